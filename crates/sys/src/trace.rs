//! Phase timestamps for benchmarks (`--trace`, `--boot-trace`): `mayfly-trace: <event> <ns>`
//! lines on stderr, in CLOCK_MONOTONIC nanoseconds, so a benchmark can line them up with its
//! own clock. Off unless [`enable`]d: then [`event`] is one relaxed load.

use std::sync::atomic::{AtomicBool, Ordering};

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Print every [`event`] from now on.
pub fn enable() {
    ENABLED.store(true, Ordering::Relaxed);
}

pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Record that `name` happened now.
pub fn event(name: &str) {
    if enabled() {
        eprintln!("mayfly-trace: {name} {}", monotonic_ns());
    }
}

/// CLOCK_MONOTONIC in nanoseconds.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime fills the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    // CLOCK_MONOTONIC is never negative.
    let (sec, nsec) = (ts.tv_sec.unsigned_abs(), ts.tv_nsec.unsigned_abs());
    sec * 1_000_000_000 + nsec
}
