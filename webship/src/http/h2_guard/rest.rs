//! An HTTP/2 connection at rest until its first request: the handshake is answered
//! as h2 would answer it, and hyper's connection (h2's 28 KiB of codec buffers, its
//! HPACK state, the guard's, the write batch) is built only when the client sends
//! something only h2 can answer.
//!
//! [`wait`] sends the SETTINGS frame h2 would send first
//! ([`GuardLimits::settings_frame`]), and reads the client's preface. While the input
//! is only the preface, its SETTINGS (valid: acknowledged here, as h2 would), the
//! acknowledgement of ours, connection WINDOW_UPDATEs and extension frames, all
//! complete and within `MAX_INPUT`, the connection stays at rest, holding that input
//! and the TLS stream. Anything else (a request, a PING, a partial or wrong frame, an
//! invalid value, a second SETTINGS) opens it: hyper's connection is built over
//! [`Replay`], which gives h2 (through the guard) the input from its first byte, and
//! [`Answered`], which drops from h2's output what was already sent: its SETTINGS
//! (byte for byte ours, or the connection fails) and, if ours acknowledged the
//! client's, h2's acknowledgement of the same frame. Errors are thus judged by the
//! guard and h2 exactly as on a connection that never rested, only later when the
//! client sent them while at rest.
//!
//! Time at rest is the connection driver's: the preface is due `handshake_timeout`
//! after the handshake, and with no request for `idle_timeout`, or within
//! `FIRST_REQUEST_GRACE` of the drain, the connection is closed with GOAWAY (last
//! stream 0: nothing was processed, so a request crossing it is safe to retry).

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};

use super::frames::{
    parse_header, put_frame, settings_error, ACK, CONTINUATION, DEFAULT_WINDOW, GOAWAY, HEADER_LEN,
    MAX_WINDOW, NO_ERROR, PREFACE, SETTINGS, WINDOW_UPDATE,
};
use crate::exchange::ConnContext;
use crate::ktls::RustlsStream;

/// The most input a connection keeps at rest: a client's preface, SETTINGS and
/// WINDOW_UPDATE are about 100 bytes.
const MAX_INPUT: usize = 512;
/// How long closing a connection at rest may take (GOAWAY and close_notify written).
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// How a connection's rest ended.
#[derive(Debug)]
pub(crate) enum Waited {
    /// The client sent what h2 must answer: build hyper's connection over this.
    Open(Opening),
    /// Closed in order: the client closed, or idle or the drain closed it.
    Closed,
    /// No preface within `handshake_timeout`.
    NoPreface,
    /// The client took no bytes of ours within `send_timeout`.
    Stalled,
    Io(io::Error),
}

/// What a connection's rest leaves for hyper's connection.
#[derive(Debug)]
pub(crate) struct Opening {
    /// Everything the client sent so far, the preface first.
    input: Vec<u8>,
    /// Whether the client's first SETTINGS was acknowledged at rest.
    acked: bool,
    /// The SETTINGS frame sent at rest.
    settings: Vec<u8>,
}

impl Opening {
    /// The bottom of hyper's connection, under the guard (which must judge the
    /// input): `inner`, with the input read at rest first.
    pub(crate) fn replay<S>(&mut self, inner: S) -> Replay<S> {
        Replay {
            inner,
            input: std::mem::take(&mut self.input),
            at: 0,
        }
    }

    /// The top, right under hyper, so that only h2's frames are dropped: `inner`
    /// with what was sent at rest taken out of h2's output.
    pub(crate) fn answered<S>(self, inner: S) -> Answered<S> {
        Answered {
            inner,
            settings: self.settings,
            settings_at: 0,
            ack: self.acked,
            header: [0; HEADER_LEN],
            header_len: 0,
            held: None,
            remaining: 0,
        }
    }
}

/// What the input at rest calls for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rest {
    /// Nothing h2 must answer; `settings`: the client's first SETTINGS is in, and
    /// valid (the one frame answered at rest).
    Idle { settings: bool },
    /// Open hyper's connection.
    Open,
}

