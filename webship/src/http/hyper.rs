//! hyper-driven connections: HTTP/2 always (over a bounded write batch), and
//! HTTP/1.1 for proxy sites ([`serve_h1`]).
//!
//! Responses are the seam's [`ResponseBody`], which hyper polls: a stream's file body
//! is read only when the stream has send capacity (flow control is h2's), and at most
//! `h2.max_send_buffer_bytes` wait per stream beyond its window.
//! DATA frames collect in the connection's [`WriteBatch`] (`h2_tls_write_buffer_bytes`,
//! 128 KiB by default: two 64 KiB frames) before rustls encrypts them. Memory per
//! connection is therefore bounded by `max_concurrent_streams × (max_send_buffer +
//! STREAM_CHUNK)` plus the batch and rustls' buffers.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::server::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};

use super::h2_guard::{guard_limits, H2Guard};
use super::WriteBatch;
use crate::exchange::{ConnContext, ResponseBody};
use crate::files::cursor::STREAM_CHUNK;
use crate::ktls::RustlsStream;
use crate::message::{BoxError, Response};

#[derive(Debug, thiserror::Error)]
pub(crate) enum HyperError {
    #[error("hyper: {0}")]
    Hyper(#[from] hyper::Error),
}

/// Serves one HTTP/2 connection until the client closes it, it idles out, or
/// shutdown is requested (then GOAWAY and the open streams finish).
pub(crate) async fn serve_h2(mut stream: RustlsStream, ctx: ConnContext) -> Result<(), HyperError> {
    // HTTP/2 never moves to kernel TLS: let rustls read whole socket buffers.
    stream.get_mut().0.unbound();
    let settings = ctx.h2;
    let limits = ctx.limits;
    let mut builder = http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .initial_stream_window_size(settings.initial_stream_window_bytes)
        .initial_connection_window_size(settings.initial_connection_window_bytes)
        .max_frame_size(settings.max_frame_size_bytes)
        .max_concurrent_streams(settings.max_concurrent_streams)
        .max_send_buf_size(settings.max_send_buffer_bytes)
        .max_header_list_size(u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX))
        // Rapid reset (CVE-2023-44487): streams the client resets before hyper takes
        // them, and streams h2 itself resets for errors, end the connection with
        // ENHANCE_YOUR_CALM past these counts (h2's defaults, stated here); the
        // guard bounds resets of streams already taken.
        .max_pending_accept_reset_streams(20)
        .max_local_error_reset_streams(1024)
        .keep_alive_interval(Some(limits.idle_timeout / 2))
        .keep_alive_timeout(Duration::from_secs(20));
    if ctx.service.webtransport_h2() {
        // RFC 8441 extended CONNECT, which WebTransport over HTTP/2 opens sessions with.
        builder.enable_connect_protocol();
    }

    // A proxy site's streams relay upstream bodies: the proxy budget bounds them, and
    // the connection's total (`proxy_h2_tls_connection_send_buffer_bytes`) caps how
    // many may run at once.
    if ctx.service.is_proxy(ctx.client.tls_site) {
        let per_stream = ctx.proxy_h2.tls_max_send_buffer_bytes;
        let streams = (ctx.proxy_h2.tls_connection_send_buffer_bytes / per_stream.max(1)).max(1);
        builder.max_send_buf_size(per_stream).max_concurrent_streams(
            u32::try_from(streams)
                .unwrap_or(u32::MAX)
                .min(settings.max_concurrent_streams),
        );
    }
    let active = Arc::new(AtomicUsize::new(0));
    let io = WriteBatch::new(stream, settings.tls_write_buffer_bytes);
    let io = TokioIo::new(H2Guard::new(io, guard_limits(&ctx)));
    let conn = builder.serve_connection(io, service(&ctx, &active));
    tokio::pin!(conn);
    drive(conn, |c| c.graceful_shutdown(), &active, &ctx).await
}

/// Serves HTTP/1.1 through hyper, for connections whose certificate names a proxy
/// site: hyper streams request bodies (chunked or sized) and relays trailers, which
/// the file-serving driver does not need to.
pub(crate) async fn serve_h1(mut stream: RustlsStream, ctx: ConnContext) -> Result<(), HyperError> {
    stream.get_mut().0.unbound();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(ctx.limits.header_read_timeout)
        .max_buf_size(ctx.limits.max_header_bytes.max(8192));
    let active = Arc::new(AtomicUsize::new(0));
    let conn = builder.serve_connection(TokioIo::new(stream), service(&ctx, &active));
    tokio::pin!(conn);
    drive(conn, |c| c.graceful_shutdown(), &active, &ctx).await
}

type HandlerFuture = Pin<Box<dyn Future<Output = Result<http::Response<HyperBody>, Infallible>> + Send>>;

/// The hyper service of one connection: every request goes to the shared Service.
#[derive(Debug, Clone)]
struct Handler {
    ctx: ConnContext,
    active: Arc<AtomicUsize>,
}

