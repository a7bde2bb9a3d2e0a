//! The `connections` scenario's client: many TLS connections that do nothing after
//! their setup, and a few downloads read at a trickle, kept cheap because the client
//! shares the host with the server it measures.
//!
//! An idle h1 or h2 connection keeps only its TCP socket once set up: the server
//! cannot tell that the client dropped its TLS state, and 50,000 rustls client
//! states would cost the host more than the servers under test. HTTP/3 keeps its
//! quinn connection (QUIC needs its state to answer the server), several to one UDP
//! socket. Connections come from 127.0.0.1, .2, … in turn, so a level beyond one
//! address's ephemeral ports still fits.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use webship_testkit::h3::{H3Client, H3Options};
use webship_testkit::pki::with_alpn;

/// What an idle connection has done before it goes quiet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Idle {
    /// ALPN http/1.1, handshake done, no request.
    H1,
    /// ALPN h2, the preface and SETTINGS sent, the server's SETTINGS acknowledged, no stream.
    H2,
    /// QUIC handshake with ALPN h3 and the HTTP/3 control streams, no request.
    H3,
}

impl Idle {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::H1 => "h1",
            Self::H2 => "h2",
            Self::H3 => "h3",
        }
    }
}

/// Handshakes in flight at once: enough to keep a one-worker server busy, few enough
/// that no server's accept backlog (nginx and HAProxy use 511 or the kernel's cap)
/// overflows.
const IN_FLIGHT: usize = 64;
/// A connection's setup (TCP, TLS, h2 SETTINGS, QUIC) must finish within this.
const SETUP_TIMEOUT: Duration = Duration::from_secs(30);
/// Connections per source address: below the 28,232 ephemeral ports of Linux's
/// default range, so no address runs out.
const PER_SOURCE: usize = 20_000;
/// HTTP/3 connections per client UDP socket (quinn endpoint): each endpoint holds a
/// receive buffer sized for GRO batches, too much to give every connection one.
const H3_PER_ENDPOINT: usize = 16;
/// The client's QUIC PINGs: under quic-go's 30 s default idle timeout (Caddy), so
/// that no server's idle timeout is what is measured.
const H3_KEEP_ALIVE: Duration = Duration::from_secs(20);

/// How long the closing HTTP/3 connections get to send CONNECTION_CLOSE.
const H3_CLOSE_GRACE: Duration = Duration::from_millis(500);

/// Connections held open: TCP sockets (TLS state dropped) or HTTP/3 clients.
#[derive(Default)]
pub(crate) struct Held {
    tcp: Vec<TcpStream>,
    h3: Vec<H3Client>,
}

impl Held {
    pub(crate) fn len(&self) -> usize {
        self.tcp.len() + self.h3.len()
    }

    /// Closes everything: TCP by dropping (a FIN; the servers see EOF), HTTP/3 with
    /// CONNECTION_CLOSE so no server keeps state until its idle timeout.
    pub(crate) async fn close(self) {
        drop(self.tcp);
        if self.h3.is_empty() {
            return;
        }
        // All at once, then one grace for the endpoints to send them (closing one by
        // one waits a grace per connection).
        for client in &self.h3 {
            client.connection().close(0u32.into(), b"done");
        }
        tokio::time::sleep(H3_CLOSE_GRACE).await;
        drop(self.h3);
    }
}

/// Where the connections go: address, SNI, the client's TLS configuration.
#[derive(Clone)]
pub(crate) struct Target {
    pub addr: SocketAddr,
    pub sni: String,
    pub tls: Arc<rustls::ClientConfig>,
}

