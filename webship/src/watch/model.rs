//! What the watch shows, computed from two polls: the figures of one poll
//! ([`Poll`]: the metrics text read into totals, per-site figures and merged
//! histograms, and the large transfers in flight), and the [`View`] of the latest
//! poll against the one before (rates per second, latency quantiles over the last
//! interval and since start). No I/O; the terminal, the text and the JSON output
//! all draw the same `View`.
//!
//! Response bytes are counted by the daemon when a response ends, so a long download
//! adds nothing to the metrics while it runs. The bytes shown as sent are therefore
//! the ended responses' bytes plus what the listed transfers have sent so far, and
//! their rate is the change of that sum.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

use super::exposition::Sample;
use crate::control::TransferInfo;

/// Status classes, as the `code` label names them.
const CLASSES: [&str; 6] = ["1xx", "2xx", "3xx", "4xx", "5xx", "other"];

/// A cumulative histogram merged over its series: (upper bound, count) ascending,
/// `+Inf` last.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Buckets(Vec<(f64, f64)>);

/// One site's figures in a poll.
#[derive(Debug, Clone, Default, PartialEq)]
struct SiteFigures {
    requests: f64,
    /// Ended responses' bytes.
    bytes: f64,
    in_flight: f64,
}

/// The figures of one poll.
#[derive(Debug, Clone, Default)]
pub(crate) struct Poll {
    version: String,
    uptime: f64,
    generation: f64,
    requests: f64,
    responses: [f64; CLASSES.len()],
    /// Ended responses' bytes.
    bytes: f64,
    in_flight: f64,
    open: f64,
    accepted: f64,
    closed: f64,
    refused: f64,
    passthrough_up: f64,
    passthrough_down: f64,
    passthrough_connections: f64,
    sites: BTreeMap<String, SiteFigures>,
    ttfb: Buckets,
    ttlb: Buckets,
    transfers: Vec<TransferInfo>,
    unlisted: u64,
}

impl Poll {
    /// Reads the samples of one metrics text and the transfer listing taken with it.
    pub(crate) fn new(samples: &[Sample], transfers: Vec<TransferInfo>, unlisted: u64) -> Self {
        let mut p = Poll {
            transfers,
            unlisted,
            ..Poll::default()
        };
        let mut ttfb = BTreeMap::new();
        let mut ttlb = BTreeMap::new();
        for s in samples {
            let v = if s.value.is_finite() { s.value } else { 0.0 };
            let site = || s.label("site").unwrap_or("-").to_owned();
            match s.name.as_str() {
                "webship_build_info" => p.version = s.label("version").unwrap_or("").to_owned(),
                "webship_uptime_seconds" => p.uptime = v,
                "webship_config_generation" => p.generation = v,
                "webship_http_requests_total" => {
                    p.requests += v;
                    p.sites.entry(site()).or_default().requests += v;
                }
                "webship_http_responses_total" => {
                    let class = s.label("code").and_then(|c| CLASSES.iter().position(|k| *k == c));
                    p.responses[class.unwrap_or(CLASSES.len() - 1)] += v;
                }
                "webship_http_response_body_bytes_total" => {
                    p.bytes += v;
                    p.sites.entry(site()).or_default().bytes += v;
                }
                "webship_http_requests_in_flight" => {
                    p.in_flight += v;
                    p.sites.entry(site()).or_default().in_flight += v;
                }
                "webship_connections_open" => p.open += v,
                "webship_connections_accepted_total" => p.accepted += v,
                "webship_connections_closed_total" => p.closed += v,
                "webship_connections_refused_total" => p.refused += v,
                "webship_passthrough_connections_total" => p.passthrough_connections += v,
                "webship_passthrough_bytes_total" => match s.label("direction") {
                    Some("up") => p.passthrough_up += v,
                    _ => p.passthrough_down += v,
                },
                "webship_http_time_to_first_byte_seconds_bucket" => add_bucket(&mut ttfb, s, v),
                "webship_http_time_to_last_byte_seconds_bucket" => add_bucket(&mut ttlb, s, v),
                _ => {}
            }
        }
        p.ttfb = Buckets::from_map(ttfb);
        p.ttlb = Buckets::from_map(ttlb);
        p
    }

    /// Bytes sent: ended responses' and the listed transfers' so far.
    fn sent(&self) -> f64 {
        self.bytes + self.transfers.iter().map(|t| t.sent as f64).sum::<f64>()
    }

