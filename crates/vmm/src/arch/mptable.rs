//! The Intel MultiProcessor Specification 1.4 table: how a guest without ACPI (or booted with
//! `acpi=off`) finds its CPUs, its IOAPIC and how ISA interrupts are wired.

use vm_memory::{Bytes, GuestAddress};

use super::layout::{below_4g, IOAPIC_ADDR, IOAPIC_PINS, LAPIC_ADDR, MPTABLE_START};
use crate::memory::ram::GuestMemory;

/// APIC IDs are 8 bits and the IOAPIC takes the ID after the last CPU.
pub const MAX_VCPUS: u8 = 254;

const APIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;
const BUS_ISA: u8 = 0;
const ENTRY_PROCESSOR: u8 = 0;
const ENTRY_BUS: u8 = 1;
const ENTRY_IOAPIC: u8 = 2;
const ENTRY_IO_INTERRUPT: u8 = 3;
const ENTRY_LOCAL_INTERRUPT: u8 = 4;
const INT_TYPE_INT: u8 = 0;
const INT_TYPE_NMI: u8 = 1;
const INT_TYPE_EXTINT: u8 = 3;
const CPU_ENABLED: u8 = 1;
const CPU_BOOTSTRAP: u8 = 2;

#[derive(Debug, thiserror::Error)]
pub enum MpTableError {
    #[error("the MP table supports 1 to {MAX_VCPUS} vCPUs, not {0}")]
    VcpuCount(u8),
    #[error("cannot write the MP table into guest memory: {0}")]
    Memory(#[from] vm_memory::GuestMemoryError),
}

/// Two's complement of the byte sum, so the covered bytes add up to zero.
fn checksum(bytes: &[u8]) -> u8 {
    bytes
        .iter()
        .fold(0u8, |sum, b| sum.wrapping_add(*b))
        .wrapping_neg()
}

/// The table for `vcpus` CPUs, to be placed at `base`: floating pointer, then the configuration
/// table.
fn build(vcpus: u8, base: u32) -> Vec<u8> {
    const FLOATING_LEN: usize = 16;
    const HEADER_LEN: usize = 44;
    let ioapic_id = vcpus;

    let mut entries = Vec::new();
    let mut count: u16 = 0;
    for cpu in 0..vcpus {
        let flags = CPU_ENABLED | if cpu == 0 { CPU_BOOTSTRAP } else { 0 };
        entries.extend_from_slice(&[ENTRY_PROCESSOR, cpu, APIC_VERSION, flags]);
        entries.extend_from_slice(&0x600u32.to_le_bytes()); // signature: family 6
        entries.extend_from_slice(&0x201u32.to_le_bytes()); // features: FPU, APIC
        entries.extend_from_slice(&[0; 8]);
        count += 1;
    }
    entries.extend_from_slice(&[ENTRY_BUS, BUS_ISA]);
    entries.extend_from_slice(b"ISA   ");
    entries.extend_from_slice(&[ENTRY_IOAPIC, ioapic_id, IOAPIC_VERSION, 1]);
    entries.extend_from_slice(&IOAPIC_ADDR.to_le_bytes());
    count += 2;
    // IRQ n goes to IOAPIC pin n, as KVM routes GSIs by default (the PIT included).
    for pin in 0..IOAPIC_PINS {
        entries.extend_from_slice(&[
            ENTRY_IO_INTERRUPT,
            INT_TYPE_INT,
            0,
            0,
            BUS_ISA,
            pin,
            ioapic_id,
            pin,
        ]);
        count += 1;
    }
    // Every local APIC: LINT0 ExtINT, LINT1 NMI.
    entries.extend_from_slice(&[
        ENTRY_LOCAL_INTERRUPT,
        INT_TYPE_EXTINT,
        0,
        0,
        BUS_ISA,
        0,
        0xff,
        0,
    ]);
    entries.extend_from_slice(&[
        ENTRY_LOCAL_INTERRUPT,
        INT_TYPE_NMI,
        0,
        0,
        BUS_ISA,
        0,
        0xff,
        1,
    ]);
    count += 2;

    let table_len =
        u16::try_from(HEADER_LEN + entries.len()).expect("an MP table of a few hundred bytes");
    let mut table = Vec::with_capacity(usize::from(table_len));
    table.extend_from_slice(b"PCMP");
    table.extend_from_slice(&table_len.to_le_bytes());
    table.push(4); // spec revision 1.4
    table.push(0); // checksum, below
    table.extend_from_slice(b"MAYFLY  ");
    table.extend_from_slice(b"MICROVM     ");
    table.extend_from_slice(&0u32.to_le_bytes()); // OEM table
    table.extend_from_slice(&0u16.to_le_bytes());
    table.extend_from_slice(&count.to_le_bytes());
    table.extend_from_slice(&LAPIC_ADDR.to_le_bytes());
    table.extend_from_slice(&0u16.to_le_bytes()); // extended table
    table.push(0);
    table.push(0);
    table.extend_from_slice(&entries);
    table[7] = checksum(&table);

    let mut floating = Vec::with_capacity(FLOATING_LEN);
    floating.extend_from_slice(b"_MP_");
    floating.extend_from_slice(&(base + below_4g(FLOATING_LEN as u64)).to_le_bytes());
    floating.push(1); // length in 16-byte units
    floating.push(4); // spec revision
    floating.push(0); // checksum, below
    floating.extend_from_slice(&[0; 5]); // features: configuration table present
    floating[10] = checksum(&floating);

    floating.extend_from_slice(&table);
    floating
}

pub fn write_mptable(mem: &GuestMemory, vcpus: u8) -> Result<(), MpTableError> {
    if vcpus == 0 || vcpus > MAX_VCPUS {
        return Err(MpTableError::VcpuCount(vcpus));
    }
    let table = build(vcpus, below_4g(MPTABLE_START));
    mem.write_slice(&table, GuestAddress(MPTABLE_START))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_and_counts() {
        let table = build(4, 0xf0000);
        let (floating, config) = table.split_at(16);
        assert_eq!(&floating[0..4], b"_MP_");
        assert_eq!(floating.iter().fold(0u8, |s, b| s.wrapping_add(*b)), 0);
        assert_eq!(
            u32::from_le_bytes(floating[4..8].try_into().unwrap()),
            0xf0010
        );
        assert_eq!(&config[0..4], b"PCMP");
        let len = u16::from_le_bytes([config[4], config[5]]) as usize;
        assert_eq!(len, config.len());
        assert_eq!(config.iter().fold(0u8, |s, b| s.wrapping_add(*b)), 0);
        let entries = u16::from_le_bytes([config[34], config[35]]);
        assert_eq!(entries, 4 + 2 + u16::from(IOAPIC_PINS) + 2);
        // The first processor is the bootstrap one, the others only enabled.
        assert_eq!(config[44 + 3], CPU_ENABLED | CPU_BOOTSTRAP);
        assert_eq!(config[44 + 20 + 3], CPU_ENABLED);
    }

    #[test]
    fn largest_table_fits_the_bios_area() {
        assert!(build(MAX_VCPUS, 0xf0000).len() < 0x10000);
    }
}
