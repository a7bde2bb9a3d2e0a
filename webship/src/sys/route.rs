//! Whether the kernel's route to a peer goes through a gateway: one rtnetlink
//! `RTM_GETROUTE` query, the question `ip route get <peer> from <local>` asks.
//!
//! HTTP/3's `h3_mtu_upper_bound_bytes = "auto"` needs it: a route's MTU is its first
//! hop's, which is the whole path's only when the peer sits on that link (or is this
//! host). Behind a gateway the path crosses links this host cannot see.
//!
//! The kernel answers a route query within the `sendto` that asks it, so the reply is
//! read without waiting (`MSG_DONTWAIT`): no reply there is an error, never a wait.

use std::io;
use std::net::IpAddr;

/// The parts of a route lookup's answer the MTU ceiling reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Route {
    /// Replies reach the peer through a router (`RTA_GATEWAY`, `RTA_VIA` or a
    /// multipath next hop), not directly on the outgoing link.
    pub via_gateway: bool,
    /// The peer is one of this host's own addresses (`RTN_LOCAL`: loopback).
    pub local: bool,
}

/// Looks up the route from `local` (the address a connection arrived on, if known:
/// policy routing may choose by source) to `peer`. IPv4-mapped IPv6 addresses are
/// looked up as IPv4.
pub(crate) fn lookup(local: Option<IpAddr>, peer: IpAddr) -> io::Result<Route> {
    let peer = peer.to_canonical();
    let local = local
        .map(|ip| ip.to_canonical())
        .filter(|ip| !ip.is_unspecified() && ip.is_ipv4() == peer.is_ipv4());
    imp::lookup(local, peer)
}

/// The rtnetlink wire format, as `linux/netlink.h` and `linux/rtnetlink.h` define it
/// (native byte order): pure functions, so the parsing is tested on bytes.
mod wire {
    use std::io;
    use std::net::IpAddr;

    use super::Route;

    const NLMSG_ERROR: u16 = 2;
    const RTM_NEWROUTE: u16 = 24;
    const RTM_GETROUTE: u16 = 26;
    const NLM_F_REQUEST: u16 = 1;
    const RTA_DST: u16 = 1;
    const RTA_SRC: u16 = 2;
    const RTA_GATEWAY: u16 = 5;
    const RTA_MULTIPATH: u16 = 9;
    const RTA_VIA: u16 = 18;
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

