//! Programmable plain-HTTP origins for the reverse-proxy tests: [`Origin`], a hyper
//! server on one loopback port that speaks HTTP/1.1 and h2c (prior knowledge), records
//! every request it receives and serves scripted responses (sized, slow, trailing,
//! dying mid-body); and [`HalfCloseOrigin`], raw TCP that ends a close-delimited
//! response with a half-close. Both run on the caller's tokio runtime as the test
//! kit's `Task` (the connections live in a JoinSet the task owns), so they stop when
//! dropped.
//!
//! Routes of [`Origin`] (the request body is read to the end and hashed first, but
//! for `/early`):
//! - `/echo`: the request's headers, method, path, body length and SHA-256 as text;
//! - `/bytes/N`: N pattern bytes with `content-length` (a single `Range` gives 206);
//! - `/slow/N/MS`: N pattern bytes, no length, 16 KiB frames MS milliseconds apart;
//!   `/slow/N/MS/SIZE`: the same in SIZE-byte frames (1 to 64 KiB);
//! - `/chunks/N/SIZE`: N pattern bytes, no length, in SIZE-byte frames (1 to 64 KiB)
//!   all ready at once (h2: that many DATA frames; HTTP/1.1: chunks);
//! - `/trailers`: `hello`, then trailers `x-checksum: 12345` and `x-origin: rust` (on
//!   HTTP/1.1 hyper sends them only if the request carried `te: trailers`);
//!   `/chunks-trailers/N/SIZE`: `/chunks/N/SIZE`'s body with those trailers;
//! - `/die/N`: promises 2N bytes, sends N, then fails the stream;
//! - `/die-chunked/N`: no length, N bytes, then fails the stream;
//! - `/huge-headers/N`: an `x-huge` header of N bytes, body `ok`;
//! - `/status/N`: status N, empty body;
//! - `/wait-abort`: one byte every 50 ms for up to 20 s, counting a peer that leaves;
//! - `/early`: `early`, answered before the request body is read, which is read to
//!   its end meanwhile (and not recorded);
//! - anything else: 404.
//!
//! "Pattern bytes" are byte `i` = `(i * 7 + i / 251) as u8` ([`pattern`], which the
//! e2e suite uses too), counted from the start of the resource.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio::time::{sleep, timeout, Sleep};
use webship_testkit::process::Task;

use crate::client::hex;

/// The accept loops end after this many connections or this long, so a test that
/// forgets an origin cannot leave a task spinning.
const MAX_CONNECTIONS: usize = 10_000;
const MAX_LIFETIME: Duration = Duration::from_secs(15 * 60);
/// One connection (keep-alive included) is cut after this long.
const MAX_CONNECTION_TIME: Duration = Duration::from_secs(5 * 60);
/// Reading one request body gives up after this long (recorded as incomplete).
const MAX_BODY_TIME: Duration = Duration::from_secs(120);
/// Frame sizes of the generated bodies.
const FRAME: usize = 64 * 1024;
const SLOW_FRAME: usize = 16 * 1024;

/// One request as the origin received it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    /// Path and query, as on the request line (or `:path` on h2).
    pub path: String,
    /// `HTTP/1.1`, `HTTP/2.0`, ...
    pub version: String,
    /// Lowercase names, in the order hyper's `HeaderMap` iterates them: insertion order
    /// of each name's first occurrence, with repeated names grouped together. On h2 the
    /// pseudo-headers are not here (`:authority` has no `host` twin).
    pub headers: Vec<(String, String)>,
    pub body_len: u64,
    /// Lowercase hex; of the bytes received so far when the body did not complete.
    pub body_sha256: String,
    /// False when the body stream ended with an error (the client aborted), the
    /// connection went away mid-body, or reading it took over two minutes.
    pub body_complete: bool,
}

impl Seen {
    /// The first value of header `name` (any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// Every value of header `name` (any case), in order.
    pub fn headers_named(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
            .collect()
    }
}

