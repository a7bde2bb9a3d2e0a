//! The send loop of the drivers that push (h1, h3; hyper pulls by itself): it drains
//! a [`ResponseBody`] into a driver's [`BodyWriter`] and is the one place that decides
//! how a response ends. A body that fails (disk error, shrunk file, upstream reset)
//! aborts the response — the writer makes the peer see it incomplete — and is never
//! finished as if it were whole.
//!
//! It is also where `send_timeout` means the same for every pushing driver: each
//! write to the peer (a data chunk, a file range, trailers, the end) must complete
//! within it, or the response is aborted as stalled. Waiting for the body itself (an
//! upstream that is slow to produce) is not the client's stall and is not timed here.
//! The pulling driver (hyper) watches its bodies through a [`PullClock`] instead.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use http::HeaderMap;
use http_body_util::BodyExt;

use super::record::Outcome;
use super::ResponseBody;
use crate::files::cursor::FileRange;
use crate::message::BoxError;

/// Why a response was not sent completely.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SendError {
    /// The body could not be produced: the response was aborted.
    #[error("response body failed: {0}")]
    Body(BoxError),
    /// Writing to the peer failed (it went away, or a protocol error).
    #[error("{0}")]
    Peer(BoxError),
    /// The peer stopped reading for longer than the send timeout.
    #[error("client stopped reading for longer than the send timeout")]
    Timeout,
}

impl SendError {
    pub(crate) fn peer(e: impl Into<BoxError>) -> Self {
        SendError::Peer(e.into())
    }

    /// How a response that failed this way ended, for its record.
    pub(crate) fn outcome(&self) -> Outcome {
        match self {
            SendError::Body(_) => Outcome::BodyError,
            SendError::Peer(_) => Outcome::ClientGone,
            SendError::Timeout => Outcome::Timeout,
        }
    }
}

/// How far a response got, after a data chunk.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Progress {
    /// Body bytes sent so far.
    pub(crate) sent: u64,
    /// Whether a file body still has bytes to come.
    pub(crate) file_left: bool,
}

/// One response stream of a driver, as the send loop writes it.
pub(crate) trait BodyWriter {
    async fn data(&mut self, data: Bytes) -> Result<(), SendError>;

    /// The body's trailers, its last frame; [`finish`](Self::finish) follows.
    async fn trailers(&mut self, trailers: HeaderMap) -> Result<(), SendError>;

    /// The body is complete (after its trailers, if any): end the response cleanly.
    async fn finish(&mut self) -> Result<(), SendError>;

    /// The response failed (its body, or a write): end it so the peer can tell it
    /// is incomplete.
    fn abort(&mut self);

    /// After each data chunk: the driver may act on the bytes sent so far (h1's
    /// kernel TLS promotion, h3's switch to BBR and its yield to the connection).
    async fn progress(&mut self, _progress: Progress) -> Result<(), SendError> {
        Ok(())
    }

    /// The size of the next file read, for a writer that can tell (h1 sees what
    /// leaves its socket and what the socket takes): a body
    /// [`sized_by_writer`](ResponseBody::sized_by_writer) reads that much
    /// ([`ResponseBody::set_next_read`]). `&mut` because it updates the writer's
    /// estimate of its client: called once before each such read, after the
    /// previous chunk was written.
    fn next_read_size(&mut self) -> Option<u64> {
        None
    }

    /// Whether the writer can send file ranges without reading them (h1 on kTLS).
    fn sends_files(&self) -> bool {
        false
    }

    /// Sends a file range unread; only called when [`sends_files`](Self::sends_files).
    async fn file(&mut self, range: FileRange) -> Result<(), SendError> {
        let _ = range;
        Err(SendError::peer("this driver cannot send files unread"))
    }
}

/// Sends `body` through `writer` until it ends, then finishes the response. Any
/// error (the body's, writing to the peer, or a write that made no progress within
/// `stall`) aborts the response instead: only a response that was finished may look
/// finished.
pub(crate) async fn send_body<W: BodyWriter>(
    mut body: ResponseBody,
    writer: &mut W,
    stall: Duration,
) -> Result<(), SendError> {
    let sent = send_all(&mut body, writer, stall).await;
    if sent.is_err() {
        writer.abort();
    }
    body.settle(
        sent.as_ref()
            .map_or_else(SendError::outcome, |()| Outcome::Complete),
    );
    sent
}

/// The largest piece of a file range handed to the writer at once: the progress of
/// a listed transfer moves this often (sendfile makes calls of this size anyway).
const FILE_PIECE: u64 = 16 * 1024 * 1024;

