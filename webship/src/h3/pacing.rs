//! CUBIC's slow start paced at two windows per round trip, as Linux paces TCP's.
//!
//! quinn's pacer spreads a connection's sends at 1.25 congestion windows per
//! smoothed RTT in every phase (a constant in quinn-proto's `connection/pacing.rs`),
//! and reads the window from the congestion controller, the same number that bounds
//! what may be in flight. In slow start the window doubles each round, so at 1.25
//! each round leaves later than the acknowledgements allow: on a 1 Gbit/s link a
//! lone 1 MiB response arrived up to half a round trip after quic-go's (Caddy's).
//! Linux paces TCP's slow start at 200 % of the window per RTT
//! (`tcp_pacing_ss_ratio`) for the same reason (docs/benchmarks.md, "Slow start
//! paced at two windows per round trip").
//!
//! quinn 0.11 has no pacing setting, so [`SlowStartPacing`] works through the
//! window the controller reports. In slow start (the caller says when) it reports
//! 1.6 × the window, so the pacer refills 1.25 × 1.6 = 2 windows per RTT, while
//! what is in flight leaves room under the true window for a whole transmit of
//! quinn's; from there on, the true window. quinn's own check (in flight plus the
//! next datagram against the reported window) then lets no more than the true
//! window out:
//!
//! - What is in flight is quinn's own figure, passed to every `on_end_acks`, plus
//!   what was sent since. quinn reports a transmit once, after building all of its
//!   datagrams (up to [`TRANSMIT_DATAGRAMS`]), so the headroom is a whole transmit
//!   of datagrams of the current size.
//! - A few sends reach the wire without a report: a transmit cut after its first
//!   datagram because the next application DATAGRAM does not fit its size, a
//!   PATH_RESPONSE to another address, and a PATH_CHALLENGE to the previous one
//!   (which quinn does not count in flight either). Each still takes a packet
//!   number, and each datagram after the handshake carries one packet of at most
//!   the current size, so a transmit counts as the larger of its bytes and one
//!   datagram of the current size per packet number since the last report. Only a
//!   run of nothing but such sends between two acknowledgements stays uncounted
//!   until the second: a WebTransport session sending datagrams of ever larger
//!   sizes can then have up to 1.6 windows in flight while in slow start.
//! - Apart from that the estimate only errs high, which falls back to the true
//!   window: acknowledgement-only datagrams count too, quinn skips packet numbers
//!   now and then, and losses, PTO and discarded handshake packets leave quinn's
//!   figure lower until the next acknowledgement brings it back.
//! - The one send it undercounts is a DPLPMTUD probe, which quinn sends outside its
//!   window check and reports with no transmit: until the next report it is not
//!   counted at all, then as one datagram of the current size. With a probe in
//!   flight (one at a time), the total may pass the window by that probe, the bound
//!   quinn's own check has when it probes while the window is full.
//!
//! With `h3_initial_window_packets = "10"` the first window is one transmit, which
//! leaves as one burst (quinn's pacer lets at least ten datagrams go at once).

/// quinn's pacer refills `QUINN_PACING.0 / QUINN_PACING.1` (1.25) of the window it
/// reads per smoothed RTT.
const QUINN_PACING: (u64, u64) = (5, 4);

/// Windows per RTT slow start is paced at (Linux's `tcp_pacing_ss_ratio`, 200 %):
/// the window reported is this ÷ 1.25 = 1.6 times the true one.
const SLOW_START_PACING: u64 = 2;

/// The most datagrams quinn builds into one transmit (`MAX_TRANSMIT_SEGMENTS` in
/// quinn's connection driver, which passes it to quinn-proto's `poll_transmit`):
/// quinn learns what one transmit sent only when it is built.
const TRANSMIT_DATAGRAMS: u64 = 10;

/// What one connection has in flight, as far as its congestion controller sees
/// it, and the window it reports to quinn from that.
#[derive(Debug, Clone, Default)]
pub(crate) struct SlowStartPacing {
    /// quinn's bytes in flight at its latest acknowledgement, plus what was sent
    /// since (an over-estimate but for a DPLPMTUD probe's excess).
    in_flight: u64,
    /// The packet number of the last packet quinn reported sending.
    last_packet: Option<u64>,
}

