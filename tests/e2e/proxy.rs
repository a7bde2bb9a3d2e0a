//! The reverse proxy with TLS termination, against real origins: Debian's nginx for
//! files, and a programmable Rust origin for what nginx cannot show (trailers,
//! mid-body death, aborts, half-close, huge headers). Fronts: h1, h2 and h3.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use rustls::ClientConfig;
use sha2::{Digest, Sha256};
use webship_tests::client::{
    connect, hex, outcome, recv_body, Conn, H3Client, H3Options, Outcome, Proto, Tuning,
};
use webship_tests::nginx::Nginx;
use webship_tests::origin::{HalfCloseOrigin, Origin};
use webship_tests::server::eventually;
use webship_tests::{fixture, Server, FIXTURE_LEN};

use crate::support::{pattern, Env};

const HOST: &str = "proxy.test";

struct World {
    env: Env,
    server: Server,
    origin: Origin,
    _nginx: Nginx,
}

/// A proxy whose `/` goes to nginx (serving the fixture) and `/api/` to the Rust
/// origin with inspection rules; `extra_routes` are appended as TOML.
async fn world(extra_routes: &str) -> World {
    let env = Env::new();
    fixture().place(&env.root, "fixture.bin").unwrap();
    let nginx = Nginx::start(&env.root);
    let origin = Origin::start().await;
    let (cert, key) = env.leaf("proxy", &[HOST]);
    let config = format!(
        r#"listen = "127.0.0.1:{{port}}"
workers = 2

[reverse_proxy]
enabled = true
tls_termination = true
[reverse_proxy.tls]
cert = "{}"
key = "{}"

[[reverse_proxy.routes]]
domain = "{HOST}"
path_prefix = "/"
upstreams = ["{}"]

[[reverse_proxy.routes]]
domain = "{HOST}"
path_prefix = "/api/"
strip_prefix = true
upstreams = ["{}"]
max_body_bytes = 1000
allowed_methods = ["GET", "HEAD", "POST"]
deny_paths = ["/api/admin*"]
required_content_types = ["application/json"]
max_header_bytes = 4096
{extra_routes}
"#,
        cert.display(),
        key.display(),
        nginx.addr,
        origin.addr
    );
    let server = Server::start(env.dir.path(), &config);
    World {
        env,
        server,
        origin,
        _nginx: nginx,
    }
}

