//! The `sockmap` engine: the eBPF stream verdict (webship-ebpf) redirects every
//! segment one socket receives to the other's transmit queue, so payload never
//! reaches userspace. The daemon sets the link up and watches for the ends.
//!
//! Four kernel behaviours shape it (measured on Linux 6.x):
//! - a segment the program passes to userspace (its peer not in the map) waits in
//!   its socket while later ones are redirected past it, so order is kept by never
//!   redirecting while the daemon still has bytes of that direction to forward:
//!   the PROXY header and the ClientHello (read whole off the client) are written
//!   to the upstream *before* the sockets are linked (both directions' entries,
//!   then the client, then the upstream into the socket map), and a direction
//!   that once had to pass a segment passes every later one too (the program's
//!   `passed` flag: a client that speaks while only it is in the map is relayed
//!   from userspace for the rest of the connection). Opening the client's
//!   direction after the upstream's, as before, let a TLS client's second flight
//!   land in between and reach the origin behind its successor (CI: "bad record
//!   mac" at nginx);
//! - segments that arrive before the link wait in the socket, which their arrival
//!   made readable; the watcher's read of it runs them through the verdict, in
//!   order, before it reads anything (tcp_bpf's recvmsg runs the receive queue
//!   first);
//! - a FIN must not travel through the redirect: the program leaves a segment
//!   without payload in its socket (redirected, the kernel's sender fails on it
//!   and sets `EPIPE` on the peer socket, which the daemon then reads as an error:
//!   an origin that answered and half-closed at once ended as a reset). When one
//!   side's read half closes, the daemon waits until everything that side
//!   received was redirected *and* acknowledged by the other side's peer
//!   (`TCP_INFO` byte counts), then half-closes the other side itself;
//! - only established sockets can be linked (a client or origin that already
//!   half-closed cannot), and map entries outlive nothing: a connection that
//!   cannot be linked is relayed by the `copy` engine instead (one whose upstream
//!   alone was refused keeps the client's entry while it is copied: the kernel
//!   discards what a socket leaving the map holds), and the link is removed when
//!   the connection ends, whichever way it ends.
//!
//! A segment the program leaves in a socket is read and forwarded from userspace,
//! so no byte is lost. That includes segments for a peer that has left the map
//! (the kernel unhashes a reset or closed socket): they wait in the socket, so the
//! sender is held back by its window instead of being drained into nothing, and
//! the daemon's write to the dead peer ends the connection.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::TcpStream;

use super::{count, write_all, Counter};
use crate::ebpf::{Programs, SocketLink};
use crate::sys::{self, TcpBytes};

/// Connections the engine could not link and relayed by copy, by why: neither
/// socket could be linked (one already half-closed, or the map is full), or the
/// upstream alone was refused.
static FALLBACKS: [AtomicU64; 2] = [AtomicU64::new(0), AtomicU64::new(0)];

/// Why a connection was relayed by copy instead of linked: the label of
/// `webship_passthrough_sockmap_fallbacks_total`, and its count so far.
pub(crate) fn fallbacks() -> [(&'static str, u64); 2] {
    [
        ("unlinkable", FALLBACKS[0].load(Ordering::Relaxed)),
        ("upstream_refused", FALLBACKS[1].load(Ordering::Relaxed)),
    ]
}

/// Userspace read size for the rare bytes the kernel did not redirect.
const FALLBACK_BUFFER: usize = 64 * 1024;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    Up,
    Down,
}

