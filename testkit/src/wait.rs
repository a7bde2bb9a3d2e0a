//! Waiting for a condition the test cannot be told about (a log line, a counter, a
//! socket going away): polled, with a deadline. It blocks the calling thread, which
//! in a `#[tokio::test]` is not one of the runtime's workers, so servers running on
//! the runtime (the in-process origins) go on meanwhile.

use std::time::{Duration, Instant};

/// How often a condition is polled.
const POLL: Duration = Duration::from_millis(50);

/// Polls `cond` every 50 ms for up to `limit`, and once more at the end; whether it held.
pub fn eventually(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(POLL);
    }
}
