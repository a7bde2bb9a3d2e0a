//! The control socket: how a command on the same host talks to the running daemon.
//!
//! `webship reload` asks it to re-read its configuration and gets the outcome back;
//! a new process starting with `--takeover` asks it for its listening sockets (the
//! descriptors travel on the same connection, see `sys::fdpass`). It is a Unix
//! stream socket, bound while the daemon is still root and made `0600`, so only
//! root can connect; and whoever connects is checked (`SO_PEERCRED`): root, or
//! the daemon's own account, else refused.
//!
//! One exchange per connection: the client writes one [`Request`] as a JSON line,
//! the daemon answers with one [`Reply`] as a JSON line (a takeover sends its
//! descriptors first), and closes. Both sides bound what they read and how long
//! they wait. This module is a leaf: it knows the wire format and the socket file,
//! not what a request does; the supervisor (`server`) answers the requests.

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;

/// How long either side waits for the other's line.
const LINE_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest request the daemon reads.
const MAX_REQUEST: u64 = 256 * 1024;
/// The longest reply a client reads: a `metrics` reply carries the whole exposition,
/// several KiB per busy site.
const MAX_REPLY: u64 = 16 * 1024 * 1024;
/// Control connections being read at once; more wait in the kernel's backlog.
const MAX_PENDING: usize = 8;

/// What a client asks of the daemon.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Re-read the configuration: from `config` when given (it becomes the
    /// daemon's file from then on), else from the file it was started with.
    Reload { config: Option<PathBuf> },
    /// Hand the listening sockets to the asking process, which then serves them.
    Takeover,
    /// Who is running: the reply's message names the pid, version and file.
    Status,
    /// Every metric now: the reply's message is the Prometheus text exposition, as
    /// the admin listener's `/metrics` serves it (for `webship stats` without an
    /// admin listener).
    Metrics,
    /// The large responses in flight (declared length of 1 MiB or more), with
    /// their progress: the reply's `transfers` (for `webship stats --watch`).
    Transfers,
    /// Each ACME site's certificate (the reply's `certs`); with `renew`, that site's
    /// certificate is ordered anew first and the reply waits for the outcome.
    Certs { renew: Option<String> },
}

/// The daemon's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Reply {
    pub ok: bool,
    /// What happened, or why not (for a refused configuration: the same text as
    /// `webship check`).
    pub message: String,
    /// Lines worth showing the operator beside the message: settings that changed
    /// in the file but need a restart to take effect, and the like.
    #[serde(default)]
    pub notes: Vec<String>,
    /// The answer to [`Request::Transfers`]; absent from every other reply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfers: Option<TransferList>,
    /// The answer to [`Request::Certs`]; absent from every other reply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub certs: Option<Vec<CertInfo>>,
}

/// One site's certificate, as `webship certs` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CertInfo {
    pub site: String,
    /// Where it comes from: `acme`.
    pub source: String,
    /// The ACME directory URL.
    pub directory: Option<String>,
    /// The serving certificate's serial (hex); `None` while the site has none.
    pub serial: Option<String>,
    /// Its expiry, in seconds since the Unix epoch.
    pub not_after: Option<u64>,
    /// When it is renewed next, in seconds since the Unix epoch.
    pub next_renewal: Option<u64>,
    /// The last order's error, until an order succeeds.
    pub last_error: Option<String>,
}

/// The large responses in flight.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferList {
    /// Largest first.
    pub listed: Vec<TransferInfo>,
    /// Large responses since start that found the table full and were not listed.
    pub unlisted: u64,
}

/// One large response in flight.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferInfo {
    /// Unique within the daemon's life (a listing's slot is reused).
    pub id: u64,
    /// The site's domain, `-` for none.
    pub site: String,
    /// `h1`, `h2` or `h3`.
    pub proto: String,
    /// The client (as a PROXY header gave it, where one came).
    pub peer: std::net::SocketAddr,
    /// The request's path, without its query, cut at 256 bytes.
    pub path: String,
    /// Body bytes handed to the connection so far.
    pub sent: u64,
    /// The declared length.
    pub total: u64,
    /// Since the request head was complete.
    pub elapsed_ms: u64,
}

impl Reply {
    pub fn ok(message: impl Into<String>) -> Self {
        Self {
            ok: true,
            message: message.into(),
            notes: Vec::new(),
            transfers: None,
            certs: None,
        }
    }

    pub fn refused(message: impl Into<String>) -> Self {
        Self {
            ok: false,
            message: message.into(),
            notes: Vec::new(),
            transfers: None,
            certs: None,
        }
    }
}

/// Why a control exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("no webship answers on {path}: {source} (is it running with this control_socket?)")]
    Unreachable {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "another webship answers on its control socket {0} (fix: stop it, take it over with \
         `webship serve --takeover`, or give this one another `control_socket`)"
    )]
    InUse(PathBuf),
    #[error("cannot create the control socket {path}: {source}")]
    Bind {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the control exchange on {path} failed: {reason}")]
    Exchange { path: PathBuf, reason: String },
}

