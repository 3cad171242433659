//! seccomp filters for the threads that handle what the guest writes: every vCPU thread (MMIO
//! and port I/O exits, the console, device registers) and every virtio device thread (the
//! queues). Each installs its own filter as its first act, before any guest code runs on it
//! or any of its queues is looked at, allowing only the system calls that thread makes; a
//! thread that then makes another is stopped with SIGSYS, and the VMM with it, after one line
//! on stderr that names the thread and the call.
//!
//! Why these threads: they are where a bug reachable from the guest would run. The controller,
//! the control socket's threads, the console input and the fork's zygote act for the host's
//! user (root, or whoever owns the socket) and keep the process's full set; confining them
//! belongs to the jail (namespaces, an unprivileged uid), not to a list of system calls.
//!
//! The lists were taken from the code and checked against every guest test in the rig (each
//! boots, snapshots, restores and forks with all devices busy); what a thread does on an
//! error path (eprintln, dropping a connection, exiting) is included.
//!
//! Modes (`MAYFLY_SECCOMP`): `on`, the default, enforces (a call not listed ends the VMM with
//! SIGSYS); `log` installs the same filters but lets a call not listed go through and has the
//! kernel log it (`dmesg`: audit type 1326, with the thread's name and the call's number);
//! `off` installs none. Enforcing became the default once the whole guest suite passed with
//! it: the enforcing runs found, besides FIONBIO, TUNSETOFFLOAD and timerfd_settime, glibc's
//! own calls on a filtered thread's behalf: the setxid broadcast when the jail drops
//! credentials, and malloc opening /proc/sys/vm/overcommit_memory (see [`no_open`]).
//!
//! Arguments are checked where it matters: a vCPU thread may only issue KVM ioctls (type
//! 0xAE), FIONBIO and TUNSETOFFLOAD; the vsock thread FIONBIO only (std's set_nonblocking);
//! the rng and net threads TUNSETOFFLOAD only (the net device's tap); the block thread none.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// Which filter a thread gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ThreadKind {
    Vcpu,
    /// virtio-rng, virtio-net: their backend descriptors and eventfds.
    Device,
    /// virtio-blk: its layer files, read, written, synced and punched.
    BlockDevice,
    /// virtio-vsock: Unix sockets to and from the host's side, made and accepted.
    VsockDevice,
}

