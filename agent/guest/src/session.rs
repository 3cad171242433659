//! One connection: HELLO, one REQUEST, the op, the closing handshake.

use std::io;
use std::time::Duration;

use mayfly_agent_protocol::{
    read_frame, ErrorCode, FrameError, FrameType, Hello, Message, PingReply, ProtocolError,
    Request, OPS, PROTOCOL_VERSION,
};

use crate::conn::Conn;
use crate::op::{send, send_ok, Config, OpError, SessionError, SessionResult};
use crate::{exec, files, refresh};

/// How long a host may take between HELLO and its REQUEST before the slot is freed.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// How long the closing handshake waits for the host to close its side.
const FINISH_GRACE: Duration = Duration::from_secs(2);

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
