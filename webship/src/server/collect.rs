//! Scrape-time collectors of the counters the server's subsystems keep anyway: the
//! passthrough counters `webship stats` reads (this process's and its predecessors',
//! kernel and userspace summed, so they continue across a takeover), and the bytes
//! terminated connections received (`ktls`'s read counter for TCP, `h3`'s for QUIC).

use std::sync::Arc;

use crate::ebpf::{Counter, Programs};
use crate::metrics::{Collector, Encoder, Kind};

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

/// Bytes received by terminated connections, by transport.
pub(super) struct Received;

impl Collector for Received {
    fn collect(&self, out: &mut Encoder) {
        out.family("webship_connection_received_bytes", Kind::Counter, "Bytes received by terminated connections (TCP: TLS records as read; QUIC: UDP payload, added when a connection closes).")
            .sample(&[("transport", "tcp")], crate::ktls::received_bytes())
            .sample(&[("transport", "quic")], crate::h3::received_bytes());
    }
}
