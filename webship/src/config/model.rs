//! The typed configuration the daemon runs on: what `validate` produces from the raw
//! file and what every other module reads. Nothing here parses or checks; a value of
//! these types has already passed validation.
//!
//! The `[runtime.settings]` structs take their defaults from the key table in
//! `settings.rs`, next to each key's name and range.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// The file it was read from, or [`BUILTIN_SOURCE`](super::BUILTIN_SOURCE).
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
    /// A passthrough connection that carries no data either way for this long is
    /// closed (`[reverse_proxy] passthrough_idle_timeout_secs`).
    pub passthrough_idle_timeout: Duration,
    /// HTTP/3 passthrough: every QUIC datagram on the listen port goes to this origin.
    pub passthrough_udp: Option<UdpPassthrough>,
    /// `[log]`: the access log.
    pub access_log: AccessLog,
    /// Sources (load balancers) whose connections start with a PROXY protocol
    /// header carrying the client's address; empty: none may send one.
    pub accept_proxy_protocol: Vec<IpNet>,
    /// The service account to switch to once bound (`None`: stay as started).
    pub user: Option<String>,
    /// Its group (`None`: the user's primary group).
    pub group: Option<String>,
    /// The control socket (`webship reload`, `--takeover`); `None` for the built-in
    /// configuration, which has no file to reload.
    pub control_socket: Option<PathBuf>,
    /// The admin listener (`/metrics`, `/healthz`, `/readyz`); `None`: none.
    pub admin: Option<Admin>,
}

/// `[admin]`: plain HTTP/1.1 for metrics scrapers and health checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admin {
    pub listen: SocketAddr,
    /// The file of the bearer token requests must carry (`Authorization: Bearer`);
    /// required for a non-loopback `listen`, read once at start.
    pub token_file: Option<PathBuf>,
}

/// `[log]`: whether exchanges are logged, how, where, and how many of them.
#[derive(Debug, Clone, PartialEq)]
pub struct AccessLog {
    /// `access`: the switch (off by default).
    pub enabled: bool,
    /// `access_format`.
    pub format: AccessFormat,
    /// `access_path`: the file (absolute once validated); `None` writes to standard
    /// error.
    pub path: Option<PathBuf>,
    /// `access_sample`: the share of exchanges logged (0 to 1) on sites that set no
    /// rate of their own.
    pub sample: f64,
}

impl Default for AccessLog {
    fn default() -> Self {
        Self {
            enabled: false,
            format: AccessFormat::Combined,
            path: None,
            sample: 1.0,
        }
    }
}

/// `access_format`: one line per exchange, in nginx's `combined` format (what log
/// analysers read without configuration) or as a JSON object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AccessFormat {
    #[default]
    Combined,
    Json,
}

impl fmt::Display for AccessFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Combined => "combined",
            Self::Json => "json",
        })
    }
}

/// The folder of the default control sockets (systemd's `RuntimeDirectory=webship`).
pub const CONTROL_DIR: &str = "/run/webship";

/// The control socket of a daemon listening on `port` when the file names none:
/// one per port, so daemons on different ports never collide, and a new process on
/// the same port finds the one it takes over.
pub fn default_control_socket(port: u16) -> PathBuf {
    PathBuf::from(CONTROL_DIR).join(format!("{port}.sock"))
}

/// A TLS passthrough route: connections whose ClientHello names `domain`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PassthroughRoute {
    pub domain: DomainPattern,
    pub upstreams: Vec<SocketAddr>,
    pub connect_timeout: Duration,
    /// The PROXY protocol header written to the upstream before the client's bytes.
    pub proxy_protocol: Option<ProxyProtocol>,
}

/// A PROXY protocol version (HAProxy's "The PROXY protocol": v1 is one text line,
/// v2 a binary block).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyProtocol {
    V1,
    V2,
}

impl fmt::Display for ProxyProtocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::V1 => "v1",
            Self::V2 => "v2",
        })
    }
}

/// The shared QUIC origin of HTTP/3 passthrough.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdpPassthrough {
    pub upstream: SocketAddr,
    /// A client flow with no datagram either way for this long is forgotten.
    pub flow_idle: Duration,
    pub engine: UdpEngine,
    /// Flows one client IP address may hold at once.
    pub max_flows_per_address: usize,
}

/// nginx stream's `proxy_timeout` default: ten minutes without data either way.
pub(crate) const DEFAULT_PASSTHROUGH_IDLE: Duration = Duration::from_secs(600);
/// UDP passthrough flows per client address unless `udp_max_flows_per_address`
/// says otherwise.
pub(crate) const DEFAULT_UDP_FLOWS_PER_ADDRESS: usize = 64;

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
    /// Whether a file site serves paths with a segment that starts with `.`. Read
    /// only for `Serve::Files`: a proxy site forwards such paths like any other.
    pub dotfiles: Dotfiles,
    /// `[sites.log]`: the share of this site's exchanges the access log keeps (0 to
    /// 1; `access = false` is 0); `None` takes `[log] access_sample`.
    pub access_sample: Option<f64>,
}

