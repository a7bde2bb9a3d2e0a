//! The `download` benchmark: the capacity matrix, Webship against its peers in
//! the same run.
//!
//! Cells are (mode, server, protocol). Modes: direct (each server sends the
//! fixture from its own disk), proxy (each terminates TLS in front of one
//! plain-HTTP nginx origin) and passthrough (each routes TLS by SNI to one
//! Webship origin without decrypting); servers: Webship (and its passthrough
//! engines, and a GSO-off instance for h3, started per round so it never sits
//! beside the other measurements) and the peers installed here, each cell a peer
//! cannot have named with the reason. Every run also measures the limit on this
//! machine ([`Mode::Limit`]): the same client against a plain-HTTP sendfile server
//! and against a TLS server sending from memory.
//!
//! Each cell is first downloaded once, untimed (warm-up, TLS parameters), then
//! sampled in interleaved rounds (rotating which server goes first) until it has
//! the requested accepted samples, so drift lands on every cell alike. A sample is
//! accepted only with status 200 and exactly the fixture's bytes (the clients
//! compare every body with the fixture generator as they read it), no packet loss
//! on the host and no major page fault in the server; rejections are counted with
//! their reasons, and the rounds are bounded. A Webship or limit cell without an
//! accepted sample fails the run; a peer's becomes "not measured". After the
//! matrix, the concurrency and WebTransport scenarios run into the same report.

use std::env;
use std::fs;
use std::path::Path;

use anyhow::{ensure, Context, Result};
use webship_testkit::fixture::hex;

use crate::clients::{Clients, Protocol};
use crate::concurrency::ConcurrencyArgs;
use crate::connections::ConnectionsArgs;
use crate::peers;
use crate::proc::{
    clock_ticks_per_second, cpu_ticks, host_busy_ticks, major_faults, udp_socket_drops, Loss, RssWatch,
};
use crate::report::{Gap, Report, Section, Series};
use crate::servers::{self, Server, Settings, Stage, WebshipSpec};
use crate::wtbench::WtBenchArgs;
use crate::DownloadArgs;

pub(crate) const WEBSHIP: &str = "webship";
pub(crate) const WEBSHIP_NO_GSO: &str = "webship gso=off";
/// `--scrape`: Webship with its admin listener, `/metrics` fetched every second.
pub(crate) const WEBSHIP_SCRAPED: &str = "webship scraped";
/// Passthrough with a named engine (plain `webship` runs `auto`).
pub(crate) const WEBSHIP_SOCKMAP: &str = "webship sockmap";
pub(crate) const WEBSHIP_SPLICE: &str = "webship splice";
pub(crate) const WEBSHIP_COPY: &str = "webship copy";
/// Passthrough h3 relayed by the daemon (plain `webship` uses the eBPF redirect
/// where it applies, as it does here on loopback).
pub(crate) const WEBSHIP_UDP_RELAY: &str = "webship udp=userspace";
/// The passthrough origin: Webship serving the fixture directly over h1/h2/h3.
pub(crate) const ORIGIN_WEBSHIP: &str = "origin webship";
/// The baselines of [`Mode::Limit`].
pub(crate) const LIMIT_PLAIN: &str = "plain HTTP/1.1, nginx sendfile";
pub(crate) const LIMIT_TLS: &str = "TLS 1.3 from memory, rustls";
pub(crate) const NGINX: &str = "nginx";
pub(crate) const LIGHTTPD: &str = "lighttpd";
pub(crate) const HAPROXY: &str = "haproxy";
pub(crate) const CADDY: &str = "caddy";
pub(crate) const H2O: &str = "h2o";
/// Built from `benches/peers/pingora-proxy` (`cargo xtask build-peers`).
pub(crate) const PINGORA: &str = "pingora";
/// The npm package's binary: `Bun.serve` (h1, h3) ...
pub(crate) const BUN: &str = "bun";
/// ... and `node:http2`'s secure server (h2), one peer as `--peers` names it.
pub(crate) const BUN_H2: &str = "bun node:http2";

