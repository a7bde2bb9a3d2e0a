//! WebTransport over HTTP/2 (draft-ietf-webtrans-http2): an extended CONNECT whose
//! stream carries everything as capsules: WT_STREAM(_FIN) for stream data,
//! WT_RESET_STREAM and WT_STOP_SENDING, DATAGRAM, and the session's close.
//!
//! One task reads capsules off the CONNECT stream and feeds each session stream
//! through a bounded in-memory pipe to [`super::diag`]; what the streams send goes
//! through a pipe to a pump task that frames it as capsules into the one writer.
//! Backpressure is the pipes' and the writer queue's bound, then HTTP/2's flow
//! control. A pipe closes when either end is dropped, so a stream that ends on one
//! side never leaves the other waiting.
//!
//! Flow control: the server grants the session's limits (WT_MAX_DATA, per-stream
//! WT_MAX_STREAM_DATA) and keeps WT_MAX_STREAMS `max_streams_per_session` above the
//! streams that have ended; it does not track the client's grants to it (the session
//! limits bound what it sends).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream, ReadBuf};
use tokio::sync::{mpsc, Notify};

use super::session::{self, ClientStream, Clocks, Dispatch};
use super::{capsule, Admission, BoxFuture, Code, RecvHalf, SendHalf, SessionState, Transport};
use crate::shutdown::Shutdown;

/// Bytes each stream direction may hold in its pipe.
const PIPE: usize = 64 * 1024;
/// Capsules waiting for the writer.
const WRITE_QUEUE: usize = 64;
/// Bytes read from the CONNECT stream at a time.
const READ_CHUNK: usize = 64 * 1024;
/// No reset requested (the flag's resting value).
const NO_RESET: u64 = u64::MAX;
/// How long the close capsule and the stream's end may wait for the client.
const CLOSE_TIME: Duration = Duration::from_secs(2);

/// How a stream's send side ends: its pump sends FIN only after a clean finish,
/// WT_RESET_STREAM otherwise (a reset, the client's STOP_SENDING, or a drop).
#[derive(Debug)]
struct SendFlags {
    reset: AtomicU64,
    finished: AtomicBool,
    /// Wakes the pump when a reset should go out now.
    wake: Notify,
}

impl SendFlags {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            reset: AtomicU64::new(NO_RESET),
            finished: AtomicBool::new(false),
            wake: Notify::new(),
        })
    }

    fn reset(&self, code: u64) {
        let _ = self.reset.compare_exchange(
            NO_RESET,
            code.min(NO_RESET - 1),
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        self.wake.notify_one();
    }
}

/// The send sides whose pumps still run, by stream id (for WT_STOP_SENDING).
type Senders = Arc<Mutex<HashMap<u64, Arc<SendFlags>>>>;

fn senders(map: &Senders) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<SendFlags>>> {
    map.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A stream's send half: bytes go into a pipe that a pump frames as capsules.
struct H2Send {
    pipe: DuplexStream,
    flags: Arc<SendFlags>,
}

impl AsyncWrite for H2Send {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if self.flags.reset.load(Ordering::Acquire) != NO_RESET {
            return Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into()));
        }
        Pin::new(&mut self.pipe).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.pipe).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.flags.finished.store(true, Ordering::Release);
        Pin::new(&mut self.pipe).poll_shutdown(cx)
    }
}

impl SendHalf for H2Send {
    fn reset(&mut self, code: u32) {
        self.flags.reset(u64::from(code));
    }
}

/// A stream's receive half: the reader task writes the client's bytes into a pipe.
struct H2Recv {
    pipe: DuplexStream,
    /// Set when the client reset the stream: its end is then an error, not EOF.
    reset: Arc<AtomicU64>,
    /// Set once the client's side ended (FIN or reset): nothing more will come, so
    /// there is nothing to stop.
    ended: Arc<AtomicBool>,
    id: u64,
    out: mpsc::Sender<Bytes>,
}

impl AsyncRead for H2Recv {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        std::task::ready!(Pin::new(&mut self.pipe).poll_read(cx, buf))?;
        if buf.filled().len() == before && self.reset.load(Ordering::Acquire) != NO_RESET {
            return Poll::Ready(Err(std::io::ErrorKind::ConnectionReset.into()));
        }
        Poll::Ready(Ok(()))
    }
}

impl RecvHalf for H2Recv {
    fn stop(&mut self, code: u32) {
        // A stream the client already ended needs no STOP_SENDING (RFC 9000 §3.5):
        // sent anyway, it could arrive after the session's close.
        if self.ended.load(Ordering::Acquire) {
            return;
        }
        // Best effort: dropping the half closes the pipe, which discards the rest.
        let _ = self.out.try_send(capsule::varints(
            capsule::WT_STOP_SENDING,
            &[self.id, u64::from(code)],
        ));
    }
}

