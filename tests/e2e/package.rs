//! The Debian package (`cargo xtask deb`), built from the debug binary: its files,
//! modes and control data, lintian, and a real installation into a throwaway root
//! (`dpkg --root` with the maintainer scripts run from outside, `DPKG_ROOT` set):
//! the files and their owners, the service account in that root's account files,
//! the unit enabled, `webship check` on the shipped configuration run inside the
//! root (chroot), a reinstallation that keeps the certificate, then remove and
//! purge. Needs root (chown, chroot), as the suite does.

use std::collections::BTreeMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use webship_tests::server::binary;

/// Every file of the package with its mode: nothing more, nothing less.
const FILES: &[(&str, &str)] = &[
    ("etc/webship/webship.toml", "-rw-r--r--"),
    ("lib/systemd/system/webship.service", "-rw-r--r--"),
    ("usr/bin/webship", "-rwxr-xr-x"),
    ("usr/lib/sysusers.d/webship.conf", "-rw-r--r--"),
    ("usr/lib/tmpfiles.d/webship.conf", "-rw-r--r--"),
    ("usr/share/doc/webship/README.md.gz", "-rw-r--r--"),
    ("usr/share/doc/webship/changelog.Debian.gz", "-rw-r--r--"),
    ("usr/share/doc/webship/copyright", "-rw-r--r--"),
    ("usr/share/lintian/overrides/webship", "-rw-r--r--"),
    ("usr/share/man/man1/webship.1.gz", "-rw-r--r--"),
    ("usr/share/webship/html/index.html", "-rw-r--r--"),
];

const CONFIG: &str = "/etc/webship/webship.toml";
const CERT: &str = "etc/webship/tls/placeholder-cert.pem";
const KEY: &str = "etc/webship/tls/placeholder-key.pem";

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_owned()
}

/// Runs `cmd`; its standard output, or a panic that shows both outputs.
fn ok(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// `dpkg` acting on `root` from the outside, its maintainer scripts too. The root
/// has none of the package's dependencies (libc6, openssl, systemd), which the
/// host's copies stand in for.
fn dpkg(root: &Path) -> Command {
    let mut cmd = Command::new("dpkg");
    cmd.arg(format!("--root={}", root.display()))
        .arg(format!("--log={}", root.join("var/log/dpkg.log").display()))
        .args(["--force-script-chrootless", "--force-depends"])
        .env("DPKG_ROOT", root);
    cmd
}

/// An empty dpkg database under `root`.
fn empty_root(root: &Path) {
    for dir in [
        "var/lib/dpkg/info",
        "var/lib/dpkg/updates",
        "var/lib/dpkg/triggers",
        "var/log",
    ] {
        std::fs::create_dir_all(root.join(dir)).unwrap();
    }
    for file in ["var/lib/dpkg/status", "var/lib/dpkg/available"] {
        std::fs::write(root.join(file), "").unwrap();
    }
}

/// `name:x:uid:gid:...` fields of `name` in `root`'s passwd or group file.
fn account(root: &Path, file: &str, name: &str) -> Option<Vec<String>> {
    let text = std::fs::read_to_string(root.join("etc").join(file)).ok()?;
    text.lines()
        .map(|l| l.split(':').map(str::to_owned).collect::<Vec<_>>())
        .find(|fields| fields[0] == name)
}

/// The shared libraries the binary loads, copied to the same paths in `root`:
/// what the package's `Depends` (libc6, libgcc-s1) would have installed there.
fn libraries_into(root: &Path) {
    let ldd = ok(Command::new("ldd").arg(root.join("usr/bin/webship")));
    let libs: Vec<&str> = ldd.split_whitespace().filter(|w| w.starts_with('/')).collect();
    assert!(libs.iter().any(|l| l.contains("libc.so")), "ldd: {ldd}");
    for lib in libs {
        let dest = root.join(lib.trim_start_matches('/'));
        std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
        std::fs::copy(lib, &dest).unwrap();
    }
}

/// The package's files from `dpkg-deb -c`: path → (mode, owner/group).
fn contents(deb: &Path) -> BTreeMap<String, (String, String)> {
    ok(Command::new("dpkg-deb").arg("-c").arg(deb))
        .lines()
        .filter(|l| !l.starts_with('d'))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let path = f[5].trim_start_matches("./").to_owned();
            (path, (f[0].to_owned(), f[1].to_owned()))
        })
        .collect()
}

