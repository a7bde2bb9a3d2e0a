//! h3's QUIC streams over quinn, written for the one thing h3-quinn cannot do: hand
//! the payload of a response's DATA frame to quinn as the `Bytes` it already is
//! (`write_chunks`: quinn keeps the buffer until the bytes are acknowledged) instead
//! of copying it into quinn's send buffer.
//!
//! h3 0.0.8 gives a backend each frame as a `WriteBuf`, which hands its payload out
//! only as a slice. So the request task *offers* the chunk it is about to send (a
//! refcount, no copy) in the stream's [`Offer`] just before `send_data`; the send
//! stream takes the offer when h3 gives it the frame, writes the frame header (a few
//! bytes, copied), and when what is left of the frame is exactly the offered bytes
//! (same address, same length: the same immutable memory) writes the offer instead
//! and advances the frame past it. Anything else (HEADERS, trailers, control and
//! QPACK streams, WebTransport, a frame nobody offered) is copied as before, so a
//! mismatch costs a copy, never correctness. `webship_h3_stream_write_bytes_total`
//! counts both ways.
//!
//! Flow control and memory are quinn's, as with h3-quinn: a write waits while the
//! stream's credit or the connection's send window (`h3_send_window_bytes`, which
//! counts bytes sent and not yet acknowledged) is used up.

use std::future::Future;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes};
use h3::quic::{self, ConnectionErrorIncoming, StreamErrorIncoming, StreamId, WriteBuf};
use quinn::VarInt;

/// Stream bytes handed to quinn as the sender's own buffer.
static ZERO_COPY_BYTES: AtomicU64 = AtomicU64::new(0);
/// Stream bytes copied into quinn's send buffer.
static COPIED_BYTES: AtomicU64 = AtomicU64::new(0);

/// Bytes written to HTTP/3 streams so far: (handed over without a copy, copied).
pub(crate) fn written_bytes() -> (u64, u64) {
    (
        ZERO_COPY_BYTES.load(Ordering::Relaxed),
        COPIED_BYTES.load(Ordering::Relaxed),
    )
}

/// The chunk a request task is about to send on a stream, shared with the stream's
/// [`SendStream`]. Holds at most one chunk, and only between `put` and the moment
/// the stream takes it (the first poll of `send_data`).
#[derive(Debug, Default)]
pub(crate) struct Offer(Mutex<Option<Bytes>>);

impl Offer {
    /// Offers `chunk` for the next frame the stream is given.
    pub(crate) fn put(&self, chunk: Bytes) {
        *self.slot() = Some(chunk);
    }

    /// Withdraws an offer the stream did not take.
    pub(crate) fn clear(&self) {
        self.slot().take();
    }

    fn take(&self) -> Option<Bytes> {
        self.slot().take()
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, Option<Bytes>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A QUIC send stream as h3 sees it.
pub(crate) struct SendStream {
    stream: quinn::SendStream,
    /// The frame being written (h3 hands one at a time).
    writing: Option<WriteBuf<Bytes>>,
    /// The offered chunk taken with that frame: its not-yet-written part.
    payload: Option<Bytes>,
    /// Where the request task offers chunks (request streams only).
    offer: Option<Arc<Offer>>,
}

impl std::fmt::Debug for SendStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendStream")
            .field("id", &self.stream.id())
            .field("writing", &self.writing.as_ref().map(Buf::remaining))
            .finish_non_exhaustive()
    }
}

impl SendStream {
    fn new(stream: quinn::SendStream, offer: Option<Arc<Offer>>) -> Self {
        Self {
            stream,
            writing: None,
            payload: None,
            offer,
        }
    }

    /// Writes the next part of `frame`: `Ready` with the bytes written.
    fn poll_write_frame(
        stream: &mut quinn::SendStream,
        payload: &mut Option<Bytes>,
        frame: &WriteBuf<Bytes>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<usize, quinn::WriteError>> {
        let next = frame.chunk();
        match payload.as_mut() {
            // The same memory: quinn takes the chunk itself, and keeps the unwritten
            // rest of it in `payload` (it splits a partly written chunk).
            Some(offered) if offered.as_ptr() == next.as_ptr() && offered.len() == next.len() => {
                let written = ready!(pin!(stream.write_chunks(std::slice::from_mut(offered))).poll(cx))?;
                ZERO_COPY_BYTES.fetch_add(written.bytes as u64, Ordering::Relaxed);
                Poll::Ready(Ok(written.bytes))
            }
            _ => {
                let written = ready!(Pin::new(stream).poll_write(cx, next))?;
                COPIED_BYTES.fetch_add(written as u64, Ordering::Relaxed);
                Poll::Ready(Ok(written))
            }
        }
    }
}

impl quic::SendStream<Bytes> for SendStream {
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), StreamErrorIncoming>> {
        while let Some(frame) = self.writing.as_mut().filter(|f| f.has_remaining()) {
            let written = ready!(Self::poll_write_frame(
                &mut self.stream,
                &mut self.payload,
                frame,
                cx
            ))
            .map_err(write_error)?;
            frame.advance(written);
        }
        self.writing = None;
        self.payload = None;
        Poll::Ready(Ok(()))
    }

