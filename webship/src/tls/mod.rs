//! TLS termination: one rustls `ServerConfig` per site, chosen by the ClientHello's SNI
//! before the handshake continues, so each site gets its own certificate and ALPN list.
//!
//! A client that sends no SNI, or a name no site claims, gets the default site's
//! certificate (the catch-all site from the top-level `root`, else the first
//! `[[sites]]` entry), like nginx's `default_server`. Routing by `Host` is then the
//! service's job. Session resumption works across sites: all configs share one
//! session cache and one set of ticket keys ([`tickets`]: per process, or a file shared
//! by the hosts behind one load balancer).
//!
//! Certificates live in process-wide slots ([`certs`]) that outlive a configuration
//! generation; the resolvers read the slot at each handshake, so a certificate can be
//! replaced without rebuilding anything.

pub(crate) mod alpn_challenge;
pub(crate) mod certs;
pub(crate) mod ocsp;
pub(crate) mod tickets;
pub(crate) mod watch;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls::server::{ProducesTickets, ServerSessionMemoryCache};
use rustls::ServerConfig;
use tokio::net::TcpStream;
use tokio_rustls::LazyConfigAcceptor;

use crate::config::{Config, Protocols, TlsSource};
use crate::ktls::{RecordBounded, RustlsStream};
use crate::names::NameTable;
use alpn_challenge::AlpnChallenges;
use certs::{CertSlot, Certificates, Origin, SlotKey, Staged};

/// Session-cache entries shared by all sites (rustls keeps them in memory).
const SESSION_CACHE_ENTRIES: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("certificate `{path}`: {reason} (fix: point `cert` at a PEM file holding the certificate chain, leaf first)")]
    Cert { path: PathBuf, reason: String },
    #[error("private key `{path}`: {reason} (fix: point `key` at a PEM file holding one PKCS#8, PKCS#1 or SEC1 key)")]
    Key { path: PathBuf, reason: String },
    #[error("site `{site}`: the key `{key}` does not belong to the certificate `{cert}` (fix: pair each certificate with its own key)")]
    Mismatch {
        site: String,
        cert: PathBuf,
        key: PathBuf,
    },
    #[error("could not generate a self-signed certificate: {0}")]
    SelfSigned(String),
    #[error(transparent)]
    TicketKeys(#[from] tickets::TicketKeyError),
    #[error("TLS setup failed: {0}")]
    Rustls(#[from] rustls::Error),
}

/// Why a connection's handshake did not complete.
#[derive(Debug, thiserror::Error)]
pub(crate) enum AcceptError {
    #[error("TLS handshake: {0}")]
    Io(#[from] std::io::Error),
    #[error("TLS handshake timed out")]
    Timeout,
    /// An ACME `tls-alpn-01` validation was answered; the connection carries nothing.
    #[error("ACME tls-alpn-01 challenge answered")]
    AcmeChallenge,
}

/// The application protocol a connection negotiated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Alpn {
    H1,
    H2,
}

/// The sites by host name: the one table that picks a connection's site from its SNI
/// (the certificate it is shown) and a request's site from its `Host`.
#[derive(Debug, Clone)]
pub(crate) struct SiteNames {
    table: Arc<NameTable<usize>>,
    default_site: usize,
}

impl SiteNames {
    pub(crate) fn new(config: &Config) -> Self {
        Self {
            table: Arc::new(NameTable::new(
                config
                    .sites
                    .iter()
                    .enumerate()
                    .map(|(i, s)| (s.domain.clone(), i)),
            )),
            default_site: config.default_site(),
        }
    }

    /// The site answering for `host`, if any.
    pub(crate) fn lookup(&self, host: &str) -> Option<usize> {
        self.table.lookup(host).copied()
    }

    /// The site a connection with this SNI is for: no or an unknown name gets the
    /// default site, like nginx's `default_server`.
    pub(crate) fn site_for(&self, sni: Option<&str>) -> usize {
        sni.and_then(|name| self.lookup(name))
            .unwrap_or(self.default_site)
    }
}

/// Accepts TLS connections for every configured site.
#[derive(Debug)]
pub(crate) struct Acceptor {
    configs: Vec<Arc<ServerConfig>>,
    protocols: Vec<Protocols>,
    sites: SiteNames,
    quic: Option<Arc<ServerConfig>>,
    /// The certificate changes this configuration brings, until
    /// [`Acceptor::take_staged`] hands them to whoever makes it current.
    staged: Option<Staged>,
    provider: Arc<CryptoProvider>,
    challenges: Arc<AlpnChallenges>,
}

/// What outlives a configuration generation: the certificate slots, the session
/// cache and the ticket keys (so a reload neither re-keys nor forgets sessions).
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) provider: Arc<CryptoProvider>,
    pub(crate) certs: Certificates,
    pub(crate) cache: Arc<dyn rustls::server::StoresServerSessions>,
    /// The ticket keys, to re-read at a reload; `ticketer` is the same object.
    pub(crate) tickets: Arc<tickets::Tickets>,
    pub(crate) ticketer: Arc<dyn ProducesTickets>,
    /// Pending ACME `tls-alpn-01` answers, filled by `crate::acme`.
    pub(crate) challenges: Arc<AlpnChallenges>,
}

