//! Guest RAM: one memory file (a memfd for a fresh VM) mapped into the VMM and registered with
//! KVM as memory slots. Keeping RAM in a file is what lets later steps snapshot it by writing
//! the file out and fork it by mapping the same file again.

use std::fs::File;
use std::os::fd::FromRawFd;

use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap};

use crate::arch::layout::{ram_ranges, RamRange};

/// The guest's physical memory as the VMM sees it.
pub type GuestMemory = GuestMemoryMmap<()>;

#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("cannot create the guest memory file: {0}")]
    Memfd(std::io::Error),
    #[error("cannot size the guest memory file to {mib} MiB: {source}")]
    Resize { mib: u64, source: std::io::Error },
    #[error("cannot map {mib} MiB of guest memory: {source}")]
    Map {
        mib: u64,
        source: vm_memory::mmap::MmapRegionError,
    },
    #[error("guest memory layout is invalid: {0}")]
    Layout(String),
}

/// Guest RAM and the file behind it.
pub struct GuestRam {
    pub memory: GuestMemory,
    pub file: File,
    pub ranges: Vec<RamRange>,
}

impl GuestRam {
    /// Fresh zeroed RAM of `mem_bytes` in an anonymous memory file.
    pub fn new_memfd(mem_bytes: u64) -> Result<Self, MemoryError> {
        // SAFETY: the name is a valid NUL-terminated string; the return value is checked.
        let fd = unsafe { libc::memfd_create(c"mayfly-guest-ram".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(MemoryError::Memfd(std::io::Error::last_os_error()));
        }
        // SAFETY: memfd_create returned a new descriptor that nothing else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(mem_bytes)
            .map_err(|source| MemoryError::Resize {
                mib: mem_bytes >> 20,
                source,
            })?;
        Self::map(file, mem_bytes, libc::MAP_SHARED)
    }

    /// Map `file` (holding `mem_bytes` of RAM) with `flags` (MAP_SHARED or MAP_PRIVATE).
    fn map(file: File, mem_bytes: u64, flags: i32) -> Result<Self, MemoryError> {
        let ranges = ram_ranges(mem_bytes);
        let mut regions = Vec::with_capacity(ranges.len());
        for range in &ranges {
            let map_err = |source| MemoryError::Map {
                mib: range.size >> 20,
                source,
            };
            let fd = file.try_clone().map_err(MemoryError::Memfd)?;
            let size = usize::try_from(range.size)
                .map_err(|_| MemoryError::Layout(format!("{} bytes", range.size)))?;
            let mapping = MmapRegionBuilder::new(size)
                .with_file_offset(FileOffset::new(fd, range.file_offset))
                .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
                .with_mmap_flags(flags | libc::MAP_NORESERVE)
                .build()
                .map_err(map_err)?;
            // Ask for transparent huge pages: a guest touching its RAM then takes one (nested)
            // page fault per 2 MiB instead of per 4 KiB, which halves a Linux boot on a
            // nested KVM. The host decides (for memfd RAM,
            // /sys/kernel/mm/transparent_hugepage/shmem_enabled must be `advise` or `always`);
            // without THP support this fails harmlessly.
            // SAFETY: advice on a mapping we just created and own; it does not change contents.
            unsafe {
                libc::madvise(mapping.as_ptr().cast(), size, libc::MADV_HUGEPAGE);
            }
            let region = GuestRegionMmap::new(mapping, GuestAddress(range.guest_addr))
                .ok_or_else(|| MemoryError::Layout(format!("{range:?} overflows")))?;
            regions.push(region);
        }
        let memory =
            GuestMemory::from_regions(regions).map_err(|e| MemoryError::Layout(e.to_string()))?;
        Ok(Self {
            memory,
            file,
            ranges,
        })
    }
}
