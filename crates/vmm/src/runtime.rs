//! A machine once it is made, with what runs around it: its event channel, its control socket
//! (already answering: requests wait in the channel), its socket claims and the refresh of its
//! guest. The boot, restore and standby paths each return a [`Vmm`]; whoever starts it drives
//! it (the `mayfly` command wraps it in a [`crate::controller::Controller`]), as Firecracker's
//! builder returns a Vmm that its API adapter then drives. Nothing here calls back up.

use std::path::PathBuf;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;

use mayfly_api::{ApiError, ApiServer};
use mayfly_sys::claim::SocketClaim;

use crate::event::VmEvent;
use crate::guest::refresh::{Refresh, RefreshStatus};
use crate::guest::routes::Routes;
use crate::machine::Machine;

/// A machine, started (its vCPUs running, or held paused as asked), and everything it runs
/// with. Drive it with [`crate::controller::Controller::new`].
pub struct Vmm {
    pub machine: Machine,
    pub events: Receiver<VmEvent>,
    pub event_sender: Sender<VmEvent>,
    /// The control socket, when the VM has one: serving already, its requests queued in
    /// `events` until the VM is driven.
    pub api: Option<ApiServer>,
    /// The claim on the vsock socket's path, let go after the device removed its socket.
    pub vsock_claim: Option<SocketClaim>,
    /// The refresh of the guest through its agent (started, or waiting for a paused VM to
    /// resume), which the control socket's guest routes wait for.
    pub refresh: Refresh,
}

/// Serve the control socket on the path `claim` holds, its requests sent into `events`; the
/// guest routes go through the guest's agent behind `vsock`, after `refresh`.
pub fn serve_api(
    claim: SocketClaim,
    events: Sender<VmEvent>,
    vsock: Option<PathBuf>,
    refresh: &Arc<RefreshStatus>,
) -> Result<ApiServer, ApiError> {
    ApiServer::start_claimed(
        claim,
        events,
        VmEvent::Api,
        mayfly_api::Timeouts::default(),
        Arc::new(Routes {
            vsock,
            refresh: refresh.clone(),
        }),
    )
}

/// What `GET /vm` answers for `machine`; `held_for_fork`: a clone restored and held until its
/// fork has every clone ready (it runs then).
pub fn describe(
    machine: &Machine,
    refresh: &RefreshStatus,
    held_for_fork: bool,
) -> serde_json::Value {
    let m = machine;
    let id = &m.info.identity;
    let vsock = m.devices.vsock();
    serde_json::json!({
        "name": id.name,
        "clone_index": id.index,
        "parent": id.parent,
        "generation": id.generation,
        "state": match (m.paused(), held_for_fork) {
            (true, true) => "starting",
            (true, false) => "paused",
            (false, _) => "running",
        },
        "origin": m.info.origin,
        "memory_mode": m.ram.kind.name(),
        "vcpus": m.info.vcpu_count,
        "mem_mib": m.ram.size() >> 20,
        "cmdline": m.info.cmdline,
        "uptime_ms": u64::try_from(m.info.started.elapsed().as_millis()).unwrap_or(u64::MAX),
        "pid": mayfly_jail::jail::host_pid(),
        "jail": mayfly_jail::jail::current().map(mayfly_jail::jail::Jail::describe),
        "agent_refresh": refresh.word(),
        "vsock": vsock.as_ref().map(|(path, cid)| serde_json::json!({
            "path": path,
            "guest_cid": cid,
        })),
        "net": m.devices.network().map(|n| serde_json::json!({
            "policy": n.policy().map(|p| p.to_string()).ok(),
            "mac": crate::devices::net::mac_text(n.guest().mac),
            "outside_ip": n.outside_ip().to_string(),
        })),
    })
}

impl Vmm {
    /// What `GET /vm` answers for it now.
    pub fn describe(&self) -> serde_json::Value {
        describe(&self.machine, &self.refresh.status, false)
    }
}
