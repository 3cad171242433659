//! Claiming a Unix socket's path: validated, locked (the lock file `<path>.lock`) and cleared of
//! a stale socket that a dead process left, before anything listens on it. The control socket,
//! the vsock device's socket and the jail's waiter (which clears a jailed VMM's sockets once it
//! is gone) all claim their paths this way, so two processes started at once on one path never
//! both think they own it.

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::socket::{bind_private, connect, PathLock, MAX_SOCKET_PATH};

/// How long claiming waits to learn whether an existing socket is alive.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Why a socket path cannot be claimed.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    #[error("the API socket path {path} is {len} bytes long, but a Unix socket path can have at most {MAX_SOCKET_PATH}: choose a shorter --api-sock path")]
    PathTooLong { path: String, len: usize },
    #[error(
        "the API socket path {0:?} is not valid: it must be a non-empty path without NUL bytes"
    )]
    InvalidPath(String),
    #[error("cannot create the API socket {path}: {dir} {problem}")]
    Directory {
        path: String,
        dir: String,
        problem: &'static str,
    },
    #[error("the API socket {path} is in use: another mayfly (or another program) listens on it; stop it or choose another --api-sock path")]
    InUse { path: String },
    #[error("{path} exists and is not a socket: remove it or choose another --api-sock path")]
    NotASocket { path: String },
    #[error("cannot create the API socket {path}: {source}")]
    Bind {
        path: String,
        source: std::io::Error,
    },
}

/// A socket path this process owns: validated, locked (the lock file `<path>.lock`) and cleared
/// of a stale socket a dead process left, but not bound yet. Of two VMMs started at once on one
/// path, one gets the claim, the other the "in use" error. Dropping the claim (or
/// [`SocketClaim::release`]) removes the lock file.
pub struct SocketClaim {
    path: PathBuf,
    lock: Option<PathLock>,
    /// Bound ahead by [`SocketClaim::listen`].
    listener: Option<UnixListener>,
}

impl std::fmt::Debug for SocketClaim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SocketClaim")
            .field("path", &self.path)
            .finish()
    }
}

impl SocketClaim {
    pub fn new(path: &Path) -> Result<Self, ClaimError> {
        use std::io::ErrorKind;
        use std::os::unix::ffi::OsStrExt;

        let shown = path.display().to_string();
        let bytes = path.as_os_str().as_bytes();
        if bytes.is_empty() || bytes.contains(&0) {
            return Err(ClaimError::InvalidPath(shown));
        }
        if bytes.len() > MAX_SOCKET_PATH {
            return Err(ClaimError::PathTooLong {
                path: shown,
                len: bytes.len(),
            });
        }
        let dir = match path.parent() {
            Some(dir) if !dir.as_os_str().is_empty() => dir,
            _ => Path::new("."),
        };
        let dir_error = |problem| ClaimError::Directory {
            path: shown.clone(),
            dir: dir.display().to_string(),
            problem,
        };
        let bind_error = |source| ClaimError::Bind {
            path: shown.clone(),
            source,
        };
        match std::fs::metadata(dir) {
            Ok(meta) if meta.is_dir() => {}
            Ok(_) => return Err(dir_error("is not a directory")),
            Err(e) if e.kind() == ErrorKind::NotFound => return Err(dir_error("does not exist")),
            Err(e) => return Err(bind_error(e)),
        }
        let lock = PathLock::acquire(path).map_err(|e| match e.raw_os_error() {
            Some(libc::EWOULDBLOCK) => ClaimError::InUse {
                path: shown.clone(),
            },
            _ => bind_error(e),
        })?;
        match std::fs::symlink_metadata(path) {
            Ok(meta) if meta.file_type().is_socket() => {
                match connect(path, PROBE_TIMEOUT) {
                    // Alive (a full backlog is alive too): a program that does not use the lock.
                    Ok(_) => return Err(ClaimError::InUse { path: shown }),
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        return Err(ClaimError::InUse { path: shown })
                    }
                    // Left behind by a process that is gone.
                    Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
                        match std::fs::remove_file(path) {
                            Ok(()) => {}
                            Err(e) if e.kind() == ErrorKind::NotFound => {}
                            Err(e) => return Err(bind_error(e)),
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::NotFound => {}
                    Err(e) => return Err(bind_error(e)),
                }
            }
            Ok(_) => return Err(ClaimError::NotASocket { path: shown }),
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(bind_error(e)),
        }
        Ok(Self {
            path: path.to_path_buf(),
            lock: Some(lock),
            listener: None,
        })
    }

    /// Listen on the claimed path now (as [`SocketClaim::bind`]); the server started on this
    /// claim later serves the same socket, connections still queued on it included.
    pub fn listen(&mut self) -> Result<&UnixListener, ClaimError> {
        if self.listener.is_none() {
            self.listener = Some(self.bind()?);
        }
        Ok(self.listener.as_ref().expect("bound just now"))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Listen on the claimed path (mode 0600 from the first instant), or take the listener
    /// [`SocketClaim::listen`] bound.
    pub fn bind(&mut self) -> Result<UnixListener, ClaimError> {
        if let Some(listener) = self.listener.take() {
            return Ok(listener);
        }
        let shown = self.path.display().to_string();
        let listener = bind_private(&self.path).map_err(|e| match e.raw_os_error() {
            Some(libc::EADDRINUSE) => ClaimError::InUse {
                path: shown.clone(),
            },
            _ => ClaimError::Bind {
                path: shown.clone(),
                source: e,
            },
        })?;
        // Already 0600 on Linux; this covers a kernel where the socket's mode does not carry
        // over.
        if let Err(e) = std::fs::set_permissions(&self.path, std::fs::Permissions::from_mode(0o600))
        {
            let _ = std::fs::remove_file(&self.path);
            return Err(ClaimError::Bind {
                path: shown,
                source: e,
            });
        }
        Ok(listener)
    }

    /// Give up the path: removes the lock file.
    pub fn release(mut self) {
        if let Some(lock) = self.lock.take() {
            lock.release();
        }
    }
}

impl Drop for SocketClaim {
    fn drop(&mut self) {
        // Bound ahead and never served: the socket file goes with it (under the lock, which
        // no other process holds, so the file is this one's).
        if self.listener.take().is_some() {
            let _ = std::fs::remove_file(&self.path);
        }
        if let Some(lock) = self.lock.take() {
            lock.release();
        }
    }
}
