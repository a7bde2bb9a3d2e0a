//! RFC 9113 (HTTP/2) conformance of the daemon, driven by the raw-frame client
//! (`webship_testkit::h2raw`): each case is one MUST of sections 3-8 (and RFC 7541
//! for header blocks) that a client can test a server for, on a fresh connection,
//! answered with the error the RFC names: a connection error is GOAWAY with that
//! code and then a close; a stream error is RST_STREAM with that code (or GOAWAY
//! with it: RFC 9113 §5.4.1 lets an endpoint treat any stream error as a connection
//! error). Every case of a table runs at once against one daemon; a failure lists
//! every case that failed, with its section.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rustls::ClientConfig;
use webship_testkit::h2raw::{
    block, code, data, flag, frame, headers, hpack_int, kind, literal, ping, rst_stream, setting, settings,
    window_update, End, H2Raw,
};

use crate::support::{Env, HOST};

/// How long a case waits for the server's answer, and then for the close.
const ANSWER: Duration = Duration::from_secs(3);

/// What the server must do.
#[derive(Debug, Clone, Copy)]
enum Expect {
    /// GOAWAY with this code, then the connection closes.
    Conn(u32),
    /// RST_STREAM with this code (or GOAWAY with it).
    Stream(u32),
    /// A stream error with any of these codes.
    StreamAny(&'static [u32]),
    /// No error at all: a PING afterwards is answered, nothing was reset with an
    /// error code.
    Fine,
    /// Fine, and the SETTINGS sent after the handshake were acknowledged.
    SettingsAck,
    /// The response on the stream has this status, and the connection is fine.
    Status(u32, u16),
    /// The connection closes, with or without GOAWAY with this code.
    Closed(u32),
}

#[derive(Debug, Clone)]
enum Step {
    Send(Vec<u8>),
    /// Read until the stream ends (its response is complete).
    EndOf(u32),
    /// Give the server time to act on what it has (h2spec writes every frame on
    /// its own, and a server may answer between them).
    Pause(Duration),
}

#[derive(Debug, Clone)]
struct Case {
    rfc: &'static str,
    /// Sent in the client's first SETTINGS.
    settings: Vec<(u16, u32)>,
    /// false: the steps start right after the TLS handshake, preface not sent.
    preface: bool,
    steps: Vec<Step>,
    expect: Expect,
}

fn case(rfc: &'static str, expect: Expect, sends: Vec<Vec<u8>>) -> Case {
    Case {
        rfc,
        settings: Vec::new(),
        preface: true,
        steps: vec![Step::Send(sends.concat())],
        expect,
    }
}

impl Case {
    fn with_settings(mut self, values: &[(u16, u32)]) -> Case {
        self.settings = values.to_vec();
        self
    }

    fn without_preface(mut self) -> Case {
        self.preface = false;
        self
    }

