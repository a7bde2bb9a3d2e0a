//! The guard's judgement of each client frame (RFC 9113 §§4-8 and the flood
//! limits), and what it learns from the server's output.

use std::time::Instant;

use super::frames::*;
use super::H2Guard;

/// One client stream the guard tracks until both sides are done with it.
#[derive(Debug)]
pub(super) struct Stream {
    /// The client sent END_STREAM (or reset it).
    client_done: bool,
    /// The server sent END_STREAM: the stream goes once the client's comes.
    server_done: bool,
    /// The request's HEADERS arrived: another HEADERS is trailers.
    headers_seen: bool,
    /// How much more DATA the client may send (the server's grants minus what
    /// it sent).
    window: i64,
}

/// A header block being collected: HEADERS, then CONTINUATION until END_HEADERS.
#[derive(Debug)]
pub(super) struct Block {
    stream: u32,
    bytes: Vec<u8>,
    continuations: u32,
    end_stream: bool,
}

/// The guard's verdict on one frame.
pub(super) enum Verdict {
    /// Hand it to h2 as it is.
    Pass,
    /// A stream error: the client gets RST_STREAM with the code, h2 gets the frame
    /// (if `forward`) and then RST_STREAM(CANCEL).
    Stream { stream: u32, code: u32, forward: bool },
    /// A connection error: GOAWAY with the code, then the end.
    Connection(u32),
}

impl<S> H2Guard<S> {
    /// Judges what `raw` holds, moving what passes to `ready`.
    pub(super) fn ingest(&mut self) {
        // Taken out for the loop, so a frame's payload is judged where it lies (no
        // copy per frame) while the judgement changes the rest of the guard.
        let mut raw = std::mem::take(&mut self.raw);
        let mut at = 0;
        while !self.fatal && at < raw.len() {
            let available = raw.len() - at;
            if self.off {
                self.ready.extend_from_slice(&raw[at..]);
                at = raw.len();
            } else if self.preface_left > 0 {
                let done = PREFACE.len() - self.preface_left;
                let take = self.preface_left.min(available);
                if raw[at..at + take] != PREFACE[done..done + take] {
                    self.off = true;
                    continue;
                }
                self.ready.extend_from_slice(&raw[at..at + take]);
                self.preface_left -= take;
                at += take;
            } else if self.data_left > 0 {
                let take = self.data_left.min(available);
                self.ready.extend_from_slice(&raw[at..at + take]);
                self.data_left -= take;
                at += take;
                if self.data_left == 0 {
                    if let Some(stream) = self.cancel_after_data.take() {
                        put_frame(&mut self.ready, RST_STREAM, 0, stream, &CANCEL.to_be_bytes());
                    }
                }
            } else {
                let Some(header) = raw.get(at..at + HEADER_LEN) else {
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
                    self.frame_done();
                    continue;
                }
                let Some(whole) = raw.get(at..at + HEADER_LEN + f.len) else {
                    break;
                };
                let verdict = self.judge(f, &whole[HEADER_LEN..]);
                self.apply(verdict, f, whole);
                at += whole.len();
                self.frame_done();
            }
        }
        raw.drain(..at.min(raw.len()));
        self.raw = raw;
        // A frame begun and not complete, or a header block not ended: its time
        // runs from the read that brought its first byte.
        let open = !self.raw.is_empty() || self.block.is_some();
        if open && !self.off && self.preface_left == 0 && self.data_left == 0 && self.open_since.is_none() {
            self.set_open(Some(tokio::time::Instant::now()));
        }
    }

