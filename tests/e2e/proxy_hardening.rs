//! The reverse proxy against attacking clients and lying origins (issue #15, items
//! 7, 9, 10, 11, 12): filters that see the path the origin sees, forwarding headers
//! a client cannot forge, response framing an origin cannot split, bounded upstream
//! concurrency, and timeouts that blame the right side. Origins: Debian's nginx, the
//! programmable Rust origin, and raw TCP origins scripted here.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use webship_testkit::proc::{established, End, FloodReport, Footprint};
use webship_testkit::process::Task;
use webship_tests::client::{connect, outcome, raw_h1, raw_status, Conn, Proto, Tuning};
use webship_tests::nginx::Nginx;
use webship_tests::origin::Origin;
use webship_tests::server::eventually;
use webship_tests::Server;

use crate::support::Env;

const HOST: &str = "proxy.test";

/// A proxy for `HOST` (plus `*.example.test`) with `routes` (TOML) and `extra` TOML
/// inside `[reverse_proxy]`.
fn proxy(env: &Env, extra: &str, routes: &str) -> Server {
    let (cert, key) = env.leaf("proxy", &[HOST, "*.example.test"]);
    Server::start(
        env.dir.path(),
        &format!(
            "listen = \"127.0.0.1:{{port}}\"\nworkers = 2\n[limits]\nsend_timeout_secs = 3\n\n[reverse_proxy]\nenabled = true\n{extra}\n[reverse_proxy.tls]\ncert = \"{}\"\nkey = \"{}\"\n{routes}\n",
            cert.display(),
            key.display()
        ),
    )
}

fn route(domain: &str, prefix: &str, upstreams: &[SocketAddr], more: &str) -> String {
    let ups: Vec<String> = upstreams.iter().map(|u| format!("\"{u}\"")).collect();
    format!(
        "\n[[reverse_proxy.routes]]\ndomain = \"{domain}\"\npath_prefix = \"{prefix}\"\nupstreams = [{}]\n{more}\n",
        ups.join(", ")
    )
}

/// One raw HTTP/1.1 request for `host` with `path` on a fresh TLS connection
/// (`Connection: close`): the status and the whole answer.
async fn raw_get(
    env: &Env,
    server: &Server,
    sni: &str,
    host: &str,
    path: &str,
    extra: &str,
) -> (u16, String) {
    let request = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\n{extra}Connection: close\r\n\r\n");
    let out = raw_h1(server.addr(), sni, env.client(b"http/1.1"), request.as_bytes()).await;
    let text = String::from_utf8_lossy(&out).into_owned();
    (raw_status(&out), text)
}

