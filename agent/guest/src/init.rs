//! `--init`: the agent as PID 1 of a guest with no other init.
//!
//! PID 1 mounts the pseudo filesystems, sets the hostname, and then only supervises: the
//! agent itself runs in a forked child (restarted if it dies), a login shell is kept on the
//! serial console, every orphan is reaped, and SIGTERM or SIGINT (ctrl-alt-del) power the
//! machine off. PID 1 stays single-threaded, so forking from it is always safe.

use std::fs::{self, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use mayfly_agent_protocol::DEFAULT_PATH;

use crate::sys::{cstring, cvt, set_hostname};

const CONSOLE: &str = "/dev/ttyS0";
const RESPAWN_DELAY: Duration = Duration::from_secs(1);
/// How long processes get between SIGTERM and SIGKILL at power-off.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(3);

struct Mount {
    source: &'static str,
    target: &'static str,
    fstype: &'static str,
    flags: libc::c_ulong,
    data: &'static str,
}

const MOUNTS: &[Mount] = &[
    Mount {
        source: "proc",
        target: "/proc",
        fstype: "proc",
        flags: libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        data: "",
    },
    Mount {
        source: "sysfs",
        target: "/sys",
        fstype: "sysfs",
        flags: libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        data: "",
    },
    Mount {
        source: "devtmpfs",
        target: "/dev",
        fstype: "devtmpfs",
        flags: libc::MS_NOSUID,
        data: "mode=0755",
    },
    Mount {
        source: "devpts",
        target: "/dev/pts",
        fstype: "devpts",
        flags: libc::MS_NOSUID | libc::MS_NOEXEC,
        data: "gid=5,mode=0620,ptmxmode=0666",
    },
    Mount {
        source: "tmpfs",
        target: "/dev/shm",
        fstype: "tmpfs",
        flags: libc::MS_NOSUID | libc::MS_NODEV,
        data: "mode=1777",
    },
    Mount {
        source: "tmpfs",
        target: "/run",
        fstype: "tmpfs",
        flags: libc::MS_NOSUID | libc::MS_NODEV,
        data: "mode=0755",
    },
    Mount {
        source: "tmpfs",
        target: "/tmp",
        fstype: "tmpfs",
        flags: libc::MS_NOSUID | libc::MS_NODEV,
        data: "mode=1777",
    },
];

fn mounted_targets() -> Vec<String> {
    fs::read_to_string("/proc/self/mounts")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(1).map(str::to_owned))
        .collect()
}

fn mount(m: &Mount) -> io::Result<()> {
    fs::create_dir_all(m.target)?;
    let c = |s: &str| cstring(s);
    let (source, target, fstype, data) = (c(m.source)?, c(m.target)?, c(m.fstype)?, c(m.data)?);
    // SAFETY: all four pointers are NUL-terminated strings that outlive the call.
    cvt(unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            m.flags,
            data.as_ptr().cast(),
        )
    })
    .map(drop)
}

/// Mounts what a Linux userland expects, skipping what is mounted already (a kernel with
/// CONFIG_DEVTMPFS_MOUNT mounts /dev itself).
fn mount_basics() {
    for m in MOUNTS {
        // Re-read each time: /proc/self/mounts only exists once proc is mounted.
        if mounted_targets().iter().any(|t| t == m.target) {
            continue;
        }
        if let Err(e) = mount(m) {
            log!("cannot mount {} on {}: {e}", m.fstype, m.target);
        }
    }
}

fn signal_set(signals: &[libc::c_int]) -> libc::sigset_t {
    // SAFETY: sigemptyset/sigaddset initialise and modify the local set in place.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for &s in signals {
            libc::sigaddset(&mut set, s);
        }
        set
    }
}

fn set_mask(how: libc::c_int, set: &libc::sigset_t) -> libc::sigset_t {
    // SAFETY: both pointers point at valid sigsets; PID 1 is single-threaded here.
    unsafe {
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigprocmask(how, set, &mut old);
        old
    }
}

