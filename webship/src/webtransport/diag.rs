//! The diagnostic modes, written once against [`SendHalf`], [`RecvHalf`] and
//! [`Transport`], so HTTP/3 and HTTP/2 sessions behave the same.
//!
//! - **echo**: a client bidirectional stream comes back on itself; a client
//!   unidirectional stream comes back on a new server stream; datagrams come back.
//! - **sink**: everything is counted and dropped; after the client finishes a
//!   bidirectional stream it gets one JSON line with the session's receive totals
//!   (`{"stream_bytes": …, "datagrams": …, "datagram_bytes": …}`), which is how a
//!   client measures datagram loss towards the server.
//! - **source**: a bidirectional stream carries one command, ended by FIN or a
//!   newline: `stream N` returns N bytes of the fixture stream ([`Pattern`], the
//!   test kit's generator: its first 99,943,778 bytes are the benchmark fixture)
//!   on that stream;
//!   `datagrams COUNT SIZE` sends COUNT datagrams of SIZE bytes (an 8-byte big-endian
//!   sequence number, then pattern bytes), then `sent COUNT` on the stream.
//!
//! Each stream holds one [`BUF`] buffer; streams and datagrams are charged to the
//! session's byte budget as they move.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use webship_testkit::fixture::Pattern;

use super::{Code, RecvHalf, SendHalf, SessionState, Transport};
use crate::config::WtMode;

/// Per-stream buffer.
const BUF: usize = 64 * 1024;
/// The longest source command.
const MAX_COMMAND: usize = 128;

/// A source-mode command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Stream(u64),
    Datagrams { count: u64, size: usize },
}

/// Parses a source command (no I/O).
pub fn parse_command(line: &[u8]) -> Option<Command> {
    let line = std::str::from_utf8(line).ok()?.trim();
    let mut words = line.split_ascii_whitespace();
    let cmd = match (words.next()?, words.next(), words.next()) {
        ("stream", Some(n), None) => Command::Stream(n.parse().ok()?),
        ("datagrams", Some(count), Some(size)) => Command::Datagrams {
            count: count.parse().ok()?,
            size: size.parse().ok()?,
        },
        _ => return None,
    };
    words.next().is_none().then_some(cmd)
}

/// Runs a client-opened bidirectional stream until it is done or the session ends;
/// on a session end the stream is reset, never left looking complete.
pub(crate) async fn bidi(
    state: Arc<SessionState>,
    transport: Arc<dyn Transport>,
    mut recv: Box<dyn RecvHalf>,
    mut send: Box<dyn SendHalf>,
) {
    let work = async {
        match state.mode {
            WtMode::Echo => echo(&state, &mut *recv, &mut *send).await,
            WtMode::Sink => {
                sink(&state, &mut *recv).await?;
                let totals = format!(
                    "{{\"stream_bytes\": {}, \"datagrams\": {}, \"datagram_bytes\": {}}}\n",
                    state.stream_bytes_in.load(Ordering::Relaxed),
                    state.datagrams_in.load(Ordering::Relaxed),
                    state.datagram_bytes_in.load(Ordering::Relaxed),
                );
                send.write_all(totals.as_bytes()).await?;
                send.shutdown().await
            }
            WtMode::Source => source(&state, &*transport, &mut *recv, &mut *send).await,
        }
    };
    let result = tokio::select! {
        r = work => Some(r),
        () = state.ended() => None,
    };
    settle(&state, result, &mut *recv, Some(&mut *send));
}

/// Runs a client-opened unidirectional stream.
pub(crate) async fn uni(
    state: Arc<SessionState>,
    transport: Arc<dyn Transport>,
    mut recv: Box<dyn RecvHalf>,
) {
    let mut out = None;
    let work = async {
        if state.mode == WtMode::Echo {
            let send = out.insert(transport.open_uni().await?);
            echo(&state, &mut *recv, &mut **send).await
        } else {
            sink(&state, &mut *recv).await
        }
    };
    let result = tokio::select! {
        r = work => Some(r),
        () = state.ended() => None,
    };
    settle(
        &state,
        result,
        &mut *recv,
        out.as_mut().map(|s| &mut **s as &mut dyn SendHalf),
    );
}

/// Handles one received datagram (already admitted by [`SessionState::datagram_in`]).
pub(crate) fn datagram(state: &SessionState, transport: &dyn Transport, payload: Bytes) {
    if state.mode != WtMode::Echo || !state.charge(payload.len()) {
        return;
    }
    let counters = state.counters();
    if transport.try_send_datagram(payload) {
        counters.datagrams_out.fetch_add(1, Ordering::Relaxed);
    } else {
        counters.datagrams_dropped.fetch_add(1, Ordering::Relaxed);
    }
}

