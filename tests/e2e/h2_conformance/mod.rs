//! RFC 9113 (HTTP/2) conformance of the daemon, driven by the raw-frame client
//! (`webship_testkit::h2raw`): each case is one MUST of sections 3-8 (and RFC 7541
//! for header blocks) that a client can test a server for, on a fresh connection,
//! answered with the error the RFC names: a connection error is GOAWAY with that
//! code and then a close; a stream error is RST_STREAM with that code (or GOAWAY
//! with it: RFC 9113 §5.4.1 lets an endpoint treat any stream error as a connection
//! error). Every case of a table runs at once against one daemon; a failure lists
//! every case that failed, with its section.

mod frames;
mod messages;
mod table;

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
