//! The normal form of a request path, which the proxy forwards (RFC 3986 §6.2.2):
//! percent-encoded unreserved characters decoded, other escapes kept with upper-case
//! hex, `.` and `..` segments resolved, empty segments (`//`) merged. A path that
//! cannot be normalized without guessing how the origin reads it is refused: an
//! encoded `/` or `\` (a segment boundary to some origins, not to others), a raw `\`,
//! NUL, bytes that are not UTF-8 once decoded, a `%` not followed by two hex digits,
//! `..` above the root, and `.` or `..` with `;` parameters (Tomcat reads
//! `/..;/admin` as `/../admin`).
//!
//! The normal form is not the only spelling origins read alike: they decode escapes
//! that are not unreserved (nginx serves `/caf%C3%A9` and `/%40x` as `/café` and
//! `/@x`) and drop `;` parameters (Tomcat, Jetty and Spring read `/;x/admin` and
//! `/admin;x` as `/admin`). Routes and `deny_paths` therefore match the
//! [`match_form`] of the normal form: every escape decoded, each segment's
//! parameters stripped, and the segments left empty merged. That form is for
//! matching only; the upstream gets the normal form.
//!
//! Pure and allocation-bounded by the input; the proxy calls [`normalize`] and
//! [`match_form`] once per request. The file server resolves paths with its own
//! decoding (`files/`).

/// Why a path has no unambiguous normal form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum PathError {
    #[error("the path does not start with `/`")]
    NotAbsolute,
    #[error("a `%` not followed by two hex digits")]
    BadEscape,
    #[error("an encoded `/` or `\\`, or a backslash")]
    Separator,
    #[error("an encoded NUL")]
    Nul,
    #[error("bytes that are not UTF-8 once decoded")]
    NotUtf8,
    #[error("`..` above the root")]
    AboveRoot,
    #[error("a `.` or `..` segment with `;` parameters")]
    DotParameters,
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

fn unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

/// One segment with its unreserved escapes decoded and the rest kept (upper-case
/// hex); `decoded` collects every byte fully decoded, for the UTF-8 check.
fn segment(raw: &str, decoded: &mut Vec<u8>) -> Result<String, PathError> {
    let bytes = raw.as_bytes();
    let mut out = String::with_capacity(raw.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'%' {
            let (Some(hi), Some(lo)) = (
                bytes.get(i + 1).copied().and_then(hex),
                bytes.get(i + 2).copied().and_then(hex),
            ) else {
                return Err(PathError::BadEscape);
            };
            let v = hi << 4 | lo;
            match v {
                b'/' | b'\\' => return Err(PathError::Separator),
                0 => return Err(PathError::Nul),
                _ => {}
            }
            decoded.push(v);
            if unreserved(v) {
                out.push(char::from(v));
            } else {
                out.push('%');
                out.push(char::from(b"0123456789ABCDEF"[usize::from(v >> 4)]));
                out.push(char::from(b"0123456789ABCDEF"[usize::from(v & 15)]));
            }
            i += 3;
            continue;
        }
        match b {
            b'\\' => return Err(PathError::Separator),
            0 => return Err(PathError::Nul),
            _ => {}
        }
        // `raw` is a `&str` and `b` starts a char outside any escape: copy it whole.
        let ch = raw[i..].chars().next().ok_or(PathError::NotUtf8)?;
        let mut utf8 = [0u8; 4];
        decoded.extend_from_slice(ch.encode_utf8(&mut utf8).as_bytes());
        out.push(ch);
        i += ch.len_utf8();
    }
    Ok(out)
}

/// The normal form of `path` (no query), or why it has none.
pub(crate) fn normalize(path: &str) -> Result<String, PathError> {
    let Some(rest) = path.strip_prefix('/') else {
        return Err(PathError::NotAbsolute);
    };
    let mut decoded = Vec::with_capacity(path.len());
    let mut out: Vec<String> = Vec::new();
    let raw: Vec<&str> = rest.split('/').collect();
    // A path ending in `/`, `/.` or `/..` names a directory: it keeps its slash.
    let mut trailing = false;
    for (n, raw_segment) in raw.iter().enumerate() {
        let last = n + 1 == raw.len();
        let seg = segment(raw_segment, &mut decoded)?;
        if let Some((name, _)) = seg.split_once(';') {
            if name == "." || name == ".." {
                return Err(PathError::DotParameters);
            }
        }
        match seg.as_str() {
            "" => trailing = last,
            "." => trailing = last,
            ".." => {
                if out.pop().is_none() {
                    return Err(PathError::AboveRoot);
                }
                trailing = last;
            }
            _ => {
                out.push(seg);
                trailing = false;
            }
        }
    }
    if std::str::from_utf8(&decoded).is_err() {
        return Err(PathError::NotUtf8);
    }
    let mut normal = String::with_capacity(path.len());
    for seg in &out {
        normal.push('/');
        normal.push_str(seg);
    }
    if trailing || normal.is_empty() {
        normal.push('/');
    }
    Ok(normal)
}

