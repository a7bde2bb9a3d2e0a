//! HTTP/2 floods that cost a server work or memory per frame, driven by the
//! raw-frame client: rapid reset (CVE-2023-44487: streams opened and cancelled at
//! once, or as soon as the server took them) and CONTINUATION (CVE-2024-27316: a
//! header block that never ends). Each must end the attacking connection with
//! GOAWAY after a bounded number of frames, keep the server's memory bounded, and
//! leave a normal download working meanwhile. Each test prints its FLOOD line.
//! A third flood aims at the guard in front of h2 itself: stream errors it answers
//! on its own while the client reads nothing.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::ClientConfig;
use webship_testkit::h2raw::{
    code, flag, frame, headers, kind, literal, rst_stream, setting, window_update, End, H2Raw,
};
use webship_testkit::http::{fetch, Proto};
use webship_testkit::proc::{FloodReport, Footprint};

use crate::support::{h2_get, Env, HOST, MIB};

/// How long each flood runs.
const FLOOD: Duration = Duration::from_secs(3);
/// Attacking connections at a time.
const ATTACKERS: usize = 8;
/// Streams one attacking connection may open before the server must have ended it.
const STREAM_BUDGET: u32 = 5_000;
/// CONTINUATION bytes one connection may send before the server must have ended it.
const CONTINUATION_BUDGET: usize = 4 * 1024 * 1024;

/// How one attacking connection ended.
#[derive(Debug, Clone)]
struct Ended {
    end: End,
    /// Streams opened, or CONTINUATION bytes sent.
    spent: u64,
}

/// Runs `attack` on `ATTACKERS` connections at a time for `FLOOD`, a normal
/// download of 4 MiB in the middle; returns how every attacking connection ended,
/// the footprints and the download's time.
async fn flood<F, Fut>(env: &Env, server: &webship_tests::Server, name: &str, attack: F) -> Vec<Ended>
where
    F: Fn(SocketAddr, Arc<ClientConfig>) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Option<Ended>> + Send,
{
    let pid = server.pid();
    let before = Footprint::of(pid).expect("server alive");
    let stop = Arc::new(AtomicBool::new(false));
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..ATTACKERS {
        let (attack, stop, addr, tls) = (attack.clone(), stop.clone(), server.addr(), env.client(b"h2"));
        set.spawn(async move {
            let mut ends = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                match attack(addr, tls.clone()).await {
                    Some(ended) => ends.push(ended),
                    None => tokio::time::sleep(Duration::from_millis(10)).await,
                }
            }
            ends
        });
    }
    let sampler = peak_until(pid, before, stop.clone());
    tokio::time::sleep(FLOOD / 3).await;
    let started = Instant::now();
    let download = normal_download(env, server, 4 * MIB, name).await;
    tokio::time::sleep(FLOOD.saturating_sub(started.elapsed() + FLOOD / 3)).await;
    stop.store(true, Ordering::Relaxed);
    let mut ends = Vec::new();
    while let Some(joined) = set.join_next().await {
        ends.extend(joined.expect("an attacker panicked"));
    }
    let during = sampler.await.expect("sampler");
    // Connections the server ended are gone from its table shortly after.
    let after = settle(pid, before).await;
    FloodReport {
        flood: name,
        before,
        during,
        after,
        download: Some(download),
    }
    .print();
    assert!(
        during.rss_kib < before.rss_kib + 256 * 1024,
        "{name}: RSS grew from {before} to {during}"
    );
    assert!(
        after.fds <= before.fds + 4,
        "{name}: fds {before} before, {after} after"
    );
    ends
}

