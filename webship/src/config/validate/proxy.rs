//! `[reverse_proxy]` with TLS termination: each route domain becomes a proxy site
//! with the proxy's certificate and protocols, and every route's HTTP rules are
//! checked here. `tls_termination = false` hands over to `passthrough`.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::config::raw::{RawReverseProxy, RawRoute};
use crate::config::{
    DomainPattern, IpNet, PassthroughRoute, Route, Serve, Site, UdpPassthrough, UpstreamProtocol,
};

use super::Validator;
use crate::proxy::path::matchable;

/// Proxy routes grouped by domain, before they become sites.
type ByDomain = BTreeMap<String, (DomainPattern, Vec<Route>)>;

/// Connections one route keeps to each upstream unless `max_connections_per_upstream`
/// says otherwise (as many as the pool keeps idle).
const DEFAULT_MAX_CONNECTIONS_PER_UPSTREAM: usize = 64;

/// How a route deals with its upstreams: the timeouts and the connection cap.
struct UpstreamLimits {
    connect: Duration,
    response: Duration,
    body_idle: Duration,
    queue: Duration,
    max_connections: usize,
}

impl Validator<'_> {
    /// Each distinct route domain becomes a proxy site with the proxy's certificate
    /// and protocols; its routes are matched by the longest `path_prefix`.
    pub(super) fn reverse_proxy(
        &mut self,
        raw: &RawReverseProxy,
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
        let trusted = self.address_blocks(
            "reverse_proxy.trusted_proxies",
            raw.trusted_proxies.as_deref().unwrap_or_default(),
        );
        let by_domain = self.proxy_routes(&raw.routes, seen, &trusted);
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
                // Unused: `dotfiles` is a file-site rule. A proxy forwards `/.env` like
                // any path; the origin decides, or a route's `deny_paths`.
                dotfiles: crate::config::Dotfiles::Deny,
                // Proxied domains have no table of their own: `[log]`'s rate.
                access_sample: None,
            });
        }
        (Vec::new(), None)
    }

    /// The valid routes by domain. A domain a `[[sites]]` entry serves from files
    /// cannot also be proxied, and two routes of a domain cannot share a prefix.
    fn proxy_routes(
        &mut self,
        routes: &[RawRoute],
        seen: &BTreeMap<String, usize>,
        trusted: &[IpNet],
    ) -> ByDomain {
        let mut by_domain = ByDomain::new();
        for (i, r) in routes.iter().enumerate() {
            let key = format!("reverse_proxy.routes[{i}]");
            let Some(domain) = self.domain(&format!("{key}.domain"), &r.domain) else {
                continue;
            };
            let Some(route) = self.route(&key, r, trusted) else {
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
        by_domain
    }

    /// `trusted_proxies`, `accept_proxy_protocol`: CIDR blocks (or single addresses)
    /// without host bits.
    pub(super) fn address_blocks(&mut self, key: &str, raw: &[String]) -> Vec<IpNet> {
        let mut out = Vec::new();
        for (i, text) in raw.iter().enumerate() {
            match IpNet::parse(text.trim()) {
                Some(net) => out.push(net),
                None => self.problem(
                    format!("{key}[{i}]"),
                    format!("`{text}` is not an address block"),
                    "write it as \"10.0.0.0/8\", \"2001:db8::/32\" or one address, with no host bits set",
                ),
            }
        }
        out
    }
}

/// Why a `deny_paths` pattern could never match a request's match form
/// ([`crate::proxy::path::match_form`]), if it could not.
fn deny_pattern_problem(pattern: &str) -> Option<&'static str> {
    if pattern == "*" {
        return None;
    }
    if pattern.len() > 1 && pattern.starts_with('*') && pattern.ends_with('*') {
        return Some("has `*` at both ends; a pattern matches by prefix (\"/admin*\"), by suffix (\"*.php\") or exactly");
    }
    let (literal, path) = match (pattern.strip_suffix('*'), pattern.strip_prefix('*')) {
        // A prefix or suffix may end or start inside a segment (`/.*`, `*.php`): it
        // is checked as part of a path.
        (Some(prefix), _) => (prefix, format!("{prefix}x")),
        (None, Some(suffix)) => (suffix, format!("/x{suffix}")),
        (None, None) => (pattern, pattern.to_owned()),
    };
    if literal.contains('*') {
        return Some("has a `*` inside; only one end may be `*`");
    }
    if !path.starts_with('/') {
        return Some("does not start with `/` or `*`");
    }
    (!matchable(&path)).then_some("can never match: requests are matched decoded, without `;` parameters")
}

