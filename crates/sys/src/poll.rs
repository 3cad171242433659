//! poll(2) over a few descriptors, with a timeout.

use std::os::fd::RawFd;
use std::time::Duration;

/// Wait up to `timeout` for the descriptors in `fds` (for `events`); returns the `revents`
/// of each (all 0 on a timeout; EINTR counts as one).
pub fn poll(
    fds: &[(RawFd, libc::c_short)],
    timeout: Duration,
) -> std::io::Result<Vec<libc::c_short>> {
    let mut polls: Vec<libc::pollfd> = fds
        .iter()
        .map(|&(fd, events)| libc::pollfd {
            fd,
            events,
            revents: 0,
        })
        .collect();
    let wait_ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    let count = libc::nfds_t::try_from(polls.len()).unwrap_or(libc::nfds_t::MAX);
    // SAFETY: poll on a vector of pollfds it may write `revents` of; the result is checked.
    let n = unsafe { libc::poll(polls.as_mut_ptr(), count, wait_ms) };
    if n < 0 {
        let err = std::io::Error::last_os_error();
        if err.kind() != std::io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
    Ok(polls.iter().map(|p| p.revents).collect())
}
