//! `Range: bytes=…` parsing (RFC 9110 §14.1.2). Pure: no I/O, tested with raw header
//! bytes.

/// One satisfiable range, resolved against the representation's length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ByteRange {
    pub start: u64,
    /// Inclusive, as in `Content-Range`.
    pub end: u64,
}

impl ByteRange {
    /// Never zero: a satisfiable range holds at least one byte.
    #[allow(clippy::len_without_is_empty)]
    pub(crate) fn len(&self) -> u64 {
        self.end - self.start + 1
    }
}

/// What a `Range` header asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RangeRequest {
    /// Not a `bytes` range, malformed, too many parts, or parts adding up to more than
    /// the file: serve the whole file once, as the RFC lets a server do with a Range
    /// header it does not understand or will not honour (RFC 9110 §14.2).
    Ignore,
    /// At least one range overlaps the file; in request order.
    Satisfiable(Vec<ByteRange>),
    /// Well-formed, but no range overlaps the file: 416.
    Unsatisfiable,
}

/// More parts than this and the header is ignored: a request for thousands of tiny
/// ranges is an amplification attempt, not a download.
pub(super) const MAX_RANGES: usize = 64;

/// Ranges closer than this are sent as one part: a part's own head (boundary,
/// Content-Type, Content-Range) costs about this much, so the gap is cheaper to send
/// than the split (RFC 9110 §14.2 lets a server coalesce).
const COALESCE_GAP: u64 = 80;

/// Parses `header` against a representation of `len` bytes.
pub(super) fn parse(header: &[u8], len: u64) -> RangeRequest {
    let Ok(text) = std::str::from_utf8(header) else {
        return RangeRequest::Ignore;
    };
    let text = text.trim();
    let Some(spec) = text
        .get(..6)
        .filter(|unit| unit.eq_ignore_ascii_case("bytes="))
        .map(|_| &text[6..])
    else {
        return RangeRequest::Ignore;
    };
    let mut ranges = Vec::new();
    let mut parts = 0;
    for part in spec.split(',') {
        let part = part.trim();
        if part.is_empty() {
            continue; // RFC 9110 allows empty list elements
        }
        parts += 1;
        if parts > MAX_RANGES {
            return RangeRequest::Ignore;
        }
        let Some((first, last)) = part.split_once('-') else {
            return RangeRequest::Ignore;
        };
        let (first, last) = (first.trim(), last.trim());
        let range = if first.is_empty() {
            // Suffix: the last N bytes.
            let Some(n) = number(last) else {
                return RangeRequest::Ignore;
            };
            if n == 0 || len == 0 {
                None
            } else {
                Some(ByteRange {
                    start: len.saturating_sub(n),
                    end: len - 1,
                })
            }
        } else {
            let Some(start) = number(first) else {
                return RangeRequest::Ignore;
            };
            let end = if last.is_empty() {
                None
            } else {
                match number(last) {
                    Some(end) if end >= start => Some(end),
                    _ => return RangeRequest::Ignore,
                }
            };
            (start < len).then(|| ByteRange {
                start,
                end: end.map_or(len - 1, |e| e.min(len - 1)),
            })
        };
        ranges.extend(range);
    }
    if parts == 0 {
        return RangeRequest::Ignore;
    }
    if ranges.is_empty() {
        return RangeRequest::Unsatisfiable;
    }
    // nginx's rule: ranges that add up to more than the file ask for some bytes twice
    // (`bytes=0-,0-,…` would send the file once per part), so the whole file goes out
    // instead, once.
    let asked = ranges.iter().fold(0u64, |sum, r| sum.saturating_add(r.len()));
    if asked > len {
        return RangeRequest::Ignore;
    }
    RangeRequest::Satisfiable(coalesce(ranges))
}

/// Ranges that overlap, touch or sit closer than [`COALESCE_GAP`] become one, in file
/// order; ranges that need no merging keep the order they were asked in.
fn coalesce(mut ranges: Vec<ByteRange>) -> Vec<ByteRange> {
    let mut sorted = ranges.clone();
    sorted.sort_by_key(|r| r.start);
    let close = |a: &ByteRange, b: &ByteRange| b.start <= a.end.saturating_add(COALESCE_GAP + 1);
    if !sorted.windows(2).any(|w| close(&w[0], &w[1])) {
        return ranges;
    }
    ranges.clear();
    for r in sorted {
        match ranges.last_mut() {
            Some(last) if close(last, &r) => last.end = last.end.max(r.end),
            _ => ranges.push(r),
        }
    }
    ranges
}

