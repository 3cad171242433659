//! A sandbox's VMM as a process: starting one (`mayfly run` or `mayfly restore`, its pid
//! saved before anything else, then waited for until its control socket answers), following
//! it through a pidfd, ending it, finding it again after a manager's restart, reading its
//! memory use and its log, and asking it to pause and snapshot. Nothing here knows the
//! manager: what a start needs is given to it.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::cgroup::{self, MemoryGroups};
use crate::error::ServeError;
use crate::records::Record;
use crate::util::io_error;

/// How long a new or waking VMM may take to answer on its control socket. A cold boot of a
/// Linux guest in the test rig takes tens of seconds; a restore on real KVM milliseconds.
const START_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a VMM asked to shut down may take to exit before it is killed.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(5);
/// Requests the manager sends a VMM (pause, snapshot, shutdown).
pub const VMM_REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

/// A sandbox's running VMM.
pub struct Vmm {
    pid: u32,
    pidfd: OwnedFd,
    /// Set when this manager started it (then it reaps it); an adopted VMM's parent is gone.
    child: Option<Child>,
    /// Its memory cgroup, removed once it has exited (an adopted VMM's is removed by the
    /// next start of its sandbox).
    cgroup: Option<std::path::PathBuf>,
}

/// Whether `fd` becomes readable within `timeout` (a pidfd does once its process exited).
fn readable(fd: std::os::fd::BorrowedFd<'_>, timeout: Duration) -> bool {
    let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    let mut fds = [nix::poll::PollFd::new(&fd, nix::poll::PollFlags::POLLIN)];
    nix::poll::poll(&mut fds, ms).unwrap_or(0) > 0
}

impl Vmm {
    pub fn pid(&self) -> u32 {
        self.pid
    }

    pub fn exited(&self) -> bool {
        readable(self.pidfd.as_fd(), Duration::ZERO)
    }

    /// Wait until it has exited (true) or `timeout` passed.
    pub fn wait_exit(&mut self, timeout: Duration) -> bool {
        let gone = readable(self.pidfd.as_fd(), timeout);
        if gone {
            if let Some(child) = &mut self.child {
                let _ = child.wait();
            }
            if let Some(dir) = self.cgroup.take() {
                cgroup::remove(&dir);
            }
        }
        gone
    }

    /// How it ended, if this manager started it and it has ended.
    pub fn exit_status(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// End it: SIGTERM first (a jailed VMM's waiter hands it on and then clears the jail's
    /// directory and cgroup), SIGKILL if it has not ended within a few seconds.
    pub fn kill(&mut self) {
        mayfly_sys::pidfd::signal(&self.pidfd, libc::SIGTERM);
        if !self.wait_exit(STOP_TIMEOUT) {
            mayfly_sys::pidfd::kill(&self.pidfd);
            self.wait_exit(STOP_TIMEOUT);
        }
    }

    /// Follow a VMM this manager did not start as its child (a fork's clone, made by the
    /// zygote of the fork's helper, or its jail's waiter): its pidfd and start time, or None
    /// if `pid` is no process now.
    pub fn follow(pid: u32, cgroup: Option<std::path::PathBuf>) -> Option<(Vmm, u64)> {
        let start = start_time(pid)?;
        let pidfd = mayfly_sys::pidfd::open(libc::pid_t::try_from(pid).ok()?).ok()?;
        // Checked again now that the pidfd is held: the pid cannot change hands from here on.
        if start_time(pid) != Some(start) {
            return None;
        }
        let vmm = Vmm {
            pid,
            pidfd,
            child: None,
            cgroup,
        };
        Some((vmm, start))
    }

    /// Ask it to shut down on its socket; kill it if it has not ended in a few seconds.
    pub fn stop(&mut self, sock: &Path) {
        let _ = mayfly_api::request_with_timeout(sock, "PUT", "/vm/shutdown", None, STOP_TIMEOUT);
        if !self.wait_exit(STOP_TIMEOUT) {
            self.kill();
        }
    }
}

/// Field 22 of /proc/PID/stat: when the process started, in clock ticks since boot; None
/// for no such process, or one that has ended (a zombie not reaped yet).
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold anything: split after it.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    if matches!(fields.next(), Some("Z" | "X" | "x")) {
        return None;
    }
    fields.nth(18)?.parse().ok()
}

