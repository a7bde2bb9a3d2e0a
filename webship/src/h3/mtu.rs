//! DPLPMTUD's ceiling for one connection (`h3_mtu_upper_bound_bytes`). With `auto`
//! it follows the route to the client, as TCP's MSS does: loopback and jumbo-frame
//! LANs carry datagrams of several KB, and HTTP/3's cost is per datagram; a route
//! of 1500 bytes or less keeps the 1452-byte ceiling. `auto` is not the default: the
//! route's MTU is the first hop's, and where the default route itself is a jumbo
//! one (AWS's 9001, jumbo VPCs) internet clients behind a 1500-byte hop would cost
//! every connection a dozen lost probes, again every ten minutes.

use std::net::{IpAddr, SocketAddr};

use crate::config::MtuBound;
use crate::sys::udp::route_mtu;

/// The ceiling on ordinary paths, and whenever the route cannot be read: a
/// 1500-byte Ethernet MTU less an IPv6 and a UDP header (IPv4 leaves 20 bytes
/// unused).
pub(crate) const ORDINARY: u16 = 1452;

/// The highest ceiling `auto` gives: a 9000-byte jumbo frame less the IPv4 and UDP
/// headers. quinn's per-connection transmit buffer holds about ten datagrams of the
/// current MTU, so a 65536-byte loopback MTU is not worth its 640 KB per connection.
pub(crate) const JUMBO: u16 = 8972;

/// Routes with an MTU above this are taken for loopback or jumbo-frame LANs.
const ETHERNET_MTU: u32 = 1500;

/// The upper bound for a connection from `peer` that arrived on `local` (when
/// quinn knows it; the kernel then picks the route the replies take).
pub(crate) fn upper_bound(setting: MtuBound, local: Option<IpAddr>, peer: SocketAddr) -> u16 {
    match setting {
        MtuBound::Fixed(n) => n,
        MtuBound::Auto => match route_mtu(local, peer) {
            Ok(mtu) => ceiling(mtu, !peer.ip().to_canonical().is_ipv4()),
            Err(e) => {
                tracing::debug!(%peer, error = %e, "h3: route MTU unknown; DPLPMTUD ceiling {ORDINARY}");
                ORDINARY
            }
        },
    }
}

/// The bound a setting gives before any peer is known (the endpoint's base config).
pub(crate) fn without_peer(setting: MtuBound) -> u16 {
    match setting {
        MtuBound::Fixed(n) => n,
        MtuBound::Auto => ORDINARY,
    }
}

/// The ceiling for a route of `route_mtu` bytes: its UDP payload (less 28 header
/// bytes for IPv4, 48 for IPv6) up to [`JUMBO`] when the route is larger than
/// Ethernet's 1500, else [`ORDINARY`]. Below 1500 (a tunnel, a PPPoE link) it is
/// still [`ORDINARY`], as before: DPLPMTUD starts at 1200, and a probe the path
/// drops only costs that probe (quinn sends each probe three times, then searches
/// lower).
pub(crate) fn ceiling(route_mtu: u32, ipv6: bool) -> u16 {
    if route_mtu <= ETHERNET_MTU {
        return ORDINARY;
    }
    let headers = if ipv6 { 48 } else { 28 };
    let payload = route_mtu.saturating_sub(headers).min(u32::from(JUMBO));
    u16::try_from(payload).map_or(JUMBO, |p| p.max(ORDINARY))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ceiling_follows_routes_above_ethernet_only() {
        for (mtu, ipv6, want) in [
            (1500, false, 1452),
            (1500, true, 1452),
            (1280, false, 1452),
            (1280, true, 1452),
            (576, false, 1452),
            (0, false, 1452),
            (1501, true, 1453),
            (1501, false, 1473),
            (4000, false, 3972),
            (9000, false, 8972),
            (9000, true, 8952),
            (9001, false, 8972),
            (65_536, false, 8972),
            (65_536, true, 8972),
            (u32::MAX, true, 8972),
        ] {
            assert_eq!(ceiling(mtu, ipv6), want, "MTU {mtu}, IPv6 {ipv6}");
        }
    }

    /// Loopback's route (65536 here) gives the jumbo ceiling; a number is used as
    /// written, without a lookup; a local address that is not this host's (so no
    /// route can be read) gives the ordinary ceiling.
    #[test]
    fn auto_reads_the_route_and_a_number_does_not() {
        let peer: SocketAddr = "127.0.0.1:4433".parse().unwrap();
        let mapped: SocketAddr = "[::ffff:127.0.0.1]:4433".parse().unwrap();
        assert_eq!(upper_bound(MtuBound::Auto, None, peer), JUMBO);
        assert_eq!(
            upper_bound(MtuBound::Auto, Some("::".parse().unwrap()), mapped),
            JUMBO
        );
        assert_eq!(upper_bound(MtuBound::Fixed(1400), None, peer), 1400);
        if std::net::UdpSocket::bind("192.0.2.1:0").is_err() {
            assert_eq!(
                upper_bound(MtuBound::Auto, Some("192.0.2.1".parse().unwrap()), peer),
                ORDINARY
            );
        }
        assert_eq!(without_peer(MtuBound::Auto), ORDINARY);
        assert_eq!(without_peer(MtuBound::Fixed(9000)), 9000);
    }
}
