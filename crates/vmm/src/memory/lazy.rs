//! Lazy restore of guest RAM with userfaultfd.
//!
//! A lazily restored VM runs before its memory is loaded. Guest RAM is private anonymous memory
//! registered with a userfaultfd (MISSING mode): the first touch of a page, by a vCPU inside KVM
//! or by the VMM itself, waits while a handler thread copies the aligned block around it from
//! the snapshot's memory file. Meanwhile the handler loads the blocks listed in
//! [`LazyOptions::prefetch`] (the working set a previous run recorded with
//! [`LazyMemory::working_set`]), and [`LazyMemory::populate_all`] finishes the load.
//!
//! What the guest sees:
//! - holes of the sparse memory file, the bytes past its end and blocks of zeros are mapped as
//!   the shared zero page (`UFFDIO_ZEROPAGE`): no copy and no memory until written;
//! - pages the VMM discards later (`MADV_DONTNEED`, e.g. a balloon) read as zero afterwards, as
//!   they would without userfaultfd: their bytes in the file are stale from then on.
//!
//! Block size, measured here (2 vCPUs of a nested KVM host, one thread touching one byte per
//! page of 128 MiB, `cargo test --release -p mayfly-vmm lazy::tests::bench -- --ignored
//! --nocapture`; 2-3 runs, µs per page touched, memory file in the page cache / not):
//!
//! | block  | sequential    | random, all   | random, 10%   | random, 1%        | populate_all |
//! |--------|---------------|---------------|---------------|-------------------|--------------|
//! | 4 KiB  | 7.6-8.3* / 8  | 7.7-8 / 53-60 | 8 / 80-92     | 8 / 56-106        | 2.7 / 8-11   |
//! | 64 KiB | 1.5 / 1.8-2.0 | 1.5 / 7.7-9.5 | 12 / 66-90    | 22-23 / 128-159   | 1.1 / 1.4    |
//! | 2 MiB  | 1.1 / 1.6-1.8 | 1.1 / 4.5-5.7 | 10-14 / 47-58 | 103-109 / 420-536 | 1.0 / 1.6-4  |
//!
//! (*) 45 µs in some runs: a 4 KiB fault costs mostly the wake-up, which is dear across CPUs.
//! 64 KiB is the default: 5x faster than 4 KiB when the guest touches much of its memory (and
//! each fault of a KVM guest costs ~70 µs more than these host-thread faults), within 1.4x of
//! 2 MiB, while a sparse guest pays 4x less than with 2 MiB, loads and keeps far less memory
//! it never uses, and a fault waits for one 64 KiB copy (~25 µs cached) where a 2 MiB block
//! stalls the vCPU ~0.5 ms (~2.5 ms with the file not cached).
//!
//! Reading the file: `pread` into a reused buffer, then `UFFDIO_COPY` from it. Copying straight
//! from a read-only mapping of the file saves a copy and was 5-15% faster with the file cached
//! and the guest touching everything, but 3-6x slower for sparse access to a file not cached
//! (each fault reads around the page through the mapping) and sometimes slower cached (the
//! kernel retries UFFDIO_COPY when the source page is not mapped yet); a mapping would also turn
//! a file truncated under us into SIGBUS for the zero checks here. So only the benchmark maps.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use userfaultfd::{Event, EventBuffer, FeatureFlags, IoctlFlags, Uffd, UffdBuilder};

use crate::memory::ram::HostRegion;

/// The host page size (x86-64): the unit userfaultfd maps in.
const PAGE: usize = 4096;

/// Bytes copied per fault unless told otherwise, chosen by the measurements above.
pub const DEFAULT_BLOCK_SIZE: usize = 64 << 10;

/// Larger blocks would make a fault wait for a long copy (and the buffer is this big).
const MAX_BLOCK_SIZE: usize = 1 << 30;

/// Events read per `read(2)` of the userfaultfd.
const EVENT_BATCH: usize = 64;

/// How long the handler retries an ioctl that keeps answering EAGAIN (an address-space change
/// in flight) before it gives up. Each change completes within microseconds once its event is
/// read, so reaching this means something is badly wrong.
const EAGAIN_LIMIT: Duration = Duration::from_secs(5);

/// How to load guest memory.
#[derive(Clone, Debug)]
pub struct LazyOptions {
    /// Bytes copied per fault: a power of two from 4 KiB to 1 GiB. Blocks are aligned to it
    /// from the start of each region. Bigger blocks mean fewer faults but more bytes loaded
    /// that the guest may never touch; see [`DEFAULT_BLOCK_SIZE`].
    pub block_size: usize,
    /// Memory file offsets (any alignment) whose blocks to load first, in this order, while
    /// faults are also served (faults go first). Offsets outside every region are ignored, so
    /// a working set recorded with another memory layout does no harm.
    pub prefetch: Vec<u64>,
}

impl Default for LazyOptions {
    fn default() -> Self {
        Self {
            block_size: DEFAULT_BLOCK_SIZE,
            prefetch: Vec::new(),
        }
    }
}

