//! A frame-level guard in front of hyper's HTTP/2 server: it reads the client's
//! frames before h2 does and answers the RFC 9113 requirements h2 0.4 gets wrong
//! (or answers with another error code) itself, with GOAWAY or RST_STREAM and the
//! code the RFC names. It also bounds two floods h2 leaves to the caller: a header
//! block that never ends (CVE-2024-27316-style CONTINUATION floods) and clients
//! that cancel streams as fast as they open them (CVE-2023-44487, "rapid reset").
//!
//! What it answers (everything else goes to h2 unchanged):
//! - frame sizes of PING, SETTINGS, RST_STREAM, WINDOW_UPDATE, GOAWAY, PRIORITY and
//!   frames over our SETTINGS_MAX_FRAME_SIZE: FRAME_SIZE_ERROR (h2: PROTOCOL_ERROR);
//! - SETTINGS values: INITIAL_WINDOW_SIZE over 2^31-1 is FLOW_CONTROL_ERROR (h2:
//!   PROTOCOL_ERROR), ENABLE_PUSH and MAX_FRAME_SIZE ranges PROTOCOL_ERROR;
//! - HPACK decoding errors: COMPRESSION_ERROR (h2: PROTOCOL_ERROR), for which the
//!   guard decodes every header block with its own decoder, kept in step with h2's
//!   (same blocks, same order, same table size limit);
//! - DATA or HEADERS after the client ended the stream: STREAM_CLOSED (h2:
//!   PROTOCOL_ERROR);
//! - pseudo-fields in trailers, CONNECT without :authority: a PROTOCOL_ERROR stream
//!   error (h2 accepts them);
//! - DATA beyond the flow-control window the server granted: FLOW_CONTROL_ERROR,
//!   decided on the bytes as they arrive (h2 may have reset the stream first).
//!
//! Time: a header block (HEADERS until END_HEADERS), or any frame other than a
//! DATA payload, that is not complete `header_read_timeout` after its first byte
//! arrived ends the connection with GOAWAY PROTOCOL_ERROR (what nginx sends when
//! `client_header_timeout` fires on an unfinished frame), also while other streams
//! are in flight. A timer polled with the reads fires it when the client sends
//! nothing more; a write of hyper's notices it too (h2 may not read while its
//! output waits on the socket). A client that reads nothing cannot be sent the
//! GOAWAY: the [`HeadClock`] lets the connection driver drop it a grace later.
//!
//! A connection error is a GOAWAY written at the next frame boundary of hyper's
//! output, after which hyper reads end of stream and its further output is
//! dropped. A stream error is a RST_STREAM written to the client the same way,
//! while h2 is handed a RST_STREAM(CANCEL) from the "client" after the offending
//! frame, so both sides forget the stream. Header blocks always reach h2, so its
//! HPACK table stays in step with the client's.
//!
//! The guard is built with hyper's connection, once the connection's rest ends
//! ([`handshake`], `http::rest`: until its first request a connection holds only what its client's
//! handshake sent).
//!
//! Memory: one frame of input (up to our SETTINGS_MAX_FRAME_SIZE; DATA payloads
//! are streamed through, never buffered), one header block (capped), a table of
//! open streams (h2 caps those with SETTINGS_MAX_CONCURRENT_STREAMS; the guard
//! drops a connection past a hard cap; a stream leaves it once both sides ended or
//! either reset it), and the guard's own frames waiting for a frame boundary of
//! hyper's output (past `MAX_INJECT` bytes the client is not read). Stream errors
//! the guard answers itself count like h2's own: past `max_local_error_resets` on
//! one connection, GOAWAY ENHANCE_YOUR_CALM.

mod frames;
pub(crate) mod handshake;
mod judge;

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use frames::{frame_end, Output, DEFAULT_WINDOW, MAX_INJECT, MAX_READ, PREFACE};
use judge::{Block, Stream};

