//! The fork path: from a running VM to N running clones, each its own `mayfly` process with
//! its own control socket, console and name.
//!
//! 1. Pause the parent and read its state (as a snapshot does).
//! 2. Freeze its memory into files nobody writes. A VM whose RAM is a memfd hands over that
//!    memfd as is, with no copy, and carries on with a private (copy-on-write) mapping of it
//!    (`GuestRam::freeze`). A VM restored copy-on-write from a snapshot hands over that
//!    snapshot's memory file as it is and, above it, a new sealed memfd of only the pages that
//!    differ from it (`GuestRam::freeze_layered`; the state names the two as memory layers),
//!    and runs on on its own mapping, untouched. Any other VM (a lazy restore, a clone of a
//!    booted VM, a jailed VM over a file of its own) first writes its memory, sparse, into a
//!    new memfd. The parent and every clone map the files privately: clean pages stay shared
//!    through the page cache, each side's writes stay its own, and nobody writes the files.
//! 3. Start the clones from a zygote ([`crate::persist::zygote`]): one `mayfly zygote` process per
//!    fork, given the state (a sealed memfd) and the memory as inherited descriptors (nothing
//!    goes to disk), prepares the restore once and fork(2)s one child per clone, each child
//!    making its own KVM VM. Each clone is its own process with its own control socket,
//!    console and name, an index, a new VM generation ID (its kernel RNG reseeds) and its
//!    wall clock set from the host.
//! 4. Wait until every clone reports it is ready (restored, held paused), resume the parent,
//!    answer, and let the clones all go at once once the answer is written (the fork's socket
//!    closes with a "go" queued: see [`crate::persist::zygote::ForkEnd`] and
//!    [`crate::persist::zygote::Release`]).
//!
//! Why this mechanism, measured in the test rig (benches/results/fork-rig.json, 128 MiB guest):
//! handing the parent's memfd over as the base freezes it in ~2 ms and the parent then shares
//! its clean pages with the clones (parent + 10 clones: 29 MiB PSS in all); copying the
//! parent's memory into a new base instead (`MAYFLY_FORK_COPY=1`, kept to measure the
//! alternative: `benches/run fork --compare-copy`) takes ~110 ms for 28 MiB and leaves the
//! parent's pages unshared (55 MiB in all). fork(2) of the VMM cannot carry a KVM VM into the
//! child (a VM belongs to the process that created it) and a forked multi-threaded process must
//! not allocate; userfaultfd COPY would give every clone a private copy of each page it touches.
//! A VM that is not memfd-backed has no single file holding its memory. Restored
//! copy-on-write from a template (what the sandbox manager runs), it copied all of it (130 MB
//! for a 128 MiB probe: the source paused 125 ms, this project's host); handing over the
//! snapshot file and a diff copies only what the VM changed (the probe: 20 KiB, paused
//! ~1 ms). Only the snapshot at the bottom goes as it is: a woken sandbox's earlier diffs and
//! a fork's memfd base hold its past (pages it has since overwritten), which its clones must
//! not hold, so those pages are copied as the VM sees them now.

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use mayfly_api::ForkRequest;

use crate::machine::{Machine, PauseError};
use crate::persist::capture::{self, SnapshotCreateError};
pub use crate::persist::zygote::CloneInfo;
use crate::persist::zygote::{Release, Zygote, ZygoteError};
use crate::vm::VmError;

/// More clones than this in one request is a mistake, not a plan (the control socket refuses
/// a larger count too).
pub const MAX_CLONES: u32 = mayfly_api::MAX_FORK_COUNT;
/// What mayfly counts a clone as costing the host at first: its VMM (measured: 1.5 MiB of host
/// memory per idle probe clone, its KVM VM included), the guest pages it will soon write (a
/// kernel's own bookkeeping), as a fraction of guest RAM.
const CLONE_OVERHEAD_MIB: u64 = 2;
const CLONE_RAM_FRACTION: u64 = 32;
/// Tasks (threads, each with a pid) of a clone besides one per vCPU: its main thread, the
/// signal, control socket, console input, fork-end and guest refresh threads, one per virtio
/// device, and KVM's own worker. Counted high: a fork that runs out of pids fails half-way.
const CLONE_TASKS: u64 = 10;
/// Names in use skipped in one fork before it gives up.
const MAX_SKIPPED_NAMES: u32 = 10_000;
/// How long a clone may take to report that it runs.
pub(crate) const READY_TIMEOUT: Duration = mayfly_api::FORK_READY_TIMEOUT;

