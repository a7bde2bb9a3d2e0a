//! `connections`: what a connection at rest costs. For each mode (direct, proxy,
//! passthrough per engine), protocol (h1, h2, h3) and level (1,000 and 10,000 by
//! default), a fresh server is started, N connections are set up and left idle
//! (`idleclient`), and the run reports the server's RSS per connection (its process
//! tree, VmRSS), what the host's kernel holds per connection (socket buffer memory
//! from /proc/net/sockstat and slab from /proc/meminfo, for every socket on the
//! host: client, server and, in passthrough, the origin's), the accept rate, and a
//! normal download's time with none held and while they are held. Then, per mode
//! and server, N slow HTTP/1.1 downloads (a few KiB/s each) the same way. Webship
//! and the peers installed (nginx, h2o, Caddy, HAProxy) where they have the cell.
//!
//! A server is restarted for every level: memory an allocator keeps after
//! connections close would otherwise hide the next level's cost.

use std::fmt::Write as _;
use std::fs;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, ensure, Context, Result};
use clap::Args;
use serde_json::json;
use webship_testkit::body::FixtureCheck;
use webship_testkit::fixture::EXACT;
use webship_testkit::h3::{recv_body, request, H3Client, H3Options};
use webship_testkit::http::Proto as Http;
use webship_testkit::pki::client_config;
use webship_testkit::proc::{descendants, status_kib};

use crate::idleclient::{self, Idle, Target};
use crate::measure::{self, Mode, CADDY, H2O, HAPROXY, NGINX, ORIGIN_WEBSHIP, WEBSHIP};
use crate::report::{fixed, Section};
use crate::servers::{self, Server, Settings, Stage, WebshipSpec};

#[derive(Debug, Args, Clone)]
pub(crate) struct ConnectionsArgs {
    /// The Webship binary (build it with `cargo build --release -p webship`).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../target/release/webship"))]
    pub webship: PathBuf,
    /// Idle connections per cell, comma-separated; a level the open-file limit cannot
    /// hold is skipped with the reason.
    #[arg(long, value_delimiter = ',', default_value = "1000,5000,10000,50000")]
    pub levels: Vec<usize>,
    /// Which modes, comma-separated: direct, proxy, passthrough.
    #[arg(long, value_delimiter = ',', default_value = "direct,proxy,passthrough")]
    pub modes: Vec<Mode>,
    /// Which protocols, comma-separated: h1, h2, h3.
    #[arg(long, value_delimiter = ',', default_value = "h1,h2,h3")]
    pub protocols: Vec<String>,
    /// Peers, comma-separated (each skipped if its binary is missing); none with --smoke.
    #[arg(long, value_delimiter = ',', default_value = "nginx,h2o,caddy,haproxy")]
    pub peers: Vec<String>,
    /// Slow HTTP/1.1 downloads per mode and server (0: none).
    #[arg(long, default_value_t = 200)]
    pub slow: usize,
    /// Bytes per second each slow download reads.
    #[arg(long, default_value_t = 4096)]
    pub slow_rate: usize,
    /// The normal download timed with and without the connections held, in MiB.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=100))]
    pub mib: u64,
    /// Timed downloads per measurement (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub samples: usize,
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub workers: u32,
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
    /// Each h1 and h2 connection GETs a small file once (read to its end) before it
    /// goes idle: what a kept-alive connection costs rather than a fresh one.
    /// HTTP/3 cells are not measured then.
    #[arg(long)]
    pub after_request: bool,
    /// CI's check that the scenario works: Webship only (default engines), 1,000
    /// connections, 20 slow downloads, one timed download per measurement.
    #[arg(long)]
    pub smoke: bool,
}

const FILE: &str = "connections.bin";
/// What `--after-request` GETs: a small file, so the response leaves no large buffer
/// behind that a bigger one would not.
const SMALL_FILE: &str = "connections-small.txt";
const SMALL_BODY: &[u8] = b"kept alive\n";
/// After the last connection is up: time for servers to send session tickets and
/// settle their tasks before memory is read.
const SETTLE: Duration = Duration::from_secs(2);
/// Slow downloads run this long before memory is read (socket buffers fill).
const SLOW_SETTLE: Duration = Duration::from_secs(4);
/// One timed download must finish within this.
const DOWNLOAD_TIMEOUT: Duration = Duration::from_secs(60);
const PAGE_KIB: f64 = 4.0;