    fn send_data<T: Into<WriteBuf<Bytes>>>(&mut self, data: T) -> Result<(), StreamErrorIncoming> {
        if self.writing.is_some() {
            // h3 waits for `poll_ready` before the next frame; this would be its bug.
            return Err(internal("h3 sent a frame before the last one was written"));
        }
        self.writing = Some(data.into());
        self.payload = self.offer.as_deref().and_then(Offer::take);
        Ok(())
    }

    fn poll_finish(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), StreamErrorIncoming>> {
        Poll::Ready(
            self.stream
                .finish()
                .map_err(|e| StreamErrorIncoming::Unknown(Box::new(e))),
        )
    }

    fn reset(&mut self, reset_code: u64) {
        let _ = self.stream.reset(varint(reset_code));
    }

    fn send_id(&self) -> StreamId {
        stream_id(self.stream.id())
    }
}

/// Raw writes (WebTransport streams): copied, as h3-quinn does.
impl quic::SendStreamUnframed<Bytes> for SendStream {
    fn poll_send<D: Buf>(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut D,
    ) -> Poll<Result<usize, StreamErrorIncoming>> {
        if self.writing.is_some() {
            return Poll::Ready(Err(internal("a raw write while a frame is being written")));
        }
        let written = ready!(Pin::new(&mut self.stream).poll_write(cx, buf.chunk())).map_err(write_error)?;
        COPIED_BYTES.fetch_add(written as u64, Ordering::Relaxed);
        buf.advance(written);
        Poll::Ready(Ok(written))
    }
}

/// A QUIC receive stream as h3 sees it: quinn's chunks, as received (no copy).
pub(crate) struct RecvStream {
    stream: quinn::RecvStream,
}

impl std::fmt::Debug for RecvStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvStream")
            .field("id", &self.stream.id())
            .finish()
    }
}

impl RecvStream {
    pub(crate) fn new(stream: quinn::RecvStream) -> Self {
        Self { stream }
    }
}

impl quic::RecvStream for RecvStream {
    type Buf = Bytes;

    fn poll_data(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<Bytes>, StreamErrorIncoming>> {
        // quinn's `read_chunk` is cancel-safe: a future made and dropped per poll
        // loses nothing, and quinn keeps the waker.
        let chunk = ready!(pin!(self.stream.read_chunk(usize::MAX, true)).poll(cx));
        Poll::Ready(chunk.map(|c| c.map(|c| c.bytes)).map_err(read_error))
    }

    fn stop_sending(&mut self, error_code: u64) {
        let _ = self.stream.stop(varint(error_code));
    }

    fn recv_id(&self) -> StreamId {
        stream_id(self.stream.id())
    }
}

/// A bidirectional stream: a request, or a WebTransport stream.
#[derive(Debug)]
pub(crate) struct BidiStream {
    send: SendStream,
    recv: RecvStream,
}

impl BidiStream {
    /// A client's stream; its send half takes chunks offered through [`Self::offer`].
    pub(crate) fn accepted(send: quinn::SendStream, recv: quinn::RecvStream) -> Self {
        Self {
            send: SendStream::new(send, Some(Arc::default())),
            recv: RecvStream::new(recv),
        }
    }

    fn opened(send: quinn::SendStream, recv: quinn::RecvStream) -> Self {
        Self {
            send: SendStream::new(send, None),
            recv: RecvStream::new(recv),
        }
    }

    /// Where a request task offers the chunks it sends on this stream.
    pub(crate) fn offer(&self) -> Option<Arc<Offer>> {
        self.send.offer.clone()
    }
}

impl quic::BidiStream<Bytes> for BidiStream {
    type SendStream = SendStream;
    type RecvStream = RecvStream;

    fn split(self) -> (SendStream, RecvStream) {
        (self.send, self.recv)
    }
}

impl quic::RecvStream for BidiStream {
    type Buf = Bytes;

    fn poll_data(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<Bytes>, StreamErrorIncoming>> {
        self.recv.poll_data(cx)
    }

    fn stop_sending(&mut self, error_code: u64) {
        self.recv.stop_sending(error_code);
    }

    fn recv_id(&self) -> StreamId {
        self.recv.recv_id()
    }
}

impl quic::SendStream<Bytes> for BidiStream {
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), StreamErrorIncoming>> {
        self.send.poll_ready(cx)
    }

    fn send_data<T: Into<WriteBuf<Bytes>>>(&mut self, data: T) -> Result<(), StreamErrorIncoming> {
        self.send.send_data(data)
    }

    fn poll_finish(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), StreamErrorIncoming>> {
        self.send.poll_finish(cx)
    }

    fn reset(&mut self, reset_code: u64) {
        self.send.reset(reset_code);
    }

