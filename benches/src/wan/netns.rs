//! Two network namespaces, server side and client side, each with one TUN
//! device whose other end is this process: the only path between them is the
//! relay ([`super::link`]). Their addresses (10.77.0.0/24) exist only inside
//! them, so nothing on the host's own network changes.
//!
//! Names carry this process's id (`wsw<pid>s`, `wsw<pid>c`), so runs never
//! collide. They are removed, with any process still inside, when [`Wan`] is
//! dropped, on SIGINT/SIGTERM ([`remove_on_signal`]), and — for a run that was
//! killed outright — by the next run, which removes every `wsw<pid>` namespace
//! whose process is gone. The one host setting touched, the list of congestion
//! controls a namespace may default to, is restored on the same paths.

use std::fs::File;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;

use anyhow::{bail, Context, Result};

use super::tun;

pub(crate) const SERVER_ADDR: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);
pub(crate) const CLIENT_ADDR: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 2);
const PREFIX: &str = "wsw";
/// Packets each TUN device queues towards the relay: far above what one
/// relay wake-up leaves behind, so the kernel never drops before the emulator.
const TXQUEUELEN: &str = "10000";

/// Namespaces this process created and has not removed yet (for the signal handler).
static LIVE: Mutex<Vec<String>> = Mutex::new(Vec::new());
/// The host's list of congestion controls a namespace may default to, as it was
/// before [`allow_default`] widened it (restored on drop and on signals).
static ALLOWED_BEFORE: Mutex<Option<String>> = Mutex::new(None);
const ALLOWED: &str = "/proc/sys/net/ipv4/tcp_allowed_congestion_control";

#[derive(Debug)]
pub(crate) struct Wan {
    pub server_ns: String,
    pub client_ns: String,
    /// The relay's ends: packets the server side sends, and where packets for it go.
    pub server_tun: File,
    pub client_tun: File,
}

impl Wan {
    /// Creates both namespaces and their devices of `mtu`, addressed and up.
    pub(crate) fn create(mtu: u32) -> Result<Self> {
        remove_stale();
        let pid = std::process::id();
        let (server_ns, client_ns) = (format!("{PREFIX}{pid}s"), format!("{PREFIX}{pid}c"));
        let mut tuns = Vec::with_capacity(2);
        for (ns, addr) in [(&server_ns, SERVER_ADDR), (&client_ns, CLIENT_ADDR)] {
            ip(&["netns", "add", ns])?;
            LIVE.lock().unwrap_or_else(|p| p.into_inner()).push(ns.clone());
            // Created here, then moved: the descriptor stays this process's.
            let tun = tun::open(ns)
                .with_context(|| format!("creating TUN device {ns} (needs root and /dev/net/tun)"))?;
            ip(&["link", "set", "dev", ns, "netns", ns])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
            ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", ns])?;
            ip(&[
                "-n",
                ns,
                "link",
                "set",
                "dev",
                ns,
                "mtu",
                &mtu.to_string(),
                "txqueuelen",
                TXQUEUELEN,
                "up",
            ])?;
            tuns.push(tun);
        }
        let client_tun = tuns.pop().context("client TUN")?;
        let server_tun = tuns.pop().context("server TUN")?;
        Ok(Self {
            server_ns,
            client_ns,
            server_tun,
            client_tun,
        })
    }

    pub(crate) fn server_path(&self) -> PathBuf {
        netns_path(&self.server_ns)
    }

    pub(crate) fn client_path(&self) -> PathBuf {
        netns_path(&self.client_ns)
    }

    /// `command` to run inside the server's namespace (network only: the mount
    /// namespace, and so /sys/fs/bpf, stay the host's, unlike `ip netns exec`).
    pub(crate) fn in_server(&self, command: &Command) -> Command {
        let mut nsenter = Command::new("nsenter");
        nsenter
            .arg(format!("--net={}", self.server_path().display()))
            .arg("--")
            .arg(command.get_program())
            .args(command.get_args());
        for (key, value) in command.get_envs() {
            match value {
                Some(value) => nsenter.env(key, value),
                None => nsenter.env_remove(key),
            };
        }
        nsenter
    }

    /// Makes `algorithm` the server namespace's default TCP congestion control.
    /// The kernel lets a namespace other than the host's default only to an
    /// algorithm in the host's allowed list, so `algorithm` is added to that list
    /// for as long as this [`Wan`] lives (the list is restored when it is dropped).
    pub(crate) fn server_congestion(&self, algorithm: &str) -> Result<()> {
        allow_default(algorithm)?;
        let path = self.server_path();
        run(Command::new("nsenter")
            .arg(format!("--net={}", path.display()))
            .args([
                "--",
                "sysctl",
                "-qw",
                &format!("net.ipv4.tcp_congestion_control={algorithm}"),
            ]))
    }
}