/// The servers measured per mode, with the passthrough engines by name.
const PASSTHROUGH_ENGINES: [(&str, &str); 4] = [
    (WEBSHIP, "auto"),
    (measure::WEBSHIP_SOCKMAP, "sockmap"),
    (measure::WEBSHIP_SPLICE, "splice"),
    (measure::WEBSHIP_COPY, "copy"),
];

/// `hold`'s arguments: idle connections to a server started by hand (under heaptrack,
/// say), to see what each one allocates.
#[derive(Debug, Args)]
pub(crate) struct HoldArgs {
    /// The server, e.g. 127.0.0.1:8443.
    #[arg(long)]
    pub addr: SocketAddr,
    /// The CA certificate (PEM) the server's certificate is issued by.
    #[arg(long)]
    pub ca: PathBuf,
    #[arg(long, default_value = "localhost")]
    pub sni: String,
    /// h1, h2 or h3.
    #[arg(long, default_value = "h1")]
    pub protocol: String,
    #[arg(long, default_value_t = 1000)]
    pub n: usize,
    /// How long to hold them once all are up.
    #[arg(long, default_value_t = 30)]
    pub secs: u64,
    /// A path each h1 or h2 connection GETs once before it goes idle.
    #[arg(long)]
    pub request: Option<String>,
}

/// Opens `n` idle connections, holds them `secs`, closes them.
pub(crate) fn hold(args: &HoldArgs) -> Result<()> {
    let kind = match args.protocol.as_str() {
        "h1" => Idle::H1,
        "h2" => Idle::H2,
        "h3" => Idle::H3,
        other => anyhow::bail!("unknown protocol {other:?}; use h1, h2 or h3"),
    };
    let target = Target {
        addr: args.addr,
        sni: args.sni.clone(),
        tls: client_config(
            webship_testkit::pki::roots_from_pem(&args.ca)?,
            rustls::DEFAULT_VERSIONS,
            &[],
        )?,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let (held, took) = idleclient::open(&target, kind, args.n, args.request.as_deref()).await?;
        eprintln!(
            "hold: {} {} connections up in {took:?}; holding {} s",
            held.len(),
            kind.label(),
            args.secs
        );
        tokio::time::sleep(Duration::from_secs(args.secs)).await;
        held.close().await;
        Ok(())
    })
}

/// `connections` on its own: the table on stdout and in target/bench/connections.md.
pub(crate) fn run(args: &ConnectionsArgs) -> Result<()> {
    measure(args)?.publish("connections")
}

/// Memory readings: the server tree's RSS and the host kernel's socket and slab memory.
#[derive(Debug, Clone, Copy)]
struct Mem {
    rss_kib: u64,
    tcp_pages: u64,
    udp_pages: u64,
    slab_kib: u64,
}

impl Mem {
    fn read(pid: u32) -> Self {
        let rss_kib = std::iter::once(pid)
            .chain(descendants(pid))
            .filter_map(|p| status_kib(p, "VmRSS:"))
            .sum();
        let sockstat = fs::read_to_string("/proc/net/sockstat").unwrap_or_default();
        let meminfo = fs::read_to_string("/proc/meminfo").unwrap_or_default();
        Self {
            rss_kib,
            tcp_pages: sockstat_mem(&sockstat, "TCP:"),
            udp_pages: sockstat_mem(&sockstat, "UDP:"),
            slab_kib: meminfo
                .lines()
                .find_map(|l| l.strip_prefix("Slab:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
                .unwrap_or(0),
        }
    }
}

/// The `mem` value (pages) on `prefix`'s line of /proc/net/sockstat.
fn sockstat_mem(sockstat: &str, prefix: &str) -> u64 {
    sockstat
        .lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| {
            let fields: Vec<&str> = l.split_whitespace().collect();
            let at = fields.iter().position(|f| *f == "mem")?;
            fields.get(at + 1)?.parse().ok()
        })
        .unwrap_or(0)
}

/// One measured row.
#[derive(Debug)]
struct Row {
    mode: Mode,
    server: String,
    what: String,
    n: usize,
    accept_per_s: Option<f64>,
    rss_kib: f64,
    sock_kib: f64,
    slab_kib: f64,
    ms_before: f64,
    ms_held: f64,
}

impl Row {
    fn new(mode: Mode, server: &str, what: String, n: usize, before: Mem, after: Mem) -> Self {
        let per = |a: u64, b: u64| (a as f64 - b as f64) / n as f64;
        Self {
            mode,
            server: server.to_owned(),
            what,
            n,
            accept_per_s: None,
            rss_kib: per(after.rss_kib, before.rss_kib),
            sock_kib: per(
                after.tcp_pages + after.udp_pages,
                before.tcp_pages + before.udp_pages,
            ) * PAGE_KIB,
            slab_kib: per(after.slab_kib, before.slab_kib),
            ms_before: 0.0,
            ms_held: 0.0,
        }
    }

