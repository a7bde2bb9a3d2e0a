//! Metrics and the admin listener against real peers: Debian's Prometheus scrapes two
//! daemons (files + a proxy site in front of nginx; TLS passthrough to an nginx TLS
//! origin) while h1, h2 (the test kit's clients), h3 (aioquic), proxy and
//! passthrough downloads run, and its query API must give back exactly the bytes
//! and statuses the clients saw. Then: promtool accepts the exposition and every
//! family is in docs/metrics.md; `/readyz` turns 503 in the drain after SIGTERM;
//! a remote admin address needs `allow_remote` and a token, and the token is checked.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use webship_tests::client::{fetch, Proto};
use webship_tests::nginx::Nginx;
use webship_tests::prometheus::Prometheus;
use webship_tests::server::{eventually, free_port};
use webship_tests::{webship, Server};

use crate::support::{aioquic_fetch, passthrough_toml, pattern, Env, HOST, MIB};

const PROXY_HOST: &str = "proxy.test";
const PASS_HOST: &str = "a.pass";

/// What the clients saw, per (site, proto): body bytes, and responses by class.
#[derive(Default, Debug)]
struct Seen {
    bytes: BTreeMap<(&'static str, &'static str), u64>,
    classes: BTreeMap<(&'static str, &'static str, String), u64>,
}

impl Seen {
    fn add(&mut self, site: &'static str, proto: &'static str, status: u16, len: u64) {
        *self.bytes.entry((site, proto)).or_default() += len;
        *self
            .classes
            .entry((site, proto, format!("{}xx", status / 100)))
            .or_default() += 1;
    }
}

