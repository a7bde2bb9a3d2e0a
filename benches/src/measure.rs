//! The `download` benchmark: Webship against nginx, same host, same run.
//!
//! Servers are measured in interleaved order (alternating which goes first in
//! each round) so that thermal or background drift lands on both equally.
//! Every sample must deliver the exact fixture size with status 200 over the
//! requested protocol, and one download per server and protocol is checked
//! byte for byte by digest; anything else aborts the run.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};

use crate::fixture::{self, Fixture, FIXTURE_BYTES, FIXTURE_NAME};
use crate::servers::{self, Server, Settings};
use crate::DownloadArgs;

const MIB: f64 = 1_048_576.0;
const GB: f64 = 1e9;
/// Upper bound per download; at even 10 MiB/s the fixture takes 10 s.
const CURL_MAX_TIME: Duration = Duration::from_secs(120);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    H1,
    H2,
}

impl Protocol {
    const ALL: [Protocol; 2] = [Protocol::H1, Protocol::H2];

    fn label(self) -> &'static str {
        match self {
            Protocol::H1 => "h1",
            Protocol::H2 => "h2",
        }
    }

    fn curl_flag(self) -> &'static str {
        match self {
            Protocol::H1 => "--http1.1",
            Protocol::H2 => "--http2",
        }
    }

    /// curl's `%{http_version}`: checked so that a silent ALPN fallback to
    /// HTTP/1.1 cannot pass as an h2 result.
    fn curl_version(self) -> &'static str {
        match self {
            Protocol::H1 => "1.1",
            Protocol::H2 => "2",
        }
    }
}

/// All samples of one server and protocol.
#[derive(Debug)]
struct Series {
    server: &'static str,
    protocol: Protocol,
    tls: String,
    mib_s: Vec<f64>,
    /// Server CPU summed over all samples: a single 100 MB download costs only a
    /// few dozen clock ticks, so per-sample figures would be too coarse.
    cpu_ticks: u64,
    bytes: u64,
}

impl Series {
    fn median_mib_s(&self) -> f64 {
        let mut sorted = self.mib_s.clone();
        sorted.sort_by(f64::total_cmp);
        let mid = sorted.len() / 2;
        if sorted.len() % 2 == 0 {
            (sorted[mid - 1] + sorted[mid]) / 2.0
        } else {
            sorted[mid]
        }
    }

