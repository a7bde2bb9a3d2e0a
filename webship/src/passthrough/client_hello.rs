//! TLS ClientHello parsing for passthrough routing: finds the SNI host name without
//! decrypting anything and without doing I/O. Callers feed the bytes peeked from the
//! socket so far; the parser says whether it needs more, found the name, or gave up.
//!
//! The hello may arrive split across TCP segments and across TLS records (a record
//! carries at most 16 KiB, and clients may fragment the handshake further), so the
//! handshake message is reassembled from consecutive handshake records first. Inputs
//! are bounded by [`MAX_HELLO`]: a bigger hello is refused, not buffered.

/// The largest ClientHello accepted (post-quantum key shares make hellos grow, but
/// nothing legitimate comes near this).
pub const MAX_HELLO: usize = 64 * 1024;

const RECORD_HEADER: usize = 5;
const CONTENT_HANDSHAKE: u8 = 22;
const HANDSHAKE_CLIENT_HELLO: u8 = 1;
const EXT_SERVER_NAME: u16 = 0;
const NAME_TYPE_HOST: u8 = 0;

/// What the bytes so far say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hello {
    /// Not enough bytes yet; read more (up to [`MAX_HELLO`]).
    Incomplete,
    /// A complete ClientHello; the SNI host name if it carried one (lowercase).
    Complete { sni: Option<String> },
}

/// Why the bytes are not a ClientHello webship will route.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HelloError {
    #[error("not a TLS handshake record")]
    NotTls,
    #[error("the first handshake message is not a ClientHello")]
    NotClientHello,
    #[error("the ClientHello is larger than {MAX_HELLO} bytes")]
    TooLarge,
    #[error("the ClientHello is malformed")]
    Malformed,
    #[error("the server_name extension is malformed")]
    BadServerName,
}

/// Parses the ClientHello at the start of `buf` (the raw bytes from the socket).
pub fn parse(buf: &[u8]) -> Result<Hello, HelloError> {
    // Reassemble the handshake message body from consecutive handshake records.
    let mut message = Vec::new();
    let mut at = 0;
    let mut needed: Option<usize> = None;
    loop {
        if let Some(total) = needed {
            if message.len() >= total {
                break;
            }
        }
        let Some(header) = buf.get(at..at + RECORD_HEADER) else {
            return if at > MAX_HELLO + RECORD_HEADER * 8 {
                Err(HelloError::TooLarge)
            } else {
                Ok(Hello::Incomplete)
            };
        };
        if header[0] != CONTENT_HANDSHAKE || header[1] != 3 {
            return Err(HelloError::NotTls);
        }
        let len = usize::from(u16::from_be_bytes([header[3], header[4]]));
        if len == 0 || len > 16 * 1024 + 256 {
            return Err(HelloError::Malformed);
        }
        let body_start = at + RECORD_HEADER;
        let available = &buf[body_start.min(buf.len())..buf.len().min(body_start + len)];
        message.extend_from_slice(available);
        if needed.is_none() && message.len() >= 4 {
            if message[0] != HANDSHAKE_CLIENT_HELLO {
                return Err(HelloError::NotClientHello);
            }
            let body =
                (usize::from(message[1]) << 16) | (usize::from(message[2]) << 8) | usize::from(message[3]);
            if body > MAX_HELLO {
                return Err(HelloError::TooLarge);
            }
            needed = Some(4 + body);
        }
        if available.len() < len {
            return Ok(Hello::Incomplete);
        }
        at = body_start + len;
        if message.len() > MAX_HELLO + 4 {
            return Err(HelloError::TooLarge);
        }
    }
    let total = needed.unwrap_or(0);
    let sni = server_name(&message[4..total])?;
    Ok(Hello::Complete { sni })
}

/// A bounds-checked reader over a byte slice.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], HelloError> {
        if self.0.len() < n {
            return Err(HelloError::Malformed);
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, HelloError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, HelloError> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn vec8(&mut self) -> Result<&'a [u8], HelloError> {
        let n = usize::from(self.u8()?);
        self.take(n)
    }

    fn vec16(&mut self) -> Result<&'a [u8], HelloError> {
        let n = usize::from(self.u16()?);
        self.take(n)
    }
}