fn number(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sat(ranges: &[(u64, u64)]) -> RangeRequest {
        RangeRequest::Satisfiable(
            ranges
                .iter()
                .map(|&(start, end)| ByteRange { start, end })
                .collect(),
        )
    }

    #[test]
    fn single_suffix_open_and_clamped() {
        assert_eq!(parse(b"bytes=0-99", 1000), sat(&[(0, 99)]));
        assert_eq!(parse(b"bytes=-100", 1000), sat(&[(900, 999)]));
        assert_eq!(parse(b"bytes=-5000", 1000), sat(&[(0, 999)]));
        assert_eq!(parse(b"bytes=990-", 1000), sat(&[(990, 999)]));
        assert_eq!(parse(b"bytes=990-5000", 1000), sat(&[(990, 999)]));
        assert_eq!(parse(b"Bytes = 1-1", 10), RangeRequest::Ignore);
        assert_eq!(parse(b"BYTES=1-1", 10), sat(&[(1, 1)]));
    }

    #[test]
    fn multiple_keep_request_order_and_skip_unsatisfiable_parts() {
        assert_eq!(
            parse(b"bytes=500-599, 0-9 ,5000-6000,-1", 1000),
            sat(&[(500, 599), (0, 9), (999, 999)])
        );
        assert_eq!(parse(b"bytes=0-0,,", 10), sat(&[(0, 0)]));
    }

    #[test]
    fn unsatisfiable() {
        assert_eq!(parse(b"bytes=1000-", 1000), RangeRequest::Unsatisfiable);
        assert_eq!(parse(b"bytes=-0", 1000), RangeRequest::Unsatisfiable);
        assert_eq!(parse(b"bytes=0-", 0), RangeRequest::Unsatisfiable);
        assert_eq!(parse(b"bytes=-10", 0), RangeRequest::Unsatisfiable);
    }

    #[test]
    fn malformed_is_ignored() {
        for bad in [
            &b"bytes=abc"[..],
            b"bytes=5-1",
            b"bytes=1-2-3",
            b"items=0-1",
            b"bytes=",
            b"bytes=+1-2",
            b"bytes=18446744073709551616-",
            b"\xff\xfe",
            b"",
        ] {
            assert_eq!(
                parse(bad, 100),
                RangeRequest::Ignore,
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn too_many_parts_are_ignored() {
        let many = format!("bytes={}", vec!["0-0"; MAX_RANGES + 1].join(","));
        assert_eq!(parse(many.as_bytes(), 1000), RangeRequest::Ignore);
        let parts: Vec<String> = (0..MAX_RANGES).map(|i| format!("{0}-{0}", i * 200)).collect();
        let ok = format!("bytes={}", parts.join(","));
        assert!(
            matches!(parse(ok.as_bytes(), 100_000), RangeRequest::Satisfiable(v) if v.len() == MAX_RANGES)
        );
    }

    #[test]
    fn ranges_adding_up_to_more_than_the_file_are_ignored() {
        let many = format!("bytes={}", vec!["0-"; MAX_RANGES].join(","));
        assert_eq!(parse(many.as_bytes(), 1000), RangeRequest::Ignore);
        assert_eq!(parse(b"bytes=0-599,400-999", 1000), RangeRequest::Ignore);
    }

    #[test]
    fn overlapping_adjacent_and_close_ranges_coalesce() {
        assert_eq!(parse(b"bytes=0-0,0-0,0-0", 1000), sat(&[(0, 0)]));
        assert_eq!(parse(b"bytes=300-399,100-199,150-299", 1000), sat(&[(100, 399)]));
        assert_eq!(parse(b"bytes=0-9,50-59", 1000), sat(&[(0, 59)]));
        // Far apart: separate parts, in the order asked.
        assert_eq!(parse(b"bytes=500-509,0-9", 1000), sat(&[(500, 509), (0, 9)]));
    }

    #[test]
    fn near_the_end_of_a_huge_file() {
        let len = 5 * 1024 * 1024 * 1024_u64;
        assert_eq!(parse(b"bytes=-10", len), sat(&[(len - 10, len - 1)]));
    }
}
