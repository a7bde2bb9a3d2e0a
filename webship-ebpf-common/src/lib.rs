//! What Webship's eBPF programs and the daemon agree on: map names, the layout of
//! map values, and the index of every counter. `#![no_std]` and dependency-free so
//! that it builds for `bpfel-unknown-none` as well as for the daemon.
//! The daemon embeds the object built from the same commit, so both sides always
//! agree on what is written here.

#![cfg_attr(not(test), no_std)]

/// SOCKHASH of spliced sockets, keyed by socket cookie.
pub const SOCKS_MAP: &str = "SOCKS";
/// HASH: socket cookie → [`Link`] (its peer and its direction).
pub const LINKS_MAP: &str = "LINKS";
/// PERCPU_ARRAY of `u64`, one slot per [`Counter`], written by the programs.
pub const KERNEL_COUNTERS_MAP: &str = "KERNEL_COUNTERS";
/// ARRAY of `u64`, one slot per [`Counter`], mirrored from the daemon's own
/// counters (userspace engines, SNI decisions) so that one reader sees both.
pub const USER_COUNTERS_MAP: &str = "USER_COUNTERS";

/// The stream-verdict program that redirects between linked sockets.
pub const VERDICT_PROGRAM: &str = "webship_splice";

/// The tc classifier that redirects HTTP/3 passthrough datagrams.
pub const UDP_PROGRAM: &str = "webship_udp";
/// ARRAY with one [`UdpRedirect`]: what the classifier rewrites.
pub const UDP_CONFIG_MAP: &str = "UDP_CONFIG";
/// LRU_HASH of client flows ([`flow_key`] → unused `u64`).
pub const UDP_FLOWS_MAP: &str = "UDP_FLOWS";
/// Client flows the kernel tracks at most (least recently used go first).
pub const MAX_UDP_FLOWS: u32 = 65_536;

/// The addresses the UDP classifier rewrites between, all in network byte order
/// exactly as they sit in the packet headers (IPv4).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct UdpRedirect {
    /// Where clients send (Webship's listen address).
    pub listen_ip: u32,
    /// The QUIC origin.
    pub origin_ip: u32,
    pub listen_port: u16,
    pub origin_port: u16,
    /// 0 until the daemon has written the rest.
    pub enabled: u32,
}

/// The `UDP_FLOWS` key of a client address (IPv4 and port, network byte order).
pub const fn flow_key(ip: u32, port: u16) -> u64 {
    ((ip as u64) << 16) | port as u64
}

/// How many sockets the SOCKHASH holds: two per spliced connection.
pub const MAX_SPLICED_SOCKETS: u32 = 65_536;

/// Direction of a spliced socket's *incoming* bytes.
pub const DIRECTION_UP: u32 = 0;
/// Bytes arriving from the origin, going to the client.
pub const DIRECTION_DOWN: u32 = 1;

/// The value of `LINKS[cookie]`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Link {
    /// Cookie of the socket this one's bytes go to.
    pub peer: u64,
    /// [`DIRECTION_UP`] or [`DIRECTION_DOWN`].
    pub direction: u32,
    /// Set by the program when it had to leave a segment of this direction to
    /// userspace (the peer was not in the map): every later one follows it there,
    /// so no redirected segment overtakes one the daemon still has to forward.
    pub passed: u32,
    /// Bytes this socket received and the program redirected to `peer`.
    pub redirected: u64,
}

// SAFETY: `Link` is `repr(C)`, has no padding the kernel could leave uninitialised
// (`passed` fills what would be), and every bit pattern is a valid value.
#[cfg(feature = "user")]
#[allow(unsafe_code)]
unsafe impl aya::Pod for Link {}

// SAFETY: `repr(C)`, fields fill it without padding (4 + 4 + 2 + 2 + 4 bytes), and
// every bit pattern is a valid value.
#[cfg(feature = "user")]
#[allow(unsafe_code)]
unsafe impl aya::Pod for UdpRedirect {}

