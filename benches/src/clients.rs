//! The download clients, both subcommands of this binary: `get` (hyper +
//! rustls) for h1 and h2 and for the plain-HTTP baseline, `h3-get` (quinn + h3)
//! for h3.
//!
//! Both run as child processes, so neither's CPU is counted as server CPU,
//! and both are charged the same way: the CPU of the waited-for child. Both
//! compare every body with the fixture as they read it, so every sample is
//! checked byte for byte.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use webship_testkit::body::FixtureCheck;
use webship_testkit::fixture::{EXACT, FIXTURE_LEN, FIXTURE_NAME};

use crate::proc::waited_children_ticks;
use crate::servers::Server;

/// Upper bound per download; at even 10 MiB/s the fixture takes 10 s.
const MAX_TIME: Duration = Duration::from_secs(120);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Protocol {
    H1,
    H2,
    H3,
}

impl Protocol {
    pub(crate) const ALL: [Protocol; 3] = [Protocol::H1, Protocol::H2, Protocol::H3];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Protocol::H1 => "h1",
            Protocol::H2 => "h2",
            Protocol::H3 => "h3",
        }
    }
}

/// One completed download that passed the size and status checks.
#[derive(Debug)]
pub(crate) struct Sample {
    pub size: u64,
    pub seconds: f64,
    /// Clock ticks the client process used (user + system).
    pub client_ticks: u64,
    /// The TLS version, cipher suite and ALPN (h1/h2), or the QUIC transport
    /// notes (h3: datagram sizes, RTT, socket buffer).
    pub notes: String,

    /// h3: datagrams the kernel dropped at the client's socket (receive buffer full).
    pub client_drops: Option<u64>,
}

/// How to reach each client.
#[derive(Debug)]
pub(crate) struct Clients {
    /// The certificate the clients trust (the only root).
    pub ca: PathBuf,
    /// This executable, which runs `get`, `h3-get` and `wt-get`.
    pub exe: PathBuf,
}

impl Clients {
    pub(crate) fn new(ca: &Path) -> Result<Self> {
        Ok(Self {
            ca: ca.to_owned(),
            exe: std::env::current_exe().context("locating this executable for its clients")?,
        })
    }

    /// Downloads the fixture once over `protocol`, plain HTTP/1.1 where the server
    /// speaks no TLS (the baseline). The client compares the body with the fixture
    /// byte for byte and drops it; `sha256` (the fixture's digest, hex) has it hashed
    /// too and the digest checked.
    pub(crate) fn download(
        &self,
        server: &Server,
        protocol: Protocol,
        sha256: Option<&str>,
    ) -> Result<Sample> {
        let path = format!("/{FIXTURE_NAME}");
        let scheme = if server.plain { "http" } else { "https" };
        let what = format!(
            "{} {} GET {scheme}://{}:{}{path}",
            server.name,
            protocol.label(),
            server.host,
            server.port
        );
        self.fetch(&Fetch {
            what,
            protocol,
            addr: format!("127.0.0.1:{}", server.port),
            // As before the `get` client existed, h3 always says `localhost`: the
            // proxies route `localhost`, and the direct servers take any name.
            host: if protocol == Protocol::H3 {
                "localhost"
            } else {
                server.host
            },
            path,
            len: FIXTURE_LEN,
            tls: !server.plain,
            sha256,
            max_time: MAX_TIME,
            netns: None,
        })
    }

