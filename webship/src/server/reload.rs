//! Reload: `SIGHUP` or a `Reload` on the control socket re-reads the configuration
//! file, builds a new [`Generation`] the way `webship check` builds one (same code,
//! same error text) and makes it current; connections in flight keep theirs.
//!
//! Settings that cannot change while running (the sockets, the runtime's threads,
//! the account, the kernel programs, the connection cap the open-file limit was sized
//! for) are compared with the running ones: a change is named in the log and in the
//! reply, the running value is kept, and the rest of the reload applies. A
//! configuration that fails to load or build is refused and the current generation
//! keeps serving. Reloads run one at a time in the supervisor task ([`supervise`]);
//! signals that arrive during one are merged into one more.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use super::generation::{Current, Fixed, Generation};
use super::{handover, process, ServerError, Stack};
use crate::config::{self, Config, UdpPassthrough};
use crate::control::{ControlListener, Incoming, Reply, Request};
use crate::exchange::access::Sink;
use crate::h3::H3Switch;

/// A configuration refused, in the words `webship check` prints (after `webship: `).
#[derive(Debug)]
pub struct CheckError(String);

impl std::fmt::Display for CheckError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CheckError {}

/// An error and its causes on one line, as `anyhow`'s `{:#}` writes them.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(e) = cause {
        text.push_str(": ");
        text.push_str(&e.to_string());
        cause = e.source();
    }
    text
}

/// Reads and validates `path` (`webship check`'s first half).
pub(super) fn load(path: &Path) -> Result<Config, CheckError> {
    config::load(path).map_err(|e| CheckError(chain(&e)))
}

/// Builds what `config` serves with: the account looked up, certificates and keys
/// read, upstream TLS, the service (`webship check`'s second half).
pub(super) fn build(config: &Config, tls: &crate::tls::Shared) -> Result<Stack, CheckError> {
    account(config)?;
    Stack::build(config, tls).map_err(|e| refused(config, &e))
}

/// [`build`] with TLS state of its own (`webship check`: nothing is served).
pub(super) fn check(config: &Config) -> Result<Stack, CheckError> {
    let tls = crate::tls::Shared::new(config.ticket_keys.as_deref())
        .map_err(|e| CheckError(format!("{}: {e}", config.source)))?;
    build(config, &tls)
}

/// Looks up the service account the file names (whether or not it is the running one).
fn account(config: &Config) -> Result<(), CheckError> {
    process::resolve(config).map_err(|e| refused(config, &ServerError::from(e)))?;
    Ok(())
}

fn refused(config: &Config, e: &ServerError) -> CheckError {
    CheckError(format!("{}: {}", config.source, chain(e)))
}

/// The control socket's file, removed at shutdown only while it is still this
/// daemon's: a process that took over binds its own in its place.
#[derive(Debug)]
pub(super) struct SocketFile {
    path: PathBuf,
    inode: Option<(u64, u64)>,
}

impl SocketFile {
    pub(super) fn of(path: &Path) -> Self {
        Self {
            path: path.to_owned(),
            inode: inode(path),
        }
    }

    pub(super) fn remove(self) {
        if self.inode.is_some() && inode(&self.path) == self.inode {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

fn inode(path: &Path) -> Option<(u64, u64)> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        std::fs::symlink_metadata(path).ok().map(|m| (m.dev(), m.ino()))
    }
    #[cfg(not(unix))]
    {
        let _ = path;
        None
    }
}

/// What the reload needs besides the current generation.
#[derive(Debug)]
pub(super) struct Reloader {
    pub(super) current: Arc<Current>,
    pub(super) fixed: Fixed,
    /// The configuration the daemon started with: what restart-only settings are.
    pub(super) running: Config,
    /// The file a reload reads; `None` for the built-in configuration.
    pub(super) file: Option<PathBuf>,
    /// The HTTP/3 endpoint, when one is bound.
    pub(super) h3: Option<H3Switch>,
    /// The service account the daemon switched to, if it did.
    pub(super) account: Option<String>,
    pub(super) started: Instant,
}

impl Reloader {
    /// Re-reads `path` (or the daemon's file), and makes it current if it builds.
    /// The one place a reload happens; the service manager hears `RELOADING=1`
    /// before and `READY=1` after, whatever the outcome.
    pub(super) async fn reload(&mut self, path: Option<PathBuf>) -> Reply {
        super::notify::reloading();
        let reply = self.reload_now(path).await;
        super::notify::ready();
        reply
    }

