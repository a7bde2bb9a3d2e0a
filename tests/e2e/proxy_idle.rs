//! HTTP/1.1 connections to a TLS-terminating proxy site before their first request:
//! the daemon builds hyper's connection only once the client's first bytes are
//! there, and until then keeps the limits hyper's connection kept — the first
//! request head is due `header_read_timeout` after the handshake (counted as
//! `header_timeout`), a shorter `idle_timeout` closes in order (`closed`), the drain
//! closes at once — while requests that come after a pause, pipelined or kept
//! alive, are served as before, byte for byte.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rustls::ClientConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use webship_tests::client::{connect, hex, outcome, Conn, Proto, Tuning};
use webship_tests::nginx::Nginx;
use webship_tests::server::eventually;
use webship_tests::{fixture, Server, FIXTURE_LEN};

use crate::subsystem_metrics::{admin, Scrape};
use crate::support::Env;

const HOST: &str = "proxy.test";
const H1_HEADER_TIMEOUT: &str =
    "webship_connections_closed_total{transport=\"tcp\",protocol=\"h1\",reason=\"header_timeout\"}";
const H1_CLOSED: &str =
    "webship_connections_closed_total{transport=\"tcp\",protocol=\"h1\",reason=\"closed\"}";

/// A TLS-terminating proxy site `proxy.test` in front of nginx (serving the fixture
/// and `files`), with `limits` and the admin listener.
struct World {
    env: Env,
    server: Server,
    admin: SocketAddr,
    _nginx: Nginx,
}

fn world(limits: &str, files: &[(&str, &[u8])]) -> World {
    let env = Env::new();
    fixture().place(&env.root, "fixture.bin").unwrap();
    for (name, contents) in files {
        env.write(name, contents);
    }
    let nginx = Nginx::start(&env.root);
    let (admin_toml, admin) = admin();
    let (cert, key) = env.leaf("proxy", &[HOST]);
    let config = format!(
        "listen = \"127.0.0.1:{{port}}\"\nworkers = 2\n\n[limits]\n{limits}\n{admin_toml}\n\
         [reverse_proxy]\nenabled = true\ntls_termination = true\n[reverse_proxy.tls]\n\
         cert = \"{}\"\nkey = \"{}\"\n[[reverse_proxy.routes]]\ndomain = \"{HOST}\"\n\
         path_prefix = \"/\"\nupstreams = [\"{}\"]\n",
        cert.display(),
        key.display(),
        nginx.addr
    );
    let server = Server::start(env.dir.path(), &config);
    World {
        env,
        server,
        admin,
        _nginx: nginx,
    }
}

impl World {
    fn tls(&self) -> Arc<ClientConfig> {
        self.env.client(b"http/1.1")
    }

    async fn connect(&self) -> TlsStream<TcpStream> {
        connect(self.server.addr(), HOST, self.tls()).await.unwrap()
    }

    /// The value of `series` once it reaches `want` (10 s at most), else its last.
    fn counted(&self, series: &str, want: f64) -> f64 {
        let mut last = 0.0;
        eventually(Duration::from_secs(10), || {
            last = Scrape::take(self.admin).get(series).unwrap_or(0.0);
            last >= want
        });
        last
    }
}

/// Reads until the server ends the connection (10 s at most): how long that took from
/// `since`, and whether it ended in order (close_notify) rather than by a bare close.
async fn until_closed(tls: &mut TlsStream<TcpStream>, since: Instant) -> (Duration, bool) {
    let mut rest = Vec::new();
    let ended = tokio::time::timeout(Duration::from_secs(10), tls.read_to_end(&mut rest))
        .await
        .expect("the server never closed the connection");
    assert!(
        rest.is_empty(),
        "bytes before the close: {:?}",
        String::from_utf8_lossy(&rest)
    );
    (since.elapsed(), ended.is_ok())
}

