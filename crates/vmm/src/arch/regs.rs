//! A vCPU's registers at boot: segments, page tables, MSRs, FPU and local APIC.

use kvm_bindings::{
    kvm_fpu, kvm_lapic_state, kvm_msr_entry, kvm_regs, kvm_segment, kvm_sregs, Msrs,
};
use kvm_ioctls::VcpuFd;
use vm_memory::{Bytes, GuestAddress};

use super::layout::*;
use crate::memory::ram::GuestMemory;

#[derive(Debug, thiserror::Error)]
pub enum RegsError {
    #[error("cannot write the boot {what} into guest memory: {source}")]
    Memory {
        what: &'static str,
        source: vm_memory::GuestMemoryError,
    },
    #[error("KVM refused the vCPU's {what}: {source}")]
    Kvm {
        what: &'static str,
        source: kvm_ioctls::Error,
    },
}

fn kvm(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> RegsError {
    move |source| RegsError::Kvm { what, source }
}

/// How the kernel is entered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryMode {
    /// PVH: 32-bit protected mode, paging off, `rbx` = start_info.
    Pvh,
    /// Linux 64-bit boot protocol: long mode with identity-mapped low memory, `rsi` = zero page.
    Linux64,
}

const X86_CR0_PE: u64 = 1 << 0;
const X86_CR0_ET: u64 = 1 << 4;
const X86_CR0_PG: u64 = 1 << 31;
const X86_CR4_PAE: u64 = 1 << 5;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;

/// A GDT entry from flags, base and limit (the usual packing of the x86 descriptor).
fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    ((u64::from(base) & 0xff00_0000) << 32)
        | ((u64::from(flags) & 0xf0ff) << 40)
        | ((u64::from(limit) & 0x000f_0000) << 32)
        | ((u64::from(base) & 0x00ff_ffff) << 16)
        | (u64::from(limit) & 0x0000_ffff)
}

/// The KVM view of descriptor `index` of `table`.
fn segment(table: &[u64], index: usize) -> kvm_segment {
    let entry = table[index];
    let flags = (entry >> 40) & 0xf0ff;
    let base = ((entry >> 16) & 0x00ff_ffff) | ((entry >> 32) & 0xff00_0000);
    let limit = (entry & 0xffff) | ((entry >> 32) & 0x000f_0000);
    let granular = (flags >> 15) & 1;
    kvm_segment {
        base,
        // A page-granular limit counts 4 KiB units.
        // A 20-bit limit, so 32 bits once scaled by pages.
        limit: u32::try_from(if granular == 1 {
            (limit << 12) | 0xfff
        } else {
            limit
        })
        .expect("a 20-bit segment limit"),
        selector: u16::try_from(index * 8).expect("a boot GDT of a few entries"),
        type_: (flags & 0xf) as u8,
        present: ((flags >> 7) & 1) as u8,
        dpl: ((flags >> 5) & 3) as u8,
        db: ((flags >> 14) & 1) as u8,
        s: ((flags >> 4) & 1) as u8,
        l: ((flags >> 13) & 1) as u8,
        g: granular as u8,
        avl: ((flags >> 12) & 1) as u8,
        unusable: 0,
        padding: 0,
    }
}

/// The boot GDT: null, code, data, TSS. The code segment is 64-bit for long mode, 32-bit for PVH.
fn boot_gdt(mode: EntryMode) -> [u64; 4] {
    let code = match mode {
        EntryMode::Linux64 => 0xa09b, // present, DPL0, code exec/read, L=1
        EntryMode::Pvh => 0xc09b,     // present, DPL0, code exec/read, D=1, 4K granular
    };
    [
        0,
        gdt_entry(code, 0, 0xfffff),
        gdt_entry(0xc093, 0, 0xfffff), // data read/write, 4K granular
        gdt_entry(0x808b, 0, 0xfffff), // 32-bit busy TSS
    ]
}

