//! HTTP/2 connections at rest before their first request: the daemon answers the
//! handshake itself (its SETTINGS, and the acknowledgement of the client's, each
//! sent once over the connection's life) and builds hyper's connection only when a
//! request (or anything else h2 must answer) comes; until then an idle timeout or
//! the drain closes the connection with GOAWAY, last stream 0, while a first request
//! sent just after the drain began is still answered. The conformance tables
//! (`h2_conformance`) run every case on a connection that rested after its
//! handshake, so h2 and the guard judge input first read at rest.

use std::time::{Duration, Instant};

use webship_testkit::h2raw::{code, flag, frame, headers, kind, setting, window_update, End, H2Raw};

use crate::support::{h2_get, Env, HOST};

const BODY: &[u8] = b"served after a rest\n";
/// Larger than the connection's default window (64 KiB): served whole only if the
/// WINDOW_UPDATE sent at rest took effect.
const LARGE: usize = 300 * 1024;

fn start(env: &Env, limits: &str) -> webship_tests::Server {
    env.write("rest.txt", BODY);
    env.write("large.bin", &crate::support::pattern(LARGE));
    env.start(&format!("[limits]\n{limits}\n"))
}

async fn rested(env: &Env, server: &webship_tests::Server) -> H2Raw {
    let mut conn = H2Raw::connect(server.addr(), HOST, &env.client(b"h2"))
        .await
        .unwrap();
    conn.handshake(&[(setting::INITIAL_WINDOW_SIZE, 1 << 20)], Duration::from_secs(5))
        .await
        .unwrap();
    conn
}

/// The body of `stream` as read so far.
fn body(conn: &H2Raw, stream: u32) -> Vec<u8> {
    conn.seen
        .iter()
        .filter(|f| f.kind == kind::DATA && f.stream == stream)
        .flat_map(|f| f.payload.iter().copied())
        .collect()
}

/// Whether `end` is the GOAWAY a connection at rest is closed with: NO_ERROR,
/// naming no stream.
fn closed_before_any_stream(end: &End) -> bool {
    matches!(
        end,
        End::GoAway {
            code: code::NO_ERROR,
            last_stream: 0
        }
    )
}

/// Server SETTINGS frames read so far: (without ACK, with ACK).
fn settings_frames(conn: &H2Raw) -> (usize, usize) {
    let settings = conn.seen.iter().filter(|f| f.kind == kind::SETTINGS);
    let acks = settings.clone().filter(|f| f.flags & flag::ACK != 0).count();
    (settings.count() - acks, acks)
}

/// A client that finishes its handshake and then waits is answered at once, and
/// its later requests are served over the same connection with the settings and
/// window it sent at rest (two 300 KiB bodies need its WINDOW_UPDATE):
/// the server's SETTINGS and its acknowledgement of the client's come once each
/// (what was sent at rest is not repeated by h2). A second SETTINGS from the client
/// at rest opens the connection and is acknowledged too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_at_rest_answers_its_handshake_once_and_serves_later_requests() {
    let env = Env::new();
    let server = start(&env, "idle_timeout_secs = 30");
    let mut conn = rested(&env, &server).await;
    assert_eq!(settings_frames(&conn), (1, 1), "handshake: {:?}", conn.seen);
    conn.send(&window_update(0, 15 << 20)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    for stream in [1, 3] {
        conn.send(&headers(stream, &h2_get("/large.bin"), true))
            .await
            .unwrap();
        assert!(
            conn.until_stream_end(stream, Duration::from_secs(10)).await,
            "stream {stream}: {:?}\n{}",
            conn.seen
                .iter()
                .map(|f| (f.kind, f.stream, f.payload.len()))
                .collect::<Vec<_>>(),
            server.log()
        );
        assert_eq!(conn.status(stream), Some(200));
        assert!(
            body(&conn, stream) == crate::support::pattern(LARGE),
            "stream {stream}'s body"
        );
    }
    assert!(
        conn.ping_pong(Duration::from_secs(5)).await,
        "PING after the rest"
    );
    assert_eq!(settings_frames(&conn), (1, 1), "frames: {:?}", conn.seen);

    let mut second = rested(&env, &server).await;
    second
        .send(&frame(kind::SETTINGS, 0, 0, &[0, 4, 0, 0, 0x40, 0]))
        .await
        .unwrap();
    second
        .send(&headers(1, &h2_get("/rest.txt"), true))
        .await
        .unwrap();
    assert!(
        second.until_stream_end(1, Duration::from_secs(10)).await,
        "{:?}",
        second.seen
    );
    assert_eq!(body(&second, 1), BODY);
    assert_eq!(settings_frames(&second), (1, 2), "frames: {:?}", second.seen);
}

