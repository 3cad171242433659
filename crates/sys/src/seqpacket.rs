//! SOCK_SEQPACKET socket pairs, which std lacks: messages keep their boundaries, a reader sees
//! the end when every writer has closed, and a descriptor can travel with a message.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixDatagram;

/// A connected SOCK_SEQPACKET pair, close-on-exec. std has no seqpacket type; a datagram
/// socket's send and recv are send(2) and recv(2), which is all either end uses.
pub fn pair() -> std::io::Result<(UnixDatagram, UnixDatagram)> {
    let mut fds = [0; 2];
    // SAFETY: socketpair fills the two-element array; the result is checked.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: socketpair returned two new descriptors that nothing else owns.
    unsafe {
        Ok((
            UnixDatagram::from(OwnedFd::from_raw_fd(fds[0])),
            UnixDatagram::from(OwnedFd::from_raw_fd(fds[1])),
        ))
    }
}

/// What one read of a seqpacket socket got.
pub enum Received {
    /// A message of this many bytes, and the descriptor sent with it (close-on-exec).
    Message(usize, Option<OwnedFd>),
    /// A message longer than the buffer, or with more descriptors than one. Any descriptor
    /// that came with it is returned (a pidfd then names a process that must not be left
    /// running).
    Truncated(Vec<OwnedFd>),
    /// Every sender has closed its end.
    End,
}

/// Read one message without blocking past what the socket's mode says. Descriptors arrive
/// close-on-exec (MSG_CMSG_CLOEXEC), so a process started meanwhile cannot inherit them.
pub fn receive(socket: &UnixDatagram, buf: &mut [u8]) -> std::io::Result<Received> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    let mut space = nix::cmsg_space!([RawFd; 2]);
    let mut iov = [std::io::IoSliceMut::new(buf)];
    let msg = recvmsg::<()>(
        socket.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .map_err(std::io::Error::from)?;
    let mut fds = Vec::new();
    for cmsg in msg.cmsgs() {
        if let ControlMessageOwned::ScmRights(raw) = cmsg {
            // SAFETY: SCM_RIGHTS gave this process new descriptors that nothing else owns.
            fds.extend(
                raw.into_iter()
                    .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
            );
        }
    }
    let truncated = msg
        .flags
        .intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC);
    let len = msg.bytes;
    if truncated || fds.len() > 1 {
        return Ok(Received::Truncated(fds));
    }
    if len == 0 && fds.is_empty() {
        return Ok(Received::End);
    }
    Ok(Received::Message(len, fds.pop()))
}

/// Send one message, with `fd` beside it (SCM_RIGHTS) when given. Never raises SIGPIPE: a
/// peer that has gone is an error (EPIPE) like any other.
pub fn send(
    socket: &UnixDatagram,
    bytes: &[u8],
    fd: Option<std::os::fd::BorrowedFd<'_>>,
) -> std::io::Result<()> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let raw = fd.map(|fd| [fd.as_raw_fd()]);
    let cmsgs: Vec<ControlMessage<'_>> = raw
        .as_ref()
        .map(|fds| ControlMessage::ScmRights(fds))
        .into_iter()
        .collect();
    let iov = [std::io::IoSlice::new(bytes)];
    let sent = sendmsg::<()>(
        socket.as_raw_fd(),
        &iov,
        &cmsgs,
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map_err(std::io::Error::from)?;
    if sent != bytes.len() {
        return Err(std::io::Error::other(format!(
            "a message of {} bytes went out as {sent}",
            bytes.len()
        )));
    }
    Ok(())
}
