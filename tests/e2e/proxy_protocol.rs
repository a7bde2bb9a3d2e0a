//! The PROXY protocol both ways, with real peers: a test client plays the load
//! balancer (it sends a v1 or v2 header naming a made-up client, then TLS), webship
//! accepts headers only from `accept_proxy_protocol`, and a passthrough route with
//! `proxy_protocol` hands the client's address on to Debian's nginx
//! (`listen … ssl proxy_protocol`), whose log shows what it was told. Sources are
//! told apart by loopback address: the whole of 127.0.0.0/8 is local on Linux, so a
//! client bound to 127.0.0.2 is "another host".

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use webship_tests::client::{raw_status, Conn, Proto, Tuning};
use webship_tests::nginx::Nginx;
use webship_tests::origin::Origin;
use webship_tests::server::{check_access_log, eventually};
use webship_tests::Server;

use crate::support::Env;

/// The balancer's address (listed) and another host's (not listed).
const BALANCER: [u8; 4] = [127, 0, 0, 1];
const STRANGER: [u8; 4] = [127, 0, 0, 2];

/// A connection to `server` from `source`.
async fn connect_from(source: [u8; 4], server: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::from((source, 0))).unwrap();
    let tcp = socket.connect(server).await.unwrap();
    tcp.set_nodelay(true).unwrap();
    tcp
}

/// A v1 header, written by hand (not by webship's encoder).
fn v1(client: &str, destination: &str) -> Vec<u8> {
    let (c, d): (SocketAddr, SocketAddr) = (client.parse().unwrap(), destination.parse().unwrap());
    let family = if c.is_ipv4() { "TCP4" } else { "TCP6" };
    format!(
        "PROXY {family} {} {} {} {}\r\n",
        c.ip(),
        d.ip(),
        c.port(),
        d.port()
    )
    .into_bytes()
}

const V2_SIGNATURE: &[u8] = b"\r\n\r\n\0\r\nQUIT\n";

/// A v2 PROXY header (IPv4 or IPv6, TCP), and `tlvs` after the addresses.
fn v2(client: &str, destination: &str, tlvs: &[u8]) -> Vec<u8> {
    let (c, d): (SocketAddr, SocketAddr) = (client.parse().unwrap(), destination.parse().unwrap());
    let mut addresses = Vec::new();
    let family = match (c.ip(), d.ip()) {
        (std::net::IpAddr::V4(s), std::net::IpAddr::V4(t)) => {
            addresses.extend_from_slice(&s.octets());
            addresses.extend_from_slice(&t.octets());
            0x11
        }
        (std::net::IpAddr::V6(s), std::net::IpAddr::V6(t)) => {
            addresses.extend_from_slice(&s.octets());
            addresses.extend_from_slice(&t.octets());
            0x21
        }
        _ => panic!("one family"),
    };
    addresses.extend_from_slice(&c.port().to_be_bytes());
    addresses.extend_from_slice(&d.port().to_be_bytes());
    addresses.extend_from_slice(tlvs);
    v2_raw(0x21, family, &addresses)
}

fn v2_raw(version_command: u8, family: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = V2_SIGNATURE.to_vec();
    out.extend_from_slice(&[version_command, family]);
    out.extend_from_slice(&u16::try_from(payload.len()).unwrap().to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// From `source`: `header`, then TLS for `sni` and `GET path` over HTTP/1.1.
/// The status and body, or why it failed (closed, refused handshake).
async fn get(
    env: &Env,
    server: SocketAddr,
    source: [u8; 4],
    header: &[u8],
    sni: &str,
    path: &str,
) -> Result<(u16, String), String> {
    let mut tcp = connect_from(source, server).await;
    tcp.write_all(header).await.map_err(|e| e.to_string())?;
    let tls = webship_testkit::http::tls(tcp, sni, env.client(b"http/1.1"));
    let mut tls = tokio::time::timeout(Duration::from_secs(10), tls)
        .await
        .map_err(|_| "handshake timed out".to_owned())?
        .map_err(|e| format!("handshake: {e}"))?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {sni}\r\nConnection: close\r\n\r\n");
    tls.write_all(request.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), tls.read_to_end(&mut out)).await;
    if out.is_empty() {
        return Err("no response".into());
    }
    let text = String::from_utf8_lossy(&out).into_owned();
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned();
    Ok((raw_status(&out), body))
}

/// From `source`: `bytes`, then a FIN when `finish`; the server must close without
/// answering a byte.
async fn closed_unanswered(
    server: SocketAddr,
    source: [u8; 4],
    bytes: &[u8],
    finish: bool,
) -> Result<(), String> {
    let mut tcp = connect_from(source, server).await;
    tcp.write_all(bytes).await.map_err(|e| e.to_string())?;
    if finish {
        tcp.shutdown().await.map_err(|e| e.to_string())?;
    }
    let mut out = Vec::new();
    match tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut out)).await {
        Err(_) => Err("still open after 10 s".into()),
        Ok(_) if !out.is_empty() => Err(format!("answered {} bytes", out.len())),
        Ok(_) => Ok(()),
    }
}

