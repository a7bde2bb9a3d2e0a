//! Configuration: TOML text → raw serde structs (unknown keys rejected) → validation →
//! the typed [`Config`] that the rest of the daemon reads.
//!
//! Every problem is reported before anything binds, naming the file, the key and the
//! fix. Parse errors carry toml's line and column; validation collects every problem
//! it finds instead of stopping at the first.

mod raw;

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use raw::{RawConfig, RawProtocols, RawTls};

/// Where the configuration came from, for messages.
pub const BUILTIN_SOURCE: &str = "<built-in default>";

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// The file it was read from, or [`BUILTIN_SOURCE`].
    pub source: String,
    pub listen: SocketAddr,
    pub workers: usize,
    /// Sites in file order. A site whose domain is [`DomainPattern::Any`] (from the
    /// top-level `root`) is always last.
    pub sites: Vec<Site>,
    pub kernel: Kernel,
    pub limits: Limits,
    pub h2: H2Settings,
    pub h3: H3Settings,
    pub proxy_h2: ProxyH2Settings,
    /// Domains whose TLS connections go to upstreams untouched (never decrypted).
    pub passthrough: Vec<PassthroughRoute>,
    pub passthrough_engine: Engine,
    /// HTTP/3 passthrough: every QUIC datagram on the listen port goes to this origin.
    pub passthrough_udp: Option<UdpPassthrough>,
    pub access_log: bool,
}

/// A TLS passthrough route: connections whose ClientHello names `domain`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PassthroughRoute {
    pub domain: DomainPattern,
    pub upstreams: Vec<SocketAddr>,
    pub connect_timeout: Duration,
}

/// The shared QUIC origin of HTTP/3 passthrough.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdpPassthrough {
    pub upstream: SocketAddr,
    /// A client flow with no datagram either way for this long is forgotten.
    pub flow_idle: Duration,
    pub engine: UdpEngine,
}

/// How HTTP/3 passthrough datagrams travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UdpEngine {
    /// eBPF where it applies (listen address and origin on IPv4 loopback, eBPF
    /// usable), else userspace.
    #[default]
    Auto,
    /// The tc classifier rewrites datagrams in the kernel.
    Ebpf,
    /// The daemon relays every datagram (GRO/GSO batches, one socket per flow).
    Userspace,
}

impl UdpEngine {
    /// Whether the eBPF redirect can carry traffic between these addresses: it
    /// rewrites on the loopback interface and keeps the client's address.
    pub fn ebpf_applies(listen: SocketAddr, upstream: SocketAddr) -> bool {
        matches!((listen, upstream), (SocketAddr::V4(l), SocketAddr::V4(u)) if l.ip().is_loopback() && u.ip().is_loopback())
    }
}

impl fmt::Display for UdpEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Ebpf => "ebpf",
            Self::Userspace => "userspace",
        })
    }
}

impl Config {
    /// The site whose certificate a client with no or an unknown SNI gets: the
    /// catch-all site when there is one, else the first site in the file.
    pub fn default_site(&self) -> usize {
        self.sites
            .iter()
            .position(|s| s.domain == DomainPattern::Any)
            .unwrap_or(0)
    }
}

#[derive(Debug, Clone)]
pub struct Site {
    pub domain: DomainPattern,
    pub serve: Serve,
    pub protocols: Protocols,
    pub tls: TlsSource,
    /// The diagnostic WebTransport endpoint, when the site enables one.
    pub webtransport: Option<WebTransport>,
}

/// A site's bounded WebTransport diagnostic endpoint (`[sites.webtransport]`).
///
/// Every limit closes the offending session with its own WebTransport error code and
/// counts it; none of them is unbounded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebTransport {
    /// The path of the extended CONNECT (a GET there returns the endpoint's counters).
    pub path: String,
    /// Exact `Origin` values a session may come from; `"*"` admits any, and requests
    /// without an `Origin` (non-browser clients) only then.
    pub allowed_origins: Vec<String>,
    /// Which of echo, sink and source clients may ask for (`?mode=`).
    pub modes: Vec<WtMode>,
    /// Concurrent sessions on this site.
    pub max_sessions: usize,
    /// Concurrent streams the client has open in one session.
    pub max_streams_per_session: usize,
    /// The largest capsule accepted (HTTP/3 session control; HTTP/2 carries streams
    /// and datagrams in capsules too).
    pub max_capsule_bytes: usize,
    /// The largest datagram payload accepted or sent.
    pub max_datagram_bytes: usize,
    /// Datagrams a session may send us per second (a one-second token bucket).
    pub max_datagrams_per_sec: u32,
    /// Bytes a session may move, both ways, streams and datagrams together.
    pub max_session_bytes: u64,
    /// A session with no stream or datagram activity for this long is closed.
    pub idle_timeout: Duration,
}

/// What the diagnostic endpoint does with a session's traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WtMode {
    /// Streams and datagrams come back as they arrive.
    Echo,
    /// Everything is counted and discarded; a stream's reply is the session's totals.
    Sink,
    /// Bytes or datagrams are generated on request (see `webtransport::diag`).
    Source,
}

impl WtMode {
    pub fn name(self) -> &'static str {
        match self {
            Self::Echo => "echo",
            Self::Sink => "sink",
            Self::Source => "source",
        }
    }
}

/// What a site does with a request.
#[derive(Debug, Clone)]
pub enum Serve {
    /// Files under this canonical document root.
    Files(PathBuf),
    /// Forward to upstreams; routes sorted by `path_prefix`, longest first.
    Proxy(Vec<Route>),
}

impl fmt::Display for Serve {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Serve::Files(root) => write!(f, "{}", root.display()),
            Serve::Proxy(routes) => {
                let list: Vec<String> = routes
                    .iter()
                    .map(|r| {
                        let ups: Vec<String> = r.upstreams.iter().map(ToString::to_string).collect();
                        format!("{} ⇒ {}", r.path_prefix, ups.join(","))
                    })
                    .collect();
                write!(f, "proxy {}", list.join("; "))
            }
        }
    }
}

