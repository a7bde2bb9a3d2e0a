//! Whether a peer sits on the link the kernel's route to it leaves by: an
//! rtnetlink route query (what `ip route get <peer> from <local>` asks) and the
//! outgoing device's flags (`SIOCGIFNAME`, `SIOCGIFFLAGS`).
//!
//! HTTP/3's `h3_mtu_upper_bound_bytes = "auto"` needs it: a route's MTU is its first
//! hop's, which is the whole path's only when the peer is on that link (or is this
//! host). Behind a gateway, or at the far end of a point-to-point tunnel, the path
//! crosses links this host cannot see.
//!
//! Nothing here waits or takes the kernel's RTNL lock (the accept loop calls it):
//! the kernel answers a route query within the `sendto` that asks it, without the
//! lock, so the reply is read with `MSG_DONTWAIT` (no reply there is an error); the
//! two ioctls read the device under RCU. (An `RTM_GETLINK` query would take the
//! lock.)

use std::io;
use std::net::{IpAddr, SocketAddr, SocketAddrV6};

/// The addresses a route lookup from `local` (the address a connection arrived on,
/// if known) to `peer` asks about: IPv4-mapped IPv6 addresses as IPv4 (a dual-stack
/// socket's view of an IPv4 peer), an IPv6 peer's scope kept (a link-local peer is
/// on the interface it names), and `local` only when it is a specified address of
/// the peer's family that can be bound without a scope (not an IPv6 link-local
/// one: the peer's scope already names the device). Both [`on_link`] and
/// [`super::udp::route_mtu`] ask this.
pub(crate) fn endpoints(local: Option<IpAddr>, peer: SocketAddr) -> (Option<IpAddr>, SocketAddr) {
    let peer = match peer {
        SocketAddr::V6(v6) if v6.ip().to_ipv4_mapped().is_none() => {
            SocketAddr::V6(SocketAddrV6::new(*v6.ip(), v6.port(), 0, v6.scope_id()))
        }
        other => SocketAddr::new(other.ip().to_canonical(), other.port()),
    };
    let local = local.map(|ip| ip.to_canonical()).filter(|ip| {
        let link_local = matches!(ip, IpAddr::V6(a) if a.segments()[0] & 0xffc0 == 0xfe80);
        !ip.is_unspecified() && !link_local && ip.is_ipv4() == peer.is_ipv4()
    });
    (local, peer)
}

/// Whether `peer` is on the link the route from `local` leaves by, so that link's
/// MTU is the path's: this host's own address (a local route), or a unicast route
/// with no gateway (`RTA_GATEWAY`, `RTA_VIA`, a multipath next hop) out of a device
/// that has neighbours (not point-to-point, not `NOARP`: a tunnel's far end is
/// further away than its MTU says). Unspecified, multicast and broadcast peers are
/// never on a link.
pub(crate) fn on_link(local: Option<IpAddr>, peer: SocketAddr) -> io::Result<bool> {
    let (local, peer) = endpoints(local, peer);
    let odd = match peer.ip() {
        IpAddr::V4(a) => a.is_unspecified() || a.is_multicast() || a.is_broadcast(),
        IpAddr::V6(a) => a.is_unspecified() || a.is_multicast(),
    };
    if odd {
        return Ok(false);
    }
    let scope = match peer {
        SocketAddr::V6(v6) if v6.scope_id() != 0 => Some(v6.scope_id()),
        _ => None,
    };
    let route = imp::route(local, peer.ip(), scope)?;
    Ok(match route.kind {
        wire::Kind::Local => true,
        wire::Kind::Unicast if !route.via_gateway => match route.device {
            Some(index) => has_neighbours(imp::device_flags(index)?),
            None => false,
        },
        _ => false,
    })
}

/// `IFF_POINTOPOINT` and `IFF_NOARP` (`linux/if.h`).
const IFF_POINTOPOINT: u32 = 0x10;
const IFF_NOARP: u32 = 0x80;

/// Whether a device with these flags has neighbours on its link: not a
/// point-to-point device and not one without ARP (tunnels: their far end can be
/// anywhere, whatever their MTU).
fn has_neighbours(flags: u32) -> bool {
    flags & (IFF_POINTOPOINT | IFF_NOARP) == 0
}

/// The rtnetlink wire format of a route query, as `linux/netlink.h` and
/// `linux/rtnetlink.h` define it (native byte order): pure functions, so the parsing
/// is tested on bytes.
mod wire {
    use std::io;
    use std::net::IpAddr;

