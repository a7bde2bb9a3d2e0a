//! Results of the `download` benchmark: per-cell series, the Markdown tables and the JSON.

use std::fmt::Write as _;
use std::fs;
use std::path::Path;

use anyhow::{Context, Result};
use serde_json::{json, Value};
use webship_testkit::fixture::FIXTURE_LEN;

use crate::clients::{Protocol, Sample};
use crate::measure::{
    is_limit, is_webship, Mode, LIMIT_PLAIN, LIMIT_TLS, WEBSHIP, WEBSHIP_NO_GSO, WEBSHIP_SCRAPED,
};

const MIB: f64 = 1_048_576.0;
const GB: f64 = 1e9;

/// All samples of one cell (mode, server, protocol).
#[derive(Debug)]
pub(crate) struct Series {
    pub mode: Mode,
    pub server: &'static str,
    pub protocol: Protocol,
    /// curl's TLS line (h1/h2) or h3-get's transport notes, from the checked download.
    pub notes: String,
    pub mib_s: Vec<f64>,
    /// Server CPU summed over all samples: a single 100 MB download costs only a
    /// few dozen clock ticks, so per-sample figures would be too coarse.
    pub cpu_ticks: u64,
    /// The client's CPU (curl or h3-get), summed the same way.
    pub client_ticks: u64,
    /// The whole host's busy CPU over the same samples (client, server, origin and
    /// kernel work no process is charged for).
    pub host_ticks: u64,
    /// Proxy mode: the origin's CPU over the same samples (None in direct mode).
    pub origin_ticks: Option<u64>,
    pub bytes: u64,
    /// h3: datagrams the kernel dropped for a full receive buffer, summed over
    /// the timed samples, at the client's socket and at the server's (None: unknown).
    pub udp_drops: Option<(Option<u64>, Option<u64>)>,
    /// Why each rejected sample was rejected (wrong size, digest or status, a
    /// client error, a major page fault in the server).
    pub rejected: Vec<String>,
    /// The largest summed VmRSS of the server's process tree seen during the
    /// accepted samples, in KiB (read every 50 ms).
    pub peak_rss_kib: u64,
}

/// A scenario measured beside the download matrix (concurrency, WebTransport),
/// already rendered: its Markdown table, its rows as a JSON array, and the bars
/// it adds to the chart (label, MiB/s).
#[derive(Debug)]
pub(crate) struct Section {
    pub title: String,
    pub markdown: String,
    pub json: Value,
    pub bars: Vec<(String, f64)>,
}

impl Section {
    /// A scenario run on its own: the table on stdout and in `target/bench/<name>.md`.
    pub(crate) fn publish(&self, name: &str) -> Result<()> {
        print!("{}", self.markdown);
        let dir = Path::new(crate::measure::REPORT_DIR);
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join(format!("{name}.md"));
        fs::write(&path, &self.markdown).with_context(|| format!("writing {}", path.display()))
    }
}

/// A cell a server does not have, and why.
#[derive(Debug, Clone)]
pub(crate) struct Gap {
    pub mode: Mode,
    pub protocol: Protocol,
    pub server: &'static str,
    pub reason: String,
}

impl Gap {
    pub(crate) fn new(mode: Mode, protocol: Protocol, server: &'static str, reason: String) -> Self {
        Self {
            mode,
            protocol,
            server,
            reason,
        }
    }
}

impl Series {
    pub(crate) fn new(mode: Mode, server: &'static str, protocol: Protocol, notes: String) -> Self {
        Self {
            mode,
            server,
            protocol,
            notes,
            mib_s: Vec::new(),
            cpu_ticks: 0,
            client_ticks: 0,
            host_ticks: 0,
            origin_ticks: None,
            bytes: 0,
            udp_drops: None,
            rejected: Vec::new(),
            peak_rss_kib: 0,
        }
    }

    pub(crate) fn accepted(&self) -> u32 {
        u32::try_from(self.mib_s.len()).unwrap_or(u32::MAX)
    }

    /// Counts a rejected sample; returns the reason for the caller's log line.
    pub(crate) fn reject(&mut self, reason: String) -> String {
        self.rejected.push(reason.clone());
        reason
    }

    /// Coefficient of variation of the accepted samples' MiB/s (population
    /// standard deviation over mean), in percent; 0 for a single sample.
    fn cv_percent(&self) -> f64 {
        let n = self.mib_s.len() as f64;
        if self.mib_s.is_empty() {
            return 0.0;
        }
        let mean = self.mib_s.iter().sum::<f64>() / n;
        let var = self.mib_s.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
        if mean > 0.0 {
            100.0 * var.sqrt() / mean
        } else {
            0.0
        }
    }

    fn peak_rss_mib(&self) -> f64 {
        self.peak_rss_kib as f64 / 1024.0
    }

    pub(crate) fn add_udp_drops(&mut self, client: Option<u64>, server: Option<u64>) {
        let sum = |total: Option<u64>, n: Option<u64>| Some(total? + n?);
        self.udp_drops = Some(match self.udp_drops {
            None => (client, server),
            Some((c, s)) => (sum(c, client), sum(s, server)),
        });
    }

