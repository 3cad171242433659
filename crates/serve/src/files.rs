//! A sandbox's directory (a template build's alike): its layout, made with its owners and
//! modes; what a jailed VMM wrote checked before root opens it; disk use counted; snapshots
//! linked (a sandbox's base, a fork's) and sealed instead of copied. Root's: `sandbox.json`,
//! `vmm.log`, `console.log`, `sock/vm.sock`; the jail uid's, all its VMM writes: `vm/`
//! (`snap/` its snapshot once it slept, `disks/` its disk layers, `base/` what it came from).

use std::collections::HashSet;
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::error::ServeError;
use crate::util::io_error;

/// A sandbox's own links to the snapshot it was made from, in its `vm/`.
pub const BASE: &str = "base";

/// Its VMM's control socket, in `sock/`: a directory of root's that the jail sees read-only
/// (the VMM's vsock sockets are there too).
pub fn socket(dir: &Path) -> PathBuf {
    dir.join("sock").join("vm.sock")
}

/// What its jailed VMM shares and writes: `vm/`, its uid's, holding its snapshot and its
/// disk layers. Everything else of the sandbox (its record, logs, console) is root's, so
/// nothing a compromised VMM writes can steer what root opens.
pub fn vm_dir(dir: &Path) -> PathBuf {
    dir.join("vm")
}

/// Its snapshot, once it has slept: in `vm/`.
pub fn snapshot_dir(dir: &Path) -> PathBuf {
    vm_dir(dir).join("snap")
}

/// Its VMM's stdout and stderr.
pub fn vmm_log(dir: &Path) -> PathBuf {
    dir.join("vmm.log")
}

/// Its guest's console.
pub fn console_log(dir: &Path) -> PathBuf {
    dir.join("console.log")
}

/// Make a sandbox's (or template's) directories: its own (root's, 0700: record, logs,
/// console), `sock/` (root's, 0755: the jail sees it read-only) and `vm/` (the jail's uid's,
/// 0700: what the jailed VMM writes).
pub fn make_dirs(dir: &Path, jail_uid: Option<u32>) -> Result<(), ServeError> {
    for (path, mode) in [
        (dir.to_path_buf(), 0o700),
        (dir.join("sock"), 0o755),
        (dir.join("vm"), 0o700),
    ] {
        std::fs::create_dir(&path).map_err(io_error("make", &path))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
            .map_err(io_error("set the mode of", &path))?;
    }
    if let Some(uid) = jail_uid {
        let vm = dir.join("vm");
        std::os::unix::fs::chown(&vm, Some(uid), Some(uid))
            .map_err(io_error("give to the jail's uid", &vm))?;
    }
    Ok(())
}

/// Refuse a snapshot (or disk directory) a jailed VMM wrote if anything in it is not a plain
/// directory or file: root opens it next, and a symbolic link planted there would have root
/// open what the link names (another sandbox's snapshot, any file of the host). Nothing of
/// that VMM's uid runs any more when this is called (the VMM is gone, and its uid is its
/// own), so what is checked stays as it is.
pub fn check_plain(path: &Path) -> Result<(), ServeError> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(ServeError::Io {
                what: "check",
                path: path.display().to_string(),
                source,
            })
        }
    };
    if meta.is_file() {
        return Ok(());
    }
    if !meta.is_dir() {
        return Err(ServeError::VmmFailed(format!(
            "{} is not a plain file or directory (a link or device a VMM made?): the sandbox \
             will not be restored from it; delete the sandbox",
            path.display()
        )));
    }
    let entries = std::fs::read_dir(path).map_err(|source| ServeError::Io {
        what: "read",
        path: path.display().to_string(),
        source,
    })?;
    for entry in entries.flatten() {
        check_plain(&entry.path())?;
    }
    Ok(())
}

/// Bytes allocated on disk under `path`, each file counted once however many hard links it
/// has there (sandboxes made from one template or fork share their base's files).
pub fn disk_bytes(path: &Path) -> u64 {
    disk_bytes_once(path, &mut HashSet::new())
}