/// Every counter, in the order of the counter arrays.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counter {
    /// Connections handed to an upstream.
    Steered = 0,
    /// Payload bytes client → origin.
    BytesUp = 1,
    /// Payload bytes origin → client.
    BytesDown = 2,
    /// ClientHellos with no or an unknown SNI, closed.
    SniMisses = 3,
    /// Malformed, oversized or too slow ClientHellos, closed.
    BadHellos = 4,
    /// Connections closed because no upstream answered.
    UpstreamFailures = 5,
    /// Segments the program left to userspace instead of redirecting them: the
    /// peer gone or not linked yet, and every later one of that direction.
    RedirectFailures = 6,
    /// QUIC flows created towards the UDP origin.
    UdpFlows = 7,
    /// Datagrams client → origin.
    UdpPacketsUp = 8,
    /// Datagrams origin → client.
    UdpPacketsDown = 9,
    /// Passthrough connections that ended with a FIN each way.
    ClosedClean = 10,
    /// Passthrough connections ended by a reset or another socket error.
    ClosedReset = 11,
    /// Passthrough connections closed after carrying nothing for the idle timeout.
    ClosedIdle = 12,
    /// Passthrough connections whose peer stopped acknowledging (keepalive,
    /// `TCP_USER_TIMEOUT`, or a receiver that never drained the last bytes).
    ClosedStalled = 13,
    /// UDP flows dropped to make room for a new client (never answered by the
    /// origin, or over the per-address cap).
    UdpFlowsEvicted = 14,
    /// Datagrams of new UDP flows dropped: the table or the address was full.
    UdpFlowsRefused = 15,
}

impl Counter {
    pub const ALL: [Counter; 16] = [
        Counter::Steered,
        Counter::BytesUp,
        Counter::BytesDown,
        Counter::SniMisses,
        Counter::BadHellos,
        Counter::UpstreamFailures,
        Counter::RedirectFailures,
        Counter::UdpFlows,
        Counter::UdpPacketsUp,
        Counter::UdpPacketsDown,
        Counter::ClosedClean,
        Counter::ClosedReset,
        Counter::ClosedIdle,
        Counter::ClosedStalled,
        Counter::UdpFlowsEvicted,
        Counter::UdpFlowsRefused,
    ];

    /// The stable name used by `webship stats --json`.
    pub const fn name(self) -> &'static str {
        match self {
            Counter::Steered => "connections_steered",
            Counter::BytesUp => "bytes_up",
            Counter::BytesDown => "bytes_down",
            Counter::SniMisses => "sni_misses",
            Counter::BadHellos => "bad_hellos",
            Counter::UpstreamFailures => "upstream_failures",
            Counter::RedirectFailures => "redirect_failures",
            Counter::UdpFlows => "udp_flows",
            Counter::UdpPacketsUp => "udp_packets_up",
            Counter::UdpPacketsDown => "udp_packets_down",
            Counter::ClosedClean => "closed_clean",
            Counter::ClosedReset => "closed_reset",
            Counter::ClosedIdle => "closed_idle",
            Counter::ClosedStalled => "closed_stalled",
            Counter::UdpFlowsEvicted => "udp_flows_evicted",
            Counter::UdpFlowsRefused => "udp_flows_refused",
        }
    }
}

/// Number of counter slots.
pub const COUNTERS: u32 = Counter::ALL.len() as u32;

// TCP health: a `sock_ops` program on the daemon's cgroup (v2) counts, per site,
// what the kernel knows about the daemon's client connections (retransmissions,
// RTO timeouts, resets, the smoothed RTT and the last delivery rate at close).
// The daemon tags each client socket with its site's slot once the site is known;
// untagged sockets are never counted.

/// The `sock_ops` program.
pub const TCP_PROGRAM: &str = "webship_tcp";
/// LRU_HASH: socket cookie → site slot (`u32`), written by the daemon once per
/// connection and deleted by the program when the socket closes (LRU: a tag written
/// after its socket already closed is evicted in time, never kept for good).
pub const TCP_TAGS_MAP: &str = "TCP_TAGS";
/// HASH: the daemon's listening ports (host byte order) → unused `u32`. Only
/// sockets accepted on one of them get the state and retransmit callbacks, so other
/// processes sharing the cgroup pay nothing beyond the program's base callbacks.
pub const TCP_PORTS_MAP: &str = "TCP_PORTS";
/// PERCPU_ARRAY: site slot → [`TcpSite`].
pub const TCP_SITES_MAP: &str = "TCP_SITES";
/// ARRAY: site slot → [`SiteName`], written by the daemon (for `webship stats`).
pub const TCP_SITE_NAMES_MAP: &str = "TCP_SITE_NAMES";
/// Site slots: distinct site names one daemon counts over its life.
pub const MAX_TCP_SITES: u32 = 256;
/// Listening ports the program watches.
pub const MAX_TCP_PORTS: u32 = 16;
/// `TCP_TAGS` entries in the object; the daemon sizes it to its connection limit.
pub const TCP_TAGS_DEFAULT: u32 = 4096;
/// RTT histogram buckets: bucket `i` counts connections whose smoothed RTT, in
/// microseconds, has `log2` equal to `i` (bucket 0 also takes 0 µs; the last one
/// everything above).
pub const RTT_BUCKETS: usize = 32;
/// Delivery-rate histogram buckets, in bytes per second, bucketed like the RTT.
pub const RATE_BUCKETS: usize = 48;
/// Longest site name kept (a DNS name is at most 253 bytes).
pub const SITE_NAME_BYTES: usize = 256;

