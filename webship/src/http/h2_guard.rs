//! A frame-level guard in front of hyper's HTTP/2 server: it reads the client's
//! frames before h2 does and answers the RFC 9113 requirements h2 0.4 gets wrong
//! (or answers with another error code) itself, with GOAWAY or RST_STREAM and the
//! code the RFC names. It also bounds two floods h2 leaves to the caller: a header
//! block that never ends (CVE-2024-27316-style CONTINUATION floods) and clients
//! that cancel streams as fast as they open them (CVE-2023-44487, "rapid reset").
//!
//! What it answers (everything else goes to h2 unchanged):
//! - frame sizes of PING, SETTINGS, RST_STREAM, WINDOW_UPDATE, GOAWAY, PRIORITY and
//!   frames over our SETTINGS_MAX_FRAME_SIZE: FRAME_SIZE_ERROR (h2: PROTOCOL_ERROR);
//! - SETTINGS values: INITIAL_WINDOW_SIZE over 2^31-1 is FLOW_CONTROL_ERROR (h2:
//!   PROTOCOL_ERROR), ENABLE_PUSH and MAX_FRAME_SIZE ranges PROTOCOL_ERROR;
//! - HPACK decoding errors: COMPRESSION_ERROR (h2: PROTOCOL_ERROR), for which the
//!   guard decodes every header block with its own decoder, kept in step with h2's
//!   (same blocks, same order, same table size limit);
//! - DATA or HEADERS after the client ended the stream: STREAM_CLOSED (h2:
//!   PROTOCOL_ERROR);
//! - pseudo-fields in trailers, CONNECT without :authority: a PROTOCOL_ERROR stream
//!   error (h2 accepts them);
//! - DATA beyond the flow-control window the server granted: FLOW_CONTROL_ERROR,
//!   decided on the bytes as they arrive (h2 may have reset the stream first).
//!
//! A connection error is a GOAWAY written at the next frame boundary of hyper's
//! output, after which hyper reads end of stream and its further output is
//! dropped. A stream error is a RST_STREAM written to the client the same way,
//! while h2 is handed a RST_STREAM(CANCEL) from the "client" after the offending
//! frame, so both sides forget the stream. Header blocks always reach h2, so its
//! HPACK table stays in step with the client's.
//!
//! Memory: one frame of input (up to our SETTINGS_MAX_FRAME_SIZE; DATA payloads
//! are streamed through, never buffered), one header block (capped), and a table
//! of open streams (h2 caps those with SETTINGS_MAX_CONCURRENT_STREAMS; the guard
//! drops a connection past a hard cap).

use std::collections::{HashMap, VecDeque};
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADER_LEN: usize = 9;

const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const PRIORITY: u8 = 0x2;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PUSH_PROMISE: u8 = 0x5;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const WINDOW_UPDATE: u8 = 0x8;
const CONTINUATION: u8 = 0x9;

const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY_FLAG: u8 = 0x20;

const PROTOCOL_ERROR: u32 = 0x1;
const FLOW_CONTROL_ERROR: u32 = 0x3;
const STREAM_CLOSED: u32 = 0x5;
const FRAME_SIZE_ERROR: u32 = 0x6;
const CANCEL: u32 = 0x8;
const COMPRESSION_ERROR: u32 = 0x9;
const ENHANCE_YOUR_CALM: u32 = 0xb;

/// RFC 9113 §6.9.1: the largest flow-control window.
const MAX_WINDOW: i64 = (1 << 31) - 1;
/// The window every stream and the connection start with (RFC 9113 §6.9.2).
const DEFAULT_WINDOW: i64 = 65_535;
/// The HPACK table size h2 advertises (its default; hyper does not change it).
const HEADER_TABLE_SIZE: usize = 4096;
/// Streams the server reset while the client could still send on them: frames
/// on these are ignored (RFC 9113 §5.1, closed), on other closed streams they are
/// STREAM_CLOSED. Bounded: the oldest are forgotten.
const RECENT_RESETS: usize = 256;
/// CONTINUATION frames one header block may have.
const MAX_CONTINUATIONS: u32 = 64;
/// The most one read from the connection takes (what hyper asks for, capped).
const MAX_READ: usize = 64 * 1024;
/// How the rapid-reset budget is counted.
const RESET_WINDOW: Duration = Duration::from_secs(1);

