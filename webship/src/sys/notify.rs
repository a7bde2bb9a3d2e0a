//! Talking to systemd: the `sd_notify` protocol (written here, without libsystemd)
//! and the check whether standard error is the journal.
//!
//! The protocol is one datagram per notification, `KEY=VALUE` lines, sent over a Unix
//! datagram socket to the address in `$NOTIFY_SOCKET`: a path, or `@name` for an
//! abstract socket. The service manager learns the sender from the kernel
//! (`SCM_CREDENTIALS`), so nothing else is needed. Without `$NOTIFY_SOCKET` (not
//! started by systemd, or not `Type=notify`) every call is a no-op that costs one
//! atomic load. The environment is read once and left as it is: a process the daemon
//! starts (a new binary taking over in an upgrade) finds the same socket.
//!
//! What each call tells systemd (`man sd_notify`):
//! - [`ready`]: `READY=1`, start-up is over (bound, preflight passed, privileges
//!   dropped); a `Type=notify` unit becomes active only now.
//! - [`reloading`]: `RELOADING=1` with `MONOTONIC_USEC=` (the time the reload
//!   started, as `Type=notify-reload` wants it); follow it with [`ready`] once the
//!   new configuration serves, or failed and the old one still does.
//! - [`stopping`]: `STOPPING=1`, the drain has started.
//! - [`status`]: `STATUS=` a line `systemctl status` shows.
//! - [`mainpid`]: `MAINPID=`, another process is now the service's main process
//!   (a new binary after an upgrade). systemd accepts it from the current main process
//!   with `NotifyAccess=main`; the new process sending it about itself needs
//!   `NotifyAccess=all`.
//! - [`watchdog_ping`]: `WATCHDOG=1`, at least every [`watchdog_interval`] (half of
//!   `$WATCHDOG_USEC`, when it is meant for this process).

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// How long a notification may wait for room in the manager's socket queue. systemd
/// drains it promptly; a peer that does not read must not hold the daemon.
const SEND_TIMEOUT: Duration = Duration::from_secs(1);

/// Where notifications go, read once from `$NOTIFY_SOCKET`.
fn target() -> Option<&'static Target> {
    static TARGET: OnceLock<Option<Target>> = OnceLock::new();
    TARGET
        .get_or_init(|| Target::parse(&std::env::var_os("NOTIFY_SOCKET")?))
        .as_ref()
}

/// Whether a service manager listens for notifications.
pub fn enabled() -> bool {
    target().is_some()
}

/// `READY=1`: start-up finished; the service is active.
pub fn ready() {
    send_logged("READY=1");
}

/// `RELOADING=1` with the current `CLOCK_MONOTONIC` time (`MONOTONIC_USEC=`, as
/// systemd's notify-reload protocol requires); send [`ready`] when the reload is over.
pub fn reloading() {
    if enabled() {
        send_logged(&reloading_message(monotonic_usec()));
    }
}

fn reloading_message(monotonic_usec: u64) -> String {
    format!("RELOADING=1\nMONOTONIC_USEC={monotonic_usec}")
}

/// `STOPPING=1`: shutting down (draining).
pub fn stopping() {
    send_logged("STOPPING=1");
}

/// `STATUS=…`: what the daemon is doing, in one line (newlines become spaces).
pub fn status(text: &str) {
    if enabled() {
        send_logged(&format!("STATUS={}", text.replace(['\n', '\r'], " ")));
    }
}

/// `MAINPID=pid`: `pid` is now the service's main process.
pub fn mainpid(pid: u32) {
    if enabled() {
        send_logged(&format!("MAINPID={pid}"));
    }
}

/// How often to send [`watchdog_ping`]: half of `$WATCHDOG_USEC`, when the manager
/// watches this process (`$WATCHDOG_PID` unset or this process's id).
pub fn watchdog_interval() -> Option<Duration> {
    if !enabled() {
        return None;
    }
    let usec = std::env::var("WATCHDOG_USEC").ok();
    let pid = std::env::var("WATCHDOG_PID").ok();
    watchdog_from(usec.as_deref(), pid.as_deref(), std::process::id())
}

