//! Micro-batching of QUIC sends: a connection's GSO batches leave as one, and with a
//! delay the datagrams of many connections leave together.
//!
//! quinn's connection driver asks quinn-proto for at most ten datagrams per GSO batch
//! (a constant of the `quinn` crate), 14.5 KB at 1452 bytes where one UDP send takes
//! 64 KB. So every task quinn spawns on an endpoint (its driver and each connection's)
//! runs under [`Runtime`], which polls it inside [`Batcher::coalescing`]: what the task
//! sends during that poll is queued, each transmit that continues the queue's last
//! message (the same peer, and datagrams of the size quinn already batched: see
//! [`Queue::joins`]) joins it as more datagrams of one GSO send, and the queue leaves
//! when the poll ends. Nothing waits beyond the poll that made it; a driver sends up to
//! 20 datagrams per poll, so at 1452 bytes a send carries 20 instead of 10.
//!
//! Across connections, with `h3_send_batch_delay_us` set:
//!
//! Every quinn connection driver hands its packets to the socket on its own
//! (`try_send`). With `h3_send_batch_delay_us` set, [`Batcher`] copies each of them
//! into the same bounded per-socket queue at any time, and one `sendmmsg` sends the
//! whole queue:
//!
//! * **When.** A task woken by the first queued transmit lets the worker run every
//!   task that is already ready (one `yield_now`: their transmits join the batch),
//!   then waits out what is left of the delay since the oldest queued transmit (tokio's
//!   timer rounds a wait up to its 1 ms tick) and sends. A full queue is sent at once
//!   by the transmit that fills it, so the delay bounds only a queue that stays small.
//! * **Bounded.** [`QUEUE_BYTES`] of payload and [`MAX_MESSAGES`] transmits. A
//!   transmit that does not fit first sends the queue synchronously; if the socket's
//!   buffer is full too, it is refused with `WouldBlock` (counted) and quinn retries it
//!   once the socket is writable: back-pressure, never an unbounded queue.
//! * **Order.** One FIFO queue, sent in order (a partial `sendmmsg` resumes where the
//!   kernel stopped), so each connection's packets leave in the order it made them.
//! * **Errors.** As quinn-udp does: a message the kernel refuses (not `EAGAIN`) is
//!   dropped and counted, and QUIC's loss recovery resends what it carried; one too
//!   large for the path (`EMSGSIZE`, a path MTU probe) is expected and not counted.
//!   The first `EINVAL` turns the ECN control message off and sends the message again
//!   without it; the first `EIO` or `EINVAL` of a GSO message turns GSO off
//!   ([`Batcher::gso_failed`]: the socket then offers one datagram per transmit).
//! * **End.** When the socket goes, what is still queued is sent once without waiting
//!   and anything the kernel does not take is dropped and counted; the task ends.
//!
//! Both ways share the bounds, the order, the error handling and the end. A queue that
//! a poll's end cannot send (the socket's buffer is full) is sent by the same task
//! once the socket is writable. The cost is one copy of each packet into the queue
//! (`try_send` only borrows it); at 1452 bytes the larger sends save about a sixth of
//! the server's CPU per byte (docs/benchmarks.md).

use std::cell::Cell;
use std::future::Future;
use std::io;
use std::os::fd::AsFd;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use super::lock;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use quinn::udp::Transmit;
use quinn::{AsyncTimer, AsyncUdpSocket};
use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;

use super::generation::{QuicSocket, GSO_BATCH_BYTES};
use crate::metrics::{Encoder, Kind, Values};
pub(crate) use crate::sys::udp::MAX_MESSAGES;
use crate::sys::udp::{self, Message, Refusal};

/// Payload bytes queued per socket, at most: about 18 full GSO batches at the
/// default MTU, small enough to stay in cache between the copy and the send.
pub(crate) const QUEUE_BYTES: usize = 256 * 1024;
/// How long the flushing task waits for a full socket buffer to drain before it drops
/// what is queued (counted).
const WRITABLE_TIMEOUT: Duration = Duration::from_secs(1);
/// Datagrams one GSO send may carry: the kernel's `UDP_MAX_SEGMENTS` (64 until Linux
/// 6.11 raised it to 128).
const MAX_SEGMENTS: usize = 64;

thread_local! {
    /// The batcher whose task this thread is polling inside [`Batcher::coalescing`]
    /// (its address, compared and never dereferenced; 0: none).
    static COALESCING: Cell<usize> = const { Cell::new(0) };
}

/// `sendmmsg` calls, by the messages (transmits) each carried.
static MESSAGES_PER_CALL: Values = Values::new(&[1, 2, 4, 8, 16, 32, 64], 1.0);
/// UDP datagrams those calls carried (a GSO message is several).
static DATAGRAMS: AtomicU64 = AtomicU64::new(0);
/// Transmits refused with `WouldBlock`: queue full and socket buffer full.
static REFUSED: AtomicU64 = AtomicU64::new(0);
/// Messages dropped: refused by the kernel, or left when the socket went.
static DROPPED: AtomicU64 = AtomicU64::new(0);

