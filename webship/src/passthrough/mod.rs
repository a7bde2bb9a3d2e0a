//! TLS passthrough: a connection whose ClientHello names a passthrough domain goes to
//! one of that route's upstreams untouched — never decrypted, the client sees the
//! origin's certificate. The hello is only *peeked*: if no passthrough route claims
//! it, the same bytes are still in the socket for the TLS acceptor of direct and
//! proxy sites on the shared listener.
//!
//! Three engines move the bytes once the upstream is connected, behind one
//! interface ([`Passthrough::forward`]):
//! - `auto` (the default): `copy` for each direction's first MiB, then `splice`;
//! - `copy`: userspace reads and writes with two 256 KiB buffers per connection;
//! - `splice`: `splice(2)` through a pipe per direction, so payload pages go from
//!   one socket to the other without a copy into userspace ([`splice`]);
//! - `sockmap`: the eBPF stream verdict redirects every segment in the kernel, and
//!   the daemon only watches for the ends ([`sockmap`]).
//!
//! Every engine forwards a FIN as a half-close and waits for the other direction,
//! so an origin that half-closes still gets the client's remaining bytes. None
//! waits forever: a connection that carries nothing for the idle timeout is
//! closed, whatever the engine ([`idle`]), and every close is counted by reason.

pub mod client_hello;
pub(crate) mod idle;
mod sockmap;

pub(crate) use sockmap::fallbacks as sockmap_fallbacks;
mod splice;
pub(crate) mod udp;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpStream;

use crate::config::{Config, Engine, PassthroughRoute};
use crate::ebpf::{Counter, Programs, Values, COUNTERS};
use crate::names::NameTable;
use crate::proxy_protocol::{self, accept::Endpoints};
use client_hello::{Hello, HelloError, MAX_HELLO};
use idle::{End, Timeouts};

/// Per-direction copy buffer of the `copy` engine.
const COPY_BUFFER: usize = 256 * 1024;

static COUNTS: [AtomicU64; COUNTERS as usize] = [const { AtomicU64::new(0) }; COUNTERS as usize];

fn count(counter: Counter, n: u64) {
    COUNTS[counter as usize].fetch_add(n, Ordering::Relaxed);
}

/// The daemon's own passthrough counters (userspace engines and decisions; the
/// sockmap engine's kernel-side bytes are in the eBPF per-CPU map).
pub(crate) fn counters() -> Values {
    let mut out = [0; COUNTERS as usize];
    for (slot, count) in out.iter_mut().zip(&COUNTS) {
        *slot = count.load(Ordering::Relaxed);
    }
    out
}

/// What to do with a new connection.
#[derive(Debug)]
pub(crate) enum Decision {
    /// Forward to this route's upstreams.
    Forward(usize),
    /// Not a passthrough domain: terminate TLS as usual (the hello is still unread).
    Terminate,
    /// Close: no route can take it (counted).
    Close(&'static str),
}

/// The passthrough routes of the listener.
#[derive(Debug)]
pub(crate) struct Passthrough {
    routes: Vec<(PassthroughRoute, AtomicUsize)>,
    /// Route index by SNI.
    names: NameTable<usize>,
    /// Whether direct or proxy sites share the listener (else a miss is closed).
    has_sites: bool,
    engine: Engine,
    /// Loaded when the engine is `sockmap`.
    programs: Option<Arc<Programs>>,
    /// How long a finished direction may wait for the receiver to take the rest.
    drain_timeout: Duration,
    timeouts: Timeouts,
}

impl Passthrough {
    /// `None` when the configuration has no passthrough routes. `programs` are the
    /// loaded eBPF programs, if any; `engine` must not be `Auto` (see [`resolve`]).
    pub(crate) fn new(config: &Config, engine: Engine, programs: Option<Arc<Programs>>) -> Option<Self> {
        (!config.passthrough.is_empty()).then(|| Self {
            routes: config
                .passthrough
                .iter()
                .map(|r| (r.clone(), AtomicUsize::new(0)))
                .collect(),
            names: NameTable::new(
                config
                    .passthrough
                    .iter()
                    .enumerate()
                    .map(|(i, r)| (r.domain.clone(), i)),
            ),
            has_sites: !config.sites.is_empty(),
            engine,
            programs,
            drain_timeout: config.limits.send_timeout,
            timeouts: Timeouts {
                idle: config.passthrough_idle_timeout,
                half_closed: config.passthrough_idle_timeout.min(config.limits.idle_timeout),
                unacknowledged: config.limits.send_timeout,
            },
        })
    }

    pub(crate) fn engine(&self) -> Engine {
        self.engine
    }

