//! The bodies crossing the proxy, each a thin wrapper: the request body's size limit
//! and its progress (which tells a slow client from a slow upstream), and the
//! relayed response body's idle timeout and length check.

use std::future::Future as _;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::Frame;

use crate::message::{BoxError, StreamBody};

use super::upstream::ClientBodyFailed;

/// The error a [`LimitedBody`] ends with, recognisable through hyper's error chain.
#[derive(Debug, thiserror::Error)]
#[error("request body over the route's max_body_bytes")]
pub(super) struct BodyTooLarge;

/// Ends a request body with an error once it exceeds the route's limit, so the
/// upstream sees an aborted request rather than a truncated one.
pub(super) struct LimitedBody {
    pub(super) inner: StreamBody,
    pub(super) left: u64,
}

impl http_body::Body for LimitedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let frame = std::task::ready!(Pin::new(&mut self.inner).poll_frame(cx));
        if let Some(Ok(f)) = &frame {
            if let Some(data) = f.data_ref() {
                let n = data.len() as u64;
                if n > self.left {
                    return Poll::Ready(Some(Err(Box::new(BodyTooLarge))));
                }
                self.left -= n;
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Which side a stalled exchange waits on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Waiting {
    /// No connection was ready long after the connector's own limits (a TLS
    /// handshake or an HTTP/2 connection another request is opening): no blame.
    Connection,
    /// The request is sent; the response head is late: the upstream's fault.
    Response,
    /// The upload pauses because the client sends nothing.
    Client,
    /// The upload pauses because the upstream takes nothing.
    UpstreamReading,
}

#[derive(Debug)]
struct UploadState {
    /// The last body bytes (or the moment the connection was ready).
    last: Instant,
    /// When the whole request had gone.
    ended: Option<Instant>,
    /// Whether the last poll of the client's body found nothing to send.
    waiting_on_client: bool,
}

/// The progress of one request's upload, shared by its body and the exchange.
#[derive(Debug, Clone)]
pub(super) struct Upload(Arc<Mutex<UploadState>>);

impl Upload {
    pub(super) fn new() -> Self {
        Upload(Arc::new(Mutex::new(UploadState {
            last: Instant::now(),
            ended: None,
            waiting_on_client: false,
        })))
    }

    fn with<R>(&self, f: impl FnOnce(&mut UploadState) -> R) -> Option<R> {
        self.0.lock().ok().map(|mut s| f(&mut s))
    }

    /// The connection is ready and the request starts: a request without a body is
    /// then as good as sent.
    pub(super) fn connected(&self, bodiless: bool) {
        let now = Instant::now();
        self.with(|s| {
            s.last = now;
            if bodiless && s.ended.is_none() {
                s.ended = Some(now);
            }
        });
    }

    /// When the exchange has waited too long, and on whom: `response` after the
    /// request's end, `idle` after the upload's last progress.
    pub(super) fn deadline(&self, response: Duration, idle: Duration) -> (Instant, Waiting) {
        self.with(|s| match s.ended {
            Some(t) => (t + response, Waiting::Response),
            None if s.waiting_on_client => (s.last + idle, Waiting::Client),
            None => (s.last + idle, Waiting::UpstreamReading),
        })
        .unwrap_or_else(|| (Instant::now(), Waiting::Response))
    }

    pub(super) fn watch(&self, inner: StreamBody) -> UploadWatch {
        UploadWatch {
            inner,
            upload: self.clone(),
        }
    }
}

/// The request body as the upstream pulls it, recording its progress; the client's
/// own errors come out as [`ClientBodyFailed`].
pub(super) struct UploadWatch {
    inner: StreamBody,
    upload: Upload,
}

impl http_body::Body for UploadWatch {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        let now = Instant::now();
        let end = self.inner.is_end_stream();
        match polled {
            Poll::Pending => {
                self.upload.with(|s| s.waiting_on_client = true);
                Poll::Pending
            }
            Poll::Ready(Some(Ok(frame))) => {
                self.upload.with(|s| {
                    s.last = now;
                    s.waiting_on_client = false;
                    if end {
                        s.ended = Some(now);
                    }
                });
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                self.upload.with(|s| s.waiting_on_client = false);
                Poll::Ready(Some(Err(Box::new(ClientBodyFailed(e)))))
            }
            Poll::Ready(None) => {
                self.upload.with(|s| {
                    s.waiting_on_client = false;
                    s.ended.get_or_insert(now);
                });
                Poll::Ready(None)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The relayed response body: fails when the upstream sends nothing for `idle`,
/// and when it sends more or fewer bytes than the `Content-Length` the client was
/// given — the client's connection must then end rather than look complete (or
/// carry the surplus as a next response).
pub(super) struct RelayBody {
    pub(super) inner: StreamBody,
    pub(super) idle: Duration,
    pub(super) timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Bytes the client was promised, if a length was forwarded.
    pub(super) expected: Option<u64>,
    pub(super) seen: u64,
}

impl RelayBody {
    fn check(
        &mut self,
        frame: Option<Result<Frame<Bytes>, BoxError>>,
    ) -> Option<Result<Frame<Bytes>, BoxError>> {
        let Some(expected) = self.expected else {
            return frame;
        };
        match &frame {
            Some(Ok(f)) => {
                let n = f.data_ref().map_or(0, |d| d.len() as u64);
                self.seen = self.seen.saturating_add(n);
                if self.seen > expected {
                    return Some(Err(format!(
                        "upstream body longer than its content-length {expected}"
                    )
                    .into()));
                }
            }
            None if self.seen < expected => {
                return Some(Err(format!(
                    "upstream body ended after {} of its content-length {expected}",
                    self.seen
                )
                .into()));
            }
            _ => {}
        }
        frame
    }
}

impl http_body::Body for RelayBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                this.timer = None;
                let frame = this.check(frame);
                if let Some(Err(e)) = &frame {
                    tracing::debug!(target: "proxy", error = %e, "upstream body failed");
                }
                Poll::Ready(frame)
            }
            Poll::Pending => {
                let idle = this.idle;
                let timer = this
                    .timer
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(idle)));
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Some(Err("upstream body stalled".into()))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        // A short body must still be polled to its end, where the check fails it.
        self.inner.is_end_stream() && self.expected.is_none_or(|e| self.seen >= e)
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    /// A body of ready chunks.
    struct Chunks(std::collections::VecDeque<Bytes>);

    impl http_body::Body for Chunks {
        type Data = Bytes;
        type Error = BoxError;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            Poll::Ready(self.0.pop_front().map(|b| Ok(Frame::data(b))))
        }
    }

    fn body(chunks: &[&'static [u8]]) -> StreamBody {
        Chunks(chunks.iter().map(|c| Bytes::from_static(c)).collect()).boxed_unsync()
    }

    async fn collect(relay: RelayBody) -> Result<Vec<u8>, String> {
        let mut relay = relay;
        let mut out = Vec::new();
        while let Some(frame) = relay.frame().await {
            let frame = frame.map_err(|e| e.to_string())?;
            if let Some(d) = frame.data_ref() {
                out.extend_from_slice(d);
            }
        }
        Ok(out)
    }

    fn relay(chunks: &[&'static [u8]], expected: Option<u64>) -> RelayBody {
        RelayBody {
            inner: body(chunks),
            idle: Duration::from_secs(5),
            timer: None,
            expected,
            seen: 0,
        }
    }

    #[tokio::test]
    async fn relayed_lengths_are_checked() {
        assert_eq!(collect(relay(&[b"hel", b"lo"], Some(5))).await.unwrap(), b"hello");
        assert_eq!(collect(relay(&[b"hel", b"lo!"], None)).await.unwrap(), b"hello!");
        assert!(collect(relay(&[b"hel", b"lo!"], Some(5)))
            .await
            .unwrap_err()
            .contains("longer"));
        assert!(collect(relay(&[b"hel"], Some(5)))
            .await
            .unwrap_err()
            .contains("ended after 3"));
    }
}
