//! The ways a configuration comes into being: a file (`load`), text (`parse`, which
//! tests and `load` share), or the built-in default `webship serve` uses without
//! `--config`. All of them end in a validated [`Config`] or a [`ConfigError`].

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use super::raw::RawConfig;
use super::validate::{self, check_root, default_workers};
use super::{
    Config, ConfigError, DomainPattern, Dotfiles, Engine, H2Settings, H3Settings, Kernel, Limits, Policy,
    Problem, Protocols, ProxyH2Settings, Serve, Site, TlsSource,
};

/// Where the configuration came from, for messages.
pub const BUILTIN_SOURCE: &str = "<built-in default>";

/// Reads and validates a configuration file.
pub fn load(path: &Path) -> Result<Config, ConfigError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: shown.clone(),
        source,
    })?;
    let base = path.parent().unwrap_or(Path::new("."));
    parse(&text, &shown, base)
}

/// Validates configuration text; relative paths in it resolve against `base`.
pub fn parse(text: &str, source: &str, base: &Path) -> Result<Config, ConfigError> {
    let raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
        path: source.to_owned(),
        message: e.to_string().trim_end().to_owned(),
    })?;
    validate::validate(raw, source, base)
}

/// The configuration `webship serve` uses without `--config`: the current directory
/// on loopback with a self-signed certificate generated at start.
pub fn builtin_default(root: &Path) -> Result<Config, ConfigError> {
    let mut problems = Vec::new();
    let root = match check_root(root) {
        Ok(root) => root,
        Err(problem) => {
            problems.push(Problem {
                key: "root".into(),
                problem,
                fix: "run `webship serve` from a readable directory, or pass --config".into(),
            });
            PathBuf::new()
        }
    };
    if !problems.is_empty() {
        return Err(ConfigError::Invalid {
            path: BUILTIN_SOURCE.into(),
            problems,
        });
    }
    Ok(Config {
        source: BUILTIN_SOURCE.into(),
        listen: SocketAddr::from(([127, 0, 0, 1], 8443)),
        workers: default_workers(),
        sites: vec![Site {
            domain: DomainPattern::Any,
            serve: Serve::Files(root),
            protocols: Protocols {
                h1: true,
                h2: true,
                h3: true,
            },
            tls: TlsSource::SelfSigned {
                names: vec!["localhost".into(), "127.0.0.1".into(), "::1".into()],
            },
            webtransport: None,
            dotfiles: Dotfiles::Deny,
            access_sample: None,
        }],
        kernel: Kernel {
            ktls: Policy::Auto,
            bbr: Policy::Auto,
            ebpf: Policy::Auto,
            tcp_health: Policy::Off,
            bpf_pin_dir: PathBuf::from(super::DEFAULT_PIN_DIR),
        },
        limits: Limits::default(),
        h2: H2Settings::default(),
        h3: H3Settings::default(),
        proxy_h2: ProxyH2Settings::default(),
        passthrough: Vec::new(),
        passthrough_engine: Engine::Auto,
        passthrough_idle_timeout: super::model::DEFAULT_PASSTHROUGH_IDLE,
        passthrough_udp: None,
        access_log: super::AccessLog::default(),
        control_socket: None,
        admin: None,
        ocsp_cache: PathBuf::from(super::DEFAULT_OCSP_CACHE),
        acme_http_listen: None,
        accept_proxy_protocol: Vec::new(),
        user: None,
        group: None,
        ticket_keys: None,
    })
}
