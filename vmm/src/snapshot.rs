//! The snapshot path: from a paused VM to a snapshot directory on disk.
//!
//! 1. Read the state of every vCPU (on its own thread), of the VM (interrupt controllers, PIT,
//!    clock) and of the devices.
//! 2. Write guest RAM sparse: a page is written only if it holds something other than zeros.
//!    Pages this process has mapped are read from the mapping; the others from the file behind
//!    guest RAM (see [`GuestRam::backing`]), so pages the guest never touched cost nothing.
//! 3. Write both files into a temporary directory, fsync them, and rename it into place
//!    (exchanging it with an older snapshot of the same name, which is then deleted): an
//!    interrupted snapshot never damages an older one.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Instant;

use mayfly_snapshot::{Header, MemoryRange, VmState, MEMORY_FILE, STATE_FILE};

use crate::arch::kvm_state::{self, StateError};
use crate::memory::RamKind;
use crate::vm::Vm;

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
    #[error("cannot write the snapshot to {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Format(#[from] mayfly_snapshot::SnapshotError),
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
    pub state_ms: f64,
    pub memory_ms: f64,
    pub total_ms: f64,
}

/// Snapshot the (paused) VM into `dest`.
pub fn create(vm: &Vm, dest: &Path) -> Result<SnapshotReport, SnapshotCreateError> {
    let start = Instant::now();
    if !vm.paused {
        return Err(SnapshotCreateError::NotPaused);
    }
    let dest = absolute(dest)?;
    check_replaceable(&dest)?;
    let parent = dest
        .parent()
        .ok_or_else(|| SnapshotCreateError::NoParent(dest.clone()))?;
    let name = dest
        .file_name()
        .ok_or_else(|| SnapshotCreateError::NoParent(dest.clone()))?;
    let tmp = parent.join(format!(
        ".{}.tmp-{}-{}",
        name.to_string_lossy(),
        std::process::id(),
        kvm_state::realtime_ns()
    ));
    std::fs::create_dir(&tmp).map_err(io_err(&tmp))?;
    let result = write_snapshot(vm, &tmp, start).and_then(|report| {
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
    result
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
        if entry.file_name() != STATE_FILE && entry.file_name() != MEMORY_FILE {
            return Err(SnapshotCreateError::NotASnapshotDir {
                path: dest.to_path_buf(),
            });
        }
    }
    Ok(())
}

/// The paused VM's state: every vCPU (read on its own thread), the VM, the devices. The
/// working set is left empty; the memory writer knows it.
pub fn capture_state(vm: &Vm) -> Result<VmState, SnapshotCreateError> {
    let mut vcpus = Vec::with_capacity(vm.vcpus.len());
    for (vcpu, cpuid) in vm.vcpus.iter().zip(&vm.cpuids) {
        let caps = vm.caps.clone();
        let cpuid = cpuid.clone();
        let state = vcpu
            .run_job(move |fd| kvm_state::save_vcpu(fd, &caps, cpuid))
            .ok_or(SnapshotCreateError::VcpuGone(vcpu.index))??;
        vcpus.push(state);
    }
    Ok(VmState {
        vcpu_count: vm.info.vcpu_count,
        mem_bytes: vm.ram.size(),
        cmdline: vm.info.cmdline.clone(),
        memory: vm
            .ram
            .ranges
            .iter()
            .map(|r| MemoryRange {
                guest_addr: r.guest_addr,
                size: r.size,
                file_offset: r.file_offset,
            })
            .collect(),
        vcpus,
        vm: kvm_state::save_vm(&vm.fd)?,
        serial: mayfly_devices::bus::lock(&vm.devices.serial).state(),
        working_set: Vec::new(),
    })
}

/// The state file's header for a snapshot taken on this host now.
pub fn header(vm: &Vm) -> Header {
    Header {
        arch: std::env::consts::ARCH.to_string(),
        fingerprint: kvm_state::host_fingerprint(&vm.caps),
        created_unix_ms: kvm_state::realtime_ns() / 1_000_000,
        writer: format!("mayfly {}", env!("CARGO_PKG_VERSION")),
    }
}

fn write_snapshot(
    vm: &Vm,
    dir: &Path,
    start: Instant,
) -> Result<SnapshotReport, SnapshotCreateError> {
    let mut state = capture_state(vm)?;
    let state_ms = start.elapsed().as_secs_f64() * 1e3;

    let memory_path = dir.join(MEMORY_FILE);
    let memory_file = File::create(&memory_path).map_err(io_err(&memory_path))?;
    let written = vm
        .ram
        .write_sparse(&memory_file)
        .and_then(|w| memory_file.sync_all().map(|()| w))
        .map_err(io_err(&memory_path))?;
    let memory_ms = start.elapsed().as_secs_f64() * 1e3 - state_ms;

    state.working_set = match (&vm.lazy, vm.ram.kind) {
        (Some(lazy), _) => lazy.working_set(),
        (None, RamKind::CopyOnWrite) => written.touched,
        _ => Vec::new(),
    };
    let state_path = dir.join(STATE_FILE);
    mayfly_snapshot::write_state_file(&state_path, &header(vm), &state)?;
    let state_bytes = std::fs::metadata(&state_path)
        .map_err(io_err(&state_path))?
        .len();
    Ok(SnapshotReport {
        path: dir.to_path_buf(),
        state_bytes,
        memory_bytes_written: written.bytes,
        memory_bytes: vm.ram.size(),
        state_ms,
        memory_ms,
        total_ms: 0.0,
    })
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