/// The bound control socket.
#[derive(Debug)]
pub struct ControlListener {
    listener: UnixListener,
    path: PathBuf,
}

impl ControlListener {
    /// Binds `path` (creating its folder), refusing when another daemon answers
    /// there and replacing a socket file nobody answers on (left by a daemon that
    /// ended without removing it). Call before dropping privileges: the socket is
    /// made `0600` for the account that binds it.
    pub fn bind(path: &Path) -> Result<Self, ControlError> {
        let bind_err = |source| ControlError::Bind {
            path: path.to_owned(),
            source,
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(bind_err)?;
        }
        match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => return Err(ControlError::InUse(path.to_owned())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(_) => remove_stale(path).map_err(bind_err)?,
        }
        Self::bind_fresh(path)
    }

    /// Binds `path` in place of the socket a daemon being taken over still listens
    /// on: that one keeps its open listener (and ends soon), new clients reach this
    /// one.
    pub fn replace(path: &Path) -> Result<Self, ControlError> {
        remove_stale(path).map_err(|source| ControlError::Bind {
            path: path.to_owned(),
            source,
        })?;
        Self::bind_fresh(path)
    }

    fn bind_fresh(path: &Path) -> Result<Self, ControlError> {
        use std::os::unix::fs::PermissionsExt;
        let bind_err = |source| ControlError::Bind {
            path: path.to_owned(),
            source,
        };
        let std = std::os::unix::net::UnixListener::bind(path).map_err(bind_err)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(bind_err)?;
        std.set_nonblocking(true).map_err(bind_err)?;
        let listener = UnixListener::from_std(std).map_err(bind_err)?;
        Ok(Self {
            listener,
            path: path.to_owned(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads requests in a task of their own and hands each, with its connection,
    /// to the returned channel; ends when the receiver is dropped. A client that
    /// sends nothing, too much or garbage is answered (when it can be) and closed
    /// here: the receiver only sees well-formed requests.
    pub fn serve(self) -> mpsc::Receiver<Incoming> {
        let (tx, rx) = mpsc::channel(MAX_PENDING);
        tokio::spawn(async move {
            let permits = std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_PENDING));
            loop {
                let permit = tokio::select! {
                    p = permits.clone().acquire_owned() => p,
                    () = tx.closed() => return,
                };
                let Ok(permit) = permit else { return };
                let stream = tokio::select! {
                    r = self.listener.accept() => match r {
                        Ok((stream, _)) => stream,
                        Err(e) => {
                            tracing::warn!(error = %e, "control socket: accept failed");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            continue;
                        }
                    },
                    () = tx.closed() => return,
                };
                let peer = stream.peer_cred().ok();
                let allowed =
                    peer.is_some_and(|p| p.uid() == 0 || p.uid() == rustix::process::geteuid().as_raw());
                if !allowed {
                    tracing::debug!(uid = ?peer.map(|p| p.uid()), "control socket: a connection from another account, closed");
                    continue;
                }
                let peer_pid = peer.and_then(|p| p.pid()).and_then(|pid| u32::try_from(pid).ok());
                let tx = tx.clone();
                tokio::spawn(async move {
                    let _permit = permit;
                    let mut stream = BufReader::new(stream);
                    match read_line::<Request>(&mut stream, MAX_REQUEST).await {
                        Ok(request) => {
                            let incoming = Incoming {
                                request,
                                peer_pid,
                                stream: stream.into_inner(),
                            };
                            let _ = tx.send(incoming).await;
                        }
                        Err(reason) => {
                            tracing::debug!(%reason, "control socket: bad request");
                            let reply = Reply::refused(format!("bad request: {reason}"));
                            let _ = write_line(stream.get_mut(), &reply).await;
                        }
                    }
                });
            }
        });
        rx
    }
}

/// A request and the connection to answer it on.
#[derive(Debug)]
pub struct Incoming {
    pub request: Request,
    /// The process that connected, as the kernel saw it at connect time.
    peer_pid: Option<u32>,
    stream: UnixStream,
}

impl Incoming {
    /// The process that sent the request (`SO_PEERCRED`).
    pub fn peer_pid(&self) -> Option<u32> {
        self.peer_pid
    }

    /// The connection, for what travels before the reply (descriptors).
    pub fn stream(&self) -> &UnixStream {
        &self.stream
    }

    /// Answers and closes.
    pub async fn reply(mut self, reply: &Reply) {
        if let Err(reason) = write_line(&mut self.stream, reply).await {
            tracing::debug!(%reason, "control socket: the client left before the reply");
        }
    }
}

/// A client's open exchange: the request is sent, the reply not yet read (a
/// takeover receives descriptors in between).
#[derive(Debug)]
pub struct Call {
    stream: BufReader<UnixStream>,
    path: PathBuf,
}

impl Call {
    /// Connects to the daemon at `path` and sends `request`.
    pub async fn start(path: &Path, request: &Request) -> Result<Self, ControlError> {
        let mut stream = UnixStream::connect(path)
            .await
            .map_err(|source| ControlError::Unreachable {
                path: path.to_owned(),
                source,
            })?;
        write_line(&mut stream, request)
            .await
            .map_err(|reason| ControlError::Exchange {
                path: path.to_owned(),
                reason,
            })?;
        Ok(Self {
            stream: BufReader::new(stream),
            path: path.to_owned(),
        })
    }

    /// The connection, for what travels before the reply. Nothing may have been
    /// read through [`Call::reply`] yet.
    pub fn stream(&self) -> &UnixStream {
        self.stream.get_ref()
    }

    /// Reads the daemon's reply, waiting at most `limit` (a reload that validates
    /// a large file and loads certificates takes a moment).
    pub async fn reply(mut self, limit: Duration) -> Result<Reply, ControlError> {
        let read = tokio::time::timeout(limit, read_line::<Reply>(&mut self.stream, MAX_REPLY));
        let reason = match read.await {
            Ok(Ok(reply)) => return Ok(reply),
            Ok(Err(reason)) => reason,
            Err(_) => format!("no reply within {} s", limit.as_secs()),
        };
        Err(ControlError::Exchange {
            path: self.path,
            reason,
        })
    }
}

/// Sends `request` to the daemon at `path` and returns its reply.
pub async fn call(path: &Path, request: &Request, limit: Duration) -> Result<Reply, ControlError> {
    Call::start(path, request).await?.reply(limit).await
}

/// Removes a socket file nobody answers on; anything but a socket is left alone
/// (an operator's typo must not delete a file).
fn remove_stale(path: &Path) -> io::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => std::fs::remove_file(path),
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "a file that is not a socket is in the way",
        )),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

