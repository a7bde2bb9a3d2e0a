//! The subsystem families of `/metrics` (docs/metrics.md) move as real traffic
//! drives them: one test per subsystem, each scraping the admin listener of a real
//! daemon after real clients — the test kit's h2 client and aioquic (h3) for the
//! transports, nginx and a refused port behind the proxy, aioquic's WebTransport
//! client, and a second webship behind a passthrough front, whose figures must
//! agree with `webship stats`.

use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use webship_tests::client::{fetch, H3Client, H3Options, Proto};
use webship_tests::nginx::Nginx;
use webship_tests::origin::Origin;
use webship_tests::server::{eventually, free_port, refused_port};
use webship_tests::Server;

use crate::support::{aioquic_fetch, origin_server, passthrough_config, pattern, stats_json, Env, HOST, MIB};
use crate::webtransport::wt;

const ZERO_COPY: &str = "webship_h3_stream_write_bytes_total{path=\"zero_copy\"}";
const COPIED: &str = "webship_h3_stream_write_bytes_total{path=\"copied\"}";
/// Chunks under this are copied into quinn rather than handed over (16 KiB).
const SMALL: usize = 16 * 1024;

/// `[admin]` on a free loopback port: the TOML and the address.
pub(crate) fn admin() -> (String, SocketAddr) {
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port().unwrap()));
    (format!("[admin]\nlisten = \"{addr}\"\n"), addr)
}

/// The TLS-terminating proxy site `proxy.test` with the admin listener: `routes`
/// (`[[reverse_proxy.routes]]` tables, `{host}` for the site's name) come before the
/// catch-all route to `upstream`. The server and the admin address.
fn proxy_with_admin(env: &Env, routes: &str, upstream: SocketAddr) -> (Server, SocketAddr) {
    let (admin_toml, admin) = admin();
    let host = "proxy.test";
    let (cert, key) = env.leaf("proxy", &[host]);
    let server = env.start(&format!(
        "{admin_toml}\n[reverse_proxy]\nenabled = true\ntls_termination = true\n\
         [reverse_proxy.tls]\ncert = \"{}\"\nkey = \"{}\"\n{}\
         [[reverse_proxy.routes]]\ndomain = \"{host}\"\npath_prefix = \"/\"\nupstreams = [\"{upstream}\"]\n",
        cert.display(),
        key.display(),
        routes.replace("{host}", host),
    ));
    (server, admin)
}

/// One scrape of `GET /metrics` (Prometheus text).
pub(crate) struct Scrape(String);

