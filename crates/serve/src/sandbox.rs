//! Sandboxes: a name, a record on disk, and (while it runs) a VMM process of its own.
//!
//! A sandbox's directory, `<state-dir>/sandboxes/<name>/`, holds everything of it:
//! `sandbox.json` (its record, replaced atomically at every change of state), `vm.sock` (its
//! VMM's control socket, with `vm.sock.vsock` and the disk layers in `vm.sock.disks/` beside
//! it), `console.log`, `vmm.log` (the VMM's stderr) and, once it has slept, `snap/` (the
//! snapshot it wakes from). The record says what the manager last knew; a manager that starts
//! (after a crash, or `kill -9`) rebuilds its view from the records and adopts the VMMs that
//! still run ([`Manager::recover`]).
//!
//! Every change of a sandbox's state happens under its own lock, so two wakes of one sandbox
//! make one wake, and a delete waits for a suspend; requests passed to a running VMM do not
//! hold it (an exec may run for minutes).

use std::collections::BTreeMap;
use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::metrics::{Gauges, Metrics};
use crate::ServeError;

/// How long a new or waking VMM may take to answer on its control socket. A cold boot of a
/// Linux guest in the test rig takes tens of seconds; a restore on real KVM milliseconds.
const START_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a VMM asked to shut down may take to exit before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);
/// Requests the manager sends a VMM (pause, snapshot, shutdown).
const VMM_REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

/// Requests passed to one sandbox's VMM at once: a VMM that stalls holds at most these of the
/// manager's connections.
const MAX_REQUESTS_PER_SANDBOX: usize = 64;

/// The longest idle timeout: a year.
const MAX_IDLE_TIMEOUT_S: u64 = 365 * 86_400;
/// How long a create of a restored sandbox waits to give its credential: its agent answers
/// within milliseconds of the restore, and a guest that stalls it costs the create this much.
/// Agentless guests (the probe, `no_agent`) are not waited for: each probe clone of a fork
/// took 5 s more while they were.
const CREDENTIAL_RESTORE_WAIT: Duration = Duration::from_secs(5);
/// How long a booting sandbox's credential waits for its guest agent.
const CREDENTIAL_BOOT_WAIT: Duration = Duration::from_secs(300);
/// The longest `acts_for` label.
const MAX_ACTS_FOR: usize = 256;
/// How often templates are looked at for collection (at most; sooner with a shorter TTL).
const TEMPLATE_CHECK_EVERY: Duration = Duration::from_secs(60);

/// The record's file name in a sandbox's directory.
const RECORD: &str = "sandbox.json";
/// The guest memory a sandbox boots with when its spec names none: what `mayfly run` boots
/// with when not told (its --mem-mib default; a test holds the two equal).
pub const DEFAULT_MEM_MIB: u64 = 256;

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

pub(super) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// What a sandbox is made from: the options of `mayfly run`, or a snapshot to restore.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Spec {
    /// A snapshot directory to restore instead of booting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initrd: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmdline: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_mib: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vcpus: Option<u32>,
    /// `debian` or an image path (`mayfly run --rootfs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rootfs: Option<String>,
    /// `mayfly run --net`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net: Option<String>,
    /// Suspend to disk after this long without a request (none: never).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout_s: Option<u64>,
    /// The probe benchmark's guest (gives the VM the probe device).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub probe: bool,
    /// A template to make it from (see [`super::template`]): a restore of the template's
    /// snapshot, built once per set of inputs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<crate::template::Template>,
    /// Whom it acts for (the platform's own label, e.g. a user id): in its credential (see
    /// [`super::credential`]); a fork's clones keep their source's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acts_for: Option<String>,
    /// Its guest runs no mayfly-agent (a guest of the user's own): no credential is given
    /// (a restored one would otherwise hold its create [`CREDENTIAL_RESTORE_WAIT`] for one).
    /// The probe guest is taken as such; a fork's clones keep their source's.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_agent: bool,
}

impl Spec {
    /// Whether its guest has no agent to give a credential to.
    pub fn agentless(&self) -> bool {
        self.no_agent || self.probe || self.template.as_ref().is_some_and(|t| t.probe)
    }
}

impl Spec {
    /// Check what can be checked before anything is made.
    pub fn check(&self) -> Result<(), String> {
        if let Some(who) = &self.acts_for {
            if who.is_empty() || who.len() > MAX_ACTS_FOR || who.chars().any(char::is_control) {
                return Err(format!(
                    "\"acts_for\" must be 1 to {MAX_ACTS_FOR} bytes of printable text (a label \
                     of the platform's own, such as a user id)"
                ));
            }
        }
        if let Some(template) = &self.template {
            if self.snapshot.is_some()
                || self.kernel.is_some()
                || self.initrd.is_some()
                || self.cmdline.is_some()
                || self.mem_mib.is_some()
                || self.vcpus.is_some()
                || self.rootfs.is_some()
                || self.probe
                || self.net.is_some()
            {
                return Err("a sandbox made from a template takes its machine from the \
                     template: put kernel, initrd, cmdline, mem_mib, vcpus and rootfs in \
                     \"template\", and give only \"idle_timeout_s\" beside it (a template's \
                     sandboxes have no NIC yet)"
                    .into());
            }
            return template.check();
        }
        if self.snapshot.is_some()
            && (self.kernel.is_some()
                || self.initrd.is_some()
                || self.cmdline.is_some()
                || self.mem_mib.is_some()
                || self.vcpus.is_some()
                || self.rootfs.is_some()
                || self.probe)
        {
            return Err(
                "a sandbox made from a snapshot takes its machine from the snapshot: \
                 give \"snapshot\" alone (with \"net\" and \"idle_timeout_s\" if wanted)"
                    .into(),
            );
        }
        for (what, path) in [
            ("snapshot", &self.snapshot),
            ("kernel", &self.kernel),
            ("initrd", &self.initrd),
        ] {
            if let Some(path) = path {
                if !path.is_absolute() {
                    return Err(format!(
                        "\"{what}\": give an absolute path ({} is relative to nothing the \
                         manager knows)",
                        path.display()
                    ));
                }
                if !path.exists() {
                    return Err(format!("\"{what}\": {} does not exist", path.display()));
                }
            }
        }
        if self.idle_timeout_s == Some(0) {
            return Err("\"idle_timeout_s\" must be at least 1 (leave it out for never)".into());
        }
        if self.idle_timeout_s.is_some_and(|t| t > MAX_IDLE_TIMEOUT_S) {
            return Err(format!(
                "\"idle_timeout_s\" must be at most {MAX_IDLE_TIMEOUT_S} (a year; leave it out \
                 for never)"
            ));
        }
        Ok(())
    }

    fn run_args(&self) -> Vec<String> {
        let mut args = Vec::new();
        let mut add = |flag: &str, value: Option<String>| {
            if let Some(value) = value {
                args.push(flag.to_owned());
                args.push(value);
            }
        };
        let path = |p: &Option<PathBuf>| p.as_ref().map(|p| p.display().to_string());
        add("--kernel", path(&self.kernel));
        add("--initrd", path(&self.initrd));
        add("--cmdline", self.cmdline.clone());
        add("--mem-mib", self.mem_mib.map(|m| m.to_string()));
        add("--vcpus", self.vcpus.map(|v| v.to_string()));
        add("--rootfs", self.rootfs.clone());
        add("--net", self.net.clone());
        if self.probe {
            args.push("--probe".into());
        }
        args
    }
}

/// Where a sandbox is in its life.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum State {
    /// Its VMM is being started (a record left in this state is a create that never finished).
    Starting,
    Running,
    /// Being snapshotted to sleep.
    Suspending,
    /// On disk only: no process, no RAM.
    Suspended,
    /// Its VMM ended without being asked and it has no snapshot to wake from.
    Dead,
    Deleting,
}

impl State {
    pub const ALL: [State; 6] = [
        State::Starting,
        State::Running,
        State::Suspending,
        State::Suspended,
        State::Dead,
        State::Deleting,
    ];

    pub fn name(self) -> &'static str {
        match self {
            State::Starting => "starting",
            State::Running => "running",
            State::Suspending => "suspending",
            State::Suspended => "suspended",
            State::Dead => "dead",
            State::Deleting => "deleting",
        }
    }
}

/// Part of a budget held while what it is for is under way: memory for a VMM while it starts
/// (see [`Manager::reserve_memory`]), disk for a snapshot while it is written (see
/// [`Manager::check_disk_for_suspend`]). Given back when dropped.
pub(super) struct Reservation<'a> {
    held: &'a Mutex<u64>,
    bytes: u64,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        let mut held = lock(self.held);
        *held = held.saturating_sub(self.bytes);
    }
}

/// What is kept of a sandbox on disk.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    pub name: String,
    pub spec: Spec,
    pub state: State,
    /// SHA-256 of its token; none once revoked.
    pub token_sha256: Option<String>,
    /// Its VMM, while it runs: pid and the process's start time (field 22 of
    /// /proc/PID/stat), so that a pid used again by another process is never taken for it.
    pub pid: Option<u32>,
    pub pid_start: Option<u64>,
    pub created_ms: u64,
    pub last_used_ms: u64,
    pub suspended_ms: Option<u64>,
    pub wakes: u64,
    pub suspends: u64,
    /// Why it is dead, when it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub died: Option<String>,
    /// Whether its VMM runs jailed (`mayfly run|restore --jail`, sharing only this
    /// sandbox's directory): kept from its create, so its wakes are jailed alike.
    #[serde(default)]
    pub jailed: bool,
    /// The uid and gid its jailed VMM runs as: one of its own (no other sandbox's VMM, and
    /// nothing else on the host, runs as it), so nothing but its VMM can use its files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// Its running VMM's guest memory, bytes, for the memory budget: set at its start (a
    /// record from before budgets has none, and counts 0 until its next start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_bytes: Option<u64>,
    /// Its VM was paused by its user (`PUT .../vm/pause`) when it last went to sleep: the
    /// next wake pauses it again, as a wake (a restore) would otherwise set it running.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub vm_paused: bool,
}

