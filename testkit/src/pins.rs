//! The eBPF pin folders the test and bench daemons get (`bpf_pin_dir =
//! "/sys/fs/bpf/webship-e2e-{port}"`, `webship-bench-{port}`): one per daemon, on a
//! port that is never used again, so a run that was killed leaves its folder behind.
//!
//! A daemon removes its pins and folder when it exits cleanly, and holds an `flock`
//! on the folder while it lives (the kernel drops it however the daemon ends; a
//! binary upgrade's successor inherits it). So a harness may remove
//! - its own daemon's folder once that daemon has stopped and no process holds the
//!   folder's lock ([`remove_own`]): the pins in it are a dead daemon's;
//! - at its start, the folders with these prefixes that are older than [`GRACE`] and
//!   that no process holds ([`sweep`], choosing with [`stale`]), pins included:
//!   killed runs' daemons (their lock went with them), never a live daemon's.
//!
//! Nothing here touches a folder without one of [`PREFIXES`] directly under
//! [`PIN_ROOT`]. Whether a folder is held is probed by taking its lock (a
//! non-blocking exclusive `flock`), and the pins and the folder are removed while
//! that lock is held, so no daemon can take the folder meanwhile. `/proc/locks`
//! cannot tell: it hides a lock whose owner's pid this pid namespace does not see
//! (a binary upgrade's successor holds the lock its exited predecessor took; a
//! daemon in another container may share `/sys/fs/bpf`). A probe could make a
//! daemon starting that instant find its folder busy, which is why only folders
//! nothing will start on are probed: those older than [`GRACE`] (a daemon locks its
//! folder a moment after creating it, and a port is never used again) and a
//! harness's own, after its daemon stopped.

use std::path::Path;
use std::time::Duration;

use rustix::fs::{FlockOperation, Mode, OFlags};

/// Where the BPF filesystem is mounted.
pub const PIN_ROOT: &str = "/sys/fs/bpf";
/// The names of the folders test and bench daemons pin under.
pub const PREFIXES: [&str; 2] = ["webship-e2e-", "webship-bench-"];
/// How old a folder must be to be swept: a daemon creates its folder a moment
/// before it locks it.
pub const GRACE: Duration = Duration::from_secs(60);

/// A folder in [`PIN_ROOT`] as the sweep sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Folder {
    pub name: String,
    /// Since it last changed.
    pub age: Duration,
}

/// The folders of `listing` a sweep probes, and removes with their pins unless some
/// process holds their lock: named with one of [`PREFIXES`] and older than
/// [`GRACE`].
pub fn stale(listing: &[Folder]) -> Vec<&str> {
    listing
        .iter()
        .filter(|f| ours(&f.name) && f.age >= GRACE)
        .map(|f| f.name.as_str())
        .collect()
}

fn ours(name: &str) -> bool {
    PREFIXES.iter().any(|p| name.starts_with(p)) && !name.contains('/')
}

/// Removes the unheld test and bench pin folders older than [`GRACE`], with their
/// pins (see [`stale`]); returns how many. Quiet: where there is no BPF filesystem or no
/// permission, it removes nothing.
pub fn sweep() -> usize {
    let Ok(entries) = std::fs::read_dir(PIN_ROOT) else {
        return 0;
    };
    let listing: Vec<Folder> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            if !ours(&name) {
                return None;
            }
            let meta = std::fs::symlink_metadata(e.path()).ok()?;
            if !meta.is_dir() {
                return None;
            }
            Some(Folder {
                age: meta.modified().ok()?.elapsed().unwrap_or_default(),
                name,
            })
        })
        .collect();
    stale(&listing)
        .into_iter()
        .filter(|name| remove_unheld(&Path::new(PIN_ROOT).join(name)))
        .count()
}

/// Removes `dir`, a harness's own daemon's pin folder, with the pins in it, once its
/// daemon has stopped: only a folder with one of [`PREFIXES`] directly under
/// [`PIN_ROOT`], and only while no process holds its lock (a binary upgrade's
/// successor, or another daemon sharing it, keeps it). Call it after the daemon
/// exited; a missing folder (the daemon removed it) is fine.
pub fn remove_own(dir: &Path) {
    let named_ours = dir.parent() == Some(Path::new(PIN_ROOT))
        && dir.file_name().and_then(|n| n.to_str()).is_some_and(ours);
    if named_ours {
        remove_unheld(dir);
    }
}

/// The folder `dir` (not a symlink), open and locked by this process, unless another
/// holds its lock or it cannot be opened.
fn take(dir: &Path) -> Option<rustix::fd::OwnedFd> {
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let folder = rustix::fs::open(dir, flags, Mode::empty()).ok()?;
    // WOULDBLOCK: a live daemon holds it; any other failure leaves it alone too.
    rustix::fs::flock(&folder, FlockOperation::NonBlockingLockExclusive).ok()?;
    Some(folder)
}

