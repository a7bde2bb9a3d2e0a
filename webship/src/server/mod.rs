//! The supervisor: builds TLS and the service, binds, accepts within the connection
//! limit, and drains on shutdown. [`run`] is those steps in order: [`Stack::build`]
//! (what `webship check` builds too), the passthrough [`Plan`], [`Bound::bind`], the
//! switch to the service account (`process.rs`), the accept loop, and the drain.
//! What serves new connections is one [`Generation`](generation::Generation), which
//! `SIGHUP` or `webship reload` replaces (`reload.rs`).
//!
//! Every connection holds one permit of a semaphore sized `max_connections`; a full
//! server stops accepting (the kernel backlog absorbs the burst) instead of failing
//! new clients. Draining is waiting for every permit to come back.

mod admin;
mod collect;
mod generation;
mod handover;
mod plan;
mod process;
mod reload;
mod systemd;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use std::os::fd::{AsFd, OwnedFd};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::{Config, TlsSource};
use crate::control::ControlListener;
use crate::exchange::access::{Sink, QUEUE_LINES};
use crate::h3::H3Endpoint;
use crate::metrics::{Close, Protocol, Tracked, Transport};
use crate::passthrough::Decision;
use crate::preflight::Report;
use crate::service::Service;
/// sd_notify: `ready()`, `reloading()`, `stopping()`, `status()`, `mainpid()`, the
/// watchdog (see the module).
pub use crate::sys::notify;
use crate::tls::{Acceptor, SiteNames};
pub use admin::AdminError;
use generation::{Current, Fixed, Generation};
pub use handover::HandoverError;
use plan::Plan;
pub use process::{keep_freed_heap_memory, raise_fd_limit, Privilege, ProcessError};
pub use reload::CheckError;

// The errors a server can fail with, nameable by the binary.
pub use crate::exchange::access::AccessLogError;
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
    AccessLog(#[from] AccessLogError),
    #[error(transparent)]
    Control(#[from] crate::control::ControlError),
    #[error(transparent)]
    Admin(#[from] AdminError),
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
    #[error(
        "the running webship hands over {sockets} UDP sockets of one SO_REUSEPORT group and this process would read {reads}; the old process keeps the others while it drains, and the kernel would send their share of new QUIC flows to sockets nobody reads (fix: {fix})"
    )]
    UnreadSockets {
        sockets: usize,
        reads: usize,
        fix: &'static str,
    },
}

