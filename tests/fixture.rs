//! The deterministic 99,943,778-byte fixture, generated at test time (never committed)
//! once per test process, and its SHA-256.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use sha2::{Digest, Sha256};

/// The size of the published capacity fixture.
pub const FIXTURE_LEN: u64 = 99_943_778;

pub struct Fixture {
    pub path: PathBuf,
    pub sha256: [u8; 32],
}

impl Fixture {
    /// Hard-links the fixture into `dir` (a server root) as `name`.
    pub fn place(&self, dir: &Path, name: &str) -> PathBuf {
        let target = dir.join(name);
        if std::fs::hard_link(&self.path, &target).is_err() {
            std::fs::copy(&self.path, &target).unwrap();
        }
        target
    }
}

/// The fixture, generated on first use.
pub fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        // One fixed place, reused across runs: regenerating 100 MB per run is waste,
        // and the digest is recomputed from disk either way.
        let dir = std::env::temp_dir().join("webship-e2e-fixture");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("fixture.bin");
        if std::fs::metadata(&path).is_ok_and(|m| m.len() == FIXTURE_LEN) {
            let sha256 = sha256_file(&path);
            return Fixture { path, sha256 };
        }
        let partial = dir.join(format!("fixture.{}.partial", std::process::id()));
        let mut file = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(&partial).unwrap());
        let mut hasher = Sha256::new();
        let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut block = vec![0u8; 1 << 20];
        let mut left = FIXTURE_LEN;
        while left > 0 {
            for word in block.chunks_exact_mut(8) {
                // xorshift64*: cheap, deterministic, incompressible enough.
                state ^= state >> 12;
                state ^= state << 25;
                state ^= state >> 27;
                word.copy_from_slice(&state.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
            }
            let n = left.min(block.len() as u64) as usize;
            hasher.update(&block[..n]);
            file.write_all(&block[..n]).unwrap();
            left -= n as u64;
        }
        file.flush().unwrap();
        drop(file);
        std::fs::rename(&partial, &path).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), FIXTURE_LEN);
        Fixture {
            path,
            sha256: hasher.finalize().into(),
        }
    })
}

/// SHA-256 of a file on disk.
pub fn sha256_file(path: &Path) -> [u8; 32] {
    let mut hasher = Sha256::new();
    let mut file = std::fs::File::open(path).unwrap();
    std::io::copy(&mut file, &mut hasher).unwrap();
    hasher.finalize().into()
}
