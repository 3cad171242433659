//! The VM's controller: the one thread that decides. Requests from the control socket, power
//! requests from the guest, signals and failures all arrive here as [`VmEvent`]s; the
//! controller acts on the machine (pause, snapshot, fork, ...) and answers. A request walks
//! socket -> controller -> machine -> vCPUs and devices; nothing below calls back up.

use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, Sender};

use mayfly_devices::PowerRequest;

use crate::devices::net::{VmNet, KEPT_OUTSIDE};
use crate::event::{VmEvent, VmExit};
use crate::guest::refresh::Refresh;
use crate::machine::Machine;
use crate::runtime::Vmm;
use mayfly_api::{Action, ApiCall, ApiServer, Reply};
use mayfly_sys::claim::SocketClaim;

/// How often an idle controller looks for a vCPU stuck behind the console (see
/// [`crate::machine::Machine::nudge_stalled_console`]): a few relaxed loads and one uncontended
/// lock, once a second.
const CONSOLE_WATCH: std::time::Duration = std::time::Duration::from_secs(1);
/// Kicks a VMM says it made (the rest are counted in none: the stall is rare, and a guest that
/// sets it off on purpose must not fill the log).
const MAX_NUDGES_LOGGED: u64 = 8;

/// What the network routes answer for a VM without a NIC.
const NO_NIC: &str =
    "the VM has no NIC (it was started with --net none): boot it with --net open or --net allow=...";

/// What a jailed VM answers to a snapshot outside what its jail shares.
const JAILED_SNAPSHOT: &str = "the VM is jailed: it can write only under the directories its \
    jail shares (--jail-share DIR, at the same path): snapshot into one of them (see \
    \"jail\" in GET /vm)";
/// What a jailed VM answers to a fork.
const JAILED_FORK: &str = "a jailed VM is forked from outside its jail, since each clone needs a \
    jail of its own that only root outside can make: run `mayfly fork --sock SOCKET --count N` \
    as root (it asks this VM for PUT /vm/fork/capture and makes the clones itself)";

/// Whether this VMM can write a snapshot at `path`: anywhere unless it is jailed.
fn jail_can_write(path: &Path) -> bool {
    mayfly_jail::jail::current().is_none_or(|jail| jail.can_write(path))
}

pub struct Controller {
    /// The control socket, when the VM has one. Dropped first: no request outlives the VM.
    pub api: Option<ApiServer>,
    pub machine: Machine,
    pub events: Receiver<VmEvent>,
    pub event_sender: Sender<VmEvent>,
    /// The claim on the vsock socket's path, let go after the device removed its socket.
    pub vsock_claim: Option<SocketClaim>,
    /// The refresh of the guest through its agent (clock, entropy, name, hooks).
    refresh: Refresh,
    /// A clone held paused until its fork has every clone ready ([`VmEvent::ForkEnded`] lets
    /// it go, unless its user paused or resumed it meanwhile).
    held_for_fork: bool,
    /// What `PUT /vm/fork/capture` holds for the one finishing the fork outside.
    fork_capture: Option<crate::persist::fork::HeldCapture>,
}

/// A way to ask a VM what its control socket would, from any thread of this process: for a
/// program that embeds mayfly and drives its VM in process. Each request waits for the VM's
/// answer.
#[derive(Clone, Debug)]
pub struct VmHandle(Sender<VmEvent>);

impl VmHandle {
    /// Ask the VM's controller for `action` and wait for its reply (503 if the VM has ended).
    /// The reply counts as delivered: a fork's clones run once it is dropped.
    pub fn request(&self, action: Action) -> Reply {
        let (reply, replies) = std::sync::mpsc::channel();
        if self
            .0
            .send(VmEvent::Api(ApiCall { action, reply }))
            .is_err()
        {
            return Reply::error(503, "the VM has ended");
        }
        match replies.recv() {
            Ok(reply) => {
                reply.until_written.delivered();
                reply
            }
            Err(_) => Reply::error(503, "the VM has ended"),
        }
    }
}

/// A fork's held clones run once its answer is written (see [`crate::persist::zygote::Release`]).
impl mayfly_api::Delivery for crate::persist::zygote::Release {
    fn delivered(&self) {
        crate::persist::zygote::Release::delivered(self);
    }
}

impl Controller {
    /// Drive `vmm`: from now on its events are this controller's, and its guest is told what
    /// happened to it (booted, restored, forked) once its agent is up.
    pub fn new(vmm: Vmm) -> Self {
        let Vmm {
            machine,
            events,
            event_sender,
            api,
            vsock_claim,
            refresh,
        } = vmm;
        Self {
            api,
            machine,
            events,
            event_sender,
            vsock_claim,
            refresh,
            held_for_fork: false,
            fork_capture: None,
        }
    }

