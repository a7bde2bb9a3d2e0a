//! hyper-driven connections: HTTP/2 always (over a bounded write batch), and
//! HTTP/1.1 for proxy sites ([`serve_h1`]).
//!
//! Responses are the seam's [`ResponseBody`], which hyper polls: a stream's file body
//! is read only when the stream has send capacity (flow control is h2's), and at most
//! `h2.max_send_buffer_bytes` wait per stream beyond its window.
//! DATA frames collect in the connection's [`WriteBatch`] (`h2_tls_write_buffer_bytes`,
//! 128 KiB by default: two 64 KiB frames) before rustls encrypts them. Memory per
//! connection is therefore bounded by `max_concurrent_streams × (max_send_buffer +
//! STREAM_CHUNK)` plus the batch and rustls' buffers; a stream whose client grants no
//! window holds two 16 KiB reads (the body ramps its reads up with what the client
//! takes: `exchange::body`).
//!
//! An HTTP/2 connection rests until its first request ([`rest::h2`]: the
//! handshake answered, none of hyper's connection built), and an HTTP/1.1 one until
//! its first bytes ([`serve_h1`]).
//!
//! Time, once hyper's connection is built, for both protocols ([`drive`]; the
//! limits at rest are `rest`'s): an HTTP/2 client whose preface was not complete
//! at rest must send it, up to its first SETTINGS frame header, within
//! `handshake_timeout` of the handshake; a connection with no request in flight for
//! `idle_timeout` is closed gracefully (GOAWAY), and dropped if it has not closed
//! [`CLOSE_GRACE`] later (a client that never answers the GOAWAY's PING); and when
//! responses wait on the client and one has waited for `send_timeout` (however
//! others move), it is dropped.
//! Bytes that arrive without making a request never reset the idle clock. A client
//! trickling a request head is cut at `header_read_timeout`: over HTTP/2 by the
//! frame guard (`h2_guard`: GOAWAY PROTOCOL_ERROR for a header block or frame not
//! complete that long after its first byte), over HTTP/1.1 by [`drive`]: the first
//! head that long after the handshake (with [`serve_h1`]'s wait: hyper's connection
//! starts with the first bytes), each later one that long after its first bytes
//! ([`Since`]; hyper's own header timer is off, since it also cut a kept-alive
//! connection waiting for its next request). A partial head pipelined behind a
//! request is bounded by `idle_timeout` instead.
//! An HTTP/2 client that does not read cannot be sent that GOAWAY: the connection
//! is dropped [`CLOSE_GRACE`] after the header timeout.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::server::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::h2_guard::handshake::Opening;
use super::h2_guard::{guard_limits, GuardLimits, H2Guard, HeadClock};
use super::rest::{self, FirstBytes, Waited};
use super::{WriteBatch, CLOSE_GRACE};
use crate::exchange::{ConnContext, PullClock, Record, ResponseBody};
use crate::files::cursor::STREAM_CHUNK;
use crate::ktls::RustlsStream;
use crate::message::{BoxError, Response};