/// nginx serving `who.txt` = "origin pp" for `pp.pass` over TLS, requiring a PROXY
/// header on every connection.
fn nginx_origin(env: &Env) -> Nginx {
    let root = env.dir.path().join("pp");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::write(root.join("who.txt"), "origin pp").unwrap();
    let (cert, key) = env.leaf("pp", &["pp.pass"]);
    Nginx::start_tls_proxy_protocol(&root, &cert, &key)
}

/// A passthrough front for `pp.pass` → `origin` through `engine`, sending
/// `version` headers, accepting them from 127.0.0.1 (and from 127.0.0.3).
fn front(env: &Env, origin: SocketAddr, engine: &str, version: &str) -> Server {
    Server::start(
        env.dir.path(),
        &format!(
            r#"listen = "127.0.0.1:{{port}}"
workers = 2
accept_proxy_protocol = ["127.0.0.1/32", "127.0.0.3"]

[limits]
handshake_timeout_secs = 1

[kernel]
bpf_pin_dir = "/sys/fs/bpf/webship-e2e-{{port}}"

[reverse_proxy]
enabled = true
tls_termination = false
passthrough_engine = "{engine}"
[reverse_proxy.protocols]
h3 = false
[[reverse_proxy.routes]]
domain = "pp.pass"
upstreams = ["{origin}"]
proxy_protocol = "{version}"
"#
        ),
    )
}

/// The client a balancer names reaches nginx through passthrough with its own
/// address, for v1 and v2 headers (IPv4 and IPv6 clients) and every engine; the
/// destination nginx hears of is the balancer's (carried), or webship's listener
/// for a client that came without a balancer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_engine_hands_the_balanced_client_to_nginx() {
    let env = Env::new();
    let nginx = nginx_origin(&env);
    for (i, (engine, version)) in [
        ("splice", "v2"),
        ("copy", "v2"),
        ("sockmap", "v2"),
        ("auto", "v1"),
    ]
    .into_iter()
    .enumerate()
    {
        let front = front(&env, nginx.addr, engine, version);
        let at = front.addr();
        let v4_client = format!("203.0.113.7:{}", 40_000 + i);
        let v6_client = format!("[2001:db8::7]:{}", 41_000 + i);
        let tlv = [0x04, 0, 3, 0, 0, 0]; // a NOOP TLV, skipped
        let sent = [
            v2(&v4_client, "198.51.100.1:443", &tlv),
            v1(&v6_client, "[2001:db8::1]:443"),
        ];
        for header in &sent {
            let got = get(&env, at, BALANCER, header, "pp.pass", "/who.txt").await;
            assert_eq!(
                got,
                Ok((200, "origin pp".into())),
                "{engine}: {}\nwebship:\n{}\nnginx:\n{}",
                String::from_utf8_lossy(header),
                front.log(),
                nginx.error_log()
            );
        }
        // A host that is no balancer, without a header: itself, as it connected.
        let got = get(&env, at, STRANGER, b"", "pp.pass", "/who.txt").await;
        assert_eq!(got, Ok((200, "origin pp".into())), "{engine}: {}", front.log());
        // The stranger came as itself, to webship's own address.
        let direct = format!(">127.0.0.1:{} 127.0.0.1 GET /who.txt", front.port);
        let wanted = [
            format!("{v4_client}>198.51.100.1:443 127.0.0.1 GET /who.txt HTTP/1.1 200"),
            format!("2001:db8::7:{}>2001:db8::1:443 127.0.0.1 GET", 41_000 + i),
        ];
        let mut log = String::new();
        let logged = eventually(Duration::from_secs(5), || {
            log = nginx.proxy_protocol_log();
            wanted.iter().all(|w| log.contains(w.as_str()))
                && log
                    .lines()
                    .any(|l| l.starts_with("127.0.0.2:") && l.contains(&direct))
        });
        assert!(logged, "{engine}: nginx was told otherwise:\n{log}");
        if engine == "sockmap" {
            assert!(
                front.log().contains("passthrough engine engine=sockmap"),
                "{}",
                front.log()
            );
        }
        std::fs::write(nginx.dir().join("carried.log"), "").unwrap();
    }
}

