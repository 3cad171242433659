//! How a device saves and restores itself: beside its own code, through one trait
//! ([`Persist`], as Firecracker's `persist.rs` per device), so the device manager can collect
//! every device's state for a snapshot and rebuild every device from it without knowing any
//! device's insides. Every device implements it: the serial console, the virtio transport,
//! and each virtio device (rng, vsock, block, net); the state types a snapshot holds are
//! gathered in [`crate::state`], and every virtio device runs one shared test of the contract
//! (`virtio::contract`, in the crate's tests).

/// A device that a snapshot can capture and a restore can rebuild.
pub trait Persist: Sized {
    /// What the device saves (serialized into the snapshot's state file).
    type State;
    /// What rebuilding it needs besides its state (host resources: a socket path, a disk, a
    /// tap; for the transport, its device and guest memory).
    type ConstructorArgs;
    type Error;

    /// The device's state. Called while the VM is paused, so nothing changes it meanwhile.
    fn save(&self) -> Self::State;

    /// The device again, from `state`. The state came from a file: it is checked like input.
    fn restore(args: Self::ConstructorArgs, state: &Self::State) -> Result<Self, Self::Error>;
}
