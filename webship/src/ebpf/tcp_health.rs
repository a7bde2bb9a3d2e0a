//! TCP health from the daemon's side (Linux, feature `ebpf`): attach the
//! `webship_tcp` sock_ops program to this process's cgroup v2, tell it the listening
//! port, tag client sockets with their site's slot, and read the per-site counters
//! back (`tcp.rs` holds the types and the pure parts).
//!
//! The hot path is [`Programs::tag_tcp`]: one `SO_COOKIE` read and one map update
//! per connection, nothing per request or per byte. The update holds one mutex
//! (aya's map `insert` takes `&mut`) for the one syscall. Unlike the metrics'
//! per-site slots (`metrics::Slots`, 4,096 names then `_other`), the kernel's table
//! of names is a fixed map of `MAX_TCP_SITES`; a name past it is not counted (logged). The kernel side costs one hash
//! lookup per state change of a watched socket and per retransmission.

use std::borrow::Borrow;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use aya::maps::{Array, HashMap, MapData, PerCpuArray};
use aya::programs::links::CgroupAttachMode;
use aya::programs::SockOps;
use webship_ebpf_common::{SiteName, TcpSite, MAX_TCP_SITES, SITE_NAME_BYTES, TCP_PROGRAM};

use super::loaded::{chain, load_object, lock, Programs};
use super::tcp::{cgroup2_dir, sum_cpus, SiteTcp, Slot, Slots, TcpSnapshot};
use super::EbpfError;

/// The TCP health maps of a loaded object.
pub(crate) struct TcpMaps {
    tags: Mutex<HashMap<MapData, u64, u32>>,
    ports: Mutex<HashMap<MapData, u32, u32>>,
    sites: PerCpuArray<MapData, TcpSite>,
    names: Mutex<Array<MapData, SiteName>>,
    slots: Mutex<Slots>,
    /// Set once the program is attached: before (or without) it, tagging would
    /// fill a map nobody reads.
    watching: AtomicBool,
}

impl TcpMaps {
    pub(super) fn new(
        tags: HashMap<MapData, u64, u32>,
        ports: HashMap<MapData, u32, u32>,
        sites: PerCpuArray<MapData, TcpSite>,
        names: Array<MapData, SiteName>,
    ) -> Self {
        Self {
            tags: Mutex::new(tags),
            ports: Mutex::new(ports),
            sites,
            names: Mutex::new(names),
            slots: Mutex::new(Slots::default()),
            watching: AtomicBool::new(false),
        }
    }
}

impl Programs {
    /// Attaches the sock_ops program to this process's cgroup v2. Returns the cgroup
    /// folder.
    pub(crate) fn watch_tcp(&self) -> Result<PathBuf, EbpfError> {
        let cgroup = {
            let mut ebpf = lock(&self.ebpf);
            attach_sock_ops(&mut ebpf)?
        };
        self.tcp.watching.store(true, Ordering::SeqCst);
        Ok(cgroup)
    }

    /// Watches connections accepted on `port` (the listener's, once bound).
    pub(crate) fn watch_port(&self, port: u16) {
        if let Err(e) = lock(&self.tcp.ports).insert(u32::from(port), 0, 0) {
            tracing::warn!(port, error = %chain(&e), "TCP health: cannot watch the listening port");
        }
    }

    /// The counter slot of site `name` (given on first sight, kept by name for the
    /// daemon's life); `None` once every slot is taken, or without the program.
    pub(crate) fn tcp_slot(&self, name: &str) -> Option<u32> {
        if !self.tcp.watching.load(Ordering::Relaxed) {
            return None;
        }
        match lock(&self.tcp.slots).slot(name) {
            Slot::Known(s) => Some(s),
            Slot::New(s) => {
                let mut entry = SiteName::EMPTY;
                let n = name.len().min(SITE_NAME_BYTES);
                entry.bytes[..n].copy_from_slice(&name.as_bytes()[..n]);
                entry.len = n as u32;
                if let Err(e) = lock(&self.tcp.names).set(s, entry, 0) {
                    tracing::debug!(error = %e, site = name, "cannot name a TCP health slot");
                }
                Some(s)
            }
            Slot::Full => {
                tracing::warn!(
                    site = name,
                    limit = MAX_TCP_SITES,
                    "TCP health: too many site names, this one is not counted"
                );
                None
            }
        }
    }

