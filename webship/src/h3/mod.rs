//! HTTP/3: a quinn endpoint on the listen address (UDP) and the h3 driver.
//!
//! Requests go through the same [`Service`](crate::service::Service) as h1 and h2, so
//! routing, headers, ranges, conditionals and path safety are identical. Transport:
//! quinn's pacing, UDP GSO/GRO (quinn-udp), DPLPMTUD up to `h3_mtu_upper_bound_bytes`,
//! GSO batches that fit one 64 KB send at any MTU bound (`generation::QuicSocket`),
//! and a per-connection congestion controller that starts on CUBIC and adds BBR once
//! a response proves bulk, using the larger window of the two ([`congestion`]).
//!
//! Response chunks of at least 16 KiB reach quinn without a copy ([`backend`]: quinn
//! holds the chunk itself, and so its whole allocation, until its bytes are
//! acknowledged); smaller ones are copied, so that a trickle of tiny relayed chunks
//! cannot pin an upstream read buffer each ([`backend::OFFER_MIN`]). Memory per
//! connection is bounded by a small multiple of `h3_send_window_bytes` (quinn holds no
//! more unacknowledged stream data than that; `send_data` waits), up to about 100 KiB
//! of stop checks left in quinn ([`backend::StopChecks`]), plus two
//! [`STREAM_CHUNK`]s per active stream, two 16 KiB reads on a stream whose client
//! grants no credit (file reads ramp up with the credit the client gives:
//! `exchange::body`). A write that waits for credit longer than `send_timeout` resets
//! the stream; a request head must arrive within `header_read_timeout`; a connection
//! without a request for `idle_timeout` closes, whatever PINGs keep QUIC alive.

pub(crate) mod backend;
pub(crate) mod batch;
pub(crate) mod congestion;
mod endpoint;
mod fields;
pub(crate) mod generation;
mod mtu;
mod pacing;
pub(crate) mod routing;
pub(crate) mod stats;
#[cfg(test)]
mod testing;
pub(crate) mod uni;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use quinn::crypto::rustls::QuicServerConfig;
use tokio::sync::OwnedSemaphorePermit;

use crate::config::{H3Settings, Limits};
use crate::exchange::{
    send_body, BodyWriter, ConnContext, Drivers, Progress, Record, ResponseBody, SendError,
};
use crate::files::cursor::STREAM_CHUNK;
use crate::message::{BoxError, Response};
use crate::metrics::{Close, Protocol, Tracked, Transport};
use crate::webtransport::h3::WtConn;
use congestion::{BulkSignal, SwitchingFactory};
pub(crate) use endpoint::{sockets_wanted, H3Endpoint, H3Switch, Handover};
use generation::Handshakes;

/// How long a draining connection with nothing left to do must have sent nothing
/// before it closes.
const CLOSE_QUIET: Duration = Duration::from_secs(1);
/// QUIC datagrams queued per connection each way (WebTransport only).
const DATAGRAM_BUFFER_BYTES: usize = 2 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum H3Error {
    #[error(
        "cannot listen for HTTP/3 on udp {addr}: {source} (fix: free the UDP port, or set `h3 = false`)"
    )]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("the TLS configuration cannot serve QUIC: {0}")]
    Crypto(String),
}

/// What the endpoint serves a new connection with: the drivers and the QUIC TLS
/// configuration of the generation current when it arrives (a reload replaces
/// both; connections keep the ones they started with). `quic` is `None` when no
/// site serves HTTP/3 any more: new connections are refused.
pub(crate) trait Serving: Send + Sync + 'static {
    fn drivers(&self) -> &Arc<Drivers>;
    fn quic(&self) -> Option<&Arc<QuicServerConfig>>;
}

/// The QUIC form of the rustls configuration `Acceptor::quic_config` builds.
pub(crate) fn quic_crypto(tls: Arc<rustls::ServerConfig>) -> Result<Arc<QuicServerConfig>, H3Error> {
    QuicServerConfig::try_from(tls)
        .map(Arc::new)
        .map_err(|e| H3Error::Crypto(e.to_string()))
}

