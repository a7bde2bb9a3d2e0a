//! The two line formats of the access log, from one [`Entry`] (plain fields, no
//! connection state), so they can be tested alone.
//!
//! - `combined`: nginx's `log_format combined` byte for byte —
//!   `$remote_addr - $remote_user [$time_local] "$request" $status $body_bytes_sent
//!   "$http_referer" "$http_user_agent"` — with nginx's default escaping (`"`, `\`,
//!   bytes below 0x20 and above 0x7e as `\xHH`), so a client cannot end a quoted
//!   field or the line early. The time is UTC (`+0000`): the daemon does not read
//!   the host's time zone. The request line names the protocol as nginx does:
//!   `HTTP/1.1`, `HTTP/2.0`, `HTTP/3.0`.
//! - `json`: one object per line (serde_json), every field always present (`null`
//!   where there is nothing); the names are the stable interface listed in
//!   docs/operations.md.

use std::borrow::Cow;
use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, SystemTime};

use serde::Serialize;

use crate::exchange::Proto;
use crate::message::TlsInfo;
use crate::proxy::UpstreamReport;

/// One exchange, as the access log prints it.
#[derive(Debug)]
pub(crate) struct Entry<'a> {
    /// When the request head was complete.
    pub(crate) time: SystemTime,
    pub(crate) peer: SocketAddr,
    pub(crate) site: Option<&'a str>,
    pub(crate) mode: &'static str,
    pub(crate) proto: Proto,
    /// `None` for a request the driver refused before it had a head.
    pub(crate) method: Option<&'a str>,
    /// The request target's path and query.
    pub(crate) target: Option<&'a str>,
    pub(crate) host: Option<&'a str>,
    pub(crate) referer: Option<&'a [u8]>,
    pub(crate) user_agent: Option<&'a [u8]>,
    pub(crate) status: u16,
    pub(crate) bytes: u64,
    pub(crate) ttfb: Duration,
    pub(crate) duration: Duration,
    pub(crate) upstream: Option<UpstreamReport>,
    pub(crate) tls: Option<TlsInfo>,
    pub(crate) ktls: bool,
    pub(crate) outcome: &'static str,
}

/// The client's address as logs show it: an IPv4 client on a dual-stack socket
/// without its `::ffff:` prefix.
fn client_ip(peer: SocketAddr) -> IpAddr {
    peer.ip().to_canonical()
}

/// Appends the `combined` line of `e` (with its newline) to `out`.
pub(crate) fn combined(e: &Entry<'_>, out: &mut Vec<u8>) {
    let version = match e.proto {
        Proto::H1 => "HTTP/1.1",
        Proto::H2 => "HTTP/2.0",
        Proto::H3 => "HTTP/3.0",
    };
    let _ = write!(out, "{} - - [", client_ip(e.peer));
    let c = Civil::of(e.time);
    let _ = write!(
        out,
        "{:02}/{}/{}:{:02}:{:02}:{:02} +0000] \"",
        c.day,
        MONTHS[usize::from(c.month - 1)],
        c.year,
        c.hour,
        c.minute,
        c.second
    );
    match (e.method, e.target) {
        (Some(method), Some(target)) => {
            escape(method.as_bytes(), out);
            out.push(b' ');
            escape(target.as_bytes(), out);
            out.push(b' ');
            out.extend_from_slice(version.as_bytes());
        }
        // nginx writes what it read of a request it could not parse; there is
        // nothing here.
        _ => out.push(b'-'),
    }
    let _ = write!(out, "\" {} {} \"", e.status, e.bytes);
    escape(e.referer.unwrap_or(b"-"), out);
    out.extend_from_slice(b"\" \"");
    escape(e.user_agent.unwrap_or(b"-"), out);
    out.extend_from_slice(b"\"\n");
}

/// nginx's default `escape`: `"`, `\` and bytes outside 0x20..=0x7e become `\xHH`.
fn escape(bytes: &[u8], out: &mut Vec<u8>) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    for &b in bytes {
        if b == b'"' || b == b'\\' || !(0x20..=0x7e).contains(&b) {
            out.extend_from_slice(&[b'\\', b'x', HEX[usize::from(b >> 4)], HEX[usize::from(b & 0xf)]]);
        } else {
            out.push(b);
        }
    }
}