/// The HTTP/2 settings of one connection that the guard judges by: [`guard_limits`]
/// makes them and [`GuardLimits::configure`] gives them to hyper's builder, so what
/// the guard assumes is what h2 advertises.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GuardLimits {
    /// Our SETTINGS_MAX_FRAME_SIZE.
    pub(crate) max_frame_size: u32,
    /// Our SETTINGS_INITIAL_WINDOW_SIZE. (The connection window starts at the
    /// default; h2's WINDOW_UPDATE raising it is followed like any other.)
    pub(crate) stream_window: u32,
    /// Our SETTINGS_MAX_HEADER_LIST_SIZE; a header block's encoded bytes may be at
    /// most twice this, or twice 16 KiB if that is more (HPACK never needs more for
    /// a list this size).
    pub(crate) max_header_bytes: usize,
    /// Our SETTINGS_MAX_CONCURRENT_STREAMS: the open-stream table's scale, and the
    /// number of streams a client may cancel per second before GOAWAY
    /// ENHANCE_YOUR_CALM. Lower on proxy sites (their send budget).
    pub(crate) max_concurrent_streams: u32,
    /// How long a header block, or any frame but DATA, may take from its first
    /// byte to its last (`header_read_timeout`).
    pub(crate) header_timeout: Duration,
    /// Our SETTINGS_HEADER_TABLE_SIZE: the guard's HPACK decoder follows h2's.
    pub(crate) header_table_size: u32,
    /// Bytes a stream may queue beyond its window (h2's send buffer).
    pub(crate) max_send_buffer: usize,
    /// Stream errors the server may answer on one connection before it ends it
    /// with GOAWAY ENHANCE_YOUR_CALM: h2 counts its own, the guard its own.
    pub(crate) max_local_error_resets: usize,
    /// SETTINGS_ENABLE_CONNECT_PROTOCOL (RFC 8441): WebTransport over HTTP/2 opens
    /// its sessions with extended CONNECT.
    pub(crate) connect_protocol: bool,
}

/// h2's default stream errors per connection (stated, so the guard counts the same).
const MAX_LOCAL_ERROR_RESETS: usize = 1024;

/// The limits of a connection of `ctx`, for hyper's builder and the guard alike.
pub(crate) fn guard_limits(ctx: &crate::exchange::ConnContext) -> GuardLimits {
    let h2 = ctx.h2;
    let mut limits = GuardLimits {
        max_frame_size: h2.max_frame_size_bytes,
        stream_window: h2.initial_stream_window_bytes,
        max_header_bytes: ctx.limits.max_header_bytes,
        max_concurrent_streams: h2.max_concurrent_streams,
        header_table_size: frames::HEADER_TABLE_SIZE,
        max_send_buffer: h2.max_send_buffer_bytes,
        max_local_error_resets: MAX_LOCAL_ERROR_RESETS,
        header_timeout: ctx.limits.header_read_timeout,
        connect_protocol: ctx.service.webtransport_h2(),
    };
    // A proxy site's streams relay upstream bodies: the proxy budget bounds them, and
    // the connection's total (`proxy_h2_tls_connection_send_buffer_bytes`) caps how
    // many may run at once.
    if ctx.service.is_proxy(ctx.client.tls_site) {
        let per_stream = ctx.proxy_h2.tls_max_send_buffer_bytes;
        let streams = (ctx.proxy_h2.tls_connection_send_buffer_bytes / per_stream.max(1)).max(1);
        limits.max_send_buffer = per_stream;
        limits.max_concurrent_streams = u32::try_from(streams)
            .unwrap_or(u32::MAX)
            .min(h2.max_concurrent_streams);
    }
    limits
}

