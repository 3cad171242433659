//! One connection: HELLO, one REQUEST, the op, the closing handshake.

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::time::Duration;

use mayfly_agent_protocol::{
    read_frame, write_message, ErrorCode, FrameError, FrameType, Hello, Message, PingReply,
    ProtocolError, Request, OPS, PROTOCOL_VERSION,
};
use serde::Serialize;

use crate::conn::Conn;
use crate::{exec, files, refresh};

/// How long a host may take between HELLO and its REQUEST before the slot is freed.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// How long the closing handshake waits for the host to close its side.
const FINISH_GRACE: Duration = Duration::from_secs(2);

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

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Serves one connection from HELLO to close.
pub fn serve(mut conn: Conn, cfg: &Config) {
    let hello = Message::Hello(Hello {
        protocol: PROTOCOL_VERSION,
        agent: cfg.agent.clone(),
        ops: OPS.iter().map(|op| op.to_string()).collect(),
    });
    if send(&mut conn, &hello).is_err() {
        return;
    }
    let answer = match session(&mut conn, cfg) {
        Ok(()) => None,
        Err(SessionError::Op(e)) => Some(Message::error(e.code, e.message)),
        Err(SessionError::Protocol(e)) => {
            log!("closing a connection: {e}");
            Some(Message::error(ErrorCode::Protocol, e.to_string()))
        }
        Err(SessionError::Gone(_)) => return,
    };
    if let Some(msg) = answer {
        let _ = conn.set_nonblocking(false);
        if send(&mut conn, &msg).is_err() {
            return;
        }
    }
    conn.finish(FINISH_GRACE);
}

/// Answers "busy" on a connection over the cap.
pub fn refuse_busy(mut conn: Conn, limit: usize) {
    // A fresh socket's buffer takes a small frame at once; the timeout is for a host that
    // is stuck anyway.
    let _ = conn.set_write_timeout(Some(Duration::from_secs(1)));
    let msg = Message::error(
        ErrorCode::Busy,
        format!("the agent is serving {limit} connections, its limit; retry shortly"),
    );
    let _ = send(&mut conn, &msg);
    conn.shutdown_write();
}

fn session(conn: &mut Conn, cfg: &Config) -> SessionResult {
    conn.set_read_timeout(Some(REQUEST_TIMEOUT))
        .map_err(SessionError::Gone)?;
    let frame = match read_frame(conn) {
        Ok(Some(frame)) => frame,
        Ok(None) => return Err(SessionError::Gone(io::ErrorKind::UnexpectedEof.into())),
        Err(FrameError::Io(e)) if is_timeout(&e) => {
            return Err(OpError::new(
                ErrorCode::Timeout,
                format!(
                    "no REQUEST arrived within {} s of HELLO",
                    REQUEST_TIMEOUT.as_secs()
                ),
            )
            .into())
        }
        Err(e) => return Err(e.into()),
    };
    conn.set_read_timeout(None).map_err(SessionError::Gone)?;
    if frame.kind != FrameType::Request {
        return Err(ProtocolError::Unexpected {
            expected: "a REQUEST after HELLO",
            got: frame.kind,
        }
        .into());
    }
    let request =
        Request::parse(&frame.payload).map_err(|e| OpError::new(e.code(), e.to_string()))?;
    match request {
        Request::Exec(r) => exec::run(conn, &r),
        Request::WriteFile(r) => files::write_file(conn, &r),
        Request::ReadFile(r) => files::read_file(conn, &r),
        Request::Stat(r) => files::stat(conn, &r),
        Request::List(r) => files::list(conn, &r),
        Request::Remove(r) => files::remove(conn, &r),
        Request::Mkdir(r) => files::mkdir(conn, &r),
        Request::Refresh(r) => refresh::refresh(conn, &r, cfg),
        Request::Identity(_) => send_ok(conn, &refresh::current_identity(cfg)),
        Request::Ping(_) => {
            let reply = PingReply {
                uptime_ms: crate::sys::clock_ms(libc::CLOCK_BOOTTIME).unwrap_or(0),
                protocol: PROTOCOL_VERSION,
                agent: cfg.agent.clone(),
            };
            send_ok(conn, &reply)
        }
    }
}
