//! Certificate files watched: a renewal on disk (certbot rewriting or re-linking
//! `fullchain.pem` and `privkey.pem`) is served without a reload.
//!
//! One background task walks the certificate table ([`Certificates::snapshot`]) every
//! [`POLL`], so a reload that adds or removes a site needs nothing from it. For each
//! slot read from files it compares what `stat` says of both files (following
//! symlinks: device, inode, size, modification time) with what it last loaded. A
//! change must hold still for one more poll before it is read, so a renewal caught
//! half-written is read once it is whole; then the pair must load, match, and the
//! leaf be valid now, or it is refused, logged and counted, and the old certificate
//! stays. A refused pair is tried again when either file changes again.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use rustls::pki_types::CertificateDer;
use x509_cert::der::Decode;

use super::certs::{self, Origin, SlotKey};
use super::{Shared, TlsError};
use crate::fsutil::Stamp;
use crate::metrics::{Collector, Encoder, Kind};

/// How often the files are looked at: a renewal is served within about two polls.
pub(crate) const POLL: Duration = Duration::from_secs(2);

static RELOADED: AtomicU64 = AtomicU64::new(0);
static REFUSED: AtomicU64 = AtomicU64::new(0);

/// Why a changed pair was not served.
#[derive(Debug, thiserror::Error)]
pub(crate) enum WatchError {
    #[error(transparent)]
    Pair(#[from] TlsError),
    #[error("certificate `{path}`: the leaf cannot be read as X.509: {reason} (fix: write a PEM chain, leaf first)")]
    Unreadable { path: PathBuf, reason: String },
    #[error("certificate `{path}`: {problem} (fix: install a certificate valid now; the one served stays until then)")]
    NotValidNow { path: PathBuf, problem: String },
}

/// What the watcher knows of one slot's files.
#[derive(Debug)]
struct Seen {
    /// The stamps of the pair served (or last refused: not tried again unchanged).
    settled: (Stamp, Stamp),
    /// A change seen at the last poll, read once it holds still.
    pending: Option<(Stamp, Stamp)>,
}

/// Watches every file-backed slot of `shared` until the task is dropped.
pub(crate) async fn run(shared: Arc<Shared>) {
    let mut seen: HashMap<SlotKey, Seen> = HashMap::new();
    let mut tick = tokio::time::interval(POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let slots = shared.certs.snapshot();
        // A site removed by a reload is forgotten (the table bounds this map).
        seen.retain(|k, _| slots.iter().any(|(key, _)| key == k));
        for (key, slot) in slots {
            let Origin::Files { cert, key: key_path } = &key.origin else {
                continue;
            };
            let (Some(c), Some(k)) = (Stamp::of(cert), Stamp::of(key_path)) else {
                // Missing for a moment (a rename in progress): looked at next poll.
                continue;
            };
            let now = (c, k);
            let entry = seen.entry(key.clone()).or_insert(Seen {
                settled: now,
                pending: None,
            });
            if entry.settled == now {
                entry.pending = None;
                continue;
            }
            if entry.pending != Some(now) {
                entry.pending = Some(now);
                continue;
            }
            entry.settled = now;
            entry.pending = None;
            // Off the async workers: a slow disk must not stall handshakes.
            let loaded = {
                let (shared, site) = (shared.clone(), key.site.clone());
                let (cert, key_path) = (cert.clone(), key_path.clone());
                tokio::task::spawn_blocking(move || load(&shared, &site, &cert, &key_path)).await
            };
            let Ok(loaded) = loaded else {
                // The runtime is ending (or the read panicked): tried again on a change.
                continue;
            };
            match loaded {
                // A reload already read these files: nothing new to serve.
                Ok(certified) if slot.get().is_some_and(|c| c.cert == certified.cert) => {}
                Ok(certified) => {
                    slot.set(Arc::new(certified));
                    RELOADED.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(site = %key.site, cert = %cert.display(), "certificate files changed: the new pair is served");
                }
                Err(e) => {
                    REFUSED.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(site = %key.site, error = %e, "certificate files changed but the new pair is refused; the previous certificate is still served");
                }
            }
        }
    }
}

fn load(
    shared: &Shared,
    site: &str,
    cert: &Path,
    key: &Path,
) -> Result<rustls::sign::CertifiedKey, WatchError> {
    let certified = certs::load_pair(&shared.provider, site, cert, key)?;
    check_valid_now(cert, &certified.cert[0], SystemTime::now())?;
    Ok(certified)
}

/// Refuses a leaf outside its validity period at `now`.
pub(crate) fn check_valid_now(
    path: &Path,
    leaf: &CertificateDer<'_>,
    now: SystemTime,
) -> Result<(), WatchError> {
    let parsed = x509_cert::Certificate::from_der(leaf).map_err(|e| WatchError::Unreadable {
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    let validity = &parsed.tbs_certificate.validity;
    let now = now.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    let not_before = validity.not_before.to_unix_duration();
    let not_after = validity.not_after.to_unix_duration();
    let problem = if now > not_after {
        format!("expired {} s ago", (now - not_after).as_secs())
    } else if now < not_before {
        format!("not valid for another {} s", (not_before - now).as_secs())
    } else {
        return Ok(());
    };
    Err(WatchError::NotValidNow {
        path: path.to_owned(),
        problem,
    })
}

/// `webship_tls_certificate_file_reloads_total`.
pub(crate) struct Metrics;

impl Collector for Metrics {
    fn collect(&self, out: &mut Encoder) {
        out.family(
            "webship_tls_certificate_file_reloads",
            Kind::Counter,
            "Certificate/key pairs changed on disk: served (ok) or refused (mismatch, unreadable, not valid now).",
        )
        .sample(&[("result", "ok")], RELOADED.load(Ordering::Relaxed))
        .sample(&[("result", "refused")], REFUSED.load(Ordering::Relaxed));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_leaf_is_checked_against_its_validity_period() {
        let mut params = rcgen::CertificateParams::new(vec!["a.test".to_owned()]).unwrap();
        params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        let path = Path::new("leaf.pem");
        let in_2020 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_590_000_000);
        check_valid_now(path, cert.der(), in_2020).unwrap();
        let e = check_valid_now(path, cert.der(), SystemTime::now()).unwrap_err();
        assert!(e.to_string().contains("expired"), "{e}");
        let in_2019 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_560_000_000);
        let e = check_valid_now(path, cert.der(), in_2019).unwrap_err();
        assert!(e.to_string().contains("not valid for another"), "{e}");
    }
}