/// A sandbox's running VMM.
pub(super) struct Vmm {
    pid: u32,
    pidfd: OwnedFd,
    /// Set when this manager started it (then it reaps it); an adopted VMM's parent is gone.
    child: Option<Child>,
}

/// Whether `fd` becomes readable within `timeout` (a pidfd does once its process exited).
fn readable(fd: std::os::fd::BorrowedFd<'_>, timeout: Duration) -> bool {
    let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    let mut fds = [nix::poll::PollFd::new(&fd, nix::poll::PollFlags::POLLIN)];
    nix::poll::poll(&mut fds, ms).unwrap_or(0) > 0
}

impl Vmm {
    fn exited(&self) -> bool {
        readable(self.pidfd.as_fd(), Duration::ZERO)
    }

    /// Wait until it has exited (true) or `timeout` passed.
    fn wait_exit(&mut self, timeout: Duration) -> bool {
        let gone = readable(self.pidfd.as_fd(), timeout);
        if gone {
            if let Some(child) = &mut self.child {
                let _ = child.wait();
            }
        }
        gone
    }

    /// End it: SIGTERM first (a jailed VMM's waiter hands it on and then clears the jail's
    /// directory and cgroup), SIGKILL if it has not ended within a few seconds.
    fn kill(&mut self) {
        mayfly_sys::pidfd::signal(&self.pidfd, libc::SIGTERM);
        if !self.wait_exit(STOP_TIMEOUT) {
            mayfly_sys::pidfd::kill(&self.pidfd);
            self.wait_exit(STOP_TIMEOUT);
        }
    }

    /// Ask it to shut down on its socket; kill it if it has not ended in a few seconds.
    pub(super) fn stop(&mut self, sock: &Path) {
        let _ = mayfly_api::request_with_timeout(sock, "PUT", "/vm/shutdown", None, STOP_TIMEOUT);
        if !self.wait_exit(STOP_TIMEOUT) {
            self.kill();
        }
    }
}

struct Inner {
    record: Record,
    vmm: Option<Vmm>,
}

pub struct Sandbox {
    pub name: String,
    dir: PathBuf,
    /// Its jail's uid (also in its record), fixed at its create: read without its lock.
    uid: Option<u32>,
    inner: Mutex<Inner>,
    /// The record as last saved: what describe, list, metrics and token checks read, so they
    /// never wait behind a wake or a suspend (which hold `inner` for as long as they take).
    view: Mutex<Record>,
    /// Requests being passed to its VMM: it is not idle while one runs.
    active: AtomicUsize,
    /// The idle watch is looking after it (on a thread of its own).
    watched: std::sync::atomic::AtomicBool,
    /// The manager's monotonic clock at its last request, in ms since the manager started.
    last_used: AtomicU64,
}

/// A request in flight for a sandbox: it counts as activity until dropped.
pub struct Activity<'a> {
    sandbox: &'a Sandbox,
    manager: &'a Manager,
}

impl Drop for Activity<'_> {
    fn drop(&mut self) {
        self.sandbox.touch(self.manager);
        self.sandbox.active.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Sandbox {
    fn touch(&self, manager: &Manager) {
        self.last_used.store(manager.uptime_ms(), Ordering::SeqCst);
    }

    fn new(dir: PathBuf, record: Record, manager: &Manager) -> Sandbox {
        Sandbox {
            name: record.name.clone(),
            dir,
            uid: record.uid,
            view: Mutex::new(record.clone()),
            inner: Mutex::new(Inner { record, vmm: None }),
            active: AtomicUsize::new(0),
            watched: std::sync::atomic::AtomicBool::new(false),
            last_used: AtomicU64::new(manager.uptime_ms()),
        }
    }

    /// Its VMM's control socket, in `sock/`: a directory of root's that the jail sees
    /// read-only (the VMM's vsock sockets are there too).
    pub fn socket(&self) -> PathBuf {
        self.dir.join("sock").join("vm.sock")
    }

    /// What its jailed VMM shares and writes: `vm/`, its uid's, holding its snapshot and its
    /// disk layers. Everything else of the sandbox (its record, logs, console) is root's, so
    /// nothing a compromised VMM writes can steer what root opens.
    pub(super) fn vm_dir(&self) -> PathBuf {
        self.dir.join("vm")
    }

    pub(super) fn snapshot_dir(&self) -> PathBuf {
        self.vm_dir().join("snap")
    }

    /// What it was made from, as last saved.
    pub(super) fn spec(&self) -> Spec {
        lock(&self.view).spec.clone()
    }

    /// Whether `token` is this sandbox's (and it has not been revoked).
    pub fn token_is(&self, token: &str) -> bool {
        lock(&self.view)
            .token_sha256
            .as_deref()
            .is_some_and(|hash| same(hash.as_bytes(), hash_token(token).as_bytes()))
    }

    pub fn describe(&self, manager: &Manager) -> Value {
        let r = lock(&self.view).clone();
        let idle_ms = manager
            .uptime_ms()
            .saturating_sub(self.last_used.load(Ordering::SeqCst));
        json!({
            "name": r.name,
            "state": r.state.name(),
            "spec": r.spec,
            "pid": r.pid,
            "socket": self.socket(),
            "console": self.dir.join("console.log"),
            "created_ms": r.created_ms,
            "last_used_ms": r.last_used_ms,
            "idle_ms": idle_ms,
            "suspended_ms": r.suspended_ms,
            "wakes": r.wakes,
            "suspends": r.suspends,
            "token": if r.token_sha256.is_some() { "set" } else { "revoked" },
            "died": r.died,
            "jailed": r.jailed,
            "uid": r.uid,
        })
    }

    fn save(&self, inner: &Inner) -> Result<(), ServeError> {
        *lock(&self.view) = inner.record.clone();
        write_atomically(
            &self.dir.join(RECORD),
            &serde_json::to_vec_pretty(&inner.record).unwrap_or_default(),
        )
    }
}

/// Constant-time comparison of two hashes.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

pub fn hash_token(token: &str) -> String {
    let digest = Sha256::digest(token.as_bytes());
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// A new token: 32 random bytes, hex, with a prefix that says what it is.
pub fn new_token(prefix: &str) -> Result<String, ServeError> {
    let mut bytes = [0u8; 32];
    let mut filled = 0;
    while filled < bytes.len() {
        // SAFETY: getrandom writes at most the given length into the buffer, which lives
        // across the call.
        let n = unsafe {
            libc::getrandom(bytes[filled..].as_mut_ptr().cast(), bytes.len() - filled, 0)
        };
        match usize::try_from(n) {
            Ok(n) => filled += n,
            Err(_) => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(ServeError::Io {
                        what: "draw a random token from",
                        path: "getrandom".into(),
                        source: e,
                    });
                }
            }
        }
    }
    Ok(format!(
        "{prefix}{}",
        bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()
    ))
}

/// Replace `path` with `bytes` so that a crash leaves the old or the new file, never half of
/// one (see `mayfly_sys::atomic`).
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), ServeError> {
    mayfly_sys::atomic::write(path, bytes).map_err(|source| ServeError::Io {
        what: "write",
        path: path.display().to_string(),
        source,
    })
}

/// Whether `name` can name a sandbox: a DNS label (RFC 1123): 1 to 63 lower-case letters,
/// digits and hyphens, not starting or ending with a hyphen.
pub fn valid_name(name: &str) -> bool {
    (1..=63).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
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
fn rss_tree_bytes(pid: u32) -> u64 {
    let children =
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    rss_bytes(pid)
        + children
            .split_whitespace()
            .filter_map(|c| c.parse::<u32>().ok())
            .map(rss_bytes)
            .sum::<u64>()
}

/// Refuse a snapshot (or disk directory) a jailed VMM wrote if anything in it is not a plain
/// directory or file: root opens it next, and a symbolic link planted there would have root
/// open what the link names (another sandbox's snapshot, any file of the host). Nothing of
/// that VMM's uid runs any more when this is called (the VMM is gone, and its uid is its
/// own), so what is checked stays as it is.
pub(super) fn check_plain(path: &Path) -> Result<(), ServeError> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(ServeError::Io {
                what: "check",
                path: path.display().to_string(),
                source,
            })
        }
    };
    if meta.is_file() {
        return Ok(());
    }
    if !meta.is_dir() {
        return Err(ServeError::VmmFailed(format!(
            "{} is not a plain file or directory (a link or device a VMM made?): the sandbox \
             will not be restored from it; delete the sandbox",
            path.display()
        )));
    }
    let entries = std::fs::read_dir(path).map_err(|source| ServeError::Io {
        what: "read",
        path: path.display().to_string(),
        source,
    })?;
    for entry in entries.flatten() {
        check_plain(&entry.path())?;
    }
    Ok(())
}

/// Bytes allocated on disk under `path`, each file counted once however many hard links it
/// has there (sandboxes made from one template or fork share their base's files).
pub(super) fn disk_bytes(path: &Path) -> u64 {
    disk_bytes_once(path, &mut std::collections::HashSet::new())
}

