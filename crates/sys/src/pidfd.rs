//! Processes by pidfd: a pidfd names one process for as long as it is held, so a signal sent
//! through it never reaches another process that took the same pid after this one ended.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// A pidfd for `pid`, close-on-exec.
pub fn open(pid: libc::pid_t) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open on a pid; the result is checked. Its pidfds are close-on-exec.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let fd = RawFd::try_from(fd).map_err(|_| std::io::Error::from_raw_os_error(libc::EBADF))?;
    // SAFETY: pidfd_open returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Send `signal` to the process behind `pidfd` (nothing happens if it has ended, even if its
/// pid is in use again).
pub fn signal(pidfd: &OwnedFd, signal: libc::c_int) {
    // SAFETY: pidfd_send_signal on a pidfd this process owns; no siginfo.
    unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            signal,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
}

/// Send SIGKILL to the process behind `pidfd` (nothing happens if it has ended, even if its
/// pid is in use again).
pub fn kill(pidfd: &OwnedFd) {
    signal(pidfd, libc::SIGKILL);
}

/// A duplicate, in this process, of descriptor `fd` of the process behind `pidfd`
/// (pidfd_getfd(2): the caller must be allowed to ptrace that process, as root is),
/// close-on-exec.
pub fn get_fd(pidfd: &OwnedFd, fd: RawFd) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_getfd on a pidfd this process owns and a plain number; the result is
    // checked. The descriptor it makes is close-on-exec.
    let got = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if got < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let got = RawFd::try_from(got).map_err(|_| std::io::Error::from_raw_os_error(libc::EBADF))?;
    // SAFETY: pidfd_getfd returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(got) })
}
