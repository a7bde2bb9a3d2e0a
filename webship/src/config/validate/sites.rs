//! `[[sites]]` and the top-level site: what each file-serving site gets from its own
//! table, what it inherits from the top level (`root`, `[tls]`, `[protocols]`), and
//! the catch-all site a top-level `root` makes.

use std::collections::BTreeMap;
use std::path::PathBuf;

use crate::config::raw::{RawConfig, RawSite, RawTls, RawTopTls, RawWebTransport};
use crate::config::{DomainPattern, Dotfiles, Protocols, Serve, Site, TlsSource};

use super::Validator;

/// The top-level `root`, `[tls]` and `[protocols]`: defaults for every `[[sites]]`
/// entry, and the catch-all site itself when there is a `root`.
pub(super) struct TopLevel {
    root: Option<PathBuf>,
    tls: Option<TlsSource>,
    protocols: Protocols,
    dotfiles: Dotfiles,
    /// `[acme] storage`, when the table is there and valid.
    acme_storage: Option<PathBuf>,
    /// Whether there is an `[acme]` table at all (a refused one is reported once).
    acme_table: bool,
    /// Whether `[acme] http_listen` is set (http-01 needs it).
    acme_http: bool,
}

impl Validator<'_> {
    pub(super) fn top_level(&mut self, raw: &RawConfig) -> TopLevel {
        TopLevel {
            root: raw.root.as_ref().and_then(|r| self.root("root", r)),
            tls: raw.tls.as_ref().and_then(|t| self.top_tls(t)),
            protocols: self.protocols("protocols", raw.protocols),
            dotfiles: raw.dotfiles.unwrap_or_default(),
            acme_storage: raw.acme.as_ref().and_then(|a| self.acme_storage(a)),
            acme_table: raw.acme.is_some(),
            acme_http: raw.acme.as_ref().is_some_and(|a| a.http_listen.is_some()),
        }
    }

    /// The top-level certificate, when `[tls]` names one: `cert` and `key` go together
    /// (a `[tls]` with only `ticket_keys` leaves each site its own certificate).
    fn top_tls(&mut self, raw: &RawTopTls) -> Option<TlsSource> {
        match (&raw.cert, &raw.key) {
            (Some(cert), Some(key)) => Some(self.tls(
                "tls",
                &RawTls {
                    cert: cert.clone(),
                    key: key.clone(),
                    ocsp_stapling: raw.ocsp_stapling,
                },
            )),
            (None, None) => {
                if raw.ocsp_stapling.is_some() {
                    self.problem(
                        "tls.ocsp_stapling",
                        "stapling without a top-level certificate",
                        "set it in each site's [sites.tls], or add `cert` and `key` here",
                    );
                }
                None
            }
            (Some(_), None) | (None, Some(_)) => {
                self.problem(
                    "tls",
                    "`cert` without `key`, or `key` without `cert`",
                    "set both (PEM files), or neither",
                );
                None
            }
        }
    }

    /// `[tls] ticket_keys`: the file is read (and its mode checked) when TLS is set up,
    /// as root at start and as the service account at a reload.
    pub(super) fn ticket_keys(&mut self, raw: &RawConfig) -> Option<PathBuf> {
        let path = raw.tls.as_ref()?.ticket_keys.as_ref()?;
        if path.as_os_str().is_empty() {
            self.problem(
                "tls.ticket_keys",
                "an empty path",
                "name the file `webship ticket-keys new` wrote, or remove the key",
            );
            return None;
        }
        Some(self.path(path))
    }

    /// The `[[sites]]` entries in file order; `seen` records each one's domain.
    pub(super) fn sites(
        &mut self,
        raw: &[RawSite],
        top: &TopLevel,
        seen: &mut BTreeMap<String, usize>,
    ) -> Vec<Site> {
        let mut sites = Vec::new();
        for (i, site) in raw.iter().enumerate() {
            if let Some(site) = self.site(i, site, top, seen) {
                sites.push(site);
            }
        }
        sites
    }

    fn site(
        &mut self,
        i: usize,
        site: &RawSite,
        top: &TopLevel,
        seen: &mut BTreeMap<String, usize>,
    ) -> Option<Site> {
        let key = format!("sites[{i}]");
        // Without a valid domain nothing else about the site is worth reporting.
        let domain = self.domain(&format!("{key}.domain"), &site.domain)?;
        let name = domain.to_string();
        if let Some(first) = seen.insert(name.clone(), i) {
            self.problem(
                format!("{key}.domain"),
                format!("`{name}` is already the domain of sites[{first}]"),
                "give each site its own domain, or merge the two sites",
            );
        }
        let root = match &site.root {
            Some(r) => self.root(&format!("{key}.root"), r),
            None if top.root.is_some() => top.root.clone(),
            None => {
                self.problem(
                    format!("{key}.root"),
                    "the site has no root and there is no top-level `root`",
                    "add `root = \"/srv/...\"` to the site",
                );
                None
            }
        };
        let tls = match (&site.acme, &site.tls, &top.tls) {
            (Some(_), Some(_), _) => {
                self.problem(
                    format!("{key}.acme"),
                    "the site has both [sites.tls] and [sites.acme]",
                    "keep one: [sites.acme] obtains the certificate, [sites.tls] reads it from files",
                );
                None
            }
            (Some(a), None, _) => self.site_acme(
                &key,
                a,
                &domain,
                top.acme_storage.as_deref(),
                (top.acme_table, top.acme_http),
            ),
            (None, Some(t), _) => Some(self.tls(&format!("{key}.tls"), t)),
            (None, None, Some(t)) => Some(t.clone()),
            (None, None, None) => {
                self.problem(
                    format!("{key}.tls"),
                    "the site has no certificate",
                    "add a [sites.tls] table with `cert` and `key` (PEM files), or [sites.acme]",
                );
                None
            }
        };
        let protocols = match site.protocols {
            Some(p) => self.protocols(&format!("{key}.protocols"), Some(p)),
            None => top.protocols,
        };
        let webtransport = site
            .webtransport
            .as_ref()
            .and_then(|w| self.webtransport(&format!("{key}.webtransport"), w, protocols));
        let access_sample = site
            .log
            .as_ref()
            .and_then(|l| self.site_log(&format!("{key}.log"), l));
        let (Some(root), Some(tls)) = (root, tls) else {
            return None;
        };
        Some(Site {
            domain,
            serve: Serve::Files(root),
            protocols,
            tls,
            webtransport,
            dotfiles: site.dotfiles.unwrap_or(top.dotfiles),
            access_sample,
        })
    }

    /// The top-level `root` becomes the last site, answering any host no other site
    /// claims. Without one, a file must still serve something.
    pub(super) fn catch_all(
        &mut self,
        top: TopLevel,
        webtransport: Option<&RawWebTransport>,
        sites: &mut Vec<Site>,
        no_passthrough: bool,
    ) {
        let Some(root) = top.root else {
            if sites.is_empty() && no_passthrough && self.problems.is_empty() {
                self.problem(
                    "root",
                    "nothing to serve: no top-level `root` and no [[sites]]",
                    "add `root = \"/srv/...\"` or at least one [[sites]] table",
                );
            }
            return;
        };
        let tls = match top.tls {
            Some(tls) => tls,
            None if !sites.is_empty() => sites[0].tls.clone(),
            None => {
                self.problem(
                    "tls",
                    "the top-level `root` is served without a certificate",
                    "add a top-level [tls] table with `cert` and `key`, or a [[sites]] entry with [sites.tls]",
                );
                TlsSource::SelfSigned { names: Vec::new() }
            }
        };
        let webtransport = webtransport.and_then(|w| self.webtransport("webtransport", w, top.protocols));
        sites.push(Site {
            domain: DomainPattern::Any,
            serve: Serve::Files(root),
            protocols: top.protocols,
            tls,
            webtransport,
            dotfiles: top.dotfiles,
            access_sample: None,
        });
    }
}
