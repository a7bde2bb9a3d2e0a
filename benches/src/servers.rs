//! Starting and stopping the servers under test.
//!
//! Each server is a child process owned by the test kit's process guard, so it
//! is stopped on every exit path, errors included: SIGTERM first (every server
//! here finishes cleanly on it), SIGKILL for the whole process tree after a
//! timeout. Each starts on a port chosen here, retried if another process takes
//! it first. A Webship instance's eBPF pin folder is removed once it has stopped,
//! unless some process still holds it ([`webship_testkit::pins::remove_own`]).

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use webship_testkit::fixture::file::Fixture;
use webship_testkit::pki::Pki;
use webship_testkit::process::{start_on_free_port, Logs, Process};

use crate::measure::{CADDY, H2O, HAPROXY, LIGHTTPD};

const READY_TIMEOUT: Duration = Duration::from_secs(15);

#[derive(Debug)]
pub(crate) struct Server {
    pub name: &'static str,
    pub port: u16,
    /// The host clients put in the URL (and so in SNI and `Host`): "127.0.0.1" for the
    /// direct cells, "localhost" for the proxies, whose route is for that domain.
    pub host: &'static str,
    /// Plain HTTP, no TLS: the baseline origin.
    pub plain: bool,
    process: Process,
    /// Fetches the admin listener's `/metrics` every second (`webship scraped`).
    scraper: Option<Scraper>,
    /// A Webship instance's eBPF pin folder (`bpf_pin_dir`).
    pins: Option<PathBuf>,
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.pins.is_none() {
            return;
        }
        // Stopped first: a daemon that stops cleanly removes its folder itself, and
        // holds it until it has exited.
        if let Err(e) = self.process.stop() {
            eprintln!("stopping {} (pid {}): {e:#}", self.name, self.pid());
        }
        if let Some(pins) = &self.pins {
            webship_testkit::pins::remove_own(pins);
        }
    }
}

impl Server {
    pub(crate) fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Everything the server wrote to stdout and stderr so far.
    pub(crate) fn log(&self) -> String {
        self.process.log()
    }

    pub(crate) fn log_tail(&self) -> String {
        self.process.log_tail()
    }
}

/// Starts a server on a free port: `command(port)` writes its configuration and
/// returns the command line; ready once the port accepts TCP connections and, with
/// `ready_line`, once that fragment is logged (Webship binds UDP for h3 after TCP,
/// so an accepting TCP port is not enough).
pub(crate) fn spawn(
    name: &'static str,
    log: PathBuf,
    ready_line: Option<&'static str>,
    mut command: impl FnMut(u16) -> Result<Command>,
) -> Result<Server> {
    let (process, port) = start_on_free_port(ready_line, READY_TIMEOUT, |port| {
        Process::spawn(name, &mut command(port)?, Logs::one(log.clone()))
    })?;
    Ok(Server {
        name,
        port,
        host: "127.0.0.1",
        plain: false,
        process,
        scraper: None,
        pins: None,
    })
}