// ---- item 9: deny_paths and routes see the normal form -------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deny_paths_cannot_be_bypassed_by_another_spelling_of_the_path() {
    let env = Env::new();
    env.write("admin.txt", b"secret");
    env.write("index.php", b"<?php source");
    env.write("ok.txt", b"fine");
    let nginx = Nginx::start(&env.root);
    let origin = Origin::start().await;
    let routes = route(HOST, "/", &[nginx.addr], "deny_paths = [\"/admin*\", \"*.php\"]")
        + &route(HOST, "/echo-route/", &[origin.addr], "strip_prefix = true");
    let server = proxy(&env, "", &routes);

    let denied = [
        "/admin.txt",
        "/%61dmin.txt",
        "//admin.txt",
        "/./admin.txt",
        "/x/../admin.txt",
        "/ADMIN.txt",
        "/Admin.txt",
        "/index.php",
        "/index.php/x",
        "/index.ph%70",
        "/index.PHP",
    ];
    for path in denied {
        let (status, text) = raw_get(&env, &server, HOST, HOST, path, "").await;
        assert_eq!(status, 403, "{path} was not denied: {text}");
    }
    // The h2 front hands hyper's :path to the same normalization.
    let tls = connect(server.addr(), HOST, env.client(b"h2")).await.unwrap();
    let mut h2 = Conn::handshake(
        tls,
        Proto::H2,
        &format!("{HOST}:{}", server.port),
        Tuning::default(),
    )
    .await
    .unwrap();
    for path in ["/%61dmin.txt", "/x/../admin.txt", "/index.ph%70"] {
        let got = outcome(h2.send("GET", path, &[], Bytes::new()).await.unwrap()).await;
        assert_eq!(got.status, 403, "h2 {path}");
    }
    let unnormalizable = [
        "/%2e%2e/admin.txt",
        "/../admin.txt",
        "/x/../../admin.txt",
        "/a%2Fb",
        "/a%2fadmin.txt",
        "/a%5Cb",
        "/a%00b",
        "/%ff.txt",
        "/%zz",
        "/x/..;/admin.txt",
    ];
    for path in unnormalizable {
        let (status, text) = raw_get(&env, &server, HOST, HOST, path, "").await;
        assert_eq!(status, 400, "{path} was not refused: {text}");
    }
    assert!(
        !nginx.access_log().contains("admin") && !nginx.access_log().contains("php"),
        "a denied path reached nginx:\n{}",
        nginx.access_log()
    );

    // What is allowed reaches the origin in its normal form.
    for path in ["/o%6b.txt", "//ok.txt", "/./x/../ok.txt"] {
        let (status, text) = raw_get(&env, &server, HOST, HOST, path, "").await;
        assert_eq!(status, 200, "{path}: {text}");
        assert!(text.ends_with("fine"), "{path}: {text}");
    }
    assert!(
        eventually(Duration::from_secs(5), || nginx
            .access_log()
            .matches("GET /ok.txt HTTP/1.1 200")
            .count()
            == 3),
        "nginx did not see the normal form:\n{}",
        nginx.access_log()
    );

    // Routes match the normal form too, and the request-rewrite headers stay behind.
    let (status, text) = raw_get(
        &env,
        &server,
        HOST,
        HOST,
        "/x/../echo-route/ech%6F?q=%2F",
        "X-Original-URL: /admin.txt\r\nX-Rewrite-URL: /admin.txt\r\n",
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let seen = origin.seen().pop().expect("the echo route's origin saw nothing");
    assert_eq!(seen.path, "/echo?q=%2F", "the query is forwarded untouched");
    assert_eq!(seen.header("x-original-url"), None);
    assert_eq!(seen.header("x-rewrite-url"), None);
}

/// One raw HTTP/1.1 request with `method` on a fresh TLS connection: status and text.
async fn raw_method(env: &Env, server: &Server, method: &str, path: &str, extra: &str) -> (u16, String) {
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {HOST}\r\n{extra}Content-Length: 0\r\nConnection: close\r\n\r\n"
    );
    let out = raw_h1(server.addr(), HOST, env.client(b"http/1.1"), request.as_bytes()).await;
    (raw_status(&out), String::from_utf8_lossy(&out).into_owned())
}

