//! Preflight on the host the tests run on: the expectations come from the kernel's
//! own files, read here independently of the code under test.

use std::time::Duration;

use webship_tests::client::{fetch, Proto};
use webship_tests::server::{free_port, listening};
use webship_tests::{webship, Server};

use crate::support::{Env, HOST};

/// `/proc/net/tls_stat` exists exactly when the kernel's TLS module is present.
fn host_has_ktls() -> bool {
    std::path::Path::new("/proc/net/tls_stat").exists()
}

fn host_has_bbr() -> bool {
    std::fs::read_to_string("/proc/sys/net/ipv4/tcp_available_congestion_control")
        .is_ok_and(|s| s.split_whitespace().any(|c| c == "bbr"))
}

fn kernel(ktls: &str, bbr: &str) -> String {
    format!("[kernel]\nktls = \"{ktls}\"\nbbr = \"{bbr}\"\n")
}

#[test]
fn required_ktls_follows_the_host() {
    let env = Env::new();
    let port = free_port().unwrap();
    let path = env.dir.path().join("ktls.toml");
    std::fs::write(
        &path,
        env.config(&kernel("required", "off"))
            .replace("{port}", &port.to_string()),
    )
    .unwrap();

    let report = webship(&["preflight", "--config", path.to_str().unwrap()], env.dir.path());
    let text = String::from_utf8_lossy(&report.stdout).into_owned();
    assert!(text.contains("ktls"), "{text}");
    assert_eq!(report.status.success(), host_has_ktls(), "preflight: {text}");

    let mut server = Server::spawn(
        env.dir.path(),
        &["serve", "--config", path.to_str().unwrap()],
        port,
    );
    if host_has_ktls() {
        server.wait_listening();
        return;
    }
    assert!(
        text.contains("MISSING") && text.contains("modprobe tls"),
        "{text}"
    );
    let mut ever_listened = false;
    let status = loop {
        ever_listened |= listening(port);
        if let Some(status) = server.wait_exit(Duration::from_millis(20)) {
            break status;
        }
    };
    assert!(!status.success());
    assert!(
        !ever_listened,
        "bound the port although kTLS is required and missing"
    );
    let log = server.log();
    assert!(
        log.contains("modprobe tls") && log.contains("nothing was bound"),
        "{log}"
    );
}

#[tokio::test]
async fn required_bbr_follows_the_host_and_auto_serves() {
    let env = Env::new();
    env.write("hello.txt", b"hello");
    if !host_has_bbr() {
        let port = free_port().unwrap();
        let path = env.dir.path().join("bbr.toml");
        std::fs::write(
            &path,
            env.config(&kernel("off", "required"))
                .replace("{port}", &port.to_string()),
        )
        .unwrap();
        let mut server = Server::spawn(
            env.dir.path(),
            &["serve", "--config", path.to_str().unwrap()],
            port,
        );
        assert!(!server.wait_exit(Duration::from_secs(10)).unwrap().success());
        return;
    }
    let server = env.start(&kernel("auto", "required"));
    let got = fetch(
        Proto::H1,
        server.addr(),
        HOST,
        env.client(b"http/1.1"),
        "GET",
        "/hello.txt",
        &[],
    )
    .await;
    assert_eq!(got.body, b"hello");
    let log = server.log();
    assert!(log.contains("bbr   [required] available"), "{log}");
    assert!(log.contains("ktls  [auto]"), "auto reports what it found: {log}");
}
