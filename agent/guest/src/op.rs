//! What every op shares: the agent's configuration, how an op fails (an ERROR frame with a
//! code) and how it answers.

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::time::Duration;

use mayfly_agent_protocol::{write_message, ErrorCode, FrameError, Message, ProtocolError};
use serde::Serialize;

use crate::conn::Conn;

/// What the command line decided, shared by every connection.
#[derive(Debug, Clone)]
pub struct Config {
    /// `"mayfly-agent <version>"`.
    pub agent: String,
    /// Set the clock, mix entropy and set the hostname on refresh. Off in tests on a host,
    /// where those would change the host itself.
    pub system_changes: bool,
    /// Where identity.json is kept (`/run/mayfly`).
    pub run_dir: PathBuf,
    /// Where on-restore.d and on-fork.d are (`/etc/mayfly`).
    pub hooks_dir: PathBuf,
    pub hook_timeout: Duration,
}

/// An op failed: answered with an ERROR frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct OpError {
    pub code: ErrorCode,
    pub message: String,
}

impl OpError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> OpError {
        OpError {
            code,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> OpError {
        OpError::new(ErrorCode::Invalid, message)
    }

    /// An OS error, with what was being done when it happened.
    pub fn io(context: impl fmt::Display, e: &io::Error) -> OpError {
        OpError::new(code_for(e), format!("{context}: {e}"))
    }
}

/// The protocol's error code for an OS error.
pub fn code_for(e: &io::Error) -> ErrorCode {
    match e.raw_os_error() {
        Some(libc::ENOENT) => ErrorCode::NotFound,
        Some(libc::EACCES | libc::EPERM | libc::EROFS) => ErrorCode::Permission,
        Some(
            libc::EEXIST
            | libc::ENOTDIR
            | libc::EISDIR
            | libc::ENOTEMPTY
            | libc::EINVAL
            | libc::ENAMETOOLONG
            | libc::ELOOP
            | libc::EXDEV,
        ) => ErrorCode::Invalid,
        Some(libc::EBUSY | libc::ETXTBSY) => ErrorCode::Busy,
        Some(libc::ETIMEDOUT) => ErrorCode::Timeout,
        Some(libc::ENOSYS | libc::EOPNOTSUPP) => ErrorCode::Unsupported,
        _ => match e.kind() {
            io::ErrorKind::NotFound => ErrorCode::NotFound,
            io::ErrorKind::PermissionDenied => ErrorCode::Permission,
            io::ErrorKind::InvalidInput | io::ErrorKind::InvalidData => ErrorCode::Invalid,
            _ => ErrorCode::Io,
        },
    }
}

/// How a session ended early.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// The op failed; the host gets an ERROR with this code.
    #[error(transparent)]
    Op(#[from] OpError),
    /// The host broke the protocol; it gets an ERROR "protocol" and the connection closes.
    #[error("protocol error: {0}")]
    Protocol(#[from] ProtocolError),
    /// The connection failed or the host went away: nobody to answer.
    #[error("the connection ended: {0}")]
    Gone(io::Error),
}

impl From<FrameError> for SessionError {
    fn from(e: FrameError) -> Self {
        match e {
            FrameError::Protocol(p) => SessionError::Protocol(p),
            FrameError::Io(e) => SessionError::Gone(e),
        }
    }
}

pub type SessionResult = Result<(), SessionError>;

pub fn send(conn: &mut Conn, msg: &Message) -> SessionResult {
    write_message(conn, msg).map_err(SessionError::from)
}

/// Sends the OK that ends an op.
pub fn send_ok<T: Serialize>(conn: &mut Conn, reply: &T) -> SessionResult {
    send(conn, &Message::ok(reply)?)
}
