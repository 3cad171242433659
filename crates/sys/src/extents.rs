//! Where a file holds data and where it has holes (SEEK_DATA / SEEK_HOLE), and holes punched.

use std::fs::File;
use std::os::fd::AsRawFd;

/// The (start, length) extents of `file` holding data within `start..start + len`; the rest
/// are holes (read as zeros). On a file system without SEEK_DATA the whole range counts as
/// data. The one SEEK_DATA loop: the eager copy, the snapshot writer and the lazy handler use it.
pub fn data_extents(file: &File, start: u64, len: u64) -> std::io::Result<Vec<(u64, u64)>> {
    let end = start.saturating_add(len);
    let fd = file.as_raw_fd();
    let to_off = |pos: u64| {
        libc::off_t::try_from(pos)
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))
    };
    let mut extents = Vec::new();
    let mut pos = start;
    while pos < end {
        // SAFETY: lseek on a valid fd; the result is checked. It moves the file position,
        // which nothing uses: every read and write of these files is positioned.
        let data = unsafe { libc::lseek(fd, to_off(pos)?, libc::SEEK_DATA) };
        // Negative: the call failed.
        let Ok(data) = u64::try_from(data) else {
            let err = std::io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::ENXIO) => break, // no data after pos
                Some(libc::EINVAL) if pos == start => {
                    // No SEEK_DATA here: all of it is data, up to the file's end.
                    let file_len = file.metadata()?.len();
                    let end = end.min(file_len);
                    return Ok(if end > start {
                        vec![(start, end - start)]
                    } else {
                        Vec::new()
                    });
                }
                _ => return Err(err),
            }
        };
        if data >= end {
            break;
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, to_off(data)?, libc::SEEK_HOLE) };
        let Ok(hole) = u64::try_from(hole) else {
            return Err(std::io::Error::last_os_error());
        };
        let hole = hole.min(end);
        if hole <= data {
            break;
        }
        extents.push((data, hole - data));
        pos = hole;
    }
    Ok(extents)
}

/// Make `offset..offset + len` of `file` a hole (zeros).
pub fn punch_hole(file: &File, offset: u64, len: u64) -> std::io::Result<()> {
    let off = |v: u64| {
        libc::off_t::try_from(v).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))
    };
    // SAFETY: fallocate on a descriptor we own; the result is checked.
    let rc = unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            off(offset)?,
            off(len)?,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}
