//! The devices mayfly emulates for its guests.
//!
//! Each device is a plain struct that the VMM puts on an I/O bus ([`bus::PioBus`]); a device's
//! saved state, when it has one, is defined next to the device so snapshots stay in step with it.
// Lossy `as` casts are refused here (tests aside): the devices read what a guest wrote, and
// every conversion that can lose bits says why it cannot.
#![cfg_attr(
    not(test),
    warn(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_possible_wrap
    )
)]

pub mod bus;
pub mod disk;
pub mod legacy;
pub mod persist;
pub mod power;
pub mod probe;
pub mod state;
pub mod virtio;

/// What a guest asked of the machine through a device: the VMM ends (or restarts) the VM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PowerRequest {
    /// The guest asked for a reset (i8042 pulse, ACPI reset register).
    Reset,
    /// The guest asked to be powered off (ACPI sleep state S5).
    PowerOff,
}

/// Called by a device, on a vCPU thread, when the guest makes a [`PowerRequest`].
pub type PowerHandler = Box<dyn Fn(PowerRequest) + Send>;
