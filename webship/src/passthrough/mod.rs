//! TLS passthrough: a connection whose ClientHello names a passthrough domain goes to
//! one of that route's upstreams untouched — never decrypted, the client sees the
//! origin's certificate. The hello is only *peeked*: if no passthrough route claims
//! it, the same bytes are still in the socket for the TLS acceptor of direct and
//! proxy sites on the shared listener.
//!
//! Splicing engine today: `copy` (userspace, two 256 KiB buffers per connection, FIN
//! forwarded as a half-close). The eBPF sockmap and `splice(2)` engines arrive with
//! their issue, behind the same interface.

pub mod client_hello;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::net::TcpStream;

use crate::config::{Config, DomainPattern, PassthroughRoute};
use client_hello::{Hello, HelloError, MAX_HELLO};

/// Per-direction copy buffer of the `copy` engine.
const COPY_BUFFER: usize = 256 * 1024;

static STEERED: AtomicU64 = AtomicU64::new(0);
static BYTES_UP: AtomicU64 = AtomicU64::new(0);
static BYTES_DOWN: AtomicU64 = AtomicU64::new(0);
static SNI_MISSES: AtomicU64 = AtomicU64::new(0);
static BAD_HELLOS: AtomicU64 = AtomicU64::new(0);
static UPSTREAM_FAILURES: AtomicU64 = AtomicU64::new(0);

/// Process-wide passthrough counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counters {
    pub steered: u64,
    pub bytes_up: u64,
    pub bytes_down: u64,
    pub sni_misses: u64,
    pub bad_hellos: u64,
    pub upstream_failures: u64,
}

pub fn counters() -> Counters {
    Counters {
        steered: STEERED.load(Ordering::Relaxed),
        bytes_up: BYTES_UP.load(Ordering::Relaxed),
        bytes_down: BYTES_DOWN.load(Ordering::Relaxed),
        sni_misses: SNI_MISSES.load(Ordering::Relaxed),
        bad_hellos: BAD_HELLOS.load(Ordering::Relaxed),
        upstream_failures: UPSTREAM_FAILURES.load(Ordering::Relaxed),
    }
}

/// What to do with a new connection.
#[derive(Debug)]
pub enum Decision {
    /// Forward to this route's upstreams.
    Forward(usize),
    /// Not a passthrough domain: terminate TLS as usual (the hello is still unread).
    Terminate,
    /// Close: no route can take it (counted).
    Close(&'static str),
}

/// The passthrough routes of the listener.
#[derive(Debug)]
pub struct Passthrough {
    routes: Vec<(PassthroughRoute, AtomicUsize)>,
    /// Whether direct or proxy sites share the listener (else a miss is closed).
    has_sites: bool,
}

impl Passthrough {
    /// `None` when the configuration has no passthrough routes.
    pub fn new(config: &Config) -> Option<Self> {
        (!config.passthrough.is_empty()).then(|| Self {
            routes: config
                .passthrough
                .iter()
                .map(|r| (r.clone(), AtomicUsize::new(0)))
                .collect(),
            has_sites: !config.sites.is_empty(),
        })
    }

    fn lookup(&self, sni: &str) -> Option<usize> {
        let exact = self
            .routes
            .iter()
            .position(|(r, _)| matches!(r.domain, DomainPattern::Exact(_)) && r.domain.matches(sni));
        exact.or_else(|| {
            self.routes
                .iter()
                .enumerate()
                .filter_map(|(i, (r, _))| match &r.domain {
                    DomainPattern::Wildcard(suffix) if r.domain.matches(sni) => Some((suffix.len(), i)),
                    _ => None,
                })
                .max()
                .map(|(_, i)| i)
        })
    }

    /// Peeks (never reads) the ClientHello within `timeout` and decides.
    pub async fn decide(&self, tcp: &TcpStream, timeout: Duration) -> Decision {
        match tokio::time::timeout(timeout, self.peek_hello(tcp)).await {
            Ok(Ok(Hello::Complete { sni: Some(sni) })) => match self.lookup(&sni) {
                Some(route) => Decision::Forward(route),
                None if self.has_sites => Decision::Terminate,
                None => {
                    SNI_MISSES.fetch_add(1, Ordering::Relaxed);
                    Decision::Close("no passthrough route for this SNI")
                }
            },
            Ok(Ok(_)) if self.has_sites => Decision::Terminate,
            Ok(Ok(_)) => {
                SNI_MISSES.fetch_add(1, Ordering::Relaxed);
                Decision::Close("ClientHello without SNI")
            }
            // The client left before sending anything (a TCP health check): no hello.
            Ok(Err(None)) => Decision::Close("closed before a ClientHello"),
            // Not TLS, or malformed: with sites, rustls gives the precise alert.
            Ok(Err(Some(_))) if self.has_sites => Decision::Terminate,
            Ok(Err(Some(_))) | Err(_) => {
                BAD_HELLOS.fetch_add(1, Ordering::Relaxed);
                Decision::Close("malformed, oversized or too slow ClientHello")
            }
        }
    }

    /// `Err(None)`: the peer closed before sending a byte.
    async fn peek_hello(&self, tcp: &TcpStream) -> Result<Hello, Option<HelloError>> {
        let mut buf = vec![0u8; MAX_HELLO + 1024];
        let mut seen = 0;
        // Bounded: the caller's timeout ends it; each turn waits for new bytes.
        loop {
            let n = match tcp.peek(&mut buf).await {
                Ok(0) if seen == 0 => return Err(None),
                Ok(0) | Err(_) => return Err(Some(HelloError::Malformed)),
                Ok(n) => n,
            };
            match client_hello::parse(&buf[..n]).map_err(Some)? {
                Hello::Incomplete if n == buf.len() => return Err(Some(HelloError::TooLarge)),
                Hello::Incomplete => {
                    if n == seen {
                        // Readiness stays set while peeked bytes wait: back off briefly
                        // instead of spinning until the rest of the hello arrives.
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                    seen = n;
                }
                done => return Ok(done),
            }
        }
    }

    /// Connects to the route's next upstream (round-robin, falling through on
    /// failure) and copies both ways until both sides are done.
    pub async fn forward(&self, route: usize, mut client: TcpStream, peer: SocketAddr) {
        let (r, next) = &self.routes[route];
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
        let Some((mut tcp, addr)) = upstream else {
            UPSTREAM_FAILURES.fetch_add(1, Ordering::Relaxed);
            return;
        };
        STEERED.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(%peer, upstream = %addr, domain = %r.domain, "passthrough: steered");
        match tokio::io::copy_bidirectional_with_sizes(&mut client, &mut tcp, COPY_BUFFER, COPY_BUFFER).await
        {
            Ok((up, down)) => {
                BYTES_UP.fetch_add(up, Ordering::Relaxed);
                BYTES_DOWN.fetch_add(down, Ordering::Relaxed);
            }
            Err(e) => tracing::debug!(%peer, upstream = %addr, error = %e, "passthrough: connection ended"),
        }
    }
}
