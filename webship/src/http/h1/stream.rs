//! The HTTP/1.1 driver's connection: rustls until a promotion moves it to kernel TLS,
//! one type for both (reads, writes, and what the driver asks of the socket).

use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::ktls::{KtlsStream, RustlsStream};

/// The fewest bytes of records rustls may hold for the socket: one full TLS record
/// (16 KiB of plaintext), so a write is never cut below a record.
const TLS_PENDING_MIN: usize = 16 * 1024;
/// rustls' own bound on records the socket has not taken (its default).
const TLS_PENDING_MAX: usize = 64 * 1024;

/// The connection's TLS: rustls first, the kernel after a promotion.
#[derive(Debug)]
pub(super) enum Stream {
    Rustls(Box<RustlsStream>),
    Kernel(KtlsStream),
    /// Only during a promotion attempt, never observed by I/O.
    Promoting,
}

impl Stream {
    /// Waits, holding no buffer, until a read will find something: plaintext rustls
    /// already holds, or bytes (or the end) on the socket. Kernel TLS reads go
    /// straight to the read (that connection is busy by construction).
    pub(super) async fn readable(&mut self) -> io::Result<()> {
        let Stream::Rustls(tls) = self else {
            return Ok(());
        };
        crate::http::tls_readable(tls).await
    }

    /// Lets rustls hold at most about `chunk` bytes of records the socket has not
    /// taken ([`TLS_PENDING_MIN`] to rustls' default [`TLS_PENDING_MAX`]): what waits
    /// for a slow client is one chunk sized by the client, not a chunk plus 64 KiB.
    /// Kernel TLS holds nothing of its own.
    pub(super) fn bound_pending(&mut self, chunk: usize) {
        if let Stream::Rustls(tls) = self {
            tls.get_mut()
                .1
                .set_buffer_limit(Some(chunk.clamp(TLS_PENDING_MIN, TLS_PENDING_MAX)));
        }
    }

    pub(super) fn tcp(&self) -> Option<&TcpStream> {
        match self {
            Stream::Rustls(tls) => Some(tls.get_ref().0.get_ref()),
            Stream::Kernel(k) => Some(k.tcp()),
            Stream::Promoting => None,
        }
    }
}

fn promoting() -> io::Error {
    io::Error::other("connection is being promoted")
}

impl AsyncRead for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Rustls(tls) => Pin::new(tls.as_mut()).poll_read(cx, buf),
            Stream::Kernel(k) => Pin::new(k).poll_read(cx, buf),
            Stream::Promoting => Poll::Ready(Err(promoting())),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Rustls(tls) => Pin::new(tls.as_mut()).poll_write(cx, data),
            Stream::Kernel(k) => Pin::new(k).poll_write(cx, data),
            Stream::Promoting => Poll::Ready(Err(promoting())),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Rustls(tls) => Pin::new(tls.as_mut()).poll_write_vectored(cx, bufs),
            Stream::Kernel(k) => Pin::new(k).poll_write_vectored(cx, bufs),
            Stream::Promoting => Poll::Ready(Err(promoting())),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Rustls(tls) => tls.is_write_vectored(),
            Stream::Kernel(k) => k.is_write_vectored(),
            Stream::Promoting => false,
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Rustls(tls) => Pin::new(tls.as_mut()).poll_flush(cx),
            Stream::Kernel(k) => Pin::new(k).poll_flush(cx),
            Stream::Promoting => Poll::Ready(Err(promoting())),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Rustls(tls) => Pin::new(tls.as_mut()).poll_shutdown(cx),
            Stream::Kernel(k) => Pin::new(k).poll_shutdown(cx),
            Stream::Promoting => Poll::Ready(Err(promoting())),
        }
    }
}
