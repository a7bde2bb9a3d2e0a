//! The eBPF pin folders the test and bench daemons get (`bpf_pin_dir =
//! "/sys/fs/bpf/webship-e2e-{port}"`, `webship-bench-{port}`): one per daemon, on a
//! port that is never used again, so a run that was killed leaves its folder behind.
//!
//! A daemon removes its pins and folder when it exits cleanly, and holds an `flock`
//! on the folder while it lives (the kernel drops it however the daemon ends; a
//! binary upgrade's successor inherits it). So a harness may remove
//! - its own daemon's folder once that daemon has stopped and no process holds the
//!   folder's lock ([`remove_own`]): the pins in it are a dead daemon's;
//! - at its start, the folders with these prefixes that no process holds and that
//!   are older than [`GRACE`] ([`sweep`], choosing with [`stale`]), pins included:
//!   killed runs' daemons (their lock went with them), never a live daemon's.
//!
//! Nothing here touches a folder without one of [`PREFIXES`] directly under
//! [`PIN_ROOT`]. Locks are read from `/proc/locks`, not probed by taking them: a
//! probe could make a daemon starting that instant find its folder busy.

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Duration;

/// Where the BPF filesystem is mounted.
pub const PIN_ROOT: &str = "/sys/fs/bpf";
/// The names of the folders test and bench daemons pin under.
pub const PREFIXES: [&str; 2] = ["webship-e2e-", "webship-bench-"];
/// How old an unlocked folder must be to be swept: a daemon creates its folder a
/// moment before it locks it.
pub const GRACE: Duration = Duration::from_secs(60);

/// A folder in [`PIN_ROOT`] as the sweep sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Folder {
    pub name: String,
    /// Some process holds a lock on it (a live daemon).
    pub locked: bool,
    /// Since it last changed.
    pub age: Duration,
}

/// The folders of `listing` a sweep removes: named with one of [`PREFIXES`], locked
/// by no process and older than [`GRACE`], with or without pins.
pub fn stale(listing: &[Folder]) -> Vec<&str> {
    listing
        .iter()
        .filter(|f| ours(&f.name) && !f.locked && f.age >= GRACE)
        .map(|f| f.name.as_str())
        .collect()
}

fn ours(name: &str) -> bool {
    PREFIXES.iter().any(|p| name.starts_with(p)) && !name.contains('/')
}

/// The (device major, device minor, inode) of every file `/proc/locks` (its text
/// is `text`) lists a lock on, waiters included.
pub fn locked_files(text: &str) -> HashSet<(u32, u32, u64)> {
    text.lines()
        .filter_map(|line| {
            // "1: FLOCK  ADVISORY  WRITE 4242 00:1f:1234 0 EOF"; a waiter has "->"
            // after the number. The file is the field after the pid.
            let fields: Vec<&str> = line.split_whitespace().filter(|f| *f != "->").collect();
            let mut id = fields.get(5)?.split(':');
            let major = u32::from_str_radix(id.next()?, 16).ok()?;
            let minor = u32::from_str_radix(id.next()?, 16).ok()?;
            let inode = id.next()?.parse().ok()?;
            Some((major, minor, inode))
        })
        .collect()
}

/// The (major, minor, inode) of `meta`'s file, as `/proc/locks` writes it.
fn file_id(meta: &std::fs::Metadata) -> (u32, u32, u64) {
    let dev = meta.dev();
    // The kernel's new_decode_dev.
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    (major as u32, minor as u32, meta.ino())
}

fn locks() -> HashSet<(u32, u32, u64)> {
    std::fs::read_to_string("/proc/locks").map_or_else(|_| HashSet::new(), |t| locked_files(&t))
}

