//! WebTransport: the bounded diagnostic endpoint a site may enable
//! (`[sites.webtransport]`), over HTTP/3 ([`h3`], draft-02 as Chromium and aioquic
//! speak it) and over HTTP/2 ([`h2`], extended CONNECT with the capsule protocol).
//!
//! The transports hand streams and datagrams to [`diag`], which runs the session's
//! mode (echo, sink, source) against the [`SessionState`] that enforces every limit.
//! A limit that trips closes the session with its own [`Code`] and counts it in the
//! endpoint's [`Counters`], which a GET on the endpoint's path returns as JSON.

pub mod capsule;
pub mod diag;
pub(crate) mod h2;
pub(crate) mod h3;
mod metrics;
pub(crate) mod session;

pub(crate) use metrics::Metrics;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, StatusCode, Uri};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use crate::config::{WebTransport, WtMode};

/// How long a session may run on after the server starts shutting down and sends
/// DRAIN_WEBTRANSPORT_SESSION; then it is closed with [`Code::Shutdown`].
pub(crate) const DRAIN_TIME: Duration = Duration::from_secs(2);

/// Why a session ended: the code goes in CLOSE_WEBTRANSPORT_SESSION.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub(crate) enum Code {
    /// The client closed the session, or it finished normally.
    Done = 0,
    TooManyStreams = 0x5701,
    CapsuleTooLarge = 0x5702,
    DatagramTooLarge = 0x5703,
    DatagramRate = 0x5704,
    SessionBytes = 0x5705,
    IdleTimeout = 0x5706,
    BadCommand = 0x5707,
    /// The peer broke the protocol (a malformed capsule, an unknown stream).
    Protocol = 0x5708,
    /// The server is shutting down.
    Shutdown = 0x5709,
}

impl Code {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Done => "done",
            Self::TooManyStreams => "too_many_streams",
            Self::CapsuleTooLarge => "capsule_too_large",
            Self::DatagramTooLarge => "datagram_too_large",
            Self::DatagramRate => "datagram_rate",
            Self::SessionBytes => "session_bytes",
            Self::IdleTimeout => "idle_timeout",
            Self::BadCommand => "bad_command",
            Self::Protocol => "protocol_error",
            Self::Shutdown => "shutdown",
        }
    }

    const ALL: [Code; 10] = [
        Self::Done,
        Self::TooManyStreams,
        Self::CapsuleTooLarge,
        Self::DatagramTooLarge,
        Self::DatagramRate,
        Self::SessionBytes,
        Self::IdleTimeout,
        Self::BadCommand,
        Self::Protocol,
        Self::Shutdown,
    ];
}

/// The HTTP/3 error code a WebTransport application code maps to on a stream reset
/// (draft-ietf-webtrans-http3 §4.3: codes skip the reserved greasing values).
pub(crate) fn stream_error_code(code: u32) -> u64 {
    const FIRST: u64 = 0x52e4_a40f_a8db;
    let code = u64::from(code);
    FIRST + code + code / 0x1e
}

/// The endpoint's counters, returned by a GET on its path.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub sessions_accepted: AtomicU64,
    pub sessions_active: AtomicU64,
    pub refused_origin: AtomicU64,
    pub refused_mode: AtomicU64,
    pub refused_capacity: AtomicU64,
    /// Sessions ended, by [`Code`], in [`Code::ALL`] order.
    closed: [AtomicU64; 10],
    pub streams: AtomicU64,
    pub stream_bytes_in: AtomicU64,
    pub stream_bytes_out: AtomicU64,
    pub datagrams_in: AtomicU64,
    pub datagrams_out: AtomicU64,
    /// Datagrams that found a full queue (ours or the connection's) and were dropped.
    pub datagrams_dropped: AtomicU64,
}

impl Counters {
    fn closed(&self, code: Code) -> &AtomicU64 {
        let i = Code::ALL.iter().position(|c| *c == code).unwrap_or(0);
        &self.closed[i]
    }

