//! Starting and stopping the servers under test.
//!
//! Each server is a child process owned by a [`Server`] guard, so it is
//! stopped on every exit path, errors included: SIGTERM first (both servers
//! finish cleanly on it), SIGKILL for the whole process tree after a timeout.

use std::fmt::Write as _;
use std::fs::{self, File};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::fixture::Identity;
use crate::proc::descendants;

const READY_TIMEOUT: Duration = Duration::from_secs(15);
const STOP_TIMEOUT: Duration = Duration::from_secs(5);
const POLL: Duration = Duration::from_millis(20);

#[derive(Debug)]
pub struct Server {
    pub name: &'static str,
    pub port: u16,
    child: Child,
    log: PathBuf,
    /// A log line fragment that appears once the server is fully up (Webship
    /// binds UDP for h3 after TCP, so an accepting TCP port is not enough).
    ready_line: Option<&'static str>,
}

impl Server {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits until the port accepts TCP connections, failing early with the
    /// server's log if it exits first.
    fn wait_ready(&mut self) -> Result<()> {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, self.port));
        let deadline = Instant::now() + READY_TIMEOUT;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "{} exited during startup ({status}); log:\n{}",
                    self.name,
                    self.log_tail()
                );
            }
            let logged = self.ready_line.is_none_or(|line| self.log().contains(line));
            if logged && TcpStream::connect_timeout(&addr, POLL).is_ok() {
                return Ok(());
            }
            thread::sleep(POLL);
        }
        bail!(
            "{} did not accept on {addr} within {READY_TIMEOUT:?}; log:\n{}",
            self.name,
            self.log_tail()
        )
    }

    /// Everything the server wrote to stdout and stderr so far.
    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn log_tail(&self) -> String {
        let log = self.log();
        let start = log.len().saturating_sub(4000);
        log.get(start..).unwrap_or(&log).to_owned()
    }

    fn stop(&mut self) -> Result<()> {
        if self.child.try_wait()?.is_some() {
            return Ok(());
        }
        // Collected before signalling: once the parent is gone, orphans can no
        // longer be found through their ppid.
        let tree = descendants(self.pid());
        signal("TERM", self.pid())?;
        let deadline = Instant::now() + STOP_TIMEOUT;
        while Instant::now() < deadline {
            if self.child.try_wait()?.is_some() {
                return Ok(());
            }
            thread::sleep(POLL);
        }
        eprintln!("{} ignored SIGTERM for {STOP_TIMEOUT:?}; killing it", self.name);
        for pid in tree {
            let _ = signal("KILL", pid);
        }
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            eprintln!("stopping {} (pid {}): {e:#}", self.name, self.pid());
        }
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

/// A loopback port that was free a moment ago. The server binds it right
/// after; a collision fails startup loudly rather than measuring the wrong thing.
fn free_port() -> Result<u16> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?.local_addr()?.port())
}

fn spawn(
    name: &'static str,
    mut command: Command,
    port: u16,
    log: PathBuf,
    ready_line: Option<&'static str>,
) -> Result<Server> {
    let log_file = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    command
        .stdin(Stdio::null())
        .stdout(log_file.try_clone()?)
        .stderr(log_file);
    let child = command
        .spawn()
        .with_context(|| format!("starting {name}: {command:?}"))?;
    let mut server = Server {
        name,
        port,
        child,
        log,
        ready_line,
    };
    server.wait_ready()?;
    Ok(server)
}

#[derive(Debug)]
pub struct Settings<'a> {
    pub root: &'a Path,
    pub identity: &'a Identity,
    pub workers: u32,
    /// Per-server scratch space: configs, logs, pid and temp files.
    pub dir: &'a Path,
}

/// One Webship instance: h1, h2 and h3 (UDP, same port), plus `[runtime.settings]`.
#[derive(Debug)]
pub struct WebshipSpec<'a> {
    pub name: &'static str,
    pub binary: &'a Path,
    pub ktls: &'a str,
    /// `[runtime.settings]` entries (name, value); Webship's defaults apply to the rest.
    pub runtime: Vec<(&'static str, String)>,
}

