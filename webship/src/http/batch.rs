//! A bounded write batch in front of a TLS stream.
//!
//! HTTP/2 writes a 9-byte frame header and then its payload; passed straight to rustls
//! each would become its own TLS record and its own `write(2)`. Collecting writes here
//! until a flush (or until the batch is full) turns them into full 16 KiB records and
//! few syscalls. The batch is the connection's only write-side buffer ahead of rustls,
//! so it is also the bound: never more than `capacity` bytes wait here.
//!
//! The h2 crate flushes after every DATA frame (its encoder holds one frame, and making
//! room for the next is a flush). Draining on each of those would send every 16 KiB
//! frame as its own `writev` of a full TLS record plus a 9-byte one carrying the next
//! frame's header: measured on a 100 MB download, 6,099 writes of 16,437 bytes where
//! h2o makes 1,217 of five full records, and the client pays for every tiny record.
//! So a flush that follows new writes is deferred once: the batch keeps the bytes and
//! wakes the connection's task, and the next flush with no write since — which the h2
//! crate issues when it has nothing more to send in this turn — drains for real.
//! Progress never depends on more data arriving.

use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::metrics::{Collector, Encoder, Kind, Values};

/// What each hand-over to TLS carried, in bytes: its count is the batches written,
/// its sum their bytes (one observation per drained batch, none per frame).
static WRITES: Values = Values::new(
    &[
        1024, 4096, 16_384, 32_768, 65_536, 131_072, 262_144, 524_288, 1_048_576,
    ],
    1.0,
);

#[derive(Debug)]
pub(crate) struct WriteBatch<S> {
    inner: S,
    buf: Vec<u8>,
    /// Bytes of `buf` already handed to `inner`.
    written: usize,
    capacity: usize,
    /// Bytes were batched since the last flush: the next flush is deferred once.
    wrote_since_flush: bool,
}

/// A drain smaller than this (a PING, SETTINGS or WINDOW_UPDATE, the tail of a
/// response) gives a buffer larger than [`KEEP`] back: the connection is not
/// streaming, and an idle one should hold no batch.
const SMALL_DRAIN: usize = 1024;
/// What a buffer may keep between small drains.
const KEEP: usize = 4 * 1024;

impl<S> WriteBatch<S> {
    /// The buffer grows to `capacity` on first use (it was allocated whole up front:
    /// 128 KiB of address space and a mapping per connection, idle or not).
    pub(crate) fn new(inner: S, capacity: usize) -> Self {
        Self {
            inner,
            buf: Vec::new(),
            written: 0,
            capacity,
            wrote_since_flush: false,
        }
    }
}

impl<S: AsyncWrite + Unpin> WriteBatch<S> {
    /// Hands everything batched to `inner`.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.buf.is_empty() {
            return Poll::Ready(Ok(()));
        }
        while self.written < self.buf.len() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.buf[self.written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
        }
        WRITES.observe(self.buf.len() as u64);
        if self.written < SMALL_DRAIN && self.buf.capacity() > KEEP {
            self.buf = Vec::new();
        }
        self.buf.clear();
        self.written = 0;
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteBatch<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if this.buf.len() + data.len() > this.capacity {
            ready!(this.poll_drain(cx))?;
            if data.len() >= this.capacity {
                let n = ready!(Pin::new(&mut this.inner).poll_write(cx, data))?;
                WRITES.observe(n as u64);
                return Poll::Ready(Ok(n));
            }
        }
        this.buf.extend_from_slice(data);
        this.wrote_since_flush |= !data.is_empty();
        Poll::Ready(Ok(data.len()))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if this.buf.len() + total > this.capacity && !this.buf.is_empty() {
            ready!(this.poll_drain(cx))?;
        }
        let mut taken = 0;
        for b in bufs {
            let room = this.capacity.saturating_sub(this.buf.len());
            if room == 0 {
                break;
            }
            let n = b.len().min(room);
            this.buf.extend_from_slice(&b[..n]);
            taken += n;
            if n < b.len() {
                break;
            }
        }
        this.wrote_since_flush |= taken > 0;
        Poll::Ready(Ok(taken))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if std::mem::take(&mut this.wrote_since_flush) {
            // Deferred (see the module notes): the task is polled again at once, and a
            // flush with no write in between drains.
            cx.waker().wake_by_ref();
            return Poll::Ready(Ok(()));
        }
        ready!(this.poll_drain(cx))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_drain(cx))?;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The HTTP/2 write batches as a metric family, read at scrape time.