fn disk_bytes_once(path: &Path, seen: &mut std::collections::HashSet<(u64, u64)>) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return 0;
    };
    if !seen.insert((meta.dev(), meta.ino())) {
        return 0;
    }
    let own = meta.blocks() * 512;
    if !meta.is_dir() {
        return own;
    }
    let Ok(entries) = std::fs::read_dir(path) else {
        return own;
    };
    own + entries
        .flatten()
        .map(|e| disk_bytes_once(&e.path(), seen))
        .sum::<u64>()
}

/// Make a sandbox's (or template's) directories: its own (root's, 0700: record, logs,
/// console), `sock/` (root's, 0755: the jail sees it read-only) and `vm/` (the jail's uid's,
/// 0700: what the jailed VMM writes).
pub(super) fn make_dirs(dir: &Path, jail_uid: Option<u32>) -> Result<(), ServeError> {
    let io = |what, path: &Path| {
        let path = path.display().to_string();
        move |source| ServeError::Io { what, path, source }
    };
    for (path, mode) in [
        (dir.to_path_buf(), 0o700),
        (dir.join("sock"), 0o755),
        (dir.join("vm"), 0o700),
    ] {
        std::fs::create_dir(&path).map_err(io("make", &path))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
            .map_err(io("set the mode of", &path))?;
    }
    if let Some(uid) = jail_uid {
        let vm = dir.join("vm");
        std::os::unix::fs::chown(&vm, Some(uid), Some(uid))
            .map_err(io("give to the jail's uid", &vm))?;
    }
    Ok(())
}

/// The last lines of a VMM's log, for an error message.
fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let tail = lines[lines.len().saturating_sub(5)..].join(" | ");
    if tail.is_empty() {
        "(its log is empty)".into()
    } else {
        tail
    }
}

/// One life-cycle event: a JSON line in the event log, and on stderr.
fn write_event(events: &Mutex<std::fs::File>, event: &str, sandbox: &str, detail: Value) {
    let mut line = json!({ "ts_ms": now_ms(), "event": event, "sandbox": sandbox });
    if let (Some(line), Value::Object(detail)) = (line.as_object_mut(), detail) {
        line.extend(detail);
    }
    let text = format!("{line}\n");
    let _ = lock(events).write_all(text.as_bytes());
    eprint!("mayfly serve: {text}");
}

/// The manager: every sandbox, its counters and its event log.
pub struct Manager {
    dir: PathBuf,
    mayfly: PathBuf,
    /// Whether new sandboxes are jailed (the default; `mayfly serve --no-jail` turns it off).
    jail: bool,
    /// Jailed sandboxes run as uids from here on, one each (templates are built as the one
    /// below it).
    uid_base: u32,
    templates: crate::template::Templates,
    admin_hash: String,
    sandboxes: Mutex<BTreeMap<String, Arc<Sandbox>>>,
    /// The memory budget, bytes (`mayfly serve --mem-budget-mib`).
    mem_budget: Option<u64>,
    /// Past it, suspend the longest-idle sandboxes instead of refusing.
    make_room: bool,
    /// The disk budget, bytes (`--disk-budget-mib`).
    disk_budget: Option<u64>,
    /// Asleep this long, a sandbox is deleted (`--expire-after`), ms.
    expire_after_ms: Option<u64>,
    /// Unused this long, a template is collected (`--template-ttl`).
    template_ttl: Option<Duration>,
    /// When templates were last looked at for collection.
    templates_checked: Mutex<Option<Instant>>,
    /// Guest memory of starts in flight (reserved, not yet in a record as running), bytes;
    /// its lock also makes each check-and-reserve one step.
    mem_starting: Mutex<u64>,
    /// Disk held by the snapshots being written for suspends now.
    disk_writing: Mutex<u64>,
    pub metrics: Metrics,
    /// Signs the credentials sandboxes' guests hold.
    credentials: crate::credential::Keys,
    events: Arc<Mutex<std::fs::File>>,
    started: Instant,
}

