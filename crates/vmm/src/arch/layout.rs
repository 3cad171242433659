//! Where things live in the guest's physical address space.
//!
//! ```text
//! 0x0000_0500  boot GDT (4 entries), then the IDT
//! 0x0000_6000  PVH start_info, module list, memory map
//! 0x0000_7000  Linux zero page (boot_params)
//! 0x0000_8ff0  boot stack (grows down)
//! 0x0000_9000  boot page tables: PML4, PDPT, PD (identity map of the first 1 GiB)
//! 0x0002_0000  kernel command line
//! 0x0009_fc00  EBDA: reserved, as on a PC
//! 0x000e_0000  ACPI tables, RSDP first (BIOS area, reserved)
//! 0x000e_e000  identity page: the VM's name and clone index, for the guest (reserved)
//! 0x000e_f000  VM generation ID, 16 bytes (ACPI VMGenID, reserved)
//! 0x000f_0000  MP table (BIOS area, reserved)
//! 0x0010_0000  high memory: the kernel is loaded at its ELF physical address (16 MiB)
//! 0xc000_0000  MMIO gap to 4 GiB: IOAPIC, local APIC, later virtio-mmio devices
//! 0x1_0000_0000  RAM beyond 3 GiB continues here
//! ```

use mayfly_snapshot::MemoryRange;

pub const BOOT_GDT_START: u64 = 0x500;
pub const BOOT_IDT_START: u64 = 0x520;
pub const PVH_INFO_START: u64 = 0x6000;
pub const PVH_MODLIST_START: u64 = 0x6040;
pub const PVH_MEMMAP_START: u64 = 0x6080;
pub const ZERO_PAGE_START: u64 = 0x7000;
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
pub const PML4_START: u64 = 0x9000;
pub const PDPT_START: u64 = 0xa000;
pub const PD_START: u64 = 0xb000;
pub const CMDLINE_START: u64 = 0x20000;
/// Linux's x86 COMMAND_LINE_SIZE, including the terminating NUL.
pub const CMDLINE_MAX_SIZE: usize = 2048;
/// Start of the extended BIOS data area: RAM below it is usable, the rest of the first MiB is not.
pub const EBDA_START: u64 = 0x9fc00;
/// A page of text the VMM writes and the guest reads through /dev/mem (see `identity`).
pub const IDENTITY_PAGE_ADDR: u64 = 0xee000;
pub const IDENTITY_PAGE_SIZE: u64 = 0x1000;
/// The 128-bit VM generation ID the guest's vmgenid driver watches.
pub const VMGENID_ADDR: u64 = 0xef000;
/// The interrupt of the ACPI Generic Event Device that tells the guest the ID changed.
pub const GED_GSI: u32 = 5;
/// The guest scans 0xf0000..0x100000 for the MP floating pointer.
pub const MPTABLE_START: u64 = 0xf0000;
/// The guest finds the RSDP by scanning 0xe0000..0x100000, or through the boot protocol.
pub const RSDP_START: u64 = 0xe0000;
pub const HIMEM_START: u64 = 0x10_0000;

pub const MMIO_GAP_START: u64 = 0xc000_0000;
pub const MMIO_GAP_END: u64 = 1 << 32;
pub const IOAPIC_ADDR: u32 = 0xfec0_0000;
pub const LAPIC_ADDR: u32 = 0xfee0_0000;
/// KVM needs three pages for the real-mode TSS and one for the identity map, inside the gap.
pub const KVM_TSS_ADDR: usize = 0xfffb_d000;
pub const KVM_IDENTITY_MAP_ADDR: u64 = 0xfffb_c000;

/// The IOAPIC's pins (GSIs 0..24).
pub const IOAPIC_PINS: u8 = 24;

/// RAM for a guest of `mem_bytes`: below the MMIO gap, then the rest above 4 GiB. The memory
/// file holds both back to back.
pub fn ram_ranges(mem_bytes: u64) -> Vec<MemoryRange> {
    let low = mem_bytes.min(MMIO_GAP_START);
    let mut ranges = vec![MemoryRange {
        guest_addr: 0,
        size: low,
        file_offset: 0,
    }];
    if mem_bytes > low {
        ranges.push(MemoryRange {
            guest_addr: MMIO_GAP_END,
            size: mem_bytes - low,
            file_offset: low,
        });
    }
    ranges
}

/// E820 entry types.
pub const E820_RAM: u32 = 1;
pub const E820_RESERVED: u32 = 2;

/// The guest's memory map, as both boot protocols hand it over.
pub fn e820_map(mem_bytes: u64) -> Vec<(u64, u64, u32)> {
    let mut map = vec![
        (0, EBDA_START, E820_RAM),
        (EBDA_START, HIMEM_START - EBDA_START, E820_RESERVED),
    ];
    for range in ram_ranges(mem_bytes) {
        if range.guest_addr == 0 {
            map.push((HIMEM_START, range.size - HIMEM_START, E820_RAM));
        } else {
            map.push((range.guest_addr, range.size, E820_RAM));
        }
    }
    map
}

/// An address or size of the fixed layout's 32-bit part (ACPI tables, the MP table, the boot
/// parameters, MMIO windows below the gap) as the 32-bit field that records it.
pub fn below_4g(value: u64) -> u32 {
    u32::try_from(value).expect("the 32-bit part of the layout lies below 4 GiB")
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    #[test]
    fn small_guest_is_one_range() {
        assert_eq!(
            ram_ranges(128 * MIB),
            vec![MemoryRange {
                guest_addr: 0,
                size: 128 * MIB,
                file_offset: 0
            }]
        );
        let map = e820_map(128 * MIB);
        assert_eq!(map.last().unwrap(), &(HIMEM_START, 127 * MIB, E820_RAM));
    }

    #[test]
    fn large_guest_skips_the_mmio_gap() {
        let ranges = ram_ranges(4 * GIB);
        assert_eq!(ranges.len(), 2);
        assert_eq!(ranges[0].size, 3 * GIB);
        assert_eq!(ranges[1].guest_addr, 4 * GIB);
        assert_eq!(ranges[1].size, GIB);
        assert_eq!(ranges[1].file_offset, 3 * GIB);
        let ram: u64 = e820_map(4 * GIB)
            .iter()
            .filter(|e| e.2 == E820_RAM)
            .map(|e| e.1)
            .sum();
        // All RAM but the reserved part of the first MiB.
        assert_eq!(ram, 4 * GIB - (HIMEM_START - EBDA_START));
    }
}
