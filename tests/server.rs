//! The real `webship` binary, started on a free loopback port with a config written
//! to a temporary directory; stopped (SIGTERM, then SIGKILL) when dropped, by the
//! test kit's process guard.

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
}

impl Server {
    /// Starts `webship serve --config <dir>/webship.toml` with `config`, in which the
    /// text `{port}` is replaced by a free port; waits until it accepts connections
    /// and has logged its start-up line (once its UDP side is ready too).
    pub fn start(dir: &Path, config: &str) -> Server {
        let path = dir.join("webship.toml");
        let (process, port) = start_on_free_port(Some("listening on"), START_TIMEOUT, |port| {
            std::fs::write(&path, config.replace("{port}", &port.to_string()))?;
            Self::launch(dir, &["serve", "--config", path.to_str().unwrap()], port)
        })
        .unwrap_or_else(|e| panic!("webship did not start: {e:#}"));
        Server { process, port }
    }

    fn launch(dir: &Path, args: &[&str], port: u16) -> anyhow::Result<Process> {
        let mut command = Command::new(binary());
        command
            .args(args)
            .current_dir(dir)
            .env("WEBSHIP_LOG", "info,webship=debug");
        let logs = Logs {
            stdout: dir.join("stdout.log"),
            stderr: dir.join(format!("webship-{port}.log")),
        };
        Process::spawn("webship", &mut command, logs)
    }

    /// Starts `webship` with `args`, without waiting.
    pub fn spawn(dir: &Path, args: &[&str], port: u16) -> Server {
        let process = Self::launch(dir, args, port).unwrap_or_else(|e| panic!("{e:#}"));
        Server { process, port }
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

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }
}