/// What the servers under test do with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum Mode {
    /// The machine's limit, measured in every run: the client against a plain-HTTP
    /// sendfile server (nginx without TLS) and against a TLS server that sends
    /// from memory (`tls-source`). Not a `--modes` choice.
    #[value(skip)]
    Limit,
    /// Each server sends the fixture from its own disk.
    Direct,
    /// Each server terminates TLS and relays the fixture from a plain-HTTP origin
    /// (a separate nginx on loopback); only the proxy's CPU is its server CPU.
    Proxy,
    /// Each server passes TLS through by SNI to one TLS origin (Webship serving
    /// the fixture directly, h1/h2 over TCP and h3 over UDP); never decrypts.
    Passthrough,
}

impl Mode {
    pub fn label(self) -> &'static str {
        match self {
            Mode::Limit => "limit",
            Mode::Direct => "direct",
            Mode::Proxy => "proxy",
            Mode::Passthrough => "passthrough",
        }
    }
}

/// A scenario measured after the matrix, into the same report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// 1, 16 and 256 concurrent downloads over h1 connections, one h2 and one h3 connection.
    Concurrency,
    /// WebTransport streams and datagrams, directly and through HTTP/3 passthrough.
    Webtransport,
    /// Idle and slow connections per mode, protocol and server: memory per connection.
    Connections,
}

/// The servers of one mode: Webship first, then the peers that started. The
/// GSO-off Webship (direct only) is started per round.
struct ModeServers {
    mode: Mode,
    servers: Vec<Server>,
    /// Proxy mode: the origin every proxy forwards to, its CPU reported apart.
    origin: Option<Server>,
}

/// The peers this runner knows, in table order.
pub(crate) const PEERS: [&str; 8] = [NGINX, LIGHTTPD, HAPROXY, CADDY, H2O, PINGORA, BUN, BUN_H2];

/// Whether `--peers` selects `peer`: by its name; `bun` selects both Bun servers.
fn selected(peer: &str, wanted: &[String]) -> bool {
    let name = if peer == BUN_H2 { BUN } else { peer };
    wanted.iter().any(|w| w == name)
}

/// Why `server` has no cell for (`mode`, `protocol`); None where it has one.
/// `nginx_version` is e.g. "nginx 1.22" (Debian's build has no HTTP/3 module).
pub(crate) fn cell_gap(server: &str, mode: Mode, protocol: Protocol, nginx_version: &str) -> Option<String> {
    let reason = match (server, mode, protocol) {
        (NGINX, Mode::Passthrough, _) if !Path::new(servers::NGINX_STREAM_MODULE).exists() => {
            "nginx's stream module is missing (Debian package libnginx-mod-stream)"
        }
        (NGINX, Mode::Passthrough, _) => return None,
        (LIGHTTPD, Mode::Passthrough, _) => "lighttpd has no TLS passthrough",
        (CADDY, Mode::Passthrough, _) => {
            "Caddy passes TLS through only with the layer4 plugin, not in its release build"
        }
        (HAPROXY, Mode::Passthrough, Protocol::H3) => "HAProxy does not forward UDP",
        (H2O, Mode::Passthrough, _) => "h2o has no TLS passthrough",
        (H2O, _, Protocol::H3) => "Debian's h2o 2.2.5 has no HTTP/3 (QUIC came with 2.3, unreleased)",
        (HAPROXY, Mode::Passthrough, _) => return None,
        (NGINX, _, Protocol::H3) => return Some(format!("{nginx_version} has no HTTP/3")),
        (LIGHTTPD, Mode::Proxy, _) => "lighttpd is measured as a file server only",
        (LIGHTTPD, _, Protocol::H3) => "lighttpd has no HTTP/3",
        (HAPROXY, Mode::Direct, _) => "HAProxy serves no files (proxy only)",
        (HAPROXY, _, Protocol::H3) => "Debian's HAProxy 2.6 is built without QUIC",
        (PINGORA, Mode::Direct, _) => "Pingora serves no files (a proxy framework)",
        (PINGORA, Mode::Passthrough, _) => "the Pingora peer terminates TLS (no SNI passthrough built in)",
        (PINGORA, _, Protocol::H3) => "Pingora 0.9 has no HTTP/3",
        (BUN | BUN_H2, Mode::Proxy, _) => "Bun is measured as a file server only",
        (BUN | BUN_H2, Mode::Passthrough, _) => "Bun has no TLS passthrough",
        (BUN, _, Protocol::H2) => "Bun.serve has no HTTP/2 (bun node:http2 has the h2 cell)",
        (BUN_H2, _, Protocol::H2) => return None,
        (BUN_H2, _, _) => "node:http2 measured for h2 only (bun, through Bun.serve, has h1 and h3)",
        _ => return None,
    };
    Some(reason.to_owned())
}

