//! The request-head rules of RFC 9114 that h3 0.0.8 does not check: no
//! connection-specific field (§4.2) and no pseudo-field after a regular one (§4.3).
//! h3 decodes the field section into an `http::HeaderMap` with the pseudo-fields
//! apart, so their order is gone by then; it is read here from the QPACK-encoded
//! section of the request's HEADERS frame, which the driver holds before h3 decodes
//! it. Only names are looked at: no Huffman decoding, no I/O, no allocation.

use http::HeaderMap;

/// Why a request head is malformed (a stream error H3_MESSAGE_ERROR).
pub(crate) fn malformed(section: &[u8], headers: &HeaderMap) -> Option<&'static str> {
    if let Some(why) = connection_specific(headers) {
        return Some(why);
    }
    // A section this scan cannot read (a dynamic-table reference, which h3 itself
    // refuses: it advertises no dynamic table) is left to h3's verdict.
    matches!(pseudo_after_regular(section), Ok(true)).then_some("pseudo-field after a regular field")
}

/// RFC 9114 §4.2: these fields are HTTP/1.1's connection management; `te` may only
/// say "trailers".
fn connection_specific(headers: &HeaderMap) -> Option<&'static str> {
    const FIELDS: [&str; 5] = [
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "upgrade",
    ];
    if FIELDS.iter().any(|name| headers.contains_key(*name)) {
        return Some("connection-specific field");
    }
    let te_trailers = |v: &http::HeaderValue| v.as_bytes().eq_ignore_ascii_case(b"trailers");
    if !headers.get_all(http::header::TE).iter().all(te_trailers) {
        return Some("te other than \"trailers\"");
    }
    None
}

/// The section could not be read (truncated, or it names a dynamic-table entry).
#[derive(Debug, PartialEq, Eq)]
struct Unreadable;

/// Whether a field line naming a pseudo-field follows one naming a regular field
/// (RFC 9204 §4.5: the section's prefix, then its field lines).
fn pseudo_after_regular(section: &[u8]) -> Result<bool, Unreadable> {
    let mut rest = section;
    let required_insert_count = int(&mut rest, 8)?;
    let _delta_base = int(&mut rest, 7)?;
    if required_insert_count != 0 {
        return Err(Unreadable);
    }
    let mut regular_seen = false;
    while let Some(&first) = rest.first() {
        let pseudo = if first & 0x80 != 0 {
            // Indexed field line: 1 T index(6); T=1 is the static table.
            if first & 0x40 == 0 {
                return Err(Unreadable);
            }
            static_pseudo(int(&mut rest, 6)?)
        } else if first & 0x40 != 0 {
            // Literal with name reference: 01 N T index(4), then the value.
            if first & 0x10 == 0 {
                return Err(Unreadable);
            }
            let pseudo = static_pseudo(int(&mut rest, 4)?);
            string(&mut rest, 7)?;
            pseudo
        } else if first & 0x20 != 0 {
            // Literal with literal name: 001 N H length(3), the name, then the value.
            let huffman = first & 0x08 != 0;
            let name = string(&mut rest, 3)?;
            let pseudo = match name.first() {
                // ':' is the 7-bit Huffman code 1011100 (RFC 7541 Appendix B); the
                // code is prefix-free, so a name starts with ':' exactly when its
                // first 7 bits are that code.
                Some(&b) if huffman => b & 0xfe == 0xb8,
                Some(&b) => b == b':',
                None => false,
            };
            string(&mut rest, 7)?;
            pseudo
        } else {
            // Post-base forms (0001…, 0000…) name dynamic-table entries.
            return Err(Unreadable);
        };
        if pseudo && regular_seen {
            return Ok(true);
        }
        regular_seen |= !pseudo;
    }
    Ok(false)
}

/// Whether the QPACK static table's entry `index` (RFC 9204 Appendix A) names a
/// pseudo-field: :authority, :path, :method, :scheme, :status.
fn static_pseudo(index: u64) -> bool {
    matches!(index, 0 | 1 | 15..=28 | 63..=71)
}

/// A prefixed integer (RFC 7541 §5.1) whose first byte keeps its low `bits`.
fn int(rest: &mut &[u8], bits: u32) -> Result<u64, Unreadable> {
    let (&first, mut tail) = rest.split_first().ok_or(Unreadable)?;
    let mask = (1u64 << bits) - 1;
    let mut value = u64::from(first) & mask;
    if value == mask {
        let mut shift = 0u32;
        loop {
            let (&byte, after) = tail.split_first().ok_or(Unreadable)?;
            tail = after;
            // 62 bits are more than any QUIC length; past that the input is junk.
            if shift > 56 {
                return Err(Unreadable);
            }
            value += u64::from(byte & 0x7f) << shift;
            shift += 7;
            if byte & 0x80 == 0 {
                break;
            }
        }
    }
    *rest = tail;
    Ok(value)
}