#[test]
fn the_debian_package_installs_checks_and_purges_cleanly() {
    assert!(
        ok(Command::new("id").arg("-u")).trim() == "0",
        "the package test installs into a root with chown and chroot: run it as root"
    );
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let built = ok(Command::new(cargo)
        .current_dir(workspace())
        .args(["run", "--quiet", "-p", "xtask", "--", "deb", "--binary"])
        .arg(binary())
        .arg("--out")
        .arg(&out));
    let deb = PathBuf::from(built.lines().last().unwrap());
    let arch = ok(Command::new("dpkg").arg("--print-architecture"));
    assert_eq!(
        deb.file_name().unwrap().to_str().unwrap(),
        format!("webship_{}-1_{}.deb", env!("CARGO_PKG_VERSION"), arch.trim())
    );

    // The control data: dependencies from dpkg-shlibdeps, the conffile, scripts.
    let field = |name: &str| ok(Command::new("dpkg-deb").args(["-f"]).arg(&deb).arg(name));
    let depends = field("Depends");
    assert!(depends.starts_with("libc6 (>= 2."), "Depends: {depends}");
    assert!(
        depends.contains("openssl") && depends.contains("systemd"),
        "Depends: {depends}"
    );
    let control = dir.path().join("control");
    ok(Command::new("dpkg-deb").arg("-e").arg(&deb).arg(&control));
    assert_eq!(
        std::fs::read_to_string(control.join("conffiles")).unwrap(),
        format!("{CONFIG}\n")
    );
    for script in ["postinst", "prerm", "postrm"] {
        let path = control.join(script);
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o755,
            "{script}"
        );
        ok(Command::new("sh").arg("-n").arg(&path));
    }

    // The files, their modes, root-owned; the unit is the repository's.
    let listed = contents(&deb);
    let expected: BTreeMap<String, (String, String)> = FILES
        .iter()
        .map(|(path, mode)| ((*path).to_owned(), ((*mode).to_owned(), "root/root".to_owned())))
        .collect();
    assert_eq!(listed, expected, "dpkg-deb -c");
    let unpacked = dir.path().join("unpacked");
    ok(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&unpacked));
    let unit = std::fs::read_to_string(unpacked.join("lib/systemd/system/webship.service")).unwrap();
    assert_eq!(
        unit,
        std::fs::read_to_string(workspace().join("packaging/webship.service")).unwrap()
    );
    let exec = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("the unit has no ExecStart=");
    assert!(
        exec.starts_with("/usr/bin/webship ") && exec.contains(CONFIG),
        "ExecStart does not run the packaged binary on the packaged config: {exec}"
    );
    man_page_names_every_command(&unpacked);

    // lintian: no error or warning beyond the documented overrides.
    let lint = Command::new("lintian")
        .args(["--fail-on", "error,warning", "--display-info"])
        .arg(&deb)
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&lint.stdout);
    eprintln!("lintian:\n{report}");
    assert!(lint.status.success(), "lintian ({}):\n{report}", lint.status);

    let root = dir.path().join("root");
    empty_root(&root);
    ok(dpkg(&root).arg("--install").arg(&deb));
    installed(&root);
    let cert = std::fs::read(root.join(CERT)).unwrap();

    // Inside the root, against its own account files and paths.
    libraries_into(&root);
    let check = ok(Command::new("chroot")
        .arg(&root)
        .args(["/usr/bin/webship", "check", "--config", CONFIG]));
    assert!(check.contains(&format!("{CONFIG}: OK")), "{check}");
    assert!(check.contains("user     webship"), "{check}");
    assert!(check.contains("/usr/share/webship/html"), "{check}");

    // Installing again (an upgrade's path through postinst): account and
    // certificate stay as they were.
    let uid = account(&root, "passwd", "webship").unwrap()[2].clone();
    ok(dpkg(&root).arg("--install").arg(&deb));
    assert_eq!(
        std::fs::read(root.join(CERT)).unwrap(),
        cert,
        "the certificate was remade"
    );
    assert_eq!(account(&root, "passwd", "webship").unwrap()[2], uid);

    // Remove keeps the configuration and the certificate; purge takes them, the
    // unit's enablement and /var/lib/webship, and keeps the account (policy).
    ok(dpkg(&root).args(["--remove", "webship"]));
    assert!(!root.join("usr/bin/webship").exists());
    assert!(root.join(CONFIG.trim_start_matches('/')).exists());
    assert!(root.join(KEY).exists());
    let state = root.join("var/lib/webship");
    std::fs::create_dir_all(&state).unwrap();
    std::fs::write(state.join("leftover"), "x").unwrap();
    ok(dpkg(&root).args(["--purge", "webship"]));
    for gone in [
        "etc/webship",
        "var/lib/webship",
        "usr/share/webship",
        "lib/systemd/system/webship.service",
    ] {
        assert!(!root.join(gone).exists(), "{gone} is left after purge");
    }
    assert!(
        !root
            .join("etc/systemd/system/multi-user.target.wants/webship.service")
            .exists(),
        "the unit is still enabled after purge"
    );
    assert!(
        account(&root, "passwd", "webship").is_some(),
        "purge removed the account"
    );
    let status = std::fs::read_to_string(root.join("var/lib/dpkg/status")).unwrap();
    assert!(
        !status.contains("Package: webship"),
        "dpkg still knows the package:\n{status}"
    );
}

