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
//! Flow control is quinn's, as with h3-quinn: a write waits while the stream's credit
//! or the connection's send window (`h3_send_window_bytes`, which counts bytes sent
//! and not yet acknowledged) is used up. Memory is not the window alone: an offered
//! chunk keeps its whole allocation alive until quinn has its bytes acknowledged,
//! and the window counts only the chunk. So the request task offers only chunks of
//! at least [`OFFER_MIN`] (`h3/mod.rs`, `Writer`); smaller ones are copied.

use std::future::Future;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes};
use h3::quic::{self, ConnectionErrorIncoming, StreamErrorIncoming, StreamId, WriteBuf};
use quinn::VarInt;

use super::stats::{STREAM_COPIED_BYTES, STREAM_ZERO_COPY_BYTES};

/// The smallest chunk worth offering: one full frame
/// ([`FULL_FRAME`](crate::exchange::coalesce::FULL_FRAME), 16 KiB). A relayed chunk
/// can be a slice of an upstream's read buffer (8 to 64 KiB, more for hyper's
/// adaptive reads), and quinn would keep that whole buffer until the client
/// acknowledges the slice: a trickling origin's 1-byte chunks held by a client that
/// never acknowledges them would pin a buffer each while the send window counts one
/// byte, so writes never wait and `send_timeout` never fires. With at least 16 KiB
/// per chunk, what quinn pins stays within the window times the buffer's size over
/// 16 KiB (4 for a 64 KiB read buffer); a smaller chunk costs a copy of under 16 KiB.
/// File chunks need no exception: only a file's tail and the first reads of a
/// client granting little credit are that small.
pub(crate) const OFFER_MIN: usize = crate::exchange::coalesce::FULL_FRAME;

/// The chunk a request task is about to send on a stream, shared with the stream's
/// [`SendStream`]. Holds at most one chunk: from [`Offer::lend`] until the stream
/// takes it with its frame (the first poll of `send_data`) or the returned
/// [`Offered`] goes, whichever comes first (a `send_data` that times out, or is
/// cancelled before h3 hands the frame down, leaves nothing behind).
#[derive(Debug, Default)]
pub(crate) struct Offer(Mutex<Option<Bytes>>);

/// An offer in force; dropping it withdraws the chunk if the stream did not take it.
#[must_use = "the offer is withdrawn when this drops"]
#[derive(Debug)]
pub(crate) struct Offered<'a>(&'a Offer);

impl Drop for Offered<'_> {
    fn drop(&mut self) {
        self.0.slot().take();
    }
}

