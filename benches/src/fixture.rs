//! The download fixture and the TLS identity both servers present.
//!
//! The fixture is pseudo-random so that no layer (TLS, HTTP, the page cache)
//! can compress or deduplicate it, and seeded so every run and every host
//! serves the same bytes. It is kept between runs because writing 100 MB is
//! slower than checking it.

use std::fs::{self, File};
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};

/// The fixture size used for the published capacity figures (SPEC.md).
pub const FIXTURE_BYTES: u64 = 99_943_778;
/// The file name under the served root.
pub const FIXTURE_NAME: &str = "fixture.bin";

/// The same xorshift64* stream as the end-to-end suite's fixture and the WebTransport
/// endpoint's source mode (`webtransport::diag::Pattern`), so one digest checks all.
const SEED: u64 = 0x9E37_79B9_7F4A_7C15;
const CHUNK: usize = 1 << 20;

#[derive(Debug)]
pub struct Fixture {
    pub path: PathBuf,
    pub sha256: [u8; 32],
}

/// Returns the fixture under `root`, regenerating it unless the file on disk
/// already has the expected size and digest.
pub fn ensure(root: &Path) -> Result<Fixture> {
    fs::create_dir_all(root).with_context(|| format!("creating fixture directory {}", root.display()))?;
    let path = root.join(FIXTURE_NAME);
    let expected = expected_digest();

    let on_disk = fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    if on_disk == FIXTURE_BYTES && file_digest(&path)? == expected {
        return Ok(Fixture {
            path,
            sha256: expected,
        });
    }

    eprintln!("writing fixture {} ({FIXTURE_BYTES} bytes)", path.display());
    let mut out =
        BufWriter::new(File::create(&path).with_context(|| format!("creating fixture {}", path.display()))?);
    generate(|chunk| out.write_all(chunk))?;
    out.into_inner()
        .map_err(|e| e.into_error())
        .and_then(|f| f.sync_all())
        .with_context(|| format!("writing fixture {}", path.display()))?;

    if file_digest(&path)? != expected {
        bail!(
            "fixture {} does not read back as written; is the disk full?",
            path.display()
        );
    }
    Ok(Fixture {
        path,
        sha256: expected,
    })
}

/// SHA-256 of a file, read in bounded chunks.
pub fn file_digest(path: &Path) -> Result<[u8; 32]> {
    let mut file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; CHUNK];
    loop {
        let n = file
            .read(&mut buf)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher.finalize().into())
}

pub fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// The digest the generator produces, computed without touching the disk.
fn expected_digest() -> [u8; 32] {
    let mut hasher = Sha256::new();
    let _ = generate(|chunk| {
        hasher.update(chunk);
        Ok(())
    });
    hasher.finalize().into()
}

/// Feeds exactly `FIXTURE_BYTES` of xorshift64* output to `sink`, one reused chunk at a time.
fn generate(mut sink: impl FnMut(&[u8]) -> std::io::Result<()>) -> Result<()> {
    let mut state = SEED;
    let mut buf = vec![0u8; CHUNK];
    let mut left = FIXTURE_BYTES;
    while left > 0 {
        for word in buf.chunks_exact_mut(8) {
            word.copy_from_slice(&next_word(&mut state).to_le_bytes());
        }
        let n = usize::try_from(left).map_or(CHUNK, |left| left.min(CHUNK));
        sink(&buf[..n])?;
        left -= n as u64;
    }
    Ok(())
}

