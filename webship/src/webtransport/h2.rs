//! WebTransport over HTTP/2 (draft-ietf-webtrans-http2): an extended CONNECT whose
//! stream carries everything as capsules: WT_STREAM(_FIN) for stream data,
//! WT_RESET_STREAM and WT_STOP_SENDING, DATAGRAM, and the session's close.
//!
//! One task reads capsules off the CONNECT stream and feeds each session stream
//! through a bounded in-memory pipe to [`super::diag`]; what the streams send goes
//! through a pipe to a pump task that frames it as capsules into the one writer.
//! Backpressure is the pipes' and the writer queue's bound, then HTTP/2's flow
//! control: a slow stream stalls the session's reading, never buffers more.
//!
//! The stream flow-control capsules of the draft are announced once, at the
//! session's limits (WT_MAX_STREAMS, WT_MAX_DATA), and not tracked further: the
//! session's own limits bound what a client may send.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{
    AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf, ReadHalf, SimplexStream, WriteHalf,
};
use tokio::sync::mpsc;

use super::{capsule, diag, Admission, BoxFuture, Code, RecvHalf, SendHalf, SessionState, Transport};
use crate::server::Shutdown;

/// Bytes each stream direction may hold in its pipe.
const PIPE: usize = 64 * 1024;
/// Capsules waiting for the writer.
const WRITE_QUEUE: usize = 64;
/// Bytes read from the CONNECT stream at a time.
const READ_CHUNK: usize = 64 * 1024;
/// No reset requested (the flag's resting value).
const NO_RESET: u64 = u64::MAX;

/// A stream's send half: bytes go into a pipe that a pump frames as capsules.
struct H2Send {
    pipe: WriteHalf<SimplexStream>,
    reset: Arc<AtomicU64>,
}

impl AsyncWrite for H2Send {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if self.reset.load(Ordering::Acquire) != NO_RESET {
            return Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into()));
        }
        Pin::new(&mut self.pipe).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.pipe).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.pipe).poll_shutdown(cx)
    }
}

impl SendHalf for H2Send {
    fn reset(&mut self, code: u32) {
        // The pump sends WT_RESET_STREAM instead of a FIN once the pipe drains.
        self.reset.store(u64::from(code), Ordering::Release);
    }
}

/// A stream's receive half: the reader task writes the client's bytes into a pipe.
struct H2Recv {
    pipe: ReadHalf<SimplexStream>,
    /// Set when the client reset the stream: its end is then an error, not EOF.
    reset: Arc<AtomicU64>,
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
        let _ = self.out.try_send(capsule::varints(
            capsule::WT_STOP_SENDING,
            &[self.id, u64::from(code)],
        ));
    }
}

