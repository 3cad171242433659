//! Test support for mayfly.
//!
//! [`rig`] runs commands on a real `/dev/kvm` when the host's own cannot run a Linux guest: inside an
//! emulated "L1" machine (QEMU TCG with an AMD SVM CPU) that shares the host's root read-only.
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

pub mod agent;
pub mod guest;
pub mod index;
pub mod netns;
pub mod probe;
pub mod rig;
pub mod serve;
