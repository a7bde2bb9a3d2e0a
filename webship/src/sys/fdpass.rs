//! Passing open descriptors between processes (`SCM_RIGHTS` over a Unix socket), and
//! the `SOCK_SEQPACKET` pair a draining process receives its QUIC datagrams through.
//!
//! A binary upgrade hands the listening sockets from the running daemon to its
//! successor on the control connection: one message carries a few descriptors beside
//! the bytes of a JSON line. The receiving side bounds how many it accepts
//! ([`MAX_FDS`]): a message with more is refused (the kernel closes what does not fit
//! the buffer, the rest are closed here), and every received descriptor is
//! close-on-exec (`MSG_CMSG_CLOEXEC`), so none leaks into a child. Descriptors arrive
//! as [`OwnedFd`]s: whatever the caller does not keep closes when dropped.
//!
//! Everything here goes through rustix's safe wrappers, except registering the pair's
//! end with tokio's reactor ([`packet_reader`]), which tokio marks `unsafe`.

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use tokio::io::Interest;
use tokio::net::UnixStream;

/// The most descriptors one message may carry (listener, up to 32 UDP sockets of an
/// HTTP/3 endpoint (`h3_sockets`), datagram pair, pin-folder lock, with room to spare).
pub(crate) const MAX_FDS: usize = 40;

/// Sends `bytes` on `stream` with `fds` attached to the first byte, then the rest of
/// `bytes` if the first write was short. Fails with `InvalidInput` for more than
/// [`MAX_FDS`] descriptors or an empty `bytes` (descriptors need a byte to ride on).
pub(crate) async fn send(stream: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    if fds.len() > MAX_FDS || (bytes.is_empty() && !fds.is_empty()) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "at most 40 descriptors, on at least one byte",
        ));
    }
    let mut sent = 0;
    if !fds.is_empty() {
        sent = loop {
            stream.writable().await?;
            let attempt = stream.try_io(Interest::WRITABLE, || send_once(stream.as_fd(), bytes, fds));
            match attempt {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        };
    }
    while sent < bytes.len() {
        stream.writable().await?;
        match stream.try_write(&bytes[sent..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => sent += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(target_os = "linux")]
fn send_once(fd: BorrowedFd<'_>, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<usize> {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "too many descriptors",
        ));
    }
    let iov = [io::IoSlice::new(bytes)];
    Ok(rustix::net::sendmsg(fd, &iov, &mut control, SendFlags::NOSIGNAL)?)
}

#[cfg(not(target_os = "linux"))]
fn send_once(_fd: BorrowedFd<'_>, _bytes: &[u8], _fds: &[BorrowedFd<'_>]) -> io::Result<usize> {
    Err(io::ErrorKind::Unsupported.into())
}

/// Reads what is there on `stream` (at least one byte, at most `buf.len()`) with the
/// descriptors that came with it. Returns 0 bytes at end of stream.
pub(crate) async fn recv(stream: &UnixStream, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    loop {
        stream.readable().await?;
        match stream.try_io(Interest::READABLE, || recv_once(stream.as_fd(), buf)) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            other => return other,
        }
    }
}

#[cfg(target_os = "linux")]
fn recv_once(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags};
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut iov = [io::IoSliceMut::new(buf)];
    let msg = rustix::net::recvmsg(fd, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC)?;
    let mut fds = Vec::new();
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = message {
            // Owned from here: dropped (closed) with the vector if refused below.
            fds.extend(received);
        }
    }
    if msg.flags.contains(ReturnFlags::CTRUNC) || fds.len() > MAX_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("more than {MAX_FDS} descriptors in one message (all closed)"),
        ));
    }
    Ok((msg.bytes, fds))
}

#[cfg(not(target_os = "linux"))]
fn recv_once(_fd: BorrowedFd<'_>, _buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    Err(io::ErrorKind::Unsupported.into())
}

