//! Reading and writing the state KVM keeps for a VM and its vCPUs, for snapshots.
//!
//! Order matters, in both directions (see the comments): some GET ioctls change state as a
//! side effect, and some SET ioctls depend on state set before them.

use kvm_bindings::{
    kvm_cpuid_entry2, kvm_irqchip, kvm_msr_entry, kvm_xsave, CpuId, Msrs, Xsave,
    KVM_CLOCK_REALTIME, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE,
};
use kvm_ioctls::{Cap, Kvm, VcpuFd, VmFd};
use mayfly_snapshot::{HostFingerprint, KvmVmState, VcpuState};

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("KVM cannot {what}: {source}")]
    Kvm {
        what: String,
        source: kvm_ioctls::Error,
    },
    #[error("KVM refused to restore MSR {index:#x} (the {position}th of {count}): is this the host the snapshot was taken on?")]
    Msr {
        index: u32,
        position: usize,
        count: usize,
    },
    #[error("the snapshot's XSAVE area is {saved} bytes; this host's KVM uses {host}: the snapshot comes from a different CPU")]
    XsaveSize { saved: usize, host: usize },
    #[error("the snapshot has XCRs but KVM on this host cannot restore them (no KVM_CAP_XCRS)")]
    NoXcrs,
    #[error("the snapshot's guest uses CPU features this host's KVM does not offer: {0}")]
    CpuidNotSupported(String),
}

fn kvm_err(what: impl Into<String>) -> impl FnOnce(kvm_ioctls::Error) -> StateError {
    let what = what.into();
    move |source| StateError::Kvm { what, source }
}

const MSR_IA32_TSC_DEADLINE: u32 = 0x6e0;

/// MSRs one KVM_GET_MSRS / KVM_SET_MSRS takes at most: longer lists go in batches. One less
/// than kvm-bindings' `Msrs` cap (`KVM_MAX_MSR_ENTRIES`, 256): the kernel refuses a list of
/// `MAX_IO_MSRS` (256) or more with E2BIG (`nmsrs >= MAX_IO_MSRS` in msr_io), which the test
/// below found on the first full batch.
const MSR_BATCH: usize = kvm_bindings::KVM_MAX_MSR_ENTRIES - 1;
/// MSRs a saved vCPU may list (KVM saves a few dozen; a state file listing more is not one
/// mayfly wrote).
pub const MAX_SAVED_MSRS: usize = 1024;

/// What this host's KVM can save and restore, probed once per VM.
#[derive(Clone, Debug)]
pub struct KvmCaps {
    /// Bytes of the XSAVE area (`KVM_CAP_XSAVE2`, or `kvm_xsave`'s 4 KiB).
    pub xsave_bytes: usize,
    pub has_xcrs: bool,
    pub has_tsc_khz: bool,
    pub has_kvmclock_ctrl: bool,
    /// `KVM_CLOCK_*` flags KVM_SET_CLOCK honours.
    pub clock_flags: u32,
    /// MSRs KVM can save (`KVM_GET_MSR_INDEX_LIST`), with the TSC deadline after the TSC.
    pub msr_index: Vec<u32>,
}

impl KvmCaps {
    pub fn probe(kvm: &Kvm) -> Result<Self, StateError> {
        let kvm_xsave_bytes = std::mem::size_of::<kvm_xsave>();
        let xsave2 = usize::try_from(kvm.check_extension_int(Cap::Xsave2)).unwrap_or(0);
        let mut msr_index: Vec<u32> = kvm
            .get_msr_index_list()
            .map_err(kvm_err("list the MSRs it saves"))?
            .as_slice()
            .to_vec();
        // KVM applies the TSC deadline relative to the TSC: restore it after.
        msr_index.sort_by_key(|&i| i == MSR_IA32_TSC_DEADLINE);
        Ok(Self {
            xsave_bytes: xsave2.max(kvm_xsave_bytes),
            has_xcrs: kvm.check_extension(Cap::Xcrs),
            has_tsc_khz: kvm.check_extension(Cap::GetTscKhz),
            has_kvmclock_ctrl: kvm.check_extension(Cap::KvmclockCtrl),
            clock_flags: u32::try_from(kvm.check_extension_int(Cap::AdjustClock)).unwrap_or(0),
            msr_index,
        })
    }
}

