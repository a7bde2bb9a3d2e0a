//! Bad configurations: `webship check` names the key and exits 1; `serve` fails the
//! same way before binding, so the port stays free.

use std::time::Duration;

use webship_tests::server::{free_port, listening};
use webship_tests::{webship, Server};

use crate::support::Env;

/// Writes `config` (with `{port}` filled) and runs `webship check` on it.
fn check(env: &Env, config: &str) -> (bool, String) {
    let path = env.dir.path().join("check.toml");
    std::fs::write(&path, config.replace("{port}", "8443")).unwrap();
    let out = webship(&["check", "--config", path.to_str().unwrap()], env.dir.path());
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn assert_rejected(env: &Env, config: &str, needles: &[&str]) {
    let (ok, text) = check(env, config);
    assert!(!ok, "accepted a bad config:\n{config}\n{text}");
    assert!(
        text.contains("check.toml"),
        "the message must name the file: {text}"
    );
    for needle in needles {
        assert!(text.contains(needle), "expected {needle:?} in: {text}");
    }
}

#[test]
fn a_good_config_checks_out() {
    let env = Env::new();
    let (ok, text) = check(&env, &env.config(""));
    assert!(ok, "{text}");
    assert!(text.contains("files.test"), "{text}");
}

#[test]
fn unknown_key_and_bad_type() {
    let env = Env::new();
    let good = env.config("");
    assert_rejected(
        &env,
        &good.replace("workers = 2", "wrokers = 2"),
        &["wrokers", "line 2"],
    );
    assert_rejected(
        &env,
        &good.replace("workers = 2", "workers = \"eight\""),
        &["workers", "line 2"],
    );
    assert_rejected(
        &env,
        &format!("{good}\n[kernel]\nktls = \"maybe\"\n"),
        &["ktls", "maybe"],
    );
    assert_rejected(&env, &good.replace("domain =", "domian ="), &["domian"]);
    assert_rejected(&env, &good.replace("127.0.0.1:{port}", "localhost"), &["listen"]);
}

#[test]
fn missing_certificate_unreadable_root_and_duplicate_domain() {
    let env = Env::new();
    let good = env.config("");
    let missing = good.replace(env.cert.to_str().unwrap(), "/nonexistent/cert.pem");
    assert_rejected(&env, &missing, &["sites[0].tls.cert", "/nonexistent/cert.pem"]);

    let no_root = good.replace(env.root.to_str().unwrap(), "/nonexistent/root");
    assert_rejected(&env, &no_root, &["sites[0].root"]);
    let file_root = good.replace(env.root.to_str().unwrap(), env.cert.to_str().unwrap());
    assert_rejected(&env, &file_root, &["sites[0].root", "not a directory"]);

    let site = good.split_once("[[sites]]").unwrap().1;
    let duplicate = format!("{good}\n[[sites]]{site}");
    assert_rejected(&env, &duplicate, &["sites[1].domain", "files.test"]);
}

#[test]
fn runtime_settings_are_checked() {
    let env = Env::new();
    let good = env.config("");
    assert_rejected(
        &env,
        &format!("{good}\n[runtime.settings]\nh2_tls_write_bufer_bytes = \"131072\"\n"),
        &["runtime.settings.h2_tls_write_bufer_bytes", "unknown setting"],
    );
    assert_rejected(
        &env,
        &format!("{good}\n[runtime.settings]\nh2_tls_write_buffer_bytes = \"lots\"\n"),
        &["runtime.settings.h2_tls_write_buffer_bytes", "lots"],
    );
    assert_rejected(
        &env,
        &format!(
            "{good}\n[runtime.settings]\nproxy_h2_tls_max_send_buffer_bytes = \"131072\"\nproxy_h2_tls_connection_send_buffer_bytes = \"65536\"\n"
        ),
        &["proxy_h2_tls_connection_send_buffer_bytes"],
    );
    let (ok, text) = check(
        &env,
        &format!(
            "{good}\n[runtime.settings]\nh2_tls_write_buffer_bytes = \"131072\"\nproxy_h2_tls_max_send_buffer_bytes = \"131072\"\nproxy_h2_tls_connection_send_buffer_bytes = \"33554432\"\n"
        ),
    );
    assert!(ok, "the spec's settings must be accepted: {text}");
}

#[test]
fn a_key_that_does_not_match_the_certificate() {
    let env = Env::new();
    let (_, other_key) = env.leaf("other", &["other.test"]);
    let bad = env
        .config("")
        .replace(env.key.to_str().unwrap(), other_key.to_str().unwrap());
    assert_rejected(&env, &bad, &["does not belong"]);
    let garbage = env.dir.path().join("garbage.pem");
    std::fs::write(&garbage, "not a certificate").unwrap();
    let bad = env
        .config("")
        .replace(env.cert.to_str().unwrap(), garbage.to_str().unwrap());
    assert_rejected(&env, &bad, &["garbage.pem"]);
}

/// A `deny_paths` pattern or `path_prefix` the proxy could never match is refused at
/// start, naming the key: `*` at both ends, `;` parameters (stripped before matching)
/// and escapes (decoded before matching).
#[test]
fn proxy_patterns_that_never_match_are_refused() {
    let env = Env::new();
    let config = |route: &str| {
        env.config(&format!(
            "[reverse_proxy]\nenabled = true\n[reverse_proxy.tls]\ncert = \"{}\"\nkey = \"{}\"\n[[reverse_proxy.routes]]\ndomain = \"proxy.test\"\nupstreams = [\"127.0.0.1:9\"]\n{route}\n",
            env.cert.display(),
            env.key.display()
        ))
    };
    let (ok, text) = check(&env, &config("deny_paths = [\"/admin*\", \"*.php\", \"/café*\"]"));
    assert!(ok, "good patterns refused: {text}");
    assert_rejected(
        &env,
        &config("deny_paths = [\"*/admin*\"]"),
        &["reverse_proxy.routes[0].deny_paths[0]", "both ends"],
    );
    assert_rejected(
        &env,
        &config("deny_paths = [\"/ok*\", \"/admin;x\"]"),
        &["reverse_proxy.routes[0].deny_paths[1]"],
    );
    assert_rejected(
        &env,
        &config("deny_paths = [\"/caf%C3%A9*\"]"),
        &["reverse_proxy.routes[0].deny_paths[0]"],
    );
    assert_rejected(
        &env,
        &config("path_prefix = \"/api;v=1/\""),
        &["reverse_proxy.routes[0].path_prefix"],
    );
}

#[test]
fn serve_fails_before_binding() {
    let env = Env::new();
    let port = free_port().unwrap();
    let path = env.dir.path().join("bad.toml");
    let bad = env
        .config("")
        .replace("{port}", &port.to_string())
        .replace("workers = 2", "wrokers = 2");
    std::fs::write(&path, bad).unwrap();
    let mut server = Server::spawn(
        env.dir.path(),
        &["serve", "--config", path.to_str().unwrap()],
        port,
    );
    let mut ever_listened = false;
    let status = loop {
        ever_listened |= listening(port);
        if let Some(status) = server.wait_exit(Duration::from_millis(20)) {
            break status;
        }
    };
    assert!(!status.success(), "serve accepted a bad config");
    assert!(!ever_listened, "the port was bound although the config is bad");
    assert!(server.log().contains("wrokers"), "log: {}", server.log());
    std::net::TcpListener::bind(("127.0.0.1", port)).expect("the port must still be free");
}
