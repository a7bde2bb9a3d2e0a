//! TCP health per site, as the `webship_tcp` sock_ops program counts it: the
//! snapshot the `/metrics` exporter and `webship stats` render, the slot table that
//! gives each site name its counters, and finding the cgroup the program attaches to.
//!
//! Slots are keyed by site *name*, not by a generation's site index: a reload that
//! keeps a site keeps its slot (its counters carry on), a new name gets the next free
//! slot, and a removed site keeps its counters until the daemon exits (counters only
//! grow, as Prometheus expects). The names are written into a pinned map so that
//! `webship stats`, another process, can label the slots. A binary upgrade starts
//! from zero (the successor loads its own maps), which a Prometheus `rate()` reads as
//! a counter reset.

// The loader (Linux, feature `ebpf`) is what fills these; a build without it keeps
// the types for the exporter and `webship stats` (which then report nothing).
#![cfg_attr(not(all(target_os = "linux", feature = "ebpf")), allow(dead_code))]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use webship_ebpf_common::{TcpSite, MAX_TCP_SITES, RATE_BUCKETS, RTT_BUCKETS};

/// Every site's TCP health, summed over CPUs: what a metrics exporter renders.
///
/// Its Prometheus families (all labelled `{site="<name>"}`; written by
/// `server::collect::TcpHealth`, documented in docs/metrics.md):
/// - `webship_tcp_retransmits_total`: segments retransmitted to the site's clients;
/// - `webship_tcp_rto_total`: retransmission timeouts (a stalled path, tail latency);
/// - `webship_tcp_connections_closed_total` and `webship_tcp_connections_reset_total`
///   (closed without the FIN handshake: a reset sent or received, or a timeout);
/// - `webship_tcp_acked_bytes_total`, `webship_tcp_received_bytes_total`: bytes of
///   closed connections;
/// - `webship_tcp_rtt_seconds` (histogram of the smoothed RTT at close, one sample
///   per closed connection; `le` bounds from [`Histogram::upper_bound`] in µs / 1e6);
/// - `webship_tcp_delivery_rate_bytes` (histogram of the last delivery-rate sample at
///   close, bytes per second; connections that never sent a sample are not in it).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct TcpSnapshot {
    pub sites: Vec<SiteTcp>,
}

impl TcpSnapshot {
    pub fn site(&self, name: &str) -> Option<&SiteTcp> {
        self.sites.iter().find(|s| s.site == name)
    }
}

/// One site's counters and histograms.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SiteTcp {
    pub site: String,
    pub retransmits: u64,
    pub rto: u64,
    pub closed: u64,
    pub reset: u64,
    pub bytes_acked: u64,
    pub bytes_received: u64,
    /// Smoothed RTT at close, microseconds.
    pub rtt_us: Histogram,
    /// Last delivery rate at close, bytes per second.
    pub delivery_rate: Histogram,
}

impl SiteTcp {
    /// `raw` summed over CPUs, under `site`.
    pub(crate) fn from_raw(site: &str, raw: &TcpSite) -> Self {
        Self {
            site: site.to_owned(),
            retransmits: raw.retransmits,
            rto: raw.rto,
            closed: raw.closed,
            reset: raw.reset,
            bytes_acked: raw.bytes_acked,
            bytes_received: raw.bytes_received,
            rtt_us: Histogram {
                buckets: raw.rtt.to_vec(),
                count: raw.rtt.iter().sum(),
                sum: raw.rtt_sum_us,
            },
            delivery_rate: Histogram {
                buckets: raw.rate.to_vec(),
                count: raw.rate_samples,
                sum: raw.rate_sum,
            },
        }
    }
}

/// A log2 histogram: `buckets[i]` counts values `v` with `2^i <= v < 2^(i+1)`
/// (bucket 0 also takes 0, the last one everything above).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Histogram {
    pub buckets: Vec<u64>,
    pub count: u64,
    pub sum: u64,
}

impl Histogram {
    /// The exclusive upper bound of bucket `i` (`None`: the last, unbounded one).
    pub fn upper_bound(&self, i: usize) -> Option<u64> {
        (i + 1 < self.buckets.len()).then(|| 1u64 << (i + 1).min(63))
    }

