//! The protocol's fixed numbers: its version, its frame and chunk sizes, its port.

/// The protocol's version. A new optional field keeps it; a changed meaning bumps it.
pub const PROTOCOL_VERSION: u32 = 1;

/// The largest frame length (the 4-byte prefix's value): a type byte plus 1 MiB of payload.
pub const MAX_FRAME: usize = 1024 * 1024 + 1;

/// The largest payload a frame can carry.
pub const MAX_PAYLOAD: usize = MAX_FRAME - 1;

/// How much output or file data one STDOUT, STDERR or DATA frame carries at most.
pub const CHUNK_SIZE: usize = 64 * 1024;

/// The vsock port the agent listens on unless told otherwise.
pub const DEFAULT_VSOCK_PORT: u32 = 52;
