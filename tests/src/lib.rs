//! Test support for mayfly.
//!
//! [`rig`] runs commands on a real `/dev/kvm` when the host's own cannot run a Linux guest: inside an
//! emulated "L1" machine (QEMU TCG with an AMD SVM CPU) that shares the host's root read-only.

pub mod agent;
pub mod guest;
pub mod probe;
pub mod rig;
