//! End-to-end tests: the real `webship` binary on loopback against real clients
//! (rustls + hyper, curl), asserting bytes, statuses and kernel-visible state.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod access_log;
mod config_errors;
mod download;
mod faults;
mod files;
mod h2;
mod h2_conformance;
mod h2_floods;
mod h3;
mod h3_conformance;
mod lifecycle;
mod metrics;
mod origins;
mod package;
mod passthrough;
mod passthrough_limits;
mod paths;
mod preflight;
mod process;
mod proxy;
mod proxy_hardening;
mod proxy_protocol;
mod reload;
mod sites;
mod stalls;
mod subsystem_metrics;
mod support;
mod systemd;
mod tcp_health;
mod tickets;
mod tls;
mod upgrade;
mod watch;
mod webtransport;