/// Another Webship build measured as a peer (`--compare LABEL=PATH`).
#[derive(Debug, Clone)]
pub struct Compare {
    /// "webship LABEL": a server name, which the report keys cells by.
    pub name: &'static str,
    pub path: std::path::PathBuf,
}

/// How many `--compare` builds one run takes; each adds a server per mode.
const MAX_COMPARE: usize = 4;

pub(crate) fn parse_compare(arg: &str) -> Result<Compare, String> {
    static COUNT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let (label, path) = arg
        .split_once('=')
        .filter(|(label, path)| !label.is_empty() && !path.is_empty())
        .ok_or_else(|| {
            format!("{arg:?}: expected LABEL=PATH, e.g. jemalloc=target/alloc/webship-jemalloc")
        })?;
    if !label
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        return Err(format!("{label:?}: a label is letters, digits, '-' and '_'"));
    }
    if COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) >= MAX_COMPARE {
        return Err(format!("at most {MAX_COMPARE} --compare builds per run"));
    }
    // Server names are `&'static str` throughout the report; a name per argument,
    // at most MAX_COMPARE per process, is leaked once.
    let name: &'static str = Box::leak(format!("webship {label}").into_boxed_str());
    Ok(Compare {
        name,
        path: path.into(),
    })
}

/// Whether `peer` takes part in `mode` at all.
fn in_mode(peer: &str, mode: Mode) -> bool {
    Protocol::ALL
        .into_iter()
        .any(|protocol| cell_gap(peer, mode, protocol, "").is_none())
}

/// The first line of an error's root cause, short enough for a table cell.
fn short(error: &anyhow::Error) -> String {
    let text = error.root_cause().to_string();
    let line = text.lines().next().unwrap_or("").trim();
    line.chars().take(240).collect()
}