/// Frames what a stream's send half writes as WT_STREAM capsules, then FIN after a
/// clean finish, or WT_RESET_STREAM.
async fn pump(
    id: u64,
    mut pipe: DuplexStream,
    flags: Arc<SendFlags>,
    out: mpsc::Sender<Bytes>,
    map: Senders,
) {
    let mut buf = vec![0u8; PIPE];
    loop {
        let n = tokio::select! {
            // A failed read ends the stream like EOF; the flags decide how.
            n = pipe.read(&mut buf) => n.unwrap_or_default(),
            () = flags.wake.notified() => 0,
        };
        let code = flags.reset.load(Ordering::Acquire);
        let capsule = if code != NO_RESET {
            capsule::varints(capsule::WT_RESET_STREAM, &[id, code])
        } else if n > 0 {
            stream_capsule(id, &buf[..n], false)
        } else if flags.finished.load(Ordering::Acquire) {
            stream_capsule(id, &[], true)
        } else {
            // Dropped without a finish: never let that look complete.
            capsule::varints(capsule::WT_RESET_STREAM, &[id, 0])
        };
        if out.send(capsule).await.is_err() || n == 0 || code != NO_RESET {
            break;
        }
    }
    senders(&map).remove(&id);
}

fn stream_capsule(id: u64, data: &[u8], fin: bool) -> Bytes {
    let kind = if fin {
        capsule::WT_STREAM_FIN
    } else {
        capsule::WT_STREAM
    };
    let mut out = BytesMut::with_capacity(24 + data.len());
    capsule::put_header(&mut out, kind, capsule::varint_len(id) + data.len());
    capsule::put_varint(&mut out, id);
    out.extend_from_slice(data);
    out.freeze()
}

/// A send half and the pump behind it, registered for WT_STOP_SENDING.
fn send_half(
    id: u64,
    out: &mpsc::Sender<Bytes>,
    map: &Senders,
) -> (H2Send, impl std::future::Future<Output = ()>) {
    let (ours, theirs) = tokio::io::duplex(PIPE);
    let flags = SendFlags::new();
    senders(map).insert(id, flags.clone());
    let pump = pump(id, theirs, flags.clone(), out.clone(), map.clone());
    (H2Send { pipe: ours, flags }, pump)
}

struct H2Transport {
    out: mpsc::Sender<Bytes>,
    senders: Senders,
    /// The next server-initiated unidirectional stream id (3, 7, 11, …).
    next_uni: AtomicU64,
    max_datagram: usize,
}

impl Transport for H2Transport {
    fn open_uni(&self) -> BoxFuture<'_, std::io::Result<Box<dyn SendHalf>>> {
        let id = self.next_uni.fetch_add(4, Ordering::Relaxed);
        let (send, pump) = send_half(id, &self.out, &self.senders);
        // The pump ends with its send half (the pipe closes on drop).
        tokio::spawn(pump);
        Box::pin(async move { Ok(Box::new(send) as Box<dyn SendHalf>) })
    }

    fn send_datagram(&self, payload: Bytes) -> BoxFuture<'_, std::io::Result<()>> {
        Box::pin(async move {
            self.out
                .send(capsule::encode(capsule::DATAGRAM, &payload))
                .await
                .map_err(|_| std::io::Error::from(std::io::ErrorKind::BrokenPipe))
        })
    }

    fn try_send_datagram(&self, payload: Bytes) -> bool {
        self.out
            .try_send(capsule::encode(capsule::DATAGRAM, &payload))
            .is_ok()
    }

    fn max_datagram(&self) -> usize {
        self.max_datagram
    }
}

/// What the reader keeps per open client stream: where its bytes go.
struct Inbound {
    pipe: Option<DuplexStream>,
    /// The client reset it (its receive half reports an error).
    recv_reset: Arc<AtomicU64>,
    /// The client's side ended (FIN or reset).
    ended: Arc<AtomicBool>,
}