/// A connection that sends nothing after its handshake is closed at the header
/// timeout and counted as `header_timeout`, as when hyper's connection (built at once)
/// timed its first head; and a head begun late must still be complete by the same
/// deadline, counted from the handshake, not from its first byte (hyper's own timer,
/// started when its connection is built, would allow 2.5 + 4 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_proxy_h1_connection_is_closed_at_the_header_timeout() {
    let w = world(
        "handshake_timeout_secs = 2\nheader_read_timeout_secs = 4\nidle_timeout_secs = 30\n",
        &[],
    );
    let mut silent = w.connect().await;
    let silent_since = Instant::now();
    let mut late = w.connect().await;
    let late_since = Instant::now();
    let silent = tokio::spawn(async move { until_closed(&mut silent, silent_since).await });
    tokio::time::sleep(Duration::from_millis(2500)).await;
    late.write_all(b"GET /fixture.bin HTTP/1.1\r\nHost: proxy.test\r\n")
        .await
        .unwrap();
    late.flush().await.unwrap();
    let (late_took, _) = until_closed(&mut late, late_since).await;
    let (silent_took, in_order) = silent.await.unwrap();
    assert!(
        (Duration::from_millis(3500)..Duration::from_secs(6)).contains(&silent_took),
        "a silent connection closed after {silent_took:?} (header timeout 4 s)"
    );
    assert!(
        !in_order,
        "a header timeout ends the connection without close_notify, as hyper's did"
    );
    assert!(
        (Duration::from_millis(3500)..Duration::from_secs(6)).contains(&late_took),
        "a head begun 2.5 s after the handshake closed after {late_took:?} (due 4 s after it)"
    );
    assert_eq!(w.counted(H1_HEADER_TIMEOUT, 2.0), 2.0, "{}", w.server.log());
    assert_eq!(w.counted(H1_CLOSED, 0.0), 0.0);
}

/// With `idle_timeout` shorter than the header timeout, a silent connection is
/// closed in order at the idle timeout, counted as `closed` (hyper's connection was
/// closed gracefully by the idle check).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_proxy_h1_connection_is_closed_in_order_at_a_shorter_idle_timeout() {
    let w = world("header_read_timeout_secs = 10\nidle_timeout_secs = 1\n", &[]);
    let mut tls = w.connect().await;
    let (took, in_order) = until_closed(&mut tls, Instant::now()).await;
    assert!(
        (Duration::from_millis(800)..Duration::from_secs(4)).contains(&took),
        "closed after {took:?} (idle timeout 1 s)"
    );
    assert!(in_order, "an idle close sends close_notify");
    assert_eq!(w.counted(H1_CLOSED, 1.0), 1.0, "{}", w.server.log());
    assert_eq!(w.counted(H1_HEADER_TIMEOUT, 0.0), 0.0);
}

