//! Writing guest RAM out sparse: which pages a copy-on-write VM wrote (the kernel's page
//! table says: /proc/self/pagemap), and memory files that hold every non-zero page and
//! nothing else (a page of zeros is a hole), for full and diff snapshots.

use std::fs::File;
use std::os::unix::fs::FileExt;

use mayfly_snapshot::Extent;
use mayfly_sys::extents::data_extents;

use crate::memory::ram::{GuestRam, HostRegion, RamKind, PAGE};

/// What [`GuestRam::write_sparse`] wrote.
pub struct SparseWritten {
    pub bytes: u64,
    /// Offsets of the pages this process had mapped (for a copy-on-write VM: what the guest
    /// touched since it was restored).
    pub touched: Vec<u64>,
}

fn is_zero(bytes: &[u8]) -> bool {
    // SAFETY: reinterpreting initialised bytes as u128 words is always valid.
    let (head, words, tail) = unsafe { bytes.align_to::<u128>() };
    head.iter().all(|&b| b == 0) && words.iter().all(|&w| w == 0) && tail.iter().all(|&b| b == 0)
}

/// pagemap: the page is present.
const PM_PRESENT: u64 = 1 << 63;
/// pagemap: the page is swapped out.
const PM_SWAPPED: u64 = 1 << 62;
/// pagemap: the page is a file page (or shared anonymous memory).
const PM_FILE: u64 = 1 << 61;

/// The /proc/self/pagemap entry of each page of `addr..addr + len`.
fn page_flags(addr: *const u8, len: usize) -> std::io::Result<Vec<u64>> {
    let pagemap = File::open("/proc/self/pagemap")?;
    let pages = len / PAGE;
    let mut flags = Vec::with_capacity(pages);
    let mut buf = vec![0u8; 8 * 4096];
    let first = addr as u64 / PAGE as u64;
    let mut done = 0usize;
    while done < pages {
        let n = (pages - done).min(buf.len() / 8);
        pagemap.read_exact_at(&mut buf[..n * 8], (first + done as u64) * 8)?;
        flags.extend(
            buf[..n * 8]
                .chunks_exact(8)
                .map(|e| u64::from_le_bytes(e.try_into().expect("8 bytes"))),
        );
        done += n;
    }
    Ok(flags)
}

/// Which pages of `addr..addr + len` this process has in its mapping: present, or swapped out
/// (a page the guest wrote and the host swapped is still its own: read through the mapping,
/// it faults back in; the file behind it holds older contents).
fn mapped_pages(addr: *const u8, len: usize) -> std::io::Result<Vec<bool>> {
    Ok(page_flags(addr, len)?
        .into_iter()
        .map(|f| f & (PM_PRESENT | PM_SWAPPED) != 0)
        .collect())
}

/// Consecutive pages of one mapped region written out to `out` in one write each (at the
/// region's file offsets), for [`GuestRam::write_sparse`] and [`GuestRam::write_pages`].
struct Runs<'a> {
    region: &'a HostRegion,
    out: &'a File,
    /// The run being gathered: its first page (in the region) and its length, pages.
    run: Option<(usize, usize)>,
    written: u64,
}

impl<'a> Runs<'a> {
    fn new(region: &'a HostRegion, out: &'a File) -> Self {
        Self {
            region,
            out,
            run: None,
            written: 0,
        }
    }

    /// Page `page` of the region (mapped, and the vCPUs paused) goes out: with the run it
    /// follows, else the run before is written and a new one starts.
    fn add(&mut self, page: usize) -> std::io::Result<()> {
        match &mut self.run {
            Some((first, count)) if *first + *count == page => *count += 1,
            _ => {
                self.flush()?;
                self.run = Some((page, 1));
            }
        }
        Ok(())
    }

    /// Write the run gathered, if any.
    fn flush(&mut self) -> std::io::Result<()> {
        if let Some((first, count)) = self.run.take() {
            // SAFETY: the run lies inside the region's mapping (its pages were added as
            // mapped pages of it), and the vCPUs are paused.
            let bytes = unsafe {
                std::slice::from_raw_parts(self.region.host_addr.add(first * PAGE), count * PAGE)
            };
            self.out
                .write_all_at(bytes, self.region.file_offset + (first * PAGE) as u64)?;
            self.written += bytes.len() as u64;
        }
        Ok(())
    }

