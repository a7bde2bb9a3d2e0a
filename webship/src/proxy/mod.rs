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
//! The path is normalized once ([`path`]): the upstream gets that normal form, and
//! routes and `deny_paths` match its fully decoded form without `;` parameters, the
//! spelling no origin reads differently. Connections per upstream are capped, with a queue timeout
//! ([`upstream`]); the wait for a response head starts when the request has gone,
//! and a stalled upload is the client's (408) or the upstream's fault, never both.
//!
//! Health is passive: an upstream that refuses or times out a connection, answers
//! garbage or sends no response head in time is ejected for [`EJECT_FOR`];
//! idempotent requests without a body then retry on the next one. Local shortages
//! (descriptors, buffers) and slow clients eject nothing. Error bodies name no
//! upstream: the log does.

mod body;
mod headers;
mod inspect;
mod metrics;
pub(crate) mod path;
mod upstream;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderValue, Method, StatusCode};
use http_body_util::BodyExt;
use hyper_util::client::legacy::connect::capture_connection;

use crate::config::{Route, UpstreamProtocol};
use crate::message::{empty_body, Body, BoxError, RequestHead, Response, StreamBody};

use body::{LimitedBody, RelayBody, Upload, Waiting};
pub(crate) use metrics::Metrics;
use metrics::{ErrorKind, UpstreamMetrics};
use upstream::{Fault, Upstream};

/// How long a failing upstream is skipped.
pub(crate) const EJECT_FOR: Duration = Duration::from_secs(10);

/// Which upstream a forwarded request went to last (after any retries), and how
/// long it took from sending the request to the upstream's response head (`None`
/// when no head came): what the access log prints as `upstream` and `upstream_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct UpstreamReport {
    pub(crate) addr: SocketAddr,
    pub(crate) head: Option<Duration>,
}

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
    /// Each upstream's metrics slot, by index.
    metrics: Vec<std::sync::Arc<UpstreamMetrics>>,
}

impl Proxy {
    /// `routes` are sorted longest `path_prefix` first (config guarantees it).
    pub(crate) fn new(routes: &[Route], domain: String) -> Result<Self, ProxyError> {
        Ok(Self {
            domain,
            routes: routes.iter().map(RouteState::new).collect::<Result<_, _>>()?,
        })
    }

