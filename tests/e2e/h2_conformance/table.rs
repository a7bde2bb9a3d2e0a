//! The guard's own table of streams on a long connection: a stream whose response
//! ends before the request does (a bidirectional stream through the proxy: the
//! origin answers at once and reads the body meanwhile) ends for h2 with both
//! END_STREAMs and no RST_STREAM, and must leave the guard's table too.

use webship_tests::origin::Origin;
use webship_tests::Server;

use super::*;

const PROXY: &str = "proxy.test";

/// With `h2_max_concurrent_streams = 4` the guard holds at most 4 × 4 + 64 = 80
/// streams; 120 streams one after the other, each answered before the client ends
/// its body, must all be served on one connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_the_server_ends_first_leave_the_guard_table() {
    let env = Env::new();
    let origin = Origin::start().await;
    let (cert, key) = env.leaf("proxy", &[PROXY]);
    let config = format!(
        r#"listen = "127.0.0.1:{{port}}"
workers = 1

[limits]
idle_timeout_secs = 10

[runtime.settings]
h2_max_concurrent_streams = "4"

[reverse_proxy]
enabled = true
tls_termination = true
[reverse_proxy.tls]
cert = "{}"
key = "{}"

[[reverse_proxy.routes]]
domain = "{PROXY}"
path_prefix = "/"
upstreams = ["{}"]
"#,
        cert.display(),
        key.display(),
        origin.addr
    );
    let server = Server::start(env.dir.path(), &config);
    let mut conn = H2Raw::connect(server.addr(), PROXY, &env.client(b"h2"))
        .await
        .expect("connect");
    conn.handshake(&[], ANSWER).await.expect("handshake");
    let post = block(&[
        (":method", "POST"),
        (":scheme", "https"),
        (":authority", PROXY),
        (":path", "/early"),
    ]);
    for i in 0..120u32 {
        let stream = 2 * i + 1;
        let mut bytes = headers(stream, &post, false);
        bytes.extend(data(stream, b"x", false));
        conn.send(&bytes).await.expect("request");
        let answered = conn.until_stream_end(stream, ANSWER).await;
        let last: Vec<_> = conn.seen.iter().rev().take(4).collect();
        assert!(
            answered,
            "stream {stream} (request {}) got no complete response; last frames: {last:?}\nserver log tail:\n{}",
            i + 1,
            tail(&server.log(), 20)
        );
        assert_eq!(conn.status(stream), Some(200), "stream {stream}");
        // The client ends its body only now, after the whole response.
        conn.send(&data(stream, b"", true)).await.expect("end of body");
    }
    if let Err(why) = fine(&mut conn).await {
        panic!("after 120 streams: {why}");
    }
}