pub(crate) fn run(args: &DownloadArgs) -> Result<()> {
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
        "--modes names no mode; use direct, proxy, passthrough or a list"
    );
    let target = if args.smoke { 1 } else { args.samples };
    let cache = args
        .cache_dir
        .clone()
        .unwrap_or_else(|| env::temp_dir().join("webship-benches"));
    let stage = Stage::new(Some(&cache.join("root")))?;
    let (fixture, root, identity) = (&stage.fixture, stage.root.as_path(), &stage.identity);
    let clients = Clients::new(&identity.ca)?;
    let bench = Bench {
        clients: &clients,
        sha256: hex(&fixture.sha256),
    };
    let dir = |name: &str| stage.dir(name);
    let base = Settings {
        root,
        identity,
        workers: args.workers,
        dir: stage.scratch.path(),
        hold: None,
    };
    let nginx_version = servers::nginx_version(&args.nginx);

    // Which peers run: none for --smoke; each one's binary must exist.
    let mut gaps: Vec<Gap> = Vec::new();
    let mut peers_found = Vec::new();
    let wanted: Vec<&str> = if args.smoke {
        Vec::new()
    } else {
        PEERS
            .into_iter()
            .filter(|peer| selected(peer, &args.peers))
            .collect()
    };
    let mut peers: Vec<&'static str> = Vec::new();
    for peer in wanted {
        let binary = peer_binary(args, peer);
        if binary.is_file() {
            let version = match peer {
                NGINX => nginx_version.clone(),
                HAPROXY => servers::version_line(binary, &["-v"]),
                CADDY => format!("caddy {}", servers::version_line(binary, &["version"])),
                PINGORA => servers::version_line(binary, &["--version"]),
                BUN | BUN_H2 => format!("bun {}", servers::version_line(binary, &["--version"])),
                _ => servers::version_line(binary, &["-v"]),
            };
            eprintln!("peer {peer}: {} ({version})", binary.display());
            peers_found.push(format!("{peer}: {} ({version})", binary.display()));
            peers.push(peer);
            for &mode in &modes {
                for protocol in Protocol::ALL {
                    if let Some(reason) = cell_gap(peer, mode, protocol, &nginx_version) {
                        gaps.push(Gap::new(mode, protocol, peer, reason));
                    }
                }
            }
        } else {
            let reason = match peer {
                PINGORA | BUN | BUN_H2 => format!("{} not found ({})", binary.display(), peers::BUILD_HINT),
                _ => format!("{} not found (install the Debian package)", binary.display()),
            };
            eprintln!("peer {peer} skipped: {reason}");
            for &mode in &modes {
                add_gaps(&mut gaps, peer, mode, &reason);
            }
        }
    }

    // The limit on this machine, measured beside everything else.
    let mut sets = vec![ModeServers {
        mode: Mode::Limit,
        servers: vec![
            servers::start_origin(LIMIT_PLAIN, &args.nginx, root, &dir("limit-plain")?, None)?,
            servers::start_tls_source(
                LIMIT_TLS,
                &Settings {
                    dir: &dir("limit-tls")?,
                    ..base
                },
                &fixture.path,
            )?,
        ],
        origin: None,
    }];
    for &mode in &modes {
        let origin = match mode {
            Mode::Limit | Mode::Direct => None,
            Mode::Proxy => Some(servers::start_origin(
                "origin nginx",
                &args.nginx,
                root,
                &dir("origin-nginx")?,
                None,
            )?),
            Mode::Passthrough => {
                let origin_dir = dir("origin-webship")?;
                let mut origin_spec = webship_spec(args, ORIGIN_WEBSHIP, true);
                // The origin stands for a host behind the relay: its datagrams are
                // Ethernet-sized, as across a network, not loopback's 8972 bytes
                // (the default's ceiling here), at which an origin on the same 2
                // cores outran the userspace relay and every sample lost packets.
                if args.h3_mtu.is_none() {
                    origin_spec
                        .runtime
                        .push(("h3_mtu_upper_bound_bytes", "1452".to_owned()));
                }
                let origin = servers::start_webship(
                    &origin_spec,
                    &Settings {
                        dir: &origin_dir,
                        ..base
                    },
                )?;
                ensure_h3(&origin)?;
                Some(origin)
            }
        };
        let origin_port = origin.as_ref().map(|o| o.port);
        let webship_dir = dir(&format!("webship-{}", mode.label()))?;
        let spec = webship_spec(args, WEBSHIP, true);
        let webship_settings = Settings {
            dir: &webship_dir,
            ..base
        };
        let webship = match (mode, origin_port) {
            (Mode::Passthrough, Some(port)) => {
                servers::start_webship_passthrough(&spec, &webship_settings, port, "auto")?
            }
            (_, None) => servers::start_webship(&spec, &webship_settings)?,
            (_, Some(port)) => servers::start_webship_proxy(&spec, &webship_settings, port)?,
        };
        ensure_h3(&webship)?;
        let mut started = vec![webship];
        // The same daemon scraped every second, beside it in the same rounds.
        if args.scrape && matches!(mode, Mode::Direct | Mode::Proxy) {
            let scraped_dir = dir(&format!("webship-scraped-{}", mode.label()))?;
            let spec = webship_spec(args, WEBSHIP_SCRAPED, true);
            let s = Settings {
                dir: &scraped_dir,
                ..base
            };
            let scraped = match origin_port {
                Some(port) => servers::start_webship_proxy(&spec, &s, port)?,
                None => servers::start_webship(&spec, &s)?,
            };
            ensure_h3(&scraped)?;
            started.push(scraped);
        }
        // Other builds (`--compare`), beside it in the same rounds.
        if matches!(mode, Mode::Direct | Mode::Proxy) {
            for build in &args.compare {
                let build_dir = dir(&format!("{}-{}", build.name.replace(' ', "-"), mode.label()))?;
                let spec = WebshipSpec {
                    binary: &build.path,
                    ..webship_spec(args, build.name, true)
                };
                let s = Settings {
                    dir: &build_dir,
                    ..base
                };
                let server = match origin_port {
                    Some(port) => servers::start_webship_proxy(&spec, &s, port)?,
                    None => servers::start_webship(&spec, &s)?,
                };
                ensure_h3(&server)?;
                started.push(server);
            }
        }
        // Passthrough: each engine by name too, beside the default (`auto`).
        if let (Mode::Passthrough, Some(port)) = (mode, origin_port) {
            for (name, engine) in [
                (WEBSHIP_SOCKMAP, "sockmap"),
                (WEBSHIP_SPLICE, "splice"),
                (WEBSHIP_COPY, "copy"),
                (WEBSHIP_UDP_RELAY, "udp=userspace"),
            ] {
                let engine_dir = dir(&format!("webship-passthrough-{engine}"))?;
                let server = servers::start_webship_passthrough(
                    &webship_spec(args, name, true),
                    &Settings {
                        dir: &engine_dir,
                        ..base
                    },
                    port,
                    engine,
                );
                match server {
                    Ok(server) => started.push(server),
                    // No eBPF here (not root, or a build without the object).
                    Err(e) => {
                        let reason = format!("failed to start: {}", short(&e));
                        eprintln!("passthrough {name}: {reason}");
                        for protocol in Protocol::ALL {
                            gaps.push(Gap::new(mode, protocol, name, reason.clone()));
                        }
                    }
                }
            }
        }
        for &peer in peers.iter().filter(|peer| in_mode(peer, mode)) {
            let peer_dir = dir(&format!("{peer}-{}", mode.label()))?;
            let s = Settings {
                dir: &peer_dir,
                ..base
            };
            let binary = peer_binary(args, peer);
            let server = match (peer, origin_port) {
                (NGINX, Some(port)) if mode == Mode::Passthrough => {
                    servers::start_nginx_passthrough(binary, &s, port)
                }
                (HAPROXY, Some(port)) if mode == Mode::Passthrough => {
                    servers::start_haproxy_passthrough(binary, &s, port)
                }
                (NGINX, None) => servers::start_nginx(binary, &s),
                (NGINX, Some(port)) => servers::start_nginx_proxy(binary, &s, port),
                (LIGHTTPD, _) => servers::start_lighttpd(binary, &s),
                (HAPROXY, Some(port)) => servers::start_haproxy(binary, &s, port),
                (CADDY, port) => servers::start_caddy(binary, &s, port),
                (H2O, port) => servers::start_h2o(binary, &s, port),
                (PINGORA, Some(port)) => peers::start_pingora(binary, &s, port),
                (BUN, None) => peers::start_bun(binary, &s, false),
                (BUN_H2, None) => peers::start_bun(binary, &s, true),
                _ => continue,
            };
            match server {
                Ok(server) => started.push(server),
                Err(e) => {
                    let reason = format!("failed to start: {}", short(&e));
                    eprintln!("{} {peer}: {reason}", mode.label());
                    add_gaps(&mut gaps, peer, mode, &reason);
                }
            }
        }
        sets.push(ModeServers {
            mode,
            servers: started,
            origin,
        });
    }
    let no_gso_dir = dir("webship-no-gso")?;
    let with_no_gso = !args.smoke && modes.contains(&Mode::Direct);
    let start_no_gso = || -> Result<Server> {
        let server = servers::start_webship(
            &webship_spec(args, WEBSHIP_NO_GSO, false),
            &Settings {
                dir: &no_gso_dir,
                ..base
            },
        )?;
        ensure_h3(&server)?;
        Ok(server)
    };
    let serves = |server: &str, mode: Mode, protocol: Protocol| match server {
        WEBSHIP | WEBSHIP_SCRAPED => true,
        WEBSHIP_SOCKMAP | WEBSHIP_SPLICE | WEBSHIP_COPY => protocol != Protocol::H3,
        WEBSHIP_UDP_RELAY => protocol == Protocol::H3,
        WEBSHIP_NO_GSO => protocol == Protocol::H3,
        LIMIT_PLAIN => protocol == Protocol::H1,
        LIMIT_TLS => protocol != Protocol::H3,
        peer => cell_gap(peer, mode, protocol, &nginx_version).is_none(),
    };

    // One checked download per cell first (size, status and SHA-256); it also
    // warms the page cache and the servers so the first timed sample is not an
    // outlier. A Webship cell that fails it ends the run; a peer's becomes n/a.
    let mut series = Vec::new();
    for set in &sets {
        for protocol in Protocol::ALL {
            for server in &set.servers {
                if !serves(server.name, set.mode, protocol) {
                    continue;
                }
                match bench.verify(set.mode, server, protocol) {
                    Ok(entry) => series.push(entry),
                    Err(e) if is_webship(server.name) || is_limit(server.name) => return Err(e),
                    Err(e) => {
                        let reason = format!("checked download failed: {}", short(&e));
                        eprintln!("{e:#}");
                        gaps.push(Gap::new(set.mode, protocol, server.name, reason));
                    }
                }
            }
        }
        if set.mode == Mode::Direct && with_no_gso {
            let no_gso = start_no_gso()?;
            series.push(bench.verify(set.mode, &no_gso, Protocol::H3)?);
        }
    }

    // Rounds until every cell has `target` accepted samples; rejected samples
    // cost a round, and the round count is bounded so a cell that keeps failing
    // ends the run instead of looping.
    let max_rounds = target * 2 + 2;
    let wants = |series: &[Series], mode: Mode, name: &str, protocol: Protocol| {
        series
            .iter()
            .any(|s| s.mode == mode && s.server == name && s.protocol == protocol && s.accepted() < target)
    };
    for round in 0..max_rounds {
        if series.iter().all(|s| s.accepted() >= target) {
            break;
        }
        for set in &sets {
            for protocol in Protocol::ALL {
                // Started afresh for each round's h3 cells, stopped right after them.
                let no_gso = match (set.mode, protocol) {
                    (Mode::Direct, Protocol::H3)
                        if with_no_gso && wants(&series, set.mode, WEBSHIP_NO_GSO, protocol) =>
                    {
                        Some(start_no_gso()?)
                    }
                    _ => None,
                };
                let mut cells: Vec<&Server> = set
                    .servers
                    .iter()
                    .chain(no_gso.as_ref())
                    .filter(|server| wants(&series, set.mode, server.name, protocol))
                    .collect();
                if !cells.is_empty() {
                    let turn = round as usize % cells.len();
                    cells.rotate_left(turn);
                }
                for server in cells {
                    let entry = series
                        .iter_mut()
                        .find(|s| s.mode == set.mode && s.server == server.name && s.protocol == protocol)
                        .context("every cell was verified before sampling")?;
                    let verdict = match bench.sample(server, set.origin.as_ref(), protocol, entry) {
                        None => format!("{:.1} MiB/s", entry.mib_s.last().copied().unwrap_or(0.0)),
                        Some(reason) => format!("REJECTED: {reason}"),
                    };
                    eprintln!(
                        "round {}/{max_rounds} {} {} {} ({}/{target} accepted): {verdict}",
                        round + 1,
                        set.mode.label(),
                        server.name,
                        protocol.label(),
                        entry.accepted(),
                    );
                }
            }
        }
    }
    // Read late: the line may be logged just after the port starts accepting.
    let webship_kernel = sets
        .iter()
        .flat_map(|set| &set.servers)
        .find(|server| server.name == WEBSHIP)
        .map_or_else(|| "unknown".to_owned(), |webship| kernel_summary(&webship.log()));
    for server in sets.iter().flat_map(|set| &set.servers) {
        if server.name == WEBSHIP_SCRAPED {
            eprintln!(
                "{} on port {}: {} scrapes of /metrics",
                server.name,
                server.port,
                server.scrapes()
            );
            // Every run lasts longer than a scrape interval: none means its cells
            // measured a server nobody scraped.
            ensure!(
                server.scrapes() > 0,
                "{} on port {}: its admin listener never answered /metrics; log:\n{}",
                server.name,
                server.port,
                server.log_tail()
            );
        }
    }
    drop(sets);

    // A cell with no accepted sample has no numbers: a peer's becomes n/a, a Webship one fails the run.
    let mut failed_webship = Vec::new();
    series.retain(|s| {
        if s.accepted() > 0 {
            return true;
        }
        let last = s.rejected.last().map_or("", String::as_str);
        let reason = format!("0 of {} samples accepted (last: {last})", s.rejected.len());
        if is_webship(s.server) || is_limit(s.server) {
            failed_webship.push(format!(
                "{} {} {}: {reason}",
                s.mode.label(),
                s.server,
                s.protocol.label()
            ));
        }
        gaps.push(Gap::new(s.mode, s.protocol, s.server, reason));
        false
    });

    let mut report = Report {
        series,
        ticks_per_s: clock_ticks_per_second(),
        samples: target,
        workers: args.workers,
        h3_mtu: args.h3_mtu,
        webship_kernel,
        gaps,
        peers: peers_found,
        smoke: args.smoke,
        sections: Vec::new(),
    };
    // The scenarios beside the matrix, each with its own servers, once the
    // matrix's are stopped. A failed one is reported in place and fails the run.
    let mut failed_scenarios = Vec::new();
    let scenarios = if args.smoke { &[][..] } else { &args.scenarios[..] };
    for scenario in scenarios {
        let section = match scenario {
            Scenario::Concurrency => crate::concurrency::measure(&ConcurrencyArgs {
                webship: args.webship.clone(),
                mib: 8,
                levels: vec![1, 16, 256],
                workers: args.workers,
                h3_sockets: 1,
                client_threads: 1,
                core_share: None,
                cache_dir: Some(cache.join("root")),
                h3_batch_delays: vec![0],
                protos: ["h1", "h2", "h3", "h3n"].map(String::from).to_vec(),
            }),
            Scenario::Connections => crate::connections::measure(&ConnectionsArgs {
                webship: args.webship.clone(),
                levels: vec![1000, 5000, 10_000, 50_000],
                modes: args.modes.clone(),
                protocols: ["h1", "h2", "h3"].map(String::from).to_vec(),
                peers: args.peers.clone(),
                slow: 200,
                slow_rate: 4096,
                mib: 16,
                samples: 3,
                workers: args.workers,
                cache_dir: Some(cache.join("root")),
                after_request: false,
                smoke: false,
            }),
            Scenario::Webtransport => crate::wtbench::measure(&WtBenchArgs {
                webship: args.webship.clone(),
                samples: target,
                datagrams: 50_000,
                size: 1100,
                workers: args.workers,
                cache_dir: Some(cache.join("root")),
            }),
        };
        report.sections.push(section.unwrap_or_else(|e| {
            failed_scenarios.push(format!("{scenario:?}: {e:#}"));
            Section {
                title: format!("{scenario:?}"),
                markdown: format!("failed: {e:#}\n"),
                json: serde_json::Value::Array(Vec::new()),
                bars: Vec::new(),
            }
        }));
    }
    print!("{}", report.markdown());
    let out_dir = Path::new(REPORT_DIR);
    report.write_files(out_dir)?;
    eprintln!(
        "wrote {0}/report.md, {0}/report.json and {0}/report.svg",
        out_dir.display()
    );
    if let Some(out) = &args.out {
        fs::write(out, report.json_text()).with_context(|| format!("writing {}", out.display()))?;
        eprintln!("wrote {}", out.display());
    }
    ensure!(
        failed_webship.is_empty(),
        "Webship or limit cells without an accepted sample:\n{}",
        failed_webship.join("\n")
    );
    ensure!(
        failed_scenarios.is_empty(),
        "scenarios that failed:\n{}",
        failed_scenarios.join("\n")
    );
    Ok(())
}