    fn line(&self) -> String {
        let accept = self.accept_per_s.map_or("".to_owned(), |r| format!("{r:.0}"));
        format!(
            "| {} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {accept} | {:.0} | {:.0} | {:.2} |",
            self.mode.label(),
            self.server,
            self.what,
            self.n,
            self.rss_kib,
            self.sock_kib,
            self.slab_kib,
            self.ms_before,
            self.ms_held,
            self.ms_held / self.ms_before,
        )
    }
}

/// Everything one run shares: the stage, the client runtime and TLS configuration.
struct Run<'a> {
    /// The hard open-file limit the servers inherit.
    hard_files: u64,
    args: &'a ConnectionsArgs,
    stage: Stage,
    tls: Arc<rustls::ClientConfig>,
    runtime: tokio::runtime::Runtime,
    size: u64,
}

pub(crate) fn measure(args: &ConnectionsArgs) -> Result<Section> {
    let mut args = args.clone();
    if args.smoke {
        args.levels = vec![1000];
        args.peers.clear();
        args.slow = args.slow.min(20);
        args.samples = 1;
        args.mib = args.mib.min(4);
    }
    ensure!(
        args.webship.is_file(),
        "webship binary {} not found; build it with `cargo build --release -p webship`",
        args.webship.display()
    );
    let most = args.levels.iter().copied().max().unwrap_or(0).max(args.slow);
    let hard_files = raise_open_files(most)?;
    let stage = Stage::new(args.cache_dir.as_deref())?;
    let size = args.mib << 20;
    let mut data = fs::read(&stage.fixture.path).context("reading the fixture")?;
    data.truncate(usize::try_from(size)?);
    fs::write(stage.root.join(FILE), &data)?;
    drop(data);
    fs::write(stage.root.join(SMALL_FILE), SMALL_BODY)?;
    let tls = client_config(
        webship_testkit::pki::roots_from_pem(&stage.identity.ca)?,
        rustls::DEFAULT_VERSIONS,
        &[],
    )?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let run = Run {
        hard_files,
        args: &args,
        stage,
        tls,
        runtime,
        size,
    };
    let mut rows = Vec::new();
    let mut gaps = Vec::new();
    for &mode in &args.modes {
        run.mode(mode, most, &mut rows, &mut gaps)?;
    }
    Ok(section(&args, &rows, &gaps))
}

