//! The jail: a VMM that runs a guest for someone else runs with as little of the host as it
//! can. `mayfly run|restore --jail` puts the VMM in mount, PID, network, IPC and UTS namespaces
//! of its own and a cgroup v2 of its own, and, before any guest code runs, chroots it into an
//! empty directory and drops it to an unprivileged uid and gid with no capabilities.
//!
//! It happens in two steps, because of what each needs:
//!
//! 1. [`enter`], first thing in `main` while the process has one thread: the cgroup is made and
//!    its limits written; the process makes a new PID namespace and forks. The parent stays
//!    outside as a small waiter (it forwards the stop signals, waits, cleans up, and exits
//!    with the VMM's status); the child, PID 1 of its namespace, makes its mount, network, IPC
//!    and UTS namespaces (these must be made with one thread: a namespace made later would
//!    hold only the thread that made it) and joins the cgroup. It is still root and sees the
//!    host's files, so the start of the VM is the same code as without a jail: the kernel,
//!    the snapshot, the disks, `/dev/kvm` and userfaultfd are opened as usual.
//! 2. [`lock_down`], in the boot and restore paths right before the vCPU threads start: a new
//!    root is made of bind mounts of only what the VM still opens by path once it runs (the
//!    disk directory, read and written; the vsock socket's directory and a console-input
//!    FIFO, read-only; directories the user shares with `--jail-share`; a /proc of its own
//!    PID namespace), the process pivots into it and drops its credentials. Every descriptor
//!    it opened before (KVM, guest memory, taps, disks, sockets) keeps working; nothing else
//!    of the host can be reached by path, and the host's processes cannot be seen.
//!
//! Why not a user namespace: it must be made while the process has one thread and before
//! KVM and the devices are opened, and inside it the VMM could no longer open `/dev/kvm`, make
//! device nodes or write its cgroup as the host's root; dropping to an unprivileged uid after
//! the start (what Firecracker's jailer does too) gives the same wall without that.
//!
//! A jailed VM's NIC: its network namespace and nftables rules are made and changed as the
//! host's root, so the waiter keeps them ([`OutsideWork`], `mayfly_network::keeper`); the VMM
//! holds only the tap. A fork of a jailed VM is made from outside it (each clone needs a jail
//! of its own, which only root outside can make): each clone calls [`enter`] itself, in the
//! zygote's child, with its parent's [`JailConfig`] (see `mayfly_vmm::persist::fork`).

use std::ffi::CString;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{unshare, CloneFlags};
use nix::sys::signal::{kill, SigSet, SigmaskHow, Signal};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{fork, ForkResult, Gid, Pid, Uid};

/// Where jails are made by default (one directory per VMM, removed when it ends).
pub const DEFAULT_DIR: &str = "/run/mayfly/jail";
/// The uid and gid a jailed VMM runs as by default: `nobody` and `nogroup` on Debian.
pub const DEFAULT_ID: u32 = 65534;
/// pids.max of a jailed VMM's cgroup when not given: its vCPU and device threads with room
/// to spare (a jailed VM cannot fork, so nothing else starts there).
pub const DEFAULT_PIDS: u64 = 256;

/// The stop signals the waiter outside hands on to the VMM (see `main`'s StopSignals).
const FORWARDED: [Signal; 4] = [
    Signal::SIGTERM,
    Signal::SIGINT,
    Signal::SIGHUP,
    Signal::SIGUSR1,
];

/// What `--jail` and its options asked for (a fork's clones get their parent's, in their
/// zygote's messages).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JailConfig {
    /// Jails are made under it: `<dir>/<name>-<pid>/`.
    pub dir: PathBuf,
    pub uid: u32,
    pub gid: u32,
    /// Directories visible inside the jail at the same path, read and written (the jail's
    /// uid must be able to write them): where its snapshots may go.
    pub share: Vec<PathBuf>,
    /// memory.max, in MiB.
    pub memory_mib: Option<u64>,
    /// cpu.max, in CPUs (1.5: one and a half CPUs' worth of time).
    pub cpus: Option<f64>,
    /// pids.max (default [`DEFAULT_PIDS`] where the pids controller is available).
    pub pids: Option<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum JailError {
    #[error("--jail needs root: it makes namespaces, a cgroup and a root directory for the VMM, then drops it to --jail-uid (run mayfly as root, or without --jail)")]
    NotRoot,
    #[error("--jail-uid and --jail-gid must not be 0: a jailed VMM runs as an unprivileged user (the default is {DEFAULT_ID}, nobody)")]
    RootId,
    #[error("--jail-share {path}: {problem}")]
    Share { path: String, problem: String },
    #[error("--jail-cpus {0}: give a number of CPUs above 0, like 1 or 0.5")]
    Cpus(f64),
    #[error(
        "--jail-{option}: give a limit above 0 and below 2^44, or leave the option out for none"
    )]
    BadLimit { option: &'static str },
    #[error("{0}")]
    Cgroup(String),
    #[error("{0}: it cannot be forked as a jailed VM")]
    NotJailed(String),
    #[error("cannot {what}: {source}")]
    Sys { what: String, source: nix::Error },
    #[error("cannot {what} {path}: {source}")]
    Io {
        what: &'static str,
        path: String,
        source: std::io::Error,
    },
}

