//! What the daemon asks of the host before it serves: enough file descriptors for
//! `max_connections`, a heap that keeps the memory it reuses (`sys::heap`), and
//! giving up root once everything that needs it is done.
//!
//! The switch to the service account happens on every thread of the runtime. The
//! runtime's threads start while the daemon is still root and wait in
//! [`Privilege::thread_start`] (tokio's `on_thread_start`) until the main thread has
//! read the certificates, loaded eBPF and bound the sockets; then the main thread
//! switches itself, opens the gate, and every waiting thread switches itself too
//! (`sys::privilege` says why each thread must). Nothing is accepted before the last
//! of them has. So the setup before the switch must never wait on the runtime's
//! threads (no `spawn_blocking` awaited, no I/O awaited): they are not running yet.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::config::{Config, Engine, Serve};
use crate::sys::privilege::{self, Account, Caps, PrivilegeError};

/// Descriptors a process needs beyond its connections: listeners, the epoll and
/// event fds of the runtime, eBPF programs and maps, the QUIC socket, logs, and the
/// files the blocking pool has open at a time.
const RESERVED_FDS: u64 = 256;

/// Why the process cannot run as configured.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error(
        "limits.max_connections = {max_connections} needs {needed} open files ({per_connection} per connection + {RESERVED_FDS}), \
         but the hard limit (RLIMIT_NOFILE) is {hard} (fix: raise it — `LimitNOFILE={needed}` in the systemd unit, \
         `ulimit -Hn {needed}` in the shell that starts webship — or lower limits.max_connections to {fits})"
    )]
    TooFewFiles {
        max_connections: usize,
        per_connection: u64,
        needed: u64,
        hard: u64,
        fits: u64,
    },
    #[error("cannot read or raise the open-file limit: {0}")]
    Rlimit(#[source] std::io::Error),
    #[error(transparent)]
    Privilege(#[from] PrivilegeError),
    #[error("`user = \"{0}\"` needs webship to start as root (fix: start it as root, or remove `user` and `group`)")]
    NotRoot(String),
    #[error("runtime threads did not switch to the service account within 10 s ({switched} of {expected})")]
    ThreadsStuck { switched: usize, expected: usize },
}

/// Keeps freed heap memory for reuse instead of returning it to the kernel at once
/// (`sys::heap`: glibc's mmap and trim thresholds fixed above the largest buffer
/// `config` makes, unless the environment tunes malloc). Called before the runtime's
/// threads start; a reload does not move them.
pub fn keep_freed_heap_memory(config: &Config) {
    use crate::sys::heap::{self, Thresholds};
    match heap::fix_thresholds(largest_buffer(config)) {
        Thresholds::Fixed { mmap, trim } => tracing::debug!(
            mmap_threshold = mmap,
            trim_threshold = trim,
            "heap: freed memory is kept for reuse"
        ),
        Thresholds::FromEnvironment => {
            tracing::info!("heap: glibc's malloc settings come from the environment")
        }
        Thresholds::Refused => tracing::warn!(
            "heap: glibc refused the mmap/trim thresholds; freed memory goes back to the kernel as glibc decides"
        ),
        Thresholds::NotGlibc => {}
    }
}

/// The largest single buffer a setting sizes: HTTP/2's TLS write batch, a frame as
/// large as HTTP/2 allows its peer, a request head (and a proxied response's), a
/// WebTransport capsule.
fn largest_buffer(config: &Config) -> usize {
    let per_site = config.sites.iter().flat_map(|site| {
        let capsule = site.webtransport.as_ref().map(|wt| wt.max_capsule_bytes);
        let heads = match &site.serve {
            Serve::Proxy(routes) => routes.iter().map(|r| r.max_header_bytes).max(),
            Serve::Files(_) => None,
        };
        capsule.into_iter().chain(heads)
    });
    [
        config.h2.tls_write_buffer_bytes,
        config.h2.max_frame_size_bytes as usize,
        config.limits.max_header_bytes,
    ]
    .into_iter()
    .chain(per_site)
    .max()
    .unwrap_or(0)
}

/// Descriptors one connection can hold: the client socket and what serves it.
fn fds_per_connection(config: &Config) -> u64 {
    let splice =
        !config.passthrough.is_empty() && matches!(config.passthrough_engine, Engine::Auto | Engine::Splice);
    if splice {
        // Client and upstream sockets, and a pipe (two fds) each way.
        6
    } else {
        // Files: the socket and the open file. Proxy: the client's and the upstream's.
        2
    }
}

/// Raises the soft open-file limit to what `max_connections` needs (up to the hard
/// limit, which is the operator's to raise), or says why it cannot start. A
/// `max_connections` the file does not set is lowered to what fits instead, with a
/// warning (HAProxy derives its default `maxconn` from the limit the same way).
pub fn raise_fd_limit(config: &mut Config) -> Result<(), ProcessError> {
    let mut per_connection = fds_per_connection(config);
    if config.passthrough_udp.is_some() {
        // The userspace relay holds one connected socket per flow, up to as many
        // flows as connections.
        per_connection += 1;
    }
    let needed_for = |connections: u64| {
        connections
            .saturating_mul(per_connection)
            .saturating_add(RESERVED_FDS)
    };
    let mut needed = needed_for(config.limits.max_connections as u64);
    let now = crate::sys::rlimit::nofile().map_err(ProcessError::Rlimit)?;
    if needed > now.hard {
        let fits = now.hard.saturating_sub(RESERVED_FDS) / per_connection;
        if config.limits.max_connections_configured || fits == 0 {
            return Err(ProcessError::TooFewFiles {
                max_connections: config.limits.max_connections,
                per_connection,
                needed,
                hard: now.hard,
                fits,
            });
        }
        tracing::warn!(
            from = config.limits.max_connections,
            to = fits,
            hard = now.hard,
            "lowered the default limits.max_connections to fit the open-file hard limit (RLIMIT_NOFILE; raise it with LimitNOFILE= or `ulimit -Hn`, or set max_connections)"
        );
        config.limits.max_connections = usize::try_from(fits).unwrap_or(usize::MAX);
        needed = needed_for(fits);
    }
    if needed > now.soft {
        crate::sys::rlimit::set_nofile_soft(needed).map_err(ProcessError::Rlimit)?;
        tracing::info!(
            from = now.soft,
            to = needed,
            hard = now.hard,
            "raised the open-file limit for limits.max_connections"
        );
    }
    Ok(())
}

/// The switch to the service account, shared by the main thread and the runtime's
/// thread-start hook. Cloning shares it.
#[derive(Debug, Clone)]
pub struct Privilege {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// `None`: stay as started.
    account: Option<Account>,
    /// Runtime threads that start before the switch and must switch themselves.
    workers: usize,
    state: Mutex<Gate>,
    changed: Condvar,
}

#[derive(Debug)]
enum Gate {
    /// Still root: starting threads wait.
    Closed,
    /// The main thread switched; every thread switches to `account` keeping `keep`.
    Open { keep: Caps, switched: usize },
    /// Startup failed before the switch: threads go on (the process is ending).
    Abandoned,
}

impl Privilege {
    /// Resolves `user`/`group` of `config` (also what `webship check` reports); a
    /// daemon started as root without them stays root, and says so.
    pub fn plan(config: &Config) -> Result<Self, ProcessError> {
        let account = match resolve(config)? {
            Some(account) => {
                let user = &account.user;
                let [_, euid, _] = privilege::thread_uids();
                if account.uid == euid {
                    None // already that user: nothing to switch
                } else if euid != 0 {
                    return Err(ProcessError::NotRoot(user.clone()));
                } else {
                    Some(account)
                }
            }
            None => None,
        };
        Ok(Self {
            inner: Arc::new(Inner {
                account,
                workers: config.workers,
                state: Mutex::new(Gate::Closed),
                changed: Condvar::new(),
            }),
        })
    }

    /// Whether the daemon switches to a service account after binding.
    pub fn switches(&self) -> bool {
        self.inner.account.is_some()
    }

    fn lock(&self) -> MutexGuard<'_, Gate> {
        self.inner.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// tokio's `on_thread_start`: a thread started before the switch waits for it,
    /// then switches itself; one started after inherited the switched credentials.
    pub fn thread_start(&self) {
        let Some(account) = &self.inner.account else {
            return;
        };
        let mut gate = self.lock();
        while matches!(*gate, Gate::Closed) {
            // Startup either switches or abandons (also when it fails or panics: the
            // guard in `server::run`); the timeout only re-checks.
            gate = self
                .inner
                .changed
                .wait_timeout(gate, Duration::from_secs(1))
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
        let Gate::Open { keep, switched } = &mut *gate else {
            return; // abandoned
        };
        if privilege::thread_uids() == [account.uid; 3] {
            return; // created by a thread that already switched
        }
        if let Err(e) = privilege::switch_thread(account, *keep) {
            // This thread would run tasks as root, and startup may already have
            // counted enough switched threads to go on: nothing is safe but ending.
            eprintln!(
                "webship: a runtime thread could not switch to the service account {}: {e}; aborting rather than serve as root",
                account.user
            );
            std::process::abort();
        }
        *switched += 1;
        self.inner.changed.notify_all();
    }

    /// Abandons the switch when dropped before it happened (startup failed or
    /// panicked), so the runtime's waiting threads can end.
    pub(super) fn guard(&self) -> AbandonGuard<'_> {
        AbandonGuard(self)
    }

    /// Startup failed: lets the waiting threads go so the runtime can shut down.
    pub(super) fn abandon(&self) {
        let mut gate = self.lock();
        if matches!(*gate, Gate::Closed) {
            *gate = Gate::Abandoned;
            self.inner.changed.notify_all();
        }
    }

    /// Switches the calling (main) thread, then every runtime thread, keeping `keep`;
    /// returns once all of them have. Without an account, warns if this is root.
    pub(super) fn switch(&self, keep: Caps) -> Result<(), ProcessError> {
        let Some(account) = &self.inner.account else {
            if privilege::thread_uids()[1] == 0 {
                tracing::warn!(
                    "running as root for the whole life of the process: set `user` (and `group`) to drop to a service account after binding"
                );
            }
            return Ok(());
        };
        if let Err(e) = privilege::switch_thread(account, keep) {
            self.abandon();
            return Err(e.into());
        }
        let mut gate = self.lock();
        *gate = Gate::Open { keep, switched: 0 };
        self.inner.changed.notify_all();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let Gate::Open { switched, .. } = &*gate else {
                // Only this thread changes an open gate; nothing else can be seen.
                return Err(ProcessError::ThreadsStuck {
                    switched: 0,
                    expected: self.inner.workers,
                });
            };
            if *switched >= self.inner.workers {
                break;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ProcessError::ThreadsStuck {
                    switched: *switched,
                    expected: self.inner.workers,
                });
            }
            gate = self
                .inner
                .changed
                .wait_timeout(gate, left)
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
        tracing::info!(
            user = %account.user,
            uid = account.uid,
            gid = account.gid,
            capabilities = %keep,
            "switched to the service account (every thread; no new privileges)"
        );
        Ok(())
    }

    /// The service account's name, when the daemon switches.
    pub(super) fn account(&self) -> Option<&str> {
        self.inner.account.as_ref().map(|a| a.user.as_str())
    }

    /// The service account's ids, when the daemon switches.
    pub(super) fn ids(&self) -> Option<(u32, u32)> {
        self.inner.account.as_ref().map(|a| (a.uid, a.gid))
    }
}

