//! The response body every driver pulls from: a file read chunk by chunk through the
//! one [`FileCursor`], a body relayed frame by frame from an upstream, or bytes known
//! up front. hyper polls it as an `http_body::Body`; the h1 and h3 drivers drain it
//! through [`send_body`](super::send_body).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Frame, SizeHint};

use crate::files::cursor::{FileCursor, FileRange};
use crate::message::{Body, BoxError, StreamBody};

#[derive(Debug)]
pub(crate) struct ResponseBody {
    kind: Kind,
    /// Data bytes handed out so far.
    produced: u64,
}

enum Kind {
    Empty,
    Bytes(Option<Bytes>),
    File(FileCursor),
    /// From an upstream: data, trailers and errors pass through as they come.
    Relay(StreamBody),
}

impl std::fmt::Debug for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Kind::Empty => f.write_str("Empty"),
            Kind::Bytes(b) => write!(f, "Bytes({:?})", b.as_ref().map(Bytes::len)),
            Kind::File(cursor) => write!(f, "File({} left)", cursor.remaining()),
            Kind::Relay(_) => f.write_str("Relay"),
        }
    }
}

impl ResponseBody {
    /// File bodies are read `chunk` bytes at a time (see `files::cursor`).
    pub(crate) fn new(body: Body, chunk: usize) -> Self {
        let kind = match body {
            Body::Empty => Kind::Empty,
            Body::Bytes(b) => Kind::Bytes(Some(b)),
            Body::File(file) => Kind::File(FileCursor::new(file, chunk)),
            Body::Stream(stream) => Kind::Relay(stream),
        };
        Self { kind, produced: 0 }
    }

    pub(crate) fn empty() -> Self {
        Self::new(Body::Empty, 0)
    }

    /// Data bytes handed out so far.
    pub(crate) fn produced(&self) -> u64 {
        self.produced
    }

    /// Whether the length is the upstream's to decide (relayed bodies).
    pub(crate) fn is_relay(&self) -> bool {
        matches!(self.kind, Kind::Relay(_))
    }

    /// Whether a file body still has bytes to come (what a kernel TLS promotion
    /// pays for).
    pub(crate) fn has_file_left(&self) -> bool {
        matches!(&self.kind, Kind::File(cursor) if cursor.remaining() > 0)
    }

    /// The rest of the current file range, unread, for a driver that sends files by
    /// itself; counted as produced.
    pub(crate) fn take_file_range(&mut self) -> Option<FileRange> {
        let Kind::File(cursor) = &mut self.kind else {
            return None;
        };
        let range = cursor.take_file_range()?;
        self.produced += range.len;
        Some(range)
    }
}

impl http_body::Body for ResponseBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let polled = match &mut this.kind {
            Kind::Empty => Poll::Ready(None),
            Kind::Bytes(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            Kind::File(cursor) => cursor
                .poll_next(cx)
                .map(|next| next.map(|chunk| chunk.map(Frame::data).map_err(BoxError::from))),
            Kind::Relay(relay) => Pin::new(relay).poll_frame(cx),
        };
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            this.produced += frame.data_ref().map_or(0, |d| d.len() as u64);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Empty => true,
            Kind::Bytes(bytes) => bytes.is_none(),
            Kind::File(cursor) => cursor.remaining() == 0,
            Kind::Relay(relay) => relay.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Empty => SizeHint::with_exact(0),
            Kind::Bytes(bytes) => SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64)),
            Kind::File(cursor) => SizeHint::with_exact(cursor.remaining()),
            Kind::Relay(relay) => relay.size_hint(),
        }
    }
}