/// `WATCHDOG=1`. A failure is logged once, not at every ping.
pub fn watchdog_ping() {
    static WARNED: AtomicBool = AtomicBool::new(false);
    let Some(target) = target() else { return };
    if let Err(e) = target.send("WATCHDOG=1") {
        if !WARNED.swap(true, Ordering::Relaxed) {
            tracing::warn!(socket = %target, error = %e, "cannot ping the systemd watchdog (later failures are not logged)");
        }
    }
}

fn send_logged(message: &str) {
    let Some(target) = target() else { return };
    if let Err(e) = target.send(message) {
        let what = message.lines().next().unwrap_or(message);
        tracing::warn!(socket = %target, error = %e, "cannot notify systemd of {what}");
    }
}

/// The interval from `$WATCHDOG_USEC` and `$WATCHDOG_PID` for process `me`.
fn watchdog_from(usec: Option<&str>, pid: Option<&str>, me: u32) -> Option<Duration> {
    if let Some(pid) = pid {
        if pid.trim().parse::<u32>().ok()? != me {
            return None; // meant for another process (the one that started us)
        }
    }
    let usec: u64 = usec?.trim().parse().ok().filter(|&u| u > 0)?;
    Some(Duration::from_micros(usec / 2))
}

/// A notification socket address.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    Path(std::path::PathBuf),
    /// The name after `@`, without the leading NUL.
    Abstract(Vec<u8>),
}

impl Target {
    /// `/path` or `@name`; anything else (a relative path, `vsock:` of newer systemd)
    /// is not supported and means "no manager".
    fn parse(value: &std::ffi::OsStr) -> Option<Self> {
        use std::os::unix::ffi::OsStrExt;
        let bytes = value.as_bytes();
        match bytes.first()? {
            b'/' => Some(Target::Path(value.into())),
            b'@' if bytes.len() > 1 => Some(Target::Abstract(bytes[1..].to_vec())),
            _ => None,
        }
    }

    /// Sends `message` as one datagram from a fresh unbound socket (no descriptor is
    /// held between notifications, and none leaks into a child: std sets CLOEXEC).
    #[cfg(target_os = "linux")]
    fn send(&self, message: &str) -> io::Result<()> {
        use std::os::linux::net::SocketAddrExt;
        use std::os::unix::net::{SocketAddr, UnixDatagram};
        let addr = match self {
            Target::Path(path) => SocketAddr::from_pathname(path)?,
            Target::Abstract(name) => SocketAddr::from_abstract_name(name)?,
        };
        let socket = UnixDatagram::unbound()?;
        socket.set_write_timeout(Some(SEND_TIMEOUT))?;
        let sent = socket.send_to_addr(message.as_bytes(), &addr)?;
        if sent != message.len() {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "notification truncated"));
        }
        Ok(())
    }

    #[cfg(not(target_os = "linux"))]
    fn send(&self, _message: &str) -> io::Result<()> {
        Err(io::ErrorKind::Unsupported.into())
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Path(p) => write!(f, "{}", p.display()),
            Target::Abstract(name) => write!(f, "@{}", String::from_utf8_lossy(name)),
        }
    }
}

/// `CLOCK_MONOTONIC` in microseconds (what systemd compares `MONOTONIC_USEC` with).
#[cfg(target_os = "linux")]
fn monotonic_usec() -> u64 {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    let secs = u64::try_from(now.tv_sec).unwrap_or(0);
    let micros = u64::try_from(now.tv_nsec).unwrap_or(0) / 1_000;
    secs.saturating_mul(1_000_000).saturating_add(micros)
}

#[cfg(not(target_os = "linux"))]
fn monotonic_usec() -> u64 {
    0
}

/// Whether standard error is connected to the journal: `$JOURNAL_STREAM` names its
/// device and inode (`DEV:INO`, set by systemd for `StandardError=journal`), and they
/// are those of file descriptor 2 — a child whose stderr was redirected inherits the
/// variable but not the stream.
pub fn stderr_is_journal() -> bool {
    let Some(value) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Some((dev, ino)) = value.to_str().and_then(parse_dev_ino) else {
        return false;
    };
    stderr_dev_ino() == Some((dev, ino))
}

fn parse_dev_ino(value: &str) -> Option<(u64, u64)> {
    let (dev, ino) = value.trim().split_once(':')?;
    Some((dev.parse().ok()?, ino.parse().ok()?))
}

