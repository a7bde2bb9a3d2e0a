//! The one router every protocol driver calls: `Host` (or `:authority`) picks the site,
//! the site serves files or forwards to its upstreams. Drivers never route by
//! themselves; they translate their protocol to a request head and body, call
//! [`Service::handle`], and send the [`Response`].

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, StatusCode, Uri, Version};

use crate::config::{Config, DomainPattern, Serve};
use crate::proxy::Proxy;

/// Errors a streamed body can end with.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A streamed body (request bodies, and responses relayed from upstreams). Data,
/// trailers and errors pass through; an error ends the peer's stream as a protocol
/// error, never as a silently short message.
pub type StreamBody = http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>;

/// An empty request body.
pub fn empty_body() -> StreamBody {
    use http_body_util::BodyExt;
    http_body_util::Empty::<Bytes>::new()
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// A protocol-neutral response. File bodies name byte ranges of an open file, so each
/// driver decides how the bytes travel (userspace TLS, or the kernel).
#[derive(Debug)]
pub struct Response {
    pub status: StatusCode,
    /// Includes `content-length` whenever the length is known (always, today).
    pub headers: HeaderMap,
    pub body: Body,
}

impl Response {
    /// A bodiless response with just a status, for errors and redirects.
    pub fn status(status: StatusCode) -> Self {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(0));
        Self {
            status,
            headers,
            body: Body::Empty,
        }
    }
}

pub enum Body {
    Empty,
    Bytes(Bytes),
    File(FileBody),
    /// Relayed from an upstream; its length is in `content-length` when known.
    Stream(StreamBody),
}

impl std::fmt::Debug for Body {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Body::Empty => f.write_str("Empty"),
            Body::Bytes(b) => write!(f, "Bytes({})", b.len()),
            Body::File(file) => write!(f, "{file:?}"),
            Body::Stream(_) => f.write_str("Stream"),
        }
    }
}