impl Scrape {
    pub(crate) fn take(admin: SocketAddr) -> Scrape {
        let out = Command::new("curl")
            .args(["--silent", "--fail", "--max-time", "10"])
            .arg(format!("http://{admin}/metrics"))
            .output()
            .expect("curl");
        assert!(
            out.status.success(),
            "GET /metrics on {admin} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Scrape(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The value of exactly `series` (`name{labels}` as the daemon writes it).
    pub(crate) fn get(&self, series: &str) -> Option<f64> {
        self.0
            .lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .map(|v| {
                v.trim()
                    .parse()
                    .unwrap_or_else(|e| panic!("{series}: {v:?}: {e}"))
            })
    }

    /// Like [`Scrape::get`], and the series must be there.
    pub(crate) fn value(&self, series: &str) -> f64 {
        self.get(series)
            .unwrap_or_else(|| panic!("no series {series} in the scrape:\n{}", self.0))
    }
}

/// Scrapes until `ready` holds (at most 10 s: a connection's figures are added
/// when the server has closed it, shortly after the client has gone).
fn scrape_until(admin: SocketAddr, what: &str, ready: impl Fn(&Scrape) -> bool) -> Scrape {
    let mut last = Scrape(String::new());
    let done = eventually(Duration::from_secs(10), || {
        last = Scrape::take(admin);
        ready(&last)
    });
    assert!(done, "{what} never showed in /metrics:\n{}", last.0);
    last
}

/// An h2 download goes out in write batches; an h3 download leaves its QUIC
/// connection's packets, datagrams, RTT, window, MTU and GSO batch in the
/// figures once the connection has ended, and its bulk response switched it to BBR.
#[tokio::test]
async fn transports_h2_batches_and_quic_connection_stats() {
    let env = Env::new();
    let len = 3 * MIB as usize + 11;
    env.write("big.bin", &pattern(len));
    let (toml, admin) = admin();
    let server = env.start(&toml);

    let h2 = env.get(Proto::H2, &server, "/big.bin", &[]).await;
    assert_eq!((h2.status.as_u16(), h2.len), (200, len as u64));
    let s = Scrape::take(admin);
    let writes = s.value("webship_h2_write_batch_bytes_count");
    let bytes = s.value("webship_h2_write_batch_bytes_sum");
    assert!(
        bytes >= len as f64,
        "the batches carried {bytes} bytes, less than the {len}-byte body"
    );
    // 128 KiB batches: a 3 MiB body in far fewer writes than its 16 KiB frames.
    assert!(
        (1.0..=(len / 16_384) as f64).contains(&writes),
        "{writes} writes for {len} bytes: the batch did not batch"
    );
    println!(
        "h2: {len} body bytes in {writes} TLS writes of {:.0} bytes on average",
        bytes / writes
    );
    if std::fs::read_to_string("/proc/sys/net/ipv4/tcp_available_congestion_control")
        .is_ok_and(|a| a.split_whitespace().any(|c| c == "bbr"))
    {
        let set = s.value("webship_tcp_bbr_switches_total{result=\"set\"}");
        assert!(set >= 1.0, "BBR is available, yet no TCP connection was switched");
    }
    assert_eq!(s.value("webship_quic_rtt_seconds_count"), 0.0, "no QUIC yet");

    let (got, line) = aioquic_fetch(server.port, HOST, "/big.bin", &env.ca_file(), &[]);
    assert_eq!(got["len"].as_u64(), Some(len as u64), "{line}");
    let s = scrape_until(admin, "the h3 connection's statistics", |s| {
        s.get("webship_quic_rtt_seconds_count") == Some(1.0)
    });
    let sent = s.value("webship_quic_udp_bytes_total{direction=\"sent\"}");
    assert!(sent > len as f64, "{sent} UDP bytes sent for a {len}-byte body");
    let packets = s.value("webship_quic_packets_sent_total");
    let datagrams = s.value("webship_quic_udp_datagrams_total{direction=\"sent\"}");
    let ios = s.value("webship_quic_udp_ios_total{direction=\"sent\"}");
    assert!(
        packets >= datagrams && datagrams >= ios && ios >= 1.0,
        "packets {packets} ≥ datagrams {datagrams} ≥ send calls {ios} ≥ 1"
    );
    assert!(s.value("webship_quic_udp_datagrams_total{direction=\"received\"}") >= 1.0);
    for histogram in [
        "webship_quic_congestion_window_bytes",
        "webship_quic_path_mtu_bytes",
        "webship_quic_gso_batch_datagrams",
    ] {
        assert_eq!(
            s.value(&format!("{histogram}_count")),
            1.0,
            "{histogram}: one connection ended"
        );
    }
    // Loopback: the RTT is well under the 100 ms bucket, and DPLPMTUD probed and
    // raised the MTU above QUIC's 1200-byte start during a 3 MiB transfer.
    assert_eq!(s.value("webship_quic_rtt_seconds_bucket{le=\"0.1\"}"), 1.0);
    assert!(s.value("webship_quic_mtu_probes_total{result=\"sent\"}") >= 1.0);
    // Exported, and none here: a fallback would have left this path at 1200 bytes,
    // which the assertion below rules out.
    assert_eq!(s.value("webship_quic_mtu_black_holes_total"), 0.0);
    assert_eq!(
        s.value("webship_quic_path_mtu_bytes_bucket{le=\"1200.0\"}"),
        0.0,
        "the path MTU stayed at 1200"
    );
    let (lost, lost_bytes) = (
        s.value("webship_quic_packets_lost_total"),
        s.value("webship_quic_lost_bytes_total"),
    );
    assert!(
        lost <= packets && (lost == 0.0) == (lost_bytes == 0.0),
        "{lost} packets ({lost_bytes} bytes) lost of {packets}"
    );
    println!(
        "h3: {packets} packets in {datagrams} datagrams over {ios} send calls, {lost} lost; \
         RTT {:.3} ms, window {} bytes, MTU {} bytes",
        s.value("webship_quic_rtt_seconds_sum") * 1e3,
        s.value("webship_quic_congestion_window_bytes_sum"),
        s.value("webship_quic_path_mtu_bytes_sum"),
    );
    assert!(
        s.value("webship_quic_bbr_switches_total") >= 1.0,
        "a {len}-byte response switches its connection to BBR"
    );
}

/// The window metric is the congestion controller's window, not the figure quinn's
/// statistics carry, which slow start raises 1.6 times for quinn's pacer
/// (`h3::pacing`). A 1 KiB response over a 1200-byte ceiling (no DPLPMTUD growth)
/// without the BBR switch leaves CUBIC in slow start, near its initial 32 × 1200
/// bytes, with nothing in flight when the connection ends: the raised figure would be
/// 61,440 or more.
#[tokio::test]
async fn the_quic_window_metric_is_the_controllers_window() {
    let env = Env::new();
    env.write("small.bin", &pattern(1024));
    let (toml, admin) = admin();
    let server = env.start(&format!(
        "{toml}\n[runtime.settings]\nh3_mtu_upper_bound_bytes = \"1200\"\n[kernel]\nbbr = \"off\"\n"
    ));
    let (got, line) = aioquic_fetch(server.port, HOST, "/small.bin", &env.ca_file(), &[]);
    assert_eq!(got["len"].as_u64(), Some(1024), "{line}");
    let s = scrape_until(admin, "the h3 connection's window", |s| {
        s.get("webship_quic_congestion_window_bytes_count") == Some(1.0)
    });
    let window = s.value("webship_quic_congestion_window_bytes_sum");
    assert!(
        (38_400.0..61_440.0).contains(&window),
        "window {window} bytes at the end: CUBIC's is 38,400 plus what slow start added"
    );
}

/// HTTP/3 response bodies reach quinn without a userspace copy: the body bytes of a
/// file and of a body relayed from an upstream are counted under `zero_copy` but for
/// chunks under 16 KiB (a file's tail, a relayed read that came alone), and what was
/// copied besides is only frame headers, header sections and the control streams (a
/// few bytes per chunk, nowhere near the body). Before the backend of `h3/backend.rs`
/// h3-quinn copied every DATA payload into quinn's send buffer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h3_bodies_reach_quinn_without_a_copy() {
    let env = Env::new();
    let len = 3 * MIB as usize + 7;
    let data = pattern(len);
    env.write("big.bin", &data);
    let origin_root = env.dir.path().join("origin");
    std::fs::create_dir(&origin_root).unwrap();
    let relayed = pattern(2 * MIB as usize + 3);
    std::fs::write(origin_root.join("up.bin"), &relayed).unwrap();
    let nginx = Nginx::start(&origin_root);
    let (server, admin) = proxy_with_admin(&env, "", nginx.addr);
    let proxy_host = "proxy.test";
    let s = Scrape::take(admin);
    assert_eq!((s.value(ZERO_COPY), s.value(COPIED)), (0.0, 0.0), "no HTTP/3 yet");

    let mut h3 = H3Client::connect(server.addr(), HOST, &env.client(b"h3"), &H3Options::default())
        .await
        .unwrap();
    let got = h3.fetch("GET", "/big.bin", &[]).await;
    assert_eq!((got.status.as_u16(), got.len), (200, len as u64));
    assert!(got.body == data, "the file arrived altered");
    h3.close().await;
    let s = Scrape::take(admin);
    let (zero_copy, copied) = (s.value(ZERO_COPY), s.value(COPIED));
    println!("file: {zero_copy} bytes handed to quinn without a copy, {copied} copied");
    // The file's last chunk is copied if it is under 16 KiB.
    assert!(
        zero_copy <= len as f64 && zero_copy > (len - SMALL) as f64,
        "{zero_copy} of {len} body bytes went without a copy: all but a small tail should"
    );
    // Each DATA frame header is at most 9 bytes; the body took more than 24 chunks
    // of at most 128 KiB, and the header section and control streams a few hundred.
    assert!(
        (1.0..(4096 + SMALL) as f64).contains(&copied),
        "{copied} bytes copied for a {len}-byte file: the body was copied"
    );

    let mut h3 = h3_client(&env, &server, proxy_host).await;
    let got = h3.fetch("GET", "/up.bin", &[]).await;
    assert_eq!((got.status.as_u16(), got.len), (200, relayed.len() as u64));
    assert!(got.body == relayed, "the relayed body arrived altered");
    h3.close().await;
    let s = Scrape::take(admin);
    let (zero_copy, copied) = (s.value(ZERO_COPY) - zero_copy, s.value(COPIED) - copied);
    println!("proxy: {zero_copy} bytes handed to quinn without a copy, {copied} copied");
    // nginx over loopback fills reads of 16 KiB and more; only a read that came
    // alone and short (the tail, a moment the socket was empty) is copied.
    assert!(
        zero_copy <= relayed.len() as f64 && zero_copy >= (relayed.len() / 2) as f64,
        "{zero_copy} of {} relayed body bytes went without a copy: most should",
        relayed.len()
    );
    assert!(
        zero_copy + copied >= relayed.len() as f64,
        "{zero_copy} + {copied} bytes written for a {}-byte relayed body",
        relayed.len()
    );
}

/// Relayed chunks under 16 KiB are copied into quinn, not handed over: quinn keeps
/// a chunk it was handed until the client acknowledges it, and a small chunk of an
/// upstream's read buffer would keep the whole buffer alive while the send window
/// counts only the chunk. An origin trickling 10-byte frames puts every body byte
/// under `copied` and none under `zero_copy` (before the fix, all went `zero_copy`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h3_small_relayed_chunks_are_copied() {
    let env = Env::new();
    let origin = Origin::start().await;
    let (server, admin) = proxy_with_admin(&env, "", origin.addr);
    let proxy_host = "proxy.test";
    let before = Scrape::take(admin);
    let mut h3 = h3_client(&env, &server, proxy_host).await;
    // 30 frames of 10 bytes, 5 ms apart: each reaches the proxy alone.
    let len = 300;
    let got = h3.fetch("GET", "/slow/300/5/10", &[]).await;
    assert_eq!((got.status.as_u16(), got.len), (200, len as u64));
    assert!(got.body == pattern(len), "the trickled body arrived altered");
    h3.close().await;
    let after = Scrape::take(admin);
    let zero_copy = after.value(ZERO_COPY) - before.value(ZERO_COPY);
    let copied = after.value(COPIED) - before.value(COPIED);
    println!("trickle: {zero_copy} bytes handed to quinn without a copy, {copied} copied");
    assert_eq!(
        zero_copy, 0.0,
        "small relayed chunks were handed to quinn uncopied"
    );
    assert!(
        copied >= len as f64,
        "{copied} bytes copied for a {len}-byte trickled body"
    );
}

