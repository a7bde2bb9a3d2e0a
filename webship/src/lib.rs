//! Webship: a Linux daemon that streams large payloads over HTTP/1.1 and HTTP/2 with
//! TLS, offloading to the kernel where it is faster.
//!
//! Data flows listener → tls → http (h1, h2) → service → files; each layer sees only
//! the next one's API. `main.rs` wires them: config → preflight → server.
#![deny(unsafe_code)]

pub mod config;
pub mod ebpf;
pub mod files;
pub mod h3;
pub mod http;
pub mod ktls;
pub mod listener;
pub mod passthrough;
pub mod preflight;
pub mod proxy;
pub mod server;
pub mod service;
pub mod sys;
pub mod tls;
pub mod webtransport;
