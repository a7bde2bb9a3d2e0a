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
use crate::tls::{Accepted, Alpn};

pub(crate) use batch::WriteBatch;

/// Why a connection ended early.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConnError {
    #[error(transparent)]
    H1(#[from] h1::H1Error),
    #[error(transparent)]
    Hyper(#[from] hyper::HyperError),
}

/// Serves one accepted connection until it ends. Each driver is boxed, so a
/// connection holds the memory of its own driver's future, not of the largest.
pub(crate) async fn serve(accepted: Accepted, ctx: ConnContext) -> Result<(), ConnError> {
    match accepted.alpn {
        Alpn::H1 if ctx.service.is_proxy(accepted.site) => {
            Ok(Box::pin(hyper::serve_h1(accepted.stream, ctx)).await?)
        }
        Alpn::H1 => Ok(Box::pin(h1::serve(accepted.stream, ctx)).await?),
        Alpn::H2 => Ok(Box::pin(hyper::serve_h2(accepted.stream, ctx)).await?),
    }
}
