//! What can go wrong making, wiring, pausing or restoring a VM's devices.

use mayfly_devices::bus::BusError;
use mayfly_devices::virtio::block::BlockError;
use mayfly_devices::virtio::net::NetError;
use mayfly_devices::virtio::vsock::VsockError;

use crate::devices::disks::DiskSetupError;
use crate::devices::net::NetSetupError;

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("cannot create an eventfd for a device: {0}")]
    EventFd(std::io::Error),
    #[error("KVM refused to connect a device interrupt (irqfd): {0}")]
    Irqfd(kvm_ioctls::Error),
    #[error("KVM refused a device's queue notification (ioeventfd): {0}")]
    Ioeventfd(kvm_ioctls::Error),
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error(transparent)]
    SerialState(#[from] mayfly_devices::legacy::serial::SerialStateError),
    #[error("no room for another device: {0}")]
    Exhausted(&'static str),
    #[error(transparent)]
    Vsock(#[from] VsockError),
    #[error("cannot start a device thread: {0}")]
    Thread(std::io::Error),
    #[error("the snapshot's {device} device cannot be restored: {reason}")]
    BadState {
        device: &'static str,
        reason: String,
    },
    #[error("a device thread did not stop for the pause: {0}")]
    Stuck(String),
    #[error("disk {serial}: {source}")]
    Disk {
        serial: String,
        source: DiskSetupError,
    },
    #[error("disk {serial}: {source}")]
    Block { serial: String, source: BlockError },
    #[error("the VM's network: {0}")]
    Network(#[from] NetSetupError),
    #[error("the VM's NIC: {0}")]
    Net(#[from] NetError),
}
