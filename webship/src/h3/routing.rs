//! Which socket of a process's HTTP/3 group owns a datagram, and the in-process
//! hand-off between them.
//!
//! A process serves HTTP/3 on a [`Group`] of UDP sockets (`h3_sockets`), one quinn
//! endpoint each, all bound to the listen address with `SO_REUSEPORT`, so the kernel
//! spreads datagrams over them by a hash of the 4-tuple and each endpoint's driver
//! can run on its own worker thread. The first byte of every connection ID names the
//! socket whose endpoint owns the connection (`generation::CidGenerator` writes it,
//! in plaintext, as QUIC-LB's plaintext mode does: an observer learns which of the
//! process's sockets serves a connection, and so a lower bound on how many there
//! are; nothing links two IDs of one connection). The generation's tag covers that
//! byte, so any generation recognises another's IDs by its key.
//!
//! A connection's datagrams keep their 4-tuple and so their socket; when the 4-tuple
//! changes (the client migrates or rebinds its port) or the group grows (a takeover
//! adds sockets), a datagram can land on another socket. [`Group::route`] says whose
//! it is (short headers by the index byte, long headers of a handshake by the shared
//! handshake table), and the socket that read it parks it in the owner's [`Inbox`]
//! ([`Group::hand_to`]: counted as misrouted; a full inbox drops it, counted, and QUIC
//! retransmits). The owner takes its inbox beside its own socket, never instead of it
//! ([`Group::recv`]): a client spraying one connection's packets from many ports
//! keeps an inbox fed, and must not stall the socket's other connections. A socket's
//! endpoint accepts only IDs carrying its own index (`validate`), so a misrouted
//! datagram never makes it send a stateless reset for a sibling's connection.
//!
//! With eBPF loaded, an SK_REUSEPORT program on the group
//! (`ebpf::Programs::steer_quic`) reads the index byte and sends each datagram to the
//! owning socket in the kernel, sparing the hop; this hand-off stays for what it does
//! not steer (long headers, whose DCID a client may choose) and is the whole mechanism
//! with `[kernel] ebpf = "off"`. During a takeover the draining process's first socket
//! reads the successor's pair (`generation`) and hands each datagram to the owning
//! sibling the same way; the others read nothing but their inbox.

use std::collections::VecDeque;
use std::io::{self, IoSliceMut};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use quinn::udp::{EcnCodepoint, RecvMeta};
use webship_ebpf_common::{CID_SOCKET_BYTE, SHORT_HEADER_DCID_OFFSET};

use super::generation::{GenerationKey, Handshakes, CID_LEN};
use super::lock;

/// The most UDP sockets (endpoints) one process serves HTTP/3 on (`h3_sockets`).
pub(crate) const MAX_SOCKETS: usize = 32;
const _: () = assert!(MAX_SOCKETS == webship_ebpf_common::MAX_QUIC_SOCKETS as usize);
/// Datagrams waiting in one socket's [`Inbox`], at most.
const INBOX_DATAGRAMS: usize = 1024;
/// Bytes of datagrams waiting in one socket's [`Inbox`], at most: a datagram may be
/// up to 64 KiB, so the count alone would let 1024 of them hold 64 MiB per socket.
const INBOX_BYTES: usize = 1536 * 1024;

/// The destination connection ID of datagram `d`, and whether its header is long.
pub(super) fn dcid(d: &[u8]) -> Option<(&[u8], bool)> {
    let &first = d.first()?;
    if first & 0x80 == 0 {
        // The offset the kernel's steering program reads too (`quic_socket`).
        let at = SHORT_HEADER_DCID_OFFSET;
        return Some((d.get(at..at + CID_LEN)?, false));
    }
    // Long header: flags, version (4), DCID length, DCID.
    let len = usize::from(*d.get(5)?);
    Some((d.get(6..6 + len)?, true))
}

/// A datagram read by one socket for a sibling's connection.
#[derive(Debug)]
struct Parked {
    addr: SocketAddr,
    ecn: Option<EcnCodepoint>,
    dst_ip: Option<IpAddr>,
    /// Its own allocation: misrouting is rare (a migration, a group that grew).
    data: Vec<u8>,
}

/// Where a socket's misrouted datagrams wait for its endpoint driver, which the
/// waker wakes (also after a mode switch).
#[derive(Debug, Default)]
struct Inbox {
    queue: Mutex<Parking>,
    waker: Mutex<Option<Waker>>,
}