    /// One JSON object, flat, keys stable.
    pub(crate) fn json(&self) -> String {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mut out = format!(
            "{{\"sessions_accepted\": {}, \"sessions_active\": {}, \"refused_origin\": {}, \
             \"refused_mode\": {}, \"refused_capacity\": {}, \"streams\": {}, \
             \"stream_bytes_in\": {}, \"stream_bytes_out\": {}, \"datagrams_in\": {}, \
             \"datagrams_out\": {}, \"datagrams_dropped\": {}",
            get(&self.sessions_accepted),
            get(&self.sessions_active),
            get(&self.refused_origin),
            get(&self.refused_mode),
            get(&self.refused_capacity),
            get(&self.streams),
            get(&self.stream_bytes_in),
            get(&self.stream_bytes_out),
            get(&self.datagrams_in),
            get(&self.datagrams_out),
            get(&self.datagrams_dropped),
        );
        for code in Code::ALL {
            out.push_str(&format!(
                ", \"closed_{}\": {}",
                code.name(),
                get(self.closed(code))
            ));
        }
        out.push_str("}\n");
        out
    }
}

/// A site's diagnostic endpoint: its limits, its session slots and its counters.
#[derive(Debug)]
pub(crate) struct Endpoint {
    pub config: WebTransport,
    sessions: Arc<Semaphore>,
    /// Shared with the site's endpoint in other generations (see [`metrics`]).
    pub counters: Arc<Counters>,
}

/// Why a CONNECT did not become a session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Refusal {
    pub status: StatusCode,
    pub reason: &'static str,
}

impl Endpoint {
    /// An endpoint with counters of its own.
    #[cfg(test)]
    pub(crate) fn new(config: WebTransport) -> Self {
        Self {
            sessions: Arc::new(Semaphore::new(config.max_sessions)),
            config,
            counters: Arc::default(),
        }
    }

    /// `site`'s endpoint, counting in the site's counters (which continue across
    /// reloads and are what the metrics read).
    pub(crate) fn for_site(config: WebTransport, site: &str) -> Self {
        Self {
            sessions: Arc::new(Semaphore::new(config.max_sessions)),
            config,
            counters: metrics::counters(site),
        }
    }

    /// Whether a request path (query ignored) is this endpoint's.
    pub(crate) fn matches(&self, uri: &Uri) -> bool {
        uri.path() == self.config.path
    }

    /// Checks a WebTransport CONNECT: its Origin against the allow-list, the mode it
    /// asks for (`?mode=`, echo by default) and a free session slot.
    pub(crate) fn admit(self: &Arc<Self>, uri: &Uri, headers: &HeaderMap) -> Result<Admission, Refusal> {
        let origin = headers.get(http::header::ORIGIN).and_then(|v| v.to_str().ok());
        let any = self.config.allowed_origins.iter().any(|o| o == "*");
        let allowed = any
            || origin.is_some_and(|o| {
                self.config
                    .allowed_origins
                    .iter()
                    .any(|a| a.eq_ignore_ascii_case(o))
            });
        if !allowed {
            self.counters.refused_origin.fetch_add(1, Ordering::Relaxed);
            return Err(Refusal {
                status: StatusCode::FORBIDDEN,
                reason: "origin not allowed",
            });
        }
        let mode = match requested_mode(uri) {
            Some(mode) if self.config.modes.contains(&mode) => mode,
            _ => {
                self.counters.refused_mode.fetch_add(1, Ordering::Relaxed);
                return Err(Refusal {
                    status: StatusCode::BAD_REQUEST,
                    reason: "unknown or disabled mode",
                });
            }
        };
        let Ok(permit) = self.sessions.clone().try_acquire_owned() else {
            self.counters.refused_capacity.fetch_add(1, Ordering::Relaxed);
            return Err(Refusal {
                status: StatusCode::TOO_MANY_REQUESTS,
                reason: "too many sessions",
            });
        };
        Ok(Admission {
            endpoint: self.clone(),
            mode,
            permit,
        })
    }

    /// The counters as an HTTP response (GET on the endpoint's path).
    pub(crate) fn stats_response(&self) -> crate::message::Response {
        let mut resp = crate::message::Response::status(StatusCode::OK);
        resp.headers.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        resp.headers.insert(
            http::header::CACHE_CONTROL,
            http::HeaderValue::from_static("no-store"),
        );
        let json = Bytes::from(self.counters.json());
        resp.headers
            .insert(http::header::CONTENT_LENGTH, http::HeaderValue::from(json.len()));
        resp.body = crate::message::Body::Bytes(json);
        resp
    }
}

