//! Several sites on one listener: the certificate follows SNI, the content follows
//! Host; no or unknown SNI gets the first site's certificate; an unknown Host is 421.

use std::sync::Arc;

use webship_tests::client::{connect, fetch, raw_h1, raw_status, Proto};
use webship_tests::pki::insecure_client;
use webship_tests::Server;

use crate::support::Env;

struct TwoSites {
    env: Env,
    server: Server,
    a_cert: Vec<u8>,
}

fn two_sites(h2_on_b: bool) -> TwoSites {
    let env = Env::new();
    let (a_cert, a_key) = env.leaf("a", &["a.test"]);
    let (b_cert, b_key) = env.leaf("b", &["b.test"]);
    for (site, body) in [("a", "site a"), ("b", "site b")] {
        let root = env.dir.path().join(site);
        std::fs::create_dir(&root).unwrap();
        std::fs::write(root.join("index.html"), body).unwrap();
    }
    let d = env.dir.path().display();
    let config = format!(
        r#"listen = "127.0.0.1:{{port}}"
workers = 2

[[sites]]
domain = "a.test"
root = "{d}/a"
[sites.tls]
cert = "{}"
key = "{}"

[[sites]]
domain = "b.test"
root = "{d}/b"
[sites.protocols]
h1 = true
h2 = {h2_on_b}
[sites.tls]
cert = "{}"
key = "{}"
"#,
        a_cert.display(),
        a_key.display(),
        b_cert.display(),
        b_key.display()
    );
    let server = Server::start(env.dir.path(), &config);
    let pem = std::fs::read(&a_cert).unwrap();
    let a_cert = rustls::pki_types::pem::PemObject::from_pem_slice(&pem)
        .map(|c: rustls::pki_types::CertificateDer<'static>| c.to_vec())
        .unwrap();
    TwoSites { env, server, a_cert }
}

#[tokio::test]
async fn certificate_and_content_follow_the_name() {
    let t = two_sites(true);
    for proto in [Proto::H1, Proto::H2] {
        for (name, body) in [("a.test", "site a"), ("b.test", "site b")] {
            // The client verifies the chain against `name`: a wrong certificate fails.
            let got = fetch(
                proto,
                t.server.addr(),
                name,
                t.env.client(proto.alpn()),
                "GET",
                "/",
                &[],
            )
            .await;
            assert_eq!(got.status, 200, "{proto:?} {name}");
            assert_eq!(got.body, body.as_bytes(), "{proto:?} {name}");
        }
    }
}

#[tokio::test]
async fn no_or_unknown_sni_gets_the_first_site_certificate() {
    let t = two_sites(true);
    for sni in ["c.test", "127.0.0.1"] {
        let tls = connect(t.server.addr(), sni, insecure_client(&[b"http/1.1"]).unwrap())
            .await
            .unwrap();
        let presented = tls.get_ref().1.peer_certificates().unwrap()[0].to_vec();
        assert_eq!(presented, t.a_cert, "SNI {sni:?} should get a.test's certificate");
    }
}

#[tokio::test]
async fn unknown_host_is_misdirected() {
    let t = two_sites(true);
    let client: Arc<_> = t.env.client(b"http/1.1");
    let response = raw_h1(
        t.server.addr(),
        "a.test",
        client,
        b"GET / HTTP/1.1\r\nHost: other.test\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(raw_status(&response), 421);
    // HTTP/1.1 without Host is a bad request.
    let response = raw_h1(
        t.server.addr(),
        "a.test",
        t.env.client(b"http/1.1"),
        b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(raw_status(&response), 400);
}

#[tokio::test]
async fn alpn_follows_the_site_protocols() {
    let t = two_sites(false);
    let tls = connect(
        t.server.addr(),
        "b.test",
        t.env.pki.client(&[b"h2", b"http/1.1"]).unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(
        tls.get_ref().1.alpn_protocol(),
        Some(&b"http/1.1"[..]),
        "b.test has h2 off"
    );
    let tls = connect(
        t.server.addr(),
        "a.test",
        t.env.pki.client(&[b"h2", b"http/1.1"]).unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
}
