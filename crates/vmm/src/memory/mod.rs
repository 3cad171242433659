//! Guest memory: its RAM and the file behind it ([`ram`]: a memfd, or a snapshot's memory file
//! mapped copy-on-write or copied), RAM served page by page as the guest touches it ([`lazy`],
//! userfaultfd), and the layers of a diff snapshot ([`diff`]).

pub mod diff;
pub mod lazy;
pub mod ram;