/// Judges the whole input at rest (it is at most `MAX_INPUT` bytes).
fn judge(input: &[u8]) -> Rest {
    if input.is_empty() {
        return Rest::Idle { settings: false };
    }
    if input.len() >= MAX_INPUT || input.get(..PREFACE.len()) != Some(PREFACE) {
        return Rest::Open;
    }
    let mut at = PREFACE.len();
    let (mut settings, mut acks, mut window) = (false, 0, DEFAULT_WINDOW);
    while at < input.len() {
        let Some(header) = input.get(at..at + HEADER_LEN) else {
            return Rest::Open;
        };
        let mut head = [0; HEADER_LEN];
        head.copy_from_slice(header);
        let f = parse_header(&head);
        let Some(payload) = input.get(at + HEADER_LEN..at + HEADER_LEN + f.len) else {
            return Rest::Open;
        };
        at += HEADER_LEN + f.len;
        let resting = match f.kind {
            SETTINGS if f.stream != 0 => false,
            SETTINGS if f.flags & ACK != 0 => {
                acks += 1;
                settings && f.len == 0 && acks == 1
            }
            SETTINGS => {
                let valid = !settings && f.len.is_multiple_of(6) && settings_error(payload).is_none();
                settings = true;
                valid
            }
            // The client's SETTINGS comes first (its preface).
            _ if !settings => false,
            WINDOW_UPDATE => {
                let increment = payload
                    .try_into()
                    .map_or(0, |b: [u8; 4]| u32::from_be_bytes(b) & 0x7fff_ffff);
                window += i64::from(increment);
                f.stream == 0 && increment > 0 && window <= MAX_WINDOW
            }
            // Extension frames are ignored (RFC 9113 §5.5), by h2 too.
            kind => kind > CONTINUATION,
        };
        if !resting {
            return Rest::Open;
        }
    }
    Rest::Idle { settings }
}

/// Holds a connection at rest until its client sends what h2 must answer, or it
/// ends (see the module notes). `settings`: the frame h2 will send first;
/// `start`: the handshake's end.
pub(crate) async fn wait(
    stream: &mut RustlsStream,
    settings: Vec<u8>,
    ctx: &ConnContext,
    start: tokio::time::Instant,
) -> Waited {
    let limits = ctx.limits;
    if let Err(waited) = send(stream, &settings, limits.send_timeout).await {
        return waited;
    }
    let mut input = Vec::new();
    let mut acked = false;
    let mut shutdown = ctx.shutdown.clone();
    let mut drain_end = None;
    loop {
        let preface = match judge(&input) {
            Rest::Open => {
                return Waited::Open(Opening {
                    input,
                    acked,
                    settings,
                })
            }
            Rest::Idle { settings } => settings,
        };
        if preface && !acked {
            acked = true;
            let mut ack = Vec::with_capacity(HEADER_LEN);
            put_frame(&mut ack, SETTINGS, ACK, 0, &[]);
            if let Err(waited) = send(stream, &ack, limits.send_timeout).await {
                return waited;
            }
        }
        let idle_end = start + limits.idle_timeout;
        let preface_end = (!preface).then_some(start + limits.handshake_timeout);
        let end = [Some(idle_end), preface_end, drain_end]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(idle_end);
        let room = MAX_INPUT - input.len();
        let arrived = tokio::select! {
            // Bytes already there win over a drain that began meanwhile.
            biased;
            arrived = tokio::time::timeout_at(end, read_some(stream, room)) => arrived,
            () = shutdown.requested(), if drain_end.is_none() => {
                // A moment for a first request on its way, as HTTP/1.1 gives one.
                drain_end = Some(tokio::time::Instant::now() + crate::http::FIRST_REQUEST_GRACE);
                continue;
            }
        };
        match arrived {
            Err(_) if preface_end == Some(end) => return Waited::NoPreface,
            Err(_) => {
                close(stream).await;
                return Waited::Closed;
            }
            Ok(Err(e)) => return Waited::Io(e),
            Ok(Ok(bytes)) if bytes.is_empty() => {
                let _ = tokio::time::timeout(CLOSE_GRACE, stream.shutdown()).await;
                return Waited::Closed;
            }
            Ok(Ok(bytes)) => input.extend_from_slice(&bytes),
        }
        input.shrink_to_fit();
    }
}

/// Up to `room` bytes of plaintext, read once there are some (the wait holds no
/// buffer: [`crate::http::tls_readable`]); none at the end of the stream.
async fn read_some(stream: &mut RustlsStream, room: usize) -> io::Result<Vec<u8>> {
    crate::http::tls_readable(stream).await?;
    let mut chunk = vec![0; room];
    let n = stream.read(&mut chunk).await?;
    chunk.truncate(n);
    Ok(chunk)
}