/// Removes the unheld test and bench pin folders older than [`GRACE`], with their
/// pins (see [`stale`]); returns how many. Quiet: where there is no BPF filesystem or no
/// permission, it removes nothing.
pub fn sweep() -> usize {
    let Ok(entries) = std::fs::read_dir(PIN_ROOT) else {
        return 0;
    };
    let held = locks();
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
                locked: held.contains(&file_id(&meta)),
                age: meta.modified().ok()?.elapsed().unwrap_or_default(),
                name,
            })
        })
        .collect();
    stale(&listing)
        .into_iter()
        .filter(|name| {
            let dir = Path::new(PIN_ROOT).join(name);
            // The lock is checked again right before: see remove_own.
            remove_own(&dir);
            !dir.exists()
        })
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
    let Ok(meta) = std::fs::symlink_metadata(dir) else {
        return;
    };
    if !named_ours || !meta.is_dir() || locks().contains(&file_id(&meta)) {
        return;
    }
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            // Pins are files on the BPF filesystem; unlinking one drops the pin only.
            let _ = std::fs::remove_file(entry.path());
        }
    }
    let _ = std::fs::remove_dir(dir);
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

    fn folder(name: &str, locked: bool, age_secs: u64) -> Folder {
        Folder {
            name: name.to_owned(),
            locked,
            age: Duration::from_secs(age_secs),
        }
    }

    /// Only an old, unheld folder with a test or bench prefix goes, with or without
    /// pins; a lock, youth or another name each keep a folder.
    #[test]
    fn the_sweep_takes_only_old_unheld_test_and_bench_folders() {
        let listing = [
            folder("webship-e2e-40001", false, 3600),
            folder("webship-bench-40002", false, 61),
            folder("webship-bench-wan-77-443", false, 600),
            folder("webship-e2e-40003", false, 3600),
            folder("webship-e2e-40004", true, 3600),
            folder("webship-e2e-40005", false, 5),
            folder("webship", false, 3600),
            folder("webship-prod", false, 3600),
            folder("maps.debug", false, 3600),
            folder("xwebship-e2e-40006", false, 3600),
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

    #[test]
    fn locks_are_read_with_their_device_and_inode() {
        let text = "1: FLOCK  ADVISORY  WRITE 4242 00:1f:1234 0 EOF\n\
                    1: -> FLOCK  ADVISORY  WRITE 4243 00:1f:1234 0 EOF\n\
                    2: POSIX  ADVISORY  READ 99 fd:01:77 128 128\n\
                    3: garbage\n";
        let held = locked_files(text);
        assert_eq!(held, HashSet::from([(0, 0x1f, 1234), (0xfd, 1, 77)]));
    }

    /// A folder another process locks is seen locked through `/proc/locks`, as the
    /// sweep and `remove_own` see a live daemon's; unlocked, it is not.
    #[test]
    fn a_held_lock_is_seen() {
        let dir = std::env::temp_dir().join(format!("webship-pins-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let meta = std::fs::metadata(&dir).unwrap();
        assert!(!locks().contains(&file_id(&meta)), "a fresh folder is locked");
        // flock(1) (util-linux) holds a lock on the folder while it runs `sleep`.
        let mut holder = std::process::Command::new("flock")
            .args(["--exclusive", dir.to_str().unwrap(), "sleep", "5"])
            .spawn()
            .expect("flock(1) runs");
        let deadline = std::time::Instant::now() + Duration::from_secs(3);
        let mut seen = false;
        while !seen && std::time::Instant::now() < deadline {
            seen = locks().contains(&file_id(&meta));
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = holder.kill();
        let _ = holder.wait();
        let _ = std::fs::remove_dir(&dir);
        assert!(seen, "a lock on {} is not in /proc/locks", dir.display());
    }

    #[test]
    fn the_pin_folder_is_read_from_a_configuration() {
        let config = "listen = \"127.0.0.1:1\"\n[kernel]\nbpf_pin_dir = \"/sys/fs/bpf/webship-e2e-1\"\n";
        assert_eq!(pin_dir_of(config), Some(Path::new("/sys/fs/bpf/webship-e2e-1")));
        assert_eq!(pin_dir_of("[kernel]\nebpf = \"off\"\n"), None);
    }
}
