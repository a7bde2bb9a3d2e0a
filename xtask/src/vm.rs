//! `cargo xtask vm-test`: the kTLS promotion path, proven inside a kernel that has
//! kTLS. This host's kernel has none, so the test boots Debian's user-mode Linux (an
//! ordinary process, no KVM) with the host's root file system mounted read-only
//! through hostfs: the guest runs the very `webship` binary, curl and coreutils of the
//! host, loads the guest kernel's `tls.ko`, and prints one `VMTEST` line per check.
//! The VM's exit status carries nothing, so the lines are the result.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context};

use crate::run;

/// Fixture size: the capacity benchmark's.
const FIXTURE_LEN: u64 = 99_943_778;

pub(crate) fn vm_test(release: bool) -> anyhow::Result<()> {
    let root = workspace_root()?;
    let vm = root.join("target/vm");
    std::fs::create_dir_all(&vm)?;
    let uml = unpack_uml(&vm)?;
    let profile = if release { "release" } else { "debug" };
    let mut build = crate::cargo();
    build.args([
        "build",
        "-p",
        "webship",
        "--bin",
        "webship",
        "-p",
        "webship-tests",
        "--bin",
        "webship-fetch",
    ]);
    if release {
        build.arg("--release");
    }
    run(&mut build)?;
    let webship = root.join("target").join(profile).join("webship");
    let fetch = root.join("target").join(profile).join("webship-fetch");
    prepare_files(&vm)?;
    std::fs::create_dir_all(vm.join("scratch"))?;
    let script = vm.join("init.sh");
    std::fs::write(&script, init_script(&vm, &uml, &webship, &fetch))?;
    make_executable(&script)?;

    let start = Instant::now();
    eprintln!("xtask: booting user-mode Linux ({})", uml.kernel.display());
    let output = Command::new("timeout")
        .arg("600")
        .arg(&uml.kernel)
        .args([
            "mem=1536M",
            "root=/dev/root",
            "rootfstype=hostfs",
            "rootflags=/",
            "ro",
            &format!("init={}", script.display()),
            "con=null",
            "con0=fd:0,fd:1",
        ])
        .env_remove("DISPLAY")
        .stdin(std::process::Stdio::null())
        .output()
        .context("cannot start the user-mode Linux kernel")?;
    let text = String::from_utf8_lossy(&output.stdout);
    let lines: Vec<&str> = text.lines().filter(|l| l.starts_with("VMTEST")).collect();
    for line in &lines {
        println!("{line}");
    }
    let passed = lines.iter().filter(|l| l.starts_with("VMTEST ok ")).count();
    let failed = lines.iter().filter(|l| l.starts_with("VMTEST FAIL ")).count();
    let done = lines.iter().any(|l| l.starts_with("VMTEST-DONE"));
    println!(
        "vm-test: {passed} passed, {failed} failed ({:.1} s in the VM)",
        start.elapsed().as_secs_f64()
    );
    if !done || failed > 0 || passed == 0 {
        let tail: Vec<&str> = text.lines().rev().take(60).collect();
        eprintln!("--- VM console (last lines) ---");
        for line in tail.iter().rev() {
            eprintln!("{line}");
        }
        bail!("the kTLS VM test failed ({failed} failed, finished: {done})");
    }
    Ok(())
}

fn workspace_root() -> anyhow::Result<PathBuf> {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    Ok(manifest
        .parent()
        .context("xtask has no parent directory")?
        .to_owned())
}

struct Uml {
    kernel: PathBuf,
    /// The guest kernel's module tree (`.../modules/<version>`).
    modules: PathBuf,
    busybox: PathBuf,
}

/// What kTLS needs, in load order: the AEADs the kernel instantiates for each suite
/// (AES itself is built in), then `tls`.
const MODULES: &[&str] = &[
    "kernel/crypto/gf128mul.ko",
    "kernel/crypto/ghash-generic.ko",
    "kernel/crypto/ctr.ko",
    "kernel/crypto/gcm.ko",
    "kernel/lib/crypto/libchacha.ko",
    "kernel/crypto/chacha_generic.ko",
    "kernel/lib/crypto/libpoly1305.ko",
    "kernel/crypto/poly1305_generic.ko",
    "kernel/crypto/chacha20poly1305.ko",
    "kernel/net/tls/tls.ko",
];

