//! Starting a lazy restore (registering guest memory with a new userfaultfd, spawning the
//! handler thread) and [`LazyMemory`], the handle that reports on it, finishes the load and
//! stops it.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use userfaultfd::{EventBuffer, FeatureFlags, IoctlFlags, UffdBuilder};

use super::handler::{describe, Handler, EVENT_BATCH};
use super::layout::{Bitmap, Extents, Layout, MappedFile, PAGE};
use super::options::{LazyError, LazyOptions, LazyStats};
use super::shared::{lock, Counters, Shared, State, WorkingSet};
use crate::memory::ram::HostRegion;

/// Larger blocks would make a fault wait for a long copy (and the buffer is this big).
const MAX_BLOCK_SIZE: usize = 1 << 30;

/// Start serving guest memory lazily: register every region with a new userfaultfd and start
/// the handler thread.
///
/// `on_failure` is called at most once, from the handler thread, if the memory file cannot be
/// read (I/O error, file truncated or changed under us, ...) or userfaultfd fails: the caller
/// then stops the VM. By then the handler has unregistered every region, so no thread stays
/// blocked on a fault: the pages it has not loaded read as zero.
///
/// # Safety
///
/// Every region must be a private anonymous mapping (MAP_PRIVATE | MAP_ANONYMOUS) that this
/// process made for guest RAM and that stays mapped, unmoved, until the returned
/// [`LazyMemory`] is dropped. Nothing may rely on what its not-yet-present pages contain: the
/// handler fills them with the file's bytes when they are first touched.
pub unsafe fn start(
    file: File,
    regions: &[HostRegion],
    options: LazyOptions,
    on_failure: Box<dyn FnOnce(String) + Send>,
) -> Result<LazyMemory, LazyError> {
    // SAFETY: the caller upholds the contract, which is this function's.
    unsafe { start_with(file, regions, options, on_failure, ReadMode::Pread) }
}

/// How the handler takes bytes from the memory file. Only the benchmark uses `Mmap`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ReadMode {
    /// `pread` into a buffer, `UFFDIO_COPY` from the buffer.
    Pread,
    /// `UFFDIO_COPY` straight from a read-only mapping of the file.
    #[cfg_attr(not(test), allow(dead_code))]
    Mmap,
}

/// [`start`] with a choice of how to read the file.
///
/// # Safety
///
/// As for [`start`].
pub(super) unsafe fn start_with(
    file: File,
    regions: &[HostRegion],
    options: LazyOptions,
    on_failure: Box<dyn FnOnce(String) + Send>,
    mode: ReadMode,
) -> Result<LazyMemory, LazyError> {
    let block_size = options.block_size;
    if !block_size.is_power_of_two() || !(PAGE..=MAX_BLOCK_SIZE).contains(&block_size) {
        return Err(LazyError::BlockSize(block_size));
    }
    let layout = Layout::new(regions, block_size)?;
    let extents = Extents::scan(&file).map_err(LazyError::Extents)?;
    let mapped = match mode {
        ReadMode::Mmap if extents.len > 0 => {
            Some(MappedFile::new(&file, extents.len).map_err(LazyError::Extents)?)
        }
        _ => None,
    };

    // Not user-mode only: KVM takes the guest's faults inside the kernel (and so does any
    // syscall the VMM makes on guest memory); with user-mode-only they fail with EFAULT.
    // Non-blocking: the handler drains events until EAGAIN and sleeps in poll.
    let uffd = UffdBuilder::new()
        .close_on_exec(true)
        .non_blocking(true)
        .user_mode_only(false)
        .require_features(FeatureFlags::EVENT_REMOVE)
        .create()
        .map_err(|e| LazyError::Create(describe(&e)))?;
    let needed = IoctlFlags::COPY | IoctlFlags::ZEROPAGE | IoctlFlags::WAKE;
    for region in &layout.regions {
        let register_err = |reason| LazyError::Register {
            addr: region.host,
            len: region.len,
            reason,
        };
        // A failure here drops `uffd`, which unregisters what was registered so far.
        let ioctls = uffd
            .register(region.host as *mut libc::c_void, region.len)
            .map_err(|e| register_err(describe(&e)))?;
        if !ioctls.contains(needed) {
            return Err(register_err(format!(
                "the kernel offers only {ioctls:?} on it"
            )));
        }
    }

    // SAFETY: plain syscall; the result is checked before use.
    let kick = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if kick < 0 {
        return Err(LazyError::EventFd(io::Error::last_os_error()));
    }
    // SAFETY: eventfd returned a new descriptor that nothing else owns.
    let kick = unsafe { OwnedFd::from_raw_fd(kick) };

    let prefetch = options
        .prefetch
        .iter()
        .filter_map(|&offset| layout.block_of_file_offset(offset))
        .collect();
    let shared = Arc::new(Shared {
        stop: AtomicBool::new(false),
        kick,
        populate_requests: AtomicU64::new(0),
        state: Mutex::new(State::default()),
        changed: Condvar::new(),
        working: Mutex::new(WorkingSet::default()),
        stats: Counters::default(),
    });
    let blocks = layout.blocks;
    let handler = Handler {
        uffd,
        shared: shared.clone(),
        file,
        mapped,
        extents,
        populated: Bitmap::new(blocks),
        remaining: blocks,
        recorded: Bitmap::new(blocks),
        discarded: None,
        prefetch,
        accounting: None,
        fill_cursor: 0,
        populate_done: 0,
        pending: VecDeque::new(),
        events: EventBuffer::new(EVENT_BATCH),
        scratch: Vec::with_capacity(EVENT_BATCH),
        buf: vec![0; block_size],
        on_failure: Some(on_failure),
        layout,
    };
    // The handler serves the guest's page faults: under its own seccomp filter (the memory
    // file read, userfaultfd's ioctls) from before its first fault.
    let builder = std::thread::Builder::new()
        .name("mayfly-lazy-mem".into())
        .stack_size(mayfly_sys::HELPER_THREAD_STACK);
    let thread = mayfly_jail::seccomp::spawn(
        builder,
        mayfly_jail::seccomp::ThreadKind::LazyMemory,
        move || handler.run(),
    )
    .map_err(LazyError::Thread)?;
    Ok(LazyMemory {
        shared,
        thread: Some(thread),
    })
}

