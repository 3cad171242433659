//! The host end of a virtio-net device: a tap opened with `IFF_TAP | IFF_NO_PI | IFF_VNET_HDR`
//! (or, for tests and userspace switches, a `SOCK_SEQPACKET`/`SOCK_DGRAM` socket). Either way
//! every read or write is one Ethernet frame behind the 12-byte virtio-net header
//! (`virtio_net_hdr_v1`), so a frame crosses between guest and host with its offload metadata.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use crate::virtio::net::error::NetError;
use crate::virtio::net::spec::VNET_HDR_LEN;

/// `struct ifreq` as TUNGETIFF fills it: the name, then the flags (the rest is a union).
#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Tap,
    Socket,
}

pub(super) struct Backend {
    fd: OwnedFd,
    kind: Kind,
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor we own, with integer arguments only.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

impl Backend {
    /// A tap: it must have been opened with IFF_TAP, IFF_NO_PI and IFF_VNET_HDR. Its header
    /// size is set to the 12 bytes of `virtio_net_hdr_v1`, and it is made non-blocking.
    pub(super) fn tap(fd: OwnedFd) -> Result<Self, NetError> {
        let mut req = IfReq {
            name: [0; libc::IFNAMSIZ],
            flags: 0,
            _pad: [0; 22],
        };
        // SAFETY: TUNGETIFF writes a struct ifreq (40 bytes, the size of IfReq) into `req`.
        let r = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNGETIFF, &mut req as *mut IfReq) };
        if r < 0 {
            return Err(NetError::NotATap(io::Error::last_os_error()));
        }
        let flags = i32::from(req.flags);
        let needed = libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR;
        if flags & needed != needed {
            return Err(NetError::TapFlags(u32::from(u16::from_ne_bytes(
                req.flags.to_ne_bytes(),
            ))));
        }
        let size = libc::c_int::try_from(VNET_HDR_LEN).expect("a 12-byte header");
        // SAFETY: TUNSETVNETHDRSZ reads one int from the pointer.
        let r = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETVNETHDRSZ, &size) };
        if r < 0 {
            return Err(NetError::TapSetup(io::Error::last_os_error()));
        }
        set_nonblocking(fd.as_raw_fd()).map_err(NetError::TapSetup)?;
        Ok(Self {
            fd,
            kind: Kind::Tap,
        })
    }

    /// A datagram or seqpacket socket carrying the same header-and-frame messages.
    pub(super) fn socket(fd: OwnedFd) -> Result<Self, NetError> {
        let mut ty: libc::c_int = 0;
        let mut len =
            libc::socklen_t::try_from(std::mem::size_of::<libc::c_int>()).expect("4 bytes");
        // SAFETY: SO_TYPE writes one int; `len` says how much room there is.
        let r = unsafe {
            libc::getsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_TYPE,
                (&mut ty as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        if r < 0 || !(ty == libc::SOCK_SEQPACKET || ty == libc::SOCK_DGRAM) {
            return Err(NetError::NotADatagramSocket);
        }
        set_nonblocking(fd.as_raw_fd()).map_err(NetError::TapSetup)?;
        Ok(Self {
            fd,
            kind: Kind::Socket,
        })
    }

    /// Which offloads the tap may hand us (`TUN_F_*`): what the guest said it can take.
    pub(super) fn set_offload(&self, flags: u32) -> io::Result<()> {
        if self.kind != Kind::Tap {
            return Ok(());
        }
        // SAFETY: TUNSETOFFLOAD takes its argument by value; no memory is passed.
        let r = unsafe {
            libc::ioctl(
                self.fd.as_raw_fd(),
                libc::TUNSETOFFLOAD,
                libc::c_ulong::from(flags),
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Write one frame gathered from `iov`.
    ///
    /// # Safety
    /// Every iovec must point at `iov_len` readable bytes that stay mapped during the call.
    pub(super) unsafe fn writev(&self, iov: &[libc::iovec]) -> io::Result<usize> {
        let count = iov.len().min(MAX_IOV);
        let n = match self.kind {
            // SAFETY: the caller guarantees the buffers; the kernel only reads them.
            Kind::Tap => unsafe {
                libc::writev(
                    self.fd.as_raw_fd(),
                    iov.as_ptr(),
                    MAX_IOV_C.min(count_c(count)),
                )
            },
            Kind::Socket => {
                // SAFETY: an all-zero msghdr is a valid empty one.
                let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
                msg.msg_iov = iov.as_ptr().cast_mut();
                msg.msg_iovlen = count;
                // SAFETY: as for writev; MSG_NOSIGNAL turns a closed peer into EPIPE rather
                // than a SIGPIPE.
                unsafe { libc::sendmsg(self.fd.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) }
            }
        };
        // Negative: the call failed.
        usize::try_from(n).map_err(|_| io::Error::last_os_error())
    }

    /// Read one frame into `buf` (a frame longer than `buf` is cut short by the kernel).
    pub(super) fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: read writes at most `buf.len()` bytes into our buffer.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        // Negative: the call failed.
        usize::try_from(n).map_err(|_| io::Error::last_os_error())
    }
}

/// The most iovecs one writev takes (UIO_MAXIOV, 1024), as a length and as the C count.
const MAX_IOV: usize = 1024;
const MAX_IOV_C: libc::c_int = libc::UIO_MAXIOV;
const _: () = assert!(MAX_IOV_C == 1024);

/// An iovec count at most [`MAX_IOV`] as the C int writev takes.
fn count_c(count: usize) -> libc::c_int {
    libc::c_int::try_from(count).unwrap_or(MAX_IOV_C)
}

impl AsRawFd for Backend {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}
