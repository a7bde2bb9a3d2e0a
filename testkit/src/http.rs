//! The HTTP/1.1 and HTTP/2 client (hyper over tokio-rustls, or plain TCP for a
//! baseline): one connection type for tests, which assert on what comes back, and
//! for benchmark clients, which time and check it. Bodies go to a [`Sink`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use bytes::Bytes;
use http::{Request, Response, Version};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::ServerName;
use rustls::ClientConfig;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

use crate::body::{Collect, Fetched, Outcome, Sink};

/// How long [`Conn::close`] waits for the connection to end.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proto {
    H1,
    H2,
}

impl Proto {
    pub fn alpn(self) -> &'static [u8] {
        match self {
            Proto::H1 => b"http/1.1",
            Proto::H2 => b"h2",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Proto::H1 => "h1",
            Proto::H2 => "h2",
        }
    }

    fn version(self) -> Version {
        match self {
            Proto::H1 => Version::HTTP_11,
            Proto::H2 => Version::HTTP_2,
        }
    }
}

/// Client-side buffer, window and header sizes; the default is hyper's own.
#[derive(Debug, Clone, Copy, Default)]
pub struct Tuning {
    pub h1_max_buffer: Option<usize>,
    pub h2_stream_window: Option<u32>,
    pub h2_connection_window: Option<u32>,
    pub h2_max_header_list: Option<u32>,
}

impl Tuning {
    /// Sized so that the client is not what limits a bulk download: an HTTP/1.1
    /// read buffer that may grow to 4 MiB, HTTP/2 windows far above a loopback
    /// bandwidth-delay product. HTTP/2's frame size stays at the protocol default
    /// (16 KiB), which is what browsers advertise, so servers are compared on the
    /// framing real clients get.
    pub const BULK: Tuning = Tuning {
        h1_max_buffer: Some(4 << 20),
        h2_stream_window: Some(32 << 20),
        h2_connection_window: Some(64 << 20),
        h2_max_header_list: None,
    };
}

/// TCP to `addr`, then TLS with `sni` (an IP address means no SNI is sent).
pub async fn connect(
    addr: SocketAddr,
    sni: &str,
    config: Arc<ClientConfig>,
) -> std::io::Result<TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await?;
    tls(tcp, sni, config).await
}

/// TLS with `sni` over an open connection.
pub async fn tls<T>(io: T, sni: &str, config: Arc<ClientConfig>) -> std::io::Result<TlsStream<T>>
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    let name = ServerName::try_from(sni.to_owned())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    TlsConnector::from(config).connect(name, io).await
}

enum Sender {
    H1(http1::SendRequest<Full<Bytes>>),
    H2(http2::SendRequest<Full<Bytes>>),
}

/// One HTTP/1.1 or HTTP/2 connection, its driver running on the current runtime.
pub struct Conn {
    sender: Sender,
    /// `None` on the extra handles of a shared HTTP/2 connection.
    driver: Option<JoinHandle<()>>,
    proto: Proto,
    authority: String,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("proto", &self.proto)
            .field("authority", &self.authority)
            .finish_non_exhaustive()
    }
}

