//! `cargo xtask build-peers`: the benchmark peers that are not Debian packages,
//! each in a cache under `target/peers/` that the bench runner looks in by default.
//! - Pingora: `benches/peers/pingora-proxy` (not a workspace member: its own
//!   Cargo.lock and target directory), linked against Debian's libssl.
//! - Bun: the npm package `bun` at a pinned version (its postinstall script puts the
//!   platform binary in `node_modules/bun/bin/bun.exe`), never installed globally.
//!
//! `cargo xtask bench` runs this for a `download` run that selects either peer, and
//! goes on without it if it fails (the runner then skips those cells and says why);
//! CI's smoke runs select no peers, so they never build these.

use std::path::Path;
use std::process::Command;

use anyhow::{ensure, Context};

use crate::{cargo, ebpf, install_apt, run};

/// The Bun release the benchmark measures.
const BUN_VERSION: &str = "1.4.5";
/// Pingora's tree under `target/`, apart from the workspace's.
const PINGORA_TARGET: &str = "target/peers/pingora";
const BUN_PREFIX: &str = "target/peers/bun";

/// Which of the built peers a benchmark run wants.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Wanted {
    pub pingora: bool,
    pub bun: bool,
}

impl Wanted {
    pub(crate) const ALL: Wanted = Wanted {
        pingora: true,
        bun: true,
    };

    /// From `cargo xtask bench` arguments: only the `download` scenario (the default
    /// one) has these peers, `--smoke` runs none, and `--peers LIST` narrows them.
    pub(crate) fn from_bench_args(args: &[String]) -> Wanted {
        let download = match args.first().map(String::as_str) {
            None | Some("download") => true,
            Some(first) => first.starts_with('-'),
        };
        if !download || args.iter().any(|a| a == "--smoke") {
            return Wanted::default();
        }
        let list = args
            .iter()
            .enumerate()
            .find_map(|(i, arg)| match arg.strip_prefix("--peers") {
                Some("") => args.get(i + 1).cloned(),
                Some(rest) => rest.strip_prefix('=').map(str::to_owned),
                None => None,
            });
        match list {
            None => Wanted::ALL,
            Some(list) => Wanted {
                pingora: list.split(',').any(|p| p == "pingora"),
                bun: list.split(',').any(|p| p == "bun"),
            },
        }
    }
}

/// Builds or installs the wanted peers; each failure is reported and left behind.
pub(crate) fn build(wanted: Wanted, strict: bool) -> anyhow::Result<()> {
    let mut failures = Vec::new();
    if wanted.pingora {
        if let Err(e) = build_pingora() {
            failures.push(format!("pingora: {e:#}"));
        }
    }
    if wanted.bun {
        if let Err(e) = install_bun() {
            failures.push(format!("bun: {e:#}"));
        }
    }
    if failures.is_empty() {
        return Ok(());
    }
    let text = failures.join("\n");
    ensure!(!strict, "{text}");
    eprintln!("xtask: peers not built, their cells will be skipped:\n{text}");
    Ok(())
}

/// `cargo build --release --locked` of the Pingora proxy into its own target dir.
fn build_pingora() -> anyhow::Result<()> {
    install_apt(&[
        ("pkg-config", "pkg-config"),
        ("/usr/include/openssl/ssl.h", "libssl-dev"),
        // pingora-core's flate2 uses zlib-ng, built from source with CMake.
        ("cmake", "cmake"),
    ])?;
    let root = ebpf::workspace_root()?;
    run(cargo()
        .args(["build", "--release", "--locked", "--manifest-path"])
        .arg(root.join("benches/peers/pingora-proxy/Cargo.toml"))
        .env("CARGO_TARGET_DIR", root.join(PINGORA_TARGET))
        // Debian's libssl instead of compiling the copy pingora-openssl vendors.
        .env("OPENSSL_NO_VENDOR", "1"))
}

/// `npm install bun@BUN_VERSION` into `target/peers/bun`, unless that version is there.
fn install_bun() -> anyhow::Result<()> {
    let prefix = ebpf::workspace_root()?.join(BUN_PREFIX);
    let binary = prefix.join("node_modules/bun/bin/bun.exe");
    if version_of(&binary).as_deref() == Some(BUN_VERSION) {
        return Ok(());
    }
    install_apt(&[("npm", "npm")])?;
    std::fs::create_dir_all(&prefix).with_context(|| format!("creating {}", prefix.display()))?;
    run(Command::new("npm")
        .args(["install", "--no-save", "--no-audit", "--no-fund", "--prefix"])
        .arg(&prefix)
        .arg(format!("bun@{BUN_VERSION}")))?;
    let found = version_of(&binary);
    ensure!(
        found.as_deref() == Some(BUN_VERSION),
        "{} reports {found:?} after `npm install bun@{BUN_VERSION}`, not {BUN_VERSION} \
         (its postinstall script places the binary; was it blocked?)",
        binary.display()
    );
    Ok(())
}

/// What `binary --version` prints, trimmed; None if it does not run.
fn version_of(binary: &Path) -> Option<String> {
    let out = Command::new(binary).arg("--version").output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

#[cfg(test)]
mod tests {
    use super::Wanted;

    fn wanted(args: &[&str]) -> Wanted {
        Wanted::from_bench_args(&args.iter().map(|a| a.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn only_download_runs_want_the_built_peers() {
        assert_eq!(wanted(&[]), Wanted::ALL);
        assert_eq!(wanted(&["download", "--samples", "3"]), Wanted::ALL);
        assert_eq!(wanted(&["--samples", "3"]), Wanted::ALL);
        assert_eq!(wanted(&["download", "--smoke", "--scrape"]), Wanted::default());
        assert_eq!(wanted(&["concurrency", "--levels", "1,16"]), Wanted::default());
        assert_eq!(wanted(&["wan", "--smoke"]), Wanted::default());
        let only_bun = Wanted {
            pingora: false,
            bun: true,
        };
        assert_eq!(wanted(&["download", "--peers", "nginx,bun"]), only_bun);
        assert_eq!(wanted(&["--peers=caddy,bun"]), only_bun);
        assert_eq!(wanted(&["download", "--peers", "nginx"]), Wanted::default());
    }
}
