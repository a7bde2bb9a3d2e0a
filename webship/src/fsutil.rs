//! The daemon's few file-system guarantees, written once: telling a changed file from
//! the one read ([`Stamp`]), replacing a file whole ([`write_atomic`]) and handing a
//! folder to the service account without following a planted symlink
//! ([`chown_dir_nofollow`], [`give_tree_nofollow`]). Certificates, OCSP answers, ticket keys and ACME state
//! all go through here, so they share one set of crash and symlink rules.
//!
//! Everything here blocks on the disk: async callers run it under
//! `tokio::task::spawn_blocking`.

use std::io::{self, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// What `stat` says of one file, following symlinks; a change in any field is a new
/// file (a rename over it, a rewrite, a symlink moved to a new target).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
}

impl Stamp {
    /// `None` when the file cannot be looked at (missing for a moment, unreadable).
    pub(crate) fn of(path: &Path) -> Option<Self> {
        let m = std::fs::metadata(path).ok()?;
        Some(Self {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime: (m.mtime(), m.mtime_nsec()),
        })
    }
}

/// Makes temporary names unique within the process (the pid makes them unique
/// between processes: during a takeover the old and the new daemon both write).
static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);
/// A name taken (a leftover of a crashed process that had the same pid) is skipped;
/// this many in a row means something else is wrong.
const TMP_ATTEMPTS: usize = 16;

/// Replaces `path` with `data` whole: readers see the old file or the new one, never a
/// part, and after a crash the file is one of the two. The new file has exactly `mode`
/// from its creation (never wider, whatever the umask) and, when given, `owner`.
///
/// The temporary file beside it is created with `O_EXCL | O_NOFOLLOW` under a name
/// unique to this process and call, so a symlink planted there is not followed and a
/// leftover from a crashed run blocks nothing. A symlink at `path` itself is replaced
/// by the file (resolve it first to write through it). The folder must exist.
pub(crate) fn write_atomic(path: &Path, data: &[u8], mode: u32, owner: Option<(u32, u32)>) -> io::Result<()> {
    let folder = folder_of(path)?;
    let (tmp, mut file) = create_temp(path)?;
    let written = (|| {
        // The creation mode went through the umask; this sets it exactly.
        file.set_permissions(std::fs::Permissions::from_mode(mode))?;
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::fchown(&file, Some(uid), Some(gid))?;
        }
        file.write_all(data)?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)?;
        // The rename itself survives a crash once the folder is synced.
        std::fs::File::open(folder)?.sync_all()
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Creates `path` with `data` and `mode`, refusing to replace anything already there
/// (a file, a symlink): for secrets an operator asks for by name.
pub(crate) fn write_new(path: &Path, data: &[u8], mode: u32) -> io::Result<()> {
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode & 0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    let written = (|| {
        file.set_permissions(std::fs::Permissions::from_mode(mode))?;
        file.write_all(data)?;
        file.sync_all()?;
        std::fs::File::open(folder_of(path)?)?.sync_all()
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(path);
    }
    written
}

fn folder_of(path: &Path) -> io::Result<&Path> {
    match path.parent() {
        Some(p) if p.as_os_str().is_empty() => Ok(Path::new(".")),
        Some(p) => Ok(p),
        None => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "a file path is needed, not a folder",
        )),
    }
}

/// A new temporary file beside `path`, created owner-only until the caller sets the
/// final mode.
fn create_temp(path: &Path) -> io::Result<(PathBuf, std::fs::File)> {
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "a file path is needed"))?;
    let mut last = None;
    for _ in 0..TMP_ATTEMPTS {
        let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        let mut tmp_name = std::ffi::OsString::from(".");
        tmp_name.push(name);
        tmp_name.push(format!(".{}.{n}.tmp", std::process::id()));
        let tmp = path.with_file_name(tmp_name);
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)
        {
            Ok(file) => return Ok((tmp, file)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| io::ErrorKind::AlreadyExists.into()))
}

