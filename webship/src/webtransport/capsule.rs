//! QUIC variable-length integers and HTTP capsules (RFC 9297), with the WebTransport
//! capsule types: no I/O, so both the HTTP/3 session control stream and the HTTP/2
//! session (where streams and datagrams travel as capsules too) parse the same way.

use bytes::{BufMut, Bytes, BytesMut};

/// RFC 9297 DATAGRAM capsule (HTTP/2 carries datagrams this way).
pub const DATAGRAM: u64 = 0x00;
/// draft-ietf-webtrans-http3 §5: ends the session, carrying a code and a reason.
pub const CLOSE_SESSION: u64 = 0x2843;
/// Asks the peer to wind the session down (newer drafts; older peers ignore it).
pub const DRAIN_SESSION: u64 = 0x78ae;
/// draft-ietf-webtrans-http2 stream capsules.
pub const WT_RESET_STREAM: u64 = 0x190b_4d39;
pub const WT_STOP_SENDING: u64 = 0x190b_4d3a;
pub const WT_STREAM: u64 = 0x190b_4d3b;
pub const WT_STREAM_FIN: u64 = 0x190b_4d3c;
pub const WT_MAX_DATA: u64 = 0x190b_4d3d;
pub const WT_MAX_STREAM_DATA: u64 = 0x190b_4d3e;
pub const WT_MAX_STREAMS_BIDI: u64 = 0x190b_4d3f;
pub const WT_MAX_STREAMS_UNI: u64 = 0x190b_4d40;

/// The longest reason a CLOSE_WEBTRANSPORT_SESSION may carry.
pub const MAX_REASON: usize = 1024;

/// The largest value a QUIC varint holds.
pub const VARINT_MAX: u64 = (1 << 62) - 1;

/// Decodes a varint from the front of `buf`: `(value, length)`, or `None` when
/// `buf` does not hold all of it yet.
pub fn read_varint(buf: &[u8]) -> Option<(u64, usize)> {
    let first = *buf.first()?;
    let len = 1usize << (first >> 6);
    if buf.len() < len {
        return None;
    }
    let mut value = u64::from(first & 0x3f);
    for b in &buf[1..len] {
        value = (value << 8) | u64::from(*b);
    }
    Some((value, len))
}

/// Appends `value` (at most [`VARINT_MAX`]) in its shortest encoding.
pub fn put_varint(out: &mut impl BufMut, value: u64) {
    debug_assert!(value <= VARINT_MAX);
    if value < 1 << 6 {
        out.put_u8(value as u8);
    } else if value < 1 << 14 {
        out.put_u16(0x4000 | value as u16);
    } else if value < 1 << 30 {
        out.put_u32(0x8000_0000 | value as u32);
    } else {
        out.put_u64(0xc000_0000_0000_0000 | value);
    }
}

pub fn varint_len(value: u64) -> usize {
    match value {
        0..=0x3f => 1,
        0x40..=0x3fff => 2,
        0x4000..=0x3fff_ffff => 4,
        _ => 8,
    }
}

