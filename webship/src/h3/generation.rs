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
//! **Several sockets per process** (`h3_sockets`): the first byte of every connection
//! ID names the socket of the process's [`Group`] whose endpoint owns the connection
//! (the tag covers it); [`routing`](super::routing) says how a datagram that reached
//! another socket of the group finds its owner. During a takeover the draining
//! process's first socket reads the pair and routes each datagram the same way.

use std::collections::{HashMap, HashSet};
use std::io::{self, IoSliceMut, Read};
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsFd, OwnedFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use quinn::udp::{EcnCodepoint, RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, ConnectionId, ConnectionIdGenerator, UdpPoller};
use tokio::io::unix::AsyncFd;
use webship_ebpf_common::CID_SOCKET_BYTE;

use super::batch::{Batcher, Writable};
use super::lock;
use super::routing::{self, dcid, Counter, Group, Route};
use crate::sys::fdpass;

/// Length of the connection IDs every generation issues (8 bytes of nonce, the first
/// of them the owning socket's index, then 4 of tag).
pub(crate) const CID_LEN: usize = 12;
const NONCE_LEN: usize = 8;
// The kernel's steering program (`[kernel] ebpf`) reads the same layout.
const _: () = assert!(CID_LEN == webship_ebpf_common::QUIC_CID_LEN as usize);
// The socket index is a byte of the nonce, which the tag covers.
const _: () = assert!(CID_SOCKET_BYTE < NONCE_LEN);
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

    pub(super) fn owner(&self, cid: &[u8]) -> Option<u8> {
        lock(&self.0).get(cid).copied()
    }

    pub(crate) fn snapshot(&self) -> Vec<Vec<u8>> {
        lock(&self.0).keys().cloned().collect()
    }
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
    /// The send queue ([`Batcher`]: a connection's GSO batches within a poll leave
    /// as few sends, and with `h3_send_batch_delay_us` many connections'), built by
    /// [`QuicSocket::use_send_queue`].
    batch: std::sync::OnceLock<Arc<Batcher>>,
    /// A duplicate of the UDP socket for the batcher.
    raw: std::net::UdpSocket,
    /// Building the batcher failed once (reported then; tried again quietly).
    batch_failed: AtomicBool,
}

/// The most UDP payload one `sendmsg` may carry, GSO batch included: the IP length
/// field's 65,535 less an IPv6 header and the UDP header (IPv4 allows 20 bytes
/// more). Beyond it the kernel answers EMSGSIZE and quinn-udp drops the whole batch;
/// [`QuicSocket::try_send`] splits larger batches into sends of at most this.
pub(crate) const GSO_BATCH_BYTES: usize = 65_535 - 40 - 8;

