//! The record of one exchange: made when the service has answered a request, carried
//! inside the response body to wherever that body ends, and reported exactly once —
//! when the response is complete, or when it ends short (the client went, a write
//! stalled, the body failed, the connection closed under it). The access log and the
//! metrics are both written from this report and from nowhere else, so every driver
//! (h1, hyper's h1/h2, h3) and every mode (files, proxy, WebTransport) is counted the
//! same way.
//!
//! Cost on the hot path: two clock reads when the record is made, one at the first
//! pull of the body and one at its end; nothing is allocated unless the access log is
//! on (then the request line's fields are kept for the line).

use std::net::SocketAddr;
use std::time::{Duration, Instant, SystemTime};

use http::{HeaderValue, Method, Uri};

use super::transfers::{Entry, Transfer};
use super::{ConnContext, Proto};
use crate::message::{Body, RequestHead, Response, TlsInfo};
use crate::service::Route;

/// How a response ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Every byte was handed to the connection and the response was ended cleanly.
    Complete,
    /// Writing to the client failed: it went away or reset the stream.
    ClientGone,
    /// The client stopped reading for longer than `send_timeout`.
    Timeout,
    /// The body could not be produced (upstream reset, disk error, shrunk file).
    BodyError,
    /// The body was dropped before its end without a verdict: the connection closed
    /// under it (the client went, or the server shut it down).
    Unfinished,
}

impl Outcome {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Outcome::Complete => "complete",
            Outcome::ClientGone => "client_gone",
            Outcome::Timeout => "timeout",
            Outcome::BodyError => "body_error",
            Outcome::Unfinished => "unfinished",
        }
    }
}

/// The request fields only the access log needs, copied when it is on.
#[derive(Debug)]
pub(crate) struct RequestLine {
    pub(crate) method: Method,
    /// Absolute for h2 and h3 (`:scheme`, `:authority`), origin-form for h1.
    pub(crate) uri: Uri,
    /// The `Host` field (h1; h2 and h3 carry the authority in `uri`).
    pub(crate) host: Option<HeaderValue>,
    pub(crate) referer: Option<HeaderValue>,
    pub(crate) user_agent: Option<HeaderValue>,
}

/// One exchange in flight (see the module's note). Dropped without being reported
/// only when its body was never built, which the drivers do not do.
#[derive(Debug)]
pub(crate) struct Record {
    ctx: ConnContext,
    proto: Proto,
    route: Route,
    status: u16,
    /// When the request head was complete (the service was called).
    began: Instant,
    /// The same moment by the wall clock, for the log line.
    time: SystemTime,
    /// When the driver first pulled the body: its head is out or goes with these
    /// bytes (time to first byte).
    first_pull: Option<Instant>,
    /// Whether the response went out through kernel TLS (h1 after promotion).
    ktls: bool,
    line: Option<Box<RequestLine>>,
    /// Its slot among the large responses in flight, if it has one.
    transfer: Option<Transfer>,
}

/// When an exchange began: its request head was complete and the service was about
/// to be called (so the time the service took, an upstream's included, is in the
/// time to first byte and the duration).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Start {
    began: Instant,
    time: SystemTime,
}

impl Start {
    pub(crate) fn now() -> Self {
        Self {
            began: Instant::now(),
            time: SystemTime::now(),
        }
    }
}

/// An exchange the service has not answered yet. If the client goes first (its
/// stream reset, its connection closed: the driver drops the service's future, and
/// with it this), the exchange is still reported once, as nginx logs it: status 499
/// ("client closed request"), outcome `client_gone`, no site (the router's answer
/// never came), nothing sent.
#[derive(Debug)]
pub(crate) struct Pending {
    /// `Some` until answered (which consumes the `Pending`) or dropped.
    parts: Option<Parts>,
}

#[derive(Debug)]
struct Parts {
    ctx: ConnContext,
    proto: Proto,
    start: Start,
    line: Option<Box<RequestLine>>,
}

/// The status an exchange is logged with when its client left before the answer.
const CLIENT_CLOSED: u16 = 499;

impl Parts {
    fn into_record(self, route: Route, status: u16) -> Record {
        self.ctx
            .metrics
            .site(route.site)
            .begin(self.proto as usize, route.mode.index());
        Record {
            ctx: self.ctx,
            proto: self.proto,
            route,
            status,
            began: self.start.began,
            time: self.start.time,
            first_pull: None,
            ktls: false,
            line: self.line,
            transfer: None,
        }
    }
}

impl Pending {
    /// The service answered with `status` through `route`: the record the response
    /// body carries from here.
    pub(crate) fn answered(mut self, route: Route, status: u16) -> Record {
        // Always `Some` here: only this (which consumes `self`) and `drop` take it.
        let parts = self.parts.take().expect("a pending exchange is answered once");
        parts.into_record(route, status)
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(parts) = self.parts.take() {
            parts
                .into_record(Route::REFUSED, CLIENT_CLOSED)
                .finish(0, Outcome::ClientGone);
        }
    }
}

/// A finished exchange: what the access log and the metrics read.
#[derive(Debug)]
pub(crate) struct Finished<'a> {
    pub(crate) ctx: &'a ConnContext,
    pub(crate) proto: Proto,
    pub(crate) route: Route,
    /// The site's configured domain, if the request reached a site.
    pub(crate) site: Option<&'a str>,
    pub(crate) status: u16,
    /// Response body bytes handed to the connection.
    pub(crate) bytes: u64,
    /// When the request head was complete.
    pub(crate) time: SystemTime,
    /// From the request head to the first pull of the body.
    pub(crate) ttfb: Duration,
    /// From the request head to the end of the response.
    pub(crate) duration: Duration,
    pub(crate) outcome: Outcome,
    pub(crate) ktls: bool,
    pub(crate) tls: Option<TlsInfo>,
    pub(crate) peer: SocketAddr,
    /// The request line and headers the log prints; `None` when the access log is off.
    pub(crate) line: Option<&'a RequestLine>,
}