/// One `[[reverse_proxy.routes]]` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub path_prefix: String,
    /// Remove `path_prefix` from the path the upstream sees.
    pub strip_prefix: bool,
    pub upstreams: Vec<SocketAddr>,
    pub upstream_protocol: UpstreamProtocol,
    /// Send the upstream's address as `Host` instead of the client's.
    pub rewrite_host: bool,
    pub max_body_bytes: Option<u64>,
    pub max_header_bytes: usize,
    /// Upper-case method names; empty means any.
    pub allowed_methods: Vec<String>,
    /// A pattern ending in `*` matches by prefix, one starting with `*` by suffix,
    /// anything else exactly.
    pub deny_paths: Vec<String>,
    /// Lower-case media types a request body must carry; empty means any.
    pub required_content_types: Vec<String>,
    pub connect_timeout: Duration,
    pub read_timeout: Duration,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpstreamProtocol {
    H1,
    /// HTTP/2 over cleartext TCP, prior knowledge.
    H2c,
    /// HTTP/2 over TLS, the upstreams' certificates checked against `ca` for `name`.
    H2 {
        ca: PathBuf,
        name: String,
    },
}

/// Which host names a site answers for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DomainPattern {
    /// `media.example.com` (stored lowercase).
    Exact(String),
    /// `*.example.com`: any name with at least one more label; stores `.example.com`.
    Wildcard(String),
    /// The top-level `root`: any host no other site claims.
    Any,
}

impl DomainPattern {
    pub fn matches(&self, host: &str) -> bool {
        match self {
            Self::Exact(name) => name.eq_ignore_ascii_case(host),
            Self::Wildcard(suffix) => {
                host.len() > suffix.len()
                    && host.is_char_boundary(host.len() - suffix.len())
                    && host[host.len() - suffix.len()..].eq_ignore_ascii_case(suffix)
            }
            Self::Any => true,
        }
    }
}

impl fmt::Display for DomainPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Exact(name) => f.write_str(name),
            Self::Wildcard(suffix) => write!(f, "*{suffix}"),
            Self::Any => f.write_str("*"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Protocols {
    pub h1: bool,
    pub h2: bool,
    pub h3: bool,
}

impl fmt::Display for Protocols {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = [(self.h1, "h1"), (self.h2, "h2"), (self.h3, "h3")]
            .into_iter()
            .filter_map(|(on, name)| on.then_some(name))
            .collect();
        f.write_str(&names.join("+"))
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TlsSource {
    Files {
        cert: PathBuf,
        key: PathBuf,
    },
    /// Generated at start for these names; only the built-in default uses it.
    SelfSigned {
        names: Vec<String>,
    },
}

/// How a kernel feature is treated by preflight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Policy {
    /// Use it when present, say so in the log.
    Auto,
    /// Refuse to start without it.
    Required,
    /// Never use it, never probe it.
    Off,
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Required => "required",
            Self::Off => "off",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kernel {
    pub ktls: Policy,
    pub bbr: Policy,
    /// eBPF programs (the `sockmap` passthrough engine, kernel counters).
    pub ebpf: Policy,
    /// Where the counter maps are pinned for `webship stats`.
    pub bpf_pin_dir: PathBuf,
}

/// How passthrough moves bytes between the client and the upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    /// Each direction copies its first MiB, then splices (see `passthrough::resolve`).
    #[default]
    Auto,
    /// eBPF `sk_skb` redirection between the two sockets: bytes never reach
    /// userspace.
    Sockmap,
    /// `splice(2)` through a pipe: no copy into userspace buffers.
    Splice,
    /// Userspace reads and writes with large reused buffers.
    Copy,
}

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Sockmap => "sockmap",
            Self::Splice => "splice",
            Self::Copy => "copy",
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_connections: usize,
    pub max_header_bytes: usize,
    pub handshake_timeout: Duration,
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
    /// Longest a response may wait for the client to take any more bytes.
    pub send_timeout: Duration,
    /// How long SIGTERM/SIGINT waits for in-flight responses before exiting.
    pub shutdown_grace: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: 10_000,
            max_header_bytes: 32 * 1024,
            handshake_timeout: Duration::from_secs(10),
            header_read_timeout: Duration::from_secs(15),
            idle_timeout: Duration::from_secs(60),
            send_timeout: Duration::from_secs(60),
            shutdown_grace: Duration::from_secs(30),
        }
    }
}

/// HTTP/2 server settings (`[runtime.settings]` keys `h2_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct H2Settings {
    /// The per-connection TLS write batch: DATA frames collect here before rustls
    /// encrypts them, so a connection never has more than this in flight to TLS.
    pub tls_write_buffer_bytes: usize,
    pub initial_stream_window_bytes: u32,
    pub initial_connection_window_bytes: u32,
    pub max_frame_size_bytes: u32,
    pub max_concurrent_streams: u32,
    /// Bytes one stream may have queued for sending beyond its flow-control window.
    pub max_send_buffer_bytes: usize,
}

impl Default for H2Settings {
    fn default() -> Self {
        Self {
            tls_write_buffer_bytes: 128 * 1024,
            initial_stream_window_bytes: 1024 * 1024,
            initial_connection_window_bytes: 16 * 1024 * 1024,
            max_frame_size_bytes: 64 * 1024,
            max_concurrent_streams: 256,
            max_send_buffer_bytes: 256 * 1024,
        }
    }
}

/// HTTP/3 (QUIC) settings (`[runtime.settings]` keys `h3_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct H3Settings {
    /// Bytes one connection may have queued for sending across all its streams: the
    /// bound on an HTTP/3 connection's send-side memory.
    pub send_window_bytes: u64,
    /// Flow-control windows we grant the client (they limit uploads, not downloads).
    pub stream_receive_window_bytes: u32,
    pub receive_window_bytes: u32,
    pub max_concurrent_streams: u32,
    /// DPLPMTUD probes up to this UDP payload size.
    pub mtu_upper_bound_bytes: u16,
    /// UDP generic segmentation offload (one sendmsg for many datagrams).
    pub gso: bool,
    /// Body bytes after which a response switches its connection to BBR.
    pub bbr_switch_bytes: u64,
    /// Address validation (Retry) for every new connection, not only under load.
    pub always_retry: bool,
}

impl Default for H3Settings {
    fn default() -> Self {
        Self {
            send_window_bytes: 16 * 1024 * 1024,
            stream_receive_window_bytes: 1024 * 1024,
            receive_window_bytes: 8 * 1024 * 1024,
            max_concurrent_streams: 256,
            mtu_upper_bound_bytes: 1452,
            gso: true,
            bbr_switch_bytes: 1024 * 1024,
            always_retry: false,
        }
    }
}

/// Process-wide HTTP/2 settings for proxied streams, validated now, used by the proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProxyH2Settings {
    pub tls_max_send_buffer_bytes: usize,
    pub tls_connection_send_buffer_bytes: usize,
}

