//! A response that cannot be completed must look incomplete on every protocol: a
//! client may never take a short body for the whole file. The fault here is a file
//! that shrinks while it is being sent (a log rotated, an artifact overwritten).

use std::time::Duration;

use bytes::{Buf, Bytes};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use webship_tests::client::{connect, H3Client, H3Options, Proto};

use crate::support::{Env, HOST};

const MIB: u64 = 1024 * 1024;
/// Large enough that no flow-control window holds it: the server is still reading
/// the file when it shrinks.
const LEN: u64 = 96 * MIB;
/// What the file is cut to once the client has seen [`READ_FIRST`] bytes.
const CUT_TO: u64 = 2 * MIB;
const READ_FIRST: u64 = 4 * MIB;

/// How a download ended.
#[derive(Debug, PartialEq, Eq)]
enum End {
    /// The body ended cleanly after this many bytes.
    Complete(u64),
    /// The transport reported an error: the client can tell the body is incomplete.
    Broken,
}

fn shrinking_file(env: &Env) -> std::path::PathBuf {
    let path = env.root.join("shrinks.bin");
    let file = std::fs::File::create(&path).unwrap();
    file.set_len(LEN).unwrap();
    path
}

fn cut(path: &std::path::Path) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(CUT_TO)
        .unwrap();
}

async fn download_tcp(env: &Env, proto: Proto, port: u16, path: &std::path::Path) -> End {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let tls = connect(addr, HOST, env.client(proto.alpn())).await.unwrap();
    let io = TokioIo::new(tls);
    let authority = format!("{HOST}:{port}");
    let req = http::Request::get(format!("https://{authority}/shrinks.bin"))
        .header("host", &authority)
        .body(Empty::<Bytes>::new())
        .unwrap();
    let resp = match proto {
        Proto::H1 => {
            let (mut send, conn) = hyper::client::conn::http1::handshake(io).await.unwrap();
            tokio::spawn(conn);
            send.send_request(req).await.unwrap()
        }
        Proto::H2 => {
            let (mut send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
                .await
                .unwrap();
            tokio::spawn(conn);
            send.send_request(req).await.unwrap()
        }
    };
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-length"], LEN.to_string());
    let mut body = resp.into_body();
    let mut got = 0u64;
    let mut was_cut = false;
    loop {
        match body.frame().await {
            None => return End::Complete(got),
            Some(Err(_)) => return End::Broken,
            Some(Ok(frame)) => got += frame.data_ref().map_or(0, |d| d.len() as u64),
        }
        if !was_cut && got >= READ_FIRST {
            cut(path);
            was_cut = true;
        }
    }
}

async fn download_h3(env: &Env, port: u16, path: &std::path::Path) -> End {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut h3 = H3Client::connect(addr, HOST, &env.client(b"h3"), &H3Options::default())
        .await
        .unwrap();
    let req = http::Request::get(format!("https://{HOST}:{port}/shrinks.bin"))
        .body(())
        .unwrap();
    let mut stream = h3.send.send_request(req).await.unwrap();
    stream.finish().await.unwrap();
    let resp = stream.recv_response().await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut got = 0u64;
    let mut was_cut = false;
    let end = loop {
        match stream.recv_data().await {
            Ok(None) => break End::Complete(got),
            Err(_) => break End::Broken,
            Ok(Some(chunk)) => got += chunk.remaining() as u64,
        }
        if !was_cut && got >= READ_FIRST {
            cut(path);
            was_cut = true;
        }
    };
    drop(stream);
    h3.close().await;
    end
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_that_shrinks_mid_response_ends_it_as_incomplete_on_h1_h2_and_h3() {
    let env = Env::new();
    let server = env.start("");
    for proto in ["h1", "h2", "h3"] {
        let path = shrinking_file(&env);
        let download = async {
            match proto {
                "h1" => download_tcp(&env, Proto::H1, server.port, &path).await,
                "h2" => download_tcp(&env, Proto::H2, server.port, &path).await,
                _ => download_h3(&env, server.port, &path).await,
            }
        };
        let end = tokio::time::timeout(Duration::from_secs(60), download)
            .await
            .unwrap_or_else(|_| panic!("{proto}: the download neither ended nor broke in 60 s"));
        assert_eq!(
            end,
            End::Broken,
            "{proto}: a file cut to {CUT_TO} bytes mid-response must end the response as broken, \
             never as a clean (short) body"
        );
    }
}

/// A proxied response on the HTTP/1.1 file driver (the certificate's site serves files,
/// `Host` names a proxy site) goes out head first, as soon as the upstream answers: a
/// client must see the status even when the first body byte is slow or never comes
/// (server-sent events, long polls, an upstream that dies first). At 65ec5f3 the h1
/// driver wrote the head before relaying; since the seam, `h1::Writer` holds it back
/// until the first data frame, so an upstream that fails before its first byte leaves
/// the client with no response at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relayed_head_goes_out_before_the_first_body_byte_on_the_h1_driver() {
    use webship_tests::client::raw_h1;
    use webship_tests::origin::Origin;
    let env = Env::new();
    let origin = Origin::start().await;
    let leaf = env.pki.leaf("api", &["api.test"]).unwrap();
    let (cert, key) = (leaf.cert, leaf.key);
    let server = env.start(&format!(
        "[reverse_proxy]\nenabled = true\ntls_termination = true\n[reverse_proxy.tls]\ncert = \"{}\"\nkey = \"{}\"\n\
         [[reverse_proxy.routes]]\ndomain = \"api.test\"\npath_prefix = \"/\"\nupstreams = [\"{}\"]\n",
        cert.display(),
        key.display(),
        origin.addr
    ));
    // `die-chunked/0`: a 200 without a length, then (50 ms later) a failure, no data.
    let raw = raw_h1(
        server.addr(),
        HOST,
        env.client(Proto::H1.alpn()),
        b"GET /die-chunked/0 HTTP/1.1\r\nHost: api.test\r\nConnection: close\r\n\r\n",
    )
    .await;
    let text = String::from_utf8_lossy(&raw);
    assert!(
        text.starts_with("HTTP/1.1 200 "),
        "the upstream answered 200 before failing; the client must see that head \
         (then a chunked body that never ends), got {text:?}"
    );
    assert!(
        !text.ends_with("0\r\n\r\n"),
        "a relayed body that failed must not end with the last chunk: {text:?}"
    );
}
