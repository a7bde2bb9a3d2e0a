//! HTTP/2 settings from `[runtime.settings]` reach the wire, read by nghttp2's own
//! client (`nghttp -v` prints every frame it receives).

use std::process::Command;

use crate::support::{Env, HOST};

#[test]
fn runtime_settings_are_announced_to_a_real_h2_client() {
    let env = Env::new();
    env.write("hello.txt", b"hello");
    let server = env.start(
        "[runtime.settings]\nh2_max_concurrent_streams = \"77\"\nh2_initial_stream_window_bytes = \"2097152\"\nh2_max_frame_size_bytes = \"32768\"\n",
    );
    let out = Command::new("nghttp")
        .args(["-nv", "--no-verify-peer"])
        .arg(format!("https://127.0.0.1:{}/hello.txt", server.port))
        .args(["-H", &format!(":authority: {HOST}")])
        .output();
    let out = match out {
        Ok(out) => out,
        Err(e) => panic!("nghttp (nghttp2-client) is required; `cargo xtask test` installs it: {e}"),
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let received = text.split("recv SETTINGS frame").nth(1).unwrap_or_else(|| {
        panic!(
            "no SETTINGS received:\n{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let settings = received.split("send SETTINGS").next().unwrap();
    for want in [
        "SETTINGS_MAX_CONCURRENT_STREAMS(0x03):77",
        "SETTINGS_INITIAL_WINDOW_SIZE(0x04):2097152",
        "SETTINGS_MAX_FRAME_SIZE(0x05):32768",
    ] {
        assert!(settings.contains(want), "missing {want} in:\n{settings}");
    }
    assert!(text.contains(":status: 200"), "{text}");
}
