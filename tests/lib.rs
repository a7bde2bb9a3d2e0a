//! Shared harness for the end-to-end suite: a private PKI, the real `webship` binary
//! started on a free loopback port, real clients (rustls + hyper, curl), and the
//! deterministic 99,943,778-byte fixture.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_debug_implementations)]

pub mod client;
pub mod fixture;
pub mod nginx;
pub mod origin;
pub mod pki;
pub mod server;

pub use fixture::{fixture, Fixture, FIXTURE_LEN};
pub use pki::Pki;
pub use server::{webship, Server};
