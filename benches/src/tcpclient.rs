//! `get`: the HTTP/1.1 and HTTP/2 download client of the h1/h2 cells.
//!
//! The runner starts it as a child process of its own binary, exactly where it
//! starts `h3-get` for h3, so the client's CPU is never counted as server CPU
//! and both clients are measured the same way. One GET on a fresh TCP
//! connection, over TLS (rustls with aws-lc-rs, the bench certificate as the only
//! root) or, for the plain-HTTP baseline, without it. The body is compared
//! with the fixture byte for byte as it arrives ([`Checker`]) and dropped, never
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
//! Sized so that it is not what limits a download: HTTP/2 windows far above a
//! loopback bandwidth-delay product, an HTTP/1.1 read buffer that may grow to
//! 4 MiB, Nagle off. HTTP/2's frame size stays at the protocol default (16 KiB),
//! which is what browsers advertise, so servers are compared on the framing real
//! clients get.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, bail, ensure, Context, Result};
use clap::{Args, ValueEnum};
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use crate::clients::{run_client, Download};
use crate::fixture::{Checker, FIXTURE_BYTES};

const H2_STREAM_WINDOW: u32 = 32 << 20;
const H2_CONNECTION_WINDOW: u32 = 64 << 20;
const H1_MAX_BUFFER: usize = 4 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Http {
    H1,
    H2,
}

#[derive(Debug, Args)]
pub struct GetArgs {
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
}

pub fn run(args: &GetArgs) -> Result<()> {
    run_client(&format!("get {}", args.addr), args.max_time, get(args))
}

/// Seeds aws-lc's random generator, whose first use samples CPU jitter for tens
/// of milliseconds: paid once per process, so not inside the timed download.
pub fn warm_up_rng() -> Result<()> {
    aws_lc_rs::rand::fill(&mut [0u8; 32]).map_err(|_| anyhow!("aws-lc's random generator failed"))
}

async fn get(args: &GetArgs) -> Result<Download> {
    let authority = format!("{}:{}", args.host, args.addr.port());
    let tls = match &args.ca {
        Some(ca) => Some(tls_config(ca)?),
        None => None,
    };
    warm_up_rng()?;
    let start = Instant::now();
    let tcp = TcpStream::connect(args.addr)
        .await
        .with_context(|| format!("connecting to {}", args.addr))?;
    tcp.set_nodelay(true).context("TCP_NODELAY")?;
    let Some(mut config) = tls else {
        ensure!(args.http == Http::H1, "plain HTTP is measured over HTTP/1.1 only");
        let (status, check) = exchange(tcp, Http::H1, "http", &authority, &args.path, args.sha256).await?;
        return Ok(Download {
            status,
            bytes: check.len(),
            seconds: start.elapsed().as_secs_f64(),
            verdict: check.verdict(FIXTURE_BYTES),
            notes: "plain HTTP/1.1 (no TLS)".to_owned(),
        });
    };
    config.alpn_protocols = vec![match args.http {
        Http::H1 => b"http/1.1".to_vec(),
        Http::H2 => b"h2".to_vec(),
    }];
    let name = ServerName::try_from(args.host.clone()).context("the TLS server name")?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .with_context(|| format!("TLS handshake with {}", args.addr))?;
    let (_, session) = tls.get_ref();
    let alpn = session
        .alpn_protocol()
        .map(|p| String::from_utf8_lossy(p).into_owned());
    if args.http == Http::H2 {
        // Checked so that a silent fallback to HTTP/1.1 cannot pass as an h2 result.
        ensure!(
            alpn.as_deref() == Some("h2"),
            "{}: ALPN {alpn:?}, expected h2",
            args.addr
        );
    }
    let notes = format!(
        "{:?} {:?} alpn={}",
        session
            .protocol_version()
            .context("no TLS version after the handshake")?,
        session
            .negotiated_cipher_suite()
            .context("no cipher suite after the handshake")?
            .suite(),
        alpn.as_deref().unwrap_or("none")
    );
    let (status, check) = exchange(tls, args.http, "https", &authority, &args.path, args.sha256).await?;
    Ok(Download {
        status,
        bytes: check.len(),
        seconds: start.elapsed().as_secs_f64(),
        verdict: check.verdict(FIXTURE_BYTES),
        notes,
    })
}

/// One GET over `io`; returns the status and the body's check against the fixture.
async fn exchange<T>(
    io: T,
    http: Http,
    scheme: &str,
    authority: &str,
    path: &str,
    sha256: bool,
) -> Result<(u16, Checker)>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let io = TokioIo::new(io);
    let uri = format!("{scheme}://{authority}{path}");
    let (response, driver) = match http {
        Http::H1 => {
            let mut builder = hyper::client::conn::http1::Builder::new();
            builder.max_buf_size(H1_MAX_BUFFER);
            let (mut send, conn) = builder.handshake(io).await.context("HTTP/1.1 setup")?;
            let driver = tokio::spawn(conn);
            // Origin form (`GET /path`), as browsers and curl send it; the absolute
            // form is for proxies, and some servers (h2o) answer it with 404.
            let request = http::Request::get(path)
                .header(http::header::HOST, authority)
                .body(Empty::<Bytes>::new())?;
            (send.send_request(request).await, driver)
        }
        Http::H2 => {
            let (mut send, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
                .initial_stream_window_size(H2_STREAM_WINDOW)
                .initial_connection_window_size(H2_CONNECTION_WINDOW)
                .handshake(io)
                .await
                .context("HTTP/2 setup")?;
            let driver = tokio::spawn(conn);
            let request = http::Request::get(&uri)
                .version(http::Version::HTTP_2)
                .body(Empty::<Bytes>::new())?;
            (send.send_request(request).await, driver)
        }
    };
    let response = response.with_context(|| format!("GET {uri}"))?;
    let want = match http {
        Http::H1 => http::Version::HTTP_11,
        Http::H2 => http::Version::HTTP_2,
    };
    ensure!(
        response.version() == want,
        "GET {uri}: answered in {:?}, expected {want:?}",
        response.version()
    );
    let status = response.status().as_u16();
    let mut body = response.into_body();
    let mut check = if sha256 {
        Checker::with_sha256()
    } else {
        Checker::default()
    };
    while let Some(frame) = body.frame().await {
        let frame =
            frame.with_context(|| format!("GET {uri}: reading the body after {} bytes", check.len()))?;
        if let Ok(data) = frame.into_data() {
            check.update(&data);
        }
    }
    driver.abort();
    Ok((status, check))
}

/// TLS 1.2 and 1.3 with aws-lc-rs, the certificates in `ca` as the only roots.
pub fn tls_config(ca: &Path) -> Result<rustls::ClientConfig> {
    // An explicit provider: this crate enables both ring and aws-lc-rs (for the
    // `aead` comparison), so rustls has no single default to pick.
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS versions with the aws-lc-rs provider")?
        .with_root_certificates(roots(ca)?)
        .with_no_client_auth())
}

/// The certificates in `ca` as a root store; an error if it holds none.
pub fn roots(ca: &Path) -> Result<rustls::RootCertStore> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca).with_context(|| format!("reading {}", ca.display()))? {
        roots
            .add(cert.with_context(|| format!("parsing {}", ca.display()))?)
            .with_context(|| format!("adding a root from {}", ca.display()))?;
    }
    if roots.is_empty() {
        bail!("{} holds no certificate", ca.display());
    }
    Ok(roots)
}
