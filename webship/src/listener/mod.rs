//! TCP listening sockets and per-connection socket setup.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::{TcpListener, TcpStream};

use crate::sys;

/// Pending connections the kernel queues while every worker is busy.
const BACKLOG: i32 = 4096;

/// Binds `addr` with `SO_REUSEADDR`, so a restart does not wait out TIME_WAIT.
pub(crate) fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    if addr.is_ipv6() {
        // `[::]` accepts IPv4 too, as operators expect from a wildcard.
        socket.set_only_v6(false)?;
    }
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(BACKLOG)?;
    TcpListener::from_std(socket.into())
}

/// Accepted connections switched to BBR, and those the kernel refused it.
static BBR: [AtomicU64; 2] = [AtomicU64::new(0), AtomicU64::new(0)];

/// Per-connection socket options: no Nagle (responses are written whole, and corked
/// where batching pays), and BBR when preflight found it.
pub(crate) fn configure(tcp: &TcpStream, bbr: bool) {
    if let Err(e) = tcp.set_nodelay(true) {
        tracing::debug!(error = %e, "TCP_NODELAY");
    }
    if bbr {
        let set = sys::set_congestion(tcp, "bbr");
        BBR[usize::from(set.is_err())].fetch_add(1, Ordering::Relaxed);
        if let Err(e) = set {
            tracing::debug!(error = %e, "TCP_CONGESTION=bbr");
        }
    }
}

/// The TCP congestion control switches as a metric family, read at scrape time.
#[derive(Debug)]
pub(crate) struct Metrics;

impl crate::metrics::Collector for Metrics {
    fn collect(&self, out: &mut crate::metrics::Encoder) {
        out.family(
            "webship_tcp_bbr_switches",
            crate::metrics::Kind::Counter,
            "Accepted TCP connections switched to BBR (TCP_CONGESTION), by result.",
        )
        .sample(&[("result", "set")], BBR[0].load(Ordering::Relaxed))
        .sample(&[("result", "failed")], BBR[1].load(Ordering::Relaxed));
    }
}
