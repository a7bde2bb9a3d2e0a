//! HTTP/3 on several UDP sockets (`h3_sockets`): connections spread over the
//! sockets' endpoints, every datagram reaches the endpoint that owns its connection
//! (the per-socket counters of `/metrics`), and a client that changes its port mid
//! connection (its datagrams now hashed to whichever socket) keeps downloading.

use std::time::Duration;

use bytes::Buf;
use sha2::{Digest, Sha256};
use webship_tests::client::{recv_body, Collect, H3Client, H3Options, Sink};

use crate::subsystem_metrics::{admin, Scrape};
use crate::support::{pattern, Env, HOST, MIB};

/// Two workers, two sockets, and the admin listener for the counters.
fn two_sockets(env: &Env) -> (webship_tests::Server, std::net::SocketAddr) {
    let (toml, admin) = admin();
    let server = env.start(&format!("{toml}[runtime.settings]\nh3_sockets = \"2\"\n"));
    assert!(
        server.log().contains("h3: one quinn endpoint per UDP socket"),
        "the server did not report its two sockets:\n{}",
        server.log()
    );
    (server, admin)
}

/// (received, misrouted, dropped) for socket `i`.
fn socket(s: &Scrape, i: usize) -> (f64, f64, f64) {
    let v = |family: &str| s.value(&format!("webship_quic_socket_{family}_datagrams_total{{socket=\"{i}\"}}"));
    (v("received"), v("misrouted"), v("misrouted_dropped"))
}

/// Sixteen connections, each from its own client port, download at once, byte-exact;
/// both sockets carried some (all sixteen on one has odds of 2 in 65,536), and no
/// datagram reached a socket other than its connection's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_spread_over_the_sockets_and_stay_on_theirs() {
    let env = Env::new();
    let body = pattern(512 * 1024 + 7);
    env.write("half.bin", &body);
    let digest: [u8; 32] = Sha256::digest(&body).into();
    let (server, admin) = two_sockets(&env);
    let tls = env.client(b"h3");
    let downloads: Vec<_> = (0..16)
        .map(|_| {
            let tls = tls.clone();
            let addr = server.addr();
            tokio::spawn(async move {
                let mut h3 = H3Client::connect(addr, HOST, &tls, &H3Options::default())
                    .await
                    .unwrap();
                let got = h3.fetch("GET", "/half.bin", &[]).await;
                h3.close().await;
                got
            })
        })
        .collect();
    for download in downloads {
        let got = download.await.unwrap();
        assert_eq!((got.status.as_u16(), got.len), (200, body.len() as u64));
        assert_eq!(got.sha256, digest, "a body differs from the file");
    }
    let s = Scrape::take(admin);
    let (a, b) = (socket(&s, 0), socket(&s, 1));
    assert!(
        a.0 > 0.0 && b.0 > 0.0,
        "one socket read nothing (socket 0: {a:?}, socket 1: {b:?}): the kernel did not spread the connections"
    );
    assert_eq!(
        (a.1, b.1),
        (0.0, 0.0),
        "datagrams reached a socket other than their connection's"
    );
    assert!(s.get("webship_quic_socket_received_datagrams_total{socket=\"2\"}").is_none());
}

/// One connection whose client moves to a new port again and again: between
/// requests until a move lands its datagrams on the other socket (counted as
/// misrouted and handed over, none dropped), then once more in the middle of a
/// download. Every response arrives byte-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_changes_its_port_keeps_its_connection() {
    let env = Env::new();
    let small = pattern(64 * 1024);
    let big = pattern(8 * MIB as usize);
    env.write("small.bin", &small);
    env.write("big.bin", &big);
    let (server, admin) = two_sockets(&env);
    let mut h3 = H3Client::connect(server.addr(), HOST, &env.client(b"h3"), &H3Options::default())
        .await
        .unwrap();
    let misrouted = || {
        let s = Scrape::take(admin);
        socket(&s, 0).1 + socket(&s, 1).1
    };
    let rebind = |h3: &H3Client| {
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        h3.endpoint().rebind(socket).unwrap();
    };
    let mut moves = 0;
    // Each move lands on the other socket with odds of one in two: 24 misses in a
    // row have odds of one in sixteen million.
    while misrouted() == 0.0 && moves < 24 {
        rebind(&h3);
        moves += 1;
        let got = h3.fetch("GET", "/small.bin", &[]).await;
        assert_eq!(got.body, small, "after move {moves}");
    }
    assert!(
        misrouted() > 0.0,
        "{moves} port changes and no datagram ever reached the other socket"
    );

    let (parts, mut stream) = h3.send("GET", "/big.bin", &[]).await.unwrap();
    assert_eq!(parts.status, 200);
    let mut sink = Collect::default();
    let mut first = tokio::time::timeout(Duration::from_secs(10), stream.recv_data())
        .await
        .expect("no body within 10 s")
        .unwrap()
        .expect("the body ended at once");
    sink.update(&first.copy_to_bytes(first.remaining()));
    rebind(&h3);
    recv_body(&mut stream, &mut sink).await.unwrap();
    let got = sink.into_fetched(parts);
    assert_eq!(got.len, big.len() as u64);
    assert_eq!(got.sha256, <[u8; 32]>::from(Sha256::digest(&big)));
    let s = Scrape::take(admin);
    assert_eq!(
        (socket(&s, 0).2, socket(&s, 1).2),
        (0.0, 0.0),
        "misrouted datagrams were dropped"
    );
    h3.close().await;
}
