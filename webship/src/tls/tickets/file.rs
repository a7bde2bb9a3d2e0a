//! The ticket-key file that hosts behind one load balancer share, so a ticket one
//! host issued resumes on any other: its text format, strict parsing, the mode check,
//! and the `webship ticket-keys new|rotate` edits.
//!
//! ```text
//! webship-ticket-keys v1
//! # key <not_before: unix seconds> <secret: 64 hex digits (32 bytes)>
//! key 1765000000 5f0c…
//! ```
//!
//! Every key in the file decrypts; the key with the latest `not_before` that has
//! passed encrypts. A rotation therefore adds a key whose `not_before` lies far enough
//! ahead for the file to reach every host first: all hosts then start encrypting with
//! it at the same moment, and each can already decrypt what the others issue.

use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::fsutil;

/// The first line of every file: the format and its version.
pub(crate) const HEADER: &str = "webship-ticket-keys v1";
/// The most keys one file may hold (each costs a trial on no lookup, but the set is
/// scanned when it is installed).
pub(crate) const MAX_KEYS: usize = 16;
/// The service account's uid, which may own the file besides root (set before the
/// file is first read, when the daemon runs with `user`).
static SERVICE_UID: OnceLock<u32> = OnceLock::new();
/// A file is read up to this size; anything larger is not a key file.
const MAX_FILE_BYTES: u64 = 16 * 1024;
/// AES-256-GCM's key length.
pub(crate) const SECRET_BYTES: usize = 32;

/// One key as the file holds it.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct FileKey {
    /// Unix seconds from which this key may encrypt.
    pub(crate) not_before: u64,
    pub(crate) secret: [u8; SECRET_BYTES],
}

// Key material never reaches a log line, not even through `{:?}`.
impl fmt::Debug for FileKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FileKey")
            .field("not_before", &self.not_before)
            .finish_non_exhaustive()
    }
}

/// Why a ticket-key file, or a key, was refused.
#[derive(Debug, thiserror::Error)]
pub enum TicketKeyError {
    #[error("ticket key file `{path}`: cannot read it: {source} (fix: point `[tls] ticket_keys` at a file the daemon can read; after the switch to `user`, reloads read it as that account: `chgrp GROUP FILE; chmod 0640 FILE`)")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("ticket key file `{path}`: mode {mode:04o} lets other users read or change it, and its keys decrypt every resumed session (fix: `chmod 0600` it, or 0640 with the service account's group so reloads can read it)")]
    Mode { path: PathBuf, mode: u32 },
    #[error("ticket key file `{path}` is larger than {MAX_FILE_BYTES} bytes: not a key file (fix: generate one with `webship ticket-keys new FILE`)")]
    TooLarge { path: PathBuf },
    #[error("ticket key file `{path}`, line {line}: {reason} (fix: generate the file with `webship ticket-keys new FILE` and change it with `webship ticket-keys rotate FILE`)")]
    Syntax {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    #[error("ticket key file `{path}`: no key is active yet (the earliest `not_before` is {earliest}, now is {now}) (fix: keep the key in use in the file until its successor's `not_before` has passed; check the host's clock)")]
    NoneActive { path: PathBuf, earliest: u64, now: u64 },
    #[error(
        "cannot write ticket key file `{path}`: {source} (fix: run as an account that may write its folder)"
    )]
    Write { path: PathBuf, source: std::io::Error },
    #[error("ticket key file `{path}` is owned by uid {uid}, neither root nor the daemon's service account: that user could replace the keys that decrypt every resumed session (fix: `chown root FILE`, or the service account, keeping mode 0600 or 0640)")]
    Owner { path: PathBuf, uid: u32 },
    #[error("ticket key file `{path}` already exists and is not overwritten (fix: change it with `webship ticket-keys rotate FILE`, or remove it first)")]
    Exists { path: PathBuf },
    #[error("cannot generate a ticket key: the system's random source failed")]
    Random,
}

