//! The bytes and messages of one socket's send queue, and the rule by which a
//! connection's consecutive GSO batches share one message (one UDP send).

use std::time::Instant;

use quinn::udp::Transmit;

use crate::h3::generation::GSO_BATCH_BYTES;
use crate::sys::udp::{Message, MAX_MESSAGES};

/// Payload bytes queued per socket, at most: about 18 full GSO sends at the default
/// MTU, small enough to stay in cache between the copy and the send.
pub(super) const QUEUE_BYTES: usize = 256 * 1024;
/// Datagrams one GSO send may carry: the kernel's `UDP_MAX_SEGMENTS` (64 until Linux
/// 6.11 raised it to 128).
const MAX_SEGMENTS: usize = 64;

#[derive(Debug, Default)]
pub(super) struct Queue {
    /// The queued datagrams' bytes, each message a range of them.
    pub(super) bytes: Vec<u8>,
    msgs: Vec<Message>,
    /// Messages already sent from the front of `msgs` (a partial `sendmmsg`).
    sent: usize,
    /// When the oldest queued transmit arrived.
    since: Option<Instant>,
}

impl Queue {
    pub(super) fn with_capacity() -> Self {
        Self {
            bytes: Vec::with_capacity(QUEUE_BYTES),
            msgs: Vec::with_capacity(MAX_MESSAGES),
            ..Self::default()
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.msgs.is_empty()
    }

    /// Whether `len` more bytes fit, as a message of their own.
    pub(super) fn fits(&self, len: usize) -> bool {
        self.msgs.len() < MAX_MESSAGES && self.bytes.len() + len <= QUEUE_BYTES
    }

    /// Whether the queue holds as many messages as one `sendmmsg` sends.
    pub(super) fn is_full(&self) -> bool {
        self.msgs.len() >= MAX_MESSAGES
    }

    /// When the oldest queued transmit arrived (`None`: nothing queued).
    pub(super) fn since(&self) -> Option<Instant> {
        self.since
    }

    /// Queues `t`: as many of its datagrams as [join](Queue::joining_bytes) the last
    /// message, the rest as a message of their own.
    pub(super) fn push(&mut self, t: &Transmit<'_>) {
        if self.is_empty() {
            self.since = Some(Instant::now());
        }
        let joining = self.joining_bytes(t);
        if joining > 0 {
            self.bytes.extend_from_slice(&t.contents[..joining]);
            let end = self.bytes.len();
            if let Some(last) = self.msgs.last_mut() {
                last.range.end = end;
            }
        }
        let rest = &t.contents[joining..];
        if rest.is_empty() {
            return;
        }
        let start = self.bytes.len();
        self.bytes.extend_from_slice(rest);
        self.msgs.push(Message {
            dest: t.destination,
            src_ip: t.src_ip,
            ecn: ecn_bits(t),
            segment_size: t.segment_size.and_then(|s| u16::try_from(s).ok()),
            range: start..self.bytes.len(),
        });
    }

    /// How many of `t`'s bytes continue the last queued message as more datagrams of
    /// one GSO send (0: none):
    ///
    /// * the message is unsent and [open](open_segment), to the same peer from the
    ///   same source with the same ECN codepoint (in practice one connection's path);
    /// * `t` is datagrams of the message's size (quinn batched it), or one datagram no
    ///   larger, which closes the message as its short last datagram;
    /// * as many whole datagrams as fit within one send.
    fn joining_bytes(&self, t: &Transmit<'_>) -> usize {
        let Some(last) = self.pending().last() else {
            return 0;
        };
        let Some(segment) = open_segment(last.segment_size.map(usize::from), last.range.len()) else {
            return 0;
        };
        if last.dest != t.destination || last.src_ip != t.src_ip || last.ecn != ecn_bits(t) {
            return 0;
        }
        let size = t.contents.len();
        let same_size = match t.segment_size.filter(|&s| s < size) {
            Some(s) => s == segment,
            None => size <= segment,
        };
        if !same_size {
            return 0;
        }
        let free = send_limit(segment) - last.range.len();
        if size <= free {
            size
        } else {
            free / segment * segment
        }
    }

    /// Whether the queue holds a message that can take nothing more: any but the last,
    /// or a last that is not [open](open_segment).
    pub(super) fn has_closed_message(&self) -> bool {
        let pending = self.pending();
        pending.len() > 1
            || pending
                .last()
                .is_some_and(|m| open_segment(m.segment_size.map(usize::from), m.range.len()).is_none())
    }

    /// The messages not yet sent.
    pub(super) fn pending(&self) -> &[Message] {
        &self.msgs[self.sent..]
    }

    /// `n` more messages were sent; all of them empties the queue.
    pub(super) fn advance(&mut self, n: usize) {
        self.sent += n;
        if self.sent >= self.msgs.len() {
            self.bytes.clear();
            self.msgs.clear();
            self.sent = 0;
            self.since = None;
        }
    }
}

/// Whether `t`, queued alone, would make a message that may take more datagrams.
pub(super) fn opens(t: &Transmit<'_>) -> bool {
    let len = t.contents.len();
    open_segment(t.segment_size.filter(|&s| s < len), len).is_some()
}

/// The segment size with which `len` bytes of `segment`-byte datagrams may take one
/// more in the same send: a GSO batch quinn made (a single datagram has no segment
/// size, so none starts a send: not with `h3_gso = "0"` or a device that refused
/// GSO, where quinn batches nothing, and not a path MTU probe, larger than the rest
/// and possibly refused by the path), every datagram full (only a send's last may be
/// short), and room for one more in one send.
fn open_segment(segment: Option<usize>, len: usize) -> Option<usize> {
    let segment = segment.filter(|&s| s > 0 && len.is_multiple_of(s))?;
    (len + segment <= send_limit(segment)).then_some(segment)
}

/// The most bytes one GSO send of `segment`-byte datagrams carries:
/// [`GSO_BATCH_BYTES`] and [`MAX_SEGMENTS`].
fn send_limit(segment: usize) -> usize {
    GSO_BATCH_BYTES.min(MAX_SEGMENTS * segment)
}

/// The two ECN bits `t` is to be sent with.
fn ecn_bits(t: &Transmit<'_>) -> u8 {
    t.ecn.map_or(0, |e| e as u8)
}

/// Transmits and queues as the tests here and in the batcher's build them.
#[cfg(test)]
pub(super) mod build {
    use std::net::SocketAddr;