/// Registers of the boot vCPU: entry point and the boot protocol's pointer argument.
pub fn setup_regs(vcpu: &VcpuFd, mode: EntryMode, entry: u64) -> Result<(), RegsError> {
    let mut regs = kvm_regs {
        rflags: 0x2,
        rip: entry,
        ..Default::default()
    };
    match mode {
        EntryMode::Pvh => regs.rbx = PVH_INFO_START,
        EntryMode::Linux64 => {
            regs.rsp = BOOT_STACK_POINTER;
            regs.rbp = BOOT_STACK_POINTER;
            regs.rsi = ZERO_PAGE_START;
        }
    }
    vcpu.set_regs(&regs).map_err(kvm("registers"))
}

/// Segment and control registers, and the GDT/IDT (and page tables, for long mode) they use.
pub fn setup_sregs(mem: &GuestMemory, vcpu: &VcpuFd, mode: EntryMode) -> Result<(), RegsError> {
    let mem_err = |what| move |source| RegsError::Memory { what, source };
    let gdt = boot_gdt(mode);
    for (i, entry) in gdt.iter().enumerate() {
        mem.write_obj(*entry, GuestAddress(BOOT_GDT_START + 8 * i as u64))
            .map_err(mem_err("GDT"))?;
    }
    mem.write_obj(0u64, GuestAddress(BOOT_IDT_START))
        .map_err(mem_err("IDT"))?;

    let mut sregs: kvm_sregs = vcpu.get_sregs().map_err(kvm("segment registers"))?;
    let code = segment(&gdt, 1);
    let data = segment(&gdt, 2);
    sregs.gdt.base = BOOT_GDT_START;
    sregs.gdt.limit = u16::try_from(gdt.len() * 8 - 1).expect("a boot GDT of a few entries");
    sregs.idt.base = BOOT_IDT_START;
    sregs.idt.limit = 7;
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = segment(&gdt, 3);
    // Caching enabled (KVM's reset value of CR0 has CD and NW set).
    sregs.cr0 = X86_CR0_PE | X86_CR0_ET;
    sregs.cr4 = 0;
    sregs.efer = 0;

    if mode == EntryMode::Linux64 {
        setup_identity_map(mem)?;
        sregs.cr3 = PML4_START;
        sregs.cr4 |= X86_CR4_PAE;
        sregs.cr0 |= X86_CR0_PG;
        sregs.efer |= EFER_LME | EFER_LMA;
    }
    vcpu.set_sregs(&sregs).map_err(kvm("segment registers"))
}

/// Identity-map the first 1 GiB with 2 MiB pages: enough for the 64-bit entry of Linux, which
/// builds its own page tables straight away.
fn setup_identity_map(mem: &GuestMemory) -> Result<(), RegsError> {
    let err = |source| RegsError::Memory {
        what: "page tables",
        source,
    };
    const PRESENT_WRITABLE: u64 = 0x3;
    const HUGE: u64 = 0x80;
    mem.write_obj(PDPT_START | PRESENT_WRITABLE, GuestAddress(PML4_START))
        .map_err(err)?;
    mem.write_obj(PD_START | PRESENT_WRITABLE, GuestAddress(PDPT_START))
        .map_err(err)?;
    let mut pd = [0u8; 4096];
    for (i, chunk) in pd.chunks_exact_mut(8).enumerate() {
        let entry = ((i as u64) << 21) | PRESENT_WRITABLE | HUGE;
        chunk.copy_from_slice(&entry.to_le_bytes());
    }
    mem.write_slice(&pd, GuestAddress(PD_START)).map_err(err)
}

/// x87 and SSE control words as after FNINIT / reset.
pub fn setup_fpu(vcpu: &VcpuFd) -> Result<(), RegsError> {
    let fpu = kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    };
    vcpu.set_fpu(&fpu).map_err(kvm("FPU state"))
}

mod msr_index {
    pub const IA32_TSC: u32 = 0x10;
    pub const IA32_SYSENTER_CS: u32 = 0x174;
    pub const IA32_SYSENTER_ESP: u32 = 0x175;
    pub const IA32_SYSENTER_EIP: u32 = 0x176;
    pub const IA32_MISC_ENABLE: u32 = 0x1a0;
    pub const MTRR_DEF_TYPE: u32 = 0x2ff;
    pub const STAR: u32 = 0xc000_0081;
    pub const LSTAR: u32 = 0xc000_0082;
    pub const CSTAR: u32 = 0xc000_0083;
    pub const SYSCALL_MASK: u32 = 0xc000_0084;
    pub const KERNEL_GS_BASE: u32 = 0xc000_0102;
}