impl QuicSocket {
    /// Socket `index` of `group` (the index must be below the group's size).
    pub(crate) fn new(socket: std::net::UdpSocket, index: u8, group: Arc<Group>) -> io::Result<Arc<Self>> {
        use quinn::Runtime;
        if usize::from(index) >= group.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "socket index outside its group",
            ));
        }
        Ok(Arc::new(Self {
            raw: socket.try_clone()?,
            batch: std::sync::OnceLock::new(),
            batch_failed: AtomicBool::new(false),
            udp: quinn::TokioRuntime.wrap_udp_socket(socket)?,
            index,
            group,
            mode: Mutex::new(Mode::Direct),
            stats: Mutex::new(ForwardStats::default()),
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

    /// The socket's send queue, once [`QuicSocket::use_send_queue`] has built it.
    pub(crate) fn batcher(&self) -> Option<&Arc<Batcher>> {
        self.batch.get()
    }

    /// One send: through the queue when it is in use.
    fn send_part(&self, transmit: &Transmit<'_>) -> io::Result<()> {
        match self.batch.get() {
            Some(b) => b.send(transmit, |t| self.udp.try_send(t)),
            None => self.udp.try_send(transmit),
        }
    }

    /// Sends through the socket's queue ([`Batcher`]): a connection's GSO batches
    /// within a poll as few sends, and across connections with at most `delay_us` of
    /// delay (0: only within a poll; what is queued still leaves). Must run inside the
    /// tokio runtime. Without the queue (an error here, returned the first time only:
    /// the caller warns once per socket) every transmit goes straight to the socket.
    pub(crate) fn use_send_queue(&self, delay_us: u64) -> io::Result<()> {
        if let Some(b) = self.batch.get() {
            b.set_delay(delay_us);
        } else if cfg!(target_os = "linux") {
            let b = match self.raw.try_clone().and_then(|raw| Batcher::new(raw, delay_us)) {
                Ok(b) => b,
                Err(e) if !self.batch_failed.swap(true, Ordering::Relaxed) => return Err(e),
                Err(_) => return Ok(()),
            };
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
        self.group.wake(self.index);
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
                        routing::count(self.index, Counter::Received, datagrams);
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
        if pred.is_none() && self.group.len() < 2 {
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
                let theirs = pred.as_deref().filter(|p| !gone && p.owns(d));
                match theirs.map(|p| forward(p, m, d)) {
                    Some(Ok(())) => stats.forwarded += 1,
                    Some(Err(e)) if e.kind() == io::ErrorKind::WouldBlock => stats.dropped += 1,
                    Some(Err(_)) => gone = true,
                    None => match self.group.route(self.index, d) {
                        Route::Sibling(owner) => {
                            misrouted += 1;
                            if !self.group.hand_to(owner, m, d) {
                                dropped += 1;
                            }
                        }
                        Route::Keep => {
                            buf.copy_within(read..end, write);
                            write += end - read;
                        }
                    },
                }
                read = end;
            }
            // Kept segments stay in order: all full-size but the batch's last.
            m.len = write;
        }
        routing::count(self.index, Counter::Misrouted, misrouted);
        routing::count(self.index, Counter::Dropped, dropped);
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

    /// quinn batches up to 10 datagrams of the connection's current MTU into one
    /// transmit: at a 9000-byte MTU that is 90 KB, which the kernel refuses whole
    /// (EMSGSIZE). Such a batch leaves as several sends of whole datagrams (see
    /// [`gso_parts`]), so a jumbo-MTU connection does not shrink every other
    /// connection's batches. The first part's error is the transmit's (quinn tries
    /// it again on `WouldBlock`); once a part has left, a later part's failure drops
    /// the rest, which QUIC's loss recovery resends like any lost datagrams: the
    /// transmit must not be retried whole, or its first datagrams would leave twice.
    fn try_send(&self, transmit: &Transmit<'_>) -> io::Result<()> {
        let mut parts = gso_parts(transmit);
        let first = parts.next().unwrap_or_else(|| transmit.clone());
        self.send_part(&first)?;
        for part in parts {
            if let Err(e) = self.send_part(&part) {
                tracing::debug!(
                    peer = %transmit.destination,
                    error = %e,
                    "h3: the rest of a split GSO batch dropped (recovered as loss)"
                );
                break;
            }
        }
        Ok(())
    }

    fn poll_recv(
        &self,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        self.group.recv(self.index, cx, bufs, meta, |cx, bufs, meta| {
            self.poll_own(cx, bufs, meta)
        })
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.udp.local_addr()
    }

    /// quinn's batch size, whatever the MTU: [`QuicSocket::try_send`] splits a
    /// batch too large for one send. 1 once batched sends found GSO unusable.
    fn max_transmit_segments(&self) -> usize {
        if self.batch.get().is_some_and(|b| b.gso_failed()) {
            return 1;
        }
        self.udp.max_transmit_segments()
    }

    fn max_receive_segments(&self) -> usize {
        self.udp.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.udp.may_fragment()
    }
}

/// Whether a connection driver may send: the send queue's readiness while it is in
/// use (no transmit refused, or the queue sent since), and the UDP socket's.
///
/// Both, because a driver using the queue may still send straight to the socket (a
/// transmit that cannot grow, with nothing queued): after that send's `WouldBlock`
/// quinn polls again before retrying, and only the socket's own readiness waits for
/// room; the queue's alone would answer at once, and quinn would retry in a loop.
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
            std::task::ready!(this.batched.get_or_insert_with(|| b.poller()).poll_writable(cx))?;
        }
        this.direct.as_mut().poll_writable(cx)
    }
}

