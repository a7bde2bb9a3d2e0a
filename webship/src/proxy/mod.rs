//! Reverse proxy with TLS termination: a site whose routes forward to upstreams.
//!
//! A request is matched to the route with the longest `path_prefix`, inspected
//! (methods, denied paths, header size, body size and type) before any upstream sees
//! it, rewritten (hop-by-hop headers out; `X-Forwarded-*`, `Forwarded` and `Via` in),
//! and sent to the next healthy upstream in round-robin order over a pooled
//! keep-alive connection (HTTP/1.1 or h2c). Bodies stream both ways with hyper's
//! bounded buffers; the response body is relayed as it arrives, and an upstream that
//! dies mid-body ends the client's response as a protocol error. A client that goes
//! away drops the relayed body, which drops the upstream exchange at once.
//!
//! Health is passive: an upstream that refuses or times out a connection is ejected
//! for [`EJECT_FOR`]; idempotent requests without a body then retry on the next one.

mod headers;
mod inspect;

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderValue, Method, StatusCode};
use http_body::Frame;
use http_body_util::BodyExt;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use crate::config::{Route, UpstreamProtocol};
use crate::message::{empty_body, Body, BoxError, RequestHead, Response, StreamBody};

/// How long a failing upstream is skipped.
pub(crate) const EJECT_FOR: Duration = Duration::from_secs(10);
/// Idle pooled connections kept per upstream.
const POOL_IDLE_PER_UPSTREAM: usize = 64;

/// The proxy of one site (one domain): its routes and their upstream state.
#[derive(Debug)]
pub(crate) struct Proxy {
    domain: String,
    routes: Vec<RouteState>,
}

#[derive(Debug)]
struct RouteState {
    route: Route,
    client: Upstream,
    next: AtomicUsize,
    /// When each upstream may be tried again after a failure.
    ejected_until: Mutex<Vec<Option<Instant>>>,
}

impl Proxy {
    /// `routes` are sorted longest `path_prefix` first (config guarantees it).
    pub(crate) fn new(routes: &[Route], domain: String) -> Result<Self, ProxyError> {
        Ok(Self {
            domain,
            routes: routes.iter().map(RouteState::new).collect::<Result<_, _>>()?,
        })
    }

    pub(crate) async fn forward(&self, req: &RequestHead<'_>, body: StreamBody) -> Response {
        let path = req.uri.path();
        let Some(state) = self
            .routes
            .iter()
            .find(|r| path.starts_with(&r.route.path_prefix))
        else {
            return text(StatusCode::NOT_FOUND, "webship: no route for this path\n");
        };
        if let Err(refusal) = inspect::check(&state.route, req) {
            tracing::info!(target: "proxy", domain = %self.domain, peer = %req.peer, method = %req.method,
                path, status = refusal.status.as_u16(), reason = refusal.reason, "request refused");
            let mut resp = text(refusal.status, &format!("webship: {}\n", refusal.reason));
            if refusal.status == StatusCode::METHOD_NOT_ALLOWED {
                if let Ok(v) = HeaderValue::from_str(&state.route.allowed_methods.join(", ")) {
                    resp.headers.insert(http::header::ALLOW, v);
                }
            }
            return resp;
        }
        // A request that announces no body sends none: some fronts (h3) cannot tell an
        // empty body from one still coming, and a GET must not go out chunked.
        let body = if !req.has_body() && !matches!(*req.method, Method::POST | Method::PUT | Method::PATCH) {
            empty_body()
        } else {
            body
        };
        let body = match state.route.max_body_bytes {
            Some(max) => LimitedBody {
                inner: body,
                left: max,
            }
            .boxed_unsync(),
            None => body,
        };
        state.send(req, body, &self.domain).await
    }
}

/// The pooled client of one route: plain TCP, or TLS to the upstreams.
#[derive(Debug)]
enum Upstream {
    Plain(Client<HttpConnector, StreamBody>),
    Tls(Client<hyper_rustls::HttpsConnector<HttpConnector>, StreamBody>),
}

impl Upstream {
    fn request(&self, req: http::Request<StreamBody>) -> hyper_util::client::legacy::ResponseFuture {
        match self {
            Upstream::Plain(c) => c.request(req),
            Upstream::Tls(c) => c.request(req),
        }
    }
}

/// Why a route's upstream client could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("upstream CA `{path}`: {reason} (fix: point `upstream_ca` at a PEM file of CA certificates)")]
    Ca {
        path: std::path::PathBuf,
        reason: String,
    },
    #[error("`{0}` is not a valid upstream_tls_name (fix: use a DNS name)")]
    Name(String),
}

