//! HTTP/3 against real clients: quinn + h3 (Rust) and aioquic (Python), the same files
//! semantics as h1/h2, concurrency, cancellation, Alt-Svc and the per-connection BBR
//! switch.

use std::net::SocketAddr;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::net::UdpSocket;

use webship_tests::client::{fetch_h3, hex, recv_body, request, H3Client, H3Options, Proto};
use webship_tests::server::eventually;
use webship_tests::{fixture, Server, FIXTURE_LEN};

use crate::support::{aioquic_fetch, assert_rss_within, pattern, Env, HOST, MIB};

/// Cross-connection send batching on (`h3_send_batch_delay_us`): the `_batched`
/// twins below run the same clients against it.
const BATCHED: &str = "[runtime.settings]\nh3_send_batch_delay_us = \"1000\"\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixture_with_quinn_h3_client() {
    quinn_fixture("").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixture_with_quinn_h3_client_batched() {
    quinn_fixture(BATCHED).await;
}

async fn quinn_fixture(config: &str) {
    let env = Env::new();
    fixture().place(&env.root, "fixture.bin").unwrap();
    let server = env.start(config);
    let got = fetch_h3(server.addr(), HOST, env.client(b"h3"), "GET", "/fixture.bin", &[]).await;
    assert_eq!(got.status, 200);
    assert_eq!(got.header("content-length"), FIXTURE_LEN.to_string());
    assert_eq!(got.len, FIXTURE_LEN);
    assert_eq!(hex(&got.sha256), hex(&fixture().sha256));
}

#[test]
fn fixture_with_aioquic() {
    aioquic_fixture("");
}

#[test]
fn fixture_with_aioquic_batched() {
    aioquic_fixture(BATCHED);
}

fn aioquic_fixture(config: &str) {
    let env = Env::new();
    fixture().place(&env.root, "fixture.bin").unwrap();
    env.write("data.bin", &pattern(10_000));
    let server = env.start(config);
    let ca = env.ca_file();
    let (full, line) = aioquic_fetch(server.port, HOST, "/fixture.bin", &ca, &[]);
    assert_eq!(full["status"], 200, "{line}");
    assert_eq!(full["len"], FIXTURE_LEN, "{line}");
    assert_eq!(full["sha256"], hex(&fixture().sha256));
    let (part, line) = aioquic_fetch(server.port, HOST, "/data.bin", &ca, &["range: bytes=100-199"]);
    assert_eq!(part["status"], 206, "{line}");
    assert_eq!(part["len"], 100);
    assert!(line.contains("bytes 100-199/10000"), "{line}");
}

