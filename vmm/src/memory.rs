//! Guest RAM: one file's worth of memory mapped into the VMM and registered with KVM as memory
//! slots. Which file, and how it is mapped, is what the memory modes differ in:
//!
//! - [`RamKind::Memfd`]: a memfd mapped shared. A fresh boot starts here, and an eager restore
//!   copies a snapshot's memory into one.
//! - [`RamKind::CopyOnWrite`]: a snapshot's memory file mapped private. Restores of one snapshot
//!   share its clean pages through the page cache; the file never changes.
//! - [`RamKind::Lazy`]: anonymous memory that a userfaultfd handler fills from the snapshot's
//!   memory file as the guest touches it (see [`crate::lazy`]).
//!
//! In every kind, a page this process has not mapped yet reads as the same page of
//! [`GuestRam::backing`], which is what lets a snapshot be written without touching pages the
//! guest never used.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};

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
    #[error("cannot copy the snapshot's memory into guest RAM: {0}")]
    Copy(std::io::Error),
    #[error("guest memory layout is invalid: {0}")]
    Layout(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RamKind {
    Memfd,
    CopyOnWrite,
    Lazy,
}

impl RamKind {
    pub fn name(self) -> &'static str {
        match self {
            RamKind::Memfd => "memfd",
            RamKind::CopyOnWrite => "cow",
            RamKind::Lazy => "lazy",
        }
    }
}

/// Guest RAM and the file behind it.
pub struct GuestRam {
    pub memory: GuestMemory,
    pub ranges: Vec<RamRange>,
    /// Where a page this process has not mapped comes from: the memfd itself, or the snapshot's
    /// memory file.
    pub backing: File,
    pub kind: RamKind,
}

/// One region as mapped in this process.
#[derive(Clone, Copy, Debug)]
pub struct HostRegion {
    pub host_addr: *mut u8,
    pub len: usize,
    pub file_offset: u64,
}

fn memfd(len: u64) -> Result<File, MemoryError> {
    // SAFETY: the name is a valid NUL-terminated string; the return value is checked.
    let fd = unsafe { libc::memfd_create(c"mayfly-guest-ram".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(MemoryError::Memfd(std::io::Error::last_os_error()));
    }
    // SAFETY: memfd_create returned a new descriptor that nothing else owns.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(len).map_err(|source| MemoryError::Resize {
        mib: len >> 20,
        source,
    })?;
    Ok(file)
}

impl GuestRam {
    /// Fresh zeroed RAM of `mem_bytes` in a memfd.
    pub fn new_memfd(mem_bytes: u64) -> Result<Self, MemoryError> {
        let file = memfd(mem_bytes)?;
        Self::map(file, &ram_ranges(mem_bytes), RamKind::Memfd)
    }

    /// A snapshot's memory, mapped copy-on-write.
    pub fn copy_on_write(file: File, ranges: &[RamRange]) -> Result<Self, MemoryError> {
        Self::map(file, ranges, RamKind::CopyOnWrite)
    }

    /// Anonymous memory to be filled from `file` by a userfaultfd handler.
    pub fn lazy(file: File, ranges: &[RamRange]) -> Result<Self, MemoryError> {
        Self::map(file, ranges, RamKind::Lazy)
    }

    /// A snapshot's memory copied into a fresh memfd (only its data: holes stay holes).
    pub fn eager(file: &File, ranges: &[RamRange]) -> Result<Self, MemoryError> {
        let total = ranges
            .iter()
            .map(|r| r.file_offset + r.size)
            .max()
            .unwrap_or(0);
        let mem = memfd(total)?;
        for (start, len) in data_extents(file, 0, total).map_err(MemoryError::Copy)? {
            copy_range(file, &mem, start, len).map_err(MemoryError::Copy)?;
        }
        Self::map(mem, ranges, RamKind::Memfd)
    }

    fn map(file: File, ranges: &[RamRange], kind: RamKind) -> Result<Self, MemoryError> {
        let mut regions = Vec::with_capacity(ranges.len());
        for range in ranges {
            let map_err = |source| MemoryError::Map {
                mib: range.size >> 20,
                source,
            };
            let size = usize::try_from(range.size)
                .map_err(|_| MemoryError::Layout(format!("{} bytes", range.size)))?;
            let builder =
                MmapRegionBuilder::new(size).with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE);
            let builder = match kind {
                RamKind::Memfd => builder
                    .with_file_offset(FileOffset::new(
                        file.try_clone().map_err(MemoryError::Memfd)?,
                        range.file_offset,
                    ))
                    .with_mmap_flags(libc::MAP_SHARED | libc::MAP_NORESERVE),
                RamKind::CopyOnWrite => builder
                    .with_file_offset(FileOffset::new(
                        file.try_clone().map_err(MemoryError::Memfd)?,
                        range.file_offset,
                    ))
                    .with_mmap_flags(libc::MAP_PRIVATE | libc::MAP_NORESERVE),
                RamKind::Lazy => builder
                    .with_mmap_flags(libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE),
            };
            let mapping = builder.build().map_err(map_err)?;
            // Ask for transparent huge pages: a guest touching its RAM then takes one (nested)
            // page fault per 2 MiB instead of per 4 KiB, which halves a Linux boot on a
            // nested KVM. The host decides (for memfd RAM,
            // /sys/kernel/mm/transparent_hugepage/shmem_enabled must be `advise` or `always`).
            // Not for lazy RAM: userfaultfd fills it in blocks of its own choosing.
            if kind != RamKind::Lazy {
                // SAFETY: advice on a mapping we just created; it does not change contents.
                unsafe { libc::madvise(mapping.as_ptr().cast(), size, libc::MADV_HUGEPAGE) };
            }
            let region = GuestRegionMmap::new(mapping, GuestAddress(range.guest_addr))
                .ok_or_else(|| MemoryError::Layout(format!("{range:?} overflows")))?;
            regions.push(region);
        }
        let memory =
            GuestMemory::from_regions(regions).map_err(|e| MemoryError::Layout(e.to_string()))?;
        Ok(Self {
            memory,
            ranges: ranges.to_vec(),
            backing: file,
            kind,
        })
    }

    /// Total bytes of guest RAM.
    pub fn size(&self) -> u64 {
        self.ranges.iter().map(|r| r.size).sum()
    }

    /// Each region's host mapping and place in the memory file.
    pub fn host_regions(&self) -> Vec<HostRegion> {
        use vm_memory::GuestMemoryBackend;
        self.ranges
            .iter()
            .map(|range| HostRegion {
                host_addr: self
                    .memory
                    .get_host_address(GuestAddress(range.guest_addr))
                    .expect("every range is mapped"),
                len: range.size as usize,
                file_offset: range.file_offset,
            })
            .collect()
    }
}

