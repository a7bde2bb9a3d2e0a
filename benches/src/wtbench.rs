//! `webtransport`: WebTransport throughput from the diagnostic endpoint's source
//! mode, directly and through HTTP/3 passthrough (userspace relay and the eBPF
//! redirect), next to a plain HTTP/3 download of the fixture from the same origin,
//! interleaved in one run.
//!
//! Each sample: the fixture over h3 (`h3-get`), the fixture's bytes on one
//! WebTransport stream (`wt-get --stream`, SHA-256 checked), and a run of datagrams
//! (`wt-get --datagrams`, loss counted at the receiver). A stream sample counts only
//! with exact bytes; a datagram sample reports what arrived and what was lost.
//! Server CPU is the origin's plus the front's, per GB received.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, ensure, Context, Result};
use clap::Args;

use serde_json::json;
use webship_testkit::fixture::{hex, FIXTURE_LEN};

use crate::clients::{Clients, Protocol};
use crate::proc::{clock_ticks_per_second, cpu_ticks};
use crate::report::{fixed, Section};
use crate::servers::{self, Server, Settings, Stage, WebshipSpec};

#[derive(Debug, Args)]
pub(crate) struct WtBenchArgs {
    /// The Webship binary (build it with `cargo build --release -p webship`).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../target/release/webship"))]
    pub webship: PathBuf,
    /// Samples per cell.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub samples: u32,
    /// Datagrams per datagram sample.
    #[arg(long, default_value_t = 50_000)]
    pub datagrams: u64,
    /// Datagram size (with its 8-byte sequence number).
    #[arg(long, default_value_t = 1100)]
    pub size: usize,
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub workers: u32,
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
}

const CELLS: [&str; 3] = ["h3 download", "WT stream", "WT datagrams"];

/// One target's measurements, per cell: (payload bytes, seconds, server CPU ticks).
#[derive(Default)]
struct Tally {
    samples: [Vec<(u64, f64, u64)>; 3],
    lost: u64,
    sent: u64,
}

/// `webtransport` on its own: the table on stdout and in target/bench/webtransport.md.
pub(crate) fn run(args: &WtBenchArgs) -> Result<()> {
    measure(args)?.publish("webtransport")
}