/// Frames what a stream's send half writes as WT_STREAM capsules, then a FIN (or
/// WT_RESET_STREAM when the half was reset).
async fn pump(id: u64, mut pipe: ReadHalf<SimplexStream>, reset: Arc<AtomicU64>, out: mpsc::Sender<Bytes>) {
    let mut buf = vec![0u8; PIPE];
    loop {
        // A failed read ends the stream like EOF (then the reset flag decides how).
        let n = pipe.read(&mut buf).await.unwrap_or_default();
        let code = reset.load(Ordering::Acquire);
        let capsule = if code != NO_RESET {
            capsule::varints(capsule::WT_RESET_STREAM, &[id, code])
        } else {
            stream_capsule(id, &buf[..n], n == 0)
        };
        if out.send(capsule).await.is_err() || n == 0 || code != NO_RESET {
            return;
        }
    }
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

struct H2Transport {
    out: mpsc::Sender<Bytes>,
    /// The next server-initiated unidirectional stream id (3, 7, 11, …).
    next_uni: AtomicU64,
    max_datagram: usize,
}

impl Transport for H2Transport {
    fn open_uni(&self) -> BoxFuture<'_, std::io::Result<Box<dyn SendHalf>>> {
        let id = self.next_uni.fetch_add(4, Ordering::Relaxed);
        let (rx, tx) = tokio::io::simplex(PIPE);
        let reset = Arc::new(AtomicU64::new(NO_RESET));
        tokio::spawn(pump(id, rx, reset.clone(), self.out.clone()));
        Box::pin(async move { Ok(Box::new(H2Send { pipe: tx, reset }) as Box<dyn SendHalf>) })
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
    pipe: Option<WriteHalf<SimplexStream>>,
    /// The client reset it (its receive half reports an error).
    recv_reset: Arc<AtomicU64>,
    /// Our send half, which WT_STOP_SENDING resets (bidirectional streams only).
    send_reset: Option<Arc<AtomicU64>>,
}

/// Runs an admitted session over the CONNECT stream's bytes (`io`, hyper's upgrade)
/// until the client closes it, a limit ends it, or the server shuts down.
pub async fn run<IO>(io: IO, admission: Admission, mut shutdown: Shutdown)
where
    IO: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let state = admission.start();
    state.touch();
    let (mut rd, mut wr) = tokio::io::split(io);
    let (out, mut queue) = mpsc::channel::<Bytes>(WRITE_QUEUE);
    let writer = tokio::spawn(async move {
        while let Some(capsule) = queue.recv().await {
            if wr.write_all(&capsule).await.is_err() {
                return;
            }
        }
        let _ = wr.shutdown().await;
    });
    let config = state.config().clone();
    // The draft's initial flow-control limits are zero: open them to the session's.
    let limits = [
        capsule::varints(
            capsule::WT_MAX_STREAMS_BIDI,
            &[config.max_streams_per_session as u64],
        ),
        capsule::varints(
            capsule::WT_MAX_STREAMS_UNI,
            &[config.max_streams_per_session as u64],
        ),
        capsule::varints(
            capsule::WT_MAX_DATA,
            &[config.max_session_bytes.min(capsule::VARINT_MAX)],
        ),
    ];
    for c in limits {
        let _ = out.send(c).await;
    }
    let transport: Arc<dyn Transport> = Arc::new(H2Transport {
        out: out.clone(),
        next_uni: AtomicU64::new(3),
        max_datagram: config.max_datagram_bytes,
    });
    let mut session = Session {
        state: state.clone(),
        transport,
        out: out.clone(),
        streams: HashMap::new(),
        next_bidi: 0,
        next_uni: 2,
        tasks: tokio::task::JoinSet::new(),
    };
    let mut capsules = capsule::Reader::new(config.max_capsule_bytes);
    let mut buf = vec![0u8; READ_CHUNK];
    let mut idle = tokio::time::interval(Duration::from_secs(1));
    let mut draining: Option<tokio::time::Instant> = None;
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
            Some(_) = session.tasks.join_next() => continue,
            _ = idle.tick() => {
                if state.idle_for() >= config.idle_timeout && session.tasks.is_empty() {
                    state.fail(Code::IdleTimeout, format!("no traffic for {} s", config.idle_timeout.as_secs()));
                }
                if draining.is_some_and(|deadline| tokio::time::Instant::now() >= deadline) {
                    state.fail(Code::Shutdown, "the server is shutting down");
                }
                continue;
            }
            () = shutdown.requested(), if draining.is_none() => {
                let _ = out.try_send(capsule::encode(capsule::DRAIN_SESSION, &[]));
                draining = Some(tokio::time::Instant::now() + super::DRAIN_TIME);
                continue;
            }
        };
        capsules.push(&buf[..n]);
        loop {
            match capsules.next_capsule() {
                Ok(Some((kind, payload))) => {
                    let handled = tokio::select! {
                        () = state.ended() => false,
                        ok = session.capsule(kind, payload) => ok,
                    };
                    if !handled {
                        break;
                    }
                }
                Ok(None) => break,
                Err(e @ capsule::CapsuleError::TooLarge { .. }) => {
                    state.fail(Code::CapsuleTooLarge, e.to_string());
                    break;
                }
                Err(e) => {
                    state.fail(Code::Protocol, e.to_string());
                    break;
                }
            }
        }
    }
    // Streams reset themselves on the session's end; their pumps then say so.
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        while session.tasks.join_next().await.is_some() {}
    })
    .await;
    if let Some(end) = state.ending().filter(|e| !e.by_client) {
        let _ = out.try_send(capsule::close_session(end.code as u32, &end.reason));
    }
    drop(session);
    drop(out);
    // The writer ends once every sender is gone: the close capsule, then END_STREAM.
    let _ = tokio::time::timeout(Duration::from_secs(2), writer).await;
}