/// One capsule's header: type and payload length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: u64,
    pub len: u64,
    /// Bytes the header itself took.
    pub header_len: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CapsuleError {
    #[error("a {len}-byte capsule (type {kind:#x}) is over the {max}-byte limit")]
    TooLarge { kind: u64, len: u64, max: usize },
    #[error("malformed {0} capsule")]
    Malformed(&'static str),
}

/// Reads a capsule header from the front of `buf`; `Ok(None)` until enough bytes
/// arrived. A payload longer than `max` is refused before any of it is buffered.
pub fn read_header(buf: &[u8], max: usize) -> Result<Option<Header>, CapsuleError> {
    let Some((kind, a)) = read_varint(buf) else {
        return Ok(None);
    };
    let Some((len, b)) = read_varint(&buf[a..]) else {
        return Ok(None);
    };
    if len > max as u64 {
        return Err(CapsuleError::TooLarge { kind, len, max });
    }
    Ok(Some(Header {
        kind,
        len,
        header_len: a + b,
    }))
}

/// Splits complete capsules off the front of a receive buffer.
///
/// The buffer never holds more than one capsule of at most `max` bytes plus its
/// header, so a session's capsule memory is bounded by the limit.
#[derive(Debug)]
pub struct Reader {
    buf: BytesMut,
    max: usize,
}

impl Reader {
    pub fn new(max: usize) -> Self {
        Self {
            buf: BytesMut::new(),
            max,
        }
    }

    /// Bytes the reader can take before it must be drained by [`Reader::next_capsule`].
    pub fn room(&self) -> usize {
        (self.max + 16).saturating_sub(self.buf.len())
    }

    pub fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// The next complete capsule: `(type, payload)`.
    pub fn next_capsule(&mut self) -> Result<Option<(u64, Bytes)>, CapsuleError> {
        let Some(h) = read_header(&self.buf, self.max)? else {
            return Ok(None);
        };
        let total = h.header_len + h.len as usize;
        if self.buf.len() < total {
            return Ok(None);
        }
        let mut capsule = self.buf.split_to(total);
        let payload = capsule.split_off(h.header_len).freeze();
        Ok(Some((h.kind, payload)))
    }

    /// Whether a partial capsule is buffered (a stream that ends here was cut).
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}

/// Appends a capsule header for a payload of `len` bytes.
pub fn put_header(out: &mut impl BufMut, kind: u64, len: usize) {
    put_varint(out, kind);
    put_varint(out, len as u64);
}

/// A whole capsule in one buffer.
pub fn encode(kind: u64, payload: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(16 + payload.len());
    put_header(&mut out, kind, payload.len());
    out.extend_from_slice(payload);
    out.freeze()
}

/// CLOSE_WEBTRANSPORT_SESSION: a 32-bit code and a UTF-8 reason (cut to
/// [`MAX_REASON`] bytes on a character boundary).
pub fn close_session(code: u32, reason: &str) -> Bytes {
    let mut end = reason.len().min(MAX_REASON);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let mut payload = Vec::with_capacity(4 + end);
    payload.extend_from_slice(&code.to_be_bytes());
    payload.extend_from_slice(&reason.as_bytes()[..end]);
    encode(CLOSE_SESSION, &payload)
}

/// Reads a CLOSE_WEBTRANSPORT_SESSION payload: `(code, reason)`.
pub fn parse_close(payload: &[u8]) -> Result<(u32, String), CapsuleError> {
    if payload.len() < 4 || payload.len() > 4 + MAX_REASON {
        return Err(CapsuleError::Malformed("CLOSE_WEBTRANSPORT_SESSION"));
    }
    let code = u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]);
    let reason = std::str::from_utf8(&payload[4..])
        .map_err(|_| CapsuleError::Malformed("CLOSE_WEBTRANSPORT_SESSION"))?;
    Ok((code, reason.to_owned()))
}

/// A stream capsule of WebTransport over HTTP/2: stream id, then data.
pub fn parse_stream(payload: &Bytes) -> Result<(u64, Bytes), CapsuleError> {
    let (id, n) = read_varint(payload).ok_or(CapsuleError::Malformed("WT_STREAM"))?;
    Ok((id, payload.slice(n..)))
}

/// WT_RESET_STREAM / WT_STOP_SENDING: stream id, then an error code.
pub fn parse_stream_code(payload: &[u8]) -> Result<(u64, u64), CapsuleError> {
    let (id, n) = read_varint(payload).ok_or(CapsuleError::Malformed("WT_RESET_STREAM"))?;
    let (code, m) = read_varint(&payload[n..]).ok_or(CapsuleError::Malformed("WT_RESET_STREAM"))?;
    if n + m != payload.len() {
        return Err(CapsuleError::Malformed("WT_RESET_STREAM"));
    }
    Ok((id, code))
}

