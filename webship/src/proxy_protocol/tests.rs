use std::net::SocketAddr;

use super::*;

fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

fn complete(buf: &[u8]) -> (Carried, usize) {
    match parse(buf) {
        Ok(Parsed::Complete { header, len }) => (header, len),
        other => panic!("{other:?} for {:?}", String::from_utf8_lossy(buf)),
    }
}

fn proxied(client: &str, destination: &str) -> Carried {
    Carried::Proxied {
        client: addr(client),
        destination: addr(destination),
    }
}

/// The specification's examples, with TLS bytes behind them that must not be taken.
#[test]
fn v1_lines() {
    let tls = [0x16, 0x03, 0x01];
    for (line, want) in [
        (
            "PROXY TCP4 203.0.113.7 198.51.100.1 56324 443\r\n",
            proxied("203.0.113.7:56324", "198.51.100.1:443"),
        ),
        (
            "PROXY TCP6 2001:db8::7 2001:db8::1 65535 0\r\n",
            proxied("[2001:db8::7]:65535", "[2001:db8::1]:0"),
        ),
        ("PROXY UNKNOWN\r\n", Carried::Local),
        (
            "PROXY UNKNOWN ffff:f...f:ffff ffff:f...f:ffff 65535 65535\r\n",
            Carried::Local,
        ),
    ] {
        let mut buf = line.as_bytes().to_vec();
        buf.extend_from_slice(&tls);
        assert_eq!(complete(&buf), (want, line.len()), "{line:?}");
        // Every shorter prefix is incomplete, bounded by the v1 maximum.
        for cut in 0..line.len() {
            let verdict = parse(&line.as_bytes()[..cut]).unwrap();
            assert!(
                matches!(verdict, Parsed::Incomplete { up_to } if up_to > cut),
                "{cut}: {verdict:?}"
            );
        }
    }
    // The longest line the specification counts (107 bytes, UNKNOWN with the longest
    // addresses) still parses; the longest TCP6 line is 104.
    let addresses =
        "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff 65535 65535\r\n";
    let longest = format!("PROXY UNKNOWN {addresses}");
    assert_eq!(complete(longest.as_bytes()), (Carried::Local, V1_MAX));
    let tcp6 = format!("PROXY TCP6 {addresses}");
    assert_eq!(complete(tcp6.as_bytes()).1, 104);
}

#[test]
fn v1_refusals() {
    for bad in [
        "PROXY TCP4 203.0.113.7 198.51.100.1 56324\r\n",
        "PROXY TCP4 203.0.113.7 198.51.100.1 56324 443 9\r\n",
        "PROXY TCP4 203.0.113.7  198.51.100.1 56324 443\r\n",
        "PROXY TCP4 2001:db8::7 198.51.100.1 1 2\r\n",
        "PROXY TCP6 203.0.113.7 2001:db8::1 1 2\r\n",
        "PROXY TCP4 203.0.113 198.51.100.1 1 2\r\n",
        "PROXY TCP4 203.0.113.7 198.51.100.1 65536 443\r\n",
        "PROXY TCP4 203.0.113.7 198.51.100.1 +1 443\r\n",
        "PROXY TCP4 203.0.113.7 198.51.100.1 0443 443\r\n",
        "PROXY TCP4 203.0.113.7 198.51.100.1 1 2\n",
        "PROXY UDP4 203.0.113.7 198.51.100.1 1 2\r\n",
        "PROXY tcp4 203.0.113.7 198.51.100.1 1 2\r\n",
        "PROXY \r\n",
    ] {
        assert!(
            matches!(parse(bad.as_bytes()), Err(HeaderError::Malformed(_))),
            "{bad:?}: {:?}",
            parse(bad.as_bytes())
        );
    }
    // No LF within 107 bytes: too long, whatever follows.
    let long = format!("PROXY UNKNOWN {}\r\n", "x".repeat(100));
    assert_eq!(parse(long.as_bytes()), Err(HeaderError::TooLarge));
    assert_eq!(parse(&long.as_bytes()[..V1_MAX]), Err(HeaderError::TooLarge));
    assert!(matches!(
        parse(&long.as_bytes()[..V1_MAX - 1]),
        Ok(Parsed::Incomplete { up_to: V1_MAX })
    ));
    // Not a header at all: TLS, HTTP, a near miss.
    for other in [
        &[0x16, 0x03, 0x01][..],
        b"GET / HTTP/1.1\r\n",
        b"PROXY-",
        b"\r\n\r\n\0\r\nQUIT\r",
    ] {
        assert_eq!(parse(other), Err(HeaderError::NotAHeader), "{other:?}");
        assert!(!starts_like_header(other));
    }
    assert!(starts_like_header(b"P") && starts_like_header(b"\r\n") && !starts_like_header(b""));
}

