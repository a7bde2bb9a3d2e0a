//! The systemd unit (`packaging/webship.service`) and what the daemon tells systemd
//! and the journal. The unit is checked by `systemd-analyze`, and its promises by
//! running the real daemon the way the unit would: with exactly its capability
//! bounding set (setpriv), and under strace, whose system calls, socket families and
//! written paths must all be inside the unit's filters. The notify protocol is
//! received on a Unix datagram socket of the test's own; the log formats are parsed
//! line by line.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use webship_testkit::process::{start_on_free_port, Logs, Process, Ready};
use webship_tests::client::{fetch, fetch_h3, Proto};
use webship_tests::server::{binary, eventually};
use webship_tests::{webship, Server};

use crate::support::{origin_server, passthrough_toml, Env, HOST};

const UNIT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../packaging/webship.service");
const START: Duration = Duration::from_secs(20);

fn unit() -> String {
    std::fs::read_to_string(UNIT).unwrap_or_else(|e| panic!("{UNIT}: {e}"))
}

/// The words of every `key=` line of the unit, in order.
fn values(unit: &str, key: &str) -> Vec<String> {
    let prefix = format!("{key}=");
    unit.lines()
        .filter_map(|l| l.strip_prefix(&prefix))
        .flat_map(|v| v.split_whitespace().map(str::to_owned))
        .collect()
}

/// Whether `command` is on PATH; if not, says the test is skipped and why.
fn require(command: &str, package: &str) -> bool {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {command}")])
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        eprintln!(
            "SKIPPED: `{command}` is missing; install the `{package}` package (`cargo xtask test` does)"
        );
    }
    found
}

