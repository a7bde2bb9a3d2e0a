//! The send queue's behaviour on real loopback sockets (and sends given as closures
//! where a full socket is needed).

use super::queue::build::{gso, queued, shapes, transmit};
use super::*;
use crate::sys::udp::MAX_MESSAGES;
use std::net::{SocketAddr, UdpSocket};

fn receiver() -> (UdpSocket, SocketAddr) {
    let s = UdpSocket::bind("127.0.0.1:0").unwrap();
    s.set_nonblocking(true).unwrap();
    let addr = s.local_addr().unwrap();
    (s, addr)
}

fn batcher(delay_us: u64) -> Arc<Batcher> {
    Batcher::new(UdpSocket::bind("127.0.0.1:0").unwrap(), delay_us).unwrap()
}

fn queue(b: &Batcher, dest: SocketAddr, contents: &[u8]) {
    b.send(&transmit(dest, contents), |_| {
        panic!("sent directly while batching")
    })
    .unwrap();
}

/// Everything `s` has received now, as numbers (each datagram a big-endian u32).
fn received(s: &UdpSocket) -> Vec<u32> {
    let mut got = Vec::new();
    let mut buf = [0u8; 64];
    while let Ok(n) = s.recv(&mut buf) {
        got.push(u32::from_be_bytes(buf[..n].try_into().unwrap()));
    }
    got
}

#[tokio::test]
async fn a_full_queue_leaves_at_once_in_order_per_destination() {
    let b = batcher(1000);
    let ((ra, a), (rb, bb)) = (receiver(), receiver());
    for i in 0..MAX_MESSAGES as u32 - 1 {
        queue(&b, if i % 2 == 0 { a } else { bb }, &i.to_be_bytes());
    }
    assert_eq!(b.queued.load(Ordering::Relaxed), MAX_MESSAGES - 1);
    assert!(received(&ra).is_empty(), "sent before the queue was full or due");
    // The transmit that fills the queue sends it, without waiting for the tick.
    queue(&b, bb, &(MAX_MESSAGES as u32 - 1).to_be_bytes());
    assert_eq!(b.queued.load(Ordering::Relaxed), 0);
    let evens: Vec<u32> = (0..MAX_MESSAGES as u32).step_by(2).collect();
    let odds: Vec<u32> = (1..MAX_MESSAGES as u32).step_by(2).collect();
    assert_eq!(received(&ra), evens);
    assert_eq!(received(&rb), odds);
}

/// Queue full and socket full: the next transmit is refused (quinn keeps it), the
/// drivers' poller waits, and once the task has sent the queue they may go on.
#[tokio::test]
async fn a_full_queue_on_a_full_socket_refuses_until_the_queue_has_left() {
    let b = batcher(1000);
    let (r, a) = receiver();
    let full = |_: &Queue, _| -> io::Result<usize> { Err(io::ErrorKind::WouldBlock.into()) };
    for i in 0..MAX_MESSAGES as u32 {
        b.send_with(&transmit(a, &i.to_be_bytes()), |_| panic!("direct"), full)
            .unwrap();
    }
    assert_eq!(b.queued.load(Ordering::Relaxed), MAX_MESSAGES);
    let refused = b
        .send_with(&transmit(a, &99u32.to_be_bytes()), |_| panic!("direct"), full)
        .unwrap_err();
    assert_eq!(refused.kind(), io::ErrorKind::WouldBlock);
    let mut poller = b.poller();
    let mut cx = Context::from_waker(std::task::Waker::noop());
    assert!(
        poller.poll_writable(&mut cx).is_pending(),
        "a refused driver must wait"
    );
    // The flushing task (the socket is really writable) sends the queue.
    tokio::time::timeout(
        Duration::from_secs(5),
        std::future::poll_fn(|cx| poller.poll_writable(cx)),
    )
    .await
    .expect("the poller was not woken when the queue left")
    .unwrap();
    assert_eq!(b.queued.load(Ordering::Relaxed), 0);
    assert_eq!(received(&r), (0..MAX_MESSAGES as u32).collect::<Vec<_>>());
}

