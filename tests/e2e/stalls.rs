//! Nothing waits forever, on any protocol: clients that never send the HTTP/2
//! preface, trickle a request head, stop granting flow-control credit, open request
//! streams and say nothing, or open and finish empty streams in a loop are cut by
//! the handshake, header, send and idle timeouts, and the server's memory stays
//! bounded meanwhile. Each flood prints its FLOOD line (run with `--nocapture`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use h2::client::SendRequest;
use rustls::ClientConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use webship_testkit::h2raw::{self, End, H2Raw};
use webship_testkit::proc::{FloodReport, Footprint};
use webship_tests::client::{connect, request, H3Client, H3Options, Proto};
use webship_tests::Server;

use crate::support::{pattern, Env, HOST, MIB};

/// Short limits, so each cut comes within seconds.
const LIMITS: &str = "[limits]\nhandshake_timeout_secs = 2\nheader_read_timeout_secs = 2\nidle_timeout_secs = 3\nsend_timeout_secs = 2\n";
/// A file large enough that no window a stalled client grants covers it.
const BIG: usize = 8 * 1024 * 1024;

fn footprint(server: &Server) -> Footprint {
    Footprint::of(server.pid()).expect("the server is running")
}

/// How long a normal 4 MiB download over HTTP/1.1 takes now (it must succeed).
async fn download(env: &Env, server: &Server) -> Duration {
    let start = Instant::now();
    let got = env.get(Proto::H1, server, "/normal.bin", &[]).await;
    assert_eq!(
        (got.status.as_u16(), got.len),
        (200, 4 * MIB),
        "the normal download"
    );
    start.elapsed()
}

/// A server with [`LIMITS`] (and `extra`) serving `/big.bin` and `/normal.bin`.
fn start(env: &Env, extra: &str) -> Server {
    env.write("big.bin", &pattern(BIG));
    env.write("normal.bin", &pattern(4 * MIB as usize));
    env.start(&format!("{LIMITS}{extra}"))
}

/// `n` TLS connections offering `alpn`, opened 50 at a time.
async fn tls_flood(addr: SocketAddr, tls: Arc<ClientConfig>, n: usize) -> Vec<TlsStream<TcpStream>> {
    let mut conns = Vec::with_capacity(n);
    while conns.len() < n {
        let batch = (n - conns.len()).min(50);
        let opened = (0..batch).map(|_| connect(addr, HOST, tls.clone()));
        for conn in futures_join(opened).await {
            conns.push(conn.expect("TLS handshake"));
        }
    }
    conns
}

async fn futures_join<F: std::future::Future + Send + 'static>(
    futures: impl Iterator<Item = F>,
) -> Vec<F::Output>
where
    F::Output: Send,
{
    let tasks: Vec<_> = futures.map(tokio::spawn).collect();
    let mut out = Vec::with_capacity(tasks.len());
    for task in tasks {
        out.push(task.await.unwrap());
    }
    out
}

/// Waits (without blocking the runtime) until the server holds at most `left`
/// established connections; whether it did within `limit`.
async fn established_at_most(server: &Server, left: usize, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if server.established() <= left {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    server.established() <= left
}

/// 300 TLS connections that negotiate h2 and then send nothing are closed at the
/// handshake timeout (they were held forever: the preface was never timed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_h2_connections_are_closed_at_the_handshake_timeout() {
    let env = Env::new();
    let server = start(&env, "");
    let before = footprint(&server);
    let conns = tls_flood(server.addr(), env.client(b"h2"), 300).await;
    let during = footprint(&server);
    let took = download(&env, &server).await;
    assert!(
        established_at_most(&server, 0, Duration::from_secs(8)).await,
        "{} silent h2 connections still open 8 s after a 2 s handshake timeout",
        server.established()
    );
    let after = footprint(&server);
    FloodReport {
        flood: "silent h2 (300 TLS h2 connections, no preface)",
        before,
        during,
        after,
        download: Some(took),
    }
    .print();
    drop(conns);
}

