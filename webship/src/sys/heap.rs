//! When the C heap (glibc's `malloc`, the system allocator Webship uses unless
//! built with another) gives freed memory back to the kernel.
//!
//! glibc serves a request at or above its mmap threshold with a mapping of its
//! own, which `free` unmaps, and gives the free top of a heap back once it exceeds
//! its trim threshold. Both start at 128 KiB and rise with what is freed. A file
//! response reads its body in chunks (up to 128 KiB for h2 and h3, 256 KiB for h1)
//! and frees each once the peer has it; HTTP/3 holds a chunk until it is
//! acknowledged, so the next chunks need new memory while older ones are freed.
//! They kept landing in memory just given back, and every 4 KiB page faulted in
//! again as the file was read into it: 96–224 page faults per 1 MiB response over
//! HTTP/3; without them the server's CPU for that response fell by 10–28 %
//! (docs/benchmarks.md, "Page faults").
//!
//! [`fix_thresholds`] sets both thresholds once, at start: requests under the mmap
//! threshold come from the heap, and a heap keeps up to the trim threshold of free
//! memory at its top. That turns glibc's own adjustment off, so a request at or
//! above the mmap threshold is always mapped and unmapped; the threshold is at
//! least twice the largest buffer the configuration makes ([`thresholds_for`]).
//! What it costs: each heap may keep up to the trim threshold of free memory at its
//! top (glibc gives each thread that allocates an arena of its own, up to eight per
//! core: the workers, the blocking pool's threads, the main thread). Free memory
//! below a heap's top was never given back either way. An operator's own malloc
//! settings in the environment are left to glibc ([`operator_sets_thresholds`]).

/// The smallest mmap threshold: well above a file chunk (256 KiB at most).
const MIN_MMAP_THRESHOLD: usize = 1 << 20;

/// The largest mmap threshold glibc accepts on 64-bit targets (`HEAP_MAX_SIZE / 2`),
/// also the ceiling of its own adjustment (32-bit targets are left alone: theirs is
/// 512 KiB).
const MAX_MMAP_THRESHOLD: usize = 32 << 20;

/// What [`fix_thresholds`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(dead_code)] // which variants a build makes depends on its target and allocator
pub(crate) enum Thresholds {
    /// Both are set, in bytes.
    Fixed { mmap: usize, trim: usize },
    /// The environment tunes glibc's malloc; glibc follows it.
    FromEnvironment,
    /// glibc refused a value (the heap keeps its own adjustment, unless the first of
    /// the two was taken).
    Refused,
    /// Not glibc's heap (another allocator, or another C library): nothing to set.
    NotGlibc,
}

/// The mmap and trim thresholds for a process whose largest buffer is
/// `largest_buffer` bytes: twice the buffer (so one that grows by doubling past its
/// size, and malloc's own header, stay under it) rounded up to a power of two,
/// within [`MIN_MMAP_THRESHOLD`] and [`MAX_MMAP_THRESHOLD`]; and twice that for the
/// trim threshold (the ratio glibc keeps when it moves the two itself).
fn thresholds_for(largest_buffer: usize) -> (usize, usize) {
    let mmap = largest_buffer
        .saturating_mul(2)
        .checked_next_power_of_two()
        .unwrap_or(MAX_MMAP_THRESHOLD)
        .clamp(MIN_MMAP_THRESHOLD, MAX_MMAP_THRESHOLD);
    (mmap, 2 * mmap)
}

/// Sets glibc's mmap and trim thresholds to [`thresholds_for`]`(largest_buffer)`,
/// unless the process's environment tunes malloc ([`operator_sets_thresholds`]).
/// Call it once, before the process starts other threads: glibc reads the two
/// without a lock.
pub(crate) fn fix_thresholds(largest_buffer: usize) -> Thresholds {
    // Not `env::vars`, which panics on a variable that is not UTF-8.
    let environment = std::env::vars_os().map(|(name, value)| {
        (
            name.to_string_lossy().into_owned(),
            value.to_string_lossy().into_owned(),
        )
    });
    // A process started with more privilege than its starter (set-user-ID, file
    // capabilities) is "secure" to glibc, which then ignores these variables.
    if !imp::secure() && operator_sets_thresholds(environment) {
        return Thresholds::FromEnvironment;
    }
    let (mmap, trim) = thresholds_for(largest_buffer);
    imp::set(mmap, trim)
}