    /// One download as `fetch` describes it, by a client child process.
    pub(crate) fn fetch(&self, fetch: &Fetch<'_>) -> Result<Sample> {
        let what = &fetch.what;
        let mut command = match fetch.netns {
            Some(netns) => {
                let mut nsenter = Command::new("nsenter");
                nsenter
                    .arg(format!("--net={}", netns.display()))
                    .arg("--")
                    .arg(&self.exe);
                nsenter
            }
            None => Command::new(&self.exe),
        };
        match fetch.protocol {
            Protocol::H3 => command.args(["h3-get", "--sni", fetch.host]),
            Protocol::H1 | Protocol::H2 => {
                command.args(["get", "--host", fetch.host, "--http", fetch.protocol.label()])
            }
        };
        command.args(["--addr", &fetch.addr, "--path", &fetch.path]);
        command.args(["--len", &fetch.len.to_string()]);
        if fetch.tls {
            command.arg("--ca").arg(&self.ca);
        }
        if fetch.sha256.is_some() {
            command.arg("--sha256");
        }
        command
            .args(["--max-time", &fetch.max_time.as_secs().max(1).to_string()])
            // A failure is reported in the bail below; a backtrace would bury it.
            .env("RUST_BACKTRACE", "0");
        let (output, client_ticks) = run_child(&mut command).context("running the client")?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        if !output.status.success() {
            bail!(
                "{what}: the client failed ({}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        let mut lines = stdout.lines();
        let (Some(head), Some(verdict), notes) = (lines.next(), lines.next(), lines.next()) else {
            bail!("{what}: unexpected client output {stdout:?}");
        };
        let fields: Vec<&str> = head.split_whitespace().collect();
        let [size, seconds, code] = fields[..] else {
            bail!("{what}: unexpected client output {stdout:?}");
        };
        let (size, seconds) = check(what, size, seconds, code, fetch.len)?;
        check_verdict(what, verdict, fetch.sha256)?;
        let notes = notes.unwrap_or("").trim();
        let client_drops = notes
            .split_whitespace()
            .find_map(|pair| pair.strip_prefix("client_socket_drops="))
            .and_then(|n| n.parse().ok());
        Ok(Sample {
            size,
            seconds,
            client_ticks,
            notes: if fetch.protocol == Protocol::H3 {
                format!("TLSv1.3 QUIC; {notes}")
            } else {
                notes.to_owned()
            },
            client_drops,
        })
    }
}

/// One client download: where, what, and what the body must be.
#[derive(Debug)]
pub(crate) struct Fetch<'a> {
    /// How errors name this download.
    pub what: String,
    pub protocol: Protocol,
    /// The server's address, `ip:port`.
    pub addr: String,
    /// The TLS server name and request authority.
    pub host: &'a str,
    pub path: String,
    /// The body must be the fixture's first `len` bytes.
    pub len: u64,
    /// HTTPS (the bench CA as the only root); plain HTTP/1.1 otherwise.
    pub tls: bool,
    pub sha256: Option<&'a str>,
    /// The client gives up after this long, handshake included.
    pub max_time: Duration,
    /// Runs the client in this network namespace (`nsenter --net`) instead of this one.
    pub netns: Option<&'a Path>,
}

/// What a client subcommand (`get`, `h3-get`) reports for one download.
#[derive(Debug)]
pub(crate) struct Download {
    pub status: u16,
    pub bytes: u64,
    pub seconds: f64,
    /// [`webship_testkit::body::FixtureCheck::verdict`].
    pub verdict: String,
    pub notes: String,
}

impl Download {
    /// A download whose body went through `check`, expecting the fixture's first `len` bytes.
    pub(crate) fn checked(
        status: http::StatusCode,
        seconds: f64,
        check: FixtureCheck,
        len: u64,
        notes: String,
    ) -> Self {
        Self {
            status: status.as_u16(),
            bytes: check.len(),
            seconds,
            verdict: check.verdict(len),
            notes,
        }
    }
}

/// Runs one client download on a current-thread runtime, bounded by `max_time`
/// seconds, and prints its result lines.
pub(crate) fn run_client(
    what: &str,
    max_time: u64,
    get: impl std::future::Future<Output = Result<Download>>,
) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("building the tokio runtime")?;
    let limit = std::time::Duration::from_secs(max_time);
    let got = runtime
        .block_on(async { tokio::time::timeout(limit, get).await })
        .map_err(|_| anyhow::anyhow!("{what}: no complete response within {limit:?}"))??;
    emit(&[
        &format!("{} {:.6} {}", got.bytes, got.seconds, got.status),
        &got.verdict,
        &got.notes,
    ])
}

/// The client's verdict line: the body must match the fixture byte for byte (the
/// right number of wrong bytes fails here) and, when `sha256` is asked for, hash to it.
fn check_verdict(what: &str, verdict: &str, sha256: Option<&str>) -> Result<()> {
    let verdict = verdict.trim();
    let digest = verdict.strip_prefix(EXACT).map(str::trim);
    match (digest, sha256) {
        (Some(""), None) => Ok(()),
        (Some(got), Some(want)) => {
            ensure!(
                got.strip_prefix("sha256=") == Some(want),
                "{what}: the body matched the fixture but hashed to {got:?}, expected sha256={want}"
            );
            Ok(())
        }
        _ => bail!("{what}: the body {verdict}"),
    }
}

/// Writes a client's result lines to stdout: an error (the runner went away and
/// closed the pipe) instead of `println!`'s panic.
pub(crate) fn emit(lines: &[&str]) -> Result<()> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    for line in lines {
        writeln!(out, "{line}").context("writing the result to stdout")?;
    }
    out.flush().context("writing the result to stdout")
}

/// Runs a client to completion and returns its output and the CPU ticks it used.
fn run_child(command: &mut Command) -> std::io::Result<(std::process::Output, u64)> {
    let before = waited_children_ticks();
    let output = command.output()?;
    Ok((output, waited_children_ticks().saturating_sub(before)))
}

/// The checks every sample must pass: status 200, the expected size, a positive time.
fn check(what: &str, size: &str, seconds: &str, code: &str, len: u64) -> Result<(u64, f64)> {
    let size: u64 = size.parse().with_context(|| format!("{what}: size {size:?}"))?;
    let seconds: f64 = seconds
        .parse()
        .with_context(|| format!("{what}: time {seconds:?}"))?;
    ensure!(code == "200", "{what}: status {code}, expected 200");
    ensure!(size == len, "{what}: received {size} bytes, expected {len}");
    ensure!(seconds > 0.0, "{what}: the client reported a time of {seconds} s");
    Ok((size, seconds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts() {
        assert!(check_verdict("x", "exact\n", None).is_ok());
        assert!(check_verdict("x", "exact sha256=ab", Some("ab")).is_ok());
        let wrong = check_verdict("x", "exact sha256=ab", Some("cd")).unwrap_err();
        assert!(wrong.to_string().contains("hashed to \"sha256=ab\""), "{wrong}");
        // A digest asked for but not reported, and a body that differs.
        assert!(check_verdict("x", "exact", Some("ab")).is_err());
        let differs = check_verdict("x", "differs from the fixture at byte 7 of 9", None).unwrap_err();
        assert!(differs
            .to_string()
            .ends_with("the body differs from the fixture at byte 7 of 9"));
        assert!(check_verdict("x", "9 bytes, expected 10", None).is_err());
        // A digest reported where none was asked for is not "exact".
        assert!(check_verdict("x", "exact sha256=ab", None).is_err());
    }
}