/// Opens `n` connections of `kind` to `target`, `IN_FLIGHT` at a time; the held
/// connections and how long opening all of them took. `request`: a path each h1 or
/// h2 connection GETs once, reading the whole response, before it goes quiet (the
/// server then holds a kept-alive connection, not a fresh one); HTTP/3 ignores it.
pub(crate) async fn open(
    target: &Target,
    kind: Idle,
    n: usize,
    request: Option<&str>,
) -> Result<(Held, Duration)> {
    let start = Instant::now();
    let gate = Arc::new(Semaphore::new(IN_FLIGHT));
    let mut held = Held::default();
    match kind {
        Idle::H1 | Idle::H2 => {
            let alpn: &[u8] = if kind == Idle::H1 { b"http/1.1" } else { b"h2" };
            let tls = with_alpn(&target.tls, alpn);
            let mut set = JoinSet::new();
            for i in 0..n {
                let permit = Arc::clone(&gate).acquire_owned().await?;
                let (tls, sni, addr) = (Arc::clone(&tls), target.sni.clone(), target.addr);
                let request = request.map(str::to_owned);
                set.spawn(async move {
                    let setup = open_tcp(addr, source(i), &sni, tls, kind, request.as_deref());
                    let opened = tokio::time::timeout(SETUP_TIMEOUT, setup)
                        .await
                        .map_err(|_| anyhow::anyhow!("connection {i}: setup not done in {SETUP_TIMEOUT:?}"))
                        .and_then(|r| r);
                    drop(permit);
                    opened
                });
                // Collect finished ones as we go, so errors surface early.
                while let Some(done) = set.try_join_next() {
                    held.tcp.push(done??);
                }
            }
            while let Some(done) = set.join_next().await {
                held.tcp.push(done??);
            }
        }
        Idle::H3 => {
            let options = H3Options {
                idle_timeout: Some(Duration::from_secs(u64::from(crate::servers::HOLD_TIMEOUT_SECS))),
                keep_alive: Some(H3_KEEP_ALIVE),
                max_udp_payload: Some(1452),
                ..H3Options::default()
            };
            let mut set = JoinSet::new();
            let mut endpoint = None;
            for i in 0..n {
                if i % H3_PER_ENDPOINT == 0 {
                    endpoint = Some(webship_testkit::h3::endpoint(target.addr, &target.tls, &options)?.0);
                }
                let endpoint = endpoint.clone().context("an endpoint exists")?;
                let permit = Arc::clone(&gate).acquire_owned().await?;
                let (sni, addr, options) = (target.sni.clone(), target.addr, options.clone());
                set.spawn(async move {
                    let opened = tokio::time::timeout(
                        SETUP_TIMEOUT,
                        H3Client::connect_on(endpoint, addr, &sni, &options),
                    )
                    .await
                    .map_err(|_| anyhow::anyhow!("h3 connection {i}: setup not done in {SETUP_TIMEOUT:?}"))
                    .and_then(|r| r);
                    drop(permit);
                    opened
                });
                while let Some(done) = set.try_join_next() {
                    held.h3.push(done??);
                }
            }
            while let Some(done) = set.join_next().await {
                held.h3.push(done??);
            }
        }
    }
    Ok((held, start.elapsed()))
}

/// The `i`th connection's source address: 127.0.0.1 for the first `PER_SOURCE`,
/// then 127.0.0.2, and so on (all of 127/8 is loopback).
fn source(i: usize) -> Ipv4Addr {
    let k = u8::try_from(1 + i / PER_SOURCE).unwrap_or(u8::MAX);
    Ipv4Addr::new(127, 0, 0, k)
}

async fn connect_from(addr: SocketAddr, from: Ipv4Addr) -> Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket
        .bind(SocketAddr::V4(SocketAddrV4::new(from, 0)))
        .with_context(|| format!("binding {from}"))?;
    socket
        .connect(addr)
        .await
        .with_context(|| format!("connecting {from} → {addr}"))
}

/// One TCP connection through the TLS handshake (and, for h2, the SETTINGS
/// exchange), then one GET of `request` if given; only its socket is kept.
async fn open_tcp(
    addr: SocketAddr,
    from: Ipv4Addr,
    sni: &str,
    tls: Arc<rustls::ClientConfig>,
    kind: Idle,
    request: Option<&str>,
) -> Result<TcpStream> {
    let tcp = connect_from(addr, from).await?;
    let mut stream = webship_testkit::http::tls(tcp, sni, tls)
        .await
        .with_context(|| format!("TLS handshake from {from}"))?;
    if kind == Idle::H2 {
        h2_settings(&mut stream).await?;
    }
    match (kind, request) {
        (Idle::H1, Some(path)) => h1_get(&mut stream, sni, path).await?,
        (Idle::H2, Some(path)) => h2_get(&mut stream, sni, path).await?,
        _ => {}
    }
    let (tcp, _) = stream.into_inner();
    Ok(tcp)
}

