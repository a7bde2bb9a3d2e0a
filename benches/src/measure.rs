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

pub fn run(args: &DownloadArgs) -> Result<()> {
    ensure!(
        args.webship.is_file(),
        "webship binary {} not found; build it with `cargo build --release -p webship` or pass --webship",
        args.webship.display()
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
    let (webship_dir, no_gso_dir, nginx_dir) = (dir("webship")?, dir("webship-no-gso")?, dir("nginx")?);
    let settings = |dir| Settings {
        root,
        identity: &identity,
        workers: args.workers,
        dir,
    };
    let webship = servers::start_webship(&webship_spec(args, WEBSHIP, true), &settings(&webship_dir))?;
    ensure_h3(&webship)?;
    let nginx = servers::start_nginx(&args.nginx, &settings(&nginx_dir))?;
    let start_no_gso = || -> Result<Server> {
        let server =
            servers::start_webship(&webship_spec(args, WEBSHIP_NO_GSO, false), &settings(&no_gso_dir))?;
        ensure_h3(&server)?;
        Ok(server)
    };

    // One checked download per cell first; it also warms the page cache and
    // the servers so the first timed sample is not an outlier.
    let mut series = Vec::new();
    for protocol in Protocol::ALL {
        for server in [&webship, &nginx] {
            if serves(server, protocol) {
                series.push(bench.verify(server, protocol)?);
            }
        }
    }
    {
        let no_gso = start_no_gso()?;
        series.push(bench.verify(&no_gso, Protocol::H3)?);
    }

    for round in 0..args.samples {
        for protocol in Protocol::ALL {
            // Started afresh for each round's h3 cells, stopped right after them.
            let no_gso = match protocol {
                Protocol::H3 => Some(start_no_gso()?),
                Protocol::H1 | Protocol::H2 => None,
            };
            let mut pair: Vec<&Server> = [&webship, &nginx]
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
                    .find(|s| s.server == server.name && s.protocol == protocol)
                    .context("every cell was verified before sampling")?;
                bench.sample(server, protocol, entry)?;
                eprintln!(
                    "round {}/{} {} {}: {:.1} MiB/s",
                    round + 1,
                    args.samples,
                    server.name,
                    protocol.label(),
                    entry.mib_s.last().copied().unwrap_or(0.0)
                );
            }
        }
    }
    // Read late: the line may be logged just after the port starts accepting.
    let webship_kernel = kernel_summary(&webship.log());
    drop(nginx);
    drop(webship);

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
    fn verify(&self, server: &Server, protocol: Protocol) -> Result<Series> {
        let to = self
            .scratch
            .join(format!("check-{}-{}.bin", server.port, protocol.label()));
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
        Ok(Series::new(server.name, protocol, sample.notes))
    }

    /// One timed download, its server CPU and client CPU added to `series`.
    fn sample(&self, server: &Server, protocol: Protocol, series: &mut Series) -> Result<()> {
        let drops_before = udp_socket_drops(server.port);
        let before = cpu_ticks(server.pid());
        let sample: Sample = self
            .clients
            .download(server, protocol, Path::new("/dev/null"), false)?;
        let after = cpu_ticks(server.pid());
        if let Some(digest) = &sample.sha256 {
            self.check_digest(server, protocol, digest)?;
        }
        series.add(&sample, after.saturating_sub(before));
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
