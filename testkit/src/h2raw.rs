//! A raw-frame HTTP/2 client for conformance tests: it writes whatever frames a
//! test builds (valid or not) over TLS with ALPN h2 and reads the server's frames
//! back until the server ends a stream or the connection, or a deadline passes.
//!
//! Header blocks are encoded with HPACK literals without indexing and no Huffman
//! coding (RFC 7541 §6.2.2), so the encoder keeps no table and a test can put any
//! bytes into a block, malformed ones included.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use rustls::ClientConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::time::{timeout_at, Instant};
use tokio_rustls::client::TlsStream;

use crate::pki::with_alpn;

/// The client connection preface (RFC 9113 §3.4).
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Frame types (RFC 9113 §6).
pub mod kind {
    pub const DATA: u8 = 0x0;
    pub const HEADERS: u8 = 0x1;
    pub const PRIORITY: u8 = 0x2;
    pub const RST_STREAM: u8 = 0x3;
    pub const SETTINGS: u8 = 0x4;
    pub const PUSH_PROMISE: u8 = 0x5;
    pub const PING: u8 = 0x6;
    pub const GOAWAY: u8 = 0x7;
    pub const WINDOW_UPDATE: u8 = 0x8;
    pub const CONTINUATION: u8 = 0x9;
}

/// Frame flags.
pub mod flag {
    pub const END_STREAM: u8 = 0x1;
    pub const ACK: u8 = 0x1;
    pub const END_HEADERS: u8 = 0x4;
    pub const PADDED: u8 = 0x8;
    pub const PRIORITY: u8 = 0x20;
}

/// Error codes (RFC 9113 §7).
pub mod code {
    pub const NO_ERROR: u32 = 0x0;
    pub const PROTOCOL_ERROR: u32 = 0x1;
    pub const INTERNAL_ERROR: u32 = 0x2;
    pub const FLOW_CONTROL_ERROR: u32 = 0x3;
    pub const SETTINGS_TIMEOUT: u32 = 0x4;
    pub const STREAM_CLOSED: u32 = 0x5;
    pub const FRAME_SIZE_ERROR: u32 = 0x6;
    pub const REFUSED_STREAM: u32 = 0x7;
    pub const CANCEL: u32 = 0x8;
    pub const COMPRESSION_ERROR: u32 = 0x9;
    pub const CONNECT_ERROR: u32 = 0xa;
    pub const ENHANCE_YOUR_CALM: u32 = 0xb;

    /// The code's name, for messages.
    pub fn name(code: u32) -> String {
        const NAMES: [&str; 14] = [
            "NO_ERROR",
            "PROTOCOL_ERROR",
            "INTERNAL_ERROR",
            "FLOW_CONTROL_ERROR",
            "SETTINGS_TIMEOUT",
            "STREAM_CLOSED",
            "FRAME_SIZE_ERROR",
            "REFUSED_STREAM",
            "CANCEL",
            "COMPRESSION_ERROR",
            "CONNECT_ERROR",
            "ENHANCE_YOUR_CALM",
            "INADEQUATE_SECURITY",
            "HTTP_1_1_REQUIRED",
        ];
        usize::try_from(code)
            .ok()
            .and_then(|i| NAMES.get(i))
            .map_or_else(|| format!("0x{code:x}"), |n| (*n).to_string())
    }
}

/// Setting identifiers (RFC 9113 §6.5.2).
pub mod setting {
    pub const HEADER_TABLE_SIZE: u16 = 0x1;
    pub const ENABLE_PUSH: u16 = 0x2;
    pub const MAX_CONCURRENT_STREAMS: u16 = 0x3;
    pub const INITIAL_WINDOW_SIZE: u16 = 0x4;
    pub const MAX_FRAME_SIZE: u16 = 0x5;
    pub const MAX_HEADER_LIST_SIZE: u16 = 0x6;
}

/// One frame as read from the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub kind: u8,
    pub flags: u8,
    pub stream: u32,
    pub payload: Vec<u8>,
}

impl Frame {
    /// The error code of a RST_STREAM or GOAWAY frame.
    pub fn error_code(&self) -> Option<u32> {
        let at = match self.kind {
            kind::RST_STREAM => 0,
            kind::GOAWAY => 4,
            _ => return None,
        };
        let bytes = self.payload.get(at..at + 4)?;
        Some(u32::from_be_bytes(bytes.try_into().ok()?))
    }
}