/// Spellings an origin decodes differently from the normal form: `;` parameters
/// (Tomcat, Jetty and Spring read `/;x/admin` and `/admin;x` as `/admin`) and escapes
/// of characters that are not unreserved (nginx serves `/caf%C3%A9` as `/café`).
/// `deny_paths` and route prefixes match the fully decoded form without parameters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deny_paths_cannot_be_bypassed_by_parameters_or_escapes() {
    let env = Env::new();
    for name in ["admin.txt", "café.txt", "@admin.txt", "a:b", "exact", "ok.txt"] {
        env.write(name, b"secret");
    }
    let nginx = Nginx::start(&env.root);
    let origin = Origin::start().await;
    let deny = "deny_paths = [\"/admin*\", \"/café*\", \"/@admin*\", \"/a:b\", \"/exact\"]";
    let routes = route(HOST, "/", &[nginx.addr], deny)
        + &route(
            HOST,
            "/locked/",
            &[origin.addr],
            "allowed_methods = [\"GET\"]\nstrip_prefix = true",
        )
        + &route(HOST, "/echo-route/", &[origin.addr], "strip_prefix = true");
    let server = proxy(&env, "", &routes);

    let denied = [
        "/;x/admin.txt",
        "/;/admin.txt",
        "/admin.txt;x",
        "/exact;x",
        "/exact%3Bx",
        "/;x/exact",
        "/caf%C3%A9.txt",
        "/caf%c3%a9.txt",
        "/%40admin.txt",
        "/a%3Ab",
        "/a%3ab;x",
    ];
    for path in denied {
        let (status, text) = raw_get(&env, &server, HOST, HOST, path, "").await;
        assert_eq!(status, 403, "{path} was not denied: {text}");
    }
    let log = nginx.access_log();
    for needle in ["admin", "caf", "a%3A", "a:b", "exact"] {
        assert!(!log.contains(needle), "a denied path reached nginx:\n{log}");
    }
    let (status, text) = raw_get(&env, &server, HOST, HOST, "/ok.txt;v=1", "").await;
    assert_eq!(status, 404, "nginx reads `;` literally: {text}");

    // A route's prefix is matched on the same form: its method filter holds.
    for path in ["/locked;x/a", "/;x/locked/a", "/lock%65d/a"] {
        let (status, text) = raw_method(&env, &server, "DELETE", path, "").await;
        assert_eq!(status, 405, "DELETE {path} passed the locked route: {text}");
        assert!(text.contains("webship: method not allowed"), "{path}: {text}");
    }
    // strip_prefix removes the prefix as spelled, with its parameters; the rest goes
    // on in its normal form.
    let (status, text) = raw_get(&env, &server, HOST, HOST, "/echo-route;jsessionid=1/ech%6F", "").await;
    assert_eq!(status, 200, "{text}");
    let seen = origin.seen().pop().expect("the echo route's origin saw nothing");
    assert_eq!(seen.path, "/echo");
}

// ---- item 10: forwarding headers -----------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarding_headers_cannot_be_forged() {
    let env = Env::new();
    let origin = Origin::start().await;
    let routes = route("*.example.test", "/", &[origin.addr], "");
    let server = proxy(&env, "", &routes);

    // A Host that would break out of Forwarded's quoted host is refused.
    let forged = "x\",for=6.6.6.6;host=\"a.example.test";
    let (status, text) = raw_get(&env, &server, "a.example.test", forged, "/echo", "").await;
    assert_eq!(status, 400, "forged Host accepted: {text}");
    for bad in [
        "a.example.test:99999",
        "a.example.test:x",
        "a b.example.test",
        "[::1",
    ] {
        let (status, text) = raw_get(&env, &server, "a.example.test", bad, "/echo", "").await;
        assert_eq!(status, 400, "Host {bad:?} accepted: {text}");
    }
    let (status, text) = raw_get(
        &env,
        &server,
        "a.example.test",
        "a.example.test",
        "/echo",
        "Host: b.example.test\r\n",
    )
    .await;
    assert_eq!(status, 400, "two Host lines accepted: {text}");
    assert!(origin.seen().is_empty(), "{:?}", origin.seen());

    // From an untrusted peer, the client's forwarding fields are replaced or dropped.
    let spoof = "X-Forwarded-For: 6.6.6.6\r\nX-Real-IP: 6.6.6.6\r\nTrue-Client-IP: 6.6.6.6\r\nX-Forwarded-Proto: http\r\nX-Forwarded-Host: evil.test\r\nForwarded: for=6.6.6.6\r\n";
    let (status, text) = raw_get(&env, &server, "a.example.test", "a.example.test", "/echo", spoof).await;
    assert_eq!(status, 200, "{text}");
    let seen = origin.seen().pop().unwrap();
    assert_eq!(seen.header("x-forwarded-for"), Some("127.0.0.1"));
    assert_eq!(seen.header("x-real-ip"), None);
    assert_eq!(seen.header("true-client-ip"), None);
    assert_eq!(seen.header("x-forwarded-proto"), Some("https"));
    assert_eq!(seen.header("x-forwarded-host"), Some("a.example.test"));
    assert_eq!(
        seen.headers_named("forwarded"),
        vec!["for=127.0.0.1;proto=https;host=\"a.example.test\""]
    );
    drop(server);

    // A trusted peer's chain is kept and extended.
    let server = proxy(&env, "trusted_proxies = [\"127.0.0.0/8\", \"::1/128\"]", &routes);
    let (status, text) = raw_get(
        &env,
        &server,
        "a.example.test",
        "a.example.test:8443",
        "/echo",
        spoof,
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let seen = origin.seen().pop().unwrap();
    assert_eq!(seen.header("x-forwarded-for"), Some("6.6.6.6, 127.0.0.1"));
    assert_eq!(seen.header("x-real-ip"), Some("6.6.6.6"));
    assert_eq!(seen.header("x-forwarded-proto"), Some("http"));
    assert_eq!(seen.header("x-forwarded-host"), Some("evil.test"));
    assert_eq!(
        seen.headers_named("forwarded").join(", "),
        "for=6.6.6.6, for=127.0.0.1;proto=https;host=\"a.example.test:8443\""
    );
}

