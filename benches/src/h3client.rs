//! `h3-get`: a minimal HTTP/3 download client, the h3 cells' client.
//!
//! The runner starts this subcommand of its own binary as a separate process,
//! exactly where it starts `get` for h1 and h2: the client's CPU is then never
//! counted as server CPU, and the runner measures it the same way for both.
//!
//! One GET on a fresh connection (quinn + h3, TLS 1.3, ALPN `h3`, the bench's
//! self-signed certificate as the only root). The body is compared with the
//! fixture byte for byte as it arrives ([`Checker`]) and dropped, never
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
//! The client is sized so that it is not what limits a bulk download: large
//! flow-control windows, large UDP socket buffers, receive payloads up to the
//! QUIC maximum (so a server probing a larger MTU is not capped here).

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use bytes::Buf;
use clap::Args;
use socket2::{Domain, Protocol, Socket, Type};

use crate::clients::{run_client, Download};
use crate::fixture::{Checker, FIXTURE_BYTES};
use crate::proc::udp_socket_drops;

/// Per-stream and per-connection receive windows: far above one bandwidth-delay
/// product on loopback, so flow control never holds the server back.
const STREAM_RECEIVE_WINDOW: u32 = 32 << 20;
const RECEIVE_WINDOW: u32 = 64 << 20;
/// Requested kernel socket buffers (best effort: capped by net.core.{r,w}mem_max).
const UDP_RECV_BUFFER: usize = 8 << 20;
const UDP_SEND_BUFFER: usize = 1 << 20;
/// The largest UDP payload QUIC allows (RFC 9000 §18.2); advertised so that the
/// server's path MTU discovery is bounded by its own setting, not by ours.
const MAX_UDP_PAYLOAD: u16 = 65_527;
const IDLE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the close is given to reach the server after the body is read.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

#[derive(Debug, Args)]
pub struct H3GetArgs {
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
}

pub fn run(args: &H3GetArgs) -> Result<()> {
    run_client(&format!("h3-get {}", args.addr), args.max_time, get(args))
}

async fn get(args: &H3GetArgs) -> Result<Download> {
    let (endpoint, rcvbuf) = endpoint(args.addr, &args.ca, |_| {})?;
    let authority = format!("{}:{}", args.sni, args.addr.port());
    let request = http::Request::get(format!("https://{authority}{}", args.path))
        .body(())
        .context("building the request")?;

    crate::tcpclient::warm_up_rng()?;
    let start = Instant::now();
    let conn = endpoint
        .connect(args.addr, &args.sni)
        .context("starting the QUIC handshake")?
        .await
        .with_context(|| format!("QUIC handshake with {}", args.addr))?;
    let (mut driver, mut send) = h3::client::new(h3_quinn::Connection::new(conn.clone()))
        .await
        .context("HTTP/3 connection setup")?;
    // The connection (control streams, GOAWAY) is driven beside the request.
    let driver = tokio::spawn(async move {
        let _ = std::future::poll_fn(|cx| driver.poll_close(cx)).await;
    });

    let mut stream = send.send_request(request).await.context("sending the request")?;
    stream.finish().await.context("finishing the request stream")?;
    let response = stream
        .recv_response()
        .await
        .context("reading the response head")?;
    let mut check = if args.sha256 {
        Checker::with_sha256()
    } else {
        Checker::default()
    };
    while let Some(mut chunk) = stream.recv_data().await.context("reading the body")? {
        while chunk.has_remaining() {
            let data = chunk.chunk();
            check.update(data);
            let n = data.len();
            chunk.advance(n);
        }
    }
    let seconds = start.elapsed().as_secs_f64();

    let stats = conn.stats();
    let avg_datagram = stats
        .udp_rx
        .bytes
        .checked_div(stats.udp_rx.datagrams)
        .unwrap_or(0);
    let drops = endpoint
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

    drop(stream);
    drop(send);
    conn.close(0u32.into(), b"done");
    let _ = tokio::time::timeout(CLOSE_GRACE, endpoint.wait_idle()).await;
    driver.abort();

    Ok(Download {
        status: response.status().as_u16(),
        bytes: check.len(),
        seconds,
        verdict: check.verdict(FIXTURE_BYTES),
        notes,
    })
}

/// A client endpoint on a socket with large kernel buffers, configured to trust
/// only the bench certificate. Returns the receive buffer the kernel granted.
fn endpoint(
    server: SocketAddr,
    ca: &Path,
    tweak: impl FnOnce(&mut quinn::TransportConfig),
) -> Result<(quinn::Endpoint, usize)> {
    let (domain, local) = if server.is_ipv4() {
        (Domain::IPV4, SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))
    } else {
        (Domain::IPV6, SocketAddr::from((Ipv6Addr::LOCALHOST, 0)))
    };
    let socket = Socket::new(domain, Type::DGRAM, Some(Protocol::UDP)).context("creating the UDP socket")?;
    // Best effort: the kernel caps both at net.core.{r,w}mem_max.
    let _ = socket.set_recv_buffer_size(UDP_RECV_BUFFER);
    let _ = socket.set_send_buffer_size(UDP_SEND_BUFFER);
    let rcvbuf = socket.recv_buffer_size().unwrap_or(0);
    socket
        .bind(&local.into())
        .with_context(|| format!("binding {local}"))?;
    let socket: UdpSocket = socket.into();

    let mut config = quinn::EndpointConfig::default();
    config
        .max_udp_payload_size(MAX_UDP_PAYLOAD)
        .map_err(|e| anyhow!("max_udp_payload_size: {e}"))?;
    let mut endpoint = quinn::Endpoint::new(config, None, socket, Arc::new(quinn::TokioRuntime))
        .context("creating the QUIC endpoint")?;
    endpoint.set_default_client_config(client_config(ca, tweak)?);
    Ok((endpoint, rcvbuf))
}

/// The same client endpoint for other QUIC clients of the bench (WebTransport),
/// with their transport settings applied on top.
pub fn endpoint_for(
    server: SocketAddr,
    ca: &Path,
    tweak: impl FnOnce(&mut quinn::TransportConfig),
) -> Result<quinn::Endpoint> {
    endpoint(server, ca, tweak).map(|(endpoint, _)| endpoint)
}

/// TLS 1.3 only, ALPN `h3`, the certificates in `ca` as the only roots.
fn client_config(ca: &Path, tweak: impl FnOnce(&mut quinn::TransportConfig)) -> Result<quinn::ClientConfig> {
    let roots = crate::tcpclient::roots(ca)?;
    // An explicit provider: this crate enables both ring and aws-lc-rs (for the
    // `aead` comparison), so rustls has no single default to pick.
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .context("TLS 1.3 with the aws-lc-rs provider")?
        .with_root_certificates(roots)
        .with_no_client_auth();
    tls.alpn_protocols = vec![b"h3".to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(Arc::new(tls))
        .map_err(|e| anyhow!("rustls config unusable for QUIC: {e}"))?;

    let mut transport = quinn::TransportConfig::default();
    transport
        .stream_receive_window(STREAM_RECEIVE_WINDOW.into())
        .receive_window(RECEIVE_WINDOW.into())
        .max_idle_timeout(Some(
            IDLE_TIMEOUT
                .try_into()
                .map_err(|e| anyhow!("idle timeout: {e}"))?,
        ));
    tweak(&mut transport);
    let mut client = quinn::ClientConfig::new(Arc::new(crypto));
    client.transport_config(Arc::new(transport));
    Ok(client)
}