    /// The transport column: curl's TLS line or h3-get's notes, plus h3's drops.
    fn transport(&self) -> String {
        let Some((client, server)) = self.udp_drops else {
            return self.notes.clone();
        };
        let show = |n: Option<u64>| n.map_or_else(|| "?".to_owned(), |n| n.to_string());
        format!(
            "{}; UDP rcvbuf drops in timed samples: client {}, server {}",
            self.notes,
            show(client),
            show(server)
        )
    }

    pub(crate) fn add(
        &mut self,
        sample: &Sample,
        server_ticks: u64,
        origin_ticks: Option<u64>,
        host_ticks: u64,
    ) {
        self.mib_s.push(sample.size as f64 / sample.seconds / MIB);
        self.cpu_ticks += server_ticks;
        self.host_ticks += host_ticks;
        if let Some(ticks) = origin_ticks {
            *self.origin_ticks.get_or_insert(0) += ticks;
        }
        self.client_ticks += sample.client_ticks;
        self.bytes += sample.size;
    }

    fn median_mib_s(&self) -> f64 {
        let mut sorted = self.mib_s.clone();
        sorted.sort_by(f64::total_cmp);
        let mid = sorted.len() / 2;
        if sorted.is_empty() {
            0.0
        } else if sorted.len().is_multiple_of(2) {
            (sorted[mid - 1] + sorted[mid]) / 2.0
        } else {
            sorted[mid]
        }
    }

    fn per_gb(&self, ticks: u64, ticks_per_s: f64) -> f64 {
        (ticks as f64 / ticks_per_s) / (self.bytes as f64 / GB)
    }
}

/// A ratio of two cells: throughput and server CPU per GB, `of` over `to`.
#[derive(Debug)]
struct Ratio {
    label: String,
    /// None where the denominator cell does not exist.
    values: Option<(f64, f64)>,
}

/// Webship against the best peer (highest median) of one mode and protocol.
#[derive(Debug)]
struct BestPeer<'a> {
    protocol: Protocol,
    webship: Option<&'a Series>,
    best: Option<&'a Series>,
    /// Peers without this cell, and why.
    missing: Vec<&'a Gap>,
}

#[derive(Debug)]
pub(crate) struct Report {
    pub series: Vec<Series>,
    pub ticks_per_s: f64,
    /// Accepted samples wanted per cell.
    pub samples: u32,
    pub workers: u32,
    /// `--h3-mtu`, passed to Webship as `h3_mtu_upper_bound_bytes` (None: Webship's default).
    pub h3_mtu: Option<u16>,
    /// What Webship's preflight enabled, e.g. "ktls=missing bbr=yes": without
    /// kTLS its h1 path stays in userspace TLS, which changes what is compared.
    pub webship_kernel: String,
    /// Cells that could not be measured, with the reason.
    pub gaps: Vec<Gap>,
    /// The peers found: "name: binary (version)".
    pub peers: Vec<String>,
    /// `--smoke`: one sample per Webship cell, no peers.
    pub smoke: bool,
    /// The scenarios measured after the matrix, in order.
    pub sections: Vec<Section>,
}

impl Report {
    fn find(&self, mode: Mode, server: &str, protocol: Protocol) -> Option<&Series> {
        self.series
            .iter()
            .find(|s| s.mode == mode && s.server == server && s.protocol == protocol)
    }

    /// The TLS-from-memory baseline for `protocol` (h1, h2), the ceiling of a TLS cell.
    fn tls_limit(&self, protocol: Protocol) -> Option<&Series> {
        self.find(Mode::Limit, LIMIT_TLS, protocol)
    }

    /// `s`'s median as a share of the TLS limit of its protocol, in percent.
    fn share_of_limit(&self, s: &Series) -> Option<f64> {
        let limit = self.tls_limit(s.protocol)?;
        (!is_limit(s.server)).then(|| 100.0 * s.median_mib_s() / limit.median_mib_s())
    }

    /// One sentence: the limit on this machine, from the baseline cells.
    fn limit_line(&self) -> Option<String> {
        let plain = self.find(Mode::Limit, LIMIT_PLAIN, Protocol::H1)?;
        let h1 = self.tls_limit(Protocol::H1)?;
        let h2 = self.tls_limit(Protocol::H2)?;
        Some(format!(
            "**The limit on this machine** (the client on one core): plain HTTP/1.1 with sendfile \
             {:.1} MiB/s; TLS 1.3 from memory {:.1} MiB/s over h1 and {:.1} MiB/s over h2.",
            plain.median_mib_s(),
            h1.median_mib_s(),
            h2.median_mib_s()
        ))
    }

