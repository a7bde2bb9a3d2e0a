//! The passthrough plan: which engines carry TLS and HTTP/3 passthrough, the eBPF
//! programs they (and TCP health) need, the UDP relay, and the counters they leave
//! behind.
//!
//! A `required` eBPF that fails to load stops startup; `auto` logs why and carries
//! on with a userspace engine (and without TCP health).

use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};

use tokio::task::JoinHandle;

use super::ServerError;
use crate::config::{Config, Engine, Policy, UdpEngine, UdpPassthrough};
use crate::ebpf::{EbpfError, Programs, Values};
use crate::passthrough::udp::UdpRelay;
use crate::passthrough::Passthrough;
use crate::preflight::Report;

#[derive(Debug)]
pub(super) struct Plan {
    /// The TCP passthrough routes, if any.
    pub(super) passthrough: Option<Arc<Passthrough>>,
    /// Loaded when passthrough or TCP health would use them and preflight found
    /// eBPF usable.
    programs: Option<Arc<Programs>>,
    /// Whether TCP health should be watched (preflight found it usable).
    tcp_health: bool,
    tcp_health_policy: Policy,
    /// Mirrors the daemon's counters into the pinned map for `webship stats`.
    publisher: Option<JoinHandle<()>>,
    /// The engine TCP passthrough runs, resolved once for every generation.
    engine: Engine,
    udp: Option<UdpPassthrough>,
    ebpf_policy: Policy,
    ktls_counters: bool,
}

/// The passthrough counters the processes before this one counted (kernel and
/// userspace, summed), as the last of them reported them over the takeover
/// connection: published on top of this process's own, so `webship stats` totals
/// carry on across a binary upgrade.
static INHERITED: Mutex<Values> = Mutex::new([0; crate::ebpf::COUNTERS as usize]);

/// Records what the predecessor reported it has counted so far (it reports more
/// while it drains; each report replaces the last).
pub(super) fn inherit_counters(values: &[u64]) {
    let mut inherited = INHERITED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for (slot, v) in inherited.iter_mut().zip(values) {
        *slot = *v;
    }
}

/// This process's userspace counters plus what it inherited.
pub(super) fn published() -> Values {
    let inherited = *INHERITED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut values = crate::passthrough::counters();
    for (v, i) in values.iter_mut().zip(inherited) {
        *v = v.saturating_add(i);
    }
    values
}

impl Plan {
    /// `inherited_lock`: the locked pin folder a predecessor handed over;
    /// `inherited_udp`: the UDP sockets it handed over (all of which this process
    /// serves).
    pub(super) fn load(
        config: &Config,
        report: &Report,
        inherited_lock: Option<OwnedFd>,
        inherited_udp: usize,
    ) -> Result<Self, ServerError> {
        let programs = load_programs(config, report, inherited_lock, inherited_udp)?;
        let engine = crate::passthrough::resolve(config.passthrough_engine, programs.is_some());
        let passthrough = Passthrough::new(config, engine, programs.clone()).map(Arc::new);
        if let Some(pt) = &passthrough {
            tracing::info!(engine = %pt.engine(), configured = %config.passthrough_engine, "passthrough engine");
        }
        let publisher = programs.clone().map(|p| tokio::spawn(publish_counters(p)));
        Ok(Self {
            passthrough,
            programs,
            publisher,
            engine,
            udp: config.passthrough_udp,
            ebpf_policy: config.kernel.ebpf,
            ktls_counters: report.use_ktls(),
            tcp_health: report.use_tcp_health(),
            tcp_health_policy: config.kernel.tcp_health,
        })
    }

    /// Attaches TCP health and returns the programs that count it (`None`: off, or
    /// `auto` and it failed, which is logged). Connections are watched once their
    /// listening port is known (`Programs::watch_port`).
    pub(super) fn watch_tcp(&self) -> Result<Option<Arc<Programs>>, ServerError> {
        let Some(programs) = self.programs.as_ref().filter(|_| self.tcp_health) else {
            return Ok(None);
        };
        match programs.watch_tcp() {
            Ok(cgroup) => {
                tracing::info!(cgroup = %cgroup.display(), "TCP health: counting per site (`webship stats`)");
                Ok(Some(programs.clone()))
            }
            Err(e) if self.tcp_health_policy == Policy::Required => Err(e.into()),
            Err(e) => {
                tracing::warn!(error = %e, "TCP health not counted: its sock_ops program did not attach");
                Ok(None)
            }
        }
    }

    /// The TCP passthrough engine and the programs it uses: what every generation's
    /// passthrough routes are carried by (reloads change routes, not engines).
    pub(super) fn engine(&self) -> Engine {
        self.engine
    }

    pub(super) fn programs(&self) -> Option<Arc<Programs>> {
        self.programs.clone()
    }

