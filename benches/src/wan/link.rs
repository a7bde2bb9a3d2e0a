//! The link emulator: one thread per direction moves IP packets from one TUN
//! device to the other through a model of a WAN link (netem is not in this kernel).
//!
//! Per direction, in this order: random loss (seeded, so a run can be repeated),
//! then a FIFO of bounded size drained at the link rate (a token bucket one
//! packet deep: each packet leaves when the previous one has been serialized;
//! a packet that would overflow the queue is dropped at its tail), then the
//! one-way delay plus a uniform jitter. Delivery times never decrease, so jitter
//! does not reorder packets, and the in-flight packets need only a FIFO, no heap.
//!
//! Each thread sleeps in `poll` until its input is readable or its oldest packet
//! is due (no spinning), then reads every packet waiting (a batch) and writes
//! every packet due. Buffers are recycled, and packets in flight are capped
//! ([`MAX_IN_FLIGHT`]), so memory is bounded whatever the peers send.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags, Timespec};

/// Packets one direction holds at once (queued and in the delay line): above the
/// bandwidth-delay product of every cell (1 Gbit/s × 41 ms ≈ 3,500 packets of 1500
/// bytes) plus the largest queue, whatever size the senders' packets are (at
/// `--mtu 9000` Caddy's still carry 1452 bytes). Times the buffers' size
/// ([`buffer_len`]), it bounds memory: 32 MiB at the default MTU, 149 MiB at 9000.
const MAX_IN_FLIGHT: usize = 16_384;

/// A packet buffer for a TUN device of `mtu`: larger than the MTU, so no packet is
/// ever truncated (2048 bytes up to 1536).
fn buffer_len(mtu: u32) -> usize {
    (mtu as usize + 512).max(2048)
}
/// Packets read per wake-up before due packets are written again.
const READ_BATCH: usize = 64;
/// The longest a thread sleeps before looking at its stop flag.
const STOP_CHECK: Duration = Duration::from_millis(50);

/// One direction's link: what a packet meets between the two namespaces.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Shape {
    /// Bits per second; 0: no rate limit (the relay's own capacity).
    pub rate_bps: u64,
    /// One-way delay.
    pub delay: Duration,
    /// Each packet's delay gets a uniform extra in [0, jitter].
    pub jitter: Duration,
    /// Probability that a packet is dropped, 0 to 1.
    pub loss: f64,
    /// Bytes the queue in front of the rate limiter holds; more is tail-dropped.
    pub queue_bytes: u64,
    pub seed: u64,
}

/// What happened to the packets of one direction.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Counts {
    pub packets: u64,
    pub delivered: u64,
    /// Dropped by the random loss.
    pub lost: u64,
    /// Tail-dropped: the queue was full.
    pub overflow: u64,
    /// Dropped because [`MAX_IN_FLIGHT`] packets were already held.
    pub over_cap: u64,
    /// The longest queue seen, in bytes.
    pub max_queue_bytes: u64,
}

/// SplitMix64: a small seeded generator, good enough for loss and jitter draws.
#[derive(Debug)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The fate of one packet offered to the link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    Lost,
    Overflow,
    /// Delivered at this instant.
    Deliver(Instant),
}

/// One direction's state: the pure model, no I/O (unit-tested below).
#[derive(Debug)]
pub(crate) struct Model {
    shape: Shape,
    rng: Rng,
    /// When the rate limiter finishes the last packet it accepted.
    busy_until: Instant,
    /// The last delivery time handed out (deliveries never go back in time).
    last_delivery: Instant,
    pub counts: Counts,
}

impl Model {
    pub(crate) fn new(shape: Shape, now: Instant) -> Self {
        Self {
            shape,
            rng: Rng(shape.seed),
            busy_until: now,
            last_delivery: now,
            counts: Counts::default(),
        }
    }

