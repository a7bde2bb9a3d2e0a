//! Per-connection congestion control policy for HTTP/3: CUBIC until the connection
//! carries a response that proves bulk, then BBR — for that connection only.
//!
//! quinn builds one controller per connection from a factory. Each accepted
//! connection gets its own factory holding a [`BulkSignal`]; the response path raises
//! the signal, and the controller swaps its inner algorithm at its next send. Other
//! connections keep their own controllers and are never affected.

use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use quinn::congestion::{BbrConfig, Controller, ControllerFactory, ControllerMetrics, CubicConfig};
use quinn_proto::RttEstimator;

/// Raised once a connection's traffic is known to be bulk.
#[derive(Debug, Clone, Default)]
pub(crate) struct BulkSignal(Arc<AtomicBool>);

impl BulkSignal {
    /// Raises the signal; `true` only for the call that raised it.
    pub(crate) fn raise(&self) -> bool {
        !self.0.swap(true, Ordering::AcqRel)
    }

    pub(crate) fn is_raised(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// Builds the switching controller for one connection.
#[derive(Debug)]
pub(crate) struct SwitchingFactory {
    signal: BulkSignal,
}

impl SwitchingFactory {
    pub(crate) fn new(signal: BulkSignal) -> Self {
        Self { signal }
    }
}

impl ControllerFactory for SwitchingFactory {
    fn build(self: Arc<Self>, now: Instant, current_mtu: u16) -> Box<dyn Controller> {
        Box::new(Switching {
            active: Arc::new(CubicConfig::default()).build(now, current_mtu),
            signal: self.signal.clone(),
            on_bbr: false,
            mtu: current_mtu,
        })
    }
}

struct Switching {
    active: Box<dyn Controller>,
    signal: BulkSignal,
    on_bbr: bool,
    mtu: u16,
}

impl Switching {
    fn maybe_switch(&mut self, now: Instant) {
        if self.on_bbr || !self.signal.is_raised() {
            return;
        }
        // BBR starts from the window CUBIC reached, not from scratch, so the switch
        // itself never slows the transfer down.
        let mut config = BbrConfig::default();
        config.initial_window(self.active.window().max(self.active.initial_window()));
        self.active = Arc::new(config).build(now, self.mtu);
        self.on_bbr = true;
        super::stats::BBR_SWITCHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Controller for Switching {
    fn on_sent(&mut self, now: Instant, bytes: u64, last_packet_number: u64) {
        self.maybe_switch(now);
        self.active.on_sent(now, bytes, last_packet_number);
    }

    fn on_ack(&mut self, now: Instant, sent: Instant, bytes: u64, app_limited: bool, rtt: &RttEstimator) {
        self.active.on_ack(now, sent, bytes, app_limited, rtt);
    }

    fn on_end_acks(&mut self, now: Instant, in_flight: u64, app_limited: bool, largest_acked: Option<u64>) {
        self.active
            .on_end_acks(now, in_flight, app_limited, largest_acked);
    }

    fn on_congestion_event(&mut self, now: Instant, sent: Instant, persistent: bool, lost_bytes: u64) {
        self.active.on_congestion_event(now, sent, persistent, lost_bytes);
    }

    fn on_mtu_update(&mut self, new_mtu: u16) {
        self.mtu = new_mtu;
        self.active.on_mtu_update(new_mtu);
    }

    fn window(&self) -> u64 {
        self.active.window()
    }

    fn metrics(&self) -> ControllerMetrics {
        self.active.metrics()
    }

    fn clone_box(&self) -> Box<dyn Controller> {
        Box::new(Switching {
            active: self.active.clone_box(),
            signal: self.signal.clone(),
            on_bbr: self.on_bbr,
            mtu: self.mtu,
        })
    }

    fn initial_window(&self) -> u64 {
        self.active.initial_window()
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switches_only_when_signalled() {
        let signal = BulkSignal::default();
        let now = Instant::now();
        let mut c = Arc::new(SwitchingFactory::new(signal.clone())).build(now, 1200);
        c.on_sent(now, 1200, 1);
        let any = c.clone_box().into_any();
        assert!(!any.downcast::<Switching>().unwrap().on_bbr);
        assert!(signal.raise());
        assert!(!signal.raise(), "only the first raise reports");
        c.on_sent(now, 1200, 2);
        let switched = c.into_any().downcast::<Switching>().unwrap();
        assert!(switched.on_bbr);
        assert!(switched
            .active
            .into_any()
            .downcast::<quinn::congestion::Bbr>()
            .is_ok());
    }

    #[test]
    fn connections_do_not_share_a_policy() {
        let now = Instant::now();
        let (a, b) = (BulkSignal::default(), BulkSignal::default());
        let mut ca = Arc::new(SwitchingFactory::new(a.clone())).build(now, 1200);
        let mut cb = Arc::new(SwitchingFactory::new(b)).build(now, 1200);
        a.raise();
        ca.on_sent(now, 1200, 1);
        cb.on_sent(now, 1200, 1);
        let cb = cb.into_any().downcast::<Switching>().unwrap();
        assert!(cb
            .active
            .into_any()
            .downcast::<quinn::congestion::Cubic>()
            .is_ok());
        assert!(ca.into_any().downcast::<Switching>().unwrap().on_bbr);
    }
}
