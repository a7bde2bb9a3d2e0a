//! TLS behaviour a client sees: both protocol versions, session resumption, ALPN,
//! and a non-TLS client getting nothing but a closed connection.

use std::sync::Arc;

use rustls::client::Resumption;
use rustls::HandshakeKind;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use webship_tests::client::{connect, raw_status};

use crate::support::{Env, HOST};

fn request() -> String {
    format!("GET /hello.txt HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n")
}

async fn get_over(addr: std::net::SocketAddr, config: Arc<rustls::ClientConfig>) -> (Vec<u8>, HandshakeKind) {
    let mut tls = connect(addr, HOST, config).await.unwrap();
    let kind = tls.get_ref().1.handshake_kind().unwrap();
    tls.write_all(request().as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tls.read_to_end(&mut out).await.unwrap();
    (out, kind)
}

#[tokio::test]
async fn tls12_and_tls13_with_resumption() {
    let env = Env::new();
    env.write("hello.txt", b"hello");
    let server = env.start("");
    for version in [&rustls::version::TLS13, &rustls::version::TLS12] {
        let mut roots = rustls::RootCertStore::empty();
        let ca = std::fs::read(env.ca_file()).unwrap();
        for cert in rustls::pki_types::pem::PemObject::pem_slice_iter(&ca) {
            roots.add(cert.unwrap()).unwrap();
        }
        let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::aws_lc_rs::default_provider(),
        ))
        .with_protocol_versions(&[version])
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        config.resumption = Resumption::in_memory_sessions(16);
        let config = Arc::new(config);

        let (first, kind) = get_over(server.addr(), config.clone()).await;
        assert_eq!(raw_status(&first), 200, "{version:?}");
        assert_eq!(kind, HandshakeKind::Full);
        let (second, kind) = get_over(server.addr(), config).await;
        assert_eq!(raw_status(&second), 200);
        assert_eq!(
            kind,
            HandshakeKind::Resumed,
            "{version:?}: the second connection resumes"
        );
    }
}

#[tokio::test]
async fn plaintext_http_gets_a_closed_connection() {
    let env = Env::new();
    let server = env.start("");
    let mut tcp = tokio::net::TcpStream::connect(server.addr()).await.unwrap();
    tcp.write_all(b"GET / HTTP/1.1\r\nHost: files.test\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    let read = tokio::time::timeout(std::time::Duration::from_secs(5), tcp.read_to_end(&mut out)).await;
    assert!(read.is_ok(), "the server kept a non-TLS connection open");
    assert!(!String::from_utf8_lossy(&out).contains("HTTP/1.1 200"));
}
