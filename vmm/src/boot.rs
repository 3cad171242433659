//! The boot path, start to finish: from a [`RunConfig`] to a running [`Vm`].
//!
//! Order matters for speed: guest memory is registered before the in-kernel irqchip, and the
//! kernel is loaded while no vCPU exists yet.

use std::sync::mpsc::channel;

use kvm_bindings::{kvm_cpuid_entry2, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use vm_memory::{Bytes, GuestAddress};

use crate::arch::cpuid::{set_vcpu_identity, CpuTemplate};
use crate::arch::kvm_state::KvmCaps;
use crate::arch::layout::e820_map;
use crate::arch::regs::{self, EntryMode};
use crate::arch::{acpi, mptable};
use crate::config::{ConfigError, RunConfig};
use crate::console;
use crate::devices::{create_devices, DeviceError};
use crate::identity::{self, Identity, IdentityError};
use crate::kernel::{self, BootInfo, KernelError};
use crate::memory::{GuestRam, MemoryError};
use crate::vm::{self, kvm_err, Vm, VmError, VmInfo};
use crate::{trace, Error};

/// Everything the boot path can fail on.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Vm(#[from] VmError),
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error(transparent)]
    Kernel(#[from] KernelError),
    #[error(transparent)]
    Devices(#[from] DeviceError),
    #[error(transparent)]
    Console(#[from] console::ConsoleError),
    #[error(transparent)]
    Regs(#[from] regs::RegsError),
    #[error(transparent)]
    MpTable(#[from] mptable::MpTableError),
    #[error(transparent)]
    Acpi(#[from] acpi::AcpiError),
    #[error("cannot start a vCPU thread: {0}")]
    Thread(std::io::Error),
    #[error(transparent)]
    State(#[from] crate::arch::kvm_state::StateError),
    #[error(transparent)]
    Api(#[from] crate::api::ApiError),
    #[error(transparent)]
    Identity(#[from] IdentityError),
}

impl From<BootError> for Error {
    fn from(e: BootError) -> Self {
        Error::Boot(e)
    }
}

/// Boot the guest described by `config`; returns once every vCPU runs.
pub fn boot(config: &RunConfig) -> Result<Vm, BootError> {
    let started = std::time::Instant::now();
    let kvm = vm::open_kvm()?;
    let max_vcpus = kvm.get_max_vcpus();
    if usize::from(config.vcpus) > max_vcpus {
        return Err(ConfigError::TooManyVcpusForKvm {
            asked: config.vcpus,
            max: max_vcpus,
        }
        .into());
    }
    let console_out = config.console.output()?;

    let ram = GuestRam::new_memfd(config.mem_bytes())?;
    let vm_fd = vm::create_vm(&kvm, &ram)?;
    trace::event("vm_created");

    // The guest's software: kernel, initrd, command line, and the tables describing the machine.
    let mem = &ram.memory;
    let kernel = kernel::load_kernel(mem, &config.kernel)?;
    let initrd = match &config.initrd {
        Some(image) => Some(kernel::load_initrd(mem, image, &kernel)?),
        None => None,
    };
    kernel::write_cmdline(mem, &config.cmdline)?;
    mptable::write_mptable(mem, config.vcpus)?;
    let rsdp = acpi::write_acpi_tables(mem, config.vcpus)?;
    let e820 = e820_map(config.mem_bytes());
    let info = BootInfo {
        cmdline_len: config.cmdline.len(),
        initrd,
        rsdp,
        e820: &e820,
    };
    match kernel.mode {
        EntryMode::Pvh => kernel::write_pvh_start_info(mem, &info)?,
        EntryMode::Linux64 => kernel::write_zero_page(mem, &kernel, &info)?,
    }
    trace::event("guest_loaded");
    let breakpoints = config.boot_trace.then(|| {
        let points: Vec<_> = config
            .kernel
            .elf_symbol("start_kernel")
            .map(|addr| ("start_kernel", addr))
            .into_iter()
            .collect();
        trace::Breakpoints::new(&points)
    });
    config.kernel.release();
    if let Some(initrd) = &config.initrd {
        initrd.release();
    }

    let (event_sender, events) = channel();
    let devices = create_devices(&vm_fd, console_out, None, &event_sender)?;
    trace::event("devices_created");

    let (vcpu_fds, cpuids) = create_vcpus(&kvm, &vm_fd, config, &ram, kernel.mode)?;
    // vCPU 0 starts at the kernel's entry (through the trace trampoline when tracing); the
    // others wait for the guest's INIT/SIPI.
    let first_rip = if config.boot_trace {
        let code = trace::trampoline(kernel.entry, kernel.mode == EntryMode::Linux64);
        mem.write_slice(&code, GuestAddress(trace::TRAMPOLINE_ADDR))
            .map_err(KernelError::Memory)?;
        trace::TRAMPOLINE_ADDR
    } else {
        kernel.entry
    };
    regs::setup_regs(&vcpu_fds[0], kernel.mode, first_rip)?;
    trace::event("vcpus_configured");

    let identity = Identity {
        name: config.name.clone(),
        ..Identity::default()
    };
    identity.write(mem)?;
    identity::new_generation_id(mem)?;

    let caps = KvmCaps::probe(&kvm)?;
    let mut vm = Vm {
        kvm,
        fd: vm_fd,
        ram,
        vcpus: Vec::new(),
        devices,
        events,
        event_sender,
        caps,
        cpuids,
        info: VmInfo {
            identity,
            next_clone: 0,
            vcpu_count: config.vcpus,
            cmdline: config.cmdline.clone(),
            origin: "boot".into(),
            started,
        },
        paused: false,
        lazy: None,
        api: None,
    };
    if let Some(path) = &config.api_sock {
        vm.start_api(path)?;
    }
    vm.start_vcpus(vcpu_fds, breakpoints, false)
        .map_err(BootError::Thread)?;
    console::connect_input(&vm.devices.serial, &config.console, None).map_err(BootError::Thread)?;
    Ok(vm)
}

/// Create and configure every vCPU (all but the boot registers of vCPU 0).
fn create_vcpus(
    kvm: &Kvm,
    vm_fd: &VmFd,
    config: &RunConfig,
    ram: &GuestRam,
    mode: EntryMode,
) -> Result<(Vec<VcpuFd>, Vec<Vec<kvm_cpuid_entry2>>), BootError> {
    let mut base_cpuid = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(kvm_err("report its supported CPUID"))?;
    config.cpu_template.apply(base_cpuid.as_mut_slice());

    let mut fds = Vec::with_capacity(usize::from(config.vcpus));
    let mut cpuids = Vec::with_capacity(usize::from(config.vcpus));
    for index in 0..config.vcpus {
        let fd = vm_fd
            .create_vcpu(u64::from(index))
            .map_err(kvm_err("create a vCPU"))?;
        let mut cpuid = base_cpuid.clone();
        set_vcpu_identity(&mut cpuid, index, config.vcpus);
        fd.set_cpuid2(&cpuid)
            .map_err(kvm_err("set the vCPU's CPUID"))?;
        cpuids.push(cpuid.as_slice().to_vec());
        regs::setup_msrs(&fd)?;
        regs::setup_sregs(&ram.memory, &fd, mode)?;
        regs::setup_fpu(&fd)?;
        regs::setup_lapic(&fd)?;
        fds.push(fd);
    }
    Ok((fds, cpuids))
}

/// A built-in template or one from a file.
pub fn cpu_template(path: Option<&std::path::Path>) -> Result<CpuTemplate, Error> {
    match path {
        Some(path) => Ok(CpuTemplate::from_file(path)?),
        None => Ok(CpuTemplate::builtin_default()),
    }
}