    /// The response, and the upstream that gave it (or failed to) when one was tried.
    pub(crate) async fn forward(
        &self,
        req: &RequestHead<'_>,
        body: StreamBody,
    ) -> (Response, Option<UpstreamReport>) {
        // One spelling of the path for the origin, or 400.
        let path = match path::normalize(req.uri.path()) {
            Ok(p) => p,
            Err(e) => {
                tracing::info!(target: "proxy", domain = %self.domain, peer = %req.peer, method = %req.method,
                    path = req.uri.path(), status = 400, reason = %e, "request refused");
                return (
                    text(StatusCode::BAD_REQUEST, &format!("webship: the path has {e}\n")),
                    None,
                );
            }
        };
        let path = path.as_str();
        // Routes and filters match the spelling every origin reads alike; the
        // upstream gets the normal form.
        let matched = path::match_form(path);
        let Some(state) = self
            .routes
            .iter()
            .find(|r| matched.starts_with(&r.route.path_prefix))
        else {
            return (
                text(StatusCode::NOT_FOUND, "webship: no route for this path\n"),
                None,
            );
        };
        if let Err(refusal) = inspect::check(&state.route, req, &matched) {
            tracing::info!(target: "proxy", domain = %self.domain, peer = %req.peer, method = %req.method,
                path, status = refusal.status.as_u16(), reason = refusal.reason, "request refused");
            let mut resp = text(refusal.status, &format!("webship: {}\n", refusal.reason));
            if refusal.status == StatusCode::METHOD_NOT_ALLOWED {
                if let Ok(v) = HeaderValue::from_str(&state.route.allowed_methods.join(", ")) {
                    resp.headers.insert(http::header::ALLOW, v);
                }
            }
            return (resp, None);
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
        state.send(req, path, body, &self.domain).await
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
        Ok(Self {
            client: Upstream::new(route)?,
            next: AtomicUsize::new(0),
            ejected_until: Mutex::new(vec![None; route.upstreams.len()]),
            metrics: route.upstreams.iter().map(|&u| metrics::slot(u)).collect(),
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

    async fn send(
        &self,
        req: &RequestHead<'_>,
        path: &str,
        body: StreamBody,
        domain: &str,
    ) -> (Response, Option<UpstreamReport>) {
        let retryable = is_idempotent(req.method) && !req.has_body();
        let mut body = Some(body);
        let mut tried = None;
        for i in self.candidates() {
            let upstream = self.route.upstreams[i];
            let Some(this_body) = body.take().or_else(|| retryable.then(empty_body)) else {
                break;
            };
            let bodiless = http_body::Body::is_end_stream(&this_body);
            let upload = Upload::new();
            let this_body = upload.watch(this_body).boxed_unsync();
            let request = match build_request(req, path, this_body, upstream, &self.route) {
                Ok(r) => r,
                Err(e) => {
                    tracing::info!(target: "proxy", %domain, %upstream, error = %e, "request cannot be forwarded");
                    let resp = text(
                        StatusCode::BAD_REQUEST,
                        "webship: the request cannot be forwarded\n",
                    );
                    return (resp, tried);
                }
            };
            let sent = Instant::now();
            let failed = match self.exchange(request, &upload, bodiless).await {
                Ok(resp) => {
                    let head = sent.elapsed();
                    self.metrics[i].responded(head);
                    let report = UpstreamReport {
                        addr: upstream,
                        head: Some(head),
                    };
                    return (
                        relay(resp, req.method, self.route.body_idle_timeout),
                        Some(report),
                    );
                }
                Err(failed) => failed,
            };
            tried = Some(UpstreamReport {
                addr: upstream,
                head: None,
            });
            // An unreachable upstream is the only failure another upstream may fix.
            if let Some(resp) = self.answer(failed, i, domain) {
                return (resp, tried);
            }
            if !retryable {
                break;
            }
        }
        (
            text(StatusCode::BAD_GATEWAY, "webship: no upstream answered\n"),
            tried,
        )
    }

    /// What the client gets for a failed exchange with upstream `i`, ejecting it
    /// for its own faults; `None` when the next upstream may be tried.
    fn answer(&self, failed: Failed, i: usize, domain: &str) -> Option<Response> {
        let upstream = self.route.upstreams[i];
        let late = || {
            text(
                StatusCode::GATEWAY_TIMEOUT,
                "webship: the upstream did not answer in time\n",
            )
        };
        let failed_text = || text(StatusCode::BAD_GATEWAY, "webship: the upstream failed\n");
        let metrics = &self.metrics[i];
        let e = match failed {
            Failed::Timeout(waiting) => {
                tracing::warn!(target: "proxy", %domain, %upstream, ?waiting, "upstream exchange timed out");
                metrics.error(match waiting {
                    Waiting::Client => ErrorKind::ClientTimeout,
                    Waiting::Connection => ErrorKind::ConnectTimeout,
                    Waiting::Response | Waiting::UpstreamReading => ErrorKind::ResponseTimeout,
                });
                return Some(match waiting {
                    Waiting::Client => {
                        text(StatusCode::REQUEST_TIMEOUT, "webship: the request body stalled\n")
                    }
                    Waiting::Connection => late(),
                    Waiting::Response | Waiting::UpstreamReading => {
                        self.eject(i, domain, upstream, "no answer in time");
                        late()
                    }
                });
            }
            Failed::Error(e) => e,
        };
        let fault = upstream::classify(&e);
        tracing::warn!(target: "proxy", %domain, %upstream, ?fault, error = %chain(&e), "upstream exchange failed");
        metrics.error(match fault {
            Fault::Unreachable => ErrorKind::Unreachable,
            Fault::QueueFull => ErrorKind::QueueFull,
            Fault::Local => ErrorKind::Local,
            Fault::TooLarge => ErrorKind::TooLarge,
            Fault::Client => ErrorKind::ClientBody,
            Fault::Garbage => ErrorKind::Garbage,
            Fault::Broken => ErrorKind::Broken,
        });
        Some(match fault {
            Fault::Unreachable => {
                self.eject(i, domain, upstream, "unreachable");
                return None;
            }
            Fault::QueueFull | Fault::Local => {
                let mut resp = text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "webship: the upstream is busy; try again later\n",
                );
                resp.headers
                    .insert(http::header::RETRY_AFTER, HeaderValue::from_static("1"));
                resp
            }
            Fault::TooLarge => text(
                StatusCode::PAYLOAD_TOO_LARGE,
                "webship: request body over the route's max_body_bytes\n",
            ),
            Fault::Client => text(StatusCode::BAD_REQUEST, "webship: the request body failed\n"),
            Fault::Garbage => {
                self.eject(i, domain, upstream, "not HTTP");
                failed_text()
            }
            Fault::Broken => failed_text(),
        })
    }

    fn eject(&self, i: usize, domain: &str, upstream: SocketAddr, why: &str) {
        tracing::warn!(target: "proxy", %domain, %upstream, why, "upstream ejected for {} s", EJECT_FOR.as_secs());
        self.metrics[i].ejected();
        if let Ok(mut e) = self.ejected_until.lock() {
            if let Some(slot) = e.get_mut(i) {
                *slot = Some(Instant::now() + EJECT_FOR);
            }
        }
    }

    /// One request to one upstream, up to its response head. Queue and connect are
    /// bounded by the connector; then the upload may pause up to `body_idle_timeout`
    /// at a time, and the head must come within `response_timeout` of the request's
    /// end.
    async fn exchange(
        &self,
        mut request: http::Request<StreamBody>,
        upload: &Upload,
        bodiless: bool,
    ) -> Result<http::Response<hyper::body::Incoming>, Failed> {
        let mut captured = capture_connection(&mut request);
        let sent = self.client.request(request);
        tokio::pin!(sent);
        // A backstop only: the connector gives up on its own before this.
        let connecting = self.route.queue_timeout + self.route.connect_timeout + Duration::from_secs(1);
        tokio::select! {
            r = &mut sent => return r.map_err(Failed::Error),
            _ = captured.wait_for_connection_metadata() => upload.connected(bodiless),
            _ = tokio::time::sleep(connecting) => return Err(Failed::Timeout(Waiting::Connection)),
        }
        loop {
            let (deadline, _) = upload.deadline(self.route.response_timeout, self.route.body_idle_timeout);
            tokio::select! {
                r = &mut sent => return r.map_err(Failed::Error),
                _ = tokio::time::sleep_until(deadline.into()) => {
                    let (deadline, waiting) =
                        upload.deadline(self.route.response_timeout, self.route.body_idle_timeout);
                    if deadline <= Instant::now() {
                        return Err(Failed::Timeout(waiting));
                    }
                }
            }
        }
    }
}

/// How an exchange failed before a response head.
#[derive(Debug)]
enum Failed {
    Timeout(Waiting),
    Error(hyper_util::client::legacy::Error),
}

/// rustls towards the upstreams: only `ca` is trusted, certificates are checked for
/// `name` whatever address was dialled, and only h2 is offered.
fn tls_connector(
    http: upstream::CappedConnector,
    ca: &std::path::Path,
    name: &str,
) -> Result<hyper_rustls::HttpsConnector<upstream::CappedConnector>, ProxyError> {
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

/// The upstream request: the normalized `path` (less the route's prefix, as the
/// client spelled it, with `strip_prefix`) and the query as the client sent it.
fn build_request(
    req: &RequestHead<'_>,
    path: &str,
    body: StreamBody,
    upstream: SocketAddr,
    route: &Route,
) -> Result<http::Request<StreamBody>, http::Error> {
    let path = if route.strip_prefix {
        path::strip_prefix(path, &route.path_prefix).unwrap_or_else(|| path.to_owned())
    } else {
        path.to_owned()
    };
    let path_and_query = match req.uri.query() {
        Some(q) => format!("{path}?{q}"),
        None => path,
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

/// Turns the upstream's response into ours, relaying the body as it arrives. A
/// `Content-Length` goes to the client only when it frames the body: never beside a
/// `Transfer-Encoding` (RFC 9112 §6.3: the length is then wrong, and a client on a
/// keep-alive connection would take the surplus for the next response), and the
/// body is checked against it.
fn relay(resp: http::Response<hyper::body::Incoming>, method: &Method, idle: Duration) -> Response {
    let (parts, body) = resp.into_parts();
    let mut headers = headers::downstream_response(&parts.headers, parts.version);
    if parts.headers.contains_key(http::header::TRANSFER_ENCODING) {
        headers.remove(http::header::CONTENT_LENGTH);
    }
    let bodiless = *method == Method::HEAD
        || parts.status.is_informational()
        || parts.status == StatusCode::NO_CONTENT
        || parts.status == StatusCode::NOT_MODIFIED;
    let lengths: Vec<&HeaderValue> = headers.get_all(http::header::CONTENT_LENGTH).iter().collect();
    let expected = match lengths.as_slice() {
        [] => None,
        [one] => match one.to_str().ok().and_then(|v| v.trim().parse::<u64>().ok()) {
            Some(n) => Some(n),
            None => {
                headers.remove(http::header::CONTENT_LENGTH);
                None
            }
        },
        _ => {
            headers.remove(http::header::CONTENT_LENGTH);
            None
        }
    };
    let body = RelayBody {
        inner: body.map_err(|e| -> BoxError { Box::new(e) }).boxed_unsync(),
        idle,
        timer: None,
        expected: expected.filter(|_| !bodiless),
        seen: 0,
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