/// The host's fingerprint: CPU identity from CPUID, and KVM's XSAVE layout.
pub fn host_fingerprint(caps: &KvmCaps) -> HostFingerprint {
    let vendor = std::arch::x86_64::__cpuid(0);
    let mut vendor_bytes = Vec::with_capacity(12);
    for reg in [vendor.ebx, vendor.edx, vendor.ecx] {
        vendor_bytes.extend_from_slice(&reg.to_le_bytes());
    }
    let signature = std::arch::x86_64::__cpuid(1).eax;
    let base_family = (signature >> 8) & 0xf;
    let family = if base_family == 0xf {
        base_family + ((signature >> 20) & 0xff)
    } else {
        base_family
    };
    let model = if base_family == 0x6 || base_family == 0xf {
        ((signature >> 4) & 0xf) | (((signature >> 16) & 0xf) << 4)
    } else {
        (signature >> 4) & 0xf
    };
    HostFingerprint {
        cpu_vendor: String::from_utf8_lossy(&vendor_bytes).into_owned(),
        cpu_family: family,
        cpu_model: model,
        cpu_stepping: signature & 0xf,
        xsave_bytes: u32::try_from(caps.xsave_bytes).unwrap_or(u32::MAX),
        has_xcrs: caps.has_xcrs,
    }
}

/// Read the MSRs in `index` that this vCPU has. KVM stops at the first MSR it cannot read;
/// those are dropped (they depend on CPUID features the guest does not have).
fn get_msrs(vcpu: &VcpuFd, index: &[u32]) -> Result<Vec<kvm_msr_entry>, StateError> {
    let mut saved = Vec::with_capacity(index.len());
    let mut rest = index;
    while !rest.is_empty() {
        let entries: Vec<kvm_msr_entry> = rest[..rest.len().min(MSR_BATCH)]
            .iter()
            .map(|&index| kvm_msr_entry {
                index,
                ..Default::default()
            })
            .collect();
        let mut msrs = Msrs::from_entries(&entries).map_err(|_| StateError::Kvm {
            what: "hold that many MSRs".into(),
            source: kvm_ioctls::Error::new(libc::E2BIG),
        })?;
        let read = vcpu
            .get_msrs(&mut msrs)
            .map_err(kvm_err("read the vCPU's MSRs"))?;
        saved.extend_from_slice(&msrs.as_slice()[..read]);
        // A whole batch read: go on with the next; otherwise skip the one that failed.
        let skip = if read == entries.len() {
            read
        } else {
            read + 1
        };
        rest = &rest[skip.min(rest.len())..];
    }
    Ok(saved)
}

