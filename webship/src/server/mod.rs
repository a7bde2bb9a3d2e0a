//! The supervisor: builds TLS and the service, binds, accepts within the connection
//! limit, and drains on shutdown.
//!
//! Every connection holds one permit of a semaphore sized `max_connections`; a full
//! server stops accepting (the kernel backlog absorbs the burst) instead of failing
//! new clients. Draining is waiting for every permit to come back.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpStream;
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};

use crate::config::{Config, TlsSource};
use crate::h3::{H3Context, H3Endpoint};
use crate::http::{self, ConnContext};
use crate::listener;
use crate::passthrough::udp::UdpRelay;
use crate::passthrough::{Decision, Passthrough};
use crate::preflight::Report;
use crate::service::Service;
use crate::tls::{self, Acceptor, Alpn};

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
    #[error(transparent)]
    H3(#[from] crate::h3::H3Error),
    #[error(transparent)]
    Proxy(#[from] crate::proxy::ProxyError),
    #[error("eBPF is required but could not be loaded: {0}")]
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

/// A cloneable view of the shutdown request.
#[derive(Debug, Clone)]
pub struct Shutdown {
    rx: watch::Receiver<bool>,
}

impl Shutdown {
    pub fn is_requested(&self) -> bool {
        *self.rx.borrow()
    }

    /// Completes once shutdown is requested (or the server is gone).
    pub async fn requested(&mut self) {
        let _ = self.rx.wait_for(|requested| *requested).await;
    }
}

/// Serves `config` until `signal` completes, then drains for up to
/// `limits.shutdown_grace`. Certificates are loaded before the port is bound, so a
/// bad certificate never leaves a half-started server.
pub async fn run(
    config: Config,
    report: Report,
    signal: impl Future<Output = ()>,
) -> Result<(), ServerError> {
    let acceptor = Arc::new(Acceptor::build(&config)?);
    let service = Arc::new(Service::new(&config)?);
    let programs = load_programs(&config, &report)?;
    let engine = crate::passthrough::resolve(config.passthrough_engine, programs.is_some());
    let passthrough = Passthrough::new(&config, engine, programs.clone()).map(Arc::new);
    if let Some(pt) = &passthrough {
        tracing::info!(engine = %pt.engine(), configured = %config.passthrough_engine, "passthrough engine");
    }
    let publisher = programs.clone().map(|p| tokio::spawn(publish_counters(p)));
    let listener = listener::bind(config.listen).map_err(|source| ServerError::Bind {
        addr: config.listen,
        source,
    })?;
    let local = listener.local_addr().unwrap_or(config.listen);
    let h3 = match acceptor.quic_config() {
        Some(tls) => Some(H3Endpoint::bind(local, tls, &config.h3, &config.limits)?),
        None => None,
    };
    // The kernel redirect goes in before the relay socket exists: a datagram the
    // relay took first would start that client's flow on the other path, and the
    // rest of the flow, redirected, would reach the origin from another address.
    if let Some(udp) = config.passthrough_udp {
        redirect_udp_in_kernel(&config, udp, local, programs.as_deref())?;
    }
    let udp_relay = match config.passthrough_udp {
        Some(udp) => Some(
            UdpRelay::bind(local, udp, config.limits.max_connections)
                .map_err(|source| ServerError::Bind { addr: local, source })?,
        ),
        None => None,
    };
    if let (Some(relay), Some(udp)) = (&udp_relay, config.passthrough_udp) {
        tracing::info!(
            udp = %relay.local_addr().unwrap_or(local),
            origin = %udp.upstream,
            "HTTP/3 passthrough: every datagram goes to the QUIC origin"
        );
    }
    let udp = match (&h3, &udp_relay) {
        (Some(_), _) => " + udp for h3",
        (None, Some(_)) => " + udp for h3 passthrough",
        (None, None) => "",
    };
    let relay_task = udp_relay.map(|relay| tokio::spawn(relay.run()));
    announce(&config, &report, local, udp);

    let (tx, rx) = watch::channel(false);
    let shutdown = Shutdown { rx };
    let limit = config.limits.max_connections;
    let permits = Arc::new(Semaphore::new(limit));
    let h3_task = h3.map(|endpoint| {
        let ctx = H3Context::new(&config, service.clone(), shutdown.clone());
        tokio::spawn(endpoint.serve(ctx, permits.clone(), limit))
    });
    let bbr = report.use_bbr();
    let ktls = report
        .use_ktls()
        .then(|| Arc::new(crate::ktls::Support::new(report.ktls_suites.clone())))
        .filter(|support| !support.is_empty());
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
        listener::configure(&tcp, bbr);
        let ctx = ConnContext {
            service: service.clone(),
            limits: config.limits,
            h2: config.h2,
            proxy_h2: config.proxy_h2,
            access_log: config.access_log,
            peer,
            tls_site: 0,
            shutdown: shutdown.clone(),
            ktls: ktls.clone(),
        };
        tokio::spawn(connection(
            tcp,
            acceptor.clone(),
            passthrough.clone(),
            ctx,
            permit,
        ));
    }
    drop(listener);
    let open = limit - permits.available_permits();
    tracing::info!(
        open,
        grace_secs = config.limits.shutdown_grace.as_secs(),
        "shutting down: draining connections"
    );
    let _ = tx.send(true);
    let all = u32::try_from(limit).unwrap_or(u32::MAX);
    match tokio::time::timeout(config.limits.shutdown_grace, permits.acquire_many(all)).await {
        Ok(_) => tracing::info!("all connections closed"),
        Err(_) => tracing::warn!(
            open = limit - permits.available_permits(),
            "grace period over: closing the remaining connections"
        ),
    }
    if let Some(task) = h3_task {
        task.abort();
    }
    if let Some(task) = publisher {
        task.abort();
    }
    if let Some(task) = relay_task {
        task.abort();
    }
    if passthrough.is_some() {
        let user = crate::passthrough::counters();
        let kernel = programs.as_ref().map(|p| p.kernel_counters());
        if let Some(p) = &programs {
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
    // The last reference: detaches the programs and removes the pinned maps.
    drop(passthrough);
    drop(programs);
    if ktls.is_some() {
        let c = crate::ktls::counters();
        tracing::info!(
            promotions = c.promotions,
            sendfile_bytes = c.sendfile_bytes,
            fallbacks = c.fallbacks,
            "ktls counters"
        );
    }
    Ok(())
}

/// Loads the eBPF programs when passthrough would use them and preflight found
/// eBPF usable. A `required` eBPF that fails to load stops startup; `auto` logs why
/// and carries on with a userspace engine.
fn load_programs(
    config: &Config,
    report: &Report,
) -> Result<Option<Arc<crate::ebpf::Programs>>, ServerError> {
    if config.passthrough.is_empty() || !report.use_ebpf() {
        return Ok(None);
    }
    match crate::ebpf::Programs::load(&config.kernel.bpf_pin_dir) {
        Ok(programs) => {
            tracing::info!(pins = %config.kernel.bpf_pin_dir.display(), "eBPF programs loaded; counters pinned for `webship stats`");
            Ok(Some(programs))
        }
        Err(e) if config.kernel.ebpf == crate::config::Policy::Required => Err(e.into()),
        Err(e) => {
            tracing::warn!(error = %e, "eBPF not used: passthrough runs a userspace engine");
            Ok(None)
        }
    }
}

/// Hands HTTP/3 passthrough to the kernel when the UDP engine asks for eBPF (or
/// `auto` finds it applicable and loaded). The userspace relay stays bound either
/// way: it owns the port and carries whatever the classifier lets through.
fn redirect_udp_in_kernel(
    config: &Config,
    udp: crate::config::UdpPassthrough,
    listen: SocketAddr,
    programs: Option<&crate::ebpf::Programs>,
) -> Result<(), ServerError> {
    use crate::config::UdpEngine;
    let applies = UdpEngine::ebpf_applies(listen, udp.upstream);
    let (Some(programs), SocketAddr::V4(listen), SocketAddr::V4(origin)) = (programs, listen, udp.upstream)
    else {
        if udp.engine == UdpEngine::Ebpf {
            return Err(crate::ebpf::EbpfError::Load(
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
        Err(e) if udp.engine == UdpEngine::Ebpf || config.kernel.ebpf == crate::config::Policy::Required => {
            Err(e.into())
        }
        Err(e) => {
            tracing::warn!(error = %e, "eBPF UDP redirect not used: HTTP/3 passthrough is relayed in userspace");
            Ok(())
        }
    }
}

/// Mirrors the daemon's passthrough counters into the pinned map twice a second.
async fn publish_counters(programs: Arc<crate::ebpf::Programs>) {
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(500));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        programs.publish(&crate::passthrough::counters());
    }
}

async fn connection(
    tcp: TcpStream,
    acceptor: Arc<Acceptor>,
    passthrough: Option<Arc<Passthrough>>,
    mut ctx: ConnContext,
    _permit: OwnedSemaphorePermit,
) {
    if let Some(pt) = &passthrough {
        match pt.decide(&tcp, ctx.limits.handshake_timeout).await {
            Decision::Forward(route) => return pt.forward(route, tcp, ctx.peer).await,
            Decision::Close(reason) => {
                return tracing::debug!(peer = %ctx.peer, reason, "passthrough: closed");
            }
            Decision::Terminate => {}
        }
    }
    if acceptor.is_empty() {
        return;
    }
    let accepted = match acceptor
        .accept(tcp, ctx.service.sites(), ctx.limits.handshake_timeout)
        .await
    {
        Ok(a) => a,
        Err(e) => {
            tracing::debug!(peer = %ctx.peer, error = %e, "handshake failed");
            return;
        }
    };
    ctx.tls_site = accepted.site;
    let peer = ctx.peer;
    let result = match accepted.alpn {
        Alpn::H1 if ctx.service.is_proxy(accepted.site) => http::h2::serve_h1(accepted.stream, ctx)
            .await
            .map_err(|e| e.to_string()),
        Alpn::H1 => http::h1::serve(accepted.stream, ctx)
            .await
            .map_err(|e| e.to_string()),
        Alpn::H2 => http::h2::serve(accepted.stream, ctx)
            .await
            .map_err(|e| e.to_string()),
    };
    if let Err(e) = result {
        tracing::debug!(%peer, error = %e, "connection ended with an error");
    }
}

fn announce(config: &Config, report: &Report, local: SocketAddr, udp: &str) {
    let sites: Vec<String> = config
        .sites
        .iter()
        .map(|s| format!("{} → {} [{}]", s.domain, s.serve, s.protocols))
        .collect();
    tracing::info!(
        "webship {} listening on https://{local} (tcp{}; workers {}; sites: {}; preflight: {})",
        env!("CARGO_PKG_VERSION"),
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