/// One connection's transport parameters; `mtu_upper_bound` is its DPLPMTUD ceiling
/// (see [`mtu`]).
fn transport(
    settings: &H3Settings,
    mtu_upper_bound: u16,
    limits: &Limits,
    webtransport: bool,
    signal: BulkSignal,
) -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    // Control and two QPACK streams, plus headroom for extensions; WebTransport
    // sessions open unidirectional streams of their own.
    let uni = if webtransport {
        settings.max_concurrent_streams.max(8)
    } else {
        8
    };
    t.max_concurrent_bidi_streams(settings.max_concurrent_streams.into())
        .max_concurrent_uni_streams(uni.into())
        // QUIC datagrams only carry WebTransport's; without it none are accepted.
        .datagram_receive_buffer_size(webtransport.then_some(DATAGRAM_BUFFER_BYTES))
        .datagram_send_buffer_size(DATAGRAM_BUFFER_BYTES)
        .stream_receive_window(settings.stream_receive_window_bytes.into())
        .receive_window(settings.receive_window_bytes.into())
        .send_window(settings.send_window_bytes)
        .max_idle_timeout(quinn::IdleTimeout::try_from(limits.idle_timeout).ok())
        .enable_segmentation_offload(settings.gso)
        .congestion_controller_factory(Arc::new(SwitchingFactory::new(
            signal,
            settings.initial_window_packets,
        )));
    let mut mtud = quinn::MtuDiscoveryConfig::default();
    mtud.upper_bound(mtu_upper_bound);
    t.mtu_discovery_config(Some(mtud));
    t
}

/// A handshake in progress, struck from the endpoint's table when it ends.
struct Handshake {
    cid: quinn::ConnectionId,
    table: Arc<Handshakes>,
}

impl Drop for Handshake {
    fn drop(&mut self) {
        self.table.ended(&self.cid);
    }
}