/// With no request for `idle_timeout`, a connection at rest gets GOAWAY NO_ERROR
/// naming no stream, then the connection ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_at_rest_is_closed_with_goaway_at_the_idle_timeout() {
    let env = Env::new();
    let server = start(&env, "idle_timeout_secs = 1\nheader_read_timeout_secs = 10");
    let since = Instant::now();
    let mut conn = rested(&env, &server).await;
    let end = conn.until_end(Duration::from_secs(5)).await;
    let took = since.elapsed();
    assert!(closed_before_any_stream(&end), "{end}: {:?}", conn.seen);
    assert!(
        (Duration::from_millis(800)..Duration::from_secs(4)).contains(&took),
        "GOAWAY after {took:?} (idle timeout 1 s)"
    );
    assert!(
        conn.closes_within(Duration::from_secs(5)).await,
        "closed after the GOAWAY"
    );
}

/// Reads until `stream` ends (true), through the drain's first GOAWAY (which names
/// the last stream the server may still take, at least `stream`); false on a reset,
/// a GOAWAY refusing it, a close or after 10 s.
async fn served_through_the_drain(conn: &mut H2Raw, stream: u32) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while let Ok(Some(f)) = conn.read_frame(deadline).await {
        let last = f
            .payload
            .get(..4)
            .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) & 0x7fff_ffff);
        match f.kind {
            kind::GOAWAY if last.is_some_and(|last| last < stream) => return false,
            kind::RST_STREAM if f.stream == stream => return false,
            kind::DATA | kind::HEADERS if f.stream == stream && f.flags & flag::END_STREAM != 0 => {
                return true
            }
            _ => {}
        }
    }
    false
}

/// The drain closes a connection at rest with GOAWAY, but a first request sent
/// just after SIGTERM (a client that connected as the drain began) is answered,
/// and the daemon exits long before its grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_closes_connections_at_rest_and_answers_a_request_just_after_it() {
    let env = Env::new();
    let mut server = start(&env, "idle_timeout_secs = 30\nshutdown_grace_secs = 20");
    let mut silent = rested(&env, &server).await;
    let mut late = rested(&env, &server).await;
    let since = Instant::now();
    server.terminate();
    tokio::time::sleep(Duration::from_millis(300)).await;
    late.send(&headers(1, &h2_get("/rest.txt"), true)).await.unwrap();
    assert!(
        served_through_the_drain(&mut late, 1).await,
        "the request after SIGTERM: {:?}\n{}",
        late.seen,
        server.log()
    );
    assert_eq!(body(&late, 1), BODY);
    // Done: hyper's drain waits for its PING's answer, which this client never gives.
    drop(late);
    let end = silent.until_end(Duration::from_secs(10)).await;
    assert!(closed_before_any_stream(&end), "{end}");
    assert!(
        since.elapsed() < Duration::from_secs(5),
        "GOAWAY {:?} after SIGTERM",
        since.elapsed()
    );
    let exited = server.wait_exit(Duration::from_secs(10));
    assert!(exited.is_some_and(|s| s.success()), "{}", server.log());
    assert!(
        since.elapsed() < Duration::from_secs(8),
        "exit took {:?}",
        since.elapsed()
    );
}