    const NLMSG_ERROR: u16 = 2;
    const RTM_NEWROUTE: u16 = 24;
    const RTM_GETROUTE: u16 = 26;
    const NLM_F_REQUEST: u16 = 1;
    const RTA_DST: u16 = 1;
    const RTA_SRC: u16 = 2;
    const RTA_OIF: u16 = 4;
    const RTA_GATEWAY: u16 = 5;
    const RTA_MULTIPATH: u16 = 9;
    const RTA_VIA: u16 = 18;
    const RTN_UNICAST: u8 = 1;
    const RTN_LOCAL: u8 = 2;
    const AF_INET: u8 = 2;
    const AF_INET6: u8 = 10;

    /// `struct nlmsghdr`: length, type, flags, sequence, port id.
    const HEADER: usize = 16;
    /// `struct rtmsg`: family, dst_len, src_len, tos, table, protocol, scope, type,
    /// flags.
    const RTMSG: usize = 12;
    /// `struct rtattr`: length, type; payloads are padded to 4 bytes.
    const ATTR: usize = 4;

    /// What kind of route the kernel chose (`rtm_type`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(super) enum Kind {
        Unicast,
        /// One of this host's own addresses.
        Local,
        /// Broadcast, multicast, blackhole, unreachable and the rest.
        Other,
    }

    /// The parts of a route lookup's answer [`super::on_link`] reads.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(super) struct Route {
        pub kind: Kind,
        /// A router in between: `RTA_GATEWAY`, `RTA_VIA` or multipath next hops.
        pub via_gateway: bool,
        /// The outgoing device's index (`RTA_OIF`).
        pub device: Option<u32>,
    }

    fn align4(n: usize) -> usize {
        (n + 3) & !3
    }

    fn octets(ip: IpAddr) -> Vec<u8> {
        match ip {
            IpAddr::V4(a) => a.octets().to_vec(),
            IpAddr::V6(a) => a.octets().to_vec(),
        }
    }

    fn attr(out: &mut Vec<u8>, kind: u16, payload: &[u8]) {
        let len = ATTR + payload.len();
        out.extend_from_slice(&(len as u16).to_ne_bytes());
        out.extend_from_slice(&kind.to_ne_bytes());
        out.extend_from_slice(payload);
        out.resize(align4(out.len()), 0);
    }

    /// Fills in the header of a request whose body follows it in `out`.
    fn seal(mut out: Vec<u8>, kind: u16, seq: u32) -> Vec<u8> {
        let len = out.len() as u32;
        out[0..4].copy_from_slice(&len.to_ne_bytes());
        out[4..6].copy_from_slice(&kind.to_ne_bytes());
        out[6..8].copy_from_slice(&NLM_F_REQUEST.to_ne_bytes());
        out[8..12].copy_from_slice(&seq.to_ne_bytes());
        out
    }

    /// An `RTM_GETROUTE` request for the route from `local` to `peer` (both of one
    /// family: the caller's duty), out of device `oif` when the peer's scope names
    /// one.
    pub(super) fn route_request(seq: u32, local: Option<IpAddr>, peer: IpAddr, oif: Option<u32>) -> Vec<u8> {
        let (family, bits) = if peer.is_ipv4() {
            (AF_INET, 32)
        } else {
            (AF_INET6, 128)
        };
        let mut out = vec![0; HEADER];
        out.extend_from_slice(&[family, bits, if local.is_some() { bits } else { 0 }]);
        out.resize(HEADER + RTMSG, 0);
        attr(&mut out, RTA_DST, &octets(peer));
        if let Some(ip) = local {
            attr(&mut out, RTA_SRC, &octets(ip));
        }
        if let Some(index) = oif {
            attr(&mut out, RTA_OIF, &index.to_ne_bytes());
        }
        seal(out, RTM_GETROUTE, seq)
    }

    fn u16_at(b: &[u8], at: usize) -> Option<u16> {
        Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
    }

    fn u32_at(b: &[u8], at: usize) -> Option<u32> {
        Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
    }

    fn malformed(what: &str) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidData, format!("rtnetlink: {what}"))
    }

    /// The body of the reply to request `seq` if it is a message of type `want`;
    /// the kernel's error (`NLMSG_ERROR`) as the error it names; `InvalidData` for
    /// anything else, a reply cut short included.
    fn body(seq: u32, want: u16, b: &[u8]) -> io::Result<&[u8]> {
        let len = u32_at(b, 0).ok_or_else(|| malformed("short reply"))? as usize;
        let kind = u16_at(b, 4).ok_or_else(|| malformed("short reply"))?;
        if u32_at(b, 8) != Some(seq) {
            return Err(malformed("a reply to another request"));
        }
        let body = b
            .get(HEADER..len)
            .ok_or_else(|| malformed("bad message length"))?;
        match kind {
            NLMSG_ERROR => {
                let code = u32_at(body, 0).ok_or_else(|| malformed("short error"))? as i32;
                // 0 would be an acknowledgement, which the request does not ask for.
                Err(match code {
                    0 => malformed("an acknowledgement instead of an answer"),
                    n => io::Error::from_raw_os_error(n.saturating_neg()),
                })
            }
            k if k == want => Ok(body),
            other => Err(malformed(&format!("unexpected message type {other}"))),
        }
    }

    /// Reads the kernel's answer to route request `seq`.
    pub(super) fn route_answer(seq: u32, b: &[u8]) -> io::Result<Route> {
        let body = body(seq, RTM_NEWROUTE, b)?;
        let kind = match *body.get(7).ok_or_else(|| malformed("short route"))? {
            RTN_UNICAST => Kind::Unicast,
            RTN_LOCAL => Kind::Local,
            _ => Kind::Other,
        };
        let mut route = Route {
            kind,
            via_gateway: false,
            device: None,
        };
        let mut at = RTMSG;
        while at + ATTR <= body.len() {
            let alen = usize::from(u16_at(body, at).unwrap_or(0));
            if alen < ATTR || at + alen > body.len() {
                return Err(malformed("bad attribute length"));
            }
            match u16_at(body, at + 2) {
                Some(RTA_GATEWAY | RTA_VIA | RTA_MULTIPATH) => route.via_gateway = true,
                Some(RTA_OIF) => route.device = u32_at(body, at + ATTR).filter(|_| alen >= ATTR + 4),
                _ => {}
            }
            at += align4(alen);
        }
        Ok(route)
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        fn reply(seq: u32, kind: u16, body: &[u8]) -> Vec<u8> {
            let mut b = Vec::new();
            b.extend_from_slice(&((HEADER + body.len()) as u32).to_ne_bytes());
            b.extend_from_slice(&kind.to_ne_bytes());
            b.extend_from_slice(&0u16.to_ne_bytes());
            b.extend_from_slice(&seq.to_ne_bytes());
            b.extend_from_slice(&0u32.to_ne_bytes());
            b.extend_from_slice(body);
            b
        }

        fn route(rtm_type: u8, attrs: &[(u16, &[u8])]) -> Vec<u8> {
            let mut body = vec![AF_INET, 32, 0, 0, 254, 0, 0, rtm_type, 0, 0, 0, 0];
            for (kind, payload) in attrs {
                attr(&mut body, *kind, payload);
            }
            body
        }

        #[test]
        fn a_request_carries_the_destination_the_source_and_the_device() {
            let peer: IpAddr = "2001:db8::7".parse().unwrap();
            let local: IpAddr = "2001:db8::1".parse().unwrap();
            let b = route_request(9, Some(local), peer, Some(3));
            assert_eq!(b.len(), HEADER + RTMSG + 2 * (ATTR + 16) + ATTR + 4);
            assert_eq!(u32_at(&b, 0), Some(b.len() as u32));
            assert_eq!(u16_at(&b, 4), Some(RTM_GETROUTE));
            assert_eq!(u32_at(&b, 8), Some(9));
            assert_eq!(&b[HEADER..HEADER + 3], &[AF_INET6, 128, 128]);
            assert_eq!(u16_at(&b, HEADER + RTMSG + 2), Some(RTA_DST));
            assert_eq!(
                &b[HEADER + RTMSG + ATTR..HEADER + RTMSG + ATTR + 16],
                &octets(peer)[..]
            );
            assert_eq!(u16_at(&b, b.len() - 6), Some(RTA_OIF));
            assert_eq!(u32_at(&b, b.len() - 4), Some(3));
            let b = route_request(1, None, "10.0.0.1".parse().unwrap(), None);
            assert_eq!(b.len(), HEADER + RTMSG + ATTR + 4);
            assert_eq!(&b[HEADER..HEADER + 3], &[AF_INET, 32, 0]);
        }

        #[test]
        fn gateways_devices_and_route_kinds_are_read() {
            let oif: &[u8] = &3u32.to_ne_bytes();
            let direct = route(RTN_UNICAST, &[(RTA_DST, &[10, 0, 0, 7]), (RTA_OIF, oif)]);
            assert_eq!(
                route_answer(5, &reply(5, RTM_NEWROUTE, &direct)).unwrap(),
                Route {
                    kind: Kind::Unicast,
                    via_gateway: false,
                    device: Some(3)
                }
            );
            for kind in [RTA_GATEWAY, RTA_VIA, RTA_MULTIPATH] {
                let via = route(
                    RTN_UNICAST,
                    &[(RTA_DST, &[10, 0, 0, 7]), (kind, &[10, 0, 0, 1]), (RTA_OIF, oif)],
                );
                assert!(
                    route_answer(5, &reply(5, RTM_NEWROUTE, &via))
                        .unwrap()
                        .via_gateway,
                    "{kind}"
                );
            }
            let local = route(RTN_LOCAL, &[(RTA_DST, &[127, 0, 0, 1])]);
            assert_eq!(
                route_answer(5, &reply(5, RTM_NEWROUTE, &local)).unwrap().kind,
                Kind::Local
            );
            for other in [0, 3, 5, 6, 7] {
                let r = route(other, &[(RTA_OIF, oif)]);
                assert_eq!(
                    route_answer(5, &reply(5, RTM_NEWROUTE, &r)).unwrap().kind,
                    Kind::Other,
                    "{other}"
                );
            }
        }

        #[test]
        fn errors_and_garbage_are_errors_not_answers() {
            let refused = reply(2, NLMSG_ERROR, &(-libc::ENETUNREACH).to_ne_bytes());
            assert_eq!(
                route_answer(2, &refused).unwrap_err().raw_os_error(),
                Some(libc::ENETUNREACH)
            );
            assert!(route_answer(2, &reply(2, NLMSG_ERROR, &0i32.to_ne_bytes())).is_err());
            let good = reply(3, RTM_NEWROUTE, &route(RTN_UNICAST, &[]));
            assert!(route_answer(4, &good).is_err(), "another request's reply");
            assert!(body(3, 99, &good).is_err(), "not the type asked for");
            for cut in 0..good.len() {
                assert!(route_answer(3, &good[..cut]).is_err(), "cut at {cut}");
            }
            let mut bad_attr = route(RTN_UNICAST, &[(RTA_DST, &[10, 0, 0, 7])]);
            bad_attr[RTMSG..RTMSG + 2].copy_from_slice(&200u16.to_ne_bytes());
            assert!(route_answer(3, &reply(3, RTM_NEWROUTE, &bad_attr)).is_err());
            bad_attr[RTMSG..RTMSG + 2].copy_from_slice(&2u16.to_ne_bytes());
            assert!(route_answer(3, &reply(3, RTM_NEWROUTE, &bad_attr)).is_err());
            assert!(route_answer(3, &reply(3, 99, &route(RTN_UNICAST, &[]))).is_err());
            let mut short = reply(3, RTM_NEWROUTE, &route(RTN_UNICAST, &[]));
            short[0..4].copy_from_slice(&8u32.to_ne_bytes());
            assert!(route_answer(3, &short).is_err(), "a length under the header's");
        }
    }
}

