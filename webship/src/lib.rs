//! Webship: a Linux daemon that streams large payloads over HTTP/1.1, HTTP/2 and
//! HTTP/3 with TLS, offloading to the kernel where it is faster.
//!
//! Data flows listener → tls → protocol drivers (`http`, `h3`) → `exchange` (the one
//! seam every driver shares) → `service` → `files` / `proxy` / `webtransport`; TLS
//! passthrough (`passthrough`) forks off before `tls`. Each layer imports only layers
//! below it; the leaves (`message`, `names`, `shutdown`, `config`, `sys`) import none
//! of the others, except that `config` checks `path_prefix` and `deny_paths` with
//! `proxy::path`, itself a leaf (pure path grammar), so that a pattern is validated
//! by the very functions requests are matched with. `main.rs` wires them: config → preflight → server.
//! `watch` (`webship stats --watch`) is a client of the daemon's control socket and
//! imports nothing but `control`.
//! docs/architecture.md draws the graph.
#![deny(unsafe_code)]

mod acme;
pub mod config;
pub mod control;
pub mod ebpf;
mod exchange;
mod files;
mod fsutil;
mod h3;
mod http;
mod ktls;
mod listener;
pub mod logging;
mod message;
mod metrics;
mod names;
pub mod passthrough;
pub mod preflight;
mod proxy;
pub mod proxy_protocol;
pub mod server;
mod service;
mod shutdown;
mod sys;
mod tls;
/// `webship ticket-keys new|rotate`: the shared ticket-key file (`[tls] ticket_keys`).
pub mod ticket_keys {
    pub use crate::tls::tickets::{create_file, new_file, rotate_file, TicketKeyError};
}
pub mod watch;
pub mod webtransport;
