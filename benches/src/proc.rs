//! CPU accounting from /proc: server processes by pid, clients as waited-for
//! children; the stat and status readers are the test kit's.

use std::fs;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use webship_testkit::proc::{descendants, parse_stat, read_stat, status_kib};

/// utime + stime, in clock ticks, of `pid` and every process below it (nginx
/// serves from worker processes; the master alone would read as idle).
pub(crate) fn cpu_ticks(pid: u32) -> u64 {
    let mut total = 0;
    for pid in std::iter::once(pid).chain(descendants(pid)) {
        // A process may exit between listing and reading; it no longer counts.
        if let Some(stat) = read_stat(pid) {
            total += stat.utime + stat.stime;
        }
    }
    total
}

/// utime + stime, in clock ticks, of this process alone: an in-process client's
/// CPU (`cpu_ticks` would add the servers it started, which are its children).
pub(crate) fn own_cpu_ticks() -> u64 {
    read_stat(std::process::id()).map_or(0, |stat| stat.utime + stat.stime)
}

/// Busy clock ticks of the whole host (every CPU's user, nice, system, irq and
/// softirq time from /proc/stat): what a sample cost everyone, including kernel work
/// no process is charged for (softirq, workqueues), such as sockmap redirection.
pub(crate) fn host_busy_ticks() -> u64 {
    std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|stat| {
            let line = stat.lines().find(|l| l.starts_with("cpu "))?;
            let fields: Vec<u64> = line
                .split_whitespace()
                .skip(1)
                .filter_map(|f| f.parse().ok())
                .collect();
            // user nice system idle iowait irq softirq steal ...
            Some([0, 1, 2, 5, 6].iter().filter_map(|&i| fields.get(i)).sum())
        })
        .unwrap_or(0)
}

/// Major page faults (field 12 of proc(5) stat) of `pid` and every process below it.
/// A sample during which this grows had the server wait on the disk, so it is rejected.
pub(crate) fn major_faults(pid: u32) -> u64 {
    std::iter::once(pid)
        .chain(descendants(pid))
        .filter_map(read_stat)
        .map(|stat| stat.majflt)
        .sum()
}

/// How often [`RssWatch`] reads the tree's VmRSS.
const RSS_PERIOD: Duration = Duration::from_millis(50);
/// A watch ends on its own after this long even if nobody stops it.
const RSS_MAX: Duration = Duration::from_secs(600);

/// The peak resident memory of a process tree over an interval, read every
/// [`RSS_PERIOD`] by a thread (summed VmRSS: VmHWM alone would miss nginx's
/// workers, and would carry the peak of earlier cells).
#[derive(Debug)]
pub(crate) struct RssWatch {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<u64>,
}

impl RssWatch {
    pub(crate) fn start(pid: u32) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = thread::spawn(move || {
            let deadline = Instant::now() + RSS_MAX;
            // The tree is listed once: no server forks during a download, and a
            // full /proc scan every period would cost the host more than the reads.
            let tree: Vec<u32> = std::iter::once(pid).chain(descendants(pid)).collect();
            let rss = || -> u64 { tree.iter().filter_map(|&pid| status_kib(pid, "VmRSS:")).sum() };
            let mut peak = rss();
            while !flag.load(Ordering::Relaxed) && Instant::now() < deadline {
                thread::sleep(RSS_PERIOD);
                peak = peak.max(rss());
            }
            peak
        });
        Self { stop, thread }
    }

    /// Stops the watch and returns the peak, in KiB.
    pub(crate) fn finish(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or(0)
    }
}

/// cutime + cstime of this process: the CPU of every child it has waited for.
/// The difference across one `Command::output()` is that client's CPU, measured
/// the same way for curl and for h3-get (servers are waited for only at the end).
pub(crate) fn waited_children_ticks() -> u64 {
    fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|stat| parse_stat(&stat))
        .map_or(0, |stat| stat.cutime + stat.cstime)
}

/// Datagrams the kernel dropped on the UDP socket bound to `port` because its
/// receive buffer was full (the `drops` column of /proc/net/udp{,6}): loss at
/// that endpoint, as opposed to loss on the path. Loopback only: it matches on
/// the port alone.
pub(crate) fn udp_socket_drops(port: u16) -> Option<u64> {
    let port = format!(":{port:04X}");
    ["/proc/net/udp", "/proc/net/udp6"].iter().find_map(|table| {
        let text = fs::read_to_string(table).ok()?;
        text.lines().skip(1).find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if !fields.get(1)?.ends_with(&port) {
                return None;
            }
            fields.last()?.parse().ok()
        })
    })
}

/// The host's packet-loss counters so far, for the sample gate: TCP segments the
/// kernel dropped on receipt (the drop and prune counters of `TcpExt` in
/// /proc/net/netstat: backlog, receive queue, out-of-order queue, zero window,
/// memory pruning) and UDP datagrams dropped on receipt (`Udp: InErrors` of
/// /proc/net/snmp plus `Udp6InErrors`; they include receive-buffer overflows at
/// any socket: client, server, relay or origin). On loopback nothing else loses
/// packets, so a sample during which either grows saw packet loss.
///
/// TCP retransmissions are not counted: on this two-core loopback, segments
/// processed on different CPUs arrive reordered, and the sender's fast
/// retransmits that follow are spurious (undone by D-SACK), not loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Loss {
    pub tcp_drops: u64,
    pub udp_receive_errors: u64,
}