fn disk_bytes_once(path: &Path, seen: &mut HashSet<(u64, u64)>) -> u64 {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return 0;
    };
    if !seen.insert((meta.dev(), meta.ino())) {
        return 0;
    }
    let own = meta.blocks() * 512;
    if !meta.is_dir() {
        return own;
    }
    let Ok(entries) = std::fs::read_dir(path) else {
        return own;
    };
    own + entries
        .flatten()
        .map(|e| disk_bytes_once(&e.path(), seen))
        .sum::<u64>()
}

/// Hard-link the tree `from` (plain files and directories only) at `to`, a new directory.
fn link_tree(from: &Path, to: &Path) -> io::Result<()> {
    std::fs::create_dir(to)?;
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(0o755))?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let kind = entry.file_type()?;
        let target = to.join(entry.file_name());
        if kind.is_dir() {
            link_tree(&entry.path(), &target)?;
        } else if kind.is_file() {
            std::fs::hard_link(entry.path(), &target)?;
        } else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{} is not a plain file or directory",
                    entry.path().display()
                ),
            ));
        }
    }
    Ok(())
}

/// Hard-link a snapshot at `to` (a new directory); nothing is left of `to` if it fails.
pub fn link_snapshot(from: &Path, to: &Path) -> Result<(), ServeError> {
    link_tree(from, to).map_err(|e| {
        let _ = std::fs::remove_dir_all(to);
        io_error("link the snapshot at", to)(e)
    })
}

/// Link `snapshot` into a sandbox's `vm/base/` and return that path; `None` when the snapshot
/// is on another file system (a snapshot the user gave: it is then restored where it is).
pub fn link_base(snapshot: &Path, vm_dir: &Path) -> Result<Option<PathBuf>, ServeError> {
    let base = vm_dir.join(BASE);
    match link_tree(snapshot, &base) {
        Ok(()) => Ok(Some(base)),
        Err(e) => {
            let _ = std::fs::remove_dir_all(&base);
            if e.raw_os_error() == Some(libc::EXDEV) {
                Ok(None)
            } else {
                Err(io_error("link the snapshot into the sandbox as", &base)(e))
            }
        }
    }
}

/// Make a fork base (or a template's snapshot) root's and read-only, all through, so no VMM
/// can change what the sandboxes made from it restore: a file root already owns (a
/// template's, linked in) is kept, one whose only name is here becomes root's, and one the
/// source shares with its own snapshot (a hard link) is replaced by a copy of root's (holes
/// kept), so the source's files stay its own (it links them into its next snapshot) and
/// nothing of it reaches the clones. Called only while no process of the source's uid runs.
pub fn seal(dir: &Path) -> Result<(), ServeError> {
    check_plain(dir)?;
    seal_tree(dir).map_err(io_error("seal (make root's and read-only)", dir))
}

fn seal_tree(path: &Path) -> io::Result<()> {
    let meta = std::fs::symlink_metadata(path)?;
    if meta.is_dir() {
        std::os::unix::fs::lchown(path, Some(0), Some(0))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))?;
        for entry in std::fs::read_dir(path)? {
            seal_tree(&entry?.path())?;
        }
    } else if meta.is_file() {
        if meta.uid() != 0 {
            if meta.nlink() == 1 {
                // Its only name is here and no process of its uid runs: root's in place.
                std::os::unix::fs::lchown(path, Some(0), Some(0))?;
            } else {
                copy_as_root(path)?;
            }
        }
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o444))?;
    } else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} is not a plain file or directory", path.display()),
        ));
    }
    Ok(())
}

/// Replace `path` by a copy of root's: its data extents copied, its holes left holes.
fn copy_as_root(path: &Path) -> io::Result<()> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let from = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    let len = from.metadata()?.len();
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    let tmp = path.with_file_name(format!(".{}.sealing", name.unwrap_or_default()));
    let to = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    let copied = (|| {
        to.set_len(len)?;
        let mut buf = vec![0u8; 1 << 20];
        for (start, size) in mayfly_sys::extents::data_extents(&from, 0, len)? {
            let mut done = 0u64;
            while done < size {
                let want =
                    usize::try_from((size - done).min(buf.len() as u64)).unwrap_or(buf.len());
                let n = from.read_at(&mut buf[..want], start + done)?;
                if n == 0 {
                    break;
                }
                to.write_all_at(&buf[..n], start + done)?;
                done += n as u64;
            }
        }
        to.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if copied.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    copied
}
