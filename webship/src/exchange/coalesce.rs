//! A relayed body hands out the chunks an upstream already delivered in one go. An
//! upstream that writes many small pieces at once (an h2 origin's small DATA frames,
//! which its connection has already read and buffered) would otherwise leave as as
//! many small DATA frames towards an h2 or h3 client, each with its own frame
//! header, TLS record and write. [`Coalesced`] polls the upstream again without
//! waiting while it holds less than a full frame, and never holds back a chunk that
//! is the only one ready: the first `Pending` ends the batch.
//!
//! Memory: the batch is copied into one buffer of exactly its size, at most
//! [`MAX_BATCH`]; the pieces are released as soon as they are copied. A chunk that
//! would pass the bound, trailers, an error or the end are kept for the next poll
//! (one slot), so their order is the upstream's.

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::{Body as _, Frame, SizeHint};

use crate::message::{BoxError, StreamBody};

/// A batch stops growing once it holds this much: one HTTP/2 DATA frame at the
/// default SETTINGS_MAX_FRAME_SIZE. Chunks this large pass through uncopied.
pub(crate) const FULL_FRAME: usize = 16 * 1024;
/// A batch never exceeds this (a small chunk followed by a large one is not copied
/// into a buffer four frames long; the large one waits for the next poll).
pub(crate) const MAX_BATCH: usize = 64 * 1024;
/// Pieces per batch: bounds the loop and the list of pieces, whatever their size
/// (empty data frames included).
const MAX_PIECES: usize = 256;

type Next = Option<Result<Frame<Bytes>, BoxError>>;

pub(crate) struct Coalesced {
    inner: StreamBody,
    /// What the upstream yielded after the last batch and did not fit in it.
    held: Option<Next>,
}

impl std::fmt::Debug for Coalesced {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coalesced")
            .field("held", &self.held.is_some())
            .finish_non_exhaustive()
    }
}

impl Coalesced {
    pub(crate) fn new(inner: StreamBody) -> Self {
        Self { inner, held: None }
    }

    /// Appends the chunks that are ready now to `first`, up to a full frame.
    fn batch(&mut self, first: Bytes, cx: &mut Context<'_>) -> Bytes {
        if first.len() >= FULL_FRAME {
            return first;
        }
        let mut pieces: Vec<Bytes> = Vec::new();
        let mut total = first.len();
        while total < FULL_FRAME && pieces.len() < MAX_PIECES {
            let next = match Pin::new(&mut self.inner).poll_frame(cx) {
                Poll::Pending => break,
                Poll::Ready(next) => next,
            };
            match next {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) if total + data.len() <= MAX_BATCH => {
                        total += data.len();
                        pieces.push(data);
                    }
                    Ok(data) => {
                        self.held = Some(Some(Ok(Frame::data(data))));
                        break;
                    }
                    Err(trailers) => {
                        self.held = Some(Some(Ok(trailers)));
                        break;
                    }
                },
                end_or_error => {
                    self.held = Some(end_or_error);
                    break;
                }
            }
        }
        if pieces.is_empty() {
            return first;
        }
        let mut out = BytesMut::with_capacity(total);
        out.extend_from_slice(&first);
        for piece in pieces {
            out.extend_from_slice(&piece);
        }
        out.freeze()
    }
}