#[tokio::test]
async fn files_semantics_match_h1_and_h2() {
    let env = Env::new();
    let data = pattern(10_000);
    env.write("data.bin", &data);
    std::fs::write(env.dir.path().join("secret.txt"), "secret").unwrap();
    let server = env.start("");
    let mut h3 = H3Client::connect(server.addr(), HOST, &env.client(b"h3"), &H3Options::default())
        .await
        .unwrap();

    let got = h3.fetch("GET", "/data.bin", &[("range", "bytes=10-19")]).await;
    assert_eq!(got.status, 206);
    assert_eq!(got.body, &data[10..20]);
    let got = h3.fetch("GET", "/data.bin", &[("range", "bytes=0-1,-2")]).await;
    assert_eq!(got.status, 206);
    assert!(got
        .header("content-type")
        .starts_with("multipart/byteranges; boundary="));
    let got = h3.fetch("GET", "/data.bin", &[("range", "bytes=99999-")]).await;
    assert_eq!(got.status, 416);
    assert_eq!(got.header("content-range"), "bytes */10000");
    let full = h3.fetch("GET", "/data.bin", &[]).await;
    assert_eq!(full.body, data);
    let etag = full.header("etag").to_owned();
    let got = h3.fetch("GET", "/data.bin", &[("if-none-match", &etag)]).await;
    assert_eq!(got.status, 304);
    let got = h3.fetch("HEAD", "/data.bin", &[]).await;
    assert_eq!((got.status.as_u16(), got.len), (200, 0));
    assert_eq!(got.header("content-length"), "10000");
    assert!(got.headers.get("alt-svc").is_none(), "no Alt-Svc over h3 itself");
    for path in ["/%2e%2e/secret.txt", "/..%5csecret.txt"] {
        let got = h3.fetch("GET", path, &[]).await;
        assert_eq!(got.status, 400, "{path}");
    }
    let got = h3.fetch("POST", "/data.bin", &[]).await;
    assert_eq!(got.status, 405);
    h3.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_concurrent_streams_on_one_connection() {
    thirty_two_streams("").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_concurrent_streams_on_one_connection_batched() {
    thirty_two_streams(BATCHED).await;
}

async fn thirty_two_streams(config: &str) {
    let env = Env::new();
    let data = pattern(2 * 1024 * 1024);
    env.write("data.bin", &data);
    let server = env.start(config);
    let h3 = H3Client::connect(server.addr(), HOST, &env.client(b"h3"), &H3Options::default())
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for i in 0..32u64 {
        let (mut send, origin) = (h3.send.clone(), h3.origin());
        let (start, end) = (i * 60_000, i * 60_000 + 59_999 + i * 1000);
        tasks.push(tokio::spawn(async move {
            let range = format!("bytes={start}-{end}");
            let (head, mut stream) = request(&mut send, &origin, "GET", "/data.bin", &[("range", &range)])
                .await
                .unwrap();
            assert_eq!(head.status, 206);
            let mut body = Vec::new();
            recv_body(&mut stream, &mut body).await.unwrap();
            (start as usize, end as usize, body)
        }));
    }
    for task in tasks {
        let (start, end, body) = task.await.unwrap();
        assert_eq!(body, &data[start..=end], "stream for {start}-{end}");
    }
    h3.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_download_frees_the_stream_and_the_connection_lives_on() {
    let env = Env::new();
    fixture().place(&env.root, "fixture.bin").unwrap();
    env.write("small.txt", b"small");
    let server = env.start("");
    let mut h3 = H3Client::connect(server.addr(), HOST, &env.client(b"h3"), &H3Options::default())
        .await
        .unwrap();
    let warm = h3
        .fetch("GET", "/fixture.bin", &[("range", "bytes=0-4194303")])
        .await;
    assert_eq!(warm.len, 4 * MIB);
    let base = server.rss();
    for _ in 0..3 {
        let (_, mut stream) = h3.send("GET", "/fixture.bin", &[]).await.unwrap();
        let mut got = 0u64;
        while got < 10 * MIB {
            use bytes::Buf;
            got += stream.recv_data().await.unwrap().unwrap().remaining() as u64;
        }
        // Dropping the request stream cancels it (STOP_SENDING). h3-quinn 0.0.10's
        // explicit stop_sending can panic while its read future holds the stream.
        drop(stream);
    }
    let got = h3.fetch("GET", "/small.txt", &[]).await;
    assert_eq!(got.body, b"small");
    // The server learns of each cancellation from the client's STOP_SENDING. A
    // response whose write waited while another filled the connection's window used
    // to miss it and wait for the send timeout (quinn answered Blocked, not Stopped:
    // `h3::backend::ask_stopped`); this failed about one run in six on a loaded
    // host. 20 s of slack for a loaded host stays well inside the 60 s send timeout,
    // so a server that ended the streams by timeout still fails here.
    assert!(
        eventually(Duration::from_secs(20), || server
            .log()
            .lines()
            .filter(|l| l.contains("h3: response not completed") && l.contains("Remote reset"))
            .count()
            == 3),
        "the server did not stop the three cancelled responses on the client's STOP_SENDING:\n{}",
        server.log()
    );
    assert_rss_within(&server, base, 24);
    h3.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_responses_switch_their_connection_to_bbr() {
    /// The first 8 MiB of the fixture over a fresh h3 connection to `server`.
    async fn eight_mib(env: &Env, server: &Server) -> u64 {
        let range = [("range", "bytes=0-8388607")];
        fetch_h3(
            server.addr(),
            HOST,
            env.client(b"h3"),
            "GET",
            "/fixture.bin",
            &range,
        )
        .await
        .len
    }
    let env = Env::new();
    fixture().place(&env.root, "fixture.bin").unwrap();
    env.write("small.txt", b"small");
    let server = env.start("");
    let switched = || server.log().matches("switches to BBR").count();
    let got = fetch_h3(server.addr(), HOST, env.client(b"h3"), "GET", "/small.txt", &[]).await;
    assert_eq!(got.status, 200);
    assert_eq!(switched(), 0, "a small response must not switch");
    assert_eq!(eight_mib(&env, &server).await, 8 * MIB);
    assert!(
        eventually(Duration::from_secs(2), || switched() == 1),
        "{}",
        server.log()
    );

    // `[kernel] bbr = "off"` never switches.
    let env = Env::new();
    fixture().place(&env.root, "fixture.bin").unwrap();
    let server = env.start("[kernel]\nbbr = \"off\"\n");
    assert_eq!(eight_mib(&env, &server).await, 8 * MIB);
    assert!(!server.log().contains("switches to BBR"));
}

/// Downloads 32 MiB over HTTP/3 with a client that accepts any payload size;
/// returns the datagrams the client received and their average size.
///
/// The client's socket holds 8 MiB (`SO_RCVBUFFORCE`, which needs root or
/// `CAP_NET_ADMIN`, as the suite runs; otherwise `net.core.rmem_max` caps it): with
/// the kernel's default 208 KiB it dropped up to a tenth of the datagrams on a busy
/// host, and about one download in 40 lost them in bursts that quinn's black-hole
/// detection took for an MTU failure, so the server fell back to 1200 bytes for a
/// minute.
async fn bulk_datagrams(env: &Env, server: &Server) -> (u64, u64) {
    let options = H3Options {
        force_receive_buffer: true,
        ..H3Options::bulk()
    };
    let mut h3 = H3Client::connect(server.addr(), HOST, &env.client(b"h3"), &options)
        .await
        .unwrap();
    let got = h3
        .fetch("GET", "/fixture.bin", &[("range", "bytes=0-33554431")])
        .await;
    assert_eq!((got.status.as_u16(), got.len), (206, 32 * MIB));
    let rx = h3.connection().stats().udp_rx;
    h3.close().await;
    (rx.datagrams, rx.bytes / rx.datagrams.max(1))
}

/// With GSO on (the default) and a DPLPMTUD ceiling of 9000 bytes, the bulk of a
/// download arrives in datagrams of the discovered size. quinn batched ten of them
/// into one 90 KB GSO send, which the kernel refuses whole (EMSGSIZE): before the
/// fix only loss probes and short batches got through, averaging 1.3–5 KB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gso_sends_at_the_large_mtu_dplpmtud_found() {
    let env = Env::new();
    fixture().place(&env.root, "fixture.bin").unwrap();
    let server = env.start("[runtime.settings]\nh3_mtu_upper_bound_bytes = \"9000\"\n");
    let (datagrams, average) = bulk_datagrams(&env, &server).await;
    assert!(
        average > 7000,
        "{datagrams} datagrams averaging {average} bytes: the server did not send at the 9000-byte MTU"
    );
}

/// With the default (`h3_mtu_upper_bound_bytes = "auto"`), DPLPMTUD's ceiling
/// follows the route: loopback's 65536-byte MTU gives 8972-byte datagrams, as TCP
/// takes a 65483-byte MSS there (before, every connection stopped at 1452). A
/// number still holds every connection to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_mtu_ceiling_follows_the_loopback_route() {
    let env = Env::new();
    fixture().place(&env.root, "fixture.bin").unwrap();
    let server = env.start("");
    let (datagrams, average) = bulk_datagrams(&env, &server).await;
    assert!(
        average > 7000,
        "{datagrams} datagrams averaging {average} bytes: the default ceiling did not follow loopback's MTU"
    );
    drop(server);

    let server = env.start("[runtime.settings]\nh3_mtu_upper_bound_bytes = \"1452\"\n");
    let (datagrams, average) = bulk_datagrams(&env, &server).await;
    assert!(
        average <= 1452,
        "{datagrams} datagrams averaging {average} bytes: a fixed 1452 ceiling was not kept"
    );
}

#[tokio::test]
async fn alt_svc_advertises_h3_only_for_h3_sites() {
    let env = Env::new();
    env.write("small.txt", b"small");
    let server = env.start("");
    for proto in [Proto::H1, Proto::H2] {
        let got = env.get(proto, &server, "/small.txt", &[]).await;
        assert_eq!(
            got.header("alt-svc"),
            format!("h3=\":{}\"; ma=86400", server.port),
            "{proto:?}"
        );
    }
    let env = Env::new();
    env.write("small.txt", b"small");
    let config = env
        .config("")
        .replace("[sites.tls]", "[sites.protocols]\nh3 = false\n[sites.tls]");
    let server = Server::start(env.dir.path(), &config);
    for proto in [Proto::H1, Proto::H2] {
        let got = env.get(proto, &server, "/small.txt", &[]).await;
        assert!(got.headers.get("alt-svc").is_none(), "{proto:?}");
    }
    assert!(
        !server.log().contains("udp for h3"),
        "no UDP endpoint without h3 sites"
    );
}

#[tokio::test]
async fn retry_validates_addresses_when_configured() {
    let env = Env::new();
    env.write("small.txt", b"small");
    let server = env.start("[runtime.settings]\nh3_retry = \"1\"\n");
    let got = fetch_h3(server.addr(), HOST, env.client(b"h3"), "GET", "/small.txt", &[]).await;
    assert_eq!(got.body, b"small", "a client that answers the Retry is served");
    assert!(server.log().contains("Retry) sent"), "{}", server.log());

    let server = env.start("");
    let got = fetch_h3(server.addr(), HOST, env.client(b"h3"), "GET", "/small.txt", &[]).await;
    assert_eq!(got.body, b"small");
    assert!(
        !server.log().contains("Retry) sent"),
        "no Retry when idle and not configured"
    );
}

#[test]
fn fixture_with_ngtcp2_client() {
    ngtcp2_fixture("");
}

#[test]
fn fixture_with_ngtcp2_client_batched() {
    ngtcp2_fixture(BATCHED);
}

fn ngtcp2_fixture(config: &str) {
    let env = Env::new();
    fixture().place(&env.root, "fixture.bin").unwrap();
    let server = env.start(config);
    let download = env.dir.path().join("ngtcp2");
    std::fs::create_dir(&download).unwrap();
    let out = Command::new("timeout")
        .args(["120", "gtlsclient", "--quiet", "--exit-on-all-streams-close"])
        .arg(format!("--download={}", download.display()))
        .args(["127.0.0.1", &server.port.to_string()])
        .arg(format!("https://{HOST}:{}/fixture.bin", server.port))
        .output()
        .expect("gtlsclient (ngtcp2-client) is required; `cargo xtask test` installs it");
    assert!(
        out.status.success(),
        "gtlsclient: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let file = download.join("fixture.bin");
    assert_eq!(std::fs::metadata(&file).unwrap().len(), FIXTURE_LEN);
    assert_eq!(
        hex(&webship_tests::fixture::sha256_file(&file).unwrap()),
        hex(&fixture().sha256)
    );
}

/// What a [`DelayedReturn`] saw the server send, in the order it arrived.
type Arrivals = Arc<Mutex<Vec<(Instant, usize)>>>;

/// A UDP relay on loopback that holds every client datagram for `delay` before it
/// reaches the server and passes the server's on at once, recording when each
/// arrived and its size: a path with a round trip of `delay`, on which the server
/// cannot have seen an acknowledgement of what it sent less than `delay` ago.
struct DelayedReturn {
    addr: SocketAddr,
    arrivals: Arrivals,
    /// When the relay received each client datagram, and when it forwarded it.
    forwarded: Arc<Mutex<Vec<(Instant, Instant)>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl DelayedReturn {
    async fn start(server: SocketAddr, delay: Duration) -> Self {
        let front = Arc::new(UdpSocket::bind("127.0.0.1:0").await.unwrap());
        let back = Arc::new(UdpSocket::bind("127.0.0.1:0").await.unwrap());
        back.connect(server).await.unwrap();
        let addr = front.local_addr().unwrap();
        let client = Arc::new(Mutex::new(None::<SocketAddr>));
        let arrivals = Arrivals::default();
        let forwarded = Arc::new(Mutex::new(Vec::new()));
        // The queue between receiving and forwarding is bounded (back-pressure on
        // the client's socket); the records grow by one per datagram of one download of a few MiB
        // download.
        let (held, mut due) = tokio::sync::mpsc::channel::<(Instant, Vec<u8>)>(4096);
        let inbound = {
            let (front, client) = (front.clone(), client.clone());
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65_535];
                while let Ok((n, from)) = front.recv_from(&mut buf).await {
                    *client.lock().unwrap() = Some(from);
                    if held.send((Instant::now(), buf[..n].to_vec())).await.is_err() {
                        break;
                    }
                }
            })
        };
        let release = {
            let (back, forwarded) = (back.clone(), forwarded.clone());
            tokio::spawn(async move {
                while let Some((received, datagram)) = due.recv().await {
                    tokio::time::sleep_until((received + delay).into()).await;
                    forwarded.lock().unwrap().push((received, Instant::now()));
                    let _ = back.send(&datagram).await;
                }
            })
        };
        let outbound = {
            let arrivals = arrivals.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65_535];
                while let Ok(n) = back.recv(&mut buf).await {
                    arrivals.lock().unwrap().push((Instant::now(), n));
                    let to = *client.lock().unwrap();
                    if let Some(to) = to {
                        let _ = front.send_to(&buf[..n], to).await;
                    }
                }
            })
        };
        Self {
            addr,
            arrivals,
            forwarded,
            tasks: vec![inbound, release, outbound],
        }
    }

    /// The sizes of the datagrams the server sent in its first round trip after the
    /// request reached it: from the first datagram after `request_forwarded_after`,
    /// up to the moment the relay forwarded the first client datagram it received
    /// after that datagram (the client's first acknowledgement of the response).
    /// Nothing the server sent before that moment can have been clocked by an
    /// acknowledgement of the response.
    fn first_round(&self, request_forwarded_after: Instant) -> Vec<usize> {
        let arrivals = self.arrivals.lock().unwrap();
        let forwarded = self.forwarded.lock().unwrap();
        let (start, _) = *arrivals
            .iter()
            .find(|(at, _)| *at > request_forwarded_after)
            .expect("no server datagram after the request reached the server");
        // The client's acknowledgements of the first data leave after it arrived
        // and reach the server no earlier than `delay` later.
        let (_, acked) = *forwarded
            .iter()
            .find(|(received, _)| *received > start)
            .expect("no client datagram after the response began");
        arrivals
            .iter()
            .filter(|(at, _)| *at >= start && *at < acked)
            .map(|&(_, len)| len)
            .collect()
    }
}

