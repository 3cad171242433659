//! Why a disk or layer could not be opened, created or used.

use std::path::PathBuf;

/// Why a disk or layer could not be opened, created or used.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("cannot open {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a regular file (a directory or device?): give the path of a raw disk image or layer file")]
    NotAFile { path: PathBuf },
    #[error("{path} is not a mayfly disk layer (no layer header): pass only files made by mayfly as layers, the raw image as the base")]
    NotALayer { path: PathBuf },
    #[error("{path} is a layer of format version {version}; this mayfly reads version 1: use the mayfly that made it")]
    UnsupportedVersion { path: PathBuf, version: u32 },
    #[error("the layer {path} is damaged ({reason}): restore it from a copy or rebuild the chain")]
    Corrupt { path: PathBuf, reason: String },
    #[error("the layer {path} is truncated: {found} bytes where its header needs {expected}; it was cut short (an incomplete copy?): copy it again, keeping it sparse")]
    Truncated {
        path: PathBuf,
        expected: u64,
        found: u64,
    },
    #[error("the layer {path} sits on {found}, not on {expected} below it: list the layers bottom to top, each on the one before")]
    WrongParent {
        path: PathBuf,
        expected: String,
        found: String,
    },
    #[error("the layer {path} was made on the base image {found:?}, not on {expected:?}: use the base image it was made on")]
    WrongBase {
        path: PathBuf,
        expected: String,
        found: String,
    },
    #[error("the layer {path} is of a {found}-byte disk where the chain's is {expected} bytes")]
    SizeMismatch {
        path: PathBuf,
        expected: u64,
        found: u64,
    },
    #[error("a disk of {disk_size} bytes is smaller than its base image ({base_size} bytes): make it at least as big as the base")]
    DiskTooSmall { disk_size: u64, base_size: u64 },
    #[error("{size} bytes is no disk size: {reason}")]
    BadDiskSize { size: u64, reason: &'static str },
    #[error("the base identity is unusable: {0}")]
    BadBaseIdentity(&'static str),
    #[error("the layer {path} is not frozen, so something may still write it: only the top layer may be unfrozen (freeze it first)")]
    NotFrozen { path: PathBuf },
    #[error("the layer {path} is frozen and cannot be written: stack a new layer on it (create_layer) and open that as the top")]
    TopFrozen { path: PathBuf },
    #[error("{path} is in use by another disk (locked): a layer has one writer, and nobody stacks on a layer still being written")]
    InUse { path: PathBuf },
    #[error("cannot create the layer {path}: {source} (a new layer never replaces an existing file: pick a new path)")]
    Create {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the disk is read-only")]
    ReadOnly,
    #[error("a writable disk needs a layer to write: create one on the base (create_base_layer)")]
    NoLayers,
    #[error("{count} layers is more than a disk may have open ({max}): compact the chain")]
    TooManyLayers { count: usize, max: usize },
    #[error("bytes {offset}..+{len} are beyond the disk's {size} bytes")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    #[error("nothing to compact: {0}")]
    NothingToCompact(&'static str),
    #[error("cannot {op} {path}: {source}")]
    Io {
        path: PathBuf,
        op: &'static str,
        source: std::io::Error,
    },
}