/// The datagrams in an [`Inbox`] and their bytes, bounded by [`INBOX_DATAGRAMS`]
/// and [`INBOX_BYTES`].
#[derive(Debug, Default)]
struct Parking {
    datagrams: VecDeque<Parked>,
    bytes: usize,
}

impl Parking {
    fn push(&mut self, p: Parked) -> bool {
        if self.datagrams.len() >= INBOX_DATAGRAMS || self.bytes + p.data.len() > INBOX_BYTES {
            return false;
        }
        self.bytes += p.data.len();
        self.datagrams.push_back(p);
        true
    }

    fn pop(&mut self) -> Option<Parked> {
        let p = self.datagrams.pop_front()?;
        self.bytes -= p.data.len();
        Some(p)
    }
}

impl Inbox {
    fn wake(&self) {
        if let Some(w) = lock(&self.waker).as_ref() {
            w.wake_by_ref();
        }
    }
}

/// Where a datagram a socket read goes, as far as the group is concerned.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Route {
    Keep,
    Sibling(usize),
}

/// The UDP sockets one process serves HTTP/3 on (one quinn endpoint each): the key
/// their IDs are tagged with, each socket's inbox, the handshakes they started.
#[derive(Debug)]
pub(crate) struct Group {
    key: GenerationKey,
    inboxes: Vec<Inbox>,
    handshakes: Arc<Handshakes>,
}

impl Group {
    /// A group of `sockets` sockets (at most [`MAX_SOCKETS`]).
    pub(crate) fn new(key: GenerationKey, sockets: usize, handshakes: Arc<Handshakes>) -> Arc<Self> {
        let sockets = sockets.clamp(1, MAX_SOCKETS);
        SOCKETS_SEEN.fetch_max(sockets, Ordering::Relaxed);
        Arc::new(Self {
            key,
            inboxes: (0..sockets).map(|_| Inbox::default()).collect(),
            handshakes,
        })
    }

    /// How many sockets the group has.
    pub(super) fn len(&self) -> usize {
        self.inboxes.len()
    }

    fn inbox(&self, index: u8) -> &Inbox {
        &self.inboxes[usize::from(index)]
    }

    /// Wakes socket `index`'s endpoint driver (its inbox has news, or its mode changed).
    pub(super) fn wake(&self, index: u8) {
        self.inbox(index).wake();
    }

    /// Where datagram `d`, read by socket `index`, goes: to the sibling socket whose
    /// endpoint owns its connection, or to this socket's endpoint.
    pub(super) fn route(&self, index: u8, d: &[u8]) -> Route {
        let sockets = self.len();
        if sockets < 2 {
            return Route::Keep;
        }
        let Some((cid, long)) = dcid(d) else {
            return Route::Keep;
        };
        if cid.len() == CID_LEN {
            let owner = usize::from(cid[CID_SOCKET_BYTE]);
            let ours = owner == usize::from(index);
            if ours && !long {
                // Ours by its index byte (a forged one is dropped by `validate`). A
                // long header's ID may be a client's choice: it goes by the table.
                return Route::Keep;
            }
            if owner < sockets && self.key.issued(cid) {
                return if ours { Route::Keep } else { Route::Sibling(owner) };
            }
        }
        match long.then(|| self.handshakes.owner(cid)).flatten() {
            Some(owner) if owner != index && usize::from(owner) < sockets => {
                Route::Sibling(usize::from(owner))
            }
            _ => Route::Keep,
        }
    }

    /// Parks datagram `d` in socket `owner`'s inbox and wakes its driver; false when
    /// the inbox is full.
    pub(super) fn hand_to(&self, owner: usize, m: &RecvMeta, d: &[u8]) -> bool {
        let inbox = &self.inboxes[owner];
        let parked = Parked {
            addr: m.addr,
            ecn: m.ecn,
            dst_ip: m.dst_ip,
            data: d.to_vec(),
        };
        if !lock(&inbox.queue).push(parked) {
            return false;
        }
        inbox.wake();
        true
    }

