//! Per-connection congestion control policy for HTTP/3: CUBIC until the connection
//! carries a response that proves bulk, then BBR beside CUBIC — for that connection
//! only, and never with a smaller window than CUBIC alone would have. The initial
//! window is counted in datagrams, as TCP counts it in segments: when DPLPMTUD
//! confirms a larger datagram before the first loss, the window is at least that
//! many datagrams of the new size.
//!
//! quinn builds one controller per connection from a factory. Each accepted
//! connection gets its own factory holding a [`BulkSignal`]; the response path raises
//! the signal, and the controller starts BBR at its next send. Other connections keep
//! their own controllers and are never affected.

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
    /// `h3_initial_window_packets`.
    initial_window_packets: u16,
}

impl SwitchingFactory {
    pub(crate) fn new(signal: BulkSignal, initial_window_packets: u16) -> Self {
        Self {
            signal,
            initial_window_packets,
        }
    }
}

impl ControllerFactory for SwitchingFactory {
    /// CUBIC starts from `initial_window_packets` datagrams of the connection's
    /// starting size: quinn passes `TransportConfig::initial_mtu` here (1200, which
    /// Webship leaves as it is) for every new path, reset and migration, not the
    /// MTU DPLPMTUD found. quinn's own default is RFC 9002's ten (12,000 bytes); the
    /// setting's default, 32 (38,400 bytes), is the packet count quic-go (Caddy) and
    /// Chromium's QUIC start from: 1.5–2 round trips less of slow start before a
    /// 1 MiB response is out (docs/benchmarks.md, "The initial window").
    fn build(self: Arc<Self>, now: Instant, current_mtu: u16) -> Box<dyn Controller> {
        let initial = u64::from(self.initial_window_packets) * u64::from(current_mtu);
        let mut cubic = CubicConfig::default();
        cubic.initial_window(initial);
        Box::new(Switching {
            cubic: Arc::new(cubic).build(now, current_mtu),
            bbr: None,
            signal: self.signal.clone(),
            mtu: current_mtu,
            initial_window_packets: self.initial_window_packets,
            initial_window: Some(initial),
        })
    }
}

/// CUBIC, and after the switch BBR beside it, both fed every event; the connection
/// uses the larger window of the two.
///
/// Why not BBR alone: quinn's BBR (experimental upstream) sizes its window at twice
/// max-bandwidth × min-RTT, and quinn's pacer sends one window per *smoothed* RTT,
/// not at BBR's pacing rate. Where the smoothed RTT sits well above the minimum (a
/// receiver that acks late, a loaded host: loopback always), BBR alone paces below
/// the bandwidth it measured and each round measures less — 2x slower than CUBIC on
/// loopback (docs/benchmarks.md). Where loss is not congestion (a lossy long path),
/// CUBIC shrinks and BBR's window carries the connection, which is what the switch
/// is for. The larger window is never smaller than staying on CUBIC would give, and
/// CUBIC's state goes on untouched through the switch.
struct Switching {
    cubic: Box<dyn Controller>,
    bbr: Option<Box<dyn Controller>>,
    signal: BulkSignal,
    mtu: u16,
    /// `h3_initial_window_packets`.
    initial_window_packets: u16,
    /// The initial window recounted at the largest datagram size DPLPMTUD has
    /// confirmed (a probe of that size was acknowledged), which CUBIC's window is
    /// kept at or above; `None` from the first congestion event on. quinn's CUBIC
    /// counts bytes, so without it a connection that starts at 1200 bytes and finds
    /// 8972 keeps a window of 38 KB while TCP's ten segments on the same loopback
    /// are 640 KB: on loopback a 1 MiB response spent a third longer in slow start
    /// (docs/benchmarks.md, "The initial window, counted in datagrams"). The floor
    /// only follows sizes the path has carried, and a loss ends it for good.
    initial_window: Option<u64>,
}

impl Switching {
    fn maybe_switch(&mut self, now: Instant) {
        if self.bbr.is_some() || !self.signal.is_raised() {
            return;
        }
        // BBR starts from the window CUBIC reached (not from quinn's BBR default of
        // 200 packets), and from no less than RFC 9002's initial window at the
        // current datagram size. Not from `h3_initial_window_packets`: a CUBIC that
        // has just backed off after a loss would be lifted back to it.
        let mtu = u64::from(self.mtu);
        let rfc9002 = (10 * mtu).min(14_720.max(2 * mtu));
        let mut config = BbrConfig::default();
        config.initial_window(self.cubic_window().max(rfc9002));
        self.bbr = Some(Arc::new(config).build(now, self.mtu));
        super::stats::BBR_SWITCHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// CUBIC's window, held at the recounted initial window until the first loss.
    fn cubic_window(&self) -> u64 {
        self.cubic.window().max(self.initial_window.unwrap_or(0))
    }

    fn each(&mut self, mut f: impl FnMut(&mut dyn Controller)) {
        f(self.cubic.as_mut());
        if let Some(bbr) = self.bbr.as_mut() {
            f(bbr.as_mut());
        }
    }
}

impl Controller for Switching {
    fn on_sent(&mut self, now: Instant, bytes: u64, last_packet_number: u64) {
        self.maybe_switch(now);
        self.each(|c| c.on_sent(now, bytes, last_packet_number));
    }