fn v2(command: u8, family: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = V2_SIGNATURE.to_vec();
    out.push(0x20 | command);
    out.push(family);
    out.extend_from_slice(&u16::try_from(payload.len()).unwrap().to_be_bytes());
    out.extend_from_slice(payload);
    out
}

#[test]
fn v2_headers() {
    let v4 = [203, 0, 113, 7, 198, 51, 100, 1, 0xdc, 0x04, 0x01, 0xbb];
    let header = v2(1, 0x11, &v4);
    assert_eq!(
        complete(&[&header[..], &[0x16, 0x03][..]].concat()),
        (proxied("203.0.113.7:56324", "198.51.100.1:443"), 28)
    );
    let mut v6 = Vec::new();
    v6.extend_from_slice(&"2001:db8::7".parse::<std::net::Ipv6Addr>().unwrap().octets());
    v6.extend_from_slice(&"2001:db8::1".parse::<std::net::Ipv6Addr>().unwrap().octets());
    v6.extend_from_slice(&[0, 1, 0, 2]);
    assert_eq!(
        complete(&v2(1, 0x21, &v6)),
        (proxied("[2001:db8::7]:1", "[2001:db8::1]:2"), 52)
    );
    // TLVs after the addresses are skipped: a NOOP and an AWS-like id.
    let mut with_tlvs = v4.to_vec();
    with_tlvs.extend_from_slice(&[0x04, 0, 2, 0, 0, 0xea, 0, 4, 1, 2, 3, 4]);
    assert_eq!(complete(&v2(1, 0x11, &with_tlvs)).1, 16 + 24);
    // LOCAL (a health check), UNSPEC, Unix and UDP keep the real endpoints.
    assert_eq!(complete(&v2(0, 0x00, &[])), (Carried::Local, 16));
    assert_eq!(complete(&v2(0, 0x11, &v4)), (Carried::Local, 28));
    assert_eq!(complete(&v2(1, 0x00, &[])), (Carried::Local, 16));
    assert_eq!(complete(&v2(1, 0x31, &[0; 216])), (Carried::Local, 232));
    assert_eq!(complete(&v2(1, 0x12, &v4)), (Carried::Local, 28));
    // Prefixes are incomplete and say how far the header reaches.
    for cut in 0..header.len() {
        let want = if cut < 16 { 16 } else { 28 };
        assert_eq!(
            parse(&header[..cut]),
            Ok(Parsed::Incomplete { up_to: want }),
            "{cut}"
        );
    }
}

#[test]
fn v2_refusals() {
    let v4 = [203, 0, 113, 7, 198, 51, 100, 1, 0, 1, 0, 2];
    let mut bad_version = v2(1, 0x11, &v4);
    bad_version[12] = 0x11;
    assert!(matches!(
        parse(&bad_version[..13]),
        Err(HeaderError::Malformed(_))
    ));
    let mut bad_command = v2(1, 0x11, &v4);
    bad_command[12] = 0x22;
    for bad in [
        bad_command,
        v2(1, 0x41, &v4),
        v2(1, 0x13, &v4),
        v2(1, 0x11, &v4[..11]),
        v2(1, 0x21, &v4),
        v2(1, 0x11, &[&v4[..], &[1, 0][..]].concat()),
        v2(1, 0x11, &[&v4[..], &[1, 0, 5, 1][..]].concat()),
    ] {
        assert!(matches!(parse(&bad), Err(HeaderError::Malformed(_))), "{bad:?}");
    }
    // A length over the cap is refused from the fixed part alone.
    let mut huge = v2(1, 0x11, &v4)[..16].to_vec();
    huge[14..16].copy_from_slice(&u16::MAX.to_be_bytes());
    assert_eq!(parse(&huge), Err(HeaderError::TooLarge));
    let cap = v2(
        1,
        0x11,
        &[&v4[..], &[0x04, 0x07, 0xf1][..], &[0; V2_MAX_PAYLOAD - 15][..]].concat(),
    );
    assert_eq!(complete(&cap).1, 16 + V2_MAX_PAYLOAD);
}