/// What the guard needs to know of the server's settings.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GuardLimits {
    /// Our SETTINGS_MAX_FRAME_SIZE.
    pub(crate) max_frame_size: u32,
    /// Our SETTINGS_INITIAL_WINDOW_SIZE. (The connection window starts at the
    /// default; h2's WINDOW_UPDATE raising it is followed like any other.)
    pub(crate) stream_window: u32,
    /// Our SETTINGS_MAX_HEADER_LIST_SIZE; a header block's encoded bytes may be at
    /// most twice this (HPACK never needs more for a list this size).
    pub(crate) max_header_bytes: usize,
    /// Our SETTINGS_MAX_CONCURRENT_STREAMS: the open-stream table's scale, and the
    /// number of streams a client may cancel per second before GOAWAY
    /// ENHANCE_YOUR_CALM.
    pub(crate) max_concurrent_streams: u32,
}

/// The guard's limits for a connection of `ctx`: what hyper's builder advertises.
pub(crate) fn guard_limits(ctx: &crate::exchange::ConnContext) -> GuardLimits {
    GuardLimits {
        max_frame_size: ctx.h2.max_frame_size_bytes,
        stream_window: ctx.h2.initial_stream_window_bytes,
        max_header_bytes: ctx.limits.max_header_bytes,
        max_concurrent_streams: ctx.h2.max_concurrent_streams,
    }
}

/// One client stream the guard tracks until both sides are done with it.
#[derive(Debug)]
struct Stream {
    /// The client sent END_STREAM (or reset it).
    client_done: bool,
    /// The request's HEADERS arrived: another HEADERS is trailers.
    headers_seen: bool,
    /// How much more DATA the client may send (the server's grants minus what
    /// it sent).
    window: i64,
}

/// A header block being collected: HEADERS, then CONTINUATION until END_HEADERS.
#[derive(Debug)]
struct Block {
    stream: u32,
    bytes: Vec<u8>,
    continuations: u32,
    end_stream: bool,
}

/// Reading the server's output frame by frame: where the next boundary is, and
/// the few frames whose content the guard needs (END_STREAM, RST_STREAM,
/// WINDOW_UPDATE).
#[derive(Debug, Default)]
struct Output {
    header: [u8; HEADER_LEN],
    header_len: usize,
    /// Payload bytes left in the current frame.
    remaining: usize,
    /// The start of a WINDOW_UPDATE's payload (its increment).
    small: Vec<u8>,
}

/// What a finished output frame header says.
#[derive(Debug, Clone, Copy)]
struct OutFrame {
    kind: u8,
    flags: u8,
    stream: u32,
    len: usize,
}

impl Output {
    fn at_boundary(&self) -> bool {
        self.header_len == 0 && self.remaining == 0
    }

    /// Follows `bytes` of output; calls `done` for each frame that ends in them
    /// with its header and (for WINDOW_UPDATE) payload.
    fn track(&mut self, mut bytes: &[u8], mut done: impl FnMut(OutFrame, &[u8])) {
        while !bytes.is_empty() {
            if self.remaining == 0 && self.header_len < HEADER_LEN {
                let take = (HEADER_LEN - self.header_len).min(bytes.len());
                self.header[self.header_len..self.header_len + take].copy_from_slice(&bytes[..take]);
                self.header_len += take;
                bytes = &bytes[take..];
                if self.header_len < HEADER_LEN {
                    return;
                }
                let f = self.frame();
                self.remaining = f.len;
                self.small.clear();
                if f.len == 0 {
                    self.header_len = 0;
                    done(f, &[]);
                }
                continue;
            }
            let take = self.remaining.min(bytes.len());
            let f = self.frame();
            if f.kind == WINDOW_UPDATE && self.small.len() < 4 {
                let keep = take.min(4 - self.small.len());
                self.small.extend_from_slice(&bytes[..keep]);
            }
            self.remaining -= take;
            bytes = &bytes[take..];
            if self.remaining == 0 {
                self.header_len = 0;
                done(f, &self.small);
            }
        }
    }