/// `curl` GET of `http://addr/path` with `headers`: status and body.
fn admin_get(addr: SocketAddr, path: &str, headers: &[&str]) -> (u16, String) {
    let mut command = Command::new("curl");
    command.args(["--silent", "--max-time", "10", "-w", "\n%{http_code}"]);
    for h in headers {
        command.args(["-H", h]);
    }
    let out = command
        .arg(format!("http://{addr}{path}"))
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

/// Starts an HTTP/1.1 download of `/big.bin` from `addr` and reads only the first
/// bytes of its answer: the connection stays busy (a drain waits for it). The
/// connection, and what was read.
async fn held_download(env: &Env, addr: SocketAddr) -> (TlsStream<TcpStream>, [u8; 64]) {
    let mut tls = webship_tests::client::connect(addr, HOST, env.client(b"http/1.1"))
        .await
        .unwrap();
    tls.write_all(format!("GET /big.bin HTTP/1.1\r\nHost: {HOST}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut head = [0u8; 64];
    let _ = tls.read(&mut head).await.unwrap();
    (tls, head)
}

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_counts_what_the_clients_received() {
    let env = Env::new();
    env.write("big.bin", &pattern(3 * MIB as usize + 17));
    env.write("small.txt", b"a small file for the metrics test\n");
    // The proxy site's origin (plain HTTP nginx), and the passthrough origin (nginx
    // with a.pass's certificate, which only it holds).
    let origin_root = env.dir.path().join("origin");
    std::fs::create_dir(&origin_root).unwrap();
    std::fs::write(origin_root.join("proxied.bin"), pattern(MIB as usize + 3)).unwrap();
    std::fs::write(origin_root.join("pass.bin"), pattern(2 * MIB as usize + 5)).unwrap();
    let nginx = Nginx::start(&origin_root);
    let (pass_cert, pass_key) = env.leaf("a", &[PASS_HOST]);
    let tls_origin = Nginx::start_tls(&origin_root, &pass_cert, &pass_key);

    let (proxy_cert, proxy_key) = env.leaf("proxy", &[PROXY_HOST]);
    let admin_a = loopback(free_port().unwrap());
    let front = env.start(&format!(
        "[admin]\nlisten = \"{admin_a}\"\n\n[reverse_proxy]\nenabled = true\ntls_termination = true\n\
         [reverse_proxy.tls]\ncert = \"{}\"\nkey = \"{}\"\n\
         [[reverse_proxy.routes]]\ndomain = \"{PROXY_HOST}\"\npath_prefix = \"/\"\nupstreams = [\"{}\"]\n",
        proxy_cert.display(),
        proxy_key.display(),
        nginx.addr
    ));
    let pass_dir = env.dir.path().join("pass");
    std::fs::create_dir(&pass_dir).unwrap();
    let admin_b = loopback(free_port().unwrap());
    let pass = Server::start(
        &pass_dir,
        &format!(
            "listen = \"127.0.0.1:{{port}}\"\nworkers = 2\n[admin]\nlisten = \"{admin_b}\"\n{}",
            passthrough_toml(
                "passthrough_engine = \"splice\"\n",
                false,
                &[(PASS_HOST, tls_origin.addr)]
            )
        ),
    );
    let prometheus = Prometheus::start(&[admin_a, admin_b]);

    let mut seen = Seen::default();
    for (proto, label) in [(Proto::H1, "h1"), (Proto::H2, "h2")] {
        for path in ["/big.bin", "/small.txt", "/big.bin", "/missing"] {
            let got = env.get(proto, &front, path, &[]).await;
            seen.add(HOST, label, got.status.as_u16(), got.len);
        }
        for path in ["/proxied.bin", "/nope"] {
            let client = env.client(proto.alpn());
            let got = fetch(proto, front.addr(), PROXY_HOST, client, "GET", path, &[]).await;
            seen.add(PROXY_HOST, label, got.status.as_u16(), got.len);
        }
    }
    let ca = env.ca_file();
    for (host, path) in [
        (HOST, "/big.bin"),
        (HOST, "/missing"),
        (PROXY_HOST, "/proxied.bin"),
    ] {
        let (got, line) = aioquic_fetch(front.port, host, path, &ca, &[]);
        let status = got["status"].as_u64().unwrap_or_else(|| panic!("{line}"));
        seen.add(host, "h3", status as u16, got["len"].as_u64().unwrap());
    }
    let pass_received = passthrough_download(&env, pass.addr()).await;

    // Every record is reported when its body ends, which is when the client has
    // read it: one scrape of each daemon after now sees them all.
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(
        prometheus.wait_scraped_after(now + 0.5, 2, Duration::from_secs(30)),
        "no scrape of both targets after the downloads; Prometheus log:\n{}",
        prometheus.log()
    );

    let mut report = Vec::new();
    for ((site, proto), bytes) in &seen.bytes {
        let query =
            format!("sum(webship_http_response_body_bytes_total{{site=\"{site}\",proto=\"{proto}\"}})");
        let got = prometheus.value(&query);
        report.push(format!("{query} = {got} (clients: {bytes})"));
        assert_eq!(got, *bytes as f64, "{query}\n{}", report.join("\n"));
    }
    for ((site, proto, code), count) in &seen.classes {
        let query =
            format!("sum(webship_http_responses_total{{site=\"{site}\",proto=\"{proto}\",code=\"{code}\"}})");
        let got = prometheus.value(&query);
        report.push(format!("{query} = {got} (clients: {count})"));
        assert_eq!(got, *count as f64, "{query}\n{}", report.join("\n"));
    }
    let modes = [(HOST, "files"), (PROXY_HOST, "proxy")];
    for (site, mode) in modes {
        let query = format!("sum(webship_http_requests_total{{site=\"{site}\"}}) - sum(webship_http_requests_total{{site=\"{site}\",mode=\"{mode}\"}})");
        assert_eq!(
            prometheus.value(&query),
            0.0,
            "every {site} request is {mode}: {query}"
        );
    }
    let in_flight = prometheus.value("sum(webship_http_requests_in_flight)");
    assert_eq!(in_flight, 0.0, "nothing in flight once the clients are done");
    let query = "sum(webship_passthrough_bytes_total{direction=\"down\"})";
    let down = prometheus.value(query);
    report.push(format!(
        "{query} = {down} (client read {pass_received} bytes off its socket)"
    ));
    assert_eq!(down, pass_received as f64, "{}", report.join("\n"));
    let steered = prometheus.value("sum(webship_passthrough_connections_total)");
    assert_eq!(steered, 1.0, "one passthrough connection");
    let quic = prometheus.value("sum(webship_connections_accepted_total{transport=\"quic\"})");
    assert_eq!(quic, 3.0, "three aioquic connections");
    // The harness's readiness probe connected once more, and closed without TLS.
    let tcp = prometheus.value(&format!(
        "sum(webship_connections_closed_total{{transport=\"tcp\",protocol=~\"h1|h2\",instance=\"{admin_a}\"}})"
    ));
    assert_eq!(tcp, 12.0, "one TCP connection per h1/h2 fetch, closed");
    let pass_closes = prometheus.value(&format!(
        "sum(webship_connections_closed_total{{protocol=\"passthrough\",instance=\"{admin_b}\"}})"
    ));
    assert_eq!(pass_closes, 1.0);
    // Received: every h1/h2 connection sent at least its ClientHello and a request;
    // every QUIC connection its Initial packets (at least 1200 bytes each).
    for (transport, at_least) in [("tcp", 12.0 * 300.0), ("quic", 3.0 * 1200.0)] {
        let query = format!(
            "webship_connection_received_bytes_total{{transport=\"{transport}\",instance=\"{admin_a}\"}}"
        );
        let received = prometheus.value(&query);
        report.push(format!("{query} = {received}"));
        assert!(
            received >= at_least,
            "{query} = {received}, expected at least {at_least}"
        );
    }
    eprintln!("Prometheus query results:\n{}", report.join("\n"));

    // The text format: promtool's linter accepts it, and docs/metrics.md names every
    // family of both daemons (the collectors' too).
    let docs = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/metrics.md")).unwrap();
    for admin in [admin_a, admin_b] {
        let (status, text) = admin_get(admin, "/metrics", &[]);
        assert_eq!(status, 200, "{text}");
        check_with_promtool(&text);
        for name in text.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
            let name = name.split_whitespace().next().unwrap();
            assert!(
                docs.contains(&format!("`{name}`")),
                "{name} is not in docs/metrics.md"
            );
        }
        let excerpt: Vec<&str> = text
            .lines()
            .filter(|l| {
                l.contains("files.test\",proto=\"h2\"") && !l.contains("_bucket")
                    || l.starts_with("webship_passthrough_bytes")
            })
            .collect();
        eprintln!("scrape excerpt from {admin}:\n{}", excerpt.join("\n"));
    }
    let (status, text) = admin_get(
        admin_a,
        "/metrics",
        &["Accept: application/openmetrics-text; version=1.0.0"],
    );
    assert_eq!(status, 200);
    assert!(text.ends_with("# EOF\n"), "OpenMetrics ends with # EOF");
    assert!(text.contains("# TYPE webship_http_responses counter\n"), "{text}");
}

/// Runs promtool's `check metrics` (the Prometheus text format's linter) on `text`.
fn check_with_promtool(text: &str) {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool (Debian package prometheus)");
    use std::io::Write;
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics:\n{}{}\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A TCP stream that counts the bytes read off it.
struct Counting {
    inner: TcpStream,
    read: Arc<AtomicU64>,
}

impl AsyncRead for Counting {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        let n = (buf.filled().len() - before) as u64;
        self.read.fetch_add(n, Ordering::Relaxed);
        polled
    }
}

impl AsyncWrite for Counting {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Downloads pass.bin through the passthrough front with `Connection: close`, TLS
/// with the origin itself, and reads the socket to its end: returns every byte the
/// client received (TLS records included), what the front relayed down.
async fn passthrough_download(env: &Env, front: SocketAddr) -> u64 {
    let read = Arc::new(AtomicU64::new(0));
    let tcp = TcpStream::connect(front).await.unwrap();
    let counting = Counting {
        inner: tcp,
        read: read.clone(),
    };
    let mut tls = webship_testkit::http::tls(counting, PASS_HOST, env.client(b"http/1.1"))
        .await
        .unwrap();
    tls.write_all(
        format!("GET /pass.bin HTTP/1.1\r\nHost: {PASS_HOST}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut response = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(30), tls.read_to_end(&mut response)).await;
    assert!(
        response.starts_with(b"HTTP/1.1 200") && response.len() > 2 * MIB as usize + 5,
        "passthrough download: {:?}",
        String::from_utf8_lossy(&response[..response.len().min(200)])
    );
    // Whatever follows the origin's close_notify (nothing, or its FIN) is read too.
    let (mut counting, _) = tls.into_inner();
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), counting.read_to_end(&mut rest)).await;
    read.load(Ordering::Relaxed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_turns_unready_in_the_drain_and_the_control_socket_answers_metrics() {
    let env = Env::new();
    env.write("big.bin", &pattern(64 * MIB as usize));
    let admin = loopback(free_port().unwrap());
    let control = env.dir.path().join("control.sock");
    let mut server = env.start(&format!(
        "control_socket = \"{}\"\n[limits]\nshutdown_grace_secs = 8\n[admin]\nlisten = \"{admin}\"\n",
        control.display()
    ));
    assert_eq!(admin_get(admin, "/readyz", &[]).0, 200);
    assert_eq!(admin_get(admin, "/healthz", &[]).0, 200);
    let reply = webship::control::call(
        &control,
        &webship::control::Request::Metrics,
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    assert!(
        reply.ok && reply.message.contains("webship_build_info{version="),
        "{reply:?}"
    );

    // A download the client does not read keeps the drain going.
    let (tls, head) = held_download(&env, server.addr()).await;
    assert!(head.starts_with(b"HTTP/1.1 200"));
    server.terminate();
    let unready = eventually(Duration::from_secs(5), || {
        admin_get(admin, "/readyz", &[]).0 == 503
    });
    assert!(
        unready,
        "/readyz still answers 200 in the drain; log:\n{}",
        server.log()
    );
    assert_eq!(admin_get(admin, "/healthz", &[]).0, 200, "alive while draining");
    let (_, metrics) = admin_get(admin, "/metrics", &[]);
    assert!(metrics.contains("\nwebship_ready 0\n"), "{metrics}");
    assert!(
        metrics.contains("webship_http_requests_in_flight{site=\"files.test\",proto=\"h1\"} 1\n"),
        "{metrics}"
    );
    drop(tls);
    assert!(
        server.wait_exit(Duration::from_secs(20)).is_some(),
        "the drain ended"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_admin_listener_needs_allow_remote_and_a_token() {
    let env = Env::new();
    let port = free_port().unwrap();
    let check = |admin: &str| {
        let path = env.dir.path().join("check.toml");
        std::fs::write(&path, env.config(admin).replace("{port}", &port.to_string())).unwrap();
        webship(&["check", "--config", path.to_str().unwrap()], env.dir.path())
    };
    let admin_port = free_port().unwrap();
    let out = check(&format!("[admin]\nlisten = \"0.0.0.0:{admin_port}\"\n"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a remote admin address without allow_remote passed check"
    );
    assert!(
        stderr.contains("admin.listen") && stderr.contains("not a loopback address"),
        "{stderr}"
    );
    let out = check(&format!(
        "[admin]\nlisten = \"0.0.0.0:{admin_port}\"\nallow_remote = true\n"
    ));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "allow_remote without a token passed check");
    assert!(stderr.contains("admin.allow_remote"), "{stderr}");
    let token = "s3cret-token-for-the-admin-listener";
    let token_file = env.dir.path().join("admin.token");
    std::fs::write(&token_file, format!("{token}\n")).unwrap();
    let with_token = format!(
        "[admin]\nlisten = \"0.0.0.0:{admin_port}\"\nallow_remote = true\ntoken_file = \"{}\"\n",
        token_file.display()
    );
    let out = check(&with_token);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    // Served on loopback with the token: nothing without it.
    let admin = loopback(admin_port);
    let _server = env.start(&with_token.replace("0.0.0.0", "127.0.0.1"));
    let (status, body) = admin_get(admin, "/metrics", &[]);
    assert_eq!(status, 401, "{body}");
    assert_eq!(
        admin_get(
            admin,
            "/readyz",
            &["Authorization: Bearer wrong-token-wrong-token"]
        )
        .0,
        401
    );
    let (status, body) = admin_get(admin, "/metrics", &[&format!("Authorization: Bearer {token}")]);
    assert_eq!(status, 200);
    assert!(body.contains("webship_build_info"), "{body}");
    let post = Command::new("curl")
        .args(["--silent", "-o", "/dev/null", "-w", "%{http_code}", "-X", "POST"])
        .args(["-H", &format!("Authorization: Bearer {token}")])
        .arg(format!("http://{admin}/metrics"))
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&post.stdout), "405");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_takeover_the_new_process_answers_on_the_admin_address() {
    let env = Env::new();
    env.write("big.bin", &pattern(64 * MIB as usize));
    let admin = loopback(free_port().unwrap());
    let control = env.dir.path().join("control.sock");
    let extra = format!(
        "control_socket = \"{}\"\n[limits]\nshutdown_grace_secs = 20\n[admin]\nlisten = \"{admin}\"\n",
        control.display()
    );
    let mut old = env.start(&extra);
    // A download the client does not read keeps the old process draining.
    let (tls, _head) = held_download(&env, old.addr()).await;
    let (_, before) = admin_get(admin, "/metrics", &[]);
    assert!(
        before.contains("webship_http_requests_total{site=\"files.test\",proto=\"h1\",mode=\"files\"} 1\n"),
        "{before}"
    );

    let new_dir = tempfile::tempdir().unwrap();
    let new_config = new_dir.path().join("webship.toml");
    std::fs::write(
        &new_config,
        env.config(&extra).replace("{port}", &old.port.to_string()),
    )
    .unwrap();
    let mut new = Server::take_over(new_dir.path(), &new_config, old.port);
    new.wait_listening();
    // The old process, still draining, closed its admin listener at the handover: every
    // answer now is the new one's (ready, and none of the old one's requests).
    let handed = eventually(Duration::from_secs(10), || {
        admin_get(admin, "/metrics", &[])
            .1
            .contains("webship_config_generation 1\n")
            && !admin_get(admin, "/metrics", &[])
                .1
                .contains("webship_http_requests_total{")
    });
    assert!(
        handed,
        "the admin address still reaches the old process; new log:\n{}",
        new.log()
    );
    for _ in 0..10 {
        assert_eq!(admin_get(admin, "/readyz", &[]).0, 200, "old log:\n{}", old.log());
    }
    assert!(
        old.wait_exit(Duration::from_millis(100)).is_none(),
        "the old process drains still"
    );
    drop(tls);
    assert!(old
        .wait_exit(Duration::from_secs(30))
        .is_some_and(|s| s.success()));
    new.terminate();
    assert!(new.wait_exit(Duration::from_secs(30)).is_some());
}
