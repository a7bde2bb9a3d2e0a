//! `cargo xtask deb [--binary PATH] [--out DIR] [--lintian]`: the Debian package.
//!
//! Built with `dpkg-deb --build --root-owner-group` from the hand-written files in
//! `packaging/` (no debhelper: one binary package needs none of its machinery).
//! Without `--binary` it builds the release binary (eBPF programs embedded); with
//! it, that binary is packaged as it is, stripped (the tests package the debug
//! build). The version is the workspace's with Debian revision 1, the architecture
//! `dpkg --print-architecture`'s, `Depends` comes from `dpkg-shlibdeps` plus what
//! the maintainer scripts run. `--lintian` checks the result and fails on any error
//! or warning that `packaging/debian/lintian-overrides` does not explain.

use std::collections::BTreeSet;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, ensure, Context};

use crate::{cargo, ebpf, run};

/// The Debian revision appended to the workspace version.
const REVISION: &str = "1";

/// Files copied as they are: (source under `packaging/`, path in the package).
const FILES: &[(&str, &str)] = &[
    ("webship.service", "lib/systemd/system/webship.service"),
    ("webship.toml", "etc/webship/webship.toml"),
    ("html/index.html", "usr/share/webship/html/index.html"),
    ("sysusers.conf", "usr/lib/sysusers.d/webship.conf"),
    ("tmpfiles.conf", "usr/lib/tmpfiles.d/webship.conf"),
    ("debian/lintian-overrides", "usr/share/lintian/overrides/webship"),
];

/// Files stored compressed (`gzip -9n`, as Debian policy asks of manuals and long
/// documents): (source relative to the workspace root, path in the package).
const GZIPPED: &[(&str, &str)] = &[
    ("packaging/webship.1", "usr/share/man/man1/webship.1.gz"),
    ("README.md", "usr/share/doc/webship/README.md.gz"),
];

const SCRIPTS: &[&str] = &["postinst", "prerm", "postrm"];

/// Tools the build needs: (command, Debian package).
const TOOLS: &[(&str, &str)] = &[("dpkg-shlibdeps", "dpkg-dev"), ("strip", "binutils")];

pub(crate) fn deb(args: &[String]) -> anyhow::Result<()> {
    let options = Options::parse(args)?;
    crate::install_apt(TOOLS)?;
    if options.lintian {
        crate::install_apt(&[("lintian", "lintian")])?;
    }
    let root = ebpf::workspace_root()?;
    let binary = match &options.binary {
        Some(binary) => binary.clone(),
        None => {
            ebpf::build_ebpf()?;
            run(cargo().args(["build", "--release", "-p", "webship", "--bin", "webship"]))?;
            root.join("target/release/webship")
        }
    };
    let out = options.out.clone().unwrap_or_else(|| root.join("target/debian"));
    let deb = build(&root, &binary, &out)?;
    if options.lintian {
        lintian(&deb)?;
    }
    println!("{}", deb.display());
    Ok(())
}

#[derive(Debug, Default)]
struct Options {
    binary: Option<PathBuf>,
    out: Option<PathBuf>,
    lintian: bool,
}

impl Options {
    fn parse(args: &[String]) -> anyhow::Result<Self> {
        let mut options = Self::default();
        let mut args = args.iter();
        while let Some(arg) = args.next() {
            match arg.as_str() {
                "--binary" => options.binary = Some(args.next().context("--binary needs a PATH")?.into()),
                "--out" => options.out = Some(args.next().context("--out needs a DIR")?.into()),
                "--lintian" => options.lintian = true,
                other => bail!("unknown argument `{other}`; usage: cargo xtask deb [--binary PATH] [--out DIR] [--lintian]"),
            }
        }
        Ok(options)
    }
}

