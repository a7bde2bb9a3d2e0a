//! HTTP/1.1 driver: keep-alive, pipelining-safe, with a bulk path for file bodies.
//!
//! Requests are parsed with httparse from one bounded read buffer; bytes after a
//! request head stay there for the next request, so pipelined requests are answered
//! in order. Responses go out through the shared send loop
//! ([`send_body`]); what is HTTP/1.1's own is here: the head written with the first
//! body bytes, chunked framing for relayed bodies of unknown length, a file response
//! inside one `TCP_CORK` interval, and, after [`BULK_PROMOTION`] bytes of a file, the
//! move to kernel TLS and `sendfile` for the rest.
//!
//! Memory per connection is bounded by `limits.max_header_bytes` (read side) plus one
//! file buffer of at most [`H1_CHUNK`] while a file response is sent, plus rustls'
//! own buffers. File reads are sized by the client (`ResponseBody::sized_by_writer`, by
//! [`DrainRate`] from what leaves the socket) and are never larger than what the socket
//! takes at that moment (`sys::tcp_send_room`), so a read is written whole unless the
//! kernel shrinks the send buffer under memory pressure; rustls holds at most one
//! chunk's worth of records ([`Stream::bound_pending`]) instead of its default 64 KiB.
//! A client that reads slowly, or that read fast and then stopped, leaves the
//! response waiting in a write with a 16 KiB chunk and about one 16 KiB record; a
//! client that keeps up gets chunks of up to [`H1_CHUNK`] and 64 KiB of records, and
//! holds them only while the socket takes them. `send_timeout` ends a client that
//! stops reading altogether.

use std::future::Future;
use std::io::{self, IoSlice};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, StatusCode, Uri, Version};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::exchange::{send_body, BodyWriter, ConnContext, Progress, Proto, Record, ResponseBody, SendError};
use crate::files::cursor::{FileRange, H1_CHUNK};
use crate::ktls::{self, Promotion, RustlsStream};
use crate::message::Response;
use crate::sys;

use super::drain::DrainRate;

mod stream;

use stream::Stream;

/// Most headers one request may carry.
const MAX_HEADERS: usize = 100;
/// A request body up to this size (on GET/HEAD) is read and dropped to keep the
/// connection; a larger one closes it after the response.
const MAX_DISCARD: u64 = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub(crate) enum H1Error {
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    #[error(transparent)]
    Send(SendError),
}

/// Serves one connection until the client closes it, a timeout fires, an error
/// happens, or shutdown is requested (between responses).
///
/// Not an `async fn`: the stream is boxed before the future is made, so the
/// connection's future holds a pointer, not the 1 KiB rustls stream beside its box.
pub(crate) fn serve(stream: RustlsStream, ctx: ConnContext) -> impl Future<Output = Result<(), H1Error>> {
    let mut stream = Stream::Rustls(Box::new(stream));
    async move {
        let mut conn = Conn {
            read: BytesMut::new(),
            head: Vec::new(),
            ctx,
        };
        let result = conn.run(&mut stream).await;
        // Best effort close_notify; the peer may already be gone.
        let _ = tokio::time::timeout(Duration::from_secs(1), stream.shutdown()).await;
        result
    }
}

struct Conn {
    /// Bytes received and not yet consumed, bounded by `max_header_bytes`; no
    /// allocation while the connection waits for a request (see `read_request`).
    read: BytesMut,
    /// Response head serialization, reused within a burst of requests and given
    /// back with the read buffer when the connection goes idle.
    head: Vec<u8>,
    ctx: ConnContext,
}

// Lives for one request on the stack; boxing would only add an allocation.
#[allow(clippy::large_enum_variant)]
enum Next {
    Request(Parsed),
    /// Clean end: the peer closed, idled out, or the server is shutting down.
    Close,
    /// Answer with this status, then close.
    Reject(StatusCode),
}

struct Parsed {
    method: Method,
    uri: Uri,
    version: Version,
    headers: HeaderMap,
    keep_alive: bool,
    body: RequestBody,
}

enum RequestBody {
    None,
    Discard(u64),
    /// Chunked or too large to drain: the connection closes after the response.
    Unframed,
}