    fn send_id(&self) -> StreamId {
        self.send.send_id()
    }
}

impl quic::SendStreamUnframed<Bytes> for BidiStream {
    fn poll_send<D: Buf>(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut D,
    ) -> Poll<Result<usize, StreamErrorIncoming>> {
        self.send.poll_send(cx, buf)
    }
}

/// A quinn future that waits for a stream (accepted or opened), held across polls.
pub(crate) type Waiting<T> = Pin<Box<dyn Future<Output = Result<T, quinn::ConnectionError>> + Send + Sync>>;

/// Polls the future in `slot`, made by `start` when there is none; empties the
/// slot once it is ready, so the next call waits for the next stream.
pub(crate) fn poll_waiting<T>(
    slot: &mut Option<Waiting<T>>,
    start: impl FnOnce() -> Waiting<T>,
    cx: &mut Context<'_>,
) -> Poll<Result<T, ConnectionErrorIncoming>> {
    let waiting = slot.get_or_insert_with(start);
    let done = ready!(waiting.as_mut().poll(cx));
    *slot = None;
    Poll::Ready(done.map_err(connection_error))
}

/// Opens the server's own streams (control, QPACK, WebTransport).
pub(crate) struct Opener {
    quic: quinn::Connection,
    bidi: Option<Waiting<(quinn::SendStream, quinn::RecvStream)>>,
    uni: Option<Waiting<quinn::SendStream>>,
}

impl std::fmt::Debug for Opener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opener")
            .field("peer", &self.quic.remote_address())
            .finish_non_exhaustive()
    }
}

impl Opener {
    pub(crate) fn new(quic: quinn::Connection) -> Self {
        Self {
            quic,
            bidi: None,
            uni: None,
        }
    }
}

impl quic::OpenStreams<Bytes> for Opener {
    type BidiStream = BidiStream;
    type SendStream = SendStream;

    fn poll_open_bidi(&mut self, cx: &mut Context<'_>) -> Poll<Result<BidiStream, StreamErrorIncoming>> {
        let quic = &self.quic;
        let opened = poll_waiting(
            &mut self.bidi,
            || {
                let quic = quic.clone();
                Box::pin(async move { quic.open_bi().await })
            },
            cx,
        );
        opened
            .map_ok(|(send, recv)| BidiStream::opened(send, recv))
            .map_err(|connection_error| StreamErrorIncoming::ConnectionErrorIncoming { connection_error })
    }

    fn poll_open_send(&mut self, cx: &mut Context<'_>) -> Poll<Result<SendStream, StreamErrorIncoming>> {
        let quic = &self.quic;
        let opened = poll_waiting(
            &mut self.uni,
            || {
                let quic = quic.clone();
                Box::pin(async move { quic.open_uni().await })
            },
            cx,
        );
        opened
            .map_ok(|send| SendStream::new(send, None))
            .map_err(|connection_error| StreamErrorIncoming::ConnectionErrorIncoming { connection_error })
    }

    fn close(&mut self, code: h3::error::Code, reason: &[u8]) {
        self.quic.close(varint(code.value()), reason);
    }
}

/// An error code h3 hands down, as a QUIC varint (codes beyond 2^62 cannot be
/// sent; they become the largest one).
fn varint(code: u64) -> VarInt {
    VarInt::from_u64(code).unwrap_or(VarInt::MAX)
}

fn stream_id(id: quinn::StreamId) -> StreamId {
    // quinn's ids are varints, which is all `StreamId` requires.
    StreamId::try_from(u64::from(id)).unwrap_or_else(|_| unreachable!("quinn stream ids are varints"))
}

fn internal(what: &str) -> StreamErrorIncoming {
    StreamErrorIncoming::ConnectionErrorIncoming {
        connection_error: ConnectionErrorIncoming::InternalError(what.to_owned()),
    }
}

pub(crate) fn connection_error(e: quinn::ConnectionError) -> ConnectionErrorIncoming {
    match e {
        quinn::ConnectionError::ApplicationClosed(close) => ConnectionErrorIncoming::ApplicationClose {
            error_code: close.error_code.into_inner(),
        },
        quinn::ConnectionError::TimedOut => ConnectionErrorIncoming::Timeout,
        other => ConnectionErrorIncoming::Undefined(Arc::new(other)),
    }
}

fn write_error(e: quinn::WriteError) -> StreamErrorIncoming {
    match e {
        quinn::WriteError::Stopped(code) => StreamErrorIncoming::StreamTerminated {
            error_code: code.into_inner(),
        },
        quinn::WriteError::ConnectionLost(e) => StreamErrorIncoming::ConnectionErrorIncoming {
            connection_error: connection_error(e),
        },
        other => StreamErrorIncoming::Unknown(Box::new(other)),
    }
}

fn read_error(e: quinn::ReadError) -> StreamErrorIncoming {
    match e {
        quinn::ReadError::Reset(code) => StreamErrorIncoming::StreamTerminated {
            error_code: code.into_inner(),
        },
        quinn::ReadError::ConnectionLost(e) => StreamErrorIncoming::ConnectionErrorIncoming {
            connection_error: connection_error(e),
        },
        // Ordered reads only, so never IllegalOrderedRead; the rest is unexpected.
        other => StreamErrorIncoming::Unknown(Box::new(other)),
    }
}
