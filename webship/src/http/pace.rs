//! How fast an HTTP/1.1 client takes a response, from what leaves its socket: the
//! size of the next file read (`ResponseBody::paced`). HTTP/1.1 has no flow control
//! to read, but the socket shows it: bytes written to it and still unsent wait for
//! the client.
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

#[derive(Debug, Default)]
pub(super) struct Pace {
    /// Bytes written since the last report.
    written: u64,
    /// What the socket had not sent at the last report.
    unsent: u64,
    /// Bytes that left for the client since the window began.
    left: u64,
    began: Option<Instant>,
    /// [`HORIZON`] worth of the rate measured over the last window.
    at_rate: u64,
}

impl Pace {
    /// `bytes` went to the connection (rustls or the socket).
    pub(super) fn wrote(&mut self, bytes: usize) {
        self.written += bytes as u64;
    }

    /// The socket holds `unsent` bytes now and takes `room` more without blocking:
    /// the next read's size.
    pub(super) fn report(&mut self, unsent: u64, room: u64, now: Instant) -> u64 {
        // What was written or waiting at the last report and is not waiting now left
        // (bytes rustls holds count as gone; the driver bounds them to a chunk).
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
        // The rate only changes once a write has finished: a client that read fast
        // and stopped would leave the next large read blocked in its write (for up to
        // `send_timeout`). A read the socket takes whole is written at once and
        // dropped; once the socket is full, the next one is the smallest.
        left.saturating_mul(2).max(self.at_rate).min(room)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB: u64 = 1024;

    /// Reports every `every`, each after writing the read size reported last (16 to
    /// 256 KiB, as the body clamps it), the client having drained `drained(t)` bytes
    /// by then; the read sizes reported, in KiB.
    fn run(every: Duration, reports: u32, drained: impl Fn(Duration) -> u64) -> Vec<u64> {
        let mut pace = Pace::default();
        let start = Instant::now();
        let (mut read, mut total) = (0, 0);
        (1..=reports)
            .map(|i| {
                let chunk = read.clamp(16 * KIB, 256 * KIB);
                total += chunk;
                pace.wrote(chunk as usize);
                let at = every * i;
                read = pace.report(total.saturating_sub(drained(at)), u64::MAX, start + at);
                read / KIB
            })
            .collect()
    }

    #[test]
    fn a_slow_client_gets_small_reads_once_a_window_shows_it() {
        // Its receive window takes the first 96 KiB, then it reads 4 KiB/s.
        let reads = run(Duration::from_millis(1), 60, |t| {
            96 * KIB + (4096.0 * t.as_secs_f64()) as u64
        });
        assert_eq!(
            reads[..4],
            [32, 64, 96, 0],
            "slow start, then nothing left: {reads:?}"
        );
        assert!(reads.iter().all(|&r| r <= 96), "{reads:?}");
        assert!(
            reads[20..].iter().all(|&r| r < 16),
            "a window at 4 KiB/s: {reads:?}"
        );
    }

    #[test]
    fn a_fast_client_slower_than_the_server_keeps_large_reads() {
        // The server could write 1 GiB/s; the client drains 2 MiB every 4 ms (512
        // MiB/s), so most reports see nothing leave the socket.
        let reads = run(Duration::from_micros(250), 400, |t| {
            (t.as_micros() / 4000) as u64 * 2048 * KIB
        });
        assert!(reads[80..].iter().all(|&r| r >= 256), "{reads:?}");
    }
}