impl Offer {
    /// Offers `chunk` for the next frame the stream is given, while the guard lives.
    pub(crate) fn lend(&self, chunk: Bytes) -> Offered<'_> {
        *self.slot() = Some(chunk);
        Offered(self)
    }

    /// Whether a chunk is offered and not yet taken.
    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.slot().is_none()
    }

    fn take(&self) -> Option<Bytes> {
        self.slot().take()
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, Option<Bytes>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// How many streams of one connection may leave a slot behind in quinn's table of
/// stop waiters ([`ask_stopped`]): about 100 KiB. Past it the connection's writes
/// no longer ask, and a stopped stream's write may wait for `send_timeout` again.
/// The bound is this plus the streams that had asked when the allowance ran out
/// (at most the connection's concurrent streams).
const STOP_SLOTS_LEFT_BEHIND: u32 = 1024;

/// One connection's allowance of [`STOP_SLOTS_LEFT_BEHIND`], shared by every send
/// stream of the connection.
#[derive(Debug, Clone)]
pub(crate) struct StopChecks(Arc<AtomicU32>);

impl Default for StopChecks {
    fn default() -> Self {
        Self(Arc::new(AtomicU32::new(STOP_SLOTS_LEFT_BEHIND)))
    }
}

impl StopChecks {
    fn allowed(&self) -> bool {
        self.0.load(Ordering::Relaxed) > 0
    }

    fn left_behind(&self) {
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    }
}

/// A QUIC send stream as h3 sees it.
pub(crate) struct SendStream {
    stream: quinn::SendStream,
    /// The frame being written (h3 hands one at a time).
    writing: Option<WriteBuf<Bytes>>,
    /// The offered chunk taken with that frame: its not-yet-written part.
    payload: Option<Bytes>,
    /// Where the request task offers chunks (only request streams' are ever filled;
    /// the server's own streams carry an empty one, which costs an allocation per
    /// stream opened, a few per connection).
    offer: Arc<Offer>,
    /// The connection's allowance for [`ask_stopped`], and whether this stream holds
    /// a slot in quinn's table (asked while not stopped).
    checks: StopChecks,
    asked: bool,
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
    pub(crate) fn new(stream: quinn::SendStream, checks: StopChecks) -> Self {
        Self {
            stream,
            writing: None,
            payload: None,
            offer: Arc::default(),
            checks,
            asked: false,
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
                STREAM_ZERO_COPY_BYTES.fetch_add(written.bytes as u64, Ordering::Relaxed);
                Poll::Ready(Ok(written.bytes))
            }
            _ => {
                let written = ready!(Pin::new(stream).poll_write(cx, next))?;
                STREAM_COPIED_BYTES.fetch_add(written as u64, Ordering::Relaxed);
                Poll::Ready(Ok(written))
            }
        }
    }
}

impl quic::SendStream<Bytes> for SendStream {
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), StreamErrorIncoming>> {
        while let Some(frame) = self.writing.as_mut().filter(|f| f.has_remaining()) {
            let written = match Self::poll_write_frame(&mut self.stream, &mut self.payload, frame, cx) {
                Poll::Ready(written) => written.map_err(|e| stopped_or(e, &mut self.asked))?,
                Poll::Pending => {
                    return ask_stopped(&self.stream, &self.checks, &mut self.asked, cx)
                        .map_or(Poll::Pending, |e| Poll::Ready(Err(e)))
                }
            };
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
        self.payload = self.offer.take();
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
        // No event will take this stream's slot out of quinn's table now.
        if std::mem::take(&mut self.asked) && holds_slot(&self.stream) {
            self.checks.left_behind();
        }
        let _ = self.stream.reset(varint(reset_code));
    }

    fn send_id(&self) -> StreamId {
        stream_id(self.stream.id())
    }
}

/// Whether the stream still holds a slot in quinn's table of stop waiters, for a
/// stream that asked: it does unless a stop, an acknowledged finish or the
/// connection's end freed it since (the slot is looked up, never added: quinn reuses
/// the one the stream holds).
fn holds_slot(stream: &quinn::SendStream) -> bool {
    let mut cx = Context::from_waker(std::task::Waker::noop());
    pin!(stream.stopped()).poll(&mut cx).is_pending()
}

/// A failed write's error; a stop also took the stream's slot, if any, out of
/// quinn's table ([`ask_stopped`]).
fn stopped_or(e: quinn::WriteError, asked: &mut bool) -> StreamErrorIncoming {
    if matches!(e, quinn::WriteError::Stopped(_)) {
        *asked = false;
    }
    write_error(e)
}