    async fn reload_now(&mut self, path: Option<PathBuf>) -> Reply {
        let Some(path) = path.or_else(|| self.file.clone()) else {
            return Reply::refused(
                "this daemon runs on the built-in configuration: there is no file to re-read \
                 (fix: restart it with --config FILE, or reload with --config FILE)",
            );
        };
        let begun = Instant::now();
        let current = self.current.load().number;
        tracing::info!(file = %path.display(), "reloading the configuration");
        let running = self.running.clone();
        let h3_bound = self.h3.is_some();
        let file = path.clone();
        let tls = self.fixed.tls.clone();
        // Reading files and building TLS configurations blocks: off the reactors.
        let prepared = tokio::task::spawn_blocking(move || {
            let mut config = load(&file)?;
            account(&config)?;
            let notes = keep_running(&mut config, &running, h3_bound);
            let stack = build(&config, &tls)?;
            let tickets = tls
                .tickets
                .prepare(config.ticket_keys.as_deref())
                .map_err(|e| CheckError(format!("{}: {e}", config.source)))?;
            Ok::<_, CheckError>((config, stack, notes, tickets))
        })
        .await;
        let built = match prepared {
            Ok(Ok(built)) => Ok(built),
            Ok(Err(refused)) => Err(refused.0),
            Err(e) => Err(format!("the reload task failed: {e}")),
        };
        let (config, mut stack, notes, tickets) = match built {
            Ok(built) => built,
            Err(text) => return self.refuse(text, current),
        };
        let number = current + 1;
        // Held back until the generation is current: a refusal below must leave the
        // served certificates, their staples and the slot table as they are.
        let certs = stack.acceptor.take_staged();
        let generation = match Generation::new(number, config, stack, &self.fixed) {
            Ok(g) => g,
            Err(e) => return self.refuse(format!("{}: {}", path.display(), chain(&e)), current),
        };
        if self.account.is_some() {
            process::check_roots(&generation.config);
        }
        let quic = generation.quic.clone();
        let sites = generation.config.sites.len();
        self.current.swap(generation);
        self.fixed.tls.tickets.install(tickets);
        // Open connections keep the keys they shook hands with; the table forgets the
        // slots no site serves from any more.
        self.fixed.tls.certs.install(certs);
        self.fixed.metrics.set_generation(number);
        self.fixed.metrics.reloaded(true);
        if let Some(h3) = &self.h3 {
            h3.set(quic.as_ref());
        }
        self.file = Some(path.clone());
        let took = begun.elapsed().as_millis();
        for note in &notes {
            tracing::warn!("reload: {note}");
        }
        tracing::info!(generation = number, file = %path.display(), sites, took_ms = took, "configuration reloaded");
        Reply {
            ok: true,
            message: format!(
                "{}: reloaded (generation {number}, {sites} site(s), {took} ms); new connections use it, \
                 open ones finish on the one they started with",
                path.display()
            ),
            notes,
            transfers: None,
            certs: None,
        }
    }

    fn refuse(&self, text: String, current: u64) -> Reply {
        self.fixed.metrics.reloaded(false);
        let mut reply = Reply::refused(text);
        if let Some(account) = self
            .account
            .as_deref()
            .filter(|_| mentions_unreadable(&reply.message))
        {
            // The group it runs with: the configured one, else its primary group,
            // which the account's own name usually names.
            let group = self.running.group.as_deref().unwrap_or(account);
            reply.notes.push(format!(
                "the daemon runs as `{account}` since it started and reads files with that account's \
                 rights: make the configuration, certificates and keys readable by its group (e.g. `chgrp {group} KEY; chmod 0640 KEY`), \
                 or restart the daemon to read them as root"
            ));
        }
        tracing::warn!(
            generation = current,
            "reload refused, the running configuration keeps serving: {}",
            reply.message
        );
        for note in &reply.notes {
            tracing::warn!("reload: {note}");
        }
        reply
    }