/// The send queue of one UDP socket; see the module documentation.
#[derive(Debug)]
pub(crate) struct Batcher {
    /// A duplicate of the endpoint's socket, registered with tokio for writability.
    fd: AsyncFd<std::net::UdpSocket>,
    queue: Mutex<Queue>,
    /// 0: batching off (transmits go straight to the socket once the queue is empty).
    delay_us: AtomicU64,
    /// Transmits queued now, so the path with batching off need not lock.
    queued: AtomicUsize,
    /// A transmit was refused: drivers wait until the queue is sent.
    blocked: AtomicBool,
    /// Signalled when a refused queue has been sent (or dropped).
    drained: Notify,
    /// The end of a poll could not send the queue; the task sends it once the socket
    /// is writable, and polls ending meanwhile do not try again.
    stalled: AtomicBool,
    wake: Arc<Notify>,
    /// The kernel refused a GSO message as the device's (`EIO`/`EINVAL`): one
    /// datagram per transmit from now on.
    gso_failed: AtomicBool,
    /// The kernel refused the ECN control message (`EINVAL`): sent without it now.
    no_ecn: AtomicBool,
}

#[derive(Debug, Default)]
struct Queue {
    bytes: Vec<u8>,
    msgs: Vec<Message>,
    /// Messages already sent from the front of `msgs` (a partial `sendmmsg`).
    sent: usize,
    /// When the oldest queued transmit arrived.
    since: Option<Instant>,
}

impl Queue {
    fn fits(&self, len: usize) -> bool {
        self.msgs.len() < MAX_MESSAGES && self.bytes.len() + len <= QUEUE_BYTES
    }

    /// Queues `t`: as many of its datagrams as [fit](Queue::room) join the last
    /// message, the rest make a message of their own.
    fn push(&mut self, t: &Transmit<'_>) {
        let joining = self.room(t);
        if joining > 0 {
            self.bytes.extend_from_slice(&t.contents[..joining]);
            let end = self.bytes.len();
            if let Some(last) = self.msgs.last_mut() {
                last.range.end = end;
            }
        }
        let rest = &t.contents[joining..];
        if rest.is_empty() {
            return;
        }
        let start = self.bytes.len();
        self.bytes.extend_from_slice(rest);
        self.msgs.push(Message {
            dest: t.destination,
            src_ip: t.src_ip,
            ecn: ecn_bits(t),
            segment_size: t.segment_size.and_then(|s| u16::try_from(s).ok()),
            range: start..self.bytes.len(),
        });
    }

    /// How many of `t`'s bytes continue the last queued message as more datagrams of
    /// one GSO send (0: none):
    ///
    /// * the message is unsent and [may grow](grows), to the same peer from the same
    ///   source with the same ECN codepoint (the same connection and path);
    /// * `t` is datagrams of the message's size (quinn batched it: GSO is on for the
    ///   connection), or one datagram no larger;
    /// * as many as fit within one send; all of `t` when it fits, its last datagram
    ///   possibly short (which ends the message's growth).
    fn room(&self, t: &Transmit<'_>) -> usize {
        let Some(last) = self.msgs.last().filter(|_| self.msgs.len() > self.sent) else {
            return 0;
        };
        let Some(segment) = grows(last) else { return 0 };
        if last.dest != t.destination || last.src_ip != t.src_ip || last.ecn != ecn_bits(t) {
            return 0;
        }
        let size = t.contents.len();
        let fits = match t.segment_size.filter(|&s| s < size) {
            Some(s) => s == segment,
            None => size <= segment,
        };
        if !fits {
            return 0;
        }
        let free = send_limit(segment) - last.range.len();
        if size <= free {
            size
        } else {
            free / segment * segment
        }
    }

    /// Whether the queue holds a message that can take nothing more: all but the
    /// last, or a last that cannot [grow](grows).
    fn has_complete(&self) -> bool {
        let pending = self.pending();
        pending.len() > 1 || pending.last().is_some_and(|m| grows(m).is_none())
    }

    fn pending(&self) -> &[Message] {
        &self.msgs[self.sent..]
    }

    fn advance(&mut self, n: usize) {
        self.sent += n;
        if self.sent >= self.msgs.len() {
            self.bytes.clear();
            self.msgs.clear();
            self.sent = 0;
            self.since = None;
        }
    }
}

/// Whether `t`, queued alone, would make a message that may take more datagrams.
fn may_grow(t: &Transmit<'_>) -> bool {
    let len = t.contents.len();
    t.segment_size
        .filter(|&s| s > 0 && s < len && len.is_multiple_of(s))
        .is_some_and(|s| len + s <= send_limit(s))
}

/// The segment size with which `m` may take more datagrams: quinn made its first
/// transmit a GSO batch (single datagrams never start one: with `h3_gso` off, or the
/// device refusing GSO, quinn batches nothing, and a path MTU probe, larger than the
/// rest and possibly refused by the path, never shares a send), every datagram in it
/// is full (only a send's last may be short), and one more fits in one send.
fn grows(m: &Message) -> Option<usize> {
    let segment = usize::from(m.segment_size?);
    let len = m.range.len();
    (segment > 0 && len.is_multiple_of(segment) && len + segment <= send_limit(segment)).then_some(segment)
}

/// The most bytes one GSO send of `segment`-byte datagrams carries:
/// [`GSO_BATCH_BYTES`] and [`MAX_SEGMENTS`].
fn send_limit(segment: usize) -> usize {
    GSO_BATCH_BYTES.min(MAX_SEGMENTS * segment)
}

