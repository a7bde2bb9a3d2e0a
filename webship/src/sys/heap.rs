//! When the C heap (glibc's `malloc`, the system allocator Webship uses unless
//! built with another) gives freed memory back to the kernel.
//!
//! glibc serves a request above its mmap threshold with a mapping of its own, which
//! `free` unmaps, and returns the free top of a heap once it exceeds its trim
//! threshold. Both start at 128 KiB and move with what is freed. A file response
//! reads its body in chunks of up to 128 KiB and frees each once the peer has it
//! (HTTP/3 holds a chunk until it is acknowledged), so the chunks kept landing in
//! memory just given back: every 4 KiB page faulted in again as the file was read
//! into it. A 1 MiB response over HTTP/3 cost the server 110–210 page faults, about
//! 14 % of its CPU for that response (docs/benchmarks.md, "Page faults").
//!
//! [`keep_freed_memory`] fixes the thresholds instead: requests under
//! [`MMAP_THRESHOLD`] come from the heap, and a heap keeps up to [`TRIM_THRESHOLD`]
//! of free memory at its top. An operator's own setting (`GLIBC_TUNABLES`, or the
//! older `MALLOC_*_` variables) is left alone.

/// Requests of this size and above get a mapping of their own (glibc's default
/// ceiling for its moving threshold is 32 MiB).
pub(crate) const MMAP_THRESHOLD: usize = 1 << 20;

/// Free memory a heap keeps at its top before returning it: twice the mmap
/// threshold, the ratio glibc keeps when it moves the two itself. It bounds what
/// each of glibc's arenas (one per thread that allocated under contention, at most
/// eight per core) holds beyond what it uses.
pub(crate) const TRIM_THRESHOLD: usize = 2 * MMAP_THRESHOLD;

/// What [`keep_freed_memory`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Heap {
    /// The thresholds are set.
    Kept,
    /// The environment sets one of them; glibc follows it.
    Operator,
    /// Not glibc's heap (another allocator, or another C library): nothing to set.
    Unsupported,
}

/// Fixes glibc's mmap and trim thresholds at [`MMAP_THRESHOLD`] and
/// [`TRIM_THRESHOLD`], unless `environment` (the process's variables) sets either.
/// Best called before other threads allocate; glibc takes its own lock either way.
pub(crate) fn keep_freed_memory(environment: impl Iterator<Item = (String, String)>) -> Heap {
    if operator_sets_thresholds(environment) {
        return Heap::Operator;
    }
    imp::set_thresholds()
}

/// Whether `environment` sets glibc's mmap or trim threshold: a `GLIBC_TUNABLES`
/// entry `glibc.malloc.mmap_threshold` or `glibc.malloc.trim_threshold`, or
/// `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_`.
fn operator_sets_thresholds(mut environment: impl Iterator<Item = (String, String)>) -> bool {
    environment.any(|(name, value)| match name.as_str() {
        "MALLOC_MMAP_THRESHOLD_" | "MALLOC_TRIM_THRESHOLD_" => true,
        "GLIBC_TUNABLES" => value.split(':').any(|entry| {
            let name = entry.split('=').next().unwrap_or_default();
            matches!(
                name,
                "glibc.malloc.mmap_threshold" | "glibc.malloc.trim_threshold"
            )
        }),
        _ => false,
    })
}

#[cfg(all(
    target_os = "linux",
    target_env = "gnu",
    not(feature = "allocator-jemalloc"),
    not(feature = "allocator-mimalloc")
))]
mod imp {
    use super::{Heap, MMAP_THRESHOLD, TRIM_THRESHOLD};

    pub(super) fn set_thresholds() -> Heap {
        let set = |param, value: usize| {
            let value = libc::c_int::try_from(value).unwrap_or(libc::c_int::MAX);
            // SAFETY: `mallopt` takes two integers and changes glibc's allocator
            // parameters under the allocator's own lock; no memory of ours is involved.
            unsafe { libc::mallopt(param, value) == 1 }
        };
        // glibc refuses only values out of its range; if it refused the first, the
        // second is not tried.
        if set(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) && set(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) {
            Heap::Kept
        } else {
            Heap::Unsupported
        }
    }
}

#[cfg(not(all(
    target_os = "linux",
    target_env = "gnu",
    not(feature = "allocator-jemalloc"),
    not(feature = "allocator-mimalloc")
)))]
mod imp {
    use super::Heap;

    pub(super) fn set_thresholds() -> Heap {
        Heap::Unsupported
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Iterator<Item = (String, String)> {
        pairs
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect::<Vec<_>>()
            .into_iter()
    }

    #[test]
    fn an_operator_s_threshold_is_left_to_glibc() {
        for set in [
            env(&[("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1")]),
            env(&[(
                "GLIBC_TUNABLES",
                "glibc.malloc.arena_max=2:glibc.malloc.mmap_threshold=65536",
            )]),
            env(&[("MALLOC_TRIM_THRESHOLD_", "0")]),
            env(&[("PATH", "/bin"), ("MALLOC_MMAP_THRESHOLD_", "0")]),
        ] {
            assert_eq!(keep_freed_memory(set), Heap::Operator);
        }
        for unrelated in [
            env(&[]),
            env(&[(
                "GLIBC_TUNABLES",
                "glibc.malloc.arena_max=2:glibc.malloc.tcache_count=0",
            )]),
            env(&[("GLIBC_TUNABLES", "glibc.malloc.trim_threshold_x=1")]),
            env(&[("MALLOC_ARENA_MAX", "2")]),
        ] {
            assert!(!operator_sets_thresholds(unrelated));
        }
    }

    /// Memory freed and asked for again is not faulted in again: a thread that
    /// allocates and frees 16–128 KiB buffers in the pattern of a file response (a
    /// few held at once, as a peer's acknowledgements free them) takes no page
    /// faults once the heap has grown to it.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn freed_chunks_stay_mapped() {
        let outcome = keep_freed_memory(env(&[]));
        if cfg!(any(
            feature = "allocator-jemalloc",
            feature = "allocator-mimalloc"
        )) {
            assert_eq!(outcome, Heap::Unsupported);
            return;
        }
        assert_eq!(outcome, Heap::Kept);
        // The faults of this thread alone (other tests run beside it).
        let faults = || {
            // SAFETY: `rusage` is plain data, and getrusage fills the one given.
            let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
            // SAFETY: `usage` is valid and writable for the call.
            assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) }, 0);
            usage.ru_minflt
        };
        let response = || {
            let mut held = std::collections::VecDeque::new();
            for size in [16, 16, 16, 32, 48, 80, 128, 128, 128, 128, 128, 128, 128, 128] {
                let mut chunk = Vec::<u8>::with_capacity(size << 10);
                chunk.resize(size << 10, 1);
                held.push_back(chunk);
                if held.len() > 3 {
                    drop(held.pop_front());
                }
            }
            std::hint::black_box(held);
        };
        // On a thread of its own, which glibc gives an arena of its own while there
        // are fewer threads than arenas, so other tests' allocations stay out of it.
        let taken = std::thread::spawn(move || {
            response();
            let before = faults();
            for _ in 0..20 {
                response();
            }
            faults() - before
        })
        .join()
        .unwrap();
        assert!(taken < 20, "{taken} page faults in 20 responses' worth of chunks");
    }
}
