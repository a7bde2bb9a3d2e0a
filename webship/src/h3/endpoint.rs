//! The HTTP/3 listener: one quinn endpoint per UDP socket (`h3_sockets`), all on the
//! listen address with `SO_REUSEPORT`, each with its own driver task (so the
//! runtime's worker threads share the packet work) and its own accept loop.
//! `routing` says how a datagram finds the socket whose endpoint owns its
//! connection, `generation` how the sockets travel in a binary upgrade.

use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use quinn::crypto::rustls::QuicServerConfig;
use tokio::sync::Semaphore;

use super::batch::GatheringRuntime;
use super::congestion::BulkSignal;
use super::generation::{CidGenerator, ForwardStats, GenerationKey, Handshakes, Predecessor, QuicSocket};
use super::routing::{Group, MAX_SOCKETS};
use super::{connection, mtu, quic_crypto, transport, H3Error, Handshake, Serving};
use crate::config::{H3Settings, Limits};
use crate::metrics::Transport;

/// Kernel socket buffers for each UDP socket; bulk QUIC needs far more than the
/// defaults to absorb bursts (best effort: capped by net.core.{r,w}mem_max).
const UDP_BUFFER_BYTES: usize = 8 * 1024 * 1024;

/// The bound HTTP/3 endpoints, one per UDP socket, index order.
#[derive(Debug)]
pub(crate) struct H3Endpoint {
    endpoints: Vec<quinn::Endpoint>,
    base: quinn::ServerConfig,
    handover: Handover,
}

/// What a binary upgrade needs of the endpoints: their sockets (to switch reading
/// modes, and the descriptors to hand over), the key their connection IDs are
/// tagged with, and the handshakes they have started.
#[derive(Debug, Clone)]
pub(crate) struct Handover {
    pub(crate) sockets: Vec<Arc<QuicSocket>>,
    pub(crate) key: GenerationKey,
    pub(crate) handshakes: Arc<Handshakes>,
    pub(crate) udp: Vec<Arc<std::net::UdpSocket>>,
}

impl Handover {
    /// Every socket reads its UDP socket again.
    pub(crate) fn direct(&self) {
        for socket in &self.sockets {
            socket.direct();
        }
    }

    /// Stops reading the UDP sockets: the first socket reads `pair` and hands the
    /// others their datagrams.
    pub(crate) fn forwarded(&self, pair: OwnedFd) -> std::io::Result<()> {
        let mut pair = Some(pair);
        for socket in &self.sockets {
            socket.forwarded(pair.take())?;
        }
        Ok(())
    }

    /// Every socket forwards the predecessor's datagrams to it until it is gone.
    pub(crate) fn demux(&self, predecessor: Predecessor) {
        let predecessor = Arc::new(predecessor);
        for socket in &self.sockets {
            socket.demux(predecessor.clone());
        }
    }

    /// Datagrams handed to a draining predecessor, over all sockets.
    pub(crate) fn forward_stats(&self) -> ForwardStats {
        self.sockets
            .iter()
            .map(|s| s.forward_stats())
            .fold(ForwardStats::default(), |a, b| ForwardStats {
                forwarded: a.forwarded + b.forwarded,
                dropped: a.dropped + b.dropped,
            })
    }
}

/// Replaces the endpoints' server configuration on reload, keeping their Retry
/// token keys (a client answering a Retry sent before the reload is still let in).
#[derive(Debug, Clone)]
pub(crate) struct H3Switch {
    endpoints: Vec<quinn::Endpoint>,
    base: quinn::ServerConfig,
}

impl H3Switch {
    pub(crate) fn set(&self, crypto: Option<&Arc<QuicServerConfig>>) {
        for endpoint in &self.endpoints {
            endpoint.set_server_config(crypto.map(|c| with_crypto(&self.base, c)));
        }
    }
}

fn with_crypto(base: &quinn::ServerConfig, crypto: &Arc<QuicServerConfig>) -> quinn::ServerConfig {
    let mut config = base.clone();
    config.crypto = crypto.clone();
    config
}

/// How many UDP sockets `h3_sockets` asks for: `0` is one per worker thread.
pub(crate) fn sockets_wanted(h3_sockets: u16, workers: usize) -> usize {
    match h3_sockets {
        0 => workers,
        n => usize::from(n),
    }
    .clamp(1, MAX_SOCKETS)
}

