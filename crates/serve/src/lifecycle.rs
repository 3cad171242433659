//! A sandbox's life cycle, one state machine: each method here moves a sandbox between the
//! states of [`State`], under that sandbox's own lock, saving its record at every step.
//!
//! | from                  | to                     | by                                           |
//! |-----------------------|------------------------|----------------------------------------------|
//! | (none)                | Starting → Running     | `create` (removed again if its VMM fails)    |
//! | Running               | Suspending → Suspended | `suspend` (`PUT .../pause`, the idle watch, make-room); back to Running if the snapshot fails |
//! | Suspended             | Running                | `ensure_running`, `enter` (a wake)           |
//! | Running               | Dead                   | `note_death`, `mark_dead`: its VMM ended unasked |
//! | Dead, with a snapshot | Running                | `ensure_running` `back_to_snapshot` (`PUT .../resume` only) |
//! | any                   | Deleting → gone        | `delete` (`DELETE`, the idle watch's expiry) |
//! | Running               | Suspended → Running    | `fork_snapshot`: a running source sleeps for its snapshot, then wakes |
//!
//! Each of them first notices a VMM that ended on its own (Running → Dead). A create, a
//! wake's VMM start and a delete are journaled before their first step (see
//! [`crate::journal`]), and a manager's start (see [`crate::recovery`]) finishes what a crash
//! left: a journaled create undone, a delete finished, a wake's unrecorded VMM ended;
//! Starting and Deleting → gone, Running and Suspending → Running (adopted) or Dead. A start reserves memory here too
//! ([`Manager::reserve_memory`]: with make-room, the longest-idle sandboxes sleep first), and
//! a suspend disk.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::budget::Reserved;
use crate::config::CrashPoint;
use crate::error::ServeError;
use crate::files::{self, check_plain, link_base, link_snapshot, make_dirs, BASE};
use crate::journal::{Intent, Pending};
use crate::manager::Manager;
use crate::process::{log_tail, pause_and_snapshot, Vmm, STOP_TIMEOUT, VMM_REQUEST_TIMEOUT};
use crate::records::{valid_name, CredentialState, Record, Spec, State, RECORD};
use crate::sandbox::{Inner, Launcher, Sandbox};
use crate::tokens::{hash_token, new_token};
use crate::util::{expires_at, io_error, lock, now_ms};

/// Requests passed to one sandbox's VMM at once: a VMM that stalls holds at most these of the
/// manager's connections.
const MAX_REQUESTS_PER_SANDBOX: usize = 64;
/// How long a VMM that could not be reached is given to end, before it is taken for alive.
const VMM_ENDING: Duration = Duration::from_millis(500);

/// A uid a template build runs as, given back to the pool when dropped.
struct BuildUid<'a> {
    manager: &'a Manager,
    uid: u32,
}

impl Drop for BuildUid<'_> {
    fn drop(&mut self) {
        lock(&self.manager.build_uids).remove(&self.uid);
    }
}

/// A request in flight for a sandbox: it counts as activity until dropped.
pub struct Activity<'a> {
    sandbox: &'a Sandbox,
    manager: &'a Manager,
    /// A request (counted in `requests` too), not a port connection.
    request: bool,
}

