//! The seam between the protocol drivers and everything behind them.
//!
//! A driver (h1, hyper's h1/h2, h3) only translates: its wire format into a
//! [`RequestHead`], and a [`Response`] back out. Everything in between is here, once:
//! the driver context ([`ConnContext`]), building the head, calling the service, the
//! access log, WebTransport admission, the response body every driver pulls from
//! ([`ResponseBody`]: one file cursor, one upstream relay) and the send loop with its
//! fault handling ([`send_body`]): a body that fails (disk error, shrunk file,
//! upstream reset) ends the response so the peer can tell it is incomplete.

pub(crate) mod access;
mod body;
pub(crate) mod coalesce;
mod record;
mod send;
mod transfers;

use std::net::SocketAddr;
use std::sync::Arc;

use http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, Version};

use crate::config::{Config, H2Settings, H3Settings, Limits, Policy, ProxyH2Settings};
use crate::message::{Client, RequestHead, Response, StreamBody, TlsInfo, SERVER};
use crate::service::Service;
use crate::shutdown::Shutdown;
use crate::webtransport::{Admission, Refusal};

pub(crate) use body::{PullClock, ResponseBody};
pub(crate) use record::{Outcome, Record};
pub(crate) use send::{send_body, BodyWriter, Progress, SendError};
pub(crate) use transfers::Transfers;

/// The protocol a request arrived over, as logs name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Proto {
    H1,
    H2,
    H3,
}

impl Proto {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Proto::H1 => "h1",
            Proto::H2 => "h2",
            Proto::H3 => "h3",
        }
    }

    pub(crate) fn of(version: Version) -> Self {
        match version {
            Version::HTTP_2 => Proto::H2,
            Version::HTTP_3 => Proto::H3,
            _ => Proto::H1,
        }
    }
}

/// What every driver needs from the server; one per server, shared by all
/// connections.
#[derive(Debug)]
pub(crate) struct Drivers {
    pub(crate) service: Arc<Service>,
    pub(crate) limits: Limits,
    pub(crate) h2: H2Settings,
    pub(crate) proxy_h2: ProxyH2Settings,
    pub(crate) h3: H3Settings,
    /// Whether h3 responses may switch their connection to BBR (`[kernel] bbr`).
    pub(crate) bbr: bool,
    /// The access log's format and sampling; `None` when it is off.
    pub(crate) access: Option<access::AccessLog>,
    /// Sources whose connections start with a PROXY header (`accept_proxy_protocol`).
    pub(crate) accept_proxy_protocol: Vec<crate::config::IpNet>,
    pub(crate) shutdown: Shutdown,
    /// Suites HTTP/1.1 bulk responses may promote to kernel TLS; `None` when kTLS is
    /// off or missing.
    pub(crate) ktls: Option<Arc<crate::ktls::Support>>,
    /// Sessions one h3 connection may hold when some site has a WebTransport
    /// endpoint; 0 when none does (then nothing WebTransport is offered).
    pub(crate) webtransport_sessions: usize,
    /// This generation's metric slots (by site index) in the process's registry.
    pub(crate) metrics: crate::metrics::Sites,
    /// The large responses in flight (one table per process).
    pub(crate) transfers: Arc<Transfers>,
}

impl Drivers {
    pub(crate) fn new(
        config: &Config,
        service: Arc<Service>,
        shutdown: Shutdown,
        ktls: Option<Arc<crate::ktls::Support>>,
        access_sink: &Arc<access::Sink>,
        metrics: &Arc<crate::metrics::Registry>,
        transfers: Arc<Transfers>,
    ) -> Self {
        Self {
            transfers,
            metrics: metrics.sites(service.site_names()),
            service,
            limits: config.limits,
            h2: config.h2,
            proxy_h2: config.proxy_h2,
            h3: config.h3,
            bbr: config.kernel.bbr != Policy::Off,
            access: access::AccessLog::new(config, access_sink),
            accept_proxy_protocol: config.accept_proxy_protocol.clone(),
            shutdown,
            ktls,
            webtransport_sessions: config
                .sites
                .iter()
                .filter_map(|s| s.webtransport.as_ref().filter(|_| s.protocols.h3))
                .map(|w| w.max_sessions)
                .max()
                .unwrap_or(0),
        }
    }

