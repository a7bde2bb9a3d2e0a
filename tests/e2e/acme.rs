//! ACME (`[sites.acme]`) against a real ACME server: Debian's Pebble, with its
//! challenge test server answering Pebble's DNS queries (every name is 127.0.0.1),
//! validating `tls-alpn-01` on the daemon's own TLS port. What a client sees is
//! checked with openssl: the chain verifies against Pebble's root, and the serial
//! tells one certificate from the next.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use webship_testkit::ports::free_port;
use webship_testkit::process::{Logs, Process, Ready};
use webship_tests::{webship, Server};

use crate::support::{Env, HOST};

const SITE: &str = "acme.webship.test";
/// Issuance with `PEBBLE_VA_NOSLEEP` takes about a second; the box may be busy.
const ISSUE_WITHIN: Duration = Duration::from_secs(90);

/// Pebble and its DNS, on loopback ports of their own; stopped when dropped.
struct Pebble {
    _dns: Process,
    _pebble: Process,
    directory: String,
    /// Pebble's issuing root (from its management interface).
    root: PathBuf,
}

impl Pebble {
    /// Validates `tls-alpn-01` on `tls_port`, `http-01` on `http_port`.
    fn start(env: &Env, tls_port: u16, http_port: u16) -> Pebble {
        let dir = env.dir.path();
        let (dns_port, dns_mgmt) = (free_port().unwrap(), free_port().unwrap());
        let mut dns = Process::spawn(
            "pebble-challtestsrv",
            Command::new("pebble-challtestsrv").args([
                "-dns01",
                &format!("127.0.0.1:{dns_port}"),
                "-management",
                &format!("127.0.0.1:{dns_mgmt}"),
                "-defaultIPv4",
                "127.0.0.1",
                "-defaultIPv6",
                "",
                "-http01",
                "",
                "-https01",
                "",
                "-tlsalpn01",
                "",
            ]),
            Logs::one(dir.join("challtestsrv.log")),
        )
        .unwrap();
        wait_ready(&mut dns, dns_mgmt);
        let (port, mgmt) = (free_port().unwrap(), free_port().unwrap());
        let leaf = env.pki.leaf("pebble", &["localhost", "127.0.0.1"]).unwrap();
        let config = serde_json::json!({"pebble": {
            "listenAddress": format!("127.0.0.1:{port}"),
            "managementListenAddress": format!("127.0.0.1:{mgmt}"),
            "certificate": leaf.cert,
            "privateKey": leaf.key,
            "httpPort": http_port,
            "tlsPort": tls_port,
            "ocspResponderURL": "",
            "externalAccountBindingRequired": false,
        }});
        let file = dir.join("pebble.json");
        std::fs::write(&file, config.to_string()).unwrap();
        let mut pebble = Process::spawn(
            "pebble",
            Command::new("pebble")
                .args([
                    "-config",
                    file.to_str().unwrap(),
                    "-dnsserver",
                    &format!("127.0.0.1:{dns_port}"),
                ])
                .env("PEBBLE_VA_NOSLEEP", "1")
                .env("PEBBLE_VA_ALWAYS_VALID", "0")
                // Every order validates (no authorization reuse), no nonce is refused.
                .env("PEBBLE_AUTHZREUSE", "0")
                .env("PEBBLE_WFE_NONCEREJECT", "0"),
            Logs::one(dir.join("pebble.log")),
        )
        .unwrap();
        wait_ready(&mut pebble, mgmt);
        let root = dir.join("pebble-root.pem");
        let out = Command::new("curl")
            .args(["-sSf", "--max-time", "10", "--cacert"])
            .arg(env.ca_file())
            .arg(format!("https://localhost:{mgmt}/roots/0"))
            .arg("-o")
            .arg(&root)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "Pebble's root: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Pebble {
            _dns: dns,
            _pebble: pebble,
            directory: format!("https://localhost:{port}/dir"),
            root,
        }
    }

    /// The daemon's configuration: `SITE` through ACME, storage in `storage`.
    fn config(&self, env: &Env, port: u16, storage: &Path) -> String {
        self.config_with(env, port, storage, "", "tls-alpn-01")
    }

    /// With `acme` added to the `[acme]` table and this `challenge`.
    fn config_with(&self, env: &Env, port: u16, storage: &Path, acme: &str, challenge: &str) -> String {
        format!(
            "listen = \"127.0.0.1:{port}\"\nworkers = 2\n\n[acme]\nstorage = \"{}\"\n{acme}\n\n[[sites]]\ndomain = \"{SITE}\"\nroot = \"{}\"\n[sites.acme]\ndirectory = \"{}\"\nemail = \"ops@webship.test\"\nchallenge = \"{challenge}\"\ndirectory_ca = \"{}\"\n",
            storage.display(),
            env.root.display(),
            self.directory,
            env.ca_file().display(),
        )
    }
}

