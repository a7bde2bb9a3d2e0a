//! Webship's eBPF programs.
//!
//! `webship_splice`, an `sk_skb` stream verdict attached to the `SOCKS` SOCKHASH:
//! every segment a spliced socket receives is redirected to the egress of its peer
//! (looked up in `LINKS` by the receiving socket's cookie), so passthrough bytes
//! never reach userspace. Per-CPU counters record what was moved and what could not
//! be; the daemon sums them for `webship stats`.

#![no_std]
#![no_main]

use aya_ebpf::bindings::sk_action::{SK_DROP, SK_PASS};
use aya_ebpf::helpers::bpf_get_socket_cookie;
use aya_ebpf::macros::{map, stream_verdict};
use aya_ebpf::maps::{Array, HashMap, PerCpuArray, SockHash};
use aya_ebpf::programs::SkBuffContext;
use aya_log_ebpf::debug;
use webship_ebpf_common::{Counter, Link, COUNTERS, DIRECTION_UP, MAX_SPLICED_SOCKETS};

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
        debug!(&ctx, "splice: socket {} has no link, {} bytes left for userspace", cookie, len);
        return SK_PASS;
    };
    // SAFETY: `link` points into the map value for this socket, which only this
    // socket's (serialized) receive path writes after the daemon created it.
    let (mut peer, direction) = unsafe { ((*link).peer, (*link).direction) };
    if SOCKS.redirect_skb(&ctx, &mut peer, 0) != i64::from(SK_PASS) {
        count(Counter::RedirectFailures, 1);
        debug!(&ctx, "splice: redirect from socket {} to {} failed", cookie, peer);
        return SK_DROP;
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

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