pub(super) struct AbandonGuard<'a>(&'a Privilege);

impl Drop for AbandonGuard<'_> {
    fn drop(&mut self) {
        self.0.abandon();
    }
}

/// The service account `config` names, looked up (what `webship check` verifies,
/// whoever runs it).
pub(super) fn resolve(config: &Config) -> Result<Option<Account>, ProcessError> {
    match &config.user {
        Some(user) => Ok(Some(privilege::lookup(user, config.group.as_deref())?)),
        None => Ok(None),
    }
}

/// The capabilities the daemon still needs after the switch, and why.
pub(super) fn kept_capabilities(ebpf_loaded: bool, bbr: bool) -> Caps {
    let mut keep = Caps::empty();
    if ebpf_loaded {
        // Sockets are linked into the sockmap and counters published while serving:
        // kernels before 6.5 refuse every bpf() command without CAP_BPF when
        // unprivileged eBPF is disabled. Detaching the programs at shutdown (tc on
        // kernels without TCX, the sk_skb verdict) needs CAP_NET_ADMIN.
        keep = keep.with(Caps::BPF).with(Caps::NET_ADMIN);
    }
    if bbr && !bbr_allowed_unprivileged() {
        // TCP_CONGESTION "bbr" on each accepted socket: an unprivileged process may
        // only pick what net.ipv4.tcp_allowed_congestion_control lists.
        keep = keep.with(Caps::NET_ADMIN);
    }
    keep
}