/// A stream whose work did not complete (an error, or the session ended first) is
/// reset both ways, so its peer never mistakes it for a complete one.
fn settle(
    state: &SessionState,
    result: Option<std::io::Result<()>>,
    recv: &mut dyn RecvHalf,
    send: Option<&mut dyn SendHalf>,
) {
    if let Some(Ok(())) = result {
        return;
    }
    if let Some(Err(e)) = result {
        tracing::debug!(error = %e, "webtransport: stream ended early");
    }
    let code = state.ending().map_or(Code::Done, |e| e.code) as u32;
    // The send half first: whatever happens after, the peer must not see a FIN.
    if let Some(send) = send {
        send.reset(code);
    }
    recv.stop(code);
}

fn over_budget() -> std::io::Error {
    std::io::Error::other("session budget spent")
}

async fn echo(state: &SessionState, recv: &mut dyn RecvHalf, send: &mut dyn SendHalf) -> std::io::Result<()> {
    let counters = state.counters();
    let mut buf = vec![0u8; BUF];
    loop {
        let n = recv.read(&mut buf).await?;
        if n == 0 {
            return send.shutdown().await;
        }
        if !state.charge(2 * n) {
            return Err(over_budget());
        }
        counters.stream_bytes_in.fetch_add(n as u64, Ordering::Relaxed);
        state.stream_bytes_in.fetch_add(n as u64, Ordering::Relaxed);
        send.write_all(&buf[..n]).await?;
        counters.stream_bytes_out.fetch_add(n as u64, Ordering::Relaxed);
    }
}

async fn sink(state: &SessionState, recv: &mut dyn RecvHalf) -> std::io::Result<()> {
    let counters = state.counters();
    let mut buf = vec![0u8; BUF];
    loop {
        let n = recv.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        if !state.charge(n) {
            return Err(over_budget());
        }
        counters.stream_bytes_in.fetch_add(n as u64, Ordering::Relaxed);
        state.stream_bytes_in.fetch_add(n as u64, Ordering::Relaxed);
    }
}

async fn source(
    state: &SessionState,
    transport: &dyn Transport,
    recv: &mut dyn RecvHalf,
    send: &mut dyn SendHalf,
) -> std::io::Result<()> {
    let mut line = Vec::with_capacity(MAX_COMMAND);
    let mut byte = [0u8; 1];
    // Byte by byte: the command is short and must not swallow what follows.
    while line.len() <= MAX_COMMAND {
        if recv.read(&mut byte).await? == 0 || byte[0] == b'\n' {
            break;
        }
        line.push(byte[0]);
    }
    let Some(command) = parse_command(&line).filter(|_| line.len() <= MAX_COMMAND) else {
        state.fail(
            Code::BadCommand,
            format!(
                "`{}` is not `stream N` or `datagrams COUNT SIZE`",
                String::from_utf8_lossy(&line[..line.len().min(64)])
            ),
        );
        return Err(std::io::Error::other("bad command"));
    };
    let counters = state.counters();
    let mut pattern = Pattern::default();
    match command {
        Command::Stream(total) => {
            let mut buf = vec![0u8; BUF];
            let mut left = total;
            while left > 0 {
                let n = usize::try_from(left).unwrap_or(BUF).min(BUF);
                if !state.charge(n) {
                    return Err(over_budget());
                }
                pattern.fill(&mut buf[..n]);
                send.write_all(&buf[..n]).await?;
                counters.stream_bytes_out.fetch_add(n as u64, Ordering::Relaxed);
                left -= n as u64;
            }
            send.shutdown().await
        }
        Command::Datagrams { count, size } => {
            let max = state.config().max_datagram_bytes.min(transport.max_datagram());
            if !(8..=max).contains(&size) {
                state.fail(
                    Code::BadCommand,
                    format!("datagram size {size} is not within 8 to {max}"),
                );
                return Err(std::io::Error::other("bad command"));
            }
            let mut body = vec![0u8; size - 8];
            for seq in 0..count {
                if !state.charge(size) {
                    return Err(over_budget());
                }
                pattern.fill(&mut body);
                let mut d = BytesMut::with_capacity(size);
                d.put_u64(seq);
                d.extend_from_slice(&body);
                transport.send_datagram(d.freeze()).await?;
                counters.datagrams_out.fetch_add(1, Ordering::Relaxed);
            }
            send.write_all(format!("sent {count}\n").as_bytes()).await?;
            send.shutdown().await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_parse_strictly() {
        assert_eq!(
            parse_command(b"stream 99943778"),
            Some(Command::Stream(99_943_778))
        );
        assert_eq!(parse_command(b" stream 5 \r"), Some(Command::Stream(5)));
        assert_eq!(
            parse_command(b"datagrams 10 1200"),
            Some(Command::Datagrams {
                count: 10,
                size: 1200
            })
        );
        for bad in [
            &b"stream"[..],
            b"stream -1",
            b"stream 1 2",
            b"datagrams 1",
            b"flood 1",
            b"\xff",
            b"",
        ] {
            assert_eq!(parse_command(bad), None, "{bad:?}");
        }
    }
}