/// Reads one response whose body ends with `tail` (the files here are distinct).
async fn read_response(tls: &mut TlsStream<TcpStream>, tail: &[u8]) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !got.ends_with(tail) {
        let n = tokio::time::timeout(Duration::from_secs(10), tls.read(&mut buf))
            .await
            .expect("the response")
            .unwrap();
        assert!(n > 0, "closed mid-response: {:?}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    got
}

/// Requests that come after a pause are served through the proxy byte for byte: the
/// fixture after 2.5 s of silence and again after 2.5 s of keep-alive idleness on
/// the same connection; three requests pipelined in one write after a pause are
/// answered in order on one connection, which then stays open for a fourth.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_after_a_pause_pipelined_and_kept_alive_pass_byte_exact() {
    let files: &[(&str, &[u8])] = &[
        ("one.txt", b"first body"),
        ("two.txt", b"second body"),
        ("three.txt", b"third body"),
        ("four.txt", b"fourth body"),
    ];
    let w = world("header_read_timeout_secs = 4\nidle_timeout_secs = 30\n", files);
    let (addr, tls) = (w.server.addr(), w.tls());
    let fixture_twice = tokio::spawn(async move {
        let stream = connect(addr, HOST, tls).await.unwrap();
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let mut conn = Conn::handshake(
            stream,
            Proto::H1,
            &format!("{HOST}:{}", addr.port()),
            Tuning::default(),
        )
        .await
        .unwrap();
        for round in ["after the handshake", "kept alive"] {
            let got = outcome(conn.send("GET", "/fixture.bin", &[], Bytes::new()).await.unwrap()).await;
            assert_eq!((got.status.as_u16(), got.error.clone()), (200, None), "{round}");
            assert_eq!(got.len, FIXTURE_LEN, "{round}");
            assert_eq!(hex(&got.sha256), hex(&fixture().sha256), "{round}");
            tokio::time::sleep(Duration::from_millis(2500)).await;
        }
    });
    let mut tls = w.connect().await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let get = |path: &str| format!("GET {path} HTTP/1.1\r\nHost: {HOST}\r\n\r\n");
    let pipelined = format!("{}{}{}", get("/one.txt"), get("/two.txt"), get("/three.txt"));
    tls.write_all(pipelined.as_bytes()).await.unwrap();
    tls.flush().await.unwrap();
    let answers = read_response(&mut tls, b"third body").await;
    let text = String::from_utf8_lossy(&answers);
    assert_eq!(text.matches("HTTP/1.1 200 OK").count(), 3, "{text}");
    let at = |body: &str| {
        text.find(body)
            .unwrap_or_else(|| panic!("{body} missing: {text}"))
    };
    assert!(
        at("first body") < at("second body") && at("second body") < at("third body"),
        "{text}"
    );
    assert!(!text.to_lowercase().contains("connection: close"), "{text}");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    tls.write_all(get("/four.txt").as_bytes()).await.unwrap();
    tls.flush().await.unwrap();
    let fourth = read_response(&mut tls, b"fourth body").await;
    assert!(
        fourth.starts_with(b"HTTP/1.1 200 OK"),
        "{:?}",
        String::from_utf8_lossy(&fourth)
    );
    fixture_twice.await.unwrap();
}

/// The drain closes idle proxy connections at once: one that never sent a byte and
/// one kept alive after a response both end within a second or two of SIGTERM, and
/// the daemon exits long before its 20 s grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_closes_idle_proxy_h1_connections_at_once() {
    let mut w = world(
        "header_read_timeout_secs = 30\nidle_timeout_secs = 30\nshutdown_grace_secs = 20\n",
        &[("small.txt", b"small body")],
    );
    let mut silent = w.connect().await;
    let mut kept = w.connect().await;
    kept.write_all(format!("GET /small.txt HTTP/1.1\r\nHost: {HOST}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    kept.flush().await.unwrap();
    read_response(&mut kept, b"small body").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let since = Instant::now();
    w.server.terminate();
    let (silent_took, silent_in_order) = until_closed(&mut silent, since).await;
    let (kept_took, _) = until_closed(&mut kept, since).await;
    assert!(
        silent_took < Duration::from_secs(3),
        "silent connection closed {silent_took:?} after SIGTERM"
    );
    assert!(silent_in_order, "the drain closes a silent connection in order");
    assert!(
        kept_took < Duration::from_secs(3),
        "kept-alive connection closed {kept_took:?} after SIGTERM"
    );
    let exited = w.server.wait_exit(Duration::from_secs(10));
    assert!(exited.is_some_and(|s| s.success()), "{}", w.server.log());
    assert!(
        since.elapsed() < Duration::from_secs(8),
        "exit took {:?}",
        since.elapsed()
    );
}

/// A connection the drain finds silent may be the last one accepted before it, its
/// client sending its first request right now (a binary upgrade's old process
/// sees exactly that): it gets a moment for it, as the file-serving driver gives
/// one, and the request sent 300 ms after SIGTERM is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_request_sent_just_after_the_drain_begins_is_answered() {
    let mut w = world(
        "header_read_timeout_secs = 30\nidle_timeout_secs = 30\nshutdown_grace_secs = 20\n",
        &[("small.txt", b"small body")],
    );
    let mut late = w.connect().await;
    w.server.terminate();
    tokio::time::sleep(Duration::from_millis(300)).await;
    late.write_all(format!("GET /small.txt HTTP/1.1\r\nHost: {HOST}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    late.flush().await.unwrap();
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), late.read_to_end(&mut got)).await;
    let got = String::from_utf8_lossy(&got);
    assert!(
        got.starts_with("HTTP/1.1 200") && got.ends_with("small body"),
        "the request after SIGTERM got: {got:?}; log:\n{}",
        w.server.log()
    );
    let exited = w.server.wait_exit(Duration::from_secs(10));
    assert!(exited.is_some_and(|s| s.success()), "{}", w.server.log());
}

