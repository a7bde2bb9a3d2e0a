//! `wan`: downloads across an emulated WAN link, because loopback says nothing
//! about congestion control. The server runs in one network namespace and the
//! clients in another; the only path between them is this process's relay
//! ([`link`]), which applies rate, delay, jitter, loss and a bounded queue.
//!
//! Per link (rate × RTT × loss), five ways of sending are measured in
//! interleaved rounds: h2 from Webship with kernel BBR (`[kernel] bbr = "auto"`)
//! and with CUBIC (`bbr = "off"`, the namespace's default set to cubic), h3 from
//! Webship on CUBIC throughout (`bbr = "off"`) and with its switch to quinn's BBR
//! (`bbr = "auto"`, the default `h3_bbr_switch_bytes`), and h3 from Caddy. Each
//! downloads a prefix of the fixture and 1 MiB objects: goodput, p50/p99 time
//! to last byte (the clients' own, handshake included), server CPU-s/GB, and
//! what the link dropped. Before the cells, a plain TCP stream through the
//! relay measures what the relay itself carries on this host.

mod link;
mod netns;
mod tun;

use std::fmt::Write as _;
use std::fs;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use serde_json::json;
use webship_testkit::process::{Logs, Process};

use crate::clients::{Clients, Fetch, Protocol};
use crate::proc::{clock_ticks_per_second, cpu_ticks};
use crate::report::{fixed, percentile, Section};
use crate::servers::{self, Settings};
use link::{Counts, Relay, Shape};
use netns::{Wan, CLIENT_ADDR, SERVER_ADDR};

#[derive(Debug, Clone, Args)]
pub(crate) struct WanArgs {
    /// The Webship binary (build it with `cargo build --release -p webship`).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../target/release/webship"))]
    pub webship: PathBuf,
    /// The Caddy binary (its h3 is a peer; skipped if missing, and in `--smoke`).
    #[arg(long, default_value = "/usr/bin/caddy")]
    pub caddy: PathBuf,
    /// Link rates in Mbit/s, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "100,1000")]
    pub rates: Vec<u64>,
    /// Round-trip times in ms (half each way), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "20,80")]
    pub rtts: Vec<u64>,
    /// Packet loss in percent, applied in each direction, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "0,0.1,1")]
    pub losses: Vec<f64>,
    /// Extra one-way delay per packet, uniform in [0, JITTER] ms (never reorders).
    #[arg(long, default_value_t = 0)]
    pub jitter_ms: u64,
    /// The queue in front of the rate limiter, in ms of the link rate (tail drop).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u64).range(1..=1000))]
    pub queue_ms: u64,
    /// The bulk download: the fixture's first MiB (0: none).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(0..=95))]
    pub fixture_mib: u64,
    /// Timed bulk downloads per cell.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=50))]
    pub fixture_samples: u32,
    /// Timed 1 MiB downloads per cell (p99 of few samples is their maximum).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=200))]
    pub samples: u32,
    /// A download not done within this many seconds counts as timed out.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=600))]
    pub max_secs: u64,
    /// The loss and jitter generator's seed (the same seed drops the same packets).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Seconds of each plain-TCP self-test of the relay.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=60))]
    pub selftest_secs: u64,
    /// CI's check that the harness works: one link (100 Mbit/s, 20 ms, no loss), one
    /// 1 MiB download per Webship mode, no bulk download, no Caddy; fails if any fails.
    #[arg(long)]
    pub smoke: bool,
    /// The TUN links' MTU: 1500 (Ethernet), 1280 to 9000 for a tunnel or a
    /// jumbo-frame path. Other than 1500, Webship's DPLPMTUD ceiling is set to the
    /// link's UDP payload ([`h3_ceiling`]).
    #[arg(long, default_value_t = 1500, value_parser = clap::value_parser!(u32).range(1280..=9000))]
    pub mtu: u32,
}

/// The plain-TCP self-test's own client and server (`wan-tcp`), run inside the namespaces.
#[derive(Debug, Args)]
pub(crate) struct WanTcpArgs {
    /// Receive: accept one connection here, read until EOF, print "<bytes> <seconds>".
    #[arg(long, conflicts_with = "connect")]
    pub listen: Option<SocketAddr>,
    /// Send: connect here and write for `--seconds`.
    #[arg(long)]
    pub connect: Option<SocketAddr>,
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=60))]
    pub seconds: u64,
}

