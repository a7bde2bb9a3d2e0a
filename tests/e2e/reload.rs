//! Reload: `webship reload` and SIGHUP swap sites, routes and certificates while
//! downloads in flight over h1, h2 and h3 finish byte-exact on the configuration
//! they started with; a broken file is refused with `webship check`'s words and the
//! running configuration keeps serving; restart-only changes are named.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes};
use http_body_util::BodyExt;
use sha2::{Digest, Sha256};
use webship_tests::client::{connect, hex, Conn, H3Client, H3Options, Proto, Tuning};
use webship_tests::origin::Origin;
use webship_tests::{webship, Server};

use crate::support::{pattern, Env, HOST, MIB};

/// Each download's size and the pace its client reads at: about five seconds each,
/// so all of them are in flight when the reload comes, a second after they start.
const LEN: usize = 16 * MIB as usize;
const READ_BYTES_PER_SEC: u64 = 3 * MIB;
const NEW_SITE: &str = "new.test";
const NEW_ROUTE: &str = "api.test";

/// A daemon on one config file that the test rewrites.
struct World {
    env: Env,
    server: Server,
    file: PathBuf,
    control: PathBuf,
}

impl World {
    fn start() -> World {
        let env = Env::new();
        let control = env.dir.path().join("control.sock");
        let server = Server::start(env.dir.path(), &config(&env, &control, "", ""));
        let file = env.dir.path().join("webship.toml");
        World {
            env,
            server,
            file,
            control,
        }
    }

    /// Rewrites the daemon's file: `top` at the top level, `tail` after the site.
    fn write(&self, top: &str, tail: &str) {
        let text =
            config(&self.env, &self.control, top, tail).replace("{port}", &self.server.port.to_string());
        std::fs::write(&self.file, text).unwrap();
    }

    fn reload(&self) -> Output {
        webship(
            &["reload", "--config", self.file.to_str().unwrap()],
            self.env.dir.path(),
        )
    }

    fn check(&self) -> Output {
        webship(
            &["check", "--config", self.file.to_str().unwrap()],
            self.env.dir.path(),
        )
    }

    /// GET `path` on `host` over a fresh connection; the status, the body and the
    /// served certificate's serial.
    async fn get(&self, proto: Proto, host: &str, path: &str) -> (u16, Vec<u8>, Vec<u8>) {
        let tls = connect(self.server.addr(), host, self.env.client(proto.alpn()))
            .await
            .unwrap_or_else(|e| panic!("TLS for {host}: {e}"));
        let served = tls.get_ref().1.peer_certificates().unwrap()[0].to_vec();
        let authority = format!("{host}:{}", self.server.port);
        let mut conn = Conn::handshake(tls, proto, &authority, Tuning::default())
            .await
            .unwrap();
        let response = conn.send("GET", path, &[], Bytes::new()).await.unwrap();
        let status = response.status().as_u16();
        let body = response.into_body().collect().await.unwrap().to_bytes().to_vec();
        conn.close().await;
        (status, body, serial(&served))
    }

    async fn get_h3(&self, host: &str, path: &str) -> (u16, Vec<u8>) {
        let tls = self.env.client(b"h3");
        let mut client = H3Client::connect(self.server.addr(), host, &tls, &H3Options::default())
            .await
            .unwrap_or_else(|e| panic!("QUIC for {host}: {e:#}"));
        let got = client.fetch("GET", path, &[]).await;
        client.close().await;
        (got.status.as_u16(), got.body.clone())
    }
}

/// The test's configuration: one files site on `HOST`; `top` goes before it, `tail`
/// after it (more sites, routes).
fn config(env: &Env, control: &Path, top: &str, tail: &str) -> String {
    format!(
        "listen = \"127.0.0.1:{{port}}\"\ncontrol_socket = \"{}\"\nworkers = 2\n{top}\n\n\
         [limits]\nshutdown_grace_secs = 2\n\n\
         [[sites]]\ndomain = \"{HOST}\"\nroot = \"{}\"\n[sites.tls]\ncert = \"{}\"\nkey = \"{}\"\n{tail}",
        control.display(),
        env.root.display(),
        env.cert.display(),
        env.key.display()
    )
}

