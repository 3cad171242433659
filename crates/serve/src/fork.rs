//! Forks through the manager: `POST /sandboxes/NAME/fork` makes N new sandboxes, each a
//! copy-on-write restore of one snapshot of NAME, each with a name and a token of its own.
//!
//! 1. The source sleeps: a running one is suspended (snapshot, then its VMM exits) and woken
//!    again once the base is made; a sleeping one is not woken. Root touches what a VMM wrote
//!    only while no process of that VMM's uid runs, as before every wake.
//! 2. Its snapshot becomes a **fork base** in `<state-dir>/forks/<id>/`: linked there, checked
//!    to hold nothing but plain files, its disk layers gathered in, and sealed: root's and
//!    read-only, the files the source keeps using copied (see [`crate::files::seal`]), so no
//!    VMM can change what the clones restore after the fact.
//! 3. Each clone is created as any sandbox is: the base is hard-linked into its own
//!    `vm/base/` (nothing is copied; every clone's RAM maps the same files, so the page cache
//!    holds the base once) and restored from there with the clock, entropy and identity
//!    refreshed (its name is its own). Up to [`PARALLEL`] are started at once.
//! 4. The fork base is removed: the clones' links keep its files for as long as any clone
//!    needs them.
//!
//! A fork that fails part-way deletes the clones it made: all of them or none. So does a
//! manager killed part-way, at its next start: the fork is in the journal (see
//! [`crate::journal`]) from before its first clone until it answers, and each clone's record
//! names it, so every clone it made is undone (its VMM ended, its directory removed; its
//! token was never handed out) and the source stays as its record says. It uses only the
//! manager's life cycle (a snapshot of the source, creates, deletes).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use serde::Deserialize;
use serde_json::{json, Value};

use crate::config::CrashPoint;
use crate::error::ServeError;
use crate::files::seal;
use crate::journal::{Intent, Pending};
use crate::manager::Manager;
use crate::process::Vmm;
use crate::records::{valid_name, Spec};
use crate::sandbox::Sandbox;
use crate::util::{io_error, now_ms};

/// The most clones one request makes (a fork into 100, with room; each is a VMM of its own,
/// and the memory budget still counts each).
pub const MAX_CLONES: usize = 128;
/// Clones started at once.
const PARALLEL: usize = 4;

/// The body of `POST /sandboxes/NAME/fork`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    /// How many clones, named `NAME-1`, `NAME-2`, ... (the first numbers not taken).
    #[serde(default)]
    pub count: Option<usize>,
    /// Or their names.
    #[serde(default)]
    pub names: Option<Vec<String>>,
    /// The clones' idle timeout (default: the source's).
    #[serde(default)]
    pub idle_timeout_s: Option<u64>,
}