/// A string literal whose length is a prefixed integer of `bits` bits (the H flag
/// sits just above them); returns its bytes as sent (Huffman-coded or not).
fn string<'a>(rest: &mut &'a [u8], bits: u32) -> Result<&'a [u8], Unreadable> {
    let len = usize::try_from(int(rest, bits)?).map_err(|_| Unreadable)?;
    if rest.len() < len {
        return Err(Unreadable);
    }
    let (bytes, tail) = rest.split_at(len);
    *rest = tail;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A section as clients send it: static references for the pseudo-fields, then a
    /// literal name.
    fn section(lines: &[&[u8]]) -> Vec<u8> {
        let mut out = vec![0, 0];
        for line in lines {
            out.extend_from_slice(line);
        }
        out
    }

    /// Indexed static `:method GET` (17), `:scheme https` (23), `:path /` (1).
    const METHOD_GET: &[u8] = &[0xc0 | 17];
    const SCHEME_HTTPS: &[u8] = &[0xc0 | 23];
    const PATH_ROOT: &[u8] = &[0xc1];
    /// Literal with static name `:authority` (0), value "a".
    const AUTHORITY_A: &[u8] = &[0x50, 1, b'a'];
    /// Literal with static name `user-agent` (95, past the 4-bit prefix), value "x".
    const USER_AGENT: &[u8] = &[0x5f, 95 - 15, 1, b'x'];
    /// Literal name "x-a" (plain), value "b".
    const X_A: &[u8] = &[0x23, b'x', b'-', b'a', 1, b'b'];
    /// Literal name ":path" Huffman-coded (as nghttp3 sends it: b9 58 d3 3f), value "/".
    const PATH_HUFFMAN: &[u8] = &[0x2c, 0xb9, 0x58, 0xd3, 0x3f, 1, b'/'];
    /// Literal name ":path" plain, value "/".
    const PATH_PLAIN: &[u8] = &[0x25, b':', b'p', b'a', b't', b'h', 1, b'/'];

    #[test]
    fn pseudo_fields_first_pass() {
        let ok = section(&[METHOD_GET, SCHEME_HTTPS, AUTHORITY_A, PATH_ROOT, USER_AGENT, X_A]);
        assert_eq!(pseudo_after_regular(&ok), Ok(false));
        let literal = section(&[METHOD_GET, PATH_HUFFMAN, PATH_PLAIN, X_A]);
        assert_eq!(pseudo_after_regular(&literal), Ok(false));
        assert_eq!(pseudo_after_regular(&[0, 0]), Ok(false));
    }

    #[test]
    fn a_pseudo_field_after_a_regular_one_is_found_in_every_form() {
        for late in [PATH_ROOT, AUTHORITY_A, PATH_HUFFMAN, PATH_PLAIN] {
            for regular in [USER_AGENT, X_A] {
                let bad = section(&[METHOD_GET, regular, late]);
                assert_eq!(pseudo_after_regular(&bad), Ok(true), "{regular:?} then {late:?}");
            }
        }
    }

    #[test]
    fn truncated_or_dynamic_sections_are_unreadable() {
        let ok = section(&[METHOD_GET, AUTHORITY_A, USER_AGENT, X_A]);
        for cut in 0..ok.len() {
            // Every prefix either parses (cut on a line boundary) or is unreadable;
            // none panics.
            let _ = pseudo_after_regular(&ok[..cut]);
        }
        assert_eq!(pseudo_after_regular(&ok[..ok.len() - 1]), Err(Unreadable));
        // Required Insert Count 1; a dynamic indexed line (T=0); a post-base line.
        assert_eq!(pseudo_after_regular(&[1, 0, 0x80]), Err(Unreadable));
        assert_eq!(pseudo_after_regular(&[0, 0, 0x80]), Err(Unreadable));
        assert_eq!(pseudo_after_regular(&[0, 0, 0x10]), Err(Unreadable));
        // An integer that never ends, or one past 62 bits.
        assert_eq!(pseudo_after_regular(&[0, 0, 0xff, 0xff, 0xff]), Err(Unreadable));
        assert_eq!(
            pseudo_after_regular(&[0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]),
            Err(Unreadable)
        );
    }

    #[test]
    fn connection_specific_fields_are_malformed() {
        let mut headers = HeaderMap::new();
        assert_eq!(malformed(&[0, 0], &headers), None);
        headers.insert("te", "trailers".parse().unwrap());
        assert_eq!(malformed(&[0, 0], &headers), None);
        headers.append("te", "gzip".parse().unwrap());
        assert!(malformed(&[0, 0], &headers).is_some());
        for name in [
            "connection",
            "keep-alive",
            "proxy-connection",
            "transfer-encoding",
            "upgrade",
        ] {
            let mut headers = HeaderMap::new();
            headers.insert(name, "x".parse().unwrap());
            assert!(malformed(&[0, 0], &headers).is_some(), "{name}");
        }
    }
}
