//! mayfly's snapshot format.
//!
//! A snapshot is a directory with two files:
//! - `state`: a header (magic, format version, architecture, the fingerprint of the host CPU
//!   and KVM features the state depends on), then the VM's state ([`VmState`]: vCPUs, in-kernel
//!   interrupt controllers and timer, KVM clock, devices, memory layout), then a checksum of
//!   everything before it ([`file`](mod@file)).
//! - `memory`: guest RAM, byte for byte at the offsets the memory layout gives, written
//!   sparse (pages of zeros are holes), then a one-page trailer naming the snapshot
//!   ([`trailer`]).
//! - A **diff snapshot** also has `memory-layers/`: the memory files it stacks on (hard links,
//!   oldest first, the first a full one), and its own `memory` holds only the pages written
//!   since the snapshot it was restored from ([`VmState::memory_layers`]).
//!
//! Devices define their saved state next to themselves (`mayfly_devices`); this crate ties the
//! pieces together and reads and writes the state file.
// Lossy `as` casts are refused here (tests aside): every conversion that can lose bits says
// why it cannot.
#![cfg_attr(
    not(test),
    warn(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_possible_wrap
    )
)]

pub mod error;
pub mod file;
pub mod gather;
pub mod layout;
pub mod open;
pub mod state;
pub mod trailer;

pub use error::SnapshotError;
pub use file::{read_state, read_state_file, write_state_file, Header, FORMAT_VERSION};
pub use gather::{gather_layers, GatherError};
pub use layout::{DISKS_DIR, MEMORY_FILE, STATE_FILE};
pub use open::{open_regular, SnapshotDir, MAX_STATE_BYTES};
pub use state::{
    layer_file_name, layer_name, Extent, HostFingerprint, IdentityState, KvmVmState, MemoryLayer,
    MemoryRange, VcpuState, VmState, MAX_MEMORY_EXTENTS, MAX_MEMORY_LAYERS, MAX_WORKING_SET,
    MEMORY_LAYERS_DIR,
};
pub use trailer::{check_trailer, memory_file_len, write_trailer, TRAILER_BYTES};
