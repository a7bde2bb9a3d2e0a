//! The HTTP/2 frame layer the guard needs: frame and flag constants, a frame
//! header's fields, and a tracker that follows hyper's output frame by frame so the
//! guard writes its own frames only between two of hyper's; and the guard's limits.

use std::time::Duration;

pub(super) const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
pub(super) const HEADER_LEN: usize = 9;

pub(super) const DATA: u8 = 0x0;
pub(super) const HEADERS: u8 = 0x1;
pub(super) const PRIORITY: u8 = 0x2;
pub(super) const RST_STREAM: u8 = 0x3;
pub(super) const SETTINGS: u8 = 0x4;
pub(super) const PUSH_PROMISE: u8 = 0x5;
pub(super) const PING: u8 = 0x6;
pub(super) const GOAWAY: u8 = 0x7;
pub(super) const WINDOW_UPDATE: u8 = 0x8;
pub(super) const CONTINUATION: u8 = 0x9;

pub(super) const END_STREAM: u8 = 0x1;
pub(super) const ACK: u8 = 0x1;
pub(super) const END_HEADERS: u8 = 0x4;
pub(super) const PADDED: u8 = 0x8;
pub(super) const PRIORITY_FLAG: u8 = 0x20;

pub(super) const NO_ERROR: u32 = 0x0;
pub(super) const PROTOCOL_ERROR: u32 = 0x1;
pub(super) const FLOW_CONTROL_ERROR: u32 = 0x3;
pub(super) const STREAM_CLOSED: u32 = 0x5;
pub(super) const FRAME_SIZE_ERROR: u32 = 0x6;
pub(super) const CANCEL: u32 = 0x8;
pub(super) const COMPRESSION_ERROR: u32 = 0x9;
pub(super) const ENHANCE_YOUR_CALM: u32 = 0xb;

/// SETTINGS identifiers (RFC 9113 §6.5.2, RFC 8441 §3).
pub(super) const SETTINGS_HEADER_TABLE_SIZE: u16 = 0x1;
pub(super) const SETTINGS_ENABLE_PUSH: u16 = 0x2;
pub(super) const SETTINGS_MAX_CONCURRENT_STREAMS: u16 = 0x3;
pub(super) const SETTINGS_INITIAL_WINDOW_SIZE: u16 = 0x4;
pub(super) const SETTINGS_MAX_FRAME_SIZE: u16 = 0x5;
pub(super) const SETTINGS_MAX_HEADER_LIST_SIZE: u16 = 0x6;
pub(super) const SETTINGS_ENABLE_CONNECT_PROTOCOL: u16 = 0x8;

/// RFC 9113 §6.9.1: the largest flow-control window.
pub(super) const MAX_WINDOW: i64 = (1 << 31) - 1;
/// The window every stream and the connection start with (RFC 9113 §6.9.2).
pub(super) const DEFAULT_WINDOW: i64 = 65_535;
/// The HPACK table size we advertise (h2's default, given to hyper's builder).
pub(super) const HEADER_TABLE_SIZE: u32 = 4096;
/// The guard's frames that may wait for hyper's output before the client is no
/// longer read.
pub(super) const MAX_INJECT: usize = 16 * 1024;
/// Streams the server reset while the client could still send on them: frames
/// on these are ignored (RFC 9113 §5.1, closed), on other closed streams they are
/// STREAM_CLOSED. Bounded: the oldest are forgotten.
pub(super) const RECENT_RESETS: usize = 256;
/// CONTINUATION frames one header block may have.
pub(super) const MAX_CONTINUATIONS: u32 = 64;
/// The most one read from the connection takes (what hyper asks for, capped).
pub(super) const MAX_READ: usize = 64 * 1024;
/// How the rapid-reset budget is counted.
pub(super) const RESET_WINDOW: Duration = Duration::from_secs(1);

/// Reading the server's output frame by frame: where the next boundary is, and
/// the few frames whose content the guard needs (END_STREAM, RST_STREAM,
/// WINDOW_UPDATE).
#[derive(Debug, Default)]
pub(super) struct Output {
    pub(super) header: [u8; HEADER_LEN],
    pub(super) header_len: usize,
    /// Payload bytes left in the current frame.
    pub(super) remaining: usize,
    /// The start of a WINDOW_UPDATE's payload (its increment).
    pub(super) small: Vec<u8>,
}

/// What a finished output frame header says.
#[derive(Debug, Clone, Copy)]
pub(super) struct OutFrame {
    pub(super) kind: u8,
    pub(super) flags: u8,
    pub(super) stream: u32,
    pub(super) len: usize,
}

impl Output {
    pub(super) fn at_boundary(&self) -> bool {
        self.header_len == 0 && self.remaining == 0
    }

    /// Follows `bytes` of output; calls `done` for each frame that ends in them
    /// with its header and (for WINDOW_UPDATE) payload.
    pub(super) fn track(&mut self, mut bytes: &[u8], mut done: impl FnMut(OutFrame, &[u8])) {
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

pub(super) fn parse_header(h: &[u8; HEADER_LEN]) -> OutFrame {
    OutFrame {
        len: usize::from(h[0]) << 16 | usize::from(h[1]) << 8 | usize::from(h[2]),
        kind: h[3],
        flags: h[4],
        stream: u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff,
    }
}

/// The connection error a SETTINGS payload's values call for (RFC 9113 §6.5.2), if
/// any; its length must be a multiple of 6. Unknown identifiers are ignored.
pub(super) fn settings_error(payload: &[u8]) -> Option<u32> {
    payload.chunks_exact(6).find_map(|setting| {
        let id = u16::from_be_bytes([setting[0], setting[1]]);
        let value = u32::from_be_bytes([setting[2], setting[3], setting[4], setting[5]]);
        match id {
            SETTINGS_ENABLE_PUSH => (value > 1).then_some(PROTOCOL_ERROR),
            SETTINGS_INITIAL_WINDOW_SIZE => (i64::from(value) > MAX_WINDOW).then_some(FLOW_CONTROL_ERROR),
            SETTINGS_MAX_FRAME_SIZE => (!(16_384..=16_777_215).contains(&value)).then_some(PROTOCOL_ERROR),
            // RFC 8441 §3: 0 or 1.
            SETTINGS_ENABLE_CONNECT_PROTOCOL => (value > 1).then_some(PROTOCOL_ERROR),
            _ => None,
        }
    })
}

/// A WINDOW_UPDATE's increment (its reserved bit cleared), if its payload is the
/// 4 bytes it must be.
pub(super) fn window_increment(payload: &[u8]) -> Option<u32> {
    let bytes: [u8; 4] = payload.try_into().ok()?;
    Some(u32::from_be_bytes(bytes) & 0x7fff_ffff)
}

/// Appends a frame to `out` (nothing allocated beyond `out`'s own growth).
pub(super) fn put_frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
    let len = u32::try_from(payload.len()).unwrap_or(0).to_be_bytes();
    out.extend_from_slice(&len[1..]);
    out.extend_from_slice(&[kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
}

#[cfg(test)]
pub(super) fn frame_bytes(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    put_frame(&mut out, kind, flags, stream, payload);
    out
}

/// A HEADERS payload without its padding and priority fields; `None` if the
/// padding is longer than the payload (RFC 9113 §6.2: PROTOCOL_ERROR).
pub(super) fn header_fragment(f: OutFrame, payload: &[u8]) -> Option<&[u8]> {
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

/// How many of `buf`'s bytes finish the output frame in progress (all of them if
/// it does not end in `buf`).
pub(super) fn frame_end(output: &Output, buf: &[u8]) -> usize {
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
