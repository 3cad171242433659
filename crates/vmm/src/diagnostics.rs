//! What a stuck guest looks like from the VMM: a state dump (on SIGUSR1, and whenever a test
//! or the stress test finds a VM that stopped answering) of where each vCPU thread is, its
//! local APIC (pending and in-service vectors, task priority, timer), MP state, pending events,
//! timer MSRs and registers, the IOAPIC and the UART.
//!
//! Where the vCPU threads are is read first, without pausing: pausing kicks every vCPU out of
//! KVM_RUN, which is itself a change (KVM moves an expired timer into the IRR on the way out),
//! so only that first line says what the VM was doing before anyone looked.

use std::fmt::Write as _;

use kvm_bindings::{kvm_lapic_state, kvm_msr_entry, kvm_vcpu_events, Msrs};
use kvm_ioctls::VcpuFd;

use crate::machine::Machine;

/// A 32-bit local APIC register.
fn lapic_reg(lapic: &kvm_lapic_state, offset: usize) -> u32 {
    u32::from_le_bytes(std::array::from_fn(|b| {
        lapic.regs[offset + b].to_ne_bytes()[0]
    }))
}

/// A 256-bit local APIC vector register (ISR, TMR, IRR) as the vectors set in it.
fn lapic_vectors(lapic: &kvm_lapic_state, offset: usize) -> Vec<String> {
    let mut vectors = Vec::new();
    for word in 0..8 {
        let bits = lapic_reg(lapic, offset + word * 0x10);
        for bit in 0..32 {
            if bits & (1 << bit) != 0 {
                vectors.push(format!("{:#04x}", word * 32 + bit));
            }
        }
    }
    vectors
}

fn describe_lapic(lapic: &kvm_lapic_state) -> String {
    let list = |v: Vec<String>| {
        if v.is_empty() {
            "-".to_string()
        } else {
            v.join(",")
        }
    };
    format!(
        "lapic: IRR {} ISR {} TMR {} TPR {:#x} PPR {:#x} SVR {:#x} LVTT {:#x} TMICT {:#x} TMCCT {:#x} TDCR {:#x}",
        list(lapic_vectors(lapic, 0x200)),
        list(lapic_vectors(lapic, 0x100)),
        list(lapic_vectors(lapic, 0x180)),
        lapic_reg(lapic, 0x80),
        lapic_reg(lapic, 0xa0),
        lapic_reg(lapic, 0xf0),
        lapic_reg(lapic, 0x320),
        lapic_reg(lapic, 0x380),
        lapic_reg(lapic, 0x390),
        lapic_reg(lapic, 0x3e0),
    )
}

fn describe_events(e: &kvm_vcpu_events) -> String {
    format!(
        "events: exception injected={} pending={} nr={} | interrupt injected={} nr={:#x} soft={} shadow={} | nmi injected={} pending={} masked={} | flags {:#x}",
        e.exception.injected,
        e.exception.pending,
        e.exception.nr,
        e.interrupt.injected,
        e.interrupt.nr,
        e.interrupt.soft,
        e.interrupt.shadow,
        e.nmi.injected,
        e.nmi.pending,
        e.nmi.masked,
        e.flags
    )
}

/// The MSRs that decide when a guest's timer fires.
const TIMER_MSRS: [(u32, &str); 4] = [
    (0x10, "TSC"),
    (0x6e0, "TSC_DEADLINE"),
    (0x4b56_4d01, "KVM_SYSTEM_TIME"),
    (0x4b56_4d04, "KVM_PV_EOI"),
];

fn describe_msrs(fd: &VcpuFd) -> String {
    let entries: Vec<kvm_msr_entry> = TIMER_MSRS
        .iter()
        .map(|&(index, _)| kvm_msr_entry {
            index,
            ..Default::default()
        })
        .collect();
    let Ok(mut msrs) = Msrs::from_entries(&entries) else {
        return "msrs: unavailable".into();
    };
    let read = fd.get_msrs(&mut msrs).unwrap_or(0);
    let mut out = String::from("msrs:");
    for (entry, (_, name)) in msrs.as_slice()[..read].iter().zip(TIMER_MSRS) {
        let _ = write!(out, " {name} {:#x}", entry.data);
    }
    out
}