    /// Peeks (never reads) the ClientHello within `timeout` and decides.
    pub(crate) async fn decide(&self, tcp: &TcpStream, timeout: Duration) -> Decision {
        match tokio::time::timeout(timeout, self.peek_hello(tcp)).await {
            Ok(Ok(Hello::Complete { sni: Some(sni) })) => match self.names.lookup(&sni).copied() {
                Some(route) => Decision::Forward(route),
                None if self.has_sites => Decision::Terminate,
                None => {
                    count(Counter::SniMisses, 1);
                    Decision::Close("no passthrough route for this SNI")
                }
            },
            Ok(Ok(_)) if self.has_sites => Decision::Terminate,
            Ok(Ok(_)) => {
                count(Counter::SniMisses, 1);
                Decision::Close("ClientHello without SNI")
            }
            // The client left before sending anything (a TCP health check): no hello.
            Ok(Err(None)) => Decision::Close("closed before a ClientHello"),
            // Not TLS, or malformed: with sites, rustls gives the precise alert.
            Ok(Err(Some(_))) if self.has_sites => Decision::Terminate,
            Ok(Err(Some(_))) | Err(_) => {
                count(Counter::BadHellos, 1);
                Decision::Close("malformed, oversized or too slow ClientHello")
            }
        }
    }

    /// `Err(None)`: the peer closed before sending a byte.
    ///
    /// Peeked bytes keep the socket readable, so waiting for readiness alone
    /// would spin; instead a turn whose receive queue has not grown since the last
    /// peek clears the readiness and waits for the next segment (or the end).
    /// A stalled partial hello costs nothing until its timeout.
    async fn peek_hello(&self, tcp: &TcpStream) -> Result<Hello, Option<HelloError>> {
        let mut buf = vec![0u8; MAX_HELLO + 1024];
        let mut seen = 0;
        // Bounded: the caller's timeout ends it; each turn waits for new bytes.
        loop {
            if seen > 0 {
                wait_for_more(tcp, seen).await?;
            }
            let n = match tcp.peek(&mut buf).await {
                Ok(0) if seen == 0 => return Err(None),
                Ok(0) | Err(_) => return Err(Some(HelloError::Malformed)),
                Ok(n) => n,
            };
            match client_hello::parse(&buf[..n]).map_err(Some)? {
                Hello::Incomplete if n == buf.len() => return Err(Some(HelloError::TooLarge)),
                Hello::Incomplete => seen = n,
                done => return Ok(done),
            }
        }
    }

