//! Configuration: TOML text → raw serde structs (unknown keys rejected) → validation →
//! the typed [`Config`] that the rest of the daemon reads.
//!
//! Every problem is reported before anything binds, naming the file, the key and the
//! fix. Parse errors carry toml's line and column; validation collects every problem
//! it finds instead of stopping at the first.
//!
//! `raw` is the file as written, `validate` turns it into the types of `model`,
//! `settings` describes each `[runtime.settings]` key once, `load` is the entry point
//! and `error` what it refuses with.

mod error;
mod load;
mod model;
mod raw;
mod settings;
mod validate;

pub use error::{ConfigError, Problem};
pub use load::{builtin_default, load, parse, BUILTIN_SOURCE};
pub use model::default_control_socket;
pub use model::{
    AccessFormat, AccessLog, AcmeChallenge, AcmeSource, Admin, Config, DomainPattern, Dotfiles, Engine,
    H2Settings, H3Settings, IpNet, Kernel, Limits, MtuBound, PassthroughRoute, Policy, Protocols,
    ProxyH2Settings, ProxyProtocol, Route, Serve, Site, TlsSource, UdpEngine, UdpPassthrough,
    UpstreamProtocol, WebTransport, WtMode, CONTROL_DIR, DEFAULT_OCSP_CACHE, DEFAULT_PIN_DIR,
};
/// The bearer token of `[admin] token_file` (what validation checked).
pub(crate) use validate::{read_token as read_admin_token, MAX_TOKEN_BYTES};

#[cfg(test)]
mod tests;
