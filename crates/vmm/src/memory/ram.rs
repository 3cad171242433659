//! Guest RAM: one file's worth of memory mapped into the VMM and registered with KVM as memory
//! slots. Which file, and how it is mapped, is what the memory modes differ in:
//!
//! - [`RamKind::Memfd`]: a memfd mapped shared. A fresh boot starts here, and an eager restore
//!   copies a snapshot's memory into one.
//! - [`RamKind::CopyOnWrite`]: a snapshot's memory file mapped private. Restores of one snapshot
//!   share its clean pages through the page cache; the file never changes.
//! - [`RamKind::Lazy`]: anonymous memory that a userfaultfd handler fills from the snapshot's
//!   memory file as the guest touches it (see [`crate::memory::lazy`]).
//!
//! In every kind, a page this process has not mapped yet reads as the same page of
//! [`GuestRam::backing`], which is what lets a snapshot be written without touching pages the
//! guest never used.

use mayfly_sys::extents::{data_extents, punch_hole};
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;

use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap};

use mayfly_snapshot::MemoryRange;

use crate::arch::layout::ram_ranges;
use crate::memory::chain::{has_seals, is_sealed, ChainLayer};

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
    #[error(
        "cannot seal the fork's memory base so that nothing can change it: {0} (if busy: the \
         host kept moving its pages for {patience}s, or something maps it for writing; try the \
         fork again)",
        patience = mayfly_sys::seal::SEAL_PATIENCE.as_secs()
    )]
    Seal(std::io::Error),
}

/// The seals a memory base carries: its size and contents can never change again.
const BASE_SEALS: libc::c_int =
    libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE | libc::F_SEAL_SEAL;

/// Seal `file` (a memfd this process made with MFD_ALLOW_SEALING) as a memory base.
pub(crate) fn seal_base(file: &File) -> Result<(), MemoryError> {
    let again = mayfly_sys::seal::add_seals(file, BASE_SEALS).map_err(MemoryError::Seal)?;
    if again > 0 {
        eprintln!(
            "mayfly: the fork's memory base sealed after {again} more tries (pages being moved)"
        );
    }
    Ok(())
}

/// fcntl(2)'s F_SETSIG, which the libc crate does not name.
const F_SETSIG: libc::c_int = 10;

/// Take a read lease on `file` for this process: the kernel sends it [`lease_signal`] before
/// anyone opens the file for writing or truncates it. Whether it was taken.
fn lease(file: &File) -> bool {
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on a descriptor the caller owns, with a valid signal number; checked.
    unsafe {
        libc::fcntl(fd, F_SETSIG, lease_signal()) == 0
            && libc::fcntl(fd, libc::F_SETLEASE, libc::F_RDLCK) == 0
    }
}

/// The signal the kernel sends when another process wants to change a memory file this VM
/// holds a lease on (see [`GuestRam::protect_backing`]).
pub fn lease_signal() -> libc::c_int {
    vmm_sys_util::signal::SIGRTMIN() + 1
}