/// What the handler has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LazyStats {
    /// Page faults served (including faults that raced with a load and only needed a wake-up).
    pub faults: u64,
    /// Blocks filled with bytes from the memory file (`UFFDIO_COPY`).
    pub blocks_copied: u64,
    /// Blocks mapped as the zero page: holes in the file, or data that was all zeros.
    pub zero_blocks: u64,
    /// Blocks loaded because [`LazyOptions::prefetch`] listed them (before any fault needed them).
    pub prefetched_blocks: u64,
    /// Bytes read from the memory file.
    pub bytes_read: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum LazyError {
    #[error("lazy restore block size {0} is invalid: use a power of two from 4 KiB to 1 GiB")]
    BlockSize(usize),
    #[error("invalid guest memory region for lazy restore: {0}")]
    Region(String),
    #[error("cannot list the data extents of the memory file: {0}")]
    Extents(io::Error),
    #[error("cannot create a userfaultfd for lazy restore: {0}; run mayfly as root (or give it read-write access to /dev/userfaultfd), or restore eagerly")]
    Create(String),
    #[error("cannot register guest memory at {addr:#x} (+{len:#x}) with userfaultfd: {reason}; lazy restore needs private anonymous guest memory")]
    Register {
        addr: usize,
        len: usize,
        reason: String,
    },
    #[error("cannot create the lazy memory thread's wake-up eventfd: {0}")]
    EventFd(io::Error),
    #[error("cannot start the lazy memory thread: {0}")]
    Thread(io::Error),
    #[error("lazy restore failed: {0}; the VM's memory is incomplete and it must stop")]
    Failed(String),
    #[error("the lazy memory thread stopped before guest memory was fully loaded")]
    Stopped,
}

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
enum ReadMode {
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
unsafe fn start_with(
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
    shared: Arc<Shared>,
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

/// What the handler thread and [`LazyMemory`] share.
struct Shared {
    /// Set when the handler must exit.
    stop: AtomicBool,
    /// An eventfd that wakes the handler from poll.
    kick: OwnedFd,
    /// How many times `populate_all` was called; the handler answers in `State::populate_done`.
    populate_requests: AtomicU64,
    state: Mutex<State>,
    /// Signalled when `state` changes.
    changed: Condvar,
    working: Mutex<WorkingSet>,
    stats: Counters,
}

impl Shared {
    /// Wake the handler from poll.
    fn kick(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a valid u64 to our eventfd. It can only fail if the
        // counter would overflow, and then the handler has a wake-up pending anyway.
        unsafe {
            libc::write(self.kick.as_raw_fd(), (&one as *const u64).cast(), 8);
        }
    }
}

#[derive(Default)]
struct State {
    /// The highest `populate_requests` value answered: every block was loaded after it.
    populate_done: u64,
    /// Why the handler failed, if it did.
    failure: Option<String>,
    /// The handler thread has ended.
    exited: bool,
}

#[derive(Default)]
struct WorkingSet {
    prefetched: Vec<u64>,
    faulted: Vec<u64>,
}

#[derive(Default)]
struct Counters {
    faults: AtomicU64,
    blocks_copied: AtomicU64,
    zero_blocks: AtomicU64,
    prefetched_blocks: AtomicU64,
    bytes_read: AtomicU64,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// userfaultfd's errors print without their errno; this keeps it.
fn describe(error: &userfaultfd::Error) -> String {
    use userfaultfd::Error as E;
    match error {
        E::SystemError(errno) => errno.to_string(),
        E::CopyFailed(errno) => format!("UFFDIO_COPY: {errno}"),
        E::ZeropageFailed(errno) => format!("UFFDIO_ZEROPAGE: {errno}"),
        E::OpenDevUserfaultfd(e) => format!("cannot open /dev/userfaultfd: {e}"),
        other => other.to_string(),
    }
}

/// The errno of a failed userfaultfd ioctl, if it has one.
fn errno_of(error: &userfaultfd::Error) -> Option<i32> {
    use userfaultfd::Error as E;
    match error {
        E::SystemError(errno) | E::CopyFailed(errno) | E::ZeropageFailed(errno) => {
            Some(*errno as i32)
        }
        _ => None,
    }
}

/// A guest RAM region as the handler sees it.
#[derive(Clone, Copy, Debug)]
struct Region {
    host: usize,
    len: usize,
    file_offset: u64,
    /// Index of the region's first block among all regions' blocks.
    first_block: usize,
    /// Index of the region's first page among all regions' pages.
    first_page: usize,
}

/// One block: a `block_size` piece of a region (shorter at the region's end).
#[derive(Clone, Copy, Debug)]
struct Block {
    host: usize,
    len: usize,
    file_offset: u64,
}

/// Where the regions and their blocks are.
struct Layout {
    /// Sorted by host address, not overlapping.
    regions: Vec<Region>,
    block_size: usize,
    blocks: usize,
    pages: usize,
}

impl Layout {
    fn new(regions: &[HostRegion], block_size: usize) -> Result<Self, LazyError> {
        let bad = |what: String| Err(LazyError::Region(what));
        if regions.is_empty() {
            return bad("there are no regions".into());
        }
        let mut sorted: Vec<Region> = Vec::with_capacity(regions.len());
        for r in regions {
            let host = r.host_addr as usize;
            if host == 0 || host & (PAGE - 1) != 0 || r.len == 0 || r.len & (PAGE - 1) != 0 {
                return bad(format!(
                    "{:#x} (+{:#x}) is not a non-empty run of whole 4 KiB pages",
                    host, r.len
                ));
            }
            if host.checked_add(r.len).is_none()
                || r.file_offset.checked_add(r.len as u64).is_none()
            {
                return bad(format!(
                    "{:#x} (+{:#x}) at file offset {:#x} overflows",
                    host, r.len, r.file_offset
                ));
            }
            sorted.push(Region {
                host,
                len: r.len,
                file_offset: r.file_offset,
                first_block: 0,
                first_page: 0,
            });
        }
        sorted.sort_by_key(|r| r.host);
        let (mut blocks, mut pages) = (0usize, 0usize);
        for i in 0..sorted.len() {
            if i > 0 && sorted[i - 1].host + sorted[i - 1].len > sorted[i].host {
                return bad(format!(
                    "{:#x} (+{:#x}) overlaps {:#x}",
                    sorted[i].host,
                    sorted[i].len,
                    sorted[i - 1].host
                ));
            }
            sorted[i].first_block = blocks;
            sorted[i].first_page = pages;
            blocks += sorted[i].len.div_ceil(block_size);
            pages += sorted[i].len / PAGE;
        }
        Ok(Self {
            regions: sorted,
            block_size,
            blocks,
            pages,
        })
    }

    fn region_of_addr(&self, addr: usize) -> Option<&Region> {
        let i = self.regions.partition_point(|r| r.host + r.len <= addr);
        self.regions.get(i).filter(|r| r.host <= addr)
    }

    fn block_of_addr(&self, addr: usize) -> Option<usize> {
        let r = self.region_of_addr(addr)?;
        Some(r.first_block + (addr - r.host) / self.block_size)
    }

    fn block_of_file_offset(&self, offset: u64) -> Option<usize> {
        self.regions.iter().find_map(|r| {
            let within = offset.checked_sub(r.file_offset)?;
            usize::try_from(within)
                .ok()
                .filter(|&within| within < r.len)
                .map(|within| r.first_block + within / self.block_size)
        })
    }

    fn block(&self, index: usize) -> Block {
        let i = self
            .regions
            .partition_point(|r| r.first_block <= index)
            .saturating_sub(1);
        let r = &self.regions[i];
        let start = (index - r.first_block) * self.block_size;
        Block {
            host: r.host + start,
            len: self.block_size.min(r.len - start),
            file_offset: r.file_offset + start as u64,
        }
    }

    /// The global page indices of the pages in `[start, end)` that lie in regions.
    fn pages_in(&self, start: usize, end: usize) -> impl Iterator<Item = usize> + '_ {
        self.regions.iter().flat_map(move |r| {
            let from = start.max(r.host);
            let to = end.min(r.host + r.len);
            let pages = if from < to {
                (from - r.host) / PAGE..(to - r.host).div_ceil(PAGE)
            } else {
                0..0
            };
            pages.map(move |p| r.first_page + p)
        })
    }
}

/// Where the memory file has data; everything else (holes, past the end) reads as zeros.
struct Extents {
    /// The file's length when the restore started.
    len: u64,
    /// Sorted, disjoint `[start, end)` ranges.
    data: Vec<(u64, u64)>,
}

impl Extents {
    fn scan(file: &File) -> io::Result<Self> {
        let len = file.metadata()?.len();
        let data = mayfly_sys::extents::data_extents(file, 0, len)?
            .into_iter()
            .map(|(start, bytes)| (start, start + bytes))
            .collect();
        Ok(Self { len, data })
    }

    fn has_data(&self, offset: u64, len: usize) -> bool {
        let end = offset.saturating_add(len as u64);
        let i = self.data.partition_point(|&(_, e)| e <= offset);
        self.data.get(i).is_some_and(|&(s, _)| s < end)
    }
}

/// A read-only mapping of the memory file (benchmark only). Only the kernel reads it (as the
/// source of UFFDIO_COPY), so a truncated file gives EFAULT there rather than SIGBUS here.
struct MappedFile {
    addr: usize,
    len: usize,
}

impl MappedFile {
    fn new(file: &File, len: u64) -> io::Result<Self> {
        let len = usize::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: a new read-only shared mapping of a file we hold; the result is checked.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Self {
            addr: addr as usize,
            len,
        })
    }
}

impl Drop for MappedFile {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping `new` made, which nothing else refers to.
        unsafe {
            libc::munmap(self.addr as *mut libc::c_void, self.len);
        }
    }
}