#[derive(Debug, thiserror::Error)]
pub(crate) enum HyperError {
    #[error("hyper: {0}")]
    Hyper(#[from] hyper::Error),
    /// Reading or writing an HTTP/2 connection at rest.
    #[error("HTTP/2 connection at rest: {0}")]
    Io(std::io::Error),
    #[error("no HTTP/2 connection preface within the handshake timeout")]
    NoPreface,
    #[error("client stopped taking response bytes for longer than the send timeout")]
    Stalled,
    /// An HTTP/2 header block (the guard's GOAWAY did not end it), or an HTTP/1.1
    /// request head, not complete within the header timeout.
    #[error("request head not complete within the header timeout")]
    HeadTimeout,
}

/// The HTTP/2 client preface (24 bytes) and the header of its SETTINGS frame.
const PREFACE_BYTES: u64 = 24 + 9;

/// Serves one HTTP/2 connection until the client closes it, it idles out, or
/// shutdown is requested (then GOAWAY and the open streams finish).
///
/// The connection rests ([`rest::h2`]: the handshake answered, nothing of hyper's built)
/// until the client sends what h2 must answer, usually its first request; then
/// hyper's connection is built, boxed, and reads from the first byte the client sent.
pub(crate) fn serve_h2(
    mut stream: RustlsStream,
    ctx: ConnContext,
) -> impl Future<Output = Result<(), HyperError>> {
    // HTTP/2 never moves to kernel TLS: let rustls read whole socket buffers.
    stream.get_mut().0.unbound();
    // Boxed: the rest holds a pointer, and hyper's connection takes the box.
    let mut stream = Box::new(stream);
    async move {
        let start = tokio::time::Instant::now();
        let guarded = guard_limits(&ctx);
        let opening = match rest::h2(&mut stream, guarded.settings_frame(), &ctx, start).await {
            Waited::Open(opening) => opening,
            Waited::Closed => return Ok(()),
            Waited::NoPreface => return Err(HyperError::NoPreface),
            Waited::Stalled => return Err(HyperError::Stalled),
            Waited::Io(e) => return Err(HyperError::Io(e)),
        };
        Box::pin(serve_h2_now(stream, ctx, guarded, opening, start)).await
    }
}

/// hyper's HTTP/2 server with every option a connection with `guarded` limits uses:
/// the one place they are set, since what h2 sends first follows from them and a
/// connection at rest sends it in h2's place ([`GuardLimits::settings_frame`], checked
/// against this builder's output by a test).
pub(super) fn h2_builder(
    guarded: &GuardLimits,
    connection_window: u32,
    idle_timeout: Duration,
) -> http2::Builder<TokioExecutor> {
    let mut builder = http2::Builder::new(TokioExecutor::new());
    // Window, frame, stream, header and send-buffer limits (lower on proxy sites),
    // and the stream errors h2 answers per connection: the guard judges by the same.
    guarded.configure(&mut builder);
    builder
        .timer(TokioTimer::new())
        .initial_connection_window_size(connection_window)
        // Rapid reset (CVE-2023-44487): streams the client resets before hyper takes
        // them end the connection with ENHANCE_YOUR_CALM past this count (h2's
        // default, stated here); the guard bounds resets of streams already taken.
        .max_pending_accept_reset_streams(20)
        .keep_alive_interval(Some(idle_timeout / 2))
        .keep_alive_timeout(Duration::from_secs(20));
    builder
}

/// hyper's HTTP/2 connection over `stream`, which rested until now (`opening`: what
/// it read and answered then); `start`: when the handshake completed.
async fn serve_h2_now(
    stream: Box<RustlsStream>,
    ctx: ConnContext,
    guarded: GuardLimits,
    opening: Opening,
    start: tokio::time::Instant,
) -> Result<(), HyperError> {
    let builder = h2_builder(
        &guarded,
        ctx.h2.initial_connection_window_bytes,
        ctx.limits.idle_timeout,
    );
    let watch = Watch::new();
    let read = Arc::new(AtomicU64::new(0));
    let (replay, answer) = opening.split(stream);
    let stream = ReadCount::new(replay, read.clone());
    let guard = H2Guard::new(WriteBatch::new(stream, ctx.h2.tls_write_buffer_bytes), guarded);
    let head = guard.head_clock();
    let io = answer.over(guard);
    let conn = builder.serve_connection(TokioIo::new(io), service(&ctx, &watch));
    tokio::pin!(conn);
    let h2 = H2Watch {
        preface: &read,
        head: &head,
    };
    let clock = Clock {
        start,
        first_head: false,
        h1_heads: false,
    };
    drive(conn, |c| c.graceful_shutdown(), &watch, Some(h2), &ctx, clock).await
}

/// Serves HTTP/1.1 through hyper, for connections whose certificate names a proxy
/// site: hyper streams request bodies (chunked or sized) and relays trailers, which
/// the file-serving driver does not need to.
///
/// hyper's connection (its read and write buffers, header cache, timer and
/// dispatcher) is built only when the client's first bytes are there
/// ([`rest::first_bytes`]); until then the connection holds the boxed stream and the wait.
/// The limits are those hyper's connection kept from the handshake on: the first
/// request head must be complete within `header_read_timeout` of the handshake
/// (`header_timeout`), a shorter `idle_timeout` closes it in order, and the drain
/// closes it in order unless a first request begins within `FIRST_REQUEST_GRACE`.
pub(crate) fn serve_h1(
    mut stream: RustlsStream,
    ctx: ConnContext,
) -> impl Future<Output = Result<(), HyperError>> {
    stream.get_mut().0.unbound();
    // Boxed: the wait holds a pointer, and hyper takes the box as its I/O.
    let mut stream = Box::new(stream);
    async move {
        let start = tokio::time::Instant::now();
        match rest::first_bytes(&mut stream, &ctx, start).await {
            FirstBytes::Arrived => {}
            // Closed in order, as hyper closes: close_notify.
            FirstBytes::Closed => return Ok(()),
            // hyper's header timer, which ran from its connection's start, ends the
            // connection without a response or close_notify.
            FirstBytes::HeadTimeout => return Err(HyperError::HeadTimeout),
        }
        // Boxed: the connection's memory is taken now, and is its own.
        Box::pin(serve_h1_now(stream, ctx, start)).await
    }
}

/// hyper's HTTP/1.1 connection over `stream`, whose first bytes have arrived; `start`:
/// when the handshake completed (the first request head's deadline and the idle
/// clock count from there).
async fn serve_h1_now(
    stream: Box<RustlsStream>,
    ctx: ConnContext,
    start: tokio::time::Instant,
) -> Result<(), HyperError> {
    let mut builder = hyper::server::conn::http1::Builder::new();
    // No header timer of hyper's: it also runs while a kept-alive connection waits
    // for its next request, which cut every such connection at
    // `header_read_timeout` after a response instead of `idle_timeout`. [`drive`]
    // times heads instead, from their first bytes.
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(None)
        .max_buf_size(ctx.limits.max_header_bytes.max(8192));
    let watch = Watch::new();
    let read = Arc::new(AtomicU64::new(0));
    let stream = ReadCount::new(stream, read).heads(&watch);
    let conn = builder.serve_connection(TokioIo::new(stream), service(&ctx, &watch));
    tokio::pin!(conn);
    let clock = Clock {
        start,
        first_head: true,
        h1_heads: true,
    };
    drive(conn, |c| c.graceful_shutdown(), &watch, None, &ctx, clock).await
}

/// Where [`drive`]'s clocks start.
#[derive(Debug, Clone, Copy)]
struct Clock {
    /// The connection's start (the handshake's end): the idle clock, the HTTP/2
    /// preface's and the first HTTP/1.1 head's deadlines count from here.
    start: tokio::time::Instant,
    /// Whether the first request head must be complete within `header_read_timeout`
    /// of `start` (HTTP/1.1 built after the first bytes: hyper's own header timer
    /// started later than the connection).
    first_head: bool,
    /// Whether every later request head must be complete within
    /// `header_read_timeout` of its first bytes ([`Since`]; HTTP/1.1).
    h1_heads: bool,
}

/// What [`drive`] watches of a connection's requests: how many are in flight, and
/// how their response bodies move.
#[derive(Debug, Clone)]
struct Watch {
    active: Arc<AtomicUsize>,
    /// Requests started so far: one that came and went between two checks is
    /// activity too.
    started: Arc<AtomicU64>,
    clock: Arc<PullClock>,
    /// HTTP/1.1: when the next request head began, and since when writes wait.
    head: Arc<Since>,
    write_blocked: Arc<Since>,
}

impl Watch {
    fn new() -> Self {
        Self {
            active: Arc::new(AtomicUsize::new(0)),
            started: Arc::new(AtomicU64::new(0)),
            clock: Arc::new(PullClock::default()),
            head: Arc::new(Since::new()),
            write_blocked: Arc::new(Since::new()),
        }
    }
}

type HandlerFuture = Pin<Box<dyn Future<Output = Result<http::Response<HyperBody>, Infallible>> + Send>>;

/// The hyper service of one connection: every request goes to the shared Service.
#[derive(Debug, Clone)]
struct Handler {
    ctx: ConnContext,
    watch: Watch,
}

impl hyper::service::Service<http::Request<hyper::body::Incoming>> for Handler {
    type Response = http::Response<HyperBody>;
    type Error = Infallible;
    type Future = HandlerFuture;