/// The two ECN bits `t` is to be sent with.
fn ecn_bits(t: &Transmit<'_>) -> u8 {
    t.ecn.map_or(0, |e| e as u8)
}

impl Batcher {
    /// Batches sends on `socket` (a duplicate of the endpoint's), starting with
    /// `delay_us` (0: off). Needs a tokio runtime: it registers the socket and spawns
    /// the flushing task.
    pub(crate) fn new(socket: std::net::UdpSocket, delay_us: u64) -> io::Result<Arc<Self>> {
        let wake = Arc::new(Notify::new());
        let batcher = Arc::new(Self {
            fd: udp::writable_socket(socket)?,
            queue: Mutex::new(Queue {
                bytes: Vec::with_capacity(QUEUE_BYTES),
                msgs: Vec::with_capacity(MAX_MESSAGES),
                ..Queue::default()
            }),
            delay_us: AtomicU64::new(delay_us),
            queued: AtomicUsize::new(0),
            blocked: AtomicBool::new(false),
            drained: Notify::new(),
            stalled: AtomicBool::new(false),
            wake: wake.clone(),
            gso_failed: AtomicBool::new(false),
            no_ecn: AtomicBool::new(false),
        });
        tokio::spawn(flusher(Arc::downgrade(&batcher), wake));
        Ok(batcher)
    }

    pub(crate) fn set_delay(&self, delay_us: u64) {
        self.delay_us.store(delay_us, Ordering::Relaxed);
    }

    /// Whether GSO failed on this socket (see [`Batcher::flush_with`]).
    pub(crate) fn gso_failed(&self) -> bool {
        self.gso_failed.load(Ordering::Relaxed)
    }

    /// Whether transmits go through the queue now: with a delay, inside a poll
    /// [coalescing](Batcher::coalescing) on this thread, or behind what is queued.
    pub(crate) fn active(&self) -> bool {
        self.delay_us.load(Ordering::Relaxed) > 0
            || self.coalescing_here()
            || self.queued.load(Ordering::Acquire) > 0
    }

    /// Whether this thread is inside [`Batcher::coalescing`] of this batcher.
    fn coalescing_here(&self) -> bool {
        COALESCING.get() == std::ptr::from_ref(self) as usize
    }

    /// Runs `poll` (one poll of a task that sends on this socket) with its transmits
    /// queued, then sends the queue, unless a delay gathers other connections' too.
    pub(crate) fn coalescing<T>(&self, poll: impl FnOnce() -> T) -> T {
        /// Restores the thread's marker, even if `poll` unwinds.
        struct Restore(usize);
        impl Drop for Restore {
            fn drop(&mut self) {
                COALESCING.set(self.0);
            }
        }
        let outer = Restore(COALESCING.replace(std::ptr::from_ref(self) as usize));
        let polled = poll();
        drop(outer);
        self.end_poll();
        polled
    }

    /// The end of a coalescing poll: the queue leaves now, or the task sends it once
    /// the socket is writable.
    fn end_poll(&self) {
        let fd = self.fd.get_ref().as_fd();
        self.end_poll_with(|q, tos| udp::sendmmsg(fd, &q.bytes, q.pending(), tos));
    }

    /// [`Batcher::end_poll`] with the system call given (tests give a full socket).
    fn end_poll_with(&self, sendmmsg: impl FnMut(&Queue, bool) -> io::Result<usize>) {
        if self.delay_us.load(Ordering::Relaxed) > 0
            || self.queued.load(Ordering::Acquire) == 0
            || self.stalled.load(Ordering::Acquire)
        {
            return;
        }
        let sent = self.flush_with(&mut lock(&self.queue), sendmmsg);
        if sent.is_err() {
            self.stalled.store(true, Ordering::Release);
            self.wake.notify_one();
        }
    }

