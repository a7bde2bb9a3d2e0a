//! Slow start paced at two windows per round trip, as Linux paces TCP's.
//!
//! quinn's pacer spreads a connection's sends at 1.25 congestion windows per
//! smoothed RTT in every phase (a constant in quinn-proto's `pacing.rs`), and reads
//! the window from the congestion controller, the same number that bounds what may
//! be in flight. In slow start the window doubles each round, so at 1.25 each round
//! leaves later than the acknowledgements allow: on a 1 Gbit/s link a lone 1 MiB
//! response arrived up to half a round trip after quic-go's (Caddy's). Linux paces
//! TCP's slow start at 200 % of the window per RTT (`tcp_pacing_ss_ratio`) for the
//! same reason (docs/benchmarks.md, "Slow start paced at two windows per round
//! trip").
//!
//! quinn 0.11 has no pacing setting, so [`SlowStartPacing`] works through the
//! window the controller reports. In slow start (the caller says when) it reports
//! [`GAIN`] × the window, so the pacer refills 1.25 × 1.6 = 2 windows per RTT,
//! while what is in flight leaves room under the true window for a whole transmit
//! of quinn's; from there on, the true window. quinn's own check (in flight plus
//! the next datagram against the reported window) then lets no more than the true
//! window out:
//!
//! - What is in flight is quinn's own figure, passed to every `on_end_acks`, plus
//!   every byte sent since. quinn reports a transmit once, after building all of
//!   its datagrams (up to [`TRANSMIT_DATAGRAMS`]), so the headroom is a whole
//!   transmit of datagrams of the current size.
//! - Otherwise the estimate errs on the high side, which only falls back to the
//!   true window: sends count acknowledgement-only datagrams too, and losses, PTO
//!   and discarded handshake packets leave quinn's figure lower until the next
//!   acknowledgement brings it back.
//! - The one send it misses is a DPLPMTUD probe: quinn sends probes outside its
//!   window check and does not report them to the controller. With a probe in
//!   flight (one at a time), the total may pass the window by that probe, the same
//!   bound quinn's own check has when it probes while the window is full.

/// The factor on the reported window in slow start: quinn's pacer refills 1.25
/// reported windows per smoothed RTT, so 1.6 gives Linux's 2 windows per RTT.
const GAIN: (u64, u64) = (8, 5);

/// The most datagrams quinn builds into one transmit (`MAX_TRANSMIT_SEGMENTS` in
/// quinn's connection driver, which passes it to quinn-proto's `poll_transmit`):
/// quinn learns what one transmit sent only when it is built.
const TRANSMIT_DATAGRAMS: u64 = 10;

/// What one connection has in flight, as far as its congestion controller sees
/// it, and the window it reports to quinn from that.
#[derive(Debug, Clone, Default)]
pub(crate) struct SlowStartPacing {
    /// quinn's bytes in flight at its latest acknowledgement, plus every byte sent
    /// since (an over-estimate, never an under-estimate).
    in_flight: u64,
}

impl SlowStartPacing {
    /// quinn sent one transmit of `bytes` (all its datagrams together).
    pub(crate) fn on_sent(&mut self, bytes: u64) {
        self.in_flight = self.in_flight.saturating_add(bytes);
    }

    /// quinn's own count, after a batch of acknowledgements.
    pub(crate) fn on_end_acks(&mut self, in_flight: u64) {
        self.in_flight = in_flight;
    }

    /// The window to report to quinn for a true `window`: [`GAIN`] × it in slow
    /// start while a whole transmit of `mtu`-byte datagrams still fits under it,
    /// else `window`.
    pub(crate) fn window(&self, window: u64, slow_start: bool, mtu: u16) -> u64 {
        let transmit = TRANSMIT_DATAGRAMS * u64::from(mtu);
        if slow_start && self.in_flight.saturating_add(transmit) <= window {
            // window × 8 / 5 without overflow: never less than the window.
            window.saturating_add(window.saturating_mul(GAIN.0 - GAIN.1) / GAIN.1)
        } else {
            window
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slow_start_reports_the_gain_while_a_transmit_fits() {
        let mut p = SlowStartPacing::default();
        assert_eq!(p.window(100_000, true, 1_200), 160_000);
        p.on_sent(88_000);
        assert_eq!(p.window(100_000, true, 1_200), 160_000, "88,000 + 12,000 fits");
        p.on_sent(1);
        assert_eq!(p.window(100_000, true, 1_200), 100_000, "one byte more does not");
    }

    /// Acknowledgements replace the estimate with quinn's own count, so what the
    /// sends added (acknowledgement-only datagrams too) does not pile up.
    #[test]
    fn acknowledgements_reset_the_estimate() {
        let mut p = SlowStartPacing::default();
        p.on_sent(500_000);
        assert_eq!(p.window(100_000, true, 1_452), 100_000);
        p.on_end_acks(20_000);
        assert_eq!(p.window(100_000, true, 1_452), 160_000);
        p.on_end_acks(90_000);
        assert_eq!(
            p.window(100_000, true, 1_452),
            100_000,
            "no room for ten datagrams"
        );
    }

    #[test]
    fn outside_slow_start_the_window_is_reported_as_it_is() {
        let p = SlowStartPacing::default();
        assert_eq!(p.window(100_000, false, 1_200), 100_000);
    }

    /// The gain saturates: it never reports less than the true window.
    #[test]
    fn huge_windows_saturate() {
        let p = SlowStartPacing::default();
        assert_eq!(p.window(u64::MAX, true, 1_200), u64::MAX);
        assert!(p.window(u64::MAX / 2, true, 1_200) > u64::MAX / 2);
        assert_eq!(
            p.window(u64::MAX / 8, true, 1_200),
            u64::MAX / 8 + u64::MAX / 8 * 3 / 5
        );
    }
}
