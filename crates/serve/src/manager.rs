//! The manager: every sandbox by name, its policy, budgets, counters, templates, credential
//! key and event log, opened from (or made in) a state directory; and what it answers
//! without changing a sandbox's state (lookups, descriptions, gauges, the admin token, the
//! credentials it gives guests and checks). What changes a sandbox is in
//! [`crate::lifecycle`], a start in [`crate::recovery`], the idle watch in [`crate::idle`].

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::budget::{DiskBudget, MemoryBudget};
use crate::cgroup::MemoryGroups;
use crate::config::{CrashPoint, Policy};
use crate::credential::{Claims, Keys, GUEST_PATH};
use crate::error::ServeError;
use crate::events::EventLog;
use crate::files::disk_bytes;
use crate::images::Images;
use crate::journal::Journal;
use crate::metrics::{Gauges, Metrics};
use crate::process::rss_tree_bytes;
use crate::records::{Record, State};
use crate::sandbox::Sandbox;
use crate::templates::Templates;
use crate::tokens::{hash_token, new_token, token_matches};
use crate::util::{io_error, lock, now_ms, write_atomically};

/// How long a create of a restored sandbox waits to give its credential: its agent answers
/// within milliseconds of the restore, and a guest that stalls it costs the create this much.
/// Agentless guests (the probe, `no_agent`) are not waited for: each probe clone of a fork
/// took 5 s more while they were.
const CREDENTIAL_RESTORE_WAIT: Duration = Duration::from_secs(5);
/// How long a booting sandbox's credential waits for its guest agent.
const CREDENTIAL_BOOT_WAIT: Duration = Duration::from_secs(300);

/// The manager: every sandbox, its counters and its event log.
pub struct Manager {
    pub(crate) dir: PathBuf,
    pub(crate) mayfly: PathBuf,
    /// Whether new sandboxes are jailed (the default; `mayfly serve --no-jail` turns it off).
    pub(crate) jail: bool,
    /// Jailed sandboxes and template builds run as uids from here on, one each.
    pub(crate) uid_base: u32,
    /// The uids template builds under way run as (the sandboxes' are in their records).
    pub(crate) build_uids: Mutex<std::collections::BTreeSet<u32>>,
    /// Where the files a create names may be (`--images-dir`).
    pub(crate) images: Images,
    /// The VMMs' memory cgroups.
    pub(crate) groups: MemoryGroups,
    /// What each VMM may hold beside its guest memory, bytes (`--vmm-allowance-mib`).
    pub(crate) allowance: u64,
    /// `--console-limit`, bytes.
    pub(crate) console_limit: u64,
    /// The network arguments every VMM gets (see [`crate::config::Config`]).
    pub(crate) net_args: Vec<String>,
    /// Where names in policies resolve (see [`crate::config::Config`]).
    pub(crate) net_names: mayfly_network::Names,
    /// Networks built ahead of need (`--net-pool`).
    pub(crate) net_pool: Arc<crate::netpool::NetPool>,
    /// The host listeners of the sandboxes' exposed ports (see `ports.rs`).
    pub(crate) ports: crate::listeners::PortListeners,
    /// The manager itself, for the threads it starts (the ports' listeners): set once it is
    /// shared (`server.rs`).
    pub(crate) me: std::sync::OnceLock<std::sync::Weak<Manager>>,
    /// Whether the disk was found over its budget at the last measure (the idle watch
    /// measures it every few seconds).
    pub(crate) disk_over: std::sync::atomic::AtomicBool,
    /// When the disk was last measured by the idle watch.
    pub(crate) disk_checked: Mutex<Option<Instant>>,
    pub(crate) templates: Templates,
    admin_hash: String,
    pub(crate) sandboxes: Mutex<BTreeMap<String, Arc<Sandbox>>>,
    /// The memory budget (`mayfly serve --mem-budget-mib`, `--make-room`).
    pub(crate) memory: MemoryBudget,
    /// The disk budget (`--disk-budget-mib`).
    pub(crate) disk: DiskBudget,
    /// Asleep this long, a sandbox is deleted (`--expire-after`), ms.
    pub(crate) expire_after_ms: Option<u64>,
    /// Unused this long, a template is collected (`--template-ttl`).
    pub(crate) template_ttl: Option<Duration>,
    /// When templates were last looked at for collection.
    pub(crate) templates_checked: Mutex<Option<Instant>>,
    pub metrics: Metrics,
    /// Signs the credentials sandboxes' guests hold.
    pub(crate) credentials: Keys,
    pub(crate) events: Arc<EventLog>,
    /// What is in flight, for the next start to finish or undo (see [`crate::journal`]).
    pub(crate) journal: Journal,
    /// `--crash-at` (tests only): the step after which the manager aborts.
    pub(crate) crash_at: Option<CrashPoint>,
    started: Instant,
}