/// Between requests a kept-alive connection waits for `idle_timeout`, not for the
/// header timeout (hyper's timer, left on, cut it at `header_read_timeout` after each
/// response, without close_notify, counted as a header timeout); a head begun after
/// the pause must still be complete within `header_read_timeout` of its first bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_alive_connection_waits_the_idle_timeout_and_a_slow_head_is_still_cut() {
    let w = world(
        "header_read_timeout_secs = 2\nidle_timeout_secs = 30\n",
        &[("small.txt", b"small body")],
    );
    let mut kept = w.connect().await;
    let get = format!("GET /small.txt HTTP/1.1\r\nHost: {HOST}\r\n\r\n");
    kept.write_all(get.as_bytes()).await.unwrap();
    kept.flush().await.unwrap();
    read_response(&mut kept, b"small body").await;
    tokio::time::sleep(Duration::from_millis(3500)).await;
    kept.write_all(get.as_bytes()).await.unwrap();
    kept.flush().await.unwrap();
    let second = tokio::time::timeout(Duration::from_secs(10), read_response(&mut kept, b"small body"))
        .await
        .expect("no answer to the request after the pause");
    assert!(second.starts_with(b"HTTP/1.1 200"), "{}", w.server.log());
    // A head begun and never finished: cut about 2 s after its first bytes.
    kept.write_all(b"GET /small.txt HTTP/1.1\r\nHost: ")
        .await
        .unwrap();
    kept.flush().await.unwrap();
    let (took, in_order) = until_closed(&mut kept, Instant::now()).await;
    assert!(
        (Duration::from_millis(1500)..Duration::from_secs(5)).contains(&took),
        "an unfinished head closed after {took:?} (header timeout 2 s)"
    );
    assert!(
        !in_order,
        "a header timeout ends the connection without close_notify"
    );
    assert_eq!(w.counted(H1_HEADER_TIMEOUT, 1.0), 1.0, "{}", w.server.log());
}

/// An upload that goes on after the answer came (nginx answers a POST to a static
/// file 405 at once): the rest of the body, trickled past the header timeout, is
/// the request's, not the start of a next head, and the connection carries the
/// next request after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_that_outlasts_its_early_answer_is_not_a_slow_head() {
    let w = world(
        "header_read_timeout_secs = 1\nidle_timeout_secs = 30\n",
        &[("small.txt", b"small body")],
    );
    let mut tls = w.connect().await;
    let piece = [b'x'; 1000];
    let head = format!("POST /small.txt HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: 8000\r\n\r\n");
    tls.write_all(head.as_bytes()).await.unwrap();
    tls.write_all(&piece).await.unwrap();
    tls.flush().await.unwrap();
    // The 405 and its end, then the rest of the body over 2.1 s.
    let answer = read_response(&mut tls, b"</html>\r\n").await;
    assert!(
        String::from_utf8_lossy(&answer).starts_with("HTTP/1.1 405"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
    for _ in 0..7 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        if tls.write_all(&piece).await.is_err() || tls.flush().await.is_err() {
            break;
        }
    }
    let get = format!("GET /small.txt HTTP/1.1\r\nHost: {HOST}\r\n\r\n");
    let _ = tls.write_all(get.as_bytes()).await;
    let _ = tls.flush().await;
    let next = tokio::time::timeout(Duration::from_secs(10), async {
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while !got.ends_with(b"small body") {
            match tls.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
        got
    })
    .await
    .unwrap_or_default();
    assert!(
        next.ends_with(b"small body"),
        "the connection did not carry the request after the upload: {:?}; log:\n{}",
        String::from_utf8_lossy(&next),
        w.server.log()
    );
    assert_eq!(w.counted(H1_HEADER_TIMEOUT, 0.0), 0.0);
}
