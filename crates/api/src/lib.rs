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
//! | `PUT /vm/fork/capture` | as `PUT /vm/fork` (a jailed VM, forked from outside) | [`Action::ForkCapture`] |
//! | `PUT /vm/fork/release` | none                                               | [`Action::ForkCaptureRelease`] |
//! | `PUT /vm/shutdown`  | none                                                  | [`Action::Shutdown`]  |
//! | `GET /vm/net`       | none                                                  | [`Action::Net`]       |
//! | `PUT /vm/net/policy`| `{"policy": "allow=192.0.2.0/24:443"}`                | [`Action::NetPolicy`] |
//! | `PUT /vm/net/expose`| `{"port": 8080, "on": "tcp:127.0.0.1:0"}`             | [`Action::NetExpose`] |
//! | `PUT /vm/net/unexpose`| `{"port": 8080}`                                    | [`Action::NetUnexpose`] |
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

pub mod action;
pub mod body;
pub mod client;
pub mod error;
pub mod guest;
pub mod http;
pub mod reply;
pub mod route;
pub mod server;

pub use action::{Action, ApiCall, ForkRequest, FORK_READY_TIMEOUT, MAX_FORK_COUNT};
pub use client::{request, request_with_server, request_with_timeout};
pub use error::ApiError;
pub use guest::{check_exec_body, GuestRoutes};
pub use reply::{Delivery, Reply, UntilWritten};
pub use route::{parse_expose_on, read_and_route, routes};
pub use server::{ApiServer, Timeouts, MAX_CONNECTIONS, MAX_GUEST_CALLS};

#[cfg(test)]
mod tests;

/// Where a jailed VM's network is served: its control socket with `.net` added. The jail's
/// waiter, outside the jail, keeps the VM's network and, once the VM has one, answers
/// `GET /vm/net`, `PUT /vm/net/policy`, `PUT /vm/net/expose` and `PUT /vm/net/unexpose` there
/// (mode 0600: root only); the VM's own socket refuses to change a jailed VM's policy or
/// expose its ports.
pub fn network_socket(api_sock: &std::path::Path) -> std::path::PathBuf {
    let mut path = api_sock.as_os_str().to_owned();
    path.push(".net");
    std::path::PathBuf::from(path)
}