impl Drop for Activity<'_> {
    fn drop(&mut self) {
        self.sandbox.touch(self.manager.uptime_ms());
        if self.request {
            self.sandbox.requests.fetch_sub(1, Ordering::SeqCst);
        }
        self.sandbox.active.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Manager {
    /// Make a sandbox and start its VMM; returns its description and its token (which
    /// expires after `token_ttl_s`, if given). Nothing of it is left if it fails, nor if the
    /// manager is killed before it returns (its journal entry has the next start undo it).
    pub fn create(
        &self,
        name: &str,
        spec: Spec,
        token_ttl_s: Option<u64>,
    ) -> Result<(Value, String), ServeError> {
        self.create_for(name, spec, token_ttl_s, None)
    }

    /// [`Manager::create`], for the fork `fork` when given (its record names the fork, which
    /// the next start undoes whole if the manager is killed before it answered).
    pub(crate) fn create_for(
        &self,
        name: &str,
        mut spec: Spec,
        token_ttl_s: Option<u64>,
        fork: Option<&str>,
    ) -> Result<(Value, String), ServeError> {
        let dir = self.new_sandbox_dir(name)?;
        spec.check().map_err(ServeError::BadRequest)?;
        // A fork's clones take the source's policy, checked once for them all (see `fork.rs`);
        // a template's, only if it is built (see below).
        if fork.is_none() {
            self.check_names("\"net\"", spec.net.as_deref())?;
        }
        if let Some(template) = &mut spec.template {
            // A guest without the agent is not waited for, nor is its template's (the record
            // keeps the template as built: its key says which one it uses).
            template.no_agent |= spec.no_agent;
        }
        if let Some(template) = &spec.template {
            // Built (or found) before the name is taken: a build may take a while. A build
            // runs as a uid of its own from the sandboxes' pool, given back when it is over.
            let builder = if self.jail {
                Some(self.take_build_uid()?)
            } else {
                None
            };
            let reserve = |name: &str, bytes| self.reserve_memory(name, bytes);
            spec.snapshot = Some(self.templates.snapshot_for(
                &self.launcher(&reserve),
                &self.events,
                template,
                builder.as_ref().map(|b| b.uid),
                &|| self.check_names("\"template.net\"", template.net.as_deref()),
            )?);
            // Its NIC gets the policy its create names, never the template's setup's: none
            // (it reaches nothing) unless the create says otherwise. A template without a NIC
            // makes sandboxes without one (a create's "none" says the same).
            if template.has_nic() && spec.net.is_none() {
                spec.net = Some("none".into());
            } else if !template.has_nic() {
                spec.net = None;
            }
        }
        let now = now_ms();
        let (sandbox, token) = self.take_name(name, &dir, spec, token_ttl_s, fork, now)?;
        let start = Instant::now();
        let mut inner = lock(&sandbox.inner);
        // Written before anything is made: a manager killed from here until the create
        // returns leaves this entry, and the next start undoes the create (its VMM ended, its
        // directory removed, its name and uid free again; its token was never handed out).
        let intent = match self.journal.begin(&Intent::Create {
            name: name.to_owned(),
            uid: inner.record.uid,
            created_ms: now,
        }) {
            Ok(intent) => intent,
            Err(e) => {
                drop(inner);
                lock(&self.sandboxes).remove(name);
                return Err(e);
            }
        };
        let made = (|| {
            make_dirs(&dir, inner.record.uid.filter(|_| inner.record.jailed))?;
            self.crash_point(CrashPoint::AfterMkdir);
            sandbox.save(&inner)?;
            // A snapshot to restore is linked into the sandbox's own `vm/base/` (nothing is
            // copied): the layers its disks stack on are then inside what its jail sees, its
            // later snapshots can name them, and the template or fork base it came from can
            // go while it lives.
            if let Some(snapshot) = inner.record.spec.snapshot.clone() {
                if let Some(base) = link_base(&snapshot, &sandbox.vm_dir())? {
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
            // A waiter that cannot say leaves a NIC that reaches nothing after a wake: closed,
            // not whatever the VMM's snapshot says.
            inner.record.net_policy = self
                .kept_policy(&sandbox)
                .unwrap_or_else(|| Some("none".into()));
            sandbox.save(&inner)
        })();
        // Its entry gone before it answers: one left would have the next start undo it.
        let mut intent = Some(intent);
        let made = made.and_then(|()| intent.take().map_or(Ok(()), Pending::done));
        if let Err(e) = made {
            if let Some(mut vmm) = inner.vmm.take() {
                vmm.kill();
            }
            let _ = std::fs::remove_dir_all(&dir);
            drop(inner);
            lock(&self.sandboxes).remove(name);
            self.metrics.creates_failed.fetch_add(1, Ordering::Relaxed);
            self.event("create_failed", name, json!({ "error": e.to_string() }));
            drop(intent);
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
        Ok((self.describe(&sandbox), token))
    }

    /// The directory of a new sandbox `name`: refused if the name is no sandbox name (400),
    /// is taken, or would make its sockets' paths too long (409).
    pub(crate) fn new_sandbox_dir(&self, name: &str) -> Result<PathBuf, ServeError> {
        if !valid_name(name) {
            return Err(ServeError::BadRequest(format!(
                "{name:?} is not a sandbox name: use 1 to 63 lower-case letters, digits and \
                 hyphens, not starting or ending with a hyphen (a DNS label)"
            )));
        }
        let dir = self.dir.join("sandboxes").join(name);
        // The path its VMM binds (see files::socket), and the vsock socket beside it, the
        // longest path the VMM binds: `<api-sock>.vsock_<port>`.
        let longest = longest_socket_path(&dir);
        // A valid name, too long for where this manager keeps its sandboxes: a conflict with
        // its --state-dir, not a bad request.
        if longest > mayfly_sys::socket::MAX_SOCKET_PATH {
            return Err(ServeError::Conflict(format!(
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
        Ok(dir)
    }

    /// Take `name` for a new sandbox of `spec` in `dir` (under the map's lock, before
    /// anything is made on disk), with a new token (returned) and credential ID, and, jailed,
    /// the lowest uid from the base that no other sandbox has. Its record says Starting.
    pub(crate) fn take_name(
        &self,
        name: &str,
        dir: &Path,
        spec: Spec,
        token_ttl_s: Option<u64>,
        fork: Option<&str>,
        now: u64,
    ) -> Result<(Arc<Sandbox>, String), ServeError> {
        let token = new_token("mfs_")?;
        let credential_id = new_token("mci_")?;
        let sandbox = {
            let mut all = lock(&self.sandboxes);
            if all.contains_key(name) || dir.exists() {
                return Err(ServeError::Conflict(format!(
                    "a sandbox named {name} exists: pick another name, or delete it first"
                )));
            }
            let uid = if self.jail {
                Some(self.free_uid(&all)?)
            } else {
                None
            };
            let record = Record {
                name: name.to_owned(),
                spec,
                state: State::Starting,
                token_sha256: Some(hash_token(&token)),
                token_expires_ms: token_ttl_s.map(|ttl| expires_at(now, ttl)),
                credential: CredentialState {
                    id: Some(credential_id),
                    ..CredentialState::default()
                },
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
                fork: fork.map(str::to_owned),
                ports: Vec::new(),
                net_policy: None,
            };
            let sandbox = Arc::new(Sandbox::new(dir.to_path_buf(), record, self.uptime_ms()));
            all.insert(name.to_owned(), Arc::clone(&sandbox));
            sandbox
        };
        Ok((sandbox, token))
    }

    /// Refuse (400) a create from a request whose files are not in this manager's images
    /// directories (see [`crate::images`]): its snapshot, kernel, initrd and root filesystem
    /// image, and its template's. A fork's clones (made from a base of the manager's own)
    /// are not requests.
    pub fn confine(&self, spec: &Spec) -> Result<(), ServeError> {
        if let Some(snapshot) = &spec.snapshot {
            self.images.check_snapshot(snapshot)?;
        }
        let template = spec.template.as_ref();
        let image =
            |rootfs: Option<&String>| rootfs.filter(|r| r.as_str() != "debian").map(PathBuf::from);
        for (what, path) in [
            ("kernel", spec.kernel.clone()),
            ("initrd", spec.initrd.clone()),
            ("rootfs", image(spec.rootfs.as_ref())),
            ("template.kernel", template.and_then(|t| t.kernel.clone())),
            ("template.initrd", template.and_then(|t| t.initrd.clone())),
            (
                "template.rootfs",
                image(template.and_then(|t| t.rootfs.as_ref())),
            ),
        ] {
            if let Some(path) = path {
                self.images.check_file(what, &path)?;
            }
        }
        Ok(())
    }

    /// What starting a VMM takes from this manager, its memory budget held through `reserve`.
    fn launcher<'a, 'r>(
        &'a self,
        reserve: &'a dyn Fn(&str, u64) -> Reserved<'r>,
    ) -> Launcher<'a, 'r> {
        Launcher {
            mayfly: &self.mayfly,
            state_dir: &self.dir,
            reserve,
            crash_after_spawn: self.crash_at == Some(CrashPoint::AfterSpawn),
            allowance: self.allowance,
            groups: &self.groups,
            console_limit: self.console_limit,
            net_args: &self.net_args,
            net_pool: &self.net_pool,
            events: &self.events,
        }
    }

    /// A uid for a template build: the lowest of the sandboxes' pool no sandbox and no other
    /// build has, held until the returned guard drops.
    fn take_build_uid(&self) -> Result<BuildUid<'_>, ServeError> {
        let all = lock(&self.sandboxes);
        let uid = self.free_uid(&all)?;
        lock(&self.build_uids).insert(uid);
        Ok(BuildUid { manager: self, uid })
    }

    /// Every name in a policy (`field` says which: a create's `"net"`, its template's, a fork
    /// source's) resolves, as its VMM will resolve it (`--net-dns` from `--net-uplink`),
    /// before a VMM or a template build is spent on it: 400 with the resolver's answer if a
    /// name has no IPv4 address, 503 if the resolver did not answer (try again).
    pub(crate) fn check_names(&self, field: &str, net: Option<&str>) -> Result<(), ServeError> {
        // One that does not parse was refused already (`Spec::check`).
        let Some(Ok(policy)) = net.map(str::parse::<mayfly_network::Policy>) else {
            return Ok(());
        };
        self.net_names.check(&policy).map_err(|e| match e.fault() {
            mayfly_network::Fault::Request => ServeError::BadRequest(format!("{field}: {e}")),
            mayfly_network::Fault::Resolver => ServeError::Busy(format!("{field}: {e}")),
            mayfly_network::Fault::Host => ServeError::Network(e),
        })
    }

    /// A jailed sandbox's NIC's policy as its jail's waiter says it (`GET /vm/net` on its
    /// `.net` socket): `Some(None)` without a NIC (no such socket) or unjailed, `None` if the
    /// waiter does not answer.
    pub(crate) fn kept_policy(&self, sandbox: &Sandbox) -> Option<Option<String>> {
        if !sandbox.jailed() {
            return Some(None);
        }
        let kept = mayfly_api::network_socket(&sandbox.socket());
        if !kept.exists() {
            return Some(None);
        }
        match mayfly_api::request_with_timeout(
            &kept,
            "GET",
            "/vm/net",
            None,
            std::time::Duration::from_secs(10),
        ) {
            Ok((200, net)) => net["policy"].as_str().map(|p| Some(p.to_owned())),
            _ => None,
        }
    }

    /// After the admin changed a jailed sandbox's policy: its record keeps the policy its
    /// waiter now has (what its next wake and its clones get).
    pub(crate) fn note_policy(&self, sandbox: &Sandbox) {
        let Some(Some(policy)) = self.kept_policy(sandbox) else {
            return;
        };
        let mut inner = lock(&sandbox.inner);
        if inner.record.net_policy.as_deref() != Some(policy.as_str()) {
            inner.record.net_policy = Some(policy);
            if let Err(e) = sandbox.save(&inner) {
                self.event(
                    "record_write_failed",
                    &sandbox.name,
                    json!({ "op": "net_policy", "error": e.to_string() }),
                );
            }
        }
    }

    /// Start a sandbox's VMM (a boot, or a restore of its own snapshot when `wake`) within the
    /// memory budget (see [`Sandbox::start_vmm`]).
    fn start_vmm(
        &self,
        sandbox: &Sandbox,
        spec: &Spec,
        jail_uid: Option<u32>,
        wake: bool,
        persist: &mut dyn FnMut(u32, Option<u64>, u64) -> Result<(), ServeError>,
    ) -> Result<Vmm, ServeError> {
        let reserve = |name: &str, bytes| self.reserve_memory(name, bytes);
        sandbox.start_vmm(&self.launcher(&reserve), spec, jail_uid, wake, persist)
    }

    /// What every VMM start (a create, a wake, a fork's clone, a template build) passes:
    /// the disk budget not spent already (what sandboxes keep, running ones' disk layers
    /// included, measured now), then `bytes` of the memory budget held for `name`'s VMM (see
    /// [`crate::budget::MemoryBudget::reserve`]); with make-room, the longest-idle running
    /// sandboxes are put to sleep first.
    pub(crate) fn reserve_memory(&self, name: &str, bytes: u64) -> Reserved<'_> {
        self.disk
            .check_start(name, &self.metrics, &|| self.disk_in_use())?;
        self.memory.reserve(
            name,
            bytes,
            &self.metrics,
            &|| self.memory_in_use(),
            &|shortfall, tried| {
                self.longest_idle(name, shortfall, tried)
                    .map(|victim| (victim.name.clone(), victim))
            },
            &|victim| self.suspend_for_room(&victim, name, bytes),
        )
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
            .map(|(_, s)| {
                lock(&s.view)
                    .guest_bytes
                    .unwrap_or(0)
                    .saturating_add(self.allowance)
            })
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
        let idle_ms = sandbox.idle_ms(self.uptime_ms());
        self.event(
            "making_room",
            &sandbox.name,
            json!({ "for": for_name, "needs_bytes": bytes, "idle_ms": idle_ms }),
        );
        if self.suspend_locked(sandbox, &mut inner).is_ok() {
            self.metrics.made_room.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A snapshot of `source` at `into` for a fork (see [`crate::fork`]), checked to hold
    /// plain files only, linked there and given to `prepare`: a running sandbox is suspended
    /// first (its snapshot in its own `vm/snap/`, its VMM ended) and woken again afterwards
    /// (paused again if its user had paused it); a sleeping one stays asleep.
    pub fn fork_snapshot(
        &self,
        source: &Sandbox,
        into: &Path,
        prepare: &dyn Fn(&Path) -> Result<(), ServeError>,
    ) -> Result<(), ServeError> {
        let mut inner = lock(&source.inner);
        if inner.record.state == State::Running && inner.vmm.as_ref().is_none_or(Vmm::exited) {
            self.note_death(source, &mut inner);
        }
        source.touch(self.uptime_ms());
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
            .and_then(|()| link_snapshot(&snapshot, into))
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

    /// A sandbox whose VMM ended without being asked is dead: what ran since its last wake is
    /// gone. Its last snapshot (if it has one) is kept, older than what it lost, and woken
    /// from only on an explicit `PUT .../resume`, never behind a request's back.
    pub(crate) fn mark_dead(&self, sandbox: &Sandbox, record: &mut Record, when: &str) {
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
        let log = log_tail(&crate::files::vmm_log(sandbox.dir()));
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

    /// Mark a sandbox whose VMM has ended on its own: suspended if it has a snapshot to wake
    /// from, dead if not.
    pub(crate) fn note_death(&self, sandbox: &Sandbox, inner: &mut Inner) {
        let Some(mut vmm) = inner.vmm.take() else {
            return;
        };
        vmm.wait_exit(Duration::ZERO);
        let status = vmm
            .exit_status()
            .map(|s| format!(", {s}"))
            .unwrap_or_default();
        self.mark_dead(
            sandbox,
            &mut inner.record,
            &format!("(pid {}{status})", vmm.pid()),
        );
        let _ = sandbox.save(inner);
    }

    /// Count a request for a sandbox as activity, wake it if it sleeps, and return its control
    /// socket: what the request is passed to. The activity lasts until the guard is dropped.
    pub fn enter<'a>(
        &'a self,
        sandbox: &'a Sandbox,
    ) -> Result<(Activity<'a>, PathBuf), ServeError> {
        self.enter_as(sandbox, true)
    }

    /// [`Manager::enter`] for a connection to one of its exposed ports: activity as a request
    /// is (it keeps the sandbox awake while open), but not counted against the cap on
    /// requests at once (each port has its own cap on connections, see `ports.rs`).
    pub fn enter_connection<'a>(
        &'a self,
        sandbox: &'a Sandbox,
    ) -> Result<(Activity<'a>, PathBuf), ServeError> {
        self.enter_as(sandbox, false)
    }

    fn enter_as<'a>(
        &'a self,
        sandbox: &'a Sandbox,
        request: bool,
    ) -> Result<(Activity<'a>, PathBuf), ServeError> {
        sandbox.active.fetch_add(1, Ordering::SeqCst);
        if request {
            sandbox.requests.fetch_add(1, Ordering::SeqCst);
        }
        let activity = Activity {
            sandbox,
            manager: self,
            request,
        };
        if request && sandbox.requests.load(Ordering::SeqCst) > MAX_REQUESTS_PER_SANDBOX {
            return Err(ServeError::Busy(format!(
                "sandbox {} has {MAX_REQUESTS_PER_SANDBOX} requests in progress: try again \
                 once some have been answered",
                sandbox.name
            )));
        }
        sandbox.touch(self.uptime_ms());
        self.ensure_running(sandbox, false)?;
        Ok((activity, sandbox.socket()))
    }

    /// After its VMM could not be reached (or closed a connection without an answer): if it
    /// has ended, or ends within a moment (a VMM that just died lets go of its socket before
    /// its process is gone), the sandbox is dead, and the error says so as
    /// [`Manager::ensure_running`] does; Ok if it still runs (the fault is then elsewhere).
    pub fn check_vmm_alive(&self, sandbox: &Sandbox) -> Result<(), ServeError> {
        let mut inner = lock(&sandbox.inner);
        if inner.record.state == State::Running {
            let ended = inner
                .vmm
                .as_mut()
                .is_none_or(|vmm| vmm.wait_exit(VMM_ENDING));
            if !ended {
                return Ok(());
            }
            self.note_death(sandbox, &mut inner);
        }
        match inner.record.state {
            State::Running | State::Suspended => Ok(()),
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
        // Until its pid is in its record, a VMM started here is known only to the journal
        // (the next start ends it by its socket if the manager is killed meanwhile).
        let mut intent = Some(self.journal.begin(&Intent::Spawn {
            name: sandbox.name.clone(),
        })?);
        let started = self.start_vmm(sandbox, &spec, jail, true, &mut |pid, start, bytes| {
            inner.record.pid = Some(pid);
            inner.record.pid_start = start;
            inner.record.guest_bytes = Some(bytes);
            let saved = sandbox.save(inner);
            if saved.is_ok() {
                intent = None;
            }
            saved
        });
        drop(intent);
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

    pub(crate) fn suspend_locked(
        &self,
        sandbox: &Sandbox,
        inner: &mut Inner,
    ) -> Result<(), ServeError> {
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
        let _writing = match self.disk.reserve_for_suspend(
            &sandbox.name,
            inner.record.guest_bytes.unwrap_or(0),
            &self.metrics,
            &|| self.disk_in_use(),
        ) {
            Ok(writing) => writing,
            Err(e) => {
                self.event(
                    "suspend_refused",
                    &sandbox.name,
                    json!({ "error": e.to_string() }),
                );
                // The idle watch tries again after another idle timeout, not at its next
                // pass.
                sandbox.touch(self.uptime_ms());
                return Err(e);
            }
        };
        let start = Instant::now();
        inner.record.state = State::Suspending;
        sandbox.save(inner)?;
        let sock = sandbox.socket();
        let snapshot = sandbox.snapshot_dir();
        // A diff over the snapshot it was restored from when that lies in its own `vm/` (its
        // `base/`, or its own last sleep: a diff must not name a file outside, which its next
        // wake would refuse).
        let wakes = inner.record.wakes;
        let (user_paused, snapped) = pause_and_snapshot(&sock, &snapshot, || {
            wakes > 0 || sandbox.vm_dir().join(BASE).is_dir()
        });
        let report = match snapped {
            Ok(report) => report,
            Err(e) => {
                // It keeps running as it was.
                let _ = mayfly_api::request_with_timeout(
                    &sock,
                    "PUT",
                    "/vm/resume",
                    None,
                    VMM_REQUEST_TIMEOUT,
                );
                inner.record.state = State::Running;
                let _ = sandbox.save(inner);
                self.metrics.suspends_failed.fetch_add(1, Ordering::Relaxed);
                self.event("suspend_failed", &sandbox.name, json!({ "error": e }));
                // The idle watch tries again after another idle timeout, not at its next pass.
                sandbox.touch(self.uptime_ms());
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
                "disk_bytes": crate::files::disk_bytes(&snapshot),
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

    pub(crate) fn delete_locked(
        &self,
        sandbox: &Sandbox,
        mut inner: MutexGuard<'_, Inner>,
    ) -> Result<(), ServeError> {
        // A delete that failed half-way (its directory could not be removed) may be tried
        // again: it starts over. Journaled first: a manager killed part-way leaves the entry,
        // and the next start finishes the delete (a directory half removed is no sandbox).
        let announced = Intent::Delete {
            name: sandbox.name.clone(),
            created_ms: Some(inner.record.created_ms),
        };
        // Not written (a full disk, say: when a delete is most wanted), it goes on without:
        // a start finishes a delete cut short all the same (a directory without a record is
        // removed, and a record saying Deleting).
        let intent = match self.journal.begin(&announced) {
            Ok(intent) => Some(intent),
            Err(e) => {
                self.event(
                    "journal_write_failed",
                    &sandbox.name,
                    json!({ "op": "delete", "error": e.to_string() }),
                );
                None
            }
        };
        inner.record.state = State::Deleting;
        // Its exposed ports stop now, not when their listeners next look (a sandbox made
        // under the same name meanwhile must not get this one's connections).
        self.ports.remove_all(&sandbox.name);
        if let Err(e) = sandbox.save(&inner) {
            // Nor this (a full disk again): the record's removal below is what makes it no
            // sandbox; a start after a crash before it finds its VMM gone and lists it dead.
            self.event(
                "record_write_failed",
                &sandbox.name,
                json!({ "op": "delete", "error": e.to_string() }),
            );
        }
        if let Some(mut vmm) = inner.vmm.take() {
            vmm.kill();
        }
        // Its memory cgroup, whoever started its VMM (an adopted one's is still there).
        if let Some(group) = self.groups.path(&sandbox.group) {
            crate::cgroup::remove(&group);
        }
        // The record first: from here on the directory is no sandbox's.
        let record = sandbox.dir().join(RECORD);
        let removed = match std::fs::remove_file(&record) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(io_error("remove", &record)(e))
            }
            _ => Ok(()),
        }
        .and_then(|()| {
            self.crash_point(CrashPoint::MidDelete);
            // Gone already: another delete of it finished while this one waited for its lock.
            match std::fs::remove_dir_all(sandbox.dir()) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                other => other.map_err(io_error("remove", sandbox.dir())),
            }
        });
        if let Err(e) = removed {
            // Left in the journal: the next start finishes it.
            if let Some(intent) = intent {
                intent.keep();
            }
            return Err(e);
        }
        drop(inner);
        // Done before the name is free: a create of it again has an entry of its own. An
        // earlier try of this delete that failed kept its entry: removed too.
        let done = intent
            .map_or(Ok(()), Pending::done)
            .and_then(|()| self.journal.remove_all(&announced).map(drop));
        if let Err(e) = done {
            self.event(
                "journal_stuck",
                &sandbox.name,
                json!({ "error": e.to_string() }),
            );
        }
        lock(&self.sandboxes).remove(&sandbox.name);
        self.event("deleted", &sandbox.name, json!({}));
        Ok(())
    }

    /// A new token for the sandbox (the old one stops working), expiring after `ttl_s` if
    /// given, or none (`revoke`).
    pub fn set_token(
        &self,
        sandbox: &Sandbox,
        revoke: bool,
        ttl_s: Option<u64>,
    ) -> Result<Option<String>, ServeError> {
        let mut inner = lock(&sandbox.inner);
        let token = if revoke {
            None
        } else {
            Some(new_token("mfs_")?)
        };
        inner.record.token_sha256 = token.as_deref().map(hash_token);
        inner.record.token_expires_ms = ttl_s
            .filter(|_| !revoke)
            .map(|ttl| expires_at(now_ms(), ttl));
        sandbox.save(&inner)?;
        self.event(
            if revoke {
                "token_revoked"
            } else {
                "token_minted"
            },
            &sandbox.name,
            json!({ "ttl_s": ttl_s }),
        );
        Ok(token)
    }

    /// A new credential for the sandbox, for `audience` and expiring after `ttl_s` if given:
    /// the one that verifies from now on (the one before it no longer does), put in its
    /// guest as at its create when it has an agent (the sandbox is woken for it). Returns the
    /// credential and whether its guest has it.
    pub fn rotate_credential(
        &self,
        sandbox: &Arc<Sandbox>,
        audience: Option<String>,
        ttl_s: Option<u64>,
    ) -> Result<(String, bool), ServeError> {
        let record = {
            let mut inner = lock(&sandbox.inner);
            inner.record.credential = CredentialState {
                id: Some(new_token("mci_")?),
                audience,
                expires_ms: ttl_s.map(|ttl| expires_at(now_ms(), ttl)),
                revoked: false,
            };
            sandbox.save(&inner)?;
            inner.record.clone()
        };
        self.event(
            "credential_minted",
            &sandbox.name,
            json!({ "ttl_s": ttl_s }),
        );
        let (_, credential) = self.credential_for(&record);
        let delivered = !record.spec.agentless()
            && self.ensure_running(sandbox, false).is_ok()
            && self.deliver_credential(sandbox, &record).is_ok();
        Ok((credential, delivered))
    }

    /// Revoke the sandbox's credential: none of its credentials verifies until a new one is
    /// minted.
    pub fn revoke_credential(&self, sandbox: &Sandbox) -> Result<(), ServeError> {
        let mut inner = lock(&sandbox.inner);
        inner.record.credential = CredentialState {
            revoked: true,
            ..CredentialState::default()
        };
        sandbox.save(&inner)?;
        drop(inner);
        self.event("credential_revoked", &sandbox.name, json!({}));
        Ok(())
    }
}

/// The longest socket path a sandbox in `dir` has its VMM bind: its vsock device's socket for
/// the highest port, beside its control socket ([`files::socket`]).
fn longest_socket_path(dir: &Path) -> usize {
    files::socket(dir).as_os_str().len() + ".vsock_4294967295".len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_socket_path_measured_is_the_one_bound() {
        let dir = Path::new("/s/sandboxes/box");
        let bound = format!("{}.vsock_4294967295", files::socket(dir).display());
        assert_eq!(bound, "/s/sandboxes/box/sock/vm.sock.vsock_4294967295");
        assert_eq!(longest_socket_path(dir), bound.len());
    }
}
