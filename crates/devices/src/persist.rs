//! How a device saves and restores itself: beside its own code, through one trait, so the
//! device manager can collect every device's state for a snapshot and rebuild every device from
//! it, without knowing any device's insides.

/// A device that a snapshot can capture and a restore can rebuild.
pub trait Persist: Sized {
    /// What the device saves (serialized into the snapshot's state file).
    type State;
    /// What rebuilding it needs besides its state (guest memory, host resources).
    type ConstructorArgs;
    type Error;

    /// The device's state. Called while the VM is paused, so nothing changes it meanwhile.
    fn save(&self) -> Self::State;

    /// The device again, from `state`. The state came from a file: it is checked like input.
    fn restore(args: Self::ConstructorArgs, state: &Self::State) -> Result<Self, Self::Error>;
}

use serde::{Deserialize, Serialize};

use crate::legacy::SerialConsoleState;
use crate::virtio::block::BlockState;
use crate::virtio::mmio::MmioTransportState;
use crate::virtio::net::NetState;
use crate::virtio::rng::RngState;
use crate::virtio::vsock::VsockState;

/// The MMIO window and interrupt line a device occupies in the guest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceResources {
    pub mmio_base: u64,
    pub mmio_size: u64,
    pub gsi: u32,
}

/// A virtio device's own saved state, by kind.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum VirtioKindState {
    Rng(RngState),
    Vsock(VsockState),
    Net(NetState),
    Block(BlockState),
}

/// A virtio device as a snapshot keeps it: where it is, its transport, itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VirtioDeviceState {
    pub resources: DeviceResources,
    pub transport: MmioTransportState,
    pub device: VirtioKindState,
}

/// Every device's state in a snapshot, as the VMM's device manager collects it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DevicesState {
    pub serial: SerialConsoleState,
    pub virtio: Vec<VirtioDeviceState>,
}