fn requested_mode(uri: &Uri) -> Option<WtMode> {
    let query = uri.query().unwrap_or("");
    let mut mode = Some(WtMode::Echo);
    for pair in query.split('&') {
        if let Some(value) = pair.strip_prefix("mode=") {
            mode = match value {
                "echo" => Some(WtMode::Echo),
                "sink" => Some(WtMode::Sink),
                "source" => Some(WtMode::Source),
                _ => None,
            };
        }
    }
    mode
}

/// An admitted CONNECT: holds its session slot until the session ends.
#[derive(Debug)]
pub(crate) struct Admission {
    endpoint: Arc<Endpoint>,
    pub mode: WtMode,
    permit: OwnedSemaphorePermit,
}

impl Admission {
    /// Starts the session's bookkeeping; the transport then drives it.
    pub(crate) fn start(self) -> Arc<SessionState> {
        let c = &self.endpoint.counters;
        c.sessions_accepted.fetch_add(1, Ordering::Relaxed);
        c.sessions_active.fetch_add(1, Ordering::Relaxed);
        let config = &self.endpoint.config;
        Arc::new(SessionState {
            streams: Arc::new(Semaphore::new(config.max_streams_per_session)),
            bytes_left: AtomicU64::new(config.max_session_bytes),
            bucket: Mutex::new(Bucket {
                tokens: f64::from(config.max_datagrams_per_sec),
                at: Instant::now(),
            }),
            started: Instant::now(),
            last_activity_ms: AtomicU64::new(0),
            end: OnceLock::new(),
            ended: Notify::new(),
            mode: self.mode,
            endpoint: self.endpoint,
            _permit: self.permit,
            stream_bytes_in: AtomicU64::new(0),
            datagrams_in: AtomicU64::new(0),
            datagram_bytes_in: AtomicU64::new(0),
        })
    }
}

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

/// How a session ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct End {
    pub code: Code,
    pub reason: String,
    /// Whether the client ended it (then no close capsule goes back).
    pub by_client: bool,
}

/// One session's limits and tallies, shared by its streams and datagram handling.
#[derive(Debug)]
pub(crate) struct SessionState {
    endpoint: Arc<Endpoint>,
    pub mode: WtMode,
    streams: Arc<Semaphore>,
    bytes_left: AtomicU64,
    bucket: Mutex<Bucket>,
    started: Instant,
    last_activity_ms: AtomicU64,
    end: OnceLock<End>,
    ended: Notify,
    _permit: OwnedSemaphorePermit,
    /// This session's receive totals, which sink mode reports.
    pub stream_bytes_in: AtomicU64,
    pub datagrams_in: AtomicU64,
    pub datagram_bytes_in: AtomicU64,
}

impl Drop for SessionState {
    fn drop(&mut self) {
        let c = &self.endpoint.counters;
        c.sessions_active.fetch_sub(1, Ordering::Relaxed);
        c.closed(self.end_code()).fetch_add(1, Ordering::Relaxed);
    }
}

impl SessionState {
    pub(crate) fn config(&self) -> &WebTransport {
        &self.endpoint.config
    }

    pub(crate) fn counters(&self) -> &Counters {
        &self.endpoint.counters
    }

    /// Ends the session (the first end wins) and wakes everything waiting on it.
    pub(crate) fn end(&self, code: Code, reason: impl Into<String>, by_client: bool) {
        let reason = reason.into();
        if self
            .end
            .set(End {
                code,
                reason: reason.clone(),
                by_client,
            })
            .is_ok()
        {
            if code != Code::Done {
                tracing::info!(code = code.name(), %reason, "webtransport: session closed");
            }
            self.ended.notify_waiters();
        }
    }

    /// Ends the session for breaking a limit.
    pub(crate) fn fail(&self, code: Code, reason: impl Into<String>) {
        self.end(code, reason, false);
    }

    pub(crate) fn ending(&self) -> Option<&End> {
        self.end.get()
    }

    /// The code the session ended with (done while it runs).
    pub(crate) fn end_code(&self) -> Code {
        self.end.get().map_or(Code::Done, |e| e.code)
    }

