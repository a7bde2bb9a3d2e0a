//! The real `webship` binary, started on a free loopback port with a config written
//! to a temporary directory; stopped (SIGTERM, then SIGKILL) when dropped.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

/// The binary under test, next to this test executable's `deps/` directory.
pub fn binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(Path::parent).unwrap();
    let bin = dir.join("webship");
    assert!(
        bin.exists(),
        "{} is missing: build it first (`cargo build -p webship`; `cargo xtask test` does)",
        bin.display()
    );
    bin
}

/// Runs `webship ARGS` to completion (for `check` and `preflight`).
pub fn webship(args: &[&str], cwd: &Path) -> Output {
    Command::new(binary())
        .args(args)
        .current_dir(cwd)
        .env("WEBSHIP_LOG", "info")
        .output()
        .unwrap()
}

/// A port that was free a moment ago.
/// A port free for both TCP and UDP a moment ago (webship serves h3 on the same
/// port over UDP, and client QUIC sockets take ephemeral UDP ports).
pub fn free_port() -> u16 {
    for _ in 0..100 {
        let tcp = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = tcp.local_addr().unwrap().port();
        if std::net::UdpSocket::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no port free for both TCP and UDP after 100 tries");
}

/// A loopback TCP port that refuses connections for as long as the returned socket
/// lives: bound, never listening. Unlike a port that was free a moment ago, no
/// parallel test's server can take it in between and answer for it.
pub fn refused_port() -> (socket2::Socket, u16) {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket
        .bind(&std::net::SocketAddr::from(([127, 0, 0, 1], 0)).into())
        .unwrap();
    let port = socket.local_addr().unwrap().as_socket().unwrap().port();
    (socket, port)
}

/// Whether something accepts TCP connections on the port.
pub fn listening(port: u16) -> bool {
    TcpStream::connect_timeout(
        &SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_millis(200),
    )
    .is_ok()
}

pub struct Server {
    child: Child,
    pub port: u16,
    log: PathBuf,
}

impl Server {
    /// Starts `webship serve --config <dir>/webship.toml` with `config`, in which the
    /// text `{port}` is replaced by a free port; waits until it accepts connections.
    ///
    /// A port taken between choosing it and binding it (another test's ephemeral
    /// socket) is retried on a fresh port: that race is the harness's, not webship's.
    pub fn start(dir: &Path, config: &str) -> Server {
        for _ in 0..3 {
            let port = free_port();
            let path = dir.join("webship.toml");
            std::fs::write(&path, config.replace("{port}", &port.to_string())).unwrap();
            let mut server = Self::spawn(dir, &["serve", "--config", path.to_str().unwrap()], port);
            if server.try_wait_listening() {
                return server;
            }
            let log = server.log();
            if !log.contains("Address already in use") {
                panic!("webship did not start on {port}; log:\n{log}");
            }
        }
        panic!("webship could not bind a free port in 3 tries");
    }

    /// Like [`Server::wait_listening`], but `false` when the process exited instead.
    /// "Listening" also needs the start-up line, which webship logs once its UDP
    /// side (h3, or passthrough's redirect) is ready too, after TCP accepts.
    fn try_wait_listening(&mut self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if listening(self.port) && self.log().contains("listening on") {
                return true;
            }
            if let Ok(Some(_)) = self.child.try_wait() {
                return false;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        panic!(
            "webship did not listen on {} within 20 s; log:\n{}",
            self.port,
            self.log()
        );
    }

    /// Starts `webship serve` with `args`, without waiting.
    pub fn spawn(dir: &Path, args: &[&str], port: u16) -> Server {
        let log = dir.join(format!("webship-{port}.log"));
        let child = Command::new(binary())
            .args(args)
            .current_dir(dir)
            .env("WEBSHIP_LOG", "info,webship=debug")
            .stdout(Stdio::from(
                std::fs::File::create(dir.join("stdout.log")).unwrap(),
            ))
            .stderr(Stdio::from(std::fs::File::create(&log).unwrap()))
            .spawn()
            .unwrap();
        Server { child, port, log }
    }

    pub fn wait_listening(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if listening(self.port) && self.log().contains("listening on") {
                return;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "webship exited ({status}) instead of listening; log:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        panic!(
            "webship did not listen on {} within 20 s; log:\n{}",
            self.port,
            self.log()
        );
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        let ok = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
    }

    /// Waits up to `limit` for the process to exit.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Resident memory of the server process, in bytes.
    pub fn rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        let kb: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap();
        kb * 1024
    }

    /// Established TCP connections whose local end is this server's port, read from
    /// the kernel's socket table (no help from the server).
    pub fn established(&self) -> usize {
        let port_hex = format!(":{:04X}", self.port);
        ["/proc/net/tcp", "/proc/net/tcp6"]
            .iter()
            .filter_map(|f| std::fs::read_to_string(f).ok())
            .map(|table| {
                table
                    .lines()
                    .skip(1)
                    .filter(|l| {
                        let cols: Vec<&str> = l.split_whitespace().collect();
                        cols.len() > 3 && cols[1].ends_with(&port_hex) && cols[3] == "01"
                    })
                    .count()
            })
            .sum()
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = Command::new("kill")
                .args(["-TERM", &self.pid().to_string()])
                .status();
            if self.wait_exit(Duration::from_secs(5)).is_none() {
                let _ = self.child.kill();
                let _ = self.child.wait();
            }
        }
    }
}

/// Polls `cond` every 50 ms for up to `limit`.
pub fn eventually(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
