//! The real implementation (Linux, feature `ebpf`), on aya.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use std::net::SocketAddrV4;

use aya::maps::{Array, HashMap, Map, MapData, PerCpuArray, ReusePortSockArray, SockHash};
use aya::programs::{SchedClassifier, SkSkb, TcAttachType};
use aya::{Ebpf, EbpfLoader};
use webship_ebpf_common::{
    Link, SiteName, TcpSite, UdpRedirect, COUNTERS, DIRECTION_DOWN, DIRECTION_UP, KERNEL_COUNTERS_MAP,
    LINKS_MAP, MAX_QUIC_SOCKETS, QUIC_SOCKETS_MAP, SOCKS_MAP, TCP_PORTS_MAP, TCP_SITES_MAP,
    TCP_SITE_NAMES_MAP, TCP_TAGS_MAP, UDP_CONFIG_MAP, UDP_PROGRAM, USER_COUNTERS_MAP, VERDICT_PROGRAM,
};

use super::tcp::TcpSnapshot;
use super::{pin_paths, EbpfError, Snapshot, Values};

#[cfg(webship_bpf_object)]
static OBJECT: Option<&[u8]> = Some(aya::include_bytes_aligned!(env!("WEBSHIP_EBPF_OBJECT_PATH")));
#[cfg(not(webship_bpf_object))]
static OBJECT: Option<&[u8]> = None;

/// The magic number of the BPF filesystem (`statfs`).
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// The loaded programs and their maps. Dropping it detaches the programs and
/// removes the pins.
pub(crate) struct Programs {
    socks: Mutex<SockHash<MapData, u64>>,
    links: Mutex<HashMap<MapData, u64, Link>>,
    /// The same map through a handle of its own, for the metrics: counting the
    /// links never holds the lock connections are linked under.
    links_reader: Mutex<HashMap<MapData, u64, Link>>,
    kernel_counters: PerCpuArray<MapData, u64>,
    user_counters: Mutex<Array<MapData, u64>>,
    udp_config: Mutex<Array<MapData, UdpRedirect>>,
    /// The HTTP/3 sockets' steering map (`quic_steer.rs`); taking over, the
    /// predecessor's own (a socket can be in one such map only).
    pub(super) quic_sockets: Mutex<ReusePortSockArray<MapData>>,
    /// TCP health (`tcp_health.rs`): tags, watched ports, per-site counters, names.
    pub(super) tcp: super::tcp_health::TcpMaps,
    pin_dir: PathBuf,
    // Keeps the programs and their attachments alive.
    pub(super) ebpf: Mutex<Ebpf>,
    /// The pin folder, open and exclusively locked (`flock`) for this daemon's
    /// life: a second daemon with the same folder is refused, not given our pins.
    /// The maps are unpinned (and, taking over, renamed) through it. A binary
    /// upgrade hands this open file to the successor, so the lock (which belongs to
    /// the open file, not the process) passes on with it.
    folder: std::fs::File,
    /// Set once a successor took the pins over: they are its now, and stay.
    handed_over: AtomicBool,
    /// Taking over: the maps are pinned under their pending names until this
    /// process serves.
    pending: AtomicBool,
}

impl std::fmt::Debug for Programs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Programs")
            .field("pin_dir", &self.pin_dir)
            .finish_non_exhaustive()
    }
}