/// One site's TCP health, per CPU (summed by the reader).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpSite {
    /// Segments retransmitted (`BPF_SOCK_OPS_RETRANS_CB`, successful ones).
    pub retransmits: u64,
    /// Retransmission timeouts that fired (`BPF_SOCK_OPS_RTO_CB`).
    pub rto: u64,
    /// Connections closed (their last state change, to `TCP_CLOSE`).
    pub closed: u64,
    /// Of those, closed straight from ESTABLISHED or CLOSE_WAIT: a reset sent or
    /// received, or a timeout, rather than the FIN handshake.
    pub reset: u64,
    /// Bytes the clients acknowledged (`bytes_acked` at close).
    pub bytes_acked: u64,
    /// Bytes received from the clients (`bytes_received` at close).
    pub bytes_received: u64,
    /// Sum of the smoothed RTTs at close, microseconds.
    pub rtt_sum_us: u64,
    /// Sum of the last delivery rates at close, bytes per second.
    pub rate_sum: u64,
    /// Connections with a delivery-rate sample (the rate histogram's count).
    pub rate_samples: u64,
    pub rtt: [u64; RTT_BUCKETS],
    pub rate: [u64; RATE_BUCKETS],
}

impl TcpSite {
    pub const ZERO: TcpSite = TcpSite {
        retransmits: 0,
        rto: 0,
        closed: 0,
        reset: 0,
        bytes_acked: 0,
        bytes_received: 0,
        rtt_sum_us: 0,
        rate_sum: 0,
        rate_samples: 0,
        rtt: [0; RTT_BUCKETS],
        rate: [0; RATE_BUCKETS],
    };
}

/// A site's name in `TCP_SITE_NAMES` (`len` bytes of UTF-8; 0: slot unused).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SiteName {
    pub len: u32,
    pub _pad: u32,
    pub bytes: [u8; SITE_NAME_BYTES],
}

impl SiteName {
    pub const EMPTY: SiteName = SiteName {
        len: 0,
        _pad: 0,
        bytes: [0; SITE_NAME_BYTES],
    };
}

/// `floor(log2(v))`, 0 for 0, without a loop or a count-leading-zeros the BPF
/// target lacks.
#[inline(always)]
pub const fn log2(mut v: u64) -> u32 {
    let mut r = 0;
    if v >= 1 << 32 {
        v >>= 32;
        r += 32;
    }
    if v >= 1 << 16 {
        v >>= 16;
        r += 16;
    }
    if v >= 1 << 8 {
        v >>= 8;
        r += 8;
    }
    if v >= 1 << 4 {
        v >>= 4;
        r += 4;
    }
    if v >= 1 << 2 {
        v >>= 2;
        r += 2;
    }
    if v >= 1 << 1 {
        r += 1;
    }
    r
}

/// The histogram bucket of `v` among `buckets` log2 buckets.
#[inline(always)]
pub const fn bucket(v: u64, buckets: usize) -> usize {
    let b = log2(v) as usize;
    if b >= buckets {
        buckets - 1
    } else {
        b
    }
}

// SAFETY: `repr(C)`, only `u64` fields and arrays of them (no padding), every bit
// pattern valid.
#[cfg(feature = "user")]
#[allow(unsafe_code)]
unsafe impl aya::Pod for TcpSite {}

// SAFETY: `repr(C)`, `u32` + `u32` + bytes fill it without padding (264 bytes,
// 8-aligned), every bit pattern valid.
#[cfg(feature = "user")]
#[allow(unsafe_code)]
unsafe impl aya::Pod for SiteName {}

