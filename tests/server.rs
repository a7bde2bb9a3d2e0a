//! The real `webship` binary, started on a free loopback port with a config written
//! to a temporary directory; stopped (SIGTERM, then SIGKILL) when dropped, by the
//! test kit's process guard.
//!
//! Every daemon [`Server::start`] starts writes a JSON access log into the test's
//! directory (unless its configuration has a `[log]` table of its own), and when the
//! server is dropped every line of it must parse and carry a status, a protocol and
//! a byte count ([`check_access_log`]): the access log of each request of the suite
//! is checked, and only a bad line fails a test that passed.
//!
//! A daemon's eBPF pin folder (`bpf_pin_dir`) goes with it: once the daemon has
//! stopped, the harness removes the folder if no process holds it (a daemon that
//! had to be killed leaves its pins), and the first start sweeps away the test and
//! bench folders killed runs left, pins included: those no process holds that are
//! older than a minute ([`webship_testkit::pins`]).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output};
use std::time::Duration;

pub use webship_testkit::ports::{free_port, listening, refused_port};
use webship_testkit::proc::{established, End};
use webship_testkit::process::{start_on_free_port, Logs, Process, Ready};
pub use webship_testkit::wait::eventually;

/// How long webship may take to listen.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// The binary under test, next to this test executable's `deps/` directory.
pub fn binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(Path::parent).unwrap();
    let bin = dir.join("webship");
    assert!(
        bin.exists(),
        "{} is missing: build it first (`cargo build -p webship`; `cargo xtask test` does)",
        bin.display()
    );
    bin
}

/// Runs `webship ARGS` to completion (for `check` and `preflight`).
pub fn webship(args: &[&str], cwd: &Path) -> Output {
    Command::new(binary())
        .args(args)
        .current_dir(cwd)
        .env("WEBSHIP_LOG", "info")
        .output()
        .unwrap()
}

pub struct Server {
    process: Process,
    pub port: u16,
    /// The JSON access log the harness turned on, checked on drop.
    access_log: Option<PathBuf>,
    /// The daemon's eBPF pin folder, removed on drop when nothing holds it.
    pins: Option<PathBuf>,
}

/// The `[log]` table the harness adds: a JSON access log per port in `dir`.
fn harness_log(dir: &Path) -> String {
    format!(
        "\n[log]\naccess = true\naccess_format = \"json\"\naccess_path = \"{}/access-{{port}}.json\"\n",
        dir.display()
    )
}

impl Server {
    /// Starts `webship serve --config <dir>/webship.toml` with `config`, in which the
    /// text `{port}` is replaced by a free port; waits until it accepts connections
    /// and has logged its start-up line (once its UDP side is ready too).
    pub fn start(dir: &Path, config: &str) -> Server {
        let path = dir.join("webship.toml");
        let logged = !config.contains("[log]");
        let config = match logged {
            true => format!("{config}{}", harness_log(dir)),
            false => config.to_owned(),
        };
        let (process, port) = start_on_free_port(Some("listening on"), START_TIMEOUT, |port| {
            std::fs::write(&path, config.replace("{port}", &port.to_string()))?;
            Self::launch(dir, &["serve", "--config", path.to_str().unwrap()], port)
        })
        .unwrap_or_else(|e| panic!("webship did not start: {e:#}"));
        let access_log = logged.then(|| dir.join(format!("access-{port}.json")));
        Server {
            process,
            port,
            access_log,
            pins: pins_of(&config.replace("{port}", &port.to_string())),
        }
    }

    fn launch(dir: &Path, args: &[&str], port: u16) -> anyhow::Result<Process> {
        static SWEEP: std::sync::Once = std::sync::Once::new();
        SWEEP.call_once(|| {
            webship_testkit::pins::sweep();
        });
        let mut command = Command::new(binary());
        command
            .args(args)
            .current_dir(dir)
            // `WEBSHIP_TEST_LOG` replaces the filter when a failure needs more, e.g.
            // `info,webship=debug,quinn_proto=trace` for every QUIC frame.
            .env(
                "WEBSHIP_LOG",
                std::env::var("WEBSHIP_TEST_LOG").unwrap_or_else(|_| "info,webship=debug".into()),
            );
        let logs = Logs {
            stdout: dir.join("stdout.log"),
            stderr: dir.join(format!("webship-{port}.log")),
        };
        Process::spawn("webship", &mut command, logs)
    }

    /// Starts `webship` with `args`, without waiting.
    pub fn spawn(dir: &Path, args: &[&str], port: u16) -> Server {
        let process = Self::launch(dir, args, port).unwrap_or_else(|e| panic!("{e:#}"));
        // The configuration named after `--config`, relative to `dir` or absolute.
        let config = args
            .iter()
            .position(|a| *a == "--config")
            .and_then(|i| args.get(i + 1))
            .and_then(|c| std::fs::read_to_string(dir.join(c)).ok());
        Server {
            process,
            port,
            access_log: None,
            pins: config.as_deref().and_then(pins_of),
        }
    }

