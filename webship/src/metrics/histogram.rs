//! A duration histogram of fixed buckets, lock-free: an observation is two relaxed
//! atomic additions (its bucket and the sum) and a search over [`BOUNDS`]; the count
//! is the sum of the buckets, added up at scrape time.
//!
//! The buckets span a millisecond to half an hour: a small file's first byte
//! takes well under a millisecond, a bulk transfer of many gigabytes to a slow
//! client minutes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds in seconds, ascending; `+Inf` is implied.
pub(crate) const BOUNDS: [f64; 20] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
    600.0, 1200.0, 1800.0,
];

/// The same bounds in microseconds, what observations are compared with.
const BOUNDS_US: [u64; 20] = {
    let mut us = [0; 20];
    let mut i = 0;
    while i < 20 {
        us[i] = (BOUNDS[i] * 1e6) as u64;
        i += 1;
    }
    us
};

/// Observations per bucket (not cumulative) and their sum in microseconds.
#[derive(Debug, Default)]
pub(crate) struct Histogram {
    /// One per bound, and the last for what is above every bound.
    buckets: [AtomicU64; BOUNDS.len() + 1],
    sum_us: AtomicU64,
}

impl Histogram {
    pub(crate) fn observe(&self, d: Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        let i = BOUNDS_US.partition_point(|&b| b < us);
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
    }

    /// What a scrape writes: cumulative counts per bound, the sum in seconds and
    /// the count. Read bucket by bucket while observations go on, so the sum may
    /// lag the count by an observation or two; each series stays monotonic.
    pub(crate) fn snapshot(&self) -> Snapshot {
        let mut cumulative = [0; BOUNDS.len()];
        let mut total = 0;
        for (i, bucket) in self.buckets.iter().enumerate() {
            total += bucket.load(Ordering::Relaxed);
            if let Some(c) = cumulative.get_mut(i) {
                *c = total;
            }
        }
        Snapshot {
            cumulative,
            sum: self.sum_us.load(Ordering::Relaxed) as f64 / 1e6,
            count: total,
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Snapshot {
    pub(crate) cumulative: [u64; BOUNDS.len()],
    pub(crate) sum: f64,
    pub(crate) count: u64,
}

impl Snapshot {
    pub(crate) fn buckets(&self) -> impl Iterator<Item = (f64, u64)> + '_ {
        BOUNDS.iter().copied().zip(self.cumulative.iter().copied())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observations_land_in_their_bucket_cumulatively() {
        let h = Histogram::default();
        h.observe(Duration::from_micros(500));
        h.observe(Duration::from_millis(1));
        h.observe(Duration::from_secs(90));
        h.observe(Duration::from_secs(7200));
        let s = h.snapshot();
        assert_eq!(s.count, 4);
        assert_eq!(s.cumulative[0], 2, "0.5 ms and exactly 1 ms are ≤ 0.001 s");
        assert_eq!(s.cumulative[14], 2, "≤ 60 s");
        assert_eq!(s.cumulative[15], 3, "90 s is ≤ 120 s");
        assert_eq!(s.cumulative[19], 3, "two hours is only in +Inf");
        assert!((s.sum - (0.0015 + 90.0 + 7200.0)).abs() < 1e-9, "{}", s.sum);
    }
}
