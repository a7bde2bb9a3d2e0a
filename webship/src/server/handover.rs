//! Zero-downtime binary upgrade: the running daemon hands its listening sockets to a
//! new process (`webship serve --takeover`) over the control socket, then drains.
//!
//! The exchange, on one control connection (JSON lines, descriptors by `SCM_RIGHTS`,
//! see `sys::fdpass`):
//!
//! 1. new → old: `Takeover` (the control request).
//! 2. old → new: an [`Offer`] with the descriptors: the TCP listener, the UDP socket
//!    (HTTP/3 endpoint or UDP passthrough relay), for HTTP/3 one end of the datagram
//!    pair and the key of the old connection IDs (`h3::generation` says why), and the
//!    locked pin folder when eBPF is loaded. Before sending it the old endpoint stops
//!    reading the UDP socket and reads the pair instead.
//! 3. The new process builds everything from its own configuration on those sockets,
//!    starts accepting, and answers [`Message::Serving`]. Until then the old process
//!    serves as before; if the new one fails (or says nothing within
//!    [`SERVING_TIMEOUT`]) the old endpoint reads the UDP socket again and nothing
//!    else changed.
//! 4. The old process stops accepting and drains like at SIGTERM, reporting its
//!    passthrough counters on the connection every half second and once more as it
//!    exits, so the new one publishes continuous totals.
//!
//! Both processes accept from the one listening socket (one accept queue) while
//! they overlap, so no connection is refused in the switch.

use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde::{de::DeserializeOwned, Deserialize, Serialize};
use tokio::net::UnixStream;

use crate::control::{Call, Incoming, Request};
use crate::ebpf::Programs;
use crate::h3::generation::{self, GenerationKey, Predecessor};
use crate::h3::Handover;
use crate::sys::fdpass;

/// How long the old process waits for the new one to serve.
const SERVING_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the new process waits for the offer.
const OFFER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the new process waits for the old one to acknowledge that it serves
/// (the old one's first counter report, sent as soon as it hears).
const ACK_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest line of the exchange.
const MAX_LINE: usize = 1024 * 1024;
/// How often a draining process reports its counters.
const REPORT_EVERY: Duration = Duration::from_millis(500);
/// How long the new process hears nothing from a draining predecessor before it
/// takes it for gone (stopped, wedged): twenty missed reports. It then reads the
/// UDP socket directly and accepts the next takeover.
const SILENCE_LIMIT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum HandoverError {
    #[error(transparent)]
    Control(#[from] crate::control::ControlError),
    #[error("the running webship refused the takeover: {0}")]
    Refused(String),
    #[error("the built-in configuration has no control socket to take over from (fix: --config FILE)")]
    NoControlSocket,
    #[error("the takeover exchange failed: {0}")]
    Exchange(String),
    #[error(
        "the running webship did not acknowledge that this process serves (it gave up waiting and serves again); \
         this process stops rather than serve beside it. Its control socket file was this process's and is gone \
         with it: the running webship still reloads on SIGHUP, and a restart gives it a control socket again"
    )]
    NotHeard,
    #[error(
        "the running webship listens on {running}, this configuration on {ours}; a takeover \
         keeps the listening sockets, so the address cannot change (fix: the same `listen`, \
         or stop the old daemon and start this one)"
    )]
    ListenDiffers { running: SocketAddr, ours: SocketAddr },
}

/// What travels on the takeover connection after the request. An upgrade speaks it
/// between two versions, so it only grows: unknown fields are ignored, a field
/// added later carries `#[serde(default)]`, none is removed or changes meaning.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum Message {
    Offer(Box<Offer>),
    Refused {
        message: String,
    },
    /// `adopted_pins`: the new process took the pin folder over (same folder, eBPF
    /// loaded); if not, the old one removes its pins when it exits.
    Serving {
        pid: u32,
        #[serde(default)]
        adopted_pins: bool,
    },
    Counters {
        values: Vec<u64>,
        last: bool,
    },
}