    fn frame(&self) -> OutFrame {
        parse_header(&self.header)
    }
}

fn parse_header(h: &[u8; HEADER_LEN]) -> OutFrame {
    OutFrame {
        len: usize::from(h[0]) << 16 | usize::from(h[1]) << 8 | usize::from(h[2]),
        kind: h[3],
        flags: h[4],
        stream: u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff,
    }
}

fn frame_bytes(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).unwrap_or(0).to_be_bytes();
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&len[1..]);
    out.extend_from_slice(&[kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// The guard's verdict on one frame.
enum Verdict {
    /// Hand it to h2 as it is.
    Pass,
    /// A stream error: the client gets RST_STREAM with the code, h2 gets the frame
    /// (if `forward`) and then RST_STREAM(CANCEL).
    Stream { stream: u32, code: u32, forward: bool },
    /// A connection error: GOAWAY with the code, then the end.
    Connection(u32),
}

/// The I/O guard: wraps the connection hyper's h2 server reads and writes.
pub(crate) struct H2Guard<S> {
    inner: S,
    limits: GuardLimits,
    /// Input not yet judged: at most one frame header plus one non-DATA payload.
    raw: Vec<u8>,
    /// Where input is read into before it is judged.
    scratch: Vec<u8>,
    /// Judged input hyper has not read yet.
    ready: Vec<u8>,
    ready_at: usize,
    /// Preface bytes still to come; a wrong preface turns the guard off (h2 refuses
    /// it itself).
    preface_left: usize,
    /// The guard could not follow the stream: everything passes unjudged.
    off: bool,
    /// DATA payload bytes still to pass through unbuffered.
    data_left: usize,
    /// A stream h2 is told the client cancelled once the DATA passing ends.
    cancel_after_data: Option<u32>,
    block: Option<Block>,
    decoder: loona_hpack::Decoder<'static>,
    streams: HashMap<u32, Stream>,
    recent_resets: VecDeque<u32>,
    highest: u32,
    /// The client's SETTINGS_INITIAL_WINDOW_SIZE does not matter here; ours does,
    /// once the client acknowledged it (until then the default).
    our_settings_acked: bool,
    connection_window: i64,
    resets: (Instant, u32),
    output: Output,
    /// Frames to write to the client at the next output boundary.
    inject: Vec<u8>,
    inject_at: usize,
    needs_flush: bool,
    /// A connection error: GOAWAY is queued; once written, reads end and writes
    /// are dropped.
    fatal: bool,
    read_waker: Option<Waker>,
}

impl<S> std::fmt::Debug for H2Guard<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("H2Guard")
            .field("streams", &self.streams.len())
            .field("highest", &self.highest)
            .field("fatal", &self.fatal)
            .finish_non_exhaustive()
    }
}

impl<S> H2Guard<S> {
    pub(crate) fn new(inner: S, limits: GuardLimits) -> Self {
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(HEADER_TABLE_SIZE);
        Self {
            inner,
            limits,
            raw: Vec::new(),
            scratch: Vec::new(),
            ready: Vec::new(),
            ready_at: 0,
            preface_left: PREFACE.len(),
            off: false,
            data_left: 0,
            cancel_after_data: None,
            block: None,
            decoder,
            streams: HashMap::new(),
            recent_resets: VecDeque::new(),
            highest: 0,
            our_settings_acked: false,
            connection_window: DEFAULT_WINDOW,
            resets: (Instant::now(), 0),
            output: Output::default(),
            inject: Vec::new(),
            inject_at: 0,
            needs_flush: false,
            fatal: false,
            read_waker: None,
        }
    }

