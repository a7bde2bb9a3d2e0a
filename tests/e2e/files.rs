//! Direct file semantics over both protocols: ranges (single, multi, suffix,
//! open-ended, unsatisfiable), conditionals, HEAD, empty and >4 GiB files, methods,
//! directories.

use std::io::{Seek, SeekFrom, Write};

use webship_tests::client::{curl, fetch, Fetched, Proto};
use webship_tests::Server;

use crate::support::{pattern, Env, HOST};

const LEN: usize = 10_000;

struct World {
    env: Env,
    server: Server,
    data: Vec<u8>,
}

fn world() -> World {
    let env = Env::new();
    let data = pattern(LEN);
    env.write("data.bin", &data);
    env.write("empty.txt", b"");
    env.write("dir/index.html", b"<h1>index</h1>");
    std::fs::create_dir_all(env.root.join("noindex")).unwrap();
    let server = env.start("");
    World { env, server, data }
}

impl World {
    async fn get(&self, proto: Proto, method: &str, path: &str, headers: &[(&str, &str)]) -> Fetched {
        fetch(
            proto,
            self.server.addr(),
            HOST,
            self.env.client(proto.alpn()),
            method,
            path,
            headers,
        )
        .await
    }
}

const BOTH: [Proto; 2] = [Proto::H1, Proto::H2];

#[tokio::test]
async fn single_suffix_and_open_ended_ranges() {
    let w = world();
    for proto in BOTH {
        for (range, start, end) in [
            ("bytes=0-99", 0, 99),
            ("bytes=-100", LEN - 100, LEN - 1),
            ("bytes=9990-", 9990, LEN - 1),
            ("bytes=5000-99999", 5000, LEN - 1),
        ] {
            let got = w.get(proto, "GET", "/data.bin", &[("range", range)]).await;
            assert_eq!(got.status, 206, "{proto:?} {range}");
            assert_eq!(
                got.header("content-range"),
                format!("bytes {start}-{end}/{LEN}"),
                "{proto:?} {range}"
            );
            assert_eq!(got.header("content-length"), (end - start + 1).to_string());
            assert_eq!(got.body, &w.data[start..=end], "{proto:?} {range}");
        }
    }
}

#[tokio::test]
async fn multiple_ranges_are_multipart_byteranges() {
    let w = world();
    for proto in BOTH {
        let got = w
            .get(proto, "GET", "/data.bin", &[("range", "bytes=0-9,100-109,-5")])
            .await;
        assert_eq!(got.status, 206, "{proto:?}");
        let ctype = got.header("content-type").to_owned();
        let boundary = ctype
            .strip_prefix("multipart/byteranges; boundary=")
            .unwrap_or_else(|| panic!("content-type {ctype}"));
        let mut expected = Vec::new();
        for (start, end) in [(0, 9), (100, 109), (LEN - 5, LEN - 1)] {
            expected.extend_from_slice(
                format!(
                    "\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\nContent-Range: bytes {start}-{end}/{LEN}\r\n\r\n"
                )
                .as_bytes(),
            );
            expected.extend_from_slice(&w.data[start..=end]);
        }
        expected.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
        assert_eq!(
            String::from_utf8_lossy(&got.body),
            String::from_utf8_lossy(&expected),
            "{proto:?}"
        );
        assert_eq!(got.header("content-length"), expected.len().to_string());
    }
}

#[tokio::test]
async fn unsatisfiable_and_malformed_ranges() {
    let w = world();
    for proto in BOTH {
        let got = w
            .get(proto, "GET", "/data.bin", &[("range", "bytes=20000-")])
            .await;
        assert_eq!(got.status, 416, "{proto:?}");
        assert_eq!(got.header("content-range"), format!("bytes */{LEN}"));
        assert!(got.body.is_empty());
        // A malformed Range is ignored: the whole file.
        let got = w.get(proto, "GET", "/data.bin", &[("range", "bytes=9-1")]).await;
        assert_eq!(got.status, 200, "{proto:?}");
        assert_eq!(got.body, w.data);
    }
}