#[test]
fn the_unit_verifies_and_its_exposure_stays_low() {
    if !require("systemd-analyze", "systemd") {
        return;
    }
    let text = unit();
    let exec = "ExecStart=/usr/bin/webship serve --config /etc/webship/webship.toml";
    assert!(text.lines().any(|l| l == exec), "{UNIT} has no `{exec}`");
    assert_eq!(values(&text, "Type"), ["notify"]);
    // verify insists that ExecStart names an existing binary: this build's.
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("webship.service");
    let ours = format!("ExecStart={} ", binary().display());
    std::fs::write(&copy, text.replace("ExecStart=/usr/bin/webship ", &ours)).unwrap();
    let out = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&copy)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    // A bad value is only a warning to verify, so anything it says is a failure.
    assert!(
        out.status.success() && said.trim().is_empty(),
        "systemd-analyze verify: {said}"
    );
    // The arguments ExecStart passes are the binary's: a missing file is reported
    // as such, not as a usage error.
    let out = webship(&["serve", "--config", "/nonexistent/webship.toml"], dir.path());
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains("cannot read the configuration"), "{said}");

    let out = Command::new("systemd-analyze")
        .args(["security", "--offline=yes", "--no-pager"])
        .arg(&copy)
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&out.stdout);
    let level = report
        .lines()
        .find_map(|l| l.split("Overall exposure level for webship.service:").nth(1))
        .and_then(|rest| rest.split_whitespace().next()?.parse::<f64>().ok())
        .unwrap_or_else(|| {
            panic!(
                "no exposure level in: {report}{}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    eprintln!("systemd-analyze security: exposure {level}");
    assert!(level <= 3.0, "exposure {level} (2.6 when written): {report}");
}

/// A port below 1024 that nothing uses (TCP and UDP) when unprivileged processes
/// cannot bind it, so that binding it needs CAP_NET_BIND_SERVICE; else `None`.
fn privileged_port() -> Option<u16> {
    let start: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_unprivileged_port_start")
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let first = 600 + (std::process::id() % 200) as u16;
    (first..first + 200)
        .filter(|&p| p < start)
        .find(|&p| TcpListener::bind(("127.0.0.1", p)).is_ok() && UdpSocket::bind(("127.0.0.1", p)).is_ok())
}

/// The temp dirs are 0700: the service account must be able to reach the root.
fn open_up(env: &Env) {
    for dir in [env.dir.path(), env.root.as_path()] {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
}

/// A pin folder inside a root-only (0700) folder, as systemd mounts /sys/fs/bpf:
/// the service account can reach its pins only through the folder it was handed.
/// Removed when dropped.
struct Pins {
    parent: PathBuf,
    dir: PathBuf,
}

/// systemd mounts the BPF filesystem at boot; a bare host (a container, a fresh VM)
/// may not have, and the daemon mounts it only for its own pin folder. The folders
/// here are made before any daemon runs, so the test mounts it as systemd would.
fn mount_bpffs() {
    static MOUNTED: std::sync::Once = std::sync::Once::new();
    MOUNTED.call_once(|| {
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
        if mounts.lines().any(|l| l.split(' ').nth(1) == Some("/sys/fs/bpf")) {
            return;
        }
        let out = Command::new("mount")
            .args(["-t", "bpf", "bpf", "/sys/fs/bpf"])
            .output()
            .expect("mount");
        assert!(
            out.status.success(),
            "cannot mount the BPF filesystem on /sys/fs/bpf: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    });
}

impl Pins {
    fn new(name: &str) -> Self {
        mount_bpffs();
        let parent = PathBuf::from(format!("/sys/fs/bpf/webship-e2e-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&parent);
        std::fs::create_dir(&parent).unwrap();
        std::fs::set_permissions(&parent, std::fs::Permissions::from_mode(0o700)).unwrap();
        let dir = parent.join("pins");
        Self { parent, dir }
    }

    fn left(&self) -> Vec<String> {
        std::fs::read_dir(&self.dir)
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl Drop for Pins {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.parent);
    }
}

/// What the unit's daemon does: a file site over h1, h2 and h3, TLS passthrough for
/// `a.pass` by the sockmap engine (eBPF required), and the switch to `nobody`.
fn unit_like_config(env: &Env, origin: SocketAddr, pins: &Path) -> String {
    let passthrough = passthrough_toml("passthrough_engine = \"sockmap\"\n", false, &[("a.pass", origin)])
        .replace("/sys/fs/bpf/webship-e2e-{port}", pins.to_str().unwrap())
        .replacen("[kernel]\n", "[kernel]\nebpf = \"required\"\n", 1);
    env.config(&format!(
        "user = \"nobody\"\ngroup = \"nogroup\"\n[limits]\nshutdown_grace_secs = 2\nmax_connections = 1000\n{passthrough}"
    ))
}

/// One world for the unit-like daemon: the site's files, an origin for `a.pass`.
struct World {
    env: Env,
    origin: Server,
    pins: Pins,
}

impl World {
    fn new(name: &str) -> Self {
        let env = Env::new();
        open_up(&env);
        env.write("hello.txt", b"hello from the unit");
        let origin_root = env.dir.path().join("origin");
        std::fs::create_dir(&origin_root).unwrap();
        std::fs::write(origin_root.join("who.txt"), "the origin").unwrap();
        let origin = origin_server(&env, "a", "a.pass", &origin_root, "", "");
        Self {
            env,
            origin,
            pins: Pins::new(name),
        }
    }

    fn config(&self) -> String {
        unit_like_config(&self.env, self.origin.addr(), &self.pins.dir)
    }

    /// The other passthrough paths: TCP by splice, HTTP/3 redirected to the origin by
    /// the tc classifier (eBPF required), no site; the same switch to `nobody`.
    fn quic_config(&self) -> String {
        let origin = self.origin.addr();
        let settings =
            format!("passthrough_engine = \"splice\"\nudp_upstream = \"{origin}\"\nudp_engine = \"ebpf\"\n");
        let passthrough = passthrough_toml(&settings, true, &[("a.pass", origin)])
            .replace("/sys/fs/bpf/webship-e2e-{port}", self.pins.dir.to_str().unwrap())
            .replacen("[kernel]\n", "[kernel]\nebpf = \"required\"\n", 1);
        format!(
            "listen = \"127.0.0.1:{{port}}\"\nworkers = 2\nuser = \"nobody\"\ngroup = \"nogroup\"\n\
             [limits]\nshutdown_grace_secs = 2\nmax_connections = 1000\n{passthrough}"
        )
    }

    /// The site over h1, h2 and h3, and `a.pass` through passthrough, all exact.
    async fn check_traffic(&self, addr: SocketAddr, log: &dyn Fn() -> String) {
        for proto in [Proto::H1, Proto::H2] {
            let got = fetch(
                proto,
                addr,
                HOST,
                self.env.client(proto.alpn()),
                "GET",
                "/hello.txt",
                &[],
            )
            .await;
            assert_eq!(got.status, 200, "{proto:?}: {}", log());
            assert_eq!(got.body, b"hello from the unit", "{proto:?}");
            let got = fetch(
                proto,
                addr,
                "a.pass",
                self.env.client(proto.alpn()),
                "GET",
                "/who.txt",
                &[],
            )
            .await;
            assert_eq!(got.status, 200, "passthrough {proto:?}: {}", log());
            assert_eq!(got.body, b"the origin", "passthrough {proto:?}");
        }
        let got = fetch_h3(addr, HOST, self.env.client(b"h3"), "GET", "/hello.txt", &[]).await;
        assert_eq!(got.status, 200, "h3: {}", log());
        assert_eq!(got.body, b"hello from the unit", "h3");
    }

    /// `a.pass` through [`World::quic_config`]'s front over h1, h2 and h3.
    async fn check_passthrough(&self, addr: SocketAddr, log: &dyn Fn() -> String) {
        for proto in [Proto::H1, Proto::H2] {
            let got = fetch(
                proto,
                addr,
                "a.pass",
                self.env.client(proto.alpn()),
                "GET",
                "/who.txt",
                &[],
            )
            .await;
            assert_eq!(got.status, 200, "passthrough {proto:?}: {}", log());
            assert_eq!(got.body, b"the origin", "passthrough {proto:?}");
        }
        let got = fetch_h3(addr, "a.pass", self.env.client(b"h3"), "GET", "/who.txt", &[]).await;
        assert_eq!(got.status, 200, "h3 passthrough: {}", log());
        assert_eq!(got.body, b"the origin", "h3 passthrough");
    }
}

/// Which of [`World`]'s daemons runs.
#[derive(Debug, Clone, Copy)]
enum Shape {
    Unit,
    Quic,
}

/// `setpriv --bounding-set` for exactly `caps` (the unit's spelling, `CAP_BPF`).
fn bounding_set(caps: &[String]) -> String {
    let mut spec = String::from("-all");
    for cap in caps {
        spec.push_str(",+");
        spec.push_str(&cap.trim_start_matches("CAP_").to_ascii_lowercase());
    }
    spec
}

/// `webship serve` of `config` on `port` as root with only `caps` and, like the
/// unit's `NoNewPrivileges=yes`, no new privileges from the start; logging to `name`.
fn start_bounded(world: &World, caps: &[String], port: u16, name: &str) -> Process {
    let dir = world.env.dir.path();
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, world.config().replace("{port}", &port.to_string())).unwrap();
    let mut command = Command::new("setpriv");
    command
        .arg(format!("--bounding-set={}", bounding_set(caps)))
        .arg("--no-new-privs")
        .arg("--")
        .arg(binary())
        .args(["serve", "--config", path.to_str().unwrap()])
        .current_dir(dir)
        .env("WEBSHIP_LOG", "info");
    Process::spawn(
        "webship",
        &mut command,
        Logs::one(dir.join(format!("{name}.log"))),
    )
    .unwrap()
}

/// What goes wrong without each capability of the unit's set.
enum Without {
    /// Start-up fails with this in the log.
    Refused(&'static str),
    /// The daemon serves, but logs this.
    Warns(&'static str),
}

fn without(cap: &str) -> Without {
    match cap {
        "CAP_NET_BIND_SERVICE" => Without::Refused("cannot listen on"),
        "CAP_SETUID" => Without::Refused("cannot switch to user `nobody` (setresuid)"),
        "CAP_SETGID" => Without::Refused("cannot switch to user `nobody` (setgroups)"),
        "CAP_BPF" | "CAP_NET_ADMIN" => Without::Refused("ebpf  [required] MISSING"),
        "CAP_CHOWN" => Without::Warns("cannot hand a pinned map to the service account"),
        other => panic!("{other} is in the unit's CapabilityBoundingSet, but this test does not know what breaks without it: add it to `without`"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_unit_capability_set_is_enough_and_each_capability_is_needed() {
    if !require("setpriv", "util-linux") {
        return;
    }
    let caps = values(&unit(), "CapabilityBoundingSet");
    assert!(!caps.is_empty(), "no CapabilityBoundingSet= in {UNIT}");
    let world = World::new("caps");
    let low = privileged_port();
    let port = low.unwrap_or_else(|| webship_tests::server::free_port().unwrap());
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let ready = Ready {
        port,
        line: Some("listening on"),
        within: START,
    };

    // Twice: the second start finds the pin folder the first one handed over.
    for run in ["first", "restart"] {
        let mut daemon = start_bounded(&world, &caps, port, run);
        if let Err(e) = daemon.wait_ready(&ready) {
            panic!("{run}: webship {e} with only {caps:?}:\n{}", daemon.log());
        }
        let log = || daemon.log();
        assert!(log().contains("switched to the service account"), "{}", log());
        world.check_traffic(addr, &log).await;
        daemon.terminate().unwrap();
        let status = daemon.wait_exit(START).expect("did not exit after SIGTERM");
        assert!(status.success(), "{run}: {status}\n{}", daemon.log());
        assert_eq!(
            world.pins.left(),
            Vec::<String>::new(),
            "{run}: pins left:\n{}",
            daemon.log()
        );
        assert!(!daemon.log().contains("pinned map"), "{run}: {}", daemon.log());
    }

    for cap in &caps {
        if cap == "CAP_NET_BIND_SERVICE" && low.is_none() {
            eprintln!("not checked: {cap} (unprivileged processes may bind every port here)");
            continue;
        }
        let fewer: Vec<String> = caps.iter().filter(|c| *c != cap).cloned().collect();
        let name = format!("without-{cap}");
        let mut daemon = start_bounded(&world, &fewer, port, &name);
        match without(cap) {
            Without::Refused(why) => {
                let status = daemon
                    .wait_exit(START)
                    .unwrap_or_else(|| panic!("still running without {cap}:\n{}", daemon.log()));
                assert!(!status.success(), "without {cap}: {status}");
                assert!(
                    daemon.log().contains(why),
                    "without {cap}, expected {why:?}:\n{}",
                    daemon.log()
                );
            }
            Without::Warns(why) => {
                if let Err(e) = daemon.wait_ready(&ready) {
                    panic!("without {cap}: webship {e}:\n{}", daemon.log());
                }
                assert!(
                    daemon.log().contains(why),
                    "without {cap}, expected {why:?}:\n{}",
                    daemon.log()
                );
                daemon.terminate().unwrap();
                assert!(daemon.wait_exit(START).is_some(), "without {cap}: did not exit");
            }
        }
    }
}

/// The system calls a process may make under `filter` (SystemCallFilter= words),
/// with the groups expanded from `systemd-analyze syscall-filter`.
fn allowed_syscalls(filter: &[String]) -> BTreeSet<String> {
    let out = Command::new("systemd-analyze")
        .arg("syscall-filter")
        .output()
        .unwrap();
    let mut groups: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut current = None;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        if line.starts_with('@') {
            current = Some(line.trim().to_owned());
        } else if let Some(group) = &current {
            let word = line.trim();
            if !word.is_empty() && !word.starts_with('#') {
                groups.entry(group.clone()).or_default().push(word.to_owned());
            }
        }
    }
    let mut allowed = BTreeSet::new();
    let mut todo: Vec<String> = filter.to_vec();
    let mut seen = BTreeSet::new();
    while let Some(word) = todo.pop() {
        if !word.starts_with('@') {
            allowed.insert(word);
        } else if seen.insert(word.clone()) {
            let members = groups
                .get(&word)
                .unwrap_or_else(|| panic!("systemd-analyze knows no {word}"));
            todo.extend(members.iter().cloned());
        }
    }
    allowed
}

/// What a strace log (`-f -y`) shows: system calls by name, socket families, and
/// the paths written (opened for writing, created, removed, chowned).
#[derive(Default, Debug)]
struct Trace {
    syscalls: BTreeSet<String>,
    families: BTreeSet<String>,
    written: BTreeSet<String>,
}

impl Trace {
    fn parse(text: &str) -> Self {
        let mut trace = Trace::default();
        for line in text.lines() {
            // "PID name(args) = result"; skip resumptions, signals and exits.
            let call = line.split_once(' ').map_or(line, |(_, rest)| rest).trim_start();
            let Some((name, args)) = call.split_once('(') else {
                continue;
            };
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                continue;
            }
            trace.syscalls.insert(name.to_owned());
            if matches!(name, "socket" | "socketpair") {
                trace
                    .families
                    .insert(args.split(',').next().unwrap_or("").to_owned());
            }
            let first_path = || args.split('"').nth(1).map(str::to_owned);
            let writes = match name {
                "openat" | "open" => ["O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC"]
                    .iter()
                    .any(|f| args.contains(f)),
                "mkdir" | "mkdirat" | "unlink" | "unlinkat" | "rmdir" | "rename" | "renameat"
                | "renameat2" | "chown" | "lchown" | "fchownat" | "chmod" | "fchmodat" | "truncate"
                | "symlink" | "link" => true,
                _ => false,
            };
            if writes {
                // -y prints a directory descriptor as `5</its/path>`: join a relative name to it.
                let path = first_path().unwrap_or_default();
                let path = match (path.starts_with('/'), args.split_once('<')) {
                    (false, Some((_, rest))) => format!("{}/{path}", rest.split('>').next().unwrap_or("")),
                    _ => path,
                };
                trace.written.insert(path);
            }
            if matches!(name, "fchown" | "fchmod" | "ftruncate") {
                if let Some((_, rest)) = args.split_once('<') {
                    trace
                        .written
                        .insert(rest.split('>').next().unwrap_or("").to_owned());
                }
            }
        }
        trace
    }
}

/// The daemon of `shape` run under strace, its traffic checked, then stopped by
/// SIGTERM.
async fn traced(world: &World, shape: Shape) -> Trace {
    let dir = world.env.dir.path();
    let trace_file = dir.join(format!("strace-{shape:?}.txt"));
    let config = match shape {
        Shape::Unit => world.config(),
        Shape::Quic => world.quic_config(),
    };
    let (mut strace, port) = start_on_free_port(Some("listening on"), START, |port| {
        let path = dir.join("traced.toml");
        std::fs::write(&path, config.replace("{port}", &port.to_string()))?;
        let mut command = Command::new("strace");
        command
            .args(["-f", "-qq", "-y", "-s", "256", "-o"])
            .arg(&trace_file)
            .arg(binary())
            .args(["serve", "--config", path.to_str().unwrap()])
            .current_dir(dir)
            .env("WEBSHIP_LOG", "info");
        Process::spawn(
            "strace",
            &mut command,
            Logs::one(dir.join(format!("traced-{port}.log"))),
        )
    })
    .unwrap_or_else(|e| panic!("{e:#}"));
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let log = || strace.log();
    match shape {
        Shape::Unit => world.check_traffic(addr, &log).await,
        Shape::Quic => world.check_passthrough(addr, &log).await,
    }
    // SIGTERM to the daemon itself (strace would only detach).
    let children = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", strace.pid())).unwrap();
    let daemon = children.split_whitespace().next().expect("strace has no child");
    assert!(Command::new("kill")
        .args(["-TERM", daemon])
        .status()
        .unwrap()
        .success());
    let status = strace.wait_exit(START).expect("the traced daemon did not exit");
    assert!(status.success(), "{status}: {}", strace.log());
    Trace::parse(&std::fs::read_to_string(&trace_file).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_system_call_socket_family_and_write_is_inside_the_unit() {
    if !require("strace", "strace") || !require("systemd-analyze", "systemd") {
        return;
    }
    let text = unit();
    let allowed = allowed_syscalls(&values(&text, "SystemCallFilter"));
    let families: BTreeSet<String> = values(&text, "RestrictAddressFamilies").into_iter().collect();
    let world = World::new("strace");
    let mut trace = traced(&world, Shape::Unit).await;
    let quic = traced(&world, Shape::Quic).await;
    trace.syscalls.extend(quic.syscalls);
    trace.families.extend(quic.families);
    trace.written.extend(quic.written);
    assert!(
        trace.syscalls.contains("bpf") && trace.syscalls.contains("setresuid"),
        "{trace:?}"
    );
    let outside: Vec<&String> = trace.syscalls.difference(&allowed).collect();
    assert!(
        outside.is_empty(),
        "system calls outside SystemCallFilter=: {outside:?}"
    );
    let outside: Vec<&String> = trace.families.difference(&families).collect();
    assert!(
        outside.is_empty(),
        "socket families outside RestrictAddressFamilies=: {outside:?}"
    );
    // ProtectSystem=strict and ProtectKernelTunables=: only the pin folder and the
    // unit's RuntimeDirectory= (the control socket) are written (no sysctl, nothing
    // under /etc, /var or /usr).
    let mut writable = vec![world.pins.dir.to_str().unwrap().to_owned()];
    writable.extend(
        values(&unit(), "RuntimeDirectory")
            .iter()
            .map(|d| format!("/run/{d}")),
    );
    let outside: Vec<&String> = trace
        .written
        .iter()
        .filter(|p| !writable.iter().any(|w| p.starts_with(w.as_str())))
        .collect();
    assert!(outside.is_empty(), "written outside {writable:?}: {outside:?}");
    eprintln!(
        "traced: {} system calls, families {:?}, {} paths written",
        trace.syscalls.len(),
        trace.families,
        trace.written.len()
    );
}

/// Notifications as the test's socket received them.
#[derive(Default)]
struct Heard {
    /// Each datagram, and whether the daemon's port accepted a connection when it came.
    messages: Vec<(String, bool)>,
}

/// A datagram socket standing in for systemd's, read by a thread until dropped.
struct Manager {
    heard: Arc<Mutex<Heard>>,
    port: Arc<AtomicU16>,
    stop: Arc<AtomicBool>,
}

impl Manager {
    fn listen(socket: UnixDatagram) -> Self {
        let heard = Arc::new(Mutex::new(Heard::default()));
        let port = Arc::new(AtomicU16::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (h, p, s) = (heard.clone(), port.clone(), stop.clone());
        socket.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 4096];
            while !s.load(Ordering::Relaxed) {
                let Ok(n) = socket.recv(&mut buf) else { continue };
                let text = String::from_utf8_lossy(&buf[..n]).into_owned();
                let accepting = text.contains("READY=1") && {
                    let addr = SocketAddr::from(([127, 0, 0, 1], p.load(Ordering::Relaxed)));
                    TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_ok()
                };
                h.lock().unwrap().messages.push((text, accepting));
            }
        });
        Self { heard, port, stop }
    }

    fn messages(&self) -> Vec<(String, bool)> {
        self.heard.lock().unwrap().messages.clone()
    }

    /// Index of the first datagram with `line` as one of its lines.
    fn position(&self, line: &str) -> Option<usize> {
        self.messages()
            .iter()
            .position(|(m, _)| m.lines().any(|l| l == line))
    }

    fn count(&self, line: &str) -> usize {
        self.messages()
            .iter()
            .filter(|(m, _)| m.lines().any(|l| l == line))
            .count()
    }

    fn wait_for(&self, line: &str, within: Duration) -> usize {
        let mut at = None;
        eventually(within, || {
            at = self.position(line);
            at.is_some()
        });
        at.unwrap_or_else(|| panic!("no {line:?} within {within:?}; heard {:?}", self.messages()))
    }
}

impl Drop for Manager {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// `webship serve` of a one-site config with `vars` in its environment, started on a
/// free port (told to `manager` before the daemon starts).
fn start_notifying(env: &Env, manager: &Manager, vars: &[(&str, String)]) -> (Process, u16) {
    let dir = env.dir.path();
    let config = env.config("[limits]\nshutdown_grace_secs = 5\n");
    start_on_free_port(Some("listening on"), START, |port| {
        manager.port.store(port, Ordering::Relaxed);
        let path = dir.join("notify.toml");
        std::fs::write(&path, config.replace("{port}", &port.to_string()))?;
        let mut command = Command::new(binary());
        command
            .args(["serve", "--config", path.to_str().unwrap()])
            .current_dir(dir)
            .env("WEBSHIP_LOG", "info,webship=debug")
            .env_remove("WATCHDOG_PID")
            .envs(vars.iter().map(|(k, v)| (k, v)));
        Process::spawn(
            "webship",
            &mut command,
            Logs::one(dir.join(format!("notify-{port}.log"))),
        )
    })
    .unwrap_or_else(|e| panic!("{e:#}"))
}

#[test]
fn notify_says_ready_once_serving_pings_the_watchdog_and_says_stopping() {
    let env = Env::new();
    let path = env.dir.path().join("notify.sock");
    let manager = Manager::listen(UnixDatagram::bind(&path).unwrap());
    let vars = [
        ("NOTIFY_SOCKET", path.to_str().unwrap().to_owned()),
        ("WATCHDOG_USEC", "200000".to_owned()),
    ];
    let (mut daemon, port) = start_notifying(&env, &manager, &vars);
    let ready = manager.wait_for("READY=1", START);
    assert!(
        manager.messages()[ready].1,
        "READY=1 came before the port accepted"
    );
    let status = format!("STATUS=serving 1 site on 127.0.0.1:{port}; 0 connections open");
    let shown = manager.position(&status);
    assert!(
        shown.is_some_and(|s| s < ready),
        "{status:?} before READY=1: {:?}",
        manager.messages()
    );
    // 200 ms watchdog: a ping every 100 ms.
    assert!(
        eventually(Duration::from_secs(10), || manager.count("WATCHDOG=1") >= 5),
        "watchdog pings: {:?}\n{}",
        manager.messages(),
        daemon.log()
    );
    assert!(
        daemon.log().contains("systemd watchdog: pinging every_ms=100"),
        "{}",
        daemon.log()
    );

    // Five status ticks later no connection is open, and the status says so: it
    // once counted the permit the accept loop holds while it waits for the next
    // connection, so it said 1 from the first tick on, and the drain's 0 below
    // (a connection SIGTERM left in the backlog) made the wait for 1 flaky.
    let last_status = || {
        manager
            .messages()
            .into_iter()
            .rev()
            .find_map(|(m, _)| m.starts_with("STATUS=").then_some(m))
    };
    // (The manager's own check of the port at READY=1 is a connection for a moment.)
    assert!(
        eventually(Duration::from_secs(10), || last_status().as_ref()
            == Some(&status)),
        "{:?}",
        manager.messages()
    );

    // An open connection shows in the status, and the drain waits for it.
    let held = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let one = format!("STATUS=serving 1 site on 127.0.0.1:{port}; 1 connections open");
    assert!(
        eventually(Duration::from_secs(10), || last_status().as_ref() == Some(&one)),
        "{:?}",
        manager.messages()
    );
    daemon.terminate().unwrap();
    let stopping = manager.wait_for("STOPPING=1", Duration::from_secs(10));
    assert!(
        eventually(Duration::from_secs(10), || manager
            .position("STATUS=draining 1 connections")
            .is_some()),
        "{:?}\n{}",
        manager.messages(),
        daemon.log()
    );
    drop(held);
    let exit = daemon.wait_exit(START).expect("did not exit");
    assert!(exit.success(), "{exit}: {}", daemon.log());
    assert!(ready < stopping);
    assert_eq!(manager.count("READY=1"), 1, "{:?}", manager.messages());
}

#[test]
fn notify_reaches_an_abstract_socket_and_the_watchdog_is_only_for_its_process() {
    use std::os::linux::net::SocketAddrExt;
    let env = Env::new();
    let name = format!("webship-e2e-notify-{}", std::process::id());
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let manager = Manager::listen(UnixDatagram::bind_addr(&addr).unwrap());
    // WATCHDOG_PID names another process (pid 1): this one must not ping.
    let vars = [
        ("NOTIFY_SOCKET", format!("@{name}")),
        ("WATCHDOG_USEC", "200000".to_owned()),
        ("WATCHDOG_PID", "1".to_owned()),
    ];
    let (mut daemon, _port) = start_notifying(&env, &manager, &vars);
    let ready = manager.wait_for("READY=1", START);
    assert!(
        manager.messages()[ready].1,
        "READY=1 came before the port accepted"
    );
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(manager.count("WATCHDOG=1"), 0, "{:?}", manager.messages());
    daemon.terminate().unwrap();
    manager.wait_for("STOPPING=1", Duration::from_secs(10));
    assert!(
        daemon.wait_exit(START).is_some_and(|s| s.success()),
        "{}",
        daemon.log()
    );
}

/// Starts `webship serve ARGS` on a one-site config with `vars`, its standard error
/// in `log` (created first, so its identity can be given to the daemon).
fn start_logging(env: &Env, args: &[&str], vars: &[(&str, String)], log: &Path) -> (Process, u16) {
    let dir = env.dir.path();
    let config = env.config("[limits]\nshutdown_grace_secs = 2\n");
    start_on_free_port(Some("listening on"), START, |port| {
        let path = dir.join("logs.toml");
        std::fs::write(&path, config.replace("{port}", &port.to_string()))?;
        let mut command = Command::new(binary());
        command
            .args(["serve", "--config", path.to_str().unwrap()])
            .args(args)
            .current_dir(dir)
            .env("WEBSHIP_LOG", "info,webship=debug")
            .env_remove("JOURNAL_STREAM")
            .env_remove("WEBSHIP_LOG_FORMAT")
            .envs(vars.iter().map(|(k, v)| (k, v)));
        let logs = Logs {
            stdout: dir.join("stdout.log"),
            stderr: log.to_owned(),
        };
        Process::spawn("webship", &mut command, logs)
    })
    .unwrap_or_else(|e| panic!("{e:#}"))
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(2) == Some("0"))
    })
}

/// Serves one request and stops: the log then has start-up, request, drain and
/// shutdown lines.
async fn one_request_then_stop(env: &Env, mut daemon: Process, port: u16) -> String {
    env.write("a.txt", b"a");
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let got = fetch(
        Proto::H1,
        addr,
        HOST,
        env.client(b"http/1.1"),
        "GET",
        "/a.txt",
        &[],
    )
    .await;
    assert_eq!(got.status, 200);
    daemon.terminate().unwrap();
    assert!(
        daemon.wait_exit(START).is_some_and(|s| s.success()),
        "{}",
        daemon.log()
    );
    daemon.log()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_are_one_object_per_line() {
    for (how, args, vars) in [
        ("--log-format json", vec!["--log-format", "json"], vec![]),
        (
            "WEBSHIP_LOG_FORMAT=json",
            vec![],
            vec![("WEBSHIP_LOG_FORMAT", "json".to_owned())],
        ),
    ] {
        let env = Env::new();
        let log = env.dir.path().join("json.log");
        let (daemon, port) = start_logging(&env, &args, &vars, &log);
        let text = one_request_then_stop(&env, daemon, port).await;
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{how}: not JSON ({e}): {l}")))
            .collect();
        for line in &lines {
            assert!(
                ["ERROR", "WARN", "INFO", "DEBUG", "TRACE"].contains(&line["level"].as_str().unwrap_or("")),
                "{line}"
            );
            assert!(line["message"].as_str().is_some_and(|m| !m.is_empty()), "{line}");
            assert!(
                line["target"].as_str().is_some_and(|t| t.starts_with("webship")),
                "{line}"
            );
            assert!(
                line["timestamp"].as_str().is_some_and(|t| t.ends_with('Z')),
                "{line}"
            );
            assert!(line["fields"].is_object(), "{line}");
        }
        let find = |fragment: &str| {
            lines
                .iter()
                .find(|l| l["message"].as_str().is_some_and(|m| m.contains(fragment)))
                .unwrap_or_else(|| panic!("{how}: no {fragment:?} in:\n{text}"))
        };
        assert_eq!(find("listening on")["level"], "INFO");
        let drain = find("shutting down: draining connections");
        assert_eq!(drain["fields"]["grace_secs"], 2, "{drain}");
        assert!(drain["fields"]["open"].is_u64(), "{drain}");
        if is_root() {
            // Running as root without `user` is worth a warning.
            assert_eq!(find("running as root")["level"], "WARN");
        }
    }
    // A failed command's last words are JSON too.
    let dir = tempfile::tempdir().unwrap();
    let out = webship(
        &["--log-format", "json", "check", "--config", "/nonexistent.toml"],
        dir.path(),
    );
    let text = String::from_utf8_lossy(&out.stderr);
    let line: serde_json::Value = serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("{e}: {text}"));
    assert_eq!(line["level"], "ERROR", "{line}");
    assert!(
        line["message"].as_str().unwrap().contains("/nonexistent.toml"),
        "{line}"
    );
    // A bad format is refused, naming the variable.
    let out = Command::new(binary())
        .args(["check", "--config", "/nonexistent.toml"])
        .env("WEBSHIP_LOG_FORMAT", "xml")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(
        text.contains("WEBSHIP_LOG_FORMAT") && text.contains("`xml`"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn journal_lines_carry_their_priority_and_no_timestamp() {
    let env = Env::new();
    let log = env.dir.path().join("journal.log");
    std::fs::write(&log, "").unwrap();
    let meta = std::fs::metadata(&log).unwrap();
    let stream = format!("{}:{}", meta.dev(), meta.ino());
    let (daemon, port) = start_logging(&env, &[], &[("JOURNAL_STREAM", stream.clone())], &log);
    let text = one_request_then_stop(&env, daemon, port).await;
    for line in text.lines() {
        let (priority, rest) = line
            .strip_prefix('<')
            .and_then(|l| l.split_once('>'))
            .unwrap_or_else(|| panic!("no <N> prefix: {line:?}"));
        let level = rest.split_whitespace().next().unwrap_or("");
        let expected = match level {
            "ERROR" => "3",
            "WARN" => "4",
            "INFO" => "6",
            "DEBUG" | "TRACE" => "7",
            _ => panic!("no level after the prefix (a timestamp?): {line:?}"),
        };
        assert_eq!(priority, expected, "{line:?}");
    }
    assert!(text.contains("<6>INFO webship::server: webship "), "{text}");
    if is_root() {
        // "running as root for the whole life of the process"
        assert!(text.contains("<4>WARN "), "{text}");
    }

    // A stream that is not stderr's (inherited by a child that redirected it) is
    // ignored: ordinary text lines with timestamps.
    let env = Env::new();
    let log = env.dir.path().join("text.log");
    let (daemon, port) = start_logging(&env, &[], &[("JOURNAL_STREAM", stream)], &log);
    let text = one_request_then_stop(&env, daemon, port).await;
    assert!(
        text.lines().all(|l| !l.starts_with('<') && l.starts_with("20")),
        "{text}"
    );
    assert!(!text.contains('\u{1b}'), "colours in a file: {text}");

    // A failed command's last words, at error priority.
    let dir = tempfile::tempdir().unwrap();
    let err = dir.path().join("err.log");
    let file = std::fs::File::create(&err).unwrap();
    let meta = file.metadata().unwrap();
    let status = Command::new(binary())
        .args(["check", "--config", "/nonexistent.toml"])
        .env("JOURNAL_STREAM", format!("{}:{}", meta.dev(), meta.ino()))
        .stderr(file)
        .status()
        .unwrap();
    assert!(!status.success());
    let text = std::fs::read_to_string(&err).unwrap();
    assert!(text.starts_with("<3>webship: /nonexistent.toml"), "{text}");
}

/// A reload is bracketed by `RELOADING=1` (with the monotonic time systemd's
/// notify-reload protocol wants) and `READY=1`; a binary upgrade hands the service to
/// the new process: the old one names it with `MAINPID=` once it serves and never
/// says `STOPPING=1` (systemd would stop the service the new process carries), and
/// the new one says `READY=1` itself.
#[test]
fn reload_and_takeover_speak_to_the_service_manager() {
    let env = Env::new();
    let path = env.dir.path().join("notify.sock");
    let manager = Manager::listen(UnixDatagram::bind(&path).unwrap());
    let control = env.dir.path().join("control.sock");
    let extra = format!(
        "control_socket = \"{}\"\n\n[limits]\nshutdown_grace_secs = 5\n",
        control.display()
    );
    let config = env.config(&extra);
    let dir = env.dir.path();
    let file = dir.join("notify.toml");
    let vars = [("NOTIFY_SOCKET", path.to_str().unwrap().to_owned())];
    let spawn = |args: &[&str], log: &str| {
        let mut command = Command::new(binary());
        command
            .args(args)
            .current_dir(dir)
            .env("WEBSHIP_LOG", "info,webship=debug")
            .env_remove("WATCHDOG_PID")
            .env_remove("WATCHDOG_USEC")
            .envs(vars.iter().map(|(k, v)| (k, v)));
        Process::spawn("webship", &mut command, Logs::one(dir.join(log)))
    };
    let (mut old, port) = start_on_free_port(Some("listening on"), START, |port| {
        manager.port.store(port, Ordering::Relaxed);
        std::fs::write(&file, config.replace("{port}", &port.to_string()))?;
        spawn(&["serve", "--config", file.to_str().unwrap()], "old.log")
    })
    .unwrap_or_else(|e| panic!("{e:#}"));
    let first_ready = manager.wait_for("READY=1", START);

    // Reload: RELOADING=1 with MONOTONIC_USEC, then READY=1 again.
    let reload = Command::new(binary())
        .args(["reload", "--config", file.to_str().unwrap()])
        .env_remove("NOTIFY_SOCKET")
        .output()
        .unwrap();
    assert!(
        reload.status.success(),
        "{}",
        String::from_utf8_lossy(&reload.stderr)
    );
    let reloading = manager.wait_for("RELOADING=1", Duration::from_secs(10));
    let (message, _) = &manager.messages()[reloading];
    assert!(
        message.lines().any(|l| l.starts_with("MONOTONIC_USEC=")),
        "{message:?}"
    );
    assert!(
        eventually(Duration::from_secs(10), || manager.count("READY=1") == 2),
        "{:?}",
        manager.messages()
    );
    assert!(first_ready < reloading);

    // Takeover: the new process gets the same notify socket, as the operator's
    // procedure gives it (docs/operations.md).
    let mut new = spawn(
        &["serve", "--config", file.to_str().unwrap(), "--takeover"],
        "new.log",
    )
    .unwrap();
    let mainpid = format!("MAINPID={}", new.pid());
    manager.wait_for(&mainpid, START);
    let exit = old.wait_exit(START).expect("the old process drains and exits");
    assert!(exit.success(), "{exit}: {}", old.log());
    assert!(
        eventually(Duration::from_secs(10), || manager.count("READY=1") == 3),
        "the new process's READY=1: {:?}\n{}",
        manager.messages(),
        new.log()
    );
    assert_eq!(
        manager.count("STOPPING=1"),
        0,
        "the old process stopped the service: {:?}",
        manager.messages()
    );
    // The new process serves on the port, and is the one that stops the service.
    assert!(TcpStream::connect(("127.0.0.1", port)).is_ok());
    new.terminate().unwrap();
    manager.wait_for("STOPPING=1", Duration::from_secs(10));
    assert!(new.wait_exit(START).is_some_and(|s| s.success()), "{}", new.log());
}

/// The unified cgroup hierarchy's mount point, if there is one.
fn cgroup2_root() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    mounts.lines().find_map(|l| {
        let fields: Vec<&str> = l.split(' ').collect();
        (fields.get(2) == Some(&"cgroup2")).then(|| PathBuf::from(fields[1]))
    })
}

/// Under a service manager, a new process outside the daemon's control group is
/// refused the sockets: systemd would not follow it (`MAINPID=` names only the
/// service's own processes when an unprivileged process sends it) and would stop
/// the service when the old process exits. The old one keeps serving and says why.
#[test]
fn a_takeover_from_outside_the_service_control_group_is_refused() {
    let Some(cgroups) = cgroup2_root() else {
        eprintln!("skipped: no cgroup2 hierarchy mounted (systemd needs one)");
        return;
    };
    let env = Env::new();
    let path = env.dir.path().join("notify.sock");
    let manager = Manager::listen(UnixDatagram::bind(&path).unwrap());
    let control = env.dir.path().join("control.sock");
    let extra = format!(
        "control_socket = \"{}\"\n\n[limits]\nshutdown_grace_secs = 5\n",
        control.display()
    );
    let config = env.config(&extra);
    let dir = env.dir.path();
    let file = dir.join("outside.toml");
    let (mut old, port) = start_on_free_port(Some("listening on"), START, |port| {
        manager.port.store(port, Ordering::Relaxed);
        std::fs::write(&file, config.replace("{port}", &port.to_string()))?;
        let mut command = Command::new(binary());
        command
            .args(["serve", "--config", file.to_str().unwrap()])
            .current_dir(dir)
            .env("WEBSHIP_LOG", "info,webship=debug")
            .env("NOTIFY_SOCKET", &path)
            .env_remove("WATCHDOG_USEC");
        Process::spawn("webship", &mut command, Logs::one(dir.join("old.log")))
    })
    .unwrap_or_else(|e| panic!("{e:#}"));
    manager.wait_for("READY=1", START);

    // The new process moves itself into a group of its own, then asks.
    let group = cgroups.join(format!("webship-e2e-outside-{}", std::process::id()));
    std::fs::create_dir(&group).unwrap_or_else(|e| panic!("{}: {e}", group.display()));
    let script = format!(
        "echo $$ > {}/cgroup.procs && exec {} serve --config {} --takeover",
        group.display(),
        binary().display(),
        file.display()
    );
    let mut command = Command::new("sh");
    command
        .args(["-c", &script])
        .current_dir(dir)
        .env("WEBSHIP_LOG", "info,webship=debug");
    let mut new = Process::spawn("webship", &mut command, Logs::one(dir.join("new.log"))).unwrap();
    let status = new.wait_exit(START).expect("the new process ends");
    let _ = std::fs::remove_dir(&group);
    assert!(!status.success(), "{}", new.log());
    assert!(new.log().contains("outside it"), "{}", new.log());
    assert!(
        old.log().contains("takeover failed; this process keeps serving"),
        "{}",
        old.log()
    );
    assert!(
        !manager.messages().iter().any(|(m, _)| m.contains("MAINPID=")),
        "{:?}",
        manager.messages()
    );
    assert!(TcpStream::connect(("127.0.0.1", port)).is_ok());
    assert!(
        old.wait_exit(Duration::from_millis(100)).is_none(),
        "{}",
        old.log()
    );
    old.terminate().unwrap();
    assert!(old.wait_exit(START).is_some_and(|s| s.success()), "{}", old.log());
}