    fn on_ack(&mut self, now: Instant, sent: Instant, bytes: u64, app_limited: bool, rtt: &RttEstimator) {
        self.each(|c| c.on_ack(now, sent, bytes, app_limited, rtt));
    }

    fn on_end_acks(&mut self, now: Instant, in_flight: u64, app_limited: bool, largest_acked: Option<u64>) {
        self.each(|c| c.on_end_acks(now, in_flight, app_limited, largest_acked));
    }

    fn on_congestion_event(&mut self, now: Instant, sent: Instant, persistent: bool, lost_bytes: u64) {
        self.initial_window = None;
        self.each(|c| c.on_congestion_event(now, sent, persistent, lost_bytes));
    }

    /// quinn calls this when a probe of a larger size is acknowledged, which raises
    /// the recounted initial window, and when black hole detection falls back to a
    /// smaller size, which ends it: the path no longer carries what it was counted in.
    fn on_mtu_update(&mut self, new_mtu: u16) {
        if new_mtu < self.mtu {
            self.initial_window = None;
        } else if let Some(initial) = self.initial_window.as_mut() {
            *initial = (*initial).max(u64::from(self.initial_window_packets) * u64::from(new_mtu));
        }
        self.mtu = new_mtu;
        self.each(|c| c.on_mtu_update(new_mtu));
    }

    fn window(&self) -> u64 {
        let cubic = self.cubic_window();
        self.bbr.as_ref().map_or(cubic, |bbr| bbr.window().max(cubic))
    }

    fn metrics(&self) -> ControllerMetrics {
        let mut metrics = self.cubic.metrics();
        metrics.congestion_window = self.window();
        if let Some(bbr) = &self.bbr {
            metrics.pacing_rate = bbr.metrics().pacing_rate;
        }
        metrics
    }

    fn clone_box(&self) -> Box<dyn Controller> {
        Box::new(Switching {
            cubic: self.cubic.clone_box(),
            bbr: self.bbr.as_ref().map(|b| b.clone_box()),
            signal: self.signal.clone(),
            mtu: self.mtu,
            initial_window_packets: self.initial_window_packets,
            initial_window: self.initial_window,
        })
    }

