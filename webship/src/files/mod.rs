//! Direct file delivery shared by every protocol: safe path resolution, validators,
//! conditional requests, single and multipart ranges. The result is a protocol-neutral
//! [`Response`] whose body names file ranges instead of holding bytes; the drivers
//! send those ranges through the seam (and h1 may hand them to the kernel).
//!
//! Every driver reads those ranges through the one [`cursor::FileCursor`].

mod conditional;
pub(crate) mod cursor;
mod mime;
mod path;
mod range;

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, StatusCode};

use crate::message::{Body, FileBody, Response, Segment};
pub(crate) use conditional::{Conditions, Validators, Verdict};
pub(crate) use range::{ByteRange, RangeRequest};

const INDEX: &str = "index.html";
const ALLOW: &str = "GET, HEAD";

/// A file site's document root and what of it is served.
#[derive(Debug, Clone)]
pub(crate) struct Docroot {
    /// Canonical.
    pub(crate) root: Arc<Path>,
    /// Serve paths with a segment that starts with `.` (`.git`, `.env`,
    /// `.htpasswd`). Off by default: such a path is 404, as if it did not exist;
    /// `/.well-known/` is served either way (RFC 8615; ACME challenges live there).
    pub(crate) dotfiles: bool,
}

/// Serves `path` (the request target's path, still percent-encoded) from the site's
/// root. File-system work runs on the blocking pool, never on a reactor thread.
pub(crate) async fn serve(site: &Docroot, method: &Method, path: &str, headers: &HeaderMap) -> Response {
    if method != Method::GET && method != Method::HEAD {
        let mut r = Response::status(StatusCode::METHOD_NOT_ALLOWED);
        r.headers.insert(header::ALLOW, HeaderValue::from_static(ALLOW));
        return r;
    }
    let relative = match path::normalize(path) {
        Ok(p) => p,
        Err(e) => {
            tracing::debug!(path, error = %e, "refused request path");
            return Response::status(StatusCode::BAD_REQUEST);
        }
    };
    if !site.dotfiles && path::hidden(&relative) {
        // 404 rather than 403: a hidden file's existence is not told either.
        tracing::debug!(path, "refused a dotfile");
        return Response::status(StatusCode::NOT_FOUND);
    }
    let root = site.root.clone();
    let trailing_slash = path.ends_with('/');
    let opened = tokio::task::spawn_blocking(move || open(&root, &relative, trailing_slash)).await;
    let opened = match opened {
        Ok(Ok(o)) => o,
        Ok(Err(status)) => return Response::status(status),
        Err(_) => return Response::status(StatusCode::INTERNAL_SERVER_ERROR),
    };
    match opened {
        Opened::Redirect => {
            let mut r = Response::status(StatusCode::MOVED_PERMANENTLY);
            let target = format!("{path}/");
            if let Ok(v) = HeaderValue::from_str(&target) {
                r.headers.insert(header::LOCATION, v);
            }
            r
        }
        Opened::File { file, meta, path } => represent(file, &meta, &path, method, headers),
    }
}

// Lives for one request on the stack; boxing would only add an allocation.
#[allow(clippy::large_enum_variant)]
enum Opened {
    File {
        file: File,
        meta: std::fs::Metadata,
        path: PathBuf,
    },
    /// A directory asked for without its trailing slash.
    Redirect,
}

fn open(root: &Path, relative: &Path, trailing_slash: bool) -> Result<Opened, StatusCode> {
    let mut candidate = root.join(relative);
    let real = candidate.canonicalize().map_err(io_status)?;
    if !path::contained(root, &real) {
        tracing::debug!(path = %candidate.display(), "symlink leaves the root");
        return Err(StatusCode::FORBIDDEN);
    }
    if real.is_dir() {
        if !trailing_slash && !relative.as_os_str().is_empty() {
            return Ok(Opened::Redirect);
        }
        candidate = real.join(INDEX);
    } else if trailing_slash {
        return Err(StatusCode::NOT_FOUND);
    }
    // Never blocks: a FIFO opens at once (and is refused below), where a plain open
    // would wait for a writer and hold this blocking-pool thread forever.
    let file = crate::sys::file::open_nonblocking(&candidate).map_err(io_status)?;
    // The lexical and canonical checks above can race with a symlink swap; the path the
    // kernel actually opened cannot.
    match path::opened_path(&file) {
        Ok(opened) if !path::contained(root, &opened) => return Err(StatusCode::FORBIDDEN),
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::Unsupported => {}
        Err(_) => return Err(StatusCode::INTERNAL_SERVER_ERROR),
    }
    let meta = file.metadata().map_err(io_status)?;
    if !meta.is_file() {
        // Devices, FIFOs and sockets are never served; there are no directory listings.
        return Err(StatusCode::FORBIDDEN);
    }
    crate::sys::file::set_blocking(&file).map_err(io_status)?;
    Ok(Opened::File {
        file,
        meta,
        path: candidate,
    })
}

