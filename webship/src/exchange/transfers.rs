//! The large responses in flight, for `webship stats --watch`: which site, client and
//! path, how many bytes of how many are out, for how long. The metrics count a
//! response's bytes when it ends, so a download of many gigabytes is invisible there
//! until it is over; this table shows it while it runs.
//!
//! Only responses whose declared length is at least [`MIN_LEN`] register, into a
//! fixed table of [`SLOTS`] slots that never grows: when every slot is taken, a new
//! large response is simply not listed (counted in `unlisted`), never waited for. A
//! small response costs nothing here (its record holds no slot). A large one claims
//! a slot once (a scan of atomic flags, one compare-and-swap), writes its fields
//! under the slot's own lock (taken again only by a listing, never across an await),
//! and then stores its progress in the slot's atomic as its body hands bytes out
//! (one relaxed store per chunk).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::Proto;
use crate::control::TransferInfo;

/// The smallest declared length that is listed.
pub(crate) const MIN_LEN: u64 = 1 << 20;
/// Slots in the table: responses listed at once.
pub(crate) const SLOTS: usize = 128;
/// The longest path kept (bytes, cut at a character boundary); the query is never
/// kept (it may carry credentials).
const MAX_PATH: usize = 256;

/// The process's table (one, shared by every generation).
#[derive(Debug)]
pub(crate) struct Transfers {
    slots: Box<[Slot]>,
    /// Identifies a transfer across listings (a slot is reused).
    next_id: AtomicU64,
    /// Large responses not listed because every slot was taken.
    unlisted: AtomicU64,
}

#[derive(Debug, Default)]
struct Slot {
    taken: AtomicBool,
    /// Body bytes handed out so far.
    sent: AtomicU64,
    /// Set by the claimer once, cleared by its release; `None` while free.
    info: Mutex<Option<Info>>,
}

#[derive(Debug, Clone)]
struct Info {
    id: u64,
    site: Option<Arc<str>>,
    proto: Proto,
    peer: SocketAddr,
    path: String,
    total: u64,
    started: Instant,
}

/// What a large response registers with.
#[derive(Debug)]
pub(crate) struct Entry<'a> {
    pub(crate) site: Option<Arc<str>>,
    pub(crate) proto: Proto,
    pub(crate) peer: SocketAddr,
    pub(crate) path: &'a str,
    pub(crate) total: u64,
    pub(crate) started: Instant,
}

impl Default for Transfers {
    fn default() -> Self {
        Self {
            slots: (0..SLOTS).map(|_| Slot::default()).collect(),
            next_id: AtomicU64::new(1),
            unlisted: AtomicU64::new(0),
        }
    }
}