impl Default for ProxyH2Settings {
    fn default() -> Self {
        Self {
            tls_max_send_buffer_bytes: 128 * 1024,
            tls_connection_send_buffer_bytes: 128 * 1024 * 256,
        }
    }
}

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: cannot read the configuration: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: String, message: String },
    #[error("{path}: {} problem(s):\n{}", problems.len(), list(problems))]
    Invalid { path: String, problems: Vec<Problem> },
}

/// One validation failure: the key, what is wrong, and how to fix it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub key: String,
    pub problem: String,
    pub fix: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}`: {} (fix: {})", self.key, self.problem, self.fix)
    }
}

fn list(problems: &[Problem]) -> String {
    problems
        .iter()
        .map(|p| format!("  - {p}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Reads and validates a configuration file.
pub fn load(path: &Path) -> Result<Config, ConfigError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: shown.clone(),
        source,
    })?;
    let base = path.parent().unwrap_or(Path::new("."));
    parse(&text, &shown, base)
}

/// Validates configuration text; relative paths in it resolve against `base`.
pub fn parse(text: &str, source: &str, base: &Path) -> Result<Config, ConfigError> {
    let raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
        path: source.to_owned(),
        message: e.to_string().trim_end().to_owned(),
    })?;
    Validator {
        base,
        problems: Vec::new(),
    }
    .validate(raw, source)
}

/// The configuration `webship serve` uses without `--config`: the current directory
/// on loopback with a self-signed certificate generated at start.
pub fn builtin_default(root: &Path) -> Result<Config, ConfigError> {
    let mut problems = Vec::new();
    let root = match check_root(root) {
        Ok(root) => root,
        Err(problem) => {
            problems.push(Problem {
                key: "root".into(),
                problem,
                fix: "run `webship serve` from a readable directory, or pass --config".into(),
            });
            PathBuf::new()
        }
    };
    if !problems.is_empty() {
        return Err(ConfigError::Invalid {
            path: BUILTIN_SOURCE.into(),
            problems,
        });
    }
    Ok(Config {
        source: BUILTIN_SOURCE.into(),
        listen: SocketAddr::from(([127, 0, 0, 1], 8443)),
        workers: default_workers(),
        sites: vec![Site {
            domain: DomainPattern::Any,
            serve: Serve::Files(root),
            protocols: Protocols {
                h1: true,
                h2: true,
                h3: true,
            },
            tls: TlsSource::SelfSigned {
                names: vec!["localhost".into(), "127.0.0.1".into(), "::1".into()],
            },
            webtransport: None,
        }],
        kernel: Kernel {
            ktls: Policy::Auto,
            bbr: Policy::Auto,
            ebpf: Policy::Auto,
            bpf_pin_dir: PathBuf::from(crate::ebpf::DEFAULT_PIN_DIR),
        },
        limits: Limits::default(),
        h2: H2Settings::default(),
        h3: H3Settings::default(),
        proxy_h2: ProxyH2Settings::default(),
        passthrough: Vec::new(),
        passthrough_engine: Engine::Auto,
        passthrough_udp: None,
        access_log: false,
    })
}

fn default_workers() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get())
}

fn check_root(root: &Path) -> Result<PathBuf, String> {
    let canonical = root
        .canonicalize()
        .map_err(|e| format!("`{}` cannot be resolved: {e}", root.display()))?;
    if !canonical.is_dir() {
        return Err(format!("`{}` is not a directory", root.display()));
    }
    std::fs::read_dir(&canonical).map_err(|e| format!("`{}` cannot be listed: {e}", root.display()))?;
    Ok(canonical)
}

struct Validator<'a> {
    base: &'a Path,
    problems: Vec<Problem>,
}

impl Validator<'_> {
    fn problem(&mut self, key: impl Into<String>, problem: impl Into<String>, fix: impl Into<String>) {
        self.problems.push(Problem {
            key: key.into(),
            problem: problem.into(),
            fix: fix.into(),
        });
    }

    fn path(&self, p: &Path) -> PathBuf {
        self.base.join(p)
    }

    fn validate(mut self, raw: RawConfig, source: &str) -> Result<Config, ConfigError> {
        let listen_text = raw.listen.as_deref().unwrap_or("0.0.0.0:443");
        let listen = listen_text.parse::<SocketAddr>().unwrap_or_else(|_| {
            self.problem(
                "listen",
                format!("`{listen_text}` is not an address and port"),
                "write it as \"0.0.0.0:443\" or \"[::]:443\"",
            );
            SocketAddr::from(([0, 0, 0, 0], 443))
        });

        let workers = raw.workers.unwrap_or_else(default_workers);
        if !(1..=1024).contains(&workers) {
            self.problem("workers", format!("{workers} is out of range"), "use 1 to 1024");
        }

        let top_root = raw.root.as_ref().and_then(|r| self.root("root", r));
        let top_tls = raw.tls.as_ref().map(|t| self.tls("tls", t));
        let top_protocols = self.protocols("protocols", raw.protocols);

        let mut sites: Vec<Site> = Vec::new();
        let mut seen: BTreeMap<String, usize> = BTreeMap::new();
        for (i, site) in raw.sites.iter().enumerate() {
            let key = format!("sites[{i}]");
            let Some(domain) = self.domain(&format!("{key}.domain"), &site.domain) else {
                continue;
            };
            let name = domain.to_string();
            if let Some(first) = seen.insert(name.clone(), i) {
                self.problem(
                    format!("{key}.domain"),
                    format!("`{name}` is already the domain of sites[{first}]"),
                    "give each site its own domain, or merge the two sites",
                );
            }
            let root = match &site.root {
                Some(r) => self.root(&format!("{key}.root"), r),
                None if top_root.is_some() => top_root.clone(),
                None => {
                    self.problem(
                        format!("{key}.root"),
                        "the site has no root and there is no top-level `root`",
                        "add `root = \"/srv/...\"` to the site",
                    );
                    None
                }
            };
            let tls = match (&site.tls, &top_tls) {
                (Some(t), _) => Some(self.tls(&format!("{key}.tls"), t)),
                (None, Some(t)) => Some(t.clone()),
                (None, None) => {
                    self.problem(
                        format!("{key}.tls"),
                        "the site has no certificate",
                        "add a [sites.tls] table with `cert` and `key` (PEM files)",
                    );
                    None
                }
            };
            let protocols = match site.protocols {
                Some(p) => self.protocols(&format!("{key}.protocols"), Some(p)),
                None => top_protocols,
            };
            let webtransport = site
                .webtransport
                .as_ref()
                .and_then(|w| self.webtransport(&format!("{key}.webtransport"), w, protocols));
            if let (Some(root), Some(tls)) = (root, tls) {
                sites.push(Site {
                    domain,
                    serve: Serve::Files(root),
                    protocols,
                    tls,
                    webtransport,
                });
            }
        }
        let (passthrough, passthrough_udp) = match &raw.reverse_proxy {
            Some(proxy) => self.reverse_proxy(proxy, &mut sites, &mut seen),
            None => (Vec::new(), None),
        };
        if let Some(root) = top_root {
            let tls = match top_tls {
                Some(tls) => tls,
                None if !sites.is_empty() => sites[0].tls.clone(),
                None => {
                    self.problem(
                        "tls",
                        "the top-level `root` is served without a certificate",
                        "add a top-level [tls] table with `cert` and `key`, or a [[sites]] entry with [sites.tls]",
                    );
                    TlsSource::SelfSigned { names: Vec::new() }
                }
            };
            let webtransport = raw
                .webtransport
                .as_ref()
                .and_then(|w| self.webtransport("webtransport", w, top_protocols));
            sites.push(Site {
                domain: DomainPattern::Any,
                serve: Serve::Files(root),
                protocols: top_protocols,
                tls,
                webtransport,
            });
        } else if sites.is_empty() && passthrough.is_empty() && self.problems.is_empty() {
            self.problem(
                "root",
                "nothing to serve: no top-level `root` and no [[sites]]",
                "add `root = \"/srv/...\"` or at least one [[sites]] table",
            );
        }

        let kernel = raw.kernel.unwrap_or_default();
        let mut kernel = Kernel {
            ktls: kernel.ktls.unwrap_or(Policy::Auto),
            bbr: kernel.bbr.unwrap_or(Policy::Auto),
            ebpf: kernel.ebpf.unwrap_or(Policy::Auto),
            bpf_pin_dir: kernel
                .bpf_pin_dir
                .unwrap_or_else(|| PathBuf::from(crate::ebpf::DEFAULT_PIN_DIR)),
        };
        if !kernel.bpf_pin_dir.is_absolute() {
            self.problem(
                "kernel.bpf_pin_dir",
                format!("`{}` is not an absolute path", kernel.bpf_pin_dir.display()),
                "use a folder under the BPF filesystem, such as \"/sys/fs/bpf/webship\"",
            );
        }
        let passthrough_engine = self.passthrough_engine(&raw.reverse_proxy, &kernel);
        if passthrough_engine == Engine::Sockmap && kernel.ebpf == Policy::Auto {
            // Asking for the eBPF engine by name is asking for eBPF.
            kernel.ebpf = Policy::Required;
        }
        let limits = self.limits(raw.limits.unwrap_or_default());
        let settings = raw.runtime.unwrap_or_default().settings;
        let (h2, h3, proxy_h2) = self.settings(&settings);

        if let Some(udp) = passthrough_udp {
            if udp.engine == UdpEngine::Ebpf && !UdpEngine::ebpf_applies(listen, udp.upstream) {
                self.problem(
                    "reverse_proxy.udp_engine",
                    "the eBPF UDP redirect rewrites datagrams on the loopback interface, so the listen \
                     address and `udp_upstream` must both be IPv4 loopback addresses",
                    "use `udp_engine = \"userspace\"` (or \"auto\"), which relays to any origin",
                );
            }
            if udp.engine == UdpEngine::Ebpf && kernel.ebpf == Policy::Off {
                self.problem(
                    "reverse_proxy.udp_engine",
                    "`ebpf` needs eBPF, which `[kernel] ebpf = \"off\"` forbids",
                    "set `[kernel] ebpf = \"auto\"`, or `udp_engine = \"userspace\"`",
                );
            } else if udp.engine == UdpEngine::Ebpf && kernel.ebpf == Policy::Auto {
                kernel.ebpf = Policy::Required;
            }
        }
        if passthrough_udp.is_some() && sites.iter().any(|s| s.protocols.h3) {
            self.problem(
                "reverse_proxy.udp_upstream",
                "HTTP/3 passthrough takes every datagram on the listen port, so no site can serve h3 there too",
                "set `h3 = false` in the protocols of the sites (or of the top level)",
            );
        }
        if self.problems.is_empty() {
            Ok(Config {
                source: source.to_owned(),
                listen,
                workers,
                sites,
                kernel,
                limits,
                h2,
                h3,
                proxy_h2,
                passthrough,
                passthrough_engine,
                passthrough_udp,
                access_log: raw.log.and_then(|l| l.access).unwrap_or(false),
            })
        } else {
            Err(ConfigError::Invalid {
                path: source.to_owned(),
                problems: self.problems,
            })
        }
    }

    /// Each distinct route domain becomes a proxy site with the proxy's certificate
    /// and protocols; its routes are matched by the longest `path_prefix`.
    fn reverse_proxy(
        &mut self,
        raw: &raw::RawReverseProxy,
        sites: &mut Vec<Site>,
        seen: &mut BTreeMap<String, usize>,
    ) -> (Vec<PassthroughRoute>, Option<UdpPassthrough>) {
        if raw.enabled == Some(false) {
            return (Vec::new(), None);
        }
        if raw.tls_termination == Some(false) {
            return self.passthrough(raw, seen);
        }
        if raw.udp_upstream.is_some() {
            self.problem(
                "reverse_proxy.udp_upstream",
                "only TLS passthrough uses a UDP upstream",
                "remove `udp_upstream`",
            );
        }
        let protocols = self.protocols("reverse_proxy.protocols", raw.protocols);
        let tls = match &raw.tls {
            Some(t) => Some(self.tls("reverse_proxy.tls", t)),
            None => {
                self.problem(
                    "reverse_proxy.tls",
                    "TLS termination needs a certificate",
                    "add a [reverse_proxy.tls] table with `cert` and `key`",
                );
                None
            }
        };
        if raw.routes.is_empty() {
            self.problem(
                "reverse_proxy.routes",
                "the reverse proxy has no routes",
                "add at least one [[reverse_proxy.routes]] with `domain`, `path_prefix` and `upstreams`",
            );
        }
        let mut by_domain: BTreeMap<String, (DomainPattern, Vec<Route>)> = BTreeMap::new();
        for (i, r) in raw.routes.iter().enumerate() {
            let key = format!("reverse_proxy.routes[{i}]");
            let Some(domain) = self.domain(&format!("{key}.domain"), &r.domain) else {
                continue;
            };
            let Some(route) = self.route(&key, r) else {
                continue;
            };
            let name = domain.to_string();
            if let Some(&site) = seen.get(&name) {
                if !by_domain.contains_key(&name) {
                    self.problem(
                        format!("{key}.domain"),
                        format!("`{name}` is already the domain of sites[{site}]"),
                        "serve a domain either from files or through the proxy",
                    );
                    continue;
                }
            }
            let entry = by_domain.entry(name).or_insert_with(|| (domain, Vec::new()));
            if entry.1.iter().any(|other| other.path_prefix == route.path_prefix) {
                self.problem(
                    format!("{key}.path_prefix"),
                    format!(
                        "another route of `{}` already has path_prefix `{}`, so this one is unreachable",
                        r.domain, route.path_prefix
                    ),
                    "give each route of a domain its own path_prefix",
                );
                continue;
            }
            entry.1.push(route);
        }
        let Some(tls) = tls else {
            return (Vec::new(), None);
        };
        for (name, (domain, mut routes)) in by_domain {
            routes.sort_by_key(|r| std::cmp::Reverse(r.path_prefix.len()));
            seen.insert(name, usize::MAX);
            sites.push(Site {
                domain,
                serve: Serve::Proxy(routes),
                protocols,
                tls: tls.clone(),
                webtransport: None,
            });
        }
        (Vec::new(), None)
    }

    fn passthrough_engine(&mut self, raw: &Option<raw::RawReverseProxy>, kernel: &Kernel) -> Engine {
        let Some(raw) = raw else {
            return Engine::Auto;
        };
        let Some(engine) = raw.passthrough_engine else {
            return Engine::Auto;
        };
        if raw.tls_termination != Some(false) {
            self.problem(
                "reverse_proxy.passthrough_engine",
                "only TLS passthrough splices connections",
                "remove `passthrough_engine`, or set `tls_termination = false`",
            );
        }
        if engine == Engine::Sockmap && kernel.ebpf == Policy::Off {
            self.problem(
                "reverse_proxy.passthrough_engine",
                "the `sockmap` engine is eBPF, which `[kernel] ebpf = \"off\"` forbids",
                "set `[kernel] ebpf = \"auto\"` or `\"required\"`, or choose `splice` or `copy`",
            );
        }
        engine
    }

    /// `tls_termination = false`: routes by SNI only; nothing about HTTP applies.
    fn passthrough(
        &mut self,
        raw: &raw::RawReverseProxy,
        seen: &mut BTreeMap<String, usize>,
    ) -> (Vec<PassthroughRoute>, Option<UdpPassthrough>) {
        if raw.tls.is_some() {
            self.problem(
                "reverse_proxy.tls",
                "passthrough never decrypts, so it has no certificate",
                "remove [reverse_proxy.tls] (the upstreams present their own certificates)",
            );
        }
        let protocols = self.protocols("reverse_proxy.protocols", raw.protocols);
        let udp = match (&raw.udp_upstream, protocols.h3) {
            (Some(addr), true) => match addr.parse::<SocketAddr>() {
                Ok(upstream) if upstream.port() != 0 => Some(UdpPassthrough {
                    upstream,
                    flow_idle: Duration::from_secs(raw.udp_flow_idle_secs.unwrap_or(30).max(1)),
                    engine: raw.udp_engine.unwrap_or_default(),
                }),
                _ => {
                    self.problem(
                        "reverse_proxy.udp_upstream",
                        format!("`{addr}` is not an IP address with a port"),
                        "write it as \"10.0.0.20:443\" or \"[::1]:443\"",
                    );
                    None
                }
            },
            (None, true) => {
                self.problem(
                    "reverse_proxy.udp_upstream",
                    "HTTP/3 passthrough needs the QUIC origin every datagram goes to",
                    "add `udp_upstream = \"host:port\"` to [reverse_proxy], or set `h3 = false` in its protocols",
                );
                None
            }
            (Some(_), false) => {
                self.problem(
                    "reverse_proxy.udp_upstream",
                    "set, but HTTP/3 passthrough is off",
                    "set `h3 = true` in [reverse_proxy.protocols], or remove `udp_upstream`",
                );
                None
            }
            (None, false) => None,
        };
        for (name, present) in [
            ("udp_flow_idle_secs", raw.udp_flow_idle_secs.is_some()),
            ("udp_engine", raw.udp_engine.is_some()),
        ] {
            if present && raw.udp_upstream.is_none() {
                self.problem(
                    format!("reverse_proxy.{name}"),
                    "applies to HTTP/3 passthrough, which is not configured",
                    "remove it, or add `udp_upstream`",
                );
            }
        }
        if raw.routes.is_empty() {
            self.problem(
                "reverse_proxy.routes",
                "passthrough has no routes",
                "add at least one [[reverse_proxy.routes]] with `domain` and `upstreams`",
            );
        }
        let mut out: Vec<PassthroughRoute> = Vec::new();
        for (i, r) in raw.routes.iter().enumerate() {
            let key = format!("reverse_proxy.routes[{i}]");
            if r.path_prefix.as_deref().is_some_and(|p| p != "/") {
                self.problem(
                    format!("{key}.path_prefix"),
                    "passthrough routes by SNI alone: it never sees a path",
                    "use `path_prefix = \"/\"` or leave it out",
                );
            }
            let http_only = [
                ("strip_prefix", r.strip_prefix.is_some()),
                ("upstream_protocol", r.upstream_protocol.is_some()),
                ("host", r.host.is_some()),
                ("max_body_bytes", r.max_body_bytes.is_some()),
                ("max_header_bytes", r.max_header_bytes.is_some()),
                ("allowed_methods", r.allowed_methods.is_some()),
                ("deny_paths", r.deny_paths.is_some()),
                ("required_content_types", r.required_content_types.is_some()),
                ("read_timeout_secs", r.read_timeout_secs.is_some()),
            ];
            for (name, present) in http_only {
                if present {
                    self.problem(
                        format!("{key}.{name}"),
                        "applies to HTTP, which passthrough never sees",
                        format!("remove `{name}`, or set `tls_termination = true`"),
                    );
                }
            }
            let Some(domain) = self.domain(&format!("{key}.domain"), &r.domain) else {
                continue;
            };
            let name = domain.to_string();
            if let Some(&site) = seen.get(&name) {
                self.problem(
                    format!("{key}.domain"),
                    if site == usize::MAX {
                        format!("`{name}` already has a passthrough route")
                    } else {
                        format!("`{name}` is already the domain of sites[{site}]")
                    },
                    "give each domain one way to be served",
                );
                continue;
            }
            seen.insert(name, usize::MAX);
            let upstreams = self.upstreams(&key, &r.upstreams);
            out.push(PassthroughRoute {
                domain,
                upstreams,
                connect_timeout: Duration::from_millis(r.connect_timeout_ms.unwrap_or(3_000).max(1)),
            });
        }
        (out, udp)
    }

    fn route(&mut self, key: &str, r: &raw::RawRoute) -> Option<Route> {
        let before = self.problems.len();
        let path_prefix = r.path_prefix.clone().unwrap_or_else(|| "/".into());
        if !path_prefix.starts_with('/') {
            self.problem(
                format!("{key}.path_prefix"),
                format!("`{path_prefix}` does not start with `/`"),
                "write it as \"/api/\"",
            );
        }
        let upstreams = self.upstreams(key, &r.upstreams);
        let upstream_protocol = match r.upstream_protocol.as_deref() {
            None | Some("h1") => UpstreamProtocol::H1,
            Some("h2c") => UpstreamProtocol::H2c,
            Some("h2") => {
                let name = r
                    .upstream_tls_name
                    .clone()
                    .unwrap_or_else(|| r.domain.trim_start_matches("*.").to_ascii_lowercase());
                match &r.upstream_ca {
                    Some(ca) => {
                        let ca = self.path(ca);
                        if let Err(e) = std::fs::File::open(&ca) {
                            self.problem(
                                format!("{key}.upstream_ca"),
                                format!("cannot open `{}`: {e}", ca.display()),
                                "point it at a readable PEM file",
                            );
                        }
                        UpstreamProtocol::H2 { ca, name }
                    }
                    None => {
                        self.problem(
                            format!("{key}.upstream_ca"),
                            "HTTP/2 over TLS to the upstreams needs the CA that signs their certificates",
                            "add `upstream_ca = \"/etc/webship/origin-ca.pem\"`",
                        );
                        UpstreamProtocol::H1
                    }
                }
            }
            Some(other) => {
                self.problem(
                    format!("{key}.upstream_protocol"),
                    format!("`{other}` is not supported"),
                    "use \"h1\", \"h2c\" or \"h2\"",
                );
                UpstreamProtocol::H1
            }
        };
        let rewrite_host = match r.host.as_deref() {
            None | Some("preserve") => false,
            Some("upstream") => true,
            Some(other) => {
                self.problem(
                    format!("{key}.host"),
                    format!("`{other}` is not a host policy"),
                    "use \"preserve\" or \"upstream\"",
                );
                false
            }
        };
        let mut allowed_methods = Vec::new();
        for m in r.allowed_methods.iter().flatten() {
            if http::Method::from_bytes(m.as_bytes()).is_err() || m.is_empty() {
                self.problem(
                    format!("{key}.allowed_methods"),
                    format!("`{m}` is not a method"),
                    "use names like \"GET\"",
                );
            }
            allowed_methods.push(m.to_ascii_uppercase());
        }
        let max_header_bytes = r.max_header_bytes.unwrap_or(64 * 1024);
        if !(1024..=1024 * 1024).contains(&max_header_bytes) {
            self.problem(
                format!("{key}.max_header_bytes"),
                "out of range",
                "use 1024 to 1048576",
            );
        }
        let connect_timeout = Duration::from_millis(r.connect_timeout_ms.unwrap_or(3_000));
        let read_timeout = Duration::from_secs(r.read_timeout_secs.unwrap_or(60));
        if connect_timeout.is_zero() || read_timeout.is_zero() {
            self.problem(
                key,
                "a timeout of zero",
                "use a positive connect_timeout_ms and read_timeout_secs",
            );
        }
        (self.problems.len() == before).then(|| Route {
            path_prefix,
            strip_prefix: r.strip_prefix.unwrap_or(false),
            upstreams,
            upstream_protocol,
            rewrite_host,
            max_body_bytes: r.max_body_bytes,
            max_header_bytes,
            allowed_methods,
            deny_paths: r.deny_paths.clone().unwrap_or_default(),
            required_content_types: r
                .required_content_types
                .iter()
                .flatten()
                .map(|t| t.to_ascii_lowercase())
                .collect(),
            connect_timeout,
            read_timeout,
        })
    }

    /// A route's `upstreams`: IP:port each, at least one.
    fn upstreams(&mut self, key: &str, list: &[String]) -> Vec<SocketAddr> {
        if list.is_empty() {
            self.problem(
                format!("{key}.upstreams"),
                "the route has no upstreams",
                "list at least one, e.g. [\"10.0.0.20:8080\"]",
            );
        }
        let mut out = Vec::with_capacity(list.len());
        for (j, u) in list.iter().enumerate() {
            match u.parse::<SocketAddr>() {
                Ok(addr) if addr.port() != 0 => out.push(addr),
                _ => self.problem(
                    format!("{key}.upstreams[{j}]"),
                    format!("`{u}` is not an IP address with a port"),
                    "write it as \"10.0.0.20:8080\" or \"[::1]:8080\"",
                ),
            }
        }
        out
    }

    fn root(&mut self, key: &str, root: &Path) -> Option<PathBuf> {
        match check_root(&self.path(root)) {
            Ok(p) => Some(p),
            Err(problem) => {
                self.problem(
                    key,
                    problem,
                    "point it at an existing directory this user can read",
                );
                None
            }
        }
    }

    fn tls(&mut self, key: &str, tls: &RawTls) -> TlsSource {
        let cert = self.path(&tls.cert);
        let key_path = self.path(&tls.key);
        for (name, path) in [("cert", &cert), ("key", &key_path)] {
            if let Err(e) = std::fs::File::open(path) {
                self.problem(
                    format!("{key}.{name}"),
                    format!("cannot open `{}`: {e}", path.display()),
                    format!("point `{name}` at a readable PEM file"),
                );
            }
        }
        TlsSource::Files { cert, key: key_path }
    }

    fn domain(&mut self, key: &str, domain: &str) -> Option<DomainPattern> {
        let lower = domain.trim_end_matches('.').to_ascii_lowercase();
        let (wildcard, name) = match lower.strip_prefix("*.") {
            Some(rest) => (true, rest),
            None => (false, lower.as_str()),
        };
        let valid = !name.is_empty()
            && name.len() <= 253
            && name.split('.').all(|label| {
                !label.is_empty()
                    && label.len() <= 63
                    && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                    && !label.starts_with('-')
                    && !label.ends_with('-')
            });
        if !valid {
            self.problem(
                key,
                format!("`{domain}` is not a host name"),
                "use a name such as \"media.example.com\" or \"*.example.com\"",
            );
            return None;
        }
        Some(if wildcard {
            DomainPattern::Wildcard(format!(".{name}"))
        } else {
            DomainPattern::Exact(name.to_owned())
        })
    }

    fn protocols(&mut self, key: &str, raw: Option<RawProtocols>) -> Protocols {
        let raw = raw.unwrap_or(RawProtocols {
            h1: None,
            h2: None,
            h3: None,
        });
        let p = Protocols {
            h1: raw.h1.unwrap_or(true),
            h2: raw.h2.unwrap_or(true),
            h3: raw.h3.unwrap_or(true),
        };
        if !p.h1 && !p.h2 && !p.h3 {
            self.problem(
                key,
                "every protocol is disabled",
                "set at least one of h1, h2, h3 to true",
            );
        }
        p
    }

    fn webtransport(
        &mut self,
        key: &str,
        raw: &raw::RawWebTransport,
        protocols: Protocols,
    ) -> Option<WebTransport> {
        let problems = self.problems.len();
        if !protocols.h3 && !protocols.h2 {
            self.problem(
                key,
                "WebTransport needs HTTP/3 or HTTP/2, and the site serves neither",
                "enable h3 (and h2 for the older clients) in the site's protocols",
            );
        }
        let path = raw.path.clone().unwrap_or_else(|| "/webtransport".into());
        if !path.starts_with('/') || path.contains(['?', '#']) || path.contains(char::is_whitespace) {
            self.problem(
                format!("{key}.path"),
                format!("`{path}` is not a plain absolute path"),
                "use a path such as \"/webtransport\" (no query, no spaces)",
            );
        }
        let allowed_origins = raw.allowed_origins.clone().unwrap_or_default();
        if allowed_origins.is_empty() {
            self.problem(
                format!("{key}.allowed_origins"),
                "no origin may open a session",
                "list the origins, such as [\"https://app.example.com\"], or [\"*\"] for any",
            );
        }
        for origin in &allowed_origins {
            let ok = origin == "*"
                || http::Uri::try_from(origin.as_str()).is_ok_and(|u| {
                    u.scheme().is_some() && u.host().is_some() && u.path() == "/" && !origin.ends_with('/')
                });
            if !ok {
                self.problem(
                    format!("{key}.allowed_origins"),
                    format!("`{origin}` is not an origin"),
                    "write scheme://host[:port] with no path, as browsers send it, or \"*\"",
                );
            }
        }
        let modes = raw
            .modes
            .clone()
            .unwrap_or_else(|| vec![WtMode::Echo, WtMode::Sink, WtMode::Source]);
        if modes.is_empty() {
            self.problem(
                format!("{key}.modes"),
                "no mode is allowed",
                "allow at least one of \"echo\", \"sink\", \"source\"",
            );
        }
        let mut range = |name: &str, v: Option<u64>, default: u64, lo: u64, hi: u64| -> u64 {
            match v {
                None => default,
                Some(v) if (lo..=hi).contains(&v) => v,
                Some(v) => {
                    self.problem(
                        format!("{key}.{name}"),
                        format!("{v} is out of range"),
                        format!("use {lo} to {hi}"),
                    );
                    default
                }
            }
        };
        let wt = WebTransport {
            path,
            allowed_origins,
            modes,
            max_sessions: range("max_sessions", raw.max_sessions.map(|v| v as u64), 16, 1, 100_000) as usize,
            max_streams_per_session: range(
                "max_streams_per_session",
                raw.max_streams_per_session.map(|v| v as u64),
                32,
                1,
                10_000,
            ) as usize,
            max_capsule_bytes: range(
                "max_capsule_bytes",
                raw.max_capsule_bytes.map(|v| v as u64),
                64 * 1024,
                1024,
                16 * 1024 * 1024,
            ) as usize,
            max_datagram_bytes: range(
                "max_datagram_bytes",
                raw.max_datagram_bytes.map(|v| v as u64),
                1200,
                16,
                65_535,
            ) as usize,
            max_datagrams_per_sec: range(
                "max_datagrams_per_sec",
                raw.max_datagrams_per_sec.map(u64::from),
                100_000,
                1,
                10_000_000,
            ) as u32,
            max_session_bytes: range("max_session_bytes", raw.max_session_bytes, 1 << 30, 1, u64::MAX),
            idle_timeout: Duration::from_secs(range(
                "idle_timeout_secs",
                raw.idle_timeout_secs,
                30,
                1,
                86_400,
            )),
        };
        (self.problems.len() == problems).then_some(wt)
    }

    fn limits(&mut self, raw: raw::RawLimits) -> Limits {
        let d = Limits::default();
        let mut secs = |name: &str, v: Option<u64>, default: Duration| -> Duration {
            match v {
                None => default,
                Some(0) | Some(86_401..) => {
                    self.problem(format!("limits.{name}"), "out of range", "use 1 to 86400 seconds");
                    default
                }
                Some(s) => Duration::from_secs(s),
            }
        };
        let handshake_timeout = secs(
            "handshake_timeout_secs",
            raw.handshake_timeout_secs,
            d.handshake_timeout,
        );
        let header_read_timeout = secs(
            "header_read_timeout_secs",
            raw.header_read_timeout_secs,
            d.header_read_timeout,
        );
        let idle_timeout = secs("idle_timeout_secs", raw.idle_timeout_secs, d.idle_timeout);
        let send_timeout = secs("send_timeout_secs", raw.send_timeout_secs, d.send_timeout);
        let shutdown_grace = secs("shutdown_grace_secs", raw.shutdown_grace_secs, d.shutdown_grace);
        let max_connections = raw.max_connections.unwrap_or(d.max_connections);
        if !(1..=1_000_000).contains(&max_connections) {
            self.problem("limits.max_connections", "out of range", "use 1 to 1000000");
        }
        let max_header_bytes = raw.max_header_bytes.unwrap_or(d.max_header_bytes);
        if !(1024..=1024 * 1024).contains(&max_header_bytes) {
            self.problem("limits.max_header_bytes", "out of range", "use 1024 to 1048576");
        }
        Limits {
            max_connections,
            max_header_bytes,
            handshake_timeout,
            header_read_timeout,
            idle_timeout,
            send_timeout,
            shutdown_grace,
        }
    }

    fn settings(&mut self, settings: &BTreeMap<String, String>) -> (H2Settings, H3Settings, ProxyH2Settings) {
        let mut h2 = H2Settings::default();
        let mut h3 = H3Settings::default();
        let mut proxy = ProxyH2Settings::default();
        for (name, value) in settings {
            let key = format!("runtime.settings.{name}");
            let Some(spec) = SETTINGS.iter().find(|s| s.name == name) else {
                let known: Vec<&str> = SETTINGS.iter().map(|s| s.name).collect();
                self.problem(
                    key,
                    "unknown setting",
                    format!("use one of: {}", known.join(", ")),
                );
                continue;
            };
            let parsed = value.trim().parse::<u64>().ok();
            let Some(n) = parsed.filter(|n| (spec.min..=spec.max).contains(n)) else {
                self.problem(
                    key,
                    format!(
                        "`{value}` is not a whole number from {} to {}",
                        spec.min, spec.max
                    ),
                    format!("write it as a quoted number, e.g. \"{}\"", spec.example),
                );
                continue;
            };
            // The ranges above keep every value inside its target type.
            let as_u32 = u32::try_from(n).unwrap_or(u32::MAX);
            let as_usize = usize::try_from(n).unwrap_or(usize::MAX);
            match spec.name {
                "h2_tls_write_buffer_bytes" => h2.tls_write_buffer_bytes = as_usize,
                "h2_initial_stream_window_bytes" => h2.initial_stream_window_bytes = as_u32,
                "h2_initial_connection_window_bytes" => h2.initial_connection_window_bytes = as_u32,
                "h2_max_frame_size_bytes" => h2.max_frame_size_bytes = as_u32,
                "h2_max_concurrent_streams" => h2.max_concurrent_streams = as_u32,
                "h2_max_send_buffer_bytes" => h2.max_send_buffer_bytes = as_usize,
                "h3_send_window_bytes" => h3.send_window_bytes = n,
                "h3_stream_receive_window_bytes" => h3.stream_receive_window_bytes = as_u32,
                "h3_receive_window_bytes" => h3.receive_window_bytes = as_u32,
                "h3_max_concurrent_streams" => h3.max_concurrent_streams = as_u32,
                "h3_mtu_upper_bound_bytes" => h3.mtu_upper_bound_bytes = u16::try_from(n).unwrap_or(u16::MAX),
                "h3_gso" => h3.gso = n == 1,
                "h3_bbr_switch_bytes" => h3.bbr_switch_bytes = n,
                "h3_retry" => h3.always_retry = n == 1,
                "proxy_h2_tls_max_send_buffer_bytes" => proxy.tls_max_send_buffer_bytes = as_usize,
                "proxy_h2_tls_connection_send_buffer_bytes" => {
                    proxy.tls_connection_send_buffer_bytes = as_usize
                }
                _ => unreachable!("every entry of SETTINGS is matched"),
            }
        }
        if h2.initial_connection_window_bytes < h2.initial_stream_window_bytes {
            self.problem(
                "runtime.settings.h2_initial_connection_window_bytes",
                "smaller than h2_initial_stream_window_bytes, so one stream could never use its window",
                "make the connection window at least the stream window",
            );
        }
        if proxy.tls_connection_send_buffer_bytes < proxy.tls_max_send_buffer_bytes {
            self.problem(
                "runtime.settings.proxy_h2_tls_connection_send_buffer_bytes",
                "smaller than proxy_h2_tls_max_send_buffer_bytes (the per-stream buffer)",
                "make the connection budget at least one stream's buffer (e.g. 131072 x streams)",
            );
        }
        (h2, h3, proxy)
    }
}