impl Manager {
    /// Open (or make) a state directory: its admin token, its event log, its sandboxes.
    pub fn open(dir: &Path, mayfly: PathBuf, policy: &Policy) -> Result<Manager, ServeError> {
        let sandboxes = dir.join("sandboxes");
        std::fs::create_dir_all(&sandboxes).map_err(io_error("make", &sandboxes))?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(io_error("set the mode of", dir))?;
        let token_file = dir.join("admin.token");
        let admin = match std::fs::read_to_string(&token_file) {
            Ok(token) if !token.trim().is_empty() => token.trim().to_owned(),
            Ok(_) | Err(_) => {
                let token = new_token("mfa_")?;
                write_atomically(&token_file, format!("{token}\n").as_bytes())?;
                token
            }
        };
        let events = EventLog::open(&dir.join("events.jsonl"))?;
        let images_dirs = if policy.images_dirs.is_empty() {
            // The default: made (root's, 0755) so that the operator only has to fill it.
            let default = dir.join("images");
            if !default.is_dir() {
                std::fs::create_dir(&default).map_err(io_error("make", &default))?;
                std::fs::set_permissions(&default, std::fs::Permissions::from_mode(0o755))
                    .map_err(io_error("set the mode of", &default))?;
            }
            vec![default]
        } else {
            policy.images_dirs.clone()
        };
        for images in &images_dirs {
            if !images.is_absolute() || !images.is_dir() {
                return Err(ServeError::BadRequest(format!(
                    "--images-dir {}: give the absolute path of a directory that exists",
                    images.display()
                )));
            }
        }
        let groups = MemoryGroups::find(dir);
        groups.sweep();
        if let Some(why) = groups.unavailable() {
            events.write(
                "no_memory_limit",
                "",
                json!({ "why": format!("{why}: its VMMs run without a memory limit of their own") }),
            );
        }
        Ok(Manager {
            dir: dir.to_path_buf(),
            mayfly,
            jail: policy.jail,
            uid_base: policy.jail_uid_base,
            build_uids: Mutex::new(std::collections::BTreeSet::new()),
            images: Images::new(images_dirs),
            groups,
            allowance: policy.vmm_allowance_mib.saturating_mul(1 << 20),
            console_limit: policy.console_limit,
            net_args: policy.net_args.clone(),
            net_names: policy.net_names.clone(),
            net_pool: crate::netpool::NetPool::new(policy.net_pool.clone()),
            ports: Default::default(),
            me: std::sync::OnceLock::new(),
            disk_over: std::sync::atomic::AtomicBool::new(false),
            disk_checked: Mutex::new(None),
            templates: Templates::new(dir),
            admin_hash: hash_token(&admin),
            sandboxes: Mutex::new(BTreeMap::new()),
            memory: MemoryBudget::new(
                policy.mem_budget_mib.map(|m| m.saturating_mul(1 << 20)),
                policy.make_room,
            ),
            disk: DiskBudget::new(policy.disk_budget_mib.map(|m| m.saturating_mul(1 << 20))),
            expire_after_ms: policy.expire_after_s.map(|s| s.saturating_mul(1000)),
            template_ttl: policy.template_ttl_s.map(Duration::from_secs),
            templates_checked: Mutex::new(None),
            metrics: Metrics::default(),
            credentials: Keys::open(dir)?,
            events: Arc::new(events),
            journal: Journal::open(dir)?,
            crash_at: policy.crash_at,
            started: Instant::now(),
        })
    }