/// Gives `dir` to `uid:gid` through a descriptor opened with `O_NOFOLLOW |
/// O_DIRECTORY`: a symlink put in its place (by the account that owns the folder
/// above) is refused rather than followed, so root never chowns what it points at.
pub(crate) fn chown_dir_nofollow(dir: &Path, uid: u32, gid: u32) -> io::Result<()> {
    let fd = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_DIRECTORY)
        .open(dir)?;
    std::os::unix::fs::fchown(&fd, Some(uid), Some(gid))
}

/// Gives `dir`, and what lies up to `levels` folders below it, to `uid:gid`, walking
/// by descriptor. The account that will own the tree may already own it (a restart)
/// and swap any folder in it for a symlink while root walks: so every entry is opened
/// with `O_NOFOLLOW` through its folder's descriptor (`/proc/self/fd/N` names the
/// folder the descriptor holds, whatever its old path names by now) and chowned
/// through its own descriptor. Symlinks are left as they are, never followed;
/// entries that vanish meanwhile, and sockets, are skipped.
pub(crate) fn give_tree_nofollow(dir: &Path, uid: u32, gid: u32, levels: usize) -> io::Result<()> {
    give_below(open_nofollow(dir, true)?, uid, gid, levels)
}

fn open_nofollow(path: &Path, dir: bool) -> io::Result<std::fs::File> {
    let mut flags = libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY;
    if dir {
        flags |= libc::O_DIRECTORY;
    }
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(flags)
        .open(path)
}

