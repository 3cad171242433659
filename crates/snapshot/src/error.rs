//! What can be wrong with a snapshot's files.

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("cannot read the snapshot state file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("cannot write the snapshot state file {path}: {source}")]
    Write {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not a mayfly snapshot state file (bad magic)")]
    NotASnapshot { path: String },
    #[error("{path} is snapshot format version {found}; this mayfly reads version {supported}: restore it with the mayfly that wrote it")]
    Version {
        path: String,
        found: u32,
        supported: u32,
    },
    #[error("{path} is truncated: the snapshot is incomplete")]
    Truncated { path: String },
    #[error("{path} is corrupted: its checksum does not match (stored {stored:#010x}, computed {computed:#010x})")]
    Checksum {
        path: String,
        stored: u32,
        computed: u32,
    },
    #[error("{path} is corrupted: {what} does not decode ({reason})")]
    Decode {
        path: String,
        what: &'static str,
        reason: String,
    },
    #[error("cannot encode the snapshot state: {0}")]
    Encode(String),
    #[error("cannot open {path}: {reason}")]
    Open { path: String, reason: String },
    #[error("{path} is {len} bytes, more than a mayfly state file can be ({max}): it is not a snapshot state file")]
    TooLarge { path: String, len: u64, max: u64 },
    #[error("the snapshot's memory file {path} does not match its state: {reason}")]
    MemoryMismatch { path: String, reason: String },
}
