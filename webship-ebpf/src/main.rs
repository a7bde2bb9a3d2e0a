//! Webship's eBPF programs.
//!
//! `webship_splice`, an `sk_skb` stream verdict attached to the `SOCKS` SOCKHASH:
//! every segment a spliced socket receives is redirected to the egress of its peer
//! (looked up in `LINKS` by the receiving socket's cookie), so passthrough bytes
//! never reach userspace. Per-CPU counters record what was moved and what could not
//! be; the daemon sums them for `webship stats`.
//!
//! `webship_udp`, a tc classifier on the loopback interface's ingress: datagrams to
//! the listen address are rewritten to the QUIC origin (the client's address
//! kept, its flow remembered), and the origin's replies to a remembered client are
//! rewritten to come from the listen address. Checksums are patched
//! incrementally; anything else passes untouched.
//!
//! `webship_tcp`, a `sock_ops` program on the daemon's cgroup (v2): sockets accepted
//! on the daemon's listening ports get the state, retransmit and RTO callbacks; for
//! those the daemon tagged with a site (`TCP_TAGS`, by socket cookie) it counts
//! retransmitted segments and timeouts as they happen and, when the socket closes,
//! the close itself, its bytes, its smoothed RTT and its last delivery rate, per
//! site in a per-CPU array. Nothing runs per segment on a healthy connection: a
//! state change (a few per connection) costs one hash lookup, an untagged one
//! nothing more.
//!
//! `webship_quic_steer`, an `sk_reuseport` program on the group of the daemon's
//! QUIC sockets: a short-header datagram whose destination connection ID names one
//! of the group's sockets (`quic_socket` in the common crate) goes to that socket,
//! picked from `QUIC_SOCKETS`; anything else (every long header, whose DCID a client
//! may choose and aim, runts, an empty slot) is left to the kernel's 4-tuple hash,
//! never dropped.

#![no_std]
#![no_main]

use aya_ebpf::bindings::sk_action::SK_PASS;
use aya_ebpf::bindings::{
    BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB, BPF_SOCK_OPS_RETRANS_CB,
    BPF_SOCK_OPS_RETRANS_CB_FLAG, BPF_SOCK_OPS_RTO_CB, BPF_SOCK_OPS_RTO_CB_FLAG, BPF_SOCK_OPS_STATE_CB,
    BPF_SOCK_OPS_STATE_CB_FLAG, BPF_TCP_CLOSE, BPF_TCP_CLOSE_WAIT, BPF_TCP_ESTABLISHED, TC_ACT_UNSPEC,
};
use aya_ebpf::helpers::{bpf_get_socket_cookie, bpf_skb_load_bytes};
use aya_ebpf::macros::{classifier, map, sk_reuseport, sock_ops, stream_verdict};
use aya_ebpf::maps::{Array, HashMap, LruHashMap, PerCpuArray, ReusePortSockArray, SockHash};
use aya_ebpf::programs::{SkBuffContext, SkReuseportContext, SockOpsContext, TcContext};
use aya_ebpf::EbpfContext;
use aya_log_ebpf::debug;
use webship_ebpf_common::{
    bucket, flow_key, quic_socket, Counter, Link, SiteName, TcpSite, UdpRedirect, COUNTERS, DIRECTION_UP,
    MAX_QUIC_SOCKETS, MAX_SPLICED_SOCKETS, MAX_TCP_PORTS, MAX_TCP_SITES, MAX_UDP_FLOWS, QUIC_HEAD_LEN,
    RATE_BUCKETS, RTT_BUCKETS, TCP_TAGS_DEFAULT, UDP_HEADER_LEN,
};

#[map]
static SOCKS: SockHash<u64> = SockHash::with_max_entries(MAX_SPLICED_SOCKETS, 0);

#[map]
static LINKS: HashMap<u64, Link> = HashMap::with_max_entries(MAX_SPLICED_SOCKETS, 0);

#[map]
static KERNEL_COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(COUNTERS, 0);

/// Written only by the daemon; declared here so that it is created and pinned
/// beside the kernel counters.
#[map]
static USER_COUNTERS: Array<u64> = Array::with_max_entries(COUNTERS, 0);

#[inline(always)]
fn count(counter: Counter, n: u64) {
    if let Some(slot) = KERNEL_COUNTERS.get_ptr_mut(counter as u32) {
        // SAFETY: a per-CPU slot is only ever written by this CPU, with preemption
        // disabled for the duration of the program.
        unsafe { *slot += n };
    }
}

