//! ACPI tables for a hardware-reduced platform: RSDP, XSDT, FADT, DSDT and MADT.
//!
//! A guest kernel with ACPI finds its CPUs and IOAPIC in the MADT, and powers off by writing
//! the `\_S5` sleep type to the FADT's sleep control register (mayfly's `AcpiPower` device).
//! Hardware-reduced means no PM timer, GPE blocks or SCI: nothing else to emulate.

use mayfly_devices::legacy::serial::{COM1_IRQ, COM1_PORT, COM1_PORT_COUNT};
use mayfly_devices::power::{
    ACPI_POWER_PORT, RESET_OFFSET, RESET_VALUE, S5_SLEEP_TYPE, SLEEP_CONTROL_OFFSET,
    SLEEP_STATUS_OFFSET,
};
use vm_memory::{Bytes, GuestAddress};

use super::aml;
use super::layout::{
    below_4g, GED_GSI, IDENTITY_PAGE_ADDR, IDENTITY_PAGE_SIZE, IOAPIC_ADDR, LAPIC_ADDR, RSDP_START,
    VMGENID_ADDR,
};
use crate::memory::ram::GuestMemory;
use mayfly_devices::state::DeviceResources;

const OEM_ID: &[u8; 6] = b"MAYFLY";
const OEM_TABLE_ID: &[u8; 8] = b"MICROVM ";
const CREATOR_ID: &[u8; 4] = b"MAYF";

