//! The restore path, start to finish: from a snapshot directory to a running VM.
//!
//! 1. Open the snapshot directory once and both files inside it (regular files only), read the
//!    state file with a size cap, and check it (format, checksum, architecture, host
//!    fingerprint) and what it asks for (vCPUs, RAM, layout, names) with the same rules as
//!    `mayfly run`; check that the memory file's trailer names this snapshot. All before
//!    creating anything.
//! 2. Map guest RAM in the requested mode ([`MemoryMode`]) and register it with KVM before the
//!    in-kernel irqchip (as at boot).
//! 3. Restore the PIT, the KVM clock (moved on by the time spent on disk, so the guest's wall
//!    clock is right) and the interrupt controllers; then each vCPU; then the devices.
//! 4. Tell each vCPU's kvmclock the guest was stopped (its soft-lockup watchdog must not count
//!    the time on disk), start the lazy memory handler if any, and start the vCPUs.
//!
//! Steps 1 and 2 ([`prepare`]) do not depend on which VM is started from the snapshot, steps 3
//! and 4 ([`start`]) make one: a fork's zygote prepares once and starts a clone per fork(2).
//! A plain restore also makes its VM (memory slot, irqchip, PIT) in step 2, while another
//! thread asks KVM what it supports.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::mpsc::channel;

use kvm_bindings::KVM_MAX_CPUID_ENTRIES;
use mayfly_snapshot::{SnapshotDir, VmState, MEMORY_FILE, STATE_FILE};

use crate::arch::kvm_state::{self, KvmCaps, StateError};
use crate::devices::console::{self, Console};
use crate::devices::manager::{DeviceError, DeviceManager, RestoreTargets, Wiring};
use crate::event::VmEvent;
use crate::guest::refresh::Refresh;
use crate::identity::{self, Identity, IdentityError};
use crate::machine::{Machine, VmInfo};
use crate::memory::lazy::{self, LazyOptions};
use crate::memory::ram::{GuestRam, MemoryError};
use crate::runtime::Vmm;
use crate::vcpu::VcpuContext;
use crate::vm::{self, kvm_err, Vm, VmError};
use mayfly_sys::claim::SocketClaim;
use mayfly_sys::trace;

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

/// Where a snapshot comes from.
#[derive(Debug)]
pub enum SnapshotSource {
    /// A snapshot directory on disk.
    Dir(PathBuf),
    /// What a fork hands a clone: its state (a sealed memfd) and its memory, as descriptors
    /// this process owns: one base, or the layers the state names, bottom first, and the top.
    Inherited { state: File, memory: Vec<File> },
}

impl SnapshotSource {
    /// Take over descriptors a fork passed (`--state-fd`, `--memory-fd`): they become
    /// close-on-exec at once, so this VM's own clones never inherit (and pin) them.
    pub fn inherited(state_fd: i32, memory_fds: &[i32]) -> Result<Self, RestoreError> {
        let take = |fd: i32, what: &'static str| -> Result<File, RestoreError> {
            // SAFETY: fcntl on a plain integer; F_GETFD only reads the descriptor's flags.
            if fd <= 2 || unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
                return Err(RestoreError::BadDescriptor { fd, what });
            }
            // SAFETY: the fork passed this descriptor for this restore alone; nothing else in
            // this process uses it, so it can own it.
            let owned = unsafe { OwnedFd::from_raw_fd(fd) };
            // SAFETY: sets FD_CLOEXEC on the descriptor this value now owns.
            unsafe { libc::fcntl(owned.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
            let file = File::from(owned);
            let meta = file
                .metadata()
                .map_err(|_| RestoreError::BadDescriptor { fd, what })?;
            if !meta.file_type().is_file() {
                return Err(RestoreError::BadDescriptor { fd, what });
            }
            Ok(file)
        };
        if memory_fds.is_empty() || memory_fds.len() > mayfly_snapshot::MAX_MEMORY_LAYERS + 1 {
            return Err(RestoreError::MemoryLayers(format!(
                "{} memory files handed over",
                memory_fds.len()
            )));
        }
        // Each descriptor is taken (and closed) once.
        let mut all = memory_fds.to_vec();
        all.push(state_fd);
        all.sort_unstable();
        if let Some(twice) = all.windows(2).find(|pair| pair[0] == pair[1]) {
            return Err(RestoreError::MemoryLayers(format!(
                "descriptor {} was handed over twice",
                twice[0]
            )));
        }
        Ok(SnapshotSource::Inherited {
            state: take(state_fd, "state")?,
            memory: memory_fds
                .iter()
                .map(|&fd| take(fd, "memory"))
                .collect::<Result<_, _>>()?,
        })
    }
}

