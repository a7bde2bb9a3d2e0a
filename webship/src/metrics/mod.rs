//! The metrics registry: counters the request path bumps without a lock or an
//! allocation, and the exposition a scrape renders from them (`/metrics` on the
//! admin listener, the control socket's `metrics` request). docs/metrics.md names
//! every series.
//!
//! - Exchanges: one [`SiteMetrics`] per configured site name (and one for requests
//!   that reached no site), kept by name across reloads, so a site's series continue
//!   when a reload renumbers the sites. Each generation's `Drivers` holds a
//!   [`Sites`] table, the slots by the generation's site index: a record finds its
//!   slot by index, with no lookup. An exchange costs relaxed atomic additions only
//!   (one when it starts, five or six when it ends).
//! - Connections: accepted, and closed by protocol and reason, per transport.
//! - Process and configuration: read at scrape time (`/proc/self`), the generation
//!   and reload counts, build information.
//! - Subsystems: any module that already keeps counters adds a [`Collector`], which
//!   the scrape asks to write its families; nothing is added to the hot path.
//!
//! A leaf: it imports nothing from the crate; the callers map their enums onto the
//! label tables below ([`PROTOS`], [`MODES`], [`OUTCOMES`], [`Close`]).

pub(crate) mod encode;
mod histogram;
mod process;
mod slots;
mod values;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

pub(crate) use encode::{Encoder, Format, Kind};
pub(crate) use histogram::Histogram;
pub(crate) use slots::Slots;
pub(crate) use values::Values;

/// The `proto` label, by the exchange's protocol index.
pub(crate) const PROTOS: [&str; 3] = ["h1", "h2", "h3"];
/// The `mode` label, by the route's mode index.
pub(crate) const MODES: [&str; 4] = ["files", "proxy", "webtransport", "refused"];
/// The `outcome` label: how a response ended.
pub(crate) const OUTCOMES: [&str; 5] = ["complete", "client_gone", "timeout", "body_error", "unfinished"];
/// The `code` label: the status class (`other` for 600-999, which `http` allows).
const CLASSES: [&str; 6] = ["1xx", "2xx", "3xx", "4xx", "5xx", "other"];
/// The `site` label of requests that reached no site (a foreign `Host`, a request
/// refused before it had one).
const NO_SITE: &str = "-";
/// Distinct site names kept by every per-site family (the exchanges here, the
/// WebTransport endpoints'); beyond, new names share one slot labelled `_other`
/// ([`slots::OTHER`]). Sites come from the configuration, but a daemon reloaded with
/// ever new names must not grow without bound.
pub(crate) const MAX_SITES: usize = 4096;

/// Writes a subsystem's families at scrape time, from counters the subsystem keeps
/// anyway (statics, endpoint counters, eBPF maps). Called with no lock of the
/// request path held; it should be quick (it delays the scrape, not traffic).
pub(crate) trait Collector: Send + Sync + 'static {
    fn collect(&self, out: &mut Encoder);
}

/// One site's exchange counters; index order is [`PROTOS`] × [`MODES`] × ….
#[derive(Debug, Default)]
pub(crate) struct SiteMetrics {
    name: Arc<str>,
    started: [[AtomicU64; MODES.len()]; PROTOS.len()],
    responses: [[[AtomicU64; CLASSES.len()]; MODES.len()]; PROTOS.len()],
    outcomes: [[AtomicU64; OUTCOMES.len()]; PROTOS.len()],
    bytes: [[AtomicU64; MODES.len()]; PROTOS.len()],
    ttfb: [Histogram; PROTOS.len()],
    ttlb: [Histogram; PROTOS.len()],
}

/// An exchange that ended, in label indices.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ended {
    pub(crate) proto: usize,
    pub(crate) mode: usize,
    pub(crate) status: u16,
    /// Response body bytes handed to the connection.
    pub(crate) bytes: u64,
    pub(crate) ttfb: Duration,
    pub(crate) ttlb: Duration,
    pub(crate) outcome: usize,
}