    use quinn::udp::Transmit;

    use super::Queue;

    /// One datagram of `contents` to `dest`.
    pub(in crate::h3::batch) fn transmit(dest: SocketAddr, contents: &[u8]) -> Transmit<'_> {
        Transmit {
            destination: dest,
            ecn: None,
            contents,
            segment_size: None,
            src_ip: None,
        }
    }

    /// A GSO batch of `segment`-byte datagrams.
    pub(in crate::h3::batch) fn gso(dest: SocketAddr, contents: &[u8], segment: usize) -> Transmit<'_> {
        Transmit {
            segment_size: Some(segment),
            ..transmit(dest, contents)
        }
    }

    pub(in crate::h3::batch) fn queued(transmits: &[Transmit<'_>]) -> Queue {
        let mut q = Queue::default();
        for t in transmits {
            q.push(t);
        }
        q
    }

    /// Each queued message as (datagrams, bytes).
    pub(in crate::h3::batch) fn shapes(q: &Queue) -> Vec<(usize, usize)> {
        q.pending()
            .iter()
            .map(|m| (m.datagrams(), m.range.len()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use super::build::{gso, queued, shapes, transmit};
    use super::*;

    /// A connection's GSO batches (ten datagrams each, quinn's most) fill one send:
    /// up to 64 KB and 64 datagrams; a short last datagram closes it. At a jumbo size
    /// the parts `try_send` splits a batch into top each other up.
    #[test]
    fn a_connection_s_gso_batches_fill_one_send() {
        let a: SocketAddr = "127.0.0.1:4433".parse().unwrap();
        let ten = vec![1u8; 10 * 1452];
        let mut q = queued(&[gso(a, &ten, 1452), gso(a, &ten, 1452), transmit(a, &[2; 700])]);
        assert_eq!(shapes(&q), [(21, 20 * 1452 + 700)]);
        assert_eq!(q.pending()[0].segment_size, Some(1452));
        assert_eq!(q.bytes.len(), 20 * 1452 + 700, "one copy of each byte");
        assert!(q.has_closed_message(), "a short datagram left the send open");
        // The next batch starts another send.
        q.push(&gso(a, &ten, 1452));
        assert_eq!(shapes(&q), [(21, 20 * 1452 + 700), (10, 10 * 1452)]);
        // 65,487 bytes hold 45 datagrams of 1452, and a send holds 64 of 1000.
        let q = queued(&vec![gso(a, &ten, 1452); 5]);
        assert_eq!(shapes(&q), [(45, 45 * 1452), (5, 5 * 1452)]);
        let small = vec![3u8; 10 * 1000];
        let q = queued(&vec![gso(a, &small, 1000); 7]);
        assert_eq!(shapes(&q), [(64, 64_000), (6, 6000)]);
        // Ten jumbo datagrams leave `try_send` as parts of seven and three.
        let (seven, three) = (vec![4u8; 7 * 8972], vec![5u8; 3 * 8972]);
        let part = |c| gso(a, c, 8972);
        let q = queued(&[part(&seven), part(&three), part(&seven), part(&three)]);
        assert_eq!(shapes(&q), [(7, 7 * 8972), (7, 7 * 8972), (6, 6 * 8972)]);
        // One open message is not yet a closed one.
        assert!(!queued(&[gso(a, &ten, 1452)]).has_closed_message());
    }

    /// Only what quinn batched grows, and only with its own kind.
    #[test]
    fn what_may_not_share_a_send_stays_apart() {
        let (a, b): (SocketAddr, SocketAddr) =
            ("127.0.0.1:1".parse().unwrap(), "127.0.0.1:2".parse().unwrap());
        let (two, one) = (vec![1u8; 2400], vec![1u8; 1200]);
        let cases: [(&str, Vec<Transmit<'_>>); 8] = [
            // `h3_gso = "0"` (or a device without GSO): quinn sends single datagrams.
            ("single datagrams", vec![transmit(a, &one), transmit(a, &one)]),
            (
                "a probe after a batch",
                vec![gso(a, &two, 1200), transmit(a, &[0; 1500])],
            ),
            (
                "a batch after a probe",
                vec![transmit(a, &[0; 1500]), gso(a, &two, 1200)],
            ),
            ("another peer", vec![gso(a, &two, 1200), gso(b, &two, 1200)]),
            (
                "another source address",
                vec![
                    gso(a, &two, 1200),
                    Transmit {
                        src_ip: Some("127.0.0.2".parse().unwrap()),
                        ..gso(a, &two, 1200)
                    },
                ],
            ),
            (
                "another ECN codepoint",
                vec![
                    gso(a, &two, 1200),
                    Transmit {
                        ecn: Some(quinn::udp::EcnCodepoint::Ect0),
                        ..gso(a, &two, 1200)
                    },
                ],
            ),
            ("another size", vec![gso(a, &two, 1200), gso(a, &[0; 2600], 1300)]),
            (
                "after a short datagram",
                vec![gso(a, &[0; 2500], 1200), gso(a, &two, 1200)],
            ),
        ];
        for (case, transmits) in cases {
            let q = queued(&transmits);
            assert_eq!(q.pending().len(), 2, "{case}: {:?}", shapes(&q));
        }
    }
}