impl Run<'_> {
    fn settings<'s>(&'s self, dir: &'s std::path::Path, hold: usize) -> Settings<'s> {
        Settings {
            root: &self.stage.root,
            identity: &self.stage.identity,
            workers: self.args.workers,
            dir,
            hold: Some(u32::try_from(hold).unwrap_or(u32::MAX)),
        }
    }

    /// Every server and protocol of `mode`, each level on a fresh server.
    fn mode(&self, mode: Mode, most: usize, rows: &mut Vec<Row>, gaps: &mut Vec<String>) -> Result<()> {
        let origin_dir = self.stage.dir(&format!("connections-origin-{}", mode.label()))?;
        let origin = match mode {
            Mode::Proxy => Some(servers::start_origin(
                "origin nginx",
                &PathBuf::from("/usr/sbin/nginx"),
                &self.stage.root,
                &origin_dir,
                Some(u32::try_from(most).unwrap_or(u32::MAX)),
            )?),
            Mode::Passthrough => Some(servers::start_webship(
                &self.spec(ORIGIN_WEBSHIP),
                &self.settings(&origin_dir, most),
            )?),
            _ => None,
        };
        let origin_port = origin.as_ref().map(|o| o.port);
        let mut names: Vec<(&'static str, &'static str)> = match mode {
            Mode::Passthrough if self.args.smoke => vec![(WEBSHIP, "auto")],
            Mode::Passthrough => PASSTHROUGH_ENGINES.to_vec(),
            _ => vec![(WEBSHIP, "")],
        };
        if mode == Mode::Passthrough && !self.args.smoke {
            names.push((measure::WEBSHIP_UDP_RELAY, "udp=userspace"));
        }
        for peer in [NGINX, H2O, CADDY, HAPROXY] {
            if self.args.peers.iter().any(|p| p == peer) {
                if peer_binary(peer).is_file() {
                    names.push((peer, ""));
                } else {
                    gaps.push(format!("{peer}: {} not found", peer_binary(peer).display()));
                }
            }
        }
        for (name, engine) in names {
            for proto in &self.args.protocols {
                let kind = match proto.as_str() {
                    "h1" => Idle::H1,
                    "h2" => Idle::H2,
                    "h3" => Idle::H3,
                    other => anyhow::bail!("unknown protocol {other:?}; use h1, h2 or h3"),
                };
                if self.args.after_request && kind == Idle::H3 {
                    gaps.push(format!(
                        "{} {name} h3: --after-request sends requests on h1 and h2 only",
                        mode.label()
                    ));
                    continue;
                }
                if let Some(gap) = gap(name, mode, kind) {
                    gaps.push(format!("{} {name} {}: {gap}", mode.label(), kind.label()));
                    continue;
                }
                for &n in &self.args.levels {
                    let files = files_needed(mode, n);
                    if files > self.hard_files {
                        gaps.push(format!(
                            "{} {name} {} × {n}: needs {files} open files, the hard limit here is {}",
                            mode.label(),
                            kind.label(),
                            self.hard_files
                        ));
                        continue;
                    }
                    let row = self.idle(mode, name, engine, origin_port, kind, n);
                    self.record(row, mode, name, rows, gaps)?;
                }
            }
            if self.args.slow > 0 && gap(name, mode, Idle::H1).is_none() {
                let row = self.slow(mode, name, engine, origin_port);
                self.record(row, mode, name, rows, gaps)?;
            }
        }
        Ok(())
    }

    /// A Webship row that failed fails the run; a peer's becomes a gap.
    fn record(
        &self,
        row: Result<Row>,
        mode: Mode,
        name: &str,
        rows: &mut Vec<Row>,
        gaps: &mut Vec<String>,
    ) -> Result<()> {
        match row {
            Ok(row) => {
                eprintln!("connections: {}", row.line());
                rows.push(row);
            }
            Err(e) if name.starts_with(WEBSHIP) => {
                return Err(anyhow!("connections: {} {name}: {e:#}", mode.label()));
            }
            Err(e) => {
                eprintln!("connections: {} {name} failed: {e:#}", mode.label());
                gaps.push(format!("{} {name}: failed: {e:#}", mode.label()));
            }
        }
        Ok(())
    }

    fn spec(&self, name: &'static str) -> WebshipSpec<'_> {
        WebshipSpec {
            name,
            binary: &self.args.webship,
            ktls: "auto",
            runtime: Vec::new(),
            scraped: false,
        }
    }

    fn start(
        &self,
        mode: Mode,
        name: &'static str,
        engine: &str,
        origin: Option<u16>,
        hold: usize,
    ) -> Result<Server> {
        let dir = self.stage.dir(&format!(
            "connections-{}-{}",
            mode.label(),
            name.replace(' ', "-")
        ))?;
        let s = self.settings(&dir, hold);
        match (name, mode, origin) {
            (n, Mode::Passthrough, Some(port)) if n.starts_with(WEBSHIP) => {
                servers::start_webship_passthrough(&self.spec(name), &s, port, engine)
            }
            (WEBSHIP, Mode::Proxy, Some(port)) => servers::start_webship_proxy(&self.spec(name), &s, port),
            (WEBSHIP, _, _) => servers::start_webship(&self.spec(name), &s),
            (NGINX, Mode::Passthrough, Some(port)) => {
                servers::start_nginx_passthrough(&peer_binary(NGINX), &s, port)
            }
            (NGINX, Mode::Proxy, Some(port)) => servers::start_nginx_proxy(&peer_binary(NGINX), &s, port),
            (NGINX, _, _) => servers::start_nginx(&peer_binary(NGINX), &s),
            (HAPROXY, Mode::Passthrough, Some(port)) => {
                servers::start_haproxy_passthrough(&peer_binary(HAPROXY), &s, port)
            }
            (HAPROXY, _, Some(port)) => servers::start_haproxy(&peer_binary(HAPROXY), &s, port),
            (CADDY, _, origin) => servers::start_caddy(&peer_binary(CADDY), &s, origin),
            (H2O, _, origin) => servers::start_h2o(&peer_binary(H2O), &s, origin),
            _ => Err(anyhow!("no way to start {name} in {}", mode.label())),
        }
    }

    /// `n` idle connections of `kind` on a fresh server.
    fn idle(
        &self,
        mode: Mode,
        name: &'static str,
        engine: &str,
        origin: Option<u16>,
        kind: Idle,
        n: usize,
    ) -> Result<Row> {
        let server = self.start(mode, name, engine, origin, n)?;
        let target = self.target(&server);
        let http = match kind {
            Idle::H1 => Some(Http::H1),
            Idle::H2 => Some(Http::H2),
            Idle::H3 => None,
        };
        let ms_before = self.timed_downloads(&target, http)?;
        let before = Mem::read(server.pid());
        let request = format!("/{SMALL_FILE}");
        let request = self.args.after_request.then_some(request.as_str());
        let (held, took) = self
            .runtime
            .block_on(idleclient::open(&target, kind, n, request))
            .with_context(|| format!("opening {n} {} connections", kind.label()))?;
        self.runtime.block_on(async { tokio::time::sleep(SETTLE).await });
        let after = Mem::read(server.pid());
        let ms_held = self.timed_downloads(&target, http)?;
        ensure!(held.len() == n, "{} of {n} connections held", held.len());
        self.runtime.block_on(held.close());
        let what = if request.is_some() {
            format!("{} idle after 1 request", kind.label())
        } else {
            format!("{} idle", kind.label())
        };
        let mut row = Row::new(mode, name, what, n, before, after);
        row.accept_per_s = Some(n as f64 / took.as_secs_f64());
        row.ms_before = ms_before;
        row.ms_held = ms_held;
        Ok(row)
    }

    /// `slow` slow HTTP/1.1 downloads of the fixture on a fresh server.
    fn slow(&self, mode: Mode, name: &'static str, engine: &str, origin: Option<u16>) -> Result<Row> {
        let n = self.args.slow;
        let server = self.start(mode, name, engine, origin, n)?;
        let target = self.target(&server);
        let ms_before = self.timed_downloads(&target, Some(Http::H1))?;
        let before = Mem::read(server.pid());
        let path = format!(
            "/{}",
            self.stage
                .fixture
                .path
                .file_name()
                .and_then(|f| f.to_str())
                .unwrap_or("")
        );
        let mut set =
            self.runtime
                .block_on(idleclient::slow_downloads(&target, &path, n, self.args.slow_rate))?;
        self.runtime
            .block_on(async { tokio::time::sleep(SLOW_SETTLE).await });
        let after = Mem::read(server.pid());
        let ms_held = self.timed_downloads(&target, Some(Http::H1))?;
        if let Some(ended) = set.try_join_next() {
            let ended = ended?;
            anyhow::bail!("a slow download ended while held: {ended:?}");
        }
        self.runtime.block_on(set.shutdown());
        let mut row = Row::new(
            mode,
            name,
            format!("h1 slow ({} B/s)", self.args.slow_rate),
            n,
            before,
            after,
        );
        row.ms_before = ms_before;
        row.ms_held = ms_held;
        Ok(row)
    }

    fn target(&self, server: &Server) -> Target {
        Target {
            addr: SocketAddr::from(([127, 0, 0, 1], server.port)),
            sni: "localhost".to_owned(),
            tls: Arc::clone(&self.tls),
        }
    }

    /// The median of `samples` downloads of the file (after one untimed), in ms;
    /// each body checked against the fixture.
    fn timed_downloads(&self, target: &Target, http: Option<Http>) -> Result<f64> {
        let mut ms = Vec::new();
        for i in 0..=self.args.samples {
            let start = Instant::now();
            self.runtime
                .block_on(async { tokio::time::timeout(DOWNLOAD_TIMEOUT, self.download(target, http)).await })
                .map_err(|_| anyhow!("a download took over {DOWNLOAD_TIMEOUT:?}"))??;
            if i > 0 {
                ms.push(start.elapsed().as_secs_f64() * 1000.0);
            }
        }
        ms.sort_by(f64::total_cmp);
        Ok(ms[ms.len() / 2])
    }

    async fn download(&self, target: &Target, http: Option<Http>) -> Result<()> {
        let path = format!("/{FILE}");
        let mut check = FixtureCheck::default();
        match http {
            Some(http) => {
                let mut conn = crate::concurrency::open(target.addr, &target.tls, http).await?;
                check = crate::concurrency::get(&mut conn, &path).await?;
                conn.close().await;
            }
            None => {
                let client =
                    H3Client::connect(target.addr, &target.sni, &target.tls, &H3Options::bulk()).await?;
                let (head, mut stream) =
                    request(&mut client.send.clone(), &client.origin(), "GET", &path, &[]).await?;
                ensure!(head.status == 200, "h3 status {}", head.status);
                recv_body(&mut stream, &mut check).await?;
                client.close().await;
            }
        }
        let verdict = check.verdict(self.size);
        ensure!(verdict == EXACT, "the timed download's body {verdict}");
        Ok(())
    }
}

