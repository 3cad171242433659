//! Listening sockets and connections. Both families end up as a plain socket fd, so one
//! [`Conn`] type serves vsock (production) and Unix sockets (tests on the host).

use std::fmt;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::time::Duration;

use crate::sys::{cvt, cvt_isize, set_nonblocking, set_socket_timeout};

/// Where to listen, from `--listen`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    Vsock(u32),
    Unix(PathBuf),
}

impl ListenAddr {
    pub fn parse(s: &str) -> Result<ListenAddr, String> {
        if let Some(port) = s.strip_prefix("vsock:") {
            port.parse()
                .map(ListenAddr::Vsock)
                .map_err(|_| format!("bad vsock port {port:?}: give a number, e.g. vsock:52"))
        } else if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err("unix: needs a path, e.g. unix:/tmp/agent.sock".into());
            }
            Ok(ListenAddr::Unix(PathBuf::from(path)))
        } else {
            Err(format!(
                "bad listen address {s:?}: give vsock:PORT or unix:PATH"
            ))
        }
    }
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ListenAddr::Vsock(port) => write!(f, "vsock port {port}"),
            ListenAddr::Unix(path) => write!(f, "unix socket {}", path.display()),
        }
    }
}

pub enum Listener {
    Vsock(OwnedFd),
    Unix(UnixListener),
}

impl Listener {
    pub fn bind(addr: &ListenAddr) -> io::Result<Listener> {
        match addr {
            ListenAddr::Vsock(port) => bind_vsock(*port).map(Listener::Vsock),
            ListenAddr::Unix(path) => {
                // A socket file left by an earlier run would make bind fail; anything
                // that is not a socket is left alone.
                if let Ok(meta) = std::fs::symlink_metadata(path) {
                    if meta.file_type().is_socket() {
                        let _ = std::fs::remove_file(path);
                    }
                }
                UnixListener::bind(path).map(Listener::Unix)
            }
        }
    }

    pub fn accept(&self) -> io::Result<Conn> {
        match self {
            Listener::Unix(l) => {
                let (stream, _) = l.accept()?;
                Ok(Conn {
                    fd: OwnedFd::from(stream),
                })
            }
            Listener::Vsock(fd) => {
                // SAFETY: accept4 with null address pointers only returns a new fd.
                let new = cvt(unsafe {
                    libc::accept4(
                        fd.as_raw_fd(),
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                        libc::SOCK_CLOEXEC,
                    )
                })?;
                Ok(Conn {
                    // SAFETY: accept4 succeeded: `new` is an open fd that nothing else owns.
                    fd: unsafe { OwnedFd::from_raw_fd(new) },
                })
            }
        }
    }
}

fn bind_vsock(port: u32) -> io::Result<OwnedFd> {
    // SAFETY: socket() has no memory effects.
    let raw =
        cvt(unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: socket succeeded: `raw` is an open fd that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: sockaddr_vm is plain old data; all-zero is a valid value to fill in.
    let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
    addr.svm_family = libc::sa_family_t::try_from(libc::AF_VSOCK).expect("AF_VSOCK is 40");
    addr.svm_port = port;
    addr.svm_cid = libc::VMADDR_CID_ANY;
    // SAFETY: the pointer and length describe `addr`, a sockaddr_vm, for the call only.
    cvt(unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_vm).cast(),
            libc::socklen_t::try_from(std::mem::size_of::<libc::sockaddr_vm>()).expect("16 bytes"),
        )
    })?;
    // SAFETY: listen has no memory effects.
    cvt(unsafe { libc::listen(fd.as_raw_fd(), 128) })?;
    Ok(fd)
}

/// A connection to `port` of vsock `cid` (2 is the host), for `mayfly-agent --connect`.
pub fn connect_vsock(cid: u32, port: u32) -> io::Result<OwnedFd> {
    // SAFETY: socket() has no memory effects.
    let raw =
        cvt(unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: socket succeeded: `raw` is an open fd that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: sockaddr_vm is plain old data; all-zero is a valid value to fill in.
    let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
    addr.svm_family = libc::sa_family_t::try_from(libc::AF_VSOCK).expect("AF_VSOCK is 40");
    addr.svm_port = port;
    addr.svm_cid = cid;
    loop {
        // SAFETY: the pointer and length describe `addr`, a sockaddr_vm, for the call only.
        let rc = unsafe {
            libc::connect(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_vm).cast(),
                libc::socklen_t::try_from(std::mem::size_of::<libc::sockaddr_vm>())
                    .expect("16 bytes"),
            )
        };
        match cvt(rc) {
            Ok(_) => return Ok(fd),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
}

/// One accepted connection. Writes use `MSG_NOSIGNAL`, so a host that went away is an
/// `EPIPE` error here rather than a SIGPIPE for the whole agent.
pub struct Conn {
    fd: OwnedFd,
}

impl Conn {
    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        set_nonblocking(self.fd.as_raw_fd(), on)
    }

    pub fn set_read_timeout(&self, d: Option<Duration>) -> io::Result<()> {
        set_socket_timeout(self.fd.as_raw_fd(), libc::SO_RCVTIMEO, d)
    }

    pub fn set_write_timeout(&self, d: Option<Duration>) -> io::Result<()> {
        set_socket_timeout(self.fd.as_raw_fd(), libc::SO_SNDTIMEO, d)
    }

    pub fn shutdown_write(&self) {
        // SAFETY: shutdown has no memory effects.
        unsafe {
            libc::shutdown(self.fd.as_raw_fd(), libc::SHUT_WR);
        }
    }

    /// Ends the session politely: say we are done writing, then read and drop whatever the
    /// host still sends (for up to `grace`) until it closes. Closing with unread data would
    /// make some transports reset the connection and lose our last frame.
    pub fn finish(mut self, grace: Duration) {
        self.shutdown_write();
        let _ = self.set_nonblocking(false);
        let deadline = std::time::Instant::now() + grace;
        let mut sink = [0u8; 16 * 1024];
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() || self.set_read_timeout(Some(left)).is_err() {
                return;
            }
            match self.read(&mut sink) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    }
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: `buf` is valid for writes of `buf.len()` bytes.
        cvt_isize(unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) })
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        // SAFETY: `buf` is valid for reads of `buf.len()` bytes.
        cvt_isize(unsafe {
            libc::send(
                self.fd.as_raw_fd(),
                buf.as_ptr().cast(),
                buf.len(),
                libc::MSG_NOSIGNAL,
            )
        })
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
