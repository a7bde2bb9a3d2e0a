//! OCSP stapling against a real responder: `openssl ocsp` on loopback over a test CA
//! run with `openssl ca` (its index is the responder's), checked with
//! `openssl s_client -status` as a client sees it. Also the test CA and the
//! handshake helper that `cert_files.rs` shares.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use webship_testkit::process::{Logs, Process};
use webship_tests::server::{eventually, free_port};
use webship_tests::Server;

/// A CA managed by `openssl ca`: its index records what it issued and revoked.
pub(crate) struct TestCa {
    dir: PathBuf,
    pub(crate) cert: PathBuf,
}

/// An issued certificate: the chain file (leaf, then the CA) and its key.
pub(crate) struct Issued {
    pub(crate) chain: PathBuf,
    pub(crate) key: PathBuf,
    pub(crate) leaf: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "openssl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl TestCa {
    pub(crate) fn new(dir: &Path) -> Self {
        let dir = dir.join("ca");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("index.txt"), "").unwrap();
        std::fs::write(dir.join("serial"), "1000\n").unwrap();
        std::fs::write(
            dir.join("ca.cnf"),
            "[ca]\ndefault_ca = test\n[test]\ndatabase = index.txt\nnew_certs_dir = .\nserial = serial\n\
             default_md = sha256\npolicy = any\nunique_subject = no\ndefault_days = 30\n\
             [any]\ncommonName = supplied\n",
        )
        .unwrap();
        openssl(
            &dir,
            &[
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-keyout",
                "ca.key",
                "-out",
                "ca.pem",
                "-days",
                "30",
                "-subj",
                "/CN=webship OCSP test CA",
            ],
        );
        Self {
            cert: dir.join("ca.pem"),
            dir,
        }
    }

    /// Issues `name` for `dns`, naming the responder on `ocsp_port` in its AIA when
    /// given, valid from `dates.0` to `dates.1` (`openssl ca` dates) when given.
    pub(crate) fn issue(
        &self,
        name: &str,
        dns: &str,
        ocsp_port: Option<u16>,
        dates: Option<(&str, &str)>,
    ) -> Issued {
        let ext = self.dir.join(format!("{name}.ext"));
        let aia = ocsp_port
            .map(|p| format!("authorityInfoAccess = OCSP;URI:http://127.0.0.1:{p}/\n"))
            .unwrap_or_default();
        std::fs::write(
            &ext,
            format!("basicConstraints = CA:FALSE\nsubjectAltName = DNS:{dns}\n{aia}"),
        )
        .unwrap();
        let (key, csr, leaf) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.pem"),
        );
        openssl(
            &self.dir,
            &[
                "req",
                "-new",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-keyout",
                &key,
                "-out",
                &csr,
                "-subj",
                &format!("/CN={dns}"),
            ],
        );
        let mut args = vec![
            "ca",
            "-batch",
            "-notext",
            "-config",
            "ca.cnf",
            "-cert",
            "ca.pem",
            "-keyfile",
            "ca.key",
            "-in",
            &csr,
            "-out",
            &leaf,
            "-extfile",
            ext.to_str().unwrap(),
        ];
        if let Some((start, end)) = dates {
            args.extend(["-startdate", start, "-enddate", end]);
        }
        openssl(&self.dir, &args);
        let leaf = self.dir.join(leaf);
        let chain = self.dir.join(format!("{name}-chain.pem"));
        let text = std::fs::read_to_string(&leaf).unwrap() + &std::fs::read_to_string(&self.cert).unwrap();
        std::fs::write(&chain, text).unwrap();
        Issued {
            chain,
            key: self.dir.join(key),
            leaf,
        }
    }

    pub(crate) fn revoke(&self, issued: &Issued) {
        openssl(
            &self.dir,
            &[
                "ca",
                "-config",
                "ca.cnf",
                "-cert",
                "ca.pem",
                "-keyfile",
                "ca.key",
                "-revoke",
                issued.leaf.to_str().unwrap(),
            ],
        );
    }

    /// `openssl ocsp` answering from this CA's index on `port`, signing with the CA
    /// key; answers carry a `nextUpdate` `minutes` ahead.
    pub(crate) fn responder(&self, port: u16, minutes: u32) -> Process {
        let logs = Logs::one(self.dir.join(format!("ocsp-{port}.log")));
        let process = Process::spawn(
            "openssl ocsp",
            Command::new("openssl")
                .args([
                    "ocsp",
                    "-index",
                    "index.txt",
                    "-port",
                    &port.to_string(),
                    "-rsigner",
                    "ca.pem",
                ])
                .args([
                    "-rkey",
                    "ca.key",
                    "-CA",
                    "ca.pem",
                    "-nmin",
                    &minutes.to_string(),
                    "-ignore_err",
                ])
                .current_dir(&self.dir),
            logs,
        )
        .unwrap();
        // Not probed with a connection: `openssl ocsp` stalls on one that closes
        // without a request.
        assert!(
            eventually(Duration::from_secs(10), || process
                .log()
                .contains("waiting for OCSP client connections")),
            "openssl ocsp did not start on {port}: {}",
            process.log()
        );
        process
    }
}