    /// Resolves once the session has ended.
    pub(crate) async fn ended(&self) {
        loop {
            let notified = self.ended.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.end.get().is_some() {
                return;
            }
            notified.await;
        }
    }

    pub(crate) fn touch(&self) {
        let ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_activity_ms.store(ms, Ordering::Relaxed);
    }

    /// How long the session has been without traffic.
    pub(crate) fn idle_for(&self) -> Duration {
        let last = Duration::from_millis(self.last_activity_ms.load(Ordering::Relaxed));
        self.started.elapsed().saturating_sub(last)
    }

    /// Charges `n` bytes (either way) to the session's budget; `false` (and the
    /// session ended) when that spends more than it had.
    pub(crate) fn charge(&self, n: usize) -> bool {
        self.touch();
        let n = n as u64;
        let ok = self
            .bytes_left
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |left| left.checked_sub(n))
            .is_ok();
        if !ok {
            self.fail(
                Code::SessionBytes,
                format!(
                    "the session moved more than {} bytes",
                    self.config().max_session_bytes
                ),
            );
        }
        ok
    }

    /// A slot for one more client stream, or the session ends for having too many.
    pub(crate) fn stream_slot(&self) -> Option<OwnedSemaphorePermit> {
        self.touch();
        match self.streams.clone().try_acquire_owned() {
            Ok(p) => {
                self.counters().streams.fetch_add(1, Ordering::Relaxed);
                Some(p)
            }
            Err(_) => {
                self.fail(
                    Code::TooManyStreams,
                    format!(
                        "more than {} streams open in one session",
                        self.config().max_streams_per_session
                    ),
                );
                None
            }
        }
    }

    /// Admits one received datagram of `len` bytes against the size and rate limits.
    pub(crate) fn datagram_in(&self, len: usize) -> bool {
        self.touch();
        let config = self.config();
        if len > config.max_datagram_bytes {
            self.fail(
                Code::DatagramTooLarge,
                format!(
                    "a {len}-byte datagram is over the {}-byte limit",
                    config.max_datagram_bytes
                ),
            );
            return false;
        }
        let rate = f64::from(config.max_datagrams_per_sec);
        let within = {
            let mut b = self
                .bucket
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let now = Instant::now();
            b.tokens = (b.tokens + now.duration_since(b.at).as_secs_f64() * rate).min(rate);
            b.at = now;
            if b.tokens >= 1.0 {
                b.tokens -= 1.0;
                true
            } else {
                false
            }
        };
        if !within {
            self.fail(
                Code::DatagramRate,
                format!("more than {} datagrams per second", config.max_datagrams_per_sec),
            );
            return false;
        }
        self.counters().datagrams_in.fetch_add(1, Ordering::Relaxed);
        self.datagrams_in.fetch_add(1, Ordering::Relaxed);
        self.datagram_bytes_in.fetch_add(len as u64, Ordering::Relaxed);
        self.charge(len)
    }
}

/// Boxed futures for the object-safe transport interface.
pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A stream's send half: bytes, a clean finish (`shutdown`), or a reset.
pub(crate) trait SendHalf: AsyncWrite + Unpin + Send {
    fn reset(&mut self, code: u32);
}

/// A stream's receive half; `stop` asks the peer to stop sending.
pub(crate) trait RecvHalf: AsyncRead + Unpin + Send {
    fn stop(&mut self, code: u32);
}

/// What a session's mode needs from its transport beyond the streams it is given.
pub(crate) trait Transport: Send + Sync {
    /// Opens a server-initiated unidirectional stream in the session.
    fn open_uni(&self) -> BoxFuture<'_, std::io::Result<Box<dyn SendHalf>>>;
    /// Sends a datagram, waiting while the connection cannot take it.
    fn send_datagram(&self, payload: Bytes) -> BoxFuture<'_, std::io::Result<()>>;
    /// Sends a datagram if it can go now; `false` when it was dropped.
    fn try_send_datagram(&self, payload: Bytes) -> bool;
    /// The largest datagram payload the connection carries now.
    fn max_datagram(&self) -> usize;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> WebTransport {
        WebTransport {
            path: "/wt".into(),
            allowed_origins: vec!["https://app.test".into()],
            modes: vec![WtMode::Echo, WtMode::Sink],
            max_sessions: 1,
            max_streams_per_session: 2,
            max_capsule_bytes: 1024,
            max_datagram_bytes: 100,
            max_datagrams_per_sec: 3,
            max_session_bytes: 1000,
            idle_timeout: Duration::from_secs(5),
        }
    }

