//! A generation: everything built from one reading of the configuration that serves
//! new connections (certificates and the TLS acceptor, the service with its sites,
//! routes, upstream pools and WebTransport endpoints, the driver settings and
//! per-connection limits, the TCP passthrough routes, the QUIC TLS configuration),
//! and [`Current`], the one place a reload swaps it.
//!
//! Each accepted connection (TCP or QUIC) takes an `Arc` of the current generation
//! once, at accept, and keeps it until it ends: transfers in flight finish on the
//! configuration they started with, and an old generation is freed (its upstream
//! pools closed) when its last connection goes. The swap is a write under a
//! `RwLock` that only the reload takes; the accept loops (one task for TCP, one for
//! QUIC) take the read side once per connection, uncontended: two atomic operations
//! and an `Arc` clone per connection, nothing per request or per chunk.

use std::os::fd::BorrowedFd;
use std::sync::{Arc, RwLock};

use quinn::crypto::rustls::QuicServerConfig;

use super::{ServerError, Stack};
use crate::config::{Config, Engine};
use crate::ebpf::Programs;
use crate::exchange::access::Sink;
use crate::exchange::Drivers;
use crate::passthrough::Passthrough;
use crate::shutdown::Shutdown;

/// What stays the same across generations: built once at start.
#[derive(Debug, Clone)]
pub(super) struct Fixed {
    pub(super) shutdown: Shutdown,
    pub(super) ktls: Option<Arc<crate::ktls::Support>>,
    /// The passthrough engine resolved at start (and the eBPF programs it uses).
    pub(super) engine: Engine,
    pub(super) programs: Option<Arc<Programs>>,
    /// The programs counting TCP health, when it is on and attached.
    pub(super) tcp_health: Option<Arc<Programs>>,
    /// Where access log lines go (the file is opened once, at start; SIGUSR1 reopens
    /// it); each generation brings its own format and sampling.
    pub(super) access: Arc<Sink>,
    /// The process's metrics: every generation's sites keep their slots in it.
    pub(super) metrics: Arc<crate::metrics::Registry>,
    /// The large responses in flight (the control socket's `transfers`).
    pub(super) transfers: Arc<crate::exchange::Transfers>,
    /// Certificate slots, session cache and ticket keys, kept across reloads.
    pub(super) tls: Arc<crate::tls::Shared>,
    /// Keeps the ACME sites' certificates filled (`webship certs` asks it).
    pub(super) acme: Arc<crate::acme::Manager>,
}

/// TCP health's counter slots for this generation's sites and passthrough routes,
/// by index (`None`: not counted, every slot taken). Looked up by name once per
/// generation, so a reload keeps a site's counters and a connection pays no lookup.
#[derive(Debug)]
pub(super) struct TcpSlots {
    programs: Arc<Programs>,
    sites: Vec<Option<u32>>,
    routes: Vec<Option<u32>>,
}

impl TcpSlots {
    fn new(programs: &Arc<Programs>, config: &Config) -> Self {
        let slot = |name: String| programs.tcp_slot(&name);
        Self {
            programs: programs.clone(),
            sites: config.sites.iter().map(|s| slot(s.domain.to_string())).collect(),
            routes: config
                .passthrough
                .iter()
                .map(|r| slot(r.domain.to_string()))
                .collect(),
        }
    }

    /// Counts a terminated connection under site `site`.
    pub(super) fn tag_site(&self, socket: BorrowedFd<'_>, site: usize) {
        if let Some(&Some(slot)) = self.sites.get(site) {
            self.programs.tag_tcp(socket, slot);
        }
    }

    /// Counts a passthrough client connection under its route's name.
    pub(super) fn tag_route(&self, socket: BorrowedFd<'_>, route: usize) {
        if let Some(&Some(slot)) = self.routes.get(route) {
            self.programs.tag_tcp(socket, slot);
        }
    }
}

/// One generation of the configuration, as new connections see it.
pub(super) struct Generation {
    /// 1 at start, one more per successful reload.
    pub(super) number: u64,
    /// What it was built from (restart-only settings already replaced by the
    /// running ones: see `reload::keep_running`).
    pub(super) config: Config,
    pub(super) stack: Stack,
    pub(super) drivers: Arc<Drivers>,
    pub(super) passthrough: Option<Arc<Passthrough>>,
    /// The QUIC form of `stack.acceptor.quic_config()`; `None` when no site serves h3.
    pub(super) quic: Option<Arc<QuicServerConfig>>,
    /// TCP health's slots, when it is counted.
    pub(super) tcp: Option<TcpSlots>,
}

impl Generation {
    /// Assembles a generation from a built [`Stack`] (what `webship check` builds).
    pub(super) fn new(number: u64, config: Config, stack: Stack, fixed: &Fixed) -> Result<Self, ServerError> {
        let drivers = Arc::new(Drivers::new(
            &config,
            stack.service.clone(),
            fixed.shutdown.clone(),
            fixed.ktls.clone(),
            &fixed.access,
            &fixed.metrics,
            fixed.transfers.clone(),
        ));
        let passthrough = Passthrough::new(&config, fixed.engine, fixed.programs.clone()).map(Arc::new);
        let quic = stack
            .acceptor
            .quic_config()
            .map(crate::h3::quic_crypto)
            .transpose()?;
        let tcp = fixed.tcp_health.as_ref().map(|p| TcpSlots::new(p, &config));
        Ok(Self {
            number,
            config,
            stack,
            drivers,
            passthrough,
            quic,
            tcp,
        })
    }
}

impl std::fmt::Debug for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Generation")
            .field("number", &self.number)
            .field("source", &self.config.source)
            .finish_non_exhaustive()
    }
}

impl crate::h3::Serving for Generation {
    fn drivers(&self) -> &Arc<Drivers> {
        &self.drivers
    }

    fn quic(&self) -> Option<&Arc<QuicServerConfig>> {
        self.quic.as_ref()
    }
}

/// The generation new connections get: the single swap point.
#[derive(Debug)]
pub(super) struct Current {
    cell: RwLock<Arc<Generation>>,
}

impl Current {
    pub(super) fn new(first: Generation) -> Self {
        Self {
            cell: RwLock::new(Arc::new(first)),
        }
    }

    /// The generation a connection accepted now keeps.
    pub(super) fn load(&self) -> Arc<Generation> {
        // A poisoned lock still holds a whole generation: the swap is one assignment.
        self.cell.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Makes `next` current; returns the generation it replaces (connections that
    /// hold it keep it alive).
    pub(super) fn swap(&self, next: Generation) -> Arc<Generation> {
        let mut cell = self.cell.write().unwrap_or_else(|e| e.into_inner());
        std::mem::replace(&mut *cell, Arc::new(next))
    }
}
