//! Debian's Prometheus (`/usr/bin/prometheus`) scraping webship's admin listeners
//! every second, on a free loopback port with its storage in a temporary directory;
//! stopped (SIGTERM, then SIGKILL) when dropped, by the test kit's process guard.
//! Queries go through its HTTP API with curl.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use webship_testkit::process::{start_on_free_port, Logs, Process};
use webship_testkit::wait::eventually;

pub const PROMETHEUS: &str = "/usr/bin/prometheus";

pub struct Prometheus {
    pub addr: SocketAddr,
    process: Process,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    /// Starts Prometheus scraping `targets` (admin listeners) every second; returns
    /// once it says it is ready.
    pub fn start(targets: &[SocketAddr]) -> Prometheus {
        assert!(
            Path::new(PROMETHEUS).exists(),
            "{PROMETHEUS} is missing (Debian package prometheus; `cargo xtask deps` installs it)"
        );
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let list: Vec<String> = targets.iter().map(|t| format!("'{t}'")).collect();
        let config = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n\
             scrape_configs:\n  - job_name: webship\n    static_configs:\n      - targets: [{}]\n",
            list.join(", ")
        );
        let config_path = d.join("prometheus.yml");
        std::fs::write(&config_path, config).unwrap();
        let log = d.join("prometheus.log");
        let (process, port) = start_on_free_port(None, Duration::from_secs(30), |port| {
            let mut command = Command::new(PROMETHEUS);
            command
                .arg(format!("--config.file={}", config_path.display()))
                .arg(format!("--storage.tsdb.path={}", d.join("data").display()))
                .arg(format!("--web.listen-address=127.0.0.1:{port}"))
                .arg("--log.level=warn");
            Process::spawn("prometheus", &mut command, Logs::one(log.clone()))
        })
        .unwrap_or_else(|e| panic!("{e:#}"));
        let prometheus = Prometheus {
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            process,
            _dir: dir,
        };
        let ready = eventually(Duration::from_secs(30), || {
            prometheus.get("/-/ready", &[]).0 == 200
        });
        assert!(
            ready,
            "Prometheus never became ready:\n{}",
            prometheus.process.log()
        );
        prometheus
    }

    /// GET `path` with `params` (URL-encoded by curl): status and body.
    fn get(&self, path: &str, params: &[(&str, &str)]) -> (u16, String) {
        let mut command = Command::new("curl");
        command.args(["--silent", "--max-time", "10", "--get", "-w", "\n%{http_code}"]);
        for (name, value) in params {
            command.arg("--data-urlencode").arg(format!("{name}={value}"));
        }
        let out = command
            .arg(format!("http://{}{path}", self.addr))
            .output()
            .expect("curl");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
        (code.trim().parse().unwrap_or(0), body.to_owned())
    }

    /// An instant query's result vector (`data.result`).
    pub fn query(&self, query: &str) -> Vec<Value> {
        let (status, body) = self.get("/api/v1/query", &[("query", query)]);
        assert_eq!(status, 200, "query {query}: {body}");
        let value: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
        assert_eq!(value["status"], "success", "query {query}: {body}");
        value["data"]["result"].as_array().cloned().unwrap_or_default()
    }

    /// The value of a query whose result is one sample (0 when it has none: a
    /// series that never became non-zero); more than one is a test's mistake.
    pub fn value(&self, query: &str) -> f64 {
        let result = self.query(query);
        assert!(
            result.len() <= 1,
            "{query} has {} series: {result:?}",
            result.len()
        );
        result.first().map_or(0.0, |r| {
            r["value"][1]
                .as_str()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{query}: {r}"))
        })
    }

    /// Waits (up to `limit`) until every target has been scraped after `after`
    /// (seconds since the epoch) and is up.
    pub fn wait_scraped_after(&self, after: f64, targets: usize, limit: Duration) -> bool {
        eventually(limit, || {
            let result = self.query("timestamp(up == 1)");
            result.len() == targets
                && result.iter().all(|r| {
                    r["value"][1]
                        .as_str()
                        .and_then(|v| v.parse::<f64>().ok())
                        .is_some_and(|t| t > after)
                })
        })
    }

    pub fn log(&self) -> String {
        self.process.log()
    }
}