/// Every target × cell, interleaved, `args.samples` rounds; the table as a report section.
pub(crate) fn measure(args: &WtBenchArgs) -> Result<Section> {
    let stage = Stage::new(args.cache_dir.as_deref())?;
    let (root, identity, fixture) = (&stage.root, &stage.identity, &stage.fixture);
    let clients = Clients::new(&identity.ca)?;
    let spec = |name| WebshipSpec {
        name,
        binary: &args.webship,
        ktls: "auto",
        runtime: Vec::new(),
        scraped: false,
    };
    let (origin_dir, user_dir, ebpf_dir) = (
        stage.dir("origin")?,
        stage.dir("front-user")?,
        stage.dir("front-ebpf")?,
    );
    let settings = |d| Settings {
        root,
        identity,
        workers: args.workers,
        dir: d,
        hold: None,
    };
    let origin = servers::start_webship_webtransport(&spec("webship"), &settings(&origin_dir))?;
    let mut targets: Vec<(&str, Option<Server>)> = vec![("direct", None)];
    targets.push((
        "passthrough, udp userspace",
        Some(servers::start_webship_passthrough(
            &spec("webship passthrough"),
            &settings(&user_dir),
            origin.port,
            "udp=userspace",
        )?),
    ));
    match servers::start_webship_passthrough(
        &spec("webship passthrough"),
        &settings(&ebpf_dir),
        origin.port,
        "auto",
    ) {
        Ok(front) if front.log().contains("engine=\"ebpf\"") || front.log().contains("engine=ebpf") => {
            targets.push(("passthrough, udp eBPF", Some(front)));
        }
        Ok(front) => {
            eprintln!("webtransport bench: the eBPF UDP redirect is not in use here; that row is skipped");
            drop(front);
        }
        Err(e) => eprintln!("webtransport bench: no eBPF front ({e:#}); that row is skipped"),
    }

    let mut tallies: Vec<Tally> = targets.iter().map(|_| Tally::default()).collect();
    for round in 0..args.samples {
        for ((label, front), tally) in targets.iter().zip(tallies.iter_mut()) {
            let server = front.as_ref().unwrap_or(&origin);
            let pids: Vec<u32> = std::iter::once(origin.pid())
                .chain(front.as_ref().map(Server::pid))
                .collect();
            let ticks = || pids.iter().map(|p| cpu_ticks(*p)).sum::<u64>();
            for (cell, samples) in tally.samples.iter_mut().enumerate() {
                let before = ticks();
                let (bytes, seconds, lost) = match cell {
                    0 => {
                        // The client checks every byte against the fixture.
                        let s = clients.download(server, Protocol::H3, None)?;
                        (s.size, s.seconds, 0)
                    }
                    1 => wt_get(
                        &clients,
                        server,
                        &["--stream", &FIXTURE_LEN.to_string()],
                        Some(&hex(&fixture.sha256)),
                    )?,
                    _ => wt_get(
                        &clients,
                        server,
                        &[
                            "--datagrams",
                            &args.datagrams.to_string(),
                            "--size",
                            &args.size.to_string(),
                        ],
                        None,
                    )?,
                };
                samples.push((bytes, seconds, ticks().saturating_sub(before)));
                if cell == 2 {
                    tally.lost += lost;
                    tally.sent += args.datagrams;
                }
            }
            eprintln!(
                "webtransport bench: round {} of {}: {label} done",
                round + 1,
                args.samples
            );
        }
    }

    let hz = clock_ticks_per_second();
    let mut report = String::new();
    let mut json = Vec::new();
    let mut bars = Vec::new();
    let _ = writeln!(
        report,
        "WebTransport (source mode) next to an h3 download of the same fixture, {} samples per cell, interleaved; \
         median MiB/s (server CPU-seconds per GB received); datagrams: {} × {} bytes per sample, loss counted at the receiver.\n",
        args.samples, args.datagrams, args.size
    );
    let _ = writeln!(report, "| path | {} | datagrams lost |", CELLS.join(" | "));
    let _ = writeln!(report, "|---|---:|---:|---:|---:|");
    for ((label, _), tally) in targets.iter().zip(&tallies) {
        let cells: Vec<String> = tally
            .samples
            .iter()
            .zip(CELLS)
            .map(|(samples, cell)| {
                let mut rates: Vec<f64> = samples
                    .iter()
                    .map(|(b, s, _)| *b as f64 / s / 1_048_576.0)
                    .collect();
                rates.sort_by(f64::total_cmp);
                let median = rates.get(rates.len() / 2).copied().unwrap_or(0.0);
                let (bytes, ticks) = samples
                    .iter()
                    .fold((0u64, 0u64), |(b, t), (sb, _, st)| (b + sb, t + st));
                let cpu = ticks as f64 / hz / (bytes as f64 / 1e9);
                json.push(json!({
                    "path": label,
                    "cell": cell,
                    "samples": samples.len(),
                    "median_mib_s": fixed(median, 3),
                    "cpu_s_per_gb": fixed(cpu, 4),
                }));
                bars.push((format!("{cell}, {label}"), median));
                format!("{median:.1} ({cpu:.2})")
            })
            .collect();
        let _ = writeln!(
            report,
            "| {label} | {} | {} of {} |",
            cells.join(" | "),
            tally.lost,
            tally.sent
        );
        json.push(json!({
            "path": label,
            "cell": "datagrams lost",
            "lost": tally.lost,
            "sent": tally.sent,
        }));
    }
    Ok(Section {
        title: "WebTransport: the diagnostic endpoint's source mode, beside an h3 download".to_owned(),
        markdown: report,
        json: json.into(),
        bars,
    })
}

/// Runs `wt-get` against `server`: (payload bytes, seconds, datagrams lost).
fn wt_get(
    clients: &Clients,
    server: &Server,
    what: &[&str],
    sha256: Option<&str>,
) -> Result<(u64, f64, u64)> {
    let output = Command::new(&clients.exe)
        .args([
            "wt-get",
            "--addr",
            &format!("127.0.0.1:{}", server.port),
            "--sni",
            "localhost",
        ])
        .args(["--origin", "https://bench.webship", "--ca"])
        .arg(&clients.ca)
        .args(what)
        .env("RUST_BACKTRACE", "0")
        .output()
        .context("running wt-get")?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        bail!(
            "{}: wt-get {what:?} failed: {}",
            server.name,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    let mut lines = stdout.lines();
    let (Some(head), Some(digest), notes) = (lines.next(), lines.next(), lines.next().unwrap_or("")) else {
        bail!("unexpected wt-get output {stdout:?}");
    };
    let fields: Vec<&str> = head.split_whitespace().collect();
    let [bytes, seconds, _status] = fields[..] else {
        bail!("unexpected wt-get output {stdout:?}");
    };
    let (bytes, seconds): (u64, f64) = (bytes.parse()?, seconds.parse()?);
    if let Some(want) = sha256 {
        ensure!(
            bytes == FIXTURE_LEN && digest == want,
            "{}: WebTransport stream: {bytes} bytes with SHA-256 {digest}, expected {FIXTURE_LEN} with {want}",
            server.name
        );
    }
    let lost = notes
        .split_whitespace()
        .find_map(|p| p.strip_prefix("datagrams_lost="))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    Ok((bytes, seconds, lost))
}
