//! `[admin]`: the admin listener's address and who may reach it. A listener that
//! serves metrics and health to anything beyond this host must be asked for twice
//! (`allow_remote = true`) and guarded by a bearer token.

use std::net::SocketAddr;

use crate::config::raw::RawAdmin;
use crate::config::Admin;

use super::Validator;

/// The shortest token accepted: a guessable token guards nothing.
pub(crate) const MIN_TOKEN_BYTES: usize = 16;
/// The longest token file read (a token is one line).
pub(crate) const MAX_TOKEN_BYTES: u64 = 4096;

impl Validator<'_> {
    pub(super) fn admin(&mut self, raw: &RawAdmin, listen: SocketAddr) -> Option<Admin> {
        let Ok(addr) = raw.listen.parse::<SocketAddr>() else {
            self.problem(
                "admin.listen",
                format!("`{}` is not an address and port", raw.listen),
                "write it as \"127.0.0.1:9901\"",
            );
            return None;
        };
        if addr.port() == 0 {
            self.problem("admin.listen", "port 0", "choose a port, e.g. \"127.0.0.1:9901\"");
        }
        let overlaps = addr.port() == listen.port()
            && (addr.ip() == listen.ip() || addr.ip().is_unspecified() || listen.ip().is_unspecified());
        if overlaps {
            self.problem(
                "admin.listen",
                format!("`{addr}` is the port `listen` serves on"),
                "give the admin listener a port of its own, e.g. \"127.0.0.1:9901\"",
            );
        }
        let token_file = raw.token_file.as_ref().map(|p| self.path(p));
        // A token readable by root only is the natural setup for a secret; a reload
        // validates as the service account, which may not read it, and `[admin]`
        // changes only at a restart (which reads it as root and fails clearly). Only
        // what is known to be wrong is refused.
        let denied = |path: &std::path::Path| {
            std::fs::File::open(path).is_err_and(|e| e.kind() == std::io::ErrorKind::PermissionDenied)
        };
        if let Some(path) = token_file.as_ref().filter(|p| !denied(p)) {
            if let Err(problem) = read_token(path) {
                self.problem(
                    "admin.token_file",
                    problem,
                    "point it at a readable file holding one token (at least 16 characters)",
                );
            }
        }
        let remote = !addr.ip().is_loopback();
        match (remote, raw.allow_remote.unwrap_or(false), &token_file) {
            (true, false, _) => self.problem(
                "admin.listen",
                format!(
                    "`{addr}` is not a loopback address: metrics and health would be open to the network"
                ),
                "listen on 127.0.0.1 or [::1], or set `allow_remote = true` with a `token_file`",
            ),
            (true, true, None) => self.problem(
                "admin.allow_remote",
                "a remote admin listener without a token",
                "set `token_file` to a file holding the bearer token scrapers must send",
            ),
            _ => {}
        }
        Some(Admin {
            listen: addr,
            token_file,
        })
    }
}

/// The token a token file holds: its content without the line end around it.
pub(crate) fn read_token(path: &std::path::Path) -> Result<String, String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_TOKEN_BYTES).read_to_string(&mut text))
        .map_err(|e| format!("cannot read `{}`: {e}", path.display()))?;
    let token = text.trim();
    if token.len() < MIN_TOKEN_BYTES || token.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!(
            "`{}` does not hold one token of at least {MIN_TOKEN_BYTES} characters without spaces",
            path.display()
        ));
    }
    Ok(token.to_owned())
}
