//! The endpoints' [`Counters`] for the metrics: one set per site name, kept
//! process-wide, so a site's WebTransport series continue across reloads (each
//! generation's endpoint holds its site's set; sessions only add to atomics).
//! Site names come from the configuration; past [`crate::metrics::MAX_SITES`] new
//! ones share one set labelled `_other`, as the exchange families do.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::metrics::{Collector, Encoder, Kind, Slots};

use super::{Code, Counters};

/// A family of one series per site: name (after `webship_`), kind, help, field.
type PerSite = (&'static str, Kind, &'static str, fn(&Counters) -> &AtomicU64);

static SITES: Slots<Counters> = Slots::new(crate::metrics::MAX_SITES);

/// The counters of `site`'s endpoint, made on first sight (configuration time).
pub(super) fn counters(site: &str) -> Arc<Counters> {
    SITES.get(site)
}

/// The WebTransport families, one series set per site with an endpoint.
#[derive(Debug)]
pub(crate) struct Metrics;

impl Collector for Metrics {
    fn collect(&self, out: &mut Encoder) {
        let known = SITES.all();
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let plain: [PerSite; 3] = [
            (
                "webtransport_sessions",
                Kind::Counter,
                "WebTransport sessions accepted, by site.",
                |c| &c.sessions_accepted,
            ),
            (
                "webtransport_sessions_active",
                Kind::Gauge,
                "WebTransport sessions open now, by site.",
                |c| &c.sessions_active,
            ),
            (
                "webtransport_streams",
                Kind::Counter,
                "WebTransport streams opened by clients, by site.",
                |c| &c.streams,
            ),
        ];
        for (name, kind, help, field) in plain {
            out.family(&format!("webship_{name}"), kind, help);
            for (site, c) in &known {
                out.sample(&[("site", site)], load(field(c)));
            }
        }
        out.family(
            "webship_webtransport_refused",
            Kind::Counter,
            "WebTransport CONNECTs refused, by site and reason (origin, mode, capacity).",
        );
        for (site, c) in &known {
            for (reason, n) in [
                ("origin", &c.refused_origin),
                ("mode", &c.refused_mode),
                ("capacity", &c.refused_capacity),
            ] {
                out.sample(&[("site", site), ("reason", reason)], load(n));
            }
        }
        out.family(
            "webship_webtransport_closed",
            Kind::Counter,
            "WebTransport sessions ended, by site and close code (series appear once non-zero).",
        );
        for (site, c) in &known {
            for code in Code::ALL {
                let n = load(c.closed(code));
                if n > 0 {
                    out.sample(&[("site", site), ("code", code.name())], n);
                }
            }
        }
        out.family(
            "webship_webtransport_stream_bytes",
            Kind::Counter,
            "WebTransport stream payload bytes, by site and direction (in: from the client).",
        );
        for (site, c) in &known {
            out.sample(&[("site", site), ("direction", "in")], load(&c.stream_bytes_in))
                .sample(&[("site", site), ("direction", "out")], load(&c.stream_bytes_out));
        }
        out.family(
            "webship_webtransport_datagrams",
            Kind::Counter,
            "WebTransport datagrams, by site and direction (dropped: a full queue).",
        );
        for (site, c) in &known {
            for (direction, n) in [
                ("in", &c.datagrams_in),
                ("out", &c.datagrams_out),
                ("dropped", &c.datagrams_dropped),
            ] {
                out.sample(&[("site", site), ("direction", direction)], load(n));
            }
        }
    }
}
