//! QUIC transport figures for the metrics: quinn's statistics of each connection
//! and its congestion controller's window, read once when the connection ends (its
//! task returns or is dropped by the drain) and added to process-wide counters and
//! histograms. Nothing is measured per packet; a long connection shows in these
//! families only once it closes. One family is live: the HTTP/3 stream bytes by
//! how they reached quinn, which [`super::backend`] counts as it writes them.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::metrics::{Collector, Encoder, Kind, Values};

/// Counters summed over ended connections, indexed by [`Sum`].
static SUMS: [AtomicU64; SUM_COUNT] = [const { AtomicU64::new(0) }; SUM_COUNT];
/// Connections switched from CUBIC to BBR (counted at the switch).
pub(super) static BBR_SWITCHES: AtomicU64 = AtomicU64::new(0);
/// HTTP/3 stream bytes handed to quinn as the sender's own buffer (live, counted by
/// [`super::backend`] as it writes them).
pub(super) static STREAM_ZERO_COPY_BYTES: AtomicU64 = AtomicU64::new(0);
/// HTTP/3 stream bytes copied into quinn's send buffer (live, as above).
pub(super) static STREAM_COPIED_BYTES: AtomicU64 = AtomicU64::new(0);

/// Smoothed RTT at the end, in microseconds: loopback to intercontinental.
static RTT: Values = Values::new(
    &[
        100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000, 1_000_000,
        2_500_000,
    ],
    1e6,
);
/// Congestion window in force at the end, in bytes (the controller's, not the one
/// quinn's pacer reads).
static CWND: Values = Values::new(
    &[
        16_384,
        32_768,
        65_536,
        131_072,
        262_144,
        524_288,
        1_048_576,
        2_097_152,
        4_194_304,
        8_388_608,
        16_777_216,
        33_554_432,
        67_108_864,
        134_217_728,
    ],
    1.0,
);
/// The path MTU reached (DPLPMTUD), in bytes: QUIC's 1200-byte floor, common
/// tunnel and Ethernet sizes, jumbo frames, loopback.
static MTU: Values = Values::new(
    &[
        1200, 1280, 1350, 1400, 1452, 1472, 1500, 4000, 9000, 16_384, 65_527,
    ],
    1.0,
);
/// UDP datagrams per transmit quinn built over the connection's life (its GSO
/// batches; the socket may gather several into one send).
static GSO_BATCH: Values = Values::new(&[1, 2, 4, 8, 16, 32, 64], 1.0);

/// Indices into [`SUMS`].
#[derive(Clone, Copy)]
enum Sum {
    PacketsSent,
    PacketsLost,
    BytesLost,
    CongestionEvents,
    DatagramsSent,
    DatagramsReceived,
    UdpBytesSent,
    UdpBytesReceived,
    IosSent,
    IosReceived,
    ProbesSent,
    ProbesLost,
    BlackHoles,
}

/// How many [`Sum`]s there are: the last one's index plus one (a new variant goes
/// before `BlackHoles`, or this names the new last one).
const SUM_COUNT: usize = Sum::BlackHoles as usize + 1;

fn add(which: Sum, n: u64) {
    SUMS[which as usize].fetch_add(n, Ordering::Relaxed);
}

fn get(which: Sum) -> u64 {
    SUMS[which as usize].load(Ordering::Relaxed)
}

/// Reads a connection's statistics when it is dropped (however its task ends).
pub(super) struct OnEnd(pub(super) quinn::Connection);

impl Drop for OnEnd {
    fn drop(&mut self) {
        // quinn's own locks would panic again on a state a panic poisoned.
        if std::thread::panicking() {
            return;
        }
        // The window from the controller's metrics: quinn's statistics carry the
        // window quinn reads, which in slow start is raised for its pacer
        // (`h3::pacing`).
        let window = self.0.congestion_state().metrics().congestion_window;
        ended(&self.0.stats(), window);
    }
}

fn ended(s: &quinn::ConnectionStats, window: u64) {
    let p = &s.path;
    add(Sum::PacketsSent, p.sent_packets);
    add(Sum::PacketsLost, p.lost_packets);
    add(Sum::BytesLost, p.lost_bytes);
    add(Sum::CongestionEvents, p.congestion_events);
    add(Sum::DatagramsSent, s.udp_tx.datagrams);
    add(Sum::DatagramsReceived, s.udp_rx.datagrams);
    add(Sum::UdpBytesSent, s.udp_tx.bytes);
    add(Sum::UdpBytesReceived, s.udp_rx.bytes);
    add(Sum::IosSent, s.udp_tx.ios);
    add(Sum::IosReceived, s.udp_rx.ios);
    add(Sum::ProbesSent, p.sent_plpmtud_probes);
    add(Sum::ProbesLost, p.lost_plpmtud_probes);
    add(Sum::BlackHoles, p.black_holes_detected);
    RTT.observe(u64::try_from(p.rtt.as_micros()).unwrap_or(u64::MAX));
    CWND.observe(window);
    MTU.observe(u64::from(p.current_mtu));
    if s.udp_tx.ios > 0 {
        GSO_BATCH.observe(s.udp_tx.datagrams.div_ceil(s.udp_tx.ios));
    }
}

/// The QUIC figures as metric families, read at scrape time.
#[derive(Debug)]
pub(crate) struct Metrics;

