//! The Grafana dashboard (`packaging/grafana/webship.json`) must not drift from the
//! exporter: every metric its queries name is documented in docs/metrics.md (whose
//! own test ties it to what the daemon writes), and every query is valid PromQL as
//! Prometheus' `promtool` reads it (each becomes a recording rule of a rules file,
//! with Grafana's variables replaced by values).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

const PROMTOOL: &str = "/usr/bin/promtool";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn dashboard() -> Value {
    let path = root().join("packaging/grafana/webship.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: not JSON: {e}", path.display()))
}

/// Every panel, rows' nested panels included.
fn panels(dashboard: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    for p in dashboard["panels"].as_array().expect("a `panels` array") {
        out.push(p);
        if let Some(nested) = p["panels"].as_array() {
            out.extend(nested);
        }
    }
    out
}

/// (panel title, expression) for every query of every panel.
fn expressions(dashboard: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for p in panels(dashboard) {
        let title = p["title"].as_str().unwrap_or("?").to_owned();
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"]
                .as_str()
                .unwrap_or_else(|| panic!("panel {title:?}: a target without `expr`"));
            out.push((title.clone(), expr.to_owned()));
        }
    }
    out
}

/// The metric names an expression selects: identifiers followed by a selector
/// (`{` or `[`), and any identifier with a metric prefix (a bare name). Label names
/// are followed by an operator, functions by `(`, so neither is taken.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let bytes = expr.as_bytes();
    let mut names = BTreeSet::new();
    let mut i = 0;
    // Inside `{…}` everything is labels and quoted values.
    let mut in_braces = false;
    let mut in_string = false;
    while i < bytes.len() {
        let c = bytes[i];
        if in_string {
            if c == b'\\' {
                i += 1;
            } else if c == b'"' {
                in_string = false;
            }
            i += 1;
            continue;
        }
        match c {
            b'"' => in_string = true,
            b'{' => in_braces = true,
            b'}' => in_braces = false,
            _ => {}
        }
        if !in_braces && (c.is_ascii_alphabetic() || c == b'_') && (i == 0 || !is_ident(bytes[i - 1])) {
            let start = i;
            while i < bytes.len() && is_ident(bytes[i]) {
                i += 1;
            }
            let ident = &expr[start..i];
            let next = expr[i..].trim_start().chars().next();
            let prefixed = ident.starts_with("webship_") || ident.starts_with("process_");
            // `by (a, b)` lists labels: `(` follows `by`, not the labels.
            if prefixed || matches!(next, Some('{') | Some('[')) {
                names.insert(ident.to_owned());
            }
            continue;
        }
        i += 1;
    }
    names
}

fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_' || c == b':'
}

/// The documented name a series name belongs to: a histogram's `_bucket`, `_sum`
/// and `_count` series are documented under the histogram's name.
fn documented(docs: &str, name: &str) -> bool {
    let listed = |n: &str| docs.contains(&format!("`{n}`"));
    listed(name)
        || ["_bucket", "_sum", "_count"]
            .iter()
            .any(|s| name.strip_suffix(s).is_some_and(listed))
}