fn sys(what: impl Into<String>) -> impl FnOnce(nix::Error) -> JailError {
    let what = what.into();
    move |source| JailError::Sys { what, source }
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> JailError + 'a {
    move |source| JailError::Io {
        what,
        path: path.display().to_string(),
        source,
    }
}

/// Work the waiter does outside the jail for its VMM: given the VMM's pid (the host's
/// numbering) and the waiter's end of a SOCK_SEQPACKET pair whose other end the VMM holds
/// ([`Jail::outside`]), it starts what it needs (threads of the waiter) and returns what to do
/// once the VMM has ended, before the jail is cleaned up. A jailed VM's network is kept so
/// (see `mayfly_network::keeper`).
pub type OutsideWork =
    Box<dyn FnOnce(u32, std::os::unix::net::UnixDatagram) -> Box<dyn FnOnce()> + Send>;

/// The jail this process runs in, once [`enter`] has made it.
#[derive(Debug)]
pub struct Jail {
    config: JailConfig,
    /// The VMM's pid as the host sees it (it is 1 in its own PID namespace).
    host_pid: u32,
    /// The jail's directory (`root/` inside it becomes the VMM's root).
    dir: PathBuf,
    /// The VMM's cgroup, if a cgroup v2 hierarchy is mounted.
    cgroup: Option<PathBuf>,
    /// Readable (at its end) once the waiter outside is gone.
    waiter: std::os::unix::net::UnixStream,
    /// The VMM's end of the channel to the waiter's [`OutsideWork`], if it was given some.
    outside: Option<std::os::unix::net::UnixDatagram>,
}

static JAIL: OnceLock<Jail> = OnceLock::new();

/// The jail this process runs in, if it is jailed.
pub fn current() -> Option<&'static Jail> {
    JAIL.get()
}

/// This process's pid as the host sees it (what to give `kill` or read in `/proc`).
pub fn host_pid() -> u32 {
    current().map_or_else(std::process::id, |j| j.host_pid)
}

impl Jail {
    pub fn uid(&self) -> u32 {
        self.config.uid
    }

    /// The directories shared with the host at their own paths, read and written.
    pub fn shared(&self) -> &[PathBuf] {
        &self.config.share
    }

    /// The channel to the work the waiter does outside the jail, if any.
    pub fn outside(&self) -> Option<&std::os::unix::net::UnixDatagram> {
        self.outside.as_ref()
    }

    /// What this jail was made with.
    pub fn config(&self) -> &JailConfig {
        &self.config
    }

    /// What the control socket says of the jail.
    pub fn describe(&self) -> serde_json::Value {
        serde_json::json!({
            "dir": self.dir,
            "uid": self.config.uid,
            "gid": self.config.gid,
            "namespaces": ["mnt", "pid", "net", "ipc", "uts"],
            "cgroup": self.cgroup,
            "shared": self.config.share,
        })
    }

    /// Whether the VMM, inside its jail, can write at `path` (an absolute path under one of
    /// the directories shared with `--jail-share`).
    pub fn can_write(&self, path: &Path) -> bool {
        is_under(path, &self.config.share)
    }
}

/// Whether `path` is an absolute path under one of `dirs` (and does not climb out of it).
fn is_under(path: &Path, dirs: &[PathBuf]) -> bool {
    path.is_absolute()
        && !path
            .components()
            .any(|c| c == std::path::Component::ParentDir)
        && dirs.iter().any(|dir| path.starts_with(dir))
}

/// Check a jail's options before anything is made: root, unprivileged ids, shared
/// directories that exist and that the jail's uid can write.
fn check(config: &JailConfig) -> Result<(), JailError> {
    if !Uid::effective().is_root() {
        return Err(JailError::NotRoot);
    }
    if config.uid == 0 || config.gid == 0 {
        return Err(JailError::RootId);
    }
    if let Some(cpus) = config.cpus {
        if !(cpus.is_finite() && cpus > 0.0 && cpus <= 4096.0) {
            return Err(JailError::Cpus(cpus));
        }
    }
    const MAX_LIMIT: u64 = 1 << 44;
    if config.memory_mib.is_some_and(|m| m == 0 || m > MAX_LIMIT) {
        return Err(JailError::BadLimit {
            option: "memory-mib",
        });
    }
    if config.pids.is_some_and(|p| p == 0 || p > MAX_LIMIT) {
        return Err(JailError::BadLimit { option: "pids" });
    }
    for path in &config.share {
        let problem = |problem: String| JailError::Share {
            path: path.display().to_string(),
            problem,
        };
        if !path.is_absolute() {
            return Err(problem("give an absolute path".into()));
        }
        let meta = std::fs::metadata(path).map_err(|e| problem(e.to_string()))?;
        if !meta.is_dir() {
            return Err(problem("is not a directory".into()));
        }
        if !writable_by(&meta, config.uid, config.gid) {
            return Err(problem(format!(
                "uid {} cannot write it (owner {}, group {}, mode {:o}): chown it to the jail's uid, \
                 or share another directory",
                config.uid,
                meta.uid(),
                meta.gid(),
                meta.permissions().mode() & 0o7777
            )));
        }
    }
    Ok(())
}