    /// A packet of `len` bytes arrives at `now`.
    pub(crate) fn offer(&mut self, now: Instant, len: usize) -> Verdict {
        self.counts.packets += 1;
        if self.shape.loss > 0.0 && self.rng.unit() < self.shape.loss {
            self.counts.lost += 1;
            return Verdict::Lost;
        }
        let start = self.busy_until.max(now);
        let sent = if self.shape.rate_bps == 0 {
            start
        } else {
            // Bytes still waiting in front of this packet: the limiter's backlog.
            let backlog = (start - now).as_nanos() * u128::from(self.shape.rate_bps) / 8_000_000_000;
            let backlog = u64::try_from(backlog).unwrap_or(u64::MAX);
            if backlog + len as u64 > self.shape.queue_bytes {
                self.counts.overflow += 1;
                return Verdict::Overflow;
            }
            self.counts.max_queue_bytes = self.counts.max_queue_bytes.max(backlog + len as u64);
            let nanos = len as u128 * 8_000_000_000 / u128::from(self.shape.rate_bps);
            start + Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
        };
        self.busy_until = sent;
        let jitter = if self.shape.jitter.is_zero() {
            Duration::ZERO
        } else {
            self.shape.jitter.mul_f64(self.rng.unit())
        };
        let at = (sent + self.shape.delay + jitter).max(self.last_delivery);
        self.last_delivery = at;
        Verdict::Deliver(at)
    }
}

/// Both directions running: `a → b` with `ab`, `b → a` with `ba`. Stopped and
/// joined when dropped (or by [`Relay::stop`], which also returns the counts).
#[derive(Debug)]
pub(crate) struct Relay {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<io::Result<Counts>>>,
}

impl Relay {
    /// `mtu`: the TUN devices' MTU, which sizes the packet buffers.
    pub(crate) fn start(a: &File, b: &File, ab: Shape, ba: Shape, mtu: u32) -> io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::with_capacity(2);
        for (from, to, shape, name) in [(a, b, ab, "wan a→b"), (b, a, ba, "wan b→a")] {
            let (from, to, stop) = (from.try_clone()?, to.try_clone()?, stop.clone());
            threads.push(
                std::thread::Builder::new()
                    .name(name.to_owned())
                    .spawn(move || forward(&from, &to, shape, mtu, &stop))?,
            );
        }
        Ok(Self { stop, threads })
    }

    /// Stops both directions; their counts (`a → b`, `b → a`).
    pub(crate) fn stop(mut self) -> io::Result<(Counts, Counts)> {
        let mut joined = self.join().into_iter();
        let missing = || Err(io::Error::other("a relay thread was not running"));
        let ab = joined.next().unwrap_or_else(missing)?;
        let ba = joined.next().unwrap_or_else(missing)?;
        Ok((ab, ba))
    }

    fn join(&mut self) -> Vec<io::Result<Counts>> {
        self.stop.store(true, Ordering::Relaxed);
        self.threads
            .drain(..)
            .map(|t| {
                t.join()
                    .unwrap_or_else(|_| Err(io::Error::other("a relay thread panicked")))
            })
            .collect()
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        let _ = self.join();
    }
}

/// A packet in flight.
struct Held {
    at: Instant,
    len: usize,
    buf: Box<[u8]>,
}