impl SiteMetrics {
    fn named(name: Arc<str>) -> Self {
        Self {
            name,
            ..Self::default()
        }
    }

    /// An exchange began (its record was made): in flight until [`Self::end`].
    pub(crate) fn begin(&self, proto: usize, mode: usize) {
        self.started[proto][mode].fetch_add(1, Ordering::Relaxed);
    }

    /// An exchange ended: exactly once per [`Self::begin`].
    pub(crate) fn end(&self, e: &Ended) {
        let class = match e.status / 100 {
            c @ 1..=5 => usize::from(c) - 1,
            _ => CLASSES.len() - 1,
        };
        self.responses[e.proto][e.mode][class].fetch_add(1, Ordering::Relaxed);
        self.outcomes[e.proto][e.outcome].fetch_add(1, Ordering::Relaxed);
        if e.bytes > 0 {
            self.bytes[e.proto][e.mode].fetch_add(e.bytes, Ordering::Relaxed);
        }
        self.ttfb[e.proto].observe(e.ttfb);
        self.ttlb[e.proto].observe(e.ttlb);
    }

    /// Exchanges of `proto` begun and not ended. Ends are read first: both only
    /// grow, so the difference is never negative.
    fn in_flight(&self, proto: usize) -> u64 {
        let ended: u64 = self.outcomes[proto].iter().map(load).sum();
        let begun: u64 = self.started[proto].iter().map(load).sum();
        begun.saturating_sub(ended)
    }
}

fn load(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

/// One generation's site slots, by the generation's site index.
#[derive(Debug)]
pub(crate) struct Sites {
    /// Keeps the registry (its connection counters) with the generation.
    registry: Arc<Registry>,
    slots: Vec<Arc<SiteMetrics>>,
    none: Arc<SiteMetrics>,
}

impl Sites {
    /// The slot of site `index` of this generation (`None`: no site).
    pub(crate) fn site(&self, index: Option<usize>) -> &SiteMetrics {
        index.and_then(|i| self.slots.get(i)).unwrap_or(&self.none)
    }

    /// Connection counters (shared by every generation).
    pub(crate) fn connections(&self) -> &Connections {
        &self.registry.connections
    }
}

/// The transport a connection came over: the `transport` label.
const TRANSPORTS: [&str; 2] = ["tcp", "quic"];
/// What a connection turned out to carry: the `protocol` label of closes
/// (`none`: it ended before one was known).
const CONN_PROTOCOLS: [&str; 5] = ["h1", "h2", "h3", "passthrough", "none"];

/// Indices into [`TRANSPORTS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Transport {
    Tcp = 0,
    Quic = 1,
}

/// Indices into [`CONN_PROTOCOLS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Protocol {
    H1 = 0,
    H2 = 1,
    H3 = 2,
    Passthrough = 3,
    None = 4,
}

/// A connection in the metrics: accepted when made, closed exactly once, with the
/// last protocol and reason set, when dropped (however its task ends: returned,
/// or dropped at the end of a drain).
#[derive(Debug)]
pub(crate) struct Tracked<'a> {
    connections: &'a Connections,
    transport: Transport,
    protocol: Protocol,
    reason: Close,
}

impl<'a> Tracked<'a> {
    pub(crate) fn accepted(connections: &'a Connections, transport: Transport) -> Self {
        connections.accepted[transport as usize].fetch_add(1, Ordering::Relaxed);
        Self {
            connections,
            transport,
            protocol: Protocol::None,
            reason: Close::Error,
        }
    }

    /// What the connection carries and why it ends, as known so far.
    pub(crate) fn close(&mut self, protocol: Protocol, reason: Close) {
        self.protocol = protocol;
        self.reason = reason;
    }
}

impl Drop for Tracked<'_> {
    fn drop(&mut self) {
        let c = &self.connections.closed[self.transport as usize][self.protocol as usize];
        c[self.reason as usize].fetch_add(1, Ordering::Relaxed);
    }
}