#[stream_verdict]
pub fn webship_splice(ctx: SkBuffContext) -> u32 {
    // SAFETY: the helper only reads the socket the context belongs to.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.skb.skb.cast()) };
    let len = u64::from(ctx.len());
    let Some(link) = LINKS.get_ptr_mut(&cookie) else {
        // Not linked (being set up or torn down): leave the bytes in the socket,
        // where the daemon reads them.
        count(Counter::RedirectFailures, 1);
        debug!(
            &ctx,
            "splice: socket {} has no link, {} bytes left for userspace", cookie, len
        );
        return SK_PASS;
    };
    // SAFETY: `link` points into the map value for this socket, which only this
    // socket's (serialized) receive path writes after the daemon created it.
    let (mut peer, direction, passed) = unsafe { ((*link).peer, (*link).direction, (*link).passed) };
    if passed != 0 && len != 0 {
        count(Counter::RedirectFailures, 1);
    }
    if len == 0 || passed != 0 {
        // A bare FIN carries nothing to move: redirected to the peer's
        // egress, the kernel's sender fails on it and breaks the peer's pipe
        // (EPIPE in its socket error). Left here, the daemon reads the end and
        // half-closes the peer itself once everything was delivered. And once
        // a segment of this direction was left to the daemon (below), every
        // later one follows it: redirected, it would overtake that one.
        return SK_PASS;
    }
    if SOCKS.redirect_skb(&ctx, &mut peer, 0) != i64::from(SK_PASS) {
        // The peer left the map: it was reset or closed (the kernel unhashes a
        // socket on TCP_CLOSE). Dropping would let the kernel swallow everything
        // the sender still sends, at wire speed, until the daemon notices; passed,
        // the bytes wait in this socket, its window closes, and the daemon's write
        // to the dead peer ends the connection. The same holds for a peer not
        // yet in the map while the daemon links the two.
        // SAFETY: as above.
        unsafe { (*link).passed = 1 };
        count(Counter::RedirectFailures, 1);
        debug!(&ctx, "splice: redirect from socket {} to {} failed", cookie, peer);
        return SK_PASS;
    }
    // SAFETY: as above.
    unsafe { (*link).redirected += len };
    count(
        if direction == DIRECTION_UP {
            Counter::BytesUp
        } else {
            Counter::BytesDown
        },
        len,
    );
    SK_PASS
}

#[map]
static UDP_CONFIG: Array<UdpRedirect> = Array::with_max_entries(1, 0);

#[map]
static UDP_FLOWS: LruHashMap<u64, u64> = LruHashMap::with_max_entries(MAX_UDP_FLOWS, 0);

/// Offsets in a loopback frame: a 14-byte Ethernet header, then IPv4 without options.
const ETH_TYPE: usize = 12;
const IP: usize = 14;
const IP_CHECK: usize = IP + 10;
const IP_SRC: usize = IP + 12;
const IP_DST: usize = IP + 16;
const UDP: usize = IP + 20;
const UDP_SRC: usize = UDP;
const UDP_DST: usize = UDP + 2;
const UDP_CHECK: usize = UDP + 6;
const HEADERS: u32 = (UDP + 8) as u32;

/// Never ends the chain: TC_ACT_UNSPEC is "next program" under TCX and "no
/// verdict, continue" under cls_bpf, so other programs on the hook (another
/// Webship, a CNI) still see every packet, rewritten or not.
#[classifier]
pub fn webship_udp(ctx: TcContext) -> i32 {
    let _ = redirect_udp(&ctx);
    TC_ACT_UNSPEC
}

