//! One ACME issuance, start to end, through the instant-acme client: the account
//! (restored from storage, else registered and stored), a new order for the site's
//! names, the `tls-alpn-01` answers put where the TLS acceptor finds them, the
//! wait for the server's validation, a fresh key and CSR, the certificate. Every
//! request of the client is bounded by the caller's overall timeout; the challenge
//! answers are withdrawn however the order ends.

use std::sync::Arc;
use std::time::Duration;

use instant_acme::{
    Account, AccountCredentials, AuthorizationStatus, ChallengeType, Identifier, NewAccount, NewOrder,
    OrderStatus, RetryPolicy,
};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivatePkcs8KeyDer};
use rustls::sign::CertifiedKey;

use super::http01::Tokens;
use super::store::{self, CertFacts};
use super::AcmeError;
use crate::config::AcmeChallenge;
use crate::config::AcmeSource;
use crate::tls::alpn_challenge::AlpnChallenges;

/// How long the server may take to validate and to issue, polled with backoff.
const POLL: RetryPolicy = RetryPolicy::new()
    .initial_delay(Duration::from_millis(250))
    .backoff(1.5)
    .timeout(Duration::from_secs(90));

/// A certificate just obtained, with the PEM texts that were stored.
pub(super) struct Issued {
    pub key: CertifiedKey,
    pub facts: CertFacts,
}

/// The account for `source`'s directory: restored from storage, else registered
/// now (agreeing to the server's terms) and stored.
pub(super) async fn account(source: &AcmeSource) -> Result<Account, AcmeError> {
    // Over a client that caps response bodies (instant-acme's own reads them whole).
    let builder = || match &source.directory_ca {
        Some(ca) => super::client::Capped::with_ca(ca)
            .map(|c| Account::builder_with_http(Box::new(c)))
            .map_err(|e| AcmeError::Client {
                step: "load directory_ca",
                source: e,
            }),
        None => super::client::Capped::platform()
            .map(|c| Account::builder_with_http(Box::new(c)))
            .map_err(|e| AcmeError::Client {
                step: "start the HTTP client",
                source: e,
            }),
    };
    let file = store::account_file(source);
    if let Ok(text) = std::fs::read(&file) {
        if let Ok(credentials) = serde_json::from_slice::<AccountCredentials>(&text) {
            return builder()?
                .from_credentials(credentials)
                .await
                .map_err(|e| AcmeError::Client {
                    step: "restore the account",
                    source: e,
                });
        }
        tracing::warn!(path = %file.display(), "acme: stored account credentials are unreadable; registering a new account");
    }
    let contact = source.email.as_ref().map(|e| format!("mailto:{e}"));
    let contacts: Vec<&str> = contact.iter().map(String::as_str).collect();
    let new = NewAccount {
        contact: &contacts,
        terms_of_service_agreed: true,
        only_return_existing: false,
    };
    let (account, credentials) = builder()?
        .create(&new, source.directory.clone(), None)
        .await
        .map_err(|e| AcmeError::Client {
            step: "register an account",
            source: e,
        })?;
    let text = serde_json::to_vec(&credentials).map_err(|e| AcmeError::Certificate(e.to_string()))?;
    store::write_atomic_async(&file, text, 0o600).await?;
    Ok(account)
}

