//! The KVM virtual machine: its fds, memory slots, in-kernel interrupt controllers and timer,
//! and the loop that waits for the VM to end.

use std::path::PathBuf;
use std::sync::mpsc::{Receiver, Sender};

use kvm_bindings::{kvm_pit_config, kvm_userspace_memory_region, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{Cap, Kvm, VmFd};
use mayfly_devices::PowerRequest;
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use crate::arch::layout::{KVM_IDENTITY_MAP_ADDR, KVM_TSS_ADDR};
use crate::memory::GuestRam;
use crate::vcpu::VcpuHandle;

/// The KVM device; `MAYFLY_KVM_DEVICE` overrides it (for tests and unusual hosts).
pub fn kvm_device_path() -> PathBuf {
    std::env::var_os("MAYFLY_KVM_DEVICE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/dev/kvm"))
}

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("{path} does not exist: this host has no KVM (load kvm_intel or kvm_amd, or enable virtualization in the firmware or the hypervisor)")]
    NoKvm { path: String },
    #[error("permission denied opening {path}: run as root or add your user to the group that owns it (usually 'kvm')")]
    KvmPermission { path: String },
    #[error("cannot open {path}: {source}")]
    KvmOpen {
        path: String,
        source: kvm_ioctls::Error,
    },
    #[error("KVM on this host lacks {0}, which mayfly needs")]
    MissingCapability(&'static str),
    #[error("KVM refused to {what}: {source}")]
    Kvm {
        what: &'static str,
        source: kvm_ioctls::Error,
    },
}

pub fn kvm_err(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmError {
    move |source| VmError::Kvm { what, source }
}

/// Open the KVM device with errors that say what to do.
pub fn open_kvm() -> Result<Kvm, VmError> {
    let path = kvm_device_path();
    let shown = path.display().to_string();
    let cpath = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| {
        VmError::NoKvm {
            path: shown.clone(),
        }
    })?;
    let kvm = Kvm::new_with_path(cpath).map_err(|source| match source.errno() {
        libc::ENOENT => VmError::NoKvm {
            path: shown.clone(),
        },
        libc::EACCES | libc::EPERM => VmError::KvmPermission {
            path: shown.clone(),
        },
        _ => VmError::KvmOpen {
            path: shown.clone(),
            source,
        },
    })?;
    for (cap, name) in [
        (
            Cap::Irqchip,
            "an in-kernel interrupt controller (KVM_CAP_IRQCHIP)",
        ),
        (Cap::UserMemory, "user memory slots (KVM_CAP_USER_MEMORY)"),
        (Cap::SetTssAddr, "KVM_CAP_SET_TSS_ADDR"),
        (Cap::Pit2, "an in-kernel PIT (KVM_CAP_PIT2)"),
        (Cap::ExtCpuid, "KVM_CAP_EXT_CPUID"),
        (Cap::Irqfd, "irqfd (KVM_CAP_IRQFD)"),
        (Cap::ImmediateExit, "KVM_CAP_IMMEDIATE_EXIT"),
    ] {
        if !kvm.check_extension(cap) {
            return Err(VmError::MissingCapability(name));
        }
    }
    Ok(kvm)
}

/// Create the VM: memory slots first (adding the first slot after the irqchip costs
/// milliseconds on some hosts), then the in-kernel PIC/IOAPIC/LAPIC and PIT.
pub fn create_vm(kvm: &Kvm, ram: &GuestRam) -> Result<VmFd, VmError> {
    let vm = kvm.create_vm().map_err(kvm_err("create a VM"))?;
    vm.set_tss_address(KVM_TSS_ADDR)
        .map_err(kvm_err("set the TSS address"))?;
    vm.set_identity_map_address(KVM_IDENTITY_MAP_ADDR)
        .map_err(kvm_err("set the identity map address"))?;
    register_memory(&vm, ram)?;
    vm.create_irq_chip()
        .map_err(kvm_err("create the in-kernel interrupt controllers"))?;
    let pit = kvm_pit_config {
        flags: KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    };
    vm.create_pit2(pit)
        .map_err(kvm_err("create the in-kernel PIT"))?;
    Ok(vm)
}

