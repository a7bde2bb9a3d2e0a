//! Slow HTTP/1.1 downloads of a large file from Webship's own driver: what the server
//! holds for a client that takes a few KiB at a time, or that read fast and then
//! stopped, stays small (its reads follow what the client takes and what the socket
//! takes now, not the largest chunk), and every byte still arrives exactly once the
//! clients read again. Memory is read from /proc (VmRSS) while the downloads are held.
//!
//! The file is larger than what the kernel can buffer for one connection (the
//! maxima of `tcp_wmem` and `tcp_rmem`) plus what a client reads before it is held,
//! so the server itself must hold back part of every body, and resume it once the
//! client reads again.

use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use webship_tests::client::{connect, hex, Proto};

use crate::support::{pattern, Env, HOST, MIB};

/// Slow downloads held at once.
const CLIENTS: usize = 20;
/// Each slow client reads this much every [`PACE`] (40 KiB/s).
const SLOW_READ: usize = 4096;
const PACE: Duration = Duration::from_millis(100);
/// How long the clients read slowly before memory is read: the server fills each
/// socket and waits on it well within this.
const SLOW_FOR: Duration = Duration::from_secs(5);
/// What one slow download may add to the server's RSS. It was ≈340 KiB when every
/// HTTP/1.1 file response read 256 KiB chunks; the paced reads hold tens of KiB.
const MAX_KIB_PER_DOWNLOAD: u64 = 200;
/// Downloads that read fast, then stop.
const STOPPED: usize = 10;
/// What a fast client reads at full speed before it stops: enough for the server's
/// reads to have grown to their largest.
const FAST_READ: u64 = 8 * MIB;
/// What one stopped download may add to the server's RSS. A server that waits in a
/// write with its largest read (256 KiB) and rustls' default 64 KiB of records holds
/// ≈330 KiB; one that reads what the socket takes holds a small read.
const MAX_KIB_PER_STOPPED: u64 = 160;
/// All downloads, read at full speed, must end within this, plus one second per
/// [`DRAIN_PER_SECOND`] of their bodies (the file grows with the host's TCP buffers).
const DRAIN_LIMIT: Duration = Duration::from_secs(60);
const DRAIN_PER_SECOND: u64 = 10 * MIB;

/// The largest value of a `net.ipv4` TCP buffer sysctl (`tcp_wmem`, `tcp_rmem`).
fn tcp_buffer_max(name: &str) -> u64 {
    let path = format!("/proc/sys/net/ipv4/{name}");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
    text.split_whitespace()
        .last()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{path}: no maximum in {text:?}"))
}

/// What the kernel can hold of one loopback connection's response: the server's send
/// buffer and the client's receive buffer at their largest.
fn kernel_holds() -> u64 {
    tcp_buffer_max("tcp_wmem") + tcp_buffer_max("tcp_rmem")
}

/// One download: the response head first, then the body hashed as it comes.
struct Download {
    tls: TlsStream<TcpStream>,
    len: u64,
    head: Vec<u8>,
    body: u64,
    hash: Sha256,
}

impl Download {
    async fn start(env: &Env, server: &webship_tests::Server, len: u64) -> Download {
        let mut tls = connect(server.addr(), HOST, env.client(b"http/1.1"))
            .await
            .expect("TLS handshake");
        let get = format!("GET /big.bin HTTP/1.1\r\nHost: {HOST}\r\n\r\n");
        tls.write_all(get.as_bytes()).await.unwrap();
        tls.flush().await.unwrap();
        Download {
            tls,
            len,
            head: Vec::new(),
            body: 0,
            hash: Sha256::new(),
        }
    }

    /// Reads at most `max` bytes (one read); false once the body is complete.
    async fn read(&mut self, max: usize) -> bool {
        let mut buf = vec![0u8; max];
        let n = self.tls.read(&mut buf).await.expect("reading the response");
        assert!(
            n > 0,
            "the server closed after {} body bytes of {}",
            self.body,
            self.len
        );
        let mut got = &buf[..n];
        if self.head.is_empty() || !self.head.ends_with(b"\r\n\r\n") {
            let end = self.take_head(got);
            got = &got[end..];
        }
        self.body += got.len() as u64;
        self.hash.update(got);
        assert!(self.body <= self.len, "more body bytes than the file has");
        self.body < self.len
    }

    /// Appends head bytes from `got`; how many of them belonged to the head.
    fn take_head(&mut self, got: &[u8]) -> usize {
        for (i, byte) in got.iter().enumerate() {
            self.head.push(*byte);
            if self.head.ends_with(b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&self.head);
                assert!(head.starts_with("HTTP/1.1 200"), "{head}");
                return i + 1;
            }
        }
        assert!(self.head.len() < 8192, "no end of the response head");
        got.len()
    }
}