/// Orders a certificate for `source`'s names and stores it with its key.
pub(super) async fn obtain(
    account: &Account,
    source: &AcmeSource,
    challenges: &AlpnChallenges,
    tokens: &Tokens,
    provider: &CryptoProvider,
) -> Result<Issued, AcmeError> {
    let identifiers: Vec<Identifier> = source.names.iter().map(|n| Identifier::Dns(n.clone())).collect();
    let mut order = account
        .new_order(&NewOrder::new(&identifiers))
        .await
        .map_err(client("create the order"))?;
    let mut answered = Answered {
        challenges,
        tokens,
        names: Vec::new(),
        token_list: Vec::new(),
    };
    let kind = match source.challenge {
        AcmeChallenge::TlsAlpn01 => ChallengeType::TlsAlpn01,
        AcmeChallenge::Http01 => ChallengeType::Http01,
    };
    let mut authorizations = order.authorizations();
    while let Some(authz) = authorizations.next().await {
        let mut authz = authz.map_err(client("fetch an authorization"))?;
        match authz.status {
            AuthorizationStatus::Valid => continue,
            AuthorizationStatus::Pending => {}
            other => return Err(AcmeError::Refused(format!("an authorization is {other:?}"))),
        }
        let mut challenge = authz.challenge(kind.clone()).ok_or_else(|| {
            AcmeError::Refused(format!("the server offers no {} challenge", source.challenge))
        })?;
        // The server names what is validated; an identifier we did not ask for
        // would put a challenge answer (a certificate) up for any name.
        let name = challenge.identifier().to_string();
        requested(&source.names, &name)?;
        let put = match source.challenge {
            AcmeChallenge::TlsAlpn01 => {
                let answer =
                    challenge_cert(provider, &name, challenge.key_authorization().digest().as_ref())?;
                answered.names.push(name);
                challenges.insert(&answered.names[answered.names.len() - 1], Arc::new(answer))
            }
            AcmeChallenge::Http01 => {
                answered.token_list.push(challenge.token.clone());
                tokens.insert(&challenge.token, challenge.key_authorization().as_str())
            }
        };
        if !put {
            return Err(AcmeError::Refused("too many challenges pending".into()));
        }
        challenge
            .set_ready()
            .await
            .map_err(client("answer the challenge"))?;
    }
    let status = order
        .poll_ready(&POLL)
        .await
        .map_err(client("wait for validation"))?;
    if status != OrderStatus::Ready {
        let detail = order
            .state()
            .error
            .as_ref()
            .map_or_else(|| format!("the order is {status:?}"), |p| p.to_string());
        return Err(AcmeError::Refused(format!("validation failed: {detail}")));
    }
    drop(answered);
    let key = rcgen::KeyPair::generate().map_err(|e| AcmeError::Certificate(e.to_string()))?;
    let csr = rcgen::CertificateParams::new(source.names.clone())
        .and_then(|p| p.serialize_request(&key))
        .map_err(|e| AcmeError::Certificate(format!("cannot build the CSR: {e}")))?;
    order
        .finalize_csr(csr.der())
        .await
        .map_err(client("finalize the order"))?;
    let chain_pem = order
        .poll_certificate(&POLL)
        .await
        .map_err(client("download the certificate"))?;
    let chain = CertificateDer::pem_slice_iter(chain_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| AcmeError::Certificate(format!("the issued chain is not PEM: {e}")))?;
    let leaf = chain
        .first()
        .ok_or_else(|| AcmeError::Certificate("the issued chain is empty".into()))?;
    let facts = CertFacts::of(leaf)?;
    check_issued(leaf, &facts, &source.names, std::time::SystemTime::now())?;
    let der = PrivatePkcs8KeyDer::from(key.serialize_der());
    let signer = provider
        .key_provider
        .load_private_key(der.into())
        .map_err(|e| AcmeError::Certificate(e.to_string()))?;
    let certified = CertifiedKey::new(chain, signer);
    certified
        .keys_match()
        .map_err(|e| AcmeError::Certificate(format!("the issued certificate is not for our key: {e}")))?;
    // The key first: a crash between the two leaves a new key beside the old
    // certificate, which fails to load and is ordered again, never a mismatch served.
    let (cert_file, key_file) = source.files();
    store::write_atomic_async(&key_file, key.serialize_pem().into_bytes(), 0o600).await?;
    store::write_atomic_async(&cert_file, chain_pem.into_bytes(), 0o644).await?;
    Ok(Issued {
        key: certified,
        facts,
    })
}

/// Refuses an authorization for `name` when the order did not ask for it.
fn requested(names: &[String], name: &str) -> Result<(), AcmeError> {
    if names.iter().any(|n| n.eq_ignore_ascii_case(name)) {
        Ok(())
    } else {
        Err(AcmeError::Refused(format!(
            "the server asks to validate `{name}`, which this order did not request ({names:?})"
        )))
    }
}

/// Refuses an issued leaf that is not valid `now` or does not name exactly the
/// requested `names` (as DNS subject alternative names, nothing else): a server
/// must not get a certificate served that it was not asked for.
fn check_issued(
    leaf: &CertificateDer<'_>,
    facts: &CertFacts,
    names: &[String],
    now: std::time::SystemTime,
) -> Result<(), AcmeError> {
    if now < facts.not_before || now > facts.not_after {
        return Err(AcmeError::Certificate(format!(
            "the issued certificate is not valid now (valid from {} to {} s after the epoch)",
            epoch_secs(facts.not_before),
            epoch_secs(facts.not_after)
        )));
    }
    let (_, cert) = x509_parser::parse_x509_certificate(leaf.as_ref())
        .map_err(|e| AcmeError::Certificate(format!("the issued certificate cannot be read: {e}")))?;
    let san = cert
        .subject_alternative_name()
        .map_err(|e| AcmeError::Certificate(format!("the issued certificate's names cannot be read: {e}")))?
        .ok_or_else(|| AcmeError::Certificate("the issued certificate names no host".into()))?;
    let mut issued = Vec::new();
    for name in &san.value.general_names {
        match name {
            x509_parser::extensions::GeneralName::DNSName(n) => issued.push(n.to_ascii_lowercase()),
            other => {
                return Err(AcmeError::Certificate(format!(
                    "the issued certificate names `{other}`, which was not requested"
                )))
            }
        }
    }
    let mut wanted: Vec<String> = names.iter().map(|n| n.to_ascii_lowercase()).collect();
    issued.sort();
    issued.dedup();
    wanted.sort();
    wanted.dedup();
    if issued != wanted {
        return Err(AcmeError::Certificate(format!(
            "the issued certificate names {issued:?}, not the requested {wanted:?}"
        )));
    }
    Ok(())
}