impl Programs {
    /// Loads and attaches the programs and pins the counter maps under `pin_dir`
    /// (mounting the BPF filesystem on /sys/fs/bpf when it is not there yet). Log
    /// records from the programs go to tracing under the `webship::ebpf` target.
    ///
    /// `inherited_lock` is the locked pin folder a predecessor handed over in a binary
    /// upgrade: the lock is already held (shared with the predecessor until it
    /// exits), and the pins found there are taken over, not stale.
    ///
    /// `max_connections` sizes the TCP health tags (one per open client connection).
    pub(crate) fn load(
        pin_dir: &Path,
        inherited_lock: Option<OwnedFd>,
        max_connections: usize,
    ) -> Result<Arc<Self>, EbpfError> {
        let debug = tracing::enabled!(target: "webship::ebpf", tracing::Level::DEBUG);
        let level = if debug {
            aya_log::Level::Debug
        } else {
            aya_log::Level::Info
        } as u8;
        let taking_over = inherited_lock.is_some();
        // The predecessor's steering map holds the sockets this process inherits: its
        // program must use that map (see `quic_steer.rs`).
        let predecessors = pin_dir.join(super::QUIC_SOCKETS_PIN);
        let shared = (taking_over && predecessors.exists() && steering_map_fits(&predecessors))
            .then_some(predecessors.as_path());
        let mut ebpf = load_object(level, max_connections, shared)?;
        match aya_log::EbpfLogger::init_with_logger(&mut ebpf, TracingLog) {
            Ok(logger) => spawn_logger(logger),
            Err(e) => tracing::debug!(error = %e, "eBPF log records are not forwarded"),
        }
        let socks: SockHash<MapData, u64> = typed(take(&mut ebpf, SOCKS_MAP)?)?;
        let links_map = take(&mut ebpf, LINKS_MAP)?;
        let kernel_map = take(&mut ebpf, KERNEL_COUNTERS_MAP)?;
        let user_map = take(&mut ebpf, USER_COUNTERS_MAP)?;
        let udp_config = typed(take(&mut ebpf, UDP_CONFIG_MAP)?)?;
        let tcp_sites_map = take(&mut ebpf, TCP_SITES_MAP)?;
        let tcp_names_map = take(&mut ebpf, TCP_SITE_NAMES_MAP)?;
        let tcp_tags = typed(take(&mut ebpf, TCP_TAGS_MAP)?)?;
        let tcp_ports = typed(take(&mut ebpf, TCP_PORTS_MAP)?)?;
        let quic_map = take(&mut ebpf, QUIC_SOCKETS_MAP)?;
        attach_verdict(&mut ebpf, &socks)?;

        let lock = match inherited_lock {
            Some(fd) => std::fs::File::from(fd),
            None => prepare_pin_dir(pin_dir)?,
        };
        // Taking over, the maps go in under other names first and replace the
        // predecessor's pins only once this process serves (`adopt_pins`): should it
        // fail before, the predecessor's pins stay as they were.
        let [kernel_pin, user_pin, links_pin, quic_pin, sites_pin, names_pin] = match taking_over {
            true => pin_paths(pin_dir).map(|p| pending(&p)),
            false => pin_paths(pin_dir),
        };
        for (map, path) in [
            (&kernel_map, &kernel_pin),
            (&user_map, &user_pin),
            (&links_map, &links_pin),
            (&quic_map, &quic_pin),
            (&tcp_sites_map, &sites_pin),
            (&tcp_names_map, &names_pin),
        ] {
            // Starting fresh (the folder's lock is ours alone), a pending pin is a
            // crashed successor's: as stale as a final one.
            let stale = (!taking_over).then(|| pending(path));
            for old in [Some(path), stale.as_ref()].into_iter().flatten() {
                if old.exists() {
                    if !taking_over {
                        tracing::warn!(path = %old.display(), "replacing a stale pinned map (a previous daemon did not stop cleanly?)");
                    }
                    let _ = std::fs::remove_file(old);
                }
            }
            map.pin(path).map_err(|e| EbpfError::Pin {
                what: "cannot pin a counter map at",
                path: path.clone(),
                source: io::Error::other(e),
            })?;
        }
        let links_reader = MapData::from_pin(&links_pin).map_err(|e| EbpfError::Pin {
            what: "cannot open the pinned map",
            path: links_pin.clone(),
            source: io::Error::other(chain(&e)),
        })?;
        Ok(Arc::new(Self {
            socks: Mutex::new(socks),
            links: Mutex::new(typed(links_map)?),
            links_reader: Mutex::new(typed(Map::HashMap(links_reader))?),
            kernel_counters: typed(kernel_map)?,
            user_counters: Mutex::new(typed(user_map)?),
            udp_config: Mutex::new(udp_config),
            quic_sockets: Mutex::new(typed(quic_map)?),
            tcp: super::tcp_health::TcpMaps::new(
                tcp_tags,
                tcp_ports,
                typed(tcp_sites_map)?,
                typed(tcp_names_map)?,
            ),
            pin_dir: pin_dir.to_owned(),
            ebpf: Mutex::new(ebpf),
            folder: lock,
            handed_over: AtomicBool::new(false),
            pending: AtomicBool::new(taking_over),
        }))
    }

