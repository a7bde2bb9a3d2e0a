//! Slow HTTP/1.1 downloads of a large file from Webship's own driver: what the server
//! holds for a client that takes a few KiB at a time stays small (its reads follow
//! what the client takes, not the largest chunk), and every byte still arrives
//! exactly. Memory is read from /proc (VmRSS) while the downloads are held.

use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use webship_tests::client::{connect, hex, Proto};

use crate::support::{pattern, Env, HOST, MIB};

/// Slow downloads held at once.
const CLIENTS: usize = 20;
/// Larger than what loopback socket buffers absorb (about 4 MiB a connection), so
/// the server ends up waiting on every slow client.
const FILE_LEN: usize = 12 * 1024 * 1024;
/// Each slow client reads this much every [`PACE`] (40 KiB/s).
const SLOW_READ: usize = 4096;
const PACE: Duration = Duration::from_millis(100);
/// How long the clients read slowly before memory is read: the server fills each
/// socket and waits on it well within this.
const SLOW_FOR: Duration = Duration::from_secs(5);
/// What one slow download may add to the server's RSS. It was ≈340 KiB when every
/// HTTP/1.1 file response read 256 KiB chunks; the paced reads hold tens of KiB.
const MAX_KIB_PER_DOWNLOAD: u64 = 200;
/// A whole download, read at full speed, must end within this.
const DRAIN_LIMIT: Duration = Duration::from_secs(60);

/// One download: the response head first, then the body hashed as it comes.
struct Download {
    tls: TlsStream<TcpStream>,
    head: Vec<u8>,
    body: u64,
    hash: Sha256,
}

impl Download {
    async fn start(env: &Env, server: &webship_tests::Server) -> Download {
        let mut tls = connect(server.addr(), HOST, env.client(b"http/1.1"))
            .await
            .expect("TLS handshake");
        let get = format!("GET /big.bin HTTP/1.1\r\nHost: {HOST}\r\n\r\n");
        tls.write_all(get.as_bytes()).await.unwrap();
        tls.flush().await.unwrap();
        Download {
            tls,
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
            "the server closed after {} body bytes of {FILE_LEN}",
            self.body
        );
        let mut got = &buf[..n];
        if self.head.is_empty() || !self.head.ends_with(b"\r\n\r\n") {
            let end = self.take_head(got);
            got = &got[end..];
        }
        self.body += got.len() as u64;
        self.hash.update(got);
        assert!(self.body <= FILE_LEN as u64, "more body bytes than the file has");
        self.body < FILE_LEN as u64
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

/// 20 clients read a 12 MiB file at 40 KiB/s each: while the server waits on all of
/// them its RSS grows by less than 200 KiB per download (it read 256 KiB chunks
/// before, ≈340 KiB each), and then, read at full speed, every body is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_h1_downloads_hold_little_and_arrive_exact() {
    let env = Env::new();
    let data = pattern(FILE_LEN);
    let want = hex(&Sha256::digest(&data));
    env.write("big.bin", &data);
    drop(data);
    let server = env.start("");
    // One full download first: the runtime's first response (its blocking pool, the
    // page cache) is not what a slow download costs.
    let warm = env.get(Proto::H1, &server, "/big.bin", &[]).await;
    assert_eq!(
        (warm.status.as_u16(), warm.len),
        (200, FILE_LEN as u64),
        "warm-up"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = server.rss();

    let mut downloads = Vec::with_capacity(CLIENTS);
    for _ in 0..CLIENTS {
        downloads.push(Download::start(&env, &server).await);
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
    let slowest = downloads.iter().map(|d| d.body).min().unwrap_or(0);
    assert!(
        slowest < FILE_LEN as u64 - 8 * MIB,
        "the clients were not slow: one had {slowest} bytes"
    );

    let drained = async {
        for d in &mut downloads {
            while d.read(256 * 1024).await {}
        }
    };
    tokio::time::timeout(DRAIN_LIMIT, drained)
        .await
        .expect("the downloads finished at full speed");
    for (i, d) in downloads.into_iter().enumerate() {
        assert_eq!(d.body, FILE_LEN as u64, "download {i}: body length");
        assert_eq!(hex(&d.hash.finalize()), want, "download {i}: body digest");
    }
    assert!(
        per_download < MAX_KIB_PER_DOWNLOAD,
        "each slow download added {per_download} KiB to the server's RSS \
         ({} → {} KiB for {CLIENTS}); at most {MAX_KIB_PER_DOWNLOAD} expected",
        before / 1024,
        held / 1024
    );
}
