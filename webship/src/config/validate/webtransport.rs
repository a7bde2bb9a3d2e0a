//! `[sites.webtransport]` and the top-level `[webtransport]`: the diagnostic
//! endpoint's path, admitted origins and modes, and its limits, none of which may be
//! unbounded.

use std::time::Duration;

use crate::config::raw::RawWebTransport;
use crate::config::{Protocols, WebTransport, WtMode};

use super::Validator;

impl Validator<'_> {
    /// The endpoint of a site serving `protocols`; `None` when any key is refused.
    pub(super) fn webtransport(
        &mut self,
        key: &str,
        raw: &RawWebTransport,
        protocols: Protocols,
    ) -> Option<WebTransport> {
        let problems = self.problems.len();
        if !protocols.h3 && !protocols.h2 {
            self.problem(
                key,
                "WebTransport needs HTTP/3 or HTTP/2, and the site serves neither",
                "enable h3 (and h2 for the older clients) in the site's protocols",
            );
        }
        let path = raw.path.clone().unwrap_or_else(|| "/webtransport".into());
        if !path.starts_with('/') || path.contains(['?', '#']) || path.contains(char::is_whitespace) {
            self.problem(
                format!("{key}.path"),
                format!("`{path}` is not a plain absolute path"),
                "use a path such as \"/webtransport\" (no query, no spaces)",
            );
        }
        let allowed_origins = self.allowed_origins(key, raw);
        let modes = raw
            .modes
            .clone()
            .unwrap_or_else(|| vec![WtMode::Echo, WtMode::Sink, WtMode::Source]);
        if modes.is_empty() {
            self.problem(
                format!("{key}.modes"),
                "no mode is allowed",
                "allow at least one of \"echo\", \"sink\", \"source\"",
            );
        }
        let mut range = |name: &str, v: Option<u64>, default: u64, lo: u64, hi: u64| -> u64 {
            match v {
                None => default,
                Some(v) if (lo..=hi).contains(&v) => v,
                Some(v) => {
                    self.problem(
                        format!("{key}.{name}"),
                        format!("{v} is out of range"),
                        format!("use {lo} to {hi}"),
                    );
                    default
                }
            }
        };
        let wt = WebTransport {
            path,
            allowed_origins,
            modes,
            max_sessions: range("max_sessions", raw.max_sessions.map(|v| v as u64), 16, 1, 100_000) as usize,
            max_streams_per_session: range(
                "max_streams_per_session",
                raw.max_streams_per_session.map(|v| v as u64),
                32,
                1,
                10_000,
            ) as usize,
            max_capsule_bytes: range(
                "max_capsule_bytes",
                raw.max_capsule_bytes.map(|v| v as u64),
                64 * 1024,
                1024,
                16 * 1024 * 1024,
            ) as usize,
            max_datagram_bytes: range(
                "max_datagram_bytes",
                raw.max_datagram_bytes.map(|v| v as u64),
                1200,
                16,
                65_535,
            ) as usize,
            max_datagrams_per_sec: range(
                "max_datagrams_per_sec",
                raw.max_datagrams_per_sec.map(u64::from),
                100_000,
                1,
                10_000_000,
            ) as u32,
            max_session_bytes: range("max_session_bytes", raw.max_session_bytes, 1 << 30, 1, u64::MAX),
            idle_timeout: Duration::from_secs(range(
                "idle_timeout_secs",
                raw.idle_timeout_secs,
                30,
                1,
                86_400,
            )),
        };
        (self.problems.len() == problems).then_some(wt)
    }

    /// `allowed_origins` must be listed, each written as a browser sends `Origin`: the
    /// endpoint compares whole strings (ignoring case), so an origin with a path or a
    /// trailing slash would never match.
    fn allowed_origins(&mut self, key: &str, raw: &RawWebTransport) -> Vec<String> {
        let allowed_origins = raw.allowed_origins.clone().unwrap_or_default();
        if allowed_origins.is_empty() {
            self.problem(
                format!("{key}.allowed_origins"),
                "no origin may open a session",
                "list the origins, such as [\"https://app.example.com\"], or [\"*\"] for any",
            );
        }
        for origin in &allowed_origins {
            let ok = origin == "*"
                || http::Uri::try_from(origin.as_str()).is_ok_and(|u| {
                    u.scheme().is_some() && u.host().is_some() && u.path() == "/" && !origin.ends_with('/')
                });
            if !ok {
                self.problem(
                    format!("{key}.allowed_origins"),
                    format!("`{origin}` is not an origin"),
                    "write scheme://host[:port] with no path, as browsers send it, or \"*\"",
                );
            }
        }
        allowed_origins
    }
}