fn bbr_allowed_unprivileged() -> bool {
    std::fs::read_to_string("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
        .map(|list| list.split_whitespace().any(|cc| cc == "bbr"))
        .unwrap_or(false)
}

/// Warns about file sites whose root the service account cannot list: every request
/// there would be 403.
pub(super) fn check_roots(config: &Config) {
    for site in &config.sites {
        if let Serve::Files(root) = &site.serve {
            if let Err(e) = std::fs::read_dir(root) {
                tracing::warn!(
                    site = %site.domain,
                    root = %root.display(),
                    error = %e,
                    "the service account cannot list this root: its files will be 403"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The settings that size one buffer each, and the largest of them wins.
    #[test]
    fn the_largest_buffer_is_the_largest_setting() {
        let dir = std::env::temp_dir();
        let mut config = crate::config::builtin_default(&dir).unwrap();
        // The defaults: HTTP/2's 128 KiB write batch.
        assert_eq!(largest_buffer(&config), 128 * 1024);
        config.limits.max_header_bytes = 1 << 20;
        assert_eq!(largest_buffer(&config), 1 << 20);
        config.h2.max_frame_size_bytes = (1 << 24) - 1;
        assert_eq!(largest_buffer(&config), (1 << 24) - 1);
        config.h2.tls_write_buffer_bytes = 1 << 24;
        assert_eq!(largest_buffer(&config), 1 << 24);
    }

    #[test]
    fn only_ebpf_and_a_restricted_bbr_keep_capabilities() {
        assert_eq!(kept_capabilities(false, false), Caps::empty());
        assert_eq!(kept_capabilities(true, false), Caps::BPF.with(Caps::NET_ADMIN));
        let bbr = kept_capabilities(false, true);
        if bbr_allowed_unprivileged() {
            assert_eq!(bbr, Caps::empty());
        } else {
            assert_eq!(bbr, Caps::NET_ADMIN);
        }
    }
}
