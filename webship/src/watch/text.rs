//! The plain-text form of a [`View`]: what `webship stats --watch` prints once per
//! interval when its output is not a terminal, and the number formats the terminal
//! view shares.

use std::fmt::Write;

use super::model::{Estimate, Figure, Latency, Quantiles, View};

/// Sites listed in the text form (the busiest).
const TEXT_SITES: usize = 10;

/// `n` bytes with a binary unit: `512 B`, `1.5 KiB`, `3.2 GiB`.
pub(crate) fn bytes(n: f64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = n.max(0.0);
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    match unit {
        0 => format!("{value:.0} B"),
        _ => format!("{value:.1} {}", UNITS[unit]),
    }
}

/// A count: whole numbers without decimals.
pub(crate) fn count(n: f64) -> String {
    format!("{n:.0}")
}

/// A rate per second: `12.5/s`, `-` when unknown.
pub(crate) fn per_second(rate: Option<f64>) -> String {
    match rate {
        Some(r) if r >= 100.0 => format!("{r:.0}/s"),
        Some(r) => format!("{r:.1}/s"),
        None => "-".to_owned(),
    }
}

/// A byte rate: `10.0 MiB/s`, `-` when unknown.
pub(crate) fn bytes_per_second(rate: Option<f64>) -> String {
    rate.map_or_else(|| "-".to_owned(), |r| format!("{}/s", bytes(r)))
}

/// A duration in seconds, in the unit that suits it: `850 µs`, `12.3 ms`, `4.20 s`,
/// `3m05s`.
pub(crate) fn duration(seconds: f64) -> String {
    match seconds {
        s if s < 0.001 => format!("{:.0} µs", s * 1e6),
        s if s < 1.0 => format!("{:.1} ms", s * 1e3),
        s if s < 60.0 => format!("{s:.2} s"),
        s => {
            let whole = s as u64;
            match whole {
                w if w < 3600 => format!("{}m{:02}s", w / 60, w % 60),
                w => format!("{}h{:02}m", w / 3600, w % 3600 / 60),
            }
        }
    }
}

/// A quantile: its duration, `>` before it when the true value is beyond the last
/// bucket, `-` when there were no observations.
pub(crate) fn estimate(e: Option<Estimate>) -> String {
    match e {
        Some(Estimate { seconds, above: true }) => format!(">{}", duration(seconds)),
        Some(Estimate { seconds, .. }) => duration(seconds),
        None => "-".to_owned(),
    }
}

/// `p50 … p90 … p99 …`, or `-`.
pub(crate) fn quantiles(q: Option<Quantiles>) -> [String; 3] {
    match q {
        Some(q) => [estimate(q.p50), estimate(q.p90), estimate(q.p99)],
        None => ["-".to_owned(), "-".to_owned(), "-".to_owned()],
    }
}

/// A progress bar of `width` cells: `#####-----`.
pub(crate) fn bar(done: f64, width: usize) -> String {
    let filled = ((done.clamp(0.0, 1.0) * width as f64).round() as usize).min(width);
    let mut s = "#".repeat(filled);
    s.push_str(&"-".repeat(width - filled));
    s
}

/// The header line: version, uptime, generation, the socket and the interval.
pub(crate) fn header(view: &View) -> String {
    format!(
        "webship {} up {} generation {} on {} every {}",
        if view.version.is_empty() {
            "?"
        } else {
            &view.version
        },
        duration(view.uptime_seconds),
        count(view.generation),
        view.socket,
        duration(view.interval_seconds)
    )
}

/// The line shown while the daemon does not answer.
pub(crate) fn unreachable(view: &View) -> Option<String> {
    view.unreachable.as_ref().map(|u| {
        format!(
            "NOT ANSWERING for {}: {} (retrying every {}; figures below are the last read)",
            duration(u.for_seconds),
            u.error,
            duration(view.interval_seconds)
        )
    })
}

/// The rows of the totals table: what, total, per second.
pub(crate) fn totals(view: &View) -> Vec<[String; 3]> {
    let t = &view.totals;
    let counted = |name: &str, f: &Figure| [name.to_owned(), count(f.total), per_second(f.per_second)];
    let mut rows = vec![counted("requests", &t.requests)];
    for (class, f) in &t.responses {
        // 1xx and 600-999 are rare: shown once seen.
        if f.total > 0.0 || !matches!(class.as_str(), "1xx" | "other") {
            rows.push(counted(&format!("responses {class}"), f));
        }
    }
    rows.push([
        "bytes sent".to_owned(),
        bytes(t.bytes_sent.total),
        bytes_per_second(t.bytes_sent.per_second),
    ]);
    rows.push(["in flight".to_owned(), count(t.in_flight), String::new()]);
    rows.push([
        "connections open".to_owned(),
        count(t.connections_open),
        String::new(),
    ]);
    rows.push(counted("connections accepted", &t.connections_accepted));
    rows.push(counted("connections closed", &t.connections_closed));
    if t.connections_refused.total > 0.0 {
        rows.push(counted("connections refused", &t.connections_refused));
    }
    rows.push(counted("passthrough connections", &t.passthrough_connections));
    for (name, f) in [
        ("passthrough bytes up", &t.passthrough_bytes_up),
        ("passthrough bytes down", &t.passthrough_bytes_down),
    ] {
        rows.push([name.to_owned(), bytes(f.total), bytes_per_second(f.per_second)]);
    }
    rows
}

