//! `webship`: serve, check a configuration, or print the kernel preflight report.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};

use webship::config::{self, Config};
use webship::logging::{self, LogFormat};
use webship::{preflight, server};

/// The process's heap allocator, chosen at build time. The system's (glibc malloc)
/// unless a feature picks another: neither jemalloc nor mimalloc beat it on both
/// memory per connection and CPU per byte (docs/benchmarks.md, "Allocator"); they
/// stay buildable so the comparison can be rerun when the code or the crates change.
mod allocator {
    #[cfg(all(feature = "allocator-jemalloc", feature = "allocator-mimalloc"))]
    compile_error!("choose at most one of the features allocator-jemalloc and allocator-mimalloc");

    #[cfg(feature = "allocator-jemalloc")]
    #[global_allocator]
    static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

    #[cfg(all(feature = "allocator-mimalloc", not(feature = "allocator-jemalloc")))]
    #[global_allocator]
    static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
}

#[derive(Debug, Parser)]
#[command(
    name = "webship",
    version,
    about = "Streams large payloads over HTTP/1.1, HTTP/2 and HTTP/3 with TLS"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// How log lines are written to standard error: `text` or `json` (one object per
    /// line) [default: $WEBSHIP_LOG_FORMAT, else text]. Under systemd each line also
    /// starts with its syslog priority (`<6>`), and text drops its timestamp.
    #[arg(long, global = true, value_name = "FORMAT", value_parser = parse_log_format)]
    log_format: Option<LogFormat>,
}

fn parse_log_format(s: &str) -> Result<LogFormat, String> {
    s.parse()
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve (the default). Without --config: the current directory on
    /// https://127.0.0.1:8443 with a self-signed certificate generated at start.
    Serve {
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// Zero-downtime upgrade: take the listening sockets over from the webship
        /// running with this configuration's `control_socket` (run as root, like the
        /// first); it drains and exits once this one serves.
        #[arg(long, requires = "config")]
        takeover: bool,
    },
    /// Validate a configuration (and load its certificates), print a summary.
    Check {
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Probe the kernel features the configuration asks for and print the report.
    Preflight {
        #[arg(long, short)]
        config: Option<PathBuf>,
    },
    /// Reload the running daemon's configuration (as SIGHUP does) and print the
    /// outcome; exits 1 when the daemon refused the file.
    Reload {
        /// The file to load: the daemon is found through its `control_socket` (or
        /// the per-port default) and runs on this file from then on. Without it: the
        /// one daemon with a socket in /run/webship, on the file it runs on.
        #[arg(long, short)]
        config: Option<PathBuf>,
    },
    /// List the running daemon's ACME certificates (serial, expiry, next renewal,
    /// last error); with --renew, order one site's certificate anew now and wait for
    /// the outcome (exits 1 when it failed: the old certificate keeps serving).
    Certs {
        /// The daemon is found through this file's `control_socket` (else the one
        /// socket in /run/webship).
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// The site (its domain) to renew now.
        #[arg(long, value_name = "SITE")]
        renew: Option<String>,
        /// One JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Print the passthrough counters of the running daemon (kernel and userspace),
    /// read from its pinned bpf maps; or, with --watch, a live view of its traffic.
    Stats {
        /// Read the pin folder from this configuration (`[kernel] bpf_pin_dir`); with
        /// --watch, the daemon's control socket (as `webship reload` finds it).
        #[arg(long, short, conflicts_with = "pin_dir")]
        config: Option<PathBuf>,
        /// The pin folder [default: /sys/fs/bpf/webship].
        #[arg(long)]
        pin_dir: Option<PathBuf>,
        /// One JSON object instead of a table (with --watch: one per interval, a line
        /// each).
        #[arg(long)]
        json: bool,
        /// Live: rates, the busiest sites, latency and the large transfers in flight,
        /// polled over the control socket every --interval (q, Esc or Ctrl-C quits).
        /// When standard output is not a terminal, one text block per interval.
        #[arg(long, conflicts_with = "pin_dir")]
        watch: bool,
        /// Seconds between polls (0.2 to 3600).
        #[arg(long, requires = "watch", value_name = "SECS", default_value_t = 1.0)]
        interval: f64,
        /// The daemon's control socket [default: its `control_socket` with --config,
        /// else the one socket in /run/webship].
        #[arg(long, requires = "watch", conflicts_with = "config", value_name = "PATH")]
        socket: Option<PathBuf>,
        /// Stop after this many polls.
        #[arg(long, requires = "watch", value_name = "N")]
        count: Option<u64>,
    },
    /// The session-ticket key file that hosts behind one load balancer share
    /// (`[tls] ticket_keys`; format and rotation: docs/operations.md).
    TicketKeys {
        #[command(subcommand)]
        action: TicketKeysAction,
    },
}

#[derive(Debug, Subcommand)]
enum TicketKeysAction {
    /// Write a new file with one key, encrypting from now: FILE is created with mode
    /// 0600 and never overwritten; without FILE the text goes to standard output.
    New { file: Option<PathBuf> },
    /// Add a key that starts encrypting --activate-in seconds from now, drop the keys
    /// no valid ticket needs any more, and replace FILE atomically (mode and owner kept).
    /// Copy the result to every host before the new key's time comes.
    Rotate {
        file: PathBuf,
        /// Seconds before the new key encrypts: long enough to reach every host.
        #[arg(long, value_name = "SECS", default_value_t = 3600)]
        activate_in: u64,
    },
}

/// 9999-12-31T23:59:59Z, the last instant `httpdate` formats.
const LAST_HTTP_DATE: u64 = 253_402_300_799;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match LogFormat::choose(cli.log_format) {
        Ok(format) => logging::init(format),
        Err(e) => {
            eprintln!("webship: {e}");
            return ExitCode::from(2);
        }
    }
    let default = Command::Serve {
        config: None,
        takeover: false,
    };
    let result = match cli.command.unwrap_or(default) {
        Command::Serve { config, takeover } => serve(config.as_deref(), takeover),
        Command::Check { config } => check(&config),
        Command::Reload { config } => reload(config.as_deref()),
        Command::Preflight { config } => run_preflight(config.as_deref()),
        Command::Certs { config, renew, json } => certs(config.as_deref(), renew, json),
        Command::Stats {
            config,
            json,
            watch: true,
            interval,
            socket,
            count,
            ..
        } => watch(config.as_deref(), socket, interval, json, count),
        Command::TicketKeys { action } => ticket_keys(action),
        Command::Stats {
            config,
            pin_dir,
            json,
            ..
        } => stats(config.as_deref(), pin_dir, json),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            logging::fatal(&format!("{e:#}"));
            ExitCode::FAILURE
        }
    }
}

