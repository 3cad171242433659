//! The control socket: a small HTTP/1.1 + JSON API on a Unix socket, which `curl
//! --unix-socket` can talk to and [`request`] is the client of.
//!
//! | request             | body                                                  | action                |
//! |---------------------|-------------------------------------------------------|-----------------------|
//! | `GET /vm`           | none                                                  | [`Action::Describe`]  |
//! | `PUT /vm/pause`     | none                                                  | [`Action::Pause`]     |
//! | `PUT /vm/resume`    | none                                                  | [`Action::Resume`]    |
//! | `PUT /vm/snapshot`  | `{"path": "/some/dir", "diff": true}`                 | [`Action::Snapshot`]  |
//! | `PUT /vm/fork`      | `{"count": N, "name_prefix": "s", "parent": "paused", "overcommit": true}`| [`Action::Fork`]      |
//! | `PUT /vm/shutdown`  | none                                                  | [`Action::Shutdown`]  |
//! | `GET /vm/net`       | none                                                  | [`Action::Net`]       |
//! | `PUT /vm/net/policy`| `{"policy": "allow=192.0.2.0/24:443"}`                | [`Action::NetPolicy`] |
//! | `PUT /vm/net/expose`| `{"port": 8080, "on": "tcp:127.0.0.1:0"}`             | [`Action::NetExpose`] |
//!
//! The routes into the guest (exec and files, through the guest agent) are in [`guest`]:
//! `POST /vm/exec`, `PUT|GET|DELETE /vm/files`, `GET /vm/files/stat`, `GET /vm/files/list`,
//! `PUT /vm/files/dir`, `GET /vm/agent`. They are served on the connection's thread and may
//! stream (a chunked response; `PUT /vm/files` streams its body of any size).
//!
//! The server only parses and validates; the VM's controller decides. It receives one
//! [`ApiCall`] per valid request through its own event channel and answers with a [`Reply`].
//! Everything the server refuses gets a JSON body `{"error": "..."}` that says what to send
//! instead: 400 malformed request or body, 404 unknown path, 405 wrong method (with `Allow`),
//! 408 a client too slow to send its request, 411 chunked bodies, 413 a body over 64 KiB,
//! 417 an `Expect` other than `100-continue`, 431 headers over 16 KiB, 505 an HTTP version
//! other than 1.0 and 1.1; 503 the VM is going away, 504 it did not answer within 120 s, 500
//! it answered with something that is not an HTTP status. Otherwise the VM's status and body
//! go back as they are.
//!
//! Each connection is served on a thread of its own (at most [`MAX_CONNECTIONS`] at once) and
//! every response closes its connection (`Connection: close`); stalled clients are dropped
//! after a timeout, so none can block the others, and nothing a client sends can stop the
//! server or the VM.

mod client;
pub mod guest;
pub(crate) mod http;
mod server;
mod socket;

use std::path::PathBuf;
use std::sync::mpsc::Sender;

pub use client::{request, request_with_timeout};
pub use guest::check_exec_body;
pub use server::{read_and_route, routes, ApiServer, SocketClaim, Timeouts, MAX_CONNECTIONS};
pub use socket::MAX_SOCKET_PATH;

/// What a client asks of the VM. The server parses and validates requests into these.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// GET /vm
    Describe,
    /// PUT /vm/pause
    Pause,
    /// PUT /vm/resume
    Resume,
    /// PUT /vm/snapshot  body {"path": "/some/dir", "diff": bool}  (path required, non-empty
    /// string; diff optional, default false: only the pages written since the restore, over
    /// the snapshot restored from, see [`crate::diff`])
    Snapshot { path: PathBuf, diff: bool },
    /// PUT /vm/fork  body {"count": N, "name_prefix": "optional string", "parent":
    /// "running"|"paused" (optional, default "running"), "overcommit": bool (optional,
    /// default false)}. `count` is at most [`MAX_FORK_COUNT`]; whether 0 makes sense is the
    /// VM's call.
    Fork(crate::fork::ForkRequest),
    /// PUT /vm/shutdown
    Shutdown,
    /// GET /vm/net: the NIC's network (policy, addresses, counters).
    Net,
    /// PUT /vm/net/policy  body {"policy": "none"|"open"|"allow=..."}: the egress policy now.
    NetPolicy(mayfly_network::Policy),
    /// PUT /vm/net/expose  body {"port": N, "on": "tcp:ADDR:PORT"|"unix:PATH" (optional,
    /// default tcp:127.0.0.1:0, a free loopback port)}: guest port N reachable on the host.
    NetExpose {
        port: u16,
        on: mayfly_network::ExposeOn,
    },
}

