//! A manager's start: what the last manager had in flight finished or undone, its view
//! rebuilt from the records on disk, the VMMs that still run adopted, and nothing left that
//! no one owns. In order:
//!
//! 1. One scan of /proc finds every process started for a control socket (`--api-sock`: see
//!    [`crate::process::VmmsBySocket`]): what finds a VMM whose pid never reached its record.
//! 2. Template builds that never finished are ended and removed, as are fork bases.
//! 3. The journal (see [`crate::journal`]), oldest entry first: a create is undone (its VMM
//!    ended, its directory removed: its name and uid are free, its token never reached
//!    anyone), a fork's clones are all undone, a delete is finished, a wake's VMM not in its
//!    record is ended. Each entry is removed once done.
//! 4. Each sandbox directory: one without a record (made or half removed by a manager older
//!    than the journal) is removed; one whose record cannot be read (an I/O error) is left
//!    as it is, its VMM running on and its name taken, for a later start; one whose record
//!    was read and is not understood is moved, whole, to `<state-dir>/quarantine/NAME-MS/`
//!    for a person to look at (nothing is deleted on a guess, and its name is free again),
//!    its VMM ended; the others are adopted as their records say
//!    (Starting and Deleting: removed; Running and Suspending: adopted, or Dead if their VMM
//!    is gone; a wake cut short: asleep again).
//! 5. Any other process still on a sandbox's socket (not the VMM its record names, nor that
//!    VMM's own children) is ended.
//!
//! Every step says what it did in the event log.

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use crate::files::socket;
use crate::journal::Intent;
use crate::manager::Manager;
use crate::process::{find_process, Vmm, VmmsBySocket};
use crate::records::{load_record, read_record, valid_name, RecordError, State, RECORD};
use crate::sandbox::Sandbox;
use crate::util::{lock, now_ms};

