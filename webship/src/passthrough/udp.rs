//! HTTP/3 passthrough: every QUIC datagram that reaches the listen port goes to one
//! shared UDP origin (`udp_upstream`), never decrypted.
//!
//! Each client address is a *flow* with its own socket connected to the origin,
//! so the origin sees distinct peers and its replies come back on the flow they
//! belong to. Replies leave the listener from the address the client sent to
//! (`IP_PKTINFO`, via quinn-udp). Both directions move batches: GRO coalesces
//! received datagrams of one flow into one buffer, and GSO sends them on as one
//! call. A flow with no traffic either way for `flow_idle` is dropped.
//!
//! The table is bounded twice: `max_flows` in all, and `max_flows_per_address`
//! from one source, an IPv4 address or an IPv6 /64 (a host sending from thousands
//! of source ports would otherwise take every slot). A flow the origin never answered costs the origin
//! nothing to lose, so when either bound is reached the oldest such flow (of the
//! table, or of that address) makes room for the newcomer; only when every flow
//! has been answered is a new one refused (counted, and logged at most every 10 s).
//! An unanswered flow holds a socket and a task but no receive buffer: the 64 KiB
//! batch buffer comes with the origin's first reply.

use std::collections::{HashMap, VecDeque};
use std::io::{self, IoSliceMut};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use quinn_udp::{RecvMeta, Transmit, UdpSocketState};
use tokio::io::Interest;
use tokio::net::UdpSocket;
use tokio::task::{AbortHandle, JoinSet};

use super::{count, Counter};
use crate::config::UdpPassthrough;

/// Room for one GRO batch (64 KiB is the most the kernel coalesces).
const BATCH_BYTES: usize = 64 * 1024;
/// Receive buffers per `recvmmsg` on the listener.
const BATCHES: usize = 8;
/// Socket buffer size asked for on every relay socket.
const SOCKET_BUFFER: usize = 4 * 1024 * 1024;
/// The "flow table full" warning comes at most this often.
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(10);

/// A bound relay, ready to [`UdpRelay::run`].
#[derive(Debug)]
pub(crate) struct UdpRelay {
    listener: Arc<Side>,
    config: UdpPassthrough,
    max_flows: usize,
}

/// A socket and its quinn-udp state (GSO/GRO and packet-info support).
#[derive(Debug)]
struct Side {
    socket: UdpSocket,
    state: UdpSocketState,
}

impl Side {
    fn new(socket: std::net::UdpSocket) -> io::Result<Self> {
        socket.set_nonblocking(true)?;
        let state = UdpSocketState::new((&socket).into())?;
        let _ = state.set_recv_buffer_size((&socket).into(), SOCKET_BUFFER);
        let _ = state.set_send_buffer_size((&socket).into(), SOCKET_BUFFER);
        Ok(Self {
            socket: UdpSocket::from_std(socket)?,
            state,
        })
    }

