//! Diff snapshots: guest RAM as a chain of memory files, and a snapshot that writes only the
//! pages written since the snapshot the VM was restored from.
//!
//! - A copy-on-write restore maps the bottom (full) memory file over all of guest RAM, then
//!   each later layer's extents over it, file-backed and private ([`GuestRam::copy_on_write_chain`]).
//!   Pages the guest (through KVM) or the VMM (a device writing a buffer) write become
//!   anonymous copies; pages only read stay the files'. So the kernel's page table says
//!   exactly which pages changed since the restore: /proc/self/pagemap, a present page that
//!   is not a file page, or a swapped one ([`GuestRam::written_extents`]). Nothing has to
//!   track writes while the VM runs (no KVM dirty log, no VMM-side bitmap).
//! - A diff snapshot ([`write_diff`]) writes those pages into its `memory` (sparse: a page of
//!   zeros stays a hole, but is in the extents) and hard-links the chain under it into its
//!   `memory-layers/`, so it is self-contained. A layer this process may not link (the sandbox
//!   manager's templates are root's and read-only; `protected_hardlinks` refuses a link to
//!   such a file) is named by its full path instead, as disk layers are, and a restore checks
//!   that path against `--disk-layers-within`.
//! - The chain is compacted when it would grow past [`COMPACT_AT`] layers or
//!   [`MAX_MEMORY_EXTENTS`](mayfly_snapshot::MAX_MEMORY_EXTENTS) extents: the new diff then
//!   holds every page that differs from the bottom layer, read from the VM's RAM, and stacks
//!   on the bottom alone. Compaction costs one write of the VM's changed pages, never a copy
//!   of the bottom.
//! - A fork of such a VM hands its clones the same two layers without writing a file
//!   ([`GuestRam::freeze_layered`]): the bottom as it is, and a sealed memfd of every page that
//!   differs from it.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use mayfly_snapshot::{Extent, MemoryLayer, VmState, MEMORY_LAYERS_DIR};

use crate::memory::chain::ChainLayer;
use crate::memory::ram::{memfd, seal_base, GuestRam, MemoryError, RamKind, PAGE};

