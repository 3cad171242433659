//! Unix socket plumbing std lacks: a listening socket whose file is mode 0600 from its first
//! instant, and a connect that gives up instead of hanging when a listener's backlog is full.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::Duration;

/// The longest socket path in bytes: `sun_path` holds 108 bytes, the last one a NUL.
pub const MAX_SOCKET_PATH: usize = 107;

/// Connections the kernel queues while the server is busy with another one.
const BACKLOG: libc::c_int = 64;

fn sockaddr(path: &Path) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    let bytes = path.as_os_str().as_bytes();
    let mut addr = libc::sockaddr_un {
        sun_family: libc::sa_family_t::try_from(libc::AF_UNIX).expect("AF_UNIX is 1"),
        sun_path: [0; 108],
    };
    if bytes.is_empty() || bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    for (dst, &src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = libc::c_char::from_ne_bytes([src]);
    }
    let len = std::mem::offset_of!(libc::sockaddr_un, sun_path) + bytes.len() + 1;
    // At most the size of a sockaddr_un (checked above).
    Ok((
        addr,
        libc::socklen_t::try_from(len).expect("a sockaddr_un length"),
    ))
}

fn new_socket() -> io::Result<OwnedFd> {
    // SAFETY: socket() takes no pointers; the descriptor it returns is checked below.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Create a listening socket at `path` that only its owner can connect to.
pub fn bind_private(path: &Path) -> io::Result<UnixListener> {
    let (addr, len) = sockaddr(path)?;
    let fd = new_socket()?;
    // Linux gives the socket file the mode of the socket's own inode (less the umask), so this
    // makes the file 0600 as bind creates it: there is no window in which others may connect.
    // SAFETY: fchmod on a descriptor we own.
    check(unsafe { libc::fchmod(fd.as_raw_fd(), 0o600) })?;
    // SAFETY: `addr` is an initialised sockaddr_un and `len` covers the path and its NUL.
    check(unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_un).cast::<libc::sockaddr>(),
            len,
        )
    })?;
    // SAFETY: listen on a bound socket we own.
    if let Err(err) = check(unsafe { libc::listen(fd.as_raw_fd(), BACKLOG) }) {
        let _ = std::fs::remove_file(path);
        return Err(err);
    }
    Ok(UnixListener::from(fd))
}

/// Connect to `path`, waiting at most `timeout` if the listener's backlog is full (then the
/// error is `WouldBlock`). The stream keeps `timeout` as its write timeout.
pub fn connect(path: &Path, timeout: Duration) -> io::Result<UnixStream> {
    let (addr, len) = sockaddr(path)?;
    let stream = UnixStream::from(new_socket()?);
    // A blocking connect to a full backlog waits for up to the send timeout (SO_SNDTIMEO).
    stream.set_write_timeout(Some(timeout))?;
    // SAFETY: `addr` is an initialised sockaddr_un and `len` covers the path and its NUL.
    check(unsafe {
        libc::connect(
            stream.as_raw_fd(),
            (&addr as *const libc::sockaddr_un).cast::<libc::sockaddr>(),
            len,
        )
    })?;
    Ok(stream)
}

/// An exclusive lock on `<path>.lock`, held while a server owns `path`. Taken with flock, so it
/// ends with the process however it dies; the file is removed when the lock is released
/// normally, and a lock file whose inode no longer is the one at the path (removed by a
/// releasing owner in between) is taken again.
pub struct PathLock {
    file: std::fs::File,
    path: std::path::PathBuf,
}

impl PathLock {
    /// Take the lock without waiting: `EWOULDBLOCK` means another process holds it.
    pub fn acquire(path: &Path) -> io::Result<Self> {
        use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
        let mut lock_path = path.as_os_str().to_owned();
        lock_path.push(".lock");
        let lock_path = std::path::PathBuf::from(lock_path);
        loop {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(&lock_path)?;
            // SAFETY: flock on a descriptor we own; the result is checked.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                return Err(io::Error::last_os_error());
            }
            let held = file.metadata()?;
            match std::fs::symlink_metadata(&lock_path) {
                Ok(now) if (now.dev(), now.ino()) == (held.dev(), held.ino()) => {
                    return Ok(Self {
                        file,
                        path: lock_path,
                    })
                }
                // The owner before us removed it while we opened it: take the new one.
                _ => continue,
            }
        }
    }

    /// Remove the lock file, then let go of the lock.
    pub fn release(self) {
        let _ = std::fs::remove_file(&self.path);
        drop(self.file);
    }
}
