//! Results of the `download` benchmark: per-cell series, the Markdown tables and the JSON.

use std::fmt::Write as _;

use crate::clients::{Protocol, Sample};
use crate::fixture::FIXTURE_BYTES;
use crate::measure::{Mode, NGINX, WEBSHIP, WEBSHIP_NO_GSO};

const MIB: f64 = 1_048_576.0;
const GB: f64 = 1e9;

/// All samples of one cell (mode, server, protocol).
#[derive(Debug)]
pub struct Series {
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
    /// Proxy mode: the origin's CPU over the same samples (None in direct mode).
    pub origin_ticks: Option<u64>,
    pub bytes: u64,
    /// h3: datagrams the kernel dropped for a full receive buffer, summed over
    /// the timed samples, at the client's socket and at the server's (None: unknown).
    pub udp_drops: Option<(Option<u64>, Option<u64>)>,
}

impl Series {
    pub fn new(mode: Mode, server: &'static str, protocol: Protocol, notes: String) -> Self {
        Self {
            mode,
            server,
            protocol,
            notes,
            mib_s: Vec::new(),
            cpu_ticks: 0,
            client_ticks: 0,
            origin_ticks: None,
            bytes: 0,
            udp_drops: None,
        }
    }

    pub fn add_udp_drops(&mut self, client: Option<u64>, server: Option<u64>) {
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

    pub fn add(&mut self, sample: &Sample, server_ticks: u64, origin_ticks: Option<u64>) {
        self.mib_s.push(sample.size as f64 / sample.seconds / MIB);
        self.cpu_ticks += server_ticks;
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
        } else if sorted.len() % 2 == 0 {
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
    /// None where the denominator cell does not exist (nginx over h3).
    values: Option<(f64, f64)>,
}

#[derive(Debug)]
pub struct Report {
    pub series: Vec<Series>,
    pub ticks_per_s: f64,
    pub samples: u32,
    pub workers: u32,
    /// `--h3-mtu`, passed to Webship as `h3_mtu_upper_bound_bytes` (None: Webship's default).
    pub h3_mtu: Option<u16>,
    /// What Webship's preflight enabled, e.g. "ktls=missing bbr=yes": without
    /// kTLS its h1 path stays in userspace TLS, which changes what is compared.
    pub webship_kernel: String,
    /// "nginx 1.22", for the h3 cell it cannot serve.
    pub nginx_version: String,
}

impl Report {
    fn find(&self, mode: Mode, server: &str, protocol: Protocol) -> Option<&Series> {
        self.series
            .iter()
            .find(|s| s.mode == mode && s.server == server && s.protocol == protocol)
    }

    /// The modes measured, in a fixed order (direct first).
    fn modes(&self) -> Vec<Mode> {
        let mut modes: Vec<Mode> = self.series.iter().map(|s| s.mode).collect();
        modes.sort();
        modes.dedup();
        modes
    }

    fn ratio(&self, of: (Mode, &str, Protocol), to: (Mode, &str, Protocol)) -> Option<(f64, f64)> {
        let (a, b) = (self.find(of.0, of.1, of.2)?, self.find(to.0, to.1, to.2)?);
        Some((
            a.median_mib_s() / b.median_mib_s(),
            a.per_gb(a.cpu_ticks, self.ticks_per_s) / b.per_gb(b.cpu_ticks, self.ticks_per_s),
        ))
    }

    /// Webship over nginx in one mode, one per protocol.
    fn peer_ratios(&self, mode: Mode) -> Vec<Ratio> {
        Protocol::ALL
            .into_iter()
            .map(|protocol| Ratio {
                label: protocol.label().to_owned(),
                values: self.ratio((mode, WEBSHIP, protocol), (mode, NGINX, protocol)),
            })
            .collect()
    }

    /// Webship's h3 against its own h2 (per mode) and against itself without GSO (direct).
    fn h3_ratios(&self) -> Vec<Ratio> {
        let mut ratios = Vec::new();
        for mode in self.modes() {
            let prefix = match mode {
                Mode::Direct => "webship",
                Mode::Proxy => "proxy: webship",
            };
            ratios.push(Ratio {
                label: format!("{prefix} h3 / webship h2"),
                values: self.ratio((mode, WEBSHIP, Protocol::H3), (mode, WEBSHIP, Protocol::H2)),
            });
            if mode == Mode::Direct {
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

    /// Each server's proxy cell over its direct cell, per protocol (both modes measured).
    fn proxy_over_direct(&self) -> Vec<(&'static str, Ratio)> {
        let mut ratios = Vec::new();
        for server in [WEBSHIP, NGINX] {
            for protocol in Protocol::ALL {
                ratios.push((
                    server,
                    Ratio {
                        label: protocol.label().to_owned(),
                        values: self.ratio((Mode::Proxy, server, protocol), (Mode::Direct, server, protocol)),
                    },
                ));
            }
        }
        ratios
    }

    fn no_h3_note(&self) -> String {
        format!("{} has no HTTP/3", self.nginx_version)
    }

    fn mode_heading(mode: Mode) -> &'static str {
        match mode {
            Mode::Direct => "direct: each server sends the fixture from its own disk",
            Mode::Proxy => {
                "proxy: each server terminates TLS in front of one origin (nginx, plain HTTP on \
                 loopback, 1 worker); server CPU is the proxy's alone, the origin's is in its own column"
            }
        }
    }

    pub fn markdown(&self) -> String {
        let mut out = String::new();
        let mtu = self
            .h3_mtu
            .map_or_else(|| "default".to_owned(), |m| m.to_string());
        let _ = writeln!(
            out,
            "\nfixture {FIXTURE_BYTES} bytes, {} samples, {} worker(s) per server, CLK_TCK {}, \
             webship preflight: {}, h3_mtu_upper_bound_bytes: {mtu}",
            self.samples, self.workers, self.ticks_per_s, self.webship_kernel
        );
        for mode in self.modes() {
            let proxy = mode == Mode::Proxy;
            let _ = writeln!(out, "\n### {}\n", Self::mode_heading(mode));
            let _ = writeln!(
                out,
                "| server | protocol | median MiB/s | min | max | server CPU-s/GB | client CPU-s/GB |{} TLS / transport (checked download) |",
                if proxy { " origin CPU-s/GB |" } else { "" }
            );
            let _ = writeln!(
                out,
                "|---|---|---:|---:|---:|---:|---:|{}---|",
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
                let _ = writeln!(
                    out,
                    "| {} | {} | {:.1} | {min:.1} | {max:.1} | {:.3} | {:.3} |{origin} {} |",
                    s.server,
                    s.protocol.label(),
                    s.median_mib_s(),
                    s.per_gb(s.cpu_ticks, self.ticks_per_s),
                    s.per_gb(s.client_ticks, self.ticks_per_s),
                    s.transport()
                );
            }
            let _ = writeln!(
                out,
                "\n| {} protocol | throughput webship/nginx | CPU-s/GB webship/nginx |",
                mode.label()
            );
            let _ = writeln!(out, "|---|---:|---:|");
            for ratio in self.peer_ratios(mode) {
                let _ = match ratio.values {
                    Some((throughput, cpu)) => {
                        writeln!(out, "| {} | {throughput:.3} | {cpu:.3} |", ratio.label)
                    }
                    None => {
                        let na = format!("n/a ({})", self.no_h3_note());
                        writeln!(out, "| {} | {na} | {na} |", ratio.label)
                    }
                };
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
        if self.modes().len() > 1 {
            let _ = writeln!(
                out,
                "\n| proxy / direct | protocol | throughput | server CPU-s/GB |"
            );
            let _ = writeln!(out, "|---|---|---:|---:|");
            for (server, ratio) in self.proxy_over_direct() {
                let _ = match ratio.values {
                    Some((throughput, cpu)) => {
                        writeln!(out, "| {server} | {} | {throughput:.3} | {cpu:.3} |", ratio.label)
                    }
                    None if server == NGINX => writeln!(
                        out,
                        "| {server} | {} | n/a ({}) | n/a |",
                        ratio.label,
                        self.no_h3_note()
                    ),
                    None => writeln!(out, "| {server} | {} | n/a | n/a |", ratio.label),
                };
            }
        }
        out
    }

    pub fn json(&self) -> String {
        let results: Vec<String> = self
            .series
            .iter()
            .map(|s| {
                let samples: Vec<String> = s.mib_s.iter().map(|v| format!("{v:.3}")).collect();
                let count = |n: Option<u64>| n.map_or_else(|| "null".to_owned(), |n| n.to_string());
                let drops = s.udp_drops.map_or_else(String::new, |(client, server)| {
                    format!(
                        ",\"udp_rcvbuf_drops_client\":{},\"udp_rcvbuf_drops_server\":{}",
                        count(client),
                        count(server)
                    )
                });
                let origin = s.origin_ticks.map_or_else(String::new, |ticks| {
                    format!(
                        ",\"origin_cpu_s_per_gb\":{:.4}",
                        s.per_gb(ticks, self.ticks_per_s)
                    )
                });
                format!(
                    "{{\"mode\":\"{}\",\"server\":{},\"protocol\":\"{}\",\"median_mib_s\":{:.3},\"samples_mib_s\":[{}],\
                     \"cpu_s_per_gb\":{:.4},\"client_cpu_s_per_gb\":{:.4}{origin},\"tls\":{}{drops}}}",
                    s.mode.label(),
                    json_string(s.server),
                    s.protocol.label(),
                    s.median_mib_s(),
                    samples.join(","),
                    s.per_gb(s.cpu_ticks, self.ticks_per_s),
                    s.per_gb(s.client_ticks, self.ticks_per_s),
                    json_string(&s.notes)
                )
            })
            .collect();
        // `head`: the fields before the values, e.g. "\"mode\":\"proxy\",\"protocol\":\"h1\"".
        let ratio_json = |head: String, r: &Ratio, note: &str| match r.values {
            Some((t, c)) => format!("{{{head},\"throughput\":{t:.4},\"cpu_s_per_gb\":{c:.4}}}"),
            None => format!(
                "{{{head},\"throughput\":null,\"cpu_s_per_gb\":null,\"note\":{}}}",
                json_string(note)
            ),
        };
        let peer: Vec<String> = self
            .modes()
            .into_iter()
            .flat_map(|mode| self.peer_ratios(mode).into_iter().map(move |r| (mode, r)))
            .map(|(mode, r)| {
                let head = format!(
                    "\"mode\":\"{}\",\"protocol\":{}",
                    mode.label(),
                    json_string(&r.label)
                );
                ratio_json(head, &r, &self.no_h3_note())
            })
            .collect();
        let h3: Vec<String> = self
            .h3_ratios()
            .iter()
            .map(|r| {
                ratio_json(
                    format!("\"comparison\":{}", json_string(&r.label)),
                    r,
                    "cell missing",
                )
            })
            .collect();
        let proxy_over_direct: Vec<String> = if self.modes().len() > 1 {
            self.proxy_over_direct()
                .iter()
                .map(|(server, r)| {
                    let head = format!(
                        "\"server\":{},\"protocol\":{}",
                        json_string(server),
                        json_string(&r.label)
                    );
                    ratio_json(head, r, "cell missing")
                })
                .collect()
        } else {
            Vec::new()
        };
        let mtu = self.h3_mtu.map_or_else(|| "null".to_owned(), |m| m.to_string());
        format!(
            "{{\"fixture_bytes\":{FIXTURE_BYTES},\"samples\":{},\"workers\":{},\"webship_preflight\":{},\
             \"h3_mtu_upper_bound_bytes\":{mtu},\"results\":[{}],\"ratios_webship_over_nginx\":[{}],\
             \"ratios_h3\":[{}],\"ratios_proxy_over_direct\":[{}]}}\n",
            self.samples,
            self.workers,
            json_string(&self.webship_kernel),
            results.join(","),
            peer.join(","),
            h3.join(","),
            proxy_over_direct.join(",")
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
    fn json_escapes() {
        assert_eq!(json_string("a\"b\\c\n"), "\"a\\\"b\\\\c\\u000a\"");
    }

    fn series(mode: Mode, server: &'static str, protocol: Protocol, mib_s: f64, ticks: u64) -> Series {
        let mut s = Series::new(mode, server, protocol, String::new());
        s.mib_s.push(mib_s);
        s.cpu_ticks = ticks;
        s.bytes = FIXTURE_BYTES;
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
            nginx_version: "nginx 1.22".into(),
        }
    }

    #[test]
    fn h3_has_no_nginx_ratio() {
        let report = report(vec![
            series(Mode::Direct, WEBSHIP, Protocol::H2, 100.0, 50),
            series(Mode::Direct, NGINX, Protocol::H2, 200.0, 25),
            series(Mode::Direct, WEBSHIP, Protocol::H3, 50.0, 100),
        ]);
        let md = report.markdown();
        assert!(md.contains("| h2 | 0.500 | 2.000 |"), "{md}");
        assert!(md.contains("| h3 | n/a (nginx 1.22 has no HTTP/3) |"), "{md}");
        assert!(md.contains("| webship h3 / webship h2 | 0.500 | 2.000 |"), "{md}");
        assert!(!md.contains("proxy"), "{md}");
        let json = report.json();
        assert!(json.contains("\"note\":\"nginx 1.22 has no HTTP/3\""), "{json}");
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
        assert!(
            md.contains("| proxy protocol | throughput webship/nginx |"),
            "{md}"
        );
        assert!(md.contains("| h2 | 2.000 | 0.500 |"), "{md}");
        // Origin: 0.1 s over 0.0999 GB.
        assert!(
            md.contains("| webship | h2 | 50.0 | 50.0 | 50.0 | 10.006 | 0.000 | 1.001 |"),
            "{md}"
        );
        assert!(md.contains("| webship | h2 | 0.500 | 2.000 |"), "{md}");
        assert!(md.contains("| nginx | h2 | 0.125 | 8.000 |"), "{md}");
        assert!(
            md.contains("| nginx | h3 | n/a (nginx 1.22 has no HTTP/3) | n/a |"),
            "{md}"
        );
        let json = report.json();
        assert!(json.contains("\"origin_cpu_s_per_gb\":1.0006"), "{json}");
        assert!(
            json.contains(
                "{\"server\":\"webship\",\"protocol\":\"h2\",\"throughput\":0.5000,\"cpu_s_per_gb\":2.0000}"
            ),
            "{json}"
        );
    }
}
