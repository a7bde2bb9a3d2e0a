//! Zero-downtime binary upgrade: `webship serve --takeover` takes the listening
//! sockets over from the running daemon, which drains and exits. Downloads in flight
//! over h1, h2 and h3 finish byte-exact on the old process, a client connecting in a
//! tight loop throughout is never refused or reset, new connections reach the new
//! process (it serves another root, so `/which.txt` says which answered), and a
//! takeover that fails leaves the old process serving, HTTP/3 included.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use webship_testkit::body::Sink;
use webship_tests::client::{connect, fetch_h3, Collect, Conn, H3Client, H3Options, Proto, Tuning};
use webship_tests::{fixture, Server, FIXTURE_LEN};

use crate::support::{
    passthrough_config_with_control, stats_json, successor_config, take_over_with, Env, HOST, MIB,
};

/// What the test's downloads read before the takeover starts, and their pace after.
const HEAD_START: u64 = 8 * MIB;
const PACE_CHUNK: u64 = 2 * MIB;
const PACE_PAUSE: Duration = Duration::from_millis(40);

/// The old daemon's world: its config file names a root whose `which.txt` says "old".
fn old_daemon(env: &Env) -> (Server, PathBuf) {
    fixture().place(&env.root, "fixture.bin").unwrap();
    env.write("which.txt", b"old");
    let control = env.dir.path().join("control.sock");
    let extra = format!(
        "control_socket = \"{}\"\n\n[limits]\nshutdown_grace_secs = 60\nidle_timeout_secs = 5\n",
        control.display()
    );
    (env.start(&extra), control)
}

/// The new daemon's configuration: the same listen address and control socket, a
/// root of its own (`which.txt` says "new"), in `dir`.
fn new_config(env: &Env, control: &Path, dir: &Path, listen_port: u16) -> PathBuf {
    let limits = "\n[limits]\nshutdown_grace_secs = 60\n";
    successor_config(env, dir, listen_port, control, limits)
}

/// A successor to `predecessor` with [`new_config`] (in the folder returned with
/// it), once it listens and `predecessor` says it drains.
fn successor_serving(env: &Env, control: &Path, predecessor: &Server) -> (tempfile::TempDir, Server) {
    let dir = tempfile::tempdir().unwrap();
    let config = new_config(env, control, dir.path(), predecessor.port);
    let mut successor = Server::take_over(dir.path(), &config, predecessor.port);
    successor.wait_listening();
    assert!(
        webship_tests::server::eventually(Duration::from_secs(10), || predecessor
            .log()
            .contains("the new process serves; draining")),
        "{}",
        predecessor.log()
    );
    (dir, successor)
}

/// An nginx origin for the passthrough route `a.pass` serving `origin_root`, and
/// the configuration of a front that passes `a.pass` to it with the sockmap engine
/// and has a control socket (for a takeover).
fn sockmap_front(env: &Env, origin_root: &Path) -> (webship_tests::nginx::Nginx, String) {
    let (cert, key) = env.leaf("a", &["a.pass"]);
    let origin = webship_tests::nginx::Nginx::start_tls(origin_root, &cert, &key);
    let control = env.dir.path().join("control.sock");
    let sockmap = "passthrough_engine = \"sockmap\"\n";
    let config = passthrough_config_with_control(sockmap, false, &[("a.pass", origin.addr)], &control);
    (origin, config)
}

/// A download over h1 or h2 that reads [`HEAD_START`], says so, then reads the rest
/// at a pace. Returns (bytes, sha256 matches).
async fn paced_tcp(
    env: &Env,
    port: u16,
    proto: Proto,
    started: tokio::sync::mpsc::Sender<()>,
) -> (u64, bool) {
    paced_tcp_to(env.client(proto.alpn()), port, HOST, proto, started).await
}

