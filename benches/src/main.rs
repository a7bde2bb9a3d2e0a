//! Benchmark runner for Webship.
//!
//! Absolute numbers depend on the host, so every comparison here is made
//! within one run: `aead` picks the rustls crypto provider by measuring both
//! on this CPU, and `download` (the default) serves one fixture from Webship
//! and from its peers (nginx, lighttpd, HAProxy, Caddy, h2o, Pingora, Bun) side by side,
//! directly and through each as a TLS-terminating reverse proxy, and reports
//! the ratios, beside the limit of the machine (the client against a plain-HTTP
//! sendfile server and against a TLS server sending from memory). The hidden
//! `get`, `h3-get` and `wt-get` are the clients `download` runs as child
//! processes, and the hidden `tls-source` is the memory-to-memory TLS baseline.
//! `wan` runs the same clients across an emulated WAN link (network namespaces
//! joined by its own relay) to compare congestion controls.

mod aead;
mod clients;
mod concurrency;
mod connections;
mod cores;
mod h3client;
mod idleclient;
mod measure;
mod peers;
mod proc;
mod report;
mod servers;
mod tcpclient;
mod tickets;
mod tlssource;
mod wan;
mod wtbench;
mod wtclient;

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(about = "Webship benchmarks: ratios against peers measured in the same run")]
#[command(args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Without a subcommand the runner downloads, so these options apply directly.
    #[command(flatten)]
    download: DownloadArgs,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// AES-GCM seal throughput and in-memory rustls throughput, aws-lc-rs vs ring.
    Aead,
    /// Download a ~100 MB fixture over h1, h2 and h3 from Webship and its peers
    /// (nginx, lighttpd, HAProxy, Caddy, h2o, Pingora, Bun), directly and through each as a
    /// TLS-terminating proxy (default).
    Download(DownloadArgs),
    /// One HTTP/1.1 or HTTP/2 GET, body hashed and dropped: the h1/h2 cells' client.
    #[command(hide = true)]
    Get(tcpclient::GetArgs),
    /// One HTTP/3 GET, body hashed and dropped: the h3 cells' client (run by `download`).
    #[command(name = "h3-get", hide = true)]
    H3Get(h3client::H3GetArgs),
    /// The memory-to-memory TLS baseline's server (run by `download`).
    #[command(name = "tls-source", hide = true)]
    TlsSource(tlssource::TlsSourceArgs),
    /// 1, 16 and 256 concurrent downloads over one h2 and one h3 connection, and
    /// over 256 h1 connections: aggregate throughput, p50/p99 time to last byte,
    /// server peak RSS.
    Concurrency(concurrency::ConcurrencyArgs),
    /// Connections at rest: N idle h1/h2/h3 connections (and N slow downloads) per
    /// mode and server; server RSS and kernel memory per connection, accept rate, a
    /// normal download's time while they are held.
    Connections(connections::ConnectionsArgs),
    /// TLS 1.3 handshakes alternating between two daemons, with keys of their own and
    /// with a shared `[tls] ticket_keys` file: the resumed share and server CPU per
    /// 1,000 handshakes.
    Tickets(tickets::TicketsArgs),
    /// Idle connections to a server started by hand, held for a while (profiling).
    #[command(hide = true)]
    Hold(connections::HoldArgs),
    /// WebTransport from the diagnostic endpoint (one stream, datagrams) directly and
    /// through HTTP/3 passthrough, next to an h3 download of the fixture.
    Webtransport(wtbench::WtBenchArgs),
    /// A WebTransport session to a diagnostic endpoint in source mode: one stream
    /// or a run of datagrams, received and counted (the WebTransport cells' client).
    #[command(name = "wt-get", hide = true)]
    WtGet(wtclient::WtGetArgs),
    /// Downloads across an emulated WAN link (two network namespaces joined by a
    /// relay with rate, delay, jitter, loss and a bounded queue): h2 with kernel BBR
    /// and CUBIC, h3 CUBIC, h3 with the BBR switch and Caddy's h3 (needs root).
    Wan(wan::WanArgs),
    /// The WAN scenario's plain-TCP self-test: one end of the stream.
    #[command(name = "wan-tcp", hide = true)]
    WanTcp(wan::WanTcpArgs),
}

