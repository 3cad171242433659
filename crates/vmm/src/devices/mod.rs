//! The VM's devices as the VMM wires them: the device manager (`manager.rs`: the bus, the MMIO
//! windows, interrupts, and every device's pause, save and restore), and the host side of the
//! console ([`console`]), the disks ([`disks`]: their copy-on-write layers) and the network
//! ([`net`]: the VM's namespace, tap and egress policy). The devices themselves are the
//! `mayfly-devices` crate.

pub mod config;
pub mod console;
pub mod disks;
pub mod error;
pub(crate) mod manager;
pub mod net;
pub(crate) mod virtio;
