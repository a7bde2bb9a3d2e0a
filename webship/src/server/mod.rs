//! The supervisor: builds TLS and the service, binds, accepts within the connection
//! limit, and drains on shutdown. [`run`] is those steps in order: [`Stack::build`]
//! (what `webship check` builds too), the passthrough [`Plan`], [`Bound::bind`], the
//! switch to the service account (`process.rs`), the accept loop, and the drain.
//!
//! Every connection holds one permit of a semaphore sized `max_connections`; a full
//! server stops accepting (the kernel backlog absorbs the burst) instead of failing
//! new clients. Draining is waiting for every permit to come back.

mod plan;
mod process;
mod systemd;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::{Config, TlsSource};
use crate::exchange::Drivers;
use crate::h3::H3Endpoint;
use crate::passthrough::{Decision, Passthrough};
use crate::preflight::Report;
use crate::service::Service;
/// sd_notify: `ready()`, `reloading()`, `stopping()`, `status()`, `mainpid()`, the
/// watchdog (see the module).
pub use crate::sys::notify;
use crate::tls::{Acceptor, SiteNames};
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
pub async fn run(
    config: Config,
    report: Report,
    privilege: Privilege,
    signal: impl Future<Output = ()>,
) -> Result<(), ServerError> {
    // The runtime's threads wait for the switch; whatever fails first releases them.
    let guard = privilege.guard();
    let stack = Stack::build(&config)?;
    let plan = Plan::load(&config, &report)?;
    let bound = Bound::bind(&config, &stack, &plan)?;
    drop_privileges(&config, &report, &plan, &privilege)?;
    drop(guard);
    announce(&config, &report, &bound);

    let (trigger, shutdown) = crate::shutdown::channel();
    let ktls = report
        .use_ktls()
        .then(|| Arc::new(crate::ktls::Support::new(report.ktls_suites.clone())))
        .filter(|support| !support.is_empty());
    let drivers = Arc::new(Drivers::new(&config, stack.service.clone(), shutdown, ktls));
    let limit = config.limits.max_connections;
    let permits = Arc::new(Semaphore::new(limit));
    let h3_task = bound
        .h3
        .map(|endpoint| tokio::spawn(endpoint.serve(drivers.clone(), permits.clone(), limit)));
    let relay_task = plan.start_relay(bound.relay);

    let front = Front {
        acceptor: Arc::new(stack.acceptor),
        passthrough: plan.passthrough.clone(),
        drivers,
        bbr: report.use_bbr(),
    };
    // READY=1 (systemd): bound, preflight passed, privileges dropped, serving.
    let reporter = systemd::Reporter::serving(&config, permits.clone(), limit);
    front.accept_until(bound.listener, &permits, signal).await;

    reporter.draining();
    trigger.request();
    drain(&permits, limit, config.limits.shutdown_grace).await;
    crate::proxy_protocol::accept::log_counters(&config.accept_proxy_protocol);
    for task in [h3_task, relay_task].into_iter().flatten() {
        task.abort();
    }
    drop(reporter);
    plan.finish();
    Ok(())
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

/// Hands what is pinned to the service account, so that it can remove the maps at
/// shutdown: the maps become the account's, the folder its group's (rwx). The folder
/// itself stays root's: had the account owned it, root would need CAP_DAC_OVERRIDE
/// (which the systemd unit does not grant) to pin in it at the next start. Links
/// are not followed: the account may have planted one naming any file of root's.
fn give_pins(dir: &std::path::Path, uid: u32, gid: u32) {
    #[cfg(unix)]
    {
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        let warn = |path: &std::path::Path, e: std::io::Error| {
            tracing::warn!(path = %path.display(), error = %e, "cannot hand a pinned map to the service account; it stays after shutdown");
        };
        let folder = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
            .open(dir)
            .and_then(|folder| {
                std::os::unix::fs::fchown(&folder, Some(0), Some(gid))?;
                folder.set_permissions(std::fs::Permissions::from_mode(0o770))
            });
        if let Err(e) = folder {
            warn(dir, e);
        }
        let entries = std::fs::read_dir(dir).into_iter().flatten().flatten();
        for path in entries.map(|e| e.path()) {
            if let Err(e) = std::os::unix::fs::lchown(&path, Some(uid), Some(gid)) {
                warn(&path, e);
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
    local: SocketAddr,
    h3: Option<H3Endpoint>,
    relay: Option<crate::passthrough::udp::UdpRelay>,
}

impl Bound {
    fn bind(config: &Config, stack: &Stack, plan: &Plan) -> Result<Self, ServerError> {
        let listener = crate::listener::bind(config.listen).map_err(|source| ServerError::Bind {
            addr: config.listen,
            source,
        })?;
        let local = listener.local_addr().unwrap_or(config.listen);
        let h3 = match stack.acceptor.quic_config() {
            Some(tls) => Some(H3Endpoint::bind(local, tls, &config.h3, &config.limits)?),
            None => None,
        };
        let relay = plan.bind_udp(config, local)?;
        Ok(Self {
            listener,
            local,
            h3,
            relay,
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
    /// Accepts connections, each holding a permit, until `signal` completes.
    async fn accept_until(
        &self,
        listener: TcpListener,
        permits: &Arc<Semaphore>,
        signal: impl Future<Output = ()>,
    ) {
        tokio::pin!(signal);
        loop {
            let permit = tokio::select! {
                p = permits.clone().acquire_owned() => match p {
                    Ok(p) => p,
                    Err(_) => break,
                },
                () = &mut signal => break,
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
                () = &mut signal => break,
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
    // Before anything else reads: a load balancer's PROXY header names the client.
    let listed = &drivers.accept_proxy_protocol;
    let Some(ends) = crate::proxy_protocol::accept::accept(&tcp, peer, listed, handshake_timeout).await
    else {
        return;
    };
    let peer = ends.client;
    if let Some(pt) = &passthrough {
        match pt.decide(&tcp, handshake_timeout).await {
            Decision::Forward(route) => return pt.forward(route, tcp, ends).await,
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
