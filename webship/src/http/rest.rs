//! Connections at rest before their first request: what hyper's drivers wait on
//! before they build hyper's connection, holding only the boxed TLS stream and a few
//! bytes, with the limits hyper's connection kept.
//!
//! - HTTP/1.1 on a proxy site ([`first_bytes`]): until the client's first bytes; the
//!   first request head is due `header_read_timeout` after the handshake, a shorter
//!   `idle_timeout` closes in order.
//! - HTTP/2 ([`h2`]): until the client sends what only h2 can answer, the handshake
//!   answered meanwhile (`h2_guard::handshake`); the client's preface (its magic and
//!   first SETTINGS) is due `handshake_timeout` after the handshake, and
//!   `idle_timeout` closes with GOAWAY naming no stream.
//!
//! The drain closes a connection at rest too, unless its first request begins
//! within `FIRST_REQUEST_GRACE` ([`super::drain_grace_over`]).

use std::io;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt};

use super::h2_guard::handshake::{self, classify, Opening, Rest, MAX_INPUT};
use super::CLOSE_GRACE;
use crate::exchange::ConnContext;
use crate::ktls::RustlsStream;

/// How the wait for an HTTP/1.1 connection's first bytes ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FirstBytes {
    /// Bytes, the end of the stream or an error: hyper's read sees which.
    Arrived,
    /// The drain (after `FIRST_REQUEST_GRACE`), or `idle_timeout` when it is the
    /// shorter: closed in order ([`close_in_order`], as hyper closes).
    Closed,
    /// `header_read_timeout` since the handshake, no request head begun.
    HeadTimeout,
}

/// Waits, holding no buffer ([`super::tls_readable`]), for the first bytes of a
/// connection that has sent none since its handshake, as long as hyper's connection
/// would have waited for them: `header_read_timeout` (or `idle_timeout` when shorter,
/// `drive`'s idle close) from `start`, or until `FIRST_REQUEST_GRACE` into the drain.
pub(super) async fn first_bytes(
    stream: &mut RustlsStream,
    ctx: &ConnContext,
    start: tokio::time::Instant,
) -> FirstBytes {
    let limits = ctx.limits;
    let (until, expired) = if limits.idle_timeout < limits.header_read_timeout {
        (start + limits.idle_timeout, FirstBytes::Closed)
    } else {
        (start + limits.header_read_timeout, FirstBytes::HeadTimeout)
    };
    let mut shutdown = ctx.shutdown.clone();
    let waited = tokio::select! {
        // Bytes already there win over a drain that began meanwhile, as they did in
        // hyper's connection when its read came first.
        biased;
        readable = tokio::time::timeout_at(until, super::tls_readable(stream)) => match readable {
            Ok(_) => FirstBytes::Arrived,
            Err(_) => expired,
        },
        () = super::drain_grace_over(&mut shutdown) => FirstBytes::Closed,
    };
    if waited == FirstBytes::Closed {
        close_in_order(stream, &[]).await;
    }
    waited
}

/// How an HTTP/2 connection's rest ended.
#[derive(Debug)]
pub(super) enum Waited {
    /// The client sent what h2 must answer: build hyper's connection over this.
    Open(Opening),
    /// Closed in order: the client went away (with close_notify or without: as h2
    /// counted one that had sent its preface), or idle or the drain closed it.
    Closed,
    /// The client's preface (magic and SETTINGS) not complete within
    /// `handshake_timeout`.
    NoPreface,
    /// The client took no bytes of ours within `send_timeout`.
    Stalled,
    Io(io::Error),
}

