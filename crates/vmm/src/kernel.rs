//! Loading the guest kernel (vmlinux ELF or bzImage, via linux-loader) and its initrd, and
//! writing the boot protocol's structures: PVH start_info or the Linux zero page.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::PathBuf;

use linux_loader::loader::bootparam::{boot_e820_entry, boot_params, setup_header};
use linux_loader::loader::elf::start_info::{
    hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info,
};
use linux_loader::loader::{BzImage, Elf, KernelLoader, KernelLoaderResult, PvhBootCapability};
use vm_memory::bitmap::BitmapSlice;
use vm_memory::{
    Address, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion, ReadVolatile,
    VolatileMemoryError, VolatileSlice,
};

use crate::arch::layout::*;
use crate::arch::regs::EntryMode;
use crate::memory::ram::GuestMemory;

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("cannot open {what} {path}: {source}")]
    Open {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error(
        "{0} is neither an x86-64 ELF vmlinux nor a bzImage: pass a Linux kernel with --kernel"
    )]
    NotAKernel(String),
    #[error("{image} is an ELF file but not an x86-64 executable: pass an x86-64 vmlinux")]
    WrongElf { image: String },
    #[error("cannot load the kernel {image}: {source} (is the guest memory large enough? see --mem-mib)")]
    Load {
        image: String,
        source: linux_loader::loader::Error,
    },
    #[error("the kernel {0} has no 64-bit entry point (boot protocol 2.12 or later is needed)")]
    No64BitEntry(String),
    #[error("the initrd ({size_mib} MiB) does not fit in guest memory next to the kernel: give the guest more memory with --mem-mib")]
    InitrdTooLarge { size_mib: u64 },
    #[error("cannot read the initrd {image}: {reason}")]
    InitrdRead { image: String, reason: String },
    #[error("the kernel command line is too long: {len} bytes, at most {max}")]
    CmdlineTooLong { len: usize, max: usize },
    #[error("the kernel command line contains a NUL byte")]
    CmdlineNul,
    #[error("cannot write the boot parameters into guest memory: {0}")]
    Memory(#[from] vm_memory::GuestMemoryError),
}

/// A kernel or initrd: a file the user named, or bytes built into the binary.
#[derive(Clone, Debug)]
pub enum Image {
    File(PathBuf),
    Embedded {
        name: &'static str,
        bytes: &'static [u8],
    },
}

impl Image {
    pub fn name(&self) -> String {
        match self {
            Image::File(path) => path.display().to_string(),
            Image::Embedded { name, .. } => format!("the built-in {name}"),
        }
    }

    fn open(&self, what: &'static str) -> Result<ImageReader, KernelError> {
        match self {
            Image::File(path) => {
                File::open(path)
                    .map(ImageReader::File)
                    .map_err(|source| KernelError::Open {
                        what,
                        path: path.clone(),
                        source,
                    })
            }
            Image::Embedded { bytes, .. } => Ok(ImageReader::Bytes { bytes, pos: 0 }),
        }
    }

    /// Check that the file can be opened and looks like a kernel, without loading it: lets the
    /// CLI reject bad input before it creates a VM.
    pub fn check_kernel(&self) -> Result<(), KernelError> {
        let mut reader = self.open("the kernel")?;
        kernel_format(&mut reader, &self.name()).map(|_| ())
    }

    pub fn check_readable(&self, what: &'static str) -> Result<(), KernelError> {
        self.open(what).map(|_| ())
    }

    /// Drop the pages of a built-in image from this process's memory once it is loaded: they
    /// are ~15 MiB of the binary's read-only data, and would otherwise stay resident for the
    /// VM's whole life. A later read faults them back in from the binary.
    pub fn release(&self) {
        let Image::Embedded { bytes, .. } = self else {
            return;
        };
        // SAFETY: sysconf has no memory effects.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
        let start = (bytes.as_ptr() as usize).next_multiple_of(page);
        let end = (bytes.as_ptr() as usize + bytes.len()) & !(page - 1);
        if end > start {
            // SAFETY: the range lies inside the image, whole pages only, in the binary's
            // read-only data (a private file mapping that is never written): dropping its
            // pages cannot change what a later read sees.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED) };
        }
    }
}

/// What linux-loader reads from: a file, or a slice of the binary.
enum ImageReader {
    File(File),
    Bytes { bytes: &'static [u8], pos: usize },
}

impl ImageReader {
    fn len(&mut self) -> io::Result<u64> {
        match self {
            ImageReader::File(file) => Ok(file.metadata()?.len()),
            ImageReader::Bytes { bytes, .. } => Ok(bytes.len() as u64),
        }
    }
}

impl Read for ImageReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            ImageReader::File(file) => file.read(buf),
            ImageReader::Bytes { bytes, pos } => {
                let n = (&bytes[(*pos).min(bytes.len())..]).read(buf)?;
                *pos += n;
                Ok(n)
            }
        }
    }
}