    /// Starts `webship serve --config <config> --takeover` in `dir`, without waiting:
    /// a binary upgrade's successor to the daemon on `port`.
    pub fn take_over(dir: &Path, config: &Path, port: u16) -> Server {
        Self::spawn(
            dir,
            &["serve", "--config", config.to_str().unwrap(), "--takeover"],
            port,
        )
    }

    pub fn wait_listening(&mut self) {
        let ready = Ready {
            port: self.port,
            line: Some("listening on"),
            within: START_TIMEOUT,
        };
        if let Err(e) = self.process.wait_ready(&ready) {
            panic!("webship {e} on {}; log:\n{}", self.port, self.log());
        }
    }

    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    pub fn log(&self) -> String {
        self.process.log()
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        self.process.terminate().unwrap();
    }

    /// Waits up to `limit` for the process to exit.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        self.process.wait_exit(limit)
    }

    /// Resident memory of the server process, in bytes.
    pub fn rss(&self) -> u64 {
        self.process.rss()
    }

    /// Established TCP connections whose local end is this server's port, read from
    /// the kernel's socket table (no help from the server).
    pub fn established(&self) -> usize {
        established(self.port, End::Local)
    }

    /// The JSON access log the harness turned on (`None` when the test's own
    /// configuration has a `[log]` table, or the server was spawned by hand).
    pub fn access_log_path(&self) -> Option<&Path> {
        self.access_log.as_deref()
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }
}

/// The pin folder `config` names, if it is one of the harness's own.
fn pins_of(config: &str) -> Option<PathBuf> {
    webship_testkit::pins::pin_dir_of(config).map(Path::to_path_buf)
}

impl Drop for Server {
    fn drop(&mut self) {
        // Stopped first, so the daemon has written out what it queued and let go of
        // its pin folder.
        if let Err(e) = self.process.stop() {
            eprintln!("stopping webship on {}: {e:#}", self.port);
        }
        if let Some(pins) = &self.pins {
            webship_testkit::pins::remove_own(pins);
        }
        let Some(path) = self.access_log.take() else {
            return;
        };
        if std::thread::panicking() {
            return;
        }
        if let Err(e) = check_access_log(&path) {
            panic!("{e}");
        }
    }
}

/// Checks a JSON access log: every complete line is one object with a `status` in
/// 100..=599, a `protocol` of h1, h2 or h3 and a numeric `bytes`; returns the lines.
/// A missing file is no lines (a daemon that never started logging). A last line
/// without its newline (a daemon killed mid-write) is left out.
pub fn check_access_log(path: &Path) -> Result<Vec<serde_json::Value>, String> {
    let text = match std::fs::read(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("access log {}: {e}", path.display())),
    };
    let complete = match text.iter().rposition(|&b| b == b'\n') {
        Some(end) => &text[..=end],
        None => &[][..],
    };
    let mut lines = Vec::new();
    for (i, line) in complete.split(|&b| b == b'\n').enumerate() {
        if line.is_empty() {
            continue;
        }
        let bad = |why: &str| {
            format!(
                "access log {} line {}: {why}: {}",
                path.display(),
                i + 1,
                String::from_utf8_lossy(line)
            )
        };
        let value: serde_json::Value = serde_json::from_slice(line).map_err(|e| bad(&e.to_string()))?;
        let status = value["status"].as_u64().ok_or_else(|| bad("no numeric status"))?;
        if !(100..=599).contains(&status) {
            return Err(bad("status out of 100..=599"));
        }
        if !matches!(value["protocol"].as_str(), Some("h1" | "h2" | "h3")) {
            return Err(bad("protocol is not h1, h2 or h3"));
        }
        if value["bytes"].as_u64().is_none() {
            return Err(bad("bytes is not a number"));
        }
        lines.push(value);
    }
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use super::check_access_log;

    #[test]
    fn a_bad_line_fails_the_check_and_a_cut_last_line_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("access.json");
        let good = r#"{"status":200,"protocol":"h2","bytes":5}"#;
        std::fs::write(&path, format!("{good}\n{good}\n{{\"status\":2")).unwrap();
        assert_eq!(check_access_log(&path).unwrap().len(), 2);
        for bad in [
            r#"{"status":99,"protocol":"h1","bytes":0}"#,
            r#"{"status":200,"protocol":"h4","bytes":0}"#,
            r#"{"status":200,"protocol":"h1","bytes":"5"}"#,
            "127.0.0.1 - - [04/Dec/2026:15:18:30 +0000] \"GET / HTTP/1.1\" 200 5 \"-\" \"-\"",
        ] {
            std::fs::write(&path, format!("{good}\n{bad}\n")).unwrap();
            let e = check_access_log(&path).unwrap_err();
            assert!(e.contains("line 2"), "{e}");
        }
        assert!(check_access_log(&dir.path().join("none")).unwrap().is_empty());
    }
}