/// Turn a SIGBUS in the VMM (its own access to guest memory whose file was truncated: a
/// snapshot being written, a device reading a queue) into one line that says so and exit
/// status 1, instead of a core dump that blames nobody.
pub fn install_sigbus_handler() -> std::io::Result<()> {
    extern "C" fn on_sigbus(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
        const MSG: &[u8] = b"mayfly: guest memory became unreadable (SIGBUS): the VM's memory file was truncated or changed under it; stopping\n";
        // SAFETY: write(2) and _exit(2) are async-signal-safe; MSG is a static buffer.
        unsafe {
            libc::write(2, MSG.as_ptr().cast(), MSG.len());
            libc::_exit(1);
        }
    }
    // SAFETY: sigaction is plain data, zeroed then filled in.
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    action.sa_sigaction = on_sigbus as *const () as usize;
    action.sa_flags = libc::SA_SIGINFO;
    // SAFETY: installs a handler that only calls async-signal-safe functions.
    if unsafe { libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// How guest RAM's backing file is kept from changing under the VM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackingProtection {
    /// The VM's own memory (a memfd nobody else holds, or anonymous memory).
    Private,
    /// A sealed memfd: its size and contents cannot change.
    Sealed,
    /// A read lease: before another process opens the file for writing or truncates it, the
    /// kernel tells this VMM (the [`lease_signal`]), which stops the VM.
    Leased,
    /// Neither was possible (e.g. the file is open for writing elsewhere): a change is still
    /// caught, when the guest or the VMM trips over it.
    Unprotected,
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
    pub ranges: Vec<MemoryRange>,
    /// Where a page this process has not mapped comes from: the memfd itself, or the snapshot's
    /// memory file.
    pub backing: File,
    pub kind: RamKind,
    /// For RAM mapped copy-on-write from a snapshot directory: the memory files it maps,
    /// bottom first (see [`crate::memory::diff`]); `backing` is the bottom's. Empty otherwise.
    pub chain: Vec<ChainLayer>,
}

/// One region as mapped in this process.
#[derive(Clone, Copy, Debug)]
pub struct HostRegion {
    pub host_addr: *mut u8,
    pub len: usize,
    pub file_offset: u64,
}

pub(crate) fn memfd(len: u64) -> Result<File, MemoryError> {
    // Sealable: a memfd that becomes a fork's base is sealed so that nothing can change it
    // under the clones that map it.
    // SAFETY: the name is a valid NUL-terminated string; the return value is checked.
    let fd = unsafe {
        libc::memfd_create(
            c"mayfly-guest-ram".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
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
    pub fn copy_on_write(file: File, ranges: &[MemoryRange]) -> Result<Self, MemoryError> {
        Self::map(file, ranges, RamKind::CopyOnWrite)
    }

    /// A snapshot's chain of memory files (see [`crate::memory::diff`]), mapped copy-on-write: the
    /// bottom over all of RAM, each later layer's extents over it.
    pub fn copy_on_write_chain(
        chain: Vec<ChainLayer>,
        ranges: &[MemoryRange],
    ) -> Result<Self, MemoryError> {
        let bottom = chain
            .first()
            .ok_or_else(|| MemoryError::Layout("an empty memory chain".into()))?;
        let mut ram = Self::map(
            bottom.file.try_clone().map_err(MemoryError::Memfd)?,
            ranges,
            RamKind::CopyOnWrite,
        )?;
        for layer in chain.iter().skip(1) {
            for extent in layer.extents.as_deref().unwrap_or_default() {
                for region in ram.host_regions() {
                    let start = extent.offset.max(region.file_offset);
                    let end = extent.end().min(region.file_offset + region.len as u64);
                    if start >= end {
                        continue;
                    }
                    let within = usize::try_from(start - region.file_offset)
                        .expect("inside a mapped region");
                    let len = usize::try_from(end - start).expect("inside a mapped region");
                    // SAFETY: replaces part of this VM's own, not yet used, mapping of guest
                    // RAM (inside the region: checked above) with the same range of a file
                    // of the snapshot's chain, private: nothing the guest does reaches it.
                    let addr = unsafe {
                        libc::mmap(
                            region.host_addr.add(within).cast(),
                            len,
                            libc::PROT_READ | libc::PROT_WRITE,
                            libc::MAP_PRIVATE | libc::MAP_FIXED | libc::MAP_NORESERVE,
                            layer.file.as_raw_fd(),
                            libc::off_t::try_from(start).expect("a file offset the file has"),
                        )
                    };
                    if addr == libc::MAP_FAILED {
                        return Err(MemoryError::Copy(std::io::Error::last_os_error()));
                    }
                }
            }
        }
        ram.chain = chain;
        Ok(ram)
    }

    /// A snapshot's chain of memory files copied into a fresh memfd: the bottom's data, then
    /// each later layer's extents over it (holes in them punched).
    pub fn eager_chain(chain: &[ChainLayer], ranges: &[MemoryRange]) -> Result<Self, MemoryError> {
        let bottom = chain
            .first()
            .ok_or_else(|| MemoryError::Layout("an empty memory chain".into()))?;
        let ram = Self::eager(&bottom.file, ranges)?;
        for layer in chain.iter().skip(1) {
            for extent in layer.extents.as_deref().unwrap_or_default() {
                punch_hole(&ram.backing, extent.offset, extent.len).map_err(MemoryError::Copy)?;
                for (start, len) in data_extents(&layer.file, extent.offset, extent.len)
                    .map_err(MemoryError::Copy)?
                {
                    copy_range(&layer.file, &ram.backing, start, len).map_err(MemoryError::Copy)?;
                }
            }
        }
        Ok(ram)
    }

    /// Anonymous memory to be filled from `file` by a userfaultfd handler.
    pub fn lazy(file: File, ranges: &[MemoryRange]) -> Result<Self, MemoryError> {
        Self::map(file, ranges, RamKind::Lazy)
    }

    /// A snapshot's memory copied into a fresh memfd (only its data: holes stay holes).
    pub fn eager(file: &File, ranges: &[MemoryRange]) -> Result<Self, MemoryError> {
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

    fn map(file: File, ranges: &[MemoryRange], kind: RamKind) -> Result<Self, MemoryError> {
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
            chain: Vec::new(),
        })
    }

    /// Make guest RAM an immutable base that clones can share, and keep running on a private
    /// (copy-on-write) view of it; returns the base. A memfd-backed VM's own memfd becomes the
    /// base without a copy: this VM stops writing it (its pages stay shared with the clones
    /// until either side writes). Any other VM's current memory is first written, sparse, into
    /// a new memfd. The vCPUs must be paused; KVM drops its mappings of the old pages when the
    /// new mapping replaces them at the same address (MMU notifiers), so the memory slots stay.
    /// Also returns how many bytes had to be copied.
    pub fn freeze(&mut self, snapshot_id: &[u8; 16]) -> Result<(File, u64), MemoryError> {
        let mut copied = 0;
        let fresh_base = self.kind != RamKind::Memfd;
        if fresh_base {
            let base = memfd(self.size())?;
            copied = self.write_sparse(&base).map_err(MemoryError::Copy)?.bytes;
            // Sealed before anything maps it. (F_SEAL_WRITE also waits for the kernel to
            // stop moving the file's pages; see mayfly_sys::seal.)
            mayfly_snapshot::write_trailer(&base, self.size(), snapshot_id)
                .map_err(MemoryError::Copy)?;
            seal_base(&base)?;
            self.backing = base;
        }
        let mut remapped = Vec::new();
        for region in self.host_regions() {
            // SAFETY: replaces this VM's own mapping of guest RAM at the same address and size
            // (MAP_FIXED), with the same contents: the file now holds everything the old
            // mapping showed. The vCPUs are paused and nothing holds references into it.
            let addr = unsafe {
                libc::mmap(
                    region.host_addr.cast(),
                    region.len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_FIXED | libc::MAP_NORESERVE,
                    self.backing.as_raw_fd(),
                    libc::off_t::try_from(region.file_offset).expect("a file offset the file has"),
                )
            };
            if addr == libc::MAP_FAILED {
                return Err(MemoryError::Copy(std::io::Error::last_os_error()));
            }
            remapped.push((addr, region.len));
        }
        self.kind = RamKind::CopyOnWrite;
        // It maps the base now, not the snapshot's chain.
        self.chain.clear();
        if !fresh_base {
            // This VM's own memfd becomes the base: no shared mapping of it is left anywhere
            // now, so it can be sealed, and not even this VMM can change what the clones map.
            // Huge pages are asked for only after the seal.
            mayfly_snapshot::write_trailer(&self.backing, self.size(), snapshot_id)
                .map_err(MemoryError::Copy)?;
            seal_base(&self.backing)?;
        }
        for (addr, len) in remapped {
            // SAFETY: advice on a mapping made above; it does not change contents.
            unsafe { libc::madvise(addr, len, libc::MADV_HUGEPAGE) };
        }
        let base = self.backing.try_clone().map_err(MemoryError::Memfd)?;
        Ok((base, copied))
    }

    /// A copy of guest RAM in a new sealed memfd (sparse), leaving this VM's memory as it is.
    pub fn copy_to_memfd(&self, snapshot_id: &[u8; 16]) -> Result<(File, u64), MemoryError> {
        let base = memfd(self.size())?;
        let copied = self.write_sparse(&base).map_err(MemoryError::Copy)?.bytes;
        mayfly_snapshot::write_trailer(&base, self.size(), snapshot_id)
            .map_err(MemoryError::Copy)?;
        seal_base(&base)?;
        Ok((base, copied))
    }

    /// Keep the file behind a copy-on-write VM's RAM from changing under it: a sealed memfd
    /// (a fork's base) cannot change; a snapshot's memory file gets a read lease, so the
    /// kernel warns this VMM (with [`lease_signal`]) before anyone opens it for writing or
    /// truncates it, and the VMM stops the VM instead of running it on changed memory.
    pub fn protect_backing(&self) -> BackingProtection {
        if self.kind != RamKind::CopyOnWrite {
            return BackingProtection::Private;
        }
        // Every file RAM maps: the backing (the chain's bottom), and the layers above it of a
        // diff snapshot's chain or a fork's: a change to any of them changes guest memory.
        // Not a file a fork handed over that is not sealed (the snapshot its parent was
        // restored from): its description is shared by every clone the zygote makes, and a
        // lease warns only the last process that set it. Each clone leases a description
        // of its own ([`GuestRam::lease_handed`]).
        let files = std::iter::once((&self.backing, self.chain.first())).chain(
            self.chain
                .iter()
                .skip(1)
                .map(|layer| (&layer.file, Some(layer))),
        );
        let mut leased = false;
        for (file, layer) in files {
            let sealed = has_seals(file, libc::F_SEAL_SHRINK | libc::F_SEAL_WRITE);
            if sealed || layer.is_some_and(|layer| layer.from_fork) {
                continue;
            }
            if !lease(file) {
                return BackingProtection::Unprotected;
            }
            leased = true;
        }
        if leased {
            BackingProtection::Leased
        } else {
            BackingProtection::Sealed
        }
    }

    /// A fork's clone: lease the files its fork handed over that are not sealed (the snapshot
    /// its parent was restored from), each on a description of this process's own, which
    /// replaces the one inherited from the zygote: the lease then warns this process, and
    /// nothing another clone does to its description (its flags) reaches this one. Returns
    /// the protection, as [`GuestRam::protect_backing`] does.
    pub fn lease_handed(&mut self) -> BackingProtection {
        if self.kind != RamKind::CopyOnWrite {
            return BackingProtection::Private;
        }
        let mut leased = false;
        for i in 0..self.chain.len() {
            let layer = &self.chain[i];
            if !layer.from_fork || is_sealed(&layer.file) {
                continue;
            }
            let Ok(own) = crate::memory::chain::reopen_handed(&layer.file) else {
                return BackingProtection::Unprotected;
            };
            if !lease(&own) {
                return BackingProtection::Unprotected;
            }
            if i == 0 {
                match own.try_clone() {
                    Ok(backing) => self.backing = backing,
                    Err(_) => return BackingProtection::Unprotected,
                }
            }
            self.chain[i].file = own;
            leased = true;
        }
        if leased {
            BackingProtection::Leased
        } else {
            self.protect_backing()
        }
    }

    /// Whether the backing file still holds all of guest RAM; if not, what happened (to name
    /// the real cause when the guest crashes on memory that vanished).
    pub fn backing_problem(&self) -> Option<String> {
        if self.kind == RamKind::Memfd {
            return None;
        }
        let needed = self
            .ranges
            .iter()
            .map(|r| r.file_offset + r.size)
            .max()
            .unwrap_or(0);
        let layers =
            std::iter::once(&self.backing).chain(self.chain.iter().skip(1).map(|l| &l.file));
        for file in layers {
            match file.metadata() {
                Ok(meta) if meta.len() >= needed => {}
                Ok(meta) => {
                    return Some(format!(
                        "the VM's memory file was truncated under it (it is now {} bytes; the VM needs {needed})",
                        meta.len()
                    ))
                }
                Err(e) => return Some(format!("the VM's memory file cannot be checked: {e}")),
            }
        }
        None
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
                len: usize::try_from(range.size).expect("a mapped range fits in memory"),
                file_offset: range.file_offset,
            })
            .collect()
    }
}

