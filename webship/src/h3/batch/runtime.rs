//! The runtime quinn runs an endpoint's tasks on: tokio's, with each poll of a task
//! that sends on the endpoint's socket gathered ([`Batcher::gathering`]).
//!
//! [`Batcher::gathering`]: super::Batcher::gathering

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use quinn::{AsyncTimer, AsyncUdpSocket};

use crate::h3::generation::QuicSocket;

/// quinn's runtime for the endpoint on one socket: tokio's, except that each task
/// quinn spawns on it (the endpoint's driver and every connection's: quinn spawns
/// nothing else, and only they send) is polled inside [`gathering`] of the
/// socket's send queue. It holds the socket rather than the queue, which may be built
/// later (a failed build is tried again as connections arrive).
///
/// [`gathering`]: super::Batcher::gathering
#[derive(Debug)]
pub(crate) struct GatheringRuntime {
    socket: Arc<QuicSocket>,
}

impl GatheringRuntime {
    pub(crate) fn new(socket: Arc<QuicSocket>) -> Self {
        Self { socket }
    }
}

impl quinn::Runtime for GatheringRuntime {
    fn new_timer(&self, at: Instant) -> Pin<Box<dyn AsyncTimer>> {
        quinn::TokioRuntime.new_timer(at)
    }

    fn spawn(&self, future: Pin<Box<dyn Future<Output = ()> + Send>>) {
        tokio::spawn(GatheredTask {
            future,
            socket: self.socket.clone(),
        });
    }

    fn wrap_udp_socket(&self, socket: std::net::UdpSocket) -> io::Result<Arc<dyn AsyncUdpSocket>> {
        quinn::TokioRuntime.wrap_udp_socket(socket)
    }

    fn now(&self) -> Instant {
        quinn::TokioRuntime.now()
    }
}

/// A task quinn spawned, polled as [`GatheringRuntime`] says.
struct GatheredTask {
    future: Pin<Box<dyn Future<Output = ()> + Send>>,
    socket: Arc<QuicSocket>,
}

impl Future for GatheredTask {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        match this.socket.batcher() {
            Some(b) => b.gathering(|| this.future.as_mut().poll(cx)),
            None => this.future.as_mut().poll(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use quinn::Runtime as _;

    use super::*;
    use crate::h3::generation::GenerationKey;
    use crate::h3::routing::Group;

    /// A task spawned through the runtime runs inside a gathering poll of its
    /// socket's queue, and plainly (no queue) when the socket has none.
    #[tokio::test]
    async fn the_runtime_s_tasks_are_polled_gathering() {
        for with_queue in [true, false] {
            let group = Group::new(GenerationKey::random().unwrap(), 1, Arc::default());
            let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
            udp.set_nonblocking(true).unwrap();
            let socket = QuicSocket::new(udp, 0, group).unwrap();
            if with_queue {
                socket.use_send_queue(0).unwrap();
            }
            let (tx, rx) = tokio::sync::oneshot::channel();
            let seen = socket.clone();
            GatheringRuntime::new(socket).spawn(Box::pin(async move {
                let _ = tx.send(seen.batcher().map(|b| b.gathering_here()));
            }));
            let got = tokio::time::timeout(std::time::Duration::from_secs(5), rx)
                .await
                .expect("the task ran")
                .unwrap();
            assert_eq!(got, with_queue.then_some(true), "with a queue: {with_queue}");
        }
    }
}