/// Each byte of the match form of `normal` (a [`normalize`]d path) with the offset
/// in `normal` just past its source, until `emit` returns `false`. A segment's name
/// ends at its first raw `;`; a segment with no name adds nothing, unless it is the
/// last (the path then ends in `/`).
fn walk(normal: &str, mut emit: impl FnMut(u8, usize) -> bool) {
    let bytes = normal.as_bytes();
    let mut start = usize::from(bytes.first() == Some(&b'/'));
    loop {
        let end = bytes[start..]
            .iter()
            .position(|&b| b == b'/')
            .map_or(bytes.len(), |i| start + i);
        let last = end == bytes.len();
        let name_end = bytes[start..end]
            .iter()
            .position(|&b| b == b';')
            .map_or(end, |i| start + i);
        if name_end > start {
            if !emit(b'/', start) {
                return;
            }
            let mut i = start;
            while i < name_end {
                let escaped = (bytes[i] == b'%')
                    .then(|| Some(hex(*bytes.get(i + 1)?)? << 4 | hex(*bytes.get(i + 2)?)?))
                    .flatten();
                let (byte, next) = match escaped {
                    Some(v) => (v, i + 3),
                    None => (bytes[i], i + 1),
                };
                if !emit(byte, next) {
                    return;
                }
                i = next;
            }
        } else if last && !emit(b'/', bytes.len()) {
            return;
        }
        if last {
            return;
        }
        start = end + 1;
    }
}

