//! WebTransport over HTTP/3 (draft-02, which Chromium and aioquic speak).
//!
//! The h3 connection stays in charge of its streams: the request loop in
//! [`crate::h3`] hands every bidirectional stream whose first frame is
//! WEBTRANSPORT_STREAM, and every unidirectional stream of type 0x54, to the
//! connection's [`WtConn`], which routes them to their session by session id. One
//! task per connection reads QUIC datagrams and routes them by quarter stream id.
//! Each session runs [`run`]: its CONNECT stream carries capsules (the client's
//! CLOSE_WEBTRANSPORT_SESSION, ours when a limit trips), and its streams and
//! datagrams go to [`super::diag`].

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use h3::stream::BufRecvStream;
use tokio::sync::mpsc;

use super::session::{self, ClientStream, Clocks, Dispatch};
use super::{capsule, Admission, BoxFuture, Code, RecvHalf, SendHalf, SessionState, Transport};
use crate::h3::backend::{SendStream, StopChecks};
use crate::shutdown::Shutdown;

/// A client bidirectional stream after its WEBTRANSPORT_STREAM header.
pub(crate) type WtBidi = BufRecvStream<crate::h3::backend::BidiStream, Bytes>;
/// A client unidirectional stream after its type and session id.
pub(crate) type WtUni = BufRecvStream<crate::h3::uni::UniStream, Bytes>;
/// The CONNECT request's stream.
pub(crate) type ConnectStream = h3::server::RequestStream<crate::h3::backend::BidiStream, Bytes>;

/// Unidirectional stream type of WebTransport (draft-02 §4.1).
const UNI_STREAM_TYPE: u64 = 0x54;
/// Streams waiting for their session's task; more means the session is not keeping up.
const STREAM_QUEUE: usize = 64;
/// Received datagrams waiting for their session's task; beyond this they are dropped.
const DATAGRAM_QUEUE: usize = 1024;
/// WebTransport streams one connection may carry in its life (h3 keeps a few bytes
/// per stream until the connection ends).
const MAX_STREAMS_PER_CONNECTION: u64 = 100_000;
/// How long a capsule we send may wait for the client's flow control.
const CAPSULE_SEND_TIME: Duration = Duration::from_secs(1);

enum Incoming {
    Bidi(Box<WtBidi>),
    Uni(Box<WtUni>),
}

impl Incoming {
    fn into_client_stream(self) -> ClientStream {
        match self {
            Self::Bidi(stream) => {
                let (send, recv) = h3::quic::BidiStream::split(*stream);
                ClientStream::Bidi(Box::new(recv), Box::new(send))
            }
            Self::Uni(recv) => ClientStream::Uni(recv),
        }
    }
}

struct Route {
    streams: mpsc::Sender<Incoming>,
    datagrams: mpsc::Sender<Bytes>,
    state: Arc<SessionState>,
}

/// The WebTransport sessions of one QUIC connection.
pub(crate) struct WtConn {
    quic: quinn::Connection,
    /// The connection's allowance for the send streams it opens
    /// (`h3::backend::StopChecks`).
    checks: StopChecks,
    sessions: Mutex<HashMap<u64, Route>>,
    datagram_reader: std::sync::Once,
    /// WebTransport streams this connection has carried.
    streams: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for WtConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WtConn")
            .field("peer", &self.quic.remote_address())
            .field("sessions", &self.sessions().len())
            .finish()
    }
}

impl WtConn {
    pub(crate) fn new(quic: quinn::Connection, checks: StopChecks) -> Arc<Self> {
        Arc::new(Self {
            quic,
            checks,
            sessions: Mutex::new(HashMap::new()),
            datagram_reader: std::sync::Once::new(),
            streams: std::sync::atomic::AtomicU64::new(0),
        })
    }