/// `webship check FILE`: loads and builds the file as [`run`] and a reload do; the
/// error is the text both print.
pub fn check_file(path: &std::path::Path) -> Result<Config, CheckError> {
    let config = reload::load(path)?;
    reload::check(&config)?;
    Ok(config)
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
    // The ticket-key file is read here, as root; reloads and the watcher re-read it
    // as the service account.
    if let Some((uid, _)) = privilege.ids() {
        crate::tls::tickets::allow_owner(uid);
    }
    let tls = Arc::new(crate::tls::Shared::new(config.ticket_keys.as_deref())?);
    let mut stack = Stack::build(&config, &tls)?;
    // Nothing serves yet and the certificate tasks start later: the table is filled
    // now, so a failure below leaves no slot a task would act on.
    tls.certs.install(stack.acceptor.take_staged());
    let mut inherited = match (takeover, &config.control_socket) {
        (true, Some(path)) => Some(handover::take(path, config.listen, &config.kernel.bpf_pin_dir).await?),
        (true, None) => return Err(HandoverError::NoControlSocket.into()),
        (false, _) => None,
    };
    let pin_lock = inherited.as_mut().and_then(|i| i.pin_lock.take());
    let inheriting_pins = pin_lock.is_some();
    let inherited_udp = inherited
        .as_ref()
        .map_or(0, |i| usize::from(i.udp.is_some()) + i.udp_more.len());
    let plan = Plan::load(&config, &report, pin_lock, inherited_udp)?;
    // The predecessor's pins become this process's only when it loads eBPF into the
    // same folder; otherwise the predecessor removes them when it exits.
    let adopts_pins = inheriting_pins && plan.ebpf_loaded();
    let (trigger, shutdown) = crate::shutdown::channel();
    // Opened as root, so a log folder only root may write to works.
    let (access, access_writer) = Sink::open(config.access_log.path.as_deref(), QUEUE_LINES)?;
    let fixed = Fixed {
        access: access.clone(),
        shutdown: shutdown.clone(),
        ktls: report
            .use_ktls()
            .then(|| Arc::new(crate::ktls::Support::new(report.ktls_suites.clone())))
            .filter(|support| !support.is_empty()),
        engine: plan.engine(),
        programs: plan.programs(),
        tcp_health: plan.watch_tcp()?,
        metrics: crate::metrics::Registry::new(),
        transfers: Arc::default(),
        acme: crate::acme::Manager::new(tls.clone()),
        tls,
    };
    let metrics = fixed.metrics.clone();
    metrics.register(Box::new(collect::Passthrough::new(plan.programs())));
    let engine = plan.passthrough.is_some().then(|| plan.engine());
    collect::register_subsystems(&metrics, plan.programs(), engine);
    metrics.register(Box::new(collect::Received));
    metrics.register(Box::new(crate::acme::Metrics(fixed.acme.clone())));
    metrics.register(Box::new(collect::AccessLog::new(fixed.access.clone())));
    if let Some(programs) = &fixed.tcp_health {
        metrics.register(Box::new(collect::TcpHealth::new(programs.clone())));
    }
    metrics.register(Box::new(crate::tls::watch::Metrics));
    metrics.register(Box::new(crate::tls::ocsp::Metrics(fixed.tls.clone())));
    let first = Generation::new(1, config.clone(), stack, &fixed)?;
    metrics.set_generation(1);
    let bound = Bound::bind(&config, &first.stack, &plan, inherited.as_mut())?;
    if let Some(programs) = &fixed.tcp_health {
        programs.watch_port(bound.local.port());
    }
    let control = bind_control(&config, takeover)?;
    let admin = config
        .admin
        .as_ref()
        .map(admin::AdminListener::bind)
        .transpose()?;
    let signals = reload::Signals::watch();
    if let Some((uid, gid)) = privilege.ids() {
        if let Err(e) = access_writer.give_to(uid, gid) {
            tracing::warn!(error = %e, "cannot hand the access log file to the service account: a SIGUSR1 that reopens it without a rotation will fail");
        }
    }
    crate::tls::ocsp::prepare_cache(&fixed.tls, &config.ocsp_cache, privilege.ids());
    crate::acme::prepare_storage(&config, privilege.ids());
    // Port 80 needs root: bound before the switch, like the TLS port.
    let acme_http = config
        .acme_http_listen
        .map(|addr| crate::acme::http01::bind(addr).map_err(|source| ServerError::Bind { addr, source }))
        .transpose()?;
    drop_privileges(&config, &report, &plan, &privilege)?;
    drop(guard);
    // Started by switched threads: certificate files, the OCSP cache and the ACME
    // storage are read and written with the service account's rights, as a reload
    // reads them.
    let cert_tasks = [
        tokio::spawn(crate::tls::watch::run(fixed.tls.clone())),
        tokio::spawn(crate::tls::ocsp::run(
            fixed.tls.clone(),
            config.ocsp_cache.clone(),
        )),
        tokio::spawn(crate::acme::supervise(fixed.acme.clone(), shutdown.clone())),
    ];
    // Started by a switched thread: the writer runs as the service account.
    access_writer.start()?;
    announce(&config, &report, &bound);
    let admin_task = admin.map(|admin| {
        if let Some(addr) = admin.local_addr() {
            tracing::info!(%addr, "admin listener: /metrics, /healthz, /readyz");
        }
        tokio::spawn(admin.serve(metrics.clone()))
    });

    let tickets_task = tokio::spawn(fixed.tls.tickets.clone().watch(shutdown.clone()));
    let current = Arc::new(Current::new(first));
    let acme_http_task = acme_http.map(|listener| {
        let tokens = fixed.acme.http01_tokens();
        // Redirects follow reloads: the names are the current generation's.
        let sites = current.clone();
        let serves: crate::acme::http01::Serves =
            Arc::new(move |host: &str| sites.load().stack.service.sites().lookup(host).is_some());
        tokio::spawn(crate::acme::http01::serve(
            listener,
            tokens,
            bound.local.port(),
            serves,
            shutdown.clone(),
        ))
    });
    let limit = config.limits.max_connections;
    let permits = Arc::new(Semaphore::new(limit));
    let relay_task = plan.start_relay(bound.relay, shutdown);
    let h3_switch = bound.h3.as_ref().map(H3Endpoint::switch);
    let quic_handover = bound.h3.as_ref().map(|h3| h3.handover().clone());
    let h3_task = bound.h3.map(|endpoint| {
        let current = current.clone();
        tokio::spawn(endpoint.serve(move || current.load(), permits.clone(), limit))
    });
    let predecessor = Arc::new(AtomicBool::new(false));
    if let Some(inherited) = inherited {
        let (alive, quic) = (predecessor.clone(), quic_handover.clone());
        alive.store(true, Ordering::SeqCst);
        let gone = move || {
            alive.store(false, Ordering::SeqCst);
            if let Some(q) = quic {
                q.direct();
                let stats = q.forward_stats();
                tracing::info!(
                    forwarded = stats.forwarded,
                    dropped = stats.dropped,
                    "takeover: QUIC datagrams of the previous process's connections, handed to it"
                );
            }
        };
        // The listener already queues connections for this process; the old one
        // stops accepting once it reads this.
        // Serving beside a predecessor that did not hear would split the sockets'
        // traffic between two processes: stop instead (it serves as before).
        inherited.serving(adopts_pins, gone).await?;
        plan.adopt_pins();
    }

    let front = Front {
        current: current.clone(),
        bbr: report.use_bbr(),
    };
    metrics.set_ready(true);
    // READY=1 (systemd): bound, preflight passed, privileges dropped, serving.
    let mut reporter = systemd::Reporter::serving(current.clone(), metrics.clone());
    let control_file = control.as_ref().map(|c| reload::SocketFile::of(c.path()));
    let reloader = reload::Reloader {
        current: current.clone(),
        fixed,
        file: (config.source != crate::config::BUILTIN_SOURCE).then(|| config.source.clone().into()),
        h3: h3_switch,
        account: privilege.account().map(str::to_owned),
        started: std::time::Instant::now(),
        running: config,
    };
    let sockets = handover::Sockets {
        listen: reloader.running.listen,
        tcp: bound.tcp.as_fd(),
        h3: quic_handover.as_ref(),
        relay: bound.relay_fd.as_ref().map(AsFd::as_fd),
        programs: plan.programs(),
    };
    // The control socket, SIGHUP and `signal` are answered by one supervisor, the
    // accept loop's stop: SIGTERM or a takeover ends accepting.
    let supervisor = reload::supervise(reloader, control, signals, sockets, &predecessor, signal);
    let successor = front
        .accept_until(bound.listener, &permits, supervisor)
        .await
        .flatten();
    metrics.set_ready(false);
    if successor.is_some() {
        // The successor answers health checks and scrapes from now on.
        if let Some(task) = &admin_task {
            task.abort();
        }
    }
    // The copies kept for a successor go too: once the accept loop has dropped its
    // listener, nothing may hold the port open (the kernel would keep completing
    // handshakes nobody accepts).
    drop((bound.tcp, bound.relay_fd, quic_handover));

    match &successor {
        // The successor is the service now: it says READY, this one no longer speaks
        // for the service (no STOPPING=1, which would stop it).
        Some(successor) => reporter.hand_over(successor.pid()),
        None => reporter.draining(),
    }
    if let Some(file) = control_file.filter(|_| successor.is_none()) {
        file.remove();
    }
    if successor.as_ref().is_some_and(handover::Successor::adopted_pins) {
        plan.hand_over();
    }
    trigger.request();
    let last = current.load();
    drain(&permits, limit, last.config.limits.shutdown_grace).await;
    crate::proxy_protocol::accept::log_counters(&last.config.accept_proxy_protocol);
    for task in [
        h3_task,
        relay_task,
        admin_task,
        acme_http_task,
        Some(tickets_task),
    ]
    .into_iter()
    .flatten()
    .chain(cert_tasks)
    {
        task.abort();
    }
    drop(reporter);
    if let Some(successor) = successor {
        tracing::info!(successor = successor.pid(), "drained; the new process carries on");
        successor.farewell().await;
    }
    plan.finish();
    access.flush(ACCESS_FLUSH);
    if access.dropped() > 0 {
        tracing::warn!(
            dropped = access.dropped(),
            "access log lines dropped since start: the queue was full"
        );
    }
    Ok(())
}