/// The ways of sending compared in every cell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sender {
    H2Bbr,
    H2Cubic,
    H3Cubic,
    H3Switch,
    CaddyH3,
}

impl Sender {
    const ALL: [Sender; 5] = [
        Sender::H2Bbr,
        Sender::H2Cubic,
        Sender::H3Cubic,
        Sender::H3Switch,
        Sender::CaddyH3,
    ];

    fn label(self) -> &'static str {
        match self {
            Sender::H2Bbr => "h2 webship, kernel BBR",
            Sender::H2Cubic => "h2 webship, kernel CUBIC",
            Sender::H3Cubic => "h3 webship, CUBIC",
            Sender::H3Switch => "h3 webship, BBR switch",
            Sender::CaddyH3 => "h3 caddy",
        }
    }

    fn protocol(self) -> Protocol {
        match self {
            Sender::H2Bbr | Sender::H2Cubic => Protocol::H2,
            _ => Protocol::H3,
        }
    }

    /// Which server instance sends.
    fn server(self) -> Instance {
        match self {
            Sender::H2Bbr | Sender::H3Switch => Instance::Bbr,
            Sender::H2Cubic | Sender::H3Cubic => Instance::Cubic,
            Sender::CaddyH3 => Instance::Caddy,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Instance {
    /// Webship with `[kernel] bbr = "auto"`.
    Bbr,
    /// Webship with `[kernel] bbr = "off"`.
    Cubic,
    Caddy,
}

impl Instance {
    fn port(self) -> u16 {
        match self {
            Instance::Bbr => 8443,
            Instance::Cubic => 8444,
            Instance::Caddy => 8445,
        }
    }
}

/// One link to emulate.
#[derive(Debug, Clone, Copy)]
struct Cell {
    mbit: u64,
    rtt_ms: u64,
    loss_pct: f64,
}

impl Cell {
    fn label(&self) -> String {
        format!("{} Mbit/s, {} ms, {} %", self.mbit, self.rtt_ms, self.loss_pct)
    }

    fn shape(&self, args: &WanArgs, seed: u64) -> Shape {
        let rate_bps = self.mbit * 1_000_000;
        Shape {
            rate_bps,
            delay: Duration::from_micros(self.rtt_ms * 500),
            jitter: Duration::from_millis(args.jitter_ms),
            loss: self.loss_pct / 100.0,
            queue_bytes: rate_bps / 8 * args.queue_ms / 1000,
            seed,
        }
    }
}

const FIXTURE_FILE: &str = "wan-fixture.bin";
const SMALL_FILE: &str = "wan-1mib.bin";
const SMALL: u64 = 1 << 20;
const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// `wan` on its own: the tables on stdout and in target/bench/wan.md.
pub(crate) fn run(args: &WanArgs) -> Result<()> {
    ensure!(
        crate::is_root(),
        "wan: network namespaces and TUN devices need root (run it as root)"
    );
    let mut args = args.clone();
    if args.smoke {
        args.rates = vec![100];
        args.rtts = vec![20];
        args.losses = vec![0.0];
        args.fixture_mib = 0;
        args.samples = 1;
        args.selftest_secs = 1;
        args.caddy = PathBuf::new();
    }
    for &loss in &args.losses {
        ensure!(
            (0.0..100.0).contains(&loss),
            "--losses: {loss} is not a percentage below 100"
        );
    }
    ensure!(
        args.rates.iter().all(|&r| (1..=10_000).contains(&r)),
        "--rates: 1 to 10000 Mbit/s"
    );
    ensure!(args.rtts.iter().all(|&r| r <= 1000), "--rtts: 0 to 1000 ms");
    netns::remove_on_signal()?;
    measure(&args)?.publish("wan")
}

/// The servers, started inside the server namespace.
struct Servers {
    running: Vec<(Instance, Process)>,
}

impl Servers {
    fn pid(&self, instance: Instance) -> Option<u32> {
        self.running
            .iter()
            .find(|(i, _)| *i == instance)
            .map(|(_, p)| p.pid())
    }
}

fn measure(args: &WanArgs) -> Result<Section> {
    let scratch = tempfile::Builder::new()
        .prefix("webship-bench-wan-")
        .tempdir()
        .context("creating a scratch directory")?;
    let root = scratch.path().join("root");
    fs::create_dir_all(&root)?;
    write_prefix(&root.join(SMALL_FILE), SMALL)?;
    if args.fixture_mib > 0 {
        write_prefix(&root.join(FIXTURE_FILE), args.fixture_mib << 20)?;
    }
    let identity = servers::write_identity(scratch.path())?;
    let wan = Wan::create(args.mtu)?;
    // What `bbr = "off"` leaves each TCP socket with, and the self-test's sender.
    wan.server_congestion("cubic")?;

    let mut servers = Servers { running: Vec::new() };
    for instance in [Instance::Bbr, Instance::Cubic, Instance::Caddy] {
        let dir = scratch.path().join(format!("{instance:?}"));
        fs::create_dir_all(&dir)?;
        let s = Settings {
            root: &root,
            identity: &identity,
            workers: 1,
            dir: &dir,
            hold: None,
        };
        let command = match instance {
            Instance::Caddy if !args.caddy.is_file() => {
                eprintln!("wan: no Caddy at {}; its cells are skipped", args.caddy.display());
                continue;
            }
            Instance::Caddy => {
                servers::caddy_command(&args.caddy, &s, &SERVER_ADDR.to_string(), instance.port(), None)?
            }
            Instance::Bbr | Instance::Cubic => webship_command(args, &s, instance)?,
        };
        let ready = match instance {
            Instance::Caddy => servers::CADDY_READY,
            _ => "listening on",
        };
        let name = format!("{instance:?}");
        let log = dir.join("server.log");
        let mut process = Process::spawn(&name, &mut wan.in_server(&command), Logs::one(log))?;
        wait_logged(&mut process, ready)?;
        servers.running.push((instance, process));
    }

    let clients = Clients::new(&identity.ca)?;
    let mut markdown = String::new();
    let mut json_rows = Vec::new();
    let mut bars = Vec::new();
    let capacity = self_test(&wan, args, &mut markdown, &mut json_rows)?;
    let bulk = match args.fixture_mib {
        0 => String::new(),
        mib => format!(
            "{} timed download(s) of the fixture's first {mib} MiB and ",
            args.fixture_samples
        ),
    };
    let jitter = match args.jitter_ms {
        0 => String::new(),
        ms => format!(", jitter 0-{ms} ms one way"),
    };
    let mtu = h3_ceiling(args.mtu).map_or_else(String::new, |ceiling| {
        format!(
            ", links of MTU {} (Webship's h3 DPLPMTUD ceiling {ceiling})",
            args.mtu
        )
    });
    let _ = writeln!(
        markdown,
        "\nPer link and sender, {bulk}{} of 1 MiB, in interleaved rounds; loss applies in each \
         direction, the queue holds {} ms of the rate (tail drop){jitter}{mtu}. Goodput is the median of \
         bytes / time to last byte (handshake included); p99 of a few samples is their maximum; a \
         sample over {} s counts as failed. Link drops are the link's, shared by the cell's senders.\n",
        args.samples, args.queue_ms, args.max_secs,
    );
    let _ = writeln!(
        markdown,
        "| link | sender | {}1 MiB Mbit/s | 1 MiB p50 ms | 1 MiB p99 ms | server CPU-s/GB | link drops (loss / queue) |",
        if args.fixture_mib > 0 {
            format!("{} MiB Mbit/s | {} MiB p50 ms | ", args.fixture_mib, args.fixture_mib)
        } else {
            String::new()
        }
    );
    let _ = writeln!(
        markdown,
        "|---|---|{}---:|---:|---:|---:|---|",
        if args.fixture_mib > 0 { "---:|---:|" } else { "" }
    );
    let mut seed = args.seed;
    let mut failures = Vec::new();
    let mut first = true;
    for &mbit in &args.rates {
        for &rtt_ms in &args.rtts {
            for &loss_pct in &args.losses {
                let cell = Cell {
                    mbit,
                    rtt_ms,
                    loss_pct,
                };
                let relay = Relay::start(
                    &wan.server_tun,
                    &wan.client_tun,
                    cell.shape(args, seed),
                    cell.shape(args, seed ^ 0x5555),
                    args.mtu,
                )?;
                seed += 1;
                if first {
                    // Through the link: the servers are reachable from the client side.
                    warm_up(&clients, &wan, &servers, args)?;
                    first = false;
                }
                let results = measure_cell(&clients, &wan, &servers, args, &cell)?;
                let (down, up) = relay.stop()?;
                let relay_limited = capacity.is_some_and(|c| c < mbit as f64 * 0.9);
                for r in &results {
                    failures.extend(r.failures.iter().cloned());
                    let row = r.row(args, &cell, &down, &up, relay_limited);
                    eprintln!("wan: {row}");
                    let _ = writeln!(markdown, "{row}");
                    json_rows.push(r.json(&cell, args.mtu, &down, &up));
                    if let Some(mbits) = median(&r.small) {
                        bars.push((
                            format!("wan {} {}", cell.label(), r.sender.label()),
                            mbits / 8.388_608,
                        ));
                    }
                }
            }
        }
    }
    if !failures.is_empty() {
        let _ = writeln!(markdown, "\nFailed or timed-out samples ({}):\n", failures.len());
        for f in failures.iter().take(20) {
            let _ = writeln!(markdown, "- {f}");
        }
        if args.smoke {
            bail!(
                "wan smoke: {} download(s) failed: {}",
                failures.len(),
                failures.join("; ")
            );
        }
    }
    drop(servers);
    drop(wan);
    Ok(Section {
        title: "wan: downloads across an emulated WAN link (goodput, time to last byte)".to_owned(),
        markdown,
        json: json_rows.into(),
        bars,
    })
}

/// The fixture's first `len` bytes, the body the clients check against.
fn write_prefix(path: &Path, len: u64) -> Result<()> {
    let mut out = std::io::BufWriter::new(
        fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
    );
    webship_testkit::fixture::generate(len, |chunk| out.write_all(chunk))?;
    out.flush()?;
    Ok(())
}

/// Webship's h3 DPLPMTUD ceiling for links of `mtu`: their IPv4 UDP payload, or
/// `None` at 1500, where `auto` already gives 1452. (`auto` takes 1452 on any TUN
/// device, which is point-to-point, so other sizes need the number.)
fn h3_ceiling(mtu: u32) -> Option<u32> {
    (mtu != 1500).then(|| mtu - 28)
}

/// Webship's command line for `instance`, its configuration written: one worker,
/// listening on the server namespace's address, `[kernel] bbr` as the instance says.
fn webship_command(args: &WanArgs, s: &Settings<'_>, instance: Instance) -> Result<Command> {
    let bbr = if instance == Instance::Bbr { "auto" } else { "off" };
    let config = format!(
        "listen = \"{SERVER_ADDR}:{port}\"\nworkers = {workers}\nroot = {root:?}\n\n\
         [tls]\ncert = {cert:?}\nkey = {key:?}\n\n\
         [kernel]\nktls = \"auto\"\nbbr = \"{bbr}\"\nbpf_pin_dir = \"/sys/fs/bpf/webship-bench-wan-{pid}-{port}\"\n{mtu}",
        port = instance.port(),
        workers = s.workers,
        root = s.root,
        cert = s.identity.cert,
        key = s.identity.key,
        pid = std::process::id(),
        mtu = h3_ceiling(args.mtu).map_or_else(String::new, |ceiling| {
            format!("\n[runtime.settings]\nh3_mtu_upper_bound_bytes = \"{ceiling}\"\n")
        }),
    );
    let path = s.dir.join("webship.toml");
    fs::write(&path, config).with_context(|| format!("writing {}", path.display()))?;
    let mut command = Command::new(&args.webship);
    command.arg("serve").arg("--config").arg(&path);
    Ok(command)
}

/// Waits until `process` logs `line` (it cannot be probed from this namespace).
fn wait_logged(process: &mut Process, line: &str) -> Result<()> {
    let deadline = Instant::now() + READY_TIMEOUT;
    while Instant::now() < deadline {
        if let Some(status) = process.exited() {
            bail!(
                "{} exited during startup ({status}); log:\n{}",
                process.name(),
                process.log_tail()
            );
        }
        if process.log().contains(line) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!(
        "{} logged no {line:?} within {READY_TIMEOUT:?}; log:\n{}",
        process.name(),
        process.log_tail()
    )
}

fn fetch<'a>(client_ns: &'a Path, sender: Sender, file: &str, len: u64, max: Duration) -> Fetch<'a> {
    let port = sender.server().port();
    Fetch {
        what: format!("{} GET https://{SERVER_ADDR}:{port}/{file}", sender.label()),
        protocol: sender.protocol(),
        addr: format!("{SERVER_ADDR}:{port}"),
        host: "localhost",
        path: format!("/{file}"),
        len,
        tls: true,
        sha256: None,
        max_time: max,
        netns: Some(client_ns),
    }
}

/// One untimed 1 MiB download per sender, retried for a few seconds: the servers
/// answer across the link before anything is timed.
fn warm_up(clients: &Clients, wan: &Wan, servers: &Servers, args: &WanArgs) -> Result<()> {
    let client_ns = wan.client_path();
    for sender in Sender::ALL {
        if servers.pid(sender.server()).is_none() {
            continue;
        }
        let mut tries = 0;
        loop {
            match clients.fetch(&fetch(
                &client_ns,
                sender,
                SMALL_FILE,
                SMALL,
                Duration::from_secs(args.max_secs),
            )) {
                Ok(_) => break,
                Err(e) if tries < 5 => {
                    tries += 1;
                    eprintln!("wan: warm-up {}: {e:#}; retrying", sender.label());
                    std::thread::sleep(Duration::from_millis(500));
                }
                Err(e) => return Err(e.context("the first download through the emulated link")),
            }
        }
    }
    Ok(())
}

/// One sender's results on one link.
#[derive(Debug)]
struct SenderResult {
    sender: Sender,
    /// Goodput of each completed download, Mbit/s, and its time to last byte, ms.
    bulk: Vec<f64>,
    bulk_ms: Vec<f64>,
    small: Vec<f64>,
    small_ms: Vec<f64>,
    server_ticks: u64,
    bytes: u64,
    failures: Vec<String>,
}

fn measure_cell(
    clients: &Clients,
    wan: &Wan,
    servers: &Servers,
    args: &WanArgs,
    cell: &Cell,
) -> Result<Vec<SenderResult>> {
    let client_ns = wan.client_path();
    let max = Duration::from_secs(args.max_secs);
    let senders: Vec<Sender> = Sender::ALL
        .into_iter()
        .filter(|s| servers.pid(s.server()).is_some())
        .collect();
    let mut results: Vec<SenderResult> = senders
        .iter()
        .map(|&sender| SenderResult {
            sender,
            bulk: Vec::new(),
            bulk_ms: Vec::new(),
            small: Vec::new(),
            small_ms: Vec::new(),
            server_ticks: 0,
            bytes: 0,
            failures: Vec::new(),
        })
        .collect();
    let bulk_rounds = if args.fixture_mib > 0 {
        args.fixture_samples
    } else {
        0
    };
    let rounds = bulk_rounds.max(args.samples);
    for round in 0..rounds {
        for r in &mut results {
            let Some(pid) = servers.pid(r.sender.server()) else {
                continue;
            };
            let mut jobs = Vec::new();
            if round < bulk_rounds {
                jobs.push((FIXTURE_FILE, args.fixture_mib << 20));
            }
            if round < args.samples {
                jobs.push((SMALL_FILE, SMALL));
            }
            for (file, len) in jobs {
                let before = cpu_ticks(pid);
                let got = clients.fetch(&fetch(&client_ns, r.sender, file, len, max));
                r.server_ticks += cpu_ticks(pid).saturating_sub(before);
                match got {
                    Ok(sample) => {
                        r.bytes += sample.size;
                        let mbits = sample.size as f64 * 8.0 / sample.seconds / 1e6;
                        let (rates, times) = if file == SMALL_FILE {
                            (&mut r.small, &mut r.small_ms)
                        } else {
                            (&mut r.bulk, &mut r.bulk_ms)
                        };
                        rates.push(mbits);
                        times.push(sample.seconds * 1000.0);
                    }
                    Err(e) => r
                        .failures
                        .push(format!("{}, {}: {e:#}", cell.label(), r.sender.label())),
                }
            }
        }
    }
    Ok(results)
}

impl SenderResult {
    fn cpu_s_per_gb(&self) -> Option<f64> {
        (self.bytes > 0)
            .then(|| self.server_ticks as f64 / clock_ticks_per_second() / (self.bytes as f64 / 1e9))
    }

    fn row(&self, args: &WanArgs, cell: &Cell, down: &Counts, up: &Counts, relay_limited: bool) -> String {
        let num =
            |v: Option<f64>, places: usize| v.map_or_else(|| "—".to_owned(), |v| format!("{v:.places$}"));
        let bulk = if args.fixture_mib > 0 {
            format!(
                "{} | {} | ",
                num(median(&self.bulk), 1),
                num(median(&self.bulk_ms), 0)
            )
        } else {
            String::new()
        };
        let timed_out = if self.failures.is_empty() {
            String::new()
        } else {
            format!(" ({} failed)", self.failures.len())
        };
        format!(
            "| {}{} | {}{timed_out} | {bulk}{} | {} | {} | {} | {} / {} |",
            cell.label(),
            if relay_limited { " (relay-limited)" } else { "" },
            self.sender.label(),
            num(median(&self.small), 1),
            num(median(&self.small_ms), 0),
            num(percentile(&self.small_ms, 0.99), 0),
            num(self.cpu_s_per_gb(), 2),
            down.lost + up.lost,
            down.overflow + up.overflow + down.over_cap + up.over_cap,
        )
    }

    fn json(&self, cell: &Cell, mtu: u32, down: &Counts, up: &Counts) -> serde_json::Value {
        let opt = |v: Option<f64>| v.map(|v| fixed(v, 3));
        json!({
            "link": { "mbit_s": cell.mbit, "rtt_ms": cell.rtt_ms, "loss_pct": cell.loss_pct, "mtu": mtu },
            "sender": self.sender.label(),
            "bulk_mbit_s": self.bulk.iter().map(|v| fixed(*v, 3)).collect::<Vec<_>>(),
            "bulk_ttlb_ms": self.bulk_ms.iter().map(|v| fixed(*v, 1)).collect::<Vec<_>>(),
            "small_mbit_s": self.small.iter().map(|v| fixed(*v, 3)).collect::<Vec<_>>(),
            "small_ttlb_ms": self.small_ms.iter().map(|v| fixed(*v, 1)).collect::<Vec<_>>(),
            "small_p50_ms": opt(median(&self.small_ms)),
            "small_p99_ms": opt(percentile(&self.small_ms, 0.99)),
            "server_cpu_s_per_gb": opt(self.cpu_s_per_gb()),
            "failures": self.failures,
            "link_down": counts_json(down),
            "link_up": counts_json(up),
        })
    }
}

/// The cell's link counters for one direction (the relay shared by every sender).
fn counts_json(c: &Counts) -> serde_json::Value {
    json!({
        "packets": c.packets, "delivered": c.delivered, "lost": c.lost,
        "queue_drops": c.overflow, "cap_drops": c.over_cap, "max_queue_bytes": c.max_queue_bytes,
    })
}

fn median(v: &[f64]) -> Option<f64> {
    percentile(v, 0.5)
}

/// What the relay carries: a plain TCP stream (the server namespace's CUBIC)
/// from the server side to the client side, first with no shaping at all (the
/// relay's own ceiling on this host), then at each configured rate with 20 ms RTT
/// and no loss. Returns the unshaped Mbit/s.
fn self_test(
    wan: &Wan,
    args: &WanArgs,
    markdown: &mut String,
    json_rows: &mut Vec<serde_json::Value>,
) -> Result<Option<f64>> {
    let _ = writeln!(
        markdown,
        "Relay self-test: one plain TCP stream (CUBIC) for {} s through the relay.\n\n\
         | link | TCP Mbit/s | link drops (loss / queue) |\n|---|---:|---|",
        args.selftest_secs
    );
    let mut unshaped = None;
    let mut links = vec![None];
    links.extend(args.rates.iter().map(|&r| {
        Some(Cell {
            mbit: r,
            rtt_ms: 20,
            loss_pct: 0.0,
        })
    }));
    for link in links {
        let shape = link.map_or(
            Shape {
                rate_bps: 0,
                delay: Duration::ZERO,
                jitter: Duration::ZERO,
                loss: 0.0,
                queue_bytes: 0,
                seed: 0,
            },
            |c| c.shape(args, 0),
        );
        let relay = Relay::start(&wan.server_tun, &wan.client_tun, shape, shape, args.mtu)?;
        let mbits = tcp_stream(wan, args.selftest_secs);
        let (down, up) = relay.stop()?;
        let mbits = mbits?;
        let label = link.map_or_else(|| "no shaping (the relay's ceiling)".to_owned(), |c| c.label());
        if link.is_none() {
            unshaped = Some(mbits);
        }
        let line = format!(
            "| {label} | {mbits:.0} | {} / {} |",
            down.lost + up.lost,
            down.overflow + up.overflow + down.over_cap + up.over_cap
        );
        eprintln!("wan: self-test {line}");
        let _ = writeln!(markdown, "{line}");
        json_rows.push(json!({ "self_test": label, "tcp_mbit_s": fixed(mbits, 1) }));
    }
    Ok(unshaped)
}

/// Mbit/s of one plain TCP stream, server namespace to client namespace.
fn tcp_stream(wan: &Wan, seconds: u64) -> Result<f64> {
    let exe = std::env::current_exe().context("locating this executable")?;
    let listen = SocketAddr::from((CLIENT_ADDR, 5201));
    let sink = Command::new("nsenter")
        .arg(format!("--net={}", wan.client_path().display()))
        .arg("--")
        .arg(&exe)
        .args([
            "wan-tcp",
            "--listen",
            &listen.to_string(),
            "--seconds",
            &seconds.to_string(),
        ])
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the self-test's receiver")?;
    let mut source = Command::new(&exe);
    source.args([
        "wan-tcp",
        "--connect",
        &listen.to_string(),
        "--seconds",
        &seconds.to_string(),
    ]);
    let sent = wan.in_server(&source).status();
    // The receiver ends by itself (EOF, or its own deadline); its output is the result.
    let out = sink
        .wait_with_output()
        .context("waiting for the self-test's receiver")?;
    ensure!(sent.is_ok_and(|s| s.success()), "the self-test's sender failed");
    let text = String::from_utf8_lossy(&out.stdout);
    let fields: Vec<f64> = text.split_whitespace().filter_map(|f| f.parse().ok()).collect();
    let [bytes, secs] = fields[..] else {
        bail!("the self-test's receiver said {text:?}");
    };
    ensure!(
        secs > 0.0 && bytes > 0.0,
        "the self-test moved nothing ({text:?})"
    );
    Ok(bytes * 8.0 / secs / 1e6)
}

/// `wan-tcp`: the self-test's sender or receiver.
pub(crate) fn tcp(args: &WanTcpArgs) -> Result<()> {
    let seconds = Duration::from_secs(args.seconds);
    if let Some(listen) = args.listen {
        let listener = TcpListener::bind(listen).with_context(|| format!("binding {listen}"))?;
        listener.set_nonblocking(true)?;
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut conn = loop {
            match listener.accept() {
                Ok((conn, _)) => break conn,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => return Err(e).context("no sender connected within 10 s"),
            }
        };
        conn.set_nonblocking(false)?;
        conn.set_read_timeout(Some(Duration::from_secs(2)))?;
        let mut buf = vec![0u8; 1 << 16];
        let (mut bytes, mut first, mut last) = (0u64, None, Instant::now());
        let stop = Instant::now() + seconds + Duration::from_secs(10);
        while Instant::now() < stop {
            match conn.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    first.get_or_insert_with(Instant::now);
                    bytes += n as u64;
                    last = Instant::now();
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    break
                }
                Err(e) => return Err(e).context("reading"),
            }
        }
        let secs = first.map_or(0.0, |f| (last - f).as_secs_f64());
        println!("{bytes} {secs:.6}");
        return Ok(());
    }
    let Some(connect) = args.connect else {
        bail!("wan-tcp: give --listen or --connect");
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut conn = loop {
        match TcpStream::connect_timeout(&connect, Duration::from_secs(2)) {
            Ok(conn) => break conn,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(e).with_context(|| format!("connecting to {connect}")),
        }
    };
    conn.set_write_timeout(Some(Duration::from_secs(5)))?;
    let buf = vec![0u8; 1 << 16];
    let end = Instant::now() + seconds;
    while Instant::now() < end {
        conn.write_all(&buf).context("writing")?;
    }
    conn.shutdown(std::net::Shutdown::Write)?;
    Ok(())
}