async fn exchange(
    proto: Proto,
    addr: SocketAddr,
    config: Arc<ClientConfig>,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Outcome {
    let tls = connect(addr, HOST, config).await.unwrap();
    // Room for the huge-header test: the limit is the client's to set.
    let tuning = Tuning {
        h2_max_header_list: Some(1 << 20),
        ..Tuning::default()
    };
    let mut conn = Conn::handshake(tls, proto, &format!("{HOST}:{}", addr.port()), tuning)
        .await
        .unwrap();
    let response = conn
        .send(method, path, headers, Bytes::copy_from_slice(body))
        .await
        .unwrap();
    outcome(response).await
}

impl World {
    async fn get(&self, proto: Proto, path: &str, headers: &[(&str, &str)]) -> Outcome {
        exchange(
            proto,
            self.server.addr(),
            self.env.client(proto.alpn()),
            "GET",
            path,
            headers,
            b"",
        )
        .await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixture_through_the_proxy_over_h1_h2_and_h3() {
    let w = world("").await;
    for proto in [Proto::H1, Proto::H2] {
        let got = w.get(proto, "/fixture.bin", &[]).await;
        assert_eq!(got.status, 200, "{proto:?}");
        assert_eq!(got.error, None, "{proto:?}");
        assert_eq!(got.len, FIXTURE_LEN, "{proto:?}");
        assert_eq!(hex(&got.sha256), hex(&fixture().sha256), "{proto:?}");
        assert!(
            got.headers["via"].to_str().unwrap().ends_with("webship"),
            "{proto:?}"
        );
    }
    let mut h3 = H3Client::connect(w.server.addr(), HOST, &w.env.client(b"h3"), &H3Options::default())
        .await
        .unwrap();
    let got = h3.fetch("GET", "/fixture.bin", &[]).await;
    assert_eq!(got.status, 200);
    assert_eq!(got.len, FIXTURE_LEN);
    assert_eq!(hex(&got.sha256), hex(&fixture().sha256));
    // Range passes through to the origin.
    let got = h3
        .fetch("GET", "/fixture.bin", &[("range", "bytes=1000-1999")])
        .await;
    assert_eq!(got.status, 206);
    assert_eq!(got.len, 1000);
    h3.close().await;
    let got = w.get(Proto::H2, "/fixture.bin", &[("range", "bytes=-100")]).await;
    assert_eq!(got.status, 206);
    let tail = std::fs::read(&fixture().path).unwrap();
    assert_eq!(got.body, &tail[tail.len() - 100..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarding_headers_as_the_origin_saw_them() {
    let w = world("").await;
    for (proto, via) in [(Proto::H1, "1.1 webship"), (Proto::H2, "2 webship")] {
        let got = w
            .get(
                proto,
                "/api/echo?q=1",
                &[("x-forwarded-for", "203.0.113.9"), ("x-keep", "yes")],
            )
            .await;
        assert_eq!(
            got.status,
            200,
            "{proto:?} {:?}",
            String::from_utf8_lossy(&got.body)
        );
        let seen = w.origin.seen().pop().unwrap();
        assert_eq!(seen.path, "/echo?q=1", "strip_prefix removes /api");
        // The client is not a trusted proxy: its own claim is replaced.
        assert_eq!(seen.header("x-forwarded-for"), Some("127.0.0.1"), "{proto:?}");
        assert_eq!(seen.header("x-forwarded-proto"), Some("https"));
        let authority = format!("{HOST}:{}", w.server.port);
        assert_eq!(seen.header("x-forwarded-host"), Some(authority.as_str()));
        assert_eq!(
            seen.header("forwarded"),
            Some(format!("for=127.0.0.1;proto=https;host=\"{authority}\"").as_str())
        );
        assert_eq!(seen.header("via"), Some(via), "{proto:?}");
        assert_eq!(seen.header("host"), Some(authority.as_str()), "Host is preserved");
        assert_eq!(seen.header("x-keep"), Some("yes"));
    }
    // Hop-by-hop fields, and those named in Connection, stay behind (h1 only).
    let got = w
        .get(
            Proto::H1,
            "/api/echo",
            &[
                ("connection", "x-drop"),
                ("x-drop", "1"),
                ("keep-alive", "timeout=5"),
            ],
        )
        .await;
    assert_eq!(got.status, 200);
    let seen = w.origin.seen().pop().unwrap();
    assert_eq!(seen.header("x-drop"), None);
    assert_eq!(seen.header("keep-alive"), None);
    // nginx, a different origin, saw the same fields.
    let got = w.get(Proto::H1, "/fixture.bin", &[("range", "bytes=0-0")]).await;
    assert_eq!(got.status, 206);
    let log = w._nginx.access_log();
    assert!(log.contains("\"https\"") && log.contains("1.1 webship"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspection_refuses_before_the_origin_sees_anything() {
    let w = world("").await;
    let json = [("content-type", "application/json")];
    let before = w.origin.seen().len();
    for proto in [Proto::H1, Proto::H2] {
        let client = w.env.client(proto.alpn());
        let addr = w.server.addr();
        let big = vec![b'x'; 2000];
        let got = exchange(proto, addr, client.clone(), "POST", "/api/echo", &json, &big).await;
        assert_eq!(got.status, 413, "{proto:?}");
        assert!(String::from_utf8_lossy(&got.body).contains("max_body_bytes"));
        let got = exchange(
            proto,
            addr,
            client.clone(),
            "POST",
            "/api/echo",
            &[("content-type", "text/plain")],
            b"hi",
        )
        .await;
        assert_eq!(got.status, 415, "{proto:?}");
        let got = exchange(proto, addr, client.clone(), "DELETE", "/api/echo", &[], b"").await;
        assert_eq!(got.status, 405, "{proto:?}");
        assert_eq!(got.headers["allow"], "GET, HEAD, POST");
        let got = exchange(proto, addr, client.clone(), "GET", "/api/admin/users", &[], b"").await;
        assert_eq!(got.status, 403, "{proto:?}");
        let big = "b".repeat(5000);
        let got = exchange(
            proto,
            addr,
            client.clone(),
            "GET",
            "/api/echo",
            &[("x-big", &big)],
            b"",
        )
        .await;
        assert_eq!(got.status, 431, "{proto:?}");
    }
    assert_eq!(
        w.origin.seen().len(),
        before,
        "a refused request reached the origin"
    );
    assert!(w.server.log().contains("request refused"));
    // An accepted body streams to the origin exactly.
    let body = pattern(900);
    for proto in [Proto::H1, Proto::H2] {
        let got = exchange(
            proto,
            w.server.addr(),
            w.env.client(proto.alpn()),
            "POST",
            "/api/echo",
            &json,
            &body,
        )
        .await;
        assert_eq!(got.status, 200, "{proto:?}");
        let seen = w.origin.seen().pop().unwrap();
        assert_eq!((seen.method.as_str(), seen.body_len), ("POST", 900));
        assert_eq!(seen.body_sha256, hex(&Sha256::digest(&body)));
        assert!(seen.body_complete);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trailers_pass_and_origin_death_is_an_error_not_a_short_success() {
    let w = world("").await;
    for proto in [Proto::H1, Proto::H2] {
        let got = w.get(proto, "/api/trailers", &[("te", "trailers")]).await;
        assert_eq!(got.status, 200, "{proto:?}");
        assert_eq!(got.body, b"hello");
        let trailers = got
            .trailers
            .as_ref()
            .unwrap_or_else(|| panic!("{proto:?}: no trailers"));
        assert_eq!(trailers["x-checksum"], "12345", "{proto:?}");

        for path in ["/api/die/100000", "/api/die-chunked/100000"] {
            let got = w.get(proto, path, &[]).await;
            assert!(
                got.error.is_some() || got.status.is_server_error(),
                "{proto:?} {path}: a dying origin became {} with {} bytes and no error",
                got.status,
                got.len
            );
        }
    }
    let mut h3 = H3Client::connect(w.server.addr(), HOST, &w.env.client(b"h3"), &H3Options::default())
        .await
        .unwrap();
    let got = h3.fetch("GET", "/api/echo", &[]).await;
    assert_eq!(got.status, 200);
    assert_eq!(w.origin.seen().pop().unwrap().header("via"), Some("3 webship"));
    h3.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_aborts_the_upstream_request() {
    let w = world("").await;
    let tls = connect(w.server.addr(), HOST, w.env.client(b"h2")).await.unwrap();
    let authority = format!("{HOST}:{}", w.server.port);
    let mut conn = Conn::handshake(tls, Proto::H2, &authority, Tuning::default())
        .await
        .unwrap();
    let resp = conn
        .send("GET", "/api/wait-abort", &[], Bytes::new())
        .await
        .unwrap();
    let mut body = resp.into_body();
    let _ = body.frame().await;
    drop(body);
    drop(conn);
    assert!(
        eventually(Duration::from_secs(5), || w.origin.aborted_responses() >= 1),
        "the origin never saw the request aborted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_ejection_and_502() {
    // Held for the whole test: a free port could be taken by a parallel test's server.
    let (_dead_socket, dead) = webship_tests::server::refused_port().unwrap();
    let origin = Origin::start().await;
    let w = world(&format!(
        "\n[[reverse_proxy.routes]]\ndomain = \"{HOST}\"\npath_prefix = \"/failover/\"\nstrip_prefix = true\nupstreams = [\"127.0.0.1:{dead}\", \"{}\"]\n\n[[reverse_proxy.routes]]\ndomain = \"{HOST}\"\npath_prefix = \"/down/\"\nupstreams = [\"127.0.0.1:{dead}\"]\n",
        origin.addr
    ))
    .await;
    for _ in 0..4 {
        let got = w.get(Proto::H2, "/failover/echo", &[]).await;
        assert_eq!(got.status, 200, "the live upstream answers");
    }
    assert_eq!(origin.seen().len(), 4);
    assert_eq!(
        origin.connections(),
        1,
        "the four requests shared one pooled connection"
    );
    assert!(w.server.log().contains("ejected"), "{}", w.server.log());
    let got = w.get(Proto::H1, "/down/x", &[]).await;
    assert_eq!(got.status, 502);
    let text = String::from_utf8_lossy(&got.body);
    // The body names no upstream (the log does).
    assert!(
        text.contains("no upstream answered") && !text.contains(&dead.to_string()),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_closed_origin_and_huge_headers() {
    let body = pattern(300_000);
    let half = HalfCloseOrigin::start(body.clone()).await;
    let w = world(&format!(
        "\n[[reverse_proxy.routes]]\ndomain = \"{HOST}\"\npath_prefix = \"/half/\"\nupstreams = [\"{}\"]\n",
        half.addr
    ))
    .await;
    for proto in [Proto::H1, Proto::H2] {
        let got = w.get(proto, "/half/x", &[]).await;
        assert_eq!(got.status, 200, "{proto:?}");
        assert_eq!(got.error, None, "{proto:?}");
        assert_eq!(
            got.len,
            body.len() as u64,
            "{proto:?}: a close-delimited body arrives whole"
        );
        let got = w.get(proto, "/api/huge-headers/60000", &[]).await;
        assert_eq!(got.status, 200, "{proto:?}");
        assert_eq!(got.headers["x-huge"].len(), 60000);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_client_fast_origin_keeps_memory_bounded() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let w = world("").await;
    let warm = w
        .get(Proto::H1, "/fixture.bin", &[("range", "bytes=0-4194303")])
        .await;
    assert_eq!(warm.len, 4 << 20);
    let base = w.server.rss();
    let mut tls = connect(w.server.addr(), HOST, w.env.client(b"http/1.1"))
        .await
        .unwrap();
    tls.write_all(format!("GET /fixture.bin HTTP/1.1\r\nHost: {HOST}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut buf = vec![0u8; 64 * 1024];
    let mut peak = 0;
    let start = std::time::Instant::now();
    while start.elapsed() < Duration::from_secs(3) {
        let n = tls.read(&mut buf).await.unwrap();
        assert!(n > 0);
        peak = peak.max(w.server.rss());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        peak < base + (24 << 20),
        "peak RSS {} MiB vs baseline {} MiB",
        peak >> 20,
        base >> 20
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_to_the_origin_over_h2c_and_over_tls() {
    // h2c to the Rust origin; HTTP/2 over TLS to a second webship serving files.
    let origin = Origin::start().await;
    let files = Env::new();
    files.write("hello.txt", b"over tls");
    let direct = Server::start(
        files.dir.path(),
        &format!(
            "listen = \"127.0.0.1:{{port}}\"\nroot = \"{}\"\n[tls]\ncert = \"{}\"\nkey = \"{}\"\n[protocols]\nh3 = false\n",
            files.root.display(),
            files.cert.display(),
            files.key.display()
        ),
    );
    let ca = files.ca_file();
    let w = world(&format!(
        "\n[[reverse_proxy.routes]]\ndomain = \"{HOST}\"\npath_prefix = \"/h2c/\"\nstrip_prefix = true\nupstream_protocol = \"h2c\"\nupstreams = [\"{}\"]\n\n[[reverse_proxy.routes]]\ndomain = \"{HOST}\"\npath_prefix = \"/tls/\"\nstrip_prefix = true\nupstream_protocol = \"h2\"\nupstream_ca = \"{}\"\nupstream_tls_name = \"files.test\"\nupstreams = [\"{}\"]\n",
        origin.addr,
        ca.display(),
        direct.addr()
    ))
    .await;
    let got = w.get(Proto::H1, "/h2c/echo", &[]).await;
    assert_eq!(got.status, 200);
    let seen = origin.seen().pop().unwrap();
    assert!(seen.version.contains('2'), "the origin saw {}", seen.version);
    for proto in [Proto::H1, Proto::H2] {
        let got = w.get(proto, "/tls/hello.txt", &[]).await;
        assert_eq!(
            got.status,
            200,
            "{proto:?}: {}\n{}",
            String::from_utf8_lossy(&got.body),
            w.server.log()
        );
        assert_eq!(got.body, b"over tls");
        assert!(got.headers["via"].to_str().unwrap().starts_with("2 webship"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h3_front_relays_trailers() {
    let w = world("").await;
    let mut h3 = H3Client::connect(w.server.addr(), HOST, &w.env.client(b"h3"), &H3Options::default())
        .await
        .unwrap();
    let (head, mut stream) = h3
        .send("GET", "/api/trailers", &[("te", "trailers")])
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", w.server.log()));
    assert_eq!(head.status, 200);
    let mut body = Vec::new();
    recv_body(&mut stream, &mut body).await.unwrap();
    assert_eq!(body, b"hello");
    let trailers = stream.recv_trailers().await.unwrap().expect("trailers over h3");
    assert_eq!(trailers["x-checksum"], "12345");
    drop(stream);
    h3.close().await;
}

#[test]
fn h2_front_bounds_proxy_streams_by_the_connection_budget() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let w = rt.block_on(world(
        "\n[runtime.settings]\nproxy_h2_tls_max_send_buffer_bytes = \"131072\"\nproxy_h2_tls_connection_send_buffer_bytes = \"1048576\"\n",
    ));
    let out = std::process::Command::new("nghttp")
        .args(["-nv", "--no-verify-peer"])
        .arg(format!("https://127.0.0.1:{}/api/echo", w.server.port))
        .args(["-H", &format!(":authority: {HOST}")])
        .output()
        .expect("nghttp (nghttp2-client) is required");
    let text = String::from_utf8_lossy(&out.stdout);
    let settings = text
        .split("recv SETTINGS frame")
        .nth(1)
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        settings.contains("SETTINGS_MAX_CONCURRENT_STREAMS(0x03):8"),
        "1 MiB / 128 KiB = 8 streams:\n{settings}"
    );
    drop(w);
}

/// An h2c origin that writes many small DATA frames at once: the proxy hands those
/// its upstream connection already holds to the client in one go, so an h2 client
/// sees full frames, not one per upstream piece (`exchange/coalesce.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_upstream_frames_reach_an_h2_client_coalesced() {
    use webship_testkit::h2raw::{block, flag, frame, headers, kind, H2Raw};
    const LEN: usize = 256 * 1024;
    const PIECE: usize = 256;
    let h2c = Origin::start().await;
    let w = world(&format!(
        "\n[[reverse_proxy.routes]]\ndomain = \"{HOST}\"\npath_prefix = \"/h2c/\"\nstrip_prefix = true\nupstream_protocol = \"h2c\"\nupstreams = [\"{}\"]\n",
        h2c.addr
    ))
    .await;
    let mut conn = H2Raw::connect(w.server.addr(), HOST, &w.env.client(b"h2"))
        .await
        .unwrap();
    // The stream's window opens only once the origin has had time to write: its
    // frames are then waiting in the proxy's upstream connection, as on a real
    // network where the upstream is faster than the client (without this the proxy
    // may keep up with the origin on loopback and see each piece alone). The
    // connection's window is larger than the body.
    const SETTINGS_INITIAL_WINDOW_SIZE: u16 = 0x4;
    conn.handshake(&[(SETTINGS_INITIAL_WINDOW_SIZE, 0)], Duration::from_secs(5))
        .await
        .unwrap();
    let grow = (1u32 << 20).to_be_bytes();
    conn.send(&frame(kind::WINDOW_UPDATE, 0, 0, &grow)).await.unwrap();
    let path = format!("/h2c/chunks/{LEN}/{PIECE}");
    let request = block(&[
        (":method", "GET"),
        (":scheme", "https"),
        (":authority", HOST),
        (":path", &path),
    ]);
    conn.send(&headers(1, &request, true)).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match conn.read_frame(deadline).await {
            Ok(Some(f)) if f.stream == 1 && f.kind == kind::HEADERS => break,
            Ok(Some(_)) => {}
            other => panic!("no response head: {other:?}\n{}", w.server.log()),
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    conn.send(&frame(kind::WINDOW_UPDATE, 0, 1, &grow)).await.unwrap();
    assert!(
        conn.until_stream_end(1, Duration::from_secs(20)).await,
        "the response did not end; frames: {:?}\n{}",
        conn.seen
            .iter()
            .map(|f| (f.kind, f.flags, f.payload.len()))
            .collect::<Vec<_>>(),
        w.server.log()
    );
    assert_eq!(conn.status(1), Some(200));
    let data: Vec<&[u8]> = conn
        .seen
        .iter()
        .filter(|f| f.stream == 1 && f.kind == kind::DATA)
        .map(|f| f.payload.as_slice())
        .collect();
    assert!(conn
        .seen
        .iter()
        .all(|f| f.kind != kind::DATA || f.flags & flag::PADDED == 0));
    assert_eq!(data.concat(), pattern(LEN), "the relayed body differs");
    // Relayed piece by piece it takes LEN / PIECE = 1024 frames; coalesced, 17 here:
    // the piece hyper took before the window opened, then full 16 KiB frames.
    let sizes: Vec<usize> = data.iter().map(|d| d.len()).collect();
    assert!(
        data.len() <= LEN / PIECE / 16,
        "{} DATA frames for {LEN} bytes written as {PIECE}-byte frames: {sizes:?}",
        data.len()
    );
    drop(h2c);
}