#[derive(Debug, thiserror::Error)]
pub enum AcpiError {
    #[error("cannot write the ACPI tables into guest memory: {0}")]
    Memory(#[from] vm_memory::GuestMemoryError),
    #[error("the ACPI tables take {0} bytes, more than the BIOS area holds: too many devices")]
    TooLarge(u64),
}

fn checksum(bytes: &[u8]) -> u8 {
    bytes
        .iter()
        .fold(0u8, |sum, b| sum.wrapping_add(*b))
        .wrapping_neg()
}

/// A system description table: the 36-byte header, then `body`.
fn sdt(signature: &[u8; 4], revision: u8, body: &[u8]) -> Vec<u8> {
    let mut table = Vec::with_capacity(36 + body.len());
    let len = u32::try_from(36 + body.len()).expect("an ACPI table of a few KiB");
    table.extend_from_slice(signature);
    table.extend_from_slice(&len.to_le_bytes());
    table.push(revision);
    table.push(0); // checksum, below
    table.extend_from_slice(OEM_ID);
    table.extend_from_slice(OEM_TABLE_ID);
    table.extend_from_slice(&1u32.to_le_bytes()); // OEM revision
    table.extend_from_slice(CREATOR_ID);
    table.extend_from_slice(&1u32.to_le_bytes()); // creator revision
    table.extend_from_slice(body);
    table[9] = checksum(&table);
    table
}

/// A Generic Address Structure for a byte-wide register in I/O space.
fn io_register(port: u64) -> [u8; 12] {
    let mut gas = [0u8; 12];
    gas[0] = 1; // system I/O
    gas[1] = 8; // bit width
    gas[3] = 1; // byte access
    gas[4..12].copy_from_slice(&port.to_le_bytes());
    gas
}

fn fadt(dsdt_addr: u64) -> Vec<u8> {
    const FLAG_WBINVD: u32 = 1 << 0;
    const FLAG_POWER_BUTTON_NOT_FIXED: u32 = 1 << 4;
    const FLAG_SLEEP_BUTTON_NOT_FIXED: u32 = 1 << 5;
    const FLAG_RESET_REG_SUP: u32 = 1 << 10;
    const FLAG_HW_REDUCED_ACPI: u32 = 1 << 20;
    const BOOT_ARCH_VGA_NOT_PRESENT: u16 = 1 << 2;
    const BOOT_ARCH_CMOS_RTC_NOT_PRESENT: u16 = 1 << 5;

    // Offsets are the FADT's (ACPI 6.5 table 5.9) minus the 36-byte header.
    let mut body = vec![0u8; 276 - 36];
    let mut put = |offset: usize, bytes: &[u8]| {
        body[offset - 36..offset - 36 + bytes.len()].copy_from_slice(bytes)
    };
    put(40, &below_4g(dsdt_addr).to_le_bytes());
    put(
        109,
        &(BOOT_ARCH_VGA_NOT_PRESENT | BOOT_ARCH_CMOS_RTC_NOT_PRESENT).to_le_bytes(),
    );
    put(
        112,
        &(FLAG_WBINVD
            | FLAG_POWER_BUTTON_NOT_FIXED
            | FLAG_SLEEP_BUTTON_NOT_FIXED
            | FLAG_RESET_REG_SUP
            | FLAG_HW_REDUCED_ACPI)
            .to_le_bytes(),
    );
    put(116, &io_register(ACPI_POWER_PORT + RESET_OFFSET));
    put(128, &[RESET_VALUE]);
    put(131, &[5]); // FADT minor version: ACPI 6.5
    put(140, &dsdt_addr.to_le_bytes());
    put(244, &io_register(ACPI_POWER_PORT + SLEEP_CONTROL_OFFSET));
    put(256, &io_register(ACPI_POWER_PORT + SLEEP_STATUS_OFFSET));
    put(268, b"MAYFLYVM");
    sdt(b"FACP", 6, &body)
}

/// The DSDT: the soft-off sleep type `\_S5`, and the devices. In a hardware-reduced platform
/// the guest maps no ISA interrupt by itself: a device's IRQ works only once the DSDT
/// describes it.
fn dsdt(virtio: &[DeviceResources]) -> Vec<u8> {
    let s5 = aml::package(&[
        aml::integer(u64::from(S5_SLEEP_TYPE)),
        aml::integer(0),
        aml::integer(0),
        aml::integer(0),
    ]);
    let com1 = aml::device(
        "COM1",
        &[
            aml::name("_HID", &aml::eisa_id("PNP0501")),
            aml::name("_UID", &aml::integer(1)),
            aml::name(
                "_CRS",
                &aml::resource_template(&[
                    aml::io_ports(
                        u16::try_from(COM1_PORT).expect("an I/O port"),
                        u8::try_from(COM1_PORT_COUNT).expect("8 ports"),
                    ),
                    aml::irq(u8::try_from(COM1_IRQ).expect("IRQ 4")),
                ]),
            ),
        ],
    );
    // The VM generation ID (Microsoft's VMGenID, which Linux's vmgenid driver implements):
    // when it changes, the guest reseeds its RNG. ADDR is its guest-physical address.
    let vmgenid = aml::device(
        "VGEN",
        &[
            aml::name("_HID", &aml::string("MAYF0001")),
            aml::name("_CID", &aml::string("VM_GEN_COUNTER")),
            aml::name("_DDN", &aml::string("VM_Gen_Counter")),
            aml::name(
                "ADDR",
                &aml::package(&[
                    aml::integer(VMGENID_ADDR & 0xffff_ffff),
                    aml::integer(VMGENID_ADDR >> 32),
                ]),
            ),
        ],
    );
    // The Generic Event Device: its interrupt runs _EVT, which tells VGEN to look again.
    let ged = aml::device(
        "GED0",
        &[
            aml::name("_HID", &aml::string("ACPI0013")),
            aml::name("_UID", &aml::integer(0)),
            aml::name("_CRS", &aml::resource_template(&[aml::interrupt(GED_GSI)])),
            aml::method("_EVT", 1, &[aml::notify("\\_SB.VGEN", 0x80)]),
        ],
    );
    // The identity page: where a guest finds its VM's name and clone index.
    let identity = aml::device(
        "MIDT",
        &[
            aml::name("_HID", &aml::string("MAYF0002")),
            aml::name("_UID", &aml::integer(0)),
            aml::name(
                "_CRS",
                &aml::resource_template(&[aml::memory32_fixed(
                    below_4g(IDENTITY_PAGE_ADDR),
                    below_4g(IDENTITY_PAGE_SIZE),
                )]),
            ),
        ],
    );
    // Each virtio-mmio device: Linux's virtio_mmio driver binds to LNRO0005. The interrupt is
    // edge-triggered, active-high: the irqfd signals edges.
    let mut devices = vec![com1, vmgenid, ged, identity];
    for (i, dev) in virtio.iter().enumerate() {
        devices.push(aml::device(
            &format!("VR{i:02X}"),
            &[
                aml::name("_HID", &aml::string("LNRO0005")),
                aml::name("_UID", &aml::integer(i as u64)),
                aml::name(
                    "_CRS",
                    &aml::resource_template(&[
                        aml::memory32_fixed(below_4g(dev.mmio_base), below_4g(dev.mmio_size)),
                        aml::interrupt(dev.gsi),
                    ]),
                ),
            ],
        ));
    }
    let body = [aml::name("_S5", &s5), aml::scope("\\_SB", &devices)].concat();
    sdt(b"DSDT", 6, &body)
}

fn madt(vcpus: u8) -> Vec<u8> {
    const PCAT_COMPAT: u32 = 1;
    let mut body = Vec::new();
    body.extend_from_slice(&LAPIC_ADDR.to_le_bytes());
    body.extend_from_slice(&PCAT_COMPAT.to_le_bytes());
    for cpu in 0..vcpus {
        // Processor local APIC: UID, APIC ID, enabled.
        body.extend_from_slice(&[0, 8, cpu, cpu]);
        body.extend_from_slice(&1u32.to_le_bytes());
    }
    // IOAPIC: ID after the CPUs', GSIs from 0.
    body.extend_from_slice(&[1, 12, vcpus, 0]);
    body.extend_from_slice(&IOAPIC_ADDR.to_le_bytes());
    body.extend_from_slice(&0u32.to_le_bytes());
    // Local APIC NMI: every processor, LINT1.
    body.extend_from_slice(&[4, 6, 0xff, 0, 0, 1]);
    sdt(b"APIC", 6, &body)
}

fn xsdt(tables: &[u64]) -> Vec<u8> {
    let body: Vec<u8> = tables.iter().flat_map(|a| a.to_le_bytes()).collect();
    sdt(b"XSDT", 1, &body)
}

fn rsdp(xsdt_addr: u64) -> Vec<u8> {
    let mut rsdp = Vec::with_capacity(36);
    rsdp.extend_from_slice(b"RSD PTR ");
    rsdp.push(0); // checksum of the first 20 bytes, below
    rsdp.extend_from_slice(OEM_ID);
    rsdp.push(2); // revision: ACPI 2.0+, has the XSDT
    rsdp.extend_from_slice(&0u32.to_le_bytes()); // no RSDT
    rsdp.extend_from_slice(&36u32.to_le_bytes());
    rsdp.extend_from_slice(&xsdt_addr.to_le_bytes());
    rsdp.push(0); // extended checksum, below
    rsdp.extend_from_slice(&[0; 3]);
    rsdp[8] = checksum(&rsdp[..20]);
    rsdp[32] = checksum(&rsdp);
    rsdp
}

/// All tables, laid out from `base` (the RSDP first), as (address, bytes).
fn build(base: u64, vcpus: u8, virtio: &[DeviceResources]) -> Vec<(u64, Vec<u8>)> {
    let align = |addr: u64| (addr + 15) & !15;
    let rsdp_addr = base;
    let xsdt_addr = align(rsdp_addr + 36);
    // The XSDT points at two tables.
    let fadt_addr = align(xsdt_addr + 36 + 2 * 8);
    let dsdt_addr = align(fadt_addr + 276);
    let dsdt = dsdt(virtio);
    let madt_addr = align(dsdt_addr + dsdt.len() as u64);
    vec![
        (rsdp_addr, rsdp(xsdt_addr)),
        (xsdt_addr, xsdt(&[fadt_addr, madt_addr])),
        (fadt_addr, fadt(dsdt_addr)),
        (dsdt_addr, dsdt),
        (madt_addr, madt(vcpus)),
    ]
}

/// Write the tables at [`RSDP_START`]; returns the RSDP's address for the boot protocol.
pub fn write_acpi_tables(
    mem: &GuestMemory,
    vcpus: u8,
    virtio: &[DeviceResources],
) -> Result<u64, AcpiError> {
    let tables = build(RSDP_START, vcpus, virtio);
    // The tables live in the BIOS area below the identity page; a DSDT that grew past it
    // would overwrite what follows.
    let end = tables
        .iter()
        .map(|(addr, bytes)| addr + bytes.len() as u64)
        .max()
        .unwrap_or(RSDP_START);
    if end > IDENTITY_PAGE_ADDR {
        return Err(AcpiError::TooLarge(end - RSDP_START));
    }
    for (addr, bytes) in tables {
        mem.write_slice(&bytes, GuestAddress(addr))?;
    }
    Ok(RSDP_START)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sums_to_zero(bytes: &[u8]) -> bool {
        bytes.iter().fold(0u8, |s, b| s.wrapping_add(*b)) == 0
    }

    #[test]
    fn tables_are_consistent() {
        let virtio = [DeviceResources {
            mmio_base: 0xd000_1000,
            mmio_size: 0x1000,
            gsi: 6,
        }];
        let tables = build(0xe0000, 2, &virtio);
        let (_, rsdp) = &tables[0];
        assert!(sums_to_zero(&rsdp[..20]) && sums_to_zero(rsdp));
        for (addr, table) in &tables[1..] {
            assert_eq!(addr % 16, 0);
            let len = u32::from_le_bytes(table[4..8].try_into().unwrap()) as usize;
            assert_eq!(len, table.len());
            assert!(
                sums_to_zero(table),
                "{}",
                String::from_utf8_lossy(&table[..4])
            );
        }
        // Tables do not overlap.
        for pair in tables.windows(2) {
            assert!(pair[0].0 + pair[0].1.len() as u64 <= pair[1].0);
        }
        let xsdt = &tables[1].1;
        assert_eq!(
            u64::from_le_bytes(xsdt[36..44].try_into().unwrap()),
            tables[2].0
        );
        assert_eq!(
            u64::from_le_bytes(xsdt[44..52].try_into().unwrap()),
            tables[4].0
        );
        let fadt = &tables[2].1;
        assert_eq!(fadt.len(), 276);
        assert_eq!(
            u64::from_le_bytes(fadt[140..148].try_into().unwrap()),
            tables[3].0
        );
        let madt = &tables[4].1;
        // Header, APIC address and flags, 2 CPUs, IOAPIC, NMI.
        assert_eq!(madt.len(), 36 + 8 + 2 * 8 + 12 + 6);
    }
}
