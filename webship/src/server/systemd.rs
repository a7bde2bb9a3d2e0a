//! What the service manager hears from a running server (`sys::notify` speaks the
//! protocol): `READY=1` once it serves, a `STATUS=` line that follows the open
//! connections, `WATCHDOG=1` pings from a task on the runtime (so a runtime that no
//! longer schedules tasks stops them and systemd restarts the service), and
//! `STOPPING=1` when the drain starts. Without `$NOTIFY_SOCKET` nothing is spawned.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;

use super::generation::Current;
use crate::config::Config;
use crate::metrics::Registry;
use crate::sys::notify;

/// How often the status line is refreshed when no watchdog asks for more often.
const STATUS_EVERY: Duration = Duration::from_secs(5);

#[derive(Debug)]
pub(super) struct Reporter {
    task: Option<JoinHandle<()>>,
    draining: Arc<AtomicBool>,
    /// Where the open connections are counted (not the connection permits: the
    /// accept loop holds one while it waits for the next connection).
    metrics: Arc<Registry>,
}

impl Reporter {
    /// Tells the manager the server is up (status first, so `systemctl status` has
    /// it when the unit turns active) and starts the watchdog and status task.
    pub(super) fn serving(current: Arc<Current>, metrics: Arc<Registry>) -> Self {
        let draining = Arc::new(AtomicBool::new(false));
        let mut reporter = Self {
            task: None,
            draining: draining.clone(),
            metrics: metrics.clone(),
        };
        if !notify::enabled() {
            return reporter;
        }
        // The summary follows reloads: each line reads the current generation.
        let what = move || summary(&current.load().config);
        let mut shown = format!("serving {}; 0 connections open", what());
        notify::status(&shown);
        notify::ready();
        let watchdog = notify::watchdog_interval();
        if let Some(every) = watchdog {
            tracing::info!(
                every_ms = u64::try_from(every.as_millis()).unwrap_or(u64::MAX),
                "systemd watchdog: pinging"
            );
        }
        let every = watchdog.map_or(STATUS_EVERY, |w| w.min(STATUS_EVERY));
        reporter.task = Some(tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if watchdog.is_some() {
                    notify::watchdog_ping();
                }
                if draining.load(Ordering::Relaxed) {
                    // The status keeps the drain's start.
                    continue;
                }
                let open = metrics.connections().open();
                let line = format!("serving {}; {open} connections open", what());
                if line != shown {
                    notify::status(&line);
                    shown = line;
                }
            }
        }));
        reporter
    }

    /// `STOPPING=1`, and the status says how many connections the drain waits for.
    pub(super) fn draining(&self) {
        if !notify::enabled() {
            return;
        }
        self.draining.store(true, Ordering::Relaxed);
        notify::stopping();
        let open = self.metrics.connections().open();
        notify::status(&format!("draining {open} connections"));
    }
}

impl Reporter {
    /// A new process took the sockets over (`webship serve --takeover`) and serves:
    /// `MAINPID=` names it, so the manager follows it, and this process stops
    /// speaking for the service (no more watchdog pings or status lines, and no
    /// `STOPPING=1`, which would stop the service the successor now carries).
    pub(super) fn hand_over(&mut self, successor: u32) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
        if notify::enabled() {
            notify::mainpid(successor);
        }
    }
}

impl Drop for Reporter {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// "3 sites and 1 passthrough route on 0.0.0.0:443".
fn summary(config: &Config) -> String {
    let plural = |n: usize, one: &str| format!("{n} {one}{}", if n == 1 { "" } else { "s" });
    let mut out = plural(config.sites.len(), "site");
    if !config.passthrough.is_empty() {
        out.push_str(" and ");
        out.push_str(&plural(config.passthrough.len(), "passthrough route"));
    }
    out.push_str(&format!(" on {}", config.listen));
    out
}

/// Under systemd, why a process taking this one's sockets over (`pid`) could not
/// carry the service: it runs outside the service's control group, so systemd
/// would refuse to follow it (`MAINPID=` from an unprivileged process must name one
/// of the service's own) and would stop the service when this process exits,
/// leaving the new one unsupervised. `None` when not under a service manager, when
/// `pid` is inside, or when the group cannot be read (then nothing is refused).
pub(super) fn outside_the_service(pid: u32) -> Option<String> {
    if !notify::enabled() {
        return None;
    }
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    // The unified hierarchy's line; systemd tracks services there.
    let group = own
        .lines()
        .find_map(|l| l.strip_prefix("0::"))?
        .trim_end_matches('/');
    // Mounted on /sys/fs/cgroup (unified) or /sys/fs/cgroup/unified (hybrid).
    let procs = ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
        .iter()
        .find_map(|root| std::fs::read_to_string(format!("{root}{group}/cgroup.procs")).ok())?;
    let wanted = pid.to_string();
    if procs.lines().any(|l| l.trim() == wanted) {
        return None;
    }
    let shown = if group.is_empty() { "/" } else { group };
    Some(format!(
        "this daemon runs under a service manager in the control group {shown}, and the new process \
         (pid {pid}) outside it: systemd would not follow it and would stop the service when this \
         process exits. Start the new process inside the group (docs/operations.md, \
         \"Zero-downtime binary upgrade\"), or restart the service"
    ))
}