#[derive(Debug, thiserror::Error)]
pub enum ForkError {
    #[error("fork needs a count of at least 1")]
    NoClones,
    #[error("{0} clones in one fork is more than mayfly allows ({MAX_CLONES})")]
    TooMany(u32),
    #[error("forking {count} clones of a {mem_mib} MiB VM needs about {needed_mib} MiB of host memory ({per_clone}); this host has {available_mib} MiB available: fork fewer, or with overcommit if the clones will stay mostly idle")]
    NotEnoughMemory {
        count: u32,
        mem_mib: u64,
        needed_mib: u64,
        available_mib: u64,
        per_clone: String,
    },
    #[error("forking {count} clones needs about {needed} tasks (threads; each takes a pid), and {in_use} of {limit} allowed by {what} are in use: {raise}, or fork fewer")]
    NotEnoughPids {
        count: u32,
        needed: u64,
        in_use: u64,
        limit: u64,
        what: String,
        raise: String,
    },
    #[error("forking {count} clones needs about {needed} open descriptors in this VMM (a pidfd per clone while they start), and {in_use} of its limit of {limit} (RLIMIT_NOFILE) are in use: raise it (ulimit -n, or LimitNOFILE= for a service), or fork fewer")]
    NotEnoughDescriptors {
        count: u32,
        needed: u64,
        in_use: u64,
        limit: u64,
    },
    #[error("the directory of the VM's control socket, {0}, is not valid UTF-8: the clones' files go there, and their paths must be passed as text; use a UTF-8 path for --api-sock")]
    SocketDirNotUtf8(PathBuf),
    #[error("the VM is shutting down: nothing to fork")]
    ShuttingDown,
    #[error("fork needs the VM's control socket (--api-sock): clones put theirs beside it")]
    NoSocket,
    #[error(transparent)]
    Name(#[from] crate::identity::IdentityError),
    #[error(transparent)]
    State(#[from] SnapshotCreateError),
    #[error(transparent)]
    Memory(#[from] crate::memory::ram::MemoryError),
    #[error(transparent)]
    Format(#[from] mayfly_snapshot::SnapshotError),
    #[error("cannot {what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error("no clone names are left: this VM has numbered 2^32 clones")]
    NamesExhausted,
    #[error("{MAX_SKIPPED_NAMES} clone names {prefix}N in {dir} in a row are taken (by files of other clones): remove stale ones or fork with another --name-prefix")]
    NamesInUse { dir: PathBuf, prefix: String },
    #[error(transparent)]
    Clones(#[from] ZygoteError),
    #[error("cannot capture the VM to fork it from outside: {0}")]
    Capture(String),
    #[error("the VM refused to be captured for a fork ({status}): {error}")]
    CaptureRefused { status: u16, error: String },
}

impl ForkError {
    /// The status a control socket answers this with.
    pub fn http_status(&self) -> u16 {
        match self {
            Self::NoClones | Self::TooMany(_) | Self::Name(_) | Self::NoSocket => 400,
            Self::NamesInUse { .. } => 409,
            Self::NotEnoughMemory { .. }
            | Self::NotEnoughPids { .. }
            | Self::NotEnoughDescriptors { .. } => 507,
            Self::ShuttingDown | Self::SocketDirNotUtf8(_) => 409,
            Self::CaptureRefused { status, .. } => *status,
            _ => 500,
        }
    }
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ForkError {
    let what = what.into();
    move |source| ForkError::Io { what, source }
}

#[derive(Debug, Serialize)]
pub struct ForkReport {
    pub parent: String,
    pub clones: Vec<CloneInfo>,
    /// Bytes of memory copied: into a new base, or the pages that differ from the snapshot a
    /// parent restored copy-on-write hands over (0 when the parent's own memfd became the base).
    pub copied_bytes: u64,
    pub pause_ms: f64,
    pub state_ms: f64,
    pub freeze_ms: f64,
    /// Starting the zygote process (its exec; it then prepares the restore while this VMM
    /// claims the clones' names, and that time is in `total_ms`).
    pub zygote_ms: f64,
    /// From the request until every clone was ready (they run when `release` is dropped).
    pub total_ms: f64,
    /// Holds the clones until dropped: the answer is written first (see [`Release`]).
    #[serde(skip)]
    pub release: Release,
}

fn available_mib() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? / 1024)
}

fn read_number(path: impl AsRef<Path>) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Tasks on this host now (the total of /proc/loadavg's "running/total").
fn tasks_in_use() -> Option<u64> {
    let loadavg = std::fs::read_to_string("/proc/loadavg").ok()?;
    loadavg
        .split_whitespace()
        .nth(3)?
        .split('/')
        .nth(1)?
        .parse()
        .ok()
}

/// A limit on the tasks (threads) that the clones of a fork count against.
struct TaskLimit {
    what: String,
    raise: String,
    limit: u64,
    in_use: u64,
}

/// Every limit a clone's tasks count against: the host's pid and thread limits, the pids.max
/// of this process's cgroup and each of its ancestors (the zygote and the clones stay in it),
/// and RLIMIT_NPROC for a VMM that does not run as root (root is not held to it).
fn task_limits() -> Vec<TaskLimit> {
    let mut limits = Vec::new();
    if let Some(in_use) = tasks_in_use() {
        for sysctl in ["kernel.pid_max", "kernel.threads-max"] {
            let path = format!("/proc/sys/{}", sysctl.replace('.', "/"));
            if let Some(limit) = read_number(&path) {
                limits.push(TaskLimit {
                    what: sysctl.to_string(),
                    raise: format!("raise it (sysctl -w {sysctl}=...)"),
                    limit,
                    in_use,
                });
            }
        }
    }
    for (mount, leaf) in pids_cgroups() {
        let mut dir = leaf;
        loop {
            // "max" (no limit) reads as no number.
            let limit = read_number(dir.join("pids.max"));
            let in_use = read_number(dir.join("pids.current"));
            if let (Some(limit), Some(in_use)) = (limit, in_use) {
                limits.push(TaskLimit {
                    what: format!("pids.max of the cgroup {}", dir.display()),
                    raise: format!("raise it (echo N > {})", dir.join("pids.max").display()),
                    limit,
                    in_use,
                });
            }
            if dir == mount || !dir.pop() || !dir.starts_with(&mount) {
                break;
            }
        }
    }
    let mut nproc = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: geteuid has no preconditions; getrlimit writes the struct given.
    let (root, got) = unsafe {
        (
            libc::geteuid() == 0,
            libc::getrlimit(libc::RLIMIT_NPROC, &mut nproc) == 0,
        )
    };
    if !root && got && nproc.rlim_cur != libc::RLIM_INFINITY {
        limits.push(TaskLimit {
            what: "RLIMIT_NPROC of this user".into(),
            raise: "raise it (ulimit -u)".into(),
            limit: nproc.rlim_cur,
            in_use: user_tasks(),
        });
    }
    limits
}

/// The cgroups whose pids controller this process is in: (where the hierarchy is mounted,
/// this process's cgroup in it), for the cgroup v2 hierarchy and a cgroup v1 `pids` one.
fn pids_cgroups() -> Vec<(PathBuf, PathBuf)> {
    let (Ok(mountinfo), Ok(cgroups)) = (
        std::fs::read_to_string("/proc/self/mountinfo"),
        std::fs::read_to_string("/proc/self/cgroup"),
    ) else {
        return Vec::new();
    };
    // /proc/self/cgroup: "hierarchy-ID:controllers:path"; "0::path" is cgroup v2.
    let path_of = |v2: bool| {
        cgroups.lines().find_map(|line| {
            let mut parts = line.splitn(3, ':');
            let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            let wanted = if v2 {
                controllers.is_empty()
            } else {
                controllers.split(',').any(|c| c == "pids")
            };
            wanted.then(|| path.trim_start_matches('/').to_string())
        })
    };
    let mut found = Vec::new();
    for line in mountinfo.lines() {
        // "id parent-id major:minor root mount-point options ... - fstype source super-options"
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let mut fields = left.split_whitespace();
        let (Some(root), Some(mount)) = (fields.nth(3), fields.next()) else {
            continue;
        };
        let (root, mount) = (
            mayfly_sys::mountinfo::unescape(root),
            mayfly_sys::mountinfo::unescape(mount),
        );
        let mut right = right.split_whitespace();
        let (fstype, super_options) = (right.next(), right.nth(1).unwrap_or(""));
        let v2 = match fstype {
            Some("cgroup2") => true,
            Some("cgroup") if super_options.split(',').any(|o| o == "pids") => false,
            _ => continue,
        };
        // The path is from the root of the hierarchy; the mount shows it from `root` down
        // (a container's cgroup namespace, or a bind mount of a subtree).
        let Some(path) = path_of(v2) else { continue };
        let root = root.trim_start_matches('/');
        let Some(below) = path
            .strip_prefix(root)
            .filter(|below| root.is_empty() || below.is_empty() || below.starts_with('/'))
        else {
            continue;
        };
        let below = below.trim_start_matches('/');
        if below.split('/').any(|part| part == "..") {
            continue;
        }
        let mount = PathBuf::from(mount);
        found.push((mount.clone(), mount.join(below)));
    }
    found
}

/// Tasks (threads) of this process's real user, from /proc: best effort (in a container, or
/// with /proc mounted hidepid, it sees fewer than RLIMIT_NPROC counts, and the fork can still
/// fail half-way, with the clones it started killed).
fn user_tasks() -> u64 {
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() }.to_string();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0;
    };
    entries
        .flatten()
        .filter_map(|entry| std::fs::read_to_string(entry.path().join("status")).ok())
        .filter(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|ids| ids.split_whitespace().next())
                == Some(uid.as_str())
        })
        .filter_map(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("Threads:"))
                .and_then(|n| n.trim().parse::<u64>().ok())
        })
        .sum()
}

