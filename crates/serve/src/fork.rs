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
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let names = clone_names(manager, &source.name, request)?;
    // The clones get the source's policy (as its waiter last said it, not the snapshot's:
    // its VMM wrote that one); its names must still resolve, or every clone would fail.
    let net = crate::util::lock(&source.view).net_policy.clone();
    manager.check_names("the source's policy", net.as_deref())?;
    let start = Instant::now();
    let forks = manager.state_dir().join("forks");
    std::fs::create_dir_all(&forks).map_err(io_error("make", &forks))?;
    let id = format!(
        "{}-{}-{}",
        source.name,
        now_ms(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    );
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