#[tokio::test]
async fn the_byte_cap_is_respected() {
    let b = batcher(1000);
    let (_r, a) = receiver();
    let big = vec![7u8; 60_000];
    for round in 1..=9 {
        b.send(
            &Transmit {
                segment_size: Some(1200),
                ..transmit(a, &big)
            },
            |_| panic!("sent directly"),
        )
        .unwrap();
        let q = lock(&b.queue);
        assert!(
            q.bytes.len() <= QUEUE_BYTES,
            "round {round}: {} bytes queued",
            q.bytes.len()
        );
        // Four fit in 256 KiB; the fifth sends them first and starts a new batch.
        assert_eq!(q.pending().len(), (round - 1) % 4 + 1, "round {round}");
    }
}

#[tokio::test]
async fn a_small_queue_leaves_on_the_tick() {
    let b = batcher(1000);
    let (r, a) = receiver();
    for i in 0..3u32 {
        queue(&b, a, &i.to_be_bytes());
    }
    assert!(received(&r).is_empty(), "sent before the tick");
    assert_eq!(arrivals(&r, 3).await, [0, 1, 2]);
    assert_eq!(b.queued.load(Ordering::Relaxed), 0);
}

#[tokio::test]
async fn outside_a_poll_without_a_delay_sends_directly_and_a_dropped_socket_sends_its_queue() {
    let b = batcher(0);
    let (r, a) = receiver();
    let mut direct = 0;
    b.send(&transmit(a, &[0; 4]), |_| {
        direct += 1;
        Ok(())
    })
    .unwrap();
    assert_eq!(direct, 1);
    b.set_delay(1000);
    queue(&b, a, &5u32.to_be_bytes());
    // Turned off with a transmit queued: the next one queues behind it (order).
    b.set_delay(0);
    queue(&b, a, &6u32.to_be_bytes());
    drop(b);
    assert_eq!(received(&r), [5, 6]);
}

/// Inside a poll without a delay: a batch that may grow waits for the poll's end,
/// which sends it as one message whose datagrams arrive as quinn built them; what
/// cannot grow, with nothing queued, goes straight to the socket.
#[tokio::test]
async fn a_poll_s_batches_leave_as_one_send_at_its_end() {
    let b = batcher(0);
    let (r, a) = receiver();
    let numbers = |range: std::ops::Range<u32>| -> Vec<u8> { range.flat_map(u32::to_be_bytes).collect() };
    let (first, second) = (numbers(0..10), numbers(10..20));
    let mut direct = 0;
    b.gathering(|| {
        b.send(&transmit(a, &99u32.to_be_bytes()), |_| {
            direct += 1;
            Ok(())
        })
        .unwrap();
        for t in [
            gso(a, &first, 4),
            gso(a, &second, 4),
            transmit(a, &20u32.to_be_bytes()),
        ] {
            b.send(&t, |_| panic!("a batch that may grow was sent directly"))
                .unwrap();
        }
        let q = lock(&b.queue);
        assert_eq!(shapes(&q), [(21, 84)], "not one message before the poll's end");
    });
    assert_eq!(direct, 1, "a lone datagram waited");
    assert_eq!(
        b.queued.load(Ordering::Relaxed),
        0,
        "the poll's end left it queued"
    );
    assert_eq!(received(&r), (0..21).collect::<Vec<u32>>());
}

/// Runs `f` as inside a gathering poll of `b`, without the poll's end.
fn in_poll(b: &Batcher, f: impl FnOnce()) {
    let outer = GATHERING.replace(std::ptr::from_ref(b) as usize);
    f();
    GATHERING.set(outer);
}

/// What `r` receives within 5 s, once `n` datagrams are in (or the time is up).
async fn arrivals(r: &UdpSocket, n: usize) -> Vec<u32> {
    let start = Instant::now();
    let mut got = Vec::new();
    while got.len() < n && start.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(1)).await;
        got.extend(received(r));
    }
    got
}