impl Conn {
    /// Sets up `proto` over `io` (TLS or plain TCP); requests name `authority`
    /// (`host:port`).
    pub async fn handshake<T>(io: T, proto: Proto, authority: &str, tuning: Tuning) -> Result<Conn>
    where
        T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let io = TokioIo::new(io);
        let (sender, driver) = match proto {
            Proto::H1 => {
                let mut builder = http1::Builder::new();
                if let Some(max) = tuning.h1_max_buffer {
                    builder.max_buf_size(max);
                }
                let (send, conn) = builder.handshake(io).await.context("HTTP/1.1 setup")?;
                (
                    Sender::H1(send),
                    tokio::spawn(async move {
                        let _ = conn.await;
                    }),
                )
            }
            Proto::H2 => {
                let mut builder = http2::Builder::new(TokioExecutor::new());
                if let Some(window) = tuning.h2_stream_window {
                    builder.initial_stream_window_size(window);
                }
                if let Some(window) = tuning.h2_connection_window {
                    builder.initial_connection_window_size(window);
                }
                if let Some(max) = tuning.h2_max_header_list {
                    builder.max_header_list_size(max);
                }
                let (send, conn) = builder.handshake(io).await.context("HTTP/2 setup")?;
                (
                    Sender::H2(send),
                    tokio::spawn(async move {
                        let _ = conn.await;
                    }),
                )
            }
        };
        Ok(Conn {
            sender,
            driver: Some(driver),
            proto,
            authority: authority.to_owned(),
        })
    }

    /// Another handle on this HTTP/2 connection, for concurrent requests; `None`
    /// for HTTP/1.1, which carries one request at a time.
    pub fn share(&self) -> Option<Conn> {
        match &self.sender {
            Sender::H1(_) => None,
            Sender::H2(send) => Some(Conn {
                sender: Sender::H2(send.clone()),
                driver: None,
                proto: self.proto,
                authority: self.authority.clone(),
            }),
        }
    }

    /// Sends one request and returns the response head, its body unread. HTTP/1.1
    /// uses the origin form with `Host` (as browsers and curl do; the absolute form
    /// is for proxies), HTTP/2 an `https` URI. An empty `body` is no body at all.
    pub async fn send(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> Result<Response<Incoming>> {
        let mut builder = Request::builder().method(method).version(self.proto.version());
        builder = match self.proto {
            Proto::H1 => builder.uri(path).header(http::header::HOST, &self.authority),
            Proto::H2 => builder.uri(format!("https://{}{path}", self.authority)),
        };
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        let request = builder.body(Full::new(body)).context("building the request")?;
        let what = || format!("{method} {path} ({})", self.proto.label());
        let response = match &mut self.sender {
            Sender::H1(send) => send.send_request(request).await,
            Sender::H2(send) => send.send_request(request).await,
        }
        .with_context(what)?;
        ensure!(
            response.version() == self.proto.version(),
            "{}: answered in {:?}",
            what(),
            response.version()
        );
        Ok(response)
    }

    /// One request without a body; the response body goes to `sink`. Returns the
    /// response head.
    pub async fn fetch_into<S: Sink>(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        sink: &mut S,
    ) -> Result<http::response::Parts> {
        let (parts, body) = self.send(method, path, headers, Bytes::new()).await?.into_parts();
        read_body(body, sink)
            .await
            .with_context(|| format!("{method} {path}: reading the body"))?;
        Ok(parts)
    }

    /// Ends the connection: the handles are dropped and the driver is given a
    /// moment, so the connection is closed cleanly before this returns and never
    /// lingers into a server's shutdown.
    pub async fn close(self) {
        drop(self.sender);
        if let Some(driver) = self.driver {
            let _ = tokio::time::timeout(CLOSE_GRACE, driver).await;
        }
    }
}

/// Reads `body` to its end (trailers included) into `sink`.
pub async fn read_body<S: Sink>(mut body: Incoming, sink: &mut S) -> Result<(), hyper::Error> {
    while let Some(frame) = body.frame().await {
        let frame = frame?;
        if let Some(data) = frame.data_ref() {
            sink.update(data);
        } else if let Some(trailers) = frame.trailers_ref() {
            sink.trailers(trailers);
        }
    }
    Ok(())
}

/// Reads `response` to its end, or to the error that cut it short, keeping both.
pub async fn outcome(response: Response<Incoming>) -> Outcome {
    let (parts, body) = response.into_parts();
    let mut got = Collect::default();
    // With its causes: hyper's "error reading a body" says little alone.
    let error = read_body(body, &mut got).await.err().map(|e| {
        let mut text = e.to_string();
        let mut cause = std::error::Error::source(&e);
        while let Some(c) = cause {
            text = format!("{text}: {c}");
            cause = c.source();
        }
        text
    });
    Outcome {
        fetched: got.into_fetched(parts),
        error,
    }
}

/// One request (`method`, no body) on a fresh TLS connection, verified with
/// `config`, which must negotiate `proto`; the body counted, hashed and kept.
/// For tests: it panics, saying what failed.
pub async fn fetch(
    proto: Proto,
    addr: SocketAddr,
    sni: &str,
    config: Arc<ClientConfig>,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> Fetched {
    let tls = connect(addr, sni, config)
        .await
        .unwrap_or_else(|e| panic!("TLS to {addr} for {sni}: {e}"));
    assert_eq!(
        tls.get_ref().1.alpn_protocol(),
        Some(proto.alpn()),
        "server did not negotiate {proto:?}"
    );
    let mut conn = Conn::handshake(tls, proto, &format!("{sni}:{}", addr.port()), Tuning::default())
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    let mut body = Collect::default();
    let parts = conn
        .fetch_into(method, path, headers, &mut body)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    conn.close().await;
    body.into_fetched(parts)
}