    /// An upper bound on the `q` quantile (0 < q <= 1): the bound of the first bucket
    /// whose cumulative count reaches `q` of the total; for the last bucket, its lower
    /// bound. `None` without samples.
    pub fn quantile(&self, q: f64) -> Option<u64> {
        let total: u64 = self.buckets.iter().sum();
        if total == 0 {
            return None;
        }
        // At least one sample, at most all of them.
        let rank = ((q.clamp(0.0, 1.0) * total as f64).ceil() as u64).clamp(1, total);
        let mut seen = 0u64;
        for (i, n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return Some(self.upper_bound(i).unwrap_or(1u64 << i.min(63)));
            }
        }
        None
    }
}

/// Sums per-CPU values of one slot.
pub(crate) fn sum_cpus<'a>(values: impl IntoIterator<Item = &'a TcpSite>) -> TcpSite {
    let mut out = TcpSite::ZERO;
    for v in values {
        out.retransmits = out.retransmits.wrapping_add(v.retransmits);
        out.rto = out.rto.wrapping_add(v.rto);
        out.closed = out.closed.wrapping_add(v.closed);
        out.reset = out.reset.wrapping_add(v.reset);
        out.bytes_acked = out.bytes_acked.wrapping_add(v.bytes_acked);
        out.bytes_received = out.bytes_received.wrapping_add(v.bytes_received);
        out.rtt_sum_us = out.rtt_sum_us.wrapping_add(v.rtt_sum_us);
        out.rate_sum = out.rate_sum.wrapping_add(v.rate_sum);
        out.rate_samples = out.rate_samples.wrapping_add(v.rate_samples);
        for (o, x) in out.rtt.iter_mut().zip(v.rtt) {
            *o = o.wrapping_add(x);
        }
        for (o, x) in out.rate.iter_mut().zip(v.rate) {
            *o = o.wrapping_add(x);
        }
    }
    out
}

const _: () = assert!(RTT_BUCKETS < 64 && RATE_BUCKETS < 64);

/// Site name → slot, for the daemon's life (bounded by [`MAX_TCP_SITES`]).
#[derive(Debug, Default)]
pub(crate) struct Slots {
    by_name: HashMap<String, u32>,
}

/// What [`Slots::slot`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Slot {
    /// Already had one.
    Known(u32),
    /// Newly given: its name must be written to the names map.
    New(u32),
    /// Every slot is taken: the site is not counted.
    Full,
}

impl Slots {
    pub(crate) fn slot(&mut self, name: &str) -> Slot {
        if let Some(&s) = self.by_name.get(name) {
            return Slot::Known(s);
        }
        let next = self.by_name.len() as u32;
        if next >= MAX_TCP_SITES {
            return Slot::Full;
        }
        self.by_name.insert(name.to_owned(), next);
        Slot::New(next)
    }
}

