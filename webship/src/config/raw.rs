//! The configuration file exactly as written: serde structs that reject unknown keys.
//! Nothing outside `config` sees these; `super::validate` turns them into `Config`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Deserialize;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    pub listen: Option<String>,
    pub workers: Option<usize>,
    /// The service account to switch to after binding.
    pub user: Option<String>,
    pub group: Option<String>,
    /// Where `webship reload` and a taking-over process reach the daemon.
    pub control_socket: Option<PathBuf>,
    pub root: Option<PathBuf>,
    /// The default of every file site, and the top-level `root` site's own.
    pub dotfiles: Option<super::Dotfiles>,
    pub tls: Option<RawTopTls>,
    pub protocols: Option<RawProtocols>,
    #[serde(default)]
    pub sites: Vec<RawSite>,
    pub kernel: Option<RawKernel>,
    pub limits: Option<RawLimits>,
    pub log: Option<RawLog>,
    pub runtime: Option<RawRuntime>,
    pub reverse_proxy: Option<RawReverseProxy>,
    /// The diagnostic WebTransport endpoint of the top-level `root` site.
    pub webtransport: Option<RawWebTransport>,
    /// Sources (CIDR blocks) that must start their connections with a PROXY header.
    pub accept_proxy_protocol: Option<Vec<String>>,
    /// The admin listener (metrics, health).
    pub admin: Option<RawAdmin>,
    /// Where fetched OCSP responses are kept across restarts.
    pub ocsp_cache: Option<PathBuf>,
    /// Where ACME accounts, keys and certificates are kept.
    pub acme: Option<RawAcme>,
}

/// `[acme]`: what every site with `[sites.acme]` shares.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAcme {
    pub storage: PathBuf,
    /// The plain-HTTP listener (port 80) that answers http-01 challenges.
    pub http_listen: Option<String>,
}

/// `[sites.acme]`: the site's certificate comes from this ACME server.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSiteAcme {
    pub directory: String,
    pub email: Option<String>,
    pub challenge: Option<String>,
    /// A PEM CA the ACME server's own HTTPS certificate must chain to.
    pub directory_ca: Option<PathBuf>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAdmin {
    pub listen: String,
    /// A non-loopback address must be allowed explicitly (and needs a token).
    pub allow_remote: Option<bool>,
    /// A file holding the bearer token every request must carry.
    pub token_file: Option<PathBuf>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawReverseProxy {
    pub enabled: Option<bool>,
    pub tls_termination: Option<bool>,
    pub protocols: Option<RawProtocols>,
    pub tls: Option<RawTls>,
    /// Passthrough's shared QUIC origin.
    pub udp_upstream: Option<String>,
    pub passthrough_engine: Option<super::Engine>,
    pub passthrough_idle_timeout_secs: Option<u64>,
    pub udp_flow_idle_secs: Option<u64>,
    pub udp_max_flows_per_address: Option<usize>,
    pub udp_engine: Option<super::UdpEngine>,
    /// Peers (CIDR blocks) whose forwarding fields are kept and extended.
    pub trusted_proxies: Option<Vec<String>>,
    #[serde(default)]
    pub routes: Vec<RawRoute>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRoute {
    pub domain: String,
    pub path_prefix: Option<String>,
    /// Send the path without the prefix (`/api/x` → `/x` for prefix `/api/`).
    pub strip_prefix: Option<bool>,
    #[serde(default)]
    pub upstreams: Vec<String>,
    /// "h1" (default), "h2c", or "h2" (HTTP/2 over TLS).
    pub upstream_protocol: Option<String>,
    /// PEM file of the CA that signs the upstreams' certificates (with "h2").
    pub upstream_ca: Option<PathBuf>,
    /// The name the upstreams' certificates are checked against (with "h2");
    /// defaults to the route's domain.
    pub upstream_tls_name: Option<String>,
    /// "preserve" (default): the client's Host; "upstream": the upstream's address.
    pub host: Option<String>,
    pub max_body_bytes: Option<u64>,
    pub max_header_bytes: Option<usize>,
    pub allowed_methods: Option<Vec<String>>,
    pub deny_paths: Option<Vec<String>>,
    pub required_content_types: Option<Vec<String>>,
    pub connect_timeout_ms: Option<u64>,
    /// Before `response_timeout_secs` and `body_idle_timeout_secs`: sets both.
    pub read_timeout_secs: Option<u64>,
    pub response_timeout_secs: Option<u64>,
    pub body_idle_timeout_secs: Option<u64>,
    pub max_connections_per_upstream: Option<usize>,
    pub queue_timeout_ms: Option<u64>,
    /// Passthrough: "v1" or "v2" sends a PROXY header to the upstream; "off" (default).
    pub proxy_protocol: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSite {
    pub domain: String,
    pub root: Option<PathBuf>,
    pub dotfiles: Option<super::Dotfiles>,
    pub protocols: Option<RawProtocols>,
    pub tls: Option<RawTls>,
    pub acme: Option<RawSiteAcme>,
    pub webtransport: Option<RawWebTransport>,
    pub log: Option<RawSiteLog>,
}

/// `[sites.log]`: the site's share of the access log.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSiteLog {
    pub access: Option<bool>,
    pub access_sample: Option<f64>,
}

/// `[sites.webtransport]`: the bounded diagnostic endpoint; absent means off.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawWebTransport {
    pub path: Option<String>,
    pub allowed_origins: Option<Vec<String>>,
    pub modes: Option<Vec<super::WtMode>>,
    pub max_sessions: Option<usize>,
    pub max_streams_per_session: Option<usize>,
    pub max_capsule_bytes: Option<usize>,
    pub max_datagram_bytes: Option<usize>,
    pub max_datagrams_per_sec: Option<u32>,
    pub max_session_bytes: Option<u64>,
    pub idle_timeout_secs: Option<u64>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawProtocols {
    pub h1: Option<bool>,
    pub h2: Option<bool>,
    pub h3: Option<bool>,
}

/// The top-level `[tls]`: the certificate every site inherits (both or neither), and
/// the process-wide ticket keys.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTopTls {
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// Staple the responder's OCSP answer in handshakes (on by default).
    pub ocsp_stapling: Option<bool>,
    /// The session-ticket key file shared by the hosts behind one load balancer.
    pub ticket_keys: Option<PathBuf>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Staple the responder's OCSP answer in handshakes (on by default).
    pub ocsp_stapling: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawKernel {
    pub ktls: Option<super::Policy>,
    pub bbr: Option<super::Policy>,
    pub ebpf: Option<super::Policy>,
    pub tcp_health: Option<super::Policy>,
    pub bpf_pin_dir: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLimits {
    pub max_connections: Option<usize>,
    pub max_header_bytes: Option<usize>,
    pub handshake_timeout_secs: Option<u64>,
    pub header_read_timeout_secs: Option<u64>,
    pub idle_timeout_secs: Option<u64>,
    pub send_timeout_secs: Option<u64>,
    pub shutdown_grace_secs: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLog {
    pub access: Option<bool>,
    pub access_format: Option<super::AccessFormat>,
    pub access_path: Option<PathBuf>,
    pub access_sample: Option<f64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRuntime {
    #[serde(default)]
    pub settings: BTreeMap<String, String>,
}
