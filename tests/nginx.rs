//! Debian's nginx (`/usr/sbin/nginx`) as a plain-HTTP origin for the reverse-proxy
//! tests: a second, independent HTTP implementation serving files with sendfile, and
//! an access log that shows what reached the origin (the forwarding headers included).
//! One process (`master_process off`), configured in a temporary directory, on a free
//! loopback port; stopped (SIGTERM, then SIGKILL) when dropped, by the test kit's
//! process guard.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use webship_testkit::process::{start_on_free_port, Logs, Process};

pub const NGINX: &str = "/usr/sbin/nginx";

pub struct Nginx {
    pub addr: SocketAddr,
    process: Process,
    dir: tempfile::TempDir,
}

impl Nginx {
    /// Serves the files under `root` on a free loopback port; returns once the port
    /// accepts connections.
    pub fn start(root: &Path) -> Nginx {
        Self::start_with(root, None, false)
    }

    /// Serves `root` over TLS (h1 and h2) with the given certificate: an origin for
    /// passthrough, whose certificate the client must see.
    pub fn start_tls(root: &Path, cert: &Path, key: &Path) -> Nginx {
        Self::start_with(root, Some((cert, key)), false)
    }

    /// As [`Nginx::start_tls`], with `listen … ssl proxy_protocol`: every connection
    /// must start with a PROXY header (v1 or v2), whose addresses go to
    /// [`Nginx::proxy_protocol_log`].
    pub fn start_tls_proxy_protocol(root: &Path, cert: &Path, key: &Path) -> Nginx {
        Self::start_with(root, Some((cert, key)), true)
    }

    fn start_with(root: &Path, tls: Option<(&Path, &Path)>, proxy_protocol: bool) -> Nginx {
        assert!(
            Path::new(NGINX).exists(),
            "{NGINX} is missing (Debian package nginx-light)"
        );
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        for temp in ["client_body", "proxy", "fastcgi", "uwsgi", "scgi"] {
            std::fs::create_dir(d.join(temp)).unwrap();
        }
        // Content types are a convenience; nginx works without the Debian file.
        let mime = Path::new("/etc/nginx/mime.types");
        let types = if mime.exists() {
            format!("include {};", mime.display())
        } else {
            String::new()
        };
        let conf = |port: u16| {
            format!(
                r#"daemon off;
master_process off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log info;

events {{
    worker_connections 1024;
}}

http {{
    {types}
    default_type application/octet-stream;
    sendfile on;
    tcp_nopush on;
    client_body_temp_path {d}/client_body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    log_format origin '$request $status $body_bytes_sent "$http_host" "$http_x_forwarded_for" '
                      '"$http_x_forwarded_proto" "$http_x_forwarded_host" "$http_forwarded" "$http_via"';
    access_log {d}/access.log origin;
    log_format carried '$proxy_protocol_addr:$proxy_protocol_port>$proxy_protocol_server_addr:$proxy_protocol_server_port '
                       '$remote_addr $request $status';
    {carried_log}

    server {{
        listen 127.0.0.1:{port}{listen_tls};
        {tls_lines}
        root {root};
        keepalive_requests 10000;
    }}
}}
"#,
                d = d.display(),
                listen_tls = match (tls.is_some(), proxy_protocol) {
                    (true, true) => " ssl http2 proxy_protocol",
                    (true, false) => " ssl http2",
                    (false, _) => "",
                },
                carried_log = if proxy_protocol {
                    format!("access_log {}/carried.log carried;", d.display())
                } else {
                    String::new()
                },
                tls_lines = tls.map_or(String::new(), |(cert, key)| format!(
                    "ssl_certificate {}; ssl_certificate_key {}; ssl_protocols TLSv1.2 TLSv1.3;",
                    cert.display(),
                    key.display()
                )),
                root = root.display(),
            )
        };
        let conf_path = d.join("nginx.conf");
        let error_log = d.join("error.log");
        let (process, port) = start_on_free_port(None, Duration::from_secs(10), |port| {
            std::fs::write(&conf_path, conf(port))?;
            // `-e` so that even the messages before the config is read stay in the temp dir.
            let mut command = Command::new(NGINX);
            command
                .arg("-p")
                .arg(d)
                .arg("-c")
                .arg(&conf_path)
                .arg("-e")
                .arg(&error_log);
            let logs = Logs {
                stdout: d.join("stdout.log"),
                stderr: d.join("stderr.log"),
            };
            Process::spawn("nginx", &mut command, logs)
        })
        .unwrap_or_else(|e| {
            panic!(
                "{e:#}\nerror.log:\n{}",
                std::fs::read_to_string(&error_log).unwrap_or_default()
            )
        });
        Nginx {
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            process,
            dir,
        }
    }

    /// One line per request: `$request $status $body_bytes_sent "$http_host"
    /// "$http_x_forwarded_for" "$http_x_forwarded_proto" "$http_x_forwarded_host"
    /// "$http_forwarded" "$http_via"` (an absent header shows as `"-"`). nginx writes a
    /// line when the request ends, so it may lag a response the client already has.
    pub fn access_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("access.log")).unwrap_or_default()
    }

    /// With `proxy_protocol`: one line per request, `CLIENT:PORT>DESTINATION:PORT
    /// $remote_addr $request $status`, the first two as the PROXY header said.
    pub fn proxy_protocol_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("carried.log")).unwrap_or_default()
    }

    pub fn error_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("error.log")).unwrap_or_default()
    }

    /// The directory holding the config and logs.
    pub fn dir(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }

    pub fn pid(&self) -> u32 {
        self.process.pid()
    }
}
