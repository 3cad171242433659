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
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use mayfly_snapshot::{Header, MemoryRange, VmState, MEMORY_FILE, STATE_FILE};

use crate::arch::kvm_state::{self, StateError};
use crate::memory::{data_extents, GuestRam, RamKind};
use crate::vm::Vm;

const PAGE: usize = 4096;

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

fn write_snapshot(
    vm: &Vm,
    dir: &Path,
    start: Instant,
) -> Result<SnapshotReport, SnapshotCreateError> {
    let mut vcpus = Vec::with_capacity(vm.vcpus.len());
    for vcpu in &vm.vcpus {
        let caps = vm.caps.clone();
        let state = vcpu
            .run_job(move |fd| kvm_state::save_vcpu(fd, &caps))
            .ok_or(SnapshotCreateError::VcpuGone(vcpu.index))??;
        vcpus.push(state);
    }
    let vm_state = kvm_state::save_vm(&vm.fd)?;
    let serial = mayfly_devices::bus::lock(&vm.devices.serial).state();
    let state_ms = start.elapsed().as_secs_f64() * 1e3;

    let memory_path = dir.join(MEMORY_FILE);
    let written = write_memory(&vm.ram, &memory_path)?;
    let memory_ms = start.elapsed().as_secs_f64() * 1e3 - state_ms;

    let working_set = match (&vm.lazy, vm.ram.kind) {
        (Some(lazy), _) => lazy.working_set(),
        (None, RamKind::CopyOnWrite) => written.touched,
        _ => Vec::new(),
    };
    let state = VmState {
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
        vm: vm_state,
        serial,
        working_set,
    };
    let header = Header {
        arch: std::env::consts::ARCH.to_string(),
        fingerprint: kvm_state::host_fingerprint(&vm.caps),
        created_unix_ms: kvm_state::realtime_ns() / 1_000_000,
        writer: format!("mayfly {}", env!("CARGO_PKG_VERSION")),
    };
    let state_path = dir.join(STATE_FILE);
    mayfly_snapshot::write_state_file(&state_path, &header, &state)?;
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

struct MemoryWritten {
    bytes: u64,
    /// Offsets of the pages this process had mapped (for a copy-on-write VM: what the guest
    /// touched since it was restored).
    touched: Vec<u64>,
}

fn is_zero(bytes: &[u8]) -> bool {
    // SAFETY: reinterpreting initialised bytes as u128 words is always valid.
    let (head, words, tail) = unsafe { bytes.align_to::<u128>() };
    head.iter().all(|&b| b == 0) && words.iter().all(|&w| w == 0) && tail.iter().all(|&b| b == 0)
}

/// Which pages of `addr..addr + len` this process has mapped (/proc/self/pagemap bit 63).
fn present_pages(addr: *const u8, len: usize) -> std::io::Result<Vec<bool>> {
    let pagemap = File::open("/proc/self/pagemap")?;
    let pages = len / PAGE;
    let mut present = Vec::with_capacity(pages);
    let mut buf = vec![0u8; 8 * 4096];
    let first = addr as u64 / PAGE as u64;
    let mut done = 0usize;
    while done < pages {
        let n = (pages - done).min(buf.len() / 8);
        pagemap.read_exact_at(&mut buf[..n * 8], (first + done as u64) * 8)?;
        present.extend(
            buf[..n * 8]
                .chunks_exact(8)
                .map(|e| u64::from_le_bytes(e.try_into().expect("8 bytes")) >> 63 == 1),
        );
        done += n;
    }
    Ok(present)
}

/// Write guest RAM to `path`, skipping pages of zeros (the file stays sparse there).
fn write_memory(ram: &GuestRam, path: &Path) -> Result<MemoryWritten, SnapshotCreateError> {
    let out = File::create(path).map_err(io_err(path))?;
    out.set_len(ram.size()).map_err(io_err(path))?;
    let mut written = MemoryWritten {
        bytes: 0,
        touched: Vec::new(),
    };
    let mut page_buf = vec![0u8; PAGE];
    for region in ram.host_regions() {
        let present = present_pages(region.host_addr, region.len).map_err(io_err(path))?;
        let extents = data_extents(&ram.backing, region.file_offset, region.len as u64)
            .map_err(io_err(path))?;
        // Pages come in increasing order: walk the extents alongside.
        let mut extent = 0usize;
        let mut in_backing = |offset: u64| {
            while extent < extents.len() && extents[extent].0 + extents[extent].1 <= offset {
                extent += 1;
            }
            extent < extents.len() && extents[extent].0 <= offset
        };
        // Consecutive non-zero mapped pages go out in one write.
        let mut run: Option<(usize, usize)> = None;
        let flush = |run: &mut Option<(usize, usize)>, written: &mut MemoryWritten| {
            if let Some((first, count)) = run.take() {
                // SAFETY: the run lies inside the region's mapping, and the vCPUs are paused.
                let bytes = unsafe {
                    std::slice::from_raw_parts(region.host_addr.add(first * PAGE), count * PAGE)
                };
                out.write_all_at(bytes, region.file_offset + (first * PAGE) as u64)?;
                written.bytes += bytes.len() as u64;
            }
            Ok::<(), std::io::Error>(())
        };
        for (page, &mapped) in present.iter().enumerate() {
            let offset = region.file_offset + (page * PAGE) as u64;
            if mapped {
                if ram.kind == RamKind::CopyOnWrite {
                    written.touched.push(offset);
                }
                // SAFETY: a mapped page inside the region; the vCPUs are paused.
                let bytes =
                    unsafe { std::slice::from_raw_parts(region.host_addr.add(page * PAGE), PAGE) };
                if !is_zero(bytes) {
                    match &mut run {
                        Some((first, count)) if *first + *count == page => *count += 1,
                        _ => {
                            flush(&mut run, &mut written).map_err(io_err(path))?;
                            run = Some((page, 1));
                        }
                    }
                    continue;
                }
            } else if in_backing(offset) {
                // Not mapped here: the page is what the backing file holds.
                ram.backing
                    .read_exact_at(&mut page_buf, offset)
                    .map_err(io_err(path))?;
                if !is_zero(&page_buf) {
                    flush(&mut run, &mut written).map_err(io_err(path))?;
                    out.write_all_at(&page_buf, offset).map_err(io_err(path))?;
                    written.bytes += PAGE as u64;
                    continue;
                }
            }
            flush(&mut run, &mut written).map_err(io_err(path))?;
        }
        flush(&mut run, &mut written).map_err(io_err(path))?;
    }
    out.sync_all().map_err(io_err(path))?;
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::layout::ram_ranges;

    #[test]
    fn zero_detection() {
        let mut page = vec![0u8; PAGE];
        assert!(is_zero(&page));
        page[PAGE - 1] = 1;
        assert!(!is_zero(&page));
        assert!(is_zero(&page[1..PAGE - 1]));
    }

    #[test]
    fn memory_file_holds_every_non_zero_page_and_nothing_else() {
        let dir = std::env::temp_dir().join(format!("mayfly-snap-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ram = GuestRam::new_memfd(4 << 20).unwrap();
        let region = ram.host_regions()[0];
        // SAFETY: inside the 4 MiB mapping this test owns.
        unsafe {
            *region.host_addr.add(8192) = 0xaa; // page 2: data
            std::ptr::write_bytes(region.host_addr.add(3 * PAGE), 0, PAGE); // page 3: touched zeros
        }
        // A page present only in the backing file (written through the fd, never mapped).
        ram.backing
            .write_all_at(&[0xbb; 16], (100 * PAGE) as u64)
            .unwrap();

        let path = dir.join("memory");
        let written = write_memory(&ram, &path).unwrap();
        assert_eq!(written.bytes, 2 * PAGE as u64);
        let file = File::open(&path).unwrap();
        assert_eq!(file.metadata().unwrap().len(), 4 << 20);
        let mut byte = [0u8; 1];
        file.read_exact_at(&mut byte, 8192).unwrap();
        assert_eq!(byte, [0xaa]);
        file.read_exact_at(&mut byte, (100 * PAGE) as u64).unwrap();
        assert_eq!(byte, [0xbb]);
        let data: u64 = data_extents(&file, 0, 4 << 20)
            .unwrap()
            .iter()
            .map(|e| e.1)
            .sum();
        assert!(data < (1 << 20), "the file is sparse: {data} bytes of data");

        // A copy-on-write view of that file reads the same, and records what it touched.
        let cow = GuestRam::copy_on_write(file, &ram_ranges(4 << 20)).unwrap();
        let cow_region = cow.host_regions()[0];
        // SAFETY: inside the mapping.
        unsafe { *cow_region.host_addr.add(5 * PAGE) = 0xcc };
        let again = write_memory(&cow, &dir.join("memory2")).unwrap();
        assert_eq!(again.bytes, 3 * PAGE as u64);
        assert!(again.touched.contains(&((5 * PAGE) as u64)));
        std::fs::remove_dir_all(&dir).unwrap();
    }

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
