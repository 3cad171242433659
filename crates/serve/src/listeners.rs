//! The host listeners of exposed guest ports, as the manager holds them (what they do with a
//! connection is `ports.rs`): one per (sandbox, guest port), each stopped by closing the
//! other end of its wake-up socket pair.

use std::collections::BTreeMap;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::util::lock;

/// One listener: how to stop it.
pub struct Listening {
    /// A Unix socket path it bound, removed when it stops.
    pub unix_path: Option<PathBuf>,
    /// Dropping it wakes the listener's thread, which then ends.
    pub stop: UnixStream,
    /// Its connections open now.
    pub open: Arc<AtomicUsize>,
    /// Held while one of its connections has the VMM's side expose the port; true once the
    /// port is closed (no connection may expose it again).
    pub exposing: Arc<Mutex<bool>>,
}

/// Every exposed port's listener, by sandbox name and guest port.
#[derive(Default)]
pub struct PortListeners {
    open: Mutex<BTreeMap<(String, u16), Listening>>,
}

impl PortListeners {
    /// Add a listener; false (and it is stopped) if that port of that sandbox has one.
    pub fn insert(&self, name: &str, guest_port: u16, listening: Listening) -> bool {
        let mut open = lock(&self.open);
        let key = (name.to_owned(), guest_port);
        if open.contains_key(&key) {
            stop(listening);
            return false;
        }
        open.insert(key, listening);
        true
    }

    /// The connections open now on that port's listener, if it has one.
    pub fn connections(&self, name: &str, guest_port: u16) -> Option<usize> {
        lock(&self.open)
            .get(&(name.to_owned(), guest_port))
            .map(|l| l.open.load(Ordering::SeqCst))
    }

    /// Stop one listener; its exposure gate (see [`Listening::exposing`]), if there was one.
    pub fn remove(&self, name: &str, guest_port: u16) -> Option<Arc<Mutex<bool>>> {
        let removed = lock(&self.open).remove(&(name.to_owned(), guest_port))?;
        let gate = Arc::clone(&removed.exposing);
        stop(removed);
        Some(gate)
    }

    /// Stop every listener of `name`.
    pub fn remove_all(&self, name: &str) {
        let mut open = lock(&self.open);
        let keys: Vec<_> = open.keys().filter(|(n, _)| n == name).cloned().collect();
        for key in keys {
            if let Some(listening) = open.remove(&key) {
                stop(listening);
            }
        }
    }
}

fn stop(listening: Listening) {
    drop(listening.stop);
    if let Some(path) = listening.unix_path {
        let _ = std::fs::remove_file(path);
    }
}
