//! The one router every protocol driver calls: `Host` (or `:authority`) picks the site,
//! the site serves files or forwards to its upstreams. Drivers never route by
//! themselves; they translate their protocol to a request head and body, call
//! [`Service::handle`], and send the [`Response`].

use std::sync::Arc;

use http::header::{self, HeaderValue};
use http::{Method, StatusCode, Version};

use crate::config::{Config, Dotfiles, Serve};
use crate::message::{RequestHead, Response, StreamBody};
use crate::proxy::Proxy;
use crate::tls::SiteNames;

#[derive(Debug)]
enum Handler {
    Files(crate::files::Docroot),
    Proxy(Proxy),
}

/// Routes requests to sites.
#[derive(Debug)]
pub(crate) struct Service {
    sites: SiteNames,
    serve: Vec<Handler>,
    /// `Alt-Svc` for h1/h2 responses of sites that also serve HTTP/3.
    alt_svc: Vec<Option<HeaderValue>>,
    /// Each site's WebTransport diagnostic endpoint, if it has one.
    webtransport: Vec<Option<Arc<crate::webtransport::Endpoint>>>,
    /// Whether some site offers WebTransport over HTTP/2 (extended CONNECT is then
    /// announced in HTTP/2 SETTINGS).
    webtransport_h2: bool,
    /// Each site's configured domain, as logs and metrics name it.
    names: Vec<Arc<str>>,
}

/// What served a request, as the exchange's record names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// The site's document root.
    Files,
    /// The site's upstreams (or the proxy refusing the request itself).
    Proxy,
    /// A WebTransport endpoint's own path.
    WebTransport,
    /// No site: the router refused the request (bad or foreign `Host`).
    Refused,
}

impl Mode {
    /// Its index in the metrics' `mode` label table (`metrics::MODES`).
    pub(crate) fn index(self) -> usize {
        self as usize
    }

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Mode::Files => "files",
            Mode::Proxy => "proxy",
            Mode::WebTransport => "webtransport",
            Mode::Refused => "refused",
        }
    }
}

/// Where the router sent a request: the site (an index into this service's sites)
/// and what answered it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Route {
    pub(crate) site: Option<usize>,
    pub(crate) mode: Mode,
    /// The upstream a proxied request went to last, and how long its head took.
    pub(crate) upstream: Option<crate::proxy::UpstreamReport>,
}

impl Route {
    pub(crate) const REFUSED: Route = Route {
        site: None,
        mode: Mode::Refused,
        upstream: None,
    };
}

impl Service {
    /// Sets up every site; fails only when a proxy route's upstream TLS cannot be
    /// configured (its CA file), which `webship check` reports too.
    pub(crate) fn new(config: &Config, sites: SiteNames) -> Result<Self, crate::proxy::ProxyError> {
        Ok(Self {
            sites,
            serve: config
                .sites
                .iter()
                .map(|s| {
                    Ok(match &s.serve {
                        Serve::Files(root) => Handler::Files(crate::files::Docroot {
                            root: Arc::from(root.as_path()),
                            dotfiles: s.dotfiles == Dotfiles::Allow,
                        }),
                        Serve::Proxy(routes) => Handler::Proxy(Proxy::new(routes, s.domain.to_string())?),
                    })
                })
                .collect::<Result<_, crate::proxy::ProxyError>>()?,
            alt_svc: config
                .sites
                .iter()
                .map(|s| {
                    s.protocols.h3.then(|| {
                        HeaderValue::try_from(format!("h3=\":{}\"; ma=86400", config.listen.port()))
                            .unwrap_or(HeaderValue::from_static("clear"))
                    })
                })
                .collect(),
            webtransport: config
                .sites
                .iter()
                .map(|s| {
                    s.webtransport
                        .clone()
                        .map(|w| Arc::new(crate::webtransport::Endpoint::for_site(w, &s.domain.to_string())))
                })
                .collect(),
            webtransport_h2: config
                .sites
                .iter()
                .any(|s| s.webtransport.is_some() && s.protocols.h2),
            names: config
                .sites
                .iter()
                .map(|s| Arc::from(s.domain.to_string()))
                .collect(),
        })
    }

