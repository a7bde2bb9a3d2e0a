//! The `download` benchmark: Webship against nginx, same host, same run.
//!
//! Cells are (server, protocol): Webship over h1, h2 and h3; nginx over h1 and
//! h2 (Debian's nginx 1.22 has no HTTP/3); and a second Webship with UDP GSO
//! off over h3, started only for its h3 cells in each round so it never sits
//! beside the other measurements. Servers are measured in interleaved order
//! (alternating which goes first in each round) so that thermal or background
//! drift lands on both equally. Every sample must deliver the exact fixture
//! size with status 200 over the requested protocol; h1/h2 bodies are checked
//! byte for byte by digest once per cell, h3 bodies on every sample (h3-get
//! hashes as it reads). Anything else aborts the run.
//!
//! `--modes` picks direct delivery (the cells above), proxy mode, or both in one
//! run. In proxy mode each server terminates TLS in front of the same origin, a
//! third nginx serving the fixture over plain HTTP on loopback: Webship over h1
//! (hyper), h2 and h3 on one port, nginx over h1 and h2. Its cells are checked
//! like the direct ones; server CPU is the proxy's, the origin's is reported
//! apart. The rounds interleave the modes too, so proxy/direct ratios compare
//! samples taken side by side.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};

use crate::clients::{Clients, Protocol, Sample};
use crate::fixture::{self, Fixture};
use crate::proc::{clock_ticks_per_second, cpu_ticks, udp_socket_drops};
use crate::report::{Report, Series};
use crate::servers::{self, Server, Settings, WebshipSpec};
use crate::DownloadArgs;

pub const WEBSHIP: &str = "webship";
pub const WEBSHIP_NO_GSO: &str = "webship gso=off";
pub const NGINX: &str = "nginx";

/// What the servers under test do with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum Mode {
    /// Each server sends the fixture from its own disk.
    Direct,
    /// Each server terminates TLS and relays the fixture from a plain-HTTP origin
    /// (a separate nginx on loopback); only the proxy's CPU is its server CPU.
    Proxy,
}

impl Mode {
    pub fn label(self) -> &'static str {
        match self {
            Mode::Direct => "direct",
            Mode::Proxy => "proxy",
        }
    }
}

/// The servers of one mode. The GSO-off Webship (direct only) is started per round.
struct ModeServers {
    mode: Mode,
    webship: Server,
    nginx: Server,
    /// Proxy mode: the origin both proxies forward to, its CPU reported apart.
    origin: Option<Server>,
}