/// Trickles `head` one byte every 100 ms on `conns` until the server closes each, or
/// `limit` passes; how many the server closed.
async fn trickle(mut conns: Vec<TlsStream<TcpStream>>, head: &'static [u8], limit: Duration) -> usize {
    let deadline = Instant::now() + limit;
    let mut at = 0;
    let mut open = conns.len();
    while Instant::now() < deadline && open > 0 && at < head.len() {
        open = 0;
        for conn in conns.iter_mut() {
            let mut probe = [0u8; 256];
            // A closed connection shows as EOF or an error on a short read.
            let closed = matches!(
                tokio::time::timeout(Duration::from_millis(1), conn.read(&mut probe)).await,
                Ok(Ok(0) | Err(_))
            );
            if !closed && conn.write_all(&head[at..=at]).await.is_ok() && conn.flush().await.is_ok() {
                open += 1;
            }
        }
        at += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    conns.len() - open
}

const H1_HEAD: &[u8] = b"GET /normal.bin HTTP/1.1\r\nHost: files.test\r\nUser-Agent: a-very-slow-client-that-never-finishes-its-head-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\r\n";

/// 300 connections trickling an HTTP/1.1 head to a file site (Webship's own driver)
/// are cut at the header timeout while they still trickle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_on_the_h1_driver_is_cut_at_the_header_timeout() {
    let env = Env::new();
    let server = start(&env, "");
    let before = footprint(&server);
    let conns = tls_flood(server.addr(), env.client(b"http/1.1"), 300).await;
    let trickling = tokio::spawn(trickle(conns, H1_HEAD, Duration::from_secs(12)));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let during = footprint(&server);
    let took = download(&env, &server).await;
    let closed = trickling.await.unwrap();
    assert_eq!(
        closed, 300,
        "connections trickling a head must be cut at the 2 s header timeout"
    );
    let after = footprint(&server);
    FloodReport {
        flood: "slowloris (300 connections trickling HTTP/1.1 heads)",
        before,
        during,
        after,
        download: Some(took),
    }
    .print();
}

/// The same on hyper's HTTP/1.1 (a proxy site's connections).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_on_hyper_h1_is_cut_at_the_header_timeout() {
    let env = Env::new();
    let proxy = format!(
        "{LIMITS}\n[reverse_proxy]\nenabled = true\ntls_termination = true\n[reverse_proxy.tls]\ncert = \"{}\"\nkey = \"{}\"\n[[reverse_proxy.routes]]\ndomain = \"proxied.test\"\npath_prefix = \"/\"\nupstreams = [\"127.0.0.1:9\"]\n",
        env.cert.display(),
        env.key.display()
    );
    let (cert, key) = env.leaf("proxied", &["proxied.test"]);
    let config = format!(
        "listen = \"127.0.0.1:{{port}}\"\nworkers = 2\n{}",
        proxy
            .replace(&env.cert.display().to_string(), &cert.display().to_string())
            .replace(&env.key.display().to_string(), &key.display().to_string())
    );
    let server = Server::start(env.dir.path(), &config);
    let tls = env.client(b"http/1.1");
    let mut conns = Vec::new();
    for _ in 0..20 {
        conns.push(connect(server.addr(), "proxied.test", tls.clone()).await.unwrap());
    }
    let closed = trickle(conns, H1_HEAD, Duration::from_secs(12)).await;
    assert_eq!(
        closed, 20,
        "hyper's HTTP/1.1 must cut a trickled head at the 2 s header timeout"
    );
}

/// An HTTP/2 request head (a HEADERS frame whose payload comes a byte at a time)
/// never makes a request, so the connection is closed while it still trickles: at
/// the header timeout, before the idle timeout (it was held for as long as it
/// trickled: bytes kept hyper's keep-alive from ever pinging). The stricter
/// `an_open_h2_header_block_is_cut_at_the_header_timeout` tells the two apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2_head_trickled_forever_is_cut() {
    let env = Env::new();
    let server = start(&env, "");
    let mut conns = Vec::new();
    for _ in 0..20 {
        let mut conn = connect(server.addr(), HOST, env.client(b"h2")).await.unwrap();
        // Preface, empty SETTINGS, then a HEADERS frame header announcing 200 bytes.
        conn.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00\x00\x00\xc8\x01\x00\x00\x00\x00\x01")
            .await
            .unwrap();
        conns.push(conn);
    }
    static BLOCK: [u8; 200] = [0x40; 200];
    let closed = trickle(conns, &BLOCK, Duration::from_secs(15)).await;
    assert_eq!(
        closed, 20,
        "a trickled h2 head must not hold its connection past the 2 s header timeout"
    );
}

