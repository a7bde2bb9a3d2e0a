//! Where access log lines go: a bounded queue that reactor threads push finished
//! lines into without ever waiting, and one writer thread that takes them in
//! batches and writes them to the file (or standard error).
//!
//! When the queue is full the line is dropped and counted — a slow disk or a full
//! pipe must never stall responses; the writer warns with the count at most every
//! ten seconds. The file is opened at start (as root, before the switch to the
//! service account) and handed to the service account; `reopen` (SIGUSR1, after
//! logrotate moved the file) opens the path again as the service account and hands
//! the new file to the writer, which switches before its next write. A reopen that
//! fails keeps the old file.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Lines the queue holds (about 4 MiB of typical lines): a second of a busy
/// server's requests while the disk hiccups.
pub(crate) const QUEUE_LINES: usize = 16_384;
/// Bytes the queue holds at most, whatever the lines' sizes: a client can make one
/// line large (a 32 KiB User-Agent of bytes the formats escape to four or six each),
/// and 16,384 of those must not become gigabytes while the writer is behind.
pub(crate) const QUEUE_BYTES: usize = 16 * 1024 * 1024;
/// Lines the writer takes off the queue for one batch.
const BATCH_LINES: usize = 1024;
/// The largest single write to standard error: PIPE_BUF, so a pipe or the journal's
/// stream never interleaves a line with the daemon's own log lines.
const STDERR_WRITE: usize = 4096;
/// The largest single write to a file.
const FILE_WRITE: usize = 256 * 1024;
/// After a batch that did not fill, how long the writer lets lines gather before it
/// looks again: under load it then takes hundreds of lines per `write`, and a
/// thread serving a request seldom has to wake it (a wake is a futex call and a
/// context switch per line; measured, that was most of the log's cost). Lines reach
/// the file this much later at most.
const GATHER: Duration = Duration::from_millis(25);
/// How often the writer looks for a reopened file and reports drops when idle.
const TICK: Duration = Duration::from_secs(1);
/// At most one warning about dropped lines or failed writes this often.
const WARN_EVERY: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum AccessLogError {
    #[error(
        "access log `{path}`: {source} (fix: make its folder writable by the account that opens it, or change `[log] access_path`)"
    )]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("access log `{path}` is not a regular file (fix: point `[log] access_path` at a file)")]
    NotAFile { path: PathBuf },
    #[error("the access log writer thread cannot start: {0}")]
    Thread(io::Error),
}

/// Where lines are written.
#[derive(Debug)]
enum Destination {
    Stderr,
    File(File),
}

impl Destination {
    fn write_batch(&mut self, batch: &[u8]) -> io::Result<()> {
        let limit = match self {
            Destination::Stderr => STDERR_WRITE,
            Destination::File(_) => FILE_WRITE,
        };
        let mut rest = batch;
        while !rest.is_empty() {
            let n = chunk(rest, limit);
            let (now, later) = rest.split_at(n);
            match self {
                Destination::Stderr => io::stderr().lock().write_all(now)?,
                Destination::File(f) => f.write_all(now)?,
            }
            rest = later;
        }
        Ok(())
    }
}

/// How much of `batch` to write at once: whole lines up to `limit` bytes (a longer
/// line alone).
fn chunk(batch: &[u8], limit: usize) -> usize {
    if batch.len() <= limit {
        return batch.len();
    }
    match batch[..limit].iter().rposition(|&b| b == b'\n') {
        Some(end) => end + 1,
        None => batch
            .iter()
            .position(|&b| b == b'\n')
            .map_or(batch.len(), |end| end + 1),
    }
}

/// Opens `path` for appending: created `0640` if missing, never through a symbolic
/// link (root opens it), never blocking on a FIFO, and only a regular file.
fn open(path: &Path) -> Result<File, AccessLogError> {
    let opened = {
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .append(true)
                .create(true)
                .mode(0o640)
                .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY)
                .open(path)
        }
        #[cfg(not(unix))]
        {
            std::fs::OpenOptions::new().append(true).create(true).open(path)
        }
    };
    let file = opened.map_err(|source| AccessLogError::Open {
        path: path.to_owned(),
        source,
    })?;
    let regular = file.metadata().map(|m| m.is_file()).unwrap_or(false);
    if !regular {
        return Err(AccessLogError::NotAFile {
            path: path.to_owned(),
        });
    }
    crate::sys::file::set_blocking(&file).map_err(|source| AccessLogError::Open {
        path: path.to_owned(),
        source,
    })?;
    Ok(file)
}