/// A capsule whose payload is varints.
pub fn varints(kind: u64, values: &[u64]) -> Bytes {
    let mut payload = BytesMut::new();
    for v in values {
        put_varint(&mut payload, *v);
    }
    encode(kind, &payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_round_trip_at_every_width() {
        for v in [
            0,
            37,
            63,
            64,
            15_293,
            16_383,
            16_384,
            494_878_333,
            (1 << 30) - 1,
            1 << 30,
            VARINT_MAX,
        ] {
            let mut out = Vec::new();
            put_varint(&mut out, v);
            assert_eq!(out.len(), varint_len(v));
            assert_eq!(read_varint(&out), Some((v, out.len())));
            assert_eq!(read_varint(&out[..out.len() - 1]), None);
        }
        // RFC 9000 appendix A examples.
        assert_eq!(
            read_varint(&[0xc2, 0x19, 0x7c, 0x5e, 0xff, 0x14, 0xe8, 0x8c]),
            Some((151_288_809_941_952_652, 8))
        );
        assert_eq!(read_varint(&[0x9d, 0x7f, 0x3e, 0x7d]), Some((494_878_333, 4)));
        assert_eq!(read_varint(&[0x7b, 0xbd]), Some((15_293, 2)));
        assert_eq!(read_varint(&[0x25]), Some((37, 1)));
    }

    #[test]
    fn reader_splits_capsules_across_pushes() {
        let mut wire = Vec::new();
        wire.extend_from_slice(&close_session(7, "bye"));
        wire.extend_from_slice(&encode(DATAGRAM, b"hello"));
        let mut r = Reader::new(1024);
        for b in &wire {
            assert!(r.room() > 0);
            r.push(std::slice::from_ref(b));
        }
        let (kind, payload) = r.next_capsule().unwrap().unwrap();
        assert_eq!(kind, CLOSE_SESSION);
        assert_eq!(parse_close(&payload).unwrap(), (7, "bye".into()));
        assert_eq!(
            r.next_capsule().unwrap(),
            Some((DATAGRAM, Bytes::from_static(b"hello")))
        );
        assert_eq!(r.next_capsule().unwrap(), None);
        assert!(r.is_empty());
    }

    #[test]
    fn oversized_capsules_are_refused_from_the_header() {
        let mut r = Reader::new(1024);
        let mut header = Vec::new();
        put_header(&mut header, WT_STREAM, 1 << 20);
        r.push(&header);
        assert_eq!(
            r.next_capsule(),
            Err(CapsuleError::TooLarge {
                kind: WT_STREAM,
                len: 1 << 20,
                max: 1024
            })
        );
    }

    #[test]
    fn close_reason_is_cut_on_a_char_boundary() {
        let long = "é".repeat(600);
        let capsule = close_session(1, &long);
        let mut r = Reader::new(4096);
        r.push(&capsule);
        let (_, payload) = r.next_capsule().unwrap().unwrap();
        let (code, reason) = parse_close(&payload).unwrap();
        assert_eq!(code, 1);
        assert_eq!(reason.len(), MAX_REASON);
        assert!(parse_close(&[0, 0]).is_err());
        assert!(parse_close(&[0, 0, 0, 1, 0xff]).is_err());
    }

    #[test]
    fn stream_capsules_parse() {
        let mut payload = BytesMut::new();
        put_varint(&mut payload, 4);
        payload.extend_from_slice(b"data");
        assert_eq!(
            parse_stream(&payload.freeze()).unwrap(),
            (4, Bytes::from_static(b"data"))
        );
        let reset = varints(WT_RESET_STREAM, &[8, 300]);
        let mut r = Reader::new(64);
        r.push(&reset);
        let (kind, p) = r.next_capsule().unwrap().unwrap();
        assert_eq!(kind, WT_RESET_STREAM);
        assert_eq!(parse_stream_code(&p).unwrap(), (8, 300));
        assert!(parse_stream_code(&p[..1]).is_err());
    }
}