impl Conn {
    async fn run(&mut self, stream: &mut Stream) -> Result<(), H1Error> {
        let mut shutdown = self.ctx.shutdown.clone();
        let mut first = true;
        loop {
            // Shutdown interrupts only an idle connection; a request already arriving
            // (pipelined bytes buffered) is still answered, with `connection: close`.
            // A connection that has not sent its first request yet was accepted just
            // before the drain (in an upgrade, the old process's last accept): its
            // client is sending that request now, so it gets a moment for it.
            let idle = self.read.is_empty();
            let wait_first = first;
            let next = tokio::select! {
                next = self.read_request(stream) => next?,
                () = async {
                    if wait_first {
                        super::drain_grace_over(&mut shutdown).await;
                    } else {
                        shutdown.requested().await;
                    }
                }, if idle => Next::Close,
            };
            first = false;
            let req = match next {
                Next::Request(req) => req,
                Next::Close => return Ok(()),
                Next::Reject(status) => {
                    let (resp, record) = self.ctx.reject(Proto::H1, status);
                    Box::pin(self.respond(stream, &Method::GET, resp, record, false)).await?;
                    return Ok(());
                }
            };
            let mut keep_alive = req.keep_alive;
            match req.body {
                RequestBody::None => {}
                RequestBody::Discard(n) => {
                    if !Box::pin(self.discard(stream, n)).await? {
                        return Ok(());
                    }
                }
                RequestBody::Unframed => keep_alive = false,
            }
            let mut head = self.ctx.head(&req.method, &req.uri, req.version, &req.headers);
            // This driver drains request bodies; proxy sites get hyper's (`http::hyper`).
            head.body_forwardable = false;
            // Handling and responding are boxed: their futures (the service, the send
            // loop) are far larger than the wait for a request, and an idle
            // connection's task would otherwise be allocated at their size.
            let (resp, record) = Box::pin(self.ctx.handle(&head, crate::message::empty_body())).await;
            keep_alive &= !self.ctx.shutdown.is_requested();
            Box::pin(self.respond(stream, &req.method, resp, record, keep_alive)).await?;
            if !keep_alive {
                return Ok(());
            }
        }
    }
    /// Reads until one request head is complete. The first byte may take up to the
    /// idle timeout; the rest of the head must arrive within the header timeout.
    async fn read_request(&mut self, stream: &mut Stream) -> Result<Next, H1Error> {
        let limits = self.ctx.limits;
        let mut deadline = None;
        loop {
            if !self.read.is_empty() {
                match self.parse()? {
                    Some(next) => return Ok(next),
                    None if self.read.len() >= limits.max_header_bytes => {
                        return Ok(Next::Reject(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE))
                    }
                    None => {}
                }
            }
            let wait = match deadline {
                Some(d) => d,
                None if self.read.is_empty() => tokio::time::Instant::now() + limits.idle_timeout,
                None => tokio::time::Instant::now() + limits.header_read_timeout,
            };
            if self.read.is_empty() {
                // Idle: an idle connection holds no buffers of its own (8 KiB read and
                // 1 KiB head buffers were 9 of its 30 KiB, heaptrack); they are
                // allocated again once bytes arrive.
                self.read = BytesMut::new();
                self.head = Vec::new();
                match tokio::time::timeout_at(wait, stream.readable()).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) if is_disconnect(&e) => return Ok(Next::Close),
                    Ok(Err(e)) => return Err(e.into()),
                    Err(_) => return Ok(Next::Close),
                }
            }
            let room = limits.max_header_bytes - self.read.len();
            self.read.reserve(room.min(8 * 1024));
            let mut limited = (&mut *stream).take(room as u64);
            let n = match tokio::time::timeout_at(wait, limited.read_buf(&mut self.read)).await {
                Ok(Ok(n)) => n,
                Ok(Err(e)) if self.read.is_empty() && is_disconnect(&e) => return Ok(Next::Close),
                Ok(Err(e)) => return Err(e.into()),
                Err(_) if self.read.is_empty() => return Ok(Next::Close),
                Err(_) => return Ok(Next::Reject(StatusCode::REQUEST_TIMEOUT)),
            };
            if n == 0 {
                // EOF: clean between requests, truncated inside one.
                return Ok(Next::Close);
            }
            if deadline.is_none() {
                deadline = Some(tokio::time::Instant::now() + limits.header_read_timeout);
            }
        }
    }

    /// Parses a complete head from `self.read`, consuming it; `None` if incomplete.
    fn parse(&mut self) -> Result<Option<Next>, H1Error> {
        let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut req = httparse::Request::new(&mut slots);
        let consumed = match req.parse(&self.read) {
            Ok(httparse::Status::Complete(n)) => n,
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(httparse::Error::TooManyHeaders) => {
                return Ok(Some(Next::Reject(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE)))
            }
            Err(_) => return Ok(Some(Next::Reject(StatusCode::BAD_REQUEST))),
        };
        let next = build(&req);
        self.read.advance(consumed);
        Ok(Some(next))
    }

    /// Reads and drops `n` bytes of request body. `false` if the peer went away.
    async fn discard(&mut self, stream: &mut Stream, mut n: u64) -> Result<bool, H1Error> {
        let buffered = (self.read.len() as u64).min(n);
        self.read.advance(buffered as usize);
        n -= buffered;
        let mut sink = [0u8; 8 * 1024];
        while n > 0 {
            let want = (n as usize).min(sink.len());
            let read = tokio::time::timeout(
                self.ctx.limits.header_read_timeout,
                stream.read(&mut sink[..want]),
            )
            .await
            .map_err(|_| io::Error::from(io::ErrorKind::TimedOut))??;
            if read == 0 {
                return Ok(false);
            }
            n -= read as u64;
        }
        Ok(true)
    }

    async fn respond(
        &mut self,
        stream: &mut Stream,
        method: &Method,
        resp: Response,
        record: Record,
        keep_alive: bool,
    ) -> Result<(), H1Error> {
        let Response {
            status,
            mut headers,
            body,
        } = resp;
        let bodiless = *method == Method::HEAD
            || status.is_informational()
            || status == StatusCode::NO_CONTENT
            || status == StatusCode::NOT_MODIFIED;
        let mut body = if bodiless {
            ResponseBody::empty()
        } else {
            ResponseBody::sized_by_writer(body, H1_CHUNK)
        }
        .recorded(record);
        if body.has_file_left() && self.read.is_empty() {
            // A file response may take long (a slow client); the empty read buffer
            // would be given back before the next request anyway.
            self.read = BytesMut::new();
        }
        let chunked = body.is_relay() && !headers.contains_key(header::CONTENT_LENGTH);
        if chunked {
            headers.insert(header::TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
        }
        self.head.clear();
        write_head(&mut self.head, status, &headers, keep_alive);
        // Head and a file body in one corked interval: the head shares its first
        // segments with the body instead of leaving alone.
        let corked = body.has_file_left() && stream.tcp().is_some_and(|tcp| sys::set_cork(tcp, true).is_ok());
        // Only a connection still in rustls can move; a promoted one stays promoted.
        let promotion = match stream {
            Stream::Rustls(_) => self.ctx.ktls.clone().map(|support| (support, &mut self.read)),
            _ => None,
        };
        let mut writer = Writer {
            stream,
            head: &mut self.head,
            head_sent: false,
            chunked,
            send_timeout: self.ctx.limits.send_timeout,
            promotion,
            peer: self.ctx.peer(),
            drain: DrainRate::default(),
        };
        // A relayed body may be slow to start (or fail first): its head goes now, not
        // with the first body bytes.
        let relay = body.is_relay();
        let sent = match relay {
            true => writer.send_head_now().await,
            false => Ok(()),
        };
        let sent = match sent {
            Ok(()) => send_body(body, &mut writer, self.ctx.limits.send_timeout).await,
            Err(e) => {
                body.settle(e.outcome());
                Err(e)
            }
        };
        if corked {
            if let Some(tcp) = writer.stream.tcp() {
                let _ = sys::set_cork(tcp, false);
            }
        }
        sent.map_err(H1Error::Send)
    }
}