/// Asks quinn, for a write that has to wait, whether the peer stopped the stream:
/// its STOP_SENDING as the error if so. quinn-proto 0.11 checks the connection's
/// credit and send window before the stream's stop, so a write to a stopped stream
/// is told Blocked, not Stopped, while the connection has none; and once the
/// stream is at its own limit too (a peer that stopped it grants no more), no
/// credit ever wakes the writer again. The response would wait for `send_timeout`.
/// A writer parked when the STOP_SENDING comes is woken by quinn (it wakes blocked
/// writers on a stop) and asks here on that poll.
///
/// The cost: one more lock of the connection and of a `Notify` per wait, and a
/// slot (about 100 bytes) in quinn's table of stop waiters for a stream asked
/// while not stopped. quinn frees the slot when the stream is stopped, finishes
/// with every byte acknowledged, or the connection ends, but not when this side
/// resets the stream (`send_timeout`, a failed body, a WebTransport session's
/// end): `asked` marks a stream that may hold one, and a connection may leave
/// [`STOP_SLOTS_LEFT_BEHIND`] behind before its writes stop asking.
fn ask_stopped(
    stream: &quinn::SendStream,
    checks: &StopChecks,
    asked: &mut bool,
    cx: &mut Context<'_>,
) -> Option<StreamErrorIncoming> {
    if !checks.allowed() {
        return None;
    }
    match pin!(stream.stopped()).poll(cx) {
        Poll::Ready(Ok(Some(code))) => Some(stopped_or(quinn::WriteError::Stopped(code), asked)),
        Poll::Pending => {
            *asked = true;
            None
        }
        // A lost connection or a closed stream: the write reports it itself.
        Poll::Ready(_) => None,
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
        let written = match Pin::new(&mut self.stream).poll_write(cx, buf.chunk()) {
            Poll::Ready(written) => written.map_err(|e| stopped_or(e, &mut self.asked))?,
            Poll::Pending => {
                return ask_stopped(&self.stream, &self.checks, &mut self.asked, cx)
                    .map_or(Poll::Pending, |e| Poll::Ready(Err(e)))
            }
        };
        STREAM_COPIED_BYTES.fetch_add(written as u64, Ordering::Relaxed);
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
    /// A stream of either side; its send half takes the chunks offered through
    /// [`Self::offer_slot`] and asks within its connection's `checks`.
    pub(crate) fn new(send: quinn::SendStream, recv: quinn::RecvStream, checks: StopChecks) -> Self {
        Self {
            send: SendStream::new(send, checks),
            recv: RecvStream::new(recv),
        }
    }

    /// Where a request task offers the chunks it sends on this stream.
    pub(crate) fn offer_slot(&self) -> Arc<Offer> {
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
    checks: StopChecks,
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
    pub(crate) fn new(quic: quinn::Connection, checks: StopChecks) -> Self {
        Self {
            quic,
            checks,
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
            .map_ok(|(send, recv)| BidiStream::new(send, recv, self.checks.clone()))
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
            .map_ok(|send| SendStream::new(send, self.checks.clone()))
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

#[cfg(test)]
pub(crate) mod tests {
    use std::future::poll_fn;
    use std::net::{Ipv4Addr, SocketAddr};
    use std::time::Duration;

    use h3::proto::frame::Frame;
    use h3::quic::SendStream as _;

    use super::*;

    /// Two quinn endpoints on loopback and the connection between them. The client
    /// grants `stream_window` bytes of credit per stream, so a server write longer
    /// than that is taken in parts as the client reads, and `window` bytes for the
    /// connection (quinn's default when `None`).
    pub(crate) struct Pair {
        pub(crate) server: quinn::Connection,
        pub(crate) client: quinn::Connection,
        _endpoints: (quinn::Endpoint, quinn::Endpoint),
    }

    pub(crate) async fn quic_pair(stream_window: u32, window: Option<u32>) -> Pair {
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
        let key = rustls::pki_types::PrivatePkcs8KeyDer::from(cert.key_pair.serialize_der());
        let server_config =
            quinn::ServerConfig::with_single_cert(vec![cert.cert.der().clone()], key.into()).unwrap();
        let loopback = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
        let server_end = quinn::Endpoint::server(server_config, loopback).unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(cert.cert.der().clone()).unwrap();
        let mut client_config = quinn::ClientConfig::with_root_certificates(Arc::new(roots)).unwrap();
        let mut transport = quinn::TransportConfig::default();
        transport.stream_receive_window(stream_window.into());
        if let Some(window) = window {
            transport.receive_window(window.into());
        }
        client_config.transport_config(Arc::new(transport));
        let mut client_end = quinn::Endpoint::client(loopback).unwrap();
        client_end.set_default_client_config(client_config);
        let connecting = client_end
            .connect(server_end.local_addr().unwrap(), "localhost")
            .unwrap();
        let (server, client) = tokio::join!(
            async { server_end.accept().await.unwrap().await.unwrap() },
            async { connecting.await.unwrap() }
        );
        Pair {
            server,
            client,
            _endpoints: (server_end, client_end),
        }
    }

    fn counters() -> (u64, u64) {
        (
            STREAM_ZERO_COPY_BYTES.load(Ordering::Relaxed),
            STREAM_COPIED_BYTES.load(Ordering::Relaxed),
        )
    }

    /// Hands `frame` to the stream as h3 does and waits until it is written: returns
    /// how many bytes went (without a copy, copied), by the counters.
    async fn write(stream: &mut SendStream, frame: Frame<Bytes>) -> (u64, u64) {
        let before = counters();
        stream.send_data(frame).unwrap();
        poll_fn(|cx| stream.poll_ready(cx)).await.unwrap();
        let after = counters();
        (after.0 - before.0, after.1 - before.1)
    }

    /// A frame as RFC 9114 puts it on the wire: type, length, payload (one-byte
    /// types, payloads under 16 KiB).
    fn wire(ty: u8, payload: &[u8]) -> Vec<u8> {
        let len = u16::try_from(payload.len()).ok().filter(|&l| l < 0x4000).unwrap();
        let mut frame = vec![ty];
        if len < 64 {
            frame.push(len as u8);
        } else {
            frame.extend((0x4000 | len).to_be_bytes());
        }
        frame.extend_from_slice(payload);
        frame
    }

    fn data_frame(payload: &[u8]) -> Vec<u8> {
        wire(0x00, payload)
    }

    /// One test, as the counters are process-wide: an offered chunk three times the
    /// stream window goes to quinn uncopied in parts (only its frame header is
    /// copied); the same bytes at another address are copied; a stale offer under a
    /// trailers frame is not written, and the trailers are copied. The client gets
    /// exactly the frames, in order.
    #[tokio::test]
    async fn offered_chunks_go_uncopied_and_anything_else_is_copied() {
        let pair = quic_pair(1024, None).await;
        let client = pair.client.clone();
        let received = tokio::spawn(async move {
            let mut recv = client.accept_uni().await.unwrap();
            recv.read_to_end(1 << 20).await.unwrap()
        });
        let mut stream = SendStream::new(pair.server.open_uni().await.unwrap(), StopChecks::default());
        let offer = stream.offer.clone();
        let chunk = Bytes::from((0..3000u32).map(|i| (i * 7) as u8).collect::<Vec<_>>());
        let mut expected = Vec::new();

        let offered = offer.lend(chunk.clone());
        let header = data_frame(&chunk).len() - chunk.len();
        assert_eq!(
            write(&mut stream, Frame::Data(chunk.clone())).await,
            (chunk.len() as u64, header as u64),
            "an offered chunk goes uncopied, only its frame header is copied"
        );
        drop(offered);
        expected.extend(data_frame(&chunk));

        let same_bytes = Bytes::copy_from_slice(&chunk);
        let offered = offer.lend(same_bytes);
        assert_eq!(
            write(&mut stream, Frame::Data(chunk.clone())).await,
            (0, (header + chunk.len()) as u64),
            "a frame whose payload is not the offered memory is copied"
        );
        drop(offered);
        expected.extend(data_frame(&chunk));

        // Never withdrawn (as a timed-out write left it before the guard existed).
        std::mem::forget(offer.lend(chunk.clone()));
        let trailers = Bytes::from_static(b"\0\0\x8f\x01\x02");
        let frame = wire(0x01, &trailers);
        assert_eq!(
            write(&mut stream, Frame::Headers(trailers)).await,
            (0, frame.len() as u64),
            "trailers after a stale offer are copied, the offer is not written"
        );
        assert!(offer.is_empty(), "the stream took the stale offer with the frame");
        expected.extend(frame);

        poll_fn(|cx| stream.poll_finish(cx)).await.unwrap();
        let got = received.await.unwrap();
        assert!(
            got == expected,
            "the client got {} bytes, not the {} written",
            got.len(),
            expected.len()
        );
    }

    /// Whether the frame handed to `stream` is still not written after 300 ms.
    async fn pending(stream: &mut SendStream) -> bool {
        let wait = poll_fn(|cx| stream.poll_ready(cx));
        tokio::time::timeout(Duration::from_millis(300), wait)
            .await
            .is_err()
    }

    /// An unframed write of `len` bytes (as WebTransport's), given 5 s.
    async fn raw_write(
        stream: &mut SendStream,
        len: usize,
    ) -> Result<Result<usize, StreamErrorIncoming>, tokio::time::error::Elapsed> {
        use h3::quic::SendStreamUnframed as _;
        let mut bytes = Bytes::from(vec![5u8; len]);
        let written = poll_fn(|cx| stream.poll_send(cx, &mut bytes));
        tokio::time::timeout(Duration::from_secs(5), written).await
    }

    /// A write to a stream the peer stopped ends with the peer's code even while the
    /// connection has no credit left: a write parked when the STOP_SENDING came
    /// (`waiting`), one begun after it (`after`), and a WebTransport stream's
    /// unframed write (`raw`). quinn-proto 0.11 answers each with Blocked, not
    /// Stopped, once the connection's credit is used up, and never wakes the writer
    /// again: a stopped stream at its own limit gets no more credit. Before the fix
    /// every one of these writes waited until `send_timeout`.
    #[tokio::test]
    async fn a_write_to_a_stopped_stream_ends_while_the_connection_has_no_credit() {
        const STREAM: usize = 4096;
        // 32 streams fill the connection's credit; what the three stopped streams give
        // back (12 KiB) is under the 1/8 of the window that makes the client grant more.
        let pair = quic_pair(STREAM as u32, Some(32 * STREAM as u32)).await;
        let checks = StopChecks::default();
        let exact = || Frame::Data(Bytes::from(vec![7u8; STREAM - 3])); // + 3 header bytes
        let open = || async { SendStream::new(pair.server.open_uni().await.unwrap(), checks.clone()) };

        let mut waiting = open().await;
        let waiting_id = waiting.stream.id();
        let waiting_stopped = waiting.stream.stopped();
        waiting
            .send_data(Frame::Data(Bytes::from(vec![1u8; 2 * STREAM])))
            .unwrap();
        // Parked on its own task: only quinn's wake can end it.
        let parked = tokio::spawn(async move { poll_fn(|cx| waiting.poll_ready(cx)).await });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!parked.is_finished(), "a write past the stream's credit waits");
        let mut after = open().await;
        write(&mut after, exact()).await;
        let mut raw = open().await;
        assert_eq!(raw_write(&mut raw, STREAM).await.unwrap().unwrap(), STREAM);
        for _ in 0..29 {
            write(&mut open().await, exact()).await;
        }
        let mut probe = open().await;
        probe.send_data(Frame::Data(Bytes::from_static(b"x"))).unwrap();
        assert!(pending(&mut probe).await, "the connection's credit is used up");

        let stop = [waiting_id, after.stream.id(), raw.stream.id()];
        let mut kept = Vec::new();
        for _ in 0..32 {
            let mut recv = pair.client.accept_uni().await.unwrap();
            if stop.contains(&recv.id()) {
                recv.stop(VarInt::from_u32(9)).unwrap();
            }
            kept.push(recv);
        }
        let nine = Ok(Some(VarInt::from_u32(9)));
        assert_eq!(waiting_stopped.await, nine);
        for stream in [&after, &raw] {
            assert_eq!(stream.stream.stopped().await, nine);
        }
        assert!(
            pending(&mut probe).await,
            "the stops gave the connection no credit back"
        );
        fn code<T>(end: Result<Result<T, StreamErrorIncoming>, tokio::time::error::Elapsed>) -> Option<u64> {
            match end {
                Ok(Err(StreamErrorIncoming::StreamTerminated { error_code })) => Some(error_code),
                _ => None,
            }
        }
        let within = Duration::from_secs(5);
        let parked = tokio::time::timeout(within, parked).await;
        let mut ended = vec![code(parked.map(|joined| joined.unwrap()))];
        after.send_data(exact()).unwrap();
        let end = poll_fn(|cx| after.poll_ready(cx));
        ended.push(code(tokio::time::timeout(within, end).await));
        ended.push(code(raw_write(&mut raw, 1).await));
        assert_eq!(
            ended,
            [Some(9); 3],
            "the writes parked at and begun after the STOP_SENDING, and the raw one"
        );
        drop(kept);
    }

    /// A stream that waited while not stopped holds a slot in quinn's table, which a
    /// reset of ours leaves behind: it counts against the connection's allowance. A
    /// stream the peer stopped, or a connection whose allowance is spent, does not.
    #[tokio::test]
    async fn a_reset_after_a_wait_counts_against_the_connections_allowance() {
        let pair = quic_pair(1024, None).await;
        let checks = StopChecks::default();
        let left = || checks.0.load(Ordering::Relaxed);
        let mut stream = SendStream::new(pair.server.open_uni().await.unwrap(), checks.clone());
        stream
            .send_data(Frame::Data(Bytes::from(vec![1u8; 4096])))
            .unwrap();
        assert!(pending(&mut stream).await, "past the stream's credit");
        assert!(stream.asked);
        stream.reset(1);
        assert_eq!(left(), STOP_SLOTS_LEFT_BEHIND - 1);

        // Stopped by the client: the stop emptied its slot.
        let mut stopped = SendStream::new(pair.server.open_uni().await.unwrap(), checks.clone());
        stopped
            .send_data(Frame::Data(Bytes::from(vec![2u8; 4096])))
            .unwrap();
        assert!(pending(&mut stopped).await);
        let mut recv = loop {
            let recv = pair.client.accept_uni().await.unwrap();
            if recv.id() == stopped.stream.id() {
                break recv;
            }
        };
        recv.stop(VarInt::from_u32(3)).unwrap();
        let ended = poll_fn(|cx| stopped.poll_ready(cx));
        let ended = tokio::time::timeout(Duration::from_secs(5), ended).await.unwrap();
        assert!(matches!(
            ended,
            Err(StreamErrorIncoming::StreamTerminated { error_code: 3 })
        ));
        assert!(!stopped.asked);
        stopped.reset(1);
        assert_eq!(left(), STOP_SLOTS_LEFT_BEHIND - 1);

        // Spent: a waiting write no longer asks.
        checks.0.store(0, Ordering::Relaxed);
        let mut spent = SendStream::new(pair.server.open_uni().await.unwrap(), checks.clone());
        spent
            .send_data(Frame::Data(Bytes::from(vec![3u8; 4096])))
            .unwrap();
        assert!(pending(&mut spent).await);
        assert!(!spent.asked);
        spent.reset(1);
        assert_eq!(left(), 0);
    }

    /// An offer the stream never took is withdrawn when its guard goes, as when a
    /// `send_data` times out before h3 hands the frame down.
    #[test]
    fn a_dropped_guard_withdraws_the_offer() {
        let offer = Offer::default();
        let offered = offer.lend(Bytes::from_static(b"chunk"));
        assert!(!offer.is_empty());
        drop(offered);
        assert!(offer.is_empty(), "the chunk stayed in the slot");
    }
}
