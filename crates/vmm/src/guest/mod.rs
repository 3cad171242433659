//! The guest from the host, through its agent (`mayfly-agent`, agent/guest; the protocol is
//! agent/PROTOCOL.md): one vsock connection per operation ([`agent`]), each bounded by its
//! deadline, its idle limit and its client's hang-up ([`watch`]), the refresh after every
//! boot, restore and fork ([`refresh`]), and the control socket's routes into the guest
//! ([`routes`]).

pub mod agent;
pub mod refresh;
pub mod routes;
pub mod watch;
