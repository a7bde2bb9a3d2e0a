//! `webship`: serve, check a configuration, or print the kernel preflight report.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};

use webship::config::{self, Config};
use webship::{preflight, server};

#[derive(Debug, Parser)]
#[command(
    name = "webship",
    version,
    about = "Streams large payloads over HTTP/1.1, HTTP/2 and HTTP/3 with TLS"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
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
    /// Print the passthrough counters of the running daemon (kernel and userspace),
    /// read from its pinned bpf maps.
    Stats {
        /// Read the pin folder from this configuration (`[kernel] bpf_pin_dir`).
        #[arg(long, short, conflicts_with = "pin_dir")]
        config: Option<PathBuf>,
        /// The pin folder [default: /sys/fs/bpf/webship].
        #[arg(long)]
        pin_dir: Option<PathBuf>,
        /// One JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging();
    let default = Command::Serve {
        config: None,
        takeover: false,
    };
    let result = match cli.command.unwrap_or(default) {
        Command::Serve { config, takeover } => serve(config.as_deref(), takeover),
        Command::Check { config } => check(&config),
        Command::Preflight { config } => run_preflight(config.as_deref()),
        Command::Stats {
            config,
            pin_dir,
            json,
        } => stats(config.as_deref(), pin_dir, json),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("webship: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("WEBSHIP_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
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
    let report = preflight::run(&config.kernel, !config.passthrough.is_empty());
    let missing = report.missing_required();
    if !missing.is_empty() {
        for finding in missing {
            eprintln!("webship: preflight: {finding}");
        }
        anyhow::bail!("required kernel features are missing; nothing was bound (see `webship preflight`)");
    }
    for finding in [&report.ktls, &report.bbr, &report.ebpf] {
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
    let config = config::load(path)?;
    server::check(&config).with_context(|| config.source.clone())?;
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
    for route in &config.passthrough {
        let upstreams: Vec<String> = route.upstreams.iter().map(ToString::to_string).collect();
        println!(
            "  pass     {} → {} [engine {}]",
            route.domain,
            upstreams.join(", "),
            config.passthrough_engine
        );
    }
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
    }
    Ok(ExitCode::SUCCESS)
}
