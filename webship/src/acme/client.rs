//! The HTTP client instant-acme speaks through: its own default client reads every
//! response body whole, so a hostile or broken ACME server could make the daemon
//! hold any amount of memory. This one cuts each body at [`MAX_BODY`] (ACME
//! answers are small JSON documents and certificate chains).

use std::future::Future;
use std::pin::Pin;

use bytes::Bytes;
use http_body_util::Limited;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use instant_acme::{BodyWrapper, BytesResponse, HttpClient};

/// The largest response body read from the ACME server.
pub(super) const MAX_BODY: usize = 1024 * 1024;

type Inner = Client<hyper_rustls::HttpsConnector<HttpConnector>, BodyWrapper<Bytes>>;

/// An https-only client whose response bodies are capped at [`MAX_BODY`].
pub(super) struct Capped(Inner);

impl Capped {
    /// Trusts the system's roots (the platform verifier), as instant-acme does.
    pub(super) fn platform() -> Result<Self, instant_acme::Error> {
        let builder = hyper_rustls::HttpsConnectorBuilder::new()
            .try_with_platform_verifier()
            .map_err(|e| instant_acme::Error::Other(Box::new(e)))?;
        Ok(Self::build(
            builder.https_only().enable_http1().enable_http2().build(),
        ))
    }

    /// Trusts only the certificates of the PEM file `ca` (`directory_ca`).
    pub(super) fn with_ca(ca: &std::path::Path) -> Result<Self, instant_acme::Error> {
        use rustls::pki_types::pem::PemObject;
        let other = |e: String| instant_acme::Error::Other(format!("`{}`: {e}", ca.display()).into());
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls::pki_types::CertificateDer::pem_file_iter(ca).map_err(|e| other(e.to_string()))? {
            roots
                .add(cert.map_err(|e| other(e.to_string()))?)
                .map_err(|e| other(e.to_string()))?;
        }
        if roots.is_empty() {
            return Err(other("no CERTIFICATE block found".into()));
        }
        let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(crate::tls::provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| other(e.to_string()))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Self::build(
            hyper_rustls::HttpsConnectorBuilder::new()
                .with_tls_config(config)
                .https_only()
                .enable_http1()
                .enable_http2()
                .build(),
        ))
    }

    fn build(connector: hyper_rustls::HttpsConnector<HttpConnector>) -> Self {
        Self(Client::builder(TokioExecutor::new()).build(connector))
    }
}

impl HttpClient for Capped {
    fn request(
        &self,
        req: http::Request<BodyWrapper<Bytes>>,
    ) -> Pin<Box<dyn Future<Output = Result<BytesResponse, instant_acme::Error>> + Send>> {
        let sent = self.0.request(req);
        Box::pin(async move {
            let response = sent.await.map_err(|e| instant_acme::Error::Other(Box::new(e)))?;
            // `Limited` fails the read once the body passes the cap; instant-acme
            // reports that as the request's error.
            Ok(BytesResponse::from(
                response.map(|body| Limited::new(body, MAX_BODY)),
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A TLS server on loopback answering every connection with a `len`-byte body;
    /// returns its port and the PEM file of its certificate (for "localhost").
    async fn server(len: usize, dir: &std::path::Path) -> (u16, std::path::PathBuf) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let pem = dir.join("ca.pem");
        std::fs::write(&pem, cert.pem()).unwrap();
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(crate::tls::provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![cert.der().clone()],
                rustls::pki_types::PrivatePkcs8KeyDer::from(key.serialize_der()).into(),
            )
            .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let mut head = [0u8; 4096];
                    let _ = tls.read(&mut head).await;
                    let text = format!("HTTP/1.1 200 OK\r\nContent-Length: {len}\r\n\r\n");
                    let _ = tls.write_all(text.as_bytes()).await;
                    let _ = tls.write_all(&vec![b'x'; len]).await;
                    let _ = tls.shutdown().await;
                });
            }
        });
        (port, pem)
    }

    async fn fetch(len: usize) -> Result<usize, String> {
        let dir = tempfile::tempdir().unwrap();
        let (port, pem) = server(len, dir.path()).await;
        let client = Capped::with_ca(&pem).unwrap();
        let request = http::Request::get(format!("https://localhost:{port}/directory"))
            .body(BodyWrapper::default())
            .unwrap();
        let mut response = tokio::time::timeout(std::time::Duration::from_secs(10), client.request(request))
            .await
            .expect("the test server answers")
            .map_err(|e| e.to_string())?;
        tokio::time::timeout(std::time::Duration::from_secs(10), response.body.into_bytes())
            .await
            .expect("the body is read or refused in time")
            .map(|b| b.len())
            .map_err(|e| e.to_string())
    }

    #[tokio::test]
    async fn a_body_over_the_cap_is_refused_and_one_under_it_read() {
        assert_eq!(fetch(1000).await, Ok(1000));
        assert_eq!(fetch(MAX_BODY).await, Ok(MAX_BODY));
        let err = fetch(MAX_BODY + 1).await.unwrap_err();
        assert!(err.contains("length limit"), "{err}");
    }
}
