//! Opening a snapshot's files without trusting them: the directory is opened once and both
//! files relative to it (a snapshot swapped in by a concurrent `mayfly snapshot` cannot pair one
//! snapshot's state with another's memory), each file must be a regular file (a FIFO would block
//! the restore, a device could be read forever), and the state file is read with a size cap.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::path::{Path, PathBuf};

use crate::error::SnapshotError;

/// The largest state file mayfly writes or reads. Registers, interrupt controllers and device
/// state take kilobytes; the rest is the recorded working set, which is capped
/// ([`crate::MAX_WORKING_SET`]) so that this always holds.
pub const MAX_STATE_BYTES: u64 = 64 << 20;

/// What a path that should be a regular file turned out to be.
fn kind_of(meta: &std::fs::Metadata) -> &'static str {
    let t = meta.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_symlink() {
        "a symbolic link"
    } else {
        "not a regular file"
    }
}

fn cstring(path: &Path) -> Result<CString, SnapshotError> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| SnapshotError::Open {
        path: path.display().to_string(),
        reason: "the path contains a NUL byte".into(),
    })
}

/// A snapshot directory, opened once.
pub struct SnapshotDir {
    path: PathBuf,
    fd: OwnedFd,
}

impl SnapshotDir {
    pub fn open(path: &Path) -> Result<Self, SnapshotError> {
        let c = cstring(path)?;
        // SAFETY: a valid NUL-terminated path; the result is checked.
        let fd = unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            let err = std::io::Error::last_os_error();
            let reason = match err.raw_os_error() {
                Some(libc::ENOENT) => "no such directory".to_string(),
                Some(libc::ENOTDIR) => "it is not a directory".to_string(),
                _ => err.to_string(),
            };
            return Err(SnapshotError::Open {
                path: path.display().to_string(),
                reason: format!("{reason}: it must be a directory holding a mayfly snapshot"),
            });
        }
        // SAFETY: open returned a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Self {
            path: path.to_path_buf(),
            fd,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Open `name` inside the directory, read-only, if it is a regular file.
    pub fn open_file(&self, name: &str) -> Result<File, SnapshotError> {
        let shown = self.path.join(name);
        let c = cstring(Path::new(name))?;
        // O_PATH opens nothing: no FIFO waits for a writer, no device runs its open routine.
        // SAFETY: a valid directory fd and NUL-terminated name; the result is checked.
        let fd = unsafe {
            libc::openat(
                self.fd.as_raw_fd(),
                c.as_ptr(),
                libc::O_PATH | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            let err = std::io::Error::last_os_error();
            let reason = match err.raw_os_error() {
                Some(libc::ENOENT) => format!(
                    "the snapshot's {name} file is missing: the directory holds an incomplete \
                     snapshot (or none); take the snapshot again"
                ),
                _ => format!("the snapshot's {name} file cannot be opened: {err}"),
            };
            return Err(SnapshotError::Open {
                path: shown.display().to_string(),
                reason,
            });
        }
        // SAFETY: openat returned a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        open_regular_path_fd(fd, &shown)
    }
}

/// Open a file read-only that must be regular: `path` may be anything (a `/proc/self/fd/N`
/// handed over by a fork, a file on disk).
pub fn open_regular(path: &Path) -> Result<File, SnapshotError> {
    let c = cstring(path)?;
    // SAFETY: a valid NUL-terminated path; the result is checked.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_PATH | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(SnapshotError::Open {
            path: path.display().to_string(),
            reason: std::io::Error::last_os_error().to_string(),
        });
    }
    // SAFETY: open returned a new descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    open_regular_path_fd(fd, path)
}

/// Check what an O_PATH descriptor names, then open that very inode read-only (through
/// /proc/self/fd, so nothing can be swapped in between the check and the open).
fn open_regular_path_fd(fd: OwnedFd, shown: &Path) -> Result<File, SnapshotError> {
    let err = |reason: String| SnapshotError::Open {
        path: shown.display().to_string(),
        reason,
    };
    // std's metadata on an O_PATH fd uses fstat, which O_PATH allows.
    let probe = File::from(fd);
    let meta = probe.metadata().map_err(|e| err(e.to_string()))?;
    if !meta.file_type().is_file() {
        return Err(err(format!(
            "it is {}; a snapshot's files must be regular files",
            kind_of(&meta)
        )));
    }
    let proc_path = format!("/proc/self/fd/{}", probe.as_raw_fd());
    File::open(&proc_path).map_err(|e| err(e.to_string()))
}

/// Read a whole state file, refusing one larger than [`MAX_STATE_BYTES`] before reading it.
/// Reads from offset 0 whatever the descriptor's position (a fork hands over a descriptor it
/// has just written), and fails if the file changes size while it is read.
pub fn read_capped(file: &File, shown: &Path) -> Result<Vec<u8>, SnapshotError> {
    let read_err = |source| SnapshotError::Read {
        path: shown.display().to_string(),
        source,
    };
    let len = file.metadata().map_err(read_err)?.len();
    if len > MAX_STATE_BYTES {
        return Err(SnapshotError::TooLarge {
            path: shown.display().to_string(),
            len,
            max: MAX_STATE_BYTES,
        });
    }
    // `len` is at most MAX_STATE_BYTES, so the buffer is bounded whatever the file says.
    let mut bytes = vec![0u8; usize::try_from(len).expect("MAX_STATE_BYTES fits a usize")];
    let mut done = 0usize;
    while done < bytes.len() {
        match file.read_at(&mut bytes[done..], done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(read_err(e)),
        }
    }
    let mut more = [0u8; 1];
    if done < bytes.len() || file.read_at(&mut more, done as u64).map_err(read_err)? > 0 {
        return Err(read_err(std::io::Error::other(
            "the file changed size while it was read",
        )));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("mayfly-open-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn only_regular_files_open() {
        let dir = scratch("kinds");
        std::fs::write(dir.join("state"), b"x").unwrap();
        std::os::unix::fs::symlink("/dev/zero", dir.join("zero")).unwrap();
        std::os::unix::fs::symlink("state", dir.join("link-to-file")).unwrap();
        let fifo = cstring(&dir.join("fifo")).unwrap();
        // SAFETY: a valid path; the result is checked.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        std::fs::create_dir(dir.join("sub")).unwrap();

        let snap = SnapshotDir::open(&dir).unwrap();
        assert!(snap.open_file("state").is_ok());
        assert!(snap.open_file("link-to-file").is_ok());
        for (name, kind) in [
            ("zero", "a character device"),
            ("fifo", "a FIFO"),
            ("sub", "a directory"),
        ] {
            let err = snap.open_file(name).unwrap_err().to_string();
            assert!(err.contains(kind), "{name}: {err}");
        }
        assert!(open_regular(&dir.join("fifo")).is_err());
        assert!(SnapshotDir::open(&dir.join("state"))
            .err()
            .unwrap()
            .to_string()
            .contains("not a directory"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn oversized_state_files_are_refused_unread() {
        let dir = scratch("size");
        let path = dir.join("state");
        let file = File::create(&path).unwrap();
        // Sparse: several GiB that cost nothing to make.
        file.set_len(8 << 30).unwrap();
        let file = File::open(&path).unwrap();
        let err = read_capped(&file, &path).unwrap_err();
        assert!(matches!(err, SnapshotError::TooLarge { .. }), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