impl RouteState {
    fn new(route: &Route) -> Result<Self, ProxyError> {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(route.connect_timeout));
        connector.set_nodelay(true);
        let mut builder = Client::builder(TokioExecutor::new());
        builder
            .pool_timer(TokioTimer::new())
            .timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_max_idle_per_host(POOL_IDLE_PER_UPSTREAM);
        let client = match &route.upstream_protocol {
            UpstreamProtocol::H1 => {
                connector.enforce_http(true);
                Upstream::Plain(builder.build(connector))
            }
            UpstreamProtocol::H2c => {
                connector.enforce_http(true);
                builder.http2_only(true);
                Upstream::Plain(builder.build(connector))
            }
            UpstreamProtocol::H2 { ca, name } => {
                connector.enforce_http(false);
                builder.http2_only(true);
                Upstream::Tls(builder.build(tls_connector(connector, ca, name)?))
            }
        };
        Ok(Self {
            client,
            next: AtomicUsize::new(0),
            ejected_until: Mutex::new(vec![None; route.upstreams.len()]),
            route: route.clone(),
        })
    }

    /// Upstream indexes in the order to try: round-robin, healthy ones first.
    fn candidates(&self) -> Vec<usize> {
        let n = self.route.upstreams.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n.max(1);
        let now = Instant::now();
        let ejected = self.ejected_until.lock().map(|e| e.clone()).unwrap_or_default();
        let (mut healthy, mut sick): (Vec<usize>, Vec<usize>) = (0..n)
            .map(|i| (start + i) % n)
            .partition(|&i| ejected.get(i).copied().flatten().is_none_or(|t| t <= now));
        // When every upstream is ejected, try them anyway rather than fail blind.
        healthy.append(&mut sick);
        healthy
    }

    fn eject(&self, i: usize) {
        if let Ok(mut e) = self.ejected_until.lock() {
            if let Some(slot) = e.get_mut(i) {
                *slot = Some(Instant::now() + EJECT_FOR);
            }
        }
    }

    async fn send(&self, req: &RequestHead<'_>, body: StreamBody, domain: &str) -> Response {
        let retryable = is_idempotent(req.method) && !req.has_body();
        let mut body = Some(body);
        let mut tried = Vec::new();
        for i in self.candidates() {
            let upstream = self.route.upstreams[i];
            let Some(this_body) = body.take().or_else(|| retryable.then(empty_body)) else {
                break;
            };
            let request = match build_request(req, this_body, upstream, &self.route) {
                Ok(r) => r,
                Err(e) => return text(StatusCode::BAD_REQUEST, &format!("webship: {e}\n")),
            };
            tried.push(upstream.to_string());
            let sent = tokio::time::timeout(self.route.read_timeout, self.client.request(request)).await;
            match sent {
                Ok(Ok(resp)) => return relay(resp, self.route.read_timeout),
                Ok(Err(e)) if e.is_connect() => {
                    tracing::warn!(target: "proxy", %domain, %upstream, error = %chain(&e), "upstream unreachable; ejected");
                    self.eject(i);
                    if !retryable {
                        break;
                    }
                }
                Ok(Err(e)) => {
                    tracing::warn!(target: "proxy", %domain, %upstream, error = %chain(&e), "upstream exchange failed");
                    if limited(&e) {
                        return text(
                            StatusCode::PAYLOAD_TOO_LARGE,
                            "webship: request body over the route's max_body_bytes\n",
                        );
                    }
                    return text(
                        StatusCode::BAD_GATEWAY,
                        &format!("webship: upstream {upstream} failed: {e}\n"),
                    );
                }
                Err(_) => {
                    tracing::warn!(target: "proxy", %domain, %upstream, "upstream timed out; ejected");
                    self.eject(i);
                    return text(
                        StatusCode::GATEWAY_TIMEOUT,
                        &format!("webship: upstream {upstream} did not answer in time\n"),
                    );
                }
            }
        }
        text(
            StatusCode::BAD_GATEWAY,
            &format!(
                "webship: no upstream answered for `{domain}{}` (tried {})\n",
                self.route.path_prefix,
                tried.join(", ")
            ),
        )
    }
}