fn redirect_udp(ctx: &TcContext) -> Result<(), i64> {
    let Some(cfg) = UDP_CONFIG.get(0) else {
        return Ok(());
    };
    if cfg.enabled == 0 {
        return Ok(());
    }
    // EtherType 0x0800 and a 20-byte IPv4 header carrying UDP; all else passes.
    if ctx.load::<u16>(ETH_TYPE)? != u16::to_be(0x0800)
        || ctx.load::<u8>(IP)? != 0x45
        || ctx.load::<u8>(IP + 9)? != 17
    {
        return Ok(());
    }
    let (src, dst): (u32, u32) = (ctx.load(IP_SRC)?, ctx.load(IP_DST)?);
    let (sport, dport): (u16, u16) = (ctx.load(UDP_SRC)?, ctx.load(UDP_DST)?);
    // A GSO super-packet carries many datagrams; payload bytes as userspace counts them.
    // SAFETY: the context pointer is the kernel's `__sk_buff` for this program run.
    let segments = u64::from(unsafe { (*ctx.skb.skb).gso_segs }.max(1));
    let payload = u64::from(ctx.len().saturating_sub(HEADERS));
    if dst == cfg.listen_ip && dport == cfg.listen_port {
        let key = flow_key(src, sport);
        // SAFETY: the value is only checked for presence.
        if unsafe { UDP_FLOWS.get(&key) }.is_none() {
            if UDP_FLOWS.insert(&key, &0, 0).is_err() {
                count(Counter::RedirectFailures, 1);
                return Ok(());
            }
            count(Counter::UdpFlows, 1);
        }
        rewrite(ctx, IP_DST, dst, cfg.origin_ip, UDP_DST, dport, cfg.origin_port)?;
        count(Counter::UdpPacketsUp, segments);
        count(Counter::BytesUp, payload);
    } else if src == cfg.origin_ip && sport == cfg.origin_port {
        // SAFETY: as above.
        if unsafe { UDP_FLOWS.get(&flow_key(dst, dport)) }.is_none() {
            return Ok(()); // a client of the origin's own, not ours
        }
        rewrite(ctx, IP_SRC, src, cfg.listen_ip, UDP_SRC, sport, cfg.listen_port)?;
        count(Counter::UdpPacketsDown, segments);
        count(Counter::BytesDown, payload);
    }
    Ok(())
}

/// Replaces one address and port, patching the IPv4 and UDP checksums
/// incrementally (the address is in UDP's pseudo-header; a zero UDP checksum means
/// none and stays zero).
fn rewrite(
    ctx: &TcContext,
    ip_at: usize,
    old_ip: u32,
    new_ip: u32,
    port_at: usize,
    old_port: u16,
    new_port: u16,
) -> Result<(), i64> {
    let mangled = u64::from(BPF_F_MARK_MANGLED_0);
    ctx.l3_csum_replace(IP_CHECK, u64::from(old_ip), u64::from(new_ip), 4)?;
    ctx.l4_csum_replace(
        UDP_CHECK,
        u64::from(old_ip),
        u64::from(new_ip),
        u64::from(BPF_F_PSEUDO_HDR) | mangled | 4,
    )?;
    ctx.store(ip_at, &new_ip, 0)?;
    ctx.l4_csum_replace(UDP_CHECK, u64::from(old_port), u64::from(new_port), mangled | 2)?;
    ctx.store(port_at, &new_port, 0)?;
    Ok(())
}

#[map]
static TCP_TAGS: LruHashMap<u64, u32> = LruHashMap::with_max_entries(TCP_TAGS_DEFAULT, 0);

#[map]
static TCP_PORTS: HashMap<u32, u32> = HashMap::with_max_entries(MAX_TCP_PORTS, 0);

#[map]
static TCP_SITES: PerCpuArray<TcpSite> = PerCpuArray::with_max_entries(MAX_TCP_SITES, 0);

/// Written only by the daemon; declared here so that it is created and pinned
/// beside the site counters.
#[map]
static TCP_SITE_NAMES: Array<SiteName> = Array::with_max_entries(MAX_TCP_SITES, 0);

/// Always 1: a `sock_ops` verdict only matters for the ops that ask for a reply,
/// and this program answers none of them.
#[sock_ops]
pub fn webship_tcp(ctx: SockOpsContext) -> u32 {
    let _ = watch_tcp(&ctx);
    1
}

fn watch_tcp(ctx: &SockOpsContext) -> Option<()> {
    match ctx.op() {
        BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB => {
            // SAFETY: the value is only checked for presence.
            unsafe { TCP_PORTS.get(&ctx.local_port()) }?;
            // Other programs on the cgroup may have asked for callbacks too: add ours.
            let flags = BPF_SOCK_OPS_STATE_CB_FLAG | BPF_SOCK_OPS_RETRANS_CB_FLAG | BPF_SOCK_OPS_RTO_CB_FLAG;
            let _ = ctx.set_cb_flags((ctx.cb_flags() | flags) as i32);
        }
        BPF_SOCK_OPS_RETRANS_CB => {
            // args: the first segment's sequence number, segments, error (0: sent).
            if ctx.arg(2) == 0 {
                let site = tagged_site(ctx, false)?;
                // SAFETY: a per-CPU slot, written only on this CPU with preemption off.
                unsafe { (*site).retransmits += u64::from(ctx.arg(1)) };
            }
        }
        BPF_SOCK_OPS_RTO_CB => {
            let site = tagged_site(ctx, false)?;
            // SAFETY: as above.
            unsafe { (*site).rto += 1 };
        }
        BPF_SOCK_OPS_STATE_CB if ctx.arg(1) == BPF_TCP_CLOSE => {
            let site = tagged_site(ctx, true)?;
            closed(ctx, site);
        }
        _ => {}
    }
    Some(())
}