    /// Queues `t` (sending the queue first if `t` does not fit), or sends it with
    /// `direct` when batching is off and nothing is queued.
    pub(crate) fn send(
        &self,
        t: &Transmit<'_>,
        direct: impl FnOnce(&Transmit<'_>) -> io::Result<()>,
    ) -> io::Result<()> {
        let fd = self.fd.get_ref().as_fd();
        self.send_with(t, direct, |q, tos| udp::sendmmsg(fd, &q.bytes, q.pending(), tos))
    }

    /// [`Batcher::send`] with the system call given (tests give a full socket).
    fn send_with(
        &self,
        t: &Transmit<'_>,
        direct: impl FnOnce(&Transmit<'_>) -> io::Result<()>,
        mut sendmmsg: impl FnMut(&Queue, bool) -> io::Result<usize>,
    ) -> io::Result<()> {
        if !self.active() {
            return direct(t);
        }
        if t.contents.len() > QUEUE_BYTES {
            // Larger than any GSO batch can be; never queued, so never stuck.
            return direct(t);
        }
        let delayed = self.delay_us.load(Ordering::Relaxed) > 0;
        // Within a poll and without a delay, only a batch that may still grow waits
        // (for the poll's end): anything else leaves at once.
        let coalescing = !delayed && self.coalescing_here();
        let mut q = lock(&self.queue);
        if coalescing && q.pending().is_empty() && !may_grow(t) {
            drop(q);
            return direct(t);
        }
        if !q.fits(t.contents.len()) {
            if let Err(e) = self.flush_with(&mut q, &mut sendmmsg) {
                self.blocked.store(true, Ordering::Relaxed);
                REFUSED.fetch_add(1, Ordering::Relaxed);
                return Err(e);
            }
        }
        let first = q.msgs.is_empty();
        q.push(t);
        if first {
            q.since = Some(Instant::now());
        }
        if q.msgs.len() == MAX_MESSAGES || coalescing && q.has_complete() {
            // Sent now if the socket takes it; otherwise the task (or the poll's end)
            // sends it later.
            let _ = self.flush_with(&mut q, &mut sendmmsg);
        }
        self.queued.store(q.pending().len(), Ordering::Release);
        // The task sends a queue that no poll's end will: one waiting out a delay,
        // or started outside a coalescing poll (behind a queue another thread's poll
        // has sent meanwhile).
        if first && !coalescing {
            self.wake.notify_one();
        }
        Ok(())
    }

    /// Sends everything queued; `WouldBlock` when the socket's buffer is full (what
    /// is left stays queued).
    fn flush(&self, q: &mut Queue) -> io::Result<()> {
        let fd = self.fd.get_ref().as_fd();
        self.flush_with(q, |q, tos| udp::sendmmsg(fd, &q.bytes, q.pending(), tos))
    }

    /// Sends the queue with `send` (given whether to set the ECN codepoint).
    fn flush_with(
        &self,
        q: &mut Queue,
        mut send: impl FnMut(&Queue, bool) -> io::Result<usize>,
    ) -> io::Result<()> {
        while !q.pending().is_empty() {
            match send(q, !self.no_ecn.load(Ordering::Relaxed)) {
                // Never from the kernel (see `udp::sendmmsg`); taken as a full socket
                // rather than tried again at once, which would spin holding the lock.
                Ok(0) => {
                    self.queued.store(q.pending().len(), Ordering::Release);
                    return Err(io::ErrorKind::WouldBlock.into());
                }
                Ok(n) => {
                    MESSAGES_PER_CALL.observe(n as u64);
                    let datagrams: usize = q.pending()[..n].iter().map(Message::datagrams).sum();
                    DATAGRAMS.fetch_add(datagrams as u64, Ordering::Relaxed);
                    q.advance(n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.queued.store(q.pending().len(), Ordering::Release);
                    return Err(e);
                }
                Err(e) => {
                    if self.refused(&q.pending()[0], &e) {
                        continue;
                    }
                    q.advance(1);
                }
            }
        }
        self.unblock();
        Ok(())
    }

    /// Deals with `e`, the kernel's refusal of message `m`, as quinn-udp does with its
    /// own: true when `m` is to be sent again (without its ECN codepoint), false when
    /// it is dropped.
    fn refused(&self, m: &Message, e: &io::Error) -> bool {
        let why = udp::refusal(e);
        if why == Refusal::TooLarge {
            // A path MTU probe above the path's MTU: expected, lost by design.
            return false;
        }
        if why == Refusal::Invalid && !self.no_ecn.swap(true, Ordering::Relaxed) {
            tracing::info!(error = %e, "h3: batched sends refused the ECN codepoint; sending without it");
            return true;
        }
        let gso = m.datagrams() > 1;
        if gso
            && matches!(why, Refusal::Device | Refusal::Invalid)
            && !self.gso_failed.swap(true, Ordering::Relaxed)
        {
            tracing::info!(error = %e, "h3: batched sends refused a GSO batch; segmentation offload off");
        } else {
            tracing::debug!(error = %e, "h3: a batched UDP message was refused, dropped");
        }
        DROPPED.fetch_add(1, Ordering::Relaxed);
        false
    }

    /// The queue is empty: drivers refused a transmit may send again.
    fn unblock(&self) {
        self.queued.store(0, Ordering::Release);
        if self.blocked.swap(false, Ordering::AcqRel) {
            self.drained.notify_waiters();
        }
    }

    /// How long the oldest queued transmit may still wait.
    fn due(&self) -> Option<Instant> {
        let since = lock(&self.queue).since?;
        Some(since + Duration::from_micros(self.delay_us.load(Ordering::Relaxed)))
    }

    /// Sends the queue, waiting (bounded) for the socket to take it.
    async fn flush_when_writable(&self) {
        if self.flush(&mut lock(&self.queue)).is_ok() {
            return;
        }
        let deadline = tokio::time::Instant::now() + WRITABLE_TIMEOUT;
        loop {
            let mut ready = match tokio::time::timeout_at(deadline, self.fd.writable()).await {
                Ok(Ok(ready)) => ready,
                Ok(Err(_)) | Err(_) => {
                    self.drop_queued("the socket stayed full");
                    return;
                }
            };
            // Through the readiness guard, so `EAGAIN` clears tokio's stale readiness.
            let sent = self.flush_with(&mut lock(&self.queue), |q, tos| {
                ready
                    .try_io(|s| udp::sendmmsg(s.get_ref().as_fd(), &q.bytes, q.pending(), tos))
                    .unwrap_or_else(|_| Err(io::ErrorKind::WouldBlock.into()))
            });
            if sent.is_ok() {
                return;
            }
        }
    }

    fn drop_queued(&self, why: &str) {
        let mut q = lock(&self.queue);
        let n = q.pending().len();
        if n > 0 {
            tracing::debug!(messages = n, why, "h3: batched UDP messages dropped");
            DROPPED.fetch_add(n as u64, Ordering::Relaxed);
            q.advance(n);
        }
        drop(q);
        self.unblock();
    }

    /// What a connection driver polls before sending: ready unless a transmit was
    /// refused, then once the queue has been sent.
    pub(crate) fn poller(self: &Arc<Self>) -> Writable {
        Writable {
            batcher: self.clone(),
            wait: None,
        }
    }
}

impl Drop for Batcher {
    fn drop(&mut self) {
        let sent = self.flush(&mut lock(&self.queue));
        if sent.is_err() {
            self.drop_queued("the socket closed");
        }
        // The task sees the batcher gone and ends.
        self.wake.notify_one();
    }
}

type WaitFuture = Pin<Box<dyn std::future::Future<Output = ()> + Send + Sync>>;

/// A connection driver's view of [`Batcher::blocked`].
pub(crate) struct Writable {
    batcher: Arc<Batcher>,
    wait: Option<WaitFuture>,
}

impl std::fmt::Debug for Writable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Writable").finish_non_exhaustive()
    }
}

impl Writable {
    pub(crate) fn poll_writable(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !self.batcher.blocked.load(Ordering::Relaxed) {
            self.wait = None;
            return Poll::Ready(Ok(()));
        }
        let batcher = self.batcher.clone();
        let wait = self.wait.get_or_insert_with(|| {
            Box::pin(async move {
                let drained = batcher.drained.notified();
                tokio::pin!(drained);
                // Registered before the check, so a drain in between is not missed.
                drained.as_mut().enable();
                if batcher.blocked.load(Ordering::Acquire) {
                    drained.await;
                }
            })
        });
        let ready = wait.as_mut().poll(cx);
        if ready.is_ready() {
            self.wait = None;
        }
        ready.map(Ok)
    }
}

/// Sends each batch once the worker's ready tasks have run and the delay is over.
async fn flusher(batcher: Weak<Batcher>, wake: Arc<Notify>) {
    loop {
        wake.notified().await;
        // The other tasks this worker has ready run first: their transmits join.
        tokio::task::yield_now().await;
        let Some(b) = batcher.upgrade() else { return };
        if let Some(due) = b.due() {
            if due > Instant::now() {
                tokio::time::sleep_until(due.into()).await;
            }
        }
        b.flush_when_writable().await;
        b.stalled.store(false, Ordering::Release);
    }
}

/// quinn's runtime for the endpoint on one socket: tokio's, except that each task
/// quinn spawns (the endpoint's driver, every connection's) is polled inside
/// [`Batcher::coalescing`] of the socket's batcher, when it has one.
#[derive(Debug)]
pub(crate) struct Runtime {
    socket: Arc<QuicSocket>,
}

impl Runtime {
    pub(crate) fn new(socket: Arc<QuicSocket>) -> Self {
        Self { socket }
    }
}

impl quinn::Runtime for Runtime {
    fn new_timer(&self, at: Instant) -> Pin<Box<dyn AsyncTimer>> {
        quinn::TokioRuntime.new_timer(at)
    }