/// MSRs at boot: syscall MSRs cleared, fast strings on, MTRRs enabled with write-back default.
pub fn setup_msrs(vcpu: &VcpuFd) -> Result<(), RegsError> {
    use msr_index::*;
    let entry = |index, data| kvm_msr_entry {
        index,
        data,
        ..Default::default()
    };
    let entries = [
        entry(IA32_SYSENTER_CS, 0),
        entry(IA32_SYSENTER_ESP, 0),
        entry(IA32_SYSENTER_EIP, 0),
        entry(STAR, 0),
        entry(CSTAR, 0),
        entry(KERNEL_GS_BASE, 0),
        entry(SYSCALL_MASK, 0),
        entry(LSTAR, 0),
        entry(IA32_TSC, 0),
        entry(IA32_MISC_ENABLE, 1),          // fast string operations
        entry(MTRR_DEF_TYPE, (1 << 11) | 6), // MTRRs on, default type write-back
    ];
    let msrs = Msrs::from_entries(&entries).map_err(|_| RegsError::Kvm {
        what: "boot MSRs",
        source: kvm_ioctls::Error::new(libc::EINVAL),
    })?;
    let written = vcpu.set_msrs(&msrs).map_err(kvm("boot MSRs"))?;
    if written != entries.len() {
        let failed = entries[written].index;
        return Err(RegsError::Kvm {
            what: if failed == MTRR_DEF_TYPE {
                "MTRR default type MSR"
            } else {
                "boot MSRs"
            },
            source: kvm_ioctls::Error::new(libc::EINVAL),
        });
    }
    Ok(())
}

const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

fn lapic_reg(lapic: &kvm_lapic_state, offset: usize) -> u32 {
    let bytes: [u8; 4] = std::array::from_fn(|i| lapic.regs[offset + i].to_ne_bytes()[0]);
    u32::from_le_bytes(bytes)
}

fn set_lapic_reg(lapic: &mut kvm_lapic_state, offset: usize, value: u32) {
    for (i, byte) in value.to_le_bytes().iter().enumerate() {
        lapic.regs[offset + i] = libc::c_char::from_ne_bytes([*byte]);
    }
}

/// Local APIC: LINT0 delivers the PIC's interrupts (ExtINT), LINT1 delivers NMIs, as the MP
/// table and MADT say.
pub fn setup_lapic(vcpu: &VcpuFd) -> Result<(), RegsError> {
    let mut lapic = vcpu.get_lapic().map_err(kvm("local APIC"))?;
    let with_mode = |reg: u32, mode: u32| (reg & !0x700) | (mode << 8);
    let lvt0 = lapic_reg(&lapic, APIC_LVT0);
    set_lapic_reg(&mut lapic, APIC_LVT0, with_mode(lvt0, APIC_MODE_EXTINT));
    let lvt1 = lapic_reg(&lapic, APIC_LVT1);
    set_lapic_reg(&mut lapic, APIC_LVT1, with_mode(lvt1, APIC_MODE_NMI));
    vcpu.set_lapic(&lapic).map_err(kvm("local APIC"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gdt_entries_decode_back() {
        let gdt = boot_gdt(EntryMode::Linux64);
        let code = segment(&gdt, 1);
        assert_eq!((code.l, code.db, code.present, code.type_), (1, 0, 1, 0xb));
        assert_eq!(code.limit, 0xffff_ffff);
        assert_eq!(code.selector, 8);
        let pvh_code = segment(&boot_gdt(EntryMode::Pvh), 1);
        assert_eq!((pvh_code.l, pvh_code.db), (0, 1));
        let data = segment(&gdt, 2);
        assert_eq!((data.type_, data.s, data.selector), (3, 1, 16));
        let tss = segment(&gdt, 3);
        assert_eq!((tss.type_, tss.s), (0xb, 0));
    }

    #[test]
    fn lapic_register_roundtrip() {
        let mut lapic = kvm_lapic_state::default();
        set_lapic_reg(&mut lapic, APIC_LVT0, 0x1_0700);
        assert_eq!(lapic_reg(&lapic, APIC_LVT0), 0x1_0700);
    }
}