/// Links `client` and `upstream` and watches them until both directions are done.
/// `prelude` (the route's PROXY header, or nothing) reaches the upstream first.
pub(super) async fn run(
    programs: &Arc<Programs>,
    client: &TcpStream,
    upstream: &TcpStream,
    prelude: &[u8],
    drain_timeout: Duration,
) -> io::Result<()> {
    use std::os::fd::AsFd;

    // Baselines first: every byte counted after them is the link's to deliver.
    let base_client = Baseline::take(client)?;
    let base_upstream = Baseline::take(upstream)?;
    // What the client queued (the ClientHello) is read and written to the upstream
    // before the link, behind the prelude: once linked, a segment the kernel
    // redirects can never be overtaken by one the daemon still has to write. Read
    // whole: linking hands a queued segment to the verdict whole, even one the
    // daemon read part of (measured on Linux 6.18: a PROXY header read off the
    // client reached the origin a second time, in front of the hello).
    let queued = read_queued(client)?;
    write_all(upstream, prelude).await?;
    write_all(upstream, &queued).await?;
    let hello = queued.len() as u64;
    drop(queued);
    // Whatever arrived since, on either side (the client's next segments, the
    // origin's answer), waits in its socket, which its arrival made readable: the
    // watcher's read runs it through the verdict, in order, before anything else.
    count(Counter::BytesUp, hello);
    // The kernel links established sockets only (a client or origin that already
    // half-closed is not one), and the map has a size: such a connection is
    // relayed by copy instead, from where the hello left off.
    let link = match programs.link(client.as_fd(), upstream.as_fd()) {
        Ok(link) => link,
        Err(e) => {
            FALLBACKS[0].fetch_add(1, Ordering::Relaxed);
            tracing::debug!(error = %e, "sockmap: cannot link, relayed by copy");
            return super::copy(client, upstream).await;
        }
    };
    if let Some(e) = link.refused() {
        FALLBACKS[1].fetch_add(1, Ordering::Relaxed);
        tracing::debug!(error = %e, "sockmap: cannot link the upstream, relayed by copy");
        // `link` lives to the end of this function, past the copy: what the
        // client sent meanwhile waits in its map entry, which unlinking discards.
        return super::copy(client, upstream).await;
    }
    let up = Watch {
        link: &link,
        direction: Direction::Up,
        from: client,
        to: upstream,
        base_from: base_client,
        base_to: base_upstream,
        userspace: hello,
        injected: prelude.len() as u64,
        drain_timeout,
    };
    let down = Watch {
        link: &link,
        direction: Direction::Down,
        from: upstream,
        to: client,
        base_from: base_upstream,
        base_to: base_client,
        userspace: 0,
        injected: 0,
        drain_timeout,
    };
    let result = tokio::try_join!(up.run(), down.run()).map(drop);
    let (redirected_up, redirected_down) = link.redirected();
    tracing::trace!(redirected_up, redirected_down, "sockmap: connection done");
    result
}

/// The most a client may have queued before its link: a ClientHello (at most
/// 64 KiB) and what a TLS client may send before the server answers (0-RTT data).
const MAX_QUEUED: usize = 256 * 1024;

/// Reads everything queued on `client` (it stops at a would-block or the end). More
/// than [`MAX_QUEUED`] is refused: stopping in the middle of a segment would leave a
/// partly read one for the link.
fn read_queued(client: &TcpStream) -> io::Result<Vec<u8>> {
    let queued = usize::try_from(rustix::io::ioctl_fionread(client)?).unwrap_or(usize::MAX);
    if queued > MAX_QUEUED {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{queued} bytes queued before the first answer"),
        ));
    }
    // Sized for what is queued; what arrives meanwhile grows it, past the cap by one
    // byte at most, which refuses the connection.
    let mut out = Vec::with_capacity(queued + 1);
    let mut got = 0;
    // Bounded: each turn reads at least one byte, and the cap ends it.
    while got <= MAX_QUEUED {
        let room = queued
            .saturating_sub(got)
            .max(16 * 1024)
            .min(MAX_QUEUED + 1 - got);
        out.resize(got + room, 0);
        match client.try_read(&mut out[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) => return Err(e),
        }
    }
    out.truncate(got);
    if got > MAX_QUEUED {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "more than 256 KiB queued before the first answer",
        ));
    }
    Ok(out)
}

/// A socket's counters when the link was made.
#[derive(Clone, Copy)]
struct Baseline {
    tcp: TcpBytes,
    /// Bytes already waiting in its receive queue (received before the baseline).
    queued: u64,
}

