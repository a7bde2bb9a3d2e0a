//! The proxy tests' origins checked on their own, with hyper's client over plain
//! TCP: `Origin` over HTTP/1.1 and h2c, `HalfCloseOrigin` with raw bytes, and nginx
//! serving a file. If these fail, a proxy test failing says nothing about the proxy.

use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use webship_tests::client::{hex, outcome, Outcome};
use webship_tests::nginx::Nginx;
use webship_tests::origin::{HalfCloseOrigin, Origin};
use webship_tests::server::eventually;

use crate::support::pattern;

/// How long an origin's counters or nginx's access log may lag the response.
const WAIT: Duration = Duration::from_secs(5);

/// A response read to its end, or to the error that cut it short, within 20 s.
async fn collect(response: Response<Incoming>) -> Outcome {
    tokio::time::timeout(Duration::from_secs(20), outcome(response))
        .await
        .expect("body not read within 20 s")
}

fn request(uri: &str, method: &str, body: &[u8]) -> Request<Full<Bytes>> {
    Request::builder()
        .method(method)
        .uri(uri)
        .header("x-test", "origins")
        .body(Full::new(Bytes::copy_from_slice(body)))
        .unwrap()
}

async fn h1(origin: &Origin) -> http1::SendRequest<Full<Bytes>> {
    let tcp = TcpStream::connect(origin.addr).await.unwrap();
    let (sender, conn) = http1::handshake(TokioIo::new(tcp)).await.unwrap();
    tokio::spawn(conn);
    sender
}

async fn h2c(origin: &Origin) -> http2::SendRequest<Full<Bytes>> {
    let tcp = TcpStream::connect(origin.addr).await.unwrap();
    let (sender, conn) = http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    sender
}

/// One request on an HTTP/1.1 connection, once it is ready for the next one.
async fn send(tx: &mut http1::SendRequest<Full<Bytes>>, req: Request<Full<Bytes>>) -> Outcome {
    tx.ready().await.unwrap();
    collect(tx.send_request(req).await.unwrap()).await
}