    fn site_sent(&self, site: &str) -> f64 {
        let ended = self.sites.get(site).map_or(0.0, |s| s.bytes);
        ended
            + self
                .transfers
                .iter()
                .filter(|t| t.site == site)
                .map(|t| t.sent as f64)
                .sum::<f64>()
    }
}

/// Histogram buckets by the bit pattern of their bound (every series of a family
/// has the same bounds).
fn add_bucket(map: &mut BTreeMap<u64, (f64, f64)>, s: &Sample, v: f64) {
    let Some(le) = s.label("le").and_then(|le| match le {
        "+Inf" => Some(f64::INFINITY),
        le => le.parse::<f64>().ok().filter(|b| b.is_finite()),
    }) else {
        return;
    };
    // Bounds are non-negative, so their bit patterns sort as the numbers do.
    if le < 0.0 {
        return;
    }
    map.entry(le.to_bits()).or_insert((le, 0.0)).1 += v;
}

impl Buckets {
    fn from_map(map: BTreeMap<u64, (f64, f64)>) -> Self {
        Buckets(map.into_values().collect())
    }

    /// Observations in all.
    fn count(&self) -> f64 {
        self.0.last().map_or(0.0, |&(_, c)| c)
    }

    /// The observations made since `before` (the same bounds, counts subtracted);
    /// `None` when they do not line up or a count went down (a restart).
    fn since(&self, before: &Buckets) -> Option<Buckets> {
        if before.0.is_empty() {
            return Some(self.clone());
        }
        if before.0.len() != self.0.len() {
            return None;
        }
        self.0
            .iter()
            .zip(&before.0)
            .map(|(&(le, now), &(le0, then))| (le == le0 && now >= then).then_some((le, now - then)))
            .collect::<Option<Vec<_>>>()
            .map(Buckets)
    }

    /// The `q` quantile (0 to 1), interpolated within its bucket as Prometheus'
    /// `histogram_quantile` does; `None` without observations. One that falls in
    /// the `+Inf` bucket is the highest finite bound, marked as a lower bound.
    pub(crate) fn quantile(&self, q: f64) -> Option<Estimate> {
        let count = self.count();
        if count <= 0.0 || !(0.0..=1.0).contains(&q) {
            return None;
        }
        let rank = q * count;
        let mut lower = (0.0, 0.0);
        for &(le, cumulative) in &self.0 {
            if cumulative >= rank && cumulative > 0.0 {
                if le.is_infinite() {
                    return Some(Estimate {
                        seconds: lower.0,
                        above: true,
                    });
                }
                let (from, below) = lower;
                let inside = cumulative - below;
                let share = if inside > 0.0 {
                    (rank - below) / inside
                } else {
                    1.0
                };
                return Some(Estimate {
                    seconds: from + (le - from) * share.clamp(0.0, 1.0),
                    above: false,
                });
            }
            lower = (le, cumulative);
        }
        None
    }
}

/// A quantile estimate.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub(crate) struct Estimate {
    pub(crate) seconds: f64,
    /// Beyond the highest bucket: at least `seconds`.
    pub(crate) above: bool,
}

/// p50, p90, p99.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub(crate) struct Quantiles {
    pub(crate) p50: Option<Estimate>,
    pub(crate) p90: Option<Estimate>,
    pub(crate) p99: Option<Estimate>,
}

impl Quantiles {
    fn of(b: &Buckets) -> Option<Self> {
        (b.count() > 0.0).then(|| Quantiles {
            p50: b.quantile(0.5),
            p90: b.quantile(0.9),
            p99: b.quantile(0.99),
        })
    }
}

/// A latency's quantiles over the last interval and since the daemon started.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub(crate) struct Latency {
    pub(crate) interval: Option<Quantiles>,
    pub(crate) since_start: Option<Quantiles>,
}

/// A figure's total and its rate per second over the last interval (`None` on the
/// first poll and after a restart).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub(crate) struct Figure {
    pub(crate) total: f64,
    pub(crate) per_second: Option<f64>,
}

/// The totals.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Totals {
    pub(crate) requests: Figure,
    /// By status class, in [`CLASSES`] order.
    pub(crate) responses: Vec<(String, Figure)>,
    /// Ended responses' bytes and the listed transfers' so far.
    pub(crate) bytes_sent: Figure,
    pub(crate) in_flight: f64,
    pub(crate) connections_open: f64,
    pub(crate) connections_accepted: Figure,
    pub(crate) connections_closed: Figure,
    pub(crate) connections_refused: Figure,
    pub(crate) passthrough_connections: Figure,
    pub(crate) passthrough_bytes_up: Figure,
    pub(crate) passthrough_bytes_down: Figure,
}

