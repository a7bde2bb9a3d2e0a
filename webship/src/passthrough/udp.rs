//! HTTP/3 passthrough: every QUIC datagram that reaches the listen port goes to one
//! shared UDP origin (`udp_upstream`), never decrypted.
//!
//! Each client address is a *flow* with its own socket connected to the origin,
//! so the origin sees distinct peers and its replies come back on the flow they
//! belong to. Replies leave the listener from the address the client sent to
//! (`IP_PKTINFO`, via quinn-udp). Both directions move batches: GRO coalesces
//! received datagrams of one flow into one buffer, and GSO sends them on as one
//! call. A flow with no traffic either way for `flow_idle` is dropped; the number
//! of flows is bounded by `max_flows` (datagrams for new flows beyond it are
//! dropped and counted).

use std::collections::HashMap;
use std::io::{self, IoSliceMut};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use quinn_udp::{RecvMeta, Transmit, UdpSocketState};
use tokio::io::Interest;
use tokio::net::UdpSocket;
use tokio::task::JoinSet;

use super::{count, Counter};
use crate::config::UdpPassthrough;

/// Room for one GRO batch (64 KiB is the most the kernel coalesces).
const BATCH_BYTES: usize = 64 * 1024;
/// Receive buffers per `recvmmsg` on the listener.
const BATCHES: usize = 8;
/// Socket buffer size asked for on every relay socket.
const SOCKET_BUFFER: usize = 4 * 1024 * 1024;

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
}

impl UdpRelay {
    /// Binds the client-facing UDP socket on `listen`.
    pub(crate) fn bind(listen: SocketAddr, config: UdpPassthrough, max_flows: usize) -> io::Result<Self> {
        let socket = std::net::UdpSocket::bind(listen)?;
        Ok(Self {
            listener: Arc::new(Side::new(socket)?),
            config,
            max_flows: max_flows.max(1),
        })
    }

    pub(crate) fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.socket.local_addr()
    }

    /// Relays until the task is dropped (which aborts every flow task too).
    pub(crate) async fn run(self) {
        let epoch = Instant::now();
        let flows: Arc<Mutex<HashMap<SocketAddr, Arc<Flow>>>> = Arc::default();
        let mut tasks = JoinSet::new();
        let mut bufs: Vec<Vec<u8>> = (0..BATCHES).map(|_| vec![0u8; BATCH_BYTES]).collect();
        let mut meta = vec![RecvMeta::default(); BATCHES];
        // Bounded: each turn handles received datagrams; the task ends when dropped.
        loop {
            let n = match self.listener.recv(&mut bufs, &mut meta).await {
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
    }

    /// The flow of `m.addr`, created (with its reply task) when new.
    fn flow(
        &self,
        flows: &Arc<Mutex<HashMap<SocketAddr, Arc<Flow>>>>,
        m: &RecvMeta,
        epoch: Instant,
        tasks: &mut JoinSet<()>,
    ) -> Option<Arc<Flow>> {
        let mut table = flows.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(flow) = table.get(&m.addr) {
            return Some(flow.clone());
        }
        if table.len() >= self.max_flows {
            count(Counter::RedirectFailures, 1);
            return None;
        }
        let flow = match self.connect() {
            Ok(side) => Arc::new(Flow {
                upstream: side,
                last: AtomicU64::new(millis(epoch)),
            }),
            Err(e) => {
                count(Counter::UpstreamFailures, 1);
                tracing::warn!(client = %m.addr, upstream = %self.config.upstream, error = %e, "udp passthrough: cannot open a flow");
                return None;
            }
        };
        table.insert(m.addr, flow.clone());
        count(Counter::UdpFlows, 1);
        tracing::debug!(client = %m.addr, "udp passthrough: new flow");
        tasks.spawn(replies(
            flow.clone(),
            self.listener.clone(),
            flows.clone(),
            m.addr,
            m.dst_ip,
            epoch,
            self.config.flow_idle,
        ));
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
/// address the client sent to, until the flow is idle for `idle`.
async fn replies(
    flow: Arc<Flow>,
    listener: Arc<Side>,
    flows: Arc<Mutex<HashMap<SocketAddr, Arc<Flow>>>>,
    client: SocketAddr,
    local_ip: Option<IpAddr>,
    epoch: Instant,
    idle: Duration,
) {
    let mut bufs = vec![vec![0u8; BATCH_BYTES]];
    let mut meta = [RecvMeta::default()];
    // Bounded by the idle timeout: every turn either relays or checks idleness.
    loop {
        let last = Duration::from_millis(flow.last.load(Ordering::Relaxed));
        let quiet = epoch.elapsed().saturating_sub(last);
        if quiet >= idle {
            break;
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
        .remove(&client);
    tracing::debug!(%client, "udp passthrough: flow expired");
}

fn millis(epoch: Instant) -> u64 {
    u64::try_from(epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
}