impl Seek for ImageReader {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        match self {
            ImageReader::File(file) => file.seek(to),
            ImageReader::Bytes { bytes, pos } => {
                let new = match to {
                    SeekFrom::Start(n) => Some(n),
                    SeekFrom::End(d) => (bytes.len() as u64).checked_add_signed(d),
                    SeekFrom::Current(d) => (*pos as u64).checked_add_signed(d),
                };
                let new = new.ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
                *pos = usize::try_from(new).map_err(|_| io::ErrorKind::InvalidInput)?;
                Ok(new)
            }
        }
    }
}

impl ReadVolatile for ImageReader {
    fn read_volatile<B: BitmapSlice>(
        &mut self,
        buf: &mut VolatileSlice<B>,
    ) -> Result<usize, VolatileMemoryError> {
        match self {
            ImageReader::File(file) => file.read_volatile(buf),
            ImageReader::Bytes { bytes, pos } => {
                let n = (&bytes[(*pos).min(bytes.len())..]).read_volatile(buf)?;
                *pos += n;
                Ok(n)
            }
        }
    }
}

enum Format {
    Elf,
    BzImage,
}

/// Tell the kernel format from its first bytes, with an error a user understands.
fn kernel_format(reader: &mut ImageReader, name: &str) -> Result<Format, KernelError> {
    let mut head = [0u8; 0x206];
    let mut read = 0;
    while read < head.len() {
        match reader.read(&mut head[read..]) {
            Ok(0) => break,
            Ok(n) => read += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return Err(KernelError::NotAKernel(name.to_string())),
        }
    }
    reader
        .seek(SeekFrom::Start(0))
        .map_err(|_| KernelError::NotAKernel(name.to_string()))?;
    if read >= 20 && head[..4] == *b"\x7fELF" {
        const ELFCLASS64: u8 = 2;
        const EM_X86_64: u16 = 62;
        let machine = u16::from_le_bytes([head[18], head[19]]);
        if head[4] != ELFCLASS64 || machine != EM_X86_64 {
            return Err(KernelError::WrongElf {
                image: name.to_string(),
            });
        }
        return Ok(Format::Elf);
    }
    if read == head.len() && head[0x202..0x206] == *b"HdrS" {
        return Ok(Format::BzImage);
    }
    Err(KernelError::NotAKernel(name.to_string()))
}

/// The loaded kernel: how to enter it.
#[derive(Debug)]
pub struct LoadedKernel {
    pub mode: EntryMode,
    pub entry: u64,
    /// First byte after the kernel image.
    pub end: u64,
    /// bzImage's setup header, to hand back in the zero page.
    setup_header: Option<setup_header>,
}

pub fn load_kernel(mem: &GuestMemory, image: &Image) -> Result<LoadedKernel, KernelError> {
    let name = image.name();
    let mut reader = image.open("the kernel")?;
    let load_err = |source| KernelError::Load {
        image: name.clone(),
        source,
    };
    let himem = Some(GuestAddress(HIMEM_START));
    match kernel_format(&mut reader, &name)? {
        Format::Elf => {
            let result: KernelLoaderResult =
                Elf::load(mem, None, &mut reader, himem).map_err(load_err)?;
            let (mode, entry) = match result.pvh_boot_cap {
                PvhBootCapability::PvhEntryPresent(addr) => (EntryMode::Pvh, addr.raw_value()),
                _ => (EntryMode::Linux64, result.kernel_load.raw_value()),
            };
            Ok(LoadedKernel {
                mode,
                entry,
                end: result.kernel_end,
                setup_header: None,
            })
        }
        Format::BzImage => {
            let result = BzImage::load(mem, None, &mut reader, himem).map_err(load_err)?;
            let header = result
                .setup_header
                .expect("the bzImage loader returns its header");
            // XLF_KERNEL_64: the kernel has a 64-bit entry 0x200 past its start.
            if header.xloadflags & 1 == 0 {
                return Err(KernelError::No64BitEntry(name));
            }
            Ok(LoadedKernel {
                mode: EntryMode::Linux64,
                entry: result.kernel_load.raw_value() + 0x200,
                end: result.kernel_end,
                setup_header: Some(header),
            })
        }
    }
}

/// Where an initrd sits in guest memory.
#[derive(Clone, Copy, Debug)]
pub struct LoadedInitrd {
    pub addr: u64,
    pub size: u64,
}