/// A route whose only upstream refuses connections counts an `unreachable` error
/// and an ejection for that upstream, and no connect; a live nginx upstream counts
/// its connect, its pooled connection and its response time.
#[tokio::test]
async fn proxy_upstream_errors_by_kind_and_pool() {
    let env = Env::new();
    let origin_root = env.dir.path().join("origin");
    std::fs::create_dir(&origin_root).unwrap();
    std::fs::write(origin_root.join("up.bin"), pattern(100_000)).unwrap();
    let nginx = Nginx::start(&origin_root);
    // Bound, never listening: a connect is refused.
    let (_held, dead_port) = refused_port().unwrap();
    let dead = SocketAddr::from(([127, 0, 0, 1], dead_port));
    let dead_route =
        format!("[[reverse_proxy.routes]]\ndomain = \"{{host}}\"\npath_prefix = \"/dead/\"\nupstreams = [\"{dead}\"]\n");
    let (server, admin) = proxy_with_admin(&env, &dead_route, nginx.addr);
    let proxy_host = "proxy.test";
    let get = |path: &'static str| {
        let client = env.client(Proto::H2.alpn());
        fetch(Proto::H2, server.addr(), proxy_host, client, "GET", path, &[])
    };
    let failed = get("/dead/x").await;
    assert_eq!(failed.status, 502, "a refused upstream is a 502");
    let ok = get("/up.bin").await;
    assert_eq!((ok.status.as_u16(), ok.len), (200, 100_000));

    let s = Scrape::take(admin);
    let of =
        |name: &str, upstream: SocketAddr, extra: &str| format!("{name}{{upstream=\"{upstream}\"{extra}}}");
    assert_eq!(
        s.value(&of(
            "webship_proxy_upstream_errors_total",
            dead,
            ",kind=\"unreachable\""
        )),
        1.0
    );
    assert_eq!(
        s.value(&of("webship_proxy_upstream_ejections_total", dead, "")),
        1.0
    );
    assert_eq!(
        s.value(&of("webship_proxy_upstream_connects_total", dead, "")),
        0.0
    );
    assert_eq!(s.value(&of("webship_proxy_upstream_connections", dead, "")), 0.0);
    assert_eq!(
        s.get(&of("webship_proxy_upstream_response_seconds_count", dead, "")),
        None,
        "nothing answered from the dead upstream"
    );
    let up = nginx.addr;
    assert_eq!(s.value(&of("webship_proxy_upstream_connects_total", up, "")), 1.0);
    assert_eq!(
        s.value(&of("webship_proxy_upstream_connections", up, "")),
        1.0,
        "the connection waits idle in the pool"
    );
    assert_eq!(
        s.value(&of("webship_proxy_upstream_response_seconds_count", up, "")),
        1.0
    );
    for line in
        s.0.lines()
            .filter(|l| l.starts_with("webship_proxy_upstream_errors_total"))
    {
        assert!(line.contains(&dead.to_string()), "an error nobody caused: {line}");
    }
}