#[derive(Debug)]
pub struct RestoreConfig {
    pub source: SnapshotSource,
    pub memory: MemoryMode,
    pub instance: Instance,
}

/// Who a restored VM is and where it connects: all a restore needs besides the snapshot. A
/// fork's zygote prepares the snapshot once and starts one instance of it per clone.
#[derive(Debug)]
pub struct Instance {
    /// How `GET /vm` names where the VM came from.
    pub origin: String,
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
    /// Where the restored devices connect on this host (the vsock socket, a clone's CID).
    pub devices: RestoreTargets,
}

/// The socket paths of an instance, claimed: of two VMMs started on one path, the second
/// stops at its claim.
pub struct Claims {
    api: Option<SocketClaim>,
    vsock: Option<SocketClaim>,
}

impl Claims {
    /// Listen on the claimed control socket now, ahead of the VM (a VMM standing by answers
    /// on it); the VM's control socket serves what is left queued on it.
    pub fn listen_early(
        &mut self,
    ) -> Result<Option<&std::os::unix::net::UnixListener>, RestoreError> {
        match &mut self.api {
            Some(claim) => Ok(Some(claim.listen()?)),
            None => Ok(None),
        }
    }

    pub fn take(instance: &Instance) -> Result<Self, RestoreError> {
        Ok(Self {
            api: instance
                .api_sock
                .as_deref()
                .map(SocketClaim::new)
                .transpose()?,
            vsock: instance
                .devices
                .vsock_path
                .as_deref()
                .map(SocketClaim::new)
                .transpose()?,
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error(transparent)]
    Format(#[from] mayfly_snapshot::SnapshotError),
    #[error("descriptor {fd} passed as the snapshot's {what} file is not an open regular file")]
    BadDescriptor { fd: i32, what: &'static str },
    #[error("the snapshot asks for something mayfly would not run: {0}")]
    Refused(String),
    #[error("the snapshot was taken on {found}; this host is {host}")]
    Arch { found: String, host: String },
    #[error("the snapshot was taken on a different host CPU: {0}. Restore it on a host like the one that took it")]
    Fingerprint(String),
    #[error("the snapshot's memory layers cannot be used: {0}")]
    MemoryLayers(String),
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
    Api(#[from] mayfly_api::ApiError),
    #[error(transparent)]
    Claim(#[from] mayfly_sys::claim::ClaimError),
    #[error("cannot start a vCPU thread: {0}")]
    Thread(std::io::Error),
    #[error("the control socket failed while standing by for a snapshot: {0}")]
    Standby(std::io::Error),
    #[error("cannot raise a device interrupt: {0}")]
    Interrupt(std::io::Error),
    #[error(transparent)]
    Jail(#[from] mayfly_jail::jail::JailError),
}

/// A snapshot read from disk and checked, with its memory file open.
pub struct LoadedSnapshot {
    pub header: mayfly_snapshot::Header,
    pub state: VmState,
    pub memory: File,
    /// How errors name the memory file.
    pub memory_path: String,
    /// The memory files its RAM is made of, bottom first: a snapshot directory's (one, its own
    /// `memory`, for a full snapshot), or what a fork handed over (one base, or the layers its
    /// state names and the top). Taken when RAM is mapped.
    pub chain: Option<Vec<crate::memory::chain::ChainLayer>>,
}

/// Read and check a snapshot without touching KVM.
/// Memory layers a diff snapshot names by full path must lie in `layers_within`, when given.
pub fn load(
    source: SnapshotSource,
    layers_within: Option<&Path>,
) -> Result<LoadedSnapshot, RestoreError> {
    let mut dir_path = None;
    let mut handed_layers = Vec::new();
    let (state_file, state_path, memory, memory_path) = match source {
        SnapshotSource::Dir(dir) => {
            let dir = SnapshotDir::open(&dir)?;
            let state = dir.open_file(STATE_FILE)?;
            let memory = dir.open_file(MEMORY_FILE)?;
            dir_path = Some(dir.path().to_path_buf());
            (
                state,
                dir.path().join(STATE_FILE),
                memory,
                dir.path().join(MEMORY_FILE).display().to_string(),
            )
        }
        SnapshotSource::Inherited { state, mut memory } => {
            let top = memory
                .pop()
                .ok_or_else(|| RestoreError::MemoryLayers("a fork handed over no memory".into()))?;
            handed_layers = memory;
            (
                state,
                PathBuf::from("the fork's state"),
                top,
                "the fork's memory".to_string(),
            )
        }
    };
    let (header, state): (mayfly_snapshot::Header, VmState) =
        mayfly_snapshot::read_state(&state_file, &state_path)?;
    if header.arch != std::env::consts::ARCH {
        return Err(RestoreError::Arch {
            found: header.arch,
            host: std::env::consts::ARCH.into(),
        });
    }
    let host_mib = crate::config::host_mem_mib().unwrap_or(u64::MAX);
    check_state(&state, host_mib)?;
    mayfly_snapshot::check_trailer(&memory, state.mem_bytes, &state.snapshot_id, &memory_path)?;
    let chain = match &dir_path {
        Some(dir) => {
            let top = memory.try_clone().map_err(MemoryError::Memfd)?;
            Some(
                crate::memory::chain::open_chain(&state, dir, top, layers_within)
                    .map_err(RestoreError::MemoryLayers)?,
            )
        }
        // A fork's: the layers it handed over must be the ones its state names.
        None => Some(handed_chain(&state, handed_layers, &memory)?),
    };
    Ok(LoadedSnapshot {
        header,
        state,
        memory,
        memory_path,
        chain,
    })
}

/// The chain of a fork's memory: the files it handed over under its top (`handed`, bottom
/// first), each the layer its state names (its trailer says so), and the top. A fork of one
/// base is a chain of one.
fn handed_chain(
    state: &VmState,
    handed: Vec<File>,
    top: &File,
) -> Result<Vec<crate::memory::chain::ChainLayer>, RestoreError> {
    use crate::memory::chain::ChainLayer;
    if handed.len() != state.memory_layers.len() {
        return Err(RestoreError::MemoryLayers(format!(
            "the fork handed over {} memory layers under its own, and its state names {}",
            handed.len(),
            state.memory_layers.len()
        )));
    }
    let mut chain = Vec::with_capacity(handed.len() + 1);
    for (i, (file, layer)) in handed.into_iter().zip(&state.memory_layers).enumerate() {
        let name = format!("the fork's memory layer {i}");
        // A file that is not a sealed memfd (the snapshot the parent maps) gets a description
        // of this process's own: the parent's is not shared with its clones.
        let file = if crate::memory::chain::is_sealed(&file) {
            file
        } else {
            crate::memory::chain::reopen_handed(&file).map_err(|e| {
                RestoreError::MemoryLayers(format!("{name} cannot be reopened: {e}"))
            })?
        };
        mayfly_snapshot::check_trailer(&file, state.mem_bytes, &layer.snapshot_id, &name)?;
        chain.push(ChainLayer {
            file,
            path: layer.path.clone(),
            snapshot_id: layer.snapshot_id,
            extents: layer.extents.clone(),
            from_fork: true,
        });
    }
    chain.push(ChainLayer {
        file: top.try_clone().map_err(MemoryError::Memfd)?,
        path: crate::memory::chain::FORK_LAYER_PATH.into(),
        snapshot_id: state.snapshot_id,
        extents: state.memory_extents.clone(),
        from_fork: true,
    });
    Ok(chain)
}

/// Check what a state file asks for with the rules `mayfly run` applies to its arguments: a
/// state file is input like any other, its checksum only says it was not damaged.
pub fn check_state(state: &VmState, host_mib: u64) -> Result<(), RestoreError> {
    let refuse = |what: String| Err(RestoreError::Refused(what));
    crate::config::check_vcpus(u32::from(state.vcpu_count))
        .map_err(|e| RestoreError::Refused(e.to_string()))?;
    if state.vcpus.len() != usize::from(state.vcpu_count) {
        return refuse(format!(
            "{} vCPU states for {} vCPUs",
            state.vcpus.len(),
            state.vcpu_count
        ));
    }
    if !state.mem_bytes.is_multiple_of(1 << 20) {
        return refuse(format!(
            "{} bytes of RAM, not a whole number of MiB",
            state.mem_bytes
        ));
    }
    crate::config::check_mem(state.mem_bytes >> 20, host_mib)
        .map_err(|e| RestoreError::Refused(e.to_string().replace("--mem-mib", "RAM of")))?;
    let layout = crate::arch::layout::ram_ranges(state.mem_bytes);
    if state.memory != layout {
        return refuse(format!(
            "a memory layout mayfly does not make for {} MiB of RAM: {:?}",
            state.mem_bytes >> 20,
            state.memory
        ));
    }
    if state.cmdline.len() >= crate::arch::layout::CMDLINE_MAX_SIZE {
        return refuse(format!(
            "a kernel command line of {} bytes",
            state.cmdline.len()
        ));
    }
    if state.working_set.len() > mayfly_snapshot::MAX_WORKING_SET {
        return refuse(format!(
            "a working set of {} pages",
            state.working_set.len()
        ));
    }
    for (index, vcpu) in state.vcpus.iter().enumerate() {
        if vcpu.cpuid.len() > KVM_MAX_CPUID_ENTRIES {
            return refuse(format!(
                "vCPU {index} with {} CPUID entries",
                vcpu.cpuid.len()
            ));
        }
        if vcpu.msrs.len() > kvm_state::MAX_SAVED_MSRS {
            return refuse(format!("vCPU {index} with {} MSRs", vcpu.msrs.len()));
        }
    }
    if state.devices.serial.in_buffer.len() > MAX_SERIAL_INPUT {
        return refuse(format!(
            "{} bytes of queued console input",
            state.devices.serial.in_buffer.len()
        ));
    }
    identity::check(&state.identity)
        .map_err(|e| RestoreError::Refused(format!("its identity: {e}")))?;
    state
        .check_memory_layers()
        .map_err(RestoreError::Inconsistent)?;
    Ok(())
}

/// Console input a UART holds at most (its FIFO, with room to spare).
const MAX_SERIAL_INPUT: usize = 1024;

/// Restore the snapshot `config.source`; returns once every vCPU runs (or waits, paused).
pub fn restore(config: RestoreConfig) -> Result<Vmm, RestoreError> {
    let started = std::time::Instant::now();
    // The socket paths, claimed before anything else.
    let claims = Claims::take(&config.instance)?;
    let prepared = prepare(
        config.source,
        config.memory,
        config.instance.devices.layers_within.as_deref(),
        Probe::Beside,
    )?;
    start(prepared, config.instance, claims, started)
}

/// A snapshot read, checked against this host's KVM and mapped: everything of a restore that
/// does not depend on which instance of the snapshot is started. Nothing in it runs a thread,
/// and prepared with [`Probe::Inline`] nothing in it belongs to a KVM VM, so a process holding
/// one can fork(2) and finish the restore in the child (see [`crate::persist::zygote`]).
pub struct Prepared {
    state: VmState,
    kvm: kvm_ioctls::Kvm,
    caps: KvmCaps,
    /// The VM, already made with [`Probe::Beside`] (never with [`Probe::Inline`], so a
    /// zygote's `Prepared` holds none: a VM does not cross fork). Before `ram`: fields drop
    /// in order, and the VM's memory slot must go before the mapping behind it.
    early_vm: Option<kvm_ioctls::VmFd>,
    ram: GuestRam,
    memory: MemoryMode,
    memory_protection: crate::memory::ram::BackingProtection,
}

impl Prepared {
    /// Make this snapshot's VM in KVM and nothing else: the VM with its memory slot, interrupt
    /// controllers and PIT, its VM state, and its vCPUs with their state (what [`start`] asks
    /// of KVM, without the devices' irqfds and ioeventfds). No device, thread, socket or
    /// console: the probe benchmark forks this to measure what a clone costs KVM alone on the
    /// host it runs on (the floor a fork's clone is compared with).
    pub fn kvm_only(&self) -> Result<(kvm_ioctls::VmFd, Vec<kvm_ioctls::VcpuFd>), RestoreError> {
        let vm_fd = vm::create_vm(&self.kvm, &self.ram)?;
        kvm_state::restore_vm(&vm_fd, &self.state.vm, &self.caps)?;
        let vcpus = restore_vcpus(&vm_fd, &self.state, &self.caps)?;
        Ok((vm_fd, vcpus))
    }
}

/// Create the snapshot's vCPUs in `vm_fd` and give each its saved state.
fn restore_vcpus(
    vm_fd: &kvm_ioctls::VmFd,
    state: &VmState,
    caps: &KvmCaps,
) -> Result<Vec<kvm_ioctls::VcpuFd>, RestoreError> {
    let mut vcpus = Vec::with_capacity(state.vcpus.len());
    for (index, vcpu_state) in state.vcpus.iter().enumerate() {
        let fd = vm_fd
            .create_vcpu(index as u64)
            .map_err(kvm_err("create a vCPU"))?;
        kvm_state::restore_vcpu(&fd, vcpu_state, caps)?;
        vcpus.push(fd);
    }
    Ok(vcpus)
}

/// Where [`prepare`] asks KVM what it supports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probe {
    /// On a thread of its own, while this one reads the state file, maps guest RAM and makes
    /// the VM: a restore's VM is made by the time KVM has been asked.
    Beside,
    /// On the calling thread, and no VM: a fork's zygote must never run a second thread
    /// (it forks), and a KVM VM does not cross fork(2) (each clone makes its own).
    Inline,
}

/// What this host's KVM supports, as a restore checks a snapshot against it.
struct HostKvm {
    caps: KvmCaps,
    fingerprint: mayfly_snapshot::HostFingerprint,
    max_vcpus: usize,
    supported: kvm_bindings::CpuId,
}

fn probe_kvm(kvm: &kvm_ioctls::Kvm) -> Result<HostKvm, RestoreError> {
    vm::check_kvm(kvm)?;
    let caps = KvmCaps::probe(kvm)?;
    let fingerprint = kvm_state::host_fingerprint(&caps);
    let max_vcpus = kvm.get_max_vcpus();
    let supported = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(kvm_err("report its supported CPUID"))?;
    Ok(HostKvm {
        caps,
        fingerprint,
        max_vcpus,
        supported,
    })
}

/// Steps 1 and 2: read and check the snapshot, open KVM and check the snapshot against it,
/// map guest RAM (and, [`Probe::Beside`], make the VM).
pub fn prepare(
    source: SnapshotSource,
    memory: MemoryMode,
    layers_within: Option<&Path>,
    probe: Probe,
) -> Result<Prepared, RestoreError> {
    // A host without KVM still hears first of what is wrong with the snapshot.
    let kvm = match vm::open_kvm_device() {
        Ok(kvm) => kvm,
        Err(no_kvm) => {
            load(source, layers_within)?;
            return Err(no_kvm.into());
        }
    };
    // KVM is asked what it supports on a thread of its own while this one reads the state
    // file, maps guest RAM and makes the VM: neither needs the other, and on this host each
    // takes most of a millisecond (KVM's supported CPUID runs the host's CPUID many times,
    // which traps on a nested host; making the VM with its memory slot and irqchip ~0.8 ms).
    // Measured side by side on this host's KVM (launch → first KVM_RUN, medians of 30
    // interleaved restores of a 128 MiB probe): the VM made after both, 4.82 ms; made
    // beside the probe, 4.25 ms.
    // The snapshot is checked against KVM once both are done: what was made before a check
    // fails is nothing anyone sees, and is dropped. Not an eager restore's memory: it reads
    // the whole memory file, which a snapshot refused on its CPU must not cost (and its
    // tens of milliseconds dwarf what making the VM beside the probe saves).
    let early = probe == Probe::Beside && memory != MemoryMode::Eager;
    let (made, host) = std::thread::scope(|scope| {
        let host = if early {
            std::thread::Builder::new()
                .name("kvm-probe".into())
                .stack_size(mayfly_sys::HELPER_THREAD_STACK)
                .spawn_scoped(scope, || probe_kvm(&kvm))
                .ok()
        } else {
            None
        };
        // Only beside a probe thread: a zygote's (Inline) must hold no VM.
        let beside = host.is_some();
        let made = load(source, layers_within).and_then(|mut snapshot| {
            trace::event("state_loaded");
            if !beside {
                return Ok((snapshot, None));
            }
            let ram = map_ram(&mut snapshot, memory)?;
            let vm = vm::create_vm(&kvm, &ram);
            Ok((snapshot, Some((ram, vm))))
        });
        let host = match host {
            Some(thread) => thread.join().unwrap_or_else(|_| {
                Err(RestoreError::Thread(std::io::Error::other(
                    "the thread asking KVM what it supports failed",
                )))
            }),
            // Inline, an eager restore, or no thread to be had: probe here.
            None => probe_kvm(&kvm),
        };
        (made, host)
    });
    // In this order: what is wrong with the snapshot first, then with KVM, whose probe says
    // what is missing when making the VM failed for want of it, then the snapshot against
    // this KVM.
    let (mut snapshot, made) = made?;
    let host = host?;
    check_against(&snapshot, &host)?;
    let (ram, early_vm) = match made {
        Some((ram, vm)) => (ram, Some(vm?)),
        None => (map_ram(&mut snapshot, memory)?, None),
    };
    Ok(finish(snapshot, kvm, host, ram, memory, early_vm))
}

/// KVM opened, asked what it supports and a VM made, before any snapshot is known: what a
/// VMM standing by holds (see [`crate::persist::standby`]), so that a restore asked of it later
/// starts with its snapshot.
pub struct ReadyKvm {
    kvm: kvm_ioctls::Kvm,
    host: HostKvm,
    vm: kvm_ioctls::VmFd,
}

impl ReadyKvm {
    pub fn open() -> Result<Self, RestoreError> {
        let kvm = vm::open_kvm_device()?;
        let host = probe_kvm(&kvm)?;
        let vm = vm::create_bare_vm(&kvm)?;
        Ok(Self { kvm, host, vm })
    }
}

/// Steps 1 and 2 with KVM ready ahead: read and check the snapshot, map guest RAM and finish
/// the VM made ahead. The VM is used up whether this succeeds or not.
pub fn prepare_ready(
    source: SnapshotSource,
    memory: MemoryMode,
    layers_within: Option<&Path>,
    ready: ReadyKvm,
) -> Result<Prepared, RestoreError> {
    let ReadyKvm { kvm, host, vm } = ready;
    let mut snapshot = load(source, layers_within)?;
    trace::event("state_loaded");
    check_against(&snapshot, &host)?;
    let ram = map_ram(&mut snapshot, memory)?;
    let vm = vm::finish_vm(vm, &ram)?;
    Ok(finish(snapshot, kvm, host, ram, memory, Some(vm)))
}

/// Check a loaded snapshot against this host's KVM.
fn check_against(snapshot: &LoadedSnapshot, host: &HostKvm) -> Result<(), RestoreError> {
    let state = &snapshot.state;
    // The fingerprint includes KVM's XSAVE layout: compared once KVM is open.
    let differences = snapshot.header.fingerprint.differences(&host.fingerprint);
    if !differences.is_empty() {
        return Err(RestoreError::Fingerprint(differences.join("; ")));
    }
    if usize::from(state.vcpu_count) > host.max_vcpus {
        return Err(RestoreError::Inconsistent(format!(
            "{} vCPUs, more than KVM here allows",
            state.vcpu_count
        )));
    }
    for vcpu in &state.vcpus {
        kvm_state::check_cpuid(&vcpu.cpuid, &host.supported)?;
    }
    Ok(())
}

/// The end of steps 1 and 2: guard the memory file, and keep what starting needs.
fn finish(
    snapshot: LoadedSnapshot,
    kvm: kvm_ioctls::Kvm,
    host: HostKvm,
    ram: GuestRam,
    memory: MemoryMode,
    early_vm: Option<kvm_ioctls::VmFd>,
) -> Prepared {
    // A memory file that changes under a copy-on-write VM changes the guest's memory: lease
    // or seal it, so that the VM stops first (see GuestRam::protect_backing).
    let memory_protection = ram.protect_backing();
    if memory_protection == crate::memory::ram::BackingProtection::Unprotected {
        // Said once, so that a user who sees the guest misbehave knows the file is not
        // guarded: only a memory file that got shorter is then caught.
        eprintln!(
            "mayfly: warning: {} cannot be leased (not owned by this user, open for writing \
             elsewhere, or a file system without leases): the VM's memory is not protected \
             against that file changing; do not write it while the VM runs",
            snapshot.memory_path
        );
    }
    Prepared {
        state: snapshot.state,
        kvm,
        caps: host.caps,
        ram,
        memory,
        memory_protection,
        early_vm,
    }
}

/// Map a loaded snapshot's guest RAM as `memory` asks.
fn map_ram(snapshot: &mut LoadedSnapshot, memory: MemoryMode) -> Result<GuestRam, RestoreError> {
    let state = &snapshot.state;
    let ranges = &state.memory;
    let diff = state.memory_extents.is_some();
    let memory_file = || snapshot.memory.try_clone().map_err(MemoryError::Memfd);
    Ok(match (memory, snapshot.chain.take()) {
        (MemoryMode::Cow, Some(chain)) => GuestRam::copy_on_write_chain(chain, ranges)?,
        (MemoryMode::Cow, None) => GuestRam::copy_on_write(memory_file()?, ranges)?,
        (MemoryMode::Lazy { .. }, _) if diff => {
            return Err(RestoreError::MemoryLayers(
                "a diff snapshot is restored with --memory cow or eager; lazy restore reads \
                 one full memory file (take a full snapshot of it to restore it lazily)"
                    .into(),
            ))
        }
        (MemoryMode::Lazy { .. }, _) => GuestRam::lazy(memory_file()?, ranges)?,
        (MemoryMode::Eager, Some(chain)) if diff => GuestRam::eager_chain(&chain, ranges)?,
        (MemoryMode::Eager, _) => GuestRam::eager(&snapshot.memory, ranges)?,
    })
}

/// Steps 3 and 4: make the VM of a prepared snapshot, as `instance`, and start it.
pub fn start(
    prepared: Prepared,
    config: Instance,
    claims: Claims,
    started: std::time::Instant,
) -> Result<Vmm, RestoreError> {
    let Prepared {
        state,
        kvm,
        caps,
        mut ram,
        memory,
        mut memory_protection,
        early_vm,
    } = prepared;
    // A clone leases what its fork handed over itself (the zygote's leases would warn the
    // zygote, which is gone): see GuestRam::lease_handed.
    if config.clone_of.is_some() {
        memory_protection = ram.lease_handed();
        if memory_protection == crate::memory::ram::BackingProtection::Unprotected {
            eprintln!(
                "mayfly: warning: the snapshot file this clone's memory maps cannot be leased: \
                 the VM's memory is not protected against that file changing; do not write it \
                 while the VM runs"
            );
        }
    }
    let state = &state;
    // The vCPU threads first: they make themselves and install their filters while the VM
    // is being made (on another CPU), and wait for their vCPUs.
    let vcpu_threads =
        vm::prepare_vcpu_threads(state.vcpus.len(), config.paused).map_err(RestoreError::Thread)?;
    let console_out = config.console.output()?;
    let (event_sender, events) = channel();
    // Serve lazy memory before anything touches it: restoring vCPUs makes KVM write into
    // guest RAM (kvmclock pages), and a page written before the handler runs would never be
    // loaded from the file.
    let lazy = match memory {
        MemoryMode::Lazy { prefetch } => {
            let file = ram.backing.try_clone().map_err(MemoryError::Memfd)?;
            let regions = ram.host_regions();
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
    let vm_fd = match early_vm {
        Some(made) => made,
        None => vm::create_vm(&kvm, &ram)?,
    };
    trace::event("vm_created");
    kvm_state::restore_vm(&vm_fd, &state.vm, &caps)?;
    trace::event("vm_state_restored");

    let devices = DeviceManager::restore(
        &Wiring {
            vm: &vm_fd,
            mem: &ram.memory,
            events: &event_sender,
        },
        console_out,
        state.probe,
        &state.devices,
        &config.devices,
    )?;
    trace::event("devices_restored");
    let vcpu_fds = restore_vcpus(&vm_fd, state, &caps)?;
    if caps.has_kvmclock_ctrl {
        for fd in &vcpu_fds {
            // EINVAL only means the guest does not use kvmclock.
            let _ = fd.kvmclock_ctrl();
        }
    }
    trace::event("vcpus_restored");
    // Only now may devices interrupt the guest: before, the vCPU restore would erase it.
    devices.raise_pending_interrupts()?;

    // Who this VM is now: a restore is a new instance of the snapshot's VM (a clone is one
    // with a new name), with a new generation ID so its RNG does not repeat another's.
    // The identity comes from the state file, never from guest memory (the guest can write
    // that); the page the guest reads is rewritten from it.
    let mut identity: Identity = state.identity.clone();
    if let Some(name) = &config.name {
        identity.name = name.clone();
    }
    let next_clone = match &config.clone_of {
        Some((parent, index)) => {
            identity.parent = Some(parent.clone());
            identity.index = Some(*index);
            // A clone's own clones are named after it, from 0.
            0
        }
        None => state.next_clone,
    };
    identity.generation += 1;
    identity::write_page(&identity, &ram.memory)?;
    identity::new_generation_id(&ram.memory)?;

    let machine = Machine {
        vm: Vm::new(
            kvm,
            vm_fd,
            caps,
            state.vcpus.iter().map(|v| v.cpuid.clone()).collect(),
        ),
        lazy,
        devices,
        ram,
        info: VmInfo {
            identity,
            next_clone,
            vcpu_count: state.vcpu_count,
            cmdline: state.cmdline.clone(),
            origin: config.origin.clone(),
            started,
            probe: state.probe,
            memory_protection,
        },
    };
    let mut refresh = Refresh::default();
    let vsock = machine.devices.vsock().and_then(|(path, _)| path);
    let api = claims
        .api
        .map(|claim| crate::runtime::serve_api(claim, event_sender.clone(), vsock, &refresh.status))
        .transpose()?;
    trace::event("api_started");
    let mut machine = machine;
    let m = &mut machine;
    let context = VcpuContext {
        pio: m.devices.pio.clone(),
        mmio: m.devices.mmio.clone(),
        events: event_sender.clone(),
        trace: None,
    };
    // A jailed VMM is shut into its root now, before any guest code runs.
    mayfly_jail::jail::lock_down(&m.devices.jail_needs(config.console_input.as_deref()))?;
    trace::event("locked_down");
    m.vm.start_prepared_vcpus(vcpu_threads, vcpu_fds, context, config.paused);
    // The restored devices' threads wait at their gates: a paused restore keeps them (and the
    // console) paused until it is resumed.
    if config.paused {
        m.devices.keep_paused()?;
    } else {
        m.devices.resume();
    }
    // The guest learns of its new generation ID through the Generic Event Device.
    m.devices.ged.write(1).map_err(RestoreError::Interrupt)?;
    mayfly_devices::bus::lock(&m.devices.serial)
        .raise_pending_interrupt()
        .map_err(RestoreError::Interrupt)?;
    trace::event("vcpus_started");
    console::connect_input(
        &m.devices.serial,
        &m.devices.console_gate,
        &config.console,
        config.console_input.as_deref(),
    )
    .map_err(RestoreError::Thread)?;
    // The guest's clock, entropy and name are stale: its agent refreshes them (a clone's
    // hooks learn it is one) before exec and file requests are let through.
    let event = match config.clone_of {
        Some(_) => mayfly_agent_protocol::RefreshEvent::Fork,
        None => mayfly_agent_protocol::RefreshEvent::Restore,
    };
    refresh.start(&machine, event, crate::guest::agent::DEFAULT_WAIT);
    Ok(Vmm {
        machine,
        events,
        event_sender,
        api,
        vsock_claim: claims.vsock,
        refresh,
    })
}
