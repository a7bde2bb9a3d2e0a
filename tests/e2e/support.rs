//! One test's world: a temp dir with a document root, a PKI and a leaf certificate;
//! and what several test files start or run the same way (a second webship as an
//! origin, an HTTP/3 passthrough front, aioquic, `webship stats`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use rustls::ClientConfig;
use serde_json::Value;
use webship_tests::client::{curl, fetch, Fetched, Proto};
pub(crate) use webship_tests::origin::pattern;
use webship_tests::{webship, Pki, Server};

pub(crate) const HOST: &str = "files.test";
pub(crate) const MIB: u64 = 1024 * 1024;

pub(crate) struct Env {
    pub dir: tempfile::TempDir,
    pub root: PathBuf,
    pub pki: Pki,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Env {
    pub(crate) fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir(&root).unwrap();
        let pki = Pki::new(dir.path()).unwrap();
        let leaf = pki.leaf("files", &[HOST, "localhost"]).unwrap();
        Self {
            dir,
            root,
            pki,
            cert: leaf.cert,
            key: leaf.key,
        }
    }

    /// One site, `HOST`, on `root`, with `extra` TOML appended.
    pub(crate) fn config(&self, extra: &str) -> String {
        format!(
            "listen = \"127.0.0.1:{{port}}\"\nworkers = 2\n\n{extra}\n\n[[sites]]\ndomain = \"{HOST}\"\nroot = \"{}\"\n[sites.tls]\ncert = \"{}\"\nkey = \"{}\"\n",
            self.root.display(),
            self.cert.display(),
            self.key.display()
        )
    }

    pub(crate) fn start(&self, extra: &str) -> Server {
        Server::start(self.dir.path(), &self.config(extra))
    }

    /// A client that trusts this PKI and offers `alpn`.
    pub(crate) fn client(&self, alpn: &[u8]) -> Arc<ClientConfig> {
        self.pki.client(&[alpn]).unwrap()
    }

    /// A leaf for `names` from this PKI: (certificate, key) files named after `name`.
    pub(crate) fn leaf(&self, name: &str, names: &[&str]) -> (PathBuf, PathBuf) {
        let leaf = self.pki.leaf(name, names).unwrap();
        (leaf.cert, leaf.key)
    }

    /// The CA certificate as a PEM file.
    pub(crate) fn ca_file(&self) -> PathBuf {
        self.pki.ca_file().unwrap()
    }

    /// One GET to `server` for `HOST` over `proto`, verified against this PKI.
    pub(crate) async fn get(
        &self,
        proto: Proto,
        server: &Server,
        path: &str,
        headers: &[(&str, &str)],
    ) -> Fetched {
        fetch(
            proto,
            server.addr(),
            HOST,
            self.client(proto.alpn()),
            "GET",
            path,
            headers,
        )
        .await
    }

    pub(crate) fn write(&self, name: &str, contents: &[u8]) -> PathBuf {
        let path = self.root.join(name);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).unwrap();
        }
        std::fs::write(&path, contents).unwrap();
        path
    }
}

/// A binary upgrade's successor configuration for `env`'s site, written to `dir`
/// (a root of its own, whose `which.txt` says "new"): listening on `port`, with
/// `control` as control socket and `extra` before `[[sites]]`. Returns its path.
pub(crate) fn successor_config(env: &Env, dir: &Path, port: u16, control: &Path, extra: &str) -> PathBuf {
    let root = dir.join("root");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::write(root.join("which.txt"), b"new").unwrap();
    let config = format!(
        "listen = \"127.0.0.1:{port}\"\nworkers = 2\ncontrol_socket = \"{}\"\n{extra}\n[[sites]]\ndomain = \"{HOST}\"\nroot = \"{}\"\n[sites.tls]\ncert = \"{}\"\nkey = \"{}\"\n",
        control.display(),
        root.display(),
        env.cert.display(),
        env.key.display()
    );
    let path = dir.join("webship.toml");
    std::fs::write(&path, config).unwrap();
    path
}

/// Starts a binary upgrade's successor to the daemon on `port` with `config` (its
/// `{port}` replaced), written to `dir`, without waiting.
pub(crate) fn take_over_with(dir: &Path, config: &str, port: u16) -> Server {
    let path = dir.join("webship.toml");
    std::fs::write(&path, config.replace("{port}", &port.to_string())).unwrap();
    Server::take_over(dir, &path, port)
}

