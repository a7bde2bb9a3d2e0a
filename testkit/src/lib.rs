//! Webship's test kit: the pieces its end-to-end tests, its benchmarks and its
//! fuzz seeds share, written once.
//!
//! - [`fixture`]: the deterministic fixture stream (generator, streaming checker,
//!   hex). No dependencies: the daemon's WebTransport source mode sends it too.
//!
//! Behind the `kit` feature, what tests and benches drive servers with:
//! - [`fixture::file`]: the fixture as a file, with its SHA-256;
//! - [`ports`]: free and refusing loopback ports;
//! - [`wait`]: polling a condition with a deadline;
//! - [`proc`]: what /proc says about a process or a port;
//! - [`process`]: the child-process guard every spawned server lives in, and its
//!   twin for servers running as tasks in the test (the scripted origins);
//! - [`pins`]: removing the eBPF pin folders test and bench daemons leave behind;
//! - [`pki`]: a private CA, leaf certificates and rustls client configurations;
//! - [`body`]: what a client does with a body (keep and hash it, or check it),
//!   and what it got of a response cut short;
//! - [`http`] and [`h3`]: the HTTP/1.1 + HTTP/2 and HTTP/3 clients;
//! - [`h2raw`] and [`h3raw`]: raw-frame HTTP/2 and HTTP/3 clients for conformance
//!   tests.

pub mod fixture;

#[cfg(feature = "kit")]
pub mod body;
#[cfg(feature = "kit")]
pub mod h2raw;
#[cfg(feature = "kit")]
pub mod h3;
#[cfg(feature = "kit")]
pub mod h3raw;
#[cfg(feature = "kit")]
pub mod http;
#[cfg(feature = "kit")]
pub mod pins;
#[cfg(feature = "kit")]
pub mod pki;
#[cfg(feature = "kit")]
pub mod ports;
#[cfg(feature = "kit")]
pub mod proc;
#[cfg(feature = "kit")]
pub mod process;
#[cfg(feature = "kit")]
pub mod wait;
