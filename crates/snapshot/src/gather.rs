//! Making a snapshot directory self-contained: the layers its state names by full path (a
//! disk's copy-on-write layers, a diff snapshot's memory layers, where the VMM that wrote it
//! left them) hard-linked into the directory and named there. For the sandbox manager, which
//! makes a fork's base of a sandbox's snapshot and must not depend on the sandbox's own files.

use std::path::{Path, PathBuf};

use crate::layout::DISKS_DIR;

/// Why a snapshot cannot be made self-contained.
#[derive(Debug, thiserror::Error)]
pub enum GatherError {
    #[error("cannot make the snapshot {path} self-contained: {reason}")]
    Gather { path: PathBuf, reason: String },
    #[error("the snapshot names the disk layer {layer}, outside {within}, where the layers of this restore must be (a snapshot written by a VMM the restorer does not trust)")]
    LayerOutside { layer: PathBuf, within: PathBuf },
    #[error("the snapshot names the disk layer {0:?}, which is not a file of its disks/ directory: the snapshot is damaged or was edited")]
    BadLayerName(String),
    #[error("cannot {what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> GatherError {
    move |source| GatherError::Io {
        what: what.into(),
        source,
    }
}

/// Make a snapshot directory self-contained (but for its disks' bases): hard-link every layer
/// its state names by full path (as the VMM's snapshot writer does) into its `disks/` (a diff
/// snapshot's memory layers into its `memory-layers/`, see the VMM's diff snapshots), name them there,
/// and replace its state file (a new file, renamed over the old, so other links to the old
/// one are untouched). Every such layer must lie in `within` (symbolic links resolved): the
/// snapshot was written by a VMM whose own directory that is. For the sandbox manager, which
/// makes a fork base of a sandbox's snapshot; it runs as root, which may link any file.
pub fn gather_layers(snapshot: &Path, within: &Path) -> Result<usize, GatherError> {
    use mayfly_devices::state::VirtioKindState;

    let state_path = snapshot.join(crate::layout::STATE_FILE);
    let gather = |reason: String| GatherError::Gather {
        path: snapshot.to_path_buf(),
        reason,
    };
    let (header, mut state): (_, crate::state::VmState) =
        crate::file::read_state_file(&state_path).map_err(|e| gather(e.to_string()))?;
    let within =
        std::fs::canonicalize(within).map_err(io(format!("resolve {}", within.display())))?;
    let mut gathered = 0;
    for device in &mut state.devices.virtio {
        let VirtioKindState::Block(block) = &mut device.device else {
            continue;
        };
        for layer in &mut block.chain.layers {
            if layer.is_relative() {
                continue;
            }
            *layer = gather_one(layer, &within, snapshot, DISKS_DIR, None)?;
            gathered += 1;
        }
    }
    // The memory layers a diff snapshot names by full path, the same way.
    for layer in &mut state.memory_layers {
        if layer.path.is_relative() {
            continue;
        }
        let name = crate::state::layer_file_name(&layer.snapshot_id);
        layer.path = gather_one(
            &layer.path,
            &within,
            snapshot,
            crate::state::MEMORY_LAYERS_DIR,
            Some(name),
        )?;
        gathered += 1;
    }
    if gathered > 0 {
        let tmp = snapshot.join(".state.new");
        crate::file::write_state_file(&tmp, &header, &state).map_err(|e| gather(e.to_string()))?;
        std::fs::rename(&tmp, &state_path)
            .map_err(io(format!("replace {}", state_path.display())))?;
    }
    Ok(gathered)
}

/// For [`gather_layers`]: hard-link `layer` (a full path, which must lie in `within`, symbolic
/// links resolved) into `snapshot`'s `subdir` as `name` (by default its own file name), and
/// return its name relative to the snapshot.
fn gather_one(
    layer: &Path,
    within: &Path,
    snapshot: &Path,
    subdir: &str,
    name: Option<String>,
) -> Result<PathBuf, GatherError> {
    let real = std::fs::canonicalize(layer)
        .ok()
        .filter(|real| real.starts_with(within))
        .ok_or_else(|| GatherError::LayerOutside {
            layer: layer.to_path_buf(),
            within: within.to_path_buf(),
        })?;
    let name = match name {
        Some(name) => std::ffi::OsString::from(name),
        None => real
            .file_name()
            .ok_or_else(|| GatherError::BadLayerName(real.display().to_string()))?
            .to_owned(),
    };
    let dir = snapshot.join(subdir);
    if !dir.exists() {
        std::fs::create_dir(&dir).map_err(io(format!("create {}", dir.display())))?;
    }
    match std::fs::hard_link(&real, dir.join(&name)) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io(format!("link {} into the snapshot", real.display()))(e)),
    }
    Ok(Path::new(subdir).join(name))
}