/// Writes `bytes` and flushes them, within `limit`.
async fn send(stream: &mut RustlsStream, bytes: &[u8], limit: Duration) -> Result<(), Waited> {
    let sent = tokio::time::timeout(limit, async {
        stream.write_all(bytes).await?;
        stream.flush().await
    })
    .await;
    match sent {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(Waited::Io(e)),
        Err(_) => Err(Waited::Stalled),
    }
}

/// Closes a connection at rest in order: GOAWAY (last stream 0, NO_ERROR), then
/// close_notify.
async fn close(stream: &mut RustlsStream) {
    let mut goaway = Vec::with_capacity(HEADER_LEN + 8);
    put_frame(&mut goaway, GOAWAY, 0, 0, &[0, 0, 0, 0, 0, 0, 0, NO_ERROR as u8]);
    let _ = tokio::time::timeout(CLOSE_GRACE, async {
        stream.write_all(&goaway).await?;
        stream.shutdown().await
    })
    .await;
}

/// The connection under the guard of a connection that rested: what the client
/// sent at rest is read first.
#[derive(Debug)]
pub(crate) struct Replay<S> {
    inner: S,
    input: Vec<u8>,
    at: usize,
}

impl<S: AsyncRead + Unpin> AsyncRead for Replay<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.at < self.input.len() {
            let n = buf.remaining().min(self.input.len() - self.at);
            buf.put_slice(&self.input[self.at..self.at + n]);
            self.at += n;
            if self.at == self.input.len() {
                self.input = Vec::new();
                self.at = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Replay<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The connection under hyper of a connection that rested: h2's first SETTINGS
/// (which must be the one sent at rest) and, if the client's was acknowledged at
/// rest, h2's first SETTINGS ACK are not written again. Once both are past, writes
/// go through as they are.
#[derive(Debug)]
pub(crate) struct Answered<S> {
    inner: S,
    /// The SETTINGS frame sent at rest; `settings_at` of its bytes have come from
    /// h2 (emptied once all have).
    settings: Vec<u8>,
    settings_at: usize,
    /// h2's first SETTINGS ACK is still to be dropped: its frames are followed.
    ack: bool,
    /// The frame header being followed, `header_len` bytes of it in.
    header: [u8; HEADER_LEN],
    header_len: usize,
    /// A kept frame's header, this many of its bytes written.
    held: Option<usize>,
    /// Payload bytes of the kept frame still to pass.
    remaining: usize,
}

impl<S: AsyncWrite + Unpin> Answered<S> {
    /// Writes the rest of a kept frame's header.
    fn poll_held(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while let Some(written) = self.held {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.header[written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.held = (written + n < HEADER_LEN).then_some(written + n);
        }
        Poll::Ready(Ok(()))
    }

    /// Whether everything passes as it is now.
    fn through(&self) -> bool {
        self.settings.is_empty() && !self.ack
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Answered<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if buf.is_empty() || this.through() {
            return Pin::new(&mut this.inner).poll_write(cx, buf);
        }
        if !this.settings.is_empty() {
            let take = buf.len().min(this.settings.len() - this.settings_at);
            if buf[..take] != this.settings[this.settings_at..this.settings_at + take] {
                tracing::error!("h2: its first SETTINGS differ from those sent while the connection rested");
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "h2's first SETTINGS differ from those sent at rest",
                )));
            }
            this.settings_at += take;
            if this.settings_at == this.settings.len() {
                this.settings = Vec::new();
            }
            return Poll::Ready(Ok(take));
        }
        ready!(this.poll_held(cx))?;
        if this.remaining > 0 {
            let n = ready!(Pin::new(&mut this.inner).poll_write(cx, &buf[..buf.len().min(this.remaining)]))?;
            this.remaining -= n;
            return Poll::Ready(Ok(n));
        }
        let take = buf.len().min(HEADER_LEN - this.header_len);
        this.header[this.header_len..this.header_len + take].copy_from_slice(&buf[..take]);
        this.header_len += take;
        if this.header_len == HEADER_LEN {
            this.header_len = 0;
            let f = parse_header(&this.header);
            if f.kind == SETTINGS && f.flags & ACK != 0 && f.len == 0 {
                this.ack = false;
            } else {
                this.held = Some(0);
                this.remaining = f.len;
            }
        }
        Poll::Ready(Ok(take))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if self.through() {
            return Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        }
        let first = bufs.iter().find(|b| !b.is_empty()).map_or(&[][..], |b| &**b);
        self.poll_write(cx, first)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_held(cx))?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_held(cx))?;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Answered<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

