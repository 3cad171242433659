//! The VM state a snapshot holds, and the fingerprint of the host it depends on.

use kvm_bindings::{
    kvm_clock_data, kvm_cpuid_entry2, kvm_debugregs, kvm_irqchip, kvm_lapic_state, kvm_mp_state,
    kvm_msr_entry, kvm_pit_state2, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs,
};
use mayfly_devices::legacy::SerialConsoleState;
use serde::{Deserialize, Serialize};

/// Everything needed to bring a VM back, besides its memory.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VmState {
    pub vcpu_count: u8,
    pub mem_bytes: u64,
    /// The kernel command line the guest booted with (for `GET /vm` and humans).
    pub cmdline: String,
    /// Where each range of guest RAM sits in the memory file.
    pub memory: Vec<MemoryRange>,
    pub vcpus: Vec<VcpuState>,
    pub vm: KvmVmState,
    pub serial: SerialConsoleState,
    /// Guest memory offsets a restored guest touched first, in order (see lazy restore's
    /// prefetch). Empty when unknown.
    pub working_set: Vec<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryRange {
    pub guest_addr: u64,
    pub size: u64,
    pub file_offset: u64,
}

/// One vCPU, as KVM reports it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VcpuState {
    pub mp_state: kvm_mp_state,
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    /// The XSAVE area (`kvm_xsave`'s region, longer when KVM_CAP_XSAVE2 says so), in 32-bit words.
    pub xsave: Vec<u32>,
    /// XCR0 and friends; absent where KVM has no KVM_CAP_XCRS.
    pub xcrs: Option<kvm_xcrs>,
    pub debugregs: kvm_debugregs,
    pub lapic: kvm_lapic_state,
    pub tsc_khz: Option<u32>,
    pub cpuid: Vec<kvm_cpuid_entry2>,
    pub msrs: Vec<kvm_msr_entry>,
    pub vcpu_events: kvm_vcpu_events,
}

/// The VM-wide state KVM keeps: interrupt controllers, PIT and clock.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct KvmVmState {
    pub pic_master: kvm_irqchip,
    pub pic_slave: kvm_irqchip,
    pub ioapic: kvm_irqchip,
    pub pit: kvm_pit_state2,
    pub clock: kvm_clock_data,
    /// Host CLOCK_REALTIME when the clock was read, in ns: moves the guest's clock on by the
    /// time spent suspended where KVM cannot (no KVM_CLOCK_REALTIME).
    pub realtime_ns: u64,
}

/// What the saved state depends on in the host: the CPU model (the guest's CPUID and MSRs
/// describe it) and KVM's XSAVE layout.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostFingerprint {
    pub cpu_vendor: String,
    pub cpu_family: u32,
    pub cpu_model: u32,
    pub cpu_stepping: u32,
    /// Size of KVM's XSAVE area on the host, in bytes.
    pub xsave_bytes: u32,
    pub has_xcrs: bool,
}

impl HostFingerprint {
    /// The ways `self` (the snapshot's host) differs from `host` in what restore depends on;
    /// empty when restoring here is safe as far as the fingerprint can tell.
    pub fn differences(&self, host: &HostFingerprint) -> Vec<String> {
        let mut out = Vec::new();
        let cpu = |f: &HostFingerprint| {
            format!(
                "{} family {:#x} model {:#x} stepping {}",
                f.cpu_vendor, f.cpu_family, f.cpu_model, f.cpu_stepping
            )
        };
        if (
            &self.cpu_vendor,
            self.cpu_family,
            self.cpu_model,
            self.cpu_stepping,
        ) != (
            &host.cpu_vendor,
            host.cpu_family,
            host.cpu_model,
            host.cpu_stepping,
        ) {
            out.push(format!(
                "CPU: snapshot {}, this host {}",
                cpu(self),
                cpu(host)
            ));
        }
        if self.xsave_bytes != host.xsave_bytes {
            out.push(format!(
                "XSAVE area: snapshot {} bytes, this host {}",
                self.xsave_bytes, host.xsave_bytes
            ));
        }
        if self.has_xcrs && !host.has_xcrs {
            out.push("the snapshot has XCRs, this host's KVM cannot restore them".into());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprint_differences() {
        let a = HostFingerprint {
            cpu_vendor: "AuthenticAMD".into(),
            cpu_family: 0x17,
            cpu_model: 1,
            cpu_stepping: 2,
            xsave_bytes: 4096,
            has_xcrs: true,
        };
        assert!(a.differences(&a).is_empty());
        let mut b = a.clone();
        b.cpu_model = 0x31;
        b.has_xcrs = false;
        let d = a.differences(&b);
        assert_eq!(d.len(), 2, "{d:?}");
        assert!(
            d[0].contains("model 0x1") && d[0].contains("model 0x31"),
            "{d:?}"
        );
        // A snapshot without XCRs restores where KVM has them.
        assert!(b
            .differences(&HostFingerprint {
                cpu_model: 0x31,
                ..a.clone()
            })
            .is_empty());
    }
}