pub fn run(args: &DownloadArgs) -> Result<()> {
    ensure!(
        args.webship.is_file(),
        "webship binary {} not found; build it with `cargo build --release -p webship` or pass --webship",
        args.webship.display()
    );
    let mut modes = args.modes.clone();
    modes.sort();
    modes.dedup();
    ensure!(
        !modes.is_empty(),
        "--modes names no mode; use direct, proxy or both"
    );
    let cache = args
        .cache_dir
        .clone()
        .unwrap_or_else(|| env::temp_dir().join("webship-benches"));
    let fixture = fixture::ensure(&cache.join("root"))?;
    let root = fixture.path.parent().context("fixture has no parent directory")?;

    let scratch = tempfile::Builder::new().prefix("webship-bench-").tempdir()?;
    let identity = fixture::write_identity(scratch.path())?;
    let clients = Clients::new(&identity.cert)?;
    let bench = Bench {
        args,
        fixture: &fixture,
        clients: &clients,
        scratch: scratch.path(),
    };

    let dir = |name: &str| -> Result<PathBuf> {
        let dir = scratch.path().join(name);
        fs::create_dir(&dir)?;
        Ok(dir)
    };
    let no_gso_dir = dir("webship-no-gso")?;
    // Per mode: the Webship, nginx and (proxy mode) origin directories.
    let mut dirs = Vec::new();
    for &mode in &modes {
        dirs.push(match mode {
            Mode::Direct => [dir("webship")?, dir("nginx")?, PathBuf::new()],
            Mode::Proxy => [dir("webship-proxy")?, dir("nginx-proxy")?, dir("origin-nginx")?],
        });
    }
    let settings = |dir| Settings {
        root,
        identity: &identity,
        workers: args.workers,
        dir,
    };
    let mut sets = Vec::new();
    for (&mode, [webship_dir, nginx_dir, origin_dir]) in modes.iter().zip(&dirs) {
        sets.push(match mode {
            Mode::Direct => {
                let webship =
                    servers::start_webship(&webship_spec(args, WEBSHIP, true), &settings(webship_dir))?;
                ensure_h3(&webship)?;
                let nginx = servers::start_nginx(&args.nginx, &settings(nginx_dir))?;
                ModeServers {
                    mode,
                    webship,
                    nginx,
                    origin: None,
                }
            }
            Mode::Proxy => {
                let origin = servers::start_origin(&args.nginx, root, origin_dir)?;
                let webship = servers::start_webship_proxy(
                    &webship_spec(args, WEBSHIP, true),
                    &settings(webship_dir),
                    origin.port,
                )?;
                ensure_h3(&webship)?;
                let nginx = servers::start_nginx_proxy(&args.nginx, &settings(nginx_dir), origin.port)?;
                ModeServers {
                    mode,
                    webship,
                    nginx,
                    origin: Some(origin),
                }
            }
        });
    }
    let start_no_gso = || -> Result<Server> {
        let server =
            servers::start_webship(&webship_spec(args, WEBSHIP_NO_GSO, false), &settings(&no_gso_dir))?;
        ensure_h3(&server)?;
        Ok(server)
    };

    // One checked download per cell first; it also warms the page cache and
    // the servers so the first timed sample is not an outlier.
    let mut series = Vec::new();
    for set in &sets {
        for protocol in Protocol::ALL {
            for server in [&set.webship, &set.nginx] {
                if serves(server, protocol) {
                    series.push(bench.verify(set.mode, server, protocol)?);
                }
            }
        }
        if set.mode == Mode::Direct {
            let no_gso = start_no_gso()?;
            series.push(bench.verify(set.mode, &no_gso, Protocol::H3)?);
        }
    }

    for round in 0..args.samples {
        for set in &sets {
            for protocol in Protocol::ALL {
                // Started afresh for each round's h3 cells, stopped right after them.
                let no_gso = match (set.mode, protocol) {
                    (Mode::Direct, Protocol::H3) => Some(start_no_gso()?),
                    _ => None,
                };
                let mut pair: Vec<&Server> = [&set.webship, &set.nginx]
                    .into_iter()
                    .chain(no_gso.as_ref())
                    .filter(|server| serves(server, protocol))
                    .collect();
                if round % 2 == 1 {
                    pair.reverse();
                }
                for server in pair {
                    let entry = series
                        .iter_mut()
                        .find(|s| s.mode == set.mode && s.server == server.name && s.protocol == protocol)
                        .context("every cell was verified before sampling")?;
                    bench.sample(server, set.origin.as_ref(), protocol, entry)?;
                    eprintln!(
                        "round {}/{} {} {} {}: {:.1} MiB/s",
                        round + 1,
                        args.samples,
                        set.mode.label(),
                        server.name,
                        protocol.label(),
                        entry.mib_s.last().copied().unwrap_or(0.0)
                    );
                }
            }
        }
    }
    // Read late: the line may be logged just after the port starts accepting.
    let webship_kernel = sets
        .first()
        .map_or_else(|| "unknown".to_owned(), |set| kernel_summary(&set.webship.log()));
    drop(sets);

    let report = Report {
        series,
        ticks_per_s: clock_ticks_per_second(),
        samples: args.samples,
        workers: args.workers,
        h3_mtu: args.h3_mtu,
        webship_kernel,
        nginx_version: servers::nginx_version(&args.nginx),
    };
    print!("{}", report.markdown());
    if let Some(out) = &args.out {
        fs::write(out, report.json()).with_context(|| format!("writing {}", out.display()))?;
        eprintln!("wrote {}", out.display());
    }
    Ok(())
}

/// Webship announces its UDP listener in the "listening on" line; without it
/// the h3 cells would measure a connection timeout.
fn ensure_h3(server: &Server) -> Result<()> {
    ensure!(
        server.log().contains("udp for h3"),
        "{} did not announce HTTP/3 (udp) on port {}; log:\n{}",
        server.name,
        server.port,
        server.log()
    );
    Ok(())
}

/// Which cells exist: nginx (1.22, as packaged) is not configured for HTTP/3,
/// and the GSO-off Webship is there only for the h3 comparison.
fn serves(server: &Server, protocol: Protocol) -> bool {
    match server.name {
        NGINX => protocol != Protocol::H3,
        WEBSHIP_NO_GSO => protocol == Protocol::H3,
        _ => true,
    }
}