    fn sessions(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Route>> {
        self.sessions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Hands a client bidirectional stream to its session (dropped, which stops it,
    /// when the session is unknown or gone).
    pub(crate) fn route_bidi(&self, session: h3::webtransport::SessionId, stream: WtBidi) {
        self.route(session, Incoming::Bidi(Box::new(stream)));
    }

    pub(crate) fn route_uni(&self, session: h3::webtransport::SessionId, stream: WtUni) {
        self.route(session, Incoming::Uni(Box::new(stream)));
    }

    fn route(&self, session: h3::webtransport::SessionId, stream: Incoming) {
        let id = h3::quic::StreamId::from(session).into_inner();
        let sessions = self.sessions();
        let Some(route) = sessions.get(&id) else {
            tracing::debug!(session = id, "webtransport: stream for no session, refused");
            return refuse(stream, Code::Protocol);
        };
        // h3 remembers every bidirectional stream of a connection (it never learns
        // that a WebTransport one ended): bound what one connection may open.
        let total = self.streams.fetch_add(1, Ordering::Relaxed) + 1;
        if total > MAX_STREAMS_PER_CONNECTION {
            route.state.fail(
                Code::TooManyStreams,
                format!("this connection carried {MAX_STREAMS_PER_CONNECTION} WebTransport streams; open a new one"),
            );
            return refuse(stream, Code::TooManyStreams);
        }
        if let Err(e) = route.streams.try_send(stream) {
            route.state.fail(
                Code::TooManyStreams,
                "streams arrive faster than the session takes them",
            );
            let (mpsc::error::TrySendError::Full(stream) | mpsc::error::TrySendError::Closed(stream)) = e;
            refuse(stream, Code::TooManyStreams);
        }
    }

    fn register(self: &Arc<Self>, id: u64, route: Route) {
        self.sessions().insert(id, route);
        let conn = self.clone();
        self.datagram_reader.call_once(|| {
            tokio::spawn(read_datagrams(Arc::downgrade(&conn), conn.quic.clone()));
        });
    }

    fn unregister(&self, id: u64) {
        self.sessions().remove(&id);
    }
}

/// Routes the connection's datagrams until it closes: a quarter-stream-id varint
/// names the session (RFC 9297 §2.1).
async fn read_datagrams(conn: std::sync::Weak<WtConn>, quic: quinn::Connection) {
    while let Ok(datagram) = quic.read_datagram().await {
        let Some(conn) = conn.upgrade() else { return };
        let Some((quarter, n)) = capsule::read_varint(&datagram) else {
            continue;
        };
        let sessions = conn.sessions();
        let Some(route) = quarter.checked_mul(4).and_then(|id| sessions.get(&id)) else {
            continue;
        };
        if route.datagrams.try_send(datagram.slice(n..)).is_err() {
            route
                .state
                .counters()
                .datagrams_dropped
                .fetch_add(1, Ordering::Relaxed);
        }
    }
}

struct H3Transport {
    quic: quinn::Connection,
    checks: StopChecks,
    session: u64,
    /// The datagram prefix: the session's quarter stream id.
    prefix: Bytes,
}

impl H3Transport {
    /// The transport of the session whose CONNECT stream is `session`.
    fn new(quic: quinn::Connection, checks: StopChecks, session: u64) -> Self {
        let mut prefix = BytesMut::new();
        capsule::put_varint(&mut prefix, session / 4);
        Self {
            quic,
            checks,
            session,
            prefix: prefix.freeze(),
        }
    }

    fn frame(&self, payload: &[u8]) -> Bytes {
        let mut d = BytesMut::with_capacity(self.prefix.len() + payload.len());
        d.extend_from_slice(&self.prefix);
        d.extend_from_slice(payload);
        d.freeze()
    }
}

impl Transport for H3Transport {
    fn open_uni(&self) -> BoxFuture<'_, std::io::Result<Box<dyn SendHalf>>> {
        Box::pin(async move {
            let send = self.quic.open_uni().await.map_err(std::io::Error::other)?;
            // Through the backend, as every other send stream: a write to a stream
            // the client stopped ends (`h3::backend::ask_stopped`).
            let mut send = BufRecvStream::<_, Bytes>::new(SendStream::new(send, self.checks.clone()));
            let mut header = BytesMut::with_capacity(16);
            capsule::put_varint(&mut header, UNI_STREAM_TYPE);
            capsule::put_varint(&mut header, self.session);
            tokio::io::AsyncWriteExt::write_all(&mut send, &header).await?;
            Ok(Box::new(send) as Box<dyn SendHalf>)
        })
    }

    fn send_datagram(&self, payload: Bytes) -> BoxFuture<'_, std::io::Result<()>> {
        Box::pin(async move {
            self.quic
                .send_datagram_wait(self.frame(&payload))
                .await
                .map_err(std::io::Error::other)
        })
    }

    fn try_send_datagram(&self, payload: Bytes) -> bool {
        self.quic.send_datagram(self.frame(&payload)).is_ok()
    }

    fn max_datagram(&self) -> usize {
        self.quic
            .max_datagram_size()
            .unwrap_or(0)
            .saturating_sub(self.prefix.len())
    }
}

impl SendHalf for BufRecvStream<crate::h3::backend::SendStream, Bytes> {
    fn reset(&mut self, code: u32) {
        h3::quic::SendStream::<Bytes>::reset(self, super::stream_error_code(code));
    }
}

impl<S: h3::quic::RecvStream + Send + Unpin> RecvHalf for BufRecvStream<S, Bytes> {
    /// STOP_SENDING with the session's code mapped into the HTTP/3 range (the
    /// backend's `stop_sending`, `h3/backend.rs`, is quinn's `stop`, safe whatever
    /// read was cancelled before).
    fn stop(&mut self, code: u32) {
        h3::quic::RecvStream::stop_sending(self, super::stream_error_code(code));
    }
}

/// Turns away a stream the session cannot take: a bidirectional one is reset (a
/// dropped send half would finish, and look like a complete, empty reply); both
/// kinds stop on drop.
fn refuse(stream: Incoming, code: Code) {
    if let Incoming::Bidi(stream) = stream {
        let (mut send, _recv) = h3::quic::BidiStream::split(*stream);
        SendHalf::reset(&mut send, code as u32);
    }
}

/// Runs one admitted session on its CONNECT stream until the client closes it, a
/// limit ends it, or the server shuts down; `accepted` is the answer to the CONNECT.
pub(crate) async fn run(
    conn: Arc<WtConn>,
    admission: Admission,
    mut stream: ConnectStream,
    accepted: http::Response<()>,
    on_bulk: impl Fn() + Send,
    mut shutdown: Shutdown,
) {
    let id = stream.id().into_inner();
    let state = admission.start();
    let (stream_tx, mut streams) = mpsc::channel(STREAM_QUEUE);
    let (datagram_tx, mut datagrams) = mpsc::channel(DATAGRAM_QUEUE);
    // Registered before the client learns the session exists: its first streams
    // and datagrams may overtake our response.
    conn.register(
        id,
        Route {
            streams: stream_tx,
            datagrams: datagram_tx,
            state: state.clone(),
        },
    );
    if let Err(e) = stream.send_response(accepted).await {
        conn.unregister(id);
        return tracing::debug!(error = %e, "webtransport: CONNECT response failed");
    }
    // An accepted session is bulk by nature: it moves to BBR.
    on_bulk();
    state.touch();
    let (mut send, mut recv) = stream.split();
    let mut capsules = capsule::Reader::new(state.config().max_capsule_bytes);
    let transport = Arc::new(H3Transport::new(conn.quic.clone(), conn.checks.clone(), id));
    let mut work = Dispatch::new(state.clone(), transport);
    let mut clocks = Clocks::new();
    let mut connect_open = true;
    loop {
        tokio::select! {
            () = state.ended() => break,
            Some(incoming) = streams.recv() => {
                let Some(slot) = work.admit() else {
                    refuse(incoming, Code::TooManyStreams);
                    continue;
                };
                work.serve(slot, incoming.into_client_stream(), ());
            }
            Some(datagram) = datagrams.recv() => work.datagram(datagram),
            data = recv.recv_data(), if connect_open => {
                connect_open = connect_data(&state, &mut capsules, data);
            }
            Some(_) = work.join_next() => {}
            () = clocks.drain_due(&state, &mut shutdown) => {
                let drain = send.send_data(capsule::encode(capsule::DRAIN_SESSION, &[]));
                clocks.drain(async {
                    let _ = tokio::time::timeout(CAPSULE_SEND_TIME, drain).await;
                })
                .await;
            }
        }
    }
    conn.unregister(id);
    close(&state, &mut streams, &mut send, &mut work).await;
}

/// Takes what arrived on the CONNECT stream; `false` once the client finished it
/// (the session is then over) or it failed.
fn connect_data(
    state: &SessionState,
    capsules: &mut capsule::Reader,
    data: Result<Option<impl Buf>, impl std::fmt::Display>,
) -> bool {
    match data {
        Ok(Some(mut data)) => {
            while data.has_remaining() {
                let chunk = data.chunk();
                let n = chunk.len().min(capsules.room().max(1));
                capsules.push(&chunk[..n]);
                data.advance(n);
                if !session_capsules(state, capsules) {
                    break;
                }
            }
            true
        }
        Ok(None) => {
            state.end(Code::Done, "the client closed the session", true);
            false
        }
        Err(e) => {
            state.end(Code::Done, format!("the CONNECT stream failed: {e}"), true);
            false
        }
    }
}

/// Ends an ended session on the wire: streams that arrived but were never taken are
/// turned away with its code, our close capsule goes out (none when the client
/// closed), the CONNECT stream finishes, and its streams get a moment to end.
async fn close(
    state: &SessionState,
    streams: &mut mpsc::Receiver<Incoming>,
    send: &mut h3::server::RequestStream<crate::h3::backend::SendStream, Bytes>,
    work: &mut Dispatch<()>,
) {
    streams.close();
    while let Ok(stream) = streams.try_recv() {
        refuse(stream, state.end_code());
    }
    if let Some(close) = session::close_capsule(state) {
        let _ = tokio::time::timeout(CAPSULE_SEND_TIME, send.send_data(close)).await;
    }
    let _ = tokio::time::timeout(CAPSULE_SEND_TIME, send.finish()).await;
    work.settle().await;
}

/// Handles the complete capsules on the CONNECT stream; `false` once the session ended.
fn session_capsules(state: &SessionState, capsules: &mut capsule::Reader) -> bool {
    loop {
        match capsules.next_capsule() {
            Ok(Some((capsule::CLOSE_SESSION, payload))) => {
                session::closed_by_client(state, &payload);
                return false;
            }
            // DRAIN and anything unknown: ignored (RFC 9297 §3.2).
            Ok(Some(_)) => state.touch(),
            Ok(None) => return true,
            Err(e) => {
                session::capsule_failed(state, e);
                return false;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::h3::backend::tests::quic_pair;

    /// A session that stops reading a client's stream sends STOP_SENDING with its own
    /// code mapped into the HTTP/3 range, not the drop's 0.
    #[tokio::test]
    async fn stop_sends_the_mapped_code() {
        let pair = quic_pair(64 * 1024, None).await;
        let (mut send, _client_recv) = pair.client.open_bi().await.unwrap();
        send.write_all(b"hello").await.unwrap();
        let (_server_send, recv) = pair.server.accept_bi().await.unwrap();
        let mut recv = BufRecvStream::<_, Bytes>::new(crate::h3::backend::RecvStream::new(recv));
        RecvHalf::stop(&mut recv, 7);
        drop(recv);
        let code = send.stopped().await.unwrap();
        assert_eq!(
            code.map(quinn::VarInt::into_inner),
            Some(super::super::stream_error_code(7)),
            "the client saw STOP_SENDING with another code"
        );
    }
}
