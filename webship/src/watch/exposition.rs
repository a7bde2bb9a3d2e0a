//! A reader for the Prometheus text exposition (0.0.4) as the daemon writes it: the
//! samples, with their labels and values; `# HELP`, `# TYPE` and `# EOF` lines and
//! timestamps are skipped. No I/O, and bounded: the text, the samples and the labels
//! per sample have caps, and anything malformed is an error naming its line, never
//! a panic.

/// The longest exposition read.
const MAX_TEXT: usize = 16 * 1024 * 1024;
/// Samples read from one exposition.
const MAX_SAMPLES: usize = 500_000;
/// Labels on one sample.
const MAX_LABELS: usize = 16;

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Sample {
    pub(crate) name: String,
    pub(crate) labels: Vec<(String, String)>,
    pub(crate) value: f64,
}

impl Sample {
    /// The value of label `name`, if the sample has it.
    pub(crate) fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Why an exposition could not be read.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("the metrics text is {0} bytes, more than the {MAX_TEXT} read")]
    TooLarge(usize),
    #[error("the metrics text has more than {MAX_SAMPLES} samples")]
    TooManySamples,
    #[error("line {line} of the metrics text: {reason}")]
    Line { line: usize, reason: &'static str },
}

/// Every sample of `text`, in order.
pub(crate) fn parse(text: &str) -> Result<Vec<Sample>, ParseError> {
    if text.len() > MAX_TEXT {
        return Err(ParseError::TooLarge(text.len()));
    }
    let mut samples = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim_start();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if samples.len() == MAX_SAMPLES {
            return Err(ParseError::TooManySamples);
        }
        let sample = parse_line(line).map_err(|reason| ParseError::Line { line: i + 1, reason })?;
        samples.push(sample);
    }
    Ok(samples)
}

fn parse_line(line: &str) -> Result<Sample, &'static str> {
    let name_end = line
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .unwrap_or(line.len());
    let name = &line[..name_end];
    if !name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
    {
        return Err("a sample must start with a metric name");
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(after) = rest.strip_prefix('{') {
        rest = parse_labels(after, &mut labels)?;
    }
    let mut fields = rest.split_ascii_whitespace();
    let value = fields.next().ok_or("a sample has no value")?;
    let value = parse_value(value).ok_or("the value is not a number")?;
    if let Some(timestamp) = fields.next() {
        timestamp
            .parse::<i64>()
            .map_err(|_| "the timestamp is not an integer")?;
    }
    if fields.next().is_some() {
        return Err("text after the value and timestamp");
    }
    Ok(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

/// Reads `name="value",…}` into `labels`; returns what follows the `}`.
fn parse_labels<'a>(mut rest: &'a str, labels: &mut Vec<(String, String)>) -> Result<&'a str, &'static str> {
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix('}') {
            return Ok(after);
        }
        if labels.len() == MAX_LABELS {
            return Err("too many labels");
        }
        let name_end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .ok_or("unterminated labels")?;
        let name = &rest[..name_end];
        if !name
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        {
            return Err("a label must start with its name");
        }
        rest = rest[name_end..].trim_start();
        rest = rest.strip_prefix('=').ok_or("a label name without `=`")?;
        rest = rest.trim_start();
        rest = rest.strip_prefix('"').ok_or("a label value must be quoted")?;
        let (value, after) = unescape(rest)?;
        labels.push((name.to_owned(), value));
        rest = after.trim_start();
        if let Some(after) = rest.strip_prefix(',') {
            rest = after;
        } else if !rest.starts_with('}') {
            return Err("labels must be separated by `,`");
        }
    }
}

/// A label value up to its closing quote, unescaped (`\\`, `\"`, `\n`); and what
/// follows the quote.
fn unescape(s: &str) -> Result<(String, &str), &'static str> {
    let mut value = String::new();
    let mut chars = s.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Ok((value, &s[i + 1..])),
            '\\' => match chars.next() {
                Some((_, '\\')) => value.push('\\'),
                Some((_, '"')) => value.push('"'),
                Some((_, 'n')) => value.push('\n'),
                _ => return Err("an unknown escape in a label value"),
            },
            c => value.push(c),
        }
    }
    Err("an unterminated label value")
}

