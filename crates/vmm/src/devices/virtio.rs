//! The one place the VMM knows each kind of virtio device: how it is made at boot from the VM's
//! configuration ([`boot`]), and from a snapshot with this host's resources: its vsock socket,
//! its disks' files, its network ([`restore`]). Everything else the device manager does
//! (wiring, pause, save, the state dump) is the same for every device, through
//! `mayfly_devices::virtio::device::Device`. A new device adds its arms here, beside its own
//! folder in `mayfly-devices` (its code, its `Persist`, its state's variant).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use crate::devices::net::VmNet;
use event_manager::MutEventSubscriber;
use mayfly_devices::persist::Persist;
use mayfly_devices::state::VirtioKindState;
use mayfly_devices::virtio::block::Block;
use mayfly_devices::virtio::device::Device;
use mayfly_devices::virtio::net::{Net, NetArgs, NetBackend};
use mayfly_devices::virtio::rng::Rng;
use mayfly_devices::virtio::vsock::{Vsock, VsockArgs};
use mayfly_devices::virtio::VirtioDevice;
use mayfly_jail::seccomp::ThreadKind;

use crate::devices::config::{DevicesConfig, RestoreTargets};
use crate::devices::disks;
use crate::devices::error::DeviceError;
use crate::devices::net;

/// What a device is to the VMM beyond its trait: read once when it is made (asking it later
/// means taking its lock, which its thread holds while it works).
pub enum Role {
    Rng,
    /// Its host socket and its guest's CID.
    Vsock {
        path: Option<PathBuf>,
        cid: u64,
    },
    /// Its serial (vda, ...), how it was opened, and the device itself: its writable disk is
    /// frozen at a snapshot.
    Block {
        serial: String,
        read_only: bool,
        device: Arc<Mutex<Block>>,
    },
    Net,
}

impl Role {
    /// What the state dump calls it.
    pub fn label(&self) -> String {
        match self {
            Role::Rng => "rng".into(),
            Role::Vsock { cid, .. } => format!("vsock cid {cid}"),
            Role::Block { serial, .. } => format!("block {serial}"),
            Role::Net => "net".into(),
        }
    }
}

/// A device made, ready to be wired: the same device seen as each of its traits (the
/// manager's, its transport's, its thread's), what it is to the VMM, and the seccomp filter
/// its thread runs under.
pub struct Made {
    pub device: Arc<Mutex<dyn Device>>,
    pub transport_side: Arc<Mutex<dyn VirtioDevice>>,
    pub thread_side: Arc<Mutex<dyn MutEventSubscriber + Send>>,
    pub role: Role,
    pub filter: ThreadKind,
}

fn made<D: Device + 'static>(device: Arc<Mutex<D>>, role: Role, filter: ThreadKind) -> Made {
    Made {
        device: device.clone(),
        transport_side: device.clone(),
        thread_side: device,
        role,
        filter,
    }
}

/// The virtio devices `config` names, freshly reset, in the order their MMIO windows and
/// interrupt lines are given out: rng, vsock, each disk, the NIC. The NIC's network (made
/// here) goes into `network`.
pub fn boot(config: &DevicesConfig, network: &mut Option<VmNet>) -> Result<Vec<Made>, DeviceError> {
    let mut all = Vec::new();
    if config.rng {
        let rng = Rng::new().map_err(DeviceError::EventFd)?;
        all.push(made(
            Arc::new(Mutex::new(rng)),
            Role::Rng,
            ThreadKind::Device,
        ));
    }
    if let Some(vsock) = &config.vsock {
        let device = Vsock::new(vsock.guest_cid, vsock.path.as_deref())?;
        all.push(vsock_made(device));
    }
    for (index, spec) in config.disks.iter().enumerate() {
        let serial = disks::serial(index).map_err(|source| DeviceError::Disk {
            serial: format!("#{index}"),
            source,
        })?;
        let disk =
            disks::open_for_boot(spec, &serial, config.disk_dir.as_deref()).map_err(|source| {
                DeviceError::Disk {
                    serial: serial.clone(),
                    source,
                }
            })?;
        let block = Block::new(disk, &serial).map_err(|source| DeviceError::Block {
            serial: serial.clone(),
            source,
        })?;
        all.push(block_made(block));
    }
    if let Some(spec) = &config.net {
        if spec.policy != mayfly_network::Policy::None {
            let (made_network, tap) = net::attach(&spec.settings, &spec.policy, None)?;
            let device = Net::new(tap, made_network.guest().mac)?;
            *network = Some(made_network);
            all.push(made(
                Arc::new(Mutex::new(device)),
                Role::Net,
                ThreadKind::Device,
            ));
        }
    }
    Ok(all)
}

