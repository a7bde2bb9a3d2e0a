//! The TCP protocol drivers over a completed TLS handshake: [`serve`] picks one by
//! ALPN and site. Each only translates its wire format to the seam's request head and
//! writes the seam's response out (`crate::exchange`).
//!
//! - [`h1`]: Webship's own HTTP/1.1 for file sites, with the kernel TLS bulk path;
//! - [`hyper`]: HTTP/2 for every site, and HTTP/1.1 for proxy sites, whose request
//!   bodies hyper streams both ways.

mod batch;
mod h1;
mod h2_guard;
mod hyper;

use crate::exchange::ConnContext;
use crate::metrics::Close;
use crate::tls::{Accepted, Alpn};

pub(crate) use batch::{Metrics as BatchMetrics, WriteBatch};

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

/// Serves one accepted connection until it ends.
pub(crate) async fn serve(accepted: Accepted, ctx: ConnContext) -> Result<(), ConnError> {
    match accepted.alpn {
        Alpn::H1 if ctx.service.is_proxy(accepted.site) => Ok(hyper::serve_h1(accepted.stream, ctx).await?),
        Alpn::H1 => Ok(h1::serve(accepted.stream, ctx).await?),
        Alpn::H2 => Ok(hyper::serve_h2(accepted.stream, ctx).await?),
    }
}
