//! Kernel feature probes, run before any socket is bound (fail closed).
//!
//! Each feature the configuration asks for is probed on a real loopback socket, not
//! guessed from version numbers: kTLS by attaching the `tls` ULP and installing TLS 1.3
//! AES-GCM transmit keys, BBR by reading what the kernel offers and allows and then
//! setting `TCP_CONGESTION` on a socket, TCP health by attaching its sock_ops program
//! to this process's cgroup and detaching it again. A `required` feature that is
//! missing stops startup with what is missing and how to fix it.

use std::fmt;

use crate::config::{Kernel, Policy};
use crate::sys::{self, KtlsCipher, KtlsVersion};

/// What preflight found.
#[derive(Debug, Clone)]
pub struct Report {
    pub ktls: Finding,
    pub bbr: Finding,
    pub ebpf: Finding,
    /// Per-site TCP health (a sock_ops program); only probed when eBPF is usable.
    pub tcp_health: Finding,
    /// Suites whose TX and RX keys the kernel accepted; empty unless kTLS is usable.
    pub(crate) ktls_suites: Vec<(KtlsVersion, KtlsCipher)>,
}

impl Report {
    /// Whether accepted TCP sockets should be switched to BBR.
    pub(crate) fn use_bbr(&self) -> bool {
        self.bbr.policy != Policy::Off && self.bbr.available()
    }

    /// Whether HTTP/1.1 bulk responses may be promoted to kernel TLS.
    pub(crate) fn use_ktls(&self) -> bool {
        self.ktls.policy != Policy::Off && self.ktls.available()
    }

    /// Whether the eBPF programs should be loaded.
    pub(crate) fn use_ebpf(&self) -> bool {
        self.ebpf.policy != Policy::Off && self.ebpf.available()
    }

    /// Whether the TCP health program should be attached.
    pub(crate) fn use_tcp_health(&self) -> bool {
        self.use_ebpf() && self.tcp_health.policy != Policy::Off && self.tcp_health.available()
    }

    /// The features that are required but missing.
    pub fn missing_required(&self) -> Vec<&Finding> {
        [&self.ktls, &self.bbr, &self.ebpf, &self.tcp_health]
            .into_iter()
            .filter(|f| f.policy == Policy::Required && !f.available())
            .collect()
    }

    /// One line for the start-up log.
    pub(crate) fn summary(&self) -> String {
        format!(
            "ktls={} bbr={} ebpf={} tcp_health={}",
            self.ktls.short(),
            self.bbr.short(),
            self.ebpf.short(),
            self.tcp_health.short()
        )
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", self.ktls)?;
        writeln!(f, "{}", self.bbr)?;
        writeln!(f, "{}", self.ebpf)?;
        write!(f, "{}", self.tcp_health)
    }
}

/// One probed feature.
#[derive(Debug, Clone)]
pub struct Finding {
    pub feature: &'static str,
    pub policy: Policy,
    pub outcome: Outcome,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Available { detail: String },
    Missing { reason: String, fix: String },
    NotProbed,
}

impl Finding {
    pub(crate) fn available(&self) -> bool {
        matches!(self.outcome, Outcome::Available { .. })
    }

    fn short(&self) -> &'static str {
        match (&self.outcome, self.policy) {
            (Outcome::NotProbed, _) => "off",
            (Outcome::Available { .. }, _) => "yes",
            (Outcome::Missing { .. }, _) => "missing",
        }
    }
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let verdict = match (&self.outcome, self.policy) {
            (Outcome::NotProbed, _) => "not probed".to_owned(),
            (Outcome::Available { detail }, _) => format!("available ({detail})"),
            (Outcome::Missing { reason, fix }, Policy::Required) => {
                format!("MISSING, required: {reason}; fix: {fix}")
            }
            (Outcome::Missing { reason, .. }, _) => format!("missing, not used: {reason}"),
        };
        write!(f, "{:<5} [{}] {verdict}", self.feature, self.policy)
    }
}

