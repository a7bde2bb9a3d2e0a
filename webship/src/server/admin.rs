//! The admin listener (`[admin] listen`): plain HTTP/1.1 for a metrics scraper and
//! health checks, apart from the traffic listener and its limits.
//!
//! - `GET /metrics`: every metric (Prometheus text; OpenMetrics when `Accept` asks);
//! - `GET /healthz`: 200 while the process answers at all (liveness);
//! - `GET /readyz`: 200 while serving (preflight passed, listeners bound, privileges
//!   dropped) and not draining; 503 during the drain after SIGTERM and while a
//!   takeover hands the sockets over.
//!
//! Bound before the switch to the service account (a low port needs root) and served
//! after it, like the other listeners. Bounded: [`MAX_CONNECTIONS`] at once (more
//! are closed on accept), a header timeout, [`CONNECTION_LIFETIME`] per connection,
//! GET and HEAD only, no request body read. With a token (`token_file`, required for a
//! non-loopback address), every request must carry `Authorization: Bearer <token>`,
//! compared in constant time.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::config::Admin;
use crate::metrics::{Format, Registry};

/// Admin connections served at once; a scraper and a health checker or two.
const MAX_CONNECTIONS: usize = 8;
/// How long a request head may take to arrive.
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one connection is kept, however busy (a scraper reconnects).
const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("cannot listen on {addr} for [admin]: {source} (fix: choose a free port for `[admin] listen`)")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("[admin] token_file: {0}")]
    Token(String),
}

/// The bound admin listener, not serving yet.
#[derive(Debug)]
pub(super) struct AdminListener {
    listener: TcpListener,
    token: Option<Arc<str>>,
}

impl AdminListener {
    /// Binds `admin.listen` and reads the token (while still root).
    pub(super) fn bind(admin: &Admin) -> Result<Self, AdminError> {
        let token = match &admin.token_file {
            Some(path) => Some(
                crate::config::read_admin_token(path)
                    .map_err(AdminError::Token)?
                    .into(),
            ),
            None => None,
        };
        let bind = || {
            let socket = socket2::Socket::new(
                socket2::Domain::for_address(admin.listen),
                socket2::Type::STREAM,
                Some(socket2::Protocol::TCP),
            )?;
            socket.set_reuse_address(true)?;
            // A process taking over binds beside its predecessor, which closes its
            // own admin listener once the sockets are handed over.
            socket.set_reuse_port(true)?;
            socket.set_nonblocking(true)?;
            socket.bind(&admin.listen.into())?;
            socket.listen(64)?;
            TcpListener::from_std(socket.into())
        };
        let listener = bind().map_err(|source| AdminError::Bind {
            addr: admin.listen,
            source,
        })?;
        Ok(Self { listener, token })
    }

    pub(super) fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.local_addr().ok()
    }

    /// Serves until the task is aborted (at the end of the drain).
    pub(super) async fn serve(self, registry: Arc<Registry>) {
        let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
        loop {
            // At the limit, new scrapers wait in the kernel's backlog rather than being
            // closed: a full set of idle connections delays a probe, it does not fail it.
            let Ok(permit) = permits.clone().acquire_owned().await else {
                return;
            };
            let (tcp, peer) = match self.listener.accept().await {
                Ok(conn) => conn,
                Err(e) => {
                    tracing::debug!(error = %e, "admin: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let (registry, token) = (registry.clone(), self.token.clone());
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| {
                    let resp = answer(&req, &registry, token.as_deref());
                    async move { Ok::<_, std::convert::Infallible>(resp) }
                });
                let mut builder = hyper::server::conn::http1::Builder::new();
                builder
                    .timer(TokioTimer::new())
                    .header_read_timeout(HEADER_TIMEOUT)
                    .max_buf_size(16 * 1024);
                let conn = builder.serve_connection(TokioIo::new(tcp), service);
                if let Ok(Err(e)) = tokio::time::timeout(CONNECTION_LIFETIME, conn).await {
                    tracing::debug!(%peer, error = %e, "admin: connection ended with an error");
                }
                drop(permit);
            });
        }
    }
}