/// Save a paused vCPU whose CPUID mayfly set to `cpuid` (kept rather than read back: some
/// nested KVMs report the host's CPUID instead). Order: MP state first (reading it lets KVM
/// accept pending INIT/SIPI events, which changes the rest), vCPU events last (other GETs can
/// change what is pending).
pub fn save_vcpu(
    vcpu: &VcpuFd,
    caps: &KvmCaps,
    cpuid: Vec<kvm_cpuid_entry2>,
) -> Result<VcpuState, StateError> {
    let mp_state = vcpu.get_mp_state().map_err(kvm_err("read the MP state"))?;
    let regs = vcpu.get_regs().map_err(kvm_err("read the registers"))?;
    let sregs = vcpu
        .get_sregs()
        .map_err(kvm_err("read the segment registers"))?;
    let xsave = if caps.xsave_bytes > std::mem::size_of::<kvm_xsave>() {
        let extra_words = (caps.xsave_bytes - std::mem::size_of::<kvm_xsave>()).div_ceil(4);
        let mut area = Xsave::new(extra_words).map_err(|_| StateError::Kvm {
            what: "allocate the XSAVE area".into(),
            source: kvm_ioctls::Error::new(libc::ENOMEM),
        })?;
        // SAFETY: `area` was sized from KVM_CAP_XSAVE2, as KVM_GET_XSAVE2 requires.
        unsafe { vcpu.get_xsave2(&mut area) }.map_err(kvm_err("read the XSAVE area"))?;
        let fam = area.as_fam_struct_ref();
        let mut words = fam.xsave.region.to_vec();
        words.extend_from_slice(area.as_slice());
        words
    } else {
        vcpu.get_xsave()
            .map_err(kvm_err("read the XSAVE area"))?
            .region
            .to_vec()
    };
    let xcrs = if caps.has_xcrs {
        Some(vcpu.get_xcrs().map_err(kvm_err("read the XCRs"))?)
    } else {
        None
    };
    let debugregs = vcpu
        .get_debug_regs()
        .map_err(kvm_err("read the debug registers"))?;
    let lapic = vcpu.get_lapic().map_err(kvm_err("read the local APIC"))?;
    let tsc_khz = if caps.has_tsc_khz {
        vcpu.get_tsc_khz().ok()
    } else {
        None
    };
    let msrs = get_msrs(vcpu, &caps.msr_index)?;
    let vcpu_events = vcpu
        .get_vcpu_events()
        .map_err(kvm_err("read the vCPU events"))?;
    Ok(VcpuState {
        mp_state,
        regs,
        sregs,
        xsave,
        xcrs,
        debugregs,
        lapic,
        tsc_khz,
        cpuid,
        msrs,
        vcpu_events,
    })
}

/// Check that the host's KVM offers every CPU feature the saved guest was given. Left out:
/// bits KVM computes from the guest's own state (OSXSAVE, OSPKE) and bits that describe the
/// VM rather than the CPU, which mayfly sets itself (hypervisor, HTT, CmpLegacy).
pub fn check_cpuid(saved: &[kvm_cpuid_entry2], supported: &CpuId) -> Result<(), StateError> {
    const CHECKED: [(u32, u32, &str, u32); 6] = [
        (0x1, 0, "ecx", !(1 << 27 | 1 << 31)), // not OSXSAVE, hypervisor
        (0x1, 0, "edx", !(1 << 28)),           // not HTT
        (0x7, 0, "ebx", u32::MAX),
        (0x7, 0, "ecx", !(1 << 4)),         // not OSPKE
        (0x8000_0001, 0, "ecx", !(1 << 1)), // not CmpLegacy
        (0x8000_0001, 0, "edx", u32::MAX),
    ];
    let find = |entries: &[kvm_cpuid_entry2], leaf, sub| {
        entries
            .iter()
            .find(|e| e.function == leaf && (e.index == sub || leaf != 0x7))
            .copied()
    };
    let reg = |e: &kvm_cpuid_entry2, name: &str| match name {
        "ecx" => e.ecx,
        "edx" => e.edx,
        _ => e.ebx,
    };
    let mut missing = Vec::new();
    for (leaf, sub, name, mask) in CHECKED {
        let Some(saved) = find(saved, leaf, sub) else {
            continue;
        };
        let host = find(supported.as_slice(), leaf, sub)
            .map(|e| reg(&e, name))
            .unwrap_or(0);
        let lacking = reg(&saved, name) & mask & !host;
        if lacking != 0 {
            missing.push(format!("leaf {leaf:#x} {name} bits {lacking:#010x}"));
        }
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(StateError::CpuidNotSupported(missing.join(", ")))
    }
}

/// Restore a freshly created vCPU. CPUID first (it decides which MSRs and XSAVE features
/// exist), MSRs before the LAPIC (the APIC base) ... and vCPU events last, as they describe
/// what is pending on top of everything else.
///
/// How far apart a snapshot's TSC frequency and this host's may be before the guest's is
/// scaled: two hosts of one model calibrate their TSCs a few kHz apart, and a guest does not
/// notice that, but a host without TSC scaling would refuse the snapshot if asked to scale.
/// (Firecracker uses the same tolerance.)
pub const TSC_TOLERANCE_PPM: u32 = 250;