    fn cpu_s_per_gb(&self, ticks_per_s: f64) -> f64 {
        (self.cpu_ticks as f64 / ticks_per_s) / (self.bytes as f64 / GB)
    }
}

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
    let ticks_per_s = clock_ticks_per_second();

    let settings = |name: &str| -> Result<_> {
        let dir = scratch.path().join(name);
        fs::create_dir(&dir)?;
        Ok(dir)
    };
    let (webship_dir, nginx_dir) = (settings("webship")?, settings("nginx")?);
    let webship = servers::start_webship(
        &args.webship,
        &args.ktls,
        &Settings {
            root,
            identity: &identity,
            workers: args.workers,
            dir: &webship_dir,
        },
    )?;
    let nginx = servers::start_nginx(
        &args.nginx,
        &Settings {
            root,
            identity: &identity,
            workers: args.workers,
            dir: &nginx_dir,
        },
    )?;
    let servers = [&webship, &nginx];

    // One checked download per pair first; it also warms the page cache and
    // both servers so the first timed sample is not an outlier.
    let mut series = Vec::new();
    for server in servers {
        for protocol in Protocol::ALL {
            let tls = verify(server, protocol, &fixture, scratch.path())?;
            series.push(Series {
                server: server.name,
                protocol,
                tls,
                mib_s: Vec::new(),
                cpu_ticks: 0,
                bytes: 0,
            });
        }
    }

    for round in 0..args.samples {
        for protocol in Protocol::ALL {
            let order: [usize; 2] = if round % 2 == 0 { [0, 1] } else { [1, 0] };
            for index in order {
                let server = servers[index];
                let before = cpu_ticks(server.pid());
                let sample = download(server, protocol, Path::new("/dev/null"), false)?;
                let after = cpu_ticks(server.pid());
                let entry = series
                    .iter_mut()
                    .find(|s| s.server == server.name && s.protocol == protocol)
                    .context("every pair was verified before sampling")?;
                entry.mib_s.push(sample.size as f64 / sample.seconds / MIB);
                entry.cpu_ticks += after.saturating_sub(before);
                entry.bytes += sample.size;
                eprintln!(
                    "round {}/{} {} {}: {:.1} MiB/s",
                    round + 1,
                    args.samples,
                    server.name,
                    protocol.label(),
                    sample.size as f64 / sample.seconds / MIB
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
        ticks_per_s,
        args,
        webship_kernel,
    };
    print!("{}", report.markdown());
    if let Some(out) = &args.out {
        fs::write(out, report.json()).with_context(|| format!("writing {}", out.display()))?;
        eprintln!("wrote {}", out.display());
    }
    Ok(())
}

#[derive(Debug)]
struct Sample {
    size: u64,
    seconds: f64,
    /// Only captured with `verbose`: the TLS version and cipher curl negotiated.
    tls: String,
}

fn download(server: &Server, protocol: Protocol, to: &Path, verbose: bool) -> Result<Sample> {
    let url = format!("https://127.0.0.1:{}/{FIXTURE_NAME}", server.port);
    let mut command = Command::new("curl");
    command
        .args(["-sk", if verbose { "-v" } else { "-S" }, protocol.curl_flag()])
        .args(["--max-time", &CURL_MAX_TIME.as_secs().to_string()])
        .arg("-o")
        .arg(to)
        .args([
            "-w",
            "%{size_download} %{time_total} %{http_code} %{http_version}",
            &url,
        ]);
    let output = command.output().context("running curl")?;
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
    let [size, seconds, code, version] = fields[..] else {
        bail!("{what}: unexpected curl -w output {stdout:?}");
    };
    let size: u64 = size.parse().with_context(|| format!("{what}: size {size:?}"))?;
    let seconds: f64 = seconds
        .parse()
        .with_context(|| format!("{what}: time {seconds:?}"))?;
    ensure!(code == "200", "{what}: status {code}, expected 200");
    ensure!(
        size == FIXTURE_BYTES,
        "{what}: received {size} bytes, expected {FIXTURE_BYTES}"
    );
    ensure!(
        version == protocol.curl_version(),
        "{what}: curl spoke HTTP/{version}, expected HTTP/{}",
        protocol.curl_version()
    );
    ensure!(seconds > 0.0, "{what}: curl reported a time of {seconds} s");

    let tls = stderr
        .lines()
        .find_map(|line| line.strip_prefix("* SSL connection using "))
        .unwrap_or("unknown")
        .trim()
        .to_owned();
    Ok(Sample { size, seconds, tls })
}

/// Downloads to a file and compares digests: size and status alone would
/// miss a server that sends the right number of wrong bytes.
fn verify(server: &Server, protocol: Protocol, fixture: &Fixture, scratch: &Path) -> Result<String> {
    let to = scratch.join(format!("check-{}-{}.bin", server.name, protocol.label()));
    let sample = download(server, protocol, &to, true)?;
    let digest = fixture::file_digest(&to)?;
    fs::remove_file(&to)?;
    ensure!(
        digest == fixture.sha256,
        "{} {}: body SHA-256 {} differs from fixture {}",
        server.name,
        protocol.label(),
        fixture::hex(&digest),
        fixture::hex(&fixture.sha256)
    );
    Ok(sample.tls)
}

/// utime + stime, in clock ticks, of `pid` and every process below it (nginx
/// serves from worker processes; the master alone would read as idle).
fn cpu_ticks(pid: u32) -> u64 {
    let mut total = 0;
    for pid in std::iter::once(pid).chain(descendants(pid)) {
        // A process may exit between listing and reading; it no longer counts.
        if let Some(stat) = read_stat(pid) {
            total += stat.utime + stat.stime;
        }
    }
    total
}

/// Every process whose parent chain leads to `root`, found through /proc/*/stat.
pub fn descendants(root: u32) -> Vec<u32> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let parents: Vec<(u32, u32)> = entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse().ok())
        .filter_map(|pid| Some((pid, read_stat(pid)?.ppid)))
        .collect();
    let mut found = vec![root];
    // Each pass adds at least one process or stops; the process count bounds it.
    let mut next = 0;
    while next < found.len() {
        let parent = found[next];
        found.extend(
            parents
                .iter()
                .filter(|&&(_, ppid)| ppid == parent)
                .map(|&(pid, _)| pid),
        );
        next += 1;
    }
    found.remove(0);
    found
}

#[derive(Debug)]
struct Stat {
    ppid: u32,
    utime: u64,
    stime: u64,
}

fn read_stat(pid: u32) -> Option<Stat> {
    parse_stat(&fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Fields 4, 14 and 15 of proc(5) stat. The command name (field 2) may hold
/// spaces and parentheses, so counting starts after its last ')'.
fn parse_stat(stat: &str) -> Option<Stat> {
    let (_, rest) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state).
    let field = |n: usize| fields.get(n - 3);
    Some(Stat {
        ppid: field(4)?.parse().ok()?,
        utime: field(14)?.parse().ok()?,
        stime: field(15)?.parse().ok()?,
    })
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

/// USER_HZ, which is 100 on every mainstream Linux build; asked of getconf to be sure.
fn clock_ticks_per_second() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|out| String::from_utf8(out.stdout).ok()?.trim().parse().ok())
        .unwrap_or(100.0)
}

