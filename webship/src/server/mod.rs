//! The supervisor: builds TLS and the service, binds, accepts within the connection
//! limit, and drains on shutdown. [`run`] is those steps in order: [`Stack::build`]
//! (what `webship check` builds too), the passthrough [`Plan`], [`Bound::bind`], the
//! switch to the service account (`process.rs`), the accept loop, and the drain.
//!
//! Every connection holds one permit of a semaphore sized `max_connections`; a full
//! server stops accepting (the kernel backlog absorbs the burst) instead of failing
//! new clients. Draining is waiting for every permit to come back.

mod handover;
mod plan;
mod process;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use std::os::fd::{AsFd, OwnedFd};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::{Config, TlsSource};
use crate::control::{ControlListener, Reply, Request};
use crate::exchange::Drivers;
use crate::h3::H3Endpoint;
use crate::passthrough::{Decision, Passthrough};
use crate::preflight::Report;
use crate::service::Service;
use crate::tls::{Acceptor, SiteNames};
pub use handover::HandoverError;
use plan::Plan;
pub use process::{raise_fd_limit, Privilege, ProcessError};

// The errors a server can fail with, nameable by the binary.
pub use crate::h3::H3Error;
pub use crate::proxy::ProxyError;
pub use crate::tls::TlsError;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error(transparent)]
    H3(#[from] H3Error),
    #[error(transparent)]
    Proxy(#[from] ProxyError),
    #[error(transparent)]
    Process(#[from] ProcessError),
    #[error("eBPF could not be set up")]
    Ebpf(#[from] crate::ebpf::EbpfError),
    #[error(transparent)]
    Handover(#[from] HandoverError),
    #[error(transparent)]
    Control(#[from] crate::control::ControlError),
    #[error("the inherited listening socket cannot be used: {0}")]
    Inherited(std::io::Error),
    #[error(
        "cannot listen on {addr}: {source} (fix: choose a free port, or run with the privilege to bind it)"
    )]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// Builds everything a configuration needs before anything binds (certificates,
/// keys, upstream TLS, the service account), as `webship check` does: a
/// configuration that passes here fails later only for the host's reasons (ports,
/// privileges, kernel).
pub fn check(config: &Config) -> Result<(), ServerError> {
    Stack::build(config)?;
    process::resolve(config)?;
    Ok(())
}

/// Serves `config` until `signal` completes, then drains for up to
/// `limits.shutdown_grace`. Certificates are loaded before the port is bound, so a
/// bad certificate never leaves a half-started server. Everything that needs root
/// (certificates and keys, eBPF, binding) happens before `privilege` switches every
/// thread to the service account; nothing is accepted before.
///
/// With `takeover`, the sockets come from the daemon running on the same control
/// socket (`handover.rs`), which drains once this one serves.
pub async fn run(
    config: Config,
    report: Report,
    privilege: Privilege,
    takeover: bool,
    signal: impl Future<Output = ()>,
) -> Result<(), ServerError> {
    // The runtime's threads wait for the switch; whatever fails first releases them.
    let guard = privilege.guard();
    let stack = Stack::build(&config)?;
    let mut inherited = match (takeover, &config.control_socket) {
        (true, Some(path)) => Some(handover::take(path, config.listen).await?),
        (true, None) => return Err(HandoverError::NoControlSocket.into()),
        (false, _) => None,
    };
    let plan = Plan::load(
        &config,
        &report,
        inherited.as_mut().and_then(|i| i.pin_lock.take()),
    )?;
    let bound = Bound::bind(&config, &stack, &plan, inherited.as_mut())?;
    let control = match &config.control_socket {
        Some(path) => bind_control(path, takeover)?,
        None => None,
    };
    drop_privileges(&config, &report, &plan, &privilege)?;
    drop(guard);
    announce(&config, &report, &bound);

    let (trigger, shutdown) = crate::shutdown::channel();
    let ktls = report
        .use_ktls()
        .then(|| Arc::new(crate::ktls::Support::new(report.ktls_suites.clone())))
        .filter(|support| !support.is_empty());
    let relay_task = plan.start_relay(bound.relay, shutdown.clone());
    let drivers = Arc::new(Drivers::new(&config, stack.service.clone(), shutdown, ktls));
    let limit = config.limits.max_connections;
    let permits = Arc::new(Semaphore::new(limit));
    let generation = bound.h3.as_ref().map(|h3| h3.generation().clone());
    let h3_task = bound
        .h3
        .map(|endpoint| tokio::spawn(endpoint.serve(drivers.clone(), permits.clone(), limit)));
    let predecessor = Arc::new(std::sync::atomic::AtomicBool::new(false));
    if let Some(inherited) = inherited {
        let (alive, quic) = (predecessor.clone(), generation.clone());
        alive.store(true, std::sync::atomic::Ordering::SeqCst);
        let gone = move || {
            alive.store(false, std::sync::atomic::Ordering::SeqCst);
            if let Some(g) = quic {
                g.socket.direct();
                let stats = g.socket.forward_stats();
                tracing::info!(
                    forwarded = stats.forwarded,
                    dropped = stats.dropped,
                    "takeover: QUIC datagrams of the previous process's connections, handed to it"
                );
            }
        };
        // The listener already queues connections for this process; the old one
        // stops accepting once it reads this.
        if let Err(e) = inherited.serving(gone).await {
            tracing::warn!(error = %e, "takeover: the previous process did not hear that this one serves");
        }
        plan.adopt_pins();
    }

    let front = Front {
        acceptor: Arc::new(stack.acceptor),
        passthrough: plan.passthrough.clone(),
        drivers,
        bbr: report.use_bbr(),
    };
    let sockets = handover::Sockets {
        listen: config.listen,
        tcp: bound.tcp.as_fd(),
        h3: generation.as_ref(),
        relay: bound.relay_fd.as_ref().map(AsFd::as_fd),
        programs: plan.programs(),
    };
    let answer = control_requests(control, sockets, &predecessor);
    let successor = front
        .accept_until(bound.listener, &permits, async {
            tokio::select! {
                () = signal => None,
                successor = answer => Some(successor),
            }
        })
        .await
        .flatten();
    // The copies kept for a successor go too: once the accept loop has dropped its
    // listener, nothing may hold the port open (the kernel would keep completing
    // handshakes nobody accepts).
    drop((bound.tcp, bound.relay_fd, generation));

    if successor.is_some() {
        plan.hand_over();
    }
    trigger.request();
    drain(&permits, limit, config.limits.shutdown_grace).await;
    for task in [h3_task, relay_task].into_iter().flatten() {
        task.abort();
    }
    if let Some(successor) = successor {
        tracing::info!(successor = successor.pid(), "drained; the new process carries on");
        successor.farewell().await;
    }
    plan.finish();
    Ok(())
}

/// Binds the control socket (in place of the old daemon's after a takeover). A
/// daemon without one still serves; it only cannot be reloaded or taken over.
fn bind_control(path: &std::path::Path, takeover: bool) -> Result<Option<ControlListener>, ServerError> {
    let bound = match takeover {
        true => ControlListener::replace(path),
        false => ControlListener::bind(path),
    };
    match bound {
        Ok(listener) => Ok(Some(listener)),
        Err(e @ crate::control::ControlError::InUse(_)) => Err(e.into()),
        Err(e) => {
            tracing::warn!(error = %e, "no control socket: `webship serve --takeover` cannot reach this daemon");
            Ok(None)
        }
    }
}

/// Answers control requests until a new process has taken the sockets over, and
/// returns it. (RELOAD merge point: `Reload` and `Status` are answered here too.)
async fn control_requests(
    control: Option<ControlListener>,
    sockets: handover::Sockets<'_>,
    predecessor: &std::sync::atomic::AtomicBool,
) -> handover::Successor {
    let Some(control) = control else {
        return std::future::pending().await;
    };
    let mut requests = control.serve();
    while let Some(incoming) = requests.recv().await {
        match incoming.request {
            Request::Takeover if predecessor.load(std::sync::atomic::Ordering::SeqCst) => {
                let reason = "the process this one took over from is still draining; try again once it exits";
                handover::refuse(incoming, reason).await;
            }
            Request::Takeover => {
                if let Some(successor) = handover::give(incoming, sockets.clone()).await {
                    return successor;
                }
            }
            Request::Status => {
                let message = format!("webship {} pid {}", env!("CARGO_PKG_VERSION"), std::process::id());
                incoming.reply(&Reply::ok(message)).await;
            }
            Request::Reload { .. } => {
                incoming
                    .reply(&Reply::refused("reload is not supported by this build"))
                    .await;
            }
        }
    }
    std::future::pending().await
}

/// Switches to the service account keeping only what serving still needs; the pinned
/// maps become the account's, so it can remove them at shutdown.
fn drop_privileges(
    config: &Config,
    report: &Report,
    plan: &Plan,
    privilege: &Privilege,
) -> Result<(), ServerError> {
    let keep = process::kept_capabilities(plan.ebpf_loaded(), report.use_bbr());
    if let (Some((uid, gid)), true) = (privilege.ids(), plan.ebpf_loaded()) {
        give_pins(&config.kernel.bpf_pin_dir, uid, gid);
    }
    privilege.switch(keep)?;
    if privilege.switches() {
        process::check_roots(config);
    }
    Ok(())
}

/// Hands the pin folder and what is pinned in it to the service account. Links are
/// not followed: the account owned the folder on an earlier run and may have left
/// one there naming any file of root's.
fn give_pins(dir: &std::path::Path, uid: u32, gid: u32) {
    #[cfg(unix)]
    {
        let entries = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path());
        for path in std::iter::once(dir.to_path_buf()).chain(entries) {
            if let Err(e) = std::os::unix::fs::lchown(&path, Some(uid), Some(gid)) {
                tracing::warn!(path = %path.display(), error = %e, "cannot hand a pinned map to the service account; it stays after shutdown");
            }
        }
    }
    #[cfg(not(unix))]
    let _ = (dir, uid, gid);
}

/// What serves requests: the TLS acceptor and the service, which share one table of
/// site names.
struct Stack {
    acceptor: Acceptor,
    service: Arc<Service>,
}

impl Stack {
    fn build(config: &Config) -> Result<Self, ServerError> {
        let sites = SiteNames::new(config);
        Ok(Self {
            acceptor: Acceptor::build(config, &sites)?,
            service: Arc::new(Service::new(config, sites)?),
        })
    }
}

/// The sockets: TCP for h1/h2 (and TCP passthrough), UDP for HTTP/3 or for HTTP/3
/// passthrough.
struct Bound {
    listener: TcpListener,
    /// The listener's descriptor again, for a successor.
    tcp: OwnedFd,
    local: SocketAddr,
    h3: Option<H3Endpoint>,
    relay: Option<crate::passthrough::udp::UdpRelay>,
    relay_fd: Option<OwnedFd>,
}

impl Bound {
    /// Binds, or takes the sockets a predecessor handed over (`inherited`).
    fn bind(
        config: &Config,
        stack: &Stack,
        plan: &Plan,
        mut inherited: Option<&mut handover::Inherited>,
    ) -> Result<Self, ServerError> {
        let listener = match inherited.as_mut().and_then(|i| i.tcp.take()) {
            Some(std) => std
                .set_nonblocking(true)
                .and_then(|()| TcpListener::from_std(std))
                .map_err(ServerError::Inherited)?,
            None => crate::listener::bind(config.listen).map_err(|source| ServerError::Bind {
                addr: config.listen,
                source,
            })?,
        };
        let tcp = listener
            .as_fd()
            .try_clone_to_owned()
            .map_err(ServerError::Inherited)?;
        let local = listener.local_addr().unwrap_or(config.listen);
        let mut udp = inherited.as_mut().and_then(|i| i.udp.take());
        let h3 = match stack.acceptor.quic_config() {
            Some(tls) => Some(H3Endpoint::bind(
                local,
                udp.take(),
                tls,
                &config.h3,
                &config.limits,
            )?),
            None => None,
        };
        let predecessor = inherited.as_mut().and_then(|i| i.predecessor.take());
        match (&h3, predecessor) {
            (Some(h3), Some(pred)) => h3.generation().socket.demux(pred),
            (None, Some(_)) => tracing::warn!(
                "takeover: this configuration serves no HTTP/3; the previous process's QUIC connections end"
            ),
            _ => {}
        }
        let relay = plan.bind_udp(config, local, udp.take())?;
        let relay_fd = match &relay {
            Some(r) => Some(r.socket().try_clone_to_owned().map_err(ServerError::Inherited)?),
            None => None,
        };
        Ok(Self {
            listener,
            tcp,
            local,
            h3,
            relay,
            relay_fd,
        })
    }
}

/// The TCP front door: every accepted connection is passed through or terminated.
struct Front {
    acceptor: Arc<Acceptor>,
    passthrough: Option<Arc<Passthrough>>,
    drivers: Arc<Drivers>,
    bbr: bool,
}

impl Front {
    /// Accepts connections, each holding a permit, until `signal` completes, and
    /// returns what it completed with.
    async fn accept_until<T>(
        &self,
        listener: TcpListener,
        permits: &Arc<Semaphore>,
        signal: impl Future<Output = T>,
    ) -> Option<T> {
        tokio::pin!(signal);
        loop {
            let permit = tokio::select! {
                p = permits.clone().acquire_owned() => match p {
                    Ok(p) => p,
                    Err(_) => return None,
                },
                t = &mut signal => return Some(t),
            };
            let (tcp, peer) = tokio::select! {
                r = listener.accept() => match r {
                    Ok(conn) => conn,
                    Err(e) => {
                        // EMFILE and friends: back off instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                },
                t = &mut signal => return Some(t),
            };
            crate::listener::configure(&tcp, self.bbr);
            tokio::spawn(connection(
                tcp,
                peer,
                self.acceptor.clone(),
                self.passthrough.clone(),
                self.drivers.clone(),
                permit,
            ));
        }
    }
}

/// Waits up to `grace` for every connection to give its permit back.
async fn drain(permits: &Semaphore, limit: usize, grace: std::time::Duration) {
    tracing::info!(
        open = limit - permits.available_permits(),
        grace_secs = grace.as_secs(),
        "shutting down: draining connections"
    );
    let all = u32::try_from(limit).unwrap_or(u32::MAX);
    match tokio::time::timeout(grace, permits.acquire_many(all)).await {
        Ok(_) => tracing::info!("all connections closed"),
        Err(_) => tracing::warn!(
            open = limit - permits.available_permits(),
            "grace period over: closing the remaining connections"
        ),
    }
}

async fn connection(
    tcp: TcpStream,
    peer: SocketAddr,
    acceptor: Arc<Acceptor>,
    passthrough: Option<Arc<Passthrough>>,
    drivers: Arc<Drivers>,
    _permit: OwnedSemaphorePermit,
) {
    let handshake_timeout = drivers.limits.handshake_timeout;
    if let Some(pt) = &passthrough {
        match pt.decide(&tcp, handshake_timeout).await {
            Decision::Forward(route) => return pt.forward(route, tcp, peer).await,
            Decision::Close(reason) => {
                return tracing::debug!(%peer, reason, "passthrough: closed");
            }
            Decision::Terminate => {}
        }
    }
    if acceptor.is_empty() {
        return;
    }
    let accepted = match acceptor.accept(tcp, handshake_timeout).await {
        Ok(a) => a,
        Err(e) => {
            tracing::debug!(%peer, error = %e, "handshake failed");
            return;
        }
    };
    let ctx = drivers.connection(peer, accepted.site);
    if let Err(e) = crate::http::serve(accepted, ctx).await {
        tracing::debug!(%peer, error = %e, "connection ended with an error");
    }
}

fn announce(config: &Config, report: &Report, bound: &Bound) {
    let udp = match (&bound.h3, &bound.relay) {
        (Some(_), _) => " + udp for h3",
        (None, Some(_)) => " + udp for h3 passthrough",
        (None, None) => "",
    };
    let sites: Vec<String> = config
        .sites
        .iter()
        .map(|s| format!("{} → {} [{}]", s.domain, s.serve, s.protocols))
        .collect();
    tracing::info!(
        "webship {} listening on https://{} (tcp{}; workers {}; sites: {}; preflight: {})",
        env!("CARGO_PKG_VERSION"),
        bound.local,
        udp,
        config.workers,
        sites.join(", "),
        report.summary(),
    );
    if config
        .sites
        .iter()
        .any(|s| matches!(s.tls, TlsSource::SelfSigned { .. }))
    {
        tracing::warn!(
            "using a self-signed certificate generated at start; clients must skip verification (curl -k)"
        );
    }
}