/// The same to `sni` (a passthrough route), trusting `client`'s roots.
async fn paced_tcp_to(
    client: Arc<rustls::ClientConfig>,
    port: u16,
    sni: &str,
    proto: Proto,
    started: tokio::sync::mpsc::Sender<()>,
) -> (u64, bool) {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let tls = connect(addr, sni, client).await.unwrap();
    let mut conn = Conn::handshake(tls, proto, &format!("{sni}:{port}"), Tuning::default())
        .await
        .unwrap();
    let response = conn.send("GET", "/fixture.bin", &[], Bytes::new()).await.unwrap();
    let (parts, mut body) = response.into_parts();
    let mut sink = Collect::default();
    let (mut got, mut told, mut since) = (0u64, false, 0u64);
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else { break };
        if let Some(data) = frame.data_ref() {
            sink.update(data);
            got += data.len() as u64;
            since += data.len() as u64;
        }
        if !told && got >= HEAD_START {
            told = true;
            let _ = started.send(()).await;
        }
        if told && since >= PACE_CHUNK {
            since = 0;
            tokio::time::sleep(PACE_PAUSE).await;
        }
    }
    let fetched = sink.into_fetched(parts);
    (fetched.len, fetched.sha256 == fixture().sha256)
}

/// The same over HTTP/3.
async fn paced_h3(env: &Env, port: u16, started: tokio::sync::mpsc::Sender<()>) -> (u64, bool) {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let tls = env.client(b"h3");
    let mut client = H3Client::connect(addr, HOST, &tls, &H3Options::default())
        .await
        .unwrap();
    let (parts, mut stream) = client.send("GET", "/fixture.bin", &[]).await.unwrap();
    let mut sink = Collect::default();
    let (mut got, mut told, mut since) = (0u64, false, 0u64);
    loop {
        let chunk = match stream.recv_data().await {
            Ok(Some(chunk)) => chunk,
            Ok(None) => break,
            Err(e) => {
                eprintln!("h3 download: {e}");
                break;
            }
        };
        let mut chunk = chunk;
        while bytes::Buf::has_remaining(&chunk) {
            let data = bytes::Buf::chunk(&chunk);
            let n = data.len();
            sink.update(data);
            got += n as u64;
            since += n as u64;
            bytes::Buf::advance(&mut chunk, n);
        }
        if !told && got >= HEAD_START {
            told = true;
            let _ = started.send(()).await;
        }
        if told && since >= PACE_CHUNK {
            since = 0;
            tokio::time::sleep(PACE_PAUSE).await;
        }
    }
    let fetched = sink.into_fetched(parts);
    client.close().await;
    (fetched.len, fetched.sha256 == fixture().sha256)
}

#[derive(Default)]
struct Tally {
    attempted: AtomicU64,
    refused: AtomicU64,
    reset: AtomicU64,
    other: AtomicU64,
    old: AtomicU64,
    new: AtomicU64,
}