#[derive(Debug, Args)]
pub struct DownloadArgs {
    /// The Webship binary to benchmark (build it with `cargo build --release -p webship`).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../target/release/webship"))]
    pub webship: PathBuf,
    /// The nginx binary: a peer, and the proxies' origin in proxy mode.
    #[arg(long, default_value = "/usr/sbin/nginx")]
    pub nginx: PathBuf,
    /// Accepted timed samples per cell (server, mode, protocol).
    #[arg(long, default_value_t = 7, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub samples: u32,
    /// The lighttpd binary (a peer in direct mode; skipped if missing).
    #[arg(long, default_value = "/usr/sbin/lighttpd")]
    pub lighttpd: PathBuf,
    /// The HAProxy binary (a peer in proxy mode; skipped if missing).
    #[arg(long, default_value = "/usr/sbin/haproxy")]
    pub haproxy: PathBuf,
    /// The Caddy binary (a peer in both modes; skipped if missing).
    #[arg(long, default_value = "/usr/bin/caddy")]
    pub caddy: PathBuf,
    /// The h2o binary (a peer for files and as a proxy; skipped if missing).
    #[arg(long, default_value = "/usr/bin/h2o")]
    pub h2o: PathBuf,
    /// The Pingora proxy (a peer in proxy mode; skipped if missing). Built from
    /// `benches/peers/pingora-proxy` by `cargo xtask build-peers`.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../target/peers/pingora/release/pingora-proxy"))]
    pub pingora: PathBuf,
    /// The Bun binary (a peer in direct mode; skipped if missing). The npm package
    /// `bun`, installed by `cargo xtask build-peers`.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../target/peers/bun/node_modules/bun/bin/bun.exe"))]
    pub bun: PathBuf,
    /// Which peers to run, comma-separated (each is skipped if its binary is missing).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "nginx,lighttpd,haproxy,caddy,h2o,pingora,bun"
    )]
    pub peers: Vec<String>,
    /// CI's check that the harness works: one accepted sample per Webship cell,
    /// no peers, no GSO-off comparison; fails if any Webship cell has none.
    #[arg(long)]
    pub smoke: bool,
    /// Worker count for every server. The default of 1 gives each server one core and
    /// leaves the other core of a two-core host to the client, so neither side starves.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub workers: u32,
    /// Webship's `[kernel] ktls` policy: auto, required or off.
    #[arg(long, default_value = "auto")]
    pub ktls: String,
    /// Where the fixture is kept between runs (it is regenerated if size or digest differ).
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
    /// Which cells to measure, comma-separated: `direct` (each server sends the
    /// fixture from disk), `proxy` (each terminates TLS in front of a plain-HTTP nginx origin),
    /// `passthrough` (each routes TLS by SNI to a TLS origin without decrypting).
    #[arg(long, value_delimiter = ',', default_value = "direct,proxy,passthrough")]
    pub modes: Vec<measure::Mode>,
    /// The scenarios measured after the matrix into the same report, comma-separated
    /// (`concurrency`, `webtransport`, `connections`); `--scenarios` with no value runs
    /// none, and so does `--smoke` (CI smoke-tests each on its own).
    #[arg(long, value_delimiter = ',', num_args = 0.., default_value = "concurrency,webtransport,connections")]
    pub scenarios: Vec<measure::Scenario>,
    /// Also write the results as JSON to this file (they always go to target/bench/report.json).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Also measure `webship scraped` beside `webship` in direct and proxy mode: the
    /// same daemon with its admin listener, whose `/metrics` this runner fetches every
    /// second for the whole run (the cost of metrics collection and scraping, as
    /// server CPU-s/GB scraped over not scraped).
    #[arg(long)]
    pub scrape: bool,
    /// Webship's `h3_mtu_upper_bound_bytes` (the DPLPMTUD ceiling) for the h3 cells;
    /// Webship's default when absent.
    #[arg(long, value_name = "BYTES", value_parser = clap::value_parser!(u16).range(1200..=65527))]
    pub h3_mtu: Option<u16>,
    /// Another Webship build measured beside `--webship` in direct and proxy mode, as
    /// `LABEL=PATH` (e.g. `jemalloc=target/alloc/webship-jemalloc`); repeatable, at
    /// most 4. Each appears as a peer column "webship LABEL" in the same rounds.
    #[arg(long, value_name = "LABEL=PATH", value_parser = measure::parse_compare)]
    pub compare: Vec<measure::Compare>,
}

/// Whether this process runs as root (namespaces, TUN devices).
pub(crate) fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    // The pin folders, with their pins, of bench and test daemons a killed run left
    // behind: those no process holds that are older than a minute.
    webship_testkit::pins::sweep();
    match cli.command.unwrap_or(Command::Download(cli.download)) {
        Command::Aead => aead::run(),
        Command::Download(args) => measure::run(&args),
        Command::Get(args) => tcpclient::run(&args),
        Command::H3Get(args) => h3client::run(&args),
        Command::TlsSource(args) => tlssource::run(&args),
        Command::WtGet(args) => wtclient::run(&args),
        Command::Webtransport(args) => wtbench::run(&args),
        Command::Concurrency(args) => concurrency::run(&args),
        Command::Connections(args) => connections::run(&args),
        Command::Hold(args) => connections::hold(&args),
        Command::Tickets(args) => tickets::run(&args),
        Command::Wan(args) => wan::run(&args),
        Command::WanTcp(args) => wan::tcp(&args),
    }
}