/// Where a vCPU's page walk starts, for [`page_walk`]: (CR3, RIP, CR2), in long mode only.
type WalkStart = Option<(u64, u64, u64)>;

/// The guest's own page-table entries for `va` under `cr3` (4-level paging), read from guest
/// memory as the VMM maps it. Tells apart a guest whose tables really say "not present" from
/// one whose vCPU sees memory other than what the VMM maps (a fault at a mapped address).
pub fn page_walk(mem: &crate::memory::ram::GuestMemory, cr3: u64, va: u64) -> String {
    use vm_memory::{Bytes, GuestAddress};
    const ADDR: u64 = 0x000f_ffff_ffff_f000;
    let mut out = format!("walk {va:#x}:");
    let mut table = cr3 & ADDR;
    for (level, name) in [(39u32, "pml4e"), (30, "pdpte"), (21, "pde"), (12, "pte")] {
        let index = (va >> level) & 0x1ff;
        let entry_addr = table + index * 8;
        let entry: u64 = match mem.read_obj(GuestAddress(entry_addr)) {
            Ok(e) => e,
            Err(_) => {
                let _ = write!(out, " {name}@{entry_addr:#x} outside guest memory");
                return out;
            }
        };
        let _ = write!(out, " {name}[{index}]={entry:#x}");
        if entry & 1 == 0 {
            out.push_str(" (not present)");
            return out;
        }
        // A 1 GiB or 2 MiB page ends the walk.
        if (level == 30 || level == 21) && entry & 0x80 != 0 {
            out.push_str(" (large page)");
            return out;
        }
        table = entry & ADDR;
    }
    out
}

/// Everything about one paused vCPU, read on its own thread, and where to walk its pages.
fn describe_vcpu(fd: &mut VcpuFd) -> (String, WalkStart) {
    let walk = match (fd.get_sregs(), fd.get_regs()) {
        // EFER.LMA: long mode (4-level paging here; the guests mayfly boots use no LA57).
        (Ok(sregs), Ok(regs)) if sregs.efer & (1 << 10) != 0 => {
            Some((sregs.cr3, regs.rip, sregs.cr2))
        }
        _ => None,
    };
    (describe_vcpu_text(fd), walk)
}

fn describe_vcpu_text(fd: &mut VcpuFd) -> String {
    let mut out = String::new();
    match fd.get_mp_state() {
        Ok(mp) => {
            let _ = writeln!(out, "    mp_state {}", mp.mp_state);
        }
        Err(e) => {
            let _ = writeln!(out, "    mp_state unavailable: {e}");
        }
    }
    if let Ok(lapic) = fd.get_lapic() {
        let _ = writeln!(out, "    {}", describe_lapic(&lapic));
    }
    let _ = writeln!(out, "    {}", describe_msrs(fd));
    if let Ok(events) = fd.get_vcpu_events() {
        let _ = writeln!(out, "    {}", describe_events(&events));
    }
    out.push_str(&crate::vcpu::dump_registers(fd));
    out
}