/// Reads `path`: refuses a file others may read or change, then parses it and
/// checks that one key is active at `now`.
pub(crate) fn read(path: &Path, now: u64) -> Result<Vec<FileKey>, TicketKeyError> {
    let read_error = |source| TicketKeyError::Read {
        path: path.to_owned(),
        source,
    };
    let file = std::fs::File::open(path).map_err(read_error)?;
    check_mode(path, &file)?;
    check_owner(path, &file, &allowed_owners())?;
    let mut text = String::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(read_error)?;
    if text.len() as u64 > MAX_FILE_BYTES {
        return Err(TicketKeyError::TooLarge {
            path: path.to_owned(),
        });
    }
    let keys = parse(&text).map_err(|(line, reason)| TicketKeyError::Syntax {
        path: path.to_owned(),
        line,
        reason,
    })?;
    if !keys.iter().any(|k| k.not_before <= now) {
        let earliest = keys.iter().map(|k| k.not_before).min().unwrap_or_default();
        return Err(TicketKeyError::NoneActive {
            path: path.to_owned(),
            earliest,
            now,
        });
    }
    Ok(keys)
}

/// Group write and any access by others are refused, as ssh refuses a private key
/// others can read; group read is allowed so that a reload, which runs as the service
/// account, can re-read a root-owned file.
#[cfg(unix)]
fn check_mode(path: &Path, file: &std::fs::File) -> Result<(), TicketKeyError> {
    use std::os::unix::fs::PermissionsExt;
    let mode = file
        .metadata()
        .map_err(|source| TicketKeyError::Read {
            path: path.to_owned(),
            source,
        })?
        .permissions()
        .mode()
        & 0o7777;
    if mode & 0o027 != 0 {
        return Err(TicketKeyError::Mode {
            path: path.to_owned(),
            mode,
        });
    }
    Ok(())
}

#[cfg(not(unix))]
fn check_mode(_path: &Path, _file: &std::fs::File) -> Result<(), TicketKeyError> {
    Ok(())
}

/// Records the daemon's service account, whose files are trusted like root's.
pub(crate) fn allow_owner(uid: u32) {
    let _ = SERVICE_UID.set(uid);
}

/// Root, whoever runs this process (an operator's own file for `rotate`) and the
/// service account.
fn allowed_owners() -> Vec<u32> {
    let mut uids = vec![0, rustix::process::geteuid().as_raw()];
    uids.extend(SERVICE_UID.get().copied());
    uids
}

/// Whoever owns the file can rewrite it with keys of their choosing, whatever its mode.
pub(crate) fn check_owner(path: &Path, file: &std::fs::File, allowed: &[u32]) -> Result<(), TicketKeyError> {
    use std::os::unix::fs::MetadataExt;
    let uid = file
        .metadata()
        .map_err(|source| TicketKeyError::Read {
            path: path.to_owned(),
            source,
        })?
        .uid();
    if !allowed.contains(&uid) {
        return Err(TicketKeyError::Owner {
            path: path.to_owned(),
            uid,
        });
    }
    Ok(())
}

/// Parses a file's text: the header, then `key NOT_BEFORE HEX` lines; blank lines and
/// `#` comments anywhere. The error is the 1-based line and what is wrong with it; it
/// never quotes a line, which could hold a secret.
pub(crate) fn parse(text: &str) -> Result<Vec<FileKey>, (usize, String)> {
    let mut header = false;
    let mut keys: Vec<FileKey> = Vec::new();
    let mut last = 0;
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        last = i + 1;
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if !header {
            if line != HEADER {
                return Err((last, format!("the file must start with `{HEADER}`")));
            }
            header = true;
            continue;
        }
        let key = parse_key(line).map_err(|reason| (last, reason))?;
        if keys.len() == MAX_KEYS {
            return Err((last, format!("more than {MAX_KEYS} keys")));
        }
        if keys.iter().any(|k| k.secret == key.secret) {
            return Err((last, "the same secret as an earlier line".into()));
        }
        if keys.iter().any(|k| k.not_before == key.not_before) {
            return Err((
                last,
                "the same `not_before` as an earlier line: which key encrypts would be ambiguous".into(),
            ));
        }
        keys.push(key);
    }
    if !header {
        return Err((last.max(1), format!("empty: no `{HEADER}` header")));
    }
    if keys.is_empty() {
        return Err((last, "no `key` line".into()));
    }
    Ok(keys)
}

fn parse_key(line: &str) -> Result<FileKey, String> {
    let fields: Vec<&str> = line.split_ascii_whitespace().collect();
    let [tag, not_before, secret] = fields.as_slice() else {
        return Err("expected `key NOT_BEFORE SECRET` (three fields)".into());
    };
    if *tag != "key" {
        return Err("expected a line starting with `key`".into());
    }
    let not_before = not_before
        .parse::<u64>()
        .ok()
        .filter(|&t| t <= i64::MAX as u64)
        .ok_or("`not_before` is not a time in unix seconds")?;
    let secret = decode_hex(secret).ok_or_else(|| {
        format!(
            "the secret is not {} hex digits ({SECRET_BYTES} bytes)",
            SECRET_BYTES * 2
        )
    })?;
    Ok(FileKey { not_before, secret })
}

