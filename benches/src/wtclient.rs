//! `wt-get`: a WebTransport (draft-02 over HTTP/3) client for the diagnostic
//! endpoint's `source` mode, the measuring end of the WebTransport cells.
//!
//! It opens a session with an extended CONNECT (h3), then works on raw QUIC: one
//! bidirectional stream with the WEBTRANSPORT_STREAM header and a command, and the
//! connection's datagrams. `--stream N` reads N bytes back through SHA-256 (the
//! first 99,943,778 are the fixture); `--datagrams COUNT --size SIZE` counts the
//! datagrams that arrive (distinct sequence numbers), so loss is counted at the
//! receiver. Time runs from the command to the last byte (stream) or to the
//! server's `sent` reply (datagrams). Output, on stdout:
//!
//! ```text
//! <payload bytes received> <seconds> <status>
//! <sha256 hex of the stream, or "-">
//! <key=value notes: datagrams_received, datagrams_lost, ...>
//! ```

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use bytes::{Buf, BufMut, BytesMut};
use clap::Args;
use sha2::{Digest, Sha256};
use webship::webtransport::capsule::{put_varint, read_varint};
use webship_testkit::fixture::hex;
use webship_testkit::h3::{H3Client, H3Options};

use crate::h3client::quic_tls;

/// Datagrams the client's QUIC stack may queue before it drops (bytes).
const DATAGRAM_RECEIVE_BUFFER: usize = 32 << 20;
/// How long datagrams may trail the server's `sent` reply.
const DATAGRAM_GRACE: Duration = Duration::from_millis(300);

#[derive(Debug, Args)]
pub(crate) struct WtGetArgs {
    /// Server UDP address, e.g. 127.0.0.1:8443.
    #[arg(long)]
    pub addr: SocketAddr,
    #[arg(long, default_value = "localhost")]
    pub sni: String,
    /// The endpoint's path (the client adds `?mode=source`).
    #[arg(long, default_value = "/wt")]
    pub path: String,
    /// The `Origin` header the session is opened with.
    #[arg(long, default_value = "https://bench.webship")]
    pub origin: String,
    #[arg(long)]
    pub ca: PathBuf,
    /// Bytes to receive on one stream.
    #[arg(long, conflicts_with = "datagrams")]
    pub stream: Option<u64>,
    /// Datagrams to receive.
    #[arg(long)]
    pub datagrams: Option<u64>,
    /// Datagram size (8-byte sequence number included).
    #[arg(long, default_value_t = 1100)]
    pub size: usize,
    #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub max_time: u64,
}

pub(crate) fn run(args: &WtGetArgs) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("building the tokio runtime")?;
    let limit = Duration::from_secs(args.max_time);
    let (bytes, seconds, status, sha, notes) = runtime
        .block_on(async { tokio::time::timeout(limit, session(args)).await })
        .map_err(|_| anyhow!("wt-get {}: not done within {limit:?}", args.addr))??;
    crate::clients::emit(&[&format!("{bytes} {seconds:.6} {status}"), &sha, &notes])
}

type Outcome = (u64, f64, u16, String, String);

async fn session(args: &WtGetArgs) -> Result<Outcome> {
    let options = H3Options {
        datagram_receive_buffer: Some(DATAGRAM_RECEIVE_BUFFER),
        webtransport: true,
        ..H3Options::bulk()
    };
    let tls = quic_tls(&args.ca)?;
    let mut client = H3Client::connect(args.addr, &args.sni, &tls, &options).await?;
    let conn = client.connection().clone();
    let mut request = http::Request::connect(format!(
        "https://{}:{}{}?mode=source",
        args.sni,
        args.addr.port(),
        args.path
    ))
    .header("origin", &args.origin)
    .header("sec-webtransport-http3-draft02", "1")
    .body(())
    .context("building the CONNECT")?;
    request.extensions_mut().insert(h3::ext::Protocol::WEB_TRANSPORT);
    let mut connect = client
        .send
        .send_request(request)
        .await
        .context("sending the CONNECT")?;
    let response = connect
        .recv_response()
        .await
        .context("reading the CONNECT response")?;
    let status = response.status().as_u16();
    if status != 200 {
        bail!("the session was refused: {status}");
    }
    let session = connect.id().into_inner();

    let (mut tx, mut rx) = conn.open_bi().await.context("opening a stream")?;
    let mut header = BytesMut::new();
    put_varint(&mut header, 0x41);
    put_varint(&mut header, session);
    let command = match (args.stream, args.datagrams) {
        (Some(n), _) => format!("stream {n}\n"),
        (None, Some(count)) => format!("datagrams {count} {}\n", args.size),
        (None, None) => bail!("say --stream N or --datagrams COUNT"),
    };
    header.put_slice(command.as_bytes());
    let start = Instant::now();
    tx.write_all(&header).await.context("sending the command")?;
    tx.finish().context("finishing the command stream")?;

    let outcome = if args.stream.is_some() {
        let mut hasher = Sha256::new();
        let mut bytes = 0u64;
        while let Some(chunk) = rx
            .read_chunk(usize::MAX, true)
            .await
            .context("reading the stream")?
        {
            hasher.update(&chunk.bytes);
            bytes += chunk.bytes.len() as u64;
        }
        let seconds = start.elapsed().as_secs_f64();
        (
            bytes,
            seconds,
            status,
            hex(&<[u8; 32]>::from(hasher.finalize())),
            String::new(),
        )
    } else {
        let count = args.datagrams.unwrap_or(0);
        let mut seen = HashSet::new();
        let mut bytes = 0u64;
        let mut reply = String::new();
        let mut last = start;
        let prefix = session / 4;
        let reply_done = async {
            let mut reply = Vec::new();
            while let Some(chunk) = rx.read_chunk(1024, true).await? {
                reply.extend_from_slice(&chunk.bytes);
            }
            Ok::<_, quinn::ReadError>(reply)
        };
        tokio::pin!(reply_done);
        let mut replied = false;
        loop {
            let grace = tokio::time::sleep(if replied {
                DATAGRAM_GRACE
            } else {
                Duration::from_secs(3600)
            });
            tokio::select! {
                r = &mut reply_done, if !replied => {
                    reply = String::from_utf8_lossy(&r.context("reading the reply")?).trim().to_owned();
                    replied = true;
                }
                d = conn.read_datagram() => {
                    let mut d = d.context("reading datagrams")?;
                    let Some((quarter, len)) = read_varint(&d) else { continue };
                    d.advance(len);
                    if quarter != prefix || d.len() < 8 {
                        continue;
                    }
                    let seq = d.get_u64();
                    if seen.insert(seq) {
                        bytes += 8 + d.len() as u64;
                        last = Instant::now();
                    }
                    if seen.len() as u64 == count && replied {
                        break;
                    }
                }
                () = grace => break,
            }
        }
        let seconds = last.duration_since(start).as_secs_f64();
        let received = seen.len() as u64;
        let notes = format!(
            "datagrams_received={received} datagrams_lost={} reply={reply:?}",
            count.saturating_sub(received),
        );
        (bytes, seconds, status, "-".to_owned(), notes)
    };
    drop(connect);
    client.close().await;
    Ok(outcome)
}