    fn headers(origin: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(o) = origin {
            h.insert(http::header::ORIGIN, o.parse().unwrap());
        }
        h
    }

    #[test]
    fn admission_checks_origin_mode_and_capacity() {
        let ep = Arc::new(Endpoint::new(config()));
        let uri: Uri = "/wt?mode=sink".parse().unwrap();
        assert_eq!(
            ep.admit(&uri, &headers(None)).unwrap_err().status,
            StatusCode::FORBIDDEN
        );
        assert_eq!(
            ep.admit(&uri, &headers(Some("https://evil.test")))
                .unwrap_err()
                .status,
            StatusCode::FORBIDDEN
        );
        let source: Uri = "/wt?mode=source".parse().unwrap();
        assert_eq!(
            ep.admit(&source, &headers(Some("https://app.test")))
                .unwrap_err()
                .status,
            StatusCode::BAD_REQUEST
        );
        let first = ep.admit(&uri, &headers(Some("https://APP.test"))).unwrap();
        assert_eq!(first.mode, WtMode::Sink);
        assert_eq!(
            ep.admit(&uri, &headers(Some("https://app.test")))
                .unwrap_err()
                .status,
            StatusCode::TOO_MANY_REQUESTS
        );
        let session = first.start();
        drop(session);
        assert!(ep
            .admit(&"/wt".parse().unwrap(), &headers(Some("https://app.test")))
            .is_ok());
        let json = ep.counters.json();
        assert!(json.contains("\"refused_origin\": 2"), "{json}");
        assert!(json.contains("\"refused_capacity\": 1"), "{json}");
        assert!(json.contains("\"closed_done\": 1"), "{json}");
    }

    #[test]
    fn limits_end_the_session_with_their_code() {
        let ep = Arc::new(Endpoint::new(config()));
        let origin = headers(Some("https://app.test"));
        let s = ep.admit(&"/wt".parse().unwrap(), &origin).unwrap().start();
        let a = s.stream_slot().unwrap();
        let _b = s.stream_slot().unwrap();
        assert!(s.ending().is_none());
        assert!(s.stream_slot().is_none());
        assert_eq!(s.ending().unwrap().code, Code::TooManyStreams);
        drop(a);
        drop(s);

        let s = ep.admit(&"/wt".parse().unwrap(), &origin).unwrap().start();
        assert!(!s.datagram_in(101));
        assert_eq!(s.ending().unwrap().code, Code::DatagramTooLarge);
        drop(s);

        let s = ep.admit(&"/wt".parse().unwrap(), &origin).unwrap().start();
        assert!(s.datagram_in(10) && s.datagram_in(10) && s.datagram_in(10));
        assert!(!s.datagram_in(10));
        assert_eq!(s.ending().unwrap().code, Code::DatagramRate);
        drop(s);

        let s = ep.admit(&"/wt".parse().unwrap(), &origin).unwrap().start();
        assert!(s.charge(999));
        assert!(s.charge(1));
        assert!(!s.charge(1));
        assert_eq!(s.ending().unwrap().code, Code::SessionBytes);
        // The first end stands.
        s.fail(Code::IdleTimeout, "late");
        assert_eq!(s.ending().unwrap().code, Code::SessionBytes);
        drop(s);
        let json = ep.counters.json();
        for key in [
            "too_many_streams",
            "datagram_too_large",
            "datagram_rate",
            "session_bytes",
        ] {
            assert!(json.contains(&format!("\"closed_{key}\": 1")), "{key}: {json}");
        }
        assert!(json.contains("\"sessions_active\": 0"), "{json}");
    }

    #[test]
    fn stream_error_codes_skip_grease() {
        assert_eq!(stream_error_code(0), 0x52e4_a40f_a8db);
        assert_eq!(stream_error_code(0x1d), 0x52e4_a40f_a8db + 0x1d);
        assert_eq!(stream_error_code(0x1e), 0x52e4_a40f_a8db + 0x1f);
    }
}
