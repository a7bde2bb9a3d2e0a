//! `concurrency`: many downloads at once — 1, 16 and 256 concurrent GETs of one
//! file over a single HTTP/2 connection and a single HTTP/3 connection, and over
//! as many HTTP/1.1 and HTTP/3 connections — giving aggregate throughput, p50/p99
//! time to last byte, the server's CPU per GB and peak RSS: the figures behind the
//! `runtime.settings` advice. With `--h3-batch-delays`, one Webship per
//! `h3_send_batch_delay_us` value serves the h3 rows, interleaved in one run;
//! `--h3-sockets` sets the servers' `h3_sockets`: with `--workers`, how HTTP/3
//! spreads over cores.
//!
//! The client (the test kit's, sized for bulk downloads) runs in this process on a
//! current-thread runtime (one core, like the server's one worker by default), or
//! on `--client-threads` threads; its CPU per GB is in the table, so a row the
//! client limits shows as one.
//! Every body is compared with the fixture byte for byte as it arrives; a run
//! counts only when every download was exact.

use std::fmt::Write as _;
use std::fs;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, ensure, Context, Result};
use clap::Args;
use serde_json::json;
use webship_testkit::body::FixtureCheck;
use webship_testkit::fixture::EXACT;
use webship_testkit::h3::{recv_body, request, H3Client, H3Options};
use webship_testkit::http::{connect, Conn, Proto as Http, Tuning};
use webship_testkit::pki::client_config;

use crate::proc::RssWatch;
use crate::report::{fixed, Section};
use crate::servers::{self, Settings, WebshipSpec};

#[derive(Debug, Args)]
pub(crate) struct ConcurrencyArgs {
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
    /// `h3_send_batch_delay_us` values, comma-separated: one Webship each, every h3
    /// row run against each (h1 and h2 rows against the first).
    #[arg(long, value_delimiter = ',', default_value = "0")]
    pub h3_batch_delays: Vec<u64>,
    /// Protocols to run, comma-separated, of h1, h2, h3 (one connection), h3n (a
    /// connection each).
    #[arg(long, value_delimiter = ',', default_value = "h1,h2,h3,h3n")]
    pub protos: Vec<String>,
    /// The servers' `h3_sockets` (UDP sockets, one quinn endpoint each; 0: one per
    /// worker).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(0..=32))]
    pub h3_sockets: u16,
    /// Client runtime threads (1: a current-thread runtime).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub client_threads: u16,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Proto {
    /// One connection per download.
    H1,
    /// All downloads on one connection.
    H2,
    H3,
    /// One h3 connection per download (cross-connection batching acts here).
    H3Each,
}

impl Proto {
    fn label(self) -> &'static str {
        match self {
            Self::H1 => "h1 (a connection each)",
            Self::H2 => "h2 (one connection)",
            Self::H3 => "h3 (one connection)",
            Self::H3Each => "h3 (a connection each)",
        }
    }

    fn short(self) -> &'static str {
        match self {
            Self::H1 => "h1",
            Self::H2 => "h2",
            Self::H3 => "h3",
            Self::H3Each => "h3n",
        }
    }
}

const FILE: &str = "concurrency.bin";
const DEADLINE: Duration = Duration::from_secs(600);

/// `concurrency` on its own: the table on stdout and in target/bench/concurrency.md.
pub(crate) fn run(args: &ConcurrencyArgs) -> Result<()> {
    measure(args)?.publish("concurrency")
}