/// Why `server` has no (`mode`, `kind`) cell; None where it has one.
fn gap(server: &str, mode: Mode, kind: Idle) -> Option<&'static str> {
    match (server, mode, kind) {
        (measure::WEBSHIP_UDP_RELAY, _, Idle::H3) => None,
        (measure::WEBSHIP_UDP_RELAY, _, _) => Some("the UDP relay carries h3 only"),
        (n, Mode::Passthrough, Idle::H3) if n.starts_with(WEBSHIP) && n != WEBSHIP => {
            Some("a TCP engine; h3 goes through the UDP relay")
        }
        (n, _, _) if n.starts_with(WEBSHIP) => None,
        (NGINX, Mode::Passthrough, _) => None,
        (NGINX, _, Idle::H3) => Some("Debian's nginx 1.22 has no HTTP/3"),
        (H2O, Mode::Passthrough, _) => Some("h2o has no TLS passthrough"),
        (H2O, _, Idle::H3) => Some("Debian's h2o 2.2.5 has no HTTP/3"),
        (CADDY, Mode::Passthrough, _) => Some("Caddy's release build has no TLS passthrough"),
        (HAPROXY, Mode::Direct, _) => Some("HAProxy serves no files"),
        (HAPROXY, _, Idle::H3) => Some("Debian's HAProxy 2.6 has no QUIC and forwards no UDP"),
        _ => None,
    }
}

