//! How a VM outlives its VMM: captured to a snapshot directory ([`capture`]), restored from
//! one ([`restore`]) or by a VMM started ahead of it ([`standby`]), and forked into live clones
//! ([`fork`], whose clones a single-threaded [`zygote`] makes).

pub mod capture;
pub mod fork;
pub mod restore;
pub mod standby;
pub mod zygote;