/// A second site and a proxy route, both under `cert`/`key`.
fn new_site_and_route(root: &Path, origin: &Origin, cert: &Path, key: &Path) -> String {
    format!(
        "\n[[sites]]\ndomain = \"{NEW_SITE}\"\nroot = \"{}\"\n[sites.tls]\ncert = \"{}\"\nkey = \"{}\"\n\n\
         [reverse_proxy]\nenabled = true\ntls_termination = true\n[reverse_proxy.tls]\ncert = \"{}\"\nkey = \"{}\"\n\
         [[reverse_proxy.routes]]\ndomain = \"{NEW_ROUTE}\"\npath_prefix = \"/api/\"\nstrip_prefix = true\nupstreams = [\"{}\"]\n",
        root.display(),
        cert.display(),
        key.display(),
        cert.display(),
        key.display(),
        origin.addr
    )
}

/// The serial number of a DER certificate (Certificate → TBSCertificate → optional
/// `[0]` version → serialNumber), read with the few DER rules it needs.
fn serial(der: &[u8]) -> Vec<u8> {
    /// (tag, content) of the element at the start of `b`, and what follows it.
    fn element(b: &[u8]) -> (u8, &[u8], &[u8]) {
        let tag = b[0];
        let (len, head) = match b[1] {
            n if n < 0x80 => (n as usize, 2),
            n => {
                let k = (n & 0x7f) as usize;
                let len = b[2..2 + k].iter().fold(0usize, |acc, &x| acc << 8 | x as usize);
                (len, 2 + k)
            }
        };
        (tag, &b[head..head + len], &b[head + len..])
    }
    let (_, certificate, _) = element(der);
    let (_, tbs, _) = element(certificate);
    let (tag, content, rest) = element(tbs);
    let (tag, content) = if tag == 0xa0 {
        let (tag, content, _) = element(rest);
        (tag, content)
    } else {
        (tag, content)
    };
    assert_eq!(tag, 0x02, "serialNumber is an INTEGER");
    content.to_vec()
}

fn pem_serial(path: &Path) -> Vec<u8> {
    use rustls::pki_types::pem::PemObject;
    let der = rustls::pki_types::CertificateDer::from_pem_file(path).unwrap();
    serial(&der)
}

/// Reads at most `READ_BYTES_PER_SEC`: sleeps until `total` bytes are due.
async fn pace(started: Instant, total: u64) {
    let due = started + Duration::from_secs_f64(total as f64 / READ_BYTES_PER_SEC as f64);
    tokio::time::sleep_until(due.into()).await;
}