/// The `TcpExt` counters of segments dropped on receipt.
const TCP_DROPS: [&str; 6] = [
    "TCPBacklogDrop",
    "TCPRcvQDrop",
    "TCPOFODrop",
    "TCPZeroWindowDrop",
    "RcvPruned",
    "OfoPruned",
];

impl Loss {
    pub(crate) fn read() -> Option<Self> {
        let snmp = fs::read_to_string("/proc/net/snmp").ok()?;
        let netstat = fs::read_to_string("/proc/net/netstat").ok()?;
        let snmp6 = fs::read_to_string("/proc/net/snmp6").unwrap_or_default();
        parse_loss(&snmp, &netstat, &snmp6)
    }

    /// What grew since `before`, as a rejection reason; None when nothing did.
    pub(crate) fn since(self, before: Self) -> Option<String> {
        let tcp = self.tcp_drops.saturating_sub(before.tcp_drops);
        let udp = self.udp_receive_errors.saturating_sub(before.udp_receive_errors);
        match (tcp, udp) {
            (0, 0) => None,
            (tcp, 0) => Some(format!("packet loss: {tcp} TCP segment(s) dropped on the host")),
            (0, udp) => Some(format!("packet loss: {udp} UDP receive error(s) on the host")),
            (tcp, udp) => Some(format!(
                "packet loss: {tcp} TCP segment(s) dropped and {udp} UDP receive error(s) on the host"
            )),
        }
    }
}

/// The value under `name` in the two-line `Prefix: names` / `Prefix: values` table.
fn snmp_field(snmp: &str, prefix: &str, name: &str) -> Option<u64> {
    let mut rows = snmp.lines().filter(|line| line.starts_with(prefix));
    let (names, values) = (rows.next()?, rows.next()?);
    let at = names.split_whitespace().position(|n| n == name)?;
    values.split_whitespace().nth(at)?.parse().ok()
}

fn parse_loss(snmp: &str, netstat: &str, snmp6: &str) -> Option<Loss> {
    let udp6 = snmp6
        .lines()
        .find_map(|line| line.strip_prefix("Udp6InErrors"))
        .and_then(|n| n.trim().parse::<u64>().ok())
        .unwrap_or(0);
    // Older kernels lack some of the counters; the ones present are summed.
    let tcp_drops = TCP_DROPS
        .iter()
        .filter_map(|name| snmp_field(netstat, "TcpExt:", name))
        .sum();
    Some(Loss {
        tcp_drops,
        udp_receive_errors: snmp_field(snmp, "Udp:", "InErrors")? + udp6,
    })
}

/// USER_HZ, which is 100 on every mainstream Linux build; asked of getconf to be sure.
pub(crate) fn clock_ticks_per_second() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|out| String::from_utf8(out.stdout).ok()?.trim().parse().ok())
        .unwrap_or(100.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loss_counters() {
        let snmp = "Udp: InDatagrams NoPorts InErrors OutDatagrams RcvbufErrors\n\
                    Udp: 10 0 7 9 7\n";
        let netstat = "TcpExt: SyncookiesSent RcvPruned TCPBacklogDrop TCPRcvQDrop TCPSACKReorder\n\
                       TcpExt: 4 1 2 30 99\n\
                       IpExt: InNoRoutes\n\
                       IpExt: 0\n";
        let before = parse_loss(snmp, netstat, "Udp6InDatagrams 5\nUdp6InErrors 2\n").expect("parses");
        assert_eq!(
            before,
            Loss {
                tcp_drops: 33,
                udp_receive_errors: 9
            }
        );
        assert_eq!(before.since(before), None);
        let after = Loss {
            udp_receive_errors: 12,
            ..before
        };
        assert_eq!(
            after.since(before).as_deref(),
            Some("packet loss: 3 UDP receive error(s) on the host")
        );
        assert_eq!(parse_loss("Tcp: RetransSegs\n", netstat, ""), None);
        // This kernel's own tables parse.
        assert!(Loss::read().is_some());
    }

    /// The in-process client's CPU is its own: the servers it starts are its
    /// children, and `cpu_ticks` counts them (the concurrency scenario's client
    /// column once did, reading the servers' CPU as the client's).
    #[test]
    fn own_ticks_leave_the_children_out() {
        let mut busy = Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .expect("sh runs");
        let deadline = Instant::now() + Duration::from_secs(10);
        // At least 50 ms of the child's CPU, read within a bounded wait.
        let mut children = 0;
        while children < 5 && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(50));
            let me = std::process::id();
            children = cpu_ticks(me).saturating_sub(own_cpu_ticks());
        }
        let _ = busy.kill();
        let _ = busy.wait();
        assert!(children >= 5, "the tree counts the busy child: {children} ticks");
    }

    #[test]
    fn own_tree_rss_and_faults_readable() {
        let me = std::process::id();
        let _ = major_faults(me);
        assert!(RssWatch::start(me).finish() > 0);
    }

    #[test]
    fn own_children_ticks_readable() {
        // Nothing to compare against, but the fields must parse on this kernel.
        assert!(fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|s| parse_stat(&s))
            .is_some());
    }
}