/// Whether a guest whose TSC ran at `saved_khz` needs it scaled on a host whose runs at
/// `host_khz`.
pub fn tsc_needs_scaling(saved_khz: u32, host_khz: u32) -> bool {
    let apart = u64::from(saved_khz.abs_diff(host_khz));
    apart * 1_000_000 > u64::from(saved_khz) * u64::from(TSC_TOLERANCE_PPM)
}

pub fn restore_vcpu(vcpu: &VcpuFd, state: &VcpuState, caps: &KvmCaps) -> Result<(), StateError> {
    let cpuid = CpuId::from_entries(&state.cpuid).map_err(|_| StateError::Kvm {
        what: "take that many CPUID entries".into(),
        source: kvm_ioctls::Error::new(libc::E2BIG),
    })?;
    vcpu.set_cpuid2(&cpuid)
        .map_err(kvm_err("set the vCPU's CPUID"))?;
    if let Some(khz) = state.tsc_khz {
        let host = vcpu.get_tsc_khz().ok();
        if caps.has_tsc_khz && host.is_some_and(|host| tsc_needs_scaling(khz, host)) {
            vcpu.set_tsc_khz(khz).map_err(kvm_err(format!(
                "run the guest's TSC at {khz} kHz (this host's runs at {} kHz, more than \
                 {TSC_TOLERANCE_PPM} ppm away, and KVM cannot scale it here)",
                host.unwrap_or(0)
            )))?;
        }
    }
    vcpu.set_mp_state(state.mp_state)
        .map_err(kvm_err("set the MP state"))?;
    vcpu.set_regs(&state.regs)
        .map_err(kvm_err("set the registers"))?;
    vcpu.set_sregs(&state.sregs)
        .map_err(kvm_err("set the segment registers"))?;

    let saved_bytes = state.xsave.len() * 4;
    let host_bytes = caps.xsave_bytes.max(std::mem::size_of::<kvm_xsave>());
    if saved_bytes > host_bytes || saved_bytes < std::mem::size_of::<kvm_xsave>() {
        return Err(StateError::XsaveSize {
            saved: saved_bytes,
            host: host_bytes,
        });
    }
    if saved_bytes > std::mem::size_of::<kvm_xsave>() {
        let extra = &state.xsave[1024..];
        let mut area = Xsave::new(extra.len()).map_err(|_| StateError::Kvm {
            what: "allocate the XSAVE area".into(),
            source: kvm_ioctls::Error::new(libc::ENOMEM),
        })?;
        // SAFETY: the FAM was allocated with exactly `extra.len()` words.
        unsafe {
            area.as_mut_fam_struct()
                .xsave
                .region
                .copy_from_slice(&state.xsave[..1024]);
            area.as_mut_slice().copy_from_slice(extra);
            vcpu.set_xsave2(&area)
        }
        .map_err(kvm_err("set the XSAVE area"))?;
    } else {
        let mut xsave = kvm_xsave::default();
        xsave.region.copy_from_slice(&state.xsave[..1024]);
        // SAFETY: a plain kvm_xsave, which is what KVM_SET_XSAVE reads without XSAVE2.
        unsafe { vcpu.set_xsave(&xsave) }.map_err(kvm_err("set the XSAVE area"))?;
    }
    if let Some(xcrs) = &state.xcrs {
        if !caps.has_xcrs {
            return Err(StateError::NoXcrs);
        }
        vcpu.set_xcrs(xcrs).map_err(kvm_err("set the XCRs"))?;
    }
    vcpu.set_debug_regs(&state.debugregs)
        .map_err(kvm_err("set the debug registers"))?;
    vcpu.set_lapic(&state.lapic)
        .map_err(kvm_err("set the local APIC"))?;

    set_msrs(vcpu, &state.msrs)?;
    vcpu.set_vcpu_events(&state.vcpu_events)
        .map_err(kvm_err("set the vCPU events"))?;
    Ok(())
}

