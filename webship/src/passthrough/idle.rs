//! When a passthrough connection has carried nothing for long enough, and how it
//! ended. The kernel keeps the clock: `TCP_INFO` says when each socket last
//! received and sent data, so one watcher serves every engine, including
//! `sockmap`, whose bytes the daemon never sees.
//!
//! The rule is nginx stream's `proxy_timeout` (HAProxy's `timeout tunnel`): no
//! data either way on either socket for the idle timeout closes both. Once a FIN
//! went either way the connection is half-closed and waits at most the shorter
//! half-close timeout (HAProxy's `timeout client-fin`), so a peer that never sends
//! its own FIN cannot hold the other half open.
//!
//! Keepalive and `TCP_USER_TIMEOUT` on both sockets find a peer that vanished
//! (a mobile client, a pulled cable) sooner than the idle timeout would.

use std::io;
use std::time::Duration;

use tokio::net::TcpStream;

use super::Counter;
use crate::sys;

/// Keepalive probes start after this long without traffic...
const KEEPALIVE_IDLE: Duration = Duration::from_secs(60);
/// ...are sent this often...
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// ...and this many unanswered ones end the connection (about two minutes).
const KEEPALIVE_PROBES: u32 = 6;

/// The timeouts of one passthrough connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Timeouts {
    /// No data either way for this long closes both sides.
    pub(crate) idle: Duration,
    /// The same, once either side has sent its FIN.
    pub(crate) half_closed: Duration,
    /// Data unacknowledged for this long ends the connection (`TCP_USER_TIMEOUT`).
    pub(crate) unacknowledged: Duration,
}

impl Timeouts {
    /// Keepalive and the user timeout on one socket of the pair (best effort: a
    /// refusal only loses the early detection; the idle timeout still applies).
    pub(super) fn arm(&self, sock: &TcpStream) {
        if let Err(e) = sys::set_dead_peer_detection(
            sock,
            KEEPALIVE_IDLE.min(self.idle),
            KEEPALIVE_INTERVAL,
            KEEPALIVE_PROBES,
            self.unacknowledged,
        ) {
            tracing::debug!(error = %e, "passthrough: no keepalive on a socket");
        }
    }
}

/// Completes once neither socket has received or sent data for the timeout that
/// applies. Never completes where `TCP_INFO` is unavailable (not Linux).
pub(super) async fn expired(client: &TcpStream, upstream: &TcpStream, timeouts: Timeouts) {
    // Bounded: each turn sleeps until the earliest moment the connection could be
    // idle (at most a quarter of the half-close timeout), so an active one costs
    // a few getsockopt calls per timeout.
    loop {
        let (a, b) = match (sys::tcp_activity(client), sys::tcp_activity(upstream)) {
            (Ok(a), Ok(b)) => (a, b),
            _ => return std::future::pending().await,
        };
        let quiet = [a.since_received, a.since_sent, b.since_received, b.since_sent]
            .into_iter()
            .min()
            .unwrap_or_default();
        let limit = if a.half_closed || b.half_closed {
            timeouts.half_closed
        } else {
            timeouts.idle
        };
        if quiet >= limit {
            return;
        }
        // A FIN may come while this sleeps and shorten the limit: look again at
        // least every quarter of the half-close timeout. The kernel's clock ticks
        // in jiffies: a few ms of margin saves a turn.
        let next = (limit - quiet).min(timeouts.half_closed / 4);
        tokio::time::sleep(next + Duration::from_millis(5)).await;
    }
}

/// How a forwarded connection ended, one counter each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum End {
    Clean,
    Reset,
    Idle,
    Stalled,
}

impl End {
    /// The end an engine's result means: a timeout is a peer that stopped
    /// acknowledging (`ETIMEDOUT` from keepalive or the user timeout, or the
    /// sockmap drain), any other error a reset.
    pub(super) fn of(result: &io::Result<()>) -> Self {
        match result {
            Ok(()) => Self::Clean,
            Err(e) if e.kind() == io::ErrorKind::TimedOut => Self::Stalled,
            Err(_) => Self::Reset,
        }
    }

    pub(super) fn counter(self) -> Counter {
        match self {
            Self::Clean => Counter::ClosedClean,
            Self::Reset => Counter::ClosedReset,
            Self::Idle => Counter::ClosedIdle,
            Self::Stalled => Counter::ClosedStalled,
        }
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    fn pair() -> (TcpStream, TcpStream) {
        let (a, b) = sys::loopback_pair().expect("a loopback pair");
        a.set_nonblocking(true).expect("non-blocking");
        b.set_nonblocking(true).expect("non-blocking");
        (
            TcpStream::from_std(a).expect("registered"),
            TcpStream::from_std(b).expect("registered"),
        )
    }

    #[tokio::test]
    async fn an_idle_pair_expires_and_traffic_postpones_it() {
        let (a, _a_peer) = pair();
        let (b, b_peer) = pair();
        let timeouts = Timeouts {
            idle: Duration::from_millis(300),
            half_closed: Duration::from_millis(300),
            unacknowledged: Duration::from_secs(5),
        };
        let start = std::time::Instant::now();
        // Traffic on one socket halfway through keeps the pair alive longer.
        let watch = expired(&a, &b, timeouts);
        let talk = async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            b_peer.try_write(b"x").expect("one byte fits");
        };
        tokio::join!(watch, talk);
        let took = start.elapsed();
        assert!(took >= Duration::from_millis(450), "expired after {took:?}");
        assert!(took < Duration::from_secs(3), "expired after {took:?}");
    }

    #[tokio::test]
    async fn arming_sets_keepalive_and_the_user_timeout() {
        let (a, _peer) = pair();
        let timeouts = Timeouts {
            idle: Duration::from_secs(30),
            half_closed: Duration::from_secs(30),
            unacknowledged: Duration::from_secs(7),
        };
        timeouts.arm(&a);
        let sock = socket2::SockRef::from(&a);
        assert!(sock.keepalive().expect("SO_KEEPALIVE"));
        assert_eq!(
            sock.keepalive_time().expect("TCP_KEEPIDLE"),
            Duration::from_secs(30)
        );
        assert_eq!(
            sock.tcp_user_timeout().expect("TCP_USER_TIMEOUT"),
            Some(Duration::from_secs(7))
        );
    }

    #[test]
    fn a_timeout_is_a_stall_and_other_errors_are_resets() {
        assert_eq!(End::of(&Ok(())), End::Clean);
        assert_eq!(End::of(&Err(io::ErrorKind::TimedOut.into())), End::Stalled);
        assert_eq!(
            End::of(&Err(io::Error::from_raw_os_error(libc::ETIMEDOUT))),
            End::Stalled
        );
        assert_eq!(End::of(&Err(io::ErrorKind::ConnectionReset.into())), End::Reset);
    }
}