/// What the connections share with the test.
#[derive(Default)]
struct Shared {
    seen: Mutex<Vec<Seen>>,
    aborted: AtomicUsize,
    connections: AtomicUsize,
}

pub struct Origin {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    _task: Task,
}

impl Origin {
    /// Binds 127.0.0.1:0 and spawns the accept loop on the current runtime.
    pub async fn start() -> Origin {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared::default());
        let _task = Task::spawn(accept_loop(listener, shared.clone()));
        Origin { addr, shared, _task }
    }

    /// Every request received so far, in the order their bodies finished (or failed).
    pub fn seen(&self) -> Vec<Seen> {
        self.shared.seen.lock().unwrap().clone()
    }

    /// The first value of header `name` in `seen`.
    pub fn header<'a>(seen: &'a Seen, name: &str) -> Option<&'a str> {
        seen.header(name)
    }

    /// Responses whose body was dropped before its end: the peer went away (or reset
    /// the stream) while the origin still had bytes to send. The deliberate failures
    /// of `/die*` do not count.
    pub fn aborted_responses(&self) -> usize {
        self.shared.aborted.load(Ordering::SeqCst)
    }

    /// TCP connections accepted so far.
    pub fn connections(&self) -> usize {
        self.shared.connections.load(Ordering::SeqCst)
    }

    /// `http://127.0.0.1:PORT`, for proxy configurations.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let started = Instant::now();
    let mut conns = JoinSet::new();
    for _ in 0..MAX_CONNECTIONS {
        let left = MAX_LIFETIME.saturating_sub(started.elapsed());
        match timeout(left, listener.accept()).await {
            Ok(Ok((stream, _))) => {
                shared.connections.fetch_add(1, Ordering::SeqCst);
                // Reap finished connections so the set stays small.
                while conns.try_join_next().is_some() {}
                conns.spawn(serve_connection(stream, shared.clone()));
            }
            // Out of descriptors and the like: back off, it still counts toward the bound.
            Ok(Err(_)) => sleep(Duration::from_millis(10)).await,
            Err(_) => break,
        }
    }
    // Let the open connections finish (each is bounded in time).
    while conns.join_next().await.is_some() {}
}

async fn serve_connection(stream: TcpStream, shared: Arc<Shared>) {
    let _ = stream.set_nodelay(true);
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // Generous limits, so the proxy's own limits are what a test exercises.
    builder.http1().max_buf_size(1 << 20);
    builder.http2().max_header_list_size(1 << 20);
    let service = service_fn(move |req| {
        let shared = shared.clone();
        async move { Ok::<_, Infallible>(handle(req, shared).await) }
    });
    let _ = timeout(
        MAX_CONNECTION_TIME,
        builder.serve_connection(TokioIo::new(stream), service),
    )
    .await;
}

/// Records a request once its body is read; if the service future is dropped first
/// (hyper drops it when the connection fails mid-body), `Drop` records it incomplete.
struct Recorder {
    shared: Arc<Shared>,
    seen: Option<Seen>,
    hasher: Sha256,
}

impl Recorder {
    fn finish(&mut self, complete: bool) -> Option<Seen> {
        let mut seen = self.seen.take()?;
        seen.body_sha256 = hex(&std::mem::take(&mut self.hasher).finalize());
        seen.body_complete = complete;
        self.shared.seen.lock().unwrap().push(seen.clone());
        Some(seen)
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.finish(false);
    }
}

