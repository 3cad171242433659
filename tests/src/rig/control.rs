//! The per-run control directory, shared read-write with L1: the rig writes its `rig.conf` and
//! `run.sh` there, QEMU and L1 their logs and the command's exit status. Removed after a run
//! unless kept.

use std::fs;
use std::io::{self, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::DirBuilderExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use super::error::{io_err, RigError};

/// The per-run control directory (shared read-write with L1 as `rw0`); removed when dropped
/// unless kept.
pub(super) struct ControlDir {
    pub(super) path: PathBuf,
    keep: std::cell::Cell<bool>,
}

impl ControlDir {
    pub(super) fn create() -> Result<ControlDir, RigError> {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let base = std::env::temp_dir();
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or_default();
        for _ in 0..100 {
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let path = base.join(format!("mayfly-rig-{}-{n}-{nanos:08x}", std::process::id()));
            match fs::DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => {
                    let path = fs::canonicalize(&path).unwrap_or(path);
                    if path.as_os_str().as_bytes().contains(&b'\n') {
                        let _ = fs::remove_dir(&path);
                        break;
                    }
                    return Ok(ControlDir {
                        path,
                        keep: std::cell::Cell::new(false),
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => {
                    return Err(RigError::Io {
                        context: format!("cannot create a control directory in {}", base.display()),
                        source: e,
                    })
                }
            }
        }
        Err(RigError::BadOption {
            what: "temporary directory",
            reason: format!(
                "cannot create a control directory in {} (set TMPDIR to a plain directory)",
                base.display()
            ),
        })
    }

    pub(super) fn write(&self, name: &str, contents: &[u8]) -> Result<(), RigError> {
        let path = self.path.join(name);
        let mut file =
            fs::File::create(&path).map_err(io_err(format!("cannot create {}", path.display())))?;
        file.write_all(contents)
            .map_err(io_err(format!("cannot write {}", path.display())))
    }

    pub(super) fn keep(&self) {
        self.keep.set(true);
    }
}

impl Drop for ControlDir {
    fn drop(&mut self) {
        if !self.keep.get() {
            let _ = fs::remove_dir_all(&self.path);
        }
    }
}