/// Method-override fields (Rails, Laravel, Express, Symfony obey them over the
/// request line) would get past `allowed_methods`; client-IP and other
/// `X-Forwarded-*` fields from an untrusted peer would let a client claim an address,
/// port, scheme or prefix. All are dropped; a trusted peer's forwarding fields pass,
/// and its method overrides pass only on a route without `allowed_methods`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn method_overrides_and_client_claims_do_not_pass() {
    let env = Env::new();
    let origin = Origin::start().await;
    let routes = route(HOST, "/", &[origin.addr], "")
        + &route(
            HOST,
            "/ro/",
            &[origin.addr],
            "allowed_methods = [\"GET\"]\nstrip_prefix = true",
        );
    let overrides = ["x-http-method-override", "x-http-method", "x-method-override"];
    let claims = [
        "x-forwarded-port",
        "x-forwarded-prefix",
        "x-forwarded-server",
        "x-forwarded-scheme",
        "x-forwarded-ssl",
        "x-client-ip",
        "cf-connecting-ip",
        "x-cluster-client-ip",
        "fastly-client-ip",
    ];
    let extra: String = overrides
        .iter()
        .map(|n| format!("{n}: DELETE\r\n"))
        .chain(claims.iter().map(|n| format!("{n}: 6.6.6.6\r\n")))
        .collect();
    async fn seen(
        env: &Env,
        server: &Server,
        origin: &Origin,
        path: &str,
        extra: &str,
    ) -> webship_tests::origin::Seen {
        let (status, text) = raw_get(env, server, HOST, HOST, path, extra).await;
        assert_eq!(status, 200, "{path}: {text}");
        origin.seen().pop().expect("the origin saw nothing")
    }

    let server = proxy(&env, "", &routes);
    for path in ["/echo", "/ro/echo"] {
        let got = seen(&env, &server, &origin, path, &extra).await;
        for name in overrides.iter().chain(&claims) {
            assert_eq!(got.header(name), None, "untrusted {path}: {name} passed");
        }
    }
    drop(server);

    let server = proxy(&env, "trusted_proxies = [\"127.0.0.0/8\"]", &routes);
    let got = seen(&env, &server, &origin, "/echo", &extra).await;
    for name in overrides.iter().chain(&claims) {
        assert!(got.header(name).is_some(), "trusted: {name} was dropped");
    }
    let got = seen(&env, &server, &origin, "/ro/echo", &extra).await;
    for name in overrides {
        assert_eq!(got.header(name), None, "trusted, allowed_methods: {name} passed");
    }
    for name in claims {
        assert!(got.header(name).is_some(), "trusted: {name} was dropped");
    }
}

// ---- item 11: response framing ---------------------------------------------------

/// Raw TCP origin: answers each request on a keep-alive connection with the bytes
/// `script(path)` gives, and closes when it gives `None`. Bounded: 100 connections,
/// 10 s each.
struct RawOrigin {
    addr: SocketAddr,
    _task: Task,
}

impl RawOrigin {
    async fn start(script: fn(&str) -> Option<Vec<u8>>) -> RawOrigin {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let _task = Task::spawn(async move {
            let mut conns = JoinSet::new();
            for _ in 0..100 {
                let Ok(Ok((stream, _))) =
                    tokio::time::timeout(Duration::from_secs(60), listener.accept()).await
                else {
                    break;
                };
                conns.spawn(async move {
                    let _ = tokio::time::timeout(Duration::from_secs(10), Self::serve(stream, script)).await;
                });
            }
        });
        RawOrigin { addr, _task }
    }