fn wait_ready(process: &mut Process, port: u16) {
    let ready = Ready {
        port,
        line: None,
        within: Duration::from_secs(20),
    };
    if let Err(e) = process.wait_ready(&ready) {
        panic!("{} {e}; log:\n{}", process.name(), process.log());
    }
}

/// Starts webship on `port` with `config` (written to `<dir>/webship.toml`).
fn start(env: &Env, port: u16, config: &str) -> (Server, PathBuf) {
    let path = env.dir.path().join("webship.toml");
    std::fs::write(&path, config).unwrap();
    let mut server = Server::spawn(
        env.dir.path(),
        &["serve", "--config", path.to_str().unwrap()],
        port,
    );
    server.wait_listening();
    (server, path)
}

/// The serial of the certificate `SITE` is served with on `port`, verified against
/// `root`; `Err` with openssl's words when the handshake or the verification fails.
fn served_serial(port: u16, root: &Path) -> Result<String, String> {
    let out = Command::new("timeout")
        .args([
            "10",
            "openssl",
            "s_client",
            "-connect",
            &format!("127.0.0.1:{port}"),
        ])
        .args([
            "-servername",
            SITE,
            "-verify_return_error",
            "-alpn",
            "http/1.1",
            "-CAfile",
        ])
        .arg(root)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let mut x509 = Command::new("openssl")
        .args(["x509", "-noout", "-serial"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    x509.stdin.take().unwrap().write_all(&out.stdout).unwrap();
    let serial = x509.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&serial.stdout);
    text.trim()
        .strip_prefix("serial=")
        .map(str::to_owned)
        .ok_or_else(|| format!("no serial in {text:?}"))
}

/// Waits for the first ACME certificate; returns its serial and how long it took.
fn first_certificate(server: &Server, root: &Path, since: Instant) -> (String, Duration) {
    loop {
        match served_serial(server.port, root) {
            Ok(serial) => return (serial, since.elapsed()),
            Err(e) if since.elapsed() > ISSUE_WITHIN => {
                panic!(
                    "no ACME certificate served after {ISSUE_WITHIN:?}: {e}\nlog:\n{}",
                    server.log()
                )
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// `webship certs --json` (with `--renew site` first when given).
fn certs(config: &Path, renew: Option<&str>) -> (bool, serde_json::Value, String) {
    let mut args = vec!["certs", "--json", "--config", config.to_str().unwrap()];
    if let Some(site) = renew {
        args.extend(["--renew", site]);
    }
    let out = webship(&args, Path::new("/"));
    let list = serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
    (
        out.status.success(),
        list,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn metric(config: &Path, line_start: &str) -> Option<u64> {
    let socket = webship::config::load(config).unwrap().control_socket.unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let reply = runtime
        .block_on(webship::control::call(
            &socket,
            &webship::control::Request::Metrics,
            Duration::from_secs(10),
        ))
        .unwrap();
    reply
        .message
        .lines()
        .find_map(|l| l.strip_prefix(line_start)?.trim().parse().ok())
}

#[test]
fn acme_tls_alpn01_issues_at_start_and_a_forced_renewal_swaps_it_under_a_download() {
    let env = Env::new();
    let body: Vec<u8> = (0..32u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(env.root.join("big.bin"), &body).unwrap();
    let port = free_port().unwrap();
    let pebble = Pebble::start(&env, port, free_port().unwrap());
    let storage = env.dir.path().join("acme");
    let started = Instant::now();
    let (server, config) = start(&env, port, &pebble.config(&env, port, &storage));
    let (serial, took) = first_certificate(&server, &pebble.root, started);
    eprintln!(
        "ACME: daemon start to a served Pebble certificate: {} ms",
        took.as_millis()
    );

    // Stored: the key private to the daemon, the chain beside it.
    let folder = std::fs::read_dir(storage.join("certs"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(folder.join("key.pem"))
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600, "the stored key is 0600");
    assert!(std::fs::read_to_string(folder.join("cert.pem"))
        .unwrap()
        .contains("BEGIN CERTIFICATE"));
    let (ok, list, _) = certs(&config, None);
    assert!(ok);
    assert_eq!(list[0]["site"], SITE);
    assert_eq!(list[0]["serial"].as_str(), Some(serial.as_str()), "{list}");

    // A slow download on its own connection, under way while the renewal happens.
    let out = env.dir.path().join("download.bin");
    let mut curl = Command::new("curl")
        .args([
            "-sS",
            "--http1.1",
            "--limit-rate",
            "8M",
            "--max-time",
            "60",
            "--cacert",
        ])
        .arg(&pebble.root)
        .args(["--resolve", &format!("{SITE}:{port}:127.0.0.1")])
        .arg(format!("https://{SITE}:{port}/big.bin"))
        .arg("-o")
        .arg(&out)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::fs::metadata(&out).map_or(0, |m| m.len()) < (1 << 20) {
        assert!(Instant::now() < deadline, "the download did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (ok, list, message) = certs(&config, Some(SITE));
    assert!(ok, "the forced renewal failed: {message}\nlog:\n{}", server.log());
    let renewed = list[0]["serial"].as_str().unwrap().to_owned();
    assert_ne!(renewed, serial, "a new certificate");
    assert!(
        std::fs::metadata(&out).unwrap().len() < body.len() as u64,
        "the renewal happened while the download ran"
    );
    assert_eq!(
        served_serial(port, &pebble.root).unwrap(),
        renewed,
        "a new connection sees the new serial"
    );
    let status = curl.wait().unwrap();
    assert!(status.success(), "the download across the renewal failed");
    assert!(std::fs::read(&out).unwrap() == body, "the download is byte-exact");
    assert_eq!(
        metric(&config, "webship_acme_orders_total{outcome=\"issued\"}"),
        Some(2)
    );
    assert_eq!(
        metric(&config, "webship_acme_orders_total{outcome=\"failed\"}"),
        Some(0)
    );
}

#[test]
fn acme_certificate_is_reused_after_a_restart_and_a_failed_renewal_keeps_it() {
    let env = Env::new();
    let port = free_port().unwrap();
    let pebble = Pebble::start(&env, port, free_port().unwrap());
    let storage = env.dir.path().join("acme");
    let (server, _) = start(&env, port, &pebble.config(&env, port, &storage));
    let (serial, _) = first_certificate(&server, &pebble.root, Instant::now());
    drop(server);

    // Restarted on another port, which Pebble does not validate on: the stored
    // certificate is served at once, and a renewal cannot pass validation.
    let other = free_port().unwrap();
    let (server, config) = start(&env, other, &pebble.config(&env, other, &storage));
    assert_eq!(
        served_serial(other, &pebble.root).as_deref(),
        Ok(serial.as_str()),
        "the stored certificate is served right after the restart"
    );
    let (ok, list, message) = certs(&config, Some(SITE));
    assert!(!ok, "the renewal cannot succeed: {list}");
    assert!(message.contains("renewal failed"), "{message}");
    assert!(
        list[0]["last_error"].as_str().is_some_and(|e| !e.is_empty()),
        "{list}"
    );
    assert_eq!(list[0]["serial"].as_str(), Some(serial.as_str()));
    assert_eq!(
        served_serial(other, &pebble.root).as_deref(),
        Ok(serial.as_str()),
        "the old certificate keeps serving"
    );
    assert_eq!(
        metric(&config, "webship_acme_orders_total{outcome=\"failed\"}"),
        Some(1)
    );
    assert_eq!(
        metric(&config, "webship_acme_orders_total{outcome=\"issued\"}"),
        Some(0)
    );
    assert!(
        server.log().contains("acme: could not obtain a certificate"),
        "the failure is logged"
    );
}

#[test]
fn acme_http01_issues_through_the_http_listener_which_redirects_served_names_only() {
    let env = Env::new();
    let (port, http) = (free_port().unwrap(), free_port().unwrap());
    let pebble = Pebble::start(&env, port, http);
    let storage = env.dir.path().join("acme");
    let acme = format!("http_listen = \"127.0.0.1:{http}\"");
    let started = Instant::now();
    let (server, config) = start(
        &env,
        port,
        &pebble.config_with(&env, port, &storage, &acme, "http-01"),
    );
    let (_, took) = first_certificate(&server, &pebble.root, started);
    eprintln!(
        "ACME http-01: daemon start to a served Pebble certificate: {} ms",
        took.as_millis()
    );
    assert!(server.log().contains("acme: certificate installed"));
    // Not a challenge: redirected to https on the TLS port, path kept.
    let out = Command::new("curl")
        .args([
            "-sS",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code} %{redirect_url}",
            "--max-time",
            "10",
        ])
        .args(["-H", &format!("Host: {SITE}")])
        .arg(format!("http://127.0.0.1:{http}/a/b.txt?x=1"))
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("308 https://{SITE}:{port}/a/b.txt?x=1")
    );
    // An unknown token is not found (the order's tokens were withdrawn).
    let out = Command::new("curl")
        .args(["-sS", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "10"])
        .arg(format!("http://127.0.0.1:{http}/.well-known/acme-challenge/nope"))
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "404");
    // A name this daemon does not serve is not redirected (no open redirector).
    let status = |host: &str, from: &str| {
        let out = Command::new("curl")
            .args(["-sS", "-o", "/dev/null", "-w", "%{http_code} %{redirect_url}"])
            .args(["--max-time", "10", "--interface", from])
            .args(["-H", &format!("Host: {host}")])
            .arg(format!("http://127.0.0.1:{http}/x"))
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    assert_eq!(status("evil.example", "127.0.0.1"), "404");
    // One source address holds at most 8 connections: a ninth is closed at accept,
    // while another address is still answered.
    let held: Vec<std::net::TcpStream> = (0..8)
        .map(|_| std::net::TcpStream::connect(("127.0.0.1", http)).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        status(SITE, "127.0.0.1"),
        "000",
        "a ninth connection from one address must be refused"
    );
    assert_eq!(
        metric(&config, "webship_acme_http01_refused_connections_total "),
        Some(1),
        "the refusal is counted"
    );
    assert_eq!(
        status(SITE, "127.0.0.2"),
        format!("308 https://{SITE}:{port}/x"),
        "another address must still be served while one holds its 8 connections"
    );
    drop(held);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(status(SITE, "127.0.0.1"), format!("308 https://{SITE}:{port}/x"));
}

#[test]
fn acme_site_added_by_a_reload_gets_its_certificate_and_goes_with_the_next() {
    let env = Env::new();
    let port = free_port().unwrap();
    let pebble = Pebble::start(&env, port, free_port().unwrap());
    let storage = env.dir.path().join("acme");
    let files_site = format!(
        "[[sites]]\ndomain = \"{HOST}\"\nroot = \"{}\"\n[sites.tls]\ncert = \"{}\"\nkey = \"{}\"\n",
        env.root.display(),
        env.cert.display(),
        env.key.display()
    );
    let base = format!("listen = \"127.0.0.1:{port}\"\nworkers = 2\n\n{files_site}");
    let (server, path) = start(&env, port, &base);
    assert!(
        served_serial(port, &pebble.root).is_err(),
        "no ACME certificate before the reload"
    );
    let reload = |text: &str| {
        std::fs::write(&path, text).unwrap();
        let out = webship(&["reload", "--config", path.to_str().unwrap()], Path::new("/"));
        assert!(
            out.status.success(),
            "reload: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    // Refused after its certificates were looked at (the ticket-key file, mode 0644,
    // is read last): the ACME site gets no slot, so nothing is ordered or listed.
    let keys = env.dir.path().join("ticket.keys");
    let made = webship(&["ticket-keys", "new"], Path::new("/"));
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    std::fs::write(&keys, &made.stdout).unwrap();
    std::fs::set_permissions(&keys, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let acme = format!("{}\n{files_site}", pebble.config(&env, port, &storage));
    std::fs::write(
        &path,
        format!("{acme}\n[tls]\nticket_keys = \"{}\"\n", keys.display()),
    )
    .unwrap();
    let out = webship(&["reload", "--config", path.to_str().unwrap()], Path::new("/"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("mode 0644"), "{stderr}");
    let (ok, list, _) = certs(&path, None);
    assert!(ok);
    assert_eq!(list, serde_json::json!([]), "the refused site is managed");
    reload(&acme);
    let (serial, _) = first_certificate(&server, &pebble.root, Instant::now());
    let (ok, list, _) = certs(&path, None);
    assert!(ok);
    assert_eq!(list[0]["serial"].as_str(), Some(serial.as_str()), "{list}");
    reload(&base);
    let (ok, list, _) = certs(&path, None);
    assert!(ok);
    assert_eq!(
        list,
        serde_json::json!([]),
        "the removed site is no longer managed"
    );
    assert!(served_serial(port, &pebble.root).is_err(), "nor served");
}
