//! `h3-get`: a minimal HTTP/3 download client, the h3 cells' client.
//!
//! The runner starts this subcommand of its own binary as a separate process,
//! exactly where it starts `get` for h1 and h2: the client's CPU is then never
//! counted as server CPU, and the runner measures it the same way for both.
//!
//! One GET on a fresh connection (the test kit's quinn + h3 client, TLS 1.3,
//! ALPN `h3`, the bench CA as the only root). The body is compared with the
//! fixture byte for byte as it arrives ([`FixtureCheck`]) and dropped, never
//! buffered whole. The time runs from before the QUIC handshake to the last
//! body byte, as curl's `time_total` does; seeding aws-lc's random generator
//! is done before it. Output, on stdout (as `get`'s):
//!
//! ```text
//! <bytes> <seconds> <status>
//! exact | <how the body differs from the fixture>
//! <key=value transport notes>
//! ```
//!
//! The client is sized so that it is not what limits a bulk download
//! ([`H3Options::bulk`]): large flow-control windows, large UDP socket buffers,
//! receive payloads up to the QUIC maximum.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use clap::Args;
use webship_testkit::body::FixtureCheck;
use webship_testkit::fixture::FIXTURE_LEN;
use webship_testkit::h3::{endpoint, H3Client, H3Options};
use webship_testkit::pki::{client_config, roots_from_pem};

use crate::clients::{run_client, Download};
use crate::proc::udp_socket_drops;

#[derive(Debug, Args)]
pub(crate) struct H3GetArgs {
    /// Server UDP address, e.g. 127.0.0.1:8443.
    #[arg(long)]
    pub addr: SocketAddr,
    /// TLS server name (also the request authority).
    #[arg(long, default_value = "localhost")]
    pub sni: String,
    /// Request path, e.g. /fixture.bin.
    #[arg(long)]
    pub path: String,
    /// PEM file with the certificate(s) to trust; nothing else is trusted.
    #[arg(long)]
    pub ca: PathBuf,
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

pub(crate) fn run(args: &H3GetArgs) -> Result<()> {
    run_client(&format!("h3-get {}", args.addr), args.max_time, get(args))
}

/// TLS 1.3 only (QUIC's), the certificates in `ca` as the only roots.
pub(crate) fn quic_tls(ca: &Path) -> Result<Arc<rustls::ClientConfig>> {
    client_config(roots_from_pem(ca)?, &[&rustls::version::TLS13], &[b"h3"])
}

async fn get(args: &H3GetArgs) -> Result<Download> {
    // One client per download: its receive buffer may pass rmem_max (root), so a
    // burst the server or a relay sends while this process is off its CPU is not
    // lost on its own socket and counted against the server.
    let options = H3Options {
        force_receive_buffer: true,
        ..H3Options::bulk()
    };
    let tls = quic_tls(&args.ca)?;
    let (endpoint, rcvbuf) = endpoint(args.addr, &tls, &options)?;

    crate::tcpclient::warm_up_rng()?;
    let start = Instant::now();
    let mut client = H3Client::connect_on(endpoint, args.addr, &args.sni, &options).await?;
    let mut check = FixtureCheck::new(args.sha256);
    let head = client.fetch_into("GET", &args.path, &[], &mut check).await?;
    let seconds = start.elapsed().as_secs_f64();

    let stats = client.connection().stats();
    let avg_datagram = stats
        .udp_rx
        .bytes
        .checked_div(stats.udp_rx.datagrams)
        .unwrap_or(0);
    let drops = client
        .endpoint()
        .local_addr()
        .ok()
        .and_then(|local| udp_socket_drops(local.port()))
        .map_or_else(|| "?".to_owned(), |n| n.to_string());
    let notes = format!(
        "rx_datagrams={} rx_avg_datagram_bytes={avg_datagram} client_socket_drops={drops} \
         client_rtt_us={} client_rcvbuf={rcvbuf}",
        stats.udp_rx.datagrams,
        stats.path.rtt.as_micros(),
    );
    client.close().await;

    Ok(Download::checked(head.status, seconds, check, args.len, notes))
}