/// What the server serves itself, off the controller's thread: requests that stream (exec,
/// files) go straight to the guest's agent over the VM's vsock socket.
#[derive(Clone, Debug, Default)]
pub struct Services {
    /// The VM's vsock socket (host side), if it has one.
    pub vsock: Option<PathBuf>,
    /// The VMM's refresh of the guest after a restore or fork: guest routes wait for it.
    pub refresh: std::sync::Arc<crate::agent::RefreshStatus>,
}

/// The largest `count` the server passes on in a fork request: the fork path's own limit, so
/// that the two cannot disagree.
pub const MAX_FORK_COUNT: u32 = crate::fork::MAX_CLONES;

/// The VM's answer: an HTTP status and an optional JSON body.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    pub status: u16,
    pub body: Option<serde_json::Value>,
    /// Kept until the answer is written (or cannot be), then dropped.
    pub until_written: UntilWritten,
}

/// What a reply keeps until it is written: told that the answer reached the client's socket
/// (or never told, if it did not), then dropped. A fork's held clones run when it is dropped
/// after the answer went out (so that the answer goes out before they all take the CPU), and
/// stop if it never did. Compares equal to any other.
#[derive(Clone, Default)]
pub struct UntilWritten(Option<std::sync::Arc<dyn Delivery>>);

/// Kept by a reply until it is written (see [`Reply::keeping`]).
pub trait Delivery: Send + Sync {
    /// The answer was written whole to the client's socket.
    fn delivered(&self) {}
}

impl UntilWritten {
    /// The answer was written whole: say so to what the reply keeps.
    pub fn delivered(&self) {
        if let Some(kept) = &self.0 {
            kept.delivered();
        }
    }
}

impl std::fmt::Debug for UntilWritten {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "held" } else { "none" })
    }
}

impl PartialEq for UntilWritten {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Reply {
    /// 200 with a body.
    pub fn ok(body: serde_json::Value) -> Self {
        Self {
            status: 200,
            body: Some(body),
            until_written: UntilWritten::default(),
        }
    }

    /// 204: done, nothing to say.
    pub fn no_content() -> Self {
        Self {
            status: 204,
            body: None,
            until_written: UntilWritten::default(),
        }
    }

    /// An error status with the body `{"error": message}`. Say what went wrong and what to do.
    pub fn error(status: u16, message: impl Into<String>) -> Self {
        Self {
            status,
            body: Some(serde_json::json!({ "error": message.into() })),
            until_written: UntilWritten::default(),
        }
    }

    /// Keep `value` until this reply has been written (or could not be), then drop it; it is
    /// told first if the answer was written ([`Delivery::delivered`]).
    pub fn keeping(mut self, value: impl Delivery + 'static) -> Self {
        self.until_written = UntilWritten(Some(std::sync::Arc::new(value)));
        self
    }
}

/// One request handed to the VM's controller, which answers through `reply`.
#[derive(Debug)]
pub struct ApiCall {
    pub action: Action,
    pub reply: Sender<Reply>,
}

impl ApiCall {
    /// Answer the call. A client that has gone away is not the controller's problem, so a
    /// failed send is ignored.
    pub fn respond(self, reply: Reply) {
        let _ = self.reply.send(reply);
    }
}

/// What can go wrong serving or using the control socket.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("the API socket path {path} is {len} bytes long, but a Unix socket path can have at most {MAX_SOCKET_PATH}: choose a shorter --api-sock path")]
    PathTooLong { path: String, len: usize },
    #[error(
        "the API socket path {0:?} is not valid: it must be a non-empty path without NUL bytes"
    )]
    InvalidPath(String),
    #[error("cannot create the API socket {path}: {dir} {problem}")]
    Directory {
        path: String,
        dir: String,
        problem: &'static str,
    },
    #[error("the API socket {path} is in use: another mayfly (or another program) listens on it; stop it or choose another --api-sock path")]
    InUse { path: String },
    #[error("{path} exists and is not a socket: remove it or choose another --api-sock path")]
    NotASocket { path: String },
    #[error("cannot create the API socket {path}: {source}")]
    Bind {
        path: String,
        source: std::io::Error,
    },
    #[error("cannot start the API server thread: {0}")]
    Thread(std::io::Error),
    #[error("no mayfly listens on {path}: is the VM running with --api-sock {path}?")]
    NotListening { path: String },
    #[error("permission denied connecting to {path}: the API socket belongs to the user who started the VM; run as that user (or root)")]
    PermissionDenied { path: String },
    #[error("cannot connect to the mayfly API socket {path}: {source}")]
    Connect {
        path: String,
        source: std::io::Error,
    },
    #[error("lost the connection to mayfly on {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("mayfly on {path} did not answer within {secs} s: the VM may be stuck; try again or stop it")]
    Timeout { path: String, secs: u64 },
    #[error("mayfly on {path} sent an invalid response: {reason}")]
    InvalidResponse { path: String, reason: String },
    #[error("invalid API request: {0}")]
    InvalidRequest(String),
}

#[cfg(test)]
mod tests;
