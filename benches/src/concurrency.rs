//! `concurrency`: many downloads at once — 1, 16 and 256 concurrent GETs of one
//! file over a single HTTP/2 connection and a single HTTP/3 connection, and over
//! 256 HTTP/1.1 connections — giving aggregate throughput, p50/p99 time to last
//! byte and the server's peak RSS: the figures behind the `runtime.settings` advice.
//!
//! The client runs in this process on a current-thread runtime (one core, like the
//! server's one worker by default). Every body is hashed and checked; a run counts
//! only when every download was exact.

use std::fmt::Write as _;
use std::fs;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context, Result};
use bytes::Buf;
use clap::Args;
use http_body_util::BodyExt;
use rustls::pki_types::ServerName;
use sha2::{Digest, Sha256};

use crate::fixture::{self, hex};
use crate::proc::RssWatch;
use crate::report::{json_string, Section};
use crate::servers::{self, Settings, WebshipSpec};

#[derive(Debug, Args)]
pub struct ConcurrencyArgs {
    /// The Webship binary (build it with `cargo build --release -p webship`).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../target/release/webship"))]
    pub webship: PathBuf,
    /// Size of the file each download fetches, in MiB.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=100))]
    pub mib: u64,
    /// Concurrency levels, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,16,256")]
    pub levels: Vec<usize>,
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub workers: u32,
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Proto {
    /// One connection per download.
    H1,
    /// All downloads on one connection.
    H2,
    H3,
}

impl Proto {
    fn label(self) -> &'static str {
        match self {
            Self::H1 => "h1 (a connection each)",
            Self::H2 => "h2 (one connection)",
            Self::H3 => "h3 (one connection)",
        }
    }

    fn short(self) -> &'static str {
        match self {
            Self::H1 => "h1",
            Self::H2 => "h2",
            Self::H3 => "h3",
        }
    }
}

const FILE: &str = "concurrency.bin";
const DEADLINE: Duration = Duration::from_secs(600);

/// `concurrency` on its own: the table on stdout and in target/bench/concurrency.md.
pub fn run(args: &ConcurrencyArgs) -> Result<()> {
    let section = measure(args)?;
    print!("{}", section.markdown);
    let out = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../target/bench"));
    fs::create_dir_all(&out)?;
    fs::write(out.join("concurrency.md"), &section.markdown)?;
    Ok(())
}