    /// `Status`: who is running and on what.
    pub(super) fn status(&self) -> Reply {
        let generation = self.current.load();
        let file = self
            .file
            .as_deref()
            .map_or_else(|| config::BUILTIN_SOURCE.to_owned(), |p| p.display().to_string());
        Reply::ok(format!(
            "webship {} pid {} config {file} generation {} up {} s",
            env!("CARGO_PKG_VERSION"),
            std::process::id(),
            generation.number,
            self.started.elapsed().as_secs(),
        ))
    }
}

/// Whether a refusal is about a file the process may not read.
fn mentions_unreadable(text: &str) -> bool {
    text.contains("Permission denied") || text.contains("permission denied")
}

/// Puts the running value back into `new` for every setting that needs a restart,
/// and says which ones the file changed.
fn keep_running(new: &mut Config, running: &Config, h3_bound: bool) -> Vec<String> {
    let mut notes = Vec::new();
    let n = &mut notes;
    let shown = |v: &dyn std::fmt::Display| v.to_string();
    let or_none = |v: Option<String>| v.unwrap_or_else(|| "(none)".into());
    let path = |v: &Option<PathBuf>| or_none(v.as_ref().map(|p| p.display().to_string()));
    kept(
        n,
        "listen",
        "listening on",
        &mut new.listen,
        &running.listen,
        |v| shown(v),
    );
    kept(n, "workers", "running", &mut new.workers, &running.workers, |v| {
        shown(v)
    });
    kept(
        n,
        "acme.http_listen",
        "answering http-01 on",
        &mut new.acme_http_listen,
        &running.acme_http_listen,
        |v| or_none(v.map(|a| a.to_string())),
    );
    kept(n, "user", "running as", &mut new.user, &running.user, |v| {
        or_none(v.clone())
    });
    kept(
        n,
        "group",
        "running with group",
        &mut new.group,
        &running.group,
        |v| or_none(v.clone()),
    );
    kept(
        n,
        "control_socket",
        "answering on",
        &mut new.control_socket,
        &running.control_socket,
        path,
    );
    kept(
        n,
        "[admin]",
        "serving",
        &mut new.admin,
        &running.admin,
        |v| match v {
            Some(a) => format!(
                "{}{}",
                a.listen,
                if a.token_file.is_some() {
                    " with a token"
                } else {
                    ""
                }
            ),
            None => "(none)".into(),
        },
    );
    // The OCSP tasks run from start with one cache folder.
    kept(
        n,
        "ocsp_cache",
        "caching OCSP answers in",
        &mut new.ocsp_cache,
        &running.ocsp_cache,
        |v| v.display().to_string(),
    );
    let (kernel, was) = (&mut new.kernel, &running.kernel);
    kept(n, "[kernel] ktls", "using", &mut kernel.ktls, &was.ktls, |v| {
        shown(v)
    });
    kept(n, "[kernel] bbr", "using", &mut kernel.bbr, &was.bbr, |v| {
        shown(v)
    });
    kept(n, "[kernel] ebpf", "using", &mut kernel.ebpf, &was.ebpf, |v| {
        shown(v)
    });
    kept(
        n,
        "[kernel] tcp_health",
        "using",
        &mut kernel.tcp_health,
        &was.tcp_health,
        |v| shown(v),
    );
    kept(
        n,
        "[kernel] bpf_pin_dir",
        "pinning under",
        &mut kernel.bpf_pin_dir,
        &was.bpf_pin_dir,
        |v| v.display().to_string(),
    );
    // The file is opened once, as root, at start (SIGUSR1 reopens the same path).
    let log_path = |v: &Option<PathBuf>| {
        v.as_ref()
            .map_or_else(|| "standard error".into(), |p| p.display().to_string())
    };
    kept(
        n,
        "[log] access_path",
        "writing the access log to",
        &mut new.access_log.path,
        &running.access_log.path,
        log_path,
    );
    let engine = (&mut new.passthrough_engine, &running.passthrough_engine);
    kept(
        n,
        "[reverse_proxy] passthrough_engine",
        "using",
        engine.0,
        engine.1,
        |v| shown(v),
    );
    let udp_key = "the HTTP/3 passthrough ([reverse_proxy] udp_*)";
    kept(
        n,
        udp_key,
        "relaying to",
        &mut new.passthrough_udp,
        &running.passthrough_udp,
        udp,
    );
    // A default cap may have been lowered to fit the open-file limit: only a
    // configured one is compared.
    let cap = |c: &Config| {
        c.limits
            .max_connections_configured
            .then_some(c.limits.max_connections)
    };
    let (mut new_cap, running_cap) = (cap(new), cap(running));
    let show_cap = |v: &Option<usize>| or_none(v.map(|c| c.to_string()));
    kept(
        n,
        "[limits] max_connections",
        "at most",
        &mut new_cap,
        &running_cap,
        show_cap,
    );
    new.limits.max_connections = running.limits.max_connections;
    new.limits.max_connections_configured = running.limits.max_connections_configured;
    if !h3_bound {
        for site in new.sites.iter_mut().filter(|s| s.protocols.h3) {
            notes.push(format!(
                "site {}: h3 turned on, but no UDP socket is bound for HTTP/3: needs a restart; \
                 still served over TCP only",
                site.domain
            ));
            site.protocols.h3 = false;
        }
    }
    notes
}

/// One restart-only setting: a change is noted and the running value put back.
fn kept<T: PartialEq + Clone>(
    notes: &mut Vec<String>,
    key: &str,
    what: &str,
    new: &mut T,
    running: &T,
    show: impl Fn(&T) -> String,
) {
    if new != running {
        let (from, to) = (show(running), show(new));
        notes.push(format!(
            "{key} changed from {from} to {to}: needs a restart; still {what} {from}"
        ));
        *new = running.clone();
    }
}

fn udp(v: &Option<UdpPassthrough>) -> String {
    match v {
        Some(u) => format!("{} ({} engine)", u.upstream, u.engine),
        None => "(none)".into(),
    }
}

/// The supervisor's side of the control socket and of `SIGHUP`: one request or
/// signal at a time, so reloads never overlap. Returns `None` once `stop` (SIGTERM)
/// completes, or the successor once a new process has taken the sockets over
/// (`webship serve --takeover`). A request under way is finished before `stop` is
/// looked at: a handover cut short would leave the new process holding sockets it
/// may not serve on while this one drains (each request is bounded by its own
/// timeouts). `predecessor` is set while the process this one took over from still
/// drains: a second takeover then waits.
pub(super) async fn supervise(
    mut reloader: Reloader,
    control: Option<ControlListener>,
    mut signals: Signals,
    sockets: handover::Sockets<'_>,
    predecessor: &AtomicBool,
    stop: impl std::future::Future<Output = ()>,
) -> Option<handover::Successor> {
    let mut requests = control.map(ControlListener::serve);
    tokio::pin!(stop);
    loop {
        tokio::select! {
            () = &mut stop => return None,
            Some(incoming) = next(&mut requests) => {
                if let Some(successor) = answer(incoming, &mut reloader, &sockets, predecessor).await {
                    return Some(successor);
                }
            }
            Some(()) = next_signal(&mut signals.hangup) => {
                tracing::info!("SIGHUP: reloading");
                reloader.reload(None).await;
            }
            Some(()) = next_signal(&mut signals.reopen) => {
                reopen_access_log(reloader.fixed.access.clone()).await;
            }
        }
    }
}

/// How long `webship certs --renew` waits for the order's outcome (an order is
/// bounded by the ACME manager's own timeout, 180 s).
const CERTS_RENEW_WAIT: std::time::Duration = std::time::Duration::from_secs(200);

/// Answers one control request; a takeover that succeeded returns the successor.
async fn answer(
    incoming: Incoming,
    reloader: &mut Reloader,
    sockets: &handover::Sockets<'_>,
    predecessor: &AtomicBool,
) -> Option<handover::Successor> {
    let reply = match &incoming.request {
        Request::Reload { config } => reloader.reload(config.clone()).await,
        Request::Status => reloader.status(),
        // Read-only answers are made and sent by a task of their own: rendering a
        // busy registry takes milliseconds, and a client that does not read its reply
        // must not hold signals, reloads and takeovers for the reply timeout.
        Request::Metrics => {
            let metrics = reloader.fixed.metrics.clone();
            tokio::spawn(async move {
                let reply = Reply::ok(metrics.render(crate::metrics::Format::Prometheus));
                incoming.reply(&reply).await;
            });
            return None;
        }
        Request::Transfers => {
            let (listed, unlisted) = reloader.fixed.transfers.list();
            let mut reply = Reply::ok(format!("{} large response(s) in flight", listed.len()));
            reply.transfers = Some(crate::control::TransferList { listed, unlisted });
            reply
        }
        Request::Certs { renew } => {
            let acme = reloader.fixed.acme.clone();
            let wait = match renew {
                Some(site) => match acme.force(site) {
                    Some(rx) => Some((site.clone(), rx)),
                    None => {
                        let reply = Reply::refused(format!("no ACME site `{site}` (see `webship certs`)"));
                        tokio::spawn(async move { incoming.reply(&reply).await });
                        return None;
                    }
                },
                None => None,
            };
            // Its own task: an order takes seconds, and signals, reloads and takeovers
            // must not wait for it.
            tokio::spawn(async move {
                let mut reply = match wait {
                    None => Reply::ok("ACME certificates"),
                    Some((site, rx)) => match tokio::time::timeout(CERTS_RENEW_WAIT, rx).await {
                        Ok(Ok(Ok(serial))) => Reply::ok(format!("{site}: renewed, serial {serial}")),
                        Ok(Ok(Err(e))) => Reply::refused(format!("{site}: renewal failed: {e}")),
                        _ => Reply::refused(format!(
                            "{site}: the renewal is still running; see `webship certs`"
                        )),
                    },
                };
                reply.certs = Some(acme.list());
                incoming.reply(&reply).await;
            });
            return None;
        }
        Request::Takeover if predecessor.load(Ordering::SeqCst) => {
            let reason = "the process this one took over from is still draining; try again once it exits";
            handover::refuse(incoming, reason).await;
            return None;
        }
        Request::Takeover => {
            // Not ready while the sockets are handed over: a balancer should send new
            // work elsewhere until it is clear which process serves.
            reloader.fixed.metrics.set_ready(false);
            let successor = handover::give(incoming, sockets.clone()).await;
            reloader.fixed.metrics.set_ready(successor.is_none());
            return successor;
        }
    };
    tokio::spawn(async move { incoming.reply(&reply).await });
    None
}

async fn next(requests: &mut Option<tokio::sync::mpsc::Receiver<Incoming>>) -> Option<Incoming> {
    match requests {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

#[cfg(unix)]
type Watched = Option<tokio::signal::unix::Signal>;
#[cfg(not(unix))]
type Watched = Option<()>;

/// The signals the supervisor answers besides SIGTERM: SIGHUP reloads, SIGUSR1
/// reopens the access log. Registered before the daemon announces itself (from
/// then on neither ends the process).
pub(super) struct Signals {
    hangup: Watched,
    reopen: Watched,
}

impl Signals {
    pub(super) fn watch() -> Self {
        Self {
            hangup: watch_signal(
                #[cfg(unix)]
                tokio::signal::unix::SignalKind::hangup(),
                "cannot watch SIGHUP: reload through `webship reload` only",
            ),
            reopen: watch_signal(
                #[cfg(unix)]
                tokio::signal::unix::SignalKind::user_defined1(),
                "cannot watch SIGUSR1: the access log cannot be reopened (rotate with copytruncate)",
            ),
        }
    }
}

#[cfg(unix)]
fn watch_signal(kind: tokio::signal::unix::SignalKind, failed: &'static str) -> Watched {
    match tokio::signal::unix::signal(kind) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "{failed}");
            None
        }
    }
}

