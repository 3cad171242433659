//! seccomp filters, one per kind of thread, for every thread that handles what the guest writes
//! or that serves a client: every vCPU thread (MMIO and port I/O exits, the console, device
//! registers), every virtio device thread (the queues), the lazy-memory handler (guest page
//! faults), the console's input, and the control socket's threads with the guest agent's
//! refresh (HTTP from the socket's clients, frames from the guest's agent). Each installs its
//! own filter as its first act, before any guest code runs on it, any of its queues is looked
//! at or any request is read, allowing only the system calls that thread makes; a thread that
//! then makes another is stopped with SIGSYS, and the VMM with it, after one line on stderr
//! that names the thread and the call. A thread a filtered thread starts (the control socket's
//! connection threads) runs under the same filter.
//!
//! Not filtered: the controller (the main thread), which acts on the host for the VMM's own
//! user: it writes snapshots and disk layers wherever it is told, starts a fork's zygote
//! (fork and exec), makes networks. Its list would be most of the system call table; what
//! confines it is the jail (namespaces, a root holding only the VM's files, an unprivileged
//! uid). The zygote and the clones it forks inherit nothing: each clone installs its own
//! filters on its own threads.
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
//! credentials, and malloc opening /proc/sys/vm/overcommit_memory (see [`refusals`]).
//!
//! Arguments are checked where it matters: a vCPU thread may only issue KVM ioctls (type
//! 0xAE), FIONBIO and TUNSETOFFLOAD; the lazy-memory handler userfaultfd's ioctls (type 0xAA)
//! only; the vsock thread and the control socket's threads FIONBIO only (std's
//! set_nonblocking); the rng and net threads TUNSETOFFLOAD only (the net device's tap); the
//! block and console threads none. The control socket's threads may start threads, never
//! processes: `clone` only with CLONE_THREAD, and `clone3` (whose flags a filter cannot read)
//! answers ENOSYS, on which glibc falls back to `clone`.

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
    /// The control socket's threads (accepting, one per connection, the exec watchers) and the
    /// guest agent's refresh: Unix sockets, and threads of their own.
    Api,
    /// The console's input: reads stdin or its FIFO, queues the bytes in the UART.
    Console,
    /// The lazy-memory handler: the memory file read, userfaultfd's ioctls.
    LazyMemory,
}

impl ThreadKind {
    /// Every kind, in the order of [`ThreadKind::index`].
    const ALL: [ThreadKind; 7] = [
        ThreadKind::Vcpu,
        ThreadKind::Device,
        ThreadKind::BlockDevice,
        ThreadKind::VsockDevice,
        ThreadKind::Api,
        ThreadKind::Console,
        ThreadKind::LazyMemory,
    ];

