//! QUIC across a binary upgrade: whose datagram is this?
//!
//! During a takeover two processes share one UDP socket (the successor received a
//! duplicate of the descriptor), and a datagram reaches whichever reads it first. A
//! quinn endpoint answers a datagram for a connection it does not know with a
//! stateless reset, so each process must see only its own connections' datagrams.
//!
//! The mechanism, chosen because it needs nothing from the kernel (it works the same
//! with `[kernel] ebpf = "off"`, and an SK_REUSEPORT program could not see a shared
//! socket's readers apart anyway):
//!
//! * **Tagged connection IDs.** Every process generation has a random
//!   [`GenerationKey`]. The connection IDs it issues ([`CidGenerator`]) are
//!   [`CID_LEN`] bytes: 8 bytes that look random (SipHash of a counter under a secret
//!   key) and a 4-byte tag, SipHash-2-4 of those 8 bytes under the generation's other
//!   secret key. Whoever holds the key recognises its IDs; an observer cannot link two
//!   IDs of one connection. A client-chosen Initial DCID carries a valid tag with
//!   probability 2⁻³² (and must also be exactly 12 bytes long). SipHash-2-4 is a
//!   fixed algorithm, so old and new binaries, whatever compiler built them, agree.
//! * **One reader at a time.** Before the running process hands its socket over, its
//!   endpoint stops reading the UDP socket ([`QuicSocket::forwarded`]): from then on
//!   its datagrams arrive on one end of a `SOCK_SEQPACKET` pair, and it still sends
//!   through its own copy of the UDP socket (same address, so clients notice
//!   nothing). The successor reads the UDP socket ([`QuicSocket::demux`]) and, while
//!   the predecessor lives, sends it through the pair every datagram whose DCID
//!   carries the predecessor's tag (short and long headers: Handshake packets of a
//!   handshake the old process answered carry its ID), plus the long-header packets
//!   whose DCID is the client-chosen ID of a handshake the old process had started
//!   (their list travels in the takeover; Initial retransmissions and 0-RTT use it
//!   until the client hears the server). Nothing else is forwarded.
//! * **Bounded.** The pair's socket buffers bound what is queued; a datagram that
//!   does not fit is dropped (counted, QUIC retransmits). When the predecessor
//!   exits, the pair breaks and forwarding stops for good: its connections are gone,
//!   and the successor's endpoint ignores their datagrams (its `validate` rejects IDs
//!   it did not issue, so it does not even reset them).
//! * **Undo.** If the successor fails before it serves, the predecessor goes back to
//!   reading the UDP socket itself ([`QuicSocket::direct`]); datagrams that queued in
//!   the socket meanwhile are read then.
//!
//! **Several sockets per process** (`h3_sockets`): one quinn endpoint per UDP socket,
//! all bound to the listen address with `SO_REUSEPORT`, so the kernel spreads
//! datagrams over them by a hash of the 4-tuple and each endpoint's driver can run
//! on its own worker thread. The sockets of one process form a [`Group`]. The first
//! byte of every connection ID names the socket whose endpoint owns the connection
//! (in plaintext, as QUIC-LB's plaintext mode does: an observer learns which of the
//! process's sockets serves a connection, and so a lower bound on how many there
//! are; nothing links two IDs of one connection). The tag covers that byte, so the
//! layout is the same 12 bytes and any generation recognises another's IDs by its
//! key as before. A connection's datagrams keep their 4-tuple and so their socket;
//! when the 4-tuple changes (the client migrates or rebinds its port) or the group
//! grows (a takeover adds sockets), a datagram can land on another socket: that
//! socket hands it to the owner's [`Inbox`] (counted as misrouted; a full inbox
//! drops it, counted, and QUIC retransmits). The owner takes its inbox beside its own
//! socket, never instead of it: a client spraying one connection's packets from many
//! ports keeps an inbox fed, and must not stall the socket's other connections. A socket's endpoint accepts only IDs
//! carrying its own index (`validate`), so a misrouted datagram never makes it
//! send a stateless reset for a sibling's connection. With eBPF loaded, an
//! SK_REUSEPORT program on the group (`ebpf::Programs::steer_quic`) reads the index
//! byte and sends each datagram to the owning socket in the kernel, sparing the
//! hop; the in-process hand-off stays for what it does not steer (long headers,
//! whose DCID a client may choose) and is the whole mechanism with `[kernel] ebpf = "off"`. During a
//! takeover the draining process's first socket reads the pair and hands each
//! datagram to the owning sibling the same way; the others read nothing but their
//! inbox.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{self, IoSliceMut, Read};
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsFd, OwnedFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use quinn::udp::{EcnCodepoint, RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, ConnectionId, ConnectionIdGenerator, UdpPoller};
use tokio::io::unix::AsyncFd;
use webship_ebpf_common::{CID_SOCKET_BYTE, SHORT_HEADER_DCID_OFFSET};