impl Shared {
    /// `ticket_keys`: the `[tls] ticket_keys` file, else keys generated here.
    pub(crate) fn new(ticket_keys: Option<&Path>) -> Result<Self, TlsError> {
        let tickets = Arc::new(tickets::Tickets::new(ticket_keys)?);
        Ok(Self {
            provider: Arc::new(provider()),
            certs: Certificates::default(),
            cache: ServerSessionMemoryCache::new(SESSION_CACHE_ENTRIES),
            ticketer: tickets.clone(),
            tickets,
            challenges: Arc::default(),
        })
    }
}

/// A completed handshake.
#[derive(Debug)]
pub(crate) struct Accepted {
    /// Reads stop at TLS record boundaries, so HTTP/1.1 can later move to kernel TLS.
    pub stream: RustlsStream,
    pub alpn: Alpn,
    /// Index of the site whose certificate was presented.
    pub site: usize,
}

impl Accepted {
    /// The version and suite the handshake settled on.
    pub(crate) fn tls_info(&self) -> Option<crate::message::TlsInfo> {
        let conn = self.stream.get_ref().1;
        Some(crate::message::TlsInfo {
            version: conn.protocol_version()?.as_str()?,
            cipher: conn.negotiated_cipher_suite().and_then(|s| s.suite().as_str()),
        })
    }
}

impl Acceptor {
    /// Loads every site's certificate and key (or generates the self-signed one) and
    /// checks that each key matches its certificate. Nothing in `shared` changes: the
    /// resolvers point at the slots that will be current, and the changes wait in
    /// [`Acceptor::take_staged`] for [`Certificates::install`] once this
    /// configuration is (a reload refused later must leave the served certificates,
    /// staples and the slot table as they were).
    pub(crate) fn build(config: &Config, sites: &SiteNames, shared: &Shared) -> Result<Self, TlsError> {
        let provider = shared.provider.clone();
        let mut configs = Vec::with_capacity(config.sites.len());
        let mut quic_slots = Vec::with_capacity(config.sites.len());
        let mut staged = Staged::default();
        for site in &config.sites {
            let domain = site.domain.to_string();
            let (origin, certified, stapling) = match &site.tls {
                TlsSource::Files {
                    cert,
                    key,
                    ocsp_stapling,
                } => (
                    Origin::Files {
                        cert: cert.clone(),
                        key: key.clone(),
                    },
                    Some(certs::load_pair(&provider, &domain, cert, key)?),
                    *ocsp_stapling,
                ),
                TlsSource::SelfSigned { names } => (
                    Origin::SelfSigned,
                    Some(certs::self_signed(&provider, names)?),
                    false,
                ),
                // Kept as it is (ACME filled it before a reload), else the stored
                // certificate if there is one; an empty slot fails handshakes until
                // the ACME manager fills it.
                TlsSource::Acme(source) => (Origin::Acme(source.clone()), None, true),
            };
            let key = SlotKey {
                site: domain.clone(),
                origin,
            };
            let found = shared.certs.lookup(&key);
            let slot = found.0.clone();
            let (certified, if_empty) = match (certified, &site.tls) {
                (Some(certified), _) => (Some(Arc::new(certified)), false),
                (None, TlsSource::Acme(source)) if slot.get().is_none() => {
                    let (cert, key) = source.files();
                    let stored = match cert.exists() {
                        true => match certs::load_pair(&provider, &domain, &cert, &key) {
                            Ok(stored) => Some(Arc::new(stored)),
                            Err(e) => {
                                tracing::warn!(site = %domain, error = %e, "acme: the stored certificate cannot be used; a new one is ordered");
                                None
                            }
                        },
                        false => None,
                    };
                    (stored, true)
                }
                (None, _) => (None, false),
            };
            staged.stage(key, found, certified, stapling, if_empty);
            quic_slots.push(site.protocols.h3.then(|| slot.clone()));
            let mut server = ServerConfig::builder_with_provider(provider.clone())
                .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])?
                .with_no_client_auth()
                .with_cert_resolver(Arc::new(SiteCert(slot)));
            server.session_storage = shared.cache.clone();
            server.ticketer = shared.ticketer.clone();
            server.alpn_protocols = alpn_list(site.protocols);
            // kTLS promotion needs the traffic secrets; rustls only hands them over when
            // asked at configuration time.
            server.enable_secret_extraction = true;
            configs.push(Arc::new(server));
        }
        let quic = if quic_slots.iter().any(Option::is_some) {
            // QUIC carries TLS 1.3 only and one config per endpoint, so the site is
            // chosen by SNI inside the certificate resolver instead.
            let mut server = ServerConfig::builder_with_provider(provider)
                .with_protocol_versions(&[&rustls::version::TLS13])?
                .with_no_client_auth()
                .with_cert_resolver(Arc::new(SniResolver {
                    sites: sites.clone(),
                    slots: quic_slots,
                }));
            server.session_storage = shared.cache.clone();
            server.ticketer = shared.ticketer.clone();
            server.alpn_protocols = vec![b"h3".to_vec()];
            server.max_early_data_size = 0;
            Some(Arc::new(server))
        } else {
            None
        };
        Ok(Self {
            configs,
            protocols: config.sites.iter().map(|s| s.protocols).collect(),
            sites: sites.clone(),
            quic,
            staged: Some(staged),
            provider: shared.provider.clone(),
            challenges: shared.challenges.clone(),
        })
    }

    /// The certificate changes of this configuration, for [`Certificates::install`]
    /// once it is current; empty the second time.
    pub(crate) fn take_staged(&mut self) -> Staged {
        self.staged.take().unwrap_or_default()
    }

    /// Whether no site terminates TLS (a passthrough-only listener).
    pub(crate) fn is_empty(&self) -> bool {
        self.configs.is_empty()
    }

    /// The rustls configuration for the HTTP/3 endpoint (TLS 1.3, ALPN `h3`, the
    /// certificate chosen by SNI among sites with `h3 = true`); `None` when no site
    /// serves HTTP/3.
    pub(crate) fn quic_config(&self) -> Option<Arc<ServerConfig>> {
        self.quic.clone()
    }

    /// Reads the ClientHello, picks the site by SNI, and completes the handshake, all
    /// within `timeout`.
    pub(crate) async fn accept(
        &self,
        tcp: TcpStream,
        timeout: std::time::Duration,
    ) -> Result<Accepted, AcceptError> {
        let handshake = async {
            let start =
                LazyConfigAcceptor::new(rustls::server::Acceptor::default(), RecordBounded::new(tcp)).await?;
            let hello = start.client_hello();
            if let Some(challenge) = self.challenges.answer(&self.provider, &hello) {
                // The validation only needs the handshake; the connection then closes.
                start.into_stream(challenge).await?;
                return Ok(None);
            }
            let site = self.sites.site_for(hello.server_name());
            let stream = start.into_stream(self.configs[site].clone()).await?;
            Ok::<_, std::io::Error>(Some((stream, site)))
        };
        let (stream, site) = tokio::time::timeout(timeout, handshake)
            .await
            .map_err(|_| AcceptError::Timeout)??
            .ok_or(AcceptError::AcmeChallenge)?;
        let alpn = match stream.get_ref().1.alpn_protocol() {
            Some(b"h2") => Alpn::H2,
            Some(_) => Alpn::H1,
            // No ALPN: only HTTP/1.1 can be spoken without it.
            None if self.protocols[site].h1 => Alpn::H1,
            None => {
                return Err(AcceptError::Io(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "client offered no ALPN and the site does not serve HTTP/1.1",
                )))
            }
        };
        Ok(Accepted { stream, alpn, site })
    }
}