/// Where the report files go: the workspace's `target/bench`.
pub(crate) const REPORT_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../target/bench");

/// A baseline of the machine's limit.
pub(crate) fn is_limit(server: &str) -> bool {
    [LIMIT_PLAIN, LIMIT_TLS].contains(&server)
}

/// Webship under test, in any of its variants.
pub(crate) fn is_webship(server: &str) -> bool {
    [
        WEBSHIP,
        WEBSHIP_NO_GSO,
        WEBSHIP_SCRAPED,
        WEBSHIP_SOCKMAP,
        WEBSHIP_SPLICE,
        WEBSHIP_COPY,
        WEBSHIP_UDP_RELAY,
    ]
    .contains(&server)
}

fn peer_binary<'a>(args: &'a DownloadArgs, peer: &str) -> &'a Path {
    match peer {
        LIGHTTPD => &args.lighttpd,
        HAPROXY => &args.haproxy,
        CADDY => &args.caddy,
        H2O => &args.h2o,
        PINGORA => &args.pingora,
        BUN | BUN_H2 => &args.bun,
        _ => &args.nginx,
    }
}

/// n/a entries for every cell `peer` would have had in `mode`.
fn add_gaps(gaps: &mut Vec<Gap>, peer: &'static str, mode: Mode, reason: &str) {
    for protocol in Protocol::ALL {
        if cell_gap(peer, mode, protocol, "").is_none() {
            gaps.push(Gap::new(mode, protocol, peer, reason.to_owned()));
        }
    }
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
        scraped: name == WEBSHIP_SCRAPED,
    }
}

