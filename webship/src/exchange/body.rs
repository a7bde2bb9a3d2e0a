//! The response body every driver pulls from: a file read chunk by chunk through the
//! one [`FileCursor`], a body relayed frame by frame from an upstream, or bytes known
//! up front. hyper polls it as an `http_body::Body`; the h1 and h3 drivers drain it
//! through [`send_body`](super::send_body).
//!
//! A multiplexed body cannot see its stream's flow control: hyper polls it for the
//! next frame before it waits for send capacity, and keeps what it got until the
//! client grants some; h3 reads the next chunk while the previous one waits for stream
//! credit. So a [`ramped`](ResponseBody::ramped) file body grows its reads like a
//! congestion window: each read is at most what the client has already taken (the
//! bytes handed out before the chunk the driver still holds), between
//! [`RAMP_CHUNK_MIN`] and the driver's chunk. A stream whose client grants no window
//! holds two small chunks, not two large ones. A pulled body's stall is seen by its
//! connection through a [`PullClock`].
//!
//! HTTP/1.1 has no flow control to read, but its driver sees the socket: a body
//! [`sized_by_writer`](ResponseBody::sized_by_writer) reads what its writer says
//! before each read ([`set_next_read`](ResponseBody::set_next_read), from what left
//! the socket and what it takes now: `http::drain`), between [`RAMP_CHUNK_MIN`] and
//! the driver's chunk. A client that keeps up gets the full chunk; one that reads
//! slowly, or stopped, gets the smallest read, and a buffer that had grown is given
//! back (`FileCursor::set_chunk`).

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::{Frame, SizeHint};

use super::coalesce::Coalesced;
use super::record::{Outcome, Record};
use crate::files::cursor::{FileCursor, FileRange};
use crate::message::{Body, BoxError};

/// The smallest read of a ramped file body (one default HTTP/2 frame).
pub(crate) const RAMP_CHUNK_MIN: usize = 16 * 1024;

#[derive(Debug)]
pub(crate) struct ResponseBody {
    kind: Kind,
    /// Data bytes handed out so far.
    produced: u64,
    /// Bodies whose file reads are sized as they go (ramped for h2 and h3, sized by
    /// the writer for h1): how the next read is sized, the size of the chunk handed
    /// out last (still held by the driver until it pulls again), and the
    /// connection's clock if it watches.
    pull: Option<Pull>,
    /// The exchange this body answers, reported when the body is dropped.
    record: Option<Record>,
    /// The body's end was handed out (its last frame, or `None`).
    ended: bool,
    /// How the response ended, when the driver said so (the send loop does).
    verdict: Option<Outcome>,
}

#[derive(Debug)]
struct Pull {
    clock: Option<Arc<PullClock>>,
    max_chunk: usize,
    last: u64,
    /// Handed out a chunk and not pulled since: waiting on the client, counted in
    /// this slot of the clock.
    waiting: Option<usize>,
    gauge: Gauge,
}

/// What a ramped body's next read is sized by.
#[derive(Debug)]
enum Gauge {
    /// The bytes handed out before the chunk the driver still holds (h2, h3: their
    /// flow control decides when the driver pulls again).
    Handed,
    /// The read size the writer set (h1: `BodyWriter::next_read_size`); nothing
    /// set yet: the smallest.
    Reported(u64),
}

/// Slots of a [`PullClock`]: a generation's slot is reused `GENERATIONS` later.
const GENERATIONS: usize = 8;

/// How long a connection's pulled responses wait on the client. A response whose
/// chunk the driver holds without pulling again waits (for flow-control credit, or
/// for a socket the client stopped reading); when one of them has waited for
/// `send_timeout`, the client stalled it and the driver ends the connection, however
/// its other responses move (it cannot reset one stream from outside hyper).
///
/// Allocation-free and without a clock read per pull: time is cut into generations,
/// which the driver's check ([`stalled`](Self::stalled)) advances every
/// `send_timeout / (GENERATIONS - 2)` or more; a response that begins to wait counts
/// itself in the current generation's slot until it is pulled again or dropped. A
/// response counted in generation `g` began waiting before `g + 1` began, so it has
/// waited at least since then.
#[derive(Debug)]
pub(crate) struct PullClock {
    start: Instant,
    /// The current generation (only the check advances it).
    generation: AtomicUsize,
    /// Responses waiting on the client, by the generation they began waiting in.
    waiting: [AtomicUsize; GENERATIONS],
    /// Milliseconds from `start` to the beginning of each slot's generation.
    began_ms: [AtomicU64; GENERATIONS],
}