/// A WebTransport echo session counts its session, streams, datagrams and its
/// clean close; a session over the stream limit counts its limit close by code.
#[tokio::test]
async fn webtransport_sessions_streams_datagrams_and_closes() {
    let env = Env::new();
    let (admin_toml, admin) = admin();
    let origin = "https://app.test";
    let server = Server::start(
        env.dir.path(),
        &format!(
            "listen = \"127.0.0.1:{{port}}\"\nworkers = 2\n{admin_toml}\n[[sites]]\ndomain = \"{HOST}\"\nroot = \"{}\"\n\
             [sites.tls]\ncert = \"{}\"\nkey = \"{}\"\n[sites.webtransport]\npath = \"/wt\"\nallowed_origins = [\"{origin}\"]\n\
             max_streams_per_session = 3\n",
            env.root.display(),
            env.cert.display(),
            env.key.display()
        ),
    );
    let echo = wt(
        &env,
        server.addr(),
        HOST,
        "/wt?mode=echo",
        origin,
        &["echo", "65536", "20"],
    );
    assert_eq!(echo["status"], 200, "{echo}");
    let over = wt(
        &env,
        server.addr(),
        HOST,
        "/wt?mode=echo",
        origin,
        &["streams", "5"],
    );
    assert_eq!(over["close_code"].as_u64(), Some(0x5701), "{over}");

    let site = format!("site=\"{HOST}\"");
    let s = scrape_until(admin, "both sessions' ends", |s| {
        s.get(&format!("webship_webtransport_sessions_active{{{site}}}")) == Some(0.0)
    });
    assert_eq!(
        s.value(&format!("webship_webtransport_sessions_total{{{site}}}")),
        2.0
    );
    assert_eq!(
        s.value(&format!(
            "webship_webtransport_closed_total{{{site},code=\"done\"}}"
        )),
        1.0
    );
    assert_eq!(
        s.value(&format!(
            "webship_webtransport_closed_total{{{site},code=\"too_many_streams\"}}"
        )),
        1.0
    );
    let streams = s.value(&format!("webship_webtransport_streams_total{{{site}}}"));
    assert!(streams >= 2.0, "echo opens a bidi and a uni stream: {streams}");
    let bytes_out = s.value(&format!(
        "webship_webtransport_stream_bytes_total{{{site},direction=\"out\"}}"
    ));
    assert!(bytes_out >= 2.0 * 65_536.0, "echoed stream bytes: {bytes_out}");
    let datagrams_in = s.value(&format!(
        "webship_webtransport_datagrams_total{{{site},direction=\"in\"}}"
    ));
    assert!(datagrams_in >= 1.0, "datagrams the client sent: {datagrams_in}");
    assert_eq!(
        s.value(&format!(
            "webship_webtransport_refused_total{{{site},reason=\"origin\"}}"
        )),
        0.0
    );
}