impl Body {
    /// Bytes known up front (0 for a stream, whose length the upstream decides).
    pub fn len(&self) -> u64 {
        match self {
            Body::Empty | Body::Stream(_) => 0,
            Body::Bytes(b) => b.len() as u64,
            Body::File(f) => f.len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Byte ranges of one open file, possibly interleaved with literal bytes (the part
/// headers of `multipart/byteranges`).
#[derive(Debug)]
pub struct FileBody {
    pub file: Arc<std::fs::File>,
    pub segments: Vec<Segment>,
    /// Sum of all segment lengths.
    pub len: u64,
}

#[derive(Debug, Clone)]
pub enum Segment {
    Bytes(Bytes),
    File { offset: u64, len: u64 },
}

/// Host name → site index, shared by TLS (for SNI) and the router (for `Host`).
#[derive(Debug, Clone)]
pub struct SiteTable {
    domains: Vec<DomainPattern>,
}

impl SiteTable {
    pub fn new(config: &Config) -> Self {
        Self {
            domains: config.sites.iter().map(|s| s.domain.clone()).collect(),
        }
    }

    /// Exact names first, then the longest matching wildcard, then the catch-all.
    pub fn lookup(&self, host: &str) -> Option<usize> {
        let host = host.trim_end_matches('.');
        let exact = self
            .domains
            .iter()
            .position(|d| matches!(d, DomainPattern::Exact(_)) && d.matches(host));
        exact
            .or_else(|| {
                self.domains
                    .iter()
                    .enumerate()
                    .filter_map(|(i, d)| match d {
                        DomainPattern::Wildcard(suffix) if d.matches(host) => Some((suffix.len(), i)),
                        _ => None,
                    })
                    .max()
                    .map(|(_, i)| i)
            })
            .or_else(|| self.domains.iter().position(|d| *d == DomainPattern::Any))
    }
}

/// The request head a driver hands to the service.
#[derive(Debug)]
pub struct RequestHead<'a> {
    pub method: &'a Method,
    pub uri: &'a Uri,
    pub version: Version,
    pub headers: &'a HeaderMap,
    /// The site whose certificate the connection presented (from SNI).
    pub tls_site: usize,
    /// The client's address, for forwarding headers.
    pub peer: std::net::SocketAddr,
    /// `false` when the driver cannot stream this request's body to an upstream
    /// (HTTP/1.1 on a connection opened for a file site); such a request with a body
    /// routed to the proxy gets 421, so the client retries on the proxy's own name.
    pub body_forwardable: bool,
}

impl RequestHead<'_> {
    /// Whether the request announces a body.
    pub fn has_body(&self) -> bool {
        self.headers.contains_key(header::TRANSFER_ENCODING)
            || self
                .headers
                .get(header::CONTENT_LENGTH)
                .is_some_and(|v| v.as_bytes() != b"0")
    }
}

#[derive(Debug)]
enum Handler {
    Files(Arc<Path>),
    Proxy(Proxy),
}

/// Routes requests to sites.
#[derive(Debug)]
pub struct Service {
    sites: SiteTable,
    serve: Vec<Handler>,
    /// `Alt-Svc` for h1/h2 responses of sites that also serve HTTP/3.
    alt_svc: Vec<Option<HeaderValue>>,
    /// Each site's WebTransport diagnostic endpoint, if it has one.
    webtransport: Vec<Option<Arc<crate::webtransport::Endpoint>>>,
    /// Whether some site offers WebTransport over HTTP/2 (extended CONNECT is then
    /// announced in HTTP/2 SETTINGS).
    webtransport_h2: bool,
    default_site: usize,
}

impl Service {
    /// Sets up every site; fails only when a proxy route's upstream TLS cannot be
    /// configured (its CA file), which `webship check` reports too.
    pub fn new(config: &Config) -> Result<Self, crate::proxy::ProxyError> {
        Ok(Self {
            sites: SiteTable::new(config),
            serve: config
                .sites
                .iter()
                .map(|s| {
                    Ok(match &s.serve {
                        Serve::Files(root) => Handler::Files(Arc::from(root.as_path())),
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
            default_site: config.default_site(),
        })
    }

    /// The site for connections without (or with an unknown) SNI.
    pub fn default_site(&self) -> usize {
        self.default_site
    }

    pub fn sites(&self) -> &SiteTable {
        &self.sites
    }

    /// Whether a site forwards to upstreams (its connections speak HTTP/1.1 through
    /// hyper, which streams request bodies both ways).
    pub fn is_proxy(&self, site: usize) -> bool {
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

    pub fn webtransport_h2(&self) -> bool {
        self.webtransport_h2
    }

    /// The WebTransport endpoint an extended CONNECT is for, if its site has one at
    /// that path.
    pub fn webtransport(&self, req: &RequestHead<'_>) -> Option<Arc<crate::webtransport::Endpoint>> {
        let site = self.site_of(req).ok()?;
        self.webtransport[site].clone().filter(|w| w.matches(req.uri))
    }

    pub async fn handle(&self, req: &RequestHead<'_>, body: StreamBody) -> Response {
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
            Handler::Files(root) => {
                crate::files::serve(root.clone(), req.method, req.uri.path(), req.headers).await
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

    fn table(domains: &[DomainPattern]) -> SiteTable {
        SiteTable {
            domains: domains.to_vec(),
        }
    }

    #[test]
    fn lookup_prefers_exact_then_longest_wildcard_then_any() {
        let t = table(&[
            DomainPattern::Wildcard(".example.com".into()),
            DomainPattern::Wildcard(".cdn.example.com".into()),
            DomainPattern::Exact("a.cdn.example.com".into()),
            DomainPattern::Any,
        ]);
        assert_eq!(t.lookup("A.CDN.example.com"), Some(2));
        assert_eq!(t.lookup("b.cdn.example.com"), Some(1));
        assert_eq!(t.lookup("x.example.com."), Some(0));
        assert_eq!(t.lookup("example.com"), Some(3));
        let no_default = table(&[DomainPattern::Exact("a.test".into())]);
        assert_eq!(no_default.lookup("b.test"), None);
    }

    #[test]
    fn ports_are_stripped() {
        assert_eq!(strip_port("a.test:8443"), "a.test");
        assert_eq!(strip_port("a.test"), "a.test");
        assert_eq!(strip_port("[::1]:443"), "::1");
        assert_eq!(strip_port("[::1]"), "::1");
    }
}