/// Why a connection closed: the `reason` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Close {
    /// The peer or the server ended it in order (including idle keep-alive ends
    /// and the drain at shutdown).
    Closed,
    /// No TLS handshake (or h2 preface, or PROXY header) within `handshake_timeout`.
    HandshakeTimeout,
    /// The TLS handshake failed (no common suite, no SNI match, garbage).
    HandshakeFailed,
    /// A request head not complete within `header_read_timeout`.
    HeaderTimeout,
    /// The client stopped reading for `send_timeout`.
    SendTimeout,
    /// No traffic for the idle timeout (QUIC).
    IdleTimeout,
    /// The peer reset the connection, or a write found it gone.
    Reset,
    /// The peer broke the protocol (h2/h3 connection error).
    ProtocolError,
    /// A PROXY header that was required, missing or invalid.
    ProxyHeader,
    /// Passthrough: no route for the SNI, or an unreadable ClientHello.
    NoRoute,
    /// Any other error.
    Error,
}

impl Close {
    const ALL: [Close; 11] = [
        Close::Closed,
        Close::HandshakeTimeout,
        Close::HandshakeFailed,
        Close::HeaderTimeout,
        Close::SendTimeout,
        Close::IdleTimeout,
        Close::Reset,
        Close::ProtocolError,
        Close::ProxyHeader,
        Close::NoRoute,
        Close::Error,
    ];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Close::Closed => "closed",
            Close::HandshakeTimeout => "handshake_timeout",
            Close::HandshakeFailed => "handshake_failed",
            Close::HeaderTimeout => "header_timeout",
            Close::SendTimeout => "send_timeout",
            Close::IdleTimeout => "idle_timeout",
            Close::Reset => "reset",
            Close::ProtocolError => "protocol_error",
            Close::ProxyHeader => "proxy_header",
            Close::NoRoute => "no_route",
            Close::Error => "error",
        }
    }
}

/// Connection counters, per transport.
#[derive(Debug, Default)]
pub(crate) struct Connections {
    accepted: [AtomicU64; TRANSPORTS.len()],
    /// Refused at accept (QUIC: over `max_connections`).
    refused: [AtomicU64; TRANSPORTS.len()],
    closed: [[[AtomicU64; Close::ALL.len()]; CONN_PROTOCOLS.len()]; TRANSPORTS.len()],
}

impl Connections {
    /// A connection refused at accept (not [`Tracked`]).
    pub(crate) fn refused(&self, transport: Transport) {
        self.refused[transport as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Connections open now over transport index `t`: accepted less closed. Closes
    /// are read first and both only grow, so it is never negative.
    fn open_over(&self, t: usize) -> u64 {
        let closed: u64 = self.closed[t].iter().flatten().map(load).sum();
        load(&self.accepted[t]).saturating_sub(closed)
    }

    /// Connections open now, every transport: what `webship_connections_open` adds
    /// up to, and what the service manager's status line shows.
    pub(crate) fn open(&self) -> u64 {
        (0..TRANSPORTS.len()).map(|t| self.open_over(t)).sum()
    }
}

/// Every metric of the process; one per daemon, shared by every generation.
pub(crate) struct Registry {
    started: Instant,
    start_time: SystemTime,
    sites: Slots<SiteMetrics>,
    none: Arc<SiteMetrics>,
    connections: Connections,
    generation: AtomicU64,
    /// Reloads that took effect and reloads refused.
    reloads: [AtomicU64; 2],
    /// Serving and not draining: what `/readyz` answers.
    ready: AtomicBool,
    collectors: Mutex<Vec<Box<dyn Collector>>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

impl Registry {
    /// Connection counters.
    pub(crate) fn connections(&self) -> &Connections {
        &self.connections
    }

    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self {
            started: Instant::now(),
            start_time: SystemTime::now(),
            sites: Slots::with_cap(MAX_SITES),
            none: Arc::new(SiteMetrics::named(NO_SITE.into())),
            connections: Connections::default(),
            generation: AtomicU64::new(0),
            reloads: Default::default(),
            ready: AtomicBool::new(false),
            collectors: Mutex::new(Vec::new()),
        })
    }

    /// The slots of a generation whose sites are `names` (by index): a name seen
    /// before gets its existing slot, so its series continue across reloads.
    pub(crate) fn sites(self: &Arc<Self>, names: &[Arc<str>]) -> Sites {
        let slots = names
            .iter()
            .map(|name| self.sites.get_with(name, |kept| SiteMetrics::named(kept.into())))
            .collect();
        Sites {
            registry: self.clone(),
            slots,
            none: self.none.clone(),
        }
    }

    /// Adds a subsystem's families to every scrape from now on.
    pub(crate) fn register(&self, collector: Box<dyn Collector>) {
        self.collectors
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(collector);
    }

    /// The generation now serving new connections.
    pub(crate) fn set_generation(&self, number: u64) {
        self.generation.store(number, Ordering::Relaxed);
    }

    /// A reload was tried: `applied` when it took effect.
    pub(crate) fn reloaded(&self, applied: bool) {
        self.reloads[usize::from(!applied)].fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }

    pub(crate) fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    /// The exposition of every metric now.
    pub(crate) fn render(&self, format: Format) -> String {
        let mut out = Encoder::new(format);
        self.render_process(&mut out);
        self.render_connections(&mut out);
        {
            let known = self.sites.all();
            let sites: Vec<&SiteMetrics> = std::iter::once(&*self.none)
                .chain(known.iter().map(|(_, s)| &**s))
                .collect();
            render_sites(&mut out, &sites);
        }
        for collector in self.collectors.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            collector.collect(&mut out);
        }
        out.finish()
    }

