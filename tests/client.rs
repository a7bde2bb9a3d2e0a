//! Real clients: hyper over tokio-rustls (h1 and h2), raw HTTP/1.1 bytes over TLS,
//! and curl.

use std::net::SocketAddr;
use std::process::{Command, Output};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::ServerName;
use rustls::ClientConfig;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

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
}

/// Bodies up to this size are kept in [`Fetched::body`]; larger ones are only hashed.
const KEEP: u64 = 4 * 1024 * 1024;

#[derive(Debug)]
pub struct Fetched {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub len: u64,
    pub sha256: [u8; 32],
    pub body: Vec<u8>,
}

impl Fetched {
    pub fn header(&self, name: &str) -> &str {
        self.headers.get(name).map_or("", |v| v.to_str().unwrap())
    }
}

/// TLS to `addr` with `sni` (an IP address means no SNI is sent).
pub async fn connect(
    addr: SocketAddr,
    sni: &str,
    config: Arc<ClientConfig>,
) -> std::io::Result<TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await?;
    let name = ServerName::try_from(sni.to_owned()).unwrap();
    TlsConnector::from(config).connect(name, tcp).await
}

/// One GET (or `method`) on a fresh connection, body streamed through SHA-256.
pub async fn fetch(
    proto: Proto,
    addr: SocketAddr,
    sni: &str,
    config: Arc<ClientConfig>,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> Fetched {
    let tls = connect(addr, sni, config).await.unwrap();
    assert_eq!(
        tls.get_ref().1.alpn_protocol(),
        Some(proto.alpn()),
        "server did not negotiate {proto:?}"
    );
    let io = TokioIo::new(tls);
    let authority = format!("{sni}:{}", addr.port());
    let mut builder = Request::builder().method(method);
    builder = match proto {
        Proto::H1 => builder.uri(path).header("host", &authority),
        Proto::H2 => builder.uri(format!("https://{authority}{path}")),
    };
    for (k, v) in headers {
        builder = builder.header(*k, *v);
    }
    let req = builder.body(Empty::<Bytes>::new()).unwrap();
    // The connection task is awaited at the end, so the connection is closed cleanly
    // before this returns and never lingers into a server's shutdown.
    let (resp, conn) = match proto {
        Proto::H1 => {
            let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await.unwrap();
            let conn = tokio::spawn(async move {
                let _ = conn.await;
            });
            (sender.send_request(req).await.unwrap(), conn)
        }
        Proto::H2 => {
            let (mut sender, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
                .await
                .unwrap();
            let conn = tokio::spawn(async move {
                let _ = conn.await;
            });
            (sender.send_request(req).await.unwrap(), conn)
        }
    };
    let (parts, mut body) = resp.into_parts();
    let mut hasher = Sha256::new();
    let mut len = 0u64;
    let mut kept = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.unwrap();
        if let Some(data) = frame.data_ref() {
            hasher.update(data);
            len += data.len() as u64;
            if len <= KEEP {
                kept.extend_from_slice(data);
            }
        }
    }
    drop(body);
    let _ = tokio::time::timeout(Duration::from_secs(2), conn).await;
    Fetched {
        status: parts.status,
        headers: parts.headers,
        len,
        sha256: hasher.finalize().into(),
        body: kept,
    }
}

/// An HTTP/3 connection from a fresh quinn client endpoint.
pub struct H3Client {
    endpoint: quinn::Endpoint,
    driver: tokio::task::JoinHandle<()>,
    pub send: h3::client::SendRequest<h3_quinn::OpenStreams, Bytes>,
    authority: String,
}

impl H3Client {
    /// Connects to `addr` with `sni`, verifying against `config` (ALPN is set to h3).
    pub async fn connect(addr: SocketAddr, sni: &str, config: Arc<ClientConfig>) -> Self {
        let mut tls = (*config).clone();
        tls.alpn_protocols = vec![b"h3".to_vec()];
        let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(Arc::new(tls)).unwrap();
        let mut transport = quinn::TransportConfig::default();
        // Windows sized so the client is not what limits a bulk download.
        transport
            .stream_receive_window((16u32 << 20).into())
            .receive_window((64u32 << 20).into());
        let mut client = quinn::ClientConfig::new(Arc::new(crypto));
        client.transport_config(Arc::new(transport));
        let mut endpoint = quinn::Endpoint::client(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
        endpoint.set_default_client_config(client);
        let conn = endpoint.connect(addr, sni).unwrap().await.unwrap();
        let (mut driver, send) = h3::client::new(h3_quinn::Connection::new(conn)).await.unwrap();
        let driver = tokio::spawn(async move {
            let _ = std::future::poll_fn(|cx| driver.poll_close(cx)).await;
        });
        Self {
            endpoint,
            driver,
            send,
            authority: format!("{sni}:{}", addr.port()),
        }
    }

    /// One request on this connection, body streamed through SHA-256.
    pub async fn fetch(&mut self, method: &str, path: &str, headers: &[(&str, &str)]) -> Fetched {
        let mut builder = Request::builder()
            .method(method)
            .uri(format!("https://{}{path}", self.authority));
        for (k, v) in headers {
            builder = builder.header(*k, *v);
        }
        let mut stream = self.send.send_request(builder.body(()).unwrap()).await.unwrap();
        stream.finish().await.unwrap();
        let resp = stream.recv_response().await.unwrap();
        let mut hasher = Sha256::new();
        let mut len = 0u64;
        let mut kept = Vec::new();
        while let Some(mut chunk) = stream.recv_data().await.unwrap() {
            use bytes::Buf;
            while chunk.has_remaining() {
                let data = chunk.chunk();
                hasher.update(data);
                len += data.len() as u64;
                if len <= KEEP {
                    kept.extend_from_slice(data);
                }
                let n = data.len();
                chunk.advance(n);
            }
        }
        let (parts, ()) = resp.into_parts();
        Fetched {
            status: parts.status,
            headers: parts.headers,
            len,
            sha256: hasher.finalize().into(),
            body: kept,
        }
    }

    /// Closes the connection and waits briefly for the close to be sent.
    pub async fn close(self) {
        drop(self.send);
        self.endpoint.close(0u32.into(), b"done");
        let _ = tokio::time::timeout(Duration::from_secs(2), self.endpoint.wait_idle()).await;
        self.driver.abort();
    }
}

/// One request over HTTP/3 on a fresh connection.
pub async fn fetch_h3(
    addr: SocketAddr,
    sni: &str,
    config: Arc<ClientConfig>,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> Fetched {
    let mut client = H3Client::connect(addr, sni, config).await;
    let got = client.fetch(method, path, headers).await;
    client.close().await;
    got
}

/// Writes `request` verbatim over HTTP/1.1-over-TLS and returns everything the
/// server sends until it closes (or 10 s pass).
pub async fn raw_h1(addr: SocketAddr, sni: &str, config: Arc<ClientConfig>, request: &[u8]) -> Vec<u8> {
    let mut tls = connect(addr, sni, config).await.unwrap();
    tls.write_all(request).await.unwrap();
    tls.flush().await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), tls.read_to_end(&mut out)).await;
    out
}

/// The status code of the first response in raw HTTP/1.1 bytes.
pub fn raw_status(response: &[u8]) -> u16 {
    let text = String::from_utf8_lossy(response);
    text.split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"))
}

/// Runs curl with `--resolve` mapping `host` to the server.
pub fn curl(host: &str, port: u16, args: &[&str]) -> Output {
    Command::new("curl")
        .args(["--silent", "--show-error", "--max-time", "120"])
        .args(["--resolve", &format!("{host}:{port}:127.0.0.1")])
        .args(args)
        .output()
        .expect("curl is required: `cargo xtask test` installs it")
}

pub fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}