/// What may not pass: a header from a source not listed, a listed source without
/// one, malformed, oversized and truncated headers, and one trickled past the
/// handshake timeout — each closed unanswered while other clients are served; a
/// `LOCAL` header (the balancer's health check) and v1 `UNKNOWN` are served as the
/// balancer itself. The shutdown line counts each kind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_out_of_place_are_closed_and_counted() {
    let env = Env::new();
    let nginx = nginx_origin(&env);
    let mut front = front(&env, nginx.addr, "splice", "v2");
    let at = front.addr();
    let good = v2("203.0.113.7:40000", "198.51.100.1:443", &[]);
    let hello = crate::passthrough::client_hello(&env, "pp.pass");

    // Trickled, one byte every 150 ms: the 1 s handshake timeout ends it.
    let trickled = tokio::spawn(async move {
        let header = v1("203.0.113.99:1", "198.51.100.1:443");
        let (mut read, mut write) = connect_from(BALANCER, at).await.into_split();
        let writer = tokio::spawn(async move {
            let mut sent = 0;
            for byte in &header {
                if write.write_all(&[*byte]).await.is_err() {
                    break;
                }
                sent += 1;
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
            (sent, header.len())
        });
        let start = Instant::now();
        let mut out = Vec::new();
        let ended = tokio::time::timeout(Duration::from_secs(6), read.read_to_end(&mut out)).await;
        assert!(
            ended.is_ok() && out.is_empty(),
            "the trickled header kept its connection: {out:?}"
        );
        let waited = start.elapsed();
        writer.abort();
        waited
    });

    // Others meanwhile: a header from another host is no TLS and no right.
    let stranger = [
        [&good[..], &hello[..]].concat(),
        v1("203.0.113.7:1", "198.51.100.1:443"),
    ];
    for bytes in &stranger {
        let closed = closed_unanswered(at, STRANGER, bytes, false).await;
        assert_eq!(closed, Ok(()), "{}", front.log());
    }
    // A listed source must send one.
    let refused = get(&env, at, BALANCER, b"", "pp.pass", "/who.txt").await;
    assert!(refused.is_err(), "served without a header: {refused:?}");
    let mut bad_version = v2("203.0.113.7:1", "198.51.100.1:443", &[]);
    bad_version[12] = 0x11;
    let mut oversized = v2("203.0.113.7:1", "198.51.100.1:443", &[])[..16].to_vec();
    oversized[14..16].copy_from_slice(&u16::MAX.to_be_bytes());
    let malformed: [(&str, Vec<u8>, bool); 5] = [
        (
            "bad v1",
            b"PROXY TCP4 203.0.113.7 2001:db8::1 1 443\r\n".to_vec(),
            false,
        ),
        (
            "v1 without an end",
            [&b"PROXY UNKNOWN "[..], &[b'x'; 120][..]].concat(),
            false,
        ),
        ("v2 version 1", bad_version, false),
        ("v2 length 65535", oversized, false),
        ("v2 truncated", good[..20].to_vec(), true),
    ];
    for (what, bytes, finish) in &malformed {
        let closed = closed_unanswered(at, BALANCER, bytes, *finish).await;
        assert_eq!(closed, Ok(()), "{what}: {}", front.log());
    }
    // Served while all that happened, and the health checks as the balancer.
    let local = v2_raw(0x20, 0x00, &[]);
    for header in [&good[..], &local[..], b"PROXY UNKNOWN\r\n"] {
        let got = get(&env, at, BALANCER, header, "pp.pass", "/who.txt").await;
        assert_eq!(got, Ok((200, "origin pp".into())), "{}", front.log());
    }
    // Another listed source (127.0.0.3) works the same.
    let got = get(&env, at, [127, 0, 0, 3], &good, "pp.pass", "/who.txt").await;
    assert_eq!(got, Ok((200, "origin pp".into())), "{}", front.log());
    let waited = trickled.await.unwrap();
    assert!(waited < Duration::from_secs(6), "{waited:?}");

    let mut log = String::new();
    let logged = eventually(Duration::from_secs(5), || {
        log = nginx.proxy_protocol_log();
        log.matches("203.0.113.7:40000>198.51.100.1:443").count() == 2
            && log.matches(">127.0.0.1:").count() == 2
    });
    assert!(logged, "nginx:\n{log}");
    assert!(!log.contains("203.0.113.99"), "{log}");

    front.terminate();
    assert!(front.wait_exit(Duration::from_secs(20)).is_some());
    let log = front.log();
    assert!(
        log.contains(
            "accepted=2 local=2 unlisted=2 missing=1 malformed=5 timed_out=1 proxy protocol counters"
        ) || log.contains(
            "proxy protocol counters accepted=2 local=2 unlisted=2 missing=1 malformed=5 timed_out=1"
        ),
        "{log}"
    );
}