impl Collector for Metrics {
    fn collect(&self, out: &mut Encoder) {
        out.family(
            "webship_quic_packets_sent",
            Kind::Counter,
            "QUIC packets sent by ended connections.",
        )
        .sample(&[], get(Sum::PacketsSent));
        out.family(
            "webship_quic_packets_lost",
            Kind::Counter,
            "QUIC packets declared lost by ended connections.",
        )
        .sample(&[], get(Sum::PacketsLost));
        out.family(
            "webship_quic_lost_bytes",
            Kind::Counter,
            "Bytes of QUIC packets declared lost by ended connections.",
        )
        .sample(&[], get(Sum::BytesLost));
        out.family(
            "webship_quic_congestion_events",
            Kind::Counter,
            "Congestion events (window reductions) of ended connections.",
        )
        .sample(&[], get(Sum::CongestionEvents));
        out.family(
            "webship_quic_udp_datagrams",
            Kind::Counter,
            "UDP datagrams of ended QUIC connections, by direction.",
        )
        .sample(&[("direction", "sent")], get(Sum::DatagramsSent))
        .sample(&[("direction", "received")], get(Sum::DatagramsReceived));
        out.family(
            "webship_quic_udp_bytes",
            Kind::Counter,
            "UDP payload bytes of ended QUIC connections, by direction.",
        )
        .sample(&[("direction", "sent")], get(Sum::UdpBytesSent))
        .sample(&[("direction", "received")], get(Sum::UdpBytesReceived));
        out.family(
            "webship_quic_udp_ios",
            Kind::Counter,
            "Received: socket calls that carried those datagrams (GRO batches); sent: transmits (GSO batches) quinn built, which the socket may gather into fewer calls. By direction.",
        )
        .sample(&[("direction", "sent")], get(Sum::IosSent))
        .sample(&[("direction", "received")], get(Sum::IosReceived));
        out.family(
            "webship_quic_mtu_probes",
            Kind::Counter,
            "DPLPMTUD probes of ended connections, by result.",
        )
        .sample(&[("result", "sent")], get(Sum::ProbesSent))
        .sample(&[("result", "lost")], get(Sum::ProbesLost));
        out.family(
            "webship_quic_mtu_black_holes",
            Kind::Counter,
            "Times an ended QUIC connection fell back to the 1200-byte minimum MTU after bursts of lost large packets (quinn's DPLPMTUD black-hole detection, which congestion or a peer's full receive buffer can set off too); a connection that lives on probes again after 60 s.",
        )
        .sample(&[], get(Sum::BlackHoles));
        out.family(
            "webship_quic_bbr_switches",
            Kind::Counter,
            "QUIC connections switched from CUBIC to BBR (a bulk response or a WebTransport session).",
        )
        .sample(&[], BBR_SWITCHES.load(Ordering::Relaxed));
        out.family(
            "webship_h3_stream_write_bytes",
            Kind::Counter,
            "Bytes written to HTTP/3 streams, by how they reached quinn: zero_copy (a response chunk's own buffer) or copied (DATA frame headers, header sections, control and QPACK streams, WebTransport, and chunks not offered: any under 16 KiB).",
        )
        .sample(&[("path", "zero_copy")], STREAM_ZERO_COPY_BYTES.load(Ordering::Relaxed))
        .sample(&[("path", "copied")], STREAM_COPIED_BYTES.load(Ordering::Relaxed));
        sockets(out);
        let histograms: [(&str, &str, &Values); 4] = [
            (
                "webship_quic_rtt_seconds",
                "Smoothed round-trip time of each QUIC connection when it ended.",
                &RTT,
            ),
            (
                "webship_quic_congestion_window_bytes",
                "Congestion window of each QUIC connection when it ended.",
                &CWND,
            ),
            (
                "webship_quic_path_mtu_bytes",
                "Path MTU each QUIC connection had reached when it ended.",
                &MTU,
            ),
            (
                "webship_quic_gso_batch_datagrams",
                "UDP datagrams per transmit (GSO batch) quinn built for each ended QUIC connection, rounded up; the socket may gather several into one send.",
                &GSO_BATCH,
            ),
        ];
        for (name, help, values) in histograms {
            out.family(name, Kind::Histogram, help);
            values.write(out, &[]);
        }
        super::batch::write_metrics(out);
    }
}

/// Per UDP socket of the HTTP/3 endpoints (`h3_sockets`), by index: datagrams read,
/// those that named another socket's connection (handed to it in-process), and
/// those dropped because that socket's inbox was full.
fn sockets(out: &mut Encoder) {
    use super::routing::SocketCounts;
    let counts = super::routing::socket_counts();
    let names: Vec<String> = (0..counts.len()).map(|i| i.to_string()).collect();
    type Family = (&'static str, &'static str, fn(&SocketCounts) -> u64);
    let families: [Family; 3] = [
        (
            "webship_quic_socket_received_datagrams",
            "UDP datagrams each HTTP/3 socket read, by socket index.",
            |c| c.received,
        ),
        (
            "webship_quic_socket_misrouted_datagrams",
            "Datagrams a socket read for a connection another socket's endpoint owns (handed to it), by the socket that read them.",
            |c| c.misrouted,
        ),
        (
            "webship_quic_socket_misrouted_dropped_datagrams",
            "Misrouted datagrams dropped because the owning socket's inbox was full, by the socket that read them.",
            |c| c.dropped,
        ),
    ];
    for (name, help, value) in families {
        out.family(name, Kind::Counter, help);
        for (count, socket) in counts.iter().zip(&names) {
            out.sample(&[("socket", socket.as_str())], value(count));
        }
    }
}
