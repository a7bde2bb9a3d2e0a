//! Raw serde structs → the typed [`Config`]. One submodule per part of the file
//! (sites, the reverse proxy and passthrough, WebTransport, kernel, limits, runtime
//! settings); this one holds the walk over the whole file and the checks several
//! parts share (host names, paths, certificates, protocols, upstreams).
//!
//! Validation collects every problem instead of stopping at the first, so one
//! `webship check` names them all; the walk's order is the order they are listed in.

mod acme;
mod admin;
mod kernel;
mod limits;
mod log;
mod passthrough;
mod proxy;
mod runtime;
mod sites;
mod webtransport;

pub(crate) use admin::{read_token, MAX_TOKEN_BYTES};

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use super::raw::{RawConfig, RawProtocols, RawTls};
use super::{Config, ConfigError, DomainPattern, Problem, Protocols, TlsSource};

/// Validates a parsed file; relative paths in it resolve against `base`.
pub(super) fn validate(raw: RawConfig, source: &str, base: &Path) -> Result<Config, ConfigError> {
    let mut v = Validator {
        base,
        problems: Vec::new(),
    };
    let config = v.config(raw, source);
    if v.problems.is_empty() {
        Ok(config)
    } else {
        Err(ConfigError::Invalid {
            path: source.to_owned(),
            problems: v.problems,
        })
    }
}

/// The worker count when the file names none: one per CPU.
pub(super) fn default_workers() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get())
}

/// A document root must resolve, be a directory and be listable by this user; the
/// built-in default checks its root the same way.
pub(super) fn check_root(root: &Path) -> Result<PathBuf, String> {
    let canonical = root
        .canonicalize()
        .map_err(|e| format!("`{}` cannot be resolved: {e}", root.display()))?;
    if !canonical.is_dir() {
        return Err(format!("`{}` is not a directory", root.display()));
    }
    std::fs::read_dir(&canonical).map_err(|e| format!("`{}` cannot be listed: {e}", root.display()))?;
    Ok(canonical)
}

struct Validator<'a> {
    base: &'a Path,
    problems: Vec<Problem>,
}

