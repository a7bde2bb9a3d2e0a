//! DPLPMTUD's ceiling for one connection (`h3_mtu_upper_bound_bytes`). With `auto`
//! (the default) it follows the route to the client, as TCP's MSS does: loopback and
//! jumbo-frame LANs carry datagrams of several KB, and HTTP/3's cost is per datagram.
//! A route's MTU is its first hop's, so it is taken only for a client on that link
//! (no gateway on the route) or on this host; behind a gateway, and on routes of
//! 1500 bytes or less, the ceiling stays 1452. Otherwise a host whose default route
//! is a jumbo one (AWS's 9001, jumbo VPCs) would cost internet clients behind a
//! 1500-byte hop a dozen lost probes per connection, again every ten minutes.

use std::net::{IpAddr, SocketAddr};

use crate::config::MtuBound;
use crate::sys::route;
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
            // The common case costs no second lookup: 1500 and below is ORDINARY.
            Ok(mtu) if mtu <= ETHERNET_MTU => ORDINARY,
            Ok(mtu) => match route::lookup(local, peer.ip()) {
                Ok(r) if !r.via_gateway => ceiling(mtu, !peer.ip().to_canonical().is_ipv4()),
                Ok(_) => ORDINARY,
                Err(e) => {
                    tracing::debug!(%peer, error = %e, "h3: route unknown; DPLPMTUD ceiling {ORDINARY}");
                    ORDINARY
                }
            },
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

    /// A network namespace of the test's own (root and `ip` needed), removed on drop.
    struct Namespace(String);

    impl Namespace {
        fn new() -> Self {
            let ns = Self(format!("wsmtu{}", std::process::id()));
            let _ = std::process::Command::new("ip")
                .args(["netns", "del", &ns.0])
                .output();
            ns.ip(&["netns", "add", &ns.0]);
            ns
        }

        /// Runs `ip` (with `-n` and the namespace unless `args` starts with "netns").
        fn ip(&self, args: &[&str]) {
            let mut cmd = std::process::Command::new("ip");
            if args.first() != Some(&"netns") {
                cmd.args(["-n", &self.0]);
            }
            let out = cmd.args(args).output().expect("running ip (iproute2)");
            assert!(
                out.status.success(),
                "ip {args:?}: {} (this test needs root)",
                String::from_utf8_lossy(&out.stderr)
            );
        }

        /// Runs `f` on a thread inside the namespace (sockets it opens belong there).
        fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
            let file = std::fs::File::open(format!("/run/netns/{}", self.0)).expect("the namespace's file");
            std::thread::spawn(move || {
                rustix::thread::move_into_link_name_space(
                    std::os::fd::AsFd::as_fd(&file),
                    Some(rustix::thread::LinkNameSpaceType::Network),
                )
                .expect("setns into the test's namespace");
                f()
            })
            .join()
            .expect("the namespace thread")
        }
    }

    impl Drop for Namespace {
        fn drop(&mut self) {
            let _ = std::process::Command::new("ip")
                .args(["netns", "del", &self.0])
                .output();
        }
    }

    /// In a namespace of its own: a 9000-byte link with a client on it and a
    /// gateway on it to a network beyond, and a 1500-byte link. The route's MTU is
    /// 9000 for both jumbo cases; only the client on the link gets the jumbo
    /// ceiling, so a host whose default route is a jumbo one does not make internet
    /// clients probe sizes their paths drop.
    #[test]
    fn auto_takes_a_jumbo_route_only_to_a_client_on_its_link() {
        let ns = Namespace::new();
        ns.ip(&["link", "set", "lo", "up"]);
        for (a, b, mtu, v4, v6) in [
            ("jumbo0", "jumbo1", "9000", "10.88.0.1/24", "fd00:88::1/64"),
            ("plain0", "plain1", "1500", "10.89.0.1/24", "fd00:89::1/64"),
        ] {
            ns.ip(&[
                "link", "add", a, "mtu", mtu, "type", "veth", "peer", "name", b, "mtu", mtu,
            ]);
            ns.ip(&["link", "set", a, "up"]);
            ns.ip(&["link", "set", b, "up"]);
            ns.ip(&["addr", "add", v4, "dev", a]);
            ns.ip(&["addr", "add", v6, "dev", a, "nodad"]);
        }
        ns.ip(&[
            "route",
            "add",
            "198.51.100.0/24",
            "via",
            "10.88.0.2",
            "dev",
            "jumbo0",
        ]);
        ns.ip(&[
            "route",
            "add",
            "2001:db8:99::/64",
            "via",
            "fd00:88::2",
            "dev",
            "jumbo0",
        ]);

        let got = ns.run(|| {
            let bound = |local: Option<&str>, peer: &str| {
                let peer: SocketAddr = peer.parse().unwrap();
                let local = local.map(|l| l.parse().unwrap());
                let mtu = route_mtu(local, peer).map_err(|e| e.to_string());
                (peer.to_string(), mtu, upper_bound(MtuBound::Auto, local, peer))
            };
            vec![
                bound(None, "10.88.0.2:443"),
                bound(Some("10.88.0.1"), "10.88.0.2:443"),
                bound(None, "[fd00:88::2]:443"),
                bound(None, "198.51.100.7:443"),
                bound(Some("10.88.0.1"), "198.51.100.7:443"),
                bound(None, "[2001:db8:99::7]:443"),
                bound(None, "10.89.0.2:443"),
                bound(Some("::"), "[::ffff:10.88.0.2]:443"),
                bound(None, "127.0.0.1:443"),
            ]
        });
        let want = [
            ("10.88.0.2:443", 9000, JUMBO),
            ("10.88.0.2:443", 9000, JUMBO),
            ("[fd00:88::2]:443", 9000, 8952),
            ("198.51.100.7:443", 9000, ORDINARY),
            ("198.51.100.7:443", 9000, ORDINARY),
            ("[2001:db8:99::7]:443", 9000, ORDINARY),
            ("10.89.0.2:443", 1500, ORDINARY),
            ("[::ffff:10.88.0.2]:443", 9000, JUMBO),
        ];
        for ((peer, mtu, bound), (want_peer, want_mtu, want_bound)) in got.iter().zip(want) {
            assert_eq!(peer, want_peer);
            assert_eq!(*mtu, Ok(want_mtu), "route MTU to {peer}");
            assert_eq!(*bound, want_bound, "ceiling for {peer}");
        }
        // This host itself: loopback's MTU (65535 or 65536, by kernel), no gateway.
        let (peer, mtu, bound) = got.last().unwrap();
        assert!(
            mtu.as_ref().is_ok_and(|&m| m > 9000),
            "route MTU to {peer}: {mtu:?}"
        );
        assert_eq!(*bound, JUMBO, "ceiling for {peer}");
        let gateway = ns.run(|| route::lookup(None, "198.51.100.7".parse().unwrap()).unwrap());
        assert!(gateway.via_gateway && !gateway.local, "{gateway:?}");
        let local = ns.run(|| route::lookup(None, "10.88.0.1".parse().unwrap()).unwrap());
        assert!(local.local && !local.via_gateway, "{local:?}");
    }
}
