//! The 99,943,778-byte fixture over h1 and h2, by curl and by a rustls/hyper client,
//! each checked for exact length and SHA-256.

use webship_tests::client::{hex, Proto};
use webship_tests::fixture::sha256_file;
use webship_tests::{fixture, FIXTURE_LEN};

use crate::support::{curl_download, Env, HOST};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixture_with_rustls_client_over_h1_and_h2() {
    let env = Env::new();
    let fx = fixture();
    fx.place(&env.root, "fixture.bin").unwrap();
    let server = env.start("");
    for proto in [Proto::H1, Proto::H2] {
        let got = env.get(proto, &server, "/fixture.bin", &[]).await;
        assert_eq!(got.status, 200, "{proto:?}");
        assert_eq!(got.header("content-length"), FIXTURE_LEN.to_string(), "{proto:?}");
        assert_eq!(got.len, FIXTURE_LEN, "{proto:?}: body length");
        assert_eq!(hex(&got.sha256), hex(&fx.sha256), "{proto:?}: body digest");
    }
}

#[test]
fn fixture_with_curl_over_h1_and_h2() {
    let env = Env::new();
    let fx = fixture();
    fx.place(&env.root, "fixture.bin").unwrap();
    let server = env.start("");
    let ca = env.ca_file();
    let url = format!("https://{HOST}:{}/fixture.bin", server.port);
    for (flag, version) in [("--http1.1", "1.1"), ("--http2", "2")] {
        let out = env.dir.path().join("download.bin");
        let stdout = curl_download(
            HOST,
            server.port,
            &ca,
            flag,
            &url,
            &out,
            "%{http_code} %{http_version} %{size_download}",
        );
        assert_eq!(stdout, format!("200 {version} {FIXTURE_LEN}"), "curl {flag}");
        assert_eq!(std::fs::metadata(&out).unwrap().len(), FIXTURE_LEN);
        assert_eq!(
            hex(&sha256_file(&out).unwrap()),
            hex(&fx.sha256),
            "curl {flag}: digest"
        );
        std::fs::remove_file(&out).unwrap();
    }
}