/// The queue's sending side and what the writer shares with the rest of the daemon:
/// one per process, kept across reloads.
#[derive(Debug)]
pub(crate) struct Sink {
    tx: SyncSender<Vec<u8>>,
    /// The file, or `None` for standard error.
    path: Option<PathBuf>,
    /// Lines queued and not yet written.
    queued: AtomicUsize,
    /// Their bytes (bounded by [`QUEUE_BYTES`]).
    queued_bytes: AtomicUsize,
    /// Lines dropped because the queue was full, since start.
    dropped: AtomicU64,
    /// A reopened file waiting for the writer.
    reopened: Mutex<Option<File>>,
}

/// The writer before its thread runs: started once the process has switched to
/// the service account, so the thread has that account's credentials.
#[derive(Debug)]
pub(crate) struct Writer {
    rx: Receiver<Vec<u8>>,
    destination: Destination,
    sink: Arc<Sink>,
}

impl Sink {
    /// Opens `path` (or takes standard error) and makes the queue of `capacity`
    /// lines; lines queue until [`Writer::start`].
    pub(crate) fn open(path: Option<&Path>, capacity: usize) -> Result<(Arc<Sink>, Writer), AccessLogError> {
        let destination = match path {
            Some(p) => Destination::File(open(p)?),
            None => Destination::Stderr,
        };
        let (tx, rx) = std::sync::mpsc::sync_channel(capacity);
        let sink = Arc::new(Sink {
            tx,
            path: path.map(Path::to_owned),
            queued: AtomicUsize::new(0),
            queued_bytes: AtomicUsize::new(0),
            dropped: AtomicU64::new(0),
            reopened: Mutex::new(None),
        });
        let writer = Writer {
            rx,
            destination,
            sink: sink.clone(),
        };
        Ok((sink, writer))
    }

