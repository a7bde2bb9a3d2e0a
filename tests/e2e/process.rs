//! What the daemon asks of the host: enough open files for `max_connections` (or a
//! refusal that names the numbers), a heap that keeps the memory it reuses, and
//! giving up root after binding: every thread runs as the service account with
//! exactly the capabilities it still needs, and still serves h1, h2, h3 and
//! passthrough.

use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use webship_testkit::proc::read_stat;
use webship_testkit::process::{Logs, Process, Ready};
use webship_tests::client::{fetch, fetch_h3, Proto};
use webship_tests::server::binary;
use webship_tests::server::free_port;
use webship_tests::{webship, Server};

use crate::support::{origin_server, passthrough_config, pattern, Env, HOST, MIB};

/// nobody:nogroup, present on Debian-like systems (and here).
const NOBODY: u32 = 65534;

/// The fields of `/proc/PID/task/TID/status` for every thread of `pid`.
fn thread_statuses(pid: u32) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
        let status = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
        out.push((task.file_name().to_string_lossy().into_owned(), status));
    }
    assert!(!out.is_empty(), "no threads under /proc/{pid}/task");
    out
}

fn field<'a>(status: &'a str, name: &str) -> &'a str {
    status
        .lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(':')))
        .map(str::trim)
        .unwrap_or_else(|| panic!("no {name} in {status}"))
}

/// Every thread: uid and gid `NOBODY` (real, effective, saved, fs), only nogroup,
/// the capability sets exactly `caps` (hex, as the kernel prints them), nothing
/// inheritable or ambient, and no new privileges.
fn assert_switched(pid: u32, caps: &str) {
    let ids = format!("{NOBODY}\t{NOBODY}\t{NOBODY}\t{NOBODY}");
    for (tid, status) in thread_statuses(pid) {
        let name = field(&status, "Name");
        assert_eq!(field(&status, "Uid"), ids, "thread {tid} ({name}) uid");
        assert_eq!(field(&status, "Gid"), ids, "thread {tid} ({name}) gid");
        assert_eq!(
            field(&status, "Groups"),
            NOBODY.to_string(),
            "thread {tid} ({name})"
        );
        for set in ["CapEff", "CapPrm", "CapBnd"] {
            assert_eq!(field(&status, set), caps, "thread {tid} ({name}) {set}");
        }
        for set in ["CapInh", "CapAmb"] {
            assert_eq!(
                field(&status, set),
                "0000000000000000",
                "thread {tid} ({name}) {set}"
            );
        }
        assert_eq!(field(&status, "NoNewPrivs"), "1", "thread {tid} ({name})");
    }
}