    fn call(&self, req: http::Request<hyper::body::Incoming>) -> Self::Future {
        let ctx = self.ctx.clone();
        self.watch.started.fetch_add(1, Ordering::AcqRel);
        let guard = InFlight::new(self.watch.active.clone());
        self.watch.head.clear();
        let clock = self.watch.clock.clone();
        Box::pin(async move { Ok(handle(req, &ctx, guard, clock).await) })
    }
}

fn service(ctx: &ConnContext, watch: &Watch) -> Handler {
    Handler {
        ctx: ctx.clone(),
        watch: watch.clone(),
    }
}

/// What [`drive`] watches of an HTTP/2 connection's input.
#[derive(Debug, Clone, Copy)]
struct H2Watch<'a> {
    /// The bytes read so far.
    preface: &'a AtomicU64,
    /// The guard's open header block or frame.
    head: &'a HeadClock,
}

/// Runs a hyper connection until it ends, shutting it down gracefully on shutdown
/// or after `idle_timeout` without a request in flight, and dropping it when the
/// client does not keep its side (see the module notes). `h2`: what an HTTP/2
/// connection's input shows.
async fn drive<C, G>(
    mut conn: Pin<&mut C>,
    graceful: G,
    watch: &Watch,
    h2: Option<H2Watch<'_>>,
    ctx: &ConnContext,
    clock: Clock,
) -> Result<(), HyperError>
where
    C: Future<Output = Result<(), hyper::Error>>,
    G: Fn(Pin<&mut C>),
{
    let limits = ctx.limits;
    let mut shutdown = ctx.shutdown.clone();
    let start = clock.start;
    let mut first_head = clock.first_head;
    // A quarter of the shortest limit, so each fires within 25 % of its time.
    let shortest = limits
        .idle_timeout
        .min(limits.send_timeout)
        .min(limits.handshake_timeout)
        .min(limits.header_read_timeout);
    let mut check =
        tokio::time::interval((shortest / 4).clamp(Duration::from_millis(50), Duration::from_secs(1)));
    let mut idle_since = start;
    let mut seen = 0;
    let mut preface = h2.map(|h2| h2.preface);
    let mut closing = false;
    let mut dropping_at = None;
    loop {
        tokio::select! {
            // The connection first: on a drain that began before hyper's first read
            // (an HTTP/1.1 connection built on its first bytes), hyper must read the
            // request before the graceful shutdown, or it closes without answering.
            biased;
            result = conn.as_mut() => return result.map_err(HyperError::from),
            () = shutdown.requested(), if !closing => {
                closing = true;
                graceful(conn.as_mut());
            }
            _ = check.tick() => {
                let now = tokio::time::Instant::now();
                if let Some(read) = preface {
                    if read.load(Ordering::Acquire) >= PREFACE_BYTES {
                        preface = None;
                    } else if now - start >= limits.handshake_timeout {
                        return Err(HyperError::NoPreface);
                    }
                }
                if first_head {
                    if watch.started.load(Ordering::Acquire) > 0 {
                        first_head = false;
                    } else if now - start >= limits.header_read_timeout {
                        return Err(HyperError::HeadTimeout);
                    }
                }
                if clock.h1_heads && watch.head.since().is_some_and(|t| now - t >= limits.header_read_timeout) {
                    return Err(HyperError::HeadTimeout);
                }
                // A response's last bytes the client does not take (no body left for
                // the pull clock to see waiting).
                if clock.h1_heads && watch.write_blocked.since().is_some_and(|t| now - t >= limits.send_timeout) {
                    return Err(HyperError::Stalled);
                }
                if watch.clock.stalled(limits.send_timeout) {
                    return Err(HyperError::Stalled);
                }
                // The guard's GOAWAY did not end it: the client reads nothing.
                if h2.is_some_and(|h2| h2.head.open_for(limits.header_read_timeout + CLOSE_GRACE, now)) {
                    return Err(HyperError::HeadTimeout);
                }
                if dropping_at.is_some_and(|at| now >= at) {
                    return Ok(());
                }
                let started = watch.started.load(Ordering::Acquire);
                if watch.active.load(Ordering::Acquire) > 0 || started != seen {
                    seen = started;
                    idle_since = now;
                } else if !closing && now - idle_since >= limits.idle_timeout {
                    closing = true;
                    dropping_at = Some(now + CLOSE_GRACE);
                    graceful(conn.as_mut());
                }
            }
        }
    }
}