/// The device and inode of file descriptor 2.
#[cfg(target_os = "linux")]
fn stderr_dev_ino() -> Option<(u64, u64)> {
    let stat = rustix::fs::fstat(std::io::stderr()).ok()?;
    #[allow(clippy::useless_conversion, clippy::unnecessary_cast)] // widths differ between libcs
    Some((stat.st_dev as u64, stat.st_ino as u64))
}

#[cfg(not(target_os = "linux"))]
fn stderr_dev_ino() -> Option<(u64, u64)> {
    None
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use std::ffi::OsStr;
    use std::os::unix::net::UnixDatagram;

    fn received(socket: &UnixDatagram) -> String {
        socket
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("read timeout");
        let mut buf = [0u8; 512];
        let n = socket.recv(&mut buf).expect("a notification within 5 s");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    #[test]
    fn addresses_parse_as_systemd_writes_them() {
        assert_eq!(
            Target::parse(OsStr::new("/run/systemd/notify")),
            Some(Target::Path("/run/systemd/notify".into()))
        );
        assert_eq!(
            Target::parse(OsStr::new("@/org/freedesktop/systemd1/notify/1")),
            Some(Target::Abstract(b"/org/freedesktop/systemd1/notify/1".to_vec()))
        );
        for unsupported in ["", "@", "relative/path", "vsock:2:1234"] {
            assert_eq!(Target::parse(OsStr::new(unsupported)), None, "{unsupported:?}");
        }
    }

    #[test]
    fn datagrams_reach_a_path_and_an_abstract_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let socket = UnixDatagram::bind(&path).unwrap();
        Target::Path(path).send("READY=1\nSTATUS=up").unwrap();
        assert_eq!(received(&socket), "READY=1\nSTATUS=up");

        use std::os::linux::net::SocketAddrExt;
        let name = format!("webship-notify-test-{}", std::process::id());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let socket = UnixDatagram::bind_addr(&addr).unwrap();
        Target::Abstract(name.into_bytes()).send("WATCHDOG=1").unwrap();
        assert_eq!(received(&socket), "WATCHDOG=1");
    }

    #[test]
    fn nobody_listening_is_an_error_not_a_hang() {
        let dir = tempfile::tempdir().unwrap();
        let err = Target::Path(dir.path().join("absent"))
            .send("READY=1")
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound, "{err}");
    }

    #[test]
    fn the_watchdog_is_half_the_interval_and_only_for_its_process() {
        assert_eq!(
            watchdog_from(Some("4000000"), None, 7),
            Some(Duration::from_secs(2))
        );
        assert_eq!(
            watchdog_from(Some("4000000"), Some("7"), 7),
            Some(Duration::from_secs(2))
        );
        assert_eq!(watchdog_from(Some("4000000"), Some("8"), 7), None);
        assert_eq!(watchdog_from(Some("4000000"), Some("x"), 7), None);
        assert_eq!(watchdog_from(Some("0"), None, 7), None);
        assert_eq!(watchdog_from(Some("soon"), None, 7), None);
        assert_eq!(watchdog_from(None, None, 7), None);
    }

    #[test]
    fn a_reload_says_when_it_started() {
        assert_eq!(
            reloading_message(12_345_678),
            "RELOADING=1\nMONOTONIC_USEC=12345678"
        );
    }

    #[test]
    fn monotonic_time_moves_forward_in_microseconds() {
        let a = monotonic_usec();
        std::thread::sleep(Duration::from_millis(2));
        let b = monotonic_usec();
        assert!(a > 0 && b >= a + 1_000, "{a} {b}");
    }

    #[test]
    fn journal_stream_must_name_stderr_itself() {
        assert_eq!(parse_dev_ino("64769:123456"), Some((64769, 123456)));
        assert_eq!(parse_dev_ino("64769"), None);
        assert_eq!(parse_dev_ino("a:b"), None);
        // The test's stderr matches its own identity, and nothing else.
        let (dev, ino) = stderr_dev_ino().unwrap();
        assert_eq!(parse_dev_ino(&format!("{dev}:{ino}")), Some((dev, ino)));
    }
}