/// Whether uid:gid may write into (and search) the directory `meta` describes.
fn writable_by(meta: &std::fs::Metadata, uid: u32, gid: u32) -> bool {
    let mode = meta.permissions().mode();
    if meta.uid() == uid {
        mode & 0o300 == 0o300
    } else if meta.gid() == gid {
        mode & 0o030 == 0o030
    } else {
        mode & 0o003 == 0o003
    }
}

/// Step 1: make the jail's namespaces and cgroup. Returns in the jailed child only (as the
/// VMM, PID 1 of its namespace, still root); the calling process becomes the waiter and
/// exits with the VMM's status. `sockets` are the VM's socket paths, which the waiter clears
/// once the VMM is gone (the VMM cannot remove them from inside its root).
pub fn enter(
    config: JailConfig,
    name: &str,
    sockets: Vec<PathBuf>,
    outside_work: Option<OutsideWork>,
) -> Result<(), JailError> {
    check(&config)?;
    let outer_pid = std::process::id();
    let dir = config.dir.join(format!("{name}-{outer_pid}"));
    std::fs::create_dir_all(&config.dir).map_err(io("make the jail directory", &config.dir))?;
    remove_dead_jails(&config.dir);
    match std::fs::create_dir(&dir) {
        Ok(()) => {}
        // A jail of a waiter that was killed and whose pid came round again.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir(&dir).map_err(io("make the jail directory", &dir))?;
        }
        Err(e) => return Err(io("make the jail directory", &dir)(e)),
    }
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
        .map_err(io("set the mode of", &dir))?;
    let cgroup = match make_cgroup(&config, &dir) {
        Ok(cgroup) => cgroup,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
    };
    let outside = Outside {
        dir: dir.clone(),
        cgroup: cgroup.clone(),
        sockets,
    };

    // Signals that come before the waiter listens are kept pending, not lost.
    let mut waited = SigSet::empty();
    for sig in FORWARDED {
        waited.add(sig);
    }
    waited.add(Signal::SIGCHLD);
    let mut old_mask = SigSet::empty();
    nix::sys::signal::pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&waited), Some(&mut old_mask))
        .map_err(sys("block signals"))?;
    let fail = |e: JailError| {
        outside.clean();
        e
    };
    mayfly_sys::trace::event("jail_cgroup_made");
    unshare(CloneFlags::CLONE_NEWPID).map_err(|e| fail(sys("make a PID namespace")(e)))?;
    // A socket pair the child watches to learn if its waiter died before it set PDEATHSIG:
    // the waiter's end closes when it dies.
    let (alive_read, alive_write) = std::os::unix::net::UnixStream::pair()
        .map_err(|e| fail(io("make a socket pair", Path::new("for the waiter"))(e)))?;
    let channel =
        match &outside_work {
            Some(_) => Some(mayfly_sys::seqpacket::pair().map_err(|e| {
                fail(io("make a socket pair", Path::new("for the waiter's work"))(e))
            })?),
            None => None,
        };
    // The VMM is born in its cgroup where the kernel allows (clone3 into it): moving it there
    // after a fork waits for an RCU grace period (see mayfly_sys::fork), which was most of a
    // jail's cost. Else it forks and moves itself.
    let cgroup_dir = cgroup
        .as_deref()
        .and_then(|dir| std::fs::File::open(dir).ok());
    let born_in = |dir: &std::fs::File| {
        use std::os::fd::AsFd;
        // SAFETY: the process has one thread here (`main` calls this before starting any),
        // so the child may run any code; the VMM never signals its main thread by its
        // pthread_t (see fork_into).
        match unsafe { mayfly_sys::fork::fork_into(dir.as_fd()) } {
            Ok(mayfly_sys::fork::Forked::Parent { child }) => Some(ForkResult::Parent {
                child: nix::unistd::Pid::from_raw(child),
            }),
            Ok(mayfly_sys::fork::Forked::Child) => Some(ForkResult::Child),
            Err(_) => None,
        }
    };
    let (forked, in_cgroup) = match cgroup_dir.as_ref().and_then(born_in) {
        Some(forked) => (forked, true),
        // SAFETY: the process has one thread here (`main` calls this before starting any),
        // so the child may run any code.
        None => (
            unsafe { fork() }.map_err(|e| fail(sys("fork the jailed VMM")(e)))?,
            false,
        ),
    };
    drop(cgroup_dir);
    match forked {
        ForkResult::Parent { child } => {
            drop(alive_read);
            let finish = match (outside_work, channel) {
                (Some(work), Some((_theirs, ours))) => {
                    // The waiter's work starts threads, which the kernel refuses (EINVAL)
                    // while the PID namespace for its children is not its own: go back to
                    // its own, the VMM's already made.
                    match own_pid_namespace() {
                        Ok(()) => {
                            let pid = u32::try_from(child.as_raw()).unwrap_or(0);
                            Some(work(pid, ours))
                        }
                        // The VMM, asking, hears nobody answer and says so.
                        Err(e) => {
                            eprintln!("mayfly: the jail's waiter cannot do its work: {e}");
                            None
                        }
                    }
                }
                _ => None,
            };
            wait_as_outside(child, &waited, outside, alive_write, finish)
        }
        ForkResult::Child => {
            drop(alive_write);
            let outside_end = channel.map(|(theirs, _ours)| theirs);
            // SAFETY: prctl(PR_SET_PDEATHSIG) with a valid signal; it has no memory effects.
            unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) };
            let mut fds = [nix::poll::PollFd::new(
                &alive_read,
                nix::poll::PollFlags::POLLIN,
            )];
            if nix::poll::poll(&mut fds, 0).unwrap_or(0) > 0 {
                // The waiter is already gone: nobody would see this VM end.
                std::process::exit(1);
            }
            let mut unblock = SigSet::empty();
            unblock.add(Signal::SIGCHLD);
            let _ =
                nix::sys::signal::pthread_sigmask(SigmaskHow::SIG_UNBLOCK, Some(&unblock), None);
            mayfly_sys::trace::event("jail_forked");
            // Set while the process has one thread, so that every thread it starts has it.
            // SAFETY: prctl(PR_SET_NO_NEW_PRIVS) has no memory effects.
            if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
                return Err(sys("forbid new privileges")(nix::Error::last()));
            }
            let host_pid = read_host_pid()?;
            if !in_cgroup {
                join_cgroup(cgroup.as_deref())?;
            }
            unshare(
                CloneFlags::CLONE_NEWNS
                    | CloneFlags::CLONE_NEWNET
                    | CloneFlags::CLONE_NEWIPC
                    | CloneFlags::CLONE_NEWUTS,
            )
            .map_err(sys(
                "make the jail's mount, network, IPC and UTS namespaces",
            ))?;
            // Nothing mounted in the jail reaches the host's mount table.
            mount(
                None::<&str>,
                "/",
                None::<&str>,
                MsFlags::MS_REC | MsFlags::MS_PRIVATE,
                None::<&str>,
            )
            .map_err(sys("make the jail's mounts private"))?;
            nix::unistd::sethostname(name).map_err(sys("set the jail's host name"))?;
            mayfly_sys::trace::event("jail_namespaces_made");
            let _ = JAIL.set(Jail {
                config,
                host_pid,
                dir,
                cgroup,
                waiter: alive_read,
                outside: outside_end,
            });
            Ok(())
        }
    }
}

