//! `cargo xtask`: the project's own commands.
//!
//! - `cargo xtask test`: install what the suite needs when missing (Debian packages:
//!   curl, nginx, nghttp2-client, ngtcp2-client, python3, prometheus, chromium + chromium-driver,
//!   and for the package test dpkg-dev, binutils, lintian, systemd; PyPI:
//!   aioquic; only what is absent), build, then run
//!   every test: formatting, clippy, unit tests, the end-to-end suite, the kTLS VM
//!   test and a smoke run of the benchmark harness.
//! - `cargo xtask vm-test [--release]`: the kTLS promotion path inside user-mode
//!   Linux, whose kernel has kTLS (this host's does not); part of `test`.
//! - `cargo xtask bench [ARGS]`: the benchmark runner in `benches/` (release build);
//!   `cargo xtask bench wan` is the emulated-WAN scenario (root: namespaces, TUN).
//! - `cargo xtask deb [--binary PATH] [--out DIR] [--lintian]`: the Debian package
//!   (`deb.rs`); the end-to-end test `package` builds it from the debug binary.
//! - `cargo xtask build-ebpf`: the eBPF programs, embedded by the next daemon build.
//! - `cargo xtask build-peers`: the benchmark peers that are not Debian packages
//!   (Pingora built from `benches/peers/pingora-proxy`, Bun from npm) under
//!   `target/peers/` (`peers.rs`); `bench` runs it when a download run selects them.
//! - `cargo xtask run [ARGS]`: builds everything (eBPF included) in release mode and
//!   starts the daemon with the privileges eBPF and port binding need.
//! - `cargo xtask fuzz [SECONDS]`: libFuzzer (cargo-fuzz, rustup's nightly) on the
//!   ClientHello parser, seeded with the hellos captured from curl and openssl, and
//!   on the WebTransport capsule reader; 60 seconds each by default. Not part of `test` (an ASan build of the daemon's
//!   dependencies takes minutes); the unit tests carry a bounded mutation fuzz.

use std::process::{Command, ExitCode};

use anyhow::{bail, Context};

mod deb;
mod ebpf;
mod peers;
mod vm;

/// Debian packages the tests or benchmarks drive: (command that proves it, package).
const APT: &[(&str, &str)] = &[
    ("curl", "curl"),
    ("nginx", "nginx-light"),
    ("h2load", "nghttp2-client"),
    ("gtlsclient", "ngtcp2-client"),
    ("openssl", "openssl"),
    ("python3", "python3"),
    ("pip3", "python3-pip"),
    // A real browser for WebTransport, driven over WebDriver.
    ("chromium", "chromium"),
    ("chromedriver", "chromium-driver"),
    // The systemd unit: `systemd-analyze verify` and its syscall groups, the
    // capability set under setpriv, the daemon's system calls under strace.
    ("systemd-analyze", "systemd"),
    ("setpriv", "util-linux"),
    ("strace", "strace"),
    // The metrics test: a real Prometheus scrapes the admin listener; promtool
    // lints the exposition.
    ("prometheus", "prometheus"),
    ("promtool", "prometheus"),
    // The package test: build (dpkg-shlibdeps, strip), check, install into a root.
    ("dpkg-shlibdeps", "dpkg-dev"),
    ("strip", "binutils"),
    ("lintian", "lintian"),
    ("systemd-sysusers", "systemd"),
    // TCP health's lossy path: a network namespace, a veth pair, a TBF qdisc.
    ("ip", "iproute2"),
    ("tc", "iproute2"),
    // ACME: the test CA (Pebble) issues certificates, its challenge test server
    // answers its DNS queries on loopback.
    ("pebble", "pebble"),
    ("pebble-challtestsrv", "pebble"),
    // The WAN bench starts its servers and clients inside network namespaces.
    ("nsenter", "util-linux"),
    // A real log analyser reads the combined access log.
    ("goaccess", "goaccess"),
];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("test") => test(&args[1..]),
        Some("bench") => bench(&args[1..]),
        Some("deps") => install_deps(),
        Some("build-ebpf") => ebpf::build_ebpf().map(drop),
        Some("build-peers") => peers::build(peers::Wanted::ALL, true),
        Some("run") => run_daemon(&args[1..]),
        Some("fuzz") => fuzz(args.get(1).map(String::as_str)),
        Some("vm-test") => vm::vm_test(args.iter().any(|a| a == "--release")),
        Some("deb") => deb::deb(&args[1..]),
        _ => {
            eprintln!(
                "usage: cargo xtask <test [-- CARGO TEST ARGS] | build-ebpf | build-peers | run [SERVE ARGS] | fuzz [SECONDS] | vm-test [--release] | bench [ARGS] | deb [--binary PATH] [--out DIR] [--lintian] | deps>"
            );
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e:#}");
            ExitCode::FAILURE
        }
    }
}

pub(crate) fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

pub(crate) fn run(cmd: &mut Command) -> anyhow::Result<()> {
    eprintln!("xtask: $ {cmd:?}");
    let status = cmd.status().with_context(|| format!("cannot start {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed with {status}");
    }
    Ok(())
}

