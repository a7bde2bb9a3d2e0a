//! The PROXY protocol (HAProxy's "The PROXY protocol", versions 1 and 2): how an L4
//! load balancer in front of Webship tells it who the client is, and how Webship
//! tells a passthrough origin the same.
//!
//! This module is the wire format only — [`parse`] and [`encode`] do no I/O, so they
//! are tested with literal bytes and fuzzed (`fuzz/fuzz_targets/proxy_header.rs`).
//! [`accept`] reads a header off a new connection: exactly the header, never a byte
//! of the TLS behind it, so the passthrough peek and the TLS handshake find the
//! socket as the client left it.
//!
//! Every length a peer controls is bounded before anything is read: a v1 line is at
//! most [`V1_MAX`] bytes, a v2 header at most 16 + [`V2_MAX_PAYLOAD`].

pub(crate) mod accept;

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

pub use crate::config::ProxyProtocol;

/// The longest v1 line, CRLF included (the specification's own figure: a TCP6 line
/// with the longest addresses and ports).
pub const V1_MAX: usize = 107;
/// The v2 signature, the first 12 bytes of every v2 header.
pub const V2_SIGNATURE: [u8; 12] = *b"\r\n\r\n\0\r\nQUIT\n";
/// The longest v2 payload (addresses and TLVs) accepted. The addresses take at most
/// 216 bytes (two Unix paths); what balancers add as TLVs (AWS's VPC endpoint id,
/// Azure's link id, HAProxy's SSL details) stays far below this. A longer length
/// field is refused before its bytes are read.
pub const V2_MAX_PAYLOAD: usize = 2048;
/// The fixed part of a v2 header: signature, version and command, family, length.
const V2_FIXED: usize = 16;
const V1_PREFIX: &[u8] = b"PROXY ";

/// What a complete header says about the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Carried {
    /// The balancer's client, and the address that client connected to.
    Proxied {
        client: SocketAddr,
        destination: SocketAddr,
    },
    /// No address to take: a v2 `LOCAL` command (the balancer's own health check),
    /// v1 `UNKNOWN`, or a family other than TCP over IPv4/IPv6 (Unix sockets,
    /// unspecified). The connection's own endpoints stand.
    Local,
}

/// The verdict on the bytes a connection started with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parsed {
    /// A whole header of `len` bytes (what follows it is not looked at).
    Complete { header: Carried, len: usize },
    /// A valid start of a header that is at most `up_to` bytes long in all: reading
    /// up to `up_to` bytes never takes one past the header's end.
    Incomplete { up_to: usize },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error("not a PROXY protocol header")]
    NotAHeader,
    #[error("malformed PROXY header: {0}")]
    Malformed(&'static str),
    #[error("PROXY header too long")]
    TooLarge,
}

/// Judges the first bytes of a connection, which may hold more than the header.
pub fn parse(buf: &[u8]) -> Result<Parsed, HeaderError> {
    if buf.is_empty() {
        return Ok(Parsed::Incomplete { up_to: V2_FIXED });
    }
    if is_prefix(buf, &V2_SIGNATURE) {
        parse_v2(buf)
    } else if is_prefix(buf, V1_PREFIX) {
        parse_v1(buf)
    } else {
        Err(HeaderError::NotAHeader)
    }
}

/// Whether `buf` (non-empty) starts like a header of either version. Neither
/// signature's first byte (`P`, CR) can start a TLS record, so one byte tells.
pub fn starts_like_header(buf: &[u8]) -> bool {
    !buf.is_empty() && (is_prefix(buf, &V2_SIGNATURE) || is_prefix(buf, V1_PREFIX))
}

/// `buf` and `signature` agree on their common length.
fn is_prefix(buf: &[u8], signature: &[u8]) -> bool {
    let n = buf.len().min(signature.len());
    buf[..n] == signature[..n]
}

fn parse_v1(buf: &[u8]) -> Result<Parsed, HeaderError> {
    let window = &buf[..buf.len().min(V1_MAX)];
    let Some(lf) = window.iter().position(|&b| b == b'\n') else {
        return if buf.len() >= V1_MAX {
            Err(HeaderError::TooLarge)
        } else {
            Ok(Parsed::Incomplete { up_to: V1_MAX })
        };
    };
    let line = window[..lf]
        .strip_suffix(b"\r")
        .ok_or(HeaderError::Malformed("v1 line not ended by CRLF"))?;
    let line = std::str::from_utf8(line).map_err(|_| HeaderError::Malformed("v1 line not ASCII"))?;
    let mut fields = line.split(' ');
    let _proxy = fields.next();
    let header = match fields.next() {
        // Whatever follows UNKNOWN is to be ignored.
        Some("UNKNOWN") => Carried::Local,
        Some(family @ ("TCP4" | "TCP6")) => {
            let mut next = || fields.next().ok_or(HeaderError::Malformed("v1 line too short"));
            let (src, dst) = (next()?, next()?);
            let (sport, dport) = (next()?, next()?);
            if fields.next().is_some() {
                return Err(HeaderError::Malformed("v1 line has extra fields"));
            }
            let v4 = family == "TCP4";
            let client = SocketAddr::new(v1_ip(src, v4)?, v1_port(sport)?);
            let destination = SocketAddr::new(v1_ip(dst, v4)?, v1_port(dport)?);
            Carried::Proxied { client, destination }
        }
        _ => return Err(HeaderError::Malformed("v1 protocol is not TCP4, TCP6 or UNKNOWN")),
    };
    Ok(Parsed::Complete { header, len: lf + 1 })
}