/// One response on the connection, as the shared send loop writes it: the head goes
/// out with the first body bytes, relayed bodies without a length are chunked, and a
/// file response may move the connection to kernel TLS halfway.
struct Writer<'a> {
    stream: &'a mut Stream,
    /// The serialized head, written with the first body bytes (or at the end).
    head: &'a mut Vec<u8>,
    head_sent: bool,
    chunked: bool,
    send_timeout: Duration,
    /// Kernel TLS support and the connection's read buffer (for the plaintext rustls
    /// already decrypted), until a promotion was tried.
    promotion: Option<(std::sync::Arc<ktls::Support>, &'a mut BytesMut)>,
    peer: std::net::SocketAddr,
    /// What left the socket for the client, for the size of the next file read.
    drain: DrainRate,
}

/// A body chunk up to this size travels in the head's write (one record, one
/// syscall for a small response).
const COALESCE: usize = 16 * 1024;

impl Writer<'_> {
    /// Writes `data`, after the head if it has not gone yet (in the same write when
    /// `data` is small).
    async fn write(&mut self, data: &[u8]) -> Result<(), SendError> {
        self.stream.bound_pending(data.len());
        self.drain.wrote(data.len());
        if !self.head_sent && data.len() <= COALESCE {
            self.head_sent = true;
            return self.write_with_head(data).await;
        }
        self.send_head().await?;
        timed(self.send_timeout, self.stream.write_all(data)).await
    }

    /// The head and `data` in one write (one record when they fit), without copying
    /// `data` behind the head: the head buffer lives as long as the connection.
    async fn write_with_head(&mut self, data: &[u8]) -> Result<(), SendError> {
        self.drain.wrote(self.head.len());
        let (stream, mut head, mut data) = (&mut *self.stream, &self.head[..], data);
        let all = async move {
            while !head.is_empty() || !data.is_empty() {
                let n = stream
                    .write_vectored(&[IoSlice::new(head), IoSlice::new(data)])
                    .await?;
                if n == 0 {
                    return Err(io::ErrorKind::WriteZero.into());
                }
                let from_head = n.min(head.len());
                head = &head[from_head..];
                data = &data[n - from_head..];
            }
            Ok(())
        };
        timed(self.send_timeout, all).await
    }

    /// The head, on the wire now.
    async fn send_head_now(&mut self) -> Result<(), SendError> {
        self.send_head().await?;
        timed(self.send_timeout, self.stream.flush()).await
    }

    /// The head, unless it has gone already: every way a body leaves (bytes, a file
    /// range by sendfile, the end) goes through here first.
    async fn send_head(&mut self) -> Result<(), SendError> {
        if self.head_sent {
            return Ok(());
        }
        self.head_sent = true;
        self.drain.wrote(self.head.len());
        timed(self.send_timeout, self.stream.write_all(self.head)).await
    }

    /// Tries to move the stream to kernel TLS. Staying in rustls is fine; only a
    /// kernel that refuses keys it accepted at preflight loses the connection.
    async fn promote(&mut self) -> Result<(), SendError> {
        let Some((support, read)) = self.promotion.take() else {
            return Ok(());
        };
        if !matches!(self.stream, Stream::Rustls(_)) {
            return Ok(());
        }
        timed(self.send_timeout, self.stream.flush()).await?;
        let tls = match std::mem::replace(self.stream, Stream::Promoting) {
            Stream::Rustls(tls) => tls,
            other => {
                *self.stream = other;
                return Ok(());
            }
        };
        match ktls::promote(*tls, &support) {
            Promotion::Kernel(kernel, leftover) => {
                tracing::debug!(peer = %self.peer, "h1: promoted to kernel TLS");
                // Plaintext rustls had decrypted but the parser had not consumed: a
                // pipelined request, which comes before anything still in the socket.
                read.extend_from_slice(&leftover);
                *self.stream = Stream::Kernel(kernel);
                Ok(())
            }
            Promotion::Stayed(tls, reason) => {
                tracing::debug!(peer = %self.peer, %reason, "h1: stays in rustls");
                *self.stream = Stream::Rustls(tls);
                Ok(())
            }
            Promotion::Lost(reason) => {
                tracing::warn!(peer = %self.peer, %reason, "h1: kernel TLS refused the keys; connection closed");
                Err(SendError::peer(reason))
            }
        }
    }
}