impl Transfers {
    /// Lists `entry` if it is large enough and a slot is free; the returned handle
    /// takes its progress and frees the slot when dropped.
    pub(crate) fn register(self: &Arc<Self>, entry: Entry<'_>) -> Option<Transfer> {
        if entry.total < MIN_LEN {
            return None;
        }
        let Some(index) = self.slots.iter().position(|slot| {
            !slot.taken.load(Ordering::Relaxed)
                && slot
                    .taken
                    .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
        }) else {
            self.unlisted.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        let slot = &self.slots[index];
        slot.sent.store(0, Ordering::Relaxed);
        let info = Info {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            site: entry.site,
            proto: entry.proto,
            peer: entry.peer,
            path: cut(entry.path, MAX_PATH).to_owned(),
            total: entry.total,
            started: entry.started,
        };
        *slot.info.lock().unwrap_or_else(|e| e.into_inner()) = Some(info);
        Some(Transfer {
            table: self.clone(),
            index,
        })
    }

    /// Every listed transfer now, largest first, and how many large responses were
    /// not listed since start.
    pub(crate) fn list(&self) -> (Vec<TransferInfo>, u64) {
        let now = Instant::now();
        let mut listed: Vec<TransferInfo> = self
            .slots
            .iter()
            .filter(|slot| slot.taken.load(Ordering::Relaxed))
            .filter_map(|slot| {
                let info = slot.info.lock().unwrap_or_else(|e| e.into_inner());
                let info = info.as_ref()?;
                Some(TransferInfo {
                    id: info.id,
                    site: info.site.as_deref().unwrap_or("-").to_owned(),
                    proto: info.proto.as_str().to_owned(),
                    peer: info.peer,
                    path: info.path.clone(),
                    sent: slot.sent.load(Ordering::Relaxed).min(info.total),
                    total: info.total,
                    elapsed_ms: u64::try_from(now.saturating_duration_since(info.started).as_millis())
                        .unwrap_or(u64::MAX),
                })
            })
            .collect();
        listed.sort_by(|a, b| b.total.cmp(&a.total).then(a.id.cmp(&b.id)));
        (listed, self.unlisted.load(Ordering::Relaxed))
    }
}

/// A listed response's slot: progress goes in, and dropping it frees the slot.
#[derive(Debug)]
pub(crate) struct Transfer {
    table: Arc<Transfers>,
    index: usize,
}

impl Transfer {
    /// `sent` body bytes are out so far.
    pub(crate) fn progress(&self, sent: u64) {
        self.table.slots[self.index].sent.store(sent, Ordering::Relaxed);
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        let slot = &self.table.slots[self.index];
        *slot.info.lock().unwrap_or_else(|e| e.into_inner()) = None;
        slot.taken.store(false, Ordering::Release);
    }
}

/// The longest prefix of `s` within `max` bytes that ends on a character boundary.
fn cut(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(path: &str, total: u64) -> Entry<'_> {
        Entry {
            site: Some("a.test".into()),
            proto: Proto::H2,
            peer: "127.0.0.1:5000".parse().unwrap(),
            path,
            total,
            started: Instant::now(),
        }
    }

    #[test]
    fn small_responses_are_not_listed_and_large_ones_show_their_progress() {
        let table = Arc::new(Transfers::default());
        assert!(table.register(entry("/small", MIN_LEN - 1)).is_none());
        let big = table.register(entry("/big.bin", 10 * MIN_LEN)).unwrap();
        let bigger = table.register(entry("/bigger.bin", 20 * MIN_LEN)).unwrap();
        big.progress(3 * MIN_LEN);
        let (listed, unlisted) = table.list();
        assert_eq!(unlisted, 0);
        let paths: Vec<&str> = listed.iter().map(|t| t.path.as_str()).collect();
        assert_eq!(paths, ["/bigger.bin", "/big.bin"], "largest first");
        assert_eq!((listed[1].sent, listed[1].total), (3 * MIN_LEN, 10 * MIN_LEN));
        assert_eq!(
            (listed[1].site.as_str(), listed[1].proto.as_str()),
            ("a.test", "h2")
        );
        drop(big);
        drop(bigger);
        assert!(table.list().0.is_empty(), "a dropped transfer frees its slot");
    }

    #[test]
    fn a_full_table_lists_no_more_and_counts_them() {
        let table = Arc::new(Transfers::default());
        let held: Vec<Transfer> = (0..SLOTS)
            .map(|_| table.register(entry("/x", MIN_LEN)).unwrap())
            .collect();
        assert!(table.register(entry("/one-too-many", MIN_LEN)).is_none());
        let (listed, unlisted) = table.list();
        assert_eq!((listed.len(), unlisted), (SLOTS, 1));
        drop(held);
        let again = table.register(entry("/after", MIN_LEN)).unwrap();
        assert_eq!(table.list().0.len(), 1);
        drop(again);
    }

    #[test]
    fn long_paths_are_cut_on_a_character_boundary() {
        let table = Arc::new(Transfers::default());
        let path = format!("/{}", "é".repeat(MAX_PATH));
        let _t = table.register(entry(&path, MIN_LEN)).unwrap();
        let listed = table.list().0;
        assert!(listed[0].path.len() <= MAX_PATH && path.starts_with(&listed[0].path));
    }
}