    /// Puts this process's maps in place of the predecessor's pins (an atomic
    /// rename on the BPF filesystem each), once this process serves.
    pub(crate) fn adopt_pins(&self) {
        if !self.pending.swap(false, Ordering::SeqCst) {
            return;
        }
        for path in pin_paths(&self.pin_dir) {
            // Relative to the folder, as the service account: see `Drop`.
            let name = path.file_name().unwrap_or(path.as_os_str());
            let from = pending(&path);
            let from = from.file_name().unwrap_or(from.as_os_str());
            let renamed = rustix::fs::renameat(&self.folder, from, &self.folder, name);
            if let Err(e) = renamed.map_err(io::Error::from) {
                tracing::warn!(path = %path.display(), error = %e, "cannot take the pinned map over");
            }
        }
    }

    /// The locked pin folder, for a successor to inherit.
    pub(crate) fn pin_lock(&self) -> BorrowedFd<'_> {
        self.folder.as_fd()
    }

    /// Where the maps are pinned.
    pub(crate) fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    /// A successor has taken the pins over: this process's programs and maps still
    /// serve its own linked sockets until it exits, but its pins are not removed.
    pub(crate) fn hand_over(&self) {
        self.handed_over.store(true, Ordering::SeqCst);
    }

    /// Starts the kernel's UDP redirection for HTTP/3 passthrough: the tc
    /// classifier on the loopback interface's ingress rewrites datagrams for
    /// `listen` to `origin` and the origin's replies back, so both directions
    /// bypass the daemon. Both addresses must be on loopback (the rewrite keeps the
    /// client's address, so the origin's replies must come back through this host's
    /// loopback). Detached when the programs are dropped.
    pub(crate) fn redirect_udp(&self, listen: SocketAddrV4, origin: SocketAddrV4) -> Result<(), EbpfError> {
        let mut ebpf = lock(&self.ebpf);
        let program: &mut SchedClassifier = ebpf
            .program_mut(UDP_PROGRAM)
            .ok_or_else(|| EbpfError::Load(format!("the object has no program `{UDP_PROGRAM}`")))?
            .try_into()
            .map_err(|e| EbpfError::Load(chain(&e)))?;
        program.load().map_err(|e| EbpfError::Load(chain(&e)))?;
        // On kernels with TCX (6.6+) this is a link that goes with the program; on
        // older ones aya needs the clsact qdisc, which may already exist.
        let _ = aya::programs::tc::qdisc_add_clsact("lo");
        program
            .attach("lo", TcAttachType::Ingress)
            .map_err(|e| EbpfError::Load(format!("attaching to lo ingress: {}", chain(&e))))?;
        let redirect = UdpRedirect {
            listen_ip: u32::from_ne_bytes(listen.ip().octets()),
            origin_ip: u32::from_ne_bytes(origin.ip().octets()),
            listen_port: listen.port().to_be(),
            origin_port: origin.port().to_be(),
            enabled: 1,
        };
        lock(&self.udp_config)
            .set(0, redirect, 0)
            .map_err(|e| EbpfError::Load(chain(&e)))
    }

    /// Links a client socket and its upstream both ways: from now on the kernel
    /// moves every byte either one receives to the other. Segments already queued
    /// in a socket go through the verdict, in order, when the daemon next reads it
    /// (their arrival made it readable), so whatever the daemon wants a peer to
    /// see first must have been written before the link.
    ///
    /// Fails only with neither socket in the map. A pair the kernel linked half
    /// (the client in the map, the upstream refused: closed already, or the map
    /// full) comes back as a link whose [`SocketLink::refused`] says why: the
    /// client's segments then all wait for userspace, in order, and the caller
    /// relays them itself *holding the link* — dropping it would take the client
    /// out of the map, and the kernel discards what a socket leaving it holds.
    pub(crate) fn link(
        self: &Arc<Self>,
        client: BorrowedFd<'_>,
        upstream: BorrowedFd<'_>,
    ) -> io::Result<SocketLink> {
        let c = rustix::net::sockopt::socket_cookie(client)?;
        let u = rustix::net::sockopt::socket_cookie(upstream)?;
        let mut link = SocketLink {
            programs: self.clone(),
            client: c,
            upstream: u,
            refused: None,
        };
        let up = Link {
            peer: u,
            direction: DIRECTION_UP,
            ..Link::default()
        };
        let down = Link {
            peer: c,
            direction: DIRECTION_DOWN,
            ..Link::default()
        };
        // The directions first: a socket in the map without one passes its bytes
        // to userspace, and one left behind that way would be overtaken by the
        // next, redirected, segment.
        let mut links = lock(&self.links);
        links.insert(c, up, 0).map_err(io::Error::other)?;
        links.insert(u, down, 0).map_err(io::Error::other)?;
        drop(links);
        // The client first: until the upstream is in the map too, what the client
        // sends is passed (and the program keeps passing that direction), so a
        // refused upstream leaves a link that still delivers in order.
        let mut socks = lock(&self.socks);
        socks.insert(c, client.as_raw_fd(), 0).map_err(io::Error::other)?;
        if let Err(e) = socks.insert(u, upstream.as_raw_fd(), 0) {
            link.refused = Some(io::Error::other(e));
        }
        drop(socks);
        Ok(link)
    }

    /// Publishes the daemon's own counters for `webship stats`.
    pub(crate) fn publish(&self, values: &Values) {
        let mut map = lock(&self.user_counters);
        for (i, v) in (0..COUNTERS).zip(values) {
            if let Err(e) = map.set(i, v, 0) {
                tracing::debug!(error = %e, "cannot publish a counter");
                return;
            }
        }
    }

    /// The programs' counters, summed over CPUs.
    pub(crate) fn kernel_counters(&self) -> Values {
        sum_per_cpu(&self.kernel_counters)
    }

    /// Sockets the `sockmap` engine has linked now (what `webship stats` shows).
    pub(crate) fn linked_sockets(&self) -> u64 {
        lock(&self.links_reader).keys().count() as u64
    }
}