/// A header timeout far shorter than the idle and send timeouts, so only it can cut.
const HEAD_LIMITS: &str = "[limits]\nhandshake_timeout_secs = 2\nheader_read_timeout_secs = 2\nidle_timeout_secs = 30\nsend_timeout_secs = 30\n";
/// How long after its first byte an open HTTP/2 header block may hold its connection:
/// the 2 s header timeout and some slack (the idle timeout is 30 s).
const HEAD_CUT: Duration = Duration::from_millis(4_500);

/// A GET header block for `path`, as literal fields.
fn h2_get(path: &str) -> Vec<u8> {
    h2raw::block(&[
        (":method", "GET"),
        (":scheme", "https"),
        (":authority", HOST),
        (":path", path),
    ])
}

/// How a stalled head ended, and how long after its first byte.
#[derive(Debug)]
struct HeadCut {
    end: End,
    after: Duration,
    /// DATA bytes of the download on stream 1 read meanwhile (the `active` case).
    downloaded: usize,
}

/// The ways a client can keep an HTTP/2 header block open.
#[derive(Debug, Clone, Copy)]
enum Stall {
    /// HEADERS without END_HEADERS, then nothing.
    Silent,
    /// HEADERS without END_HEADERS, then one CONTINUATION (no END_HEADERS) a second,
    /// four at most (h2 itself ends a block at its sixth CONTINUATION frame).
    Continuations,
    /// A HEADERS frame's 9-byte header, then its payload a byte every 200 ms.
    Payload,
    /// As `Continuations`, on stream 3, while stream 1 downloads `/big.bin` (1 MiB
    /// of window granted before the block opens; no other frame may come between a
    /// block's frames, so its response stays in flight, waiting on window).
    Active,
}