/// The process a record names, if it is still that process: the same pid, started at the
/// same time (a pid used again by another process is never taken for it).
pub fn find_process(record: &Record) -> Option<Vmm> {
    let (vmm, start) = Vmm::follow(record.pid?, None)?;
    (Some(start) == record.pid_start).then_some(vmm)
}

/// The processes started for a VMM control socket, found by their command lines (and only
/// those running the manager's own binary: see [`runs_our_binary`]): every VMM
/// the manager starts is told its sandbox's socket (`--api-sock PATH`), a path no other
/// sandbox has, and a jailed VMM (forked by its waiter) has the same command line as the
/// waiter. This finds the VMMs a record never got to name (a manager killed between a VMM's
/// start and its record: see `journal.rs`).
pub struct VmmsBySocket(BTreeMap<PathBuf, Vec<u32>>);

/// Whether process `pid` runs the same binary as this manager (the same file: device and
/// inode of `/proc/PID/exe` and `/proc/self/exe`): a command line is the process's to write,
/// its binary is not.
fn runs_our_binary(pid: u32) -> bool {
    use std::os::unix::fs::MetadataExt;
    static OURS: std::sync::OnceLock<Option<(u64, u64)>> = std::sync::OnceLock::new();
    let ours = OURS.get_or_init(|| {
        std::fs::metadata("/proc/self/exe")
            .ok()
            .map(|m| (m.dev(), m.ino()))
    });
    let theirs = std::fs::metadata(format!("/proc/{pid}/exe"))
        .ok()
        .map(|m| (m.dev(), m.ino()));
    ours.is_some() && *ours == theirs
}

/// Whether process `pid` was started with `--api-sock SOCK` and runs this manager's binary.
fn started_on(pid: u32, sock: &[u8]) -> bool {
    if !runs_our_binary(pid) {
        return false;
    }
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
    args.windows(2)
        .any(|pair| pair[0] == b"--api-sock" && pair[1] == sock)
}

/// A process's parent (field 4 of /proc/PID/stat).
fn parent(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 1..]
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// Whether `pid` is `ancestor` or one of its descendants (a jailed VMM is its waiter's child).
fn descends_from(mut pid: u32, ancestor: u32) -> bool {
    for _ in 0..16 {
        if pid == ancestor {
            return true;
        }
        match parent(pid) {
            Some(p) if p > 1 => pid = p,
            _ => return false,
        }
    }
    false
}

impl VmmsBySocket {
    /// Every process of the host started with `--api-sock PATH`, by PATH (one pass of /proc).
    pub fn scan() -> VmmsBySocket {
        let mut found: BTreeMap<PathBuf, Vec<u32>> = BTreeMap::new();
        let Ok(procs) = std::fs::read_dir("/proc") else {
            return VmmsBySocket(found);
        };
        for pid in procs
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        {
            let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
                continue;
            };
            let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
            if !args.contains(&&b"--api-sock"[..]) || !runs_our_binary(pid) {
                continue;
            }
            for pair in args.windows(2) {
                if pair[0] == b"--api-sock" {
                    found
                        .entry(PathBuf::from(std::ffi::OsStr::from_bytes(pair[1])))
                        .or_default()
                        .push(pid);
                }
            }
        }
        VmmsBySocket(found)
    }

    /// End every process found for `sock` but `keep` (the VMM its record names, adopted) and
    /// its children: SIGTERM, SIGKILL if it has not ended within [`STOP_TIMEOUT`], each
    /// waited for, so that the sandbox's socket and uid are free once this returns. Returns
    /// the pids ended.
    pub fn end(&self, sock: &Path, keep: Option<u32>) -> Vec<u32> {
        let mut ended = Vec::new();
        let Some(pids) = self.0.get(sock) else {
            return ended;
        };
        for &pid in pids {
            if keep.is_some_and(|k| descends_from(pid, k)) {
                continue;
            }
            let Ok(pidfd) = mayfly_sys::pidfd::open(libc::pid_t::try_from(pid).unwrap_or(-1))
            else {
                continue;
            };
            // Checked again now that the pidfd holds it: the pid cannot change hands from
            // here on.
            if !started_on(pid, sock.as_os_str().as_bytes()) {
                continue;
            }
            Vmm {
                pid,
                pidfd,
                child: None,
                cgroup: None,
            }
            .kill();
            ended.push(pid);
        }
        ended
    }
}

