//! WebTransport's diagnostic endpoint against aioquic (an independent QUIC, HTTP/3
//! and WebTransport implementation, driven by `tests/clients/wt_client.py`): echo,
//! sink and source with exact bytes, every limit closing the session with its code,
//! the counters that report it, and sessions that leave nothing behind.

use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use webship_tests::client::{hex, Proto};
use webship_tests::{fixture, Server, FIXTURE_LEN};

use crate::support::{h3_passthrough_front, origin_server, stats_json, Env, HOST};

const ORIGIN: &str = "https://app.test";
const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/clients/wt_client.py");

/// The endpoint's session close codes (`webtransport::Code`).
const TOO_MANY_STREAMS: u64 = 0x5701;
const CAPSULE_TOO_LARGE: u64 = 0x5702;
const DATAGRAM_TOO_LARGE: u64 = 0x5703;
const DATAGRAM_RATE: u64 = 0x5704;
const SESSION_BYTES: u64 = 0x5705;
const IDLE_TIMEOUT: u64 = 0x5706;
const BAD_COMMAND: u64 = 0x5707;
const PROTOCOL_ERROR: u64 = 0x5708;
const SHUTDOWN: u64 = 0x5709;

/// A server whose one site has the diagnostic endpoint at `/wt` with `limits`.
pub(crate) fn start_wt(env: &Env, limits: &str) -> Server {
    Server::start(
        env.dir.path(),
        &format!(
            "listen = \"127.0.0.1:{{port}}\"\nworkers = 2\n[kernel]\nebpf = \"off\"\n[[sites]]\ndomain = \"{HOST}\"\nroot = \"{}\"\n[sites.tls]\ncert = \"{}\"\nkey = \"{}\"\n[sites.webtransport]\npath = \"/wt\"\nallowed_origins = [\"{ORIGIN}\"]\n{limits}\n",
            env.root.display(),
            env.cert.display(),
            env.key.display()
        ),
    )
}

