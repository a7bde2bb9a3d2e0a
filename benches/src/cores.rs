//! Emulated cores: a server's worker threads each confined to a CPU quota of their
//! own, so that the server, not the client beside it, is what limits a run.
//!
//! On a host with two cores the client takes one, and "does h3 scale with workers"
//! cannot be answered by adding workers: the client is the limit long before the
//! server is. With each worker thread in a cgroup of its own holding `share` of
//! one CPU, every worker is a small core of its own: throughput that grows with
//! the worker count shows that no single thread (one UDP socket's driver, say)
//! caps the server.
//!
//! The mechanism is the cgroup v1 `cpu` controller (`cpu.cfs_quota_us` over
//! `cpu.cfs_period_us`), which accepts single threads in its `tasks` file, and
//! `cpuacct` for each group's CPU time (kept for threads that exit, unlike
//! `/proc`'s per-thread figures). The groups are made under the server's own
//! groups, and its threads go back there on drop. The server's other threads (the
//! main thread, the access-log writer) share one more group with the same quota.
//!
//! What it does not emulate, so read the figures with it:
//! - A thread a worker starts later (tokio's blocking pool: file opens and reads
//!   that miss the page cache) joins the group of the worker that started it, and
//!   then serves every worker's blocking calls on that worker's quota.
//! - The kernel charges some packet work to whoever runs when it happens: on
//!   loopback the server's receive path runs partly in the client's sends, and the
//!   client's in the server's.
//! - The quota is enforced at the scheduler's accounting points, so a group can
//!   overrun its share for a while; the CPU a core actually got is reported.
//! - Cgroup v2 would need the process moved into a threaded subtree; only v1 (as
//!   on this project's hosts) is supported, as root.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};

/// Where cgroup v1 hierarchies are mounted on Debian and most distributions.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";
/// The kernel's smallest quota and period (1 ms). Each group gets the shortest
/// period that still holds this quota at its share (1 ms of every 5 at a share
/// of 0.2, instead of the default 100 ms period's 20 of every 100), so a QUIC
/// connection's timers see a steadily slow core rather than one that stops for
/// most of a tenth of a second.
const MIN_US: u64 = 1_000;
/// What tokio names the server's threads (`webship/src/main.rs`): the workers and
/// the blocking pool alike, which is why [`EmulatedCores::confine`] runs before a
/// blocking-pool thread exists and checks that it sees exactly the workers.
const WORKER_NAME: &str = "webship-worker";

/// `--core-share`'s parser: a share of one CPU the kernel can enforce.
pub(crate) fn parse_share(text: &str) -> Result<f64, String> {
    let share: f64 = text.parse().map_err(|e| format!("{text:?}: {e}"))?;
    period_and_quota_us(share).map_err(|e| e.to_string())?;
    Ok(share)
}

/// One thread of a process: its id and name.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Thread {
    tid: u32,
    name: String,
}

/// Every thread of `pid` that could be read.
fn threads(pid: u32) -> Vec<Thread> {
    let Ok(entries) = fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse().ok())
        .filter_map(|tid: u32| {
            let name = fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm")).ok()?;
            Some(Thread {
                tid,
                name: name.trim_end().to_owned(),
            })
        })
        .collect()
}

/// The two v1 controllers used: `cpu` (the quota) and `cpuacct` (the usage). On
/// hosts that mount them together both are the same directory.
#[derive(Debug)]
struct Hierarchies {
    cpu: PathBuf,
    acct: PathBuf,
}

impl Hierarchies {
    /// The hierarchies' directories of `pid`'s own groups, where the new groups go.
    fn of(pid: u32) -> Result<Self> {
        let cgroups = fs::read_to_string(format!("/proc/{pid}/cgroup"))
            .with_context(|| format!("reading /proc/{pid}/cgroup"))?;
        let dir = |controller: &str| -> Option<PathBuf> {
            cgroups.lines().find_map(|line| {
                let mut fields = line.splitn(3, ':');
                let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
                let names: Vec<&str> = controllers.split(',').collect();
                if !names.contains(&controller) {
                    return None;
                }
                let mount = Path::new(CGROUP_ROOT).join(controllers);
                let dir = mount.join(path.trim_start_matches('/'));
                dir.is_dir().then_some(dir)
            })
        };
        let (Some(cpu), Some(acct)) = (dir("cpu"), dir("cpuacct")) else {
            bail!(
                "--core-share needs the cgroup v1 cpu and cpuacct controllers mounted under \
                 {CGROUP_ROOT}, with process {pid}'s groups there (cgroup v2 alone, or a \
                 container that does not show its groups, is not supported)"
            );
        };
        ensure!(crate::is_root(), "--core-share needs root (it creates cgroups)");
        Ok(Self { cpu, acct })
    }

