//! Shared harness for the end-to-end suite: the real `webship` binary started on a
//! free loopback port, nginx and scripted origins beside it, and what the test kit
//! (`webship-testkit`) provides: a private PKI, real clients (rustls + hyper,
//! quinn + h3) and the deterministic 99,943,778-byte fixture.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_debug_implementations)]

pub mod client;
pub mod fixture;
pub mod nginx;
pub mod origin;
pub mod prometheus;
pub mod server;

pub use fixture::{fixture, Fixture, FIXTURE_LEN};
pub use server::{webship, Server};
pub use webship_testkit::pki::{self, Pki};
