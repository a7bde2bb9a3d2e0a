//! The HTTP/3 client (quinn + h3): one client for tests, the benchmark's h3
//! download client and its WebTransport client, with the transport sized by
//! [`H3Options`]. Bodies go to a [`Sink`].

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use bytes::{Buf, Bytes};
use http::Request;
use rustls::ClientConfig;
use socket2::{Domain, Protocol, Socket, Type};

use crate::body::{Collect, Fetched, Sink};
use crate::pki::with_alpn;

/// How long [`H3Client::close`] gives the close to reach the server.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// A request stream of an [`H3Client`].
pub type RequestStream = h3::client::RequestStream<h3_quinn::BidiStream<Bytes>, Bytes>;
/// The request half of an [`H3Client`], cloned for concurrent requests.
pub type SendRequest = h3::client::SendRequest<h3_quinn::OpenStreams, Bytes>;

/// The client's transport and socket settings.
#[derive(Debug, Clone)]
pub struct H3Options {
    /// Per-stream and per-connection receive windows.
    pub stream_window: u32,
    pub window: u32,
    /// quinn's default (30 s) when `None`.
    pub idle_timeout: Option<Duration>,
    /// Requested kernel socket buffers, receive and send (best effort: capped by
    /// net.core.{r,w}mem_max); the kernel's defaults when `None`.
    pub socket_buffers: Option<(usize, usize)>,
    /// The largest UDP payload advertised; quinn's default when `None`.
    pub max_udp_payload: Option<u16>,
    /// Datagrams the QUIC stack may queue before it drops (bytes).
    pub datagram_receive_buffer: Option<usize>,
    /// Extended CONNECT and HTTP datagrams, for WebTransport sessions.
    pub webtransport: bool,
    /// QUIC PINGs at this interval keep the connection alive; none when `None`.
    pub keep_alive: Option<Duration>,
    /// The receive buffer of `socket_buffers` past net.core.rmem_max where the
    /// process may (`SO_RCVBUFFORCE`, root): for one bulk client that must not drop
    /// on its own socket, never for many clients at once (each would pin it).
    pub force_receive_buffer: bool,
}

impl Default for H3Options {
    /// Windows sized so the client is not what limits a test's bulk download;
    /// everything else quinn's and the kernel's defaults.
    fn default() -> Self {
        Self {
            stream_window: 16 << 20,
            window: 64 << 20,
            idle_timeout: None,
            socket_buffers: None,
            max_udp_payload: None,
            datagram_receive_buffer: None,
            webtransport: false,
            keep_alive: None,
            force_receive_buffer: false,
        }
    }
}

impl H3Options {
    /// Sized so that the client is not what limits a benchmark's bulk download:
    /// windows far above one loopback bandwidth-delay product, large UDP socket
    /// buffers, receive payloads up to the QUIC maximum (RFC 9000 §18.2, so a
    /// server probing a larger MTU is not capped here).
    pub fn bulk() -> Self {
        Self {
            stream_window: 32 << 20,
            window: 64 << 20,
            idle_timeout: Some(Duration::from_secs(10)),
            socket_buffers: Some((8 << 20, 1 << 20)),
            max_udp_payload: Some(65_527),
            ..Self::default()
        }
    }
}