    /// Steers the HTTP/3 sockets' datagrams in the kernel (with more than one socket
    /// and the programs loaded); returns whether it does. Failing, `required` stops
    /// startup; `auto` logs it, and the sockets hand misrouted datagrams over
    /// themselves as without eBPF.
    pub(super) fn steer_quic(&self, h3: &crate::h3::H3Endpoint) -> Result<bool, ServerError> {
        let sockets = &h3.handover().udp;
        if sockets.len() < 2 {
            return Ok(false);
        }
        let Some(programs) = &self.programs else {
            // A predecessor's program stays on the group (it outlives the process
            // that attached it) and would go on steering: `off` means none.
            if self.ebpf_policy == Policy::Off {
                match crate::sys::detach_reuseport_program(&*sockets[0]) {
                    Ok(true) => {
                        tracing::info!("h3: removed the SK_REUSEPORT program a previous process attached")
                    }
                    Ok(false) => {}
                    Err(e) => {
                        tracing::warn!(error = %e, "h3: cannot remove the SK_REUSEPORT program a previous process attached")
                    }
                }
            }
            return Ok(false);
        };
        match programs.steer_quic(sockets) {
            Ok(()) => Ok(true),
            Err(e) if self.ebpf_policy == Policy::Required => Err(e.into()),
            Err(e) => {
                tracing::warn!(error = %e, "h3: SK_REUSEPORT steering not used: datagrams for another socket are handed over in-process");
                Ok(false)
            }
        }
    }

    /// Whether eBPF programs were loaded (the process keeps what they need at run time).
    pub(super) fn ebpf_loaded(&self) -> bool {
        self.programs.is_some()
    }

    /// Every passthrough counter this process and its predecessors counted, kernel
    /// and userspace summed: what a successor publishes on top of its own.
    pub(super) fn totals(programs: Option<&Programs>) -> Values {
        let mut values = published();
        if let Some(kernel) = programs.map(Programs::kernel_counters) {
            for (v, k) in values.iter_mut().zip(kernel) {
                *v = v.saturating_add(k);
            }
        }
        values
    }

    /// This process serves now: its maps replace the predecessor's pins.
    pub(super) fn adopt_pins(&self) {
        if let Some(p) = &self.programs {
            p.adopt_pins();
        }
    }

    /// A successor serves now and has taken over the pins: stop publishing into
    /// maps nobody reads, and leave the pins alone at exit.
    pub(super) fn hand_over(&self) {
        if let Some(task) = &self.publisher {
            task.abort();
        }
        if let Some(p) = &self.programs {
            p.hand_over();
        }
    }

    /// Whether this plan relays HTTP/3 passthrough (it reads one UDP socket).
    pub(super) fn relays_udp(&self) -> bool {
        self.udp.is_some()
    }

    /// HTTP/3 passthrough on the UDP side of `listen`: the kernel redirect when it
    /// applies, and the userspace relay, which owns the port either way.
    pub(super) fn bind_udp(
        &self,
        config: &Config,
        listen: SocketAddr,
        inherited: Option<std::net::UdpSocket>,
    ) -> Result<Option<UdpRelay>, ServerError> {
        let Some(udp) = self.udp else {
            return Ok(None);
        };
        // The kernel redirect goes in before the relay socket exists: a datagram the
        // relay took first would start that client's flow on the other path, and the
        // rest of the flow, redirected, would reach the origin from another address.
        self.redirect_udp_in_kernel(udp, listen)?;
        let relay = UdpRelay::bind(listen, inherited, udp, config.limits.max_connections)
            .map_err(|source| ServerError::Bind { addr: listen, source })?;
        tracing::info!(
            udp = %relay.local_addr().unwrap_or(listen),
            origin = %udp.upstream,
            "HTTP/3 passthrough: every datagram goes to the QUIC origin"
        );
        Ok(Some(relay))
    }

    /// Relays until aborted; stops reading clients once `stop` is requested (a
    /// successor reads them then).
    pub(super) fn start_relay(
        &self,
        relay: Option<UdpRelay>,
        stop: crate::shutdown::Shutdown,
    ) -> Option<JoinHandle<()>> {
        relay.map(|relay| tokio::spawn(relay.run(stop)))
    }

