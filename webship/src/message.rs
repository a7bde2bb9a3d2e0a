//! The protocol-neutral request head and response every layer speaks: drivers build a
//! [`RequestHead`] from their wire format and write a [`Response`] out; the service,
//! files, proxy and WebTransport produce them. A leaf: it imports nothing above it.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, StatusCode, Uri, Version};

/// The `Server` header value.
pub(crate) const SERVER: &str = concat!("webship/", env!("CARGO_PKG_VERSION"));

/// Errors a streamed body can end with.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A streamed body (request bodies, and responses relayed from upstreams). Data,
/// trailers and errors pass through; an error ends the peer's stream as a protocol
/// error, never as a silently short message.
pub(crate) type StreamBody = http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>;

/// An empty request body.
pub(crate) fn empty_body() -> StreamBody {
    use http_body_util::BodyExt;
    http_body_util::Empty::<Bytes>::new()
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// Who sent a request: the same for every request of a connection.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Client {
    /// The client's address, for logs and forwarding headers.
    pub(crate) peer: SocketAddr,
    /// The site whose certificate the connection presented (chosen by SNI).
    pub(crate) tls_site: usize,
    /// What the connection's TLS negotiated, where the driver can tell.
    pub(crate) tls: Option<TlsInfo>,
}

/// A connection's TLS version and cipher suite, as logs name them (`TLSv1_3`,
/// `TLS13_AES_128_GCM_SHA256`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TlsInfo {
    pub(crate) version: &'static str,
    pub(crate) cipher: Option<&'static str>,
}

/// The request head a driver hands to the service.
#[derive(Debug)]
pub(crate) struct RequestHead<'a> {
    pub(crate) method: &'a Method,
    pub(crate) uri: &'a Uri,
    pub(crate) version: Version,
    pub(crate) headers: &'a HeaderMap,
    /// The site whose certificate the connection presented (from SNI).
    pub(crate) tls_site: usize,
    /// The client's address, for forwarding headers.
    pub(crate) peer: SocketAddr,
    /// `false` when the driver cannot stream this request's body to an upstream
    /// (HTTP/1.1 on a connection opened for a file site); such a request with a body
    /// routed to the proxy gets 421, so the client retries on the proxy's own name.
    pub(crate) body_forwardable: bool,
}

impl<'a> RequestHead<'a> {
    /// The one constructor: every driver's request becomes this.
    pub(crate) fn new(
        client: Client,
        method: &'a Method,
        uri: &'a Uri,
        version: Version,
        headers: &'a HeaderMap,
    ) -> Self {
        Self {
            method,
            uri,
            version,
            headers,
            tls_site: client.tls_site,
            peer: client.peer,
            body_forwardable: true,
        }
    }

    /// Whether the request announces a body.
    pub(crate) fn has_body(&self) -> bool {
        self.headers.contains_key(header::TRANSFER_ENCODING)
            || self
                .headers
                .get(header::CONTENT_LENGTH)
                .is_some_and(|v| v.as_bytes() != b"0")
    }
}

/// A protocol-neutral response. File bodies name byte ranges of an open file, so each
/// driver decides how the bytes travel (userspace TLS, or the kernel).
#[derive(Debug)]
pub(crate) struct Response {
    pub(crate) status: StatusCode,
    /// Includes `content-length` whenever the length is known (always, today).
    pub(crate) headers: HeaderMap,
    pub(crate) body: Body,
}

impl Response {
    /// The head as the `http` crate's type (what hyper, h2 and h3 take), and the body
    /// apart.
    pub(crate) fn into_http(self) -> (http::Response<()>, Body) {
        let mut head = http::Response::new(());
        *head.status_mut() = self.status;
        *head.headers_mut() = self.headers;
        (head, self.body)
    }

    /// A bodiless response with just a status, for errors and redirects.
    pub(crate) fn status(status: StatusCode) -> Self {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(0));
        Self {
            status,
            headers,
            body: Body::Empty,
        }
    }
}

pub(crate) enum Body {
    Empty,
    Bytes(Bytes),
    File(FileBody),
    /// Relayed from an upstream; its length is in `content-length` when known.
    Stream(StreamBody),
}

impl std::fmt::Debug for Body {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Body::Empty => f.write_str("Empty"),
            Body::Bytes(b) => write!(f, "Bytes({})", b.len()),
            Body::File(file) => write!(f, "{file:?}"),
            Body::Stream(_) => f.write_str("Stream"),
        }
    }
}

/// Byte ranges of one open file, possibly interleaved with literal bytes (the part
/// headers of `multipart/byteranges`).
#[derive(Debug)]
pub(crate) struct FileBody {
    pub(crate) file: Arc<std::fs::File>,
    pub(crate) segments: Vec<Segment>,
    /// Sum of all segment lengths.
    pub(crate) len: u64,
}

#[derive(Debug, Clone)]
pub(crate) enum Segment {
    Bytes(Bytes),
    File { offset: u64, len: u64 },
}