/// One slow download of `/big.bin`: its progress counts into `progress`; returns
/// the body's length and digest.
async fn download(
    tls: Arc<rustls::ClientConfig>,
    addr: std::net::SocketAddr,
    proto: Option<Proto>,
    progress: Arc<AtomicU64>,
) -> (u64, String) {
    let started = Instant::now();
    let mut hasher = Sha256::new();
    let take = |data: &[u8], hasher: &mut Sha256| {
        hasher.update(data);
        progress.fetch_add(data.len() as u64, Ordering::SeqCst) + data.len() as u64
    };
    let total = || progress.load(Ordering::SeqCst);
    match proto {
        Some(proto) => {
            let tls = connect(addr, HOST, tls).await.unwrap();
            // Small windows: the server waits on this client rather than buffering.
            let tuning = Tuning {
                h1_max_buffer: None,
                h2_stream_window: Some(1 << 20),
                h2_connection_window: Some(1 << 20),
                h2_max_header_list: None,
            };
            let mut conn = Conn::handshake(tls, proto, &format!("{HOST}:{}", addr.port()), tuning)
                .await
                .unwrap();
            let response = conn.send("GET", "/big.bin", &[], Bytes::new()).await.unwrap();
            assert_eq!(response.status(), 200);
            let mut body = response.into_body();
            while let Some(frame) = body.frame().await {
                let frame = frame.unwrap_or_else(|e| panic!("{proto:?} download cut at {}: {e}", total()));
                if let Some(data) = frame.data_ref() {
                    let t = take(data, &mut hasher);
                    pace(started, t).await;
                }
            }
            conn.close().await;
        }
        None => {
            let options = H3Options {
                stream_window: 1 << 20,
                window: 1 << 20,
                ..H3Options::default()
            };
            let mut client = H3Client::connect(addr, HOST, &tls, &options).await.unwrap();
            let (parts, mut stream) = client.send("GET", "/big.bin", &[]).await.unwrap();
            assert_eq!(parts.status, 200);
            while let Some(mut chunk) = stream
                .recv_data()
                .await
                .unwrap_or_else(|e| panic!("h3 download cut at {}: {e}", total()))
            {
                let data = chunk.copy_to_bytes(chunk.remaining());
                let t = take(&data, &mut hasher);
                pace(started, t).await;
            }
            client.close().await;
        }
    }
    (total(), hex(&hasher.finalize()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_under_20_downloads_keeps_them_exact_and_serves_the_new_site_route_and_certificate() {
    let w = World::start();
    let body = pattern(LEN);
    w.env.write("big.bin", &body);
    let digest = hex(&Sha256::digest(&body));
    let new_root = w.env.dir.path().join("new-root");
    std::fs::create_dir(&new_root).unwrap();
    std::fs::write(new_root.join("hello.txt"), b"the new site\n").unwrap();
    let origin = Origin::start().await;
    let old_serial = pem_serial(&w.env.cert);
    let (status, _, served) = w.get(Proto::H2, HOST, "/hello.txt").await;
    assert_eq!((status, &served), (404, &old_serial), "before the reload");

    let protos = [Some(Proto::H1), Some(Proto::H2), None];
    let mut tasks = Vec::new();
    let mut progress = Vec::new();
    for i in 0..20 {
        let p = Arc::new(AtomicU64::new(0));
        progress.push(p.clone());
        let proto = protos[i % 3];
        let tls = w.env.client(proto.map_or(&b"h3"[..], Proto::alpn));
        tasks.push((proto, tokio::spawn(download(tls, w.server.addr(), proto, p))));
    }
    let all_started = webship_tests::server::eventually(Duration::from_secs(10), || {
        progress.iter().all(|p| p.load(Ordering::SeqCst) > 0)
    });
    assert!(all_started, "not every download started");

    // New certificate for the old site (same file names, new key pair), a new site
    // and a new route, in one reload.
    let (cert, key) = w.env.leaf("renewed", &[HOST, NEW_SITE, NEW_ROUTE, "localhost"]);
    std::fs::copy(&cert, &w.env.cert).unwrap();
    std::fs::copy(&key, &w.env.key).unwrap();
    w.write("", &new_site_and_route(&new_root, &origin, &cert, &key));
    let begun = Instant::now();
    let out = w.reload();
    let round_trip = begun.elapsed();
    let at_reload: Vec<u64> = progress.iter().map(|p| p.load(Ordering::SeqCst)).collect();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "reload: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("reloaded (generation 2"), "{stdout}");
    let (status, got, served) = w.get(Proto::H1, NEW_SITE, "/hello.txt").await;
    let effect = begun.elapsed();
    eprintln!(
        "webship reload: {round_trip:?} until the reply, {effect:?} until a new connection saw the new site"
    );
    assert_eq!((status, got.as_slice()), (200, &b"the new site\n"[..]));
    assert_eq!(served, pem_serial(&cert), "the new certificate is served");
    assert_ne!(served, old_serial);
    let (status, _, served) = w.get(Proto::H2, HOST, "/big.bin").await;
    assert_eq!(
        (status, served),
        (200, pem_serial(&cert)),
        "the old site, renewed"
    );
    let (status, got, _) = w.get(Proto::H2, NEW_ROUTE, "/api/echo").await;
    assert_eq!(status, 200, "the new route");
    assert!(
        String::from_utf8_lossy(&got).contains("path: /echo"),
        "{}",
        String::from_utf8_lossy(&got)
    );
    assert_eq!(origin.seen().len(), 1);
    let (status, got) = w.get_h3(NEW_SITE, "/hello.txt").await;
    assert_eq!(
        (status, got.as_slice()),
        (200, &b"the new site\n"[..]),
        "h3 sees the new site"
    );

    for (i, (proto, task)) in tasks.into_iter().enumerate() {
        let (len, got) = tokio::time::timeout(Duration::from_secs(60), task)
            .await
            .expect("a download did not finish")
            .unwrap();
        assert!(
            at_reload[i] < LEN as u64,
            "download {i} ({proto:?}) had finished before the reload"
        );
        assert_eq!(
            (len, got.as_str()),
            (LEN as u64, digest.as_str()),
            "download {i} ({proto:?})"
        );
    }
    let log = w.server.log();
    assert!(log.contains("configuration reloaded"), "{log}");
}

/// Each kind of broken file: what to write (top level, after the site) and a
/// fragment of the refusal.
fn broken(w: &World) -> Vec<(&'static str, String, String, &'static str)> {
    let (cert_a, _) = w.env.leaf("other", &[HOST]);
    let garbage = w.env.dir.path().join("garbage.pem");
    std::fs::write(&garbage, "not a key\n").unwrap();
    let site = |cert: &Path, key: &Path| {
        format!(
            "\n[[sites]]\ndomain = \"{NEW_SITE}\"\nroot = \"{}\"\n[sites.tls]\ncert = \"{}\"\nkey = \"{}\"\n",
            w.env.root.display(),
            cert.display(),
            key.display()
        )
    };
    vec![
        ("syntax", String::new(), "\n[[sites]\n".into(), "expected"),
        (
            "validation",
            "no_such_key = 1".into(),
            String::new(),
            "no_such_key",
        ),
        (
            "unreadable key",
            String::new(),
            site(&w.env.cert, &garbage),
            "private key",
        ),
        (
            "mismatched certificate",
            String::new(),
            site(&cert_a, &w.env.key),
            "does not belong",
        ),
        (
            "unknown user",
            "user = \"no-such-webship-user\"".into(),
            String::new(),
            "no-such-webship-user",
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_config_is_refused_with_the_check_text_and_the_old_one_keeps_serving() {
    let w = World::start();
    w.env.write("hello.txt", b"hello\n");
    let serial = pem_serial(&w.env.cert);
    for (kind, top, tail, fragment) in broken(&w) {
        w.write(&top, &tail);
        let check = w.check();
        assert!(!check.status.success(), "{kind}: check passed");
        let check_text = String::from_utf8_lossy(&check.stderr).into_owned();
        let out = w.reload();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(1), "{kind}: {stderr}");
        assert!(check_text.contains(fragment), "{kind}: {check_text}");
        // The same words as `webship check`, line for line.
        assert!(
            stderr.starts_with(check_text.trim_end()),
            "{kind}:\ncheck: {check_text}\nreload: {stderr}"
        );
        let (status, body, served) = w.get(Proto::H2, HOST, "/hello.txt").await;
        assert_eq!(
            (status, body.as_slice(), &served),
            (200, &b"hello\n"[..], &serial),
            "{kind}"
        );
    }
    assert_eq!(
        w.server.log().matches("reload refused").count(),
        5,
        "{}",
        w.server.log()
    );

    // A good file again: generation 2 (none of the refusals counted).
    w.write("", "");
    let out = w.reload();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("generation 2"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_only_changes_are_named_and_the_rest_applies() {
    let w = World::start();
    let new_root = w.env.dir.path().join("new-root");
    std::fs::create_dir(&new_root).unwrap();
    std::fs::write(new_root.join("hello.txt"), b"the new site\n").unwrap();
    let port = w.server.port;
    let other = webship_tests::server::free_port().unwrap();
    let origin = Origin::start().await;
    let (cert, key) = w.env.leaf("both", &[NEW_SITE, NEW_ROUTE]);
    let text = config(
        &w.env,
        &w.control,
        "",
        &new_site_and_route(&new_root, &origin, &cert, &key),
    )
    .replace("{port}", &other.to_string())
    .replace("workers = 2", "workers = 3");
    std::fs::write(&w.file, text).unwrap();
    let out = w.reload();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listen = format!(
        "note: listen changed from 127.0.0.1:{port} to 127.0.0.1:{other}: needs a restart; still listening on 127.0.0.1:{port}"
    );
    assert!(stdout.contains(&listen), "{stdout}");
    assert!(
        stdout.contains("note: workers changed from 2 to 3: needs a restart; still running 2"),
        "{stdout}"
    );
    assert!(
        w.server.log().contains("listen changed from"),
        "the log names it too"
    );
    let (status, got, _) = w.get(Proto::H2, NEW_SITE, "/hello.txt").await;
    assert_eq!(
        (status, got.as_slice()),
        (200, &b"the new site\n"[..]),
        "the rest applied"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_file_the_daemon_runs_on() {
    let w = World::start();
    let new_root = w.env.dir.path().join("new-root");
    std::fs::create_dir(&new_root).unwrap();
    std::fs::write(new_root.join("hello.txt"), b"the new site\n").unwrap();
    let origin = Origin::start().await;
    let (cert, key) = w.env.leaf("both", &[NEW_SITE, NEW_ROUTE]);
    w.write("", &new_site_and_route(&new_root, &origin, &cert, &key));
    let begun = Instant::now();
    let kill = std::process::Command::new("kill")
        .args(["-HUP", &w.server.pid().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    // Poll the changed response in a bounded loop: the time SIGHUP takes to apply.
    let mut seen = None;
    for _ in 0..500 {
        // Until the reload, new.test is shown the old site's certificate: refused.
        let verified = connect(w.server.addr(), NEW_SITE, w.env.client(b"http/1.1")).await;
        if verified.is_ok() && w.get(Proto::H1, NEW_SITE, "/hello.txt").await.0 == 200 {
            seen = Some(begun.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let took =
        seen.unwrap_or_else(|| panic!("SIGHUP did not reload within the loop; log:\n{}", w.server.log()));
    eprintln!("SIGHUP: the new site answered {took:?} after the signal");

    // The daemon is still the one started, on generation 2, and says so.
    let status = webship::control::call(
        &w.control,
        &webship::control::Request::Status,
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    assert!(status.ok, "{status:?}");
    let pid = format!("pid {} ", w.server.pid());
    assert!(
        status.message.contains(&pid) && status.message.contains("generation 2"),
        "{status:?}"
    );
    // The socket file goes with the daemon.
    assert!(w.control.exists());
    let mut w = w;
    w.server.terminate();
    assert!(w
        .server
        .wait_exit(Duration::from_secs(10))
        .is_some_and(|s| s.success()));
    assert!(!w.control.exists(), "the control socket was left behind");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_account_cannot_reread_a_root_only_key_and_the_refusal_says_what_to_do() {
    use std::os::unix::fs::PermissionsExt;
    let env = Env::new();
    // The temp dirs are 0700: the service account must reach the file and the root.
    for dir in [env.dir.path(), env.root.as_path()] {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    std::fs::set_permissions(&env.key, std::fs::Permissions::from_mode(0o600)).unwrap();
    env.write("hello.txt", b"hello\n");
    let control = env.dir.path().join("control.sock");
    let server = Server::start(
        env.dir.path(),
        &config(&env, &control, "user = \"nobody\"\ngroup = \"nogroup\"", ""),
    );
    let file = env.dir.path().join("webship.toml");
    let reload = || webship(&["reload", "--config", file.to_str().unwrap()], env.dir.path());
    let out = reload();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(stderr.contains("Permission denied"), "{stderr}");
    assert!(
        stdout.contains("the daemon runs as `nobody`") && stdout.contains("chgrp nogroup KEY"),
        "{stdout}"
    );
    // As the note says: the key readable by the account's group, and it reloads.
    let chgrp = std::process::Command::new("chgrp")
        .arg("nogroup")
        .arg(&env.key)
        .status()
        .unwrap();
    assert!(chgrp.success());
    std::fs::set_permissions(&env.key, std::fs::Permissions::from_mode(0o640)).unwrap();
    let out = reload();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let got = env.get(Proto::H2, &server, "/hello.txt", &[]).await;
    assert_eq!(got.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_passthrough_route_added_by_a_reload_carries_new_connections() {
    let w = World::start();
    let origin_root = w.env.dir.path().join("origin-root");
    std::fs::create_dir(&origin_root).unwrap();
    std::fs::write(origin_root.join("who.txt"), b"origin a").unwrap();
    let origin_dir = tempfile::tempdir().unwrap();
    let (cert, key) = w.env.leaf("a", &["a.pass"]);
    let origin = Server::start(
        origin_dir.path(),
        &format!(
            "listen = \"127.0.0.1:{{port}}\"\nworkers = 1\n[[sites]]\ndomain = \"a.pass\"\nroot = \"{}\"\n\
             [sites.protocols]\nh3 = false\n[sites.tls]\ncert = \"{}\"\nkey = \"{}\"\n",
            origin_root.display(),
            cert.display(),
            key.display()
        ),
    );
    w.write(
        "",
        &format!(
            "\n[reverse_proxy]\nenabled = true\ntls_termination = false\n[reverse_proxy.protocols]\nh1 = true\nh2 = true\nh3 = false\n\
             [[reverse_proxy.routes]]\ndomain = \"a.pass\"\nupstreams = [\"{}\"]\n",
            origin.addr()
        ),
    );
    let out = w.reload();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // The client verifies a.pass's chain: only the origin holds that key.
    let (status, body, served) = w.get(Proto::H2, "a.pass", "/who.txt").await;
    assert_eq!((status, body.as_slice()), (200, &b"origin a"[..]));
    assert_eq!(served, pem_serial(&cert));
    w.env.write("hello.txt", b"hello\n");
    let (status, body, _) = w.get(Proto::H1, HOST, "/hello.txt").await;
    assert_eq!(
        (status, body.as_slice()),
        (200, &b"hello\n"[..]),
        "the files site still terminates"
    );
}

/// The control socket answers root and the daemon's own account only: even with its
/// file opened to everyone (as a permissive umask could leave it for a moment), a
/// connection from another account is closed unanswered, and root's is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_control_socket_answers_no_other_account() {
    let w = World::start();
    // The test's folder (in /tmp) opened for `nobody` to reach the socket.
    std::fs::set_permissions(w.env.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&w.control, std::fs::Permissions::from_mode(0o666)).unwrap();
    // As `nobody` (perl is essential on Debian): connect, ask for the status, print
    // what comes back.
    let ask = r#"use IO::Socket::UNIX; $SIG{PIPE} = "IGNORE"; my $s = IO::Socket::UNIX->new(Peer => $ARGV[0]) or die "connect: $!";
        print $s "\"status\"\n"; local $/; my $got = <$s>; print "[", (defined $got ? $got : ""), "]";"#;
    let out = std::os::unix::process::CommandExt::uid(
        std::os::unix::process::CommandExt::gid(Command::new("perl").args(["-e", ask]), 65534),
        65534,
    )
    .arg(&w.control)
    .output()
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout.trim(), "[]", "another account got an answer");
    // Root's request is answered.
    let status = webship::control::call(
        &w.control,
        &webship::control::Request::Status,
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    assert!(status.ok, "{status:?}");
}
