//! The names of a snapshot directory's files.

/// The state file's name inside a snapshot directory.
pub const STATE_FILE: &str = "state";
/// The memory file's name inside a snapshot directory.
pub const MEMORY_FILE: &str = "memory";
/// The directory of a snapshot's disk layers (hard links of the copy-on-write layers of its
/// writable disks, which its state names as `disks/<file>`).
pub const DISKS_DIR: &str = "disks";
