//! The TLS side of ACME's `tls-alpn-01` challenge (RFC 8737): while an order is
//! pending, the ACME server connects to the TLS port with SNI naming the site and
//! ALPN offering only `acme-tls/1`; it must be shown a special self-signed
//! certificate (built by `crate::acme`), negotiate `acme-tls/1`, and nothing else
//! happens on that connection. This table holds those certificates by name; the
//! acceptor asks it before choosing a site, so no HTTP listener is needed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rustls::crypto::CryptoProvider;
use rustls::server::ClientHello;
use rustls::sign::CertifiedKey;
use rustls::ServerConfig;

/// The ALPN protocol of the challenge (RFC 8737 section 4).
pub(crate) const ACME_TLS_ALPN: &[u8] = b"acme-tls/1";
/// Pending challenges at once: one per name being validated; ACME orders run one
/// at a time per certificate, so this is far above need, and bounds the table.
const MAX_PENDING: usize = 1024;

/// Challenge certificates by the (lower-case) name they answer for.
#[derive(Debug, Default)]
pub(crate) struct AlpnChallenges {
    pending: Mutex<HashMap<String, Arc<CertifiedKey>>>,
}

impl AlpnChallenges {
    /// Answers `name`'s challenge with `key` until [`remove`](Self::remove); false
    /// when the table is full (the order then fails and is retried later).
    pub(crate) fn insert(&self, name: &str, key: Arc<CertifiedKey>) -> bool {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        if pending.len() >= MAX_PENDING && !pending.contains_key(name) {
            return false;
        }
        pending.insert(name.to_ascii_lowercase(), key);
        true
    }

    pub(crate) fn remove(&self, name: &str) {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&name.to_ascii_lowercase());
    }

    /// The configuration that answers this ClientHello's challenge, when it is one:
    /// it offers `acme-tls/1` and names a host with a pending challenge. A client
    /// offering `acme-tls/1` for any other name is treated as an ordinary one.
    pub(crate) fn answer(
        &self,
        provider: &Arc<CryptoProvider>,
        hello: &ClientHello<'_>,
    ) -> Option<Arc<ServerConfig>> {
        let offers = hello.alpn()?.any(|p| p == ACME_TLS_ALPN);
        if !offers {
            return None;
        }
        let name = hello.server_name()?.to_ascii_lowercase();
        let key = self
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&name)?
            .clone();
        let mut config = ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .ok()?
            .with_no_client_auth()
            .with_cert_resolver(Arc::new(Fixed(key)));
        config.alpn_protocols = vec![ACME_TLS_ALPN.to_vec()];
        Some(Arc::new(config))
    }
}

#[derive(Debug)]
struct Fixed(Arc<CertifiedKey>);

impl rustls::server::ResolvesServerCert for Fixed {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }
}