/// Descriptors a fork needs besides one per clone (the zygote's socket and pidfd, the state
/// and base, the request being served, the console log being sent).
const DESCRIPTOR_MARGIN: u64 = 32;

/// This VMM's open descriptors and its RLIMIT_NOFILE.
fn descriptors() -> Option<(u64, u64)> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct given; the result is checked.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0
        || limit.rlim_cur == libc::RLIM_INFINITY
    {
        return None;
    }
    let open = std::fs::read_dir("/proc/self/fd").ok()?.count();
    Some((u64::try_from(open).ok()?, limit.rlim_cur))
}

/// Host memory (MiB) that `count` clones of a VM of `mem_mib` are counted as needing, and how
/// that was counted.
fn memory_needed(count: u32, mem_mib: u64, overcommit: bool) -> (u64, String) {
    if overcommit {
        (
            u64::from(count) * CLONE_OVERHEAD_MIB,
            format!(
                "{CLONE_OVERHEAD_MIB} MiB per clone, its VMM; overcommit counts no guest memory"
            ),
        )
    } else {
        (
            u64::from(count) * (CLONE_OVERHEAD_MIB + mem_mib / CLONE_RAM_FRACTION),
            format!("{CLONE_OVERHEAD_MIB} MiB plus 1/{CLONE_RAM_FRACTION} of guest RAM per clone"),
        )
    }
}

/// Check a request before anything happens to the VM.
fn check(vm: &Machine, dir: Option<&Path>, request: &ForkRequest) -> Result<(), ForkError> {
    if request.count == 0 {
        return Err(ForkError::NoClones);
    }
    if request.count > MAX_CLONES {
        return Err(ForkError::TooMany(request.count));
    }
    let mem_mib = vm.ram.size() >> 20;
    let (needed_mib, per_clone) = memory_needed(request.count, mem_mib, request.overcommit);
    if let Some(available_mib) = available_mib() {
        if needed_mib > available_mib {
            return Err(ForkError::NotEnoughMemory {
                count: request.count,
                mem_mib,
                needed_mib,
                available_mib,
                per_clone,
            });
        }
    }
    let needed = u64::from(request.count) * (u64::from(vm.info.vcpu_count) + CLONE_TASKS);
    for limit in task_limits() {
        if limit.in_use + needed > limit.limit {
            return Err(ForkError::NotEnoughPids {
                count: request.count,
                needed,
                in_use: limit.in_use,
                limit: limit.limit,
                what: limit.what,
                raise: limit.raise,
            });
        }
    }
    if let Some((in_use, limit)) = descriptors() {
        let needed = u64::from(request.count) + DESCRIPTOR_MARGIN;
        if in_use + needed > limit {
            return Err(ForkError::NotEnoughDescriptors {
                count: request.count,
                needed,
                in_use,
                limit,
            });
        }
    }
    if let Some(prefix) = &request.name_prefix {
        crate::identity::check_name(&format!("{prefix}0"))?;
    }
    match dir {
        None => Err(ForkError::NoSocket),
        Some(dir) if dir.to_str().is_none() => Err(ForkError::SocketDirNotUtf8(dir.into())),
        Some(_) => Ok(()),
    }
}