impl BodyWriter for Writer<'_> {
    async fn data(&mut self, data: Bytes) -> Result<(), SendError> {
        if self.chunked {
            let size = format!("{:x}\r\n", data.len());
            self.write(size.as_bytes()).await?;
            self.write(&data).await?;
            return self.write(b"\r\n").await;
        }
        self.write(&data).await
    }

    async fn trailers(&mut self, trailers: HeaderMap) -> Result<(), SendError> {
        if !self.chunked {
            // A sized body has nowhere to carry trailers (RFC 9112 §7.1.2).
            return Ok(());
        }
        self.chunked = false;
        let mut last = b"0\r\n".to_vec();
        write_fields(&mut last, &trailers);
        last.extend_from_slice(b"\r\n");
        self.write(&last).await
    }

    async fn finish(&mut self) -> Result<(), SendError> {
        if self.chunked {
            self.chunked = false;
            self.write(b"0\r\n\r\n").await?;
        }
        self.send_head().await?;
        timed(self.send_timeout, self.stream.flush()).await
    }

    /// Returning the error is enough: the connection closes without finishing the
    /// message (no last chunk, or fewer bytes than its length), which the client sees.
    fn abort(&mut self) {}

    async fn progress(&mut self, progress: Progress) -> Result<(), SendError> {
        if self.promotion.is_some() && progress.sent >= BULK_PROMOTION && progress.file_left {
            self.promote().await?;
        }
        Ok(())
    }

    fn next_read_size(&mut self) -> Option<u64> {
        let tcp = self.stream.tcp()?;
        let unsent = sys::tcp_unsent(tcp).ok()?;
        let room = sys::tcp_send_room(tcp).ok()?;
        Some(self.drain.next_read(unsent, room, std::time::Instant::now()))
    }

    fn sends_files(&self) -> bool {
        matches!(self.stream, Stream::Kernel(_))
    }

    async fn file(&mut self, range: FileRange) -> Result<(), SendError> {
        // A response that starts on a promoted connection has sent nothing yet.
        self.send_head().await?;
        let Stream::Kernel(kernel) = &mut *self.stream else {
            return Err(SendError::peer("sendfile needs kernel TLS"));
        };
        kernel
            .sendfile(&range.file, range.offset, range.len, self.send_timeout)
            .await
            .map_err(|e| match e.kind() {
                io::ErrorKind::TimedOut => SendError::Timeout,
                io::ErrorKind::UnexpectedEof => SendError::Body(e.into()),
                _ => SendError::peer(e),
            })
    }
}

