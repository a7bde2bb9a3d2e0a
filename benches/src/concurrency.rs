//! `concurrency`: many downloads at once — 1, 16 and 256 concurrent GETs of one
//! file over a single HTTP/2 connection and a single HTTP/3 connection, and over
//! as many HTTP/1.1 and HTTP/3 connections — giving aggregate throughput, p50/p99
//! time to last byte, the server's CPU per GB and peak RSS: the figures behind the
//! `runtime.settings` advice. With `--h3-batch-delays`, one Webship per
//! `h3_send_batch_delay_us` value serves the h3 rows, interleaved in one run;
//! `--h3-sockets` sets the servers' `h3_sockets`: with `--workers`, how HTTP/3
//! spreads over cores. `--core-share` gives each worker thread an emulated core of
//! its own (a CPU quota, [`crate::cores`]), so the server limits the run, not the
//! client beside it: how throughput grows with `--workers` on a small host.
//!
//! Columns: aggregate MiB/s (every byte over the time to the last one); "p50
//! connected", the median time from the row's start until a connection's handshakes
//! were done (TCP, TLS and HTTP/2's preface, or QUIC and the client's HTTP/3 setup,
//! which does not wait for the server's SETTINGS; one figure for a shared
//! connection, and for a connection each it includes waiting behind the others'
//! handshakes); p50/p99 time to last byte; server and client CPU per GB (the
//! client's is this process's own, the servers being its children); the server's
//! peak RSS; with `--core-share`, the CPU each emulated core used over the row
//! (CPU-seconds over seconds to the last byte: each worker's, then the rest's),
//! which shows whether the cores were what limited it. CPU is read at the last
//! byte, before the connections close.
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

