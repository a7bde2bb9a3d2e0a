//! Emulated cores: a server's worker threads each confined to a CPU quota of their
//! own, so that the server, not the client beside it, is what limits a run.
//!
//! On a host with two cores the client takes one, and "does h3 scale with workers"
//! cannot be answered by adding workers: the client is the limit long before the
//! server is. With each worker thread in a cgroup of its own holding `share` of
//! one CPU, every worker is a small core of its own: throughput that grows with
//! the worker count shows that no single thread (one UDP socket's driver, say)
//! caps the server, which is what "scales with cores" asks.
//!
//! The mechanism is the cgroup v1 `cpu` controller (`cpu.cfs_quota_us` over
//! `cpu.cfs_period_us`), which accepts single threads in its `tasks` file. Threads
//! a worker starts later (tokio's blocking pool, which reads files) inherit its
//! group and so its quota. The server's other threads (the main thread, the
//! access-log writer) share one more group with the same quota, so nothing the
//! server does runs outside the emulated cores. Cgroup v2 would need the process
//! moved into a threaded subtree; this host has v1 and only v1 is supported.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};

/// Where the cgroup v1 `cpu` hierarchy is mounted on Debian and most distributions.
const CPU_HIERARCHY: &str = "/sys/fs/cgroup/cpu";
/// The kernel's smallest quota and period (1 ms). Each group gets the shortest
/// period that still holds this quota at its share, so a throttled thread waits
/// as little as the kernel allows (4 ms of every 5 at a share of 0.2, instead of
/// the default period's 80 of every 100) and a QUIC connection's timers see a
/// steady, slow core rather than one that stops for a tenth of a second.
const MIN_US: u64 = 1_000;
/// What tokio names the server's worker threads (`webship-worker`, truncated to
/// 15 bytes by the kernel as every thread name is).
const WORKER_NAME: &str = "webship-worker";

/// One thread of a process: its id, name and CPU time so far (clock ticks).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Thread {
    pub tid: u32,
    pub name: String,
    pub ticks: u64,
}

/// Every thread of `pid`, in thread-id order (tokio's workers start first, so
/// they come before any blocking-pool thread).
pub(crate) fn threads(pid: u32) -> Vec<Thread> {
    let Ok(entries) = fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    let mut threads: Vec<Thread> = entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse().ok())
        .filter_map(|tid: u32| {
            let dir = format!("/proc/{pid}/task/{tid}");
            let name = fs::read_to_string(format!("{dir}/comm"))
                .ok()?
                .trim_end()
                .to_owned();
            let stat = webship_testkit::proc::parse_stat(&fs::read_to_string(format!("{dir}/stat")).ok()?)?;
            Some(Thread {
                tid,
                name,
                ticks: stat.utime + stat.stime,
            })
        })
        .collect();
    threads.sort_by_key(|t| t.tid);
    threads
}

/// The confinement of one server: a cgroup per worker and one for the rest,
/// removed again on drop (the threads moved back to the root group first).
#[derive(Debug)]
pub(crate) struct EmulatedCores {
    /// One per worker thread, then the rest's.
    groups: Vec<PathBuf>,
}

impl EmulatedCores {
    /// Confines `pid`'s `workers` worker threads to `share` of a CPU each, and its
    /// other threads together to one more such share. Fails, changing nothing that
    /// outlives the error, when the hierarchy is missing, the share is out of range,
    /// or the process does not have exactly `workers` worker threads yet (a
    /// blocking-pool thread started before this call would be indistinguishable).
    pub(crate) fn confine(pid: u32, workers: usize, share: f64) -> Result<Self> {
        let root = Path::new(CPU_HIERARCHY);
        ensure!(
            root.join("cpu.cfs_quota_us").exists(),
            "--core-share needs the cgroup v1 cpu controller at {CPU_HIERARCHY} (and root)"
        );
        let (period, quota) = period_and_quota_us(share)?;
        let all = threads(pid);
        let worker_tids: Vec<u32> = all
            .iter()
            .filter(|t| t.name == WORKER_NAME)
            .map(|t| t.tid)
            .collect();
        if worker_tids.len() != workers {
            bail!(
                "expected {workers} {WORKER_NAME} threads in process {pid}, found {}: \
                 the cores must be set before the server starts blocking-pool threads",
                worker_tids.len()
            );
        }
        let mut cores = Self { groups: Vec::new() };
        let rest: Vec<u32> = all
            .iter()
            .filter(|t| t.name != WORKER_NAME)
            .map(|t| t.tid)
            .collect();
        let members = worker_tids
            .into_iter()
            .map(|tid| vec![tid])
            .chain(std::iter::once(rest));
        for (i, tids) in members.enumerate() {
            // Pushed before it is filled: a failure below still removes it on drop.
            let group = root.join(format!("webship-bench-{pid}-{i}"));
            fs::create_dir(&group).with_context(|| format!("creating {}", group.display()))?;
            cores.groups.push(group.clone());
            fs::write(group.join("cpu.cfs_period_us"), period.to_string())?;
            fs::write(group.join("cpu.cfs_quota_us"), quota.to_string())?;
            for tid in tids {
                fs::write(group.join("tasks"), tid.to_string())
                    .with_context(|| format!("moving thread {tid} into {}", group.display()))?;
            }
        }
        Ok(cores)
    }