/// New connections in a tight, bounded loop: TCP connect, TLS, `GET /which.txt`,
/// read to the end; every failure counted by kind.
async fn connect_loop(env: Arc<Env>, port: u16, stop: Arc<AtomicBool>, tally: Arc<Tally>) {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let config = env.client(b"http/1.1");
    let request = format!("GET /which.txt HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n");
    let deadline = Instant::now() + Duration::from_secs(120);
    for _ in 0..50_000 {
        if stop.load(Ordering::SeqCst) || Instant::now() > deadline {
            break;
        }
        tally.attempted.fetch_add(1, Ordering::SeqCst);
        let outcome = async {
            let mut tls = connect(addr, HOST, config.clone()).await?;
            tls.write_all(request.as_bytes()).await?;
            let mut answer = Vec::new();
            tls.read_to_end(&mut answer).await?;
            Ok::<_, std::io::Error>(answer)
        };
        match tokio::time::timeout(Duration::from_secs(10), outcome).await {
            Ok(Ok(answer)) if answer.ends_with(b"\r\n\r\nold") => tally.old.fetch_add(1, Ordering::SeqCst),
            Ok(Ok(answer)) if answer.ends_with(b"\r\n\r\nnew") => tally.new.fetch_add(1, Ordering::SeqCst),
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                tally.refused.fetch_add(1, Ordering::SeqCst)
            }
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                tally.reset.fetch_add(1, Ordering::SeqCst)
            }
            Ok(Ok(answer)) => {
                eprintln!(
                    "connect loop: unexpected answer {:?}",
                    String::from_utf8_lossy(&answer)
                );
                tally.other.fetch_add(1, Ordering::SeqCst)
            }
            other => {
                eprintln!("connect loop: {other:?}");
                tally.other.fetch_add(1, Ordering::SeqCst)
            }
        };
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn upgrade_keeps_downloads_and_connections_and_hands_new_ones_over() {
    let env = Arc::new(Env::new());
    let (mut old, control) = old_daemon(&env);
    let port = old.port;
    let new_dir = tempfile::tempdir().unwrap();
    let config = new_config(&env, &control, new_dir.path(), port);

    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let looping = tokio::spawn(connect_loop(env.clone(), port, stop.clone(), tally.clone()));

    let (started, mut heads) = tokio::sync::mpsc::channel(8);
    let h1 = tokio::spawn({
        let (env, started) = (env.clone(), started.clone());
        async move { paced_tcp(&env, port, Proto::H1, started).await }
    });
    let h2 = tokio::spawn({
        let (env, started) = (env.clone(), started.clone());
        async move { paced_tcp(&env, port, Proto::H2, started).await }
    });
    let h3 = tokio::spawn({
        let (env, started) = (env.clone(), started.clone());
        async move { paced_h3(&env, port, started).await }
    });
    drop(started);
    for _ in 0..3 {
        tokio::time::timeout(Duration::from_secs(60), heads.recv())
            .await
            .expect("every download under way within 60 s");
    }
    assert!(
        tally.old.load(Ordering::SeqCst) > 0,
        "the loop reached the old process"
    );

    let mut new = Server::take_over(new_dir.path(), &config, port);
    new.wait_listening();
    let deadline = Instant::now() + Duration::from_secs(20);
    while tally.new.load(Ordering::SeqCst) == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        tally.new.load(Ordering::SeqCst) > 0,
        "no new connection reached the new process; its log:\n{}",
        new.log()
    );
    // A new HTTP/3 connection goes to the new process too.
    let fresh = fetch_h3(old.addr(), HOST, env.client(b"h3"), "GET", "/which.txt", &[]).await;
    assert_eq!(fresh.body, b"new", "a new h3 connection reached the old process");

    let results = [
        ("h1", h1.await.unwrap()),
        ("h2", h2.await.unwrap()),
        ("h3", h3.await.unwrap()),
    ];
    for (proto, (len, exact)) in results {
        assert!(
            len == FIXTURE_LEN && exact,
            "{proto} download across the takeover: {len} of {FIXTURE_LEN} bytes, digest exact: {exact}; old log:\n{}",
            old.log()
        );
    }
    let exit = old.wait_exit(Duration::from_secs(30));
    assert!(
        exit.is_some_and(|s| s.success()),
        "the old process did not exit cleanly once drained ({exit:?}); its log:\n{}",
        old.log()
    );
    // A moment of new-process-only traffic, then the loop stops.
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::SeqCst);
    looping.await.unwrap();
    let t = |c: &AtomicU64| c.load(Ordering::SeqCst);
    eprintln!(
        "upgrade: connections attempted {}, refused {}, reset {}, other failures {}, answered by old {}, by new {}; downloads exact 3 of 3",
        t(&tally.attempted),
        t(&tally.refused),
        t(&tally.reset),
        t(&tally.other),
        t(&tally.old),
        t(&tally.new)
    );
    assert_eq!(
        (t(&tally.refused), t(&tally.reset), t(&tally.other)),
        (0, 0, 0),
        "connections failed during the takeover"
    );
    assert!(old.log().contains("takeover: the new process serves; draining"));
    let log = new.log();
    assert!(log.contains("takeover: the previous process has exited"), "{log}");
    // The old h3 download's ACKs reached the old process through the new one.
    let forwarded: u64 = log
        .split("handed to it forwarded=")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no forwarding summary in the new log:\n{log}"));
    eprintln!("upgrade: QUIC datagrams forwarded to the old process: {forwarded}");
    assert!(forwarded > 0);
    new.terminate();
    assert!(new.wait_exit(Duration::from_secs(30)).is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_takeover_leaves_the_old_process_serving() {
    let env = Env::new();
    let (mut old, control) = old_daemon(&env);
    let port = old.port;
    // An h3 connection from before, still open across both attempts.
    let mut before = H3Client::connect(old.addr(), HOST, &env.client(b"h3"), &H3Options::default())
        .await
        .unwrap();

    // 1. Refused after the sockets were offered: another listen address.
    let dir = tempfile::tempdir().unwrap();
    let config = new_config(&env, &control, dir.path(), port + 1);
    let mut other = Server::take_over(dir.path(), &config, port);
    let status = other
        .wait_exit(Duration::from_secs(30))
        .expect("the new process ends");
    assert!(!status.success());
    assert!(
        other.log().contains("the address cannot change"),
        "{}",
        other.log()
    );

    // 2. A configuration that fails to build: a key that does not exist.
    let broken = std::fs::read_to_string(&config)
        .unwrap()
        .replace(&format!(":{}\"", port + 1), &format!(":{port}\""))
        .replace(env.key.to_str().unwrap(), "/nonexistent/key.pem");
    std::fs::write(&config, broken).unwrap();
    let mut bad = Server::take_over(dir.path(), &config, port);
    let status = bad
        .wait_exit(Duration::from_secs(30))
        .expect("the new process ends");
    assert!(!status.success(), "{}", bad.log());

    // The old process still serves everything: h1, a new h3 connection, the old one.
    let got = env.get(Proto::H1, &old, "/which.txt", &[]).await;
    assert_eq!(got.body, b"old");
    let fresh = fetch_h3(old.addr(), HOST, env.client(b"h3"), "GET", "/which.txt", &[]).await;
    assert_eq!(fresh.body, b"old");
    let again = before.fetch("GET", "/which.txt", &[]).await;
    assert_eq!(again.body, b"old");
    before.close().await;
    assert!(
        old.log().contains("takeover failed; this process keeps serving"),
        "{}",
        old.log()
    );
    assert!(old.wait_exit(Duration::from_millis(100)).is_none());
    old.terminate();
    assert!(old.wait_exit(Duration::from_secs(30)).is_some());
}

/// `counters.<name>.total` from `webship stats --json` for the pins at `pins`.
fn total(pins: &str, name: &str) -> u64 {
    let stats = stats_json(pins);
    stats["counters"][name]["total"]
        .as_u64()
        .unwrap_or_else(|| panic!("no counter {name} in {stats}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sockmap_passthrough_counters_and_links_carry_on_across_a_takeover() {
    let env = Env::new();
    let origin_root = env.dir.path().join("a");
    std::fs::create_dir(&origin_root).unwrap();
    fixture().place(&origin_root, "fixture.bin").unwrap();
    // The origin stops when the test ends.
    let (_origin, config) = sockmap_front(&env, &origin_root);
    let mut old = Server::start(env.dir.path(), &config);
    let port = old.port;
    let pins = format!("/sys/fs/bpf/webship-e2e-{port}");
    assert!(
        old.log().contains("passthrough engine engine=sockmap"),
        "{}",
        old.log()
    );

    // One whole download before, one in flight across the takeover (linked in the
    // old process's sockmap), one after through the new process.
    let (started, mut heads) = tokio::sync::mpsc::channel(1);
    let first = webship_tests::client::fetch(
        Proto::H1,
        old.addr(),
        "a.pass",
        env.client(b"http/1.1"),
        "GET",
        "/fixture.bin",
        &[],
    )
    .await;
    assert_eq!((first.len, first.sha256), (FIXTURE_LEN, fixture().sha256));
    let paced = tokio::spawn(paced_tcp_to(
        env.client(b"http/1.1"),
        port,
        "a.pass",
        Proto::H1,
        started,
    ));
    tokio::time::timeout(Duration::from_secs(60), heads.recv())
        .await
        .expect("download under way");
    let before = total(&pins, "bytes_down");
    let steered_before = total(&pins, "connections_steered");
    assert!(before >= FIXTURE_LEN, "{before}");

    let new_dir = tempfile::tempdir().unwrap();
    let mut new = take_over_with(new_dir.path(), &config, port);
    new.wait_listening();
    // No reset to zero while the old process drains.
    let during = total(&pins, "bytes_down");
    assert!(
        during >= before,
        "bytes_down went from {before} to {during} at the takeover"
    );

    let (len, exact) = paced.await.unwrap();
    assert!(
        len == FIXTURE_LEN && exact,
        "the linked download across the takeover: {len} bytes, exact {exact}"
    );
    let exit = old.wait_exit(Duration::from_secs(30));
    assert!(
        exit.is_some_and(|s| s.success()),
        "old process: {exit:?}\n{}",
        old.log()
    );
    let last = webship_tests::client::fetch(
        Proto::H1,
        new.addr(),
        "a.pass",
        env.client(b"http/1.1"),
        "GET",
        "/fixture.bin",
        &[],
    )
    .await;
    assert_eq!((last.len, last.sha256), (FIXTURE_LEN, fixture().sha256));

    // Three connections steered in all, counted once each; three fixtures went down.
    let mut steered = 0;
    let mut down = 0;
    for _ in 0..40 {
        steered = total(&pins, "connections_steered");
        down = total(&pins, "bytes_down");
        if steered == 3 && down > 3 * FIXTURE_LEN {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    eprintln!("sockmap upgrade: bytes_down {before} before, {during} at the takeover, {down} after; connections_steered {steered_before} before, {steered} after");
    assert_eq!(steered, 3, "connections counted across the takeover");
    assert!(
        down > 3 * FIXTURE_LEN && down < 3 * FIXTURE_LEN + 1_000_000,
        "{down}"
    );
    assert!(
        new.log().contains("passthrough engine engine=sockmap"),
        "{}",
        new.log()
    );
    new.terminate();
    assert!(new.wait_exit(Duration::from_secs(30)).is_some());
    assert!(
        !std::path::Path::new(&pins).exists(),
        "pins left behind after the new process stopped"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webtransport_session_keeps_echoing_across_a_takeover() {
    let env = Env::new();
    let control = env.dir.path().join("control.sock");
    let config = format!(
        "listen = \"127.0.0.1:{{port}}\"\nworkers = 2\ncontrol_socket = \"{}\"\n[kernel]\nebpf = \"off\"\n[[sites]]\ndomain = \"{HOST}\"\nroot = \"{}\"\n[sites.tls]\ncert = \"{}\"\nkey = \"{}\"\n[sites.webtransport]\npath = \"/wt\"\nallowed_origins = [\"https://app.test\"]\n",
        control.display(),
        env.root.display(),
        env.cert.display(),
        env.key.display()
    );
    let mut old = Server::start(env.dir.path(), &config);
    let port = old.port;
    let ca = env.ca_file();
    let session = std::thread::spawn(move || {
        std::process::Command::new("timeout")
            .args(["60", "python3"])
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/clients/wt_client.py"))
            .args(["127.0.0.1", &port.to_string(), HOST, "/wt", ca.to_str().unwrap()])
            .args(["https://app.test", "echo-loop", "6"])
            .output()
            .unwrap()
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let new_dir = tempfile::tempdir().unwrap();
    let mut new = take_over_with(new_dir.path(), &config, port);
    new.wait_listening();
    let out = session.join().unwrap();
    assert!(
        out.status.success(),
        "aioquic: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    eprintln!("webtransport across the takeover: {report}");
    let n = |k: &str| report[k].as_u64().unwrap_or_else(|| panic!("{k} in {report}"));
    assert_eq!(report["status"], 200, "{report}");
    assert!(n("echoes_before_drain") > 0, "{report}");
    // After the new process took the UDP socket over and the old one began to
    // drain (as at SIGTERM: DRAIN_WEBTRANSPORT_SESSION, no new streams, closed after
    // the drain time), the old session still echoed datagrams: they were forwarded.
    assert!(
        n("datagrams_echoed_while_draining") > 0,
        "{report}\nold log:\n{}",
        old.log()
    );
    assert_eq!(report["drained"], true, "{report}");
    assert_eq!(n("echoes_failed"), 0, "{report}");
    assert!(old
        .wait_exit(Duration::from_secs(30))
        .is_some_and(|s| s.success()));
    new.terminate();
    assert!(new.wait_exit(Duration::from_secs(30)).is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h3_passthrough_connection_moves_to_the_new_relay() {
    let env = Env::new();
    let origin_root = env.dir.path().join("origin");
    std::fs::create_dir(&origin_root).unwrap();
    std::fs::write(origin_root.join("who.txt"), b"origin").unwrap();
    let origin = crate::support::origin_server(&env, "quic-origin", "a.pass", &origin_root, "", "");
    let control = env.dir.path().join("control.sock");
    let udp = format!(
        "udp_upstream = \"{}\"\nudp_engine = \"userspace\"\n",
        origin.addr()
    );
    let config = passthrough_config_with_control(&udp, true, &[("a.pass", origin.addr())], &control);
    let mut old = Server::start(env.dir.path(), &config);
    let port = old.port;
    let tls = env.client(b"h3");
    let mut client = H3Client::connect(old.addr(), "a.pass", &tls, &H3Options::default())
        .await
        .unwrap();
    assert_eq!(client.fetch("GET", "/who.txt", &[]).await.body, b"origin");

    let new_dir = tempfile::tempdir().unwrap();
    let mut new = take_over_with(new_dir.path(), &config, port);
    new.wait_listening();
    // The same QUIC connection, now relayed by the new process from another port:
    // the origin sees a NAT rebinding.
    let again = tokio::time::timeout(Duration::from_secs(20), client.fetch("GET", "/who.txt", &[]))
        .await
        .unwrap_or_else(|_| panic!("the old connection stalled; new log:\n{}", new.log()));
    assert_eq!(again.body, b"origin");
    client.close().await;
    let fresh = fetch_h3(old.addr(), "a.pass", env.client(b"h3"), "GET", "/who.txt", &[]).await;
    assert_eq!(fresh.body, b"origin");
    assert!(
        old.wait_exit(Duration::from_secs(30))
            .is_some_and(|s| s.success()),
        "{}",
        old.log()
    );
    new.terminate();
    assert!(new.wait_exit(Duration::from_secs(30)).is_some());
}

/// `webship serve --config CONFIG --takeover` under strace, which holds the first
/// `recvmsg` of each of its threads (the offer's) for `hold`; its log is `NAME.log`
/// in `dir`. strace does not pass SIGTERM on: the process is killed when dropped.
fn takeover_held(config: &Path, dir: &Path, hold: Duration, name: &str) -> webship_testkit::process::Process {
    let strace = std::process::Command::new("strace").arg("-V").output();
    assert!(
        strace.is_ok_and(|o| o.status.success()),
        "strace is missing (Debian package strace; `cargo xtask deps` installs it)"
    );
    let inject = format!("inject=recvmsg:delay_enter={}:when=1", hold.as_micros());
    let mut command = std::process::Command::new("strace");
    command
        .args([
            "-f",
            "-qq",
            "-o",
            "/dev/null",
            "-e",
            "trace=recvmsg",
            "-e",
            &inject,
        ])
        .arg(webship_tests::server::binary())
        .args(["serve", "--config", config.to_str().unwrap(), "--takeover"])
        .current_dir(dir)
        .env("WEBSHIP_LOG", "info,webship=debug");
    let logs = webship_testkit::process::Logs::one(dir.join(format!("{name}.log")));
    webship_testkit::process::Process::spawn("strace webship", &mut command, logs).unwrap()
}

/// The old process waits a minute for the new one to serve, then serves again on its
/// own. A new process that says it serves only after that (here: strace holds the
/// first `recvmsg` of each of its threads, the offer's, for 65 s) stops:
/// it must not serve beside the old one on the same sockets, where the kernel would
/// split the listener's connections and the QUIC datagrams between the two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_process_the_old_one_gave_up_on_does_not_serve_beside_it() {
    let env = Env::new();
    let (mut old, control) = old_daemon(&env);
    let port = old.port;
    let dir = tempfile::tempdir().unwrap();
    let config = new_config(&env, &control, dir.path(), port);
    let mut late = takeover_held(&config, dir.path(), Duration::from_secs(65), "late");

    // The old process gives up after its minute and serves on, HTTP/3 included.
    let gave_up = Instant::now();
    assert!(
        webship_tests::server::eventually(Duration::from_secs(90), || old
            .log()
            .contains("takeover failed; this process keeps serving")),
        "old:\n{}\nnew:\n{}",
        old.log(),
        late.log()
    );
    eprintln!("the old process gave up after {:?}", gave_up.elapsed());
    let got = env.get(Proto::H1, &old, "/which.txt", &[]).await;
    assert_eq!(got.body, b"old");

    // The late one finds the old one gone from the exchange, and stops.
    let status = late
        .wait_exit(Duration::from_secs(30))
        .unwrap_or_else(|| panic!("the late process serves on:\n{}", late.log()));
    assert!(!status.success(), "{}", late.log());
    assert!(late.log().contains("takeover"), "{}", late.log());
    // The old process serves everything, on its own.
    for _ in 0..5 {
        let got = env.get(Proto::H1, &old, "/which.txt", &[]).await;
        assert_eq!(got.body, b"old");
    }
    let h3 = fetch_h3(old.addr(), HOST, env.client(b"h3"), "GET", "/which.txt", &[]).await;
    assert_eq!(h3.body, b"old");
    assert!(old.wait_exit(Duration::from_millis(100)).is_none());
    old.terminate();
    assert!(old.wait_exit(Duration::from_secs(30)).is_some());
}

/// A predecessor that stops reporting while it drains (here: SIGSTOP) is taken for
/// gone after ten silent seconds: the new process reads its UDP socket directly
/// again and accepts the next takeover, instead of waiting for it for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_predecessor_that_goes_silent_is_taken_for_gone() {
    let env = Env::new();
    let (mut old, control) = old_daemon(&env);
    let port = old.port;
    // A download that stalls keeps the old process draining (grace 60 s).
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let tls = connect(addr, HOST, env.client(b"http/1.1")).await.unwrap();
    let mut stalled = Conn::handshake(tls, Proto::H1, &format!("{HOST}:{port}"), Tuning::default())
        .await
        .unwrap();
    let response = stalled
        .send("GET", "/fixture.bin", &[], Bytes::new())
        .await
        .unwrap();
    assert_eq!(response.status(), 200);

    let (_dir, mut new) = successor_serving(&env, &control, &old);
    let stop = |signal: &str| {
        let status = std::process::Command::new("kill")
            .args([signal, &old.pid().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    };
    stop("-STOP");
    let stopped = Instant::now();
    assert!(
        webship_tests::server::eventually(Duration::from_secs(30), || new
            .log()
            .contains("the previous process stopped reporting; taken for gone")),
        "{}",
        new.log()
    );
    eprintln!(
        "a silent predecessor taken for gone after {:?}",
        stopped.elapsed()
    );
    // The next takeover is not refused as "still draining".
    let (_third_dir, mut third) = successor_serving(&env, &control, &new);
    let got = env.get(Proto::H1, &third, "/which.txt", &[]).await;
    assert_eq!(got.body, b"new");
    stop("-KILL");
    drop(stalled);
    let _ = old.wait_exit(Duration::from_secs(10));
    assert!(new.wait_exit(Duration::from_secs(60)).is_some(), "{}", new.log());
    third.terminate();
    assert!(third.wait_exit(Duration::from_secs(30)).is_some());
}

/// SIGTERM reaching the old process while it hands its sockets over does not cut
/// the handover short (which would leave the new process with sockets it may not
/// serve on, and the old one draining: nobody serving): the handover finishes
/// first (strace holds the new process's reading of the offer for 3 s, and the
/// SIGTERM comes in between), then the new process serves and the old one drains
/// and exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_takeover_lets_the_takeover_finish() {
    let env = Env::new();
    let (mut old, control) = old_daemon(&env);
    let port = old.port;
    let dir = tempfile::tempdir().unwrap();
    let config = new_config(&env, &control, dir.path(), port);
    let mut new = takeover_held(&config, dir.path(), Duration::from_secs(3), "new");
    // The old process has offered its sockets (the new one's log says it asked).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    old.terminate();

    assert!(
        webship_tests::server::eventually(Duration::from_secs(20), || new.log().contains("listening on")),
        "new:\n{}\nold:\n{}",
        new.log(),
        old.log()
    );
    let exit = old.wait_exit(Duration::from_secs(30));
    assert!(exit.is_some_and(|s| s.success()), "{exit:?}\n{}", old.log());
    assert!(
        old.log().contains("takeover: the new process serves; draining"),
        "{}",
        old.log()
    );
    // The new process serves alone, h1 and h3.
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let got = webship_tests::client::fetch(
        Proto::H1,
        addr,
        HOST,
        env.client(b"http/1.1"),
        "GET",
        "/which.txt",
        &[],
    )
    .await;
    assert_eq!(got.body, b"new", "{}", new.log());
    let h3 = fetch_h3(addr, HOST, env.client(b"h3"), "GET", "/which.txt", &[]).await;
    assert_eq!(h3.body, b"new");
    assert!(
        new.wait_exit(Duration::from_millis(100)).is_none(),
        "{}",
        new.log()
    );
    // (strace does not pass SIGTERM on: the process is killed when dropped.)
}

/// A takeover may move the pin folder (`bpf_pin_dir` is restart-only for a reload,
/// not for an upgrade): the new process pins its maps in its own folder, and the
/// old one, whose pins nobody adopted, removes them when it exits. A new process
/// without eBPF adopts nothing either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_may_move_the_pin_folder_and_leaves_no_pins_behind() {
    let env = Env::new();
    let origin_root = env.dir.path().join("a");
    std::fs::create_dir(&origin_root).unwrap();
    std::fs::write(origin_root.join("who.txt"), b"the origin").unwrap();
    // The origin stops when the test ends.
    let (_origin, config) = sockmap_front(&env, &origin_root);
    let mut old = Server::start(env.dir.path(), &config);
    let port = old.port;
    let first = format!("/sys/fs/bpf/webship-e2e-{port}");
    let second = format!("/sys/fs/bpf/webship-e2e-{port}-moved");
    assert!(
        Path::new(&first).join("counters").exists() || std::fs::read_dir(&first).is_ok_and(|d| d.count() > 0)
    );

    let moved = config
        .replace("{port}", &port.to_string())
        .replace(&format!("\"{first}\""), &format!("\"{second}\""));
    let new_dir = tempfile::tempdir().unwrap();
    let mut new = take_over_with(new_dir.path(), &moved, port);
    new.wait_listening();
    assert!(
        new.log().contains("takeover: the pin folder changes"),
        "{}",
        new.log()
    );
    let exit = old.wait_exit(Duration::from_secs(30));
    assert!(exit.is_some_and(|s| s.success()), "{}", old.log());
    // The old folder is empty (or gone); the new one has the maps `stats` reads.
    let left: Vec<_> = std::fs::read_dir(&first)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "left in {first}: {left:?}\n{}", old.log());
    let stats = stats_json(&second);
    assert!(stats.get("counters").is_some(), "{stats}");
    let got = webship_tests::client::fetch(
        Proto::H1,
        new.addr(),
        "a.pass",
        env.client(b"http/1.1"),
        "GET",
        "/who.txt",
        &[],
    )
    .await;
    assert_eq!(got.body, b"the origin");
    new.terminate();
    assert!(new
        .wait_exit(Duration::from_secs(30))
        .is_some_and(|s| s.success()));
    assert!(
        std::fs::read_dir(&second).map_or(true, |d| d.count() == 0),
        "the new process's pins stay after it stopped"
    );
}
