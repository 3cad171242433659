//! The idle watch, a pass every quarter second: it suspends sandboxes idle past their
//! timeout, notices VMMs that ended on their own, deletes sandboxes asleep past
//! `--expire-after` and collects templates unused past `--template-ttl`. Each sandbox is
//! looked after on a thread of its own, only when its lock is free: a VMM slow to snapshot
//! or to die holds up only its own sandbox.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::config::VMM_LOG_LIMIT;
use crate::manager::Manager;
use crate::process::{trim_log, Vmm};
use crate::records::{Record, State};
use crate::sandbox::Sandbox;
use crate::util::{lock, now_ms};

/// How often templates are looked at for collection (at most; sooner with a shorter TTL).
const TEMPLATE_CHECK_EVERY: Duration = Duration::from_secs(60);
/// How often the disk the sandboxes keep is measured against the budget (every start
/// measures it too).
const DISK_CHECK_EVERY: Duration = Duration::from_secs(5);

impl Manager {
    /// One pass of the idle watch: suspend sandboxes idle past their timeout, notice VMMs
    /// that ended, reap.
    pub fn watch_once(self: &Arc<Self>) {
        self.collect_templates();
        self.measure_disk();
        for (key, log) in self.templates.vmm_logs() {
            if let Ok(true) = trim_log(&log, VMM_LOG_LIMIT) {
                self.event(
                    "vmm_log_trimmed",
                    "",
                    json!({ "limit": VMM_LOG_LIMIT, "template": key }),
                );
            }
        }
        let all = self.all();
        for sandbox in all {
            // A VMM's log is kept under its cap whatever its VMM writes.
            let log = crate::files::vmm_log(sandbox.dir());
            if let Ok(true) = trim_log(&log, VMM_LOG_LIMIT) {
                self.event(
                    "vmm_log_trimmed",
                    &sandbox.name,
                    json!({ "limit": VMM_LOG_LIMIT }),
                );
            }
            let view = lock(&sandbox.view).clone();
            if view.state == State::Suspended {
                self.expire_if_due(&sandbox, &view);
                continue;
            }
            if view.state != State::Running {
                continue;
            }
            let idle_ms = sandbox.idle_ms(self.uptime_ms());
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
        let touched_ms = now_ms().saturating_sub(sandbox.idle_ms(self.uptime_ms()));
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

    /// Measure the disk the sandboxes keep (running ones' disk layers grow as their guests
    /// write) every few seconds: crossing the budget is an event (starts are refused then,
    /// see `reserve_memory`), as is coming back under it.
    fn measure_disk(&self) {
        {
            let mut checked = lock(&self.disk_checked);
            if checked.is_some_and(|t| t.elapsed() < DISK_CHECK_EVERY) {
                return;
            }
            *checked = Some(Instant::now());
        }
        let over = self.disk.over(&|| self.disk_in_use());
        let was = self.disk_over.swap(over.is_some(), Ordering::SeqCst);
        match over {
            Some((kept, budget)) if !was => self.event(
                "disk_over_budget",
                "",
                json!({ "disk_bytes": kept, "budget_bytes": budget }),
            ),
            None if was => self.event("disk_within_budget", "", json!({})),
            _ => {}
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
        let all = self.all();
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
        let idle_ms = sandbox.idle_ms(self.uptime_ms());
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