/// Write `msrs` into the vCPU, in batches KVM takes (at most `KVM_MAX_MSR_ENTRIES` each), the
/// TSC deadline last (it is relative to the TSC, written before it). Every one must be taken.
fn set_msrs(vcpu: &VcpuFd, msrs: &[kvm_msr_entry]) -> Result<(), StateError> {
    let mut msrs_in_order = msrs.to_vec();
    msrs_in_order.sort_by_key(|m| m.index == MSR_IA32_TSC_DEADLINE);
    for (batch_index, batch) in msrs_in_order.chunks(MSR_BATCH).enumerate() {
        let msrs = Msrs::from_entries(batch).map_err(|_| StateError::Kvm {
            what: "take that many MSRs".into(),
            source: kvm_ioctls::Error::new(libc::E2BIG),
        })?;
        let written = vcpu.set_msrs(&msrs).map_err(kvm_err("set the MSRs"))?;
        if written < batch.len() {
            return Err(StateError::Msr {
                index: batch[written].index,
                position: batch_index * MSR_BATCH + written + 1,
                count: msrs_in_order.len(),
            });
        }
    }
    Ok(())
}

fn irqchip(id: u32) -> kvm_irqchip {
    kvm_irqchip {
        chip_id: id,
        ..Default::default()
    }
}

/// Save the VM-wide state; the vCPUs must be paused.
pub fn save_vm(vm: &VmFd) -> Result<KvmVmState, StateError> {
    let pit = vm.get_pit2().map_err(kvm_err("read the PIT"))?;
    let clock = vm.get_clock().map_err(kvm_err("read the KVM clock"))?;
    let realtime_ns = realtime_ns();
    let mut chips = [
        irqchip(KVM_IRQCHIP_PIC_MASTER),
        irqchip(KVM_IRQCHIP_PIC_SLAVE),
        irqchip(KVM_IRQCHIP_IOAPIC),
    ];
    for chip in &mut chips {
        vm.get_irqchip(chip)
            .map_err(kvm_err("read the interrupt controllers"))?;
    }
    let [pic_master, pic_slave, ioapic] = chips;
    Ok(KvmVmState {
        pic_master,
        pic_slave,
        ioapic,
        pit,
        clock,
        realtime_ns,
    })
}

/// How the guest's clock was brought forward on restore.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClockCatchUp {
    /// KVM moved the clock on by the real time elapsed since the snapshot (KVM_CLOCK_REALTIME).
    Kvm,
    /// mayfly added the elapsed real time itself (hosts without KVM_CLOCK_REALTIME).
    Mayfly,
}

/// Restore the VM-wide state into a VM with its irqchip and PIT created, before any vCPU runs.
/// The guest's clock moves on by the time the snapshot spent on disk, so its wall clock is right.
pub fn restore_vm(
    vm: &VmFd,
    state: &KvmVmState,
    caps: &KvmCaps,
) -> Result<ClockCatchUp, StateError> {
    vm.set_pit2(&state.pit).map_err(kvm_err("set the PIT"))?;
    let mut clock = state.clock;
    let catch_up =
        if clock.flags & KVM_CLOCK_REALTIME != 0 && caps.clock_flags & KVM_CLOCK_REALTIME != 0 {
            // KVM compares `realtime` with the host's real time now and adds the difference.
            clock.flags = KVM_CLOCK_REALTIME;
            ClockCatchUp::Kvm
        } else {
            clock.clock = clock
                .clock
                .saturating_add(realtime_ns().saturating_sub(state.realtime_ns));
            clock.flags = 0;
            ClockCatchUp::Mayfly
        };
    vm.set_clock(&clock).map_err(kvm_err("set the KVM clock"))?;
    for chip in [&state.pic_master, &state.pic_slave, &state.ioapic] {
        vm.set_irqchip(chip)
            .map_err(kvm_err("set the interrupt controllers"))?;
    }
    Ok(catch_up)
}

