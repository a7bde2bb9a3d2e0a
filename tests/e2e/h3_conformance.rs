//! RFC 9114 (HTTP/3) conformance of the daemon where a client can drive it, with
//! raw HTTP/3 frames on quinn streams (`webship_testkit::h3raw`): each case is one
//! requirement on a fresh QUIC connection, answered with the error code the RFC
//! names: a connection error closes the connection with that code, a stream error
//! resets the stream (or asks to stop sending) with it, or closes the connection
//! with it (RFC 9114 §8 lets an endpoint treat a stream error as a connection
//! error). All cases run at once against one daemon; a failure lists every case
//! that failed, with its section.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rustls::ClientConfig;
use webship_testkit::h3raw::{code, frame, headers, kind, settings, stream_type, End, H3Raw};

use crate::support::{Env, HOST};

const ANSWER: Duration = Duration::from_secs(3);

#[derive(Debug, Clone, Copy)]
enum Expect {
    /// The connection is closed with this code.
    Conn(u64),
    /// The request stream is reset with this code (or the connection closed with it).
    Stream(u64),
    /// The request is answered.
    Answered,
    /// A malformed request body (content-length, trailers) that a file site answers
    /// without reading: the complete response the server may send before the
    /// request ends (RFC 9114 §4.1), or the stream error if the server read it.
    EarlyAnswer(u64),
}

use Expect::{Answered, Conn, EarlyAnswer, Stream};

