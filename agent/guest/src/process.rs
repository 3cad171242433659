//! Starting and reaping programs: shared by exec and the refresh hooks.
//!
//! Every program gets its own session and process group (so one signal reaches everything
//! it started), and a waiter thread that reaps it with wait4 (which also yields its CPU
//! time and peak RSS) and wakes the caller's poll loop through a pipe.

use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use mayfly_agent_protocol::{ExitRecord, DEFAULT_PATH};

use crate::sys::{self, kill_group, pipe, set_nonblocking, timeval_ms};
use crate::users::Account;

/// How long a program has between SIGTERM and SIGKILL when it is being stopped.
pub const KILL_GRACE: Duration = Duration::from_secs(2);

/// After the program exits, how long output may keep arriving from processes it left
/// behind holding its stdout or stderr (say, `daemon &`) before the agent stops reading.
pub const EXIT_GRACE: Duration = Duration::from_secs(1);

/// How a reaped process ended, and what it used.
#[derive(Clone, Copy)]
pub struct WaitResult {
    pub status: libc::c_int,
    pub rusage: libc::rusage,
}

/// Blocks until `pid` is reaped. `None` only if the process is not our child any more.
pub fn wait_for(pid: u32) -> Option<WaitResult> {
    let mut status: libc::c_int = 0;
    // SAFETY: rusage is plain old data; all-zero is a valid value for wait4 to overwrite.
    let mut rusage: libc::rusage = unsafe { std::mem::zeroed() };
    // A process ID always fits a pid_t (the kernel's pid_max is at most 2^22).
    let c_pid = libc::pid_t::try_from(pid).ok()?;
    loop {
        // SAFETY: both pointers point at live locals of the right types.
        let ret = unsafe { libc::wait4(c_pid, &mut status, 0, &mut rusage) };
        if ret == c_pid {
            return Some(WaitResult { status, rusage });
        }
        if ret == -1 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
            continue;
        }
        return None;
    }
}

/// Reaps one process on its own thread and reports through a pipe a poll loop can watch.
pub struct Waiter {
    wake: OwnedFd,
    rx: mpsc::Receiver<Option<WaitResult>>,
}

impl Waiter {
    /// On failure the process was killed and reaped here, so nothing is left behind.
    pub fn spawn(pid: u32) -> io::Result<Waiter> {
        let start = || -> io::Result<Waiter> {
            let (wake, wake_tx) = pipe()?;
            let (tx, rx) = mpsc::channel();
            thread::Builder::new()
                .name("mayfly-wait".into())
                .stack_size(64 * 1024)
                .spawn(move || {
                    let _ = tx.send(wait_for(pid));
                    let _ = sys::write(&wake_tx, &[1]);
                })?;
            Ok(Waiter { wake, rx })
        };
        start().inspect_err(|_| {
            kill_group(pid, libc::SIGKILL);
            wait_for(pid);
        })
    }

    /// The fd that becomes readable once the process is reaped.
    pub fn fd(&self) -> libc::c_int {
        self.wake.as_raw_fd()
    }

    /// The result, if the process has been reaped. `Some(None)`: the waiter lost it.
    pub fn try_result(&self) -> Option<Option<WaitResult>> {
        match self.rx.try_recv() {
            Ok(result) => Some(result),
            Err(mpsc::TryRecvError::Empty) => None,
            Err(mpsc::TryRecvError::Disconnected) => Some(None),
        }
    }

    /// Blocks until the process is reaped.
    pub fn wait(&self) -> Option<WaitResult> {
        self.rx.recv().ok().flatten()
    }
}

/// Identity a child switches to before exec.
pub struct Switch {
    uid: libc::uid_t,
    gid: libc::gid_t,
    groups: Vec<libc::gid_t>,
}

impl Switch {
    /// `None` when the account is the agent's own: no switch needed (and an unprivileged
    /// agent could not setgroups anyway).
    pub fn to(account: &Account) -> Option<Switch> {
        // SAFETY: geteuid and getegid cannot fail and have no memory effects.
        let (euid, egid) = unsafe { (libc::geteuid(), libc::getegid()) };
        if account.uid == euid && account.gid == egid {
            return None;
        }
        Some(Switch {
            uid: account.uid,
            gid: account.gid,
            groups: account.groups.clone(),
        })
    }
}

