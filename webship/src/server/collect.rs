//! Scrape-time collectors of the counters the server's subsystems keep anyway: the
//! passthrough counters `webship stats` reads (this process's and its predecessors',
//! kernel and userspace summed, so they continue across a takeover), also by engine;
//! the bytes terminated connections received (`ktls`'s read counter for TCP, `h3`'s
//! for QUIC); and [`register_subsystems`], which adds every subsystem's own collector
//! (kTLS, TCP BBR, HTTP/2 write batches, QUIC, proxy upstreams, WebTransport).

use std::sync::Arc;

use crate::config::Engine;
use crate::ebpf::{Counter, Programs};
use crate::metrics::{Collector, Encoder, Kind, Registry};

/// The subsystems' families, read at scrape time from the counters they keep.
/// `engine`: the TCP passthrough engine, when there are passthrough routes.
pub(super) fn register_subsystems(
    metrics: &Registry,
    programs: Option<Arc<Programs>>,
    engine: Option<Engine>,
) {
    metrics.register(Box::new(PassthroughEngines::new(programs, engine)));
    metrics.register(Box::new(crate::ktls::Metrics));
    metrics.register(Box::new(crate::listener::Metrics));
    metrics.register(Box::new(crate::http::BatchMetrics));
    metrics.register(Box::new(crate::h3::stats::Metrics));
    metrics.register(Box::new(crate::proxy::Metrics));
    metrics.register(Box::new(crate::webtransport::Metrics));
}

/// TCP health per site (`[kernel] tcp_health`): the sock_ops program's per-CPU
/// counters, summed when a scrape asks (the same snapshot `webship stats` shows).
pub(super) struct TcpHealth {
    programs: Arc<Programs>,
}

impl TcpHealth {
    pub(super) fn new(programs: Arc<Programs>) -> Self {
        Self { programs }
    }
}

/// One counter of a site's TCP health.
type SiteCounter = fn(&crate::ebpf::tcp::SiteTcp) -> u64;

/// A log2 histogram of the eBPF side as Prometheus buckets: bucket `i` holds values
/// below `2^(i+1)` (in the program's unit; `scale` turns that into the metric's), the
/// last, unbounded one is `+Inf`.
fn log2_buckets(h: &crate::ebpf::tcp::Histogram, scale: f64) -> impl Iterator<Item = (f64, u64)> + '_ {
    let bounded = h.buckets.len().saturating_sub(1);
    h.buckets[..bounded]
        .iter()
        .enumerate()
        .scan(0u64, move |cumulative, (i, n)| {
            *cumulative += n;
            Some((h.upper_bound(i).unwrap_or(u64::MAX) as f64 * scale, *cumulative))
        })
}

impl Collector for TcpHealth {
    fn collect(&self, out: &mut Encoder) {
        let snapshot = self.programs.tcp_snapshot();
        let counters: [(&str, &str, SiteCounter); 6] = [
            ("webship_tcp_retransmits", "TCP segments retransmitted to the site's clients (kernel, sock_ops).", |s| s.retransmits),
            ("webship_tcp_rto", "TCP retransmission timeouts on the site's connections.", |s| s.rto),
            ("webship_tcp_connections_closed", "TCP connections of the site that closed (counted by the kernel).", |s| s.closed),
            ("webship_tcp_connections_reset", "TCP connections of the site closed without the FIN handshake (a reset either way, or a timeout).", |s| s.reset),
            ("webship_tcp_acked_bytes", "Bytes the site's clients acknowledged, of closed connections.", |s| s.bytes_acked),
            ("webship_tcp_received_bytes", "Bytes received from the site's clients, of closed connections.", |s| s.bytes_received),
        ];
        for (name, help, value) in counters {
            out.family(name, Kind::Counter, help);
            for site in &snapshot.sites {
                out.sample(&[("site", &site.site)], value(site));
            }
        }
        out.family(
            "webship_tcp_rtt_seconds",
            Kind::Histogram,
            "Smoothed TCP RTT of the site's connections when they closed (log2 buckets).",
        );
        for site in &snapshot.sites {
            let h = &site.rtt_us;
            out.histogram(
                &[("site", &site.site)],
                log2_buckets(h, 1e-6),
                h.sum as f64 / 1e6,
                h.count,
            );
        }
        out.family(
            "webship_tcp_delivery_rate_bytes",
            Kind::Histogram,
            "The last delivery-rate sample of the site's connections when they closed, bytes per second (log2 buckets).",
        );
        for site in &snapshot.sites {
            let h = &site.delivery_rate;
            out.histogram(
                &[("site", &site.site)],
                log2_buckets(h, 1.0),
                h.sum as f64,
                h.count,
            );
        }
    }
}

