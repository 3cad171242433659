//! The process plumbing every mayfly program shares and std lacks: pidfds, seqpacket sockets,
//! poll, fork into a cgroup, claimed socket paths, mountinfo, atomic file writes, memfd seals,
//! file extents, the terminal and phase traces. Nothing here knows about VMs: it is the layer
//! below all of them.

pub mod atomic;
pub mod beneath;
pub mod claim;
pub mod extents;
pub mod fork;
pub mod mountinfo;
pub mod pidfd;
pub mod poll;
pub mod seal;
pub mod seqpacket;
pub mod socket;
pub mod terminal;
pub mod trace;

/// Stack size of mayfly's own helper threads (vCPUs, console, signals, the control socket's).
/// They need little, and a stack smaller than 2 MiB can never be backed by a transparent huge
/// page, which would cost 2 MiB of RSS per thread on hosts that enable THP for all anonymous
/// memory.
pub const HELPER_THREAD_STACK: usize = 256 << 10;
