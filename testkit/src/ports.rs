//! Loopback ports for servers under test.

use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::time::Duration;

use anyhow::{bail, Context, Result};

/// A loopback port free for both TCP and UDP a moment ago (webship serves h3 on
/// the same port over UDP, and client QUIC sockets take ephemeral UDP ports).
/// The server binds it right after; [`crate::process::start_on_free_port`]
/// retries when someone else took it in between.
pub fn free_port() -> Result<u16> {
    for _ in 0..100 {
        let tcp = TcpListener::bind("127.0.0.1:0").context("binding a loopback TCP port")?;
        let port = tcp.local_addr().context("reading a bound port")?.port();
        if UdpSocket::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    bail!("no port free for both TCP and UDP after 100 tries")
}

/// A loopback TCP port that refuses connections for as long as the returned socket
/// lives: bound, never listening. Unlike a port that was free a moment ago, no
/// parallel test's server can take it in between and answer for it.
pub fn refused_port() -> Result<(socket2::Socket, u16)> {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
        .context("creating a TCP socket")?;
    socket
        .bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
        .context("binding a loopback TCP port")?;
    let port = socket
        .local_addr()
        .ok()
        .and_then(|a| a.as_socket())
        .context("reading a bound port")?
        .port();
    Ok((socket, port))
}

/// Whether something accepts TCP connections on the loopback port.
pub fn listening(port: u16) -> bool {
    TcpStream::connect_timeout(
        &SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_millis(200),
    )
    .is_ok()
}