/// The access log's lines dropped because its queue was full (the writer behind):
/// the table's counter, beside the rate-limited warning.
pub(super) struct AccessLog {
    sink: Arc<crate::exchange::access::Sink>,
}

impl AccessLog {
    pub(super) fn new(sink: Arc<crate::exchange::access::Sink>) -> Self {
        Self { sink }
    }
}

impl Collector for AccessLog {
    fn collect(&self, out: &mut Encoder) {
        out.family(
            "webship_access_log_dropped_lines",
            Kind::Counter,
            "Access log lines dropped because the writer's queue was full.",
        )
        .sample(&[], self.sink.dropped());
    }
}

/// The passthrough counters as metric families.
pub(super) struct Passthrough {
    programs: Option<Arc<Programs>>,
}

impl Passthrough {
    pub(super) fn new(programs: Option<Arc<Programs>>) -> Self {
        Self { programs }
    }
}

impl Collector for Passthrough {
    fn collect(&self, out: &mut Encoder) {
        let values = super::plan::Plan::totals(self.programs.as_deref());
        let v = |c: Counter| values[c as usize];
        out.family(
            "webship_passthrough_connections",
            Kind::Counter,
            "TLS passthrough connections handed to an upstream.",
        )
        .sample(&[], v(Counter::Steered));
        out.family(
            "webship_passthrough_bytes",
            Kind::Counter,
            "TLS passthrough payload bytes, by direction (up: client to origin).",
        )
        .sample(&[("direction", "up")], v(Counter::BytesUp))
        .sample(&[("direction", "down")], v(Counter::BytesDown));
        out.family(
            "webship_passthrough_refused",
            Kind::Counter,
            "TLS passthrough connections closed before an upstream carried them, by reason.",
        )
        .sample(&[("reason", "sni_miss")], v(Counter::SniMisses))
        .sample(&[("reason", "bad_hello")], v(Counter::BadHellos))
        .sample(&[("reason", "upstream_failure")], v(Counter::UpstreamFailures));
        out.family(
            "webship_passthrough_closed",
            Kind::Counter,
            "TLS passthrough connections ended, by reason.",
        )
        .sample(&[("reason", "clean")], v(Counter::ClosedClean))
        .sample(&[("reason", "reset")], v(Counter::ClosedReset))
        .sample(&[("reason", "idle")], v(Counter::ClosedIdle))
        .sample(&[("reason", "stalled")], v(Counter::ClosedStalled));
    }
}

/// The rest of what `webship stats` shows, split by who counted it: `kernel` (the
/// eBPF programs: sockmap redirects, the UDP classifier) or `userspace` (the
/// daemon's copy and splice engines, the UDP relay, its decisions); the sockets
/// linked now; and which TCP engine runs.
pub(super) struct PassthroughEngines {
    programs: Option<Arc<Programs>>,
    /// The TCP engine, when there are passthrough routes.
    engine: Option<Engine>,
}

impl PassthroughEngines {
    pub(super) fn new(programs: Option<Arc<Programs>>, engine: Option<Engine>) -> Self {
        Self { programs, engine }
    }
}

