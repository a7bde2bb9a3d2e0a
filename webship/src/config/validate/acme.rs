//! `[acme]` and `[sites.acme]`: a site whose certificate comes from an ACME server
//! (RFC 8555) instead of files. The names, the directory, the challenge and the
//! top-level storage folder become one [`AcmeSource`], which is also what the
//! certificate's slot is kept by.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use crate::config::raw::{RawAcme, RawSiteAcme};
use crate::config::{AcmeChallenge, AcmeSource, DomainPattern, TlsSource};

use super::Validator;

impl Validator<'_> {
    /// `[acme] storage`: absolute once resolved; an existing path must be a folder,
    /// a missing one is created at start (0700, with its parents).
    pub(super) fn acme_storage(&mut self, raw: &RawAcme) -> Option<PathBuf> {
        let storage = self.path(&raw.storage);
        if storage.exists() && !storage.is_dir() {
            self.problem(
                "acme.storage",
                format!("`{}` is not a folder", storage.display()),
                "point `storage` at a folder, such as \"/var/lib/webship/acme\" (created at start when missing)",
            );
            return None;
        }
        Some(storage)
    }

    /// `[acme] http_listen`: an address and port other than the TLS listener's.
    pub(super) fn acme_http_listen(&mut self, text: &str, listen: SocketAddr) -> Option<SocketAddr> {
        match text.parse::<SocketAddr>() {
            Ok(addr)
                if addr.port() == listen.port()
                    && (addr.ip() == listen.ip()
                        || addr.ip().is_unspecified()
                        || listen.ip().is_unspecified()) =>
            {
                self.problem(
                    "acme.http_listen",
                    format!("`{text}` is the TLS listener's port"),
                    "use port 80 (ACME servers validate http-01 there)",
                );
                None
            }
            Ok(addr) => Some(addr),
            Err(_) => {
                self.problem(
                    "acme.http_listen",
                    format!("`{text}` is not an address and port"),
                    "write it as \"0.0.0.0:80\" or \"[::]:80\"",
                );
                None
            }
        }
    }

    /// One site's `[sites.acme]`, for `domain`, with the top-level storage folder
    /// (`None`: no `[acme]` table, or a refused one).
    pub(super) fn site_acme(
        &mut self,
        key: &str,
        raw: &RawSiteAcme,
        domain: &DomainPattern,
        storage: Option<&Path>,
        (acme_table, http_listen): (bool, bool),
    ) -> Option<TlsSource> {
        let key = format!("{key}.acme");
        let mut ok = true;
        let name = match domain {
            DomainPattern::Exact(name) => Some(name.clone()),
            _ => {
                self.problem(
                    &key,
                    format!("`{domain}` is not one host name: wildcard certificates are not obtained through ACME"),
                    "give the site an exact domain, or a [sites.tls] certificate",
                );
                None
            }
        };
        if !raw.directory.starts_with("https://") || raw.directory.len() <= "https://".len() {
            ok = false;
            self.problem(
                format!("{key}.directory"),
                format!("`{}` is not an https:// URL", raw.directory),
                "use the ACME server's directory URL, such as \"https://acme-v02.api.letsencrypt.org/directory\"",
            );
        }
        let challenge = match raw.challenge.as_deref().unwrap_or("tls-alpn-01") {
            "tls-alpn-01" => Some(AcmeChallenge::TlsAlpn01),
            "http-01" if http_listen => Some(AcmeChallenge::Http01),
            "http-01" => {
                self.problem(
                    format!("{key}.challenge"),
                    "`http-01` is answered on a plain-HTTP listener, and [acme] has no `http_listen`",
                    "add `http_listen = \"0.0.0.0:80\"` to [acme], or use challenge = \"tls-alpn-01\" (answered on the TLS port itself)",
                );
                None
            }
            other => {
                self.problem(
                    format!("{key}.challenge"),
                    format!("`{other}` is not a challenge type"),
                    "use \"tls-alpn-01\" or \"http-01\"",
                );
                None
            }
        };
        let email = raw
            .email
            .as_ref()
            .map(|e| e.strip_prefix("mailto:").unwrap_or(e).to_owned());
        if let Some(e) = &email {
            let valid = e
                .split_once('@')
                .is_some_and(|(user, host)| !user.is_empty() && !host.is_empty())
                && !e.chars().any(|c| c.is_whitespace() || c.is_control() || c == ',');
            if !valid {
                ok = false;
                self.problem(
                    format!("{key}.email"),
                    format!("`{e}` is not an e-mail address"),
                    "write it as \"ops@example.com\", or leave `email` out",
                );
            }
        }
        let directory_ca = raw.directory_ca.as_ref().map(|p| self.path(p));
        if let Some(ca) = &directory_ca {
            if let Err(e) = std::fs::File::open(ca) {
                ok = false;
                self.problem(
                    format!("{key}.directory_ca"),
                    format!("cannot open `{}`: {e}", ca.display()),
                    "point `directory_ca` at a readable PEM file, or leave it out to trust the system's roots",
                );
            }
        }
        if storage.is_none() && !acme_table {
            ok = false;
            self.problem(
                &key,
                "the site gets its certificate through ACME but there is no top-level [acme] table",
                "add [acme] with `storage = \"/var/lib/webship/acme\"` (where accounts, keys and certificates are kept)",
            );
        }
        let (name, challenge, storage) = (name?, challenge?, storage?);
        ok.then(|| {
            TlsSource::Acme(AcmeSource {
                directory: raw.directory.clone(),
                email,
                challenge,
                directory_ca,
                names: vec![name],
                storage: storage.to_owned(),
            })
        })
    }
}
