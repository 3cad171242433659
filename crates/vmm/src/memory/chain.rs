//! Guest RAM as a chain of memory files: a full one at the bottom, and the diffs above it,
//! each holding only the pages written since the snapshot below. A copy-on-write restore maps
//! them in order (see [`crate::memory::ram::GuestRam::copy_on_write_chain`]); a page is read
//! from the newest layer that holds it.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use mayfly_snapshot::{Extent, VmState, MEMORY_LAYERS_DIR};

/// How a chain names a layer that is a fork's sealed memfd, not a file of a snapshot
/// directory: as the kernel names the memfd in /proc/PID/fd (a full path, as a state's
/// memory layers must be outside `memory-layers/`).
pub const FORK_LAYER_PATH: &str = "/memfd:mayfly-guest-ram";

/// One memory file of the chain a copy-on-write VM's RAM maps.
#[derive(Debug)]
pub struct ChainLayer {
    pub file: File,
    /// Its full path as this VMM opened it (how a diff that cannot link it names it).
    pub path: PathBuf,
    /// The ID in its trailer.
    pub snapshot_id: [u8; 16],
    /// `None` for the bottom layer (all of RAM); the ranges it holds otherwise.
    pub extents: Option<Vec<Extent>>,
    /// Handed over by a fork (a descriptor, not a file of a snapshot directory): a diff
    /// snapshot cannot link it.
    pub from_fork: bool,
}

/// Open the chain a snapshot's state names (for a diff; a full snapshot is a chain of one):
/// each layer's trailer checked against its ID. `top` is the snapshot's own memory file.
/// Layers named by full path must lie in `within`, when given.
pub fn open_chain(
    state: &VmState,
    snapshot_dir: &Path,
    top: File,
    within: Option<&Path>,
) -> Result<Vec<ChainLayer>, String> {
    let snapshot_dir = std::path::absolute(snapshot_dir).map_err(|e| e.to_string())?;
    let mut chain = Vec::with_capacity(state.memory_layers.len() + 1);
    for layer in &state.memory_layers {
        let path = if layer.path.is_relative() {
            let name = mayfly_snapshot::layer_name(&layer.path).ok_or_else(|| {
                format!("the memory layer {:?} is outside its directory", layer.path)
            })?;
            // Resolved strictly beneath the snapshot's directory: a symbolic link in
            // memory-layers/ that leads out of it is refused.
            let (_, real) =
                mayfly_sys::beneath::open(&snapshot_dir, &Path::new(MEMORY_LAYERS_DIR).join(name))
                    .map_err(|e| {
                        format!(
                            "its memory layer {} cannot be opened inside the snapshot ({e})",
                            layer.path.display()
                        )
                    })?;
            real
        } else {
            let real = std::fs::canonicalize(&layer.path).map_err(|e| {
                format!(
                    "its memory layer {} cannot be opened ({e}): a diff snapshot needs the \
                     snapshot it was taken over",
                    layer.path.display()
                )
            })?;
            if let Some(within) = within {
                let outside = || {
                    format!(
                        "its memory layer {} lies outside {}, where this restore was told its \
                         layers are",
                        layer.path.display(),
                        within.display()
                    )
                };
                let within_real = std::fs::canonicalize(within).map_err(|e| e.to_string())?;
                let rest = layer
                    .path
                    .strip_prefix(within)
                    .or_else(|_| layer.path.strip_prefix(&within_real))
                    .map_err(|_| outside())?;
                let (_, beneath) =
                    mayfly_sys::beneath::open(&within_real, rest).map_err(|_| outside())?;
                beneath
            } else {
                real
            }
        };
        let file = mayfly_snapshot::open_regular(&path).map_err(|e| e.to_string())?;
        mayfly_snapshot::check_trailer(
            &file,
            state.mem_bytes,
            &layer.snapshot_id,
            &path.display().to_string(),
        )
        .map_err(|e| e.to_string())?;
        chain.push(ChainLayer {
            file,
            path,
            snapshot_id: layer.snapshot_id,
            extents: layer.extents.clone(),
            from_fork: false,
        });
    }
    chain.push(ChainLayer {
        file: top,
        path: snapshot_dir.join(mayfly_snapshot::MEMORY_FILE),
        snapshot_id: state.snapshot_id,
        extents: state.memory_extents.clone(),
        from_fork: false,
    });
    Ok(chain)
}

/// Whether `file` carries every seal of `wanted` (`F_SEAL_*`; a file that cannot be sealed
/// carries none).
pub fn has_seals(file: &File, wanted: libc::c_int) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: fcntl on a descriptor the caller owns; it only reads its seals.
    let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    seals >= 0 && seals & wanted == wanted
}

/// Whether `file` is sealed against writes (a fork's memfd): nothing can change it.
pub fn is_sealed(file: &File) -> bool {
    has_seals(file, libc::F_SEAL_WRITE)
}

/// Refuse a descriptor that cannot read its file (O_PATH, write-only): reopened by a more
/// privileged process to be read, it would read what its holder could not.
pub fn check_readable(file: &File) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: fcntl on a descriptor the caller owns; it only reads its flags.
    let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if flags & libc::O_PATH != 0 || flags & libc::O_ACCMODE == libc::O_WRONLY {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            "a memory file handed over on a descriptor that cannot read it",
        ));
    }
    Ok(())
}

/// Whether only `uid` may write `meta`'s file: a regular file of its, that neither its group
/// nor others may write.
pub fn written_only_by(meta: &std::fs::Metadata, uid: u32) -> bool {
    use std::os::unix::fs::MetadataExt;
    meta.file_type().is_file() && meta.uid() == uid && meta.mode() & 0o022 == 0
}

/// A description of this process's own, read-only, of the file a fork handed over as `file`
/// (the snapshot its parent maps): reopened through /proc/self/fd, checked to be the same
/// file. A description is shared by all who hold it (its flags, who its lease warns), so a
/// clone does not keep its parent's. A descriptor that cannot read (O_PATH, write-only) is
/// refused: reopened, it would read what its holder could not.
pub fn reopen_handed(file: &File) -> std::io::Result<File> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::MetadataExt;
    check_readable(file)?;
    let reopened = File::open(format!("/proc/self/fd/{}", file.as_raw_fd()))?;
    let (was, is) = (file.metadata()?, reopened.metadata()?);
    if (was.dev(), was.ino()) != (is.dev(), is.ino()) || !is.file_type().is_file() {
        return Err(std::io::Error::other(
            "a memory file handed over is not the file its descriptor reopens",
        ));
    }
    Ok(reopened)
}

/// The newest layer of `chain` that holds the page at `offset` (the bottom holds all).
pub fn layer_holding(chain: &[ChainLayer], offset: u64) -> Option<&ChainLayer> {
    chain.iter().rev().find(|layer| match &layer.extents {
        None => true,
        Some(extents) => {
            let i = extents.partition_point(|e| e.end() <= offset);
            extents.get(i).is_some_and(|e| e.offset <= offset)
        }
    })
}

/// Read one page at `offset` of guest RAM from the newest layer of `chain` that holds it.
pub fn read_chain_page(chain: &[ChainLayer], offset: u64, page: &mut [u8]) -> std::io::Result<()> {
    match layer_holding(chain, offset) {
        Some(layer) => layer.file.read_exact_at(page, offset),
        None => {
            page.fill(0);
            Ok(())
        }
    }
}
