//! Per-route request inspection, before any upstream sees the request: allowed
//! methods, denied paths, header size, body size and body media type. Pure.

use http::header;
use http::StatusCode;

use crate::config::Route;
use crate::message::RequestHead;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Refusal {
    pub status: StatusCode,
    pub reason: &'static str,
}

fn refuse(status: StatusCode, reason: &'static str) -> Result<(), Refusal> {
    Err(Refusal { status, reason })
}

/// `path` is the request's match form ([`super::path::match_form`]).
pub(super) fn check(route: &Route, req: &RequestHead<'_>, path: &str) -> Result<(), Refusal> {
    if !route.allowed_methods.is_empty() && !route.allowed_methods.iter().any(|m| m == req.method.as_str()) {
        return refuse(StatusCode::METHOD_NOT_ALLOWED, "method not allowed on this route");
    }
    if route.deny_paths.iter().any(|p| super::path::denied_by(p, path)) {
        return refuse(StatusCode::FORBIDDEN, "path denied on this route");
    }
    let header_bytes: usize = req
        .headers
        .iter()
        .map(|(n, v)| n.as_str().len() + v.len() + 4)
        .sum();
    if header_bytes > route.max_header_bytes {
        return refuse(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "request headers over the route's max_header_bytes",
        );
    }
    let length = req
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if let (Some(max), Some(len)) = (route.max_body_bytes, length) {
        if len > max {
            return refuse(
                StatusCode::PAYLOAD_TOO_LARGE,
                "request body over the route's max_body_bytes",
            );
        }
    }
    if req.has_body() && !route.required_content_types.is_empty() {
        let media = req
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.split(';').next().unwrap_or("").trim().to_ascii_lowercase())
            .unwrap_or_default();
        if !route.required_content_types.contains(&media) {
            return refuse(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "request body type not accepted on this route",
            );
        }
    }
    Ok(())
}
