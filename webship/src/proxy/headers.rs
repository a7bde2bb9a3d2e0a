//! Header rewriting at the proxy boundary (RFC 9110 §7.6): hop-by-hop fields stay
//! behind, forwarding fields are added.
//!
//! Forwarding fields say who the client is, so a client may not write its own: from a
//! peer outside `trusted_proxies`, `X-Forwarded-For`, `Forwarded`,
//! `X-Forwarded-Proto` and `X-Forwarded-Host` are replaced by ours, and every other
//! `X-Forwarded-*` (`-Port`, `-Prefix`, `-Server`, `-Scheme`, `-Ssl`, ...) and the
//! client-address fields (`X-Real-IP`, `True-Client-IP`, `X-Client-IP`,
//! `CF-Connecting-IP`, `X-Cluster-Client-IP`, `Fastly-Client-IP`) are dropped; a
//! trusted peer's are kept and extended. The request-rewrite fields some origins obey
//! over the request line (`X-Original-URL`, `X-Rewrite-URL`) never pass: they would
//! route around the proxy's path filters. The method-override fields (Rails, Laravel,
//! Express, Symfony obey them over the method) would route around `allowed_methods`:
//! they pass only from a trusted peer, and never on a route with `allowed_methods`.

use std::net::SocketAddr;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::Version;

use crate::config::Route;
use crate::message::RequestHead;

/// Fields that describe one connection, never forwarded (RFC 9110 §7.6.1), plus the
/// legacy ones proxies in the wild still send.
const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Copies `from` without hop-by-hop fields, including those `Connection` names, into
/// a map with room for `room` more fields.
fn end_to_end(from: &HeaderMap, room: usize) -> HeaderMap {
    let named: Vec<String> = from
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
        .filter(|t| !t.is_empty())
        .collect();
    let mut out = HeaderMap::with_capacity(from.len() + room);
    for (name, value) in from {
        if HOP_BY_HOP.contains(name) || named.iter().any(|n| n == name.as_str()) {
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    out
}

fn version_token(v: Version) -> &'static str {
    match v {
        Version::HTTP_10 => "1.0",
        Version::HTTP_2 => "2",
        Version::HTTP_3 => "3",
        _ => "1.1",
    }
}

fn append(out: &mut HeaderMap, name: HeaderName, existing: Option<&HeaderValue>, ours: &str) {
    let value = match existing.and_then(|v| v.to_str().ok()) {
        Some(prev) if !prev.is_empty() => format!("{prev}, {ours}"),
        _ => ours.to_owned(),
    };
    if let Ok(v) = HeaderValue::from_str(&value) {
        out.insert(name, v);
    }
}

/// Every value of `name` as one comma-separated list (a client may split a list
/// over several lines).
fn joined(from: &HeaderMap, name: &str) -> Option<HeaderValue> {
    let values: Vec<&str> = from
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect();
    if values.is_empty() {
        return None;
    }
    HeaderValue::from_str(&values.join(", ")).ok()
}

/// An RFC 7239 `quoted-string` (RFC 9110 §5.6.4): `"` and `\` escaped.
fn quoted(value: &str) -> String {
    let mut out = String::with_capacity(value.len() + 2);
    out.push('"');
    for c in value.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

/// Fields a client may state only through a trusted proxy (besides every
/// `x-forwarded-*`).
const CLAIMS: [&str; 7] = [
    "forwarded",
    "x-real-ip",
    "true-client-ip",
    "x-client-ip",
    "cf-connecting-ip",
    "x-cluster-client-ip",
    "fastly-client-ip",
];

/// Fields that replace the request's method on some origins.
const METHOD_OVERRIDES: [&str; 3] = ["x-http-method-override", "x-http-method", "x-method-override"];

/// Fields that rewrite the request's target on some origins (IIS, Symfony).
const REWRITES: [&str; 2] = ["x-original-url", "x-rewrite-url"];

/// The request headers the upstream sees.
pub(super) fn upstream_request(req: &RequestHead<'_>, upstream: SocketAddr, route: &Route) -> HeaderMap {
    // The forwarding fields.
    let mut out = end_to_end(req.headers, 5);
    // `TE: trailers` is the one TE value worth passing: it asks for trailers.
    if req
        .headers
        .get(header::TE)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"trailers"))
    {
        out.insert(header::TE, HeaderValue::from_static("trailers"));
    }
    let host = req
        .uri
        .authority()
        .map(|a| a.as_str().to_owned())
        .or_else(|| {
            req.headers
                .get(header::HOST)
                .and_then(|h| h.to_str().ok())
                .map(str::to_owned)
        })
        .unwrap_or_default();
    for name in REWRITES {
        out.remove(name);
    }
    let ip = req.peer.ip().to_canonical();
    let trusted = route.trusted_proxies.iter().any(|net| net.contains(ip));
    if !trusted {
        for name in CLAIMS {
            out.remove(name);
        }
        let forwarded: Vec<HeaderName> = out
            .keys()
            .filter(|n| n.as_str().starts_with("x-forwarded-"))
            .cloned()
            .collect();
        for name in forwarded {
            out.remove(name);
        }
    }
    if !trusted || !route.allowed_methods.is_empty() {
        for name in METHOD_OVERRIDES {
            out.remove(name);
        }
    }
    let theirs = |name: &str| if trusted { joined(req.headers, name) } else { None };
    append(
        &mut out,
        HeaderName::from_static("x-forwarded-for"),
        theirs("x-forwarded-for").as_ref(),
        &ip.to_string(),
    );
    if !out.contains_key("x-forwarded-proto") {
        out.insert(
            HeaderName::from_static("x-forwarded-proto"),
            HeaderValue::from_static("https"),
        );
    }
    if !out.contains_key("x-forwarded-host") {
        if let Ok(v) = HeaderValue::from_str(&host) {
            out.insert(HeaderName::from_static("x-forwarded-host"), v);
        }
    }
    let node = match ip {
        std::net::IpAddr::V4(v4) => v4.to_string(),
        std::net::IpAddr::V6(v6) => format!("\"[{v6}]\""),
    };
    let forwarded = if host.is_empty() {
        format!("for={node};proto=https")
    } else {
        format!("for={node};proto=https;host={}", quoted(&host))
    };
    append(
        &mut out,
        header::FORWARDED,
        theirs("forwarded").as_ref(),
        &forwarded,
    );
    let via = format!("{} webship", version_token(req.version));
    append(&mut out, header::VIA, req.headers.get(header::VIA), &via);
    let host_value = if route.rewrite_host {
        upstream.to_string()
    } else {
        host
    };
    if let Ok(v) = HeaderValue::from_str(&host_value) {
        out.insert(header::HOST, v);
    }
    out
}