fn have(command: &str) -> bool {
    Command::new("sh")
        .args([
            "-c",
            &format!("command -v {command} >/dev/null 2>&1 || test -x /usr/sbin/{command}"),
        ])
        .status()
        .is_ok_and(|s| s.success())
}

pub(crate) fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0\n"))
}

/// PyPI packages the tests drive: (module that proves it, pinned requirement).
const PYPI: &[(&str, &str)] = &[("aioquic", "aioquic==1.7.2")];

/// Installs the missing Debian and PyPI packages; without root it says what to
/// install.
fn install_deps() -> anyhow::Result<()> {
    install_apt(APT)?;
    install_pypi(PYPI)
}

/// Installs the PyPI packages whose module `python3` cannot import, for the same
/// `python3` the tests run (Debian's marks itself externally managed: then pip needs
/// `--break-system-packages`).
fn install_pypi(packages: &[(&str, &str)]) -> anyhow::Result<()> {
    let missing: Vec<&str> = packages
        .iter()
        .filter(|(module, _)| {
            !Command::new("python3")
                .args(["-c", &format!("import {module}")])
                .status()
                .is_ok_and(|s| s.success())
        })
        .map(|(_, requirement)| *requirement)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let pip = |extra: &[&str]| {
        run(Command::new("python3")
            .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check"])
            .args(extra)
            .args(&missing))
    };
    pip(&[]).or_else(|_| pip(&["--break-system-packages"]))
}