/// Bytes a response may take before the client gives up on it: the requests are of
/// a small file.
const RESPONSE_MAX: usize = 64 << 10;

/// One keep-alive HTTP/1.1 GET, read to the end of its `content-length` body.
async fn h1_get<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    stream: &mut S,
    host: &str,
    path: &str,
) -> Result<()> {
    let request = format!("GET {path} HTTP/1.1\r\nhost: {host}\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    stream.flush().await?;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = stream.read(&mut buf).await.context("reading the response")?;
        ensure!(n > 0, "the server closed before the response ended");
        got.extend_from_slice(&buf[..n]);
        ensure!(got.len() <= RESPONSE_MAX, "response over {RESPONSE_MAX} bytes");
        let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
        ensure!(head.starts_with("http/1.1 200"), "no 200 response: {head:?}");
        let length = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse::<usize>().ok())
            .context("a response without content-length")?;
        if got.len() >= end + 4 + length {
            return Ok(());
        }
    }
}

/// One GET on stream 1 of an h2 connection whose SETTINGS are exchanged, read until
/// the stream ends (HPACK by hand: static-table indices and plain literals).
async fn h2_get<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    stream: &mut S,
    host: &str,
    path: &str,
) -> Result<()> {
    const HEADERS: u8 = 1;
    const END_STREAM: u8 = 1;
    const END_HEADERS: u8 = 4;
    ensure!(path.len() < 127 && host.len() < 127, "path or host too long");
    // :method GET (2), :scheme https (7), :path and :authority as literals on
    // indexed names (4, 1) without indexing.
    let mut block = vec![0x82, 0x87, 0x04, path.len() as u8];
    block.extend_from_slice(path.as_bytes());
    block.extend_from_slice(&[0x01, host.len() as u8]);
    block.extend_from_slice(host.as_bytes());
    let len = block.len();
    let mut frame = vec![
        0,
        (len >> 8) as u8,
        len as u8,
        HEADERS,
        END_STREAM | END_HEADERS,
        0,
        0,
        0,
        1,
    ];
    frame.extend_from_slice(&block);
    stream.write_all(&frame).await?;
    stream.flush().await?;
    let mut total = 0;
    loop {
        let mut header = [0u8; 9];
        stream
            .read_exact(&mut header)
            .await
            .context("reading the response's frames")?;
        let len = usize::from(header[0]) << 16 | usize::from(header[1]) << 8 | usize::from(header[2]);
        total += 9 + len;
        ensure!(total <= RESPONSE_MAX, "response over {RESPONSE_MAX} bytes");
        let mut payload = vec![0u8; len];
        stream.read_exact(&mut payload).await?;
        let on_stream_1 = header[5..9] == [0, 0, 0, 1];
        // A HEADERS frame without padding or priority starts with :status; 0x88 is
        // the static table's 200.
        if header[3] == HEADERS && on_stream_1 && header[4] & 0x28 == 0 {
            ensure!(payload.first() == Some(&0x88), "h2 response status is not 200");
        }
        match header[3] {
            // RST_STREAM
            3 if on_stream_1 => bail!("the server reset the request's stream"),
            // GOAWAY
            7 => bail!("the server sent GOAWAY"),
            // DATA or HEADERS ending the stream
            0 | HEADERS if on_stream_1 && header[4] & END_STREAM != 0 => return Ok(()),
            _ => {}
        }
    }
}