/// Put the initrd as high in low memory as it goes, above the kernel and below what the
/// kernel can reach (`initrd_addr_max`).
pub fn load_initrd(
    mem: &GuestMemory,
    image: &Image,
    kernel: &LoadedKernel,
) -> Result<LoadedInitrd, KernelError> {
    let name = image.name();
    let mut reader = image.open("the initrd")?;
    let size = reader.len().map_err(|e| KernelError::InitrdRead {
        image: name.clone(),
        reason: e.to_string(),
    })?;
    let max_addr = kernel
        .setup_header
        .map(|h| u64::from(h.initrd_addr_max))
        .filter(|&m| m != 0)
        .unwrap_or(0x7fff_ffff);
    let low_end = mem
        .iter()
        .next()
        .map(|r| r.start_addr().raw_value() + r.len())
        .unwrap_or(0);
    let top = low_end.min(max_addr + 1);
    let too_large = || KernelError::InitrdTooLarge {
        size_mib: size.div_ceil(1 << 20),
    };
    let addr = top.checked_sub(size).ok_or_else(too_large)? & !0xfff;
    if addr < kernel.end {
        return Err(too_large());
    }
    let size_usize = usize::try_from(size).map_err(|_| too_large())?;
    mem.read_exact_volatile_from(GuestAddress(addr), &mut reader, size_usize)
        .map_err(|e| KernelError::InitrdRead {
            image: name,
            reason: e.to_string(),
        })?;
    Ok(LoadedInitrd { addr, size })
}

/// Write the command line (NUL-terminated) where both boot protocols point.
pub fn write_cmdline(mem: &GuestMemory, cmdline: &str) -> Result<(), KernelError> {
    if cmdline.contains('\0') {
        return Err(KernelError::CmdlineNul);
    }
    if cmdline.len() + 1 > CMDLINE_MAX_SIZE {
        return Err(KernelError::CmdlineTooLong {
            len: cmdline.len(),
            max: CMDLINE_MAX_SIZE - 1,
        });
    }
    mem.write_slice(cmdline.as_bytes(), GuestAddress(CMDLINE_START))?;
    mem.write_obj(0u8, GuestAddress(CMDLINE_START + cmdline.len() as u64))?;
    Ok(())
}

/// Everything the boot protocol hands the kernel besides its image.
pub struct BootInfo<'a> {
    pub cmdline_len: usize,
    pub initrd: Option<LoadedInitrd>,
    pub rsdp: u64,
    pub e820: &'a [(u64, u64, u32)],
}

/// PVH: `hvm_start_info` with the memory map and the initrd as module 0.
pub fn write_pvh_start_info(mem: &GuestMemory, info: &BootInfo) -> Result<(), KernelError> {
    const XEN_HVM_START_MAGIC: u32 = 0x336e_c578;
    let mut start = hvm_start_info {
        magic: XEN_HVM_START_MAGIC,
        version: 1,
        cmdline_paddr: CMDLINE_START,
        rsdp_paddr: info.rsdp,
        memmap_paddr: PVH_MEMMAP_START,
        memmap_entries: u32::try_from(info.e820.len()).expect("a memory map of a few entries"),
        ..Default::default()
    };
    if let Some(initrd) = info.initrd {
        let module = hvm_modlist_entry {
            paddr: initrd.addr,
            size: initrd.size,
            ..Default::default()
        };
        mem.write_obj(module, GuestAddress(PVH_MODLIST_START))?;
        start.nr_modules = 1;
        start.modlist_paddr = PVH_MODLIST_START;
    }
    for (i, &(addr, size, type_)) in info.e820.iter().enumerate() {
        let entry = hvm_memmap_table_entry {
            addr,
            size,
            type_,
            reserved: 0,
        };
        let at = PVH_MEMMAP_START + (i * std::mem::size_of::<hvm_memmap_table_entry>()) as u64;
        mem.write_obj(entry, GuestAddress(at))?;
    }
    mem.write_obj(start, GuestAddress(PVH_INFO_START))?;
    Ok(())
}

/// Linux 64-bit boot protocol: the zero page (`boot_params`).
pub fn write_zero_page(
    mem: &GuestMemory,
    kernel: &LoadedKernel,
    info: &BootInfo,
) -> Result<(), KernelError> {
    const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
    const KERNEL_HDR_MAGIC: u32 = 0x5372_6448; // "HdrS"
    const KERNEL_LOADER_OTHER: u8 = 0xff;
    const KERNEL_MIN_ALIGNMENT: u32 = 0x0100_0000;

    let mut params = boot_params::default();
    if let Some(header) = kernel.setup_header {
        params.hdr = header;
    } else {
        params.hdr.boot_flag = KERNEL_BOOT_FLAG_MAGIC;
        params.hdr.header = KERNEL_HDR_MAGIC;
        params.hdr.kernel_alignment = KERNEL_MIN_ALIGNMENT;
    }
    params.hdr.type_of_loader = KERNEL_LOADER_OTHER;
    params.hdr.cmd_line_ptr = below_4g(CMDLINE_START);
    // At most the command line's limit (checked when it was written).
    params.hdr.cmdline_size = u32::try_from(info.cmdline_len).expect("a bounded command line");
    if let Some(initrd) = info.initrd {
        // load_initrd placed it below initrd_addr_max (at most 4 GiB - 1).
        params.hdr.ramdisk_image = below_4g(initrd.addr);
        params.hdr.ramdisk_size = below_4g(initrd.size);
    }
    params.acpi_rsdp_addr = info.rsdp;
    for (slot, &(addr, size, type_)) in params.e820_table.iter_mut().zip(info.e820) {
        *slot = boot_e820_entry {
            addr,
            size,
            r#type: type_,
        };
    }
    params.e820_entries = u8::try_from(info.e820.len().min(params.e820_table.len()))
        .expect("the zero page holds 128 entries");
    mem.write_obj(params, GuestAddress(ZERO_PAGE_START))?;
    Ok(())
}