    /// Judges what `raw` holds, moving what passes to `ready`.
    fn ingest(&mut self) {
        let mut at = 0;
        while !self.fatal && at < self.raw.len() {
            let available = self.raw.len() - at;
            if self.off {
                self.ready.extend_from_slice(&self.raw[at..]);
                at = self.raw.len();
            } else if self.preface_left > 0 {
                let done = PREFACE.len() - self.preface_left;
                let take = self.preface_left.min(available);
                if self.raw[at..at + take] != PREFACE[done..done + take] {
                    self.off = true;
                    continue;
                }
                self.ready.extend_from_slice(&self.raw[at..at + take]);
                self.preface_left -= take;
                at += take;
            } else if self.data_left > 0 {
                let take = self.data_left.min(available);
                self.ready.extend_from_slice(&self.raw[at..at + take]);
                self.data_left -= take;
                at += take;
                if self.data_left == 0 {
                    if let Some(stream) = self.cancel_after_data.take() {
                        self.ready
                            .extend(frame_bytes(RST_STREAM, 0, stream, &CANCEL.to_be_bytes()));
                    }
                }
            } else {
                let Some(header) = self.raw.get(at..at + HEADER_LEN) else {
                    break;
                };
                let mut copy = [0u8; HEADER_LEN];
                copy.copy_from_slice(header);
                let f = parse_header(&copy);
                if f.len > self.limits.max_frame_size as usize {
                    self.connection_error(FRAME_SIZE_ERROR);
                    break;
                }
                if matches!(f.kind, HEADERS | CONTINUATION) && f.len > self.block_cap() {
                    // Refused before its bytes are buffered.
                    self.connection_error(ENHANCE_YOUR_CALM);
                    break;
                }
                if f.kind == DATA {
                    let verdict = self.judge_data(f);
                    self.apply_data(verdict, f, &copy);
                    at += HEADER_LEN;
                    continue;
                }
                let Some(whole) = self.raw.get(at..at + HEADER_LEN + f.len) else {
                    break;
                };
                let whole = whole.to_vec();
                let verdict = self.judge(f, &whole[HEADER_LEN..]);
                self.apply(verdict, f, &whole);
                at += whole.len();
            }
        }
        self.raw.drain(..at.min(self.raw.len()));
    }

    /// A DATA frame's header: passed with its payload, which streams after it; a
    /// stream error still passes it (h2 counts it against the connection window,
    /// as the client did) and cancels the stream for h2 after its last byte.
    fn apply_data(&mut self, verdict: Verdict, f: OutFrame, header: &[u8]) {
        match verdict {
            Verdict::Connection(code) => self.connection_error(code),
            Verdict::Pass => {
                self.ready.extend_from_slice(header);
                self.data_left = f.len;
            }
            Verdict::Stream { stream, code, .. } => {
                self.ready.extend_from_slice(header);
                self.data_left = f.len;
                if self.streams.remove(&stream).is_some() {
                    if f.len == 0 {
                        self.ready
                            .extend(frame_bytes(RST_STREAM, 0, stream, &CANCEL.to_be_bytes()));
                    } else {
                        self.cancel_after_data = Some(stream);
                    }
                }
                self.remember_reset(stream);
                self.inject
                    .extend(frame_bytes(RST_STREAM, 0, stream, &code.to_be_bytes()));
                tracing::debug!(stream, code, "h2 guard: stream error on DATA");
            }
        }
    }

    fn apply(&mut self, verdict: Verdict, f: OutFrame, whole: &[u8]) {
        match verdict {
            Verdict::Pass => self.ready.extend_from_slice(whole),
            Verdict::Stream {
                stream,
                code,
                forward,
            } => {
                if forward {
                    self.ready.extend_from_slice(whole);
                }
                if self.streams.remove(&stream).is_some() {
                    self.ready
                        .extend(frame_bytes(RST_STREAM, 0, stream, &CANCEL.to_be_bytes()));
                }
                self.remember_reset(stream);
                self.inject
                    .extend(frame_bytes(RST_STREAM, 0, stream, &code.to_be_bytes()));
                tracing::debug!(stream, code, kind = f.kind, "h2 guard: stream error");
            }
            Verdict::Connection(code) => self.connection_error(code),
        }
    }

    fn connection_error(&mut self, code: u32) {
        tracing::debug!(code, "h2 guard: connection error");
        let mut payload = self.highest.to_be_bytes().to_vec();
        payload.extend_from_slice(&code.to_be_bytes());
        self.inject.extend(frame_bytes(GOAWAY, 0, 0, &payload));
        self.fatal = true;
        self.ready.clear();
        self.ready_at = 0;
    }