impl SlowStartPacing {
    /// quinn sent one transmit of `bytes` (all its datagrams together), the last
    /// of its packets numbered `last_packet`, while datagrams were at most `mtu`.
    pub(crate) fn on_sent(&mut self, bytes: u64, last_packet: u64, mtu: u16) {
        let numbered = match self.last_packet {
            Some(previous) if last_packet > previous => {
                (last_packet - previous).saturating_mul(u64::from(mtu))
            }
            _ => 0,
        };
        self.last_packet = Some(last_packet);
        self.in_flight = self.in_flight.saturating_add(bytes.max(numbered));
    }

    /// quinn's own count, after a batch of acknowledgements.
    pub(crate) fn on_end_acks(&mut self, in_flight: u64) {
        self.in_flight = in_flight;
    }

    /// The window to report to quinn for `true_window`: 1.6 × it in slow start
    /// while a whole transmit of `mtu`-byte datagrams still fits under it, else
    /// `true_window`.
    pub(crate) fn reported_window(&self, true_window: u64, slow_start: bool, mtu: u16) -> u64 {
        let transmit = TRANSMIT_DATAGRAMS * u64::from(mtu);
        if !slow_start || self.in_flight.saturating_add(transmit) > true_window {
            return true_window;
        }
        // true_window × 8 / 5 without overflow, and never less than true_window.
        let (num, den) = (SLOW_START_PACING * QUINN_PACING.1, QUINN_PACING.0);
        true_window.saturating_add(true_window.saturating_mul(num - den) / den)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slow_start_reports_the_gain_while_a_transmit_fits() {
        let mut p = SlowStartPacing::default();
        assert_eq!(p.reported_window(100_000, true, 1_200), 160_000);
        p.on_sent(88_000, 80, 1_200);
        assert_eq!(
            p.reported_window(100_000, true, 1_200),
            160_000,
            "88,000 + 12,000 fits"
        );
        p.on_sent(1, 81, 1_200);
        assert_eq!(
            p.reported_window(100_000, true, 1_200),
            100_000,
            "one byte more does not"
        );
    }

    /// Acknowledgements replace the estimate with quinn's own count, so what the
    /// sends added (acknowledgement-only datagrams too) does not pile up.
    #[test]
    fn acknowledgements_reset_the_estimate() {
        let mut p = SlowStartPacing::default();
        p.on_sent(500_000, 400, 1_452);
        assert_eq!(p.reported_window(100_000, true, 1_452), 100_000);
        p.on_end_acks(20_000);
        assert_eq!(p.reported_window(100_000, true, 1_452), 160_000);
        p.on_end_acks(90_000);
        assert_eq!(
            p.reported_window(100_000, true, 1_452),
            100_000,
            "no room for ten datagrams"
        );
    }

    /// Packets quinn sent without a report (a cut GSO batch, an off-path
    /// PATH_RESPONSE) count as a datagram of the current size each, from the gap
    /// in packet numbers.
    #[test]
    fn unreported_packets_count_from_the_packet_numbers() {
        let mut p = SlowStartPacing::default();
        p.on_sent(1_200, 10, 1_200);
        p.on_sent(1_200, 21, 1_200);
        assert_eq!(
            p.in_flight,
            1_200 + 11 * 1_200,
            "ten unreported packets and this one"
        );
        p.on_sent(6_000, 22, 1_200);
        assert_eq!(p.in_flight, 14_400 + 6_000, "the bytes, when they are more");
        p.on_sent(1_200, 3, 1_200);
        assert_eq!(
            p.in_flight, 21_600,
            "another packet number space counts its bytes"
        );
    }

    #[test]
    fn outside_slow_start_the_window_is_reported_as_it_is() {
        let p = SlowStartPacing::default();
        assert_eq!(p.reported_window(100_000, false, 1_200), 100_000);
    }

    /// The gain saturates: it never reports less than the true window.
    #[test]
    fn huge_windows_saturate() {
        let p = SlowStartPacing::default();
        assert_eq!(p.reported_window(u64::MAX, true, 1_200), u64::MAX);
        assert!(p.reported_window(u64::MAX / 2, true, 1_200) > u64::MAX / 2);
        assert_eq!(
            p.reported_window(u64::MAX / 8, true, 1_200),
            u64::MAX / 8 + u64::MAX / 8 * 3 / 5
        );
    }
}