/// The JSON line's fields, in this order; see the module's note.
#[derive(Serialize)]
struct JsonLine<'a> {
    time: String,
    client: IpAddr,
    client_port: u16,
    site: Option<&'a str>,
    mode: &'a str,
    protocol: &'a str,
    method: Option<&'a str>,
    host: Option<&'a str>,
    path: Option<&'a str>,
    status: u16,
    bytes: u64,
    duration_ms: f64,
    ttfb_ms: f64,
    upstream: Option<SocketAddr>,
    upstream_ms: Option<f64>,
    tls_version: Option<&'a str>,
    tls_cipher: Option<&'a str>,
    ktls: bool,
    outcome: &'a str,
    referer: Option<Cow<'a, str>>,
    user_agent: Option<Cow<'a, str>>,
}

/// Milliseconds with microsecond precision.
fn ms(d: Duration) -> f64 {
    d.as_micros() as f64 / 1000.0
}

/// Appends the JSON line of `e` (with its newline) to `out`.
pub(crate) fn json(e: &Entry<'_>, out: &mut Vec<u8>) {
    let c = Civil::of(e.time);
    let line = JsonLine {
        time: format!(
            "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z",
            c.year, c.month, c.day, c.hour, c.minute, c.second, c.millis
        ),
        client: client_ip(e.peer),
        client_port: e.peer.port(),
        site: e.site,
        mode: e.mode,
        protocol: e.proto.as_str(),
        method: e.method,
        host: e.host,
        path: e.target,
        status: e.status,
        bytes: e.bytes,
        duration_ms: ms(e.duration),
        ttfb_ms: ms(e.ttfb),
        upstream: e.upstream.map(|u| u.addr),
        upstream_ms: e.upstream.and_then(|u| u.head).map(ms),
        tls_version: e.tls.map(|t| t.version),
        tls_cipher: e.tls.and_then(|t| t.cipher),
        ktls: e.ktls,
        outcome: e.outcome,
        // Header values may hold bytes that are not UTF-8 (obs-text); JSON strings
        // cannot, so those become U+FFFD.
        referer: e.referer.map(String::from_utf8_lossy),
        user_agent: e.user_agent.map(String::from_utf8_lossy),
    };
    // Writing plain fields into a Vec cannot fail.
    if serde_json::to_writer(&mut *out, &line).is_ok() {
        out.push(b'\n');
    }
}

const MONTHS: [&str; 12] = [
    "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
];

/// A UTC calendar time.
#[derive(Debug, PartialEq, Eq)]
struct Civil {
    year: i64,
    month: u8,
    day: u8,
    hour: u8,
    minute: u8,
    second: u8,
    millis: u16,
}

impl Civil {
    /// The proleptic Gregorian date of `time` (Howard Hinnant's `civil_from_days`);
    /// a time before 1970 reads as 1970-01-01.
    fn of(time: SystemTime) -> Self {
        let since = time.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
        let secs = since.as_secs();
        let days = (secs / 86_400) as i64;
        let of_day = secs % 86_400;
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z.rem_euclid(146_097);
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = (doy - (153 * mp + 2) / 5 + 1) as u8;
        let month = if mp < 10 { mp + 3 } else { mp - 9 } as u8;
        let year = yoe + era * 400 + i64::from(month <= 2);
        Self {
            year,
            month,
            day,
            hour: (of_day / 3600) as u8,
            minute: (of_day / 60 % 60) as u8,
            second: (of_day % 60) as u8,
            millis: since.subsec_millis() as u16,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry() -> Entry<'static> {
        Entry {
            // 2026-12-04T15:18:30.250Z
            time: SystemTime::UNIX_EPOCH + Duration::from_millis(1_796_397_510_250),
            peer: "[::ffff:192.0.2.7]:40000".parse().unwrap(),
            site: Some("files.test"),
            mode: "files",
            proto: Proto::H2,
            method: Some("GET"),
            target: Some("/a b/\"q\"?x=\\1"),
            host: Some("files.test"),
            referer: None,
            user_agent: Some(b"curl/8\x01\xff\""),
            status: 206,
            bytes: 12_345,
            ttfb: Duration::from_micros(1_500),
            duration: Duration::from_micros(20_250),
            upstream: None,
            tls: Some(TlsInfo {
                version: "TLSv1_3",
                cipher: Some("TLS13_AES_128_GCM_SHA256"),
            }),
            ktls: false,
            outcome: "complete",
        }
    }

    #[test]
    fn combined_is_nginx_s_line_with_nginx_s_escapes() {
        let mut out = Vec::new();
        combined(&entry(), &mut out);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "192.0.2.7 - - [04/Dec/2026:15:18:30 +0000] \"GET /a b/\\x22q\\x22?x=\\x5C1 HTTP/2.0\" 206 12345 \
             \"-\" \"curl/8\\x01\\xFF\\x22\"\n"
        );
    }