/// A download through a passthrough front over TCP and one over QUIC, once per
/// pair of engines that move bytes differently (splice and the UDP relay: the
/// daemon; sockmap and the tc classifier: the kernel): the figures say which engine
/// ran and who moved the bytes, and agree with `webship stats` (the same counters).
#[tokio::test]
async fn passthrough_per_engine_matches_webship_stats() {
    let env = Env::new();
    let origin_root = env.dir.path().join("origin");
    std::fs::create_dir(&origin_root).unwrap();
    let len = MIB as usize + 3;
    std::fs::write(origin_root.join("pass.bin"), pattern(len)).unwrap();
    let origin = origin_server(&env, "a", "a.pass", &origin_root, "", "");
    // TCP and UDP engines in pairs: the daemon moves both, or the kernel does.
    for (engine, udp_engine) in [("splice", "userspace"), ("sockmap", "ebpf")] {
        let (admin_toml, admin) = admin();
        let origin_addr = origin.addr();
        let config = passthrough_config(
            &format!(
                "passthrough_engine = \"{engine}\"\nudp_upstream = \"{origin_addr}\"\nudp_engine = \"{udp_engine}\"\n"
            ),
            true,
            &[("a.pass", origin_addr)],
        );
        let front = Server::start(env.dir.path(), &format!("{config}\n{admin_toml}"));
        let client = env.client(Proto::H1.alpn());
        let got = fetch(Proto::H1, front.addr(), "a.pass", client, "GET", "/pass.bin", &[]).await;
        assert_eq!((got.status.as_u16(), got.len), (200, len as u64), "{engine}");
        passthrough_figures(engine, &front, admin, len as f64);

        let (got, line) = aioquic_fetch(front.port, "a.pass", "/pass.bin", &env.ca_file(), &[]);
        assert_eq!(got["len"].as_u64(), Some(len as u64), "{udp_engine}: {line}");
        let who = if udp_engine == "ebpf" {
            "kernel"
        } else {
            "userspace"
        };
        udp_figures(who, &front, admin, len as f64);
    }
}

