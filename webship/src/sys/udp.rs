//! `sendmmsg(2)` for QUIC: several UDP messages, each to its own destination, in one
//! system call.
//!
//! Each message carries the control messages quinn-udp sets on its own `sendmsg`: the
//! ECN codepoint (`IP_TOS`, or `IPV6_TCLASS` for an IPv6 destination that is not
//! IPv4-mapped), `UDP_SEGMENT` when the message is a GSO batch of several datagrams,
//! and the source address (`IP_PKTINFO` / `IPV6_PKTINFO`) when the socket is bound to
//! a wildcard address and the connection arrived on a specific one. Everything else
//! (the socket's options, its buffers) is the socket's own.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::ops::Range;
use std::os::fd::BorrowedFd;

/// The most messages one call sends (the rest wait for the next call). Linux accepts
/// up to `UIO_MAXIOV` (1024); 64 already spreads one call over many connections.
pub(crate) const MAX_MESSAGES: usize = 64;

/// One message: `range` of the caller's buffer to `dest`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Message {
    pub(crate) dest: SocketAddr,
    /// The source address to send from (`None`: the kernel chooses).
    pub(crate) src_ip: Option<IpAddr>,
    /// The two ECN bits.
    pub(crate) ecn: u8,
    /// The size of each datagram when the message holds several (GSO); `None`, or a
    /// size not below the message's length, sends one datagram.
    pub(crate) segment_size: Option<u16>,
    pub(crate) range: Range<usize>,
}

impl Message {
    /// The datagrams this message becomes on the wire.
    pub(crate) fn datagrams(&self) -> usize {
        let len = self.range.len();
        match self.segment_size {
            Some(s) if s > 0 && usize::from(s) < len => len.div_ceil(usize::from(s)),
            _ => 1,
        }
    }
}

/// Registers a UDP socket with the tokio reactor for writability, for
/// [`sendmmsg`] on it. Fails outside a tokio runtime.
pub(crate) fn writable_socket(
    socket: std::net::UdpSocket,
) -> io::Result<tokio::io::unix::AsyncFd<std::net::UdpSocket>> {
    tokio::runtime::Handle::try_current().map_err(io::Error::other)?;
    socket.set_nonblocking(true)?;
    // SAFETY: a `UdpSocket` owns an open descriptor that only it closes, and its
    // `as_raw_fd` always returns that descriptor; the `AsyncFd` owns the socket (and
    // so keeps it open) for as long as the registration lives.
    unsafe { tokio::io::unix::AsyncFd::register_with_interest(socket, tokio::io::Interest::WRITABLE) }
        .map_err(|e| e.into())
}

/// What a message the kernel refused says about the next ones (quinn-udp reacts the
/// same way to its own `sendmsg`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// `EMSGSIZE`: larger than the path allows, as path MTU probes may be; expected.
    TooLarge,
    /// `EIO`: with `UDP_SEGMENT`, the device cannot segment (GSO unusable).
    Device,
    /// `EINVAL`: a control message the kernel or device does not accept (the ECN
    /// codepoint, or `UDP_SEGMENT`).
    Invalid,
    Other,
}

pub(crate) fn refusal(e: &io::Error) -> Refusal {
    imp::refusal(e)
}

/// Sends up to [`MAX_MESSAGES`] of `msgs`, whose bytes are in `buf`, and returns how
/// many left; `tos`: whether each carries its ECN codepoint (`IP_TOS`/`IPV6_TCLASS`).
/// An error means the first message did not (`WouldBlock` when the
/// socket's send buffer is full; any other error is that message's own).
pub(crate) fn sendmmsg(fd: BorrowedFd<'_>, buf: &[u8], msgs: &[Message], tos: bool) -> io::Result<usize> {
    if msgs.iter().any(|m| buf.get(m.range.clone()).is_none()) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "a message lies outside its buffer",
        ));
    }
    match imp::sendmmsg(fd, buf, &msgs[..msgs.len().min(MAX_MESSAGES)], tos)? {
        // Linux reports a first message it did not take as an error, never as 0; if
        // it ever did, calling again must not spin: the socket is taken as full.
        0 if !msgs.is_empty() => Err(io::ErrorKind::WouldBlock.into()),
        n => Ok(n),
    }
}