impl Baseline {
    fn take(sock: &TcpStream) -> io::Result<Self> {
        // Exact when no segment lands between the counters and the queue's size,
        // so the counters are read on both sides of it until they agree (one turn
        // unless segments are streaming in). A segment counted as queued but not
        // received would make the delivery check wait for a byte that never comes.
        for _ in 0..8 {
            let before = sys::tcp_bytes(sock)?;
            let queued = rustix::io::ioctl_fionread(sock)?;
            if sys::tcp_bytes(sock)?.received == before.received {
                return Ok(Self { tcp: before, queued });
            }
        }
        // Still moving: the queue first, which can only overstate what is passed
        // on, never hold the check.
        let queued = rustix::io::ioctl_fionread(sock)?;
        Ok(Self {
            tcp: sys::tcp_bytes(sock)?,
            queued,
        })
    }
}

/// One direction: bytes `from` receives go to `to`.
struct Watch<'a> {
    link: &'a SocketLink,
    direction: Direction,
    from: &'a TcpStream,
    to: &'a TcpStream,
    base_from: Baseline,
    base_to: Baseline,
    /// Bytes of this direction forwarded from userspace.
    userspace: u64,
    /// Bytes the daemon wrote to `to` itself (the PROXY header): `to`'s peer
    /// acknowledges them too, though `from` never received them.
    injected: u64,
    drain_timeout: Duration,
}

impl Watch<'_> {
    async fn run(mut self) -> io::Result<()> {
        let mut buf = Vec::new();
        loop {
            self.from.readable().await?;
            if buf.is_empty() {
                buf.resize(FALLBACK_BUFFER, 0);
            }
            match self.from.try_read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    // Left in the socket by the program: forward it ourselves.
                    write_all(self.to, &buf[..n]).await?;
                    self.userspace += n as u64;
                    count(self.counter(), n as u64);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
        self.delivered().await?;
        let _ = rustix::net::shutdown(self.to, rustix::net::Shutdown::Write);
        Ok(())
    }

    /// Forwards what a read of `from` returns now, until it returns nothing.
    async fn forward_left(&mut self) -> io::Result<()> {
        let mut buf = vec![0u8; 16 * 1024];
        // Bounded: past its FIN the peer sends nothing more, so the reads end at
        // what this socket already holds.
        loop {
            match self.from.try_read(&mut buf) {
                Ok(0) => return Ok(()),
                Ok(n) => {
                    write_all(self.to, &buf[..n]).await?;
                    self.userspace += n as u64;
                    count(self.counter(), n as u64);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    }

    fn counter(&self) -> Counter {
        match self.direction {
            Direction::Up => Counter::BytesUp,
            Direction::Down => Counter::BytesDown,
        }
    }

    fn redirected(&self) -> u64 {
        let (up, down) = self.link.redirected();
        match self.direction {
            Direction::Up => up,
            Direction::Down => down,
        }
    }

    /// Waits until `from`'s FIN is the only thing it received that was not passed
    /// on, and `to`'s peer acknowledged all of it. Gives up after `drain_timeout`
    /// without progress.
    async fn delivered(&mut self) -> io::Result<()> {
        let mut pause = Duration::from_micros(200);
        let mut last_acked = 0;
        let mut deadline = Instant::now() + self.drain_timeout;
        // Bounded by the deadline, which only moves on acknowledged progress.
        loop {
            let redirected = self.redirected();
            let received = sys::tcp_bytes(self.from)?
                .received
                .saturating_sub(self.base_from.tcp.received);
            let acked = sys::tcp_bytes(self.to)?
                .acked
                .saturating_sub(self.base_to.tcp.acked);
            // What we read ourselves includes the bytes queued before the baseline.
            let passed_on = redirected + self.userspace.saturating_sub(self.base_from.queued);
            if passed_on + 1 < received {
                // Received, neither redirected nor read: a segment the program
                // passed may still be on its way to the socket's queue behind the
                // end the read saw. A read returns it once there.
                self.forward_left().await?;
            }
            let passed_on = redirected + self.userspace.saturating_sub(self.base_from.queued);
            let sent = redirected + self.userspace + self.injected;
            if passed_on + 1 >= received && acked >= sent {
                return Ok(());
            }
            if acked > last_acked {
                last_acked = acked;
                deadline = Instant::now() + self.drain_timeout;
            } else if Instant::now() >= deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("receiver stalled: {acked} of {sent} bytes acknowledged"),
                ));
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }
}
