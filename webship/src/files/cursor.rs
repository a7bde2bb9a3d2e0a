//! Reads a [`FileBody`] out chunk by chunk: the one file reader of every protocol
//! driver (h1 writes each chunk through rustls, h2 and h3 hand it to their framing).
//!
//! One buffer per response: each chunk is split off it and frozen, and once the
//! driver drops the chunk the next chunk reuses the same allocation: h1 once it is
//! written, h2 once it is framed and encrypted, h3 only once the client acknowledged
//! it (quinn holds the chunk until then). A driver that still holds a chunk makes the
//! next one allocate, so the bound is the driver's: one chunk for h1 (written before
//! the next is read), for h2 what its flow control lets wait per stream plus one
//! chunk, and for h3 the unacknowledged chunks (the send window) plus one.
//!
//! Bytes already in the page cache are read on the reactor thread without blocking
//! (`RWF_NOWAIT`); only a miss goes to the blocking pool, so a slow disk never stalls
//! a reactor. A file that got shorter since it was opened is an error: the promised
//! length cannot be met, and the driver must end the response as incomplete.

use std::fs::File;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::{Bytes, BytesMut};
use tokio::task::JoinHandle;

use crate::message::{FileBody, Segment};

/// Chunk size for HTTP/1.1, where one connection carries one response at a time and
/// larger writes mean fewer records and syscalls (measured: docs/benchmarks.md).
pub(crate) const H1_CHUNK: usize = 256 * 1024;
/// Chunk size for multiplexed protocols (h2, h3): each stream holds at most about two
/// of these, so many concurrent streams stay cheap.
pub(crate) const STREAM_CHUNK: usize = 128 * 1024;

/// Part of a file, handed to a driver that sends it without reading it (sendfile).
#[derive(Debug)]
pub(crate) struct FileRange {
    pub(crate) file: Arc<File>,
    pub(crate) offset: u64,
    pub(crate) len: u64,
}

/// The read position in a [`FileBody`].
#[derive(Debug)]
pub(crate) struct FileCursor {
    file: Arc<File>,
    segments: std::vec::IntoIter<Segment>,
    /// The file segment being read: next offset and end.
    current: Option<(u64, u64)>,
    /// Bytes not yet handed out.
    remaining: u64,
    chunk: usize,
    buf: BytesMut,
    /// The largest read into `buf`'s allocation (what it holds, roughly).
    held: usize,
    /// A read the page cache could not complete, on the blocking pool.
    pending: Option<JoinHandle<io::Result<BytesMut>>>,
}

impl FileCursor {
    pub(crate) fn new(body: FileBody, chunk: usize) -> Self {
        Self {
            file: body.file,
            segments: body.segments.into_iter(),
            current: None,
            remaining: body.len,
            chunk,
            buf: BytesMut::new(),
            held: 0,
            pending: None,
        }
    }

    /// The size of the reads from now on (a ramped body follows the bytes its
    /// client takes).
    pub(crate) fn set_chunk(&mut self, chunk: usize) {
        let chunk = chunk.max(1);
        // Far smaller reads from now on: the client stopped taking bytes, and the
        // large buffer goes back to the allocator instead of waiting with it.
        if chunk <= self.held / 4 {
            self.buf = BytesMut::new();
            self.held = 0;
        }
        self.chunk = chunk;
    }

    /// Bytes not yet handed out.
    pub(crate) fn remaining(&self) -> u64 {
        self.remaining
    }

    /// The next chunk: literal bytes or file bytes, at most `chunk` long. `None` once
    /// everything was handed out.
    pub(crate) fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<io::Result<Bytes>>> {
        if let Some(pending) = self.pending.as_mut() {
            let done = ready!(Pin::new(pending).poll(cx));
            self.pending = None;
            return Poll::Ready(Some(done.map_err(io::Error::other).and_then(|r| r).map(|buf| {
                // A `set_chunk` while the read was away saw no buffer to free: this
                // one counts from now on.
                self.held = self.held.max(buf.capacity());
                self.buf = buf;
                self.hand_out()
            })));
        }
        loop {
            let Some((at, end)) = self.current else {
                match self.segments.next() {
                    None => return Poll::Ready(None),
                    Some(Segment::Bytes(bytes)) => {
                        self.remaining -= bytes.len() as u64;
                        return Poll::Ready(Some(Ok(bytes)));
                    }
                    Some(Segment::File { offset, len }) => {
                        self.current = (len > 0).then_some((offset, offset + len));
                        continue;
                    }
                }
            };
            let n = usize::try_from(end - at).map_or(self.chunk, |left| left.min(self.chunk));
            let next = at + n as u64;
            self.current = (next < end).then_some((next, end));
            self.buf.clear();
            // Takes the previous chunk's allocation back when the driver dropped it.
            self.buf.reserve(n);
            self.held = self.held.max(n);
            let filled = match fill(&self.file, &mut self.buf, n, at, true) {
                Ok(filled) => filled,
                Err(e) => return Poll::Ready(Some(Err(e))),
            };
            if filled == n {
                return Poll::Ready(Some(Ok(self.hand_out())));
            }
            let (file, mut buf) = (self.file.clone(), std::mem::take(&mut self.buf));
            self.pending = Some(tokio::task::spawn_blocking(move || {
                let more = fill(&file, &mut buf, n - filled, at + filled as u64, false)?;
                debug_assert_eq!(more, n - filled);
                Ok(buf)
            }));
            return self.poll_next(cx);
        }
    }