async fn handle(req: Request<Incoming>, shared: Arc<Shared>) -> Response<OriginBody> {
    let (parts, mut body) = req.into_parts();
    if parts.uri.path() == "/early" {
        // Answers at once and reads the request body to its end meanwhile (bounded
        // by MAX_BODY_TIME), as a bidirectional stream does; not recorded.
        tokio::spawn(async move {
            let _ = timeout(MAX_BODY_TIME, async {
                while let Some(Ok(_)) = body.frame().await {}
            })
            .await;
        });
        return reply(
            StatusCode::OK,
            OriginBody::new(&shared)
                .head(Bytes::from_static(b"early\n"))
                .exact(),
        )
        .header(header::CONTENT_LENGTH, 6)
        .body_now();
    }
    let mut recorder = Recorder {
        shared: shared.clone(),
        seen: Some(Seen {
            method: parts.method.to_string(),
            path: parts
                .uri
                .path_and_query()
                .map_or_else(|| parts.uri.path().to_owned(), |p| p.as_str().to_owned()),
            version: format!("{:?}", parts.version),
            headers: parts
                .headers
                .iter()
                .map(|(n, v)| {
                    (
                        n.as_str().to_owned(),
                        String::from_utf8_lossy(v.as_bytes()).into_owned(),
                    )
                })
                .collect(),
            body_len: 0,
            body_sha256: String::new(),
            body_complete: false,
        }),
        hasher: Sha256::new(),
    };
    let read = timeout(MAX_BODY_TIME, async {
        // Bounded by the client's body and by MAX_BODY_TIME.
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(frame) => {
                    if let Some(data) = frame.data_ref() {
                        recorder.hasher.update(data);
                        if let Some(seen) = recorder.seen.as_mut() {
                            seen.body_len += data.len() as u64;
                        }
                    }
                }
                Err(_) => return false,
            }
        }
        true
    })
    .await;
    let seen = recorder.finish(read == Ok(true)).unwrap();

    let mut response = route(&seen, &parts.headers, &shared);
    if parts.method == Method::HEAD {
        // hyper never polls a HEAD response's body; that is not the peer leaving.
        response.body_mut().aborted = None;
    }
    response
}

fn route(seen: &Seen, headers: &HeaderMap, shared: &Arc<Shared>) -> Response<OriginBody> {
    let path = seen.path.split('?').next().unwrap_or("");
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let num = |s: &str| s.parse::<u64>().ok();
    let body = OriginBody::new(shared);
    match segments.as_slice() {
        ["echo"] => {
            let mut text = String::new();
            for (name, value) in &seen.headers {
                text.push_str(&format!("{name}: {value}\n"));
            }
            text.push_str(&format!(
                "method: {}\npath: {}\nbody-len: {}\nbody-sha256: {}\n",
                seen.method, seen.path, seen.body_len, seen.body_sha256
            ));
            let len = text.len();
            reply(StatusCode::OK, body.head(Bytes::from(text)).exact())
                .header(header::CONTENT_TYPE, "text/plain")
                .header(header::CONTENT_LENGTH, len)
                .body_now()
        }
        ["bytes", n] => match num(n) {
            Some(n) => bytes_route(n, headers, body),
            None => bad_request(body),
        },
        ["slow", n, ms] => match (num(n), num(ms)) {
            (Some(n), Some(ms)) => reply(
                StatusCode::OK,
                body.pattern(0, n, SLOW_FRAME).every(Duration::from_millis(ms)),
            )
            .body_now(),
            _ => bad_request(body),
        },
        ["slow", n, ms, size] => match (num(n), num(ms), num(size)) {
            (Some(n), Some(ms), Some(size)) if (1..=FRAME as u64).contains(&size) => reply(
                StatusCode::OK,
                body.pattern(0, n, size as usize).every(Duration::from_millis(ms)),
            )
            .body_now(),
            _ => bad_request(body),
        },
        ["chunks", n, size] => match (num(n), num(size)) {
            (Some(n), Some(size)) if (1..=FRAME as u64).contains(&size) => {
                reply(StatusCode::OK, body.pattern(0, n, size as usize)).body_now()
            }
            _ => bad_request(body),
        },
        // `n` pattern bytes in frames of `size`, then the trailers of `/trailers`.
        ["chunks-trailers", n, size] => match (num(n), num(size)) {
            (Some(n), Some(size)) if (1..=FRAME as u64).contains(&size) => reply(
                StatusCode::OK,
                body.pattern(0, n, size as usize)
                    .then(Tail::Trailers(checksum_trailers())),
            )
            .header(header::TRAILER, "x-checksum, x-origin")
            .body_now(),
            _ => bad_request(body),
        },
        ["trailers"] => {
            // hyper's HTTP/1.1 encoder sends only the trailers announced here.
            reply(
                StatusCode::OK,
                body.head(Bytes::from_static(b"hello"))
                    .then(Tail::Trailers(checksum_trailers())),
            )
            .header(header::TRAILER, "x-checksum, x-origin")
            .body_now()
        }
        ["die", n] => match num(n) {
            Some(n) => reply(StatusCode::OK, body.pattern(0, n, FRAME).then(Tail::Fail))
                .header(header::CONTENT_LENGTH, n * 2)
                .body_now(),
            None => bad_request(body),
        },
        ["die-chunked", n] => match num(n) {
            Some(n) => reply(StatusCode::OK, body.pattern(0, n, FRAME).then(Tail::Fail)).body_now(),
            None => bad_request(body),
        },
        ["huge-headers", n] => match num(n) {
            Some(n) if n <= 64 << 20 => {
                let huge = HeaderValue::from_str(&"a".repeat(n as usize)).unwrap();
                reply(StatusCode::OK, body.head(Bytes::from_static(b"ok")).exact())
                    .header("x-huge", huge)
                    .header(header::CONTENT_LENGTH, 2)
                    .body_now()
            }
            _ => bad_request(body),
        },
        ["status", n] => match n.parse::<u16>().ok().and_then(|n| StatusCode::from_u16(n).ok()) {
            Some(status) if !status.is_informational() => reply(status, body).body_now(),
            _ => bad_request(body),
        },
        // 400 bytes at 20 per second: 20 s unless the peer leaves first.
        ["wait-abort"] => reply(
            StatusCode::OK,
            body.pattern(0, 400, 1).every(Duration::from_millis(50)),
        )
        .body_now(),
        _ => reply(StatusCode::NOT_FOUND, body).body_now(),
    }
}

