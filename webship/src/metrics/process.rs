//! The process's own figures, read from `/proc/self` at scrape time: resident
//! memory, open descriptors, threads and CPU time. Nothing is kept between scrapes.

use std::time::Duration;

#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Process {
    pub(crate) rss_bytes: Option<u64>,
    pub(crate) threads: Option<u64>,
    pub(crate) open_fds: Option<u64>,
    pub(crate) cpu: Option<Duration>,
}

/// Clock ticks per second of `/proc/<pid>/stat`: `USER_HZ`, 100 in the kernel's
/// user ABI on every architecture Linux ships.
const USER_HZ: u64 = 100;
/// More descriptors than this are reported as this many: the scrape never walks an
/// unbounded folder (the daemon's limit is `max_connections`-sized anyway).
const MAX_FDS_COUNTED: u64 = 1 << 22;

impl Process {
    /// What `/proc/self` says now; a figure it cannot read is `None` (left out).
    pub(crate) fn read() -> Self {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|v| v.parse::<u64>().ok())
        };
        Self {
            rss_bytes: field("VmRSS:").map(|kib| kib * 1024),
            threads: field("Threads:"),
            open_fds: open_fds(),
            cpu: std::fs::read_to_string("/proc/self/stat")
                .ok()
                .and_then(|s| cpu(&s)),
        }
    }
}

fn open_fds() -> Option<u64> {
    let entries = std::fs::read_dir("/proc/self/fd").ok()?;
    // The folder's own descriptor is one of its entries while it is read.
    let n = entries.take(MAX_FDS_COUNTED as usize).count() as u64;
    Some(n.saturating_sub(1))
}

/// User plus system time from a `/proc/<pid>/stat` line. The command name (field 2)
/// may hold spaces and parentheses, so fields are counted after its last `)`.
fn cpu(stat: &str) -> Option<Duration> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    // After the name: state (3), …, utime (14), stime (15).
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(Duration::from_millis((utime + stime) * 1000 / USER_HZ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_time_is_read_past_an_odd_command_name() {
        let line = "42 (web ship) x) S 1 42 42 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 3 0 9 0 0";
        assert_eq!(cpu(line), Some(Duration::from_secs(3)));
    }

    #[test]
    fn this_process_reads() {
        let p = Process::read();
        assert!(p.rss_bytes.unwrap() > 0);
        assert!(p.threads.unwrap() >= 1);
        assert!(p.open_fds.unwrap() >= 1);
        assert!(p.cpu.is_some());
    }
}