/// A client endpoint on a loopback socket of the server's address family, trusting
/// what `tls` trusts (its ALPN is set to `h3`). Returns the receive buffer the
/// kernel granted.
pub fn endpoint(
    server: SocketAddr,
    tls: &ClientConfig,
    options: &H3Options,
) -> Result<(quinn::Endpoint, usize)> {
    // Loopback servers get a loopback source; any other (the WAN bench's, in another
    // network namespace) the kernel's choice, since a loopback source cannot leave.
    let loopback = server.ip().is_loopback();
    let (domain, local) = match (server.is_ipv4(), loopback) {
        (true, true) => (Domain::IPV4, SocketAddr::from((Ipv4Addr::LOCALHOST, 0))),
        (true, false) => (Domain::IPV4, SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0))),
        (false, true) => (Domain::IPV6, SocketAddr::from((Ipv6Addr::LOCALHOST, 0))),
        (false, false) => (Domain::IPV6, SocketAddr::from((Ipv6Addr::UNSPECIFIED, 0))),
    };
    let socket = Socket::new(domain, Type::DGRAM, Some(Protocol::UDP)).context("creating the UDP socket")?;
    if let Some((receive, send)) = options.socket_buffers {
        // Best effort: the kernel caps both at net.core.{r,w}mem_max, unless the
        // receive buffer is forced and the process may.
        let forced = options.force_receive_buffer
            && rustix::net::sockopt::set_socket_recv_buffer_size_force(&socket, receive).is_ok();
        if !forced {
            let _ = socket.set_recv_buffer_size(receive);
        }
        let _ = socket.set_send_buffer_size(send);
    }
    let rcvbuf = socket.recv_buffer_size().unwrap_or(0);
    socket
        .bind(&local.into())
        .with_context(|| format!("binding {local}"))?;
    let socket: UdpSocket = socket.into();

    let mut config = quinn::EndpointConfig::default();
    if let Some(max) = options.max_udp_payload {
        config
            .max_udp_payload_size(max)
            .map_err(|e| anyhow!("max_udp_payload_size: {e}"))?;
    }
    let mut endpoint = quinn::Endpoint::new(config, None, socket, Arc::new(quinn::TokioRuntime))
        .context("creating the QUIC endpoint")?;
    endpoint.set_default_client_config(client_config(tls, options)?);
    Ok((endpoint, rcvbuf))
}

fn client_config(tls: &ClientConfig, options: &H3Options) -> Result<quinn::ClientConfig> {
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(with_alpn(tls, b"h3"))
        .map_err(|e| anyhow!("rustls config unusable for QUIC: {e}"))?;
    let mut transport = quinn::TransportConfig::default();
    transport
        .stream_receive_window(options.stream_window.into())
        .receive_window(options.window.into());
    if let Some(idle) = options.idle_timeout {
        transport.max_idle_timeout(Some(idle.try_into().map_err(|e| anyhow!("idle timeout: {e}"))?));
    }
    transport.keep_alive_interval(options.keep_alive);
    if let Some(buffer) = options.datagram_receive_buffer {
        transport.datagram_receive_buffer_size(Some(buffer));
    }
    let mut client = quinn::ClientConfig::new(Arc::new(crypto));
    client.transport_config(Arc::new(transport));
    Ok(client)
}

/// One HTTP/3 connection on its own endpoint, its driver running on the current
/// runtime.
pub struct H3Client {
    endpoint: quinn::Endpoint,
    conn: quinn::Connection,
    driver: tokio::task::JoinHandle<()>,
    pub send: SendRequest,
    authority: String,
}

impl std::fmt::Debug for H3Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("H3Client")
            .field("authority", &self.authority)
            .finish_non_exhaustive()
    }
}

impl H3Client {
    /// A fresh endpoint, then a connection to `addr` with `sni`, verified with `tls`.
    pub async fn connect(
        addr: SocketAddr,
        sni: &str,
        tls: &ClientConfig,
        options: &H3Options,
    ) -> Result<Self> {
        let (endpoint, _) = endpoint(addr, tls, options)?;
        Self::connect_on(endpoint, addr, sni, options).await
    }