pub fn start_webship(spec: &WebshipSpec<'_>, s: &Settings<'_>) -> Result<Server> {
    let port = free_port()?;
    let config = s.dir.join("webship.toml");
    fs::write(&config, webship_config(spec, s, port))?;
    let mut command = Command::new(spec.binary);
    command.arg("serve").arg("--config").arg(&config);
    spawn(
        spec.name,
        command,
        port,
        s.dir.join("webship.log"),
        Some("listening on"),
    )
}

fn webship_config(spec: &WebshipSpec<'_>, s: &Settings<'_>, port: u16) -> String {
    let mut config = format!(
        "listen = \"127.0.0.1:{port}\"\nworkers = {workers}\nroot = {root:?}\n\n\
         [tls]\ncert = {cert:?}\nkey = {key:?}\n\n[kernel]\nktls = {ktls:?}\nbbr = \"auto\"\n",
        workers = s.workers,
        root = s.root,
        cert = s.identity.cert,
        key = s.identity.key,
        ktls = spec.ktls,
    );
    if !spec.runtime.is_empty() {
        config.push_str("\n[runtime.settings]\n");
        for (name, value) in &spec.runtime {
            let _ = writeln!(config, "{name} = {value:?}");
        }
    }
    config
}

pub fn start_nginx(binary: &Path, s: &Settings<'_>) -> Result<Server> {
    let port = free_port()?;
    let dir = s.dir.display();
    let mut conf = String::new();
    // One master plus `workers` workers, in the foreground so it stays our child.
    // Every path nginx writes is inside `dir`, so it runs beside a system nginx.
    writeln!(
        conf,
        "daemon off;\nmaster_process on;\nworker_processes {};",
        s.workers
    )?;
    writeln!(conf, "pid {dir}/nginx.pid;\nerror_log stderr warn;")?;
    writeln!(conf, "events {{ worker_connections 64; }}")?;
    writeln!(conf, "http {{")?;
    writeln!(
        conf,
        "  access_log off;\n  default_type application/octet-stream;"
    )?;
    writeln!(conf, "  sendfile on;\n  tcp_nopush on;")?;
    for temp in ["client_body", "proxy", "fastcgi", "uwsgi", "scgi"] {
        writeln!(conf, "  {temp}_temp_path {dir}/{temp}_temp;")?;
    }
    writeln!(conf, "  server {{")?;
    writeln!(conf, "    listen 127.0.0.1:{port} ssl http2;")?;
    writeln!(conf, "    ssl_certificate {};", s.identity.cert.display())?;
    writeln!(conf, "    ssl_certificate_key {};", s.identity.key.display())?;
    writeln!(conf, "    ssl_protocols TLSv1.3;\n    root {};", s.root.display())?;
    writeln!(conf, "  }}\n}}")?;
    let config = s.dir.join("nginx.conf");
    fs::write(&config, conf)?;

    let mut command = Command::new(binary);
    // -e: otherwise the compiled-in error log is opened before the config is read.
    command
        .arg("-p")
        .arg(s.dir)
        .arg("-c")
        .arg(&config)
        .args(["-e", "stderr"]);
    spawn("nginx", command, port, s.dir.join("nginx.log"), None)
}

/// "nginx 1.22" from `nginx -v`, for the cells nginx cannot serve.
pub fn nginx_version(binary: &Path) -> String {
    Command::new(binary)
        .arg("-v")
        .output()
        .ok()
        .and_then(|out| {
            // nginx prints "nginx version: nginx/1.22.1" on stderr.
            let text = String::from_utf8_lossy(&out.stderr).into_owned();
            let version = text.split("nginx/").nth(1)?.split_whitespace().next()?.to_owned();
            let major_minor: Vec<&str> = version.split('.').take(2).collect();
            Some(format!("nginx {}", major_minor.join(".")))
        })
        .unwrap_or_else(|| "nginx".to_owned())
}