/// Downloads (no install) and unpacks `user-mode-linux` and `busybox-static`.
fn unpack_uml(vm: &Path) -> anyhow::Result<Uml> {
    let debs = vm.join("debs");
    let tree = vm.join("uml");
    std::fs::create_dir_all(&debs)?;
    let kernel = tree.join("usr/bin/linux.uml");
    let busybox = tree.join("bin/busybox");
    if !kernel.exists() || !busybox.exists() {
        let have_lists = Path::new("/var/lib/apt/lists")
            .read_dir()
            .is_ok_and(|mut d| d.next().is_some());
        if !have_lists {
            run(Command::new("apt-get").args(["update", "-qq"]))?;
        }
        run(Command::new("apt-get")
            .args(["download", "-qq", "user-mode-linux", "busybox-static"])
            .current_dir(&debs))?;
        for entry in std::fs::read_dir(&debs)? {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "deb") {
                run(Command::new("dpkg-deb").arg("-x").arg(&path).arg(&tree))?;
            }
        }
    }
    let modules = tree.join("usr/lib/uml/modules");
    let modules = std::fs::read_dir(&modules)
        .with_context(|| format!("no {}", modules.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| MODULES.iter().all(|m| p.join(m).exists()))
        .context("the user-mode-linux package lacks the kTLS modules")?;
    Ok(Uml {
        kernel,
        modules,
        busybox,
    })
}

/// The fixture, a small file, a certificate and the server configs the guest uses.
fn prepare_files(vm: &Path) -> anyhow::Result<()> {
    let www = vm.join("www");
    std::fs::create_dir_all(&www)?;
    let fixture = www.join("fixture.bin");
    if std::fs::metadata(&fixture).map(|m| m.len()).ok() != Some(FIXTURE_LEN) {
        run(Command::new("sh").arg("-c").arg(format!(
            "head -c {FIXTURE_LEN} /dev/urandom > '{}'",
            fixture.display()
        )))?;
    }
    std::fs::write(www.join("small.txt"), "small and after promotion\n")?;
    let cert = vm.join("cert.pem");
    let key = vm.join("key.pem");
    if !cert.exists() || !key.exists() {
        run(Command::new("openssl")
            .args([
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-days",
                "30",
            ])
            .args([
                "-subj",
                "/CN=localhost",
                "-addext",
                "subjectAltName=DNS:localhost",
                // A leaf, not a CA: rustls clients refuse a CA certificate as a server's.
                "-addext",
                "basicConstraints=critical,CA:FALSE",
            ])
            .arg("-keyout")
            .arg(&key)
            .arg("-out")
            .arg(&cert)
            .stderr(std::process::Stdio::null()))?;
    }
    // The kTLS server's admin listener: the guest reads the promotion metrics there.
    for (name, port, ktls, admin) in [
        (
            "required",
            8443,
            "required",
            "[admin]\nlisten = \"127.0.0.1:9901\"\n",
        ),
        ("auto", 8444, "auto", ""),
        ("off", 8445, "off", ""),
    ] {
        std::fs::write(
            vm.join(format!("{name}.toml")),
            format!(
                "listen = \"127.0.0.1:{port}\"\nworkers = 1\nroot = \"{}\"\n[tls]\ncert = \"{}\"\nkey = \"{}\"\n[protocols]\nh3 = false\n[kernel]\nktls = \"{ktls}\"\nbbr = \"off\"\n{admin}",
                www.display(),
                cert.display(),
                key.display()
            ),
        )?;
    }
    Ok(())
}

fn make_executable(path: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mut perms = std::fs::metadata(path)?.permissions();
    perms.set_mode(0o755);
    std::fs::set_permissions(path, perms)?;
    Ok(())
}

/// The guest's PID 1. Everything it writes goes to a tmpfs: the host tree is read-only.
fn init_script(vm: &Path, uml: &Uml, webship: &Path, fetch: &Path) -> String {
    let template = include_str!("vm_init.sh");
    template
        .replace("@VM@", &vm.display().to_string())
        .replace("@BUSYBOX@", &uml.busybox.display().to_string())
        .replace(
            "@MODULES@",
            &MODULES
                .iter()
                .map(|m| uml.modules.join(m).display().to_string())
                .collect::<Vec<_>>()
                .join(" "),
        )
        .replace("@WEBSHIP@", &webship.display().to_string())
        .replace("@FETCH@", &fetch.display().to_string())
        .replace("@FIXTURE_LEN@", &FIXTURE_LEN.to_string())
}
