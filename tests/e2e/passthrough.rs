//! TLS passthrough against real TLS origins (Debian nginx with its own certificates):
//! the client completes TLS with the origin, never with webship; routing is by SNI,
//! also for a ClientHello that arrives one byte per segment; misses and garbage are
//! closed; direct sites can share the listener.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use webship_testkit::proc::{established, End};
use webship_tests::client::{connect, fetch, fetch_h3, hex, raw_status, Proto};
use webship_tests::fixture::sha256_file;
use webship_tests::nginx::Nginx;
use webship_tests::server::eventually;
use webship_tests::{fixture, Server, FIXTURE_LEN};

use crate::support::{
    aioquic_fetch, curl_download, h3_passthrough_front, origin_server, passthrough_config, passthrough_toml,
    stats_json, Env, HOST,
};

struct World {
    env: Env,
    server: Server,
    _a: Nginx,
    _b: Nginx,
}

/// Origins `a.pass` (serving the fixture) and `b.pass` (serving "b"), each with its
/// own certificate; webship in front, optionally with a direct site too, with the
/// default engine.
fn world(with_site: bool) -> World {
    world_with(with_site, "auto")
}

/// As [`world`], with the given passthrough engine. The counter maps are pinned
/// in a folder of this server's own, so tests can run side by side.
fn world_with(with_site: bool, engine: &str) -> World {
    let env = Env::new();
    fixture().place(&env.root, "fixture.bin").unwrap();
    let a_root = env.dir.path().join("a");
    let b_root = env.dir.path().join("b");
    std::fs::create_dir(&a_root).unwrap();
    std::fs::create_dir(&b_root).unwrap();
    fixture().place(&a_root, "fixture.bin").unwrap();
    std::fs::write(a_root.join("who.txt"), "origin a").unwrap();
    std::fs::write(b_root.join("who.txt"), "origin b").unwrap();
    let (a_cert, a_key) = env.leaf("a", &["a.pass"]);
    let (b_cert, b_key) = env.leaf("b", &["b.pass", "*.b.pass"]);
    let a = Nginx::start_tls(&a_root, &a_cert, &a_key);
    let b = Nginx::start_tls(&b_root, &b_cert, &b_key);
    let engine = format!("passthrough_engine = \"{engine}\"\n");
    let routes = [("a.pass", a.addr), ("*.b.pass", b.addr), ("b.pass", b.addr)];
    let config = if with_site {
        let passthrough = passthrough_toml(&engine, false, &routes);
        env.config(&passthrough.replace("[kernel]", "[protocols]\nh3 = false\n\n[kernel]"))
    } else {
        passthrough_config(&engine, false, &routes)
    };
    let server = Server::start(env.dir.path(), &config);
    World {
        env,
        server,
        _a: a,
        _b: b,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sockmap_engine_moves_exact_bytes() {
    exact_bytes_with("sockmap").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn splice_engine_moves_exact_bytes() {
    exact_bytes_with("splice").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copy_engine_moves_exact_bytes() {
    exact_bytes_with("copy").await;
}

/// The fixture over h1 and h2 through `engine`, exact and from the origin; then the
/// counters in `webship stats --json` account for it.
async fn exact_bytes_with(engine: &str) {
    let w = world_with(false, engine);
    assert!(
        w.server
            .log()
            .contains(&format!("passthrough engine engine={engine}")),
        "{}",
        w.server.log()
    );
    for proto in [Proto::H1, Proto::H2] {
        let get = |sni, path| {
            fetch(
                proto,
                w.server.addr(),
                sni,
                w.env.client(proto.alpn()),
                "GET",
                path,
                &[],
            )
        };
        // The client verifies the chain for a.pass: only the origin holds that key.
        let got = get("a.pass", "/fixture.bin").await;
        assert_eq!(got.status, 200, "{proto:?}");
        assert_eq!(got.len, FIXTURE_LEN, "{proto:?}");
        assert_eq!(hex(&got.sha256), hex(&fixture().sha256), "{proto:?}");
        assert!(
            got.header("server").starts_with("nginx"),
            "{proto:?}: served by the origin"
        );
        let got = get("b.pass", "/who.txt").await;
        assert_eq!(got.body, b"origin b", "{proto:?}");
        let got = get("x.b.pass", "/who.txt").await;
        assert_eq!(got.status, 200, "wildcard route");
    }
    let pins = format!("/sys/fs/bpf/webship-e2e-{}", w.server.port);
    // Six connections; the userspace counters are published twice a second.
    let mut stats = Value::Null;
    let published = eventually(Duration::from_secs(5), || {
        stats = stats_json(&pins);
        counter(&stats, "connections_steered", "total") == 6
    });
    assert!(published, "{stats}");
    let down = counter(&stats, "bytes_down", "total");
    assert!(
        down > 2 * FIXTURE_LEN && down < 2 * FIXTURE_LEN + 1_000_000,
        "two fixtures and TLS overhead went down: {stats}"
    );
    let up = counter(&stats, "bytes_up", "total");
    assert!(up > 6 * 200 && up < 100_000, "requests went up: {stats}");
    if engine == "sockmap" {
        // The kernel moved the payload; userspace only the ClientHellos.
        assert!(counter(&stats, "bytes_down", "kernel") == down, "{stats}");
        assert!(counter(&stats, "bytes_down", "userspace") == 0, "{stats}");
    } else {
        assert_eq!(counter(&stats, "bytes_down", "kernel"), 0, "{stats}");
    }
    let mut server = w.server;
    server.terminate();
    assert!(server.wait_exit(Duration::from_secs(20)).is_some());
    assert!(
        !std::path::Path::new(&pins).exists(),
        "pinned maps left behind after shutdown"
    );
}

/// `counters.<name>.<part>` from `webship stats --json`.
fn counter(stats: &Value, name: &str, part: &str) -> u64 {
    stats["counters"][name][part]
        .as_u64()
        .unwrap_or_else(|| panic!("no counter {name}.{part} in {stats}"))
}

#[test]
fn curl_through_passthrough() {
    let w = world(false);
    let ca = w.env.ca_file();
    let out = w.env.dir.path().join("curl.bin");
    for flag in ["--http1.1", "--http2"] {
        let stdout = curl_download(
            "a.pass",
            w.server.port,
            &ca,
            flag,
            &format!("https://a.pass:{}/fixture.bin", w.server.port),
            &out,
            "%{http_code} %{size_download}",
        );
        assert_eq!(stdout, format!("200 {FIXTURE_LEN}"), "{flag}");
        assert_eq!(hex(&sha256_file(&out).unwrap()), hex(&fixture().sha256), "{flag}");
    }
}

/// Writes the first `slow` bytes one per write (each its own segment: no Nagle).
struct Trickle {
    tcp: TcpStream,
    slow: usize,
}

impl AsyncRead for Trickle {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for Trickle {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let n = if self.slow > 0 {
            1.min(data.len())
        } else {
            data.len()
        };
        let r = Pin::new(&mut self.tcp).poll_write(cx, &data[..n]);
        if let Poll::Ready(Ok(written)) = &r {
            self.slow = self.slow.saturating_sub(*written);
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hello_in_one_byte_segments_still_routes() {
    let w = world(false);
    let tcp = TcpStream::connect(w.server.addr()).await.unwrap();
    tcp.set_nodelay(true).unwrap();
    let trickle = Trickle { tcp, slow: 4096 };
    let name = rustls::pki_types::ServerName::try_from("b.pass").unwrap();
    let mut config = (*w.env.client(b"http/1.1")).clone();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let mut tls = connector.connect(name, trickle).await.unwrap();
    tls.write_all(b"GET /who.txt HTTP/1.1\r\nHost: b.pass\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    tls.flush().await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(20), tls.read_to_end(&mut out)).await;
    assert!(!out.is_empty(), "no response; log:\n{}", w.server.log());
    assert_eq!(raw_status(&out), 200);
    assert!(String::from_utf8_lossy(&out).ends_with("origin b"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_sni_and_garbage_are_closed_and_counted() {
    let w = world(false);
    assert!(connect(w.server.addr(), "nobody.pass", w.env.client(b"http/1.1"))
        .await
        .is_err());
    for garbage in [
        &b"GET / HTTP/1.1\r\nHost: a.pass\r\n\r\n"[..],
        &[22, 3, 1, 0, 4, 2, 0, 0, 0],
    ] {
        let mut tcp = TcpStream::connect(w.server.addr()).await.unwrap();
        tcp.write_all(garbage).await.unwrap();
        let mut buf = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(15), tcp.read_to_end(&mut buf)).await;
        assert!(closed.is_ok(), "garbage kept the connection open");
        assert!(buf.is_empty(), "webship answered garbage: {buf:?}");
    }
    // A truncated hello is closed when the handshake timeout ends it.
    let mut tcp = TcpStream::connect(w.server.addr()).await.unwrap();
    tcp.write_all(&[22, 3, 1, 2, 0, 1, 0, 1]).await.unwrap();
    // Let the daemon accept it before the signal stops its accept loop (under
    // load the signal could win, and the hello would never be counted).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut server = w.server;
    server.terminate();
    assert!(server.wait_exit(Duration::from_secs(20)).is_some());
    let log = server.log();
    // Two garbage connections and the truncated hello (its timeout ends it during
    // the drain); the harness's TCP probe that sent nothing is not a bad hello.
    assert!(
        log.contains("sni_misses=1") && log.contains("bad_hellos=3"),
        "{log}"
    );
    drop(tcp);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_sites_share_the_listener() {
    let w = world(true);
    std::fs::write(w.env.root.join("here.txt"), "terminated by webship").unwrap();
    let got = fetch(
        Proto::H2,
        w.server.addr(),
        HOST,
        w.env.client(b"h2"),
        "GET",
        "/here.txt",
        &[],
    )
    .await;
    assert_eq!(got.body, b"terminated by webship");
    assert!(got.header("server").starts_with("webship"));
    let got = fetch(
        Proto::H2,
        w.server.addr(),
        "a.pass",
        w.env.client(b"h2"),
        "GET",
        "/who.txt",
        &[],
    )
    .await;
    assert_eq!(got.body, b"origin a");
    assert!(got.header("server").starts_with("nginx"));
}

/// HTTP/3 through passthrough: the QUIC origin is a second webship serving
/// `a.pass` directly (with its own certificate); the front only relays datagrams.
/// The fixture arrives exact with quinn and with aioquic, and the UDP counters
/// account for the flows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h3_through_passthrough_in_userspace() {
    h3_through_passthrough("userspace").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h3_through_passthrough_redirected_by_ebpf() {
    h3_through_passthrough("ebpf").await;
}

async fn h3_through_passthrough(udp_engine: &str) {
    let env = Env::new();
    let origin_root = env.dir.path().join("origin");
    std::fs::create_dir(&origin_root).unwrap();
    fixture().place(&origin_root, "fixture.bin").unwrap();
    let origin = origin_server(&env, "quic-origin", "a.pass", &origin_root, "", "");
    let start_front = || h3_passthrough_front(&env, origin.addr(), udp_engine);
    // With eBPF, another front's classifier attaches first on the same hook:
    // it must pass every packet on, not end the chain.
    let _decoy = (udp_engine == "ebpf").then(&start_front);
    let front = start_front();
    let (addr, client) = (front.addr(), env.client(b"h3"));
    let fetched =
        tokio::spawn(async move { fetch_h3(addr, "a.pass", client, "GET", "/fixture.bin", &[]).await });
    let got = match fetched.await {
        Ok(got) => got,
        Err(e) => panic!("{e}\nFRONT:\n{}\nORIGIN:\n{}", front.log(), origin.log()),
    };
    assert_eq!(got.status, 200, "{}", front.log());
    assert_eq!(got.len, FIXTURE_LEN);
    assert_eq!(hex(&got.sha256), hex(&fixture().sha256));

    let (value, line) = aioquic_fetch(front.port, "a.pass", "/fixture.bin", &env.ca_file(), &[]);
    assert_eq!(value["status"], 200, "{line}");
    assert_eq!(value["len"], FIXTURE_LEN, "{line}");
    assert_eq!(value["sha256"], hex(&fixture().sha256), "{line}");

    // Two client flows, each a real QUIC connection carried whole.
    let pins = format!("/sys/fs/bpf/webship-e2e-{}", front.port);
    let mut stats = Value::Null;
    let counted = eventually(Duration::from_secs(5), || {
        stats = stats_json(&pins);
        counter(&stats, "udp_flows", "total") == 2
    });
    assert!(counted, "{stats}");
    assert!(
        counter(&stats, "bytes_down", "total") > 2 * FIXTURE_LEN,
        "{stats}"
    );
    // At least a datagram per 8,972 bytes: the origin's ceiling on loopback's route.
    assert!(
        counter(&stats, "udp_packets_down", "total") > 2 * FIXTURE_LEN / 8972,
        "{stats}"
    );
    assert!(counter(&stats, "udp_packets_up", "total") > 10, "{stats}");
    // Exactly one side carried the datagrams: the kernel or the daemon.
    let (carrier, idle) = if udp_engine == "ebpf" {
        ("kernel", "userspace")
    } else {
        ("userspace", "kernel")
    };
    assert_eq!(counter(&stats, "udp_flows", carrier), 2, "{stats}");
    assert_eq!(counter(&stats, "udp_packets_down", idle), 0, "{stats}");
    assert!(
        front
            .log()
            .contains(&format!("HTTP/3 passthrough engine engine=\"{udp_engine}\"")),
        "{}",
        front.log()
    );
    // The TCP side of the same route still works.
    let got = fetch(
        Proto::H2,
        front.addr(),
        "a.pass",
        env.client(b"h2"),
        "GET",
        "/fixture.bin",
        &[],
    )
    .await;
    assert_eq!(got.len, FIXTURE_LEN);
    assert!(
        got.header("server").starts_with("webship"),
        "served by the origin"
    );
}

/// A raw TCP origin for one connection: reads exactly `hello_len` bytes, answers
/// `reply` and half-closes, then reads the client's remaining bytes to EOF and
/// hands back (hello, tail).
async fn half_closing_origin(
    hello_len: usize,
    reply: Vec<u8>,
) -> (std::net::SocketAddr, tokio::task::JoinHandle<(Vec<u8>, Vec<u8>)>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let (mut tcp, _) = tokio::time::timeout(Duration::from_secs(10), listener.accept())
            .await
            .unwrap()
            .unwrap();
        let mut hello = vec![0; hello_len];
        tcp.read_exact(&mut hello).await.unwrap();
        tcp.write_all(&reply).await.unwrap();
        tcp.shutdown().await.unwrap();
        let mut tail = Vec::new();
        tokio::time::timeout(Duration::from_secs(20), tcp.read_to_end(&mut tail))
            .await
            .unwrap()
            .unwrap();
        (hello, tail)
    });
    (addr, task)
}

/// A real rustls ClientHello naming `sni`.
pub(crate) fn client_hello(env: &Env, sni: &str) -> Vec<u8> {
    let name = rustls::pki_types::ServerName::try_from(sni.to_owned()).unwrap();
    let mut conn = rustls::ClientConnection::new(env.client(b"h2"), name).unwrap();
    let mut hello = Vec::new();
    conn.write_tls(&mut hello).unwrap();
    hello
}

fn passthrough_only(origin: std::net::SocketAddr, engine: &str) -> String {
    passthrough_config(
        &format!("passthrough_engine = \"{engine}\"\n"),
        false,
        &[("raw.pass", origin)],
    )
}

/// Sockets of the front connected to `origin` (its upstream side).
fn upstream_sockets(origin: std::net::SocketAddr) -> usize {
    established(origin.port(), End::Remote)
}

/// An origin that half-closes after its reply still receives everything the
/// client sends afterwards, and the client sees the origin's FIN after exactly
/// the reply: with every engine. Nothing stays open or linked afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_closed_origin_ends_both_sides_cleanly() {
    let env = Env::new();
    let hello = client_hello(&env, "raw.pass");
    let reply = crate::support::pattern(16 << 20);
    let tail = crate::support::pattern(700_000);
    for engine in ["auto", "sockmap", "splice", "copy"] {
        let (origin, task) = half_closing_origin(hello.len(), reply.clone()).await;
        let front = Server::start(env.dir.path(), &passthrough_only(origin, engine));
        let mut tcp = TcpStream::connect(front.addr()).await.unwrap();
        tcp.write_all(&hello).await.unwrap();
        // A slow start: the reply and the origin's FIN pile up inside webship (and
        // for sockmap, in the kernel's redirect queue) before the client reads.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(20), tcp.read_to_end(&mut got))
            .await
            .unwrap_or_else(|_| panic!("{engine}: no FIN after the reply; log:\n{}", front.log()))
            .unwrap();
        assert!(
            got == reply,
            "{engine}: reply differs ({} of {} bytes)",
            got.len(),
            reply.len()
        );
        // The client keeps talking after the origin's half-close.
        tcp.write_all(&tail).await.unwrap();
        tcp.shutdown().await.unwrap();
        let (seen_hello, seen_tail) = tokio::time::timeout(Duration::from_secs(20), task)
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "{engine}: the origin never saw the client's FIN; log:\n{}",
                    front.log()
                )
            })
            .unwrap();
        assert!(seen_hello == hello, "{engine}: hello altered");
        assert!(
            seen_tail == tail,
            "{engine}: tail differs ({} of {} bytes)",
            seen_tail.len(),
            tail.len()
        );
        drop(tcp);
        assert_nothing_left(&front, origin, engine);
    }
}

/// A client that resets mid-download ends the upstream side too, with every engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_reset_ends_the_upstream_side() {
    let env = Env::new();
    let hello = client_hello(&env, "raw.pass");
    for engine in ["auto", "sockmap", "splice", "copy"] {
        // An origin that keeps sending until the peer goes away.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let origin = listener.local_addr().unwrap();
        let hello_len = hello.len();
        let task = tokio::spawn(async move {
            let (mut tcp, _) = listener.accept().await.unwrap();
            let mut seen = vec![0; hello_len];
            tcp.read_exact(&mut seen).await.unwrap();
            let chunk = vec![7u8; 64 * 1024];
            // Bounded: 1 GiB at most, or until the write fails (or, with the
            // buffers full, the caller's timeout). 64 MiB was not enough: with
            // tcp_rmem's maximum at 32 MiB, the kernel's buffers on the way
            // (two receive buffers, two send buffers, the pipe) hold all of it
            // before the client resets, and the origin finished without an error.
            for _ in 0..16 * 1024 {
                if tcp.write_all(&chunk).await.is_err() {
                    return true;
                }
            }
            false
        });
        let front = Server::start(env.dir.path(), &passthrough_only(origin, engine));
        let tcp = TcpStream::connect(front.addr()).await.unwrap();
        let mut tcp = tcp;
        tcp.write_all(&hello).await.unwrap();
        let mut buf = vec![0; 256 * 1024];
        let mut got = 0;
        // Bounded: EOF or an error ends it (an early close used to spin here).
        while got < 1 << 20 {
            let n = tcp.read(&mut buf).await.unwrap();
            assert!(n > 0, "{engine}: closed after {got} bytes; log:\n{}", front.log());
            got += n;
        }
        // Reset, not FIN: linger 0 then close with unread data.
        socket2::SockRef::from(&tcp)
            .set_linger(Some(Duration::ZERO))
            .unwrap();
        drop(tcp);
        let origin_saw_error = tokio::time::timeout(Duration::from_secs(20), task)
            .await
            .unwrap_or_else(|_| panic!("{engine}: the origin kept its connection; log:\n{}", front.log()))
            .unwrap();
        assert!(
            origin_saw_error,
            "{engine}: the origin sent 1 GiB to a reset client"
        );
        assert_nothing_left(&front, origin, engine);
    }
}

/// No client or upstream socket left open, no sockmap link left behind.
fn assert_nothing_left(front: &Server, origin: std::net::SocketAddr, engine: &str) {
    let closed = eventually(Duration::from_secs(10), || {
        front.established() == 0 && upstream_sockets(origin) == 0
    });
    assert!(
        closed,
        "{engine}: {} client and {} upstream sockets still open; log:\n{}",
        front.established(),
        upstream_sockets(origin),
        front.log()
    );
    let stats = stats_json(&format!("/sys/fs/bpf/webship-e2e-{}", front.port));
    assert_eq!(stats["linked_sockets"], 0, "{engine}: {stats}");
}

/// A client that keeps sending, one small segment after another, from right after
/// its ClientHello (as a TLS client sending early data does, or one whose next
/// flight races the link), to an origin that speaks first: the origin receives the
/// hello and then every byte in the order sent, and the client the origin's
/// answer, with every engine. For `sockmap` both arrive while the daemon links the
/// sockets, which is when an order could break: one segment left in the socket
/// while a later one is redirected past it; the kernel must have moved some of
/// the bytes (not every connection relayed from userspace).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn segments_racing_the_link_arrive_in_order() {
    const SEGMENTS: u64 = 3_000;
    const CONNECTIONS: usize = 12;
    const ANSWER: &[u8] = b"the origin speaks first";
    let env = Env::new();
    let hello = client_hello(&env, "raw.pass");
    for engine in ["sockmap", "auto", "splice", "copy"] {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let origin = listener.local_addr().unwrap();
        let hello_len = hello.len();
        // Reads, per connection, the hello and then the counters, and reports the
        // first counter out of place (or the hello altered).
        let task = tokio::spawn(async move {
            let mut verdicts = Vec::new();
            for _ in 0..CONNECTIONS {
                let (mut tcp, _) = tokio::time::timeout(Duration::from_secs(10), listener.accept())
                    .await
                    .expect("no connection reached the origin")
                    .unwrap();
                tcp.write_all(ANSWER).await.unwrap();
                let mut all = Vec::new();
                let ended = tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut all)).await;
                let ended = matches!(ended, Ok(Ok(_)));
                let rest = all.split_off(hello_len.min(all.len()));
                let seen = all;
                let out_of_place = rest
                    .chunks(8)
                    .enumerate()
                    .find(|(i, c)| *c != (*i as u64).to_be_bytes())
                    .map(|(i, _)| i);
                verdicts.push((seen, rest.len(), out_of_place, ended));
                if !ended {
                    break;
                }
            }
            verdicts
        });
        let front = Server::start(env.dir.path(), &passthrough_only(origin, engine));
        for _ in 0..CONNECTIONS {
            let mut tcp = TcpStream::connect(front.addr()).await.unwrap();
            tcp.set_nodelay(true).unwrap();
            tcp.write_all(&hello).await.unwrap();
            // One write per counter: each its own segment on loopback.
            for i in 0..SEGMENTS {
                tcp.write_all(&i.to_be_bytes()).await.unwrap();
            }
            tcp.shutdown().await.unwrap();
            let mut answer = Vec::new();
            tokio::time::timeout(Duration::from_secs(20), tcp.read_to_end(&mut answer))
                .await
                .unwrap_or_else(|_| panic!("{engine}: no answer; log:\n{}", front.log()))
                .unwrap_or_else(|e| panic!("{engine}: {e}; log:\n{}", front.log()));
            assert_eq!(answer, ANSWER, "{engine}: answer altered");
        }
        let verdicts = tokio::time::timeout(Duration::from_secs(60), task)
            .await
            .unwrap_or_else(|_| panic!("{engine}: the origin hung; log:\n{}", front.log()))
            .unwrap();
        for (k, (seen, len, out_of_place, ended)) in verdicts.into_iter().enumerate() {
            let log = front.log();
            assert!(
                ended,
                "{engine}: connection {k}: no end after {len} bytes; log:\n{log}"
            );
            assert!(
                seen == hello,
                "{engine}: connection {k}: hello altered; log:\n{log}"
            );
            assert_eq!(
                len as u64,
                SEGMENTS * 8,
                "{engine}: connection {k}: bytes lost; log:\n{log}"
            );
            assert_eq!(
                out_of_place, None,
                "{engine}: connection {k}: counter out of place (of {SEGMENTS}); log:\n{log}"
            );
        }
        if engine == "sockmap" {
            let stats = stats_json(&format!("/sys/fs/bpf/webship-e2e-{}", front.port));
            let kernel = counter(&stats, "bytes_up", "kernel");
            // Not all: a segment landing while only the client is in the map sends
            // the rest of that connection's bytes through userspace.
            assert!(kernel > 0, "the kernel moved nothing up: {stats}");
        }
        assert_nothing_left(&front, origin, engine);
    }
}

/// A client that sends its hello, everything else and its FIN at once has
/// half-closed before the daemon links its socket (most runs: the daemon may be
/// quicker, so up to ten tries until one is), which the kernel refuses for a socket
/// no longer established: the `sockmap` engine relays it by copy instead, and the
/// origin gets every byte and the end, and its answer comes back, either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_half_closed_before_the_link_is_still_relayed() {
    let env = Env::new();
    let hello = client_hello(&env, "raw.pass");
    let body = crate::support::pattern(100_000);
    let mut sent = hello.clone();
    sent.extend_from_slice(&body);
    let mut copied = false;
    for _ in 0..10 {
        let (origin, task) = half_closing_origin(hello.len(), b"answer".to_vec()).await;
        let (admin_toml, admin) = crate::subsystem_metrics::admin();
        let config = format!(
            "{}
{admin_toml}",
            passthrough_only(origin, "sockmap")
        );
        let front = Server::start(env.dir.path(), &config);
        let mut tcp = TcpStream::connect(front.addr()).await.unwrap();
        tcp.write_all(&sent).await.unwrap();
        tcp.shutdown().await.unwrap();
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(20), tcp.read_to_end(&mut got))
            .await
            .unwrap_or_else(|_| panic!("no answer; log:\n{}", front.log()))
            .unwrap_or_else(|e| panic!("{e}; log:\n{}", front.log()));
        assert_eq!(got, b"answer", "log:\n{}", front.log());
        let (seen_hello, tail) = tokio::time::timeout(Duration::from_secs(20), task)
            .await
            .unwrap_or_else(|_| panic!("the origin never saw the end; log:\n{}", front.log()))
            .unwrap();
        assert!(seen_hello == hello, "hello altered");
        assert!(
            tail == body,
            "body differs ({} of {} bytes); log:\n{}",
            tail.len(),
            body.len(),
            front.log()
        );
        drop(tcp);
        assert_nothing_left(&front, origin, "sockmap");
        let fallbacks = crate::subsystem_metrics::Scrape::take(admin)
            .get("webship_passthrough_sockmap_fallbacks_total{reason=\"unlinkable\"}");
        if front.log().contains("sockmap: cannot link, relayed by copy") {
            assert_eq!(fallbacks, Some(1.0), "the fallback is counted");
            copied = true;
            break;
        }
        assert_eq!(fallbacks, Some(0.0), "log:\n{}", front.log());
    }
    assert!(copied, "every try was linked before the client's FIN arrived");
}