impl Image {
    /// A symbol's address from an ELF kernel's symbol table (for boot tracing).
    pub fn elf_symbol(&self, wanted: &str) -> Option<u64> {
        match self {
            Image::File(path) => elf_symbol(&std::fs::read(path).ok()?, wanted),
            Image::Embedded { bytes, .. } => elf_symbol(bytes, wanted),
        }
    }
}

fn elf_symbol(data: &[u8], wanted: &str) -> Option<u64> {
    let u16_at = |o: usize| Some(u16::from_le_bytes(data.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(data.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(data.get(o..o + 8)?.try_into().ok()?));
    if data.get(..4)? != b"\x7fELF" || *data.get(4)? != 2 {
        return None;
    }
    let usize_at = |o: usize| usize::try_from(u64_at(o)?).ok();
    let shoff = usize_at(0x28)?;
    let shentsize = usize::from(u16_at(0x3a)?);
    let shnum = usize::from(u16_at(0x3c)?);
    const SHT_SYMTAB: u32 = 2;
    for i in 0..shnum {
        let sh = shoff.checked_add(i.checked_mul(shentsize)?)?;
        // Past the data, every read below fails; bounded, no offset added to it overflows.
        if sh > data.len() {
            return None;
        }
        if u32_at(sh + 4)? != SHT_SYMTAB {
            continue;
        }
        let (symoff, symsize) = (usize_at(sh + 0x18)?, usize_at(sh + 0x20)?);
        let link = usize::try_from(u32_at(sh + 0x28)?).ok()?;
        let strtab = shoff.checked_add(link.checked_mul(shentsize)?)?;
        if strtab > data.len() {
            return None;
        }
        let stroff = usize_at(strtab + 0x18)?;
        for sym in (symoff..symoff.checked_add(symsize)?).step_by(24) {
            if sym > data.len() {
                return None;
            }
            let name_at = stroff.checked_add(usize::try_from(u32_at(sym)?).ok()?)?;
            let name = data.get(name_at..)?.split(|&b| b == 0).next()?;
            if name == wanted.as_bytes() {
                return u64_at(sym + 8);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn format_of(bytes: &'static [u8]) -> Result<Format, KernelError> {
        let mut reader = ImageReader::Bytes { bytes, pos: 0 };
        kernel_format(&mut reader, "test")
    }

    #[test]
    fn recognises_kernel_formats() {
        let mut elf = vec![0u8; 64];
        elf[..4].copy_from_slice(b"\x7fELF");
        elf[4] = 2;
        elf[18] = 62;
        assert!(matches!(format_of(elf.clone().leak()), Ok(Format::Elf)));
        elf[18] = 183; // aarch64
        assert!(matches!(
            format_of(elf.leak()),
            Err(KernelError::WrongElf { .. })
        ));

        let mut bz = vec![0u8; 0x300];
        bz[0x202..0x206].copy_from_slice(b"HdrS");
        assert!(matches!(format_of(bz.leak()), Ok(Format::BzImage)));

        assert!(matches!(
            format_of(b"#!/bin/sh\necho hi\n"),
            Err(KernelError::NotAKernel(_))
        ));
        assert!(matches!(format_of(b""), Err(KernelError::NotAKernel(_))));
    }

    #[test]
    fn byte_reader_seeks_like_a_file() {
        let mut reader = ImageReader::Bytes {
            bytes: b"0123456789",
            pos: 0,
        };
        assert_eq!(reader.seek(SeekFrom::End(-3)).unwrap(), 7);
        let mut buf = [0u8; 8];
        assert_eq!(reader.read(&mut buf).unwrap(), 3);
        assert_eq!(&buf[..3], b"789");
        assert!(reader.seek(SeekFrom::Current(-20)).is_err());
        assert_eq!(reader.seek(SeekFrom::Start(100)).unwrap(), 100);
        assert_eq!(reader.read(&mut buf).unwrap(), 0);
    }
}
