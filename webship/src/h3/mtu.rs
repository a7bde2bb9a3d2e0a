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
        MtuBound::Auto => route_ceiling(local, peer).unwrap_or_else(|e| {
            tracing::debug!(%peer, error = %e, "h3: route unknown; DPLPMTUD ceiling {ORDINARY}");
            ORDINARY
        }),
    }
}

/// `auto`'s ceiling: the route's MTU for a client on its link, else [`ORDINARY`].
/// The common case costs one lookup: a route of 1500 or less needs no second.
fn route_ceiling(local: Option<IpAddr>, peer: SocketAddr) -> std::io::Result<u16> {
    let mtu = route_mtu(local, peer)?;
    if mtu <= ETHERNET_MTU || !route::on_link(local, peer)? {
        return Ok(ORDINARY);
    }
    Ok(ceiling(mtu, !peer.ip().to_canonical().is_ipv4()))
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

    /// Runs `setup` (arguments to `ip`, one command each) and then `f` on a thread in
    /// a network namespace of its own, which goes with the thread. `None` (the test
    /// skips, saying why) where namespaces, `ip` or TUN devices are not to be had:
    /// not root, a container without CAP_SYS_ADMIN, no iproute2, no /dev/net/tun.
    fn in_own_namespace<T: Send + 'static>(
        setup: &'static [&'static [&'static str]],
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Option<T> {
        let skip = |why: &str| eprintln!("skipped: {why}");
        if !rustix::process::geteuid().is_root() {
            skip("needs root for a network namespace");
            return None;
        }
        if !std::path::Path::new("/dev/net/tun").exists() {
            skip("no /dev/net/tun");
            return None;
        }
        let thread = std::thread::spawn(move || {
            if let Err(e) = crate::sys::route::enter_own_network_namespace() {
                skip(&format!("unshare(CLONE_NEWNET): {e}"));
                return None;
            }
            for args in setup {
                // Started from this thread, so inside its namespace.
                let out = match std::process::Command::new("ip").args(*args).output() {
                    Ok(out) => out,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                        skip("no ip (iproute2)");
                        return None;
                    }
                    Err(e) => panic!("running ip: {e}"),
                };
                assert!(
                    out.status.success(),
                    "ip {args:?}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            Some(f())
        });
        thread.join().expect("the namespace thread")
    }

    /// The namespace [`auto_takes_a_jumbo_route_only_to_a_client_on_its_link`]
    /// builds: a 9000-byte link with clients on it, a gateway on it to networks
    /// beyond (a route, a default route, a next-hop object), a policy rule that
    /// sends one local address's replies through that gateway, a 9000-byte
    /// point-to-point tunnel, and a 1500-byte link.
    const TOPOLOGY: &[&[&str]] = &[
        &["link", "set", "lo", "up"],
        &[
            "link", "add", "jumbo0", "mtu", "9000", "type", "veth", "peer", "name", "jumbo1", "mtu", "9000",
        ],
        &[
            "link", "add", "plain0", "mtu", "1500", "type", "veth", "peer", "name", "plain1", "mtu", "1500",
        ],
        &["tuntap", "add", "mode", "tun", "name", "tun9"],
        &["link", "set", "tun9", "mtu", "9000", "up"],
        &["link", "set", "jumbo0", "up"],
        &["link", "set", "jumbo1", "up"],
        &["link", "set", "plain0", "up"],
        &["link", "set", "plain1", "up"],
        &["addr", "add", "10.88.0.1/24", "dev", "jumbo0"],
        &["addr", "add", "10.88.0.11/24", "dev", "jumbo0"],
        &["addr", "add", "fd00:88::1/64", "dev", "jumbo0", "nodad"],
        &["addr", "add", "fe80::88:1/64", "dev", "jumbo0", "nodad"],
        &["addr", "add", "10.89.0.1/24", "dev", "plain0"],
        &["route", "add", "default", "via", "10.88.0.2", "dev", "jumbo0"],
        &[
            "route",
            "add",
            "198.51.100.0/24",
            "via",
            "10.88.0.2",
            "dev",
            "jumbo0",
        ],
        &[
            "-6",
            "route",
            "add",
            "2001:db8:99::/64",
            "via",
            "fd00:88::2",
            "dev",
            "jumbo0",
        ],
        &["nexthop", "add", "id", "7", "via", "10.88.0.2", "dev", "jumbo0"],
        &["route", "add", "192.0.2.0/24", "nhid", "7"],
        &["route", "add", "203.0.113.0/24", "dev", "tun9"],
        &[
            "rule",
            "add",
            "from",
            "10.88.0.11",
            "lookup",
            "100",
            "pref",
            "100",
        ],
        &[
            "route",
            "add",
            "10.88.0.0/24",
            "via",
            "10.88.0.3",
            "dev",
            "jumbo0",
            "onlink",
            "table",
            "100",
        ],
    ];

    /// In a namespace of its own ([`TOPOLOGY`]): the route's MTU is 9000 in every
    /// jumbo case, and only a client on the 9000-byte link (or this host) gets the
    /// jumbo ceiling, so a host whose default route is a jumbo one does not make
    /// internet clients probe sizes their paths drop.
    #[test]
    fn auto_takes_a_jumbo_route_only_to_a_client_on_its_link() {
        let Some(got) = in_own_namespace(TOPOLOGY, || {
            let jumbo0 = std::net::UdpSocket::bind("127.0.0.1:0")
                .and_then(|s| rustix::net::netdevice::name_to_index(&s, "jumbo0").map_err(Into::into))
                .expect("jumbo0's index");
            let link_local = format!("[fe80::88:2%{jumbo0}]:443");
            let cases: Vec<(Option<&str>, String, Option<u32>, u16)> = vec![
                (None, "10.88.0.2:443".into(), Some(9000), JUMBO),
                (Some("10.88.0.1"), "10.88.0.2:443".into(), Some(9000), JUMBO),
                (None, "[fd00:88::2]:443".into(), Some(9000), 8952),
                (None, link_local.clone(), Some(9000), 8952),
                // The address it arrived on is link-local too (quinn knows it).
                (Some("fe80::88:1"), link_local, Some(9000), 8952),
                (Some("::"), "[::ffff:10.88.0.2]:443".into(), Some(9000), JUMBO),
                (None, "127.0.0.1:443".into(), None, JUMBO),
                (None, "10.88.0.1:443".into(), None, JUMBO),
                // Through the gateway: a route, the default route, a next-hop
                // object, a source address whose rule picks the gateway.
                (None, "198.51.100.7:443".into(), Some(9000), ORDINARY),
                (Some("10.88.0.1"), "198.51.100.7:443".into(), Some(9000), ORDINARY),
                (None, "[2001:db8:99::7]:443".into(), Some(9000), ORDINARY),
                (None, "198.18.0.9:443".into(), Some(9000), ORDINARY),
                (None, "192.0.2.5:443".into(), Some(9000), ORDINARY),
                (Some("10.88.0.11"), "10.88.0.2:443".into(), Some(9000), ORDINARY),
                // The far end of a tunnel, a 1500-byte link, no unicast peer.
                (None, "203.0.113.9:443".into(), Some(9000), ORDINARY),
                (None, "10.89.0.2:443".into(), Some(1500), ORDINARY),
                (None, "224.1.2.3:443".into(), Some(9000), ORDINARY),
                (None, "0.0.0.0:443".into(), None, ORDINARY),
            ];
            cases
                .into_iter()
                .map(|(local, peer, want_mtu, want)| {
                    let local = local.map(|l| l.parse().unwrap());
                    let addr: SocketAddr = peer.parse().unwrap();
                    let mtu = route_mtu(local, addr).map_err(|e| e.to_string());
                    (
                        format!("{local:?} → {peer}"),
                        mtu,
                        want_mtu,
                        upper_bound(MtuBound::Auto, local, addr),
                        want,
                    )
                })
                .collect::<Vec<_>>()
        }) else {
            return;
        };
        assert_eq!(got.len(), 18);
        for (case, mtu, want_mtu, bound, want) in got {
            if let Some(want_mtu) = want_mtu {
                assert_eq!(mtu, Ok(want_mtu), "route MTU, {case}");
            }
            assert_eq!(bound, want, "ceiling, {case}");
        }
    }
}