#[cfg(test)]
mod tests {
    use super::super::frames::{frame_bytes, HEADERS, HEADER_TABLE_SIZE, PING, PRIORITY};
    use super::super::GuardLimits;
    use super::*;
    use std::task::Waker;

    fn limits(max_concurrent_streams: u32, connect_protocol: bool) -> GuardLimits {
        GuardLimits {
            max_frame_size: 32_768,
            stream_window: 1 << 20,
            max_header_bytes: 20_000,
            max_concurrent_streams,
            header_table_size: HEADER_TABLE_SIZE,
            max_send_buffer: 1 << 18,
            max_local_error_resets: 1024,
            header_timeout: Duration::from_secs(10),
            connect_protocol,
        }
    }

    /// What a connection at rest sends must be what h2 sends first, byte for byte,
    /// with the options `serve_h2_now` gives hyper.
    #[tokio::test]
    async fn the_settings_sent_at_rest_are_the_ones_h2_sends_first() {
        use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
        for limits in [limits(128, false), limits(3, true)] {
            let (server, mut client) = tokio::io::duplex(4096);
            let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
            limits.configure(&mut builder);
            builder
                .timer(TokioTimer::new())
                .initial_connection_window_size(8 << 20)
                .max_pending_accept_reset_streams(20)
                .keep_alive_interval(Some(Duration::from_secs(30)))
                .keep_alive_timeout(Duration::from_secs(20));
            let service = hyper::service::service_fn(|_req| async {
                Ok::<_, std::convert::Infallible>(http::Response::new(
                    http_body_util::Empty::<bytes::Bytes>::new(),
                ))
            });
            let conn = tokio::spawn(builder.serve_connection(TokioIo::new(server), service));
            let ours = limits.settings_frame();
            let mut theirs = vec![0; ours.len()];
            tokio::time::timeout(Duration::from_secs(5), client.read_exact(&mut theirs))
                .await
                .expect("h2 sends its SETTINGS at once")
                .unwrap();
            assert_eq!(theirs, ours, "limits {limits:?}");
            conn.abort();
        }
    }

    fn preface(extra: &[Vec<u8>]) -> Vec<u8> {
        let mut input = PREFACE.to_vec();
        input.extend(frame_bytes(
            SETTINGS,
            0,
            0,
            &[0, 4, 0, 0x10, 0, 0, 0, 2, 0, 0, 0, 0],
        ));
        for frame in extra {
            input.extend_from_slice(frame);
        }
        input
    }

    fn window_update(stream: u32, increment: u32) -> Vec<u8> {
        frame_bytes(WINDOW_UPDATE, 0, stream, &increment.to_be_bytes())
    }

    #[test]
    fn only_the_handshake_and_what_h2_ignores_rest() {
        let idle = Rest::Idle { settings: true };
        assert_eq!(judge(&[]), Rest::Idle { settings: false });
        assert_eq!(judge(PREFACE), Rest::Idle { settings: false });
        assert_eq!(judge(&preface(&[])), idle);
        let ack = frame_bytes(SETTINGS, ACK, 0, &[]);
        let resting = [
            vec![ack.clone()],
            vec![window_update(0, 15 << 20), ack.clone()],
            vec![frame_bytes(0xfa, 0, 0, b"grease")],
        ];
        for extra in resting {
            assert_eq!(judge(&preface(&extra)), idle, "{extra:?}");
        }
        let opening = [
            // A request, and what h2 must answer or refuse.
            vec![frame_bytes(HEADERS, 0x5, 1, b"\x82")],
            vec![frame_bytes(PING, 0, 0, &[0; 8])],
            vec![frame_bytes(PRIORITY, 0, 3, &[0, 0, 0, 1, 16])],
            vec![frame_bytes(GOAWAY, 0, 0, &[0; 8])],
            // A second SETTINGS, a second ACK: h2 answers (or refuses) them.
            vec![frame_bytes(SETTINGS, 0, 0, &[])],
            vec![ack.clone(), ack.clone()],
            // Invalid WINDOW_UPDATEs: zero, on a stream, past 2^31-1.
            vec![window_update(0, 0)],
            vec![window_update(1, 10)],
            vec![window_update(0, 0x7fff_0000), window_update(0, 0x7fff_0000)],
            // A frame not complete yet: the guard times it.
            vec![window_update(0, 10)[..5].to_vec()],
        ];
        for extra in opening {
            assert_eq!(judge(&preface(&extra)), Rest::Open, "{extra:?}");
        }
        // A wrong or partial preface, a preface without SETTINGS first, invalid SETTINGS.
        assert_eq!(judge(b"GET / HTTP/1.1\r\n\r\nxxxxxxxxx"), Rest::Open);
        assert_eq!(judge(&PREFACE[..10]), Rest::Open);
        let mut no_settings = PREFACE.to_vec();
        no_settings.extend(window_update(0, 10));
        assert_eq!(judge(&no_settings), Rest::Open);
        for bad in [
            &[0, 2, 0, 0, 0, 2][..],
            &[0, 4, 0x80, 0, 0, 0],
            &[0, 5, 0, 0, 0, 1],
            &[0, 1, 0],
        ] {
            let mut input = PREFACE.to_vec();
            input.extend(frame_bytes(SETTINGS, 0, 0, bad));
            assert_eq!(judge(&input), Rest::Open, "{bad:?}");
        }
        // More than a rest keeps.
        let many: Vec<_> = (0..60).map(|_| frame_bytes(0xfa, 0, 0, b"x")).collect();
        assert_eq!(judge(&preface(&many)), Rest::Open);
    }