impl H3Endpoint {
    /// Binds `wanted` UDP sockets on `addr` for the sites that serve HTTP/3, or serves
    /// on `inherited`, the bound sockets a previous process handed over (all of them,
    /// whatever `wanted` says: every socket of the port's group must have a reader;
    /// more are bound if `wanted` is larger).
    pub(crate) fn bind(
        addr: SocketAddr,
        inherited: Vec<std::net::UdpSocket>,
        wanted: usize,
        tls: Arc<rustls::ServerConfig>,
        settings: &H3Settings,
        limits: &Limits,
    ) -> Result<Self, H3Error> {
        let crypto = quic_crypto(tls)?;
        let mut base = quinn::ServerConfig::with_crypto(crypto);
        base.transport_config(Arc::new(transport(
            settings,
            mtu::without_peer(settings.mtu_upper_bound_bytes),
            limits,
            false,
            BulkSignal::default(),
        )));
        let bind_err = |source| H3Error::Bind { addr, source };
        let sockets = group_sockets(addr, inherited, wanted).map_err(bind_err)?;
        let key = GenerationKey::random().map_err(bind_err)?;
        let handshakes = Arc::<Handshakes>::default();
        let group = Group::new(key, sockets.len(), handshakes.clone());
        let (mut endpoints, mut quic, mut udp) = (Vec::new(), Vec::new(), Vec::new());
        for (index, socket) in (0u8..).zip(sockets) {
            socket.set_nonblocking(true).map_err(bind_err)?;
            udp.push(Arc::new(socket.try_clone().map_err(bind_err)?));
            let socket = QuicSocket::new(socket, index, group.clone()).map_err(bind_err)?;
            if let Err(e) = socket.use_send_queue(settings.send_batch_delay_us) {
                tracing::warn!(error = %e, "h3: cannot batch sends; sending per connection");
            }
            let mut config = quinn::EndpointConfig::default();
            config.cid_generator(move || Box::new(CidGenerator::new(key, index)));
            let endpoint = quinn::Endpoint::new_with_abstract_socket(
                config,
                Some(base.clone()),
                socket.clone(),
                Arc::new(GatheringRuntime::new(socket.clone())),
            )
            .map_err(bind_err)?;
            endpoints.push(endpoint);
            quic.push(socket);
        }
        let handover = Handover {
            sockets: quic,
            key,
            handshakes,
            udp,
        };
        Ok(Self {
            endpoints,
            base,
            handover,
        })
    }

    /// How many UDP sockets (endpoints) serve.
    pub(crate) fn sockets(&self) -> usize {
        self.endpoints.len()
    }

    /// What a binary upgrade hands over or switches (see [`Handover`]).
    pub(crate) fn handover(&self) -> &Handover {
        &self.handover
    }

    /// The handle a reload replaces the server configuration through.
    pub(crate) fn switch(&self) -> H3Switch {
        H3Switch {
            endpoints: self.endpoints.clone(),
            base: self.base.clone(),
        }
    }

    /// Accepts connections on every endpoint until shutdown, each holding one of
    /// `permits` (shared with TCP) for its whole life, and served by the generation
    /// `current` returns when it arrives. Under load (more than half the permits
    /// taken), or always with `h3_retry`, new clients must prove their address
    /// first (Retry).
    pub(crate) async fn serve<S: Serving>(
        self,
        current: impl Fn() -> Arc<S> + Send + Sync + 'static,
        permits: Arc<Semaphore>,
        max_connections: usize,
    ) {
        let current = Arc::new(current);
        // Dropped (the server aborts this task when its drain ends), it aborts them.
        let mut loops = tokio::task::JoinSet::new();
        for (index, endpoint) in (0u8..).zip(&self.endpoints) {
            let intake = Intake {
                endpoint: endpoint.clone(),
                socket: self.handover.sockets[usize::from(index)].clone(),
                index,
                base: self.base.clone(),
                handshakes: self.handover.handshakes.clone(),
            };
            let current = current.clone();
            loops.spawn(intake.run(move || current(), permits.clone(), max_connections));
        }
        while loops.join_next().await.is_some() {}
        // New connections are refused from here on; open ones drain through `shutdown`.
        for endpoint in &self.endpoints {
            endpoint.set_server_config(None);
        }
        let endpoints = self.endpoints.clone();
        drop(self);
        // Once the last QUIC connection has gone (its close sent and drained), the
        // endpoints close. Not by waiting for every permit: a waiter holds the
        // permits it has collected so far, and the server's drain would count them
        // as open connections. The server aborts this task when its drain ends.
        for endpoint in &endpoints {
            endpoint.wait_idle().await;
            endpoint.close(quinn::VarInt::from_u32(0), b"shutdown");
        }
    }
}

/// One endpoint's accept loop.
struct Intake {
    endpoint: quinn::Endpoint,
    socket: Arc<QuicSocket>,
    index: u8,
    base: quinn::ServerConfig,
    handshakes: Arc<Handshakes>,
}

