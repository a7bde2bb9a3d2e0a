//! The TCP protocol drivers over a completed TLS handshake: [`serve`] picks one by
//! ALPN and site. Each only translates its wire format to the seam's request head and
//! writes the seam's response out (`crate::exchange`).
//!
//! - [`h1`]: Webship's own HTTP/1.1 for file sites, with the kernel TLS bulk path;
//! - [`hyper`]: HTTP/2 for every site, and HTTP/1.1 for proxy sites, whose request
//!   bodies hyper streams both ways.

mod batch;
mod drain;
mod h1;
mod h2_guard;
mod hyper;
mod rest;

use std::future::Future;
use std::pin::Pin;

use crate::exchange::ConnContext;
use crate::ktls::RustlsStream;
use crate::metrics::Close;
use crate::tls::{Accepted, Alpn};

pub(crate) use batch::{Metrics as BatchMetrics, WriteBatch};

/// How long a connection (HTTP/1.1 or HTTP/2) that has sent no request yet may take
/// to send its first once the drain has begun: it may be the last one accepted
/// before the drain (in a binary upgrade, the old process's), its client sending
/// right now.
const FIRST_REQUEST_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// How long closing a connection in order may take before it is dropped: hyper's
/// GOAWAY answered, or at rest the GOAWAY and close_notify written and what the
/// client still sends read (`rest::close_in_order`).
const CLOSE_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// Completes `FIRST_REQUEST_GRACE` after the drain begins: when a connection that
/// has sent no request yet, and is waiting for one, is closed.
async fn drain_grace_over(shutdown: &mut crate::shutdown::Shutdown) {
    shutdown.requested().await;
    tokio::time::sleep(FIRST_REQUEST_GRACE).await;
}

/// Why a connection ended early.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConnError {
    #[error(transparent)]
    H1(#[from] h1::H1Error),
    #[error(transparent)]
    Hyper(#[from] hyper::HyperError),
}

impl ConnError {
    /// The `reason` label the connection's close is counted under.
    pub(crate) fn close(&self) -> Close {
        use crate::exchange::SendError;
        use std::io::ErrorKind;
        let io = |e: &std::io::Error| match e.kind() {
            ErrorKind::TimedOut => Close::HeaderTimeout,
            ErrorKind::ConnectionReset
            | ErrorKind::BrokenPipe
            | ErrorKind::UnexpectedEof
            | ErrorKind::ConnectionAborted => Close::Reset,
            ErrorKind::InvalidData => Close::ProtocolError,
            _ => Close::Error,
        };
        match self {
            ConnError::H1(h1::H1Error::Io(e)) => io(e),
            ConnError::H1(h1::H1Error::Send(SendError::Timeout)) => Close::SendTimeout,
            ConnError::H1(h1::H1Error::Send(SendError::Peer(_))) => Close::Reset,
            ConnError::H1(h1::H1Error::Send(SendError::Body(_))) => Close::Error,
            ConnError::Hyper(hyper::HyperError::Stalled) => Close::SendTimeout,
            ConnError::Hyper(hyper::HyperError::HeadTimeout) => Close::HeaderTimeout,
            ConnError::Hyper(hyper::HyperError::NoPreface) => Close::HandshakeTimeout,
            ConnError::Hyper(hyper::HyperError::Io(e)) => io(e),
            ConnError::Hyper(hyper::HyperError::Hyper(e)) if e.is_timeout() => Close::HeaderTimeout,
            ConnError::Hyper(hyper::HyperError::Hyper(e)) if e.is_parse() => Close::ProtocolError,
            ConnError::Hyper(hyper::HyperError::Hyper(e)) if e.is_incomplete_message() || e.is_closed() => {
                Close::Reset
            }
            ConnError::Hyper(hyper::HyperError::Hyper(e)) => {
                match std::error::Error::source(e).and_then(|s| s.downcast_ref::<std::io::Error>()) {
                    Some(e) => io(e),
                    None => Close::ProtocolError,
                }
            }
        }
    }
}

/// Waits, holding no buffer, until a read on `tls` will find something: plaintext
/// rustls already holds (what an earlier read took in beyond one request: Webship's
/// own HTTP/1.1 reads ahead), the peer's close_notify or records rustls could not
/// process (the read that follows reports them), or bytes (or the end) on the
/// socket, seen with a 1-byte peek. An idle connection waits here instead of in a
/// read that would need its buffer.
pub(super) async fn tls_readable(tls: &mut RustlsStream) -> std::io::Result<()> {
    match tls.get_mut().1.process_new_packets() {
        Ok(state) if state.plaintext_bytes_to_read() == 0 && !state.peer_has_closed() => {}
        // Plaintext waiting, the peer's close_notify, or a TLS error the read reports.
        _ => return Ok(()),
    }
    let mut probe = [0u8; 1];
    tls.get_ref().0.get_ref().peek(&mut probe).await.map(drop)
}

/// The future of one connection's driver, boxed at its own size.
pub(crate) type Serving = Pin<Box<dyn Future<Output = Result<(), ConnError>> + Send>>;

/// Serves one accepted connection until it ends. The driver's future is boxed on
/// its own: a connection holds the memory of its driver, not of the largest of
/// them, and no wrapper holds the accepted stream a second time.
pub(crate) fn serve(accepted: Accepted, ctx: ConnContext) -> Serving {
    match accepted.alpn {
        Alpn::H1 if ctx.service.is_proxy(accepted.site) => {
            let driver = hyper::serve_h1(accepted.stream, ctx);
            Box::pin(async move { Ok(driver.await?) })
        }
        Alpn::H1 => {
            let driver = h1::serve(accepted.stream, ctx);
            Box::pin(async move { Ok(driver.await?) })
        }
        Alpn::H2 => {
            let driver = hyper::serve_h2(accepted.stream, ctx);
            Box::pin(async move { Ok(driver.await?) })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exchange::SendError;

    /// The close reasons the metrics count: timeouts by kind, resets, the rest.
    #[test]
    fn connection_errors_map_to_close_reasons() {
        let io = |kind| ConnError::H1(h1::H1Error::Io(std::io::Error::from(kind)));
        assert_eq!(io(std::io::ErrorKind::TimedOut).close(), Close::HeaderTimeout);
        assert_eq!(io(std::io::ErrorKind::ConnectionReset).close(), Close::Reset);
        assert_eq!(io(std::io::ErrorKind::BrokenPipe).close(), Close::Reset);
        assert_eq!(io(std::io::ErrorKind::Other).close(), Close::Error);
        let send = |e| ConnError::H1(h1::H1Error::Send(e));
        assert_eq!(send(SendError::Timeout).close(), Close::SendTimeout);
        assert_eq!(send(SendError::peer("gone")).close(), Close::Reset);
        let hyper = |e| ConnError::Hyper(e);
        assert_eq!(hyper(hyper::HyperError::Stalled).close(), Close::SendTimeout);
        assert_eq!(
            hyper(hyper::HyperError::HeadTimeout).close(),
            Close::HeaderTimeout
        );
        assert_eq!(
            hyper(hyper::HyperError::NoPreface).close(),
            Close::HandshakeTimeout
        );
        let rest = |kind| hyper(hyper::HyperError::Io(std::io::Error::from(kind)));
        assert_eq!(rest(std::io::ErrorKind::ConnectionReset).close(), Close::Reset);
        assert_eq!(rest(std::io::ErrorKind::Other).close(), Close::Error);
    }
}