/// The jail of the running jailed VMM `pid` as the kernel says it, for its clones: a VMM
/// its guest took over could say anything of itself, so only what the kernel shows is taken.
/// Its uid and gid from its status; its limits from its cgroup; the directory its jails go in
/// only if it holds this VMM's (a directory of root's named for its waiter's pid), since
/// a new jail clears dead ones there; the shares it names that it has mounted in its root (a
/// clone's jail checks that its uid may write each, as any jail's does).
pub fn config_of(pid: u32, claimed: &JailConfig) -> Result<JailConfig, JailError> {
    use std::os::unix::fs::MetadataExt;
    let status_path = PathBuf::from(format!("/proc/{pid}/status"));
    let status = std::fs::read_to_string(&status_path).map_err(io("read", &status_path))?;
    let field = |name: &str, nth: usize| -> Option<u32> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))?
            .split_whitespace()
            .nth(nth)?
            .parse()
            .ok()
    };
    let not_jailed = |why: &str| JailError::NotJailed(format!("VMM {pid} {why}"));
    let (Some(uid), Some(gid), Some(waiter)) =
        (field("Uid:", 1), field("Gid:", 1), field("PPid:", 0))
    else {
        return Err(not_jailed("has no uid, gid or parent in its status"));
    };
    let dir = &claimed.dir;
    let own_jail = dir.is_absolute()
        && !dir
            .components()
            .any(|c| c == std::path::Component::ParentDir)
        && std::fs::read_dir(dir).is_ok_and(|entries| {
            entries.flatten().any(|entry| {
                entry
                    .file_name()
                    .to_str()
                    .and_then(|n| n.rsplit_once('-'))
                    .is_some_and(|(_, p)| p == waiter.to_string())
                    && std::fs::symlink_metadata(entry.path())
                        .is_ok_and(|m| m.is_dir() && m.uid() == 0 && m.mode() & 0o7777 == 0o700)
            })
        });
    if !own_jail {
        return Err(not_jailed(&format!(
            "says its jails are made in {}, which does not hold its jail",
            dir.display()
        )));
    }
    let cgroup_path = PathBuf::from(format!("/proc/{pid}/cgroup"));
    let cgroup = std::fs::read_to_string(&cgroup_path).ok().and_then(|text| {
        let path = text
            .lines()
            .find_map(|l| l.strip_prefix("0::"))?
            .to_string();
        Some(cgroup2_mount()?.join(path.trim_start_matches('/')))
    });
    let read = |file: &str| -> Option<String> {
        let text = std::fs::read_to_string(cgroup.as_ref()?.join(file)).ok()?;
        Some(text.trim().to_string())
    };
    let memory_mib = read("memory.max")
        .and_then(|v| v.parse::<u64>().ok())
        .map(|bytes| bytes >> 20);
    let cpus = read("cpu.max").and_then(|v| {
        let (quota, period) = v.split_once(' ')?;
        let (quota, period) = (quota.parse::<f64>().ok()?, period.parse::<f64>().ok()?);
        (period > 0.0).then(|| quota / period)
    });
    let pids = read("pids.max").and_then(|v| v.parse::<u64>().ok());
    // A share is taken only if the VMM has it: a mount at that path in its own root.
    let mountinfo_path = PathBuf::from(format!("/proc/{pid}/mountinfo"));
    let mountinfo =
        std::fs::read_to_string(&mountinfo_path).map_err(io("read", &mountinfo_path))?;
    let mounted: Vec<PathBuf> = mountinfo
        .lines()
        .filter_map(|line| line.split_whitespace().nth(4))
        .map(|point| PathBuf::from(mayfly_sys::mountinfo::unescape(point)))
        .collect();
    let share = claimed
        .share
        .iter()
        .filter(|path| mounted.contains(path))
        .cloned()
        .collect();
    Ok(JailConfig {
        dir: claimed.dir.clone(),
        uid,
        gid,
        share,
        memory_mib,
        cpus,
        pids,
    })
}