/// The old process's sockets and what the new one must know about them. The
/// descriptors come in the order of the fields that name an index.
#[derive(Debug, Serialize, Deserialize)]
struct Offer {
    pid: u32,
    version: String,
    /// The configured `listen` (the sockets are bound to it).
    listen: SocketAddr,
    tcp: usize,
    udp: Option<usize>,
    /// The HTTP/3 endpoint's other UDP sockets (`h3_sockets`), same port and
    /// `SO_REUSEPORT` group; a binary from before ignores them (and the datagrams
    /// the kernel hashes to them wait until this process drains).
    #[serde(default)]
    udp_more: Vec<usize>,
    quic: Option<QuicOffer>,
    pin_lock: Option<usize>,
    /// The folder the lock is for: a successor configured with another one does not
    /// inherit it.
    #[serde(default)]
    pin_dir: Option<std::path::PathBuf>,
    /// Passthrough counters so far (kernel and userspace summed), so the new process
    /// publishes continuous totals from its first publication on.
    counters: Vec<u64>,
}

#[derive(Debug, Serialize, Deserialize)]
struct QuicOffer {
    pair: usize,
    /// The key the old connection IDs are tagged with (hex).
    key: String,
    cid_len: usize,
    /// Client-chosen IDs of handshakes the old endpoint started (hex).
    handshakes: Vec<String>,
}

/// One side of the exchange: JSON lines, the first received ones with descriptors.
struct Wire<'a> {
    stream: &'a UnixStream,
    pending: Vec<u8>,
    fds: Vec<OwnedFd>,
}

impl<'a> Wire<'a> {
    fn new(stream: &'a UnixStream) -> Self {
        Self {
            stream,
            pending: Vec::new(),
            fds: Vec::new(),
        }
    }

    async fn send<T: Serialize>(&self, value: &T, fds: &[BorrowedFd<'_>]) -> Result<(), String> {
        let mut line = serde_json::to_vec(value).map_err(|e| e.to_string())?;
        line.push(b'\n');
        tokio::time::timeout(OFFER_TIMEOUT, fdpass::send(self.stream, &line, fds))
            .await
            .map_err(|_| "the peer reads nothing".to_owned())?
            .map_err(|e| e.to_string())
    }

    /// The next line; `None` at end of stream.
    async fn recv<T: DeserializeOwned>(&mut self) -> Result<Option<T>, String> {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            if let Some(end) = self.pending.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.pending.drain(..=end).collect();
                return serde_json::from_slice(&line).map(Some).map_err(|e| e.to_string());
            }
            if self.pending.len() > MAX_LINE {
                return Err(format!("no line within {MAX_LINE} bytes"));
            }
            let (n, fds) = fdpass::recv(self.stream, &mut buf)
                .await
                .map_err(|e| e.to_string())?;
            if self.fds.len() + fds.len() > fdpass::MAX_FDS {
                return Err("too many descriptors".into());
            }
            self.fds.extend(fds);
            if n == 0 {
                return Ok(None);
            }
            self.pending.extend_from_slice(&buf[..n]);
        }
    }

    /// Takes descriptor `index` of those received (the rest close with the wire).
    fn take(&mut self, index: usize) -> Result<OwnedFd, String> {
        let fd = self.fds.get(index).ok_or("a descriptor is missing")?;
        fd.try_clone().map_err(|e| e.to_string())
    }
}

/// The sockets a running process can hand over.
#[derive(Clone)]
pub(super) struct Sockets<'a> {
    pub(super) listen: SocketAddr,
    pub(super) tcp: BorrowedFd<'a>,
    pub(super) h3: Option<&'a Handover>,
    pub(super) relay: Option<BorrowedFd<'a>>,
    pub(super) programs: Option<Arc<Programs>>,
}