/// Two datagrams (0 and 1) of 4 bytes in one GSO batch: one that may grow.
fn two() -> Vec<u8> {
    [0u32.to_be_bytes(), 1u32.to_be_bytes()].concat()
}

/// A poll's end that finds the socket full leaves the queue to the task, which
/// sends it once the socket is writable; polls ending meanwhile do not try again.
#[tokio::test]
async fn a_poll_end_on_a_full_socket_leaves_the_queue_to_the_task() {
    let b = batcher(0);
    let (r, a) = receiver();
    let both = two();
    in_poll(&b, || b.send(&gso(a, &both, 4), |_| panic!("direct")).unwrap());
    let full = |_: &Queue, _| -> io::Result<usize> { Err(io::ErrorKind::WouldBlock.into()) };
    b.send_after_poll_with(full);
    assert!(b.left_to_task.load(Ordering::Relaxed));
    b.send_after_poll_with(|_, _| panic!("tried again while the task waits"));
    assert_eq!(arrivals(&r, 2).await, [0, 1], "the task did not send the queue");
    assert!(!b.left_to_task.load(Ordering::Relaxed));
}

/// A batch queued while the queue is still marked as the task's (it has just sent
/// the queue and not yet cleared the mark) is not left behind: the poll's end
/// wakes the task. Failed before the fix: nothing sent it.
#[tokio::test]
async fn a_batch_queued_while_the_task_has_the_queue_is_not_left_behind() {
    let b = batcher(0);
    let (r, a) = receiver();
    let both = two();
    b.left_to_task.store(true, Ordering::Relaxed);
    in_poll(&b, || b.send(&gso(a, &both, 4), |_| panic!("direct")).unwrap());
    b.send_after_poll_with(|_, _| panic!("sent while the task has the queue"));
    assert_eq!(arrivals(&r, 2).await, [0, 1], "left queued");
}

/// A reload that sets a delay while a poll has queued without one: the poll's end
/// leaves the queue to the task, which sends it after the delay. Failed before the
/// fix: nothing sent it until the queue filled.
#[tokio::test]
async fn a_delay_set_during_a_poll_leaves_its_queue_to_the_task() {
    let b = batcher(0);
    let (r, a) = receiver();
    let both = two();
    in_poll(&b, || b.send(&gso(a, &both, 4), |_| panic!("direct")).unwrap());
    b.set_delay(1000);
    b.send_after_poll_with(|_, _| panic!("sent before the delay"));
    assert_eq!(arrivals(&r, 2).await, [0, 1], "left queued");
}

/// Inside a poll, a message that can take no more leaves at once, before the
/// poll's end: here a batch to another peer closes the first one.
#[tokio::test]
async fn a_closed_message_leaves_before_the_poll_s_end() {
    let b = batcher(0);
    let ((ra, a), (rb, bb)) = (receiver(), receiver());
    let both = two();
    b.gathering(|| {
        b.send(&gso(a, &both, 4), |_| panic!("direct")).unwrap();
        assert!(
            received(&ra).is_empty(),
            "an open message left before the poll's end"
        );
        b.send(&gso(bb, &both, 4), |_| panic!("direct")).unwrap();
        assert_eq!(b.queued.load(Ordering::Relaxed), 0, "a closed message waited");
    });
    assert_eq!(received(&ra), [0, 1]);
    assert_eq!(received(&rb), [0, 1]);
}

/// With a delay, a connection's batches join in the queue all the same, and the
/// poll's end leaves them to the task, which sends them after the delay.
#[tokio::test]
async fn with_a_delay_batches_join_and_wait_for_the_task() {
    let b = batcher(1000);
    let (r, a) = receiver();
    let (first, second) = (two(), [2u32.to_be_bytes(), 3u32.to_be_bytes()].concat());
    b.gathering(|| {
        for t in [gso(a, &first, 4), gso(a, &second, 4)] {
            b.send(&t, |_| panic!("direct")).unwrap();
        }
    });
    assert_eq!(shapes(&lock(&b.queue)), [(4, 16)], "sent at the poll's end");
    assert_eq!(arrivals(&r, 4).await, [0, 1, 2, 3]);
}