#[cfg(not(unix))]
fn watch_signal(failed: &'static str) -> Watched {
    let _ = failed;
    None
}

async fn next_signal(watched: &mut Watched) -> Option<()> {
    #[cfg(unix)]
    if let Some(s) = watched {
        return s.recv().await;
    }
    let _ = watched;
    std::future::pending().await
}

/// SIGUSR1: opens the access log's path again (logrotate moved the file and
/// signalled); a failure keeps the old file.
async fn reopen_access_log(sink: Arc<Sink>) {
    let reopened = tokio::task::spawn_blocking(move || sink.reopen().map(|p| p.map(Path::to_owned))).await;
    match reopened {
        Ok(Ok(Some(path))) => tracing::info!(path = %path.display(), "SIGUSR1: access log reopened"),
        Ok(Ok(None)) => tracing::info!("SIGUSR1: the access log goes to standard error, nothing to reopen"),
        Ok(Err(e)) => tracing::warn!("access log not reopened, still writing to the previous file: {e}"),
        Err(e) => tracing::warn!("access log not reopened, still writing to the previous file: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn running() -> Config {
        config::builtin_default(Path::new("/")).unwrap()
    }

    #[test]
    fn restart_only_changes_are_named_and_kept() {
        let running = running();
        let mut same = running.clone();
        assert!(keep_running(&mut same, &running, true).is_empty());

        let mut new = running.clone();
        new.listen.set_port(9443);
        new.workers = running.workers + 1;
        new.access_log.enabled = !running.access_log.enabled;
        let notes = keep_running(&mut new, &running, true);
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert_eq!(
            notes[0],
            "listen changed from 127.0.0.1:8443 to 127.0.0.1:9443: needs a restart; still listening on 127.0.0.1:8443"
        );
        assert_eq!(new.listen, running.listen);
        assert_eq!(new.workers, running.workers);
        assert_ne!(
            new.access_log.enabled, running.access_log.enabled,
            "what reloads is left alone"
        );
    }

    #[test]
    fn h3_without_a_udp_socket_stays_off() {
        let running = running();
        let mut new = running.clone();
        assert!(new.sites[0].protocols.h3);
        let notes = keep_running(&mut new, &running, false);
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(!new.sites[0].protocols.h3);
    }

    #[test]
    fn the_error_chain_reads_like_check() {
        let e = config::load(Path::new("/nonexistent/webship.toml")).unwrap_err();
        let text = chain(&e);
        assert!(
            text.starts_with("/nonexistent/webship.toml: cannot read the configuration: "),
            "{text}"
        );
    }
}