// HTTP/3 socket steering: an SK_REUSEPORT program on the group of the daemon's QUIC
// sockets (`h3_sockets`) sends each datagram to the socket whose index its
// destination connection ID names, so the daemon need not hand it over itself.

/// The SK_REUSEPORT program.
pub const QUIC_STEER_PROGRAM: &str = "webship_quic_steer";
/// REUSEPORT_SOCKARRAY: socket index → the group's UDP socket with that index,
/// filled by the daemon (a slot left empty falls back to the kernel's hash).
pub const QUIC_SOCKETS_MAP: &str = "QUIC_SOCKETS";
/// Sockets one QUIC group holds at most (the daemon's `h3_sockets` cap).
pub const MAX_QUIC_SOCKETS: u32 = 32;
/// Length of the connection IDs the daemon issues; byte [`CID_SOCKET_BYTE`] is the
/// socket index.
pub const QUIC_CID_LEN: u8 = 12;
/// The byte of a daemon-issued connection ID that names its socket.
pub const CID_SOCKET_BYTE: usize = 0;
/// Where a short-header packet's destination connection ID starts: right after
/// the first byte (the header carries no length; every ID the daemon issues is
/// [`QUIC_CID_LEN`] bytes long).
pub const SHORT_HEADER_DCID_OFFSET: usize = 1;
/// Bytes before the QUIC packet in the program's view of a datagram: the UDP
/// header (the kernel runs the program with the packet data starting there).
pub const UDP_HEADER_LEN: u32 = 8;
/// Bytes of a QUIC packet [`quic_socket`] reads: the first byte through a short
/// header's socket index byte.
pub const QUIC_HEAD_LEN: usize = SHORT_HEADER_DCID_OFFSET + CID_SOCKET_BYTE + 1;

/// The socket index a short-header QUIC packet's destination connection ID names,
/// if it is below `sockets`. `head` is the packet's first [`QUIC_HEAD_LEN`] bytes.
/// Only the index byte is read, not the tag: a forged ID steers to an arbitrary
/// socket, which drops it or hands it over as without the program.
///
/// Long headers (form bit 0x80 set) name none and are left to the kernel's
/// 4-tuple hash: their DCID may be client-chosen (an Initial's, whose index byte
/// an attacker could aim at one socket with a flood), and a client may not migrate
/// before its handshake is confirmed (RFC 9000 §9), so a handshake's packets keep
/// their 4-tuple and socket anyway; after a takeover grew the group, the daemon's
/// in-process hand-off carries those that land elsewhere.
#[inline(always)]
pub const fn quic_socket(head: &[u8; QUIC_HEAD_LEN], sockets: u32) -> Option<u32> {
    if head[0] & 0x80 != 0 {
        return None;
    }
    let index = head[SHORT_HEADER_DCID_OFFSET + CID_SOCKET_BYTE];
    if (index as u32) < sockets {
        Some(index as u32)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first bytes of a packet with `first` as its first byte and `index` as
    /// its second.
    fn head(first: u8, index: u8) -> [u8; QUIC_HEAD_LEN] {
        [first, index]
    }

    #[test]
    fn short_header_names_the_socket_in_its_first_dcid_byte() {
        assert_eq!(quic_socket(&head(0x40, 3), 4), Some(3));
        // The fixed bit may be greased: only the form bit matters.
        assert_eq!(quic_socket(&head(0x01, 0), 2), Some(0));
    }

    #[test]
    fn long_headers_name_no_socket_even_with_our_id_length() {
        // Handshake and Initial packets, whatever their DCID: the second byte is the
        // version's first, and even a 12-byte DCID whose index byte is in range (a
        // client could choose it) steers nowhere.
        for first in [0xc0, 0xe0, 0xd0, 0xf0, 0x80] {
            for index in [0, 1, 12] {
                assert_eq!(quic_socket(&head(first, index), MAX_QUIC_SOCKETS), None);
            }
        }
    }

    #[test]
    fn unknown_indices_name_none() {
        assert_eq!(quic_socket(&head(0x40, 2), 2), None);
        assert_eq!(quic_socket(&head(0x40, 0xff), MAX_QUIC_SOCKETS), None);
        assert_eq!(quic_socket(&head(0x40, 0), 0), None);
    }
}
