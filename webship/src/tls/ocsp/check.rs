//! OCSP without I/O: the request for a certificate, and the checks a response must
//! pass before it is stapled (RFC 6960), as typed DER (`x509-ocsp`, `x509-cert`).
//!
//! What is verified: the response is `successful` and `basic`; it holds a
//! `SingleResponse` for exactly this certificate (the CertID: SHA-1 of the issuer's
//! name and key, the serial); it is signed, over the bytes of `tbsResponseData` as
//! received, either by the issuer's key or by a delegated responder certificate that
//! the issuer signed, that carries the `OCSPSigning` extended key usage and is valid
//! now; its `thisUpdate` is not in the future (beyond [`SKEW`]) and its `nextUpdate`,
//! when present, not past. Signatures are checked by the crypto provider's WebPKI
//! algorithms (the ones rustls verifies certificates with).

use std::time::{Duration, SystemTime};

use aws_lc_rs::digest;
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::CertificateDer;
use x509_cert::der::asn1::{Null, OctetString};
use x509_cert::der::oid::db::rfc5280::{ID_AD_OCSP, ID_KP_OCSP_SIGNING};
use x509_cert::der::oid::db::rfc5912::ID_SHA_1;
use x509_cert::der::{Any, AnyRef, Decode, Encode, Header, Reader, SliceReader};
use x509_cert::ext::pkix::name::GeneralName;
use x509_cert::ext::pkix::{AuthorityInfoAccessSyntax, ExtendedKeyUsage};
use x509_cert::spki::AlgorithmIdentifierOwned;
use x509_cert::Certificate;
use x509_ocsp::{
    BasicOcspResponse, CertId, CertStatus, OcspRequest, OcspResponse, OcspResponseStatus, Request,
    ResponderId, TbsRequest,
};

/// How far a responder's clock may run ahead of ours.
pub(crate) const SKEW: Duration = Duration::from_secs(300);

/// Why a certificate cannot be stapled, or a response was not accepted.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CheckError {
    #[error("the certificate cannot be read as X.509: {0}")]
    Leaf(String),
    #[error("the chain has no issuer certificate after the leaf (fix: configure the full chain, e.g. certbot's fullchain.pem)")]
    NoIssuer,
    #[error("the issuer certificate cannot be read as X.509: {0}")]
    Issuer(String),
    #[error("the response is not DER an OCSP response can be read from: {0}")]
    Malformed(String),
    #[error("the responder answered `{0}` instead of `successful`")]
    Status(&'static str),
    #[error("the response holds no answer for this certificate (serial {0})")]
    NotForThis(String),
    #[error("the response's signature does not verify: {0}")]
    Signature(String),
    #[error("the response is not current: {0}")]
    Stale(String),
}

/// A certificate the responder is asked about.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    /// The responder's URL from the leaf's Authority Information Access.
    pub(crate) url: String,
    /// The leaf's serial number in hex, for log lines.
    pub(crate) serial: String,
    cert_id: CertId,
    issuer: Certificate,
    /// The DER `OCSPRequest` to POST.
    pub(crate) request: Vec<u8>,
}

/// What a verified response says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Answer {
    pub(crate) status: Status,
    pub(crate) this_update: SystemTime,
    pub(crate) next_update: Option<SystemTime>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    Good,
    Revoked,
    Unknown,
}

