//! `cargo xtask build-ebpf`: builds `webship-ebpf/` for `bpfel-unknown-none` and
//! leaves the object at `target/bpf/webship-ebpf.o`, where the daemon's `build.rs`
//! embeds it.
//!
//! The toolchain (the route proven on Debian 12, where rustup has no BPF `core` and
//! cannot download one): Debian's `rustc-web` with `libstd-rust-web-dev-bpf` (a
//! prebuilt `core` for the BPF target) and `llvm-22-dev`, plus `bpf-linker` built
//! against that LLVM. Missing pieces are installed when running as root. The
//! userspace workspace stays on rustup's toolchain.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};

use crate::{cargo, have, is_root, run};

const DEBIAN_RUSTC: &str = "/usr/bin/rustc";
const LLVM_PREFIX: &str = "/usr/lib/llvm-22";
const LLVM_MAJOR: &str = "22";
const BPF_LINKER: &str = "0.13.0";
const APT: &[&str] = &["rustc-web", "libstd-rust-web-dev-bpf", "llvm-22-dev"];

/// The object's path relative to the workspace root.
pub(crate) const OBJECT: &str = "target/bpf/webship-ebpf.o";

pub(crate) fn build_ebpf() -> anyhow::Result<PathBuf> {
    let root = workspace_root()?;
    install_toolchain()?;
    let build_dir = root.join("target/bpf-build");
    let mut cmd = cargo();
    cmd.current_dir(root.join("webship-ebpf"))
        .args(["build", "--release", "--locked", "--target", "bpfel-unknown-none"])
        .env("RUSTC", DEBIAN_RUSTC)
        // The prebuilt `core` for the BPF target is a nightly-featured build.
        .env("RUSTC_BOOTSTRAP", "1")
        .env("CARGO_TARGET_DIR", &build_dir)
        .env("PATH", path_with_cargo_bin())
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("RUSTC_WRAPPER")
        .env_remove("RUSTC_WORKSPACE_WRAPPER");
    run(&mut cmd)?;
    let built = build_dir.join("bpfel-unknown-none/release/webship-ebpf");
    let bytes = std::fs::read(&built).with_context(|| format!("reading {}", built.display()))?;
    let object = root.join(OBJECT);
    if std::fs::read(&object).ok().as_deref() != Some(&bytes[..]) {
        // Through a rename, so the folder's mtime (which build.rs watches) changes.
        let dir = object.parent().context("object path has a parent")?;
        std::fs::create_dir_all(dir)?;
        let tmp = dir.join("webship-ebpf.o.tmp");
        std::fs::write(&tmp, &bytes)?;
        std::fs::rename(&tmp, &object)?;
    }
    eprintln!(
        "xtask: eBPF object at {} ({} bytes)",
        object.display(),
        bytes.len()
    );
    Ok(object)
}

fn install_toolchain() -> anyhow::Result<()> {
    let rustc_ok = rustc_llvm_major().as_deref() == Some(LLVM_MAJOR)
        && Path::new("/usr/lib/rustlib/bpfel-unknown-none/lib").is_dir()
        && Path::new(LLVM_PREFIX).join("bin/llvm-config").exists();
    if !rustc_ok {
        if !is_root() {
            bail!(
                "the eBPF toolchain is missing; install it with `sudo apt-get install {}` \
                 (from bookworm-security)",
                APT.join(" ")
            );
        }
        eprintln!("xtask: installing the eBPF toolchain: {}", APT.join(" "));
        run(Command::new("apt-get").args(["update", "-qq"]))?;
        run(Command::new("apt-get")
            .args(["install", "-y", "-qq", "--no-install-recommends"])
            .args(APT)
            .env("DEBIAN_FRONTEND", "noninteractive"))?;
        match rustc_llvm_major() {
            Some(major) if major == LLVM_MAJOR => {}
            other => bail!(
                "Debian's rustc uses LLVM {}, but bpf-linker is built against LLVM {LLVM_MAJOR}",
                other.as_deref().unwrap_or("(unknown)")
            ),
        }
    }
    let linker_ok = Command::new("bpf-linker")
        .arg("--version")
        .env("PATH", path_with_cargo_bin())
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains(BPF_LINKER));
    if !linker_ok {
        eprintln!("xtask: building bpf-linker {BPF_LINKER} against {LLVM_PREFIX} (a few minutes, once)");
        run(cargo()
            .args(["install", &format!("bpf-linker@{BPF_LINKER}"), "--locked"])
            .args([
                "--no-default-features",
                "--features",
                &format!("llvm-{LLVM_MAJOR}"),
            ])
            .env("LLVM_PREFIX", LLVM_PREFIX))?;
    }
    Ok(())
}

/// The LLVM major version of Debian's rustc, if it is installed.
fn rustc_llvm_major() -> Option<String> {
    if !have(DEBIAN_RUSTC) {
        return None;
    }
    let out = Command::new(DEBIAN_RUSTC).arg("-vV").output().ok()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("LLVM version: "))
        .and_then(|v| v.split('.').next())
        .map(str::to_owned)
}

/// PATH with `~/.cargo/bin` first: rustc-web also installs /usr/bin/cargo, and
/// bpf-linker lives in cargo's bin folder.
fn path_with_cargo_bin() -> String {
    let home = std::env::var("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|_| std::env::var("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .unwrap_or_else(|_| PathBuf::from("/root/.cargo"));
    let path = std::env::var("PATH").unwrap_or_default();
    format!("{}:{path}", home.join("bin").display())
}

pub(crate) fn workspace_root() -> anyhow::Result<PathBuf> {
    let manifest = std::env::var("CARGO_MANIFEST_DIR").context("run through `cargo xtask`")?;
    Ok(Path::new(&manifest)
        .parent()
        .context("xtask lives in the workspace")?
        .to_owned())
}