/// Probes what `kernel` asks for. Never binds a public port: probes use an ephemeral
/// loopback pair that is closed before this returns. eBPF is probed when it is
/// required, or when it is `auto` and something would use it (`wants_ebpf`:
/// passthrough routes or HTTP/3 socket steering; or TCP health, when not off).
pub fn run(kernel: &Kernel, wants_ebpf: bool) -> Report {
    let wants_ebpf = wants_ebpf || kernel.tcp_health != Policy::Off;
    let ebpf = match kernel.ebpf {
        Policy::Required => probe_ebpf(),
        Policy::Auto if wants_ebpf => probe_ebpf(),
        _ => Outcome::NotProbed,
    };
    let tcp_health = match (kernel.tcp_health, &ebpf) {
        (Policy::Off, _) => Outcome::NotProbed,
        (_, Outcome::Available { .. }) => probe_tcp_health(),
        (_, Outcome::Missing { reason, fix }) => Outcome::Missing {
            reason: format!("eBPF is not usable: {reason}"),
            fix: fix.clone(),
        },
        (_, Outcome::NotProbed) => Outcome::Missing {
            reason: "eBPF is off".into(),
            fix: "set `[kernel] ebpf = \"auto\"`".into(),
        },
    };
    let (ktls, ktls_suites) = if kernel.ktls == Policy::Off {
        (Outcome::NotProbed, Vec::new())
    } else {
        probe_ktls()
    };
    Report {
        ktls_suites,
        ktls: Finding {
            feature: "ktls",
            policy: kernel.ktls,
            outcome: ktls,
        },
        bbr: Finding {
            feature: "bbr",
            policy: kernel.bbr,
            outcome: if kernel.bbr == Policy::Off {
                Outcome::NotProbed
            } else {
                probe_bbr()
            },
        },
        ebpf: Finding {
            feature: "ebpf",
            policy: kernel.ebpf,
            outcome: ebpf,
        },
        tcp_health: Finding {
            feature: "tcp_health",
            policy: kernel.tcp_health,
            outcome: tcp_health,
        },
    }
}

/// Attaches the TCP health sock_ops program to this process's cgroup v2 and
/// detaches it again.
fn probe_tcp_health() -> Outcome {
    match crate::ebpf::probe_tcp() {
        Ok(detail) => Outcome::Available { detail },
        Err(e) => Outcome::Missing {
            reason: e.to_string(),
            fix: "run as root (CAP_BPF and CAP_NET_ADMIN) on a kernel with cgroup v2 mounted and \
                  BPF sock_ops (CONFIG_CGROUP_BPF), or set `[kernel] tcp_health = \"off\"`"
                .into(),
        },
    }
}

/// Loads the embedded programs, attaches the verdict program to a SOCKHASH and
/// inserts a loopback socket: exactly what the `sockmap` engine does later.
fn probe_ebpf() -> Outcome {
    match crate::ebpf::probe() {
        Ok(detail) => Outcome::Available { detail },
        Err(e) => {
            let fix = match e {
                crate::ebpf::EbpfError::NotBuilt => {
                    "build with `cargo xtask build-ebpf` before the daemon (or `cargo xtask run`), \
                     or set `[kernel] ebpf = \"off\"`"
                }
                _ => {
                    "run as root (CAP_BPF and CAP_NET_ADMIN) on a kernel with BPF sockmap support \
                      (CONFIG_BPF_SYSCALL, CONFIG_BPF_STREAM_PARSER), or set `[kernel] ebpf = \"off\"`"
                }
            };
            Outcome::Missing {
                reason: e.to_string(),
                fix: fix.into(),
            }
        }
    }
}

/// Every (version, cipher) pair kernel TLS could take over from rustls.
pub(crate) const KTLS_SUITES: [(KtlsVersion, KtlsCipher); 6] = [
    (KtlsVersion::Tls13, KtlsCipher::Aes128Gcm),
    (KtlsVersion::Tls13, KtlsCipher::Aes256Gcm),
    (KtlsVersion::Tls13, KtlsCipher::Chacha20Poly1305),
    (KtlsVersion::Tls12, KtlsCipher::Aes128Gcm),
    (KtlsVersion::Tls12, KtlsCipher::Aes256Gcm),
    (KtlsVersion::Tls12, KtlsCipher::Chacha20Poly1305),
];