impl Default for PullClock {
    fn default() -> Self {
        Self {
            start: Instant::now(),
            generation: AtomicUsize::new(0),
            waiting: std::array::from_fn(|_| AtomicUsize::new(0)),
            began_ms: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl PullClock {
    fn elapsed_ms(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Whether some response has waited on the client for `limit` (the driver's one
    /// periodic check; it advances the generations).
    pub(crate) fn stalled(&self, limit: Duration) -> bool {
        let limit = u64::try_from(limit.as_millis()).unwrap_or(u64::MAX);
        let now = self.elapsed_ms();
        let mut current = self.generation.load(Ordering::Acquire);
        let began = |g: usize| self.began_ms[g % GENERATIONS].load(Ordering::Acquire);
        if now.saturating_sub(began(current)) >= limit / (GENERATIONS as u64 - 2) {
            let next = current.wrapping_add(1);
            // The slot to reuse holds responses that have waited for at least
            // `GENERATIONS - 2` steps of `limit / (GENERATIONS - 2)`.
            if self.waiting[next % GENERATIONS].load(Ordering::Acquire) > 0 {
                return true;
            }
            self.began_ms[next % GENERATIONS].store(now, Ordering::Release);
            self.generation.store(next, Ordering::Release);
            current = next;
        }
        (1..GENERATIONS).any(|back| {
            let g = current.wrapping_sub(back);
            self.waiting[g % GENERATIONS].load(Ordering::Acquire) > 0
                && now.saturating_sub(began(g.wrapping_add(1))) >= limit
        })
    }
}

impl Pull {
    fn set_waiting(&mut self, waiting: bool) {
        let Some(clock) = &self.clock else {
            return;
        };
        match (self.waiting, waiting) {
            (None, true) => {
                let slot = clock.generation.load(Ordering::Acquire) % GENERATIONS;
                clock.waiting[slot].fetch_add(1, Ordering::AcqRel);
                self.waiting = Some(slot);
            }
            (Some(slot), false) => {
                clock.waiting[slot].fetch_sub(1, Ordering::AcqRel);
                self.waiting = None;
            }
            _ => {}
        }
    }
}

impl Drop for Pull {
    fn drop(&mut self) {
        self.set_waiting(false);
    }
}

enum Kind {
    Empty,
    Bytes(Option<Bytes>),
    File(FileCursor),
    /// From an upstream: data, trailers and errors pass through in order, the data
    /// chunks already there handed out together.
    Relay(Coalesced),
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
            Body::Stream(stream) => Kind::Relay(Coalesced::new(stream)),
        };
        Self {
            kind,
            produced: 0,
            pull: None,
            record: None,
            ended: false,
            verdict: None,
        }
    }

    /// This body answers `record`'s exchange: reported (bytes, timing, how it ended)
    /// when the body is dropped.
    pub(crate) fn recorded(mut self, record: Record) -> Self {
        self.record = Some(record);
        self
    }

    /// How the response ended, as the driver saw it (see [`Outcome`]); without a
    /// verdict a body is complete only if its end was handed out.
    pub(crate) fn settle(&mut self, outcome: Outcome) {
        self.verdict = Some(outcome);
    }

    /// The response's bytes go through kernel TLS.
    pub(crate) fn set_ktls(&mut self) {
        if let Some(record) = &mut self.record {
            record.set_ktls();
        }
    }

    /// How the response ended, by the driver's verdict or by what was handed out.
    fn outcome(&self) -> Outcome {
        match self.verdict {
            Some(outcome) => outcome,
            None if self.ended || http_body::Body::is_end_stream(self) => Outcome::Complete,
            None => Outcome::Unfinished,
        }
    }

    /// A body of a multiplexed stream (h2, h3): file reads ramp up from
    /// [`RAMP_CHUNK_MIN`] to `chunk` as the client takes bytes.
    pub(crate) fn ramped(body: Body, chunk: usize) -> Self {
        Self::ramp(body, chunk, Gauge::Handed)
    }

    /// A body whose writer sizes each file read ([`set_next_read`](Self::set_next_read),
    /// from `BodyWriter::next_read_size`), within [`RAMP_CHUNK_MIN`] and `chunk`;
    /// [`RAMP_CHUNK_MIN`] until it says.
    pub(crate) fn sized_by_writer(body: Body, chunk: usize) -> Self {
        Self::ramp(body, chunk, Gauge::Reported(0))
    }

    fn ramp(body: Body, chunk: usize, gauge: Gauge) -> Self {
        let mut this = Self::new(body, chunk);
        this.pull = Some(Pull {
            clock: None,
            max_chunk: chunk,
            last: 0,
            waiting: None,
            gauge,
        });
        this
    }

    /// The next reads of a body [`sized_by_writer`](Self::sized_by_writer) are
    /// `bytes` (within its bounds). Other bodies ignore it.
    pub(crate) fn set_next_read(&mut self, bytes: u64) {
        if let Some(Pull {
            gauge: Gauge::Reported(read),
            ..
        }) = &mut self.pull
        {
            *read = bytes;
        }
    }

    /// Whether the next frame is a file read its writer sizes
    /// ([`set_next_read`](Self::set_next_read)).
    pub(crate) fn reads_at_writers_size(&self) -> bool {
        matches!(
            self.pull,
            Some(Pull {
                gauge: Gauge::Reported(_),
                ..
            })
        ) && self.has_file_left()
    }

    /// A ramped body a driver pulls by itself (hyper): `clock` sees whether it moves.
    pub(crate) fn pulled(body: Body, chunk: usize, clock: Arc<PullClock>) -> Self {
        let mut this = Self::ramped(body, chunk);
        if let Some(pull) = &mut this.pull {
            pull.clock = Some(clock);
        }
        this
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
        if let Some(record) = &mut self.record {
            record.pulled();
        }
        Some(range)
    }

    /// `bytes` of a file range taken by [`take_file_range`](Self::take_file_range)
    /// were not sent after all (the write failed): the record counts what went.
    pub(crate) fn not_sent(&mut self, bytes: u64) {
        self.produced = self.produced.saturating_sub(bytes);
    }

    /// `sent` body bytes are out: a range taken by [`Self::take_file_range`] is
    /// produced at once but sent piece by piece, and its sender says how far it got.
    pub(crate) fn sent(&self, sent: u64) {
        if let Some(record) = &self.record {
            record.progress(sent);
        }
    }
}

impl Drop for ResponseBody {
    fn drop(&mut self) {
        if let Some(record) = self.record.take() {
            record.finish(self.produced, self.outcome());
        }
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
        if let Some(record) = &mut this.record {
            record.pulled();
        }
        if let Some(pull) = &mut this.pull {
            // Pulled again: everything but the chunk the driver held until now has
            // been taken by the client (within its window), so the next read may be
            // that large.
            pull.set_waiting(false);
            if let Kind::File(cursor) = &mut this.kind {
                let allowed = match &mut pull.gauge {
                    Gauge::Handed => this.produced - pull.last,
                    Gauge::Reported(read) => *read,
                };
                let chunk = usize::try_from(allowed).unwrap_or(usize::MAX);
                cursor.set_chunk(chunk.clamp(RAMP_CHUNK_MIN.min(pull.max_chunk), pull.max_chunk));
            }
        }
        let polled = match &mut this.kind {
            Kind::Empty => Poll::Ready(None),
            Kind::Bytes(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            Kind::File(cursor) => cursor
                .poll_next(cx)
                .map(|next| next.map(|chunk| chunk.map(Frame::data).map_err(BoxError::from))),
            Kind::Relay(relay) => Pin::new(relay).poll_frame(cx),
        };
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                let len = frame.data_ref().map_or(0, |d| d.len() as u64);
                this.produced += len;
                if let Some(record) = &this.record {
                    record.progress(this.produced);
                }
                // Trailers are the last frame.
                this.ended |= frame.is_trailers();
                if let Some(pull) = &mut this.pull {
                    pull.last = len;
                    pull.set_waiting(len > 0);
                }
            }
            Poll::Ready(None) => this.ended = true,
            Poll::Ready(Some(Err(_))) => this.verdict = Some(Outcome::BodyError),
            Poll::Pending => {}
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::{FileBody, Segment};
    use http_body_util::BodyExt;

    fn file_body(len: usize) -> (tempfile::TempDir, Body) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, vec![9u8; len]).unwrap();
        let body = Body::File(FileBody {
            file: Arc::new(std::fs::File::open(&path).unwrap()),
            segments: vec![Segment::File {
                offset: 0,
                len: len as u64,
            }],
            len: len as u64,
        });
        (dir, body)
    }

    #[tokio::test]
    async fn ramped_reads_grow_with_what_the_client_took() {
        let (_dir, body) = file_body(1 << 20);
        let mut body = ResponseBody::ramped(body, 128 * 1024);
        let mut sizes = Vec::new();
        while let Some(frame) = body.frame().await {
            sizes.push(frame.unwrap().into_data().unwrap().len() / 1024);
        }
        // Each read is at most what was handed out before the chunk still held.
        assert_eq!(sizes[..7], [16, 16, 16, 32, 48, 80, 128], "{sizes:?}");
        assert_eq!(sizes.iter().sum::<usize>(), 1024);
    }

    #[tokio::test]
    async fn reads_sized_by_the_writer_follow_it() {
        let (_dir, body) = file_body(4 << 20);
        let mut body = ResponseBody::sized_by_writer(body, 256 * 1024);
        // The KiB of the next read after `size` was set (if it was).
        let mut next = async |size: Option<u64>| {
            if let Some(size) = size {
                body.set_next_read(size);
            }
            body.frame().await.unwrap().unwrap().into_data().unwrap().len() / 1024
        };
        // Nothing reported yet: the smallest read.
        assert_eq!(next(None).await, 16);
        assert_eq!(next(Some(40 << 10)).await, 40);
        // A report holds until the next one, within the smallest and the chunk.
        assert_eq!(next(None).await, 40);
        assert_eq!(next(Some(8 << 20)).await, 256);
        assert_eq!(next(Some(0)).await, 16);
    }

    /// A relayed body that yields one chunk, then fails.
    struct Failing(u8);

    impl http_body::Body for Failing {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            self.0 += 1;
            Poll::Ready(Some(match self.0 {
                1 => Ok(Frame::data(Bytes::from_static(b"abc"))),
                _ => Err("upstream reset".into()),
            }))
        }
    }

    fn failing_relay() -> Body {
        Body::Stream(Failing(0).boxed_unsync())
    }

    #[tokio::test]
    async fn a_body_is_complete_only_when_its_end_was_handed_out() {
        let (_dir, file) = file_body(1 << 20);
        let mut body = ResponseBody::ramped(file, 128 * 1024);
        assert_eq!(body.outcome(), Outcome::Unfinished, "nothing handed out yet");
        let _first = body.frame().await.unwrap().unwrap();
        assert_eq!(body.outcome(), Outcome::Unfinished, "dropped halfway");
        while body.frame().await.is_some() {}
        assert_eq!(body.outcome(), Outcome::Complete);
        assert_eq!(body.produced(), 1 << 20);

        // An empty body (HEAD, 304) has nothing to hand out: complete as it is.
        assert_eq!(ResponseBody::empty().outcome(), Outcome::Complete);
    }

    #[tokio::test]
    async fn a_failed_body_or_the_drivers_verdict_decides_the_outcome() {
        let mut body = ResponseBody::new(failing_relay(), 128 * 1024);
        assert_eq!(body.frame().await.unwrap().unwrap().into_data().unwrap(), "abc");
        assert!(body.frame().await.unwrap().is_err());
        assert_eq!(body.outcome(), Outcome::BodyError);

        // The send loop's verdict wins over what was handed out.
        let mut body = ResponseBody::new(Body::Bytes(Bytes::from_static(b"x")), 1024);
        while body.frame().await.is_some() {}
        body.settle(Outcome::ClientGone);
        assert_eq!(body.outcome(), Outcome::ClientGone);
    }

    #[tokio::test]
    async fn a_clock_sees_a_body_waiting_on_its_client() {
        let (_dir, body) = file_body(1 << 20);
        let clock = Arc::new(PullClock::default());
        let mut body = ResponseBody::pulled(body, 128 * 1024, clock.clone());
        assert!(!clock.stalled(Duration::ZERO), "nothing handed out yet");
        let _chunk = body.frame().await.unwrap().unwrap();
        // Handed out and not pulled since: waiting on the client.
        assert!(clock.stalled(Duration::ZERO));
        assert!(!clock.stalled(Duration::from_secs(60)), "not for that long");
        drop(body);
        assert!(!clock.stalled(Duration::ZERO), "a dropped body waits for nothing");
    }

    #[tokio::test]
    async fn a_moving_body_does_not_hide_a_stalled_one() {
        let (_dir, stalled) = file_body(1 << 20);
        let clock = Arc::new(PullClock::default());
        let mut stalled = ResponseBody::pulled(stalled, 128 * 1024, clock.clone());
        let limit = Duration::from_millis(120);
        let _held = stalled.frame().await.unwrap().unwrap();
        let waiting = Instant::now();
        let mut seen = None;
        // A small response is pulled to its end every 10 ms; the stalled one never
        // again.
        for _ in 0..200 {
            let small = Body::Bytes(Bytes::from_static(b"x"));
            let mut small = ResponseBody::pulled(small, 128 * 1024, clock.clone());
            while small.frame().await.is_some() {}
            if clock.stalled(limit) {
                seen = Some(waiting.elapsed());
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let seen = seen.expect("a body waiting past the limit is seen");
        assert!(seen >= limit, "seen after {seen:?}, before the limit");
        drop(stalled);
        assert!(!clock.stalled(limit), "nothing waits any more");
    }
}