/// After an HTTP/3 download through the front: its datagrams and its flow are
/// counted under the engine that relayed them (`who`), none under the other, and
/// `webship stats` says the same.
fn udp_figures(who: &str, front: &Server, admin: SocketAddr, len: f64) {
    let series = |name: &str, engine: &str, direction: Option<&str>| match direction {
        Some(d) => format!("webship_passthrough_udp_{name}_total{{engine=\"{engine}\",direction=\"{d}\"}}"),
        None => format!("webship_passthrough_udp_{name}_total{{engine=\"{engine}\"}}"),
    };
    // At least one full datagram per 8,972 bytes of body (the origin's DPLPMTUD
    // ceiling on loopback's route).
    let s = scrape_until(admin, "the QUIC datagrams", |s| {
        s.get(&series("packets", who, Some("down")))
            .is_some_and(|n| n >= len / 8972.0)
    });
    let other = if who == "kernel" { "userspace" } else { "kernel" };
    assert!(s.value(&series("packets", who, Some("up"))) >= 1.0, "{who}");
    assert!(
        s.value(&series("flows", who, None)) >= 1.0,
        "{who}: no flow counted"
    );
    for (name, direction) in [
        ("flows", None),
        ("packets", Some("up")),
        ("packets", Some("down")),
    ] {
        assert_eq!(
            s.get(&series(name, other, direction)).unwrap_or(0.0),
            0.0,
            "{who} relayed, yet {other} counted {name} {direction:?}"
        );
    }
    if s.get("webship_passthrough_linked_sockets").is_none() {
        return;
    }
    let pins = format!("/sys/fs/bpf/webship-e2e-{}", front.port);
    let mut compared = Vec::new();
    let agreed = eventually(Duration::from_secs(5), || {
        let s = Scrape::take(admin);
        let stats = stats_json(&pins);
        let c = &stats["counters"];
        let part = if who == "kernel" { "kernel" } else { "userspace" };
        compared = vec![
            (s.get(&series("flows", who, None)), c["udp_flows"][part].as_f64()),
            (
                s.get(&series("packets", who, Some("up"))),
                c["udp_packets_up"][part].as_f64(),
            ),
            (
                s.get(&series("packets", who, Some("down"))),
                c["udp_packets_down"][part].as_f64(),
            ),
        ];
        compared.iter().all(|(m, st)| m.is_some() && m == st)
    });
    assert!(
        agreed,
        "{who}: /metrics vs webship stats (UDP flows, packets up, down): {compared:?}"
    );
    println!("UDP {who}: /metrics and webship stats agree: {compared:?}");
}