/// The site's certificate as its slot holds it now, whatever the ClientHello asks: the
/// site was already chosen by SNI before this config was picked.
#[derive(Debug)]
struct SiteCert(Arc<CertSlot>);

impl rustls::server::ResolvesServerCert for SiteCert {
    fn resolve(&self, _hello: rustls::server::ClientHello<'_>) -> Option<Arc<rustls::sign::CertifiedKey>> {
        self.0.serve()
    }
}

/// Picks the certificate by SNI for QUIC, where one rustls config serves all sites.
/// No or an unknown SNI gets the default site, as over TCP; a site with `h3 = false`
/// gets no certificate, so the handshake fails rather than serving it over HTTP/3.
#[derive(Debug)]
struct SniResolver {
    sites: SiteNames,
    slots: Vec<Option<Arc<CertSlot>>>,
}

impl rustls::server::ResolvesServerCert for SniResolver {
    fn resolve(&self, hello: rustls::server::ClientHello<'_>) -> Option<Arc<rustls::sign::CertifiedKey>> {
        self.slots
            .get(self.sites.site_for(hello.server_name()))?
            .as_ref()?
            .serve()
    }
}

/// The crypto provider: aws-lc-rs, measured faster than ring at AES-GCM both raw and
/// through rustls on the development host (`cargo xtask bench aead`,
/// docs/benchmarks.md).
pub(crate) fn provider() -> CryptoProvider {
    rustls::crypto::aws_lc_rs::default_provider()
}

fn alpn_list(p: Protocols) -> Vec<Vec<u8>> {
    let mut list = Vec::new();
    if p.h2 {
        list.push(b"h2".to_vec());
    }
    if p.h1 {
        list.push(b"http/1.1".to_vec());
    }
    list
}
