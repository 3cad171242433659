//! The restore path, start to finish: from a snapshot directory to a running [`Vm`].
//!
//! 1. Read and check the state file (format, checksum, architecture, host fingerprint) and the
//!    memory file's size, before creating anything.
//! 2. Map guest RAM in the requested mode ([`MemoryMode`]) and register it with KVM before the
//!    in-kernel irqchip (as at boot).
//! 3. Restore the PIT, the KVM clock (moved on by the time spent on disk, so the guest's wall
//!    clock is right) and the interrupt controllers; then each vCPU; then the devices.
//! 4. Tell each vCPU's kvmclock the guest was stopped (its soft-lockup watchdog must not count
//!    the time on disk), start the lazy memory handler if any, and start the vCPUs.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::mpsc::channel;

use kvm_bindings::KVM_MAX_CPUID_ENTRIES;
use mayfly_snapshot::{VmState, MEMORY_FILE, STATE_FILE};

use crate::arch::kvm_state::{self, KvmCaps, StateError};
use crate::arch::layout::RamRange;
use crate::console::{self, Console};
use crate::devices::{create_devices, DeviceError};
use crate::identity::{self, Identity, IdentityError};
use crate::lazy::{self, LazyOptions, LazyRegion};
use crate::memory::{GuestRam, MemoryError};
use crate::trace;
use crate::vm::{self, kvm_err, Vm, VmError, VmEvent, VmInfo};

/// How a restored VM gets its memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryMode {
    /// Map the memory file copy-on-write: instant, and restores of one snapshot share clean
    /// pages through the page cache. The file never changes.
    Cow,
    /// Anonymous memory filled on demand by a userfaultfd handler, prefetching the snapshot's
    /// recorded working set when `prefetch` is set.
    Lazy { prefetch: bool },
    /// Read all of the memory before the guest runs.
    Eager,
}

impl std::str::FromStr for MemoryMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cow" => Ok(MemoryMode::Cow),
            "lazy" => Ok(MemoryMode::Lazy { prefetch: true }),
            "eager" => Ok(MemoryMode::Eager),
            other => Err(format!(
                "unknown memory mode {other:?}: use cow, lazy or eager"
            )),
        }
    }
}

/// Where a snapshot's two files are.
#[derive(Clone, Debug)]
pub struct SnapshotFiles {
    pub state: PathBuf,
    pub memory: PathBuf,
}

impl SnapshotFiles {
    /// The files of a snapshot directory.
    pub fn in_dir(dir: &Path) -> Self {
        Self {
            state: dir.join(STATE_FILE),
            memory: dir.join(MEMORY_FILE),
        }
    }
}

#[derive(Clone, Debug)]
pub struct RestoreConfig {
    pub files: SnapshotFiles,
    /// How `GET /vm` names where the VM came from.
    pub origin: String,
    pub memory: MemoryMode,
    pub console: Console,
    /// A file or FIFO whose bytes are typed into the console (besides stdin with
    /// `Console::Stdio`).
    pub console_input: Option<PathBuf>,
    pub api_sock: Option<PathBuf>,
    /// Leave the vCPUs paused (resume through the control socket).
    pub paused: bool,
    /// The VM's name; the snapshot's when absent.
    pub name: Option<String>,
    /// For a clone: its parent's name and its index.
    pub clone_of: Option<(String, u32)>,
}

