//! The pooled client of one route and what its failures mean.
//!
//! Connections to each upstream are capped (`max_connections_per_upstream`, in use
//! and idle together): the connector holds one permit of the upstream's semaphore
//! inside every connection it makes, so the permit returns only when the connection
//! closes. A connect waits for a permit at most `queue_timeout` (HAProxy's `maxconn`
//! and `timeout queue`); meanwhile hyper's pool hands the request any connection
//! that becomes idle. Then `connect_timeout` bounds the TCP (and TLS) connect.
//!
//! [`Fault`] sorts a failed exchange: only the upstream's own faults eject it; a
//! full queue or a local resource shortage (EMFILE, ENOBUFS) says nothing about the
//! upstream's health.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::Uri;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::{Route, UpstreamProtocol};
use crate::message::{BoxError, StreamBody};

use super::metrics::{self, OpenConnection, UpstreamMetrics};
use super::ProxyError;

/// Idle pooled connections kept per upstream (never more than the cap).
const POOL_IDLE_PER_UPSTREAM: usize = 64;

/// No connection to the upstream freed up within `queue_timeout`.
#[derive(Debug, thiserror::Error)]
#[error("no connection to the upstream became free in time (queue timeout)")]
pub(super) struct QueueTimeout;

/// Each upstream's connection cap and metrics slot.
type Caps = HashMap<SocketAddr, (Arc<Semaphore>, Arc<UpstreamMetrics>)>;

/// Makes TCP connections, each holding a permit of its upstream's semaphore and
/// counted open in its upstream's metrics.
#[derive(Debug, Clone)]
pub(super) struct CappedConnector {
    http: HttpConnector,
    caps: Arc<Caps>,
    queue_timeout: Duration,
}

impl CappedConnector {
    fn new(route: &Route) -> Self {
        let mut http = HttpConnector::new();
        http.set_connect_timeout(Some(route.connect_timeout));
        http.set_nodelay(true);
        http.enforce_http(matches!(
            route.upstream_protocol,
            UpstreamProtocol::H1 | UpstreamProtocol::H2c
        ));
        let caps = route
            .upstreams
            .iter()
            .map(|u| {
                let cap = Arc::new(Semaphore::new(route.max_connections_per_upstream));
                (*u, (cap, metrics::slot(*u)))
            })
            .collect();
        Self {
            http,
            caps: Arc::new(caps),
            queue_timeout: route.queue_timeout,
        }
    }
}

impl tower_service::Service<Uri> for CappedConnector {
    type Response = Capped<TokioIo<TcpStream>>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        tower_service::Service::<Uri>::poll_ready(&mut self.http, cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        // The URI names the upstream by address (see `build_request`).
        let cap = uri
            .authority()
            .and_then(|a| a.as_str().parse::<SocketAddr>().ok())
            .and_then(|addr| self.caps.get(&addr).cloned());
        let mut http = self.http.clone();
        let queue_timeout = self.queue_timeout;
        Box::pin(async move {
            let (permit, metrics) = match cap {
                Some((cap, metrics)) => (
                    Some(
                        tokio::time::timeout(queue_timeout, cap.acquire_owned())
                            .await
                            .map_err(|_| QueueTimeout)?
                            .map_err(|_| QueueTimeout)?,
                    ),
                    Some(metrics),
                ),
                None => (None, None),
            };
            let io = tower_service::Service::call(&mut http, uri).await?;
            Ok(Capped {
                io,
                _permit: permit,
                _open: metrics.map(|m| m.connected()),
            })
        })
    }
}

/// A connection and the permit it holds until it closes.
#[derive(Debug)]
pub(super) struct Capped<T> {
    io: T,
    _permit: Option<OwnedSemaphorePermit>,
    _open: Option<OpenConnection>,
}

impl<T: hyper::rt::Read + Unpin> hyper::rt::Read for Capped<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: hyper::rt::Write + Unpin> hyper::rt::Write for Capped<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
}

impl<T: Connection> Connection for Capped<T> {
    fn connected(&self) -> Connected {
        self.io.connected()
    }
}

/// The pooled client of one route: plain TCP, or TLS to the upstreams.
#[derive(Debug)]
pub(super) enum Upstream {
    Plain(Client<CappedConnector, StreamBody>),
    Tls(Client<hyper_rustls::HttpsConnector<CappedConnector>, StreamBody>),
}

