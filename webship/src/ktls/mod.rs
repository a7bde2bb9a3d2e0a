//! Promotion of an HTTP/1.1 TLS connection from rustls to kernel TLS, so the rest of
//! a bulk file response goes out with `sendfile` and never passes through userspace.
//!
//! Design: both directions move to the kernel together (TX and RX keys). rustls'
//! buffered connection can only hand over its secrets by being consumed, so after
//! promotion nothing in userspace could decrypt the client's next request; with RX in
//! the kernel, the next keep-alive request is read as plaintext from the socket.
//! A record of any type but application data (an alert, a TLS 1.3 KeyUpdate from the
//! client) makes the kernel fail the read with `EIO`, and the connection is closed —
//! never misread. Shutdown sends `close_notify` as a real alert record.
//!
//! Two conditions make the handover exact:
//! - nothing may sit in rustls' receive buffers, or it would be lost: every read from
//!   the socket stops at a TLS record boundary ([`RecordBounded`]), so rustls never
//!   holds part of a record, and decrypted-but-unread bytes are drained first;
//! - nothing may sit in rustls' send buffers: the stream is flushed, and rustls itself
//!   refuses to export secrets otherwise.
//!
//! The `tls` ULP is attached before the secrets are extracted, so the only failure
//! that can lose a connection is the kernel refusing keys it accepted at preflight —
//! suites are probed once at start ([`crate::preflight`]) and only those are promoted.

use std::fs::File;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use rustls::{CipherSuite, ConnectionTrafficSecrets, ProtocolVersion};
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;

use crate::sys::{self, KtlsCipher, KtlsDirection, KtlsKeys, KtlsVersion};

static PROMOTIONS: AtomicU64 = AtomicU64::new(0);
static SENDFILE_BYTES: AtomicU64 = AtomicU64::new(0);
static FALLBACKS: AtomicU64 = AtomicU64::new(0);
static LOST: AtomicU64 = AtomicU64::new(0);
/// Bytes read off every terminated TCP connection (TLS records; after a promotion,
/// what the kernel hands over): one relaxed addition per read, for the metrics.
static RECEIVED: AtomicU64 = AtomicU64::new(0);

/// Bytes read off terminated TCP connections so far (see [`RECEIVED`]).
pub(crate) fn received_bytes() -> u64 {
    RECEIVED.load(Ordering::Relaxed)
}

/// Counts what a read added to `buf` since it held `before` bytes.
fn count_read(buf: &ReadBuf<'_>, before: usize) {
    let n = buf.filled().len().saturating_sub(before);
    if n > 0 {
        RECEIVED.fetch_add(n as u64, Ordering::Relaxed);
    }
}

/// Process-wide kTLS counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Counters {
    pub promotions: u64,
    pub sendfile_bytes: u64,
    pub fallbacks: u64,
    /// Connections lost in a promotion (the kernel refused the keys).
    pub lost: u64,
}

pub(crate) fn counters() -> Counters {
    Counters {
        promotions: PROMOTIONS.load(Ordering::Relaxed),
        sendfile_bytes: SENDFILE_BYTES.load(Ordering::Relaxed),
        fallbacks: FALLBACKS.load(Ordering::Relaxed),
        lost: LOST.load(Ordering::Relaxed),
    }
}

/// The kTLS counters as metric families, read at scrape time.
#[derive(Debug)]
pub(crate) struct Metrics;

impl crate::metrics::Collector for Metrics {
    fn collect(&self, out: &mut crate::metrics::Encoder) {
        let c = counters();
        out.family(
            "webship_ktls_promotions",
            crate::metrics::Kind::Counter,
            "HTTP/1.1 promotions to kernel TLS tried, by result (kernel: promoted; stayed: left in rustls; lost: the connection was lost).",
        )
        .sample(&[("result", "kernel")], c.promotions)
        .sample(&[("result", "stayed")], c.fallbacks)
        .sample(&[("result", "lost")], c.lost);
        out.family(
            "webship_ktls_sendfile_bytes",
            crate::metrics::Kind::Counter,
            "Response bytes sent with sendfile over kernel TLS.",
        )
        .sample(&[], c.sendfile_bytes);
    }
}

/// A promotion that lost its connection: counted where it is returned.
fn lost(e: PromoteError) -> Promotion {
    LOST.fetch_add(1, Ordering::Relaxed);
    Promotion::Lost(e)
}

/// The suites preflight found the kernel able to take over (TX and RX).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Support {
    suites: Vec<(KtlsVersion, KtlsCipher)>,
}

impl Support {
    pub(crate) fn new(suites: Vec<(KtlsVersion, KtlsCipher)>) -> Self {
        Self { suites }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.suites.is_empty()
    }

    fn covers(&self, suite: (KtlsVersion, KtlsCipher)) -> bool {
        self.suites.contains(&suite)
    }
}

