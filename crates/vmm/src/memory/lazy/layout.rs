//! Where guest memory lies over the memory file: the regions and their blocks, the file's data
//! extents (holes read as zeros), the benchmark's read-only mapping of the file, and the bit
//! sets the handler keeps per block and per page.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

use super::options::LazyError;
use crate::memory::ram::HostRegion;

/// The host page size (x86-64): the unit userfaultfd maps in.
pub(super) const PAGE: usize = 4096;

/// A guest RAM region as the handler sees it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Region {
    pub(super) host: usize,
    pub(super) len: usize,
    pub(super) file_offset: u64,
    /// Index of the region's first block among all regions' blocks.
    pub(super) first_block: usize,
    /// Index of the region's first page among all regions' pages.
    pub(super) first_page: usize,
}

/// One block: a `block_size` piece of a region (shorter at the region's end).
#[derive(Clone, Copy, Debug)]
pub(super) struct Block {
    pub(super) host: usize,
    pub(super) len: usize,
    pub(super) file_offset: u64,
}

/// Where the regions and their blocks are.
pub(super) struct Layout {
    /// Sorted by host address, not overlapping.
    pub(super) regions: Vec<Region>,
    pub(super) block_size: usize,
    pub(super) blocks: usize,
    pub(super) pages: usize,
}

impl Layout {
    pub(super) fn new(regions: &[HostRegion], block_size: usize) -> Result<Self, LazyError> {
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

    pub(super) fn region_of_addr(&self, addr: usize) -> Option<&Region> {
        let i = self.regions.partition_point(|r| r.host + r.len <= addr);
        self.regions.get(i).filter(|r| r.host <= addr)
    }

    pub(super) fn block_of_addr(&self, addr: usize) -> Option<usize> {
        let r = self.region_of_addr(addr)?;
        Some(r.first_block + (addr - r.host) / self.block_size)
    }

    pub(super) fn block_of_file_offset(&self, offset: u64) -> Option<usize> {
        self.regions.iter().find_map(|r| {
            let within = offset.checked_sub(r.file_offset)?;
            usize::try_from(within)
                .ok()
                .filter(|&within| within < r.len)
                .map(|within| r.first_block + within / self.block_size)
        })
    }

    pub(super) fn block(&self, index: usize) -> Block {
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
    pub(super) fn pages_in(&self, start: usize, end: usize) -> impl Iterator<Item = usize> + '_ {
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
pub(super) struct Extents {
    /// The file's length when the restore started.
    pub(super) len: u64,
    /// Sorted, disjoint `[start, end)` ranges.
    data: Vec<(u64, u64)>,
}

impl Extents {
    pub(super) fn scan(file: &File) -> io::Result<Self> {
        let len = file.metadata()?.len();
        let data = mayfly_sys::extents::data_extents(file, 0, len)?
            .into_iter()
            .map(|(start, bytes)| (start, start + bytes))
            .collect();
        Ok(Self { len, data })
    }

    pub(super) fn has_data(&self, offset: u64, len: usize) -> bool {
        let end = offset.saturating_add(len as u64);
        let i = self.data.partition_point(|&(_, e)| e <= offset);
        self.data.get(i).is_some_and(|&(s, _)| s < end)
    }
}

/// A read-only mapping of the memory file (benchmark only). Only the kernel reads it (as the
/// source of UFFDIO_COPY), so a truncated file gives EFAULT there rather than SIGBUS here.
pub(super) struct MappedFile {
    pub(super) addr: usize,
    pub(super) len: usize,
}

impl MappedFile {
    pub(super) fn new(file: &File, len: u64) -> io::Result<Self> {
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
pub(super) struct Bitmap(Vec<u64>, usize);

impl Bitmap {
    pub(super) fn new(bits: usize) -> Self {
        Self(vec![0; bits.div_ceil(64)], bits)
    }

    pub(super) fn get(&self, i: usize) -> bool {
        self.0[i / 64] & (1 << (i % 64)) != 0
    }

    pub(super) fn set(&mut self, i: usize) {
        self.0[i / 64] |= 1 << (i % 64);
    }

    pub(super) fn clear(&mut self, i: usize) {
        self.0[i / 64] &= !(1 << (i % 64));
    }

    /// The first clear bit at or after `from`, wrapping around once.
    pub(super) fn next_clear(&self, from: usize) -> Option<usize> {
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

#[cfg(test)]
mod tests {
    use super::Bitmap;

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
}
