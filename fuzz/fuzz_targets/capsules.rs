//! The WebTransport capsule reader (the HTTP/3 CONNECT stream, all of an HTTP/2
//! session) and the payload parsers on arbitrary bytes: no panic, no capsule over
//! the limit, and the same capsules however the bytes are split.

#![no_main]

use libfuzzer_sys::fuzz_target;
use webship::webtransport::capsule::{self, Reader};
use webship::webtransport::diag::parse_command;

const MAX: usize = 1024;

fn read_all(chunks: &[&[u8]]) -> (Vec<(u64, Vec<u8>)>, bool) {
    let mut r = Reader::new(MAX);
    let mut out = Vec::new();
    for chunk in chunks {
        r.push(chunk);
        loop {
            match r.next_capsule() {
                Ok(Some((kind, payload))) => {
                    assert!(payload.len() <= MAX);
                    out.push((kind, payload.to_vec()));
                }
                Ok(None) => break,
                Err(_) => return (out, true),
            }
        }
    }
    (out, false)
}

fuzz_target!(|data: &[u8]| {
    let whole = read_all(&[data]);
    if data.len() > 1 {
        let (a, b) = data.split_at(data.len() / 3);
        assert_eq!(read_all(&[a, b]), whole);
    }
    for (kind, payload) in &whole.0 {
        let bytes = bytes::Bytes::copy_from_slice(payload);
        match *kind {
            capsule::CLOSE_SESSION => {
                if let Ok((code, reason)) = capsule::parse_close(payload) {
                    // What parses re-encodes to the same payload.
                    let again = capsule::close_session(code, &reason);
                    assert!(again.ends_with(payload));
                }
            }
            capsule::WT_STREAM | capsule::WT_STREAM_FIN => {
                let _ = capsule::parse_stream(&bytes);
            }
            _ => {
                let _ = capsule::parse_stream_code(payload);
            }
        }
    }
    let _ = parse_command(data);
});