    fn render_process(&self, out: &mut Encoder) {
        out.family("webship_build", Kind::Info, "Webship's version.")
            .sample(&[("version", env!("CARGO_PKG_VERSION"))], 1u64);
        let start = self
            .start_time
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        out.family(
            "process_start_time_seconds",
            Kind::Gauge,
            "When the process started, in seconds since the epoch.",
        )
        .sample(&[], start.as_secs_f64());
        out.family(
            "webship_uptime_seconds",
            Kind::Gauge,
            "Seconds since the process started.",
        )
        .sample(&[], self.started.elapsed().as_secs_f64());
        let p = process::Process::read();
        if let Some(v) = p.rss_bytes {
            out.family(
                "process_resident_memory_bytes",
                Kind::Gauge,
                "Resident memory (VmRSS).",
            )
            .sample(&[], v);
        }
        if let Some(v) = p.open_fds {
            out.family("process_open_fds", Kind::Gauge, "Open file descriptors.")
                .sample(&[], v);
        }
        if let Some(v) = p.threads {
            out.family("webship_process_threads", Kind::Gauge, "Threads of the process.")
                .sample(&[], v);
        }
        if let Some(v) = p.cpu {
            out.family("process_cpu_seconds", Kind::Counter, "User and system CPU time.")
                .sample(&[], v.as_secs_f64());
        }
        out.family(
            "webship_config_generation",
            Kind::Gauge,
            "The configuration generation serving new connections (1 at start, one more per applied reload).",
        )
        .sample(&[], self.generation.load(Ordering::Relaxed));
        out.family(
            "webship_config_reloads",
            Kind::Counter,
            "Reloads tried, by result.",
        );
        for (result, count) in ["applied", "refused"].iter().zip(&self.reloads) {
            out.sample(&[("result", result)], load(count));
        }
        out.family(
            "webship_ready",
            Kind::Gauge,
            "1 while serving and not draining (what /readyz answers).",
        )
        .sample(&[], u64::from(self.is_ready()));
    }