    /// The directories a group named `name` has: one per distinct hierarchy.
    fn dirs(&self, name: &str) -> Vec<PathBuf> {
        let mut dirs = vec![self.cpu.join(name)];
        if self.acct != self.cpu {
            dirs.push(self.acct.join(name));
        }
        dirs
    }
}

/// The confinement of one server: a group per worker and one for the rest,
/// removed on drop (the threads moved back to the server's own groups first).
#[derive(Debug)]
pub(crate) struct EmulatedCores {
    hierarchies: Hierarchies,
    /// The groups' names, one per worker thread, then the rest's.
    groups: Vec<String>,
}

impl EmulatedCores {
    /// Confines `pid`'s `workers` worker threads to `share` of a CPU each, and its
    /// other threads together to one more such share. Fails, leaving no group
    /// behind, when the hierarchies are missing, the share is out of range, or the
    /// process does not have exactly `workers` threads of the workers' name (a
    /// blocking-pool thread started before this call would carry it too).
    pub(crate) fn confine(pid: u32, workers: usize, share: f64) -> Result<Self> {
        let hierarchies = Hierarchies::of(pid)?;
        let (period, quota) = period_and_quota_us(share)?;
        let all = threads(pid);
        let (named, rest): (Vec<Thread>, Vec<Thread>) = all.into_iter().partition(|t| t.name == WORKER_NAME);
        if named.len() != workers {
            bail!(
                "expected {workers} {WORKER_NAME} threads in process {pid}, found {}: \
                 the cores must be set before the server starts blocking-pool threads",
                named.len()
            );
        }
        let mut cores = Self {
            hierarchies,
            groups: Vec::new(),
        };
        let members = named
            .into_iter()
            .map(|t| vec![t.tid])
            .chain(std::iter::once(rest.into_iter().map(|t| t.tid).collect()));
        for (i, tids) in members.enumerate() {
            let name = format!("webship-bench-{pid}-{i}");
            // Recorded before it is made: a failure below still removes what exists.
            cores.groups.push(name.clone());
            for dir in cores.hierarchies.dirs(&name) {
                fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
            }
            let cpu = cores.hierarchies.cpu.join(&name);
            // A quota above the server's own group's (systemd's CPUQuota=, a
            // container's limit) is refused by the kernel with EINVAL.
            for (file, value) in [("cpu.cfs_period_us", period), ("cpu.cfs_quota_us", quota)] {
                fs::write(cpu.join(file), value.to_string()).with_context(|| {
                    format!(
                        "writing {value} to {} (under a quota of its own?)",
                        cpu.join(file).display()
                    )
                })?;
            }
            for tid in tids {
                for dir in cores.hierarchies.dirs(&name) {
                    fs::write(dir.join("tasks"), tid.to_string())
                        .with_context(|| format!("moving thread {tid} into {}", dir.display()))?;
                }
            }
        }
        Ok(cores)
    }

    /// CPU time per emulated core so far, in seconds (`cpuacct.usage`): each
    /// worker's group, then the rest's. A group that cannot be read counts 0.
    pub(crate) fn cpu_seconds(&self) -> Vec<f64> {
        self.groups
            .iter()
            .map(|name| read_u64(&self.hierarchies.acct.join(name).join("cpuacct.usage")) as f64 / 1e9)
            .collect()
    }

    /// How often each group was throttled since it was made (`nr_throttled` of
    /// `cpu.stat`).
    pub(crate) fn throttled(&self) -> Vec<u64> {
        self.groups
            .iter()
            .map(|name| {
                fs::read_to_string(self.hierarchies.cpu.join(name).join("cpu.stat"))
                    .unwrap_or_default()
                    .lines()
                    .find_map(|line| line.strip_prefix("nr_throttled ")?.trim().parse().ok())
                    .unwrap_or(0)
            })
            .collect()
    }
}

