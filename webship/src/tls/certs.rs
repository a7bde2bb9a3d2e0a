//! The certificates sites serve, as one process-wide table of swappable slots.
//!
//! Every site's handshakes read its certificate from a [`CertSlot`]; whatever renews a
//! certificate (a reload, a changed file on disk, ACME, an OCSP refresh) builds a
//! complete [`CertifiedKey`], checks it, and swaps it in with [`CertSlot::set`]. Open
//! connections keep the key they shook hands with; the next handshake sees the new one.
//!
//! Slots are kept by site name and by where the certificate comes from
//! ([`SlotKey`]), so a reload that keeps a site's source keeps its slot (an ACME
//! certificate obtained before the reload is served after it), and a reload that
//! changes the source starts a fresh one.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};

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

/// One site's certificate as served now. Empty until a certificate is installed: a
/// handshake for a site whose slot is empty fails rather than showing another site's
/// certificate.
#[derive(Debug, Default)]
pub(crate) struct CertSlot {
    current: RwLock<Option<Arc<CertifiedKey>>>,
}

impl CertSlot {
    /// The certificate to present now, if any.
    pub(crate) fn get(&self) -> Option<Arc<CertifiedKey>> {
        // A poisoned lock only means a writer panicked between two whole values.
        self.current.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Serves `key` from the next handshake on.
    pub(crate) fn set(&self, key: Arc<CertifiedKey>) {
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = Some(key);
    }
}

/// The process's certificate slots, shared by every configuration generation.
#[derive(Debug, Default)]
pub(crate) struct Certificates {
    slots: Mutex<HashMap<SlotKey, Arc<CertSlot>>>,
}

impl Certificates {
    /// The slot for `key`, created empty the first time it is asked for.
    pub(crate) fn slot(&self, key: SlotKey) -> Arc<CertSlot> {
        self.slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(key)
            .or_default()
            .clone()
    }

    /// The slots whose certificates come from ACME, for the renewal manager to walk:
    /// reloads that add or remove ACME sites change what it sees.
    pub(crate) fn acme_slots(&self) -> Vec<(SlotKey, Arc<CertSlot>)> {
        self.slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(k, _)| matches!(k.origin, Origin::Acme(_)))
            .map(|(k, s)| (k.clone(), s.clone()))
            .collect()
    }

    /// Drops the slots no generation named in `keep`: a reload that removes a site or
    /// changes its source does not leave its old certificate behind.
    pub(crate) fn retain(&self, keep: &[SlotKey]) {
        self.slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|k, _| keep.contains(k));
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
        SlotKey {
            site: site.into(),
            origin: Origin::SelfSigned,
        }
    }

    #[test]
    fn a_slot_is_kept_by_site_and_origin_and_swapped_whole() {
        let provider = super::super::provider();
        let table = Certificates::default();
        let a = table.slot(key("a.test"));
        assert!(a.get().is_none(), "a new slot serves nothing");
        a.set(Arc::new(self_signed(&provider, &["a.test".into()]).unwrap()));
        let again = table.slot(key("a.test"));
        assert!(Arc::ptr_eq(&a, &again));
        assert!(again.get().is_some());
        let files = table.slot(SlotKey {
            site: "a.test".into(),
            origin: Origin::Files {
                cert: "c.pem".into(),
                key: "k.pem".into(),
            },
        });
        assert!(files.get().is_none(), "another origin is another slot");
        table.retain(&[key("a.test")]);
        assert!(Arc::ptr_eq(&table.slot(key("a.test")), &a));
    }
}
