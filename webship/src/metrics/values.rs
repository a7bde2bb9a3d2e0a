//! A histogram of plain values (bytes, datagrams, microseconds) over bounds its
//! owner picks, for subsystem figures taken once per connection or per write: QUIC's
//! RTT and congestion window when a connection ends, the size of an HTTP/2 write
//! batch. Lock-free and `const`-constructible, so a subsystem keeps it in a
//! `static`: an observation is a search over the bounds and two relaxed atomic
//! additions; the count is the sum of the buckets, added up at scrape time.

use std::sync::atomic::{AtomicU64, Ordering};

use super::Encoder;

/// Bounds a histogram may have (its `+Inf` bucket comes on top).
const MAX_BOUNDS: usize = 24;

#[derive(Debug)]
pub(crate) struct Values {
    /// Upper bounds, ascending, in the unit observations come in.
    bounds: &'static [u64],
    /// What a bound and the sum are divided by when written (1e6: microseconds
    /// written as seconds).
    divisor: f64,
    /// One per bound, then what is above every bound.
    buckets: [AtomicU64; MAX_BOUNDS + 1],
    sum: AtomicU64,
}

impl Values {
    /// `bounds` ascending, at most 24 (checked when the `static` is built).
    pub(crate) const fn new(bounds: &'static [u64], divisor: f64) -> Self {
        assert!(bounds.len() <= MAX_BOUNDS, "too many histogram bounds");
        Self {
            bounds,
            divisor,
            buckets: [const { AtomicU64::new(0) }; MAX_BOUNDS + 1],
            sum: AtomicU64::new(0),
        }
    }

    pub(crate) fn observe(&self, value: u64) {
        let i = self.bounds.partition_point(|&b| b < value);
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum.fetch_add(value, Ordering::Relaxed);
    }

    /// Observations so far.
    #[cfg(test)]
    pub(crate) fn count(&self) -> u64 {
        self.buckets.iter().map(|b| b.load(Ordering::Relaxed)).sum()
    }

    /// Writes the histogram as one series of the current family (a
    /// [`super::Kind::Histogram`] family) with `labels`.
    pub(crate) fn write(&self, out: &mut Encoder, labels: &[(&str, &str)]) {
        let n = self.bounds.len();
        let mut cumulative = [0u64; MAX_BOUNDS];
        let mut total = 0;
        for (i, bucket) in self.buckets[..=n].iter().enumerate() {
            total += bucket.load(Ordering::Relaxed);
            if let Some(c) = cumulative[..n].get_mut(i) {
                *c = total;
            }
        }
        let divisor = self.divisor;
        let buckets = self
            .bounds
            .iter()
            .zip(cumulative)
            .map(move |(&b, c)| (b as f64 / divisor, c));
        let sum = self.sum.load(Ordering::Relaxed) as f64 / divisor;
        out.histogram(labels, buckets, sum, total);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{Format, Kind};

    static RTT: Values = Values::new(&[100, 1_000, 10_000], 1e6);

    #[test]
    fn values_land_in_their_bucket_and_are_written_scaled() {
        RTT.observe(50);
        RTT.observe(1_000);
        RTT.observe(2_000_000);
        assert_eq!(RTT.count(), 3);
        let mut out = Encoder::new(Format::Prometheus);
        out.family("webship_t_seconds", Kind::Histogram, "T.");
        RTT.write(&mut out, &[]);
        let text = out.finish();
        for line in [
            "webship_t_seconds_bucket{le=\"0.0001\"} 1\n",
            "webship_t_seconds_bucket{le=\"0.001\"} 2\n",
            "webship_t_seconds_bucket{le=\"0.01\"} 2\n",
            "webship_t_seconds_bucket{le=\"+Inf\"} 3\n",
            "webship_t_seconds_sum 2.00105\n",
            "webship_t_seconds_count 3\n",
        ] {
            assert!(text.contains(line), "{line:?} missing from\n{text}");
        }
    }
}
