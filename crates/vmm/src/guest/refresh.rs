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
use crate::machine::Machine;

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

/// The refresh of one VM's guest: started once the VM runs, or, for a VM that is paused, held
/// until it resumes (its agent cannot answer before).
#[derive(Debug, Default)]
pub struct Refresh {
    /// Where it is, shared with the control socket's guest routes, which wait for it.
    pub status: Arc<RefreshStatus>,
    /// A refresh to start once the paused VM resumes.
    pending: Option<(RefreshEvent, Duration)>,
}

impl Refresh {
    /// Tell the guest what happened to it (booted, restored, forked) through its agent: the
    /// host's clock, fresh entropy, its name, its hook scripts. Runs on a thread of its own,
    /// waiting up to `wait` for the agent; a paused VM gets it when it resumes
    /// ([`Refresh::resumed`]). Exec and file requests wait for it, so that nothing runs in a
    /// clone before it is told it is one. A VM without a vsock device (or the probe guest,
    /// which has no agent) has nothing to do.
    pub fn start(&mut self, machine: &Machine, event: RefreshEvent, wait: Duration) {
        if machine.info.probe {
            return;
        }
        let Some((Some(vsock), _)) = machine.devices.vsock() else {
            return;
        };
        if machine.paused() {
            self.pending = Some((event, wait));
            return;
        }
        let identity = machine.info.identity.clone();
        // A clone's NIC has a MAC of its own, which its guest takes on now (a restored or
        // booted VM's guest has it already: setting it again changes nothing).
        let mac = machine.devices.network().map(|n| n.guest().mac);
        if let Err(e) = spawn_refresh(&vsock, event, identity, mac, wait, &self.status) {
            eprintln!("mayfly: cannot start the guest refresh: {e}");
        }
    }

    /// The VM resumed: start a refresh that had to wait for it.
    pub fn resumed(&mut self, machine: &Machine) {
        if let Some((event, wait)) = self.pending.take() {
            self.start(machine, event, wait);
        }
    }

    /// Whether a refresh waits for the VM to resume.
    pub fn pending(&self) -> bool {
        self.pending.is_some()
    }
}
