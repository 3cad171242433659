//! The manager's intent journal: what it is about to do, on disk before it does it, so that a
//! manager killed part-way (a crash, `kill -9`) leaves nothing a new one cannot finish or
//! undo.
//!
//! A record (`records.rs`) says where a sandbox is once it exists; the steps around it are
//! where a crash used to leave something no one owned: a VMM started but not yet in its
//! record, a directory made before its first record (or half removed by a delete), a fork's
//! clones made before the fork answered (their tokens never reached anyone). Each such
//! operation first writes an [`Intent`] as one small file in `<state-dir>/journal/`
//! (atomically: the file synced, renamed into place, the directory synced) and removes it
//! (the directory synced again) once what it did is in the records for good, or undone:
//!
//! | intent   | written                                  | removed                          | a new manager finds it and |
//! |----------|------------------------------------------|----------------------------------|----------------------------|
//! | `create` | the name taken, before its directory     | the create answered or undone    | undoes it: ends any VMM on its socket, removes its directory (the name and uid are free again; its token was never handed out) |
//! | `spawn`  | before a wake starts a VMM               | the VMM's pid in the record      | ends any VMM on the sandbox's socket that its record does not name |
//! | `fork`   | the source's snapshot made, before the clones | every clone made, or all undone | undoes every clone made for it (their records name the fork); the source stays as its record says |
//! | `delete` | before anything of the sandbox goes      | its directory gone (with any entry an earlier try of it kept) | finishes it, unless the name's record is another sandbox's (its `created_ms` differs) |
//!
//! The new manager does this (see [`crate::recovery`]) before it adopts anything. A VMM is
//! found by its record's pid and start time, or, when the record never got one, by its
//! command line: every VMM the manager starts is given its sandbox's socket path
//! (`--api-sock`), unique to that sandbox (see [`crate::process::end_strays`]).
//!
//! An operation that answers removes its entry with [`Pending::done`] first, and is undone
//! instead of answered if that fails (the entry would have the next start undo it). An entry
//! is otherwise removed when its [`Pending`] is dropped, except while a panic unwinds (the
//! next start then finishes or undoes it) or when [`Pending::keep`] says so (a delete whose
//! directory could not be removed is finished by the next start).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::error::ServeError;
use crate::util::{io_error, now_ms, write_atomically};

/// What the manager is about to do (see the module's table).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Intent {
    /// A create of `name` (as `uid`, when jailed), its record's `created_ms` this one's: a
    /// sandbox of the name whose record says otherwise is another (made after this create's
    /// sandbox was deleted) and is left alone.
    Create {
        name: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        uid: Option<u32>,
        created_ms: u64,
    },
    /// A VMM started for a wake of `name`.
    Spawn { name: String },
    /// A fork of `source` into `clones`; each clone's record names the fork by `id`.
    Fork {
        id: String,
        source: String,
        clones: Vec<String>,
    },
    /// A delete of `name`, its record's `created_ms` this one's: a sandbox of the name whose
    /// record says otherwise is another (made after this delete finished) and is left alone.
    /// Entries written before this field have none: they finish only a sandbox whose record
    /// is gone or says Deleting.
    Delete {
        name: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        created_ms: Option<u64>,
    },
}

impl Intent {
    fn kind(&self) -> &'static str {
        match self {
            Intent::Create { .. } => "create",
            Intent::Spawn { .. } => "spawn",
            Intent::Fork { .. } => "fork",
            Intent::Delete { .. } => "delete",
        }
    }
}

/// `<state-dir>/journal/`: one file per operation in flight.
pub struct Journal {
    dir: PathBuf,
}

/// An operation's entry in the journal, removed when dropped (see the module's docs).
#[must_use = "the entry is removed when this is dropped"]
pub struct Pending {
    path: Option<PathBuf>,
}

/// Sync a directory, so that a name made or removed in it stays so after a power cut.
fn sync_dir(dir: &Path) -> Result<(), ServeError> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_error("sync", dir))
}

impl Journal {
    /// Open (or make) the journal in the state directory `state_dir`.
    pub fn open(state_dir: &Path) -> Result<Journal, ServeError> {
        let dir = state_dir.join("journal");
        std::fs::create_dir_all(&dir).map_err(io_error("make", &dir))?;
        Ok(Journal { dir })
    }

