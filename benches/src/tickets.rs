//! `tickets`: what shared session-ticket keys buy behind a load balancer. Two Webship
//! daemons stand for two hosts; one client makes N TLS 1.3 handshakes alternating
//! between them, each offering the newest ticket it holds (the one the other daemon
//! just issued), and fetches a small file so the tickets arrive. Run twice: each
//! daemon with keys of its own (the default), then both with the same
//! `[tls] ticket_keys` file. Reported: the share of handshakes that resumed, and the
//! daemons' CPU time (utime + stime from /proc/PID/stat) per 1,000 handshakes.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use clap::Args;
use rustls::client::Resumption;
use rustls::pki_types::ServerName;
use rustls::HandshakeKind;
use serde_json::json;
use webship_testkit::pki::{client_config, roots_from_pem};

use crate::proc::{clock_ticks_per_second, cpu_ticks};
use crate::report::{fixed, Section};
use crate::servers::{self, Server, Settings, WebshipSpec};

#[derive(Debug, Args, Clone)]
pub(crate) struct TicketsArgs {
    /// The Webship binary (build it with `cargo build --release -p webship`).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../target/release/webship"))]
    pub webship: PathBuf,
    /// Handshakes per run, alternating between the two daemons.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u32).range(2..=1_000_000))]
    pub handshakes: u32,
    /// Worker threads of each daemon.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub workers: u32,
}

/// Every read and write of one handshake's connection gives up after this long.
const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// The file each connection fetches: small, so the handshake dominates.
const SMALL: &[u8] = b"resume me\n";

pub(crate) fn run(args: &TicketsArgs) -> Result<()> {
    ensure!(
        args.webship.exists(),
        "{} is missing: build it with `cargo build --release -p webship`",
        args.webship.display()
    );
    let scratch = tempfile::Builder::new().prefix("webship-tickets-").tempdir()?;
    let root = scratch.path().join("root");
    std::fs::create_dir_all(&root)?;
    std::fs::write(root.join("small.txt"), SMALL)?;
    let identity = servers::write_identity(scratch.path())?;
    let keys = scratch.path().join("ticket.keys");
    let made = std::process::Command::new(&args.webship)
        .args(["ticket-keys", "new"])
        .output()
        .context("running `webship ticket-keys new`")?;
    ensure!(made.status.success(), "webship ticket-keys new failed");
    std::fs::write(&keys, &made.stdout)?;
    std::fs::set_permissions(
        &keys,
        <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o600),
    )?;
    let mut rows = Vec::new();
    for (label, file) in [
        ("keys per process", None),
        ("shared ticket_keys", Some(keys.as_path())),
    ] {
        let pair = [0, 1].map(|i| {
            let dir = scratch
                .path()
                .join(format!("{}-{i}", if file.is_some() { "shared" } else { "own" }));
            std::fs::create_dir_all(&dir)?;
            let s = Settings {
                root: &root,
                identity: &identity,
                workers: args.workers,
                dir: &dir,
                hold: None,
            };
            let spec = WebshipSpec {
                name: crate::measure::WEBSHIP,
                binary: &args.webship,
                ktls: "off",
                runtime: Vec::new(),
                scraped: false,
            };
            servers::start_webship_tickets(&spec, &s, file)
        });
        let [a, b] = pair;
        let pair = [a?, b?];
        rows.push(measure(label, &pair, &identity.ca, args.handshakes)?);
    }
    section(&rows, args.handshakes).publish("tickets")
}

struct Row {
    label: &'static str,
    resumed: u32,
    cpu_s: f64,
    wall: Duration,
}

fn measure(label: &'static str, pair: &[Server; 2], ca: &Path, n: u32) -> Result<Row> {
    let mut config = Arc::unwrap_or_clone(client_config(
        roots_from_pem(ca)?,
        &[&rustls::version::TLS13],
        &[b"http/1.1"],
    )?);
    config.resumption = Resumption::in_memory_sessions(64);
    let config = Arc::new(config);
    // One warm-up handshake each, not counted: the daemons' first-connection costs.
    for server in pair {
        handshake(&config, server)?;
    }
    let ticks = clock_ticks_per_second();
    let before: u64 = pair.iter().map(|s| cpu_ticks(s.pid())).sum();
    let begun = Instant::now();
    let mut resumed = 0;
    for i in 0..n {
        let server = &pair[i as usize % 2];
        if handshake(&config, server)
            .with_context(|| format!("{label}: handshake {i} with {}", server.port))?
            == HandshakeKind::Resumed
        {
            resumed += 1;
        }
    }
    let wall = begun.elapsed();
    let after: u64 = pair.iter().map(|s| cpu_ticks(s.pid())).sum();
    Ok(Row {
        label,
        resumed,
        cpu_s: (after - before) as f64 / ticks,
        wall,
    })
}

/// One connection: TLS 1.3 (resuming if the client holds a ticket for the name), a
/// GET of the small file read to the end, so the tickets sent after the handshake
/// are taken.
fn handshake(config: &Arc<rustls::ClientConfig>, server: &Server) -> Result<HandshakeKind> {
    let mut tcp = TcpStream::connect(("127.0.0.1", server.port))?;
    tcp.set_read_timeout(Some(IO_TIMEOUT))?;
    tcp.set_write_timeout(Some(IO_TIMEOUT))?;
    tcp.set_nodelay(true)?;
    let mut conn =
        rustls::ClientConnection::new(config.clone(), ServerName::try_from("localhost")?.to_owned())?;
    let mut tls = rustls::Stream::new(&mut conn, &mut tcp);
    tls.write_all(b"GET /small.txt HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")?;
    let mut response = Vec::with_capacity(512);
    // Bounded: the response is a few hundred bytes and the server closes after it.
    tls.take(64 * 1024).read_to_end(&mut response)?;
    ensure!(
        response.starts_with(b"HTTP/1.1 200") && response.ends_with(SMALL),
        "unexpected response: {}",
        String::from_utf8_lossy(&response)
    );
    conn.handshake_kind().context("the handshake did not complete")
}

fn section(rows: &[Row], n: u32) -> Section {
    let mut markdown = format!(
        "## Session tickets across two daemons\n\n{n} TLS 1.3 handshakes alternating between two \
         Webship daemons (each with one small GET), every one offering the newest ticket the \
         client holds; server CPU is both daemons' utime + stime.\n\n\
         | ticket keys | resumed | server CPU-s / 1000 handshakes | client wall s |\n|---|---|---|---|\n"
    );
    let mut json_rows = Vec::new();
    for r in rows {
        let share = f64::from(r.resumed) / f64::from(n) * 100.0;
        let per_1000 = r.cpu_s / f64::from(n) * 1000.0;
        markdown.push_str(&format!(
            "| {} | {:.1} % ({}/{n}) | {:.3} | {:.2} |\n",
            r.label,
            share,
            r.resumed,
            per_1000,
            r.wall.as_secs_f64()
        ));
        json_rows.push(json!({
            "keys": r.label,
            "handshakes": n,
            "resumed": r.resumed,
            "resumed_percent": fixed(share, 1),
            "server_cpu_s_per_1000": fixed(per_1000, 3),
            "wall_s": fixed(r.wall.as_secs_f64(), 2),
        }));
    }
    Section {
        title: "Session tickets".into(),
        markdown,
        json: json!(json_rows),
        bars: Vec::new(),
    }
}