/// Makes `cmd` start in a new session (so it is its own process group, without a
/// controlling terminal) and as `switch`'s user.
pub fn configure(cmd: &mut Command, switch: Option<Switch>) {
    let child_setup = move || -> io::Result<()> {
        // SAFETY: the calls below run in the forked child before exec. It
        // calls only async-signal-safe syscall wrappers and allocates nothing: the group
        // list was built before the fork; the pointer and length describe that vector.
        unsafe {
            if libc::setsid() == -1 {
                return Err(io::Error::last_os_error());
            }
            if let Some(s) = &switch {
                if libc::setgroups(s.groups.len(), s.groups.as_ptr()) == -1
                    || libc::setgid(s.gid) == -1
                    || libc::setuid(s.uid) == -1
                {
                    return Err(io::Error::last_os_error());
                }
            }
        }
        Ok(())
    };
    // SAFETY: `child_setup` is async-signal-safe and allocation-free, as pre_exec requires.
    unsafe {
        cmd.pre_exec(child_setup);
    }
}

/// The environment a program gets unless the request clears it.
pub fn base_env(account: &Account) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    env.insert("PATH".into(), DEFAULT_PATH.into());
    env.insert("HOME".into(), account.home.clone());
    env.insert("USER".into(), account.name.clone());
    env.insert("LOGNAME".into(), account.name.clone());
    if !account.shell.is_empty() {
        env.insert("SHELL".into(), account.shell.clone());
    }
    env.insert("TERM".into(), "xterm".into());
    env
}

/// Exit status and error message for a program that could not be started, the way shells
/// report it: 127 when it does not exist, 126 when it exists but cannot be executed.
pub fn spawn_failure(program: &str, e: &io::Error) -> (i32, String) {
    match e.raw_os_error() {
        Some(libc::ENOENT) => (127, format!("no such file: {program}")),
        Some(libc::ENOTDIR) => (
            127,
            format!("no such file: {program} (a path component is not a directory)"),
        ),
        Some(libc::EACCES) => (
            126,
            format!(
                "permission denied: {program} (not executable, a directory, or on a noexec mount)"
            ),
        ),
        Some(libc::ENOEXEC) => (
            126,
            format!("not an executable: {program} (exec format error)"),
        ),
        _ => (126, format!("cannot execute {program}: {e}")),
    }
}

/// The EXIT record for a reaped process.
pub fn exit_record(result: Option<WaitResult>, wall: Duration, timed_out: bool) -> ExitRecord {
    let mut rec = ExitRecord {
        timed_out,
        wall_ms: wall.as_secs_f64() * 1000.0,
        ..ExitRecord::default()
    };
    match result {
        Some(r) => {
            if libc::WIFEXITED(r.status) {
                rec.exit_code = Some(libc::WEXITSTATUS(r.status));
            } else if libc::WIFSIGNALED(r.status) {
                rec.signal = Some(libc::WTERMSIG(r.status));
            }
            rec.user_cpu_ms = timeval_ms(&r.rusage.ru_utime);
            rec.sys_cpu_ms = timeval_ms(&r.rusage.ru_stime);
            // Linux reports ru_maxrss in KiB.
            rec.max_rss_kib = u64::try_from(r.rusage.ru_maxrss).unwrap_or(0);
        }
        None => rec.error = Some("the agent lost track of the process (not its child)".into()),
    }
    rec
}

/// Milliseconds until `t` for poll, rounded up so a deadline is not polled early.
pub fn poll_timeout(deadlines: &[Option<Instant>]) -> libc::c_int {
    let now = Instant::now();
    deadlines
        .iter()
        .flatten()
        .map(|t| {
            let left = t.saturating_duration_since(now);
            libc::c_int::try_from(left.as_micros().div_ceil(1000)).unwrap_or(libc::c_int::MAX)
        })
        .min()
        .unwrap_or(-1)
}

