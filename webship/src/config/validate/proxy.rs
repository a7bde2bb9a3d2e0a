//! `[reverse_proxy]` with TLS termination: each route domain becomes a proxy site
//! with the proxy's certificate and protocols, and every route's HTTP rules are
//! checked here. `tls_termination = false` hands over to `passthrough`.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::config::raw::{RawReverseProxy, RawRoute};
use crate::config::{DomainPattern, PassthroughRoute, Route, Serve, Site, UdpPassthrough, UpstreamProtocol};

use super::Validator;

/// Proxy routes grouped by domain, before they become sites.
type ByDomain = BTreeMap<String, (DomainPattern, Vec<Route>)>;

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
        let by_domain = self.proxy_routes(&raw.routes, seen);
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
                dotfiles: crate::config::Dotfiles::Deny,
            });
        }
        (Vec::new(), None)
    }

    /// The valid routes by domain. A domain a `[[sites]]` entry serves from files
    /// cannot also be proxied, and two routes of a domain cannot share a prefix.
    fn proxy_routes(&mut self, routes: &[RawRoute], seen: &BTreeMap<String, usize>) -> ByDomain {
        let mut by_domain = ByDomain::new();
        for (i, r) in routes.iter().enumerate() {
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
        by_domain
    }

    /// One route's HTTP rules; `None` when any of them is refused.
    fn route(&mut self, key: &str, r: &RawRoute) -> Option<Route> {
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