/// The request for `chain`'s leaf, or `None` when the leaf names no OCSP responder
/// (nothing to staple).
pub(crate) fn target(chain: &[CertificateDer<'_>]) -> Result<Option<Target>, CheckError> {
    let leaf_der = chain.first().ok_or(CheckError::Leaf("empty chain".into()))?;
    let leaf = Certificate::from_der(leaf_der).map_err(|e| CheckError::Leaf(e.to_string()))?;
    let Some(url) = responder_url(&leaf)? else {
        return Ok(None);
    };
    let issuer_der = chain.get(1).ok_or(CheckError::NoIssuer)?;
    let issuer = Certificate::from_der(issuer_der).map_err(|e| CheckError::Issuer(e.to_string()))?;
    let serial = leaf.tbs_certificate.serial_number.clone();
    let name = issuer
        .tbs_certificate
        .subject
        .to_der()
        .map_err(|e| CheckError::Issuer(e.to_string()))?;
    let octets = |bytes: &[u8]| OctetString::new(sha1(bytes)).map_err(|e| CheckError::Issuer(e.to_string()));
    let cert_id = CertId {
        hash_algorithm: AlgorithmIdentifierOwned {
            oid: ID_SHA_1,
            parameters: Some(Any::from(Null)),
        },
        issuer_name_hash: octets(&name)?,
        issuer_key_hash: octets(spki_bits(&issuer))?,
        serial_number: serial.clone(),
    };
    let request = OcspRequest {
        tbs_request: TbsRequest {
            request_list: vec![Request {
                req_cert: cert_id.clone(),
                single_request_extensions: None,
            }],
            ..TbsRequest::default()
        },
        optional_signature: None,
    }
    .to_der()
    .map_err(|e| CheckError::Leaf(e.to_string()))?;
    Ok(Some(Target {
        url,
        serial: hex(serial.as_bytes()),
        cert_id,
        issuer,
        request,
    }))
}

/// The first `http://` OCSP location of the leaf's Authority Information Access.
fn responder_url(leaf: &Certificate) -> Result<Option<String>, CheckError> {
    let aia = leaf
        .tbs_certificate
        .get::<AuthorityInfoAccessSyntax>()
        .map_err(|e| CheckError::Leaf(e.to_string()))?;
    Ok(aia.into_iter().flat_map(|(_, aia)| aia.0).find_map(|d| {
        match (d.access_method == ID_AD_OCSP, d.access_location) {
            (true, GeneralName::UniformResourceIdentifier(uri)) if uri.as_str().starts_with("http://") => {
                Some(uri.as_str().to_owned())
            }
            _ => None,
        }
    }))
}

/// Checks `response` (DER, as the responder sent it) for `target` at `now`.
pub(crate) fn verify(
    target: &Target,
    response: &[u8],
    algs: &WebPkiSupportedAlgorithms,
    now: SystemTime,
) -> Result<Answer, CheckError> {
    let malformed = |e: x509_cert::der::Error| CheckError::Malformed(e.to_string());
    let outer = OcspResponse::from_der(response).map_err(malformed)?;
    if outer.response_status != OcspResponseStatus::Successful {
        return Err(CheckError::Status(status_name(outer.response_status)));
    }
    let bytes = outer
        .response_bytes
        .ok_or_else(|| CheckError::Malformed("`successful` without a response".into()))?;
    if bytes.response_type != x509_cert::der::oid::db::rfc6960::ID_PKIX_OCSP_BASIC {
        return Err(CheckError::Malformed(format!(
            "response type {} is not basic",
            bytes.response_type
        )));
    }
    let raw = bytes.response.as_bytes();
    let basic = BasicOcspResponse::from_der(raw).map_err(malformed)?;
    let single = basic
        .tbs_response_data
        .responses
        .iter()
        .find(|r| r.cert_id == target.cert_id)
        .ok_or_else(|| CheckError::NotForThis(target.serial.clone()))?;
    let signer = signer(target, &basic, algs, now)?;
    let tbs = first_element(raw).map_err(malformed)?;
    check_signature(
        algs,
        signer,
        &basic.signature_algorithm,
        tbs,
        basic.signature.raw_bytes(),
    )
    .map_err(|e| CheckError::Signature(format!("response: {e}")))?;
    let this_update = at(single.this_update.0.to_unix_duration());
    let next_update = single.next_update.map(|t| at(t.0.to_unix_duration()));
    if this_update > now + SKEW {
        return Err(CheckError::Stale("its thisUpdate is in the future".into()));
    }
    if next_update.is_some_and(|next| next <= now) {
        return Err(CheckError::Stale("its nextUpdate has passed".into()));
    }
    let status = match single.cert_status {
        CertStatus::Good(_) => Status::Good,
        CertStatus::Revoked(_) => Status::Revoked,
        CertStatus::Unknown(_) => Status::Unknown,
    };
    Ok(Answer {
        status,
        this_update,
        next_update,
    })
}

/// The certificate whose key signed the response: the issuer itself, or a delegated
/// responder certificate in the response that the issuer signed for OCSP signing.
fn signer<'a>(
    target: &'a Target,
    basic: &'a BasicOcspResponse,
    algs: &WebPkiSupportedAlgorithms,
    now: SystemTime,
) -> Result<&'a Certificate, CheckError> {
    let names = |cert: &Certificate| match &basic.tbs_response_data.responder_id {
        ResponderId::ByName(name) => *name == cert.tbs_certificate.subject,
        ResponderId::ByKey(hash) => hash.as_bytes() == sha1(spki_bits(cert)).as_slice(),
    };
    if names(&target.issuer) {
        return Ok(&target.issuer);
    }
    let delegate = basic.certs.iter().flatten().find(|c| names(c)).ok_or_else(|| {
        CheckError::Signature("signed by neither the issuer nor a certificate it carries".into())
    })?;
    let refuse = |why: &str| CheckError::Signature(format!("delegated responder certificate: {why}"));
    if delegate.tbs_certificate.issuer != target.issuer.tbs_certificate.subject {
        return Err(refuse("not issued by the certificate's issuer"));
    }
    let tbs = delegate
        .tbs_certificate
        .to_der()
        .map_err(|e| refuse(&e.to_string()))?;
    check_signature(
        algs,
        &target.issuer,
        &delegate.signature_algorithm,
        &tbs,
        delegate.signature.raw_bytes(),
    )
    .map_err(|e| refuse(&e))?;
    let ocsp_signing = delegate
        .tbs_certificate
        .get::<ExtendedKeyUsage>()
        .ok()
        .flatten()
        .is_some_and(|(_, eku)| eku.0.contains(&ID_KP_OCSP_SIGNING));
    if !ocsp_signing {
        return Err(refuse("no OCSPSigning extended key usage"));
    }
    let validity = &delegate.tbs_certificate.validity;
    if now < at(validity.not_before.to_unix_duration()) || now > at(validity.not_after.to_unix_duration()) {
        return Err(refuse("not valid now"));
    }
    Ok(delegate)
}

