//! The operator's guide must not go stale: every warning and error the daemon can log
//! (`warn!` and `error!` in `webship/src`) appears in `docs/operations.md`.
//!
//! The rule: a macro's message is its first positional string literal (not
//! `target: "…"`, not a field's `= "…"` value). Its fixed text, cut at the `{…}`
//! placeholders of a formatted message, must appear piece by piece in the guide
//! (whitespace runs compared as one space). Pieces under three characters or without
//! a letter (`)`, ` s`) are not checked, so a message made only of placeholders (the
//! eBPF log forwarder's `"{message}"`) has nothing to check.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

/// The levels an operator must find explained.
const MACROS: [&str; 2] = ["warn!", "error!"];

#[test]
fn every_warning_and_error_is_in_the_operations_guide() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let guide_path = root.join("docs/operations.md");
    let guide = std::fs::read_to_string(&guide_path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", guide_path.display()));
    let guide = squeeze(&guide.replace("\\|", "|"));

    let mut files = Vec::new();
    rust_files(&root.join("webship/src"), &mut files);
    assert!(!files.is_empty(), "no sources found under webship/src");

    let mut checked = 0;
    let mut missing = Vec::new();
    for file in &files {
        let source = std::fs::read_to_string(file).unwrap();
        for (line, message) in messages(&source) {
            let pieces = fixed_pieces(&message);
            if pieces.is_empty() {
                continue;
            }
            checked += 1;
            if pieces.iter().any(|p| !guide.contains(p.as_str())) {
                let at = file.strip_prefix(&root).unwrap_or(file).display().to_string();
                missing.push(format!("  {at}:{line}: {message:?}"));
            }
        }
    }
    assert!(
        checked >= 10,
        "found only {checked} warn!/error! messages in webship/src: is the scanner broken?"
    );
    assert!(
        missing.is_empty(),
        "these log messages are not in docs/operations.md (add each to a table under \
         \"Log lines\": level, message, meaning, what to do):\n{}",
        missing.join("\n")
    );
}

#[test]
fn the_scanner_finds_messages_and_skips_targets_fields_and_comments() {
    let source = r##"
        // tracing::warn!("in a comment");
        tracing::warn!(target: "proxy", %domain, engine = "ebpf", why, "upstream ejected for {} s", n);
        tracing::error!(
            path = %p.display(),
            "a long message \
             continued"
        );
        log::Level::Warn => tracing::warn!(target: "webship::ebpf", "{message}"),
        tracing::warn!(error = %e, "says \"hi\" {{literally}} to {who:?}; then (more)");
        let text = "warn!(\"not a macro\")";
        let quote = b'"'; let raw = r#"warn!("raw")"#; /* warn!("block") */
        tracing::debug!("not checked");
    "##;
    let found: Vec<(usize, String)> = messages(source);
    assert_eq!(
        found,
        vec![
            (3, "upstream ejected for {} s".to_owned()),
            (4, "a long message continued".to_owned()),
            (9, "{message}".to_owned()),
            (10, "says \"hi\" {{literally}} to {who:?}; then (more)".to_owned()),
        ]
    );
    assert_eq!(fixed_pieces(&found[0].1), vec!["upstream ejected for"]);
    assert!(fixed_pieces(&found[2].1).is_empty());
    assert_eq!(
        fixed_pieces(&found[3].1),
        vec!["says \"hi\" {literally} to", "; then (more)"]
    );
}

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push(path);
        }
    }
}

/// The message of every `warn!`/`error!` call in `source`, with its line (1-based).
fn messages(source: &str) -> Vec<(usize, String)> {
    let bytes = source.as_bytes();
    let mut found = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'/' if bytes.get(i + 1) == Some(&b'/') => i = skip_line(bytes, i),
            b'/' if bytes.get(i + 1) == Some(&b'*') => {
                i = source[i + 2..].find("*/").map_or(bytes.len(), |n| i + 2 + n + 2);
            }
            b'"' => i = string_literal(source, i).1,
            b'\'' => i = skip_char_literal(bytes, i),
            b'r' if (i == 0 || !is_ident(bytes[i - 1])) && skip_raw_string(source, i).is_some() => {
                i = skip_raw_string(source, i).unwrap_or(i + 1);
            }
            _ => {
                let call = MACROS.iter().find(|m| {
                    source[i..].starts_with(*m)
                        && bytes.get(i + m.len()) == Some(&b'(')
                        && (i == 0 || !is_ident(bytes[i - 1]))
                });
                match call {
                    Some(m) => {
                        let open = i + m.len();
                        if let Some(message) = first_positional_literal(source, open) {
                            let line = source[..i].matches('\n').count() + 1;
                            found.push((line, message));
                        }
                        i = open + 1;
                    }
                    None => i += 1,
                }
            }
        }
    }
    found
}