/// After `dpkg --install`: every file with its mode, root-owned; the account; the
/// placeholder certificate and its key readable by the account's group only; the
/// unit enabled for the target it names.
fn installed(root: &Path) {
    for (path, mode) in FILES {
        let meta = std::fs::metadata(root.join(path)).unwrap_or_else(|e| panic!("{path}: {e}"));
        let want = if mode.contains('x') { 0o755 } else { 0o644 };
        assert_eq!(meta.mode() & 0o7777, want, "{path}");
        assert_eq!((meta.uid(), meta.gid()), (0, 0), "{path}");
    }
    let user = account(root, "passwd", "webship").expect("no webship in the root's /etc/passwd");
    let group = account(root, "group", "webship").expect("no webship in the root's /etc/group");
    let uid: u32 = user[2].parse().unwrap();
    assert!(
        (1..1000).contains(&uid),
        "webship is not a system account: {user:?}"
    );
    assert_eq!(user[3], group[2], "webship's primary group");
    assert_eq!(user[5], "/", "webship has a home: {user:?}");
    assert!(user[6].ends_with("nologin"), "webship can log in: {user:?}");
    let gid: u32 = group[2].parse().unwrap();

    // The pin folder as systemd-tmpfiles makes it at boot (here in the root's /sys,
    // which is a plain folder: the snippet and its account resolve there).
    ok(Command::new("systemd-tmpfiles")
        .arg(format!("--root={}", root.display()))
        .args(["--create", "webship.conf"]));
    let pins = std::fs::metadata(root.join("sys/fs/bpf/webship")).unwrap();
    assert_eq!(
        (pins.mode() & 0o7777, pins.uid(), pins.gid()),
        (0o770, 0, gid),
        "the pin folder: root's (which pins without CAP_DAC_OVERRIDE), the account's group writes it"
    );
    std::fs::remove_dir_all(root.join("sys")).unwrap();

    let mut tls: Vec<String> = std::fs::read_dir(root.join("etc/webship/tls"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    tls.sort();
    assert_eq!(
        tls,
        ["placeholder-cert.pem", "placeholder-key.pem"],
        "etc/webship/tls"
    );
    let key = std::fs::metadata(root.join(KEY)).unwrap();
    assert_eq!(
        (key.mode() & 0o777, key.uid(), key.gid()),
        (0o640, 0, gid),
        "{KEY}"
    );
    let cert = std::fs::metadata(root.join(CERT)).unwrap();
    assert_eq!((cert.mode() & 0o777, cert.uid()), (0o644, 0), "{CERT}");
    let subject = ok(Command::new("openssl")
        .args(["x509", "-noout", "-subject", "-ext", "subjectAltName", "-in"])
        .arg(root.join(CERT)));
    assert!(subject.contains("DNS:localhost"), "{subject}");

    let unit = std::fs::read_to_string(root.join("lib/systemd/system/webship.service")).unwrap();
    let target = unit
        .lines()
        .find_map(|l| l.strip_prefix("WantedBy="))
        .expect("the unit names no WantedBy= target");
    let link = root.join(format!(
        "etc/systemd/system/{}.wants/webship.service",
        target.trim()
    ));
    assert_eq!(
        std::fs::read_link(&link).unwrap_or_else(|e| panic!("{}: {e}", link.display())),
        Path::new("/lib/systemd/system/webship.service")
    );
}

/// The manual names every command `webship --help` lists.
fn man_page_names_every_command(unpacked: &Path) {
    let man = ok(Command::new("gzip")
        .args(["-dc"])
        .arg(unpacked.join("usr/share/man/man1/webship.1.gz")));
    let help = ok(Command::new(binary()).arg("--help"));
    let commands = help
        .split_once("Commands:")
        .unwrap()
        .1
        .lines()
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.split_whitespace().next())
        .filter(|&c| c != "help");
    for command in commands {
        assert!(
            man.contains(&format!(".B {command}\n")),
            "the manual (packaging/webship.1) does not describe `webship {command}`"
        );
    }
}
