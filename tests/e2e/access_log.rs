//! The access log people read: the `combined` file parsed by GoAccess (a real log
//! analyser) with the totals, statuses, bytes and protocols the test sent; JSON lines
//! with the proxy's upstream; logrotate's move-and-SIGUSR1 losing no line; a reload
//! that changes the format and samples a site. (Every other daemon of the suite
//! writes a JSON log that `Server`'s drop checks.)

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use webship_tests::client::{connect, Proto};
use webship_tests::origin::Origin;
use webship_tests::server::{check_access_log, eventually, refused_port};
use webship_tests::Server;

use crate::support::{aioquic_fetch, Env, HOST};

/// How long a line may take to reach the file (the writer batches).
const WAIT: Duration = Duration::from_secs(10);

fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

fn signal(name: &str, server: &Server) {
    let status = Command::new("kill")
        .args([format!("-{name}"), server.pid().to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -{name}");
}

/// One HTTP/1.1 request written by hand (odd bytes in the target and the headers
/// the log escapes); the whole response.
async fn raw_get(env: &Env, server: &Server, target: &str, headers: &str) -> Vec<u8> {
    let mut tls = connect(server.addr(), HOST, env.client(b"http/1.1"))
        .await
        .unwrap();
    let request = format!("GET {target} HTTP/1.1\r\nHost: {HOST}\r\n{headers}Connection: close\r\n\r\n");
    tls.write_all(request.as_bytes()).await.unwrap();
    let mut all = Vec::new();
    tokio::time::timeout(WAIT, tls.read_to_end(&mut all))
        .await
        .expect("the response did not end")
        .ok();
    all
}

/// Runs GoAccess on `log` in its COMBINED format; its JSON report.
fn goaccess(log: &Path, dir: &Path) -> Value {
    let report = dir.join("goaccess.json");
    let out = Command::new("goaccess")
        .arg(log)
        .args(["--log-format=COMBINED", "--no-global-config", "-o"])
        .arg(&report)
        .output()
        .expect("goaccess is required: `cargo xtask deps` installs it");
    assert!(
        out.status.success(),
        "goaccess: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap()
}

/// h1, h2 and h3 requests of several statuses, one with a quote, a backslash and a
/// control byte where a client controls them: GoAccess reads every line as valid,
/// and its totals, statuses, bandwidth and protocols are what was sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn goaccess_reads_the_combined_log() {
    let env = Env::new();
    env.write("small.txt", b"small");
    env.write("big.bin", &vec![7u8; 100_000]);
    let log = env.dir.path().join("access.log");
    let server = env.start(&format!(
        "[log]\naccess = true\naccess_format = \"combined\"\naccess_path = \"{}\"\n",
        log.display()
    ));
    let mut sent: Vec<(u16, u64)> = Vec::new();
    for proto in [Proto::H1, Proto::H2] {
        let got = env.get(proto, &server, "/small.txt", &[]).await;
        assert_eq!(got.status, 200);
        sent.push((200, got.body.len() as u64));
        let got = env
            .get(proto, &server, "/big.bin", &[("range", "bytes=0-9")])
            .await;
        assert_eq!(got.status, 206);
        sent.push((206, got.body.len() as u64));
        let got = env.get(proto, &server, "/missing.txt", &[]).await;
        assert_eq!(got.status, 404);
        sent.push((404, got.body.len() as u64));
    }
    let (h3, line) = aioquic_fetch(server.port, HOST, "/big.bin", &env.ca_file(), &[]);
    assert_eq!(h3["status"], 200, "{line}");
    sent.push((200, 100_000));
    let odd = raw_get(
        &env,
        &server,
        "/small.txt?q=%22",
        "User-Agent: agent \"quoted\" \\ \u{fc}\r\nReferer: https://r.test/a\"b\r\n",
    )
    .await;
    assert!(
        odd.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&odd)
    );
    sent.push((200, 5));

    let n = sent.len();
    assert!(
        eventually(WAIT, || lines(&log).len() == n),
        "{n} lines expected: {:?}",
        lines(&log)
    );
    let text = lines(&log);
    let protocols: Vec<&str> = text
        .iter()
        .map(|l| l.split('"').nth(1).unwrap_or("").rsplit(' ').next().unwrap_or(""))
        .collect();
    assert_eq!(
        protocols.iter().filter(|p| **p == "HTTP/2.0").count(),
        3,
        "{text:#?}"
    );
    assert_eq!(
        protocols.iter().filter(|p| **p == "HTTP/3.0").count(),
        1,
        "{text:#?}"
    );
    let escaped = text.last().unwrap();
    assert!(
        escaped.contains(
            "\"GET /small.txt?q=%22 HTTP/1.1\" 200 5 \"https://r.test/a\\x22b\" \"agent \\x22quoted\\x22 \\x5C \\xC3\\xBC\""
        ),
        "{escaped}"
    );

    let report = goaccess(&log, env.dir.path());
    let general = &report["general"];
    assert_eq!(general["total_requests"], n as u64, "{general}");
    assert_eq!(general["valid_requests"], n as u64, "{general}");
    assert_eq!(general["failed_requests"], 0, "{general}");
    let bytes: u64 = sent.iter().map(|s| s.1).sum();
    assert_eq!(general["bandwidth"], bytes, "{general}");
    for status in [200u16, 206, 404] {
        let hits: u64 = report["status_codes"]["data"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|class| class["items"].as_array().cloned().unwrap_or_default())
            .filter(|item| {
                item["data"]
                    .as_str()
                    .unwrap_or("")
                    .starts_with(&status.to_string())
            })
            .map(|item| item["hits"]["count"].as_u64().unwrap())
            .sum();
        let expected = sent.iter().filter(|s| s.0 == status).count() as u64;
        assert_eq!(hits, expected, "status {status}: {}", report["status_codes"]);
    }
    let mut seen_protocols: Vec<String> = ["requests", "not_found"]
        .iter()
        .flat_map(|panel| report[*panel]["data"].as_array().cloned().unwrap_or_default())
        .map(|r| r["protocol"].as_str().unwrap_or("").to_owned())
        .collect();
    seen_protocols.sort_unstable();
    seen_protocols.dedup();
    assert_eq!(seen_protocols, ["HTTP/1.1", "HTTP/2", "HTTP/3"], "{report}");
}

/// A proxied exchange names the upstream and the time to its head; one whose
/// upstream refused names it with no time; both in the JSON lines the harness
/// turns on, with the right status, bytes and protocol.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_lines_name_the_upstream_and_its_time() {
    let env = Env::new();
    let origin = Origin::start().await;
    let (cert, key) = env.leaf("proxy", &["proxy.test", "dead.test"]);
    let (_refusing, dead) = refused_port().unwrap();
    let server = Server::start(
        env.dir.path(),
        &format!(
            "listen = \"127.0.0.1:{{port}}\"\nworkers = 2\n[reverse_proxy]\nenabled = true\n\
             [reverse_proxy.tls]\ncert = \"{}\"\nkey = \"{}\"\n\
             [[reverse_proxy.routes]]\ndomain = \"proxy.test\"\nupstreams = [\"{}\"]\n\
             [[reverse_proxy.routes]]\ndomain = \"dead.test\"\nupstreams = [\"127.0.0.1:{dead}\"]\n",
            cert.display(),
            key.display(),
            origin.addr
        ),
    );
    let client = |proto: Proto| env.pki.client(&[proto.alpn()]).unwrap();
    for proto in [Proto::H1, Proto::H2] {
        let got = webship_tests::client::fetch(
            proto,
            server.addr(),
            "proxy.test",
            client(proto),
            "GET",
            "/bytes/1000",
            &[],
        )
        .await;
        assert_eq!((got.status.as_u16(), got.body.len()), (200, 1000), "{proto:?}");
    }
    let got = webship_tests::client::fetch(
        Proto::H1,
        server.addr(),
        "dead.test",
        client(Proto::H1),
        "GET",
        "/x",
        &[],
    )
    .await;
    assert_eq!(got.status, 502);
    let path = server.access_log_path().unwrap().to_owned();
    let read = || check_access_log(&path).unwrap();
    assert!(eventually(WAIT, || read().len() == 3), "{:?}", read());
    let lines = read();
    for (line, protocol) in lines[..2].iter().zip(["h1", "h2"]) {
        assert_eq!(line["protocol"], protocol, "{line}");
        assert_eq!(line["status"], 200, "{line}");
        assert_eq!(line["bytes"], 1000, "{line}");
        assert_eq!(line["mode"], "proxy", "{line}");
        assert_eq!(line["site"], "proxy.test", "{line}");
        assert_eq!(line["path"], "/bytes/1000", "{line}");
        assert_eq!(line["upstream"], origin.addr.to_string(), "{line}");
        assert!(line["upstream_ms"].as_f64().is_some_and(|ms| ms >= 0.0), "{line}");
        // The exchange began before the service called the upstream.
        let (ttfb, upstream) = (
            line["ttfb_ms"].as_f64().unwrap(),
            line["upstream_ms"].as_f64().unwrap(),
        );
        assert!(
            ttfb >= upstream,
            "time to first byte {ttfb} ms < upstream {upstream} ms: {line}"
        );
        assert!(line["duration_ms"].as_f64() >= line["ttfb_ms"].as_f64(), "{line}");
        assert_eq!(line["outcome"], "complete", "{line}");
        assert_eq!(line["tls_version"], "TLSv1_3", "{line}");
        assert_eq!(line["client"], "127.0.0.1", "{line}");
    }
    let failed = &lines[2];
    assert_eq!(failed["status"], 502, "{failed}");
    assert_eq!(failed["upstream"], format!("127.0.0.1:{dead}"), "{failed}");
    assert_eq!(failed["upstream_ms"], Value::Null, "{failed}");
}