/// One raw HTTP/2 connection that stalls its head as `stall` says, reading frames
/// until the server ends the connection or 12 s pass.
async fn stall_head(addr: SocketAddr, tls: Arc<ClientConfig>, stall: Stall) -> HeadCut {
    let mut conn = H2Raw::connect(addr, HOST, &tls).await.unwrap();
    let window = 64 * 1024;
    conn.handshake(
        &[(h2raw::setting::INITIAL_WINDOW_SIZE, window)],
        Duration::from_secs(3),
    )
    .await
    .unwrap();
    let stream = if matches!(stall, Stall::Active) { 3 } else { 1 };
    let mut downloaded = 0;
    if matches!(stall, Stall::Active) {
        conn.send(&h2raw::headers(1, &h2_get("/big.bin"), true))
            .await
            .unwrap();
        // The download is under way before the head opens.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
        while downloaded == 0 {
            match conn.read_frame(deadline).await {
                Ok(Some(f)) if f.kind == h2raw::kind::DATA && f.stream == 1 => downloaded += f.payload.len(),
                Ok(Some(_)) => {}
                other => panic!("the download did not start: {other:?}"),
            }
        }
        let mut grant = h2raw::window_update(0, 1 << 20);
        grant.extend(h2raw::window_update(1, 1 << 20));
        conn.send(&grant).await.unwrap();
    }
    let head = h2_get("/normal.bin");
    let start = Instant::now();
    let mut payload_at = 0;
    match stall {
        Stall::Payload => {
            let mut first = h2raw::frame(
                h2raw::kind::HEADERS,
                h2raw::flag::END_HEADERS | h2raw::flag::END_STREAM,
                stream,
                &head,
            );
            first.truncate(9 + 1);
            payload_at = 1;
            conn.send(&first).await.unwrap();
        }
        _ => {
            let half = &head[..head.len() / 2];
            conn.send(&h2raw::frame(
                h2raw::kind::HEADERS,
                h2raw::flag::END_STREAM,
                stream,
                half,
            ))
            .await
            .unwrap();
        }
    }
    let tick = match stall {
        Stall::Silent => Duration::from_millis(500),
        Stall::Continuations | Stall::Active => Duration::from_secs(1),
        Stall::Payload => Duration::from_millis(200),
    };
    let limit = Instant::now() + Duration::from_secs(12);
    let mut n = 0;
    while Instant::now() < limit {
        let next = tokio::time::Instant::now() + tick;
        // Frames until the next tick; a GOAWAY or the close ends it.
        loop {
            match conn.read_frame(next).await {
                Err(_) => break,
                Ok(None) => {
                    return HeadCut {
                        end: End::Closed,
                        after: start.elapsed(),
                        downloaded,
                    }
                }
                Ok(Some(f)) if f.kind == h2raw::kind::GOAWAY => {
                    return HeadCut {
                        end: End::GoAway {
                            code: f.error_code().unwrap_or(u32::MAX),
                            last_stream: 0,
                        },
                        after: start.elapsed(),
                        downloaded,
                    }
                }
                Ok(Some(f)) if f.stream == 1 && f.flags & h2raw::flag::END_STREAM != 0 => {
                    panic!("{stall:?}: the download ended before the head was cut")
                }
                Ok(Some(f)) if f.kind == h2raw::kind::DATA && f.stream == 1 => downloaded += f.payload.len(),
                Ok(Some(_)) => {}
            }
        }
        conn.seen.clear();
        let mut out = Vec::new();
        match stall {
            Stall::Silent => {}
            Stall::Continuations | Stall::Active if n < 4 => {
                let mut field = Vec::new();
                h2raw::literal(&mut field, format!("x-slow-{n}").as_bytes(), b"v");
                out.extend(h2raw::frame(h2raw::kind::CONTINUATION, 0, stream, &field));
            }
            Stall::Continuations | Stall::Active => {}
            Stall::Payload => {
                if payload_at < head.len() {
                    out.push(head[payload_at]);
                    payload_at += 1;
                }
            }
        }
        n += 1;
        // A server that closed makes the write fail; the read says how it ended.
        if !out.is_empty() {
            let _ = conn.send(&out).await;
        }
    }
    HeadCut {
        end: End::TimedOut,
        after: start.elapsed(),
        downloaded,
    }
}

