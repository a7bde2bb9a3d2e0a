//! Validators and conditional requests (RFC 9110 §8.8 and §13). Pure: no I/O.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The validators of one file version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Validators {
    /// Strong ETag, quotes included.
    pub etag: String,
    /// Last modification, truncated to whole seconds as HTTP dates are.
    pub modified: Option<SystemTime>,
}

impl Validators {
    /// A strong ETag from inode, length and nanosecond mtime: any rewrite of the file
    /// changes at least one of them.
    pub(crate) fn new(inode: u64, len: u64, modified: Option<SystemTime>) -> Self {
        let nanos = modified
            .and_then(|m| m.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        Self {
            etag: format!("\"{inode:x}-{len:x}-{nanos:x}\""),
            modified: modified.map(whole_seconds),
        }
    }
}

fn whole_seconds(t: SystemTime) -> SystemTime {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => UNIX_EPOCH + Duration::from_secs(d.as_secs()),
        Err(_) => t,
    }
}

/// The conditional headers of a request, as raw bytes.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Conditions<'a> {
    pub if_match: Option<&'a [u8]>,
    pub if_none_match: Option<&'a [u8]>,
    pub if_modified_since: Option<&'a [u8]>,
    pub if_unmodified_since: Option<&'a [u8]>,
    pub if_range: Option<&'a [u8]>,
}

/// What the preconditions decide for a GET or HEAD.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    Proceed,
    NotModified,
    PreconditionFailed,
}

/// Evaluates preconditions in the order RFC 9110 §13.2.2 prescribes.
pub(super) fn evaluate(c: &Conditions<'_>, v: &Validators) -> Verdict {
    if let Some(im) = c.if_match {
        if !etag_list_matches(im, &v.etag, true) {
            return Verdict::PreconditionFailed;
        }
    } else if let Some(ius) = c.if_unmodified_since.and_then(date) {
        if v.modified.is_none_or(|m| m > ius) {
            return Verdict::PreconditionFailed;
        }
    }
    if let Some(inm) = c.if_none_match {
        if etag_list_matches(inm, &v.etag, false) {
            return Verdict::NotModified;
        }
    } else if let Some(ims) = c.if_modified_since.and_then(date) {
        if v.modified.is_some_and(|m| m <= ims) {
            return Verdict::NotModified;
        }
    }
    Verdict::Proceed
}

/// Whether a `Range` may be honoured given `If-Range`: only if it names the current
/// strong ETag, or exactly the current Last-Modified date.
pub(super) fn if_range_allows(c: &Conditions<'_>, v: &Validators) -> bool {
    let Some(raw) = c.if_range else {
        return true;
    };
    let text = String::from_utf8_lossy(raw);
    let text = text.trim();
    if text.starts_with('"') {
        return text == v.etag;
    }
    if text.starts_with("W/") {
        return false;
    }
    match (date(raw), v.modified) {
        (Some(d), Some(m)) => d == m,
        _ => false,
    }
}

fn date(raw: &[u8]) -> Option<SystemTime> {
    httpdate::parse_http_date(std::str::from_utf8(raw).ok()?.trim()).ok()
}

/// Matches an `If-Match`/`If-None-Match` list; `strong` selects the comparison.
fn etag_list_matches(raw: &[u8], etag: &str, strong: bool) -> bool {
    let text = String::from_utf8_lossy(raw);
    let text = text.trim();
    if text == "*" {
        return true;
    }
    text.split(',')
        .map(str::trim)
        .any(|candidate| match candidate.strip_prefix("W/") {
            Some(weak) => !strong && weak == etag,
            None => candidate == etag,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v() -> Validators {
        Validators::new(7, 100, Some(UNIX_EPOCH + Duration::new(1_700_000_000, 123)))
    }

    fn cond<'a>() -> Conditions<'a> {
        Conditions::default()
    }

    #[test]
    fn etag_is_strong_and_changes_with_the_file() {
        let a = v();
        assert!(a.etag.starts_with('"') && a.etag.ends_with('"'));
        let b = Validators::new(7, 101, a.modified);
        assert_ne!(a.etag, b.etag);
    }

    #[test]
    fn if_none_match() {
        let v = v();
        let tag = v.etag.clone();
        let weak = format!("W/{tag}");
        let list = format!("\"x\", {tag}");
        for (header, want) in [
            (tag.as_str(), Verdict::NotModified),
            (weak.as_str(), Verdict::NotModified),
            (list.as_str(), Verdict::NotModified),
            ("*", Verdict::NotModified),
            ("\"other\"", Verdict::Proceed),
        ] {
            let c = Conditions {
                if_none_match: Some(header.as_bytes()),
                ..cond()
            };
            assert_eq!(evaluate(&c, &v), want, "{header}");
        }
    }

    #[test]
    fn if_modified_since_and_its_precedence() {
        let v = v();
        let same = httpdate::fmt_http_date(v.modified.unwrap());
        let older = httpdate::fmt_http_date(v.modified.unwrap() - Duration::from_secs(1));
        let c = Conditions {
            if_modified_since: Some(same.as_bytes()),
            ..cond()
        };
        assert_eq!(evaluate(&c, &v), Verdict::NotModified);
        let c = Conditions {
            if_modified_since: Some(older.as_bytes()),
            ..cond()
        };
        assert_eq!(evaluate(&c, &v), Verdict::Proceed);
        // If-None-Match wins over If-Modified-Since.
        let c = Conditions {
            if_none_match: Some(b"\"other\""),
            if_modified_since: Some(same.as_bytes()),
            ..cond()
        };
        assert_eq!(evaluate(&c, &v), Verdict::Proceed);
        // Garbage dates are ignored.
        let c = Conditions {
            if_modified_since: Some(b"yesterday"),
            ..cond()
        };
        assert_eq!(evaluate(&c, &v), Verdict::Proceed);
    }

    #[test]
    fn if_match_and_if_unmodified_since() {
        let v = v();
        let weak = format!("W/{}", v.etag);
        let c = Conditions {
            if_match: Some(weak.as_bytes()),
            ..cond()
        };
        assert_eq!(evaluate(&c, &v), Verdict::PreconditionFailed);
        let c = Conditions {
            if_match: Some(v.etag.as_bytes()),
            ..cond()
        };
        assert_eq!(evaluate(&c, &v), Verdict::Proceed);
        let before = httpdate::fmt_http_date(v.modified.unwrap() - Duration::from_secs(60));
        let c = Conditions {
            if_unmodified_since: Some(before.as_bytes()),
            ..cond()
        };
        assert_eq!(evaluate(&c, &v), Verdict::PreconditionFailed);
    }

    #[test]
    fn if_range() {
        let v = v();
        let date = httpdate::fmt_http_date(v.modified.unwrap());
        let weak = format!("W/{}", v.etag);
        for (header, want) in [
            (v.etag.as_str(), true),
            (weak.as_str(), false),
            ("\"stale\"", false),
            (date.as_str(), true),
            ("Thu, 01 Jan 1970 00:00:00 GMT", false),
            ("nonsense", false),
        ] {
            let c = Conditions {
                if_range: Some(header.as_bytes()),
                ..cond()
            };
            assert_eq!(if_range_allows(&c, &v), want, "{header}");
        }
        assert!(if_range_allows(&cond(), &v));
    }
}
