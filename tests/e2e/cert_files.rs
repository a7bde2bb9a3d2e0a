//! Certificate files watched: a pair renewed on disk the way certbot does it (the
//! configured paths are symlinks moved to new files) is served by the next
//! handshake without a reload; a mismatched or expired pair is refused, logged, and
//! the previous certificate stays.

use std::path::Path;
use std::time::Duration;

use super::ocsp::{first_pem, s_client, scrape, Issued, TestCa};
use webship_tests::server::{eventually, free_port};
use webship_tests::Server;

const HOST: &str = "renewed.test";

/// Points `link` at `target` in one rename, as certbot moves its `live/` links.
fn relink(link: &Path, target: &Path) {
    let tmp = link.with_extension("new");
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(target, &tmp).unwrap();
    std::fs::rename(&tmp, link).unwrap();
}

fn served(port: u16, ca: &Path) -> String {
    first_pem(&s_client(port, HOST, ca))
}

fn leaf_pem(issued: &Issued) -> String {
    first_pem(&std::fs::read_to_string(&issued.chain).unwrap())
}

#[test]
fn a_renewed_pair_is_served_and_a_mismatched_or_expired_one_refused() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let ca = TestCa::new(dir.path());
    let first = ca.issue("first", HOST, None, None);
    let live = dir.path().join("live");
    std::fs::create_dir(&live).unwrap();
    let (cert, key) = (live.join("fullchain.pem"), live.join("privkey.pem"));
    relink(&cert, &first.chain);
    relink(&key, &first.key);
    let admin = free_port().unwrap();
    let config = format!(
        "listen = \"127.0.0.1:{{port}}\"\nworkers = 1\n[admin]\nlisten = \"127.0.0.1:{admin}\"\n[[sites]]\ndomain = \"{HOST}\"\nroot = \"{}\"\n\
         [sites.tls]\ncert = \"{}\"\nkey = \"{}\"\n",
        root.display(),
        cert.display(),
        key.display()
    );
    let server = Server::start(dir.path(), &config);
    assert_eq!(served(server.port, &ca.cert), leaf_pem(&first));

    // Renewed: a new key and certificate (a new serial), the links moved.
    let second = ca.issue("second", HOST, None, None);
    relink(&key, &second.key);
    relink(&cert, &second.chain);
    assert!(
        eventually(Duration::from_secs(15), || served(server.port, &ca.cert)
            == leaf_pem(&second)),
        "the renewed certificate is not served: {}",
        server.log()
    );
    assert!(server
        .log()
        .contains("certificate files changed: the new pair is served"));

    // A certificate with another certificate's key: refused, the renewed pair stays.
    let third = ca.issue("third", HOST, None, None);
    relink(&cert, &third.chain);
    let refused = "certificate files changed but the new pair is refused";
    assert!(
        eventually(Duration::from_secs(15), || server.log().contains(refused)),
        "the mismatched pair is not refused: {}",
        server.log()
    );
    assert!(
        server.log().contains("does not belong to the certificate"),
        "{}",
        server.log()
    );
    assert_eq!(served(server.port, &ca.cert), leaf_pem(&second));

    // A matching pair that has expired: refused too.
    let expired = ca.issue(
        "expired",
        HOST,
        None,
        Some(("20200101000000Z", "20200201000000Z")),
    );
    relink(&key, &expired.key);
    relink(&cert, &expired.chain);
    assert!(
        eventually(Duration::from_secs(15), || server.log().contains("expired")),
        "the expired pair is not refused: {}",
        server.log()
    );
    assert_eq!(server.log().matches(refused).count(), 2, "{}", server.log());
    assert_eq!(served(server.port, &ca.cert), leaf_pem(&second));

    // Then a good pair again is picked up (a refusal does not stop the watch).
    relink(&key, &third.key);
    relink(&cert, &third.chain);
    assert!(
        eventually(Duration::from_secs(15), || served(server.port, &ca.cert)
            == leaf_pem(&third)),
        "the corrected pair is not served: {}",
        server.log()
    );
    let metrics = scrape(admin);
    for line in [
        "webship_tls_certificate_file_reloads_total{result=\"ok\"} 2",
        "webship_tls_certificate_file_reloads_total{result=\"refused\"} 2",
    ] {
        assert!(metrics.lines().any(|l| l == line), "no `{line}` in:\n{metrics}");
    }
}
