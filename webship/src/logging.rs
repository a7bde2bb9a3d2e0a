//! The daemon's log: one line per event on standard error, as text or as JSON.
//!
//! - `text` (the default): a timestamp, the level, the module and the message with
//!   its `key=value` fields; ANSI colours only when standard error is a terminal.
//! - `json`: one object per line, `{"timestamp","level","target","message","fields"}`,
//!   written by serde_json, for log shippers.
//!
//! When standard error is the journal (`$JOURNAL_STREAM` names it), every line starts
//! with the sd-daemon priority prefix (`<3>` error, `<4>` warning, `<6>` info, `<7>`
//! debug and trace), which journald strips and stores as the entry's priority, so
//! `journalctl -p warning` works; text lines then carry no timestamp (journald adds
//! its own). A newline inside a message or a field is written as `\n`, so an event
//! never spans two lines (journald would make two entries of it, the second without
//! a priority).
//!
//! The format is chosen on the command line (`--log-format`) or by
//! `$WEBSHIP_LOG_FORMAT`, not in the configuration file: logging starts before the
//! file is read, and the file's own errors must be logged in the chosen format.

use std::fmt;
use std::io::Write;
use std::str::FromStr;
use std::sync::OnceLock;

use serde::Serialize;
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::{Format, Writer};
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// The variable that chooses the format when `--log-format` is not given.
pub const FORMAT_ENV: &str = "WEBSHIP_LOG_FORMAT";
/// The variable that holds the level filter (`info`, `webship=debug`, …).
pub const FILTER_ENV: &str = "WEBSHIP_LOG";

/// How events are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

impl FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(format!(
                "unknown log format `{other}` (expected `text` or `json`)"
            )),
        }
    }
}

impl fmt::Display for LogFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        })
    }
}

impl LogFormat {
    /// `flag` if given, else `$WEBSHIP_LOG_FORMAT`, else text; a bad variable is an
    /// error that names it.
    pub fn choose(flag: Option<LogFormat>) -> Result<LogFormat, String> {
        if let Some(format) = flag {
            return Ok(format);
        }
        match std::env::var(FORMAT_ENV) {
            Ok(value) if value.is_empty() => Ok(LogFormat::Text),
            Ok(value) => value.parse().map_err(|e| format!("{FORMAT_ENV}: {e}")),
            Err(_) => Ok(LogFormat::Text),
        }
    }
}

/// Where and how lines go, decided once at start.
#[derive(Debug, Clone, Copy)]
struct Output {
    format: LogFormat,
    /// Standard error is the journal: priority prefixes, no timestamps in text.
    journal: bool,
    /// Standard error is a terminal (and the format text): colours.
    ansi: bool,
}

static OUTPUT: OnceLock<Output> = OnceLock::new();

fn output() -> Output {
    *OUTPUT.get_or_init(|| Output::detect(LogFormat::Text))
}

impl Output {
    fn detect(format: LogFormat) -> Self {
        let journal = crate::sys::notify::stderr_is_journal();
        let ansi =
            !journal && format == LogFormat::Text && std::io::IsTerminal::is_terminal(&std::io::stderr());
        Self {
            format,
            journal,
            ansi,
        }
    }
}

/// Installs the process's logger: `format` on standard error, filtered by
/// `$WEBSHIP_LOG` (default `info`). Records of the `log` crate (aya) come through too.
pub fn init(format: LogFormat) {
    let out = *OUTPUT.get_or_init(|| Output::detect(format));
    let filter = tracing_subscriber::EnvFilter::try_from_env(FILTER_ENV)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let line = match (out.format, out.journal) {
        (LogFormat::Json, _) => Line::Json,
        (LogFormat::Text, false) => Line::Text(Format::default().with_ansi(out.ansi)),
        (LogFormat::Text, true) => Line::Journal(Format::default().without_time().with_ansi(false)),
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(out.ansi)
        .event_format(Prefixed {
            journal: out.journal,
            line,
        })
        .init();
}

/// The last words of a failed command (`webship: <error>`), as one line in the
/// format of the log, at error priority.
pub fn fatal(message: &str) {
    let out = output();
    let mut line = String::new();
    if out.journal {
        line.push_str(priority(&Level::ERROR));
    }
    match out.format {
        LogFormat::Text => {
            line.push_str("webship: ");
            push_one_line(&mut line, message);
        }
        LogFormat::Json => line.push_str(&json_line(&Level::ERROR, "webship", message, Default::default())),
    }
    line.push('\n');
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// The sd-daemon prefix for `level` (`SD_ERR`, `SD_WARNING`, `SD_INFO`, `SD_DEBUG`).
fn priority(level: &Level) -> &'static str {
    match *level {
        Level::ERROR => "<3>",
        Level::WARN => "<4>",
        Level::INFO => "<6>",
        Level::DEBUG | Level::TRACE => "<7>",
    }
}

/// Appends `text` with line breaks escaped, so it stays on one line.
fn push_one_line(out: &mut String, text: &str) {
    if !text.contains(['\n', '\r']) {
        out.push_str(text);
        return;
    }
    for c in text.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c => out.push(c),
        }
    }
}

