//! TLS 1.3 session tickets: the keys that seal the resumption state rustls hands out
//! (stateless resumption), shared by every site's TCP configuration and the QUIC one.
//!
//! A ticket is `key id (8) ‖ nonce (12) ‖ AES-256-GCM(state) ‖ tag (16)`; the id picks
//! the key, so the newest key encrypts while older ones still decrypt. The keys come
//! from one of two sources:
//! - generated in this process (the default): a new key every [`ROTATION_SECS`], the
//!   previous one kept to decrypt, so a ticket resumes for its whole lifetime on this
//!   process, across reloads, but not on another host or after a restart;
//! - the file `[tls] ticket_keys` ([`file`]), identical on every host behind a load
//!   balancer: re-read at each reload and when it changes on disk (polled every
//!   [`POLL`]), a refused file leaving the current keys in place.

pub(crate) mod file;

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};

use crate::fsutil::Stamp;
use crate::shutdown::Shutdown;
use file::FileKey;
pub use file::TicketKeyError;

/// How long a client may offer a ticket (announced in each ticket; RFC 8446 allows up
/// to 7 days). A key must therefore decrypt for this long after it last encrypted.
pub(crate) const TICKET_LIFETIME_SECS: u32 = 12 * 3600;
/// How often a generated key set takes a new encrypting key. The previous key stays
/// for one more period, which is the ticket lifetime: no valid ticket is orphaned.
pub(crate) const ROTATION_SECS: u64 = TICKET_LIFETIME_SECS as u64;
/// How often the key file's metadata is compared with what was last read.
pub(crate) const POLL: Duration = Duration::from_secs(2);
const ID_BYTES: usize = 8;
const TAG_BYTES: usize = 16;
/// rustls' resumption state is a few hundred bytes; anything much larger offered as a
/// ticket is not one of ours and is not decrypted.
const MAX_TICKET_BYTES: usize = 8 * 1024;

/// The seconds since the epoch (0 on a clock set before 1970).
fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// One usable key: its id in each ticket, when it may start encrypting, its cipher.
struct Key {
    id: [u8; ID_BYTES],
    not_before: u64,
    aead: LessSafeKey,
}

impl Key {
    fn new(k: &FileKey) -> Self {
        // The id is a digest of the secret: the file names keys without a second field,
        // and the same secret has the same id on every host.
        let mut input = b"webship ticket key id\0".to_vec();
        input.extend_from_slice(&k.secret);
        let digest = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, &input);
        let mut id = [0u8; ID_BYTES];
        id.copy_from_slice(&digest.as_ref()[..ID_BYTES]);
        let unbound = UnboundKey::new(&AES_256_GCM, &k.secret).expect("AES-256-GCM takes a 32-byte key");
        Self {
            id,
            not_before: k.not_before,
            aead: LessSafeKey::new(unbound),
        }
    }
}

/// Keys newest first by `not_before`.
struct KeySet(Vec<Key>);

impl KeySet {
    fn from_file(keys: &[FileKey]) -> Self {
        debug_assert!(keys.len() <= file::MAX_KEYS);
        let mut set: Vec<Key> = keys.iter().map(Key::new).collect();
        set.sort_by_key(|k| std::cmp::Reverse(k.not_before));
        Self(set)
    }

    fn generated(now: u64) -> Result<Self, TicketKeyError> {
        Ok(Self(vec![Key::new(&file::fresh(now)?)]))
    }

    fn encrypting(&self, now: u64) -> Option<&Key> {
        self.0.iter().find(|k| k.not_before <= now)
    }

    fn by_id(&self, id: &[u8]) -> Option<&Key> {
        self.0.iter().find(|k| k.id == id)
    }
}

/// Where the keys come from; for a file, what its metadata was when last read.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Source {
    Generated,
    File { path: PathBuf, stamp: Option<Stamp> },
}

struct State {
    set: KeySet,
    source: Source,
}

/// The process's ticket keys ([`rustls::server::ProducesTickets`]), replaced whole
/// when the file changes or a reload names another source.
pub(crate) struct Tickets {
    state: RwLock<State>,
}

impl std::fmt::Debug for Tickets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.state.read().unwrap_or_else(|e| e.into_inner());
        f.debug_struct("Tickets")
            .field("keys", &state.set.0.len())
            .field("source", &state.source)
            .finish()
    }
}