    /// The directory of the control socket: a fork's clones put their files there.
    fn socket_dir(&self) -> Option<PathBuf> {
        self.api
            .as_ref()
            .and_then(|api| api.path().parent().map(Path::to_path_buf))
    }

    /// A handle for requests to this VM from other threads of the process.
    pub fn handle(&self) -> VmHandle {
        VmHandle(self.event_sender.clone())
    }

    /// Hold this restored, paused clone until its fork ends ([`VmEvent::ForkEnded`]). Until
    /// then its state reads "starting", and requests into its guest wait for it to run and be
    /// refreshed rather than being refused as paused.
    pub fn hold_for_fork(&mut self) {
        self.held_for_fork = true;
        if self.refresh.pending() {
            self.refresh
                .status
                .set(crate::guest::refresh::RefreshState::Running);
        }
    }

    /// Resume a paused VM, and then tell its guest what happened while it was paused (a
    /// refresh that had to wait).
    fn resume(&mut self) {
        self.held_for_fork = false;
        self.machine.resume();
        self.refresh.resumed(&self.machine);
    }

    /// Serve requests until something ends the VM, then stop every vCPU.
    pub fn run(mut self) -> VmExit {
        let mut nudges: u64 = 0;
        let exit = loop {
            let event = match self.events.recv_timeout(CONSOLE_WATCH) {
                Ok(event) => event,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    // Nothing to do for a while: look for the lost console wake-up.
                    for index in self.machine.nudge_stalled_console() {
                        nudges += 1;
                        if nudges <= MAX_NUDGES_LOGGED {
                            eprintln!(
                                "mayfly: vCPU {index} sat in KVM_RUN over {} s with the console's \
                                 interrupt pending: kicked it (the lost console wake-up, \
                                 docs/rig.md){}",
                                crate::machine::CONSOLE_STALL.as_secs(),
                                if nudges == MAX_NUDGES_LOGGED {
                                    "; further kicks are not logged"
                                } else {
                                    ""
                                }
                            );
                        }
                    }
                    continue;
                }
                // Every sender gone: cannot happen while `self` holds one.
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break VmExit::PowerOff,
            };
            match event {
                VmEvent::Api(call) => {
                    let (reply, exit) = self.act(call.action);
                    let _ = call.reply.send(reply);
                    if let Some(exit) = exit {
                        break exit;
                    }
                }
                VmEvent::Power(PowerRequest::PowerOff) => break VmExit::PowerOff,
                VmEvent::Power(PowerRequest::Reset) => break VmExit::Reset,
                VmEvent::Signal(libc::SIGUSR1) => {
                    eprintln!("{}", crate::diagnostics::state_dump(&mut self.machine))
                }
                VmEvent::Signal(sig) => break VmExit::Signal(sig),
                VmEvent::MemoryFailed(reason) => break VmExit::Failed(reason),
                VmEvent::ForkEnded => {
                    if self.held_for_fork && self.machine.paused() {
                        self.resume();
                    }
                    self.held_for_fork = false;
                }
                VmEvent::VcpuFailed {
                    index,
                    reason,
                    registers,
                } => {
                    break VmExit::Crashed {
                        index,
                        reason,
                        registers,
                    }
                }
            }
        };
        // Stop accepting requests before the VM goes away.
        self.api = None;
        self.machine.stop();
        // A guest that "crashed" or "rebooted" because the file behind its memory was cut
        // short did neither by itself: say what happened.
        match (&exit, self.machine.ram.backing_problem()) {
            (VmExit::Reset | VmExit::Crashed { .. }, Some(problem)) => VmExit::Failed(format!(
                "{problem}; the guest stopped because its memory changed under it (keep a snapshot's files unchanged while VMs restored from them run, or restore with --memory eager)"
            )),
            _ => exit,
        }
    }

    /// Answer one control socket request; the second value ends the VM.
    fn act(&mut self, action: Action) -> (Reply, Option<VmExit>) {
        let paused = self.machine.paused();
        match action {
            Action::Describe => (Reply::ok(self.describe()), None),
            // A clone held until its fork ends: its user's pause keeps it paused past that.
            Action::Pause if paused && self.held_for_fork => {
                self.held_for_fork = false;
                // Its refresh waits for its resume now, like any paused VM's: requests into
                // its guest get 409 rather than waiting for a fork's end that no longer frees it.
                if self.refresh.pending() {
                    self.refresh
                        .status
                        .set(crate::guest::refresh::RefreshState::Idle);
                }
                (Reply::no_content(), None)
            }
            Action::Pause if paused => (Reply::error(409, "the VM is already paused"), None),
            Action::Pause => match self.machine.pause() {
                Ok(()) => (Reply::no_content(), None),
                Err(e) => (Reply::error(500, e.to_string()), None),
            },
            Action::Resume if !paused => (Reply::error(409, "the VM is not paused"), None),
            Action::Resume => {
                self.resume();
                (Reply::no_content(), None)
            }
            Action::Snapshot { .. } if !paused => (
                Reply::error(
                    409,
                    "the VM must be paused to be snapshotted: PUT /vm/pause first",
                ),
                None,
            ),
            Action::Snapshot { path, .. } if !jail_can_write(&path) => {
                (Reply::error(400, JAILED_SNAPSHOT), None)
            }
            Action::Snapshot { path, diff } => {
                match crate::persist::capture::create(&self.machine, &path, diff) {
                    Ok(report) => (
                        Reply::ok(serde_json::to_value(report).unwrap_or_default()),
                        None,
                    ),
                    Err(e) => (Reply::error(e.http_status(), e.to_string()), None),
                }
            }
            Action::Fork(_) if mayfly_jail::jail::current().is_some() => {
                (Reply::error(409, JAILED_FORK), None)
            }
            Action::Fork(request) => {
                let dir = self.socket_dir();
                match crate::persist::fork::fork(&mut self.machine, dir.as_deref(), &request) {
                    // The clones run once the answer is written (see zygote::Release).
                    Ok(report) => (
                        Reply::ok(serde_json::to_value(&report).unwrap_or_default())
                            .keeping(report.release),
                        None,
                    ),
                    Err(e) => (Reply::error(e.http_status(), e.to_string()), None),
                }
            }
            Action::ForkCapture(request) => {
                // What an earlier capture held goes first: its memory is this VM's.
                self.fork_capture = None;
                let dir = self.socket_dir();
                match crate::persist::fork::capture(&mut self.machine, dir.as_deref(), &request) {
                    Ok((captured, held)) => {
                        self.fork_capture = Some(held);
                        (
                            Reply::ok(serde_json::to_value(&captured).unwrap_or_default()),
                            None,
                        )
                    }
                    Err(e) => (Reply::error(e.http_status(), e.to_string()), None),
                }
            }
            Action::ForkCaptureRelease => {
                self.fork_capture = None;
                (Reply::no_content(), None)
            }
            Action::Shutdown => (Reply::no_content(), Some(VmExit::Shutdown)),
            Action::Net => match self.machine.devices.network() {
                Some(network) => match network.describe() {
                    Ok(described) => (Reply::ok(described), None),
                    Err(e) => (Reply::error(502, e.to_string()), None),
                },
                None => (Reply::error(409, NO_NIC), None),
            },
            Action::NetPolicy(policy) => match self.machine.devices.network_mut() {
                // Names are resolved now; a policy that cannot be applied leaves the old one.
                Some(VmNet::Own(network)) => match network.set_policy(policy) {
                    Ok(()) => (Reply::ok(network.describe()), None),
                    Err(e) => (
                        Reply::error(crate::outside::policy_status(&e), e.to_string()),
                        None,
                    ),
                },
                Some(VmNet::Kept(_)) => (Reply::error(409, KEPT_OUTSIDE), None),
                None => (Reply::error(409, NO_NIC), None),
            },
            Action::NetExpose { port, on } => match self.machine.devices.network_mut() {
                Some(VmNet::Kept(_)) => (Reply::error(409, KEPT_OUTSIDE), None),
                Some(VmNet::Own(network)) => match network.expose(port, on) {
                    Ok(endpoint) => (
                        Reply::ok(serde_json::json!({
                            "guest_port": port,
                            "host": match endpoint {
                                mayfly_network::HostEndpoint::Tcp(addr) => format!("tcp:{addr}"),
                                mayfly_network::HostEndpoint::Unix(path) =>
                                    format!("unix:{}", path.display()),
                            },
                        })),
                        None,
                    ),
                    Err(e) => (Reply::error(409, e.to_string()), None),
                },
                None => (Reply::error(409, NO_NIC), None),
            },
            Action::NetUnexpose { port, on } => match self.machine.devices.network_mut() {
                Some(VmNet::Kept(_)) => (Reply::error(409, KEPT_OUTSIDE), None),
                Some(VmNet::Own(network)) => (
                    crate::outside::unexposed(port, network.unexpose(port, on.as_ref())),
                    None,
                ),
                None => (Reply::error(409, NO_NIC), None),
            },
        }
    }

    /// What `GET /vm` answers.
    pub fn describe(&self) -> serde_json::Value {
        crate::runtime::describe(&self.machine, &self.refresh.status, self.held_for_fork)
    }
}
