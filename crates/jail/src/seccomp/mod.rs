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
//! Not filtered: the controller (the main thread) and its helpers (the signal thread, a
//! restore's short-lived KVM probe, the thread that reaps a PID 1 VMM's clones), which act on
//! the host for the VMM's own user and read nothing the guest or a client writes: the
//! controller writes snapshots and disk layers wherever it is told, starts a fork's zygote
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
//! credentials, and malloc opening /proc/sys/vm/overcommit_memory (see `policy` below).
//!
//! Arguments are checked where it matters: a vCPU thread may only issue KVM ioctls (type
//! 0xAE), FIONBIO and TUNSETOFFLOAD; the lazy-memory handler userfaultfd's ioctls (type 0xAA)
//! only; the vsock thread and the control socket's threads FIONBIO only (std's
//! set_nonblocking); the rng and net threads TUNSETOFFLOAD only (the net device's tap); the
//! block and console threads none. The control socket's threads may start threads, never
//! processes: `clone` only with CLONE_THREAD, and `clone3` (whose flags a filter cannot read)
//! answers ENOSYS, on which glibc falls back to `clone`.

use std::sync::OnceLock;

use seccompiler::{BpfProgram, SeccompAction};

use bpf::Policy;

mod bpf;

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
    /// The control socket's threads (accepting, one per connection): Unix
    /// sockets, and threads of their own.
    Api,
    /// The guest agent's refresh after a restore or fork: Unix socket clients only.
    Refresh,
    /// The console's input: reads stdin or its FIFO, queues the bytes in the UART.
    Console,
    /// A clone's wait for its fork to end (a poll, then an event to the controller).
    ForkEnd,
    /// The lazy-memory handler: the memory file read, userfaultfd's ioctls.
    LazyMemory,
}

