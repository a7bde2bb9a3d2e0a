//! Mapping a request path onto the document root without ever leaving it.
//!
//! Two stages: `normalize` is pure (percent-decoding, NUL, backslashes, dot segments)
//! and yields a relative path made only of plain components; `contain` then checks the
//! path the kernel actually opened, so a symlink that points outside the root is
//! refused even if it was swapped in after the lexical check.

use std::path::{Component, Path, PathBuf};

use percent_encoding::percent_decode_str;

/// Why a request path was refused before touching the file system.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum PathError {
    #[error("the path does not start with `/`")]
    NotAbsolute,
    #[error("the path is not valid UTF-8 after percent-decoding")]
    NotUtf8,
    #[error("the path contains a NUL byte")]
    Nul,
    #[error("the path contains a backslash")]
    Backslash,
    #[error("the path contains a `..` segment")]
    DotDot,
}

/// Turns the path part of a request target into a relative path of plain components.
/// An empty result means the root itself.
pub(super) fn normalize(raw: &str) -> Result<PathBuf, PathError> {
    if !raw.starts_with('/') {
        return Err(PathError::NotAbsolute);
    }
    let decoded: Vec<u8> = percent_decode_str(raw).collect();
    let decoded = String::from_utf8(decoded).map_err(|_| PathError::NotUtf8)?;
    if decoded.contains('\0') {
        return Err(PathError::Nul);
    }
    // Windows-style separators are never path separators here, and a file name that
    // contains one is refused rather than guessed at.
    if decoded.contains('\\') {
        return Err(PathError::Backslash);
    }
    let mut out = PathBuf::new();
    for segment in decoded.split('/') {
        match segment {
            "" | "." => {}
            ".." => return Err(PathError::DotDot),
            name => out.push(name),
        }
    }
    debug_assert!(out.components().all(|c| matches!(c, Component::Normal(_))));
    Ok(out)
}

/// Whether a normalized path names a hidden entry: any segment that starts with `.`,
/// except a leading `.well-known` (RFC 8615), which is public by definition.
pub(super) fn hidden(relative: &Path) -> bool {
    relative.components().enumerate().any(|(i, c)| match c {
        Component::Normal(name) => {
            let name = name.as_encoded_bytes();
            name.starts_with(b".") && !(i == 0 && name == b".well-known")
        }
        _ => false,
    })
}

/// Whether `real` (a fully resolved path) lies inside `root` (canonical).
pub(super) fn contained(root: &Path, real: &Path) -> bool {
    real.starts_with(root)
}

/// The path the kernel resolved for an open file, from `/proc/self/fd`.
#[cfg(target_os = "linux")]
pub(super) fn opened_path(file: &std::fs::File) -> std::io::Result<PathBuf> {
    use std::os::fd::AsRawFd;
    std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))
}

#[cfg(not(target_os = "linux"))]
pub fn opened_path(_file: &std::fs::File) -> std::io::Result<PathBuf> {
    Err(std::io::ErrorKind::Unsupported.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_paths() {
        assert_eq!(normalize("/").unwrap(), PathBuf::new());
        assert_eq!(normalize("/a/b.txt").unwrap(), PathBuf::from("a/b.txt"));
        assert_eq!(normalize("//a/./b//").unwrap(), PathBuf::from("a/b"));
        assert_eq!(normalize("/sp%20ace").unwrap(), PathBuf::from("sp ace"));
        assert_eq!(normalize("/%C3%A9t%C3%A9").unwrap(), PathBuf::from("été"));
        assert_eq!(normalize("/...").unwrap(), PathBuf::from("..."));
        assert_eq!(normalize("/a..b").unwrap(), PathBuf::from("a..b"));
    }

    #[test]
    fn traversal_in_every_spelling_is_refused() {
        for (raw, want) in [
            ("/../etc/passwd", PathError::DotDot),
            ("/a/../../etc/passwd", PathError::DotDot),
            ("/%2e%2e/etc/passwd", PathError::DotDot),
            ("/%2E%2E%2Fetc%2Fpasswd", PathError::DotDot),
            ("/.%2e/x", PathError::DotDot),
            ("/a%2f..%2f..%2fx", PathError::DotDot),
            ("/..", PathError::DotDot),
            ("/a%00.txt", PathError::Nul),
            ("/..%5c..%5cetc%5cpasswd", PathError::Backslash),
            ("/a\\b", PathError::Backslash),
            ("/%ff%fe", PathError::NotUtf8),
            ("etc/passwd", PathError::NotAbsolute),
            ("", PathError::NotAbsolute),
        ] {
            assert_eq!(normalize(raw), Err(want), "{raw}");
        }
    }

    #[test]
    fn dotfiles_are_hidden_except_well_known() {
        for raw in [
            "/.env",
            "/%2egit/config",
            "/a/.htpasswd",
            "/a/.well-known/x",
            "/.well-known/.x",
            "/...",
        ] {
            assert!(hidden(&normalize(raw).unwrap()), "{raw}");
        }
        for raw in [
            "/",
            "/a.b",
            "/a/b.",
            "/.well-known/acme-challenge/t",
            "/.well-known/",
        ] {
            assert!(!hidden(&normalize(raw).unwrap()), "{raw}");
        }
    }

    #[test]
    fn normalized_paths_never_climb() {
        // Whatever survives normalization has only plain components, so joining it to
        // the root cannot leave the root lexically.
        for raw in ["/a/b", "/./a", "/%2e/a", "/a//b/", "/C:/x", "/c:%2fwindows"] {
            let p = normalize(raw).unwrap();
            assert!(p.components().all(|c| matches!(c, Component::Normal(_))), "{raw}");
            assert!(Path::new("/srv/root").join(&p).starts_with("/srv/root"), "{raw}");
        }
    }
}