/// Since when something has been under way (nothing: 0), shared between a
/// connection's I/O wrapper and [`drive`]'s check. HTTP/1.1 keeps two: when the
/// first bytes of a request head that no request has taken yet were read (bytes
/// read while nothing is in flight, a request or its body: hyper has begun the next
/// head; cleared when hyper hands a request over), and since when a write has been
/// refused (the client reads nothing; cleared by the next write that goes through).
/// How `drive` applies `header_read_timeout` and `send_timeout` between requests,
/// which hyper's own header timer (off: it cut kept-alive connections) did. A
/// pipelined head read during the previous request is not seen: `idle_timeout`
/// bounds one left unfinished that way.
#[derive(Debug)]
struct Since {
    base: tokio::time::Instant,
    /// Nanoseconds since `base`, plus one; 0 for none under way.
    at: AtomicU64,
}

impl Since {
    fn new() -> Self {
        Self {
            base: tokio::time::Instant::now(),
            at: AtomicU64::new(0),
        }
    }

    fn mark(&self) {
        let at = u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX - 1) + 1;
        let _ = self
            .at
            .compare_exchange(0, at, Ordering::AcqRel, Ordering::Acquire);
    }

    fn clear(&self) {
        self.at.store(0, Ordering::Release);
    }

    fn since(&self) -> Option<tokio::time::Instant> {
        match self.at.load(Ordering::Acquire) {
            0 => None,
            at => Some(self.base + Duration::from_nanos(at - 1)),
        }
    }
}

