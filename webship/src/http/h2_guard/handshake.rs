//! The HTTP/2 handshake answered before h2 exists, for a connection at rest until
//! its first request (`http::rest` holds it there): what h2's connection would cost
//! (its 28 KiB of codec buffers, its HPACK state, the guard's, the write batch) is
//! built only when the client sends something only h2 can answer.
//!
//! At rest the daemon sends the SETTINGS frame h2 sends first
//! ([`GuardLimits::settings_frame`](super::GuardLimits::settings_frame)) and, once
//! the client's preface is complete and valid, acknowledges its SETTINGS.
//! [`classify`] says whether the input so far may rest: only the preface, its
//! SETTINGS, one acknowledgement of ours, connection WINDOW_UPDATEs and extension
//! frames, all complete, valid and within `MAX_INPUT`. Anything else (a request, a
//! PING, a partial or invalid frame, a second SETTINGS) opens the connection: hyper's
//! connection is built over [`Replay`], which gives the guard and h2 the input from
//! its first byte, under [`Answered`], which takes out of h2's output what was sent
//! at rest: its SETTINGS (byte for byte ours, or the connection fails) and, if the
//! client's was acknowledged at rest, h2's acknowledgement of the same frame. So
//! the guard and h2 judge every frame as on a connection that never rested; a frame
//! that may rest is one both accept, and an answer to one that may not comes as
//! soon as it arrives.
//!
//! Choices: a partial magic opens the connection (the driver then times the
//! preface, as before), and so does PRIORITY, which h2 ignores but the guard judges
//! (a client that sends PRIORITY frames after its SETTINGS, as older Firefox did,
//! does not rest). h2's WINDOW_UPDATE raising the connection's receive window
//! (`h2_initial_connection_window_bytes`) goes out when the connection opens, so a
//! first request's upload beyond the default 64 KiB waits one round trip for it.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::frames::{
    parse_header, put_frame, settings_error, window_increment, ACK, CONTINUATION, DEFAULT_WINDOW, GOAWAY,
    HEADER_LEN, MAX_WINDOW, NO_ERROR, PREFACE, SETTINGS, WINDOW_UPDATE,
};

/// The most input a connection keeps at rest: a client's preface, SETTINGS and
/// WINDOW_UPDATE are about 100 bytes.
pub(crate) const MAX_INPUT: usize = 512;

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
    /// `input`: everything the client sent at rest; `acked`: whether its first
    /// SETTINGS was acknowledged then; `settings`: the SETTINGS frame sent then.
    pub(crate) fn new(input: Vec<u8>, acked: bool, settings: Vec<u8>) -> Self {
        Self {
            input,
            acked,
            settings,
        }
    }

    /// The bottom of hyper's I/O, to go under the guard (which must judge the
    /// input): `inner` with the input read at rest first; and what goes on top of
    /// it all, right under hyper ([`Answer::over`]), so that only h2's own frames
    /// are taken out of its output.
    pub(crate) fn split<S>(self, inner: S) -> (Replay<S>, Answer) {
        let replay = Replay {
            inner,
            input: self.input,
            at: 0,
        };
        let answer = Answer {
            settings: self.settings,
            acked: self.acked,
        };
        (replay, answer)
    }
}

/// What a connection answered at rest, for [`Answered`].
#[derive(Debug)]
pub(crate) struct Answer {
    settings: Vec<u8>,
    acked: bool,
}