/// One xorshift64* step: the next 8 bytes of the stream, little-endian.
fn next_word(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

/// Checks a body against the fixture byte for byte as it arrives, by running the
/// generator beside it: exact like a digest, and cheap enough (a compare per
/// 8 bytes) that verifying every sample does not make the client the bottleneck,
/// which SHA-256 at about 1.3 GB/s on one core would. [`Checker::with_sha256`]
/// also hashes, for the one untimed download per cell.
#[derive(Debug)]
pub struct Checker {
    sha256: Option<Sha256>,
    state: u64,
    /// The current generator word and how many of its bytes were compared.
    word: [u8; 8],
    used: usize,
    offset: u64,
    /// The first offset that differed.
    mismatch: Option<u64>,
}

impl Default for Checker {
    fn default() -> Self {
        Self {
            sha256: None,
            state: SEED,
            word: [0; 8],
            used: 8,
            offset: 0,
            mismatch: None,
        }
    }
}

impl Checker {
    /// A checker that also computes the body's SHA-256 (reported by [`Checker::verdict`]).
    pub fn with_sha256() -> Self {
        Self {
            sha256: Some(Sha256::new()),
            ..Self::default()
        }
    }

    pub fn update(&mut self, data: &[u8]) {
        if let Some(hasher) = &mut self.sha256 {
            hasher.update(data);
        }
        self.compare(data);
    }

    fn compare(&mut self, mut data: &[u8]) {
        if self.mismatch.is_some() {
            self.offset += data.len() as u64;
            return;
        }
        // The rest of a word a previous chunk started.
        while self.used < 8 && !data.is_empty() {
            if data[0] != self.word[self.used] {
                self.mismatch = Some(self.offset);
            }
            self.used += 1;
            self.offset += 1;
            data = &data[1..];
        }
        if self.mismatch.is_some() {
            self.offset += data.len() as u64;
            return;
        }
        let end = self.offset + data.len() as u64;
        let mut words = data.chunks_exact(8);
        for chunk in &mut words {
            let want = next_word(&mut self.state).to_le_bytes();
            if chunk != want {
                let at = chunk.iter().zip(want).position(|(a, b)| *a != b).unwrap_or(0);
                self.mismatch = Some(self.offset + at as u64);
                self.offset = end;
                return;
            }
            self.offset += 8;
        }
        let rest = words.remainder();
        if !rest.is_empty() {
            self.word = next_word(&mut self.state).to_le_bytes();
            self.used = 0;
            self.compare(rest);
        }
    }

    /// Bytes checked so far.
    pub fn len(&self) -> u64 {
        self.offset
    }

    /// "exact" when all of `expected_len` bytes, and no more, matched the fixture,
    /// followed by " sha256=HEX" when hashing.
    pub fn verdict(self, expected_len: u64) -> String {
        let verdict = match self.mismatch {
            Some(at) => format!("differs from the fixture at byte {at} of {}", self.offset),
            None if self.offset != expected_len => {
                format!("{} bytes, expected {expected_len}", self.offset)
            }
            None => EXACT.to_owned(),
        };
        match self.sha256 {
            Some(hasher) => format!("{verdict} sha256={}", hex(&hasher.finalize())),
            None => verdict,
        }
    }
}

/// [`Checker::verdict`] for a body that matched.
pub const EXACT: &str = "exact";

/// A self-signed certificate for localhost / 127.0.0.1, written as PEM files.
#[derive(Debug)]
pub struct Identity {
    pub cert: PathBuf,
    pub key: PathBuf,
}

pub fn write_identity(dir: &Path) -> Result<Identity> {
    let certified = rcgen::generate_simple_self_signed(["localhost".to_owned(), "127.0.0.1".to_owned()])
        .context("generating a self-signed certificate")?;
    let identity = Identity {
        cert: dir.join("cert.pem"),
        key: dir.join("key.pem"),
    };
    fs::write(&identity.cert, certified.cert.pem())
        .with_context(|| format!("writing {}", identity.cert.display()))?;
    fs::write(&identity.key, certified.key_pair.serialize_pem())
        .with_context(|| format!("writing {}", identity.key.display()))?;
    Ok(identity)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first `n` bytes of the fixture, from the generator.
    fn fixture(n: usize) -> Vec<u8> {
        let mut out = Vec::new();
        let _ = generate(|chunk| {
            out.extend_from_slice(chunk);
            Ok(())
        });
        out.truncate(n);
        out
    }

    #[test]
    fn checker_accepts_the_fixture_in_any_chunking() {
        let body = fixture(10_000);
        for split in [1, 3, 8, 13, 4096, 10_000] {
            let mut check = Checker::default();
            for chunk in body.chunks(split) {
                check.update(chunk);
            }
            assert_eq!(check.len(), 10_000);
            assert_eq!(check.verdict(10_001), "10000 bytes, expected 10001");
        }
        let mut check = Checker::default();
        check.update(&body);
        assert_eq!(check.verdict(10_000), EXACT);
        let mut check = Checker::with_sha256();
        check.update(&body);
        assert_eq!(
            check.verdict(10_000),
            format!("{EXACT} sha256={}", hex(&Sha256::digest(&body)))
        );
    }

    /// The whole fixture, through the checker, hashes to the digest the runner expects.
    #[test]
    fn checked_fixture_has_the_expected_digest() {
        let mut check = Checker::with_sha256();
        generate(|chunk| {
            check.update(chunk);
            Ok(())
        })
        .expect("generates");
        assert_eq!(
            check.verdict(FIXTURE_BYTES),
            format!("{EXACT} sha256={}", hex(&expected_digest()))
        );
    }

    #[test]
    fn checker_finds_the_first_wrong_byte() {
        for at in [0, 5, 8, 4099, 9_999] {
            let mut body = fixture(10_000);
            body[at] ^= 0x40;
            for split in [7, 8, 1000] {
                let mut check = Checker::default();
                for chunk in body.chunks(split) {
                    check.update(chunk);
                }
                assert_eq!(
                    check.verdict(10_000),
                    format!("differs from the fixture at byte {at} of 10000"),
                    "chunks of {split}"
                );
            }
        }
    }
}
