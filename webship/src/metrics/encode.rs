//! The exposition formats: Prometheus text 0.0.4 and OpenMetrics 1.0 text, written
//! into one `String` at scrape time (never on the request path).
//!
//! The two differ in three places only, which this writer hides from the callers:
//! a counter's family is named without `_total` in OpenMetrics' `# TYPE` line (its
//! samples carry `_total` in both), an info metric is a `gauge` of value 1 in the
//! Prometheus format, and OpenMetrics ends with `# EOF`. Label values are escaped
//! (`\`, `"`, newline), so a site name can hold any character.

use std::fmt::Write;

/// Which text format a scraper asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    /// `text/plain; version=0.0.4`, what Prometheus reads by default.
    Prometheus,
    /// `application/openmetrics-text; version=1.0.0`.
    OpenMetrics,
}

impl Format {
    /// The format an `Accept` header asks for: OpenMetrics when it is named, else
    /// the Prometheus text format.
    pub(crate) fn negotiate(accept: Option<&str>) -> Self {
        match accept {
            Some(a) if a.contains("application/openmetrics-text") => Format::OpenMetrics,
            _ => Format::Prometheus,
        }
    }

    pub(crate) fn content_type(self) -> &'static str {
        match self {
            Format::Prometheus => "text/plain; version=0.0.4; charset=utf-8",
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }
}

/// A metric family's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Monotonic; the family name is given without `_total`, samples get it.
    Counter,
    Gauge,
    /// Buckets (`_bucket` with `le`), `_sum` and `_count`.
    Histogram,
    /// Constant labels describing the process; the sample is `<name>_info 1`.
    Info,
}

/// A sample value: integers print exactly, floats in Rust's shortest form.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Value {
    Int(u64),
    Float(f64),
}

impl From<u64> for Value {
    fn from(v: u64) -> Self {
        Value::Int(v)
    }
}

impl From<f64> for Value {
    fn from(v: f64) -> Self {
        Value::Float(v)
    }
}

/// Writes one exposition. Families are written whole: [`Encoder::family`], then its
/// samples, before the next family begins.
#[derive(Debug)]
pub(crate) struct Encoder {
    format: Format,
    out: String,
    /// The family whose samples are being written, and its kind.
    family: String,
    kind: Kind,
}

impl Encoder {
    pub(crate) fn new(format: Format) -> Self {
        Self {
            format,
            out: String::with_capacity(16 * 1024),
            family: String::new(),
            kind: Kind::Gauge,
        }
    }

    /// Begins a family: its `# HELP` and `# TYPE` lines. `name` is the base name
    /// (for a counter, without `_total`; for an info metric, without `_info`).
    pub(crate) fn family(&mut self, name: &str, kind: Kind, help: &str) -> &mut Self {
        debug_assert!(valid_name(name), "metric name {name:?}");
        self.family.clear();
        self.family.push_str(name);
        self.kind = kind;
        let (shown, kind_name) = match (self.format, kind) {
            (Format::Prometheus, Kind::Counter) => (format!("{name}_total"), "counter"),
            (Format::OpenMetrics, Kind::Counter) => (name.to_owned(), "counter"),
            (Format::Prometheus, Kind::Info) => (format!("{name}_info"), "gauge"),
            (Format::OpenMetrics, Kind::Info) => (name.to_owned(), "info"),
            (_, Kind::Gauge) => (name.to_owned(), "gauge"),
            (_, Kind::Histogram) => (name.to_owned(), "histogram"),
        };
        let _ = writeln!(self.out, "# HELP {shown} {}", escape_help(help));
        let _ = writeln!(self.out, "# TYPE {shown} {kind_name}");
        self
    }

    /// One sample of the current family (a counter's `_total` and an info's `_info`
    /// are added here).
    pub(crate) fn sample(&mut self, labels: &[(&str, &str)], value: impl Into<Value>) -> &mut Self {
        let suffix = match self.kind {
            Kind::Counter => "_total",
            Kind::Info => "_info",
            Kind::Gauge | Kind::Histogram => "",
        };
        self.line(suffix, labels, None, value.into());
        self
    }