    async fn serve(mut stream: TcpStream, script: fn(&str) -> Option<Vec<u8>>) -> std::io::Result<()> {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            let end = loop {
                if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    break i + 4;
                }
                let n = stream.read(&mut chunk).await?;
                if n == 0 || buf.len() > 64 * 1024 {
                    return Ok(());
                }
                buf.extend_from_slice(&chunk[..n]);
            };
            let head = String::from_utf8_lossy(&buf[..end]).into_owned();
            buf.drain(..end);
            let path = head.split_whitespace().nth(1).unwrap_or("/").to_owned();
            match script(&path) {
                Some(answer) => stream.write_all(&answer).await?,
                None => return Ok(()),
            }
        }
    }
}

/// The lies: `/te-cl` announces 5 bytes but sends a chunked body whose decoded bytes
/// hold a whole second response; `/te-cl-short` announces 100 and sends 2 (chunked);
/// `/long` sends a second response after its 5 announced bytes; `/plain` is honest.
fn lying_origin(path: &str) -> Option<Vec<u8>> {
    let smuggled = "HTTP/1.1 200 OK\r\nContent-Length: 7\r\nX-Smuggled: yes\r\n\r\nsmuggle";
    let chunked = |body: &str| format!("{:x}\r\n{body}\r\n0\r\n\r\n", body.len());
    Some(
        match path {
            "/te-cl" => format!(
                "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n{}",
                chunked(&format!("hello{smuggled}"))
            ),
            "/te-cl-short" => format!(
                "HTTP/1.1 200 OK\r\nContent-Length: 100\r\nTransfer-Encoding: chunked\r\n\r\n{}",
                chunked("hi")
            ),
            "/long" => format!("HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello{smuggled}"),
            "/plain" => "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nplain".to_owned(),
            _ => return None,
        }
        .into_bytes(),
    )
}

/// One HTTP/1.1 response parsed from `bytes`: (status, lowercase headers, body,
/// bytes consumed), or `None` when `bytes` holds no complete response.
type Parsed = (u16, Vec<(String, String)>, Vec<u8>, usize);

fn parse_response(bytes: &[u8]) -> Option<Parsed> {
    let end = bytes.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = String::from_utf8_lossy(&bytes[..end]);
    let mut lines = head.split("\r\n");
    let status = lines.next()?.split_whitespace().nth(1)?.parse().ok()?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let get = |name: &str| headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
    let mut at = end;
    let mut body = Vec::new();
    if get("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        loop {
            let line_end = bytes[at..].windows(2).position(|w| w == b"\r\n")? + at;
            let size_text = String::from_utf8_lossy(&bytes[at..line_end]);
            let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
            at = line_end + 2;
            if size == 0 {
                // No trailers in these tests.
                if bytes.len() < at + 2 {
                    return None;
                }
                at += 2;
                break;
            }
            if bytes.len() < at + size + 2 {
                return None;
            }
            body.extend_from_slice(&bytes[at..at + size]);
            at += size + 2;
        }
    } else if let Some(len) = get("content-length") {
        let len: usize = len.parse().ok()?;
        if bytes.len() < at + len {
            return None;
        }
        body.extend_from_slice(&bytes[at..at + len]);
        at += len;
    }
    Some((status, headers, body, at))
}