    /// One receive for socket `index`: what `own` reads from the socket itself, and
    /// what waits in its inbox. While datagrams wait, the socket reads into half the
    /// buffers and they take the rest (all of it when the socket has nothing): a
    /// sibling kept busy handing datagrams over (a client spraying one connection's
    /// packets from many ports) must not starve this socket's own connections, nor
    /// they the handed-over ones. Remembers the waker for [`Group::hand_to`].
    pub(super) fn recv(
        &self,
        index: u8,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
        own: impl FnOnce(&mut Context<'_>, &mut [IoSliceMut<'_>], &mut [RecvMeta]) -> Poll<io::Result<usize>>,
    ) -> Poll<io::Result<usize>> {
        self.remember(index, cx.waker());
        let room = bufs.len().min(meta.len());
        // A lone socket has no sibling to park anything for it.
        let siblings = self.len() > 1;
        let waiting = siblings && !lock(&self.inbox(index).queue).datagrams.is_empty();
        let share = if waiting { room - room / 2 } else { room };
        let read = own(cx, &mut bufs[..share], &mut meta[..share]);
        let msgs = match read {
            Poll::Ready(Ok(n)) => n,
            Poll::Pending => 0,
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
        };
        let parked = if siblings {
            self.take_parked(index, &mut bufs[msgs..room], &mut meta[msgs..room])
        } else {
            0
        };
        if read.is_pending() && parked == 0 {
            return Poll::Pending;
        }
        Poll::Ready(Ok(msgs + parked))
    }

    fn remember(&self, index: u8, waker: &Waker) {
        let mut slot = lock(&self.inbox(index).waker);
        if !slot.as_ref().is_some_and(|w| w.will_wake(waker)) {
            *slot = Some(waker.clone());
        }
    }

    /// Moves datagrams parked for socket `index` into `bufs`; how many.
    fn take_parked(&self, index: u8, bufs: &mut [IoSliceMut<'_>], meta: &mut [RecvMeta]) -> usize {
        let mut queue = lock(&self.inbox(index).queue);
        let mut filled = 0;
        while filled < bufs.len().min(meta.len()) {
            let Some(p) = queue.pop() else { break };
            let Some(dst) = bufs[filled].get_mut(..p.data.len()) else {
                continue;
            };
            dst.copy_from_slice(&p.data);
            meta[filled] = RecvMeta {
                addr: p.addr,
                len: p.data.len(),
                stride: p.data.len(),
                ecn: p.ecn,
                dst_ip: p.dst_ip,
            };
            filled += 1;
        }
        filled
    }
}

/// Per socket index: datagrams read from the UDP socket, those among them handed to
/// a sibling (misrouted), and those dropped because the sibling's inbox was full.
static SOCKET_COUNTS: [[AtomicU64; 3]; MAX_SOCKETS] =
    [const { [const { AtomicU64::new(0) }; 3] }; MAX_SOCKETS];
/// The most sockets a group of this process has had (the counters' extent).
static SOCKETS_SEEN: AtomicUsize = AtomicUsize::new(0);

/// Which of a socket's counters [`count`] adds to.
#[derive(Debug, Clone, Copy)]
pub(super) enum Counter {
    Received = 0,
    Misrouted = 1,
    Dropped = 2,
}

/// Adds `n` to socket `index`'s `which` counter.
pub(super) fn count(index: u8, which: Counter, n: u64) {
    if n > 0 {
        SOCKET_COUNTS[usize::from(index)][which as usize].fetch_add(n, Ordering::Relaxed);
    }
}

/// One socket's counters (see [`SOCKET_COUNTS`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SocketCounts {
    pub(crate) received: u64,
    pub(crate) misrouted: u64,
    pub(crate) dropped: u64,
}

