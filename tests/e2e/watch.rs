//! `webship stats --watch` against a running daemon with a slow large download in
//! flight: piped (not a terminal), it prints one text block per interval, or one
//! JSON object per line with `--json`, and both show the site, a sending rate above
//! zero and the download with its progress, read from the daemon's control socket.

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::BodyExt;
use serde_json::Value;
use webship_tests::client::{connect, Conn, Proto, Tuning};
use webship_tests::server::binary;

use crate::support::{Env, HOST, MIB};

/// The download: large enough to last the whole test at the client's pace.
const LEN: u64 = 96 * MIB;
const READ_BYTES_PER_SEC: u64 = 2 * MIB;

/// Reads `/big.bin` over HTTP/2 at `READ_BYTES_PER_SEC`, counting into `got`.
async fn slow_download(
    env_client: Arc<rustls::ClientConfig>,
    addr: std::net::SocketAddr,
    got: Arc<AtomicU64>,
) {
    let tls = connect(addr, HOST, env_client).await.unwrap();
    // Small windows: the server waits on this client rather than buffering ahead.
    let tuning = Tuning {
        h1_max_buffer: None,
        h2_stream_window: Some(1 << 20),
        h2_connection_window: Some(1 << 20),
        h2_max_header_list: None,
    };
    let authority = format!("{HOST}:{}", addr.port());
    let mut conn = Conn::handshake(tls, Proto::H2, &authority, tuning).await.unwrap();
    let response = conn.send("GET", "/big.bin", &[], Bytes::new()).await.unwrap();
    assert_eq!(response.status(), 200);
    let started = Instant::now();
    let mut body = response.into_body();
    while let Some(Ok(frame)) = body.frame().await {
        if let Some(data) = frame.data_ref() {
            let total = got.fetch_add(data.len() as u64, Ordering::SeqCst) + data.len() as u64;
            let due = started + Duration::from_secs_f64(total as f64 / READ_BYTES_PER_SEC as f64);
            tokio::time::sleep_until(due.into()).await;
        }
    }
}