    fn initial_window(&self) -> u64 {
        self.cubic.initial_window()
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A connection's controller with an `initial_window_packets` window, built at
    /// quinn's starting size, and the signal that switches it.
    fn controller(initial_window_packets: u16, now: Instant) -> (BulkSignal, Box<dyn Controller>) {
        let signal = BulkSignal::default();
        let factory = SwitchingFactory::new(signal.clone(), initial_window_packets);
        (signal, Arc::new(factory).build(now, 1200))
    }

    fn switching(c: Box<dyn Controller>) -> Box<Switching> {
        c.into_any().downcast::<Switching>().unwrap()
    }

    #[test]
    fn switches_only_when_signalled() {
        let now = Instant::now();
        let (signal, mut c) = controller(10, now);
        c.on_sent(now, 1200, 1);
        assert!(switching(c.clone_box()).bbr.is_none());
        assert!(signal.raise());
        assert!(!signal.raise(), "only the first raise reports");
        c.on_sent(now, 1200, 2);
        let switched = switching(c);
        assert!(switched
            .bbr
            .unwrap()
            .into_any()
            .downcast::<quinn::congestion::Bbr>()
            .is_ok());
        assert!(switched
            .cubic
            .into_any()
            .downcast::<quinn::congestion::Cubic>()
            .is_ok());
    }

    /// `h3_initial_window_packets` datagrams of the starting size, before the switch
    /// and after it (BBR starts from CUBIC's window).
    #[test]
    fn a_connection_starts_from_the_configured_window() {
        let now = Instant::now();
        let (signal, mut c) = controller(32, now);
        assert_eq!((c.window(), c.initial_window()), (38_400, 38_400));
        let (_, ten) = controller(10, now);
        assert_eq!(ten.window(), 12_000, "quinn's and RFC 9002's ten");
        signal.raise();
        c.on_sent(now, 1200, 1);
        assert_eq!(c.window(), 38_400);
        assert!(switching(c).bbr.is_some());
    }

    /// A switch right after a loss starts BBR from the window CUBIC backed off to
    /// (or RFC 9002's initial window at the current size, if that is more), not
    /// from the configured initial window the loss just proved too much.
    #[test]
    fn a_switch_after_a_loss_does_not_restore_the_initial_window() {
        let now = Instant::now();
        let (signal, mut c) = controller(200, now);
        c.on_mtu_update(1452);
        for pn in 0..20 {
            c.on_sent(now, 1452, pn);
        }
        c.on_congestion_event(now, now, false, 1452);
        let backed_off = c.window();
        assert!(
            backed_off < 200 * 1200,
            "CUBIC must have backed off: {backed_off}"
        );
        signal.raise();
        c.on_sent(now, 1452, 20);
        let switched = switching(c);
        let bbr = switched.bbr.as_ref().unwrap().window();
        assert_eq!(bbr, backed_off.max(14_520), "RFC 9002's window at 1452 is 14,520");
    }

    /// When DPLPMTUD confirms a larger datagram before any loss, the window is at
    /// least the configured count of datagrams of that size (32 × 8972 on loopback),
    /// and a switch to BBR starts from it.
    #[test]
    fn the_initial_window_is_counted_in_confirmed_datagrams() {
        let now = Instant::now();
        let (signal, mut c) = controller(32, now);
        c.on_mtu_update(5086);
        assert_eq!(c.window(), 32 * 5086);
        c.on_mtu_update(8972);
        assert_eq!(c.window(), 32 * 8972);
        assert_eq!(c.metrics().congestion_window, 32 * 8972);
        signal.raise();
        c.on_sent(now, 8972, 1);
        let switched = switching(c);
        assert_eq!(switched.bbr.as_ref().unwrap().window(), 32 * 8972);
    }

    /// A congestion event ends the recount for the connection's life: the window is
    /// CUBIC's backed-off one, and a larger size confirmed afterwards does not lift it.
    #[test]
    fn a_loss_ends_the_recounted_initial_window() {
        let now = Instant::now();
        let (_, mut c) = controller(32, now);
        c.on_mtu_update(8972);
        for pn in 0..20 {
            c.on_sent(now, 8972, pn);
        }
        c.on_congestion_event(now, now, false, 8972);
        let backed_off = c.window();
        assert!(
            backed_off < 38_400,
            "CUBIC's own window, backed off: {backed_off}"
        );
        c.on_mtu_update(8972);
        assert_eq!(c.window(), backed_off);
    }

    /// Black hole detection falling back to a smaller size ends the recount too,
    /// whichever order quinn reports the size and the losses in.
    #[test]
    fn a_smaller_datagram_size_ends_the_recounted_initial_window() {
        let now = Instant::now();
        let (_, mut c) = controller(32, now);
        c.on_mtu_update(8972);
        c.on_mtu_update(1200);
        assert_eq!(c.window(), 38_400, "CUBIC's initial window in bytes");
        c.on_mtu_update(1452);
        assert_eq!(c.window(), 38_400);
    }

    #[test]
    fn connections_do_not_share_a_policy() {
        let now = Instant::now();
        let (a, mut ca) = controller(10, now);
        let (_, mut cb) = controller(10, now);
        a.raise();
        ca.on_sent(now, 1200, 1);
        cb.on_sent(now, 1200, 1);
        assert!(switching(cb).bbr.is_none());
        assert!(switching(ca).bbr.is_some());
    }

    /// The switch never leaves a connection with less window than CUBIC alone: a
    /// loss right after it shrinks CUBIC, and BBR, which does not treat one loss as
    /// congestion, keeps the window; CUBIC fed the same events ends lower.
    #[test]
    fn the_switch_never_shrinks_the_window_below_cubic() {
        let start = Instant::now();
        let (signal, mut c) = controller(10, start);
        let mut cubic = Arc::new(CubicConfig::default()).build(start, 1200);
        let before = c.window();
        signal.raise();
        let mut pn = 0;
        for step in 0..50u32 {
            let now = start + Duration::from_millis(step.into());
            for side in [&mut c, &mut cubic] {
                side.on_sent(now, 1200, pn);
            }
            pn += 1;
            if step % 10 == 5 {
                for side in [&mut c, &mut cubic] {
                    side.on_congestion_event(now, now, false, 1200);
                    side.on_end_acks(now, 1200, false, Some(pn - 1));
                }
            }
            assert!(
                c.window() >= cubic.window(),
                "step {step}: {} < CUBIC's {}",
                c.window(),
                cubic.window()
            );
        }
        assert!(cubic.window() < before, "the losses must have cut CUBIC");
        assert!(
            c.window() >= before,
            "BBR keeps the window CUBIC had at the switch"
        );
    }
}
