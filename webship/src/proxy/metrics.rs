//! Per-upstream figures for the metrics: connects, failed exchanges by kind,
//! ejections, connections open (the pool: in use and idle) and the time to the
//! response head.
//!
//! One slot per upstream address, kept process-wide by address, so an upstream's
//! series continue across reloads (each generation's routes hold their slots; the
//! request path only adds to atomics). Addresses come from the configuration;
//! past [`MAX_UPSTREAMS`] new ones share one slot labelled `_other`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::metrics::{Collector, Encoder, Histogram, Kind, Slots};

const MAX_UPSTREAMS: usize = 1024;

/// Why an exchange with an upstream failed: the `kind` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ErrorKind {
    /// Refused, reset or timed out at connect.
    Unreachable,
    /// No connection freed up within `queue_timeout`.
    QueueFull,
    /// A local shortage (descriptors, buffers, ports).
    Local,
    /// The request body went over `max_body_bytes`.
    TooLarge,
    /// The client's request body failed.
    ClientBody,
    /// The client stalled its upload.
    ClientTimeout,
    /// The upstream answered something that is not HTTP.
    Garbage,
    /// The exchange broke after the connect.
    Broken,
    /// No connection was ready within the connect limits.
    ConnectTimeout,
    /// The response head was late, or the upstream took none of the upload.
    ResponseTimeout,
}

impl ErrorKind {
    const ALL: [ErrorKind; 10] = [
        Self::Unreachable,
        Self::QueueFull,
        Self::Local,
        Self::TooLarge,
        Self::ClientBody,
        Self::ClientTimeout,
        Self::Garbage,
        Self::Broken,
        Self::ConnectTimeout,
        Self::ResponseTimeout,
    ];

    fn name(self) -> &'static str {
        match self {
            Self::Unreachable => "unreachable",
            Self::QueueFull => "queue_full",
            Self::Local => "local",
            Self::TooLarge => "too_large",
            Self::ClientBody => "client_body",
            Self::ClientTimeout => "client_timeout",
            Self::Garbage => "garbage",
            Self::Broken => "broken",
            Self::ConnectTimeout => "connect_timeout",
            Self::ResponseTimeout => "response_timeout",
        }
    }
}

/// One upstream's counters.
#[derive(Debug, Default)]
pub(super) struct UpstreamMetrics {
    connects: AtomicU64,
    /// Connections closed: open = connects - closed (in use or idle in the pool).
    closed: AtomicU64,
    errors: [AtomicU64; ErrorKind::ALL.len()],
    ejections: AtomicU64,
    /// From the start of the request towards the upstream (queue and connect
    /// included when it needs a new connection) to its response head.
    response: Histogram,
}

impl UpstreamMetrics {
    pub(super) fn error(&self, kind: ErrorKind) {
        self.errors[kind as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn ejected(&self) {
        self.ejections.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn responded(&self, after: Duration) {
        self.response.observe(after);
    }

    /// A connection was made: counted open until the returned guard drops.
    pub(super) fn connected(self: &Arc<Self>) -> OpenConnection {
        self.connects.fetch_add(1, Ordering::Relaxed);
        OpenConnection(self.clone())
    }
}

/// Held inside a pooled connection: it closes when this drops.
#[derive(Debug)]
pub(super) struct OpenConnection(Arc<UpstreamMetrics>);

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.closed.fetch_add(1, Ordering::Relaxed);
    }
}

static UPSTREAMS: Slots<UpstreamMetrics> = Slots::new(MAX_UPSTREAMS);

/// The slot of `addr`, made on first sight (configuration time, never per request).
pub(super) fn slot(addr: SocketAddr) -> Arc<UpstreamMetrics> {
    UPSTREAMS.get(&addr.to_string())
}

/// The proxy's upstream families, read at scrape time.
#[derive(Debug)]
pub(crate) struct Metrics;

impl Collector for Metrics {
    fn collect(&self, out: &mut Encoder) {
        let known = UPSTREAMS.all();
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        out.family(
            "webship_proxy_upstream_connects",
            Kind::Counter,
            "Connections made to an upstream (TCP connected), by upstream.",
        );
        for (label, u) in &known {
            out.sample(&[("upstream", label)], load(&u.connects));
        }
        out.family(
            "webship_proxy_upstream_connections",
            Kind::Gauge,
            "Connections open to an upstream now, in use or idle in the pool, by upstream.",
        );
        for (label, u) in &known {
            // Closes first (both only grow): never negative.
            let closed = load(&u.closed);
            out.sample(&[("upstream", label)], load(&u.connects).saturating_sub(closed));
        }
        out.family(
            "webship_proxy_upstream_errors",
            Kind::Counter,
            "Failed exchanges with an upstream, by upstream and kind (series appear once non-zero).",
        );
        for (label, u) in &known {
            for kind in ErrorKind::ALL {
                let n = load(&u.errors[kind as usize]);
                if n > 0 {
                    out.sample(&[("upstream", label), ("kind", kind.name())], n);
                }
            }
        }
        out.family(
            "webship_proxy_upstream_ejections",
            Kind::Counter,
            "Times an upstream was ejected (skipped for 10 s), by upstream.",
        );
        for (label, u) in &known {
            out.sample(&[("upstream", label)], load(&u.ejections));
        }
        out.family(
            "webship_proxy_upstream_response_seconds",
            Kind::Histogram,
            "From sending a request to an upstream to its response head, by upstream.",
        );
        for (label, u) in &known {
            let snap = u.response.snapshot();
            if snap.count > 0 {
                out.histogram(&[("upstream", label)], snap.buckets(), snap.sum, snap.count);
            }
        }
    }
}
