//! Session tickets across processes: openssl's s_client saves a TLS 1.3 session from
//! one daemon and offers it to another. Daemons given the same `[tls] ticket_keys`
//! file resume each other's tickets, one without it does not; a reload keeps the keys;
//! a rotated file still resumes tickets of a key while it is listed and not after;
//! a bad file is refused at start and at reload, and the keys in use stay. Over HTTP/3,
//! aioquic (`clients/h3_resume.py`) does the same across two daemons.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use webship_tests::server::binary;
use webship_tests::{webship, Server};

use crate::support::{Env, HOST};

/// What one s_client run reported about its handshake.
#[derive(Debug, PartialEq, Eq)]
enum Handshake {
    New,
    Reused,
}

/// A ticket-key file made by `webship ticket-keys new`, mode 0600.
fn new_key_file(dir: &Path, name: &str) -> PathBuf {
    let out = webship(&["ticket-keys", "new"], dir);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let path = dir.join(name);
    std::fs::write(&path, &out.stdout).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

fn keys_toml(path: &Path) -> String {
    format!("[tls]\nticket_keys = \"{}\"\n", path.display())
}

/// One TLS 1.3 GET to `server` with s_client: offers the session in `sess_in` if
/// given, saves the session it ends with (the server's ticket) to `sess_out`.
fn s_client(env: &Env, server: &Server, sess_in: Option<&Path>, sess_out: &Path) -> Handshake {
    let port = server.port.to_string();
    let connect = format!("127.0.0.1:{port}");
    let ca = env.ca_file();
    let mut args = vec![
        "20",
        "openssl",
        "s_client",
        "-connect",
        &connect,
        "-servername",
        HOST,
        "-tls1_3",
        "-alpn",
        "http/1.1",
        "-CAfile",
        ca.to_str().unwrap(),
        "-verify_return_error",
        // Read until the server closes, not until our stdin ends: the response, and
        // the tickets before it.
        "-ign_eof",
        "-sess_out",
        sess_out.to_str().unwrap(),
    ];
    if let Some(path) = sess_in {
        args.extend(["-sess_in", path.to_str().unwrap()]);
    }
    let mut child = Command::new("timeout")
        .args(&args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("openssl is required (`cargo xtask deps` installs it)");
    // A request that the server answers and then closes: s_client reads the tickets,
    // which come first, then the response, and exits at the close.
    let request = format!("GET /hello.txt HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n");
    std::io::Write::write_all(child.stdin.as_mut().unwrap(), request.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("HTTP/1.1 200") && out.status.success(),
        "s_client to {port} failed ({}):\n{text}\n{}\nserver log:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        server.log()
    );
    if text.contains("Reused, TLSv1.3") {
        Handshake::Reused
    } else {
        assert!(
            text.contains("New, TLSv1.3"),
            "no TLS 1.3 handshake line:\n{text}"
        );
        Handshake::New
    }
}

/// A second daemon like `env`'s, in a folder of its own (its own config file, logs).
fn start_in(env: &Env, name: &str, extra: &str) -> (Server, PathBuf) {
    let dir = env.dir.path().join(name);
    std::fs::create_dir_all(&dir).unwrap();
    (Server::start(&dir, &env.config(extra)), dir)
}

fn reload(dir: &Path) -> (bool, String) {
    let file = dir.join("webship.toml");
    let out = webship(&["reload", "--config", file.to_str().unwrap()], dir);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn a_ticket_resumes_on_another_daemon_with_the_same_key_file_and_not_on_one_without() {
    let env = Env::new();
    env.write("hello.txt", b"hello");
    let keys = new_key_file(env.dir.path(), "ticket.keys");
    let (a, _) = start_in(&env, "a", &keys_toml(&keys));
    let (b, _) = start_in(&env, "b", &keys_toml(&keys));
    let (c, _) = start_in(&env, "c", "");
    let from_a = env.dir.path().join("a.session");
    let scratch = env.dir.path().join("scratch.session");
    assert_eq!(s_client(&env, &a, None, &from_a), Handshake::New);
    assert_eq!(
        s_client(&env, &b, Some(&from_a), &scratch),
        Handshake::Reused,
        "B shares A's keys"
    );
    assert_eq!(
        s_client(&env, &c, Some(&from_a), &scratch),
        Handshake::New,
        "C has keys of its own"
    );
    // And the other way: C's ticket is C's alone.
    let from_c = env.dir.path().join("c.session");
    assert_eq!(s_client(&env, &c, Some(&from_a), &from_c), Handshake::New);
    assert_eq!(s_client(&env, &c, Some(&from_c), &scratch), Handshake::Reused);
    assert_eq!(s_client(&env, &a, Some(&from_c), &scratch), Handshake::New);
}

#[test]
fn a_reload_keeps_the_ticket_keys_generated_or_from_a_file() {
    let env = Env::new();
    env.write("hello.txt", b"hello");
    let keys = new_key_file(env.dir.path(), "ticket.keys");
    for (name, extra) in [("generated", String::new()), ("file", keys_toml(&keys))] {
        let (server, dir) = start_in(&env, name, &extra);
        let session = env.dir.path().join(format!("{name}.session"));
        let scratch = env.dir.path().join("scratch.session");
        assert_eq!(s_client(&env, &server, None, &session), Handshake::New);
        let (ok, text) = reload(&dir);
        assert!(ok, "{name}: reload refused: {text}");
        assert_eq!(
            s_client(&env, &server, Some(&session), &scratch),
            Handshake::Reused,
            "{name}: a ticket from before the reload no longer resumes"
        );
    }
}

#[test]
fn a_rotated_file_resumes_a_key_while_it_is_listed_and_not_after() {
    let env = Env::new();
    env.write("hello.txt", b"hello");
    let keys_a = new_key_file(env.dir.path(), "a.keys");
    let keys_b = env.dir.path().join("b.keys");
    std::fs::copy(&keys_a, &keys_b).unwrap();
    let (a, _) = start_in(&env, "a", &keys_toml(&keys_a));
    let (b, dir_b) = start_in(&env, "b", &keys_toml(&keys_b));
    let old = env.dir.path().join("old.session");
    let new = env.dir.path().join("new.session");
    let scratch = env.dir.path().join("scratch.session");
    assert_eq!(s_client(&env, &a, None, &old), Handshake::New);

    // B's file gets a key that encrypts at once; the old one stays listed.
    let out = webship(
        &[
            "ticket-keys",
            "rotate",
            keys_b.to_str().unwrap(),
            "--activate-in",
            "0",
        ],
        &dir_b,
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // Its `not_before` is the next second when the first key was made this second.
    std::thread::sleep(Duration::from_millis(1100));
    let (ok, text) = reload(&dir_b);
    assert!(ok, "reload refused: {text}");
    assert_eq!(
        s_client(&env, &b, Some(&old), &new),
        Handshake::Reused,
        "the old key still decrypts"
    );
    // B now issues under the new key, which A does not have yet: why a rotation
    // must reach every host before its key's `not_before`.
    assert_eq!(s_client(&env, &a, Some(&new), &scratch), Handshake::New);
    assert_eq!(s_client(&env, &b, Some(&new), &scratch), Handshake::Reused);

    // The old key leaves B's file (no reload: the daemon notices the change).
    let text = std::fs::read_to_string(&keys_b).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    let last_key = lines.iter().rposition(|l| l.starts_with("key ")).unwrap();
    lines.remove(last_key); // newest first: the last key line is the old key
    std::fs::write(&keys_b, lines.join("\n") + "\n").unwrap();
    wait_for_log(&b, "ticket keys re-read", 1);
    assert_eq!(
        s_client(&env, &b, Some(&old), &scratch),
        Handshake::New,
        "a removed key still decrypts"
    );
    assert_eq!(s_client(&env, &b, Some(&new), &scratch), Handshake::Reused);
}

/// Waits (bounded) until `server`'s log holds `line` at least `count` times.
fn wait_for_log(server: &Server, line: &str, count: usize) {
    let begun = Instant::now();
    while server.log().matches(line).count() < count {
        assert!(
            begun.elapsed() < Duration::from_secs(20),
            "no `{line}` in the log within 20 s:\n{}",
            server.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Bad files: what each must be refused with.
fn bad_files(good: &str) -> Vec<(&'static str, String, u32, &'static str)> {
    let key_line = good.lines().find(|l| l.starts_with("key ")).unwrap();
    vec![
        ("world-readable", good.to_owned(), 0o644, "mode 0644"),
        (
            "short",
            format!("{}\n", &good[..good.len() - 3]),
            0o600,
            "64 hex digits",
        ),
        (
            "not hex",
            good.replacen(&key_line[key_line.len() - 4..], "zzzz", 1),
            0o600,
            "64 hex digits",
        ),
        (
            "no header",
            format!("{key_line}\n"),
            0o600,
            "must start with `webship-ticket-keys v1`",
        ),
    ]
}

/// Starts a daemon that should refuse `extra` at start: its exit code and stderr.
fn start_refused(env: &Env, extra: &str) -> (Option<i32>, String) {
    let config = env.dir.path().join("start.toml");
    std::fs::write(&config, env.config(extra).replace("{port}", "1")).unwrap();
    // `timeout`: a daemon that wrongly starts is stopped, and the test fails.
    let out = Command::new("timeout")
        .args([
            "20",
            binary().to_str().unwrap(),
            "serve",
            "--config",
            config.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn new_file_is_private_from_the_start_never_overwritten_and_only_trusted_owners_serve() {
    use std::os::unix::fs::MetadataExt;
    let env = Env::new();
    for dir in [env.dir.path(), env.root.as_path()] {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    env.write("hello.txt", b"hello");
    let keys = env.dir.path().join("ticket.keys");
    let arg = keys.to_str().unwrap();
    let out = webship(&["ticket-keys", "new", arg], env.dir.path());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let meta = std::fs::metadata(&keys).unwrap();
    assert_eq!(meta.mode() & 0o7777, 0o600, "not created 0600");
    let first = std::fs::read(&keys).unwrap();
    let again = webship(&["ticket-keys", "new", arg], env.dir.path());
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert!(
        !again.status.success() && stderr.contains("already exists") && stderr.contains("fix:"),
        "an existing file was not refused: {stderr}"
    );
    assert_eq!(std::fs::read(&keys).unwrap(), first, "the existing file changed");

    // Owned by the service account: trusted like root's, and it serves.
    let chown = Command::new("chown")
        .arg("nobody:nogroup")
        .arg(&keys)
        .status()
        .unwrap();
    assert!(chown.success());
    let extra = format!("user = \"nobody\"\ngroup = \"nogroup\"\n{}", keys_toml(&keys));
    let (server, _dir) = start_in(&env, "a", &extra);
    let session = env.dir.path().join("a.session");
    assert_eq!(s_client(&env, &server, None, &session), Handshake::New);
    drop(server);

    // Owned by anyone else: whoever it is could swap the keys, so it is refused.
    let chown = Command::new("chown").arg("4242").arg(&keys).status().unwrap();
    assert!(chown.success());
    let (code, stderr) = start_refused(&env, &keys_toml(&keys));
    assert_eq!(code, Some(1), "a foreign-owned file was not refused: {stderr}");
    assert!(
        stderr.contains("owned by uid 4242") && stderr.contains("fix: `chown root FILE`"),
        "{stderr}"
    );
}

#[test]
fn a_bad_key_file_is_refused_at_start_and_at_reload_where_the_keys_in_use_stay() {
    let env = Env::new();
    env.write("hello.txt", b"hello");
    let good_path = new_key_file(env.dir.path(), "good.keys");
    let good = std::fs::read_to_string(&good_path).unwrap();
    let keys = env.dir.path().join("ticket.keys");
    let secret = &good.lines().find(|l| l.starts_with("key ")).unwrap()[20..];
    for (what, text, mode, words) in bad_files(&good) {
        std::fs::write(&keys, &text).unwrap();
        std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(mode)).unwrap();
        let (code, stderr) = start_refused(&env, &keys_toml(&keys));
        assert_eq!(code, Some(1), "{what}: not refused at start: {stderr}");
        assert!(
            stderr.contains(words) && stderr.contains("fix:"),
            "{what}: {stderr}"
        );
        assert!(
            !stderr.contains(secret),
            "{what}: key material in the message: {stderr}"
        );
    }

    std::fs::write(&keys, &good).unwrap();
    std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o600)).unwrap();
    let (server, dir) = start_in(&env, "served", &keys_toml(&keys));
    let session = env.dir.path().join("a.session");
    let scratch = env.dir.path().join("scratch.session");
    assert_eq!(s_client(&env, &server, None, &session), Handshake::New);
    for (i, (what, text, mode, words)) in bad_files(&good).into_iter().enumerate() {
        // The mode first: the watcher compares content stamps, which chmod leaves.
        std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(mode)).unwrap();
        std::fs::write(&keys, &text).unwrap();
        let (ok, reply) = reload(&dir);
        assert!(
            !ok && reply.contains(words),
            "{what}: reload not refused: {reply}"
        );
        assert!(
            !reply.contains(secret),
            "{what}: key material in the reply: {reply}"
        );
        // The watcher sees the changed file too, refuses it, and says so.
        wait_for_log(&server, "the changed ticket key file was refused", i + 1);
        assert_eq!(
            s_client(&env, &server, Some(&session), &scratch),
            Handshake::Reused,
            "{what}: the keys in use were dropped"
        );
    }
}

/// HTTP/3: aioquic takes a ticket from `first` and offers it to `second`; whether the
/// second connection resumed, after checking both answered 200 and the ticket offered
/// no 0-RTT.
fn quic_resumes(env: &Env, first: &Server, second: &Server) -> bool {
    let out = Command::new("timeout")
        .args([
            "60",
            "python3",
            concat!(env!("CARGO_MANIFEST_DIR"), "/clients/h3_resume.py"),
            "127.0.0.1",
            &first.port.to_string(),
            &second.port.to_string(),
            HOST,
            "/hello.txt",
            env.ca_file().to_str().unwrap(),
        ])
        .output()
        .expect("python3 with aioquic is required; `cargo xtask deps` installs it");
    let line = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "aioquic: {line}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(line.trim()).unwrap_or_else(|e| panic!("{e}: {line}"));
    assert_eq!(v["first"]["status"], "200", "{line}");
    assert_eq!(v["second"]["status"], "200", "{line}");
    assert_eq!(v["first"]["resumed"], false, "{line}");
    assert!(v["early_data"].is_null(), "a ticket offers 0-RTT: {line}");
    v["second"]["resumed"].as_bool().unwrap()
}

#[test]
fn over_quic_a_ticket_resumes_on_another_daemon_with_the_same_key_file_and_not_without() {
    let env = Env::new();
    env.write("hello.txt", b"hello");
    let keys = new_key_file(env.dir.path(), "ticket.keys");
    let (a, _) = start_in(&env, "a", &keys_toml(&keys));
    let (b, _) = start_in(&env, "b", &keys_toml(&keys));
    let (c, _) = start_in(&env, "c", "");
    assert!(
        quic_resumes(&env, &a, &b),
        "B did not resume A's ticket over QUIC"
    );
    assert!(
        !quic_resumes(&env, &a, &c),
        "C resumed a ticket it has no key for"
    );
}

#[test]
fn a_root_only_key_file_serves_but_a_service_account_is_told_it_cannot_reread_it() {
    let env = Env::new();
    // The temp dirs are 0700: the service account must reach the files and the root.
    for dir in [env.dir.path(), env.root.as_path()] {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    env.write("hello.txt", b"hello");
    let keys = new_key_file(env.dir.path(), "ticket.keys");
    let extra = format!("user = \"nobody\"\ngroup = \"nogroup\"\n{}", keys_toml(&keys));
    let (server, dir) = start_in(&env, "a", &extra);
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    wait_for_log(&server, "the service account cannot read the ticket key file", 1);
    let session = env.dir.path().join("a.session");
    let scratch = env.dir.path().join("scratch.session");
    assert_eq!(s_client(&env, &server, None, &session), Handshake::New);
    let (ok, reply) = reload(&dir);
    assert!(!ok && reply.contains("Permission denied"), "{reply}");
    // As the warning says: readable by the account's group, and it reloads.
    let chgrp = Command::new("chgrp").arg("nogroup").arg(&keys).status().unwrap();
    assert!(chgrp.success());
    std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o640)).unwrap();
    let (ok, reply) = reload(&dir);
    assert!(ok, "{reply}");
    assert_eq!(
        s_client(&env, &server, Some(&session), &scratch),
        Handshake::Reused
    );
}