/// Fetches `path` over HTTP/3 with aioquic (`clients/h3_fetch.py`) from the server
/// on loopback `port` as `sni`, trusting `ca`; its one-line JSON report
/// (status, headers, len, sha256) and the line itself, for messages.
pub(crate) fn aioquic_fetch(
    port: u16,
    sni: &str,
    path: &str,
    ca: &Path,
    headers: &[&str],
) -> (Value, String) {
    let out = Command::new("python3")
        .args([
            concat!(env!("CARGO_MANIFEST_DIR"), "/clients/h3_fetch.py"),
            "127.0.0.1",
            &port.to_string(),
            sni,
            path,
            ca.to_str().unwrap(),
        ])
        .args(headers)
        .output()
        .expect("python3 with aioquic is required; `cargo xtask test` installs it");
    assert!(
        out.status.success(),
        "aioquic: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
    (value, line)
}

/// A second webship serving `domain` from `root` directly, with a certificate of
/// its own from this PKI: an origin behind a passthrough front. `kernel` and
/// `site` are TOML appended before the site and inside it.
pub(crate) fn origin_server(
    env: &Env,
    name: &str,
    domain: &str,
    root: &Path,
    kernel: &str,
    site: &str,
) -> Server {
    let (cert, key) = env.leaf(name, &[domain]);
    Server::start(
        env.dir.path(),
        &format!(
            "listen = \"127.0.0.1:{{port}}\"\nworkers = 2\n{kernel}[[sites]]\ndomain = \"{domain}\"\nroot = \"{}\"\n[sites.tls]\ncert = \"{}\"\nkey = \"{}\"\n{site}",
            root.display(),
            cert.display(),
            key.display()
        ),
    )
}

/// The TOML of a front passing TLS through, without its `listen` line: counter
/// maps pinned in a folder of this server's own (so tests run side by side),
/// `settings` added to `[reverse_proxy]` (engines, the UDP upstream), HTTP/3 on or
/// off, and one route per `(domain, upstream)`.
pub(crate) fn passthrough_toml(settings: &str, h3: bool, routes: &[(&str, SocketAddr)]) -> String {
    let mut toml = format!(
        "\n[kernel]\nbpf_pin_dir = \"/sys/fs/bpf/webship-e2e-{{port}}\"\n\n\
         [reverse_proxy]\nenabled = true\ntls_termination = false\n{settings}\
         [reverse_proxy.protocols]\nh1 = true\nh2 = true\nh3 = {h3}\n"
    );
    for (domain, upstream) in routes {
        toml.push_str(&format!(
            "[[reverse_proxy.routes]]\ndomain = \"{domain}\"\nupstreams = [\"{upstream}\"]\n"
        ));
    }
    toml
}

/// A whole passthrough front's configuration: [`passthrough_toml`] on a free port.
pub(crate) fn passthrough_config(settings: &str, h3: bool, routes: &[(&str, SocketAddr)]) -> String {
    format!(
        "listen = \"127.0.0.1:{{port}}\"\nworkers = 2\n{}",
        passthrough_toml(settings, h3, routes)
    )
}

/// [`passthrough_config`] with `control` as its control socket (a takeover's old
/// process).
pub(crate) fn passthrough_config_with_control(
    settings: &str,
    h3: bool,
    routes: &[(&str, SocketAddr)],
    control: &Path,
) -> String {
    passthrough_config(settings, h3, routes).replace(
        "workers = 2\n",
        &format!("workers = 2\ncontrol_socket = \"{}\"\n", control.display()),
    )
}

/// A front passing TLS and QUIC for `a.pass` through to `origin` (TCP and UDP),
/// its UDP side carried by `udp_engine`.
pub(crate) fn h3_passthrough_front(env: &Env, origin: SocketAddr, udp_engine: &str) -> Server {
    let udp = format!("udp_upstream = \"{origin}\"\nudp_engine = \"{udp_engine}\"\n");
    Server::start(
        env.dir.path(),
        &passthrough_config(&udp, true, &[("a.pass", origin)]),
    )
}

/// `webship stats --json` for the maps pinned at `pins`.
pub(crate) fn stats_json(pins: &str) -> Value {
    let out = webship(&["stats", "--json", "--pin-dir", pins], Path::new("/"));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The server's resident memory is under `base` plus `mib` MiB: what it holds for
/// connections and responses that are gone (or going) was given back.
pub(crate) fn assert_rss_within(server: &Server, base: u64, mib: u64) {
    let rss = server.rss();
    assert!(
        rss < base + mib * MIB,
        "RSS {} MiB vs baseline {} MiB",
        rss / MIB,
        base / MIB
    );
}

/// curl downloads `url` over `flag` (`--http1.1`, `--http2`) into `out`, trusting
/// `ca`, with `host` resolved to the server on `port`; it must succeed. Returns
/// what `-w write_out` printed.
pub(crate) fn curl_download(
    host: &str,
    port: u16,
    ca: &Path,
    flag: &str,
    url: &str,
    out: &Path,
    write_out: &str,
) -> String {
    let result = curl(
        host,
        port,
        &[
            "--cacert",
            ca.to_str().unwrap(),
            flag,
            "-o",
            out.to_str().unwrap(),
            "-w",
            write_out,
            url,
        ],
    );
    assert!(
        result.status.success(),
        "curl {flag}: {}",
        String::from_utf8_lossy(&result.stderr)
    );
    String::from_utf8_lossy(&result.stdout).into_owned()
}

/// The header block (HPACK literals) of a GET for `path` on `HOST`, for the raw
/// HTTP/2 client.
pub(crate) fn h2_get(path: &str) -> Vec<u8> {
    webship_testkit::h2raw::block(&[
        (":method", "GET"),
        (":scheme", "https"),
        (":authority", HOST),
        (":path", path),
    ])
}