    #[test]
    fn combined_names_each_protocol_and_a_refused_request() {
        for (proto, version) in [(Proto::H1, "HTTP/1.1"), (Proto::H3, "HTTP/3.0")] {
            let mut out = Vec::new();
            combined(&Entry { proto, ..entry() }, &mut out);
            assert!(String::from_utf8_lossy(&out).contains(&format!("?x=\\x5C1 {version}\" 206")));
        }
        let mut out = Vec::new();
        let refused = Entry {
            method: None,
            target: None,
            status: 400,
            bytes: 0,
            ..entry()
        };
        combined(&refused, &mut out);
        assert!(
            String::from_utf8_lossy(&out).contains("] \"-\" 400 0 \"-\""),
            "{}",
            String::from_utf8_lossy(&out)
        );
    }

    #[test]
    fn json_is_one_line_with_every_field() {
        let mut out = Vec::new();
        let proxied = Entry {
            mode: "proxy",
            upstream: Some(UpstreamReport {
                addr: "127.0.0.1:8080".parse().unwrap(),
                head: Some(Duration::from_micros(750)),
            }),
            ..entry()
        };
        json(&proxied, &mut out);
        assert_eq!(out.iter().filter(|&&b| b == b'\n').count(), 1);
        assert_eq!(out.last(), Some(&b'\n'));
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        let fields: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        let mut expected = vec![
            "time",
            "client",
            "client_port",
            "site",
            "mode",
            "protocol",
            "method",
            "host",
            "path",
            "status",
            "bytes",
            "duration_ms",
            "ttfb_ms",
            "upstream",
            "upstream_ms",
            "tls_version",
            "tls_cipher",
            "ktls",
            "outcome",
            "referer",
            "user_agent",
        ];
        expected.sort_unstable();
        let mut fields = fields;
        fields.sort_unstable();
        assert_eq!(fields, expected);
        assert_eq!(v["time"], "2026-12-04T15:18:30.250Z");
        assert_eq!(v["client"], "192.0.2.7");
        assert_eq!(v["client_port"], 40000);
        assert_eq!(v["protocol"], "h2");
        assert_eq!(v["path"], "/a b/\"q\"?x=\\1");
        assert_eq!(v["status"], 206);
        assert_eq!(v["bytes"], 12345);
        assert_eq!(v["duration_ms"], 20.25);
        assert_eq!(v["ttfb_ms"], 1.5);
        assert_eq!(v["upstream"], "127.0.0.1:8080");
        assert_eq!(v["upstream_ms"], 0.75);
        assert_eq!(v["tls_version"], "TLSv1_3");
        assert_eq!(v["ktls"], false);
        assert_eq!(v["outcome"], "complete");
        assert_eq!(v["referer"], serde_json::Value::Null);
        assert_eq!(v["user_agent"], "curl/8\u{1}\u{fffd}\"");
    }

    #[test]
    fn calendar_dates_across_leap_years_and_month_ends() {
        let at = |secs: u64| Civil::of(SystemTime::UNIX_EPOCH + Duration::from_secs(secs));
        let date = |c: Civil| (c.year, c.month, c.day, c.hour, c.minute, c.second);
        assert_eq!(date(at(0)), (1970, 1, 1, 0, 0, 0));
        // 2000-02-29T23:59:59Z and the second after.
        assert_eq!(date(at(951_868_799)), (2000, 2, 29, 23, 59, 59));
        assert_eq!(date(at(951_868_800)), (2000, 3, 1, 0, 0, 0));
        // 2024-12-31T12:00:00Z.
        assert_eq!(date(at(1_735_646_400)), (2024, 12, 31, 12, 0, 0));
    }
}