#[cfg(target_os = "linux")]
mod imp {
    use std::io;
    use std::net::IpAddr;
    use std::os::fd::{AsRawFd, OwnedFd};
    use std::sync::atomic::{AtomicU32, Ordering};

    use rustix::net::netlink::SocketAddrNetlink;
    use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketFlags, SocketType};

    use super::wire;

    /// Room for one route reply: a few hundred bytes; a longer one is refused.
    const REPLY_BYTES: usize = 4096;

    static SEQ: AtomicU32 = AtomicU32::new(1);

    pub(super) fn route(local: Option<IpAddr>, peer: IpAddr, oif: Option<u32>) -> io::Result<wire::Route> {
        // `None`: NETLINK_ROUTE, the family's protocol 0.
        let fd: OwnedFd = rustix::net::socket_with(
            AddressFamily::NETLINK,
            SocketType::DGRAM,
            SocketFlags::CLOEXEC,
            None,
        )?;
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        let request = wire::route_request(seq, local, peer, oif);
        rustix::net::sendto(&fd, &request, SendFlags::empty(), &SocketAddrNetlink::new(0, 0))?;
        let mut reply = [0u8; REPLY_BYTES];
        let (got, whole) = rustix::net::recv(&fd, &mut reply[..], RecvFlags::DONTWAIT | RecvFlags::TRUNC)?;
        if whole > got {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "rtnetlink: route reply truncated",
            ));
        }
        wire::route_answer(seq, &reply[..got])
    }

    /// The flags of device `index` (`IFF_*`): its name by `SIOCGIFNAME`, then
    /// `SIOCGIFFLAGS`, on a throwaway UDP socket of this namespace. A device renamed
    /// between the two calls answers for whatever now has the name, or fails.
    pub(super) fn device_flags(index: u32) -> io::Result<u32> {
        let socket =
            rustix::net::socket_with(AddressFamily::INET, SocketType::DGRAM, SocketFlags::CLOEXEC, None)?;
        let name = rustix::net::netdevice::index_to_name(&socket, index)?;
        // SAFETY: `ifreq` is plain data (a name and a union of integers and
        // addresses), for which all zeroes is a valid value.
        let mut request: libc::ifreq = unsafe { std::mem::zeroed() };
        // Names are under IFNAMSIZ bytes; the last byte stays the terminating NUL.
        let room = request.ifr_name.len() - 1;
        if name.len() > room {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "device name too long"));
        }
        for (slot, byte) in request.ifr_name.iter_mut().zip(name.bytes()) {
            *slot = byte as libc::c_char;
        }
        // SAFETY: SIOCGIFFLAGS reads the NUL-terminated name and writes the flags
        // into the `ifreq` it is given, which lives for the call; the socket is
        // open for the call.
        let rc = unsafe { libc::ioctl(socket.as_raw_fd(), libc::SIOCGIFFLAGS, &mut request) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: SIOCGIFFLAGS succeeded, so the union holds `ifru_flags`.
        let flags = unsafe { request.ifr_ifru.ifru_flags };
        Ok(u32::from(flags as u16))
    }

    /// Moves the calling thread into a network namespace of its own; processes the
    /// thread starts afterwards are inside it too. The caller must be a thread of
    /// its own that ends afterwards (never a pool's or a runtime's): the namespace,
    /// and every device made in it, goes away with the thread.
    #[cfg(test)]
    pub(crate) fn enter_own_network_namespace() -> io::Result<()> {
        // SAFETY: only CLONE_NEWNET: the file table and filesystem context, which
        // `unshare_unsafe` warns about, stay shared with the other threads.
        unsafe { rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::NEWNET) }?;
        Ok(())
    }
}

