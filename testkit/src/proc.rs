//! What the kernel says about a process or a port, read from /proc: no help from
//! the server under test is needed, and none is trusted.

use std::fs;

/// Fields 4, 12 and 14 to 17 of proc(5) stat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    pub ppid: u32,
    /// Minor page faults (every thread's).
    pub minflt: u64,
    pub majflt: u64,
    pub utime: u64,
    pub stime: u64,
    pub cutime: u64,
    pub cstime: u64,
}

/// `/proc/PID/stat`, or `None` once the process is gone.
pub fn read_stat(pid: u32) -> Option<Stat> {
    parse_stat(&fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Parses one proc(5) stat line. The command name (field 2) may hold spaces and
/// parentheses, so counting starts after its last ')'.
pub fn parse_stat(stat: &str) -> Option<Stat> {
    let (_, rest) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state).
    let field = |n: usize| -> Option<u64> { fields.get(n - 3)?.parse().ok() };
    Some(Stat {
        ppid: u32::try_from(field(4)?).ok()?,
        minflt: field(10)?,
        majflt: field(12)?,
        utime: field(14)?,
        stime: field(15)?,
        cutime: field(16)?,
        cstime: field(17)?,
    })
}

/// Every process whose parent chain leads to `root`, found through /proc/*/stat.
pub fn descendants(root: u32) -> Vec<u32> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let parents: Vec<(u32, u32)> = entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse().ok())
        .filter_map(|pid| Some((pid, read_stat(pid)?.ppid)))
        .collect();
    let mut found = vec![root];
    // Each pass adds at least one process or stops; the process count bounds it.
    let mut next = 0;
    while next < found.len() {
        let parent = found[next];
        found.extend(
            parents
                .iter()
                .filter(|&&(_, ppid)| ppid == parent)
                .map(|&(pid, _)| pid),
        );
        next += 1;
    }
    found.remove(0);
    found
}

/// One `Name:   1234 kB` line of /proc/PID/status (`field` with its colon), in KiB.
pub fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix(field))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Open file descriptors of a process (entries of /proc/PID/fd), or `None` once
/// it is gone.
pub fn open_fds(pid: u32) -> Option<usize> {
    Some(fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count())
}

/// What a process holds at one instant: resident memory and open descriptors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Footprint {
    pub rss_kib: u64,
    pub fds: usize,
}

impl Footprint {
    /// The process's footprint now, or `None` once it is gone.
    pub fn of(pid: u32) -> Option<Footprint> {
        Some(Footprint {
            rss_kib: status_kib(pid, "VmRSS:")?,
            fds: open_fds(pid)?,
        })
    }
}

impl std::fmt::Display for Footprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rss {:.1} MiB, {} fds", self.rss_kib as f64 / 1024.0, self.fds)
    }
}

/// One flood's record for the hardening report: the server's footprint before,
/// at the height of and after the flood, and how long a normal download took
/// while it ran. Printed as one `FLOOD` line (run the test with `--nocapture`).
#[derive(Debug, Clone, Copy)]
pub struct FloodReport<'a> {
    pub flood: &'a str,
    pub before: Footprint,
    pub during: Footprint,
    pub after: Footprint,
    pub download: Option<std::time::Duration>,
}

impl FloodReport<'_> {
    pub fn print(&self) {
        let download = match self.download {
            Some(took) => format!("{} ms", took.as_millis()),
            None => "not measured".to_string(),
        };
        eprintln!(
            "FLOOD {}: before {}; during {}; after {}; a normal download during it: {}",
            self.flood, self.before, self.during, self.after, download
        );
    }
}

/// Which end of a TCP connection a port is matched against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// Connections to a server listening on the port.
    Local,
    /// Connections a client (a proxy's upstream side) made to the port.
    Remote,
}

/// Established TCP connections whose `end` is the loopback `port`, from the
/// kernel's socket tables (/proc/net/tcp and tcp6).
pub fn established(port: u16, end: End) -> usize {
    count_established(port, end, |_| true)
}

/// Of those, the ones whose armed timer is the keepalive timer (`tr` 2): sockets
/// with SO_KEEPALIVE and nothing in flight.
pub fn established_with_keepalive(port: u16, end: End) -> usize {
    count_established(port, end, |cols| {
        cols.get(5).is_some_and(|timer| timer.starts_with("02:"))
    })
}

/// Established sockets of `port`'s `end` whose columns also pass `keep`.
fn count_established(port: u16, end: End, keep: impl Fn(&[&str]) -> bool) -> usize {
    let port_hex = format!(":{port:04X}");
    let column = match end {
        End::Local => 1,
        End::Remote => 2,
    };
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|f| fs::read_to_string(f).ok())
        .map(|table| {
            table
                .lines()
                .skip(1)
                .filter(|l| {
                    let cols: Vec<&str> = l.split_whitespace().collect();
                    cols.len() > 3 && cols[column].ends_with(&port_hex) && cols[3] == "01" && keep(&cols)
                })
                .count()
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_with_spaces_in_comm() {
        let stat = "42 (nginx: worker (x)) S 7 42 42 0 -1 4194560 10 0 3 0 123 45 6 7 20 0 1 0";
        let parsed = parse_stat(stat).expect("parses");
        assert_eq!(
            (
                parsed.ppid,
                parsed.majflt,
                parsed.utime,
                parsed.stime,
                parsed.cutime,
                parsed.cstime
            ),
            (7, 3, 123, 45, 6, 7)
        );
    }

    #[test]
    fn own_process_is_readable() {
        let me = std::process::id();
        assert!(read_stat(me).is_some());
        assert!(status_kib(me, "VmRSS:").is_some_and(|kib| kib > 0));
    }
}