/// A successor that serves: this process drains, reporting its counters to it.
pub(super) struct Successor {
    pid: u32,
    adopted_pins: bool,
    report: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Successor {
    pub(super) fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether it took the pinned maps over (else they are still this process's to
    /// remove).
    pub(super) fn adopted_pins(&self) -> bool {
        self.adopted_pins
    }

    /// The last report, once drained.
    pub(super) async fn farewell(self) {
        let _ = self.report.send(());
        let _ = tokio::time::timeout(Duration::from_secs(2), self.task).await;
    }
}

/// Answers a `Takeover` request: offers the sockets and waits for the new process
/// to serve. `None` means it did not, and this process carries on as before.
pub(super) async fn give(incoming: Incoming, sockets: Sockets<'_>) -> Option<Successor> {
    match offer(&incoming, &sockets).await {
        Ok((pid, adopted_pins)) => {
            tracing::info!(
                successor = pid,
                adopted_pins,
                "takeover: the new process serves; draining"
            );
            let programs = sockets.programs.clone();
            let (report, stop) = tokio::sync::oneshot::channel();
            let task = tokio::spawn(report_counters(incoming, programs, stop));
            Some(Successor {
                pid,
                adopted_pins,
                report,
                task,
            })
        }
        Err(reason) => {
            if let Some(h3) = sockets.h3 {
                h3.direct();
            }
            tracing::warn!(%reason, "takeover failed; this process keeps serving");
            refuse(incoming, &reason).await;
            None
        }
    }
}

async fn offer(incoming: &Incoming, sockets: &Sockets<'_>) -> Result<(u32, bool), String> {
    if let Some(reason) = incoming.peer_pid().and_then(super::systemd::outside_the_service) {
        return Err(reason);
    }
    let wire = Wire::new(incoming.stream());
    let mut fds = vec![sockets.tcp];
    let udp = sockets
        .h3
        .and_then(|h3| h3.udp.first())
        .map(|u| u.as_fd())
        .or(sockets.relay);
    let udp_index = udp.map(|fd| {
        fds.push(fd);
        fds.len() - 1
    });
    let mut udp_more = Vec::new();
    for more in sockets.h3.iter().flat_map(|h3| h3.udp.iter().skip(1)) {
        fds.push(more.as_fd());
        udp_more.push(fds.len() - 1);
    }
    let (pair, quic) = match sockets.h3 {
        Some(h3) => {
            let (ours, theirs) = fdpass::seqpacket_pair().map_err(|e| format!("datagram pair: {e}"))?;
            // From here this endpoint reads only what the successor forwards.
            h3.forwarded(ours).map_err(|e| format!("datagram pair: {e}"))?;
            let handshakes = h3
                .handshakes
                .snapshot()
                .iter()
                .map(|c| generation::to_hex(c))
                .collect();
            (
                Some(theirs),
                Some(QuicOffer {
                    pair: 0,
                    key: h3.key.to_hex(),
                    cid_len: generation::CID_LEN,
                    handshakes,
                }),
            )
        }
        None => (None, None),
    };
    let quic = quic.map(|mut q| {
        q.pair = fds.len();
        q
    });
    if let Some(pair) = &pair {
        fds.push(pair.as_fd());
    }
    let pin_lock = sockets.programs.as_deref().map(|p| {
        fds.push(p.pin_lock());
        fds.len() - 1
    });
    let offer = Message::Offer(Box::new(Offer {
        pid: std::process::id(),
        version: env!("CARGO_PKG_VERSION").to_owned(),
        listen: sockets.listen,
        tcp: 0,
        udp: udp_index,
        udp_more,
        quic,
        pin_lock,
        pin_dir: sockets.programs.as_deref().map(|p| p.pin_dir().to_owned()),
        counters: super::plan::Plan::totals(sockets.programs.as_deref()).to_vec(),
    }));
    wire.send(&offer, &fds).await?;
    drop(pair);
    let mut wire = wire;
    match tokio::time::timeout(SERVING_TIMEOUT, wire.recv::<Message>()).await {
        Ok(Ok(Some(Message::Serving { pid, adopted_pins }))) => {
            // The acknowledgement the new process waits for, sent before this one
            // stops accepting: if it can no longer be sent (the new process gave up
            // and went), this one serves on instead of draining with nobody left.
            let values = super::plan::Plan::totals(sockets.programs.as_deref()).to_vec();
            let ack = Message::Counters { values, last: false };
            wire.send(&ack, &[])
                .await
                .map_err(|e| format!("the new process went away before it heard this one drains: {e}"))?;
            Ok((pid, adopted_pins))
        }
        Ok(Ok(Some(other))) => Err(format!("unexpected answer: {other:?}")),
        Ok(Ok(None)) => Err("the new process ended before serving (see its output)".into()),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(format!(
            "the new process did not serve within {} s",
            SERVING_TIMEOUT.as_secs()
        )),
    }
}

async fn report_counters(
    incoming: Incoming,
    programs: Option<Arc<Programs>>,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) {
    let wire = Wire::new(incoming.stream());
    let mut tick = tokio::time::interval(REPORT_EVERY);
    loop {
        let last = tokio::select! {
            _ = tick.tick() => false,
            _ = &mut stop => true,
        };
        let values = super::plan::Plan::totals(programs.as_deref()).to_vec();
        if wire.send(&Message::Counters { values, last }, &[]).await.is_err() || last {
            return;
        }
    }
}

/// Refuses a takeover: this process cannot give one (its own predecessor still
/// drains), or the new process did not serve in time.
pub(super) async fn refuse(incoming: Incoming, reason: &str) {
    let wire = Wire::new(incoming.stream());
    let _ = wire
        .send(
            &Message::Refused {
                message: reason.to_owned(),
            },
            &[],
        )
        .await;
}

/// Whether the locked folder a predecessor handed over is `path` (the same device
/// and inode, however either is spelled).
fn same_folder(lock: &OwnedFd, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(held) = rustix::fs::fstat(lock) else {
        return false;
    };
    std::fs::metadata(path).is_ok_and(|m| m.dev() == held.st_dev && m.ino() == held.st_ino)
}

/// What the new process received.
pub(super) struct Inherited {
    pub(super) tcp: Option<std::net::TcpListener>,
    pub(super) udp: Option<std::net::UdpSocket>,
    /// The HTTP/3 endpoint's other sockets, if it had more than one.
    pub(super) udp_more: Vec<std::net::UdpSocket>,
    pub(super) predecessor: Option<Predecessor>,
    pub(super) pin_lock: Option<OwnedFd>,
    pub(super) pid: u32,
    call: Call,
    /// Bytes already read past the offer (none in practice: the old process waits).
    leftover: Vec<u8>,
}

/// Asks the daemon on `control` for its sockets. Refuses when it listens elsewhere.
pub(super) async fn take(
    control: &Path,
    listen: SocketAddr,
    pin_dir: &Path,
) -> Result<Inherited, HandoverError> {
    let call = Call::start(control, &Request::Takeover).await?;
    let mut wire = Wire::new(call.stream());
    let exchange = HandoverError::Exchange;
    let offer = match tokio::time::timeout(OFFER_TIMEOUT, wire.recv::<Message>()).await {
        Err(_) => return Err(exchange("no offer within 10 s".into())),
        Ok(Err(e)) => return Err(exchange(e)),
        Ok(Ok(None)) => return Err(exchange("closed without an offer".into())),
        Ok(Ok(Some(Message::Offer(offer)))) => offer,
        Ok(Ok(Some(Message::Refused { message }))) => return Err(HandoverError::Refused(message)),
        Ok(Ok(Some(other))) => return Err(exchange(format!("unexpected: {other:?}"))),
    };
    if offer.listen != listen {
        return Err(HandoverError::ListenDiffers {
            running: offer.listen,
            ours: listen,
        });
    }
    let tcp = Some(std::net::TcpListener::from(
        wire.take(offer.tcp).map_err(exchange)?,
    ));
    let udp = match offer.udp {
        Some(i) => Some(std::net::UdpSocket::from(wire.take(i).map_err(exchange)?)),
        None => None,
    };
    let udp_more = offer
        .udp_more
        .iter()
        .map(|&i| wire.take(i).map(std::net::UdpSocket::from))
        .collect::<Result<Vec<_>, _>>()
        .map_err(exchange)?;
    let predecessor = match offer.quic {
        Some(q) => {
            let key = GenerationKey::from_hex(&q.key).ok_or_else(|| exchange("a bad QUIC key".into()))?;
            if q.cid_len != generation::CID_LEN {
                return Err(exchange(format!(
                    "the running webship issues {}-byte connection IDs, this one {}",
                    q.cid_len,
                    generation::CID_LEN
                )));
            }
            let handshakes = q
                .handshakes
                .iter()
                .take(generation::MAX_HANDSHAKES)
                .filter_map(|h| generation::hex(h))
                .collect();
            Some(Predecessor {
                key,
                handshakes,
                pair: wire.take(q.pair).map_err(exchange)?,
            })
        }
        None => None,
    };
    let pin_lock = match offer.pin_lock {
        Some(i) => Some(wire.take(i).map_err(exchange)?),
        None => None,
    };
    // Another pin folder: this process pins in its own, and the old one removes its
    // pins when it exits.
    let pin_lock = match (pin_lock, &offer.pin_dir) {
        (Some(lock), Some(theirs)) if !same_folder(&lock, pin_dir) => {
            tracing::info!(
                from = %theirs.display(),
                to = %pin_dir.display(),
                "takeover: the pin folder changes; the previous process removes its pins when it exits"
            );
            drop(lock);
            None
        }
        (lock, _) => lock,
    };
    tracing::info!(
        predecessor = offer.pid,
        version = %offer.version,
        "takeover: received the listening sockets"
    );
    super::plan::inherit_counters(&offer.counters);
    let leftover = std::mem::take(&mut wire.pending);
    drop(wire);
    Ok(Inherited {
        tcp,
        udp,
        udp_more,
        predecessor,
        pin_lock,
        pid: offer.pid,
        call,
        leftover,
    })
}

impl Inherited {
    /// Tells the old process this one serves and waits for its first counter
    /// report, the sign it heard and drains; then follows its reports until it
    /// exits (`gone` runs then). An error means the old process did not take the
    /// news (it gave up waiting, see [`SERVING_TIMEOUT`], and serves again): this
    /// process must not serve beside it on the same sockets.
    pub(super) async fn serving(
        self,
        adopted_pins: bool,
        gone: impl FnOnce() + Send + 'static,
    ) -> Result<(), HandoverError> {
        let call = self.call;
        let old = self.pid;
        let leftover = self.leftover;
        let first = {
            let mut wire = Wire::new(call.stream());
            wire.pending = leftover;
            wire.send(
                &Message::Serving {
                    pid: std::process::id(),
                    adopted_pins,
                },
                &[],
            )
            .await
            .map_err(HandoverError::Exchange)?;
            let heard = tokio::time::timeout(ACK_TIMEOUT, wire.recv::<Message>()).await;
            let first = match heard {
                Ok(Ok(Some(Message::Counters { values, last }))) => (values, last),
                Ok(Ok(Some(Message::Refused { message }))) => return Err(HandoverError::Refused(message)),
                Ok(Ok(Some(other))) => return Err(HandoverError::Exchange(format!("unexpected: {other:?}"))),
                Ok(Ok(None)) | Err(_) => return Err(HandoverError::NotHeard),
                Ok(Err(e)) => return Err(HandoverError::Exchange(e)),
            };
            (first, std::mem::take(&mut wire.pending))
        };
        let ((values, last), leftover) = first;
        super::plan::inherit_counters(&values);
        // The old process names this one to the service manager (`MAINPID=`, see
        // `systemd::Reporter::hand_over`): with `NotifyAccess=main` only it may.
        tokio::spawn(async move {
            let mut wire = Wire::new(call.stream());
            wire.pending = leftover;
            let mut done = last;
            let mut silent = false;
            while !done {
                done = match tokio::time::timeout(SILENCE_LIMIT, wire.recv::<Message>()).await {
                    Ok(Ok(Some(Message::Counters { values, last }))) => {
                        super::plan::inherit_counters(&values);
                        last
                    }
                    Ok(Ok(Some(_))) => false,
                    Ok(Ok(None) | Err(_)) => true,
                    Err(_) => {
                        silent = true;
                        true
                    }
                };
            }
            if silent {
                tracing::warn!(
                    predecessor = old,
                    silent_secs = SILENCE_LIMIT.as_secs(),
                    "takeover: the previous process stopped reporting; taken for gone (its QUIC connections are no longer forwarded)"
                );
            } else {
                // Until the connection closes the old process may still be sending.
                let _ = tokio::time::timeout(SILENCE_LIMIT, wire.recv::<Message>()).await;
                tracing::info!(predecessor = old, "takeover: the previous process has exited");
            }
            gone();
        });
        Ok(())
    }
}