/// A key set read and checked ahead of a reload, installed once the reload commits.
pub(crate) struct Prepared {
    /// `None`: keep the generated keys this process already has.
    set: Option<KeySet>,
    source: Source,
}

impl Tickets {
    /// The keys of `file`, or a generated set without one.
    pub(crate) fn new(file: Option<&Path>) -> Result<Self, TicketKeyError> {
        let now = unix_now();
        let (set, source) = match file {
            Some(path) => read_source(path, now)?,
            None => (KeySet::generated(now)?, Source::Generated),
        };
        Ok(Self {
            state: RwLock::new(State { set, source }),
        })
    }

    /// Reads what a reload names: the file is read again even if unchanged (a reload is
    /// how an operator says "take the file now"); generated keys stay generated, not
    /// re-keyed, so tickets issued before the reload still resume.
    pub(crate) fn prepare(&self, file: Option<&Path>) -> Result<Prepared, TicketKeyError> {
        match file {
            Some(path) => {
                let (set, source) = read_source(path, unix_now())?;
                Ok(Prepared {
                    set: Some(set),
                    source,
                })
            }
            None if self.read().source == Source::Generated => Ok(Prepared {
                set: None,
                source: Source::Generated,
            }),
            None => Ok(Prepared {
                set: Some(KeySet::generated(unix_now())?),
                source: Source::Generated,
            }),
        }
    }

    pub(crate) fn install(&self, prepared: Prepared) {
        let mut state = self.state.write().unwrap_or_else(|e| e.into_inner());
        if let Some(set) = prepared.set {
            state.set = set;
        }
        state.source = prepared.source;
    }

