//! Which devices a VM gets: at boot (what the command line asked for), and at a restore (what
//! the snapshot's devices connect to on this host).

use std::path::PathBuf;

use crate::devices::disks::DiskSpec;
use crate::devices::net::{NetSpec, NetTargets};

/// Which virtio devices a VM gets at boot.
#[derive(Clone, Debug, Default)]
pub struct DevicesConfig {
    pub rng: bool,
    pub vsock: Option<VsockConfig>,
    /// Disks, in order: the first is `vda` (the root file system with `--rootfs`).
    pub disks: Vec<DiskSpec>,
    /// Where the writable disks' own layers live (see `disks`).
    pub disk_dir: Option<PathBuf>,
    /// A NIC and its network (none: `--net none`, no NIC at all).
    pub net: Option<NetSpec>,
}

/// The vsock device: the guest's CID and the host socket (none: the guest can reach nothing
/// and nothing reaches it, but its driver stays bound, so a snapshot keeps the device).
#[derive(Clone, Debug)]
pub struct VsockConfig {
    pub guest_cid: u64,
    pub path: Option<PathBuf>,
}

/// What a restored VM's devices connect to on this host (which may differ from where the
/// snapshot was taken).
#[derive(Clone, Debug, Default)]
pub struct RestoreTargets {
    pub vsock_path: Option<PathBuf>,
    /// A clone's own CID; None keeps the snapshot's.
    pub vsock_cid: Option<u64>,
    /// The snapshot directory the disks' layers are named relative to (None for a fork,
    /// whose state names them by full path).
    pub snapshot_dir: Option<PathBuf>,
    /// Where the writable disks' new top layers go.
    pub disk_dir: Option<PathBuf>,
    /// Layers named by full path must lie in here (see [`crate::devices::disks::open_for_restore`]).
    pub layers_within: Option<PathBuf>,
    /// Layers named by full path under `.0` are opened at the same place under `.1` (a
    /// sandbox manager's clone: its own links to its source's layers).
    pub layers_moved: Option<(PathBuf, PathBuf)>,
    /// Where the NIC's network is made (if the snapshot has a NIC), and with what.
    pub net: NetTargets,
}

/// The guest CID a VM's vsock device has unless told otherwise.
pub const DEFAULT_GUEST_CID: u64 = 3;
