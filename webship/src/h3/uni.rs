//! The QUIC connection as h3 sees it: its streams are [`super::backend`]'s, and
//! it makes one check h3 0.0.8 lacks: a push stream
//! (unidirectional stream type 0x01) from a client is a connection error
//! H3_STREAM_CREATION_ERROR (RFC 9114 §6.2.2: only servers push). h3 reads the type
//! of each unidirectional stream itself and drops a push stream silently, so the
//! type is watched here, below h3, as the first bytes of each such stream pass
//! through: no copy, no buffering beyond the type's at most 8 bytes.

use std::task::{Context, Poll};

use bytes::Bytes;
use h3::quic::{self, ConnectionErrorIncoming, StreamErrorIncoming, StreamId};

use super::backend::{poll_waiting, BidiStream, Opener, RecvStream, SendStream, StopChecks, Waiting};

/// Unidirectional stream type of a push stream (RFC 9114 §6.2.2).
const PUSH_STREAM: u64 = 0x01;
/// H3_STREAM_CREATION_ERROR (RFC 9114 §8.1).
const H3_STREAM_CREATION_ERROR: u32 = 0x0103;

/// The QUIC connection h3 runs on: streams of [`super::backend`], and client
/// unidirectional streams as [`UniStream`]s.
pub(crate) struct Connection {
    quic: quinn::Connection,
    bidi: Option<Waiting<(quinn::SendStream, quinn::RecvStream)>>,
    uni: Option<Waiting<quinn::RecvStream>>,
    opener: Opener,
    /// Every send stream's allowance (`backend::StopChecks`), the connection's.
    checks: StopChecks,
}

impl Connection {
    pub(crate) fn new(quic: quinn::Connection, checks: StopChecks) -> Self {
        Self {
            opener: Opener::new(quic.clone(), checks.clone()),
            checks,
            quic,
            bidi: None,
            uni: None,
        }
    }
}

impl quic::Connection<Bytes> for Connection {
    type RecvStream = UniStream;
    type OpenStreams = Opener;

    fn poll_accept_recv(&mut self, cx: &mut Context<'_>) -> Poll<Result<UniStream, ConnectionErrorIncoming>> {
        let quic = &self.quic;
        let accepted = poll_waiting(
            &mut self.uni,
            || {
                let quic = quic.clone();
                Box::pin(async move { quic.accept_uni().await })
            },
            cx,
        );
        accepted.map_ok(|recv| UniStream {
            inner: RecvStream::new(recv),
            watch: Some((StreamType::default(), self.quic.clone())),
        })
    }

    fn poll_accept_bidi(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<BidiStream, ConnectionErrorIncoming>> {
        let quic = &self.quic;
        let accepted = poll_waiting(
            &mut self.bidi,
            || {
                let quic = quic.clone();
                Box::pin(async move { quic.accept_bi().await })
            },
            cx,
        );
        accepted.map_ok(|(send, recv)| BidiStream::new(send, recv, self.checks.clone()))
    }

    fn opener(&self) -> Opener {
        Opener::new(self.quic.clone(), self.checks.clone())
    }
}

impl quic::OpenStreams<Bytes> for Connection {
    type BidiStream = BidiStream;
    type SendStream = SendStream;

    fn poll_open_bidi(&mut self, cx: &mut Context<'_>) -> Poll<Result<BidiStream, StreamErrorIncoming>> {
        self.opener.poll_open_bidi(cx)
    }

    fn poll_open_send(&mut self, cx: &mut Context<'_>) -> Poll<Result<SendStream, StreamErrorIncoming>> {
        self.opener.poll_open_send(cx)
    }

    fn close(&mut self, code: h3::error::Code, reason: &[u8]) {
        self.opener.close(code, reason);
    }
}

/// A client's unidirectional stream; its type is read as it passes.
pub(crate) struct UniStream {
    inner: RecvStream,
    /// Until the type is known: the type so far, and the connection to close if it
    /// is a push stream.
    watch: Option<(StreamType, quinn::Connection)>,
}

/// A stream type (a QUIC varint, 1 to 8 bytes) read from the chunks it arrives in.
#[derive(Debug, Default)]
struct StreamType {
    head: [u8; 8],
    read: usize,
}

impl StreamType {
    /// Takes the type's bytes from the start of `chunk`: the type once complete.
    fn feed(&mut self, chunk: &[u8]) -> Option<u64> {
        for &byte in chunk {
            self.head[self.read] = byte;
            self.read += 1;
            let len = 1usize << (self.head[0] >> 6);
            if self.read == len {
                let value = self.head[1..len]
                    .iter()
                    .fold(u64::from(self.head[0] & 0x3f), |v, &b| (v << 8) | u64::from(b));
                return Some(value);
            }
        }
        None
    }
}

impl quic::RecvStream for UniStream {
    type Buf = Bytes;

    fn poll_data(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<Bytes>, StreamErrorIncoming>> {
        let polled = self.inner.poll_data(cx);
        if let (Poll::Ready(Ok(Some(chunk))), Some((ty, quic))) = (&polled, &mut self.watch) {
            if let Some(ty) = ty.feed(chunk) {
                if ty == PUSH_STREAM {
                    tracing::debug!(peer = %quic.remote_address(), "h3: push stream from a client");
                    quic.close(H3_STREAM_CREATION_ERROR.into(), b"push stream from a client");
                }
                self.watch = None;
            }
        }
        polled
    }

    fn stop_sending(&mut self, error_code: u64) {
        self.inner.stop_sending(error_code);
    }

    fn recv_id(&self) -> StreamId {
        self.inner.recv_id()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads `bytes` as a stream type, in chunks of `step`: the value, or `None`.
    fn stream_type(bytes: &[u8], step: usize) -> Option<u64> {
        let mut ty = StreamType::default();
        bytes.chunks(step).find_map(|chunk| ty.feed(chunk))
    }

    #[test]
    fn varint_types_in_any_encoding() {
        assert_eq!(stream_type(&[0x01, 0x00], 1), Some(PUSH_STREAM));
        assert_eq!(stream_type(&[0x40, 0x01], 1), Some(PUSH_STREAM));
        assert_eq!(stream_type(&[0x80, 0, 0, 0x01], 3), Some(PUSH_STREAM));
        assert_eq!(stream_type(&[0xc0, 0, 0, 0, 0, 0, 0, 0x01], 5), Some(PUSH_STREAM));
        assert_eq!(stream_type(&[0x40, 0x54], 2), Some(0x54));
        assert_eq!(stream_type(&[0x80, 0], 1), None);
    }
}
