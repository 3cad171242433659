//! mayfly's snapshot format: a directory with a state file (header with magic, format version,
//! architecture and host fingerprint; the VM's and devices' state; a checksum) and a memory
//! file. Filled in with the snapshot/restore work; devices define their own saved state next
//! to themselves and this crate ties them together.