#[test]
fn curl_ranges_over_both_protocols() {
    let w = world();
    let ca = w.env.ca_file();
    let url = format!("https://{HOST}:{}/data.bin", w.server.port);
    for flag in ["--http1.1", "--http2"] {
        let out = curl(
            HOST,
            w.server.port,
            &["--cacert", ca.to_str().unwrap(), flag, "-r", "10-19", &url],
        );
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(out.stdout, &w.data[10..20], "curl {flag}");
    }
}

#[tokio::test]
async fn conditional_requests() {
    let w = world();
    for proto in BOTH {
        let full = w.get(proto, "GET", "/data.bin", &[]).await;
        assert_eq!(full.status, 200);
        assert_eq!(full.header("accept-ranges"), "bytes");
        let etag = full.header("etag").to_owned();
        let modified = full.header("last-modified").to_owned();
        assert!(
            etag.starts_with('"') && etag.ends_with('"'),
            "strong etag: {etag}"
        );
        assert!(!modified.is_empty());

        let got = w
            .get(proto, "GET", "/data.bin", &[("if-none-match", &etag)])
            .await;
        assert_eq!(got.status, 304, "{proto:?} If-None-Match");
        assert!(got.body.is_empty());
        assert_eq!(got.header("etag"), etag);
        let got = w
            .get(proto, "GET", "/data.bin", &[("if-none-match", "\"other\"")])
            .await;
        assert_eq!(got.status, 200);
        let got = w
            .get(proto, "GET", "/data.bin", &[("if-modified-since", &modified)])
            .await;
        assert_eq!(got.status, 304, "{proto:?} If-Modified-Since");
        let got = w
            .get(proto, "GET", "/data.bin", &[("if-match", "\"other\"")])
            .await;
        assert_eq!(got.status, 412, "{proto:?} If-Match");

        let got = w
            .get(
                proto,
                "GET",
                "/data.bin",
                &[("range", "bytes=0-9"), ("if-range", &etag)],
            )
            .await;
        assert_eq!(got.status, 206, "{proto:?} If-Range current");
        let got = w
            .get(
                proto,
                "GET",
                "/data.bin",
                &[("range", "bytes=0-9"), ("if-range", "\"stale\"")],
            )
            .await;
        assert_eq!(got.status, 200, "{proto:?} If-Range stale");
        assert_eq!(got.body, w.data);
    }
}

#[tokio::test]
async fn head_empty_files_and_methods() {
    let w = world();
    for proto in BOTH {
        let got = w.get(proto, "HEAD", "/data.bin", &[]).await;
        assert_eq!(got.status, 200);
        assert_eq!(got.header("content-length"), LEN.to_string());
        assert!(got.body.is_empty(), "{proto:?}: HEAD has no body");

        let got = w.get(proto, "GET", "/empty.txt", &[]).await;
        assert_eq!(got.status, 200);
        assert_eq!(got.header("content-length"), "0");
        assert_eq!(got.header("content-type"), "text/plain; charset=utf-8");
        assert!(got.body.is_empty());
        let got = w.get(proto, "GET", "/empty.txt", &[("range", "bytes=0-")]).await;
        assert_eq!(got.status, 416);

        for method in ["POST", "PUT", "DELETE"] {
            let got = w.get(proto, method, "/data.bin", &[]).await;
            assert_eq!(got.status, 405, "{proto:?} {method}");
            assert_eq!(got.header("allow"), "GET, HEAD");
        }
        let got = w.get(proto, "GET", "/missing", &[]).await;
        assert_eq!(got.status, 404);
    }
}

#[tokio::test]
async fn directories() {
    let w = world();
    for proto in BOTH {
        let got = w.get(proto, "GET", "/dir/", &[]).await;
        assert_eq!(got.status, 200);
        assert_eq!(got.body, b"<h1>index</h1>");
        assert_eq!(got.header("content-type"), "text/html; charset=utf-8");
        let got = w.get(proto, "GET", "/dir", &[]).await;
        assert_eq!(got.status, 301);
        assert_eq!(got.header("location"), "/dir/");
        let got = w.get(proto, "GET", "/noindex/", &[]).await;
        assert_eq!(
            got.status, 404,
            "{proto:?}: a directory without index.html is not listed"
        );
        let got = w.get(proto, "GET", "/data.bin/", &[]).await;
        assert_eq!(got.status, 404);
    }
}