impl Validator<'_> {
    fn problem(&mut self, key: impl Into<String>, problem: impl Into<String>, fix: impl Into<String>) {
        self.problems.push(Problem {
            key: key.into(),
            problem: problem.into(),
            fix: fix.into(),
        });
    }

    fn path(&self, p: &Path) -> PathBuf {
        self.base.join(p)
    }

    /// The whole file. The returned `Config` holds placeholders where a value was
    /// refused; `validate` only hands it out when there were no problems.
    fn config(&mut self, raw: RawConfig, source: &str) -> Config {
        let listen = self.listen(raw.listen.as_deref());
        let workers = self.workers(raw.workers);
        self.account(raw.user.as_deref(), raw.group.as_deref());
        let control_socket = self.control_socket(raw.control_socket.as_deref(), listen);
        let admin = raw.admin.as_ref().and_then(|a| self.admin(a, listen));
        let acme_http_listen = raw
            .acme
            .as_ref()
            .and_then(|a| a.http_listen.as_deref())
            .and_then(|text| self.acme_http_listen(text, listen));
        let top = self.top_level(&raw);
        let ticket_keys = self.ticket_keys(&raw);
        let accept_proxy_protocol = self.address_blocks(
            "accept_proxy_protocol",
            raw.accept_proxy_protocol.as_deref().unwrap_or_default(),
        );
        // Domains taken so far: site index, or `usize::MAX` for proxy and passthrough.
        let mut seen: BTreeMap<String, usize> = BTreeMap::new();
        let access_log = self.access_log(raw.log.as_ref());
        let mut sites = self.sites(&raw.sites, &top, &mut seen);
        let (passthrough, passthrough_udp) = match &raw.reverse_proxy {
            Some(proxy) => self.reverse_proxy(proxy, &mut sites, &mut seen),
            None => (Vec::new(), None),
        };
        self.catch_all(top, raw.webtransport.as_ref(), &mut sites, passthrough.is_empty());
        let mut kernel = self.kernel(raw.kernel.unwrap_or_default());
        let passthrough_engine = self.passthrough_engine(raw.reverse_proxy.as_ref(), &mut kernel);
        let passthrough_idle_timeout = self.passthrough_idle_timeout(raw.reverse_proxy.as_ref());
        let limits = self.limits(raw.limits.unwrap_or_default());
        let (h2, h3, proxy_h2) = self.settings(&raw.runtime.unwrap_or_default().settings);
        if let Some(udp) = passthrough_udp {
            self.udp_passthrough(udp, listen, &mut kernel, &sites);
        }
        Config {
            source: source.to_owned(),
            listen,
            workers,
            sites,
            kernel,
            limits,
            h2,
            h3,
            proxy_h2,
            passthrough,
            passthrough_engine,
            passthrough_idle_timeout,
            passthrough_udp,
            access_log,
            accept_proxy_protocol,
            user: raw.user,
            group: raw.group,
            control_socket: Some(control_socket),
            admin,
            ocsp_cache: raw
                .ocsp_cache
                .as_deref()
                .map_or_else(|| PathBuf::from(super::DEFAULT_OCSP_CACHE), |p| self.path(p)),
            acme_http_listen,
            ticket_keys,
        }
    }

    fn listen(&mut self, text: Option<&str>) -> SocketAddr {
        let text = text.unwrap_or("0.0.0.0:443");
        text.parse::<SocketAddr>().unwrap_or_else(|_| {
            self.problem(
                "listen",
                format!("`{text}` is not an address and port"),
                "write it as \"0.0.0.0:443\" or \"[::]:443\"",
            );
            SocketAddr::from(([0, 0, 0, 0], 443))
        })
    }

    fn workers(&mut self, workers: Option<usize>) -> usize {
        let workers = workers.unwrap_or_else(default_workers);
        if !(1..=1024).contains(&workers) {
            self.problem("workers", format!("{workers} is out of range"), "use 1 to 1024");
        }
        workers
    }

    /// `user` and `group` are names (or numbers); whether they exist is checked by
    /// `webship check` and at start, against the account database of that host.
    fn account(&mut self, user: Option<&str>, group: Option<&str>) {
        for (key, value) in [("user", user), ("group", group)] {
            if let Some(v) = value {
                if v.is_empty() || v.contains(['\0', ':', '/']) || v.chars().any(char::is_whitespace) {
                    self.problem(
                        key,
                        format!("`{v}` is not an account name"),
                        "name an account, e.g. \"webship\"",
                    );
                }
            }
        }
        if group.is_some() && user.is_none() {
            self.problem(
                "group",
                "a group without a user",
                "set `user` too, or remove `group`",
            );
        }
    }

    /// `control_socket`: an absolute path that fits a Unix socket address.
    fn control_socket(&mut self, path: Option<&Path>, listen: SocketAddr) -> PathBuf {
        let Some(path) = path else {
            return super::default_control_socket(listen.port());
        };
        // sun_path holds 108 bytes with the terminating NUL.
        let len = path.as_os_str().len();
        if !path.is_absolute() || len > 107 {
            self.problem(
                "control_socket",
                format!(
                    "`{}` is not an absolute path of at most 107 bytes",
                    path.display()
                ),
                "write it as \"/run/webship/control.sock\"",
            );
        }
        path.to_owned()
    }

    /// A route's `upstreams`: IP:port each, at least one.
    fn upstreams(&mut self, key: &str, list: &[String]) -> Vec<SocketAddr> {
        if list.is_empty() {
            self.problem(
                format!("{key}.upstreams"),
                "the route has no upstreams",
                "list at least one, e.g. [\"10.0.0.20:8080\"]",
            );
        }
        let mut out = Vec::with_capacity(list.len());
        for (j, u) in list.iter().enumerate() {
            match u.parse::<SocketAddr>() {
                Ok(addr) if addr.port() != 0 => out.push(addr),
                _ => self.problem(
                    format!("{key}.upstreams[{j}]"),
                    format!("`{u}` is not an IP address with a port"),
                    "write it as \"10.0.0.20:8080\" or \"[::1]:8080\"",
                ),
            }
        }
        out
    }

    fn root(&mut self, key: &str, root: &Path) -> Option<PathBuf> {
        match check_root(&self.path(root)) {
            Ok(p) => Some(p),
            Err(problem) => {
                self.problem(
                    key,
                    problem,
                    "point it at an existing directory this user can read",
                );
                None
            }
        }
    }

    fn tls(&mut self, key: &str, tls: &RawTls) -> TlsSource {
        let cert = self.path(&tls.cert);
        let key_path = self.path(&tls.key);
        for (name, path) in [("cert", &cert), ("key", &key_path)] {
            if let Err(e) = std::fs::File::open(path) {
                self.problem(
                    format!("{key}.{name}"),
                    format!("cannot open `{}`: {e}", path.display()),
                    format!("point `{name}` at a readable PEM file"),
                );
            }
        }
        TlsSource::Files {
            cert,
            key: key_path,
            ocsp_stapling: tls.ocsp_stapling.unwrap_or(true),
        }
    }

    fn domain(&mut self, key: &str, domain: &str) -> Option<DomainPattern> {
        let lower = domain.trim_end_matches('.').to_ascii_lowercase();
        let (wildcard, name) = match lower.strip_prefix("*.") {
            Some(rest) => (true, rest),
            None => (false, lower.as_str()),
        };
        let valid = !name.is_empty()
            && name.len() <= 253
            && name.split('.').all(|label| {
                !label.is_empty()
                    && label.len() <= 63
                    && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                    && !label.starts_with('-')
                    && !label.ends_with('-')
            });
        if !valid {
            self.problem(
                key,
                format!("`{domain}` is not a host name"),
                "use a name such as \"media.example.com\" or \"*.example.com\"",
            );
            return None;
        }
        Some(if wildcard {
            DomainPattern::Wildcard(format!(".{name}"))
        } else {
            DomainPattern::Exact(name.to_owned())
        })
    }

    fn protocols(&mut self, key: &str, raw: Option<RawProtocols>) -> Protocols {
        let raw = raw.unwrap_or(RawProtocols {
            h1: None,
            h2: None,
            h3: None,
        });
        let p = Protocols {
            h1: raw.h1.unwrap_or(true),
            h2: raw.h2.unwrap_or(true),
            h3: raw.h3.unwrap_or(true),
        };
        if !p.h1 && !p.h2 && !p.h3 {
            self.problem(
                key,
                "every protocol is disabled",
                "set at least one of h1, h2, h3 to true",
            );
        }
        p
    }
}
