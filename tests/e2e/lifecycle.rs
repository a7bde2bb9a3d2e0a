//! Connection lifecycle: cancellation frees the connection and its memory, slow
//! readers stay bounded, pipelining and keep-alive, header limits and timeouts, the
//! connection cap, graceful shutdown, and the no-config default.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use webship_tests::client::{connect, fetch, hex, raw_h1, raw_status, Conn, Proto, Tuning};
use webship_tests::pki::insecure_client;
use webship_tests::server::{eventually, listening};
use webship_tests::{fixture, Server, FIXTURE_LEN};

use crate::support::{assert_rss_within, Env, HOST, MIB};

fn fixture_server(extra: &str) -> (Env, Server) {
    let env = Env::new();
    fixture().place(&env.root, "fixture.bin").unwrap();
    env.write("small.txt", b"small");
    let server = env.start(extra);
    (env, server)
}

fn get_request(path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: {HOST}\r\n\r\n")
}

/// An HTTP/1.1 connection that has sent `GET path`, its response not read yet.
async fn h1_get(env: &Env, server: &Server, path: &str) -> TlsStream<TcpStream> {
    let mut tls = connect(server.addr(), HOST, env.client(b"http/1.1"))
        .await
        .unwrap();
    tls.write_all(get_request(path).as_bytes()).await.unwrap();
    tls
}

