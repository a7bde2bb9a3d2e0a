//! `[reverse_proxy]` with `tls_termination = false`: routes by SNI alone, so every
//! HTTP key is refused; the HTTP/3 passthrough origin (`udp_upstream`) and the
//! engines, and how the eBPF ones interact with `[kernel] ebpf`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use crate::config::model::{DEFAULT_PASSTHROUGH_IDLE, DEFAULT_UDP_FLOWS_PER_ADDRESS};
use crate::config::raw::{RawReverseProxy, RawRoute};
use crate::config::{
    Engine, Kernel, PassthroughRoute, Policy, Protocols, ProxyProtocol, Site, UdpEngine, UdpPassthrough,
};

use super::Validator;

impl Validator<'_> {
    /// `tls_termination = false`: routes by SNI only; nothing about HTTP applies.
    pub(super) fn passthrough(
        &mut self,
        raw: &RawReverseProxy,
        seen: &mut BTreeMap<String, usize>,
    ) -> (Vec<PassthroughRoute>, Option<UdpPassthrough>) {
        if raw.tls.is_some() {
            self.problem(
                "reverse_proxy.tls",
                "passthrough never decrypts, so it has no certificate",
                "remove [reverse_proxy.tls] (the upstreams present their own certificates)",
            );
        }
        if raw.trusted_proxies.is_some() {
            self.problem(
                "reverse_proxy.trusted_proxies",
                "applies to HTTP forwarding fields, which passthrough never sees",
                "remove `trusted_proxies`, or set `tls_termination = true`",
            );
        }
        let protocols = self.protocols("reverse_proxy.protocols", raw.protocols);
        let udp = self.udp_origin(raw, protocols);
        if raw.routes.is_empty() {
            self.problem(
                "reverse_proxy.routes",
                "passthrough has no routes",
                "add at least one [[reverse_proxy.routes]] with `domain` and `upstreams`",
            );
        }
        let mut out: Vec<PassthroughRoute> = Vec::new();
        for (i, r) in raw.routes.iter().enumerate() {
            if let Some(route) = self.passthrough_route(i, r, seen) {
                out.push(route);
            }
        }
        (out, udp)
    }

    /// The QUIC origin every datagram goes to: required exactly when passthrough
    /// carries h3, and its `udp_*` keys only then.
    fn udp_origin(&mut self, raw: &RawReverseProxy, protocols: Protocols) -> Option<UdpPassthrough> {
        let udp = match (&raw.udp_upstream, protocols.h3) {
            (Some(addr), true) => match addr.parse::<SocketAddr>() {
                Ok(upstream) if upstream.port() != 0 => Some(UdpPassthrough {
                    upstream,
                    flow_idle: Duration::from_secs(raw.udp_flow_idle_secs.unwrap_or(30).max(1)),
                    engine: raw.udp_engine.unwrap_or_default(),
                    max_flows_per_address: self.udp_flows_per_address(raw.udp_max_flows_per_address),
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
            (
                "udp_max_flows_per_address",
                raw.udp_max_flows_per_address.is_some(),
            ),
        ] {
            if present && raw.udp_upstream.is_none() {
                self.problem(
                    format!("reverse_proxy.{name}"),
                    "applies to HTTP/3 passthrough, which is not configured",
                    "remove it, or add `udp_upstream`",
                );
            }
        }
        udp
    }

    fn udp_flows_per_address(&mut self, value: Option<usize>) -> usize {
        match value {
            None => DEFAULT_UDP_FLOWS_PER_ADDRESS,
            Some(n @ 1..=65_536) => n,
            Some(_) => {
                self.problem(
                    "reverse_proxy.udp_max_flows_per_address",
                    "out of range",
                    "use 1 to 65536 (flows one client address may hold)",
                );
                DEFAULT_UDP_FLOWS_PER_ADDRESS
            }
        }
    }

    /// `passthrough_idle_timeout_secs`: only for TLS passthrough, 1 s to a day.
    pub(super) fn passthrough_idle_timeout(&mut self, raw: Option<&RawReverseProxy>) -> Duration {
        let Some(secs) = raw.and_then(|r| r.passthrough_idle_timeout_secs) else {
            return DEFAULT_PASSTHROUGH_IDLE;
        };
        if raw.is_some_and(|r| r.tls_termination != Some(false)) {
            self.problem(
                "reverse_proxy.passthrough_idle_timeout_secs",
                "only TLS passthrough tunnels connections",
                "remove it (`[limits] idle_timeout_secs` applies), or set `tls_termination = false`",
            );
        }
        if !(1..=86_400).contains(&secs) {
            self.problem(
                "reverse_proxy.passthrough_idle_timeout_secs",
                "out of range",
                "use 1 to 86400 seconds",
            );
            return DEFAULT_PASSTHROUGH_IDLE;
        }
        Duration::from_secs(secs)
    }

    /// One passthrough route: a domain no other site or route has, and its upstreams.
    fn passthrough_route(
        &mut self,
        i: usize,
        r: &RawRoute,
        seen: &mut BTreeMap<String, usize>,
    ) -> Option<PassthroughRoute> {
        let key = format!("reverse_proxy.routes[{i}]");
        if r.path_prefix.as_deref().is_some_and(|p| p != "/") {
            self.problem(
                format!("{key}.path_prefix"),
                "passthrough routes by SNI alone: it never sees a path",
                "use `path_prefix = \"/\"` or leave it out",
            );
        }
        self.http_only_keys(&key, r);
        let domain = self.domain(&format!("{key}.domain"), &r.domain)?;
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
            return None;
        }
        seen.insert(name, usize::MAX);
        let upstreams = self.upstreams(&key, &r.upstreams);
        let proxy_protocol = match r.proxy_protocol.as_deref() {
            None | Some("off") => None,
            Some("v1") => Some(ProxyProtocol::V1),
            Some("v2") => Some(ProxyProtocol::V2),
            Some(other) => {
                self.problem(
                    format!("{key}.proxy_protocol"),
                    format!("`{other}` is not a PROXY protocol version"),
                    "use \"v2\" (binary, what nginx, HAProxy and most origins read), \"v1\" (text) or \"off\"",
                );
                None
            }
        };
        Some(PassthroughRoute {
            domain,
            upstreams,
            connect_timeout: Duration::from_millis(r.connect_timeout_ms.unwrap_or(3_000).max(1)),
            proxy_protocol,
        })
    }

    /// A route key that only means something to HTTP would be silently ignored by
    /// passthrough, so it is refused instead.
    fn http_only_keys(&mut self, key: &str, r: &RawRoute) {
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
            ("response_timeout_secs", r.response_timeout_secs.is_some()),
            ("body_idle_timeout_secs", r.body_idle_timeout_secs.is_some()),
            (
                "max_connections_per_upstream",
                r.max_connections_per_upstream.is_some(),
            ),
            ("queue_timeout_ms", r.queue_timeout_ms.is_some()),
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
    }

    /// `passthrough_engine`. Asking for the eBPF engine by name is asking for eBPF,
    /// so it turns `ebpf = "auto"` into `"required"`.
    pub(super) fn passthrough_engine(
        &mut self,
        raw: Option<&RawReverseProxy>,
        kernel: &mut Kernel,
    ) -> Engine {
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
        if engine == Engine::Sockmap && kernel.ebpf == Policy::Auto {
            kernel.ebpf = Policy::Required;
        }
        engine
    }

    /// HTTP/3 passthrough against the rest of the file: the eBPF redirect's limits,
    /// `[kernel] ebpf`, and sites that would want the same UDP port.
    pub(super) fn udp_passthrough(
        &mut self,
        udp: UdpPassthrough,
        listen: SocketAddr,
        kernel: &mut Kernel,
        sites: &[Site],
    ) {
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
        if sites.iter().any(|s| s.protocols.h3) {
            self.problem(
                "reverse_proxy.udp_upstream",
                "HTTP/3 passthrough takes every datagram on the listen port, so no site can serve h3 there too",
                "set `h3 = false` in the protocols of the sites (or of the top level)",
            );
        }
    }
}
