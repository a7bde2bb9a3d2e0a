//! RFC 9113 sections 3 to 7: frames, streams, frame types.

use super::*;

/// Sections 3 to 5: the preface, frame format and size, header blocks, stream
/// states and identifiers, priority. The daemon advertises 16 KiB frames here,
/// the protocol's default, so 4.2 is the case an independent suite (h2spec) sends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfc9113_sections_3_to_5_frames_and_streams() {
    let max = 16_384;
    let cases = vec![
        case(
            "3.4 invalid connection preface",
            Closed(code::PROTOCOL_ERROR),
            vec![
                b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n".to_vec(),
                frame(kind::SETTINGS, 0, 0, &[]),
            ],
        )
        .without_preface(),
        case(
            "4.1 unknown frame type is ignored",
            Fine,
            vec![frame(0xfa, 0, 0, b"xx")],
        ),
        case(
            "4.1 unknown flags are ignored",
            Fine,
            vec![frame(kind::PING, 0xfe, 0, &[1; 8])],
        ),
        case(
            "4.1 reserved bit of the stream identifier is ignored",
            Status(1, 200),
            vec![headers(0x8000_0001, &get("/hello.txt"), true)],
        ),
        case(
            "4.2 HEADERS over SETTINGS_MAX_FRAME_SIZE (h2spec 4.2/3)",
            Conn(code::FRAME_SIZE_ERROR),
            vec![headers(1, &big_block(max + 1), true)],
        ),
        case(
            "4.2 DATA over SETTINGS_MAX_FRAME_SIZE",
            Stream(code::FRAME_SIZE_ERROR),
            vec![post(1, &[]), data(1, &vec![0; max + 1], true)],
        ),
        case(
            "4.2 frame of exactly SETTINGS_MAX_FRAME_SIZE is processed",
            Fine,
            vec![post(1, &[]), data(1, &vec![0; max], true)],
        ),
        case(
            "4.3 header block that cannot be decoded",
            Conn(code::COMPRESSION_ERROR),
            vec![frame(
                kind::HEADERS,
                flag::END_HEADERS | flag::END_STREAM,
                1,
                &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
            )],
        ),
        case(
            "4.3 header block interrupted by a PING",
            Conn(code::PROTOCOL_ERROR),
            vec![
                frame(kind::HEADERS, flag::END_STREAM, 1, &get("/hello.txt")),
                ping([0; 8]),
            ],
        ),
        case(
            "4.3/5.5 header block interrupted by an unknown frame",
            Conn(code::PROTOCOL_ERROR),
            vec![
                frame(kind::HEADERS, flag::END_STREAM, 1, &get("/hello.txt")),
                frame(0xfa, 0, 0, b"xx"),
            ],
        ),
        case(
            "5.1 DATA on an idle stream",
            Conn(code::PROTOCOL_ERROR),
            vec![data(1, b"x", true)],
        ),
        case(
            "5.1 RST_STREAM on an idle stream",
            Conn(code::PROTOCOL_ERROR),
            vec![rst_stream(1, code::CANCEL)],
        ),
        case(
            "5.1 WINDOW_UPDATE on an idle stream",
            Conn(code::PROTOCOL_ERROR),
            vec![window_update(1, 100)],
        ),
        case(
            "5.1 CONTINUATION on an idle stream",
            Conn(code::PROTOCOL_ERROR),
            vec![frame(
                kind::CONTINUATION,
                flag::END_HEADERS,
                1,
                &get("/hello.txt"),
            )],
        ),
        case(
            "5.1 DATA on a half-closed (remote) stream",
            Stream(code::STREAM_CLOSED),
            vec![headers(1, &get("/big.bin"), true), data(1, b"x", true)],
        ),
        case(
            "5.1 HEADERS on a half-closed (remote) stream",
            Stream(code::STREAM_CLOSED),
            vec![
                headers(1, &get("/big.bin"), true),
                headers(1, &get("/big.bin"), true),
            ],
        ),
        case(
            "5.1 DATA on a stream the client reset",
            Stream(code::STREAM_CLOSED),
            vec![post(1, &[]), rst_stream(1, code::CANCEL), data(1, b"x", true)],
        ),
        case(
            "5.1 DATA on a closed stream",
            Stream(code::STREAM_CLOSED),
            vec![headers(1, &get("/hello.txt"), true)],
        )
        .then(Step::EndOf(1))
        .then(Step::Send(data(1, b"x", true))),
        case(
            "5.1.1 even stream identifier",
            Conn(code::PROTOCOL_ERROR),
            vec![headers(2, &get("/hello.txt"), true)],
        ),
        case(
            "5.1.1 stream identifier below an earlier one",
            Conn(code::PROTOCOL_ERROR),
            vec![
                headers(5, &get("/hello.txt"), true),
                headers(3, &get("/hello.txt"), true),
            ],
        ),
        case(
            "5.1.2 more streams than SETTINGS_MAX_CONCURRENT_STREAMS",
            StreamAny(&[code::PROTOCOL_ERROR, code::REFUSED_STREAM]),
            (0..3)
                .map(|i| headers(1 + 2 * i, &get("/big.bin"), true))
                .collect(),
        ),
        case(
            "5.3.1 HEADERS depending on its own stream",
            Stream(code::PROTOCOL_ERROR),
            vec![frame(
                kind::HEADERS,
                flag::END_HEADERS | flag::END_STREAM | flag::PRIORITY,
                1,
                &[&[0, 0, 0, 1, 16][..], &get("/hello.txt")].concat(),
            )],
        ),
        case(
            "5.3.1 PRIORITY depending on its own stream",
            Stream(code::PROTOCOL_ERROR),
            vec![frame(kind::PRIORITY, 0, 3, &[0, 0, 0, 3, 16])],
        ),
        case(
            "7 unknown error code in RST_STREAM is not special",
            Fine,
            vec![post(1, &[]), rst_stream(1, 0xff)],
        ),
    ];
    run_table(
        "h2_max_frame_size_bytes = \"16384\"\nh2_max_concurrent_streams = \"2\"\n",
        cases,
    )
    .await;
}