    fn name(self) -> &'static str {
        match self {
            ThreadKind::Vcpu => "vcpu",
            ThreadKind::Device => "device",
            ThreadKind::BlockDevice => "block device",
            ThreadKind::VsockDevice => "vsock device",
            ThreadKind::Api => "control socket",
            ThreadKind::Console => "console input",
            ThreadKind::LazyMemory => "lazy memory",
        }
    }

    fn index(self) -> usize {
        match self {
            ThreadKind::Vcpu => 0,
            ThreadKind::Device => 1,
            ThreadKind::BlockDevice => 2,
            ThreadKind::VsockDevice => 3,
            ThreadKind::Api => 4,
            ThreadKind::Console => 5,
            ThreadKind::LazyMemory => 6,
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

/// Unix sockets: made, connected, accepted, read and written (the vsock device's host side,
/// the control socket's clients and its connections to the guest agent).
const SOCKETS: &[libc::c_long] = &[
    libc::SYS_socket,
    libc::SYS_socketpair,
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
];

/// The vsock device, besides its sockets: dropped, it removes its host socket (after checking
/// it is still its own).
const VSOCK: &[libc::c_long] = &[libc::SYS_unlink, libc::SYS_unlinkat];

/// A thread that starts threads (the control socket's): what glibc's pthread_create and a new
/// thread's start and end make, besides memory and signals. `clone` itself is added with its
/// flags checked, and `clone3` is refused with ENOSYS by [`refusals`].
const THREADS: &[libc::c_long] = &[libc::SYS_set_robust_list, libc::SYS_rseq];

/// The lazy-memory handler: the memory file read into its buffer; whether a page is in
/// memory already (a fault that raced with a load).
const LAZY: &[libc::c_long] = &[libc::SYS_pread64, libc::SYS_mincore];

/// ioctl's request number's type byte for KVM (`KVMIO`).
const KVMIO: u64 = 0xAE;
/// ioctl's request number's type byte for userfaultfd (`UFFDIO`).
const UFFDIO: u64 = 0xAA;

fn build(kind: ThreadKind, mode: Mode) -> Result<BpfProgram, SeccompError> {
    let fail = |e: seccompiler::BackendError| SeccompError::Build(kind.name(), e.to_string());
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    let extra: &[&[libc::c_long]] = match kind {
        ThreadKind::Vcpu | ThreadKind::Device | ThreadKind::Console => &[],
        ThreadKind::BlockDevice => &[BLOCK],
        ThreadKind::VsockDevice => &[SOCKETS, VSOCK],
        ThreadKind::Api => &[SOCKETS, THREADS],
        ThreadKind::LazyMemory => &[LAZY],
    };
    for &call in COMMON.iter().chain(extra.iter().copied().flatten()) {
        rules.insert(call, Vec::new());
    }
    // Opening files is refused by the second filter ([`refusals`]) with EACCES, not here.
    rules.insert(libc::SYS_openat, Vec::new());
    rules.insert(libc::SYS_open, Vec::new());
    // The ioctl request (the second argument) or another argument equal to `value`.
    let argument_is = |index: u8, value: u64| {
        SeccompCondition::new(index, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, value)
            .and_then(|c| SeccompRule::new(vec![c]))
    };
    let request = |number: libc::c_ulong| {
        argument_is(1, u64::from(u32::try_from(number).unwrap_or(u32::MAX)))
    };
    // Any ioctl of one type: the request number's type byte is its bits 8-15.
    let ioctl_type = |kind: u64| {
        SeccompCondition::new(
            1,
            SeccompCmpArgLen::Dword,
            SeccompCmpOp::MaskedEq(0xff00),
            kind << 8,
        )
        .and_then(|c| SeccompRule::new(vec![c]))
    };
    // std's set_nonblocking is ioctl(FIONBIO): the vsock device sets every host connection
    // non-blocking as it makes or accepts it, the control socket its listener's.
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
    let ioctls = match kind {
        ThreadKind::Vcpu => vec![
            ioctl_type(KVMIO).map_err(fail)?,
            fionbio().map_err(fail)?,
            tunsetoffload().map_err(fail)?,
        ],
        ThreadKind::VsockDevice | ThreadKind::Api => vec![fionbio().map_err(fail)?],
        ThreadKind::Device => vec![tunsetoffload().map_err(fail)?],
        ThreadKind::LazyMemory => vec![ioctl_type(UFFDIO).map_err(fail)?],
        ThreadKind::BlockDevice | ThreadKind::Console => Vec::new(),
    };
    if !ioctls.is_empty() {
        rules.insert(libc::SYS_ioctl, ioctls);
    }
    if kind == ThreadKind::Api {
        // Threads, never processes: clone with CLONE_THREAD set (glibc's pthread_create, once
        // clone3 got ENOSYS); a fork from here would be a process outside every filter's
        // reach but this one, able to exec. The flags are clone's first argument on x86-64.
        let thread = u64::from(u32::try_from(libc::CLONE_THREAD).unwrap_or(u32::MAX));
        rules.insert(
            libc::SYS_clone,
            vec![SeccompCondition::new(
                0,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::MaskedEq(thread),
                thread,
            )
            .and_then(|c| SeccompRule::new(vec![c]))
            .map_err(fail)?],
        );
        // Refused with ENOSYS by [`refusals`]; allowed here so that filter's answer stands.
        rules.insert(libc::SYS_clone3, Vec::new());
        // std names a new thread with prctl(PR_SET_NAME).
        rules.insert(
            libc::SYS_prctl,
            vec![argument_is(0, u64::from(libc::PR_SET_NAME.unsigned_abs())).map_err(fail)?],
        );
    }
    let mismatch = match mode {
        Mode::Enforce | Mode::Off => SeccompAction::Trap,
        Mode::Log => SeccompAction::Log,
    };
    let filter = SeccompFilter::new(rules, mismatch, SeccompAction::Allow, TargetArch::x86_64)
        .map_err(fail)?;
    BpfProgram::try_from(filter).map_err(fail)
}

/// The filters stacked on top of every thread's own: calls that fail with an error rather than
/// end the VMM. Stacked filters take the strictest answer, so these calls get these filters'
/// answer (the thread's own allows them) and every other call the thread's own.
/// - open and openat fail with EACCES (logged instead, with `MAYFLY_SECCOMP=log`): glibc's
///   malloc opens /proc/sys/vm/overcommit_memory the first time it shrinks a thread arena's
///   heap, on whichever thread frees memory then (the enforcing guest suite lost a vsock device
///   thread to it, after a 64 MiB transfer), and takes a failed open as "do not shrink by
///   remapping". No filtered thread opens a file otherwise.
/// - clone3 fails with ENOSYS (for a thread that starts threads): its flags sit in memory a
///   filter cannot read, and glibc then falls back to clone, whose flags the thread's own
///   filter checks.
fn refusals(kind: ThreadKind, mode: Mode) -> Result<Vec<&'static BpfProgram>, SeccompError> {
    static PROGRAMS: OnceLock<Result<[BpfProgram; 2], String>> = OnceLock::new();
    let programs = PROGRAMS
        .get_or_init(|| {
            let refuse = |calls: &[libc::c_long], errno: i32| {
                let action = match mode {
                    Mode::Log => SeccompAction::Log,
                    Mode::Enforce | Mode::Off => SeccompAction::Errno(errno.unsigned_abs()),
                };
                let rules = calls.iter().map(|&call| (call, Vec::new())).collect();
                SeccompFilter::new(rules, SeccompAction::Allow, action, TargetArch::x86_64)
                    .and_then(BpfProgram::try_from)
                    .map_err(|e| e.to_string())
            };
            Ok([
                refuse(&[libc::SYS_openat, libc::SYS_open], libc::EACCES)?,
                refuse(&[libc::SYS_clone3], libc::ENOSYS)?,
            ])
        })
        .as_ref()
        .map_err(|e| SeccompError::Build("refusals", e.clone()))?;
    let [no_open, no_clone3] = programs;
    Ok(match kind {
        ThreadKind::Api => vec![no_open, no_clone3],
        _ => vec![no_open],
    })
}

/// The filters, compiled once per process (a fork's clones inherit them compiled: see
/// [`prepare`]).
fn program(kind: ThreadKind, mode: Mode) -> Result<&'static BpfProgram, SeccompError> {
    static PROGRAMS: OnceLock<Result<Vec<BpfProgram>, String>> = OnceLock::new();
    let all = PROGRAMS.get_or_init(|| {
        ThreadKind::ALL
            .iter()
            .map(|&k| build(k, mode).map_err(|e| e.to_string()))
            .collect()
    });
    let all = all
        .as_ref()
        .map_err(|e| SeccompError::Build(kind.name(), e.clone()))?;
    all.get(kind.index())
        .ok_or(SeccompError::Build(kind.name(), "no such filter".into()))
}

