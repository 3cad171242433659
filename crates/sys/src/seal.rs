//! Memfd seals that hold even while the kernel is moving the file's pages.
//!
//! `F_SEAL_WRITE` is refused (EBUSY) while any page of the file has a reference besides the
//! page cache's and its mappings', and the kernel waits only about 150 ms (10 + 20 + 40 +
//! 80 ms) for such references to go. Page migration takes one: compaction isolates the
//! pages it moves, and when the task compacting (kcompactd, or any process whose huge-page
//! fault compacts directly) is itself waiting for a CPU, it holds them longer than that.
//! Measured on this project's 2-core host with the compaction of `/proc/sys/vm/compact_memory`
//! at nice 19 beside 12 busy loops: 2 of 100 seals of a 64 MiB memfd failed after 168 and
//! 198 ms; sealing again until it took succeeded in 100 of 100, the worst after 8 more
//! tries. So a seal refused after the kernel's wait is asked again, until [`SEAL_PATIENCE`]
//! has passed: the reference is the kernel's own and goes. A file someone has mapped shared
//! and writable is refused at once (no wait), and that is not asked again: waiting does not
//! unmap it.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// How long [`add_seals`] keeps asking while the kernel answers EBUSY.
pub const SEAL_PATIENCE: Duration = Duration::from_secs(5);

/// An EBUSY that came back sooner than this was not the kernel's wait for page references
/// (at least 150 ms) but a shared writable mapping.
const WAITED: Duration = Duration::from_millis(100);

/// Add `seals` (`F_SEAL_*`) to the memfd `file`. Asked again while the kernel answers EBUSY
/// after waiting for page references to go, for up to [`SEAL_PATIENCE`]; an EBUSY for a
/// shared writable mapping is returned at once. Returns how many times it asked again.
pub fn add_seals(file: &File, seals: libc::c_int) -> std::io::Result<u32> {
    let deadline = Instant::now() + SEAL_PATIENCE;
    let mut again = 0;
    loop {
        let asked = Instant::now();
        // SAFETY: fcntl on a descriptor the caller owns; the result is checked.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } == 0 {
            return Ok(again);
        }
        let err = std::io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EINTR) => {}
            Some(libc::EBUSY) if asked.elapsed() >= WAITED && Instant::now() < deadline => {
                again += 1
            }
            _ => return Err(err),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::fd::FromRawFd;

    use super::*;

    fn memfd() -> File {
        // SAFETY: a valid NUL-terminated name; the result is checked.
        let fd = unsafe {
            libc::memfd_create(
                c"seal-test".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        assert!(fd >= 0, "{}", std::io::Error::last_os_error());
        // SAFETY: a new descriptor nothing else owns.
        unsafe { File::from_raw_fd(fd) }
    }

    /// The first page of `file`, mapped shared and writable (the caller unmaps it).
    fn map_shared_page(file: &File) -> *mut libc::c_void {
        // SAFETY: a new shared mapping of the caller's memfd; the caller unmaps it.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(addr, libc::MAP_FAILED);
        addr
    }

    #[test]
    fn a_sealed_file_refuses_writes() {
        let mut file = memfd();
        file.write_all(b"kept").unwrap();
        add_seals(
            &file,
            libc::F_SEAL_WRITE | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW,
        )
        .unwrap();
        let err = file.write_all(b"changed").unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");
    }

    #[test]
    fn a_file_mapped_shared_and_writable_is_refused_at_once() {
        let file = memfd();
        file.set_len(4096).unwrap();
        let addr = map_shared_page(&file);
        let started = Instant::now();
        let err = add_seals(&file, libc::F_SEAL_WRITE).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EBUSY), "{err}");
        let took = started.elapsed();
        // Not asked again: the kernel answered at once (asking again would take 150 ms each).
        assert!(took < Duration::from_secs(1), "asked again for {took:?}");
        // SAFETY: the mapping made above, no longer used.
        unsafe { libc::munmap(addr, 4096) };
        add_seals(&file, libc::F_SEAL_WRITE).unwrap();
    }

    #[test]
    fn a_page_reference_held_past_the_kernels_wait_delays_the_seal_but_does_not_fail_it() {
        // A pipe holding a page of the file (vmsplice takes a reference, as page migration
        // does), read out only after the kernel's own wait (150 ms) has given up once.
        let file = memfd();
        file.set_len(4096).unwrap();
        let addr = map_shared_page(&file);
        // SAFETY: the page is mapped and ours.
        unsafe { addr.cast::<u8>().write(7) };
        let mut pipe = [0; 2];
        // SAFETY: a valid array for two descriptors; checked.
        assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
        // SAFETY: the descriptors pipe() just made, owned here.
        let (reader, writer) = unsafe { (File::from_raw_fd(pipe[0]), File::from_raw_fd(pipe[1])) };
        let iov = libc::iovec {
            iov_base: addr,
            iov_len: 4096,
        };
        // SAFETY: one iovec over the mapped page; checked.
        let spliced = unsafe { libc::vmsplice(writer.as_raw_fd(), &iov, 1, 0) };
        assert_eq!(spliced, 4096, "{}", std::io::Error::last_os_error());
        // SAFETY: the mapping made above; the pipe keeps its own reference to the page.
        unsafe { libc::munmap(addr, 4096) };
        // Held for a second from just before the seal is asked for: past the kernel's own
        // wait, however late this thread gets to ask.
        let (go, asked) = std::sync::mpsc::channel::<()>();
        let drain = std::thread::spawn(move || {
            asked.recv().unwrap();
            std::thread::sleep(Duration::from_secs(1));
            let mut page = vec![0u8; 4096];
            std::io::Read::read_exact(&mut &reader, &mut page).unwrap();
            page[0]
        });
        go.send(()).unwrap();
        let again = add_seals(&file, libc::F_SEAL_WRITE).unwrap();
        assert_eq!(drain.join().unwrap(), 7);
        assert!(
            again >= 1,
            "the reference did not outlast the kernel's wait"
        );
        drop(writer);
    }
}