/// `openssl s_client -status` to the daemon on `port` for `sni`: its whole output.
pub(crate) fn s_client(port: u16, sni: &str, ca: &Path) -> String {
    let out = Command::new("timeout")
        .args([
            "15",
            "openssl",
            "s_client",
            "-connect",
            &format!("127.0.0.1:{port}"),
            "-servername",
            sni,
        ])
        .args(["-status", "-CAfile", ca.to_str().unwrap()])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

/// `/metrics` of the admin listener on `port`, by curl.
pub(crate) fn scrape(port: u16) -> String {
    let out = Command::new("curl")
        .args([
            "-sS",
            "--max-time",
            "10",
            &format!("http://127.0.0.1:{port}/metrics"),
        ])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The first PEM certificate in `text` (the leaf `s_client` prints), whitespace-free.
pub(crate) fn first_pem(text: &str) -> String {
    let start = text
        .find("-----BEGIN CERTIFICATE-----")
        .unwrap_or_else(|| panic!("no certificate in:\n{text}"));
    let end = text[start..].find("-----END CERTIFICATE-----").unwrap() + start;
    text[start..end].split_whitespace().collect()
}

/// The `This Update` line of a stapled response.
fn this_update(out: &str) -> Option<String> {
    out.lines()
        .find(|l| l.trim_start().starts_with("This Update:"))
        .map(|l| l.trim().to_owned())
}

fn stapled_good(out: &str) -> bool {
    out.contains("OCSP Response Status: successful") && out.contains("Cert Status: good")
}

fn site(domain: &str, issued: &Issued, root: &Path, extra: &str) -> String {
    format!(
        "[[sites]]\ndomain = \"{domain}\"\nroot = \"{}\"\n[sites.tls]\ncert = \"{}\"\nkey = \"{}\"\n{extra}\n",
        root.display(),
        issued.chain.display(),
        issued.key.display()
    )
}

/// A daemon config on a free port with an OCSP cache in `dir` and an admin listener
/// on `admin`, serving `sites`.
fn with_admin(dir: &Path, admin: u16, sites: &str) -> String {
    format!(
        "listen = \"127.0.0.1:{{port}}\"\nworkers = 1\nocsp_cache = \"{}\"\n[admin]\nlisten = \"127.0.0.1:{admin}\"\n{sites}",
        dir.join("ocsp-cache").display(),
    )
}

/// A test's folder, its document root, its CA, and the port its OCSP responder
/// will listen on.
fn world() -> (tempfile::TempDir, PathBuf, TestCa, u16) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let ca = TestCa::new(dir.path());
    let port = free_port().unwrap();
    (dir, root, ca, port)
}

/// Waits (bounded) until a handshake for `name` carries a good staple.
fn wait_for_staple(server: &Server, name: &str, ca: &TestCa) {
    staple_within(server, name, ca, Duration::from_secs(15), &|| "no staple".into());
}

/// Waits up to `within` until a handshake for `name` carries a good staple, and
/// returns what `openssl s_client` printed for it; fails saying `what()` otherwise.
fn staple_within(
    server: &Server,
    name: &str,
    ca: &TestCa,
    within: Duration,
    what: &dyn Fn() -> String,
) -> String {
    let mut out = String::new();
    assert!(
        eventually(within, || {
            out = s_client(server.port, name, &ca.cert);
            stapled_good(&out)
        }),
        "{} for {name}:\n{out}\nwebship: {}",
        what(),
        server.log()
    );
    out
}

fn count(log: &str, line: &str) -> usize {
    log.matches(line).count()
}

#[test]
fn a_staple_is_sent_refreshed_before_next_update_and_cached_for_a_restart() {
    let (dir, root, ca, port) = world();
    let leaf = ca.issue("good", "good.test", Some(port), None);
    let responder = ca.responder(port, 1);
    let cache = dir.path().join("ocsp-cache");
    let config = format!(
        "listen = \"127.0.0.1:{{port}}\"\nworkers = 1\nocsp_cache = \"{}\"\n{}",
        cache.display(),
        site("good.test", &leaf, &root, "")
    );
    let server = Server::start(dir.path(), &config);
    let no_staple = || format!("no good staple (responder: {})", responder.log());
    let out = staple_within(&server, "good.test", &ca, Duration::from_secs(15), &no_staple);
    let first = this_update(&out).unwrap();
    // A reload reads the same files again: the staple stays, with no new fetch.
    let hup = Command::new("kill")
        .args(["-HUP", &server.pid().to_string()])
        .status()
        .unwrap();
    assert!(hup.success());
    assert!(
        eventually(Duration::from_secs(10), || server
            .log()
            .contains("configuration reloaded")),
        "no reload: {}",
        server.log()
    );
    let out = s_client(server.port, "good.test", &ca.cert);
    assert!(stapled_good(&out), "the reload dropped the staple:\n{out}");
    assert_eq!(this_update(&out).unwrap(), first);
    // nextUpdate is a minute ahead: asked again half-way, about 30 s on.
    assert!(
        eventually(Duration::from_secs(50), || count(
            &server.log(),
            "OCSP response fetched and stapled"
        ) >= 2),
        "no refresh: {}",
        server.log()
    );
    let out = s_client(server.port, "good.test", &ca.cert);
    assert!(stapled_good(&out), "{out}");
    assert_ne!(
        this_update(&out).unwrap(),
        first,
        "the refreshed answer is not the one stapled"
    );
    let cached: Vec<_> = std::fs::read_dir(&cache).unwrap().collect();
    assert_eq!(cached.len(), 1, "one cached answer: {cached:?}");
    drop(server);

    // With the responder gone, a restart staples the cached answer.
    drop(responder);
    let server = Server::start(dir.path(), &config);
    let not_cached = || "the cached answer is not stapled after a restart".into();
    staple_within(&server, "good.test", &ca, Duration::from_secs(5), &not_cached);
    assert!(
        server.log().contains("OCSP response from the cache stapled"),
        "{}",
        server.log()
    );
}

#[test]
fn stapling_is_per_site_and_a_revoked_certificate_is_logged_not_stapled() {
    let (dir, root, ca, port) = world();
    let on = ca.issue("on", "on.test", Some(port), None);
    let off = ca.issue("off", "off.test", Some(port), None);
    let revoked = ca.issue("revoked", "revoked.test", Some(port), None);
    ca.revoke(&revoked);
    let _responder = ca.responder(port, 60);
    let admin = free_port().unwrap();
    let config = with_admin(
        dir.path(),
        admin,
        &(site("on.test", &on, &root, "")
            + &site("off.test", &off, &root, "ocsp_stapling = false")
            + &site("revoked.test", &revoked, &root, "")),
    );
    let server = Server::start(dir.path(), &config);
    wait_for_staple(&server, "on.test", &ca);
    assert!(
        eventually(Duration::from_secs(15), || server.log().contains("is REVOKED")),
        "the revocation is not logged: {}",
        server.log()
    );
    let log = server.log();
    let line = log.lines().find(|l| l.contains("is REVOKED")).unwrap();
    assert!(line.contains("ERROR") && line.contains("revoked.test"), "{line}");
    let serial = std::fs::read_to_string(dir.path().join("ca/serial.old")).unwrap();
    assert!(
        line.contains(serial.trim()),
        "the serial {serial} is not named: {line}"
    );
    // The on.test staple shows the fetch loop ran for every site by now.
    for sni in ["off.test", "revoked.test"] {
        let out = s_client(server.port, sni, &ca.cert);
        assert!(
            out.contains("OCSP response: no response sent"),
            "{sni} got a staple:\n{out}"
        );
        assert!(
            out.contains("Verify return code: 0 (ok)"),
            "{sni}: handshake not verified:\n{out}"
        );
    }
    let metrics = scrape(admin);
    for line in [
        "webship_tls_ocsp_staple{site=\"on.test\",state=\"good\"} 1",
        "webship_tls_ocsp_staple{site=\"off.test\",state=\"none\"} 1",
        "webship_tls_ocsp_staple{site=\"revoked.test\",state=\"revoked\"} 1",
        "webship_tls_ocsp_staple{site=\"revoked.test\",state=\"good\"} 0",
    ] {
        assert!(metrics.lines().any(|l| l == line), "no `{line}` in:\n{metrics}");
    }
    assert!(
        metrics.lines().any(
            |l| l.starts_with("webship_tls_ocsp_responses_total{status=\"revoked\"} ") && !l.ends_with(" 0")
        ),
        "the revoked answer is not counted:\n{metrics}"
    );
}

/// `webship reload` of the file `server` runs on: whether it applied, and its words.
fn reload(dir: &Path) -> (bool, String) {
    let file = dir.join("webship.toml");
    let out = webship_tests::webship(&["reload", "--config", file.to_str().unwrap()], dir);
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// A reload refused after the certificates were read (here by the ticket-key file,
/// read last) changes nothing the running configuration serves: the staple stays on
/// though the file turns stapling off, and a site the file adds gets no certificate
/// slot (no OCSP state, nothing for the certificate tasks to act on). The same file
/// without the bad key file then applies both.
#[test]
fn a_refused_reload_leaves_staples_and_certificate_slots_as_they_were() {
    let (dir, root, ca, port) = world();
    let kept = ca.issue("kept", "kept.test", Some(port), None);
    let added = ca.issue("added", "added.test", None, None);
    let _responder = ca.responder(port, 60);
    let admin = free_port().unwrap();
    let config = with_admin(dir.path(), admin, &site("kept.test", &kept, &root, ""));
    let server = Server::start(dir.path(), &config);
    wait_for_staple(&server, "kept.test", &ca);

    // Stapling off for kept.test, a new site, and a ticket-key file the daemon
    // refuses (mode 0644), which it reads only after building the TLS configurations.
    let keys = dir.path().join("ticket.keys");
    let made = webship_tests::webship(&["ticket-keys", "new"], dir.path());
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    std::fs::write(&keys, &made.stdout).unwrap();
    std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o644)).unwrap();
    let file = dir.path().join("webship.toml");
    let running = std::fs::read_to_string(&file).unwrap();
    let kept_key = format!("key = \"{}\"\n", kept.key.display());
    assert!(running.contains(&kept_key), "{running}");
    let changed = running.replace(&kept_key, &format!("{kept_key}ocsp_stapling = false\n"))
        + &site("added.test", &added, &root, "");
    std::fs::write(
        &file,
        format!("{changed}\n[tls]\nticket_keys = \"{}\"\n", keys.display()),
    )
    .unwrap();
    let (ok, text) = reload(dir.path());
    assert!(
        !ok && text.contains("mode 0644"),
        "not refused for the key file: {text}"
    );
    let out = s_client(server.port, "kept.test", &ca.cert);
    assert!(
        stapled_good(&out),
        "the refused reload took the staple off:\n{out}\n{}",
        server.log()
    );
    let metrics = scrape(admin);
    assert!(
        metrics.contains("site=\"kept.test\"") && !metrics.contains("site=\"added.test\""),
        "the refused reload's new site has a certificate slot:\n{metrics}"
    );

    // The same changes in a file the daemon accepts: both apply.
    std::fs::write(&file, &changed).unwrap();
    let (ok, text) = reload(dir.path());
    assert!(ok, "{text}");
    let out = s_client(server.port, "kept.test", &ca.cert);
    assert!(
        out.contains("OCSP response: no response sent"),
        "stapling off is not applied:\n{out}"
    );
    assert_eq!(
        first_pem(&s_client(server.port, "added.test", &ca.cert)),
        first_pem(&std::fs::read_to_string(&added.chain).unwrap())
    );
    let metrics = scrape(admin);
    assert!(
        metrics.contains("webship_tls_ocsp_staple{site=\"added.test\",state=\"none\"} 1"),
        "the new site has no certificate slot:\n{metrics}"
    );
}