    /// A connection from `endpoint` (made by [`endpoint`]): the QUIC handshake and
    /// the HTTP/3 setup.
    pub async fn connect_on(
        endpoint: quinn::Endpoint,
        addr: SocketAddr,
        sni: &str,
        options: &H3Options,
    ) -> Result<Self> {
        let conn = endpoint
            .connect(addr, sni)
            .context("starting the QUIC handshake")?
            .await
            .with_context(|| format!("QUIC handshake with {addr}"))?;
        let (mut driver, send) = h3::client::builder()
            .enable_extended_connect(options.webtransport)
            .enable_datagram(options.webtransport)
            .build::<_, _, Bytes>(h3_quinn::Connection::new(conn.clone()))
            .await
            .context("HTTP/3 connection setup")?;
        // The connection (control streams, GOAWAY) is driven beside the requests.
        let driver = tokio::spawn(async move {
            let _ = std::future::poll_fn(|cx| driver.poll_close(cx)).await;
        });
        Ok(Self {
            endpoint,
            conn,
            driver,
            send,
            authority: format!("{sni}:{}", addr.port()),
        })
    }

    /// The QUIC connection (statistics, raw streams, datagrams).
    pub fn connection(&self) -> &quinn::Connection {
        &self.conn
    }

    pub fn endpoint(&self) -> &quinn::Endpoint {
        &self.endpoint
    }

    /// `https://host:port`, as request URIs start.
    pub fn origin(&self) -> String {
        format!("https://{}", self.authority)
    }

    /// Sends one request without a body and returns the response head and the
    /// stream its body arrives on.
    pub async fn send(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
    ) -> Result<(http::response::Parts, RequestStream)> {
        let origin = self.origin();
        request(&mut self.send, &origin, method, path, headers).await
    }

    /// One request; its body goes to `sink`. Returns the response head.
    pub async fn fetch_into<S: Sink>(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        sink: &mut S,
    ) -> Result<http::response::Parts> {
        let (parts, mut stream) = self.send(method, path, headers).await?;
        recv_body(&mut stream, sink)
            .await
            .with_context(|| format!("{method} {path}: reading the body"))?;
        Ok(parts)
    }

    /// One request on this connection, body counted, hashed and kept. For tests:
    /// it panics, saying what failed.
    pub async fn fetch(&mut self, method: &str, path: &str, headers: &[(&str, &str)]) -> Fetched {
        let mut body = Collect::default();
        let parts = self
            .fetch_into(method, path, headers, &mut body)
            .await
            .unwrap_or_else(|e| panic!("{e:#}"));
        body.into_fetched(parts)
    }

    /// Closes the connection and waits briefly for the close to be sent.
    pub async fn close(self) {
        drop(self.send);
        self.conn.close(0u32.into(), b"done");
        let _ = tokio::time::timeout(CLOSE_GRACE, self.endpoint.wait_idle()).await;
        self.driver.abort();
    }
}

/// Sends one request without a body on `send` (a clone of [`H3Client::send`] for
/// concurrent requests); `origin` as [`H3Client::origin`] gives it.
pub async fn request(
    send: &mut SendRequest,
    origin: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> Result<(http::response::Parts, RequestStream)> {
    let mut builder = Request::builder().method(method).uri(format!("{origin}{path}"));
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    let request = builder.body(()).context("building the request")?;
    let mut stream = send
        .send_request(request)
        .await
        .with_context(|| format!("sending {method} {path}"))?;
    stream.finish().await.context("finishing the request stream")?;
    let response = stream
        .recv_response()
        .await
        .context("reading the response head")?;
    Ok((response.into_parts().0, stream))
}

/// Reads a request stream's body to its end into `sink`.
pub async fn recv_body<S: Sink>(
    stream: &mut RequestStream,
    sink: &mut S,
) -> Result<(), h3::error::StreamError> {
    while let Some(mut chunk) = stream.recv_data().await? {
        while chunk.has_remaining() {
            let data = chunk.chunk();
            sink.update(data);
            let n = data.len();
            chunk.advance(n);
        }
    }
    Ok(())
}

/// One request on a fresh connection (test settings). For tests: it panics,
/// saying what failed.
pub async fn fetch_h3(
    addr: SocketAddr,
    sni: &str,
    tls: Arc<ClientConfig>,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> Fetched {
    let mut client = H3Client::connect(addr, sni, &tls, &H3Options::default())
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    let got = client.fetch(method, path, headers).await;
    client.close().await;
    got
}