#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error("{0} is not a directory with a mayfly snapshot (no such directory)")]
    NoDir(PathBuf),
    #[error(transparent)]
    Format(#[from] mayfly_snapshot::SnapshotError),
    #[error("the snapshot was taken on {found}; this host is {host}")]
    Arch { found: String, host: String },
    #[error("the snapshot was taken on a different host CPU: {0}. Restore it on a host like the one that took it")]
    Fingerprint(String),
    #[error("the snapshot's memory file {path} is missing: {source}")]
    MemoryMissing {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the snapshot's memory file {path} is {found} bytes, but the snapshot needs {expected}: it is truncated or belongs to another snapshot")]
    MemoryTruncated {
        path: PathBuf,
        found: u64,
        expected: u64,
    },
    #[error("the snapshot's state is inconsistent: {0}")]
    Inconsistent(String),
    #[error(transparent)]
    Vm(#[from] VmError),
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error(transparent)]
    State(#[from] StateError),
    #[error(transparent)]
    Devices(#[from] DeviceError),
    #[error(transparent)]
    Console(#[from] console::ConsoleError),
    #[error(transparent)]
    Lazy(#[from] lazy::LazyError),
    #[error(transparent)]
    Identity(#[from] IdentityError),
    #[error(transparent)]
    Api(#[from] crate::api::ApiError),
    #[error("cannot start a vCPU thread: {0}")]
    Thread(std::io::Error),
    #[error("cannot raise a device interrupt: {0}")]
    Interrupt(std::io::Error),
}

/// A snapshot read from disk and checked, with its memory file open.
pub struct LoadedSnapshot {
    pub header: mayfly_snapshot::Header,
    pub state: VmState,
    pub memory: File,
    pub memory_path: PathBuf,
}

/// Read and check a snapshot without touching KVM.
pub fn load(files: &SnapshotFiles) -> Result<LoadedSnapshot, RestoreError> {
    if let Some(dir) = files.state.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.exists() {
            return Err(RestoreError::NoDir(dir.to_path_buf()));
        }
    }
    let (header, state): (mayfly_snapshot::Header, VmState) =
        mayfly_snapshot::read_state_file(&files.state)?;
    if header.arch != std::env::consts::ARCH {
        return Err(RestoreError::Arch {
            found: header.arch,
            host: std::env::consts::ARCH.into(),
        });
    }
    if state.vcpus.len() != usize::from(state.vcpu_count) || state.vcpus.is_empty() {
        return Err(RestoreError::Inconsistent(format!(
            "{} vCPU states for {} vCPUs",
            state.vcpus.len(),
            state.vcpu_count
        )));
    }
    let memory_path = files.memory.clone();
    let memory = File::options()
        .read(true)
        .open(&memory_path)
        .map_err(|source| RestoreError::MemoryMissing {
            path: memory_path.clone(),
            source,
        })?;
    let expected = state
        .memory
        .iter()
        .map(|r| r.file_offset + r.size)
        .max()
        .unwrap_or(0);
    let found = memory
        .metadata()
        .map_err(|source| RestoreError::MemoryMissing {
            path: memory_path.clone(),
            source,
        })?
        .len();
    if found < expected || expected != state.mem_bytes {
        return Err(RestoreError::MemoryTruncated {
            path: memory_path,
            found,
            expected,
        });
    }
    Ok(LoadedSnapshot {
        header,
        state,
        memory,
        memory_path,
    })
}

/// Restore the snapshot in `config.dir`; returns once every vCPU runs (or waits, paused).
pub fn restore(config: &RestoreConfig) -> Result<Vm, RestoreError> {
    let started = std::time::Instant::now();
    let snapshot = load(&config.files)?;
    trace::event("state_loaded");
    let state = &snapshot.state;

    let kvm = vm::open_kvm()?;
    let caps = KvmCaps::probe(&kvm)?;
    // The fingerprint includes KVM's XSAVE layout: compared once KVM is open.
    let differences = snapshot
        .header
        .fingerprint
        .differences(&kvm_state::host_fingerprint(&caps));
    if !differences.is_empty() {
        return Err(RestoreError::Fingerprint(differences.join("; ")));
    }
    if usize::from(state.vcpu_count) > kvm.get_max_vcpus() {
        return Err(RestoreError::Inconsistent(format!(
            "{} vCPUs, more than KVM here allows",
            state.vcpu_count
        )));
    }
    let supported = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(kvm_err("report its supported CPUID"))?;
    for vcpu in &state.vcpus {
        kvm_state::check_cpuid(&vcpu.cpuid, &supported)?;
    }
    let console_out = config.console.output()?;

    let ranges: Vec<RamRange> = state
        .memory
        .iter()
        .map(|r| RamRange {
            guest_addr: r.guest_addr,
            size: r.size,
            file_offset: r.file_offset,
        })
        .collect();
    let ram = match config.memory {
        MemoryMode::Cow => GuestRam::copy_on_write(snapshot.memory, &ranges)?,
        MemoryMode::Lazy { .. } => GuestRam::lazy(snapshot.memory, &ranges)?,
        MemoryMode::Eager => GuestRam::eager(&snapshot.memory, &ranges)?,
    };
    let (event_sender, events) = channel();
    // Serve lazy memory before anything touches it: restoring vCPUs makes KVM write into
    // guest RAM (kvmclock pages), and a page written before the handler runs would never be
    // loaded from the file.
    let lazy = match config.memory {
        MemoryMode::Lazy { prefetch } => {
            let file = ram.backing.try_clone().map_err(MemoryError::Memfd)?;
            let regions: Vec<LazyRegion> = ram
                .host_regions()
                .iter()
                .map(|r| LazyRegion {
                    host_addr: r.host_addr,
                    len: r.len,
                    file_offset: r.file_offset,
                })
                .collect();
            let options = LazyOptions {
                prefetch: if prefetch {
                    state.working_set.clone()
                } else {
                    Vec::new()
                },
                ..LazyOptions::default()
            };
            let failures = event_sender.clone();
            let on_failure = Box::new(move |reason: String| {
                let _ = failures.send(VmEvent::MemoryFailed(format!(
                    "guest memory cannot be loaded any more: {reason}"
                )));
            });
            // SAFETY: the regions are `ram`'s private anonymous mappings (RamKind::Lazy), which
            // the Vm keeps mapped until after it has dropped the LazyMemory (field order), and
            // nothing has read their untouched pages.
            Some(unsafe { lazy::start(file, &regions, options, on_failure) }?)
        }
        _ => None,
    };
    trace::event("memory_mapped");
    let vm_fd = vm::create_vm(&kvm, &ram)?;
    trace::event("vm_created");
    kvm_state::restore_vm(&vm_fd, &state.vm, &caps)?;

    let devices = create_devices(&vm_fd, console_out, Some(&state.serial), &event_sender)?;
    let mut vcpu_fds = Vec::with_capacity(state.vcpus.len());
    for (index, vcpu_state) in state.vcpus.iter().enumerate() {
        let fd = vm_fd
            .create_vcpu(index as u64)
            .map_err(kvm_err("create a vCPU"))?;
        kvm_state::restore_vcpu(&fd, vcpu_state, &caps)?;
        if caps.has_kvmclock_ctrl {
            // EINVAL only means the guest does not use kvmclock.
            let _ = fd.kvmclock_ctrl();
        }
        vcpu_fds.push(fd);
    }
    trace::event("vcpus_restored");

    // Who this VM is now: a restore is a new instance of the snapshot's VM (a clone is one
    // with a new name), with a new generation ID so its RNG does not repeat another's.
    let mut identity = Identity::read(&ram.memory);
    if let Some(name) = &config.name {
        identity.name = name.clone();
    } else if identity.name.is_empty() {
        identity.name = format!("vm-{}", std::process::id());
    }
    if let Some((parent, index)) = &config.clone_of {
        identity.parent = Some(parent.clone());
        identity.index = Some(*index);
    }
    identity.generation += 1;
    identity.write(&ram.memory)?;
    identity::new_generation_id(&ram.memory)?;

    let mut vm = Vm {
        kvm,
        fd: vm_fd,
        ram,
        vcpus: Vec::new(),
        devices,
        events,
        event_sender,
        caps,
        cpuids: state.vcpus.iter().map(|v| v.cpuid.clone()).collect(),
        info: VmInfo {
            identity,
            next_clone: 0,
            vcpu_count: state.vcpu_count,
            cmdline: state.cmdline.clone(),
            origin: config.origin.clone(),
            started,
        },
        paused: config.paused,
        lazy,
        api: None,
    };
    if let Some(path) = &config.api_sock {
        vm.start_api(path)?;
    }
    vm.start_vcpus(vcpu_fds, None, config.paused)
        .map_err(RestoreError::Thread)?;
    // The guest learns of its new generation ID through the Generic Event Device.
    vm.devices.ged.write(1).map_err(RestoreError::Interrupt)?;
    mayfly_devices::bus::lock(&vm.devices.serial)
        .raise_pending_interrupt()
        .map_err(RestoreError::Interrupt)?;
    trace::event("vcpus_started");
    console::connect_input(
        &vm.devices.serial,
        &config.console,
        config.console_input.as_deref(),
    )
    .map_err(RestoreError::Thread)?;
    Ok(vm)
}
