//! What can go wrong serving or using the control socket.

use mayfly_sys::claim::ClaimError;
use mayfly_sys::socket::MAX_SOCKET_PATH;

/// What can go wrong serving or using the control socket.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("the API socket path {path} is {len} bytes long, but a Unix socket path can have at most {MAX_SOCKET_PATH}: choose a shorter --api-sock path")]
    PathTooLong { path: String, len: usize },
    #[error(
        "the API socket path {0:?} is not valid: it must be a non-empty path without NUL bytes"
    )]
    InvalidPath(String),
    #[error(transparent)]
    Claim(#[from] ClaimError),
    #[error("cannot start the API server thread: {0}")]
    Thread(std::io::Error),
    #[error("no mayfly listens on {path}: is the VM running with --api-sock {path}?")]
    NotListening { path: String },
    #[error("permission denied connecting to {path}: the API socket belongs to the user who started the VM; run as that user (or root)")]
    PermissionDenied { path: String },
    #[error("cannot connect to the mayfly API socket {path}: {source}")]
    Connect {
        path: String,
        source: std::io::Error,
    },
    #[error("lost the connection to mayfly on {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("mayfly on {path} did not answer within {secs} s: the VM may be stuck; try again or stop it")]
    Timeout { path: String, secs: u64 },
    #[error("mayfly on {path} sent an invalid response: {reason}")]
    InvalidResponse { path: String, reason: String },
    #[error("invalid API request: {0}")]
    InvalidRequest(String),
}