use super::batch::{Batcher, Writable};
use super::lock;
use crate::sys::fdpass;

/// Length of the connection IDs every generation issues (8 bytes of nonce, the first
/// of them the owning socket's index, then 4 of tag).
pub(crate) const CID_LEN: usize = 12;
const NONCE_LEN: usize = 8;
/// The most UDP sockets (endpoints) one process serves HTTP/3 on (`h3_sockets`).
pub(crate) const MAX_SOCKETS: usize = 32;
// The kernel's steering program (`[kernel] ebpf`) reads the same layout.
const _: () = assert!(CID_LEN == webship_ebpf_common::QUIC_CID_LEN as usize);
// The socket index is a byte of the nonce, which the tag covers.
const _: () = assert!(CID_SOCKET_BYTE < NONCE_LEN);
const _: () = assert!(MAX_SOCKETS == webship_ebpf_common::MAX_QUIC_SOCKETS as usize);
/// Datagrams waiting in one socket's [`Inbox`], at most.
const INBOX_DATAGRAMS: usize = 1024;
/// Bytes of datagrams waiting in one socket's [`Inbox`], at most: a datagram may be
/// up to 64 KiB, so the count alone would let 1024 of them hold 64 MiB per socket.
const INBOX_BYTES: usize = 1536 * 1024;
/// Handshakes in progress whose client-chosen IDs travel in a takeover, at most.
pub(crate) const MAX_HANDSHAKES: usize = 4096;
/// Bytes before each forwarded datagram: source family, ECN, port, source address,
/// destination family, destination address.
const HEADER_LEN: usize = 1 + 1 + 2 + 16 + 1 + 16;

/// A generation's secret: two SipHash keys (nonce, tag).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct GenerationKey {
    nonce: (u64, u64),
    tag: (u64, u64),
}

impl std::fmt::Debug for GenerationKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GenerationKey(..)")
    }
}

impl GenerationKey {
    /// A fresh key from the kernel's random source.
    pub(crate) fn random() -> io::Result<Self> {
        let mut bytes = [0u8; 32];
        std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
        Ok(Self::from_bytes(bytes))
    }

    fn from_bytes(b: [u8; 32]) -> Self {
        let word = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
        Self {
            nonce: (word(0), word(1)),
            tag: (word(2), word(3)),
        }
    }

    /// The key as 64 hex digits (it travels in the takeover's JSON).
    pub(crate) fn to_hex(self) -> String {
        [self.nonce.0, self.nonce.1, self.tag.0, self.tag.1]
            .iter()
            .map(|w| format!("{:016x}", w.swap_bytes()))
            .collect()
    }

    pub(crate) fn from_hex(s: &str) -> Option<Self> {
        let bytes = hex(s)?;
        Some(Self::from_bytes(bytes.try_into().ok()?))
    }

    fn tag_of(&self, nonce: &[u8]) -> [u8; 4] {
        let t = siphash(self.tag, nonce).to_le_bytes();
        [t[0], t[1], t[2], t[3]]
    }

    /// Whether this generation issued `cid`.
    pub(crate) fn issued(&self, cid: &[u8]) -> bool {
        cid.len() == CID_LEN && self.tag_of(&cid[..NONCE_LEN]) == cid[NONCE_LEN..]
    }
}

#[allow(deprecated)] // std's SipHasher is SipHash-2-4, a fixed algorithm: what we need.
fn siphash(key: (u64, u64), data: &[u8]) -> u64 {
    use std::hash::Hasher;
    let mut h = std::hash::SipHasher::new_with_keys(key.0, key.1);
    h.write(data);
    h.finish()
}

pub(crate) fn hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || s.len() > 512 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

pub(crate) fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Issues this generation's connection IDs for the endpoint on socket `index` (one per
/// endpoint, made by quinn's factory).
pub(crate) struct CidGenerator {
    key: GenerationKey,
    index: u8,
    counter: u64,
}

impl CidGenerator {
    pub(crate) fn new(key: GenerationKey, index: u8) -> Self {
        Self {
            key,
            index,
            counter: 0,
        }
    }
}

impl ConnectionIdGenerator for CidGenerator {
    fn generate_cid(&mut self) -> ConnectionId {
        self.counter = self.counter.wrapping_add(1);
        let mut nonce = siphash(self.key.nonce, &self.counter.to_le_bytes()).to_le_bytes();
        nonce[CID_SOCKET_BYTE] = self.index;
        let mut cid = [0u8; CID_LEN];
        cid[..NONCE_LEN].copy_from_slice(&nonce);
        cid[NONCE_LEN..].copy_from_slice(&self.key.tag_of(&nonce));
        ConnectionId::new(&cid)
    }