/// A fork's ID, unique in this manager: its source, the time, and a count (its journal entry,
/// its clones' records, its base or placement under `<state-dir>/forks/` name it).
fn fork_id(source: &str) -> String {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    format!(
        "{source}-{}-{}",
        now_ms(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

/// The clones' names: the ones asked for, or `NAME-k` for the first free k.
fn clone_names(
    manager: &Manager,
    source: &str,
    request: &ForkRequest,
) -> Result<Vec<String>, ServeError> {
    let bad = |m: String| Err(ServeError::BadRequest(m));
    crate::records::check_idle_timeout(request.idle_timeout_s).map_err(ServeError::BadRequest)?;
    let names =
        match (&request.names, request.count) {
            (Some(names), None) => names.clone(),
            (Some(_), Some(_)) => return bad("give \"count\" or \"names\", not both".into()),
            (None, Some(count)) => {
                if count == 0 || count > MAX_CLONES {
                    return bad(format!("\"count\" must be 1 to {MAX_CLONES}"));
                }
                let mut names = Vec::with_capacity(count);
                let mut k = 1usize;
                while names.len() < count {
                    let name = format!("{source}-{k}");
                    // The source's name leaves no room for a number: the request is fine,
                    // the name it meets is not.
                    if !valid_name(&name) {
                        return Err(ServeError::Conflict(format!(
                            "{name:?} would be too long for a sandbox name: give the clones' \
                         \"names\""
                        )));
                    }
                    if manager.get(&name).is_none() {
                        names.push(name);
                    }
                    k += 1;
                }
                names
            }
            (None, None) => return bad(
                "say how many clones: {\"count\": N}, or name them: {\"names\": [\"a\", \"b\"]}"
                    .into(),
            ),
        };
    if names.is_empty() || names.len() > MAX_CLONES {
        return bad(format!("a fork makes 1 to {MAX_CLONES} clones"));
    }
    for (i, name) in names.iter().enumerate() {
        if !valid_name(name) {
            return bad(format!(
                "{name:?} is not a sandbox name: use 1 to 63 lower-case letters, digits and \
                 hyphens, not starting or ending with a hyphen (a DNS label)"
            ));
        }
        if names[..i].contains(name) {
            return bad(format!("{name:?} is asked for twice"));
        }
        if manager.get(name).is_some() {
            return Err(ServeError::Conflict(format!(
                "a sandbox named {name} exists: pick other names"
            )));
        }
    }
    Ok(names)
}

/// Fork `source` into new sandboxes; answers what a create answers for each (tokens included).
pub fn fork(
    manager: &Manager,
    source: &Sandbox,
    request: &ForkRequest,
) -> Result<Value, ServeError> {
    let names = clone_names(manager, &source.name, request)?;
    // The clones get the source's policy (as its waiter last said it, not the snapshot's:
    // its VMM wrote that one); its names must still resolve, or every clone would fail.
    let net = crate::util::lock(&source.view).net_policy.clone();
    manager.check_names("the source's policy", net.as_deref())?;
    // A running source is forked where it runs: its VMM's memory, captured, is shared by
    // its clones through a zygote (see `fork_live`); a sleeping one from its snapshot.
    if let Some(forked) = fork_live(manager, source, request, &names, net.as_deref())? {
        return Ok(forked);
    }
    let start = Instant::now();
    let forks = manager.state_dir().join("forks");
    std::fs::create_dir_all(&forks).map_err(io_error("make", &forks))?;
    let id = fork_id(&source.name);
    let base = forks.join(&id);
    // 1-2. One sealed snapshot of the source. Layers its snapshot names by full path (those
    // it stacks on, in its own `vm/base/`) are gathered in: the base must not depend on the
    // source, which may go before its clones.
    manager.fork_snapshot(source, &base, &|base| {
        mayfly_snapshot::gather::gather_layers(base, &source.vm_dir())
            .map_err(|e| ServeError::VmmFailed(e.to_string()))?;
        seal(base)
    })?;
    let snapshot_ms = start.elapsed().as_secs_f64() * 1e3;
    // From the first clone until the answer: the next start undoes every clone naming `id`.
    let intent = match manager.journal.begin(&Intent::Fork {
        id: id.clone(),
        source: source.name.clone(),
        clones: names.clone(),
    }) {
        Ok(intent) => intent,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&base);
            return Err(e);
        }
    };
    let clones_made = AtomicUsize::new(0);
    let idle = request
        .idle_timeout_s
        .or_else(|| source.spec().idle_timeout_s);
    let (acts_for, no_agent) = {
        let spec = source.spec();
        (spec.acts_for.clone(), spec.agentless())
    };
    // 3. The clones, a few at a time.
    let mut made: Vec<Result<Value, (String, ServeError)>> = Vec::with_capacity(names.len());
    for chunk in names.chunks(PARALLEL) {
        std::thread::scope(|scope| {
            let started: Vec<_> = chunk
                .iter()
                .map(|name| {
                    let spec = Spec {
                        snapshot: Some(base.clone()),
                        idle_timeout_s: idle,
                        acts_for: acts_for.clone(),
                        no_agent,
                        net: net.clone(),
                        ..Spec::default()
                    };
                    let (id, clones_made) = (&id, &clones_made);
                    scope.spawn(move || {
                        manager
                            .create_for(name, spec, None, Some(id))
                            .inspect(|_| {
                                let k = clones_made.fetch_add(1, Ordering::SeqCst) + 1;
                                manager.crash_point(CrashPoint::AfterClone(k));
                            })
                            .map(|(mut described, token)| {
                                if let Some(o) = described.as_object_mut() {
                                    o.insert("token".into(), Value::String(token));
                                }
                                described
                            })
                            .map_err(|e| (name.clone(), e))
                    })
                })
                .collect();
            for handle in started {
                made.push(handle.join().unwrap_or_else(|_| {
                    Err((
                        String::new(),
                        ServeError::VmmFailed("a clone's create panicked".into()),
                    ))
                }));
            }
        });
        if made.iter().any(Result::is_err) {
            break;
        }
    }
    // 4. The base goes; the clones hold links to its files.
    let _ = std::fs::remove_dir_all(&base);
    // Every clone made: the entry goes before the answer (one left would have the next start
    // undo the clones whose tokens the answer gives out). If it cannot, they are undone now.
    let mut intent = Some(intent);
    if made.iter().all(Result::is_ok) {
        if let Err(e) = intent.take().map_or(Ok(()), Pending::done) {
            made.push(Err((String::new(), e)));
        }
    }
    if let Some(pos) = made.iter().position(Result::is_err) {
        // All or none: the clones that were made are deleted.
        for clone in made.iter().flatten() {
            if let Some(sandbox) = clone["name"].as_str().and_then(|n| manager.get(n)) {
                let _ = manager.delete(&sandbox);
            }
        }
        drop(intent);
        let Some(Err((name, e))) = made.into_iter().nth(pos) else {
            unreachable!("position found an error");
        };
        manager.event(
            "fork_failed",
            &source.name,
            json!({ "clone": name, "error": e.to_string() }),
        );
        return Err(match e {
            ServeError::BadRequest(m) => ServeError::BadRequest(format!("clone {name}: {m}")),
            ServeError::Conflict(m) => ServeError::Conflict(format!("clone {name}: {m}")),
            ServeError::VmmFailed(m) => ServeError::VmmFailed(format!(
                "clone {name} did not start, so no clone was kept: {m}"
            )),
            other => other,
        });
    }
    let clones: Vec<Value> = made.into_iter().flatten().collect();
    let ms = start.elapsed().as_secs_f64() * 1e3;
    manager.event(
        "forked",
        &source.name,
        json!({ "clones": names, "ms": ms, "snapshot_ms": snapshot_ms }),
    );
    Ok(json!({
        "source": source.name,
        "clones": clones,
        "ms": ms,
        "snapshot_ms": snapshot_ms,
    }))
}

/// How long the fork's helper may take to make every clone: the clones' own deadline
/// (`mayfly_api::FORK_READY_TIMEOUT`) and some.
const HELPER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(150);

/// A fork of a running source, its clones made by `mayfly fork --place ... --hold` (the
/// fork's helper, a child of the manager): `None` when the source is not running (it is then
/// forked from its snapshot).
///
/// 1. Each clone is made a sandbox, Starting: its name, uid, token, directory, record
///    naming the fork (which is in the journal from here until it answers), its memory
///    reserved and its memory cgroup made.
/// 2. The helper captures the source's VMM (paused only for its state and the freeze of its
///    memory: see `mayfly_vmm::persist::fork::fork_from_outside`), links the layers its
///    disks stack on into each clone's own `vm/`, and makes every clone from one zygote,
///    each in its own jail as its uid, its files where its sandbox keeps them, its network
///    where every VMM's is made, with the source's policy. It prints them, held.
/// 3. Each clone's process (its jail's waiter) is saved in its record and put in its memory
///    cgroup; then the helper is told `go`, and the clones run.
///
/// All or none: a clone that fails, a helper that fails or a manager killed part-way stops
/// every clone (a held clone whose helper ends without `go` stops itself) and deletes them.
fn fork_live(
    manager: &Manager,
    source: &Sandbox,
    request: &ForkRequest,
    names: &[String],
    net: Option<&str>,
) -> Result<Option<Value>, ServeError> {
    use crate::records::State;
    use crate::util::lock;
    let start = Instant::now();
    // The source stays as it is (running, not suspended or deleted) until the helper has
    // captured it (its state and memory taken, its layers linked for the clones).
    let mut source_lock = Some(lock(&source.inner));
    let source_inner = source_lock.as_ref().expect("just locked");
    if source_inner.record.state != State::Running || source_inner.vmm.is_none() {
        return Ok(None);
    }
    let guest_bytes = source_inner.record.guest_bytes.unwrap_or(0);
    if net.is_some() {
        manager.net_pool.want(&manager.events);
    }
    let id = fork_id(&source.name);
    let intent = manager.journal.begin(&Intent::Fork {
        id: id.clone(),
        source: source.name.clone(),
        clones: names.to_vec(),
    })?;
    let idle = request
        .idle_timeout_s
        .or_else(|| source_inner.record.spec.idle_timeout_s);
    let spec = Spec {
        idle_timeout_s: idle,
        acts_for: source_inner.record.spec.acts_for.clone(),
        no_agent: source_inner.record.spec.agentless(),
        net: net.map(str::to_owned),
        ..Spec::default()
    };
    let mut made = Made {
        manager,
        clones: Vec::with_capacity(names.len()),
    };
    // How long the source was paused for its capture (at most), as the helper says.
    let mut source_paused_ms = 0.0;
    let mut copied_bytes = 0;
    let result = (|| {
        // 1. The clones as sandboxes, and their places.
        let mut placements = Vec::with_capacity(names.len());
        let mut reserved = Vec::with_capacity(names.len());
        let limit = guest_bytes.saturating_add(manager.allowance);
        for name in names {
            let dir = manager.new_sandbox_dir(name)?;
            let (sandbox, token) =
                manager.take_name(name, &dir, spec.clone(), None, Some(&id), now_ms())?;
            made.clones.push(Clone {
                sandbox: std::sync::Arc::clone(&sandbox),
                token,
                group: None,
            });
            let inner = lock(&sandbox.inner);
            crate::files::make_dirs(&dir, inner.record.uid.filter(|_| inner.record.jailed))?;
            sandbox.save(&inner)?;
            reserved.push(manager.reserve_memory(name, limit)?);
            let group = manager.groups.make(&sandbox.group, limit)?;
            let v2 = group.as_ref().is_some_and(|g| g.v2);
            made.clones.last_mut().expect("just pushed").group = group;
            let vm_dir = sandbox.vm_dir();
            let sock = sandbox.socket();
            placements.push(json!({
                "name": name,
                "api_sock": sock,
                "console_log": crate::files::console_log(&dir),
                "stderr": crate::files::vmm_log(&dir),
                "vsock": format!("{}.vsock", sock.display()),
                "disk_dir": vm_dir.join("disks"),
                "uid": inner.record.uid.filter(|_| inner.record.jailed),
                "share": [&vm_dir],
                // A jailed VMM of a cgroup v2 host is in its jail's own group: its limit goes
                // there (as for any sandbox's VMM, see process::launch).
                "memory_mib": v2.then(|| limit.div_ceil(1 << 20)),
                "layers_moved": [source.vm_dir(), &vm_dir],
            }));
        }
        let forks = manager.state_dir().join("forks");
        std::fs::create_dir_all(&forks).map_err(io_error("make", &forks))?;
        let place = forks.join(format!("{id}.json"));
        let placed = json!({ "clones": placements, "policy": net });
        crate::util::write_atomically(&place, placed.to_string().as_bytes())?;
        // 2. The helper makes them, held.
        let helper = Helper::start(manager, &source.socket(), names.len(), &place, &forks, &id);
        let captured = helper.and_then(|mut helper| helper.captured().map(|()| helper));
        // Read by now (it reads it before anything else), or never.
        let _ = std::fs::remove_file(&place);
        let mut helper = captured?;
        // Nothing more is needed of the source: its own requests, a sleep or a delete go on.
        drop(source_lock.take());
        let report = helper.report()?;
        source_paused_ms = ["pause_ms", "state_ms", "freeze_ms"]
            .iter()
            .filter_map(|k| report[k].as_f64())
            .sum();
        copied_bytes = report["copied_bytes"].as_u64().unwrap_or(0);
        let listed = report["clones"].as_array().cloned().unwrap_or_default();
        if listed.len() != names.len() {
            return Err(ServeError::VmmFailed(format!(
                "the fork's helper made {} clones of the {} asked for",
                listed.len(),
                names.len()
            )));
        }
        // 3. Their processes saved, then let go.
        for (k, (clone, listed)) in made.clones.iter_mut().zip(&listed).enumerate() {
            let name = &clone.sandbox.name;
            if listed["name"].as_str() != Some(name.as_str()) {
                return Err(ServeError::VmmFailed(format!(
                    "the fork's helper made {} where {name} was asked for",
                    listed["name"]
                )));
            }
            let pid = listed["pid"].as_u64().and_then(|p| u32::try_from(p).ok());
            let vmm_pid = listed["vmm_pid"]
                .as_u64()
                .and_then(|p| u32::try_from(p).ok());
            let group_dir = clone.group.as_ref().map(|g| g.dir.clone());
            let Some((vmm, pid_start)) = pid.and_then(|pid| Vmm::follow(pid, group_dir)) else {
                return Err(ServeError::VmmFailed(format!(
                    "clone {name} ended before it could run"
                )));
            };
            if let Some(group) = &clone.group {
                // Both the waiter and (on a cgroup v1 host, where the jail's own group holds
                // no memory limit) the VMM it made before it was moved: the pid the helper
                // says, taken only if it is the waiter's child.
                let mut pids = vec![vmm.pid()];
                if !group.v2 {
                    pids.extend(vmm_pid.filter(|p| parent_of(*p) == Some(vmm.pid())));
                }
                for pid in pids {
                    use std::io::Write;
                    (&group.procs)
                        .write_all(pid.to_string().as_bytes())
                        .map_err(io_error("move into its memory cgroup", &group.dir))?;
                }
            }
            let mut inner = lock(&clone.sandbox.inner);
            inner.record.pid = Some(vmm.pid());
            inner.record.pid_start = Some(pid_start);
            inner.record.guest_bytes = Some(guest_bytes);
            inner.record.state = State::Running;
            inner.record.net_policy = net.map(str::to_owned);
            inner.vmm = Some(vmm);
            clone.sandbox.save(&inner)?;
            drop(inner);
            manager.crash_point(CrashPoint::AfterClone(k + 1));
        }
        drop(reserved);
        helper.go()?;
        Ok(())
    })();
    drop(source_lock);
    // Every clone made: the entry goes before the answer (one left would have the next start
    // undo the clones whose tokens the answer gives out).
    let mut intent = Some(intent);
    let result = result.and_then(|()| intent.take().map_or(Ok(()), Pending::done));
    if let Err(e) = result {
        // The clones go before the journal entry does: a manager killed meanwhile undoes
        // them at its next start.
        drop(made);
        drop(intent);
        manager.event(
            "fork_failed",
            &source.name,
            json!({ "error": e.to_string() }),
        );
        return Err(match e {
            ServeError::VmmFailed(m) => ServeError::VmmFailed(format!(
                "the fork did not make every clone, so no clone was kept: {m}"
            )),
            other => other,
        });
    }
    let mut clones = Vec::with_capacity(made.clones.len());
    for clone in std::mem::take(&mut made.clones) {
        let record = lock(&clone.sandbox.view).clone();
        manager.give_credential(&clone.sandbox, &record);
        let mut described = manager.describe(&clone.sandbox);
        if let Some(o) = described.as_object_mut() {
            o.insert("token".into(), Value::String(clone.token));
        }
        clones.push(described);
    }
    let ms = start.elapsed().as_secs_f64() * 1e3;
    manager.event(
        "forked",
        &source.name,
        json!({
            "clones": names,
            "ms": ms,
            "source_paused_ms": source_paused_ms,
            "copied_bytes": copied_bytes,
        }),
    );
    Ok(Some(json!({
        "source": source.name,
        "clones": clones,
        "ms": ms,
        "snapshot_ms": 0.0,
        "source_paused_ms": source_paused_ms,
        "copied_bytes": copied_bytes,
    })))
}

/// The parent of process `pid`, if it runs.
fn parent_of(pid: u32) -> Option<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("PPid:"))?
        .trim()
        .parse()
        .ok()
}

