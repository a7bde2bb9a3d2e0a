//! The shutdown request, as every long-running task sees it.
//!
//! A leaf: the supervisor holds the [`Trigger`], every connection, driver and session
//! a cloned [`Shutdown`]; nothing here knows who is listening.

use tokio::sync::watch;

/// A cloneable view of the shutdown request.
#[derive(Debug, Clone)]
pub(crate) struct Shutdown {
    rx: watch::Receiver<bool>,
}

/// The one handle that requests shutdown.
#[derive(Debug)]
pub(crate) struct Trigger {
    tx: watch::Sender<bool>,
}

/// A new, not yet requested, shutdown.
pub(crate) fn channel() -> (Trigger, Shutdown) {
    let (tx, rx) = watch::channel(false);
    (Trigger { tx }, Shutdown { rx })
}

impl Trigger {
    /// Requests shutdown; every [`Shutdown::requested`] completes.
    pub(crate) fn request(&self) {
        let _ = self.tx.send(true);
    }
}

impl Shutdown {
    pub(crate) fn is_requested(&self) -> bool {
        *self.rx.borrow()
    }

    /// Completes once shutdown is requested (or the trigger is gone).
    pub(crate) async fn requested(&mut self) {
        let _ = self.rx.wait_for(|requested| *requested).await;
    }
}