impl Record {
    /// The record of `head`'s exchange, begun at `start` and answered with `status`
    /// by `route`.
    pub(crate) fn new(
        ctx: &ConnContext,
        head: &RequestHead<'_>,
        start: Start,
        route: Route,
        status: u16,
    ) -> Self {
        Self::begin(ctx, head, start).answered(route, status)
    }

    /// An exchange whose request the service is about to answer (see [`Pending`]).
    pub(crate) fn begin(ctx: &ConnContext, head: &RequestHead<'_>, start: Start) -> Pending {
        let line = ctx.access.is_some().then(|| {
            let header = |name| head.headers.get(name).cloned();
            Box::new(RequestLine {
                method: head.method.clone(),
                uri: head.uri.clone(),
                host: header(http::header::HOST),
                referer: header(http::header::REFERER),
                user_agent: header(http::header::USER_AGENT),
            })
        });
        Pending {
            parts: Some(Parts {
                ctx: ctx.clone(),
                proto: Proto::of(head.version),
                start,
                line,
            }),
        }
    }

    /// The record of a request the driver refused before it had a head (unparsable,
    /// too large, too slow).
    pub(crate) fn refused(ctx: &ConnContext, proto: Proto, status: u16) -> Self {
        let route = Route::REFUSED;
        ctx.metrics
            .site(route.site)
            .begin(proto as usize, route.mode.index());
        Self {
            ctx: ctx.clone(),
            proto,
            route,
            status,
            began: Instant::now(),
            time: SystemTime::now(),
            first_pull: None,
            ktls: false,
            line: None,
            transfer: None,
        }
    }

    /// Lists the exchange among the large responses in flight when `resp` declares
    /// a body of at least `transfers::MIN_LEN` (see `transfers`); a smaller one
    /// costs a comparison.
    pub(crate) fn list_if_large(&mut self, head: &RequestHead<'_>, resp: &Response) {
        if head.method == http::Method::HEAD {
            return;
        }
        let total = match &resp.body {
            Body::Empty => 0,
            Body::Bytes(b) => b.len() as u64,
            Body::File(f) => f.len,
            Body::Stream(_) => resp
                .headers
                .get(http::header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
        };
        if total < super::transfers::MIN_LEN {
            return;
        }
        let site = self
            .route
            .site
            .and_then(|s| self.ctx.service.site_name(s))
            .cloned();
        self.transfer = self.ctx.transfers.register(Entry {
            site,
            proto: self.proto,
            peer: self.ctx.client.peer,
            path: head.uri.path(),
            total,
            started: self.began,
        });
    }

    /// `sent` bytes of the body are out (for a listed transfer's progress).
    pub(crate) fn progress(&self, sent: u64) {
        if let Some(transfer) = &self.transfer {
            transfer.progress(sent);
        }
    }

    /// The body was pulled (the first time counts).
    pub(crate) fn pulled(&mut self) {
        if self.first_pull.is_none() {
            self.first_pull = Some(Instant::now());
        }
    }

    /// The response's bytes went through kernel TLS.
    pub(crate) fn set_ktls(&mut self) {
        self.ktls = true;
    }

    /// Reports the exchange: `bytes` of body handed out, ended as `outcome`.
    pub(crate) fn finish(self, bytes: u64, outcome: Outcome) {
        let end = Instant::now();
        let finished = Finished {
            ctx: &self.ctx,
            proto: self.proto,
            route: self.route,
            site: self
                .route
                .site
                .and_then(|s| self.ctx.service.site_name(s))
                .map(|name| &**name),
            status: self.status,
            bytes,
            time: self.time,
            ttfb: self.first_pull.unwrap_or(end) - self.began,
            duration: end - self.began,
            outcome,
            ktls: self.ktls,
            tls: self.ctx.client.tls,
            peer: self.ctx.client.peer,
            line: self.line.as_deref(),
        };
        report(&finished);
    }
}

/// Where a finished exchange goes: the access log and the metrics.
fn report(finished: &Finished<'_>) {
    observe(finished);
    super::access::write(finished);
}

/// The exchange's end in its site's metrics (begun in [`Record::new`]).
fn observe(f: &Finished<'_>) {
    f.ctx.metrics.site(f.route.site).end(&crate::metrics::Ended {
        proto: f.proto as usize,
        mode: f.route.mode.index(),
        status: f.status,
        bytes: f.bytes,
        ttfb: f.ttfb,
        ttlb: f.duration,
        outcome: f.outcome as usize,
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{MODES, OUTCOMES, PROTOS};
    use crate::service::Mode;

    /// The metrics label tables are indexed by these enums' discriminants.
    #[test]
    fn label_tables_match_the_enums() {
        for p in [Proto::H1, Proto::H2, Proto::H3] {
            assert_eq!(PROTOS[p as usize], p.as_str());
        }
        for m in [Mode::Files, Mode::Proxy, Mode::WebTransport, Mode::Refused] {
            assert_eq!(MODES[m.index()], m.as_str());
        }
        let outcomes = [
            Outcome::Complete,
            Outcome::ClientGone,
            Outcome::Timeout,
            Outcome::BodyError,
            Outcome::Unfinished,
        ];
        for o in outcomes {
            assert_eq!(OUTCOMES[o as usize], o.as_str());
        }
    }
}
