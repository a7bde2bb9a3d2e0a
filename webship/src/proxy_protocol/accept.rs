//! Reading the header a load balancer puts in front of a connection
//! (`accept_proxy_protocol`), before anything else reads the socket.
//!
//! A connection from a listed source must start with a header (nginx's
//! `listen … proxy_protocol` and HAProxy's `accept-proxy` / `expect-proxy` close one
//! that does not): a balancer that sends none is misconfigured, and serving it as
//! itself would log and forward the balancer's address as the client's. A connection
//! from any other source that starts with one is closed: it is not TLS, and nobody
//! else may claim an address. The header is *peeked* and then exactly its bytes are
//! read, so the ClientHello behind it stays in the socket.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::net::TcpStream;

use super::{parse, starts_like_header, Carried, HeaderError, Parsed, V1_MAX, V2_MAX_PAYLOAD};
use crate::config::IpNet;

/// The buffer one header is read into (a v2 header at its longest).
const MAX_HEADER: usize = 16 + V2_MAX_PAYLOAD;

/// Who the client is and what it connected to, as the rest of the daemon sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Endpoints {
    /// The carried client address, or the TCP peer.
    pub(crate) client: SocketAddr,
    /// The carried destination; `None`: the connection's own local address.
    pub(crate) destination: Option<SocketAddr>,
}

impl Endpoints {
    /// A connection that carries no header: its own endpoints.
    pub(crate) fn direct(peer: SocketAddr) -> Self {
        Self {
            client: peer,
            destination: None,
        }
    }
}

/// How headers were judged since start: each connection counts once.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Counters {
    /// Headers that carried a client address, now the connection's.
    pub(crate) accepted: u64,
    /// `LOCAL` / `UNKNOWN` / other families: read, the real endpoints kept.
    pub(crate) local: u64,
    /// A header from a source not listed: closed.
    pub(crate) unlisted: u64,
    /// A listed source that started with something else: closed.
    pub(crate) missing: u64,
    /// Malformed, oversized or truncated: closed.
    pub(crate) malformed: u64,
    /// Not complete within the handshake timeout: closed.
    pub(crate) timed_out: u64,
}

static ACCEPTED: AtomicU64 = AtomicU64::new(0);
static LOCAL: AtomicU64 = AtomicU64::new(0);
static UNLISTED: AtomicU64 = AtomicU64::new(0);
static MISSING: AtomicU64 = AtomicU64::new(0);
static MALFORMED: AtomicU64 = AtomicU64::new(0);
static TIMED_OUT: AtomicU64 = AtomicU64::new(0);
/// The first missing header is worth a warning (a balancer not sending any);
/// the rest are debug lines, so a flood of them floods nothing.
static WARNED_MISSING: AtomicBool = AtomicBool::new(false);

pub(crate) fn counters() -> Counters {
    let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
    Counters {
        accepted: get(&ACCEPTED),
        local: get(&LOCAL),
        unlisted: get(&UNLISTED),
        missing: get(&MISSING),
        malformed: get(&MALFORMED),
        timed_out: get(&TIMED_OUT),
    }
}

