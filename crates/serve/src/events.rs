//! The event log: one JSON line per life-cycle event (`{"ts_ms", "event", "sandbox", ...}`),
//! appended to `<state-dir>/events.jsonl` (mode 0600) and written to stderr.
//!
//! Its own type so that what runs apart from the manager (a template's build, a credential
//! given from a thread of its own) reports the same way.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Mutex;

use serde_json::{json, Value};

use crate::error::ServeError;
use crate::util::{io_error, lock, now_ms};

pub struct EventLog {
    file: Mutex<std::fs::File>,
}

impl EventLog {
    /// Open (or make) the log at `path`, to append to.
    pub fn open(path: &Path) -> Result<EventLog, ServeError> {
        let file = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o600)
            .open(path)
            .map_err(io_error("open", path))?;
        Ok(EventLog {
            file: Mutex::new(file),
        })
    }

    /// One life-cycle event: a JSON line in the event log, and on stderr.
    pub fn write(&self, event: &str, sandbox: &str, detail: Value) {
        let mut line = json!({ "ts_ms": now_ms(), "event": event, "sandbox": sandbox });
        if let (Some(line), Value::Object(detail)) = (line.as_object_mut(), detail) {
            line.extend(detail);
        }
        let text = format!("{line}\n");
        let _ = lock(&self.file).write_all(text.as_bytes());
        eprint!("mayfly serve: {text}");
    }
}