impl Drop for EmulatedCores {
    fn drop(&mut self) {
        for name in self.groups.iter().rev() {
            for (dir, home) in self
                .hierarchies
                .dirs(name)
                .iter()
                .zip([&self.hierarchies.cpu, &self.hierarchies.acct])
            {
                if !dir.exists() {
                    continue;
                }
                // A group holding threads cannot be removed: they go home first.
                // Threads that exited in between are simply gone.
                for tid in fs::read_to_string(dir.join("tasks")).unwrap_or_default().lines() {
                    let _ = fs::write(home.join("tasks"), tid);
                }
                if let Err(e) = fs::remove_dir(dir) {
                    eprintln!("cores: could not remove {}: {e}", dir.display());
                }
            }
        }
    }
}

fn read_u64(path: &Path) -> u64 {
    fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// The period and quota, in µs, for `share` of one CPU: the shortest period whose
/// quota is at least the kernel's 1 ms.
fn period_and_quota_us(share: f64) -> Result<(u64, u64)> {
    ensure!(
        share.is_finite() && (0.01..=1.0).contains(&share),
        "a core's share must be between 0.01 and 1 CPU, not {share}"
    );
    // In range by the check above: 1 to 100 ms.
    let period = (MIN_US as f64 / share).ceil() as u64;
    let quota = ((share * period as f64).round() as u64).max(MIN_US);
    Ok((period, quota))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn shares_map_to_the_shortest_period() {
        assert_eq!(period_and_quota_us(0.2).expect("in range"), (5_000, 1_000));
        assert_eq!(period_and_quota_us(0.1).expect("in range"), (10_000, 1_000));
        assert_eq!(period_and_quota_us(0.3).expect("in range"), (3_334, 1_000));
        assert_eq!(period_and_quota_us(1.0).expect("in range"), (1_000, 1_000));
        assert_eq!(period_and_quota_us(0.01).expect("in range"), (100_000, 1_000));
        for bad in [0.0, -0.5, 1.5, f64::NAN, f64::INFINITY, 0.005] {
            assert!(period_and_quota_us(bad).is_err(), "{bad} accepted");
        }
        assert_eq!(parse_share("0.25"), Ok(0.25));
        assert!(parse_share("2").is_err());
        assert!(parse_share("a fifth").is_err());
    }

    #[test]
    fn own_threads_are_listed_by_name() {
        let name = "cores-probe";
        let (ready, wait) = std::sync::mpsc::channel();
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let probe = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                ready.send(()).expect("the test waits");
                let _ = stopped.recv_timeout(Duration::from_secs(10));
            })
            .expect("spawns");
        wait.recv_timeout(Duration::from_secs(10))
            .expect("the probe starts");
        let listed = threads(std::process::id());
        drop(stop);
        probe.join().expect("the probe ends");
        assert!(listed.iter().any(|t| t.name == name), "{listed:?}");
    }

    /// Kills the child however the test ends.
    struct Reaped(std::process::Child);

    impl Drop for Reaped {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    /// A real process confined and released, on this project's hosts (root, cgroup
    /// v1; CI runs as root). A host without them is said so, not failed.
    #[test]
    fn a_process_is_confined_and_released() {
        let child = Reaped(
            std::process::Command::new("sleep")
                .arg("30")
                .spawn()
                .expect("sleep runs"),
        );
        let pid = child.0.id();
        let hierarchies = match Hierarchies::of(pid) {
            Ok(h) => h,
            Err(e) => {
                eprintln!("skipped: {e:#}");
                return;
            }
        };
        let wrong = EmulatedCores::confine(pid, 1, 0.5).expect_err("sleep has no worker thread");
        assert!(wrong.to_string().contains("found 0"), "{wrong:#}");
        let cores = EmulatedCores::confine(pid, 0, 0.5).expect("confined");
        let group = hierarchies.cpu.join(&cores.groups[0]);
        let read = |dir: &Path, file: &str| fs::read_to_string(dir.join(file)).expect("readable");
        assert_eq!(read(&group, "cpu.cfs_quota_us").trim(), "1000");
        assert_eq!(read(&group, "cpu.cfs_period_us").trim(), "2000");
        assert_eq!(read(&group, "tasks").trim(), pid.to_string());
        let acct = hierarchies.acct.join(&cores.groups[0]);
        assert_eq!(read(&acct, "tasks").trim(), pid.to_string());
        assert_eq!(cores.cpu_seconds().len(), 1);
        assert_eq!(cores.throttled().len(), 1);
        drop(cores);
        assert!(!group.exists() && !acct.exists());
        let home = read(&hierarchies.cpu, "tasks");
        assert!(
            home.lines().any(|tid| tid == pid.to_string()),
            "{pid} is back home"
        );
    }
}