/// Guest memory being loaded lazily. Dropping it stops the handler and unregisters the
/// regions: pages not loaded by then read as zero, so drop it only once the VM is stopped or
/// after [`LazyMemory::populate_all`].
pub struct LazyMemory {
    pub(super) shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl LazyMemory {
    /// Blocks loaded so far (memory file offsets of block starts), in the order they were first
    /// needed: blocks loaded by prefetch first, in prefetch order, then blocks loaded for
    /// faults, in fault order. This is the working set a later snapshot records so the next
    /// restore can prefetch it. Blocks loaded only by [`LazyMemory::populate_all`] are not in it.
    pub fn working_set(&self) -> Vec<u64> {
        let working = lock(&self.shared.working);
        let mut blocks = Vec::with_capacity(working.prefetched.len() + working.faulted.len());
        blocks.extend_from_slice(&working.prefetched);
        blocks.extend_from_slice(&working.faulted);
        blocks
    }

    /// Counters of what the handler has done so far.
    pub fn stats(&self) -> LazyStats {
        let counters = &self.shared.stats;
        LazyStats {
            faults: counters.faults.load(Ordering::Relaxed),
            blocks_copied: counters.blocks_copied.load(Ordering::Relaxed),
            zero_blocks: counters.zero_blocks.load(Ordering::Relaxed),
            prefetched_blocks: counters.prefetched_blocks.load(Ordering::Relaxed),
            bytes_read: counters.bytes_read.load(Ordering::Relaxed),
        }
    }

    /// Block until every region is fully loaded (faults keep being served meanwhile), e.g.
    /// before a snapshot, or to turn a lazy VM eager before dropping this. Fails if the handler
    /// failed, before or while loading.
    pub fn populate_all(&self) -> Result<(), LazyError> {
        let shared = &self.shared;
        let mut state = lock(&shared.state);
        let ticket = shared.populate_requests.fetch_add(1, Ordering::AcqRel) + 1;
        shared.kick();
        loop {
            if let Some(failure) = &state.failure {
                return Err(LazyError::Failed(failure.clone()));
            }
            if state.populate_done >= ticket {
                return Ok(());
            }
            if state.exited {
                return Err(LazyError::Stopped);
            }
            state = shared
                .changed
                .wait(state)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }
}

impl Drop for LazyMemory {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.kick();
        if let Some(thread) = self.thread.take() {
            // Dropped from `on_failure` (on the handler thread itself): it is exiting anyway.
            if thread.thread().id() != std::thread::current().id() {
                let _ = thread.join();
            }
        }
    }
}
