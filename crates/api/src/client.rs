//! The client side: one request per connection, as `mayfly`'s own commands send them.

use std::io::{ErrorKind, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::Duration;

use serde_json::Value;

use crate::error::ApiError;
use crate::http::{self, ReadError, ResponseError};
use mayfly_sys::socket::{self, MAX_SOCKET_PATH};

/// How long a request may take, answer included: longer than the server waits for the VM
/// (120 s), so the client sees the server's 504 rather than its own timeout.
const TIMEOUT: Duration = Duration::from_secs(130);

/// Send one request and return (status, parsed JSON body or Null).
pub fn request(
    socket: &Path,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> Result<(u16, Value), ApiError> {
    request_with_timeout(socket, method, path, body, TIMEOUT)
}

/// [`request`] with another time limit.
pub fn request_with_timeout(
    socket: &Path,
    method: &str,
    path: &str,
    body: Option<&Value>,
    timeout: Duration,
) -> Result<(u16, Value), ApiError> {
    exchange(socket, method, path, body, timeout, None)
}

/// [`request`], and a pidfd of the process that serves the socket, as the kernel says it
/// (SO_PEERCRED, taken once connected): what is asked of that process is asked of the one
/// that answers, whatever its answer says it is.
pub fn request_with_server(
    socket: &Path,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> Result<(u16, Value, std::os::fd::OwnedFd), ApiError> {
    let mut server = None;
    let (status, value) = exchange(socket, method, path, body, TIMEOUT, Some(&mut server))?;
    let server = server.ok_or_else(|| ApiError::InvalidResponse {
        path: socket.display().to_string(),
        reason: "the process serving it cannot be named".into(),
    })?;
    Ok((status, value, server))
}

/// Its process, by pidfd (see [`request_with_server`]).
fn server_of(stream: &std::os::unix::net::UnixStream) -> std::io::Result<std::os::fd::OwnedFd> {
    use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
    let credentials = getsockopt(stream, PeerCredentials).map_err(std::io::Error::from)?;
    mayfly_sys::pidfd::open(credentials.pid())
}

fn exchange(
    socket: &Path,
    method: &str,
    path: &str,
    body: Option<&Value>,
    timeout: Duration,
    server: Option<&mut Option<std::os::fd::OwnedFd>>,
) -> Result<(u16, Value), ApiError> {
    if !http::is_token(method) {
        return Err(ApiError::InvalidRequest(format!(
            "{method:?} is not an HTTP method"
        )));
    }
    if !path.starts_with('/') || path.bytes().any(|b| b <= b' ' || b == 0x7f) {
        return Err(ApiError::InvalidRequest(format!(
            "{path:?} is not a request path such as /vm"
        )));
    }
    let timeout = timeout.max(Duration::from_millis(1));
    let shown = socket.display().to_string();
    let timed_out = || ApiError::Timeout {
        path: shown.clone(),
        secs: timeout.as_secs(),
    };
    let io_error = |source| ApiError::Io {
        path: shown.clone(),
        source,
    };

    let stream = socket::connect(socket, timeout).map_err(|source| match source.kind() {
        ErrorKind::NotFound | ErrorKind::ConnectionRefused => ApiError::NotListening {
            path: shown.clone(),
        },
        ErrorKind::PermissionDenied => ApiError::PermissionDenied {
            path: shown.clone(),
        },
        ErrorKind::WouldBlock | ErrorKind::TimedOut => timed_out(),
        ErrorKind::InvalidInput if socket.as_os_str().len() > MAX_SOCKET_PATH => {
            ApiError::PathTooLong {
                path: shown.clone(),
                len: socket.as_os_str().as_bytes().len(),
            }
        }
        ErrorKind::InvalidInput => ApiError::InvalidPath(shown.clone()),
        _ => ApiError::Connect {
            path: shown.clone(),
            source,
        },
    })?;
    let deadline = http::deadline(timeout);
    if let Some(server) = server {
        *server = Some(server_of(&stream).map_err(io_error)?);
    }

    let body = body
        .map(serde_json::to_vec)
        .transpose()
        .map_err(|e| ApiError::InvalidRequest(format!("cannot encode the body: {e}")))?;
    let mut message =
        format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nAccept: application/json\r\n");
    match &body {
        Some(body) => message.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        )),
        None if method != "GET" && method != "HEAD" => message.push_str("Content-Length: 0\r\n"),
        None => {}
    }
    message.push_str("Connection: close\r\n\r\n");
    let mut message = message.into_bytes();
    message.extend_from_slice(body.as_deref().unwrap_or_default());
    match (&stream).write_all(&message) {
        Ok(()) => {}
        // The server may answer before it reads everything (a body too large, say): read on.
        Err(e) if matches!(e.kind(), ErrorKind::BrokenPipe | ErrorKind::ConnectionReset) => {}
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
            return Err(timed_out())
        }
        Err(e) => return Err(io_error(e)),
    }

    let response = http::read_response(&stream, deadline).map_err(|e| match e {
        ResponseError::Read(ReadError::TimedOut) => timed_out(),
        ResponseError::Read(ReadError::Eof) => io_error(ErrorKind::UnexpectedEof.into()),
        ResponseError::Read(ReadError::Io(source)) => io_error(source),
        ResponseError::NoResponse => ApiError::InvalidResponse {
            path: shown.clone(),
            reason: "it closed the connection without answering".into(),
        },
        ResponseError::Invalid(reason) => ApiError::InvalidResponse {
            path: shown.clone(),
            reason,
        },
    })?;
    let value = if response.body.trim_ascii().is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&response.body).map_err(|e| ApiError::InvalidResponse {
            path: shown.clone(),
            reason: format!("its body is not JSON ({e})"),
        })?
    };
    Ok((response.status, value))
}