/// A client that gives up while the proxy still waits for its upstream's head (an
/// h2 connection dropped: hyper drops the service's future) is logged once, as
/// nginx logs it: status 499, and here the outcome `client_gone`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_before_the_upstream_answers_is_logged() {
    let env = Env::new();
    // Connections complete in the kernel's backlog; nothing ever answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let (cert, key) = env.leaf("proxy", &["silent.test"]);
    let server = Server::start(
        env.dir.path(),
        &format!(
            "listen = \"127.0.0.1:{{port}}\"\nworkers = 2\n[reverse_proxy]\nenabled = true\n\
             [reverse_proxy.tls]\ncert = \"{}\"\nkey = \"{}\"\n\
             [[reverse_proxy.routes]]\ndomain = \"silent.test\"\nupstreams = [\"{}\"]\n",
            cert.display(),
            key.display(),
            silent.local_addr().unwrap()
        ),
    );
    let client = env.pki.client(&[Proto::H2.alpn()]).unwrap();
    let fetch = webship_tests::client::fetch(
        Proto::H2,
        server.addr(),
        "silent.test",
        client,
        "GET",
        "/wait",
        &[],
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(1500), fetch)
            .await
            .is_err(),
        "the silent upstream answered"
    );
    let path = server.access_log_path().unwrap().to_owned();
    let read = || check_access_log(&path).unwrap();
    assert!(eventually(WAIT, || read().len() == 1), "one line: {:?}", read());
    let line = &read()[0];
    assert_eq!(line["status"], 499, "{line}");
    assert_eq!(line["outcome"], "client_gone", "{line}");
    assert_eq!(line["protocol"], "h2", "{line}");
    assert_eq!(line["path"], "/wait", "{line}");
    assert_eq!(line["bytes"], 0, "{line}");
    // From the request, not the connection: the handshake came first (CI, busy:
    // 363 ms of a 500 ms wait), so the bound leaves it most of a second.
    assert!(
        line["duration_ms"].as_f64().is_some_and(|ms| ms >= 700.0),
        "{line}"
    );
    drop(silent);
}