/// The cgroup v2 folder of this process: its `0::` line in `/proc/self/cgroup`
/// under the first cgroup2 mount in `/proc/self/mountinfo` (on a hybrid hierarchy,
/// /sys/fs/cgroup/unified). `None` when there is no cgroup v2.
pub(crate) fn cgroup2_dir(proc_cgroup: &str, mountinfo: &str) -> Option<PathBuf> {
    let path = proc_cgroup.lines().find_map(|l| l.strip_prefix("0::"))?.trim();
    let mount = mountinfo.lines().find_map(|line| {
        // `ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTS [OPTIONAL...] - FSTYPE SOURCE SUPER`
        let (left, right) = line.split_once(" - ")?;
        (right.split_whitespace().next()? == "cgroup2").then_some(())?;
        let mut fields = left.split_whitespace();
        let root = fields.nth(3)?;
        let point = fields.next()?;
        Some((root.to_owned(), point.to_owned()))
    })?;
    let (root, point) = mount;
    // A mount of a sub-tree (in a cgroup namespace the root is "/"): strip it.
    let relative = Path::new(path).strip_prefix(&root).ok()?;
    Some(Path::new(&unescape(&point)).join(relative))
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape(field: &str) -> String {
    let mut out = String::with_capacity(field.len());
    let mut rest = field;
    while let Some(i) = rest.find('\\') {
        out.push_str(&rest[..i]);
        let code = rest.get(i + 1..i + 4).and_then(|o| u8::from_str_radix(o, 8).ok());
        match code {
            Some(c) => {
                out.push(char::from(c));
                rest = &rest[i + 4..];
            }
            None => {
                out.push('\\');
                rest = &rest[i + 1..];
            }
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use webship_ebpf_common::{bucket, log2};

    #[test]
    fn log2_buckets_match_their_bounds() {
        assert_eq!(log2(0), 0);
        assert_eq!(log2(1), 0);
        assert_eq!(log2(2), 1);
        assert_eq!(log2(3), 1);
        assert_eq!(log2(1 << 40), 40);
        assert_eq!(log2(u64::MAX), 63);
        for v in [1u64, 5, 17, 1000, 123_456_789] {
            let b = bucket(v, RTT_BUCKETS);
            let h = Histogram {
                buckets: vec![0; RTT_BUCKETS],
                ..Histogram::default()
            };
            assert!(v < h.upper_bound(b).unwrap(), "{v} in bucket {b}");
            assert!(v >= 1 << b, "{v} in bucket {b}");
        }
        assert_eq!(bucket(u64::MAX, RTT_BUCKETS), RTT_BUCKETS - 1);
    }

    #[test]
    fn quantiles_are_bucket_upper_bounds() {
        let mut buckets = vec![0u64; 8];
        buckets[3] = 90; // 8..16
        buckets[5] = 9; // 32..64
        buckets[7] = 1; // 128.. (last)
        let h = Histogram {
            buckets,
            count: 100,
            sum: 0,
        };
        assert_eq!(h.quantile(0.5), Some(16));
        assert_eq!(h.quantile(0.9), Some(16));
        assert_eq!(h.quantile(0.95), Some(64));
        assert_eq!(h.quantile(0.99), Some(64));
        assert_eq!(
            h.quantile(1.0),
            Some(128),
            "the last bucket reports its lower bound"
        );
        assert_eq!(Histogram::default().quantile(0.5), None);
    }

    #[test]
    fn per_cpu_values_sum() {
        let mut a = TcpSite::ZERO;
        a.retransmits = 3;
        a.rtt[2] = 1;
        let mut b = TcpSite::ZERO;
        b.retransmits = 4;
        b.rtt[2] = 2;
        b.rate_samples = 1;
        b.rate[30] = 1;
        let s = SiteTcp::from_raw("a.test", &sum_cpus([&a, &b]));
        assert_eq!(s.retransmits, 7);
        assert_eq!(s.rtt_us.count, 3);
        assert_eq!(s.delivery_rate.count, 1);
        assert_eq!(s.delivery_rate.buckets[30], 1);
    }

    #[test]
    fn slots_are_kept_by_name_and_capped() {
        let mut slots = Slots::default();
        assert_eq!(slots.slot("a.test"), Slot::New(0));
        assert_eq!(slots.slot("b.test"), Slot::New(1));
        assert_eq!(slots.slot("a.test"), Slot::Known(0), "a reload keeps the slot");
        for i in 2..MAX_TCP_SITES {
            assert_eq!(slots.slot(&format!("s{i}.test")), Slot::New(i));
        }
        assert_eq!(slots.slot("one-too-many.test"), Slot::Full);
        assert_eq!(slots.slot("b.test"), Slot::Known(1));
    }

    #[test]
    fn cgroup_v2_folder_on_unified_and_hybrid_hierarchies() {
        let unified = "29 23 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw\n";
        assert_eq!(
            cgroup2_dir("0::/system.slice/webship.service\n", unified),
            Some(PathBuf::from("/sys/fs/cgroup/system.slice/webship.service"))
        );
        let hybrid = "30 25 0:27 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n\
                      35 25 0:32 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n";
        let proc = "4:memory:/x\n0::/\n";
        assert_eq!(
            cgroup2_dir(proc, hybrid),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        assert_eq!(cgroup2_dir("1:name=systemd:/\n", hybrid), None, "no v2 line");
        assert_eq!(cgroup2_dir("0::/\n", "30 25 0:27 / /x rw - tmpfs t rw\n"), None);
        let spaced = "35 25 0:32 / /mnt/cg\\040two rw - cgroup2 cgroup2 rw\n";
        assert_eq!(
            cgroup2_dir("0::/a\n", spaced),
            Some(PathBuf::from("/mnt/cg two/a"))
        );
    }
}