    fn remember_reset(&mut self, stream: u32) {
        if self.recent_resets.len() >= RECENT_RESETS {
            self.recent_resets.pop_front();
        }
        self.recent_resets.push_back(stream);
    }

    /// The judgement on a DATA frame's header (its payload streams through).
    fn judge_data(&mut self, f: OutFrame) -> Verdict {
        if self.block.is_some() {
            return Verdict::Connection(PROTOCOL_ERROR);
        }
        if f.stream == 0 {
            return Verdict::Connection(PROTOCOL_ERROR);
        }
        let len = f.len as i64;
        self.connection_window -= len;
        if self.connection_window < 0 {
            return Verdict::Connection(FLOW_CONTROL_ERROR);
        }
        match self.streams.get_mut(&f.stream) {
            Some(s) if s.client_done => Verdict::Connection(STREAM_CLOSED),
            Some(s) => {
                s.window -= len;
                if s.window < 0 {
                    return Verdict::Stream {
                        stream: f.stream,
                        code: FLOW_CONTROL_ERROR,
                        forward: false,
                    };
                }
                if f.flags & END_STREAM != 0 {
                    s.client_done = true;
                }
                Verdict::Pass
            }
            None => self.on_closed(f.stream),
        }
    }

    /// A frame on a stream the guard does not track: idle (h2 answers), reset by
    /// the server a moment ago (ignored, h2 does), or closed (STREAM_CLOSED).
    fn on_closed(&self, stream: u32) -> Verdict {
        if stream > self.highest || self.recent_resets.contains(&stream) {
            Verdict::Pass
        } else {
            Verdict::Connection(STREAM_CLOSED)
        }
    }

    /// The judgement on a whole non-DATA frame.
    fn judge(&mut self, f: OutFrame, payload: &[u8]) -> Verdict {
        if let Some(block) = &self.block {
            if f.kind != CONTINUATION || f.stream != block.stream {
                return Verdict::Connection(PROTOCOL_ERROR);
            }
        }
        match f.kind {
            HEADERS => self.judge_headers(f, payload),
            CONTINUATION => self.judge_continuation(f, payload),
            PRIORITY if f.stream == 0 => Verdict::Connection(PROTOCOL_ERROR),
            PRIORITY if f.len != 5 => Verdict::Stream {
                stream: f.stream,
                code: FRAME_SIZE_ERROR,
                forward: false,
            },
            RST_STREAM | WINDOW_UPDATE if f.len != 4 => Verdict::Connection(FRAME_SIZE_ERROR),
            RST_STREAM => self.judge_reset(f),
            SETTINGS => self.judge_settings(f, payload),
            PING if f.stream != 0 => Verdict::Connection(PROTOCOL_ERROR),
            PING if f.len != 8 => Verdict::Connection(FRAME_SIZE_ERROR),
            GOAWAY if f.stream != 0 => Verdict::Connection(PROTOCOL_ERROR),
            GOAWAY if f.len < 8 => Verdict::Connection(FRAME_SIZE_ERROR),
            PUSH_PROMISE => Verdict::Connection(PROTOCOL_ERROR),
            _ => Verdict::Pass,
        }
    }

    fn judge_settings(&mut self, f: OutFrame, payload: &[u8]) -> Verdict {
        if f.stream != 0 {
            return Verdict::Connection(PROTOCOL_ERROR);
        }
        if f.flags & ACK != 0 {
            if f.len != 0 {
                return Verdict::Connection(FRAME_SIZE_ERROR);
            }
            if !self.our_settings_acked {
                self.our_settings_acked = true;
                // Our initial stream window now applies to every open stream.
                let delta = i64::from(self.limits.stream_window) - DEFAULT_WINDOW;
                for s in self.streams.values_mut() {
                    s.window += delta;
                }
            }
            return Verdict::Pass;
        }
        if !f.len.is_multiple_of(6) {
            return Verdict::Connection(FRAME_SIZE_ERROR);
        }
        for setting in payload.chunks_exact(6) {
            let id = u16::from_be_bytes([setting[0], setting[1]]);
            let value = u32::from_be_bytes([setting[2], setting[3], setting[4], setting[5]]);
            let bad = match id {
                0x2 => (value > 1).then_some(PROTOCOL_ERROR),
                0x4 => (i64::from(value) > MAX_WINDOW).then_some(FLOW_CONTROL_ERROR),
                0x5 => (!(16_384..=16_777_215).contains(&value)).then_some(PROTOCOL_ERROR),
                _ => None,
            };
            if let Some(code) = bad {
                return Verdict::Connection(code);
            }
        }
        Verdict::Pass
    }