/// Section 6: each frame type's own rules, and 7 (error codes), 8.4 (push).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfc9113_section_6_frame_definitions() {
    let max_window = 0x7fff_ffff;
    let cases = vec![
        case(
            "6.1 DATA on stream 0",
            Conn(code::PROTOCOL_ERROR),
            vec![data(0, b"x", false)],
        ),
        case(
            "6.1 DATA padding as long as the payload",
            Conn(code::PROTOCOL_ERROR),
            vec![
                post(1, &[]),
                frame(kind::DATA, flag::PADDED | flag::END_STREAM, 1, &[3, b'a', b'b']),
            ],
        ),
        case(
            "6.2 HEADERS on stream 0",
            Conn(code::PROTOCOL_ERROR),
            vec![headers(0, &get("/hello.txt"), true)],
        ),
        case(
            "6.2 HEADERS padding as long as the payload",
            Conn(code::PROTOCOL_ERROR),
            vec![frame(
                kind::HEADERS,
                flag::END_HEADERS | flag::END_STREAM | flag::PADDED,
                1,
                &[&[200][..], &get("/hello.txt")].concat(),
            )],
        ),
        case(
            "6.3 PRIORITY on stream 0",
            Conn(code::PROTOCOL_ERROR),
            vec![frame(kind::PRIORITY, 0, 0, &[0, 0, 0, 1, 16])],
        ),
        case(
            "6.3 PRIORITY of length other than 5",
            Stream(code::FRAME_SIZE_ERROR),
            vec![frame(kind::PRIORITY, 0, 1, &[0, 0, 0, 0])],
        ),
        case(
            "6.3 PRIORITY on an idle stream is allowed",
            Fine,
            vec![frame(kind::PRIORITY, 0, 7, &[0, 0, 0, 0, 16])],
        ),
        case(
            "6.4 RST_STREAM on stream 0",
            Conn(code::PROTOCOL_ERROR),
            vec![rst_stream(0, code::CANCEL)],
        ),
        case(
            "6.4 RST_STREAM of length other than 4",
            Conn(code::FRAME_SIZE_ERROR),
            vec![post(1, &[]), frame(kind::RST_STREAM, 0, 1, &[0, 0, 0])],
        ),
        case(
            "6.5 SETTINGS ACK with a payload",
            Conn(code::FRAME_SIZE_ERROR),
            vec![frame(
                kind::SETTINGS,
                flag::ACK,
                0,
                &settings(&[(setting::ENABLE_PUSH, 0)]),
            )],
        ),
        case(
            "6.5 SETTINGS on a stream",
            Conn(code::PROTOCOL_ERROR),
            vec![frame(kind::SETTINGS, 0, 1, &[])],
        ),
        case(
            "6.5 SETTINGS length not a multiple of 6",
            Conn(code::FRAME_SIZE_ERROR),
            vec![frame(kind::SETTINGS, 0, 0, &[0, 2, 0])],
        ),
        case(
            "6.5.2 SETTINGS_ENABLE_PUSH other than 0 or 1",
            Conn(code::PROTOCOL_ERROR),
            vec![frame(
                kind::SETTINGS,
                0,
                0,
                &settings(&[(setting::ENABLE_PUSH, 2)]),
            )],
        ),
        case(
            "6.5.2 SETTINGS_INITIAL_WINDOW_SIZE above 2^31-1",
            Conn(code::FLOW_CONTROL_ERROR),
            vec![frame(
                kind::SETTINGS,
                0,
                0,
                &settings(&[(setting::INITIAL_WINDOW_SIZE, 1 << 31)]),
            )],
        ),
        case(
            "6.5.2 SETTINGS_MAX_FRAME_SIZE below 2^14",
            Conn(code::PROTOCOL_ERROR),
            vec![frame(
                kind::SETTINGS,
                0,
                0,
                &settings(&[(setting::MAX_FRAME_SIZE, 16_383)]),
            )],
        ),
        case(
            "6.5.2 SETTINGS_MAX_FRAME_SIZE above 2^24-1",
            Conn(code::PROTOCOL_ERROR),
            vec![frame(
                kind::SETTINGS,
                0,
                0,
                &settings(&[(setting::MAX_FRAME_SIZE, 1 << 24)]),
            )],
        ),
        case(
            "6.5.2 an unknown setting is ignored",
            SettingsAck,
            vec![frame(kind::SETTINGS, 0, 0, &settings(&[(0xfa, 7)]))],
        ),
        case(
            "6.5.3 SETTINGS are acknowledged",
            SettingsAck,
            vec![frame(
                kind::SETTINGS,
                0,
                0,
                &settings(&[
                    (setting::INITIAL_WINDOW_SIZE, 100),
                    (setting::MAX_FRAME_SIZE, 20_000),
                ]),
            )],
        ),
        case("6.7 PING is answered with its payload", Fine, vec![]),
        case(
            "6.7 PING on a stream",
            Conn(code::PROTOCOL_ERROR),
            vec![frame(kind::PING, 0, 1, &[0; 8])],
        ),
        case(
            "6.7 PING of length other than 8",
            Conn(code::FRAME_SIZE_ERROR),
            vec![frame(kind::PING, 0, 0, &[0; 6])],
        ),
        case(
            "6.7 PING ACK is not answered",
            Fine,
            vec![frame(kind::PING, flag::ACK, 0, &[9; 8])],
        ),
        case(
            "6.8 GOAWAY on a stream",
            Conn(code::PROTOCOL_ERROR),
            vec![frame(kind::GOAWAY, 0, 1, &[0; 8])],
        ),
        case(
            "6.9 WINDOW_UPDATE of 0 on the connection",
            Conn(code::PROTOCOL_ERROR),
            vec![window_update(0, 0)],
        ),
        case(
            "6.9 WINDOW_UPDATE of 0 on a stream",
            Stream(code::PROTOCOL_ERROR),
            vec![headers(1, &get("/big.bin"), true), window_update(1, 0)],
        ),
        case(
            "6.9 WINDOW_UPDATE of length other than 4",
            Conn(code::FRAME_SIZE_ERROR),
            vec![frame(kind::WINDOW_UPDATE, 0, 0, &[0, 0, 1])],
        ),
        case(
            "6.9.1 connection window above 2^31-1",
            Conn(code::FLOW_CONTROL_ERROR),
            vec![window_update(0, max_window)],
        ),
        case(
            "6.9.1 stream window above 2^31-1",
            Stream(code::FLOW_CONTROL_ERROR),
            vec![headers(1, &get("/big.bin"), true), window_update(1, max_window)],
        ),
        case(
            "6.9.2 SETTINGS_INITIAL_WINDOW_SIZE change overflowing a stream window",
            Conn(code::FLOW_CONTROL_ERROR),
            vec![
                headers(1, &get("/big.bin"), true),
                window_update(1, max_window),
                frame(
                    kind::SETTINGS,
                    0,
                    0,
                    &settings(&[(setting::INITIAL_WINDOW_SIZE, 1)]),
                ),
            ],
        )
        .with_settings(&[(setting::INITIAL_WINDOW_SIZE, 0)]),
        case(
            "6.10 CONTINUATION after END_HEADERS",
            Conn(code::PROTOCOL_ERROR),
            vec![
                post(1, &[]),
                frame(kind::CONTINUATION, flag::END_HEADERS, 1, &block(&[("x-a", "b")])),
            ],
        ),
        case(
            "6.10 CONTINUATION on another stream",
            Conn(code::PROTOCOL_ERROR),
            vec![
                frame(kind::HEADERS, flag::END_STREAM, 1, &get("/hello.txt")),
                frame(kind::CONTINUATION, flag::END_HEADERS, 3, &block(&[("x-a", "b")])),
            ],
        ),
        case(
            "6.10 CONTINUATION on stream 0",
            Conn(code::PROTOCOL_ERROR),
            vec![
                frame(kind::HEADERS, flag::END_STREAM, 1, &get("/hello.txt")),
                frame(kind::CONTINUATION, flag::END_HEADERS, 0, &block(&[("x-a", "b")])),
            ],
        ),
        case(
            "6.10 CONTINUATION after DATA",
            Conn(code::PROTOCOL_ERROR),
            vec![
                post(1, &[]),
                data(1, b"x", false),
                frame(kind::CONTINUATION, flag::END_HEADERS, 1, &block(&[("x-a", "b")])),
            ],
        ),
        {
            let whole = get("/hello.txt");
            let (a, rest) = whole.split_at(10);
            let (b, c) = rest.split_at(10);
            case(
                "6.10 a header block split over CONTINUATION frames is served",
                Status(1, 200),
                vec![
                    frame(kind::HEADERS, flag::END_STREAM, 1, a),
                    frame(kind::CONTINUATION, 0, 1, b),
                    frame(kind::CONTINUATION, flag::END_HEADERS, 1, c),
                ],
            )
        },
        case(
            "8.4 PUSH_PROMISE from a client",
            Conn(code::PROTOCOL_ERROR),
            vec![
                post(1, &[]),
                frame(
                    kind::PUSH_PROMISE,
                    flag::END_HEADERS,
                    1,
                    &[&[0, 0, 0, 2][..], &get("/hello.txt")].concat(),
                ),
            ],
        ),
    ];
    run_table("", cases).await;
}