/// Copy `len` bytes at `offset` from one file to the same offset of another, in the kernel
/// where it can (copy_file_range), by reading and writing where it cannot.
fn copy_range(from: &File, to: &File, offset: u64, len: u64) -> std::io::Result<()> {
    let mut done = 0u64;
    while done < len {
        let mut off_in = libc::loff_t::try_from(offset + done)
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        let mut off_out = off_in;
        // SAFETY: valid fds and offsets we own; the result is checked.
        let n = unsafe {
            libc::copy_file_range(
                from.as_raw_fd(),
                &mut off_in,
                to.as_raw_fd(),
                &mut off_out,
                usize::try_from(len - done).unwrap_or(usize::MAX),
                0,
            )
        };
        if n > 0 {
            done += n.unsigned_abs() as u64;
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
        let chunk = usize::try_from(len - done)
            .unwrap_or(usize::MAX)
            .min(buf.len());
        from.read_exact_at(&mut buf[..chunk], offset + done)?;
        to.write_all_at(&buf[..chunk], offset + done)?;
        done += chunk as u64;
    }
    Ok(())
}

pub const PAGE: usize = 4096;

#[cfg(test)]
mod tests {
    use mayfly_snapshot::Extent;

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
    fn freezing_keeps_contents_and_stops_writes_reaching_the_base() {
        let mut ram = GuestRam::new_memfd(2 << 20).unwrap();
        let region = ram.host_regions()[0];
        // SAFETY: inside the 2 MiB mapping this test owns.
        unsafe { *region.host_addr.add(100) = 1 };
        let (base, copied) = ram.freeze(&[1; 16]).unwrap();
        assert_eq!(copied, 0, "a memfd VM's memfd is the base as it is");
        assert_eq!(ram.kind, RamKind::CopyOnWrite);
        // SAFETY: the same address, now a private mapping of the base.
        unsafe {
            assert_eq!(*region.host_addr.add(100), 1);
            *region.host_addr.add(100) = 2;
        }
        let mut byte = [0u8];
        base.read_exact_at(&mut byte, 100).unwrap();
        assert_eq!(byte, [1], "the base keeps the fork instant");
        // Sealed: nobody can change or truncate the base any more.
        mayfly_snapshot::check_trailer(&base, 2 << 20, &[1; 16], "base").unwrap();
        assert!(base.set_len(4096).is_err(), "a sealed base cannot shrink");
        assert!(
            base.write_all_at(&[9], 100).is_err(),
            "a sealed base cannot be written"
        );
        assert_eq!(ram.protect_backing(), BackingProtection::Sealed);

        // Freezing a copy-on-write VM writes its current memory into a new base.
        let (second, copied) = ram.freeze(&[2; 16]).unwrap();
        assert_eq!(copied, 4096, "one page holds data");
        second.read_exact_at(&mut byte, 100).unwrap();
        assert_eq!(byte, [2]);
        base.read_exact_at(&mut byte, 100).unwrap();
        assert_eq!(byte, [1]);
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

    #[test]
    fn a_chain_of_memory_files_maps_tracks_writes_and_writes_diffs() {
        use crate::memory::chain::ChainLayer;
        let dir = std::env::temp_dir().join(format!("mayfly-chain-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let size = 4u64 << 20;
        let ranges = ram_ranges(size);
        let page = |n: u64| n * PAGE as u64;
        let base_path = dir.join("base");
        let create = |path: &std::path::Path| {
            File::options()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(path)
                .unwrap()
        };
        let base = create(&base_path);
        base.set_len(size).unwrap();
        base.write_all_at(&[0x11; PAGE], page(1)).unwrap();
        base.write_all_at(&[0x11; PAGE], page(2)).unwrap();
        base.write_all_at(&[0x55; PAGE], page(8)).unwrap();
        let layer = |file: &File, path: &std::path::Path, id: u8, extents: Option<Vec<Extent>>| {
            ChainLayer {
                file: file.try_clone().unwrap(),
                path: path.to_path_buf(),
                snapshot_id: [id; 16],
                extents,
                from_fork: false,
            }
        };
        let read = |ram: &GuestRam, n: u64| -> u8 {
            let region = ram.host_regions()[0];
            // SAFETY: inside the mapping this test owns.
            unsafe { *region.host_addr.add(usize::try_from(page(n)).unwrap()) }
        };
        let write = |ram: &GuestRam, n: u64, value: u8| {
            let region = ram.host_regions()[0];
            // SAFETY: inside the mapping this test owns.
            unsafe {
                std::ptr::write_bytes(
                    region.host_addr.add(usize::try_from(page(n)).unwrap()),
                    value,
                    PAGE,
                )
            }
        };

        // Restored from the full file: a read is not a write; a write of zeros is.
        let ram = GuestRam::copy_on_write_chain(vec![layer(&base, &base_path, 1, None)], &ranges)
            .unwrap();
        assert_eq!(read(&ram, 5), 0);
        assert_eq!(read(&ram, 1), 0x11);
        write(&ram, 2, 0x22);
        write(&ram, 7, 0x33);
        write(&ram, 8, 0);
        let written = ram.written_extents().unwrap();
        assert_eq!(
            written,
            vec![
                Extent {
                    offset: page(2),
                    len: page(1)
                },
                Extent {
                    offset: page(7),
                    len: page(2)
                }
            ]
        );
        let diff_path = dir.join("diff");
        let diff = create(&diff_path);
        assert_eq!(ram.write_pages(&diff, &written).unwrap(), page(2));
        drop(ram);

        // Restored from the diff over the base: each page from the newest layer holding it,
        // and nothing counts as written yet.
        let chain = vec![
            layer(&base, &base_path, 1, None),
            layer(&diff, &diff_path, 2, Some(written.clone())),
        ];
        let ram = GuestRam::copy_on_write_chain(chain, &ranges).unwrap();
        assert_eq!(
            [read(&ram, 1), read(&ram, 2), read(&ram, 7), read(&ram, 8)],
            [0x11, 0x22, 0x33, 0]
        );
        assert_eq!(ram.written_extents().unwrap(), vec![]);
        write(&ram, 1, 0x44);
        assert_eq!(
            ram.written_extents().unwrap(),
            vec![Extent {
                offset: page(1),
                len: page(1)
            }]
        );
        // A full snapshot of it reads what it has not mapped from the right layer.
        let full_path = dir.join("full");
        let full = create(&full_path);
        let unmapped = GuestRam::copy_on_write_chain(
            vec![
                layer(&base, &base_path, 1, None),
                layer(&diff, &diff_path, 2, Some(written.clone())),
            ],
            &ranges,
        )
        .unwrap();
        unmapped.write_sparse(&full).unwrap();
        let mut byte = [0u8; 1];
        for (n, want) in [(1, 0x11), (2, 0x22), (7, 0x33), (8, 0)] {
            full.read_exact_at(&mut byte, page(n)).unwrap();
            assert_eq!(byte[0], want, "page {n}");
        }
        // An eager restore of the chain: the diff's pages over the base's, zeros included.
        let eager = GuestRam::eager_chain(
            &[
                layer(&base, &base_path, 1, None),
                layer(&diff, &diff_path, 2, Some(written)),
            ],
            &ranges,
        )
        .unwrap();
        assert_eq!(
            [
                read(&eager, 1),
                read(&eager, 2),
                read(&eager, 7),
                read(&eager, 8)
            ],
            [0x11, 0x22, 0x33, 0]
        );

        // A fork of the VM over base + diff that wrote page 1: its clones get the base as it
        // is and, above it, every page that differs from it (the diff's and the written one),
        // as the VM sees them now, and nothing of the diff file itself.
        let forked = freeze_layered_checked(&ram, size, |_| true);
        let clone = GuestRam::copy_on_write_chain(forked, &ranges).unwrap();
        assert_eq!(
            [
                read(&clone, 1),
                read(&clone, 2),
                read(&clone, 5),
                read(&clone, 7),
                read(&clone, 8)
            ],
            [0x44, 0x22, 0, 0x33, 0]
        );
        assert_eq!(clone.written_extents().unwrap(), vec![]);
        // A clone's own fork copies what differs from the base again, over the same base.
        write(&clone, 5, 0x66);
        let again = freeze_layered_checked(&clone, size, |_| true);
        assert_eq!(again[0].path, base_path);
        let grandchild = GuestRam::copy_on_write_chain(again, &ranges).unwrap();
        assert_eq!(
            [
                read(&grandchild, 1),
                read(&grandchild, 5),
                read(&grandchild, 8)
            ],
            [0x44, 0x66, 0]
        );
        // Refused: a base its maker does not hand over as it is, a fork's base (a sealed
        // memfd: a parent's past), RAM in a memfd.
        assert!(ram.freeze_layered(&[9; 16], |_| false).unwrap().is_none());
        let mut booted = GuestRam::new_memfd(size).unwrap();
        assert!(booted.freeze_layered(&[9; 16], |_| true).unwrap().is_none());
        let (base, _) = booted.freeze(&[8; 16]).unwrap();
        assert!(booted.freeze_layered(&[9; 16], |_| true).unwrap().is_none());
        let on_fork_base = GuestRam::copy_on_write_chain(
            vec![ChainLayer {
                from_fork: true,
                ..layer(&base, std::path::Path::new("/memfd"), 8, None)
            }],
            &ranges,
        )
        .unwrap();
        assert!(on_fork_base
            .freeze_layered(&[9; 16], |_| true)
            .unwrap()
            .is_none());
        // A snapshot file on tmpfs (which answers F_GET_SEALS too, unsealed) is handed over.
        let shm =
            std::path::Path::new("/dev/shm").join(format!("mayfly-chain-{}", std::process::id()));
        let on_tmpfs = create(&shm);
        on_tmpfs.set_len(size).unwrap();
        let tmpfs_ram =
            GuestRam::copy_on_write_chain(vec![layer(&on_tmpfs, &shm, 3, None)], &ranges).unwrap();
        std::fs::remove_file(&shm).unwrap();
        freeze_layered_checked(&tmpfs_ram, size, |_| true);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// [`GuestRam::freeze_layered`] that must hand over layers: the snapshot file at the
    /// bottom as it is, and a sealed top whose trailer is the fork's.
    fn freeze_layered_checked(
        ram: &GuestRam,
        size: u64,
        ok: impl Fn(&File) -> bool,
    ) -> Vec<crate::memory::chain::ChainLayer> {
        let (layers, copied) = ram.freeze_layered(&[7; 16], ok).unwrap().unwrap();
        assert_eq!(layers.len(), 2);
        assert!(layers[0].extents.is_none());
        let top = &layers[1];
        assert!(top.from_fork);
        assert!(copied <= top.extents.as_ref().unwrap().iter().map(|e| e.len).sum());
        assert!(crate::memory::chain::has_seals(&top.file, BASE_SEALS));
        mayfly_snapshot::check_trailer(&top.file, size, &[7; 16], "the top").unwrap();
        layers
    }
}