/// A clone of a live fork while it is made.
struct Clone {
    sandbox: std::sync::Arc<Sandbox>,
    token: String,
    group: Option<crate::cgroup::Group>,
}

/// The clones of a live fork: deleted when dropped with any left in it (a fork that failed).
struct Made<'a> {
    manager: &'a Manager,
    clones: Vec<Clone>,
}

impl Drop for Made<'_> {
    fn drop(&mut self) {
        // A delete ends each one's VMM and removes its memory cgroup and directory.
        for clone in self.clones.drain(..) {
            let _ = self.manager.delete(&clone.sandbox);
        }
    }
}

/// The fork's helper, `mayfly fork --place FILE --hold`: it makes the clones and holds them
/// until told `go` on its stdin; killed if dropped before it has ended.
struct Helper {
    child: std::process::Child,
    log: std::path::PathBuf,
    /// Its stdout, line by line (a thread reads it).
    lines: std::sync::mpsc::Receiver<std::io::Result<String>>,
    /// When it must have made every clone.
    deadline: Instant,
}

impl Helper {
    fn start(
        manager: &Manager,
        source_sock: &std::path::Path,
        count: usize,
        place: &std::path::Path,
        forks: &std::path::Path,
        id: &str,
    ) -> Result<Helper, ServeError> {
        use std::os::unix::process::CommandExt;
        use std::process::{Command, Stdio};
        let log = forks.join(format!("{id}.log"));
        let err = std::fs::File::create(&log).map_err(io_error("make", &log))?;
        let mut command = Command::new(&manager.mayfly);
        command
            .arg("fork")
            .arg("--sock")
            .arg(source_sock)
            .arg("--count")
            .arg(count.to_string())
            .arg("--place")
            .arg(place)
            .arg("--hold")
            .args(&manager.net_args)
            .env("MAYFLY_CONSOLE_LIMIT", manager.console_limit.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(err)
            // Its own process group: a Ctrl-C meant for the manager does not reach it.
            .process_group(0);
        // SAFETY: between fork and exec the closure only calls prctl(2) with plain integers
        // (async-signal-safe). The helper ends with the thread that started it (the fork's,
        // which waits for it), and with it every clone still held.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
        let mut child = command
            .spawn()
            .map_err(io_error("start", &manager.mayfly))?;
        let stdout = child.stdout.take().expect("piped");
        let (sender, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stdout).lines() {
                let end = line.is_err();
                if sender.send(line).is_err() || end {
                    return;
                }
            }
        });
        Ok(Helper {
            child,
            log,
            lines,
            deadline: Instant::now() + HELPER_TIMEOUT,
        })
    }

    /// Its next line of JSON. One that says what failed is that failure, with the status the
    /// fork's error had (a VMM shutting down, a host short of memory, pids or descriptors).
    fn next(&mut self) -> Result<Value, ServeError> {
        let wait = self.deadline.saturating_duration_since(Instant::now());
        let line = match self.lines.recv_timeout(wait) {
            Ok(Ok(line)) if !line.trim().is_empty() => line,
            Ok(_) | Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                let _ = self.child.wait();
                return Err(ServeError::VmmFailed(self.said()));
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return Err(ServeError::VmmFailed(format!(
                    "the clones were not ready within {} s",
                    HELPER_TIMEOUT.as_secs()
                )));
            }
        };
        let said: Value = serde_json::from_str(&line).map_err(|e| {
            ServeError::VmmFailed(format!("the fork's helper said what does not parse: {e}"))
        })?;
        if let Some(error) = said["error"].as_str() {
            let error = error.to_string();
            return Err(match said["status"].as_u64() {
                Some(409) => ServeError::Conflict(error),
                Some(503 | 507) => ServeError::Busy(error),
                _ => ServeError::VmmFailed(error),
            });
        }
        Ok(said)
    }

    /// Wait until it has captured the source.
    fn captured(&mut self) -> Result<(), ServeError> {
        match self.next()? {
            said if said["captured"] == Value::Bool(true) => Ok(()),
            said => Err(ServeError::VmmFailed(format!(
                "the fork's helper said {said} where it had captured its source"
            ))),
        }
    }

    /// What it says of the clones once every one is ready (one line of JSON), or why not.
    fn report(&mut self) -> Result<Value, ServeError> {
        self.next()
    }

    /// Let the clones run, and wait for the helper to end.
    fn go(&mut self) -> Result<(), ServeError> {
        use std::io::Write;
        let told = self
            .child
            .stdin
            .take()
            .map(|mut stdin| stdin.write_all(b"go\n"));
        let status = self.child.wait();
        match (told, status) {
            (Some(Ok(())), Ok(status)) if status.success() => Ok(()),
            _ => Err(ServeError::VmmFailed(self.said())),
        }
    }

    /// The end of what it wrote to its log.
    fn said(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let text = text.trim();
        // Its last 2,000 characters.
        let from = text.char_indices().rev().nth(1999).map_or(0, |(i, _)| i);
        match &text[from..] {
            "" => "the fork's helper ended without a word".into(),
            said => said.to_string(),
        }
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_file(&self.log);
    }
}