/// Give KVM every region of guest RAM as a memory slot.
pub fn register_memory(vm: &VmFd, ram: &GuestRam) -> Result<(), VmError> {
    for (slot, region) in ram.memory.iter().enumerate() {
        let host_addr = ram
            .memory
            .get_host_address(region.start_addr())
            .map_err(|_| VmError::MissingCapability("a host mapping of guest memory"))?;
        let mem_region = kvm_userspace_memory_region {
            slot: slot as u32,
            flags: 0,
            guest_phys_addr: region.start_addr().0,
            memory_size: region.len(),
            userspace_addr: host_addr as u64,
        };
        // SAFETY: the mapping behind `host_addr` is `region.len()` bytes long and lives in
        // `ram`, which the VM keeps for as long as the VM fd exists.
        unsafe { vm.set_user_memory_region(mem_region) }
            .map_err(kvm_err("add a guest memory slot"))?;
    }
    Ok(())
}

/// Something that ends (or will end) the VM, reported to the thread that waits on it.
#[derive(Debug)]
pub enum VmEvent {
    Power(PowerRequest),
    VcpuFailed {
        index: u8,
        reason: String,
        registers: String,
    },
    Signal(i32),
}

/// How a VM ended, and the process exit status that says so.
#[derive(Debug, PartialEq, Eq)]
pub enum VmExit {
    /// The guest powered off: status 0.
    PowerOff,
    /// The guest rebooted (mayfly does not restart it): status 133, as systemd-nspawn does.
    Reset,
    /// A signal asked the VMM to stop: 128 + the signal.
    Signal(i32),
    /// A vCPU hit something fatal: status 1.
    Crashed {
        index: u8,
        reason: String,
        registers: String,
    },
}

impl VmExit {
    pub const RESET_STATUS: u8 = 133;

    pub fn status(&self) -> u8 {
        match self {
            VmExit::PowerOff => 0,
            VmExit::Reset => Self::RESET_STATUS,
            VmExit::Signal(sig) => 128u8.saturating_add(*sig as u8),
            VmExit::Crashed { .. } => 1,
        }
    }
}

impl From<VmEvent> for VmExit {
    fn from(event: VmEvent) -> Self {
        match event {
            VmEvent::Power(PowerRequest::PowerOff) => VmExit::PowerOff,
            VmEvent::Power(PowerRequest::Reset) => VmExit::Reset,
            VmEvent::Signal(sig) => VmExit::Signal(sig),
            VmEvent::VcpuFailed {
                index,
                reason,
                registers,
            } => VmExit::Crashed {
                index,
                reason,
                registers,
            },
        }
    }
}

/// A running VM: what must stay alive while it runs, and its event channel.
pub struct Vm {
    pub kvm: Kvm,
    pub fd: VmFd,
    pub ram: GuestRam,
    pub vcpus: Vec<VcpuHandle>,
    pub devices: crate::devices::Devices,
    pub events: Receiver<VmEvent>,
    pub event_sender: Sender<VmEvent>,
}

impl Vm {
    /// Block until something ends the VM, then stop every vCPU.
    pub fn wait_for_exit(mut self) -> VmExit {
        let exit = match self.events.recv() {
            Ok(event) => VmExit::from(event),
            // Every sender gone: cannot happen while `self` holds one.
            Err(_) => VmExit::PowerOff,
        };
        self.stop_vcpus();
        exit
    }

    pub fn stop_vcpus(&mut self) {
        for vcpu in &self.vcpus {
            vcpu.request_exit();
        }
        for vcpu in &mut self.vcpus {
            vcpu.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_statuses() {
        assert_eq!(VmExit::PowerOff.status(), 0);
        assert_eq!(VmExit::Reset.status(), 133);
        assert_eq!(VmExit::Signal(libc::SIGTERM).status(), 143);
        assert_eq!(
            VmExit::from(VmEvent::Power(PowerRequest::Reset)),
            VmExit::Reset
        );
    }
}