impl GuardLimits {
    /// Gives hyper's builder every setting the guard judges by.
    pub(crate) fn configure<E>(&self, builder: &mut hyper::server::conn::http2::Builder<E>) {
        builder
            .initial_stream_window_size(self.stream_window)
            .max_frame_size(self.max_frame_size)
            .max_concurrent_streams(self.max_concurrent_streams)
            .max_send_buf_size(self.max_send_buffer)
            .max_header_list_size(u32::try_from(self.max_header_bytes).unwrap_or(u32::MAX))
            .header_table_size(self.header_table_size)
            .max_local_error_reset_streams(self.max_local_error_resets);
        if self.connect_protocol {
            builder.enable_connect_protocol();
        }
    }

    /// The SETTINGS frame h2 sends first for these limits (the values
    /// [`GuardLimits::configure`] gives hyper, in h2's order): what a connection at
    /// rest ([`handshake`]) sends in h2's place.
    pub(crate) fn settings_frame(&self) -> Vec<u8> {
        use frames::{
            put_frame, HEADER_LEN, SETTINGS, SETTINGS_ENABLE_CONNECT_PROTOCOL, SETTINGS_HEADER_TABLE_SIZE,
            SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_CONCURRENT_STREAMS, SETTINGS_MAX_FRAME_SIZE,
            SETTINGS_MAX_HEADER_LIST_SIZE,
        };
        let mut values = vec![
            (SETTINGS_HEADER_TABLE_SIZE, self.header_table_size),
            (SETTINGS_MAX_CONCURRENT_STREAMS, self.max_concurrent_streams),
            (SETTINGS_INITIAL_WINDOW_SIZE, self.stream_window),
            (SETTINGS_MAX_FRAME_SIZE, self.max_frame_size),
            (
                SETTINGS_MAX_HEADER_LIST_SIZE,
                u32::try_from(self.max_header_bytes).unwrap_or(u32::MAX),
            ),
        ];
        if self.connect_protocol {
            values.push((SETTINGS_ENABLE_CONNECT_PROTOCOL, 1));
        }
        let payload: Vec<u8> = values
            .iter()
            .flat_map(|(id, value)| id.to_be_bytes().into_iter().chain(value.to_be_bytes()))
            .collect();
        let mut frame = Vec::with_capacity(HEADER_LEN + payload.len());
        put_frame(&mut frame, SETTINGS, 0, 0, &payload);
        frame
    }
}

/// Since when a connection's guard has had a header block or frame open, shared
/// with the connection driver.
#[derive(Debug)]
pub(crate) struct HeadClock {
    base: tokio::time::Instant,
    /// Milliseconds from `base` to the open head's first byte, plus one; 0: none.
    since: AtomicU64,
}

impl HeadClock {
    fn new() -> Self {
        Self {
            base: tokio::time::Instant::now(),
            since: AtomicU64::new(0),
        }
    }

    fn set(&self, since: Option<tokio::time::Instant>) {
        let ms = since.map_or(0, |t| {
            u64::try_from(t.saturating_duration_since(self.base).as_millis())
                .unwrap_or(u64::MAX - 1)
                .saturating_add(1)
        });
        self.since.store(ms, Ordering::Release);
    }

    /// Whether a head has been open for `limit` or longer at `now`.
    pub(crate) fn open_for(&self, limit: Duration, now: tokio::time::Instant) -> bool {
        match self.since.load(Ordering::Acquire) {
            0 => false,
            ms => now.saturating_duration_since(self.base) >= Duration::from_millis(ms - 1) + limit,
        }
    }
}