/// A frame on the wire: the 9-octet header (the length taken from `payload`) and
/// the payload. The stream id's reserved bit is kept as given.
pub fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).unwrap_or(u32::MAX).min(0xff_ffff);
    let mut out = Vec::with_capacity(9 + payload.len());
    out.extend_from_slice(&len.to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// A SETTINGS payload.
pub fn settings(values: &[(u16, u32)]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|(id, value)| id.to_be_bytes().into_iter().chain(value.to_be_bytes()))
        .collect()
}

/// A WINDOW_UPDATE frame.
pub fn window_update(stream: u32, increment: u32) -> Vec<u8> {
    frame(kind::WINDOW_UPDATE, 0, stream, &increment.to_be_bytes())
}

/// A RST_STREAM frame.
pub fn rst_stream(stream: u32, error: u32) -> Vec<u8> {
    frame(kind::RST_STREAM, 0, stream, &error.to_be_bytes())
}

/// A PING frame with `data`.
pub fn ping(data: [u8; 8]) -> Vec<u8> {
    frame(kind::PING, 0, 0, &data)
}

/// A HEADERS frame carrying `block` whole (END_HEADERS), ending the stream or not.
pub fn headers(stream: u32, block: &[u8], end_stream: bool) -> Vec<u8> {
    let flags = flag::END_HEADERS | if end_stream { flag::END_STREAM } else { 0 };
    frame(kind::HEADERS, flags, stream, block)
}

/// A DATA frame.
pub fn data(stream: u32, payload: &[u8], end_stream: bool) -> Vec<u8> {
    frame(
        kind::DATA,
        if end_stream { flag::END_STREAM } else { 0 },
        stream,
        payload,
    )
}

/// An HPACK integer with an `n`-bit prefix whose high bits are `first` (RFC 7541 §5.1).
pub fn hpack_int(out: &mut Vec<u8>, first: u8, n: u8, mut value: usize) {
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

/// A header block of literal fields without indexing, new names, no Huffman: any
/// name and value bytes, uppercase and pseudo-fields included, in the order given.
pub fn block(fields: &[(&str, &str)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in fields {
        literal(&mut out, name.as_bytes(), value.as_bytes());
    }
    out
}

/// Appends one literal field without indexing (RFC 7541 §6.2.2, new name).
pub fn literal(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.push(0x00);
    hpack_int(out, 0, 7, name.len());
    out.extend_from_slice(name);
    hpack_int(out, 0, 7, value.len());
    out.extend_from_slice(value);
}

/// What a connection's reading ended with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// The server sent GOAWAY with this code (and closed, or went quiet).
    GoAway { code: u32, last_stream: u32 },
    /// The server reset this stream with this code.
    Reset { stream: u32, code: u32 },
    /// The server closed the connection without GOAWAY.
    Closed,
    /// Nothing ended before the deadline.
    TimedOut,
}

impl std::fmt::Display for End {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            End::GoAway { code: c, last_stream } => {
                write!(f, "GOAWAY {} (last stream {last_stream})", code::name(*c))
            }
            End::Reset { stream, code: c } => write!(f, "RST_STREAM {} on stream {stream}", code::name(*c)),
            End::Closed => f.write_str("connection closed without GOAWAY"),
            End::TimedOut => f.write_str("no GOAWAY, RST_STREAM or close before the deadline"),
        }
    }
}

/// One raw HTTP/2 connection over TLS.
pub struct H2Raw {
    tls: TlsStream<TcpStream>,
    buf: Vec<u8>,
    /// Every frame read so far, in order.
    pub seen: Vec<Frame>,
    /// The settings of the server's first SETTINGS frame.
    pub server_settings: Vec<(u16, u32)>,
}

impl std::fmt::Debug for H2Raw {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("H2Raw")
            .field("seen", &self.seen.len())
            .finish_non_exhaustive()
    }
}

impl H2Raw {
    /// TCP to `addr`, TLS with `sni`, ALPN h2 (required of the server).
    pub async fn connect(addr: SocketAddr, sni: &str, tls: &ClientConfig) -> Result<H2Raw> {
        H2Raw::connect_with(addr, sni, tls, None).await
    }

