//! Error types. Three layers, so that each caller can tell what to do:
//! [`ProtocolError`] (the peer sent something this protocol does not allow),
//! [`FrameError`] (reading or writing a frame: a protocol error or the connection failed),
//! [`Error`] (what [`crate::AgentClient`] returns: adds the agent's own ERROR replies,
//! version mismatches and failures of the caller's local readers and writers).

use std::io;

use crate::error_code::ErrorCode;
use crate::frame_type::FrameType;
use crate::params::MAX_FRAME;

/// The peer broke the protocol. The connection is unusable afterwards: close it.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("frame length 0: a frame holds at least its type byte")]
    EmptyFrame,
    #[error("frame length {0} exceeds the maximum of {MAX_FRAME} bytes")]
    FrameTooLarge(u64),
    #[error("unknown frame type 0x{0:02x}")]
    UnknownType(u8),
    #[error("the connection ended in the middle of a frame")]
    Truncated,
    #[error("bad {frame} payload: {reason}")]
    BadPayload { frame: FrameType, reason: String },
    #[error("expected {expected}, got a {got} frame")]
    Unexpected {
        expected: &'static str,
        got: FrameType,
    },
    #[error("the connection closed while waiting for {0}")]
    Closed(&'static str),
    #[error("a {frame} payload of {len} bytes does not fit in one frame (at most {max})", max = MAX_FRAME - 1)]
    PayloadTooLarge { frame: FrameType, len: usize },
    #[error("{0}")]
    Other(String),
}

/// Reading or writing one frame failed.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    #[error("connection i/o failed: {0}")]
    Io(#[from] io::Error),
}

/// Everything [`crate::AgentClient`] can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The agent answered ERROR: the operation failed inside the guest.
    #[error("the agent refused or failed the request ({code}): {message}")]
    Agent { code: ErrorCode, message: String },
    /// The agent sent something the protocol does not allow (or nothing at all).
    #[error("agent protocol error: {0}")]
    Protocol(#[from] ProtocolError),
    /// The connection to the agent failed.
    #[error("connection to the agent failed: {0}")]
    Io(io::Error),
    /// The agent speaks a different protocol version.
    #[error(
        "the agent ({agent}) speaks protocol version {theirs}, this host speaks {ours}: \
         rebuild the guest image with a matching mayfly-agent"
    )]
    VersionMismatch {
        ours: u32,
        theirs: u32,
        agent: String,
    },
    /// Reading the caller's input (stdin for exec, file contents for write_file) failed.
    #[error("reading the local input failed: {0}")]
    Input(io::Error),
    /// Writing to the caller's output (read_file's destination) failed.
    #[error("writing the local output failed: {0}")]
    Output(io::Error),
    /// The request was refused before anything was sent; the message says why.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The agent sent more than this client keeps (say, a directory past its listing
    /// limits): nothing of it is returned.
    #[error("the agent's {what} exceeds {limit}: {advice}")]
    TooLarge {
        what: &'static str,
        limit: String,
        advice: &'static str,
    },
    /// A signal was sent while no program was running on that connection.
    #[error("no program is running on this connection (not started yet, or already exited)")]
    NotRunning,
}

impl From<FrameError> for Error {
    fn from(e: FrameError) -> Self {
        match e {
            FrameError::Protocol(p) => Error::Protocol(p),
            FrameError::Io(e) => Error::Io(e),
        }
    }
}

impl Error {
    /// The agent's error code, if the agent answered ERROR.
    pub fn agent_code(&self) -> Option<ErrorCode> {
        match self {
            Error::Agent { code, .. } => Some(*code),
            _ => None,
        }
    }
}
