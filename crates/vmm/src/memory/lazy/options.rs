//! What a lazy restore is asked to do and what it reports: its options (block size, blocks to
//! prefetch), the counters of what the handler did, and its errors.

use std::io;

/// Bytes copied per fault unless told otherwise, chosen by the measurements above.
pub const DEFAULT_BLOCK_SIZE: usize = 64 << 10;

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