/// A terminated proxy site behind a balancer: the origin's forwarding fields and
/// webship's access log name the carried client, and `trusted_proxies` is judged
/// on it (a trusted L7 proxy behind the balancer keeps its X-Forwarded-For).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_site_forwards_the_carried_client() {
    let env = Env::new();
    let origin = Origin::start().await;
    let (cert, key) = env.leaf("proxy", &["proxy.test"]);
    let server = Server::start(
        env.dir.path(),
        &format!(
            r#"listen = "127.0.0.1:{{port}}"
workers = 2
accept_proxy_protocol = ["127.0.0.1/32"]

[reverse_proxy]
enabled = true
tls_termination = true
trusted_proxies = ["203.0.113.0/24"]
[reverse_proxy.tls]
cert = "{}"
key = "{}"
[[reverse_proxy.routes]]
domain = "proxy.test"
path_prefix = "/"
upstreams = ["{}"]
"#,
            cert.display(),
            key.display(),
            origin.addr
        ),
    );
    let at = server.addr();
    for (proto, header, port) in [
        (Proto::H1, v1("198.51.100.9:5001", "192.0.2.1:443"), 5001),
        (Proto::H2, v2("198.51.100.9:5002", "192.0.2.1:443", &[]), 5002),
    ] {
        // Not a trusted proxy: its own X-Forwarded-For is dropped.
        let got = request(&env, at, &header, proto, &[("x-forwarded-for", "10.9.9.9")]).await;
        assert_eq!(got, 200, "{}", server.log());
        let seen = origin.seen().pop().unwrap();
        assert_eq!(seen.header("x-forwarded-for"), Some("198.51.100.9"), "{proto:?}");
        let forwarded = seen.header("forwarded").unwrap_or_default();
        assert!(forwarded.starts_with("for=198.51.100.9;"), "{forwarded}");
        let log = server.access_log_path().unwrap();
        let named = |l: &serde_json::Value| l["client"] == "198.51.100.9" && l["client_port"] == port;
        assert!(
            eventually(Duration::from_secs(10), || {
                check_access_log(log).unwrap().iter().any(named)
            }),
            "access log: {:?}",
            check_access_log(log)
        );
    }
    // A trusted proxy (carried): its X-Forwarded-For is kept and extended.
    let header = v2("203.0.113.7:5003", "192.0.2.1:443", &[]);
    let got = request(&env, at, &header, Proto::H2, &[("x-forwarded-for", "10.9.9.9")]).await;
    assert_eq!(got, 200);
    let seen = origin.seen().pop().unwrap();
    assert_eq!(seen.header("x-forwarded-for"), Some("10.9.9.9, 203.0.113.7"));
}

/// One GET /echo for proxy.test over `proto`, behind `header` from the balancer.
async fn request(env: &Env, at: SocketAddr, header: &[u8], proto: Proto, headers: &[(&str, &str)]) -> u16 {
    let mut tcp = connect_from(BALANCER, at).await;
    tcp.write_all(header).await.unwrap();
    let tls = webship_testkit::http::tls(tcp, "proxy.test", env.client(proto.alpn()))
        .await
        .unwrap();
    let authority = format!("proxy.test:{}", at.port());
    let mut conn = Conn::handshake(tls, proto, &authority, Tuning::default())
        .await
        .unwrap();
    let mut body = webship_tests::client::Collect::default();
    let parts = conn.fetch_into("GET", "/echo", headers, &mut body).await.unwrap();
    conn.close().await;
    parts.status.as_u16()
}