/// A fixed-size bit set.
struct Bitmap(Vec<u64>, usize);

impl Bitmap {
    fn new(bits: usize) -> Self {
        Self(vec![0; bits.div_ceil(64)], bits)
    }

    fn get(&self, i: usize) -> bool {
        self.0[i / 64] & (1 << (i % 64)) != 0
    }

    fn set(&mut self, i: usize) {
        self.0[i / 64] |= 1 << (i % 64);
    }

    fn clear(&mut self, i: usize) {
        self.0[i / 64] &= !(1 << (i % 64));
    }

    /// The first clear bit at or after `from`, wrapping around once.
    fn next_clear(&self, from: usize) -> Option<usize> {
        let scan = |lo: usize, hi: usize| {
            let mut i = lo;
            while i < hi {
                let word = self.0[i / 64] | ((1u64 << (i % 64)) - 1);
                if word != u64::MAX {
                    let bit = (i / 64) * 64 + word.trailing_ones() as usize;
                    return (bit < hi).then_some(bit);
                }
                i = (i / 64 + 1) * 64;
            }
            None
        };
        scan(from.min(self.1), self.1).or_else(|| scan(0, from.min(self.1)))
    }
}

/// Why a block is being loaded.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Why {
    Fault,
    Prefetch,
    /// For `populate_all`: not part of the working set.
    Fill,
}

/// The outcome of placing memory with userfaultfd.
enum Placed {
    Done,
    /// An address-space change is in flight (EAGAIN): read events, then try again.
    Again,
}

/// The userfaultfd events the handler acts on.
enum Message {
    Fault(usize),
    /// `[start, end)` was discarded.
    Remove(usize, usize),
}

/// The handler's failure: the message for `on_failure`.
struct Fatal(String);

/// The handler thread's state.
struct Handler {
    uffd: Uffd,
    shared: Arc<Shared>,
    file: File,
    mapped: Option<MappedFile>,
    extents: Extents,
    layout: Layout,
    /// Blocks whose pages are all present.
    populated: Bitmap,
    /// Blocks not in `populated`.
    remaining: usize,
    /// Blocks already in the working set.
    recorded: Bitmap,
    /// Pages discarded (UFFD_EVENT_REMOVE): they read as zero from then on. Allocated on the
    /// first discard.
    discarded: Option<Bitmap>,
    /// Blocks still to prefetch, in order.
    prefetch: VecDeque<usize>,
    /// The block `serve_block` is loading and why, until `account` has counted it.
    accounting: Option<(usize, Why)>,
    /// Where `populate_all`'s sweep looks for the next missing block.
    fill_cursor: usize,
    /// The last `populate_requests` value answered.
    populate_done: u64,
    /// Addresses of faults read but not served yet, in order.
    pending: VecDeque<usize>,
    events: EventBuffer,
    /// Reused list of the events of one read.
    scratch: Vec<Message>,
    /// Reused read buffer, one block long.
    buf: Vec<u8>,
    on_failure: Option<Box<dyn FnOnce(String) + Send>>,
}

/// Marks the handler as gone even if it panics, so `populate_all` callers do not wait forever.
struct ExitGuard(Arc<Shared>);

impl Drop for ExitGuard {
    fn drop(&mut self) {
        lock(&self.0.state).exited = true;
        self.0.changed.notify_all();
    }
}

impl Handler {
    fn run(mut self) {
        let _exit = ExitGuard(self.shared.clone());
        match self.serve() {
            Ok(()) => self.release(),
            Err(Fatal(message)) => {
                // Release faulting threads before telling anyone: `on_failure` may well wait
                // for the vCPU threads, which may be blocked on a fault.
                self.release();
                lock(&self.shared.state).failure = Some(message.clone());
                self.shared.changed.notify_all();
                if let Some(on_failure) = self.on_failure.take() {
                    on_failure(message);
                }
            }
        }
        // Dropping `self.uffd` closes it, which would release any waiter left.
    }

    /// Unregister every region: faults on them are served by the kernel from now on, and
    /// threads waiting on one are woken.
    fn release(&self) {
        for r in &self.layout.regions {
            let _ = self.uffd.unregister(r.host as *mut libc::c_void, r.len);
        }
    }

    /// The main loop: faults first, then prefetch, then `populate_all`, one block at a time,
    /// checking for faults in between; sleep in poll when there is nothing to do.
    fn serve(&mut self) -> Result<(), Fatal> {
        loop {
            if self.shared.stop.load(Ordering::Acquire) {
                return Ok(());
            }
            if self.pending.is_empty() {
                self.drain_events()?;
            }
            if let Some(addr) = self.pending.pop_front() {
                self.serve_fault(addr)?;
                continue;
            }
            if let Some(block) = self.next_prefetch() {
                self.serve_block(block, Why::Prefetch)?;
                continue;
            }
            let requested = self.shared.populate_requests.load(Ordering::Acquire);
            if requested > self.populate_done {
                if self.remaining > 0 {
                    if let Some(block) = self.populated.next_clear(self.fill_cursor) {
                        self.fill_cursor = block + 1;
                        self.serve_block(block, Why::Fill)?;
                        continue;
                    }
                }
                self.populate_done = requested;
                lock(&self.shared.state).populate_done = requested;
                self.shared.changed.notify_all();
                continue;
            }
            self.wait()?;
        }
    }

    fn next_prefetch(&mut self) -> Option<usize> {
        while let Some(block) = self.prefetch.pop_front() {
            if !self.populated.get(block) {
                return Some(block);
            }
        }
        None
    }