/// An HTTP/2 header block left open (HEADERS without END_HEADERS and then nothing,
/// CONTINUATION frames trickled one a second, a HEADERS frame's payload trickled a
/// byte at a time, and the same CONTINUATION trickle while another stream on the
/// connection downloads) ends its connection with GOAWAY PROTOCOL_ERROR at the 2 s
/// header timeout, long before the 30 s idle timeout (these were held until the
/// connection had had no request for the idle timeout, and the active download
/// kept that from ever happening).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_h2_header_block_is_cut_at_the_header_timeout() {
    let env = Env::new();
    env.write("big.bin", &pattern(BIG));
    env.write("normal.bin", &pattern(4 * MIB as usize));
    let server = env.start(HEAD_LIMITS);
    let stalls = [Stall::Silent, Stall::Continuations, Stall::Payload, Stall::Active];
    let tasks: Vec<_> = stalls
        .iter()
        .map(|&stall| tokio::spawn(stall_head(server.addr(), env.client(b"h2"), stall)))
        .collect();
    let mut wrong = Vec::new();
    for (stall, task) in stalls.iter().zip(tasks) {
        let cut = task.await.unwrap();
        println!("{stall:?}: {} after {:?}", cut.end, cut.after);
        let goaway = matches!(
            cut.end,
            End::GoAway {
                code: h2raw::code::PROTOCOL_ERROR,
                ..
            }
        );
        // Cut at the header timeout: not before it, and well before the idle timeout.
        if !goaway || cut.after > HEAD_CUT || cut.after < Duration::from_millis(1_500) {
            wrong.push(format!("{stall:?}: {} after {:?}", cut.end, cut.after));
        }
        if matches!(stall, Stall::Active) && (cut.downloaded <= 64 * 1024 || cut.downloaded >= BIG) {
            wrong.push(format!(
                "{stall:?}: the download on the same connection was not in flight throughout ({} bytes)",
                cut.downloaded
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "open h2 heads must end with GOAWAY PROTOCOL_ERROR 2 s (at most {HEAD_CUT:?}) after their first byte: {wrong:#?}"
    );
}

/// A client that opens downloads with all the window they need, reads nothing, and
/// then opens a header block it never ends: the server, blocked writing, cannot
/// send its GOAWAY, so it drops the connection 2 s (the close grace) after the
/// 2 s header timeout, long before the 30 s send timeout (it was held until the
/// send timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_h2_header_block_behind_blocked_output_is_dropped() {
    let env = Env::new();
    env.write("big.bin", &pattern(BIG));
    env.write("normal.bin", &pattern(4 * MIB as usize));
    let server = env.start(HEAD_LIMITS);
    let tls = env.client(b"h2");
    let mut conn = H2Raw::connect(server.addr(), HOST, &tls).await.unwrap();
    let max = (1u32 << 31) - 1;
    conn.handshake(
        &[(h2raw::setting::INITIAL_WINDOW_SIZE, max)],
        Duration::from_secs(3),
    )
    .await
    .unwrap();
    // Eight 8 MiB downloads with every byte granted: far more than the socket
    // buffers hold, so the server's writes block on this client.
    let mut opening = h2raw::window_update(0, max - 65_535);
    for stream in (1..16).step_by(2) {
        opening.extend(h2raw::headers(stream, &h2_get("/big.bin"), true));
    }
    conn.send(&opening).await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(server.established(), 1, "the connection is open before its head");
    let head = h2_get("/normal.bin");
    conn.send(&h2raw::frame(
        h2raw::kind::HEADERS,
        0,
        17,
        &head[..head.len() / 2],
    ))
    .await
    .unwrap();
    let start = Instant::now();
    let dropped = established_at_most(&server, 0, Duration::from_secs(12)).await;
    let after = start.elapsed();
    println!("blocked output: dropped {dropped} after {after:?}");
    assert!(
        dropped && after <= Duration::from_secs(7),
        "an open head behind blocked output held its connection for {after:?} (want dropped by 7 s: 2 s header timeout, 2 s grace, slack)"
    );
    drop(conn);
}

/// Opens `streams` GETs of `/big.bin` on one HTTP/2 connection whose client grants
/// a stream window of one byte and never more, answering PINGs meanwhile; returns
/// the connection's driver (it ends when the server closes the connection) and the
/// responses' heads.
async fn stalled_h2(server: &Server, env: &Env, streams: usize) -> (tokio::task::JoinHandle<()>, usize) {
    let (send, driver) = h2_window_one(server, env).await;
    (driver, stall_streams(send, streams).await)
}

/// An HTTP/2 connection whose client grants a stream window of one byte; its driver
/// ends when the server closes the connection.
async fn h2_window_one(server: &Server, env: &Env) -> (SendRequest<Bytes>, tokio::task::JoinHandle<()>) {
    let tls = connect(server.addr(), HOST, env.client(b"h2")).await.unwrap();
    let (send, conn) = h2::client::Builder::new()
        .initial_window_size(1)
        .handshake::<_, Bytes>(tls)
        .await
        .unwrap();
    let driver = tokio::spawn(async move {
        let _ = conn.await;
    });
    (send, driver)
}

/// Opens `streams` GETs of `/big.bin` whose responses are never read (no
/// WINDOW_UPDATE is ever sent for them); how many got their response head.
async fn stall_streams(mut send: SendRequest<Bytes>, streams: usize) -> usize {
    let mut heads = 0;
    let mut pending = Vec::new();
    for _ in 0..streams {
        send = send.ready().await.unwrap();
        let req = http::Request::get(format!("https://{HOST}/big.bin"))
            .body(())
            .unwrap();
        let (resp, _) = send.send_request(req, true).unwrap();
        pending.push(resp);
    }
    for resp in pending {
        if let Ok(Ok(resp)) = tokio::time::timeout(Duration::from_secs(5), resp).await {
            heads += usize::from(resp.status() == 200);
            // Held, never read: no WINDOW_UPDATE is ever sent.
            std::mem::forget(resp);
        }
    }
    heads
}

/// Four HTTP/2 connections, each with 128 large GETs whose client grants one byte
/// of stream window and answers PINGs: the server holds little per stream (it
/// reads a file chunk only as the client takes bytes), and drops each connection
/// once nothing moved for the send timeout (they were held forever, with two
/// 128 KiB chunks per stream).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_h2_windows_are_bounded_and_dropped_after_the_send_timeout() {
    let env = Env::new();
    let server = start(&env, "[runtime.settings]\nh2_max_concurrent_streams = \"128\"\n");
    let before = footprint(&server);
    let mut drivers = Vec::new();
    for _ in 0..4 {
        let (driver, heads) = stalled_h2(&server, &env, 128).await;
        assert_eq!(heads, 128, "every stalled stream got its response head");
        drivers.push(driver);
    }
    let during = footprint(&server);
    let took = download(&env, &server).await;
    // 512 streams with two 128 KiB chunks each held 128 MiB; two ramped 16 KiB
    // reads hold 16 MiB.
    let grown = during.rss_kib.saturating_sub(before.rss_kib) / 1024;
    assert!(
        grown < 48,
        "512 stalled h2 streams grew the server by {grown} MiB"
    );
    for driver in drivers {
        tokio::time::timeout(Duration::from_secs(10), driver)
            .await
            .expect("a connection stalled on flow control must be dropped after the 2 s send timeout")
            .unwrap();
    }
    let after = footprint(&server);
    FloodReport {
        flood: "stalled h2 window (4 connections x 128 GETs, window 1, PINGs answered)",
        before,
        during,
        after,
        download: Some(took),
    }
    .print();
}