/// The I/O guard: wraps the connection hyper's h2 server reads and writes.
pub(crate) struct H2Guard<S> {
    inner: S,
    limits: GuardLimits,
    /// Input not yet judged: at most one frame header plus one non-DATA payload.
    raw: Vec<u8>,
    /// Judged input hyper has not read yet.
    ready: Vec<u8>,
    ready_at: usize,
    /// Preface bytes still to come; a wrong preface turns the guard off (h2 refuses
    /// it itself).
    preface_left: usize,
    /// The guard could not follow the stream: everything passes unjudged.
    off: bool,
    /// DATA payload bytes still to pass through unbuffered.
    data_left: usize,
    /// A stream h2 is told the client cancelled once the DATA passing ends.
    cancel_after_data: Option<u32>,
    block: Option<Block>,
    /// When the first byte of the header block or frame not complete yet arrived.
    open_since: Option<tokio::time::Instant>,
    /// Fires at `open_since` plus the header timeout (made on first need).
    head_timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// `open_since`, for the connection driver.
    head_clock: Arc<HeadClock>,
    decoder: loona_hpack::Decoder<'static>,
    streams: HashMap<u32, Stream>,
    recent_resets: VecDeque<u32>,
    highest: u32,
    /// The client's SETTINGS_INITIAL_WINDOW_SIZE does not matter here; ours does,
    /// once the client acknowledged it (until then the default).
    our_settings_acked: bool,
    connection_window: i64,
    resets: (Instant, u32),
    /// Stream errors the guard answered itself on this connection.
    local_errors: usize,
    output: Output,
    /// Output frames one write finished (reused).
    finished: Vec<(frames::OutFrame, [u8; 4], usize)>,
    /// Frames to write to the client at the next output boundary. While more than
    /// `MAX_INJECT` bytes wait, the client is not read (it is not reading either):
    /// at most that plus one read's worth of the guard's answers.
    inject: Vec<u8>,
    inject_at: usize,
    needs_flush: bool,
    /// A connection error: GOAWAY is queued; once written, reads end and writes
    /// are dropped.
    fatal: bool,
    read_waker: Option<Waker>,
}

impl<S> std::fmt::Debug for H2Guard<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("H2Guard")
            .field("streams", &self.streams.len())
            .field("highest", &self.highest)
            .field("fatal", &self.fatal)
            .finish_non_exhaustive()
    }
}

impl<S> H2Guard<S> {
    pub(crate) fn new(inner: S, limits: GuardLimits) -> Self {
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(limits.header_table_size as usize);
        Self {
            inner,
            limits,
            raw: Vec::new(),
            ready: Vec::new(),
            ready_at: 0,
            preface_left: PREFACE.len(),
            off: false,
            data_left: 0,
            cancel_after_data: None,
            block: None,
            open_since: None,
            head_timer: None,
            head_clock: Arc::new(HeadClock::new()),
            decoder,
            streams: HashMap::new(),
            recent_resets: VecDeque::new(),
            highest: 0,
            our_settings_acked: false,
            connection_window: DEFAULT_WINDOW,
            resets: (Instant::now(), 0),
            local_errors: 0,
            output: Output::default(),
            finished: Vec::new(),
            inject: Vec::new(),
            inject_at: 0,
            needs_flush: false,
            fatal: false,
            read_waker: None,
        }
    }
}

impl<S> H2Guard<S> {
    /// The clock of the open head, for the connection driver.
    pub(crate) fn head_clock(&self) -> Arc<HeadClock> {
        self.head_clock.clone()
    }

    /// A head opened (its first byte came now) or none is open any more.
    pub(super) fn set_open(&mut self, since: Option<tokio::time::Instant>) {
        if self.open_since != since {
            self.open_since = since;
            self.head_clock.set(since);
        }
    }

    /// Whether a header block or frame has been open for the header timeout.
    fn head_expired(&self) -> bool {
        !self.fatal
            && self
                .open_since
                .is_some_and(|since| since.elapsed() >= self.limits.header_timeout)
    }

    /// Ends the connection for a head not complete within the header timeout.
    fn head_timeout(&mut self) {
        tracing::debug!(
            timeout = ?self.limits.header_timeout,
            "h2 guard: header block or frame not complete within the header timeout"
        );
        self.connection_error(frames::PROTOCOL_ERROR);
    }

