//! The TCP protocol drivers over a completed TLS handshake: [`serve`] picks one by
//! ALPN and site. Each only translates its wire format to the seam's request head and
//! writes the seam's response out (`crate::exchange`).
//!
//! - [`h1`]: Webship's own HTTP/1.1 for file sites, with the kernel TLS bulk path;
//! - [`hyper`]: HTTP/2 for every site, and HTTP/1.1 for proxy sites, whose request
//!   bodies hyper streams both ways.

mod batch;
mod h1;
mod hyper;

use crate::exchange::ConnContext;
use crate::tls::{Accepted, Alpn};

pub(crate) use batch::WriteBatch;

/// Serves one accepted connection until it ends; the error says why it ended early.
pub(crate) async fn serve(accepted: Accepted, ctx: ConnContext) -> Result<(), String> {
    match accepted.alpn {
        Alpn::H1 if ctx.service.is_proxy(accepted.site) => hyper::serve_h1(accepted.stream, ctx)
            .await
            .map_err(|e| e.to_string()),
        Alpn::H1 => h1::serve(accepted.stream, ctx).await.map_err(|e| e.to_string()),
        Alpn::H2 => hyper::serve_h2(accepted.stream, ctx)
            .await
            .map_err(|e| e.to_string()),
    }
}