/// Within the macro call whose `(` is at `open`: the first string literal that
/// follows the `(` or a `,` at the call's own level.
fn first_positional_literal(source: &str, open: usize) -> Option<String> {
    let bytes = source.as_bytes();
    let mut depth = 0usize;
    let mut previous = b'(';
    let mut i = open + 1;
    while i < bytes.len() {
        let c = bytes[i];
        match c {
            b'"' => {
                let (text, end) = string_literal(source, i);
                if depth == 0 && (previous == b'(' || previous == b',') {
                    return Some(text);
                }
                previous = b'"';
                i = end;
                continue;
            }
            b'/' if bytes.get(i + 1) == Some(&b'/') => {
                i = skip_line(bytes, i);
                continue;
            }
            b'(' | b'[' | b'{' => depth += 1,
            b')' | b']' | b'}' if depth == 0 => return None,
            b')' | b']' | b'}' => depth -= 1,
            _ => {}
        }
        if !c.is_ascii_whitespace() {
            previous = c;
        }
        i += 1;
    }
    None
}

/// The value of the string literal whose opening quote is at `start`, and the index
/// just past its closing quote. `\` at a line's end continues the string after the
/// next line's indentation, as Rust reads it.
fn string_literal(source: &str, start: usize) -> (String, usize) {
    let mut out = String::new();
    let mut chars = source[start + 1..].char_indices().peekable();
    while let Some((k, c)) = chars.next() {
        match c {
            '"' => return (out, start + 1 + k + 1),
            '\\' => match chars.next() {
                Some((_, '\n')) => while chars.next_if(|&(_, w)| w.is_whitespace()).is_some() {},
                Some((_, 'n')) => out.push('\n'),
                Some((_, 't')) => out.push('\t'),
                Some((_, other)) => out.push(other),
                None => break,
            },
            c => out.push(c),
        }
    }
    (out, source.len())
}

/// Past a raw string (`r"…"`, `r#"…"#`) whose `r` is at `start`, if it is one.
fn skip_raw_string(source: &str, start: usize) -> Option<usize> {
    let rest = &source[start + 1..];
    let hashes = rest.len() - rest.trim_start_matches('#').len();
    if !rest[hashes..].starts_with('"') {
        return None;
    }
    let close = format!("\"{}", "#".repeat(hashes));
    let body = start + 1 + hashes + 1;
    Some(
        source[body..]
            .find(&close)
            .map_or(source.len(), |n| body + n + close.len()),
    )
}

/// Past a character literal (`'"'`, `'\''`) at `start`; a lifetime is one byte.
fn skip_char_literal(bytes: &[u8], start: usize) -> usize {
    match (bytes.get(start + 1), bytes.get(start + 2), bytes.get(start + 3)) {
        (Some(b'\\'), _, _) => bytes[start + 2..]
            .iter()
            .take(12)
            .position(|&b| b == b'\'')
            .map_or(start + 1, |n| start + 2 + n + 1),
        (Some(_), Some(b'\''), _) => start + 3,
        _ => start + 1,
    }
}

/// The fixed text of a format string, cut at its placeholders (`{{` and `}}` are
/// literal braces), whitespace squeezed, keeping pieces of three characters or more
/// with a letter.
fn fixed_pieces(format: &str) -> Vec<String> {
    let mut pieces = Vec::new();
    let mut current = String::new();
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '{' if chars.peek() == Some(&'{') => {
                chars.next();
                current.push('{');
            }
            '}' if chars.peek() == Some(&'}') => {
                chars.next();
                current.push('}');
            }
            '{' => {
                for c in chars.by_ref() {
                    if c == '}' {
                        break;
                    }
                }
                pieces.push(std::mem::take(&mut current));
            }
            c => current.push(c),
        }
    }
    pieces.push(current);
    pieces
        .iter()
        .map(|p| squeeze(p.trim()))
        .filter(|p| p.chars().count() >= 3 && p.chars().any(char::is_alphabetic))
        .collect()
}

/// Runs of whitespace as one space.
fn squeeze(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn skip_line(bytes: &[u8], from: usize) -> usize {
    bytes[from..]
        .iter()
        .position(|&b| b == b'\n')
        .map_or(bytes.len(), |n| from + n)
}

fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}
