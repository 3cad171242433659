//! Thin, checked wrappers over the few libc calls std does not offer.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// Turns a `-1` return into the thread's errno.
pub fn cvt(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

pub fn cvt_isize(ret: isize) -> io::Result<usize> {
    // Negative: the call failed.
    usize::try_from(ret).map_err(|_| io::Error::last_os_error())
}

/// A close-on-exec pipe: (read end, write end).
pub fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `fds` is a valid array of two ints for pipe2 to fill.
    cvt(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) })?;
    // SAFETY: pipe2 succeeded, so both fds are open and owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

pub fn set_nonblocking(fd: RawFd, on: bool) -> io::Result<()> {
    // SAFETY: fcntl with F_GETFL/F_SETFL only reads and sets flags of `fd`; a bad fd is an
    // error return, not undefined behaviour.
    unsafe {
        let flags = cvt(libc::fcntl(fd, libc::F_GETFL))?;
        let flags = if on {
            flags | libc::O_NONBLOCK
        } else {
            flags & !libc::O_NONBLOCK
        };
        cvt(libc::fcntl(fd, libc::F_SETFL, flags))?;
    }
    Ok(())
}

/// How many bytes a pipe or socket has ready to read.
pub fn bytes_readable(fd: RawFd) -> io::Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int through the pointer, which points at `n`.
    cvt(unsafe { libc::ioctl(fd, libc::FIONREAD, &mut n) })?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// read(2) without retry; `WouldBlock` on a non-blocking fd with nothing to read.
pub fn read(fd: &impl AsRawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for writes of `buf.len()` bytes.
    cvt_isize(unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) })
}

/// write(2) without retry.
pub fn write(fd: &impl AsRawFd, buf: &[u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for reads of `buf.len()` bytes.
    cvt_isize(unsafe { libc::write(fd.as_raw_fd(), buf.as_ptr().cast(), buf.len()) })
}

/// Sends `signal` to every process of group `pgid`; a group that is gone is not an error.
pub fn kill_group(pgid: u32, signal: libc::c_int) {
    // kill(0) or kill(-1) would hit far more than the group; no real group is beyond pid_t.
    let Ok(pgid) = libc::pid_t::try_from(pgid) else {
        return;
    };
    if pgid <= 1 {
        return;
    }
    // SAFETY: kill has no memory effects; the pgid was checked above to be a real group.
    unsafe {
        libc::kill(-pgid, signal);
    }
}

pub fn timeval_ms(tv: &libc::timeval) -> f64 {
    tv.tv_sec as f64 * 1000.0 + tv.tv_usec as f64 / 1000.0
}

/// Milliseconds on a clock (e.g. CLOCK_BOOTTIME for uptime).
pub fn clock_ms(clock: libc::clockid_t) -> io::Result<u64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for clock_gettime to fill.
    cvt(unsafe { libc::clock_gettime(clock, &mut ts) })?;
    // A monotonic clock: never negative.
    Ok(ts.tv_sec.unsigned_abs() * 1000 + ts.tv_nsec.unsigned_abs() / 1_000_000)
}

pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for `buf.len()` bytes; gethostname NUL-terminates within
    // it (we leave one byte spare to be sure).
    let ret = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len() - 1) };
    if ret != 0 {
        return String::new();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

pub fn set_hostname(name: &str) -> io::Result<()> {
    // SAFETY: the pointer and length describe `name`'s bytes, which outlive the call.
    cvt(unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) }).map(drop)
}

/// Set network interface `name`'s hardware address (SIOCSIFHWADDR).
pub fn set_link_mac(name: &str, mac: [u8; 6]) -> io::Result<()> {
    // SAFETY: ifreq is plain old data; all zeroes is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    if name.len() >= req.ifr_name.len() || name.contains('\0') {
        return Err(io::Error::other(format!("bad interface name {name:?}")));
    }
    for (dst, src) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *dst = libc::c_char::from_ne_bytes([src]);
    }
    let mut addr = libc::sockaddr {
        sa_family: libc::ARPHRD_ETHER,
        sa_data: [0; 14],
    };
    for (dst, src) in addr.sa_data.iter_mut().zip(mac) {
        *dst = libc::c_char::from_ne_bytes([src]);
    }
    req.ifr_ifru.ifru_hwaddr = addr;
    // SAFETY: a plain socket call; the descriptor is owned below.
    let fd = cvt(unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: `fd` was just opened and is owned by nothing else.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: SIOCSIFHWADDR reads an ifreq, which `req` is and which outlives the call.
    cvt(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFHWADDR, &req) }).map(drop)
}

/// SO_RCVTIMEO / SO_SNDTIMEO.
pub fn set_socket_timeout(fd: RawFd, option: libc::c_int, d: Option<Duration>) -> io::Result<()> {
    let d = d.unwrap_or(Duration::ZERO);
    let tv = libc::timeval {
        tv_sec: libc::time_t::try_from(d.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_usec: d.subsec_micros() as libc::suseconds_t,
    };
    // SAFETY: the option value points at a timeval of the size passed.
    cvt(unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            option,
            (&tv as *const libc::timeval).cast(),
            libc::socklen_t::try_from(std::mem::size_of::<libc::timeval>()).expect("16 bytes"),
        )
    })
    .map(drop)
}

pub fn cstring(s: &str) -> io::Result<CString> {
    CString::new(s).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "contains a NUL byte"))
}