/// A GET of the one-byte `/one.txt` on `send`, read to its end (its one byte fits
/// the window); whether it completed within a second.
async fn small_get(send: &SendRequest<Bytes>) -> bool {
    let get = async {
        let mut send = send.clone().ready().await.ok()?;
        let req = http::Request::get(format!("https://{HOST}/one.txt"))
            .body(())
            .unwrap();
        let (resp, _) = send.send_request(req, true).ok()?;
        let mut body = resp.await.ok()?.into_body();
        let mut len = 0;
        while let Some(data) = body.data().await {
            let data = data.ok()?;
            len += data.len();
            let _ = body.flow_control().release_capacity(data.len());
        }
        Some(len == 1)
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(1), get).await,
        Ok(Some(true))
    )
}

/// One HTTP/2 connection with 100 large GETs stalled on a one-byte window, and a
/// small GET completed on it every 500 ms: the stalled streams still end the
/// connection after the 2 s send timeout (any stream's progress reset the one clock
/// and kept the connection, and the stalled streams' files, alive forever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moving_stream_does_not_keep_stalled_h2_streams_alive() {
    let env = Env::new();
    env.write("one.txt", b"x");
    let server = start(&env, "[runtime.settings]\nh2_max_concurrent_streams = \"128\"\n");
    let before = footprint(&server);
    let (send, driver) = h2_window_one(&server, &env).await;
    assert_eq!(
        stall_streams(send.clone(), 100).await,
        100,
        "every stalled stream got its response head"
    );
    let stalled = Instant::now();
    let during = footprint(&server);
    let took = download(&env, &server).await;
    let mut moved = 0;
    while !driver.is_finished() && stalled.elapsed() < Duration::from_secs(12) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        moved += usize::from(small_get(&send).await);
    }
    let lived = stalled.elapsed();
    assert!(moved >= 2, "the moving stream moved ({moved} small GETs)");
    assert!(
        driver.is_finished() && lived < Duration::from_secs(7),
        "a connection with streams stalled past the 2 s send timeout must end although \
         another stream moves ({moved} small GETs; still open after {lived:?})"
    );
    assert!(
        established_at_most(&server, 0, Duration::from_secs(5)).await,
        "the dropped connection is gone"
    );
    let after = footprint(&server);
    FloodReport {
        flood: "stalled h2 streams behind a moving one (100 GETs, window 1, a small GET every 500 ms)",
        before,
        during,
        after,
        download: Some(took),
    }
    .print();
}