    fn then(mut self, step: Step) -> Case {
        self.steps.push(step);
        self
    }
}

/// A file site answers a POST without reading its body: a complete response and
/// then RST_STREAM(NO_ERROR), which RFC 9113 §8.1 allows, after which §5.1 says to
/// ignore what the client still sends on the stream. A content-length mismatch
/// arriving after that is not seen, so NO_ERROR is as right as PROTOCOL_ERROR
/// (this is the h2spec 8.1.2.6 case that "passed in one run only").
const EARLY_ANSWER: Expect = StreamAny(&[code::PROTOCOL_ERROR, code::NO_ERROR]);

use Expect::{Closed, Conn, Fine, SettingsAck, Status, Stream, StreamAny};

/// The pseudo-fields of a request for `path` with `method`.
fn request(method: &str, path: &str, extra: &[(&str, &str)]) -> Vec<u8> {
    let mut fields = vec![
        (":method", method),
        (":scheme", "https"),
        (":authority", HOST),
        (":path", path),
    ];
    fields.extend_from_slice(extra);
    block(&fields)
}

fn get(path: &str) -> Vec<u8> {
    request("GET", path, &[])
}

/// HEADERS opening a POST on `stream` whose body follows (no END_STREAM).
fn post(stream: u32, extra: &[(&str, &str)]) -> Vec<u8> {
    headers(stream, &request("POST", "/hello.txt", extra), false)
}

/// A header block of `size` bytes or more: a GET with filler fields.
fn big_block(size: usize) -> Vec<u8> {
    let mut out = get("/hello.txt");
    let filler = "x".repeat(4000);
    let mut i = 0;
    while out.len() < size {
        literal(&mut out, format!("x-dummy{i}").as_bytes(), filler.as_bytes());
        i += 1;
    }
    out
}

/// Runs one case; a description of what went wrong otherwise.
async fn check(case: Case, addr: SocketAddr, tls: Arc<ClientConfig>) -> Result<(), String> {
    let mut conn = H2Raw::connect(addr, HOST, &tls)
        .await
        .map_err(|e| format!("{e:#}"))?;
    if case.preface {
        conn.handshake(&case.settings, ANSWER)
            .await
            .map_err(|e| format!("handshake: {e:#}"))?;
    }
    for step in &case.steps {
        match step {
            // A server that already closed may refuse the rest; the outcome says.
            Step::Send(bytes) => drop(conn.send(bytes).await),
            Step::Pause(pause) => tokio::time::sleep(*pause).await,
            Step::EndOf(stream) => {
                if !conn.until_stream_end(*stream, ANSWER).await {
                    return Err(format!(
                        "stream {stream} did not complete; frames: {:?}",
                        conn.seen
                    ));
                }
            }
        }
    }
    let got = match case.expect {
        Conn(want) => {
            let end = conn.until_end(ANSWER).await;
            if !matches!(end, End::GoAway { code, .. } if code == want) {
                return Err(format!("want GOAWAY {}, got {end}", code::name(want)));
            }
            if !conn.closes_within(ANSWER).await {
                return Err(format!(
                    "GOAWAY {} but the connection stayed open",
                    code::name(want)
                ));
            }
            return Ok(());
        }
        Stream(want) => return stream_error(&mut conn, &[want]).await,
        StreamAny(want) => return stream_error(&mut conn, want).await,
        Closed(want) => match conn.until_end(ANSWER).await {
            End::Closed => return Ok(()),
            End::GoAway { code, .. } if code == want && conn.closes_within(ANSWER).await => return Ok(()),
            end => end.to_string(),
        },
        Status(stream, want) => {
            if !conn.until_stream_end(stream, ANSWER).await {
                return Err(format!(
                    "no complete response on stream {stream}; frames: {:?}",
                    conn.seen
                ));
            }
            match conn.status(stream) {
                Some(status) if status == want => return fine(&mut conn).await,
                other => format!("status {other:?}"),
            }
        }
        Fine => return fine(&mut conn).await,
        SettingsAck => {
            fine(&mut conn).await?;
            let acks = conn
                .seen
                .iter()
                .filter(|f| f.kind == kind::SETTINGS && f.flags & flag::ACK != 0)
                .count();
            if acks >= 2 {
                return Ok(());
            }
            format!("{acks} SETTINGS ACK")
        }
    };
    Err(format!("want {:?}, got {got}", case.expect))
}

async fn stream_error(conn: &mut H2Raw, want: &[u32]) -> Result<(), String> {
    match conn.until_end(ANSWER).await {
        End::Reset { code, .. } | End::GoAway { code, .. } if want.contains(&code) => Ok(()),
        end => Err(format!(
            "want RST_STREAM {}, got {end}",
            want.iter()
                .map(|c| code::name(*c))
                .collect::<Vec<_>>()
                .join(" or ")
        )),
    }
}

/// The connection still works and nothing was refused with an error.
async fn fine(conn: &mut H2Raw) -> Result<(), String> {
    if !conn.ping_pong(ANSWER).await {
        return Err(format!("PING not answered; frames: {:?}", conn.seen));
    }
    let errors: Vec<_> = conn
        .seen
        .iter()
        .filter(|f| {
            f.kind == kind::GOAWAY
                || (f.kind == kind::RST_STREAM
                    && !matches!(f.error_code(), Some(code::NO_ERROR | code::CANCEL)))
        })
        .collect();
    if errors.is_empty() {
        Ok(())
    } else {
        Err(format!("errors: {errors:?}"))
    }
}

/// Runs every case against a daemon started with `settings`, all at once, and
/// fails with the list of cases the daemon got wrong.
async fn run_table(settings_toml: &str, cases: Vec<Case>) {
    let env = Env::new();
    env.write("hello.txt", b"hello");
    env.write("big.bin", &vec![7u8; 1 << 20]);
    let server = env.start(&format!(
        "[limits]\nidle_timeout_secs = 10\n[runtime.settings]\n{settings_toml}"
    ));
    let tls = env.client(b"h2");
    let total = cases.len();
    let mut set = tokio::task::JoinSet::new();
    for case in cases {
        let (addr, tls) = (server.addr(), tls.clone());
        set.spawn(async move { (case.rfc, check(case, addr, tls).await) });
    }
    let mut failed = Vec::new();
    while let Some(joined) = set.join_next().await {
        let (rfc, result) = joined.expect("a case panicked");
        if let Err(why) = result {
            failed.push(format!("  RFC 9113 §{rfc}: {why}"));
        }
    }
    failed.sort();
    assert!(
        failed.is_empty(),
        "{} of {total} cases failed:\n{}\nserver log tail:\n{}",
        failed.len(),
        failed.join("\n"),
        tail(&server.log(), 30)
    );
}

fn tail(log: &str, lines: usize) -> String {
    let all: Vec<&str> = log.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

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
