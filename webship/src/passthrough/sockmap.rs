//! The `sockmap` engine: the eBPF stream verdict (webship-ebpf) redirects every
//! segment one socket receives to the other's transmit queue, so payload never
//! reaches userspace. The daemon sets the link up and watches for the ends.
//!
//! Four kernel behaviours shape it (measured on Linux 6.x):
//! - a segment the program passes to userspace (its peer not in the map) waits in
//!   its socket while later ones are redirected past it, so order is kept by never
//!   redirecting while the daemon still has bytes of that direction to forward:
//!   the PROXY header and the ClientHello (read whole off the client) are written
//!   to the upstream *before* the sockets are linked, both directions at once, and
//!   a direction that once had to pass a segment passes every later one too (the
//!   program's `passed` flag; the watcher forwards them in order). Opening the
//!   client's direction after the upstream's, as before, let a TLS client's second
//!   flight land in between and reach the origin behind its successor (CI: "bad
//!   record mac" at nginx);
//! - segments that arrive before the link wait in the socket and go through the
//!   verdict, in order, at its next wake-up: a new segment, or the daemon's next
//!   read of the socket (tcp_bpf's recvmsg runs the receive queue first), which is
//!   why each watcher reads once before it waits;
//! - a FIN must not travel through the redirect: the program leaves a segment
//!   without payload in its socket (redirected, the kernel's sender fails on it
//!   and sets `EPIPE` on the peer socket, which the daemon then reads as an error:
//!   an origin that answered and half-closed at once ended as a reset). When one
//!   side's read half closes, the daemon waits until everything that side
//!   received was redirected *and* acknowledged by the other side's peer
//!   (`TCP_INFO` byte counts), then half-closes the other side itself;
//! - only established sockets can be linked (a client that already half-closed
//!   cannot), and map entries outlive nothing: a connection that cannot be linked
//!   is relayed by the `copy` engine instead, and the link is removed when the
//!   connection ends, whichever way it ends.
//!
//! A segment the program leaves in a socket is read and forwarded from userspace,
//! so no byte is lost. That includes segments for a peer that has left the map
//! (the kernel unhashes a reset or closed socket): they wait in the socket, so the
//! sender is held back by its window instead of being drained into nothing, and
//! the daemon's write to the dead peer ends the connection.

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::TcpStream;

use super::{count, write_all, Counter};
use crate::ebpf::{Programs, SocketLink};
use crate::sys::{self, TcpBytes};

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
    // origin's answer), waits in its socket and goes through the verdict in order
    // at the socket's next wake-up; each watcher's first read is one.
    count(Counter::BytesUp, hello);
    let link = match programs.link(client.as_fd(), upstream.as_fd()) {
        Ok(link) => link,
        Err(e) => {
            // The kernel links established sockets only (a client that already
            // half-closed is not one), and the map has a size: such a connection
            // is relayed from userspace instead, from where the hello left off.
            tracing::debug!(error = %e, "sockmap: cannot link, relayed by copy");
            return super::copy(client, upstream).await;
        }
    };
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
        // What is queued is read first: a segment landing between the two reads
        // then counts as received after the baseline, which the delivery check
        // tolerates (what was read counts as passed on). The other order counted
        // it as queued but not received, and the check waited for a byte that
        // never comes.
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
        // The first turn reads without waiting: a read runs the segments queued
        // before the link through the verdict first (tcp_bpf's recvmsg), so they
        // leave even if nothing else ever arrives.
        let mut first = true;
        loop {
            if !std::mem::take(&mut first) {
                self.from.readable().await?;
            }
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
    async fn delivered(&self) -> io::Result<()> {
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