impl hyper::service::Service<http::Request<hyper::body::Incoming>> for Handler {
    type Response = http::Response<HyperBody>;
    type Error = Infallible;
    type Future = HandlerFuture;

    fn call(&self, req: http::Request<hyper::body::Incoming>) -> Self::Future {
        let ctx = self.ctx.clone();
        let guard = InFlight::new(self.active.clone());
        Box::pin(async move { Ok(handle(req, &ctx, guard).await) })
    }
}

fn service(ctx: &ConnContext, active: &Arc<AtomicUsize>) -> Handler {
    Handler {
        ctx: ctx.clone(),
        active: active.clone(),
    }
}

/// Runs a hyper connection until it ends, shutting it down gracefully on shutdown
/// or after `idle_timeout` without a request in flight.
async fn drive<C, G>(
    mut conn: Pin<&mut C>,
    graceful: G,
    active: &AtomicUsize,
    ctx: &ConnContext,
) -> Result<(), HyperError>
where
    C: Future<Output = Result<(), hyper::Error>>,
    G: Fn(Pin<&mut C>),
{
    let mut shutdown = ctx.shutdown.clone();
    let mut idle_check = tokio::time::interval(Duration::from_secs(1));
    let mut idle_since = tokio::time::Instant::now();
    let mut closing = false;
    loop {
        tokio::select! {
            result = conn.as_mut() => return result.map_err(HyperError::from),
            () = shutdown.requested(), if !closing => {
                closing = true;
                graceful(conn.as_mut());
            }
            _ = idle_check.tick(), if !closing => {
                if active.load(Ordering::Acquire) > 0 {
                    idle_since = tokio::time::Instant::now();
                } else if idle_since.elapsed() >= ctx.limits.idle_timeout {
                    closing = true;
                    graceful(conn.as_mut());
                }
            }
        }
    }
}

async fn handle(
    mut req: http::Request<hyper::body::Incoming>,
    ctx: &ConnContext,
    guard: InFlight,
) -> http::Response<HyperBody> {
    let webtransport = req.method() == http::Method::CONNECT
        && req
            .extensions()
            .get::<hyper::ext::Protocol>()
            .is_some_and(|p| p.as_str() == "webtransport");
    if webtransport {
        let upgrade = hyper::upgrade::on(&mut req);
        return webtransport_connect(req, upgrade, ctx, guard);
    }
    let (parts, body) = req.into_parts();
    let head = ctx.head(&parts.method, &parts.uri, parts.version, &parts.headers);
    let body = body.map_err(|e| -> BoxError { Box::new(e) }).boxed_unsync();
    let resp = ctx.handle(&head, body).await;
    into_hyper(resp, guard)
}

/// A WebTransport extended CONNECT: admitted, the session runs on the stream's bytes
/// (hyper's upgrade) in its own task, counted as a request in flight meanwhile.
fn webtransport_connect(
    req: http::Request<hyper::body::Incoming>,
    upgrade: hyper::upgrade::OnUpgrade,
    ctx: &ConnContext,
    guard: InFlight,
) -> http::Response<HyperBody> {
    let (parts, _body) = req.into_parts();
    let head = ctx.head(&parts.method, &parts.uri, parts.version, &parts.headers);
    let admitted = ctx.admit_webtransport(&head);
    let resp = ctx.webtransport_response(&admitted);
    if let Ok(admission) = admitted {
        let session_guard = InFlight::new(guard.0.clone());
        let (shutdown, peer) = (ctx.shutdown.clone(), ctx.peer());
        tokio::spawn(async move {
            match upgrade.await {
                Ok(upgraded) => {
                    crate::webtransport::h2::run(TokioIo::new(upgraded), admission, shutdown).await
                }
                Err(e) => tracing::debug!(%peer, error = %e, "h2: WebTransport upgrade failed"),
            }
            drop(session_guard);
        });
    }
    into_hyper(resp, guard)
}

fn into_hyper(resp: Response, guard: InFlight) -> http::Response<HyperBody> {
    let (head, body) = resp.into_http();
    head.map(|()| HyperBody {
        body: ResponseBody::new(body, STREAM_CHUNK),
        _guard: guard,
    })
}

/// Counts a request as in flight until its response body is dropped.
#[derive(Debug)]
struct InFlight(Arc<AtomicUsize>);

impl InFlight {
    fn new(counter: Arc<AtomicUsize>) -> Self {
        counter.fetch_add(1, Ordering::AcqRel);
        Self(counter)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The seam's response body, counted in flight while hyper holds it. A body error
/// makes hyper reset the stream (h2) or close the connection mid-message (h1).
#[derive(Debug)]
pub(crate) struct HyperBody {
    body: ResponseBody,
    _guard: InFlight,
}

impl http_body::Body for HyperBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
