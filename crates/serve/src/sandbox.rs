//! A sandbox as the manager holds it: its name and directory, its record (the one being
//! changed, under its own lock, so two wakes make one and a delete waits for a suspend; and
//! the one last saved, read without waiting), its running VMM, how recently it was used,
//! and starting its VMM. Requests passed to a running VMM do not hold its lock (an exec may
//! run for minutes); what changes its state is in [`crate::lifecycle`].

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use serde_json::{json, Value};

use crate::budget::Reserved;
use crate::cgroup::MemoryGroups;
use crate::error::ServeError;
use crate::files::{self, check_plain, BASE};
use crate::process::{self, Launch, Start, Vmm};
use crate::records::{write_record, Record, Spec, State, DEFAULT_MEM_MIB};
use crate::tokens::{canonical, token_matches};
use crate::util::{lock, now_ms};

/// What its lock guards: the record being changed, and its VMM while it runs.
pub struct Inner {
    pub record: Record,
    pub vmm: Option<Vmm>,
}

pub struct Sandbox {
    pub name: String,
    /// Its VMM's memory cgroup's name: `s-<name>` for a sandbox, `t-<name>` for a template's
    /// build (named `template-<key>`, which is also a name a sandbox may take): the two
    /// never share a group.
    pub group: String,
    dir: PathBuf,
    /// Its jail's uid (also in its record), fixed at its create: read without its lock.
    pub uid: Option<u32>,
    pub inner: Mutex<Inner>,
    /// The record as last saved: what describe, list, metrics and token checks read, so they
    /// never wait behind a wake or a suspend (which hold `inner` for as long as they take).
    pub view: Mutex<Record>,
    /// Requests being passed to its VMM and connections to its exposed ports: it is not idle
    /// while one runs.
    pub active: AtomicUsize,
    /// The requests among them (API calls, not port connections): what the cap on requests
    /// at once counts, so that connections to its ports never crowd out its API.
    pub requests: AtomicUsize,
    /// Connections relayed to its exposed ports now, all ports together (see `ports.rs`).
    pub connections: AtomicUsize,
    /// The idle watch is looking after it (on a thread of its own).
    pub watched: AtomicBool,
    /// The manager's monotonic clock at its last request, in ms since the manager started.
    pub last_used: AtomicU64,
}

/// What starting a VMM takes from whoever starts it (the manager): the mayfly binary, the
/// state directory (a snapshot under it was written by a VMM, and is checked before a
/// restore), and the memory budget: `reserve` holds a start's memory (guest memory and the
/// VMM's allowance, by the name of what starts) until the start is over; the limits every
/// VMM gets (its memory cgroup, its console's size).
pub struct Launcher<'a, 'r> {
    pub mayfly: &'a Path,
    pub state_dir: &'a Path,
    pub reserve: &'a dyn Fn(&str, u64) -> Reserved<'r>,
    /// Abort right after a VMM is started (`--crash-at after-spawn`; tests).
    pub crash_after_spawn: bool,
    /// What a VMM may hold beside its guest's memory (`--vmm-allowance-mib`), bytes.
    pub allowance: u64,
    pub groups: &'a MemoryGroups,
    /// `--console-limit`, bytes.
    pub console_limit: u64,
    /// Where networks are made (`--net-*` arguments for every VMM).
    pub net_args: &'a [String],
    /// Told before a VMM with a network starts (kept filled from then), and where it says so.
    pub net_pool: &'a std::sync::Arc<crate::netpool::NetPool>,
    pub events: &'a std::sync::Arc<crate::events::EventLog>,
}

impl Sandbox {
    /// A sandbox of `record` in `dir`, last used at `now` (the manager's clock, ms).
    pub fn new(dir: PathBuf, record: Record, now: u64) -> Sandbox {
        Sandbox {
            name: record.name.clone(),
            group: format!("s-{}", record.name),
            dir,
            uid: record.uid,
            view: Mutex::new(record.clone()),
            inner: Mutex::new(Inner { record, vmm: None }),
            active: AtomicUsize::new(0),
            requests: AtomicUsize::new(0),
            connections: AtomicUsize::new(0),
            watched: AtomicBool::new(false),
            last_used: AtomicU64::new(now),
        }
    }

