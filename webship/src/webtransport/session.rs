//! What a session's loop does the same whichever transport carries it, written once
//! so that a fix lands in both: the clocks that end it (the idle limit, the drain a
//! shutdown starts), the admission of client streams and the task each one runs in,
//! the datagrams it takes, the capsules that end it, and what it sends when it ends.
//!
//! [`super::h3`] and [`super::h2`] keep only their wire: how streams, datagrams and
//! capsules reach the session, and how a capsule goes out on the CONNECT stream.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::OwnedSemaphorePermit;
use tokio::task::{JoinError, JoinSet};
use tokio::time::{Instant, Interval};

use super::{capsule, diag, Code, RecvHalf, SendHalf, SessionState, Transport, DRAIN_TIME};
use crate::shutdown::Shutdown;

/// How long the streams' work may take to end once the session has.
const SETTLE_TIME: Duration = Duration::from_secs(1);

/// The clocks a session runs by: once a second it checks the idle limit and, after a
/// shutdown asked it to drain, whether [`DRAIN_TIME`] is over.
#[derive(Debug)]
pub(crate) struct Clocks {
    idle: Interval,
    drain_deadline: Option<Instant>,
}

impl Clocks {
    pub(crate) fn new() -> Self {
        Self {
            idle: tokio::time::interval(Duration::from_secs(1)),
            drain_deadline: None,
        }
    }

    /// Resolves when the server starts shutting down and the session has not been
    /// asked to drain yet; the caller then sends the drain through [`Clocks::drain`].
    /// Until then it ends the session that has been idle too long, or that has run
    /// past its drain time. Cancel-safe: a `select!` branch.
    pub(crate) async fn drain_due(&mut self, state: &SessionState, shutdown: &mut Shutdown) {
        loop {
            tokio::select! {
                _ = self.idle.tick() => self.check(state),
                () = shutdown.requested(), if self.drain_deadline.is_none() => return,
            }
        }
    }

    /// Asks the client to wind down (`send` carries DRAIN_WEBTRANSPORT_SESSION its
    /// transport's way); what is still open [`DRAIN_TIME`] after it has gone closes.
    pub(crate) async fn drain(&mut self, send: impl Future<Output = ()>) {
        send.await;
        self.drain_deadline = Some(Instant::now() + DRAIN_TIME);
    }

    fn check(&self, state: &SessionState) {
        let limit = state.config().idle_timeout;
        if state.idle_for() >= limit {
            state.fail(Code::IdleTimeout, format!("no traffic for {} s", limit.as_secs()));
        }
        if self
            .drain_deadline
            .is_some_and(|deadline| Instant::now() >= deadline)
        {
            state.fail(Code::Shutdown, "the server is shutting down");
        }
    }
}

/// A client stream as its transport hands it over, split into its halves.
pub(crate) enum ClientStream {
    Bidi(Box<dyn RecvHalf>, Box<dyn SendHalf>),
    Uni(Box<dyn RecvHalf>),
}

/// A client stream's place among the session's `max_streams_per_session`, held until
/// its work is over.
#[derive(Debug)]
pub(crate) struct Slot {
    _permit: OwnedSemaphorePermit,
}

/// Hands what the client sends to the session's mode ([`diag`]): each admitted
/// stream runs in a task of its own, which yields `T` when its work is over.
pub(crate) struct Dispatch<T> {
    state: Arc<SessionState>,
    transport: Arc<dyn Transport>,
    tasks: JoinSet<T>,
}

impl<T: Send + 'static> Dispatch<T> {
    pub(crate) fn new(state: Arc<SessionState>, transport: Arc<dyn Transport>) -> Self {
        Self {
            state,
            transport,
            tasks: JoinSet::new(),
        }
    }

    /// A slot for one more client stream; `None` when the session has no room, which
    /// ends it (too many streams): the caller then turns the stream away its own way.
    pub(crate) fn admit(&self) -> Option<Slot> {
        let permit = self.state.stream_slot()?;
        Some(Slot { _permit: permit })
    }

    /// Runs an admitted client stream in the session's mode; its task gives the slot
    /// back and yields `done` when the work is over.
    pub(crate) fn serve(&mut self, slot: Slot, stream: ClientStream, done: T) {
        let (state, transport) = (self.state.clone(), self.transport.clone());
        self.tasks.spawn(async move {
            match stream {
                ClientStream::Bidi(recv, send) => diag::bidi(state, transport, recv, send).await,
                ClientStream::Uni(recv) => diag::uni(state, transport, recv).await,
            }
            drop(slot);
            done
        });
    }

    /// Other work of the session's streams (h2's send pumps), which the session's end
    /// waits for like theirs.
    pub(crate) fn spawn(&mut self, work: impl Future<Output = T> + Send + 'static) {
        self.tasks.spawn(work);
    }

    /// A received datagram: admitted against the session's limits, then answered.
    pub(crate) fn datagram(&self, payload: Bytes) {
        if self.state.datagram_in(payload.len()) {
            diag::datagram(&self.state, &*self.transport, payload);
        }
    }

    /// The next task to finish; `None` at once when none runs. Cancel-safe.
    pub(crate) async fn join_next(&mut self) -> Option<Result<T, JoinError>> {
        self.tasks.join_next().await
    }

    /// Streams reset themselves on the session's end: give them a moment to say so
    /// (what still runs after it is aborted when the dispatch drops).
    pub(crate) async fn settle(&mut self) {
        let _ = tokio::time::timeout(SETTLE_TIME, async {
            while self.tasks.join_next().await.is_some() {}
        })
        .await;
    }
}

/// The client's CLOSE_WEBTRANSPORT_SESSION ends the session as done, by the client,
/// so no close goes back.
pub(crate) fn closed_by_client(state: &SessionState, payload: &[u8]) {
    let reason = match capsule::parse_close(payload) {
        Ok((code, reason)) => format!("the client closed the session ({code}: {reason})"),
        Err(e) => e.to_string(),
    };
    state.end(Code::Done, reason, true);
}

/// A capsule the CONNECT stream's reader could not take ends the session: one over
/// the size limit with its own code, a malformed one as a protocol error.
pub(crate) fn capsule_failed(state: &SessionState, error: capsule::CapsuleError) {
    let code = match error {
        capsule::CapsuleError::TooLarge { .. } => Code::CapsuleTooLarge,
        _ => Code::Protocol,
    };
    state.fail(code, error.to_string());
}

/// The CLOSE_WEBTRANSPORT_SESSION that tells the client why we ended the session;
/// `None` while it runs, or when the client ended it.
pub(crate) fn close_capsule(state: &SessionState) -> Option<Bytes> {
    let end = state.ending().filter(|e| !e.by_client)?;
    Some(capsule::close_session(end.code as u32, &end.reason))
}
