//! How fast an HTTP/1.1 client takes a response ([`DrainRate`]), from what leaves its
//! socket: the size of the next file read (`ResponseBody::sized_by_writer`).
//! HTTP/1.1 has no flow control to read, but the socket shows it: bytes written to it
//! and still unsent wait for the client. When none wait (the response's first read
//! too), the client takes what comes, and the read is what the socket takes.
//!
//! One write says little: a fast client that is slower than the server keeps the
//! socket full, and right after it drained, several writes go in while nothing
//! leaves; a slow client looks the same while the socket buffers fill. So a read is
//! the larger of two sizes: twice what left while the last chunk was written (slow
//! start; a slow client's reads fall back as soon as its receive window is full),
//! and [`HORIZON`] worth of the client's rate over the last window of at least
//! [`WINDOW`] (a client taking 100 MiB/s keeps 200 KiB reads through the writes that
//! see nothing leave; one taking 4 KiB/s gets the smallest). Neither is more than
//! the socket takes now (`sys::tcp_send_room`): a fast client that stops reading
//! leaves the server waiting with the smallest read, not the largest.

use std::time::{Duration, Instant};

/// The shortest span a rate is measured over: longer than a fast client's cycle of
/// reading a burst and decrypting it (a few ms for 4 MiB).
const WINDOW: Duration = Duration::from_millis(10);
/// A read holds this long of what the client takes at its measured rate.
const HORIZON: Duration = Duration::from_millis(2);

/// A write smaller than this (a chunk-size line, a part's headers) says nothing about
/// the client: the size it reported last stands.
const SMALL_WRITE: u64 = 16 * 1024;

#[derive(Debug, Default)]
pub(super) struct DrainRate {
    /// Bytes written since the last estimate.
    written: u64,
    /// What the socket had not sent at the last estimate.
    unsent: u64,
    /// Bytes that left for the client since the window began.
    left: u64,
    began: Option<Instant>,
    /// [`HORIZON`] worth of the rate measured over the last window.
    at_rate: u64,
    /// The last estimate, before the socket's room bounded it.
    last: Option<u64>,
}

impl DrainRate {
    /// `bytes` went to the connection (rustls or the socket).
    pub(super) fn wrote(&mut self, bytes: usize) {
        self.written += bytes as u64;
    }

    /// The socket holds `unsent` bytes now and takes `room` more without blocking:
    /// the next read's size.
    pub(super) fn next_read(&mut self, unsent: u64, room: u64, now: Instant) -> u64 {
        let estimate = match self.last {
            Some(last) if self.written < SMALL_WRITE => last,
            _ => {
                let fresh = self.estimate(unsent, now);
                self.last = Some(fresh);
                fresh
            }
        };
        // Nothing waits in the socket: the client takes what comes as fast as it is
        // written (or nothing was written yet), so the read is what the socket takes.
        let estimate = if unsent == 0 { u64::MAX } else { estimate };
        // The rate only changes once a write has finished: a client that read fast
        // and stopped would leave the next large read blocked in its write (for up to
        // `send_timeout`). A read the socket takes whole is written at once and
        // dropped; once the socket is full, the next one is the smallest.
        estimate.min(room)
    }

