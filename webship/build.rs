//! Embeds the eBPF object built by `cargo xtask build-ebpf` when the `ebpf` feature
//! is on and the object exists (`target/bpf/webship-ebpf.o`, or the path in
//! `WEBSHIP_EBPF_OBJECT`). Without it the daemon still builds and runs: preflight
//! reports eBPF as missing and passthrough uses a userspace engine.

use std::path::PathBuf;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(webship_bpf_object)");
    println!("cargo::rerun-if-env-changed=WEBSHIP_EBPF_OBJECT");
    if std::env::var_os("CARGO_FEATURE_EBPF").is_none()
        || std::env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux")
    {
        return;
    }
    let object = match std::env::var_os("WEBSHIP_EBPF_OBJECT") {
        Some(path) => PathBuf::from(path),
        None => {
            let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
            let dir = manifest.join("../target/bpf");
            // Watch the folder (created here if needed), so that a later
            // `cargo xtask build-ebpf` writing the object triggers a rebuild.
            let _ = std::fs::create_dir_all(&dir);
            println!("cargo::rerun-if-changed={}", dir.display());
            dir.join("webship-ebpf.o")
        }
    };
    if object.is_file() {
        // Only an existing path: a missing one would rerun this script every build.
        println!("cargo::rerun-if-changed={}", object.display());
        println!("cargo::rustc-cfg=webship_bpf_object");
        println!("cargo::rustc-env=WEBSHIP_EBPF_OBJECT_PATH={}", object.display());
    } else if std::env::var("PROFILE").as_deref() == Ok("release") {
        println!(
            "cargo::warning=no eBPF object at {}: this build has no sockmap engine \
             (run `cargo xtask build-ebpf` first)",
            object.display()
        );
    }
}