    /// A sandbox no one knows by name, for a VMM of the manager's own (a template's build).
    pub fn detached(name: &str, dir: &Path, uid: Option<u32>) -> Sandbox {
        let record = Record {
            name: name.to_owned(),
            spec: Spec::default(),
            state: State::Starting,
            token_sha256: None,
            token_expires_ms: None,
            credential: Default::default(),
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
            fork: None,
            ports: Vec::new(),
            net_policy: None,
        };
        let mut sandbox = Sandbox::new(dir.to_path_buf(), record, 0);
        sandbox.group = format!("t-{name}");
        sandbox
    }

    /// A request for it now (the manager's clock, ms).
    pub fn touch(&self, now: u64) {
        self.last_used.store(now, Ordering::SeqCst);
    }

    /// How long it has been idle at `now` (the manager's clock, ms).
    pub fn idle_ms(&self, now: u64) -> u64 {
        now.saturating_sub(self.last_used.load(Ordering::SeqCst))
    }

    /// Its directory: everything of it.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Its VMM's control socket (see [`files::socket`]).
    pub fn socket(&self) -> PathBuf {
        files::socket(&self.dir)
    }

    /// What its jailed VMM shares and writes (see [`files::vm_dir`]).
    pub fn vm_dir(&self) -> PathBuf {
        files::vm_dir(&self.dir)
    }

    pub fn snapshot_dir(&self) -> PathBuf {
        files::snapshot_dir(&self.dir)
    }

    /// What it was made from, as last saved.
    pub fn spec(&self) -> Spec {
        lock(&self.view).spec.clone()
    }

    /// Whether its VMM runs jailed (fixed at its create).
    pub fn jailed(&self) -> bool {
        lock(&self.view).jailed
    }

    /// Whether `token` is this sandbox's, in the one spelling it was given in, and it has
    /// neither been revoked nor expired.
    pub fn token_is(&self, token: &str) -> bool {
        let view = lock(&self.view);
        let live = view.token_expires_ms.is_none_or(|at| now_ms() < at);
        // Both checks always run: the time taken says nothing about which one failed.
        let matches = view
            .token_sha256
            .as_deref()
            .is_some_and(|hash| token_matches(hash, token));
        canonical("mfs_", token) & matches & live
    }

    /// What `GET /sandboxes/NAME` answers, at `now` (the manager's clock, ms).
    pub fn describe(&self, now: u64) -> Value {
        let r = lock(&self.view).clone();
        let idle_ms = self.idle_ms(now);
        json!({
            "name": r.name,
            "state": r.state.name(),
            "spec": r.spec,
            "pid": r.pid,
            "socket": self.socket(),
            "console": files::console_log(&self.dir),
            "created_ms": r.created_ms,
            "last_used_ms": r.last_used_ms,
            "idle_ms": idle_ms,
            "suspended_ms": r.suspended_ms,
            "wakes": r.wakes,
            "suspends": r.suspends,
            "token": match (&r.token_sha256, r.token_expires_ms) {
                (None, _) => "revoked",
                (Some(_), Some(at)) if now_ms() >= at => "expired",
                (Some(_), _) => "set",
            },
            "token_expires_ms": r.token_expires_ms,
            "credential": {
                "revoked": r.credential.revoked,
                "audience": r.credential.audience,
                "expires_ms": r.credential.expires_ms,
            },
            "died": r.died,
            "jailed": r.jailed,
            "uid": r.uid,
        })
    }

    /// Save the record being changed: the view readers see, and the file on disk.
    pub fn save(&self, inner: &Inner) -> Result<(), ServeError> {
        *lock(&self.view) = inner.record.clone();
        write_record(&self.dir, &inner.record)
    }