/// Two requests on one keep-alive TLS connection (the second sent once the first
/// answer had time to arrive): every response the client can parse.
async fn two_on_one_connection(env: &Env, server: &Server, sni: &str, first: &str) -> Vec<Parsed> {
    let mut tls = connect(server.addr(), sni, env.client(b"http/1.1"))
        .await
        .unwrap();
    tls.write_all(format!("GET {first} HTTP/1.1\r\nHost: {HOST}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    // The second write may fail if the server already closed: that is allowed.
    let _ = tls
        .write_all(format!("GET /plain HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n").as_bytes())
        .await;
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), tls.read_to_end(&mut out)).await;
    let mut responses = Vec::new();
    let mut at = 0;
    while let Some(parsed) = parse_response(&out[at..]) {
        at += parsed.3;
        responses.push(parsed);
    }
    responses
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_origin_cannot_split_the_clients_keep_alive_connection() {
    let env = Env::new();
    let origin = RawOrigin::start(lying_origin).await;
    // `files.test` is a file site: its HTTP/1.1 connections run the own h1 driver,
    // which also relays GETs for the proxy domain. `proxy.test`'s run hyper's.
    let (cert, key) = env.leaf("proxy", &[HOST]);
    let config = env.config(&format!(
        "[reverse_proxy]\nenabled = true\n[reverse_proxy.tls]\ncert = \"{}\"\nkey = \"{}\"\n{}",
        cert.display(),
        key.display(),
        route(HOST, "/", &[origin.addr], "")
    ));
    let server = Server::start(env.dir.path(), &config);
    for sni in [crate::support::HOST, HOST] {
        for first in ["/te-cl", "/te-cl-short", "/long"] {
            let responses = two_on_one_connection(&env, &server, sni, first).await;
            for (status, headers, body, _) in &responses {
                assert!(
                    !headers.iter().any(|(n, _)| n == "x-smuggled"),
                    "{sni} {first}: a smuggled response reached the client ({status}, {:?})",
                    String::from_utf8_lossy(body)
                );
            }
            let first_body = responses.first().map(|r| r.2.clone()).unwrap_or_default();
            let expected: &[u8] = match first {
                "/te-cl" => b"helloHTTP/1.1 200 OK\r\nContent-Length: 7\r\nX-Smuggled: yes\r\n\r\nsmuggle",
                "/long" => b"hello",
                _ => b"hi",
            };
            // Either the whole decoded body in honest framing, or nothing complete.
            if !responses.is_empty() {
                assert_eq!(
                    String::from_utf8_lossy(&first_body),
                    String::from_utf8_lossy(expected),
                    "{sni} {first}: body not what the origin sent"
                );
            }
            if let Some(second) = responses.get(1) {
                assert_eq!(second.2, b"plain", "{sni} {first}: the second answer is /plain's");
            }
            assert!(
                responses.len() <= 2,
                "{sni} {first}: {} responses to 2 requests",
                responses.len()
            );
        }
    }
}

// ---- item 12: error bodies name no upstream -------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_errors_name_no_upstream() {
    let env = Env::new();
    let (_dead_socket, dead) = webship_tests::server::refused_port().unwrap();
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let routes = route(HOST, "/down/", &[SocketAddr::from(([127, 0, 0, 1], dead))], "")
        + &route(
            HOST,
            "/silent/",
            &[silent.local_addr().unwrap()],
            "read_timeout_secs = 1",
        );
    let server = proxy(&env, "", &routes);
    let (status, text) = raw_get(&env, &server, HOST, HOST, "/down/x", "").await;
    assert_eq!(status, 502, "{text}");
    assert!(
        !text.contains("127.0.0.1") && !text.contains(&dead.to_string()),
        "{text}"
    );
    assert!(
        server.log().contains(&dead.to_string()),
        "the log names the upstream"
    );
    let (status, text) = raw_get(&env, &server, HOST, HOST, "/silent/x", "").await;
    assert_eq!(status, 504, "{text}");
    let port = silent.local_addr().unwrap().port().to_string();
    assert!(!text.contains("127.0.0.1") && !text.contains(&port), "{text}");
}