#[tokio::test]
async fn range_near_the_end_of_a_sparse_file_over_4_gib() {
    let w = world();
    let len: u64 = 5 * 1024 * 1024 * 1024 + 123;
    let mut file = std::fs::File::create(w.env.root.join("huge.img")).unwrap();
    file.set_len(len).unwrap();
    file.seek(SeekFrom::Start(len - 16)).unwrap();
    file.write_all(b"end-of-the-file!").unwrap();
    // And a marker straddling the 4 GiB boundary, where 32-bit offsets would wrap.
    file.seek(SeekFrom::Start((1 << 32) - 4)).unwrap();
    file.write_all(b"4GiB").unwrap();
    drop(file);
    for proto in BOTH {
        let got = w.get(proto, "GET", "/huge.img", &[("range", "bytes=-16")]).await;
        assert_eq!(got.status, 206);
        assert_eq!(
            got.header("content-range"),
            format!("bytes {}-{}/{len}", len - 16, len - 1)
        );
        assert_eq!(got.body, b"end-of-the-file!");
        let range = format!("bytes={}-{}", (1u64 << 32) - 4, (1u64 << 32) + 3);
        let got = w.get(proto, "GET", "/huge.img", &[("range", &range)]).await;
        assert_eq!(got.body, b"4GiB\0\0\0\0", "{proto:?}");
        let got = w.get(proto, "HEAD", "/huge.img", &[]).await;
        assert_eq!(got.header("content-length"), len.to_string());
    }
}

#[tokio::test]
async fn dotfiles_are_hidden_but_well_known_is_served() {
    let w = world();
    w.env.write(".env", b"SECRET=1");
    w.env.write(".git/config", b"[core]");
    w.env.write("sub/.htpasswd", b"admin:x");
    w.env.write(".well-known/acme-challenge/token", b"challenge");
    for proto in BOTH {
        for path in [
            "/.env",
            "/%2eenv",
            "/.git/config",
            "/.git/",
            "/sub/.htpasswd",
            "/sub/%2Ehtpasswd",
            "//.env",
            "/./.env",
        ] {
            let got = w.get(proto, "GET", path, &[]).await;
            assert_eq!(got.status, 404, "{proto:?} {path}: a dotfile is not served");
            assert!(!got.body.starts_with(b"SECRET"), "{proto:?} {path}");
        }
        let got = w
            .get(proto, "GET", "/.well-known/acme-challenge/token", &[])
            .await;
        assert_eq!(got.status, 200, "{proto:?}: .well-known stays served (ACME)");
        assert_eq!(got.body, b"challenge");
    }
}

#[tokio::test]
async fn a_site_may_allow_dotfiles() {
    let env = Env::new();
    env.write(".env", b"PUBLIC=1");
    let config = env
        .config("")
        .replace("[sites.tls]", "dotfiles = \"allow\"\n[sites.tls]");
    let server = Server::start(env.dir.path(), &config);
    let got = env.get(Proto::H1, &server, "/.env", &[]).await;
    assert_eq!(got.status, 200);
    assert_eq!(got.body, b"PUBLIC=1");
}

#[tokio::test]
async fn a_fifo_in_the_root_is_refused_at_once() {
    let w = world();
    let fifo = w.env.root.join("pipe");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success(), "mkfifo failed");
    for proto in BOTH {
        // More requests than the blocking pool would notice, each bounded in time: a
        // FIFO opened for reading waits for a writer, forever.
        for _ in 0..4 {
            let got = tokio::time::timeout(
                std::time::Duration::from_secs(3),
                w.get(proto, "GET", "/pipe", &[]),
            )
            .await
            .unwrap_or_else(|_| panic!("{proto:?}: GET of a FIFO still unanswered after 3 s"));
            assert!(
                got.status == 403 || got.status == 404,
                "{proto:?}: a FIFO answered {}",
                got.status
            );
        }
        let got = w.get(proto, "GET", "/data.bin", &[]).await;
        assert_eq!(got.status, 200, "{proto:?}: still serving");
        assert_eq!(got.body, w.data);
    }
}