    /// The rest of the file segment at the read position, handed over unread, for a
    /// driver that sends files by itself (h1 after a kernel TLS promotion). `None`
    /// when literal bytes come next, nothing is left, or a read is in flight.
    pub(crate) fn take_file_range(&mut self) -> Option<FileRange> {
        if self.pending.is_some() {
            return None;
        }
        if self.current.is_none() {
            if let Some(Segment::File { .. }) = self.segments.as_slice().first() {
                if let Some(Segment::File { offset, len }) = self.segments.next() {
                    self.current = Some((offset, offset + len));
                }
            }
        }
        let (offset, end) = self.current.take()?;
        self.remaining -= end - offset;
        Some(FileRange {
            file: self.file.clone(),
            offset,
            len: end - offset,
        })
    }

    fn hand_out(&mut self) -> Bytes {
        let chunk = self.buf.split().freeze();
        self.remaining -= chunk.len() as u64;
        chunk
    }
}

impl Drop for FileCursor {
    fn drop(&mut self) {
        // A cancelled response must not leave a read running for nobody.
        if let Some(pending) = self.pending.take() {
            pending.abort();
        }
    }
}

/// Appends `want` bytes of `file` at `offset` to `buf`; with `nowait`, stops at the
/// first page-cache miss. Returns how many were appended. End of file before `want`
/// is the shrunk-file error.
fn fill(file: &File, buf: &mut BytesMut, want: usize, offset: u64, nowait: bool) -> io::Result<usize> {
    let mut filled = 0;
    while filled < want {
        match crate::sys::pread_append(file, buf, want - filled, offset + filled as u64, nowait) {
            Ok(0) => return Err(shrank()),
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

fn shrank() -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "file shrank while it was being sent",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(path: &std::path::Path, segments: Vec<Segment>) -> FileBody {
        let len = segments
            .iter()
            .map(|s| match s {
                Segment::Bytes(b) => b.len() as u64,
                Segment::File { len, .. } => *len,
            })
            .sum();
        FileBody {
            file: Arc::new(File::open(path).unwrap()),
            segments,
            len,
        }
    }

    impl FileCursor {
        async fn next(&mut self) -> Option<io::Result<Bytes>> {
            std::future::poll_fn(|cx| self.poll_next(cx)).await
        }
    }

    #[tokio::test]
    async fn a_far_smaller_chunk_lets_go_of_a_grown_buffer() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let data: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let len = data.len() as u64;
        let mut cursor = FileCursor::new(body(&path, vec![Segment::File { offset: 0, len }]), 256 * 1024);
        let first = cursor.next().await.unwrap().unwrap();
        assert_eq!(first.len(), 256 * 1024);
        assert!(
            !first.is_unique(),
            "the cursor keeps the buffer for its next read"
        );
        cursor.set_chunk(128 * 1024);
        assert!(
            !first.is_unique(),
            "a read half as large still fits the buffer: kept"
        );
        cursor.set_chunk(16 * 1024);
        assert!(
            first.is_unique(),
            "reads a sixteenth as large: the cursor let go of it"
        );
        let next = cursor.next().await.unwrap().unwrap();
        assert_eq!(&next[..], &data[256 * 1024..272 * 1024]);
        drop(first);
        let rest = drain(&mut cursor).await.unwrap();
        assert_eq!(&rest[..], &data[272 * 1024..]);
    }

    async fn drain(cursor: &mut FileCursor) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        while let Some(chunk) = cursor.next().await {
            out.extend_from_slice(&chunk?);
        }
        Ok(out)
    }

    #[tokio::test]
    async fn segments_come_back_exact_in_chunks() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let segments = vec![
            Segment::Bytes(Bytes::from_static(b"<head>")),
            Segment::File {
                offset: 1_000,
                len: 50_000,
            },
            Segment::File {
                offset: 99_990,
                len: 10,
            },
            Segment::File { offset: 5, len: 0 },
        ];
        let mut cursor = FileCursor::new(body(&path, segments), 4096);
        let mut want = b"<head>".to_vec();
        want.extend_from_slice(&data[1_000..51_000]);
        want.extend_from_slice(&data[99_990..]);
        assert_eq!(drain(&mut cursor).await.unwrap(), want);
        assert_eq!(cursor.remaining(), 0);
    }

    #[tokio::test]
    async fn a_shrunken_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, vec![7u8; 10_000]).unwrap();
        let mut cursor = FileCursor::new(
            body(
                &path,
                vec![Segment::File {
                    offset: 0,
                    len: 20_000,
                }],
            ),
            4096,
        );
        let err = drain(&mut cursor).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }

    #[tokio::test]
    async fn file_ranges_are_handed_over_unread() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, vec![1u8; 10_000]).unwrap();
        let segments = vec![
            Segment::File {
                offset: 0,
                len: 6_000,
            },
            Segment::Bytes(Bytes::from_static(b"--")),
            Segment::File { offset: 100, len: 50 },
        ];
        let mut cursor = FileCursor::new(body(&path, segments), 4096);
        assert_eq!(cursor.next().await.unwrap().unwrap().len(), 4096);
        let range = cursor.take_file_range().unwrap();
        assert_eq!((range.offset, range.len), (4096, 6_000 - 4096));
        assert!(cursor.take_file_range().is_none(), "literal bytes come next");
        assert_eq!(&cursor.next().await.unwrap().unwrap()[..], b"--");
        let range = cursor.take_file_range().unwrap();
        assert_eq!((range.offset, range.len), (100, 50));
        assert_eq!(cursor.remaining(), 0);
        assert!(cursor.next().await.is_none());
    }
}