    fn estimate(&mut self, unsent: u64, now: Instant) -> u64 {
        // What was written or waiting at the last estimate and is not waiting now
        // left (bytes rustls holds count as gone; the driver bounds them to a chunk).
        let left = (std::mem::take(&mut self.written) + self.unsent).saturating_sub(unsent);
        self.unsent = unsent;
        self.left += left;
        let began = *self.began.get_or_insert(now);
        let span = now.saturating_duration_since(began);
        if span >= WINDOW {
            let at_rate = u128::from(self.left) * HORIZON.as_nanos() / span.as_nanos();
            self.at_rate = u64::try_from(at_rate).unwrap_or(u64::MAX);
            self.left = 0;
            self.began = Some(now);
        }
        left.saturating_mul(2).max(self.at_rate)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB: u64 = 1024;
    const MIB: u64 = 1024 * KIB;

    /// One asked read size: what the estimate said (KiB, before the body clamps it) and
    /// whether the clamped read was larger than the socket's room (its write waits
    /// with the chunk in hand until the client reads again).
    #[derive(Debug, Clone, Copy)]
    struct Read {
        kib: u64,
        waits: bool,
    }

    /// A socket that holds `socket` bytes, to a client that has drained `drained(t)`
    /// bytes by `t` (its receive window included), and a server that writes one read
    /// (16 to 256 KiB, as the body clamps it) every `every` at most: it asks for the
    /// next read's size once the last one is in the socket. A write the socket cannot
    /// take whole waits, like the kernel's, until a third of the socket is free.
    fn run(every: Duration, steps: u32, socket: u64, drained: impl Fn(Duration) -> u64) -> Vec<Read> {
        let mut drain = DrainRate::default();
        let start = Instant::now();
        let (mut total, mut waiting) = (0, 0);
        let mut reads = Vec::new();
        for i in 1..=steps {
            let at = every * i;
            let unsent = total - drained(at).min(total);
            let room = socket.saturating_sub(unsent);
            if waiting > 0 {
                if room >= socket / 3 {
                    let took = waiting.min(room);
                    (total, waiting) = (total + took, waiting - took);
                }
                continue;
            }
            let asked = drain.next_read(unsent, room, start + at);
            let read = asked.clamp(16 * KIB, 256 * KIB);
            drain.wrote(read as usize);
            let took = read.min(room);
            (total, waiting) = (total + took, read - took);
            reads.push(Read {
                kib: asked.min(u64::MAX / 2) / KIB,
                waits: read > room,
            });
        }
        reads
    }

    /// Whether every read that waits in its write is the smallest.
    fn only_small_reads_wait(reads: &[Read]) -> bool {
        reads.iter().all(|r| !r.waits || r.kib <= 16)
    }

    #[test]
    fn a_slow_client_gets_small_reads_once_a_window_shows_it() {
        // Its receive window takes the first 96 KiB, then it reads 4 KiB/s.
        let reads = run(Duration::from_millis(1), 60, 4 * MIB, |t| {
            96 * KIB + (4096.0 * t.as_secs_f64()) as u64
        });
        assert!(reads[0].kib >= 256, "nothing waits yet: a full read: {reads:?}");
        assert!(
            reads[20..].iter().all(|r| r.kib < 16),
            "a window at 4 KiB/s: {reads:?}"
        );
        assert!(only_small_reads_wait(&reads), "{reads:?}");
    }

    #[test]
    fn a_full_socket_gets_the_smallest_read() {
        // A 512 KiB socket to a client that took 96 KiB, then 4 KiB/s: the server
        // fills the socket, and every read that then waits is the smallest.
        let reads = run(Duration::from_millis(1), 80, 512 * KIB, |t| {
            96 * KIB + (4096.0 * t.as_secs_f64()) as u64
        });
        assert!(
            reads.iter().any(|r| r.waits),
            "the socket never filled: {reads:?}"
        );
        assert!(only_small_reads_wait(&reads), "{reads:?}");
    }

    #[test]
    fn a_fast_client_slower_than_the_server_keeps_large_reads() {
        // The server could write 1 GiB/s; the client drains 2 MiB every 4 ms (512
        // MiB/s), so most reports see nothing leave the socket.
        let reads = run(Duration::from_micros(250), 400, 4 * MIB, |t| {
            (t.as_micros() / 4000) as u64 * 2 * MIB
        });
        assert_mostly_large(&reads[20..]);
        assert!(only_small_reads_wait(&reads), "{reads:?}");
    }

    /// Four in five bytes come in the largest reads (the others fill what is left of
    /// the socket before a write waits).
    fn assert_mostly_large(reads: &[Read]) {
        let bytes = |r: &Read| r.kib.clamp(16, 256);
        let all: u64 = reads.iter().map(bytes).sum();
        let large: u64 = reads.iter().filter(|r| r.kib >= 256).map(bytes).sum();
        assert!(
            large * 5 >= all * 4,
            "{large} of {all} KiB in 256 KiB reads: {reads:?}"
        );
    }

    #[test]
    fn a_fast_client_that_stops_leaves_only_the_smallest_read_waiting() {
        // 512 MiB/s for 200 ms (reads grown to their largest), then nothing: the
        // socket fills, and the read in hand when it is full is the smallest, not the
        // 256 KiB the rate asks for.
        let stop = Duration::from_millis(200);
        let reads = run(Duration::from_micros(250), 1600, 4 * MIB, |t| {
            (t.min(stop).as_micros() / 4000) as u64 * 2 * MIB
        });
        let stopped = reads.len() - 1;
        assert_mostly_large(&reads[20..stopped]);
        assert!(reads[stopped].waits, "the last read did not wait: {reads:?}");
        assert!(only_small_reads_wait(&reads), "{reads:?}");
    }

    #[test]
    fn a_small_write_keeps_the_read_size() {
        let start = Instant::now();
        let mut drain = DrainRate::default();
        assert_eq!(
            drain.next_read(0, 3 * MIB, start),
            3 * MIB,
            "nothing waits: what the socket takes"
        );
        drain.wrote(256 * 1024);
        // 64 KiB of the 256 KiB left (the rest waits): reads of twice that.
        let at = start + Duration::from_millis(1);
        assert_eq!(drain.next_read(192 * KIB, 3 * MIB, at), 128 * KIB);
        // A part's headers or a chunk-size line leave nothing to measure.
        drain.wrote(100);
        assert_eq!(drain.next_read(192 * KIB, 3 * MIB, at), 128 * KIB);
        // The room bounds every size.
        assert_eq!(drain.next_read(192 * KIB, 20 * KIB, at), 20 * KIB);
    }
}