    /// Only this socket's IDs: a sibling's (misrouted, or its inbox full) are dropped,
    /// never answered with a stateless reset.
    fn validate(&self, cid: &ConnectionId) -> Result<(), quinn_proto::InvalidCid> {
        if self.key.issued(cid) && cid[CID_SOCKET_BYTE] == self.index {
            Ok(())
        } else {
            Err(quinn_proto::InvalidCid)
        }
    }

    fn cid_len(&self) -> usize {
        CID_LEN
    }

    fn cid_lifetime(&self) -> Option<Duration> {
        None
    }
}

/// The client-chosen IDs of handshakes this process's endpoints started and have not
/// finished, each with the index of the socket whose endpoint started it.
#[derive(Debug, Default)]
pub(crate) struct Handshakes(Mutex<HashMap<Vec<u8>, u8>>);

impl Handshakes {
    pub(crate) fn started(&self, cid: &[u8], socket: u8) {
        let mut map = lock(&self.0);
        if map.len() < MAX_HANDSHAKES {
            map.insert(cid.to_vec(), socket);
        }
    }

    pub(crate) fn ended(&self, cid: &[u8]) {
        lock(&self.0).remove(cid);
    }

    fn owner(&self, cid: &[u8]) -> Option<u8> {
        lock(&self.0).get(cid).copied()
    }

    pub(crate) fn snapshot(&self) -> Vec<Vec<u8>> {
        lock(&self.0).keys().cloned().collect()
    }
}

/// The destination connection ID of datagram `d`, and whether its header is long.
fn dcid(d: &[u8]) -> Option<(&[u8], bool)> {
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
}

/// Per socket index: datagrams read from the UDP socket, those among them handed to
/// a sibling (misrouted), and those dropped because the sibling's inbox was full.
static SOCKET_COUNTS: [[AtomicU64; 3]; MAX_SOCKETS] =
    [const { [const { AtomicU64::new(0) }; 3] }; MAX_SOCKETS];
/// The most sockets a group of this process has had (the counters' extent).
static SOCKETS_SEEN: AtomicUsize = AtomicUsize::new(0);

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
            received: c[0].load(Ordering::Relaxed),
            misrouted: c[1].load(Ordering::Relaxed),
            dropped: c[2].load(Ordering::Relaxed),
        })
        .collect()
}

/// Where a datagram a socket read goes.
enum Route {
    Keep,
    Predecessor,
    Sibling(usize),
}

/// What a successor needs to send a draining predecessor its datagrams.
#[derive(Debug)]
pub(crate) struct Predecessor {
    pub(crate) key: GenerationKey,
    pub(crate) handshakes: HashSet<Vec<u8>>,
    pub(crate) pair: OwnedFd,
}

impl Predecessor {
    /// Whether the datagram `d` belongs to the predecessor's connections.
    fn owns(&self, d: &[u8]) -> bool {
        match dcid(d) {
            Some((cid, false)) => self.key.issued(cid),
            Some((cid, true)) => self.key.issued(cid) || self.handshakes.contains(cid),
            None => false,
        }
    }
}

#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct ForwardStats {
    pub(crate) forwarded: u64,
    pub(crate) dropped: u64,
}

#[derive(Debug)]
enum Mode {
    /// Reads the UDP socket: the normal state.
    Direct,
    /// A successor reads the UDP socket; this endpoint's datagrams come through the
    /// pair (the group's first socket reads it) or the inbox (the others).
    Forwarded(Option<AsyncFd<OwnedFd>>),
    /// A predecessor is draining: its datagrams go to it.
    Demux(Arc<Predecessor>),
}

/// The UDP socket under a quinn endpoint, able to switch between the three modes
/// above while the endpoint runs.
#[derive(Debug)]
pub(crate) struct QuicSocket {
    udp: Arc<dyn AsyncUdpSocket>,
    /// This socket's place in its group (the first byte of its connections' IDs).
    index: u8,
    group: Arc<Group>,
    mode: Mutex<Mode>,
    stats: Mutex<ForwardStats>,
    /// The largest datagram any connection on this endpoint may send: the highest
    /// `h3_mtu_upper_bound_bytes` a generation has used (only ever raised, since
    /// connections keep the bound they started with).
    largest_datagram: AtomicUsize,
    /// Cross-connection send batching (`h3_send_batch_delay_us`), built the first
    /// time it is turned on; see [`Batcher`].
    batch: std::sync::OnceLock<Arc<Batcher>>,
    /// A duplicate of the UDP socket for the batcher.
    raw: std::net::UdpSocket,
}

/// The most UDP payload one `sendmsg` may carry, GSO batch included: the IP length
/// field's 65,535 less an IPv6 header and the UDP header (IPv4 allows 20 bytes
/// more). Beyond it the kernel answers EMSGSIZE and quinn-udp drops the whole batch.
const GSO_BATCH_BYTES: usize = 65_535 - 40 - 8;