fn io_status(e: io::Error) -> StatusCode {
    match e.kind() {
        io::ErrorKind::NotFound | io::ErrorKind::NotADirectory => StatusCode::NOT_FOUND,
        io::ErrorKind::PermissionDenied => StatusCode::FORBIDDEN,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

fn inode(meta: &std::fs::Metadata) -> u64 {
    #[cfg(unix)]
    {
        std::os::unix::fs::MetadataExt::ino(meta)
    }
    #[cfg(not(unix))]
    {
        let _ = meta;
        0
    }
}

/// The response for an opened file: the conditional headers decide first, then the
/// Range header picks what of the file the body carries.
fn represent(
    file: File,
    meta: &std::fs::Metadata,
    path: &Path,
    method: &Method,
    headers: &HeaderMap,
) -> Response {
    let len = meta.len();
    let validators = Validators::new(inode(meta), len, meta.modified().ok());
    let conditions = conditions(headers);
    let mut common = validator_headers(&validators);
    match conditional::evaluate(&conditions, &validators) {
        Verdict::Proceed => {}
        Verdict::NotModified => {
            let mut r = Response::status(StatusCode::NOT_MODIFIED);
            r.headers = common;
            r.body = Body::Empty;
            return r;
        }
        Verdict::PreconditionFailed => return Response::status(StatusCode::PRECONDITION_FAILED),
    }

    let content_type = HeaderValue::from_static(mime::content_type(path));
    let file = Arc::new(file);
    let (status, body) = match requested_ranges(headers, &conditions, &validators, len) {
        RangeRequest::Ignore => (StatusCode::OK, whole(file, len, content_type, &mut common)),
        RangeRequest::Unsatisfiable => return unsatisfiable(len),
        RangeRequest::Satisfiable(ranges) if ranges.len() == 1 => (
            StatusCode::PARTIAL_CONTENT,
            single_range(file, ranges[0], len, content_type, &mut common),
        ),
        RangeRequest::Satisfiable(ranges) => (
            StatusCode::PARTIAL_CONTENT,
            multipart_ranges(file, &ranges, len, &content_type, &mut common),
        ),
    };
    common.insert(header::CONTENT_LENGTH, HeaderValue::from(body.len));
    Response {
        status,
        headers: common,
        body: if method == Method::HEAD {
            Body::Empty
        } else {
            Body::File(body)
        },
    }
}

/// The request's conditional headers, as the evaluator reads them.
fn conditions(headers: &HeaderMap) -> Conditions<'_> {
    let get = |name| headers.get(name).map(HeaderValue::as_bytes);
    Conditions {
        if_match: get(header::IF_MATCH),
        if_none_match: get(header::IF_NONE_MATCH),
        if_modified_since: get(header::IF_MODIFIED_SINCE),
        if_unmodified_since: get(header::IF_UNMODIFIED_SINCE),
        if_range: get(header::IF_RANGE),
    }
}

/// The headers every answer about the file carries, a 304 included: its validators,
/// so a cache can revalidate, and that it takes ranges.
fn validator_headers(validators: &Validators) -> HeaderMap {
    let mut common = HeaderMap::new();
    if let Ok(v) = HeaderValue::from_str(&validators.etag) {
        common.insert(header::ETAG, v);
    }
    if let Some(m) = validators.modified {
        if let Ok(v) = HeaderValue::from_str(&httpdate::fmt_http_date(m)) {
            common.insert(header::LAST_MODIFIED, v);
        }
    }
    common.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    common
}

/// The ranges asked for; a Range header whose If-Range no longer matches the file is
/// ignored, and the whole file goes out (RFC 9110 §13.1.5).
fn requested_ranges(
    headers: &HeaderMap,
    conditions: &Conditions<'_>,
    validators: &Validators,
    len: u64,
) -> RangeRequest {
    match headers.get(header::RANGE).map(HeaderValue::as_bytes) {
        Some(raw) if conditional::if_range_allows(conditions, validators) => range::parse(raw, len),
        _ => RangeRequest::Ignore,
    }
}

/// 416, naming the file's length so the client can ask again.
fn unsatisfiable(len: u64) -> Response {
    let mut r = Response::status(StatusCode::RANGE_NOT_SATISFIABLE);
    if let Ok(v) = HeaderValue::from_str(&format!("bytes */{len}")) {
        r.headers.insert(header::CONTENT_RANGE, v);
    }
    r
}

/// The whole file (an empty one has no segment to send).
fn whole(file: Arc<File>, len: u64, content_type: HeaderValue, headers: &mut HeaderMap) -> FileBody {
    headers.insert(header::CONTENT_TYPE, content_type);
    let segments = if len == 0 {
        Vec::new()
    } else {
        vec![Segment::File { offset: 0, len }]
    };
    FileBody { file, segments, len }
}

/// One range: the file's own type, and Content-Range says where the bytes sit.
fn single_range(
    file: Arc<File>,
    r: ByteRange,
    len: u64,
    content_type: HeaderValue,
    headers: &mut HeaderMap,
) -> FileBody {
    headers.insert(header::CONTENT_TYPE, content_type);
    if let Ok(v) = HeaderValue::from_str(&content_range(r, len)) {
        headers.insert(header::CONTENT_RANGE, v);
    }
    let segments = vec![Segment::File {
        offset: r.start,
        len: r.len(),
    }];
    FileBody {
        file,
        segments,
        len: r.len(),
    }
}

/// Several ranges: a `multipart/byteranges` body, each part with its own headers.
fn multipart_ranges(
    file: Arc<File>,
    ranges: &[ByteRange],
    len: u64,
    content_type: &HeaderValue,
    headers: &mut HeaderMap,
) -> FileBody {
    let boundary = boundary();
    let (segments, total) = multipart(ranges, len, &boundary, content_type.as_bytes());
    if let Ok(v) = HeaderValue::from_str(&format!("multipart/byteranges; boundary={boundary}")) {
        headers.insert(header::CONTENT_TYPE, v);
    }
    FileBody {
        file,
        segments,
        len: total,
    }
}

fn content_range(r: ByteRange, len: u64) -> String {
    format!("bytes {}-{}/{len}", r.start, r.end)
}

/// A boundary that cannot occur in the part headers and is unlikely in the payload.
fn boundary() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    format!(
        "webship-{:016x}{:08x}",
        t ^ (u64::from(std::process::id()) << 32),
        n
    )
}