/// logrotate's move-and-signal: lines written before the move stay in the moved
/// file, lines after SIGUSR1 go to a new file at the path, none lost or doubled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigusr1_after_a_move_reopens_the_file() {
    let env = Env::new();
    env.write("small.txt", b"small");
    let server = env.start("");
    let path = server.access_log_path().unwrap().to_owned();
    let rotated = path.with_extension("json.1");
    for _ in 0..3 {
        assert_eq!(env.get(Proto::H1, &server, "/small.txt", &[]).await.status, 200);
    }
    assert!(eventually(WAIT, || lines(&path).len() == 3), "{:?}", lines(&path));
    std::fs::rename(&path, &rotated).unwrap();
    // Written after the move, before the signal: into the moved file.
    assert_eq!(env.get(Proto::H2, &server, "/small.txt", &[]).await.status, 200);
    assert!(
        eventually(WAIT, || lines(&rotated).len() == 4),
        "{:?}",
        lines(&rotated)
    );
    signal("USR1", &server);
    assert!(
        eventually(WAIT, || server.log().contains("SIGUSR1: access log reopened")),
        "{}",
        server.log()
    );
    assert!(path.exists(), "the path was not opened again");
    for proto in [Proto::H1, Proto::H2] {
        assert_eq!(env.get(proto, &server, "/small.txt", &[]).await.status, 200);
    }
    assert!(eventually(WAIT, || lines(&path).len() == 2), "{:?}", lines(&path));
    assert_eq!(lines(&rotated).len(), 4, "a line went to the moved file");
    assert_eq!(check_access_log(&rotated).unwrap().len(), 4);
    assert_eq!(check_access_log(&path).unwrap().len(), 2);
    // The process stays up: SIGUSR1 no longer ends it.
    assert_eq!(env.get(Proto::H1, &server, "/small.txt", &[]).await.status, 200);
}