/// Verifies `signature` over `message` with `signer`'s key, by the provider's
/// algorithm whose identifiers match the signature's and the key's.
fn check_signature(
    algs: &WebPkiSupportedAlgorithms,
    signer: &Certificate,
    signature_alg: &AlgorithmIdentifierOwned,
    message: &[u8],
    signature: &[u8],
) -> Result<(), String> {
    let sig_id = contents(signature_alg)?;
    let key_id = contents(&signer.tbs_certificate.subject_public_key_info.algorithm)?;
    let alg = algs
        .all
        .iter()
        .find(|a| a.signature_alg_id().as_ref() == sig_id && a.public_key_alg_id().as_ref() == key_id)
        .ok_or_else(|| format!("unsupported signature algorithm {}", signature_alg.oid))?;
    alg.verify_signature(spki_bits(signer), message, signature)
        .map_err(|_| "bad signature".to_owned())
}

/// An AlgorithmIdentifier's DER without its SEQUENCE header (how WebPKI names them).
fn contents(alg: &AlgorithmIdentifierOwned) -> Result<Vec<u8>, String> {
    let der = alg.to_der().map_err(|e| e.to_string())?;
    let any = AnyRef::from_der(&der).map_err(|e| e.to_string())?;
    Ok(any.value().to_vec())
}

/// The first element of a DER SEQUENCE, header included, exactly as encoded: what a
/// signature covers must not go through a decode and re-encode.
fn first_element(der: &[u8]) -> Result<&[u8], x509_cert::der::Error> {
    let outer = AnyRef::from_der(der)?;
    let inner = outer.value();
    let mut reader = SliceReader::new(inner)?;
    let header = Header::decode(&mut reader)?;
    let len = usize::try_from(reader.position())? + usize::try_from(header.length)?;
    inner.get(..len).ok_or_else(|| {
        x509_cert::der::ErrorKind::Incomplete {
            expected_len: header.length,
            actual_len: x509_cert::der::Length::try_from(inner.len()).unwrap_or_default(),
        }
        .into()
    })
}

fn at(since_epoch: Duration) -> SystemTime {
    SystemTime::UNIX_EPOCH + since_epoch
}

fn spki_bits(cert: &Certificate) -> &[u8] {
    cert.tbs_certificate
        .subject_public_key_info
        .subject_public_key
        .raw_bytes()
}

fn sha1(bytes: &[u8]) -> Vec<u8> {
    digest::digest(&digest::SHA1_FOR_LEGACY_USE_ONLY, bytes)
        .as_ref()
        .to_vec()
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02X}")).collect()
}

fn status_name(status: OcspResponseStatus) -> &'static str {
    match status {
        OcspResponseStatus::Successful => "successful",
        OcspResponseStatus::MalformedRequest => "malformedRequest",
        OcspResponseStatus::InternalError => "internalError",
        OcspResponseStatus::TryLater => "tryLater",
        OcspResponseStatus::SigRequired => "sigRequired",
        OcspResponseStatus::Unauthorized => "unauthorized",
    }
}