// ---- item 7: upstream concurrency and timeouts ----------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_h2_client_cannot_open_more_upstream_connections_than_the_cap() {
    const CAP: usize = 4;
    const STREAMS: usize = 40;
    let env = Env::new();
    env.write("big.bin", &vec![7u8; 4 << 20]);
    let nginx = Nginx::start(&env.root);
    let origin = Origin::start().await;
    let routes = route(
        HOST,
        "/api/",
        &[origin.addr],
        &format!("strip_prefix = true\nmax_connections_per_upstream = {CAP}\nqueue_timeout_ms = 1500"),
    ) + &route(HOST, "/", &[nginx.addr], "");
    let server = proxy(&env, "", &routes);
    let before = Footprint::of(server.pid()).unwrap();

    let tls = connect(server.addr(), HOST, env.client(b"h2")).await.unwrap();
    let conn = Conn::handshake(
        tls,
        Proto::H2,
        &format!("{HOST}:{}", server.port),
        Tuning::default(),
    )
    .await
    .unwrap();
    let mut streams = JoinSet::new();
    for _ in 0..STREAMS {
        let mut c = conn.share().unwrap();
        // 48 KiB in three frames 300 ms apart: each exchange holds its upstream ~0.6 s.
        streams.spawn(async move {
            let resp = c
                .send("GET", "/api/slow/49152/300", &[], Bytes::new())
                .await
                .unwrap();
            outcome(resp).await
        });
    }
    let mut peak = 0;
    let mut statuses = Vec::new();
    let mut during = before;
    let started = Instant::now();
    let download = Instant::now();
    let mut download_took = None;
    let got = webship_tests::client::fetch(
        Proto::H1,
        server.addr(),
        HOST,
        env.client(b"http/1.1"),
        "GET",
        "/big.bin",
        &[],
    )
    .await;
    if got.status == 200 && got.len == 4 << 20 {
        download_took = Some(download.elapsed());
    }
    while !streams.is_empty() && started.elapsed() < Duration::from_secs(20) {
        peak = peak.max(established(origin.addr.port(), End::Remote));
        if let Some(f) = Footprint::of(server.pid()) {
            if f.fds > during.fds {
                during = f;
            }
        }
        while let Some(done) = streams.try_join_next() {
            statuses.push(done.unwrap().status.as_u16());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    while let Some(done) = streams.join_next().await {
        statuses.push(done.unwrap().status.as_u16());
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    FloodReport {
        flood: "h2 streams to one upstream (40 streams, cap 4)",
        before,
        during,
        after: Footprint::of(server.pid()).unwrap(),
        download: download_took,
    }
    .print();
    assert!(
        peak <= CAP,
        "{peak} upstream connections for one h2 client, cap {CAP}; statuses {statuses:?}"
    );
    assert!(
        origin.connections() <= CAP,
        "the origin accepted {}",
        origin.connections()
    );
    assert!(
        statuses.iter().all(|s| *s == 200 || *s == 503),
        "statuses {statuses:?}"
    );
    assert!(
        statuses.iter().filter(|s| **s == 200).count() >= CAP,
        "{statuses:?}"
    );
    assert!(statuses.contains(&503), "the queue never timed out: {statuses:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_upload_is_not_an_upstream_timeout_and_ejects_nothing() {
    let env = Env::new();
    let a = Origin::start().await;
    let b = Origin::start().await;
    // The response must come within 1 s of the request's end; a body may pause up
    // to 1 s between chunks (read_timeout_secs sets both).
    let routes = route(HOST, "/", &[a.addr, b.addr], "read_timeout_secs = 1");
    let server = proxy(&env, "", &routes);

    // 8 chunks 400 ms apart: 2.8 s of upload, never 1 s without a byte.
    let mut tls = connect(server.addr(), HOST, env.client(b"http/1.1"))
        .await
        .unwrap();
    tls.write_all(
        format!("POST /echo HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: 8000\r\nConnection: close\r\n\r\n")
            .as_bytes(),
    )
    .await
    .unwrap();
    for _ in 0..8 {
        tls.write_all(&[b'x'; 1000]).await.unwrap();
        tls.flush().await.unwrap();
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), tls.read_to_end(&mut out)).await;
    let text = String::from_utf8_lossy(&out);
    assert_eq!(raw_status(&out), 200, "slow upload: {text}\n{}", server.log());
    assert!(text.contains("body-len: 8000"), "{text}");
    assert!(!server.log().contains("ejected"), "{}", server.log());
    // Neither upstream was ejected: the next requests alternate between both.
    let seen_a = a.seen().len();
    let seen_b = b.seen().len();
    for _ in 0..4 {
        let (status, text) = raw_get(&env, &server, HOST, HOST, "/echo", "").await;
        assert_eq!(status, 200, "{text}");
    }
    assert_eq!(
        (a.seen().len() - seen_a, b.seen().len() - seen_b),
        (2, 2),
        "round-robin skipped an upstream: one was ejected"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_descriptor_shortage_ejects_no_upstream() {
    let env = Env::new();
    let a = Origin::start().await;
    let b = Origin::start().await;
    let server = proxy(&env, "", &route(HOST, "/", &[a.addr, b.addr], ""));
    let pid = server.pid().to_string();
    let limit = |soft: &str| {
        let out = std::process::Command::new("prlimit")
            .args(["--pid", &pid, &format!("--nofile={soft}:")])
            .output()
            .expect("prlimit (util-linux) is required");
        assert!(
            out.status.success(),
            "prlimit: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    // The client's connection is open first; then the daemon may open no descriptor
    // more, so the connect to an upstream fails with EMFILE.
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let soft = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(3))
        .expect("Max open files in /proc/PID/limits")
        .to_owned();
    // The lowest free descriptor is measured from outside while the daemon runs:
    // one it closes in between (a blocking thread's file, a probe) leaves a slot
    // free and the request is simply served. Such a try proves nothing; try again.
    let mut shortage = None;
    for _ in 0..5 {
        let mut tls = connect(server.addr(), HOST, env.client(b"http/1.1"))
            .await
            .unwrap();
        // The lowest free descriptor number: below it every slot is taken.
        let open: std::collections::BTreeSet<usize> = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect();
        let lowest_free = (0..).find(|n| !open.contains(n)).unwrap();
        limit(&lowest_free.to_string());
        tls.write_all(format!("GET /echo HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(10), tls.read_to_end(&mut out)).await;
        limit(&soft);
        match raw_status(&out) {
            503 => {
                shortage = Some(out);
                break;
            }
            200 => continue,
            _ => panic!("{}\n{}", String::from_utf8_lossy(&out), server.log()),
        }
    }
    assert!(
        shortage.is_some(),
        "no try ran into the descriptor limit (5 served); log:\n{}",
        server.log()
    );
    assert!(!server.log().contains("ejected"), "{}", server.log());
    // Neither upstream was ejected: the next requests alternate between both.
    let seen = (a.seen().len(), b.seen().len());
    for _ in 0..4 {
        let (status, text) = raw_get(&env, &server, HOST, HOST, "/echo", "").await;
        assert_eq!(status, 200, "{text}");
    }
    assert_eq!((a.seen().len() - seen.0, b.seen().len() - seen.1), (2, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_body_over_the_limit_is_413_not_a_client_error() {
    let env = Env::new();
    let origin = Origin::start().await;
    let server = proxy(
        &env,
        "",
        &route(HOST, "/", &[origin.addr], "max_body_bytes = 1000"),
    );
    // Chunked: no length to refuse up front; the limit trips while streaming.
    let chunk = "x".repeat(800);
    let request = format!(
        "POST /echo HTTP/1.1\r\nHost: {HOST}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n320\r\n{chunk}\r\n320\r\n{chunk}\r\n0\r\n\r\n"
    );
    let out = raw_h1(server.addr(), HOST, env.client(b"http/1.1"), request.as_bytes()).await;
    assert_eq!(raw_status(&out), 413, "{}", String::from_utf8_lossy(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stalls_its_upload_gets_408_and_ejects_nothing() {
    let env = Env::new();
    let a = Origin::start().await;
    let routes = route(
        HOST,
        "/",
        &[a.addr],
        "response_timeout_secs = 1\nbody_idle_timeout_secs = 2",
    );
    let server = proxy(&env, "", &routes);
    let mut tls = connect(server.addr(), HOST, env.client(b"http/1.1"))
        .await
        .unwrap();
    tls.write_all(
        format!("POST /echo HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: 8000\r\nConnection: close\r\n\r\n")
            .as_bytes(),
    )
    .await
    .unwrap();
    tls.write_all(&[b'x'; 1000]).await.unwrap();
    tls.flush().await.unwrap();
    let started = Instant::now();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), tls.read_to_end(&mut out)).await;
    assert_eq!(raw_status(&out), 408, "{}", String::from_utf8_lossy(&out));
    assert!(
        started.elapsed() >= Duration::from_millis(1500),
        "408 before the body idle timeout"
    );
    assert!(!server.log().contains("ejected"), "{}", server.log());
}