impl Validator<'_> {
    /// One route's HTTP rules; `None` when any of them is refused.
    fn route(&mut self, key: &str, r: &RawRoute, trusted: &[IpNet]) -> Option<Route> {
        let before = self.problems.len();
        let path_prefix = r.path_prefix.clone().unwrap_or_else(|| "/".into());
        if !path_prefix.starts_with('/') {
            self.problem(
                format!("{key}.path_prefix"),
                format!("`{path_prefix}` does not start with `/`"),
                "write it as \"/api/\"",
            );
        } else if !matchable(&format!("{path_prefix}x")) {
            self.problem(
                format!("{key}.path_prefix"),
                format!(
                    "`{path_prefix}` can never match: requests are matched decoded, without `;` parameters"
                ),
                "write the path decoded, without `;`, `//`, `.` or `..` segments (\"/api/\", \"/café/\")",
            );
        }
        let deny_paths = r.deny_paths.clone().unwrap_or_default();
        for (i, pattern) in deny_paths.iter().enumerate() {
            if let Some(why) = deny_pattern_problem(pattern) {
                self.problem(
                    format!("{key}.deny_paths[{i}]"),
                    format!("`{pattern}` {why}"),
                    "use \"/prefix*\", \"*suffix\" or \"/exact\", written decoded (\"/café*\"), without `;`, `//`, `.` or `..` segments",
                );
            }
        }
        if r.proxy_protocol.is_some() {
            self.problem(
                format!("{key}.proxy_protocol"),
                "only TLS passthrough sends a PROXY header; an HTTP upstream learns the client's \
                 address from X-Forwarded-For and Forwarded",
                "remove `proxy_protocol`, or set `tls_termination = false`",
            );
        }
        let upstreams = self.upstreams(key, &r.upstreams);
        let upstream_protocol = self.upstream_protocol(key, r);
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
        let limits = self.upstream_limits(key, r);
        (self.problems.len() == before).then(|| Route {
            path_prefix,
            strip_prefix: r.strip_prefix.unwrap_or(false),
            upstreams,
            upstream_protocol,
            rewrite_host,
            max_body_bytes: r.max_body_bytes,
            max_header_bytes,
            allowed_methods,
            deny_paths,
            required_content_types: r
                .required_content_types
                .iter()
                .flatten()
                .map(|t| t.to_ascii_lowercase())
                .collect(),
            connect_timeout: limits.connect,
            response_timeout: limits.response,
            body_idle_timeout: limits.body_idle,
            max_connections_per_upstream: limits.max_connections,
            queue_timeout: limits.queue,
            trusted_proxies: trusted.to_vec(),
        })
    }

    /// The route's timeouts and connection cap. `read_timeout_secs`, the key before
    /// the response and body-idle timeouts were separate, still sets both, alone.
    fn upstream_limits(&mut self, key: &str, r: &RawRoute) -> UpstreamLimits {
        if r.read_timeout_secs.is_some()
            && (r.response_timeout_secs.is_some() || r.body_idle_timeout_secs.is_some())
        {
            self.problem(
                format!("{key}.read_timeout_secs"),
                "`read_timeout_secs` sets both `response_timeout_secs` and `body_idle_timeout_secs`; it cannot be combined with them",
                "replace `read_timeout_secs` with `response_timeout_secs` and `body_idle_timeout_secs`",
            );
        }
        let mut positive = |name: &str, value: Option<u64>, default: u64| -> u64 {
            match value {
                Some(0) => {
                    self.problem(
                        format!("{key}.{name}"),
                        "a timeout of zero",
                        format!("give `{name}` a positive value"),
                    );
                    default
                }
                Some(v) => v,
                None => default,
            }
        };
        let connect_ms = positive("connect_timeout_ms", r.connect_timeout_ms, 3_000);
        let legacy = positive("read_timeout_secs", r.read_timeout_secs, 60);
        let response = positive("response_timeout_secs", r.response_timeout_secs, legacy);
        let body_idle = positive("body_idle_timeout_secs", r.body_idle_timeout_secs, legacy);
        // HAProxy's rule: without its own `timeout queue`, the connect timeout.
        let queue_ms = positive("queue_timeout_ms", r.queue_timeout_ms, connect_ms);
        let max_connections = r
            .max_connections_per_upstream
            .unwrap_or(DEFAULT_MAX_CONNECTIONS_PER_UPSTREAM);
        if !(1..=65_536).contains(&max_connections) {
            self.problem(
                format!("{key}.max_connections_per_upstream"),
                "out of range",
                "use 1 to 65536",
            );
        }
        UpstreamLimits {
            connect: Duration::from_millis(connect_ms),
            response: Duration::from_secs(response),
            body_idle: Duration::from_secs(body_idle),
            queue: Duration::from_millis(queue_ms),
            max_connections: max_connections.clamp(1, 65_536),
        }
    }

    /// `upstream_protocol`, with the CA and name that HTTP/2 over TLS checks the
    /// upstreams' certificates against.
    fn upstream_protocol(&mut self, key: &str, r: &RawRoute) -> UpstreamProtocol {
        match r.upstream_protocol.as_deref() {
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
        }
    }
}