    /// Connects to the route's next upstream (round-robin, falling through on
    /// failure), writes the route's PROXY header, and moves bytes both ways with the
    /// configured engine until both sides are done. `ends` are the client's address
    /// (carried by a balancer's header, or the peer's) and what it connected to.
    pub(crate) async fn forward(&self, route: usize, client: TcpStream, ends: Endpoints) {
        let peer = ends.client;
        let (r, next) = &self.routes[route];
        // The address the client connected to: the balancer's, or this listener's.
        let header = match (r.proxy_protocol, ends.destination) {
            (None, _) => None,
            (Some(version), Some(to)) => Some(proxy_protocol::encode(version, peer, to)),
            (Some(version), None) => match client.local_addr() {
                Ok(to) => Some(proxy_protocol::encode(version, peer, to)),
                Err(e) => return tracing::debug!(%peer, error = %e, "passthrough: no local address"),
            },
        };
        let header = header.unwrap_or_default();
        let n = r.upstreams.len();
        let start = next.fetch_add(1, Ordering::Relaxed);
        let mut upstream = None;
        for k in 0..n {
            let addr = r.upstreams[(start + k) % n];
            match tokio::time::timeout(r.connect_timeout, TcpStream::connect(addr)).await {
                Ok(Ok(tcp)) => {
                    let _ = tcp.set_nodelay(true);
                    upstream = Some((tcp, addr));
                    break;
                }
                Ok(Err(e)) => {
                    tracing::warn!(%peer, upstream = %addr, error = %e, "passthrough: upstream unreachable")
                }
                Err(_) => tracing::warn!(%peer, upstream = %addr, "passthrough: upstream connect timed out"),
            }
        }
        let Some((tcp, addr)) = upstream else {
            count(Counter::UpstreamFailures, 1);
            return;
        };
        count(Counter::Steered, 1);
        tracing::debug!(%peer, upstream = %addr, domain = %r.domain, engine = %self.engine, "passthrough: steered");
        self.timeouts.arm(&client);
        self.timeouts.arm(&tcp);
        let moved = async {
            // The header goes first, before any byte of the client's; sockmap writes
            // it itself, after its counters' baseline (it must be acknowledged too).
            if self.engine != Engine::Sockmap || self.programs.is_none() {
                write_all(&tcp, &header).await?;
            }
            match (self.engine, &self.programs) {
                (Engine::Sockmap, Some(programs)) => {
                    sockmap::run(programs, &client, &tcp, &header, self.drain_timeout).await
                }
                (Engine::Splice, _) => splice::run(&client, &tcp, 0).await,
                (Engine::Auto, _) => splice::run(&client, &tcp, splice::ADAPTIVE_COPY_BYTES).await,
                _ => copy(&client, &tcp).await,
            }
        };
        // Whichever ends first: dropping the engine drops its pipes and links, and
        // the sockets close when this returns.
        let end = tokio::select! {
            result = moved => {
                if let Err(e) = &result {
                    tracing::debug!(%peer, upstream = %addr, error = %e, "passthrough: connection ended");
                }
                End::of(&result)
            }
            () = idle::expired(&client, &tcp, self.timeouts) => {
                tracing::debug!(%peer, upstream = %addr, "passthrough: idle, closed");
                End::Idle
            }
        };
        count(end.counter(), 1);
    }
}

/// Waits until more than `seen` bytes are queued on `tcp`. A peer that half-closed
/// or reset instead ends the hello (truncated).
async fn wait_for_more(tcp: &TcpStream, seen: usize) -> Result<(), Option<HelloError>> {
    use std::io::ErrorKind::WouldBlock;
    let truncated = Some(HelloError::Malformed);
    // Bounded by the caller's timeout; every turn follows a readiness event.
    loop {
        tcp.readable().await.map_err(|_| truncated)?;
        let grew = tcp.try_io(tokio::io::Interest::READABLE, || {
            let queued = usize::try_from(rustix::io::ioctl_fionread(tcp)?).unwrap_or(usize::MAX);
            if queued != seen {
                return Ok(true);
            }
            // Nothing new: a FIN (no more bytes will come), or clear the readiness
            // so that only the next segment wakes this task.
            match crate::sys::tcp_activity(tcp) {
                Ok(a) if a.half_closed => Ok(false),
                _ => Err(WouldBlock.into()),
            }
        });
        match grew {
            Ok(true) => return Ok(()),
            Ok(false) => return Err(truncated),
            Err(e) if e.kind() == WouldBlock => continue,
            Err(_) => return Err(truncated),
        }
    }
}

/// Writes all of `data` (the engines' own writes: the PROXY header, the hello).
async fn write_all(sock: &TcpStream, mut data: &[u8]) -> std::io::Result<()> {
    while !data.is_empty() {
        sock.writable().await?;
        match sock.try_write(data) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => data = &data[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The `copy` engine: one [`COPY_BUFFER`] per direction.
async fn copy(client: &TcpStream, upstream: &TcpStream) -> std::io::Result<()> {
    let up = copy_one_way(client, upstream, Counter::BytesUp, COPY_BUFFER, u64::MAX);
    let down = copy_one_way(upstream, client, Counter::BytesDown, COPY_BUFFER, u64::MAX);
    tokio::try_join!(up, down).map(drop)
}

/// Copies what `from` receives to `to` through a buffer of `buffer` bytes until
/// `limit` bytes have moved (`true`) or `from` ends first (`false`, and `to` is
/// half-closed). An error (a reset on either side) ends it.
///
/// A connection at rest holds no buffer (every idle one held both directions': 62
/// KiB of RSS per idle connection on the `auto` engine, 45 on `copy`, measured by
/// the `connections` bench). A [`SMALL_READ`] buffer is allocated when the socket is
/// readable and given back after a read smaller than it (a handshake flight, an
/// interactive message) or a read that finds nothing; a read that fills it moves the
/// direction to the full `buffer`, which bulk reads keep.
async fn copy_one_way(
    from: &TcpStream,
    to: &TcpStream,
    counter: Counter,
    buffer: usize,
    limit: u64,
) -> std::io::Result<bool> {
    use std::io::ErrorKind::{WouldBlock, WriteZero};
    let mut buf = Vec::new();
    let mut moved = 0u64;
    while moved < limit {
        from.readable().await?;
        let fresh = buf.is_empty();
        if fresh {
            buf = vec![0u8; SMALL_READ.min(buffer)];
        }
        let n = match from.try_read(&mut buf) {
            Ok(0) => {
                let _ = socket2::SockRef::from(to).shutdown(std::net::Shutdown::Write);
                return Ok(false);
            }
            Ok(n) => n,
            // Readiness left over from the last read: wait holding nothing again.
            Err(e) if e.kind() == WouldBlock => {
                if fresh {
                    buf = Vec::new();
                }
                continue;
            }
            Err(e) => return Err(e),
        };
        let mut data = &buf[..n];
        while !data.is_empty() {
            to.writable().await?;
            match to.try_write(data) {
                Ok(0) => return Err(WriteZero.into()),
                Ok(w) => data = &data[w..],
                Err(e) if e.kind() == WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
        moved += n as u64;
        count(counter, n as u64);
        if n == buf.len() && n < buffer {
            buf = vec![0u8; buffer];
        } else if n < SMALL_READ {
            buf = Vec::new();
        }
    }
    Ok(true)
}

/// A read below this leaves the copy engines' buffer given back (see `copy_one_way`).
const SMALL_READ: usize = 16 * 1024;

/// The engine to run for `configured`. `auto` stays itself: each direction copies
/// its first [`splice::ADAPTIVE_COPY_BYTES`], then splices — chosen by measurement
/// (docs/benchmarks.md, "TLS passthrough"): `sockmap` was slower than both userspace
/// engines here for bulk and for small messages, `splice` matches `copy` on bulk
/// with less CPU, and `copy` wins on small messages.
pub(crate) fn resolve(configured: Engine, ebpf_usable: bool) -> Engine {
    match configured {
        Engine::Sockmap if !ebpf_usable => Engine::Auto,
        other => other,
    }
}