/// A TCP stream whose reads end at TLS record boundaries, so a TLS library reading
/// from it never buffers part of a record. Writes pass straight through. Once a
/// connection will never be promoted (HTTP/2), [`RecordBounded::unbound`] lifts it.
#[derive(Debug)]
pub(crate) struct RecordBounded<S> {
    inner: S,
    header: [u8; 5],
    header_len: usize,
    /// Body bytes of the current record still to read.
    remaining: usize,
    bounded: bool,
}

impl<S> RecordBounded<S> {
    pub(crate) fn new(inner: S) -> Self {
        Self {
            inner,
            header: [0; 5],
            header_len: 0,
            remaining: 0,
            bounded: true,
        }
    }

    /// Whether a record has been partly read (its rest is still in the kernel).
    pub(crate) fn in_record(&self) -> bool {
        self.header_len > 0 || self.remaining > 0
    }

    pub(crate) fn unbound(&mut self) {
        self.bounded = false;
    }

    pub(crate) fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for RecordBounded<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if !this.bounded {
            let before = buf.filled().len();
            let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
            count_read(buf, before);
            return polled;
        }
        let reading_header = this.remaining == 0;
        let want = if reading_header {
            5 - this.header_len
        } else {
            this.remaining
        };
        let limit = want.min(buf.remaining());
        if limit == 0 {
            return Poll::Ready(Ok(()));
        }
        let dst = buf.initialize_unfilled_to(limit);
        let mut sub = ReadBuf::new(dst);
        ready!(Pin::new(&mut this.inner).poll_read(cx, &mut sub))?;
        let n = sub.filled().len();
        RECEIVED.fetch_add(n as u64, Ordering::Relaxed);
        if reading_header {
            this.header[this.header_len..this.header_len + n].copy_from_slice(sub.filled());
            this.header_len += n;
            if this.header_len == 5 {
                this.remaining = usize::from(u16::from_be_bytes([this.header[3], this.header[4]]));
                this.header_len = 0;
            }
        } else {
            this.remaining -= n;
        }
        buf.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for RecordBounded<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, data)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A rustls stream over a record-bounded socket: what TCP connections start as.
pub(crate) type RustlsStream = TlsStream<RecordBounded<TcpStream>>;

/// Why a connection stayed in rustls.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PromoteError {
    #[error("the negotiated suite is not one the kernel took at preflight")]
    Suite,
    #[error("a TLS record is partly read")]
    MidRecord,
    #[error(transparent)]
    Kernel(#[from] sys::KtlsError),
}

/// A connection whose TLS the kernel does, in both directions.
#[derive(Debug)]
pub(crate) struct KtlsStream {
    tcp: TcpStream,
}

/// The result of a promotion attempt.
#[derive(Debug)]
pub(crate) enum Promotion {
    /// Promoted; the bytes are plaintext rustls had decrypted but nobody had read yet
    /// (the start of a pipelined request), to be consumed before the socket.
    Kernel(KtlsStream, Vec<u8>),
    /// Not promoted; the connection continues in rustls, untouched.
    Stayed(Box<RustlsStream>, PromoteError),
    /// The kernel refused keys after the secrets left rustls: the connection is gone.
    Lost(PromoteError),
}

/// Moves a flushed rustls connection to kernel TLS if `support` covers its suite.
pub(crate) fn promote(tls: RustlsStream, support: &Support) -> Promotion {
    let (io, conn) = tls.get_ref();
    let Some(suite) = conn
        .negotiated_cipher_suite()
        .and_then(|s| map_suite(s.version().version, s.suite()))
    else {
        FALLBACKS.fetch_add(1, Ordering::Relaxed);
        return Promotion::Stayed(Box::new(tls), PromoteError::Suite);
    };
    if !support.covers(suite) {
        FALLBACKS.fetch_add(1, Ordering::Relaxed);
        return Promotion::Stayed(Box::new(tls), PromoteError::Suite);
    }
    if io.in_record() {
        FALLBACKS.fetch_add(1, Ordering::Relaxed);
        return Promotion::Stayed(Box::new(tls), PromoteError::MidRecord);
    }
    if let Err(e) = sys::attach_tls_ulp(io.get_ref()) {
        FALLBACKS.fetch_add(1, Ordering::Relaxed);
        return Promotion::Stayed(Box::new(tls), e.into());
    }
    let (io, mut conn) = tls.into_inner();
    let mut leftover = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        match io::Read::read(&mut conn.reader(), &mut chunk) {
            Ok(0) | Err(_) => break, // WouldBlock: drained; 0: the client sent close_notify
            Ok(n) => leftover.extend_from_slice(&chunk[..n]),
        }
    }
    let secrets = match conn.dangerous_extract_secrets() {
        Ok(s) => s,
        Err(e) => return lost(sys::KtlsError::Refused("rustls", io::Error::other(e)).into()),
    };
    let tcp = io.inner;
    for (direction, (seq, secrets)) in [(KtlsDirection::Tx, secrets.tx), (KtlsDirection::Rx, secrets.rx)] {
        let (key, iv) = match &secrets {
            ConnectionTrafficSecrets::Aes128Gcm { key, iv }
            | ConnectionTrafficSecrets::Aes256Gcm { key, iv }
            | ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => (key.as_ref(), iv.as_ref()),
            _ => return lost(PromoteError::Suite),
        };
        let keys = KtlsKeys {
            version: suite.0,
            cipher: suite.1,
            key,
            iv,
            seq,
        };
        if let Err(e) = sys::set_ktls_keys(&tcp, direction, &keys) {
            return lost(e.into());
        }
    }
    PROMOTIONS.fetch_add(1, Ordering::Relaxed);
    Promotion::Kernel(KtlsStream { tcp }, leftover)
}