/// Bytes of body after which an HTTP/1.1 file response may move to kernel TLS.
pub(crate) const BULK_PROMOTION: u64 = 1024 * 1024;

async fn timed<F: std::future::Future<Output = io::Result<()>>>(
    limit: Duration,
    f: F,
) -> Result<(), SendError> {
    match tokio::time::timeout(limit, f).await {
        Ok(r) => r.map_err(SendError::peer),
        Err(_) => Err(SendError::Timeout),
    }
}

fn is_disconnect(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionReset | io::ErrorKind::UnexpectedEof | io::ErrorKind::BrokenPipe
    )
}

/// Turns a parsed httparse request into the typed head, deciding framing and
/// connection persistence. Ambiguous framing is refused (request smuggling).
fn build(req: &httparse::Request<'_, '_>) -> Next {
    let version = match req.version {
        Some(1) => Version::HTTP_11,
        Some(0) => Version::HTTP_10,
        _ => return Next::Reject(StatusCode::HTTP_VERSION_NOT_SUPPORTED),
    };
    let Ok(method) = Method::from_bytes(req.method.unwrap_or_default().as_bytes()) else {
        return Next::Reject(StatusCode::BAD_REQUEST);
    };
    let Ok(uri) = req.path.unwrap_or_default().parse::<Uri>() else {
        return Next::Reject(StatusCode::BAD_REQUEST);
    };
    if uri.path().is_empty() || (uri.scheme().is_none() && !uri.path().starts_with('/')) {
        return Next::Reject(StatusCode::BAD_REQUEST);
    }
    let mut headers = HeaderMap::with_capacity(req.headers.len());
    for h in req.headers.iter() {
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(h.name.as_bytes()),
            HeaderValue::from_bytes(h.value),
        ) else {
            return Next::Reject(StatusCode::BAD_REQUEST);
        };
        headers.append(name, value);
    }
    let mut close = false;
    let mut keep_alive_token = false;
    for value in headers.get_all(header::CONNECTION) {
        for token in value.to_str().unwrap_or("").split(',') {
            let token = token.trim();
            close |= token.eq_ignore_ascii_case("close");
            keep_alive_token |= token.eq_ignore_ascii_case("keep-alive");
        }
    }
    let keep_alive = match version {
        Version::HTTP_11 => !close,
        _ => keep_alive_token && !close,
    };
    let has_te = headers.contains_key(header::TRANSFER_ENCODING);
    let lengths: Vec<&HeaderValue> = headers.get_all(header::CONTENT_LENGTH).iter().collect();
    if has_te && !lengths.is_empty() {
        return Next::Reject(StatusCode::BAD_REQUEST);
    }
    let body = if has_te {
        RequestBody::Unframed
    } else if let Some(first) = lengths.first() {
        let parsed = first
            .to_str()
            .ok()
            .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|s| s.parse::<u64>().ok());
        match parsed {
            Some(n) if lengths.iter().all(|v| v == first) => match n {
                0 => RequestBody::None,
                n if n <= MAX_DISCARD => RequestBody::Discard(n),
                _ => RequestBody::Unframed,
            },
            _ => return Next::Reject(StatusCode::BAD_REQUEST),
        }
    } else {
        RequestBody::None
    };
    Next::Request(Parsed {
        method,
        uri,
        version,
        headers,
        keep_alive,
        body,
    })
}