async fn connection(
    connecting: quinn::Connecting,
    drivers: Arc<Drivers>,
    signal: BulkSignal,
    peer: SocketAddr,
    permit: OwnedSemaphorePermit,
    handshake: Handshake,
) {
    let mut tracked = Tracked::accepted(drivers.metrics.connections(), Transport::Quic);
    let handshaken = tokio::time::timeout(drivers.limits.handshake_timeout, connecting).await;
    drop(handshake);
    let conn = match handshaken {
        Ok(Ok(conn)) => conn,
        Ok(Err(e)) => {
            tracked.close(Protocol::None, Close::HandshakeFailed);
            return tracing::debug!(%peer, error = %e, "h3: handshake failed");
        }
        Err(_) => {
            tracked.close(Protocol::None, Close::HandshakeTimeout);
            return tracing::debug!(%peer, "h3: handshake timed out");
        }
    };
    tracked.close(Protocol::H3, Close::Closed);
    // Declared before everything that holds the connection: read last, once closed.
    let _stats = stats::OnEnd(conn.clone());
    let sni = conn
        .handshake_data()
        .and_then(|d| d.downcast::<quinn::crypto::rustls::HandshakeData>().ok())
        .and_then(|d| d.server_name);
    // QUIC is TLS 1.3; quinn does not say which suite it picked.
    let tls = crate::message::TlsInfo {
        version: "TLSv1_3",
        cipher: None,
    };
    let site = drivers.service.sites().site_for(sni.as_deref());
    let ctx = drivers.connection(peer, site, Some(tls));
    let quic = conn.clone();
    let mut builder = h3::server::builder();
    builder.max_field_section_size(ctx.limits.max_header_bytes as u64);
    if ctx.webtransport_sessions > 0 {
        // draft-02's ENABLE_WEBTRANSPORT (what Chromium and aioquic check) and the
        // later WEBTRANSPORT_MAX_SESSIONS both go out.
        builder
            .enable_webtransport(true)
            .enable_extended_connect(true)
            .enable_datagram(true)
            .max_webtransport_sessions(ctx.webtransport_sessions as u64);
    }
    // One allowance for every send stream of the connection, WebTransport's too.
    let checks = backend::StopChecks::default();
    let mut h3 = match builder
        .build::<_, Bytes>(uni::Connection::new(conn, checks.clone()))
        .await
    {
        Ok(h3) => h3,
        Err(e) => {
            tracked.close(Protocol::H3, Close::ProtocolError);
            return tracing::debug!(%peer, error = %e, "h3: connection setup failed");
        }
    };
    let permit = Arc::new(permit);
    let wt = (ctx.webtransport_sessions > 0).then(|| WtConn::new(quic.clone(), checks));
    let mut shutdown = ctx.shutdown.clone();
    let mut closing = false;
    let mut check = tokio::time::interval(Duration::from_millis(100));
    // QUIC's idle timeout does not see an application that is idle while the client
    // keeps the connection alive with PINGs: with no request for `idle_timeout`, the
    // connection goes (GOAWAY, then H3_NO_ERROR), as an idle HTTP/2 one does.
    let mut idle_since = tokio::time::Instant::now();
    // While closing: what the connection had sent at the last check, and since when.
    let mut quiet = (0u64, tokio::time::Instant::now());
    loop {
        let accept = std::future::poll_fn(|cx| {
            let polled = h3.poll_accept_request_stream(cx);
            // Polling also accepts unidirectional streams: WebTransport's wait here.
            if let Some(wt) = &wt {
                for (session, stream) in h3.inner.accepted_streams_mut().wt_uni_streams.drain(..) {
                    wt.route_uni(session, stream);
                }
            }
            polled
        });
        let accepted = tokio::select! {
            accepted = accept => accepted.map(|s| s.map(|s| {
                // The offer slot is shared before h3 wraps the stream, which hides it.
                let offer_slot = s.offer_slot();
                (h3.create_resolver(h3::frame::FrameStream::new(h3::stream::BufRecvStream::new(s))), offer_slot)
            })),
            () = shutdown.requested(), if !closing => {
                closing = true;
                // GOAWAY: no new requests; those in flight finish.
                if let Err(e) = h3.shutdown(0).await {
                    tracing::debug!(%peer, error = %e, "h3: goaway");
                }
                continue;
            }
            // After GOAWAY h3 waits for the client to close (or, for WebTransport
            // streams, for ends it never sees): once no request task holds the
            // connection, it is done, and shutdown need not wait for the client.
            _ = check.tick() => {
                let idle = Arc::strong_count(&permit) == 1;
                // A response whose task is done may still sit in quinn's send
                // buffer (up to the send window): closing the connection would
                // discard it. So a draining connection closes once it has sent
                // nothing for CLOSE_QUIET (all acknowledged, or the client stalls).
                if closing && idle {
                    let sent = quic.stats().udp_tx.bytes;
                    if sent != quiet.0 {
                        quiet = (sent, tokio::time::Instant::now());
                    } else if quiet.1.elapsed() >= CLOSE_QUIET {
                        break;
                    }
                }
                if !idle {
                    idle_since = tokio::time::Instant::now();
                } else if idle_since.elapsed() >= ctx.limits.idle_timeout {
                    tracked.close(Protocol::H3, Close::IdleTimeout);
                    tracing::debug!(%peer, "h3: idle, connection closed");
                    let goaway = tokio::time::timeout(Duration::from_secs(1), h3.shutdown(0));
                    if let Ok(Err(e)) = goaway.await {
                        tracing::debug!(%peer, error = %e, "h3: goaway");
                    }
                    break;
                }
                continue;
            }
        };
        match accepted {
            Ok(Some((resolver, offer_slot))) => {
                // A request that comes and goes between two checks is activity too.
                idle_since = tokio::time::Instant::now();
                let ctx = ctx.clone();
                let signal = signal.clone();
                // Each request keeps the connection's permit alive until it is done.
                let permit = permit.clone();
                let wt = wt.clone();
                tokio::spawn(async move {
                    request(resolver, offer_slot, &ctx, &signal, wt).await;
                    drop(permit);
                });
            }
            Ok(None) => break,
            Err(e) => {
                tracked.close(
                    Protocol::H3,
                    quic.close_reason().map_or(Close::Error, |r| close_reason(&r)),
                );
                tracing::debug!(%peer, error = %e, "h3: connection ended");
                break;
            }
        }
    }
    // H3_NO_ERROR; also ends the WebTransport datagram reader, which holds a handle.
    quic.close(quinn::VarInt::from_u32(0x100), b"");
    RECEIVED.fetch_add(quic.stats().udp_rx.bytes, std::sync::atomic::Ordering::Relaxed);
}

/// UDP payload bytes received by QUIC connections that served HTTP/3, added when
/// each closes (for the metrics).
static RECEIVED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Bytes received by closed HTTP/3 connections so far (see [`RECEIVED`]).
pub(crate) fn received_bytes() -> u64 {
    RECEIVED.load(std::sync::atomic::Ordering::Relaxed)
}

