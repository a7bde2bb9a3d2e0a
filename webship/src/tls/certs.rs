//! The certificates sites serve, as one process-wide table of swappable slots.
//!
//! Every site's handshakes read its certificate from a [`CertSlot`]; whatever renews a
//! certificate (a reload, a changed file on disk, ACME, an OCSP refresh) builds a
//! complete [`CertifiedKey`], checks it, and swaps it in with [`CertSlot::set`]. Open
//! connections keep the key they shook hands with; the next handshake sees the new one.
//!
//! A slot also carries the site's OCSP staple ([`CertSlot::staple`]): whoever renews
//! the certificate need not know about OCSP, since [`CertSlot::set`] keeps the staple
//! only while the leaf it was fetched for is still the one served.
//!
//! Slots are kept by site name and by where the certificate comes from
//! ([`SlotKey`]), so a reload that keeps a site's source keeps its slot (an ACME
//! certificate obtained before the reload is served after it), and a reload that
//! changes the source starts a fresh one.
//!
//! The tasks that keep slots filled or stapled (ACME, OCSP) sleep until their next
//! due time; what changes a slot or the table wakes them ([`CertSlot::changes`],
//! [`Certificates::changes`]), so they need not poll.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::SystemTime;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::sign::CertifiedKey;

use super::TlsError;

/// Where a site's certificate comes from, as far as keeping its slot goes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Origin {
    /// A PEM certificate chain and key read from these files.
    Files { cert: PathBuf, key: PathBuf },
    /// Generated at start (the built-in default site).
    SelfSigned,
    /// Obtained and renewed through ACME (`crate::acme` keeps the slot filled).
    Acme(crate::config::AcmeSource),
}

/// A slot's identity: the site's name and the origin of its certificate.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct SlotKey {
    pub(crate) site: String,
    pub(crate) origin: Origin,
}

#[cfg(test)]
impl SlotKey {
    /// A self-signed site's key, as the tests name slots.
    pub(crate) fn self_signed(site: &str) -> Self {
        Self {
            site: site.into(),
            origin: Origin::SelfSigned,
        }
    }
}

/// One site's certificate as served now. Empty until a certificate is installed: a
/// handshake for a site whose slot is empty fails rather than showing another site's
/// certificate.
#[derive(Debug)]
pub(crate) struct CertSlot {
    current: RwLock<Option<Arc<CertifiedKey>>>,
    /// The OCSP response stapled to `current`, with the leaf it answers for. Written
    /// under this lock only, so a renewal and a staple never interleave.
    staple: Mutex<Option<Staple>>,
    /// `ocsp_stapling` of the site (on unless the configuration turns it off).
    stapling: AtomicBool,
    /// [`StapleState`] as a byte, for the metrics.
    state: AtomicU8,
    /// When the stapled response's `nextUpdate` passes, in seconds since the epoch
    /// ([`NO_EXPIRY`]: no staple, or one without `nextUpdate`).
    staple_expires: AtomicU64,
    /// Bumped when the certificate or the stapling setting changes (not by a staple).
    changed: tokio::sync::watch::Sender<u64>,
}

#[derive(Debug)]
struct Staple {
    leaf: CertificateDer<'static>,
    /// `None` once the responder said something not to staple (revoked).
    response: Option<Vec<u8>>,
}

/// What the OCSP responder last said about the certificate a slot serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum StapleState {
    /// No staple: stapling is off, the certificate names no responder, or no valid
    /// response is at hand.
    None = 0,
    /// A valid `good` response is stapled.
    Good = 1,
    /// The responder says the certificate is revoked; nothing is stapled.
    Revoked = 2,
}

impl StapleState {
    pub(crate) const ALL: [StapleState; 3] = [Self::None, Self::Good, Self::Revoked];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Good => "good",
            Self::Revoked => "revoked",
        }
    }
}

impl Default for CertSlot {
    fn default() -> Self {
        Self {
            current: RwLock::default(),
            staple: Mutex::default(),
            stapling: AtomicBool::new(true),
            state: AtomicU8::new(StapleState::None as u8),
            staple_expires: AtomicU64::new(NO_EXPIRY),
            changed: tokio::sync::watch::Sender::new(0),
        }
    }
}