    /// Webship's cells ranked by how far they are behind the best peer of their
    /// cell or the TLS limit of their protocol, whichever is further: (cell,
    /// Webship's MiB/s, what it is compared with, that MiB/s, the ratio).
    pub(crate) fn furthest_behind(&self) -> Vec<(String, f64, String, f64, f64)> {
        let mut rows = Vec::new();
        for mode in self.modes().into_iter().filter(|m| *m != Mode::Limit) {
            for row in self.best_peers(mode) {
                let Some(webship) = row.webship else { continue };
                let mut against: Vec<(String, f64)> = Vec::new();
                if let Some(best) = row.best {
                    against.push((format!("best peer ({})", best.server), best.median_mib_s()));
                }
                if let Some(limit) = self.tls_limit(row.protocol) {
                    against.push(("the TLS limit".to_owned(), limit.median_mib_s()));
                }
                let w = webship.median_mib_s();
                if let Some((what, other)) =
                    against.into_iter().min_by(|a, b| (w / a.1).total_cmp(&(w / b.1)))
                {
                    let cell = format!("{} {}", mode.label(), row.protocol.label());
                    rows.push((cell, w, what, other, w / other));
                }
            }
        }
        rows.sort_by(|a, b| a.4.total_cmp(&b.4));
        rows
    }

    /// The modes measured, in a fixed order (direct first).
    fn modes(&self) -> Vec<Mode> {
        let mut modes: Vec<Mode> = self
            .series
            .iter()
            .map(|s| s.mode)
            .chain(self.gaps.iter().map(|g| g.mode))
            .collect();
        modes.sort();
        modes.dedup();
        modes
    }

    fn ratio(&self, of: (Mode, &str, Protocol), to: (Mode, &str, Protocol)) -> Option<(f64, f64)> {
        let (a, b) = (self.find(of.0, of.1, of.2)?, self.find(to.0, to.1, to.2)?);
        Some(self.ratio_of(a, b))
    }

    fn ratio_of(&self, a: &Series, b: &Series) -> (f64, f64) {
        (
            a.median_mib_s() / b.median_mib_s(),
            a.per_gb(a.cpu_ticks, self.ticks_per_s) / b.per_gb(b.cpu_ticks, self.ticks_per_s),
        )
    }

