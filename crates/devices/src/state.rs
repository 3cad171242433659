//! Every device's state as a snapshot holds it: the serial console's, and each virtio
//! device's (where it sits, its transport, its own state by kind). Each state type is defined
//! beside its device; a new virtio device adds its variant to [`VirtioKindState`] here (at the
//! end: the snapshot format encodes variants by position) and a `From` for its state.

use serde::{Deserialize, Serialize};

use crate::legacy::serial::SerialConsoleState;
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

impl From<RngState> for VirtioKindState {
    fn from(state: RngState) -> Self {
        VirtioKindState::Rng(state)
    }
}

impl From<VsockState> for VirtioKindState {
    fn from(state: VsockState) -> Self {
        VirtioKindState::Vsock(state)
    }
}

impl From<NetState> for VirtioKindState {
    fn from(state: NetState) -> Self {
        VirtioKindState::Net(state)
    }
}

impl From<BlockState> for VirtioKindState {
    fn from(state: BlockState) -> Self {
        VirtioKindState::Block(state)
    }
}