/// Removes the folder `dir` and the pins in it while holding its lock, unless some
/// process holds it; returns whether the folder is gone.
fn remove_unheld(dir: &Path) -> bool {
    let Some(lock) = take(dir) else {
        return false;
    };
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            // Pins are files on the BPF filesystem; unlinking one drops the pin only.
            let _ = std::fs::remove_file(entry.path());
        }
    }
    let gone = std::fs::remove_dir(dir).is_ok();
    drop(lock);
    gone
}

/// The `bpf_pin_dir` a daemon configuration names, if any.
pub fn pin_dir_of(config: &str) -> Option<&Path> {
    config.lines().find_map(|line| {
        let value = line
            .trim()
            .strip_prefix("bpf_pin_dir")?
            .trim()
            .strip_prefix('=')?;
        Some(Path::new(value.trim().strip_prefix('"')?.strip_suffix('"')?))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn folder(name: &str, age_secs: u64) -> Folder {
        Folder {
            name: name.to_owned(),
            age: Duration::from_secs(age_secs),
        }
    }

    /// Only an old folder with a test or bench prefix is a candidate, with or without
    /// pins; youth or another name each keep a folder (a lock is probed later).
    #[test]
    fn the_sweep_takes_only_old_test_and_bench_folders() {
        let listing = [
            folder("webship-e2e-40001", 3600),
            folder("webship-bench-40002", 61),
            folder("webship-bench-wan-77-443", 600),
            folder("webship-e2e-40003", 3600),
            folder("webship-e2e-40005", 5),
            folder("webship", 3600),
            folder("webship-prod", 3600),
            folder("maps.debug", 3600),
            folder("xwebship-e2e-40006", 3600),
        ];
        assert_eq!(
            stale(&listing),
            [
                "webship-e2e-40001",
                "webship-bench-40002",
                "webship-bench-wan-77-443",
                "webship-e2e-40003"
            ]
        );
    }

    /// A folder whose lock some process holds is kept with its files, even once the
    /// process that took the lock has exited and only its child holds it (a binary
    /// upgrade's successor, which `/proc/locks` hides in another pid namespace);
    /// released, the folder goes with its files.
    #[test]
    fn a_held_folder_is_kept_and_a_released_one_removed() {
        let base = std::env::temp_dir().join(format!("webship-pins-test-{}", std::process::id()));
        let dir = base.join("webship-e2e-1");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("pin"), b"").unwrap();
        let child_pid = base.join("child.pid");
        // flock(1) (util-linux) takes the lock and runs a shell that writes its pid
        // and becomes `sleep`, inheriting the lock; flock(1) itself is then killed.
        let mut taker = std::process::Command::new("flock")
            .args(["--exclusive", dir.to_str().unwrap(), "sh", "-c"])
            .arg(format!("echo $$ > {}; exec sleep 10", child_pid.display()))
            .spawn()
            .expect("flock(1) runs");
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let mut held = None;
        while held.is_none() && std::time::Instant::now() < deadline {
            held = std::fs::read_to_string(&child_pid)
                .ok()
                .and_then(|pid| pid.trim().parse::<u32>().ok());
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = taker.kill();
        let _ = taker.wait();
        let Some(sleeper) = held else {
            let _ = std::fs::remove_dir_all(&base);
            panic!("flock(1) did not start its command within 5 s");
        };
        let kept = !remove_unheld(&dir) && dir.join("pin").exists();
        // The sleeper is this test's grandchild, ended by its pid.
        let _ = std::process::Command::new("kill")
            .arg(sleeper.to_string())
            .status();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let mut removed = false;
        while !removed && std::time::Instant::now() < deadline {
            removed = remove_unheld(&dir);
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = std::fs::remove_dir_all(&base);
        assert!(kept, "a folder whose lock a live process holds was removed");
        assert!(removed, "a released folder was not removed within 5 s");
    }

    /// Only folders named like a test or bench daemon's, directly in the pin root,
    /// are ever touched by `remove_own`.
    #[test]
    fn remove_own_leaves_other_folders_alone() {
        let dir = std::env::temp_dir().join(format!("webship-e2e-pins-own-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        remove_own(&dir);
        let kept = dir.exists();
        let _ = std::fs::remove_dir(&dir);
        assert!(kept, "a folder outside {PIN_ROOT} was removed");
    }

    #[test]
    fn the_pin_folder_is_read_from_a_configuration() {
        let config = "listen = \"127.0.0.1:1\"\n[kernel]\nbpf_pin_dir = \"/sys/fs/bpf/webship-e2e-1\"\n";
        assert_eq!(pin_dir_of(config), Some(Path::new("/sys/fs/bpf/webship-e2e-1")));
        assert_eq!(pin_dir_of("[kernel]\nebpf = \"off\"\n"), None);
    }
}