    /// Re-reads the key file whenever its metadata changes, until shutdown. A file that
    /// is refused (or gone) is reported once per change; the keys in use stay.
    pub(crate) async fn watch(self: Arc<Self>, mut shutdown: Shutdown) {
        // Started once the daemon runs as its service account: the file was read as
        // root, and whether this account can read it decides whether reloads can.
        if let Source::File { path, .. } = &self.read().source {
            if let Err(e) = std::fs::File::open(path) {
                tracing::warn!(path = %path.display(), error = %e, "the service account cannot read the ticket key file: reloads will be refused and changes not taken (make it readable by the account's group: chmod 0640, chgrp)");
            }
        }
        loop {
            tokio::select! {
                () = shutdown.requested() => return,
                () = tokio::time::sleep(POLL) => {}
            }
            let Source::File { path, stamp: seen } = self.read().source.clone() else {
                continue;
            };
            let now_stamp = Stamp::of(&path);
            if now_stamp == seen {
                continue;
            }
            let read = tokio::task::spawn_blocking(move || read_source(&path, unix_now())).await;
            match read {
                Ok(Ok((set, source))) => {
                    let keys = set.0.len();
                    self.install(Prepared {
                        set: Some(set),
                        source,
                    });
                    tracing::info!(keys, "ticket keys re-read: the key file changed");
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "the changed ticket key file was refused; the keys in use stay");
                    self.remember(now_stamp);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "the ticket key file check failed; the keys in use stay")
                }
            }
        }
    }

    /// Records `stamp` as seen, so a refused file is not re-read until it changes again.
    fn remember(&self, new: Option<Stamp>) {
        let mut state = self.state.write().unwrap_or_else(|e| e.into_inner());
        if let Source::File { stamp, .. } = &mut state.source {
            *stamp = new;
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    /// A generated set takes a new encrypting key once the current one has encrypted
    /// for [`ROTATION_SECS`], keeping the previous one to decrypt.
    fn rotate_if_due(&self, now: u64) {
        let due = |state: &State| {
            state.source == Source::Generated
                && state
                    .set
                    .encrypting(now)
                    .is_none_or(|k| k.not_before.saturating_add(ROTATION_SECS) <= now)
        };
        if !due(&self.read()) {
            return;
        }
        let mut state = self.state.write().unwrap_or_else(|e| e.into_inner());
        if !due(&state) {
            return;
        }
        match file::fresh(now) {
            Ok(key) => {
                state.set.0.insert(0, Key::new(&key));
                state.set.0.truncate(2);
            }
            // Keep encrypting with the old key; the next ticket tries again.
            Err(e) => tracing::warn!(error = %e, "cannot rotate the ticket key; the current one stays"),
        }
    }

    fn seal(&self, plain: &[u8], now: u64) -> Option<Vec<u8>> {
        self.rotate_if_due(now);
        let state = self.read();
        let key = state.set.encrypting(now)?;
        let mut nonce = [0u8; NONCE_LEN];
        aws_lc_rs::rand::fill(&mut nonce).ok()?;
        let mut out = Vec::with_capacity(ID_BYTES + NONCE_LEN + plain.len() + TAG_BYTES);
        out.extend_from_slice(&key.id);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(plain);
        let mut body = out.split_off(ID_BYTES + NONCE_LEN);
        key.aead
            .seal_in_place_append_tag(Nonce::assume_unique_for_key(nonce), Aad::from(key.id), &mut body)
            .ok()?;
        out.append(&mut body);
        Some(out)
    }

    fn open(&self, ticket: &[u8]) -> Option<Vec<u8>> {
        if ticket.len() < ID_BYTES + NONCE_LEN + TAG_BYTES || ticket.len() > MAX_TICKET_BYTES {
            return None;
        }
        let (id, rest) = ticket.split_at(ID_BYTES);
        let (nonce, sealed) = rest.split_at(NONCE_LEN);
        let state = self.read();
        let key = state.set.by_id(id)?;
        let nonce = Nonce::try_assume_unique_for_key(nonce).ok()?;
        let mut body = sealed.to_vec();
        let plain_len = key
            .aead
            .open_in_place(nonce, Aad::from(id), &mut body)
            .ok()?
            .len();
        body.truncate(plain_len);
        Some(body)
    }
}

fn read_source(path: &Path, now: u64) -> Result<(KeySet, Source), TicketKeyError> {
    // The stamp is taken before the read: a change racing the read is seen next poll.
    let seen = Stamp::of(path);
    let keys = file::read(path, now)?;
    Ok((
        KeySet::from_file(&keys),
        Source::File {
            path: path.to_owned(),
            stamp: seen,
        },
    ))
}

impl rustls::server::ProducesTickets for Tickets {
    fn enabled(&self) -> bool {
        true
    }

    fn lifetime(&self) -> u32 {
        TICKET_LIFETIME_SECS
    }

    fn encrypt(&self, plain: &[u8]) -> Option<Vec<u8>> {
        self.seal(plain, unix_now())
    }

    fn decrypt(&self, cipher: &[u8]) -> Option<Vec<u8>> {
        self.open(cipher)
    }
}

/// `webship ticket-keys new`: a file with one key, encrypting from now.
pub fn new_file() -> Result<String, TicketKeyError> {
    Ok(file::render(&[file::fresh(unix_now())?]))
}

/// `webship ticket-keys new FILE`: writes a new file with one key, mode 0600 from the
/// start (no moment when others may read it), never over an existing file.
pub fn create_file(path: &Path) -> Result<(), TicketKeyError> {
    file::create(path, &new_file()?)
}

/// Trusts key files owned by the service account `uid` (besides root's).
pub(crate) fn allow_owner(uid: u32) {
    file::allow_owner(uid);
}

/// `webship ticket-keys rotate FILE`: adds a key that starts encrypting in
/// `activate_in` seconds, drops the retired ones, and replaces the file atomically.
/// Returns the new key's `not_before` and how many keys the file holds.
pub fn rotate_file(path: &Path, activate_in: u64) -> Result<(u64, usize), TicketKeyError> {
    let now = unix_now();
    // A file whose keys are all still waiting is rotated too: it is the operator's.
    let keys = match file::read(path, now) {
        Err(TicketKeyError::NoneActive { .. }) => file::read(path, u64::MAX)?,
        other => other?,
    };
    let keys = file::rotate(keys, now, activate_in, u64::from(TICKET_LIFETIME_SECS))?;
    file::replace(path, &file::render(&keys))?;
    let newest = keys.iter().map(|k| k.not_before).max().unwrap_or(now);
    Ok((newest, keys.len()))
}

#[cfg(test)]
mod tests;