/// The answer to one admin request.
fn answer<B>(req: &Request<B>, registry: &Registry, token: Option<&str>) -> Response<Full<Bytes>> {
    if let Some(token) = token {
        // The scheme is case-insensitive (RFC 9110 §11.1).
        let sent = req
            .headers()
            .get(header::AUTHORIZATION)
            .map(HeaderValue::as_bytes)
            .filter(|v| v.len() > 7 && v[..7].eq_ignore_ascii_case(b"bearer "))
            .map(|v| &v[7..]);
        if !sent.is_some_and(|sent| same(sent, token.as_bytes())) {
            let mut resp = text(StatusCode::UNAUTHORIZED, "a bearer token is required\n");
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            // A client without the token does not keep one of the few connections.
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            return resp;
        }
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut resp = text(StatusCode::METHOD_NOT_ALLOWED, "GET only\n");
        resp.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return resp;
    }
    let head = req.method() == Method::HEAD;
    let mut resp = match req.uri().path() {
        "/metrics" => {
            let accept = req.headers().get(header::ACCEPT).and_then(|v| v.to_str().ok());
            let format = Format::negotiate(accept);
            let mut resp = Response::new(Full::new(Bytes::from(registry.render(format))));
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static(format.content_type()),
            );
            resp
        }
        "/healthz" => text(StatusCode::OK, "ok\n"),
        "/readyz" if registry.is_ready() => text(StatusCode::OK, "ready\n"),
        "/readyz" => text(
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: starting, draining or handing over\n",
        ),
        _ => text(StatusCode::NOT_FOUND, "not found: /metrics, /healthz, /readyz\n"),
    };
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    if head {
        *resp.body_mut() = Full::new(Bytes::new());
    }
    resp
}

fn text(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}

/// Whether `a` equals `b`, in time that gives away neither the first differing byte
/// nor the token's length: every byte up to the longest token a file may hold is
/// compared (missing bytes as zero), and the lengths are compared along with them.
fn same(a: &[u8], b: &[u8]) -> bool {
    const SPAN: usize = crate::config::MAX_TOKEN_BYTES as usize;
    if a.len() > SPAN || b.len() > SPAN {
        return false;
    }
    let at = |s: &[u8], i: usize| s.get(i).copied().unwrap_or(0);
    let lengths = (a.len() ^ b.len())
        .to_le_bytes()
        .iter()
        .fold(0u8, |acc, x| acc | x);
    let diff = (0..SPAN).fold(lengths, |acc, i| acc | (at(a, i) ^ at(b, i)));
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(path: &str, auth: Option<&str>) -> Request<()> {
        let mut b = Request::get(path);
        if let Some(a) = auth {
            b = b.header(header::AUTHORIZATION, a);
        }
        b.body(()).unwrap()
    }

    #[test]
    fn readyz_follows_the_registry_and_a_token_is_checked() {
        let registry = Registry::new();
        assert_eq!(answer(&get("/readyz", None), &registry, None).status(), 503);
        registry.set_ready(true);
        assert_eq!(answer(&get("/readyz", None), &registry, None).status(), 200);
        assert_eq!(answer(&get("/healthz", None), &registry, None).status(), 200);
        assert_eq!(answer(&get("/nope", None), &registry, None).status(), 404);
        let token = Some("0123456789abcdef");
        assert_eq!(answer(&get("/metrics", None), &registry, token).status(), 401);
        let wrong = Some("Bearer 0123456789abcdeX");
        assert_eq!(answer(&get("/metrics", wrong), &registry, token).status(), 401);
        let right = Some("Bearer 0123456789abcdef");
        let resp = answer(&get("/metrics", right), &registry, token);
        assert_eq!(resp.status(), 200);
        assert_eq!(
            resp.headers()[header::CONTENT_TYPE],
            "text/plain; version=0.0.4; charset=utf-8"
        );
        let post = Request::post("/metrics").body(()).unwrap();
        assert_eq!(answer(&post, &registry, None).status(), 405);
    }
}
