//! The deterministic 99,943,778-byte fixture (the test kit's stream), generated at
//! test time (never committed) once per test process, with its SHA-256.

use std::sync::OnceLock;

pub use webship_testkit::fixture::file::{sha256_file, Fixture};
pub use webship_testkit::fixture::FIXTURE_LEN;

/// The fixture, generated on first use.
pub fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    // One fixed place, reused across runs: regenerating 100 MB per run is waste.
    FIXTURE.get_or_init(|| {
        webship_testkit::fixture::file::ensure(&std::env::temp_dir().join("webship-e2e-fixture"))
            .unwrap_or_else(|e| panic!("{e:#}"))
    })
}