/// Walks a ClientHello body (RFC 8446 §4.1.2) to the server_name extension.
fn server_name(body: &[u8]) -> Result<Option<String>, HelloError> {
    let mut r = Reader(body);
    r.take(2)?; // legacy_version
    r.take(32)?; // random
    r.vec8()?; // legacy_session_id
    r.vec16()?; // cipher_suites
    r.vec8()?; // legacy_compression_methods
    if r.0.is_empty() {
        return Ok(None); // no extensions at all (SSLv3-era hello)
    }
    let mut extensions = Reader(r.vec16()?);
    while !extensions.0.is_empty() {
        let kind = extensions.u16()?;
        let data = extensions.vec16()?;
        if kind != EXT_SERVER_NAME {
            continue;
        }
        let mut list = Reader(Reader(data).vec16().map_err(|_| HelloError::BadServerName)?);
        while !list.0.is_empty() {
            let name_type = list.u8().map_err(|_| HelloError::BadServerName)?;
            let name = list.vec16().map_err(|_| HelloError::BadServerName)?;
            if name_type == NAME_TYPE_HOST {
                let name = std::str::from_utf8(name).map_err(|_| HelloError::BadServerName)?;
                // One trailing dot (the root) is allowed; the rest must be a name.
                let trimmed = name.strip_suffix('.').unwrap_or(name);
                let valid = !trimmed.is_empty()
                    && trimmed.len() <= 253
                    && trimmed.split('.').all(|label| !label.is_empty())
                    && trimmed
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
                if !valid {
                    return Err(HelloError::BadServerName);
                }
                return Ok(Some(trimmed.to_ascii_lowercase()));
            }
        }
        return Ok(None);
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// A real ClientHello from rustls for `name` (an IP address means no SNI).
    fn rustls_hello(name: &str) -> Vec<u8> {
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(crate::tls::provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        let server = rustls::pki_types::ServerName::try_from(name.to_owned()).unwrap();
        let mut conn = rustls::ClientConnection::new(Arc::new(config), server).unwrap();
        let mut out = Vec::new();
        while conn.wants_write() {
            conn.write_tls(&mut out).unwrap();
        }
        out
    }

    /// Re-frames a single-record hello into records of at most `chunk` body bytes.
    fn fragment(hello: &[u8], chunk: usize) -> Vec<u8> {
        let body = &hello[RECORD_HEADER..];
        let mut out = Vec::new();
        for part in body.chunks(chunk) {
            out.extend_from_slice(&[CONTENT_HANDSHAKE, 3, 1]);
            out.extend_from_slice(&(part.len() as u16).to_be_bytes());
            out.extend_from_slice(part);
        }
        out
    }

    #[test]
    fn finds_the_sni_of_a_real_hello() {
        let hello = rustls_hello("Media.Example.COM");
        assert_eq!(
            parse(&hello),
            Ok(Hello::Complete {
                sni: Some("media.example.com".into())
            })
        );
        assert_eq!(
            parse(&rustls_hello("127.0.0.1")),
            Ok(Hello::Complete { sni: None })
        );
    }

    /// Hellos captured on loopback from the clients themselves (testdata/).
    const CURL_HELLO: &[u8] = include_bytes!("testdata/curl-7.88-hello.bin");
    const OPENSSL_HELLO: &[u8] = include_bytes!("testdata/openssl-3.0-hello.bin");

    #[test]
    fn finds_the_sni_of_captured_curl_and_openssl_hellos() {
        // curl 7.88 (OpenSSL 3, TLS 1.3, ALPN h2) for https://media.example.com/.
        assert_eq!(
            parse(CURL_HELLO),
            Ok(Hello::Complete {
                sni: Some("media.example.com".into())
            })
        );
        // `openssl s_client -servername files.example.org`.
        assert_eq!(
            parse(OPENSSL_HELLO),
            Ok(Hello::Complete {
                sni: Some("files.example.org".into())
            })
        );
        for hello in [CURL_HELLO, OPENSSL_HELLO] {
            for n in 0..hello.len() {
                assert_eq!(parse(&hello[..n]), Ok(Hello::Incomplete), "prefix {n}");
            }
            assert!(matches!(
                parse(&fragment(hello, 3)),
                Ok(Hello::Complete { sni: Some(_) })
            ));
        }
    }

    #[test]
    fn every_prefix_is_incomplete_never_wrong() {
        let hello = rustls_hello("a.example");
        for n in 0..hello.len() {
            assert_eq!(parse(&hello[..n]), Ok(Hello::Incomplete), "prefix {n}");
        }
    }

    #[test]
    fn reassembles_across_records() {
        let hello = rustls_hello("split.example");
        for chunk in [1, 7, 100] {
            let fragmented = fragment(&hello, chunk);
            assert_eq!(
                parse(&fragmented),
                Ok(Hello::Complete {
                    sni: Some("split.example".into())
                }),
                "records of {chunk} bytes"
            );
            assert_eq!(parse(&fragmented[..fragmented.len() - 1]), Ok(Hello::Incomplete));
        }
    }

    #[test]
    fn refuses_what_is_not_a_hello() {
        assert_eq!(parse(b"GET / HTTP/1.1\r\n\r\n"), Err(HelloError::NotTls));
        assert_eq!(
            parse(&[22, 3, 1, 0, 4, 2, 0, 0, 0]),
            Err(HelloError::NotClientHello)
        );
        assert_eq!(parse(&[22, 3, 1, 0, 0]), Err(HelloError::Malformed));
        // A hello announcing more than MAX_HELLO bytes.
        assert_eq!(
            parse(&[22, 3, 1, 0, 4, 1, 0xff, 0xff, 0xff]),
            Err(HelloError::TooLarge)
        );
        // A truncated body inside a complete message: lengths that do not add up.
        let mut bad = rustls_hello("x.example");
        let sid = RECORD_HEADER + 4 + 2 + 32;
        bad[sid] = 0xff; // session id length beyond the message
        assert_eq!(parse(&bad), Err(HelloError::Malformed));
    }

    #[test]
    fn server_names_are_whole_dns_names() {
        let hello = rustls_hello("abcd.ex");
        let at = hello
            .windows(7)
            .position(|w| w == b"abcd.ex")
            .expect("the name is in the hello");
        let with = |name: &[u8; 7]| {
            let mut h = hello.clone();
            h[at..at + 7].copy_from_slice(name);
            parse(&h)
        };
        let named = |n: &str| Ok(Hello::Complete { sni: Some(n.into()) });
        assert_eq!(with(b"abcd.e."), named("abcd.e"), "the root dot is dropped");
        for bad in [
            b".......",
            b"a..b.ex",
            b".abc.ex",
            b"ab.ex..",
            b"ab_c.ex",
            b"ab\0c.ex",
        ] {
            assert_eq!(
                with(bad),
                Err(HelloError::BadServerName),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        // A cheap deterministic fuzz: mutate a real hello byte by byte.
        let hello = rustls_hello("fuzz.example");
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        for _ in 0..20_000 {
            let mut input = hello.clone();
            for _ in 0..4 {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let i = (state as usize) % input.len();
                input[i] = (state >> 32) as u8;
            }
            let cut = (state as usize >> 8) % (input.len() + 1);
            let _ = parse(&input[..cut]);
        }
    }
}