    /// A writer that takes at most `room` bytes per write.
    struct Sink {
        out: Vec<u8>,
        room: usize,
    }

    impl AsyncWrite for Sink {
        fn poll_write(mut self: Pin<&mut Self>, _: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
            let n = buf.len().min(self.room);
            self.out.extend_from_slice(&buf[..n]);
            Poll::Ready(Ok(n))
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    /// Writes `output` through an `Answered` in pieces of `piece` bytes over a sink
    /// taking `room` bytes a write; what reached the sink.
    fn answer(settings: &[u8], acked: bool, output: &[u8], piece: usize, room: usize) -> io::Result<Vec<u8>> {
        let opening = Opening {
            input: Vec::new(),
            acked,
            settings: settings.to_vec(),
        };
        let mut answered = opening.answered(Sink {
            out: Vec::new(),
            room,
        });
        let mut cx = Context::from_waker(Waker::noop());
        let mut at = 0;
        while at < output.len() {
            let end = output.len().min(at + piece);
            match Pin::new(&mut answered).poll_write(&mut cx, &output[at..end]) {
                Poll::Ready(Ok(n)) => {
                    assert!(n > 0);
                    at += n;
                }
                Poll::Ready(Err(e)) => return Err(e),
                Poll::Pending => unreachable!("the sink never waits"),
            }
        }
        assert!(Pin::new(&mut answered).poll_flush(&mut cx).is_ready());
        Ok(answered.inner.out)
    }

    #[test]
    fn what_was_sent_at_rest_is_taken_out_of_h2s_output() {
        let settings = limits(100, false).settings_frame();
        let ack = frame_bytes(SETTINGS, ACK, 0, &[]);
        let update = window_update(0, 1 << 20);
        let headers = frame_bytes(HEADERS, 0x4, 1, &[0x88; 40]);
        let h2 = [
            settings.clone(),
            update.clone(),
            ack.clone(),
            headers.clone(),
            ack.clone(),
        ]
        .concat();
        for piece in [1, 2, 7, 9, 10, 64, 1000] {
            for room in [1, 3, 9, 1000] {
                let unacked = answer(&settings, false, &h2, piece, room).unwrap();
                assert_eq!(unacked, h2[settings.len()..], "piece {piece} room {room}");
                let acked = answer(&settings, true, &h2, piece, room).unwrap();
                let want = [update.clone(), headers.clone(), ack.clone()].concat();
                assert_eq!(acked, want, "piece {piece} room {room}");
            }
        }
        // SETTINGS other than those sent at rest fail the connection.
        let other = limits(7, false).settings_frame();
        let mismatch = answer(&settings, false, &[other, headers].concat(), 1000, 1000);
        assert_eq!(mismatch.unwrap_err().kind(), io::ErrorKind::InvalidData);
    }

    #[tokio::test]
    async fn the_input_at_rest_is_read_first() {
        let (mut client, server) = tokio::io::duplex(64);
        let mut opening = Opening {
            input: b"rested".to_vec(),
            acked: false,
            settings: Vec::new(),
        };
        let mut replay = opening.replay(server);
        client.write_all(b" then live").await.unwrap();
        drop(client);
        let mut read = Vec::new();
        replay.read_to_end(&mut read).await.unwrap();
        assert_eq!(read, b"rested then live");
    }
}