/// Every socket's counters since the process started, by socket index.
pub(crate) fn socket_counts() -> Vec<SocketCounts> {
    SOCKET_COUNTS
        .iter()
        .take(SOCKETS_SEEN.load(Ordering::Relaxed))
        .map(|c| SocketCounts {
            received: c[Counter::Received as usize].load(Ordering::Relaxed),
            misrouted: c[Counter::Misrouted as usize].load(Ordering::Relaxed),
            dropped: c[Counter::Dropped as usize].load(Ordering::Relaxed),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use quinn::{ConnectionIdGenerator, Runtime};

    use super::*;
    use crate::h3::generation::CidGenerator;
    use crate::h3::testing::{long, loopback_udp, runtime, short};

    /// Socket 1 of a group of three keeps its own connections' datagrams and hands
    /// the others' to their sockets: short headers by the ID's index byte, long
    /// headers of a handshake by the table; anything else (another generation's
    /// IDs, a new client's Initial) stays where the kernel put it.
    #[test]
    fn a_socket_hands_its_siblings_their_datagrams() {
        let key = GenerationKey::random().unwrap();
        let handshakes = Arc::<Handshakes>::default();
        let group = Group::new(key, 3, handshakes.clone());
        let ours = CidGenerator::new(key, 1).generate_cid();
        let theirs = CidGenerator::new(key, 2).generate_cid();
        let stranger = CidGenerator::new(GenerationKey::random().unwrap(), 2).generate_cid();
        let initial = [5u8; 8];
        handshakes.started(&[6u8; 8], 0);
        let route = |d: &[u8]| group.route(1, d);
        assert_eq!(route(&short(&ours)), Route::Keep);
        assert_eq!(route(&short(&theirs)), Route::Sibling(2));
        assert_eq!(route(&long(&theirs)), Route::Sibling(2));
        assert_eq!(route(&short(&stranger)), Route::Keep);
        assert_eq!(route(&long(&initial)), Route::Keep);
        assert_eq!(route(&long(&[6u8; 8])), Route::Sibling(0));
        // A client may choose a 12-byte ID that starts with this socket's index: a
        // long header goes by the table all the same.
        let chosen = [1u8; CID_LEN];
        handshakes.started(&chosen, 2);
        assert_eq!(route(&long(&chosen)), Route::Sibling(2));
        assert_eq!(route(&long(&ours)), Route::Keep);
        assert_eq!(route(&[0x40, 2]), Route::Keep);
    }

    /// The inbox holds at most [`INBOX_BYTES`] as well as [`INBOX_DATAGRAMS`]: large
    /// datagrams fill it long before the count does.
    #[test]
    fn an_inbox_is_bounded_in_bytes() {
        let mut p = Parking::default();
        let parked = |len: usize| Parked {
            addr: "127.0.0.1:1".parse().unwrap(),
            ecn: None,
            dst_ip: None,
            data: vec![0; len],
        };
        let big = 65_000;
        let fit = INBOX_BYTES / big;
        for _ in 0..fit {
            assert!(p.push(parked(big)));
        }
        assert!(!p.push(parked(big)), "the byte bound let one more in");
        assert!(p.datagrams.len() < INBOX_DATAGRAMS);
        assert!(p.pop().is_some());
        assert_eq!(p.bytes, (fit - 1) * big);
        assert!(p.push(parked(big)));
    }

    /// A sibling that keeps this socket's inbox full (a client spraying one
    /// connection's packets from many source ports) must not stop the socket's own
    /// datagrams from being read.
    #[test]
    fn a_full_inbox_does_not_starve_the_socket() {
        let key = GenerationKey::random().unwrap();
        let group = Group::new(key, 2, Arc::default());
        let (udp, to) = loopback_udp();
        let rt = runtime();
        let _guard = rt.enter();
        let udp = quinn::TokioRuntime.wrap_udp_socket(udp).unwrap();
        let client = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let own = client.local_addr().unwrap();
        client.send_to(b"own datagram", to).unwrap();
        let sprayed = RecvMeta {
            addr: "127.0.0.2:9".parse().unwrap(),
            ..RecvMeta::default()
        };
        let refill = || while group.hand_to(1, &sprayed, &[7; 100]) {};
        let read_own = async {
            let mut storage = vec![[0u8; 1500]; 8];
            let mut meta = [RecvMeta::default(); 8];
            loop {
                refill();
                let mut bufs: Vec<IoSliceMut<'_>> = storage.iter_mut().map(|b| IoSliceMut::new(b)).collect();
                let n = std::future::poll_fn(|cx| {
                    Poll::Ready(group.recv(1, cx, &mut bufs, &mut meta, |cx, b, m| udp.poll_recv(cx, b, m)))
                })
                .await;
                if let Poll::Ready(n) = n {
                    if meta[..n.unwrap()].iter().any(|m| m.addr == own) {
                        return;
                    }
                }
                // Lets the reactor see the socket readable.
                tokio::task::yield_now().await;
            }
        };
        rt.block_on(async { tokio::time::timeout(Duration::from_secs(10), read_own).await })
            .expect("the socket's own datagram was never read while its inbox stayed full");
    }
}
