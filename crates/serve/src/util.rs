//! Small helpers every layer of the manager uses: a lock that outlives a panicked holder, the
//! wall clock in milliseconds, an atomic file write, and an I/O error that names its path.
//!
//! Kept apart so that the lowest modules (the event log, the credential keys) need nothing
//! above them.

use std::path::Path;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::ServeError;

/// Take `m`, even if a thread panicked while holding it: the manager's state stays usable.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The wall clock, in ms since the Unix epoch (what records and events say).
/// `ttl_s` seconds after `now` (ms since the epoch), as ms since the epoch.
pub fn expires_at(now: u64, ttl_s: u64) -> u64 {
    now.saturating_add(ttl_s.saturating_mul(1000))
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Replace `path` with `bytes` so that a crash leaves the old or the new file, never half of
/// one (see `mayfly_sys::atomic`).
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), ServeError> {
    mayfly_sys::atomic::write(path, bytes).map_err(|source| ServeError::Io {
        what: "write",
        path: path.display().to_string(),
        source,
    })
}

/// An I/O error's mapping into a [`ServeError`] that says what was done to which path.
pub fn io_error(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> ServeError {
    let path = path.display().to_string();
    move |source| ServeError::Io { what, path, source }
}