fn passthrough_figures(engine: &str, front: &Server, admin: SocketAddr, len: f64) {
    // The client has read the body: every byte of it has been counted (or is about
    // to be: an engine counts after its write returns). The connection may stay
    // open (keep-alive), so nothing here waits for its end.
    let s = scrape_until(admin, "the body's bytes", |s| {
        s.get("webship_passthrough_bytes_total{direction=\"down\"}")
            .is_some_and(|n| n >= len)
    });
    let series = |who: &str, direction: &str| {
        format!("webship_passthrough_engine_bytes_total{{engine=\"{who}\",direction=\"{direction}\"}}")
    };
    assert_eq!(
        s.value(&format!("webship_passthrough_engine{{engine=\"{engine}\"}}")),
        1.0
    );
    let user_down = s.value(&series("userspace", "down"));
    let kernel_down = s.get(&series("kernel", "down"));
    assert_eq!(
        s.value("webship_passthrough_bytes_total{direction=\"down\"}"),
        user_down + kernel_down.unwrap_or(0.0),
        "{engine}: the totals are the engines summed"
    );
    match engine {
        "splice" => {
            assert!(user_down >= len, "{engine}: the daemon moved {user_down} bytes");
            assert_eq!(
                kernel_down.unwrap_or(0.0),
                0.0,
                "splice moves nothing through eBPF"
            );
        }
        _ => assert!(
            kernel_down.is_some_and(|k| k > len / 2.0),
            "sockmap: the kernel redirected {kernel_down:?} of {len} bytes"
        ),
    }
    // With eBPF loaded, `webship stats` reads the pinned maps (the daemon publishes
    // its own counters there twice a second): the same figures, and the same
    // linked sockets.
    if s.get("webship_passthrough_linked_sockets").is_none() {
        assert_ne!(engine, "sockmap", "the sockmap engine runs without eBPF?");
        println!("{engine}: eBPF not loaded, only the userspace figures were checked");
        return;
    }
    let pins = format!("/sys/fs/bpf/webship-e2e-{}", front.port);
    let mut compared = Vec::new();
    let agreed = eventually(Duration::from_secs(5), || {
        let s = Scrape::take(admin);
        let stats = stats_json(&pins);
        let c = &stats["counters"];
        compared = vec![
            (
                s.get(&series("userspace", "down")),
                c["bytes_down"]["userspace"].as_f64(),
            ),
            (
                s.get(&series("userspace", "up")),
                c["bytes_up"]["userspace"].as_f64(),
            ),
            (
                s.get(&series("kernel", "down")),
                c["bytes_down"]["kernel"].as_f64(),
            ),
            (s.get(&series("kernel", "up")), c["bytes_up"]["kernel"].as_f64()),
            (
                s.get("webship_passthrough_linked_sockets"),
                stats["linked_sockets"].as_f64(),
            ),
        ];
        compared.iter().all(|(m, st)| m.is_some() && m == st)
    });
    assert!(
        agreed,
        "{engine}: /metrics vs webship stats (userspace down, up; kernel down, up; linked sockets): {compared:?}"
    );
    println!("{engine}: /metrics and webship stats agree: {compared:?}");
}

/// 8 MiB over one h3 connection from a server whose `[runtime.settings]` are
/// `settings`, at the 1452-byte ceiling every internet client gets; checked
/// byte-exact. The server's metrics afterwards.
async fn eight_mib_over_h3_at_1452(settings: &str) -> Scrape {
    use webship_tests::client::hex;
    use webship_tests::fixture::sha256_file;

    let env = Env::new();
    env.write("eight.bin", &pattern(8 * MIB as usize));
    let want = hex(&sha256_file(&env.root.join("eight.bin")).unwrap());
    let (toml, admin) = admin();
    let server = env.start(&format!(
        "{toml}[runtime.settings]\nh3_mtu_upper_bound_bytes = \"1452\"\n{settings}"
    ));
    let mut h3 = H3Client::connect(server.addr(), HOST, &env.client(b"h3"), &H3Options::bulk())
        .await
        .expect("h3 connection");
    let got = h3.fetch("GET", "/eight.bin", &[]).await;
    h3.close().await;
    assert_eq!(got.status, 200);
    assert_eq!(hex(&got.sha256), want, "body digest");
    Scrape::take(admin)
}

/// Without a delay, one connection's GSO batches leave together: the sends of a bulk
/// download carry more datagrams than quinn puts in one transmit (ten), and the body
/// arrives byte-exact. Before the sends were gathered, nothing went through the
/// queue (0 messages).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_s_gso_batches_leave_as_larger_sends() {
    /// quinn's most datagrams per transmit (`MAX_TRANSMIT_SEGMENTS`).
    const QUINN_BATCH: f64 = 10.0;
    let s = eight_mib_over_h3_at_1452("").await;
    let messages = s.value("webship_quic_send_batch_messages_sum");
    let datagrams = s.value("webship_quic_send_batch_datagrams_total");
    println!("{datagrams} datagrams in {messages} GSO sends");
    assert!(messages > 0.0, "no send was gathered");
    assert!(
        datagrams * 1452.0 > 4.0 * MIB as f64,
        "{datagrams} gathered datagrams carry under half the body"
    );
    assert!(
        datagrams / messages > QUINN_BATCH,
        "{datagrams} datagrams in {messages} sends: none larger than quinn's own"
    );
}