struct SettingSpec {
    name: &'static str,
    min: u64,
    max: u64,
    example: &'static str,
}

/// The `[runtime.settings]` keys this build knows; values are strings holding numbers.
const SETTINGS: &[SettingSpec] = &[
    SettingSpec {
        name: "h2_tls_write_buffer_bytes",
        min: 16 * 1024,
        max: 16 * 1024 * 1024,
        example: "131072",
    },
    SettingSpec {
        name: "h2_initial_stream_window_bytes",
        min: 65_535,
        max: (1 << 31) - 1,
        example: "1048576",
    },
    SettingSpec {
        name: "h2_initial_connection_window_bytes",
        min: 65_535,
        max: (1 << 31) - 1,
        example: "16777216",
    },
    SettingSpec {
        name: "h2_max_frame_size_bytes",
        min: 16_384,
        max: (1 << 24) - 1,
        example: "65536",
    },
    SettingSpec {
        name: "h2_max_concurrent_streams",
        min: 1,
        max: 10_000,
        example: "256",
    },
    SettingSpec {
        name: "h2_max_send_buffer_bytes",
        min: 16 * 1024,
        max: 64 * 1024 * 1024,
        example: "262144",
    },
    SettingSpec {
        name: "h3_send_window_bytes",
        min: 64 * 1024,
        max: 1024 * 1024 * 1024,
        example: "16777216",
    },
    SettingSpec {
        name: "h3_stream_receive_window_bytes",
        min: 16 * 1024,
        max: 1 << 30,
        example: "1048576",
    },
    SettingSpec {
        name: "h3_receive_window_bytes",
        min: 16 * 1024,
        max: 1 << 30,
        example: "8388608",
    },
    SettingSpec {
        name: "h3_max_concurrent_streams",
        min: 1,
        max: 10_000,
        example: "256",
    },
    SettingSpec {
        name: "h3_mtu_upper_bound_bytes",
        min: 1200,
        max: 65_527,
        example: "1452",
    },
    SettingSpec {
        name: "h3_gso",
        min: 0,
        max: 1,
        example: "1",
    },
    SettingSpec {
        name: "h3_bbr_switch_bytes",
        min: 0,
        max: 1 << 40,
        example: "1048576",
    },
    SettingSpec {
        name: "h3_retry",
        min: 0,
        max: 1,
        example: "0",
    },
    SettingSpec {
        name: "proxy_h2_tls_max_send_buffer_bytes",
        min: 16 * 1024,
        max: 64 * 1024 * 1024,
        example: "131072",
    },
    SettingSpec {
        name: "proxy_h2_tls_connection_send_buffer_bytes",
        min: 16 * 1024,
        max: 4 * 1024 * 1024 * 1024,
        example: "33554432",
    },
];

#[cfg(test)]
mod tests;