/// The MTU of the kernel's route from `local` (the address a connection arrived on,
/// if known) to `peer`, as `IP_MTU`/`IPV6_MTU` reports it: a UDP socket of the peer's
/// family, bound to `local` so the kernel picks the route replies take, `connect`ed
/// to `peer` (nothing is sent), asked, and closed. The addresses are those
/// [`super::route::endpoints`] gives (IPv4-mapped as IPv4, an IPv6 scope kept).
pub(crate) fn route_mtu(local: Option<IpAddr>, peer: SocketAddr) -> io::Result<u32> {
    let (local, peer) = super::route::endpoints(local, peer);
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(peer),
        socket2::Type::DGRAM,
        Some(socket2::Protocol::UDP),
    )?;
    if let Some(ip) = local {
        socket.bind(&SocketAddr::new(ip, 0).into())?;
    }
    socket.connect(&peer.into())?;
    imp::path_mtu(&socket, peer.is_ipv6())
}

#[cfg(target_os = "linux")]
mod imp {
    use std::io;
    use std::mem::{size_of, zeroed};
    use std::net::{IpAddr, SocketAddr};
    use std::os::fd::{AsRawFd, BorrowedFd};

    use super::{Message, MAX_MESSAGES};

    /// Room for the three control messages (TOS/TCLASS, UDP_SEGMENT, PKTINFO), each
    /// `CMSG_SPACE` of its payload: 24 + 24 + 40 = 88 bytes at most on 64-bit Linux.
    const CONTROL_BYTES: usize = 96;

    /// A control buffer aligned for `cmsghdr`.
    #[derive(Clone, Copy)]
    #[repr(C, align(8))]
    struct Control([u8; CONTROL_BYTES]);