fn decode_hex(text: &str) -> Option<[u8; SECRET_BYTES]> {
    let bytes = text.as_bytes();
    if bytes.len() != SECRET_BYTES * 2 {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut out = [0u8; SECRET_BYTES];
    for (o, pair) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(out)
}

/// The file's text for `keys`, newest first.
pub(crate) fn render(keys: &[FileKey]) -> String {
    let mut sorted: Vec<&FileKey> = keys.iter().collect();
    sorted.sort_by_key(|k| std::cmp::Reverse(k.not_before));
    let mut text = format!(
        "{HEADER}\n# key <not_before: unix seconds> <secret: {} hex digits>; the latest key whose\n\
         # not_before has passed encrypts, every key decrypts. Keep this file secret (mode 0600\n\
         # or 0640) and identical on every host; change it with `webship ticket-keys rotate`.\n",
        SECRET_BYTES * 2
    );
    for k in sorted {
        text.push_str(&format!("key {} ", k.not_before));
        for b in k.secret {
            text.push_str(&format!("{b:02x}"));
        }
        text.push('\n');
    }
    text
}

/// A fresh key from the system's random source.
pub(crate) fn fresh(not_before: u64) -> Result<FileKey, TicketKeyError> {
    let mut secret = [0u8; SECRET_BYTES];
    aws_lc_rs::rand::fill(&mut secret).map_err(|_| TicketKeyError::Random)?;
    Ok(FileKey { not_before, secret })
}

/// `keys` after a rotation at `now`: a new key that starts encrypting `activate_in`
/// seconds from now (after any key already waiting), and without the keys whose
/// successor has encrypted for longer than a ticket lives (no ticket they issued is
/// still valid). At most [`MAX_KEYS`] stay, the newest.
pub(crate) fn rotate(
    mut keys: Vec<FileKey>,
    now: u64,
    activate_in: u64,
    lifetime: u64,
) -> Result<Vec<FileKey>, TicketKeyError> {
    let latest = keys.iter().map(|k| k.not_before).max().unwrap_or(0);
    let not_before = now.saturating_add(activate_in).max(latest.saturating_add(1));
    keys.push(fresh(not_before)?);
    keys.sort_by_key(|k| std::cmp::Reverse(k.not_before));
    // Newest first: a key is retired once the key after it began before now - lifetime.
    let horizon = now.saturating_sub(lifetime);
    let mut successor_start: Option<u64> = None;
    keys.retain(|k| {
        let keep = successor_start.is_none_or(|s| s > horizon);
        successor_start = Some(k.not_before);
        keep
    });
    keys.truncate(MAX_KEYS);
    Ok(keys)
}

/// Replaces `path` with `text` atomically, keeping the old file's mode and owner so
/// the service account can still read it. Through a symlink the link stays and its
/// target is replaced (the link is the operator's layout).
pub(crate) fn replace(path: &Path, text: &str) -> Result<(), TicketKeyError> {
    use std::os::unix::fs::MetadataExt;
    let write_error = |source| TicketKeyError::Write {
        path: path.to_owned(),
        source,
    };
    let target = std::fs::canonicalize(path).map_err(write_error)?;
    let old = std::fs::metadata(&target).map_err(write_error)?;
    // Only root can give a file away; anyone else keeps owning what they write.
    let owner = rustix::process::geteuid()
        .is_root()
        .then(|| (old.uid(), old.gid()));
    fsutil::write_atomic(&target, text.as_bytes(), old.mode() & 0o640, owner).map_err(write_error)
}

/// Creates `path` with `text`, mode 0600 from the start, refusing to overwrite.
pub(crate) fn create(path: &Path, text: &str) -> Result<(), TicketKeyError> {
    fsutil::write_new(path, text.as_bytes(), 0o600).map_err(|source| {
        if source.kind() == std::io::ErrorKind::AlreadyExists {
            TicketKeyError::Exists {
                path: path.to_owned(),
            }
        } else {
            TicketKeyError::Write {
                path: path.to_owned(),
                source,
            }
        }
    })
}