/// A client of HTTP/3 whose QUIC keep-alive PINGs go on and whose stream receive
/// window is tiny.
async fn h3_client(server: &Server, env: &Env, stream_window: u32) -> H3Client {
    let options = H3Options {
        stream_window,
        keep_alive: Some(Duration::from_millis(300)),
        idle_timeout: Some(Duration::from_secs(30)),
        ..H3Options::default()
    };
    H3Client::connect(server.addr(), HOST, &env.client(b"h3"), &options)
        .await
        .unwrap()
}

/// HTTP/3 GETs of a large file on streams the client never reads (its stream credit
/// runs out at 1 KiB) while QUIC PINGs keep the connection alive: the server holds
/// little per stream, each stream is reset after the send timeout, and the idle
/// connection is then closed (all were held forever, with two 128 KiB chunks each).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_h3_credit_resets_streams_and_closes_the_connection() {
    let env = Env::new();
    let server = start(&env, "");
    let before = footprint(&server);
    let mut clients = Vec::new();
    let mut streams = Vec::new();
    for _ in 0..4 {
        let client = h3_client(&server, &env, 1024).await;
        for _ in 0..64 {
            let mut send = client.send.clone();
            let (head, stream) = request(&mut send, &client.origin(), "GET", "/big.bin", &[])
                .await
                .unwrap();
            assert_eq!(head.status, 200);
            // Never read: the client grants no credit beyond its first 1 KiB.
            streams.push(stream);
        }
        clients.push(client);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let during = footprint(&server);
    let took = download(&env, &server).await;
    // 256 streams with two 128 KiB chunks each held 64 MiB; two ramped 16 KiB reads
    // hold 8 MiB.
    let grown = during.rss_kib.saturating_sub(before.rss_kib) / 1024;
    assert!(
        grown < 20,
        "256 h3 streams without credit grew the server by {grown} MiB"
    );
    // Every stream ends (reset, or with its connection) within the send timeout and
    // the idle timeout after it.
    let deadline = Instant::now() + Duration::from_secs(12);
    for client in &clients {
        let closed = tokio::time::timeout_at(deadline.into(), client.connection().closed()).await;
        let reason = closed.expect("a connection whose streams stalled must be closed once idle");
        assert!(
            matches!(reason, quinn::ConnectionError::ApplicationClosed(_)),
            "closed by the server's application: {reason:?}"
        );
    }
    let after = footprint(&server);
    FloodReport {
        flood: "stalled h3 credit (4 connections x 64 GETs, 1 KiB credit, PINGs)",
        before,
        during,
        after,
        download: Some(took),
    }
    .print();
    drop(streams);
}

/// A request stream whose HEADERS frame never completes is reset at the header
/// timeout (it waited forever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfinished_h3_request_head_is_reset_at_the_header_timeout() {
    let env = Env::new();
    let server = start(&env, "");
    let client = h3_client(&server, &env, 1 << 20).await;
    let (mut send, mut recv) = client.connection().open_bi().await.unwrap();
    // A HEADERS frame announcing 100 bytes, of which three come.
    send.write_all(&[0x01, 0x40, 0x64, 0, 0, 0xd1]).await.unwrap();
    let started = Instant::now();
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_secs(10), recv.read(&mut buf)).await;
    let read = read.expect("an unfinished request head must not be waited on forever");
    assert!(
        matches!(read, Err(quinn::ReadError::Reset(code)) if code.into_inner() == 0x10d),
        "reset with H3_REQUEST_INCOMPLETE, got {read:?}"
    );
    assert!(
        started.elapsed() >= Duration::from_millis(1500),
        "not before the header timeout"
    );
}