/// A server with a file of `len` bytes, after one full download of it (the runtime's
/// first response, its blocking pool and the page cache are not what a held download
/// costs), and its RSS then.
async fn warm_server(env: &Env, len: u64) -> (webship_tests::Server, String, u64) {
    let data = pattern(usize::try_from(len).unwrap());
    let want = hex(&Sha256::digest(&data));
    env.write("big.bin", &data);
    drop(data);
    let server = env.start("");
    let warm = env.get(Proto::H1, &server, "/big.bin", &[]).await;
    assert_eq!((warm.status.as_u16(), warm.len), (200, len), "warm-up");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = server.rss();
    (server, want, before)
}

/// Each download was held with part of its body still on the server (more than the
/// kernel buffers and what the client read), and the server resumes it: read at full
/// speed, every body is exact.
async fn drain_exact(downloads: Vec<Download>, want: &str) {
    let kernel = kernel_holds();
    for (i, d) in downloads.iter().enumerate() {
        assert!(
            d.body + kernel < d.len,
            "download {i}: {} bytes read and {kernel} in kernel buffers cover the \
             file of {}: the server never had to hold back",
            d.body,
            d.len
        );
    }
    let total: u64 = downloads.iter().map(|d| d.len).sum();
    let limit = DRAIN_LIMIT + Duration::from_secs(total / DRAIN_PER_SECOND);
    let mut downloads = downloads;
    let drained = async {
        for d in &mut downloads {
            while d.read(256 * 1024).await {}
        }
    };
    tokio::time::timeout(limit, drained)
        .await
        .expect("the downloads finished at full speed");
    for (i, d) in downloads.into_iter().enumerate() {
        assert_eq!(d.body, d.len, "download {i}: body length");
        assert_eq!(hex(&d.hash.finalize()), want, "download {i}: body digest");
    }
}

/// 20 clients read a large file at 40 KiB/s each: while the server waits on all of
/// them its RSS grows by less than 200 KiB per download (it read 256 KiB chunks
/// before, ≈340 KiB each), and then, read at full speed, every body is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_h1_downloads_hold_little_and_arrive_exact() {
    let env = Env::new();
    let len = kernel_holds() + 4 * MIB;
    let (server, want, before) = warm_server(&env, len).await;

    let mut downloads = Vec::with_capacity(CLIENTS);
    for _ in 0..CLIENTS {
        downloads.push(Download::start(&env, &server, len).await);
    }
    let slow_until = Instant::now() + SLOW_FOR;
    while Instant::now() < slow_until {
        for d in &mut downloads {
            assert!(d.read(SLOW_READ).await, "a slow download finished early");
        }
        tokio::time::sleep(PACE).await;
    }
    let held = server.rss();
    let per_download = held.saturating_sub(before) / 1024 / CLIENTS as u64;
    eprintln!(
        "slow h1 downloads: RSS {} KiB before, {} KiB with {CLIENTS} held: {per_download} KiB each",
        before / 1024,
        held / 1024
    );
    drain_exact(downloads, &want).await;
    assert!(
        per_download < MAX_KIB_PER_DOWNLOAD,
        "each slow download added {per_download} KiB to the server's RSS \
         ({} → {} KiB for {CLIENTS}); at most {MAX_KIB_PER_DOWNLOAD} expected",
        before / 1024,
        held / 1024
    );
}

/// 10 clients each read 8 MiB at full speed (the server's reads grow to their
/// largest), then stop: while the server waits on them its RSS grows by less than
/// 160 KiB per download (a server blocked with its largest read holds ≈330 KiB), and
/// then, read at full speed again, every body is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_then_stopped_h1_downloads_hold_little_and_arrive_exact() {
    let env = Env::new();
    let len = kernel_holds() + FAST_READ + 4 * MIB;
    let (server, want, before) = warm_server(&env, len).await;

    let mut downloads = Vec::with_capacity(STOPPED);
    for _ in 0..STOPPED {
        let mut d = Download::start(&env, &server, len).await;
        while d.body < FAST_READ {
            assert!(d.read(256 * 1024).await, "a fast download finished early");
        }
        downloads.push(d);
    }
    // The server fills each socket and the client's receive buffer at loopback speed,
    // then waits in a write.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let held = server.rss();
    let per_download = held.saturating_sub(before) / 1024 / STOPPED as u64;
    eprintln!(
        "stopped h1 downloads: RSS {} KiB before, {} KiB with {STOPPED} held: {per_download} KiB each",
        before / 1024,
        held / 1024
    );
    drain_exact(downloads, &want).await;
    assert!(
        per_download < MAX_KIB_PER_STOPPED,
        "each download stopped after a fast start added {per_download} KiB to the \
         server's RSS ({} → {} KiB for {STOPPED}); at most {MAX_KIB_PER_STOPPED} expected",
        before / 1024,
        held / 1024
    );
}