/// The trailers of `/trailers` and `/chunks-trailers/…`.
fn checksum_trailers() -> HeaderMap {
    let mut trailers = HeaderMap::new();
    trailers.insert("x-checksum", HeaderValue::from_static("12345"));
    trailers.insert("x-origin", HeaderValue::from_static("rust"));
    trailers
}

/// `/bytes/N`, with a single `Range: bytes=a-b` (or `a-`, `-n`) honoured.
fn bytes_route(len: u64, headers: &HeaderMap, body: OriginBody) -> Response<OriginBody> {
    let range = headers
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().strip_prefix("bytes="))
        .filter(|v| !v.contains(','))
        .and_then(|v| v.split_once('-'))
        .and_then(|(a, b)| {
            let (a, b) = (a.trim(), b.trim());
            match (a.parse::<u64>().ok(), b.parse::<u64>().ok()) {
                (Some(a), Some(b)) if a <= b => Some((a, b.min(len.saturating_sub(1)))),
                (Some(a), None) if b.is_empty() => Some((a, len.saturating_sub(1))),
                (None, Some(n)) if a.is_empty() && n > 0 => {
                    Some((len.saturating_sub(n), len.saturating_sub(1)))
                }
                _ => None,
            }
        });
    match range {
        None => reply(StatusCode::OK, body.pattern(0, len, FRAME).exact())
            .header(header::CONTENT_LENGTH, len)
            .header(header::ACCEPT_RANGES, "bytes")
            .body_now(),
        Some((first, _)) if first >= len => reply(StatusCode::RANGE_NOT_SATISFIABLE, body)
            .header(header::CONTENT_RANGE, format!("bytes */{len}"))
            .body_now(),
        Some((first, last)) => reply(
            StatusCode::PARTIAL_CONTENT,
            body.pattern(first, last + 1, FRAME).exact(),
        )
        .header(header::CONTENT_LENGTH, last + 1 - first)
        .header(header::CONTENT_RANGE, format!("bytes {first}-{last}/{len}"))
        .header(header::ACCEPT_RANGES, "bytes")
        .body_now(),
    }
}