/// One row of the sites table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct SiteRow {
    pub(crate) site: String,
    pub(crate) requests: Figure,
    pub(crate) bytes_sent: Figure,
    pub(crate) in_flight: f64,
}

/// One large response in flight.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct TransferRow {
    #[serde(flatten)]
    pub(crate) info: TransferInfo,
    /// Bytes per second over the last interval (since it began, when it is new).
    pub(crate) per_second: Option<f64>,
}

impl TransferRow {
    /// How far it is, 0 to 1.
    pub(crate) fn done(&self) -> f64 {
        if self.info.total == 0 {
            return 1.0;
        }
        (self.info.sent as f64 / self.info.total as f64).clamp(0.0, 1.0)
    }
}

/// Everything one screen, text block or JSON line shows.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct View {
    pub(crate) socket: String,
    pub(crate) interval_seconds: f64,
    /// Why the last poll failed, and for how long the daemon has not answered;
    /// the figures are then the last ones read.
    pub(crate) unreachable: Option<Unreachable>,
    pub(crate) version: String,
    pub(crate) uptime_seconds: f64,
    pub(crate) generation: f64,
    pub(crate) totals: Totals,
    pub(crate) time_to_first_byte: Latency,
    pub(crate) time_to_last_byte: Latency,
    /// By bytes sent per second, then requests per second, then name.
    pub(crate) sites: Vec<SiteRow>,
    /// Largest first.
    pub(crate) transfers: Vec<TransferRow>,
    /// Large responses the daemon's table had no room for (since it started).
    pub(crate) unlisted: u64,
}

/// A daemon that stopped answering.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Unreachable {
    pub(crate) error: String,
    pub(crate) for_seconds: f64,
}

impl View {
    /// The view of `now`, with rates against `before` (taken `elapsed` earlier by
    /// the watch's clock; the daemon's uptime is preferred when it moved).
    pub(crate) fn new(
        socket: &str,
        interval: Duration,
        now: &Poll,
        before: Option<&Poll>,
        elapsed: Duration,
    ) -> Self {
        // A restart (a takeover, a new daemon) resets every counter: no rates.
        let before = before.filter(|b| b.uptime <= now.uptime);
        let seconds = match before {
            Some(b) if now.uptime > b.uptime => now.uptime - b.uptime,
            _ => elapsed.as_secs_f64(),
        };
        let rates = before.filter(|_| seconds > 0.0);
        let figure = |f: fn(&Poll) -> f64| Figure {
            total: f(now),
            per_second: rates.map(|b| (f(now) - f(b)).max(0.0) / seconds),
        };
        let totals = Totals {
            requests: figure(|p| p.requests),
            responses: CLASSES
                .iter()
                .enumerate()
                .map(|(i, class)| {
                    let f = Figure {
                        total: now.responses[i],
                        per_second: rates.map(|b| (now.responses[i] - b.responses[i]).max(0.0) / seconds),
                    };
                    ((*class).to_owned(), f)
                })
                .collect(),
            bytes_sent: figure(Poll::sent),
            in_flight: now.in_flight,
            connections_open: now.open,
            connections_accepted: figure(|p| p.accepted),
            connections_closed: figure(|p| p.closed),
            connections_refused: figure(|p| p.refused),
            passthrough_connections: figure(|p| p.passthrough_connections),
            passthrough_bytes_up: figure(|p| p.passthrough_up),
            passthrough_bytes_down: figure(|p| p.passthrough_down),
        };
        let latency = |b: fn(&Poll) -> &Buckets| Latency {
            interval: before
                .and_then(|before| b(now).since(b(before)))
                .and_then(|d| Quantiles::of(&d)),
            since_start: Quantiles::of(b(now)),
        };
        View {
            socket: socket.to_owned(),
            interval_seconds: interval.as_secs_f64(),
            unreachable: None,
            version: now.version.clone(),
            uptime_seconds: now.uptime,
            generation: now.generation,
            totals,
            time_to_first_byte: latency(|p| &p.ttfb),
            time_to_last_byte: latency(|p| &p.ttlb),
            sites: sites(now, rates, seconds),
            transfers: transfers(now, rates, seconds),
            unlisted: now.unlisted,
        }
    }
}