    fn spawn(&self, future: Pin<Box<dyn Future<Output = ()> + Send>>) {
        tokio::spawn(Coalesced {
            future,
            socket: self.socket.clone(),
        });
    }

    fn wrap_udp_socket(&self, socket: std::net::UdpSocket) -> io::Result<Arc<dyn AsyncUdpSocket>> {
        quinn::TokioRuntime.wrap_udp_socket(socket)
    }
}

/// A task quinn spawned, polled as [`Runtime`] says.
struct Coalesced {
    future: Pin<Box<dyn Future<Output = ()> + Send>>,
    socket: Arc<QuicSocket>,
}

impl Future for Coalesced {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        match this.socket.batcher() {
            Some(b) => b.coalescing(|| this.future.as_mut().poll(cx)),
            None => this.future.as_mut().poll(cx),
        }
    }
}

/// Writes the batching counters (called by the QUIC collector).
pub(crate) fn write_metrics(out: &mut Encoder) {
    out.family(
        "webship_quic_send_batch_messages",
        Kind::Histogram,
        "sendmmsg calls of gathered QUIC sends, by the messages (one connection's GSO send each) they carried.",
    );
    MESSAGES_PER_CALL.write(out, &[]);
    out.family(
        "webship_quic_send_batch_datagrams",
        Kind::Counter,
        "UDP datagrams sent by the gathered sendmmsg calls.",
    )
    .sample(&[], DATAGRAMS.load(Ordering::Relaxed));
    out.family(
        "webship_quic_send_batch_refused",
        Kind::Counter,
        "QUIC transmits refused because the batch queue and the socket buffer were full (quinn retries them).",
    )
    .sample(&[], REFUSED.load(Ordering::Relaxed));
    out.family(
        "webship_quic_send_batch_dropped",
        Kind::Counter,
        "Batched UDP messages dropped: refused by the kernel, or queued when the socket closed.",
    )
    .sample(&[], DROPPED.load(Ordering::Relaxed));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{SocketAddr, UdpSocket};

    fn receiver() -> (UdpSocket, SocketAddr) {
        let s = UdpSocket::bind("127.0.0.1:0").unwrap();
        s.set_nonblocking(true).unwrap();
        let addr = s.local_addr().unwrap();
        (s, addr)
    }

    fn batcher(delay_us: u64) -> Arc<Batcher> {
        Batcher::new(UdpSocket::bind("127.0.0.1:0").unwrap(), delay_us).unwrap()
    }

    fn transmit(dest: SocketAddr, contents: &[u8]) -> Transmit<'_> {
        Transmit {
            destination: dest,
            ecn: None,
            contents,
            segment_size: None,
            src_ip: None,
        }
    }

    fn queue(b: &Batcher, dest: SocketAddr, contents: &[u8]) {
        b.send(&transmit(dest, contents), |_| {
            panic!("sent directly while batching")
        })
        .unwrap();
    }

    /// Everything `s` has received now, as numbers (each datagram a big-endian u32).
    fn received(s: &UdpSocket) -> Vec<u32> {
        let mut got = Vec::new();
        let mut buf = [0u8; 64];
        while let Ok(n) = s.recv(&mut buf) {
            got.push(u32::from_be_bytes(buf[..n].try_into().unwrap()));
        }
        got
    }

    #[tokio::test]
    async fn a_full_queue_leaves_at_once_in_order_per_destination() {
        let b = batcher(1000);
        let ((ra, a), (rb, bb)) = (receiver(), receiver());
        for i in 0..MAX_MESSAGES as u32 - 1 {
            queue(&b, if i % 2 == 0 { a } else { bb }, &i.to_be_bytes());
        }
        assert_eq!(b.queued.load(Ordering::Relaxed), MAX_MESSAGES - 1);
        assert!(received(&ra).is_empty(), "sent before the queue was full or due");
        // The transmit that fills the queue sends it, without waiting for the tick.
        queue(&b, bb, &(MAX_MESSAGES as u32 - 1).to_be_bytes());
        assert_eq!(b.queued.load(Ordering::Relaxed), 0);
        let evens: Vec<u32> = (0..MAX_MESSAGES as u32).step_by(2).collect();
        let odds: Vec<u32> = (1..MAX_MESSAGES as u32).step_by(2).collect();
        assert_eq!(received(&ra), evens);
        assert_eq!(received(&rb), odds);
    }

    /// Queue full and socket full: the next transmit is refused (quinn keeps it), the
    /// drivers' poller waits, and once the task has sent the queue they may go on.
    #[tokio::test]
    async fn a_full_queue_on_a_full_socket_refuses_until_the_queue_has_left() {
        let b = batcher(1000);
        let (r, a) = receiver();
        let full = |_: &Queue, _| -> io::Result<usize> { Err(io::ErrorKind::WouldBlock.into()) };
        for i in 0..MAX_MESSAGES as u32 {
            b.send_with(&transmit(a, &i.to_be_bytes()), |_| panic!("direct"), full)
                .unwrap();
        }
        assert_eq!(b.queued.load(Ordering::Relaxed), MAX_MESSAGES);
        let refused = b
            .send_with(&transmit(a, &99u32.to_be_bytes()), |_| panic!("direct"), full)
            .unwrap_err();
        assert_eq!(refused.kind(), io::ErrorKind::WouldBlock);
        let mut poller = b.poller();
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(
            poller.poll_writable(&mut cx).is_pending(),
            "a refused driver must wait"
        );
        // The flushing task (the socket is really writable) sends the queue.
        tokio::time::timeout(
            Duration::from_secs(5),
            std::future::poll_fn(|cx| poller.poll_writable(cx)),
        )
        .await
        .expect("the poller was not woken when the queue left")
        .unwrap();
        assert_eq!(b.queued.load(Ordering::Relaxed), 0);
        assert_eq!(received(&r), (0..MAX_MESSAGES as u32).collect::<Vec<_>>());
    }

    #[tokio::test]
    async fn the_byte_cap_is_respected() {
        let b = batcher(1000);
        let (_r, a) = receiver();
        let big = vec![7u8; 60_000];
        for round in 1..=9 {
            b.send(
                &Transmit {
                    segment_size: Some(1200),
                    ..transmit(a, &big)
                },
                |_| panic!("sent directly"),
            )
            .unwrap();
            let q = lock(&b.queue);
            assert!(
                q.bytes.len() <= QUEUE_BYTES,
                "round {round}: {} bytes queued",
                q.bytes.len()
            );
            // Four fit in 256 KiB; the fifth sends them first and starts a new batch.
            assert_eq!(q.pending().len(), (round - 1) % 4 + 1, "round {round}");
        }
    }

    #[tokio::test]
    async fn a_small_queue_leaves_on_the_tick() {
        let b = batcher(1000);
        let (r, a) = receiver();
        for i in 0..3u32 {
            queue(&b, a, &i.to_be_bytes());
        }
        assert!(received(&r).is_empty(), "sent before the tick");
        let start = Instant::now();
        let mut got = Vec::new();
        while got.len() < 3 && start.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(Duration::from_millis(1)).await;
            got.extend(received(&r));
        }
        assert_eq!(got, [0, 1, 2]);
        assert_eq!(b.queued.load(Ordering::Relaxed), 0);
    }

    #[tokio::test]
    async fn off_sends_directly_and_a_dropped_socket_sends_its_queue() {
        let b = batcher(0);
        let (r, a) = receiver();
        let mut direct = 0;
        b.send(&transmit(a, &[0; 4]), |_| {
            direct += 1;
            Ok(())
        })
        .unwrap();
        assert_eq!(direct, 1);
        b.set_delay(1000);
        queue(&b, a, &5u32.to_be_bytes());
        // Turned off with a transmit queued: the next one queues behind it (order).
        b.set_delay(0);
        queue(&b, a, &6u32.to_be_bytes());
        drop(b);
        assert_eq!(received(&r), [5, 6]);
    }

    fn queued(transmits: &[Transmit<'_>]) -> Queue {
        let mut q = Queue::default();
        for t in transmits {
            q.push(t);
        }
        q
    }

    fn gso<'a>(dest: SocketAddr, contents: &'a [u8], segment: usize) -> Transmit<'a> {
        Transmit {
            segment_size: Some(segment),
            ..transmit(dest, contents)
        }
    }

    /// Each queued message as (datagrams, bytes).
    fn shapes(q: &Queue) -> Vec<(usize, usize)> {
        q.pending()
            .iter()
            .map(|m| (m.datagrams(), m.range.len()))
            .collect()
    }

    /// A connection's GSO batches (ten datagrams each, quinn's most) fill one send:
    /// up to 64 KB and 64 datagrams; a short last datagram ends it. At a jumbo size
    /// the parts `try_send` splits a batch into top each other up.
    #[test]
    fn a_connection_s_gso_batches_fill_one_send() {
        let a: SocketAddr = "127.0.0.1:4433".parse().unwrap();
        let ten = vec![1u8; 10 * 1452];
        let q = queued(&[gso(a, &ten, 1452), gso(a, &ten, 1452), transmit(a, &[2; 700])]);
        assert_eq!(shapes(&q), [(21, 20 * 1452 + 700)]);
        assert_eq!(q.pending()[0].segment_size, Some(1452));
        assert_eq!(q.bytes.len(), 20 * 1452 + 700, "one copy of each byte");
        // The short datagram ended that send: the next batch starts another.
        let mut q = q;
        q.push(&gso(a, &ten, 1452));
        assert_eq!(shapes(&q), [(21, 20 * 1452 + 700), (10, 10 * 1452)]);
        // 65,487 bytes hold 45 datagrams of 1452, and a send holds 64 of 1000.
        let q = queued(&vec![gso(a, &ten, 1452); 5]);
        assert_eq!(shapes(&q), [(45, 45 * 1452), (5, 5 * 1452)]);
        let small = vec![3u8; 10 * 1000];
        let q = queued(&vec![gso(a, &small, 1000); 7]);
        assert_eq!(shapes(&q), [(64, 64_000), (6, 6000)]);
        // Ten jumbo datagrams leave `try_send` as parts of seven and three.
        let (seven, three) = (vec![4u8; 7 * 8972], vec![5u8; 3 * 8972]);
        let part = |c| gso(a, c, 8972);
        let q = queued(&[part(&seven), part(&three), part(&seven), part(&three)]);
        assert_eq!(shapes(&q), [(7, 7 * 8972), (7, 7 * 8972), (6, 6 * 8972)]);
    }

    /// Only what quinn batched grows, and only with its own kind.
    #[test]
    fn what_may_not_share_a_send_stays_apart() {
        let (a, b): (SocketAddr, SocketAddr) =
            ("127.0.0.1:1".parse().unwrap(), "127.0.0.1:2".parse().unwrap());
        let (two, one) = (vec![1u8; 2400], vec![1u8; 1200]);
        let cases: [(&str, Vec<Transmit<'_>>); 7] = [
            // `h3_gso = "0"` (or a device without GSO): quinn sends single datagrams.
            ("single datagrams", vec![transmit(a, &one), transmit(a, &one)]),
            (
                "a probe after a batch",
                vec![gso(a, &two, 1200), transmit(a, &[0; 1500])],
            ),
            (
                "a batch after a probe",
                vec![transmit(a, &[0; 1500]), gso(a, &two, 1200)],
            ),
            ("another peer", vec![gso(a, &two, 1200), gso(b, &two, 1200)]),
            (
                "another ECN codepoint",
                vec![
                    gso(a, &two, 1200),
                    Transmit {
                        ecn: Some(quinn::udp::EcnCodepoint::Ect0),
                        ..gso(a, &two, 1200)
                    },
                ],
            ),
            ("another size", vec![gso(a, &two, 1200), gso(a, &[0; 2600], 1300)]),
            (
                "after a short datagram",
                vec![gso(a, &[0; 2500], 1200), gso(a, &two, 1200)],
            ),
        ];
        for (case, transmits) in cases {
            let q = queued(&transmits);
            assert_eq!(q.pending().len(), 2, "{case}: {:?}", shapes(&q));
        }
    }

    /// Inside a poll without a delay: a batch that may grow waits for the poll's end,
    /// which sends it as one message whose datagrams arrive as quinn built them; what
    /// cannot grow, with nothing queued, goes straight to the socket.
    #[tokio::test]
    async fn a_poll_s_batches_leave_as_one_send_at_its_end() {
        let b = batcher(0);
        let (r, a) = receiver();
        let numbers = |range: std::ops::Range<u32>| -> Vec<u8> { range.flat_map(u32::to_be_bytes).collect() };
        let (first, second) = (numbers(0..10), numbers(10..20));
        let mut direct = 0;
        b.coalescing(|| {
            b.send(&transmit(a, &99u32.to_be_bytes()), |_| {
                direct += 1;
                Ok(())
            })
            .unwrap();
            for t in [
                gso(a, &first, 4),
                gso(a, &second, 4),
                transmit(a, &20u32.to_be_bytes()),
            ] {
                b.send(&t, |_| panic!("a batch that may grow was sent directly"))
                    .unwrap();
            }
            let q = lock(&b.queue);
            assert_eq!(shapes(&q), [(21, 84)], "not one message before the poll's end");
        });
        assert_eq!(direct, 1, "a lone datagram waited");
        assert_eq!(
            b.queued.load(Ordering::Relaxed),
            0,
            "the poll's end left it queued"
        );
        assert_eq!(received(&r), (0..21).collect::<Vec<u32>>());
    }

    /// A poll's end that finds the socket full leaves the queue to the task, which
    /// sends it once the socket is writable; polls ending meanwhile do not try again.
    #[tokio::test]
    async fn a_poll_end_on_a_full_socket_leaves_the_queue_to_the_task() {
        let b = batcher(0);
        let (r, a) = receiver();
        let both = [0u32.to_be_bytes(), 1u32.to_be_bytes()].concat();
        let outer = COALESCING.replace(std::ptr::from_ref(&*b) as usize);
        b.send(&gso(a, &both, 4), |_| panic!("direct")).unwrap();
        COALESCING.set(outer);
        let full = |_: &Queue, _| -> io::Result<usize> { Err(io::ErrorKind::WouldBlock.into()) };
        b.end_poll_with(full);
        assert!(b.stalled.load(Ordering::Relaxed));
        b.end_poll_with(|_, _| panic!("tried again while the task waits"));
        let start = Instant::now();
        let mut got = Vec::new();
        while got.len() < 2 && start.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(Duration::from_millis(1)).await;
            got.extend(received(&r));
        }
        assert_eq!(got, [0, 1], "the task did not send the queue");
        assert!(!b.stalled.load(Ordering::Relaxed));
    }

    /// A send that takes nothing is a full socket, not a reason to call again at once
    /// (which would spin holding the queue's lock). Failed before the fix by never
    /// returning.
    #[tokio::test]
    async fn a_send_that_takes_nothing_is_a_full_socket() {
        let b = batcher(1000);
        let (_r, a) = receiver();
        let (tx, rx) = std::sync::mpsc::channel();
        let worker = b.clone();
        std::thread::spawn(move || {
            let mut q = queued(&[transmit(a, b"x")]);
            let _ = tx.send(worker.flush_with(&mut q, |_, _| Ok(0)).map_err(|e| e.kind()));
        });
        let got = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("flush_with kept calling a send that took nothing");
        assert_eq!(got, Err(io::ErrorKind::WouldBlock));
    }

    /// As quinn-udp: `EMSGSIZE` (a path MTU probe) is skipped and not counted; the
    /// first `EINVAL` sends the message again without ECN, for good; `EIO` on a GSO
    /// message turns GSO off (one datagram per transmit) and drops that message.
    #[tokio::test]
    async fn refusals_are_handled_as_quinn_udp_does() {
        let b = batcher(1000);
        let (_r, a) = receiver();
        let gso = Transmit {
            segment_size: Some(2),
            ..transmit(a, b"gsogso")
        };
        let mut q = queued(&[
            transmit(a, b"probe"),
            transmit(a, b"ecn"),
            gso,
            transmit(a, b"last"),
        ]);
        let dropped = DROPPED.load(Ordering::Relaxed);
        let mut calls = Vec::new();
        let error = |code| Err(io::Error::from_raw_os_error(code));
        b.flush_with(&mut q, |q, tos| {
            let first = &q.bytes[q.pending()[0].range.clone()];
            calls.push((String::from_utf8_lossy(first).into_owned(), tos));
            match (first, tos) {
                (b"probe", _) => error(libc::EMSGSIZE),
                (b"ecn", true) => error(libc::EINVAL),
                (b"gsogso", _) => error(libc::EIO),
                _ => Ok(1),
            }
        })
        .unwrap();
        let want = [
            ("probe", true),
            ("ecn", true),
            ("ecn", false),
            ("gsogso", false),
            ("last", false),
        ];
        let want: Vec<(String, bool)> = want.iter().map(|&(m, t)| (m.to_owned(), t)).collect();
        assert_eq!(calls, want);
        assert!(b.gso_failed(), "GSO still on after the device refused it");
        assert_eq!(
            DROPPED.load(Ordering::Relaxed) - dropped,
            1,
            "only the GSO message is a drop"
        );
    }
}