fn bad_request(body: OriginBody) -> Response<OriginBody> {
    reply(StatusCode::BAD_REQUEST, body).body_now()
}

/// A response builder that already holds its body.
struct Reply {
    builder: http::response::Builder,
    body: OriginBody,
}

fn reply(status: StatusCode, body: OriginBody) -> Reply {
    Reply {
        builder: Response::builder().status(status),
        body,
    }
}

impl Reply {
    fn header<K, V>(mut self, name: K, value: V) -> Self
    where
        http::HeaderName: TryFrom<K>,
        <http::HeaderName as TryFrom<K>>::Error: Into<http::Error>,
        HeaderValue: TryFrom<V>,
        <HeaderValue as TryFrom<V>>::Error: Into<http::Error>,
    {
        self.builder = self.builder.header(name, value);
        self
    }

    fn body_now(self) -> Response<OriginBody> {
        self.builder.body(self.body).unwrap()
    }
}

/// How a generated body ends once its data is out.
enum Tail {
    Trailers(HeaderMap),
    /// An error from the body stream: hyper aborts the connection (h1) or resets the
    /// stream (h2), so the peer sees a truncated body.
    Fail,
}

/// A response body generated on the fly: an optional fixed chunk, then pattern bytes
/// `[pos, end)` in frames of `frame` bytes (`delay` apart), then an optional tail.
/// Dropped before its end, it counts as an aborted response.
struct OriginBody {
    aborted: Option<Arc<Shared>>,
    head: Option<Bytes>,
    pos: u64,
    end: u64,
    frame: usize,
    delay: Option<Duration>,
    sleep: Option<Pin<Box<Sleep>>>,
    tail: Option<Tail>,
    /// Whether to announce the exact length (else hyper chunks on h1).
    exact: bool,
}

impl OriginBody {
    fn new(shared: &Arc<Shared>) -> Self {
        OriginBody {
            aborted: Some(shared.clone()),
            head: None,
            pos: 0,
            end: 0,
            frame: FRAME,
            delay: None,
            sleep: None,
            tail: None,
            exact: false,
        }
    }

    fn head(mut self, data: Bytes) -> Self {
        self.head = Some(data);
        self
    }

    fn pattern(mut self, from: u64, to: u64, frame: usize) -> Self {
        assert!(frame > 0 && frame <= FRAME);
        (self.pos, self.end, self.frame) = (from, to, frame);
        self
    }

    fn every(mut self, delay: Duration) -> Self {
        self.delay = Some(delay);
        self
    }

    fn then(mut self, tail: Tail) -> Self {
        self.tail = Some(tail);
        self
    }

    fn exact(mut self) -> Self {
        self.exact = true;
        self
    }

    fn remaining(&self) -> u64 {
        self.head.as_ref().map_or(0, |h| h.len() as u64) + self.end.saturating_sub(self.pos)
    }

    fn done(&self) -> bool {
        self.head.is_none() && self.pos >= self.end && self.tail.is_none()
    }
}

impl Body for OriginBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        if let Some(head) = this.head.take() {
            return Poll::Ready(Some(Ok(Frame::data(head))));
        }
        if this.pos < this.end {
            if let Some(delay) = this.sleep.as_mut() {
                ready!(delay.as_mut().poll(cx));
                this.sleep = None;
            }
            let len = (this.end - this.pos).min(this.frame as u64) as usize;
            let data = pattern_bytes(this.pos, len);
            this.pos += len as u64;
            if let (Some(delay), true) = (this.delay, this.pos < this.end) {
                this.sleep = Some(Box::pin(sleep(delay)));
            }
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        if let Some(Tail::Fail) = this.tail {
            // A pause before failing lets hyper flush the bytes already produced (it
            // flushes when the body is pending), so the peer reliably sees them all
            // before the abort.
            let pause = this
                .sleep
                .get_or_insert_with(|| Box::pin(sleep(Duration::from_millis(50))));
            ready!(pause.as_mut().poll(cx));
        }
        Poll::Ready(match this.tail.take() {
            None => None,
            Some(Tail::Trailers(trailers)) => Some(Ok(Frame::trailers(trailers))),
            Some(Tail::Fail) => Some(Err("origin: deliberate failure mid-body".into())),
        })
    }

    fn is_end_stream(&self) -> bool {
        // hyper stops polling (and drops the body) as soon as this is true.
        self.done()
    }

    fn size_hint(&self) -> SizeHint {
        if self.exact {
            SizeHint::with_exact(self.remaining())
        } else {
            SizeHint::default()
        }
    }
}