/// The response headers the client sees.
pub(super) fn downstream_response(from: &HeaderMap, upstream_version: Version) -> HeaderMap {
    // Room for `Via` and the service's `Alt-Svc`, no more: hyper's HTTP/1.1 keeps
    // the response's (emptied) map for the connection's next request head, so its
    // capacity stays with every kept-alive connection (with 5 spare, 2.5 KiB for
    // a typical origin's 8 fields; heaptrack, docs/benchmarks.md).
    let mut out = end_to_end(from, 2);
    let via = format!("{} webship", version_token(upstream_version));
    append(&mut out, header::VIA, from.get(header::VIA), &via);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_and_connection_named_fields_stay_behind() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-secret"),
        );
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert(header::TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
        h.insert("x-kept", HeaderValue::from_static("yes"));
        let out = end_to_end(&h, 0);
        assert_eq!(out.len(), 1);
        assert_eq!(out["x-kept"], "yes");
    }

    #[test]
    fn forwarding_fields_append() {
        let mut h = HeaderMap::new();
        h.insert("x-forwarded-for", HeaderValue::from_static("203.0.113.7"));
        h.insert(header::HOST, HeaderValue::from_static("media.example.com"));
        let uri: http::Uri = "/a?b".parse().unwrap();
        let req = RequestHead {
            method: &http::Method::GET,
            uri: &uri,
            version: Version::HTTP_11,
            headers: &h,
            tls_site: 0,
            peer: "[::1]:5000".parse().unwrap(),
            body_forwardable: true,
        };
        let route = Route {
            path_prefix: "/".into(),
            strip_prefix: false,
            upstreams: vec!["127.0.0.1:9".parse().unwrap()],
            upstream_protocol: crate::config::UpstreamProtocol::H1,
            rewrite_host: false,
            max_body_bytes: None,
            max_header_bytes: 65536,
            allowed_methods: vec![],
            deny_paths: vec![],
            required_content_types: vec![],
            connect_timeout: std::time::Duration::from_secs(1),
            response_timeout: std::time::Duration::from_secs(1),
            body_idle_timeout: std::time::Duration::from_secs(1),
            max_connections_per_upstream: 4,
            queue_timeout: std::time::Duration::from_secs(1),
            trusted_proxies: vec![crate::config::IpNet::parse("::1").unwrap()],
        };
        let out = upstream_request(&req, "127.0.0.1:9".parse().unwrap(), &route);
        assert_eq!(out["x-forwarded-for"], "203.0.113.7, ::1");
        assert_eq!(out["x-forwarded-proto"], "https");
        assert_eq!(out["x-forwarded-host"], "media.example.com");
        assert_eq!(
            out[header::FORWARDED],
            "for=\"[::1]\";proto=https;host=\"media.example.com\""
        );
        assert_eq!(out[header::VIA], "1.1 webship");
        assert_eq!(out[header::HOST], "media.example.com");
        let rewrite = Route {
            rewrite_host: true,
            ..route.clone()
        };
        let out = upstream_request(&req, "127.0.0.1:9".parse().unwrap(), &rewrite);
        assert_eq!(out[header::HOST], "127.0.0.1:9");
        // Untrusted: the client's claim is replaced.
        let untrusted = Route {
            trusted_proxies: vec![],
            ..route
        };
        let out = upstream_request(&req, "127.0.0.1:9".parse().unwrap(), &untrusted);
        assert_eq!(out["x-forwarded-for"], "::1");
    }

    #[test]
    fn forwarded_host_is_a_quoted_string() {
        assert_eq!(quoted("a.test:443"), "\"a.test:443\"");
        assert_eq!(quoted("x\",for=6.6.6.6"), "\"x\\\",for=6.6.6.6\"");
        assert_eq!(quoted("a\\b"), "\"a\\\\b\"");
    }
}