    /// Receives one `recvmmsg` worth of batches.
    async fn recv(&self, bufs: &mut [Vec<u8>], meta: &mut [RecvMeta]) -> io::Result<usize> {
        loop {
            self.socket.readable().await?;
            let mut slices: Vec<IoSliceMut<'_>> = bufs.iter_mut().map(|b| IoSliceMut::new(b)).collect();
            match self.socket.try_io(Interest::READABLE, || {
                self.state.recv((&self.socket).into(), &mut slices, meta)
            }) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// Sends `contents` (datagrams of `stride` bytes, the last maybe shorter) to
    /// `destination`, as one GSO call where the batch allows it.
    async fn send(
        &self,
        destination: SocketAddr,
        src_ip: Option<IpAddr>,
        contents: &[u8],
        stride: usize,
    ) -> io::Result<()> {
        let max = self.state.max_gso_segments().max(1);
        for batch in contents.chunks(stride * max) {
            let transmit = Transmit {
                destination,
                ecn: None,
                contents: batch,
                segment_size: (batch.len() > stride).then_some(stride),
                src_ip,
            };
            loop {
                self.socket.writable().await?;
                match self.socket.try_io(Interest::WRITABLE, || {
                    self.state.try_send((&self.socket).into(), &transmit)
                }) {
                    Ok(()) => break,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(())
    }
}

/// One client flow.
#[derive(Debug)]
struct Flow {
    upstream: Side,
    /// Milliseconds since `epoch` of the last datagram either way.
    last: AtomicU64,
    /// Whether the origin has answered (then the flow is a real QUIC connection,
    /// and never evicted to make room).
    answered: AtomicBool,
    /// Tells this flow from a later one of the same client address.
    id: u64,
}

/// A flow in the table, with its reply task.
#[derive(Debug)]
struct Entry {
    flow: Arc<Flow>,
    task: AbortHandle,
}

/// One client IP address's share of the table.
#[derive(Debug, Default)]
struct Address {
    flows: usize,
    /// Its flows the origin had not answered when they were made, oldest first
    /// (checked when taken: answered or gone ones are skipped).
    unanswered: VecDeque<(SocketAddr, u64)>,
}

/// Whose share of the table a client's flows count against: its IPv4 address
/// (also when it arrives v4-mapped on a dual-stack socket), or its IPv6 /64 — one
/// host is routinely given a whole /64, so counting by full address would give it
/// 2^64 shares of `max_flows_per_address`.
fn source(client: SocketAddr) -> IpAddr {
    match client.ip().to_canonical() {
        IpAddr::V6(v6) => {
            let prefix = u128::from(v6) & !u128::from(u64::MAX);
            IpAddr::V6(Ipv6Addr::from(prefix))
        }
        v4 => v4,
    }
}

/// The flow table and its two bounds.
#[derive(Debug)]
struct Table {
    flows: HashMap<SocketAddr, Entry>,
    addresses: HashMap<IpAddr, Address>,
    /// Every flow not answered when made, oldest first (checked when taken).
    unanswered: VecDeque<(SocketAddr, u64)>,
    max_flows: usize,
    per_address: usize,
    next_id: u64,
    refused: u64,
    last_refusal_log: Option<Instant>,
}

type Flows = Arc<Mutex<Table>>;

impl Table {
    fn new(max_flows: usize, per_address: usize) -> Self {
        Self {
            flows: HashMap::new(),
            addresses: HashMap::new(),
            unanswered: VecDeque::new(),
            max_flows: max_flows.max(1),
            per_address: per_address.max(1),
            next_id: 0,
            refused: 0,
            last_refusal_log: None,
        }
    }

    /// Makes room for a new flow from `client`: evicts the oldest unanswered flow of
    /// its address when the address is at its cap, and of the whole table when the
    /// table is full. `false`: no room (everything in the way was answered).
    fn make_room(&mut self, client: SocketAddr) -> bool {
        let ip = source(client);
        if self
            .addresses
            .get(&ip)
            .is_some_and(|a| a.flows >= self.per_address)
        {
            let Some(address) = self.addresses.get_mut(&ip) else {
                return false;
            };
            let Some(victim) = oldest_unanswered(&mut address.unanswered, &self.flows) else {
                return false;
            };
            self.evict(victim);
        }
        if self.flows.len() >= self.max_flows {
            let Some(victim) = oldest_unanswered(&mut self.unanswered, &self.flows) else {
                return false;
            };
            self.evict(victim);
        }
        true
    }

    fn insert(&mut self, client: SocketAddr, entry: Entry) {
        let key = (client, entry.flow.id);
        // Into the table first: pruning keeps only keys the table still holds.
        self.flows.insert(client, entry);
        let address = self.addresses.entry(source(client)).or_default();
        address.flows += 1;
        address.unanswered.push_back(key);
        prune(&mut address.unanswered, address.flows, &self.flows);
        self.unanswered.push_back(key);
        prune(&mut self.unanswered, self.flows.len(), &self.flows);
    }

    fn evict(&mut self, client: SocketAddr) {
        if let Some(entry) = self.remove(client, None) {
            entry.task.abort();
            count(Counter::UdpFlowsEvicted, 1);
        }
    }

    /// Removes `client`'s flow (only the one with `id`, when given).
    fn remove(&mut self, client: SocketAddr, id: Option<u64>) -> Option<Entry> {
        if id.is_some_and(|id| self.flows.get(&client).is_some_and(|e| e.flow.id != id)) {
            return None;
        }
        let entry = self.flows.remove(&client)?;
        if let Some(address) = self.addresses.get_mut(&source(client)) {
            address.flows = address.flows.saturating_sub(1);
            if address.flows == 0 {
                self.addresses.remove(&source(client));
            }
        }
        Some(entry)
    }

    /// Counts a refused flow; logs the count at most every [`REFUSAL_LOG_EVERY`].
    fn refuse(&mut self, client: SocketAddr) {
        count(Counter::UdpFlowsRefused, 1);
        self.refused += 1;
        let now = Instant::now();
        if self
            .last_refusal_log
            .is_none_or(|last| now.duration_since(last) >= REFUSAL_LOG_EVERY)
        {
            tracing::warn!(
                %client,
                refused = self.refused,
                flows = self.flows.len(),
                addresses = self.addresses.len(),
                "udp passthrough: flow table full of answered flows, new flows refused"
            );
            self.refused = 0;
            self.last_refusal_log = Some(now);
        }
    }
}

/// The oldest flow in `queue` that still exists and is still unanswered; the
/// entries before it are stale and dropped.
fn oldest_unanswered(
    queue: &mut VecDeque<(SocketAddr, u64)>,
    flows: &HashMap<SocketAddr, Entry>,
) -> Option<SocketAddr> {
    while let Some((client, id)) = queue.pop_front() {
        if flows
            .get(&client)
            .is_some_and(|e| e.flow.id == id && !e.flow.answered.load(Ordering::Relaxed))
        {
            return Some(client);
        }
    }
    None
}

/// Keeps a queue of flow keys within twice the live flows it could name, by
/// dropping the stale ones (answered or gone): its memory stays bounded by the
/// table's, and the work is amortized over the insertions that grew it.
fn prune(queue: &mut VecDeque<(SocketAddr, u64)>, live: usize, flows: &HashMap<SocketAddr, Entry>) {
    if queue.len() > 2 * live + 64 {
        queue.retain(|(client, id)| {
            flows
                .get(client)
                .is_some_and(|e| e.flow.id == *id && !e.flow.answered.load(Ordering::Relaxed))
        });
    }
}

impl UdpRelay {
    /// Binds the client-facing UDP socket on `listen`, or relays on `inherited`, the
    /// bound socket a previous process handed over.
    pub(crate) fn bind(
        listen: SocketAddr,
        inherited: Option<std::net::UdpSocket>,
        config: UdpPassthrough,
        max_flows: usize,
    ) -> io::Result<Self> {
        let socket = match inherited {
            Some(socket) => socket,
            None => std::net::UdpSocket::bind(listen)?,
        };
        Ok(Self {
            listener: Arc::new(Side::new(socket)?),
            config,
            max_flows: max_flows.max(1),
        })
    }

    pub(crate) fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.socket.local_addr()
    }

    /// The client-facing socket, for a successor to inherit.
    pub(crate) fn socket(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.listener.socket.as_fd()
    }

    /// Relays until the task is dropped (which aborts every flow task too). Once
    /// `stop` is requested it reads no more client datagrams (a successor process
    /// reads them after a binary upgrade; its flows reach the origin from new ports,
    /// which QUIC takes as a NAT rebinding) while its flows still carry the origin's
    /// replies back.
    pub(crate) async fn run(self, mut stop: crate::shutdown::Shutdown) {
        let epoch = Instant::now();
        let flows: Flows = Arc::new(Mutex::new(Table::new(
            self.max_flows,
            self.config.max_flows_per_address,
        )));
        let mut tasks = JoinSet::new();
        let mut bufs: Vec<Vec<u8>> = (0..BATCHES).map(|_| vec![0u8; BATCH_BYTES]).collect();
        let mut meta = vec![RecvMeta::default(); BATCHES];
        // Bounded: each turn handles received datagrams; the task ends when dropped.
        loop {
            let received = tokio::select! {
                r = self.listener.recv(&mut bufs, &mut meta) => r,
                () = stop.requested() => break,
            };
            let n = match received {
                Ok(n) => n,
                Err(e) => {
                    // ICMP errors surface here on some kernels: keep relaying.
                    tracing::debug!(error = %e, "udp passthrough: receive error");
                    continue;
                }
            };
            // Reap finished flow tasks so the set does not grow.
            while tasks.try_join_next().is_some() {}
            for (m, buf) in meta.iter().zip(&bufs).take(n) {
                let Some(flow) = self.flow(&flows, m, epoch, &mut tasks) else {
                    continue;
                };
                flow.last.store(millis(epoch), Ordering::Relaxed);
                let stride = m.stride.max(1);
                count(Counter::UdpPacketsUp, m.len.div_ceil(stride) as u64);
                count(Counter::BytesUp, m.len as u64);
                if let Err(e) = flow
                    .upstream
                    .send(self.config.upstream, None, &buf[..m.len], stride)
                    .await
                {
                    tracing::debug!(client = %m.addr, error = %e, "udp passthrough: send to the origin failed");
                }
            }
        }
        // The flows (in `tasks`) keep relaying replies until the task is dropped.
        std::future::pending::<()>().await;
        drop(tasks);
    }

    /// The flow of `m.addr`, created (with its reply task) when new and there is
    /// room for it.
    fn flow(
        &self,
        flows: &Flows,
        m: &RecvMeta,
        epoch: Instant,
        tasks: &mut JoinSet<()>,
    ) -> Option<Arc<Flow>> {
        let mut table = flows.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(entry) = table.flows.get(&m.addr) {
            return Some(entry.flow.clone());
        }
        if !table.make_room(m.addr) {
            table.refuse(m.addr);
            return None;
        }
        let side = match self.connect() {
            Ok(side) => side,
            Err(e) => {
                count(Counter::UpstreamFailures, 1);
                tracing::warn!(client = %m.addr, upstream = %self.config.upstream, error = %e, "udp passthrough: cannot open a flow");
                return None;
            }
        };
        let flow = Arc::new(Flow {
            upstream: side,
            last: AtomicU64::new(millis(epoch)),
            answered: AtomicBool::new(false),
            id: table.next_id,
        });
        table.next_id += 1;
        let task = tasks.spawn(replies(
            flow.clone(),
            self.listener.clone(),
            flows.clone(),
            m.addr,
            m.dst_ip,
            epoch,
            self.config.flow_idle,
        ));
        table.insert(
            m.addr,
            Entry {
                flow: flow.clone(),
                task,
            },
        );
        count(Counter::UdpFlows, 1);
        tracing::debug!(client = %m.addr, "udp passthrough: new flow");
        Some(flow)
    }

    fn connect(&self) -> io::Result<Side> {
        let any = match self.config.upstream {
            SocketAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            SocketAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        };
        let socket = std::net::UdpSocket::bind((any, 0))?;
        socket.connect(self.config.upstream)?;
        Side::new(socket)
    }
}

/// Carries the origin's datagrams of one flow back to its client, from the
/// address the client sent to, until the flow is idle for `idle` (or evicted,
/// which aborts this task).
async fn replies(
    flow: Arc<Flow>,
    listener: Arc<Side>,
    flows: Flows,
    client: SocketAddr,
    local_ip: Option<IpAddr>,
    epoch: Instant,
    idle: Duration,
) {
    // Allocated with the first reply: a flow the origin never answers has none.
    let mut bufs = vec![Vec::new()];
    let mut meta = [RecvMeta::default()];
    // Bounded by the idle timeout: every turn either relays or checks idleness.
    loop {
        let last = Duration::from_millis(flow.last.load(Ordering::Relaxed));
        let quiet = epoch.elapsed().saturating_sub(last);
        if quiet >= idle {
            break;
        }
        if bufs[0].is_empty() {
            match tokio::time::timeout(idle - quiet, flow.upstream.socket.readable()).await {
                Ok(Ok(())) => bufs[0] = vec![0u8; BATCH_BYTES],
                Ok(Err(_)) => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
                Err(_) => continue,
            }
        }
        let received = tokio::time::timeout(idle - quiet, flow.upstream.recv(&mut bufs, &mut meta)).await;
        let n = match received {
            Err(_) => continue,
            Ok(Err(e)) => {
                // A refused datagram (the origin is down) is not the end of the flow.
                tracing::debug!(%client, error = %e, "udp passthrough: receive from the origin failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
            Ok(Ok(n)) => n,
        };
        flow.last.store(millis(epoch), Ordering::Relaxed);
        flow.answered.store(true, Ordering::Relaxed);
        for (m, buf) in meta.iter().zip(&bufs).take(n) {
            let stride = m.stride.max(1);
            count(Counter::UdpPacketsDown, m.len.div_ceil(stride) as u64);
            count(Counter::BytesDown, m.len as u64);
            if let Err(e) = listener.send(client, local_ip, &buf[..m.len], stride).await {
                tracing::debug!(%client, error = %e, "udp passthrough: send to the client failed");
            }
        }
    }
    flows
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .remove(client, Some(flow.id));
    tracing::debug!(%client, "udp passthrough: flow expired");
}

fn millis(epoch: Instant) -> u64 {
    u64::try_from(epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A table entry for `client`, with a socket and a task that never ends.
    fn entry(table: &mut Table, tasks: &mut JoinSet<()>) -> Entry {
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").expect("a UDP socket");
        let flow = Arc::new(Flow {
            upstream: Side::new(socket).expect("registered"),
            last: AtomicU64::new(0),
            answered: AtomicBool::new(false),
            id: table.next_id,
        });
        table.next_id += 1;
        let task = tasks.spawn(std::future::pending());
        Entry { flow, task }
    }

    fn client(ip: u8, port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, ip], port))
    }

    fn admit(table: &mut Table, tasks: &mut JoinSet<()>, c: SocketAddr) -> bool {
        if !table.make_room(c) {
            return false;
        }
        let e = entry(table, tasks);
        table.insert(c, e);
        true
    }

    fn answer(table: &Table, c: SocketAddr) {
        table.flows[&c].flow.answered.store(true, Ordering::Relaxed);
    }

    #[tokio::test]
    async fn an_address_at_its_cap_gives_up_its_oldest_unanswered_flow() {
        let mut tasks = JoinSet::new();
        let mut table = Table::new(100, 2);
        assert!(admit(&mut table, &mut tasks, client(1, 1)));
        assert!(admit(&mut table, &mut tasks, client(1, 2)));
        // The oldest unanswered one goes.
        assert!(admit(&mut table, &mut tasks, client(1, 3)));
        assert!(!table.flows.contains_key(&client(1, 1)));
        // Answered flows stay: only the unanswered one makes room.
        answer(&table, client(1, 2));
        assert!(admit(&mut table, &mut tasks, client(1, 4)));
        assert!(table.flows.contains_key(&client(1, 2)));
        assert!(!table.flows.contains_key(&client(1, 3)));
        // Everything answered: refused, and other addresses are not affected.
        answer(&table, client(1, 4));
        assert!(!admit(&mut table, &mut tasks, client(1, 5)));
        assert!(admit(&mut table, &mut tasks, client(2, 1)));
        assert_eq!(table.addresses[&source(client(1, 0))].flows, 2);
    }

    #[tokio::test]
    async fn a_full_table_evicts_the_oldest_unanswered_flow_of_any_address() {
        let mut tasks = JoinSet::new();
        let mut table = Table::new(3, 10);
        assert!(admit(&mut table, &mut tasks, client(1, 1)));
        assert!(admit(&mut table, &mut tasks, client(2, 1)));
        assert!(admit(&mut table, &mut tasks, client(3, 1)));
        answer(&table, client(1, 1));
        assert!(admit(&mut table, &mut tasks, client(4, 1)));
        assert!(table.flows.contains_key(&client(1, 1)));
        assert!(!table.flows.contains_key(&client(2, 1)));
        assert_eq!(table.flows.len(), 3);
        assert!(!table.addresses.contains_key(&source(client(2, 1))));
    }

    #[tokio::test]
    async fn the_queues_stay_bounded_and_keep_live_flows() {
        let mut tasks = JoinSet::new();
        let mut table = Table::new(1000, 2);
        // An answered flow keeps its address's queue alive while 200 others come
        // and go: stale keys pile up in both queues until pruned.
        assert!(admit(&mut table, &mut tasks, client(2, 1000)));
        answer(&table, client(2, 1000));
        for port in 1..=200 {
            let c = client(2, port);
            assert!(admit(&mut table, &mut tasks, c));
            let id = table.flows[&c].flow.id;
            // The newest key survives every pruning, in both queues.
            let address = &table.addresses[&source(c)];
            assert!(address.unanswered.contains(&(c, id)), "port {port}");
            assert!(table.unanswered.contains(&(c, id)), "port {port}");
            assert!(address.unanswered.len() <= 2 * address.flows + 64);
            assert!(table.unanswered.len() <= 2 * table.flows.len() + 64);
            assert!(table.remove(c, None).is_some());
        }
        // At the address's cap, the oldest unanswered flow makes room.
        assert!(admit(&mut table, &mut tasks, client(2, 201)));
        assert!(admit(&mut table, &mut tasks, client(2, 202)));
        assert!(!table.flows.contains_key(&client(2, 201)));
        assert!(table.flows.contains_key(&client(2, 1000)));
    }

    #[tokio::test]
    async fn one_ipv6_prefix_and_its_mapped_spellings_share_one_cap() {
        let mut tasks = JoinSet::new();
        let mut table = Table::new(1000, 2);
        let v6 = |tail: u16| SocketAddr::from(([0x2001, 0xdb8, 0, 1, 0, 0, 0, tail], 443));
        // Two answered flows from one /64, under two interface identifiers.
        for c in [v6(1), v6(2)] {
            assert!(admit(&mut table, &mut tasks, c));
            answer(&table, c);
        }
        // A third interface identifier of the same /64 is the same source.
        assert!(!admit(&mut table, &mut tasks, v6(3)));
        // Another /64 is another source.
        let other = SocketAddr::from(([0x2001, 0xdb8, 0, 2, 0, 0, 0, 1], 443));
        assert!(admit(&mut table, &mut tasks, other));
        // An IPv4 client seen as v4-mapped IPv6 counts as its IPv4 address.
        let mapped = SocketAddr::from((Ipv4Addr::new(127, 0, 0, 9).to_ipv6_mapped(), 1));
        for c in [client(9, 1), client(9, 2)] {
            assert!(admit(&mut table, &mut tasks, c));
            answer(&table, c);
        }
        assert!(!admit(&mut table, &mut tasks, mapped));
    }
}