    /// As [`H2Raw::connect`], with the socket's receive buffer set to about
    /// `receive_buffer` bytes before connecting (a client that reads slowly, or not
    /// at all, fills it fast).
    pub async fn connect_with(
        addr: SocketAddr,
        sni: &str,
        tls: &ClientConfig,
        receive_buffer: Option<u32>,
    ) -> Result<H2Raw> {
        let socket = if addr.is_ipv4() {
            TcpSocket::new_v4()
        } else {
            TcpSocket::new_v6()
        }
        .context("socket")?;
        if let Some(size) = receive_buffer {
            socket.set_recv_buffer_size(size).context("SO_RCVBUF")?;
        }
        let tcp = socket
            .connect(addr)
            .await
            .with_context(|| format!("TCP to {addr}"))?;
        // Frames go out as written: no Nagle delay between a test's small writes.
        tcp.set_nodelay(true).context("TCP_NODELAY")?;
        let tls = crate::http::tls(tcp, sni, with_alpn(tls, b"h2"))
            .await
            .with_context(|| format!("TLS to {addr}"))?;
        if tls.get_ref().1.alpn_protocol() != Some(b"h2") {
            bail!("the server did not select ALPN h2");
        }
        Ok(H2Raw {
            tls,
            buf: Vec::new(),
            seen: Vec::new(),
            server_settings: Vec::new(),
        })
    }

    /// The preface and `settings`, then the server's SETTINGS (acknowledged) and
    /// the acknowledgement of ours, within `within`.
    pub async fn handshake(&mut self, settings_values: &[(u16, u32)], within: Duration) -> Result<()> {
        let mut hello = PREFACE.to_vec();
        hello.extend(frame(kind::SETTINGS, 0, 0, &settings(settings_values)));
        self.send(&hello).await?;
        let deadline = Instant::now() + within;
        let (mut theirs, mut acked) = (false, false);
        while !(theirs && acked) {
            let Some(f) = self.read_frame(deadline).await? else {
                bail!("closed during the handshake (frames: {:?})", self.seen);
            };
            match (f.kind, f.flags & flag::ACK != 0) {
                (kind::SETTINGS, false) if !theirs => {
                    theirs = true;
                    self.server_settings = f
                        .payload
                        .chunks_exact(6)
                        .map(|c| {
                            (
                                u16::from_be_bytes([c[0], c[1]]),
                                u32::from_be_bytes([c[2], c[3], c[4], c[5]]),
                            )
                        })
                        .collect();
                    self.send(&frame(kind::SETTINGS, flag::ACK, 0, &[])).await?;
                }
                (kind::SETTINGS, true) => acked = true,
                (kind::GOAWAY, _) => bail!("GOAWAY during the handshake: {:?}", f),
                _ => {}
            }
        }
        Ok(())
    }

    /// A value of the server's SETTINGS.
    pub fn server_setting(&self, id: u16) -> Option<u32> {
        self.server_settings
            .iter()
            .find(|(i, _)| *i == id)
            .map(|(_, v)| *v)
    }

    /// Writes `bytes` as they are. A server that already closed makes this fail,
    /// which tests that expect a close may ignore.
    pub async fn send(&mut self, bytes: &[u8]) -> Result<()> {
        self.tls.write_all(bytes).await.context("writing")?;
        self.tls.flush().await.context("flushing")
    }

    /// The next frame, `None` at the end of the stream (or a TLS error, which is
    /// how a closing server often looks), an error at the deadline.
    pub async fn read_frame(&mut self, deadline: Instant) -> Result<Option<Frame>> {
        loop {
            if self.buf.len() >= 9 {
                let len = u32::from_be_bytes([0, self.buf[0], self.buf[1], self.buf[2]]) as usize;
                if self.buf.len() >= 9 + len {
                    let head: Vec<u8> = self.buf.drain(..9 + len).collect();
                    let f = Frame {
                        kind: head[3],
                        flags: head[4],
                        stream: u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff,
                        payload: head[9..].to_vec(),
                    };
                    self.seen.push(f.clone());
                    return Ok(Some(f));
                }
            }
            let mut chunk = [0u8; 16 * 1024];
            match timeout_at(deadline, self.tls.read(&mut chunk)).await {
                Err(_) => bail!("timed out"),
                Ok(Ok(0) | Err(_)) => return Ok(None),
                Ok(Ok(n)) => self.buf.extend_from_slice(&chunk[..n]),
            }
        }
    }