use crate::cores::EmulatedCores;
use crate::proc::RssWatch;
use crate::report::{fixed, percentile, Section};
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
    /// Emulated cores: each server worker thread gets this share of one CPU (0.01
    /// to 1), and the server's other threads share one more such quota; the report
    /// adds each core's share of a CPU over the row. Needs root and the cgroup v1
    /// cpu and cpuacct controllers.
    #[arg(long, value_parser = crate::cores::parse_share)]
    pub core_share: Option<f64>,
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
    let servers = start_servers(args, &stage)?;
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
    let cores_note = args.core_share.map_or_else(String::new, |share| {
        format!(", each worker an emulated core of {share} CPU (the other threads one more)")
    });
    let _ = writeln!(
        report,
        "{} concurrent downloads of {} MiB each from Webship ({} worker{cores_note}, h3_sockets {}), \
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
        "| protocol | h3 batch µs | concurrent | aggregate MiB/s | p50 connected ms | p50 TTLB ms | p99 TTLB ms | server CPU-s/GB | client CPU-s/GB | server peak RSS MiB | CPU share per emulated core (workers + rest) |"
    );
    let _ = writeln!(report, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    warm_up(&runtime, &servers, &tls, size)?;
    for &n in &args.levels {
        for proto in protos.iter().copied() {
            if proto == Proto::H1 && n > 256 {
                continue;
            }
            let h3 = matches!(proto, Proto::H3 | Proto::H3Each);
            for (delay, server, cores) in servers.iter().take(if h3 { usize::MAX } else { 1 }) {
                let row = measure_row(&runtime, proto, n, server, cores.as_ref(), &tls, size)?;
                let batch = if h3 { delay.to_string() } else { "—".to_owned() };
                let line = row.markdown(proto, &batch, n);
                eprintln!("concurrency: {line}");
                let _ = writeln!(report, "{line}");
                json.push(row.json(proto, h3.then_some(*delay), n));
                bars.push((
                    format!("concurrency {} × {n} batch {batch}", proto.short()),
                    row.mibs,
                ));
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

/// One untimed download per protocol and server before the rows: the file in the
/// page cache and each server's first-connection costs out of the first row.
fn warm_up(
    runtime: &tokio::runtime::Runtime,
    servers: &[(u64, servers::Server, Option<EmulatedCores>)],
    tls: &Arc<rustls::ClientConfig>,
    size: u64,
) -> Result<()> {
    for (_, server, _) in servers {
        let addr = SocketAddr::from(([127, 0, 0, 1], server.port));
        for proto in [Proto::H2, Proto::H3] {
            runtime
                .block_on(async {
                    tokio::time::timeout(DEADLINE, async {
                        let (_, left_open) = downloads(proto, 1, addr, tls, size).await?;
                        left_open.close().await;
                        anyhow::Ok(())
                    })
                    .await
                })
                .map_err(|_| anyhow!("warm-up {}: not done within {DEADLINE:?}", proto.label()))??;
        }
    }
    Ok(())
}

/// One Webship per `h3_send_batch_delay_us` value, each with its emulated cores
/// when `--core-share` asks for them.
fn start_servers(
    args: &ConcurrencyArgs,
    stage: &servers::Stage,
) -> Result<Vec<(u64, servers::Server, Option<EmulatedCores>)>> {
    let mut started = Vec::new();
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
            root: &stage.root,
            identity: &stage.identity,
            workers: args.workers,
            dir: &stage.dir(name)?,
            hold: None,
        };
        let server = servers::start_webship(&spec, &settings)?;
        // Before the first request, so that no blocking-pool thread exists yet (it
        // would carry a worker's name); those started later join their starter's core.
        let cores = args
            .core_share
            .map(|share| EmulatedCores::confine(server.pid(), usize::try_from(args.workers)?, share))
            .transpose()?;
        started.push((delay, server, cores));
    }
    Ok(started)
}

/// One row's figures: MiB/s, times in ms, CPU-s per GB, MiB, the seconds to the
/// last byte, and per emulated core (workers, then the rest; empty without
/// `--core-share`) its CPU-seconds and how often it was throttled, over the row.
struct Row {
    mibs: f64,
    connect_p50: f64,
    p50: f64,
    p99: f64,
    cpu_gb: f64,
    client_gb: f64,
    rss_mib: f64,
    seconds: f64,
    per_core: Vec<f64>,
    throttled: Vec<u64>,
}

impl Row {
    /// The report's table line.
    fn markdown(&self, proto: Proto, batch: &str, n: usize) -> String {
        let shares = if self.per_core.is_empty() {
            "—".to_owned()
        } else {
            let each = self.per_core.iter().map(|s| format!("{:.2}", s / self.seconds));
            each.collect::<Vec<_>>().join(" + ")
        };
        format!(
            "| {} | {batch} | {n} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} | {:.1} | {shares} |",
            proto.label(),
            self.mibs,
            self.connect_p50,
            self.p50,
            self.p99,
            self.cpu_gb,
            self.client_gb,
            self.rss_mib
        )
    }

    fn json(&self, proto: Proto, h3_batch_delay: Option<u64>, n: usize) -> serde_json::Value {
        json!({
            "protocol": proto.label(),
            "concurrent": n,
            "h3_send_batch_delay_us": h3_batch_delay,
            "server_cpu_s_per_gb": fixed(self.cpu_gb, 3),
            "client_cpu_s_per_gb": fixed(self.client_gb, 3),
            "aggregate_mib_s": fixed(self.mibs, 3),
            "p50_connected_ms": fixed(self.connect_p50, 1),
            "p50_ttlb_ms": fixed(self.p50, 1),
            "p99_ttlb_ms": fixed(self.p99, 1),
            "server_peak_rss_mib": fixed(self.rss_mib, 1),
            "seconds_to_last_byte": fixed(self.seconds, 3),
            "cpu_s_per_core": self.per_core.iter().map(|s| fixed(*s, 3)).collect::<Vec<_>>(),
            "throttled_per_core": self.throttled,
        })
    }
}

/// `n` downloads over `proto` from `server`, with the server's and this process's CPU
/// and the server's peak RSS over them.
fn measure_row(
    runtime: &tokio::runtime::Runtime,
    proto: Proto,
    n: usize,
    server: &servers::Server,
    cores: Option<&EmulatedCores>,
    tls: &Arc<rustls::ClientConfig>,
    size: u64,
) -> Result<Row> {
    let ticks_per_s = crate::proc::clock_ticks_per_second();
    let addr = SocketAddr::from(([127, 0, 0, 1], server.port));
    let core_before = cores.map(EmulatedCores::cpu_seconds);
    let throttled_before = cores.map(EmulatedCores::throttled).unwrap_or_default();
    let rss = RssWatch::start(server.pid());
    let cpu = crate::proc::cpu_ticks(server.pid());
    let client_cpu = crate::proc::own_cpu_ticks();
    let start = Instant::now();
    let (times, left_open) = runtime
        .block_on(async { tokio::time::timeout(DEADLINE, downloads(proto, n, addr, tls, size)).await })
        .map_err(|_| anyhow!("{} × {n}: not done within {DEADLINE:?}", proto.label()))??;
    // Up to the last byte: closing the connections afterwards is not counted.
    let total = times
        .last_byte
        .iter()
        .max()
        .map_or(start.elapsed(), |t| *t)
        .as_secs_f64();
    let cpu_s = crate::proc::cpu_ticks(server.pid()).saturating_sub(cpu) as f64 / ticks_per_s;
    let client_s = crate::proc::own_cpu_ticks().saturating_sub(client_cpu) as f64 / ticks_per_s;
    let per_core = cores.zip(core_before).map_or_else(Vec::new, |(cores, before)| {
        let after = cores.cpu_seconds();
        after.iter().zip(before).map(|(a, b)| a - b).collect()
    });
    let peak = rss.finish();
    let throttled_after = cores.map(EmulatedCores::throttled).unwrap_or_default();
    let throttled = throttled_after
        .iter()
        .zip(throttled_before)
        .map(|(a, b)| a.saturating_sub(b))
        .collect();
    runtime
        .block_on(async { tokio::time::timeout(DEADLINE, left_open.close()).await })
        .map_err(|_| {
            anyhow!(
                "{} × {n}: connections not closed within {DEADLINE:?}",
                proto.label()
            )
        })?;
    let gb = (n as u64 * size) as f64 / 1e9;
    let ms = |d: &[Duration]| d.iter().map(|d| d.as_secs_f64() * 1000.0).collect::<Vec<_>>();
    let (connected, last_byte) = (ms(&times.connected), ms(&times.last_byte));
    Ok(Row {
        mibs: (n as u64 * size) as f64 / total / 1_048_576.0,
        connect_p50: percentile(&connected, 0.50).unwrap_or(0.0),
        p50: percentile(&last_byte, 0.50).unwrap_or(0.0),
        p99: percentile(&last_byte, 0.99).unwrap_or(0.0),
        cpu_gb: cpu_s / gb,
        client_gb: client_s / gb,
        rss_mib: peak as f64 / 1024.0,
        seconds: total,
        per_core,
        throttled,
    })
}

/// When a row's downloads ended and when their connections were ready (handshakes
/// done: TCP, TLS and HTTP/2's preface, or QUIC and HTTP/3's setup), from the
/// common start. One connection time per connection: one for a shared connection.
struct Timings {
    last_byte: Vec<Duration>,
    connected: Vec<Duration>,
}

/// The connections a row leaves open, closed after its figures are read (so a
/// close is neither a time to last byte nor CPU of the row).
#[derive(Default)]
struct Open {
    tcp: Vec<Conn>,
    h3: Vec<H3Client>,
}

impl Open {
    async fn close(self) {
        for conn in self.tcp {
            conn.close().await;
        }
        for client in self.h3 {
            client.close().await;
        }
    }
}

/// `n` concurrent downloads, timed; the connections still open.
async fn downloads(
    proto: Proto,
    n: usize,
    addr: SocketAddr,
    tls: &Arc<rustls::ClientConfig>,
    size: u64,
) -> Result<(Timings, Open)> {
    let start = Instant::now();
    let mut connected = Vec::new();
    let path = format!("/{FILE}");
    let mut set = tokio::task::JoinSet::new();
    let mut left_open = Open::default();
    // Connections of their own, kept by their tasks once their body is in.
    let (h1_each, h3_each) = (
        Arc::new(std::sync::Mutex::new(Vec::new())),
        Arc::new(std::sync::Mutex::new(Vec::new())),
    );
    match proto {
        Proto::H1 => {
            for _ in 0..n {
                let (tls, path, kept) = (tls.clone(), path.clone(), h1_each.clone());
                set.spawn(async move {
                    let mut conn = open(addr, &tls, Http::H1).await?;
                    let ready = start.elapsed();
                    let checked = get(&mut conn, &path).await?;
                    kept.lock().map_err(|_| anyhow!("poisoned"))?.push(conn);
                    Ok((checked, Some(ready)))
                });
            }
        }
        Proto::H2 => {
            let conn = open(addr, tls, Http::H2).await?;
            connected.push(start.elapsed());
            for _ in 0..n {
                let mut conn = conn.share().context("an h2 connection is shared")?;
                let path = path.clone();
                set.spawn(async move { Ok((get(&mut conn, &path).await?, None)) });
            }
            left_open.tcp.push(conn);
        }
        Proto::H3Each => {
            for _ in 0..n {
                let (tls, path, kept) = (tls.clone(), path.clone(), h3_each.clone());
                set.spawn(async move {
                    let client = H3Client::connect(addr, "localhost", &tls, &H3Options::bulk()).await?;
                    let ready = start.elapsed();
                    let (head, mut stream) =
                        request(&mut client.send.clone(), &client.origin(), "GET", &path, &[]).await?;
                    ensure!(head.status == 200, "h3 status {}", head.status);
                    let mut check = FixtureCheck::default();
                    recv_body(&mut stream, &mut check).await?;
                    kept.lock().map_err(|_| anyhow!("poisoned"))?.push(client);
                    Ok((check, Some(ready)))
                });
            }
        }
        Proto::H3 => {
            let client = H3Client::connect(addr, "localhost", tls, &H3Options::bulk()).await?;
            connected.push(start.elapsed());
            for _ in 0..n {
                let (mut send, origin, path) = (client.send.clone(), client.origin(), path.clone());
                set.spawn(async move {
                    let (head, mut stream) = request(&mut send, &origin, "GET", &path, &[]).await?;
                    ensure!(head.status == 200, "h3 status {}", head.status);
                    let mut check = FixtureCheck::default();
                    recv_body(&mut stream, &mut check).await?;
                    Ok((check, None))
                });
            }
            left_open.h3.push(client);
        }
    }
    let mut last_byte = Vec::with_capacity(n);
    while let Some(done) = set.join_next().await {
        let (check, ready) = done??;
        let verdict = check.verdict(size);
        ensure!(verdict == EXACT, "a download's body {verdict}");
        last_byte.push(start.elapsed());
        connected.extend(ready);
    }
    left_open.h3.extend(std::mem::take(
        &mut *h3_each.lock().map_err(|_| anyhow!("poisoned"))?,
    ));
    Ok((Timings { last_byte, connected }, left_open))
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
