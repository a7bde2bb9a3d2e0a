//! The daemon's few file-system guarantees, written once: telling a changed file from
//! the one read ([`Stamp`]), replacing a file whole ([`write_atomic`]) and handing a
//! folder to the service account without following a planted symlink
//! ([`chown_dir_nofollow`], [`give_tree_nofollow`]). Certificates, OCSP answers, ticket keys and ACME state
//! all go through here, so they share one set of crash and symlink rules.
//!
//! Everything here blocks on the disk: async callers run it under
//! `tokio::task::spawn_blocking`.

use std::io::{self, Write};
use std::os::unix::ffi::OsStrExt;
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

/// Gives `dir`, and what lies up to `levels` folders below it, to `uid:gid`.
///
/// The account may already own the tree (any restart after the first) and act
/// while root walks it: swap a folder for a symlink, or plant a hard link to a file
/// of root's. So the walk is by descriptor (each entry opened `O_PATH | O_NOFOLLOW`
/// in its folder's descriptor, a folder re-opened through its own, every chown
/// through the entry's descriptor: no path is resolved twice), and ownership decides
/// what is touched: in a folder only root can write (root's, no group or other
/// write), every folder and regular file is given; in a folder the account can
/// write, only what already is the account's (a file owned by anyone else there may
/// be a planted link: it is left as it is, with a warning). Symlinks, FIFOs,
/// sockets and devices are never given. Children go before their folder, so a
/// folder of root's is still root's while its entries are given.
pub(crate) fn give_tree_nofollow(dir: &Path, uid: u32, gid: u32, levels: usize) -> io::Result<()> {
    use rustix::fs::{Mode, OFlags};
    let top = rustix::fs::open(
        dir,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    // The configured folder itself is the operator's choice: trusted.
    Heir { uid, gid }.give(&top, dir, true, levels)
}

/// Who [`give_tree_nofollow`] hands a tree to.
struct Heir {
    uid: u32,
    gid: u32,
}

impl Heir {
    /// Gives `entry` (found in a folder only root can write when `trusted`) and, if
    /// it is a folder, what it holds `levels` deep.
    fn give(
        &self,
        entry: &std::os::fd::OwnedFd,
        path: &Path,
        trusted: bool,
        levels: usize,
    ) -> io::Result<()> {
        use rustix::fs::{AtFlags, FileType, Mode, OFlags};
        let st = rustix::fs::fstat(entry)?;
        if !trusted && st.st_uid != self.uid {
            tracing::warn!(
                path = %path.display(),
                owner = st.st_uid,
                "not handed to the service account: owned by another user in a folder that account can write (a link it planted?); left as it is"
            );
            return Ok(());
        }
        match FileType::from_raw_mode(st.st_mode) {
            FileType::Directory if levels > 0 => {
                let root_only = st.st_uid == 0 && st.st_mode & 0o022 == 0;
                let folder = rustix::fs::openat(
                    entry,
                    c".",
                    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
                    Mode::empty(),
                )?;
                for item in rustix::fs::Dir::read_from(&folder)? {
                    let item = item?;
                    let name = item.file_name();
                    if name == c"." || name == c".." {
                        continue;
                    }
                    let flags = OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC;
                    let child = match rustix::fs::openat(&folder, name, flags, Mode::empty()) {
                        Ok(child) => child,
                        // Gone meanwhile.
                        Err(rustix::io::Errno::NOENT) => continue,
                        Err(e) => return Err(e.into()),
                    };
                    let name = std::ffi::OsStr::from_bytes(name.to_bytes());
                    self.give(&child, &path.join(name), root_only, levels - 1)?;
                }
            }
            FileType::Directory | FileType::RegularFile => {}
            _ => return Ok(()),
        }
        if st.st_uid != self.uid || st.st_gid != self.gid {
            let (uid, gid) = (
                rustix::fs::Uid::from_raw(self.uid),
                rustix::fs::Gid::from_raw(self.gid),
            );
            rustix::fs::chownat(entry, c"", Some(uid), Some(gid), AtFlags::EMPTY_PATH)?;
        }
        Ok(())
    }
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

    /// A hard link the account plants to a file of root's (possible for any file with
    /// `fs.protected_hardlinks = 0`) is not chowned: in a folder the account can
    /// write, only what is already the account's is touched.
    #[test]
    fn a_hard_link_to_roots_file_in_the_accounts_folder_is_left_alone() {
        let tmp = tempfile::tempdir().unwrap();
        if std::fs::metadata(tmp.path()).unwrap().uid() != 0 {
            eprintln!("skipped: needs root to chown");
            return;
        }
        let (uid, gid) = (65534, 65534);
        let storage = tmp.path().join("storage");
        std::fs::create_dir_all(storage.join("acct")).unwrap();
        std::fs::write(storage.join("acct/key"), b"k").unwrap();
        // The first start: root made all of it, and hands it over whole.
        give_tree_nofollow(&storage, uid, gid, 3).unwrap();
        assert_eq!(std::fs::metadata(storage.join("acct/key")).unwrap().uid(), uid);
        // Then the account links a file of root's into its folder.
        std::fs::write(tmp.path().join("secret"), b"root's").unwrap();
        std::fs::hard_link(tmp.path().join("secret"), storage.join("acct/x")).unwrap();
        std::fs::hard_link(tmp.path().join("secret"), storage.join("y")).unwrap();
        let _ = give_tree_nofollow(&storage, uid, gid, 3);
        assert_eq!(std::fs::metadata(tmp.path().join("secret")).unwrap().uid(), 0);
    }
}