impl ThreadKind {
    fn name(self) -> &'static str {
        match self {
            ThreadKind::Vcpu => "vcpu",
            ThreadKind::Device => "device",
            ThreadKind::BlockDevice => "block device",
            ThreadKind::VsockDevice => "vsock device",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("cannot build the {0} thread's seccomp filter: {1}")]
    Build(&'static str, String),
    #[error("cannot install the {0} thread's seccomp filter: {1}")]
    Install(&'static str, String),
    #[error("MAYFLY_SECCOMP={0:?}: use on (the default), log or off")]
    Mode(String),
}

/// What a filter does with a call it does not allow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// SIGSYS: a line on stderr, then the process ends.
    Enforce,
    /// The call goes through; the kernel logs it.
    Log,
    Off,
}

/// `MAYFLY_SECCOMP`, read once.
pub fn mode() -> Result<Mode, SeccompError> {
    static MODE: OnceLock<Result<Mode, String>> = OnceLock::new();
    MODE.get_or_init(|| match std::env::var("MAYFLY_SECCOMP").as_deref() {
        Ok("on") => Ok(Mode::Enforce),
        Err(_) | Ok("") => Ok(Mode::Enforce),
        Ok("log") => Ok(Mode::Log),
        Ok("off") => Ok(Mode::Off),
        Ok(other) => Err(other.to_owned()),
    })
    .clone()
    .map_err(SeccompError::Mode)
}

/// Every filtered thread: memory, threads and their end, time, signals (the kick, the SIGSYS
/// report), eventfds, stderr.
const COMMON: &[libc::c_long] = &[
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_writev,
    libc::SYS_close,
    libc::SYS_futex,
    libc::SYS_sched_yield,
    libc::SYS_nanosleep,
    libc::SYS_clock_nanosleep,
    libc::SYS_clock_gettime,
    libc::SYS_gettimeofday,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_madvise,
    libc::SYS_mprotect,
    libc::SYS_brk,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_rt_sigaction,
    libc::SYS_sigaltstack,
    libc::SYS_restart_syscall,
    libc::SYS_getpid,
    libc::SYS_gettid,
    libc::SYS_tgkill,
    libc::SYS_getrandom,
    // glibc's malloc counts the CPUs once, when a thread's first allocation finds eight
    // arenas made already: from /sys and /proc files (opens, refused with EACCES by
    // [`no_open`]) and then sched_getaffinity, on whichever thread allocates then.
    libc::SYS_sched_getaffinity,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_ctl,
    libc::SYS_fcntl,
    libc::SYS_poll,
    libc::SYS_ppoll,
    // Timeouts (the vsock device's handshakes) are timerfds on the event loop.
    libc::SYS_timerfd_create,
    libc::SYS_timerfd_settime,
    libc::SYS_timerfd_gettime,
    // A device can be dropped on its own thread (its last reference goes with the event
    // loop): what its Drop looks at.
    libc::SYS_fstat,
    libc::SYS_newfstatat,
    libc::SYS_statx,
];

const BLOCK: &[libc::c_long] = &[
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_preadv,
    libc::SYS_pwritev,
    libc::SYS_preadv2,
    libc::SYS_pwritev2,
    libc::SYS_fdatasync,
    libc::SYS_fsync,
    libc::SYS_fallocate,
    libc::SYS_lseek,
];

const VSOCK: &[libc::c_long] = &[
    libc::SYS_socket,
    libc::SYS_connect,
    libc::SYS_accept4,
    libc::SYS_accept,
    libc::SYS_sendto,
    libc::SYS_recvfrom,
    libc::SYS_sendmsg,
    libc::SYS_recvmsg,
    libc::SYS_shutdown,
    libc::SYS_getsockopt,
    libc::SYS_setsockopt,
    libc::SYS_getsockname,
    libc::SYS_getpeername,
    // Dropped, the device removes its host socket (after checking it is still its own).
    libc::SYS_unlink,
    libc::SYS_unlinkat,
];

/// ioctl's request number's type byte for KVM (`KVMIO`).
const KVMIO: u64 = 0xAE;

fn build(kind: ThreadKind, mode: Mode) -> Result<BpfProgram, SeccompError> {
    let fail = |e: seccompiler::BackendError| SeccompError::Build(kind.name(), e.to_string());
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    let extra: &[libc::c_long] = match kind {
        ThreadKind::Vcpu | ThreadKind::Device => &[],
        ThreadKind::BlockDevice => BLOCK,
        ThreadKind::VsockDevice => VSOCK,
    };
    for &call in COMMON.iter().chain(extra) {
        rules.insert(call, Vec::new());
    }
    // Opening files is refused by the second filter ([`no_open`]) with EACCES, not here.
    rules.insert(libc::SYS_openat, Vec::new());
    rules.insert(libc::SYS_open, Vec::new());
    // std's set_nonblocking is ioctl(FIONBIO): the vsock device sets every host connection
    // non-blocking as it makes or accepts it.
    let request = |number: libc::c_ulong| {
        SeccompCondition::new(
            1,
            SeccompCmpArgLen::Dword,
            SeccompCmpOp::Eq,
            u64::from(u32::try_from(number).unwrap_or(u32::MAX)),
        )
        .and_then(|c| SeccompRule::new(vec![c]))
    };
    let fionbio = || request(libc::FIONBIO);
    // The net device sets its tap's offloads to what the guest's driver accepted, when the
    // driver starts it: on the vCPU thread that wrote DRIVER_OK, or on its own.
    let tunsetoffload = || request(libc::TUNSETOFFLOAD);
    // The jail drops the VMM's credentials after its threads have started, and glibc makes
    // every thread of the process repeat setgroups/setresgid/setresuid (its setxid
    // broadcast, so the whole process changes at once): every filter lets those through.
    // They cannot raise a thread's rights: before the drop the thread is root already, and
    // after it an unprivileged uid can only take ids it holds. setgroups only as the jail
    // calls it, emptying the list.
    rules.insert(libc::SYS_setresuid, Vec::new());
    rules.insert(libc::SYS_setresgid, Vec::new());
    rules.insert(
        libc::SYS_setgroups,
        vec![
            SeccompCondition::new(0, SeccompCmpArgLen::Qword, SeccompCmpOp::Eq, 0)
                .and_then(|c| SeccompRule::new(vec![c]))
                .map_err(fail)?,
        ],
    );
    match kind {
        ThreadKind::Vcpu => {
            let kvm_only = SeccompCondition::new(
                1,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::MaskedEq(0xff00),
                KVMIO << 8,
            )
            .map_err(fail)?;
            rules.insert(
                libc::SYS_ioctl,
                vec![
                    SeccompRule::new(vec![kvm_only]).map_err(fail)?,
                    fionbio().map_err(fail)?,
                    tunsetoffload().map_err(fail)?,
                ],
            );
        }
        ThreadKind::VsockDevice => {
            rules.insert(libc::SYS_ioctl, vec![fionbio().map_err(fail)?]);
        }
        ThreadKind::Device => {
            rules.insert(libc::SYS_ioctl, vec![tunsetoffload().map_err(fail)?]);
        }
        ThreadKind::BlockDevice => {}
    }
    let mismatch = match mode {
        Mode::Enforce | Mode::Off => SeccompAction::Trap,
        Mode::Log => SeccompAction::Log,
    };
    let filter = SeccompFilter::new(rules, mismatch, SeccompAction::Allow, TargetArch::x86_64)
        .map_err(fail)?;
    BpfProgram::try_from(filter).map_err(fail)
}

/// The second filter every filtered thread gets: open and openat fail with EACCES (logged
/// instead, with `MAYFLY_SECCOMP=log`) rather than ending the VMM. glibc's malloc opens
/// /proc/sys/vm/overcommit_memory the first time it shrinks a thread arena's heap, on
/// whichever thread frees memory then (the enforcing guest suite lost a vsock device thread
/// to it, after a 64 MiB transfer), and takes a failed open as "do not shrink by remapping".
/// No filtered thread opens a file otherwise. Stacked filters take the strictest answer, so
/// these two calls get this filter's and every other call the first filter's.
fn no_open(mode: Mode) -> Result<&'static BpfProgram, SeccompError> {
    static PROGRAM: OnceLock<Result<BpfProgram, String>> = OnceLock::new();
    PROGRAM
        .get_or_init(|| {
            let action = match mode {
                Mode::Log => SeccompAction::Log,
                Mode::Enforce | Mode::Off => SeccompAction::Errno(libc::EACCES as u32),
            };
            let rules = [libc::SYS_openat, libc::SYS_open]
                .into_iter()
                .map(|call| (call, Vec::new()))
                .collect();
            SeccompFilter::new(rules, SeccompAction::Allow, action, TargetArch::x86_64)
                .and_then(BpfProgram::try_from)
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| SeccompError::Build("open", e.clone()))
}

/// The filters, compiled once per process (a fork's clones inherit them compiled).
fn program(kind: ThreadKind, mode: Mode) -> Result<&'static BpfProgram, SeccompError> {
    static PROGRAMS: OnceLock<Result<[BpfProgram; 4], String>> = OnceLock::new();
    let all = PROGRAMS.get_or_init(|| {
        let one = |k| build(k, mode).map_err(|e| e.to_string());
        Ok([
            one(ThreadKind::Vcpu)?,
            one(ThreadKind::Device)?,
            one(ThreadKind::BlockDevice)?,
            one(ThreadKind::VsockDevice)?,
        ])
    });
    let all = all
        .as_ref()
        .map_err(|e| SeccompError::Build(kind.name(), e.clone()))?;
    Ok(&all[match kind {
        ThreadKind::Vcpu => 0,
        ThreadKind::Device => 1,
        ThreadKind::BlockDevice => 2,
        ThreadKind::VsockDevice => 3,
    }])
}

