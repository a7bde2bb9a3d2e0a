//! ACME `http-01` (RFC 8555 section 8.3): the plain-HTTP listener of
//! `[acme] http_listen` (port 80). While an order is pending it answers
//! `GET /.well-known/acme-challenge/<token>` with the key authorization; every other
//! request for a name this daemon serves is redirected to https on the same host,
//! any other name gets 404 (no open redirector for foreign names). One request per
//! connection, its head bounded in size and time; connections capped in all and
//! per source address, so one client cannot hold every slot while the CA validates.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use socket2::{Domain, Protocol, Socket, Type};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use crate::shutdown::Shutdown;

/// The path prefix of the challenge (RFC 8555 section 8.3).
const PREFIX: &str = "/.well-known/acme-challenge/";
/// The longest request head read.
const MAX_HEAD: usize = 8 * 1024;
/// How long a client may take to send its head and read the answer.
const TIMEOUT: Duration = Duration::from_secs(5);
/// Connections served at once; more are closed at accept.
const MAX_CONNECTIONS: usize = 256;
/// Connections served at once from one source address; more are closed at accept.
const MAX_PER_SOURCE: usize = 8;
/// Tokens pending at once (one per name being validated).
const MAX_TOKENS: usize = 1024;

/// Connections closed at accept since start: their address already held
/// [`MAX_PER_SOURCE`], or the listener [`MAX_CONNECTIONS`]
/// (`webship_acme_http01_refused_connections_total`).
pub(crate) static REFUSED: AtomicU64 = AtomicU64::new(0);

/// Pending challenge answers: token → key authorization.
#[derive(Debug, Default)]
pub(crate) struct Tokens {
    pending: Mutex<HashMap<String, String>>,
}

impl Tokens {
    /// False when the table is full.
    pub(crate) fn insert(&self, token: &str, answer: &str) -> bool {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        if pending.len() >= MAX_TOKENS && !pending.contains_key(token) {
            return false;
        }
        pending.insert(token.to_owned(), answer.to_owned());
        true
    }

    pub(crate) fn remove(&self, token: &str) {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(token);
    }

    fn get(&self, token: &str) -> Option<String> {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(token)
            .cloned()
    }
}

/// Binds the http-01 listener (`SO_REUSEPORT`, so a `--takeover` successor binds
/// it too while its predecessor drains).
pub(crate) fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    if addr.is_ipv6() {
        socket.set_only_v6(false)?;
    }
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    TcpListener::from_std(socket.into())
}

/// Whether this daemon serves a host name now (the current generation's sites).
pub(crate) type Serves = Arc<dyn Fn(&str) -> bool + Send + Sync>;

/// Open connections by source address; an entry lives while its connections do,
/// so the table holds at most [`MAX_CONNECTIONS`] entries.
#[derive(Debug, Default)]
struct PerSource(Mutex<HashMap<IpAddr, usize>>);

/// One connection's share of [`PerSource`], given back on drop.
struct SourceSlot {
    table: Arc<PerSource>,
    ip: IpAddr,
}

impl PerSource {
    fn take(self: &Arc<Self>, ip: IpAddr) -> Option<SourceSlot> {
        let mut table = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let count = table.entry(ip).or_default();
        if *count >= MAX_PER_SOURCE {
            return None;
        }
        *count += 1;
        Some(SourceSlot {
            table: self.clone(),
            ip,
        })
    }
}

impl Drop for SourceSlot {
    fn drop(&mut self) {
        let mut table = self.table.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(count) = table.get_mut(&self.ip) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                table.remove(&self.ip);
            }
        }
    }
}

/// Serves until shutdown; `https_port` is where redirects point, for the names
/// `serves` accepts.
pub(crate) async fn serve(
    listener: TcpListener,
    tokens: Arc<Tokens>,
    https_port: u16,
    serves: Serves,
    mut shutdown: Shutdown,
) {
    let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let per_source = Arc::new(PerSource::default());
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = shutdown.requested() => return,
        };
        let (tcp, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                tracing::debug!(error = %e, "acme: http-01 accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // An IPv4 client on a dual-stack socket is counted by its IPv4 address.
        let ip = peer.ip().to_canonical();
        let Some(source_slot) = per_source.take(ip) else {
            REFUSED.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(%peer, "acme: http-01 connection refused: too many from this address");
            continue;
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            REFUSED.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        let (tokens, serves) = (tokens.clone(), serves.clone());
        tokio::spawn(async move {
            let _ = tokio::time::timeout(TIMEOUT, answer(tcp, &tokens, https_port, &*serves)).await;
            drop(permit);
            drop(source_slot);
        });
    }
}

async fn answer(
    mut tcp: TcpStream,
    tokens: &Tokens,
    https_port: u16,
    serves: &(dyn Fn(&str) -> bool + Send + Sync),
) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        if head.len() >= MAX_HEAD {
            return respond(&mut tcp, "431 Request Header Fields Too Large", None, "").await;
        }
        let n = tcp.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
    }
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut request = httparse::Request::new(&mut headers);
    if !matches!(request.parse(&head), Ok(httparse::Status::Complete(_))) {
        return respond(&mut tcp, "400 Bad Request", None, "").await;
    }
    let path = request.path.unwrap_or("/");
    if let Some(token) = path.strip_prefix(PREFIX) {
        return match (request.method, tokens.get(token)) {
            (Some("GET" | "HEAD"), Some(auth)) => respond(&mut tcp, "200 OK", None, &auth).await,
            _ => respond(&mut tcp, "404 Not Found", None, "").await,
        };
    }
    let host = request
        .headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("host"))
        .and_then(|h| std::str::from_utf8(h.value).ok())
        .map(|h| h.rsplit_once(':').map_or(h, |(name, _)| name))
        .filter(|h| {
            !h.is_empty()
                && h.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-')
        });
    let Some(host) = host else {
        return respond(&mut tcp, "400 Bad Request", None, "").await;
    };
    if !serves(host) {
        return respond(&mut tcp, "404 Not Found", None, "").await;
    }
    let port = if https_port == 443 {
        String::new()
    } else {
        format!(":{https_port}")
    };
    let path = if path.starts_with('/') { path } else { "/" };
    let location = format!("https://{host}{port}{path}");
    respond(&mut tcp, "308 Permanent Redirect", Some(&location), "").await
}

async fn respond(
    tcp: &mut TcpStream,
    status: &str,
    location: Option<&str>,
    body: &str,
) -> std::io::Result<()> {
    let location = location.map(|l| format!("Location: {l}\r\n")).unwrap_or_default();
    let text = format!(
        "HTTP/1.1 {status}\r\n{location}Content-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    tcp.write_all(text.as_bytes()).await?;
    tcp.shutdown().await
}