impl Drop for Programs {
    fn drop(&mut self) {
        if self.handed_over.load(Ordering::SeqCst) {
            return;
        }
        let pending_pins = self.pending.load(Ordering::SeqCst);
        for path in pin_paths(&self.pin_dir) {
            // Relative to the folder opened at start: the service account may not
            // search /sys/fs/bpf (systemd mounts it 0700), only the folder it was
            // given (see `server::give_pins`).
            let path = if pending_pins { pending(&path) } else { path };
            let name = path.file_name().unwrap_or(path.as_os_str());
            let removed = rustix::fs::unlinkat(&self.folder, name, rustix::fs::AtFlags::empty());
            if let Err(e) = removed.map_err(io::Error::from) {
                if e.kind() != io::ErrorKind::NotFound {
                    tracing::warn!(path = %path.display(), error = %e, "cannot remove a pinned map");
                }
            }
        }
        // Only removes the folder when nothing else is pinned there.
        let _ = std::fs::remove_dir(&self.pin_dir);
    }
}

/// Whether the pinned map at `path` can be the QUIC steering map: a
/// REUSEPORT_SOCKARRAY of [`MAX_QUIC_SOCKETS`] entries, as this object declares.
/// The pin folder is writable by the service account, which could have put another
/// map there; the verifier refuses the steering program with it (no steering at
/// all, and with `ebpf = "required"` no start), while a fresh map only costs the
/// steering of the inherited sockets (`EBUSY`, logged).
fn steering_map_fits(path: &Path) -> bool {
    let why = match aya::maps::MapInfo::from_pin(path) {
        Ok(info) => match info.map_type() {
            Ok(aya::maps::MapType::ReuseportSockArray) if info.max_entries() == MAX_QUIC_SOCKETS => {
                return true
            }
            Ok(other) => format!("a {other:?} map of {} entries", info.max_entries()),
            Err(e) => chain(&e),
        },
        Err(e) => chain(&e),
    };
    tracing::warn!(path = %path.display(), found = %why, "the pinned QUIC steering map is not one this daemon made; a fresh one is used");
    false
}

