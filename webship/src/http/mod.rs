//! HTTP/1.1 and HTTP/2 connection drivers over a TLS stream. Each translates its
//! protocol into a [`RequestHead`](crate::service::RequestHead), calls the shared
//! [`Service`](crate::service::Service), and sends the response its own way.

mod batch;
pub mod h1;
pub mod h2;

use std::net::SocketAddr;
use std::sync::Arc;

use crate::config::{H2Settings, Limits};
use crate::server::Shutdown;
use crate::service::Service;

pub use batch::WriteBatch;

/// What a connection driver needs from the server.
#[derive(Debug, Clone)]
pub struct ConnContext {
    pub service: Arc<Service>,
    pub limits: Limits,
    pub h2: H2Settings,
    pub proxy_h2: crate::config::ProxyH2Settings,
    pub access_log: bool,
    pub peer: SocketAddr,
    /// Site of the certificate presented, for requests without a host.
    pub tls_site: usize,
    pub shutdown: Shutdown,
    /// Suites HTTP/1.1 bulk responses may promote to kernel TLS; `None` when kTLS is
    /// off or missing.
    pub ktls: Option<Arc<crate::ktls::Support>>,
}

/// The `Server` header value.
pub const SERVER: &str = concat!("webship/", env!("CARGO_PKG_VERSION"));