impl ThreadKind {
    /// Every kind, in the order of [`ThreadKind::index`].
    const ALL: [ThreadKind; 9] = [
        ThreadKind::Vcpu,
        ThreadKind::Device,
        ThreadKind::BlockDevice,
        ThreadKind::VsockDevice,
        ThreadKind::Api,
        ThreadKind::Console,
        ThreadKind::LazyMemory,
        ThreadKind::ForkEnd,
        ThreadKind::Refresh,
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
            ThreadKind::ForkEnd => "fork end",
            ThreadKind::Refresh => "guest refresh",
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
            ThreadKind::ForkEnd => 7,
            ThreadKind::Refresh => 8,
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

impl std::str::FromStr for Mode {
    type Err = SeccompError;

    /// `on` (or empty), `log` or `off`: what `MAYFLY_SECCOMP` says.
    fn from_str(text: &str) -> Result<Mode, SeccompError> {
        match text {
            "on" | "" => Ok(Mode::Enforce),
            "log" => Ok(Mode::Log),
            "off" => Ok(Mode::Off),
            other => Err(SeccompError::Mode(other.to_owned())),
        }
    }
}

static MODE: OnceLock<Mode> = OnceLock::new();

/// Make every filter of this process in `mode` (the `mayfly` command sets what
/// `MAYFLY_SECCOMP` says, first thing in `main`). Once: returns `mode` back if the process
/// already has one (set before, or read by a filter already made).
pub fn set_mode(mode: Mode) -> Result<(), Mode> {
    MODE.set(mode)
}

/// The mode filters are made in: as [`set_mode`] set it, else [`Mode::Enforce`].
pub fn mode() -> Mode {
    *MODE.get_or_init(|| Mode::Enforce)
}

/// Every filtered thread: memory, threads and their end, time, signals (the kick, the SIGSYS
/// report; tgkill is guarded: this process's threads only), eventfds, stderr.
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
    libc::SYS_getrandom,
    // glibc's malloc counts the CPUs once, when a thread's first allocation finds eight
    // arenas made already: from /sys and /proc files (opens, refused with EACCES: see
    // [`policy`]) and then sched_getaffinity, on whichever thread allocates then.
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

/// Sockets connected, read and written (the vsock device's host side, the control socket's
/// clients and its connections to the guest agent, the refresh's). Making one (`socket`) is
/// allowed for Unix sockets only: see [`policy`].
const SOCKET_CLIENT: &[libc::c_long] = &[
    libc::SYS_connect,
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

/// Sockets accepted (the vsock device's listeners, the control socket's).
const SOCKET_SERVER: &[libc::c_long] = &[libc::SYS_accept4, libc::SYS_accept];

/// The vsock device, besides its sockets: dropped, it removes its host socket (after checking
/// it is still its own).
const VSOCK: &[libc::c_long] = &[libc::SYS_unlink, libc::SYS_unlinkat];

/// A thread that starts threads (the control socket's): what glibc's pthread_create and a new
/// thread's start and end make, besides memory and signals. `clone` itself is added with its
/// flags checked, and `clone3` is refused with ENOSYS (see [`policy`]).
const THREADS: &[libc::c_long] = &[libc::SYS_set_robust_list, libc::SYS_rseq];

/// The lazy-memory handler: the memory file read into its buffer; whether a page is in
/// memory already (a fault that raced with a load).
const LAZY: &[libc::c_long] = &[libc::SYS_pread64, libc::SYS_mincore];

/// A clone's wait for its fork's end: a look (MSG_PEEK) at the word its fork left queued.
const FORK_END: &[libc::c_long] = &[libc::SYS_recvfrom];

/// ioctl's request number's type byte for KVM (`KVMIO`).
const KVMIO: u32 = 0xAE;
/// ioctl's request number's type byte for userfaultfd (`UFFDIO`).
const UFFDIO: u32 = 0xAA;

/// A constant as the filter compares it: a 32-bit argument.
fn word(value: impl TryInto<u32>) -> u32 {
    value.try_into().unwrap_or(u32::MAX)
}

/// What `kind`'s filter allows and refuses.
fn policy(kind: ThreadKind, mode: Mode) -> Policy {
    use bpf::{Cond, Guarded};
    let extra: &[&[libc::c_long]] = match kind {
        ThreadKind::Vcpu | ThreadKind::Device | ThreadKind::Console => &[],
        ThreadKind::ForkEnd => &[FORK_END],
        ThreadKind::BlockDevice => &[BLOCK],
        ThreadKind::VsockDevice => &[SOCKET_CLIENT, SOCKET_SERVER, VSOCK],
        ThreadKind::Api => &[SOCKET_CLIENT, SOCKET_SERVER, THREADS],
        ThreadKind::Refresh => &[SOCKET_CLIENT],
        ThreadKind::LazyMemory => &[LAZY],
    };
    let mut allow: Vec<i64> = COMMON
        .iter()
        .chain(extra.iter().copied().flatten())
        .copied()
        .collect();
    // The jail drops the VMM's credentials after its threads have started, and glibc makes
    // every thread of the process repeat setgroups/setresgid/setresuid (its setxid
    // broadcast, so the whole process changes at once): every filter lets those through.
    // They cannot raise a thread's rights: before the drop the thread is root already, and
    // after it an unprivileged uid can only take ids it holds. setgroups only as the jail
    // calls it, emptying the list.
    allow.extend([libc::SYS_setresuid, libc::SYS_setresgid]);
    let mut guarded = vec![
        Guarded {
            call: libc::SYS_setgroups,
            rules: vec![vec![Cond::eq64(0, 0)]],
        },
        // Signals to this process's own threads only (a raise, a kick of a sibling): an
        // unjailed VMM runs as root, and any target would be any process on the host. The
        // thread group is the first argument; its value is bound when the filter is
        // installed, in the process that installs it (a fork's clones are processes of
        // their own).
        Guarded {
            call: libc::SYS_tgkill,
            rules: vec![vec![Cond::eq32(0, bpf::THIS_PROCESS)]],
        },
    ];
    // The ioctl request is the second argument. std's set_nonblocking is ioctl(FIONBIO): the
    // vsock device sets every host connection non-blocking as it makes or accepts it, the
    // control socket its listener's. The net device sets its tap's offloads to what the
    // guest's driver accepted (TUNSETOFFLOAD), when the driver starts it: on the vCPU thread
    // that wrote DRIVER_OK, or on its own. An ioctl type is the request number's bits 8-15.
    let request = |number: libc::c_ulong| vec![Cond::eq32(1, word(number))];
    let of_type = |kind: u32| vec![Cond::masked32(1, 0xff00, kind << 8)];
    let ioctls = match kind {
        ThreadKind::Vcpu => vec![
            of_type(KVMIO),
            request(libc::FIONBIO),
            request(libc::TUNSETOFFLOAD),
        ],
        ThreadKind::VsockDevice | ThreadKind::Api | ThreadKind::Refresh => {
            vec![request(libc::FIONBIO)]
        }
        ThreadKind::Device => vec![request(libc::TUNSETOFFLOAD)],
        ThreadKind::LazyMemory => vec![of_type(UFFDIO)],
        ThreadKind::BlockDevice | ThreadKind::Console | ThreadKind::ForkEnd => Vec::new(),
    };
    // Sockets are made of the Unix family only: a thread that talks to the guest's agent or
    // to the control socket's clients has no business with the host's network (or netlink,
    // or raw packets).
    let unix_only = vec![vec![Cond::eq32(0, word(libc::AF_UNIX))]];
    if matches!(
        kind,
        ThreadKind::VsockDevice | ThreadKind::Api | ThreadKind::Refresh
    ) {
        guarded.push(Guarded {
            call: libc::SYS_socket,
            rules: unix_only,
        });
    }
    if !ioctls.is_empty() {
        // First: a vCPU thread's every exit is an ioctl (KVM_RUN).
        guarded.insert(
            0,
            Guarded {
                call: libc::SYS_ioctl,
                rules: ioctls,
            },
        );
    }
    // Refused with an error, not the end of the VMM: glibc's malloc opens
    // /proc/sys/vm/overcommit_memory the first time it shrinks a thread arena's heap, on
    // whichever thread frees memory then (the enforcing guest suite lost a vsock device thread
    // to it, after a 64 MiB transfer), and takes a failed open as "do not shrink by
    // remapping". No filtered thread opens a file otherwise. Logged instead with
    // `MAYFLY_SECCOMP=log`.
    let refusal = |errno: i32| match mode {
        Mode::Log => u32::from(SeccompAction::Log),
        Mode::Enforce | Mode::Off => u32::from(SeccompAction::Errno(errno.unsigned_abs())),
    };
    // A panic's backtrace (RUST_BACKTRACE) reads /proc/self/maps (an open, refused) and then
    // the binary's path: refused too, so a panicking thread ends itself and not the VMM.
    let mut refuse = vec![
        (libc::SYS_openat, refusal(libc::EACCES)),
        (libc::SYS_open, refusal(libc::EACCES)),
        (libc::SYS_readlink, refusal(libc::EACCES)),
        (libc::SYS_readlinkat, refusal(libc::EACCES)),
    ];
    if kind == ThreadKind::Api {
        // Threads, never processes: clone with CLONE_THREAD set (glibc's pthread_create);
        // a fork from here would be a process outside every filter's reach but this one,
        // able to exec. The flags are clone's first argument on x86-64. clone3's flags sit in
        // memory a filter cannot read: it answers ENOSYS, on which glibc falls back to clone.
        let thread = word(libc::CLONE_THREAD);
        guarded.push(Guarded {
            call: libc::SYS_clone,
            rules: vec![vec![Cond::masked32(0, thread, thread)]],
        });
        refuse.push((libc::SYS_clone3, refusal(libc::ENOSYS)));
        // std names a new thread with prctl(PR_SET_NAME).
        guarded.push(Guarded {
            call: libc::SYS_prctl,
            rules: vec![vec![Cond::eq32(0, word(libc::PR_SET_NAME))]],
        });
    }
    Policy {
        allow,
        guarded,
        refuse,
        matched: u32::from(SeccompAction::Allow),
        mismatch: u32::from(match mode {
            Mode::Enforce | Mode::Off => SeccompAction::Trap,
            Mode::Log => SeccompAction::Log,
        }),
    }
}

/// The filters, compiled once per process (a fork's clones inherit them compiled: see
/// [`prepare`]).
fn program(kind: ThreadKind, mode: Mode) -> Result<&'static BpfProgram, SeccompError> {
    static PROGRAMS: OnceLock<Result<Vec<BpfProgram>, String>> = OnceLock::new();
    let all = PROGRAMS.get_or_init(|| {
        ThreadKind::ALL
            .iter()
            .map(|&k| bpf::compile(&policy(k, mode)))
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
    let mode = mode();
    if mode == Mode::Off {
        return Ok(());
    }
    program(ThreadKind::Vcpu, mode).map(drop)
}

thread_local! {
    /// Which filter this thread runs under (its kind's index + 1; 0: none), for the SIGSYS
    /// report.
    static KIND: std::cell::Cell<u8> = const { std::cell::Cell::new(0) };
}

/// Install `kind`'s filter on the calling thread (and the SIGSYS report, once per process).
/// With `MAYFLY_SECCOMP=off`, nothing.
pub fn install(kind: ThreadKind) -> Result<(), SeccompError> {
    let mode = mode();
    if mode == Mode::Off {
        return Ok(());
    }
    install_reporter().map_err(|e| SeccompError::Install(kind.name(), e.to_string()))?;
    let program = bpf::for_process(program(kind, mode)?, std::process::id());
    KIND.with(|k| k.set(u8::try_from(kind.index() + 1).unwrap_or(0)));
    seccompiler::apply_filter(&program)
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
        mayfly_sys::terminal::restore_terminal();
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
    // A plain table lookup: nothing here allocates or locks. A thread with no label runs
    // under a filter it inherited from the thread that started it (an unfiltered thread
    // never gets here).
    let name = usize::from(kind)
        .checked_sub(1)
        .and_then(|index| ThreadKind::ALL.get(index))
        .map_or("filtered (inherited)", |kind| kind.name())
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
