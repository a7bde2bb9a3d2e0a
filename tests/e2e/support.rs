//! One test's world: a temp dir with a document root, a PKI and a leaf certificate.

use std::path::PathBuf;
use std::sync::Arc;

use rustls::ClientConfig;
use webship_tests::client::{fetch, Fetched, Proto};
use webship_tests::{Pki, Server};

pub const HOST: &str = "files.test";

pub struct Env {
    pub dir: tempfile::TempDir,
    pub root: PathBuf,
    pub pki: Pki,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Env {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir(&root).unwrap();
        let pki = Pki::new(dir.path());
        let (cert, key) = pki.leaf("files", &[HOST, "localhost"]);
        Self {
            dir,
            root,
            pki,
            cert,
            key,
        }
    }

    /// One site, `HOST`, on `root`, with `extra` TOML appended.
    pub fn config(&self, extra: &str) -> String {
        format!(
            "listen = \"127.0.0.1:{{port}}\"\nworkers = 2\n\n{extra}\n\n[[sites]]\ndomain = \"{HOST}\"\nroot = \"{}\"\n[sites.tls]\ncert = \"{}\"\nkey = \"{}\"\n",
            self.root.display(),
            self.cert.display(),
            self.key.display()
        )
    }

    pub fn start(&self, extra: &str) -> Server {
        Server::start(self.dir.path(), &self.config(extra))
    }

    pub fn client(&self, alpn: &[u8]) -> Arc<ClientConfig> {
        self.pki.client(&[alpn])
    }

    /// One GET to `server` for `HOST` over `proto`, verified against this PKI.
    pub async fn get(&self, proto: Proto, server: &Server, path: &str, headers: &[(&str, &str)]) -> Fetched {
        fetch(
            proto,
            server.addr(),
            HOST,
            self.client(proto.alpn()),
            "GET",
            path,
            headers,
        )
        .await
    }

    pub fn write(&self, name: &str, contents: &[u8]) -> PathBuf {
        let path = self.root.join(name);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).unwrap();
        }
        std::fs::write(&path, contents).unwrap();
        path
    }
}

/// Deterministic, position-dependent bytes, so a wrong offset shows.
pub fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + i / 251) as u8).collect()
}
