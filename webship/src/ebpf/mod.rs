//! Webship's eBPF programs, from the daemon's side: load them, link spliced socket
//! pairs, mirror the daemon's counters, and read everything back for
//! `webship stats`.
//!
//! The object is built by `cargo xtask build-ebpf` and embedded at compile time when
//! the `ebpf` feature is on (see `build.rs`); a binary without it reports
//! [`EbpfError::NotBuilt`] and passthrough uses a userspace engine.
//!
//! Counters live in pinned maps under the pin folder (default
//! [`DEFAULT_PIN_DIR`]): `kernel_counters` (per-CPU, written by the programs),
//! `user_counters` (written by the daemon once a second and at shutdown), and TCP
//! health per site (`tcp_sites`, per-CPU, with their names in `tcp_site_names`; see
//! `tcp.rs`). Beside them `quic_sockets`, the HTTP/3 sockets' steering map
//! (`quic_steer.rs`), pinned so that a successor reuses it. The pins are removed
//! when the daemon stops.

use std::path::{Path, PathBuf};

pub use webship_ebpf_common::{Counter, COUNTERS};

pub use crate::config::DEFAULT_PIN_DIR;
// The pins only the loader touches; a build without eBPF has none.
#[cfg_attr(not(all(target_os = "linux", feature = "ebpf")), allow(dead_code))]
const KERNEL_PIN: &str = "kernel_counters";
#[cfg_attr(not(all(target_os = "linux", feature = "ebpf")), allow(dead_code))]
const USER_PIN: &str = "user_counters";
#[cfg_attr(not(all(target_os = "linux", feature = "ebpf")), allow(dead_code))]
const LINKS_PIN: &str = "links";
#[cfg_attr(not(all(target_os = "linux", feature = "ebpf")), allow(dead_code))]
const TCP_SITES_PIN: &str = "tcp_sites";
#[cfg_attr(not(all(target_os = "linux", feature = "ebpf")), allow(dead_code))]
const TCP_SITE_NAMES_PIN: &str = "tcp_site_names";
const QUIC_SOCKETS_PIN: &str = "quic_sockets";

/// Whether a pin (by its file name) stays root's when the others go to the service
/// account: the QUIC steering map, which a successor's programs share (and its
/// pending name during a takeover). The account only removes pins at shutdown, which
/// the folder's group write allows whoever owns them.
#[cfg_attr(not(unix), allow(dead_code))]
pub(crate) fn stays_root(name: &std::ffi::OsStr) -> bool {
    name.as_encoded_bytes().starts_with(QUIC_SOCKETS_PIN.as_bytes())
}

#[derive(Debug, thiserror::Error)]
pub enum EbpfError {
    #[error(
        "this binary carries no eBPF programs (built without the `ebpf` feature, or before \
         `cargo xtask build-ebpf`)"
    )]
    NotBuilt,
    #[error("the kernel refused the eBPF programs or maps: {0}")]
    Load(String),
    #[error("{what} {}: {source}", path.display())]
    Pin {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("no Webship counters are pinned under {}: is the daemon running, with passthrough and eBPF (`[kernel] ebpf`)?", .0.display())]
    NotRunning(PathBuf),
    #[error(
        "the pin folder {} is not on a BPF filesystem (its file system type is {magic:#x}); \
         nothing in it was touched. Set `[kernel] bpf_pin_dir` to a folder under /sys/fs/bpf \
         (or another `mount -t bpf` mount)",
        path.display()
    )]
    NotBpfFs { path: PathBuf, magic: i64 },
    #[error(
        "the pin folder {} belongs to another running webship (it holds the folder's lock); \
         give each daemon its own `[kernel] bpf_pin_dir`",
        .0.display()
    )]
    PinDirBusy(PathBuf),
}

impl EbpfError {
    /// A mistake in the configuration rather than a kernel without eBPF: startup
    /// stops even with `ebpf = "auto"`.
    pub(crate) fn is_misconfiguration(&self) -> bool {
        matches!(self, Self::NotBpfFs { .. } | Self::PinDirBusy(_))
    }
}

/// Counter values, indexed by [`Counter`].
pub(crate) type Values = [u64; COUNTERS as usize];

/// What `webship stats` reads from the pinned maps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Snapshot {
    /// Summed over CPUs, as the programs counted them.
    pub kernel: Values,
    /// As the daemon last published them.
    pub user: Values,
    /// Sockets the `sockmap` engine has linked right now (two per connection).
    pub linked_sockets: u64,
}

impl Snapshot {
    pub fn total(&self, counter: Counter) -> u64 {
        let i = counter as usize;
        self.kernel[i].saturating_add(self.user[i])
    }
}

/// The pinned maps: kernel counters, userspace counters, links, the QUIC steering
/// map, TCP health per site and the sites' names.
#[cfg_attr(not(all(target_os = "linux", feature = "ebpf")), allow(dead_code))]
fn pin_paths(dir: &Path) -> [PathBuf; 6] {
    [
        dir.join(KERNEL_PIN),
        dir.join(USER_PIN),
        dir.join(LINKS_PIN),
        dir.join(QUIC_SOCKETS_PIN),
        dir.join(TCP_SITES_PIN),
        dir.join(TCP_SITE_NAMES_PIN),
    ]
}

pub mod tcp;
pub use tcp::{Histogram, SiteTcp, TcpSnapshot};

#[cfg(all(target_os = "linux", feature = "ebpf"))]
mod loaded;
#[cfg(all(target_os = "linux", feature = "ebpf"))]
mod quic_steer;
#[cfg(all(target_os = "linux", feature = "ebpf"))]
mod tcp_health;
#[cfg(all(target_os = "linux", feature = "ebpf"))]
pub(crate) use loaded::{probe, Programs, SocketLink};
#[cfg(all(target_os = "linux", feature = "ebpf"))]
pub use loaded::{read_pinned, read_tcp_pinned};
#[cfg(all(target_os = "linux", feature = "ebpf"))]
pub(crate) use tcp_health::probe_tcp;

#[cfg(not(all(target_os = "linux", feature = "ebpf")))]
mod absent;
#[cfg(not(all(target_os = "linux", feature = "ebpf")))]
pub(crate) use absent::{probe, probe_tcp, Programs, SocketLink};
#[cfg(not(all(target_os = "linux", feature = "ebpf")))]
pub use absent::{read_pinned, read_tcp_pinned};
