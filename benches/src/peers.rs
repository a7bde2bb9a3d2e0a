//! The peers that are not Debian packages, each in a cache under `target/peers/`
//! (`cargo xtask build-peers`, also run by `cargo xtask bench` when they are
//! selected): Pingora, Cloudflare's proxy framework, as a minimal TLS-terminating
//! proxy built from `benches/peers/pingora-proxy`; and Bun (the npm package's
//! binary) serving files with `benches/peers/bun/serve.js`. A run without them
//! skips their cells with the reason.

use std::path::Path;
use std::process::Command;

use anyhow::Result;

use crate::measure::{BUN, BUN_H2, PINGORA};
use crate::servers::{spawn, Server, Settings};

/// `benches/peers/bun/serve.js`: `Bun.serve` for h1, `node:http2` for h2.
const BUN_SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/peers/bun/serve.js");

/// What to run when a peer's binary is missing.
pub(crate) const BUILD_HINT: &str = "build it with `cargo xtask build-peers` or pass its path";

/// Pingora terminating TLS 1.3 (h2 and HTTP/1.1 by ALPN) in front of the plain-HTTP
/// origin, with `s.workers` threads; its pid file and upgrade socket in `s.dir`.
pub(crate) fn start_pingora(binary: &Path, s: &Settings<'_>, origin_port: u16) -> Result<Server> {
    let mut server = spawn(PINGORA, s.dir.join("pingora.log"), None, |port| {
        let mut command = Command::new(binary);
        command
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--origin", &format!("127.0.0.1:{origin_port}")])
            .arg("--cert")
            .arg(&s.identity.cert)
            .arg("--key")
            .arg(&s.identity.key)
            .args(["--threads", &s.workers.to_string()])
            .arg("--dir")
            .arg(s.dir);
        Ok(command)
    })?;
    server.host = "localhost";
    Ok(server)
}

/// Bun serving `s.root` over TLS: `Bun.serve` with `Bun.file` (HTTP/1.1 only; it has
/// no h2) as [`BUN`], or `node:http2`'s `createSecureServer` with `respondWithFile`
/// (h2 only) as [`BUN_H2`]. One process either way: Bun runs JavaScript on one
/// thread, and `--workers` does not change that.
pub(crate) fn start_bun(binary: &Path, s: &Settings<'_>, h2: bool) -> Result<Server> {
    let name = if h2 { BUN_H2 } else { BUN };
    spawn(name, s.dir.join("bun.log"), None, |port| {
        let mut command = Command::new(binary);
        command
            .arg(BUN_SCRIPT)
            .args(["--port", &port.to_string()])
            .arg("--root")
            .arg(s.root)
            .arg("--cert")
            .arg(&s.identity.cert)
            .arg("--key")
            .arg(&s.identity.key);
        if h2 {
            command.arg("--h2");
        }
        // Bun's own cache and telemetry stay inside the server's scratch directory.
        command
            .env("HOME", s.dir)
            .env("BUN_INSTALL_CACHE_DIR", s.dir.join("bun-cache"))
            .env("DO_NOT_TRACK", "1");
        Ok(command)
    })
}