/// A memfd holding `bytes`, sealed so no one can change it.
fn sealed_memfd(bytes: &[u8]) -> Result<File, ForkError> {
    // SAFETY: a valid NUL-terminated name; the result is checked.
    let fd = unsafe {
        libc::memfd_create(
            c"mayfly-fork-state".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    if fd < 0 {
        return Err(io("create the fork's state file")(
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: memfd_create returned a new descriptor nothing else owns.
    let mut file = unsafe { File::from_raw_fd(fd) };
    file.write_all(bytes)
        .map_err(io("write the fork's state file"))?;
    let seals = libc::F_SEAL_SEAL | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;
    mayfly_sys::seal::add_seals(&file, seals).map_err(io("seal the fork's state file"))?;
    Ok(file)
}

/// Create a FIFO at `path`; never replaces what is there (EEXIST then).
fn mkfifo(path: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: a valid NUL-terminated path; the result is checked.
    if unsafe { libc::mkfifo(c.as_ptr(), 0o600) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// A clone's console log as this fork created it: (device, inode), so that it is reopened
/// only if it is still that file.
type LogIdentity = (u64, u64);

/// A clone's files beside its parent's socket, claimed for it: created new (never following
/// a symlink, never replacing anything), or `None` if something by that name exists already
/// (a live clone of an earlier fork, or of the VM this one was restored from).
fn claim_clone_files(
    dir: &Path,
    name: &str,
    disks: bool,
) -> Result<Option<(CloneInfo, LogIdentity)>, ForkError> {
    let input = dir.join(format!("{name}.in"));
    let info = CloneInfo {
        api_sock: dir.join(format!("{name}.sock")),
        console_log: dir.join(format!("{name}.log")),
        console_input: Some(input.clone()),
        vsock: dir.join(format!("{name}.vsock")),
        vsock_cid: 0,
        disk_dir: disks.then(|| dir.join(format!("{name}.disks"))),
        net: None,
        jail: None,
        vmm_pid: None,
        policy: None,
        layers_moved: None,
        name: name.to_string(),
        index: 0,
        pid: 0,
        ready_ms: 0.0,
    };
    let exists = |p: &Path| std::fs::symlink_metadata(p).is_ok();
    if exists(&info.api_sock)
        || exists(&input)
        || exists(&info.vsock)
        || info.disk_dir.as_deref().is_some_and(exists)
    {
        return Ok(None);
    }
    // The log is the claim: O_CREAT | O_EXCL fails on anything that exists, symlinks included.
    let log = match File::options()
        .write(true)
        .create_new(true)
        .open(&info.console_log)
    {
        Ok(log) => log,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Ok(None),
        Err(e) => return Err(io(format!("create {}", info.console_log.display()))(e)),
    };
    let claimed = mkfifo(&input).and_then(|()| match &info.disk_dir {
        // Made here, not by the clone: the name is claimed only once all of it is.
        Some(disks) => {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(disks)
                .inspect_err(|_| {
                    let _ = std::fs::remove_file(&input);
                })
        }
        None => Ok(()),
    });
    let identity = log
        .metadata()
        .map(|meta| {
            use std::os::unix::fs::MetadataExt;
            (meta.dev(), meta.ino())
        })
        .map_err(io(format!("read {}", info.console_log.display())));
    match claimed {
        // The log is closed here and opened again when the clone's request goes out: a fork
        // of thousands would otherwise hold a descriptor per clone for nothing.
        Ok(()) => Ok(Some((info, identity?))),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let _ = std::fs::remove_file(&info.console_log);
            Ok(None)
        }
        Err(e) => {
            let _ = std::fs::remove_file(&info.console_log);
            Err(io(format!("create the FIFO {}", input.display()))(e))
        }
    }
}

/// Open a clone's console log again to hand it to the clone: only if it is still the file
/// this fork created (not followed if it is now a symlink, refused if it was replaced).
fn reopen_log(info: &CloneInfo, identity: Option<&LogIdentity>) -> std::io::Result<File> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let log = File::options()
        .append(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&info.console_log)?;
    let meta = log.metadata()?;
    if identity != Some(&(meta.dev(), meta.ino())) {
        return Err(std::io::Error::other(
            "it is not the file this fork created (it was replaced)",
        ));
    }
    Ok(log)
}

/// A vsock CID for a clone: random, so that no two clones of one VM (or of its clones) are
/// likely to share one (each has its own device and socket either way).
fn clone_cid() -> Result<u64, ForkError> {
    let mut bytes = [0u8; 4];
    crate::identity::host_random(&mut bytes).map_err(io("get random bytes for a clone's CID"))?;
    // 3 and up (0-2 are reserved), below u32::MAX.
    Ok(1000 + u64::from(u32::from_le_bytes(bytes) % (u32::MAX - 2000)))
}

/// Fork the machine into `request.count` clones whose files go into `dir` (the directory of
/// the parent's control socket).
pub fn fork(
    vm: &mut Machine,
    dir: Option<&Path>,
    request: &ForkRequest,
) -> Result<ForkReport, ForkError> {
    let start = Instant::now();
    mayfly_sys::trace::event("fork_requested");
    check(vm, dir, request)?;
    let dir = dir.ok_or(ForkError::NoSocket)?.to_path_buf();
    let was_running = !vm.paused();
    if was_running {
        pause(vm)?;
    }
    let pause_ms = start.elapsed().as_secs_f64() * 1e3;
    mayfly_sys::trace::event("fork_paused");
    let result = fork_paused(vm, request, &dir, start, pause_ms);
    if was_running && !request.parent_paused {
        vm.resume();
    }
    result
}

fn pause(vm: &mut Machine) -> Result<(), ForkError> {
    vm.pause().map_err(|e| match e {
        PauseError::Vm(VmError::VcpuGone(_)) => ForkError::ShuttingDown,
        other => ForkError::Io {
            what: "pause the VM".into(),
            source: std::io::Error::other(other.to_string()),
        },
    })
}

fn fork_paused(
    vm: &mut Machine,
    request: &ForkRequest,
    dir: &Path,
    start: Instant,
    pause_ms: f64,
) -> Result<ForkReport, ForkError> {
    let frozen = freeze(vm, start, pause_ms)?;
    // The zygote starts (exec) while this VMM claims the clones' names.
    let zygote = Zygote::spawn(&frozen.state, &frozen.memory)?;
    mayfly_sys::trace::event("fork_zygote_spawned");
    let zygote_ms =
        start.elapsed().as_secs_f64() * 1e3 - pause_ms - frozen.state_ms - frozen.freeze_ms;
    let parent = vm.info.identity.name.clone();
    let clones = Clones {
        parent: &parent,
        names: Naming::Numbered {
            prefix: request
                .name_prefix
                .clone()
                .unwrap_or_else(|| format!("{parent}-")),
            count: request.count,
        },
        dir,
        disks: frozen.disks,
        net: vm.devices.net_settings().cloned(),
        jail: None,
    };
    let (clones, release) = clones.start(zygote, &mut vm.info.next_clone, start)?;
    Ok(ForkReport {
        parent,
        clones,
        copied_bytes: frozen.copied_bytes,
        pause_ms,
        state_ms: frozen.state_ms,
        freeze_ms: frozen.freeze_ms,
        zygote_ms,
        total_ms: start.elapsed().as_secs_f64() * 1e3,
        release,
    })
}

/// A paused VM's state and memory, frozen for its clones (steps 1 and 2).
struct Frozen {
    /// The state, in a sealed memfd.
    state: File,
    /// The memory files nobody writes, bottom first: one base, or the files the parent maps
    /// and a sealed memfd of the pages it wrote (the state names them as memory layers).
    memory: Vec<File>,
    copied_bytes: u64,
    /// Whether the VM has writable disks (each clone then gets a layer directory).
    disks: bool,
    state_ms: f64,
    freeze_ms: f64,
}

fn freeze(vm: &mut Machine, start: Instant, pause_ms: f64) -> Result<Frozen, ForkError> {
    // Writable disks freeze first: the clones stack their own layers on the frozen chain, the
    // parent goes on on a new top of its own (metadata only, whatever the disks hold).
    vm.devices
        .freeze_disks()
        .map_err(SnapshotCreateError::from)?;
    let disks = vm.devices.has_writable_disks();
    let mut state = capture::capture_state(vm)?;
    let state_ms = start.elapsed().as_secs_f64() * 1e3 - pause_ms;
    mayfly_sys::trace::event("fork_state_captured");

    // fork_copy (MAYFLY_FORK_COPY): measure the alternative to handing the memory over (see
    // above).
    let (memory, copied_bytes) = if crate::settings::get().fork_copy {
        let (base, copied) = vm.ram.copy_to_memfd(&state.snapshot_id)?;
        (vec![base], copied)
    } else if let Some((layers, copied)) =
        vm.ram.freeze_layered(&state.snapshot_id, handed_as_is)?
    {
        // A parent restored copy-on-write: the snapshot file under it as it is, and above it
        // the pages that differ from it.
        let (top, below) = layers.split_last().expect("a top layer");
        state.memory_extents = top.extents.clone();
        state.memory_layers = below
            .iter()
            .map(|layer| mayfly_snapshot::MemoryLayer {
                path: layer.path.clone(),
                snapshot_id: layer.snapshot_id,
                extents: layer.extents.clone(),
            })
            .collect();
        (layers.into_iter().map(|layer| layer.file).collect(), copied)
    } else {
        // A lazily restored VM's handler may still be loading pages: stop it before its
        // mapping is replaced (its copies would fail on the new one). Nothing is lost: the
        // base is written from what is mapped and, for the rest, from the snapshot's file.
        drop(vm.lazy.take());
        let (base, copied) = vm.ram.freeze(&state.snapshot_id)?;
        (vec![base], copied)
    };
    let state_file = sealed_memfd(&mayfly_snapshot::file::encode(
        &capture::header(vm),
        &state,
    )?)?;
    let freeze_ms = start.elapsed().as_secs_f64() * 1e3 - pause_ms - state_ms;
    mayfly_sys::trace::event("fork_frozen");
    Ok(Frozen {
        state: state_file,
        memory,
        copied_bytes,
        disks,
        state_ms,
        freeze_ms,
    })
}

/// Whether the snapshot file under a parent's memory may go to its clones as it is, not
/// copied: always for an unjailed VMM (its clones are its own children); for a jailed one,
/// only a file that the jail's uid cannot change, as its fork's maker checks
/// ([`check_memory_layer`]): root's, and nobody else may write it (the sandbox manager's
/// template). A file of the jail's own (a snapshot it wrote) is copied instead.
fn handed_as_is(file: &File) -> bool {
    if mayfly_jail::jail::current().is_none() {
        return true;
    }
    crate::memory::chain::check_readable(file).is_ok()
        && file
            .metadata()
            .is_ok_and(|meta| crate::memory::chain::written_only_by(&meta, 0))
}

/// The clones of one fork, as they are to be made (steps 3 and 4).
struct Clones<'a> {
    parent: &'a str,
    names: Naming,
    /// Their files go here (beside the parent's control socket) when they are numbered.
    dir: &'a Path,
    disks: bool,
    net: Option<crate::devices::net::NetSettings>,
    /// The jail each makes itself (a fork of a jailed VM).
    jail: Option<&'a mayfly_jail::jail::JailConfig>,
}

/// How a fork's clones are named and where their files go.
enum Naming {
    /// `<prefix><n>` beside the parent's socket, for the first `count` numbers free.
    Numbered { prefix: String, count: u32 },
    /// As their maker placed them (see [`Placement`]).
    Placed {
        clones: Vec<Placement>,
        policy: Option<String>,
    },
}

/// What the maker of a fork from outside says of its clones, each placed (see
/// [`fork_from_outside`]).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Placed {
    pub clones: Vec<Placement>,
    /// Their NICs' policy (default: the one the parent's state holds).
    #[serde(default)]
    pub policy: Option<String>,
}

/// Where one clone of a fork made from outside goes when its maker places it: the sandbox
/// manager makes each clone a sandbox of its own, with its files in its own directory and a
/// uid of its own.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Placement {
    pub name: String,
    pub api_sock: PathBuf,
    /// Its console's output.
    pub console_log: PathBuf,
    /// Where its VMM's own output goes (created if missing, appended to); default: its
    /// console log.
    #[serde(default)]
    pub stderr: Option<PathBuf>,
    pub vsock: PathBuf,
    /// Where its writable disks' layers go.
    #[serde(default)]
    pub disk_dir: Option<PathBuf>,
    /// Its jail's uid and gid (a jailed parent's clones), instead of the parent's.
    #[serde(default)]
    pub uid: Option<u32>,
    /// Its jail's shared directories, instead of the parent's.
    #[serde(default)]
    pub share: Option<Vec<PathBuf>>,
    /// Its jail's memory limit (MiB), instead of the parent's.
    #[serde(default)]
    pub memory_mib: Option<u64>,
    /// Layers the parent's state names under `.0` are its own links under `.1`.
    #[serde(default)]
    pub layers_moved: Option<(PathBuf, PathBuf)>,
}

impl Placement {
    /// This clone, and where its stderr goes opened (created if need be, never through a
    /// symlink).
    fn claim(
        &self,
        index: u32,
        jail: Option<&mayfly_jail::jail::JailConfig>,
        policy: Option<&String>,
    ) -> Result<(CloneInfo, File), ForkError> {
        use std::os::unix::fs::OpenOptionsExt;
        crate::identity::check_name(&self.name)?;
        let open = |path: &Path| {
            File::options()
                .append(true)
                .create(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(path)
                .map_err(io(format!("open {}", path.display())))
        };
        // Made here (the clone's console opens it as it is).
        let console = open(&self.console_log)?;
        let log = match &self.stderr {
            Some(stderr) => open(stderr)?,
            None => console,
        };
        let jail = jail.map(|jail| mayfly_jail::jail::JailConfig {
            uid: self.uid.unwrap_or(jail.uid),
            gid: self.uid.unwrap_or(jail.gid),
            share: self.share.clone().unwrap_or_else(|| jail.share.clone()),
            memory_mib: self.memory_mib.or(jail.memory_mib),
            ..jail.clone()
        });
        let info = CloneInfo {
            name: self.name.clone(),
            index,
            pid: 0,
            api_sock: self.api_sock.clone(),
            console_log: self.console_log.clone(),
            console_input: None,
            vsock: self.vsock.clone(),
            vsock_cid: clone_cid()?,
            disk_dir: self.disk_dir.clone(),
            net: None,
            jail,
            vmm_pid: None,
            policy: policy.cloned(),
            layers_moved: self.layers_moved.clone(),
            ready_ms: 0.0,
        };
        Ok((info, log))
    }
}

impl Clones<'_> {
    /// Claim the clones' names, numbered from `next` on (names in use are skipped), or as
    /// placed, and start them from `zygote`; they are ready and held when this returns.
    fn start(
        self,
        zygote: Zygote,
        next: &mut u32,
        start: Instant,
    ) -> Result<(Vec<CloneInfo>, Release), ForkError> {
        let mut claimed = Vec::new();
        let mut logs = std::collections::HashMap::new();
        let mut placed_logs = std::collections::HashMap::new();
        match &self.names {
            Naming::Numbered { prefix, count } => {
                let mut skipped = 0u32;
                while claimed.len() < *count as usize {
                    if skipped > MAX_SKIPPED_NAMES {
                        return Err(ForkError::NamesInUse {
                            dir: self.dir.to_path_buf(),
                            prefix: prefix.clone(),
                        });
                    }
                    let index = *next;
                    *next = index.checked_add(1).ok_or(ForkError::NamesExhausted)?;
                    let name = format!("{prefix}{index}");
                    crate::identity::check_name(&name)?;
                    // A name in use (by a live clone of an earlier fork) is skipped, not reused.
                    let Some((info, log)) = claim_clone_files(self.dir, &name, self.disks)? else {
                        skipped += 1;
                        continue;
                    };
                    logs.insert(index, log);
                    if let (Some(jail), Some(input)) = (self.jail, &info.console_input) {
                        // A jailed clone opens its console's FIFO once it runs as its uid.
                        std::os::unix::fs::lchown(input, Some(jail.uid), Some(jail.gid))
                            .map_err(io(format!("give {} to the jail's uid", input.display())))?;
                    }
                    claimed.push(CloneInfo {
                        index,
                        vsock_cid: clone_cid()?,
                        net: self.net.clone(),
                        jail: self.jail.cloned(),
                        ..info
                    });
                }
            }
            Naming::Placed { clones, policy } => {
                for placement in clones {
                    let index = *next;
                    *next = index.checked_add(1).ok_or(ForkError::NamesExhausted)?;
                    let (info, log) = placement.claim(index, self.jail, policy.as_ref())?;
                    placed_logs.insert(index, log);
                    claimed.push(CloneInfo {
                        net: self.net.clone(),
                        ..info
                    });
                }
            }
        }
        mayfly_sys::trace::event("fork_clones_claimed");
        let open_log = |info: &CloneInfo| match placed_logs.get(&info.index) {
            Some(log) => log.try_clone(),
            None => reopen_log(info, logs.get(&info.index)),
        };
        let started = zygote.start_clones(self.parent, claimed, &open_log, start, READY_TIMEOUT)?;
        mayfly_sys::trace::event("fork_clones_ready");
        Ok(started)
    }
}

/// What `PUT /vm/fork/capture` answers: the first half of a fork of a jailed VM, which
/// [`fork_from_outside`] finishes.
#[derive(Debug, Serialize, Deserialize)]
pub struct Captured {
    /// This process's descriptors that hold the state (a sealed memfd) and the memory base,
    /// until `PUT /vm/fork/release` or the next capture.
    pub state_fd: i32,
    /// The memory base, or the top layer of the memory (the parent's own pages) when the
    /// state names layers under it.
    pub memory_fd: i32,
    /// The memory layers under `memory_fd`, bottom first (none for one base).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub memory_layer_fds: Vec<i32>,
    pub parent: String,
    /// The clones are numbered from here (this many numbers are kept for them).
    pub first_clone: u32,
    pub disks: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net: Option<crate::devices::net::NetSettings>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jail: Option<mayfly_jail::jail::JailConfig>,
    pub copied_bytes: u64,
    pub pause_ms: f64,
    pub state_ms: f64,
    pub freeze_ms: f64,
}

/// What a capture holds for the one who finishes its fork.
#[derive(Debug)]
pub struct HeldCapture {
    _state: File,
    _memory: Vec<File>,
}

/// `PUT /vm/fork/capture`: steps 1 and 2 only, for a fork made from outside this VMM. The
/// VM runs again (unless `parent_paused`) as soon as its memory is frozen: the clones are
/// made by someone else.
pub fn capture(
    vm: &mut Machine,
    dir: Option<&Path>,
    request: &ForkRequest,
) -> Result<(Captured, HeldCapture), ForkError> {
    let start = Instant::now();
    check(vm, dir, request)?;
    let was_running = !vm.paused();
    if was_running {
        pause(vm)?;
    }
    let pause_ms = start.elapsed().as_secs_f64() * 1e3;
    let frozen = freeze(vm, start, pause_ms);
    if was_running && !request.parent_paused {
        vm.resume();
    }
    let frozen = frozen?;
    let first_clone = vm.info.next_clone;
    vm.info.next_clone = first_clone
        .checked_add(request.count)
        .ok_or(ForkError::NamesExhausted)?;
    let captured = Captured {
        state_fd: frozen.state.as_raw_fd(),
        memory_fd: frozen.memory.last().expect("a memory file").as_raw_fd(),
        memory_layer_fds: frozen.memory[..frozen.memory.len() - 1]
            .iter()
            .map(|file| file.as_raw_fd())
            .collect(),
        parent: vm.info.identity.name.clone(),
        first_clone,
        disks: frozen.disks,
        net: vm.devices.net_settings().cloned(),
        jail: mayfly_jail::jail::current().map(|jail| jail.config().clone()),
        copied_bytes: frozen.copied_bytes,
        pause_ms,
        state_ms: frozen.state_ms,
        freeze_ms: frozen.freeze_ms,
    };
    let held = HeldCapture {
        _state: frozen.state,
        _memory: frozen.memory,
    };
    Ok((captured, held))
}

/// Fork the jailed VM at `api_sock` from outside it, as root: each clone needs a jail of
/// its own, which only root outside can make, so the clones are made here and not by the VM's
/// VMM (`mayfly fork` does this for a jailed VM).
///
/// 1. `PUT /vm/fork/capture`: the VMM pauses, captures its state and freezes its memory (as
///    its own fork would, steps 1 and 2), runs on, and answers with the numbers of the two
///    descriptors that hold them.
/// 2. Both are taken from the process that serves the socket (as the kernel names it, not as
///    its answer does) with pidfd_getfd; the state must be sealed against writes. The VMM is
///    told to let go of its copies.
/// 3. The clones are made from a zygote of this process's, as any fork's (steps 3 and 4),
///    each beside the parent's socket and each making itself a jail as its parent's: its own
///    namespaces, cgroup and root, the parent's uid and gid as the kernel says them, and a
///    waiter outside that keeps its network.
///
/// A maker that places the clones itself (the sandbox manager) gives `placed`: their names,
/// files, uids and policy, and `net`, where their networks are made; its parent need not be
/// jailed then (its clones are not, either). `on_captured` is called once nothing more is
/// needed of the parent (its state and memory taken, its layers linked): it may be put to
/// sleep, or go, from then on.
pub fn fork_from_outside(
    api_sock: &Path,
    request: &ForkRequest,
    placed: Option<Placed>,
    net: Option<crate::devices::net::NetSettings>,
    on_captured: &mut dyn FnMut(),
) -> Result<ForkReport, ForkError> {
    let start = Instant::now();
    if placed
        .as_ref()
        .is_some_and(|p| p.clones.len() != request.count as usize)
    {
        return Err(ForkError::Capture(
            "the clones placed are not as many as the count asked for".into(),
        ));
    }
    let dir = api_sock.parent().ok_or(ForkError::NoSocket)?;
    let body = serde_json::json!({
        "count": request.count,
        "name_prefix": request.name_prefix,
        "parent": if request.parent_paused { "paused" } else { "running" },
        "overcommit": request.overcommit,
    });
    // 1. The capture.
    let (status, answer, server) =
        mayfly_api::request_with_server(api_sock, "PUT", "/vm/fork/capture", Some(&body))
            .map_err(|e| ForkError::Capture(e.to_string()))?;
    if status != 200 {
        return Err(ForkError::CaptureRefused {
            status,
            error: answer["error"].as_str().unwrap_or("").to_string(),
        });
    }
    // 2. Its descriptors, and then the VMM lets go of them, whatever happens: what it holds
    // is its memory.
    let taken = serde_json::from_value::<Captured>(answer)
        .map_err(|e| ForkError::Capture(format!("its answer does not parse: {e}")))
        .and_then(|captured| {
            let take = |fd: i32, what: &str| {
                let file = mayfly_sys::pidfd::get_fd(&server, fd)
                    .map(File::from)
                    .map_err(io(format!(
                        "take the fork's {what} from the VMM (pidfd_getfd)"
                    )))?;
                // Sealed (by the VMM, before anything mapped it): not even that VMM can
                // change what the clones restore, whatever it runs.
                if !crate::memory::chain::has_seals(&file, UNCHANGEABLE) {
                    return Err(ForkError::Capture(format!(
                        "its {what} is not a sealed file: it could change under the clones"
                    )));
                }
                Ok(file)
            };
            let state = take(captured.state_fd, "state")?;
            if captured.memory_layer_fds.len() > mayfly_snapshot::MAX_MEMORY_LAYERS {
                return Err(ForkError::Capture(format!(
                    "its memory has {} layers",
                    captured.memory_layer_fds.len() + 1
                )));
            }
            let mut memory = Vec::with_capacity(captured.memory_layer_fds.len() + 1);
            for &fd in &captured.memory_layer_fds {
                let file = mayfly_sys::pidfd::get_fd(&server, fd)
                    .map(File::from)
                    .map_err(io(
                        "take the fork's memory layers from the VMM (pidfd_getfd)",
                    ))?;
                check_memory_layer(&file).map_err(ForkError::Capture)?;
                memory.push(file);
            }
            memory.push(take(captured.memory_fd, "memory")?);
            Ok((captured, state, memory))
        });
    let _ = mayfly_api::request(api_sock, "PUT", "/vm/fork/release", None);
    let (captured, state, memory) = taken?;
    let jail = match (&captured.jail, &placed) {
        // The clones' jail is the parent's as the kernel says it, not as its answer does.
        (Some(claimed), _) => {
            let pid = pid_of(&server).map_err(io("find the VMM's process"))?;
            let jail = mayfly_jail::jail::config_of(pid, claimed)
                .map_err(|e| ForkError::Capture(e.to_string()))?;
            if pid_of(&server).ok() != Some(pid) {
                return Err(ForkError::Capture("the VMM ended".into()));
            }
            Some(jail)
        }
        // Clones placed with uids of their own are to be jailed: a parent that says it is
        // not (its VMM's word) forks none.
        (None, Some(placed)) if placed.clones.iter().any(|c| c.uid.is_some()) => {
            return Err(ForkError::Capture(
                "the VM says it is not jailed, but its clones are to be: it is not forked".into(),
            ))
        }
        (None, Some(_)) => None,
        (None, None) => {
            return Err(ForkError::Capture(
                "the VM is not jailed: fork it with PUT /vm/fork".into(),
            ))
        }
    };
    // 3. The clones, placed ones with their own links to the layers they stack on.
    if let Some(placed) = &placed {
        link_moved_layers(&state, &placed.clones)?;
    }
    on_captured();
    let zygote = Zygote::spawn(&state, &memory)?;
    let zygote_ms = start.elapsed().as_secs_f64() * 1e3;
    let names = match placed {
        Some(Placed { clones, policy }) => Naming::Placed { clones, policy },
        None => Naming::Numbered {
            prefix: request
                .name_prefix
                .clone()
                .unwrap_or_else(|| format!("{}-", captured.parent)),
            count: request.count,
        },
    };
    let clones = Clones {
        parent: &captured.parent,
        names,
        dir,
        disks: captured.disks,
        // A parent with a NIC gives its clones one; where it is made, their maker may say.
        net: captured.net.clone().map(|own| net.unwrap_or(own)),
        jail: jail.as_ref(),
    };
    let mut next = captured.first_clone;
    let (clones, release) = clones.start(zygote, &mut next, start)?;
    Ok(ForkReport {
        parent: captured.parent,
        clones,
        copied_bytes: captured.copied_bytes,
        pause_ms: captured.pause_ms,
        state_ms: captured.state_ms,
        freeze_ms: captured.freeze_ms,
        zygote_ms,
        total_ms: start.elapsed().as_secs_f64() * 1e3,
        release,
    })
}

/// The seals of a file a fork's maker takes from a VMM as it is: nobody, that VMM included,
/// can change its contents or size.
const UNCHANGEABLE: libc::c_int = libc::F_SEAL_WRITE | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;

/// A memory layer a jailed VMM hands over under its own pages (a fork of a VM restored
/// copy-on-write): the clones map it, so nothing but this process's owner may be able to
/// change it. A sealed memfd (an earlier fork's) cannot change; any other file must be a
/// regular file of this process's owner (root: the snapshot a sandbox was restored from)
/// that no one else may write. The restore then checks its trailer against the layer the
/// fork's state names. Why not more: a VMM can hand over only files it can open, and a
/// jailed one sees only its own jail's.
fn check_memory_layer(file: &File) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    if crate::memory::chain::has_seals(file, UNCHANGEABLE) {
        return Ok(());
    }
    // Reopened by root to be read, it would read what its VMM could not.
    crate::memory::chain::check_readable(file)
        .map_err(|_| "its memory layer is on a descriptor that cannot read it".to_string())?;
    let meta = file
        .metadata()
        .map_err(|e| format!("its memory layer cannot be looked at: {e}"))?;
    // SAFETY: geteuid has no preconditions.
    let owner = unsafe { libc::geteuid() };
    if !crate::memory::chain::written_only_by(&meta, owner) {
        return Err(format!(
            "its memory layer is not a sealed memfd nor a file only uid {owner} may write \
             (owner {}, mode {:o}): it could change under the clones (restore the VM from a \
             snapshot directory of uid {owner}'s to fork it)",
            meta.uid(),
            meta.mode() & 0o7777
        ));
    }
    Ok(())
}

/// Give each placed clone its own links to the layers its parent's disks stack on under
/// `layers_moved.0` (its maker's layout: the parent's own directory), at the same place
/// under `layers_moved.1`: the clone then opens (and its snapshots name) files of its own
/// only, and they outlive the parent. Only plain files are linked: what else is there (the
/// parent's VMM writes that directory) is left for the clone's restore to refuse.
fn link_moved_layers(state: &File, placements: &[Placement]) -> Result<(), ForkError> {
    use mayfly_devices::state::VirtioKindState;
    let (_, vm): (_, mayfly_snapshot::state::VmState) =
        mayfly_snapshot::file::read_state(state, Path::new("the fork's state"))?;
    let layers: Vec<&PathBuf> = vm
        .devices
        .virtio
        .iter()
        .filter_map(|device| match &device.device {
            VirtioKindState::Block(block) => Some(&block.chain.layers),
            _ => None,
        })
        .flatten()
        .collect();
    for placement in placements {
        let Some((from, to)) = &placement.layers_moved else {
            continue;
        };
        for layer in &layers {
            let Ok(rest) = layer.strip_prefix(from) else {
                continue;
            };
            if rest
                .components()
                .any(|c| !matches!(c, std::path::Component::Normal(_)))
            {
                continue;
            }
            // Opened strictly beneath the parent's directory with no symbolic link followed
            // (the parent's VMM, running, writes there): what is linked is what is there.
            let Ok((file, _)) = mayfly_sys::beneath::open_no_links(from, rest) else {
                continue;
            };
            if !file.metadata().is_ok_and(|m| m.is_file()) {
                continue;
            }
            let link = to.join(rest);
            if let Some(dir) = link.parent() {
                std::fs::create_dir_all(dir).map_err(io(format!("make {}", dir.display())))?;
            }
            match link_open_file(&file, &link) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => {
                    return Err(io(format!(
                        "link {} at {}",
                        layer.display(),
                        link.display()
                    ))(e))
                }
            }
        }
    }
    Ok(())
}