    /// The manager's monotonic clock: ms since it started (what sandboxes' idleness counts).
    pub fn uptime_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    pub fn state_dir(&self) -> &Path {
        &self.dir
    }

    pub fn is_admin(&self, token: &str) -> bool {
        token_matches(&self.admin_hash, token)
    }

    /// Abort here if `--crash-at` names this step (tests only: a `kill -9` right there).
    pub(crate) fn crash_point(&self, at: CrashPoint) {
        if self.crash_at == Some(at) {
            self.event("crashing", "", json!({ "at": format!("{at:?}") }));
            std::process::abort();
        }
    }

    /// One JSON line per life-cycle event, in `events.jsonl` and on stderr.
    pub fn event(&self, event: &str, sandbox: &str, detail: Value) {
        self.events.write(event, sandbox, detail);
    }

    pub fn get(&self, name: &str) -> Option<Arc<Sandbox>> {
        lock(&self.sandboxes).get(name).cloned()
    }

    /// Every sandbox, as the map holds them now.
    pub fn all(&self) -> Vec<Arc<Sandbox>> {
        lock(&self.sandboxes).values().cloned().collect()
    }

    /// What `GET /sandboxes/NAME` answers.
    pub fn describe(&self, sandbox: &Sandbox) -> Value {
        sandbox.describe(self.uptime_ms())
    }

    pub fn list(&self) -> Vec<Value> {
        let all = self.all();
        all.iter().map(|s| self.describe(s)).collect()
    }

