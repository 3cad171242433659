//! The test rig: run a command on a real `/dev/kvm` inside an emulated machine.
//!
//! The host's own `/dev/kvm` (when it comes from `kvm_pvm`) cannot run a Linux guest to user space.
//! The rig boots an "L1" Linux under QEMU's software emulator (TCG) with an AMD SVM CPU; L1's kernel
//! has `kvm_amd` built in and so a real `/dev/kvm`. L1 mounts the host's root read-only over 9p,
//! mounts fresh `/proc`, `/sys`, `/dev`, `/tmp`, `/run` inside it, mounts each writable directory
//! (`RigOptions::rw`) at its own path, `chroot`s there and runs the command in the caller's working
//! directory. The command's output comes back on L1's first serial port, its exit status through a
//! control directory shared read-write.
//!
//! ```no_run
//! use mayfly_tests::rig::{self, KvmLocation, RigOptions};
//!
//! if rig::kvm_location() == KvmLocation::Rig {
//!     let out = rig::run(&RigOptions::default(), &["sh", "-c", "ls -l /dev/kvm"])?;
//!     assert_eq!(out.status, 0, "{}", out.output_lossy());
//! }
//! # Ok::<(), rig::RigError>(())
//! ```
//!
//! Files of a run, in its control directory (kept when the run fails, or with
//! `RigOptions::keep_control_dir`): `rig.conf` and `run.sh` (written by the rig), `console.log`
//! (everything the command printed), `l1-kernel.log` (L1's kernel console and its init's log),
//! `qemu.log` (QEMU's own messages), `exit-status` (written by L1).

mod artifacts;
mod control;
mod error;
mod l1;
mod location;
mod options;
mod qemu;
mod run;

pub use artifacts::{ensure_artifacts, qemu_binary, source_root};
pub use error::{RigError, EXIT_RIG_FAILED, EXIT_STOPPED, EXIT_TIMEOUT};
pub use l1::parse_env_setting;
pub use location::{detect_kvm_location, kvm_location, KvmLocation, FORCE_ENV, IN_RIG_ENV};
pub use options::{RigArtifacts, RigOptions, RigOutput, DEFAULT_CPU_MODEL};
pub use run::run;

#[cfg(test)]
mod tests;