/// With `h3_gso = "0"` quinn sends single datagrams, which never start a gathered
/// send: a bulk download arrives byte-exact, quinn's transmits are one datagram each,
/// and none of them was gathered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_gso_nothing_is_gathered_and_the_body_arrives() {
    let s = eight_mib_over_h3_at_1452("h3_gso = \"0\"\n").await;
    let sent = s.value("webship_quic_udp_datagrams_total{direction=\"sent\"}");
    let transmits = s.value("webship_quic_udp_ios_total{direction=\"sent\"}");
    let gathered = s.value("webship_quic_send_batch_datagrams_total");
    println!("{sent} datagrams in {transmits} transmits, {gathered} gathered");
    assert!(
        sent * 1452.0 > 8.0 * MIB as f64,
        "{sent} datagrams cannot carry the body"
    );
    assert_eq!(sent, transmits, "quinn batched datagrams with GSO off");
    assert_eq!(gathered, 0.0, "single datagrams were gathered into GSO sends");
}

/// With `h3_send_batch_delay_us` on, sixteen h3 connections downloading at once get
/// byte-exact bodies and their packets leave together: the batching `sendmmsg` calls
/// carry several messages (a connection's gathered send each) on average.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_send_batching_puts_many_connections_in_one_sendmmsg() {
    use webship_tests::client::{hex, H3Client, H3Options};
    use webship_tests::fixture::sha256_file;

    const CONNECTIONS: usize = 16;
    let env = Env::new();
    env.write("one.bin", &pattern(MIB as usize));
    let want = hex(&sha256_file(&env.root.join("one.bin")).unwrap());
    let (toml, admin) = admin();
    let server = env.start(&format!(
        "{toml}[runtime.settings]\nh3_send_batch_delay_us = \"1000\"\n"
    ));
    let tls = env.client(b"h3");
    let downloads = (0..CONNECTIONS).map(|i| {
        let tls = tls.clone();
        let addr = server.addr();
        tokio::spawn(async move {
            let mut h3 = H3Client::connect(addr, HOST, &tls, &H3Options::bulk())
                .await
                .unwrap_or_else(|e| panic!("connection {i}: {e:#}"));
            let got = h3.fetch("GET", "/one.bin", &[]).await;
            h3.close().await;
            got
        })
    });
    for (i, d) in downloads.collect::<Vec<_>>().into_iter().enumerate() {
        let got = tokio::time::timeout(Duration::from_secs(60), d)
            .await
            .unwrap_or_else(|_| panic!("download {i} did not finish in 60 s"))
            .unwrap();
        assert_eq!((got.status.as_u16(), got.len), (200, MIB), "download {i}");
        assert_eq!(hex(&got.sha256), want, "download {i}: body digest");
    }
    let s = Scrape::take(admin);
    let calls = s.value("webship_quic_send_batch_messages_count");
    let messages = s.value("webship_quic_send_batch_messages_sum");
    let datagrams = s.value("webship_quic_send_batch_datagrams_total");
    println!(
        "{messages} messages, {datagrams} datagrams in {calls} sendmmsg calls, refused {}, dropped {}",
        s.value("webship_quic_send_batch_refused_total"),
        s.value("webship_quic_send_batch_dropped_total")
    );
    // Loopback's route gives DPLPMTUD an 8972-byte ceiling (`auto`).
    assert!(
        datagrams * 8972.0 > (CONNECTIONS as u64 * MIB) as f64,
        "{datagrams} batched datagrams cannot carry {CONNECTIONS} MiB: sends bypassed the queue"
    );
    // Without the delay a poll's end sends its connection's message, about one per
    // call (1.5 measured); with it, the calls carry several connections' (7.6).
    assert!(
        messages / calls > 2.0,
        "{messages} messages in {calls} sendmmsg calls: the delay gathered nothing across connections"
    );
}

/// An HTTP/3 client of `server` for `host`, default options.
async fn h3_client(env: &Env, server: &Server, host: &str) -> H3Client {
    H3Client::connect(server.addr(), host, &env.client(b"h3"), &H3Options::default())
        .await
        .unwrap()
}
