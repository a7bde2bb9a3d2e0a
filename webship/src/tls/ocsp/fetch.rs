//! One OCSP exchange over plain HTTP/1.1 (RFC 6960 appendix A: a POST of the DER
//! request), bounded in time ([`TIMEOUT`], connecting included) and in size
//! ([`MAX_RESPONSE`]).

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::TokioIo;

/// The whole exchange: name lookup, connect, request and response.
pub(crate) const TIMEOUT: Duration = Duration::from_secs(10);
/// Responses are a few KiB; anything larger is refused.
pub(crate) const MAX_RESPONSE: usize = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub(crate) enum FetchError {
    #[error("responder URL `{0}` is not an http:// URL with a host")]
    Url(String),
    #[error("responder {url}: {reason}")]
    Io { url: String, reason: String },
    #[error("responder {url}: no answer within {} s", TIMEOUT.as_secs())]
    Timeout { url: String },
    #[error("responder {url}: HTTP status {status}")]
    Status { url: String, status: u16 },
}

/// POSTs `request` to `url` and returns the response body.
pub(crate) async fn post(url: &str, request: &[u8]) -> Result<Vec<u8>, FetchError> {
    tokio::time::timeout(TIMEOUT, exchange(url, request))
        .await
        .map_err(|_| FetchError::Timeout { url: url.to_owned() })?
}

async fn exchange(url: &str, request: &[u8]) -> Result<Vec<u8>, FetchError> {
    let uri: http::Uri = url.parse().map_err(|_| FetchError::Url(url.to_owned()))?;
    let (Some("http"), Some(host)) = (uri.scheme_str(), uri.host()) else {
        return Err(FetchError::Url(url.to_owned()));
    };
    let io = |e: &dyn std::fmt::Display| FetchError::Io {
        url: url.to_owned(),
        reason: e.to_string(),
    };
    let port = uri.port_u16().unwrap_or(80);
    let authority = uri.authority().map(|a| a.as_str().to_owned()).unwrap_or_default();
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let tcp = tokio::net::TcpStream::connect((host, port))
        .await
        .map_err(|e| io(&e))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .map_err(|e| io(&e))?;
    let driver = tokio::spawn(conn);
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let req = http::Request::post(path)
        .header(http::header::HOST, authority)
        .header(http::header::CONTENT_TYPE, "application/ocsp-request")
        .header(http::header::ACCEPT, "application/ocsp-response")
        .body(Full::new(Bytes::copy_from_slice(request)))
        .map_err(|e| io(&e))?;
    let result = async {
        let response = sender.send_request(req).await.map_err(|e| io(&e))?;
        if !response.status().is_success() {
            return Err(FetchError::Status {
                url: url.to_owned(),
                status: response.status().as_u16(),
            });
        }
        let body = Limited::new(response.into_body(), MAX_RESPONSE)
            .collect()
            .await
            .map_err(|e| io(&format!("{e} (the cap is {MAX_RESPONSE} bytes)")))?;
        Ok(body.to_bytes().to_vec())
    }
    .await;
    driver.abort();
    result
}
