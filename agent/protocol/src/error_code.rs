//! The codes of an ERROR frame: what kind of failure the agent reports.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Error codes of an ERROR frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The path, user or directory does not exist.
    NotFound,
    /// The guest refused access.
    Permission,
    /// The request is malformed or asks for something impossible.
    Invalid,
    /// An input/output error inside the guest.
    Io,
    /// The op (or a feature of it) is not implemented by this agent.
    Unsupported,
    /// The agent is serving as many connections as it allows; retry later.
    Busy,
    /// Something took too long (e.g. no REQUEST arrived in time).
    Timeout,
    /// The host broke the protocol (bad frame, wrong frame type).
    Protocol,
    /// A code this client does not know (from a newer agent).
    #[serde(other)]
    Other,
}

impl ErrorCode {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::NotFound => "not_found",
            ErrorCode::Permission => "permission",
            ErrorCode::Invalid => "invalid",
            ErrorCode::Io => "io",
            ErrorCode::Unsupported => "unsupported",
            ErrorCode::Busy => "busy",
            ErrorCode::Timeout => "timeout",
            ErrorCode::Protocol => "protocol",
            ErrorCode::Other => "other",
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