fn v1_ip(text: &str, v4: bool) -> Result<IpAddr, HeaderError> {
    let ip: IpAddr = text
        .parse()
        .map_err(|_| HeaderError::Malformed("v1 address is not an IP address"))?;
    if ip.is_ipv4() != v4 {
        return Err(HeaderError::Malformed("v1 address of the other family"));
    }
    Ok(ip)
}

fn v1_port(text: &str) -> Result<u16, HeaderError> {
    let digits = !text.is_empty() && text.len() <= 5 && text.bytes().all(|b| b.is_ascii_digit());
    let no_leading_zero = text == "0" || !text.starts_with('0');
    match text.parse::<u16>() {
        Ok(port) if digits && no_leading_zero => Ok(port),
        _ => Err(HeaderError::Malformed("v1 port is not a number from 0 to 65535")),
    }
}

fn parse_v2(buf: &[u8]) -> Result<Parsed, HeaderError> {
    if buf.len() > 12 && buf[12] >> 4 != 2 {
        return Err(HeaderError::Malformed("v2 version is not 2"));
    }
    if buf.len() < V2_FIXED {
        return Ok(Parsed::Incomplete { up_to: V2_FIXED });
    }
    let command = buf[12] & 0x0f;
    let (family, transport) = (buf[13] >> 4, buf[13] & 0x0f);
    let payload = usize::from(u16::from_be_bytes([buf[14], buf[15]]));
    if payload > V2_MAX_PAYLOAD {
        return Err(HeaderError::TooLarge);
    }
    let len = V2_FIXED + payload;
    if command > 1 {
        return Err(HeaderError::Malformed("v2 command is neither LOCAL nor PROXY"));
    }
    if family > 3 || transport > 2 {
        return Err(HeaderError::Malformed("v2 family or transport unknown"));
    }
    if buf.len() < len {
        return Ok(Parsed::Incomplete { up_to: len });
    }
    let body = &buf[V2_FIXED..len];
    // The address block's size by family: unspecified, IPv4, IPv6, Unix.
    let addresses = [0, 12, 36, 216][usize::from(family)];
    if body.len() < addresses {
        return Err(HeaderError::Malformed("v2 length shorter than its addresses"));
    }
    check_tlvs(&body[addresses..])?;
    // LOCAL: the receiver must ignore the address block (a health check).
    let header = match (command, family, transport) {
        (1, 1, 1) => {
            let ip = |at: usize| IpAddr::from([body[at], body[at + 1], body[at + 2], body[at + 3]]);
            let port = |at: usize| u16::from_be_bytes([body[at], body[at + 1]]);
            Carried::Proxied {
                client: SocketAddr::new(ip(0), port(8)),
                destination: SocketAddr::new(ip(4), port(10)),
            }
        }
        (1, 2, 1) => {
            let ip = |at: usize| {
                let mut octets = [0u8; 16];
                octets.copy_from_slice(&body[at..at + 16]);
                IpAddr::from(octets)
            };
            let port = |at: usize| u16::from_be_bytes([body[at], body[at + 1]]);
            Carried::Proxied {
                client: SocketAddr::new(ip(0), port(32)),
                destination: SocketAddr::new(ip(16), port(34)),
            }
        }
        _ => Carried::Local,
    };
    Ok(Parsed::Complete { header, len })
}

/// The TLVs after the addresses: each type, a 16-bit length and that many bytes,
/// exactly filling the rest. Their meaning is skipped (none changes an address).
fn check_tlvs(mut tlvs: &[u8]) -> Result<(), HeaderError> {
    // Bounded: each turn consumes at least the 3-byte TLV head.
    while !tlvs.is_empty() {
        if tlvs.len() < 3 {
            return Err(HeaderError::Malformed("v2 TLV truncated"));
        }
        let value = usize::from(u16::from_be_bytes([tlvs[1], tlvs[2]]));
        tlvs = tlvs
            .get(3 + value..)
            .ok_or(HeaderError::Malformed("v2 TLV longer than the header"))?;
    }
    Ok(())
}

/// The header that tells an origin about `client`, who connected to `destination`.
/// Both are written in one family: an IPv4 address beside an IPv6 one is written
/// as IPv4-mapped IPv6.
pub fn encode(version: ProxyProtocol, client: SocketAddr, destination: SocketAddr) -> Vec<u8> {
    let (mut src, mut dst) = (client.ip().to_canonical(), destination.ip().to_canonical());
    if src.is_ipv4() != dst.is_ipv4() {
        (src, dst) = (IpAddr::V6(mapped(src)), IpAddr::V6(mapped(dst)));
    }
    let (sport, dport) = (client.port(), destination.port());
    match version {
        ProxyProtocol::V1 => {
            let family = if src.is_ipv4() { "TCP4" } else { "TCP6" };
            format!("PROXY {family} {src} {dst} {sport} {dport}\r\n").into_bytes()
        }
        ProxyProtocol::V2 => {
            let mut out = Vec::with_capacity(V2_FIXED + 36);
            out.extend_from_slice(&V2_SIGNATURE);
            // Version 2, PROXY; TCP over IPv4 (0x11) or IPv6 (0x21).
            out.push(0x21);
            match (src, dst) {
                (IpAddr::V4(s), IpAddr::V4(d)) => {
                    out.extend_from_slice(&[0x11, 0, 12]);
                    out.extend_from_slice(&s.octets());
                    out.extend_from_slice(&d.octets());
                }
                _ => {
                    out.extend_from_slice(&[0x21, 0, 36]);
                    out.extend_from_slice(&mapped(src).octets());
                    out.extend_from_slice(&mapped(dst).octets());
                }
            }
            out.extend_from_slice(&sport.to_be_bytes());
            out.extend_from_slice(&dport.to_be_bytes());
            out
        }
    }
}

fn mapped(ip: IpAddr) -> Ipv6Addr {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    }
}

#[cfg(test)]
mod tests;