/// A socket full for a while and then taking the queue without signalling room (the
/// kernel signals only once its buffer is half empty): the task tries again on its
/// own and sends, dropping nothing. Fails with a wait for the signal alone
/// (`WRITABLE_RECHECK` at the timeout): the queue is dropped after a second.
#[tokio::test]
async fn a_full_socket_that_takes_the_queue_without_a_signal_gets_it() {
    // A delay far beyond the test: the task's own flush stays out of it.
    let b = batcher(60_000_000);
    let (r, a) = receiver();
    queue(&b, a, &7u32.to_be_bytes());
    let mut full = 5;
    let start = Instant::now();
    b.flush_when_writable_with(|q, tos| {
        if full > 0 {
            full -= 1;
            return Err(io::ErrorKind::WouldBlock.into());
        }
        b.sendmmsg(q, tos)
    })
    .await;
    assert!(
        start.elapsed() < WRITABLE_TIMEOUT,
        "waited for a signal that never came"
    );
    // Sent, not dropped (the counter is shared with the other tests).
    assert_eq!(arrivals(&r, 1).await, [7]);
}

/// A send that takes nothing is a full socket, not a reason to call again at once
/// (which would spin holding the queue's lock). Failed before the fix by never
/// returning.
#[tokio::test]
async fn a_send_that_takes_nothing_is_a_full_socket() {
    let b = batcher(1000);
    let (_r, a) = receiver();
    let (tx, rx) = std::sync::mpsc::channel();
    let worker = b.clone();
    std::thread::spawn(move || {
        let mut q = queued(&[transmit(a, b"x")]);
        let _ = tx.send(worker.flush_with(&mut q, |_, _| Ok(0)).map_err(|e| e.kind()));
    });
    let got = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("flush_with kept calling a send that took nothing");
    assert_eq!(got, Err(io::ErrorKind::WouldBlock));
}

/// As quinn-udp: `EMSGSIZE` (a path MTU probe) is skipped and not counted; the
/// first `EINVAL` sends the message again without ECN, for good; `EIO` on a GSO
/// message turns GSO off (one datagram per transmit) and drops that message.
#[tokio::test]
async fn refusals_are_handled_as_quinn_udp_does() {
    let b = batcher(1000);
    let (_r, a) = receiver();
    let gso = Transmit {
        segment_size: Some(2),
        ..transmit(a, b"gsogso")
    };
    let mut q = queued(&[
        transmit(a, b"probe"),
        transmit(a, b"ecn"),
        gso,
        transmit(a, b"last"),
    ]);
    let dropped = DROPPED.load(Ordering::Relaxed);
    let mut calls = Vec::new();
    let error = |code| Err(io::Error::from_raw_os_error(code));
    b.flush_with(&mut q, |q, tos| {
        let first = &q.bytes[q.pending()[0].range.clone()];
        calls.push((String::from_utf8_lossy(first).into_owned(), tos));
        match (first, tos) {
            (b"probe", _) => error(libc::EMSGSIZE),
            (b"ecn", true) => error(libc::EINVAL),
            (b"gsogso", _) => error(libc::EIO),
            _ => Ok(1),
        }
    })
    .unwrap();
    let want = [
        ("probe", true),
        ("ecn", true),
        ("ecn", false),
        ("gsogso", false),
        ("last", false),
    ];
    let want: Vec<(String, bool)> = want.iter().map(|&(m, t)| (m.to_owned(), t)).collect();
    assert_eq!(calls, want);
    assert!(b.gso_failed(), "GSO still on after the device refused it");
    assert_eq!(
        DROPPED.load(Ordering::Relaxed) - dropped,
        1,
        "only the GSO message is a drop"
    );
}