fn peer_binary(peer: &str) -> PathBuf {
    PathBuf::from(match peer {
        NGINX => "/usr/sbin/nginx",
        HAPROXY => "/usr/sbin/haproxy",
        CADDY => "/usr/bin/caddy",
        _ => "/usr/bin/h2o",
    })
}

/// The hard open-file limit every server started here inherits: raised (root with
/// CAP_SYS_RESOURCE can) to fit `most` connections on the costliest path, else left
/// as it is, and the levels that do not fit are skipped with the reason.
fn raise_open_files(most: usize) -> Result<u64> {
    let want = files_needed(Mode::Passthrough, most);
    let hard = || -> Option<u64> {
        let limits = fs::read_to_string("/proc/self/limits").ok()?;
        let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
        line.split_whitespace().nth(4)?.parse::<u64>().ok()
    };
    let now = hard().context("reading the open-file limit")?;
    if now >= want {
        return Ok(now);
    }
    let raised = std::process::Command::new("prlimit")
        .args([
            "--pid",
            &std::process::id().to_string(),
            &format!("--nofile={want}:{want}"),
        ])
        .output()
        .is_ok_and(|out| out.status.success());
    if !raised {
        eprintln!(
            "connections: the hard open-file limit stays {now} (raising it to {want} needs \
             CAP_SYS_RESOURCE); levels that need more are skipped"
        );
    }
    hard().context("reading the open-file limit")
}

