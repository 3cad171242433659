//! The guest from the host, through its agent (`mayfly-agent`, agent/guest; the protocol is
//! agent/PROTOCOL.md): one vsock connection per operation ([`agent`]), the refresh after every
//! boot, restore and fork ([`refresh`]), and the control socket's routes into the guest
//! ([`routes`]).

pub mod agent;
pub mod refresh;
pub mod routes;