#[cfg(test)]
pub(crate) use imp::enter_own_network_namespace;

#[cfg(not(target_os = "linux"))]
mod imp {
    use std::io;
    use std::net::IpAddr;

    use super::wire;

    pub(super) fn route(_: Option<IpAddr>, _: IpAddr, _: Option<u32>) -> io::Result<wire::Route> {
        Err(io::ErrorKind::Unsupported.into())
    }

    pub(super) fn device_flags(_: u32) -> io::Result<u32> {
        Err(io::ErrorKind::Unsupported.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn point_to_point_and_noarp_devices_have_no_neighbours() {
        // UP|BROADCAST|RUNNING|MULTICAST, an Ethernet or veth device.
        assert!(has_neighbours(0x1043));
        // A TUN device: UP|POINTOPOINT|NOARP|MULTICAST; a GRE tunnel: UP|NOARP.
        assert!(!has_neighbours(0x10d1));
        assert!(!has_neighbours(0x81));
        assert!(!has_neighbours(0x1043 | IFF_POINTOPOINT));
    }

    /// The device flags of this namespace's loopback: read, and not a tunnel's.
    #[test]
    fn device_flags_are_read_from_the_kernel() {
        let lo = imp::device_flags(1).unwrap();
        assert_ne!(lo & 0x8, 0, "IFF_LOOPBACK on device 1: {lo:#x}");
        assert!(imp::device_flags(u32::MAX).is_err());
    }

    #[test]
    fn link_local_sources_are_left_to_the_peers_scope() {
        let peer: SocketAddr = "[fe80::2%3]:443".parse().unwrap();
        assert_eq!(endpoints(Some("fe80::1".parse().unwrap()), peer), (None, peer));
        let peer: SocketAddr = "[2001:db8::2]:443".parse().unwrap();
        let local: IpAddr = "2001:db8::1".parse().unwrap();
        assert_eq!(endpoints(Some(local), peer), (Some(local), peer));
        let mapped: SocketAddr = "[::ffff:10.0.0.2]:443".parse().unwrap();
        let v4: SocketAddr = "10.0.0.2:443".parse().unwrap();
        assert_eq!(endpoints(Some("::".parse().unwrap()), mapped), (None, v4));
    }
}