/// `range` in pieces of at most [`FILE_PIECE`] bytes.
fn pieces(range: FileRange) -> impl Iterator<Item = FileRange> {
    let end = range.offset + range.len;
    (range.offset..end)
        .step_by(usize::try_from(FILE_PIECE).unwrap_or(usize::MAX))
        .map(move |offset| FileRange {
            file: range.file.clone(),
            offset,
            len: FILE_PIECE.min(end - offset),
        })
}

/// One write to the peer, which must complete within `stall`.
async fn timed<F: Future<Output = Result<(), SendError>>>(
    stall: Duration,
    write: F,
) -> Result<(), SendError> {
    tokio::time::timeout(stall, write)
        .await
        .unwrap_or(Err(SendError::Timeout))
}

async fn send_all<W: BodyWriter>(
    body: &mut ResponseBody,
    writer: &mut W,
    stall: Duration,
) -> Result<(), SendError> {
    loop {
        if writer.sends_files() {
            if let Some(range) = body.take_file_range() {
                body.set_ktls();
                // A range by sendfile times its own writes (each must make progress);
                // it goes in pieces so its progress shows while it runs.
                let end = body.produced();
                let mut sent = end - range.len;
                for piece in pieces(range) {
                    let len = piece.len;
                    if let Err(e) = writer.file(piece).await {
                        // The range counted as handed out when it was taken: what did
                        // not go (this piece and the rest) is not the response's.
                        body.not_sent(end - sent);
                        return Err(e);
                    }
                    sent += len;
                    body.sent(sent);
                }
                continue;
            }
        }
        // Only a file read of a body sized by its writer asks the writer (one
        // `TCP_INFO` and one `SO_MEMINFO` for h1); the first read is sized too.
        if body.reads_at_writers_size() {
            if let Some(size) = writer.next_read_size() {
                body.set_next_read(size);
            }
        }
        let frame = match body.frame().await {
            None => break,
            Some(Ok(frame)) => frame,
            Some(Err(e)) => return Err(SendError::Body(e)),
        };
        match frame.into_data() {
            Ok(data) => {
                if data.is_empty() {
                    continue;
                }
                timed(stall, writer.data(data)).await?;
                let progress = Progress {
                    sent: body.produced(),
                    file_left: body.has_file_left(),
                };
                writer.progress(progress).await?;
            }
            Err(frame) => {
                if let Ok(trailers) = frame.into_trailers() {
                    // Trailers end the body; nothing may follow them.
                    timed(stall, writer.trailers(trailers)).await?;
                    break;
                }
            }
        }
    }
    timed(stall, writer.finish()).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_range_goes_in_pieces_that_cover_it_exactly() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"").unwrap();
        let file = std::sync::Arc::new(std::fs::File::open(&path).unwrap());
        let range = |offset, len| FileRange {
            file: file.clone(),
            offset,
            len,
        };
        let cut: Vec<(u64, u64)> = pieces(range(5, 2 * FILE_PIECE + 3))
            .map(|p| (p.offset, p.len))
            .collect();
        assert_eq!(
            cut,
            [
                (5, FILE_PIECE),
                (5 + FILE_PIECE, FILE_PIECE),
                (5 + 2 * FILE_PIECE, 3)
            ]
        );
        assert_eq!(pieces(range(9, 0)).count(), 0);
    }

    /// A writer that sends files unread and fails after `ok` pieces.
    struct FailingFiles {
        ok: usize,
    }

    impl BodyWriter for FailingFiles {
        async fn data(&mut self, _: Bytes) -> Result<(), SendError> {
            Ok(())
        }
        async fn trailers(&mut self, _: HeaderMap) -> Result<(), SendError> {
            Ok(())
        }
        async fn finish(&mut self) -> Result<(), SendError> {
            Ok(())
        }
        fn abort(&mut self) {}
        fn sends_files(&self) -> bool {
            true
        }
        async fn file(&mut self, _: FileRange) -> Result<(), SendError> {
            match self.ok.checked_sub(1) {
                Some(left) => {
                    self.ok = left;
                    Ok(())
                }
                None => Err(SendError::peer("the client went")),
            }
        }
    }

    #[tokio::test]
    async fn a_file_range_that_fails_halfway_counts_only_what_went() {
        use crate::message::{Body, FileBody, Segment};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sparse");
        let len = 3 * FILE_PIECE;
        std::fs::File::create(&path).unwrap().set_len(len).unwrap();
        let body = Body::File(FileBody {
            file: std::sync::Arc::new(std::fs::File::open(&path).unwrap()),
            segments: vec![Segment::File { offset: 0, len }],
            len,
        });
        let mut body = ResponseBody::new(body, 64 * 1024);
        let sent = send_all(&mut body, &mut FailingFiles { ok: 1 }, Duration::from_secs(5)).await;
        assert!(matches!(sent, Err(SendError::Peer(_))), "{sent:?}");
        assert_eq!(body.produced(), FILE_PIECE, "one piece went, two did not");
    }
}