/// The client preface with empty SETTINGS, then frames until the server's SETTINGS
/// has arrived, which is acknowledged.
async fn h2_settings<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(stream: &mut S) -> Result<()> {
    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    const SETTINGS: u8 = 4;
    const ACK: u8 = 1;
    let mut hello = PREFACE.to_vec();
    hello.extend_from_slice(&[0, 0, 0, SETTINGS, 0, 0, 0, 0, 0]);
    stream.write_all(&hello).await?;
    stream.flush().await?;
    // A server's first frames are a few control frames; bounded, as a peer may send anything.
    for _ in 0..16 {
        let mut header = [0u8; 9];
        stream
            .read_exact(&mut header)
            .await
            .context("reading the server's frames")?;
        let len = usize::from(header[0]) << 16 | usize::from(header[1]) << 8 | usize::from(header[2]);
        ensure!(len <= 16_384, "h2 frame of {len} bytes before any stream");
        let mut payload = vec![0u8; len];
        stream.read_exact(&mut payload).await?;
        if header[3] == SETTINGS && header[4] & ACK == 0 {
            stream.write_all(&[0, 0, 0, SETTINGS, ACK, 0, 0, 0, 0]).await?;
            stream.flush().await?;
            return Ok(());
        }
    }
    bail!("no SETTINGS among the server's first 16 frames")
}

/// `n` HTTP/1.1 GETs of `path` on their own connections, each read at `rate` bytes
/// per second (a 4 KiB read every so often) until the set is shut down: the slow
/// active downloads held beside the idle connections. Returns once every response
/// head has arrived; a task that ends on its own is a download the server cut.
pub(crate) async fn slow_downloads(
    target: &Target,
    path: &str,
    n: usize,
    rate: usize,
) -> Result<JoinSet<Result<u64>>> {
    const READ: usize = 4096;
    let tls = with_alpn(&target.tls, b"http/1.1");
    let pause = Duration::from_secs_f64(READ as f64 / rate.max(1) as f64);
    let mut set = JoinSet::new();
    let (ready_tx, mut ready_rx) = tokio::sync::mpsc::channel::<Result<()>>(n.max(1));
    for i in 0..n {
        let (tls, sni, addr, ready) = (
            Arc::clone(&tls),
            target.sni.clone(),
            target.addr,
            ready_tx.clone(),
        );
        let request = format!("GET {path} HTTP/1.1\r\nhost: {sni}\r\n\r\n");
        set.spawn(async move {
            let started = async {
                let tcp = connect_from(addr, source(i)).await?;
                let mut stream = webship_testkit::http::tls(tcp, &sni, tls).await?;
                stream.write_all(request.as_bytes()).await?;
                stream.flush().await?;
                let mut buf = vec![0u8; READ];
                let n = stream.read(&mut buf).await?;
                ensure!(
                    buf[..n].starts_with(b"HTTP/1.1 200"),
                    "slow download: no 200 response: {:?}",
                    String::from_utf8_lossy(&buf[..n.min(200)])
                );
                anyhow::Ok((stream, buf, n as u64))
            };
            let (mut stream, mut buf, mut total) = match tokio::time::timeout(SETUP_TIMEOUT, started).await {
                Ok(Ok(s)) => {
                    let _ = ready.send(Ok(())).await;
                    s
                }
                Ok(Err(e)) => {
                    let _ = ready.send(Err(anyhow::anyhow!("{e:#}"))).await;
                    return Err(e);
                }
                Err(_) => {
                    let _ = ready
                        .send(Err(anyhow::anyhow!("slow download not started")))
                        .await;
                    bail!("slow download {i}: no response head within {SETUP_TIMEOUT:?}");
                }
            };
            loop {
                tokio::time::sleep(pause).await;
                let read = stream.read(&mut buf).await?;
                if read == 0 {
                    bail!("slow download {i}: the server closed after {total} bytes");
                }
                total += read as u64;
            }
        });
    }
    drop(ready_tx);
    for _ in 0..n {
        ready_rx
            .recv()
            .await
            .context("a slow download ended before its response")??;
    }
    Ok(set)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_rotate_before_ports_run_out() {
        assert_eq!(source(0), Ipv4Addr::new(127, 0, 0, 1));
        assert_eq!(source(PER_SOURCE - 1), Ipv4Addr::new(127, 0, 0, 1));
        assert_eq!(source(PER_SOURCE), Ipv4Addr::new(127, 0, 0, 2));
        assert_eq!(source(2 * PER_SOURCE + 5), Ipv4Addr::new(127, 0, 0, 3));
    }
}