/// A new name `link` for the open `file` (linkat through /proc/self/fd, following that one
/// link: the file itself, whatever has happened to its path since).
fn link_open_file(file: &File, link: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let from = std::ffi::CString::new(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    let to = std::ffi::CString::new(link.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: linkat with two valid NUL-terminated paths; the result is checked.
    let rc = unsafe {
        libc::linkat(
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::AT_SYMLINK_FOLLOW,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The pid of the process behind `pidfd`, from the pidfd's own fdinfo (an ended process's
/// reads -1, which is no pid).
fn pid_of(pidfd: &std::os::fd::OwnedFd) -> std::io::Result<u32> {
    let fdinfo = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", pidfd.as_raw_fd()))?;
    fdinfo
        .lines()
        .find_map(|l| l.strip_prefix("Pid:"))
        .and_then(|pid| pid.trim().parse().ok())
        .ok_or_else(|| std::io::Error::other("the process has ended"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overcommit_counts_the_clones_vmms_and_not_their_guest_memory() {
        // 10,000 idle clones of a 128 MiB VM: 60 GB counted in full, 20 GB overcommitted.
        assert_eq!(memory_needed(10_000, 128, false).0, 60_000);
        assert_eq!(memory_needed(10_000, 128, true).0, 20_000);
        assert!(memory_needed(1, 128, true).1.contains("overcommit"));
    }
}