impl Answer {
    /// `inner` (the connection as hyper's h2 writes to it) without what was sent at
    /// rest.
    pub(crate) fn over<T>(self, inner: T) -> Answered<T> {
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
pub(crate) enum Rest {
    /// Nothing h2 must answer. `settings_in`: the client's preface is complete (its
    /// magic and its first SETTINGS, valid), which the rest acknowledges.
    Waiting { settings_in: bool },
    /// Open hyper's connection.
    Open,
}

/// What the whole input at rest calls for (it is at most `MAX_INPUT` bytes).
pub(crate) fn classify(input: &[u8]) -> Rest {
    if input.is_empty() {
        return Rest::Waiting { settings_in: false };
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
                let increment = window_increment(payload).unwrap_or(0);
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
    Rest::Waiting {
        settings_in: settings,
    }
}

/// The acknowledgement of the client's SETTINGS, sent at rest.
pub(crate) fn settings_ack() -> Vec<u8> {
    let mut ack = Vec::with_capacity(HEADER_LEN);
    put_frame(&mut ack, SETTINGS, ACK, 0, &[]);
    ack
}

/// GOAWAY naming no stream (NO_ERROR): how a connection at rest is closed, since it
/// processed nothing (a request crossing it is safe to retry).
pub(crate) fn goaway_before_any_stream() -> Vec<u8> {
    let mut goaway = Vec::with_capacity(HEADER_LEN + 8);
    let payload = [0u32.to_be_bytes(), NO_ERROR.to_be_bytes()].concat();
    put_frame(&mut goaway, GOAWAY, 0, 0, &payload);
    goaway
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
                // The daemon's fault, not the client's: counted as an error.
                return Poll::Ready(Err(io::Error::other(
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
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

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

    /// hyper's HTTP/2 server as a connection uses it, over one end of a pipe.
    fn h2_server(limits: &GuardLimits) -> (tokio::io::DuplexStream, tokio::task::JoinHandle<()>) {
        let (server, client) = tokio::io::duplex(1 << 16);
        let builder = crate::http::hyper::h2_builder(limits, 8 << 20, Duration::from_secs(60));
        let service = hyper::service::service_fn(|_req| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(
                http_body_util::Empty::<bytes::Bytes>::new(),
            ))
        });
        let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(server), service);
        (client, tokio::spawn(async move { drop(conn.await) }))
    }

    /// The next frame from `conn` (2 s at most): kind, flags, payload.
    async fn next_frame(conn: &mut tokio::io::DuplexStream) -> Option<(u8, u8, Vec<u8>)> {
        let mut header = [0; HEADER_LEN];
        let read = tokio::time::timeout(Duration::from_secs(2), conn.read_exact(&mut header)).await;
        read.ok()?.ok()?;
        let f = parse_header(&header);
        let mut payload = vec![0; f.len];
        conn.read_exact(&mut payload).await.ok()?;
        Some((f.kind, f.flags, payload))
    }

    /// What a connection at rest sends must be what h2 sends first, byte for byte,
    /// with the builder every connection uses.
    #[tokio::test]
    async fn the_settings_sent_at_rest_are_the_ones_h2_sends_first() {
        for limits in [limits(128, false), limits(3, true)] {
            let (mut client, conn) = h2_server(&limits);
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

    /// A client SETTINGS may rest (and be acknowledged at rest) exactly when h2
    /// acknowledges it; one h2 refuses opens the connection, so h2 answers it
    /// (GOAWAY) as on a connection that never rested.
    #[tokio::test]
    async fn a_client_settings_rests_exactly_when_h2_accepts_it() {
        let ids = [0u16, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0x10, 0xffff];
        let values = [
            0u32,
            1,
            2,
            16_383,
            16_384,
            16_777_215,
            16_777_216,
            0x7fff_ffff,
            0x8000_0000,
            u32::MAX,
        ];
        for id in ids {
            for value in values {
                let payload = [id.to_be_bytes().as_slice(), &value.to_be_bytes()].concat();
                let mut input = PREFACE.to_vec();
                input.extend(frame_bytes(SETTINGS, 0, 0, &payload));
                let (mut client, conn) = h2_server(&limits(100, false));
                client.write_all(&input).await.unwrap();
                let mut acked = false;
                while let Some((kind, flags, _)) = next_frame(&mut client).await {
                    match kind {
                        SETTINGS if flags & ACK != 0 => {
                            acked = true;
                            break;
                        }
                        GOAWAY => break,
                        _ => {}
                    }
                }
                conn.abort();
                let rests = classify(&input) == Rest::Waiting { settings_in: true };
                assert_eq!(
                    rests, acked,
                    "setting {id:#x} = {value}: rests {rests}, h2 acknowledged {acked}"
                );
            }
        }
    }

    /// Everything `classify` lets rest, h2 takes without a word: after each of these
    /// inputs it answers a PING, and sends no GOAWAY first.
    #[tokio::test]
    async fn what_rests_h2_accepts() {
        for extra in resting() {
            let input = preface(&extra);
            assert_eq!(classify(&input), Rest::Waiting { settings_in: true }, "{extra:?}");
            let (mut client, conn) = h2_server(&limits(100, false));
            client.write_all(&input).await.unwrap();
            client
                .write_all(&frame_bytes(PING, 0, 0, b"restping"))
                .await
                .unwrap();
            let mut answered = false;
            while let Some((kind, flags, payload)) = next_frame(&mut client).await {
                assert_ne!(kind, GOAWAY, "h2 refused {extra:?}: {payload:?}");
                if kind == PING && flags & ACK != 0 {
                    answered = true;
                    break;
                }
            }
            conn.abort();
            assert!(answered, "no PING answer after {extra:?}");
        }
    }

    /// Inputs after the preface's SETTINGS that rest.
    fn resting() -> Vec<Vec<Vec<u8>>> {
        let ack = frame_bytes(SETTINGS, ACK, 0, &[]);
        vec![
            vec![],
            vec![ack.clone()],
            vec![window_update(0, 15 << 20), ack.clone()],
            vec![window_update(0, 0x7fff_ffff - 65_535)],
            vec![
                frame_bytes(0xfa, 0, 0, b"grease"),
                frame_bytes(0xfb, 0xff, 7, &[]),
            ],
        ]
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
        let waiting = Rest::Waiting { settings_in: true };
        assert_eq!(classify(&[]), Rest::Waiting { settings_in: false });
        assert_eq!(classify(PREFACE), Rest::Waiting { settings_in: false });
        assert_eq!(classify(&preface(&[])), waiting);
        let ack = frame_bytes(SETTINGS, ACK, 0, &[]);
        for extra in resting() {
            assert_eq!(classify(&preface(&extra)), waiting, "{extra:?}");
        }
        let opening = [
            // A request, and what h2 must answer or refuse.
            vec![frame_bytes(HEADERS, 0x5, 1, b"\x82")],
            vec![frame_bytes(PING, 0, 0, &[0; 8])],
            vec![frame_bytes(PRIORITY, 0, 3, &[0, 0, 0, 1, 16])],
            vec![frame_bytes(GOAWAY, 0, 0, &[0; 8])],
            // A second SETTINGS, a second ACK, an ACK with a payload, SETTINGS on a
            // stream: h2 answers (or refuses) them.
            vec![frame_bytes(SETTINGS, 0, 0, &[])],
            vec![ack.clone(), ack.clone()],
            vec![frame_bytes(SETTINGS, ACK, 0, &[0; 6])],
            vec![frame_bytes(SETTINGS, 0, 1, &[])],
            // Invalid WINDOW_UPDATEs: zero, on a stream, past 2^31-1, too long.
            vec![window_update(0, 0)],
            vec![window_update(1, 10)],
            vec![window_update(0, 0x7fff_0000), window_update(0, 0x7fff_0000)],
            vec![frame_bytes(WINDOW_UPDATE, 0, 0, &[0, 0, 0, 1, 0])],
            // A frame not complete yet: the guard times it.
            vec![window_update(0, 10)[..5].to_vec()],
        ];
        for extra in opening {
            assert_eq!(classify(&preface(&extra)), Rest::Open, "{extra:?}");
        }
        // A wrong or partial preface; anything, even an extension frame, before the
        // client's SETTINGS; invalid SETTINGS.
        assert_eq!(classify(b"GET / HTTP/1.1\r\n\r\nxxxxxxxxx"), Rest::Open);
        assert_eq!(classify(&PREFACE[..10]), Rest::Open);
        for first in [window_update(0, 10), frame_bytes(0xfa, 0, 0, b"x")] {
            let mut input = PREFACE.to_vec();
            input.extend(first);
            assert_eq!(classify(&input), Rest::Open);
        }
        for bad in [
            &[0, 2, 0, 0, 0, 2][..],
            &[0, 4, 0x80, 0, 0, 0],
            &[0, 5, 0, 0, 0, 1],
            &[0, 8, 0, 0, 0, 2],
            &[0, 1, 0],
        ] {
            let mut input = PREFACE.to_vec();
            input.extend(frame_bytes(SETTINGS, 0, 0, bad));
            assert_eq!(classify(&input), Rest::Open, "{bad:?}");
        }
        // At most `MAX_INPUT` bytes rest: one short of it does, all of it opens.
        let base = preface(&[]);
        let pad = MAX_INPUT - 1 - base.len() - HEADER_LEN;
        let mut just = base.clone();
        just.extend(frame_bytes(0xfa, 0, 0, &vec![0; pad]));
        assert_eq!(just.len(), MAX_INPUT - 1);
        assert_eq!(classify(&just), waiting);
        let mut full = base;
        full.extend(frame_bytes(0xfa, 0, 0, &vec![0; pad + 1]));
        assert_eq!(classify(&full), Rest::Open);
    }

    /// A writer that takes at most `room` bytes per write, and waits (Pending) on
    /// every other call when `waits`.
    struct Sink {
        out: Vec<u8>,
        room: usize,
        waits: bool,
        calls: usize,
    }

    impl Sink {
        fn new(room: usize, waits: bool) -> Sink {
            Sink {
                out: Vec::new(),
                room,
                waits,
                calls: 0,
            }
        }
    }

    impl AsyncWrite for Sink {
        fn poll_write(mut self: Pin<&mut Self>, _: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
            self.calls += 1;
            if self.waits && self.calls % 2 == 1 {
                return Poll::Pending;
            }
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

    /// Writes `output` through an `Answered` in pieces of `piece` bytes over `sink`,
    /// retrying what waits; what reached the sink.
    fn answer(settings: &[u8], acked: bool, output: &[u8], piece: usize, sink: Sink) -> io::Result<Vec<u8>> {
        let (_, answer) = Opening::new(Vec::new(), acked, settings.to_vec()).split(());
        let mut answered = answer.over(sink);
        let mut cx = Context::from_waker(Waker::noop());
        let mut at = 0;
        let mut tries = 0;
        while at < output.len() {
            tries += 1;
            assert!(tries < 100_000, "no progress");
            let end = output.len().min(at + piece);
            match Pin::new(&mut answered).poll_write(&mut cx, &output[at..end]) {
                Poll::Ready(Ok(n)) => {
                    assert!(n > 0, "Ready(0) for {} bytes", end - at);
                    at += n;
                }
                Poll::Ready(Err(e)) => return Err(e),
                Poll::Pending => {}
            }
        }
        while Pin::new(&mut answered).poll_flush(&mut cx).is_pending() {
            tries += 1;
            assert!(tries < 100_000, "no progress");
        }
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
                for waits in [false, true] {
                    let unacked = answer(&settings, false, &h2, piece, Sink::new(room, waits)).unwrap();
                    assert_eq!(unacked, h2[settings.len()..], "piece {piece} room {room}");
                    let acked = answer(&settings, true, &h2, piece, Sink::new(room, waits)).unwrap();
                    let want = [update.clone(), headers.clone(), ack.clone()].concat();
                    assert_eq!(acked, want, "piece {piece} room {room} waits {waits}");
                }
            }
        }
        // SETTINGS other than those sent at rest fail the connection.
        let other = limits(7, false).settings_frame();
        let mismatch = answer(
            &settings,
            false,
            &[other, headers].concat(),
            1000,
            Sink::new(1000, false),
        );
        assert_eq!(mismatch.unwrap_err().kind(), io::ErrorKind::Other);
    }

    #[tokio::test]
    async fn the_input_at_rest_is_read_first() {
        let (mut client, server) = tokio::io::duplex(64);
        let (mut replay, _) = Opening::new(b"rested".to_vec(), false, Vec::new()).split(server);
        client.write_all(b" then live").await.unwrap();
        drop(client);
        let mut read = Vec::new();
        let mut small = [0; 4];
        loop {
            match replay.read(&mut small).await.unwrap() {
                0 => break,
                n => read.extend_from_slice(&small[..n]),
            }
        }
        assert_eq!(read, b"rested then live");
    }
}