    /// The context of a new connection from `peer` (the client's address, carried by
    /// a PROXY header where one came) that was shown `tls_site`'s certificate.
    pub(crate) fn connection(
        self: &Arc<Self>,
        peer: SocketAddr,
        tls_site: usize,
        tls: Option<TlsInfo>,
    ) -> ConnContext {
        ConnContext {
            drivers: self.clone(),
            client: Client { peer, tls_site, tls },
        }
    }
}

/// One connection's context: the shared driver settings and who the client is.
#[derive(Debug, Clone)]
pub(crate) struct ConnContext {
    pub(crate) drivers: Arc<Drivers>,
    pub(crate) client: Client,
}

impl std::ops::Deref for ConnContext {
    type Target = Drivers;

    fn deref(&self) -> &Drivers {
        &self.drivers
    }
}

impl ConnContext {
    pub(crate) fn peer(&self) -> SocketAddr {
        self.client.peer
    }

    /// The request head of a request on this connection.
    pub(crate) fn head<'a>(
        &self,
        method: &'a Method,
        uri: &'a Uri,
        version: Version,
        headers: &'a HeaderMap,
    ) -> RequestHead<'a> {
        RequestHead::new(self.client, method, uri, version, headers)
    }

    /// Serves one request: the service's response, stamped (`Server`, `Date`), and
    /// the exchange's record, which the driver puts in the response body it sends
    /// ([`ResponseBody::recorded`]) so it is reported when that body ends.
    pub(crate) async fn handle(&self, head: &RequestHead<'_>, body: StreamBody) -> (Response, Record) {
        // Begun before the service is called: its time is the exchange's, and a client
        // that leaves while it runs is still reported (see `record::Pending`).
        let pending = Record::begin(self, head, record::Start::now());
        let (mut resp, route) = self.service.handle(head, body).await;
        let mut record = pending.answered(route, resp.status.as_u16());
        record.list_if_large(head, &resp);
        stamp(&mut resp);
        (resp, record)
    }

    /// A response the driver makes by itself (a request it could not parse), and its
    /// record.
    pub(crate) fn reject(&self, proto: Proto, status: StatusCode) -> (Response, Record) {
        (self.refuse(status), Record::refused(self, proto, status.as_u16()))
    }

    /// A bare response with our stamp.
    fn refuse(&self, status: StatusCode) -> Response {
        let mut resp = Response::status(status);
        stamp(&mut resp);
        resp
    }

    /// Admits a WebTransport extended CONNECT, or says why not (logged either way).
    pub(crate) fn admit_webtransport(&self, head: &RequestHead<'_>) -> Result<Admission, Refusal> {
        let proto = Proto::of(head.version).as_str();
        let admitted = match self.service.webtransport(head) {
            Some(endpoint) => endpoint.admit(head.uri, head.headers),
            None => Err(Refusal {
                status: StatusCode::NOT_FOUND,
                reason: "no WebTransport endpoint here",
            }),
        };
        let status = admitted.as_ref().map_or_else(|r| r.status, |_| StatusCode::OK);
        // The session is its own business (its streams and datagrams have their own
        // counters); the exchange is the CONNECT and its answer.
        let route = crate::service::Route {
            site: self.service.site_of_request(head),
            mode: crate::service::Mode::WebTransport,
            upstream: None,
        };
        Record::new(self, head, record::Start::now(), route, status.as_u16()).finish(0, Outcome::Complete);
        if let Err(refusal) = &admitted {
            tracing::debug!(peer = %self.client.peer, proto, reason = refusal.reason, "WebTransport session refused");
        }
        admitted
    }

    /// The answer to a WebTransport CONNECT: 200 without a length (RFC 9110 §9.3.6),
    /// or the refusal's status.
    pub(crate) fn webtransport_response(&self, admitted: &Result<Admission, Refusal>) -> Response {
        match admitted {
            Ok(_) => {
                let mut resp = self.refuse(StatusCode::OK);
                resp.headers.remove(http::header::CONTENT_LENGTH);
                resp
            }
            Err(refusal) => self.refuse(refusal.status),
        }
    }
}

/// The fields every response of ours carries: `Server`, and `Date` unless an
/// upstream gave one (an origin with a clock must send it, RFC 9110 §6.6.1).
fn stamp(resp: &mut Response) {
    resp.headers
        .insert(http::header::SERVER, HeaderValue::from_static(SERVER));
    if !resp.headers.contains_key(http::header::DATE) {
        if let Ok(date) = HeaderValue::try_from(httpdate::fmt_http_date(std::time::SystemTime::now())) {
            resp.headers.insert(http::header::DATE, date);
        }
    }
}