    /// Queues one line; drops (and counts) it when the queue is full. Never waits.
    pub(crate) fn send(&self, line: Vec<u8>) {
        let len = line.len();
        if self.queued_bytes.fetch_add(len, Ordering::Relaxed) + len > QUEUE_BYTES {
            self.queued_bytes.fetch_sub(len, Ordering::Relaxed);
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.queued.fetch_add(1, Ordering::Relaxed);
        match self.tx.try_send(line) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.queued.fetch_sub(1, Ordering::Relaxed);
                self.queued_bytes.fetch_sub(len, Ordering::Relaxed);
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Lines dropped since start.
    pub(crate) fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Opens the path again (after logrotate moved the file away); the writer
    /// switches before its next write. `Ok(None)`: standard error, nothing to reopen.
    pub(crate) fn reopen(&self) -> Result<Option<&Path>, AccessLogError> {
        let Some(path) = &self.path else {
            return Ok(None);
        };
        let file = open(path)?;
        *self.reopened.lock().unwrap_or_else(|e| e.into_inner()) = Some(file);
        Ok(Some(path))
    }

    /// Waits up to `limit` for the queue to be written out (at shutdown).
    pub(crate) fn flush(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        while self.queued.load(Ordering::Relaxed) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Writer {
    /// Gives the file to the service account (`uid`, `gid`), so that a reopen of the
    /// same path (no rotation happened) still works after the switch.
    #[cfg(unix)]
    pub(crate) fn give_to(&self, uid: u32, gid: u32) -> io::Result<()> {
        use std::os::unix::fs::MetadataExt;
        match &self.destination {
            Destination::File(f) => {
                // A second name for the file (a hard link someone planted at the
                // path) would hand that other file to the account: refuse it.
                let meta = f.metadata()?;
                if meta.nlink() != 1 {
                    return Err(io::Error::other(format!(
                        "the file has {} names (hard links); not handing it over",
                        meta.nlink()
                    )));
                }
                std::os::unix::fs::fchown(f, Some(uid), Some(gid))
            }
            Destination::Stderr => Ok(()),
        }
    }

    /// Starts the writer thread; it runs until the process exits.
    pub(crate) fn start(self) -> Result<(), AccessLogError> {
        std::thread::Builder::new()
            .name("access-log".into())
            .spawn(move || self.run())
            .map(drop)
            .map_err(AccessLogError::Thread)
    }

    fn run(mut self) {
        let mut batch = Vec::with_capacity(64 * 1024);
        let mut warned: Option<Instant> = None;
        let (mut reported_drops, mut failed) = (0u64, 0u64);
        loop {
            let mut lines = 0usize;
            match self.rx.recv_timeout(TICK) {
                Ok(line) => {
                    batch.extend_from_slice(&line);
                    lines = 1;
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
            for line in self.rx.try_iter().take(BATCH_LINES - 1) {
                batch.extend_from_slice(&line);
                lines += 1;
            }
            self.sink.queued_bytes.fetch_sub(batch.len(), Ordering::Relaxed);
            // Lines queued before the reopen go to the new file too: nothing is lost
            // and nothing written after the signal lands in the moved file.
            let reopened = self
                .sink
                .reopened
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take();
            if let Some(file) = reopened {
                self.destination = Destination::File(file);
            }
            if !batch.is_empty() && self.destination.write_batch(&batch).is_err() {
                failed += lines as u64;
            }
            batch.clear();
            // A batch far above the usual size gives its memory back.
            batch.shrink_to(1024 * 1024);
            self.sink.queued.fetch_sub(lines, Ordering::Relaxed);
            if lines > 0 && lines < BATCH_LINES {
                std::thread::sleep(GATHER);
            }
            let dropped = self.sink.dropped();
            let quiet = warned.is_none_or(|at| at.elapsed() >= WARN_EVERY);
            if (dropped > reported_drops || failed > 0) && quiet {
                tracing::warn!(
                    dropped_total = dropped,
                    dropped = dropped - reported_drops,
                    failed_writes = failed,
                    "access log lines lost: the queue was full (the writer fell behind) or the write failed"
                );
                warned = Some(Instant::now());
                reported_drops = dropped;
                failed = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("webship-access-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_full_queue_drops_and_counts_without_waiting() {
        let dir = temp("full");
        let path = dir.join("access.log");
        let (sink, writer) = Sink::open(Some(&path), 4).unwrap();
        // No writer thread yet: the queue fills, then every line is dropped at once.
        let began = Instant::now();
        for i in 0..10 {
            sink.send(format!("line {i}\n").into_bytes());
        }
        assert!(began.elapsed() < Duration::from_secs(1), "a send waited");
        assert_eq!(sink.dropped(), 6);
        writer.start().unwrap();
        sink.flush(Duration::from_secs(10));
        let written = std::fs::read_to_string(&path).unwrap();
        assert_eq!(written, "line 0\nline 1\nline 2\nline 3\n");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn the_queue_holds_a_bounded_number_of_bytes() {
        let dir = temp("bytes");
        let path = dir.join("access.log");
        let (sink, writer) = Sink::open(Some(&path), 64).unwrap();
        let big = vec![b'x'; QUEUE_BYTES / 2 + 1];
        sink.send(big.clone());
        sink.send(big.clone());
        assert_eq!(
            sink.dropped(),
            1,
            "two lines over the byte cap: the second dropped"
        );
        sink.send(b"small\n".to_vec());
        assert_eq!(sink.dropped(), 1, "a small line still fits");
        writer.start().unwrap();
        sink.flush(Duration::from_secs(10));
        // Written: the room is back.
        sink.send(big);
        assert_eq!(sink.dropped(), 1);
        sink.flush(Duration::from_secs(10));
        let written = std::fs::metadata(&path).unwrap().len();
        assert_eq!(written, 2 * (QUEUE_BYTES as u64 / 2 + 1) + 6);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_file_with_a_second_name_is_not_handed_over() {
        let dir = temp("hardlink");
        let target = dir.join("secret");
        std::fs::write(&target, b"").unwrap();
        let path = dir.join("access.log");
        std::fs::hard_link(&target, &path).unwrap();
        let (_sink, writer) = Sink::open(Some(&path), 4).unwrap();
        let refused = writer.give_to(65534, 65534);
        assert!(refused.is_err(), "a hard-linked log file was handed over");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn reopen_after_a_move_writes_to_the_new_file() {
        let dir = temp("reopen");
        let path = dir.join("access.log");
        let (sink, writer) = Sink::open(Some(&path), 64).unwrap();
        writer.start().unwrap();
        sink.send(b"before\n".to_vec());
        sink.flush(Duration::from_secs(10));
        std::fs::rename(&path, dir.join("access.log.1")).unwrap();
        sink.send(b"between\n".to_vec());
        assert_eq!(sink.reopen().unwrap(), Some(path.as_path()));
        sink.send(b"after\n".to_vec());
        sink.flush(Duration::from_secs(10));
        let old = std::fs::read_to_string(dir.join("access.log.1")).unwrap();
        let new = std::fs::read_to_string(&path).unwrap();
        assert!(old.starts_with("before\n"), "{old:?}");
        assert!(new.ends_with("after\n"), "{new:?}");
        assert_eq!(
            old.lines().count() + new.lines().count(),
            3,
            "a line lost or doubled: {old:?} {new:?}"
        );
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_link_or_a_folder_is_refused() {
        let dir = temp("refuse");
        let target = dir.join("target");
        std::fs::write(&target, b"").unwrap();
        let link = dir.join("link");
        let _ = std::fs::remove_file(&link);
        #[cfg(unix)]
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(matches!(
            Sink::open(Some(&link), 1),
            Err(AccessLogError::Open { .. })
        ));
        assert!(Sink::open(Some(&dir), 1).is_err());
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn writes_are_whole_lines() {
        assert_eq!(chunk(b"ab\ncd\nef\n", 7), 6);
        assert_eq!(chunk(b"abcdefgh\nx\n", 4), 9);
        assert_eq!(chunk(b"ab\n", 4), 3);
    }
}