/// A stream that counts the bytes read from it (how [`drive`] sees the HTTP/2
/// preface and HTTP/1.1 request heads arrive without parsing them: hyper does).
#[derive(Debug)]
struct ReadCount<S> {
    inner: S,
    read: Arc<AtomicU64>,
    /// HTTP/1.1: requests in flight, where bytes read while there are none mark a
    /// head's start, and where a refused write marks the client not reading.
    heads: Option<(Arc<AtomicUsize>, Arc<Since>, Arc<Since>)>,
}

impl<S> ReadCount<S> {
    fn new(inner: S, read: Arc<AtomicU64>) -> Self {
        Self {
            inner,
            read,
            heads: None,
        }
    }

    /// Also marks, in `watch`, when a request head begins between requests.
    fn heads(mut self, watch: &Watch) -> Self {
        self.heads = Some((
            watch.active.clone(),
            watch.head.clone(),
            watch.write_blocked.clone(),
        ));
        self
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for ReadCount<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        let n = (buf.filled().len() - before) as u64;
        if n > 0 {
            self.read.fetch_add(n, Ordering::AcqRel);
            if let Some((active, head, _)) = &self.heads {
                if active.load(Ordering::Acquire) == 0 {
                    head.mark();
                }
            }
        }
        polled
    }
}

impl<S> ReadCount<S> {
    /// Notes a write's outcome: refused (the client reads nothing) or through.
    fn wrote<T>(&self, polled: Poll<T>) -> Poll<T> {
        if let Some((_, _, blocked)) = &self.heads {
            match polled {
                Poll::Pending => blocked.mark(),
                Poll::Ready(_) => blocked.clear(),
            }
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for ReadCount<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, data);
        self.wrote(polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.wrote(polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_flush(cx);
        self.wrote(polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A request body, counted in flight until it ends or is dropped: what hyper reads
/// for it after the response went out (an upload the upstream answered early) is
/// the request's, not the start of a next head.
#[derive(Debug)]
struct RequestBody<B> {
    body: B,
    in_flight: Option<InFlight>,
}

impl<B: http_body::Body + Unpin> http_body::Body for RequestBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        if matches!(polled, Poll::Ready(None | Some(Err(_)))) {
            self.in_flight = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

async fn handle(
    mut req: http::Request<hyper::body::Incoming>,
    ctx: &ConnContext,
    guard: InFlight,
    clock: Arc<PullClock>,
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
    let in_flight = (!http_body::Body::is_end_stream(&body)).then(|| InFlight::new(guard.0.clone()));
    let body = RequestBody { body, in_flight };
    let body = body.map_err(|e| -> BoxError { Box::new(e) }).boxed_unsync();
    let (resp, record) = ctx.handle(&head, body).await;
    into_hyper(resp, Some(record), guard, Some(clock))
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
    into_hyper(resp, None, guard, None)
}

/// The seam's response for hyper; its body watched by the connection's `clock`
/// (not a WebTransport answer: the session keeps its own time).
/// The record of its exchange, if it has one (a WebTransport answer's was reported at
/// admission), is reported when hyper drops the body.
fn into_hyper(
    resp: Response,
    record: Option<Record>,
    guard: InFlight,
    clock: Option<Arc<PullClock>>,
) -> http::Response<HyperBody> {
    let (head, body) = resp.into_http();
    let mut body = match clock {
        Some(clock) => ResponseBody::pulled(body, STREAM_CHUNK, clock),
        None => ResponseBody::new(body, STREAM_CHUNK),
    };
    if let Some(record) = record {
        body = body.recorded(record);
    }
    head.map(|()| HyperBody { body, _guard: guard })
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