/// The event formatter: the journal's priority prefix, then the line.
struct Prefixed {
    journal: bool,
    line: Line,
}

enum Line {
    Text(Format),
    Journal(Format<tracing_subscriber::fmt::format::Full, ()>),
    Json,
}

impl<S, N> FormatEvent<S, N> for Prefixed
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        let mut line = String::new();
        if self.journal {
            line.push_str(priority(meta.level()));
        }
        let mut text = String::new();
        match &self.line {
            Line::Text(format) => format.format_event(ctx, Writer::new(&mut text), event)?,
            Line::Journal(format) => format.format_event(ctx, Writer::new(&mut text), event)?,
            Line::Json => {
                let mut fields = JsonFields::default();
                event.record(&mut fields);
                let target = fields.target.as_deref().unwrap_or(meta.target());
                let message = fields.message.as_deref().unwrap_or("");
                text = json_line(meta.level(), target, message, fields.fields);
            }
        }
        // The level is padded to five columns; after a priority prefix that would
        // leave a space at the start of the journal's message.
        let text = text.strip_suffix('\n').unwrap_or(&text);
        push_one_line(&mut line, if self.journal { text.trim_start() } else { text });
        writer.write_str(&line)?;
        writer.write_char('\n')
    }
}

/// One JSON log line (without the newline), fields in this order.
#[derive(Serialize)]
struct JsonLine<'a> {
    timestamp: String,
    level: &'a str,
    target: &'a str,
    message: &'a str,
    fields: serde_json::Map<String, serde_json::Value>,
}

fn json_line(
    level: &Level,
    target: &str,
    message: &str,
    fields: serde_json::Map<String, serde_json::Value>,
) -> String {
    let mut timestamp = String::new();
    let _ = SystemTime.format_time(&mut Writer::new(&mut timestamp));
    let line = JsonLine {
        timestamp,
        level: level.as_str(),
        target,
        message,
        fields,
    };
    // Serializing strings and JSON values cannot fail.
    serde_json::to_string(&line).unwrap_or_default()
}

/// An event's fields as JSON values; `message` and the `log` crate's metadata
/// (`log.target`, `log.file`, …) are taken out.
#[derive(Default)]
struct JsonFields {
    message: Option<String>,
    target: Option<String>,
    fields: serde_json::Map<String, serde_json::Value>,
}

impl JsonFields {
    fn put(&mut self, field: &Field, value: serde_json::Value) {
        match field.name() {
            "message" => {
                self.message = Some(match value {
                    serde_json::Value::String(s) => s,
                    other => other.to_string(),
                });
            }
            "log.target" => self.target = value.as_str().map(str::to_owned),
            name if name.starts_with("log.") => {}
            name => {
                self.fields.insert(name.to_owned(), value);
            }
        }
    }
}

impl Visit for JsonFields {
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.put(field, value.into());
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.put(field, value.into());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.put(field, value.into());
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.put(field, value.into());
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.put(field, value.into());
    }
    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.put(field, value.to_string().into());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.put(field, format!("{value:?}").into());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_parse_and_name_themselves() {
        assert_eq!("json".parse::<LogFormat>(), Ok(LogFormat::Json));
        assert_eq!("text".parse::<LogFormat>(), Ok(LogFormat::Text));
        let err = "xml".parse::<LogFormat>().unwrap_err();
        assert!(err.contains("`xml`") && err.contains("json"), "{err}");
        assert_eq!(LogFormat::Json.to_string(), "json");
    }

    #[test]
    fn priorities_follow_sd_daemon() {
        assert_eq!(priority(&Level::ERROR), "<3>");
        assert_eq!(priority(&Level::WARN), "<4>");
        assert_eq!(priority(&Level::INFO), "<6>");
        assert_eq!(priority(&Level::DEBUG), "<7>");
        assert_eq!(priority(&Level::TRACE), "<7>");
    }

    #[test]
    fn a_line_break_never_starts_a_second_line() {
        let mut out = String::new();
        push_one_line(&mut out, "first\nsecond\r\nthird");
        assert_eq!(out, "first\\nsecond\\r\\nthird");
    }

    #[test]
    fn json_lines_are_one_object_in_a_fixed_order() {
        let mut fields = serde_json::Map::new();
        fields.insert("open".into(), 3.into());
        let line = json_line(&Level::WARN, "webship::server", "two\nlines", fields);
        assert!(!line.contains('\n'), "{line}");
        assert!(line.starts_with("{\"timestamp\":\""), "{line}");
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["level"], "WARN");
        assert_eq!(v["target"], "webship::server");
        assert_eq!(v["message"], "two\nlines");
        assert_eq!(v["fields"]["open"], 3);
    }
}