/// Resident memory of a process, in bytes.
fn rss_bytes(pid: u32) -> u64 {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return 0;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map_or(0, |kib| kib << 10)
}

/// Resident memory of a process and its children (a jailed VMM is its waiter's child).
pub fn rss_tree_bytes(pid: u32) -> u64 {
    let children =
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    rss_bytes(pid)
        + children
            .split_whitespace()
            .filter_map(|c| c.parse::<u32>().ok())
            .map(rss_bytes)
            .sum::<u64>()
}

/// The last lines of a VMM's log, for an error message.
pub fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let tail = lines[lines.len().saturating_sub(5)..].join(" | ");
    if tail.is_empty() {
        "(its log is empty)".into()
    } else {
        tail
    }
}

/// Keep a VMM's log at most `limit` bytes: past it, its last half is kept behind a line
/// saying how much went (the VMM appends to it, so it writes on at the new end). What the
/// VMM writes while the tail is copied may be lost; the log is a diagnostic. Returns whether
/// it was trimmed.
pub fn trim_log(path: &Path, limit: u64) -> std::io::Result<bool> {
    use std::io::{Read, Seek, SeekFrom, Write};
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    let len = file.metadata()?.len();
    if len <= limit {
        return Ok(false);
    }
    let keep = limit / 2;
    file.seek(SeekFrom::Start(len - keep))?;
    let mut tail = Vec::with_capacity(usize::try_from(keep).unwrap_or(0));
    std::io::Read::by_ref(&mut file)
        .take(keep)
        .read_to_end(&mut tail)?;
    let line = format!(
        "[mayfly serve: this log reached {limit} bytes; the first {} were dropped]\n",
        len - keep
    );
    // Written over its start, then cut after: a reader never finds it empty.
    file.seek(SeekFrom::Start(0))?;
    file.write_all(line.as_bytes())?;
    file.write_all(&tail)?;
    file.set_len(line.len() as u64 + tail.len() as u64)?;
    Ok(true)
}

/// A VMM's log, opened to append to: its stdout and its stderr.
pub struct Log {
    out: File,
    err: File,
}

/// Open (or make, mode 0600) the VMM log at `path`.
pub fn open_log(path: &Path) -> Result<Log, ServeError> {
    let out = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .open(path)
        .map_err(io_error("open", path))?;
    let err = out.try_clone().map_err(io_error("open", path))?;
    Ok(Log { out, err })
}

/// How a VMM starts.
pub enum Start<'a> {
    /// A boot: `mayfly run` with these options.
    Boot(Vec<String>),
    /// A restore of `snapshot`, its disk layers only from within the VMM's `vm/`, and a
    /// network policy (`--net`) if one is given.
    Restore {
        snapshot: &'a Path,
        net: Option<&'a str>,
        /// A fresh MAC for its NIC (`mayfly restore --new-mac`): a fork's clone.
        new_mac: bool,
    },
}

