//! HTTP/2 driver: hyper's server over a bounded write batch.
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
use crate::service::{Body, FileBody, RequestHead, Response, Segment};

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

    let active = Arc::new(AtomicUsize::new(0));
    let io = TokioIo::new(WriteBatch::new(stream, settings.tls_write_buffer_bytes));
    let service = {
        let ctx = ctx.clone();
        let active = active.clone();
        hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
            let ctx = ctx.clone();
            let guard = InFlight::new(active.clone());
            async move { Ok::<_, Infallible>(handle(req, &ctx, guard).await) }
        })
    };
    let conn = builder.serve_connection(io, service);
    tokio::pin!(conn);
    let mut shutdown = ctx.shutdown.clone();
    let mut idle_check = tokio::time::interval(Duration::from_secs(1));
    let mut idle_since = tokio::time::Instant::now();
    let mut closing = false;
    loop {
        tokio::select! {
            result = conn.as_mut() => return result.map_err(H2Error::from),
            () = shutdown.requested(), if !closing => {
                closing = true;
                conn.as_mut().graceful_shutdown();
            }
            _ = idle_check.tick(), if !closing => {
                if active.load(Ordering::Acquire) > 0 {
                    idle_since = tokio::time::Instant::now();
                } else if idle_since.elapsed() >= limits.idle_timeout {
                    closing = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
    }
}

async fn handle(
    req: http::Request<hyper::body::Incoming>,
    ctx: &ConnContext,
    guard: InFlight,
) -> http::Response<FileStream> {
    let (parts, _body) = req.into_parts();
    let head = RequestHead {
        method: &parts.method,
        uri: &parts.uri,
        version: parts.version,
        headers: &parts.headers,
        tls_site: ctx.tls_site,
    };
    let resp = ctx.service.handle(&head).await;
    if ctx.access_log {
        tracing::info!(target: "access", peer = %ctx.peer, proto = "h2",
            method = %parts.method, uri = %parts.uri, status = resp.status.as_u16(),
            bytes = resp.body.len());
    }
    into_hyper(resp, guard)
}

fn into_hyper(resp: Response, guard: InFlight) -> http::Response<FileStream> {
    let Response {
        status,
        mut headers,
        body,
    } = resp;
    headers.insert(http::header::SERVER, http::HeaderValue::from_static(SERVER));
    let body = FileStream::new(body, guard);
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

/// A response body that reads file ranges on demand, one chunk at a time, only when
/// hyper polls it (which it does only when the stream has capacity).
#[derive(Debug)]
pub struct FileStream {
    file: Option<Arc<std::fs::File>>,
    segments: VecDeque<Segment>,
    remaining: u64,
    pending: Option<JoinHandle<std::io::Result<Vec<u8>>>>,
    _guard: InFlight,
}

impl FileStream {
    fn new(body: Body, guard: InFlight) -> Self {
        let (file, segments, remaining) = match body {
            Body::Empty => (None, VecDeque::new(), 0),
            Body::Bytes(b) => {
                let len = b.len() as u64;
                (None, VecDeque::from([Segment::Bytes(b)]), len)
            }
            Body::File(FileBody { file, segments, len }) => (Some(file), segments.into(), len),
        };
        Self {
            file,
            segments,
            remaining,
            pending: None,
            _guard: guard,
        }
    }
}

impl http_body::Body for FileStream {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        if let Some(pending) = this.pending.as_mut() {
            let result = match Pin::new(pending).poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(r) => r.map_err(std::io::Error::other).and_then(|r| r),
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
                    return Poll::Ready(Some(Err(std::io::Error::other("file segment without a file"))));
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
                    Err(e) => return Poll::Ready(Some(Err(e))),
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
        self.remaining == 0 && self.pending.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.remaining)
    }
}

impl Drop for FileStream {
    fn drop(&mut self) {
        // A cancelled stream must not leave a read running for nobody.
        if let Some(pending) = self.pending.take() {
            pending.abort();
        }
    }
}