/// The client's SETTINGS, read at rest, bind h2 once the connection opens: with an
/// initial stream window of 100 bytes, exactly 100 bytes of a large body come, and
/// no more until the client grants more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_settings_a_client_sent_at_rest_bind_the_server() {
    let env = Env::new();
    let server = start(&env, "idle_timeout_secs = 30");
    let mut conn = H2Raw::connect(server.addr(), HOST, &env.client(b"h2"))
        .await
        .unwrap();
    conn.handshake(&[(setting::INITIAL_WINDOW_SIZE, 100)], Duration::from_secs(5))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    conn.send(&headers(1, &h2_get("/large.bin"), true)).await.unwrap();
    assert!(
        !conn.until_stream_end(1, Duration::from_millis(1500)).await,
        "the body did not wait for the window"
    );
    assert_eq!(conn.status(1), Some(200));
    assert_eq!(body(&conn, 1).len(), 100, "DATA within a 100-byte window");
}

/// A frame left incomplete at rest opens the connection, and the guard's header
/// timeout ends it (GOAWAY PROTOCOL_ERROR) as on a connection that never rested; a
/// client whose preface stops after the magic is dropped at the handshake timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfinished_frame_or_preface_at_rest_is_cut_in_time() {
    let env = Env::new();
    let server = start(
        &env,
        "handshake_timeout_secs = 2\nheader_read_timeout_secs = 2\nidle_timeout_secs = 30",
    );
    let mut partial = rested(&env, &server).await;
    let since = Instant::now();
    partial.send(&window_update(0, 1000)[..6]).await.unwrap();
    let end = partial.until_end(Duration::from_secs(8)).await;
    assert!(
        matches!(
            end,
            End::GoAway {
                code: code::PROTOCOL_ERROR,
                ..
            }
        ),
        "{end}"
    );
    let took = since.elapsed();
    assert!(
        (Duration::from_millis(1500)..Duration::from_secs(6)).contains(&took),
        "GOAWAY {took:?} after a partial frame (header timeout 2 s)"
    );

    let mut magic_only = H2Raw::connect(server.addr(), HOST, &env.client(b"h2"))
        .await
        .unwrap();
    let since = Instant::now();
    magic_only.send(webship_testkit::h2raw::PREFACE).await.unwrap();
    assert!(
        magic_only.closes_within(Duration::from_secs(8)).await,
        "a preface without SETTINGS is closed"
    );
    let took = since.elapsed();
    assert!(
        (Duration::from_millis(1500)..Duration::from_secs(6)).contains(&took),
        "closed {took:?} after the magic (handshake timeout 2 s)"
    );
}

/// Each way a rest ends is counted as what it is: an idle close and a client that
/// goes away (with close_notify or without) as `closed`, a preface that never
/// completes as `handshake_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ways_a_rest_ends_are_counted() {
    use crate::subsystem_metrics::{admin, Scrape};
    let env = Env::new();
    let (admin_toml, admin) = admin();
    let server = start(
        &env,
        &format!("handshake_timeout_secs = 1\nidle_timeout_secs = 2\n{admin_toml}"),
    );
    let series = |reason: &str| {
        format!("webship_connections_closed_total{{transport=\"tcp\",protocol=\"h2\",reason=\"{reason}\"}}")
    };
    let idle = rested(&env, &server).await;
    let mut magic_only = H2Raw::connect(server.addr(), HOST, &env.client(b"h2"))
        .await
        .unwrap();
    magic_only.send(webship_testkit::h2raw::PREFACE).await.unwrap();
    let mut polite = rested(&env, &server).await;
    polite.close().await.unwrap();
    let abrupt = rested(&env, &server).await;
    abrupt.drop_tcp();
    let mut counted = (0.0, 0.0);
    webship_tests::server::eventually(Duration::from_secs(10), || {
        let scrape = Scrape::take(admin);
        counted = (
            scrape.get(&series("closed")).unwrap_or(0.0),
            scrape.get(&series("handshake_timeout")).unwrap_or(0.0),
        );
        counted == (3.0, 1.0)
    });
    assert_eq!(
        counted,
        (3.0, 1.0),
        "(closed, handshake_timeout); log:\n{}",
        server.log()
    );
    drop((idle, magic_only));
}
