//! `[limits]`: connection count, header size and the timeouts every protocol
//! enforces. Each is bounded, so no value can switch a limit off.

use std::time::Duration;

use crate::config::raw::RawLimits;
use crate::config::Limits;

use super::Validator;

impl Validator<'_> {
    pub(super) fn limits(&mut self, raw: RawLimits) -> Limits {
        let d = Limits::default();
        let mut secs = |name: &str, v: Option<u64>, default: Duration| -> Duration {
            match v {
                None => default,
                Some(0) | Some(86_401..) => {
                    self.problem(format!("limits.{name}"), "out of range", "use 1 to 86400 seconds");
                    default
                }
                Some(s) => Duration::from_secs(s),
            }
        };
        let handshake_timeout = secs(
            "handshake_timeout_secs",
            raw.handshake_timeout_secs,
            d.handshake_timeout,
        );
        let header_read_timeout = secs(
            "header_read_timeout_secs",
            raw.header_read_timeout_secs,
            d.header_read_timeout,
        );
        let idle_timeout = secs("idle_timeout_secs", raw.idle_timeout_secs, d.idle_timeout);
        let send_timeout = secs("send_timeout_secs", raw.send_timeout_secs, d.send_timeout);
        let shutdown_grace = secs("shutdown_grace_secs", raw.shutdown_grace_secs, d.shutdown_grace);
        let max_connections = raw.max_connections.unwrap_or(d.max_connections);
        if !(1..=1_000_000).contains(&max_connections) {
            self.problem("limits.max_connections", "out of range", "use 1 to 1000000");
        }
        let max_header_bytes = raw.max_header_bytes.unwrap_or(d.max_header_bytes);
        if !(1024..=1024 * 1024).contains(&max_header_bytes) {
            self.problem("limits.max_header_bytes", "out of range", "use 1024 to 1048576");
        }
        Limits {
            max_connections,
            max_connections_configured: raw.max_connections.is_some(),
            max_header_bytes,
            handshake_timeout,
            header_read_timeout,
            idle_timeout,
            send_timeout,
            shutdown_grace,
        }
    }
}
