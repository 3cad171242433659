//! What a client asks of the VM: the actions the server parses requests into, and the call
//! that carries one to the VM's controller with the way back for its [`Reply`].

use std::path::PathBuf;
use std::sync::mpsc::Sender;
use std::time::Duration;

use crate::reply::Reply;

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
    /// the snapshot restored from, see the VMM's memory/diff.rs)
    Snapshot { path: PathBuf, diff: bool },
    /// PUT /vm/fork  body {"count": N, "name_prefix": "optional string", "parent":
    /// "running"|"paused" (optional, default "running"), "overcommit": bool (optional,
    /// default false)}. `count` is at most [`MAX_FORK_COUNT`]; whether 0 makes sense is the
    /// VM's call.
    Fork(ForkRequest),
    /// PUT /vm/fork/capture  body as [`Action::Fork`]: the first half of a fork made from
    /// outside the VMM, for a jailed VM (its clones need jails of their own, which only root
    /// outside can make): pause, capture the state and freeze the memory, and hold both as
    /// descriptors that root takes from this process (pidfd_getfd) by the numbers answered.
    ForkCapture(ForkRequest),
    /// PUT /vm/fork/release: let go of what the last capture holds.
    ForkCaptureRelease,
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
    /// PUT /vm/net/unexpose  body {"port": N, "on": "tcp:ADDR:PORT"|"unix:PATH" (optional)}:
    /// guest port N no longer reachable on the host at `on` (as `host` answered it), or at
    /// any endpoint without it; each closes with its open connections.
    NetUnexpose {
        port: u16,
        on: Option<mayfly_network::ExposeOn>,
    },
}

/// The most clones one fork request may ask for: more than this in one request is a mistake,
/// not a plan. The server refuses a larger `count`; the fork path holds to the same bound.
pub const MAX_FORK_COUNT: u32 = 10_000;

/// How long a fork waits for its clones to be ready before it gives up on them (and stops
/// them); requests into a clone its fork still holds wait as long.
pub const FORK_READY_TIMEOUT: Duration = Duration::from_secs(120);

/// What a fork request asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForkRequest {
    pub count: u32,
    /// Clones are named `<prefix><n>`; default `<parent's name>-`.
    pub name_prefix: Option<String>,
    /// Leave the parent paused after the fork.
    pub parent_paused: bool,
    /// Count only what starting the clones costs the host (their VMMs), not the guest memory
    /// they will go on to write: for many clones that stay idle, or a host whose cgroups
    /// bound what each may use.
    pub overcommit: bool,
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