/// A site removed and restored by two reloads while its stapler is still in a fetch
/// (held here unanswered) gets a stapler for its restored slot: once the responder
/// answers, the site is stapled, though the old stapler has ended.
#[test]
fn a_site_restored_while_its_stapler_fetches_is_stapled() {
    let (dir, root, ca, port) = world();
    let back = ca.issue("back", "back.test", Some(port), None);
    let other = ca.issue("other", "other.test", None, None);
    // Takes the daemon's first OCSP request and holds it unanswered.
    let holder = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
    holder.set_nonblocking(true).unwrap();
    let other_site = site("other.test", &other, &root, "");
    let both = format!(
        "listen = \"127.0.0.1:{{port}}\"\nworkers = 1\nocsp_cache = \"{}\"\n{other_site}{}",
        dir.path().join("ocsp-cache").display(),
        site("back.test", &back, &root, "")
    );
    let server = Server::start(dir.path(), &both);
    let mut held = None;
    assert!(
        eventually(Duration::from_secs(10), || {
            held = holder.accept().ok();
            held.is_some()
        }),
        "the daemon asked no OCSP responder: {}",
        server.log()
    );
    // Removed, then restored, while the first stapler waits on its answer.
    let file = dir.path().join("webship.toml");
    let running = std::fs::read_to_string(&file).unwrap();
    let back_site = site("back.test", &back, &root, "");
    assert!(running.contains(&back_site), "{running}");
    std::fs::write(&file, running.replace(&back_site, "")).unwrap();
    let (ok, text) = reload(dir.path());
    assert!(ok, "{text}");
    std::fs::write(&file, &running).unwrap();
    let (ok, text) = reload(dir.path());
    assert!(ok, "{text}");
    // The held fetch fails, and the responder takes the port.
    drop(held);
    drop(holder);
    let _responder = ca.responder(port, 60);
    staple_within(&server, "back.test", &ca, Duration::from_secs(25), &|| {
        "the restored site is never stapled".into()
    });
}