/// Runs `webship stats --watch ARGS` with its output piped; killed if it has not
/// ended within `limit`. Its standard output and error.
fn watch(args: &[&str], limit: Duration) -> (String, String) {
    let mut child = Command::new(binary())
        .args(["stats", "--watch"])
        .args(args)
        .current_dir(Path::new("/"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        status.is_some_and(|s| s.success()),
        "`webship stats --watch {args:?}` did not end well within {limit:?} ({status:?})\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    (stdout, stderr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_shows_the_site_its_rate_and_a_slow_download_with_its_progress() {
    let env = Env::new();
    env.write("big.bin", &vec![7u8; LEN as usize]);
    let control = env.dir.path().join("control.sock");
    let server = env.start(&format!("control_socket = \"{}\"", control.display()));
    let got = Arc::new(AtomicU64::new(0));
    let download = tokio::spawn(slow_download(env.client(b"h2"), server.addr(), got.clone()));
    let deadline = Instant::now() + Duration::from_secs(20);
    while got.load(Ordering::SeqCst) < 2 * MIB {
        let got = got.load(Ordering::SeqCst);
        assert!(
            Instant::now() < deadline,
            "the download did not start: {got} bytes in 20 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let socket = control.to_str().unwrap().to_owned();
    let text = tokio::task::spawn_blocking({
        let socket = socket.clone();
        move || {
            watch(
                &["--interval", "1", "--count", "3", "--socket", &socket],
                Duration::from_secs(30),
            )
        }
    })
    .await
    .unwrap()
    .0;
    let blocks: Vec<&str> = text.split("\n\n").filter(|b| !b.trim().is_empty()).collect();
    assert_eq!(blocks.len(), 3, "one block per poll:\n{text}");
    let last = blocks[2];
    assert!(last.starts_with("webship "), "{last}");
    assert!(last.contains(&format!(" on {socket} every 1.00 s")), "{last}");
    // The site's row: its bytes sent per second (known from the second poll on).
    let site_rate = |block: &str| {
        let site = block
            .lines()
            .find(|l| l.trim_start().starts_with(HOST))
            .unwrap_or_else(|| panic!("no row for {HOST}:\n{block}"));
        let columns: Vec<&str> = site.split_whitespace().collect();
        format!("{} {}", columns[2], columns[3])
    };
    let rates: Vec<String> = blocks[1..].iter().map(|b| site_rate(b)).collect();
    assert!(rates.iter().all(|r| r.ends_with("/s")), "{rates:?}:\n{text}");
    // The client reads in bursts as it opens its window: one of the two intervals
    // at least saw bytes move.
    assert!(
        rates.iter().any(|r| !r.starts_with("0 ")),
        "the site sent nothing per second ({rates:?}):\n{text}"
    );
    let transfer = last
        .lines()
        .find(|l| l.contains("/big.bin"))
        .unwrap_or_else(|| panic!("no transfer in flight:\n{last}"));
    assert!(
        transfer
            .trim_start()
            .starts_with(&format!("{HOST} h2 127.0.0.1:")),
        "{transfer}"
    );
    assert!(transfer.contains("of 96.0 MiB"), "{transfer}");
    let percent: f64 = transfer
        .split_whitespace()
        .find_map(|w| w.strip_suffix('%'))
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no progress in {transfer}"));
    assert!(percent > 0.0 && percent < 100.0, "{transfer}");

    // Scripts: one JSON object per poll, the same figures.
    let json = tokio::task::spawn_blocking(move || {
        watch(
            &["--interval", "1", "--count", "3", "--json", "--socket", &socket],
            Duration::from_secs(30),
        )
    })
    .await
    .unwrap()
    .0;
    let lines: Vec<Value> = json
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert_eq!(lines.len(), 3, "{json}");
    let last = &lines[2];
    let transfer = &last["transfers"][0];
    assert_eq!(transfer["path"], "/big.bin", "{last}");
    assert_eq!(transfer["site"], HOST, "{last}");
    assert_eq!(transfer["total"], LEN, "{last}");
    let sent = transfer["sent"].as_u64().unwrap();
    assert!(sent > 0 && sent < LEN, "{last}");
    let site_rate = |line: &Value| {
        let sites = line["sites"].as_array().unwrap();
        let site = sites
            .iter()
            .find(|s| s["site"] == HOST)
            .unwrap_or_else(|| panic!("{line}"));
        site["bytes_sent"]["per_second"].as_f64()
    };
    let rates: Vec<Option<f64>> = lines.iter().map(site_rate).collect();
    assert_eq!(rates[0], None, "no rate from one poll: {json}");
    assert!(
        rates[1..].iter().any(|r| r.is_some_and(|r| r > 0.0)),
        "{rates:?}: {json}"
    );
    assert!(
        last["totals"]["connections_open"].as_f64().unwrap() >= 1.0,
        "{last}"
    );

    download.abort();
}

#[test]
fn a_socket_nobody_answers_on_is_an_error_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("none.sock");
    let out = webship_tests::webship(
        &["stats", "--watch", "--socket", socket.to_str().unwrap()],
        dir.path(),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("no webship answers on {}", socket.display())),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_that_goes_away_is_shown_with_its_last_figures() {
    let env = Env::new();
    let control = env.dir.path().join("control.sock");
    let mut server = env.start(&format!("control_socket = \"{}\"", control.display()));
    let socket = control.to_str().unwrap().to_owned();
    let watching = tokio::task::spawn_blocking(move || {
        watch(
            &["--interval", "1", "--count", "4", "--socket", &socket],
            Duration::from_secs(30),
        )
    });
    // The first poll is at once; the daemon goes between the first and the third.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    server.terminate();
    assert!(
        server.wait_exit(Duration::from_secs(10)).is_some(),
        "the daemon did not stop"
    );
    let (text, _) = watching.await.unwrap();
    let blocks: Vec<&str> = text.split("\n\n").filter(|b| !b.trim().is_empty()).collect();
    assert_eq!(blocks.len(), 4, "one block per poll, answered or not:\n{text}");
    assert!(!blocks[0].contains("NOT ANSWERING"), "{text}");
    let last = blocks[3];
    let warning = last
        .lines()
        .find(|l| l.starts_with("NOT ANSWERING for "))
        .unwrap_or_else(|| panic!("the last block does not say the daemon is away:\n{text}"));
    assert!(warning.contains("no webship answers on"), "{warning}");
    assert!(last.contains("  requests "), "the last figures stay:\n{last}");
}