struct Report<'a> {
    series: Vec<Series>,
    ticks_per_s: f64,
    args: &'a DownloadArgs,
    /// What Webship's preflight enabled, e.g. "ktls=missing bbr=yes": without
    /// kTLS its h1 path stays in userspace TLS, which changes what is compared.
    webship_kernel: String,
}

impl Report<'_> {
    fn find(&self, server: &str, protocol: Protocol) -> Option<&Series> {
        self.series
            .iter()
            .find(|s| s.server == server && s.protocol == protocol)
    }

    /// (protocol, throughput ratio, CPU-per-GB ratio), webship over nginx.
    fn ratios(&self) -> Vec<(Protocol, f64, f64)> {
        Protocol::ALL
            .into_iter()
            .filter_map(|protocol| {
                let (w, n) = (self.find("webship", protocol)?, self.find("nginx", protocol)?);
                Some((
                    protocol,
                    w.median_mib_s() / n.median_mib_s(),
                    w.cpu_s_per_gb(self.ticks_per_s) / n.cpu_s_per_gb(self.ticks_per_s),
                ))
            })
            .collect()
    }

    fn markdown(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "\nfixture {FIXTURE_BYTES} bytes, {} samples, {} worker(s) per server, CLK_TCK {}, \
             webship preflight: {}\n",
            self.args.samples, self.args.workers, self.ticks_per_s, self.webship_kernel
        );
        let _ = writeln!(
            out,
            "| server | protocol | median MiB/s | min | max | server CPU-s/GB | TLS |"
        );
        let _ = writeln!(out, "|---|---|---:|---:|---:|---:|---|");
        for s in &self.series {
            let min = s.mib_s.iter().copied().fold(f64::INFINITY, f64::min);
            let max = s.mib_s.iter().copied().fold(0.0, f64::max);
            let _ = writeln!(
                out,
                "| {} | {} | {:.1} | {min:.1} | {max:.1} | {:.3} | {} |",
                s.server,
                s.protocol.label(),
                s.median_mib_s(),
                s.cpu_s_per_gb(self.ticks_per_s),
                s.tls
            );
        }
        let _ = writeln!(
            out,
            "\n| protocol | throughput webship/nginx | CPU-s/GB webship/nginx |"
        );
        let _ = writeln!(out, "|---|---:|---:|");
        for (protocol, throughput, cpu) in self.ratios() {
            let _ = writeln!(out, "| {} | {throughput:.3} | {cpu:.3} |", protocol.label());
        }
        out
    }

    fn json(&self) -> String {
        let results: Vec<String> = self
            .series
            .iter()
            .map(|s| {
                let samples: Vec<String> = s.mib_s.iter().map(|v| format!("{v:.3}")).collect();
                format!(
                    "{{\"server\":{},\"protocol\":\"{}\",\"median_mib_s\":{:.3},\"samples_mib_s\":[{}],\
                     \"cpu_s_per_gb\":{:.4},\"tls\":{}}}",
                    json_string(s.server),
                    s.protocol.label(),
                    s.median_mib_s(),
                    samples.join(","),
                    s.cpu_s_per_gb(self.ticks_per_s),
                    json_string(&s.tls)
                )
            })
            .collect();
        let ratios: Vec<String> = self
            .ratios()
            .into_iter()
            .map(|(p, t, c)| {
                format!(
                    "{{\"protocol\":\"{}\",\"throughput\":{t:.4},\"cpu_s_per_gb\":{c:.4}}}",
                    p.label()
                )
            })
            .collect();
        format!(
            "{{\"fixture_bytes\":{FIXTURE_BYTES},\"samples\":{},\"workers\":{},\"webship_preflight\":{},\
             \"results\":[{}],\"ratios_webship_over_nginx\":[{}]}}\n",
            self.args.samples,
            self.args.workers,
            json_string(&self.webship_kernel),
            results.join(","),
            ratios.join(",")
        )
    }
}

/// Enough JSON string escaping for the ASCII labels written here, and correct for any input.
fn json_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_with_spaces_in_comm() {
        let stat = "42 (nginx: worker (x)) S 7 42 42 0 -1 4194560 10 0 0 0 123 45 0 0 20 0 1 0";
        let parsed = parse_stat(stat).expect("parses");
        assert_eq!((parsed.ppid, parsed.utime, parsed.stime), (7, 123, 45));
    }

    #[test]
    fn kernel_summary_from_log() {
        let log = "x INFO preflight: ktls [auto] missing\n\
                   y INFO listening on https://127.0.0.1:1 (workers 1; preflight: ktls=missing bbr=yes; h3 off)\n";
        assert_eq!(kernel_summary(log), "ktls=missing bbr=yes");
        assert_eq!(kernel_summary(""), "unknown");
    }

    #[test]
    fn json_escapes() {
        assert_eq!(json_string("a\"b\\c\n"), "\"a\\\"b\\\\c\\u000a\"");
    }
}