    /// Write `intent` for good, before the step it announces.
    pub fn begin(&self, intent: &Intent) -> Result<Pending, ServeError> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        // Sorted by name, the entries are in the order they were written.
        let path = self.dir.join(format!(
            "{:016}-{:08}-{}.json",
            now_ms(),
            SEQ.fetch_add(1, Ordering::Relaxed),
            intent.kind()
        ));
        let bytes = serde_json::to_vec(intent).unwrap_or_default();
        write_atomically(&path, &bytes)?;
        Ok(Pending { path: Some(path) })
    }

    /// Every entry, oldest first: its file and its intent (or why it cannot be read).
    pub fn entries(&self) -> Vec<(PathBuf, Result<Intent, String>)> {
        let Ok(listing) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut paths: Vec<PathBuf> = listing
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        paths.sort();
        paths
            .into_iter()
            .map(|path| {
                let intent = std::fs::read(&path)
                    .map_err(|e| e.to_string())
                    .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()));
                (path, intent)
            })
            .collect()
    }

    /// Remove what a write cut short left (an entry's temporary file, never renamed into
    /// place: its operation had not started).
    pub fn remove_partial(&self) {
        let Ok(listing) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for entry in listing.flatten() {
            if entry.file_name().to_string_lossy().starts_with('.') {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }

    /// Remove every entry announcing `intent` (a delete tried again removes the entries its
    /// earlier tries kept); returns how many.
    pub fn remove_all(&self, intent: &Intent) -> Result<usize, ServeError> {
        let mut removed = 0;
        for (path, found) in self.entries() {
            if found.as_ref() == Ok(intent) {
                self.remove(&path)?;
                removed += 1;
            }
        }
        Ok(removed)
    }

    /// Remove an entry once what it announced is finished or undone.
    pub fn remove(&self, path: &Path) -> Result<(), ServeError> {
        match std::fs::remove_file(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(io_error("remove", path)(e))
            }
            _ => {}
        }
        sync_dir(&self.dir)
    }
}

impl Pending {
    /// Remove the entry, what it announced done for good (before its answer): an error means
    /// the entry may still be there, and the next start would undo what it announced, so the
    /// caller undoes it now rather than answer.
    pub fn done(mut self) -> Result<(), ServeError> {
        let Some(path) = self.path.take() else {
            return Ok(());
        };
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(io_error("remove the journal entry", &path)(e));
            }
            _ => {}
        }
        path.parent().map_or(Ok(()), sync_dir)
    }

    /// Leave the entry for the next start to finish what it announced.
    pub fn keep(mut self) {
        self.path = None;
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        if let Some(path) = self.path.take() {
            let _ = std::fs::remove_file(&path);
            if let Some(dir) = path.parent() {
                let _ = sync_dir(dir);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_lasts_until_its_operation_is_done_or_kept() {
        let dir = std::env::temp_dir().join(format!("mayfly-journal-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let journal = Journal::open(&dir).unwrap();
        let create = Intent::Create {
            name: "a".into(),
            uid: Some(7),
            created_ms: 1,
        };
        let fork = Intent::Fork {
            id: "f".into(),
            source: "a".into(),
            clones: vec!["b".into(), "c".into()],
        };
        let first = journal.begin(&create).unwrap();
        let second = journal.begin(&fork).unwrap();
        let found: Vec<Intent> = journal
            .entries()
            .into_iter()
            .map(|(_, i)| i.unwrap())
            .collect();
        assert_eq!(found, vec![create.clone(), fork]);
        drop(second);
        first.keep();
        let left = journal.entries();
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].1, Ok(create));
        journal.remove(&left[0].0).unwrap();
        assert!(journal.entries().is_empty());
        // A write cut short before its rename leaves a temporary file: no entry, removed.
        let partial = dir.join("journal").join(".1-create.json.tmp-1");
        std::fs::write(&partial, b"{").unwrap();
        assert!(journal.entries().is_empty());
        journal.remove_partial();
        assert!(!partial.exists());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