fn map_suite(version: ProtocolVersion, suite: CipherSuite) -> Option<(KtlsVersion, KtlsCipher)> {
    let version = match version {
        ProtocolVersion::TLSv1_3 => KtlsVersion::Tls13,
        ProtocolVersion::TLSv1_2 => KtlsVersion::Tls12,
        _ => return None,
    };
    let cipher = match suite {
        CipherSuite::TLS13_AES_128_GCM_SHA256
        | CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256
        | CipherSuite::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256 => KtlsCipher::Aes128Gcm,
        CipherSuite::TLS13_AES_256_GCM_SHA384
        | CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384
        | CipherSuite::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384 => KtlsCipher::Aes256Gcm,
        CipherSuite::TLS13_CHACHA20_POLY1305_SHA256
        | CipherSuite::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256
        | CipherSuite::TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256 => KtlsCipher::Chacha20Poly1305,
        _ => return None,
    };
    Some((version, cipher))
}

impl KtlsStream {
    pub(crate) fn tcp(&self) -> &TcpStream {
        &self.tcp
    }

    /// Sends `len` bytes of `file` from `offset` with `sendfile`: the kernel reads the
    /// page cache and encrypts into TLS records; no byte enters userspace. Each wait
    /// for the client to take more is bounded by `send_timeout`.
    pub(crate) async fn sendfile(
        &self,
        file: &File,
        mut offset: u64,
        len: u64,
        send_timeout: Duration,
    ) -> io::Result<()> {
        /// Per call; large enough that the syscall count does not matter.
        const MAX_CALL: u64 = 16 * 1024 * 1024;
        let end = offset + len;
        while offset < end {
            let count = usize::try_from((end - offset).min(MAX_CALL)).unwrap_or(usize::MAX);
            let sent = tokio::time::timeout(
                send_timeout,
                self.tcp.async_io(Interest::WRITABLE, || {
                    sys::sendfile(&self.tcp, file, &mut offset, count)
                }),
            )
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "client stopped reading"))??;
            if sent == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "file shrank while it was being sent",
                ));
            }
            SENDFILE_BYTES.fetch_add(sent as u64, Ordering::Relaxed);
        }
        Ok(())
    }
}

impl AsyncRead for KtlsStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.tcp).poll_read(cx, buf);
        count_read(buf, before);
        polled
    }
}

impl AsyncWrite for KtlsStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write(cx, data)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Best effort, like rustls' own close_notify: the peer may be gone already.
        let _ = sys::ktls_send_close_notify(&self.tcp);
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn reads_stop_at_record_boundaries() {
        let (mut a, b) = tokio::io::duplex(1 << 16);
        // Two records (5-byte headers, 3 and 2 body bytes) and the start of a third.
        a.write_all(&[23, 3, 3, 0, 3, 1, 2, 3, 23, 3, 3, 0, 2, 4, 5, 23, 3])
            .await
            .unwrap();
        let mut r = RecordBounded::new(b);
        let mut buf = [0u8; 64];
        let mut seen = Vec::new();
        let mut boundaries = Vec::new();
        while seen.len() < 17 {
            let n = r.read(&mut buf).await.unwrap();
            seen.extend_from_slice(&buf[..n]);
            boundaries.push((seen.len(), r.in_record()));
        }
        assert_eq!(seen, [23, 3, 3, 0, 3, 1, 2, 3, 23, 3, 3, 0, 2, 4, 5, 23, 3]);
        // Never a read across a boundary; in_record is false exactly at the ends.
        assert!(boundaries.contains(&(8, false)));
        assert!(boundaries.contains(&(15, false)));
        assert_eq!(boundaries.last(), Some(&(17, true)));
        r.unbound();
        a.write_all(&[9; 10]).await.unwrap();
        let n = r.read(&mut buf).await.unwrap();
        assert_eq!(n, 10, "unbounded reads take what is there");
    }

    #[test]
    fn suites_map_to_kernel_ciphers() {
        assert_eq!(
            map_suite(ProtocolVersion::TLSv1_3, CipherSuite::TLS13_AES_256_GCM_SHA384),
            Some((KtlsVersion::Tls13, KtlsCipher::Aes256Gcm))
        );
        assert_eq!(
            map_suite(
                ProtocolVersion::TLSv1_2,
                CipherSuite::TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256
            ),
            Some((KtlsVersion::Tls12, KtlsCipher::Chacha20Poly1305))
        );
        assert_eq!(
            map_suite(ProtocolVersion::TLSv1_1, CipherSuite::TLS13_AES_128_GCM_SHA256),
            None
        );
    }
}