thread_local! {
    /// Which filter this thread runs under (0: none), for the SIGSYS report.
    static KIND: std::cell::Cell<u8> = const { std::cell::Cell::new(0) };
}

/// Install `kind`'s filter on the calling thread (and the SIGSYS report, once per process).
/// With `MAYFLY_SECCOMP=off`, nothing.
pub fn install(kind: ThreadKind) -> Result<(), SeccompError> {
    let mode = mode()?;
    if mode == Mode::Off {
        return Ok(());
    }
    install_reporter().map_err(|e| SeccompError::Install(kind.name(), e.to_string()))?;
    let program = program(kind, mode)?;
    KIND.with(|k| {
        k.set(match kind {
            ThreadKind::Vcpu => 1,
            ThreadKind::Device => 2,
            ThreadKind::BlockDevice => 3,
            ThreadKind::VsockDevice => 4,
        })
    });
    let no_open = no_open(mode)?;
    seccompiler::apply_filter(no_open)
        .and_then(|()| seccompiler::apply_filter(program))
        .map_err(|e| SeccompError::Install(kind.name(), e.to_string()))
}

fn install_reporter() -> std::io::Result<()> {
    static DONE: OnceLock<Result<(), i32>> = OnceLock::new();
    let done = DONE.get_or_init(|| {
        // SAFETY: a zeroed sigaction is valid; the handler is an extern "C" fn of the
        // SA_SIGINFO shape that only makes async-signal-safe calls.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_sigsys as *const () as usize;
            action.sa_flags = libc::SA_SIGINFO;
            libc::sigemptyset(&mut action.sa_mask);
            if libc::sigaction(libc::SIGSYS, &action, std::ptr::null_mut()) != 0 {
                return Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0));
            }
        }
        Ok(())
    });
    done.map_err(std::io::Error::from_raw_os_error)
}