/// Layers a chain keeps at most below a new diff: one more and the diff compacts.
pub const COMPACT_AT: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum DiffError {
    #[error("a diff snapshot needs a VM restored copy-on-write from a snapshot directory (this one {0}): take a full snapshot")]
    NotLayered(&'static str),
    #[error("the memory layer {path} cannot be linked into the snapshot ({source}), and naming it by its path will not do (it is not the file this VM maps any more, or it is in the snapshot being replaced): take a full snapshot")]
    Unlinkable {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot {what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> DiffError {
    let what = what.into();
    move |source| DiffError::Io { what, source }
}

/// What [`write_diff`] did.
#[derive(Debug)]
pub struct DiffWritten {
    /// Bytes of memory written (non-zero pages).
    pub bytes: u64,
    /// Layers the new diff stacks on.
    pub layers: usize,
    /// Whether the chain was compacted.
    pub compacted: bool,
}

/// Union of two sorted lists of disjoint extents, adjacent ones merged.
pub fn union(a: &[Extent], b: &[Extent]) -> Vec<Extent> {
    let mut all: Vec<Extent> = a.iter().chain(b).copied().collect();
    all.sort_by_key(|e| e.offset);
    let mut out: Vec<Extent> = Vec::with_capacity(all.len());
    for e in all {
        match out.last_mut() {
            Some(last) if e.offset <= last.end() => {
                let end = last.end().max(e.end());
                last.len = end - last.offset;
            }
            _ => out.push(e),
        }
    }
    out
}

/// Merge extents across their smallest gaps until at most `max` are left (the pages in the
/// gaps are written too: a diff may hold pages that did not change).
pub fn coalesce(mut extents: Vec<Extent>, max: usize) -> Vec<Extent> {
    let mut gap = PAGE as u64;
    while extents.len() > max.max(1) {
        let mut out: Vec<Extent> = Vec::with_capacity(extents.len());
        for e in extents {
            match out.last_mut() {
                Some(last) if e.offset - last.end() <= gap => last.len = e.end() - last.offset,
                _ => out.push(e),
            }
        }
        extents = out;
        gap *= 2;
    }
    extents
}

/// At most this many ranges hold a fork's own pages above its source's memory files
/// ([`GuestRam::freeze_layered`]): each is a mapping of its own in the zygote and in every
/// clone (fork copies them), so the pages in the smallest gaps between the ranges are copied
/// too rather than map more.
pub const FORK_MAX_EXTENTS: usize = 512;

impl GuestRam {
    /// Freeze a copy-on-write VM's RAM for its clones without copying the snapshot file it
    /// maps: that file (the bottom of its chain) as it is, and on top a new sealed memfd
    /// holding every page that differs from it (the pages this VM wrote since it mapped them,
    /// [`GuestRam::written_extents`], and those the layers above the bottom hold, read as the
    /// VM sees them now; merged into at most [`FORK_MAX_EXTENTS`] ranges). This VM's own
    /// mapping stays as it is. Returns the two layers and the bytes copied; `None` when RAM is
    /// not mapped from a snapshot file (a memfd, a lazy restore, a fork's base) or
    /// `bottom_ok` refuses the file: then [`GuestRam::freeze`] copies it all into one base.
    /// The vCPUs must be paused.
    ///
    /// Why: the pause of a fork's source is this copy. A template-restored probe of 128 MiB
    /// paused 125 ms for [`GuestRam::freeze`]'s full copy (130 MB), on this project's host.
    /// Why only the bottom: a clone must hold nothing of its parent's past that its parent no
    /// longer holds. The layers above the bottom (a woken sandbox's earlier diffs, a fork's
    /// pages) hold such pages, and so does a fork's base (a memfd: its parent's memory when
    /// it was forked); the snapshot at the bottom is what the VM was restored from (the
    /// sandbox manager's template).
    pub fn freeze_layered(
        &self,
        snapshot_id: &[u8; 16],
        bottom_ok: impl Fn(&File) -> bool,
    ) -> Result<Option<(Vec<ChainLayer>, u64)>, MemoryError> {
        let Some(bottom) = self.chain.first() else {
            return Ok(None);
        };
        if self.kind != RamKind::CopyOnWrite
            || bottom.extents.is_some()
            || crate::memory::chain::is_sealed(&bottom.file)
            || !bottom_ok(&bottom.file)
        {
            return Ok(None);
        }
        let mut differ = self.written_extents().map_err(MemoryError::Copy)?;
        for layer in &self.chain[1..] {
            differ = union(&differ, layer.extents.as_deref().unwrap_or(&[]));
        }
        let differ = coalesce(differ, FORK_MAX_EXTENTS);
        let top = memfd(self.size())?;
        let copied = self.write_pages(&top, &differ).map_err(MemoryError::Copy)?;
        mayfly_snapshot::write_trailer(&top, self.size(), snapshot_id)
            .map_err(MemoryError::Copy)?;
        seal_base(&top)?;
        let layers = vec![
            ChainLayer {
                file: bottom.file.try_clone().map_err(MemoryError::Memfd)?,
                path: bottom.path.clone(),
                snapshot_id: bottom.snapshot_id,
                extents: None,
                from_fork: bottom.from_fork,
            },
            ChainLayer {
                file: top,
                path: crate::memory::chain::FORK_LAYER_PATH.into(),
                snapshot_id: *snapshot_id,
                extents: Some(differ),
                from_fork: true,
            },
        ];
        Ok(Some((layers, copied)))
    }
}

/// Link `layer` into `dir` as `name`: through /proc/self/fd (exactly the file this VM maps,
/// whatever its name now is), else by its path, checked to be the same file once linked
/// (a descriptor opened before the jail was entered is on another mount: EXDEV). `Ok(false)`
/// when the kernel refuses both (another owner's file) but the path still names the file and
/// lies outside `replacing` (the snapshot the new one replaces): the caller names it by path.
fn link_layer(
    layer: &ChainLayer,
    dir: &Path,
    name: &str,
    replacing: &Path,
) -> Result<bool, DiffError> {
    use std::os::unix::ffi::OsStrExt;
    let target = dir.join(name);
    let fd_path = format!("/proc/self/fd/{}", layer.file.as_raw_fd());
    let c_from = std::ffi::CString::new(fd_path).expect("no NUL");
    let c_to = std::ffi::CString::new(target.as_os_str().as_bytes())
        .map_err(|_| io("name a memory layer")(std::io::ErrorKind::InvalidInput.into()))?;
    // SAFETY: two valid NUL-terminated paths; the result is checked.
    let rc = unsafe {
        libc::linkat(
            libc::AT_FDCWD,
            c_from.as_ptr(),
            libc::AT_FDCWD,
            c_to.as_ptr(),
            libc::AT_SYMLINK_FOLLOW,
        )
    };
    if rc == 0 {
        return Ok(true);
    }
    let meta = layer
        .file
        .metadata()
        .map_err(io(format!("stat {}", layer.path.display())))?;
    let same_file = |path: &Path| {
        std::fs::symlink_metadata(path)
            .is_ok_and(|m| m.is_file() && m.dev() == meta.dev() && m.ino() == meta.ino())
    };
    let err = if same_file(&layer.path) {
        match std::fs::hard_link(&layer.path, &target) {
            Ok(()) if same_file(&target) => return Ok(true),
            Ok(()) => {
                let _ = std::fs::remove_file(&target);
                std::io::Error::from(std::io::ErrorKind::NotFound)
            }
            Err(e) => e,
        }
    } else {
        std::io::Error::from(std::io::ErrorKind::NotFound)
    };
    let refused = matches!(
        err.raw_os_error(),
        Some(libc::EPERM) | Some(libc::EXDEV) | Some(libc::EACCES)
    );
    // Compared resolved: a layer inside the snapshot being replaced, however spelt, goes with
    // it.
    let resolved = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    if refused
        && layer.path.is_absolute()
        && !resolved(&layer.path).starts_with(resolved(replacing))
        && same_file(&layer.path)
    {
        return Ok(false);
    }
    Err(DiffError::Unlinkable {
        path: layer.path.clone(),
        source: err,
    })
}

/// Whether a diff snapshot of `ram` can be written; why not if not.
pub fn check_layered(ram: &GuestRam) -> Result<(), DiffError> {
    if ram.kind != RamKind::CopyOnWrite {
        return Err(DiffError::NotLayered(match ram.kind {
            RamKind::Lazy => "was restored lazily",
            _ => "has its memory in a memfd: booted, restored eagerly, or a fork's clone",
        }));
    }
    if ram.chain.is_empty() || ram.chain.iter().any(|layer| layer.from_fork) {
        return Err(DiffError::NotLayered("maps memory a fork handed over"));
    }
    Ok(())
}

/// Write guest RAM as a diff snapshot into `dir` (the snapshot's temporary directory): its
/// `memory` file (sized for all of RAM, trailer not yet written) and `memory-layers/`, and
/// fill in `state`'s memory layers. `replacing` is the snapshot directory the new one takes
/// the place of. The vCPUs must be paused.
pub fn write_diff(
    ram: &GuestRam,
    dir: &Path,
    replacing: &Path,
    state: &mut VmState,
) -> Result<DiffWritten, DiffError> {
    check_layered(ram)?;
    let written = ram
        .written_extents()
        .map_err(io("read which pages were written (/proc/self/pagemap)"))?;
    let above: Vec<&ChainLayer> = ram.chain.iter().skip(1).collect();
    let held: usize = above
        .iter()
        .map(|l| l.extents.as_ref().map_or(0, Vec::len))
        .sum();
    let budget = mayfly_snapshot::MAX_MEMORY_EXTENTS;
    let fresh = coalesce(written, budget / 2);
    let compacted = ram.chain.len() > COMPACT_AT || held + fresh.len() > budget;
    let (keep, extents) = if compacted {
        // Everything that differs from the bottom: what the layers above it hold and what
        // was written since.
        let mut all = fresh;
        for layer in &above {
            all = union(&all, layer.extents.as_deref().unwrap_or_default());
        }
        (&ram.chain[..1], coalesce(all, budget / 2))
    } else {
        (&ram.chain[..], fresh)
    };

    let layers_dir = dir.join(MEMORY_LAYERS_DIR);
    std::fs::create_dir(&layers_dir).map_err(io(format!("create {}", layers_dir.display())))?;
    let mut layers = Vec::with_capacity(keep.len());
    for layer in keep {
        let name = mayfly_snapshot::layer_file_name(&layer.snapshot_id);
        let path = if link_layer(layer, &layers_dir, &name, replacing)? {
            Path::new(MEMORY_LAYERS_DIR).join(&name)
        } else {
            layer.path.clone()
        };
        layers.push(MemoryLayer {
            path,
            snapshot_id: layer.snapshot_id,
            extents: layer.extents.clone(),
        });
    }
    let memory_path = dir.join(mayfly_snapshot::MEMORY_FILE);
    let out =
        File::create(&memory_path).map_err(io(format!("create {}", memory_path.display())))?;
    let bytes = ram
        .write_pages(&out, &extents)
        .map_err(io(format!("write {}", memory_path.display())))?;
    state.memory_layers = layers;
    state.memory_extents = Some(extents);
    Ok(DiffWritten {
        bytes,
        layers: keep.len(),
        compacted,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(offset: u64, len: u64) -> Extent {
        Extent { offset, len }
    }

    #[test]
    fn extents_union_and_coalesce() {
        assert_eq!(
            union(
                &[e(0, 4096), e(16384, 4096)],
                &[e(4096, 4096), e(32768, 4096)]
            ),
            vec![e(0, 8192), e(16384, 4096), e(32768, 4096)]
        );
        let many: Vec<Extent> = (0..100).map(|i| e(i * 8192, 4096)).collect();
        let few = coalesce(many.clone(), 10);
        assert!(few.len() <= 10);
        // Every page of the input is still covered.
        for x in &many {
            assert!(few
                .iter()
                .any(|f| f.offset <= x.offset && x.end() <= f.end()));
        }
        assert_eq!(coalesce(many.clone(), 100), many);
    }
}