struct Bench<'a> {
    clients: &'a Clients,
    /// The fixture's SHA-256 (hex), checked on each cell's untimed download.
    sha256: String,
}

impl Bench<'_> {
    /// Downloads the fixture once, untimed, and checks it like every sample and by
    /// SHA-256 too: warms the page cache and the server, and records the TLS parameters.
    fn verify(&self, mode: Mode, server: &Server, protocol: Protocol) -> Result<Series> {
        let sample = self
            .clients
            .download(server, protocol, Some(&self.sha256))
            .with_context(|| failed(mode, server, protocol))?;
        Ok(Series::new(mode, server.name, protocol, sample.notes))
    }

    /// One timed download, its server CPU (the proxy's alone in proxy mode), the
    /// origin's CPU and the client's CPU added to `series` if the sample is
    /// accepted: status 200, exactly the fixture's bytes, no packet loss on
    /// the host (no TCP retransmission, no UDP receive error) and no major page
    /// fault in the server's process tree.
    /// Returns the reason for a rejected sample, which is counted in `series`.
    fn sample(
        &self,
        server: &Server,
        origin: Option<&Server>,
        protocol: Protocol,
        series: &mut Series,
    ) -> Option<String> {
        let drops_before = udp_socket_drops(server.port);
        let origin_before = origin.map(|o| cpu_ticks(o.pid()));
        let faults_before = major_faults(server.pid());
        let before = cpu_ticks(server.pid());
        let host_before = host_busy_ticks();
        let loss_before = Loss::read();
        let rss = RssWatch::start(server.pid());
        let result = self.clients.download(server, protocol, None);
        let loss = Loss::read()
            .zip(loss_before)
            .and_then(|(after, before)| after.since(before));
        let after = cpu_ticks(server.pid());
        let host = host_busy_ticks().saturating_sub(host_before);
        let peak_kib = rss.finish();
        let faults = major_faults(server.pid()).saturating_sub(faults_before);
        let origin_ticks = origin
            .zip(origin_before)
            .map(|(o, before)| cpu_ticks(o.pid()).saturating_sub(before));
        let sample = match result {
            Err(e) => return Some(series.reject(short(&e))),
            Ok(_) if faults > 0 => {
                return Some(series.reject(format!("{faults} major page fault(s) in the server")))
            }
            Ok(sample) => match loss {
                Some(reason) => return Some(series.reject(reason)),
                None => sample,
            },
        };
        series.add(&sample, after.saturating_sub(before), origin_ticks, host);
        series.peak_rss_kib = series.peak_rss_kib.max(peak_kib);
        if protocol == Protocol::H3 {
            // The server's UDP socket lives across samples, so its counter is read as a difference.
            let server_drops = udp_socket_drops(server.port)
                .zip(drops_before)
                .map(|(after, before)| after.saturating_sub(before));
            series.add_udp_drops(sample.client_drops, server_drops);
        }
        None
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

    /// The cells a peer has: (mode, protocol) pairs without a gap.
    fn cells(peer: &str) -> Vec<(Mode, Protocol)> {
        [Mode::Direct, Mode::Proxy, Mode::Passthrough]
            .into_iter()
            .flat_map(|mode| Protocol::ALL.into_iter().map(move |p| (mode, p)))
            .filter(|&(mode, protocol)| cell_gap(peer, mode, protocol, "nginx 1.22").is_none())
            .collect()
    }

    #[test]
    fn built_peers_play_where_they_can() {
        use Protocol::{H1, H2, H3};
        assert_eq!(cells(PINGORA), [(Mode::Proxy, H1), (Mode::Proxy, H2)]);
        assert_eq!(cells(BUN), [(Mode::Direct, H1), (Mode::Direct, H3)]);
        assert_eq!(cells(BUN_H2), [(Mode::Direct, H2)]);
        // `--peers bun` runs both Bun servers; neither is selected by the other names.
        let wanted = ["nginx".to_owned(), "bun".to_owned()];
        assert!(selected(BUN, &wanted) && selected(BUN_H2, &wanted));
        assert!(!selected(PINGORA, &wanted));
    }
}