    fn render_connections(&self, out: &mut Encoder) {
        let c = &self.connections;
        out.family(
            "webship_connections_accepted",
            Kind::Counter,
            "Connections accepted, by transport.",
        );
        for (t, name) in TRANSPORTS.iter().enumerate() {
            out.sample(&[("transport", name)], load(&c.accepted[t]));
        }
        out.family(
            "webship_connections_refused",
            Kind::Counter,
            "Connections refused at accept (QUIC over max_connections), by transport.",
        );
        for (t, name) in TRANSPORTS.iter().enumerate() {
            out.sample(&[("transport", name)], load(&c.refused[t]));
        }
        out.family(
            "webship_connections_open",
            Kind::Gauge,
            "Connections open now, by transport.",
        );
        for (t, name) in TRANSPORTS.iter().enumerate() {
            out.sample(&[("transport", name)], c.open_over(t));
        }
        out.family("webship_connections_closed", Kind::Counter, "Connections closed, by transport, what they carried and why they ended (series appear once non-zero).");
        for (t, transport) in TRANSPORTS.iter().enumerate() {
            for (p, protocol) in CONN_PROTOCOLS.iter().enumerate() {
                for reason in Close::ALL {
                    let n = load(&c.closed[t][p][reason as usize]);
                    if n > 0 {
                        out.sample(
                            &[
                                ("transport", transport),
                                ("protocol", protocol),
                                ("reason", reason.as_str()),
                            ],
                            n,
                        );
                    }
                }
            }
        }
    }
}

/// The exchange families, every site's series under each (series appear once
/// non-zero, so a site without h3 traffic has no h3 series).
fn render_sites(out: &mut Encoder, sites: &[&SiteMetrics]) {
    out.family(
        "webship_http_requests",
        Kind::Counter,
        "Requests answered (the exchange began), by site, protocol and mode.",
    );
    for s in sites {
        for (p, proto) in PROTOS.iter().enumerate() {
            for (m, mode) in MODES.iter().enumerate() {
                let n = load(&s.started[p][m]);
                if n > 0 {
                    out.sample(&[("site", &s.name), ("proto", proto), ("mode", mode)], n);
                }
            }
        }
    }
    out.family(
        "webship_http_responses",
        Kind::Counter,
        "Responses ended, by site, protocol, mode and status class.",
    );
    for s in sites {
        for (p, proto) in PROTOS.iter().enumerate() {
            for (m, mode) in MODES.iter().enumerate() {
                for (c, code) in CLASSES.iter().enumerate() {
                    let n = load(&s.responses[p][m][c]);
                    if n > 0 {
                        out.sample(
                            &[
                                ("site", &s.name),
                                ("proto", proto),
                                ("mode", mode),
                                ("code", code),
                            ],
                            n,
                        );
                    }
                }
            }
        }
    }
    out.family(
        "webship_http_response_outcomes",
        Kind::Counter,
        "Responses ended, by site, protocol and how they ended.",
    );
    for s in sites {
        for (p, proto) in PROTOS.iter().enumerate() {
            for (o, outcome) in OUTCOMES.iter().enumerate() {
                let n = load(&s.outcomes[p][o]);
                if n > 0 {
                    out.sample(&[("site", &s.name), ("proto", proto), ("outcome", outcome)], n);
                }
            }
        }
    }
    out.family(
        "webship_http_response_body_bytes",
        Kind::Counter,
        "Response body bytes handed to the connection, counted when the response ends.",
    );
    for s in sites {
        for (p, proto) in PROTOS.iter().enumerate() {
            for (m, mode) in MODES.iter().enumerate() {
                let n = load(&s.bytes[p][m]);
                if n > 0 {
                    out.sample(&[("site", &s.name), ("proto", proto), ("mode", mode)], n);
                }
            }
        }
    }
    out.family(
        "webship_http_requests_in_flight",
        Kind::Gauge,
        "Exchanges begun and not ended, by site and protocol.",
    );
    for s in sites {
        for (p, proto) in PROTOS.iter().enumerate() {
            if s.started[p].iter().any(|a| load(a) > 0) {
                out.sample(&[("site", &s.name), ("proto", proto)], s.in_flight(p));
            }
        }
    }
    let histograms = [
        (
            "webship_http_time_to_first_byte_seconds",
            "From the complete request head to the first pull of the response body, by site and protocol.",
            0,
        ),
        (
            "webship_http_time_to_last_byte_seconds",
            "From the complete request head to the end of the response, by site and protocol.",
            1,
        ),
    ];
    for (name, help, which) in histograms {
        out.family(name, Kind::Histogram, help);
        for s in sites {
            for (p, proto) in PROTOS.iter().enumerate() {
                let h = if which == 0 { &s.ttfb[p] } else { &s.ttlb[p] };
                let snap = h.snapshot();
                if snap.count > 0 {
                    out.histogram(
                        &[("site", &s.name), ("proto", proto)],
                        snap.buckets(),
                        snap.sum,
                        snap.count,
                    );
                }
            }
        }
    }
}

