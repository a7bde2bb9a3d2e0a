//! `get`: the HTTP/1.1 and HTTP/2 download client of the h1/h2 cells.
//!
//! The runner starts it as a child process of its own binary, exactly where it
//! starts `h3-get` for h3, so the client's CPU is never counted as server CPU
//! and both clients are measured the same way. One GET on a fresh TCP
//! connection, over TLS (rustls with aws-lc-rs, the bench CA as the only root)
//! or, for the plain-HTTP baseline, without it, through the test kit's client
//! sized for bulk downloads ([`Tuning::BULK`]). The body is compared with the
//! fixture byte for byte as it arrives ([`FixtureCheck`]) and dropped, never
//! buffered whole. The time runs from before the TCP connect to the last body
//! byte; what a process pays once (the TLS configuration, seeding aws-lc's
//! random generator, about 40 ms of CPU jitter sampling) is done before it.
//! Output, on stdout, as `h3-get`'s:
//!
//! ```text
//! <bytes> <seconds> <status>
//! exact | <how the body differs from the fixture>
//! <transport notes>
//! ```
//!
//! Nagle is off.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{anyhow, ensure, Context, Result};
use clap::{Args, ValueEnum};
use tokio::net::TcpStream;
use webship_testkit::body::FixtureCheck;
use webship_testkit::fixture::FIXTURE_LEN;
use webship_testkit::http::{tls, Conn, Proto, Tuning};
use webship_testkit::pki::{client_config, roots_from_pem};

use crate::clients::{run_client, Download};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Http {
    H1,
    H2,
}

#[derive(Debug, Args)]
pub(crate) struct GetArgs {
    /// Server TCP address, e.g. 127.0.0.1:8443.
    #[arg(long)]
    pub addr: SocketAddr,
    /// TLS server name and request authority.
    #[arg(long, default_value = "localhost")]
    pub host: String,
    /// Request path, e.g. /fixture.bin.
    #[arg(long)]
    pub path: String,
    #[arg(long, value_enum)]
    pub http: Http,
    /// PEM file with the certificate(s) to trust; nothing else is trusted.
    /// Without it the request goes out as plain HTTP/1.1 (the baseline).
    #[arg(long)]
    pub ca: Option<PathBuf>,
    /// Upper bound for the whole download, handshake included.
    #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub max_time: u64,
    /// Also hash the body and report its SHA-256 (the untimed download per cell).
    #[arg(long)]
    pub sha256: bool,
    /// The body expected: the fixture's first LEN bytes (the whole fixture by default).
    #[arg(long, default_value_t = FIXTURE_LEN)]
    pub len: u64,
}

pub(crate) fn run(args: &GetArgs) -> Result<()> {
    run_client(&format!("get {}", args.addr), args.max_time, get(args))
}

/// Seeds aws-lc's random generator, whose first use samples CPU jitter for tens
/// of milliseconds: paid once per process, so not inside the timed download.
pub(crate) fn warm_up_rng() -> Result<()> {
    aws_lc_rs::rand::fill(&mut [0u8; 32]).map_err(|_| anyhow!("aws-lc's random generator failed"))
}

async fn get(args: &GetArgs) -> Result<Download> {
    let authority = format!("{}:{}", args.host, args.addr.port());
    let proto = match args.http {
        Http::H1 => Proto::H1,
        Http::H2 => Proto::H2,
    };
    let config = match &args.ca {
        Some(ca) => Some(client_config(
            roots_from_pem(ca)?,
            rustls::DEFAULT_VERSIONS,
            &[proto.alpn()],
        )?),
        None => None,
    };
    warm_up_rng()?;
    let start = Instant::now();
    let tcp = TcpStream::connect(args.addr)
        .await
        .with_context(|| format!("connecting to {}", args.addr))?;
    tcp.set_nodelay(true).context("TCP_NODELAY")?;
    let (mut conn, notes) = match config {
        None => {
            ensure!(proto == Proto::H1, "plain HTTP is measured over HTTP/1.1 only");
            let conn = Conn::handshake(tcp, proto, &authority, Tuning::BULK).await?;
            (conn, "plain HTTP/1.1 (no TLS)".to_owned())
        }
        Some(config) => {
            let tls = tls(tcp, &args.host, config)
                .await
                .with_context(|| format!("TLS handshake with {}", args.addr))?;
            let notes = tls_notes(tls.get_ref().1, proto, args.addr)?;
            (
                Conn::handshake(tls, proto, &authority, Tuning::BULK).await?,
                notes,
            )
        }
    };
    let mut check = FixtureCheck::new(args.sha256);
    let head = conn
        .fetch_into("GET", &args.path, &[], &mut check)
        .await
        .with_context(|| format!("after {} bytes", check.len()))?;
    let seconds = start.elapsed().as_secs_f64();
    conn.close().await;
    Ok(Download::checked(head.status, seconds, check, args.len, notes))
}

/// The TLS version, cipher suite and ALPN; an error if h2 was asked for and not
/// negotiated, so that a silent fallback to HTTP/1.1 cannot pass as an h2 result.
fn tls_notes(session: &rustls::ClientConnection, proto: Proto, addr: SocketAddr) -> Result<String> {
    let alpn = session
        .alpn_protocol()
        .map(|p| String::from_utf8_lossy(p).into_owned());
    if proto == Proto::H2 {
        ensure!(
            alpn.as_deref() == Some("h2"),
            "{addr}: ALPN {alpn:?}, expected h2"
        );
    }
    Ok(format!(
        "{:?} {:?} alpn={}",
        session
            .protocol_version()
            .context("no TLS version after the handshake")?,
        session
            .negotiated_cipher_suite()
            .context("no cipher suite after the handshake")?
            .suite(),
        alpn.as_deref().unwrap_or("none")
    ))
}