/// Where a map is pinned by a process taking over until it serves.
fn pending(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    // No dot: the BPF filesystem keeps names with dots for itself (EPERM).
    name.push("_takeover");
    PathBuf::from(name)
}

/// A linked socket pair; dropping it unlinks both sockets.
pub(crate) struct SocketLink {
    programs: Arc<Programs>,
    client: u64,
    upstream: u64,
    /// Why the upstream is not in the map, for a half link.
    refused: Option<io::Error>,
}

impl std::fmt::Debug for SocketLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SocketLink")
            .field("client", &self.client)
            .field("upstream", &self.upstream)
            .finish()
    }
}

impl SocketLink {
    /// Why only the client is linked (the upstream was refused), if it is.
    pub(crate) fn refused(&self) -> Option<&io::Error> {
        self.refused.as_ref()
    }

    /// Bytes the kernel moved client → upstream and upstream → client so far.
    pub(crate) fn redirected(&self) -> (u64, u64) {
        let links = lock(&self.programs.links);
        let get = |cookie| links.get(&cookie, 0).map(|l| l.redirected).unwrap_or(0);
        (get(self.client), get(self.upstream))
    }
}

impl Drop for SocketLink {
    fn drop(&mut self) {
        let mut socks = lock(&self.programs.socks);
        let _ = socks.remove(&self.client);
        let _ = socks.remove(&self.upstream);
        drop(socks);
        let mut links = lock(&self.programs.links);
        let _ = links.remove(&self.client);
        let _ = links.remove(&self.upstream);
    }
}

/// Loads the object and attaches the verdict program to a fresh map, then inserts
/// a connected loopback socket: what the `sockmap` engine needs, checked without
/// pinning anything. Returns what was verified.
pub(crate) fn probe() -> Result<String, EbpfError> {
    let mut ebpf = load_object(aya_log::Level::Info as u8, 0, None)?;
    let mut socks: SockHash<MapData, u64> = typed(take(&mut ebpf, SOCKS_MAP)?)?;
    attach_verdict(&mut ebpf, &socks)?;
    let (a, _b) = crate::sys::loopback_pair().map_err(|e| EbpfError::Load(format!("loopback pair: {e}")))?;
    socks
        .insert(1, a.as_raw_fd(), 0)
        .map_err(|e| EbpfError::Load(format!("SOCKHASH insert of a TCP socket: {}", chain(&e))))?;
    let _ = socks.remove(&1);
    // HTTP/3 socket steering is an extra: without it the sockets hand datagrams over
    // themselves, so its absence is reported, not fatal.
    let steer = match super::quic_steer::load_steer(&mut ebpf) {
        Ok(_) => "SK_REUSEPORT QUIC socket steering".to_owned(),
        Err(e) => format!("no SK_REUSEPORT QUIC socket steering: {e}"),
    };
    Ok(format!(
        "sk_skb stream verdict on a SOCKHASH, per-CPU counters; {steer}"
    ))
}