/// The `reason` a QUIC connection's close is counted under.
fn close_reason(e: &quinn::ConnectionError) -> Close {
    use quinn::ConnectionError as E;
    match e {
        E::TimedOut => Close::IdleTimeout,
        E::Reset => Close::Reset,
        E::ApplicationClosed(_) | E::ConnectionClosed(_) | E::LocallyClosed => Close::Closed,
        E::TransportError(_) | E::VersionMismatch => Close::ProtocolError,
        E::CidsExhausted => Close::Error,
    }
}

type Resolver = h3::server::RequestResolver<uni::Connection, Bytes>;
/// Reads what is left of a request nobody needs, for at most [`DRAIN_TIME`] and
/// [`DRAIN_BYTES`], then lets it go.
async fn drain_request(mut recv: RecvHalf) {
    use bytes::Buf;
    let drain = async {
        let mut left = DRAIN_BYTES;
        while let Ok(Some(chunk)) = recv.recv_data().await {
            left = left.saturating_sub(chunk.remaining());
            if left == 0 {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(DRAIN_TIME, drain).await;
}

/// Bounds of [`drain_request`].
const DRAIN_TIME: Duration = Duration::from_secs(2);
const DRAIN_BYTES: usize = 64 * 1024;

type SendHalf = h3::server::RequestStream<backend::SendStream, Bytes>;
type RecvHalf = h3::server::RequestStream<backend::RecvStream, Bytes>;

/// A request body read from an h3 stream's receive half, trailers included.
///
/// Dropped unread (a file request, or a proxied request without a body), it hands the
/// receive half back to the request task instead of closing it: closing it would send
/// STOP_SENDING while the client may still be about to FIN its request, which the
/// client sees as its request being refused. The task drops it after the response.
struct H3Body {
    recv: Option<RecvHalf>,
    park: Option<tokio::sync::oneshot::Sender<RecvHalf>>,
    data_done: bool,
    done: bool,
}

impl Drop for H3Body {
    fn drop(&mut self) {
        if let (Some(recv), Some(park)) = (self.recv.take(), self.park.take()) {
            let _ = park.send(recv);
        }
    }
}

impl http_body::Body for H3Body {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        use bytes::Buf;
        use std::task::Poll;
        let this = &mut *self;
        let Some(recv) = this.recv.as_mut() else {
            return Poll::Ready(None);
        };
        if this.done {
            return Poll::Ready(None);
        }
        if !this.data_done {
            match std::task::ready!(recv.poll_recv_data(cx)) {
                Ok(Some(mut buf)) => {
                    let n = buf.remaining();
                    return Poll::Ready(Some(Ok(http_body::Frame::data(buf.copy_to_bytes(n)))));
                }
                Ok(None) => this.data_done = true,
                Err(e) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(Box::new(e))));
                }
            }
        }
        let trailers = std::task::ready!(recv.poll_recv_trailers(cx));
        this.done = true;
        match trailers {
            Ok(Some(t)) => Poll::Ready(Some(Ok(http_body::Frame::trailers(t)))),
            Ok(None) => Poll::Ready(None),
            Err(e) => Poll::Ready(Some(Err(Box::new(e)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }
}

/// Lets h3 forget a request stream that will never be a request. h3 0.0.8 keeps the
/// id of every stream it accepted until a request made from it ends, so a stream that
/// ended (FIN or reset) or timed out before its HEADERS would stay in its table for
/// the connection's life, and a client opening and finishing empty streams in a loop
/// would grow it without bound. The stream is reset with `code`, then made into a
/// request with an empty field section (QPACK prefix only) that is dropped at once:
/// that ends it in h3's table.
fn release(mut resolver: Resolver, code: h3::error::Code) {
    use h3::quic::SendStream as _;
    resolver.frame_stream.reset(code.value());
    let empty = h3::proto::frame::Frame::Headers(Bytes::from_static(&[0, 0]));
    drop(resolver.accept_with_frame(Ok(Some(empty))));
}

async fn request(
    mut resolver: Resolver,
    offer_slot: Arc<backend::Offer>,
    ctx: &ConnContext,
    signal: &BulkSignal,
    wt: Option<Arc<WtConn>>,
) {
    use h3::frame::FrameStreamError;
    let peer = ctx.peer();
    // The request's HEADERS frame must arrive whole within the header timeout, as an
    // HTTP/1.1 request head must.
    let first = std::future::poll_fn(|cx| resolver.frame_stream.poll_next(cx));
    let Ok(first) = tokio::time::timeout(ctx.limits.header_read_timeout, first).await else {
        tracing::debug!(%peer, "h3: no request head within the header timeout");
        return release(resolver, h3::error::Code::H3_REQUEST_INCOMPLETE);
    };
    if let (Some(wt), Ok(Some(h3::proto::frame::Frame::WebTransportStream(session)))) = (&wt, &first) {
        wt.route_bidi(*session, resolver.frame_stream.into_inner());
        return;
    }
    // Ended or reset before its head: not a request (and nothing to answer).
    if matches!(
        first,
        Ok(None) | Err(FrameStreamError::Quic(_) | FrameStreamError::UnexpectedEnd)
    ) {
        return release(resolver, h3::error::Code::H3_REQUEST_INCOMPLETE);
    }
    // The encoded field section, for the rules h3 does not check (shares the bytes).
    let section = match &first {
        Ok(Some(h3::proto::frame::Frame::Headers(section))) => section.clone(),
        _ => Bytes::new(),
    };
    let resolved = match resolver.accept_with_frame(first) {
        Ok(resolved) => resolved.resolve().await,
        Err(e) => Err(e),
    };
    let (req, mut stream) = match resolved {
        Ok(r) => r,
        Err(e) => return tracing::debug!(%peer, error = %e, "h3: bad request"),
    };
    let (parts, ()) = req.into_parts();
    if let Some(why) = fields::malformed(&section, &parts.headers) {
        // RFC 9114 §4.1.2: a malformed request is a stream error H3_MESSAGE_ERROR,
        // as h3 answers the malformations it finds itself.
        tracing::debug!(%peer, why, "h3: malformed request");
        stream.stop_stream(h3::error::Code::H3_MESSAGE_ERROR);
        stream.stop_sending(h3::error::Code::H3_MESSAGE_ERROR);
        return;
    }
    let head = ctx.head(&parts.method, &parts.uri, http::Version::HTTP_3, &parts.headers);
    let webtransport = parts.method == http::Method::CONNECT
        && parts.extensions.get::<h3::ext::Protocol>() == Some(&h3::ext::Protocol::WEB_TRANSPORT);
    if let (true, Some(wt)) = (webtransport, wt) {
        return webtransport_connect(ctx, &head, stream, wt, signal).await;
    }
    let (mut stream, recv) = stream.split();
    let (park, mut parked) = tokio::sync::oneshot::channel();
    let body = http_body_util::BodyExt::boxed_unsync(H3Body {
        recv: Some(recv),
        park: Some(park),
        data_done: false,
        done: false,
    });
    let (resp, record) = ctx.handle(&head, body).await;
    let writer = Writer {
        stream: &mut stream,
        offer_slot: &offer_slot,
        ctx,
        signal,
    };
    let result = respond(writer, resp, record).await;
    // The response is complete. A request whose end has not arrived yet (its FIN can
    // trail a fast response) gets a moment to finish before the receive half goes:
    // closing it early would send STOP_SENDING, which clients report as an error.
    if let Ok(recv) = parked.try_recv() {
        tokio::spawn(drain_request(recv));
    }
    if let Err(e) = result {
        // Typically the client cancelled (STOP_SENDING) or went away: stop reading.
        tracing::debug!(%peer, error = %e, "h3: response not completed");
    }
}

/// A WebTransport extended CONNECT: admitted, the session runs on this stream.
async fn webtransport_connect(
    ctx: &ConnContext,
    head: &crate::message::RequestHead<'_>,
    mut stream: crate::webtransport::h3::ConnectStream,
    wt: Arc<WtConn>,
    signal: &BulkSignal,
) {
    let admitted = ctx.admit_webtransport(head);
    let (mut resp, _) = ctx.webtransport_response(&admitted).into_http();
    let Ok(admission) = admitted else {
        // The refusal's status, then the end of the stream: the client reads both.
        let refuse = async {
            stream.send_response(resp).await?;
            stream.finish().await
        };
        if let Err(e) = tokio::time::timeout(ctx.limits.send_timeout, refuse).await {
            tracing::debug!(peer = %ctx.peer(), error = %e, "h3: WebTransport refusal not delivered");
        }
        return;
    };
    // The draft-02 answer, which Chromium and aioquic check for.
    resp.headers_mut().insert(
        "sec-webtransport-http3-draft",
        http::HeaderValue::from_static("draft02"),
    );
    let on_bulk = || {
        if ctx.bbr && signal.raise() {
            tracing::info!(peer = %ctx.peer(), "h3: WebTransport session, connection switches to BBR");
        }
    };
    crate::webtransport::h3::run(wt, admission, stream, resp, on_bulk, ctx.shutdown.clone()).await;
}

async fn respond(mut writer: Writer<'_>, resp: Response, record: Record) -> Result<(), SendError> {
    let (stream, ctx) = (&mut *writer.stream, writer.ctx);
    let (head, body) = resp.into_http();
    let mut body = ResponseBody::ramped(body, STREAM_CHUNK).recorded(record);
    // The head waits for the client's stream credit like any data.
    let sent = match tokio::time::timeout(ctx.limits.send_timeout, stream.send_response(head)).await {
        Ok(sent) => sent.map_err(SendError::peer),
        Err(_) => {
            stream.stop_stream(h3::error::Code::H3_INTERNAL_ERROR);
            Err(SendError::Timeout)
        }
    };
    if let Err(e) = sent {
        body.settle(e.outcome());
        return Err(e);
    }
    send_body(body, &mut writer, ctx.limits.send_timeout).await
}

/// One response stream, as the shared send loop writes it.
struct Writer<'a> {
    stream: &'a mut SendHalf,
    /// Where each chunk of at least [`backend::OFFER_MIN`] is offered to the
    /// stream's backend, which then hands it to quinn without copying it.
    offer_slot: &'a backend::Offer,
    ctx: &'a ConnContext,
    signal: &'a BulkSignal,
}

impl BodyWriter for Writer<'_> {
    async fn data(&mut self, data: Bytes) -> Result<(), SendError> {
        if data.len() < backend::OFFER_MIN {
            // Copied: quinn would keep the chunk's whole allocation until it is
            // acknowledged, and the window counts only the chunk.
            return self.stream.send_data(data).await.map_err(SendError::peer);
        }
        // A refcount, not a copy; the backend takes it with the frame. The guard
        // withdraws it if the write ends (or is cancelled) before that.
        let _offered = self.offer_slot.lend(data.clone());
        self.stream.send_data(data).await.map_err(SendError::peer)
    }

    async fn trailers(&mut self, trailers: http::HeaderMap) -> Result<(), SendError> {
        self.stream.send_trailers(trailers).await.map_err(SendError::peer)
    }

    async fn finish(&mut self) -> Result<(), SendError> {
        self.stream.finish().await.map_err(SendError::peer)
    }

    /// A dropped send half would finish the stream and make a short body look
    /// complete: reset it instead.
    fn abort(&mut self) {
        self.stream.stop_stream(h3::error::Code::H3_INTERNAL_ERROR);
    }

    /// Switches the connection to BBR once a response (file or relayed) proves bulk,
    /// and yields between the chunks of a file. quinn takes a chunk at once while
    /// the connection's send window (`h3_send_window_bytes`, 16 MiB) has room, so
    /// without the yield the task would read and queue a whole file before the
    /// connection's driver, on the same worker, sent its first packet (a 1 MiB
    /// file: thirteen reads, then the first datagram); now the driver sends each
    /// chunk while the next is read. Not after a file's last chunk (its end then
    /// leaves in the same packet) nor for relayed bodies, whose chunks arrive when
    /// the upstream sends them (`Coalesced` hands over what is ready and waits).
    async fn progress(&mut self, progress: Progress) -> Result<(), SendError> {
        let sent = progress.sent;
        if self.ctx.bbr && sent >= self.ctx.h3.bbr_switch_bytes && self.signal.raise() {
            tracing::info!(peer = %self.ctx.peer(), sent, "h3: bulk response, connection switches to BBR");
        }
        if progress.file_left {
            tokio::task::yield_now().await;
        }
        Ok(())
    }
}

/// Locks `m`, poisoned or not: what the h3 sockets guard stays usable after a panic
/// elsewhere, and they keep serving.
fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
