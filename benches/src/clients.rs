//! The download clients: curl for h1 and h2, `h3-get` (this binary) for h3.
//!
//! Both run as child processes, so neither's CPU is counted as server CPU,
//! and both are charged the same way: the CPU of the waited-for child.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};

use crate::fixture::{FIXTURE_BYTES, FIXTURE_NAME};
use crate::proc::waited_children_ticks;
use crate::servers::Server;

/// Upper bound per download; at even 10 MiB/s the fixture takes 10 s.
const MAX_TIME: Duration = Duration::from_secs(120);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    H1,
    H2,
    H3,
}

impl Protocol {
    pub const ALL: [Protocol; 3] = [Protocol::H1, Protocol::H2, Protocol::H3];

    pub fn label(self) -> &'static str {
        match self {
            Protocol::H1 => "h1",
            Protocol::H2 => "h2",
            Protocol::H3 => "h3",
        }
    }
}

/// One completed download that passed the size and status checks.
#[derive(Debug)]
pub struct Sample {
    pub size: u64,
    pub seconds: f64,
    /// Clock ticks the client process used (user + system).
    pub client_ticks: u64,
    /// h1/h2 with `verbose`: the TLS version and cipher curl negotiated.
    /// h3: the client's transport notes (datagram sizes, RTT, socket buffer).
    pub notes: String,
    /// The body digest, where the client computes it (h3-get always does).
    pub sha256: Option<String>,
    /// h3: datagrams the kernel dropped at the client's socket (receive buffer full).
    pub client_drops: Option<u64>,
}

/// How to reach each client.
#[derive(Debug)]
pub struct Clients {
    /// The certificate h3-get trusts (curl runs with -k, as before).
    pub ca: PathBuf,
    /// This executable, which runs `h3-get`.
    pub h3_get: PathBuf,
}

impl Clients {
    pub fn new(ca: &Path) -> Result<Self> {
        Ok(Self {
            ca: ca.to_owned(),
            h3_get: std::env::current_exe().context("locating this executable for h3-get")?,
        })
    }

    /// Downloads the fixture once. curl writes the body to `to`; h3-get hashes
    /// and drops it, so `to` is unused there. `verbose` asks curl for its TLS line.
    pub fn download(&self, server: &Server, protocol: Protocol, to: &Path, verbose: bool) -> Result<Sample> {
        match protocol {
            Protocol::H1 | Protocol::H2 => curl(server, protocol, to, verbose),
            Protocol::H3 => self.h3_get(server),
        }
    }

    fn h3_get(&self, server: &Server) -> Result<Sample> {
        let addr = format!("127.0.0.1:{}", server.port);
        let path = format!("/{FIXTURE_NAME}");
        let what = format!("{} h3 GET https://{addr}{path}", server.name);
        let mut command = Command::new(&self.h3_get);
        command
            .args(["h3-get", "--addr", &addr, "--sni", "localhost", "--path", &path])
            .arg("--ca")
            .arg(&self.ca)
            .args(["--max-time", &MAX_TIME.as_secs().to_string()])
            // A failure is reported in the bail below; a backtrace would bury it.
            .env("RUST_BACKTRACE", "0");
        let (output, client_ticks) = run_child(&mut command).context("running h3-get")?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        if !output.status.success() {
            bail!(
                "{what}: h3-get failed ({}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        let mut lines = stdout.lines();
        let (Some(head), Some(digest), notes) = (lines.next(), lines.next(), lines.next()) else {
            bail!("{what}: unexpected h3-get output {stdout:?}");
        };
        let fields: Vec<&str> = head.split_whitespace().collect();
        let [size, seconds, code] = fields[..] else {
            bail!("{what}: unexpected h3-get output {stdout:?}");
        };
        let (size, seconds) = check(&what, size, seconds, code)?;
        let notes = notes.unwrap_or("").trim();
        let client_drops = notes
            .split_whitespace()
            .find_map(|pair| pair.strip_prefix("client_socket_drops="))
            .and_then(|n| n.parse().ok());
        Ok(Sample {
            size,
            seconds,
            client_ticks,
            notes: format!("TLSv1.3 QUIC; {notes}"),
            sha256: Some(digest.trim().to_owned()),
            client_drops,
        })
    }
}

fn curl(server: &Server, protocol: Protocol, to: &Path, verbose: bool) -> Result<Sample> {
    let (flag, version) = match protocol {
        Protocol::H1 => ("--http1.1", "1.1"),
        Protocol::H2 => ("--http2", "2"),
        Protocol::H3 => bail!("curl on this host has no HTTP/3; h3 goes through h3-get"),
    };
    let url = format!("https://{}:{}/{FIXTURE_NAME}", server.host, server.port);
    let mut command = Command::new("curl");
    if server.host != "127.0.0.1" {
        // A name (the proxies route `localhost`) resolved without asking the system.
        command
            .arg("--resolve")
            .arg(format!("{}:{}:127.0.0.1", server.host, server.port));
    }
    command
        .args(["-sk", if verbose { "-v" } else { "-S" }, flag])
        .args(["--max-time", &MAX_TIME.as_secs().to_string()])
        .arg("-o")
        .arg(to)
        .args([
            "-w",
            "%{size_download} %{time_total} %{http_code} %{http_version}",
            &url,
        ]);
    let (output, client_ticks) = run_child(&mut command).context("running curl")?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let what = format!("{} {} GET {url}", server.name, protocol.label());
    if !output.status.success() {
        bail!(
            "{what}: curl failed ({}): {stdout} {}",
            output.status,
            stderr.trim()
        );
    }

    let fields: Vec<&str> = stdout.split_whitespace().collect();
    let [size, seconds, code, spoken] = fields[..] else {
        bail!("{what}: unexpected curl -w output {stdout:?}");
    };
    let (size, seconds) = check(&what, size, seconds, code)?;
    // Checked so that a silent ALPN fallback to HTTP/1.1 cannot pass as an h2 result.
    ensure!(
        spoken == version,
        "{what}: curl spoke HTTP/{spoken}, expected HTTP/{version}"
    );

    let notes = stderr
        .lines()
        .find_map(|line| line.strip_prefix("* SSL connection using "))
        .unwrap_or("unknown")
        .trim()
        .to_owned();
    Ok(Sample {
        size,
        seconds,
        client_ticks,
        notes,
        sha256: None,
        client_drops: None,
    })
}

/// Runs a client to completion and returns its output and the CPU ticks it used.
fn run_child(command: &mut Command) -> std::io::Result<(std::process::Output, u64)> {
    let before = waited_children_ticks();
    let output = command.output()?;
    Ok((output, waited_children_ticks().saturating_sub(before)))
}

/// The checks every sample must pass: status 200, the exact fixture size, a positive time.
fn check(what: &str, size: &str, seconds: &str, code: &str) -> Result<(u64, f64)> {
    let size: u64 = size.parse().with_context(|| format!("{what}: size {size:?}"))?;
    let seconds: f64 = seconds
        .parse()
        .with_context(|| format!("{what}: time {seconds:?}"))?;
    ensure!(code == "200", "{what}: status {code}, expected 200");
    ensure!(
        size == FIXTURE_BYTES,
        "{what}: received {size} bytes, expected {FIXTURE_BYTES}"
    );
    ensure!(seconds > 0.0, "{what}: the client reported a time of {seconds} s");
    Ok((size, seconds))
}
