//! Vectored positioned I/O over lists of host buffers (`iovec`s), and a cursor that hands out
//! consecutive byte ranges of such a list.

use std::fs::File;
use std::io::ErrorKind;
use std::os::fd::AsRawFd;

/// At most this many iovecs go into one preadv/pwritev (Linux's `IOV_MAX`).
const IOV_MAX: usize = 1024;

/// A list of memory buffers (host addresses and lengths) for one vectored read or write, kept
/// between requests so building one allocates nothing. It holds plain addresses: using them is
/// what is unsafe (see [`crate::disk::Disk::read_vectored`]).
#[derive(Default)]
pub struct IoVecs(Vec<libc::iovec>);

// SAFETY: an IoVecs is a list of addresses that this type never dereferences; the code that
// fills it and passes it to an unsafe read or write promises the memory is valid, on the thread
// that makes the call. Sending the list elsewhere gives no access by itself.
unsafe impl Send for IoVecs {}

impl IoVecs {
    pub fn with_capacity(n: usize) -> Self {
        Self(Vec::with_capacity(n))
    }

    pub fn clear(&mut self) {
        self.0.clear();
    }

    /// Add a buffer of `len` bytes at `ptr`.
    pub fn push(&mut self, ptr: *mut u8, len: usize) {
        if len > 0 {
            self.0.push(libc::iovec {
                iov_base: ptr.cast(),
                iov_len: len,
            });
        }
    }

    /// How many buffers.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The bytes of all buffers together (None if that overflows).
    pub fn total(&self) -> Option<u64> {
        total(&self.0)
    }

    pub(crate) fn as_slice(&self) -> &[libc::iovec] {
        &self.0
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [libc::iovec] {
        &mut self.0
    }
}

pub(crate) fn total(iov: &[libc::iovec]) -> Option<u64> {
    iov.iter()
        .try_fold(0u64, |sum, v| sum.checked_add(v.iov_len as u64))
}

/// Hands out consecutive ranges of a request's buffers.
pub(crate) struct Cursor<'a> {
    iov: &'a [libc::iovec],
    index: usize,
    offset: usize,
}

impl<'a> Cursor<'a> {
    pub fn new(iov: &'a [libc::iovec]) -> Self {
        Self {
            iov,
            index: 0,
            offset: 0,
        }
    }

    /// Append iovecs covering the next `len` bytes to `out` (fewer if the buffers end first,
    /// which callers rule out by checking the total beforehand).
    pub fn take(&mut self, mut len: u64, out: &mut IoVecs) {
        while len > 0 && self.index < self.iov.len() {
            let v = self.iov[self.index];
            let left = v.iov_len - self.offset;
            let n = left.min(usize::try_from(len).unwrap_or(usize::MAX));
            // The address arithmetic stays within the buffer the caller vouched for.
            out.push(v.iov_base.cast::<u8>().wrapping_add(self.offset), n);
            len -= n as u64;
            self.offset += n;
            if self.offset == v.iov_len {
                self.index += 1;
                self.offset = 0;
            }
        }
    }
}

/// Fill every buffer of `iov` with zeros.
///
/// # Safety
/// Every buffer must be valid for writes of its length.
pub(crate) unsafe fn zero(iov: &[libc::iovec]) {
    for v in iov {
        // SAFETY: the caller guarantees the buffer is writable for its length.
        unsafe { std::ptr::write_bytes(v.iov_base.cast::<u8>(), 0, v.iov_len) };
    }
}

/// Copy the bytes of `iov` (in order) into `dst`, which has their total length.
///
/// # Safety
/// Every buffer must be valid for reads of its length and must not overlap `dst`.
pub(crate) unsafe fn gather(iov: &[libc::iovec], dst: &mut [u8]) {
    let mut at = 0;
    for v in iov {
        let n = v.iov_len.min(dst.len() - at);
        // SAFETY: the source is readable for its length (caller), the destination range is in
        // bounds of `dst` (n is clamped to what is left), and they do not overlap (caller).
        unsafe {
            std::ptr::copy_nonoverlapping(v.iov_base.cast::<u8>(), dst[at..].as_mut_ptr(), n)
        };
        at += n;
    }
}

/// Drop the first `n` bytes from `iov[*start..]`, moving `*start` past buffers used up.
fn advance(iov: &mut [libc::iovec], start: &mut usize, mut n: usize) {
    while n > 0 && *start < iov.len() {
        let v = &mut iov[*start];
        if n >= v.iov_len {
            n -= v.iov_len;
            *start += 1;
        } else {
            v.iov_base = v.iov_base.cast::<u8>().wrapping_add(n).cast();
            v.iov_len -= n;
            n = 0;
        }
    }
}

/// Which vectored call [`vectored_full`] makes.
#[derive(Clone, Copy)]
enum Direction {
    Read,
    Write,
}