/// What routes and `deny_paths` match: the normal form `normal` with every escape
/// decoded, `;` parameters stripped from every segment, and the segments that leaves
/// empty merged (`/;x/admin;y` is `/admin`; `/caf%C3%A9` is `/café`). Decoding
/// cannot add a segment: [`normalize`] refused an encoded `/`, and the bytes are
/// UTF-8. An escaped `;` (`%3B`) is decoded, not stripped: origins strip parameters
/// before decoding.
pub(crate) fn match_form(normal: &str) -> String {
    let mut out = Vec::with_capacity(normal.len());
    walk(normal, |b, _| {
        out.push(b);
        true
    });
    String::from_utf8(out).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

/// `normal` less the part whose match form is `prefix` (with that segment's
/// parameters), as a path: what `strip_prefix` forwards. `None` when the match form
/// does not start with `prefix`.
pub(crate) fn strip_prefix(normal: &str, prefix: &str) -> Option<String> {
    let want = prefix.as_bytes();
    let mut seen = 0;
    let mut offset = 0;
    walk(normal, |b, end| {
        if seen == want.len() || want[seen] != b {
            return false;
        }
        seen += 1;
        offset = end;
        seen < want.len()
    });
    if seen != want.len() {
        return None;
    }
    let mut rest = &normal[offset..];
    if rest.starts_with(';') {
        rest = rest.find('/').map_or("", |i| &rest[i..]);
    }
    Some(format!("/{}", rest.trim_start_matches('/')))
}

/// Whether `path` is written the way routes and `deny_paths` see requests: its own
/// normal form and its own match form (no escapes, `;` parameters, `//`, `.` or
/// `..` segments).
pub(crate) fn matchable(path: &str) -> bool {
    normalize(path).is_ok_and(|n| n == path) && match_form(path) == path
}

/// Whether a `deny_paths` pattern matches a path's [`match_form`], ASCII
/// case-insensitively (an origin on a case-insensitive file system serves `/ADMIN` as
/// `/admin`): `/admin*` by prefix; `*.php` by suffix of the path or of any leading
/// part that ends a segment (`/index.php/x` runs index.php on PHP's PATH_INFO, and
/// `/index.php%3Bx` is `/index.php;x`); anything else exactly, with or without a
/// trailing `/` or a decoded `;` and what follows it in the last segment.
pub(crate) fn denied_by(pattern: &str, path: &str) -> bool {
    let path = path.as_bytes();
    if let Some(prefix) = pattern.strip_suffix('*') {
        let prefix = prefix.as_bytes();
        path.len() >= prefix.len() && path[..prefix.len()].eq_ignore_ascii_case(prefix)
    } else if let Some(suffix) = pattern.strip_prefix('*') {
        let suffix = suffix.as_bytes();
        let ends =
            |end: usize| end >= suffix.len() && path[end - suffix.len()..end].eq_ignore_ascii_case(suffix);
        ends(path.len())
            || path
                .iter()
                .enumerate()
                .any(|(i, b)| matches!(b, b'/' | b';') && ends(i))
    } else {
        let trimmed = |p: &'_ [u8]| -> usize {
            let p = p.strip_suffix(b"/").filter(|p| !p.is_empty()).unwrap_or(p);
            let last = p.iter().rposition(|&b| b == b'/').unwrap_or(0);
            p[last..]
                .iter()
                .position(|&b| b == b';')
                .map_or(p.len(), |i| last + i)
        };
        let pattern = pattern.as_bytes();
        let pattern = &pattern[..trimmed(pattern)];
        path[..trimmed(path)].eq_ignore_ascii_case(pattern)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_forms() {
        let table = [
            ("/", "/"),
            ("/a", "/a"),
            ("/a/", "/a/"),
            ("//a", "/a"),
            ("/a//b", "/a/b"),
            ("/a///", "/a/"),
            ("/./a", "/a"),
            ("/a/.", "/a/"),
            ("/a/./b", "/a/b"),
            ("/x/../a", "/a"),
            ("/x/y/../../a", "/a"),
            ("/a/b/..", "/a/"),
            ("/a/..", "/"),
            ("/%61dmin", "/admin"),
            ("/%41%2d%2E%5f%7E", "/A-._~"),
            ("/%2e/admin", "/admin"),
            ("/x/%2E%2E/admin", "/admin"),
            ("/index.ph%70", "/index.php"),
            ("/a%20b", "/a%20b"),
            ("/a%3fb", "/a%3Fb"),
            ("/%c3%a9", "/%C3%A9"),
            ("/é", "/é"),
            ("/a;b=c", "/a;b=c"),
            ("/..a", "/..a"),
            ("/...", "/..."),
        ];
        for (raw, normal) in table {
            assert_eq!(normalize(raw).as_deref(), Ok(normal), "{raw}");
            // Idempotent: the normal form is its own normal form.
            assert_eq!(normalize(normal).as_deref(), Ok(normal), "{normal}");
        }
    }

    #[test]
    fn ambiguous_paths_are_refused() {
        let table = [
            ("", PathError::NotAbsolute),
            ("a", PathError::NotAbsolute),
            ("*", PathError::NotAbsolute),
            ("/..", PathError::AboveRoot),
            ("/../a", PathError::AboveRoot),
            ("/a/../../b", PathError::AboveRoot),
            ("/%2e%2e/a", PathError::AboveRoot),
            ("/a%2Fb", PathError::Separator),
            ("/a%2fb", PathError::Separator),
            ("/a%5Cb", PathError::Separator),
            ("/a\\b", PathError::Separator),
            ("/a%00b", PathError::Nul),
            ("/%ff", PathError::NotUtf8),
            ("/%c3", PathError::NotUtf8),
            ("/%", PathError::BadEscape),
            ("/%4", PathError::BadEscape),
            ("/%zz", PathError::BadEscape),
            ("/x/..;/admin", PathError::DotParameters),
            ("/.;x/admin", PathError::DotParameters),
            ("/%2e%2e;/admin", PathError::DotParameters),
        ];
        for (raw, err) in table {
            assert_eq!(normalize(raw), Err(err), "{raw}");
        }
    }

    /// Property over a generated table: every spelling of `/admin/x` built from
    /// escapes, dot segments and doubled slashes normalizes to it, and is denied.
    #[test]
    fn every_spelling_has_one_normal_form() {
        let escapes = |s: &str, mask: usize| -> String {
            s.chars()
                .enumerate()
                .map(|(i, c)| {
                    if mask >> (i % 8) & 1 == 1 && c != '/' {
                        format!("%{:02x}", c as u32)
                    } else {
                        c.to_string()
                    }
                })
                .collect()
        };
        let prefixes = ["", "/.", "//", "/x/..", "/./y/z/../..", "///."];
        for mask in 0..256 {
            for prefix in prefixes {
                let raw = format!("{prefix}{}", escapes("/admin/x", mask));
                let normal = normalize(&raw).unwrap_or_else(|e| panic!("{raw}: {e}"));
                assert_eq!(normal, "/admin/x", "{raw}");
                assert!(denied_by("/admin*", &normal));
                assert!(denied_by("/ADMIN/*", &normal));
            }
        }
    }

    #[test]
    fn match_forms() {
        let table = [
            ("/", "/"),
            ("/admin", "/admin"),
            ("/;x/admin", "/admin"),
            ("/;/admin", "/admin"),
            ("/admin;x", "/admin"),
            ("/admin;x/", "/admin/"),
            ("/admin/;x", "/admin/"),
            ("/a;x/b;y=1;z/c", "/a/b/c"),
            ("/;x", "/"),
            ("/;x/;y", "/"),
            ("/caf%C3%A9", "/café"),
            ("/%40admin", "/@admin"),
            ("/a%3Ab", "/a:b"),
            ("/a%20b", "/a b"),
            ("/a%3Bx", "/a;x"),
            ("/a%3Bx;y", "/a;x"),
            ("/%25", "/%"),
        ];
        for (raw, matched) in table {
            let normal = normalize(raw).unwrap_or_else(|e| panic!("{raw}: {e}"));
            assert_eq!(match_form(&normal), matched, "{raw}");
            if !matched.contains(';') {
                // A decoded `;` would be a parameter the second time round.
                assert_eq!(match_form(matched), matched, "{matched} is its own match form");
            }
        }
    }

    /// The reviewer's bypasses: each spelling is denied by the pattern it dodged.
    #[test]
    fn parameters_and_escapes_do_not_dodge_deny_paths() {
        let table = [
            ("/admin*", "/;x/admin"),
            ("/admin*", "/;/admin/users"),
            ("/admin", "/admin;x"),
            ("/admin", "/admin%3Bx"),
            ("/admin", "/;x/admin;y/"),
            ("/café*", "/caf%C3%A9"),
            ("/café*", "/caf%c3%a9/x"),
            ("/@admin*", "/%40admin"),
            ("/a:b", "/a%3Ab"),
            ("/a:b", "/a%3ab;x"),
            ("*.php", "/x/index.php;x"),
            ("*.php", "/x/index.php%3Bx/y"),
            ("*.php", "/x/index%2Ephp"),
            ("*/admin", "/x/;y/admin"),
        ];
        for (pattern, raw) in table {
            let normal = normalize(raw).unwrap_or_else(|e| panic!("{raw}: {e}"));
            assert!(denied_by(pattern, &match_form(&normal)), "{raw} dodged {pattern}");
        }
        for (pattern, raw) in [
            ("/admin", "/administrator"),
            ("/admin", "/admin/x"),
            ("/a:b", "/a%3Abc"),
        ] {
            let normal = normalize(raw).unwrap();
            assert!(
                !denied_by(pattern, &match_form(&normal)),
                "{raw} denied by {pattern}"
            );
        }
    }

    #[test]
    fn stripped_prefixes() {
        let table = [
            ("/api/x", "/api/", Some("/x")),
            ("/api/x", "/api", Some("/x")),
            ("/apix/y", "/api", Some("/x/y")),
            ("/api;v=1/x;y", "/api/", Some("/x;y")),
            ("/api;v=1/x", "/api", Some("/x")),
            ("/;s/api/x", "/api/", Some("/x")),
            ("/api/;x", "/api/", Some("/")),
            ("/api", "/api/", None),
            ("/caf%C3%A9/x%20y", "/café/", Some("/x%20y")),
            ("/caf%C3%A9/x", "/caf", Some("/%C3%A9/x")),
            ("/x/api", "/api/", None),
            ("/a", "/", Some("/a")),
        ];
        for (raw, prefix, stripped) in table {
            let normal = normalize(raw).unwrap();
            assert_eq!(
                strip_prefix(&normal, prefix).as_deref(),
                stripped,
                "{raw} less {prefix}"
            );
        }
    }

    #[test]
    fn matchable_paths() {
        for ok in ["/", "/api/", "/café", "/a:b", "/@x", "/a b", "/.well-known/"] {
            assert!(matchable(ok), "{ok}");
        }
        for bad in [
            "api",
            "/a;b",
            "/a;b/",
            "/%61pi",
            "/caf%C3%A9",
            "//a",
            "/./a",
            "/a/..",
            "/a\\b",
            "",
        ] {
            assert!(!matchable(bad), "{bad}");
        }
    }

    #[test]
    fn patterns() {
        assert!(denied_by("/admin*", "/admin/users"));
        assert!(denied_by("/admin*", "/ADMIN.txt"));
        assert!(!denied_by("/admin*", "/public"));
        assert!(denied_by("*.php", "/x/index.php"));
        assert!(denied_by("*.php", "/index.PHP"));
        assert!(denied_by("*.php", "/index.php/x"));
        assert!(denied_by("*.php", "/index.php;x"));
        assert!(denied_by("*.php", "/a.php/b/c"));
        assert!(!denied_by("*.php", "/index.phps"));
        assert!(!denied_by("*.php", "/php"));
        assert!(denied_by("/exact", "/exact"));
        assert!(denied_by("/exact", "/EXACT/"));
        assert!(!denied_by("/exact", "/exact/more"));
        assert!(denied_by("/", "/"));
    }
}
