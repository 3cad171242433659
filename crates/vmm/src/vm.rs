//! The KVM virtual machine: its fds, memory slots, in-kernel interrupt controllers and timer,
//! and its vCPU threads. This module knows KVM only: what the VM is for (devices, memory
//! modes, requests) is the machine's and the controller's business.

use std::path::PathBuf;
use std::sync::Arc;

use kvm_bindings::{kvm_pit_config, kvm_userspace_memory_region, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{Cap, Kvm, VmFd};
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use crate::arch::kvm_state::KvmCaps;
use crate::arch::layout::{KVM_IDENTITY_MAP_ADDR, KVM_TSS_ADDR};
use crate::memory::ram::GuestRam;
use crate::vcpu::{VcpuContext, VcpuHandle};

/// The KVM device; `MAYFLY_KVM_DEVICE` overrides it (for tests and unusual hosts).
pub fn kvm_device_path() -> PathBuf {
    crate::settings::get().kvm_device.clone()
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
    #[error("vCPU {0} is gone (it stopped the VM)")]
    VcpuGone(u8),
    #[error("KVM refused to {what}: {source}")]
    Kvm {
        what: &'static str,
        source: kvm_ioctls::Error,
    },
}

pub fn kvm_err(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmError {
    move |source| VmError::Kvm { what, source }
}

/// Open the KVM device with errors that say what to do, and check it has what mayfly needs.
pub fn open_kvm() -> Result<Kvm, VmError> {
    let kvm = open_kvm_device()?;
    check_kvm(&kvm)?;
    Ok(kvm)
}

/// Open the KVM device without asking it anything yet (see [`check_kvm`]): a restore makes
/// its VM on one thread while another checks KVM.
pub fn open_kvm_device() -> Result<Kvm, VmError> {
    let path = kvm_device_path();
    let shown = path.display().to_string();
    let cpath = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| {
        VmError::NoKvm {
            path: shown.clone(),
        }
    })?;
    Kvm::new_with_path(cpath).map_err(|source| match source.errno() {
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
    })
}

/// Check that an open KVM has what mayfly needs.
pub fn check_kvm(kvm: &Kvm) -> Result<(), VmError> {
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
    Ok(())
}

/// Create the VM: memory slots first (adding the first slot after the irqchip costs
/// milliseconds on some hosts), then the in-kernel PIC/IOAPIC/LAPIC and PIT. Measured on this
/// project's kvm_pvm host with a VMM standing by (medians of 15): a 128 MiB slot added after
/// the irqchip and PIT, 4.6 ms; the slot, irqchip and PIT in this order, 0.34 ms in all. So
/// a VMM standing by makes neither the irqchip nor a vCPU (which needs the irqchip) ahead.
pub fn create_vm(kvm: &Kvm, ram: &GuestRam) -> Result<VmFd, VmError> {
    finish_vm(create_bare_vm(kvm)?, ram)
}

/// The part of [`create_vm`] that needs no guest memory: the VM itself and the two addresses
/// KVM needs before any vCPU (a VMM standing by makes it before it knows its snapshot).
pub fn create_bare_vm(kvm: &Kvm) -> Result<VmFd, VmError> {
    let vm = kvm.create_vm().map_err(kvm_err("create a VM"))?;
    vm.set_tss_address(KVM_TSS_ADDR)
        .map_err(kvm_err("set the TSS address"))?;
    vm.set_identity_map_address(KVM_IDENTITY_MAP_ADDR)
        .map_err(kvm_err("set the identity map address"))?;
    Ok(vm)
}

/// The rest of [`create_vm`], on a VM from [`create_bare_vm`]: guest memory, then the
/// interrupt controllers and the PIT.
pub fn finish_vm(vm: VmFd, ram: &GuestRam) -> Result<VmFd, VmError> {
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
            slot: u32::try_from(slot).expect("a memory slot per RAM range"),
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

/// The KVM VM and its vCPU threads. Fields drop in order: the vCPU threads stop first.
pub struct Vm {
    pub vcpus: Vec<VcpuHandle>,
    pub fd: VmFd,
    pub kvm: Kvm,
    pub caps: KvmCaps,
    /// Each vCPU's CPUID, as mayfly set it.
    pub cpuids: Vec<Vec<kvm_bindings::kvm_cpuid_entry2>>,
    pub paused: bool,
}

impl Vm {
    pub fn new(
        kvm: Kvm,
        fd: VmFd,
        caps: KvmCaps,
        cpuids: Vec<Vec<kvm_bindings::kvm_cpuid_entry2>>,
    ) -> Self {
        Self {
            vcpus: Vec::new(),
            fd,
            kvm,
            caps,
            cpuids,
            paused: false,
        }
    }

    /// Stop every vCPU outside KVM_RUN. Also tells each guest its clock was stopped, so a long
    /// pause does not set off its soft-lockup watchdog once it runs again.
    pub fn pause(&mut self) -> Result<(), VmError> {
        for vcpu in &self.vcpus {
            vcpu.request_pause();
        }
        for vcpu in &self.vcpus {
            if !vcpu.wait_paused() {
                return Err(VmError::VcpuGone(vcpu.index));
            }
        }
        if self.caps.has_kvmclock_ctrl {
            for vcpu in &self.vcpus {
                // EINVAL only means the guest does not use kvmclock.
                vcpu.run_job(|fd| {
                    let _ = fd.kvmclock_ctrl();
                });
            }
        }
        self.paused = true;
        Ok(())
    }

    pub fn resume(&mut self) {
        for vcpu in &self.vcpus {
            vcpu.resume();
        }
        self.paused = false;
    }

    /// Start one thread per vCPU, running or paused.
    pub fn start_vcpus(
        &mut self,
        fds: Vec<kvm_ioctls::VcpuFd>,
        context: VcpuContext,
        paused: bool,
    ) -> std::io::Result<()> {
        let threads = prepare_vcpu_threads(fds.len(), paused)?;
        self.start_prepared_vcpus(threads, fds, context, paused);
        Ok(())
    }

    /// Give threads made by [`prepare_vcpu_threads`] (as many as `fds`, with the same
    /// `paused`) their vCPUs.
    pub fn start_prepared_vcpus(
        &mut self,
        threads: Vec<VcpuHandle>,
        fds: Vec<kvm_ioctls::VcpuFd>,
        context: VcpuContext,
        paused: bool,
    ) {
        let context = Arc::new(context);
        for (handle, fd) in threads.into_iter().zip(fds) {
            handle.start(fd, context.clone());
            self.vcpus.push(handle);
        }
        self.paused = paused;
    }

    /// Ask every vCPU thread to end and wait for them, but not forever: a vCPU blocked on
    /// guest memory that can no longer be served may never come out (the process is about to
    /// end).
    pub fn stop_vcpus(&mut self) {
        for vcpu in &self.vcpus {
            vcpu.request_exit();
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        for vcpu in &mut self.vcpus {
            vcpu.join_until(deadline);
        }
    }
}

/// Start `count` vCPU threads ahead of their vCPUs (see [`VcpuHandle::prepare`]), to run at
/// once or held paused.
pub fn prepare_vcpu_threads(count: usize, paused: bool) -> std::io::Result<Vec<VcpuHandle>> {
    let target = if paused {
        crate::vcpu::Target::Pause
    } else {
        crate::vcpu::Target::Run
    };
    (0..count)
        .map(|index| {
            let index = u8::try_from(index).map_err(|_| std::io::ErrorKind::InvalidInput)?;
            VcpuHandle::prepare(index, target)
        })
        .collect()
}