fn ticket_keys(action: TicketKeysAction) -> anyhow::Result<ExitCode> {
    use webship::ticket_keys::{create_file, new_file, rotate_file};
    match action {
        TicketKeysAction::New { file: None } => print!("{}", new_file()?),
        TicketKeysAction::New { file: Some(file) } => {
            create_file(&file)?;
            println!("{}: a new ticket key file (mode 0600)", file.display());
        }
        TicketKeysAction::Rotate { file, activate_in } => {
            let (newest, keys) = rotate_file(&file, activate_in)?;
            println!(
                "{}: {keys} keys; the new one encrypts from {newest} (unix seconds): copy the file to every host before then, and reload them or let them notice the change",
                file.display()
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn load(path: Option<&Path>) -> anyhow::Result<Config> {
    Ok(match path {
        Some(path) => config::load(path)?,
        None => {
            let cwd = std::env::current_dir().context("cannot determine the current directory")?;
            config::builtin_default(&cwd)?
        }
    })
}

fn serve(path: Option<&Path>, takeover: bool) -> anyhow::Result<ExitCode> {
    let mut config = load(path)?;
    server::keep_freed_heap_memory(&config);
    let wants_ebpf = match takeover {
        true => config.may_want_ebpf_taking_over(),
        false => config.wants_ebpf(),
    };
    let report = preflight::run(&config.kernel, wants_ebpf);
    let missing = report.missing_required();
    if !missing.is_empty() {
        for finding in missing {
            tracing::error!("preflight: {finding}");
        }
        anyhow::bail!("required kernel features are missing; nothing was bound (see `webship preflight`)");
    }
    for finding in [&report.ktls, &report.bbr, &report.ebpf, &report.tcp_health] {
        tracing::info!("preflight: {finding}");
    }
    server::raise_fd_limit(&mut config).with_context(|| config.source.clone())?;
    let privilege = server::Privilege::plan(&config).with_context(|| config.source.clone())?;
    if path.is_none() {
        let root = &config.sites[0].serve;
        println!(
            "Serving {} at https://{}/ (self-signed certificate)",
            root, config.listen
        );
    }
    // Every runtime thread starts as root and switches itself to the service account
    // once the sockets are bound (see `server::Privilege`).
    let hook = privilege.clone();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.workers)
        // Workers and the blocking pool alike (tokio names both); the benchmarks'
        // emulated cores find the workers by this name (benches/src/cores.rs).
        .thread_name("webship-worker")
        .on_thread_start(move || hook.thread_start())
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let source = config.source.clone();
    runtime
        .block_on(server::run(
            config,
            report,
            privilege,
            takeover,
            shutdown_signal(),
        ))
        .with_context(|| source)?;
    Ok(ExitCode::SUCCESS)
}

/// SIGTERM or SIGINT.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
            (Ok(mut term), Ok(mut int)) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
            }
            _ => std::future::pending::<()>().await,
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

fn check(path: &Path) -> anyhow::Result<ExitCode> {
    let config = server::check_file(path)?;
    println!("{}: OK", config.source);
    println!("  listen   {}", config.listen);
    println!("  workers  {}", config.workers);
    if let Some(user) = &config.user {
        let group = config.group.as_deref().unwrap_or("(its primary group)");
        println!("  user     {user} group {group}");
    }
    for site in &config.sites {
        println!("  site     {} → {} [{}]", site.domain, site.serve, site.protocols);
    }
    println!(
        "  kernel   ktls={} bbr={} ebpf={}",
        config.kernel.ktls, config.kernel.bbr, config.kernel.ebpf
    );
    match &config.ticket_keys {
        Some(path) => println!(
            "  tickets  keys from {} (shared by the hosts given it)",
            path.display()
        ),
        None => println!("  tickets  keys generated per process"),
    }
    if !config.accept_proxy_protocol.is_empty() {
        let sources: Vec<String> = config
            .accept_proxy_protocol
            .iter()
            .map(ToString::to_string)
            .collect();
        println!("  accept   PROXY headers from {}", sources.join(", "));
    }
    for route in &config.passthrough {
        let upstreams: Vec<String> = route.upstreams.iter().map(ToString::to_string).collect();
        let header = route
            .proxy_protocol
            .map_or(String::new(), |v| format!(", PROXY {v} header"));
        println!(
            "  pass     {} → {} [engine {}{header}]",
            route.domain,
            upstreams.join(", "),
            config.passthrough_engine
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// How long `webship reload` waits for the daemon's answer.
const RELOAD_REPLY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

fn reload(path: Option<&Path>) -> anyhow::Result<ExitCode> {
    use webship::control::{self, Request};
    let (socket, config) = match path {
        Some(path) => {
            let file = std::fs::canonicalize(path)
                .with_context(|| format!("{}: cannot read the configuration", path.display()))?;
            (control_socket_of(&file)?, Some(file))
        }
        None => (only_control_socket()?, None),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let request = Request::Reload { config };
    let reply = runtime.block_on(control::call(&socket, &request, RELOAD_REPLY_TIMEOUT))?;
    if reply.ok {
        println!("{}", reply.message);
    } else {
        // As `webship check` prints the same words (one line, the log's format).
        logging::fatal(&reply.message);
    }
    for note in &reply.notes {
        println!("note: {note}");
    }
    Ok(if reply.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// How long `webship certs --renew` waits: the daemon gives up on an order first.
const CERTS_REPLY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(210);

fn certs(path: Option<&Path>, renew: Option<String>, json: bool) -> anyhow::Result<ExitCode> {
    use webship::control::{self, Request};
    let socket = match path {
        Some(path) => {
            let file = std::fs::canonicalize(path)
                .with_context(|| format!("{}: cannot read the configuration", path.display()))?;
            control_socket_of(&file)?
        }
        None => only_control_socket()?,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let reply = runtime.block_on(control::call(
        &socket,
        &Request::Certs { renew },
        CERTS_REPLY_TIMEOUT,
    ))?;
    let list = reply.certs.clone().unwrap_or_default();
    if json {
        println!("{}", serde_json::to_string(&list)?);
    } else {
        println!(
            "{:<32} {:<6} {:<40} {:<20} {:<20} last error",
            "site", "source", "serial", "not after", "next renewal"
        );
        let when = |t: Option<u64>| {
            t.map_or_else(
                || "-".to_owned(),
                // httpdate panics from year 10000 on; the daemon's answer is not
                // trusted to stay below it.
                |t| {
                    let t = t.min(LAST_HTTP_DATE);
                    httpdate::fmt_http_date(std::time::UNIX_EPOCH + std::time::Duration::from_secs(t))
                },
            )
        };
        for c in &list {
            println!(
                "{:<32} {:<6} {:<40} {:<20} {:<20} {}",
                c.site,
                c.source,
                c.serial.as_deref().unwrap_or("(none yet)"),
                when(c.not_after),
                when(c.next_renewal),
                c.last_error.as_deref().unwrap_or("-")
            );
        }
    }
    if reply.ok {
        eprintln!("{}", reply.message);
        Ok(ExitCode::SUCCESS)
    } else {
        logging::fatal(&reply.message);
        Ok(ExitCode::FAILURE)
    }
}

/// The control socket the daemon running `file` answers on: its `control_socket`,
/// else the default of its `listen` port. Read leniently, so a file the daemon will
/// refuse (a syntax error further down) still names its daemon.
fn control_socket_of(file: &Path) -> anyhow::Result<PathBuf> {
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("{}: cannot read the configuration", file.display()))?;
    let table: toml::Table = toml::from_str(&text).unwrap_or_else(|_| {
        // Top-level `key = value` lines, each on its own, before the first table.
        text.lines()
            .map(str::trim)
            .take_while(|line| !line.starts_with('['))
            .filter_map(|line| toml::from_str::<toml::Table>(line).ok())
            .flatten()
            .collect()
    });
    if let Some(path) = table.get("control_socket").and_then(toml::Value::as_str) {
        return Ok(PathBuf::from(path));
    }
    let port = table
        .get("listen")
        .and_then(toml::Value::as_str)
        .and_then(|listen| listen.parse::<std::net::SocketAddr>().ok())
        .map(|addr| addr.port())
        .with_context(|| {
            format!(
                "{}: cannot tell which daemon runs it: neither `control_socket` nor a `listen` address is readable",
                file.display()
            )
        })?;
    Ok(config::default_control_socket(port))
}

/// The one control socket in /run/webship.
fn only_control_socket() -> anyhow::Result<PathBuf> {
    let dir = Path::new(config::CONTROL_DIR);
    let mut sockets: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "sock"))
        .collect();
    sockets.sort();
    match sockets.len() {
        0 => anyhow::bail!(
            "no webship control socket in {} (is the daemon running? one with a `control_socket` elsewhere is \
             found with `webship reload --config FILE`)",
            dir.display()
        ),
        1 => Ok(sockets.remove(0)),
        _ => {
            let list: Vec<String> = sockets.iter().map(|p| p.display().to_string()).collect();
            anyhow::bail!(
                "several webship daemons answer in {}: {} (fix: name one with `webship reload --config FILE`)",
                dir.display(),
                list.join(", ")
            )
        }
    }
}

fn watch(
    config: Option<&Path>,
    socket: Option<PathBuf>,
    interval: f64,
    json: bool,
    count: Option<u64>,
) -> anyhow::Result<ExitCode> {
    use webship::watch::{self, Options, MAX_INTERVAL, MIN_INTERVAL};
    let interval = std::time::Duration::try_from_secs_f64(interval)
        .ok()
        .filter(|i| (MIN_INTERVAL..=MAX_INTERVAL).contains(i))
        .with_context(|| {
            format!(
                "--interval {interval}: give seconds from {} to {}",
                MIN_INTERVAL.as_secs_f64(),
                MAX_INTERVAL.as_secs()
            )
        })?;
    let socket = match (socket, config) {
        (Some(socket), _) => socket,
        (None, Some(path)) => {
            let file = std::fs::canonicalize(path)
                .with_context(|| format!("{}: cannot read the configuration", path.display()))?;
            control_socket_of(&file)?
        }
        (None, None) => only_control_socket()?,
    };
    let options = Options {
        socket,
        interval,
        json,
        count,
    };
    watch::run(&options)?;
    Ok(ExitCode::SUCCESS)
}

fn run_preflight(path: Option<&Path>) -> anyhow::Result<ExitCode> {
    let config = load(path)?;
    // Everything not `off`, whether or not this configuration would use it.
    let report = preflight::run(&config.kernel, true);
    println!("{report}");
    Ok(if report.missing_required().is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn stats(config: Option<&Path>, pin_dir: Option<PathBuf>, json: bool) -> anyhow::Result<ExitCode> {
    use webship::ebpf::{self, Counter};

    let dir = match (config, pin_dir) {
        (Some(path), _) => config::load(path)?.kernel.bpf_pin_dir,
        (None, Some(dir)) => dir,
        (None, None) => PathBuf::from(ebpf::DEFAULT_PIN_DIR),
    };
    let snapshot = ebpf::read_pinned(&dir)?;
    // Pinned beside the counters by any daemon with eBPF; empty without TCP health.
    let tcp = ebpf::read_tcp_pinned(&dir).ok();
    if json {
        let counters: serde_json::Map<String, serde_json::Value> = Counter::ALL
            .iter()
            .map(|&c| {
                let i = c as usize;
                let value = serde_json::json!({
                    "kernel": snapshot.kernel[i],
                    "userspace": snapshot.user[i],
                    "total": snapshot.total(c),
                });
                (c.name().to_owned(), value)
            })
            .collect();
        let report = serde_json::json!({
            "pin_dir": dir.display().to_string(),
            "linked_sockets": snapshot.linked_sockets,
            "counters": counters,
            "tcp_health": tcp.as_ref().map(tcp_json).transpose()?,
        });
        println!("{report}");
    } else {
        println!("passthrough counters (pinned under {})", dir.display());
        println!(
            "linked sockets (sockmap engine, now): {}",
            snapshot.linked_sockets
        );
        println!(
            "{:<22} {:>16} {:>16} {:>16}",
            "counter", "kernel", "userspace", "total"
        );
        for c in Counter::ALL {
            let i = c as usize;
            println!(
                "{:<22} {:>16} {:>16} {:>16}",
                c.name(),
                snapshot.kernel[i],
                snapshot.user[i],
                snapshot.total(c)
            );
        }
        if let Some(tcp) = tcp.filter(|t| !t.sites.is_empty()) {
            print_tcp(&tcp);
        }
    }
    Ok(ExitCode::SUCCESS)
}

const QUANTILES: [(&str, f64); 3] = [("p50", 0.5), ("p90", 0.9), ("p99", 0.99)];

/// The TCP health snapshot, each histogram with its quantile bounds beside it.
fn tcp_json(tcp: &webship::ebpf::TcpSnapshot) -> anyhow::Result<serde_json::Value> {
    let mut sites = Vec::with_capacity(tcp.sites.len());
    for site in &tcp.sites {
        let mut value = serde_json::to_value(site)?;
        for (field, histogram) in [("rtt_us", &site.rtt_us), ("delivery_rate", &site.delivery_rate)] {
            for (name, q) in QUANTILES {
                value[format!("{field}_{name}")] = serde_json::json!(histogram.quantile(q));
            }
        }
        sites.push(value);
    }
    Ok(serde_json::json!({ "sites": sites }))
}

/// One line per site: closes, resets, retransmissions, RTT and delivery rate.
fn print_tcp(tcp: &webship::ebpf::TcpSnapshot) {
    let q = |h: &webship::ebpf::Histogram, q: f64| h.quantile(q).map_or("-".to_owned(), |v| v.to_string());
    println!();
    println!("TCP health per site (kernel; RTT and delivery rate at close, quantiles are bucket bounds)");
    println!(
        "{:<28} {:>8} {:>7} {:>8} {:>6} {:>10} {:>10} {:>14} {:>14} {:>16}",
        "site",
        "closed",
        "reset",
        "retrans",
        "rto",
        "rtt_p50_us",
        "rtt_p99_us",
        "rate_p50_B/s",
        "rate_p99_B/s",
        "bytes_acked"
    );
    for s in &tcp.sites {
        println!(
            "{:<28} {:>8} {:>7} {:>8} {:>6} {:>10} {:>10} {:>14} {:>14} {:>16}",
            s.site,
            s.closed,
            s.reset,
            s.retransmits,
            s.rto,
            q(&s.rtt_us, 0.5),
            q(&s.rtt_us, 0.99),
            q(&s.delivery_rate, 0.5),
            q(&s.delivery_rate, 0.99),
            s.bytes_acked
        );
    }
}