/// CLOCK_REALTIME in nanoseconds.
pub fn realtime_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(function: u32, ecx: u32, edx: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            ecx,
            edx,
            ..Default::default()
        }
    }

    /// More MSRs than one KVM_GET_MSRS / KVM_SET_MSRS takes (KVM_MAX_MSR_ENTRIES) are read
    /// and written in batches, every one of them, on this machine's KVM.
    #[test]
    fn msr_lists_longer_than_one_batch_go_in_batches() {
        let kvm = kvm_ioctls::Kvm::new().expect("/dev/kvm opens");
        let vm = kvm.create_vm().expect("a VM");
        let vcpu = vm.create_vcpu(0).expect("a vCPU");
        // SYSENTER_CS/ESP/EIP, STAR, LSTAR, CSTAR, SFMASK, KERNEL_GS_BASE: plain registers
        // every x86-64 vCPU has, repeated past three batches.
        let plain = [
            0x174,
            0x175,
            0x176,
            0xc000_0081,
            0xc000_0082,
            0xc000_0083,
            0xc000_0084,
            0xc000_0102,
        ];
        let count = 3 * MSR_BATCH + 5;
        let index: Vec<u32> = plain.iter().copied().cycle().take(count).collect();
        let read = get_msrs(&vcpu, &index).expect("the MSRs read");
        assert_eq!(read.len(), count);
        // Written back with values of their own (the last write of each index wins): every
        // batch is taken, and what the last batch wrote is what the vCPU holds.
        let written: Vec<kvm_msr_entry> = index
            .iter()
            .enumerate()
            .map(|(i, &index)| kvm_msr_entry {
                index,
                data: 0x1000 + i as u64,
                ..Default::default()
            })
            .collect();
        set_msrs(&vcpu, &written).expect("every batch is taken");
        let now = get_msrs(&vcpu, &plain).expect("the MSRs read back");
        for entry in now {
            let last = written
                .iter()
                .rev()
                .find(|w| w.index == entry.index)
                .unwrap();
            assert_eq!(entry.data, last.data, "MSR {:#x}", entry.index);
        }
    }

    #[test]
    fn cpuid_subset_check() {
        let host = CpuId::from_entries(&[entry(0x1, 0b0110, 0xff)]).unwrap();
        assert!(check_cpuid(&[entry(0x1, 0b0100, 0x0f)], &host).is_ok());
        // OSXSAVE is the guest's own doing: never a mismatch.
        assert!(check_cpuid(&[entry(0x1, 1 << 27, 0)], &host).is_ok());
        let err = check_cpuid(&[entry(0x1, 0b1001, 0x100)], &host).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("leaf 0x1 ecx bits 0x00000009"), "{msg}");
        assert!(msg.contains("leaf 0x1 edx bits 0x00000100"), "{msg}");
    }

    #[test]
    fn fingerprint_reads_this_cpu() {
        let caps = KvmCaps {
            xsave_bytes: 4096,
            has_xcrs: true,
            has_tsc_khz: true,
            has_kvmclock_ctrl: true,
            clock_flags: 0,
            msr_index: vec![],
        };
        let f = host_fingerprint(&caps);
        // What the kernel read from the same CPUID leaves.
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap();
        let field = |name: &str| {
            cpuinfo
                .lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split(':').nth(1))
                .map(|v| v.trim().to_string())
                .unwrap()
        };
        assert_eq!(f.cpu_vendor, field("vendor_id"));
        assert_eq!(f.cpu_family.to_string(), field("cpu family"));
    }

    #[test]
    fn a_tsc_a_few_khz_off_is_not_scaled_and_one_further_off_is() {
        // 2.4 GHz: 250 ppm is 600 kHz.
        assert!(!tsc_needs_scaling(2_400_000, 2_400_000));
        assert!(!tsc_needs_scaling(2_400_000, 2_399_997));
        assert!(!tsc_needs_scaling(2_400_000, 2_400_600));
        assert!(tsc_needs_scaling(2_400_000, 2_400_601));
        assert!(tsc_needs_scaling(2_400_000, 3_000_000));
        assert!(tsc_needs_scaling(2_400_000, 1_200_000));
    }
}