/// Compile every filter now, in a process about to fork(2) the VMMs that install them (the
/// fork's zygote): each clone then finds them compiled instead of compiling its own.
pub fn prepare() -> Result<(), SeccompError> {
    let mode = mode()?;
    if mode == Mode::Off {
        return Ok(());
    }
    program(ThreadKind::Vcpu, mode)?;
    refusals(ThreadKind::Api, mode)?;
    Ok(())
}

thread_local! {
    /// Which filter this thread runs under (its kind's index + 1; 0: none), for the SIGSYS
    /// report.
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
    let refusals = refusals(kind, mode)?;
    KIND.with(|k| k.set(u8::try_from(kind.index() + 1).unwrap_or(0)));
    refusals
        .into_iter()
        .chain(std::iter::once(program))
        .try_for_each(|program| seccompiler::apply_filter(program))
        .map_err(|e| SeccompError::Install(kind.name(), e.to_string()))
}

/// Which filter the calling thread runs under, as the SIGSYS report names it. A thread that a
/// filtered thread starts runs under its filter (the kernel copies it) but not under its
/// label: take it in the starting thread and [`Label::apply`] it in the new one.
#[derive(Clone, Copy, Debug)]
pub struct Label(u8);

impl Label {
    pub fn current() -> Self {
        Label(KIND.with(|k| k.get()))
    }

    pub fn apply(self) {
        KIND.with(|k| k.set(self.0));
    }
}

/// [`install`], or the process ends (exit status 1) after a line saying why: a thread that
/// would handle what the guest writes without its filter must not run.
pub fn install_or_exit(kind: ThreadKind) {
    if let Err(e) = install(kind) {
        eprintln!(
            "mayfly: {e}: the VMM stops (MAYFLY_SECCOMP=off runs the VM without seccomp filters)"
        );
        std::process::exit(1);
    }
}

/// Start a thread that runs under `kind`'s filter, installed first thing on the new thread,
/// before `body` runs (see [`install_or_exit`]). Not waited for: a handshake per thread cost
/// each clone of a fork a scheduler round trip per thread (milliseconds each on a loaded
/// 2-CPU host, measured with the fork's trace).
pub fn spawn<F>(
    builder: std::thread::Builder,
    kind: ThreadKind,
    body: F,
) -> std::io::Result<std::thread::JoinHandle<()>>
where
    F: FnOnce() + Send + 'static,
{
    builder.spawn(move || {
        install_or_exit(kind);
        body();
    })
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
    // A plain table lookup: nothing here allocates or locks.
    let name = usize::from(kind)
        .checked_sub(1)
        .and_then(|index| ThreadKind::ALL.get(index))
        .map_or("unfiltered", |kind| kind.name())
        .as_bytes();
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
