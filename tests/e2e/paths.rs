//! Nothing outside `root` is ever served: every spelling of traversal, NUL,
//! backslashes and escaping symlinks, sent as raw bytes no client normalizes.

use webship_tests::client::{fetch, raw_h1, raw_status, Proto};

use crate::support::{Env, HOST};

const SECRET: &[u8] = b"top-secret-7f3a9c";

fn setup() -> (Env, webship_tests::Server) {
    let env = Env::new();
    std::fs::write(env.dir.path().join("secret.txt"), SECRET).unwrap();
    env.write("public.txt", b"public");
    env.write("sub/inner.txt", b"inner");
    #[cfg(unix)]
    {
        use std::os::unix::fs::symlink;
        symlink(env.dir.path().join("secret.txt"), env.root.join("leak.txt")).unwrap();
        symlink(env.dir.path(), env.root.join("parent")).unwrap();
        symlink("/etc", env.root.join("etc")).unwrap();
        symlink(env.root.join("sub/inner.txt"), env.root.join("inside.txt")).unwrap();
    }
    let server = env.start("");
    (env, server)
}

#[tokio::test]
async fn traversal_spellings_never_leave_the_root() {
    let (env, server) = setup();
    let attempts = [
        "/../secret.txt",
        "/sub/../../secret.txt",
        "/%2e%2e/secret.txt",
        "/%2E%2E%2Fsecret.txt",
        "/.%2e/secret.txt",
        "/sub%2f..%2f..%2fsecret.txt",
        "/..%5csecret.txt",
        "/..\\secret.txt",
        "/%2e%2e%5csecret.txt",
        "/public.txt%00.html",
        "/%ff%fe",
        "/....//secret.txt",
        "/../../../../../../etc/passwd",
    ];
    for path in attempts {
        let request = format!("GET {path} HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n");
        let response = raw_h1(server.addr(), HOST, env.client(b"http/1.1"), request.as_bytes()).await;
        let status = raw_status(&response);
        assert!([400, 403, 404].contains(&status), "h1 {path}: status {status}");
        assert!(!contains(&response, SECRET), "h1 {path}: leaked the secret");
        assert!(
            !contains(&response, b"root:x:0:0"),
            "h1 {path}: leaked /etc/passwd"
        );
    }
    // h2 carries the path in :path; hyper sends it as given.
    for path in ["/%2e%2e/secret.txt", "/..%5csecret.txt", "/public.txt%00"] {
        let got = fetch(
            Proto::H2,
            server.addr(),
            HOST,
            env.client(b"h2"),
            "GET",
            path,
            &[],
        )
        .await;
        assert!(
            [400, 403, 404].contains(&got.status.as_u16()),
            "h2 {path}: {}",
            got.status
        );
        assert!(!contains(&got.body, SECRET));
    }
}

#[tokio::test]
async fn symlinks_leaving_the_root_are_refused() {
    let (env, server) = setup();
    for proto in [Proto::H1, Proto::H2] {
        for path in ["/leak.txt", "/parent/secret.txt", "/etc/passwd"] {
            let got = env.get(proto, &server, path, &[]).await;
            assert_eq!(got.status, 403, "{proto:?} {path}");
            assert!(!contains(&got.body, SECRET));
        }
        let got = env.get(proto, &server, "/inside.txt", &[]).await;
        assert_eq!(
            got.status, 200,
            "{proto:?}: a symlink within the root is followed"
        );
        assert_eq!(got.body, b"inner");
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}