#[test]
fn encode_round_trips() {
    let cases = [
        (
            "203.0.113.7:56324",
            "198.51.100.1:443",
            "PROXY TCP4 203.0.113.7 198.51.100.1 56324 443\r\n",
        ),
        (
            "[2001:db8::7]:1",
            "[2001:db8::1]:443",
            "PROXY TCP6 2001:db8::7 2001:db8::1 1 443\r\n",
        ),
        // An IPv4 client on an IPv6 listener (`[::]`) is written as IPv4.
        (
            "[::ffff:203.0.113.7]:5",
            "[::ffff:127.0.0.1]:443",
            "PROXY TCP4 203.0.113.7 127.0.0.1 5 443\r\n",
        ),
        // Mixed families: both IPv6, the IPv4 one mapped.
        (
            "203.0.113.7:5",
            "[2001:db8::1]:443",
            "PROXY TCP6 ::ffff:203.0.113.7 2001:db8::1 5 443\r\n",
        ),
    ];
    for (client, destination, line) in cases {
        let (c, d) = (addr(client), addr(destination));
        assert_eq!(String::from_utf8(encode(ProxyProtocol::V1, c, d)).unwrap(), line);
        for version in [ProxyProtocol::V1, ProxyProtocol::V2] {
            let bytes = encode(version, c, d);
            let (header, len) = complete(&bytes);
            assert_eq!(len, bytes.len());
            let Carried::Proxied { client, destination } = header else {
                panic!("{header:?}");
            };
            assert_eq!(client.ip().to_canonical(), c.ip().to_canonical(), "{version}");
            assert_eq!(
                destination.ip().to_canonical(),
                d.ip().to_canonical(),
                "{version}"
            );
            assert_eq!((client.port(), destination.port()), (c.port(), d.port()));
        }
    }
    assert_eq!(
        encode(ProxyProtocol::V2, addr("1.2.3.4:1"), addr("5.6.7.8:2")).len(),
        28
    );
}

/// Arbitrary bytes (a fixed pseudo-random sequence): never a panic, a complete
/// header never longer than its input, and a verdict that later bytes cannot change.
#[test]
fn arbitrary_bytes_never_panic() {
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let starts: [&[u8]; 3] = [b"PROXY ", &V2_SIGNATURE, b""];
    for i in 0..20_000 {
        let mut buf = starts[i % 3].to_vec();
        if i % 3 == 1 {
            buf.push(0x20 | (next() as u8 & 1));
            buf.push([0x00, 0x11, 0x21, 0x31][next() as usize % 4]);
            buf.extend_from_slice(&[0, (next() % 64) as u8]);
        }
        let extra = next() as usize % 120;
        buf.extend((0..extra).map(|_| {
            let b = next() as u8;
            if i % 3 == 0 && b < 40 {
                b" 0123456789.:TCP\r\n"[usize::from(b) % 18]
            } else {
                b
            }
        }));
        match parse(&buf) {
            Ok(Parsed::Complete { len, .. }) => {
                assert!(len <= buf.len());
                let mut longer = buf.clone();
                longer.extend_from_slice(b"\x16\x03\x01");
                assert_eq!(parse(&longer), parse(&buf));
                assert_eq!(parse(&buf[..len]), parse(&buf));
            }
            Ok(Parsed::Incomplete { up_to }) => assert!(up_to > buf.len() && up_to <= 16 + V2_MAX_PAYLOAD),
            Err(_) => {}
        }
    }
}