/// The counters of the site the socket was tagged with; `untag`: the socket is
/// closing, its tag goes.
#[inline(always)]
fn tagged_site(ctx: &SockOpsContext, untag: bool) -> Option<*mut TcpSite> {
    // SAFETY: the helper only reads the socket the context belongs to.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.ops.cast()) };
    // SAFETY: the value is copied out at once.
    let slot = *unsafe { TCP_TAGS.get(&cookie) }?;
    if untag {
        let _ = TCP_TAGS.remove(&cookie);
    }
    TCP_SITES.get_ptr_mut(slot)
}

/// A tagged socket's last state change: what it moved and how the path looked.
#[inline(always)]
fn closed(ctx: &SockOpsContext, site: *mut TcpSite) {
    // SAFETY: `ops` is the kernel's context for this run; these fields read the full
    // socket a state callback always has.
    let (srtt8, mss, delivered, interval, acked, received) = unsafe {
        let o = &*ctx.ops;
        (
            o.srtt_us,
            o.mss_cache,
            o.rate_delivered,
            o.rate_interval_us,
            o.bytes_acked,
            o.bytes_received,
        )
    };
    let old = ctx.arg(0);
    // SAFETY: a per-CPU slot, written only on this CPU with preemption off.
    let s = unsafe { &mut *site };
    s.closed += 1;
    if old == BPF_TCP_ESTABLISHED || old == BPF_TCP_CLOSE_WAIT {
        s.reset += 1;
    }
    s.bytes_acked += acked;
    s.bytes_received += received;
    // The kernel keeps the smoothed RTT in eighths of a microsecond.
    let rtt = u64::from(srtt8 >> 3);
    s.rtt_sum_us += rtt;
    if let Some(b) = s.rtt.get_mut(bucket(rtt, RTT_BUCKETS)) {
        *b += 1;
    }
    // The last rate sample: segments delivered over its interval (what `ss` shows
    // as delivery_rate), in bytes per second.
    if interval > 0 && delivered > 0 {
        let rate = u64::from(delivered) * u64::from(mss) * 1_000_000 / u64::from(interval);
        s.rate_sum += rate;
        s.rate_samples += 1;
        if let Some(b) = s.rate.get_mut(bucket(rate, RATE_BUCKETS)) {
            *b += 1;
        }
    }
}

#[map]
static QUIC_SOCKETS: ReusePortSockArray = ReusePortSockArray::with_max_entries(MAX_QUIC_SOCKETS, 0);

const IPPROTO_UDP: u32 = 17;

/// Always SK_PASS: a datagram this program does not steer is placed by the
/// kernel's hash (SK_DROP would drop it).
#[sk_reuseport]
pub fn webship_quic_steer(ctx: SkReuseportContext) -> u32 {
    if ctx.ip_protocol() == IPPROTO_UDP {
        let mut head = [0u8; QUIC_HEAD_LEN];
        // SAFETY: the helper copies at most `QUIC_HEAD_LEN` bytes into `head`, which
        // has exactly that many, and fails (non-zero) on a shorter packet. The data
        // start at the UDP header, whatever part of the datagram is linear.
        let loaded = unsafe {
            bpf_skb_load_bytes(
                ctx.as_ptr(),
                UDP_HEADER_LEN,
                head.as_mut_ptr().cast(),
                QUIC_HEAD_LEN as u32,
            )
        };
        if loaded == 0 {
            if let Some(index) = quic_socket(&head, MAX_QUIC_SOCKETS) {
                // An empty slot (a socket the daemon has not added) fails: the hash decides.
                let _ = QUIC_SOCKETS.select_reuseport(&ctx, index);
            }
        }
    }
    SK_PASS
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
