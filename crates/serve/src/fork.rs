//! Forks through the manager: `POST /sandboxes/NAME/fork` makes N new sandboxes, each a
//! copy-on-write restore of one snapshot of NAME, each with a name and a token of its own.
//!
//! 1. The source sleeps: a running one is suspended (snapshot, then its VMM exits) and woken
//!    again once the base is made; a sleeping one is not woken. Root touches what a VMM wrote
//!    only while no process of that VMM's uid runs, as before every wake.
//! 2. Its snapshot becomes a **fork base** in `<state-dir>/forks/<id>/`: linked there, checked
//!    to hold nothing but plain files, its disk layers gathered in, and sealed: root's and
//!    read-only, the files the source keeps using copied (see [`seal`]), so no VMM can change
//!    what the clones restore after the fact.
//! 3. Each clone is created as any sandbox is: the base is hard-linked into its own
//!    `vm/base/` (nothing is copied; every clone's RAM maps the same files, so the page cache
//!    holds the base once) and restored from there with the clock, entropy and identity
//!    refreshed (its name is its own). Up to [`PARALLEL`] are started at once.
//! 4. The fork base is removed: the clones' links keep its files for as long as any clone
//!    needs them.
//!
//! A fork that fails part-way deletes the clones it made: all of them or none.

use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use serde::Deserialize;
use serde_json::{json, Value};

use crate::sandbox::{now_ms, valid_name, Manager, Sandbox, Spec};
use crate::ServeError;

/// The most clones one request makes.
pub const MAX_CLONES: usize = 64;
/// Clones started at once.
const PARALLEL: usize = 4;
/// A sandbox's own links to the snapshot it was made from, in its `vm/`.
pub const BASE: &str = "base";

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

fn io_error(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> ServeError {
    let path = path.display().to_string();
    move |source| ServeError::Io { what, path, source }
}

/// Hard-link the tree `from` (plain files and directories only) at `to`, a new directory.
fn link_tree(from: &Path, to: &Path) -> io::Result<()> {
    std::fs::create_dir(to)?;
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(0o755))?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let kind = entry.file_type()?;
        let target = to.join(entry.file_name());
        if kind.is_dir() {
            link_tree(&entry.path(), &target)?;
        } else if kind.is_file() {
            std::fs::hard_link(entry.path(), &target)?;
        } else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{} is not a plain file or directory",
                    entry.path().display()
                ),
            ));
        }
    }
    Ok(())
}

/// Hard-link a snapshot at `to` (a new directory); nothing is left of `to` if it fails.
pub(super) fn link_snapshot(from: &Path, to: &Path) -> Result<(), ServeError> {
    link_tree(from, to).map_err(|e| {
        let _ = std::fs::remove_dir_all(to);
        io_error("link the snapshot at", to)(e)
    })
}

/// Link `snapshot` into a sandbox's `vm/base/` and return that path; `None` when the snapshot
/// is on another file system (a snapshot the user gave: it is then restored where it is).
pub(super) fn link_base(snapshot: &Path, vm_dir: &Path) -> Result<Option<PathBuf>, ServeError> {
    let base = vm_dir.join(BASE);
    match link_tree(snapshot, &base) {
        Ok(()) => Ok(Some(base)),
        Err(e) => {
            let _ = std::fs::remove_dir_all(&base);
            if e.raw_os_error() == Some(libc::EXDEV) {
                Ok(None)
            } else {
                Err(io_error("link the snapshot into the sandbox as", &base)(e))
            }
        }
    }
}

/// Make a fork base root's and read-only, all through, so no VMM can change what the clones
/// restore: a file root already owns (a template's, linked in) is kept, one whose only name is
/// here becomes root's, and one the source shares with its own snapshot (a hard link) is
/// replaced by a copy of root's (holes kept), so the source's files stay its own (it links
/// them into its next snapshot) and nothing of it reaches the clones. Called only while no
/// process of the source's uid runs.
pub(super) fn seal(dir: &Path) -> Result<(), ServeError> {
    crate::sandbox::check_plain(dir)?;
    seal_tree(dir).map_err(io_error("seal (make root's and read-only)", dir))
}

fn seal_tree(path: &Path) -> io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::symlink_metadata(path)?;
    if meta.is_dir() {
        std::os::unix::fs::lchown(path, Some(0), Some(0))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))?;
        for entry in std::fs::read_dir(path)? {
            seal_tree(&entry?.path())?;
        }
    } else if meta.is_file() {
        if meta.uid() != 0 {
            if meta.nlink() == 1 {
                // Its only name is here and no process of its uid runs: root's in place.
                std::os::unix::fs::lchown(path, Some(0), Some(0))?;
            } else {
                copy_as_root(path)?;
            }
        }
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o444))?;
    } else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} is not a plain file or directory", path.display()),
        ));
    }
    Ok(())
}

/// Replace `path` by a copy of root's: its data extents copied, its holes left holes.
fn copy_as_root(path: &Path) -> io::Result<()> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let from = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    let len = from.metadata()?.len();
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    let tmp = path.with_file_name(format!(".{}.sealing", name.unwrap_or_default()));
    let to = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    let copied = (|| {
        to.set_len(len)?;
        let mut buf = vec![0u8; 1 << 20];
        for (start, size) in mayfly_sys::extents::data_extents(&from, 0, len)? {
            let mut done = 0u64;
            while done < size {
                let want =
                    usize::try_from((size - done).min(buf.len() as u64)).unwrap_or(buf.len());
                let n = from.read_at(&mut buf[..want], start + done)?;
                if n == 0 {
                    break;
                }
                to.write_all_at(&buf[..n], start + done)?;
                done += n as u64;
            }
        }
        to.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if copied.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    copied
}

/// The clones' names: the ones asked for, or `NAME-k` for the first free k.
fn clone_names(
    manager: &Manager,
    source: &str,
    request: &ForkRequest,
) -> Result<Vec<String>, ServeError> {
    let bad = |m: String| Err(ServeError::BadRequest(m));
    let names =
        match (&request.names, request.count) {
            (Some(names), None) => names.clone(),
            (Some(names), Some(count)) if count == names.len() => names.clone(),
            (Some(_), Some(_)) => return bad("\"count\" and \"names\" disagree: give one".into()),
            (None, Some(count)) => {
                if count == 0 || count > MAX_CLONES {
                    return bad(format!("\"count\" must be 1 to {MAX_CLONES}"));
                }
                let mut names = Vec::with_capacity(count);
                let mut k = 1usize;
                while names.len() < count {
                    let name = format!("{source}-{k}");
                    if !valid_name(&name) {
                        return bad(format!(
                            "{name:?} would be too long for a sandbox name: give the clones' \
                         \"names\""
                        ));
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
                        ..Spec::default()
                    };
                    scope.spawn(move || {
                        manager
                            .create(name, spec)
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
    if let Some(pos) = made.iter().position(Result::is_err) {
        // All or none: the clones that were made are deleted.
        for clone in made.iter().flatten() {
            if let Some(sandbox) = clone["name"].as_str().and_then(|n| manager.get(n)) {
                let _ = manager.delete(&sandbox);
            }
        }
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