/// Whether `environment` sets one of the malloc parameters that fix glibc's
/// thresholds (any of them turns its adjustment off): a `GLIBC_TUNABLES` entry
/// `glibc.malloc.{mmap_threshold,trim_threshold,top_pad,mmap_max}=…`, or
/// `MALLOC_{MMAP_THRESHOLD,TRIM_THRESHOLD,TOP_PAD,MMAP_MAX}_`. An empty value counts
/// (glibc reads it as 0); a tunable without `=` does not (glibc skips it).
fn operator_sets_thresholds(mut environment: impl Iterator<Item = (String, String)>) -> bool {
    const TUNABLES: [&str; 4] = [
        "glibc.malloc.mmap_threshold",
        "glibc.malloc.trim_threshold",
        "glibc.malloc.top_pad",
        "glibc.malloc.mmap_max",
    ];
    const VARIABLES: [&str; 4] = [
        "MALLOC_MMAP_THRESHOLD_",
        "MALLOC_TRIM_THRESHOLD_",
        "MALLOC_TOP_PAD_",
        "MALLOC_MMAP_MAX_",
    ];
    environment.any(|(name, value)| match name.as_str() {
        "GLIBC_TUNABLES" => value.split(':').any(|entry| {
            entry
                .split_once('=')
                .is_some_and(|(name, _)| TUNABLES.contains(&name))
        }),
        name => VARIABLES.contains(&name),
    })
}

#[cfg(all(
    target_os = "linux",
    target_env = "gnu",
    target_pointer_width = "64",
    not(feature = "allocator-jemalloc"),
    not(feature = "allocator-mimalloc")
))]
mod imp {
    use super::Thresholds;

    /// Whether glibc runs this process in secure mode (`AT_SECURE`).
    pub(super) fn secure() -> bool {
        // SAFETY: `getauxval` reads the auxiliary vector the kernel gave the
        // process; it takes and returns integers only.
        unsafe { libc::getauxval(libc::AT_SECURE) != 0 }
    }

    pub(super) fn set(mmap: usize, trim: usize) -> Thresholds {
        let set = |param, value: usize| {
            let Ok(value) = libc::c_int::try_from(value) else {
                return false;
            };
            // SAFETY: `mallopt` takes two integers and touches no memory of ours.
            // glibc marks it MT-Unsafe because other threads' allocations read the
            // parameters without a lock; `fix_thresholds` is called before the
            // daemon starts other threads, and a racing reader would at worst see one
            // threshold before the other.
            unsafe { libc::mallopt(param, value) == 1 }
        };
        if set(libc::M_MMAP_THRESHOLD, mmap) && set(libc::M_TRIM_THRESHOLD, trim) {
            Thresholds::Fixed { mmap, trim }
        } else {
            Thresholds::Refused
        }
    }
}

#[cfg(not(all(
    target_os = "linux",
    target_env = "gnu",
    target_pointer_width = "64",
    not(feature = "allocator-jemalloc"),
    not(feature = "allocator-mimalloc")
)))]
mod imp {
    use super::Thresholds;

    pub(super) fn secure() -> bool {
        false
    }

