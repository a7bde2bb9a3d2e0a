//! What the h3 unit tests share: QUIC packet headers around a connection ID, a
//! loopback UDP socket, a runtime for the sockets that need one.

use std::net::SocketAddr;

/// A short-header packet to `cid`, with a few bytes of payload.
pub(super) fn short(cid: &[u8]) -> Vec<u8> {
    [&[0x40][..], cid, &[1, 2, 3]].concat()
}

/// A long-header packet (version 1) to `cid`, with a few bytes of payload.
pub(super) fn long(cid: &[u8]) -> Vec<u8> {
    [&[0xc0, 0, 0, 0, 1, cid.len() as u8][..], cid, &[0, 1]].concat()
}

/// A non-blocking UDP socket on a free loopback port, and its address.
pub(super) fn loopback_udp() -> (std::net::UdpSocket, SocketAddr) {
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    udp.set_nonblocking(true).unwrap();
    let addr = udp.local_addr().unwrap();
    (udp, addr)
}

/// A current-thread runtime with I/O and timers (enter it before wrapping a socket).
pub(super) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}
