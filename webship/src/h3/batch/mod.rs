//! The send queue of one UDP socket: QUIC transmits gathered into fewer, larger sends.
//!
//! quinn's connection driver hands the socket at most ten datagrams per transmit
//! (`MAX_TRANSMIT_SEGMENTS` in the `quinn` crate): 14.5 KB at 1452 bytes, where one
//! GSO send takes 64 KB. [`Batcher`] queues transmits ([`queue`]) and sends the queue
//! with one `sendmmsg`, in two ways:
//!
//! * **Within a poll (always).** Every task quinn spawns runs under
//!   [`GatheringRuntime`], which polls it inside [`Batcher::gathering`]. A GSO batch
//!   that may still grow (every datagram full, room for one more) waits in the queue,
//!   and the same connection's next transmits join it as more datagrams of one
//!   message, up to 64 KB and 64 datagrams; a short datagram closes it. A closed
//!   message leaves at once, an open one when the poll ends. A transmit that cannot
//!   grow, with nothing queued, goes straight to the socket, uncopied. A driver sends
//!   up to 20 datagrams per poll, so at 1452 bytes a send carries up to 20 (19
//!   measured) instead of 10.
//! * **Across connections (`h3_send_batch_delay_us` above 0).** Every transmit is
//!   queued (joining as above), and the flushing task sends the queue once the worker
//!   has run its other ready tasks (one `yield_now`: their transmits join) and the
//!   delay since the oldest queued transmit is over (tokio rounds a wait up to its
//!   1 ms tick).
//!
//! Both share the rest:
//!
//! * **Who sends.** The transmit that fills the queue; without a delay, a closed
//!   message or the poll's end; otherwise the flushing task: after the delay, for a
//!   queue started outside a poll, and for one a poll's end found the socket too full
//!   to take ([`Batcher::leave_to_task`]).
//! * **Bounded.** [`QUEUE_BYTES`] of payload and [`MAX_MESSAGES`] messages. A
//!   transmit that does not fit first sends the queue synchronously; if the socket's
//!   buffer is full too, it is refused with `WouldBlock` (counted) and quinn retries it
//!   once the queue has gone out: back-pressure, never an unbounded queue. The task
//!   tries a full socket again as it signals room and at least every
//!   [`WRITABLE_RECHECK`], and after [`WRITABLE_TIMEOUT`] drops what is queued
//!   (counted).
//! * **Order.** One FIFO queue, sent in order (a partial `sendmmsg` resumes where the
//!   kernel stopped), and a transmit goes straight to the socket only when nothing is
//!   queued, so each connection's packets leave in the order it made them.
//! * **Errors.** As quinn-udp does: a message the kernel refuses (not `EAGAIN`) is
//!   dropped and counted, and QUIC's loss recovery resends what it carried; one too
//!   large for the path (`EMSGSIZE`, a path MTU probe) is expected and not counted.
//!   The first `EINVAL` turns the ECN control message off and sends the message again
//!   without it; the first `EIO` or `EINVAL` of a GSO message turns GSO off
//!   ([`Batcher::gso_failed`]: the socket then offers one datagram per transmit).
//! * **End.** When the socket goes, what is still queued is sent once without waiting
//!   and anything the kernel does not take is dropped and counted; the task ends.
//!
//! The cost is one copy of each queued packet (`try_send` only borrows it); at 1452
//! bytes the gathered sends took a bulk download's server CPU from 0.97 to 0.86
//! CPU-s/GB (docs/benchmarks.md, "A connection's GSO batches in one send").
//!
//! [`MAX_MESSAGES`]: crate::sys::udp::MAX_MESSAGES

mod queue;
mod runtime;

use std::cell::Cell;
use std::io;
use std::os::fd::AsFd;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use quinn::udp::Transmit;
use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;

use super::lock;
use crate::metrics::{Encoder, Kind, Values};
use crate::sys::udp::{self, Message, Refusal};
use queue::{Queue, QUEUE_BYTES};
pub(crate) use runtime::GatheringRuntime;

/// How long the flushing task waits for a full socket buffer to drain before it drops
/// what is queued (counted).
const WRITABLE_TIMEOUT: Duration = Duration::from_secs(1);
/// How often the flushing task tries a full socket again without its signal of room.
const WRITABLE_RECHECK: Duration = Duration::from_millis(10);

thread_local! {
    /// The batcher whose task this thread is polling inside [`Batcher::gathering`]
    /// (its address, compared and never dereferenced; 0: none).
    static GATHERING: Cell<usize> = const { Cell::new(0) };
}

/// `sendmmsg` calls, by the messages (one or more of a connection's transmits each)
/// they carried.
static MESSAGES_PER_CALL: Values = Values::new(&[1, 2, 4, 8, 16, 32, 64], 1.0);
/// UDP datagrams those calls carried (a GSO message is several).
static DATAGRAMS: AtomicU64 = AtomicU64::new(0);
/// Transmits refused with `WouldBlock`: queue full and socket buffer full.
static REFUSED: AtomicU64 = AtomicU64::new(0);
/// Messages dropped: refused by the kernel, still queued when the socket stayed full
/// for [`WRITABLE_TIMEOUT`], or left when the socket went.
static DROPPED: AtomicU64 = AtomicU64::new(0);