    /// Counts `socket` under `slot` from now on (until it closes).
    pub(crate) fn tag_tcp(&self, socket: BorrowedFd<'_>, slot: u32) {
        let cookie = match rustix::net::sockopt::socket_cookie(socket) {
            Ok(c) => c,
            Err(e) => return tracing::debug!(error = %e, "no socket cookie: connection not counted"),
        };
        if let Err(e) = lock(&self.tcp.tags).insert(cookie, slot, 0) {
            tracing::debug!(error = %e, "cannot tag a connection for TCP health");
        }
    }

    /// Every named site's TCP health now.
    pub(crate) fn tcp_snapshot(&self) -> TcpSnapshot {
        snapshot(&*lock(&self.tcp.names), &self.tcp.sites)
    }
}

/// Reads every named slot.
pub(super) fn snapshot<N, S>(names: &Array<N, SiteName>, sites: &PerCpuArray<S, TcpSite>) -> TcpSnapshot
where
    N: Borrow<MapData>,
    S: Borrow<MapData>,
{
    let mut out = TcpSnapshot::default();
    for slot in 0..MAX_TCP_SITES {
        let Ok(name) = names.get(&slot, 0) else { break };
        if name.len == 0 {
            // Slots are given in order: the first unnamed one ends the list.
            break;
        }
        let len = (name.len as usize).min(SITE_NAME_BYTES);
        let site = String::from_utf8_lossy(&name.bytes[..len]);
        let raw = match sites.get(&slot, 0) {
            Ok(per_cpu) => sum_cpus(per_cpu.iter()),
            Err(_) => TcpSite::ZERO,
        };
        out.sites.push(SiteTcp::from_raw(&site, &raw));
    }
    out
}

/// Loads and attaches the sock_ops program in `ebpf` to this process's cgroup v2.
fn attach_sock_ops(ebpf: &mut aya::Ebpf) -> Result<PathBuf, EbpfError> {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cgroup = cgroup2_dir(&read("/proc/self/cgroup"), &read("/proc/self/mountinfo")).ok_or_else(|| {
        EbpfError::Load("no cgroup v2 hierarchy is mounted (/proc/self/cgroup has no `0::` line)".into())
    })?;
    let folder = std::fs::File::open(&cgroup)
        .map_err(|e| EbpfError::Load(format!("opening the cgroup {}: {e}", cgroup.display())))?;
    let program: &mut SockOps = ebpf
        .program_mut(TCP_PROGRAM)
        .ok_or_else(|| EbpfError::Load(format!("the object has no program `{TCP_PROGRAM}`")))?
        .try_into()
        .map_err(|e| EbpfError::Load(chain(&e)))?;
    program.load().map_err(|e| EbpfError::Load(chain(&e)))?;
    // Beside any other sock_ops program on the cgroup (another daemon, a CNI): aya
    // attaches with a bpf_link (5.7+), which the kernel always adds beside the others
    // and which takes no flags (ALLOW_MULTI there is EINVAL). (Before 5.7 a plain
    // `Single` attach would refuse to share the cgroup; such kernels fail here.)
    let mode = CgroupAttachMode::Single;
    program.attach(folder.as_fd(), mode).map_err(|e| {
        EbpfError::Load(format!(
            "attaching to the cgroup {}: {}",
            cgroup.display(),
            chain(&e)
        ))
    })?;
    Ok(cgroup)
}

/// Loads the object and attaches the sock_ops program to this process's cgroup, then
/// detaches it: what TCP health needs, checked without pinning anything.
pub(crate) fn probe_tcp() -> Result<String, EbpfError> {
    let mut ebpf = load_object(aya_log::Level::Info as u8, 0, None)?;
    let cgroup = attach_sock_ops(&mut ebpf)?;
    Ok(format!("sock_ops on the cgroup {}", cgroup.display()))
}