/// The names of the families in an exposition (as its `# TYPE` lines give them).
#[cfg(test)]
fn family_names(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ended(proto: usize, mode: usize, status: u16, bytes: u64) -> Ended {
        Ended {
            proto,
            mode,
            status,
            bytes,
            ttfb: Duration::from_millis(2),
            ttlb: Duration::from_millis(40),
            outcome: 0,
        }
    }

    #[test]
    fn a_site_keeps_its_series_across_a_renumbering_reload() {
        let registry = Registry::new();
        let first = registry.sites(&["a.test".into(), "b.test".into()]);
        first.site(Some(1)).begin(1, 0);
        first.site(Some(1)).end(&ended(1, 0, 200, 1000));
        // The reload drops a.test: b.test is now index 0, and keeps its slot.
        let second = registry.sites(&["b.test".into()]);
        second.site(Some(0)).begin(1, 0);
        second.site(Some(0)).end(&ended(1, 0, 206, 500));
        second.site(None).begin(0, 3);
        let text = registry.render(Format::Prometheus);
        assert!(
            text.contains(
                "webship_http_response_body_bytes_total{site=\"b.test\",proto=\"h2\",mode=\"files\"} 1500\n"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "webship_http_responses_total{site=\"b.test\",proto=\"h2\",mode=\"files\",code=\"2xx\"} 2\n"
            ),
            "{text}"
        );
        assert!(
            text.contains("webship_http_requests_in_flight{site=\"-\",proto=\"h1\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains(
                "webship_http_time_to_last_byte_seconds_bucket{site=\"b.test\",proto=\"h2\",le=\"0.05\"} 2\n"
            ),
            "{text}"
        );
        assert!(
            !text.contains("a.test\",proto"),
            "a.test never served: no series\n{text}"
        );
    }

    #[test]
    fn site_slots_are_bounded() {
        let registry = Registry::new();
        let names: Vec<Arc<str>> = (0..MAX_SITES + 10).map(|i| format!("s{i}.test").into()).collect();
        let sites = registry.sites(&names);
        assert_eq!(registry.sites.all().len(), MAX_SITES + 1);
        assert_eq!(&*sites.site(Some(MAX_SITES + 5)).name, slots::OTHER);
    }

    #[test]
    fn open_connections_are_accepted_less_closed() {
        let registry = Registry::new();
        let c = &registry.connections;
        let _open = Tracked::accepted(c, Transport::Tcp);
        let mut closed = Tracked::accepted(c, Transport::Tcp);
        closed.close(Protocol::H1, Close::SendTimeout);
        drop(closed);
        let _quic = Tracked::accepted(c, Transport::Quic);
        assert_eq!(c.open(), 2, "every transport");
        let text = registry.render(Format::OpenMetrics);
        assert!(
            text.contains("webship_connections_open{transport=\"tcp\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("webship_connections_open{transport=\"quic\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("webship_connections_closed_total{transport=\"tcp\",protocol=\"h1\",reason=\"send_timeout\"} 1\n"),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"));
    }

    /// Every family the registry writes is in docs/metrics.md.
    #[test]
    fn every_family_is_documented() {
        let docs = include_str!("../../../docs/metrics.md");
        let registry = Registry::new();
        let sites = registry.sites(&["a.test".into()]);
        sites.site(Some(0)).begin(0, 0);
        sites.site(Some(0)).end(&ended(0, 0, 200, 1));
        let names = family_names(&registry.render(Format::Prometheus));
        assert!(names.len() > 20, "{names:?}");
        for name in names {
            assert!(
                docs.contains(&format!("`{name}`")),
                "{name} is not in docs/metrics.md"
            );
        }
    }
}