/// Move all of `iov` at `pos` with preadv or pwritev, IOV_MAX buffers per call, retrying on
/// EINTR; returns how many iovecs were done completely when a call moved nothing (end of
/// file for a read, a write that wrote nothing), else `iov.len()`.
///
/// # Safety
/// Every buffer must be valid for writes (a read) or reads (a write) of its length.
unsafe fn vectored_full(
    file: &File,
    mut pos: u64,
    iov: &mut [libc::iovec],
    direction: Direction,
) -> std::io::Result<usize> {
    let mut start = 0;
    while start < iov.len() {
        let batch = &iov[start..iov.len().min(start + IOV_MAX)];
        let offset = libc::off_t::try_from(pos)
            .map_err(|_| std::io::Error::from(ErrorKind::InvalidInput))?;
        // At most IOV_MAX (1024) entries.
        let count = libc::c_int::try_from(batch.len()).expect("a batch of at most IOV_MAX");
        let (fd, ptr) = (file.as_raw_fd(), batch.as_ptr());
        // SAFETY: the iovecs point at memory the caller guarantees writable (a read) or
        // readable (a write) for their lengths; the count is at most IOV_MAX.
        let n = unsafe {
            match direction {
                Direction::Read => libc::preadv(fd, ptr, count, offset),
                Direction::Write => libc::pwritev(fd, ptr, count, offset),
            }
        };
        // Negative: the call failed.
        let Ok(n) = usize::try_from(n) else {
            let err = std::io::Error::last_os_error();
            if err.kind() == ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        };
        if n == 0 {
            return Ok(start);
        }
        pos += n as u64;
        advance(iov, &mut start, n);
    }
    Ok(start)
}

/// Read at `pos` into all of `iov`. Returns the index of the first buffer not (fully) filled
/// when the file ended first (`iov.len()` when everything was read); that buffer has been
/// shortened to what is left of it, so `iov[returned..]` is exactly the unfilled part.
///
/// # Safety
/// Every buffer must be valid for writes of its length.
pub(crate) unsafe fn preadv_full(
    file: &File,
    pos: u64,
    iov: &mut [libc::iovec],
) -> std::io::Result<usize> {
    // SAFETY: passed on from the caller.
    unsafe { vectored_full(file, pos, iov, Direction::Read) }
}

/// Write all of `iov` at `pos`.
///
/// # Safety
/// Every buffer must be valid for reads of its length.
pub(crate) unsafe fn pwritev_full(
    file: &File,
    pos: u64,
    iov: &mut [libc::iovec],
) -> std::io::Result<()> {
    let len = iov.len();
    // SAFETY: passed on from the caller.
    match unsafe { vectored_full(file, pos, iov, Direction::Write) }? {
        done if done == len => Ok(()),
        _ => Err(ErrorKind::WriteZero.into()),
    }
}

/// Free the blocks of `[pos, pos + len)` in `file` (they read as zeros). Filesystems that
/// cannot punch holes keep the blocks: callers never rely on the hole, only on their map.
pub(crate) fn punch_hole(file: &File, pos: u64, len: u64) -> std::io::Result<()> {
    let (Ok(offset), Ok(len)) = (libc::off_t::try_from(pos), libc::off_t::try_from(len)) else {
        return Err(ErrorKind::InvalidInput.into());
    };
    loop {
        // SAFETY: fallocate on a descriptor we own; no memory is involved.
        let rc = unsafe {
            libc::fallocate(
                file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset,
                len,
            )
        };
        if rc == 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => return Ok(()),
            _ => return Err(err),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursor_hands_out_consecutive_ranges() {
        let mut a = [0u8; 10];
        let mut b = [0u8; 6];
        let mut list = IoVecs::default();
        list.push(a.as_mut_ptr(), a.len());
        list.push(b.as_mut_ptr(), b.len());
        let mut cursor = Cursor::new(list.as_slice());
        let mut out = IoVecs::default();
        cursor.take(4, &mut out);
        assert_eq!(out.total(), Some(4));
        out.clear();
        cursor.take(8, &mut out);
        assert_eq!(out.len(), 2, "crosses into the second buffer");
        assert_eq!(out.total(), Some(8));
        out.clear();
        cursor.take(100, &mut out);
        assert_eq!(out.total(), Some(4), "only what is left");
    }

    #[test]
    fn advance_skips_and_shortens() {
        let mut a = [0u8; 4];
        let mut b = [0u8; 4];
        let mut list = IoVecs::default();
        list.push(a.as_mut_ptr(), 4);
        list.push(b.as_mut_ptr(), 4);
        let mut start = 0;
        advance(list.as_mut_slice(), &mut start, 6);
        assert_eq!(start, 1);
        assert_eq!(list.as_slice()[1].iov_len, 2);
    }
}