    /// Sleep until the userfaultfd has events or someone kicks the eventfd.
    fn wait(&mut self) -> Result<(), Fatal> {
        let mut fds = [
            libc::pollfd {
                fd: self.uffd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.shared.kick.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a valid array of two pollfds for the duration of the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n < 0 {
            let error = io::Error::last_os_error();
            if error.kind() == io::ErrorKind::Interrupted {
                return Ok(());
            }
            return Err(Fatal(format!("cannot wait for page faults: {error}")));
        }
        if fds[0].revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 {
            return Err(Fatal("the userfaultfd reported an error".into()));
        }
        if fds[1].revents & libc::POLLIN != 0 {
            let mut count = 0u64;
            // SAFETY: reads 8 bytes into a valid u64 from our non-blocking eventfd; a failure
            // (EAGAIN) only means someone else consumed it.
            unsafe {
                libc::read(
                    self.shared.kick.as_raw_fd(),
                    (&mut count as *mut u64).cast(),
                    8,
                );
            }
        }
        Ok(())
    }

    /// Read every pending event: discards take effect at once (before any fault read with
    /// them is served: until a REMOVE event is read, every ioctl answers EAGAIN), faults join
    /// `pending`.
    fn drain_events(&mut self) -> Result<(), Fatal> {
        loop {
            let mut events = std::mem::take(&mut self.scratch);
            events.clear();
            let read = self
                .uffd
                .read_events(&mut self.events)
                .map_err(|e| Fatal(format!("cannot read userfaultfd events: {}", describe(&e))));
            let read = read.and_then(|iter| {
                for event in iter {
                    let event = event
                        .map_err(|e| Fatal(format!("bad userfaultfd event: {}", describe(&e))))?;
                    events.push(match event {
                        Event::Pagefault { addr, .. } => Message::Fault(addr as usize),
                        Event::Remove { start, end } => {
                            Message::Remove(start as usize, end as usize)
                        }
                        // Not subscribed to; nothing to do.
                        _ => continue,
                    });
                }
                Ok(())
            });
            let count = events.len();
            for event in events.drain(..) {
                match event {
                    Message::Remove(start, end) => self.discard(start, end),
                    Message::Fault(addr) => self.pending.push_back(addr),
                }
            }
            self.scratch = events;
            read?;
            if count < EVENT_BATCH {
                return Ok(());
            }
        }
    }

    /// The VMM discarded `[start, end)` (MADV_DONTNEED): those pages are missing again and read
    /// as zero from now on.
    fn discard(&mut self, start: usize, end: usize) {
        let discarded = self
            .discarded
            .get_or_insert_with(|| Bitmap::new(self.layout.pages));
        for page in self.layout.pages_in(start, end) {
            discarded.set(page);
        }
        let mut addr = start & !(PAGE - 1);
        while addr < end {
            let Some(region) = self.layout.region_of_addr(addr) else {
                // Not ours: skip to the next region, if any.
                match self.layout.regions.iter().find(|r| r.host > addr) {
                    Some(r) => addr = r.host,
                    None => break,
                }
                continue;
            };
            let block = region.first_block + (addr - region.host) / self.layout.block_size;
            if self.populated.get(block) {
                self.populated.clear(block);
                self.remaining += 1;
            }
            let block_end = region.host
                + ((addr - region.host) / self.layout.block_size + 1) * self.layout.block_size;
            addr = block_end.min(region.host + region.len);
        }
    }

    fn serve_fault(&mut self, addr: usize) -> Result<(), Fatal> {
        self.shared.stats.faults.fetch_add(1, Ordering::Relaxed);
        let page = addr & !(PAGE - 1);
        match self.layout.block_of_addr(page) {
            Some(block) if !self.populated.get(block) => self.serve_block(block, Why::Fault),
            Some(_) => self.serve_stale_fault(page),
            // Not ours (cannot happen): wake it so it does not hang.
            None => self.wake(page, PAGE),
        }
    }

    /// A fault on a block already loaded: usually a fault that raced with the load (the page
    /// is there: wake the thread), or a page discarded after a REMOVE event we already read
    /// (load just that page).
    fn serve_stale_fault(&mut self, page: usize) -> Result<(), Fatal> {
        let mut present = 0u8;
        // SAFETY: `page` is a page-aligned address in one of our regions and `present` has
        // room for the one page asked about.
        let rc = unsafe { libc::mincore(page as *mut libc::c_void, PAGE, &mut present) };
        if rc == 0 && present & 1 != 0 {
            return self.wake(page, PAGE);
        }
        let Some(region) = self.layout.region_of_addr(page).copied() else {
            return self.wake(page, PAGE);
        };
        let block = Block {
            host: page,
            len: PAGE,
            file_offset: region.file_offset + (page - region.host) as u64,
        };
        self.place_with_retry(block)
    }

    /// Load one whole block.
    fn serve_block(&mut self, index: usize, why: Why) -> Result<(), Fatal> {
        let block = self.layout.block(index);
        self.accounting = Some((index, why));
        self.place_with_retry(block)?;
        self.populated.set(index);
        self.remaining -= 1;
        Ok(())
    }

    /// Record and count the block `serve_block` is loading, once, just before the copy that
    /// wakes the faulting thread: whoever it tells then sees the block in the working set and
    /// the stats.
    fn account(&mut self, zero: bool) {
        let Some((index, why)) = self.accounting.take() else {
            return;
        };
        let stats = &self.shared.stats;
        if zero {
            stats.zero_blocks.fetch_add(1, Ordering::Relaxed);
        } else {
            stats.blocks_copied.fetch_add(1, Ordering::Relaxed);
        }
        if why == Why::Prefetch {
            stats.prefetched_blocks.fetch_add(1, Ordering::Relaxed);
        }
        if why != Why::Fill && !self.recorded.get(index) {
            self.recorded.set(index);
            let offset = self.layout.block(index).file_offset;
            let mut working = lock(&self.shared.working);
            match why {
                Why::Prefetch => working.prefetched.push(offset),
                _ => working.faulted.push(offset),
            }
        }
    }

    /// Fill the missing pages of `block`, retrying while an address-space change is in flight.
    fn place_with_retry(&mut self, block: Block) -> Result<(), Fatal> {
        let since = Instant::now();
        let mut tries = 0u32;
        loop {
            match self.place(block)? {
                Placed::Done => return Ok(()),
                Placed::Again => {
                    // Read the event that holds things up (a REMOVE); it may discard pages of
                    // this very block, so start the block over with its new contents.
                    self.drain_events()?;
                    if since.elapsed() > EAGAIN_LIMIT {
                        return Err(Fatal(format!(
                            "userfaultfd kept answering EAGAIN for {EAGAIN_LIMIT:?} at {:#x}",
                            block.host
                        )));
                    }
                    tries += 1;
                    if tries < 16 {
                        std::thread::yield_now();
                    } else {
                        std::thread::sleep(Duration::from_micros(50));
                    }
                }
            }
        }
    }

    /// Fill the missing pages of `block` once.
    fn place(&mut self, block: Block) -> Result<Placed, Fatal> {
        let src = self.source(block)?;
        self.account(src.is_none());
        self.copy(block, src)
    }

    /// Where to copy `block` from: `None` for the zero page (holes, zeros, discarded pages),
    /// else the file's bytes (discarded pages as zeros), in `buf` or the file mapping.
    fn source(&mut self, block: Block) -> Result<Option<*const u8>, Fatal> {
        let discarded = self.discarded.as_ref().map_or(0, |d| {
            self.layout
                .pages_in(block.host, block.host + block.len)
                .filter(|&p| d.get(p))
                .count()
        });
        if discarded == block.len / PAGE || !self.extents.has_data(block.file_offset, block.len) {
            return Ok(None);
        }
        let discarded = discarded > 0;
        if let Some(mapped) = &self.mapped {
            let end = block.file_offset + block.len as u64;
            if !discarded && end <= mapped.len as u64 {
                // Inside the mapping (checked above).
                let src = mapped.addr
                    + usize::try_from(block.file_offset).expect("an offset in the mapping");
                self.shared
                    .stats
                    .bytes_read
                    .fetch_add(block.len as u64, Ordering::Relaxed);
                return Ok(Some(src as *const u8));
            }
        }
        self.read(block.file_offset, block.len)?;
        if discarded {
            if let Some(d) = &self.discarded {
                for (i, page) in self
                    .layout
                    .pages_in(block.host, block.host + block.len)
                    .enumerate()
                {
                    if d.get(page) {
                        self.buf[i * PAGE..(i + 1) * PAGE].fill(0);
                    }
                }
            }
        }
        if is_zero(&self.buf[..block.len]) {
            Ok(None)
        } else {
            Ok(Some(self.buf.as_ptr()))
        }
    }

    /// Read `len` bytes of the file at `offset` into `buf`. Past the file's original end reads
    /// zeros; a file that ends earlier than it did at start was changed under us: fatal.
    fn read(&mut self, offset: u64, len: usize) -> Result<(), Fatal> {
        // At most `len`.
        let want = usize::try_from(self.extents.len.saturating_sub(offset).min(len as u64))
            .expect("at most len");
        let mut got = 0;
        while got < want {
            match self
                .file
                .read_at(&mut self.buf[got..want], offset + got as u64)
            {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(Fatal(format!(
                        "cannot read the memory file at offset {:#x}: {e}",
                        offset + got as u64
                    )))
                }
            }
        }
        self.shared
            .stats
            .bytes_read
            .fetch_add(got as u64, Ordering::Relaxed);
        if got < want {
            return Err(Fatal(format!(
                "the memory file ends at {:#x}, inside the {want} bytes at {offset:#x} it had when \
                 the restore started: it was truncated or replaced under a running VM",
                offset + got as u64
            )));
        }
        self.buf[want..len].fill(0);
        Ok(())
    }

    /// Place `block.len` bytes at `block.host` from `src`, or the zero page if `None`. Pages
    /// already present are left alone (EEXIST: a race, or pages of a partly discarded block)
    /// and their waiters woken.
    fn copy(&self, block: Block, src: Option<*const u8>) -> Result<Placed, Fatal> {
        use userfaultfd::Error as E;
        let mut done = 0;
        let mut existed = false;
        // UFFDIO_ZEROPAGE reports a partial fill (it met a present page) only as EAGAIN, like
        // a change in flight: after one, try a single page to tell which it was.
        let mut single = false;
        while done < block.len {
            let dst = (block.host + done) as *mut libc::c_void;
            let left = if single { PAGE } else { block.len - done };
            let result = match src {
                // SAFETY: `dst..dst+left` lies in a region registered with this userfaultfd,
                // which the caller of `start` keeps mapped; UFFDIO_COPY only fills missing
                // pages. `src..src+left` is readable: our buffer or file mapping, at least
                // `block.len` long from `src`.
                Some(src) => unsafe { self.uffd.copy(src.add(done).cast(), dst, left, true) },
                // SAFETY: as above; UFFDIO_ZEROPAGE only fills missing pages.
                None => unsafe { self.uffd.zeropage(dst, left, true) },
            };
            match result {
                Ok(n) if n > 0 && n <= left => done += n,
                // Progress, then a stop (EEXIST on a later page, or a change in flight).
                Err(E::PartiallyCopied(n)) if n > 0 && n <= left => done += n,
                Err(e) if errno_of(&e) == Some(libc::EEXIST) => {
                    existed = true;
                    done += PAGE;
                }
                Err(E::ZeropageFailed(errno)) if errno as i32 == libc::EAGAIN && !single => {
                    single = true;
                    continue;
                }
                Ok(_) | Err(E::PartiallyCopied(_)) => return Ok(Placed::Again),
                Err(e) if errno_of(&e) == Some(libc::EAGAIN) => return Ok(Placed::Again),
                Err(e) => {
                    return Err(Fatal(format!(
                        "cannot fill guest memory at {:#x}: {}",
                        dst as usize,
                        describe(&e)
                    )))
                }
            }
            single = false;
        }
        if existed {
            self.wake(block.host, block.len)?;
        }
        Ok(Placed::Done)
    }

    fn wake(&self, addr: usize, len: usize) -> Result<(), Fatal> {
        self.uffd.wake(addr as *mut libc::c_void, len).map_err(|e| {
            Fatal(format!(
                "cannot wake a thread at {addr:#x}: {}",
                describe(&e)
            ))
        })
    }
}

/// Whether `bytes` are all zero. Checks a page at a time, so data is usually recognised by its
/// first page.
fn is_zero(bytes: &[u8]) -> bool {
    bytes
        .chunks(PAGE)
        .all(|page| page.iter().fold(0u8, |acc, &b| acc | b) == 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::sync::atomic::AtomicUsize;
    use std::sync::mpsc;

    const MIB: usize = 1 << 20;

    /// Private anonymous memory, unmapped on drop.
    struct Anon {
        addr: usize,
        len: usize,
    }

    impl Anon {
        fn new(len: usize) -> Self {
            // SAFETY: a new private anonymous mapping; the result is checked.
            let addr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                    -1,
                    0,
                )
            };
            assert_ne!(addr, libc::MAP_FAILED);
            Self {
                addr: addr as usize,
                len,
            }
        }

        fn region(&self, file_offset: u64) -> HostRegion {
            HostRegion {
                host_addr: self.addr as *mut u8,
                len: self.len,
                file_offset,
            }
        }

        fn byte(&self, offset: usize) -> u8 {
            assert!(offset < self.len);
            // SAFETY: inside the mapping.
            unsafe { std::ptr::read_volatile((self.addr + offset) as *const u8) }
        }

        fn page(&self, offset: usize) -> &[u8] {
            assert!(offset + PAGE <= self.len);
            // SAFETY: inside the mapping, which lives as long as `self`.
            unsafe { std::slice::from_raw_parts((self.addr + offset) as *const u8, PAGE) }
        }
    }