/// The (start, length) extents of `file` holding data within `start..start + len`; the rest
/// are holes (read as zeros).
pub fn data_extents(file: &File, start: u64, len: u64) -> std::io::Result<Vec<(u64, u64)>> {
    let end = start + len;
    let mut extents = Vec::new();
    let mut pos = start;
    while pos < end {
        // SAFETY: lseek on a valid fd; the result is checked.
        let data = unsafe { libc::lseek(file.as_raw_fd(), pos as i64, libc::SEEK_DATA) };
        if data < 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::ENXIO) {
                break; // no data after pos
            }
            return Err(err);
        }
        let data = data as u64;
        if data >= end {
            break;
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(file.as_raw_fd(), data as i64, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let hole = (hole as u64).min(end);
        extents.push((data, hole - data));
        pos = hole;
    }
    Ok(extents)
}

/// Copy `len` bytes at `offset` from one file to the same offset of another, in the kernel
/// where it can (copy_file_range), by reading and writing where it cannot.
fn copy_range(from: &File, to: &File, offset: u64, len: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let mut done = 0u64;
    while done < len {
        let mut off_in = (offset + done) as i64;
        let mut off_out = off_in;
        // SAFETY: valid fds and offsets we own; the result is checked.
        let n = unsafe {
            libc::copy_file_range(
                from.as_raw_fd(),
                &mut off_in,
                to.as_raw_fd(),
                &mut off_out,
                (len - done) as usize,
                0,
            )
        };
        if n > 0 {
            done += n as u64;
            continue;
        }
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        let err = std::io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EXDEV)
            | Some(libc::EINVAL)
            | Some(libc::ENOSYS)
            | Some(libc::EOPNOTSUPP) => break,
            Some(libc::EINTR) => continue,
            _ => return Err(err),
        }
    }
    let mut buf = vec![0u8; 1 << 20];
    while done < len {
        let chunk = ((len - done) as usize).min(buf.len());
        from.read_exact_at(&mut buf[..chunk], offset + done)?;
        to.write_all_at(&buf[..chunk], offset + done)?;
        done += chunk as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    #[test]
    fn extents_and_eager_copy_keep_holes() {
        let src = memfd(8 << 20).unwrap();
        src.write_all_at(&[1u8; 4096], 0).unwrap();
        src.write_all_at(&[2u8; 8192], 5 << 20).unwrap();
        let extents = data_extents(&src, 0, 8 << 20).unwrap();
        assert_eq!(extents.len(), 2, "{extents:?}");
        assert_eq!(extents[0].0, 0);
        assert!(extents[1].0 <= 5 << 20 && extents[1].0 + extents[1].1 >= (5 << 20) + 8192);

        let ranges = ram_ranges(8 << 20);
        let ram = GuestRam::eager(&src, &ranges).unwrap();
        assert_eq!(ram.kind, RamKind::Memfd);
        let mut byte = [0u8; 1];
        ram.backing
            .read_exact_at(&mut byte, (5 << 20) + 100)
            .unwrap();
        assert_eq!(byte, [2]);
        ram.backing.read_exact_at(&mut byte, 3 << 20).unwrap();
        assert_eq!(byte, [0]);
        let copied = data_extents(&ram.backing, 0, 8 << 20).unwrap();
        let copied_bytes: u64 = copied.iter().map(|e| e.1).sum();
        assert!(copied_bytes < 4 << 20, "holes stay holes: {copied:?}");
    }

    #[test]
    fn copy_on_write_never_changes_the_file() {
        let src = memfd(2 << 20).unwrap();
        src.write_all_at(&[7u8; 4096], 4096).unwrap();
        let ranges = ram_ranges(2 << 20);
        let ram = GuestRam::copy_on_write(src.try_clone().unwrap(), &ranges).unwrap();
        let region = ram.host_regions()[0];
        // SAFETY: inside the 2 MiB mapping this test owns.
        unsafe {
            assert_eq!(*region.host_addr.add(4096), 7);
            *region.host_addr.add(4096) = 9;
            assert_eq!(*region.host_addr.add(4096), 9);
        }
        let mut byte = [0u8; 1];
        src.read_exact_at(&mut byte, 4096).unwrap();
        assert_eq!(byte, [7]);
    }
}