/// Runs every (protocol, level) row against a fresh Webship; the rows as a report section.
pub fn measure(args: &ConcurrencyArgs) -> Result<Section> {
    let scratch = tempfile::tempdir().context("creating a scratch directory")?;
    let root = args
        .cache_dir
        .clone()
        .unwrap_or_else(|| scratch.path().join("root"));
    let fixture = fixture::ensure(&root)?;
    // The first MIB MiB of the fixture.
    let size = args.mib << 20;
    let mut data = fs::read(&fixture.path).context("reading the fixture")?;
    data.truncate(usize::try_from(size)?);
    fs::write(root.join(FILE), &data)?;
    let digest: [u8; 32] = Sha256::digest(&data).into();
    drop(data);
    let identity = fixture::write_identity(scratch.path())?;
    let spec = WebshipSpec {
        name: "webship",
        binary: &args.webship,
        ktls: "auto",
        runtime: Vec::new(),
    };
    let dir = scratch.path().join("webship");
    fs::create_dir_all(&dir)?;
    let server = servers::start_webship(
        &spec,
        &Settings {
            root: &root,
            identity: &identity,
            workers: args.workers,
            dir: &dir,
        },
    )?;
    let addr = SocketAddr::from(([127, 0, 0, 1], server.port));
    let tls = Arc::new(crate::tcpclient::tls_config(&identity.cert)?);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;

    let mut report = String::new();
    let mut json = Vec::new();
    let mut bars = Vec::new();
    let _ = writeln!(
        report,
        "{} concurrent downloads of {} MiB each from Webship ({} worker), one client core; \
         every body checked (SHA-256).\n",
        args.levels
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(" / "),
        args.mib,
        args.workers
    );
    let _ = writeln!(
        report,
        "| protocol | concurrent | aggregate MiB/s | p50 TTLB ms | p99 TTLB ms | server peak RSS MiB |"
    );
    let _ = writeln!(report, "|---|---:|---:|---:|---:|---:|");
    for proto in [Proto::H1, Proto::H2, Proto::H3] {
        for &n in &args.levels {
            if proto == Proto::H1 && n > 256 {
                continue;
            }
            let rss = RssWatch::start(server.pid());
            let start = Instant::now();
            let times = runtime
                .block_on(async {
                    tokio::time::timeout(
                        DEADLINE,
                        downloads(proto, n, addr, &tls, &identity.cert, size, &digest),
                    )
                    .await
                })
                .map_err(|_| anyhow!("{} × {n}: not done within {DEADLINE:?}", proto.label()))??;
            let total = start.elapsed().as_secs_f64();
            let peak = rss.finish();
            let mut ms: Vec<f64> = times.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
            ms.sort_by(f64::total_cmp);
            let pct = |p: f64| ms[((ms.len() as f64 * p).ceil() as usize).clamp(1, ms.len()) - 1];
            let mibs = (n as u64 * size) as f64 / total / 1_048_576.0;
            let (p50, p99, rss_mib) = (pct(0.50), pct(0.99), peak as f64 / 1024.0);
            let line = format!(
                "| {} | {n} | {mibs:.1} | {p50:.0} | {p99:.0} | {rss_mib:.1} |",
                proto.label()
            );
            eprintln!("concurrency: {line}");
            let _ = writeln!(report, "{line}");
            json.push(format!(
                "{{\"protocol\":{},\"concurrent\":{n},\"aggregate_mib_s\":{mibs:.3},\"p50_ttlb_ms\":{p50:.1},\
                 \"p99_ttlb_ms\":{p99:.1},\"server_peak_rss_mib\":{rss_mib:.1}}}",
                json_string(proto.label())
            ));
            bars.push((format!("concurrency {} × {n}", proto.short()), mibs));
        }
    }
    // The client's connections close before the server is asked to stop.
    drop(runtime);
    Ok(Section {
        title: "concurrency: many downloads at once (aggregate MiB/s, time to last byte, server RSS)"
            .to_owned(),
        markdown: report,
        json: format!("[{}]", json.join(",")),
        bars,
    })
}

