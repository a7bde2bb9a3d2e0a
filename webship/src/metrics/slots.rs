//! Slots of counters kept by name for a process's life, for subsystems whose
//! objects a reload rebuilds (a proxy route's upstreams, a site's WebTransport
//! endpoint): each new generation asks for its names' slots and gets the ones the
//! last generation counted in, so the series continue. Asked at configuration time
//! only; the request path holds its slot and adds to its atomics.
//!
//! Names come from the configuration, yet a daemon reloaded with ever new names
//! must stay bounded: past the cap, new names share one slot named `_other`.

use std::sync::{Arc, Mutex};

/// The name of the slot shared by names past the cap.
pub(crate) const OTHER: &str = "_other";

#[derive(Debug)]
pub(crate) struct Slots<T> {
    cap: usize,
    named: Mutex<Vec<(String, Arc<T>)>>,
}

impl<T: Default> Slots<T> {
    /// At most `cap` names (then `_other`); `const`, so a subsystem keeps it in a
    /// `static`.
    pub(crate) const fn new(cap: usize) -> Self {
        Self {
            cap,
            named: Mutex::new(Vec::new()),
        }
    }

    /// The slot of `name`, made on first sight.
    pub(crate) fn get(&self, name: &str) -> Arc<T> {
        self.get_with(name, |_| T::default())
    }
}

impl<T> Slots<T> {
    /// At most `cap` names (then `_other`), for slots made by
    /// [`get_with`](Self::get_with).
    pub(crate) const fn with_cap(cap: usize) -> Self {
        Self {
            cap,
            named: Mutex::new(Vec::new()),
        }
    }

    /// The slot of `name`, made by `make` (given the name it is kept under: `name`,
    /// or `_other` past the cap) on first sight.
    pub(crate) fn get_with(&self, name: &str, make: impl FnOnce(&str) -> T) -> Arc<T> {
        let mut named = self.named.lock().unwrap_or_else(|e| e.into_inner());
        let mut name = name;
        if let Some((_, slot)) = named.iter().find(|(n, _)| n == name) {
            return slot.clone();
        }
        if named.len() >= self.cap {
            name = OTHER;
            if let Some((_, slot)) = named.iter().find(|(n, _)| n == name) {
                return slot.clone();
            }
        }
        let slot = Arc::new(make(name));
        named.push((name.to_owned(), slot.clone()));
        slot
    }

    /// Every slot with its name, in the order they were made (what a scrape writes).
    pub(crate) fn all(&self) -> Vec<(String, Arc<T>)> {
        self.named.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    #[test]
    fn a_name_keeps_its_slot_and_names_past_the_cap_share_one() {
        let slots: Slots<AtomicU64> = Slots::new(2);
        slots.get("a").fetch_add(1, Ordering::Relaxed);
        slots.get("b").fetch_add(1, Ordering::Relaxed);
        // A later generation asks again: the same counters.
        assert_eq!(slots.get("a").fetch_add(1, Ordering::Relaxed), 1);
        slots.get("c").fetch_add(1, Ordering::Relaxed);
        slots.get("d").fetch_add(1, Ordering::Relaxed);
        let all: Vec<(String, u64)> = slots
            .all()
            .into_iter()
            .map(|(n, c)| (n, c.load(Ordering::Relaxed)))
            .collect();
        assert_eq!(all, [("a".into(), 2), ("b".into(), 1), ("_other".into(), 2)]);
        // A name seen before the cap keeps its own slot after it.
        assert_eq!(slots.get("b").load(Ordering::Relaxed), 1);
    }
}