/// The peak of each measure of `pid`, sampled every 50 ms until `stop`.
fn peak_until(pid: u32, before: Footprint, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<Footprint> {
    tokio::spawn(async move {
        let mut peak = before;
        while !stop.load(Ordering::Relaxed) {
            if let Some(now) = Footprint::of(pid) {
                peak.rss_kib = peak.rss_kib.max(now.rss_kib);
                peak.fds = peak.fds.max(now.fds);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        peak
    })
}

/// A normal h2 download of `/big.bin` (`len` bytes) during the `name` flood: how
/// long it took.
async fn normal_download(env: &Env, server: &webship_tests::Server, len: u64, name: &str) -> Duration {
    let started = Instant::now();
    let got = fetch(
        Proto::H2,
        server.addr(),
        HOST,
        env.client(b"h2"),
        "GET",
        "/big.bin",
        &[],
    )
    .await;
    let took = started.elapsed();
    assert_eq!(
        (got.status.as_u16(), got.len),
        (200, len),
        "a normal download during the {name} flood"
    );
    took
}

/// The footprint once open fds are back near `before` (or after 5 s).
async fn settle(pid: u32, before: Footprint) -> Footprint {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let now = Footprint::of(pid).expect("server alive");
        if now.fds <= before.fds + 4 || Instant::now() > deadline {
            return now;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn start(env: &Env) -> webship_tests::Server {
    env.write("big.bin", &vec![7u8; 4 * MIB as usize]);
    env.start("[limits]\nidle_timeout_secs = 10\n")
}

/// Every attacking connection was ended by a GOAWAY with one of `codes` within
/// `budget`; `what` names the budget in the message.
fn assert_ended(ends: &[Ended], codes: &[u32], budget: u64, what: &str) {
    assert!(
        !ends.is_empty(),
        "no attacking connection was ended by the server"
    );
    for ended in ends {
        let by_goaway = matches!(ended.end, End::GoAway { code, .. } if codes.contains(&code));
        assert!(
            by_goaway && ended.spent <= budget,
            "an attacking connection ended with {} after {} {what} (want GOAWAY {} within {budget})",
            ended.end,
            ended.spent,
            codes
                .iter()
                .map(|c| code::name(*c))
                .collect::<Vec<_>>()
                .join(" or ")
        );
    }
}

/// HEADERS + RST_STREAM pairs, 50 per write, on new streams until the server ends
/// the connection. `None` when the connection could not be set up.
async fn reset_pipelined(addr: SocketAddr, tls: Arc<ClientConfig>) -> Option<Ended> {
    let mut conn = H2Raw::connect(addr, HOST, &tls).await.ok()?;
    conn.handshake(&[], Duration::from_secs(3)).await.ok()?;
    let request = h2_get("/big.bin");
    let mut stream = 1u32;
    let mut opened = 0u64;
    while opened < u64::from(STREAM_BUDGET) {
        let mut batch = Vec::new();
        for _ in 0..50 {
            batch.extend(headers(stream, &request, true));
            batch.extend(rst_stream(stream, code::CANCEL));
            stream += 2;
            opened += 1;
        }
        if conn.send(&batch).await.is_err() {
            break;
        }
        if let Some(end) = poll_goaway(&mut conn).await {
            return Some(Ended { end, spent: opened });
        }
    }
    let end = conn.until_end(Duration::from_secs(3)).await;
    Some(Ended { end, spent: opened })
}

/// One stream at a time: HEADERS, wait for the response's HEADERS (the server
/// took the stream and started on it), RST_STREAM; until the server ends it.
async fn reset_after_accept(addr: SocketAddr, tls: Arc<ClientConfig>) -> Option<Ended> {
    let mut conn = H2Raw::connect(addr, HOST, &tls).await.ok()?;
    conn.handshake(&[], Duration::from_secs(3)).await.ok()?;
    let request = h2_get("/big.bin");
    let mut stream = 1u32;
    let mut opened = 0u64;
    while opened < u64::from(STREAM_BUDGET) {
        if conn.send(&headers(stream, &request, true)).await.is_err() {
            break;
        }
        opened += 1;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
        loop {
            match conn.read_frame(deadline).await {
                Ok(Some(f)) if f.kind == kind::HEADERS && f.stream == stream => break,
                Ok(Some(f)) if f.kind == kind::GOAWAY => {
                    let code = f.error_code().unwrap_or(u32::MAX);
                    return Some(Ended {
                        end: End::GoAway { code, last_stream: 0 },
                        spent: opened,
                    });
                }
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => {
                    return Some(Ended {
                        end: End::Closed,
                        spent: opened,
                    })
                }
            }
        }
        conn.seen.clear();
        if conn.send(&rst_stream(stream, code::CANCEL)).await.is_err() {
            break;
        }
        stream += 2;
    }
    let end = conn.until_end(Duration::from_secs(3)).await;
    Some(Ended { end, spent: opened })
}

/// A GOAWAY already waiting in the socket, without blocking for one.
async fn poll_goaway(conn: &mut H2Raw) -> Option<End> {
    let deadline = tokio::time::Instant::now() + Duration::from_millis(1);
    loop {
        match conn.read_frame(deadline).await {
            Ok(Some(f)) if f.kind == kind::GOAWAY => {
                return Some(End::GoAway {
                    code: f.error_code().unwrap_or(u32::MAX),
                    last_stream: 0,
                })
            }
            Ok(Some(_)) => conn.seen.clear(),
            Ok(None) => return Some(End::Closed),
            Err(_) => return None,
        }
    }
}

/// HEADERS without END_HEADERS, then CONTINUATION frames of `chunk` bytes of
/// header fields (0: empty frames) without END_HEADERS, until the server ends it.
async fn continuation(addr: SocketAddr, tls: Arc<ClientConfig>, chunk: usize) -> Option<Ended> {
    let mut conn = H2Raw::connect(addr, HOST, &tls).await.ok()?;
    conn.handshake(&[], Duration::from_secs(3)).await.ok()?;
    if conn
        .send(&frame(kind::HEADERS, flag::END_STREAM, 1, &h2_get("/big.bin")))
        .await
        .is_err()
    {
        return None;
    }
    let mut fields = Vec::new();
    let mut i = 0;
    while fields.len() < chunk {
        literal(&mut fields, format!("x-flood-{i}").as_bytes(), &[b'v'; 100]);
        i += 1;
    }
    let one = frame(kind::CONTINUATION, 0, 1, &fields);
    let batch: Vec<u8> = one.iter().copied().cycle().take(one.len() * 16).collect();
    let mut sent = 0usize;
    while sent < CONTINUATION_BUDGET + batch.len() {
        if conn.send(&batch).await.is_err() {
            break;
        }
        sent += batch.len();
        if let Some(end) = poll_goaway(&mut conn).await {
            return Some(Ended {
                end,
                spent: sent as u64,
            });
        }
    }
    let end = conn.until_end(Duration::from_secs(3)).await;
    Some(Ended {
        end,
        spent: sent as u64,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rapid_reset_flood_is_bounded() {
    let env = Env::new();
    let server = start(&env);
    let ends = flood(
        &env,
        &server,
        "h2 rapid reset (HEADERS+RST_STREAM pipelined)",
        reset_pipelined,
    )
    .await;
    assert_ended(
        &ends,
        &[code::ENHANCE_YOUR_CALM],
        u64::from(STREAM_BUDGET),
        "streams",
    );
    let ends = flood(
        &env,
        &server,
        "h2 rapid reset (RST_STREAM after the response began)",
        reset_after_accept,
    )
    .await;
    assert_ended(
        &ends,
        &[code::ENHANCE_YOUR_CALM],
        u64::from(STREAM_BUDGET),
        "streams",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn continuation_flood_is_bounded() {
    let env = Env::new();
    let server = start(&env);
    // Large CONTINUATION frames hit the header block's byte cap, empty ones its
    // frame count; either ends the connection long before the budget.
    let codes = [
        code::ENHANCE_YOUR_CALM,
        code::COMPRESSION_ERROR,
        code::PROTOCOL_ERROR,
    ];
    let ends = flood(&env, &server, "h2 CONTINUATION (16 KB frames)", |addr, tls| {
        continuation(addr, tls, 16_000)
    })
    .await;
    assert_ended(&ends, &codes, CONTINUATION_BUDGET as u64, "CONTINUATION bytes");
    let ends = flood(&env, &server, "h2 CONTINUATION (empty frames)", |addr, tls| {
        continuation(addr, tls, 0)
    })
    .await;
    assert_ended(&ends, &codes, CONTINUATION_BUDGET as u64, "CONTINUATION bytes");
}

/// Bytes of bad PRIORITY frames one connection may send before the server must have
/// stopped taking them (by closing the connection or by not reading).
const PRIORITY_BUDGET: usize = 32 * 1024 * 1024;

/// How one not-reading PRIORITY flood ended: the bytes the server took, and what
/// reading afterwards found (GOAWAY or a close).
async fn priority_while_not_reading(addr: SocketAddr, tls: Arc<ClientConfig>) -> (usize, End) {
    let mut conn = H2Raw::connect_with(addr, HOST, &tls, Some(4096))
        .await
        .expect("connect");
    let max = (1u32 << 31) - 1;
    conn.handshake(&[(setting::INITIAL_WINDOW_SIZE, max)], Duration::from_secs(3))
        .await
        .expect("handshake");
    let mut request = window_update(0, max - 65_535);
    request.extend(headers(1, &h2_get("/big.bin"), true));
    conn.send(&request).await.expect("request");
    // The response fills the socket buffers; hyper's output stops mid-frame.
    tokio::time::sleep(Duration::from_millis(500)).await;
    // PRIORITY with a 4-byte payload on an idle stream: a FRAME_SIZE_ERROR stream
    // error the guard answers itself with RST_STREAM.
    let one = frame(kind::PRIORITY, 0, 3, &[0, 0, 0, 0]);
    let batch: Vec<u8> = one.iter().copied().cycle().take(one.len() * 4096).collect();
    let mut sent = 0;
    let deadline = Instant::now() + Duration::from_secs(20);
    while sent < PRIORITY_BUDGET && Instant::now() < deadline {
        match tokio::time::timeout(Duration::from_secs(3), conn.send(&batch)).await {
            Ok(Ok(())) => sent += batch.len(),
            // Closed, or the server stopped reading.
            Ok(Err(_)) | Err(_) => break,
        }
    }
    // Now read: the response's bytes, the guard's resets, then GOAWAY or the end.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let end = loop {
        match conn.read_frame(deadline).await {
            Ok(Some(f)) if f.kind == kind::GOAWAY => {
                break End::GoAway {
                    code: f.error_code().unwrap_or(u32::MAX),
                    last_stream: 0,
                }
            }
            Ok(Some(_)) => conn.seen.clear(),
            Ok(None) => break End::Closed,
            Err(_) => break End::TimedOut,
        }
    };
    eprintln!("bad PRIORITY flood: {sent} bytes taken, then {end}");
    (sent, end)
}

/// A client that asks for a large file and reads none of it (the server's output
/// stops mid-frame) while it sends PRIORITY frames of the wrong size, each a stream
/// error the guard answers with a RST_STREAM of its own: the server must not queue
/// those without bound, must count them (GOAWAY ENHANCE_YOUR_CALM past a limit, as
/// h2 does for its own), and must stop reading a client that takes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn guard_stream_errors_while_not_reading_are_bounded() {
    let env = Env::new();
    env.write("big.bin", &vec![7u8; 16 * MIB as usize]);
    let server = env.start("[limits]\nidle_timeout_secs = 10\nsend_timeout_secs = 30\n");
    let pid = server.pid();
    let before = Footprint::of(pid).expect("server alive");
    let attackers: Vec<_> = (0..2)
        .map(|_| tokio::spawn(priority_while_not_reading(server.addr(), env.client(b"h2"))))
        .collect();
    let done = Arc::new(AtomicBool::new(false));
    let sampler = peak_until(pid, before, done.clone());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let download = normal_download(&env, &server, 16 * MIB, "bad PRIORITY").await;
    let mut ends = Vec::new();
    for attacker in attackers {
        ends.push(attacker.await.expect("an attacker panicked"));
    }
    done.store(true, Ordering::Relaxed);
    let during = sampler.await.expect("sampler");
    let after = settle(pid, before).await;
    FloodReport {
        flood: "h2 guard stream errors (bad PRIORITY) while reading nothing",
        before,
        during,
        after,
        download: Some(download),
    }
    .print();
    assert!(
        during.rss_kib < before.rss_kib + 24 * 1024,
        "RSS grew from {before} to {during}; attackers: {ends:?}"
    );
    for (sent, end) in &ends {
        assert!(
            *sent < PRIORITY_BUDGET,
            "the server took all {sent} bytes of bad PRIORITY frames from a client reading nothing"
        );
        assert!(
            matches!(end, End::Closed | End::GoAway { code: code::ENHANCE_YOUR_CALM, .. }),
            "the attacking connection ended with {end} after {sent} bytes (want GOAWAY ENHANCE_YOUR_CALM or a close)"
        );
    }
    assert!(after.fds <= before.fds + 4, "fds {before} before, {after} after");
}
