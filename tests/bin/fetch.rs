//! `webship-fetch`: one HTTP/1.1 GET over rustls with a chosen TLS version and cipher,
//! printing `<status> <body length> <sha256>`. It insists on a `close_notify` at the
//! end, so it also checks that a promoted connection closes with a real alert. The kTLS VM test uses it as the rustls
//! peer next to curl (OpenSSL).
//!
//! usage: webship-fetch HOST:PORT SNI PATH CA.pem tls12|tls13 aes128|aes256|chacha20

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;

use anyhow::{bail, Context};
use rustls::pki_types::ServerName;
use rustls::CipherSuite;
use sha2::{Digest, Sha256};
use webship_testkit::fixture::hex;
use webship_testkit::pki::roots_from_pem;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [addr, sni, path, ca, version, cipher] = args.as_slice() else {
        bail!("usage: webship-fetch HOST:PORT SNI PATH CA.pem tls12|tls13 aes128|aes256|chacha20");
    };
    let wanted: &[CipherSuite] = match (version.as_str(), cipher.as_str()) {
        ("tls13", "aes128") => &[CipherSuite::TLS13_AES_128_GCM_SHA256],
        ("tls13", "aes256") => &[CipherSuite::TLS13_AES_256_GCM_SHA384],
        ("tls13", "chacha20") => &[CipherSuite::TLS13_CHACHA20_POLY1305_SHA256],
        ("tls12", "aes128") => &[
            CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
            CipherSuite::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
        ],
        ("tls12", "aes256") => &[
            CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
            CipherSuite::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
        ],
        ("tls12", "chacha20") => &[
            CipherSuite::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
            CipherSuite::TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256,
        ],
        _ => bail!("unknown version/cipher {version}/{cipher}"),
    };
    let mut provider = rustls::crypto::aws_lc_rs::default_provider();
    provider.cipher_suites.retain(|s| wanted.contains(&s.suite()));
    let versions: &[&rustls::SupportedProtocolVersion] = if version == "tls13" {
        &[&rustls::version::TLS13]
    } else {
        &[&rustls::version::TLS12]
    };
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(provider))
        .with_protocol_versions(versions)?
        .with_root_certificates(roots_from_pem(ca.as_ref())?)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let name = ServerName::try_from(sni.clone())?;
    let conn = rustls::ClientConnection::new(Arc::new(config), name)?;
    let tcp = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    write!(
        tls,
        "GET {path} HTTP/1.1\r\nHost: {sni}\r\nConnection: close\r\n\r\n"
    )?;
    tls.flush()?;

    // Read the head, then hash the body as it streams.
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if tls.read(&mut byte)? == 0 {
            bail!("connection closed inside the response head");
        }
        head.push(byte[0]);
        if head.len() > 64 * 1024 {
            bail!("response head too large");
        }
    }
    let head = String::from_utf8_lossy(&head);
    let status = head.split_whitespace().nth(1).unwrap_or("0").to_owned();
    let mut hasher = Sha256::new();
    let mut len = 0u64;
    let mut buf = vec![0u8; 256 * 1024];
    loop {
        match tls.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                hasher.update(&buf[..n]);
                len += n as u64;
            }
            // rustls reports a close without `close_notify` as UnexpectedEof: the server
            // must end the connection with a real alert, also from kernel TLS.
            Err(e) => {
                return Err(anyhow::Error::new(e).context("the connection did not end with close_notify"))
            }
        }
    }
    println!("{status} {len} {}", hex(&hasher.finalize()));
    Ok(())
}