/// poll(2) on a small set; EINTR is "nothing happened".
pub fn poll(fds: &mut [libc::pollfd], timeout_ms: libc::c_int) -> io::Result<()> {
    // SAFETY: the pointer and length describe the caller's pollfd slice.
    let ret = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
    if ret == -1 {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
        for fd in fds.iter_mut() {
            fd.revents = 0;
        }
    }
    Ok(())
}

pub fn pollfd(fd: libc::c_int, events: libc::c_short) -> libc::pollfd {
    libc::pollfd {
        fd,
        events,
        revents: 0,
    }
}

/// A finished captured run (see [`run_captured`]).
pub struct Captured {
    pub result: Option<WaitResult>,
    pub timed_out: bool,
    /// The first `cap` bytes of stdout and stderr together.
    pub output: Vec<u8>,
}

/// Runs `cmd` with stdin from /dev/null and stdout and stderr into one pipe, keeping the
/// first `cap` bytes of output (the rest is read and dropped so the program never blocks on
/// a full pipe). After `timeout` its process group gets SIGTERM, then SIGKILL.
pub fn run_captured(mut cmd: Command, timeout: Duration, cap: usize) -> io::Result<Captured> {
    let (out_r, out_w) = pipe()?;
    let out_w2 = out_w.try_clone()?;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::from(out_w))
        .stderr(Stdio::from(out_w2));
    configure(&mut cmd, None);
    let child = cmd.spawn()?;
    // The Command holds our copies of the pipe's write end: drop it, or the pipe never
    // reports end of file.
    drop(cmd);
    let pid = child.id();
    let started = Instant::now();
    set_nonblocking(out_r.as_raw_fd(), true)?;
    let waiter = Waiter::spawn(pid)?;

    let deadline = started + timeout;
    let mut out = Some(out_r);
    let mut output = Vec::new();
    let mut buf = vec![0u8; 16 * 1024];
    let mut result: Option<Option<WaitResult>> = None;
    let mut timed_out = false;
    let mut kill_at: Option<Instant> = None;
    let mut grace_end: Option<Instant> = None;
    loop {
        let now = Instant::now();
        if result.is_none() {
            if !timed_out && now >= deadline {
                timed_out = true;
                kill_group(pid, libc::SIGTERM);
                kill_at = Some(now + KILL_GRACE);
            }
            if kill_at.is_some_and(|k| now >= k) {
                kill_group(pid, libc::SIGKILL);
                kill_at = None;
            }
        } else {
            if grace_end.is_some_and(|g| now >= g) {
                out = None;
            }
            if out.is_none() {
                return Ok(Captured {
                    result: result.flatten(),
                    timed_out,
                    output,
                });
            }
        }
        let mut fds = Vec::with_capacity(2);
        if let Some(fd) = &out {
            fds.push(pollfd(fd.as_raw_fd(), libc::POLLIN));
        }
        if result.is_none() {
            fds.push(pollfd(waiter.fd(), libc::POLLIN));
        }
        let pending_deadline = if timed_out { None } else { Some(deadline) };
        let timeout_ms = if result.is_none() {
            poll_timeout(&[pending_deadline, kill_at])
        } else {
            poll_timeout(&[grace_end])
        };
        poll(&mut fds, timeout_ms)?;
        for pfd in &fds {
            if pfd.revents == 0 {
                continue;
            }
            if out.as_ref().map(|o| o.as_raw_fd()) == Some(pfd.fd) {
                let read = match &out {
                    Some(o) => sys::read(o, &mut buf),
                    None => Ok(0),
                };
                match read {
                    Ok(0) => out = None,
                    Ok(n) => {
                        let keep = n.min(cap.saturating_sub(output.len()));
                        output.extend_from_slice(&buf[..keep]);
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => out = None,
                }
            } else if pfd.fd == waiter.fd() {
                if let Some(r) = waiter.try_result() {
                    result = Some(r);
                    grace_end = Some(Instant::now() + EXIT_GRACE);
                    if timed_out {
                        // Whatever it left behind in its group goes too.
                        kill_group(pid, libc::SIGKILL);
                    }
                }
            }
        }
    }
}