/// The device a snapshot's state describes, rebuilt on this host as `targets` says. A NIC's
/// network (made here) goes into `network`: a VM has one NIC at most.
pub fn restore(
    saved: &VirtioKindState,
    targets: &RestoreTargets,
    network: &mut Option<VmNet>,
) -> Result<Made, DeviceError> {
    Ok(match saved {
        VirtioKindState::Rng(s) => made(
            Arc::new(Mutex::new(
                Rng::restore((), s).map_err(DeviceError::EventFd)?,
            )),
            Role::Rng,
            ThreadKind::Device,
        ),
        VirtioKindState::Vsock(s) => {
            let args = VsockArgs {
                guest_cid: targets.vsock_cid.unwrap_or(s.guest_cid),
                path: targets.vsock_path.clone(),
            };
            vsock_made(Vsock::restore(args, s)?)
        }
        VirtioKindState::Block(s) => {
            let serial = s.serial.clone();
            let disk = disks::open_for_restore(
                s,
                targets.snapshot_dir.as_deref(),
                targets.disk_dir.as_deref(),
                targets.layers_within.as_deref(),
                targets.layers_moved.as_ref(),
            )
            .map_err(|source| DeviceError::Disk {
                serial: serial.clone(),
                source,
            })?;
            block_made(
                Block::restore(disk, s).map_err(|source| DeviceError::Block { serial, source })?,
            )
        }
        VirtioKindState::Net(s) => {
            if network.is_some() {
                return Err(DeviceError::BadState {
                    device: "virtio-net",
                    reason: "the snapshot has two NICs; mayfly gives a VM one".into(),
                });
            }
            let policy = match &targets.net.policy {
                Some(policy) => policy.clone(),
                None => net::saved_policy(&s.policy)?,
            };
            let mac = (!targets.net.new_mac).then_some(s.mac);
            let (made_network, tap) = net::attach(&targets.net.settings, &policy, mac)?;
            let args = NetArgs {
                backend: NetBackend::Tap(tap),
                mac: Some(made_network.guest().mac),
            };
            let device = Net::restore(args, s)?;
            *network = Some(made_network);
            made(Arc::new(Mutex::new(device)), Role::Net, ThreadKind::Device)
        }
        #[allow(unreachable_patterns)]
        _ => {
            return Err(DeviceError::BadState {
                device: "virtio",
                reason: "this mayfly does not know the device yet: restore with the mayfly \
                         that took the snapshot"
                    .into(),
            })
        }
    })
}

fn vsock_made(device: Vsock) -> Made {
    let role = Role::Vsock {
        path: device.path().map(PathBuf::from),
        cid: device.guest_cid(),
    };
    made(Arc::new(Mutex::new(device)), role, ThreadKind::VsockDevice)
}

fn block_made(device: Block) -> Made {
    let serial = device.save().serial;
    let read_only = device.disk().is_read_only();
    let device = Arc::new(Mutex::new(device));
    let role = Role::Block {
        serial,
        read_only,
        device: device.clone(),
    };
    made(device, role, ThreadKind::BlockDevice)
}