    /// Reads until the server sends GOAWAY or resets a stream, or closes, or
    /// `within` passes. PINGs are not answered; everything read is in `seen`.
    pub async fn until_end(&mut self, within: Duration) -> End {
        let deadline = Instant::now() + within;
        loop {
            match self.read_frame(deadline).await {
                Err(_) => return End::TimedOut,
                Ok(None) => return End::Closed,
                Ok(Some(f)) => match (f.kind, f.error_code()) {
                    (kind::GOAWAY, Some(code)) => {
                        let last = f
                            .payload
                            .get(..4)
                            .map_or(0, |b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) & 0x7fff_ffff);
                        return End::GoAway {
                            code,
                            last_stream: last,
                        };
                    }
                    (kind::RST_STREAM, Some(code)) => {
                        return End::Reset {
                            stream: f.stream,
                            code,
                        }
                    }
                    _ => {}
                },
            }
        }
    }

    /// Reads until `stream` ends: a frame on it with END_STREAM, or its reset
    /// (false), or a GOAWAY, a close or the deadline (false).
    pub async fn until_stream_end(&mut self, stream: u32, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        loop {
            match self.read_frame(deadline).await {
                Ok(Some(f)) if f.stream == stream && f.kind == kind::RST_STREAM => return false,
                Ok(Some(f))
                    if f.stream == stream
                        && matches!(f.kind, kind::DATA | kind::HEADERS)
                        && f.flags & flag::END_STREAM != 0 =>
                {
                    return true
                }
                Ok(Some(f)) if f.kind == kind::GOAWAY => return false,
                Ok(Some(_)) => {}
                Err(_) | Ok(None) => return false,
            }
        }
    }

    /// Ends the connection in order: close_notify, then the TCP FIN.
    pub async fn close(&mut self) -> Result<()> {
        self.tls.shutdown().await.context("close_notify")
    }

    /// Ends the connection without close_notify: the TCP socket is closed under TLS.
    pub fn drop_tcp(self) {
        drop(self.tls.into_inner().0);
    }

    /// Whether the connection is closed within `within` (reading and dropping
    /// whatever comes first).
    pub async fn closes_within(&mut self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        loop {
            match self.read_frame(deadline).await {
                Err(_) => return false,
                Ok(None) => return true,
                Ok(Some(_)) => {}
            }
        }
    }

    /// Sends a PING and reads until its ACK (true), or a GOAWAY, a close or the
    /// deadline (false): whether the connection is still in working order.
    pub async fn ping_pong(&mut self, within: Duration) -> bool {
        let data = *b"confPING";
        if self.send(&ping(data)).await.is_err() {
            return false;
        }
        let deadline = Instant::now() + within;
        loop {
            match self.read_frame(deadline).await {
                Ok(Some(f)) if f.kind == kind::PING && f.flags & flag::ACK != 0 && f.payload == data => {
                    return true
                }
                Ok(Some(f)) if f.kind == kind::GOAWAY => return false,
                Ok(Some(_)) => {}
                Err(_) | Ok(None) => return false,
            }
        }
    }

    /// The `:status` of the first response on `stream`, decoded from every header
    /// block the server sent so far (HPACK, in order, as the server's table grew).
    pub fn status(&self, stream: u32) -> Option<u16> {
        let mut decoder = loona_hpack::Decoder::new();
        let mut block: Option<(u32, Vec<u8>)> = None;
        for f in &self.seen {
            match f.kind {
                kind::HEADERS => block = Some((f.stream, header_fragment(f)?.to_vec())),
                kind::CONTINUATION => block.as_mut()?.1.extend_from_slice(&f.payload),
                _ => continue,
            }
            if f.flags & flag::END_HEADERS == 0 {
                continue;
            }
            let (id, bytes) = block.take()?;
            let fields = decoder.decode(&bytes).ok()?;
            if id == stream {
                let (_, value) = fields.iter().find(|(name, _)| name.as_slice() == b":status")?;
                return std::str::from_utf8(value).ok()?.parse().ok();
            }
        }
        None
    }
}

/// The header block fragment of a HEADERS frame: without padding and priority.
fn header_fragment(f: &Frame) -> Option<&[u8]> {
    let mut payload = f.payload.as_slice();
    let mut pad = 0;
    if f.flags & flag::PADDED != 0 {
        pad = usize::from(*payload.first()?);
        payload = &payload[1..];
    }
    if f.flags & flag::PRIORITY != 0 {
        payload = payload.get(5..)?;
    }
    payload.get(..payload.len().checked_sub(pad)?)
}