impl Manager {
    /// Rebuild the view from the records on disk (at start): adopt the VMMs that still run,
    /// keep the suspended, finish what a crash interrupted.
    pub fn recover(&self) {
        let vmms = VmmsBySocket::scan();
        self.remove_unfinished_templates(&vmms);
        // Fork bases, and a live fork's placement and helper log, live only while their fork
        // request runs: any left are a killed manager's (its clones, if made, hold links to
        // the files they need).
        if let Ok(entries) = std::fs::read_dir(self.dir.join("forks")) {
            for entry in entries.flatten() {
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    let _ = std::fs::remove_dir_all(entry.path());
                } else {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        }
        self.replay_journal(&vmms);
        let Ok(entries) = std::fs::read_dir(self.dir.join("sandboxes")) else {
            return;
        };
        for entry in entries.flatten() {
            let dir = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if !valid_name(&name) || !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let record = match load_record(&dir) {
                Ok(record) => record,
                Err(RecordError::Unreadable { source, .. })
                    if source.kind() == std::io::ErrorKind::NotFound =>
                {
                    // Made, or half removed, by a manager that kept no journal: no sandbox.
                    let ended = vmms.end(&socket(&dir), None);
                    let removed = std::fs::remove_dir_all(&dir).map_err(|e| e.to_string());
                    self.event(
                        "removed",
                        &name,
                        json!({ "why": "its directory has no record (a create or delete cut short)",
                                "vmms_ended": ended, "error": removed.err() }),
                    );
                    continue;
                }
                Err(e @ RecordError::Unreadable { .. }) => {
                    // An I/O error says nothing of the sandbox: it is left as it is (its VMM
                    // runs on, its directory keeps its name taken) for the next start.
                    self.event(
                        "record_unreadable",
                        &name,
                        json!({ "error": e.to_string(),
                                "why": "left as it is (its name stays taken) until a start reads its record" }),
                    );
                    continue;
                }
                Err(e @ RecordError::Garbled { .. }) => {
                    // Moved aside whole for a person to look at (nothing is deleted on a
                    // guess), so that its name is free again.
                    let ended = vmms.end(&socket(&dir), None);
                    self.quarantine(&name, &dir, &e.to_string(), &ended);
                    continue;
                }
            };
            let sandbox = Arc::new(Sandbox::new(dir.clone(), record, self.uptime_ms()));
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
                    let ended = vmms.end(&socket(&dir), None);
                    let _ = std::fs::remove_dir_all(&dir);
                    self.event(
                        "removed",
                        &name,
                        json!({ "why": "unfinished at the last stop", "vmms_ended": ended }),
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
            // Anything else on its socket is a VMM its record never got to name.
            let strays = vmms.end(&sandbox.socket(), inner.vmm.as_ref().map(Vmm::pid));
            if !strays.is_empty() {
                self.event("strays_ended", &name, json!({ "pids": strays }));
            }
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

    /// Finish or undo what the journal says was in flight (see [`crate::journal`]), oldest
    /// first, each entry removed once done.
    fn replay_journal(&self, vmms: &VmmsBySocket) {
        self.journal.remove_partial();
        for (path, intent) in self.journal.entries() {
            match intent {
                Err(error) => {
                    self.event(
                        "journal_unreadable",
                        "",
                        json!({ "entry": path, "error": error }),
                    );
                }
                Ok(Intent::Create {
                    name,
                    uid,
                    created_ms,
                }) => {
                    let dir = self.dir.join("sandboxes").join(&name);
                    if read_record(&dir).is_ok_and(|r| r.created_ms != created_ms) {
                        // Another sandbox of the name, made after this one was deleted.
                        self.event(
                            "create_gone",
                            &name,
                            json!({ "why": "deleted before the manager stopped" }),
                        );
                    } else {
                        let ended = self.undo_sandbox(&name, vmms);
                        self.event(
                            "create_undone",
                            &name,
                            json!({ "uid": uid, "vmms_ended": ended,
                                    "why": "the manager stopped before the create answered" }),
                        );
                    }
                }
                Ok(Intent::Spawn { name }) => {
                    // The VMM its record names (if its pid was saved) is adopted or ended as
                    // any; another on its socket was started and never recorded.
                    let dir = self.dir.join("sandboxes").join(&name);
                    let keep = read_record(&dir)
                        .ok()
                        .and_then(|r| find_process(&r))
                        .map(|vmm| vmm.pid());
                    let ended = if valid_name(&name) {
                        vmms.end(&socket(&dir), keep)
                    } else {
                        Vec::new()
                    };
                    self.event("spawn_undone", &name, json!({ "vmms_ended": ended }));
                }
                Ok(Intent::Fork { id, source, clones }) => {
                    let mut undone = Vec::new();
                    for clone in &clones {
                        let dir = self.dir.join("sandboxes").join(clone);
                        let ours = valid_name(clone)
                            && read_record(&dir).is_ok_and(|r| r.fork.as_deref() == Some(&id));
                        if ours {
                            self.undo_sandbox(clone, vmms);
                            undone.push(clone.clone());
                        }
                    }
                    self.event(
                        "fork_undone",
                        &source,
                        json!({ "fork": id, "clones_undone": undone,
                                "why": "the manager stopped before the fork answered" }),
                    );
                }
                Ok(Intent::Delete { name, created_ms }) => {
                    let dir = self.dir.join("sandboxes").join(&name);
                    // Only the sandbox it was written for: its record gone (removed first),
                    // or still its own. Another of the name (made after this delete finished,
                    // its entry kept by a try that failed) is left alone.
                    let ours = match (read_record(&dir), created_ms) {
                        (Err(_), _) => std::fs::symlink_metadata(dir.join(RECORD)).is_err(),
                        (Ok(record), Some(ms)) => record.created_ms == ms,
                        (Ok(record), None) => record.state == State::Deleting,
                    };
                    if ours {
                        let ended = self.undo_sandbox(&name, vmms);
                        self.event("delete_finished", &name, json!({ "vmms_ended": ended }));
                    } else {
                        self.event(
                            "delete_gone",
                            &name,
                            json!({ "why": "finished before the manager stopped; the name is another sandbox's now" }),
                        );
                    }
                }
            }
            if let Err(e) = self.journal.remove(&path) {
                self.event(
                    "journal_stuck",
                    "",
                    json!({ "entry": path, "error": e.to_string() }),
                );
            }
        }
    }

    /// End every VMM of sandbox `name` (the one its record names, and any other on its
    /// socket) and remove its directory; returns the pids ended.
    fn undo_sandbox(&self, name: &str, vmms: &VmmsBySocket) -> Vec<u32> {
        // A journal's name only ever names a sandbox's directory.
        if !valid_name(name) {
            return Vec::new();
        }
        let dir = self.dir.join("sandboxes").join(name);
        let mut ended = Vec::new();
        if let Some(mut vmm) = read_record(&dir).ok().and_then(|r| find_process(&r)) {
            ended.push(vmm.pid());
            vmm.kill();
        }
        ended.extend(vmms.end(&socket(&dir), None));
        // Its memory cgroup: the start's sweep left it while the VMM was in it, and whatever
        // of its VMM is still in it ends now (a fork's clone, its jail's waiter still
        // cleaning up after its VMM).
        if let Some(group) = self.groups.path(&format!("s-{name}")) {
            crate::cgroup::end_and_remove(&group);
        }
        match std::fs::remove_dir_all(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                self.event(
                    "remove_failed",
                    name,
                    json!({ "dir": dir, "error": e.to_string() }),
                );
            }
            _ => {}
        }
        ended
    }

    /// Move a sandbox directory whose record cannot be read to `<state-dir>/quarantine/`.
    fn quarantine(&self, name: &str, dir: &std::path::Path, error: &str, ended: &[u32]) {
        let aside = self.dir.join("quarantine");
        let to = aside.join(format!("{name}-{}", now_ms()));
        let moved = std::fs::create_dir_all(&aside)
            .and_then(|()| std::fs::rename(dir, &to))
            .map_err(|e| e.to_string());
        self.event(
            "quarantined",
            name,
            json!({ "error": error, "moved_to": moved.is_ok().then_some(&to),
                    "move_failed": moved.err(), "vmms_ended": ended }),
        );
    }

    /// End the VMMs of template builds a killed manager left, and remove those builds.
    fn remove_unfinished_templates(&self, vmms: &VmmsBySocket) {
        let Ok(entries) = std::fs::read_dir(self.dir.join("templates")) else {
            return;
        };
        for entry in entries.flatten() {
            let dir = entry.path();
            if dir.join("template.json").is_file() {
                continue;
            }
            let record = read_record(&dir).ok();
            if let Some(mut vmm) = record.as_ref().and_then(find_process) {
                vmm.kill();
            }
            vmms.end(&socket(&dir), None);
            if let Some(group) = record
                .as_ref()
                .and_then(|r| self.groups.path(&format!("t-{}", r.name)))
            {
                crate::cgroup::remove(&group);
            }
            let _ = std::fs::remove_dir_all(&dir);
            self.event(
                "template_removed",
                "",
                json!({ "template": entry.file_name().to_string_lossy(), "why": "its build never finished" }),
            );
        }
    }
}
