//! The boot path, start to finish: from a [`RunConfig`] to a running VM, a [`Vmm`] for its
//! caller to drive.
//!
//! 1. Open KVM, make guest RAM (a memfd) and the VM: memory slots first, then the in-kernel
//!    irqchip and PIT (a slot added after the irqchip costs milliseconds on some hosts).
//! 2. Create the devices: their MMIO windows and interrupt lines are allocated here, and the
//!    ACPI tables written next describe them.
//! 3. Load the kernel, initrd, command line and the tables (MP table, ACPI) while no vCPU
//!    exists yet.
//! 4. Create and configure the vCPUs; write the identity page and a VM generation ID.
//! 5. Start the control socket, then the vCPU threads, then the console's input.

use std::sync::mpsc::channel;

use kvm_bindings::{kvm_cpuid_entry2, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use vm_memory::{Bytes, GuestAddress};

use crate::arch::cpuid::{set_vcpu_identity, CpuTemplate, CpuTemplateError};
use crate::arch::kvm_state::KvmCaps;
use crate::arch::layout::e820_map;
use crate::arch::regs::{self, EntryMode};
use crate::arch::{acpi, mptable};
use crate::config::{ConfigError, RunConfig};
use crate::devices::console;
use crate::devices::manager::{DeviceError, DeviceManager, Wiring};
use crate::guest::refresh::Refresh;
use crate::identity::{self, Identity, IdentityError};
use crate::kernel::{self, BootInfo, KernelError};
use crate::machine::{Machine, VmInfo};
use crate::memory::ram::{GuestRam, MemoryError};
use crate::runtime::Vmm;
use crate::trace;
use crate::vcpu::VcpuContext;
use crate::vm::{self, kvm_err, Vm, VmError};
use mayfly_sys::claim::SocketClaim;

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
    Api(#[from] mayfly_api::ApiError),
    #[error(transparent)]
    Claim(#[from] mayfly_sys::claim::ClaimError),
    #[error(transparent)]
    Identity(#[from] IdentityError),
    #[error(transparent)]
    Jail(#[from] mayfly_jail::jail::JailError),
}

/// Boot the guest described by `config`; returns once every vCPU runs.
pub fn boot(config: &RunConfig) -> Result<Vmm, BootError> {
    let started = std::time::Instant::now();
    // 0. The socket paths, claimed before anything else: of two VMMs started on one path, the
    // second stops here.
    let api_claim = config
        .api_sock
        .as_deref()
        .map(SocketClaim::new)
        .transpose()?;
    let vsock_claim = config
        .devices
        .vsock
        .as_ref()
        .and_then(|v| v.path.as_deref())
        .map(SocketClaim::new)
        .transpose()?;
    // 1. KVM, guest RAM, the VM.
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
    mayfly_sys::trace::event("vm_created");

    // 2. The devices.
    let (event_sender, events) = channel();
    let devices = DeviceManager::new(
        &Wiring {
            vm: &vm_fd,
            mem: &ram.memory,
            events: &event_sender,
        },
        console_out,
        config.probe,
        &config.devices,
    )?;
    mayfly_sys::trace::event("devices_created");

    // 3. The guest's software: kernel, initrd, command line, and the tables describing the
    // machine.
    let mem = &ram.memory;
    let kernel = kernel::load_kernel(mem, &config.kernel)?;
    let initrd = match &config.initrd {
        Some(image) => Some(kernel::load_initrd(mem, image, &kernel)?),
        None => None,
    };
    // A VM with a NIC is told its address (the same in every VM: see `net`) on its command line.
    let cmdline = match devices.network() {
        Some(network) => format!(
            "{} {}",
            config.cmdline,
            crate::devices::net::guest_cmdline_arg(network.guest())
        ),
        None => config.cmdline.clone(),
    };
    kernel::write_cmdline(mem, &cmdline)?;
    mptable::write_mptable(mem, config.vcpus)?;
    let rsdp = acpi::write_acpi_tables(mem, config.vcpus, &devices.acpi_devices())?;
    let e820 = e820_map(config.mem_bytes());
    let info = BootInfo {
        cmdline_len: cmdline.len(),
        initrd,
        rsdp,
        e820: &e820,
    };
    match kernel.mode {
        EntryMode::Pvh => kernel::write_pvh_start_info(mem, &info)?,
        EntryMode::Linux64 => kernel::write_zero_page(mem, &kernel, &info)?,
    }
    mayfly_sys::trace::event("guest_loaded");
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

    // 4. The vCPUs and the VM's identity.
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
    mayfly_sys::trace::event("vcpus_configured");

    let identity = Identity {
        name: config.name.clone(),
        ..Identity::default()
    };
    identity::write_page(&identity, mem)?;
    identity::new_generation_id(mem)?;

    let caps = KvmCaps::probe(&kvm)?;
    let machine = Machine {
        vm: Vm::new(kvm, vm_fd, caps, cpuids),
        lazy: None,
        devices,
        ram,
        info: VmInfo {
            identity,
            next_clone: 0,
            vcpu_count: config.vcpus,
            cmdline,
            origin: "boot".into(),
            started,
            probe: config.probe,
            memory_protection: crate::memory::ram::BackingProtection::Private,
        },
    };
    // 5. The control socket, the vCPU threads, the console's input.
    let mut refresh = Refresh::default();
    let vsock = machine.devices.vsock().and_then(|(path, _)| path);
    let api = api_claim
        .map(|claim| crate::runtime::serve_api(claim, event_sender.clone(), vsock, &refresh.status))
        .transpose()?;
    let mut machine = machine;
    let m = &mut machine;
    let context = VcpuContext {
        pio: m.devices.pio.clone(),
        mmio: m.devices.mmio.clone(),
        events: event_sender.clone(),
        trace: breakpoints,
    };
    // A jailed VMM is shut into its root now, before any guest code runs.
    mayfly_jail::jail::lock_down(&m.devices.jail_needs(None))?;
    m.vm.start_vcpus(vcpu_fds, context, false)
        .map_err(BootError::Thread)?;
    console::connect_input(
        &m.devices.serial,
        &m.devices.console_gate,
        &config.console,
        None,
    )
    .map_err(BootError::Thread)?;
    // 6. Once its agent is up, tell the guest its name.
    refresh.start(
        &machine,
        mayfly_agent_protocol::RefreshEvent::Boot,
        crate::guest::agent::BOOT_WAIT,
    );
    Ok(Vmm {
        machine,
        events,
        event_sender,
        api,
        vsock_claim,
        refresh,
    })
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
pub fn cpu_template(path: Option<&std::path::Path>) -> Result<CpuTemplate, CpuTemplateError> {
    match path {
        Some(path) => CpuTemplate::from_file(path),
        None => Ok(CpuTemplate::builtin_default()),
    }
}
