//! Pingora as the benchmark's TLS-terminating reverse proxy: TLS 1.3 on one
//! loopback port (h2 and HTTP/1.1 by ALPN), every request forwarded over plain
//! HTTP/1.1 to one origin, as the other proxy peers are configured. Nothing else:
//! no cache, no load balancing, no header rewriting beyond Pingora's own.
//!
//! Started by `webship-benches` with
//! `pingora-proxy --listen ADDR --origin ADDR --cert PEM --key PEM --threads N --dir DIR`
//! (`--version` prints the Pingora release);
//! SIGTERM stops it (Pingora's graceful shutdown, shortened to a second).

use std::process::ExitCode;

use async_trait::async_trait;
use pingora_core::listeners::tls::TlsSettings;
use pingora_core::server::configuration::ServerConf;
use pingora_core::server::Server;
use pingora_core::tls::ssl::SslVersion;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_proxy::{ProxyHttp, Session};

/// The command line; every option is required.
#[derive(Debug)]
struct Args {
    listen: String,
    origin: std::net::SocketAddr,
    cert: String,
    key: String,
    threads: usize,
    /// Pid file and upgrade socket go here, so two instances never share them.
    dir: String,
}

impl Args {
    fn parse(mut raw: impl Iterator<Item = String>) -> Result<Self, String> {
        let (mut listen, mut origin, mut cert, mut key, mut threads, mut dir) =
            (None, None, None, None, None, None);
        while let Some(flag) = raw.next() {
            let value = raw.next().ok_or_else(|| format!("{flag} needs a value"))?;
            let slot = match flag.as_str() {
                "--listen" => &mut listen,
                "--origin" => &mut origin,
                "--cert" => &mut cert,
                "--key" => &mut key,
                "--threads" => &mut threads,
                "--dir" => &mut dir,
                _ => return Err(format!("unknown option {flag}")),
            };
            *slot = Some(value);
        }
        let need = |v: Option<String>, name: &str| v.ok_or_else(|| format!("--{name} is required"));
        Ok(Self {
            listen: need(listen, "listen")?,
            origin: need(origin, "origin")?
                .parse()
                .map_err(|e| format!("--origin: {e}"))?,
            cert: need(cert, "cert")?,
            key: need(key, "key")?,
            threads: need(threads, "threads")?
                .parse()
                .map_err(|e| format!("--threads: {e}"))?,
            dir: need(dir, "dir")?,
        })
    }
}

/// Every request goes to the one plain-HTTP origin; the client's Host is kept.
#[derive(Debug)]
struct Origin(std::net::SocketAddr);

#[async_trait]
impl ProxyHttp for Origin {
    type CTX = ();

    fn new_ctx(&self) {}

    async fn upstream_peer(
        &self,
        _session: &mut Session,
        _ctx: &mut (),
    ) -> pingora_core::Result<Box<HttpPeer>> {
        Ok(Box::new(HttpPeer::new(self.0, false, String::new())))
    }
}

/// The Pingora release this proxy is built from (pinned in Cargo.toml).
const PINGORA_VERSION: &str = "0.9.1";

fn main() -> ExitCode {
    if std::env::args().nth(1).as_deref() == Some("--version") {
        println!("pingora {PINGORA_VERSION} (openssl)");
        return ExitCode::SUCCESS;
    }
    let args = match Args::parse(std::env::args().skip(1)) {
        Ok(args) => args,
        Err(e) => {
            eprintln!("pingora-proxy: {e}");
            return ExitCode::from(2);
        }
    };
    let conf = ServerConf {
        threads: args.threads,
        pid_file: format!("{}/pingora.pid", args.dir),
        upgrade_sock: format!("{}/pingora-upgrade.sock", args.dir),
        // The bench stops servers between runs; no draining period to wait out.
        grace_period_seconds: Some(0),
        graceful_shutdown_timeout_seconds: Some(1),
        ..ServerConf::default()
    };
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();
    let mut tls = match TlsSettings::intermediate(&args.cert, &args.key) {
        Ok(tls) => tls,
        Err(e) => {
            eprintln!("pingora-proxy: {e}");
            return ExitCode::from(1);
        }
    };
    // TLS 1.3 only, like the other peers' configurations.
    if let Err(e) = tls.set_min_proto_version(Some(SslVersion::TLS1_3)) {
        eprintln!("pingora-proxy: TLS 1.3 minimum: {e}");
        return ExitCode::from(1);
    }
    tls.enable_h2();
    let mut proxy = pingora_proxy::http_proxy_service(&server.configuration, Origin(args.origin));
    proxy.add_tls_with_settings(&args.listen, None, tls);
    server.add_service(proxy);
    eprintln!("pingora-proxy: listening on {} -> {}", args.listen, args.origin);
    server.run_forever()
}