    /// Webship over the fastest peer of each protocol in `mode`.
    fn best_peers(&self, mode: Mode) -> Vec<BestPeer<'_>> {
        Protocol::ALL
            .into_iter()
            .map(|protocol| BestPeer {
                protocol,
                webship: self.find(mode, WEBSHIP, protocol),
                best: self
                    .series
                    .iter()
                    .filter(|s| s.mode == mode && s.protocol == protocol && !is_webship(s.server))
                    .max_by(|a, b| a.median_mib_s().total_cmp(&b.median_mib_s())),
                missing: self
                    .gaps
                    .iter()
                    .filter(|g| g.mode == mode && g.protocol == protocol && !is_webship(g.server))
                    .collect(),
            })
            .collect()
    }

    /// Webship's h3 against its own h2 (per mode) and against itself without GSO (direct).
    fn h3_ratios(&self) -> Vec<Ratio> {
        let mut ratios = Vec::new();
        for mode in self.modes() {
            let prefix = match mode {
                Mode::Limit => continue,
                Mode::Direct => "webship",
                Mode::Proxy => "proxy: webship",
                Mode::Passthrough => "passthrough: webship",
            };
            ratios.push(Ratio {
                label: format!("{prefix} h3 / webship h2"),
                values: self.ratio((mode, WEBSHIP, Protocol::H3), (mode, WEBSHIP, Protocol::H2)),
            });
            if mode == Mode::Direct && self.find(mode, WEBSHIP_NO_GSO, Protocol::H3).is_some() {
                ratios.push(Ratio {
                    label: "webship h3 gso=off / gso=on".to_owned(),
                    values: self.ratio(
                        (mode, WEBSHIP_NO_GSO, Protocol::H3),
                        (mode, WEBSHIP, Protocol::H3),
                    ),
                });
            }
        }
        ratios
    }

    /// `--scrape`: Webship scraped every second over Webship not scraped, per mode
    /// and protocol (the cost of metrics; 1.0 within noise is the goal).
    fn scrape_ratios(&self) -> Vec<Ratio> {
        let mut ratios = Vec::new();
        for mode in self.modes() {
            for protocol in Protocol::ALL {
                if self.find(mode, WEBSHIP_SCRAPED, protocol).is_none() {
                    continue;
                }
                ratios.push(Ratio {
                    label: format!("{} {}: scraped / not scraped", mode.label(), protocol.label()),
                    values: self.ratio((mode, WEBSHIP_SCRAPED, protocol), (mode, WEBSHIP, protocol)),
                });
            }
        }
        ratios
    }

    /// Each server's proxy cell over its direct cell, for the cells measured in both modes.
    fn proxy_over_direct(&self) -> Vec<(&'static str, Ratio)> {
        self.series
            .iter()
            .filter(|s| s.mode != Mode::Direct && s.mode != Mode::Limit)
            .filter_map(|proxied| {
                // Passthrough engines compare with Webship's own direct delivery.
                let server = if is_webship(proxied.server) {
                    WEBSHIP
                } else {
                    proxied.server
                };
                let direct = self.find(Mode::Direct, server, proxied.protocol)?;
                Some((
                    proxied.server,
                    Ratio {
                        label: format!("{} {}", proxied.mode.label(), proxied.protocol.label()),
                        values: Some(self.ratio_of(proxied, direct)),
                    },
                ))
            })
            .collect()
    }

    fn mode_heading(mode: Mode) -> &'static str {
        match mode {
            Mode::Limit => {
                "limit: the same client against servers that do the least: nginx over plain HTTP/1.1 \
                 with sendfile (no TLS), and a rustls server sending the fixture from memory (TLS 1.3, \
                 no disk, no file layer); no server under test can be measured above these"
            }
            Mode::Direct => "direct: each server sends the fixture from its own disk",
            Mode::Proxy => {
                "proxy: each server terminates TLS in front of one origin (nginx, plain HTTP on \
                 loopback, 1 worker); server CPU is the proxy's alone, the origin's is in its own column"
            }
            Mode::Passthrough => {
                "passthrough: each server routes by SNI to one TLS origin (Webship direct: h1/h2 over \
                 TCP, h3 over UDP with 1452-byte datagrams, as from a host across a network, unless \
                 --h3-mtu is given) and never decrypts; `webship` runs the default engine. Server CPU is \
                 the process's: the sockmap engine's redirection runs in kernel softirq and workqueue \
                 context, which no process is charged for"
            }
        }
    }

    pub(crate) fn markdown(&self) -> String {
        let mut out = String::new();
        let mtu = self
            .h3_mtu
            .map_or_else(|| "auto (the default)".to_owned(), |m| m.to_string());
        let _ = writeln!(
            out,
            "\nfixture {FIXTURE_LEN} bytes, {} accepted sample(s) per cell{}, {} worker(s) per server, \
             CLK_TCK {}, webship preflight: {}, h3_mtu_upper_bound_bytes: {mtu}",
            self.samples,
            if self.smoke { " (smoke: no peers)" } else { "" },
            self.workers,
            self.ticks_per_s,
            self.webship_kernel
        );
        let _ = writeln!(
            out,
            "\nA sample is accepted only with status 200 and exactly the fixture's {FIXTURE_LEN} bytes \
             (the clients compare every body with the fixture's generator as they read it, and each cell's \
             untimed first download is also checked by SHA-256), no packet loss \
             on the host during the sample (no TCP segment dropped, no UDP receive error) and no major page \
             fault in the server's process tree. CV: standard deviation / mean of the accepted MiB/s. Peak RSS: the server \
             tree's summed VmRSS, read every 50 ms during the accepted samples. % of limit: the median \
             over the TLS-from-memory limit of the same protocol."
        );
        if let Some(line) = self.limit_line() {
            let _ = writeln!(out, "\n{line}");
        }
        if !self.peers.is_empty() {
            let _ = writeln!(out, "\npeers: {}", self.peers.join("; "));
        }
        for mode in self.modes() {
            let proxy = mode != Mode::Direct;
            let _ = writeln!(out, "\n### {}\n", Self::mode_heading(mode));
            let _ = writeln!(
                out,
                "| server | protocol | accepted | rejected | median MiB/s | % of limit | CV % | min | max | \
                 server CPU-s/GB | client CPU-s/GB |{} host CPU-s/GB | peak RSS MiB | TLS / transport (checked download) |",
                if proxy { " origin CPU-s/GB |" } else { "" }
            );
            let _ = writeln!(
                out,
                "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|{}---:|---:|---|",
                if proxy { "---:|" } else { "" }
            );
            for s in self.series.iter().filter(|s| s.mode == mode) {
                let min = s.mib_s.iter().copied().fold(f64::INFINITY, f64::min);
                let max = s.mib_s.iter().copied().fold(0.0, f64::max);
                let origin = match s.origin_ticks {
                    Some(ticks) if proxy => format!(" {:.3} |", s.per_gb(ticks, self.ticks_per_s)),
                    _ if proxy => " ? |".to_owned(),
                    _ => String::new(),
                };
                let share = self
                    .share_of_limit(s)
                    .map_or_else(|| "-".to_owned(), |p| format!("{p:.0}"));
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {} | {:.1} | {share} | {:.1} | {min:.1} | {max:.1} | {:.3} | {:.3} |{origin} {:.3} | {:.1} | {} |",
                    s.server,
                    s.protocol.label(),
                    s.accepted(),
                    s.rejected.len(),
                    s.median_mib_s(),
                    s.cv_percent(),
                    s.per_gb(s.cpu_ticks, self.ticks_per_s),
                    s.per_gb(s.client_ticks, self.ticks_per_s),
                    s.per_gb(s.host_ticks, self.ticks_per_s),
                    s.peak_rss_mib(),
                    s.transport()
                );
            }
            if mode == Mode::Limit {
                continue;
            }
            let _ = writeln!(
                out,
                "\n| {} protocol | best peer | webship MiB/s | best peer MiB/s | throughput webship/best | \
                 CPU-s/GB webship/best | peers without this cell |",
                mode.label()
            );
            let _ = writeln!(out, "|---|---|---:|---:|---:|---:|---|");
            for row in self.best_peers(mode) {
                let missing: Vec<String> = row
                    .missing
                    .iter()
                    .map(|g| format!("{}: {}", g.server, g.reason))
                    .collect();
                let missing = if missing.is_empty() {
                    "-".to_owned()
                } else {
                    missing.join("; ")
                };
                let _ = match (row.webship, row.best) {
                    (Some(w), Some(b)) => {
                        let (throughput, cpu) = self.ratio_of(w, b);
                        writeln!(
                            out,
                            "| {} | {} | {:.1} | {:.1} | {throughput:.3} | {cpu:.3} | {missing} |",
                            row.protocol.label(),
                            b.server,
                            w.median_mib_s(),
                            b.median_mib_s()
                        )
                    }
                    (w, b) => writeln!(
                        out,
                        "| {} | {} | {} | {} | n/a | n/a | {missing} |",
                        row.protocol.label(),
                        b.map_or("none", |b| b.server),
                        w.map_or_else(|| "n/a".to_owned(), |w| format!("{:.1}", w.median_mib_s())),
                        b.map_or_else(|| "n/a".to_owned(), |b| format!("{:.1}", b.median_mib_s())),
                    ),
                };
            }
        }
        let behind = self.furthest_behind();
        if !behind.is_empty() {
            let _ = writeln!(
                out,
                "\n**Where Webship is furthest behind** (each Webship cell against the best peer of the cell \
                 or the TLS limit of its protocol, whichever is further ahead; worst first):\n"
            );
            let _ = writeln!(
                out,
                "| cell | webship MiB/s | against | their MiB/s | webship / theirs |"
            );
            let _ = writeln!(out, "|---|---:|---|---:|---:|");
            for (cell, webship, against, theirs, ratio) in behind {
                let _ = writeln!(
                    out,
                    "| {cell} | {webship:.1} | {against} | {theirs:.1} | {ratio:.3} |"
                );
            }
        }
        let _ = writeln!(out, "\n| h3 comparison | throughput | server CPU-s/GB |");
        let _ = writeln!(out, "|---|---:|---:|");
        for ratio in self.h3_ratios() {
            let _ = match ratio.values {
                Some((throughput, cpu)) => {
                    writeln!(out, "| {} | {throughput:.3} | {cpu:.3} |", ratio.label)
                }
                None => writeln!(out, "| {} | n/a | n/a |", ratio.label),
            };
        }
        let scrape = self.scrape_ratios();
        if !scrape.is_empty() {
            let _ = writeln!(
                out,
                "\n| metrics scraped every second | throughput | server CPU-s/GB |"
            );
            let _ = writeln!(out, "|---|---:|---:|");
            for ratio in scrape {
                let _ = match ratio.values {
                    Some((throughput, cpu)) => {
                        writeln!(out, "| {} | {throughput:.3} | {cpu:.3} |", ratio.label)
                    }
                    None => writeln!(out, "| {} | n/a | n/a |", ratio.label),
                };
            }
        }
        let proxy_over_direct = self.proxy_over_direct();
        if !proxy_over_direct.is_empty() {
            let _ = writeln!(
                out,
                "\n| proxy or passthrough / direct | protocol | throughput | server CPU-s/GB |"
            );
            let _ = writeln!(out, "|---|---|---:|---:|");
            for (server, ratio) in proxy_over_direct {
                if let Some((throughput, cpu)) = ratio.values {
                    let _ = writeln!(out, "| {server} | {} | {throughput:.3} | {cpu:.3} |", ratio.label);
                }
            }
        }
        if !self.gaps.is_empty() {
            let _ = writeln!(out, "\n| not measured | server | protocol | why |");
            let _ = writeln!(out, "|---|---|---|---|");
            for g in &self.gaps {
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {} |",
                    g.mode.label(),
                    g.server,
                    g.protocol.label(),
                    g.reason
                );
            }
        }
        let rejected: Vec<&Series> = self.series.iter().filter(|s| !s.rejected.is_empty()).collect();
        if !rejected.is_empty() {
            let _ = writeln!(out, "\nrejected samples:");
            for s in rejected {
                let _ = writeln!(
                    out,
                    "- {} {} {}: {}",
                    s.mode.label(),
                    s.server,
                    s.protocol.label(),
                    s.rejected.join("; ")
                );
            }
        }
        for section in &self.sections {
            let _ = write!(out, "\n### {}\n\n{}", section.title, section.markdown);
        }
        out
    }

    /// The results as JSON (report.json).
    pub(crate) fn json(&self) -> Value {
        let results: Vec<Value> = self.series.iter().map(|s| self.series_json(s)).collect();
        // `head`: the fields before the values, e.g. mode and protocol.
        let ratio_json = |mut head: Value, r: &Ratio, note: &str| {
            let fields = match r.values {
                Some((t, c)) => json!({"throughput": fixed(t, 4), "cpu_s_per_gb": fixed(c, 4)}),
                None => json!({"throughput": null, "cpu_s_per_gb": null, "note": note}),
            };
            if let (Value::Object(head), Value::Object(fields)) = (&mut head, fields) {
                head.extend(fields);
            }
            head
        };
        let best: Vec<Value> = self
            .modes()
            .into_iter()
            .filter(|mode| *mode != Mode::Limit)
            .flat_map(|mode| self.best_peers(mode).into_iter().map(move |r| (mode, r)))
            .map(|(mode, row)| {
                let values = row.webship.zip(row.best).map(|(w, b)| self.ratio_of(w, b));
                let reasons: Vec<String> = row
                    .missing
                    .iter()
                    .map(|g| format!("{}: {}", g.server, g.reason))
                    .collect();
                let head = json!({
                    "mode": mode.label(),
                    "protocol": row.protocol.label(),
                    "best_peer": row.best.map(|b| b.server),
                    "peers_without_cell": reasons.join("; "),
                });
                let ratio = Ratio {
                    label: String::new(),
                    values,
                };
                ratio_json(head, &ratio, "no peer has this cell")
            })
            .collect();
        let h3: Vec<Value> = self
            .h3_ratios()
            .iter()
            .map(|r| ratio_json(json!({"comparison": r.label}), r, "cell missing"))
            .collect();
        let scrape: Vec<Value> = self
            .scrape_ratios()
            .iter()
            .map(|r| ratio_json(json!({"comparison": r.label}), r, "cell missing"))
            .collect();
        let proxy_over_direct: Vec<Value> = self
            .proxy_over_direct()
            .iter()
            .map(|(server, r)| ratio_json(json!({"server": server, "protocol": r.label}), r, "cell missing"))
            .collect();
        let gaps: Vec<Value> = self
            .gaps
            .iter()
            .map(|g| {
                json!({
                    "mode": g.mode.label(),
                    "server": g.server,
                    "protocol": g.protocol.label(),
                    "reason": g.reason,
                })
            })
            .collect();
        let limit = |server: &str, protocol: Protocol| {
            self.find(Mode::Limit, server, protocol)
                .map(|s| fixed(s.median_mib_s(), 3))
        };
        let behind: Vec<Value> = self
            .furthest_behind()
            .iter()
            .map(|(cell, webship, against, theirs, ratio)| {
                json!({
                    "cell": cell,
                    "webship_mib_s": fixed(*webship, 3),
                    "against": against,
                    "their_mib_s": fixed(*theirs, 3),
                    "ratio": fixed(*ratio, 4),
                })
            })
            .collect();
        let sections: Vec<Value> = self
            .sections
            .iter()
            .map(|s| json!({"title": s.title, "rows": s.json}))
            .collect();
        json!({
            "fixture_bytes": FIXTURE_LEN,
            "samples": self.samples,
            "smoke": self.smoke,
            "workers": self.workers,
            "webship_preflight": self.webship_kernel,
            "h3_mtu_upper_bound_bytes": self.h3_mtu,
            "peers": self.peers,
            "limit_on_this_machine": {
                "plain_sendfile_h1_mib_s": limit(LIMIT_PLAIN, Protocol::H1),
                "tls_memory_h1_mib_s": limit(LIMIT_TLS, Protocol::H1),
                "tls_memory_h2_mib_s": limit(LIMIT_TLS, Protocol::H2),
            },
            "furthest_behind": behind,
            "results": results,
            "ratios_webship_over_best_peer": best,
            "ratios_h3": h3,
            "ratios_scrape": scrape,
            "ratios_proxy_over_direct": proxy_over_direct,
            "not_measured": gaps,
            "scenarios": sections,
        })
    }

    /// One cell's results.
    fn series_json(&self, s: &Series) -> Value {
        let mut row = json!({
            "mode": s.mode.label(),
            "server": s.server,
            "protocol": s.protocol.label(),
            "accepted": s.accepted(),
            "rejected": s.rejected.len(),
            "rejected_reasons": s.rejected,
            "median_mib_s": fixed(s.median_mib_s(), 3),
            "cv_percent": fixed(s.cv_percent(), 2),
            "samples_mib_s": s.mib_s.iter().map(|v| fixed(*v, 3)).collect::<Vec<_>>(),
            "cpu_s_per_gb": fixed(s.per_gb(s.cpu_ticks, self.ticks_per_s), 4),
            "client_cpu_s_per_gb": fixed(s.per_gb(s.client_ticks, self.ticks_per_s), 4),
            "peak_rss_mib": fixed(s.peak_rss_mib(), 1),
            "tls": s.notes,
        });
        if let Some(ticks) = s.origin_ticks {
            row["origin_cpu_s_per_gb"] = json!(fixed(s.per_gb(ticks, self.ticks_per_s), 4));
        }
        if let Some((client, server)) = s.udp_drops {
            row["udp_rcvbuf_drops_client"] = json!(client);
            row["udp_rcvbuf_drops_server"] = json!(server);
        }
        row
    }

    /// [`Report::json`] as report.json holds it.
    pub(crate) fn json_text(&self) -> String {
        format!("{}\n", self.json())
    }

    /// A horizontal bar chart of the median MiB/s, one bar per cell (Webship blue,
    /// peers grey, the limit green) and one per scenario row (orange), as plain SVG.
    pub(crate) fn svg(&self) -> String {
        const LABEL_W: f64 = 300.0;
        const BAR_W: f64 = 520.0;
        const ROW_H: f64 = 22.0;
        const TOP: f64 = 40.0;
        let mut ordered: Vec<&Series> = self.series.iter().collect();
        ordered.sort_by_key(|s| (s.mode, s.protocol.label(), !is_webship(s.server)));
        let mut bars: Vec<(String, f64, &str)> = ordered
            .into_iter()
            .map(|s| {
                let fill = if is_webship(s.server) {
                    "#2b6cb0"
                } else if is_limit(s.server) {
                    "#2f855a"
                } else {
                    "#a0aec0"
                };
                let label = format!("{} {} {}", s.mode.label(), s.protocol.label(), s.server);
                (label, s.median_mib_s(), fill)
            })
            .collect();
        for section in &self.sections {
            bars.extend(
                section
                    .bars
                    .iter()
                    .map(|(label, v)| (label.clone(), *v, "#dd6b20")),
            );
        }
        let peak = bars.iter().map(|b| b.1).fold(0.0, f64::max).max(1.0);
        let height = TOP + ROW_H * bars.len() as f64 + 20.0;
        let width = LABEL_W + BAR_W + 100.0;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" \
             font-family=\"sans-serif\" font-size=\"12\">"
        );
        let _ = writeln!(
            out,
            "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"10\" y=\"22\" font-size=\"15\">\
             Median MiB/s of a {FIXTURE_LEN}-byte download ({} accepted sample(s) per cell)</text>",
            self.samples
        );
        for (i, (label, value, fill)) in bars.into_iter().enumerate() {
            let y = TOP + ROW_H * i as f64;
            let len = BAR_W * value / peak;
            let label = xml_escape(&label);
            let _ = writeln!(
                out,
                "<text x=\"{:.0}\" y=\"{:.0}\" text-anchor=\"end\">{label}</text>\
                 <rect x=\"{LABEL_W}\" y=\"{:.0}\" width=\"{len:.1}\" height=\"{:.0}\" fill=\"{fill}\"/>\
                 <text x=\"{:.1}\" y=\"{:.0}\">{value:.1}</text>",
                LABEL_W - 8.0,
                y + 15.0,
                y + 3.0,
                ROW_H - 6.0,
                LABEL_W + len + 6.0,
                y + 15.0,
            );
        }
        out.push_str("</svg>\n");
        out
    }

    /// Writes report.md, report.json and report.svg into `dir`, creating it.
    pub(crate) fn write_files(&self, dir: &Path) -> Result<()> {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        for (name, text) in [
            ("report.md", self.markdown()),
            ("report.json", self.json_text()),
            ("report.svg", self.svg()),
        ] {
            let path = dir.join(name);
            fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    }
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// `v` rounded to `places` decimals: the precision the figures have, and all a
/// reader of the JSON needs. Not finite (no samples) becomes null in JSON.
pub(crate) fn fixed(v: f64, places: i32) -> f64 {
    let scale = 10f64.powi(places);
    (v * scale).round() / scale
}

/// The nearest-rank percentile (so p99 of a few samples is their maximum); None
/// for no samples.
pub(crate) fn percentile(v: &[f64], p: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut sorted = v.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len());
    Some(sorted[rank - 1])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::measure::{LIGHTTPD, NGINX};

    fn series(mode: Mode, server: &'static str, protocol: Protocol, mib_s: f64, ticks: u64) -> Series {
        let mut s = Series::new(mode, server, protocol, String::new());
        s.mib_s.push(mib_s);
        s.cpu_ticks = ticks;
        s.bytes = FIXTURE_LEN;
        s
    }

    fn report(series: Vec<Series>) -> Report {
        Report {
            series,
            ticks_per_s: 100.0,
            samples: 1,
            workers: 1,
            h3_mtu: None,
            webship_kernel: "x".into(),
            gaps: vec![Gap::new(
                Mode::Direct,
                Protocol::H3,
                NGINX,
                "nginx 1.22 has no HTTP/3".into(),
            )],
            peers: vec!["nginx: /usr/sbin/nginx (nginx 1.22)".into()],
            smoke: false,
            sections: Vec::new(),
        }
    }

    #[test]
    fn best_peer_and_gaps() {
        let mut slow = series(Mode::Direct, LIGHTTPD, Protocol::H2, 150.0, 30);
        slow.rejected.push("1 major page fault(s) in the server".into());
        let report = report(vec![
            series(Mode::Direct, WEBSHIP, Protocol::H2, 100.0, 50),
            series(Mode::Direct, NGINX, Protocol::H2, 200.0, 25),
            slow,
            series(Mode::Direct, WEBSHIP, Protocol::H3, 50.0, 100),
        ]);
        let md = report.markdown();
        assert!(
            md.contains("| h2 | nginx | 100.0 | 200.0 | 0.500 | 2.000 | - |"),
            "{md}"
        );
        assert!(
            md.contains("| h3 | none | 50.0 | n/a | n/a | n/a | nginx: nginx 1.22 has no HTTP/3 |"),
            "{md}"
        );
        assert!(md.contains("| webship h3 / webship h2 | 0.500 | 2.000 |"), "{md}");
        assert!(
            md.contains("| direct | nginx | h3 | nginx 1.22 has no HTTP/3 |"),
            "{md}"
        );
        assert!(md.contains("| lighttpd | h2 | 1 | 1 | 150.0 |"), "{md}");
        assert!(
            md.contains("- direct lighttpd h2: 1 major page fault(s) in the server"),
            "{md}"
        );
        assert!(!md.contains("proxy"), "{md}");
        let json: Value = serde_json::from_str(&report.json_text()).expect("valid JSON");
        let best = &json["ratios_webship_over_best_peer"];
        assert!(
            best.as_array()
                .is_some_and(|rows| rows.iter().any(|r| r["best_peer"] == "nginx")),
            "{json}"
        );
        assert_eq!(
            json["not_measured"][0]["reason"], "nginx 1.22 has no HTTP/3",
            "{json}"
        );
        let lighttpd = json["results"]
            .as_array()
            .and_then(|rows| rows.iter().find(|r| r["server"] == LIGHTTPD))
            .expect("lighttpd's row");
        assert_eq!(lighttpd["rejected"], 1, "{json}");
        let svg = report.svg();
        assert_eq!(svg.matches("<rect x=").count(), 4, "{svg}");
        assert!(svg.contains(">direct h2 nginx</text>"), "{svg}");
    }

    #[test]
    fn limit_and_furthest_behind() {
        let report = report(vec![
            series(Mode::Limit, LIMIT_PLAIN, Protocol::H1, 1000.0, 10),
            series(Mode::Limit, LIMIT_TLS, Protocol::H1, 800.0, 10),
            series(Mode::Limit, LIMIT_TLS, Protocol::H2, 400.0, 10),
            series(Mode::Direct, WEBSHIP, Protocol::H1, 600.0, 50),
            series(Mode::Direct, NGINX, Protocol::H1, 500.0, 50),
            series(Mode::Direct, WEBSHIP, Protocol::H2, 300.0, 50),
            series(Mode::Direct, NGINX, Protocol::H2, 360.0, 50),
        ]);
        let md = report.markdown();
        assert!(
            md.contains(
                "plain HTTP/1.1 with sendfile 1000.0 MiB/s; TLS 1.3 from memory 800.0 MiB/s over h1 and 400.0 MiB/s over h2."
            ),
            "{md}"
        );
        // 600 of the h1 limit's 800, and no share for the limit itself.
        assert!(md.contains("| webship | h1 | 1 | 0 | 600.0 | 75 |"), "{md}");
        assert!(
            md.contains("| TLS 1.3 from memory, rustls | h1 | 1 | 0 | 800.0 | - |"),
            "{md}"
        );
        // No best-peer table for the limit.
        assert!(!md.contains("| limit protocol |"), "{md}");
        // h1: 600 is 0.75 of the limit (800) and 1.2 of nginx; h2: 300 is 0.75 of the
        // limit (400) and 0.83 of nginx. Each row names the one further ahead.
        let behind = report.furthest_behind();
        assert_eq!(behind.len(), 2);
        assert!(behind.iter().all(|row| row.2 == "the TLS limit"), "{behind:?}");
        assert!((behind[0].4 - 0.75).abs() < 1e-9);
        let json = report.json();
        assert_eq!(
            json["limit_on_this_machine"],
            json!({
                "plain_sendfile_h1_mib_s": 1000.0,
                "tls_memory_h1_mib_s": 800.0,
                "tls_memory_h2_mib_s": 400.0,
            }),
            "{json}"
        );
        assert!(
            json["furthest_behind"][0]["cell"]
                .as_str()
                .is_some_and(|cell| cell.starts_with("direct h")),
            "{json}"
        );
    }

    #[test]
    fn cv_of_samples() {
        let mut s = series(Mode::Direct, WEBSHIP, Protocol::H1, 90.0, 1);
        s.mib_s.push(110.0);
        assert!((s.cv_percent() - 10.0).abs() < 1e-9);
    }

    #[test]
    fn proxy_cells_beside_direct() {
        let mut proxied = series(Mode::Proxy, WEBSHIP, Protocol::H2, 50.0, 100);
        proxied.origin_ticks = Some(10);
        let report = report(vec![
            series(Mode::Direct, WEBSHIP, Protocol::H2, 100.0, 50),
            series(Mode::Direct, NGINX, Protocol::H2, 200.0, 25),
            proxied,
            series(Mode::Proxy, NGINX, Protocol::H2, 25.0, 200),
        ]);
        let md = report.markdown();
        assert!(md.contains("| proxy protocol | best peer |"), "{md}");
        assert!(
            md.contains("| h2 | nginx | 50.0 | 25.0 | 2.000 | 0.500 | - |"),
            "{md}"
        );
        // Origin: 0.1 s over 0.0999 GB.
        assert!(
            md.contains("| webship | h2 | 1 | 0 | 50.0 | - | 0.0 | 50.0 | 50.0 | 10.006 | 0.000 | 1.001 |"),
            "{md}"
        );
        assert!(md.contains("| webship | proxy h2 | 0.500 | 2.000 |"), "{md}");
        assert!(md.contains("| nginx | proxy h2 | 0.125 | 8.000 |"), "{md}");
        let json = report.json();
        let rows = json["results"].as_array().expect("results");
        assert!(rows.iter().any(|r| r["origin_cpu_s_per_gb"] == 1.0006), "{json}");
        assert!(
            json["ratios_proxy_over_direct"]
                .as_array()
                .expect("ratios")
                .contains(&json!({
                    "server": "webship",
                    "protocol": "proxy h2",
                    "throughput": 0.5,
                    "cpu_s_per_gb": 2.0,
                })),
            "{json}"
        );
    }
}