/// Runs one aioquic scenario against `addr` and returns its JSON report.
pub(crate) fn wt(
    env: &Env,
    addr: SocketAddr,
    sni: &str,
    path: &str,
    origin: &str,
    scenario: &[&str],
) -> Value {
    let out = Command::new("timeout")
        .arg("300")
        .arg("python3")
        .args([
            SCRIPT,
            &addr.ip().to_string(),
            &addr.port().to_string(),
            sni,
            path,
            env.ca_file().to_str().unwrap(),
            origin,
        ])
        .args(scenario)
        .output()
        .expect("python3 with aioquic is required; `cargo xtask test` installs it");
    assert!(
        out.status.success(),
        "aioquic {scenario:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

/// An aioquic session on `/wt` that only idles, in a thread, returned once the
/// server counts it as active.
async fn idle_session(env: &Env, server: &Server) -> std::thread::JoinHandle<std::process::Output> {
    let (port, ca) = (server.port, env.ca_file());
    let session = std::thread::spawn(move || {
        Command::new("python3")
            .args([
                SCRIPT,
                "127.0.0.1",
                &port.to_string(),
                HOST,
                "/wt",
                ca.to_str().unwrap(),
                ORIGIN,
                "idle",
            ])
            .output()
            .unwrap()
    });
    for _ in 0..200 {
        if n(&counters(env, server).await, "sessions_active") == 1 {
            return session;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the idle session never started: {}", server.log());
}

/// The endpoint's counters, from a GET on its path over HTTP/2.
async fn counters(env: &Env, server: &Server) -> Value {
    let got = env.get(Proto::H2, server, "/wt", &[]).await;
    assert_eq!(got.status, 200);
    serde_json::from_slice(&got.body).unwrap()
}

fn n(v: &Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("{key} missing in {v}"))
}

#[tokio::test]
async fn echo_sink_and_source_deliver_exact_bytes() {
    let env = Env::new();
    let server = start_wt(&env, "max_session_bytes = 1000000000");
    let at = |mode: &str| format!("/wt?mode={mode}");

    let echo = wt(
        &env,
        server.addr(),
        HOST,
        &at("echo"),
        ORIGIN,
        &["echo", "1048576", "200"],
    );
    assert_eq!(echo["status"], 200, "{echo}");
    assert_eq!(
        (n(&echo, "bidi_len"), n(&echo, "uni_len")),
        (1 << 20, 1 << 20),
        "{echo}"
    );
    assert_eq!(
        (&echo["bidi_equal"], &echo["uni_equal"]),
        (&Value::Bool(true), &Value::Bool(true))
    );
    // Datagrams are unreliable: on loopback nearly all come back; the count is the
    // loss measurement, and it must see some.
    assert!(n(&echo, "datagrams_back") > 0, "{echo}");
    println!("echo: {echo}");
    assert!(
        server
            .log()
            .contains("WebTransport session, connection switches to BBR"),
        "an accepted session moves its connection to BBR: {}",
        server.log()
    );

    let source = wt(
        &env,
        server.addr(),
        HOST,
        &at("source"),
        ORIGIN,
        &["source", &FIXTURE_LEN.to_string()],
    );
    assert_eq!(n(&source, "len"), FIXTURE_LEN, "{source}");
    assert_eq!(source["sha256"].as_str().unwrap(), hex(&fixture().sha256));
    println!("source stream: {source}");

    let datagrams = wt(
        &env,
        server.addr(),
        HOST,
        &at("source"),
        ORIGIN,
        &["source-datagrams", "500", "1000"],
    );
    assert_eq!(datagrams["reply"], "sent 500", "{datagrams}");
    assert!(n(&datagrams, "datagrams_received") > 0, "{datagrams}");
    assert_eq!(datagrams["first_payload_ok"], true, "{datagrams}");
    println!("source datagrams: {datagrams}");

    let sink = wt(
        &env,
        server.addr(),
        HOST,
        &at("sink"),
        ORIGIN,
        &["sink", "300000", "50"],
    );
    let totals = &sink["totals"];
    assert_eq!(n(totals, "stream_bytes"), 300_000, "{sink}");
    let got = n(totals, "datagrams");
    assert!((1..=50).contains(&got), "{sink}");
    assert_eq!(n(totals, "datagram_bytes"), got * 108, "{sink}");

    let c = counters(&env, &server).await;
    assert_eq!(n(&c, "sessions_accepted"), 4, "{c}");
    assert_eq!(n(&c, "closed_done"), 4, "{c}");
    assert_eq!(n(&c, "sessions_active"), 0, "{c}");
    assert!(n(&c, "stream_bytes_out") >= FIXTURE_LEN + 2 * (1 << 20), "{c}");
    assert!(n(&c, "datagrams_out") >= 500 + n(&echo, "datagrams_back"), "{c}");
}

/// A refused session is an answer the client reads over HTTP/3: the refusal's status,
/// then the end of the CONNECT stream, never a reset in its place.
#[test]
fn refusals_over_h3_are_statuses_the_client_reads() {
    let env = Env::new();
    let server = start_wt(&env, "modes = [\"echo\"]");
    for (path, origin, status) in [
        ("/wt?mode=echo", "https://evil.test", 403),
        ("/wt?mode=echo", "-", 403),
        ("/wt?mode=sink", ORIGIN, 400),
        ("/elsewhere", ORIGIN, 404),
    ] {
        let got = wt(&env, server.addr(), HOST, path, origin, &["idle"]);
        assert_eq!(got["status"], status, "{path} from {origin}: {got}");
        assert_eq!(got["session_ended"], true, "{path} from {origin}: {got}");
        assert!(got.get("session_reset").is_none(), "{path} from {origin}: {got}");
    }
}

#[tokio::test]
async fn every_limit_closes_the_session_with_its_code_and_counts_it() {
    let env = Env::new();
    let server = start_wt(
        &env,
        "modes = [\"echo\", \"source\"]\nmax_sessions = 1\nmax_streams_per_session = 3\nmax_datagram_bytes = 200\nmax_datagrams_per_sec = 50\nmax_session_bytes = 100000\nidle_timeout_secs = 2",
    );
    let run = |mode: &str, origin: &str, scenario: &[&str]| {
        wt(
            &env,
            server.addr(),
            HOST,
            &format!("/wt?mode={mode}"),
            origin,
            scenario,
        )
    };
    assert_eq!(run("echo", "https://evil.test", &["idle"])["status"], 403);
    assert_eq!(run("echo", "-", &["idle"])["status"], 403);
    assert_eq!(run("sink", ORIGIN, &["idle"])["status"], 400);

    let closed = |v: Value, code: u64| {
        assert_eq!(v["status"], 200, "{v}");
        assert_eq!(v["close_code"].as_u64(), Some(code), "{v}");
        assert!(!v["close_reason"].as_str().unwrap().is_empty(), "{v}");
        v
    };
    closed(run("echo", ORIGIN, &["streams", "5"]), TOO_MANY_STREAMS);
    closed(run("echo", ORIGIN, &["datagram", "500"]), DATAGRAM_TOO_LARGE);
    closed(run("echo", ORIGIN, &["flood", "2000"]), DATAGRAM_RATE);
    let bytes = closed(run("source", ORIGIN, &["source", "200000"]), SESSION_BYTES);
    // The stream was reset, not finished short.
    assert!(
        bytes["stream_resets"].as_array().is_some_and(|r| !r.is_empty()),
        "{bytes}"
    );
    let started = std::time::Instant::now();
    closed(run("echo", ORIGIN, &["idle"]), IDLE_TIMEOUT);
    assert!(started.elapsed() < Duration::from_secs(15));
    closed(run("source", ORIGIN, &["bad-command"]), BAD_COMMAND);

    // One session at a time: a second one is refused while the first idles.
    let first = idle_session(&env, &server).await;
    assert_eq!(run("echo", ORIGIN, &["idle"])["status"], 429);
    assert!(first.join().unwrap().status.success());

    let c = counters(&env, &server).await;
    for key in [
        "closed_too_many_streams",
        "closed_datagram_too_large",
        "closed_datagram_rate",
        "closed_session_bytes",
        "closed_bad_command",
    ] {
        assert_eq!(n(&c, key), 1, "{key}: {c}");
    }
    assert_eq!(n(&c, "closed_idle_timeout"), 2, "{c}");
    assert_eq!(
        (
            n(&c, "refused_origin"),
            n(&c, "refused_mode"),
            n(&c, "refused_capacity")
        ),
        (2, 1, 1),
        "{c}"
    );
    assert_eq!(n(&c, "sessions_active"), 0, "{c}");
}

#[tokio::test]
async fn a_hundred_sessions_leave_no_memory_behind_and_shutdown_closes_sessions() {
    let env = Env::new();
    let mut server = start_wt(&env, "max_sessions = 4\nidle_timeout_secs = 60");
    let warm = wt(&env, server.addr(), HOST, "/wt", ORIGIN, &["churn", "10"]);
    assert_eq!(n(&warm, "sessions_ok"), 10, "{warm}");
    let before = server.rss();
    let churn = wt(&env, server.addr(), HOST, "/wt", ORIGIN, &["churn", "100"]);
    assert_eq!(n(&churn, "sessions_ok"), 100, "{churn}");
    let c = counters(&env, &server).await;
    assert_eq!(
        (n(&c, "sessions_accepted"), n(&c, "closed_done")),
        (110, 110),
        "{c}"
    );
    assert_eq!(n(&c, "sessions_active"), 0, "{c}");
    let after = server.rss();
    assert!(
        after < before + 8 * 1024 * 1024,
        "RSS grew from {before} to {after} bytes over 100 sessions"
    );

    // A session open at shutdown is closed with the shutdown code.
    let open = idle_session(&env, &server).await;
    server.terminate();
    let out = open.join().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    // First asked to drain, then closed once the drain time is over.
    assert_eq!(v["drained"], true, "{v}");
    assert_eq!(v["close_code"].as_u64(), Some(SHUTDOWN), "{v}");
    assert!(server.wait_exit(Duration::from_secs(10)).is_some());
}

/// WebTransport to an origin behind HTTP/3 passthrough is just QUIC to the origin:
/// the front never decrypts, whichever engine carries the datagrams.
async fn through_passthrough(udp_engine: &str) {
    let env = Env::new();
    let origin_root = env.dir.path().join("origin");
    std::fs::create_dir(&origin_root).unwrap();
    let origin = origin_server(
        &env,
        "wt-origin",
        "a.pass",
        &origin_root,
        "[kernel]\nebpf = \"off\"\n",
        &format!("[sites.webtransport]\npath = \"/wt\"\nallowed_origins = [\"{ORIGIN}\"]\n"),
    );
    let front = h3_passthrough_front(&env, origin.addr(), udp_engine);
    let echo = wt(
        &env,
        front.addr(),
        "a.pass",
        "/wt",
        ORIGIN,
        &["echo", "1048576", "200"],
    );
    assert_eq!(echo["status"], 200, "{echo}\nFRONT:\n{}", front.log());
    assert_eq!(
        (&echo["bidi_equal"], &echo["uni_equal"]),
        (&Value::Bool(true), &Value::Bool(true)),
        "{echo}"
    );
    assert!(n(&echo, "datagrams_back") > 0, "{echo}");
    let source = wt(
        &env,
        front.addr(),
        "a.pass",
        "/wt?mode=source",
        ORIGIN,
        &["source", &FIXTURE_LEN.to_string()],
    );
    assert_eq!(n(&source, "len"), FIXTURE_LEN, "{source}");
    assert_eq!(source["sha256"].as_str().unwrap(), hex(&fixture().sha256));
    println!("{udp_engine}: echo {echo}; source {source}");
    // The front relayed both sessions as UDP flows of its own engine.
    let stats = stats_json(&format!("/sys/fs/bpf/webship-e2e-{}", front.port));
    assert_eq!(
        stats["counters"]["udp_flows"]["total"].as_u64(),
        Some(2),
        "{stats}"
    );
}

#[tokio::test]
async fn through_h3_passthrough_in_userspace() {
    through_passthrough("userspace").await;
}

#[tokio::test]
async fn through_h3_passthrough_redirected_by_ebpf() {
    through_passthrough("ebpf").await;
}

/// A WebTransport session over HTTP/2 from the `h2` crate's client: capsules out on
/// the CONNECT stream's send half, capsules in from its receive half.
struct H2Session {
    send: h2::SendStream<bytes::Bytes>,
    capsules: tokio::sync::mpsc::Receiver<(u64, bytes::Bytes)>,
    _conn: tokio::task::JoinHandle<()>,
}

impl H2Session {
    async fn open(env: &Env, server: &Server, path: &str) -> Result<Self, http::StatusCode> {
        let tls = webship_tests::client::connect(server.addr(), HOST, env.client(b"h2"))
            .await
            .unwrap();
        let (mut client, conn) = h2::client::handshake(tls).await.unwrap();
        let conn = tokio::spawn(async move {
            let _ = conn.await;
        });
        client = client.ready().await.unwrap();
        // Extended CONNECT may be used once the server's SETTINGS said so.
        for _ in 0..100 {
            if client.is_extended_connect_protocol_enabled() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(
            client.is_extended_connect_protocol_enabled(),
            "no SETTINGS_ENABLE_CONNECT_PROTOCOL"
        );
        let mut req = http::Request::builder()
            .method(http::Method::CONNECT)
            .uri(format!("https://{HOST}:{}{path}", server.port))
            .header("origin", ORIGIN)
            .body(())
            .unwrap();
        req.extensions_mut()
            .insert(h2::ext::Protocol::from_static("webtransport"));
        let (response, send) = client.send_request(req, false).unwrap();
        let response = response.await.unwrap();
        if response.status() != http::StatusCode::OK {
            return Err(response.status());
        }
        let mut body = response.into_body();
        let (tx, capsules) = tokio::sync::mpsc::channel(1024);
        let conn_reader = tokio::spawn(async move {
            let mut reader = webship::webtransport::capsule::Reader::new(1 << 20);
            while let Some(Ok(data)) = body.data().await {
                let _ = body.flow_control().release_capacity(data.len());
                reader.push(&data);
                while let Ok(Some(c)) = reader.next_capsule() {
                    if tx.send(c).await.is_err() {
                        return;
                    }
                }
            }
            drop(conn);
        });
        Ok(Self {
            send,
            capsules,
            _conn: conn_reader,
        })
    }

    /// Sends a capsule, waiting for HTTP/2 flow control to take it.
    async fn capsule(&mut self, c: bytes::Bytes) {
        let mut c = c;
        while !c.is_empty() {
            self.send.reserve_capacity(c.len());
            let granted = std::future::poll_fn(|cx| self.send.poll_capacity(cx))
                .await
                .expect("stream open")
                .unwrap();
            let part = c.split_to(granted.min(c.len()));
            self.send.send_data(part, false).unwrap();
        }
    }

    /// The next capsule, skipping the flow-control ones; `None` at the session's end.
    async fn next(&mut self) -> Option<(u64, bytes::Bytes)> {
        use webship::webtransport::capsule as c;
        loop {
            let got = tokio::time::timeout(Duration::from_secs(20), self.capsules.recv())
                .await
                .expect("a capsule within 20 s")?;
            if !matches!(
                got.0,
                c::WT_MAX_DATA | c::WT_MAX_STREAM_DATA | c::WT_MAX_STREAMS_BIDI | c::WT_MAX_STREAMS_UNI
            ) {
                return Some(got);
            }
        }
    }
}

fn wt_stream(id: u64, data: &[u8], fin: bool) -> bytes::Bytes {
    use webship::webtransport::capsule as c;
    let mut payload = bytes::BytesMut::new();
    c::put_varint(&mut payload, id);
    payload.extend_from_slice(data);
    c::encode(if fin { c::WT_STREAM_FIN } else { c::WT_STREAM }, &payload)
}

#[tokio::test]
async fn http2_sessions_echo_streams_and_datagrams_as_capsules() {
    use webship::webtransport::capsule as c;
    let env = Env::new();
    let server = start_wt(&env, "max_streams_per_session = 2\nmax_capsule_bytes = 32768");

    let mut s = H2Session::open(&env, &server, "/wt?mode=echo").await.unwrap();
    // A 1 MiB bidirectional stream, sent while its echo is read back.
    let data: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
    let mut back = Vec::new();
    let mut fin = false;
    let mut datagram = None;
    for (i, chunk) in data.chunks(16 * 1024).enumerate() {
        s.capsule(wt_stream(0, chunk, i == 63)).await;
    }
    s.capsule(c::encode(c::DATAGRAM, b"ping over h2")).await;
    // A unidirectional stream comes back on the server's first one (id 3).
    s.capsule(wt_stream(2, b"one way", true)).await;
    let mut uni = Vec::new();
    let mut uni_fin = false;
    while !(fin && uni_fin && datagram.is_some()) {
        let (kind, payload) = s.next().await.expect("session open");
        match kind {
            c::WT_STREAM | c::WT_STREAM_FIN => {
                let (id, bytes) = c::parse_stream(&payload).unwrap();
                let (buf, done) = match id {
                    0 => (&mut back, &mut fin),
                    3 => (&mut uni, &mut uni_fin),
                    other => panic!("data on stream {other}"),
                };
                buf.extend_from_slice(&bytes);
                *done |= kind == c::WT_STREAM_FIN;
            }
            c::DATAGRAM => datagram = Some(payload),
            other => panic!("unexpected capsule {other:#x}"),
        }
    }
    assert_eq!(back.len(), data.len());
    assert!(back == data, "echoed bytes differ");
    assert_eq!(uni, b"one way");
    assert_eq!(datagram.unwrap(), &b"ping over h2"[..]);
    // Streams come and go: more in sequence than may be open at once.
    for id in [4u64, 8, 12, 16] {
        s.capsule(wt_stream(id, b"again", true)).await;
        let mut got = Vec::new();
        loop {
            let (kind, payload) = s.next().await.expect("session open");
            if kind == c::DATAGRAM {
                continue;
            }
            let (sid, bytes) = c::parse_stream(&payload).unwrap();
            assert_eq!(sid, id, "capsule {kind:#x}");
            got.extend_from_slice(&bytes);
            if kind == c::WT_STREAM_FIN {
                break;
            }
        }
        assert_eq!(got, b"again");
    }
    // The client resets a stream it was sending on: the echo is reset too, not
    // finished, and the session goes on.
    s.capsule(wt_stream(20, b"half a message", false)).await;
    s.capsule(c::varints(c::WT_RESET_STREAM, &[20, 7])).await;
    loop {
        let (kind, payload) = s.next().await.expect("session open");
        assert_ne!(kind, c::WT_STREAM_FIN, "a reset stream must not end cleanly");
        if kind == c::WT_RESET_STREAM {
            assert_eq!(c::parse_stream_code(&payload).unwrap().0, 20);
            break;
        }
    }
    // A clean close: the server ends the CONNECT stream.
    s.capsule(c::close_session(0, "done")).await;
    assert!(s.next().await.is_none());

    // STOP_SENDING on a source stream stops it with a reset.
    let mut s = H2Session::open(&env, &server, "/wt?mode=source").await.unwrap();
    s.capsule(wt_stream(0, b"stream 50000000\n", true)).await;
    let (kind, _) = s.next().await.expect("source data");
    assert_eq!(kind, c::WT_STREAM);
    s.capsule(c::varints(c::WT_STOP_SENDING, &[0, 9])).await;
    loop {
        let (kind, payload) = s.next().await.expect("session open");
        assert_ne!(kind, c::WT_STREAM_FIN, "a stopped stream must not end cleanly");
        if kind == c::WT_RESET_STREAM {
            assert_eq!(c::parse_stream_code(&payload).unwrap(), (0, 9));
            break;
        }
    }
    s.capsule(c::close_session(0, "done")).await;
    // The stopped stream's receive half is stopped too: its WT_STOP_SENDING (best
    // effort, so it may be dropped) can trail the reset.
    while let Some((kind, _)) = s.next().await {
        assert_eq!(
            kind,
            c::WT_STOP_SENDING,
            "only the stream's STOP_SENDING may follow"
        );
    }

    // Three streams at once in a two-stream session: closed with the code.
    let mut s = H2Session::open(&env, &server, "/wt?mode=echo").await.unwrap();
    for id in [0, 4, 8] {
        s.capsule(wt_stream(id, b"held open", false)).await;
    }
    let close = loop {
        let (kind, payload) = s.next().await.expect("a close capsule");
        if kind == c::CLOSE_SESSION {
            break c::parse_close(&payload).unwrap();
        }
    };
    assert_eq!(u64::from(close.0), TOO_MANY_STREAMS, "{close:?}");

    // A capsule over max_capsule_bytes ends the session before it is buffered.
    let mut s = H2Session::open(&env, &server, "/wt?mode=echo").await.unwrap();
    s.capsule(wt_stream(0, &[7u8; 40_000], false)).await;
    let close = loop {
        let (kind, payload) = s.next().await.expect("a close capsule");
        if kind == c::CLOSE_SESSION {
            break c::parse_close(&payload).unwrap();
        }
    };
    assert_eq!(u64::from(close.0), CAPSULE_TOO_LARGE, "{close:?}");

    // Data on a stream id only the server may open is a protocol error.
    let mut s = H2Session::open(&env, &server, "/wt?mode=echo").await.unwrap();
    s.capsule(wt_stream(3, b"not yours", false)).await;
    let close = loop {
        let (kind, payload) = s.next().await.expect("a close capsule");
        if kind == c::CLOSE_SESSION {
            break c::parse_close(&payload).unwrap();
        }
    };
    assert_eq!(u64::from(close.0), PROTOCOL_ERROR, "{close:?}");

    // Refusals are plain statuses, as over HTTP/3.
    assert_eq!(
        H2Session::open(&env, &server, "/wt?mode=nonsense").await.err(),
        Some(http::StatusCode::BAD_REQUEST)
    );
    let c = counters(&env, &server).await;
    assert_eq!(
        (
            n(&c, "closed_done"),
            n(&c, "closed_too_many_streams"),
            n(&c, "closed_capsule_too_large"),
            n(&c, "closed_protocol_error")
        ),
        (2, 1, 1, 1),
        "{c}"
    );
    assert_eq!(n(&c, "sessions_active"), 0, "{c}");
}

/// A real browser: headless Chromium (QUIC on) opens a session with
/// `serverCertificateHashes` — an ECDSA P-256 certificate valid for under 14 days,
/// as that API requires — from an allowed page origin, and echoes a stream and a
/// datagram (`tests/clients/wt_chromium.py` drives it over WebDriver).
#[tokio::test]
async fn chromium_echoes_a_stream_and_a_datagram() {
    use sha2::Digest;
    let env = Env::new();
    let leaf = env
        .pki
        .short_lived_leaf("short", &[HOST, "localhost", "127.0.0.1"])
        .unwrap();
    let (cert_path, key_path) = (&leaf.cert, &leaf.key);
    let hash = base64(&sha2::Sha256::digest(&leaf.der));
    let page_port = webship_tests::server::free_port().unwrap();
    let server = Server::start(
        env.dir.path(),
        &format!(
            // The top-level site (any host), with the top-level [webtransport] table.
            "listen = \"127.0.0.1:{{port}}\"\nworkers = 2\nroot = \"{}\"\n[tls]\ncert = \"{}\"\nkey = \"{}\"\n[kernel]\nebpf = \"off\"\n[webtransport]\npath = \"/wt\"\nallowed_origins = [\"http://127.0.0.1:{page_port}\"]\n",
            env.root.display(),
            cert_path.display(),
            key_path.display()
        ),
    );
    let out = Command::new("timeout")
        .args([
            "180",
            "python3",
            concat!(env!("CARGO_MANIFEST_DIR"), "/clients/wt_chromium.py"),
        ])
        .arg(format!("https://127.0.0.1:{}/wt?mode=echo", server.port))
        .arg(&hash)
        .arg(page_port.to_string())
        .arg(webship_tests::server::free_port().unwrap().to_string())
        .output()
        .expect("python3 and chromium-driver are required; `cargo xtask test` installs them");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
    assert_eq!(v["ok"], true, "{v}\n{}", server.log());
    assert_eq!(v["stream"], "hello from chromium", "{v}");
    assert!(
        v["datagram"].as_str().is_some_and(|d| d.starts_with("datagram ")),
        "{v}"
    );
    let c = counters(&env, &server).await;
    assert_eq!(
        (n(&c, "sessions_accepted"), n(&c, "sessions_active")),
        (1, 0),
        "{c}"
    );
}

fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}