/// Reads the pinned counters of a running daemon.
pub fn read_pinned(dir: &Path) -> Result<Snapshot, EbpfError> {
    let [kernel_pin, user_pin, links_pin, ..] = pin_paths(dir);
    if !kernel_pin.exists() || !user_pin.exists() || !links_pin.exists() {
        return Err(EbpfError::NotRunning(dir.to_owned()));
    }
    let kernel: PerCpuArray<MapData, u64> = typed(Map::PerCpuArray(open(&kernel_pin)?))?;
    let user: Array<MapData, u64> = typed(Map::Array(open(&user_pin)?))?;
    let links: HashMap<MapData, u64, Link> = typed(Map::HashMap(open(&links_pin)?))?;
    let mut snapshot = Snapshot {
        kernel: sum_per_cpu(&kernel),
        user: [0; COUNTERS as usize],
        linked_sockets: links.keys().count() as u64,
    };
    for (i, slot) in (0..COUNTERS).zip(snapshot.user.iter_mut()) {
        *slot = user.get(&i, 0).unwrap_or(0);
    }
    Ok(snapshot)
}

/// Reads the pinned TCP health of a running daemon (empty when it counts no site).
pub fn read_tcp_pinned(dir: &Path) -> Result<TcpSnapshot, EbpfError> {
    let [.., sites_pin, names_pin] = pin_paths(dir);
    if !sites_pin.exists() || !names_pin.exists() {
        return Err(EbpfError::NotRunning(dir.to_owned()));
    }
    let sites: PerCpuArray<MapData, TcpSite> = typed(Map::PerCpuArray(open(&sites_pin)?))?;
    let names: Array<MapData, SiteName> = typed(Map::Array(open(&names_pin)?))?;
    Ok(super::tcp_health::snapshot(&names, &sites))
}

pub(super) fn open(path: &Path) -> Result<MapData, EbpfError> {
    MapData::from_pin(path).map_err(|e| EbpfError::Pin {
        what: "cannot open the pinned map",
        path: path.to_owned(),
        source: io::Error::other(chain(&e)),
    })
}

/// `tags`: entries of the TCP health tag map (0: as in the object). `quic_sockets`:
/// the pin of an existing QUIC steering map the programs use instead of a new one.
pub(super) fn load_object(
    log_level: u8,
    tags: usize,
    quic_sockets: Option<&Path>,
) -> Result<Ebpf, EbpfError> {
    let object = OBJECT.ok_or(EbpfError::NotBuilt)?;
    let mut loader = EbpfLoader::new();
    if let Some(pin) = quic_sockets {
        loader.map_pin_path(QUIC_SOCKETS_MAP, pin);
    }
    loader.override_global(aya_log::LEVEL, &log_level, false);
    if tags > 0 {
        // Every open connection may hold a tag; some slack for closed ones whose
        // tag came too late (the LRU evicts those).
        let entries = u32::try_from(tags.saturating_mul(2))
            .unwrap_or(u32::MAX)
            .clamp(1024, 1 << 22);
        loader.map_max_entries(TCP_TAGS_MAP, entries);
    }
    loader.load(object).map_err(|e| EbpfError::Load(chain(&e)))
}

fn attach_verdict(ebpf: &mut Ebpf, socks: &SockHash<MapData, u64>) -> Result<(), EbpfError> {
    let program: &mut SkSkb = ebpf
        .program_mut(VERDICT_PROGRAM)
        .ok_or_else(|| EbpfError::Load(format!("the object has no program `{VERDICT_PROGRAM}`")))?
        .try_into()
        .map_err(|e| EbpfError::Load(chain(&e)))?;
    program.load().map_err(|e| EbpfError::Load(chain(&e)))?;
    program
        .attach(socks.fd())
        .map_err(|e| EbpfError::Load(chain(&e)))?;
    Ok(())
}

pub(super) fn take(ebpf: &mut Ebpf, name: &str) -> Result<Map, EbpfError> {
    ebpf.take_map(name)
        .ok_or_else(|| EbpfError::Load(format!("the object has no map `{name}`")))
}

pub(super) fn typed<T>(map: Map) -> Result<T, EbpfError>
where
    T: TryFrom<Map, Error = aya::maps::MapError>,
{
    T::try_from(map).map_err(|e| EbpfError::Load(chain(&e)))
}

