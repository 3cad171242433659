//! mayfly: a KVM virtual machine monitor for microVMs.
//!
//! The public modules are the API (see docs/embedding.md): configure a VM ([`config`],
//! [`devices`]), make it ([`boot`], [`persist::restore`], [`persist::standby`]), drive it
//! ([`runtime::Vmm`], [`controller::Controller`]), run it as a process ([`launch`]), reach its
//! guest ([`guest`]). The machine, vCPUs, memory and x86 specifics are the crate's own.
//!
//! Where to start reading:
//! - [`boot`]: the boot path, from a [`config::RunConfig`] to a running VM.
//! - [`persist::capture`]: the snapshot path, from a paused VM to a directory on disk.
//! - [`persist::restore`]: the restore path, from a snapshot directory to a running VM.
//! - [`persist::fork`]: the fork path, from a running VM to N running clones.
//! - [`controller`]: the one thread that decides: it answers the control socket's requests
//!   (`mayfly_api`) and acts on the machine.
//! - `vcpu.rs`: the vCPU threads and how they are paused, stopped and kicked.
//! - `vm.rs`: the KVM VM itself; `machine.rs`: the VM with its memory and devices.
// Lossy `as` casts are refused here (tests aside): every conversion that can lose bits says
// why it cannot.
#![cfg_attr(
    not(test),
    warn(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_possible_wrap
    )
)]

#[cfg(not(target_arch = "x86_64"))]
compile_error!("mayfly supports x86-64 hosts only");

// The public API: what the `mayfly` command and a program that embeds mayfly use (see
// docs/embedding.md). The rest is the VMM's own.
pub mod boot;
pub mod config;
pub mod controller;
pub mod devices;
pub mod event;
pub mod guest;
pub mod identity;
pub mod kernel;
pub mod launch;
pub mod outside;
pub mod persist;
pub mod runtime;
pub mod settings;
pub mod signals;

mod arch;
mod diagnostics;
mod machine;
mod memory;
mod trace;
mod vcpu;
mod vm;

/// The guest kernel and initramfs built into this binary, if they were built before it.
pub mod default_guest {
    include!(concat!(env!("OUT_DIR"), "/default_guest.rs"));
}
