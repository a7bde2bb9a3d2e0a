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
                        .map(|w| Arc::new(crate::webtransport::Endpoint::new(w)))
                })
                .collect(),
            webtransport_h2: config
                .sites
                .iter()
                .any(|s| s.webtransport.is_some() && s.protocols.h2),
        })
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

    pub(crate) fn webtransport_h2(&self) -> bool {
        self.webtransport_h2
    }

    /// The WebTransport endpoint an extended CONNECT is for, if its site has one at
    /// that path.
    pub(crate) fn webtransport(&self, req: &RequestHead<'_>) -> Option<Arc<crate::webtransport::Endpoint>> {
        let site = self.site_of(req).ok()?;
        self.webtransport[site].clone().filter(|w| w.matches(req.uri))
    }

    pub(crate) async fn handle(&self, req: &RequestHead<'_>, body: StreamBody) -> Response {
        let site = match self.site_of(req) {
            Ok(site) => site,
            Err(status) => return Response::status(status),
        };
        if let Some(wt) = self.webtransport[site].as_ref().filter(|w| w.matches(req.uri)) {
            // The endpoint's own path: its counters, or a hint for a plain CONNECT.
            return match *req.method {
                Method::GET | Method::HEAD => wt.stats_response(),
                _ => {
                    let mut resp = Response::status(StatusCode::METHOD_NOT_ALLOWED);
                    resp.headers
                        .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD, CONNECT"));
                    resp
                }
            };
        }
        let mut resp = match &self.serve[site] {
            Handler::Files(docroot) => {
                crate::files::serve(docroot, req.method, req.uri.path(), req.headers).await
            }
            Handler::Proxy(_) if req.has_body() && !req.body_forwardable => {
                Response::status(StatusCode::MISDIRECTED_REQUEST)
            }
            Handler::Proxy(proxy) => proxy.forward(req, body).await,
        };
        if req.version != Version::HTTP_3 {
            if let Some(alt) = &self.alt_svc[site] {
                resp.headers.insert(header::ALT_SVC, alt.clone());
            }
        }
        resp
    }
}

/// The host the request names, without port. HTTP/1.1 requires one (RFC 9112 §3.2).
fn host_of<'a>(req: &'a RequestHead<'_>) -> Result<Option<&'a str>, StatusCode> {
    let raw = match req.uri.authority() {
        Some(a) => Some(a.host()),
        None => match req.headers.get(header::HOST) {
            Some(v) => Some(v.to_str().map_err(|_| StatusCode::BAD_REQUEST).map(strip_port)?),
            None if req.version == Version::HTTP_11 => return Err(StatusCode::BAD_REQUEST),
            None => None,
        },
    };
    Ok(raw.map(|h| h.trim_start_matches('[').trim_end_matches(']')))
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
}