/// Runs every (protocol, level) row against a fresh Webship; the rows as a report section.
pub(crate) fn measure(args: &ConcurrencyArgs) -> Result<Section> {
    let stage = servers::Stage::new(args.cache_dir.as_deref())?;
    let (root, identity) = (&stage.root, &stage.identity);
    // The first MIB MiB of the fixture.
    let size = args.mib << 20;
    let mut data = fs::read(&stage.fixture.path).context("reading the fixture")?;
    data.truncate(usize::try_from(size)?);
    fs::write(root.join(FILE), &data)?;
    drop(data);
    let mut servers = Vec::new();
    for &delay in &args.h3_batch_delays {
        let name: &'static str = Box::leak(format!("webship-batch{delay}").into_boxed_str());
        let spec = WebshipSpec {
            name,
            binary: &args.webship,
            ktls: "auto",
            runtime: vec![
                ("h3_send_batch_delay_us", delay.to_string()),
                ("h3_sockets", args.h3_sockets.to_string()),
            ],
            scraped: false,
        };
        let settings = Settings {
            root,
            identity,
            workers: args.workers,
            dir: &stage.dir(name)?,
            hold: None,
        };
        servers.push((delay, servers::start_webship(&spec, &settings)?));
    }
    let all = [Proto::H1, Proto::H2, Proto::H3, Proto::H3Each];
    if let Some(unknown) = args.protos.iter().find(|a| !all.iter().any(|p| p.short() == *a)) {
        return Err(anyhow!("unknown protocol {unknown:?} (h1, h2, h3, h3n)"));
    }
    let protos: Vec<Proto> = all
        .into_iter()
        .filter(|p| args.protos.iter().any(|a| a == p.short()))
        .collect();
    let tls = client_config(
        webship_testkit::pki::roots_from_pem(&identity.ca)?,
        rustls::DEFAULT_VERSIONS,
        &[],
    )?;
    let runtime = match args.client_threads {
        1 => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?,
        n => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(n.into())
            .enable_all()
            .build()?,
    };

    let mut report = String::new();
    let mut json = Vec::new();
    let mut bars = Vec::new();
    let _ = writeln!(
        report,
        "{} concurrent downloads of {} MiB each from Webship ({} worker, h3_sockets {}), \
         {} client thread(s); every body checked byte for byte.\n",
        args.levels
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(" / "),
        args.mib,
        args.workers,
        args.h3_sockets,
        args.client_threads
    );
    let _ = writeln!(
        report,
        "| protocol | h3 batch µs | concurrent | aggregate MiB/s | p50 TTLB ms | p99 TTLB ms | server CPU-s/GB | client CPU-s/GB | server peak RSS MiB |"
    );
    let _ = writeln!(report, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let ticks = crate::proc::clock_ticks_per_second();
    // One untimed download per protocol and server first: the file in the page cache
    // and each server's first-connection costs out of the first row.
    for (_, server) in &servers {
        let addr = SocketAddr::from(([127, 0, 0, 1], server.port));
        for proto in [Proto::H2, Proto::H3] {
            runtime
                .block_on(async {
                    tokio::time::timeout(DEADLINE, downloads(proto, 1, addr, &tls, size)).await
                })
                .map_err(|_| anyhow!("warm-up {}: not done within {DEADLINE:?}", proto.label()))??;
        }
    }
    for &n in &args.levels {
        for proto in protos.iter().copied() {
            if proto == Proto::H1 && n > 256 {
                continue;
            }
            let h3 = matches!(proto, Proto::H3 | Proto::H3Each);
            for (delay, server) in servers.iter().take(if h3 { usize::MAX } else { 1 }) {
                let addr = SocketAddr::from(([127, 0, 0, 1], server.port));
                let rss = RssWatch::start(server.pid());
                let cpu = crate::proc::cpu_ticks(server.pid());
                let client_cpu = crate::proc::cpu_ticks(std::process::id());
                let start = Instant::now();
                let times = runtime
                    .block_on(async {
                        tokio::time::timeout(DEADLINE, downloads(proto, n, addr, &tls, size)).await
                    })
                    .map_err(|_| anyhow!("{} × {n}: not done within {DEADLINE:?}", proto.label()))??;
                // Up to the last byte: closing the connections afterwards is not counted.
                let total = times.iter().max().map_or(start.elapsed(), |t| *t).as_secs_f64();
                let cpu_s = (crate::proc::cpu_ticks(server.pid()) - cpu) as f64 / ticks;
                let client_s = (crate::proc::cpu_ticks(std::process::id()) - client_cpu) as f64 / ticks;
                let peak = rss.finish();
                let mut ms: Vec<f64> = times.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
                ms.sort_by(f64::total_cmp);
                let pct = |p: f64| ms[((ms.len() as f64 * p).ceil() as usize).clamp(1, ms.len()) - 1];
                let mibs = (n as u64 * size) as f64 / total / 1_048_576.0;
                let (p50, p99, rss_mib) = (pct(0.50), pct(0.99), peak as f64 / 1024.0);
                let gb = (n as u64 * size) as f64 / 1e9;
                let (cpu_gb, client_gb) = (cpu_s / gb, client_s / gb);
                let batch = if h3 { delay.to_string() } else { "—".to_owned() };
                let line = format!(
                    "| {} | {batch} | {n} | {mibs:.1} | {p50:.1} | {p99:.1} | {cpu_gb:.2} | {client_gb:.2} | {rss_mib:.1} |",
                    proto.label()
                );
                eprintln!("concurrency: {line}");
                let _ = writeln!(report, "{line}");
                json.push(json!({
                    "protocol": proto.label(),
                    "concurrent": n,
                    "h3_send_batch_delay_us": h3.then_some(*delay),
                    "server_cpu_s_per_gb": fixed(cpu_gb, 3),
                "client_cpu_s_per_gb": fixed(client_gb, 3),
                    "aggregate_mib_s": fixed(mibs, 3),
                    "p50_ttlb_ms": fixed(p50, 1),
                    "p99_ttlb_ms": fixed(p99, 1),
                    "server_peak_rss_mib": fixed(rss_mib, 1),
                }));
                bars.push((format!("concurrency {} × {n} batch {batch}", proto.short()), mibs));
            }
        }
    }
    // The client's connections close before the server is asked to stop.
    drop(runtime);
    Ok(Section {
        title: "concurrency: many downloads at once (aggregate MiB/s, time to last byte, server RSS)"
            .to_owned(),
        markdown: report,
        json: json.into(),
        bars,
    })
}

/// `n` concurrent downloads; each one's time to last byte, from the common start.
async fn downloads(
    proto: Proto,
    n: usize,
    addr: SocketAddr,
    tls: &Arc<rustls::ClientConfig>,
    size: u64,
) -> Result<Vec<Duration>> {
    let start = Instant::now();
    let path = format!("/{FILE}");
    let mut set = tokio::task::JoinSet::new();
    // What is left to close once every download is in.
    let (mut h2, mut h3) = (None, None);
    let h3_each = Arc::new(std::sync::Mutex::new(Vec::new()));
    match proto {
        Proto::H1 => {
            for _ in 0..n {
                let (tls, path) = (tls.clone(), path.clone());
                set.spawn(async move {
                    let mut conn = open(addr, &tls, Http::H1).await?;
                    let checked = get(&mut conn, &path).await;
                    conn.close().await;
                    checked
                });
            }
        }
        Proto::H2 => {
            let conn = open(addr, tls, Http::H2).await?;
            for _ in 0..n {
                let mut conn = conn.share().context("an h2 connection is shared")?;
                let path = path.clone();
                set.spawn(async move { get(&mut conn, &path).await });
            }
            h2 = Some(conn);
        }
        Proto::H3Each => {
            for _ in 0..n {
                let (tls, path, open) = (tls.clone(), path.clone(), h3_each.clone());
                set.spawn(async move {
                    let client = H3Client::connect(addr, "localhost", &tls, &H3Options::bulk()).await?;
                    let (head, mut stream) =
                        request(&mut client.send.clone(), &client.origin(), "GET", &path, &[]).await?;
                    ensure!(head.status == 200, "h3 status {}", head.status);
                    let mut check = FixtureCheck::default();
                    recv_body(&mut stream, &mut check).await?;
                    // Closed once every body is in, so a close is not a time to last byte.
                    open.lock().map_err(|_| anyhow!("poisoned"))?.push(client);
                    Ok(check)
                });
            }
        }
        Proto::H3 => {
            let client = H3Client::connect(addr, "localhost", tls, &H3Options::bulk()).await?;
            for _ in 0..n {
                let (mut send, origin, path) = (client.send.clone(), client.origin(), path.clone());
                set.spawn(async move {
                    let (head, mut stream) = request(&mut send, &origin, "GET", &path, &[]).await?;
                    ensure!(head.status == 200, "h3 status {}", head.status);
                    let mut check = FixtureCheck::default();
                    recv_body(&mut stream, &mut check).await?;
                    Ok(check)
                });
            }
            h3 = Some(client);
        }
    }
    let mut times = Vec::with_capacity(n);
    while let Some(done) = set.join_next().await {
        let verdict = done??.verdict(size);
        ensure!(verdict == EXACT, "a download's body {verdict}");
        times.push(start.elapsed());
    }
    if let Some(conn) = h2 {
        conn.close().await;
    }
    if let Some(client) = h3 {
        client.close().await;
    }
    let each = std::mem::take(&mut *h3_each.lock().map_err(|_| anyhow!("poisoned"))?);
    for client in each {
        client.close().await;
    }
    Ok(times)
}

/// A TLS connection to `localhost` on `addr` speaking `http`.
pub(crate) async fn open(addr: SocketAddr, tls: &Arc<rustls::ClientConfig>, http: Http) -> Result<Conn> {
    let tls = webship_testkit::pki::with_alpn(tls, http.alpn());
    let stream = connect(addr, "localhost", tls).await.context("TLS handshake")?;
    Conn::handshake(stream, http, &format!("localhost:{}", addr.port()), Tuning::BULK).await
}

/// One GET on `conn`, the body checked against the fixture.
pub(crate) async fn get(conn: &mut Conn, path: &str) -> Result<FixtureCheck> {
    let mut check = FixtureCheck::default();
    let head = conn.fetch_into("GET", path, &[], &mut check).await?;
    ensure!(head.status == 200, "status {}", head.status);
    Ok(check)
}
