//! What the handler thread and [`LazyMemory`](super::LazyMemory) share: the stop flag and
//! wake-up eventfd, the answers to `populate_all`, the working set recorded so far and the
//! counters behind [`LazyStats`](super::LazyStats).

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Condvar, Mutex, MutexGuard};

/// What the handler thread and [`LazyMemory`](super::LazyMemory) share.
pub(super) struct Shared {
    /// Set when the handler must exit.
    pub(super) stop: AtomicBool,
    /// An eventfd that wakes the handler from poll.
    pub(super) kick: OwnedFd,
    /// How many times `populate_all` was called; the handler answers in `State::populate_done`.
    pub(super) populate_requests: AtomicU64,
    pub(super) state: Mutex<State>,
    /// Signalled when `state` changes.
    pub(super) changed: Condvar,
    pub(super) working: Mutex<WorkingSet>,
    pub(super) stats: Counters,
}

impl Shared {
    /// Wake the handler from poll.
    pub(super) fn kick(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a valid u64 to our eventfd. It can only fail if the
        // counter would overflow, and then the handler has a wake-up pending anyway.
        unsafe {
            libc::write(self.kick.as_raw_fd(), (&one as *const u64).cast(), 8);
        }
    }
}

#[derive(Default)]
pub(super) struct State {
    /// The highest `populate_requests` value answered: every block was loaded after it.
    pub(super) populate_done: u64,
    /// Why the handler failed, if it did.
    pub(super) failure: Option<String>,
    /// The handler thread has ended.
    pub(super) exited: bool,
}

#[derive(Default)]
pub(super) struct WorkingSet {
    pub(super) prefetched: Vec<u64>,
    pub(super) faulted: Vec<u64>,
}

#[derive(Default)]
pub(super) struct Counters {
    pub(super) faults: AtomicU64,
    pub(super) blocks_copied: AtomicU64,
    pub(super) zero_blocks: AtomicU64,
    pub(super) prefetched_blocks: AtomicU64,
    pub(super) bytes_read: AtomicU64,
}

pub(super) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