/// A sample value: a float, `NaN`, `+Inf` or `-Inf`.
fn parse_value(s: &str) -> Option<f64> {
    match s {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        // Rust also reads `inf` and `infinity`, which the format does not have.
        s if s.bytes().all(|b| b.is_ascii_digit() || b"+-.eE".contains(&b)) => s.parse().ok(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_with_labels_escapes_and_histograms_are_read() {
        let text = "# HELP webship_http_requests_total Requests.\n\
            # TYPE webship_http_requests_total counter\n\
            webship_http_requests_total{site=\"a.test\",proto=\"h2\",mode=\"files\"} 12\n\
            webship_x{site=\"q\\\"uote\\\\back\\nline\",} 1.5e3 1700000000000\n\
            webship_uptime_seconds 3.25\n\
            \n\
            webship_t_seconds_bucket{site=\"a.test\",le=\"0.5\"} 1\n\
            webship_t_seconds_bucket{site=\"a.test\",le=\"+Inf\"} 3\n\
            webship_t_seconds_sum{site=\"a.test\"} NaN\n\
            # EOF\n";
        let samples = parse(text).unwrap();
        assert_eq!(samples.len(), 6);
        assert_eq!(samples[0].name, "webship_http_requests_total");
        assert_eq!(samples[0].label("site"), Some("a.test"));
        assert_eq!(samples[0].label("mode"), Some("files"));
        assert_eq!(samples[0].value, 12.0);
        assert_eq!(samples[1].label("site"), Some("q\"uote\\back\nline"));
        assert_eq!(samples[1].value, 1500.0);
        assert_eq!((samples[2].labels.len(), samples[2].value), (0, 3.25));
        assert_eq!(samples[4].label("le"), Some("+Inf"));
        assert!(samples[5].value.is_nan());
    }

    #[test]
    fn what_the_daemon_renders_reads_back() {
        use crate::metrics::{Encoder, Format, Kind};
        let mut e = Encoder::new(Format::Prometheus);
        e.family("webship_x", Kind::Counter, "Things.")
            .sample(&[("site", "a\"b\\c\nd")], 3u64);
        e.family("webship_t_seconds", Kind::Histogram, "Time.").histogram(
            &[("proto", "h1")],
            [(0.5, 1), (1.0, 2)].into_iter(),
            1.25,
            3,
        );
        let samples = parse(&e.finish()).unwrap();
        assert_eq!(samples[0].label("site"), Some("a\"b\\c\nd"));
        let les: Vec<&str> = samples[1..4].iter().filter_map(|s| s.label("le")).collect();
        assert_eq!(les, ["0.5", "1.0", "+Inf"]);
        assert_eq!(samples[4].value, 1.25);
    }

    #[test]
    fn malformed_lines_are_errors_that_name_the_line() {
        let cases = [
            ("{site=\"a\"} 1", "a sample must start with a metric name"),
            ("x{site=\"a} 1", "an unterminated label value"),
            ("x{site=a} 1", "a label value must be quoted"),
            ("x{site=\"a\" proto=\"b\"} 1", "labels must be separated by `,`"),
            ("x{site=\"\\t\"} 1", "an unknown escape in a label value"),
            ("x{site", "unterminated labels"),
            ("x", "a sample has no value"),
            ("x one", "the value is not a number"),
            ("x infinity", "the value is not a number"),
            ("x 1 2 3", "text after the value and timestamp"),
            ("x 1 soon", "the timestamp is not an integer"),
        ];
        for (line, reason) in cases {
            let text = format!("ok 1\n{line}\n");
            assert_eq!(parse(&text), Err(ParseError::Line { line: 2, reason }), "{line}");
        }
        let many = (0..=MAX_LABELS)
            .map(|i| format!("l{i}=\"v\""))
            .collect::<Vec<_>>()
            .join(",");
        assert_eq!(
            parse(&format!("x{{{many}}} 1")),
            Err(ParseError::Line {
                line: 1,
                reason: "too many labels"
            })
        );
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        // A cheap deterministic generator: every prefix of a mangled exposition.
        let text = "a_b{c=\"d\\\"e\",f=\"\\\\\"} -Inf 12\nz{y=\"é\\n\"} 0.5\n";
        for end in 0..=text.len() {
            if let Some(prefix) = text.get(..end) {
                let _ = parse(prefix);
                let _ = parse(&prefix.replace('"', "{"));
                let _ = parse(&prefix.replace('=', "}"));
            }
        }
    }
}