    /// A whole frame (a DATA frame's header) was judged: unless it left a header
    /// block open, nothing is open any more.
    fn frame_done(&mut self) {
        if self.block.is_none() {
            self.set_open(None);
        }
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
                        put_frame(&mut self.ready, RST_STREAM, 0, stream, &CANCEL.to_be_bytes());
                    } else {
                        self.cancel_after_data = Some(stream);
                    }
                }
                tracing::debug!(stream, code, "h2 guard: stream error on DATA");
                self.stream_error(stream, code);
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
                    put_frame(&mut self.ready, RST_STREAM, 0, stream, &CANCEL.to_be_bytes());
                }
                tracing::debug!(stream, code, kind = f.kind, "h2 guard: stream error");
                self.stream_error(stream, code);
            }
            Verdict::Connection(code) => self.connection_error(code),
        }
    }

    /// RST_STREAM with `code` to the client; counted, and past the connection's
    /// budget of stream errors (as h2 counts its own) the connection ends with
    /// GOAWAY ENHANCE_YOUR_CALM.
    fn stream_error(&mut self, stream: u32, code: u32) {
        self.remember_reset(stream);
        self.local_errors += 1;
        if self.local_errors > self.limits.max_local_error_resets {
            tracing::debug!(errors = self.local_errors, "h2 guard: too many stream errors");
            self.connection_error(ENHANCE_YOUR_CALM);
            return;
        }
        put_frame(&mut self.inject, RST_STREAM, 0, stream, &code.to_be_bytes());
    }

    pub(super) fn connection_error(&mut self, code: u32) {
        tracing::debug!(code, "h2 guard: connection error");
        let mut payload = [0u8; 8];
        payload[..4].copy_from_slice(&self.highest.to_be_bytes());
        payload[4..].copy_from_slice(&code.to_be_bytes());
        put_frame(&mut self.inject, GOAWAY, 0, 0, &payload);
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
                    if s.server_done {
                        self.streams.remove(&f.stream);
                    }
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
        if let Some(code) = settings_error(payload) {
            return Verdict::Connection(code);
        }
        Verdict::Pass
    }

    fn judge_reset(&mut self, f: OutFrame) -> Verdict {
        if f.stream == 0 {
            return Verdict::Connection(PROTOCOL_ERROR);
        }
        if self.streams.remove(&f.stream).is_some_and(|s| !s.server_done) {
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
                        server_done: false,
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
        let both_done = stream.client_done && stream.server_done;
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
        if both_done {
            self.streams.remove(&block.stream);
        }
        Verdict::Pass
    }

    /// Follows the server's output: streams it ended or reset, windows it granted.
    pub(super) fn on_output(&mut self, f: OutFrame, payload: &[u8]) {
        match f.kind {
            RST_STREAM => {
                if let Some(s) = self.streams.remove(&f.stream) {
                    if !s.client_done {
                        self.remember_reset(f.stream);
                    }
                }
            }
            DATA | HEADERS if f.flags & END_STREAM != 0 => match self.streams.get_mut(&f.stream) {
                Some(s) if s.client_done => {
                    self.streams.remove(&f.stream);
                }
                // The response ended first (an early answer, a bidirectional
                // stream): the client's END_STREAM or a reset ends it later.
                Some(s) => s.server_done = true,
                None => {}
            },
            WINDOW_UPDATE => {
                if let Some(increment) = window_increment(payload).map(i64::from) {
                    if f.stream == 0 {
                        self.connection_window += increment;
                    } else if let Some(s) = self.streams.get_mut(&f.stream) {
                        s.window += increment;
                    }
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::GuardLimits;
    use super::*;

    fn guard() -> H2Guard<()> {
        H2Guard::new(
            (),
            GuardLimits {
                max_frame_size: 16_384,
                stream_window: 1 << 20,
                max_header_bytes: 32 * 1024,
                max_concurrent_streams: 100,
                header_timeout: Duration::from_secs(2),
                connect_protocol: false,
                header_table_size: HEADER_TABLE_SIZE,
                max_send_buffer: 1 << 20,
                max_local_error_resets: 1024,
            },
        )
    }

    /// The head clock runs from the first byte of a frame or header block until
    /// the frame is whole and the block ended, and never for a DATA payload.
    #[test]
    fn the_head_clock_covers_open_frames_and_blocks_only() {
        let mut g = guard();
        g.raw.extend_from_slice(PREFACE);
        g.ingest();
        assert!(g.open_since.is_none(), "the preface is the handshake timeout's");
        let settings = frame_bytes(SETTINGS, 0, 0, &[]);
        g.raw.extend_from_slice(&settings[..4]);
        g.ingest();
        let since = g.open_since.expect("a frame header begun");
        g.raw.extend_from_slice(&settings[4..]);
        g.ingest();
        assert!(g.open_since.is_none(), "the frame is whole");
        let headers = frame_bytes(HEADERS, 0, 1, &[0x82]);
        g.raw.extend_from_slice(&headers);
        g.ingest();
        assert!(g.open_since.is_some_and(|t| t >= since), "a header block is open");
        let first = g.open_since;
        let far = tokio::time::Instant::now() + Duration::from_secs(3);
        assert!(
            g.head_clock().open_for(Duration::from_secs(2), far),
            "the driver sees it"
        );
        assert!(!g.head_clock().open_for(Duration::from_secs(60), far));
        g.raw.extend_from_slice(&frame_bytes(CONTINUATION, 0, 1, &[0x84]));
        g.ingest();
        assert_eq!(g.open_since, first, "a CONTINUATION does not restart the clock");
        g.raw
            .extend_from_slice(&frame_bytes(CONTINUATION, END_HEADERS, 1, &[0x87]));
        g.ingest();
        assert!(g.open_since.is_none(), "the block ended");
        let clock = g.head_clock();
        let now = tokio::time::Instant::now();
        assert!(
            !clock.open_for(Duration::ZERO, now),
            "the driver sees no head open"
        );
        let data = frame_bytes(DATA, 0, 1, &[7u8; 100]);
        g.raw.extend_from_slice(&data[..50]);
        g.ingest();
        assert!(g.open_since.is_none(), "a DATA payload streams through, untimed");
        assert!(!g.fatal);
    }

    fn feed(g: &mut H2Guard<()>, bytes: &[u8]) {
        g.raw.extend_from_slice(bytes);
        g.ingest();
    }

    fn output(g: &mut H2Guard<()>, bytes: &[u8]) {
        let mut seen = Vec::new();
        g.output.track(bytes, |f, p| seen.push((f, p.to_vec())));
        for (f, p) in seen {
            g.on_output(f, &p);
        }
    }

    /// A POST header block (literal fields without indexing).
    fn request_block() -> Vec<u8> {
        let mut block = Vec::new();
        for (name, value) in [(":method", "POST"), (":scheme", "https"), (":path", "/")] {
            block.push(0);
            block.push(name.len() as u8);
            block.extend_from_slice(name.as_bytes());
            block.push(value.len() as u8);
            block.extend_from_slice(value.as_bytes());
        }
        block
    }

    /// A stream the server ends first leaves the table when the client's
    /// END_STREAM comes, with no reset in between.
    #[test]
    fn stream_ended_by_the_server_first_is_forgotten() {
        let mut g = guard();
        feed(&mut g, PREFACE);
        feed(&mut g, &frame_bytes(HEADERS, END_HEADERS, 1, &request_block()));
        assert_eq!(g.streams.len(), 1);
        output(&mut g, &frame_bytes(DATA, END_STREAM, 1, b"early"));
        assert_eq!(g.streams.len(), 1, "the client may still send");
        feed(&mut g, &frame_bytes(DATA, END_STREAM, 1, b""));
        assert!(g.streams.is_empty());
        assert!(!g.fatal);
    }

    /// The guard's own stream errors are counted: past the limit, GOAWAY
    /// ENHANCE_YOUR_CALM instead of one more RST_STREAM.
    #[test]
    fn guard_stream_errors_are_limited_per_connection() {
        let mut g = guard();
        g.limits.max_local_error_resets = 10;
        feed(&mut g, PREFACE);
        let bad_priority = frame_bytes(PRIORITY, 0, 3, &[0, 0, 0, 0]);
        for _ in 0..10 {
            feed(&mut g, &bad_priority);
        }
        assert!(!g.fatal);
        assert_eq!(g.inject.len(), 10 * 13);
        feed(&mut g, &bad_priority);
        assert!(g.fatal);
        assert_eq!(g.inject.len(), 10 * 13 + 17, "then GOAWAY");
        assert_eq!(&g.inject[g.inject.len() - 4..], &ENHANCE_YOUR_CALM.to_be_bytes());
    }

    /// Peer input never panics the guard and never grows what it holds beyond
    /// one frame: random frames of every type, random flags, streams and payloads,
    /// split at random points, with random server frames in between.
    #[test]
    fn random_frames_never_panic() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for _ in 0..2_000 {
            let mut g = guard();
            g.raw.extend_from_slice(PREFACE);
            g.ingest();
            for _ in 0..next(40) {
                let payload: Vec<u8> = (0..next(64)).map(|_| next(256) as u8).collect();
                let stream = next(8) as u32;
                let bytes = frame_bytes(next(12) as u8, next(256) as u8, stream, &payload);
                let cut = next(bytes.len() as u64 + 1) as usize;
                g.raw.extend_from_slice(&bytes[..cut]);
                g.ingest();
                g.raw.extend_from_slice(&bytes[cut..]);
                g.ingest();
                let out = frame_bytes(next(10) as u8, next(2) as u8, stream, &[0, 0, 0, next(200) as u8]);
                let mut seen = Vec::new();
                g.output.track(&out, |f, p| seen.push((f, p.to_vec())));
                for (f, p) in seen {
                    g.on_output(f, &p);
                }
                assert!(g.raw.len() <= HEADER_LEN + 16_384);
                g.ready.clear();
                if g.fatal {
                    break;
                }
            }
        }
    }
}