/// Assembles the package under `out/work` and builds `out/webship_VERSION_ARCH.deb`.
fn build(root: &Path, binary: &Path, out: &Path) -> anyhow::Result<PathBuf> {
    ensure!(binary.is_file(), "{} is not a file", binary.display());
    let version = format!("{}-{REVISION}", env!("CARGO_PKG_VERSION"));
    let arch = output(Command::new("dpkg").arg("--print-architecture"))?;
    // dpkg-shlibdeps wants the layout debhelper uses: debian/control beside
    // debian/PACKAGE/, the package's root.
    let work = out.join("work");
    if work.exists() {
        fs::remove_dir_all(&work).with_context(|| format!("cannot clear {}", work.display()))?;
    }
    let pkg = work.join("debian/webship");
    let packaging = root.join("packaging");

    let bin = pkg.join("usr/bin/webship");
    create_parent(&bin)?;
    run(Command::new("strip")
        .args([
            "--strip-unneeded",
            "--remove-section=.comment",
            "--remove-section=.note",
            "-o",
        ])
        .arg(&bin)
        .arg(binary))?;
    set_mode(&bin, 0o755)?;
    for (source, dest) in FILES {
        install(
            &fs::read(packaging.join(source)).with_context(|| format!("packaging/{source}"))?,
            &pkg.join(dest),
        )?;
    }
    for (source, dest) in GZIPPED {
        install(&gzip(&root.join(source))?, &pkg.join(dest))?;
    }
    let doc = pkg.join("usr/share/doc/webship");
    let copyright = read(&packaging.join("debian/copyright"))?.replace("@CRATES@", &crates(root)?);
    install(copyright.as_bytes(), &doc.join("copyright"))?;
    let changelog = read(&packaging.join("debian/changelog"))?
        .replace("@VERSION@", &version)
        .replace("@UPSTREAM@", &upstream(root))
        .replace("@DATE@", &changelog_date(root)?);
    let changelog_path = work.join("changelog.Debian");
    fs::write(&changelog_path, changelog)?;
    install(&gzip(&changelog_path)?, &doc.join("changelog.Debian.gz"))?;

    let control_dir = pkg.join("DEBIAN");
    for script in SCRIPTS {
        let dest = control_dir.join(script);
        install(&fs::read(packaging.join("debian").join(script))?, &dest)?;
        set_mode(&dest, 0o755)?;
    }
    // Everything under /etc is the administrator's once installed.
    let files = files_under(&pkg)?;
    let conffiles: String = files
        .iter()
        .filter(|f| f.starts_with("etc/"))
        .map(|f| format!("/{f}\n"))
        .collect();
    install(conffiles.as_bytes(), &control_dir.join("conffiles"))?;
    install(md5sums(&pkg, &files)?.as_bytes(), &control_dir.join("md5sums"))?;
    let control = read(&packaging.join("debian/control"))?
        .replace("@VERSION@", &version)
        .replace("@ARCH@", &arch)
        .replace("@INSTALLED_SIZE@", &installed_size(&pkg, &files)?.to_string())
        .replace("@SHLIBS@", &shlibs(&work)?);
    install(control.as_bytes(), &control_dir.join("control"))?;
    directory_modes(&pkg)?;

    let deb = out.join(format!("webship_{version}_{arch}.deb"));
    run(Command::new("dpkg-deb")
        .args(["--build", "--root-owner-group", "-Zxz"])
        .arg(&pkg)
        .arg(&deb))?;
    Ok(deb)
}

/// `lintian` on the package: any error or warning fails (overrides excepted).
fn lintian(deb: &Path) -> anyhow::Result<()> {
    run(Command::new("lintian")
        .args(["--fail-on", "error,warning", "--display-info"])
        .arg(deb))
}

/// The shared-library dependencies of the binary, as `dpkg-shlibdeps` finds them.
fn shlibs(work: &Path) -> anyhow::Result<String> {
    fs::write(
        work.join("debian/control"),
        "Source: webship\n\nPackage: webship\nArchitecture: any\n",
    )?;
    let line = output(Command::new("dpkg-shlibdeps").current_dir(work).args([
        "-O",
        "-e",
        "debian/webship/usr/bin/webship",
    ]))?;
    let deps = line
        .strip_prefix("shlibs:Depends=")
        .with_context(|| format!("dpkg-shlibdeps printed `{line}`"))?;
    ensure!(
        deps.contains("libc6"),
        "dpkg-shlibdeps found no libc6 dependency: `{deps}`"
    );
    Ok(deps.to_owned())
}

/// The crates linked into the binary: `cargo tree` over normal dependencies (not
/// build scripts, not proc macros, which run only at build time), as copyright
/// continuation lines "name version: license".
fn crates(root: &Path) -> anyhow::Result<String> {
    let tree = output(cargo().current_dir(root).args([
        "tree",
        "-p",
        "webship",
        "-e",
        "normal,no-proc-macro",
        "--prefix",
        "none",
        "--format",
        "{p}|{l}",
    ]))?;
    let mut lines = BTreeSet::new();
    for entry in tree.lines() {
        let entry = entry.trim_end_matches(" (*)");
        let Some((package, license)) = entry.split_once('|') else {
            continue;
        };
        // "name v1.2.3" or, for the workspace's own, "name v1.2.3 (/path)".
        let mut words = package.split_whitespace();
        let (Some(name), Some(version)) = (words.next(), words.next()) else {
            continue;
        };
        let version = version.trim_start_matches('v');
        let license = if license.is_empty() {
            "(not declared)"
        } else {
            license
        };
        lines.insert(format!(" {name} {version}: {license}"));
    }
    ensure!(!lines.is_empty(), "cargo tree listed no crates");
    Ok(lines.into_iter().collect::<Vec<_>>().join("\n"))
}