    pub fn gauges(&self) -> Gauges {
        let all = self.all();
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

    /// Memory held by sandboxes whose VMM runs (starting, running, suspending or being
    /// woken: whenever its record has a pid), bytes, from their root-owned records: each its
    /// guest memory and the VMM's allowance (what its memory cgroup allows).
    pub fn memory_in_use(&self) -> u64 {
        let all = self.all();
        all.iter()
            .filter_map(|sandbox| {
                let view = lock(&sandbox.view);
                view.pid
                    .map(|_| view.guest_bytes.unwrap_or(0).saturating_add(self.allowance))
            })
            .fold(0u64, u64::saturating_add)
    }

    /// The lowest uid from the base that no sandbox (in `all`, the map under its lock) and
    /// no template build has.
    pub(crate) fn free_uid(&self, all: &BTreeMap<String, Arc<Sandbox>>) -> Result<u32, ServeError> {
        let builds = lock(&self.build_uids);
        let taken: std::collections::BTreeSet<u32> = all
            .values()
            .filter_map(|s| s.uid)
            .chain(builds.iter().copied())
            .collect();
        (self.uid_base..u32::MAX)
            .find(|uid| !taken.contains(uid))
            .ok_or_else(|| {
                ServeError::Conflict(
                    "no uid is left for a new sandbox or template build: delete sandboxes, or \
                     start the manager with a lower --jail-uid-base"
                        .into(),
                )
            })
    }

    /// What the sandboxes keep on disk, bytes (each file once, however many links it has).
    pub fn disk_in_use(&self) -> u64 {
        disk_bytes(&self.dir.join("sandboxes"))
    }

    /// The credential of the sandbox `record` describes (see [`crate::credential`]).
    pub(crate) fn credential_for(&self, record: &Record) -> (Claims, String) {
        let claims = Claims {
            sandbox: record.name.clone(),
            acts_for: record.spec.acts_for.clone(),
            created_ms: record.created_ms,
            id: record.credential.id.clone(),
            audience: record.credential.audience.clone(),
            expires_ms: record.credential.expires_ms,
        };
        let credential = self.credentials.mint(&claims);
        (claims, credential)
    }

    /// Put its credential in a new sandbox's guest, through its agent. A restored guest (a
    /// template's, a snapshot's, a fork's clone) has its agent up at once, and gets it before
    /// its create answers; a booting one gets it from a thread once its agent answers. Never
    /// fails the create (a guest of the user's own may have no agent): a failure is an event.
    /// The probe guest has no agent.
    pub(crate) fn give_credential(&self, sandbox: &Arc<Sandbox>, record: &Record) {
        let spec = &record.spec;
        if spec.agentless() {
            return;
        }
        let put = self.credential_put(sandbox, record);
        let events = Arc::clone(&self.events);
        let name = sandbox.name.clone();
        let report = move |result: Result<(), String>| match result {
            Ok(()) => events.write("credential_given", &name, json!({})),
            Err(e) => events.write("credential_failed", &name, json!({ "error": e })),
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

    /// What puts the credential `record` says in its sandbox's guest (through its agent,
    /// tried until the wait it is given is over).
    fn credential_put(
        &self,
        sandbox: &Arc<Sandbox>,
        record: &Record,
    ) -> impl FnOnce(Duration) -> Result<(), String> + Send + 'static {
        let (claims, credential) = self.credential_for(record);
        let mut file = serde_json::to_value(&claims).unwrap_or_default();
        file["credential"] = Value::String(credential);
        let sock = sandbox.socket();
        let path = format!(
            "/vm/files?path={}&mode=0400&mkdirs=1",
            GUEST_PATH.replace('/', "%2F")
        );
        // Tried until `wait` is over (each attempt only as long as is left), again only when
        // the agent is not up yet (503, 504, or no answer): any other answer is final.
        // Its own sandbox, not its name: a sandbox deleted meanwhile (and perhaps made again
        // under the name, at the same socket path) gets nothing more from this one.
        let own = Arc::clone(sandbox);
        move |wait: Duration| -> Result<(), String> {
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
        }
    }

    /// Put the sandbox's current credential in its (running) guest now.
    pub(crate) fn deliver_credential(
        &self,
        sandbox: &Arc<Sandbox>,
        record: &Record,
    ) -> Result<(), String> {
        let result = (self.credential_put(sandbox, record))(CREDENTIAL_RESTORE_WAIT);
        match &result {
            Ok(()) => self.event("credential_given", &sandbox.name, json!({})),
            Err(e) => self.event("credential_failed", &sandbox.name, json!({ "error": e })),
        }
        result
    }

    /// Whether `credential` is one this manager made for a sandbox that still exists, and
    /// the one of its credentials that verifies now (the latest minted, not revoked, not
    /// expired), for `audience` when one is asked for.
    pub fn verify_credential(&self, credential: &str, audience: Option<&str>) -> Value {
        let claims = match self.credentials.check(credential) {
            Ok(claims) => claims,
            Err(why) => return json!({ "valid": false, "error": why }),
        };
        let invalid = |why: String| json!({ "valid": false, "error": why });
        let name = &claims.sandbox;
        let Some(sandbox) = self.get(name) else {
            return invalid(format!("sandbox {name} no longer exists"));
        };
        let (created, state, current) = {
            let view = lock(&sandbox.view);
            (view.created_ms, view.state, view.credential.clone())
        };
        if created != claims.created_ms {
            return invalid(format!(
                "sandbox {name} was deleted and made again since: this credential was its \
                 predecessor's"
            ));
        }
        if state == State::Deleting {
            return invalid(format!("sandbox {name} is being deleted"));
        }
        if current.revoked {
            return invalid(format!(
                "the credentials of sandbox {name} were revoked: the admin mints a new one \
                 with POST /sandboxes/{name}/credential"
            ));
        }
        if claims.id != current.id {
            return invalid(format!(
                "this credential of sandbox {name} was replaced by a newer one (a rotation, or \
                 the sandbox is a fork's clone with a credential of its own)"
            ));
        }
        if claims.expires_ms.is_some_and(|at| now_ms() >= at) {
            return invalid(format!(
                "this credential of sandbox {name} expired: the admin mints a new one with \
                 POST /sandboxes/{name}/credential"
            ));
        }
        if let Some(wanted) = audience {
            if claims.audience.as_deref() != Some(wanted) {
                return invalid(format!(
                    "this credential of sandbox {name} is not meant for {wanted:?}"
                ));
            }
        }
        json!({
            "valid": true,
            "sandbox": claims.sandbox,
            "acts_for": claims.acts_for,
            "created_ms": claims.created_ms,
            "audience": claims.audience,
            "expires_ms": claims.expires_ms,
        })
    }
}