#[test]
fn a_symlinked_cache_folder_is_not_handed_to_the_service_account() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let (dir, root, ca, port) = world();
    // The service account must reach the files after the switch.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let leaf = ca.issue("good", "good.test", Some(port), None);
    let _responder = ca.responder(port, 1);
    // What the account owning the folder above could plant: a link to a root folder.
    let victim = dir.path().join("victim");
    std::fs::create_dir(&victim).unwrap();
    let owner_before = std::fs::metadata(&victim).unwrap().uid();
    let cache = dir.path().join("ocsp-cache");
    std::os::unix::fs::symlink(&victim, &cache).unwrap();
    let config = format!(
        "listen = \"127.0.0.1:{{port}}\"\nworkers = 1\nuser = \"nobody\"\ngroup = \"nogroup\"\nocsp_cache = \"{}\"\n{}",
        cache.display(),
        site("good.test", &leaf, &root, "")
    );
    let server = Server::start(dir.path(), &config);
    assert!(
        eventually(Duration::from_secs(10), || server
            .log()
            .contains("the OCSP cache folder is a symlink")),
        "the symlinked cache was not refused: {}",
        server.log()
    );
    assert_eq!(
        std::fs::metadata(&victim).unwrap().uid(),
        owner_before,
        "root chowned the symlink's target"
    );
    // Stapling itself goes on; only the cache is lost.
    let mut out = String::new();
    assert!(
        eventually(Duration::from_secs(15), || {
            out = s_client(server.port, "good.test", &ca.cert);
            stapled_good(&out)
        }),
        "no staple:\n{out}\n{}",
        server.log()
    );
}
