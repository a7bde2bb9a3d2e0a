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

#![no_std]
#![no_main]

use aya_ebpf::bindings::sk_action::SK_PASS;
use aya_ebpf::bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, TC_ACT_UNSPEC};
use aya_ebpf::helpers::bpf_get_socket_cookie;
use aya_ebpf::macros::{classifier, map, stream_verdict};
use aya_ebpf::maps::{Array, HashMap, LruHashMap, PerCpuArray, SockHash};
use aya_ebpf::programs::{SkBuffContext, TcContext};
use aya_log_ebpf::debug;
use webship_ebpf_common::{
    flow_key, Counter, Link, UdpRedirect, COUNTERS, DIRECTION_UP, MAX_SPLICED_SOCKETS, MAX_UDP_FLOWS,
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
    let (mut peer, direction) = unsafe { ((*link).peer, (*link).direction) };
    if len == 0 {
        // A bare FIN carries nothing to move: redirected to the peer's
        // egress, the kernel's sender fails on it and breaks the peer's pipe
        // (EPIPE in its socket error). Left here, the daemon reads the end and
        // half-closes the peer itself once everything was delivered.
        return SK_PASS;
    }
    if SOCKS.redirect_skb(&ctx, &mut peer, 0) != i64::from(SK_PASS) {
        // The peer left the map: it was reset or closed (the kernel unhashes a
        // socket on TCP_CLOSE). Dropping would let the kernel swallow everything
        // the sender still sends, at wire speed, until the daemon notices; passed,
        // the bytes wait in this socket, its window closes, and the daemon's write
        // to the dead peer ends the connection.
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

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
