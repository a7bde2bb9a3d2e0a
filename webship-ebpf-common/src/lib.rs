//! What Webship's eBPF programs and the daemon agree on: map names, the layout of
//! map values, and the index of every counter. `#![no_std]` and dependency-free so
//! that it builds for `bpfel-unknown-none` as well as for the daemon.
//! The daemon embeds the object built from the same commit, so both sides always
//! agree on what is written here.

#![no_std]

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
    pub _pad: u32,
    /// Bytes this socket received and the program redirected to `peer`.
    pub redirected: u64,
}

// SAFETY: `Link` is `repr(C)`, has no padding the kernel could leave uninitialised
// (the explicit `_pad` fills it), and every bit pattern is a valid value.
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
    /// Segments the kernel could not redirect (peer gone or unlinked).
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