impl CertSlot {
    /// The certificate to present now, if any.
    pub(crate) fn get(&self) -> Option<Arc<CertifiedKey>> {
        // A poisoned lock only means a writer panicked between two whole values.
        self.current.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The certificate for a handshake: [`CertSlot::get`], less a staple whose
    /// `nextUpdate` has passed. The OCSP task drops such a staple within a minute of
    /// its expiry; this covers that minute, and a suspend or a clock step that brings
    /// the expiry nearer than the task's sleep.
    pub(crate) fn serve(&self) -> Option<Arc<CertifiedKey>> {
        let key = self.get()?;
        let expires = self.staple_expires.load(Ordering::Relaxed);
        if key.ocsp.is_some() && epoch_secs(SystemTime::now()) >= expires {
            // Rare (the minute above), so the copy without the staple is not kept.
            return Some(with_ocsp(&key, None));
        }
        Some(key)
    }

    /// Serves `key` from the next handshake on. The staple stays when `key` has the
    /// same leaf as the one it was fetched for (a reload reading unchanged files);
    /// otherwise it goes, since a renewed certificate needs its own.
    pub(crate) fn set(&self, key: Arc<CertifiedKey>) {
        let mut staple = self.staple.lock().unwrap_or_else(|p| p.into_inner());
        let kept = staple
            .as_ref()
            .filter(|s| key.cert.first() == Some(&s.leaf))
            .map(|s| s.response.clone());
        let key = match kept {
            Some(response) => with_ocsp(&key, response.filter(|_| self.stapling())),
            None => {
                *staple = None;
                self.set_state(StapleState::None);
                self.staple_expires.store(NO_EXPIRY, Ordering::Relaxed);
                with_ocsp(&key, None)
            }
        };
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = Some(key);
        drop(staple);
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// Marks each change of the certificate served ([`CertSlot::set`]) or of the
    /// stapling setting, for a task to wait on.
    pub(crate) fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Staples `response` (a DER OCSP response the caller verified, valid until
    /// `expires`, its `nextUpdate`) to the certificate whose leaf is `leaf`, or takes
    /// the staple off with `None`, and records `state`. Does nothing when the slot serves another leaf by now; staples
    /// nothing when stapling is off. Returns whether the slot still serves `leaf`.
    pub(crate) fn staple(
        &self,
        leaf: &CertificateDer<'_>,
        response: Option<Vec<u8>>,
        expires: Option<SystemTime>,
        state: StapleState,
    ) -> bool {
        let mut staple = self.staple.lock().unwrap_or_else(|p| p.into_inner());
        let Some(current) = self.get() else {
            return false;
        };
        if current.cert.first() != Some(leaf) {
            return false;
        }
        let response = response.filter(|_| self.stapling());
        let expires = expires
            .filter(|_| response.is_some())
            .map_or(NO_EXPIRY, epoch_secs);
        self.staple_expires.store(expires, Ordering::Relaxed);
        self.set_state(match (&response, state) {
            (None, StapleState::Good) => StapleState::None,
            _ => state,
        });
        *self.current.write().unwrap_or_else(|p| p.into_inner()) =
            Some(with_ocsp(&current, response.clone()));
        *staple = Some(Staple {
            leaf: leaf.clone().into_owned(),
            response,
        });
        true
    }

    /// Turns stapling on or off for this slot (the site's `ocsp_stapling`); off takes
    /// a staple off at once.
    pub(crate) fn set_stapling(&self, on: bool) {
        let was = self.stapling.swap(on, Ordering::Relaxed);
        if !on {
            if let Some(current) = self.get() {
                self.staple(&current.cert[0], None, None, StapleState::None);
            }
        }
        if was != on {
            self.changed.send_modify(|v| *v = v.wrapping_add(1));
        }
    }

    pub(crate) fn stapling(&self) -> bool {
        self.stapling.load(Ordering::Relaxed)
    }

    /// What the responder last said, as far as the slot serves it.
    pub(crate) fn staple_state(&self) -> StapleState {
        match self.state.load(Ordering::Relaxed) {
            1 => StapleState::Good,
            2 => StapleState::Revoked,
            _ => StapleState::None,
        }
    }

    fn set_state(&self, state: StapleState) {
        self.state.store(state as u8, Ordering::Relaxed);
    }
}

/// Resolves at the next change `rx` marks ([`CertSlot::changes`],
/// [`Certificates::changes`]); never, once nothing can mark one.
pub(crate) async fn changed(rx: &mut tokio::sync::watch::Receiver<u64>) {
    if rx.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// [`CertSlot::staple_expires`] when a staple does not expire.
const NO_EXPIRY: u64 = u64::MAX;

fn epoch_secs(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `key` with its OCSP response replaced; the chain and the signing key are shared.
fn with_ocsp(key: &CertifiedKey, ocsp: Option<Vec<u8>>) -> Arc<CertifiedKey> {
    let mut key = key.clone();
    key.ocsp = ocsp;
    Arc::new(key)
}

/// The process's certificate slots, shared by every configuration generation.
#[derive(Debug)]
pub(crate) struct Certificates {
    slots: Mutex<HashMap<SlotKey, Arc<CertSlot>>>,
    /// Bumped by each [`Certificates::install`] (a reload: slots added or removed).
    changed: tokio::sync::watch::Sender<u64>,
}

impl Default for Certificates {
    fn default() -> Self {
        Self {
            slots: Mutex::default(),
            changed: tokio::sync::watch::Sender::new(0),
        }
    }
}

impl Certificates {
    /// The slot for `key` if the table has one (`false`), else a new empty slot that
    /// is not in the table yet (`true`): only [`Certificates::install`] adds it, so a
    /// configuration that is built and then refused leaves no trace here.
    pub(crate) fn lookup(&self, key: &SlotKey) -> (Arc<CertSlot>, bool) {
        match self.slots.lock().unwrap_or_else(|p| p.into_inner()).get(key) {
            Some(slot) => (slot.clone(), false),
            None => (Arc::default(), true),
        }
    }

    /// Applies what a configuration build staged, once that configuration is current:
    /// new slots join the table, kept slots take their new certificate and stapling
    /// setting, and the slots it does not name are dropped (a reload that removes a
    /// site or changes its source does not leave its old certificate behind).
    pub(crate) fn install(&self, staged: Staged) {
        let mut new = Vec::new();
        for change in staged.changes {
            if change.new {
                // Filled when it was built: nothing else could see it until now.
                new.push((change.key, change.slot));
                continue;
            }
            change.slot.set_stapling(change.stapling);
            match change.cert {
                Some(cert) if !change.if_empty || change.slot.get().is_none() => change.slot.set(cert),
                _ => {}
            }
        }
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        slots.extend(new);
        slots.retain(|k, _| staged.keep.contains(k));
        drop(slots);
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// Marks each [`Certificates::install`] (the table may have changed), for a task
    /// to wait on.
    pub(crate) fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Every slot now, with its key (for the tasks that renew certificates: they walk
    /// this table rather than the configuration, so a reload that adds or removes a
    /// site needs nothing from them).
    pub(crate) fn snapshot(&self) -> Vec<(SlotKey, Arc<CertSlot>)> {
        self.slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// The slots whose certificates come from ACME, for the renewal manager to walk:
    /// reloads that add or remove ACME sites change what it sees.
    pub(crate) fn acme_slots(&self) -> Vec<(SlotKey, Arc<CertSlot>)> {
        self.snapshot()
            .into_iter()
            .filter(|(k, _)| matches!(k.origin, Origin::Acme(_)))
            .collect()
    }

    /// Whether `key` still has a slot (a removed site's renewer stops).
    pub(crate) fn holds(&self, key: &SlotKey, slot: &Arc<CertSlot>) -> bool {
        self.slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(key)
            .is_some_and(|s| Arc::ptr_eq(s, slot))
    }
}

/// The certificate changes of one configuration build, held back until it is current
/// ([`Certificates::install`]).
#[derive(Debug, Default)]
pub(crate) struct Staged {
    changes: Vec<Change>,
    /// Every slot the configuration serves from.
    keep: Vec<SlotKey>,
}

#[derive(Debug)]
struct Change {
    key: SlotKey,
    slot: Arc<CertSlot>,
    /// Not in the table yet (see [`Certificates::lookup`]); already filled.
    new: bool,
    stapling: bool,
    cert: Option<Arc<CertifiedKey>>,
    /// `cert` only fills an empty slot: a stored ACME certificate read at the build
    /// must not replace one the ACME manager obtained since.
    if_empty: bool,
}

impl Staged {
    /// Stages `slot` (from [`Certificates::lookup`]) for `key` to serve `cert` with
    /// `stapling` on or off. A new slot is filled at once (no handshake can reach it
    /// before it is installed); a slot the table holds is changed at install.
    pub(crate) fn stage(
        &mut self,
        key: SlotKey,
        (slot, new): (Arc<CertSlot>, bool),
        cert: Option<Arc<CertifiedKey>>,
        stapling: bool,
        if_empty: bool,
    ) {
        if new {
            slot.set_stapling(stapling);
            if let Some(cert) = &cert {
                slot.set(cert.clone());
            }
        }
        self.keep.push(key.clone());
        self.changes.push(Change {
            key,
            slot,
            new,
            stapling,
            cert,
            if_empty,
        });
    }
}

/// Reads a certificate chain and its key from PEM files and checks that they belong
/// together. `site` names the site in the mismatch error.
pub(crate) fn load_pair(
    provider: &CryptoProvider,
    site: &str,
    cert: &Path,
    key: &Path,
) -> Result<CertifiedKey, TlsError> {
    let chain = load_chain(cert)?;
    let der = load_key(key)?;
    let signer = provider
        .key_provider
        .load_private_key(der)
        .map_err(|e| TlsError::Key {
            path: key.to_owned(),
            reason: e.to_string(),
        })?;
    let certified = CertifiedKey::new(chain, signer);
    if certified.keys_match().is_err() {
        return Err(TlsError::Mismatch {
            site: site.to_owned(),
            cert: cert.to_owned(),
            key: key.to_owned(),
        });
    }
    Ok(certified)
}

/// A self-signed certificate for `names`, generated now.
pub(crate) fn self_signed(provider: &CryptoProvider, names: &[String]) -> Result<CertifiedKey, TlsError> {
    let generated = rcgen::generate_simple_self_signed(names.to_vec())
        .map_err(|e| TlsError::SelfSigned(e.to_string()))?;
    let key = PrivatePkcs8KeyDer::from(generated.key_pair.serialize_der());
    let signer = provider
        .key_provider
        .load_private_key(key.into())
        .map_err(|e| TlsError::SelfSigned(e.to_string()))?;
    Ok(CertifiedKey::new(vec![generated.cert.der().clone()], signer))
}

fn load_chain(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let err = |reason: String| TlsError::Cert {
        path: path.to_owned(),
        reason,
    };
    let chain = CertificateDer::pem_file_iter(path)
        .map_err(|e| err(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| err(e.to_string()))?;
    if chain.is_empty() {
        return Err(err("no CERTIFICATE block found".into()));
    }
    Ok(chain)
}

fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| TlsError::Key {
        path: path.to_owned(),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(site: &str) -> SlotKey {
        SlotKey::self_signed(site)
    }

    /// Stages `cert` for `key` the way a configuration build does.
    fn stage(
        table: &Certificates,
        staged: &mut Staged,
        key: SlotKey,
        cert: &Arc<CertifiedKey>,
        stapling: bool,
    ) {
        staged.stage(
            key.clone(),
            table.lookup(&key),
            Some(cert.clone()),
            stapling,
            false,
        );
    }

    /// What the ACME and OCSP tasks sleep on: a new certificate, a stapling
    /// setting that changes and an install are marked; a staple (the OCSP task's own
    /// doing) and a setting left as it was are not.
    #[test]
    fn changes_that_wake_the_renewers_are_marked_and_no_others() {
        let provider = super::super::provider();
        let table = Certificates::default();
        let mut installs = table.changes();
        let cert = Arc::new(self_signed(&provider, &["a.test".into()]).unwrap());
        let mut staged = Staged::default();
        stage(&table, &mut staged, key("a.test"), &cert, true);
        assert!(!installs.has_changed().unwrap());
        table.install(staged);
        assert!(installs.has_changed().unwrap(), "an install is not marked");
        installs.borrow_and_update();

        let (slot, _) = table.lookup(&key("a.test"));
        let mut changes = slot.changes();
        slot.staple(&cert.cert[0], Some(vec![1, 2, 3]), None, StapleState::Good);
        slot.set_stapling(true);
        assert!(!changes.has_changed().unwrap(), "a staple or no change is marked");
        slot.set_stapling(false);
        assert!(
            changes.has_changed().unwrap(),
            "stapling turned off is not marked"
        );
        changes.borrow_and_update();
        slot.set(Arc::new(self_signed(&provider, &["a.test".into()]).unwrap()));
        assert!(changes.has_changed().unwrap(), "a new certificate is not marked");
        assert!(
            !installs.has_changed().unwrap(),
            "a slot's change is marked as an install"
        );
    }

    #[test]
    fn a_slot_is_kept_by_site_and_origin_and_changes_only_when_installed() {
        let provider = super::super::provider();
        let table = Certificates::default();
        let first = Arc::new(self_signed(&provider, &["a.test".into()]).unwrap());
        let mut staged = Staged::default();
        stage(&table, &mut staged, key("a.test"), &first, true);
        assert!(
            table.snapshot().is_empty(),
            "a staged slot is not in the table yet"
        );
        table.install(staged);
        let (a, new) = table.lookup(&key("a.test"));
        assert!(!new);
        assert_eq!(a.get().unwrap().cert, first.cert);

        // A build that is never installed (a refused reload) changes nothing: not the
        // certificate, not the stapling setting, not the table.
        let second = Arc::new(self_signed(&provider, &["a.test".into()]).unwrap());
        let files = SlotKey {
            site: "a.test".into(),
            origin: Origin::Files {
                cert: "c.pem".into(),
                key: "k.pem".into(),
            },
        };
        let mut refused = Staged::default();
        stage(&table, &mut refused, key("a.test"), &second, false);
        stage(&table, &mut refused, files.clone(), &second, true);
        drop(refused);
        assert_eq!(a.get().unwrap().cert, first.cert);
        assert!(a.stapling());
        assert_eq!(table.snapshot().len(), 1);

        // Installed: the same slot serves the new certificate; another origin is
        // another slot, and a slot no longer named leaves the table.
        let mut staged = Staged::default();
        stage(&table, &mut staged, key("a.test"), &second, false);
        table.install(staged);
        let (again, _) = table.lookup(&key("a.test"));
        assert!(Arc::ptr_eq(&a, &again));
        assert_eq!(a.get().unwrap().cert, second.cert);
        assert!(!a.stapling());
        let mut staged = Staged::default();
        stage(&table, &mut staged, files.clone(), &first, true);
        table.install(staged);
        let keys: Vec<_> = table.snapshot().into_iter().map(|(k, _)| k).collect();
        assert_eq!(keys, vec![files]);
        assert!(!table.holds(&key("a.test"), &a));
    }

    /// A handshake gets no staple once its `nextUpdate` has passed, though the
    /// slot still holds it; a staple not yet expired, or without `nextUpdate`, is
    /// sent.
    #[test]
    fn a_handshake_leaves_out_an_expired_staple() {
        let provider = super::super::provider();
        let slot = CertSlot::default();
        let cert = Arc::new(self_signed(&provider, &["a.test".into()]).unwrap());
        let leaf = cert.cert[0].clone();
        slot.set(cert);
        let now = SystemTime::now();
        let hour = std::time::Duration::from_secs(3600);
        let served = |expires| {
            assert!(slot.staple(&leaf, Some(b"r".to_vec()), expires, StapleState::Good));
            assert!(slot.get().unwrap().ocsp.is_some());
            slot.serve().unwrap().ocsp.is_some()
        };
        assert!(served(Some(now + hour)), "a valid staple was left out");
        assert!(!served(Some(now - hour)), "an expired staple was sent");
        assert!(served(None), "a staple without nextUpdate was left out");
        assert!(!served(Some(now - hour)));
        assert!(slot.staple(&leaf, None, None, StapleState::None));
        assert!(slot.serve().unwrap().ocsp.is_none());
    }

    #[test]
    fn a_staple_follows_its_leaf_and_the_site_setting() {
        let provider = super::super::provider();
        let slot = CertSlot::default();
        let first = Arc::new(self_signed(&provider, &["a.test".into()]).unwrap());
        let leaf = first.cert[0].clone();
        assert!(
            !slot.staple(&leaf, Some(b"r1".to_vec()), None, StapleState::Good),
            "an empty slot takes no staple"
        );
        slot.set(first.clone());
        assert!(slot.staple(&leaf, Some(b"r1".to_vec()), None, StapleState::Good));
        assert_eq!(slot.get().unwrap().ocsp.as_deref(), Some(&b"r1"[..]));
        assert_eq!(slot.staple_state(), StapleState::Good);
        // The same certificate set again (a reload of unchanged files) keeps it.
        slot.set(first.clone());
        assert_eq!(slot.get().unwrap().ocsp.as_deref(), Some(&b"r1"[..]));
        // A renewed certificate drops it, and an answer for the old leaf is ignored.
        slot.set(Arc::new(self_signed(&provider, &["a.test".into()]).unwrap()));
        assert!(slot.get().unwrap().ocsp.is_none());
        assert_eq!(slot.staple_state(), StapleState::None);
        assert!(!slot.staple(&leaf, Some(b"r2".to_vec()), None, StapleState::Good));
        assert!(slot.get().unwrap().ocsp.is_none());
        // Revoked: recorded, nothing stapled; stapling off takes a staple off.
        let now = slot.get().unwrap().cert[0].clone();
        assert!(slot.staple(&now, None, None, StapleState::Revoked));
        assert_eq!(slot.staple_state(), StapleState::Revoked);
        assert!(slot.staple(&now, Some(b"r3".to_vec()), None, StapleState::Good));
        slot.set_stapling(false);
        assert!(slot.get().unwrap().ocsp.is_none());
        assert!(slot.staple(&now, Some(b"r4".to_vec()), None, StapleState::Good));
        assert!(slot.get().unwrap().ocsp.is_none(), "stapling off staples nothing");
        assert_eq!(slot.staple_state(), StapleState::None);
    }
}