/// Installs the packages whose command (or file, for an absolute path) is missing.
pub(crate) fn install_apt(packages: &[(&str, &str)]) -> anyhow::Result<()> {
    let missing: Vec<&str> = packages
        .iter()
        .filter(|(cmd, _)| {
            if cmd.starts_with('/') {
                !std::path::Path::new(cmd).exists()
            } else {
                !have(cmd)
            }
        })
        .map(|(_, pkg)| *pkg)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    if !is_root() {
        bail!(
            "missing packages: {}; install them with `sudo apt-get install {}`",
            missing.join(" "),
            missing.join(" ")
        );
    }
    eprintln!("xtask: installing {}", missing.join(" "));
    run(Command::new("apt-get").args(["update", "-qq"]))?;
    run(Command::new("apt-get")
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive"))?;
    Ok(())
}

fn test(extra: &[String]) -> anyhow::Result<()> {
    let mut steps = Steps::default();
    steps.time("dependencies", install_deps)?;
    raise_open_files();
    steps.time("fmt", || {
        run(cargo().args(["fmt", "--all", "--", "--check"]))?;
        // The crates outside the workspace (their own toolchains build them).
        for manifest in ["webship-ebpf/Cargo.toml", "fuzz/Cargo.toml"] {
            run(cargo().args(["fmt", "--manifest-path", manifest, "--", "--check"]))?;
        }
        Ok(())
    })?;
    // First, so that every build below embeds the programs.
    steps.time("eBPF build", || ebpf::build_ebpf().map(drop))?;
    steps.time("clippy", || {
        run(cargo().args(["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"]))?;
        // The daemon without eBPF (userspace engines only) must stay clean too.
        run(cargo().args([
            "clippy",
            "-p",
            "webship",
            "--no-default-features",
            "--",
            "-D",
            "warnings",
        ]))
    })?;
    // The end-to-end suite drives the real binary; build it first.
    steps.time("build", || {
        run(cargo().args(["build", "-p", "webship", "--bin", "webship"]))
    })?;
    steps.time("cargo test", || {
        run(cargo().args(["test", "--workspace"]).args(extra))
    })?;
    // The kTLS promotion path, in a kernel that has kTLS.
    steps.time("kTLS VM", || vm::vm_test(false))?;
    // The benchmark harness, one sample per webship cell, so it cannot rot.
    steps.time("bench smokes", || {
        bench(&["download".into(), "--smoke".into(), "--scrape".into()])?;
        bench(&["webtransport", "--samples", "1", "--datagrams", "2000"].map(String::from))?;
        bench(&["concurrency", "--levels", "1,16", "--mib", "1"].map(String::from))?;
        bench(&["connections", "--smoke"].map(String::from))?;
        bench(&["tickets", "--handshakes", "40"].map(String::from))?;
        // One emulated WAN link (namespaces, TUN devices, the relay), h2 and h3.
        bench(&["wan", "--smoke"].map(String::from))
    })
}

/// The time each step of `cargo xtask test` took, printed when the suite ends (passed
/// or not), so the CI budget (30 minutes on 2 cores) is watched step by step.
#[derive(Default)]
struct Steps {
    done: Vec<(&'static str, std::time::Duration)>,
}

impl Steps {
    fn time<T>(&mut self, name: &'static str, step: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
        let started = std::time::Instant::now();
        let result = step();
        self.done.push((name, started.elapsed()));
        result
    }
}

impl Drop for Steps {
    fn drop(&mut self) {
        let total: std::time::Duration = self.done.iter().map(|(_, t)| *t).sum();
        eprintln!("xtask: time per step ({:.0} s in all)", total.as_secs_f64());
        for (name, took) in &self.done {
            eprintln!("  {:>7.1} s  {name}", took.as_secs_f64());
        }
    }
}

/// Open files the suite's daemons may need: a flood test configures 1,000
/// connections under UDP passthrough (7 descriptors each, plus 256), and the daemon
/// refuses a configured `max_connections` the limit cannot fit. Below this hard
/// limit, root raises it for the suite (inherited by everything it starts; needs
/// CAP_SYS_RESOURCE); the limit tests set their own.
const SUITE_OPEN_FILES: u64 = 8_192;

fn raise_open_files() {
    let hard = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|limits| {
            let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
            line.split_whitespace().nth(4)?.parse::<u64>().ok()
        });
    if !is_root() || hard.is_some_and(|h| h >= SUITE_OPEN_FILES) {
        return;
    }
    let limit = format!("--nofile={SUITE_OPEN_FILES}:{SUITE_OPEN_FILES}");
    let pid = std::process::id().to_string();
    match Command::new("prlimit").args(["--pid", &pid, &limit]).status() {
        Ok(status) if status.success() => eprintln!("xtask: open-file limit raised to {SUITE_OPEN_FILES} for the suite"),
        _ => eprintln!("xtask: could not raise the open-file limit (hard {hard:?}); tests that need more descriptors may fail"),
    }
}

fn run_daemon(extra: &[String]) -> anyhow::Result<()> {
    ebpf::build_ebpf()?;
    run(cargo().args(["build", "--release", "-p", "webship", "--bin", "webship"]))?;
    let binary = ebpf::workspace_root()?.join("target/release/webship");
    let mut cmd = if is_root() {
        Command::new(&binary)
    } else {
        eprintln!("xtask: eBPF and kernel offloads need root; starting through sudo");
        let mut sudo = Command::new("sudo");
        sudo.arg(&binary);
        sudo
    };
    cmd.args(extra);
    run(&mut cmd)
}

fn fuzz(seconds: Option<&str>) -> anyhow::Result<()> {
    let seconds: u64 = seconds
        .unwrap_or("60")
        .parse()
        .context("SECONDS must be a number")?;
    let root = ebpf::workspace_root()?;
    let have_fuzz = Command::new("cargo")
        .args(["fuzz", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !have_fuzz {
        run(cargo().args(["install", "cargo-fuzz", "--locked"]))?;
    }
    let corpus = root.join("target/fuzz-corpus/client_hello");
    std::fs::create_dir_all(&corpus)?;
    for seed in std::fs::read_dir(root.join("webship/src/passthrough/testdata"))? {
        let seed = seed?.path();
        if let Some(name) = seed.file_name() {
            std::fs::copy(&seed, corpus.join(name))?;
        }
    }
    let capsules = root.join("target/fuzz-corpus/capsules");
    std::fs::create_dir_all(&capsules)?;
    let proxy_header = root.join("target/fuzz-corpus/proxy_header");
    std::fs::create_dir_all(&proxy_header)?;
    for (name, seed) in [
        ("v1", &b"PROXY TCP4 203.0.113.7 198.51.100.1 56324 443\r\n"[..]),
        (
            "v2",
            b"\r\n\r\n\0\r\nQUIT\n\x21\x11\x00\x0c\xcb\x00\x71\x07\xc6\x33\x64\x01\xdc\x04\x01\xbb",
        ),
    ] {
        std::fs::write(proxy_header.join(name), seed)?;
    }
    for target in [
        ("client_hello", corpus),
        ("capsules", capsules),
        ("proxy_header", proxy_header),
    ] {
        run(Command::new("cargo")
            .current_dir(root.join("fuzz"))
            .args(["+nightly", "fuzz", "run", "--fuzz-dir", "."])
            .arg(target.0)
            .arg(&target.1)
            .arg("--")
            .arg(format!("-max_total_time={seconds}"))
            .env_remove("CARGO")
            .env_remove("RUSTUP_TOOLCHAIN"))?;
    }
    Ok(())
}

/// The peers of a full benchmark run (Debian packages); `--smoke` runs none.
const BENCH_APT: &[(&str, &str)] = &[
    ("haproxy", "haproxy"),
    ("lighttpd", "lighttpd"),
    ("/usr/lib/lighttpd/mod_openssl.so", "lighttpd-mod-openssl"),
    ("caddy", "caddy"),
    ("h2o", "h2o"),
    (
        "/usr/lib/nginx/modules/ngx_stream_module.so",
        "libnginx-mod-stream",
    ),
];

fn bench(extra: &[String]) -> anyhow::Result<()> {
    install_deps()?;
    if !extra.iter().any(|a| a == "--smoke") {
        install_apt(BENCH_APT)?;
    }
    peers::build(peers::Wanted::from_bench_args(extra), false)?;
    ebpf::build_ebpf()?;
    run(cargo().args(["build", "--release", "-p", "webship", "--bin", "webship"]))?;
    run(cargo()
        .args(["run", "--release", "-p", "webship-benches", "--"])
        .args(extra))
}