#[derive(Debug)]
pub(crate) struct Metrics;

impl Collector for Metrics {
    fn collect(&self, out: &mut Encoder) {
        out.family(
            "webship_h2_write_batch_bytes",
            Kind::Histogram,
            "HTTP/2 write batches handed to TLS, by size in bytes (count: writes, sum: bytes).",
        );
        WRITES.write(out, &[]);
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteBatch<S> {
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
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// Records every write it receives.
    #[derive(Default)]
    struct Recorder {
        writes: Vec<usize>,
        flushed: usize,
    }

    impl AsyncWrite for Recorder {
        fn poll_write(mut self: Pin<&mut Self>, _: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
            self.writes.push(data.len());
            Poll::Ready(Ok(data.len()))
        }
        fn poll_flush(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            self.flushed += 1;
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn small_writes_become_one_until_flush() {
        let mut w = WriteBatch::new(Recorder::default(), 1024);
        for _ in 0..10 {
            w.write_all(&[0; 9]).await.unwrap();
            w.write_all(&[1; 50]).await.unwrap();
        }
        assert!(w.inner.writes.is_empty());
        // The first flush after writes is deferred; the next one drains.
        w.flush().await.unwrap();
        assert!(w.inner.writes.is_empty());
        w.flush().await.unwrap();
        assert_eq!(w.inner.writes, vec![590]);
        assert_eq!(w.inner.flushed, 1);
    }

    /// What the h2 crate does per DATA frame: a vectored write of the 9-byte header
    /// and the payload, then a flush. Frames join until the batch is full or a flush
    /// comes with nothing written before it.
    #[tokio::test]
    async fn frames_flushed_one_by_one_still_leave_in_batches() {
        let mut w = WriteBatch::new(Recorder::default(), 64 * 1024);
        let payload = [7u8; 16 * 1024];
        for _ in 0..8 {
            let frame = [IoSlice::new(&[0; 9]), IoSlice::new(&payload)];
            // A frame always fits once a full batch has drained.
            assert_eq!(w.write_vectored(&frame).await.unwrap(), 9 + payload.len());
            w.flush().await.unwrap();
        }
        // Eight frames of 16,393 bytes: full batches drained on the way, none per frame.
        assert!(w.inner.writes.len() <= 3, "{:?}", w.inner.writes);
        assert_eq!(w.inner.flushed, 0);
        w.flush().await.unwrap();
        assert_eq!(w.inner.writes.iter().sum::<usize>(), 8 * (9 + 16 * 1024));
        assert_eq!(w.inner.flushed, 1);
        assert!(w.buf.is_empty());
    }

    /// A deferred flush wakes its task, so a caller that waits for nothing else
    /// still gets its bytes drained on the next poll.
    #[tokio::test]
    async fn a_deferred_flush_wakes_the_task() {
        let mut w = WriteBatch::new(Recorder::default(), 1024);
        w.write_all(b"GOAWAY").await.unwrap();
        let waker = std::sync::Arc::new(Counted::default());
        let waker_ref = std::task::Waker::from(waker.clone());
        let mut cx = Context::from_waker(&waker_ref);
        assert!(Pin::new(&mut w).poll_flush(&mut cx).is_ready());
        assert_eq!(waker.wakes.load(std::sync::atomic::Ordering::Relaxed), 1);
        assert!(w.inner.writes.is_empty());
        assert!(Pin::new(&mut w).poll_flush(&mut cx).is_ready());
        assert_eq!(w.inner.writes, vec![6]);
    }

    #[derive(Default)]
    struct Counted {
        wakes: std::sync::atomic::AtomicUsize,
    }

    impl std::task::Wake for Counted {
        fn wake(self: std::sync::Arc<Self>) {
            self.wakes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    #[tokio::test]
    async fn never_holds_more_than_capacity() {
        let mut w = WriteBatch::new(Recorder::default(), 100);
        w.write_all(&[0; 60]).await.unwrap();
        w.write_all(&[0; 60]).await.unwrap();
        assert_eq!(w.inner.writes, vec![60]);
        assert!(w.buf.len() <= 100);
        w.write_all(&[0; 500]).await.unwrap();
        assert_eq!(w.inner.writes, vec![60, 60, 500]);
        let slices = [IoSlice::new(&[1; 70]), IoSlice::new(&[2; 70])];
        let n = w.write_vectored(&slices).await.unwrap();
        assert_eq!(n, 100);
        assert!(w.buf.len() <= 100);
    }
}