/// The segments of a `multipart/byteranges` body and its exact length.
fn multipart(ranges: &[ByteRange], len: u64, boundary: &str, content_type: &[u8]) -> (Vec<Segment>, u64) {
    let mut segments = Vec::with_capacity(ranges.len() * 2 + 1);
    let mut total = 0u64;
    for r in ranges {
        let mut head = Vec::with_capacity(128);
        head.extend_from_slice(b"\r\n--");
        head.extend_from_slice(boundary.as_bytes());
        head.extend_from_slice(b"\r\nContent-Type: ");
        head.extend_from_slice(content_type);
        head.extend_from_slice(b"\r\nContent-Range: ");
        head.extend_from_slice(content_range(*r, len).as_bytes());
        head.extend_from_slice(b"\r\n\r\n");
        total += head.len() as u64 + r.len();
        segments.push(Segment::Bytes(Bytes::from(head)));
        segments.push(Segment::File {
            offset: r.start,
            len: r.len(),
        });
    }
    let tail = Bytes::from(format!("\r\n--{boundary}--\r\n"));
    total += tail.len() as u64;
    segments.push(Segment::Bytes(tail));
    (segments, total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multipart_length_is_exact() {
        let ranges = [ByteRange { start: 0, end: 9 }, ByteRange { start: 20, end: 29 }];
        let (segments, total) = multipart(&ranges, 100, "b", b"text/plain");
        let counted: u64 = segments
            .iter()
            .map(|s| match s {
                Segment::Bytes(b) => b.len() as u64,
                Segment::File { len, .. } => *len,
            })
            .sum();
        assert_eq!(total, counted);
        assert!(
            matches!(&segments[0], Segment::Bytes(b) if b.starts_with(b"\r\n--b\r\nContent-Type: text/plain\r\nContent-Range: bytes 0-9/100\r\n\r\n"))
        );
        assert!(matches!(segments.last(), Some(Segment::Bytes(b)) if &b[..] == b"\r\n--b--\r\n"));
    }
}