/// Holds an HTTP/2 connection at rest until its client sends what h2 must answer,
/// or it ends (see the module notes). `settings`: the SETTINGS frame h2 will send
/// first; `start`: the handshake's end.
pub(super) async fn h2(
    stream: &mut RustlsStream,
    settings: Vec<u8>,
    ctx: &ConnContext,
    start: tokio::time::Instant,
) -> Waited {
    let limits = ctx.limits;
    if let Err(waited) = send(stream, &settings, limits.send_timeout).await {
        return waited;
    }
    let mut input = Vec::new();
    let mut acked = false;
    let mut shutdown = ctx.shutdown.clone();
    // One future for the whole rest: the grace counts from the drain's start.
    let drained = super::drain_grace_over(&mut shutdown);
    tokio::pin!(drained);
    loop {
        let settings_in = match classify(&input) {
            Rest::Open => return Waited::Open(Opening::new(input, acked, settings)),
            Rest::Waiting { settings_in } => settings_in,
        };
        if settings_in && !acked {
            acked = true;
            if let Err(waited) = send(stream, &handshake::settings_ack(), limits.send_timeout).await {
                return waited;
            }
        }
        let idle_end = start + limits.idle_timeout;
        let preface_end = start + limits.handshake_timeout;
        let (end, expired) = if !settings_in && preface_end <= idle_end {
            (preface_end, Waited::NoPreface)
        } else {
            (idle_end, Waited::Closed)
        };
        let room = MAX_INPUT - input.len();
        let arrived = tokio::select! {
            // Bytes already there win over a drain that began meanwhile.
            biased;
            arrived = tokio::time::timeout_at(end, read_into(stream, &mut input, room)) => arrived,
            () = &mut drained => {
                close_in_order(stream, &handshake::goaway_before_any_stream()).await;
                return Waited::Closed;
            }
        };
        match arrived {
            Err(_) => {
                if matches!(expired, Waited::Closed) {
                    close_in_order(stream, &handshake::goaway_before_any_stream()).await;
                }
                return expired;
            }
            Ok(Ok(Read::More)) => {
                input.shrink_to_fit();
                // What a resting connection reads (the client's acknowledgement of our
                // SETTINGS, a WINDOW_UPDATE) gets no answer that would carry the TCP
                // ACK, and a client with Nagle's algorithm on holds its request back
                // until that ACK comes: 40 ms of delayed ACK on the first request
                // (measured: 3 of 12 single 1 MiB downloads took 45 ms, not 3).
                let _ = crate::sys::ack_now(stream.get_ref().0.get_ref());
            }
            Ok(Ok(Read::End)) => {
                close_in_order(stream, &[]).await;
                return Waited::Closed;
            }
            Ok(Err(e)) if e.kind() == io::ErrorKind::UnexpectedEof => return Waited::Closed,
            Ok(Err(e)) => return Waited::Io(e),
        }
    }
}

/// What a read at rest found.
enum Read {
    More,
    /// The client's close_notify.
    End,
}

/// Appends up to `room` bytes of plaintext to `input` once there are some, taken
/// from rustls' own buffer (the wait holds none: [`super::tls_readable`]).
async fn read_into(stream: &mut RustlsStream, input: &mut Vec<u8>, room: usize) -> io::Result<Read> {
    super::tls_readable(stream).await?;
    let available = stream.fill_buf().await?;
    if available.is_empty() {
        return Ok(Read::End);
    }
    let n = available.len().min(room);
    input.extend_from_slice(&available[..n]);
    stream.consume(n);
    Ok(Read::More)
}

/// Writes `bytes` and flushes them, within `limit`.
async fn send(stream: &mut RustlsStream, bytes: &[u8], limit: Duration) -> Result<(), Waited> {
    let sent = tokio::time::timeout(limit, async {
        stream.write_all(bytes).await?;
        stream.flush().await
    })
    .await;
    match sent {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(Waited::Io(e)),
        Err(_) => Err(Waited::Stalled),
    }
}

/// What a closing connection at rest reads and drops at most, waiting for its
/// client's end.
const LINGER_BYTES: usize = 64 * 1024;

/// Closes a connection at rest in order, within `CLOSE_GRACE`: `goodbye` (HTTP/2's
/// GOAWAY naming no stream; nothing for HTTP/1.1), close_notify, then what the
/// client still sends (a request that crossed the close) is read and dropped until
/// it closes too, `LINGER_BYTES` at most, from rustls' own buffer. Closing a socket
/// with input unread makes the kernel reset the connection, which can discard the
/// GOAWAY and close_notify still on their way to the client.
pub(super) async fn close_in_order(stream: &mut RustlsStream, goodbye: &[u8]) {
    let _ = tokio::time::timeout(CLOSE_GRACE, async {
        stream.write_all(goodbye).await?;
        stream.shutdown().await?;
        let mut dropped = 0;
        while dropped < LINGER_BYTES {
            let n = stream.fill_buf().await?.len();
            if n == 0 {
                break;
            }
            stream.consume(n);
            dropped += n;
        }
        io::Result::Ok(())
    })
    .await;
}