/// What starting a VMM takes.
pub struct Launch<'a> {
    /// The mayfly binary.
    pub mayfly: &'a Path,
    /// Its name (`--name`), also what its errors call it.
    pub name: &'a str,
    /// Its memory cgroup's name (see [`crate::sandbox::Sandbox::group`]).
    pub group: &'a str,
    pub start: Start<'a>,
    /// Its control socket.
    pub sock: &'a Path,
    pub console: &'a Path,
    /// Where its log is (opened by the caller), quoted when it fails.
    pub log_path: &'a Path,
    /// The directory it shares when jailed and keeps its disk layers in (`disks/`).
    pub vm_dir: &'a Path,
    /// Jailed as this uid and gid.
    pub jail_uid: Option<u32>,
    /// Abort the manager right after the VMM is started (`--crash-at after-spawn`; tests).
    pub crash_after_spawn: bool,
    /// The most memory it may hold, guest and VMM (its memory cgroup's limit), bytes.
    pub memory_limit: u64,
    /// Where its memory cgroup is made.
    pub groups: &'a MemoryGroups,
    /// The most its console file takes (`MAYFLY_CONSOLE_LIMIT`), bytes.
    pub console_limit: u64,
    /// Where its network is made, if it has one (`--net-uplink`, `--net-dir`, ...).
    pub net_args: &'a [String],
}