/// How long the last access log lines may take to be written at exit.
const ACCESS_FLUSH: std::time::Duration = std::time::Duration::from_secs(2);

/// The control socket (`webship reload`, `webship serve --takeover`), in place of
/// the running daemon's when taking over. One the file names must be bound (a live
/// daemon on it is an error); the default one (`/run/webship/<port>.sock`) is best
/// effort: the daemon runs without it, and SIGHUP still reloads.
fn bind_control(config: &Config, takeover: bool) -> Result<Option<ControlListener>, ServerError> {
    let Some(path) = &config.control_socket else {
        return Ok(None);
    };
    let bound = match takeover {
        true => ControlListener::replace(path),
        false => ControlListener::bind(path),
    };
    match bound {
        Ok(listener) => Ok(Some(listener)),
        Err(e @ crate::control::ControlError::InUse(_)) => Err(e.into()),
        Err(e) if *path == crate::config::default_control_socket(config.listen.port()) => {
            tracing::warn!(error = %e, "no control socket: `webship reload` and `webship serve --takeover` cannot reach this daemon (SIGHUP still reloads)");
            Ok(None)
        }
        Err(e) => Err(e.into()),
    }
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
/// shutdown: the maps but the QUIC steering map become the account's, the folder
/// its group's (rwx). The folder
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
            // The steering map stays root's: the account could otherwise clear its
            // slots, and a successor's programs use it (`ebpf::stays_root`).
            if path.file_name().is_some_and(crate::ebpf::stays_root) {
                continue;
            }
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
#[derive(Debug)]
struct Stack {
    acceptor: Acceptor,
    service: Arc<Service>,
}

impl Stack {
    fn build(config: &Config, tls: &crate::tls::Shared) -> Result<Self, ServerError> {
        let sites = SiteNames::new(config);
        Ok(Self {
            acceptor: Acceptor::build(config, &sites, tls)?,
            service: Arc::new(Service::new(config, sites)?),
        })
    }
}

/// Refuses a takeover that would leave inherited UDP sockets unread: the old process
/// holds them (they stay in the port's `SO_REUSEPORT` group) until it exits, and
/// reads none of them once it has handed them over.
fn unread_sockets(inherited: Option<&handover::Inherited>, h3: bool, plan: &Plan) -> Result<(), ServerError> {
    let Some(i) = inherited else { return Ok(()) };
    let sockets = usize::from(i.udp.is_some()) + i.udp_more.len();
    let (reads, fix) = if h3 {
        (
            crate::h3::routing::MAX_SOCKETS,
            "the running webship is newer and serves more sockets than this one can; restart instead of taking over",
        )
    } else if plan.relays_udp() {
        (
            1,
            "serve HTTP/3 in this configuration, or restart instead of taking over",
        )
    } else {
        return Ok(());
    };
    if sockets <= reads {
        return Ok(());
    }
    Err(ServerError::UnreadSockets { sockets, reads, fix })
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
    /// Whether the kernel steers the HTTP/3 sockets' datagrams (SK_REUSEPORT).
    h3_steered: bool,
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
        unread_sockets(inherited.as_deref(), stack.acceptor.quic_config().is_some(), plan)?;
        let mut udp = inherited.as_mut().and_then(|i| i.udp.take());
        let h3 = match stack.acceptor.quic_config() {
            Some(tls) => {
                let more = inherited.as_mut().map(|i| std::mem::take(&mut i.udp_more));
                let sockets = udp.take().into_iter().chain(more.into_iter().flatten()).collect();
                Some(H3Endpoint::bind(
                    local,
                    sockets,
                    crate::h3::sockets_wanted(config.h3.sockets, config.workers),
                    tls,
                    &config.h3,
                    &config.limits,
                )?)
            }
            None => None,
        };
        let h3_steered = match &h3 {
            Some(h3) => plan.steer_quic(h3)?,
            None => false,
        };
        let predecessor = inherited.as_mut().and_then(|i| i.predecessor.take());
        match (&h3, predecessor) {
            (Some(h3), Some(pred)) => h3.handover().demux(pred),
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
            h3_steered,
        })
    }
}