    /// Write what is left; the bytes written through runs.
    fn finish(mut self) -> std::io::Result<u64> {
        self.flush()?;
        Ok(self.written)
    }
}

impl GuestRam {
    /// For copy-on-write RAM: the pages written since it was mapped (by the guest or by this
    /// VMM), as memory-file extents. A write to a private file mapping makes the page an
    /// anonymous copy: present and not a file page, or swapped out. The vCPUs must be paused.
    pub fn written_extents(&self) -> std::io::Result<Vec<Extent>> {
        let mut extents: Vec<Extent> = Vec::new();
        for region in self.host_regions() {
            for (page, flags) in page_flags(region.host_addr, region.len)?
                .into_iter()
                .enumerate()
            {
                let written =
                    (flags & PM_PRESENT != 0 && flags & PM_FILE == 0) || flags & PM_SWAPPED != 0;
                if !written {
                    continue;
                }
                let offset = region.file_offset + (page * PAGE) as u64;
                match extents.last_mut() {
                    Some(last) if last.end() == offset => last.len += PAGE as u64,
                    _ => extents.push(Extent {
                        offset,
                        len: PAGE as u64,
                    }),
                }
            }
        }
        Ok(extents)
    }

    /// Write the pages of `extents` (memory-file offsets, sorted) into `out` at their offsets,
    /// pages of zeros left as holes; `out` is sized for all of RAM. Returns the bytes written.
    /// The vCPUs must be paused.
    pub fn write_pages(&self, out: &File, extents: &[Extent]) -> std::io::Result<u64> {
        out.set_len(self.size())?;
        let mut written = 0u64;
        let mut page_buf = vec![0u8; PAGE];
        for region in self.host_regions() {
            let region_end = region.file_offset + region.len as u64;
            let present = mapped_pages(region.host_addr, region.len)?;
            // Consecutive non-zero mapped pages go out in one write (a fork's pause is this).
            let mut runs = Runs::new(&region, out);
            for extent in extents {
                let start = extent.offset.max(region.file_offset);
                let end = extent.end().min(region_end);
                let mut offset = start;
                while offset < end {
                    let page = usize::try_from((offset - region.file_offset) / PAGE as u64)
                        .expect("inside a mapped region");
                    offset += PAGE as u64;
                    if present[page] {
                        // SAFETY: a mapped page inside the region; the vCPUs are paused.
                        let bytes = unsafe {
                            std::slice::from_raw_parts(region.host_addr.add(page * PAGE), PAGE)
                        };
                        if !is_zero(bytes) {
                            runs.add(page)?;
                            continue;
                        }
                    } else {
                        let at = offset - PAGE as u64;
                        crate::memory::chain::read_chain_page(&self.chain, at, &mut page_buf)?;
                        if !is_zero(&page_buf) {
                            runs.flush()?;
                            out.write_all_at(&page_buf, at)?;
                            written += PAGE as u64;
                            continue;
                        }
                    }
                    runs.flush()?;
                }
            }
            written += runs.finish()?;
        }
        Ok(written)
    }
}