fn epoch_secs(t: std::time::SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Names the protocol step an instant-acme error happened in.
fn client(step: &'static str) -> impl FnOnce(instant_acme::Error) -> AcmeError {
    move |source| AcmeError::Client { step, source }
}

/// The RFC 8737 certificate that answers `name`'s challenge: self-signed, for that
/// name only, with the critical acmeIdentifier extension holding `digest` (the
/// SHA-256 of the key authorization).
fn challenge_cert(provider: &CryptoProvider, name: &str, digest: &[u8]) -> Result<CertifiedKey, AcmeError> {
    let err =
        |e: rcgen::Error| AcmeError::Certificate(format!("cannot build the tls-alpn-01 certificate: {e}"));
    let mut params = rcgen::CertificateParams::new(vec![name.to_owned()]).map_err(err)?;
    params
        .custom_extensions
        .push(rcgen::CustomExtension::new_acme_identifier(digest));
    let key = rcgen::KeyPair::generate().map_err(err)?;
    let cert = params.self_signed(&key).map_err(err)?;
    let signer = provider
        .key_provider
        .load_private_key(PrivatePkcs8KeyDer::from(key.serialize_der()).into())
        .map_err(|e| AcmeError::Certificate(e.to_string()))?;
    Ok(CertifiedKey::new(vec![cert.der().clone()], signer))
}

/// Withdraws the challenge answers when the order is done with them, however it ends.
struct Answered<'a> {
    challenges: &'a AlpnChallenges,
    tokens: &'a Tokens,
    names: Vec<String>,
    token_list: Vec<String>,
}

impl Drop for Answered<'_> {
    fn drop(&mut self) {
        for name in &self.names {
            self.challenges.remove(name);
        }
        for token in &self.token_list {
            self.tokens.remove(token);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, SystemTime};

    fn cert(names: &[&str]) -> CertificateDer<'static> {
        let key = rcgen::KeyPair::generate().unwrap();
        let params =
            rcgen::CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>()).unwrap();
        params.self_signed(&key).unwrap().der().clone()
    }

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|n| (*n).to_owned()).collect()
    }

    #[test]
    fn an_issued_certificate_must_name_exactly_the_requested_names() {
        let leaf = cert(&["a.example", "b.example"]);
        let facts = CertFacts::of(&leaf).unwrap();
        let now = SystemTime::now();
        check_issued(&leaf, &facts, &names(&["b.example", "A.example"]), now).unwrap();
        for wanted in [
            &["a.example"][..],
            &["a.example", "b.example", "c.example"],
            &["other.example"],
        ] {
            let err = check_issued(&leaf, &facts, &names(wanted), now).unwrap_err();
            assert!(err.to_string().contains("not the requested"), "{err}");
        }
    }

    #[test]
    fn an_issued_certificate_must_be_valid_now() {
        let leaf = cert(&["a.example"]);
        let facts = CertFacts::of(&leaf).unwrap();
        let wanted = names(&["a.example"]);
        let long_after = facts.not_after + Duration::from_secs(1);
        let err = check_issued(&leaf, &facts, &wanted, long_after).unwrap_err();
        assert!(err.to_string().contains("not valid now"), "{err}");
        let before = facts.not_before - Duration::from_secs(1);
        assert!(check_issued(&leaf, &facts, &wanted, before).is_err());
    }

    #[test]
    fn an_identifier_not_requested_is_refused() {
        let wanted = names(&["a.example"]);
        requested(&wanted, "A.Example").unwrap();
        let err = requested(&wanted, "victim.example").unwrap_err();
        assert!(err.to_string().contains("did not request"), "{err}");
    }
}