/// The rows of the latency table: what, over which span, p50, p90, p99.
pub(crate) fn latency(view: &View) -> Vec<[String; 5]> {
    let mut rows = Vec::new();
    for (name, l) in [
        ("first byte", &view.time_to_first_byte),
        ("last byte", &view.time_to_last_byte),
    ] {
        let Latency {
            interval,
            since_start,
        } = *l;
        for (span, q) in [("last interval", interval), ("since start", since_start)] {
            let [p50, p90, p99] = quantiles(q);
            rows.push([name.to_owned(), span.to_owned(), p50, p90, p99]);
        }
    }
    rows
}

/// One block of text for `view`, ending with a blank line.
pub(crate) fn render(view: &View) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{}", header(view));
    if let Some(line) = unreachable(view) {
        let _ = writeln!(out, "{line}");
    }
    for [name, total, rate] in totals(view) {
        let _ = writeln!(out, "  {name:<24} {total:>14} {rate:>14}");
    }
    let _ = writeln!(
        out,
        "  {:<24} {:<14} {:>10} {:>10} {:>10}",
        "latency", "", "p50", "p90", "p99"
    );
    for [name, span, p50, p90, p99] in latency(view) {
        let _ = writeln!(out, "  {name:<24} {span:<14} {p50:>10} {p90:>10} {p99:>10}");
    }
    let _ = writeln!(
        out,
        "sites ({} by bytes sent per second)\n  {:<32} {:>10} {:>14} {:>12} {:>9}",
        view.sites.len().min(TEXT_SITES),
        "site",
        "req/s",
        "sent/s",
        "sent",
        "in flight"
    );
    for s in view.sites.iter().take(TEXT_SITES) {
        let _ = writeln!(
            out,
            "  {:<32} {:>10} {:>14} {:>12} {:>9}",
            s.site,
            per_second(s.requests.per_second),
            bytes_per_second(s.bytes_sent.per_second),
            bytes(s.bytes_sent.total),
            count(s.in_flight)
        );
    }
    let _ = writeln!(out, "{}", transfers_title(view));
    for t in &view.transfers {
        let i = &t.info;
        let _ = writeln!(
            out,
            "  {} {} {} {} [{}] {:.1}% {} of {} {} for {}",
            i.site,
            i.proto,
            i.peer,
            i.path,
            bar(t.done(), 20),
            t.done() * 100.0,
            bytes(i.sent as f64),
            bytes(i.total as f64),
            bytes_per_second(t.per_second),
            duration(i.elapsed_ms as f64 / 1000.0)
        );
    }
    out.push('\n');
    out
}

/// `transfers in flight (N listed)`, with the count of those not listed.
pub(crate) fn transfers_title(view: &View) -> String {
    let mut title = format!("transfers in flight ({} listed", view.transfers.len());
    if view.unlisted > 0 {
        let _ = write!(title, "; {} found the table full since start", view.unlisted);
    }
    title.push(')');
    title
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::watch::exposition::parse;
    use crate::watch::model::tests::{text, transfer};
    use crate::watch::model::Poll;
    use std::time::Duration;

    #[test]
    fn numbers_read_as_an_operator_expects() {
        assert_eq!(bytes(512.0), "512 B");
        assert_eq!(bytes(1536.0), "1.5 KiB");
        assert_eq!(bytes(3.0 * 1024.0 * 1024.0 * 1024.0), "3.0 GiB");
        assert_eq!(per_second(Some(2.0)), "2.0/s");
        assert_eq!(per_second(None), "-");
        assert_eq!(duration(0.000_85), "850 µs");
        assert_eq!(duration(0.0123), "12.3 ms");
        assert_eq!(duration(185.0), "3m05s");
        assert_eq!(duration(7300.0), "2h01m");
        assert_eq!(bar(0.5, 10), "#####-----");
        assert_eq!(bar(2.0, 4), "####");
        assert_eq!(
            estimate(Some(Estimate {
                seconds: 1800.0,
                above: true
            })),
            ">30m00s"
        );
    }

    #[test]
    fn a_block_shows_the_site_its_rate_and_the_transfer() {
        let before = Poll::new(
            &parse(&text(10.0, 100, 0, 3, 0)).unwrap(),
            vec![transfer(1, 0, 8 << 20)],
            0,
        );
        let now = Poll::new(
            &parse(&text(11.0, 110, 0, 3, 0)).unwrap(),
            vec![transfer(1, 2 << 20, 8 << 20)],
            2,
        );
        let view = View::new(
            "/run/webship/443.sock",
            Duration::from_secs(1),
            &now,
            Some(&before),
            Duration::from_secs(1),
        );
        let block = render(&view);
        assert!(
            block.starts_with("webship 0.1.0 up 11.00 s generation 1 on /run/webship/443.sock"),
            "{block}"
        );
        assert!(block.contains("  requests "), "{block}");
        assert!(block.contains("10.0/s"), "{block}");
        assert!(block.contains("  files.test "), "{block}");
        assert!(block.contains("2.0 MiB/s"), "{block}");
        assert!(
            block.contains(
                "files.test h2 127.0.0.1:40000 /big.bin [#####---------------] 25.0% 2.0 MiB of 8.0 MiB"
            ),
            "{block}"
        );
        assert!(
            block.contains("(1 listed; 2 found the table full since start)"),
            "{block}"
        );
        assert!(block.ends_with("\n\n"));
    }
}