    impl Drop for Anon {
        fn drop(&mut self) {
            // SAFETY: our own mapping.
            unsafe {
                libc::munmap(self.addr as *mut libc::c_void, self.len);
            }
        }
    }

    /// A file in the temp directory, removed on drop.
    struct TempFile(std::path::PathBuf);

    impl TempFile {
        fn new(tag: &str) -> Self {
            static N: AtomicUsize = AtomicUsize::new(0);
            let n = N.fetch_add(1, Ordering::Relaxed);
            let path =
                std::env::temp_dir().join(format!("mayfly-lazy-{tag}-{}-{n}", std::process::id()));
            Self(path)
        }

        fn create(&self) -> File {
            File::options()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&self.0)
                .unwrap()
        }

        fn open(&self) -> File {
            File::open(&self.0).unwrap()
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn pattern(offset: usize) -> u8 {
        ((offset / PAGE) as u8).wrapping_mul(31) ^ (offset % 251) as u8 | 1
    }

    /// A 12 MiB memory file: pattern, a 2 MiB hole at 3 MiB, 64 KiB of written zeros at 6 MiB,
    /// and its last 1 MiB missing (past the end). Returns the file and the expected 12 MiB.
    fn sample_file(tag: &str) -> (TempFile, Vec<u8>) {
        let size = 12 * MIB;
        let mut expected: Vec<u8> = (0..size).map(pattern).collect();
        expected[3 * MIB..5 * MIB].fill(0);
        expected[6 * MIB..6 * MIB + (64 << 10)].fill(0);
        expected[11 * MIB..].fill(0);
        let temp = TempFile::new(tag);
        let file = temp.create();
        file.write_all_at(&expected[..3 * MIB], 0).unwrap();
        file.write_all_at(&expected[5 * MIB..11 * MIB], 5 * MIB as u64)
            .unwrap();
        file.sync_all().unwrap();
        (temp, expected)
    }

    /// Guest RAM for the sample: an 8 MiB and a 4 MiB region (file offsets 0 and 8 MiB).
    fn sample_ram() -> (Anon, Anon) {
        (Anon::new(8 * MIB), Anon::new(4 * MIB))
    }

    type Failures = Arc<Mutex<Vec<String>>>;

    fn recorder() -> (Failures, Box<dyn FnOnce(String) + Send>) {
        let failures = Failures::default();
        let f = failures.clone();
        (failures, Box::new(move |m| lock(&f).push(m)))
    }

    fn start_sample(
        file: File,
        ram: &(Anon, Anon),
        options: LazyOptions,
        on_failure: Box<dyn FnOnce(String) + Send>,
    ) -> LazyMemory {
        let regions = [ram.0.region(0), ram.1.region(8 * MIB as u64)];
        // SAFETY: fresh private anonymous mappings that outlive the LazyMemory in every test.
        unsafe { start(file, &regions, options, on_failure) }.unwrap()
    }

    fn options(block_size: usize) -> LazyOptions {
        LazyOptions {
            block_size,
            prefetch: Vec::new(),
        }
    }

    /// Byte `offset` of the sample's guest RAM, as the file sees it.
    fn ram_byte(ram: &(Anon, Anon), offset: usize) -> u8 {
        if offset < 8 * MIB {
            ram.0.byte(offset)
        } else {
            ram.1.byte(offset - 8 * MIB)
        }
    }

    fn ram_page(ram: &(Anon, Anon), offset: usize) -> &[u8] {
        if offset < 8 * MIB {
            ram.0.page(offset)
        } else {
            ram.1.page(offset - 8 * MIB)
        }
    }

    /// xorshift64: enough randomness for shuffles without a dependency.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        fn shuffle<T>(&mut self, items: &mut [T]) {
            for i in (1..items.len()).rev() {
                items.swap(i, (self.next() % (i as u64 + 1)) as usize);
            }
        }
    }

    fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn lazy_two_threads_random_order_read_the_file() {
        for block_size in [4 << 10, 64 << 10, 2 * MIB] {
            let (temp, expected) = sample_file("content");
            let ram = sample_ram();
            let (failures, on_failure) = recorder();
            let lazy = start_sample(temp.open(), &ram, options(block_size), on_failure);
            let pages = expected.len() / PAGE;
            std::thread::scope(|s| {
                for seed in [1u64, 2] {
                    let (ram, expected) = (&ram, &expected);
                    s.spawn(move || {
                        let mut order: Vec<usize> = (0..pages).collect();
                        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15)).shuffle(&mut order);
                        for page in order {
                            let offset = page * PAGE;
                            assert!(
                                ram_page(ram, offset) == &expected[offset..offset + PAGE],
                                "page at {offset:#x} differs (block size {block_size})"
                            );
                        }
                    });
                }
            });
            let stats = lazy.stats();
            let blocks = (12 * MIB).div_ceil(block_size) as u64;
            assert_eq!(stats.blocks_copied + stats.zero_blocks, blocks, "{stats:?}");
            // Blocks in the hole, in the zeros written at 6 MiB or in the missing tail.
            let zero = expected
                .chunks(block_size)
                .filter(|block| block.iter().all(|&b| b == 0))
                .count() as u64;
            assert_eq!(stats.zero_blocks, zero, "{stats:?}");
            assert!(stats.faults >= blocks, "{stats:?}");
            assert_eq!(lazy.working_set().len() as u64, blocks);
            drop(lazy);
            assert!(lock(&failures).is_empty());
        }
    }

    /// A syscall that reads guest memory faults inside the kernel: that needs a userfaultfd
    /// that is not user-mode only, as KVM does.
    #[test]
    fn lazy_kernel_mode_faults_are_served() {
        let (temp, expected) = sample_file("kernel");
        let ram = sample_ram();
        let (failures, on_failure) = recorder();
        let lazy = start_sample(temp.open(), &ram, LazyOptions::default(), on_failure);
        let out = TempFile::new("kernel-out");
        let mut file = out.create();
        // SAFETY: the whole mapping, alive for the call.
        let all = unsafe { std::slice::from_raw_parts(ram.0.addr as *const u8, ram.0.len) };
        file.write_all(all).unwrap();
        let written = std::fs::read(&out.0).unwrap();
        assert!(written == expected[..8 * MIB]);
        assert!(lazy.stats().faults > 0);
        drop(lazy);
        assert!(lock(&failures).is_empty());
    }

    #[test]
    fn lazy_working_set_is_in_first_use_order() {
        let (temp, _) = sample_file("order");
        let ram = sample_ram();
        let (failures, on_failure) = recorder();
        let bs = 64 << 10;
        let lazy = start_sample(temp.open(), &ram, options(bs), on_failure);
        for block in [7usize, 2, 130, 9, 2, 7, 0] {
            ram_byte(&ram, block * bs + 5000);
        }
        let want: Vec<u64> = [7u64, 2, 130, 9, 0].iter().map(|b| b * bs as u64).collect();
        assert_eq!(lazy.working_set(), want);
        assert_eq!(lazy.stats().faults, 5);
        drop(lazy);
        assert!(lock(&failures).is_empty());
    }

    #[test]
    fn lazy_prefetch_loads_without_faults() {
        let (temp, expected) = sample_file("prefetch");
        let ram = sample_ram();
        let (failures, on_failure) = recorder();
        let bs = 64 << 10;
        let prefetch = vec![
            5 * bs as u64 + 100,
            bs as u64,
            (8 * MIB + 3 * bs) as u64,
            5 * bs as u64,     // again: loaded once
            (64 * MIB) as u64, // outside every region: ignored
        ];
        let lazy = start_sample(
            temp.open(),
            &ram,
            LazyOptions {
                block_size: bs,
                prefetch,
            },
            on_failure,
        );
        wait_until("prefetch", || lazy.stats().prefetched_blocks == 3);
        for offset in [5 * bs, bs + 4096, 8 * MIB + 3 * bs + bs - 1] {
            assert_eq!(ram_byte(&ram, offset), expected[offset]);
        }
        assert_eq!(lazy.stats().faults, 0);
        ram_byte(&ram, 3 * bs);
        let stats = lazy.stats();
        assert_eq!(stats.faults, 1);
        assert_eq!(stats.blocks_copied, 4);
        assert_eq!(stats.bytes_read, 4 * bs as u64);
        let want: Vec<u64> = [5 * bs, bs, 8 * MIB + 3 * bs, 3 * bs]
            .iter()
            .map(|&o| o as u64)
            .collect();
        assert_eq!(lazy.working_set(), want);
        drop(lazy);
        assert!(lock(&failures).is_empty());
    }

    #[test]
    fn lazy_populate_all_loads_everything() {
        let (temp, expected) = sample_file("populate");
        let ram = sample_ram();
        let (failures, on_failure) = recorder();
        let bs = 64 << 10;
        let lazy = start_sample(temp.open(), &ram, options(bs), on_failure);
        ram_byte(&ram, 0);
        lazy.populate_all().unwrap();
        let stats = lazy.stats();
        assert_eq!(
            stats.blocks_copied + stats.zero_blocks,
            (12 * MIB / bs) as u64
        );
        assert_eq!(stats.faults, 1);
        for offset in (0..12 * MIB).step_by(PAGE) {
            assert!(ram_page(&ram, offset) == &expected[offset..offset + PAGE]);
        }
        assert_eq!(lazy.stats().faults, 1, "no faults after populate_all");
        assert_eq!(
            lazy.working_set(),
            vec![0],
            "populate_all is not the working set"
        );
        lazy.populate_all().unwrap();
        drop(lazy);
        assert!(lock(&failures).is_empty());
    }

    /// MADV_DONTNEED on lazy memory: the handler reads the REMOVE event (the madvise waits for
    /// that), and the discarded pages read as zero afterwards, as without userfaultfd.
    #[test]
    fn lazy_discarded_pages_read_zero() {
        let (temp, expected) = sample_file("discard");
        let ram = sample_ram();
        let (failures, on_failure) = recorder();
        let bs = 64 << 10;
        let lazy = start_sample(temp.open(), &ram, options(bs), on_failure);
        assert_eq!(ram.0.byte(PAGE), expected[PAGE]);
        // One loaded page, and a block not loaded yet.
        for (offset, len) in [(PAGE, PAGE), (4 * bs, bs)] {
            // SAFETY: pages of our own mapping.
            let rc = unsafe {
                libc::madvise(
                    (ram.0.addr + offset) as *mut libc::c_void,
                    len,
                    libc::MADV_DONTNEED,
                )
            };
            assert_eq!(rc, 0);
        }
        assert!(ram.0.page(PAGE).iter().all(|&b| b == 0));
        assert!(ram.0.page(0) == &expected[..PAGE]);
        assert!(ram.0.page(2 * PAGE) == &expected[2 * PAGE..3 * PAGE]);
        assert!(ram.0.page(4 * bs).iter().all(|&b| b == 0));
        // The whole block was discarded: nothing to read for it.
        assert_eq!(lazy.stats().bytes_read, bs as u64 + bs as u64);
        lazy.populate_all().unwrap();
        assert!(ram.0.page(PAGE).iter().all(|&b| b == 0));
        assert!(ram.0.page(5 * bs) == &expected[5 * bs..5 * bs + PAGE]);
        drop(lazy);
        assert!(lock(&failures).is_empty());
    }

    /// A discarded page inside a block mapped as the zero page: the block is filled again
    /// around the pages still present.
    #[test]
    fn lazy_discard_inside_a_zero_block() {
        let (temp, _) = sample_file("discard-zero");
        let ram = sample_ram();
        let (failures, on_failure) = recorder();
        let bs = 64 << 10;
        let lazy = start_sample(temp.open(), &ram, options(bs), on_failure);
        let hole = 3 * MIB;
        assert_eq!(ram.0.byte(hole), 0);
        // Write to a page so it is a real page, then discard the one after it.
        // SAFETY: inside our mapping.
        unsafe { std::ptr::write_volatile((ram.0.addr + hole + PAGE) as *mut u8, 7) };
        // SAFETY: a page of our own mapping.
        let rc = unsafe {
            libc::madvise(
                (ram.0.addr + hole + 2 * PAGE) as *mut libc::c_void,
                PAGE,
                libc::MADV_DONTNEED,
            )
        };
        assert_eq!(rc, 0);
        assert_eq!(ram.0.byte(hole + 2 * PAGE), 0);
        assert_eq!(ram.0.byte(hole + PAGE), 7);
        assert_eq!(ram.0.byte(hole + 5 * PAGE), 0);
        let stats = lazy.stats();
        assert_eq!((stats.zero_blocks, stats.bytes_read), (2, 0), "{stats:?}");
        drop(lazy);
        assert!(lock(&failures).is_empty());
    }

    /// One thread discards pages while another reads them: every read ends with the file's
    /// bytes or zeros, and nothing hangs.
    #[test]
    fn lazy_discards_racing_with_faults() {
        let (temp, expected) = sample_file("discard-race");
        let ram = sample_ram();
        let (failures, on_failure) = recorder();
        let lazy = start_sample(temp.open(), &ram, options(64 << 10), on_failure);
        let (addr, len) = (ram.0.addr, ram.0.len);
        let (tx, done) = mpsc::channel();
        let discarder = std::thread::spawn(move || {
            let mut rng = Rng(7);
            for _ in 0..2000 {
                let page = rng.next() as usize % (len / PAGE);
                // SAFETY: a page of the test's mapping, which outlives this thread.
                let rc = unsafe {
                    libc::madvise(
                        (addr + page * PAGE) as *mut libc::c_void,
                        PAGE,
                        libc::MADV_DONTNEED,
                    )
                };
                assert_eq!(rc, 0);
            }
            let _ = tx.send(());
        });
        let mut rng = Rng(11);
        while done.try_recv().is_err() {
            let offset = (rng.next() as usize % (len / PAGE)) * PAGE;
            for (i, &b) in ram.0.page(offset).iter().enumerate() {
                assert!(b == 0 || b == expected[offset + i], "{offset:#x}+{i}");
            }
        }
        discarder.join().unwrap();
        lazy.populate_all().unwrap();
        drop(lazy);
        assert!(lock(&failures).is_empty());
    }

    #[test]
    fn lazy_truncated_file_fails_and_releases_the_faulting_thread() {
        let (temp, expected) = sample_file("truncate");
        let ram = sample_ram();
        let (tx, failed) = mpsc::channel();
        let lazy = start_sample(
            temp.open(),
            &ram,
            options(64 << 10),
            Box::new(move |message| tx.send(message).unwrap()),
        );
        assert_eq!(ram.0.byte(0), expected[0]);
        File::options()
            .write(true)
            .open(&temp.0)
            .unwrap()
            .set_len(0)
            .unwrap();
        let (tx, touched) = mpsc::channel();
        let addr = ram.0.addr + 2 * MIB;
        std::thread::spawn(move || {
            // SAFETY: inside the mapping, which outlives this thread in the test (the test
            // waits for the thread's answer before it ends, or fails and leaks nothing worse).
            let byte = unsafe { std::ptr::read_volatile(addr as *const u8) };
            let _ = tx.send(byte);
        });
        let message = failed.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(message.contains("truncated"), "{message}");
        let byte = touched.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(byte, 0, "released threads see zero pages");
        assert!(matches!(lazy.populate_all(), Err(LazyError::Failed(_))));
        // The regions are unregistered: untouched memory is plain anonymous memory now.
        assert_eq!(ram.1.byte(0), 0);
        drop(lazy);
    }

    #[test]
    fn lazy_drop_stops_the_thread_and_unregisters() {
        let (temp, expected) = sample_file("drop");
        let ram = sample_ram();
        let (failures, on_failure) = recorder();
        let lazy = start_sample(temp.open(), &ram, LazyOptions::default(), on_failure);
        assert_eq!(ram.0.byte(PAGE), expected[PAGE]);
        let shared = Arc::downgrade(&lazy.shared);
        let (tx, dropped) = mpsc::channel();
        std::thread::spawn(move || {
            drop(lazy);
            let _ = tx.send(());
        });
        dropped.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(shared.upgrade().is_none(), "the handler thread is gone");
        assert_eq!(ram.0.byte(2 * MIB), 0, "unregistered: no handler, no hang");
        assert!(lock(&failures).is_empty());
    }

    #[test]
    fn lazy_rejects_bad_input() {
        let ram = sample_ram();
        let temp = TempFile::new("bad");
        temp.create();
        let start = |regions: &[HostRegion], block_size| {
            // SAFETY: only invalid input, which `start` rejects before registering anything.
            unsafe { super::start(temp.open(), regions, options(block_size), Box::new(|_| {})) }
        };
        let good = ram.0.region(0);
        for bs in [0, 1000, 2048, 3 * PAGE, 2 << 30] {
            assert!(matches!(start(&[good], bs), Err(LazyError::BlockSize(_))));
        }
        let unaligned = HostRegion {
            host_addr: (ram.0.addr + 1) as *mut u8,
            ..good
        };
        let overlapping = HostRegion {
            host_addr: (ram.0.addr + PAGE) as *mut u8,
            len: PAGE,
            ..good
        };
        for regions in [&[][..], &[unaligned], &[good, overlapping]] {
            assert!(matches!(start(regions, PAGE), Err(LazyError::Region(_))));
        }
    }

    #[test]
    fn lazy_memory_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<LazyMemory>();
    }

    #[test]
    fn lazy_bitmap_next_clear_wraps() {
        let mut bits = Bitmap::new(130);
        for i in 0..130 {
            bits.set(i);
        }
        assert_eq!(bits.next_clear(0), None);
        bits.clear(3);
        bits.clear(129);
        assert_eq!(bits.next_clear(0), Some(3));
        assert_eq!(bits.next_clear(4), Some(129));
        assert_eq!(bits.next_clear(130), Some(3));
        bits.set(129);
        assert_eq!(bits.next_clear(64), Some(3));
    }

    /// Block sizes and read modes, touching 128 MiB from one thread, with the memory file in
    /// the page cache or not. Run by hand:
    /// `cargo test --release -p mayfly-vmm lazy::tests::bench -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn bench_block_sizes() {
        const SIZE: usize = 128 * MIB;
        let temp = TempFile::new("bench");
        {
            let mut rng = Rng(0x1234_5678);
            let data: Vec<u8> = (0..SIZE / 8)
                .flat_map(|_| (rng.next() | 0x0101_0101_0101_0101).to_ne_bytes())
                .collect();
            let mut file = temp.create();
            file.write_all(&data).unwrap();
            file.sync_all().unwrap();
        }
        let pages = SIZE / PAGE;
        let sequential: Vec<usize> = (0..pages).collect();
        let mut random = sequential.clone();
        Rng(42).shuffle(&mut random);
        let patterns: [(&str, &[usize]); 5] = [
            ("sequential", &sequential),
            ("random", &random),
            ("random 10%", &random[..pages / 10]),
            ("random 1%", &random[..pages / 100]),
            ("populate", &[]),
        ];
        println!("cache mode   block  pattern     total ms  us/page  faults  MiB read");
        for cold in [false, true] {
            for mode in [ReadMode::Pread, ReadMode::Mmap] {
                for bs in [4 << 10, 64 << 10, 2 * MIB] {
                    for (name, order) in patterns {
                        let file = temp.open();
                        if cold {
                            // SAFETY: advice on our own descriptor.
                            let rc = unsafe {
                                libc::posix_fadvise(
                                    file.as_raw_fd(),
                                    0,
                                    0,
                                    libc::POSIX_FADV_DONTNEED,
                                )
                            };
                            assert_eq!(rc, 0);
                        }
                        let ram = Anon::new(SIZE);
                        // SAFETY: a fresh private anonymous mapping that outlives the
                        // LazyMemory.
                        let lazy = unsafe {
                            start_with(
                                file,
                                &[ram.region(0)],
                                options(bs),
                                Box::new(|m| panic!("{m}")),
                                mode,
                            )
                        }
                        .unwrap();
                        let t = Instant::now();
                        let mut sum = 0u64;
                        for &page in order.iter() {
                            sum += ram.byte(page * PAGE) as u64;
                        }
                        if order.is_empty() {
                            lazy.populate_all().unwrap();
                        }
                        let elapsed = t.elapsed();
                        assert!(sum > 0 || order.is_empty());
                        let stats = lazy.stats();
                        let touched = if order.is_empty() { pages } else { order.len() };
                        println!(
                            "{:<5} {:<6} {:>5}K  {:<10} {:>9.1} {:>8.2} {:>7} {:>9}",
                            if cold { "cold" } else { "warm" },
                            format!("{mode:?}"),
                            bs >> 10,
                            name,
                            elapsed.as_secs_f64() * 1e3,
                            elapsed.as_secs_f64() * 1e6 / touched as f64,
                            stats.faults,
                            stats.bytes_read >> 20
                        );
                    }
                }
            }
        }
    }
}
