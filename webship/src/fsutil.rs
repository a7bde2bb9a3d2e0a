//! The daemon's few file-system guarantees, written once: telling a changed file from
//! the one read ([`Stamp`]), replacing a file whole ([`write_atomic`]) and handing a
//! folder to the service account without following a planted symlink
//! ([`chown_dir_nofollow`]). Certificates, OCSP answers, ticket keys and ACME state
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