    /// One histogram: `buckets` are (upper bound, cumulative count) pairs in
    /// ascending order, without `+Inf`, which is `count`.
    pub(crate) fn histogram(
        &mut self,
        labels: &[(&str, &str)],
        buckets: impl Iterator<Item = (f64, u64)>,
        sum: f64,
        count: u64,
    ) -> &mut Self {
        debug_assert_eq!(self.kind, Kind::Histogram);
        let mut le = String::new();
        for (bound, cumulative) in buckets {
            le.clear();
            // `{:?}` keeps the `.0` OpenMetrics asks for (`1.0`, not `1`).
            let _ = write!(le, "{bound:?}");
            self.line("_bucket", labels, Some(&le), Value::Int(cumulative));
        }
        self.line("_bucket", labels, Some("+Inf"), Value::Int(count));
        self.line("_sum", labels, None, Value::Float(sum));
        self.line("_count", labels, None, Value::Int(count));
        self
    }

    fn line(&mut self, suffix: &str, labels: &[(&str, &str)], le: Option<&str>, value: Value) {
        let out = &mut self.out;
        out.push_str(&self.family);
        out.push_str(suffix);
        let le = le.map(|le| ("le", le));
        let mut all = labels.iter().copied().chain(le).peekable();
        if all.peek().is_some() {
            out.push('{');
            for (i, (name, value)) in all.enumerate() {
                debug_assert!(valid_name(name), "label name {name:?}");
                if i > 0 {
                    out.push(',');
                }
                out.push_str(name);
                out.push_str("=\"");
                escape_label(out, value);
                out.push('"');
            }
            out.push('}');
        }
        let _ = match value {
            Value::Int(v) => writeln!(out, " {v}"),
            Value::Float(v) if v.is_nan() => writeln!(out, " NaN"),
            Value::Float(v) if v.is_infinite() => writeln!(out, " {}Inf", if v > 0.0 { "+" } else { "-" }),
            Value::Float(v) => writeln!(out, " {v}"),
        };
    }

    /// The exposition, terminated as its format requires.
    pub(crate) fn finish(mut self) -> String {
        if self.format == Format::OpenMetrics {
            self.out.push_str("# EOF\n");
        }
        self.out
    }
}

/// `[a-zA-Z_:][a-zA-Z0-9_:]*`: every name we write is a constant, so this is a
/// debug check on our own code.
fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn escape_label(out: &mut String, value: &str) {
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

fn escape_help(help: &str) -> String {
    help.replace('\\', "\\\\").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_text_names_counters_with_total() {
        let mut e = Encoder::new(Format::Prometheus);
        e.family("webship_x", Kind::Counter, "Things.")
            .sample(&[("site", "a\"b\\c\nd")], 3u64);
        e.family("webship_build", Kind::Info, "Build.")
            .sample(&[("version", "1")], 1u64);
        let text = e.finish();
        assert_eq!(
            text,
            "# HELP webship_x_total Things.\n# TYPE webship_x_total counter\n\
             webship_x_total{site=\"a\\\"b\\\\c\\nd\"} 3\n\
             # HELP webship_build_info Build.\n# TYPE webship_build_info gauge\n\
             webship_build_info{version=\"1\"} 1\n"
        );
    }

    #[test]
    fn openmetrics_names_families_bare_and_ends_with_eof() {
        let mut e = Encoder::new(Format::OpenMetrics);
        e.family("webship_x", Kind::Counter, "Things.").sample(&[], 3u64);
        e.family("webship_t_seconds", Kind::Histogram, "Time.").histogram(
            &[("proto", "h1")],
            [(0.5, 1), (1.0, 2)].into_iter(),
            1.25,
            3,
        );
        let text = e.finish();
        assert_eq!(
            text,
            "# HELP webship_x Things.\n# TYPE webship_x counter\nwebship_x_total 3\n\
             # HELP webship_t_seconds Time.\n# TYPE webship_t_seconds histogram\n\
             webship_t_seconds_bucket{proto=\"h1\",le=\"0.5\"} 1\n\
             webship_t_seconds_bucket{proto=\"h1\",le=\"1.0\"} 2\n\
             webship_t_seconds_bucket{proto=\"h1\",le=\"+Inf\"} 3\n\
             webship_t_seconds_sum{proto=\"h1\"} 1.25\n\
             webship_t_seconds_count{proto=\"h1\"} 3\n# EOF\n"
        );
    }

    #[test]
    fn accept_picks_the_format() {
        assert_eq!(Format::negotiate(None), Format::Prometheus);
        assert_eq!(
            Format::negotiate(Some(
                "application/openmetrics-text;version=1.0.0,text/plain;q=0.5"
            )),
            Format::OpenMetrics
        );
        assert_eq!(Format::negotiate(Some("text/plain")), Format::Prometheus);
    }
}
