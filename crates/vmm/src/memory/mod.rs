//! Guest memory: its RAM and the file behind it ([`ram`]: a memfd, or a snapshot's memory file
//! mapped copy-on-write or copied), a chain of memory files ([`chain`]), RAM written out sparse
//! ([`sparse`]), RAM served page by page as the guest touches it ([`lazy`], userfaultfd), and
//! diff snapshots ([`diff`]).

pub mod chain;
pub mod diff;
pub mod lazy;
pub mod ram;
pub mod sparse;
