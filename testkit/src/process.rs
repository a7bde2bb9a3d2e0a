//! Child processes under test — webship, nginx, the benchmark's peers and its own
//! client subcommands — each owned by a [`Process`] guard, so it is stopped on
//! every exit path, panics and errors included: SIGTERM first (every server here
//! finishes cleanly on it), SIGKILL for the whole process tree after a timeout.
//! Servers that run as tasks in the test's own runtime (the scripted origins) are
//! held by a [`Task`], aborted the same way when dropped.

use std::fmt;
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::ports::{free_port, listening};
use crate::proc::{descendants, status_kib};

/// How long a stopped process gets between SIGTERM and SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);
const POLL: Duration = Duration::from_millis(20);
/// How much of a log a failure message quotes.
const LOG_TAIL: usize = 8000;

/// Where a child's output goes; the same path twice means one file for both.
#[derive(Debug, Clone)]
pub struct Logs {
    pub stdout: PathBuf,
    pub stderr: PathBuf,
}

impl Logs {
    /// Standard output and standard error into one file.
    pub fn one(path: PathBuf) -> Self {
        Self {
            stdout: path.clone(),
            stderr: path,
        }
    }
}

/// When a started server counts as up.
#[derive(Debug, Clone, Copy)]
pub struct Ready<'a> {
    /// The loopback port that must accept TCP connections.
    pub port: u16,
    /// A fragment of a line the server logs (on stderr) once fully up: webship
    /// binds UDP for h3 after TCP, so an accepting TCP port alone is not enough.
    pub line: Option<&'a str>,
    pub within: Duration,
}

/// Why [`Process::wait_ready`] gave up.
#[derive(Debug)]
pub enum NotReady {
    Exited(ExitStatus),
    TimedOut,
}

impl fmt::Display for NotReady {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NotReady::Exited(status) => write!(f, "exited during startup ({status})"),
            NotReady::TimedOut => f.write_str("was not ready in time"),
        }
    }
}

/// A child process, stopped when dropped.
#[derive(Debug)]
pub struct Process {
    name: String,
    child: Child,
    logs: Logs,
}

impl Process {
    /// Starts `command` with no stdin and its output in `logs`.
    pub fn spawn(name: &str, command: &mut Command, logs: Logs) -> Result<Process> {
        let create = |path: &Path| File::create(path).with_context(|| format!("creating {}", path.display()));
        let stderr = create(&logs.stderr)?;
        let stdout = if logs.stdout == logs.stderr {
            stderr.try_clone().context("sharing the log file")?
        } else {
            create(&logs.stdout)?
        };
        command
            .stdin(Stdio::null())
            .stdout(Stdio::from(stdout))
            .stderr(Stdio::from(stderr));
        let child = command
            .spawn()
            .with_context(|| format!("starting {name}: {command:?}"))?;
        Ok(Process {
            name: name.to_owned(),
            child,
            logs,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything written to standard error so far (and standard output, when
    /// both go to one file).
    pub fn log(&self) -> String {
        fs::read_to_string(&self.logs.stderr).unwrap_or_default()
    }

    /// The last few thousand bytes of [`Process::log`], for failure messages.
    pub fn log_tail(&self) -> String {
        let log = self.log();
        let mut start = log.len().saturating_sub(LOG_TAIL);
        while !log.is_char_boundary(start) {
            start += 1;
        }
        log[start..].to_owned()
    }

    /// Everything written to standard output so far.
    pub fn stdout(&self) -> String {
        fs::read_to_string(&self.logs.stdout).unwrap_or_default()
    }

    /// The exit status, once the process has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Waits until `ready` holds, or the process exits, or the time is up.
    pub fn wait_ready(&mut self, ready: &Ready<'_>) -> Result<(), NotReady> {
        let deadline = Instant::now() + ready.within;
        while Instant::now() < deadline {
            if let Some(status) = self.exited() {
                return Err(NotReady::Exited(status));
            }
            let logged = ready.line.is_none_or(|line| self.log().contains(line));
            if logged && listening(ready.port) {
                return Ok(());
            }
            thread::sleep(POLL);
        }
        Err(NotReady::TimedOut)
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) -> Result<()> {
        signal("TERM", self.pid())
    }

    /// Waits up to `limit` for the process to exit.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Some(status) = self.exited() {
                return Some(status);
            }
            thread::sleep(POLL);
        }
        None
    }

    /// SIGTERM, then SIGKILL for the process and everything below it if it has
    /// not exited within 5 s.
    pub fn stop(&mut self) -> Result<()> {
        if self.exited().is_some() {
            return Ok(());
        }
        // Collected before signalling: once the parent is gone, orphans can no
        // longer be found through their ppid.
        let tree = descendants(self.pid());
        self.terminate()?;
        if self.wait_exit(STOP_TIMEOUT).is_some() {
            return Ok(());
        }
        eprintln!("{} ignored SIGTERM for {STOP_TIMEOUT:?}; killing it", self.name);
        for pid in tree {
            let _ = signal("KILL", pid);
        }
        self.child.kill().context("SIGKILL")?;
        self.child.wait().context("reaping")?;
        Ok(())
    }

    /// Resident memory, in bytes (VmRSS of this process alone).
    pub fn rss(&self) -> u64 {
        status_kib(self.pid(), "VmRSS:").map_or(0, |kib| kib * 1024)
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            eprintln!("stopping {} (pid {}): {e:#}", self.name, self.pid());
        }
    }
}

/// A server task on the current tokio runtime, aborted when dropped: the
/// in-process twin of [`Process`]. Whatever the task owns (its listener, a
/// `JoinSet` of connections) goes with it.
#[derive(Debug)]
pub struct Task(tokio::task::JoinHandle<()>);

impl Task {
    pub fn spawn(server: impl std::future::Future<Output = ()> + Send + 'static) -> Self {
        Self(tokio::spawn(server))
    }
}

impl Drop for Task {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// kill(1) rather than libc::kill: the workspace denies unsafe code outside webship's `sys/`.
fn signal(name: &str, pid: u32) -> Result<()> {
    let status = Command::new("kill")
        .args([format!("-{name}"), pid.to_string()])
        .stderr(Stdio::null())
        .status()
        .context("running kill(1)")?;
    if !status.success() {
        bail!("kill -{name} {pid} failed ({status})");
    }
    Ok(())
}

/// Starts a server on a port chosen here: `launch(port)` writes its configuration
/// and spawns it; then it must become ready (`line` logged and the port accepting
/// within `within`). A port taken between choosing it and binding it (another
/// test's ephemeral socket: the log says "Address already in use") is retried on a
/// fresh port, up to three times; that race is the harness's, not the server's.
pub fn start_on_free_port(
    line: Option<&str>,
    within: Duration,
    mut launch: impl FnMut(u16) -> Result<Process>,
) -> Result<(Process, u16)> {
    for _ in 0..3 {
        let port = free_port()?;
        let mut process = launch(port)?;
        match process.wait_ready(&Ready { port, line, within }) {
            Ok(()) => return Ok((process, port)),
            Err(NotReady::Exited(_)) if process.log().contains("Address already in use") => continue,
            Err(e) => bail!(
                "{} {e} on port {port}; log:\n{}",
                process.name(),
                process.log_tail()
            ),
        }
    }
    bail!("no free port could be bound in 3 tries")
}
