//! The fork's clone factory: one single-threaded process per fork that holds the prepared
//! snapshot and fork(2)s a clone out of itself per request, so that a clone costs what making
//! its KVM VM costs, not a `mayfly` process start.
//!
//! 1. The forking VMM starts `mayfly zygote` (one exec per fork, whatever the clone count),
//!    passing it the fork's state, its memory (one base, or the layers its state names) and
//!    one end of a socket pair.
//! 2. The zygote prepares the restore once ([`crate::persist::restore::prepare`]): reads and checks the
//!    state, opens KVM and checks the state against it, maps the memory copy-on-write.
//!    It never starts a thread: only a single-threaded process can fork(2) and let the child
//!    go on allocating, opening and starting threads as any process does.
//! 3. For each request (a clone's name, index and files, its console log attached) it forks;
//!    the forking VMM keeps a few clones starting at once (four per host CPU), not all.
//!    The child makes itself a process of its own (its own process group, stderr to its log),
//!    makes its KVM VM (a VM belongs to the process that created it, so no VM ever crosses a
//!    fork), paused, and reports on the socket that it is ready. The zygote sends the forking
//!    VMM the child's pid with a pidfd: clones are killed by pidfd, never by a pid that may
//!    have been recycled.
//! 4. When every clone is ready, the forking VMM kills the zygote (it has answered every
//!    request; the clones no longer die with it), writes the fork's answer, then queues
//!    `Message::Go` and closes its end: every clone runs ([`ForkEnd`]) and lives on. A
//!    clone that sees the end close without the word (the forking VMM died, or its answer
//!    reached nobody) stops.
//!
//! Why, measured on this machine's KVM with the probe guest (benches/results/probe-host.json):
//! starting every clone as `mayfly restore` of inherited descriptors cost 3.3 ms per clone (100
//! clones in 327 ms; the exec, the dynamic linking of a 37 MB binary and the state parse each
//! time), against the ~0.5 ms the KVM work itself takes. A pool of VMM processes started in
//! advance would still parse the state and map the memory per clone, and sits idle between
//! forks; fork(2) of a process that has done both already shares them, copy-on-write. The
//! forking VMM itself cannot be the one to fork(2): it is multi-threaded (its vCPUs, devices
//! and control socket), and a child of a multi-threaded process may not allocate.

pub mod child;
pub mod message;
pub mod parent;

pub use child::{serve, CloneMain, ForkEnd, Reporter};
pub use message::{CloneInfo, ZygoteError};
pub use parent::{Release, Zygote};

#[cfg(test)]
mod tests;