impl Drop for DelayedReturn {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// The sizes of the datagrams a response of `len` bytes puts on a 400 ms path in its
/// first round trip: a server with `settings` under `[runtime.settings]`, a client
/// with `options`, one small exchange first (the handshake is confirmed and the
/// server has its round-trip estimate; an idle connection's window does not grow on
/// its acks), then `idle` without traffic, then the response, its body checked.
/// quinn paces a round in bursts of at least ten datagrams about a quarter of the
/// round trip apart, so the last leaves ~0.75 of it after the first: a 400 ms trip
/// leaves ~100 ms for a loaded host's stalls.
async fn first_round_on_a_slow_path(
    settings: &str,
    options: &H3Options,
    len: usize,
    idle: Duration,
) -> Vec<usize> {
    const DELAY: Duration = Duration::from_millis(400);
    let env = Env::new();
    let body = pattern(len);
    env.write("body.bin", &body);
    env.write("small.txt", b"small");
    let server = env.start(&format!("[runtime.settings]\n{settings}"));
    let relay = DelayedReturn::start(server.addr(), DELAY).await;
    let mut h3 = H3Client::connect(relay.addr, HOST, &env.client(b"h3"), options)
        .await
        .unwrap();
    assert_eq!(h3.fetch("GET", "/small.txt", &[]).await.body, b"small");
    tokio::time::sleep(idle).await;
    let sent = Instant::now();
    let got = tokio::time::timeout(Duration::from_secs(30), h3.fetch("GET", "/body.bin", &[]))
        .await
        .expect("the response across a 400 ms path within 30 s");
    assert_eq!(got.body, body);
    h3.close().await;
    relay.first_round(sent + DELAY)
}

/// How many full datagrams a 1 MiB response puts in its first round trip on the
/// 400 ms path, with `settings`. The MTU stays at 1200 (no DPLPMTUD probes take
/// part of the window).
async fn first_round_datagrams(settings: &str) -> usize {
    let settings = format!("h3_mtu_upper_bound_bytes = \"1200\"\n{settings}");
    let round = first_round_on_a_slow_path(
        &settings,
        &H3Options::default(),
        MIB as usize,
        Duration::from_millis(50),
    )
    .await;
    round.iter().filter(|&&len| len >= 1200).count()
}

/// The initial window is counted in datagrams of the size DPLPMTUD has confirmed,
/// as TCP counts it in segments: on loopback, once probes of several KB have come
/// back (the client idles for a few round trips of the 400 ms path first), a 4 MiB
/// response's first round trip carries about 32 datagrams of that size, not the
/// 38,400 bytes 32 × 1200 make (what quinn's byte-counted CUBIC alone sends). Seen:
/// 287 KB (278–285 with a first version); the build before counted 52 KB (38,400
/// and a probe).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_initial_window_counts_datagrams_of_the_confirmed_size() {
    // `auto`: the relay is on loopback, so the ceiling is 8972; the client takes
    // datagrams that large (quinn's own default would cap them at 1472). DPLPMTUD
    // probes one size per round trip (5086, 7029, 8000, 8486, ...) meanwhile; an
    // idle connection's window does not grow on their acknowledgements.
    let options = H3Options {
        max_udp_payload: Some(65_527),
        ..H3Options::default()
    };
    let round = first_round_on_a_slow_path("", &options, 4 * MIB as usize, Duration::from_millis(2400)).await;
    let bytes: usize = round.iter().sum();
    let largest = round.iter().copied().max().unwrap_or(0);
    assert!(
        largest > 5000,
        "no datagram above 5000 bytes in the first round trip (DPLPMTUD had not raised the size): {round:?}"
    );
    // Within the window: 32 datagrams of the largest size, plus what it does not
    // count: one DPLPMTUD probe (one is in flight at a time) and acknowledgements.
    assert!(
        (100_000..=33 * largest + 1200).contains(&bytes),
        "{bytes} bytes in {} datagrams (largest {largest}) in the first round trip; \
         32 × 1200 bytes would be 38,400",
        round.len()
    );
}

/// A new connection's first round trip carries its `h3_initial_window_packets`
/// window: the default 32 (quic-go's and Chromium's packet count), against RFC
/// 9002's ten when set so. Counted on the wire by a relay that delays the client's
/// datagrams. quinn sends while a full datagram still fits under the window, so a
/// window of N × 1200 bytes carries N − 1 of them (31 and 9); runs on a loaded host
/// also counted N (10).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_round_trip_carries_the_initial_window() {
    let default = first_round_datagrams("").await;
    assert!(
        (27..=32).contains(&default),
        "{default} full datagrams in the first round trip; the default window is 32 × 1200 bytes"
    );
    let ten = first_round_datagrams("h3_initial_window_packets = \"10\"\n").await;
    assert!(
        (7..=10).contains(&ten),
        "{ten} full datagrams in the first round trip with a window of 10 × 1200 bytes"
    );
}