/// Probes each suite once, on its own loopback pair: the `tls` ULP, then TX and RX
/// keys. Promotion later only uses suites that passed here, because a connection
/// whose secrets were extracted cannot go back to rustls.
fn probe_ktls() -> (Outcome, Vec<(KtlsVersion, KtlsCipher)>) {
    let mut usable = Vec::new();
    let mut first_error = None;
    for (version, cipher) in KTLS_SUITES {
        match probe_suite(version, cipher) {
            Ok(()) => usable.push((version, cipher)),
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    let outcome = if usable.is_empty() {
        let error = first_error.unwrap_or(sys::KtlsError::Unsupported);
        let fix = match error {
            sys::KtlsError::NoUlp(_) => {
                "load the module (`modprobe tls`) or use a kernel built with CONFIG_TLS, \
                 or set `[kernel] ktls = \"auto\"`"
            }
            sys::KtlsError::Unsupported => "run on Linux, or set `[kernel] ktls = \"off\"`",
            _ => "use a kernel with TLS 1.2/1.3 AES-GCM support in CONFIG_TLS (5.2 or newer)",
        };
        Outcome::Missing {
            reason: error.to_string(),
            fix: fix.into(),
        }
    } else {
        let names: Vec<String> = usable.iter().map(|&(v, c)| suite_name(v, c)).collect();
        Outcome::Available {
            detail: format!("TX+RX for {}", names.join(", ")),
        }
    };
    (outcome, usable)
}

fn probe_suite(version: KtlsVersion, cipher: KtlsCipher) -> Result<(), sys::KtlsError> {
    let (client, _server) = sys::loopback_pair().map_err(sys::KtlsError::NoUlp)?;
    sys::attach_tls_ulp(&client)?;
    // Throwaway keys: the socket is closed right after and never carries data.
    let key = [0x42u8; 32];
    let key_len = if cipher == KtlsCipher::Aes128Gcm { 16 } else { 32 };
    let keys = sys::KtlsKeys {
        version,
        cipher,
        key: &key[..key_len],
        iv: &[0x24; 12],
        seq: 0,
    };
    sys::set_ktls_keys(&client, sys::KtlsDirection::Tx, &keys)?;
    sys::set_ktls_keys(&client, sys::KtlsDirection::Rx, &keys)
}

/// A suite's name as operators read it.
pub(crate) fn suite_name(version: KtlsVersion, cipher: KtlsCipher) -> String {
    let v = match version {
        KtlsVersion::Tls12 => "TLS1.2",
        KtlsVersion::Tls13 => "TLS1.3",
    };
    let c = match cipher {
        KtlsCipher::Aes128Gcm => "AES-128-GCM",
        KtlsCipher::Aes256Gcm => "AES-256-GCM",
        KtlsCipher::Chacha20Poly1305 => "CHACHA20-POLY1305",
    };
    format!("{v} {c}")
}

const AVAILABLE_CC: &str = "/proc/sys/net/ipv4/tcp_available_congestion_control";
const ALLOWED_CC: &str = "/proc/sys/net/ipv4/tcp_allowed_congestion_control";

fn probe_bbr() -> Outcome {
    let available = std::fs::read_to_string(AVAILABLE_CC).unwrap_or_default();
    if !available.split_whitespace().any(|name| name == "bbr") {
        return Outcome::Missing {
            reason: format!("`bbr` is not in {AVAILABLE_CC} ({})", available.trim()),
            fix: "load it (`modprobe tcp_bbr`) or use a kernel built with CONFIG_TCP_CONG_BBR".into(),
        };
    }
    let (client, _server) = match sys::loopback_pair() {
        Ok(pair) => pair,
        Err(e) => {
            return Outcome::Missing {
                reason: format!("could not open a loopback TCP pair to probe with: {e}"),
                fix: "allow this process to use loopback TCP".into(),
            }
        }
    };
    if let Err(e) = sys::set_congestion(&client, "bbr") {
        let allowed = std::fs::read_to_string(ALLOWED_CC).unwrap_or_default();
        return Outcome::Missing {
            reason: format!(
                "setting TCP_CONGESTION=bbr failed: {e} (allowed for unprivileged users: {})",
                allowed.trim()
            ),
            fix: format!("add bbr to {ALLOWED_CC}, or run with CAP_NET_ADMIN"),
        };
    }
    match sys::congestion(&client) {
        Ok(name) if name == "bbr" => Outcome::Available {
            detail: "TCP_CONGESTION=bbr set and read back".into(),
        },
        Ok(other) => Outcome::Missing {
            reason: format!("TCP_CONGESTION reads back `{other}` after setting bbr"),
            fix: "check for a security module overriding congestion control".into(),
        },
        Err(e) => Outcome::Missing {
            reason: format!("reading TCP_CONGESTION back failed: {e}"),
            fix: "check that the kernel supports TCP_CONGESTION".into(),
        },
    }
}