async fn read_line<T: for<'de> Deserialize<'de>>(
    stream: &mut BufReader<UnixStream>,
    max: u64,
) -> Result<T, String> {
    let mut line = Vec::new();
    let mut limited = (&mut *stream).take(max);
    let read = tokio::time::timeout(LINE_TIMEOUT, limited.read_until(b'\n', &mut line));
    match read.await {
        Err(_) => return Err(format!("nothing within {} s", LINE_TIMEOUT.as_secs())),
        Ok(Err(e)) => return Err(e.to_string()),
        Ok(Ok(0)) => return Err("closed without a line".into()),
        Ok(Ok(_)) if line.last() != Some(&b'\n') => {
            return Err(format!("no complete line within {max} bytes"));
        }
        Ok(Ok(_)) => {}
    }
    serde_json::from_slice(&line).map_err(|e| e.to_string())
}

async fn write_line<T: Serialize>(stream: &mut UnixStream, value: &T) -> Result<(), String> {
    let mut line = serde_json::to_vec(value).map_err(|e| e.to_string())?;
    line.push(b'\n');
    let write = async {
        stream.write_all(&line).await?;
        stream.flush().await
    };
    match tokio::time::timeout(LINE_TIMEOUT, write).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err(format!(
            "the peer read nothing within {} s",
            LINE_TIMEOUT.as_secs()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_request_is_answered_and_garbage_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/control.sock");
        let listener = ControlListener::bind(&path).unwrap();
        let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&path).unwrap().permissions());
        assert_eq!(mode & 0o777, 0o600);
        // A second daemon on the same path is refused while the first answers.
        assert!(matches!(
            ControlListener::bind(&path),
            Err(ControlError::InUse(_))
        ));
        let mut requests = listener.serve();
        let server = tokio::spawn(async move {
            let incoming = requests.recv().await.unwrap();
            assert_eq!(
                incoming.request,
                Request::Reload {
                    config: Some("/etc/w.toml".into())
                }
            );
            incoming.reply(&Reply::ok("reloaded")).await;
            requests // still serving
        });
        let request = Request::Reload {
            config: Some("/etc/w.toml".into()),
        };
        let reply = call(&path, &request, Duration::from_secs(5)).await.unwrap();
        assert_eq!(reply, Reply::ok("reloaded"));
        let _requests = server.await.unwrap();

        let mut raw = UnixStream::connect(&path).await.unwrap();
        raw.write_all(b"{\"format_disk\":{}}\n").await.unwrap();
        let mut answer = String::new();
        raw.read_to_string(&mut answer).await.unwrap();
        let reply: Reply = serde_json::from_str(answer.trim()).unwrap();
        assert!(!reply.ok && reply.message.starts_with("bad request"), "{reply:?}");
    }

    #[tokio::test]
    async fn a_stale_socket_is_replaced_and_a_regular_file_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("control.sock");
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        assert!(path.exists());
        let listener = ControlListener::bind(&path).unwrap();
        drop(listener);
        let file = dir.path().join("not-a-socket");
        std::fs::write(&file, "keep me").unwrap();
        assert!(matches!(
            ControlListener::bind(&file),
            Err(ControlError::Bind { .. })
        ));
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me");
    }
}
