//! The fork's messages between the forking VMM, its zygote and the clones, on one
//! SOCK_SEQPACKET socket: what each clone is (its name, index and files), the zygote's and the
//! clones' reports, and the word that lets the clones go.

use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// One clone: what the fork asks the zygote for, and what the fork's answer lists.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CloneInfo {
    pub name: String,
    pub index: u32,
    /// Its process (0 until the zygote has forked it).
    pub pid: u32,
    /// Its control socket.
    pub api_sock: PathBuf,
    /// Its serial console's output.
    pub console_log: PathBuf,
    /// A FIFO: what is written to it is typed into the clone's serial console.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub console_input: Option<PathBuf>,
    /// Its vsock socket (the guest agent is reached through it).
    pub vsock: PathBuf,
    /// Its vsock CID, its own.
    pub vsock_cid: u64,
    /// Where its writable disks keep their own layers (on the parent's frozen chain).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub disk_dir: Option<PathBuf>,
    /// Where its NIC's network is made (its parent's settings; it gets a namespace and a MAC
    /// of its own), if the parent has a NIC.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub net: Option<crate::devices::net::NetSettings>,
    /// The jail it makes itself before anything of its VM, as its parent's is (a fork of a
    /// jailed VM, made from outside it: see [`crate::persist::fork::fork_from_outside`]):
    /// namespaces, a cgroup and a root of its own, and its parent's uid.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub jail: Option<mayfly_jail::jail::JailConfig>,
    /// A jailed clone's VMM (`pid` is then its jail's waiter, which the VMM dies with, and
    /// which ends as the VMM does).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub vmm_pid: Option<u32>,
    /// Its NIC's policy, when not the one its parent's state holds.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub policy: Option<String>,
    /// Layers its parent's state names under `.0` are opened at the same place under `.1`,
    /// and none outside `.1` (a sandbox manager's clone, see
    /// [`crate::devices::config::RestoreTargets::layers_moved`]).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub layers_moved: Option<(PathBuf, PathBuf)>,
    /// From the fork request until this clone reported that it is ready to run.
    #[serde(default)]
    pub ready_ms: f64,
}

/// A message on the fork's socket (a SOCK_SEQPACKET pair: one message is one datagram, and
/// the forking VMM sees the end of the stream once the zygote and every clone have closed
/// theirs).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Message {
    /// Forking VMM → zygote: start this clone (its console log attached).
    Start {
        parent: String,
        clone: Box<CloneInfo>,
    },
    /// Zygote → forking VMM: the snapshot cannot be restored here; no clone will start.
    Unusable { reason: String },
    /// Zygote → forking VMM: the clone's process (its pidfd attached).
    Forked { index: u32, pid: u32 },
    /// Zygote → forking VMM: no process for this clone.
    NotForked { index: u32, reason: String },
    /// Clone → forking VMM: it is restored and ready to run (its own pidfd attached, so that the forking VMM
    /// can stop it even if the zygote's word on it never comes).
    Ready { index: u32, pid: u32 },
    /// Forking VMM → zygote: the fork failed; kill every clone process you made, reap them,
    /// and exit.
    Abort,
    /// Clone → forking VMM: it could not start (it exits).
    Failed { index: u32, reason: String },
    /// Zygote → forking VMM: a clone's process ended.
    Exited { index: u32, status: String },
    /// Forking VMM → its clones, as it lets them go: the fork succeeded. A clone that sees the
    /// forking VMM's end close without this queued (the VMM died mid-fork, or its answer
    /// reached nobody) stops.
    Go,
}

/// Longest message either side sends or takes (the socket's default send buffer holds a
/// few). A reason is cut to `MAX_REASON` bytes first, so even escaped six to a byte in JSON it
/// fits; a request whose paths do not fit is refused before it is sent.
pub(crate) const MAX_MESSAGE: usize = 64 << 10;
pub(crate) const MAX_REASON: usize = 2 << 10;

#[derive(Debug, thiserror::Error)]
pub enum ZygoteError {
    #[error("cannot {what}: {source}")]
    Io {
        what: &'static str,
        source: std::io::Error,
    },
    #[error("the fork's snapshot cannot be restored on this host: {0}")]
    Unusable(String),
    #[error("clone {name} did not start: {reason} (its console log: {log}); the fork's other clones were stopped ({killed} processes killed)")]
    CloneFailed {
        name: String,
        reason: String,
        log: PathBuf,
        /// Processes of this fork killed for it (the failed clone's own included, if made).
        killed: usize,
    },
    #[error(
        "the fork's zygote broke its protocol: {0} (this is a bug in mayfly; please report it)"
    )]
    Protocol(&'static str),
}

pub(crate) fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> ZygoteError {
    move |source| ZygoteError::Io { what, source }
}

/// A message as sent, or `None` if it cannot be (a path that is not UTF-8, or more than
/// `MAX_MESSAGE` bytes of it).
pub(crate) fn encode(message: &Message) -> Option<Vec<u8>> {
    serde_json::to_vec(message)
        .ok()
        .filter(|bytes| bytes.len() <= MAX_MESSAGE)
}

/// The longest start of `text` of at most `max` bytes that ends at a character boundary.
pub(crate) fn prefix(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// `reason` cut to at most `MAX_REASON` bytes.
pub(crate) fn cut(reason: &str) -> String {
    prefix(reason, MAX_REASON).to_string()
}

/// Send a message that always encodes (no paths in it; its reason cut); errors are the
/// receiver's to notice (it then fails the clone for want of a word).
pub(crate) fn send(socket: &UnixDatagram, message: &Message) {
    if let Some(bytes) = encode(message) {
        let _ = socket.send(&bytes);
    }
}