/// Becomes the supervising PID 1. `agent` is run in a forked child each time the agent
/// (re)starts; it is not expected to return.
pub fn run(agent: &dyn Fn()) -> ! {
    // SAFETY: getpid has no memory effects.
    if unsafe { libc::getpid() } != 1 {
        log!("--init but not PID 1; supervising anyway");
    }
    mount_basics();
    if let Err(e) = set_hostname("mayfly") {
        log!("cannot set the hostname: {e}");
    }
    // SAFETY: reboot(RB_DISABLE_CAD) only changes what ctrl-alt-del does: send SIGINT to
    // PID 1 (handled below as power-off) instead of rebooting on the spot.
    unsafe {
        libc::reboot(libc::RB_DISABLE_CAD);
    }
    // The signals PID 1 handles are blocked and taken synchronously with sigtimedwait:
    // no handlers, no async-signal-safety questions.
    let handled = signal_set(&[libc::SIGCHLD, libc::SIGTERM, libc::SIGINT, libc::SIGHUP]);
    let old_mask = set_mask(libc::SIG_BLOCK, &handled);

    let shell = ["/bin/bash", "/bin/sh"]
        .into_iter()
        .find(|p| Path::new(p).exists());
    let mut agent_pid: Option<libc::pid_t> = None;
    let mut agent_at = Instant::now();
    let mut shell_pid: Option<libc::pid_t> = None;
    let mut shell_at = Instant::now();
    let mut shell_error: Option<String> = None;
    loop {
        let now = Instant::now();
        if agent_pid.is_none() && now >= agent_at {
            agent_pid = spawn_agent(agent, &old_mask);
            agent_at = now + RESPAWN_DELAY;
        }
        if let (None, Some(sh)) = (shell_pid, shell) {
            if now >= shell_at {
                match spawn_console_shell(sh) {
                    Ok(pid) => {
                        shell_pid = Some(pid);
                        shell_error = None;
                    }
                    Err(e) => {
                        // Said once, not on every retry.
                        let msg = e.to_string();
                        if shell_error.as_deref() != Some(msg.as_str()) {
                            log!("no shell on {CONSOLE}: {msg}");
                            shell_error = Some(msg);
                        }
                    }
                }
                // A shell that exits at once (no console) is retried, not spun.
                shell_at = now + RESPAWN_DELAY;
            }
        }

        let timeout = libc::timespec {
            tv_sec: 1,
            tv_nsec: 0,
        };
        // SAFETY: the set and timeout are valid for the call; the info pointer may be null.
        let sig = unsafe { libc::sigtimedwait(&handled, std::ptr::null_mut(), &timeout) };
        if sig == libc::SIGTERM || sig == libc::SIGINT {
            power_off();
        }
        // Reap everything that ended: our children and every orphan the kernel gave us.
        loop {
            let mut status = 0;
            // SAFETY: `status` is a valid int for waitpid to fill.
            let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
            if pid <= 0 {
                break;
            }
            if Some(pid) == agent_pid {
                log!("the agent exited ({}); restarting it", describe(status));
                agent_pid = None;
            } else if Some(pid) == shell_pid {
                shell_pid = None;
            }
        }
    }
}

fn describe(status: libc::c_int) -> String {
    if libc::WIFEXITED(status) {
        format!("status {}", libc::WEXITSTATUS(status))
    } else if libc::WIFSIGNALED(status) {
        format!("signal {}", libc::WTERMSIG(status))
    } else {
        format!("wait status {status:#x}")
    }
}

fn spawn_agent(agent: &dyn Fn(), old_mask: &libc::sigset_t) -> Option<libc::pid_t> {
    // SAFETY: PID 1 is single-threaded, so the child may do anything after fork.
    match unsafe { libc::fork() } {
        -1 => {
            log!("cannot fork the agent: {}", io::Error::last_os_error());
            None
        }
        0 => {
            set_mask(libc::SIG_SETMASK, old_mask);
            agent();
            std::process::exit(0);
        }
        pid => Some(pid),
    }
}

/// A login shell on the serial console, in its own session with the console as its
/// controlling terminal (so ctrl-c works there).
fn spawn_console_shell(shell: &str) -> io::Result<libc::pid_t> {
    let tty = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOCTTY)
        .open(CONSOLE)?;
    let name = Path::new(shell)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "sh".into());
    let mut cmd = Command::new(shell);
    cmd.arg0(format!("-{name}"))
        .env_clear()
        .env("PATH", DEFAULT_PATH)
        .env("HOME", "/root")
        .env("USER", "root")
        .env("LOGNAME", "root")
        .env("SHELL", shell)
        .env("TERM", "vt220")
        .current_dir("/")
        .stdin(Stdio::from(tty.try_clone()?))
        .stdout(Stdio::from(tty.try_clone()?))
        .stderr(Stdio::from(tty));
    let setup = || -> io::Result<()> {
        // TIOCSCTTY's 1 takes the console even if the kernel made it PID 1's controlling
        // terminal (we are root).
        // SAFETY: in the forked child before exec, the calls below make only
        // async-signal-safe syscalls; stdin is already the console.
        unsafe {
            if libc::setsid() == -1 || libc::ioctl(0, libc::TIOCSCTTY, 1) == -1 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(())
    };
    // SAFETY: `setup` is async-signal-safe and allocation-free, as pre_exec requires.
    unsafe {
        cmd.pre_exec(setup);
    }
    let child = cmd.spawn()?;
    // Reaped by the supervisor's waitpid(-1) loop, not through the Child handle.
    // A process ID always fits a pid_t.
    Ok(libc::pid_t::try_from(child.id()).expect("a pid"))
}

/// Stops everything, syncs and powers off. Never returns.
fn power_off() -> ! {
    log!("powering off");
    // SAFETY: kill(-1) signals every process but PID 1; no memory effects.
    unsafe {
        libc::kill(-1, libc::SIGTERM);
    }
    let deadline = Instant::now() + SHUTDOWN_GRACE;
    while Instant::now() < deadline && reap_all() {
        std::thread::sleep(Duration::from_millis(50));
    }
    // SAFETY: as above.
    unsafe {
        libc::kill(-1, libc::SIGKILL);
    }
    reap_all();
    // SAFETY: sync and reboot have no memory effects; as PID 1 we may power off.
    unsafe {
        libc::sync();
        libc::reboot(libc::RB_POWER_OFF);
    }
    // Power-off failed (no way to power off this machine): halt instead, and never exit,
    // which as PID 1 would panic the kernel.
    log!("power off failed: {}", io::Error::last_os_error());
    // SAFETY: as above.
    unsafe {
        libc::reboot(libc::RB_HALT_SYSTEM);
    }
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// Reaps what has exited; whether children remain.
fn reap_all() -> bool {
    loop {
        let mut status = 0;
        // SAFETY: `status` is a valid int for waitpid to fill.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        match pid {
            0 => return true,
            -1 => return false, // ECHILD: nothing left
            _ => continue,
        }
    }
}