impl Intake {
    async fn run<S: Serving>(
        self,
        current: impl Fn() -> Arc<S> + Send,
        permits: Arc<Semaphore>,
        max_connections: usize,
    ) {
        let mut shutdown = current().drivers().shutdown.clone();
        loop {
            let incoming = tokio::select! {
                incoming = self.endpoint.accept() => match incoming {
                    Some(incoming) => incoming,
                    None => break,
                },
                () = shutdown.requested() => break,
            };
            // One load per connection: the generation it keeps for its whole life.
            let generation = current();
            let drivers = generation.drivers();
            let Some(crypto) = generation.quic() else {
                drivers.metrics.connections().refused(Transport::Quic);
                incoming.refuse();
                continue;
            };
            let busy = permits.available_permits() < max_connections / 2;
            if (drivers.h3.always_retry || busy)
                && !incoming.remote_address_validated()
                && incoming.may_retry()
            {
                let peer = incoming.remote_address();
                match incoming.retry() {
                    Ok(()) => tracing::debug!(%peer, "h3: address validation (Retry) sent"),
                    Err(e) => tracing::debug!(%peer, error = %e, "h3: retry failed"),
                }
                continue;
            }
            let Ok(permit) = permits.clone().try_acquire_owned() else {
                drivers.metrics.connections().refused(Transport::Quic);
                incoming.refuse();
                continue;
            };
            // One controller factory per connection carries that connection's signal.
            let signal = BulkSignal::default();
            let mut config = with_crypto(&self.base, crypto);
            let webtransport = drivers.webtransport_sessions > 0;
            let mtu_upper_bound = mtu::upper_bound(
                drivers.h3.mtu_upper_bound_bytes,
                incoming.local_ip(),
                incoming.remote_address(),
            );
            config.transport_config(Arc::new(transport(
                &drivers.h3,
                mtu_upper_bound,
                &drivers.limits,
                webtransport,
                signal.clone(),
            )));
            // A reload changes the cross-connection delay (gathering within a poll is
            // always on); what is queued still leaves.
            if let Err(e) = self.socket.use_send_queue(drivers.h3.send_batch_delay_us) {
                tracing::warn!(error = %e, "h3: cannot batch sends; sending per connection");
            }
            let peer = incoming.remote_address();
            let cid = incoming.orig_dst_cid();
            match incoming.accept_with(Arc::new(config)) {
                Ok(connecting) => {
                    let handshake = Handshake {
                        cid,
                        table: self.handshakes.clone(),
                    };
                    handshake.table.started(&handshake.cid, self.index);
                    tokio::spawn(connection(
                        connecting,
                        drivers.clone(),
                        signal,
                        peer,
                        permit,
                        handshake,
                    ));
                }
                Err(e) => tracing::debug!(%peer, error = %e, "h3: accept failed"),
            }
        }
    }
}

/// The group's UDP sockets: the inherited ones first (a successor numbers them
/// afresh: its IDs are its own, under its own key), then new ones up to `wanted`. With more than one, every socket has `SO_REUSEPORT`; a socket inherited
/// from a binary that bound it without may refuse company, and the group stays
/// smaller (logged).
fn group_sockets(
    addr: SocketAddr,
    mut sockets: Vec<std::net::UdpSocket>,
    wanted: usize,
) -> std::io::Result<Vec<std::net::UdpSocket>> {
    sockets.truncate(MAX_SOCKETS);
    let reuse = wanted > 1 || sockets.len() > 1;
    if reuse {
        for socket in &sockets {
            socket2::SockRef::from(socket).set_reuse_port(true)?;
        }
    }
    if sockets.is_empty() {
        sockets.push(udp_socket(addr, reuse)?);
    }
    // The port actually bound (the listen address may name port 0).
    let local = sockets[0].local_addr()?;
    while sockets.len() < wanted {
        match udp_socket(local, true) {
            Ok(socket) => sockets.push(socket),
            Err(e) => {
                tracing::warn!(
                    %local,
                    error = %e,
                    sockets = sockets.len(),
                    wanted,
                    "h3: cannot add a UDP socket to the port's SO_REUSEPORT group; serving on fewer"
                );
                break;
            }
        }
    }
    Ok(sockets)
}

fn udp_socket(addr: SocketAddr, reuse_port: bool) -> std::io::Result<std::net::UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    if addr.is_ipv6() {
        socket.set_only_v6(false)?;
    }
    if reuse_port {
        socket.set_reuse_port(true)?;
    }
    let _ = socket.set_recv_buffer_size(UDP_BUFFER_BYTES);
    let _ = socket.set_send_buffer_size(UDP_BUFFER_BYTES);
    socket.bind(&addr.into())?;
    Ok(socket.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_is_one_socket_per_worker_within_the_cap() {
        assert_eq!(sockets_wanted(0, 2), 2);
        assert_eq!(sockets_wanted(0, 200), MAX_SOCKETS);
        assert_eq!(sockets_wanted(1, 8), 1);
        assert_eq!(sockets_wanted(4, 1), 4);
    }

    /// Four sockets share one port, and a fifth joins the group as a successor's would.
    #[test]
    fn sockets_share_the_port_and_a_successor_can_add_more() {
        let sockets = group_sockets("127.0.0.1:0".parse().unwrap(), Vec::new(), 4).unwrap();
        let port = sockets[0].local_addr().unwrap().port();
        assert_eq!(sockets.len(), 4);
        assert!(sockets.iter().all(|s| s.local_addr().unwrap().port() == port));
        let grown = group_sockets("127.0.0.1:0".parse().unwrap(), sockets, 5).unwrap();
        assert_eq!(grown.len(), 5);
        assert!(grown.iter().all(|s| s.local_addr().unwrap().port() == port));
    }
}