#[tokio::test]
async fn overlapping_ranges_never_amplify_the_file() {
    let w = world();
    let many = format!("bytes={}", vec!["0-"; 64].join(","));
    let small = format!("bytes={}", vec!["0-0"; 64].join(","));
    for proto in BOTH {
        let got = w.get(proto, "GET", "/data.bin", &[("range", &many)]).await;
        assert!(
            got.body.len() <= LEN,
            "{proto:?}: 64 × `0-` returned {} bytes for a {LEN}-byte file",
            got.body.len()
        );
        assert_eq!(
            got.status, 200,
            "{proto:?}: ranges larger than the file → the whole file (nginx)"
        );
        assert_eq!(got.body, w.data);
        // The same byte 64 times is one range.
        let got = w.get(proto, "GET", "/data.bin", &[("range", &small)]).await;
        assert_eq!(got.status, 206, "{proto:?}");
        assert_eq!(got.header("content-range"), format!("bytes 0-0/{LEN}"));
        assert_eq!(got.body, &w.data[..1]);
        // Overlapping and adjacent ranges coalesce into one part.
        let got = w
            .get(
                proto,
                "GET",
                "/data.bin",
                &[("range", "bytes=100-199,150-299,300-399")],
            )
            .await;
        assert_eq!(got.status, 206, "{proto:?}");
        assert_eq!(got.header("content-range"), format!("bytes 100-399/{LEN}"));
        assert_eq!(got.body, &w.data[100..400]);
    }
}

/// 200 GETs of a FIFO and 200 of `bytes=0-,0-,…` (20 at a time): each answered
/// quickly, a normal download meanwhile intact, and the footprint back where it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_and_overlapping_range_floods_leave_nothing_behind() {
    use std::sync::Arc;
    use std::time::{Duration, Instant};
    use webship_testkit::proc::{FloodReport, Footprint};

    let w = Arc::new(world());
    let big = pattern(4 << 20);
    w.env.write("big.bin", &big);
    let made = std::process::Command::new("mkfifo")
        .arg(w.env.root.join("pipe"))
        .status()
        .unwrap();
    assert!(made.success(), "mkfifo failed");
    let many = format!("bytes={}", vec!["0-"; 64].join(","));
    let pid = w.server.pid();
    for (flood, path, range) in [
        ("GET of a FIFO x200", "/pipe", None),
        ("Range: 64 x `0-` x200", "/data.bin", Some(many.clone())),
    ] {
        let before = Footprint::of(pid).unwrap();
        let mut during = before;
        let mut download = None;
        for round in 0..10 {
            let mut set = tokio::task::JoinSet::new();
            for _ in 0..20 {
                let (w, range) = (w.clone(), range.clone());
                set.spawn(async move {
                    let headers: Vec<(&str, &str)> = range.iter().map(|r| ("range", r.as_str())).collect();
                    let got =
                        tokio::time::timeout(Duration::from_secs(5), w.get(Proto::H1, "GET", path, &headers))
                            .await
                            .unwrap_or_else(|_| panic!("GET {path} unanswered after 5 s"));
                    assert!(got.body.len() <= LEN, "{path}: {} bytes", got.body.len());
                    got.status
                });
            }
            if round == 5 {
                let start = Instant::now();
                let got = w.get(Proto::H2, "GET", "/big.bin", &[]).await;
                download = Some(start.elapsed());
                assert_eq!(got.body.len(), big.len(), "{flood}: the normal download");
                during = Footprint::of(pid).unwrap();
            }
            while let Some(status) = set.join_next().await {
                let status = status.unwrap();
                assert!([200, 403, 404].contains(&status.as_u16()), "{flood}: {status}");
            }
        }
        let mut after = Footprint::of(pid).unwrap();
        for _ in 0..40 {
            if after.fds <= before.fds + 4 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            after = Footprint::of(pid).unwrap();
        }
        FloodReport {
            flood,
            before,
            during,
            after,
            download,
        }
        .print();
        assert!(after.fds <= before.fds + 4, "{flood}: fds {before} → {after}");
    }
}