/// An HTTP/3 connection with no request is closed after the idle timeout even while
/// the client's QUIC PINGs keep the transport alive (it never was).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_h3_connection_is_closed_despite_keep_alive_pings() {
    let env = Env::new();
    let server = start(&env, "");
    let mut client = h3_client(&server, &env, 1 << 20).await;
    let got = client.fetch("GET", "/normal.bin", &[]).await;
    assert_eq!(got.status, 200);
    let closed = tokio::time::timeout(Duration::from_secs(10), client.connection().closed()).await;
    let reason = closed.expect("an idle h3 connection must close after the 3 s idle timeout");
    assert!(
        matches!(&reason, quinn::ConnectionError::ApplicationClosed(c) if c.error_code.into_inner() == 0x100),
        "closed with H3_NO_ERROR: {reason:?}"
    );
}

/// Opens and finishes `n` empty request streams on one connection, up to 200 at once.
async fn empty_streams(conn: &quinn::Connection, n: usize) {
    let mut open = tokio::task::JoinSet::new();
    for _ in 0..n {
        if open.len() >= 200 {
            open.join_next().await;
        }
        let (mut send, mut recv) = conn.open_bi().await.unwrap();
        open.spawn(async move {
            let _ = send.finish();
            // The server resets its side: wait for that, so the stream is gone.
            let mut buf = [0u8; 16];
            let _ = tokio::time::timeout(Duration::from_secs(5), recv.read(&mut buf)).await;
        });
    }
    while open.join_next().await.is_some() {}
}

/// Request streams that end before their HEADERS, opened and finished in a loop, do
/// not grow the server (h3 kept each one's id for the connection's life).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_request_streams_in_a_loop_leave_memory_flat() {
    let streams: usize = std::env::var("WEBSHIP_EMPTY_STREAMS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(100_000);
    let env = Env::new();
    let server = start(&env, "");
    let client = h3_client(&server, &env, 1 << 20).await;
    // A first round settles the allocator; the loop after it must not grow.
    empty_streams(client.connection(), 20_000).await;
    let before = footprint(&server);
    let started = Instant::now();
    empty_streams(client.connection(), streams / 2).await;
    let during = footprint(&server);
    let took = download(&env, &server).await;
    empty_streams(client.connection(), streams - streams / 2).await;
    let after = footprint(&server);
    eprintln!("{streams} empty streams in {:?}", started.elapsed());
    let grown = after.rss_kib.saturating_sub(before.rss_kib);
    assert!(
        grown < 2 * 1024,
        "{streams} empty streams grew the server by {grown} KiB"
    );
    assert!(
        client.connection().close_reason().is_none(),
        "the connection lives on"
    );
    FloodReport {
        flood: &format!("empty-stream loop ({streams} streams opened and finished)"),
        before,
        during,
        after,
        download: Some(took),
    }
    .print();
}

/// A client of a proxy site (hyper's HTTP/1.1) that stops reading a large relayed
/// body is dropped after the send timeout (it was held until the upstream's own
/// read timeout, 60 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_reader_on_hyper_h1_is_dropped_after_the_send_timeout() {
    let env = Env::new();
    let origin = webship_tests::origin::Origin::start().await;
    let (cert, key) = env.leaf("proxied", &[HOST]);
    let config = format!(
        "listen = \"127.0.0.1:{{port}}\"\nworkers = 2\n{LIMITS}\n[reverse_proxy]\nenabled = true\ntls_termination = true\n[reverse_proxy.tls]\ncert = \"{}\"\nkey = \"{}\"\n[[reverse_proxy.routes]]\ndomain = \"{HOST}\"\npath_prefix = \"/\"\nupstreams = [\"{}\"]\n",
        cert.display(),
        key.display(),
        origin.addr
    );
    let server = Server::start(env.dir.path(), &config);
    let mut conn = connect(server.addr(), HOST, env.client(b"http/1.1"))
        .await
        .unwrap();
    conn.write_all(format!("GET /bytes/{} HTTP/1.1\r\nHost: {HOST}\r\n\r\n", 256 * MIB).as_bytes())
        .await
        .unwrap();
    let mut head = [0u8; 1024];
    let n = conn.read(&mut head).await.unwrap();
    assert!(
        head[..n].starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&head[..n])
    );
    // Never read again.
    assert!(
        established_at_most(&server, 0, Duration::from_secs(10)).await,
        "a client that stopped reading must be dropped after the 2 s send timeout"
    );
    drop(conn);
}