    /// Hands HTTP/3 passthrough to the kernel when the UDP engine asks for eBPF (or
    /// `auto` finds it applicable and loaded).
    fn redirect_udp_in_kernel(&self, udp: UdpPassthrough, listen: SocketAddr) -> Result<(), ServerError> {
        let applies = UdpEngine::ebpf_applies(listen, udp.upstream);
        let (Some(programs), SocketAddr::V4(listen), SocketAddr::V4(origin)) =
            (self.programs.as_deref(), listen, udp.upstream)
        else {
            if udp.engine == UdpEngine::Ebpf {
                return Err(EbpfError::Load(
                    "the eBPF UDP redirect needs the programs loaded and IPv4 loopback addresses".into(),
                )
                .into());
            }
            tracing::info!(engine = "userspace", "HTTP/3 passthrough engine");
            return Ok(());
        };
        if udp.engine == UdpEngine::Userspace || !applies {
            tracing::info!(engine = "userspace", configured = %udp.engine, "HTTP/3 passthrough engine");
            return Ok(());
        }
        match programs.redirect_udp(listen, origin) {
            Ok(()) => {
                tracing::info!(engine = "ebpf", configured = %udp.engine, "HTTP/3 passthrough engine");
                Ok(())
            }
            Err(e) if udp.engine == UdpEngine::Ebpf || self.ebpf_policy == Policy::Required => Err(e.into()),
            Err(e) => {
                tracing::warn!(error = %e, "eBPF UDP redirect not used: HTTP/3 passthrough is relayed in userspace");
                Ok(())
            }
        }
    }

    /// After the drain: the counters' last word, then the programs detach and the
    /// pinned maps go (with the last reference).
    pub(super) fn finish(self) {
        if let Some(task) = &self.publisher {
            task.abort();
        }
        if self.passthrough.is_some() {
            let user = published();
            let kernel = self.programs.as_ref().map(|p| p.kernel_counters());
            if let Some(p) = &self.programs {
                p.publish(&user);
            }
            let line: Vec<String> = crate::ebpf::Counter::ALL
                .iter()
                .map(|&c| {
                    let k = kernel.map_or(0, |k| k[c as usize]);
                    format!("{}={}", c.name(), user[c as usize] + k)
                })
                .collect();
            tracing::info!("passthrough counters: {}", line.join(" "));
        }
        if let Some(p) = self.programs.as_ref().filter(|_| self.tcp_health) {
            for s in p.tcp_snapshot().sites {
                tracing::info!(
                    site = %s.site,
                    closed = s.closed,
                    reset = s.reset,
                    retransmits = s.retransmits,
                    rto = s.rto,
                    rtt_p50_us = s.rtt_us.quantile(0.5),
                    rtt_p99_us = s.rtt_us.quantile(0.99),
                    "TCP health"
                );
            }
        }
        drop(self.passthrough);
        drop(self.programs);
        if self.ktls_counters {
            let c = crate::ktls::counters();
            tracing::info!(
                promotions = c.promotions,
                sendfile_bytes = c.sendfile_bytes,
                fallbacks = c.fallbacks,
                "ktls counters"
            );
        }
    }
}

fn load_programs(
    config: &Config,
    report: &Report,
    inherited_lock: Option<OwnedFd>,
    inherited_udp: usize,
) -> Result<Option<Arc<Programs>>, ServerError> {
    let tcp_health = config.kernel.tcp_health != Policy::Off;
    let steers = steers_quic(config, inherited_udp);
    if (config.passthrough.is_empty() && !steers && !tcp_health) || !report.use_ebpf() {
        return Ok(None);
    }
    match Programs::load(
        &config.kernel.bpf_pin_dir,
        inherited_lock,
        config.limits.max_connections,
    ) {
        Ok(programs) => {
            tracing::info!(pins = %config.kernel.bpf_pin_dir.display(), "eBPF programs loaded; counters pinned for `webship stats`");
            Ok(Some(programs))
        }
        // Steering alone is an optimisation the in-process hand-off stands in
        // for: under `auto` a busy or unusable pin folder (a second daemon on the
        // host with the default folder) must not stop a start that eBPF was never
        // essential to.
        Err(e)
            if config.kernel.ebpf == Policy::Auto
                && steers
                && config.passthrough.is_empty()
                && !tcp_health =>
        {
            tracing::warn!(error = %e, "eBPF steering not used: HTTP/3 sockets hand misrouted datagrams over themselves");
            Ok(None)
        }
        Err(e) if config.kernel.ebpf == Policy::Required || e.is_misconfiguration() => Err(e.into()),
        Err(e) => {
            tracing::warn!(error = %e, "eBPF not used: passthrough runs a userspace engine, HTTP/3 sockets hand datagrams over themselves");
            Ok(None)
        }
    }
}

/// Whether HTTP/3 is served on more than one UDP socket: as configured, or as
/// inherited (a successor serves every socket its predecessor handed over, whose
/// group may carry the predecessor's steering program).
fn steers_quic(config: &Config, inherited_udp: usize) -> bool {
    config.steers_quic() || (inherited_udp > 1 && config.sites.iter().any(|s| s.protocols.h3))
}

/// Mirrors the daemon's passthrough counters into the pinned map twice a second.
async fn publish_counters(programs: Arc<Programs>) {
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(500));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        programs.publish(&published());
    }
}