/// Logs the counters (at shutdown), when any source may send headers.
pub(crate) fn log_counters(listed: &[IpNet]) {
    if listed.is_empty() {
        return;
    }
    let c = counters();
    tracing::info!(
        accepted = c.accepted,
        local = c.local,
        unlisted = c.unlisted,
        missing = c.missing,
        malformed = c.malformed,
        timed_out = c.timed_out,
        "proxy protocol counters"
    );
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// Why a connection is closed before TLS.
enum Refusal {
    /// The peer left before sending a byte (a TCP health check): not counted.
    Left,
    Unlisted,
    Missing,
    Bad(HeaderError),
    Truncated,
}

/// The endpoints of a new connection from `peer`, or `None` when it must be closed.
/// With `listed` empty nothing is read and the peer is the client. Otherwise
/// everything happens within `timeout`: a listed source's header is read (and only
/// it), another source's first bytes are peeked for one.
pub(crate) async fn accept(
    tcp: &TcpStream,
    peer: SocketAddr,
    listed: &[IpNet],
    timeout: Duration,
) -> Option<Endpoints> {
    if listed.is_empty() {
        return Some(Endpoints::direct(peer));
    }
    let from_balancer = listed.iter().any(|net| net.contains(peer.ip()));
    let judged = tokio::time::timeout(timeout, async {
        if from_balancer {
            read_header(tcp, peer).await
        } else {
            no_header(tcp).await.map(|()| Endpoints::direct(peer))
        }
    })
    .await;
    let refusal = match judged {
        Ok(Ok(endpoints)) => return Some(endpoints),
        Ok(Err(refusal)) => refusal,
        Err(_) if from_balancer => {
            bump(&TIMED_OUT);
            tracing::debug!(%peer, "proxy protocol: no complete header within the handshake timeout; closed");
            return None;
        }
        // Silent for the whole handshake timeout: its handshake would have timed out.
        Err(_) => {
            tracing::debug!(%peer, "sent nothing within the handshake timeout; closed");
            return None;
        }
    };
    match refusal {
        Refusal::Left => {}
        Refusal::Unlisted => {
            bump(&UNLISTED);
            tracing::debug!(%peer, "proxy protocol: header from a source not in accept_proxy_protocol; closed");
        }
        Refusal::Missing => {
            bump(&MISSING);
            if WARNED_MISSING.swap(true, Ordering::Relaxed) {
                tracing::debug!(%peer, "proxy protocol: no header from a listed source; closed");
            } else {
                tracing::warn!(%peer, "proxy protocol: a connection from a source in accept_proxy_protocol did not start with a PROXY header and was closed; is the balancer set to send one? (further ones are logged at debug level)");
            }
        }
        Refusal::Bad(e) => {
            bump(&MALFORMED);
            tracing::debug!(%peer, error = %e, "proxy protocol: closed");
        }
        Refusal::Truncated => {
            bump(&MALFORMED);
            tracing::debug!(%peer, "proxy protocol: connection ended inside the header; closed");
        }
    }
    None
}

/// A source not listed: its first bytes (peeked, left in place) must not start a
/// header. One peek tells: neither signature's first byte can start TLS.
async fn no_header(tcp: &TcpStream) -> Result<(), Refusal> {
    let mut first = [0u8; 16];
    match tcp.peek(&mut first).await {
        Ok(0) | Err(_) => Err(Refusal::Left),
        Ok(n) if starts_like_header(&first[..n]) => Err(Refusal::Unlisted),
        Ok(_) => Ok(()),
    }
}

/// A listed source: reads exactly its header. Each turn peeks at most as many bytes
/// as the header can still hold, and on an incomplete verdict takes all it peeked
/// (every one of them is the header's), so the next peek waits for new bytes: no
/// turn spins, and each consumes at least one byte of a bounded header.
async fn read_header(tcp: &TcpStream, peer: SocketAddr) -> Result<Endpoints, Refusal> {
    let mut buf = vec![0u8; MAX_HEADER];
    let mut have = 0;
    // A first peek of a v1 line's length takes a whole v1 header, or a v2 one
    // with its addresses, in one turn.
    let mut up_to = V1_MAX;
    loop {
        let n = match tcp.peek(&mut buf[have..up_to]).await {
            Ok(0) if have == 0 => return Err(Refusal::Left),
            Ok(0) | Err(_) => return Err(Refusal::Truncated),
            Ok(n) => n,
        };
        match parse(&buf[..have + n]) {
            Ok(Parsed::Complete { header, len }) => {
                take(tcp, &mut buf[have..len]).await?;
                return Ok(endpoints(header, peer));
            }
            Ok(Parsed::Incomplete { up_to: next }) => {
                take(tcp, &mut buf[have..have + n]).await?;
                have += n;
                up_to = next.min(MAX_HEADER);
            }
            Err(HeaderError::NotAHeader) => return Err(Refusal::Missing),
            Err(e) => return Err(Refusal::Bad(e)),
        }
        debug_assert!(up_to > have);
    }
}

fn endpoints(header: Carried, peer: SocketAddr) -> Endpoints {
    match header {
        Carried::Proxied { client, destination } => {
            bump(&ACCEPTED);
            tracing::debug!(balancer = %peer, %client, %destination, "proxy protocol: client address carried");
            Endpoints {
                client,
                destination: Some(destination),
            }
        }
        Carried::Local => {
            bump(&LOCAL);
            Endpoints::direct(peer)
        }
    }
}

/// Reads exactly `buf.len()` bytes that a peek already saw in the receive queue.
async fn take(tcp: &TcpStream, buf: &mut [u8]) -> Result<(), Refusal> {
    let mut got = 0;
    // Bounded: the bytes are queued, so each turn reads some or the peer is gone.
    while got < buf.len() {
        tcp.readable().await.map_err(|_| Refusal::Truncated)?;
        match tcp.try_read(&mut buf[got..]) {
            Ok(0) => return Err(Refusal::Truncated),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(_) => return Err(Refusal::Truncated),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    use super::{accept, Endpoints};
    use crate::config::IpNet;

    /// Sends `pieces` (each its own segment, a pause apart) on a loopback connection
    /// and runs [`accept`] on the server side; then the bytes left in the socket.
    async fn judge(pieces: &[&[u8]], listed: &str) -> (Option<Endpoints>, Vec<u8>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        client.set_nodelay(true).unwrap();
        let (server, peer) = listener.accept().await.unwrap();
        let pieces: Vec<Vec<u8>> = pieces.iter().map(|p| p.to_vec()).collect();
        let sender = tokio::spawn(async move {
            for piece in pieces {
                client.write_all(&piece).await.unwrap();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            client.shutdown().await.unwrap();
            client
        });
        let listed = [IpNet::parse(listed).unwrap()];
        let ends = accept(&server, peer, &listed, Duration::from_secs(5)).await;
        let _client = sender.await.unwrap();
        let mut rest = Vec::new();
        let mut server = server;
        if ends.is_some() {
            server.read_to_end(&mut rest).await.unwrap();
        }
        (ends, rest)
    }

    /// Headers split anywhere (inside the signature, the fixed part, the addresses, the
    /// v1 line) are read whole, and not one byte of what follows is taken.
    #[tokio::test]
    async fn exactly_the_header_is_taken_however_it_arrives() {
        let tls = &[0x16, 0x03, 0x01, 0x00, 0x05][..];
        let v1 = &b"PROXY TCP4 203.0.113.7 198.51.100.1 56324 443\r\n"[..];
        let v2 = &b"\r\n\r\n\0\r\nQUIT\n\x21\x11\x00\x0c\xcb\x00\x71\x07\xc6\x33\x64\x01\xdc\x04\x01\xbb"[..];
        let client = "203.0.113.7:56324".parse().unwrap();
        let destination = Some("198.51.100.1:443".parse().unwrap());
        let want = Some(Endpoints { client, destination });
        for header in [v1, v2] {
            for cuts in [
                vec![],
                vec![1],
                vec![5, 13],
                vec![15, 16, 20],
                vec![header.len() - 1],
            ] {
                let mut pieces = Vec::new();
                let mut at = 0;
                for cut in cuts.iter().chain(std::iter::once(&header.len())) {
                    pieces.push(&header[at..*cut]);
                    at = *cut;
                }
                // The TLS bytes in the header's last segment, and in one of their own.
                let last = [pieces.pop().unwrap(), &tls[..2]].concat();
                pieces.push(&last);
                pieces.push(&tls[2..]);
                let (ends, rest) = judge(&pieces, "127.0.0.1/32").await;
                assert_eq!(ends, want, "{cuts:?}");
                assert_eq!(rest, tls, "{cuts:?}");
            }
        }
        // Not listed: a header closes, TLS is left untouched.
        let (ends, _) = judge(&[v2, tls], "10.0.0.0/8").await;
        assert_eq!(ends, None);
        let (ends, rest) = judge(&[tls], "10.0.0.0/8").await;
        assert!(ends.is_some_and(|e| e.destination.is_none()));
        assert_eq!(rest, tls);
        // Listed without a header, or a header cut short: closed.
        assert_eq!(judge(&[tls], "127.0.0.1/32").await.0, None);
        assert_eq!(judge(&[&v2[..20]], "127.0.0.1/32").await.0, None);
    }
}
