//! mayfly: a KVM virtual machine monitor for microVMs.
//!
//! Where to start reading:
//! - [`boot`]: the boot path, from a [`config::RunConfig`] to a running [`vm::Vm`].
//! - [`snapshot`]: the snapshot path, from a paused VM to a directory on disk.
//! - [`restore`]: the restore path, from a snapshot directory to a running VM.
//! - [`fork`]: the fork path, from a running VM to N running clones.
//! - [`api`]: the control socket, whose requests the VM's controller ([`vm::Vm::run`]) answers.
//! - [`vcpu`]: the vCPU threads and how they are paused, stopped and kicked.
//! - [`vm`]: the KVM VM itself and how a VM ends.
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

pub mod agent;
pub mod api;
pub mod arch;
pub mod boot;
pub mod config;
pub mod console;
pub mod controller;
pub mod device_manager;
pub mod diagnostics;
pub mod diff;
pub mod disks;
pub mod event;
pub mod fork;
pub mod identity;
pub mod jail;
pub mod kernel;
pub mod lazy;
pub mod machine;
pub mod memory;
pub mod net;
pub mod restore;
pub mod seccomp;
pub mod serve;
pub mod snapshot;
pub mod standby;
pub mod trace;
pub mod vcpu;
pub mod vm;
pub mod zygote;

/// Stack size of the VMM's own threads (vCPUs, console, signals). They need little, and a stack
/// smaller than 2 MiB can never be backed by a transparent huge page, which would cost 2 MiB of
/// RSS per thread on hosts that enable THP for all anonymous memory.
pub const HELPER_THREAD_STACK: usize = 256 << 10;

/// The guest kernel and initramfs built into this binary, if they were built before it.
pub mod default_guest {
    include!(concat!(env!("OUT_DIR"), "/default_guest.rs"));
}

/// Any error `mayfly` reports to its user.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Boot(boot::BootError),
    #[error(transparent)]
    Restore(restore::RestoreError),
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    #[error(transparent)]
    Kernel(#[from] kernel::KernelError),
    #[error(transparent)]
    CpuTemplate(#[from] arch::cpuid::CpuTemplateError),
    #[error("this mayfly has no built-in guest {0}: build it with guest-kernel/build.sh and rootfs/build.sh and rebuild mayfly (cargo build --release), or pass --kernel and --initrd")]
    NoDefaultGuest(&'static str),
    #[error("cannot set up signal handling: {0}")]
    Signals(std::io::Error),
    #[error(transparent)]
    Identity(#[from] identity::IdentityError),
    #[error(transparent)]
    Disk(disks::DiskSetupError),
    #[error(transparent)]
    Net(#[from] net::NetSetupError),
}
