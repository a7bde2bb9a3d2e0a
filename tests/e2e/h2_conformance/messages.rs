//! RFC 9113 section 8 and RFC 7541 header blocks; flow control with real bodies.

use super::*;

/// Section 8 (messages: framing, field names and values, pseudo-fields) and
/// RFC 7541 header block errors, which RFC 9113 §4.3 makes COMPRESSION_ERROR.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfc9113_section_8_messages_and_hpack() {
    let malformed = |rfc, extra: &'static [(&'static str, &'static str)]| {
        case(
            rfc,
            Stream(code::PROTOCOL_ERROR),
            vec![headers(1, &request("GET", "/hello.txt", extra), true)],
        )
    };
    let fields = |rfc, list: &[(&str, &str)]| {
        case(
            rfc,
            Stream(code::PROTOCOL_ERROR),
            vec![headers(1, &block(list), true)],
        )
    };
    let hpack =
        |rfc, bytes: Vec<u8>| case(rfc, Conn(code::COMPRESSION_ERROR), vec![headers(1, &bytes, true)]);
    let (m, s, a, p) = (
        (":method", "GET"),
        (":scheme", "https"),
        (":authority", HOST),
        (":path", "/hello.txt"),
    );
    let mut size_update = get("/hello.txt");
    size_update.push(0x20);
    let mut too_big_table = Vec::new();
    hpack_int(&mut too_big_table, 0x20, 5, 4097);
    too_big_table.extend(get("/hello.txt"));
    let cases = vec![
        case(
            "4.2 HEADERS over the advertised 64 KiB frame size",
            Conn(code::FRAME_SIZE_ERROR),
            vec![headers(1, &big_block(64 * 1024 + 1), true)],
        ),
        case(
            "8.1 trailers without END_STREAM",
            Stream(code::PROTOCOL_ERROR),
            vec![
                post(1, &[]),
                data(1, b"x", false),
                headers(1, &block(&[("x-trailer", "1")]), false),
            ],
        ),
        case(
            "8.1.1 content-length above the DATA received",
            Stream(code::PROTOCOL_ERROR),
            vec![post(1, &[("content-length", "3")]), data(1, b"x", true)],
        ),
        case(
            "8.1.1 content-length below the DATA received",
            Stream(code::PROTOCOL_ERROR),
            vec![post(1, &[("content-length", "1")]), data(1, b"abc", true)],
        ),
        case(
            "8.1.1 content-length below DATA split over frames",
            Stream(code::PROTOCOL_ERROR),
            vec![
                post(1, &[("content-length", "1")]),
                data(1, b"a", false),
                data(1, b"b", true),
            ],
        ),
        case(
            "8.1.1 content-length above the DATA, the DATA 50 ms later",
            EARLY_ANSWER,
            vec![post(1, &[("content-length", "3")])],
        )
        .then(Step::Pause(Duration::from_millis(50)))
        .then(Step::Send(data(1, b"x", true))),
        case(
            "8.1.1 content-length below the DATA, the DATA 50 ms later",
            EARLY_ANSWER,
            vec![post(1, &[("content-length", "1")])],
        )
        .then(Step::Pause(Duration::from_millis(50)))
        .then(Step::Send(data(1, b"abc", true))),
        case(
            "8.1.1 content-length matching the DATA is served",
            Fine,
            vec![
                post(1, &[("content-length", "2")]),
                data(1, b"a", false),
                data(1, b"b", true),
            ],
        ),
        malformed("8.2 uppercase field name", &[("X-Upper", "1")]),
        malformed("8.2.1 field name with a space", &[("x a", "1")]),
        malformed("8.2.1 field value with a line feed", &[("x-a", "a\nb")]),
        malformed("8.2.1 field value with NUL", &[("x-a", "a\0b")]),
        malformed("8.2.2 connection field", &[("connection", "keep-alive")]),
        malformed("8.2.2 keep-alive field", &[("keep-alive", "timeout=5")]),
        malformed(
            "8.2.2 proxy-connection field",
            &[("proxy-connection", "keep-alive")],
        ),
        malformed(
            "8.2.2 transfer-encoding field",
            &[("transfer-encoding", "chunked")],
        ),
        malformed("8.2.2 upgrade field", &[("upgrade", "websocket")]),
        malformed("8.2.2 te other than trailers", &[("te", "gzip")]),
        case(
            "8.2.2 te: trailers is served",
            Status(1, 200),
            vec![headers(
                1,
                &request("GET", "/hello.txt", &[("te", "trailers")]),
                true,
            )],
        ),
        malformed("8.3 unknown pseudo-field", &[(":foo", "bar")]),
        malformed("8.3 response pseudo-field in a request", &[(":status", "200")]),
        fields(
            "8.3 pseudo-field after a regular field",
            &[m, s, a, ("x-a", "b"), p],
        ),
        fields("8.3.1 :method missing", &[s, a, p]),
        fields("8.3.1 :scheme missing", &[m, a, p]),
        fields("8.3.1 :path missing", &[m, s, a]),
        fields("8.3.1 :method twice", &[m, s, a, p, m]),
        fields("8.3.1 :scheme twice", &[m, s, a, p, s]),
        fields("8.3.1 :path twice", &[m, s, a, p, p]),
        fields("8.3.1 empty :path", &[m, s, a, (":path", "")]),
        fields(
            "8.5 CONNECT with :scheme and :path",
            &[(":method", "CONNECT"), a, s, p],
        ),
        fields("8.5 CONNECT without :authority", &[(":method", "CONNECT")]),
        case(
            "8.3 pseudo-field in trailers",
            Stream(code::PROTOCOL_ERROR),
            vec![
                post(1, &[]),
                data(1, b"x", false),
                headers(1, &block(&[(":path", "/hello.txt")]), true),
            ],
        ),
        hpack("7541 indexed field 0", vec![0x80]),
        hpack("7541 index past the tables", vec![0xbf, 0x20]),
        hpack(
            "7541 table size update above SETTINGS_HEADER_TABLE_SIZE",
            too_big_table,
        ),
        hpack("7541 table size update after a field", size_update),
        hpack(
            "7541 Huffman string padded with EOS",
            vec![0x00, 0x84, 0xff, 0xff, 0xff, 0xff, 0x01, b'a'],
        ),
        hpack("7541 string longer than the block", vec![0x00, 0x05, b'a']),
    ];
    run_table("", cases).await;
}