    /// A site's configured domain (`*.example.com`, `_` for the catch-all).
    pub(crate) fn site_name(&self, site: usize) -> Option<&Arc<str>> {
        self.names.get(site)
    }

    /// Every site's name, by index.
    pub(crate) fn site_names(&self) -> &[Arc<str>] {
        &self.names
    }

    /// The sites by name (the TLS layer's table).
    pub(crate) fn sites(&self) -> &SiteNames {
        &self.sites
    }

    /// Whether a site forwards to upstreams (its connections speak HTTP/1.1 through
    /// hyper, which streams request bodies both ways).
    pub(crate) fn is_proxy(&self, site: usize) -> bool {
        matches!(self.serve.get(site), Some(Handler::Proxy(_)))
    }

    /// The site a request is for, or the status that refuses it.
    fn site_of(&self, req: &RequestHead<'_>) -> Result<usize, StatusCode> {
        match host_of(req)? {
            // Not ours: RFC 9110 §15.5.20, the client may retry on another connection.
            Some(host) => self.sites.lookup(host).ok_or(StatusCode::MISDIRECTED_REQUEST),
            // HTTP/1.0 may omit Host: the certificate's site answers.
            None => Ok(req.tls_site),
        }
    }

    /// The site a request is for, if any (for records of requests answered elsewhere).
    pub(crate) fn site_of_request(&self, req: &RequestHead<'_>) -> Option<usize> {
        self.site_of(req).ok()
    }

    pub(crate) fn webtransport_h2(&self) -> bool {
        self.webtransport_h2
    }

    /// The WebTransport endpoint an extended CONNECT is for, if its site has one at
    /// that path.
    pub(crate) fn webtransport(&self, req: &RequestHead<'_>) -> Option<Arc<crate::webtransport::Endpoint>> {
        let site = self.site_of(req).ok()?;
        self.webtransport[site].clone().filter(|w| w.matches(req.uri))
    }

    /// Serves a request; says which site and what answered it beside the response.
    pub(crate) async fn handle(&self, req: &RequestHead<'_>, body: StreamBody) -> (Response, Route) {
        let site = match self.site_of(req) {
            Ok(site) => site,
            Err(status) => return (Response::status(status), Route::REFUSED),
        };
        if let Some(wt) = self.webtransport[site].as_ref().filter(|w| w.matches(req.uri)) {
            // The endpoint's own path: its counters, or a hint for a plain CONNECT.
            let resp = match *req.method {
                Method::GET | Method::HEAD => wt.stats_response(),
                _ => {
                    let mut resp = Response::status(StatusCode::METHOD_NOT_ALLOWED);
                    resp.headers
                        .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD, CONNECT"));
                    resp
                }
            };
            let route = Route {
                site: Some(site),
                mode: Mode::WebTransport,
                upstream: None,
            };
            return (resp, route);
        }
        let (mut resp, mode, upstream) = match &self.serve[site] {
            Handler::Files(docroot) => (
                crate::files::serve(docroot, req.method, req.uri.path(), req.headers).await,
                Mode::Files,
                None,
            ),
            Handler::Proxy(_) if req.has_body() && !req.body_forwardable => (
                Response::status(StatusCode::MISDIRECTED_REQUEST),
                Mode::Proxy,
                None,
            ),
            Handler::Proxy(proxy) => {
                let (resp, upstream) = proxy.forward(req, body).await;
                (resp, Mode::Proxy, upstream)
            }
        };
        if req.version != Version::HTTP_3 {
            if let Some(alt) = &self.alt_svc[site] {
                resp.headers.insert(header::ALT_SVC, alt.clone());
            }
        }
        let route = Route {
            site: Some(site),
            mode,
            upstream,
        };
        (resp, route)
    }
}