#[cfg(test)]
mod tests {
    //! Responses captured from `openssl ocsp` (offline, `-reqin`/`-respout`) over a
    //! fixture CA: `leaf` good, `revoked` revoked; `delegated` signed by a responder
    //! certificate the CA issued with OCSPSigning, `rogue` by one the CA issued
    //! without it. All produced at [`PRODUCED`], with a `nextUpdate` 7 days on.
    use super::*;
    use rustls::pki_types::pem::PemObject;

    const PRODUCED: u64 = 1_796_410_623;
    const CA: &[u8] = include_bytes!("testdata/ca.pem");

    fn chain(leaf: &[u8]) -> Vec<CertificateDer<'static>> {
        [leaf, CA]
            .iter()
            .map(|pem| CertificateDer::from_pem_slice(pem).unwrap())
            .collect()
    }

    fn at(secs_after: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(PRODUCED + secs_after)
    }

    fn algs() -> WebPkiSupportedAlgorithms {
        crate::tls::provider().signature_verification_algorithms
    }

    fn leaf() -> Target {
        target(&chain(include_bytes!("testdata/leaf.pem")))
            .unwrap()
            .unwrap()
    }

    #[test]
    fn the_request_names_the_responder_and_the_serial() {
        let t = leaf();
        assert_eq!(t.url, "http://127.0.0.1:9/ocsp");
        assert_eq!(t.serial, "2000");
        let req = OcspRequest::from_der(&t.request).unwrap();
        assert_eq!(req.tbs_request.request_list[0].req_cert, t.cert_id);
        let no_aia = crate::tls::certs::self_signed(&crate::tls::provider(), &["a.test".into()]).unwrap();
        assert!(target(&no_aia.cert).unwrap().is_none(), "no AIA: nothing to ask");
        let alone = chain(include_bytes!("testdata/leaf.pem"))[..1].to_vec();
        assert!(matches!(target(&alone), Err(CheckError::NoIssuer)));
    }

    #[test]
    fn a_good_answer_signed_by_the_issuer_or_its_delegate_verifies() {
        let t = leaf();
        for file in [
            &include_bytes!("testdata/good.der")[..],
            include_bytes!("testdata/delegated.der"),
        ] {
            let answer = verify(&t, file, &algs(), at(60)).unwrap();
            assert_eq!(answer.status, Status::Good);
            assert_eq!(answer.this_update, at(0));
            assert_eq!(answer.next_update, Some(at(7 * 86_400)));
        }
    }

    #[test]
    fn a_revoked_answer_says_so() {
        let t = target(&chain(include_bytes!("testdata/revoked.pem")))
            .unwrap()
            .unwrap();
        let answer = verify(&t, include_bytes!("testdata/revoked.der"), &algs(), at(60)).unwrap();
        assert_eq!(answer.status, Status::Revoked);
    }

    #[test]
    fn bad_answers_are_refused() {
        let t = leaf();
        let good = include_bytes!("testdata/good.der");
        let e = verify(&t, include_bytes!("testdata/rogue.der"), &algs(), at(60)).unwrap_err();
        assert!(e.to_string().contains("no OCSPSigning"), "{e}");
        // Another certificate's answer.
        let e = verify(&t, include_bytes!("testdata/revoked.der"), &algs(), at(60)).unwrap_err();
        assert!(matches!(e, CheckError::NotForThis(_)), "{e}");
        // One bit of the signed data changed: the producedAt seconds digit.
        let mut tampered = good.to_vec();
        let pos = tampered
            .windows(15)
            .position(|w| w == b"20261204185703Z")
            .unwrap();
        tampered[pos + 13] = b'4';
        let e = verify(&t, &tampered, &algs(), at(60)).unwrap_err();
        assert!(matches!(e, CheckError::Signature(_)), "{e}");
        let e = verify(&t, good, &algs(), at(8 * 86_400)).unwrap_err();
        assert!(e.to_string().contains("nextUpdate has passed"), "{e}");
        let e = verify(
            &t,
            good,
            &algs(),
            SystemTime::UNIX_EPOCH + Duration::from_secs(PRODUCED - 3600),
        )
        .unwrap_err();
        assert!(e.to_string().contains("thisUpdate is in the future"), "{e}");
        for cut in [0, 5, good.len() - 1] {
            assert!(verify(&t, &good[..cut], &algs(), at(60)).is_err());
        }
        let e = verify(&t, &[0x30, 0x03, 0x0a, 0x01, 0x03], &algs(), at(60)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "the responder answered `tryLater` instead of `successful`"
        );
    }
}