impl Collector for PassthroughEngines {
    fn collect(&self, out: &mut Encoder) {
        let user = super::plan::published();
        let kernel = self.programs.as_deref().map(Programs::kernel_counters);
        let engines: [(&str, Option<&crate::ebpf::Values>); 2] =
            [("kernel", kernel.as_ref()), ("userspace", Some(&user))];
        let by_engine = |out: &mut Encoder, c: Counter, extra: &[(&str, &str)]| {
            for (engine, values) in engines {
                if let Some(v) = values {
                    let mut labels = vec![("engine", engine)];
                    labels.extend_from_slice(extra);
                    out.sample(&labels, v[c as usize]);
                }
            }
        };
        let total = |c: Counter| user[c as usize].saturating_add(kernel.map_or(0, |k| k[c as usize]));
        if let Some(engine) = self.engine {
            out.family(
                "webship_passthrough_engine",
                Kind::Gauge,
                "1 for the engine TLS passthrough runs (auto: copy the first MiB, then splice).",
            )
            .sample(&[("engine", &engine.to_string())], 1u64);
        }
        out.family(
            "webship_passthrough_engine_bytes",
            Kind::Counter,
            "Passthrough payload bytes (TCP and UDP), by who moved them (kernel: eBPF redirects) and direction.",
        );
        by_engine(out, Counter::BytesUp, &[("direction", "up")]);
        by_engine(out, Counter::BytesDown, &[("direction", "down")]);
        out.family(
            "webship_passthrough_redirect_failures",
            Kind::Counter,
            "Segments and datagrams the eBPF programs could not redirect (peer gone or unlinked).",
        )
        .sample(&[], total(Counter::RedirectFailures));
        out.family(
            "webship_passthrough_udp_flows",
            Kind::Counter,
            "HTTP/3 passthrough flows created towards the UDP origin, by engine.",
        );
        by_engine(out, Counter::UdpFlows, &[]);
        out.family(
            "webship_passthrough_udp_packets",
            Kind::Counter,
            "HTTP/3 passthrough datagrams, by engine and direction.",
        );
        by_engine(out, Counter::UdpPacketsUp, &[("direction", "up")]);
        by_engine(out, Counter::UdpPacketsDown, &[("direction", "down")]);
        out.family(
            "webship_passthrough_udp_flows_dropped",
            Kind::Counter,
            "HTTP/3 passthrough flows dropped (evicted: to make room; refused: the table or the address was full).",
        )
        .sample(&[("reason", "evicted")], total(Counter::UdpFlowsEvicted))
        .sample(&[("reason", "refused")], total(Counter::UdpFlowsRefused));
        if let Some(p) = &self.programs {
            out.family(
                "webship_passthrough_linked_sockets",
                Kind::Gauge,
                "Sockets the sockmap engine has linked now (two per connection).",
            )
            .sample(&[], p.linked_sockets());
            let family = out.family(
                "webship_passthrough_sockmap_fallbacks",
                Kind::Counter,
                "Connections the sockmap engine could not link and relayed by copy (unlinkable: a socket already half-closed or the map full; upstream_refused).",
            );
            for (reason, n) in crate::passthrough::sockmap_fallbacks() {
                family.sample(&[("reason", reason)], n);
            }
        }
    }
}

/// Bytes received by terminated connections, by transport.
pub(super) struct Received;

impl Collector for Received {
    fn collect(&self, out: &mut Encoder) {
        out.family("webship_connection_received_bytes", Kind::Counter, "Bytes received by terminated connections (TCP: TLS records as read; QUIC: UDP payload, added when a connection closes).")
            .sample(&[("transport", "tcp")], crate::ktls::received_bytes())
            .sample(&[("transport", "quic")], crate::h3::received_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Format;

    #[test]
    fn dropped_access_lines_are_counted_and_documented() {
        let (sink, _writer) = crate::exchange::access::Sink::open(None, 1).unwrap();
        for _ in 0..3 {
            sink.send(b"line\n".to_vec());
        }
        let registry = Registry::new();
        registry.register(Box::new(AccessLog::new(sink)));
        let text = registry.render(Format::Prometheus);
        assert!(
            text.contains("\nwebship_access_log_dropped_lines_total 2\n"),
            "{text}"
        );
        let docs = include_str!("../../../docs/metrics.md");
        assert!(docs.contains("`webship_access_log_dropped_lines_total`"));
    }

    /// Every family the subsystem collectors write is in docs/metrics.md, in both
    /// formats' spelling of the name (`_total` on counters in Prometheus' text).
    #[test]
    fn every_subsystem_family_is_documented() {
        let docs = include_str!("../../../docs/metrics.md");
        let registry = Registry::new();
        register_subsystems(&registry, None, Some(Engine::Splice));
        let text = registry.render(Format::Prometheus);
        let names: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split_whitespace().next())
            .collect();
        for expected in [
            "webship_ktls_promotions_total",
            "webship_quic_rtt_seconds",
            "webship_proxy_upstream_errors_total",
            "webship_webtransport_sessions_total",
            "webship_passthrough_engine_bytes_total",
            "webship_h2_write_batch_bytes",
            "webship_tcp_bbr_switches_total",
        ] {
            assert!(names.contains(&expected), "{expected} not written:\n{text}");
        }
        for name in names {
            assert!(
                docs.contains(&format!("`{name}`")),
                "{name} is not in docs/metrics.md"
            );
        }
        assert!(docs.contains("`webship_passthrough_linked_sockets`"));
    }
}