/// Remove the jails (directory and cgroup) that waiters killed with SIGKILL left in `dir`: a
/// jail is `<name>-<waiter's pid>`, and one whose waiter is gone is dead (its VMM died with
/// its waiter). Best effort: what cannot be removed stays.
fn remove_dead_jails(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let group = cgroup2_mount().map(|mount| mount.join("mayfly"));
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.rsplit_once('-'))
            .and_then(|(_, pid)| pid.parse::<i32>().ok())
            .filter(|pid| *pid > 0)
        else {
            continue;
        };
        if kill(Pid::from_raw(pid), None) != Err(nix::errno::Errno::ESRCH) {
            continue;
        }
        // Not following symlinks: only a real directory of ours qualifies. What is in it
        // is plain directories and files out here (the mounts lived in the dead VMM's
        // mount namespace).
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
        if let Some(group) = &group {
            let _ = std::fs::remove_dir(group.join(&name));
        }
    }
}

/// Have the kernel kill this process when the waiter outside dies (nobody would see the VM
/// end, or clean up after it), and die now if it already has. Set again after each change of
/// credentials, which clears it.
fn die_with_waiter(waiter: &std::os::unix::net::UnixStream) {
    // SAFETY: prctl(PR_SET_PDEATHSIG) with a valid signal; it has no memory effects.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) };
    let mut fds = [nix::poll::PollFd::new(waiter, nix::poll::PollFlags::POLLIN)];
    if nix::poll::poll(&mut fds, 0).unwrap_or(0) > 0 {
        eprintln!("mayfly: the jailed VMM's waiter is gone; the VMM stops");
        std::process::exit(1);
    }
}

/// What the waiter removes once the VMM is gone.
struct Outside {
    dir: PathBuf,
    cgroup: Option<PathBuf>,
    sockets: Vec<PathBuf>,
}

impl Outside {
    fn clean(&self) {
        for path in &self.sockets {
            // Claiming the path clears a socket nobody listens on; dropping the claim removes
            // its lock file.
            drop(mayfly_sys::claim::SocketClaim::new(path));
        }
        // The mount points in it are plain directories and files out here (the mounts lived in
        // the VMM's mount namespace, gone with it).
        let _ = std::fs::remove_dir_all(&self.dir);
        if let Some(cgroup) = &self.cgroup {
            // The kernel empties a cgroup a moment after its last process exits.
            for _ in 0..100 {
                if std::fs::remove_dir(cgroup).is_ok() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
    }
}

/// The waiter: hand stop signals on to the VMM, wait for it, clean up, and end as it ended.
fn wait_as_outside(
    child: Pid,
    waited: &SigSet,
    outside: Outside,
    alive: std::os::unix::net::UnixStream,
    finish: Option<Box<dyn FnOnce()>>,
) -> ! {
    let status = loop {
        match waited.wait() {
            Ok(Signal::SIGCHLD) => match waitpid(child, Some(nix::sys::wait::WaitPidFlag::WNOHANG))
            {
                Ok(WaitStatus::Exited(_, code)) => break Ok(code),
                Ok(WaitStatus::Signaled(_, sig, _)) => break Err(sig),
                _ => {}
            },
            Ok(sig) => {
                let _ = kill(child, sig);
            }
            Err(_) => {}
        }
    };
    drop(alive);
    if let Some(finish) = finish {
        finish();
    }
    outside.clean();
    match status {
        Ok(code) => std::process::exit(code),
        Err(sig) => {
            // End by the same signal, so whoever started mayfly sees what ended the VMM.
            // SAFETY: resetting a signal's disposition to the default has no memory effects.
            unsafe { libc::signal(sig as libc::c_int, libc::SIG_DFL) };
            let mut set = SigSet::empty();
            set.add(sig);
            let _ = nix::sys::signal::pthread_sigmask(SigmaskHow::SIG_UNBLOCK, Some(&set), None);
            let _ = nix::sys::signal::raise(sig);
            std::process::exit(128 + sig as i32)
        }
    }
}

/// Make this process's children go into its own PID namespace again (undo
/// `unshare(CLONE_NEWPID)` once the child that needed it is made).
fn own_pid_namespace() -> Result<(), JailError> {
    let path = Path::new("/proc/self/ns/pid");
    let own = std::fs::File::open(path).map_err(io("open", path))?;
    nix::sched::setns(&own, CloneFlags::CLONE_NEWPID)
        .map_err(sys("go back to the waiter's own PID namespace"))
}

/// The VMM's pid in the host's PID namespace: /proc is still the host's here.
fn read_host_pid() -> Result<u32, JailError> {
    let link = Path::new("/proc/self");
    let target = std::fs::read_link(link).map_err(io("read", link))?;
    target
        .to_str()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| JailError::Cgroup(format!("/proc/self points at {target:?}, not a pid")))
}

/// Where the cgroup v2 hierarchy is mounted, from /proc/self/mountinfo.
fn cgroup2_mount() -> Option<PathBuf> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    mountinfo.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        (right.split_whitespace().next() == Some("cgroup2"))
            .then(|| left.split_whitespace().nth(4))
            .flatten()
            .map(|mount| PathBuf::from(mayfly_sys::mountinfo::unescape(mount)))
    })
}