impl Drop for OriginBody {
    fn drop(&mut self) {
        if let (false, Some(shared)) = (self.done(), &self.aborted) {
            shared.aborted.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// The pattern repeats every 251 * 256 bytes: `7 * 64256` is a multiple of 256 and
/// `i / 251` grows by exactly 256 over one period.
const PERIOD: usize = 251 * 256;

/// The first `len` pattern bytes: position-dependent, so a wrong offset shows.
pub fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + i / 251) as u8).collect()
}

/// Pattern bytes `[offset, offset + len)`, a zero-copy slice of three periods.
fn pattern_bytes(offset: u64, len: usize) -> Bytes {
    static PERIODS: OnceLock<Bytes> = OnceLock::new();
    let periods = PERIODS.get_or_init(|| pattern(3 * PERIOD).into());
    assert!(len <= 2 * PERIOD);
    let start = (offset % PERIOD as u64) as usize;
    periods.slice(start..start + len)
}

/// Raw TCP: for each connection, reads one request head, answers
/// `HTTP/1.1 200 OK` + `connection: close` + the body with no length (delimited by the
/// close), shuts down its write half, and keeps reading for up to 2 s (until the peer
/// closes too) before closing. A proxy must treat the FIN as the end of the body.
pub struct HalfCloseOrigin {
    pub addr: SocketAddr,
    connections: Arc<AtomicUsize>,
    _task: Task,
}

impl HalfCloseOrigin {
    const MAX_CONNECTIONS: usize = 100;
    const MAX_CONNECTION_TIME: Duration = Duration::from_secs(10);
    const MAX_HEAD: usize = 64 * 1024;

    pub async fn start(body: Vec<u8>) -> HalfCloseOrigin {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let body = Arc::new(body);
        let connections = Arc::new(AtomicUsize::new(0));
        let counter = connections.clone();
        let _task = Task::spawn(async move {
            let mut conns = JoinSet::new();
            for _ in 0..Self::MAX_CONNECTIONS {
                let Ok(Ok((stream, _))) = timeout(MAX_LIFETIME, listener.accept()).await else {
                    break;
                };
                counter.fetch_add(1, Ordering::SeqCst);
                while conns.try_join_next().is_some() {}
                let body = body.clone();
                conns.spawn(async move {
                    let _ = timeout(Self::MAX_CONNECTION_TIME, Self::serve(stream, &body)).await;
                });
            }
            while conns.join_next().await.is_some() {}
        });
        HalfCloseOrigin {
            addr,
            connections,
            _task,
        }
    }

    /// TCP connections accepted so far.
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }

    async fn serve(mut stream: TcpStream, body: &[u8]) -> std::io::Result<()> {
        let mut head = Vec::new();
        let mut buf = [0u8; 4096];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            if head.len() > Self::MAX_HEAD {
                return Ok(());
            }
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                return Ok(());
            }
            head.extend_from_slice(&buf[..n]);
        }
        stream
            .write_all(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n")
            .await?;
        stream.write_all(body).await?;
        stream.shutdown().await?;
        // Half-closed: still reading, so whatever the peer sends is consumed rather
        // than answered with a reset when the socket finally closes.
        let _ = timeout(Duration::from_secs(2), async {
            while let Ok(1..) = stream.read(&mut buf).await {}
        })
        .await;
        Ok(())
    }
}