impl Manager {
    /// Open (or make) a state directory: its admin token, its event log, its sandboxes.
    pub fn open(
        dir: &Path,
        mayfly: PathBuf,
        policy: &super::Policy,
    ) -> Result<Manager, ServeError> {
        let io = |what, path: &Path| {
            let path = path.display().to_string();
            move |source| ServeError::Io { what, path, source }
        };
        let sandboxes = dir.join("sandboxes");
        std::fs::create_dir_all(&sandboxes).map_err(io("make", &sandboxes))?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(io("set the mode of", dir))?;
        let token_file = dir.join("admin.token");
        let admin = match std::fs::read_to_string(&token_file) {
            Ok(token) if !token.trim().is_empty() => token.trim().to_owned(),
            Ok(_) | Err(_) => {
                let token = new_token("mfa_")?;
                write_atomically(&token_file, format!("{token}\n").as_bytes())?;
                token
            }
        };
        let events_path = dir.join("events.jsonl");
        let events = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o600)
            .open(&events_path)
            .map_err(io("open", &events_path))?;
        Ok(Manager {
            dir: dir.to_path_buf(),
            mayfly,
            jail: policy.jail,
            uid_base: policy.jail_uid_base,
            templates: crate::template::Templates::new(dir),
            admin_hash: hash_token(&admin),
            sandboxes: Mutex::new(BTreeMap::new()),
            mem_budget: policy.mem_budget_mib.map(|m| m.saturating_mul(1 << 20)),
            make_room: policy.make_room,
            disk_budget: policy.disk_budget_mib.map(|m| m.saturating_mul(1 << 20)),
            expire_after_ms: policy.expire_after_s.map(|s| s.saturating_mul(1000)),
            template_ttl: policy.template_ttl_s.map(Duration::from_secs),
            templates_checked: Mutex::new(None),
            mem_starting: Mutex::new(0),
            disk_writing: Mutex::new(0),
            metrics: Metrics::default(),
            credentials: crate::credential::Keys::open(dir)?,
            events: Arc::new(Mutex::new(events)),
            started: Instant::now(),
        })
    }

    /// Guest memory held by sandboxes whose VMM runs (starting, running, suspending or
    /// being woken: whenever its record has a pid), bytes, from their root-owned records.
    fn memory_in_use(&self) -> u64 {
        let all: Vec<Arc<Sandbox>> = lock(&self.sandboxes).values().cloned().collect();
        all.iter()
            .filter_map(|sandbox| {
                let view = lock(&sandbox.view);
                view.pid.map(|_| view.guest_bytes.unwrap_or(0))
            })
            .fold(0u64, u64::saturating_add)
    }

    /// Hold `bytes` of the memory budget for a VMM about to start (none without a budget):
    /// refused when the running sandboxes and the starts in flight already hold too much.
    /// The reservation ends when the returned guard drops, by when the started VMM is in its
    /// record (so it is counted there: for a moment twice, never not at all).
    pub(super) fn reserve_memory(
        &self,
        name: &str,
        bytes: u64,
    ) -> Result<Option<Reservation<'_>>, ServeError> {
        let Some(budget) = self.mem_budget else {
            return Ok(None);
        };
        if bytes > budget {
            return Err(ServeError::BadRequest(format!(
                "{name} needs {} MiB, more than the whole memory budget of {} MiB (mayfly serve \
                 --mem-budget-mib): give it less memory or the manager a larger budget",
                bytes >> 20,
                budget >> 20
            )));
        }
        // With suspend-idle, a sandbox is picked under the budget's lock and put to sleep
        // after it is released (a suspend takes a while, and other starts need the lock), and
        // the check starts over; each sandbox is tried once.
        let mut tried: Vec<String> = Vec::new();
        loop {
            let mut starting = lock(&self.mem_starting);
            let in_use = self.memory_in_use().saturating_add(*starting);
            if in_use.saturating_add(bytes) <= budget {
                *starting += bytes;
                return Ok(Some(Reservation {
                    held: &self.mem_starting,
                    bytes,
                }));
            }
            let shortfall = in_use.saturating_add(bytes) - budget;
            let victim = if self.make_room {
                self.longest_idle(name, shortfall, &tried)
            } else {
                None
            };
            let Some(victim) = victim else {
                self.metrics.over_budget.fetch_add(1, Ordering::Relaxed);
                return Err(ServeError::OverBudget(format!(
                    "memory budget: {} needs {} MiB, and sandboxes running hold {} MiB of the \
                     {} MiB budget (mayfly serve --mem-budget-mib): pause or delete one (PUT \
                     /sandboxes/NAME/pause sleeps it to disk), or start the manager with a \
                     larger budget",
                    name,
                    bytes >> 20,
                    in_use >> 20,
                    budget >> 20
                )));
            };
            drop(starting);
            tried.push(victim.name.clone());
            self.suspend_for_room(&victim, name, bytes);
        }
    }

    /// The running sandbox idle longest that could go to sleep to make room for `for_name`
    /// (no request in flight, not tried yet), if all such sandboxes together free at least
    /// `shortfall`: nothing goes to sleep that would not help.
    fn longest_idle(
        &self,
        for_name: &str,
        shortfall: u64,
        tried: &[String],
    ) -> Option<Arc<Sandbox>> {
        let candidates: Vec<(u64, Arc<Sandbox>)> = lock(&self.sandboxes)
            .values()
            .filter(|s| s.name != for_name && s.active.load(Ordering::SeqCst) == 0)
            .filter(|s| {
                let view = lock(&s.view);
                view.state == State::Running && view.pid.is_some()
            })
            .map(|s| (s.last_used.load(Ordering::SeqCst), Arc::clone(s)))
            .collect();
        let freeable = candidates
            .iter()
            .map(|(_, s)| lock(&s.view).guest_bytes.unwrap_or(0))
            .fold(0u64, u64::saturating_add);
        if freeable < shortfall {
            return None;
        }
        candidates
            .into_iter()
            .filter(|(_, s)| !tried.contains(&s.name))
            .min_by_key(|(last_used, _)| *last_used)
            .map(|(_, s)| s)
    }

    /// Put `sandbox` to sleep for `for_name`, if it is still running and idle. A sandbox busy
    /// with a wake, suspend or delete (its lock taken) is passed over rather than waited for:
    /// it may itself be waiting for the budget.
    fn suspend_for_room(&self, sandbox: &Sandbox, for_name: &str, bytes: u64) {
        let mut inner = match sandbox.inner.try_lock() {
            Ok(inner) => inner,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return,
        };
        // A request that came meanwhile (it counts itself before it takes the lock) keeps its
        // sandbox awake.
        if inner.record.state != State::Running || sandbox.active.load(Ordering::SeqCst) != 0 {
            return;
        }
        let idle_ms = self
            .uptime_ms()
            .saturating_sub(sandbox.last_used.load(Ordering::SeqCst));
        self.event(
            "making_room",
            &sandbox.name,
            json!({ "for": for_name, "needs_bytes": bytes, "idle_ms": idle_ms }),
        );
        if self.suspend_locked(sandbox, &mut inner).is_ok() {
            self.metrics.made_room.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// What the sandboxes keep on disk, bytes (each file once, however many links it has).
    fn disk_in_use(&self) -> u64 {
        disk_bytes(&self.dir.join("sandboxes"))
    }

    /// Whether `sandbox` may write a snapshot of `guest_bytes` of memory within the disk
    /// budget: a snapshot takes at most its memory and a MiB (a diff is usually far less, but
    /// a compacting one can be all of it). What suspends under way may write is held until
    /// they are done (the returned guard), so two at once are counted against each other.
    fn check_disk_for_suspend(
        &self,
        sandbox: &Sandbox,
        guest_bytes: u64,
    ) -> Result<Option<Reservation<'_>>, ServeError> {
        let Some(budget) = self.disk_budget else {
            return Ok(None);
        };
        // The whole of it: the new snapshot is written beside the old one before the old
        // goes, and the old one's files may be linked by clones and stay.
        let needs = guest_bytes.saturating_add(1 << 20);
        // The walk of the sandboxes' files outside the lock (it takes a while with many).
        let kept = self.disk_in_use();
        let mut writing = lock(&self.disk_writing);
        let in_use = kept.saturating_add(*writing);
        if in_use.saturating_add(needs) > budget {
            self.metrics.over_budget.fetch_add(1, Ordering::Relaxed);
            return Err(ServeError::OverBudget(format!(
                "disk budget: suspending {} may write up to {} MiB, and sandboxes keep (or are \
                 writing) {} MiB of the {} MiB budget (mayfly serve --disk-budget-mib): delete \
                 a sleeping sandbox, or start the manager with a larger budget; it stays awake \
                 meanwhile",
                sandbox.name,
                needs >> 20,
                in_use >> 20,
                budget >> 20
            )));
        }
        *writing += needs;
        Ok(Some(Reservation {
            held: &self.disk_writing,
            bytes: needs,
        }))
    }

    pub(super) fn mayfly(&self) -> &Path {
        &self.mayfly
    }

    pub(super) fn state_dir(&self) -> &Path {
        &self.dir
    }

    /// A snapshot of `source` at `into` for a fork (see [`super::fork`]): a running sandbox
    /// is paused, snapshotted into its own `vm/` (`vm/<name>`, all its jail may write), moved
    /// to `into` and resumed (unless its user had paused it); a sleeping one stays asleep and
    /// its own snapshot is linked at `into`.
    pub(super) fn fork_snapshot(
        &self,
        source: &Sandbox,
        into: &Path,
        prepare: &dyn Fn(&Path) -> Result<(), ServeError>,
    ) -> Result<(), ServeError> {
        let mut inner = lock(&source.inner);
        if inner.record.state == State::Running && inner.vmm.as_ref().is_none_or(Vmm::exited) {
            self.note_death(source, &mut inner);
        }
        source.touch(self);
        // A running source sleeps first: root reads, links and copies what its VMM wrote only
        // once no process of its uid runs (a live VMM could swap a name for a link under
        // root's feet, or keep a descriptor to write through), as before every wake.
        let was_running = match inner.record.state {
            State::Running => {
                self.suspend_locked(source, &mut inner)?;
                true
            }
            State::Suspended => false,
            other => {
                return Err(ServeError::Conflict(format!(
                    "sandbox {} is {}: only a running or sleeping sandbox can be forked",
                    source.name,
                    other.name()
                )))
            }
        };
        let snapshot = source.snapshot_dir();
        let made = check_plain(&snapshot)
            .and_then(|()| crate::fork::link_snapshot(&snapshot, into))
            .and_then(|()| prepare(into));
        if made.is_err() {
            let _ = std::fs::remove_dir_all(into);
        }
        if was_running {
            // Back as it was; if it cannot wake now, it stays asleep and wakes on its next
            // request (the fork does not fail for it).
            if let Err(e) = self.wake(source, &mut inner) {
                self.event(
                    "fork_source_asleep",
                    &source.name,
                    json!({ "error": e.to_string() }),
                );
            }
        }
        made
    }

    /// A sandbox no one knows by name, for a VMM of the manager's own (a template's build).
    pub(super) fn detached_sandbox(&self, name: &str, dir: &Path, uid: Option<u32>) -> Sandbox {
        let record = Record {
            name: name.to_owned(),
            spec: Spec::default(),
            state: State::Starting,
            token_sha256: None,
            pid: None,
            pid_start: None,
            created_ms: now_ms(),
            last_used_ms: now_ms(),
            suspended_ms: None,
            wakes: 0,
            suspends: 0,
            died: None,
            jailed: uid.is_some(),
            uid,
            guest_bytes: None,
            vm_paused: false,
        };
        Sandbox::new(dir.to_path_buf(), record, self)
    }

    /// Save a detached sandbox's VMM in its record right after it started (see
    /// [`Manager::start_vmm`]), so that a manager killed meanwhile can end it at its restart.
    pub(super) fn save_started(
        sandbox: &Sandbox,
        pid: u32,
        start: Option<u64>,
    ) -> Result<(), ServeError> {
        let mut inner = lock(&sandbox.inner);
        inner.record.pid = Some(pid);
        inner.record.pid_start = start;
        sandbox.save(&inner)
    }

    /// End the VMMs of template builds a killed manager left, and remove those builds.
    fn remove_unfinished_templates(&self) {
        let Ok(entries) = std::fs::read_dir(self.dir.join("templates")) else {
            return;
        };
        for entry in entries.flatten() {
            let dir = entry.path();
            if dir.join("template.json").is_file() {
                continue;
            }
            let record: Option<Record> = std::fs::read(dir.join(RECORD))
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok());
            if let Some(mut vmm) = record.as_ref().and_then(find_process) {
                vmm.kill();
            }
            let _ = std::fs::remove_dir_all(&dir);
            self.event(
                "template_removed",
                "",
                json!({ "template": entry.file_name().to_string_lossy(), "why": "its build never finished" }),
            );
        }
    }

    fn uptime_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    pub fn is_admin(&self, token: &str) -> bool {
        same(self.admin_hash.as_bytes(), hash_token(token).as_bytes())
    }

    /// One JSON line per life-cycle event, in `events.jsonl` and on stderr.
    pub fn event(&self, event: &str, sandbox: &str, detail: Value) {
        write_event(&self.events, event, sandbox, detail);
    }

    pub fn get(&self, name: &str) -> Option<Arc<Sandbox>> {
        lock(&self.sandboxes).get(name).cloned()
    }

    pub fn list(&self) -> Vec<Value> {
        let all: Vec<Arc<Sandbox>> = lock(&self.sandboxes).values().cloned().collect();
        all.iter().map(|s| s.describe(self)).collect()
    }

    pub fn gauges(&self) -> Gauges {
        let all: Vec<Arc<Sandbox>> = lock(&self.sandboxes).values().cloned().collect();
        let mut counts = [0usize; State::ALL.len()];
        let mut memory = 0;
        for sandbox in &all {
            let view = lock(&sandbox.view).clone();
            if let Some(i) = State::ALL.iter().position(|s| *s == view.state) {
                counts[i] += 1;
            }
            if let (State::Running, Some(pid)) = (view.state, view.pid) {
                memory += rss_tree_bytes(pid);
            }
        }
        Gauges {
            by_state: State::ALL
                .iter()
                .zip(counts)
                .map(|(s, n)| (s.name(), n))
                .collect(),
            memory_bytes: memory,
            disk_bytes: self.disk_in_use(),
        }
    }

    /// Rebuild the view from the records on disk (at start): adopt the VMMs that still run,
    /// keep the suspended, finish what a crash interrupted.
    pub fn recover(&self) {
        self.remove_unfinished_templates();
        // Fork bases live only while their fork request runs: any left are a killed
        // manager's (its clones, if made, hold links to the files they need).
        if let Ok(entries) = std::fs::read_dir(self.dir.join("forks")) {
            for entry in entries.flatten() {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
        let Ok(entries) = std::fs::read_dir(self.dir.join("sandboxes")) else {
            return;
        };
        for entry in entries.flatten() {
            let dir = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if !valid_name(&name) || !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let record: Record = match std::fs::read(dir.join(RECORD))
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
            {
                Ok(record) => record,
                Err(e) => {
                    // Left alone for a person to look at: nothing is deleted on a guess.
                    self.event("unreadable", &name, json!({ "error": e, "dir": dir }));
                    continue;
                }
            };
            let sandbox = Arc::new(Sandbox::new(dir.clone(), record, self));
            let mut inner = lock(&sandbox.inner);
            // The process the record names, if it still is that process (same pid, same
            // start time): saved right after each VMM was started, so none is ever lost.
            let process = find_process(&inner.record);
            let answers = process.is_some()
                && matches!(
                    mayfly_api::request_with_timeout(
                        &sandbox.socket(),
                        "GET",
                        "/vm",
                        None,
                        Duration::from_secs(5)
                    ),
                    Ok((200, _))
                );
            let outcome = match (inner.record.state, process) {
                (State::Starting | State::Deleting, process) => {
                    // A create that never answered, or a delete that never finished: finish
                    // removing it.
                    if let Some(mut vmm) = process {
                        vmm.kill();
                    }
                    let _ = std::fs::remove_dir_all(&dir);
                    self.event(
                        "removed",
                        &name,
                        json!({ "why": "unfinished at the last stop" }),
                    );
                    continue;
                }
                (State::Running | State::Suspending, Some(vmm)) if answers => {
                    if inner.record.state == State::Suspending {
                        // A suspend cut short: the VM may be paused; it carries on instead.
                        let _ = mayfly_api::request_with_timeout(
                            &sandbox.socket(),
                            "PUT",
                            "/vm/resume",
                            None,
                            Duration::from_secs(5),
                        );
                    }
                    inner.vmm = Some(vmm);
                    inner.record.state = State::Running;
                    "adopted"
                }
                (State::Running | State::Suspending, process) => {
                    // Its VMM ended (or no longer answers) while the manager was away.
                    if let Some(mut vmm) = process {
                        vmm.kill();
                    }
                    self.mark_dead(&sandbox, &mut inner.record, "while the manager was away");
                    "vmm_gone"
                }
                (State::Suspended | State::Dead, Some(mut vmm)) => {
                    // A wake the manager did not see through: it is asleep again.
                    vmm.kill();
                    inner.record.pid = None;
                    inner.record.pid_start = None;
                    "unfinished_wake_undone"
                }
                (state, None) => state.name(),
            };
            let _ = sandbox.save(&inner);
            self.event(
                "recovered",
                &name,
                json!({ "state": inner.record.state.name(), "how": outcome }),
            );
            drop(inner);
            lock(&self.sandboxes).insert(name, Arc::clone(&sandbox));
        }
    }

    /// A sandbox whose VMM ended without being asked is dead: what ran since its last wake is
    /// gone. Its last snapshot (if it has one) is kept, older than what it lost, and woken
    /// from only on an explicit `PUT .../resume`, never behind a request's back.
    fn mark_dead(&self, sandbox: &Sandbox, record: &mut Record, when: &str) {
        // A jailed VMM outlives its waiter by a moment (it dies of the waiter's death): until
        // it lets go of its socket, nothing else can serve the sandbox.
        let deadline = Instant::now() + STOP_TIMEOUT;
        while std::os::unix::net::UnixStream::connect(sandbox.socket()).is_ok()
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(10));
        }
        record.pid = None;
        record.pid_start = None;
        record.state = State::Dead;
        let log = log_tail(&sandbox.dir.join("vmm.log"));
        record.died = Some(if sandbox.snapshot_dir().is_dir() {
            format!(
                "its VMM ended {when} ({log}); its last snapshot, from before its last wake, \
                 is kept: PUT /sandboxes/{}/resume goes back to it (what happened since is lost), \
                 DELETE removes it",
                sandbox.name
            )
        } else {
            format!("its VMM ended {when} ({log}) and it has no snapshot: delete it")
        });
        self.metrics.vmm_deaths.fetch_add(1, Ordering::Relaxed);
        self.event("vmm_died", &sandbox.name, json!({ "why": record.died }));
    }

    /// Make a sandbox and start its VMM; returns its description and its token. Nothing of
    /// it is left if it fails.
    pub fn create(&self, name: &str, mut spec: Spec) -> Result<(Value, String), ServeError> {
        if !valid_name(name) {
            return Err(ServeError::BadRequest(format!(
                "{name:?} is not a sandbox name: use 1 to 63 lower-case letters, digits and \
                 hyphens, not starting or ending with a hyphen (a DNS label)"
            )));
        }
        spec.check().map_err(ServeError::BadRequest)?;
        if self.jail && spec.net.as_deref().is_some_and(|net| net != "none") {
            return Err(ServeError::BadRequest(
                "this manager jails its sandboxes, and a jailed VM cannot have a NIC yet: leave \
                 \"net\" out, or start the manager with --no-jail to give sandboxes networks \
                 (their VMMs then run as root)"
                    .into(),
            ));
        }
        let dir = self.dir.join("sandboxes").join(name);
        let sock = dir.join("vm.sock");
        // The vsock socket beside it is the longest path the VMM binds.
        let longest = sock.as_os_str().len() + ".vsock_4294967295".len();
        if longest > mayfly_sys::socket::MAX_SOCKET_PATH {
            return Err(ServeError::BadRequest(format!(
                "the sandbox's sockets under {} would be {longest} bytes long, over the {} a \
                 Unix socket path may have: give a shorter name, or serve from a shorter \
                 --state-dir",
                dir.display(),
                mayfly_sys::socket::MAX_SOCKET_PATH
            )));
        }
        if lock(&self.sandboxes).contains_key(name) {
            return Err(ServeError::Conflict(format!(
                "a sandbox named {name} exists: pick another name, or delete it first"
            )));
        }
        if let Some(template) = &mut spec.template {
            // A guest without the agent is not waited for, nor is its template's (the record
            // keeps the template as built: its key says which one it uses).
            template.no_agent |= spec.no_agent;
        }
        if let Some(template) = &spec.template {
            // Built (or found) before the name is taken: a build may take a while.
            let builder_uid = self.jail.then(|| self.uid_base.saturating_sub(1).max(1));
            spec.snapshot = Some(self.templates.snapshot_for(self, template, builder_uid)?);
        }
        let token = new_token("mfs_")?;
        let now = now_ms();
        // The name is taken (under the map's lock) before anything is made on disk, and a
        // jailed sandbox gets the lowest uid from the base that no other sandbox has.
        let sandbox = {
            let mut all = lock(&self.sandboxes);
            if all.contains_key(name) || dir.exists() {
                return Err(ServeError::Conflict(format!(
                    "a sandbox named {name} exists: pick another name, or delete it first"
                )));
            }
            let uid = if self.jail {
                let taken: std::collections::BTreeSet<u32> =
                    all.values().filter_map(|s| s.uid).collect();
                Some(
                    (self.uid_base..u32::MAX)
                        .find(|uid| !taken.contains(uid))
                        .ok_or_else(|| {
                            ServeError::Conflict("no uid is left for a new sandbox".into())
                        })?,
                )
            } else {
                None
            };
            let record = Record {
                name: name.to_owned(),
                spec,
                state: State::Starting,
                token_sha256: Some(hash_token(&token)),
                pid: None,
                pid_start: None,
                created_ms: now,
                last_used_ms: now,
                suspended_ms: None,
                wakes: 0,
                suspends: 0,
                died: None,
                jailed: self.jail,
                uid,
                guest_bytes: None,
                vm_paused: false,
            };
            let sandbox = Arc::new(Sandbox::new(dir.clone(), record, self));
            all.insert(name.to_owned(), Arc::clone(&sandbox));
            sandbox
        };
        let start = Instant::now();
        let mut inner = lock(&sandbox.inner);
        let made = (|| {
            make_dirs(&dir, inner.record.uid.filter(|_| inner.record.jailed))?;
            sandbox.save(&inner)?;
            // A snapshot to restore is linked into the sandbox's own `vm/base/` (nothing is
            // copied): the layers its disks stack on are then inside what its jail sees, its
            // later snapshots can name them, and the template or fork base it came from can
            // go while it lives.
            if let Some(snapshot) = inner.record.spec.snapshot.clone() {
                if let Some(base) = crate::fork::link_base(&snapshot, &sandbox.vm_dir())? {
                    inner.record.spec.snapshot = Some(base);
                    sandbox.save(&inner)?;
                }
            }
            let jail = inner.record.uid.filter(|_| inner.record.jailed);
            let spec = inner.record.spec.clone();
            let vmm = self.start_vmm(&sandbox, &spec, jail, false, &mut |pid, start, bytes| {
                inner.record.pid = Some(pid);
                inner.record.pid_start = start;
                inner.record.guest_bytes = Some(bytes);
                sandbox.save(&inner)
            })?;
            inner.vmm = Some(vmm);
            inner.record.state = State::Running;
            sandbox.save(&inner)
        })();
        if let Err(e) = made {
            if let Some(mut vmm) = inner.vmm.take() {
                vmm.kill();
            }
            let _ = std::fs::remove_dir_all(&dir);
            drop(inner);
            lock(&self.sandboxes).remove(name);
            self.metrics.creates_failed.fetch_add(1, Ordering::Relaxed);
            self.event("create_failed", name, json!({ "error": e.to_string() }));
            return Err(e);
        }
        let took = start.elapsed();
        self.metrics.create.observe(took);
        self.event(
            "created",
            name,
            json!({ "ms": took.as_secs_f64() * 1e3, "pid": inner.record.pid }),
        );
        let record = inner.record.clone();
        drop(inner);
        self.give_credential(&sandbox, &record);
        Ok((sandbox.describe(self), token))
    }

    /// The credential of the sandbox `record` describes (see [`super::credential`]).
    fn credential_for(&self, record: &Record) -> (crate::credential::Claims, String) {
        let claims = crate::credential::Claims {
            sandbox: record.name.clone(),
            acts_for: record.spec.acts_for.clone(),
            created_ms: record.created_ms,
        };
        let credential = self.credentials.mint(&claims);
        (claims, credential)
    }

    /// Put its credential in a new sandbox's guest, through its agent. A restored guest (a
    /// template's, a snapshot's, a fork's clone) has its agent up at once, and gets it before
    /// its create answers; a booting one gets it from a thread once its agent answers. Never
    /// fails the create (a guest of the user's own may have no agent): a failure is an event.
    /// The probe guest has no agent.
    fn give_credential(&self, sandbox: &Arc<Sandbox>, record: &Record) {
        let spec = &record.spec;
        if spec.agentless() {
            return;
        }
        let (claims, credential) = self.credential_for(record);
        let mut file = serde_json::to_value(&claims).unwrap_or_default();
        file["credential"] = Value::String(credential);
        let sock = sandbox.socket();
        let path = format!(
            "/vm/files?path={}&mode=0400&mkdirs=1",
            crate::credential::GUEST_PATH.replace('/', "%2F")
        );
        // Tried until `wait` is over (each attempt only as long as is left), again only when
        // the agent is not up yet (503, 504, or no answer): any other answer is final.
        // Its own sandbox, not its name: a sandbox deleted meanwhile (and perhaps made again
        // under the name, at the same socket path) gets nothing more from this one.
        let own = Arc::clone(sandbox);
        let put = move |wait: Duration| -> Result<(), String> {
            let deadline = Instant::now() + wait;
            loop {
                if lock(&own.view).state == State::Deleting {
                    return Err("the sandbox was deleted".into());
                }
                let left = deadline.saturating_duration_since(Instant::now());
                let attempt = left.max(Duration::from_millis(100));
                let last = match mayfly_api::request_with_timeout(
                    &sock,
                    "PUT",
                    &path,
                    Some(&file),
                    attempt,
                ) {
                    Ok((200, _)) => return Ok(()),
                    Ok((status, body)) if status != 503 && status != 504 => {
                        return Err(format!("{status} {body}"))
                    }
                    Ok((status, body)) => format!("{status} {body}"),
                    Err(e) => e.to_string(),
                };
                if Instant::now() >= deadline {
                    return Err(last);
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        };
        let events = Arc::clone(&self.events);
        let name = sandbox.name.clone();
        let report = move |result: Result<(), String>| match result {
            Ok(()) => write_event(&events, "credential_given", &name, json!({})),
            Err(e) => write_event(&events, "credential_failed", &name, json!({ "error": e })),
        };
        if spec.snapshot.is_some() {
            report(put(CREDENTIAL_RESTORE_WAIT));
            return;
        }
        let spawned = std::thread::Builder::new()
            .name("serve-credential".into())
            .spawn(move || report(put(CREDENTIAL_BOOT_WAIT)));
        if let Err(e) = spawned {
            self.event(
                "credential_failed",
                &sandbox.name,
                json!({ "error": format!("cannot start its thread: {e}") }),
            );
        }
    }

    /// Whether `credential` is one this manager made for a sandbox that still exists.
    pub fn verify_credential(&self, credential: &str) -> Value {
        let claims = match self.credentials.check(credential) {
            Ok(claims) => claims,
            Err(why) => return json!({ "valid": false, "error": why }),
        };
        let current = self.get(&claims.sandbox).map(|s| {
            let view = lock(&s.view);
            (view.created_ms, view.state)
        });
        match current {
            Some((created, State::Deleting)) if created == claims.created_ms => json!({
                "valid": false,
                "error": format!("sandbox {} is being deleted", claims.sandbox),
            }),
            Some((created, _)) if created == claims.created_ms => json!({
                "valid": true,
                "sandbox": claims.sandbox,
                "acts_for": claims.acts_for,
                "created_ms": claims.created_ms,
            }),
            Some(_) => json!({
                "valid": false,
                "error": format!("sandbox {} was deleted and made again since: this credential was its predecessor's", claims.sandbox),
            }),
            None => json!({
                "valid": false,
                "error": format!("sandbox {} no longer exists", claims.sandbox),
            }),
        }
    }

    /// Start a sandbox's VMM (a boot, or a restore of its own snapshot when `wake`) and wait
    /// for its control socket to answer.
    pub(super) fn start_vmm(
        &self,
        sandbox: &Sandbox,
        spec: &Spec,
        jail_uid: Option<u32>,
        wake: bool,
        persist: &mut dyn FnMut(u32, Option<u64>, u64) -> Result<(), ServeError>,
    ) -> Result<Vmm, ServeError> {
        let sock = sandbox.socket();
        let log_path = sandbox.dir.join("vmm.log");
        let log = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o600)
            .open(&log_path)
            .map_err(|source| ServeError::Io {
                what: "open",
                path: log_path.display().to_string(),
                source,
            })?;
        let err_log = log.try_clone().map_err(|source| ServeError::Io {
            what: "open",
            path: log_path.display().to_string(),
            source,
        })?;
        let mut command = Command::new(&self.mayfly);
        let restore_from = if wake {
            Some(sandbox.snapshot_dir())
        } else {
            spec.snapshot.clone()
        };
        // Its guest memory, for the budget: a restore's is its memory file's length, a
        // boot's what it asks for.
        let guest_bytes = match &restore_from {
            Some(snapshot) => {
                std::fs::symlink_metadata(snapshot.join(mayfly_snapshot::MEMORY_FILE))
                    .map(|m| m.len())
                    .unwrap_or(0)
            }
            None => spec
                .mem_mib
                .unwrap_or(crate::sandbox::DEFAULT_MEM_MIB)
                .saturating_mul(1 << 20),
        };
        let _reservation = self.reserve_memory(&sandbox.name, guest_bytes)?;
        match &restore_from {
            Some(snapshot) => {
                // A snapshot the manager keeps was written by a VMM (jailed, perhaps
                // compromised): root restores it only if it holds nothing but plain files.
                if snapshot.starts_with(&self.dir) {
                    check_plain(snapshot)?;
                    check_plain(&sandbox.vm_dir().join("disks"))?;
                    check_plain(&sandbox.vm_dir().join(crate::fork::BASE))?;
                }
                // Layers it names by full path must be its own (see disks::open_for_restore).
                command
                    .arg("restore")
                    .arg(snapshot)
                    .arg("--disk-layers-within")
                    .arg(sandbox.vm_dir());
                // The snapshot's policy is kept on wake; a first restore may set one.
                if let (false, Some(net)) = (wake, &spec.net) {
                    command.args(["--net", net]);
                }
            }
            None => {
                command.arg("run").args(spec.run_args());
            }
        }
        command
            .arg("--name")
            .arg(&sandbox.name)
            .arg("--api-sock")
            .arg(&sock)
            .arg("--console")
            .arg(sandbox.dir.join("console.log"))
            .arg("--disk-dir")
            .arg(sandbox.vm_dir().join("disks"));
        if let Some(uid) = jail_uid {
            // Its `vm/` is all it shares: its snapshot goes there when it sleeps.
            command
                .arg("--jail")
                .arg("--jail-share")
                .arg(sandbox.vm_dir())
                .args([
                    "--jail-uid",
                    &uid.to_string(),
                    "--jail-gid",
                    &uid.to_string(),
                ]);
        }
        command
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err_log)
            // Its own process group: a Ctrl-C meant for the manager does not stop its VMs.
            .process_group(0);
        let child = command.spawn().map_err(|source| ServeError::Io {
            what: "start",
            path: self.mayfly.display().to_string(),
            source,
        })?;
        let pid = child.id();
        let pidfd = mayfly_sys::pidfd::open(libc::pid_t::try_from(pid).unwrap_or(-1)).map_err(
            |source| ServeError::Io {
                what: "follow (pidfd_open) the VMM of",
                path: sandbox.name.clone(),
                source,
            },
        )?;
        let mut vmm = Vmm {
            pid,
            pidfd,
            child: Some(child),
        };
        // Saved before anything else: a manager killed from here on finds this process in
        // the record (and ends or adopts it) instead of leaving it running unowned.
        if let Err(e) = persist(pid, start_time(pid), guest_bytes) {
            vmm.kill();
            return Err(e);
        }
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if vmm.exited() {
                vmm.wait_exit(Duration::ZERO);
                return Err(ServeError::VmmFailed(format!(
                    "the VMM of {} ended before it answered: {}",
                    sandbox.name,
                    log_tail(&log_path)
                )));
            }
            if let Ok((200, _)) =
                mayfly_api::request_with_timeout(&sock, "GET", "/vm", None, Duration::from_secs(5))
            {
                return Ok(vmm);
            }
            if Instant::now() > deadline {
                vmm.kill();
                return Err(ServeError::VmmFailed(format!(
                    "the VMM of {} did not answer within {} s: {}",
                    sandbox.name,
                    START_TIMEOUT.as_secs(),
                    log_tail(&log_path)
                )));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Mark a sandbox whose VMM has ended on its own: suspended if it has a snapshot to wake
    /// from, dead if not.
    fn note_death(&self, sandbox: &Sandbox, inner: &mut Inner) {
        let Some(mut vmm) = inner.vmm.take() else {
            return;
        };
        vmm.wait_exit(Duration::ZERO);
        let status = vmm
            .child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
            .map(|s| format!(", {s}"))
            .unwrap_or_default();
        self.mark_dead(
            sandbox,
            &mut inner.record,
            &format!("(pid {}{status})", vmm.pid),
        );
        let _ = sandbox.save(inner);
    }

    /// Count a request for a sandbox as activity, wake it if it sleeps, and return its control
    /// socket: what the request is passed to. The activity lasts until the guard is dropped.
    pub fn enter<'a>(
        &'a self,
        sandbox: &'a Sandbox,
    ) -> Result<(Activity<'a>, PathBuf), ServeError> {
        sandbox.active.fetch_add(1, Ordering::SeqCst);
        let activity = Activity {
            sandbox,
            manager: self,
        };
        if sandbox.active.load(Ordering::SeqCst) > MAX_REQUESTS_PER_SANDBOX {
            return Err(ServeError::Busy(format!(
                "sandbox {} has {MAX_REQUESTS_PER_SANDBOX} requests in progress: try again \
                 once some have been answered",
                sandbox.name
            )));
        }
        sandbox.touch(self);
        self.ensure_running(sandbox, false)?;
        Ok((activity, sandbox.socket()))
    }

    /// Wake the sandbox if it sleeps (one wake however many ask at once).
    /// `back_to_snapshot`: a dead sandbox with a snapshot goes back to it (an explicit
    /// `PUT .../resume` only).
    pub fn ensure_running(
        &self,
        sandbox: &Sandbox,
        back_to_snapshot: bool,
    ) -> Result<(), ServeError> {
        let mut inner = lock(&sandbox.inner);
        if inner.record.state == State::Running && inner.vmm.as_ref().is_none_or(Vmm::exited) {
            self.note_death(sandbox, &mut inner);
        }
        match inner.record.state {
            State::Running => Ok(()),
            State::Suspended => self.wake(sandbox, &mut inner),
            State::Dead if back_to_snapshot && sandbox.snapshot_dir().is_dir() => {
                self.event("back_to_snapshot", &sandbox.name, json!({}));
                self.wake(sandbox, &mut inner)
            }
            State::Dead => Err(ServeError::Conflict(format!(
                "sandbox {} is dead: {}",
                sandbox.name,
                inner.record.died.as_deref().unwrap_or("its VMM ended")
            ))),
            State::Deleting => Err(ServeError::NotFound(format!(
                "sandbox {} is being deleted",
                sandbox.name
            ))),
            State::Starting | State::Suspending => Err(ServeError::Conflict(format!(
                "sandbox {} is {}: try again",
                sandbox.name,
                inner.record.state.name()
            ))),
        }
    }

    fn wake(&self, sandbox: &Sandbox, inner: &mut Inner) -> Result<(), ServeError> {
        let start = Instant::now();
        let spec = inner.record.spec.clone();
        let jail = inner.record.uid.filter(|_| inner.record.jailed);
        let started = self.start_vmm(sandbox, &spec, jail, true, &mut |pid, start, bytes| {
            inner.record.pid = Some(pid);
            inner.record.pid_start = start;
            inner.record.guest_bytes = Some(bytes);
            sandbox.save(inner)
        });
        match started {
            Ok(vmm) => {
                inner.vmm = Some(vmm);
                inner.record.died = None;
                inner.record.state = State::Running;
                inner.record.wakes += 1;
                // Paused by its user before it slept: paused again (its snapshot, taken paused,
                // restores running). If that fails it runs, and says so.
                if inner.record.vm_paused {
                    match mayfly_api::request_with_timeout(
                        &sandbox.socket(),
                        "PUT",
                        "/vm/pause",
                        None,
                        VMM_REQUEST_TIMEOUT,
                    ) {
                        Ok((status, _)) if status < 300 || status == 409 => {}
                        other => self.event(
                            "pause_not_kept",
                            &sandbox.name,
                            json!({ "error": format!("{other:?}") }),
                        ),
                    }
                    inner.record.vm_paused = false;
                }
                let asleep = inner
                    .record
                    .suspended_ms
                    .map(|t| now_ms().saturating_sub(t));
                inner.record.last_used_ms = now_ms();
                sandbox.save(inner)?;
                let took = start.elapsed();
                self.metrics.wake.observe(took);
                self.event(
                    "woke",
                    &sandbox.name,
                    json!({ "ms": took.as_secs_f64() * 1e3, "asleep_ms": asleep, "pid": inner.record.pid }),
                );
                Ok(())
            }
            Err(e) => {
                inner.record.pid = None;
                inner.record.pid_start = None;
                let _ = sandbox.save(inner);
                self.metrics.wakes_failed.fetch_add(1, Ordering::Relaxed);
                self.event(
                    "wake_failed",
                    &sandbox.name,
                    json!({ "error": e.to_string() }),
                );
                Err(e)
            }
        }
    }

    /// Put a running sandbox to sleep: snapshot it into its directory, then end its VMM (its
    /// RAM is freed). A sandbox already asleep stays so.
    pub fn suspend(&self, sandbox: &Sandbox) -> Result<(), ServeError> {
        let mut inner = lock(&sandbox.inner);
        self.suspend_locked(sandbox, &mut inner)
    }

    fn suspend_locked(&self, sandbox: &Sandbox, inner: &mut Inner) -> Result<(), ServeError> {
        if inner.record.state == State::Running && inner.vmm.as_ref().is_none_or(Vmm::exited) {
            self.note_death(sandbox, inner);
        }
        match inner.record.state {
            State::Running => {}
            State::Suspended => return Ok(()),
            other => {
                return Err(ServeError::Conflict(format!(
                    "sandbox {} is {}: only a running sandbox can be suspended",
                    sandbox.name,
                    other.name()
                )))
            }
        }
        let _writing =
            match self.check_disk_for_suspend(sandbox, inner.record.guest_bytes.unwrap_or(0)) {
                Ok(writing) => writing,
                Err(e) => {
                    self.event(
                        "suspend_refused",
                        &sandbox.name,
                        json!({ "error": e.to_string() }),
                    );
                    // The idle watch tries again after another idle timeout, not at its next
                    // pass.
                    sandbox.touch(self);
                    return Err(e);
                }
            };
        let start = Instant::now();
        inner.record.state = State::Suspending;
        sandbox.save(inner)?;
        let sock = sandbox.socket();
        let vmm_request = |method: &str, path: &str, body: Option<&Value>| {
            match mayfly_api::request_with_timeout(&sock, method, path, body, VMM_REQUEST_TIMEOUT) {
                Ok((status, _)) if status < 300 => Ok(()),
                Ok((status, body)) => Err(format!("{method} {path}: {status} {body}")),
                Err(e) => Err(format!("{method} {path}: {e}")),
            }
        };
        let snapshot = sandbox.snapshot_dir();
        // Paused first (a snapshot is of a paused VM); a VM paused through its own socket
        // already is, and says so with 409.
        let mut user_paused = false;
        let snapped = match mayfly_api::request_with_timeout(
            &sock,
            "PUT",
            "/vm/pause",
            None,
            VMM_REQUEST_TIMEOUT,
        ) {
            Ok((status, _)) if status < 300 => Ok(()),
            Ok((409, _)) => {
                user_paused = true;
                Ok(())
            }
            Ok((status, body)) => Err(format!("PUT /vm/pause: {status} {body}")),
            Err(e) => Err(format!("PUT /vm/pause: {e}")),
        }
        .and_then(|()| {
            // A diff over the snapshot it was restored from (its dirtied pages, not its RAM),
            // when that lies in its own `vm/` (its `base/`, or its own last sleep: a diff must
            // not name a file outside, which its next wake would refuse). A VMM that cannot
            // make one (a booted VM: its memory is no snapshot's) refuses before writing
            // anything, and a full snapshot is written instead.
            let take = |diff: bool| {
                mayfly_api::request_with_timeout(
                    &sock,
                    "PUT",
                    "/vm/snapshot",
                    Some(&json!({ "path": snapshot, "diff": diff })),
                    VMM_REQUEST_TIMEOUT,
                )
            };
            let diffable =
                inner.record.wakes > 0 || sandbox.vm_dir().join(crate::fork::BASE).is_dir();
            if diffable {
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
        let report = match snapped {
            Ok(report) => report,
            Err(e) => {
                // It keeps running as it was.
                let _ = vmm_request("PUT", "/vm/resume", None);
                inner.record.state = State::Running;
                let _ = sandbox.save(inner);
                self.metrics.suspends_failed.fetch_add(1, Ordering::Relaxed);
                self.event("suspend_failed", &sandbox.name, json!({ "error": e }));
                // The idle watch tries again after another idle timeout, not at its next pass.
                sandbox.touch(self);
                return Err(ServeError::VmmFailed(format!(
                    "could not snapshot sandbox {} to suspend it: {e}",
                    sandbox.name
                )));
            }
        };
        // The snapshot is on disk: the VMM may go however it goes.
        if let Some(mut vmm) = inner.vmm.take() {
            vmm.stop(&sock);
        }
        inner.record.state = State::Suspended;
        inner.record.pid = None;
        inner.record.pid_start = None;
        inner.record.vm_paused = user_paused;
        inner.record.suspends += 1;
        inner.record.suspended_ms = Some(now_ms());
        sandbox.save(inner)?;
        let took = start.elapsed();
        self.metrics.suspend.observe(took);
        self.event(
            "suspended",
            &sandbox.name,
            json!({
                "ms": took.as_secs_f64() * 1e3,
                "disk_bytes": disk_bytes(&snapshot),
                "memory_bytes_written": report.get("memory_bytes_written"),
                "memory_layers": report.get("memory_layers"),
                "compacted": report.get("compacted"),
            }),
        );
        Ok(())
    }

    /// End a sandbox's VMM and remove everything of it.
    pub fn delete(&self, sandbox: &Sandbox) -> Result<(), ServeError> {
        let inner = lock(&sandbox.inner);
        self.delete_locked(sandbox, inner)
    }

    fn delete_locked(
        &self,
        sandbox: &Sandbox,
        mut inner: MutexGuard<'_, Inner>,
    ) -> Result<(), ServeError> {
        // A delete that failed half-way (its directory could not be removed) may be tried
        // again: it starts over.
        inner.record.state = State::Deleting;
        sandbox.save(&inner)?;
        if let Some(mut vmm) = inner.vmm.take() {
            vmm.kill();
        }
        std::fs::remove_dir_all(&sandbox.dir).map_err(|source| ServeError::Io {
            what: "remove",
            path: sandbox.dir.display().to_string(),
            source,
        })?;
        drop(inner);
        lock(&self.sandboxes).remove(&sandbox.name);
        self.event("deleted", &sandbox.name, json!({}));
        Ok(())
    }

    /// A new token for the sandbox (the old one stops working), or none (`revoke`).
    pub fn set_token(&self, sandbox: &Sandbox, revoke: bool) -> Result<Option<String>, ServeError> {
        let mut inner = lock(&sandbox.inner);
        let token = if revoke {
            None
        } else {
            Some(new_token("mfs_")?)
        };
        inner.record.token_sha256 = token.as_deref().map(hash_token);
        sandbox.save(&inner)?;
        self.event(
            if revoke {
                "token_revoked"
            } else {
                "token_minted"
            },
            &sandbox.name,
            json!({}),
        );
        Ok(token)
    }

    /// One pass of the idle watch: suspend sandboxes idle past their timeout, notice VMMs
    /// that ended, reap.
    pub fn watch_once(self: &Arc<Self>) {
        self.collect_templates();
        let all: Vec<Arc<Sandbox>> = lock(&self.sandboxes).values().cloned().collect();
        for sandbox in all {
            let view = lock(&sandbox.view).clone();
            if view.state == State::Suspended {
                self.expire_if_due(&sandbox, &view);
                continue;
            }
            if view.state != State::Running {
                continue;
            }
            let idle_ms = self
                .uptime_ms()
                .saturating_sub(sandbox.last_used.load(Ordering::SeqCst));
            let idle = view.spec.idle_timeout_s.is_some_and(|t| {
                sandbox.active.load(Ordering::SeqCst) == 0 && idle_ms >= t.saturating_mul(1000)
            });
            // Each sandbox is looked after on a thread of its own (one at a time): a VMM slow
            // to snapshot or to die holds up only its own sandbox.
            if sandbox.watched.swap(true, Ordering::SeqCst) {
                continue;
            }
            let manager = Arc::clone(self);
            let watched = Arc::clone(&sandbox);
            let spawned = std::thread::Builder::new()
                .name("serve-watch".into())
                .spawn(move || {
                    manager.watch_sandbox(&watched, idle);
                    watched.watched.store(false, Ordering::SeqCst);
                });
            if spawned.is_err() {
                sandbox.watched.store(false, Ordering::SeqCst);
            }
        }
    }

    /// Delete a sandbox asleep past `--expire-after` (since its suspend or its last use),
    /// checked again under its lock: a request that woke it meanwhile keeps it.
    fn expire_if_due(&self, sandbox: &Sandbox, view: &Record) {
        let Some(after) = self.expire_after_ms else {
            return;
        };
        // Its last use: the record's, or a request since (a fork of it asleep, say), which
        // only the in-memory counter saw.
        let touched_ms = now_ms().saturating_sub(
            self.uptime_ms()
                .saturating_sub(sandbox.last_used.load(Ordering::SeqCst)),
        );
        let since = |r: &Record| {
            r.suspended_ms
                .unwrap_or(0)
                .max(r.last_used_ms)
                .max(touched_ms)
        };
        if now_ms().saturating_sub(since(view)) < after || sandbox.active.load(Ordering::SeqCst) > 0
        {
            return;
        }
        // Under its lock from the check to the delete: a request that wakes it meanwhile
        // either comes first (and it is not due) or finds it gone.
        let inner = match sandbox.inner.try_lock() {
            Ok(inner) => inner,
            Err(_) => return,
        };
        if inner.record.state != State::Suspended
            || now_ms().saturating_sub(since(&inner.record)) < after
            || sandbox.active.load(Ordering::SeqCst) != 0
        {
            return;
        }
        let asleep_ms = now_ms().saturating_sub(since(&inner.record));
        match self.delete_locked(sandbox, inner) {
            Ok(()) => {
                self.metrics.expired.fetch_add(1, Ordering::Relaxed);
                self.event("expired", &sandbox.name, json!({ "asleep_ms": asleep_ms }));
            }
            Err(e) => self.event(
                "expire_failed",
                &sandbox.name,
                json!({ "error": e.to_string() }),
            ),
        }
    }

    /// Collect templates unused past `--template-ttl` (looked at once a minute at most).
    fn collect_templates(&self) {
        let Some(ttl) = self.template_ttl else {
            return;
        };
        {
            let mut checked = lock(&self.templates_checked);
            if checked.is_some_and(|t| t.elapsed() < TEMPLATE_CHECK_EVERY.min(ttl)) {
                return;
            }
            *checked = Some(Instant::now());
        }
        let all: Vec<Arc<Sandbox>> = lock(&self.sandboxes).values().cloned().collect();
        let named: Vec<PathBuf> = all
            .iter()
            .filter_map(|s| lock(&s.view).spec.snapshot.clone())
            .collect();
        let in_use = |dir: &Path| named.iter().any(|snapshot| snapshot.starts_with(dir));
        for key in self.templates.collect_unused(ttl, &in_use) {
            self.event("template_collected", "", json!({ "template": key }));
        }
    }

    /// Notice a VMM that ended, or suspend a sandbox found idle (checked again under its lock).
    fn watch_sandbox(&self, sandbox: &Sandbox, idle: bool) {
        // Busy with a wake, suspend or delete: next time.
        let mut inner = match sandbox.inner.try_lock() {
            Ok(inner) => inner,
            Err(std::sync::TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return,
        };
        if inner.record.state != State::Running {
            return;
        }
        if inner.vmm.as_ref().is_none_or(Vmm::exited) {
            self.note_death(sandbox, &mut inner);
            return;
        }
        let idle_ms = self
            .uptime_ms()
            .saturating_sub(sandbox.last_used.load(Ordering::SeqCst));
        let still_idle = inner
            .record
            .spec
            .idle_timeout_s
            .is_some_and(|t| idle_ms >= t.saturating_mul(1000));
        if idle && still_idle && sandbox.active.load(Ordering::SeqCst) == 0 {
            self.event("idle", &sandbox.name, json!({ "idle_ms": idle_ms }));
            let _ = self.suspend_locked(sandbox, &mut inner);
        }
    }
}

/// The process a record names, if it is still that process: the same pid, started at the
/// same time (a pid used again by another process is never taken for it).
fn find_process(record: &Record) -> Option<Vmm> {
    let pid = record.pid?;
    if record.pid_start.is_none() || start_time(pid) != record.pid_start {
        return None;
    }
    let pidfd = mayfly_sys::pidfd::open(libc::pid_t::try_from(pid).ok()?).ok()?;
    // Checked again now that the pidfd is held: the pid cannot change hands from here on.
    if start_time(pid) != record.pid_start {
        return None;
    }
    Some(Vmm {
        pid,
        pidfd,
        child: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_dns_labels() {
        for good in ["a", "sbx-1", "0", &"x".repeat(63)] {
            assert!(valid_name(good), "{good}");
        }
        for bad in [
            "",
            "-a",
            "a-",
            "A",
            "a_b",
            "a.b",
            "a/b",
            "..",
            &"x".repeat(64),
            "é",
        ] {
            assert!(!valid_name(bad), "{bad}");
        }
    }

    #[test]
    fn specs_from_a_snapshot_take_nothing_else_and_paths_are_absolute() {
        let snap = Spec {
            snapshot: Some("/".into()),
            mem_mib: Some(64),
            ..Spec::default()
        };
        assert!(snap.check().unwrap_err().contains("alone"));
        let relative = Spec {
            kernel: Some("vmlinux".into()),
            ..Spec::default()
        };
        assert!(relative.check().unwrap_err().contains("absolute"));
        let missing = Spec {
            kernel: Some("/nonexistent/vmlinux".into()),
            ..Spec::default()
        };
        assert!(missing.check().unwrap_err().contains("does not exist"));
        let never = Spec {
            idle_timeout_s: Some(0),
            ..Spec::default()
        };
        assert!(never.check().unwrap_err().contains("at least 1"));
        assert!(Spec::default().check().is_ok());
        assert!(serde_json::from_value::<Spec>(json!({"kernal": "/x"})).is_err());
    }

    #[test]
    fn tokens_are_random_and_checked_by_hash() {
        let a = new_token("mfs_").unwrap();
        let b = new_token("mfs_").unwrap();
        assert_ne!(a, b);
        assert_eq!(a.len(), 4 + 64);
        assert!(same(hash_token(&a).as_bytes(), hash_token(&a).as_bytes()));
        assert!(!same(hash_token(&a).as_bytes(), hash_token(&b).as_bytes()));
    }

    #[test]
    fn a_process_start_time_tells_a_reused_pid_apart() {
        let me = std::process::id();
        assert!(start_time(me).is_some());
        assert_eq!(start_time(me), start_time(me));
        assert_eq!(start_time(u32::MAX), None);
    }
}
