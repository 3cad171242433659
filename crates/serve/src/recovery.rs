//! A manager's start: its view rebuilt from the records on disk, the VMMs that still run
//! adopted, and what a crash (or `kill -9`) of the last manager interrupted finished. Each
//! record names its VMM by pid and start time, saved first thing at every start, so no VMM
//! is lost; nothing is deleted on a guess (an unreadable record is left for a person).

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use crate::manager::Manager;
use crate::process::find_process;
use crate::records::{read_record, valid_name, State};
use crate::sandbox::Sandbox;
use crate::util::lock;

impl Manager {
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
            let record = match read_record(&dir) {
                Ok(record) => record,
                Err(e) => {
                    // Left alone for a person to look at: nothing is deleted on a guess.
                    self.event("unreadable", &name, json!({ "error": e, "dir": dir }));
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
            let record = read_record(&dir).ok();
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
}