/// rustls towards the upstreams: only `ca` is trusted, certificates are checked for
/// `name` whatever address was dialled, and only h2 is offered.
fn tls_connector(
    http: HttpConnector,
    ca: &std::path::Path,
    name: &str,
) -> Result<hyper_rustls::HttpsConnector<HttpConnector>, ProxyError> {
    use rustls::pki_types::pem::PemObject;
    let ca_error = |reason: String| ProxyError::Ca {
        path: ca.to_owned(),
        reason,
    };
    let mut roots = rustls::RootCertStore::empty();
    let certs = rustls::pki_types::CertificateDer::pem_file_iter(ca).map_err(|e| ca_error(e.to_string()))?;
    for cert in certs {
        roots
            .add(cert.map_err(|e| ca_error(e.to_string()))?)
            .map_err(|e| ca_error(e.to_string()))?;
    }
    if roots.is_empty() {
        return Err(ca_error("no CERTIFICATE block found".into()));
    }
    let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(crate::tls::provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| ca_error(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let server_name = rustls::pki_types::ServerName::try_from(name.to_owned())
        .map_err(|_| ProxyError::Name(name.to_owned()))?;
    Ok(hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config)
        .https_only()
        .with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(server_name))
        .enable_http2()
        .wrap_connector(http))
}

/// An error and its sources on one line: hyper's own message is only the outer layer.
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

fn is_idempotent(m: &Method) -> bool {
    matches!(
        *m,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::PUT | Method::DELETE | Method::TRACE
    )
}

fn build_request(
    req: &RequestHead<'_>,
    body: StreamBody,
    upstream: SocketAddr,
    route: &Route,
) -> Result<http::Request<StreamBody>, http::Error> {
    let path_and_query = req.uri.path_and_query().map_or("/", |p| p.as_str());
    let path_and_query = match path_and_query.strip_prefix(route.path_prefix.as_str()) {
        Some(rest) if route.strip_prefix => format!("/{}", rest.trim_start_matches('/')),
        _ => path_and_query.to_owned(),
    };
    let scheme = match route.upstream_protocol {
        UpstreamProtocol::H2 { .. } => "https",
        _ => "http",
    };
    let uri = format!("{scheme}://{upstream}{path_and_query}");
    let mut out = http::Request::builder()
        .method(req.method.clone())
        .uri(uri)
        .body(body)?;
    *out.headers_mut() = headers::upstream_request(req, upstream, route);
    if route.upstream_protocol != UpstreamProtocol::H1 {
        *out.version_mut() = http::Version::HTTP_2;
    }
    Ok(out)
}

/// Turns the upstream's response into ours, relaying the body as it arrives.
fn relay(resp: http::Response<hyper::body::Incoming>, idle: Duration) -> Response {
    let (parts, body) = resp.into_parts();
    let headers = headers::downstream_response(&parts.headers, parts.version);
    let body = IdleTimeout {
        inner: body.map_err(|e| -> BoxError { Box::new(e) }).boxed_unsync(),
        idle,
        timer: None,
    };
    Response {
        status: parts.status,
        headers,
        body: Body::Stream(body.boxed_unsync()),
    }
}

fn text(status: StatusCode, message: &str) -> Response {
    let mut resp = Response::status(status);
    resp.headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp.headers
        .insert(http::header::CONTENT_LENGTH, HeaderValue::from(message.len()));
    resp.body = Body::Bytes(Bytes::copy_from_slice(message.as_bytes()));
    resp
}

/// The error a [`LimitedBody`] ends with, recognisable through hyper's error chain.
#[derive(Debug, thiserror::Error)]
#[error("request body over the route's max_body_bytes")]
struct BodyTooLarge;

fn limited(e: &hyper_util::client::legacy::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(s) = source {
        if s.is::<BodyTooLarge>() {
            return true;
        }
        source = s.source();
    }
    false
}

/// Ends a request body with an error once it exceeds the route's limit, so the
/// upstream sees an aborted request rather than a truncated one.
struct LimitedBody {
    inner: StreamBody,
    left: u64,
}

impl http_body::Body for LimitedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let frame = std::task::ready!(Pin::new(&mut self.inner).poll_frame(cx));
        if let Some(Ok(f)) = &frame {
            if let Some(data) = f.data_ref() {
                let n = data.len() as u64;
                if n > self.left {
                    return Poll::Ready(Some(Err(Box::new(BodyTooLarge))));
                }
                self.left -= n;
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Fails a relayed body whose upstream sends nothing for `idle`.
struct IdleTimeout {
    inner: StreamBody,
    idle: Duration,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl http_body::Body for IdleTimeout {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                this.timer = None;
                if let Some(Err(e)) = &frame {
                    tracing::debug!(target: "proxy", error = %e, "upstream body failed");
                }
                Poll::Ready(frame)
            }
            Poll::Pending => {
                let idle = this.idle;
                let timer = this
                    .timer
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(idle)));
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Some(Err("upstream body stalled".into()))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

use std::future::Future as _;