impl GuestRam {
    /// Write guest RAM into `out` (from offset 0, at each range's file offset), skipping pages of
    /// zeros: the file stays sparse there. The vCPUs must be paused.
    pub fn write_sparse(&self, out: &File) -> std::io::Result<SparseWritten> {
        let ram = self;
        out.set_len(ram.size())?;
        let mut written = SparseWritten {
            bytes: 0,
            touched: Vec::new(),
        };
        let mut page_buf = vec![0u8; PAGE];
        for region in ram.host_regions() {
            let present = mapped_pages(region.host_addr, region.len)?;
            let extents = data_extents(&ram.backing, region.file_offset, region.len as u64)?;
            // Pages come in increasing order: walk the extents alongside.
            let mut extent = 0usize;
            let mut in_backing = |offset: u64| {
                while extent < extents.len() && extents[extent].0 + extents[extent].1 <= offset {
                    extent += 1;
                }
                extent < extents.len() && extents[extent].0 <= offset
            };
            // Consecutive non-zero mapped pages go out in one write.
            let mut runs = Runs::new(&region, out);
            for (page, &mapped) in present.iter().enumerate() {
                let offset = region.file_offset + (page * PAGE) as u64;
                if mapped {
                    if ram.kind == RamKind::CopyOnWrite {
                        written.touched.push(offset);
                    }
                    // SAFETY: a mapped page inside the region; the vCPUs are paused.
                    let bytes = unsafe {
                        std::slice::from_raw_parts(region.host_addr.add(page * PAGE), PAGE)
                    };
                    if !is_zero(bytes) {
                        runs.add(page)?;
                        continue;
                    }
                } else if let Some(source) = crate::memory::chain::layer_holding(&ram.chain, offset)
                    .filter(|layer| layer.extents.is_some())
                    .map(|layer| &layer.file)
                    .or_else(|| in_backing(offset).then_some(&ram.backing))
                {
                    // Not mapped here: the page is what the layer above the bottom that holds
                    // it holds (a diff snapshot's chain), else what the backing file holds
                    // (skipping its holes).
                    source.read_exact_at(&mut page_buf, offset)?;
                    if !is_zero(&page_buf) {
                        runs.flush()?;
                        out.write_all_at(&page_buf, offset)?;
                        written.bytes += PAGE as u64;
                        continue;
                    }
                }
                runs.flush()?;
            }
            written.bytes += runs.finish()?;
        }
        Ok(written)
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;

    use super::*;
    use crate::arch::layout::ram_ranges;

    #[test]
    fn zero_detection() {
        let mut page = vec![0u8; PAGE];
        assert!(is_zero(&page));
        page[PAGE - 1] = 1;
        assert!(!is_zero(&page));
        assert!(is_zero(&page[1..PAGE - 1]));
    }

    #[test]
    fn memory_file_holds_every_non_zero_page_and_nothing_else() {
        let dir = std::env::temp_dir().join(format!("mayfly-snap-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ram = GuestRam::new_memfd(4 << 20).unwrap();
        let region = ram.host_regions()[0];
        // SAFETY: inside the 4 MiB mapping this test owns.
        unsafe {
            *region.host_addr.add(8192) = 0xaa; // page 2: data
            std::ptr::write_bytes(region.host_addr.add(3 * PAGE), 0, PAGE); // page 3: touched zeros
        }
        // A page present only in the backing file (written through the fd, never mapped).
        ram.backing
            .write_all_at(&[0xbb; 16], (100 * PAGE) as u64)
            .unwrap();

        let path = dir.join("memory");
        let written = ram.write_sparse(&File::create(&path).unwrap()).unwrap();
        assert_eq!(written.bytes, 2 * PAGE as u64);
        let file = File::open(&path).unwrap();
        assert_eq!(file.metadata().unwrap().len(), 4 << 20);
        let mut byte = [0u8; 1];
        file.read_exact_at(&mut byte, 8192).unwrap();
        assert_eq!(byte, [0xaa]);
        file.read_exact_at(&mut byte, (100 * PAGE) as u64).unwrap();
        assert_eq!(byte, [0xbb]);
        let data: u64 = data_extents(&file, 0, 4 << 20)
            .unwrap()
            .iter()
            .map(|e| e.1)
            .sum();
        assert!(data < (1 << 20), "the file is sparse: {data} bytes of data");

        // A copy-on-write view of that file reads the same, and records what it touched.
        let cow = GuestRam::copy_on_write(file, &ram_ranges(4 << 20)).unwrap();
        let cow_region = cow.host_regions()[0];
        // SAFETY: inside the mapping.
        unsafe { *cow_region.host_addr.add(5 * PAGE) = 0xcc };
        let again = cow
            .write_sparse(&File::create(dir.join("memory2")).unwrap())
            .unwrap();
        assert_eq!(again.bytes, 3 * PAGE as u64);
        assert!(again.touched.contains(&((5 * PAGE) as u64)));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