/// The whole dump. Pauses the VM for the time it takes if it runs.
pub fn state_dump(vm: &mut Machine) -> String {
    let mut out = String::from("mayfly: state dump\n");
    // 1. Before touching anything: where each vCPU thread is.
    for vcpu in &vm.vm.vcpus {
        let _ = writeln!(out, "  vcpu {}: {}", vcpu.index, vcpu.activity().describe());
    }
    for line in vm.devices.describe() {
        let _ = writeln!(out, "  {line}");
    }
    // 2. The devices and interrupt controllers.
    let serial =
        mayfly_devices::persist::Persist::save(&*mayfly_devices::bus::lock(&vm.devices.serial));
    let _ = writeln!(
        out,
        "  serial: IER {:#04x} IIR {:#04x} LSR {:#04x} MCR {:#04x} LCR {:#04x}, {} input bytes queued",
        serial.interrupt_enable,
        serial.interrupt_identification,
        serial.line_status,
        serial.modem_control,
        serial.line_control,
        serial.in_buffer.len()
    );
    let mut ioapic = kvm_bindings::kvm_irqchip {
        chip_id: kvm_bindings::KVM_IRQCHIP_IOAPIC,
        ..Default::default()
    };
    if vm.vm.fd.get_irqchip(&mut ioapic).is_ok() {
        // SAFETY: chip_id is the IOAPIC, so the union holds its state.
        let state = unsafe { ioapic.chip.ioapic };
        let _ = write!(out, "  ioapic: irr {:#x}", state.irr);
        for pin in 0..usize::from(crate::arch::layout::IOAPIC_PINS) {
            // SAFETY: redirection entries are plain 64-bit values.
            let entry = unsafe { state.redirtbl[pin].bits };
            // Masked and never programmed pins say nothing.
            if entry & (1 << 16) == 0 {
                let _ = write!(out, "; pin {pin} {entry:#x}");
            }
        }
        out.push('\n');
    }
    // 3. Each vCPU, paused.
    let was_paused = vm.paused();
    if !was_paused {
        if let Err(e) = vm.pause() {
            let _ = writeln!(out, "  (cannot pause to read the vCPUs: {e})");
            return out;
        }
    }
    for vcpu in &vm.vm.vcpus {
        let _ = writeln!(out, "  vcpu {}:", vcpu.index);
        match vcpu.run_job(describe_vcpu) {
            Some((text, walk)) => {
                out.push_str(&text);
                if let Some((cr3, rip, cr2)) = walk {
                    let _ = writeln!(out, "    rip {}", page_walk(&vm.ram.memory, cr3, rip));
                    if cr2 != 0 && cr2 != rip {
                        let _ = writeln!(out, "    cr2 {}", page_walk(&vm.ram.memory, cr3, cr2));
                    }
                }
            }
            None => out.push_str("    (gone)\n"),
        }
    }
    if !was_paused {
        vm.resume();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_walks_show_each_level_and_where_they_stop() {
        use vm_memory::{Bytes, GuestAddress};
        let mem =
            crate::memory::ram::GuestMemory::from_ranges(&[(GuestAddress(0), 4 << 20)]).unwrap();
        let put = |addr: u64, value: u64| mem.write_obj(value, GuestAddress(addr)).unwrap();
        put(0x1000, 0x2003);
        put(0x2000, 0x3003);
        put(0x3000, 0x4003);
        put(0x3008, 0x20_0083);
        put(0x4000 + 5 * 8, 0x5003);
        let walk = page_walk(&mem, 0x1000, 0x5123);
        assert!(walk.ends_with("pte[5]=0x5003"), "{walk}");
        assert!(page_walk(&mem, 0x1000, 0x20_0000).ends_with("(large page)"));
        assert!(page_walk(&mem, 0x1000, 0x6000).ends_with("pte[6]=0x0 (not present)"));
        assert!(page_walk(&mem, 0x40_0000, 0).contains("outside guest memory"));
    }

    #[test]
    fn lapic_vectors_are_listed_by_number() {
        let mut lapic = kvm_lapic_state::default();
        // IRR bit 0xec: word 7, bit 12.
        lapic.regs[0x200 + 7 * 0x10 + 1] = 0x10;
        // ISR bit 0x22: word 1, bit 2.
        lapic.regs[0x100 + 0x10] = 0x04;
        let text = describe_lapic(&lapic);
        assert!(text.contains("IRR 0xec"), "{text}");
        assert!(text.contains("ISR 0x22"), "{text}");
        assert!(text.contains("TMR -"), "{text}");
    }
}