/// One direction's loop until `stop`: read, shape, hold, write when due.
fn forward(from: &File, to: &File, shape: Shape, mtu: u32, stop: &AtomicBool) -> io::Result<Counts> {
    let mut model = Model::new(shape, Instant::now());
    let mut held: VecDeque<Held> = VecDeque::new();
    let buf_len = buffer_len(mtu);
    // Buffers of delivered or dropped packets, reused (at most MAX_IN_FLIGHT + 1 exist).
    let mut spare: Vec<Box<[u8]>> = Vec::new();
    let (mut from_r, mut to_w) = (from, to);
    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        while held.front().is_some_and(|p| p.at <= now) {
            let Some(p) = held.pop_front() else { break };
            // The TUN device takes whole packets; an error (the namespace went
            // away) only loses this packet, as a wire would.
            if to_w.write(&p.buf[..p.len]).is_ok() {
                model.counts.delivered += 1;
            }
            spare.push(p.buf);
        }
        let wait = held.front().map_or(STOP_CHECK, |p| {
            p.at.saturating_duration_since(now).min(STOP_CHECK)
        });
        // `wait` is at most STOP_CHECK, so it always fits.
        let timeout = Timespec::try_from(wait).unwrap_or(Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        });
        let mut fds = [PollFd::new(from, PollFlags::IN)];
        match poll(&mut fds, Some(&timeout)) {
            Ok(0) => continue,
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
        for _ in 0..READ_BATCH {
            let mut buf = spare
                .pop()
                .unwrap_or_else(|| vec![0u8; buf_len].into_boxed_slice());
            let len = match from_r.read(&mut buf) {
                Ok(len) => len,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    spare.push(buf);
                    break;
                }
                Err(e) => return Err(e),
            };
            if held.len() >= MAX_IN_FLIGHT {
                model.counts.packets += 1;
                model.counts.over_cap += 1;
                spare.push(buf);
                continue;
            }
            match model.offer(Instant::now(), len) {
                Verdict::Deliver(at) => held.push_back(Held { at, len, buf }),
                Verdict::Lost | Verdict::Overflow => spare.push(buf),
            }
        }
    }
    Ok(model.counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The default MTU keeps the buffers of before: 2048 bytes, 32 MiB at the cap.
    #[test]
    fn buffers_fit_the_mtu() {
        assert_eq!(buffer_len(1500), 2048);
        assert_eq!(buffer_len(1500) * MAX_IN_FLIGHT, 32 << 20);
        assert!(buffer_len(9000) > 9000);
    }

    fn shape(rate_bps: u64, queue_bytes: u64) -> Shape {
        Shape {
            rate_bps,
            delay: Duration::from_millis(10),
            jitter: Duration::ZERO,
            loss: 0.0,
            queue_bytes,
            seed: 7,
        }
    }

    #[test]
    fn rate_spaces_packets_and_delay_is_added() {
        let t0 = Instant::now();
        // 12 Mbit/s: a 1500-byte packet takes 1 ms on the wire.
        let mut m = Model::new(shape(12_000_000, 1 << 20), t0);
        let at: Vec<_> = (0..3)
            .map(|_| match m.offer(t0, 1500) {
                Verdict::Deliver(at) => at - t0,
                v => panic!("dropped: {v:?}"),
            })
            .collect();
        assert_eq!(at, [11, 12, 13].map(Duration::from_millis));
    }

    #[test]
    fn a_full_queue_drops_at_its_tail_and_drains_at_the_rate() {
        let t0 = Instant::now();
        let mut m = Model::new(shape(12_000_000, 4500), t0);
        let verdicts: Vec<_> = (0..5).map(|_| m.offer(t0, 1500)).collect();
        assert!(verdicts[..3].iter().all(|v| matches!(v, Verdict::Deliver(_))));
        assert_eq!(verdicts[3..], [Verdict::Overflow, Verdict::Overflow]);
        assert_eq!((m.counts.overflow, m.counts.max_queue_bytes), (2, 4500));
        // 1 ms later one packet has left: there is room for exactly one more.
        let later = t0 + Duration::from_millis(1);
        assert!(matches!(m.offer(later, 1500), Verdict::Deliver(_)));
        assert_eq!(m.offer(later, 1500), Verdict::Overflow);
    }

    #[test]
    fn loss_follows_the_seed_and_the_probability() {
        let t0 = Instant::now();
        let run = |seed| {
            let mut m = Model::new(
                Shape {
                    loss: 0.01,
                    seed,
                    ..shape(0, 0)
                },
                t0,
            );
            for _ in 0..100_000 {
                let _ = m.offer(t0, 100);
            }
            m.counts.lost
        };
        let lost = run(1);
        assert_eq!(lost, run(1), "the same seed loses the same packets");
        assert!((800..1200).contains(&lost), "1 % of 100,000 packets, got {lost}");
        assert_ne!(lost, run(2));
    }

    #[test]
    fn jitter_never_reorders() {
        let t0 = Instant::now();
        let jittery = Shape {
            jitter: Duration::from_millis(5),
            ..shape(1_000_000_000, 1 << 20)
        };
        let mut m = Model::new(jittery, t0);
        let mut last = t0;
        let mut spread = Duration::ZERO;
        for i in 0..1000u32 {
            let now = t0 + Duration::from_micros(u64::from(i) * 20);
            let Verdict::Deliver(at) = m.offer(now, 1500) else {
                panic!("dropped")
            };
            assert!(at >= last, "packet {i} delivered before its predecessor");
            spread = spread.max(at - now);
            last = at;
        }
        assert!(
            spread > Duration::from_millis(13),
            "jitter was applied: {spread:?}"
        );
    }
}
