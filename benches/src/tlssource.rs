//! `tls-source`: the memory-to-memory TLS baseline's server.
//!
//! It holds the fixture in memory and answers every GET with it, over TLS 1.3
//! (rustls, aws-lc-rs) and HTTP/1.1 or HTTP/2 by ALPN: no disk, no file
//! layer, no proxy. HTTP/1.1 is written by hand: the response head, then the
//! body in 256 KiB writes (rustls makes full 16 KiB records of them, four to a
//! `writev`). HTTP/2 goes through hyper, which writes each DATA frame as its own
//! TLS write: a weaker sender, so a server that batches frames can beat it.
//! The report prints what the `get` client reaches against it as "the limit on
//! this machine" beside the plain-HTTP sendfile baseline (nginx without TLS).
//! Run by the runner as a child process on one core, like the servers under test.

use std::convert::Infallible;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Args;
use http_body_util::Full;
use hyper::body::Bytes;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpListener;

#[derive(Debug, Args)]
pub(crate) struct TlsSourceArgs {
    /// The loopback port to listen on.
    #[arg(long)]
    pub port: u16,
    #[arg(long)]
    pub cert: PathBuf,
    #[arg(long)]
    pub key: PathBuf,
    /// The file served from memory (read once at startup).
    #[arg(long)]
    pub file: PathBuf,
}

pub(crate) fn run(args: &TlsSourceArgs) -> Result<()> {
    let body =
        Bytes::from(std::fs::read(&args.file).with_context(|| format!("reading {}", args.file.display()))?);
    let certs = CertificateDer::pem_file_iter(&args.cert)
        .with_context(|| format!("reading {}", args.cert.display()))?
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("parsing {}", args.cert.display()))?;
    let key =
        PrivateKeyDer::from_pem_file(&args.key).with_context(|| format!("reading {}", args.key.display()))?;
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut tls = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .context("TLS 1.3 with the aws-lc-rs provider")?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .context("the certificate and key")?;
    tls.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("building the tokio runtime")?;
    runtime.block_on(async move {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, args.port));
        let listener = TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        eprintln!("tls-source: {} bytes from memory on https://{addr}", body.len());
        loop {
            let (tcp, peer) = listener.accept().await.context("accepting")?;
            let (acceptor, body) = (acceptor.clone(), body.clone());
            tokio::spawn(async move {
                if let Err(e) = serve(acceptor, tcp, body).await {
                    eprintln!("tls-source: {peer}: {e:#}");
                }
            });
        }
    })
}

/// One connection: every request gets the whole body.
async fn serve(acceptor: tokio_rustls::TlsAcceptor, tcp: tokio::net::TcpStream, body: Bytes) -> Result<()> {
    tcp.set_nodelay(true)?;
    let tls = acceptor.accept(tcp).await.context("TLS handshake")?;
    if tls.get_ref().1.alpn_protocol() != Some(b"h2") {
        return serve_h1(tls, &body).await;
    }
    let service = service_fn(move |_request| {
        let body = body.clone();
        async move { Ok::<_, Infallible>(hyper::Response::new(Full::new(body))) }
    });
    hyper::server::conn::http2::Builder::new(TokioExecutor::new())
        .serve_connection(TokioIo::new(tls), service)
        .await
        .context("HTTP/2")
}

/// The largest request head read; the bench client's is a few dozen bytes.
const MAX_HEAD: usize = 8 * 1024;
/// Body bytes per write.
const WRITE: usize = 256 * 1024;

/// HTTP/1.1 by hand: each request head (up to an empty line) gets a 200 with the body.
async fn serve_h1<S>(mut tls: S, body: &[u8]) -> Result<()>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    loop {
        let n = tls.read(&mut buf).await.context("reading a request")?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
        if head.len() > MAX_HEAD {
            bail!("a request head over {MAX_HEAD} bytes");
        }
        // Pipelining is not expected: one request, then its response.
        if !head.windows(4).any(|w| w == b"\r\n\r\n") {
            continue;
        }
        head.clear();
        let response = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        tls.write_all(response.as_bytes())
            .await
            .context("writing the head")?;
        for chunk in body.chunks(WRITE) {
            tls.write_all(chunk).await.context("writing the body")?;
        }
        tls.flush().await.context("flushing")?;
    }
}