/// `n` concurrent downloads; each one's time to last byte, from the common start.
async fn downloads(
    proto: Proto,
    n: usize,
    addr: SocketAddr,
    tls: &Arc<rustls::ClientConfig>,
    ca: &Path,
    size: u64,
    digest: &[u8; 32],
) -> Result<Vec<Duration>> {
    let start = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    match proto {
        Proto::H1 => {
            for _ in 0..n {
                let tls = tls.clone();
                set.spawn(async move {
                    let mut send = hyper_connect(addr, tls, false).await?;
                    get_hyper(&mut send, addr).await
                });
            }
        }
        Proto::H2 => {
            let send = hyper_connect(addr, tls.clone(), true).await?;
            for _ in 0..n {
                let mut send = send.clone();
                set.spawn(async move { get_hyper(&mut send, addr).await });
            }
        }
        Proto::H3 => {
            let endpoint = crate::h3client::endpoint_for(addr, ca, |_| {})?;
            let conn = endpoint
                .connect(addr, "localhost")?
                .await
                .context("QUIC handshake")?;
            let (mut driver, send) = h3::client::new(h3_quinn::Connection::new(conn.clone()))
                .await
                .context("HTTP/3 setup")?;
            let drive = tokio::spawn(async move {
                let _ = std::future::poll_fn(|cx| driver.poll_close(cx)).await;
            });
            for _ in 0..n {
                let mut send = send.clone();
                set.spawn(async move {
                    let req =
                        http::Request::get(format!("https://localhost:{}/{FILE}", addr.port())).body(())?;
                    let mut stream = send.send_request(req).await?;
                    stream.finish().await?;
                    let resp = stream.recv_response().await?;
                    ensure!(resp.status() == 200, "h3 status {}", resp.status());
                    let mut hasher = Sha256::new();
                    let mut len = 0u64;
                    while let Some(mut chunk) = stream.recv_data().await? {
                        while chunk.has_remaining() {
                            let c = chunk.chunk();
                            hasher.update(c);
                            len += c.len() as u64;
                            let k = c.len();
                            chunk.advance(k);
                        }
                    }
                    Ok::<_, anyhow::Error>((len, <[u8; 32]>::from(hasher.finalize())))
                });
            }
            let mut times = Vec::with_capacity(n);
            while let Some(done) = set.join_next().await {
                let (len, got) = done??;
                check(len, &got, size, digest)?;
                times.push(start.elapsed());
            }
            conn.close(0u32.into(), b"done");
            let _ = tokio::time::timeout(Duration::from_secs(2), endpoint.wait_idle()).await;
            drive.abort();
            return Ok(times);
        }
    }
    let mut times = Vec::with_capacity(n);
    while let Some(done) = set.join_next().await {
        let (len, got) = done??;
        check(len, &got, size, digest)?;
        times.push(start.elapsed());
    }
    Ok(times)
}

fn check(len: u64, got: &[u8; 32], size: u64, digest: &[u8; 32]) -> Result<()> {
    if len != size || got != digest {
        bail!(
            "a download got {len} bytes with SHA-256 {}, expected {size} with {}",
            hex(got),
            hex(digest)
        );
    }
    Ok(())
}

#[derive(Clone)]
enum Sender {
    H1(Arc<tokio::sync::Mutex<hyper::client::conn::http1::SendRequest<http_body_util::Empty<bytes::Bytes>>>>),
    H2(hyper::client::conn::http2::SendRequest<http_body_util::Empty<bytes::Bytes>>),
}

async fn hyper_connect(addr: SocketAddr, tls: Arc<rustls::ClientConfig>, h2: bool) -> Result<Sender> {
    let mut config = (*tls).clone();
    config.alpn_protocols = vec![if h2 { b"h2".to_vec() } else { b"http/1.1".to_vec() }];
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let name = ServerName::try_from("localhost")?;
    let stream = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .context("TLS handshake")?;
    let io = hyper_util::rt::TokioIo::new(stream);
    if h2 {
        let (send, conn) = hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .initial_stream_window_size(16 << 20)
            .initial_connection_window_size(64 << 20)
            .handshake(io)
            .await?;
        tokio::spawn(conn);
        Ok(Sender::H2(send))
    } else {
        let (send, conn) = hyper::client::conn::http1::handshake(io).await?;
        tokio::spawn(conn);
        Ok(Sender::H1(Arc::new(tokio::sync::Mutex::new(send))))
    }
}

async fn get_hyper(send: &mut Sender, addr: SocketAddr) -> Result<(u64, [u8; 32])> {
    let req = http::Request::get(format!("https://localhost:{}/{FILE}", addr.port()))
        .header(http::header::HOST, format!("localhost:{}", addr.port()))
        .body(http_body_util::Empty::<bytes::Bytes>::new())?;
    let resp = match send {
        Sender::H1(s) => s.lock().await.send_request(req).await?,
        Sender::H2(s) => s.send_request(req).await?,
    };
    ensure!(resp.status() == 200, "status {}", resp.status());
    let mut body = resp.into_body();
    let mut hasher = Sha256::new();
    let mut len = 0u64;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame?.into_data() {
            hasher.update(&data);
            len += data.len() as u64;
        }
    }
    Ok((len, hasher.finalize().into()))
}