/// The status line and fields (`Server` and `Date` are among them: the seam stamps
/// them).
fn write_head(out: &mut Vec<u8>, status: StatusCode, headers: &HeaderMap, keep_alive: bool) {
    // Always answered as HTTP/1.1, whatever the request's minor version (RFC 9110 §6.2).
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    write_fields(out, headers);
    if !keep_alive {
        out.extend_from_slice(b"connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

fn write_fields(out: &mut Vec<u8>, fields: &HeaderMap) {
    for (name, value) in fields {
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(raw: &[u8]) -> Next {
        let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut req = httparse::Request::new(&mut slots);
        assert!(req.parse(raw).unwrap().is_complete());
        build(&req)
    }

    fn reject(raw: &[u8]) -> StatusCode {
        match parse(raw) {
            Next::Reject(s) => s,
            _ => panic!("accepted {:?}", String::from_utf8_lossy(raw)),
        }
    }

    #[test]
    fn keep_alive_rules() {
        let ka = |raw: &[u8]| match parse(raw) {
            Next::Request(p) => p.keep_alive,
            _ => panic!("rejected"),
        };
        assert!(ka(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"));
        assert!(!ka(b"GET / HTTP/1.1\r\nHost: a\r\nConnection: Close\r\n\r\n"));
        assert!(!ka(b"GET / HTTP/1.0\r\n\r\n"));
        assert!(ka(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"));
    }

    #[test]
    fn ambiguous_framing_is_refused() {
        assert_eq!(
            reject(b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"),
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            reject(b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n"),
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            reject(b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: +5\r\n\r\n"),
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            reject(b"GET nothing HTTP/1.1\r\nHost: a\r\n\r\n"),
            StatusCode::BAD_REQUEST
        );
    }

    #[test]
    fn bodies_are_drained_or_close_the_connection() {
        match parse(b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\n") {
            Next::Request(Parsed {
                body: RequestBody::Discard(10),
                ..
            }) => {}
            _ => panic!("small body not drained"),
        }
        match parse(b"GET / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n") {
            Next::Request(Parsed {
                body: RequestBody::Unframed,
                ..
            }) => {}
            _ => panic!("chunked body must close"),
        }
    }

    #[test]
    fn head_carries_length_and_close() {
        let mut out = Vec::new();
        let resp = crate::message::Response::status(StatusCode::NOT_FOUND);
        write_head(&mut out, resp.status, &resp.headers, false);
        let text = String::from_utf8(out).unwrap();
        assert!(text.starts_with("HTTP/1.1 404 Not Found\r\n"), "{text}");
        assert!(text.contains("\r\ncontent-length: 0\r\n"));
        assert!(text.ends_with("connection: close\r\n\r\n"));
    }
}