    /// CPU ticks per emulated core so far: each worker's group (every thread now in
    /// it, blocking-pool threads included), then the rest.
    pub(crate) fn ticks(&self, pid: u32) -> Vec<u64> {
        let by_tid: std::collections::HashMap<u32, u64> =
            threads(pid).into_iter().map(|t| (t.tid, t.ticks)).collect();
        self.groups
            .iter()
            .map(|group| {
                fs::read_to_string(group.join("tasks"))
                    .unwrap_or_default()
                    .lines()
                    .filter_map(|tid| by_tid.get(&tid.parse().ok()?))
                    .sum()
            })
            .collect()
    }
}

impl Drop for EmulatedCores {
    fn drop(&mut self) {
        let root = Path::new(CPU_HIERARCHY).join("tasks");
        for group in self.groups.iter().rev() {
            // A group holding threads cannot be removed: they go back to the root
            // first. Threads that exited in between are simply gone.
            for tid in fs::read_to_string(group.join("tasks"))
                .unwrap_or_default()
                .lines()
            {
                let _ = fs::write(&root, tid);
            }
            if let Err(e) = fs::remove_dir(group) {
                eprintln!("cores: could not remove {}: {e}", group.display());
            }
        }
    }
}

/// The period and quota, in µs, for `share` of one CPU: the shortest period whose
/// quota is at least the kernel's 1 ms.
fn period_and_quota_us(share: f64) -> Result<(u64, u64)> {
    ensure!(
        share.is_finite() && (0.01..=1.0).contains(&share),
        "--core-share must be between 0.01 and 1, not {share}"
    );
    // In range by the check above: 1 to 100 ms.
    let period = (MIN_US as f64 / share).ceil() as u64;
    let quota = ((share * period as f64).round() as u64).max(MIN_US);
    Ok((period, quota))
}

#[cfg(test)]
mod tests {
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
    }

    #[test]
    fn own_threads_are_listed_in_order() {
        let name = "cores-probe";
        let (ready, wait) = std::sync::mpsc::channel();
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let probe = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                ready.send(()).expect("the test waits");
                let _ = stopped.recv();
            })
            .expect("spawns");
        wait.recv().expect("the probe starts");
        let listed = threads(std::process::id());
        drop(stop);
        probe.join().expect("the probe ends");
        assert!(listed.windows(2).all(|w| w[0].tid < w[1].tid));
        assert!(listed.iter().any(|t| t.name == name), "{listed:?}");
    }

    /// A real process confined (as root, on this cgroup v1 host; the suite runs as
    /// root): its thread lands in a group with the quota, and the group is gone
    /// after the drop.
    #[test]
    fn a_process_is_confined_and_released() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep runs");
        let pid = child.id();
        let wrong = EmulatedCores::confine(pid, 1, 0.5).expect_err("sleep has no worker thread");
        assert!(wrong.to_string().contains("found 0"), "{wrong:#}");
        let cores = EmulatedCores::confine(pid, 0, 0.5).expect("confined");
        let group = cores.groups.last().expect("the rest's group").clone();
        let read = |file: &str| fs::read_to_string(group.join(file)).expect("readable");
        assert_eq!(read("cpu.cfs_quota_us").trim(), "1000");
        assert_eq!(read("cpu.cfs_period_us").trim(), "2000");
        assert_eq!(read("tasks").trim(), pid.to_string());
        assert_eq!(cores.ticks(pid).len(), 1);
        drop(cores);
        assert!(!group.exists());
        child.kill().expect("killed");
        child.wait().expect("reaped");
    }
}