/// The temp dirs are 0700: the service account must be able to reach the root.
fn open_up(env: &Env) {
    for dir in [env.dir.path(), env.root.as_path()] {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
}

#[tokio::test]
async fn files_are_served_as_the_service_account_with_no_capabilities() {
    let env = Env::new();
    open_up(&env);
    env.write("public.txt", b"for everyone");
    let secret = env.write("secret.txt", b"root only");
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    // BBR off: where bbr is not in tcp_allowed_congestion_control the daemon keeps
    // CAP_NET_ADMIN to set it on accepted sockets; here nothing should stay.
    let server = env.start("user = \"nobody\"\ngroup = \"nogroup\"\n[kernel]\nbbr = \"off\"\n");
    assert_switched(server.pid(), "0000000000000000");
    assert!(
        server.log().contains("switched to the service account"),
        "{}",
        server.log()
    );
    for proto in [Proto::H1, Proto::H2] {
        let got = env.get(proto, &server, "/public.txt", &[]).await;
        assert_eq!(got.status, 200, "{proto:?}");
        assert_eq!(got.body, b"for everyone");
        let got = env.get(proto, &server, "/secret.txt", &[]).await;
        assert_eq!(got.status, 403, "{proto:?}: a file only root may read");
        assert!(!got.body.starts_with(b"root only"));
    }
    let got = fetch_h3(server.addr(), HOST, env.client(b"h3"), "GET", "/public.txt", &[]).await;
    assert_eq!(got.status, 200, "h3");
    assert_eq!(got.body, b"for everyone");
    let got = fetch_h3(server.addr(), HOST, env.client(b"h3"), "GET", "/secret.txt", &[]).await;
    assert_eq!(got.status, 403, "h3");
    // The blocking pool's threads (started after the switch) are the account's too.
    assert_switched(server.pid(), "0000000000000000");
}

#[tokio::test]
async fn passthrough_runs_as_the_service_account_keeping_only_what_ebpf_needs() {
    let env = Env::new();
    open_up(&env);
    let origin_root = env.dir.path().join("origin");
    std::fs::create_dir(&origin_root).unwrap();
    std::fs::write(origin_root.join("who.txt"), "the origin").unwrap();
    let origin = origin_server(&env, "a", "a.pass", &origin_root, "", "");
    for engine in ["sockmap", "splice"] {
        // splice also carries HTTP/3 passthrough through the userspace relay, whose
        // per-flow sockets are made after the switch.
        let h3 = engine != "sockmap";
        let settings = if h3 {
            format!(
                "passthrough_engine = \"{engine}\"\nudp_upstream = \"{}\"\nudp_engine = \"userspace\"\n",
                origin.addr()
            )
        } else {
            format!("passthrough_engine = \"{engine}\"\n")
        };
        // splice without eBPF: nothing loaded, so nothing is kept.
        let kernel = if engine == "sockmap" {
            "[kernel]\nbbr = \"off\"\n"
        } else {
            "[kernel]\nbbr = \"off\"\nebpf = \"off\"\n"
        };
        let config = passthrough_config(&settings, h3, &[("a.pass", origin.addr())])
            .replacen("[kernel]\n", kernel, 1)
            .replacen(
                "workers = 2\n",
                // Short grace: a passthrough connection the origin keeps open would
                // otherwise hold the shutdown for 30 s (not what this test is about).
                "workers = 2\nuser = \"nobody\"\n[limits]\nshutdown_grace_secs = 2\n",
                1,
            );
        let mut front = Server::start(env.dir.path(), &config);
        let log = front.log();
        assert!(log.contains(&format!("engine={engine}")), "{log}");
        // sockmap: eBPF loaded, so CAP_NET_ADMIN (12) and CAP_BPF (39) stay; splice
        // without eBPF (and BBR off) needs none.
        let caps = if engine == "sockmap" {
            "0000008000001000"
        } else {
            "0000000000000000"
        };
        assert_switched(front.pid(), caps);
        for proto in [Proto::H1, Proto::H2] {
            let got = fetch(
                proto,
                front.addr(),
                "a.pass",
                env.client(proto.alpn()),
                "GET",
                "/who.txt",
                &[],
            )
            .await;
            assert_eq!(got.status, 200, "{engine} {proto:?}");
            assert_eq!(got.body, b"the origin", "{engine} {proto:?}");
        }
        if h3 {
            let got = fetch_h3(front.addr(), "a.pass", env.client(b"h3"), "GET", "/who.txt", &[]).await;
            assert_eq!(got.status, 200, "{engine}: h3 passthrough");
            assert_eq!(got.body, b"the origin", "{engine}: h3 passthrough");
        }
        front.terminate();
        assert!(
            front.wait_exit(Duration::from_secs(20)).is_some(),
            "{engine}: did not exit; log:\n{}",
            front.log()
        );
        // The account could remove its pins, not the folder in root's /sys/fs/bpf.
        let pins = format!("/sys/fs/bpf/webship-e2e-{}", front.port);
        if let Ok(left) = std::fs::read_dir(&pins) {
            assert_eq!(left.count(), 0, "{engine}: pinned maps left in {pins}");
            let _ = std::fs::remove_dir(&pins);
        }
    }
}

/// Handing the pin folder to the service account must not follow a link planted
/// in it (the account owned the folder on an earlier run): root would otherwise
/// chown whatever the link names.
#[test]
fn handing_the_pins_over_follows_no_planted_link() {
    use std::os::unix::fs::MetadataExt;
    let env = Env::new();
    open_up(&env);
    let victim = env.dir.path().join("victim");
    std::fs::write(&victim, "root's").unwrap();
    let pins = format!("/sys/fs/bpf/webship-e2e-chown-{}", std::process::id());
    let _ = std::fs::remove_dir_all(&pins);
    std::fs::create_dir(&pins).unwrap();
    std::os::unix::fs::symlink(&victim, format!("{pins}/planted")).unwrap();
    let config = passthrough_config(
        "passthrough_engine = \"sockmap\"\n",
        false,
        &[("a.pass", "127.0.0.1:9".parse().unwrap())],
    )
    .replace("/sys/fs/bpf/webship-e2e-{port}", &pins)
    .replacen("[kernel]\n", "[kernel]\nbbr = \"off\"\n", 1)
    .replacen(
        "workers = 2\n",
        "workers = 2\nuser = \"nobody\"\n[limits]\nshutdown_grace_secs = 2\n",
        1,
    );
    let mut front = Server::start(env.dir.path(), &config);
    assert_switched(front.pid(), "0000008000001000");
    let owner = std::fs::metadata(&victim).unwrap().uid();
    front.terminate();
    let _ = front.wait_exit(Duration::from_secs(20));
    let _ = std::fs::remove_dir_all(&pins);
    assert_eq!(
        owner, 0,
        "root chowned the target of a link planted in the pin folder"
    );
}

#[test]
fn check_names_an_unknown_user() {
    let env = Env::new();
    let path = env.dir.path().join("check.toml");
    let config = env.config("user = \"no-such-user-webship\"\n");
    std::fs::write(&path, config.replace("{port}", "8443")).unwrap();
    let out = webship(&["check", "--config", path.to_str().unwrap()], env.dir.path());
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "accepted an unknown user: {text}");
    assert!(
        text.contains("user `no-such-user-webship` does not exist") && text.contains("check.toml"),
        "{text}"
    );
    let config = env.config("user = \"nobody\"\ngroup = \"no-such-group-webship\"\n");
    std::fs::write(&path, config.replace("{port}", "8443")).unwrap();
    let out = webship(&["check", "--config", path.to_str().unwrap()], env.dir.path());
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "accepted an unknown group: {text}");
    assert!(
        text.contains("group `no-such-group-webship` does not exist"),
        "{text}"
    );
}