impl QuicSocket {
    /// Socket `index` of `group` (the index must be below the group's size).
    pub(crate) fn new(socket: std::net::UdpSocket, index: u8, group: Arc<Group>) -> io::Result<Arc<Self>> {
        use quinn::Runtime;
        if usize::from(index) >= group.inboxes.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "socket index outside its group",
            ));
        }
        Ok(Arc::new(Self {
            raw: socket.try_clone()?,
            batch: std::sync::OnceLock::new(),
            udp: quinn::TokioRuntime.wrap_udp_socket(socket)?,
            index,
            group,
            mode: Mutex::new(Mode::Direct),
            stats: Mutex::new(ForwardStats::default()),
            largest_datagram: AtomicUsize::new(1200),
        }))
    }

    /// Stops reading the UDP socket: datagrams arrive on `pair` from now on, or only
    /// in the inbox (from the sibling that reads the pair) without one.
    pub(crate) fn forwarded(&self, pair: Option<OwnedFd>) -> io::Result<()> {
        let fd = pair.map(fdpass::packet_reader).transpose()?;
        self.switch(Mode::Forwarded(fd));
        Ok(())
    }

    /// Reads the UDP socket again (a successor failed, or the predecessor is gone).
    pub(crate) fn direct(&self) {
        self.switch(Mode::Direct);
    }

    /// Forwards the predecessor's datagrams to it until it is gone.
    pub(crate) fn demux(&self, predecessor: Arc<Predecessor>) {
        self.switch(Mode::Demux(predecessor));
    }

    /// Connections accepted from now on may send datagrams of up to `bytes`
    /// (their DPLPMTUD upper bound); GSO batches shrink to fit.
    pub(crate) fn allow_datagrams_up_to(&self, bytes: u16) {
        self.largest_datagram
            .fetch_max(usize::from(bytes), Ordering::Relaxed);
    }

    /// Batches sends across connections with at most `delay_us` of delay (0: off;
    /// what is queued still leaves). Must run inside the tokio runtime.
    pub(crate) fn batch_sends(&self, delay_us: u64) -> io::Result<()> {
        if let Some(b) = self.batch.get() {
            b.set_delay(delay_us);
        } else if delay_us > 0 && cfg!(target_os = "linux") {
            let b = Batcher::new(self.raw.try_clone()?, delay_us)?;
            if let Err(b) = self.batch.set(b) {
                // Another caller won the race; use its batcher.
                drop(b);
                if let Some(b) = self.batch.get() {
                    b.set_delay(delay_us);
                }
            }
        }
        Ok(())
    }

    pub(crate) fn forward_stats(&self) -> ForwardStats {
        *lock(&self.stats)
    }

    fn switch(&self, mode: Mode) {
        *lock(&self.mode) = mode;
        self.inbox().wake();
    }

    fn inbox(&self) -> &Inbox {
        &self.group.inboxes[usize::from(self.index)]
    }

    fn remember(&self, waker: &Waker) {
        let mut slot = lock(&self.inbox().waker);
        if !slot.as_ref().is_some_and(|w| w.will_wake(waker)) {
            *slot = Some(waker.clone());
        }
    }

    fn count(&self, which: usize, n: u64) {
        if n > 0 {
            SOCKET_COUNTS[usize::from(self.index)][which].fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Where datagram `d` goes: to a draining predecessor, to the sibling socket whose
    /// endpoint owns its connection, or to this socket's endpoint.
    fn route(&self, pred: Option<&Predecessor>, d: &[u8]) -> Route {
        if pred.is_some_and(|p| p.owns(d)) {
            return Route::Predecessor;
        }
        let sockets = self.group.inboxes.len();
        if sockets < 2 {
            return Route::Keep;
        }
        let Some((cid, long)) = dcid(d) else {
            return Route::Keep;
        };
        if cid.len() == CID_LEN {
            let owner = usize::from(cid[CID_SOCKET_BYTE]);
            let ours = owner == usize::from(self.index);
            if ours && !long {
                // Ours by its index byte (a forged one is dropped by `validate`). A
                // long header's ID may be a client's choice: it goes by the table.
                return Route::Keep;
            }
            if owner < sockets && self.group.key.issued(cid) {
                return if ours { Route::Keep } else { Route::Sibling(owner) };
            }
        }
        match long.then(|| self.group.handshakes.owner(cid)).flatten() {
            Some(owner) if owner != self.index && usize::from(owner) < sockets => {
                Route::Sibling(usize::from(owner))
            }
            _ => Route::Keep,
        }
    }

    /// Parks datagram `d` in sibling `owner`'s inbox; false when it is full.
    fn hand_to(&self, owner: usize, m: &RecvMeta, d: &[u8]) -> bool {
        let inbox = &self.group.inboxes[owner];
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

    /// Moves datagrams parked for this socket into `bufs`; how many.
    fn take_parked(&self, bufs: &mut [IoSliceMut<'_>], meta: &mut [RecvMeta]) -> usize {
        let mut queue = lock(&self.inbox().queue);
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

    /// Reads what the kernel (or, forwarded, the successor) delivered to this socket,
    /// passing the datagrams that are not this endpoint's on.
    fn poll_own(
        &self,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        let read = {
            let mode = lock(&self.mode);
            match &*mode {
                // Only the group's first socket reads the pair; it sorts for the rest.
                Mode::Forwarded(Some(pair)) => poll_pair(pair, cx, bufs, meta),
                Mode::Forwarded(None) => return Poll::Pending,
                Mode::Direct | Mode::Demux(_) => {
                    drop(mode);
                    let read = self.udp.poll_recv(cx, bufs, meta);
                    if let Poll::Ready(Ok(n)) = read {
                        let datagrams = meta[..n]
                            .iter()
                            .map(|m| m.len.div_ceil(m.stride.max(1)) as u64)
                            .sum();
                        self.count(0, datagrams);
                    }
                    read
                }
            }
        };
        let msgs = match read {
            Poll::Ready(Ok(n)) => n,
            other => return other,
        };
        self.filter(bufs, meta, msgs);
        Poll::Ready(Ok(msgs))
    }

    /// Takes the datagrams that are not this endpoint's out of what was read: the
    /// predecessor's (to it) and the siblings' (to their inboxes).
    fn filter(&self, bufs: &mut [IoSliceMut<'_>], meta: &mut [RecvMeta], msgs: usize) {
        let pred = match &*lock(&self.mode) {
            Mode::Demux(pred) => Some(pred.clone()),
            _ => None,
        };
        if pred.is_none() && self.group.inboxes.len() < 2 {
            return;
        }
        let mut stats = ForwardStats::default();
        let (mut misrouted, mut dropped) = (0, 0);
        let mut gone = false;
        for (m, buf) in meta.iter_mut().zip(bufs.iter_mut()).take(msgs) {
            let stride = m.stride.max(1);
            let (mut read, mut write) = (0, 0);
            while read < m.len {
                let end = (read + stride).min(m.len);
                let d = &buf[read..end];
                match self.route(pred.as_deref().filter(|_| !gone), d) {
                    Route::Predecessor => match pred.as_deref().map(|p| forward(p, m, d)) {
                        Some(Ok(())) => stats.forwarded += 1,
                        Some(Err(e)) if e.kind() == io::ErrorKind::WouldBlock => stats.dropped += 1,
                        _ => gone = true,
                    },
                    Route::Sibling(owner) => {
                        misrouted += 1;
                        if !self.hand_to(owner, m, d) {
                            dropped += 1;
                        }
                    }
                    Route::Keep => {
                        buf.copy_within(read..end, write);
                        write += end - read;
                    }
                }
                read = end;
            }
            // Kept segments stay in order: all full-size but the batch's last.
            m.len = write;
        }
        self.count(1, misrouted);
        self.count(2, dropped);
        if gone {
            let mut mode = lock(&self.mode);
            if matches!(&*mode, Mode::Demux(_)) {
                tracing::info!("h3: the previous process is gone; its datagrams are no longer forwarded");
                *mode = Mode::Direct;
            }
        }
        if pred.is_some() {
            let mut total = lock(&self.stats);
            total.forwarded += stats.forwarded;
            total.dropped += stats.dropped;
        }
    }
}

fn forward(pred: &Predecessor, m: &RecvMeta, datagram: &[u8]) -> io::Result<()> {
    let mut header = [0u8; HEADER_LEN];
    let (family, ip) = ip_bytes(m.addr.ip());
    header[0] = family;
    header[1] = m.ecn.map_or(0, |e| e as u8);
    header[2..4].copy_from_slice(&m.addr.port().to_be_bytes());
    header[4..20].copy_from_slice(&ip);
    if let Some(dst) = m.dst_ip {
        let (family, ip) = ip_bytes(dst);
        header[20] = family;
        header[21..37].copy_from_slice(&ip);
    }
    let parts = [io::IoSlice::new(&header), io::IoSlice::new(datagram)];
    fdpass::send_packet(pred.pair.as_fd(), &parts).map(|_| ())
}

fn ip_bytes(ip: IpAddr) -> (u8, [u8; 16]) {
    match ip {
        IpAddr::V4(v4) => {
            let mut b = [0u8; 16];
            b[..4].copy_from_slice(&v4.octets());
            (4, b)
        }
        IpAddr::V6(v6) => (6, v6.octets()),
    }
}

fn ip_from(family: u8, b: &[u8]) -> Option<IpAddr> {
    match family {
        4 => Some(IpAddr::from([b[0], b[1], b[2], b[3]])),
        6 => Some(IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(b).ok()?))),
        _ => None,
    }
}

/// Turns a forwarded message in `buf` (`n` bytes) into a datagram at the buffer's
/// start and its metadata.
fn unwrap_forwarded(buf: &mut [u8], n: usize) -> Option<RecvMeta> {
    if n <= HEADER_LEN {
        return None;
    }
    let src = ip_from(buf[0], &buf[4..20])?;
    let port = u16::from_be_bytes([buf[2], buf[3]]);
    let ecn = EcnCodepoint::from_bits(buf[1]);
    let dst_ip = ip_from(buf[20], &buf[21..37]);
    buf.copy_within(HEADER_LEN..n, 0);
    let len = n - HEADER_LEN;
    Some(RecvMeta {
        addr: SocketAddr::new(src, port),
        len,
        stride: len,
        ecn,
        dst_ip,
    })
}

fn poll_pair(
    pair: &AsyncFd<OwnedFd>,
    cx: &mut Context<'_>,
    bufs: &mut [IoSliceMut<'_>],
    meta: &mut [RecvMeta],
) -> Poll<io::Result<usize>> {
    let mut filled = 0;
    while filled < bufs.len().min(meta.len()) {
        let mut guard = match pair.poll_read_ready(cx) {
            Poll::Ready(Ok(guard)) => guard,
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            Poll::Pending if filled > 0 => break,
            Poll::Pending => return Poll::Pending,
        };
        let buf = &mut bufs[filled];
        match guard.try_io(|fd| fdpass::recv_packet(fd.get_ref().as_fd(), buf)) {
            Ok(Ok(0)) => {
                // The successor closed its end: nothing more will come.
                guard.retain_ready();
                return if filled > 0 {
                    Poll::Ready(Ok(filled))
                } else {
                    Poll::Pending
                };
            }
            Ok(Ok(n)) => {
                if let Some(m) = unwrap_forwarded(buf, n) {
                    meta[filled] = m;
                    filled += 1;
                }
            }
            Ok(Err(e)) if e.kind() == io::ErrorKind::InvalidData => {}
            Ok(Err(e)) => return Poll::Ready(Err(e)),
            Err(_would_block) => {
                if filled > 0 {
                    break;
                }
            }
        }
    }
    Poll::Ready(Ok(filled))
}

impl AsyncUdpSocket for QuicSocket {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        Box::pin(Poller {
            direct: self.udp.clone().create_io_poller(),
            batched: None,
            socket: self,
        })
    }

    fn try_send(&self, transmit: &Transmit<'_>) -> io::Result<()> {
        match self.batch.get() {
            Some(b) => b.send(transmit, |t| self.udp.try_send(t)),
            None => self.udp.try_send(transmit),
        }
    }

    fn poll_recv(
        &self,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        self.remember(cx.waker());
        let room = bufs.len().min(meta.len());
        // A lone socket has no sibling to park anything for it. While datagrams wait,
        // the socket reads into half the buffers and they take the rest (all of it
        // when the socket has nothing): a sibling kept busy handing datagrams over
        // (a client spraying one connection's packets from many ports) must not
        // starve this socket's own connections, nor they the handed-over ones.
        let siblings = self.group.inboxes.len() > 1;
        let waiting = siblings && !lock(&self.inbox().queue).datagrams.is_empty();
        let own = if waiting { room - room / 2 } else { room };
        let read = self.poll_own(cx, &mut bufs[..own], &mut meta[..own]);
        let msgs = match read {
            Poll::Ready(Ok(n)) => n,
            Poll::Pending => 0,
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
        };
        let parked = if siblings {
            self.take_parked(&mut bufs[msgs..room], &mut meta[msgs..room])
        } else {
            0
        };
        if read.is_pending() && parked == 0 {
            return Poll::Pending;
        }
        Poll::Ready(Ok(msgs + parked))
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.udp.local_addr()
    }

    /// quinn batches up to 10 datagrams of the connection's current MTU into one
    /// GSO send; at a 9000-byte MTU that is 90 KB, which the kernel refuses whole
    /// (EMSGSIZE): every full batch was lost and only the loss probes, clamped to
    /// 1200 bytes, got through. A batch here never exceeds [`GSO_BATCH_BYTES`].
    fn max_transmit_segments(&self) -> usize {
        if self.batch.get().is_some_and(|b| b.gso_failed()) {
            return 1;
        }
        gso_segments(
            self.udp.max_transmit_segments(),
            self.largest_datagram.load(Ordering::Relaxed),
        )
    }

    fn max_receive_segments(&self) -> usize {
        self.udp.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.udp.may_fragment()
    }
}

/// Whether a connection driver may send: the UDP socket's readiness, or the send
/// queue's while batching is on.
#[derive(Debug)]
struct Poller {
    socket: Arc<QuicSocket>,
    direct: Pin<Box<dyn UdpPoller>>,
    batched: Option<Writable>,
}

impl UdpPoller for Poller {
    fn poll_writable(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Some(b) = this.socket.batch.get().filter(|b| b.active()) {
            return this.batched.get_or_insert_with(|| b.poller()).poll_writable(cx);
        }
        this.direct.as_mut().poll_writable(cx)
    }
}

/// How many datagrams of up to `datagram` bytes one send may batch.
fn gso_segments(socket_max: usize, datagram: usize) -> usize {
    socket_max.min(GSO_BATCH_BYTES / datagram.max(1)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gso_batch_fits_one_send() {
        assert_eq!(gso_segments(64, 1452), 45);
        assert_eq!(gso_segments(64, 9000), 7);
        assert_eq!(gso_segments(10, 1200), 10);
        assert_eq!(gso_segments(64, 65_527), 1);
        assert_eq!(gso_segments(1, 9000), 1);
    }

    #[test]
    fn a_generation_recognises_its_ids_and_no_other() {
        let a = GenerationKey::random().unwrap();
        let b = GenerationKey::random().unwrap();
        assert_eq!(GenerationKey::from_hex(&a.to_hex()), Some(a));
        let mut gen = CidGenerator::new(a, 3);
        let ids: Vec<ConnectionId> = (0..1000).map(|_| gen.generate_cid()).collect();
        assert!(ids.iter().all(|c| a.issued(c) && !b.issued(c)));
        let distinct: HashSet<&[u8]> = ids.iter().map(|c| &c[..]).collect();
        assert_eq!(distinct.len(), ids.len());
        // Random client-chosen IDs (any length) are not taken for ours.
        let mut raw = [0u8; 32];
        std::fs::File::open("/dev/urandom")
            .unwrap()
            .read_exact(&mut raw)
            .unwrap();
        for len in [8, 12, 20] {
            assert!(!a.issued(&raw[..len]));
        }
    }

    /// The kernel's steering program and this router read the socket index at the
    /// same place: every ID a socket's generator issues, in a short header, names
    /// that socket to `quic_socket` and to `dcid`.
    #[test]
    fn every_issued_id_steers_to_its_socket_in_the_kernel_too() {
        use webship_ebpf_common::{quic_socket, MAX_QUIC_SOCKETS, QUIC_HEAD_LEN};
        let key = GenerationKey::random().unwrap();
        for index in 0..MAX_QUIC_SOCKETS as u8 {
            let mut gen = CidGenerator::new(key, index);
            for _ in 0..64 {
                let cid = gen.generate_cid();
                let mut packet = vec![0x41];
                packet.extend_from_slice(&cid);
                packet.extend_from_slice(&[0u8; 20]);
                let head: [u8; QUIC_HEAD_LEN] = packet[..QUIC_HEAD_LEN].try_into().unwrap();
                assert_eq!(quic_socket(&head, MAX_QUIC_SOCKETS), Some(u32::from(index)));
                let (read, long) = dcid(&packet).unwrap();
                assert_eq!((read, long), (&cid[..], false));
                assert_eq!(read[CID_SOCKET_BYTE], index);
            }
        }
    }

    #[test]
    fn the_predecessor_owns_its_short_and_long_header_packets() {
        let old = GenerationKey::random().unwrap();
        let new = GenerationKey::random().unwrap();
        let (pair, _other) = fdpass::seqpacket_pair().unwrap();
        let client_initial = vec![9u8; 8];
        let pred = Predecessor {
            key: old,
            handshakes: [client_initial.clone()].into_iter().collect(),
            pair,
        };
        let old_cid = CidGenerator::new(old, 0).generate_cid();
        let new_cid = CidGenerator::new(new, 0).generate_cid();
        let short = |cid: &[u8]| [&[0x40][..], cid, &[1, 2, 3]].concat();
        let long = |cid: &[u8]| [&[0xc0, 0, 0, 0, 1, cid.len() as u8][..], cid, &[0, 1]].concat();
        assert!(pred.owns(&short(&old_cid)));
        assert!(!pred.owns(&short(&new_cid)));
        assert!(pred.owns(&long(&old_cid)));
        assert!(pred.owns(&long(&client_initial)));
        assert!(!pred.owns(&long(&[7u8; 8])));
        assert!(!pred.owns(&[0xc0, 0, 0]));
        assert!(!pred.owns(&[]));
    }

    /// Socket 1 of a group of three keeps its own connections' datagrams and hands
    /// the others' to their sockets: short headers by the ID's index byte, long
    /// headers of a handshake by the table; anything else (another generation's
    /// IDs, a new client's Initial) stays where the kernel put it.
    #[test]
    fn a_socket_hands_its_siblings_their_datagrams() {
        let key = GenerationKey::random().unwrap();
        let handshakes = Arc::<Handshakes>::default();
        let group = Group::new(key, 3, handshakes.clone());
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        udp.set_nonblocking(true).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _guard = rt.enter();
        let socket = QuicSocket::new(udp, 1, group.clone()).unwrap();
        let ours = CidGenerator::new(key, 1).generate_cid();
        let theirs = CidGenerator::new(key, 2).generate_cid();
        let stranger = CidGenerator::new(GenerationKey::random().unwrap(), 2).generate_cid();
        let short = |cid: &[u8]| [&[0x40][..], cid, &[1, 2, 3]].concat();
        let long = |cid: &[u8]| [&[0xc0, 0, 0, 0, 1, cid.len() as u8][..], cid, &[0, 1]].concat();
        let initial = [5u8; 8];
        handshakes.started(&[6u8; 8], 0);
        let route = |d: &[u8]| match socket.route(None, d) {
            Route::Keep => None,
            Route::Sibling(i) => Some(i),
            Route::Predecessor => Some(99),
        };
        assert_eq!(route(&short(&ours)), None);
        assert_eq!(route(&short(&theirs)), Some(2));
        assert_eq!(route(&long(&theirs)), Some(2));
        assert_eq!(route(&short(&stranger)), None);
        assert_eq!(route(&long(&initial)), None);
        assert_eq!(route(&long(&[6u8; 8])), Some(0));
        // A client may choose a 12-byte ID that starts with this socket's index: a
        // long header goes by the table all the same.
        let chosen = [1u8; CID_LEN];
        handshakes.started(&chosen, 2);
        assert_eq!(route(&long(&chosen)), Some(2));
        assert_eq!(route(&long(&ours)), None);
        assert_eq!(route(&[0x40, 2]), None);
        // An endpoint takes only its own socket's IDs: a sibling's are dropped, not reset.
        assert!(CidGenerator::new(key, 1).validate(&ours).is_ok());
        assert!(CidGenerator::new(key, 1).validate(&theirs).is_err());

        // Filtering a GRO batch of three: the sibling's segment goes to its inbox.
        let mut raw = [short(&ours), short(&theirs), short(&ours)].concat();
        let stride = short(&ours).len();
        let mut bufs = [IoSliceMut::new(&mut raw)];
        let mut meta = [RecvMeta {
            addr: "127.0.0.1:4433".parse().unwrap(),
            len: 3 * stride,
            stride,
            ecn: None,
            dst_ip: None,
        }];
        socket.filter(&mut bufs, &mut meta, 1);
        assert_eq!(meta[0].len, 2 * stride);
        assert_eq!(&bufs[0][..2 * stride], &[short(&ours), short(&ours)].concat()[..]);
        let parked = lock(&group.inboxes[2].queue).pop().unwrap();
        assert_eq!(parked.data, short(&theirs));
        assert_eq!(parked.addr, meta[0].addr);
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
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let to = udp.local_addr().unwrap();
        udp.set_nonblocking(true).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _guard = rt.enter();
        let socket = QuicSocket::new(udp, 1, group.clone()).unwrap();
        let client = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let own = client.local_addr().unwrap();
        client.send_to(b"own datagram", to).unwrap();
        let sprayer: SocketAddr = "127.0.0.2:9".parse().unwrap();
        let refill = || {
            let mut q = lock(&group.inboxes[1].queue);
            while q.push(Parked {
                addr: sprayer,
                ecn: None,
                dst_ip: None,
                data: vec![7; 100],
            }) {}
        };
        let read_own = async {
            let mut storage = vec![[0u8; 1500]; 8];
            let mut meta = [RecvMeta::default(); 8];
            loop {
                refill();
                let mut bufs: Vec<IoSliceMut<'_>> = storage.iter_mut().map(|b| IoSliceMut::new(b)).collect();
                let n =
                    std::future::poll_fn(|cx| Poll::Ready(socket.poll_recv(cx, &mut bufs, &mut meta))).await;
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

    #[test]
    fn a_forwarded_datagram_keeps_its_addresses() {
        let (a, b) = fdpass::seqpacket_pair().unwrap();
        let pred = Predecessor {
            key: GenerationKey::random().unwrap(),
            handshakes: HashSet::new(),
            pair: a,
        };
        let m = RecvMeta {
            addr: "[2001:db8::1]:4433".parse().unwrap(),
            len: 5,
            stride: 5,
            ecn: Some(EcnCodepoint::Ect0),
            dst_ip: Some("127.0.0.1".parse().unwrap()),
        };
        forward(&pred, &m, b"hello").unwrap();
        let mut buf = [0u8; 128];
        let n = fdpass::recv_packet(b.as_fd(), &mut buf).unwrap();
        let got = unwrap_forwarded(&mut buf, n).unwrap();
        assert_eq!(
            (got.addr, got.len, got.ecn, got.dst_ip),
            (m.addr, 5, m.ecn, m.dst_ip)
        );
        assert_eq!(&buf[..5], b"hello");
    }
}