/// Start a VMM and wait for its control socket to answer. `persist` is given its pid and
/// start time as soon as it runs, before anything else: a manager killed from then on finds
/// the process in the record (and ends or adopts it) instead of leaving it running unowned.
pub fn launch(
    how: &Launch<'_>,
    log: Log,
    persist: &mut dyn FnMut(u32, Option<u64>) -> Result<(), ServeError>,
) -> Result<Vmm, ServeError> {
    let mut command = Command::new(how.mayfly);
    match &how.start {
        Start::Restore {
            snapshot,
            net,
            new_mac,
        } => {
            // Layers it names by full path must be its own (see disks::open_for_restore).
            command
                .arg("restore")
                .arg(snapshot)
                .arg("--disk-layers-within")
                .arg(how.vm_dir);
            if let Some(net) = net {
                command.args(["--net", net]);
            }
            if *new_mac {
                command.arg("--new-mac");
            }
        }
        Start::Boot(args) => {
            command.arg("run").args(args);
        }
    }
    command.args(how.net_args);
    command
        .arg("--name")
        .arg(how.name)
        .arg("--api-sock")
        .arg(how.sock)
        .arg("--console")
        .arg(how.console)
        .arg("--disk-dir")
        .arg(how.vm_dir.join("disks"));
    let group = how.groups.make(how.group, how.memory_limit)?;
    if let Some(uid) = how.jail_uid {
        // A jailed VMM moves to its jail's own cgroup v2 group: the limit goes there too.
        if group.as_ref().is_some_and(|g| g.v2) {
            command
                .arg("--jail-memory-mib")
                .arg(how.memory_limit.div_ceil(1 << 20).to_string());
        }
        // Its `vm/` is all it shares: its snapshot goes there when it sleeps.
        command
            .arg("--jail")
            .arg("--jail-share")
            .arg(how.vm_dir)
            .args([
                "--jail-uid",
                &uid.to_string(),
                "--jail-gid",
                &uid.to_string(),
            ]);
    }
    command
        .stdin(Stdio::null())
        .stdout(log.out)
        .stderr(log.err)
        .env("MAYFLY_CONSOLE_LIMIT", how.console_limit.to_string())
        // Its own process group: a Ctrl-C meant for the manager does not stop its VMs.
        .process_group(0);
    if let Some(group) = &group {
        let procs = std::os::fd::AsRawFd::as_raw_fd(&group.procs);
        // SAFETY: between fork and exec the closure only calls write(2) (async-signal-safe)
        // on a descriptor the parent holds open until spawn returns, with a static buffer.
        unsafe {
            command.pre_exec(move || {
                if libc::write(procs, b"0".as_ptr().cast(), 1) == 1 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
    }
    let child = command.spawn().map_err(|e| {
        if let Some(group) = &group {
            cgroup::remove(&group.dir);
        }
        io_error("start", how.mayfly)(e)
    })?;
    let pid = child.id();
    if how.crash_after_spawn {
        eprintln!("mayfly serve: --crash-at after-spawn: aborting (VMM pid {pid} not saved)");
        std::process::abort();
    }
    let pidfd =
        mayfly_sys::pidfd::open(libc::pid_t::try_from(pid).unwrap_or(-1)).map_err(|source| {
            ServeError::Io {
                what: "follow (pidfd_open) the VMM of",
                path: how.name.to_owned(),
                source,
            }
        })?;
    let mut vmm = Vmm {
        pid,
        pidfd,
        child: Some(child),
        cgroup: group.map(|g| g.dir),
    };
    // Saved before anything else: a manager killed from here on finds this process in
    // the record (and ends or adopts it) instead of leaving it running unowned.
    if let Err(e) = persist(pid, start_time(pid)) {
        vmm.kill();
        return Err(e);
    }
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if vmm.exited() {
            vmm.wait_exit(Duration::ZERO);
            return Err(ServeError::VmmFailed(format!(
                "the VMM of {} ended before it answered: {}",
                how.name,
                log_tail(how.log_path)
            )));
        }
        if let Ok((200, _)) =
            mayfly_api::request_with_timeout(how.sock, "GET", "/vm", None, Duration::from_secs(5))
        {
            return Ok(vmm);
        }
        if Instant::now() > deadline {
            vmm.kill();
            return Err(ServeError::VmmFailed(format!(
                "the VMM of {} did not answer within {} s: {}",
                how.name,
                START_TIMEOUT.as_secs(),
                log_tail(how.log_path)
            )));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Pause a VM and snapshot it to `snapshot`, as a suspend does: whether its user had paused
/// it already (its VMM answers the pause with 409), and the snapshot's report or what
/// failed. When `diffable` says so (asked once the VM is paused), a diff over the snapshot
/// it was restored from is tried first (its dirtied pages, not its RAM); a VMM that cannot
/// make one (a booted VM: its memory is no snapshot's) refuses before writing anything, and
/// a full snapshot is written instead.
pub fn pause_and_snapshot(
    sock: &Path,
    snapshot: &Path,
    diffable: impl FnOnce() -> bool,
) -> (bool, Result<Value, String>) {
    // Paused first (a snapshot is of a paused VM); a VM paused through its own socket
    // already is, and says so with 409.
    let mut user_paused = false;
    let snapped =
        match mayfly_api::request_with_timeout(sock, "PUT", "/vm/pause", None, VMM_REQUEST_TIMEOUT)
        {
            Ok((status, _)) if status < 300 => Ok(()),
            Ok((409, _)) => {
                user_paused = true;
                Ok(())
            }
            Ok((status, body)) => Err(format!("PUT /vm/pause: {status} {body}")),
            Err(e) => Err(format!("PUT /vm/pause: {e}")),
        }
        .and_then(|()| {
            let take = |diff: bool| {
                mayfly_api::request_with_timeout(
                    sock,
                    "PUT",
                    "/vm/snapshot",
                    Some(&json!({ "path": snapshot, "diff": diff })),
                    VMM_REQUEST_TIMEOUT,
                )
            };
            if diffable() {
                match take(true) {
                    Ok((status, _)) if status >= 300 => take(false),
                    other => other,
                }
            } else {
                take(false)
            }
            .map_err(|e| format!("PUT /vm/snapshot: {e}"))
            .and_then(|(status, body)| {
                if status < 300 {
                    Ok(body)
                } else {
                    Err(format!("PUT /vm/snapshot: {status} {body}"))
                }
            })
        });
    (user_paused, snapped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_start_time_tells_a_reused_pid_apart() {
        let me = std::process::id();
        assert!(start_time(me).is_some());
        assert_eq!(start_time(me), start_time(me));
        assert_eq!(start_time(u32::MAX), None);
    }
}