fn sum_per_cpu(map: &PerCpuArray<MapData, u64>) -> Values {
    let mut out = [0; COUNTERS as usize];
    for (i, slot) in (0..COUNTERS).zip(out.iter_mut()) {
        *slot = map
            .get(&i, 0)
            .map(|per_cpu| per_cpu.iter().copied().fold(0u64, u64::wrapping_add))
            .unwrap_or(0);
    }
    out
}

/// Mounts the BPF filesystem on /sys/fs/bpf when the pin folder is under it and it
/// is not mounted, checks that the folder is on a BPF filesystem before creating
/// or deleting anything there, creates it, and locks it for this daemon.
fn prepare_pin_dir(dir: &Path) -> Result<std::fs::File, EbpfError> {
    let root = Path::new("/sys/fs/bpf");
    if dir.starts_with(root) && fs_magic(root) != Some(BPF_FS_MAGIC) {
        rustix::mount::mount("bpf", root, "bpf", rustix::mount::MountFlags::empty(), None).map_err(|e| {
            EbpfError::Pin {
                what: "cannot mount the BPF filesystem on",
                path: root.to_owned(),
                source: e.into(),
            }
        })?;
        tracing::info!("mounted the BPF filesystem on /sys/fs/bpf");
    }
    // The folder, or where it would be created, must be a BPF filesystem: pinning
    // elsewhere fails anyway, and the stale-pin cleanup must never delete an
    // operator's files.
    let existing = dir.ancestors().find(|p| p.exists()).unwrap_or(dir);
    let on_bpffs = |p: &Path| match fs_magic(p) {
        Some(BPF_FS_MAGIC) => Ok(()),
        magic => Err(EbpfError::NotBpfFs {
            path: dir.to_owned(),
            magic: magic.unwrap_or(0),
        }),
    };
    on_bpffs(existing)?;
    std::fs::create_dir_all(dir).map_err(|source| EbpfError::Pin {
        what: "cannot create the pin folder",
        path: dir.to_owned(),
        source,
    })?;
    on_bpffs(dir)?;
    let folder = std::fs::File::open(dir).map_err(|source| EbpfError::Pin {
        what: "cannot open the pin folder",
        path: dir.to_owned(),
        source,
    })?;
    // Released by the kernel when the daemon exits, however it exits.
    match rustix::fs::flock(&folder, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(folder),
        Err(rustix::io::Errno::WOULDBLOCK) => Err(EbpfError::PinDirBusy(dir.to_owned())),
        Err(e) => Err(EbpfError::Pin {
            what: "cannot lock the pin folder",
            path: dir.to_owned(),
            source: e.into(),
        }),
    }
}

/// The file system type of `path` (`statfs`), if it can be read.
fn fs_magic(path: &Path) -> Option<i64> {
    #[allow(clippy::useless_conversion)] // `f_type`'s width differs between libcs.
    rustix::fs::statfs(path).ok().map(|s| i64::from(s.f_type))
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A map handle has no invariant a panicking holder could break.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

pub(super) fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// Forwards aya-log records from the programs to tracing.
struct TracingLog;

impl log::Log for TracingLog {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }

    fn log(&self, record: &log::Record<'_>) {
        let message = record.args();
        match record.level() {
            log::Level::Error => tracing::error!(target: "webship::ebpf", "{message}"),
            log::Level::Warn => tracing::warn!(target: "webship::ebpf", "{message}"),
            log::Level::Info => tracing::info!(target: "webship::ebpf", "{message}"),
            log::Level::Debug => tracing::debug!(target: "webship::ebpf", "{message}"),
            log::Level::Trace => tracing::trace!(target: "webship::ebpf", "{message}"),
        }
    }

    fn flush(&self) {}
}

/// Drains the programs' log ring buffer a few times a second. (Waiting on the ring
/// buffer's fd would need tokio's `unsafe` registration; records are rare and
/// only for failures, so a short timer costs less than that.)
fn spawn_logger(mut logger: aya_log::EbpfLogger<TracingLog>) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_millis(250));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            logger.flush();
        }
    });
}