fn sha(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn origin_serves_http1() {
    let origin = Origin::start().await;
    let mut tx = h1(&origin).await;
    let host = origin.addr.to_string();
    let with_host = |uri: &str, method: &str, body: &[u8]| {
        let mut req = request(uri, method, body);
        req.headers_mut().insert("host", host.parse().unwrap());
        req
    };

    let got = send(&mut tx, with_host("/echo?q=1", "POST", b"abc")).await;
    assert_eq!(got.status, StatusCode::OK);
    let text = String::from_utf8(got.fetched.body).unwrap();
    assert!(text.contains("x-test: origins\n"), "{text}");
    assert!(
        text.contains("method: POST\npath: /echo?q=1\nbody-len: 3\n"),
        "{text}"
    );
    assert!(
        text.contains(&format!("body-sha256: {}\n", sha(b"abc"))),
        "{text}"
    );

    let got = send(&mut tx, with_host("/bytes/1000000", "GET", b"")).await;
    assert_eq!(
        (got.status, got.header("content-length")),
        (StatusCode::OK, "1000000")
    );
    assert_eq!(sha(&got.body), sha(&pattern(1_000_000)));

    let mut ranged = with_host("/bytes/1000000", "GET", b"");
    ranged
        .headers_mut()
        .insert("range", "bytes=70000-70099".parse().unwrap());
    let got = send(&mut tx, ranged).await;
    assert_eq!(got.status, StatusCode::PARTIAL_CONTENT);
    assert_eq!(got.header("content-range"), "bytes 70000-70099/1000000");
    assert_eq!(got.body, pattern(70_100)[70_000..]);

    // hyper's HTTP/1.1 server sends trailers only to a request with `te: trailers`.
    let got = send(&mut tx, with_host("/trailers", "GET", b"")).await;
    assert_eq!(
        (got.body.as_slice(), got.trailers.is_none()),
        (&b"hello"[..], true)
    );
    let mut te = with_host("/trailers", "GET", b"");
    te.headers_mut().insert("te", "trailers".parse().unwrap());
    let got = send(&mut tx, te).await;
    assert_eq!(got.header("transfer-encoding"), "chunked");
    assert_eq!(got.body, b"hello");
    let trailers = got.trailers.as_ref().expect("trailers on HTTP/1.1");
    assert_eq!(trailers["x-checksum"], "12345");
    assert_eq!(trailers["x-origin"], "rust");

    let got = send(&mut tx, with_host("/slow/40000/10", "GET", b"")).await;
    assert_eq!(got.header("transfer-encoding"), "chunked");
    assert_eq!(got.body, pattern(40_000));

    let got = send(&mut tx, with_host("/huge-headers/100000", "GET", b"")).await;
    assert_eq!((got.header("x-huge").len(), &got.body[..]), (100_000, &b"ok"[..]));

    let got = send(&mut tx, with_host("/status/503", "GET", b"")).await;
    assert_eq!((got.status, got.body.len()), (StatusCode::SERVICE_UNAVAILABLE, 0));
    let got = send(&mut tx, with_host("/nope", "GET", b"")).await;
    assert_eq!(got.status, StatusCode::NOT_FOUND);

    // Last on this connection: the origin aborts it mid-body.
    let got = send(&mut tx, with_host("/die/1000", "GET", b"")).await;
    assert_eq!(got.header("content-length"), "2000");
    assert!(got.error.is_some(), "no error after {} bytes", got.body.len());
    assert_eq!(got.body, pattern(1000));

    let seen = origin.seen();
    let paths: Vec<&str> = seen.iter().map(|s| s.path.as_str()).collect();
    assert_eq!(paths[0], "/echo?q=1");
    assert_eq!(seen.len(), 10, "{paths:?}");
    assert_eq!(
        (seen[0].method.as_str(), seen[0].version.as_str()),
        ("POST", "HTTP/1.1")
    );
    assert_eq!((seen[0].body_len, seen[0].body_complete), (3, true));
    assert_eq!(seen[0].body_sha256, sha(b"abc"));
    assert_eq!(seen[0].header("host"), Some(host.as_str()));
    assert_eq!(Origin::header(&seen[0], "X-Test"), Some("origins"));
    assert_eq!(origin.connections(), 1, "keep-alive across all requests");
    assert_eq!(origin.aborted_responses(), 0);

    // A second connection with a chunked body that ends truncated.
    let mut tx = h1(&origin).await;
    let got = send(&mut tx, with_host("/die-chunked/5000", "GET", b"")).await;
    assert_eq!(got.header("transfer-encoding"), "chunked");
    assert!(got.error.is_some());
    assert_eq!(got.body, pattern(5000));
    assert_eq!(origin.connections(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn origin_serves_h2c() {
    let origin = Origin::start().await;
    let mut tx = h2c(&origin).await;
    let base = format!("http://{}", origin.addr);

    let body = pattern(300_000);
    let got = collect(
        tx.send_request(request(&format!("{base}/echo"), "PUT", &body))
            .await
            .unwrap(),
    )
    .await;
    let text = String::from_utf8(got.fetched.body).unwrap();
    assert!(
        text.contains(&format!("body-len: 300000\nbody-sha256: {}\n", sha(&body))),
        "{text}"
    );

    let got = collect(
        tx.send_request(request(&format!("{base}/bytes/1000000"), "GET", b""))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(sha(&got.body), sha(&pattern(1_000_000)));

    let got = collect(
        tx.send_request(request(&format!("{base}/trailers"), "GET", b""))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(got.body, b"hello");
    let trailers = got.trailers.as_ref().expect("trailers on h2");
    assert_eq!(trailers["x-checksum"], "12345");
    assert_eq!(trailers["x-origin"], "rust");

    // A failed stream is reset; the connection stays usable.
    let got = collect(
        tx.send_request(request(&format!("{base}/die/1000"), "GET", b""))
            .await
            .unwrap(),
    )
    .await;
    assert!(got.error.is_some());
    assert_eq!(got.body, pattern(1000));
    let got = collect(
        tx.send_request(request(&format!("{base}/die-chunked/100"), "GET", b""))
            .await
            .unwrap(),
    )
    .await;
    assert!(got.error.is_some());
    let got = collect(
        tx.send_request(request(&format!("{base}/status/204"), "GET", b""))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(got.status, StatusCode::NO_CONTENT);

    let seen = origin.seen();
    assert_eq!(seen.len(), 6);
    assert_eq!(seen[0].version, "HTTP/2.0");
    assert_eq!((seen[0].body_len, seen[0].body_complete), (300_000, true));
    assert_eq!(seen[1].path, "/bytes/1000000");
    assert_eq!(seen[0].header("host"), None, "h2 carries :authority, not host");
    assert_eq!(origin.connections(), 1);
    assert_eq!(origin.aborted_responses(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn origin_counts_responses_the_client_abandons() {
    let origin = Origin::start().await;
    let base = format!("http://{}", origin.addr);

    // HTTP/1.1: the client closes the connection mid-body.
    let tcp = TcpStream::connect(origin.addr).await.unwrap();
    let (mut tx, conn) = http1::handshake(TokioIo::new(tcp)).await.unwrap();
    let conn = tokio::spawn(conn);
    let response = tx.send_request(request("/wait-abort", "GET", b"")).await.unwrap();
    let mut body = response.into_body();
    body.frame().await.unwrap().unwrap();
    drop((body, tx));
    conn.abort();
    assert!(eventually(WAIT, || origin.aborted_responses() == 1));

    // h2: dropping the body resets the stream; the connection lives on.
    let mut tx = h2c(&origin).await;
    let response = tx
        .send_request(request(&format!("{base}/wait-abort"), "GET", b""))
        .await
        .unwrap();
    let mut body = response.into_body();
    body.frame().await.unwrap().unwrap();
    drop(body);
    assert!(eventually(WAIT, || origin.aborted_responses() == 2));
    let got = collect(
        tx.send_request(request(&format!("{base}/status/200"), "GET", b""))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(got.status, StatusCode::OK);
    assert_eq!(origin.aborted_responses(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_close_origin_ends_the_body_with_fin() {
    let body = pattern(200_000);
    let origin = HalfCloseOrigin::start(body.clone()).await;
    let mut tcp = TcpStream::connect(origin.addr).await.unwrap();
    tcp.write_all(b"GET / HTTP/1.1\r\nhost: origin\r\n\r\n")
        .await
        .unwrap();
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut response))
        .await
        .unwrap()
        .unwrap();
    let head = b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n";
    assert_eq!(&response[..head.len()], head);
    assert_eq!(sha(&response[head.len()..]), sha(&body));
    // Half-closed, not closed: the origin still reads what comes after its FIN.
    tcp.write_all(b"after the fin").await.unwrap();
    assert_eq!(origin.connections(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_serves_a_file() {
    let root = tempfile::tempdir().unwrap();
    std::fs::write(root.path().join("big.bin"), pattern(1_000_000)).unwrap();
    let nginx = Nginx::start(root.path());

    let tcp = TcpStream::connect(nginx.addr).await.unwrap();
    let (mut tx, conn) = http1::handshake(TokioIo::new(tcp)).await.unwrap();
    tokio::spawn(conn);
    for _ in 0..2 {
        let mut req = request("/big.bin", "GET", b"");
        req.headers_mut().insert("host", "origin.test".parse().unwrap());
        req.headers_mut()
            .insert("x-forwarded-for", "192.0.2.1".parse().unwrap());
        let got = send(&mut tx, req).await;
        assert_eq!(got.status, StatusCode::OK);
        assert_eq!(sha(&got.body), sha(&pattern(1_000_000)));
    }
    let line = "GET /big.bin HTTP/1.1 200 1000000 \"origin.test\" \"192.0.2.1\" \"-\" \"-\" \"-\" \"-\"";
    assert!(
        eventually(WAIT, || nginx.access_log().matches(line).count() == 2),
        "{}",
        nginx.access_log()
    );
}