    fn judge_reset(&mut self, f: OutFrame) -> Verdict {
        if f.stream == 0 {
            return Verdict::Connection(PROTOCOL_ERROR);
        }
        if self.streams.remove(&f.stream).is_some() {
            // The client cancelled a stream the server was still working on.
            let now = Instant::now();
            if now.duration_since(self.resets.0) > RESET_WINDOW {
                self.resets = (now, 0);
            }
            self.resets.1 += 1;
            if self.resets.1 > self.limits.max_concurrent_streams.max(100) {
                tracing::debug!("h2 guard: rapid reset");
                return Verdict::Connection(ENHANCE_YOUR_CALM);
            }
        }
        Verdict::Pass
    }

    fn judge_headers(&mut self, f: OutFrame, payload: &[u8]) -> Verdict {
        if f.stream == 0 {
            return Verdict::Connection(PROTOCOL_ERROR);
        }
        let Some(fragment) = header_fragment(f, payload) else {
            return Verdict::Connection(PROTOCOL_ERROR);
        };
        match self.streams.get(&f.stream) {
            Some(s) if s.client_done => return Verdict::Connection(STREAM_CLOSED),
            Some(_) => {}
            None if f.stream > self.highest => {
                if f.stream.is_multiple_of(2) {
                    return Verdict::Connection(PROTOCOL_ERROR);
                }
                if self.streams.len() >= 4 * self.limits.max_concurrent_streams as usize + 64 {
                    return Verdict::Connection(ENHANCE_YOUR_CALM);
                }
                self.highest = f.stream;
                let window = if self.our_settings_acked {
                    i64::from(self.limits.stream_window)
                } else {
                    DEFAULT_WINDOW
                };
                self.streams.insert(
                    f.stream,
                    Stream {
                        client_done: false,
                        headers_seen: false,
                        window,
                    },
                );
            }
            // A lower stream id: h2 tells the reused idle id (PROTOCOL_ERROR) from
            // a closed one; the block still goes through the decoder.
            None => {}
        }
        self.block = Some(Block {
            stream: f.stream,
            bytes: fragment.to_vec(),
            continuations: 0,
            end_stream: f.flags & END_STREAM != 0,
        });
        self.end_block(f)
    }

    /// The most bytes one header block may have: twice the header list we accept
    /// (HPACK never needs more to carry it), and never less than one 16 KiB frame.
    fn block_cap(&self) -> usize {
        2 * self.limits.max_header_bytes.max(16 * 1024)
    }

    fn judge_continuation(&mut self, f: OutFrame, payload: &[u8]) -> Verdict {
        let cap = self.block_cap();
        let Some(block) = self.block.as_mut() else {
            // No header block open: h2 answers PROTOCOL_ERROR, as RFC 9113 §6.10 says.
            return Verdict::Connection(PROTOCOL_ERROR);
        };
        block.continuations += 1;
        if block.continuations > MAX_CONTINUATIONS || block.bytes.len() + payload.len() > cap {
            return Verdict::Connection(ENHANCE_YOUR_CALM);
        }
        block.bytes.extend_from_slice(payload);
        self.end_block(f)
    }