/// The send queue of one UDP socket; see the module documentation.
#[derive(Debug)]
pub(crate) struct Batcher {
    /// A duplicate of the endpoint's socket, registered with tokio for writability.
    fd: AsyncFd<std::net::UdpSocket>,
    queue: Mutex<Queue>,
    /// 0: no cross-connection delay (only a poll's own transmits are gathered).
    delay_us: AtomicU64,
    /// Messages queued now, so sends outside a poll and polls' ends need not lock.
    queued: AtomicUsize,
    /// A transmit was refused: drivers wait until the queue is sent.
    blocked: AtomicBool,
    /// Signalled when a refused queue has been sent (or dropped).
    drained: Notify,
    /// The flushing task sends the queue ([`Batcher::leave_to_task`]); polls' ends
    /// only wake it.
    left_to_task: AtomicBool,
    wake: Arc<Notify>,
    /// The kernel refused a GSO message as the device's (`EIO`/`EINVAL`): one
    /// datagram per transmit from now on.
    gso_failed: AtomicBool,
    /// The kernel refused the ECN control message (`EINVAL`): sent without it now.
    no_ecn: AtomicBool,
}

impl Batcher {
    /// Batches sends on `socket` (a duplicate of the endpoint's), starting with
    /// `delay_us` (0: no cross-connection delay). Needs a tokio runtime: it registers the socket and spawns
    /// the flushing task.
    pub(crate) fn new(socket: std::net::UdpSocket, delay_us: u64) -> io::Result<Arc<Self>> {
        let wake = Arc::new(Notify::new());
        let batcher = Arc::new(Self {
            fd: udp::writable_socket(socket)?,
            queue: Mutex::new(Queue::with_capacity()),
            delay_us: AtomicU64::new(delay_us),
            queued: AtomicUsize::new(0),
            blocked: AtomicBool::new(false),
            drained: Notify::new(),
            left_to_task: AtomicBool::new(false),
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

    /// Whether transmits go through the queue now: with a delay, inside a gathering
    /// poll of this queue on this thread, or behind what is queued.
    pub(crate) fn active(&self) -> bool {
        self.delay_us.load(Ordering::Relaxed) > 0
            || self.gathering_here()
            || self.queued.load(Ordering::Acquire) > 0
    }

    /// Whether this thread is inside [`Batcher::gathering`] of this batcher.
    fn gathering_here(&self) -> bool {
        GATHERING.get() == std::ptr::from_ref(self) as usize
    }

    /// Runs `poll` (one poll of a task that sends on this socket) with its transmits
    /// gathered, then [sends what it left](Batcher::send_after_poll).
    pub(crate) fn gathering<T>(&self, poll: impl FnOnce() -> T) -> T {
        /// Restores the thread's marker and ends the poll, even if `poll` unwinds.
        struct End<'a> {
            batcher: &'a Batcher,
            outer: usize,
        }
        impl Drop for End<'_> {
            fn drop(&mut self) {
                GATHERING.set(self.outer);
                self.batcher.send_after_poll();
            }
        }
        let _end = End {
            batcher: self,
            outer: GATHERING.replace(std::ptr::from_ref(self) as usize),
        };
        poll()
    }

    /// The end of a gathering poll: the queue leaves now, unless the task has it.
    fn send_after_poll(&self) {
        self.send_after_poll_with(|q, tos| self.sendmmsg(q, tos));
    }

    /// [`Batcher::send_after_poll`] with the system call given (tests give a full
    /// socket). A queue waiting out a delay (one set by a reload while the poll ran,
    /// too), or already left to the task, is the task's: it is woken, in case it has
    /// just finished. One the socket does not take is left to it.
    fn send_after_poll_with(&self, sendmmsg: impl FnMut(&Queue, bool) -> io::Result<usize>) {
        if self.queued.load(Ordering::Acquire) == 0 {
            return;
        }
        if self.delay_us.load(Ordering::Relaxed) > 0 || self.left_to_task.load(Ordering::Acquire) {
            self.wake.notify_one();
            return;
        }
        let mut q = lock(&self.queue);
        if self.flush_with(&mut q, sendmmsg).is_err() {
            self.leave_to_task(q);
        }
    }

    /// The flushing task sends the queue from now on: polls' ends only wake it, until
    /// the queue is [emptied](Batcher::emptied). Marked under the queue's lock (`q`),
    /// as it is cleared.
    fn leave_to_task(&self, q: std::sync::MutexGuard<'_, Queue>) {
        self.left_to_task.store(true, Ordering::Release);
        drop(q);
        self.wake.notify_one();
    }

    /// Queues `t` (sending the queue first if `t` does not fit), or sends it with
    /// `direct` when nothing is queued and it would neither wait for a delay nor grow
    /// within this poll.
    pub(crate) fn send(
        &self,
        t: &Transmit<'_>,
        direct: impl FnOnce(&Transmit<'_>) -> io::Result<()>,
    ) -> io::Result<()> {
        self.send_with(t, direct, |q, tos| self.sendmmsg(q, tos))
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
        // Inside this queue's poll without a delay, the poll's end sends the queue;
        // otherwise the task does.
        let at_poll_end = self.delay_us.load(Ordering::Relaxed) == 0 && self.gathering_here();
        let mut q = lock(&self.queue);
        if at_poll_end && q.pending().is_empty() && !queue::opens(t) {
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
        if t.contents.len() > QUEUE_BYTES {
            // Larger than the queue (never from `try_send`, whose parts are at most one
            // send): on its own, behind what was queued.
            drop(q);
            return direct(t);
        }
        let first = q.is_empty();
        q.push(t);
        let task_has_it = self.left_to_task.load(Ordering::Acquire);
        if q.is_full() || (at_poll_end && !task_has_it && q.has_closed_message()) {
            // Sent now if the socket takes it; otherwise the task (or the poll's end)
            // sends it later.
            let _ = self.flush_with(&mut q, &mut sendmmsg);
        }
        self.queued.store(q.pending().len(), Ordering::Release);
        if first && !at_poll_end {
            self.leave_to_task(q);
        }
        Ok(())
    }

    /// Sends everything queued; `WouldBlock` when the socket's buffer is full (what
    /// is left stays queued).
    fn flush(&self, q: &mut Queue) -> io::Result<()> {
        self.flush_with(q, |q, tos| self.sendmmsg(q, tos))
    }

    /// One `sendmmsg` of what `q` has pending (`tos`: with the ECN codepoint); how many
    /// messages the kernel took.
    fn sendmmsg(&self, q: &Queue, tos: bool) -> io::Result<usize> {
        udp::sendmmsg(self.fd.get_ref().as_fd(), &q.bytes, q.pending(), tos)
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
        self.emptied();
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

    /// The queue is empty (called under its lock): drivers refused a transmit may
    /// send again, and polls' ends send what comes next (not [left to the
    /// task](Batcher::leave_to_task) any more).
    fn emptied(&self) {
        self.queued.store(0, Ordering::Release);
        self.left_to_task.store(false, Ordering::Release);
        if self.blocked.swap(false, Ordering::AcqRel) {
            self.drained.notify_waiters();
        }
    }

    /// How long the oldest queued transmit may still wait.
    fn due(&self) -> Option<Instant> {
        let since = lock(&self.queue).since()?;
        Some(since + Duration::from_micros(self.delay_us.load(Ordering::Relaxed)))
    }

    /// Sends the queue, waiting (bounded) for the socket to take it.
    async fn flush_when_writable(&self) {
        self.flush_when_writable_with(|q, tos| self.sendmmsg(q, tos))
            .await;
    }

    /// [`Batcher::flush_when_writable`] with the system call given (tests give a
    /// socket that is full for a while). A try that finds the socket full clears
    /// tokio's readiness, so the next wait is for the socket's edge; but the kernel
    /// signals room only once the buffer is half empty, and polls' ends may send
    /// meanwhile, so the task tries again at least every [`WRITABLE_RECHECK`] and
    /// drops the queue only after a try at [`WRITABLE_TIMEOUT`] fails too.
    async fn flush_when_writable_with(&self, mut sendmmsg: impl FnMut(&Queue, bool) -> io::Result<usize>) {
        let deadline = tokio::time::Instant::now() + WRITABLE_TIMEOUT;
        let mut sent = self.flush_with(&mut lock(&self.queue), &mut sendmmsg);
        while sent.is_err() {
            if tokio::time::Instant::now() >= deadline {
                self.drop_queued("the socket stayed full");
                return;
            }
            let recheck = (tokio::time::Instant::now() + WRITABLE_RECHECK).min(deadline);
            sent = match tokio::time::timeout_at(recheck, self.fd.writable()).await {
                Ok(Ok(mut ready)) => {
                    let tried = self.flush_with(&mut lock(&self.queue), &mut sendmmsg);
                    if tried.is_err() {
                        ready.clear_ready();
                    }
                    tried
                }
                Ok(Err(_)) => {
                    self.drop_queued("the socket failed");
                    return;
                }
                Err(_no_edge) => self.flush_with(&mut lock(&self.queue), &mut sendmmsg),
            };
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
        self.emptied();
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
        "QUIC transmits refused because the send queue and the socket buffer were full (quinn retries them).",
    )
    .sample(&[], REFUSED.load(Ordering::Relaxed));
    out.family(
        "webship_quic_send_batch_dropped",
        Kind::Counter,
        "Queued UDP messages dropped: refused by the kernel, still queued after the socket stayed full for a second, or queued when the socket closed.",
    )
    .sample(&[], DROPPED.load(Ordering::Relaxed));
}

#[cfg(test)]
mod tests;
