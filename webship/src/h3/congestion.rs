//! Per-connection congestion control policy for HTTP/3: CUBIC until the connection
//! carries a response that proves bulk, then BBR beside CUBIC — for that connection
//! only, and never with a smaller window than CUBIC alone would have. The initial
//! window is counted in datagrams, as TCP counts it in segments: when DPLPMTUD
//! confirms a larger datagram before the first congestion event, CUBIC starts over
//! from that many datagrams of the new size.
//!
//! quinn builds one controller per connection from a factory. Each accepted
//! connection gets its own factory holding a [`BulkSignal`]; the response path raises
//! the signal, and the controller starts BBR at its next send. Other connections keep
//! their own controllers and are never affected.
//!
//! In CUBIC's slow start the window quinn reads is raised for its pacer's sake
//! only ([`super::pacing`]): slow start is paced at two windows per round trip, as
//! Linux paces TCP's, and what is in flight stays within the window in force.

use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use quinn::congestion::{BbrConfig, Controller, ControllerFactory, ControllerMetrics, CubicConfig};
use quinn_proto::RttEstimator;

use super::pacing::SlowStartPacing;

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
    /// Webship leaves as it is) for every new path and reset, not the MTU DPLPMTUD
    /// found (a NAT rebinding clones the controller instead: `clone_box`). quinn's
    /// own default is RFC 9002's ten (12,000 bytes); the setting's default, 32
    /// (38,400 bytes), is the packet count quic-go (Caddy) and Chromium's QUIC start
    /// from: 1.5–2 round trips less of slow start before a 1 MiB response is out
    /// (docs/benchmarks.md, "The initial window").
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
            recounting: true,
            pacing: SlowStartPacing::default(),
            now,
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
    /// Whether the initial window is still recounted: until the first congestion
    /// event (a lost packet other than a DPLPMTUD probe, or an ECN mark) or the
    /// first fall back to a smaller size, and never on a path cloned for a NAT
    /// rebinding, each larger size DPLPMTUD confirms (a probe of that size was
    /// acknowledged) starts CUBIC over from `initial_window_packets` datagrams of
    /// it, or from the window it reached if that is more. quinn's CUBIC counts bytes, so without it a
    /// connection that starts at 1200 bytes and finds 8972 keeps a window of 38 KB,
    /// where TCP's ten segments on the same loopback are 640 KB, and a lone 1 MiB
    /// response spent 0.25–0.55 ms longer in slow start (docs/benchmarks.md, "The
    /// initial window, counted in datagrams"). Only sizes the path has carried count.
    recounting: bool,
    /// What is in flight, for the window quinn's pacer reads in slow start.
    pacing: SlowStartPacing,
    /// The latest time quinn has passed in, for building a controller.
    now: Instant,
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
        config.initial_window(self.cubic.window().max(rfc9002));
        self.bbr = Some(Arc::new(config).build(now, self.mtu));
        super::stats::BBR_SWITCHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// CUBIC started over from the initial window recounted at `mtu`, or from the
    /// window it reached if that is more. Only the window (and the initial window
    /// CUBIC reports, which quinn reads from fresh controllers only) changes: before
    /// its first congestion event quinn's CUBIC holds nothing but its window and
    /// datagram size (no threshold, recovery or cubic state yet), and its `now` is
    /// unused; `a_loss_cuts_the_recounted_window_as_cubic_would` pins the outcome.
    fn recount(&mut self, mtu: u16) {
        let recounted = u64::from(self.initial_window_packets) * u64::from(mtu);
        let mut config = CubicConfig::default();
        config.initial_window(self.cubic.window().max(recounted));
        self.cubic = Arc::new(config).build(self.now, mtu);
    }

    /// The window in force: CUBIC's, or after the switch the larger of BBR's and
    /// CUBIC's.
    fn window_in_force(&self) -> u64 {
        let cubic = self.cubic.window();
        self.bbr.as_ref().map_or(cubic, |bbr| bbr.window().max(cubic))
    }

    /// Whether the window in force is CUBIC's, in slow start: below its threshold,
    /// which is `u64::MAX` until the first congestion event (quinn's CUBIC has no
    /// HyStart) and comes back after persistent congestion. After a switch BBR's
    /// window may be the larger one, and BBR (its startup included) is then left
    /// to quinn's pacer as it is.
    fn in_cubic_slow_start(&self) -> bool {
        let cubic = self.cubic.window();
        cubic == self.window_in_force()
            && self
                .cubic
                .metrics()
                .ssthresh
                .is_some_and(|threshold| cubic < threshold)
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
        self.now = now;
        self.maybe_switch(now);
        self.pacing.on_sent(bytes, last_packet_number, self.mtu);
        self.each(|c| c.on_sent(now, bytes, last_packet_number));
    }

    fn on_ack(&mut self, now: Instant, sent: Instant, bytes: u64, app_limited: bool, rtt: &RttEstimator) {
        self.now = now;
        self.each(|c| c.on_ack(now, sent, bytes, app_limited, rtt));
    }

    fn on_end_acks(&mut self, now: Instant, in_flight: u64, app_limited: bool, largest_acked: Option<u64>) {
        self.pacing.on_end_acks(in_flight);
        self.each(|c| c.on_end_acks(now, in_flight, app_limited, largest_acked));
    }

    fn on_congestion_event(&mut self, now: Instant, sent: Instant, persistent: bool, lost_bytes: u64) {
        self.recounting = false;
        self.now = now;
        self.each(|c| c.on_congestion_event(now, sent, persistent, lost_bytes));
    }

    /// quinn calls this when a probe of a larger size is acknowledged, which
    /// recounts the initial window while [`Switching::recounting`], and when black
    /// hole detection falls back to a smaller size, which ends the recounting (CUBIC
    /// keeps its window in bytes; quinn reports the losses that detected the black
    /// hole as a congestion event right after).
    fn on_mtu_update(&mut self, new_mtu: u16) {
        if new_mtu < self.mtu {
            self.recounting = false;
        } else if new_mtu > self.mtu && self.recounting {
            self.recount(new_mtu);
        }
        self.mtu = new_mtu;
        self.each(|c| c.on_mtu_update(new_mtu));
    }

    /// The window in force, raised in CUBIC's slow start for quinn's pacer as
    /// [`SlowStartPacing::reported_window`] says; quinn reads it for its pacer and
    /// for what may be in flight, and its connection statistics carry it
    /// (`metrics` has the window in force).
    fn window(&self) -> u64 {
        self.pacing
            .reported_window(self.window_in_force(), self.in_cubic_slow_start(), self.mtu)
    }

    fn metrics(&self) -> ControllerMetrics {
        let mut metrics = self.cubic.metrics();
        metrics.congestion_window = self.window_in_force();
        if let Some(bbr) = &self.bbr {
            metrics.pacing_rate = bbr.metrics().pacing_rate;
        }
        metrics
    }

    /// quinn clones the controller for a path a NAT rebinding moved the client to,
    /// with its DPLPMTUD state and any probe in flight on the old path, and holds
    /// back acknowledgements from the controller until the new path is validated.
    /// The clone keeps the window but recounts no further: a probe the old path
    /// carried proves nothing about the new one.
    fn clone_box(&self) -> Box<dyn Controller> {
        Box::new(Switching {
            cubic: self.cubic.clone_box(),
            bbr: self.bbr.as_ref().map(|b| b.clone_box()),
            signal: self.signal.clone(),
            mtu: self.mtu,
            initial_window_packets: self.initial_window_packets,
            recounting: false,
            pacing: self.pacing.clone(),
            now: self.now,
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

    /// The window in force, as `metrics` reports it (`window` is what quinn reads).
    fn in_force(c: &dyn Controller) -> u64 {
        c.metrics().congestion_window
    }

    fn switching(c: Box<dyn Controller>) -> Box<Switching> {
        c.into_any().downcast::<Switching>().unwrap()
    }

    /// Twenty datagrams of `size` sent, then a congestion event.
    fn lose_one(c: &mut dyn Controller, now: Instant, size: u16) {
        for pn in 0..20 {
            c.on_sent(now, size.into(), pn);
        }
        c.on_congestion_event(now, now, false, size.into());
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
        assert_eq!((in_force(c.as_ref()), c.initial_window()), (38_400, 38_400));
        let (_, ten) = controller(10, now);
        assert_eq!(in_force(ten.as_ref()), 12_000, "quinn's and RFC 9002's ten");
        signal.raise();
        c.on_sent(now, 1200, 1);
        assert_eq!(in_force(c.as_ref()), 38_400);
        assert!(switching(c).bbr.is_some());
    }

    /// In slow start quinn reads 1.6 windows, so its pacer (1.25 of what it reads
    /// per round trip) sends two windows per round trip, until what is in flight
    /// leaves no room under the true window for a transmit of ten datagrams; after
    /// a switch to BBR too, while CUBIC's window is in force. After a loss it reads
    /// the window as it is.
    #[test]
    fn slow_start_is_paced_at_two_windows_per_round_trip() {
        let now = Instant::now();
        let (signal, mut c) = controller(32, now);
        assert_eq!(in_force(c.as_ref()), 38_400);
        assert_eq!(c.window(), 61_440);
        c.on_sent(now, 26_400, 1);
        assert_eq!(
            c.window(),
            61_440,
            "26,400 in flight: ten 1200-byte datagrams fit"
        );
        c.on_sent(now, 1_200, 2);
        assert_eq!(c.window(), 38_400, "27,600 in flight: they do not");
        c.on_end_acks(now, 14_400, false, Some(2));
        assert_eq!(c.window(), 61_440, "quinn's own count replaces the estimate");

        let (_, mut lossy) = controller(32, now);
        lose_one(lossy.as_mut(), now, 1200);
        lossy.on_end_acks(now, 0, false, Some(19));
        assert_eq!(lossy.window(), in_force(lossy.as_ref()));
        assert!(lossy.window() < 38_400, "CUBIC backed off: {}", lossy.window());

        signal.raise();
        c.on_sent(now, 1_200, 3);
        c.on_end_acks(now, 0, false, Some(3));
        assert!(switching(c.clone_box()).bbr.is_some());
        assert_eq!(
            c.window(),
            in_force(c.as_ref()) * 8 / 5,
            "switched, CUBIC in slow start"
        );
        lose_one(c.as_mut(), now, 1200);
        c.on_end_acks(now, 0, false, Some(22));
        assert_eq!(c.window(), in_force(c.as_ref()), "switched, after a loss");
    }

    /// BBR's stand-in holding a fixed window.
    #[derive(Clone)]
    struct Fixed(u64);

    impl Controller for Fixed {
        fn on_congestion_event(&mut self, _: Instant, _: Instant, _: bool, _: u64) {}
        fn on_mtu_update(&mut self, _: u16) {}
        fn window(&self) -> u64 {
            self.0
        }
        fn clone_box(&self) -> Box<dyn Controller> {
            Box::new(self.clone())
        }
        fn initial_window(&self) -> u64 {
            self.0
        }
        fn into_any(self: Box<Self>) -> Box<dyn Any> {
            self
        }
    }

    /// After a switch, a larger window of BBR's is read as it is: the gain is for
    /// CUBIC's slow start only. Level with CUBIC's, CUBIC's slow start is in force.
    #[test]
    fn a_larger_bbr_window_is_read_as_it_is() {
        let now = Instant::now();
        let (_, c) = controller(32, now);
        let mut s = switching(c);
        s.bbr = Some(Box::new(Fixed(500_000)));
        assert_eq!(s.window(), 500_000);
        s.bbr = Some(Box::new(Fixed(38_400)));
        assert_eq!(s.window(), 61_440);
    }

    /// The headroom is ten datagrams of the size DPLPMTUD confirmed, and packet
    /// numbers quinn used without reporting a send count as datagrams of it.
    #[test]
    fn the_headroom_follows_the_datagram_size() {
        let now = Instant::now();
        let (_, mut c) = controller(32, now);
        c.on_mtu_update(1452);
        assert_eq!(in_force(c.as_ref()), 46_464, "32 × 1452, recounted");
        c.on_sent(now, 33_000, 7);
        assert_eq!(
            c.window(),
            46_464,
            "33,000 + 14,520 is over: ten 1452-byte datagrams"
        );

        let (_, mut c) = controller(32, now);
        c.on_mtu_update(1452);
        c.on_sent(now, 30_000, 7);
        assert_eq!(c.window(), 74_342, "30,000 + 14,520 fits: 1.6 × 46,464");
        c.on_sent(now, 100, 9);
        assert_eq!(
            c.window(),
            46_464,
            "packet 8 went unreported: two datagrams count"
        );
    }

    /// A switch right after a loss starts BBR from the window CUBIC backed off to
    /// (or RFC 9002's initial window at the current size, if that is more), not
    /// from the configured initial window the loss just proved too much.
    #[test]
    fn a_switch_after_a_loss_does_not_restore_the_initial_window() {
        let now = Instant::now();
        let (signal, mut c) = controller(200, now);
        c.on_mtu_update(1452);
        lose_one(c.as_mut(), now, 1452);
        let backed_off = in_force(c.as_ref());
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

    /// When DPLPMTUD confirms a larger datagram before any congestion event, CUBIC
    /// starts over from the configured count of datagrams of that size (32 × 8972
    /// on loopback), and a switch to BBR starts from that window.
    #[test]
    fn the_initial_window_is_counted_in_confirmed_datagrams() {
        let now = Instant::now();
        let (signal, mut c) = controller(32, now);
        c.on_mtu_update(5086);
        assert_eq!(in_force(c.as_ref()), 32 * 5086);
        c.on_mtu_update(8972);
        assert_eq!(in_force(c.as_ref()), 32 * 8972);
        assert_eq!(
            c.window(),
            32 * 8972 * 8 / 5,
            "quinn reads 1.6 of it in slow start"
        );
        signal.raise();
        c.on_sent(now, 8972, 1);
        let switched = switching(c);
        assert_eq!(switched.bbr.as_ref().unwrap().window(), 32 * 8972);
    }

    /// The recounted window is CUBIC's own: a loss cuts it as CUBIC cuts any window
    /// (to 0.7 of it), and ends the recounting, so a larger size confirmed after
    /// the loss leaves the window where the loss put it. (Being CUBIC's own, slow
    /// start adds to it as well; acknowledgements are not driven here, as only
    /// quinn can build the `RttEstimator` they take.)
    #[test]
    fn a_loss_cuts_the_recounted_window_as_cubic_would() {
        let now = Instant::now();
        let (_, mut c) = controller(32, now);
        c.on_mtu_update(5086);
        lose_one(c.as_mut(), now, 5086);
        let cut = in_force(c.as_ref());
        assert_eq!(cut, (32.0 * 5086.0 * 0.7) as u64, "CUBIC's beta of 0.7");
        c.on_mtu_update(8972);
        assert_eq!(in_force(c.as_ref()), cut);
    }

    /// Black hole detection falling back to a smaller size ends the recounting: a
    /// larger size confirmed later leaves the window as it was.
    #[test]
    fn a_smaller_datagram_size_ends_the_recounting() {
        let now = Instant::now();
        let (_, mut c) = controller(32, now);
        c.on_mtu_update(5086);
        c.on_mtu_update(1200);
        assert_eq!(in_force(c.as_ref()), 32 * 5086, "CUBIC keeps its window in bytes");
        c.on_mtu_update(8972);
        assert_eq!(in_force(c.as_ref()), 32 * 5086);
    }

    /// A controller cloned for a NAT rebinding keeps the window and recounts no
    /// further.
    #[test]
    fn a_cloned_controller_recounts_no_further() {
        let now = Instant::now();
        let (_, mut c) = controller(32, now);
        c.on_mtu_update(5086);
        let mut clone = c.clone_box();
        assert_eq!(in_force(clone.as_ref()), 32 * 5086);
        clone.on_mtu_update(8972);
        assert_eq!(in_force(clone.as_ref()), 32 * 5086);
        c.on_mtu_update(8972);
        assert_eq!(in_force(c.as_ref()), 32 * 8972, "the original still recounts");
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
        let before = in_force(c.as_ref());
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
                in_force(c.as_ref()) >= cubic.window(),
                "step {step}: {} < CUBIC's {}",
                in_force(c.as_ref()),
                cubic.window()
            );
        }
        assert!(cubic.window() < before, "the losses must have cut CUBIC");
        assert!(
            in_force(c.as_ref()) >= before,
            "BBR keeps the window CUBIC had at the switch"
        );
    }
}