/// The SIGSYS handler: one line naming the thread's filter and the call, then the process
/// ends with SIGSYS. Only write(2), sigaction(2) and raise (tgkill) are called here:
/// every filter allows them.
extern "C" fn on_sigsys(
    _signal: libc::c_int,
    info: *mut libc::siginfo_t,
    _context: *mut libc::c_void,
) {
    // siginfo's _sigsys: after si_signo, si_errno, si_code (and padding to 16 bytes), the
    // faulting call's address (8 bytes), then the system call number (int).
    // SAFETY: the kernel passes a valid siginfo_t for SIGSYS, whose _sigsys member lays out
    // as above on x86-64.
    let call = unsafe {
        info.cast::<u8>()
            .add(24)
            .cast::<libc::c_int>()
            .read_unaligned()
    };
    let kind = KIND.with(|k| k.get());
    let name: &[u8] = match kind {
        1 => b"vcpu",
        2 => b"device",
        3 => b"block device",
        4 => b"vsock device",
        _ => b"unfiltered",
    };
    let mut line = [0u8; 160];
    let mut len = 0;
    let mut put = |bytes: &[u8]| {
        for &b in bytes {
            if len < line.len() {
                line[len] = b;
                len += 1;
            }
        }
    };
    put(b"mayfly: seccomp: a ");
    put(name);
    put(b" thread made system call ");
    let mut digits = [0u8; 12];
    let mut n = i64::from(call).unsigned_abs();
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + u8::try_from(n % 10).unwrap_or(0);
        n /= 10;
        if n == 0 {
            break;
        }
    }
    put(&digits[at..]);
    put(
        b", which its filter forbids: the VMM stops (a bug in mayfly: report it; \
          MAYFLY_SECCOMP=log lets such calls through and has the kernel log them)\n",
    );
    // SAFETY: write(2) of a stack buffer to stderr; async-signal-safe.
    unsafe { libc::write(2, line.as_ptr().cast(), len) };
    // SAFETY: restoring SIGSYS's default action and raising it are async-signal-safe; the
    // signal is blocked in this handler, so it ends the process as the handler returns.
    unsafe {
        libc::signal(libc::SIGSYS, libc::SIG_DFL);
        libc::raise(libc::SIGSYS);
    }
}
