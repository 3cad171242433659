//! The snapshot path: from a paused VM to a snapshot directory on disk.
//!
//! 1. Freeze every writable disk's top layer (the VM goes on on a new one) and read the state
//!    of every vCPU (on its own thread), of the VM (interrupt controllers, PIT, clock) and of
//!    the devices; hard-link the disks' frozen layers into the snapshot's `disks/` (see
//!    [`crate::devices::disks`]): metadata only, whatever they hold.
//! 2. Write guest RAM sparse: a page is written only if it holds something other than zeros.
//!    Pages this process has mapped are read from the mapping; the others from the file behind
//!    guest RAM (see `GuestRam::backing`), so pages the guest never touched cost nothing.
//! 3. Write both files into a temporary directory, fsync them, and rename it into place
//!    (exchanging it with an older snapshot of the same name, which is then deleted): an
//!    interrupted snapshot never damages an older one. The temporary directory is locked
//!    (flock) while it is written, so the next snapshot into the same parent directory can tell
//!    the leftovers of a VMM that died (kill -9) from a snapshot in progress, and removes them.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Instant;

use mayfly_snapshot::{Header, VmState, MEMORY_FILE, MEMORY_LAYERS_DIR, STATE_FILE};

use mayfly_devices::state::VirtioKindState;

use crate::arch::kvm_state::{self, StateError};
use crate::devices::disks::SNAPSHOT_DISKS;
use crate::machine::Machine;
use crate::memory::ram::RamKind;

