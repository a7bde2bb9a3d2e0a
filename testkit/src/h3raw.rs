//! A raw HTTP/3 client for conformance tests: QUIC streams from quinn, and HTTP/3
//! frames (RFC 9114 §7) and QPACK field sections (RFC 9204, literals only, no
//! dynamic table) written by hand, so a test can send what no library would.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};
use rustls::ClientConfig;

use crate::h3::{endpoint, H3Options};

/// Frame types (RFC 9114 §7.2).
pub mod kind {
    pub const DATA: u64 = 0x0;
    pub const HEADERS: u64 = 0x1;
    pub const CANCEL_PUSH: u64 = 0x3;
    pub const SETTINGS: u64 = 0x4;
    pub const PUSH_PROMISE: u64 = 0x5;
    pub const GOAWAY: u64 = 0x7;
    pub const MAX_PUSH_ID: u64 = 0xd;
    /// A reserved type (0x1f * N + 0x21), which receivers ignore (§7.2.8).
    pub const RESERVED: u64 = 0x21;
}

/// Unidirectional stream types (RFC 9114 §6.2).
pub mod stream_type {
    pub const CONTROL: u64 = 0x0;
    pub const PUSH: u64 = 0x1;
    /// A reserved stream type, which receivers ignore (§6.2.3).
    pub const RESERVED: u64 = 0x21;
}

/// Error codes (RFC 9114 §8.1).
pub mod code {
    pub const H3_NO_ERROR: u64 = 0x100;
    pub const H3_GENERAL_PROTOCOL_ERROR: u64 = 0x101;
    pub const H3_INTERNAL_ERROR: u64 = 0x102;
    pub const H3_STREAM_CREATION_ERROR: u64 = 0x103;
    pub const H3_CLOSED_CRITICAL_STREAM: u64 = 0x104;
    pub const H3_FRAME_UNEXPECTED: u64 = 0x105;
    pub const H3_FRAME_ERROR: u64 = 0x106;
    pub const H3_EXCESSIVE_LOAD: u64 = 0x107;
    pub const H3_ID_ERROR: u64 = 0x108;
    pub const H3_SETTINGS_ERROR: u64 = 0x109;
    pub const H3_MISSING_SETTINGS: u64 = 0x10a;
    pub const H3_REQUEST_REJECTED: u64 = 0x10b;
    pub const H3_REQUEST_CANCELLED: u64 = 0x10c;
    pub const H3_REQUEST_INCOMPLETE: u64 = 0x10d;
    pub const H3_MESSAGE_ERROR: u64 = 0x10e;

    /// The code's name, for messages.
    pub fn name(code: u64) -> String {
        const NAMES: [&str; 15] = [
            "H3_NO_ERROR",
            "H3_GENERAL_PROTOCOL_ERROR",
            "H3_INTERNAL_ERROR",
            "H3_STREAM_CREATION_ERROR",
            "H3_CLOSED_CRITICAL_STREAM",
            "H3_FRAME_UNEXPECTED",
            "H3_FRAME_ERROR",
            "H3_EXCESSIVE_LOAD",
            "H3_ID_ERROR",
            "H3_SETTINGS_ERROR",
            "H3_MISSING_SETTINGS",
            "H3_REQUEST_REJECTED",
            "H3_REQUEST_CANCELLED",
            "H3_REQUEST_INCOMPLETE",
            "H3_MESSAGE_ERROR",
        ];
        code.checked_sub(0x100)
            .and_then(|i| NAMES.get(usize::try_from(i).ok()?))
            .map_or_else(|| format!("0x{code:x}"), |n| (*n).to_string())
    }
}

/// Appends a QUIC variable-length integer (RFC 9000 §16).
pub fn varint(out: &mut Vec<u8>, value: u64) {
    match value {
        0..=0x3f => out.push(value as u8),
        0x40..=0x3fff => out.extend_from_slice(&(value as u16 | 0x4000).to_be_bytes()),
        0x4000..=0x3fff_ffff => out.extend_from_slice(&(value as u32 | 0x8000_0000).to_be_bytes()),
        _ => out.extend_from_slice(&(value | 0xc000_0000_0000_0000).to_be_bytes()),
    }
}

/// An HTTP/3 frame: type, length, payload.
pub fn frame(kind: u64, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + 16);
    varint(&mut out, kind);
    varint(&mut out, payload.len() as u64);
    out.extend_from_slice(payload);
    out
}