/// Make the VMM's cgroup, `<cgroup2>/mayfly/<jail's name>`, with its limits; None when no
/// cgroup v2 hierarchy is mounted and no limit was asked for.
fn make_cgroup(config: &JailConfig, dir: &Path) -> Result<Option<PathBuf>, JailError> {
    let asked: Vec<&str> = [
        config.memory_mib.map(|_| "memory"),
        config.cpus.map(|_| "cpu"),
        config.pids.map(|_| "pids"),
    ]
    .into_iter()
    .flatten()
    .collect();
    let Some(mount) = cgroup2_mount() else {
        if asked.is_empty() {
            eprintln!(
                "mayfly: warning: no cgroup v2 hierarchy is mounted, so the jailed VMM has no \
                 cgroup of its own (mount -t cgroup2 none /sys/fs/cgroup)"
            );
            return Ok(None);
        }
        return Err(JailError::Cgroup(format!(
            "--jail-{} needs a cgroup v2 hierarchy and none is mounted: mount one \
             (mount -t cgroup2 none /sys/fs/cgroup), or leave the limit out",
            option_name(asked[0])
        )));
    };
    let available = std::fs::read_to_string(mount.join("cgroup.controllers")).unwrap_or_default();
    let available: Vec<&str> = available.split_whitespace().collect();
    if let Some(missing) = asked.iter().find(|c| !available.contains(c)) {
        return Err(JailError::Cgroup(format!(
            "--jail-{}: the cgroup v2 hierarchy at {} has no {missing} controller (it offers: {}); \
             on a host that still gives it to cgroup v1, boot with systemd.unified_cgroup_hierarchy=1, \
             or leave the limit out",
            option_name(missing),
            mount.display(),
            if available.is_empty() { "none".to_string() } else { available.join(" ") }
        )));
    }
    let mut wanted: Vec<&str> = asked.clone();
    if config.pids.is_none() && available.contains(&"pids") {
        wanted.push("pids");
    }
    let group = mount.join("mayfly");
    match std::fs::create_dir(&group) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io("make the cgroup", &group)(e)),
    }
    // The controllers are handed down from the root to mayfly/ to the VMM's own group (a
    // cgroup v2 group with processes of its own cannot hand them down, so mayfly/ has none).
    let control: String = wanted.iter().map(|c| format!("+{c} ")).collect();
    for parent in [&mount, &group] {
        if !wanted.is_empty() {
            let file = parent.join("cgroup.subtree_control");
            std::fs::write(&file, control.trim_end())
                .map_err(io("enable controllers in", &file))?;
        }
    }
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let cgroup = group.join(name);
    match std::fs::create_dir(&cgroup) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io("make the cgroup", &cgroup)(e)),
    }
    let write = |file: &str, value: String| {
        let path = cgroup.join(file);
        std::fs::write(&path, value).map_err(io("write", &path))
    };
    let result = (|| {
        if let Some(mib) = config.memory_mib {
            // Checked in `check`: at most 2^44 MiB, so the shift keeps every bit.
            write("memory.max", (mib << 20).to_string())?;
            // No swap: a guest over its budget is stopped, not slowed to a crawl.
            if cgroup.join("memory.swap.max").exists() {
                write("memory.swap.max", "0".into())?;
            }
        }
        if let Some(cpus) = config.cpus {
            const PERIOD_US: f64 = 100_000.0;
            // Checked in `check`: 0 < cpus <= 4096, so the quota fits a u64 well.
            let quota = (cpus * PERIOD_US).round().max(1000.0);
            write("cpu.max", format!("{quota:.0} {PERIOD_US:.0}"))?;
        }
        if wanted.contains(&"pids") {
            write("pids.max", config.pids.unwrap_or(DEFAULT_PIDS).to_string())?;
        }
        Ok(())
    })();
    match result {
        Ok(()) => Ok(Some(cgroup)),
        Err(e) => {
            let _ = std::fs::remove_dir(&cgroup);
            Err(e)
        }
    }
}

fn option_name(controller: &str) -> &'static str {
    match controller {
        "memory" => "memory-mib",
        "cpu" => "cpus",
        _ => "pids",
    }
}