fn sites(now: &Poll, before: Option<&Poll>, seconds: f64) -> Vec<SiteRow> {
    let mut rows: Vec<SiteRow> = now
        .sites
        .iter()
        .map(|(name, s)| {
            let sent = now.site_sent(name);
            let then = before.map(|b| (b.sites.get(name).cloned().unwrap_or_default(), b.site_sent(name)));
            SiteRow {
                site: name.clone(),
                requests: Figure {
                    total: s.requests,
                    per_second: then
                        .as_ref()
                        .map(|(t, _)| (s.requests - t.requests).max(0.0) / seconds),
                },
                bytes_sent: Figure {
                    total: sent,
                    per_second: then.map(|(_, t)| (sent - t).max(0.0) / seconds),
                },
                in_flight: s.in_flight,
            }
        })
        .collect();
    let key = |f: &Figure| f.per_second.unwrap_or(0.0);
    rows.sort_by(|a, b| {
        key(&b.bytes_sent)
            .total_cmp(&key(&a.bytes_sent))
            .then(key(&b.requests).total_cmp(&key(&a.requests)))
            .then(b.bytes_sent.total.total_cmp(&a.bytes_sent.total))
            .then(a.site.cmp(&b.site))
    });
    rows
}

fn transfers(now: &Poll, before: Option<&Poll>, seconds: f64) -> Vec<TransferRow> {
    now.transfers
        .iter()
        .map(|t| {
            let then = before.and_then(|b| b.transfers.iter().find(|o| o.id == t.id));
            let per_second = match then {
                Some(o) => Some(t.sent.saturating_sub(o.sent) as f64 / seconds),
                None if t.elapsed_ms > 0 => Some(t.sent as f64 * 1000.0 / t.elapsed_ms as f64),
                None => None,
            };
            TransferRow {
                info: t.clone(),
                per_second,
            }
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::watch::exposition::parse;

    /// A daemon's metrics text: `requests` to files.test, `bytes` ended there, and
    /// `fast`/`slow` first-byte observations (≤ 10 ms, in (1, 2.5] s).
    pub(crate) fn text(uptime: f64, requests: u64, bytes: u64, fast: u64, slow: u64) -> String {
        let mut t = format!(
            "webship_build_info{{version=\"0.1.0\"}} 1\n\
             webship_uptime_seconds {uptime}\n\
             webship_config_generation 1\n\
             webship_connections_open{{transport=\"tcp\"}} 2\n\
             webship_connections_accepted_total{{transport=\"tcp\"}} {requests}\n\
             webship_http_requests_total{{site=\"files.test\",proto=\"h2\",mode=\"files\"}} {requests}\n\
             webship_http_requests_total{{site=\"-\",proto=\"h1\",mode=\"refused\"}} 1\n\
             webship_http_responses_total{{site=\"files.test\",proto=\"h2\",mode=\"files\",code=\"2xx\"}} {requests}\n\
             webship_http_responses_total{{site=\"-\",proto=\"h1\",mode=\"refused\",code=\"4xx\"}} 1\n\
             webship_http_response_body_bytes_total{{site=\"files.test\",proto=\"h2\",mode=\"files\"}} {bytes}\n\
             webship_http_requests_in_flight{{site=\"files.test\",proto=\"h2\"}} 1\n\
             webship_passthrough_bytes_total{{direction=\"up\"}} 10\n\
             webship_passthrough_bytes_total{{direction=\"down\"}} 20\n"
        );
        let total = fast + slow;
        for (le, n) in [("0.01", fast), ("1.0", fast), ("2.5", total), ("+Inf", total)] {
            t.push_str(&format!(
                "webship_http_time_to_first_byte_seconds_bucket{{site=\"files.test\",proto=\"h2\",le=\"{le}\"}} {n}\n"
            ));
        }
        t
    }

    pub(crate) fn transfer(id: u64, sent: u64, total: u64) -> TransferInfo {
        TransferInfo {
            id,
            site: "files.test".into(),
            proto: "h2".into(),
            peer: "127.0.0.1:40000".parse().unwrap(),
            path: "/big.bin".into(),
            sent,
            total,
            elapsed_ms: 2000,
        }
    }

    fn poll(text: &str, transfers: Vec<TransferInfo>) -> Poll {
        Poll::new(&parse(text).unwrap(), transfers, 0)
    }

    #[test]
    fn rates_are_per_second_of_daemon_uptime_and_count_transfers_in_flight() {
        let before = poll(&text(10.0, 100, 1000, 0, 0), vec![transfer(7, 4000, 1 << 30)]);
        // Two seconds later: 20 more requests, 2000 more bytes ended, and the
        // transfer moved 6000 bytes.
        let now = poll(&text(12.0, 120, 3000, 0, 0), vec![transfer(7, 10_000, 1 << 30)]);
        let view = View::new(
            "s",
            Duration::from_secs(2),
            &now,
            Some(&before),
            Duration::from_secs(5),
        );
        assert_eq!(view.totals.requests.total, 121.0);
        assert_eq!(view.totals.requests.per_second, Some(10.0));
        assert_eq!(
            view.totals.responses[1],
            (
                "2xx".to_owned(),
                Figure {
                    total: 120.0,
                    per_second: Some(10.0)
                }
            )
        );
        assert_eq!(view.totals.bytes_sent.total, 13_000.0);
        assert_eq!(view.totals.bytes_sent.per_second, Some(4000.0));
        assert_eq!(view.totals.passthrough_bytes_down.total, 20.0);
        assert_eq!(view.sites[0].site, "files.test", "the busiest site first");
        assert_eq!(view.sites[0].bytes_sent.per_second, Some(4000.0));
        assert_eq!(view.sites[0].in_flight, 1.0);
        assert_eq!(view.transfers[0].per_second, Some(3000.0));
        assert!((view.transfers[0].done() - 10_000.0 / f64::from(1 << 30)).abs() < 1e-12);

        // The transfer ended: its bytes moved into the ended total, none counted twice.
        let after = poll(&text(13.0, 121, 3000 + 12_000, 0, 0), vec![]);
        let view = View::new(
            "s",
            Duration::from_secs(1),
            &after,
            Some(&now),
            Duration::from_secs(1),
        );
        assert_eq!(view.totals.bytes_sent.per_second, Some(2000.0));

        // A restart (uptime went back): totals, no rates.
        let restarted = poll(&text(1.0, 3, 0, 0, 0), vec![]);
        let view = View::new(
            "s",
            Duration::from_secs(1),
            &restarted,
            Some(&after),
            Duration::from_secs(1),
        );
        assert_eq!(
            view.totals.requests,
            Figure {
                total: 4.0,
                per_second: None
            }
        );
    }

    #[test]
    fn quantiles_interpolate_within_their_bucket() {
        // 0.01 → 50, 1.0 → 50, 2.5 → 100, +Inf → 100.
        let p = poll(&text(1.0, 0, 0, 50, 50), vec![]);
        let q = |x| p.ttfb.quantile(x).unwrap();
        assert_eq!(
            q(0.5),
            Estimate {
                seconds: 0.01,
                above: false
            },
            "the 50th of 100 is the last in ≤ 10 ms"
        );
        assert!((q(0.25).seconds - 0.005).abs() < 1e-12, "{:?}", q(0.25));
        assert!((q(0.9).seconds - (1.0 + 1.5 * 0.8)).abs() < 1e-12, "{:?}", q(0.9));
        // All above the last finite bound: at least that.
        let inf = Buckets(vec![(1.0, 0.0), (f64::INFINITY, 4.0)]);
        assert_eq!(
            inf.quantile(0.5),
            Some(Estimate {
                seconds: 1.0,
                above: true
            })
        );
        assert_eq!(Buckets::default().quantile(0.5), None);
        assert_eq!(inf.quantile(1.5), None);
    }

    #[test]
    fn interval_quantiles_count_only_the_new_observations() {
        let before = poll(&text(1.0, 0, 0, 100, 0), vec![]);
        let now = poll(&text(2.0, 0, 0, 100, 10), vec![]);
        let view = View::new(
            "s",
            Duration::from_secs(1),
            &now,
            Some(&before),
            Duration::from_secs(1),
        );
        let interval = view.time_to_first_byte.interval.unwrap().p50.unwrap();
        assert!(
            interval.seconds > 1.0,
            "the last second saw only slow ones: {interval:?}"
        );
        let all = view.time_to_first_byte.since_start.unwrap().p50.unwrap();
        assert!(all.seconds <= 0.01, "{all:?}");
        assert_eq!(view.time_to_last_byte.since_start, None);
    }
}