/// A reload swaps the format and the sampling with the generation: JSON lines
/// before, `combined` after, and a site sampled at 0.5 logs one in two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_changes_the_format_and_the_sampling() {
    let env = Env::new();
    env.write("small.txt", b"small");
    let log = env.dir.path().join("mixed.log");
    let top = |format: &str| {
        format!(
            "[log]\naccess = true\naccess_format = \"{format}\"\naccess_path = \"{}\"\n",
            log.display()
        )
    };
    let server = env.start(&top("json"));
    assert_eq!(env.get(Proto::H1, &server, "/small.txt", &[]).await.status, 200);
    assert!(eventually(WAIT, || lines(&log).len() == 1), "{:?}", lines(&log));
    let config = env.dir.path().join("webship.toml");
    let text = format!(
        "{}[sites.log]\naccess_sample = 0.5\n",
        env.config(&top("combined"))
    )
    .replace("{port}", &server.port.to_string());
    std::fs::write(&config, text).unwrap();
    signal("HUP", &server);
    assert!(
        eventually(WAIT, || server.log().contains("configuration reloaded")),
        "{}",
        server.log()
    );
    for _ in 0..4 {
        assert_eq!(env.get(Proto::H2, &server, "/small.txt", &[]).await.status, 200);
    }
    assert!(eventually(WAIT, || lines(&log).len() == 3), "{:?}", lines(&log));
    // Nothing more comes: two of the four were sampled out.
    std::thread::sleep(Duration::from_millis(1500));
    let all = lines(&log);
    assert_eq!(all.len(), 3, "{all:#?}");
    let first: Value = serde_json::from_str(&all[0]).unwrap();
    assert_eq!(
        (first["status"].as_u64(), first["protocol"].as_str()),
        (Some(200), Some("h1"))
    );
    for line in &all[1..] {
        assert!(
            line.starts_with("127.0.0.1 - - [") && line.contains("\"GET /small.txt HTTP/2.0\" 200 5 \"-\""),
            "{line}"
        );
    }
}

/// A log folder only root may enter: the file is opened as root before the switch
/// and the service account's threads write to it (it becomes the account's); a
/// reload still validates; a SIGUSR1 the account cannot act on (it cannot enter the
/// folder) warns and keeps writing to the open file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_root_only_log_folder_works_for_the_service_account() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let env = Env::new();
    // The service account must reach the document root, not the logs.
    for dir in [env.dir.path(), env.root.as_path()] {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    env.write("small.txt", b"small");
    let logs = env.dir.path().join("logs");
    std::fs::create_dir(&logs).unwrap();
    std::fs::set_permissions(&logs, std::fs::Permissions::from_mode(0o700)).unwrap();
    let log = logs.join("access.log");
    let server = env.start(&format!(
        "user = \"nobody\"\ngroup = \"nogroup\"\n[kernel]\nbbr = \"off\"\n\
         [log]\naccess = true\naccess_format = \"json\"\naccess_path = \"{}\"\n",
        log.display()
    ));
    assert!(
        server.log().contains("switched to the service account"),
        "{}",
        server.log()
    );
    assert_eq!(env.get(Proto::H1, &server, "/small.txt", &[]).await.status, 200);
    assert!(eventually(WAIT, || lines(&log).len() == 1), "{}", server.log());
    assert_eq!(
        std::fs::metadata(&log).unwrap().uid(),
        65534,
        "handed to the account"
    );
    signal("HUP", &server);
    assert!(
        eventually(WAIT, || server.log().contains("configuration reloaded")),
        "a reload as the account must accept the folder it cannot enter: {}",
        server.log()
    );
    signal("USR1", &server);
    assert!(
        eventually(WAIT, || server
            .log()
            .contains("access log not reopened, still writing to the previous file")),
        "{}",
        server.log()
    );
    assert_eq!(env.get(Proto::H2, &server, "/small.txt", &[]).await.status, 200);
    assert!(eventually(WAIT, || lines(&log).len() == 2), "{:?}", lines(&log));
    assert_eq!(check_access_log(&log).unwrap().len(), 2);
}