/// `webship serve` under `prlimit --nofile=SOFT:HARD`, with `max_connections`.
fn under_limit(env: &Env, nofile: &str, max_connections: Option<u32>, port: u16) -> Command {
    let path = env.dir.path().join(format!("limit-{port}.toml"));
    let limits = max_connections.map_or(String::new(), |n| format!("[limits]\nmax_connections = {n}\n"));
    let config = env.config(&limits).replace("{port}", &port.to_string());
    std::fs::write(&path, config).unwrap();
    let mut command = Command::new("prlimit");
    command
        .arg(format!("--nofile={nofile}"))
        .arg("--")
        .arg(binary())
        .args(["serve", "--config", path.to_str().unwrap()])
        .current_dir(env.dir.path())
        .env("WEBSHIP_LOG", "info");
    command
}

#[test]
fn too_few_open_files_for_max_connections_is_refused_with_the_numbers() {
    let env = Env::new();
    let port = free_port().unwrap();
    // 1000 connections × 2 + 256 = 2256 files; the hard limit is 1024.
    let mut child = under_limit(&env, "512:1024", Some(1000), port)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("webship still running under a hard limit that cannot fit max_connections");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(!status.success(), "{stderr}");
    for needle in [
        "max_connections = 1000",
        "2256",
        "1024",
        "LimitNOFILE=2256",
        "ulimit",
    ] {
        assert!(stderr.contains(needle), "expected {needle:?} in: {stderr}");
    }
}