    /// After a HEADERS or CONTINUATION frame: once the block is complete, decode it
    /// and judge the fields.
    fn end_block(&mut self, f: OutFrame) -> Verdict {
        if f.flags & END_HEADERS == 0 {
            return Verdict::Pass;
        }
        let Some(block) = self.block.take() else {
            return Verdict::Pass;
        };
        let mut fields = Fields::default();
        if self
            .decoder
            .decode_with_cb(&block.bytes, |name, value| fields.see(&name, &value))
            .is_err()
        {
            return Verdict::Connection(COMPRESSION_ERROR);
        }
        let Some(stream) = self.streams.get_mut(&block.stream) else {
            // A block for a stream reset a moment ago: decoded for the table only.
            return Verdict::Pass;
        };
        let trailers = stream.headers_seen;
        stream.headers_seen = true;
        if block.end_stream {
            stream.client_done = true;
        }
        let malformed = if trailers {
            fields.pseudo
        } else {
            fields.connect && !fields.protocol && !fields.authority
        };
        if malformed {
            return Verdict::Stream {
                stream: block.stream,
                code: PROTOCOL_ERROR,
                forward: true,
            };
        }
        Verdict::Pass
    }

    /// Follows the server's output: streams it ended or reset, windows it granted.
    fn on_output(&mut self, f: OutFrame, payload: &[u8]) {
        match f.kind {
            RST_STREAM => {
                if let Some(s) = self.streams.remove(&f.stream) {
                    if !s.client_done {
                        self.remember_reset(f.stream);
                    }
                }
            }
            DATA | HEADERS
                if f.flags & END_STREAM != 0
                    && self.streams.get(&f.stream).is_some_and(|s| s.client_done) =>
            {
                self.streams.remove(&f.stream);
            }
            WINDOW_UPDATE if payload.len() == 4 => {
                let increment = i64::from(
                    u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]) & 0x7fff_ffff,
                );
                if f.stream == 0 {
                    self.connection_window += increment;
                } else if let Some(s) = self.streams.get_mut(&f.stream) {
                    s.window += increment;
                }
            }
            _ => {}
        }
    }
}

/// What the guard looks for in a decoded field list.
#[derive(Debug, Default)]
struct Fields {
    pseudo: bool,
    connect: bool,
    protocol: bool,
    authority: bool,
}

impl Fields {
    fn see(&mut self, name: &[u8], value: &[u8]) {
        if name.first() == Some(&b':') {
            self.pseudo = true;
        }
        match name {
            b":method" => self.connect |= value == b"CONNECT",
            b":protocol" => self.protocol = true,
            b":authority" => self.authority = true,
            _ => {}
        }
    }
}

/// A HEADERS payload without its padding and priority fields; `None` if the
/// padding is longer than the payload (RFC 9113 §6.2: PROTOCOL_ERROR).
fn header_fragment(f: OutFrame, payload: &[u8]) -> Option<&[u8]> {
    let mut rest = payload;
    let mut pad = 0;
    if f.flags & PADDED != 0 {
        pad = usize::from(*rest.first()?);
        rest = rest.get(1..)?;
    }
    if f.flags & PRIORITY_FLAG != 0 {
        rest = rest.get(5..)?;
    }
    rest.get(..rest.len().checked_sub(pad)?)
}