/// A SETTINGS frame.
pub fn settings(values: &[(u64, u64)]) -> Vec<u8> {
    let mut payload = Vec::new();
    for (id, value) in values {
        varint(&mut payload, *id);
        varint(&mut payload, *value);
    }
    frame(kind::SETTINGS, &payload)
}

/// A QPACK prefixed integer (RFC 9204 §4.1.1, as HPACK's) with an `n`-bit prefix
/// under the high bits `first`.
fn prefixed(out: &mut Vec<u8>, first: u8, n: u8, mut value: usize) {
    let max = (1usize << n) - 1;
    if value < max {
        out.push(first | value as u8);
        return;
    }
    out.push(first | max as u8);
    value -= max;
    while value >= 128 {
        out.push((value % 128) as u8 | 0x80);
        value /= 128;
    }
    out.push(value as u8);
}

/// A QPACK field section of literal field lines with literal names, no Huffman
/// (RFC 9204 §4.5.6): any bytes, in the order given.
pub fn field_section(fields: &[(&str, &str)]) -> Vec<u8> {
    // Required Insert Count 0, Delta Base 0: no dynamic table.
    let mut out = vec![0, 0];
    for (name, value) in fields {
        prefixed(&mut out, 0x20, 3, name.len());
        out.extend_from_slice(name.as_bytes());
        prefixed(&mut out, 0x00, 7, value.len());
        out.extend_from_slice(value.as_bytes());
    }
    out
}

/// A HEADERS frame with these fields.
pub fn headers(fields: &[(&str, &str)]) -> Vec<u8> {
    frame(kind::HEADERS, &field_section(fields))
}

/// How a connection or stream ended, as the client saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// The server closed the connection with this application error code.
    Connection(u64),
    /// The server reset the stream (or asked to stop sending) with this code.
    Stream(u64),
    /// A response came: its HEADERS frame's field section is here (raw QPACK).
    Response(Vec<u8>),
    /// The connection ended some other way (transport error, idle, ...).
    Other(String),
    /// Nothing happened before the deadline.
    TimedOut,
}

impl std::fmt::Display for End {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            End::Connection(c) => write!(f, "connection closed with {}", code::name(*c)),
            End::Stream(c) => write!(f, "stream reset with {}", code::name(*c)),
            End::Response(_) => f.write_str("a response"),
            End::Other(why) => write!(f, "connection ended: {why}"),
            End::TimedOut => f.write_str("nothing before the deadline"),
        }
    }
}

/// One raw HTTP/3 connection: QUIC to the server, nothing of HTTP/3 sent yet.
#[derive(Debug)]
pub struct H3Raw {
    _endpoint: quinn::Endpoint,
    pub conn: quinn::Connection,
    control: Option<quinn::SendStream>,
}

impl H3Raw {
    /// The QUIC handshake with ALPN h3, verified with `tls`.
    pub async fn connect(addr: SocketAddr, sni: &str, tls: &ClientConfig) -> Result<H3Raw> {
        let options = H3Options {
            idle_timeout: Some(Duration::from_secs(5)),
            ..H3Options::default()
        };
        let (endpoint, _) = endpoint(addr, tls, &options)?;
        let conn = endpoint
            .connect(addr, sni)
            .context("starting the QUIC handshake")?
            .await
            .with_context(|| format!("QUIC handshake with {addr}"))?;
        Ok(H3Raw {
            _endpoint: endpoint,
            conn,
            control: None,
        })
    }

    /// Opens the client's control stream with `first` written on it (normally an
    /// empty SETTINGS frame); the stream stays open.
    pub async fn open_control(&mut self, first: &[u8]) -> Result<()> {
        let mut send = self.conn.open_uni().await.context("opening the control stream")?;
        let mut bytes = Vec::new();
        varint(&mut bytes, stream_type::CONTROL);
        bytes.extend_from_slice(first);
        send.write_all(&bytes)
            .await
            .context("writing the control stream")?;
        self.control = Some(send);
        Ok(())
    }

    /// Writes more on the control stream.
    pub async fn control(&mut self, bytes: &[u8]) -> Result<()> {
        let send = self.control.as_mut().context("no control stream")?;
        send.write_all(bytes).await.context("writing the control stream")
    }