/// `t` as sends of at most [`GSO_BATCH_BYTES`] each, every one whole datagrams of
/// `t`'s segment size (the last datagram may be short, as in `t`); `t` itself when
/// it fits one send or is one datagram. A part of one datagram has no segment size.
fn gso_parts<'a>(t: &Transmit<'a>) -> impl Iterator<Item = Transmit<'a>> + 'a {
    let segment = t
        .segment_size
        .filter(|&s| s > 0 && t.contents.len() > GSO_BATCH_BYTES)
        .unwrap_or(t.contents.len().max(1));
    let per_part = (GSO_BATCH_BYTES / segment).max(1) * segment;
    let (destination, ecn, src_ip, segment_size) = (t.destination, t.ecn, t.src_ip, t.segment_size);
    t.contents.chunks(per_part).map(move |contents| Transmit {
        destination,
        ecn,
        contents,
        segment_size: segment_size.filter(|&s| contents.len() > s),
        src_ip,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::h3::testing::{long, loopback_udp, runtime, short};

    /// The parts' lengths and segment sizes for `len` bytes of `segment`-byte datagrams.
    fn parts(len: usize, segment: Option<usize>) -> Vec<(usize, Option<usize>)> {
        let contents = vec![7u8; len];
        let t = Transmit {
            destination: "127.0.0.1:443".parse().unwrap(),
            ecn: None,
            contents: &contents,
            segment_size: segment,
            src_ip: None,
        };
        let parts: Vec<Transmit<'_>> = gso_parts(&t).collect();
        assert_eq!(parts.iter().map(|p| p.contents.len()).sum::<usize>(), len);
        for p in &parts {
            assert!(p.contents.len() <= GSO_BATCH_BYTES || segment.is_none_or(|s| s >= GSO_BATCH_BYTES));
            assert_eq!(p.destination, t.destination);
        }
        parts.iter().map(|p| (p.contents.len(), p.segment_size)).collect()
    }

    /// A GSO batch over one send's limit leaves as sends of whole datagrams, each at
    /// most [`GSO_BATCH_BYTES`]; one that fits is sent as it is.
    #[test]
    fn a_gso_batch_too_large_for_one_send_is_split_at_datagrams() {
        // Ten 8972-byte datagrams: 7 (62,804 bytes) and 3.
        assert_eq!(
            parts(89_720, Some(8972)),
            [(62_804, Some(8972)), (26_916, Some(8972))]
        );
        // A short last datagram stays last; a part of one datagram has no segment size.
        assert_eq!(
            parts(14 * 8972 + 100, Some(8972)),
            [(62_804, Some(8972)), (62_804, Some(8972)), (100, None)]
        );
        assert_eq!(
            parts(8 * 8972 + 100, Some(8972)),
            [(62_804, Some(8972)), (9072, Some(8972))]
        );
        assert_eq!(parts(8 * 8972, Some(8972)), [(62_804, Some(8972)), (8972, None)]);
        // Exactly at the limit, or under it: one send, untouched.
        assert_eq!(
            parts(GSO_BATCH_BYTES, Some(1200)),
            [(GSO_BATCH_BYTES, Some(1200))]
        );
        assert_eq!(parts(14_520, Some(1452)), [(14_520, Some(1452))]);
        assert_eq!(parts(1200, None), [(1200, None)]);
        assert!(parts(0, None).is_empty(), "nothing to send, no part");
        // One byte over: the last whole datagrams that do not fit go next.
        let over = GSO_BATCH_BYTES + 1;
        assert_eq!(
            parts(over, Some(1200)),
            [(54 * 1200, Some(1200)), (over - 54 * 1200, None)]
        );
        // Loopback-sized datagrams: one per send.
        assert_eq!(
            parts(3 * 65_000, Some(65_000)),
            [(65_000, None), (65_000, None), (65_000, None)]
        );
    }

    /// A socket that is never writable.
    #[derive(Debug)]
    struct Full;

    impl UdpPoller for Full {
        fn poll_writable(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Pending
        }
    }

    /// Inside a gathering poll the queue is in use, yet a transmit that cannot grow
    /// goes straight to the socket; after its `WouldBlock` quinn polls before trying
    /// again, and the poller must wait for the socket. Failed before the fix, which
    /// answered from the queue's readiness alone (quinn retried in a loop, the worker
    /// spinning).
    #[test]
    fn a_driver_using_the_queue_still_waits_for_a_full_socket() {
        let rt = runtime();
        let _guard = rt.enter();
        let group = Group::new(GenerationKey::random().unwrap(), 1, Arc::default());
        let socket = QuicSocket::new(loopback_udp().0, 0, group).unwrap();
        socket.use_send_queue(0).unwrap();
        let batcher = socket.batcher().unwrap().clone();
        let mut poller = Poller {
            socket,
            direct: Box::pin(Full),
            batched: None,
        };
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let polled = batcher.gathering(|| Pin::new(&mut poller).poll_writable(&mut cx));
        assert!(polled.is_pending(), "ready while the socket is full");
    }

    /// Ten 8972-byte datagrams in one transmit (quinn's batch at loopback's `auto`
    /// ceiling, 89,720 bytes) reach the peer whole and in order: sent outside a poll,
    /// inside a gathering poll (the seven-datagram part straight to the socket, the
    /// three queued for the poll's end) and through the cross-connection queue.
    /// Before the split the kernel refused the one 90 KB send (EMSGSIZE) and nothing
    /// arrived.
    #[test]
    fn a_transmit_over_one_send_s_limit_arrives_whole() {
        let rt = runtime();
        let _guard = rt.enter();
        for (delay_us, in_poll) in [(0, false), (0, true), (1, false)] {
            let group = Group::new(GenerationKey::random().unwrap(), 1, Arc::default());
            let socket = QuicSocket::new(loopback_udp().0, 0, group).unwrap();
            socket.use_send_queue(delay_us).unwrap();
            let rx = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
            socket2::SockRef::from(&rx).set_recv_buffer_size(4 << 20).unwrap();
            rx.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            let contents: Vec<u8> = (0..10u8).flat_map(|i| [i; 8972]).collect();
            let transmit = Transmit {
                destination: rx.local_addr().unwrap(),
                ecn: None,
                contents: &contents,
                segment_size: Some(8972),
                src_ip: None,
            };
            // As quinn does: wait until the socket is writable, then send.
            let mut poller = socket.clone().create_io_poller();
            rt.block_on(std::future::poll_fn(|cx| poller.as_mut().poll_writable(cx)))
                .unwrap();
            match socket.batcher().filter(|_| in_poll) {
                Some(b) => b.gathering(|| socket.try_send(&transmit)).unwrap(),
                None => socket.try_send(&transmit).unwrap(),
            }
            // The queue's task sends what batching queued.
            rt.block_on(tokio::time::sleep(Duration::from_millis(20)));
            let mut buf = vec![0u8; 65_536];
            for i in 0..10u8 {
                let n = rx
                    .recv(&mut buf)
                    .unwrap_or_else(|e| panic!("delay {delay_us}: datagram {i} of 10 missing: {e}"));
                assert_eq!(n, 8972, "delay {delay_us}: datagram {i}");
                assert!(
                    buf[..n].iter().all(|&b| b == i),
                    "delay {delay_us}: datagram {i} out of order"
                );
            }
        }
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

    /// An endpoint takes only its own socket's IDs: a sibling's are dropped, not reset.
    #[test]
    fn an_endpoint_validates_only_its_own_sockets_ids() {
        let key = GenerationKey::random().unwrap();
        let ours = CidGenerator::new(key, 1).generate_cid();
        let theirs = CidGenerator::new(key, 2).generate_cid();
        assert!(CidGenerator::new(key, 1).validate(&ours).is_ok());
        assert!(CidGenerator::new(key, 1).validate(&theirs).is_err());
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
        assert!(pred.owns(&short(&old_cid)));
        assert!(!pred.owns(&short(&new_cid)));
        assert!(pred.owns(&long(&old_cid)));
        assert!(pred.owns(&long(&client_initial)));
        assert!(!pred.owns(&long(&[7u8; 8])));
        assert!(!pred.owns(&[0xc0, 0, 0]));
        assert!(!pred.owns(&[]));
    }

    /// Filtering a GRO batch of three on socket 1 of a group of three: its own
    /// segments stay, in order; the sibling's goes to socket 2, which reads it with
    /// its sender's address.
    #[test]
    fn a_gro_batch_keeps_its_own_segments_and_hands_a_siblings_over() {
        let key = GenerationKey::random().unwrap();
        let group = Group::new(key, 3, Arc::default());
        let rt = runtime();
        let _guard = rt.enter();
        let socket = QuicSocket::new(loopback_udp().0, 1, group.clone()).unwrap();
        let sibling = QuicSocket::new(loopback_udp().0, 2, group).unwrap();
        let ours = CidGenerator::new(key, 1).generate_cid();
        let theirs = CidGenerator::new(key, 2).generate_cid();
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

        let mut storage = [0u8; 1500];
        let mut got = [RecvMeta::default()];
        let read = rt.block_on(std::future::poll_fn(|cx| {
            Poll::Ready(sibling.poll_recv(cx, &mut [IoSliceMut::new(&mut storage)], &mut got))
        }));
        assert!(matches!(read, Poll::Ready(Ok(1))), "{read:?}");
        assert_eq!(&storage[..got[0].len], &short(&theirs)[..]);
        assert_eq!(got[0].addr, meta[0].addr);
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