#[derive(Debug, thiserror::Error)]
pub enum SnapshotCreateError {
    #[error("the VM must be paused to be snapshotted (PUT /vm/pause, or `mayfly pause`)")]
    NotPaused,
    #[error("vCPU {0} is gone (it stopped the VM): nothing consistent to snapshot")]
    VcpuGone(u8),
    #[error(transparent)]
    State(#[from] StateError),
    #[error("{path} exists and is not a mayfly snapshot: choose another path")]
    NotASnapshotDir { path: PathBuf },
    #[error("the snapshot path {0} has no parent directory")]
    NoParent(PathBuf),
    #[error("cannot write a snapshot to {path}: its parent directory {parent} {problem}")]
    BadParent {
        path: PathBuf,
        parent: PathBuf,
        problem: &'static str,
    },
    #[error("cannot write the snapshot to {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Format(#[from] mayfly_snapshot::SnapshotError),
    #[error(transparent)]
    Devices(#[from] crate::devices::manager::DeviceError),
    #[error(transparent)]
    Disk(#[from] crate::devices::disks::DiskSetupError),
    #[error(transparent)]
    Diff(#[from] crate::memory::diff::DiffError),
}

impl SnapshotCreateError {
    /// The HTTP status that says whose mistake it is: 4xx for a request that cannot work (the
    /// path), 5xx for the VMM's own failures.
    pub fn http_status(&self) -> u16 {
        match self {
            SnapshotCreateError::NotPaused => 409,
            SnapshotCreateError::Diff(crate::memory::diff::DiffError::NotLayered(_)) => 409,
            SnapshotCreateError::NotASnapshotDir { .. } => 409,
            SnapshotCreateError::NoParent(_) | SnapshotCreateError::BadParent { .. } => 400,
            SnapshotCreateError::Io { source, .. }
                if matches!(
                    source.raw_os_error(),
                    Some(libc::EACCES) | Some(libc::EPERM) | Some(libc::EROFS)
                ) =>
            {
                403
            }
            SnapshotCreateError::Io { source, .. }
                if matches!(
                    source.raw_os_error(),
                    Some(libc::ENOSPC) | Some(libc::EDQUOT)
                ) =>
            {
                507
            }
            _ => 500,
        }
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> SnapshotCreateError + '_ {
    move |source| SnapshotCreateError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// What a snapshot took and cost.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SnapshotReport {
    pub path: PathBuf,
    pub state_bytes: u64,
    /// Bytes of guest RAM written (non-zero pages).
    pub memory_bytes_written: u64,
    pub memory_bytes: u64,
    /// For a diff snapshot: the memory layers it stacks on, and whether the chain was
    /// compacted to get there. 0 and false for a full one.
    pub memory_layers: usize,
    pub compacted: bool,
    pub state_ms: f64,
    pub memory_ms: f64,
    pub total_ms: f64,
}

/// Snapshot the (paused) VM into `dest`; with `diff`, only the pages written since it was
/// restored, over the snapshot it was restored from (see `memory/diff.rs`).
pub fn create(
    vm: &Machine,
    dest: &Path,
    diff: bool,
) -> Result<SnapshotReport, SnapshotCreateError> {
    let start = Instant::now();
    if !vm.paused() {
        return Err(SnapshotCreateError::NotPaused);
    }
    if diff {
        crate::memory::diff::check_layered(&vm.ram)?;
    }
    let dest = absolute(dest)?;
    let parent = dest
        .parent()
        .ok_or_else(|| SnapshotCreateError::NoParent(dest.clone()))?;
    let name = dest
        .file_name()
        .ok_or_else(|| SnapshotCreateError::NoParent(dest.clone()))?;
    match std::fs::metadata(parent) {
        Ok(meta) if meta.is_dir() => {}
        Ok(_) => {
            return Err(SnapshotCreateError::BadParent {
                path: dest.clone(),
                parent: parent.to_path_buf(),
                problem: "is not a directory",
            })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(SnapshotCreateError::BadParent {
                path: dest.clone(),
                parent: parent.to_path_buf(),
                problem: "does not exist: create it first",
            })
        }
        Err(e) => return Err(io_err(parent)(e)),
    }
    check_replaceable(&dest)?;
    remove_dead_leftovers(parent);
    let tmp = parent.join(format!(
        ".{}{TMP_MARK}{}-{}",
        name.to_string_lossy(),
        std::process::id(),
        kvm_state::realtime_ns()
    ));
    std::fs::create_dir(&tmp).map_err(io_err(&tmp))?;
    // Held until the snapshot is in place (or removed): a live writer's lock.
    let lock = File::open(&tmp).map_err(io_err(&tmp))?;
    // SAFETY: flock on a descriptor we own; the result is checked.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let err = std::io::Error::last_os_error();
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(io_err(&tmp)(err));
    }
    let result = write_snapshot(vm, &tmp, &dest, start, diff).and_then(|report| {
        install(&tmp, &dest)?;
        Ok(SnapshotReport {
            path: dest.clone(),
            total_ms: start.elapsed().as_secs_f64() * 1e3,
            ..report
        })
    });
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    drop(lock);
    result
}

/// What marks a temporary snapshot directory: `.<name>.tmp-<pid>-<ns>`.
const TMP_MARK: &str = ".tmp-";

/// Remove the temporary directories that VMMs which died while snapshotting left in `parent`
/// (a kill -9 leaves up to a whole memory file behind). A directory qualifies only if it is
/// named like one, holds nothing but a state and a memory file, and nobody holds its lock: a
/// snapshot in progress keeps it locked. Best effort: what cannot be removed stays.
fn remove_dead_leftovers(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if !name.starts_with('.') || !name.contains(TMP_MARK) {
            continue;
        }
        let path = entry.path();
        // Not following symlinks: only a real directory of ours qualifies.
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if !meta.is_dir() {
            continue;
        }
        // Not an empty one: a snapshot that has just made its directory has not locked it yet.
        let only_snapshot_files = std::fs::read_dir(&path).is_ok_and(|inner| {
            let entries: Vec<_> = inner.flatten().collect();
            !entries.is_empty()
                && entries.iter().all(|e| {
                    ((e.file_name() == STATE_FILE || e.file_name() == MEMORY_FILE)
                        && e.file_type().is_ok_and(|t| t.is_file()))
                        || ((e.file_name() == SNAPSHOT_DISKS || e.file_name() == MEMORY_LAYERS_DIR)
                            && e.file_type().is_ok_and(|t| t.is_dir()))
                })
        });
        if !only_snapshot_files {
            continue;
        }
        let Ok(dir) = File::open(&path) else {
            continue;
        };
        // SAFETY: flock on a descriptor we own; the result is checked.
        if unsafe { libc::flock(dir.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            let _ = std::fs::remove_dir_all(&path);
        }
    }
}

fn absolute(path: &Path) -> Result<PathBuf, SnapshotCreateError> {
    std::path::absolute(path).map_err(io_err(path))
}

/// An existing `dest` may be replaced only if it is an (empty or complete) snapshot directory.
fn check_replaceable(dest: &Path) -> Result<(), SnapshotCreateError> {
    let entries = match std::fs::read_dir(dest) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(_) => {
            return Err(SnapshotCreateError::NotASnapshotDir {
                path: dest.to_path_buf(),
            })
        }
    };
    for entry in entries {
        let entry = entry.map_err(io_err(dest))?;
        let disks = (entry.file_name() == SNAPSHOT_DISKS || entry.file_name() == MEMORY_LAYERS_DIR)
            && entry.file_type().is_ok_and(|t| t.is_dir());
        if entry.file_name() != STATE_FILE && entry.file_name() != MEMORY_FILE && !disks {
            return Err(SnapshotCreateError::NotASnapshotDir {
                path: dest.to_path_buf(),
            });
        }
    }
    Ok(())
}

/// The paused VM's state: every vCPU (read on its own thread), the VM, the devices. The
/// working set is left empty; the memory writer knows it.
pub fn capture_state(vm: &Machine) -> Result<VmState, SnapshotCreateError> {
    let snapshot_id = random_id().map_err(|e| SnapshotCreateError::Io {
        path: PathBuf::from("the host's random number generator"),
        source: e,
    })?;
    let mut vcpus = Vec::with_capacity(vm.vm.vcpus.len());
    for (vcpu, cpuid) in vm.vm.vcpus.iter().zip(&vm.vm.cpuids) {
        let caps = vm.vm.caps.clone();
        let cpuid = cpuid.clone();
        let state = vcpu
            .run_job(move |fd| kvm_state::save_vcpu(fd, &caps, cpuid))
            .ok_or(SnapshotCreateError::VcpuGone(vcpu.index))??;
        vcpus.push(state);
    }
    Ok(VmState {
        snapshot_id,
        vcpu_count: vm.info.vcpu_count,
        mem_bytes: vm.ram.size(),
        cmdline: vm.info.cmdline.clone(),
        memory: vm.ram.ranges.clone(),
        vcpus,
        vm: kvm_state::save_vm(&vm.vm.fd)?,
        devices: vm.devices.save(),
        identity: vm.info.identity.clone(),
        next_clone: vm.info.next_clone,
        probe: vm.info.probe,
        working_set: Vec::new(),
        memory_layers: Vec::new(),
        memory_extents: None,
    })
}

/// 16 random bytes from the host: a snapshot ID.
pub fn random_id() -> std::io::Result<[u8; 16]> {
    let mut id = [0u8; 16];
    crate::identity::host_random(&mut id)?;
    Ok(id)
}

/// The state file's header for a snapshot taken on this host now.
pub fn header(vm: &Machine) -> Header {
    Header {
        arch: std::env::consts::ARCH.to_string(),
        fingerprint: kvm_state::host_fingerprint(&vm.vm.caps),
        created_unix_ms: kvm_state::realtime_ns() / 1_000_000,
        writer: format!("mayfly {}", env!("CARGO_PKG_VERSION")),
    }
}

fn write_snapshot(
    vm: &Machine,
    dir: &Path,
    dest: &Path,
    start: Instant,
    diff: bool,
) -> Result<SnapshotReport, SnapshotCreateError> {
    // The disks first: each writable one's top layer is frozen (the VM goes on on a new one)
    // and the frozen chain linked into the snapshot, in time independent of its size.
    vm.devices.freeze_disks()?;
    let mut state = capture_state(vm)?;
    link_disks(&mut state, dir)?;
    let state_ms = start.elapsed().as_secs_f64() * 1e3;

    let memory_path = dir.join(MEMORY_FILE);
    let mut layers = (0, false);
    let (bytes, touched) = if diff {
        let written = crate::memory::diff::write_diff(&vm.ram, dir, dest, &mut state)?;
        layers = (written.layers, written.compacted);
        (written.bytes, Vec::new())
    } else {
        let memory_file = File::create(&memory_path).map_err(io_err(&memory_path))?;
        let written = vm
            .ram
            .write_sparse(&memory_file)
            .map_err(io_err(&memory_path))?;
        (written.bytes, written.touched)
    };
    File::options()
        .write(true)
        .open(&memory_path)
        .and_then(|memory_file| {
            mayfly_snapshot::write_trailer(&memory_file, vm.ram.size(), &state.snapshot_id)?;
            memory_file.sync_all()
        })
        .map_err(io_err(&memory_path))?;
    if diff {
        let layers = dir.join(MEMORY_LAYERS_DIR);
        File::open(&layers)
            .and_then(|d| d.sync_all())
            .map_err(io_err(&layers))?;
    }
    let memory_ms = start.elapsed().as_secs_f64() * 1e3 - state_ms;

    state.working_set = match (&vm.lazy, vm.ram.kind) {
        (Some(lazy), _) => lazy.working_set(),
        (None, RamKind::CopyOnWrite) => touched,
        _ => Vec::new(),
    };
    state.working_set.truncate(mayfly_snapshot::MAX_WORKING_SET);
    let state_path = dir.join(STATE_FILE);
    mayfly_snapshot::write_state_file(&state_path, &header(vm), &state)?;
    let state_bytes = std::fs::metadata(&state_path)
        .map_err(io_err(&state_path))?
        .len();
    Ok(SnapshotReport {
        path: dir.to_path_buf(),
        state_bytes,
        memory_bytes_written: bytes,
        memory_layers: layers.0,
        compacted: layers.1,
        memory_bytes: vm.ram.size(),
        state_ms,
        memory_ms,
        total_ms: 0.0,
    })
}

/// Link every block device's layers into the snapshot being written in `dir` (see
/// [`crate::devices::disks::link_into_snapshot`]) and make the links durable.
fn link_disks(state: &mut VmState, dir: &Path) -> Result<(), SnapshotCreateError> {
    let mut linked = false;
    for device in &mut state.devices.virtio {
        if let VirtioKindState::Block(block) = &mut device.device {
            crate::devices::disks::link_into_snapshot(block, dir)?;
            linked |= !block.chain.layers.is_empty();
        }
    }
    if linked {
        let disks = dir.join(SNAPSHOT_DISKS);
        File::open(&disks)
            .and_then(|d| d.sync_all())
            .map_err(io_err(&disks))?;
    }
    Ok(())
}

/// Put the finished temporary directory in place of `dest`, atomically.
fn install(tmp: &Path, dest: &Path) -> Result<(), SnapshotCreateError> {
    let parent = dest.parent().expect("checked by the caller");
    File::open(tmp)
        .and_then(|d| d.sync_all())
        .map_err(io_err(tmp))?;
    match std::fs::rename(tmp, dest) {
        Ok(()) => {}
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::ENOTEMPTY) | Some(libc::EEXIST) | Some(libc::EISDIR)
            ) =>
        {
            // An older snapshot is there: swap the two in one step, then delete the old one.
            exchange(tmp, dest).map_err(io_err(dest))?;
            std::fs::remove_dir_all(tmp).map_err(io_err(tmp))?;
        }
        Err(e) => return Err(io_err(dest)(e)),
    }
    File::open(parent)
        .and_then(|d| d.sync_all())
        .map_err(io_err(parent))
}

fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let ca = std::ffi::CString::new(a.as_os_str().as_bytes())?;
    let cb = std::ffi::CString::new(b.as_os_str().as_bytes())?;
    // SAFETY: two valid NUL-terminated paths; the result is checked.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_snapshot_directories_are_replaced() {
        let dir = std::env::temp_dir().join(format!("mayfly-snap-repl-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("snap")).unwrap();
        std::fs::write(dir.join("snap").join(STATE_FILE), b"x").unwrap();
        assert!(check_replaceable(&dir.join("snap")).is_ok());
        assert!(check_replaceable(&dir.join("absent")).is_ok());
        std::fs::write(dir.join("snap").join("notes.txt"), b"mine").unwrap();
        assert!(matches!(
            check_replaceable(&dir.join("snap")),
            Err(SnapshotCreateError::NotASnapshotDir { .. })
        ));
        std::fs::write(dir.join("file"), b"x").unwrap();
        assert!(check_replaceable(&dir.join("file")).is_err());

        // Installing over an older snapshot swaps it out whole.
        let old = dir.join("old");
        std::fs::create_dir_all(&old).unwrap();
        std::fs::write(old.join(STATE_FILE), b"old").unwrap();
        let new = dir.join(".old.tmp");
        std::fs::create_dir_all(&new).unwrap();
        std::fs::write(new.join(STATE_FILE), b"new").unwrap();
        install(&new, &old).unwrap();
        assert_eq!(std::fs::read(old.join(STATE_FILE)).unwrap(), b"new");
        assert!(!new.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