    /// Writes control messages one after another into a [`Control`].
    struct Cmsgs<'a> {
        buf: &'a mut Control,
        used: usize,
    }

    impl Cmsgs<'_> {
        fn push<T: Copy>(&mut self, level: libc::c_int, kind: libc::c_int, value: T) {
            let payload = u32::try_from(size_of::<T>()).unwrap_or(u32::MAX);
            // SAFETY: CMSG_SPACE and CMSG_LEN are pure arithmetic on the length.
            let (space, len) = unsafe { (libc::CMSG_SPACE(payload), libc::CMSG_LEN(payload)) };
            let space = space as usize;
            // The three payloads are fixed-size types; CONTROL_BYTES holds all of them.
            assert!(self.used + space <= CONTROL_BYTES, "control buffer too small");
            // SAFETY: `used` is a multiple of the cmsghdr alignment (each step is a
            // CMSG_SPACE) and the buffer is 8-aligned, so `hdr` is aligned; the assert
            // above keeps the header and its payload inside the buffer. The payload is
            // written unaligned-safe.
            unsafe {
                let hdr = self.buf.0.as_mut_ptr().add(self.used).cast::<libc::cmsghdr>();
                (*hdr).cmsg_level = level;
                (*hdr).cmsg_type = kind;
                (*hdr).cmsg_len = len as _;
                std::ptr::write_unaligned(libc::CMSG_DATA(hdr).cast::<T>(), value);
            }
            self.used += space;
        }
    }

    pub(super) fn refusal(e: &io::Error) -> super::Refusal {
        match e.raw_os_error() {
            Some(libc::EMSGSIZE) => super::Refusal::TooLarge,
            Some(libc::EIO) => super::Refusal::Device,
            Some(libc::EINVAL) => super::Refusal::Invalid,
            _ => super::Refusal::Other,
        }
    }

    fn controls(m: &Message, buf: &mut Control, tos: bool) -> usize {
        let mut c = Cmsgs { buf, used: 0 };
        let ecn = libc::c_int::from(m.ecn & 0b11);
        let v4 = match m.dest.ip() {
            IpAddr::V4(_) => true,
            IpAddr::V6(a) => a.to_ipv4_mapped().is_some(),
        };
        if tos && v4 {
            c.push(libc::IPPROTO_IP, libc::IP_TOS, ecn);
        } else if tos {
            c.push(libc::IPPROTO_IPV6, libc::IPV6_TCLASS, ecn);
        }
        if let Some(s) = m.segment_size.filter(|&s| usize::from(s) < m.range.len()) {
            c.push(libc::SOL_UDP, libc::UDP_SEGMENT, s);
        }
        match m.src_ip {
            Some(IpAddr::V4(ip)) => c.push(
                libc::IPPROTO_IP,
                libc::IP_PKTINFO,
                libc::in_pktinfo {
                    ipi_ifindex: 0,
                    ipi_spec_dst: libc::in_addr {
                        s_addr: u32::from_ne_bytes(ip.octets()),
                    },
                    ipi_addr: libc::in_addr { s_addr: 0 },
                },
            ),
            Some(IpAddr::V6(ip)) => c.push(
                libc::IPPROTO_IPV6,
                libc::IPV6_PKTINFO,
                libc::in6_pktinfo {
                    ipi6_addr: libc::in6_addr { s6_addr: ip.octets() },
                    ipi6_ifindex: 0,
                },
            ),
            None => {}
        }
        c.used
    }

    pub(super) fn sendmmsg(fd: BorrowedFd<'_>, buf: &[u8], msgs: &[Message], tos: bool) -> io::Result<usize> {
        let n = msgs.len().min(MAX_MESSAGES);
        if n == 0 {
            return Ok(0);
        }
        let mut names: [socket2::SockAddr; MAX_MESSAGES] =
            std::array::from_fn(|_| socket2::SockAddr::from(SocketAddr::from(([0, 0, 0, 0], 0))));
        let mut control = [Control([0; CONTROL_BYTES]); MAX_MESSAGES];
        // SAFETY: iovec and mmsghdr are plain C structs for which all-zero is valid
        // (null pointers, zero lengths).
        let mut iovs: [libc::iovec; MAX_MESSAGES] = unsafe { zeroed() };
        // SAFETY: as above.
        let mut hdrs: [libc::mmsghdr; MAX_MESSAGES] = unsafe { zeroed() };
        for (i, m) in msgs.iter().take(n).enumerate() {
            let bytes = &buf[m.range.clone()];
            names[i] = socket2::SockAddr::from(m.dest);
            iovs[i] = libc::iovec {
                iov_base: bytes.as_ptr().cast_mut().cast(),
                iov_len: bytes.len(),
            };
            let controllen = controls(m, &mut control[i], tos);
            let h = &mut hdrs[i].msg_hdr;
            // sendmmsg only reads the name, the iovec and the control data, so the
            // mutable pointers the C struct wants are never written through.
            h.msg_name = names[i].as_ptr().cast_mut().cast();
            h.msg_namelen = names[i].len();
            h.msg_iov = &mut iovs[i];
            h.msg_iovlen = 1;
            h.msg_control = control[i].0.as_mut_ptr().cast();
            h.msg_controllen = controllen as _;
        }
        loop {
            // SAFETY: `hdrs[..n]` point into `names`, `iovs` and `control`, which
            // outlive the call, and each iovec into `buf` within its bounds (checked by
            // the caller); `n` ≤ MAX_MESSAGES fits the array and a c_uint.
            let sent = unsafe { libc::sendmmsg(fd.as_raw_fd(), hdrs.as_mut_ptr(), n as _, 0) };
            if sent >= 0 {
                return Ok(sent as usize);
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    /// `IP_MTU` (`IPV6_MTU` with `ipv6`) of a connected socket: its route's MTU.
    pub(super) fn path_mtu(socket: &socket2::Socket, ipv6: bool) -> io::Result<u32> {
        let (level, name) = if ipv6 {
            (libc::IPPROTO_IPV6, libc::IPV6_MTU)
        } else {
            (libc::IPPROTO_IP, libc::IP_MTU)
        };
        let mut mtu: libc::c_int = 0;
        let mut len = size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: the descriptor is the open socket `socket` borrows for the call;
        // `mtu` and `len` are live locals and `len` holds `mtu`'s size, so the kernel
        // writes at most that many bytes into `mtu`.
        let rc = unsafe {
            libc::getsockopt(
                socket.as_raw_fd(),
                level,
                name,
                (&raw mut mtu).cast(),
                &raw mut len,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        u32::try_from(mtu).map_err(|_| io::Error::other("negative route MTU"))
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    use std::io;
    use std::os::fd::BorrowedFd;

    use super::Message;

    pub(super) fn sendmmsg(_: BorrowedFd<'_>, _: &[u8], _: &[Message], _: bool) -> io::Result<usize> {
        Err(io::ErrorKind::Unsupported.into())
    }

    pub(super) fn refusal(_: &io::Error) -> super::Refusal {
        super::Refusal::Other
    }

    pub(super) fn path_mtu(_: &socket2::Socket, _: bool) -> io::Result<u32> {
        Err(io::ErrorKind::Unsupported.into())
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    /// The route to a loopback peer is `lo`'s (65536 on Linux, as `ip link show lo`
    /// says; IPv4 reports 65535, its largest packet): above any Ethernet MTU, from
    /// either family, a dual-stack socket's mapped address, with or without the
    /// local address; a local address that is not this host's is an error (unless
    /// the host allows binding to foreign addresses).
    #[test]
    fn the_route_mtu_to_loopback_is_lo_s() {
        let v4: SocketAddr = "127.0.0.1:443".parse().unwrap();
        let mapped: SocketAddr = "[::ffff:127.0.0.1]:443".parse().unwrap();
        let v6: SocketAddr = "[::1]:443".parse().unwrap();
        let lo = route_mtu(None, v4).unwrap();
        assert!(lo > 1500, "{lo}");
        assert_eq!(route_mtu(Some("127.0.0.1".parse().unwrap()), v4).unwrap(), lo);
        assert_eq!(
            route_mtu(Some("::ffff:127.0.0.1".parse().unwrap()), mapped).unwrap(),
            lo
        );
        assert_eq!(route_mtu(Some("::".parse().unwrap()), mapped).unwrap(), lo);
        if std::net::UdpSocket::bind("[::1]:0").is_ok() {
            assert!(route_mtu(Some("::1".parse().unwrap()), v6).unwrap() > 1500);
        }
        // Not an address of this host: the bind fails, and the caller falls back.
        if std::net::UdpSocket::bind("192.0.2.1:0").is_err() {
            assert!(route_mtu(Some("192.0.2.1".parse().unwrap()), v4).is_err());
        }
    }

    #[test]
    fn one_call_reaches_two_destinations_and_splits_gso_batches() {
        let a = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let b = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let tx = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let buf = b"aaaaabbbbbcc0123456789";
        let msg = |dest, range, segment_size| Message {
            dest,
            src_ip: Some("127.0.0.1".parse().unwrap()),
            ecn: 2,
            segment_size,
            range,
        };
        let msgs = [
            msg(a.local_addr().unwrap(), 0..12, Some(5)),
            msg(b.local_addr().unwrap(), 12..22, None),
        ];
        assert_eq!(msgs[0].datagrams(), 3);
        assert_eq!(sendmmsg(tx.as_fd(), buf, &msgs, true).unwrap(), 2);
        let mut got = [0u8; 64];
        for want in [&b"aaaaa"[..], b"bbbbb", b"cc"] {
            let n = a.recv(&mut got).unwrap();
            assert_eq!(&got[..n], want);
        }
        let n = b.recv(&mut got).unwrap();
        assert_eq!(&got[..n], b"0123456789");
        let outside = [msg(a.local_addr().unwrap(), 20..30, None)];
        assert_eq!(
            sendmmsg(tx.as_fd(), buf, &outside, false).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
    }
}
