//! fork(2) into a cgroup. A child born in its cgroup (clone3 with `CLONE_INTO_CGROUP`, Linux
//! 5.7) costs what a fork costs. A fork followed by a write of the child's pid to
//! `cgroup.procs` costs a move, and a move takes the kernel's cgroup thread-group lock for
//! writing, which waits for an RCU grace period unless the cgroup2 hierarchy is mounted with
//! `favordynmods`. Measured on this project's host (2 vCPUs, Linux 6.18, cgroup2 without
//! favordynmods, medians of 15): fork 0.31 ms, fork then move 7.8 ms (v1 and v2 alike),
//! clone3 into the cgroup 0.45 ms. Moves are serialised host-wide, so a jail that moved its
//! VMM made every start of a fork into 100 wait its turn.

use std::os::fd::{AsRawFd, BorrowedFd};

/// What [`fork_into`] returns in each process.
#[derive(Debug)]
pub enum Forked {
    Parent { child: libc::pid_t },
    Child,
}

/// clone3's arguments up to `cgroup` (CLONE_ARGS_SIZE_VER2, 88 bytes).
#[repr(C)]
#[derive(Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

/// fork(2), the child born in the cgroup v2 directory `cgroup` (an `O_DIRECTORY` descriptor),
/// with SIGCHLD to its parent when it ends. An error means no child was made (a kernel before
/// 5.7, a cgroup that takes no processes): the caller forks and moves instead.
///
/// # Safety
/// As for fork(2), and one of: the calling process has a single thread, or the child calls
/// only async-signal-safe functions until it execs or `_exit`s (the child is a copy of the
/// calling thread, and glibc's fork handlers do not run). A raw clone3 leaves glibc's state
/// of the main thread as the parent's where glibc's own fork updates it: its thread id (the
/// child must not use its main thread's `pthread_t` with `pthread_kill`,
/// `pthread_setaffinity_np`, `pthread_setschedparam` or `pthread_getcpuclockid`; a
/// recursive or error-checking mutex the main thread holds could be taken for a later
/// thread's that got the same id) and its robust-futex list (not registered again: robust
/// mutexes the main thread holds are not released if it dies). Signalling itself is
/// unaffected (glibc's raise asks the kernel for the thread's id). mayfly's jailed VMM does
/// none of these on its main thread.
pub unsafe fn fork_into(cgroup: BorrowedFd<'_>) -> std::io::Result<Forked> {
    let fd = u64::try_from(cgroup.as_raw_fd())
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EBADF))?;
    let mut args = CloneArgs {
        // CLONE_INTO_CGROUP is 1 << 33: libc declares it as a c_int that cannot hold it.
        flags: 1 << 33,
        exit_signal: libc::SIGCHLD as u64,
        cgroup: fd,
        ..CloneArgs::default()
    };
    // SAFETY: clone3 with a valid argument block of the size given, no new stack and no
    // shared memory: the child runs on a copy of this process (which has one thread, as the
    // caller promises), returning 0 here, as from fork.
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone3,
            &mut args as *mut CloneArgs,
            std::mem::size_of::<CloneArgs>(),
        )
    };
    match pid {
        0 => Ok(Forked::Child),
        p if p > 0 => Ok(Forked::Parent {
            child: libc::pid_t::try_from(p)
                .map_err(|_| std::io::Error::from_raw_os_error(libc::EOVERFLOW))?,
        }),
        _ => Err(std::io::Error::last_os_error()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_is_born_in_the_cgroup_named() {
        // Needs a cgroup2 hierarchy this (root) test may write; the unit tests run as root
        // on the project's machines, whose cgroup2 is at /sys/fs/cgroup or its unified/.
        let mount = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
            .iter()
            .map(std::path::Path::new)
            .find(|p| p.join("cgroup.procs").exists() && p.join("cgroup.subtree_control").exists())
            .expect("a cgroup v2 hierarchy (mount -t cgroup2 none /sys/fs/cgroup)");
        let dir = mount.join(format!("mayfly-fork-test-{}", std::process::id()));
        std::fs::create_dir(&dir).expect("make a cgroup");
        let fd = std::fs::File::open(&dir).expect("open the cgroup");
        // The test harness runs threads: the child makes only system calls (no allocation,
        // whose lock another thread may have held at the fork) before it ends.
        let (read, write) = std::os::unix::net::UnixStream::pair().expect("a pair");
        use std::io::Read;
        use std::os::fd::AsFd;
        // SAFETY: the child calls only open, read, write and _exit.
        match unsafe { fork_into(fd.as_fd()) }.expect("clone3 into the cgroup") {
            Forked::Child => {
                let mut buf = [0u8; 1024];
                // SAFETY: open/read/write on a NUL-terminated path and a buffer of our own;
                // _exit ends the child without running the parent's destructors.
                unsafe {
                    let own = libc::open(c"/proc/self/cgroup".as_ptr(), libc::O_RDONLY);
                    let n = libc::read(own, buf.as_mut_ptr().cast(), buf.len());
                    if n > 0 {
                        libc::write(write.as_raw_fd(), buf.as_ptr().cast(), n as usize);
                    }
                    libc::_exit(0);
                }
            }
            Forked::Parent { child } => {
                drop(write);
                let mut said = String::new();
                (&read)
                    .read_to_string(&mut said)
                    .expect("the child's answer");
                let mut status = 0;
                // SAFETY: waitpid on our own child.
                unsafe { libc::waitpid(child, &mut status, 0) };
                let name = dir.file_name().unwrap().to_string_lossy().into_owned();
                let _ = std::fs::remove_dir(&dir);
                let v2 = said.lines().find(|l| l.starts_with("0::")).unwrap_or("");
                assert!(
                    v2.ends_with(&format!("/{name}")),
                    "the child was in {said:?}"
                );
            }
        }
    }
}