fn webship_spec<'a>(args: &'a DownloadArgs, name: &'static str, gso: bool) -> WebshipSpec<'a> {
    let mut runtime = Vec::new();
    // Only what differs from Webship's defaults is written, so the default
    // instance runs on exactly the configuration users get.
    if !gso {
        runtime.push(("h3_gso", "0".to_owned()));
    }
    if let Some(mtu) = args.h3_mtu {
        runtime.push(("h3_mtu_upper_bound_bytes", mtu.to_string()));
    }
    WebshipSpec {
        name,
        binary: &args.webship,
        ktls: &args.ktls,
        runtime,
    }
}

struct Bench<'a> {
    args: &'a DownloadArgs,
    fixture: &'a Fixture,
    clients: &'a Clients,
    scratch: &'a Path,
}

impl Bench<'_> {
    /// Downloads the fixture once, untimed, and compares digests: size and status
    /// alone would miss a server that sends the right number of wrong bytes.
    fn verify(&self, mode: Mode, server: &Server, protocol: Protocol) -> Result<Series> {
        let to = self
            .scratch
            .join(format!("check-{}-{}.bin", server.port, protocol.label()));
        let checked = || -> Result<Sample> {
            let sample = self.clients.download(server, protocol, &to, true)?;
            let digest = match &sample.sha256 {
                Some(digest) => digest.clone(),
                None => {
                    let digest = fixture::file_digest(&to)?;
                    fs::remove_file(&to)?;
                    fixture::hex(&digest)
                }
            };
            self.check_digest(server, protocol, &digest)?;
            Ok(sample)
        };
        let sample = checked().with_context(|| failed(mode, server, protocol))?;
        Ok(Series::new(mode, server.name, protocol, sample.notes))
    }

    /// One timed download, its server CPU (the proxy's alone in proxy mode), the
    /// origin's CPU and the client's CPU added to `series`.
    fn sample(
        &self,
        server: &Server,
        origin: Option<&Server>,
        protocol: Protocol,
        series: &mut Series,
    ) -> Result<()> {
        let drops_before = udp_socket_drops(server.port);
        let origin_before = origin.map(|o| cpu_ticks(o.pid()));
        let before = cpu_ticks(server.pid());
        let timed = || -> Result<Sample> {
            let sample = self
                .clients
                .download(server, protocol, Path::new("/dev/null"), false)?;
            if let Some(digest) = &sample.sha256 {
                self.check_digest(server, protocol, digest)?;
            }
            Ok(sample)
        };
        let sample = timed().with_context(|| failed(series.mode, server, protocol))?;
        let after = cpu_ticks(server.pid());
        let origin_ticks = origin
            .zip(origin_before)
            .map(|(o, before)| cpu_ticks(o.pid()).saturating_sub(before));
        series.add(&sample, after.saturating_sub(before), origin_ticks);
        if protocol == Protocol::H3 {
            // The server's UDP socket lives across samples, so its counter is read as a difference.
            let server_drops = udp_socket_drops(server.port)
                .zip(drops_before)
                .map(|(after, before)| after.saturating_sub(before));
            series.add_udp_drops(sample.client_drops, server_drops);
        }
        Ok(())
    }

    fn check_digest(&self, server: &Server, protocol: Protocol, digest: &str) -> Result<()> {
        let expected = fixture::hex(&self.fixture.sha256);
        ensure!(
            digest == expected,
            "{} {} (workers {}): body SHA-256 {digest} differs from fixture {expected}",
            server.name,
            protocol.label(),
            self.args.workers,
        );
        Ok(())
    }
}

/// The context of a failed download: the cell and what the server logged last.
fn failed(mode: Mode, server: &Server, protocol: Protocol) -> String {
    format!(
        "{} {} {} (port {}) failed; server log tail:\n{}",
        mode.label(),
        server.name,
        protocol.label(),
        server.port,
        server.log_tail()
    )
}

/// The `preflight: ...` part of Webship's "listening on" log line.
fn kernel_summary(log: &str) -> String {
    log.lines()
        .filter(|line| line.contains("listening on"))
        .find_map(|line| line.split("preflight: ").nth(1))
        .and_then(|rest| rest.split([';', ')']).next())
        .unwrap_or("unknown")
        .trim()
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_summary_from_log() {
        let log = "x INFO preflight: ktls [auto] missing\n\
                   y INFO listening on https://127.0.0.1:1 (workers 1; preflight: ktls=missing bbr=yes; h3 off)\n";
        assert_eq!(kernel_summary(log), "ktls=missing bbr=yes");
        assert_eq!(kernel_summary(""), "unknown");
    }
}