/// A scraper on its own thread: `GET /metrics` every second on one admin listener,
/// as Prometheus with a 1 s interval would; stopped and joined when dropped. Its CPU
/// is this runner's, never the server's.
#[derive(Debug)]
pub(crate) struct Scraper {
    stop: Arc<AtomicBool>,
    scrapes: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Scraper {
    fn start(admin: u16) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let scrapes = Arc::new(AtomicU64::new(0));
        let (halt, count) = (stop.clone(), scrapes.clone());
        let thread = std::thread::spawn(move || {
            while !halt.load(Ordering::Relaxed) {
                if scrape_once(admin).is_ok_and(|ok| ok) {
                    count.fetch_add(1, Ordering::Relaxed);
                }
                // Bounded by the stop flag: checked every 100 ms.
                for _ in 0..10 {
                    if halt.load(Ordering::Relaxed) {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        });
        Self {
            stop,
            scrapes,
            thread: Some(thread),
        }
    }
}

/// One `GET /metrics`: whether it answered 200 with a body.
fn scrape_once(port: u16) -> std::io::Result<bool> {
    use std::io::{Read, Write};
    let mut tcp = std::net::TcpStream::connect(("127.0.0.1", port))?;
    tcp.set_read_timeout(Some(Duration::from_secs(2)))?;
    tcp.write_all(b"GET /metrics HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")?;
    let mut response = Vec::new();
    tcp.take(1 << 22).read_to_end(&mut response)?;
    Ok(response.starts_with(b"HTTP/1.1 200") && response.len() > 1000)
}

impl Drop for Scraper {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Server {
    /// Scrapes done so far (0 without a scraper).
    pub(crate) fn scrapes(&self) -> u64 {
        self.scraper
            .as_ref()
            .map_or(0, |s| s.scrapes.load(Ordering::Relaxed))
    }
}

/// The certificate every server presents (for localhost and 127.0.0.1), issued by
/// the test kit's private CA, which is all the clients trust.
#[derive(Debug)]
pub(crate) struct Identity {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The CA certificate, PEM.
    pub ca: PathBuf,
}

pub(crate) fn write_identity(dir: &Path) -> Result<Identity> {
    let pki = Pki::new(dir)?;
    let leaf = pki.leaf("server", &["localhost", "127.0.0.1"])?;
    Ok(Identity {
        cert: leaf.cert,
        key: leaf.key,
        ca: pki.ca_file()?,
    })
}

/// What a run serves from: a scratch directory (removed when dropped), the
/// fixture in the served root, and the identity every server presents.
#[derive(Debug)]
pub(crate) struct Stage {
    pub scratch: tempfile::TempDir,
    pub root: PathBuf,
    pub fixture: Fixture,
    pub identity: Identity,
}

impl Stage {
    /// The root is `root` when given (a cache kept between runs), else in the scratch
    /// directory.
    pub(crate) fn new(root: Option<&Path>) -> Result<Self> {
        let scratch = tempfile::Builder::new()
            .prefix("webship-bench-")
            .tempdir()
            .context("creating a scratch directory")?;
        let root = root.map_or_else(|| scratch.path().join("root"), Path::to_path_buf);
        let fixture = webship_testkit::fixture::file::ensure(&root)?;
        let identity = write_identity(scratch.path())?;
        Ok(Self {
            scratch,
            root,
            fixture,
            identity,
        })
    }

    /// A fresh directory for one server's configuration and logs.
    pub(crate) fn dir(&self, name: &str) -> Result<PathBuf> {
        let dir = self.scratch.path().join(name);
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(dir)
    }
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Settings<'a> {
    pub root: &'a Path,
    pub identity: &'a Identity,
    pub workers: u32,
    /// Per-server scratch space: configs, logs, pid and temp files.
    pub dir: &'a Path,
    /// `Some(n)`: the server must hold `n` connections that send nothing for minutes
    /// (the `connections` scenario): connection limits sized to fit them, idle and
    /// first-request timeouts of [`HOLD_TIMEOUT_SECS`]. `None`: each server's own
    /// defaults, as an operator would start it.
    pub hold: Option<u32>,
}

/// The idle and first-request timeout of every server holding idle connections: far
/// beyond one measurement (open, settle, timed downloads), so no server closes them
/// while they are counted.
pub(crate) const HOLD_TIMEOUT_SECS: u32 = 900;
/// Connections a server holding idle ones allows beyond them: the timed downloads'.
pub(crate) const HOLD_MARGIN: u32 = 200;

impl Settings<'_> {
    /// Connections a server must allow: what it holds plus room for the timed
    /// downloads ([`HOLD_MARGIN`]); 1024 without `hold`.
    fn connection_cap(&self) -> u32 {
        self.hold.map_or(1024, |n| n + HOLD_MARGIN)
    }
}

/// One Webship instance: h1, h2 and h3 (UDP, same port), plus `[runtime.settings]`.
#[derive(Debug)]
pub(crate) struct WebshipSpec<'a> {
    pub name: &'static str,
    pub binary: &'a Path,
    pub ktls: &'a str,
    /// `[runtime.settings]` entries (name, value); Webship's defaults apply to the rest.
    pub runtime: Vec<(&'static str, String)>,
    /// Start the admin listener on a free loopback port and scrape its `/metrics`
    /// every second while the server runs.
    pub scraped: bool,
}

pub(crate) fn start_webship(spec: &WebshipSpec<'_>, s: &Settings<'_>) -> Result<Server> {
    let serve = format!(
        "root = {root:?}\n\n[tls]\ncert = {cert:?}\nkey = {key:?}\n",
        root = s.root,
        cert = s.identity.cert,
        key = s.identity.key,
    );
    launch_webship(spec, s, &serve)
}

/// [`start_webship`] with `[tls] ticket_keys` when `ticket_keys` is given (the
/// `tickets` scenario).
pub(crate) fn start_webship_tickets(
    spec: &WebshipSpec<'_>,
    s: &Settings<'_>,
    ticket_keys: Option<&Path>,
) -> Result<Server> {
    let keys = ticket_keys.map_or_else(String::new, |p| format!("ticket_keys = {p:?}\n"));
    let serve = format!(
        "root = {root:?}\n\n[tls]\ncert = {cert:?}\nkey = {key:?}\n{keys}",
        root = s.root,
        cert = s.identity.cert,
        key = s.identity.key,
    );
    launch_webship(spec, s, &serve)
}

/// Webship serving the fixture directly and the WebTransport diagnostic endpoint at
/// `/wt` (origin `https://bench.webship`), with limits far above what a run moves.
pub(crate) fn start_webship_webtransport(spec: &WebshipSpec<'_>, s: &Settings<'_>) -> Result<Server> {
    let serve = format!(
        "root = {root:?}\n\n[tls]\ncert = {cert:?}\nkey = {key:?}\n\n\
         [webtransport]\npath = \"/wt\"\nallowed_origins = [\"https://bench.webship\"]\n\
         modes = [\"source\"]\nmax_sessions = 64\nmax_datagram_bytes = 1400\n\
         max_datagrams_per_sec = 10000000\nmax_session_bytes = 17179869184\n",
        root = s.root,
        cert = s.identity.cert,
        key = s.identity.key,
    );
    launch_webship(spec, s, &serve)
}

/// Webship as a TLS-terminating reverse proxy for `localhost`, every path forwarded
/// to the plain-HTTP origin on `origin_port`. The proxy site speaks h1 (through
/// hyper), h2 and h3 on one port, like the direct site.
pub(crate) fn start_webship_proxy(
    spec: &WebshipSpec<'_>,
    s: &Settings<'_>,
    origin_port: u16,
) -> Result<Server> {
    let serve = format!(
        "[reverse_proxy]\nenabled = true\ntls_termination = true\n\n\
         [reverse_proxy.tls]\ncert = {cert:?}\nkey = {key:?}\n\n\
         [[reverse_proxy.routes]]\ndomain = \"localhost\"\npath_prefix = \"/\"\n\
         upstreams = [\"127.0.0.1:{origin_port}\"]\n{per_upstream}",
        cert = s.identity.cert,
        key = s.identity.key,
        // Holding many slow downloads: one upstream connection each, like the peers.
        per_upstream = s
            .hold
            .map(|_| format!("max_connections_per_upstream = {}\n", s.connection_cap()))
            .unwrap_or_default(),
    );
    let mut server = launch_webship(spec, s, &serve)?;
    server.host = "localhost";
    Ok(server)
}

/// Webship passing TLS through, by SNI `localhost`, to the TLS origin on
/// `origin_port` (TCP for h1/h2, UDP for h3), with the given engine ("auto",
/// "sockmap", "splice", "copy", or "udp=userspace" for the userspace UDP relay).
/// Its counter maps are pinned in a folder of its own.
pub(crate) fn start_webship_passthrough(
    spec: &WebshipSpec<'_>,
    s: &Settings<'_>,
    origin_port: u16,
    engine: &str,
) -> Result<Server> {
    // "udp=userspace": the default TCP engine, HTTP/3 relayed by the daemon.
    let (engine, udp_engine) = match engine {
        "udp=userspace" => ("auto", "userspace"),
        tcp => (tcp, "auto"),
    };
    let serve = format!(
        "[reverse_proxy]\nenabled = true\ntls_termination = false\npassthrough_engine = {engine:?}\n\
         udp_upstream = \"127.0.0.1:{origin_port}\"\nudp_engine = {udp_engine:?}\n\
         passthrough_idle_timeout_secs = {HOLD_TIMEOUT_SECS}\n{flows}\n\
         [[reverse_proxy.routes]]\ndomain = \"localhost\"\n\
         upstreams = [\"127.0.0.1:{origin_port}\"]\n",
        // The idle h3 connections come from a few client sockets on one address.
        flows = s
            .hold
            .map(|_| format!("udp_max_flows_per_address = {}\n", s.connection_cap()))
            .unwrap_or_default(),
    );
    let mut server = launch_webship(spec, s, &serve)?;
    server.host = "localhost";
    Ok(server)
}

fn launch_webship(spec: &WebshipSpec<'_>, s: &Settings<'_>, serve: &str) -> Result<Server> {
    let config = s.dir.join("webship.toml");
    let admin = match spec.scraped {
        true => Some(webship_testkit::ports::free_port()?),
        false => None,
    };
    let serve = match admin {
        Some(port) => format!("{serve}\n[admin]\nlisten = \"127.0.0.1:{port}\"\n"),
        None => serve.to_owned(),
    };
    let serve = serve.as_str();
    let mut server = spawn(
        spec.name,
        s.dir.join("webship.log"),
        Some("listening on"),
        |port| {
            fs::write(&config, webship_config(spec, s, port, serve))?;
            let mut command = Command::new(spec.binary);
            command.arg("serve").arg("--config").arg(&config);
            Ok(command)
        },
    )?;
    server.scraper = admin.map(Scraper::start);
    let written = fs::read_to_string(&config).unwrap_or_default();
    server.pins = webship_testkit::pins::pin_dir_of(&written).map(Path::to_path_buf);
    Ok(server)
}

/// `serve`: what the instance serves (a root with its `[tls]`, or a `[reverse_proxy]`).
fn webship_config(spec: &WebshipSpec<'_>, s: &Settings<'_>, port: u16, serve: &str) -> String {
    let mut config = format!(
        "listen = \"127.0.0.1:{port}\"\nworkers = {workers}\n{serve}\n\
         [kernel]\nktls = {ktls:?}\nbbr = \"auto\"\nbpf_pin_dir = \"/sys/fs/bpf/webship-bench-{port}\"\n",
        workers = s.workers,
        ktls = spec.ktls,
    );
    if s.hold.is_some() {
        let _ = write!(
            config,
            "\n[limits]\nmax_connections = {}\nidle_timeout_secs = {HOLD_TIMEOUT_SECS}\n",
            s.connection_cap()
        );
    }
    if !spec.runtime.is_empty() {
        config.push_str("\n[runtime.settings]\n");
        for (name, value) in &spec.runtime {
            let _ = writeln!(config, "{name} = {value:?}");
        }
    }
    config
}

/// The memory-to-memory TLS baseline: this binary's `tls-source`, serving `file`
/// from memory over TLS 1.3 (h1 and h2 by ALPN).
pub(crate) fn start_tls_source(name: &'static str, s: &Settings<'_>, file: &Path) -> Result<Server> {
    let exe = std::env::current_exe().context("locating this executable")?;
    spawn(
        name,
        s.dir.join("tls-source.log"),
        Some("from memory on"),
        |port| {
            let mut command = Command::new(&exe);
            command
                .args(["tls-source", "--port", &port.to_string(), "--cert"])
                .arg(&s.identity.cert)
                .arg("--key")
                .arg(&s.identity.key)
                .arg("--file")
                .arg(file);
            Ok(command)
        },
    )
}

pub(crate) fn start_nginx(binary: &Path, s: &Settings<'_>) -> Result<Server> {
    launch_nginx("nginx", binary, s, |port| {
        let mut server = String::new();
        tls_server(&mut server, port, s)?;
        writeln!(server, "    root {};\n  }}", s.root.display())?;
        Ok(server)
    })
}

/// The proxies' origin: nginx serving `root` over plain HTTP on loopback, one
/// worker, keep-alive connections reused for as long as the proxies like.
/// `hold`: as [`Settings::hold`], when the proxies in front hold that many slow downloads.
pub(crate) fn start_origin(
    name: &'static str,
    binary: &Path,
    root: &Path,
    dir: &Path,
    hold: Option<u32>,
) -> Result<Server> {
    let origin_settings = Settings {
        root,
        identity: &Identity {
            cert: PathBuf::new(),
            key: PathBuf::new(),
            ca: PathBuf::new(),
        },
        workers: 1,
        dir,
        hold,
    };
    let mut origin = launch_nginx(name, binary, &origin_settings, |port| {
        let mut server = String::new();
        writeln!(server, "  keepalive_requests 100000;")?;
        writeln!(server, "  server {{\n    listen 127.0.0.1:{port};")?;
        writeln!(server, "    root {};\n  }}", root.display())?;
        Ok(server)
    })?;
    origin.plain = true;
    Ok(origin)
}

/// nginx as the TLS-terminating proxy in front of the origin on `origin_port`,
/// with the settings nginx documents for relaying large responses: HTTP/1.1 to
/// the upstream with `Connection` cleared so the `keepalive` pool reuses
/// connections; buffering on with 16 × 64k buffers (`proxy_buffer_size` 64k for
/// the header); `proxy_max_temp_file_size 0`, so a response larger than the
/// buffers is relayed synchronously through them and never spooled to disk.
pub(crate) fn start_nginx_proxy(binary: &Path, s: &Settings<'_>, origin_port: u16) -> Result<Server> {
    let mut nginx = launch_nginx("nginx", binary, s, |port| {
        let mut server = String::new();
        writeln!(
            server,
            "  upstream origin {{\n    server 127.0.0.1:{origin_port};\n    keepalive 32;\n  }}"
        )?;
        tls_server(&mut server, port, s)?;
        writeln!(server, "    location / {{")?;
        writeln!(server, "      proxy_pass http://origin;")?;
        writeln!(
            server,
            "      proxy_http_version 1.1;\n      proxy_set_header Connection \"\";"
        )?;
        writeln!(
            server,
            "      proxy_buffering on;\n      proxy_buffers 16 64k;\n      proxy_buffer_size 64k;"
        )?;
        writeln!(server, "      proxy_max_temp_file_size 0;\n    }}\n  }}")?;
        Ok(server)
    })?;
    nginx.host = "localhost";
    Ok(nginx)
}

/// The opening of a TLS server block, the same for direct delivery and the proxy.
fn tls_server(conf: &mut String, port: u16, s: &Settings<'_>) -> Result<()> {
    writeln!(conf, "  server {{")?;
    writeln!(conf, "    listen 127.0.0.1:{port} ssl http2;")?;
    writeln!(conf, "    ssl_certificate {};", s.identity.cert.display())?;
    writeln!(conf, "    ssl_certificate_key {};", s.identity.key.display())?;
    writeln!(conf, "    ssl_protocols TLSv1.3;")?;
    Ok(())
}

/// Writes `nginx.conf` in `s.dir` around the `http` block's `servers(port)` and starts nginx.
fn launch_nginx(
    name: &'static str,
    binary: &Path,
    s: &Settings<'_>,
    mut servers: impl FnMut(u16) -> Result<String>,
) -> Result<Server> {
    let dir = s.dir;
    spawn(name, dir.join("nginx.log"), None, |port| {
        let shown = dir.display();
        let connections = if s.hold.is_some() { s.connection_cap() } else { 64 };
        let mut conf = nginx_main(dir, s.workers, connections)?;
        writeln!(conf, "http {{")?;
        if s.hold.is_some() {
            // Before the first request (h1), between requests and with no stream (h2).
            writeln!(
                conf,
                "  client_header_timeout {HOLD_TIMEOUT_SECS}s;\n  keepalive_timeout {HOLD_TIMEOUT_SECS}s;"
            )?;
        }
        writeln!(
            conf,
            "  access_log off;\n  default_type application/octet-stream;"
        )?;
        writeln!(conf, "  sendfile on;\n  tcp_nopush on;")?;
        for temp in ["client_body", "proxy", "fastcgi", "uwsgi", "scgi"] {
            writeln!(conf, "  {temp}_temp_path {shown}/{temp}_temp;")?;
        }
        conf.push_str(&servers(port)?);
        writeln!(conf, "}}")?;
        nginx_command(binary, dir, &conf)
    })
}

/// Writes `conf` to `path`; then `binary ARGS path`, the configuration last.
fn with_config(binary: &Path, path: PathBuf, conf: &str, args: &[&str]) -> Result<Command> {
    fs::write(&path, conf).with_context(|| format!("writing {}", path.display()))?;
    let mut command = Command::new(binary);
    command.args(args).arg(&path);
    Ok(command)
}

/// The `global` and `defaults` sections of both HAProxy setups: `s.workers` threads,
/// 64k buffers, `mode` (tcp or http) and the same timeouts (longer when holding idle
/// connections; HAProxy sizes its open-file limit from `maxconn`).
fn haproxy_head(s: &Settings<'_>, mode: &str, global: &str) -> String {
    let (workers, maxconn) = (s.workers, s.connection_cap());
    let client = s.hold.map_or(150, |_| HOLD_TIMEOUT_SECS);
    format!(
        "global\n  nbthread {workers}\n  maxconn {maxconn}\n  tune.bufsize 65536\n{global}\
         defaults\n  mode {mode}\n  maxconn {maxconn}\n  timeout connect 5s\n  timeout client {client}s\n  \
         timeout server {client}s\n  timeout http-request {client}s\n  timeout http-keep-alive {client}s\n"
    )
}

/// The main context of every nginx here: one master plus `workers` workers, in the
/// foreground so it stays our child. Every path nginx writes is inside `dir`, so it
/// runs beside a system nginx.
fn nginx_main(dir: &Path, workers: u32, connections: u32) -> Result<String> {
    let mut conf = String::new();
    writeln!(
        conf,
        "daemon off;\nmaster_process on;\nworker_processes {workers};"
    )?;
    // Two descriptors per passthrough connection, and a margin for files and logs.
    writeln!(conf, "worker_rlimit_nofile {};", 2 * connections + 256)?;
    writeln!(conf, "pid {}/nginx.pid;\nerror_log stderr warn;", dir.display())?;
    writeln!(conf, "events {{ worker_connections {connections}; }}")?;
    Ok(conf)
}

/// Writes `conf` as `dir/nginx.conf`; nginx in the foreground with its prefix in `dir`.
fn nginx_command(binary: &Path, dir: &Path, conf: &str) -> Result<Command> {
    let config = dir.join("nginx.conf");
    fs::write(&config, conf)?;
    let mut command = Command::new(binary);
    // -e: otherwise the compiled-in error log is opened before the config is read.
    command
        .arg("-p")
        .arg(dir)
        .arg("-c")
        .arg(&config)
        .args(["-e", "stderr"]);
    Ok(command)
}

/// Where Debian's nginx keeps the dynamic `stream` module (package libnginx-mod-stream).
pub(crate) const NGINX_STREAM_MODULE: &str = "/usr/lib/nginx/modules/ngx_stream_module.so";

/// nginx passing TLS through with its `stream` module: `ssl_preread` reads the SNI
/// and a `map` picks the upstream (the documented recipe), plus a UDP server that
/// forwards every datagram to the origin's QUIC port, one session per client
/// address (nginx's UDP proxying, no QUIC awareness).
pub(crate) fn start_nginx_passthrough(binary: &Path, s: &Settings<'_>, origin_port: u16) -> Result<Server> {
    let mut server = spawn("nginx", s.dir.join("nginx.log"), None, |port| {
        let mut conf = format!("load_module {NGINX_STREAM_MODULE};\n");
        // Two connections per tunnel: the client's and the upstream's.
        conf.push_str(&nginx_main(s.dir, s.workers, 2 * s.connection_cap())?);
        writeln!(conf, "stream {{")?;
        writeln!(
            conf,
            "  map $ssl_preread_server_name $origin {{\n    localhost 127.0.0.1:{origin_port};\n    default 127.0.0.1:1;\n  }}"
        )?;
        writeln!(
            conf,
            "  server {{\n    listen 127.0.0.1:{port};\n    ssl_preread on;\n    proxy_pass $origin;\n    \
             proxy_buffer_size 256k;\n    proxy_timeout {}s;\n  }}",
            s.hold.map_or(600, |_| HOLD_TIMEOUT_SECS)
        )?;
        writeln!(
            conf,
            "  server {{\n    listen 127.0.0.1:{port} udp;\n    proxy_pass 127.0.0.1:{origin_port};\n    \
             proxy_timeout 30s;\n  }}\n}}"
        )?;
        nginx_command(binary, s.dir, &conf)
    })?;
    server.host = "localhost";
    Ok(server)
}

/// HAProxy passing TLS through: `mode tcp`, waiting for the ClientHello
/// (`tcp-request inspect-delay` + `req.ssl_hello_type`) and routing on
/// `req.ssl_sni`, as its documentation describes; one thread, 64k buffers.
pub(crate) fn start_haproxy_passthrough(binary: &Path, s: &Settings<'_>, origin_port: u16) -> Result<Server> {
    let mut server = spawn(HAPROXY, s.dir.join("haproxy.log"), None, |port| {
        let mut conf = haproxy_head(s, "tcp", "");
        writeln!(
            conf,
            "frontend fe\n  bind 127.0.0.1:{port}\n  tcp-request inspect-delay 5s\n  \
             tcp-request content accept if {{ req.ssl_hello_type 1 }}\n  \
             use_backend origin if {{ req.ssl_sni -i localhost }}"
        )?;
        writeln!(conf, "backend origin\n  server origin 127.0.0.1:{origin_port}")?;
        // -db: foreground, no daemon; stays our child.
        with_config(binary, s.dir.join("haproxy.cfg"), &conf, &["-db", "-f"])
    })?;
    server.host = "localhost";
    Ok(server)
}

/// "nginx 1.22" from `nginx -v`, for the cells nginx cannot serve.
pub(crate) fn nginx_version(binary: &Path) -> String {
    Command::new(binary)
        .arg("-v")
        .output()
        .ok()
        .and_then(|out| {
            // nginx prints "nginx version: nginx/1.22.1" on stderr.
            let text = String::from_utf8_lossy(&out.stderr).into_owned();
            let version = text.split("nginx/").nth(1)?.split_whitespace().next()?.to_owned();
            let major_minor: Vec<&str> = version.split('.').take(2).collect();
            Some(format!("nginx {}", major_minor.join(".")))
        })
        .unwrap_or_else(|| "nginx".to_owned())
}

/// lighttpd serving `root` over TLS (h1 and h2), single process (lighttpd's
/// default `server.max-worker = 0`), with the settings its documentation gives
/// for large static files: the `sendfile` network backend, and OpenSSL's kTLS
/// option so sendfile can reach the socket where the kernel offers kTLS.
pub(crate) fn start_lighttpd(binary: &Path, s: &Settings<'_>) -> Result<Server> {
    spawn(LIGHTTPD, s.dir.join("lighttpd.log"), None, |port| {
        let mut conf = String::new();
        writeln!(conf, "server.document-root = {:?}", s.root.display().to_string())?;
        writeln!(conf, "server.bind = \"127.0.0.1\"\nserver.port = {port}")?;
        writeln!(conf, "server.modules += (\"mod_openssl\")")?;
        writeln!(conf, "server.network-backend = \"sendfile\"")?;
        writeln!(conf, "server.feature-flags += (\"server.h2proto\" => \"enable\")")?;
        writeln!(conf, "server.upload-dirs = ({:?})", s.dir.display().to_string())?;
        writeln!(conf, "mimetype.assign = (\"\" => \"application/octet-stream\")")?;
        writeln!(conf, "ssl.engine = \"enable\"")?;
        writeln!(conf, "ssl.pemfile = {:?}", s.identity.cert.display().to_string())?;
        writeln!(conf, "ssl.privkey = {:?}", s.identity.key.display().to_string())?;
        writeln!(
            conf,
            "ssl.openssl.ssl-conf-cmd = (\"MinProtocol\" => \"TLSv1.3\", \"Options\" => \"KTLS\")"
        )?;
        // -D: foreground, so it stays our child; errors go to stderr (no server.errorlog).
        with_config(binary, s.dir.join("lighttpd.conf"), &conf, &["-D", "-f"])
    })
}

/// HAProxy as the TLS-terminating proxy (h1 and h2 via ALPN) in front of the
/// origin: one thread (`nbthread`, like nginx's one worker), `tune.bufsize`
/// 64k for large responses, `http-reuse always` for the origin connections.
pub(crate) fn start_haproxy(binary: &Path, s: &Settings<'_>, origin_port: u16) -> Result<Server> {
    let mut server = spawn(HAPROXY, s.dir.join("haproxy.log"), None, |port| {
        // HAProxy wants certificate and key in one PEM.
        let pem = s.dir.join("haproxy.pem");
        let mut both = fs::read_to_string(&s.identity.cert)?;
        both.push_str(&fs::read_to_string(&s.identity.key)?);
        fs::write(&pem, both)?;
        let mut conf = haproxy_head(s, "http", "  ssl-default-bind-options ssl-min-ver TLSv1.3\n");
        writeln!(
            conf,
            "frontend fe\n  bind 127.0.0.1:{port} ssl crt {} alpn h2,http/1.1\n  default_backend origin",
            pem.display()
        )?;
        writeln!(
            conf,
            "backend origin\n  http-reuse always\n  server origin 127.0.0.1:{origin_port}"
        )?;
        // -db: foreground, no daemon; stays our child.
        with_config(binary, s.dir.join("haproxy.cfg"), &conf, &["-db", "-f"])
    })?;
    server.host = "localhost";
    Ok(server)
}

/// Caddy serving `root` (`file_server`) or proxying to the origin
/// (`reverse_proxy`), with the given certificate, over h1, h2 and h3 (Caddy
/// 2.6 enables HTTP/3 by default), `GOMAXPROCS` = workers, admin endpoint off
/// and all its state inside `dir`.
pub(crate) fn start_caddy(binary: &Path, s: &Settings<'_>, origin_port: Option<u16>) -> Result<Server> {
    let mut server = spawn(CADDY, s.dir.join("caddy.log"), Some(CADDY_READY), |port| {
        caddy_command(binary, s, "127.0.0.1", port, origin_port)
    })?;
    if origin_port.is_some() {
        server.host = "localhost";
    }
    Ok(server)
}

/// What Caddy logs once it serves.
pub(crate) const CADDY_READY: &str = "serving initial configuration";

/// Caddy's command line, its Caddyfile written: bound to `bind`:`port`, serving
/// `s.root`, or proxying to `origin_port` on loopback.
pub(crate) fn caddy_command(
    binary: &Path,
    s: &Settings<'_>,
    bind: &str,
    port: u16,
    origin_port: Option<u16>,
) -> Result<Command> {
    let dir = s.dir.display();
    let mut conf = String::new();
    writeln!(
        conf,
        "{{\n  admin off\n  auto_https disable_redirects\n  storage file_system {dir}/data\n  \
         servers {{\n    protocols h1 h2 h3\n    timeouts {{\n      idle {idle}s\n    }}\n  }}\n}}",
        idle = s.hold.map_or(300, |_| HOLD_TIMEOUT_SECS)
    )?;
    writeln!(conf, ":{port} {{\n  bind {bind}")?;
    writeln!(
        conf,
        "  tls {} {}",
        s.identity.cert.display(),
        s.identity.key.display()
    )?;
    match origin_port {
        Some(origin) => writeln!(conf, "  reverse_proxy 127.0.0.1:{origin}")?,
        None => writeln!(conf, "  root * {}\n  file_server", s.root.display())?,
    }
    writeln!(conf, "}}")?;
    let caddyfile = s.dir.join("Caddyfile");
    let run = ["run", "--adapter", "caddyfile", "--config"];
    let mut command = with_config(binary, caddyfile, &conf, &run)?;
    command
        .env("GOMAXPROCS", s.workers.to_string())
        .env("HOME", s.dir)
        .env("XDG_DATA_HOME", s.dir.join("xdg-data"))
        .env("XDG_CONFIG_HOME", s.dir.join("xdg-config"));
    Ok(command)
}

/// h2o serving `root` (`file.dir`) or proxying to the origin (`proxy.reverse.url`)
/// over TLS, h1 and h2 by ALPN, with `num-threads` = workers and its temporary
/// buffers in memory. h2o 2.2 has no other large-file switches (it streams files
/// through its buffers); `proxy.preserve-host` keeps the client's Host, as the
/// other proxies do.
pub(crate) fn start_h2o(binary: &Path, s: &Settings<'_>, origin_port: Option<u16>) -> Result<Server> {
    let mut server = spawn(H2O, s.dir.join("h2o.log"), None, |port| {
        let mut conf = String::new();
        // Started as root, h2o drops to `nobody` unless told otherwise, and could then
        // not read the scratch directory.
        writeln!(conf, "user: root\nnum-threads: {}", s.workers)?;
        writeln!(conf, "max-connections: {}", s.connection_cap())?;
        if s.hold.is_some() {
            writeln!(
                conf,
                "http1-request-timeout: {HOLD_TIMEOUT_SECS}\nhttp2-idle-timeout: {HOLD_TIMEOUT_SECS}"
            )?;
        }
        // Responses bigger than its buffer go to mmap'ed temporary files (the proxy's
        // case here): on a disk-backed /tmp every sample then takes major page faults.
        if Path::new("/dev/shm").is_dir() {
            writeln!(conf, "temp-buffer-path: /dev/shm")?;
        }
        writeln!(
            conf,
            "pid-file: {:?}",
            s.dir.join("h2o.pid").display().to_string()
        )?;
        writeln!(
            conf,
            "hosts:\n  default:\n    listen:\n      host: 127.0.0.1\n      port: {port}"
        )?;
        writeln!(
            conf,
            "      ssl:\n        certificate-file: {:?}\n        key-file: {:?}\n        minimum-version: TLSv1.2",
            s.identity.cert.display().to_string(),
            s.identity.key.display().to_string()
        )?;
        writeln!(conf, "    paths:\n      \"/\":")?;
        match origin_port {
            Some(origin) => writeln!(
                conf,
                "        proxy.reverse.url: \"http://127.0.0.1:{origin}/\"\n        proxy.preserve-host: ON"
            )?,
            None => writeln!(conf, "        file.dir: {:?}", s.root.display().to_string())?,
        }
        with_config(binary, s.dir.join("h2o.conf"), &conf, &["-c"])
    })?;
    if origin_port.is_some() {
        server.host = "localhost";
    }
    Ok(server)
}

/// The first line of `binary ARGS`' output (stdout, else stderr), e.g. "lighttpd/1.4.69 (ssl)".
pub(crate) fn version_line(binary: &Path, args: &[&str]) -> String {
    Command::new(binary)
        .args(args)
        .output()
        .ok()
        .and_then(|out| {
            let text = if out.stdout.is_empty() {
                out.stderr
            } else {
                out.stdout
            };
            Some(String::from_utf8_lossy(&text).lines().next()?.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown version".to_owned())
}