/// What a case sends.
#[derive(Debug, Clone, Copy)]
enum Send {
    /// Control stream: these bytes after the stream type; then wait for the close.
    Control(&'static [u8]),
    /// Control stream with SETTINGS, then these frames on it.
    ControlThen(fn() -> Vec<u8>),
    /// Control stream with SETTINGS, then FIN on it.
    ControlFin,
    /// Control stream with SETTINGS, and a unidirectional stream of this type.
    Uni(u64, fn() -> Vec<u8>),
    /// Control stream with SETTINGS, and a request stream with these bytes (FIN).
    Request(fn() -> Vec<u8>),
}

fn get() -> Vec<(&'static str, &'static str)> {
    vec![
        (":method", "GET"),
        (":scheme", "https"),
        (":authority", HOST),
        (":path", "/hello.txt"),
    ]
}

fn get_with(extra: &[(&'static str, &'static str)]) -> Vec<u8> {
    let mut fields = get();
    fields.extend_from_slice(extra);
    headers(&fields)
}

fn post(extra: &[(&'static str, &'static str)]) -> Vec<u8> {
    let mut fields = get();
    fields[0] = (":method", "POST");
    fields.extend_from_slice(extra);
    headers(&fields)
}

async fn check(send: Send, expect: Expect, addr: SocketAddr, tls: Arc<ClientConfig>) -> Result<(), String> {
    let mut conn = H3Raw::connect(addr, HOST, &tls)
        .await
        .map_err(|e| format!("{e:#}"))?;
    let setup = |e: anyhow::Error| format!("{e:#}");
    let end = match send {
        Send::Control(bytes) => {
            conn.open_control(bytes).await.map_err(setup)?;
            conn.closed(ANSWER).await
        }
        Send::ControlThen(more) => {
            conn.open_control(&settings(&[])).await.map_err(setup)?;
            conn.control(&more()).await.map_err(setup)?;
            conn.closed(ANSWER).await
        }
        Send::ControlFin => {
            conn.open_control(&settings(&[])).await.map_err(setup)?;
            conn.finish_control().map_err(setup)?;
            conn.closed(ANSWER).await
        }
        Send::Uni(stream_kind, bytes) => {
            conn.open_control(&settings(&[])).await.map_err(setup)?;
            let _stream = conn.uni(stream_kind, &bytes()).await.map_err(setup)?;
            match expect {
                // The stream is ignored: a request on the connection still works.
                Answered => conn.request(&headers(&get()), true, ANSWER).await,
                _ => conn.closed(ANSWER).await,
            }
        }
        Send::Request(bytes) => {
            conn.open_control(&settings(&[])).await.map_err(setup)?;
            conn.request(&bytes(), true, ANSWER).await
        }
    };
    let ok = match (expect, &end) {
        (Conn(want), End::Connection(got)) => want == *got,
        (Stream(want), End::Stream(got) | End::Connection(got)) => want == *got,
        (Answered | EarlyAnswer(_), End::Response(_)) => true,
        (EarlyAnswer(want), End::Stream(got) | End::Connection(got)) => want == *got,
        _ => false,
    };
    conn.conn.close(0u32.into(), b"");
    if ok {
        Ok(())
    } else {
        let want = match expect {
            Conn(c) => format!("connection closed with {}", code::name(c)),
            Stream(c) => format!("stream reset with {}", code::name(c)),
            Answered => "a response".to_string(),
            EarlyAnswer(c) => format!("a response or a stream reset with {}", code::name(c)),
        };
        Err(format!("want {want}, got {end}"))
    }
}

/// Runs every case against one daemon, all at once; fails with the list of the
/// cases it got wrong.
async fn run_table(cases: Vec<(&'static str, Send, Expect)>) {
    let env = Env::new();
    env.write("hello.txt", b"hello");
    let server = env.start("");
    let tls = env.client(b"h3");
    let total = cases.len();
    let mut set = tokio::task::JoinSet::new();
    for (rfc, send, expect) in cases {
        let (addr, tls) = (server.addr(), tls.clone());
        set.spawn(async move { (rfc, check(send, expect, addr, tls).await) });
    }
    let mut failed = Vec::new();
    while let Some(joined) = set.join_next().await {
        let (rfc, result) = joined.expect("a case panicked");
        if let Err(why) = result {
            failed.push(format!("  RFC 9114 §{rfc}: {why}"));
        }
    }
    failed.sort();
    assert!(
        failed.is_empty(),
        "{} of {total} cases failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfc9114_connection_and_message_rules() {
    let cases: Vec<(&str, Send, Expect)> = vec![
        (
            "4.1 a valid request is answered",
            Send::Request(|| headers(&get())),
            Answered,
        ),
        (
            "4.1 DATA before HEADERS on a request stream",
            Send::Request(|| frame(kind::DATA, b"x")),
            Conn(code::H3_FRAME_UNEXPECTED),
        ),
        (
            "4.1 SETTINGS on a request stream",
            Send::Request(|| settings(&[])),
            Conn(code::H3_FRAME_UNEXPECTED),
        ),
        (
            "4.1.2 content-length above the DATA",
            Send::Request(|| [post(&[("content-length", "3")]), frame(kind::DATA, b"x")].concat()),
            EarlyAnswer(code::H3_MESSAGE_ERROR),
        ),
        (
            "4.1.2 content-length below the DATA",
            Send::Request(|| [post(&[("content-length", "1")]), frame(kind::DATA, b"abc")].concat()),
            EarlyAnswer(code::H3_MESSAGE_ERROR),
        ),
        (
            "4.2 uppercase field name",
            Send::Request(|| get_with(&[("X-Upper", "1")])),
            Stream(code::H3_MESSAGE_ERROR),
        ),
        (
            "4.2 connection-specific field: connection",
            Send::Request(|| get_with(&[("connection", "keep-alive")])),
            Stream(code::H3_MESSAGE_ERROR),
        ),
        (
            "4.2 connection-specific field: keep-alive",
            Send::Request(|| get_with(&[("keep-alive", "timeout=5")])),
            Stream(code::H3_MESSAGE_ERROR),
        ),
        (
            "4.2 connection-specific field: proxy-connection",
            Send::Request(|| get_with(&[("proxy-connection", "keep-alive")])),
            Stream(code::H3_MESSAGE_ERROR),
        ),
        (
            "4.2 connection-specific field: transfer-encoding",
            Send::Request(|| post(&[("transfer-encoding", "chunked")])),
            Stream(code::H3_MESSAGE_ERROR),
        ),
        (
            "4.2 connection-specific field: upgrade",
            Send::Request(|| get_with(&[("upgrade", "websocket")])),
            Stream(code::H3_MESSAGE_ERROR),
        ),
        (
            "4.2 te other than trailers",
            Send::Request(|| get_with(&[("te", "gzip")])),
            Stream(code::H3_MESSAGE_ERROR),
        ),
        (
            "4.2 te: trailers is answered",
            Send::Request(|| get_with(&[("te", "trailers")])),
            Answered,
        ),
        (
            "4.3 pseudo-field after a regular field",
            Send::Request(|| {
                headers(&[
                    (":method", "GET"),
                    (":scheme", "https"),
                    (":authority", HOST),
                    ("x-a", "b"),
                    (":path", "/hello.txt"),
                ])
            }),
            Stream(code::H3_MESSAGE_ERROR),
        ),
        (
            "4.3 unknown pseudo-field",
            Send::Request(|| get_with(&[(":foo", "bar")])),
            Stream(code::H3_MESSAGE_ERROR),
        ),
        (
            "4.3.1 :path missing",
            Send::Request(|| headers(&[(":method", "GET"), (":scheme", "https"), (":authority", HOST)])),
            Stream(code::H3_MESSAGE_ERROR),
        ),
        (
            "4.3.1 :scheme missing",
            Send::Request(|| headers(&[(":method", "GET"), (":authority", HOST), (":path", "/hello.txt")])),
            Stream(code::H3_MESSAGE_ERROR),
        ),
        (
            "4.3 pseudo-field in trailers",
            Send::Request(|| [post(&[]), frame(kind::DATA, b"x"), headers(&[(":path", "/")])].concat()),
            EarlyAnswer(code::H3_MESSAGE_ERROR),
        ),
        (
            "6.2.1 the client's control stream closed",
            Send::ControlFin,
            Conn(code::H3_CLOSED_CRITICAL_STREAM),
        ),
        (
            "6.2.1 a second control stream",
            Send::Uni(stream_type::CONTROL, || settings(&[])),
            Conn(code::H3_STREAM_CREATION_ERROR),
        ),
        (
            "6.2.2 a push stream from the client",
            Send::Uni(stream_type::PUSH, || vec![0]),
            Conn(code::H3_STREAM_CREATION_ERROR),
        ),
        (
            "6.2.3 a reserved stream type is ignored",
            Send::Uni(stream_type::RESERVED, || b"ignored".to_vec()),
            Answered,
        ),
        (
            "7.2.4 a second SETTINGS on the control stream",
            Send::ControlThen(|| settings(&[])),
            Conn(code::H3_FRAME_UNEXPECTED),
        ),
        (
            "7.2.4 the control stream not starting with SETTINGS",
            Send::Control(&[kind::GOAWAY as u8, 1, 0]),
            Conn(code::H3_MISSING_SETTINGS),
        ),
        (
            "7.2.4.1 an HTTP/2 setting in SETTINGS",
            Send::Control(&[kind::SETTINGS as u8, 2, 0x2, 1]),
            Conn(code::H3_SETTINGS_ERROR),
        ),
        (
            "7.2.1 DATA on the control stream",
            Send::ControlThen(|| frame(kind::DATA, b"x")),
            Conn(code::H3_FRAME_UNEXPECTED),
        ),
        (
            "7.2.2 HEADERS on the control stream",
            Send::ControlThen(|| headers(&get())),
            Conn(code::H3_FRAME_UNEXPECTED),
        ),
        (
            "7.2.5 PUSH_PROMISE from a client",
            Send::Request(|| [frame(kind::PUSH_PROMISE, &[0, 0, 0]), headers(&get())].concat()),
            Conn(code::H3_FRAME_UNEXPECTED),
        ),
        (
            "7.2.8 an HTTP/2 frame type on the control stream",
            Send::ControlThen(|| frame(0x06, &[0; 8])),
            Conn(code::H3_FRAME_UNEXPECTED),
        ),
        (
            "7.2.8/9 a reserved frame type on a request stream is ignored",
            Send::Request(|| [frame(kind::RESERVED, b"abc"), headers(&get())].concat()),
            Answered,
        ),
    ];
    run_table(cases).await;
}
