//! The KVM virtual machine: its fds, memory slots, in-kernel interrupt controllers and timer,
//! and the loop that waits for the VM to end.

use std::path::PathBuf;
use std::sync::mpsc::{Receiver, Sender};

use kvm_bindings::{kvm_pit_config, kvm_userspace_memory_region, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{Cap, Kvm, VmFd};
use mayfly_devices::PowerRequest;
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use crate::api::{Action, ApiCall, ApiServer, Reply};
use crate::arch::kvm_state::KvmCaps;
use crate::arch::layout::{KVM_IDENTITY_MAP_ADDR, KVM_TSS_ADDR};
use crate::fork::{ForkError, ForkRequest};
use crate::identity::Identity;
use crate::lazy::LazyMemory;
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

/// Something the VM's controller must act on: the VM ending, or a request.
#[derive(Debug)]
pub enum VmEvent {
    Power(PowerRequest),
    VcpuFailed {
        index: u8,
        reason: String,
        registers: String,
    },
    Signal(i32),
    /// Guest memory cannot be served any more (a lazy restore's memory file failed).
    MemoryFailed(String),
    /// A request from the control socket.
    Api(ApiCall),
}

/// How a VM ended, and the process exit status that says so.
#[derive(Debug, PartialEq, Eq)]
pub enum VmExit {
    /// The guest powered off: status 0.
    PowerOff,
    /// Shut down through the control socket: status 0.
    Shutdown,
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
    /// The VMM could not keep the VM running (e.g. its memory file failed): status 1.
    Failed(String),
}

impl VmExit {
    pub const RESET_STATUS: u8 = 133;

    pub fn status(&self) -> u8 {
        match self {
            VmExit::PowerOff | VmExit::Shutdown => 0,
            VmExit::Reset => Self::RESET_STATUS,
            VmExit::Signal(sig) => 128u8.saturating_add(*sig as u8),
            VmExit::Crashed { .. } | VmExit::Failed(_) => 1,
        }
    }
}

/// Facts about the VM for `GET /vm`.
#[derive(Clone, Debug)]
pub struct VmInfo {
    pub identity: Identity,
    /// The index the next clone forked from this VM gets.
    pub next_clone: u32,
    pub vcpu_count: u8,
    pub cmdline: String,
    /// "boot", or the snapshot it was restored from.
    pub origin: String,
    pub started: std::time::Instant,
}

/// A running VM: what must stay alive while it runs, and its controller's event channel.
/// Fields drop in order: the control socket and vCPU threads stop first, then the lazy memory
/// handler, and guest memory is unmapped only after everything that uses it is gone.
pub struct Vm {
    /// The control socket, when the VM has one.
    pub api: Option<ApiServer>,
    pub vcpus: Vec<VcpuHandle>,
    /// The userfaultfd handler of a lazily restored VM.
    pub lazy: Option<LazyMemory>,
    pub devices: crate::devices::Devices,
    pub fd: VmFd,
    pub ram: GuestRam,
    pub kvm: Kvm,
    pub events: Receiver<VmEvent>,
    pub event_sender: Sender<VmEvent>,
    pub caps: KvmCaps,
    /// Each vCPU's CPUID, as mayfly set it.
    pub cpuids: Vec<Vec<kvm_bindings::kvm_cpuid_entry2>>,
    pub info: VmInfo,
    pub paused: bool,
}

impl Vm {
    /// Serve requests until something ends the VM, then stop every vCPU.
    pub fn run(mut self) -> VmExit {
        let exit = loop {
            let event = match self.events.recv() {
                Ok(event) => event,
                // Every sender gone: cannot happen while `self` holds one.
                Err(_) => break VmExit::PowerOff,
            };
            match event {
                VmEvent::Api(call) => {
                    let (reply, exit) = self.handle(call.action);
                    let _ = call.reply.send(reply);
                    if let Some(exit) = exit {
                        break exit;
                    }
                }
                VmEvent::Power(PowerRequest::PowerOff) => break VmExit::PowerOff,
                VmEvent::Power(PowerRequest::Reset) => break VmExit::Reset,
                VmEvent::Signal(libc::SIGUSR1) => eprintln!("{}", self.debug_dump()),
                VmEvent::Signal(sig) => break VmExit::Signal(sig),
                VmEvent::MemoryFailed(reason) => break VmExit::Failed(reason),
                VmEvent::VcpuFailed {
                    index,
                    reason,
                    registers,
                } => {
                    break VmExit::Crashed {
                        index,
                        reason,
                        registers,
                    }
                }
            }
        };
        // Stop accepting requests before the VM goes away.
        self.api = None;
        self.stop_vcpus();
        exit
    }

    /// Answer one control socket request; the second value ends the VM.
    fn handle(&mut self, action: Action) -> (Reply, Option<VmExit>) {
        match action {
            Action::Describe => (Reply::ok(self.describe()), None),
            Action::Pause if self.paused => (Reply::error(409, "the VM is already paused"), None),
            Action::Pause => match self.pause() {
                Ok(()) => (Reply::no_content(), None),
                Err(e) => (Reply::error(500, e.to_string()), None),
            },
            Action::Resume if !self.paused => (Reply::error(409, "the VM is not paused"), None),
            Action::Resume => {
                self.resume();
                (Reply::no_content(), None)
            }
            Action::Snapshot { .. } if !self.paused => (
                Reply::error(
                    409,
                    "the VM must be paused to be snapshotted: PUT /vm/pause first",
                ),
                None,
            ),
            Action::Snapshot { path } => match crate::snapshot::create(self, &path) {
                Ok(report) => (
                    Reply::ok(serde_json::to_value(report).unwrap_or_default()),
                    None,
                ),
                Err(e) => (Reply::error(500, e.to_string()), None),
            },
            Action::Fork {
                count,
                name_prefix,
                parent_paused,
            } => {
                let request = ForkRequest {
                    count,
                    name_prefix,
                    parent_paused,
                };
                match crate::fork::fork(self, &request) {
                    Ok(report) => (
                        Reply::ok(serde_json::to_value(report).unwrap_or_default()),
                        None,
                    ),
                    Err(e) => {
                        let status = match e {
                            ForkError::NoClones
                            | ForkError::TooMany(_)
                            | ForkError::Name(_)
                            | ForkError::NoSocket => 400,
                            ForkError::NotEnoughMemory { .. } => 507,
                            ForkError::ShuttingDown => 409,
                            _ => 500,
                        };
                        (Reply::error(status, e.to_string()), None)
                    }
                }
            }
            Action::Shutdown => (Reply::no_content(), Some(VmExit::Shutdown)),
        }
    }

    /// What a stuck guest's devices and interrupt controllers look like (on SIGUSR1).
    fn debug_dump(&mut self) -> String {
        use std::fmt::Write as _;
        let mut out = String::from("mayfly: state dump\n");
        let serial = mayfly_devices::bus::lock(&self.devices.serial).state();
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
        if self.fd.get_irqchip(&mut ioapic).is_ok() {
            // SAFETY: chip_id is the IOAPIC, so the union holds its state.
            let state = unsafe { ioapic.chip.ioapic };
            for pin in [4usize, 5] {
                // SAFETY: redirection entries are plain 64-bit values.
                let entry = unsafe { state.redirtbl[pin].bits };
                let _ = writeln!(
                    out,
                    "  ioapic pin {pin}: {entry:#018x} (irr {:#x})",
                    state.irr
                );
            }
        }
        let was_paused = self.paused;
        if !was_paused && self.pause().is_err() {
            return out;
        }
        for vcpu in &self.vcpus {
            let lapic = vcpu.run_job(|fd| fd.get_lapic().ok()).flatten();
            if let Some(lapic) = lapic {
                let reg = |offset: usize| {
                    (0..8)
                        .map(|i| {
                            let at = offset + i * 0x10;
                            u32::from_le_bytes(std::array::from_fn(|b| lapic.regs[at + b] as u8))
                        })
                        .rev()
                        .map(|w| format!("{w:08x}"))
                        .collect::<String>()
                };
                let _ = writeln!(
                    out,
                    "  vcpu {}: ISR {} IRR {}",
                    vcpu.index,
                    reg(0x100),
                    reg(0x200)
                );
            }
            let regs = vcpu.run_job(|fd| crate::vcpu::dump_registers(fd));
            if let Some(regs) = regs {
                out.push_str(&regs);
            }
        }
        if !was_paused {
            self.resume();
        }
        out
    }

    fn describe(&self) -> serde_json::Value {
        let id = &self.info.identity;
        serde_json::json!({
            "name": id.name,
            "clone_index": id.index,
            "parent": id.parent,
            "generation": id.generation,
            "state": if self.paused { "paused" } else { "running" },
            "origin": self.info.origin,
            "memory_mode": self.ram.kind.name(),
            "vcpus": self.info.vcpu_count,
            "mem_mib": self.ram.size() >> 20,
            "cmdline": self.info.cmdline,
            "uptime_ms": self.info.started.elapsed().as_millis() as u64,
            "pid": std::process::id(),
        })
    }

    /// Stop every vCPU outside KVM_RUN. Also tells each guest its clock was stopped, so a long
    /// pause does not set off its soft-lockup watchdog once it runs again.
    pub fn pause(&mut self) -> Result<(), VmError> {
        for vcpu in &self.vcpus {
            vcpu.request_pause();
        }
        self.devices.probe_waker.wake();
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

    /// Start one thread per vCPU, running or paused.
    pub fn start_vcpus(
        &mut self,
        fds: Vec<kvm_ioctls::VcpuFd>,
        trace: Option<crate::trace::Breakpoints>,
        paused: bool,
    ) -> std::io::Result<()> {
        let context = std::sync::Arc::new(crate::vcpu::VcpuContext {
            pio: self.devices.pio.clone(),
            mmio: self.devices.mmio.clone(),
            events: self.event_sender.clone(),
            trace,
        });
        crate::vcpu::init_kick_signal()?;
        let target = if paused {
            crate::vcpu::Target::Pause
        } else {
            crate::vcpu::Target::Run
        };
        for (index, fd) in fds.into_iter().enumerate() {
            let handle = VcpuHandle::spawn(index as u8, fd, context.clone(), target)?;
            self.vcpus.push(handle);
        }
        self.paused = paused;
        Ok(())
    }

    /// Serve the control socket at `path`.
    pub fn start_api(&mut self, path: &std::path::Path) -> Result<(), crate::api::ApiError> {
        self.api = Some(ApiServer::start(
            path,
            self.event_sender.clone(),
            VmEvent::Api,
        )?);
        Ok(())
    }

    pub fn resume(&mut self) {
        for vcpu in &self.vcpus {
            vcpu.resume();
        }
        self.paused = false;
    }

    pub fn stop_vcpus(&mut self) {
        for vcpu in &self.vcpus {
            vcpu.request_exit();
        }
        self.devices.probe_waker.wake();
        // A vCPU blocked on guest memory that can no longer be served may never come out:
        // give up on it after a while (the process is about to end).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        for vcpu in &mut self.vcpus {
            vcpu.join_until(deadline);
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
        assert_eq!(VmExit::Shutdown.status(), 0);
        assert_eq!(VmExit::Failed("x".into()).status(), 1);
    }
}