/// Runs an admitted session over the CONNECT stream's bytes (`io`, hyper's upgrade)
/// until the client closes it, a limit ends it, or the server shuts down.
pub(crate) async fn run<IO>(io: IO, admission: Admission, mut shutdown: Shutdown)
where
    IO: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let state = admission.start();
    state.touch();
    let (mut rd, wr) = tokio::io::split(io);
    let (out, mut writer) = spawn_writer(wr);
    open_limits(&out, state.config()).await;
    let mut session = Session::new(state.clone(), &out);
    let mut capsules = capsule::Reader::new(state.config().max_capsule_bytes);
    let mut buf = vec![0u8; READ_CHUNK];
    let mut clocks = Clocks::new();
    loop {
        let n = tokio::select! {
            () = state.ended() => break,
            read = rd.read(&mut buf[..capsules.room().clamp(1, READ_CHUNK)]) => match read {
                Ok(0) | Err(_) => {
                    state.end(Code::Done, "the client closed the session", true);
                    break;
                }
                Ok(n) => n,
            },
            Some(done) = session.work.join_next() => {
                if let Ok(Some(id)) = done {
                    session.stream_ended(id).await;
                }
                continue;
            }
            () = clocks.drain_due(&state, &mut shutdown) => {
                let drain = capsule::encode(capsule::DRAIN_SESSION, &[]);
                clocks.drain(async { let _ = out.try_send(drain); }).await;
                continue;
            }
        };
        capsules.push(&buf[..n]);
        session.capsules(&mut capsules).await;
    }
    // Streams reset themselves on the session's end; their pumps then say so.
    session.streams.clear();
    session.work.settle().await;
    if let Some(close) = session::close_capsule(&state) {
        let _ = tokio::time::timeout(CLOSE_TIME, out.send(close)).await;
    }
    drop(session);
    drop(out);
    // The writer ends once every sender is gone: the close capsule, then END_STREAM.
    if tokio::time::timeout(CLOSE_TIME, &mut writer).await.is_err() {
        writer.abort();
    }
}

/// The one writer of the CONNECT stream: capsules from the returned queue go out in
/// order; once every sender is gone the stream ends.
fn spawn_writer<W>(mut wr: W) -> (mpsc::Sender<Bytes>, tokio::task::JoinHandle<()>)
where
    W: AsyncWrite + Send + Unpin + 'static,
{
    let (out, mut queue) = mpsc::channel::<Bytes>(WRITE_QUEUE);
    let writer = tokio::spawn(async move {
        while let Some(capsule) = queue.recv().await {
            if wr.write_all(&capsule).await.is_err() {
                return;
            }
        }
        let _ = wr.shutdown().await;
    });
    (out, writer)
}

/// The draft's initial limits are zero: open them to the session's.
async fn open_limits(out: &mpsc::Sender<Bytes>, config: &crate::config::WebTransport) {
    let max_streams = config.max_streams_per_session as u64;
    for c in [
        capsule::varints(capsule::WT_MAX_STREAMS_BIDI, &[max_streams]),
        capsule::varints(capsule::WT_MAX_STREAMS_UNI, &[max_streams]),
        capsule::varints(
            capsule::WT_MAX_DATA,
            &[config.max_session_bytes.min(capsule::VARINT_MAX)],
        ),
    ] {
        let _ = out.send(c).await;
    }
}

/// The session as the CONNECT stream's reader sees it: the client streams it feeds
/// and the flow control it grants.
struct Session {
    state: Arc<SessionState>,
    work: Dispatch<Option<u64>>,
    out: mpsc::Sender<Bytes>,
    senders: Senders,
    streams: HashMap<u64, Inbound>,
    /// The lowest id a new client stream of each kind may have: lower ones not in
    /// `streams` are finished, and their late capsules are ignored.
    next_bidi: u64,
    next_uni: u64,
    /// Client streams whose work is over, which WT_MAX_STREAMS gives back.
    ended_bidi: u64,
    ended_uni: u64,
}

impl Session {
    fn new(state: Arc<SessionState>, out: &mpsc::Sender<Bytes>) -> Self {
        let config = state.config();
        let senders: Senders = Arc::default();
        let transport = Arc::new(H2Transport {
            out: out.clone(),
            senders: senders.clone(),
            next_uni: AtomicU64::new(3),
            max_datagram: config.max_datagram_bytes.min(config.max_capsule_bytes),
        });
        Self {
            work: Dispatch::new(state.clone(), transport),
            state,
            out: out.clone(),
            senders,
            streams: HashMap::new(),
            next_bidi: 0,
            next_uni: 2,
            ended_bidi: 0,
            ended_uni: 0,
        }
    }

