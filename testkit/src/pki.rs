//! A throwaway private PKI, so clients verify servers for real: a CA, leaf
//! certificates signed by it (written as PEM files for the servers), and rustls
//! client configurations that trust only that CA. Every configuration names its
//! crypto provider (aws-lc-rs): the benches enable ring too, so rustls has no
//! single default to pick.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, RootCertStore, SupportedProtocolVersion};

/// A CA whose files go into one directory.
pub struct Pki {
    dir: PathBuf,
    ca: rcgen::Certificate,
    ca_key: KeyPair,
}

impl std::fmt::Debug for Pki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pki")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

/// A leaf certificate as the servers read it.
#[derive(Debug, Clone)]
pub struct Leaf {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The certificate's DER (WebTransport's `serverCertificateHashes` hash it).
    pub der: Vec<u8>,
    /// The private key's PKCS#8 DER, for a server configured in memory.
    pub key_der: Vec<u8>,
}

impl Pki {
    /// A new CA whose files go under `dir`.
    pub fn new(dir: &Path) -> Result<Self> {
        let ca_key = KeyPair::generate().context("generating the CA key")?;
        let mut params = CertificateParams::new(Vec::<String>::new()).context("CA parameters")?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "webship test CA");
        let ca = params.self_signed(&ca_key).context("signing the CA")?;
        Ok(Self {
            dir: dir.to_owned(),
            ca,
            ca_key,
        })
    }

    /// Writes `<name>.crt` and `<name>.key` for an ECDSA P-256 leaf valid for
    /// `names` (DNS names or IP addresses) with rcgen's default validity.
    pub fn leaf(&self, name: &str, names: &[&str]) -> Result<Leaf> {
        self.write_leaf(name, self.params(names)?)
    }

    /// Like [`Pki::leaf`], but valid for 10 days, as WebTransport's
    /// `serverCertificateHashes` requires.
    pub fn short_lived_leaf(&self, name: &str, names: &[&str]) -> Result<Leaf> {
        let mut params = self.params(names)?;
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::hours(1);
        params.not_after = now + time::Duration::days(10);
        self.write_leaf(name, params)
    }

    fn params(&self, names: &[&str]) -> Result<CertificateParams> {
        CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>())
            .with_context(|| format!("certificate parameters for {names:?}"))
    }

    fn write_leaf(&self, name: &str, params: CertificateParams) -> Result<Leaf> {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).context("generating a key")?;
        let cert = params
            .signed_by(&key, &self.ca, &self.ca_key)
            .with_context(|| format!("signing {name}"))?;
        let leaf = Leaf {
            cert: self.dir.join(format!("{name}.crt")),
            key: self.dir.join(format!("{name}.key")),
            der: cert.der().to_vec(),
            key_der: key.serialize_der(),
        };
        write(&leaf.cert, cert.pem())?;
        write(&leaf.key, key.serialize_pem())?;
        Ok(leaf)
    }

    /// The CA certificate as a PEM file (for curl --cacert, aioquic, child clients).
    pub fn ca_file(&self) -> Result<PathBuf> {
        let path = self.dir.join("ca.crt");
        write(&path, self.ca.pem())?;
        Ok(path)
    }

    /// A root store holding only this CA.
    pub fn roots(&self) -> Result<RootCertStore> {
        let mut roots = RootCertStore::empty();
        roots
            .add(CertificateDer::from(self.ca.der().to_vec()))
            .context("adding the CA")?;
        Ok(roots)
    }

    /// A client that trusts only this CA and offers `alpn`, TLS 1.2 and 1.3.
    pub fn client(&self, alpn: &[&[u8]]) -> Result<Arc<ClientConfig>> {
        client_config(self.roots()?, rustls::DEFAULT_VERSIONS, alpn)
    }
}

fn write(path: &Path, contents: String) -> Result<()> {
    std::fs::write(path, contents).with_context(|| format!("writing {}", path.display()))
}

/// The certificates in the PEM file `ca` as a root store; an error if it holds none.
pub fn roots_from_pem(ca: &Path) -> Result<RootCertStore> {
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca).with_context(|| format!("reading {}", ca.display()))? {
        roots
            .add(cert.with_context(|| format!("parsing {}", ca.display()))?)
            .with_context(|| format!("adding a root from {}", ca.display()))?;
    }
    if roots.is_empty() {
        bail!("{} holds no certificate", ca.display());
    }
    Ok(roots)
}

/// A client with aws-lc-rs, `versions`, `roots` as the only trust and `alpn` offered.
pub fn client_config(
    roots: RootCertStore,
    versions: &[&'static SupportedProtocolVersion],
    alpn: &[&[u8]],
) -> Result<Arc<ClientConfig>> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(versions)
        .context("TLS versions with the aws-lc-rs provider")?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// `config` offering `alpn` instead.
pub fn with_alpn(config: &ClientConfig, alpn: &[u8]) -> Arc<ClientConfig> {
    let mut config = config.clone();
    config.alpn_protocols = vec![alpn.to_vec()];
    Arc::new(config)
}

/// A client for servers whose certificate the test cannot know (the built-in
/// self-signed default): it checks signatures but accepts any certificate.
pub fn insecure_client(alpn: &[&[u8]]) -> Result<Arc<ClientConfig>> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .context("TLS versions with the aws-lc-rs provider")?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AcceptAny(provider)))
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

#[derive(Debug)]
struct AcceptAny(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AcceptAny {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