impl<S: AsyncWrite + Unpin> H2Guard<S> {
    /// Writes queued frames if the output is at a frame boundary; Ready once none
    /// are left.
    fn poll_inject(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.inject_at < self.inject.len() {
            if !self.output.at_boundary() {
                return Poll::Pending;
            }
            let n =
                std::task::ready!(Pin::new(&mut self.inner).poll_write(cx, &self.inject[self.inject_at..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.inject_at += n;
            self.needs_flush = true;
        }
        self.inject.clear();
        self.inject_at = 0;
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for H2Guard<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            match this.poll_inject(cx) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                // Mid-frame output: the write that finishes the frame wakes us.
                Poll::Pending if !this.output.at_boundary() => {
                    this.read_waker = Some(cx.waker().clone());
                    if this.fatal {
                        return Poll::Pending;
                    }
                }
                Poll::Pending => return Poll::Pending,
            }
            if this.needs_flush {
                match Pin::new(&mut this.inner).poll_flush(cx) {
                    Poll::Ready(Ok(())) => this.needs_flush = false,
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    // Flushing is also what a deferred batch asks for: go on
                    // reading, the next poll flushes again.
                    Poll::Pending if this.fatal => return Poll::Pending,
                    Poll::Pending => {}
                }
            }
            if this.fatal {
                // GOAWAY is out: hyper reads the end of the connection.
                return Poll::Ready(Ok(()));
            }
            if this.ready_at < this.ready.len() {
                let n = buf.remaining().min(this.ready.len() - this.ready_at);
                buf.put_slice(&this.ready[this.ready_at..this.ready_at + n]);
                this.ready_at += n;
                if this.ready_at == this.ready.len() {
                    this.ready.clear();
                    this.ready_at = 0;
                }
                return Poll::Ready(Ok(()));
            }
            // Read as much as hyper asked for, so h2 sees the reads it would
            // without the guard (one buffer per connection, zeroed once).
            let want = buf.remaining().clamp(8 * 1024, MAX_READ);
            if this.scratch.len() < want {
                this.scratch.resize(want, 0);
            }
            let mut read = ReadBuf::new(&mut this.scratch[..want]);
            std::task::ready!(Pin::new(&mut this.inner).poll_read(cx, &mut read))?;
            if read.filled().is_empty() {
                return Poll::Ready(Ok(()));
            }
            this.raw.extend_from_slice(read.filled());
            this.ingest();
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for H2Guard<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if this.fatal && this.output.at_boundary() {
            // After GOAWAY nothing more goes out; hyper is told it went.
            if this.poll_inject(cx)?.is_pending() {
                return Poll::Pending;
            }
            return Poll::Ready(Ok(buf.len()));
        }
        if this.output.at_boundary() && this.poll_inject(cx)?.is_pending() {
            return Poll::Pending;
        }
        // Never past the end of the current frame when something waits to go in
        // between, so the next call finds the boundary.
        let limit = if this.inject.is_empty() || this.output.at_boundary() {
            buf.len()
        } else {
            frame_end(&this.output, buf)
        };
        let n = std::task::ready!(Pin::new(&mut this.inner).poll_write(cx, &buf[..limit]))?;
        let mut finished = Vec::new();
        this.output
            .track(&buf[..n], |f, payload| finished.push((f, payload.to_vec())));
        for (f, payload) in finished {
            this.on_output(f, &payload);
        }
        if this.output.at_boundary() {
            if let Some(waker) = this.read_waker.take() {
                waker.wake();
            }
        }
        Poll::Ready(Ok(n))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.output.at_boundary() {
            std::task::ready!(this.poll_inject(cx))?;
        }
        this.needs_flush = false;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.output.at_boundary() {
            std::task::ready!(this.poll_inject(cx))?;
        }
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

/// How many of `buf`'s bytes finish the output frame in progress (all of them if
/// it does not end in `buf`).
fn frame_end(output: &Output, buf: &[u8]) -> usize {
    if output.header_len < HEADER_LEN && output.remaining == 0 {
        // Inside a header: its length is not known yet; finish the header first.
        let need = HEADER_LEN - output.header_len;
        if buf.len() <= need {
            return buf.len();
        }
        let mut header = output.header;
        header[output.header_len..].copy_from_slice(&buf[..need]);
        return (need + parse_header(&header).len).min(buf.len());
    }
    output.remaining.min(buf.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_tracking_finds_frame_boundaries_across_writes() {
        let mut out = Output::default();
        let mut seen = Vec::new();
        let mut bytes = frame_bytes(DATA, END_STREAM, 1, b"hello");
        bytes.extend(frame_bytes(WINDOW_UPDATE, 0, 0, &100u32.to_be_bytes()));
        for chunk in bytes.chunks(4) {
            out.track(chunk, |f, p| seen.push((f.kind, f.stream, p.to_vec())));
        }
        assert!(out.at_boundary());
        assert_eq!(
            seen,
            vec![
                (DATA, 1, vec![]),
                (WINDOW_UPDATE, 0, 100u32.to_be_bytes().to_vec())
            ]
        );
    }

    #[test]
    fn header_fragment_rejects_padding_past_the_payload() {
        let f = OutFrame {
            kind: HEADERS,
            flags: PADDED,
            stream: 1,
            len: 3,
        };
        assert!(header_fragment(f, &[5, 1, 2]).is_none());
        assert_eq!(header_fragment(f, &[1, 1, 2]), Some(&[1][..]));
    }
}