fn give_below(folder: std::fs::File, uid: u32, gid: u32, levels: usize) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    std::os::unix::fs::fchown(&folder, Some(uid), Some(gid))?;
    if levels == 0 {
        return Ok(());
    }
    let through = PathBuf::from(format!("/proc/self/fd/{}", folder.as_raw_fd()));
    for entry in std::fs::read_dir(&through)? {
        let child = match open_nofollow(&through.join(entry?.file_name()), false) {
            Ok(child) => child,
            Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOENT | libc::ENXIO)) => continue,
            Err(e) => return Err(e),
        };
        if child.metadata()?.is_dir() {
            give_below(child, uid, gid, levels - 1)?;
        } else {
            std::os::unix::fs::fchown(&child, Some(uid), Some(gid))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    #[test]
    fn write_atomic_replaces_whole_with_the_exact_mode() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        write_atomic(&path, b"one", 0o640, None).unwrap();
        write_atomic(&path, b"two", 0o600, None).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o600);
        // No temporary file is left behind.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn write_atomic_is_not_blocked_by_leftovers_nor_follows_planted_links() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        // Every name the next calls could pick is taken by a symlink to the victim.
        let next = TMP_COUNTER.load(Ordering::Relaxed);
        for n in next..next + 4 {
            let tmp = dir.path().join(format!(".f.{}.{n}.tmp", std::process::id()));
            std::os::unix::fs::symlink(&victim, tmp).unwrap();
        }
        for name in ["f.new", "f.tmp", ".f.tmp"] {
            std::fs::write(dir.path().join(name), b"stale").unwrap();
        }
        write_atomic(&path, b"new", 0o600, None).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
    }

    #[test]
    fn write_new_refuses_to_replace() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k");
        write_new(&path, b"a", 0o600).unwrap();
        let e = write_new(&path, b"b", 0o600).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
        assert_eq!(std::fs::read(&path).unwrap(), b"a");
        let link = dir.path().join("l");
        std::os::unix::fs::symlink(dir.path().join("absent"), &link).unwrap();
        assert!(write_new(&link, b"c", 0o600).is_err());
        assert!(!dir.path().join("absent").exists());
    }

    #[test]
    fn chown_dir_nofollow_refuses_a_symlink() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real");
        std::fs::create_dir(&real).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let uid = std::fs::metadata(&real).unwrap().uid();
        let gid = std::fs::metadata(&real).unwrap().gid();
        assert!(chown_dir_nofollow(&link, uid, gid).is_err());
        chown_dir_nofollow(&real, uid, gid).unwrap();
    }

    #[test]
    fn stamp_sees_a_rewrite() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        assert_eq!(Stamp::of(&path), None);
        std::fs::write(&path, b"a").unwrap();
        let first = Stamp::of(&path).unwrap();
        write_atomic(&path, b"bb", 0o600, None).unwrap();
        assert_ne!(Stamp::of(&path), Some(first));
    }

    #[test]
    fn give_tree_nofollow_gives_the_levels_asked_and_leaves_links() {
        let tmp = tempfile::tempdir().unwrap();
        let me = std::fs::metadata(tmp.path()).unwrap();
        if me.uid() != 0 {
            eprintln!("skipped: needs root to chown");
            return;
        }
        let root = tmp.path().join("store");
        std::fs::create_dir_all(root.join("a/b/c")).unwrap();
        std::fs::write(root.join("a/key"), b"k").unwrap();
        std::fs::write(root.join("a/b/c/deep"), b"d").unwrap();
        std::fs::write(tmp.path().join("target"), b"t").unwrap();
        std::os::unix::fs::symlink(tmp.path().join("target"), root.join("a/link")).unwrap();
        give_tree_nofollow(&root, 65534, 65534, 2).unwrap();
        let owner = |p: &str| std::fs::symlink_metadata(root.join(p)).unwrap().uid();
        assert_eq!(owner(""), 65534);
        assert_eq!(owner("a"), 65534);
        assert_eq!(owner("a/key"), 65534);
        assert_eq!(owner("a/b"), 65534, "the second level is given");
        assert_eq!(owner("a/b/c"), 0, "nothing below the levels asked");
        assert_eq!(owner("a/link"), 0, "a link is left as it is");
        assert_eq!(std::fs::metadata(tmp.path().join("target")).unwrap().uid(), 0);
        let link = tmp.path().join("linked-store");
        std::os::unix::fs::symlink(&root, &link).unwrap();
        assert!(
            give_tree_nofollow(&link, 65534, 65534, 1).is_err(),
            "the top folder may not be a link"
        );
    }

    /// The service account owns the storage folder, so while root hands it over at
    /// start the account may swap a subfolder for a symlink to any folder of root's.
    /// Root must never chown what such a link points at.
    #[test]
    fn handing_over_storage_never_chowns_through_a_swapped_symlink() {
        let tmp = tempfile::tempdir().unwrap();
        if std::fs::metadata(tmp.path()).unwrap().uid() != 0 {
            eprintln!("skipped: needs root to chown");
            return;
        }
        let storage = tmp.path().join("storage");
        let outside = tmp.path().join("outside");
        std::fs::create_dir_all(storage.join("real")).unwrap();
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("secret"), b"root's").unwrap();
        std::fs::write(storage.join("real").join("secret"), b"decoy").unwrap();
        std::os::unix::fs::symlink(&outside, storage.join("link")).unwrap();
        std::fs::rename(storage.join("real"), storage.join("sub")).unwrap();
        let (uid, gid) = (65534, 65534);

        let stop = Arc::new(AtomicBool::new(false));
        let attacker = {
            let (stop, storage) = (stop.clone(), storage.clone());
            std::thread::spawn(move || {
                let (sub, real, link) = (storage.join("sub"), storage.join("real"), storage.join("link"));
                let mut flips = 0u64;
                while !stop.load(Ordering::Relaxed) && flips < 50_000_000 {
                    // sub is the real folder, then the link, then the folder again.
                    let _ = std::fs::rename(&sub, &real);
                    let _ = std::fs::rename(&link, &sub);
                    let _ = std::fs::rename(&sub, &link);
                    let _ = std::fs::rename(&real, &sub);
                    flips += 1;
                }
            })
        };
        let started = Instant::now();
        let mut walks = 0;
        while started.elapsed() < Duration::from_secs(3) && walks < 200_000 {
            let _ = give_tree_nofollow(&storage, uid, gid, 3);
            walks += 1;
            if std::fs::metadata(outside.join("secret")).unwrap().uid() == uid {
                break;
            }
        }
        stop.store(true, Ordering::Relaxed);
        attacker.join().unwrap();
        let owner = std::fs::metadata(outside.join("secret")).unwrap().uid();
        assert_eq!(
            owner, 0,
            "root chowned a file outside the storage folder after {walks} walks"
        );
    }
}