fn join_cgroup(cgroup: Option<&Path>) -> Result<(), JailError> {
    if let Some(cgroup) = cgroup {
        let procs = cgroup.join("cgroup.procs");
        // "0" is the writing process.
        std::fs::write(&procs, "0").map_err(io("join the cgroup through", &procs))?;
    }
    Ok(())
}

/// A path the jailed VMM still opens once its guest runs.
#[derive(Clone, Debug)]
pub struct Share {
    pub path: PathBuf,
    pub writable: bool,
}

/// What of the host a jailed VM still needs once it runs: the paths it opens, and the files
/// it made as root that it must still open for writing as the jail's uid (its own vsock
/// socket, which its controller connects to to reach the guest agent).
#[derive(Clone, Debug, Default)]
pub struct Needs {
    pub shares: Vec<Share>,
    pub own: Vec<PathBuf>,
}

/// Step 2: with everything the VM needs open, shut the VMM into its root and drop its
/// credentials (no-op without a jail). `needs` are the VM's own paths (its disk directory,
/// its vsock socket's directory, its console-input FIFO); the jail's `--jail-share`
/// directories are added. Called before any vCPU runs.
pub fn lock_down(needs: &Needs) -> Result<(), JailError> {
    let Some(jail) = current() else {
        return Ok(());
    };
    mayfly_sys::trace::event("jail_lock_down");
    for path in &needs.own {
        if path.exists() {
            chown_tree_top(path, jail.config.uid, jail.config.gid)?;
        }
    }
    let root = jail.dir.join("root");
    std::fs::create_dir(&root).map_err(io("make the jail's root", &root))?;
    // pivot_root wants a mount point.
    bind(&root, &root, false)?;
    let own = needs.shares.iter().map(|share| (share.clone(), true));
    let theirs = jail.config.share.iter().map(|p| {
        let share = Share {
            path: p.clone(),
            writable: true,
        };
        (share, false)
    });
    // The directories bound so far, and whether they were bound writable.
    let mut bound: Vec<(PathBuf, bool)> = Vec::new();
    for (share, ours) in own.chain(theirs) {
        let Ok(meta) = std::fs::metadata(&share.path) else {
            // Not there (a FIFO not made yet, a directory made later): the VM does without.
            continue;
        };
        // Within a directory bound already, as writable as it needs: seen there. (Its mount
        // point would otherwise be made in that directory, which is the host's: a console
        // FIFO beside the vsock socket, opened to be made, would wait for a reader forever.)
        if bound
            .iter()
            .any(|(dir, writable)| share.path.starts_with(dir) && (*writable || !share.writable))
        {
            continue;
        }
        let inside = root.join(share.path.strip_prefix("/").unwrap_or(&share.path));
        if ours && meta.is_dir() && meta.permissions().mode() & 0o002 != 0 {
            // Shared whole, a directory anyone writes (/tmp) would bring every socket and
            // file others put there into the jail.
            return Err(JailError::Share {
                path: share.path.display().to_string(),
                problem: "holds the VM's vsock socket and anyone may write it (like /tmp): the \
                          jail would share it whole; put the VM's sockets (--api-sock, --vsock) \
                          in a directory of their own"
                    .into(),
            });
        }
        if meta.is_dir() {
            std::fs::create_dir_all(&inside).map_err(io("make a mount point", &inside))?;
            if share.writable && ours {
                // The VM's own directory (its disk layers): its uid writes there now.
                chown_tree_top(&share.path, jail.config.uid, jail.config.gid)?;
                give_own_layers(&share.path, jail.config.uid, jail.config.gid)?;
            }
        } else {
            if let Some(parent) = inside.parent() {
                std::fs::create_dir_all(parent).map_err(io("make a mount point", parent))?;
            }
            std::fs::File::create(&inside).map_err(io("make a mount point", &inside))?;
        }
        bind(&share.path, &inside, !share.writable)?;
        if meta.is_dir() {
            bound.push((share.path.clone(), share.writable));
        }
    }
    // A /proc of the jail's own PID namespace: the VMM reads its own maps and status there.
    let proc_dir = root.join("proc");
    std::fs::create_dir(&proc_dir).map_err(io("make a mount point", &proc_dir))?;
    mount(
        Some("proc"),
        &proc_dir,
        Some("proc"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        None::<&str>,
    )
    .map_err(sys("mount the jail's /proc"))?;
    // The root itself is read-only: the VMM writes only where it shares.
    mount(
        None::<&str>,
        &root,
        None::<&str>,
        MsFlags::MS_BIND
            | MsFlags::MS_REMOUNT
            | MsFlags::MS_RDONLY
            | MsFlags::MS_NOSUID
            | MsFlags::MS_NODEV,
        None::<&str>,
    )
    .map_err(sys("make the jail's root read-only"))?;
    // Relative paths the VM holds (a disk directory given as `vm.disks`) resolve as before
    // where the directory they are in is shared.
    let cwd = std::env::current_dir().ok();
    nix::unistd::chdir(&root).map_err(sys("enter the jail's root"))?;
    // The old root ends up under the new one, at ".", and is then detached: nothing of the
    // host's tree is left to reach.
    nix::unistd::pivot_root(".", ".").map_err(sys("pivot into the jail's root"))?;
    umount2(".", MntFlags::MNT_DETACH).map_err(sys("detach the host's root"))?;
    if cwd.is_none_or(|cwd| nix::unistd::chdir(&cwd).is_err()) {
        nix::unistd::chdir("/").map_err(sys("enter the jail's root"))?;
    }

    // Credentials last: groups, then gid, then uid (after which nothing above is allowed).
    // glibc applies each to every thread of the process.
    let (uid, gid) = (
        Uid::from_raw(jail.config.uid),
        Gid::from_raw(jail.config.gid),
    );
    nix::unistd::setgroups(&[]).map_err(sys("drop the supplementary groups"))?;
    nix::unistd::setresgid(gid, gid, gid).map_err(sys(format!("become gid {gid}")))?;
    nix::unistd::setresuid(uid, uid, uid).map_err(sys(format!("become uid {uid}")))?;
    die_with_waiter(&jail.waiter);
    mayfly_sys::trace::event("jail_locked");
    // A change of uid makes the process undumpable, and its /proc/self files then belong to
    // root: the VMM could no longer read its own page map (which snapshots read). Nothing
    // else of its uid can see it (its PID namespace holds only it).
    // SAFETY: prctl(PR_SET_DUMPABLE) has no memory effects.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 1, 0, 0, 0) } != 0 {
        return Err(sys("keep the VMM's /proc readable to itself")(
            nix::Error::last(),
        ));
    }
    Ok(())
}