impl Drop for Wan {
    fn drop(&mut self) {
        for ns in [&self.server_ns, &self.client_ns] {
            remove(ns);
        }
        restore_allowed();
    }
}

/// Adds `algorithm` to the host's allowed congestion controls, remembering the list.
fn allow_default(algorithm: &str) -> Result<()> {
    let before = std::fs::read_to_string(ALLOWED).with_context(|| format!("reading {ALLOWED}"))?;
    let before = before.trim().to_owned();
    if before.split_whitespace().any(|a| a == algorithm) {
        return Ok(());
    }
    let mut saved = ALLOWED_BEFORE.lock().unwrap_or_else(|p| p.into_inner());
    // Kept on disk too, so the next run can restore it if this one is killed.
    let note = allowed_note(std::process::id());
    std::fs::write(&note, &before).with_context(|| format!("writing {}", note.display()))?;
    std::fs::write(ALLOWED, format!("{before} {algorithm}"))
        .with_context(|| format!("adding {algorithm} to {ALLOWED}"))?;
    saved.get_or_insert(before);
    Ok(())
}

/// Where run `pid` keeps the host's allowed list as it found it.
fn allowed_note(pid: u32) -> PathBuf {
    PathBuf::from(format!("/run/{PREFIX}{pid}-allowed-congestion"))
}

/// Puts the host's allowed congestion controls back as they were, if changed.
fn restore_allowed() {
    if let Some(before) = ALLOWED_BEFORE.lock().unwrap_or_else(|p| p.into_inner()).take() {
        if let Err(e) = std::fs::write(ALLOWED, &before) {
            eprintln!("wan: could not restore {ALLOWED} to {before:?}: {e}; write it back by hand");
        }
        let _ = std::fs::remove_file(allowed_note(std::process::id()));
    }
}

/// Whether `pid` still runs (a zombie does not).
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            stat.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().starts_with('Z'))
        })
        .is_some_and(|zombie| !zombie)
}

fn netns_path(name: &str) -> PathBuf {
    PathBuf::from("/run/netns").join(name)
}

/// Stops whatever still runs inside `ns` (only this bench's servers and clients
/// ever do) and deletes it.
fn remove(ns: &str) {
    if let Ok(out) = Command::new("ip").args(["netns", "pids", ns]).output() {
        for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            let _ = Command::new("kill").args(["-KILL", pid]).status();
        }
    }
    if let Err(e) = ip(&["netns", "del", ns]) {
        eprintln!("wan: could not remove network namespace {ns}: {e:#}; remove it with `ip netns del {ns}`");
    }
    LIVE.lock().unwrap_or_else(|p| p.into_inner()).retain(|n| n != ns);
}

/// Removes the namespaces of earlier runs that were killed before they could.
fn remove_stale() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some(name) = line.split_whitespace().next() else {
            continue;
        };
        let Some(pid) = name
            .strip_prefix(PREFIX)
            .and_then(|rest| rest.strip_suffix(['s', 'c']))
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !running(pid) {
            eprintln!("wan: removing {name}, left by a run that was killed");
            remove(name);
            let note = allowed_note(pid);
            if let Ok(before) = std::fs::read_to_string(&note) {
                eprintln!("wan: restoring {ALLOWED} to {before:?}, as that run found it");
                let _ = std::fs::write(ALLOWED, before.trim());
                let _ = std::fs::remove_file(&note);
            }
        }
    }
}

/// On SIGINT or SIGTERM: removes the live namespaces (stopping what runs in
/// them) and exits with 130, since the stack's guards will not run.
pub(crate) fn remove_on_signal() -> Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("building the signal runtime")?;
    std::thread::Builder::new()
        .name("wan signals".to_owned())
        .spawn(move || {
            runtime.block_on(async {
                use tokio::signal::unix::{signal, SignalKind};
                let (Ok(mut int), Ok(mut term)) =
                    (signal(SignalKind::interrupt()), signal(SignalKind::terminate()))
                else {
                    return;
                };
                tokio::select! {
                    _ = int.recv() => {}
                    _ = term.recv() => {}
                }
                let live = LIVE.lock().unwrap_or_else(|p| p.into_inner()).clone();
                for ns in live {
                    remove(&ns);
                }
                restore_allowed();
                eprintln!("wan: interrupted; network namespaces removed");
                std::process::exit(130);
            });
        })
        .context("starting the signal thread")?;
    Ok(())
}

fn ip(args: &[&str]) -> Result<()> {
    run(Command::new("ip").args(args))
}

fn run(command: &mut Command) -> Result<()> {
    let out = command
        .output()
        .with_context(|| format!("cannot start {command:?}"))?;
    if !out.status.success() {
        bail!(
            "{command:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}
