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

use std::future::Future;
use std::pin::Pin;

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
