//! Certificates beyond a site's files: OCSP stapling, ACME, session-ticket keys.

use super::*;

#[test]
fn ocsp_stapling_is_on_unless_a_site_turns_it_off_and_the_cache_path_resolves() {
    let f = Files::new();
    let text = "ocsp_cache = \"state/ocsp\"\n[[sites]]\ndomain = \"a.test\"\nroot = \"media\"\n\
                [sites.tls]\ncert = \"cert.pem\"\nkey = \"key.pem\"\nocsp_stapling = false\n\
                [[sites]]\ndomain = \"b.test\"\nroot = \"media\"\n[sites.tls]\ncert = \"cert.pem\"\nkey = \"key.pem\"\n";
    let config = f.parse(text).unwrap();
    let stapling: Vec<bool> = config
        .sites
        .iter()
        .map(|s| match s.tls {
            TlsSource::Files { ocsp_stapling, .. } => ocsp_stapling,
            TlsSource::SelfSigned { .. } | TlsSource::Acme(_) => panic!("files expected"),
        })
        .collect();
    assert_eq!(stapling, [false, true]);
    assert_eq!(config.ocsp_cache, f.dir.path().join("state/ocsp"));
    let base = "root = \"media\"\n[tls]\ncert = \"cert.pem\"\nkey = \"key.pem\"\n";
    assert_eq!(
        f.parse(base).unwrap().ocsp_cache,
        std::path::Path::new(DEFAULT_OCSP_CACHE)
    );
    let typo = f
        .parse(&format!("{base}ocsp_stapeling = true\n"))
        .unwrap_err()
        .to_string();
    assert!(typo.contains("unknown field `ocsp_stapeling`"), "{typo}");
}

const ACME_SITE: &str = r#"
[[sites]]
domain = "media.example.com"
root = "media"
[sites.acme]
directory = "https://acme.example/directory"
email = "ops@example.com"
"#;

#[test]
fn an_acme_site_needs_no_tls_and_gets_a_source_with_the_storage() {
    let f = Files::new();
    let config = f
        .parse(&format!("[acme]\nstorage = \"acme\"\n{ACME_SITE}"))
        .unwrap();
    let TlsSource::Acme(source) = &config.sites[0].tls else {
        panic!("an ACME source: {:?}", config.sites[0].tls)
    };
    assert_eq!(source.names, ["media.example.com"]);
    assert_eq!(
        source.challenge,
        AcmeChallenge::TlsAlpn01,
        "the default challenge"
    );
    assert_eq!(source.storage, f.dir.path().join("acme"));
    assert_eq!(source.email.as_deref(), Some("ops@example.com"));
    let (cert, key) = source.files();
    assert!(cert.starts_with(f.dir.path().join("acme/certs")) && key.ends_with("key.pem"));
}

#[test]
fn acme_mistakes_are_named_with_their_key() {
    let f = Files::new();
    let keys = |text: &str| -> Vec<String> { f.problems(text).into_iter().map(|p| p.key).collect() };
    assert_eq!(keys(ACME_SITE), ["sites[0].acme"], "no [acme] storage");
    let both = format!(
        "[acme]\nstorage = \"acme\"\n{ACME_SITE}[sites.tls]\ncert = \"cert.pem\"\nkey = \"key.pem\"\n"
    );
    assert_eq!(keys(&both), ["sites[0].acme"], "tls and acme on one site");
    let http = format!("[acme]\nstorage = \"acme\"\n{ACME_SITE}challenge = \"http-01\"\n");
    assert_eq!(keys(&http), ["sites[0].acme.challenge"]);
    let plain = format!(
        "[acme]\nstorage = \"acme\"\n{}",
        ACME_SITE.replace("https://", "http://")
    );
    assert_eq!(keys(&plain), ["sites[0].acme.directory"]);
    let wildcard = format!(
        "[acme]\nstorage = \"acme\"\n{}",
        ACME_SITE.replace("media.example", "*.example")
    );
    assert_eq!(keys(&wildcard), ["sites[0].acme"]);
    let file = format!("[acme]\nstorage = \"cert.pem\"\n{ACME_SITE}");
    assert_eq!(keys(&file), ["acme.storage"]);
    let unknown = format!("[acme]\nstorage = \"acme\"\n{ACME_SITE}dns = \"x\"\n");
    assert!(
        matches!(f.parse(&unknown), Err(ConfigError::Parse { .. })),
        "unknown keys are refused"
    );
}

#[test]
fn http01_needs_the_http_listener_on_another_port() {
    let f = Files::new();
    let site = format!("{ACME_SITE}challenge = \"http-01\"\n");
    let config = f
        .parse(&format!(
            "[acme]\nstorage = \"acme\"\nhttp_listen = \"0.0.0.0:80\"\n{site}"
        ))
        .unwrap();
    assert_eq!(config.acme_http_listen, Some("0.0.0.0:80".parse().unwrap()));
    assert!(matches!(&config.sites[0].tls, TlsSource::Acme(a) if a.challenge == AcmeChallenge::Http01));
    let same = format!(
        "listen = \"0.0.0.0:443\"\n[acme]\nstorage = \"acme\"\nhttp_listen = \"127.0.0.1:443\"\n{site}"
    );
    let keys: Vec<String> = f.problems(&same).into_iter().map(|p| p.key).collect();
    assert_eq!(keys, ["acme.http_listen"]);
}

#[test]
fn tls_ticket_keys_stand_alone_and_cert_and_key_go_together() {
    let f = Files::new();
    let sites = "[[sites]]\ndomain = \"a.test\"\nroot = \"media\"\n[sites.tls]\ncert = \"cert.pem\"\nkey = \"key.pem\"\n";
    // Only ticket keys at the top: each site keeps its own certificate.
    let config = f
        .parse(&format!("[tls]\nticket_keys = \"ticket.keys\"\n\n{sites}"))
        .unwrap();
    assert_eq!(config.ticket_keys, Some(f.dir.path().join("ticket.keys")));
    assert_eq!(f.parse(sites).unwrap().ticket_keys, None);
    let problems = f.problems(&format!("[tls]\ncert = \"cert.pem\"\n\n{sites}"));
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(problems[0].key, "tls");
    assert!(problems[0].problem.contains("without `key`"), "{problems:?}");
    let problems = f.problems(&format!("[tls]\nticket_keys = \"\"\n\n{sites}"));
    assert_eq!(problems[0].key, "tls.ticket_keys", "{problems:?}");
    // A typo is refused, as everywhere.
    assert!(f.parse(&format!("[tls]\nticket_key = \"k\"\n\n{sites}")).is_err());
    // `ticket_keys` is process-wide: a site's [sites.tls] does not take it.
    let site_keys = sites.replace("key = \"key.pem\"", "key = \"key.pem\"\nticket_keys = \"k\"");
    assert!(f.parse(&site_keys).is_err());
}