    /// An `RTM_GETROUTE` request for the route from `local` to `peer`, both of one
    /// family (the caller's duty).
    pub(super) fn request(seq: u32, local: Option<IpAddr>, peer: IpAddr) -> Vec<u8> {
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
        let len = out.len() as u32;
        out[0..4].copy_from_slice(&len.to_ne_bytes());
        out[4..6].copy_from_slice(&RTM_GETROUTE.to_ne_bytes());
        out[6..8].copy_from_slice(&NLM_F_REQUEST.to_ne_bytes());
        out[8..12].copy_from_slice(&seq.to_ne_bytes());
        out
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

    /// Reads the kernel's answer to request `seq`: the route, or the error the
    /// kernel reported (`NLMSG_ERROR`), or `InvalidData` for anything else.
    pub(super) fn answer(seq: u32, b: &[u8]) -> io::Result<Route> {
        let len = u32_at(b, 0).ok_or_else(|| malformed("short reply"))? as usize;
        let kind = u16_at(b, 4).ok_or_else(|| malformed("short reply"))?;
        if len < HEADER || len > b.len() {
            return Err(malformed("bad message length"));
        }
        if u32_at(b, 8) != Some(seq) {
            return Err(malformed("a reply to another request"));
        }
        let body = &b[HEADER..len];
        match kind {
            NLMSG_ERROR => {
                let code = u32_at(body, 0).ok_or_else(|| malformed("short error"))? as i32;
                // 0 would be an acknowledgement, which this request does not ask for.
                Err(match code {
                    0 => malformed("an acknowledgement instead of a route"),
                    n => io::Error::from_raw_os_error(n.saturating_neg()),
                })
            }
            RTM_NEWROUTE => {
                let rtm_type = *body.get(7).ok_or_else(|| malformed("short route"))?;
                let mut via_gateway = false;
                let mut at = RTMSG;
                while at + ATTR <= body.len() {
                    let alen = usize::from(u16_at(body, at).unwrap_or(0));
                    if alen < ATTR || at + alen > body.len() {
                        return Err(malformed("bad attribute length"));
                    }
                    if matches!(u16_at(body, at + 2), Some(RTA_GATEWAY | RTA_VIA | RTA_MULTIPATH)) {
                        via_gateway = true;
                    }
                    at += align4(alen);
                }
                Ok(Route {
                    via_gateway,
                    local: rtm_type == RTN_LOCAL,
                })
            }
            other => Err(malformed(&format!("unexpected message type {other}"))),
        }
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
        fn a_request_carries_the_destination_and_the_source() {
            let peer: IpAddr = "2001:db8::7".parse().unwrap();
            let local: IpAddr = "2001:db8::1".parse().unwrap();
            let b = request(9, Some(local), peer);
            assert_eq!(b.len(), HEADER + RTMSG + 2 * (ATTR + 16));
            assert_eq!(u32_at(&b, 0), Some(b.len() as u32));
            assert_eq!(u16_at(&b, 4), Some(RTM_GETROUTE));
            assert_eq!(u32_at(&b, 8), Some(9));
            assert_eq!(&b[HEADER..HEADER + 3], &[AF_INET6, 128, 128]);
            assert_eq!(u16_at(&b, HEADER + RTMSG + 2), Some(RTA_DST));
            assert_eq!(
                &b[HEADER + RTMSG + ATTR..HEADER + RTMSG + ATTR + 16],
                &octets(peer)[..]
            );
            let b = request(1, None, "10.0.0.1".parse().unwrap());
            assert_eq!(b.len(), HEADER + RTMSG + ATTR + 4);
            assert_eq!(&b[HEADER..HEADER + 3], &[AF_INET, 32, 0]);
        }

        #[test]
        fn gateways_in_any_form_are_seen() {
            let oif: &[u8] = &3u32.to_ne_bytes();
            let direct = route(1, &[(RTA_DST, &[10, 0, 0, 7]), (4, oif)]);
            assert_eq!(
                answer(5, &reply(5, RTM_NEWROUTE, &direct)).unwrap(),
                Route {
                    via_gateway: false,
                    local: false
                }
            );
            for kind in [RTA_GATEWAY, RTA_VIA, RTA_MULTIPATH] {
                let via = route(1, &[(RTA_DST, &[10, 0, 0, 7]), (kind, &[10, 0, 0, 1]), (4, oif)]);
                assert!(
                    answer(5, &reply(5, RTM_NEWROUTE, &via)).unwrap().via_gateway,
                    "{kind}"
                );
            }
            let local = route(RTN_LOCAL, &[(RTA_DST, &[127, 0, 0, 1])]);
            assert_eq!(
                answer(5, &reply(5, RTM_NEWROUTE, &local)).unwrap(),
                Route {
                    via_gateway: false,
                    local: true
                }
            );
        }

        #[test]
        fn errors_and_garbage_are_errors_not_routes() {
            let refused = reply(2, NLMSG_ERROR, &(-libc::ENETUNREACH).to_ne_bytes());
            assert_eq!(
                answer(2, &refused).unwrap_err().raw_os_error(),
                Some(libc::ENETUNREACH)
            );
            assert!(answer(2, &reply(2, NLMSG_ERROR, &0i32.to_ne_bytes())).is_err());
            let good = reply(3, RTM_NEWROUTE, &route(1, &[]));
            assert!(answer(4, &good).is_err(), "another request's reply");
            for cut in 0..good.len() {
                assert!(answer(3, &good[..cut]).is_err(), "cut at {cut}");
            }
            let mut bad_attr = route(1, &[(RTA_DST, &[10, 0, 0, 7])]);
            bad_attr[RTMSG..RTMSG + 2].copy_from_slice(&200u16.to_ne_bytes());
            assert!(answer(3, &reply(3, RTM_NEWROUTE, &bad_attr)).is_err());
            bad_attr[RTMSG..RTMSG + 2].copy_from_slice(&2u16.to_ne_bytes());
            assert!(answer(3, &reply(3, RTM_NEWROUTE, &bad_attr)).is_err());
            assert!(answer(3, &reply(3, 99, &route(1, &[]))).is_err());
        }
    }
}

#[cfg(target_os = "linux")]
mod imp {
    use std::io;
    use std::net::IpAddr;
    use std::sync::atomic::{AtomicU32, Ordering};

    use rustix::net::netlink::SocketAddrNetlink;
    use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketFlags, SocketType};

    use super::{wire, Route};

    /// Room for one route reply: a few hundred bytes; more is refused as truncated.
    const REPLY_BYTES: usize = 4096;

    static SEQ: AtomicU32 = AtomicU32::new(1);

    pub(super) fn lookup(local: Option<IpAddr>, peer: IpAddr) -> io::Result<Route> {
        // `None`: NETLINK_ROUTE, the family's protocol 0.
        let fd = rustix::net::socket_with(
            AddressFamily::NETLINK,
            SocketType::DGRAM,
            SocketFlags::CLOEXEC,
            None,
        )?;
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        let request = wire::request(seq, local, peer);
        rustix::net::sendto(&fd, &request, SendFlags::empty(), &SocketAddrNetlink::new(0, 0))?;
        let mut reply = [0u8; REPLY_BYTES];
        let (got, whole) = rustix::net::recv(&fd, &mut reply[..], RecvFlags::DONTWAIT | RecvFlags::TRUNC)?;
        if whole > got {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "rtnetlink: reply truncated",
            ));
        }
        wire::answer(seq, &reply[..got])
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    use std::io;
    use std::net::IpAddr;

    use super::Route;

    pub(super) fn lookup(_: Option<IpAddr>, _: IpAddr) -> io::Result<Route> {
        Err(io::ErrorKind::Unsupported.into())
    }
}
