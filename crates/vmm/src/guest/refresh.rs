//! The refresh of the guest after every boot, restore and fork: through its agent, the VMM
//! tells the guest the host's wall clock, fresh entropy, its name and identity (and a clone's
//! MAC), and runs the guest's own hook scripts. Requests into the guest wait for it, so that
//! nothing runs in a clone before it is told it is one.

use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use mayfly_agent_protocol::{RefreshEvent, RefreshReply};

use crate::guest::agent::Agent;
use crate::identity::Identity;

/// Where the VMM's refresh of the guest is.
#[derive(Clone, Debug, PartialEq)]
pub enum RefreshState {
    /// Not needed (no vsock socket) or not started.
    Idle,
    Running,
    Done(Box<RefreshReply>),
    /// The agent did not answer or refused: requests still go ahead (the guest may run
    /// without an agent), and GET /vm/agent says why.
    Failed(String),
}

/// The refresh's state, shared with the control socket (which waits for it before exec).
#[derive(Debug, Default)]
pub struct RefreshStatus {
    state: Mutex<Option<RefreshState>>,
    changed: Condvar,
}

impl RefreshStatus {
    /// One word for `GET /vm`: idle, running, done or failed.
    pub fn word(&self) -> &'static str {
        match self.state() {
            RefreshState::Idle => "idle",
            RefreshState::Running => "running",
            RefreshState::Done(_) => "done",
            RefreshState::Failed(_) => "failed",
        }
    }

    pub fn state(&self) -> RefreshState {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .unwrap_or(RefreshState::Idle)
    }

    pub(crate) fn set(&self, state: RefreshState) {
        *self.state.lock().unwrap_or_else(|p| p.into_inner()) = Some(state);
        self.changed.notify_all();
    }

    /// Wait until a running refresh has ended, at most `timeout`.
    pub fn wait(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        while matches!(*state, Some(RefreshState::Running)) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            state = self
                .changed
                .wait_timeout(state, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// Refresh the guest on a thread of its own (the VM runs meanwhile).
pub fn spawn_refresh(
    vsock: &Path,
    event: RefreshEvent,
    identity: Identity,
    mac: Option<[u8; 6]>,
    wait: Duration,
    status: &Arc<RefreshStatus>,
) -> std::io::Result<()> {
    let agent = Agent::new(vsock).with_wait(wait);
    let status = status.clone();
    status.set(RefreshState::Running);
    // It reads the guest agent's frames: under a filter of its own (a Unix socket's client).
    let builder = std::thread::Builder::new()
        .name("agent-refresh".into())
        .stack_size(mayfly_sys::HELPER_THREAD_STACK);
    let thread_status = status.clone();
    let spawned = mayfly_jail::seccomp::spawn(
        builder,
        mayfly_jail::seccomp::ThreadKind::Refresh,
        move || {
            let state = match agent.refresh(event, &identity, mac) {
                Ok(reply) => RefreshState::Done(Box::new(reply)),
                Err(e) => RefreshState::Failed(e.to_string()),
            };
            thread_status.set(state);
        },
    );
    if let Err(e) = &spawned {
        status.set(RefreshState::Failed(format!(
            "cannot start the refresh: {e}"
        )));
    }
    spawned.map(drop)
}