    /// Handles the complete capsules read so far, until one ends the session.
    async fn capsules(&mut self, capsules: &mut capsule::Reader) {
        let state = self.state.clone();
        loop {
            match capsules.next_capsule() {
                Ok(Some((kind, payload))) => {
                    let handled = tokio::select! {
                        () = state.ended() => false,
                        ok = self.capsule(kind, payload) => ok,
                    };
                    if !handled {
                        break;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    session::capsule_failed(&state, e);
                    break;
                }
            }
        }
    }

    /// Handles one capsule; `false` once the session ended.
    async fn capsule(&mut self, kind: u64, payload: Bytes) -> bool {
        let state = self.state.clone();
        match kind {
            capsule::WT_STREAM | capsule::WT_STREAM_FIN => {
                let Ok((id, data)) = capsule::parse_stream(&payload) else {
                    state.fail(Code::Protocol, "malformed WT_STREAM capsule");
                    return false;
                };
                state.touch();
                if !self.streams.contains_key(&id) && !self.open(id).await {
                    return state.ending().is_none();
                }
                let Some(stream) = self.streams.get_mut(&id) else {
                    return true;
                };
                if let (Some(pipe), false) = (stream.pipe.as_mut(), data.is_empty()) {
                    // The stream's work takes its bytes within the idle time, or they
                    // are dropped with the pipe (it stopped reading: a source command
                    // followed by more data, say).
                    let write = tokio::time::timeout(state.config().idle_timeout, pipe.write_all(&data));
                    if !matches!(write.await, Ok(Ok(()))) {
                        stream.pipe = None;
                    }
                }
                if kind == capsule::WT_STREAM_FIN {
                    stream.ended.store(true, Ordering::Release);
                    if let Some(mut pipe) = stream.pipe.take() {
                        let _ = pipe.shutdown().await;
                    }
                }
            }
            capsule::WT_RESET_STREAM => {
                let Ok((id, code)) = capsule::parse_stream_code(&payload) else {
                    state.fail(Code::Protocol, "malformed WT_RESET_STREAM capsule");
                    return false;
                };
                if let Some(stream) = self.streams.get_mut(&id) {
                    stream.recv_reset.store(code.min(NO_RESET - 1), Ordering::Release);
                    stream.ended.store(true, Ordering::Release);
                    stream.pipe = None;
                }
            }
            capsule::WT_STOP_SENDING => {
                let Ok((id, code)) = capsule::parse_stream_code(&payload) else {
                    state.fail(Code::Protocol, "malformed WT_STOP_SENDING capsule");
                    return false;
                };
                if let Some(flags) = senders(&self.senders).get(&id) {
                    flags.reset(code);
                }
            }
            capsule::DATAGRAM => self.work.datagram(payload),
            capsule::CLOSE_SESSION => {
                session::closed_by_client(&state, &payload);
                return false;
            }
            // Flow control, padding, drain, and anything unknown: ignored.
            _ => state.touch(),
        }
        true
    }

    /// A client stream's work is over: forget it, and let the client open another.
    async fn stream_ended(&mut self, id: u64) {
        self.streams.remove(&id);
        let (kind, ended) = if id.is_multiple_of(4) {
            self.ended_bidi += 1;
            (capsule::WT_MAX_STREAMS_BIDI, self.ended_bidi)
        } else {
            self.ended_uni += 1;
            (capsule::WT_MAX_STREAMS_UNI, self.ended_uni)
        };
        let limit = ended + self.state.config().max_streams_per_session as u64;
        let _ = self.out.send(capsule::varints(kind, &[limit])).await;
    }

    /// Opens the client stream `id` for its first capsule; `false` when the id is
    /// not a new client stream (or the session has no room for it).
    async fn open(&mut self, id: u64) -> bool {
        let bidi = match id % 4 {
            0 => true,
            2 => false,
            _ => {
                self.state
                    .fail(Code::Protocol, format!("stream {id} is not a client stream"));
                return false;
            }
        };
        let next = if bidi {
            &mut self.next_bidi
        } else {
            &mut self.next_uni
        };
        if id < *next {
            return false;
        }
        *next = id + 4;
        let Some(slot) = self.work.admit() else {
            return false;
        };
        let (ours, theirs) = tokio::io::duplex(PIPE);
        let recv_reset = Arc::new(AtomicU64::new(NO_RESET));
        let ended = Arc::new(AtomicBool::new(false));
        let recv = Box::new(H2Recv {
            pipe: theirs,
            reset: recv_reset.clone(),
            ended: ended.clone(),
            id,
            out: self.out.clone(),
        });
        let stream = if bidi {
            let (send, pump) = send_half(id, &self.out, &self.senders);
            self.work.spawn(async move {
                pump.await;
                None
            });
            ClientStream::Bidi(recv, Box::new(send))
        } else {
            ClientStream::Uni(recv)
        };
        // The stream's work yields its id, which gives its WT_MAX_STREAMS credit back.
        self.work.serve(slot, stream, Some(id));
        self.streams.insert(
            id,
            Inbound {
                pipe: Some(ours),
                recv_reset,
                ended,
            },
        );
        // Let the client send on it up to the session's budget.
        let grant = self.state.config().max_session_bytes.min(capsule::VARINT_MAX);
        let _ = self
            .out
            .send(capsule::varints(capsule::WT_MAX_STREAM_DATA, &[id, grant]))
            .await;
        true
    }
}