/// Descriptors a Webship server holding `n` connections in `mode` asks for (its own
/// rule: 2 per connection, 7 with TLS passthrough, plus 256); the peers need no more.
fn files_needed(mode: Mode, n: usize) -> u64 {
    let per = if mode == Mode::Passthrough { 7 } else { 2 };
    (n as u64 + u64::from(servers::HOLD_MARGIN)) * per + 256
}

fn section(args: &ConnectionsArgs, rows: &[Row], gaps: &[String]) -> Section {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "Connections at rest: N connections set up and left idle (h1: TLS handshake, no request; \
         h2: preface and SETTINGS, no stream; h3: QUIC handshake and control streams; \
         \"after 1 request\": one GET of an {}-byte file read to its end first), and N slow \
         HTTP/1.1 downloads at {} B/s each; a fresh server per row, {} worker(s). Server RSS is \
         the process tree's VmRSS; kernel socket buffers (/proc/net/sockstat TCP+UDP mem) and slab \
         (/proc/meminfo) are the whole host's, every end of every socket. Download: {} MiB, median \
         of {} with none held and while held.\n",
        SMALL_BODY.len(),
        args.slow_rate,
        args.workers,
        args.mib,
        args.samples
    );
    let _ = writeln!(
        md,
        "| mode | server | connections | N | server RSS KiB/conn | host socket buffers KiB/conn | \
         host slab KiB/conn | accepted conn/s | download ms, none held | ms, held | ratio |"
    );
    let _ = writeln!(md, "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut json = Vec::new();
    let mut bars = Vec::new();
    for row in rows {
        let _ = writeln!(md, "{}", row.line());
        json.push(json!({
            "mode": row.mode.label(),
            "server": row.server,
            "connections": row.what,
            "n": row.n,
            "server_rss_kib_per_conn": fixed(row.rss_kib, 2),
            "host_socket_kib_per_conn": fixed(row.sock_kib, 2),
            "host_slab_kib_per_conn": fixed(row.slab_kib, 2),
            "accepted_per_s": row.accept_per_s.map(|r| fixed(r, 1)),
            "download_ms_none_held": fixed(row.ms_before, 1),
            "download_ms_held": fixed(row.ms_held, 1),
        }));
        bars.push((
            format!(
                "{} {} {} × {} (KiB/conn)",
                row.mode.label(),
                row.server,
                row.what,
                row.n
            ),
            row.rss_kib,
        ));
    }
    if !gaps.is_empty() {
        let _ = writeln!(md, "\nNot measured:\n");
        for gap in gaps {
            let _ = writeln!(md, "- {gap}");
        }
    }
    Section {
        title: "connections: what a connection at rest costs (server RSS, kernel memory, accept rate)"
            .to_owned(),
        markdown: md,
        json: json.into(),
        bars,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sockstat_mem_is_read_per_protocol() {
        let sockstat = "sockets: used 290\nTCP: inuse 7 orphan 0 tw 2 alloc 9 mem 3\nUDP: inuse 4 mem 12\n";
        assert_eq!(sockstat_mem(sockstat, "TCP:"), 3);
        assert_eq!(sockstat_mem(sockstat, "UDP:"), 12);
        assert_eq!(sockstat_mem(sockstat, "RAW:"), 0, "a missing line reads as 0");
        // This kernel's own tables have what the scenario reads.
        let mem = Mem::read(std::process::id());
        assert!(mem.rss_kib > 0 && mem.slab_kib > 0, "{mem:?}");
    }

    #[test]
    fn levels_are_sized_by_webships_descriptor_rule() {
        let margin = u64::from(servers::HOLD_MARGIN);
        assert_eq!(files_needed(Mode::Direct, 1000), (1000 + margin) * 2 + 256);
        assert_eq!(files_needed(Mode::Passthrough, 1000), (1000 + margin) * 7 + 256);
    }
}
