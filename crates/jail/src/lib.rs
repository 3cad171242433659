//! What keeps a VMM that runs someone else's guest from reaching the rest of the host, kept
//! apart from the VMM as Firecracker keeps its jailer:
//!
//! - [`jail`]: `--jail` puts the VMM in namespaces and a cgroup of its own, then, before the
//!   guest runs, into an empty root as an unprivileged uid with no capabilities;
//! - [`seccomp`]: every thread of the VMM but its controller runs under a seccomp filter made
//!   for what that thread does (a vCPU, a device, the control socket, ...).

pub mod jail;
pub mod seccomp;