/// The TCP front door: every accepted connection is passed through or terminated,
/// by the generation current when it was accepted.
struct Front {
    current: Arc<Current>,
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
            tokio::spawn(connection(tcp, peer, self.current.load(), permit));
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

/// One accepted connection, from the PROXY header to its end. Each stage is boxed:
/// a task is allocated at the size of its largest state, so without the boxes every
/// idle connection carried the largest of them all (13.4 KiB measured with heaptrack,
/// the biggest allocation of an idle HTTP/1.1 connection); boxed, a stage's memory
/// is held only while that stage runs, and only its own.
async fn connection(
    tcp: TcpStream,
    peer: SocketAddr,
    generation: Arc<Generation>,
    _permit: OwnedSemaphorePermit,
) {
    let (acceptor, drivers) = (&generation.stack.acceptor, &generation.drivers);
    let mut tracked = Tracked::accepted(drivers.metrics.connections(), Transport::Tcp);
    let handshake_timeout = drivers.limits.handshake_timeout;
    // Before anything else reads: a load balancer's PROXY header names the client.
    let listed = &drivers.accept_proxy_protocol;
    let Some(ends) = Box::pin(crate::proxy_protocol::accept::accept(
        &tcp,
        peer,
        listed,
        handshake_timeout,
    ))
    .await
    else {
        return tracked.close(Protocol::None, Close::ProxyHeader);
    };
    let peer = ends.client;
    if let Some(pt) = &generation.passthrough {
        match Box::pin(pt.decide(&tcp, handshake_timeout)).await {
            Decision::Forward(route) => {
                if let Some(slots) = &generation.tcp {
                    slots.tag_route(tcp.as_fd(), route);
                }
                // Its ends are counted by reason in the passthrough counters.
                tracked.close(Protocol::Passthrough, Close::Closed);
                return Box::pin(pt.forward(route, tcp, ends)).await;
            }
            Decision::Close(reason) => {
                tracked.close(Protocol::None, Close::NoRoute);
                return tracing::debug!(%peer, reason, "passthrough: closed");
            }
            Decision::Terminate => {}
        }
    }
    if acceptor.is_empty() {
        return tracked.close(Protocol::None, Close::NoRoute);
    }
    let accepted = match Box::pin(acceptor.accept(tcp, handshake_timeout)).await {
        Ok(a) => a,
        Err(crate::tls::AcceptError::AcmeChallenge) => {
            tracked.close(Protocol::None, Close::Closed);
            tracing::debug!(%peer, "acme: tls-alpn-01 challenge answered");
            return;
        }
        Err(e) => {
            let reason = match e {
                crate::tls::AcceptError::Timeout => Close::HandshakeTimeout,
                crate::tls::AcceptError::Io(_) | crate::tls::AcceptError::AcmeChallenge => {
                    Close::HandshakeFailed
                }
            };
            tracked.close(Protocol::None, reason);
            tracing::debug!(%peer, error = %e, "handshake failed");
            return;
        }
    };
    if let Some(slots) = &generation.tcp {
        slots.tag_site(accepted.stream.get_ref().0.get_ref().as_fd(), accepted.site);
    }
    let protocol = match accepted.alpn {
        crate::tls::Alpn::H1 => Protocol::H1,
        crate::tls::Alpn::H2 => Protocol::H2,
    };
    // Counted as closed in order unless the driver says otherwise (a task dropped at
    // the end of the drain too).
    tracked.close(protocol, Close::Closed);
    let tls = accepted.tls_info();
    let ctx = drivers.connection(peer, accepted.site, tls);
    if let Err(e) = crate::http::serve(accepted, ctx).await {
        tracked.close(protocol, e.close());
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
    if let Some(h3) = bound.h3.as_ref().filter(|h3| h3.sockets() > 1) {
        tracing::info!(
            sockets = h3.sockets(),
            steering = if bound.h3_steered { "ebpf" } else { "userspace" },
            "h3: one quinn endpoint per UDP socket (SO_REUSEPORT group); each datagram goes to \
             the socket its connection ID names: steered by the kernel's SK_REUSEPORT program \
             (steering ebpf), or handed over in-process when the kernel's 4-tuple hash picked \
             another socket (steering userspace)"
        );
    }
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