#[test]
fn the_dashboard_is_grafana_json_with_the_promised_variables() {
    let d = dashboard();
    assert!(d["title"].is_string() && d["uid"].is_string());
    assert!(
        d["schemaVersion"].as_u64().is_some_and(|v| v >= 30),
        "schemaVersion"
    );
    let vars = d["templating"]["list"].as_array().expect("templating.list");
    let var = |name: &str| {
        vars.iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("no `{name}` variable"))
    };
    let ds = var("datasource");
    assert_eq!(
        (&ds["type"], &ds["query"]),
        (&Value::from("datasource"), &Value::from("prometheus"))
    );
    let site = var("site");
    assert_eq!(site["type"], "query");
    assert!(site["definition"].as_str().unwrap().contains("site)"), "{site}");
    let mut ids = BTreeSet::new();
    for p in panels(&d) {
        let title = p["title"].as_str().unwrap_or("?");
        assert!(
            ids.insert(p["id"].as_u64().expect("panel id")),
            "duplicate id at {title:?}"
        );
        let grid = &p["gridPos"];
        for key in ["h", "w", "x", "y"] {
            assert!(grid[key].is_u64(), "panel {title:?}: gridPos.{key}");
        }
        assert!(
            grid["x"].as_u64().unwrap() + grid["w"].as_u64().unwrap() <= 24,
            "{title:?} is wider than the grid"
        );
        if p["type"] != "row" {
            assert_eq!(
                p["datasource"]["uid"], "${datasource}",
                "panel {title:?} ignores the variable"
            );
            assert!(
                p["targets"].as_array().is_some_and(|t| !t.is_empty()),
                "panel {title:?} has no query"
            );
        }
    }
    let all: String = expressions(&d).into_iter().map(|(_, e)| e).collect();
    for needed in [
        "webship_http_response_body_bytes_total",
        "webship_http_time_to_first_byte_seconds_bucket",
        "webship_ktls_promotions_total",
        "webship_passthrough_engine_bytes_total",
        "webship_quic_rtt_seconds_bucket",
        "webship_proxy_upstream_errors_total",
        "webship_connections_closed_total",
    ] {
        assert!(all.contains(needed), "no panel shows {needed}");
    }
    assert!(
        all.contains("site=~\"$site\""),
        "no query filters by the site variable"
    );
}

#[test]
fn every_metric_the_dashboard_queries_is_documented() {
    let docs_path = root().join("docs/metrics.md");
    let docs = std::fs::read_to_string(&docs_path).unwrap();
    let mut missing = Vec::new();
    let mut seen = BTreeSet::new();
    for (title, expr) in expressions(&dashboard()) {
        let names = metric_names(&expr);
        assert!(!names.is_empty(), "panel {title:?}: no metric in {expr}");
        for name in names {
            if !documented(&docs, &name) {
                missing.push(format!("{name} (panel {title:?})"));
            }
            seen.insert(name);
        }
    }
    assert!(
        missing.is_empty(),
        "the dashboard queries metrics docs/metrics.md does not document:\n{}",
        missing.join("\n")
    );
    assert!(seen.len() > 30, "only {} metrics found: {seen:?}", seen.len());
}

#[test]
fn the_scanner_takes_metrics_and_skips_labels_and_functions() {
    let names = metric_names(
        "sum by (upstream, le) (rate(foo_bucket{a=\"x{y}\",b=~\"$site\"}[5m])) / on (job) webship_up + process_open_fds",
    );
    let want: BTreeSet<String> = ["foo_bucket", "webship_up", "process_open_fds"]
        .map(String::from)
        .into();
    assert_eq!(names, want);
    assert!(documented("`webship_t_seconds`", "webship_t_seconds_bucket"));
    assert!(!documented("`webship_t_seconds`", "webship_t_bucket"));
}

#[test]
fn every_dashboard_query_is_valid_promql() {
    assert!(
        Path::new(PROMTOOL).exists(),
        "{PROMTOOL} is missing (Debian package prometheus; `cargo xtask deps` installs it)"
    );
    let mut rules = String::from("groups:\n  - name: webship_dashboard\n    rules:\n");
    let exprs = expressions(&dashboard());
    for (i, (_, expr)) in exprs.iter().enumerate() {
        let expr = expr
            .replace("$__rate_interval", "5m")
            .replace("$__interval", "1m")
            .replace("$instance", ".*")
            .replace("$site", ".*");
        assert!(
            !expr.contains('$'),
            "a Grafana variable the test does not replace: {expr}"
        );
        // A YAML double-quoted scalar: escape what JSON would.
        let quoted = serde_json::to_string(&expr).unwrap();
        rules.push_str(&format!(
            "      - record: dashboard:query_{i}\n        expr: {quoted}\n"
        ));
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("dashboard.rules.yml");
    std::fs::write(&file, &rules).unwrap();
    let out = Command::new(PROMTOOL)
        .arg("check")
        .arg("rules")
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "promtool rejects a dashboard query:\n{}{}\nrules:\n{rules}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(&format!("{} rules found", exprs.len())),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}