/// 6.9.1: a client sending more than the stream's window (65,535 here) in one
/// DATA frame, which the 128 KiB frame size advertised here allows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfc9113_6_9_1_data_beyond_the_flow_control_window() {
    let cases = vec![case(
        "6.9.1 DATA beyond the stream's flow-control window",
        Stream(code::FLOW_CONTROL_ERROR),
        vec![post(1, &[]), data(1, &vec![0; 65_536], true)],
    )];
    run_table(
        "h2_initial_stream_window_bytes = \"65535\"\nh2_initial_connection_window_bytes = \"65535\"\nh2_max_frame_size_bytes = \"131072\"\n",
        cases,
    )
    .await;
}

/// The guard follows the server's flow-control grants exactly: four 12 MiB uploads
/// at once on one connection, through a proxy site (which reads request bodies,
/// unlike a file site), need many WINDOW_UPDATEs on every stream and on the
/// connection, and all arrive whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_beyond_every_window_pass_the_guard() {
    use bytes::Bytes;
    use webship_tests::client::{connect, Conn, Proto, Tuning};
    use webship_tests::origin::Origin;

    let env = Env::new();
    let origin = Origin::start().await;
    let (cert, key) = env.leaf("proxy", &["upload.test"]);
    let server = webship_tests::Server::start(
        env.dir.path(),
        &format!(
            "listen = \"127.0.0.1:{{port}}\"\nworkers = 2\n[reverse_proxy]\nenabled = true\n\
             tls_termination = true\n[reverse_proxy.tls]\ncert = \"{}\"\nkey = \"{}\"\n\
             [[reverse_proxy.routes]]\ndomain = \"upload.test\"\nupstreams = [\"{}\"]\n\
             max_body_bytes = 33554432\n",
            cert.display(),
            key.display(),
            origin.addr
        ),
    );
    let tls = connect(server.addr(), "upload.test", env.client(b"h2"))
        .await
        .unwrap();
    let authority = format!("upload.test:{}", server.port);
    let conn = Conn::handshake(tls, Proto::H2, &authority, Tuning::default())
        .await
        .unwrap();
    let body = Bytes::from(crate::support::pattern(12 << 20));
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..4 {
        let (mut conn, body) = (conn.share().unwrap(), body.clone());
        set.spawn(async move { conn.send("POST", "/echo", &[], body).await.map(|r| r.status()) });
    }
    while let Some(status) = set.join_next().await {
        assert_eq!(status.unwrap().unwrap(), 200);
    }
    let seen = origin.seen();
    assert_eq!(seen.len(), 4);
    assert!(
        seen.iter().all(|s| s.body_len == 12 << 20 && s.body_complete),
        "{seen:?}"
    );
    conn.close().await;
}