    /// Save a detached sandbox's VMM in its record right after it started (see
    /// [`Sandbox::start_vmm`]), so that a manager killed meanwhile can end it at its restart.
    pub fn save_started(&self, pid: u32, start: Option<u64>) -> Result<(), ServeError> {
        let mut inner = lock(&self.inner);
        inner.record.pid = Some(pid);
        inner.record.pid_start = start;
        self.save(&inner)
    }

    /// Start its VMM (a boot, or a restore of its own snapshot when `wake`) and wait for its
    /// control socket to answer. `persist` is given the VMM's pid, start time and guest
    /// memory as soon as it runs.
    pub fn start_vmm(
        &self,
        launcher: &Launcher<'_, '_>,
        spec: &Spec,
        jail_uid: Option<u32>,
        wake: bool,
        persist: &mut dyn FnMut(u32, Option<u64>, u64) -> Result<(), ServeError>,
    ) -> Result<Vmm, ServeError> {
        let sock = self.socket();
        let log_path = files::vmm_log(&self.dir);
        let log = process::open_log(&log_path)?;
        let restore_from = if wake {
            Some(self.snapshot_dir())
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
                .unwrap_or(DEFAULT_MEM_MIB)
                .saturating_mul(1 << 20),
        };
        // The budget counts, and the VMM's memory cgroup allows, its guest memory and the
        // VMM's own allowance.
        let memory_limit = guest_bytes.saturating_add(launcher.allowance);
        let _reservation = (launcher.reserve)(&self.name, memory_limit)?;
        // A wake gets the policy the jail's waiter last said, not the snapshot's (which its
        // VMM wrote).
        let kept_policy = if wake {
            lock(&self.view).net_policy.clone()
        } else {
            None
        };
        if spec.net.is_some() || kept_policy.is_some() {
            launcher.net_pool.want(launcher.events);
        }
        let start = match &restore_from {
            Some(snapshot) => {
                // A snapshot the manager keeps was written by a VMM (jailed, perhaps
                // compromised): root restores it only if it holds nothing but plain files.
                if snapshot.starts_with(launcher.state_dir) {
                    check_plain(snapshot)?;
                    check_plain(&self.vm_dir().join("disks"))?;
                    check_plain(&self.vm_dir().join(BASE))?;
                }
                // The snapshot's policy is kept on wake; a first restore may set one.
                Start::Restore {
                    snapshot,
                    net: if wake {
                        kept_policy.as_deref()
                    } else {
                        spec.net.as_deref()
                    },
                    // A fork's clone is not its source: its NIC gets a MAC of its own (kept
                    // by its snapshots from then on).
                    new_mac: !wake && lock(&self.view).fork.is_some(),
                }
            }
            None => Start::Boot(spec.run_args()),
        };
        let vm_dir = self.vm_dir();
        let console = files::console_log(&self.dir);
        let how = Launch {
            mayfly: launcher.mayfly,
            name: &self.name,
            group: &self.group,
            start,
            sock: &sock,
            console: &console,
            log_path: &log_path,
            vm_dir: &vm_dir,
            jail_uid,
            crash_after_spawn: launcher.crash_after_spawn,
            memory_limit,
            groups: launcher.groups,
            console_limit: launcher.console_limit,
            net_args: launcher.net_args,
        };
        process::launch(&how, log, &mut |pid, start| {
            persist(pid, start, guest_bytes)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_template_build_and_a_sandbox_of_its_name_have_memory_groups_of_their_own() {
        let dir = Path::new("/nonexistent");
        let build = Sandbox::detached("template-0123456789abcdef", dir, None);
        let record = build.view.lock().expect("its record").clone();
        let sandbox = Sandbox::new(dir.to_path_buf(), record, 0);
        assert_eq!(build.name, sandbox.name);
        assert_ne!(build.group, sandbox.group);
    }
}