/// A connected, non-blocking, close-on-exec `SOCK_SEQPACKET` pair: message
/// boundaries kept, delivery in order, and a full receiver makes the sender's
/// non-blocking send fail instead of queueing without bound (unlike `SOCK_DGRAM`
/// pairs, no `net.unix.max_dgram_qlen` of 10 messages).
pub(crate) fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    #[cfg(target_os = "linux")]
    {
        use rustix::net::{socketpair, AddressFamily, SocketFlags, SocketType};
        let flags = SocketFlags::CLOEXEC | SocketFlags::NONBLOCK;
        let (a, b) = socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, flags, None)?;
        for fd in [&a, &b] {
            let _ = rustix::net::sockopt::set_socket_send_buffer_size(fd, 4 * 1024 * 1024);
            let _ = rustix::net::sockopt::set_socket_recv_buffer_size(fd, 4 * 1024 * 1024);
        }
        Ok((a, b))
    }
    #[cfg(not(target_os = "linux"))]
    Err(io::ErrorKind::Unsupported.into())
}

/// Registers a seqpacket socket with the tokio reactor, for [`recv_packet`] when
/// it is readable.
pub(crate) fn packet_reader(fd: OwnedFd) -> io::Result<tokio::io::unix::AsyncFd<OwnedFd>> {
    // SAFETY: an `OwnedFd` is an open descriptor that only it closes, and its
    // `as_raw_fd` always returns that same descriptor; the `AsyncFd` owns it (and so
    // keeps it open) for as long as the registration lives.
    unsafe { tokio::io::unix::AsyncFd::register_with_interest(fd, Interest::READABLE) }.map_err(|e| e.into())
}

/// Sends one message made of `parts` on a seqpacket socket without waiting: a full
/// peer fails with `WouldBlock` (the caller drops the message).
pub(crate) fn send_packet(fd: BorrowedFd<'_>, parts: &[io::IoSlice<'_>]) -> io::Result<usize> {
    #[cfg(target_os = "linux")]
    {
        use rustix::net::{SendAncillaryBuffer, SendFlags};
        let flags = SendFlags::DONTWAIT | SendFlags::NOSIGNAL;
        Ok(rustix::net::sendmsg(
            fd,
            parts,
            &mut SendAncillaryBuffer::default(),
            flags,
        )?)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (fd, parts);
        Err(io::ErrorKind::Unsupported.into())
    }
}

/// Receives one message from a seqpacket socket without waiting. A message longer
/// than `buf` is cut and reported as `InvalidData` (the caller drops it).
pub(crate) fn recv_packet(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    #[cfg(target_os = "linux")]
    {
        use rustix::net::{RecvAncillaryBuffer, RecvFlags, ReturnFlags};
        let mut iov = [io::IoSliceMut::new(buf)];
        let msg = rustix::net::recvmsg(
            fd,
            &mut iov,
            &mut RecvAncillaryBuffer::default(),
            RecvFlags::DONTWAIT,
        )?;
        if msg.flags.contains(ReturnFlags::TRUNC) {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "message cut"));
        }
        Ok(msg.bytes)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (fd, buf);
        Err(io::ErrorKind::Unsupported.into())
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[tokio::test]
    async fn descriptors_travel_with_the_bytes_and_are_bounded() {
        let (a, b) = UnixStream::pair().unwrap();
        let file = tempfile::tempfile().unwrap();
        send(&a, b"{\"x\":1}\n", &[file.as_fd()]).await.unwrap();
        let mut buf = [0u8; 64];
        let (n, fds) = recv(&b, &mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"{\"x\":1}\n");
        assert_eq!(fds.len(), 1);
        let flags = rustix::io::fcntl_getfd(&fds[0]).unwrap();
        assert!(flags.contains(rustix::io::FdFlags::CLOEXEC));

        // More than MAX_FDS is refused before anything is sent.
        let many: Vec<BorrowedFd<'_>> = (0..=MAX_FDS).map(|_| file.as_fd()).collect();
        assert!(send(&a, b"x", &many).await.is_err());
    }

    #[test]
    fn a_full_seqpacket_peer_refuses_instead_of_queueing() {
        let (a, b) = seqpacket_pair().unwrap();
        let payload = [7u8; 1200];
        let mut sent = 0;
        while sent < 100_000 {
            match send_packet(a.as_fd(), &[io::IoSlice::new(b"hdr"), io::IoSlice::new(&payload)]) {
                Ok(_) => sent += 1,
                Err(e) => {
                    assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
                    break;
                }
            }
        }
        assert!(sent > 10 && sent < 100_000, "{sent}");
        let mut buf = [0u8; 2048];
        assert_eq!(recv_packet(b.as_fd(), &mut buf).unwrap(), 1203);
        assert_eq!(&buf[..3], b"hdr");
    }
}