/// Warm the server up (TLS, both drivers, the blocking pool) so RSS has a baseline.
async fn baseline(env: &Env, server: &Server) -> u64 {
    for proto in [Proto::H1, Proto::H2] {
        let got = env
            .get(proto, server, "/fixture.bin", &[("range", "bytes=0-4194303")])
            .await;
        assert_eq!(got.len, 4 * MIB);
    }
    server.rss()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h1_disconnect_mid_body_frees_the_connection() {
    let (env, server) = fixture_server("");
    let base = baseline(&env, &server).await;
    for _ in 0..3 {
        let mut tls = h1_get(&env, &server, "/fixture.bin").await;
        let mut buf = vec![0u8; 256 * 1024];
        let mut got = 0u64;
        while got < 10 * MIB {
            let n = tls.read(&mut buf).await.unwrap();
            assert!(n > 0, "server closed early");
            got += n as u64;
        }
        assert!(server.established() >= 1);
        drop(tls);
    }
    assert!(
        eventually(Duration::from_secs(10), || server.established() == 0),
        "the server kept {} connections after the clients left",
        server.established()
    );
    assert_rss_within(&server, base, 16);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_reset_stream_and_disconnect_free_resources() {
    let (env, server) = fixture_server("");
    let base = baseline(&env, &server).await;
    let tls = connect(server.addr(), HOST, env.client(b"h2")).await.unwrap();
    let authority = format!("{HOST}:{}", server.port);
    let mut conn = Conn::handshake(tls, Proto::H2, &authority, Tuning::default())
        .await
        .unwrap();
    for _ in 0..3 {
        let resp = conn.send("GET", "/fixture.bin", &[], Bytes::new()).await.unwrap();
        let mut body = resp.into_body();
        let mut got = 0u64;
        while got < 10 * MIB {
            let frame = body.frame().await.unwrap().unwrap();
            got += frame.data_ref().map_or(0, |d| d.len() as u64);
        }
        drop(body); // RST_STREAM(CANCEL)
    }
    // The connection survives the resets and still serves.
    let mut small = Vec::new();
    conn.fetch_into("GET", "/small.txt", &[], &mut small)
        .await
        .unwrap();
    assert_eq!(small, b"small");
    conn.close().await;
    assert!(
        eventually(Duration::from_secs(10), || server.established() == 0),
        "h2 connection not released"
    );
    assert_rss_within(&server, base, 16);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_reader_keeps_memory_bounded() {
    let (env, server) = fixture_server("");
    let base = baseline(&env, &server).await;
    let mut tls = h1_get(&env, &server, "/fixture.bin").await;
    let mut buf = vec![0u8; 64 * 1024];
    let mut peak = 0;
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(3) {
        let n = tls.read(&mut buf).await.unwrap();
        assert!(n > 0);
        peak = peak.max(server.rss());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // 100 MB queued in the server would show; one connection's buffers would not.
    assert!(
        peak < base + 24 * MIB,
        "peak RSS {} MiB vs baseline {} MiB",
        peak / MIB,
        base / MIB
    );
}

#[tokio::test]
async fn pipelined_requests_are_answered_in_order() {
    let (env, server) = fixture_server("");
    env.write("one.txt", b"first");
    env.write("two.txt", b"second");
    let request = format!(
        "{}GET /two.txt HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n",
        get_request("/one.txt")
    );
    let response = raw_h1(server.addr(), HOST, env.client(b"http/1.1"), request.as_bytes()).await;
    let text = String::from_utf8_lossy(&response);
    let first = text.find("\r\n\r\nfirst").expect("first response");
    let second = text.find("\r\n\r\nsecond").expect("second response");
    assert!(first < second, "{text}");
    assert_eq!(text.matches("HTTP/1.1 200 OK").count(), 2);
}

#[test]
fn curl_reuses_one_connection() {
    let (env, server) = fixture_server("");
    let ca = env.ca_file();
    let url = format!("https://{HOST}:{}/small.txt", server.port);
    let out = webship_tests::client::curl(
        HOST,
        server.port,
        &[
            "--cacert",
            ca.to_str().unwrap(),
            "--http1.1",
            "-w",
            " %{num_connects}",
            &url,
            &url,
        ],
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "small 1small 0");
}

#[tokio::test]
async fn oversized_and_slow_headers() {
    let (env, server) = fixture_server("[limits]\nheader_read_timeout_secs = 1\nmax_header_bytes = 4096\n");
    let big = format!(
        "GET / HTTP/1.1\r\nHost: {HOST}\r\nX-Big: {}\r\n\r\n",
        "a".repeat(8000)
    );
    let response = raw_h1(server.addr(), HOST, env.client(b"http/1.1"), big.as_bytes()).await;
    assert_eq!(raw_status(&response), 431);

    let start = Instant::now();
    let partial = format!("GET /small.txt HTTP/1.1\r\nHost: {HOST}\r\n");
    let response = raw_h1(server.addr(), HOST, env.client(b"http/1.1"), partial.as_bytes()).await;
    assert_eq!(raw_status(&response), 408);
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "took {:?}",
        start.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_cap_holds_new_connections_until_one_closes() {
    let (env, server) = fixture_server("[limits]\nmax_connections = 2\n");
    let first = connect(server.addr(), HOST, env.client(b"http/1.1"))
        .await
        .unwrap();
    let _second = connect(server.addr(), HOST, env.client(b"http/1.1"))
        .await
        .unwrap();
    let third = tokio::spawn({
        let client = env.client(b"http/1.1");
        let addr = server.addr();
        async move { connect(addr, HOST, client).await }
    });
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        !third.is_finished(),
        "a third connection was served beyond max_connections = 2"
    );
    drop(first);
    let third = tokio::time::timeout(Duration::from_secs(5), third).await;
    assert!(
        matches!(third, Ok(Ok(Ok(_)))),
        "the third connection was not served after one closed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_responses_then_exits_zero() {
    let (env, mut server) = fixture_server("");
    let mut tls = h1_get(&env, &server, "/fixture.bin").await;
    let mut buf = vec![0u8; 256 * 1024];
    let n = tls.read(&mut buf).await.unwrap();
    let mut received: Vec<u8> = buf[..n].to_vec();
    server.terminate();
    assert!(
        eventually(Duration::from_secs(5), || !listening(server.port)),
        "still accepting after SIGTERM"
    );
    // The in-flight download completes byte-exact.
    tokio::time::timeout(Duration::from_secs(60), tls.read_to_end(&mut received))
        .await
        .expect("download did not finish during drain")
        .ok();
    let head_end = received.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
    let body = &received[head_end..];
    assert_eq!(body.len() as u64, FIXTURE_LEN);
    use sha2::Digest;
    assert_eq!(hex(&sha2::Sha256::digest(body)), hex(&fixture().sha256));
    let status = server
        .wait_exit(Duration::from_secs(10))
        .expect("no exit after drain");
    assert!(status.success(), "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_grace_has_a_deadline() {
    let (env, mut server) = fixture_server("[limits]\nshutdown_grace_secs = 1\n");
    let mut tls = h1_get(&env, &server, "/fixture.bin").await;
    let mut buf = [0u8; 1024];
    let _ = tls.read(&mut buf).await.unwrap();
    // Never read again: the response stalls on a full socket buffer.
    let start = Instant::now();
    server.terminate();
    let status = server
        .wait_exit(Duration::from_secs(10))
        .expect("no exit after the grace period");
    assert!(status.success(), "{status:?}");
    assert!(
        start.elapsed() < Duration::from_secs(6),
        "took {:?}",
        start.elapsed()
    );
    // The one stalled download is what the drain says it gave up on (the HTTP/3
    // endpoint's own wait for its connections must not be counted as open ones).
    let log = server.log();
    let over = log
        .lines()
        .find(|l| l.contains("grace period over"))
        .unwrap_or_else(|| panic!("{log}"));
    assert!(over.contains("open=1"), "{over}");
    let drain = log
        .lines()
        .find(|l| l.contains("draining connections"))
        .unwrap_or_else(|| panic!("{log}"));
    assert!(drain.contains("open=1"), "{drain}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_config_serves_the_current_directory_on_8443() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("hello.txt"), b"hello from cwd").unwrap();
    let mut server = Server::spawn(dir.path(), &["serve"], 8443);
    server.wait_listening();
    let addr = server.addr();
    for proto in [Proto::H1, Proto::H2] {
        let got = fetch(
            proto,
            addr,
            "localhost",
            insecure_client(&[proto.alpn()]).unwrap(),
            "GET",
            "/hello.txt",
            &[],
        )
        .await;
        assert_eq!(got.status, 200, "{proto:?}");
        assert_eq!(got.body, b"hello from cwd");
    }
    let stdout = std::fs::read_to_string(dir.path().join("stdout.log")).unwrap();
    assert!(stdout.contains("https://127.0.0.1:8443/"), "{stdout}");
}

/// Off unless `[log] access` says so; on, it goes to standard error in the
/// `combined` format by default.
#[tokio::test]
async fn access_log_is_off_by_default_and_on_by_switch() {
    for (extra, expect) in [("[log]\n", false), ("[log]\naccess = true\n", true)] {
        let env = Env::new();
        env.write("small.txt", b"small");
        let server = env.start(extra);
        for proto in [Proto::H1, Proto::H2] {
            let got = env.get(proto, &server, "/small.txt", &[]).await;
            assert_eq!(got.status, 200);
        }
        let ok = eventually(Duration::from_secs(2), || {
            let log = server.log();
            log.contains("\"GET /small.txt HTTP/1.1\" 200 5 \"-\"")
                && log.contains("\"GET /small.txt HTTP/2.0\" 200 5 \"-\"")
        });
        assert_eq!(ok, expect, "access log with {extra:?}:\n{}", server.log());
    }
}

/// The JSON access log lines (the harness's) whose path is `path`.
fn access_lines(server: &Server, path: &str) -> Vec<serde_json::Value> {
    let file = server.access_log_path().expect("the harness's access log");
    webship_tests::server::check_access_log(file)
        .unwrap()
        .into_iter()
        .filter(|l| l["path"] == path)
        .collect()
}

/// Every exchange is reported once, when its response ends, with what was actually
/// handed to the connection: whole responses over h1, h2 and h3 as complete with
/// their length, a refusal with its status, and a download the client abandons as
/// not complete with fewer bytes than the file has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_exchange_is_recorded_once_with_what_was_sent() {
    let (env, server) = fixture_server("");
    for proto in [Proto::H1, Proto::H2] {
        let got = env.get(proto, &server, "/small.txt", &[]).await;
        assert_eq!(got.status, 200);
    }
    let (h3, line) =
        crate::support::aioquic_fetch(server.addr().port(), HOST, "/small.txt", &env.ca_file(), &[]);
    assert_eq!(h3["status"], 200, "{line}");
    let got = env.get(Proto::H1, &server, "/missing.txt", &[]).await;
    assert_eq!(got.status, 404);
    // Abandoned after the first 64 KiB of the fixture.
    let mut tls = h1_get(&env, &server, "/fixture.bin").await;
    let mut buf = vec![0u8; 64 * 1024];
    tls.read_exact(&mut buf).await.unwrap();
    drop(tls);

    let settled = eventually(Duration::from_secs(10), || {
        access_lines(&server, "/fixture.bin").len() == 1 && access_lines(&server, "/small.txt").len() == 3
    });
    assert!(settled, "one line per exchange:\n{}", server.log());
    let small = access_lines(&server, "/small.txt");
    let mut protos: Vec<&str> = small.iter().map(|l| l["protocol"].as_str().unwrap()).collect();
    protos.sort_unstable();
    assert_eq!(protos, ["h1", "h2", "h3"], "{small:?}");
    for line in &small {
        assert_eq!(line["status"], 200, "{line}");
        assert_eq!(line["bytes"], 5, "{line}");
        assert_eq!(line["outcome"], "complete", "{line}");
        assert_eq!(line["mode"], "files", "{line}");
        assert_eq!(line["site"], HOST, "{line}");
        assert_eq!(line["tls_version"], "TLSv1_3", "{line}");
    }
    let missing = &access_lines(&server, "/missing.txt")[0];
    assert_eq!(
        (missing["status"].as_u64(), missing["outcome"].as_str()),
        (Some(404), Some("complete"))
    );
    let abandoned = &access_lines(&server, "/fixture.bin")[0];
    assert_ne!(abandoned["outcome"], "complete", "{abandoned}");
    let bytes = abandoned["bytes"].as_u64().unwrap();
    assert!((64 * 1024..FIXTURE_LEN).contains(&bytes), "{abandoned}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_closed_after_the_idle_timeout() {
    let env = Env::new();
    env.write("small.txt", b"small");
    let server = env.start("[limits]\nidle_timeout_secs = 1\n");
    // HTTP/1.1: one request, then silence.
    let mut tls = h1_get(&env, &server, "/small.txt").await;
    let start = Instant::now();
    let mut all = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), tls.read_to_end(&mut all))
        .await
        .expect("an idle keep-alive connection was never closed")
        .ok();
    assert!(String::from_utf8_lossy(&all).ends_with("small"));
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "closed after {:?}",
        start.elapsed()
    );
    // HTTP/2: the connection ends by itself too (GOAWAY, then close).
    let tls = connect(server.addr(), HOST, env.client(b"h2")).await.unwrap();
    let (_send, conn) =
        hyper::client::conn::http2::handshake::<_, _, Empty<Bytes>>(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(10), conn).await;
    assert!(ended.is_ok(), "an idle h2 connection was never closed");
    assert!(eventually(Duration::from_secs(5), || server.established() == 0));
}

/// A connection accepted just before the drain began (its handshake done, its first
/// request not sent yet) still gets that request answered, with `connection:
/// close`, instead of being closed unanswered: in a binary upgrade it is the
/// connection the old process accepted in its last moment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_accepted_before_the_drain_gets_its_first_request_answered() {
    let (env, mut server) = fixture_server("[limits]\nshutdown_grace_secs = 10\n");
    let mut tls = connect(server.addr(), HOST, env.client(b"http/1.1"))
        .await
        .unwrap();
    // A download in flight keeps the drain going meanwhile.
    let mut busy = h1_get(&env, &server, "/fixture.bin").await;
    let mut buf = [0u8; 1024];
    let _ = busy.read(&mut buf).await.unwrap();
    server.terminate();
    tokio::time::sleep(Duration::from_millis(300)).await;
    tls.write_all(get_request("/small.txt").as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), tls.read_to_end(&mut answer))
        .await
        .expect("the answer")
        .ok();
    let text = String::from_utf8_lossy(&answer).to_lowercase();
    assert!(text.starts_with("http/1.1 200"), "{text:?}\n{}", server.log());
    assert!(
        text.contains("connection: close") && text.ends_with("small"),
        "{text:?}"
    );
    drop(busy);
    assert!(server
        .wait_exit(Duration::from_secs(20))
        .is_some_and(|s| s.success()));
}