/// Starts webship under `nofile`; its `Max open files` soft and hard, and its log.
fn open_file_limits(nofile: &str, max_connections: Option<u32>) -> (Vec<String>, String) {
    let env = Env::new();
    let port = free_port().unwrap();
    let mut command = under_limit(&env, nofile, max_connections, port);
    let logs = Logs::one(env.dir.path().join("limit.log"));
    let mut process = Process::spawn("webship", &mut command, logs).unwrap();
    let ready = Ready {
        port,
        line: Some("listening on"),
        within: Duration::from_secs(20),
    };
    if let Err(e) = process.wait_ready(&ready) {
        panic!("webship {e}: {}", process.log());
    }
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", process.pid())).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap_or_else(|| panic!("{limits}"));
    let numbers = line
        .split_whitespace()
        .skip(3)
        .take(2)
        .map(str::to_owned)
        .collect();
    (numbers, process.log())
}

#[test]
fn the_soft_open_file_limit_is_raised_to_fit_max_connections() {
    // 1000 connections × 2 + 256.
    let (limits, log) = open_file_limits("256:8192", Some(1000));
    assert_eq!(limits, ["2256", "8192"], "{log}");
}

#[test]
fn a_default_max_connections_is_lowered_to_fit_the_hard_limit() {
    // The default 10000 cannot fit 1024 files: (1024 - 256) / 2 = 384 connections.
    let (limits, log) = open_file_limits("256:1024", None);
    assert_eq!(limits, ["1024", "1024"], "{log}");
    assert!(
        log.contains("lowered the default limits.max_connections") && log.contains("to=384"),
        "{log}"
    );
}

/// A daemon that was killed removed nothing itself: the harness removes its pin
/// folder, pins and all, once the daemon is gone and no process holds the folder
/// (`webship_testkit::pins::remove_own`, run when the `Server` is dropped).
#[test]
fn the_harness_removes_a_killed_daemons_pin_folder() {
    let env = Env::new();
    let server = env.start(
        "[kernel]\nebpf = \"required\"\nbpf_pin_dir = \"/sys/fs/bpf/webship-e2e-{port}\"\n\
         [runtime.settings]\nh3_sockets = \"2\"\n",
    );
    let pins = std::path::PathBuf::from(format!("/sys/fs/bpf/webship-e2e-{}", server.port));
    assert!(
        pins.join("kernel_counters").exists(),
        "no pins:\n{}",
        server.log()
    );
    let killed = Command::new("kill")
        .args(["-KILL", &server.pid().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let mut server = server;
    assert!(
        server.wait_exit(Duration::from_secs(10)).is_some(),
        "SIGKILL did not end the daemon"
    );
    assert!(
        pins.join("kernel_counters").exists(),
        "the killed daemon's pins are gone already: nothing left to check"
    );
    drop(server);
    assert!(!pins.exists(), "the harness left {}", pins.display());
}

/// A file response's chunks reuse the heap memory the previous response freed: 1 MiB
/// over HTTP/3 and HTTP/2 takes (almost) no page faults once the server is warm.
/// With glibc's moving thresholds, each HTTP/3 download of it faulted 96–224 pages
/// back in (the chunks landed in memory just returned to the kernel); HTTP/2's
/// allocations did not churn, and its half guards against that changing.
#[tokio::test]
async fn a_file_response_reuses_freed_heap_memory() {
    let env = Env::new();
    let len = MIB as usize;
    env.write("one.bin", &pattern(len));
    let server = env.start("");
    let faults = || read_stat(server.pid()).expect("the server's /proc stat").minflt;
    for h3 in [true, false] {
        let download = || async {
            let got = match h3 {
                true => fetch_h3(server.addr(), HOST, env.client(b"h3"), "GET", "/one.bin", &[]).await,
                false => env.get(Proto::H2, &server, "/one.bin", &[]).await,
            };
            assert_eq!((got.status.as_u16(), got.len), (200, len as u64), "h3 {h3}");
        };
        for _ in 0..10 {
            download().await;
        }
        let mut each = Vec::new();
        for _ in 0..20 {
            let before = faults();
            download().await;
            each.push(faults() - before);
        }
        // A download that holds more unacknowledged chunks than any before it (on a
        // loaded host, or on the other worker's heap) grows a heap once, by up to 256
        // pages; that memory is then kept. Before, every download faulted.
        let many = each.iter().filter(|&&n| n >= 16).count();
        assert!(
            many <= 5,
            "h3 {h3}: page faults per 1 MiB download (a 1 MiB body is 256 pages): {each:?}"
        );
    }
}