    pub(super) fn set(_: usize, _: usize) -> Thresholds {
        Thresholds::NotGlibc
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
    fn an_operator_s_malloc_settings_are_left_to_glibc() {
        for set in [
            env(&[("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1")]),
            env(&[(
                "GLIBC_TUNABLES",
                "glibc.malloc.arena_max=2:glibc.malloc.mmap_threshold=65536",
            )]),
            env(&[("GLIBC_TUNABLES", "glibc.malloc.top_pad=0")]),
            env(&[("GLIBC_TUNABLES", "glibc.malloc.mmap_max=0")]),
            env(&[("MALLOC_TRIM_THRESHOLD_", "0")]),
            env(&[("PATH", "/bin"), ("MALLOC_MMAP_THRESHOLD_", "0")]),
            env(&[("MALLOC_TOP_PAD_", "4096")]),
            // glibc reads an empty value as 0.
            env(&[("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=")]),
            env(&[("MALLOC_TRIM_THRESHOLD_", "")]),
        ] {
            assert!(operator_sets_thresholds(set));
        }
        for unrelated in [
            env(&[]),
            env(&[(
                "GLIBC_TUNABLES",
                "glibc.malloc.arena_max=2:glibc.malloc.tcache_count=0",
            )]),
            env(&[("GLIBC_TUNABLES", "glibc.malloc.trim_threshold_x=1")]),
            // glibc skips an entry without `=`.
            env(&[("GLIBC_TUNABLES", "glibc.malloc.trim_threshold")]),
            env(&[("MALLOC_ARENA_MAX", "2")]),
        ] {
            assert!(!operator_sets_thresholds(unrelated));
        }
    }

    #[test]
    fn the_thresholds_cover_the_largest_buffer() {
        // The defaults' largest buffer (128 KiB), and anything up to 512 KiB.
        assert_eq!(thresholds_for(0), (1 << 20, 2 << 20));
        assert_eq!(thresholds_for(128 << 10), (1 << 20, 2 << 20));
        assert_eq!(thresholds_for(512 << 10), (1 << 20, 2 << 20));
        // Above it, twice the buffer rounded up: `h2_tls_write_buffer_bytes =
        // "1048576"`, or a little over 4 MiB.
        assert_eq!(thresholds_for(1 << 20), (2 << 20, 4 << 20));
        assert_eq!(thresholds_for((4 << 20) + 1), (16 << 20, 32 << 20));
        // Up to glibc's ceiling (`h2_max_frame_size_bytes` at its largest, 16 MiB
        // less one byte), and the ceiling past it.
        assert_eq!(thresholds_for((16 << 20) - 1), (32 << 20, 64 << 20));
        assert_eq!(thresholds_for(1 << 30), (32 << 20, 64 << 20));
        assert_eq!(thresholds_for(usize::MAX), (32 << 20, 64 << 20));
    }

    /// Memory freed and asked for again is not faulted in again: a thread that
    /// allocates and frees 16–128 KiB buffers in the pattern of a file response (a
    /// few held at once, as a peer's acknowledgements free them) takes no page
    /// faults once the heap has grown to it. Without the thresholds: about 1,600
    /// faults in these 20 responses.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn freed_chunks_stay_mapped() {
        let arena_limit = |(name, value): &(String, String)| {
            name == "MALLOC_ARENA_MAX" || (name == "GLIBC_TUNABLES" && value.contains("arena_max"))
        };
        if std::env::vars().any(|v| arena_limit(&v)) {
            // Threads may then share an arena with other tests' allocations.
            return;
        }
        // `mallopt` here runs while other tests' threads allocate, which the daemon
        // never does (`fix_thresholds`' SAFETY): a racing allocation may see one
        // threshold before the other, which changes only when freed memory goes back;
        // the thresholds then hold for the rest of this test binary, which is fine.
        match fix_thresholds(0) {
            Thresholds::Fixed { .. } => {}
            Thresholds::FromEnvironment | Thresholds::NotGlibc => return,
            Thresholds::Refused => panic!("glibc refused the thresholds"),
        }
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
        // A new thread gets an arena of its own while glibc has fewer arenas than
        // its limit (eight per core), so other tests' allocations stay out of it.
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
        assert!(taken < 64, "{taken} page faults in 20 responses' worth of chunks");
    }
}