/// The commit the package is built from, or "an unknown commit" outside git.
fn upstream(root: &Path) -> String {
    output(
        Command::new("git")
            .current_dir(root)
            .args(["rev-parse", "--short=12", "HEAD"]),
    )
    .map_or_else(|_| "an unknown commit".into(), |c| format!("commit {c}"))
}

/// The changelog's date (RFC 2822): `SOURCE_DATE_EPOCH`, else the last commit's,
/// so the same tree gives the same package.
fn changelog_date(root: &Path) -> anyhow::Result<String> {
    let epoch = match std::env::var("SOURCE_DATE_EPOCH") {
        Ok(epoch) => epoch,
        Err(_) => output(
            Command::new("git")
                .current_dir(root)
                .args(["log", "-1", "--format=%ct"]),
        )
        .unwrap_or_else(|_| "0".into()),
    };
    output(
        Command::new("date")
            .env("LC_ALL", "C")
            .args(["-u", "-R", "-d"])
            .arg(format!("@{epoch}")),
    )
}

/// Files (not directories) under `pkg`, relative, sorted, `DEBIAN/` left out.
fn files_under(pkg: &Path) -> anyhow::Result<Vec<String>> {
    let mut out = Vec::new();
    let mut dirs = vec![pkg.to_owned()];
    while let Some(dir) = dirs.pop() {
        for entry in fs::read_dir(&dir)? {
            let path = entry?.path();
            if path.is_dir() {
                if path != pkg.join("DEBIAN") {
                    dirs.push(path);
                }
            } else {
                let rel = path
                    .strip_prefix(pkg)?
                    .to_str()
                    .context("a non-UTF-8 file name")?;
                out.push(rel.to_owned());
            }
        }
    }
    out.sort();
    Ok(out)
}

fn md5sums(pkg: &Path, files: &[String]) -> anyhow::Result<String> {
    let sums = output(Command::new("md5sum").current_dir(pkg).arg("--").args(files))?;
    Ok(sums + "\n")
}

/// KiB, each file rounded up, plus one per directory (what dpkg-gencontrol counts).
fn installed_size(pkg: &Path, files: &[String]) -> anyhow::Result<u64> {
    let mut kib = 0;
    let mut dirs = BTreeSet::new();
    for file in files {
        kib += fs::metadata(pkg.join(file))?.len().div_ceil(1024);
        let mut parent = Path::new(file).parent();
        while let Some(dir) = parent.filter(|d| !d.as_os_str().is_empty()) {
            dirs.insert(dir.to_owned());
            parent = dir.parent();
        }
    }
    Ok(kib + dirs.len() as u64)
}

/// `gzip -9n`: the best compression, and no name or time stamp in the header.
fn gzip(path: &Path) -> anyhow::Result<Vec<u8>> {
    let out = Command::new("gzip")
        .args(["-9n", "-c"])
        .arg(path)
        .output()
        .context("cannot run gzip")?;
    ensure!(out.status.success(), "gzip {} failed", path.display());
    Ok(out.stdout)
}

/// Writes a package file with mode 0644 (directories 0755), whatever the umask.
fn install(contents: &[u8], dest: &Path) -> anyhow::Result<()> {
    create_parent(dest)?;
    fs::write(dest, contents).with_context(|| format!("cannot write {}", dest.display()))?;
    set_mode(dest, 0o644)
}

fn create_parent(path: &Path) -> anyhow::Result<()> {
    let parent = path.parent().context("a path without a parent")?;
    fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))
}

/// Every directory of the package 0755, whatever the umask made them.
fn directory_modes(pkg: &Path) -> anyhow::Result<()> {
    let mut dirs = vec![pkg.to_owned()];
    while let Some(dir) = dirs.pop() {
        set_mode(&dir, 0o755)?;
        for entry in fs::read_dir(&dir)? {
            let path = entry?.path();
            if path.is_dir() {
                dirs.push(path);
            }
        }
    }
    Ok(())
}

fn set_mode(path: &Path, mode: u32) -> anyhow::Result<()> {
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .with_context(|| format!("cannot set the mode of {}", path.display()))
}

fn read(path: &Path) -> anyhow::Result<String> {
    fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))
}

/// A command's standard output, trimmed; a failure is an error with its stderr.
fn output(cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd.output().with_context(|| format!("cannot start {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed with {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8(out.stdout)?.trim().to_owned())
}
