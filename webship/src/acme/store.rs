//! The ACME storage folder (`[acme] storage`): account credentials per directory and
//! each certificate with its key, so a restart serves what was obtained before
//! instead of ordering again. Every file is written whole (a temporary file in the
//! same folder, synced, then renamed over the old one), keys and credentials `0600`.
//!
//! Layout: `accounts/<tag>.json` (instant-acme's credentials for one directory URL)
//! and `certs/<names>-<tag>/{cert.pem,key.pem}` (see `AcmeSource::folder`).

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use rustls::pki_types::CertificateDer;

use super::AcmeError;
use crate::config::AcmeSource;

/// The file holding the account credentials for `source`'s directory.
pub(super) fn account_file(source: &AcmeSource) -> PathBuf {
    let folder = source.folder();
    let tag = folder
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.rsplit_once('-'))
        .map_or("default", |(_, tag)| tag)
        .to_owned();
    source.storage.join("accounts").join(format!("{tag}.json"))
}

/// Writes `data` to `path` whole, creating its folder (0700): readers see the old
/// file or the new one, never a part; `mode` is the new file's permissions.
pub(super) fn write_atomic(path: &Path, data: &[u8], mode: u32) -> Result<(), AcmeError> {
    let err = |e: std::io::Error| AcmeError::Storage {
        path: path.to_owned(),
        source: e,
    };
    let folder = path
        .parent()
        .ok_or_else(|| err(std::io::ErrorKind::InvalidInput.into()))?;
    create_private_dir(folder).map_err(err)?;
    crate::fsutil::write_atomic(path, data, mode, None).map_err(err)
}

/// [`write_atomic`] for async code: its two disk syncs run off the async workers.
pub(super) async fn write_atomic_async(path: &Path, data: Vec<u8>, mode: u32) -> Result<(), AcmeError> {
    let owned = path.to_owned();
    tokio::task::spawn_blocking(move || write_atomic(&owned, &data, mode))
        .await
        .unwrap_or_else(|e| {
            Err(AcmeError::Storage {
                path: path.to_owned(),
                source: std::io::Error::other(e),
            })
        })
}

/// Creates `dir` and its missing parents, each new one `0700`.
pub(super) fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)
}

/// What the operator and the scheduler need from a certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct CertFacts {
    /// Hex, as `openssl x509 -serial` prints it.
    pub serial: String,
    pub not_before: SystemTime,
    pub not_after: SystemTime,
}

impl CertFacts {
    /// Reads the leaf's serial and validity.
    pub(super) fn of(leaf: &CertificateDer<'_>) -> Result<Self, AcmeError> {
        let (_, cert) = x509_parser::parse_x509_certificate(leaf.as_ref())
            .map_err(|e| AcmeError::Certificate(format!("the issued certificate cannot be read: {e}")))?;
        let time = |t: x509_parser::time::ASN1Time| {
            let secs = t.timestamp();
            if secs >= 0 {
                SystemTime::UNIX_EPOCH + Duration::from_secs(secs.unsigned_abs())
            } else {
                SystemTime::UNIX_EPOCH
            }
        };
        Ok(Self {
            serial: cert.raw_serial_as_string().replace(':', "").to_ascii_uppercase(),
            not_before: time(cert.validity().not_before),
            not_after: time(cert.validity().not_after),
        })
    }

    /// The certificate's lifetime (at least a second).
    pub(super) fn lifetime(&self) -> Duration {
        self.not_after
            .duration_since(self.not_before)
            .unwrap_or_default()
            .max(Duration::from_secs(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_atomic_write_replaces_the_file_whole_with_its_mode() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a/b/key.pem");
        write_atomic(&path, b"one", 0o600).unwrap();
        write_atomic(&path, b"two", 0o600).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let folder = std::fs::metadata(dir.path().join("a/b"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(folder, 0o700);
        assert!(
            !dir.path().join("a/b/key.pem.tmp").exists(),
            "no temporary file is left"
        );
    }

    #[test]
    fn facts_of_a_generated_certificate() {
        let mut params = rcgen::CertificateParams::new(vec!["a.test".to_owned()]).unwrap();
        params.serial_number = Some(rcgen::SerialNumber::from_slice(&[0x0a, 0xbc]));
        params.not_before = rcgen::date_time_ymd(2030, 1, 1);
        params.not_after = rcgen::date_time_ymd(2030, 1, 31);
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        let facts = CertFacts::of(cert.der()).unwrap();
        assert_eq!(facts.serial, "0ABC");
        assert_eq!(facts.lifetime(), Duration::from_secs(30 * 86400));
        assert!(CertFacts::of(&CertificateDer::from(vec![1, 2, 3])).is_err());
    }
}
