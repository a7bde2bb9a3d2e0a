//! What a client does with response body bytes as they arrive: a [`Sink`]. The
//! clients are written once, generic over it, so a test keeps and hashes a body
//! ([`Collect`]) while a timed benchmark download only compares it with the fixture
//! stream ([`Checker`]: no copy, no hash per chunk).

use http::{HeaderMap, StatusCode};
use sha2::{Digest, Sha256};

use crate::fixture::{hex, Checker};

/// Receives a body chunk by chunk.
pub trait Sink {
    fn update(&mut self, data: &[u8]);

    /// The trailers after the body, if any came.
    fn trailers(&mut self, _trailers: &HeaderMap) {}
}

impl Sink for Checker {
    fn update(&mut self, data: &[u8]) {
        Checker::update(self, data);
    }
}

/// The whole body, for small ones a test compares byte for byte.
impl Sink for Vec<u8> {
    fn update(&mut self, data: &[u8]) {
        self.extend_from_slice(data);
    }
}

impl Sink for Sha256 {
    fn update(&mut self, data: &[u8]) {
        Digest::update(self, data);
    }
}

/// Bodies up to this size are kept by [`Collect`]; larger ones are only hashed.
pub const KEEP: u64 = 4 * 1024 * 1024;

/// Counts, hashes and keeps (up to [`KEEP`] bytes) a body, and keeps its trailers:
/// what tests assert on.
#[derive(Debug, Default)]
pub struct Collect {
    hasher: Sha256,
    len: u64,
    kept: Vec<u8>,
    trailers: Option<HeaderMap>,
}

impl Sink for Collect {
    fn update(&mut self, data: &[u8]) {
        Digest::update(&mut self.hasher, data);
        self.len += data.len() as u64;
        if self.len <= KEEP {
            self.kept.extend_from_slice(data);
        }
    }

    fn trailers(&mut self, trailers: &HeaderMap) {
        self.trailers = Some(trailers.clone());
    }
}

impl Collect {
    /// The response with head `parts`, as tests see it.
    pub fn into_fetched(self, parts: http::response::Parts) -> Fetched {
        Fetched {
            status: parts.status,
            headers: parts.headers,
            len: self.len,
            sha256: self.hasher.finalize().into(),
            body: self.kept,
            trailers: self.trailers,
        }
    }
}

/// One response, read to its end.
#[derive(Debug)]
pub struct Fetched {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub len: u64,
    pub sha256: [u8; 32],
    /// The whole body when it is at most [`KEEP`] bytes, else its first bytes.
    pub body: Vec<u8>,
    pub trailers: Option<HeaderMap>,
}

impl Fetched {
    /// The value of header `name`, or "" when absent or not text.
    pub fn header(&self, name: &str) -> &str {
        self.headers.get(name).map_or("", |v| v.to_str().unwrap_or(""))
    }
}

/// What a client got of one response: read to its end, or up to the error that
/// cut it short (`error` says what), for tests of failures mid-body.
#[derive(Debug)]
pub struct Outcome {
    pub fetched: Fetched,
    pub error: Option<String>,
}

impl std::ops::Deref for Outcome {
    type Target = Fetched;

    fn deref(&self) -> &Fetched {
        &self.fetched
    }
}

/// The benches' body check: every byte against the fixture stream ([`Checker`]),
/// and with [`FixtureCheck::with_sha256`] a SHA-256 too, for the untimed download.
#[derive(Debug, Default)]
pub struct FixtureCheck {
    check: Checker,
    sha256: Option<Sha256>,
}

impl Sink for FixtureCheck {
    fn update(&mut self, data: &[u8]) {
        if let Some(hasher) = &mut self.sha256 {
            Digest::update(hasher, data);
        }
        self.check.update(data);
    }
}

impl FixtureCheck {
    pub fn new(sha256: bool) -> Self {
        Self {
            check: Checker::default(),
            sha256: sha256.then(Sha256::new),
        }
    }

    /// Bytes checked so far.
    pub fn len(&self) -> u64 {
        self.check.len()
    }

    /// Whether no byte was checked yet.
    pub fn is_empty(&self) -> bool {
        self.check.is_empty()
    }

    /// [`Checker::verdict`], followed by " sha256=HEX" when hashing.
    pub fn verdict(self, expected_len: u64) -> String {
        let verdict = self.check.verdict(expected_len);
        match self.sha256 {
            Some(hasher) => format!("{verdict} sha256={}", hex(&hasher.finalize())),
            None => verdict,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixture::{file::expected_sha256, generate, EXACT, FIXTURE_LEN};

    /// The whole fixture, through the check, hashes to the digest the runner expects.
    #[test]
    fn checked_fixture_has_the_expected_digest() {
        let mut check = FixtureCheck::new(true);
        generate::<()>(FIXTURE_LEN, |chunk| {
            check.update(chunk);
            Ok(())
        })
        .expect("generates");
        assert_eq!(
            check.verdict(FIXTURE_LEN),
            format!("{EXACT} sha256={}", hex(&expected_sha256()))
        );
    }

    #[test]
    fn a_short_body_says_so_with_its_digest() {
        let mut body = vec![0u8; 100];
        crate::fixture::Pattern::default().fill(&mut body);
        let mut check = FixtureCheck::new(true);
        check.update(&body);
        assert_eq!(
            check.verdict(101),
            format!("100 bytes, expected 101 sha256={}", hex(&Sha256::digest(&body)))
        );
    }
}