/// Give a path the VM writes in to the jail's uid (its own disk directory, whose files are
/// already open; its own vsock socket).
fn chown_tree_top(path: &Path, uid: u32, gid: u32) -> Result<(), JailError> {
    let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| JailError::Share {
        path: path.display().to_string(),
        problem: "has a NUL byte".into(),
    })?;
    // SAFETY: chown with a valid NUL-terminated path; it has no memory effects.
    if unsafe { libc::chown(c.as_ptr(), uid, gid) } != 0 {
        return Err(io("give to the jail's uid", path)(
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// Give the jail's uid the files root made in the VM's own disk directory before the jail
/// closed (its new top layers): a snapshot hard-links the layers it freezes, and the kernel
/// (`protected_hardlinks`) lets a process link only files it owns or may write. A file with
/// other links is left as it is: a frozen layer that a fork's clones (or a snapshot) share,
/// sealed root's by the sandbox manager, must not become this VMM's again.
fn give_own_layers(dir: &Path, uid: u32, gid: u32) -> Result<(), JailError> {
    use std::os::unix::fs::MetadataExt;
    let entries = std::fs::read_dir(dir).map_err(io("read", dir))?;
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if meta.is_file() && meta.uid() == 0 && meta.nlink() == 1 {
            chown_tree_top(&path, uid, gid)?;
        }
    }
    Ok(())
}

fn bind(from: &Path, to: &Path, read_only: bool) -> Result<(), JailError> {
    let shown = || format!("bind-mount {} at {}", from.display(), to.display());
    mount(
        Some(from),
        to,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        None::<&str>,
    )
    .map_err(|e| sys(shown())(e))?;
    let mut flags = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    if read_only {
        flags |= MsFlags::MS_RDONLY;
    }
    mount(None::<&str>, to, None::<&str>, flags, None::<&str>).map_err(|e| sys(shown())(e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> JailConfig {
        JailConfig {
            dir: PathBuf::from(DEFAULT_DIR),
            uid: DEFAULT_ID,
            gid: DEFAULT_ID,
            share: Vec::new(),
            memory_mib: None,
            cpus: None,
            pids: None,
        }
    }

    #[test]
    fn bad_options_are_refused_before_anything_is_made() {
        if !Uid::effective().is_root() {
            assert!(matches!(check(&config()), Err(JailError::NotRoot)));
            return;
        }
        assert!(check(&config()).is_ok());
        let with = |f: &dyn Fn(&mut JailConfig)| {
            let mut c = config();
            f(&mut c);
            check(&c).unwrap_err().to_string()
        };
        assert!(with(&|c| c.uid = 0).contains("must not be 0"));
        assert!(with(&|c| c.cpus = Some(0.0)).contains("above 0"));
        assert!(with(&|c| c.cpus = Some(f64::NAN)).contains("above 0"));
        assert!(with(&|c| c.memory_mib = Some(0)).contains("--jail-memory-mib: give a limit"));
        assert!(with(&|c| c.share = vec!["relative".into()]).contains("absolute"));
        assert!(with(&|c| c.share = vec!["/nonexistent-mayfly".into()]).contains("No such file"));
        // /etc belongs to root, mode 755: nobody cannot write it.
        assert!(with(&|c| c.share = vec!["/etc".into()]).contains("cannot write it"));
    }

    #[test]
    fn a_jail_writes_only_under_what_it_shares() {
        let shared = [PathBuf::from("/srv/snaps")];
        assert!(is_under(Path::new("/srv/snaps/a"), &shared));
        assert!(!is_under(Path::new("/srv/snaps/../etc"), &shared));
        assert!(!is_under(Path::new("/srv/snapshots"), &shared));
        assert!(!is_under(Path::new("snaps"), &shared));
    }
}