struct Session {
    state: Arc<SessionState>,
    transport: Arc<dyn Transport>,
    out: mpsc::Sender<Bytes>,
    streams: HashMap<u64, Inbound>,
    /// The lowest id a new client stream of each kind may have: lower ones not in
    /// `streams` are finished, and their late capsules are ignored.
    next_bidi: u64,
    next_uni: u64,
    tasks: tokio::task::JoinSet<()>,
}

impl Session {
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
                if !self.streams.contains_key(&id) && !self.open(id) {
                    return state.ending().is_none();
                }
                let Some(stream) = self.streams.get_mut(&id) else {
                    return true;
                };
                if let Some(pipe) = stream.pipe.as_mut() {
                    if !data.is_empty() && pipe.write_all(&data).await.is_err() {
                        // The stream's reader is gone (it finished or was reset).
                        stream.pipe = None;
                    }
                }
                if kind == capsule::WT_STREAM_FIN {
                    if let Some(mut pipe) = stream.pipe.take() {
                        let _ = pipe.shutdown().await;
                    }
                    self.streams.remove(&id);
                }
            }
            capsule::WT_RESET_STREAM | capsule::WT_STOP_SENDING => {
                let Ok((id, code)) = capsule::parse_stream_code(&payload) else {
                    state.fail(Code::Protocol, "malformed stream capsule");
                    return false;
                };
                if let Some(stream) = self.streams.get_mut(&id) {
                    if kind == capsule::WT_RESET_STREAM {
                        stream.recv_reset.store(code.min(NO_RESET - 1), Ordering::Release);
                        stream.pipe = None;
                        self.streams.remove(&id);
                    } else if let Some(send) = &stream.send_reset {
                        send.store(code.min(NO_RESET - 1), Ordering::Release);
                    }
                }
            }
            capsule::DATAGRAM => {
                if state.datagram_in(payload.len()) {
                    diag::datagram(&state, &*self.transport, payload);
                }
            }
            capsule::CLOSE_SESSION => {
                let reason = match capsule::parse_close(&payload) {
                    Ok((code, reason)) => format!("the client closed the session ({code}: {reason})"),
                    Err(e) => e.to_string(),
                };
                state.end(Code::Done, reason, true);
                return false;
            }
            // Flow control, padding, drain, and anything unknown: ignored.
            _ => state.touch(),
        }
        true
    }

    /// Opens the client stream `id` for its first capsule; `false` when the id is
    /// not a new client stream (or the session has no room for it).
    fn open(&mut self, id: u64) -> bool {
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
        let Some(slot) = self.state.stream_slot() else {
            return false;
        };
        let (in_rx, in_tx) = tokio::io::simplex(PIPE);
        let recv_reset = Arc::new(AtomicU64::new(NO_RESET));
        let recv = Box::new(H2Recv {
            pipe: in_rx,
            reset: recv_reset.clone(),
            id,
            out: self.out.clone(),
        });
        let (state, transport) = (self.state.clone(), self.transport.clone());
        let send_reset = if bidi {
            let (out_rx, out_tx) = tokio::io::simplex(PIPE);
            let reset = Arc::new(AtomicU64::new(NO_RESET));
            self.tasks
                .spawn(pump(id, out_rx, reset.clone(), self.out.clone()));
            let send = Box::new(H2Send {
                pipe: out_tx,
                reset: reset.clone(),
            });
            self.tasks.spawn(async move {
                diag::bidi(state, transport, recv, send).await;
                drop(slot);
            });
            Some(reset)
        } else {
            self.tasks.spawn(async move {
                diag::uni(state, transport, recv).await;
                drop(slot);
            });
            None
        };
        self.streams.insert(
            id,
            Inbound {
                pipe: Some(in_tx),
                recv_reset,
                send_reset,
            },
        );
        true
    }
}