    /// Ends the control stream (FIN), which the server must treat as an error.
    pub fn finish_control(&mut self) -> Result<()> {
        let send = self.control.as_mut().context("no control stream")?;
        send.finish().context("finishing the control stream")
    }

    /// A unidirectional stream of `kind` carrying `bytes`, left open.
    pub async fn uni(&mut self, stream_kind: u64, bytes: &[u8]) -> Result<quinn::SendStream> {
        let mut send = self.conn.open_uni().await.context("opening a stream")?;
        let mut all = Vec::new();
        varint(&mut all, stream_kind);
        all.extend_from_slice(bytes);
        send.write_all(&all).await.context("writing")?;
        Ok(send)
    }

    /// A request stream carrying `bytes`, finished (FIN) if `fin`; then waits up to
    /// `within` for the server's answer: a response's HEADERS frame, a reset of
    /// the stream, or the end of the connection.
    pub async fn request(&mut self, bytes: &[u8], fin: bool, within: Duration) -> End {
        let (mut send, mut recv) = match self.conn.open_bi().await {
            Ok(pair) => pair,
            Err(e) => return connection_end(e),
        };
        if let Err(e) = send.write_all(bytes).await {
            return write_end(e);
        }
        if fin {
            let _ = send.finish();
        }
        let conn = &self.conn;
        let read = async {
            let mut got = Vec::new();
            let mut chunk = [0u8; 4096];
            loop {
                match recv.read(&mut chunk).await {
                    Ok(Some(n)) => got.extend_from_slice(&chunk[..n]),
                    Ok(None) => {
                        if let Some(end) = response(&got) {
                            return end;
                        }
                        // A server closing the connection may end its streams
                        // first: the close is the answer then.
                        return match tokio::time::timeout(Duration::from_secs(1), conn.closed()).await {
                            Ok(e) => connection_end(e),
                            Err(_) => End::Other("stream ended without HEADERS".into()),
                        };
                    }
                    Err(quinn::ReadError::Reset(c)) => return End::Stream(c.into_inner()),
                    Err(quinn::ReadError::ConnectionLost(e)) => return connection_end(e),
                    Err(e) => return End::Other(e.to_string()),
                }
                if let Some(end) = response(&got) {
                    return end;
                }
            }
        };
        let stopped = async {
            match send.stopped().await {
                Ok(Some(c)) => End::Stream(c.into_inner()),
                // Stopped with no code: the stream completed; let the read decide.
                Ok(None) => std::future::pending().await,
                Err(quinn::StoppedError::ConnectionLost(e)) => connection_end(e),
                Err(e) => End::Other(e.to_string()),
            }
        };
        tokio::select! {
            end = read => end,
            end = stopped => end,
            () = tokio::time::sleep(within) => End::TimedOut,
        }
    }

    /// Waits up to `within` for the server to close the connection.
    pub async fn closed(&self, within: Duration) -> End {
        match tokio::time::timeout(within, self.conn.closed()).await {
            Ok(e) => connection_end(e),
            Err(_) => End::TimedOut,
        }
    }
}

fn connection_end(e: quinn::ConnectionError) -> End {
    match e {
        quinn::ConnectionError::ApplicationClosed(close) => End::Connection(close.error_code.into_inner()),
        other => End::Other(other.to_string()),
    }
}

fn write_end(e: quinn::WriteError) -> End {
    match e {
        quinn::WriteError::Stopped(c) => End::Stream(c.into_inner()),
        quinn::WriteError::ConnectionLost(e) => connection_end(e),
        other => End::Other(other.to_string()),
    }
}

/// The first frame of a response stream, once complete: HEADERS gives its field
/// section; anything else is reported as such.
fn response(got: &[u8]) -> Option<End> {
    let (kind, a) = read_varint(got)?;
    let (len, b) = read_varint(&got[a..])?;
    let start = a + b;
    let payload = got.get(start..start + usize::try_from(len).ok()?)?;
    Some(if kind == kind::HEADERS {
        End::Response(payload.to_vec())
    } else {
        End::Other(format!("response stream began with frame type 0x{kind:x}"))
    })
}

fn read_varint(b: &[u8]) -> Option<(u64, usize)> {
    let first = *b.first()?;
    let len = 1usize << (first >> 6);
    let bytes = b.get(..len)?;
    let mut value = u64::from(first & 0x3f);
    for byte in &bytes[1..] {
        value = (value << 8) | u64::from(*byte);
    }
    Some((value, len))
}