/// `dotfiles`: what a file site does with `/.git/config`, `/.env`, `/a/.htpasswd`.
/// `/.well-known/` is served either way (RFC 8615: ACME challenges live there).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dotfiles {
    /// 404, as if the file did not exist (nginx's customary `location ~ /\.` rule,
    /// Caddy's `hide`; 404 rather than 403 tells nothing about what exists).
    #[default]
    Deny,
    /// Served like any other file.
    Allow,
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
    /// The TCP (and TLS) connect to one upstream.
    pub connect_timeout: Duration,
    /// From the end of the request (its body sent) to the response head.
    pub response_timeout: Duration,
    /// The longest pause between body bytes, either way: the client's upload and
    /// the upstream's response body.
    pub body_idle_timeout: Duration,
    /// Connections to one upstream of this route, in use or idle.
    pub max_connections_per_upstream: usize,
    /// How long a request waits for a free connection (then 503).
    pub queue_timeout: Duration,
    /// Peers whose `X-Forwarded-*`, `Forwarded`, `X-Real-IP` and `True-Client-IP`
    /// are kept (the `[reverse_proxy]` list, on every route).
    pub trusted_proxies: Vec<IpNet>,
}

/// An address block of `trusted_proxies` or `accept_proxy_protocol`: `10.0.0.0/8`,
/// `::1/128`, or one address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpNet {
    addr: IpAddr,
    prefix: u8,
}

impl IpNet {
    /// `ADDR/LEN` or `ADDR`; `None` when either part is wrong or host bits are set.
    pub fn parse(text: &str) -> Option<IpNet> {
        let (addr, prefix) = match text.split_once('/') {
            Some((a, p)) => (a.parse::<IpAddr>().ok()?, p.parse::<u8>().ok()?),
            None => {
                let a = text.parse::<IpAddr>().ok()?;
                (a, if a.is_ipv4() { 32 } else { 128 })
            }
        };
        let net = IpNet { addr, prefix };
        let max = if addr.is_ipv4() { 32 } else { 128 };
        (prefix <= max && net.contains(addr) && net.mask(addr) == net.bits()).then_some(net)
    }

    fn bits(&self) -> u128 {
        match self.addr {
            IpAddr::V4(a) => u128::from(u32::from(a)),
            IpAddr::V6(a) => u128::from(a),
        }
    }

    fn mask(&self, ip: IpAddr) -> u128 {
        let (value, width) = match ip {
            IpAddr::V4(a) => (u128::from(u32::from(a)), 32u32),
            IpAddr::V6(a) => (u128::from(a), 128),
        };
        let host_bits = width - u32::from(self.prefix).min(width);
        value
            .checked_shr(host_bits)
            .unwrap_or(0)
            .checked_shl(host_bits)
            .unwrap_or(0)
    }

    /// Whether `ip` (an IPv4-mapped IPv6 address counts as IPv4) is in the block.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        ip.is_ipv4() == self.addr.is_ipv4() && self.mask(ip) == self.mask(self.addr)
    }
}

impl fmt::Display for IpNet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
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

/// Where the eBPF counter maps are pinned unless `[kernel] bpf_pin_dir` says otherwise.
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/webship";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kernel {
    pub ktls: Policy,
    pub bbr: Policy,
    /// eBPF programs (the `sockmap` passthrough engine, kernel counters).
    pub ebpf: Policy,
    /// Kernel-side TCP health per site (a sock_ops program on the daemon's cgroup);
    /// needs `ebpf`. Off unless asked for.
    pub tcp_health: Policy,
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
    /// Whether the file set `max_connections`: a default that does not fit the
    /// open-file limit is lowered to fit, a configured one refuses to start.
    pub max_connections_configured: bool,
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
            max_connections_configured: false,
            max_header_bytes: 32 * 1024,
            handshake_timeout: Duration::from_secs(10),
            header_read_timeout: Duration::from_secs(15),
            idle_timeout: Duration::from_secs(60),
            send_timeout: Duration::from_secs(60),
            shutdown_grace: Duration::from_secs(30),
        }
    }
}

/// HTTP/2 server settings (`[runtime.settings]` keys `h2_*`; defaults and ranges in
/// `settings.rs`).
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

/// HTTP/3 (QUIC) settings (`[runtime.settings]` keys `h3_*`; defaults and ranges in
/// `settings.rs`).
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

/// Process-wide HTTP/2 settings for proxied streams, validated now, used by the proxy
/// (`[runtime.settings]` keys `proxy_h2_*`; defaults and ranges in `settings.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProxyH2Settings {
    pub tls_max_send_buffer_bytes: usize,
    pub tls_connection_send_buffer_bytes: usize,
}
