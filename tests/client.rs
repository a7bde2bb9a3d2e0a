//! Real clients: the test kit's hyper-over-rustls (h1 and h2) and quinn + h3
//! clients, raw HTTP/1.1 bytes over TLS, and curl.

use std::net::SocketAddr;
use std::process::{Command, Output};
use std::sync::Arc;
use std::time::Duration;

use rustls::ClientConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
pub use webship_testkit::body::{Collect, Fetched, Outcome};
pub use webship_testkit::fixture::hex;
pub use webship_testkit::h3::{fetch_h3, recv_body, request, H3Client, H3Options};
pub use webship_testkit::http::{connect, fetch, outcome, read_body, Conn, Proto, Tuning};

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