/// The host the request names, without port. HTTP/1.1 requires one (RFC 9112 §3.2).
/// An authority that is not a host name, an IP address or `[IPv6]` with an optional
/// port is refused (400), like nginx does: it would otherwise reach wildcard
/// matching, logs and the proxy's forwarding fields as the client wrote it.
fn host_of<'a>(req: &'a RequestHead<'_>) -> Result<Option<&'a str>, StatusCode> {
    // Two Host lines leave which one an origin reads to chance (RFC 9112 §3.2: 400).
    if req.headers.get_all(header::HOST).iter().nth(1).is_some() {
        return Err(StatusCode::BAD_REQUEST);
    }
    let authority = match req.uri.authority() {
        Some(a) => Some(a.as_str()),
        None => match req.headers.get(header::HOST) {
            Some(v) => Some(v.to_str().map_err(|_| StatusCode::BAD_REQUEST)?),
            None if req.version == Version::HTTP_11 => return Err(StatusCode::BAD_REQUEST),
            None => None,
        },
    };
    match authority {
        Some(a) if !valid_authority(a) => Err(StatusCode::BAD_REQUEST),
        Some(a) => Ok(Some(strip_port(a).trim_start_matches('[').trim_end_matches(']'))),
        None => Ok(None),
    }
}

/// `reg-name` (letters, digits, `-`, `.`, `_`; IPv4 included), or `[IPv6]`, then an
/// optional `:port` (1 to 65535): RFC 9110 §7.2 without userinfo and escapes.
pub(crate) fn valid_authority(authority: &str) -> bool {
    let (host, port) = if let Some(rest) = authority.strip_prefix('[') {
        let Some((v6, after)) = rest.split_once(']') else {
            return false;
        };
        if v6.parse::<std::net::Ipv6Addr>().is_err() {
            return false;
        }
        (
            None,
            after
                .strip_prefix(':')
                .map(Some)
                .unwrap_or((!after.is_empty()).then_some("")),
        )
    } else {
        match authority.rsplit_once(':') {
            Some((host, port)) => (Some(host), Some(port)),
            None => (Some(authority), None),
        }
    };
    let host_ok = host.is_none_or(|h| {
        !h.is_empty()
            && h.len() <= 253
            && h.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
    });
    let port_ok = port.is_none_or(|p| {
        !p.is_empty()
            && p.len() <= 5
            && p.bytes().all(|b| b.is_ascii_digit())
            && p.parse::<u16>().is_ok_and(|n| n > 0)
    });
    host_ok && port_ok
}

fn strip_port(host: &str) -> &str {
    if let Some(rest) = host.strip_prefix('[') {
        // [v6]:port
        return rest.split(']').next().unwrap_or(rest);
    }
    match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_stripped() {
        assert_eq!(strip_port("a.test:8443"), "a.test");
        assert_eq!(strip_port("a.test"), "a.test");
        assert_eq!(strip_port("[::1]:443"), "::1");
        assert_eq!(strip_port("[::1]"), "::1");
    }

    #[test]
    fn authorities() {
        for good in [
            "a.test",
            "a.test:8443",
            "a_b-c.test.",
            "127.0.0.1",
            "127.0.0.1:1",
            "[::1]",
            "[::1]:443",
        ] {
            assert!(valid_authority(good), "{good}");
        }
        for bad in [
            "",
            ":443",
            "a.test:",
            "a.test:0",
            "a.test:65536",
            "a.test:x",
            "a b",
            "x\",for=6.6.6.6;host=\"a.test",
            "user@a.test",
            "a.test:1:2",
            "[::1",
            "[::1]x",
            "[::1]:",
            "[zz]",
            "a%2e.test",
        ] {
            assert!(!valid_authority(bad), "{bad}");
        }
    }
}