impl Upstream {
    pub(super) fn new(route: &Route) -> Result<Self, ProxyError> {
        let connector = CappedConnector::new(route);
        let mut builder = Client::builder(TokioExecutor::new());
        builder
            .pool_timer(TokioTimer::new())
            .timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_max_idle_per_host(POOL_IDLE_PER_UPSTREAM.min(route.max_connections_per_upstream));
        Ok(match &route.upstream_protocol {
            UpstreamProtocol::H1 => Upstream::Plain(builder.build(connector)),
            UpstreamProtocol::H2c => {
                builder.http2_only(true);
                Upstream::Plain(builder.build(connector))
            }
            UpstreamProtocol::H2 { ca, name } => {
                builder.http2_only(true);
                Upstream::Tls(builder.build(super::tls_connector(connector, ca, name)?))
            }
        })
    }

    pub(super) fn request(
        &self,
        req: http::Request<StreamBody>,
    ) -> hyper_util::client::legacy::ResponseFuture {
        match self {
            Upstream::Plain(c) => c.request(req),
            Upstream::Tls(c) => c.request(req),
        }
    }
}

/// Why an exchange with an upstream failed, and so what the client gets and
/// whether the upstream is ejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fault {
    /// The upstream refused, reset or timed out the connect: eject, try the next.
    Unreachable,
    /// No connection freed up within `queue_timeout`: 503.
    QueueFull,
    /// This host ran short of descriptors, buffers or ports: 503, no ejection.
    Local,
    /// The request body went over `max_body_bytes`: 413.
    TooLarge,
    /// The client's request body failed (it went away or sent a bad body): 400.
    Client,
    /// The upstream answered with something that is not HTTP: 502, eject.
    Garbage,
    /// The exchange broke after the connect (a reset, a close): 502. A pooled
    /// keep-alive connection the upstream just closed looks the same, so no
    /// ejection.
    Broken,
}

/// Local shortages: the connect failed before the upstream was involved.
fn local_errno(code: i32) -> bool {
    matches!(
        code,
        libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM | libc::EADDRNOTAVAIL | libc::EAGAIN
    )
}

/// A request body error of the client's own (wrapped by the upload watch).
#[derive(Debug, thiserror::Error)]
#[error("the client's request body failed: {0}")]
pub(super) struct ClientBodyFailed(#[source] pub(super) BoxError);

pub(super) fn classify(e: &hyper_util::client::legacy::Error) -> Fault {
    classify_chain(std::error::Error::source(e), e.is_connect())
}

/// Sorts an error by every cause in its chain; the most specific wins whatever its
/// depth (the client's body error wraps `BodyTooLarge`, hyper wraps both).
fn classify_chain(mut source: Option<&(dyn std::error::Error + 'static)>, is_connect: bool) -> Fault {
    let (mut too_large, mut queue, mut client, mut local, mut parse) = (false, false, false, false, false);
    while let Some(s) = source {
        too_large |= s.is::<super::body::BodyTooLarge>();
        queue |= s.is::<QueueTimeout>();
        client |= s.is::<ClientBodyFailed>();
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            local |= io.raw_os_error().is_some_and(local_errno);
        }
        if let Some(h) = s.downcast_ref::<hyper::Error>() {
            parse |= h.is_parse() || h.is_parse_status();
        }
        source = s.source();
    }
    if too_large {
        Fault::TooLarge
    } else if queue {
        Fault::QueueFull
    } else if client {
        Fault::Client
    } else if local {
        Fault::Local
    } else if is_connect {
        Fault::Unreachable
    } else if parse {
        Fault::Garbage
    } else {
        Fault::Broken
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_shortages_are_not_the_upstreams_fault() {
        for code in [libc::EMFILE, libc::ENFILE, libc::ENOBUFS, libc::EADDRNOTAVAIL] {
            assert!(local_errno(code), "{code}");
        }
        for code in [
            libc::ECONNREFUSED,
            libc::ETIMEDOUT,
            libc::ECONNRESET,
            libc::EHOSTUNREACH,
        ] {
            assert!(!local_errno(code), "{code}");
        }
    }
}
