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
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            word.copy_from_slice(&state.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
        }
        let n = usize::try_from(left).map_or(CHUNK, |left| left.min(CHUNK));
        sink(&buf[..n])?;
        left -= n as u64;
    }
    Ok(())
}

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
