//! Where the files a create names may be: the images directories (`mayfly serve
//! --images-dir`, default `<state-dir>/images`). A create's kernel, initrd, root filesystem
//! and snapshot (and a template's) are read by root before any jail, so each must be beneath
//! one of them, reached without a symbolic link (openat2 with `RESOLVE_BENEATH` and
//! `RESOLVE_NO_SYMLINKS`), and be a regular file; a snapshot a directory holding nothing but
//! directories and regular files. Anything else is refused (400) before it is read.

use std::path::{Component, Path, PathBuf};

use mayfly_devices::state::VirtioKindState;

use crate::error::ServeError;

/// The most entries a snapshot directory may hold (a snapshot has a handful; a tree of
/// millions would only make the walk long).
const MAX_SNAPSHOT_ENTRIES: usize = 10_000;

/// The images directories of a manager.
pub struct Images {
    dirs: Vec<PathBuf>,
}

impl Images {
    pub fn new(dirs: Vec<PathBuf>) -> Images {
        Images { dirs }
    }

    /// How the directories read in an error.
    fn named(&self) -> String {
        self.dirs
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Open `path` (the create's `what`) beneath the images directory it is in, following no
    /// link; returns what it resolved to.
    fn open(&self, what: &str, path: &Path) -> Result<(std::fs::File, PathBuf), ServeError> {
        let outside = || {
            ServeError::BadRequest(format!(
                "\"{what}\": {} is not in an images directory of this manager ({}): it reads \
                 only files under the directories given by mayfly serve --images-dir (default \
                 <state-dir>/images), named by their own absolute path with no symbolic link \
                 and no \"..\"",
                path.display(),
                self.named()
            ))
        };
        if !path.is_absolute()
            || path
                .components()
                .any(|c| matches!(c, Component::ParentDir | Component::CurDir))
        {
            return Err(outside());
        }
        let Some((dir, rest)) = self
            .dirs
            .iter()
            .find_map(|dir| Some((dir, path.strip_prefix(dir).ok()?)))
        else {
            return Err(outside());
        };
        if rest.as_os_str().is_empty() {
            return Err(outside());
        }
        mayfly_sys::beneath::open_no_links(dir, rest).map_err(|e| match e.raw_os_error() {
            Some(libc::ENOENT) => {
                ServeError::BadRequest(format!("\"{what}\": {} does not exist", path.display()))
            }
            Some(libc::ELOOP | libc::EXDEV) => ServeError::BadRequest(format!(
                "\"{what}\": {} is reached through a symbolic link, which the manager does not \
                 follow in its images directories ({}): name the file itself",
                path.display(),
                self.named()
            )),
            _ => ServeError::BadRequest(format!(
                "\"{what}\": {} cannot be opened in the images directory {}: {e}",
                path.display(),
                dir.display()
            )),
        })
    }

    /// A file a create names (kernel, initrd, root filesystem image): a regular file beneath
    /// an images directory, reached without links.
    pub fn check_file(&self, what: &str, path: &Path) -> Result<(), ServeError> {
        let (file, _) = self.open(what, path)?;
        let meta = file.metadata().map_err(|source| ServeError::Io {
            what: "check",
            path: path.display().to_string(),
            source,
        })?;
        if !meta.is_file() {
            return Err(ServeError::BadRequest(format!(
                "\"{what}\": {} is not a regular file",
                path.display()
            )));
        }
        Ok(())
    }

    /// A snapshot a create names: a directory beneath an images directory, reached without
    /// links, holding only directories and regular files (root links and reads them).
    pub fn check_snapshot(&self, path: &Path) -> Result<(), ServeError> {
        let (dir, real) = self.open("snapshot", path)?;
        let meta = dir.metadata().map_err(|source| ServeError::Io {
            what: "check",
            path: path.display().to_string(),
            source,
        })?;
        if !meta.is_dir() {
            return Err(ServeError::BadRequest(format!(
                "\"snapshot\": {} is not a directory (a snapshot is the directory `mayfly \
                 snapshot` writes)",
                path.display()
            )));
        }
        let mut seen = 0usize;
        walk_plain(&real, &mut seen).map_err(|problem| {
            ServeError::BadRequest(format!(
                "\"snapshot\": {}: {problem}: a snapshot holds only directories and regular \
                 files",
                path.display()
            ))
        })?;
        self.check_state(path)
    }

    /// The files a snapshot's state names by full path (its disks' bases, disk layers and
    /// memory layers kept outside it): the VMM restoring it opens them as root, checking only
    /// that they match what the same state recorded, so each must pass [`Self::check_file`].
    /// Names relative to the snapshot are opened beneath it by the VMM.
    fn check_state(&self, snapshot: &Path) -> Result<(), ServeError> {
        let shown = snapshot.join(mayfly_snapshot::STATE_FILE);
        let (file, _) = self.open("snapshot", &shown)?;
        let unreadable = |problem: String| {
            ServeError::BadRequest(format!(
                "\"snapshot\": {}: {problem}: a snapshot's state is the file `mayfly snapshot` \
                 writes",
                shown.display()
            ))
        };
        let meta = file
            .metadata()
            .map_err(|e| unreadable(format!("cannot check it: {e}")))?;
        if !meta.is_file() {
            return Err(unreadable("not a regular file".into()));
        }
        let (_, state): (_, mayfly_snapshot::VmState) =
            mayfly_snapshot::read_state(&file, &shown).map_err(|e| unreadable(e.to_string()))?;
        for device in &state.devices.virtio {
            let VirtioKindState::Block(block) = &device.device else {
                continue;
            };
            let serial = &block.serial;
            self.check_file(
                &format!("snapshot: the base of disk {serial}"),
                &block.chain.base,
            )?;
            for layer in block.chain.layers.iter().filter(|l| l.is_absolute()) {
                self.check_file(&format!("snapshot: a layer of disk {serial}"), layer)?;
            }
        }
        for layer in state.memory_layers.iter().filter(|l| l.path.is_absolute()) {
            self.check_file("snapshot: memory layer", &layer.path)?;
        }
        Ok(())
    }
}

/// Check every entry under `dir` is a directory or a regular file (links are not followed).
fn walk_plain(dir: &Path, seen: &mut usize) -> Result<(), String> {
    let entries =
        std::fs::read_dir(dir).map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
    for entry in entries {
        let entry = entry.map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
        *seen += 1;
        if *seen > MAX_SNAPSHOT_ENTRIES {
            return Err(format!("it holds more than {MAX_SNAPSHOT_ENTRIES} entries"));
        }
        let kind = entry
            .file_type()
            .map_err(|e| format!("cannot check {}: {e}", entry.path().display()))?;
        if kind.is_dir() {
            walk_plain(&entry.path(), seen)?;
        } else if !kind.is_file() {
            return Err(format!(
                "{} is not a regular file or directory",
                entry.path().display()
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_files_beneath_an_images_dir_pass() {
        let root = std::env::temp_dir().join(format!("mayfly-images-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let images = root.join("images");
        std::fs::create_dir_all(images.join("snap/sub")).unwrap();
        std::fs::write(images.join("kernel"), b"k").unwrap();
        std::fs::write(images.join("snap/sub/f"), b"f").unwrap();
        std::fs::write(root.join("secret"), b"s").unwrap();
        std::os::unix::fs::symlink(root.join("secret"), images.join("out")).unwrap();
        std::os::unix::fs::symlink("kernel", images.join("near")).unwrap();
        let check = Images::new(vec![images.clone()]);
        assert!(check.check_file("kernel", &images.join("kernel")).is_ok());
        // A tree of plain files is not yet a snapshot: its state is read for the files it names.
        let e = check.check_snapshot(&images.join("snap")).unwrap_err();
        assert!(e.to_string().contains("state"), "{e}");
        for bad in [
            root.join("secret"),
            images.join("out"),
            images.join("near"),
            images.join("../secret"),
            images.join("snap"),
            PathBuf::from("kernel"),
            images.clone(),
        ] {
            let e = check.check_file("kernel", &bad).unwrap_err();
            assert_eq!(e.status(), 400, "{bad:?}: {e}");
        }
        std::os::unix::fs::symlink("/proc/self", images.join("snap/sub/proc")).unwrap();
        let e = check.check_snapshot(&images.join("snap")).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        assert_eq!(
            check
                .check_snapshot(Path::new("/proc/self"))
                .unwrap_err()
                .status(),
            400
        );
        let _ = std::fs::remove_dir_all(&root);
    }
}
