//! hyper-driven connections: HTTP/2 always (over a bounded write batch), and
//! HTTP/1.1 for proxy sites ([`serve_h1`]).
//!
//! Flow control is h2's: a stream's file body is read only when the stream has send
//! capacity, and at most `h2.max_send_buffer_bytes` wait per stream beyond its window.
//! DATA frames collect in the connection's [`WriteBatch`] (`h2_tls_write_buffer_bytes`,
//! 128 KiB by default: two 64 KiB frames) before rustls encrypts them. Memory per
//! connection is therefore bounded by `max_concurrent_streams × (max_send_buffer +
//! FILE_CHUNK)` plus the batch and rustls' buffers.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use hyper::server::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::task::JoinHandle;

use super::{ConnContext, WriteBatch, SERVER};
use crate::ktls::RustlsStream;
use crate::service::{Body, BoxError, FileBody, RequestHead, Response, Segment, StreamBody};
use http_body_util::BodyExt;

/// File bytes read per DATA production step.
const FILE_CHUNK: usize = 128 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum H2Error {
    #[error("http2: {0}")]
    Hyper(#[from] hyper::Error),
}

/// Serves one HTTP/2 connection until the client closes it, it idles out, or
/// shutdown is requested (then GOAWAY and the open streams finish).
pub async fn serve(mut stream: RustlsStream, ctx: ConnContext) -> Result<(), H2Error> {
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
        .keep_alive_interval(Some(limits.idle_timeout / 2))
        .keep_alive_timeout(Duration::from_secs(20));
    if ctx.service.webtransport_h2() {
        // RFC 8441 extended CONNECT, which WebTransport over HTTP/2 opens sessions with.
        builder.enable_connect_protocol();
    }

    // A proxy site's streams relay upstream bodies: the proxy budget bounds them, and
    // the connection's total (`proxy_h2_tls_connection_send_buffer_bytes`) caps how
    // many may run at once.
    if ctx.service.is_proxy(ctx.tls_site) {
        let per_stream = ctx.proxy_h2.tls_max_send_buffer_bytes;
        let streams = (ctx.proxy_h2.tls_connection_send_buffer_bytes / per_stream.max(1)).max(1);
        builder.max_send_buf_size(per_stream).max_concurrent_streams(
            u32::try_from(streams)
                .unwrap_or(u32::MAX)
                .min(settings.max_concurrent_streams),
        );
    }
    let active = Arc::new(AtomicUsize::new(0));
    let io = TokioIo::new(WriteBatch::new(stream, settings.tls_write_buffer_bytes));
    let conn = builder.serve_connection(io, service(&ctx, &active));
    tokio::pin!(conn);
    drive(conn, |c| c.graceful_shutdown(), &active, &ctx).await
}

/// Serves HTTP/1.1 through hyper, for connections whose certificate names a proxy
/// site: hyper streams request bodies (chunked or sized) and relays trailers, which
/// the file-serving driver does not need to.
pub async fn serve_h1(mut stream: RustlsStream, ctx: ConnContext) -> Result<(), H2Error> {
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

type HandlerFuture = Pin<Box<dyn Future<Output = Result<http::Response<ResponseBody>, Infallible>> + Send>>;

/// The hyper service of one connection: every request goes to the shared Service.
#[derive(Debug, Clone)]
struct Handler {
    ctx: ConnContext,
    active: Arc<AtomicUsize>,
}

impl hyper::service::Service<http::Request<hyper::body::Incoming>> for Handler {
    type Response = http::Response<ResponseBody>;
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
) -> Result<(), H2Error>
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
            result = conn.as_mut() => return result.map_err(H2Error::from),
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
) -> http::Response<ResponseBody> {
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
    let head = request_head(&parts, ctx);
    let body = body.map_err(|e| -> BoxError { Box::new(e) }).boxed_unsync();
    let resp = ctx.service.handle(&head, body).await;
    if ctx.access_log {
        let proto = if parts.version == http::Version::HTTP_2 {
            "h2"
        } else {
            "h1"
        };
        tracing::info!(target: "access", peer = %ctx.peer, proto,
            method = %parts.method, uri = %parts.uri, status = resp.status.as_u16(),
            bytes = resp.body.len());
    }
    into_hyper(resp, guard)
}

fn request_head<'a>(parts: &'a http::request::Parts, ctx: &ConnContext) -> RequestHead<'a> {
    RequestHead {
        method: &parts.method,
        uri: &parts.uri,
        version: parts.version,
        headers: &parts.headers,
        tls_site: ctx.tls_site,
        peer: ctx.peer,
        body_forwardable: true,
    }
}