impl http_body::Body for Coalesced {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Next> {
        let this = &mut *self;
        let next = match this.held.take() {
            Some(next) => next,
            None => ready!(Pin::new(&mut this.inner).poll_frame(cx)),
        };
        match next {
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => Poll::Ready(Some(Ok(Frame::data(this.batch(data, cx))))),
                Err(trailers) => Poll::Ready(Some(Ok(trailers))),
            },
            end_or_error => Poll::Ready(end_or_error),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.held {
            Some(None) => true,
            Some(Some(_)) => false,
            None => self.inner.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        let hint = self.inner.size_hint();
        let held = match &self.held {
            Some(None) => return SizeHint::with_exact(0),
            Some(Some(Ok(frame))) => frame.data_ref().map_or(0, |d| d.len() as u64),
            _ => 0,
        };
        let mut out = SizeHint::new();
        out.set_lower(hint.lower().saturating_add(held));
        if let Some(upper) = hint.upper() {
            out.set_upper(upper.saturating_add(held));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use std::collections::VecDeque;

    /// A scripted upstream: `None` entries are a `Pending` (the next chunk not
    /// there yet), which wakes the task at once.
    struct Script(VecDeque<Option<Next>>);

    impl http_body::Body for Script {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Next> {
            match self.0.pop_front() {
                Some(Some(next)) => Poll::Ready(next),
                Some(None) => {
                    cx.waker().wake_by_ref();
                    Poll::Pending
                }
                None => Poll::Ready(None),
            }
        }
    }

    fn data(len: usize) -> Option<Next> {
        Some(Some(Ok(Frame::data(Bytes::from(vec![7u8; len])))))
    }

    fn coalesced(script: Vec<Option<Next>>) -> Coalesced {
        Coalesced::new(Script(script.into()).boxed_unsync())
    }

    /// The frames as (data length, or u64::MAX for trailers), and how it ended.
    async fn frames(mut body: Coalesced) -> (Vec<usize>, Result<(), String>) {
        let mut sizes = Vec::new();
        for _ in 0..10_000 {
            match body.frame().await {
                None => return (sizes, Ok(())),
                Some(Err(e)) => return (sizes, Err(e.to_string())),
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(d) => sizes.push(d.len()),
                    Err(_) => sizes.push(usize::MAX),
                },
            }
        }
        panic!("no end after 10,000 frames");
    }

    #[tokio::test]
    async fn ready_chunks_leave_as_full_frames() {
        // 100 chunks of 1000 bytes, all there at once.
        let (sizes, end) = frames(coalesced((0..100).map(|_| data(1000)).collect())).await;
        assert_eq!(end, Ok(()));
        assert_eq!(sizes.iter().sum::<usize>(), 100_000);
        // Each batch grows until it holds a full frame: 17 chunks.
        assert_eq!(sizes, [17_000, 17_000, 17_000, 17_000, 17_000, 15_000]);
    }

    #[tokio::test]
    async fn a_lone_chunk_is_not_held_back() {
        // Each chunk is followed by a Pending: none waits for the next.
        let script = vec![data(10), None, data(20), None, data(30)];
        let (sizes, end) = frames(coalesced(script)).await;
        assert_eq!((sizes, end), (vec![10, 20, 30], Ok(())));
    }

    #[tokio::test]
    async fn large_chunks_pass_and_a_batch_stays_bounded() {
        let script = vec![
            data(100),
            data(MAX_BATCH),
            data(FULL_FRAME),
            data(FULL_FRAME - 1),
            data(1),
        ];
        let (sizes, _) = frames(coalesced(script)).await;
        // 100 + MAX_BATCH would pass the bound: the large chunk goes on its own.
        assert_eq!(sizes, [100, MAX_BATCH, FULL_FRAME, FULL_FRAME]);
    }

    #[tokio::test]
    async fn trailers_errors_and_the_end_keep_their_place() {
        let trailers = Some(Some(Ok(Frame::trailers(http::HeaderMap::new()))));
        let script = vec![data(5), data(5), trailers];
        let (sizes, end) = frames(coalesced(script)).await;
        assert_eq!((sizes, end), (vec![10, usize::MAX], Ok(())));

        let error = Some(Some(Err::<Frame<Bytes>, BoxError>("upstream reset".into())));
        let (sizes, end) = frames(coalesced(vec![data(5), data(5), error])).await;
        assert_eq!((sizes, end), (vec![10], Err("upstream reset".to_owned())));

        // The end seen while batching is reported with the batch.
        let mut body = coalesced(vec![data(5), Some(None)]);
        let first = body.frame().await.unwrap().unwrap();
        assert_eq!(first.into_data().unwrap().len(), 5);
        assert!(body.is_end_stream(), "the end was already seen");
        assert!(body.frame().await.is_none());
    }
}