    /// Ready once the open head's time is up; otherwise its timer wakes `cx` then
    /// (never, with no head open).
    fn poll_head_timer(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Some(since) = self.open_since.filter(|_| !self.fatal) else {
            return Poll::Pending;
        };
        let deadline = since + self.limits.header_timeout;
        let timer = self
            .head_timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if timer.deadline() != deadline {
            timer.as_mut().reset(deadline);
        }
        timer.as_mut().poll(cx)
    }
}

impl<S: AsyncWrite + Unpin> H2Guard<S> {
    /// Writes queued frames if the output is at a frame boundary; Ready once none
    /// are left.
    fn poll_inject(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.inject_at < self.inject.len() {
            if !self.output.at_boundary() {
                return Poll::Pending;
            }
            let n =
                std::task::ready!(Pin::new(&mut self.inner).poll_write(cx, &self.inject[self.inject_at..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.inject_at += n;
            self.needs_flush = true;
        }
        self.inject.clear();
        self.inject_at = 0;
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for H2Guard<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            match this.poll_inject(cx) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                // Mid-frame output: the write that finishes the frame wakes us.
                Poll::Pending if !this.output.at_boundary() => {
                    this.read_waker = Some(cx.waker().clone());
                    if this.fatal {
                        return Poll::Pending;
                    }
                }
                Poll::Pending => return Poll::Pending,
            }
            if this.needs_flush {
                match Pin::new(&mut this.inner).poll_flush(cx) {
                    Poll::Ready(Ok(())) => this.needs_flush = false,
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    // Flushing is also what a deferred batch asks for: go on
                    // reading, the next poll flushes again.
                    Poll::Pending if this.fatal => return Poll::Pending,
                    Poll::Pending => {}
                }
            }
            if this.fatal {
                // GOAWAY is out: hyper reads the end of the connection.
                return Poll::Ready(Ok(()));
            }
            if this.ready_at < this.ready.len() {
                let n = buf.remaining().min(this.ready.len() - this.ready_at);
                buf.put_slice(&this.ready[this.ready_at..this.ready_at + n]);
                this.ready_at += n;
                if this.ready_at == this.ready.len() {
                    this.ready.clear();
                    this.ready_at = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.head_expired() {
                this.head_timeout();
                continue;
            }
            if this.inject.len() - this.inject_at > MAX_INJECT {
                // The client takes none of our answers: read no more of its frames
                // until they are out (the write at the next boundary wakes us).
                this.read_waker = Some(cx.waker().clone());
                return Poll::Pending;
            }
            // Read as much as hyper asked for, so h2 sees the reads it would
            // without the guard, into hyper's own buffer: the bytes are copied out to
            // be judged and only the judged ones are handed back (below, next turn).
            // A buffer of the guard's own was 8 KiB kept by every idle connection.
            let want = buf.remaining().min(MAX_READ);
            if want == 0 {
                return Poll::Ready(Ok(()));
            }
            let mut read = ReadBuf::new(buf.initialize_unfilled_to(want));
            if Pin::new(&mut this.inner).poll_read(cx, &mut read)?.is_pending() {
                // Nothing more comes: the open head's timer wakes this read.
                if this.poll_head_timer(cx).is_ready() {
                    this.head_timeout();
                    continue;
                }
                return Poll::Pending;
            }
            if read.filled().is_empty() {
                return Poll::Ready(Ok(()));
            }
            this.raw.extend_from_slice(read.filled());
            this.ingest();
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for H2Guard<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if this.head_expired() {
            this.head_timeout();
        }
        if this.fatal && this.output.at_boundary() {
            // After GOAWAY nothing more goes out; hyper is told it went.
            if this.poll_inject(cx)?.is_pending() {
                return Poll::Pending;
            }
            return Poll::Ready(Ok(buf.len()));
        }
        if this.output.at_boundary() && this.poll_inject(cx)?.is_pending() {
            return Poll::Pending;
        }
        // Never past the end of the current frame when something waits to go in
        // between, so the next call finds the boundary.
        let limit = if this.inject.is_empty() || this.output.at_boundary() {
            buf.len()
        } else {
            frame_end(&this.output, buf)
        };
        let n = std::task::ready!(Pin::new(&mut this.inner).poll_write(cx, &buf[..limit]))?;
        // The frames this write finished, in a list kept for the connection (no
        // allocation per write once it has grown to a write's frame count).
        let mut finished = std::mem::take(&mut this.finished);
        this.output.track(&buf[..n], |f, payload| {
            let mut small = [0u8; 4];
            let len = payload.len().min(4);
            small[..len].copy_from_slice(&payload[..len]);
            finished.push((f, small, len));
        });
        for (f, small, len) in finished.drain(..) {
            this.on_output(f, &small[..len]);
        }
        this.finished = finished;
        if this.output.at_boundary() {
            if let Some(waker) = this.read_waker.take() {
                waker.wake();
            }
        }
        Poll::Ready(Ok(n))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.output.at_boundary() {
            std::task::ready!(this.poll_inject(cx))?;
        }
        this.needs_flush = false;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.output.at_boundary() {
            std::task::ready!(this.poll_inject(cx))?;
        }
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::frames::{frame_bytes, DATA, PRIORITY};
    use super::*;

    /// A connection whose client sends `input` as fast as it is read and takes only
    /// `room` bytes of output.
    struct Stuck {
        input: Vec<u8>,
        read_at: usize,
        room: usize,
    }

    impl AsyncRead for Stuck {
        fn poll_read(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            let n = buf.remaining().min(self.input.len() - self.read_at);
            let at = self.read_at;
            buf.put_slice(&self.input[at..at + n]);
            self.read_at += n;
            Poll::Ready(Ok(()))
        }
    }

    impl AsyncWrite for Stuck {
        fn poll_write(mut self: Pin<&mut Self>, _: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
            if self.room == 0 {
                return Poll::Pending;
            }
            let n = buf.len().min(self.room);
            self.room -= n;
            Poll::Ready(Ok(n))
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    /// While hyper's output is stuck inside a frame, the guard's own answers to a
    /// stream of bad frames stop the reading once `MAX_INJECT` bytes of them wait.
    #[test]
    fn answers_the_client_does_not_take_stop_the_reading() {
        let mut input = PREFACE.to_vec();
        let bad_priority = frame_bytes(PRIORITY, 0, 3, &[0, 0, 0, 0]);
        for _ in 0..50_000 {
            input.extend_from_slice(&bad_priority);
        }
        let total = input.len();
        let stuck = Stuck {
            input,
            read_at: 0,
            room: 20,
        };
        let mut guard = H2Guard::new(
            stuck,
            GuardLimits {
                max_frame_size: 16_384,
                stream_window: 65_535,
                max_header_bytes: 16_384,
                max_concurrent_streams: 100,
                header_table_size: frames::HEADER_TABLE_SIZE,
                max_send_buffer: 1 << 20,
                max_local_error_resets: usize::MAX,
                header_timeout: Duration::from_secs(60),
                connect_protocol: false,
            },
        );
        let mut cx = Context::from_waker(Waker::noop());
        // hyper's output: a DATA frame the client takes only 20 bytes of.
        let data = frame_bytes(DATA, 0, 1, &[0; 100]);
        let written = Pin::new(&mut guard).poll_write(&mut cx, &data);
        assert!(matches!(written, Poll::Ready(Ok(20))));
        let mut buf = vec![0u8; 64 * 1024];
        let mut pending = false;
        for _ in 0..1_000 {
            let mut read = ReadBuf::new(&mut buf);
            if Pin::new(&mut guard).poll_read(&mut cx, &mut read).is_pending() {
                pending = true;
                break;
            }
        }
        assert!(pending, "the guard read on");
        assert!(guard.inner.read_at < total, "the guard read all {total} bytes");
        assert!(
            guard.inject.len() <= MAX_INJECT + MAX_READ,
            "{} bytes wait",
            guard.inject.len()
        );
    }
}