/// A WebTransport extended CONNECT: admitted, the session runs on the stream's bytes
/// (hyper's upgrade) in its own task, counted as a request in flight meanwhile.
fn webtransport_connect(
    req: http::Request<hyper::body::Incoming>,
    upgrade: hyper::upgrade::OnUpgrade,
    ctx: &ConnContext,
    guard: InFlight,
) -> http::Response<ResponseBody> {
    let (parts, _body) = req.into_parts();
    let head = request_head(&parts, ctx);
    let admitted = match ctx.service.webtransport(&head) {
        Some(endpoint) => endpoint.admit(&parts.uri, &parts.headers),
        None => Err(crate::webtransport::Refusal {
            status: http::StatusCode::NOT_FOUND,
            reason: "no WebTransport endpoint here",
        }),
    };
    let status = admitted
        .as_ref()
        .map_or_else(|r| r.status, |_| http::StatusCode::OK);
    if ctx.access_log {
        tracing::info!(target: "access", peer = %ctx.peer, proto = "h2", method = "CONNECT",
            protocol = "webtransport", uri = %parts.uri, status = status.as_u16());
    }
    let mut resp = Response::status(status);
    match admitted {
        Ok(admission) => {
            // A 2xx answer to CONNECT has no content-length (RFC 9110 §9.3.6).
            resp.headers.remove(http::header::CONTENT_LENGTH);
            let session_guard = InFlight::new(guard.0.clone());
            let (shutdown, peer) = (ctx.shutdown.clone(), ctx.peer);
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
        Err(refusal) => {
            tracing::debug!(peer = %ctx.peer, reason = refusal.reason, "h2: WebTransport session refused")
        }
    }
    into_hyper(resp, guard)
}

fn into_hyper(resp: Response, guard: InFlight) -> http::Response<ResponseBody> {
    let Response {
        status,
        mut headers,
        body,
    } = resp;
    headers.insert(http::header::SERVER, http::HeaderValue::from_static(SERVER));
    let body = ResponseBody::new(body, guard);
    let mut out = http::Response::new(body);
    *out.status_mut() = status;
    *out.headers_mut() = headers;
    out
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

/// A response body for hyper: file ranges read on demand, one chunk at a time, only
/// when hyper polls it (which it does only when the stream has capacity), or a body
/// relayed from an upstream, frame by frame.
pub struct ResponseBody {
    /// A relayed body (proxy), passed through frame by frame, trailers and errors
    /// included; the file fields are unused then.
    relay: Option<StreamBody>,
    file: Option<Arc<std::fs::File>>,
    segments: VecDeque<Segment>,
    remaining: u64,
    pending: Option<JoinHandle<std::io::Result<Vec<u8>>>>,
    _guard: InFlight,
}

impl ResponseBody {
    fn new(body: Body, guard: InFlight) -> Self {
        let mut relay = None;
        let (file, segments, remaining) = match body {
            Body::Empty => (None, VecDeque::new(), 0),
            Body::Stream(stream) => {
                relay = Some(stream);
                (None, VecDeque::new(), 0)
            }
            Body::Bytes(b) => {
                let len = b.len() as u64;
                (None, VecDeque::from([Segment::Bytes(b)]), len)
            }
            Body::File(FileBody { file, segments, len }) => (Some(file), segments.into(), len),
        };
        Self {
            relay,
            file,
            segments,
            remaining,
            pending: None,
            _guard: guard,
        }
    }
}

impl http_body::Body for ResponseBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        if let Some(relay) = this.relay.as_mut() {
            return Pin::new(relay).poll_frame(cx);
        }
        if let Some(pending) = this.pending.as_mut() {
            let result = match Pin::new(pending).poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(r) => r
                    .map_err(std::io::Error::other)
                    .and_then(|r| r)
                    .map_err(BoxError::from),
            };
            this.pending = None;
            return Poll::Ready(Some(result.map(|buf| {
                this.remaining -= buf.len() as u64;
                Frame::data(Bytes::from(buf))
            })));
        }
        let Some(segment) = this.segments.pop_front() else {
            return Poll::Ready(None);
        };
        match segment {
            Segment::Bytes(b) => {
                this.remaining -= b.len() as u64;
                Poll::Ready(Some(Ok(Frame::data(b))))
            }
            Segment::File { offset, len } => {
                let Some(file) = this.file.clone() else {
                    return Poll::Ready(Some(Err("file segment without a file".into())));
                };
                let n = FILE_CHUNK.min(usize::try_from(len).unwrap_or(FILE_CHUNK));
                if (n as u64) < len {
                    this.segments.push_front(Segment::File {
                        offset: offset + n as u64,
                        len: len - n as u64,
                    });
                }
                // h2 takes ownership of each chunk, so each gets its own buffer.
                let mut buf = Vec::new();
                let filled = match crate::files::read_cached(&file, &mut buf, offset, n) {
                    Ok(filled) => filled,
                    Err(e) => return Poll::Ready(Some(Err(e.into()))),
                };
                if filled == n {
                    this.remaining -= n as u64;
                    return Poll::Ready(Some(Ok(Frame::data(Bytes::from(buf)))));
                }
                this.pending = Some(tokio::task::spawn_blocking(move || {
                    crate::files::read_rest(&file, buf, offset, filled)
                }));
                self.poll_frame(cx)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.relay {
            Some(relay) => relay.is_end_stream(),
            None => self.remaining == 0 && self.pending.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.relay {
            Some(relay) => relay.size_hint(),
            None => SizeHint::with_exact(self.remaining),
        }
    }
}

impl std::fmt::Debug for ResponseBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseBody")
            .field("relay", &self.relay.is_some())
            .field("remaining", &self.remaining)
            .finish()
    }
}

impl Drop for ResponseBody {
    fn drop(&mut self) {
        // A cancelled stream must not leave a read running for nobody.
        if let Some(pending) = self.pending.take() {
            pending.abort();
        }
    }
}
