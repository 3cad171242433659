//! The control socket: bound (claimed, so that two managers never serve one socket), each
//! connection served on a thread of its own (up to [`MAX_CONNECTIONS`] at once), the idle
//! watch started beside it, and everything left as it is when the manager is told to stop.

use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use mayfly_api::http::{self, Refusal};

use crate::config::ServeConfig;
use crate::error::ServeError;
use crate::manager::Manager;
use crate::routes::{error_reply, refusal_reply, reply, route, streamed, REQUEST_IDLE};

/// Connections served at once; more get 503 at once.
const MAX_CONNECTIONS: usize = 256;
/// How long a client may take to send its request, in all.
const REQUEST_TOTAL: Duration = Duration::from_secs(30);
/// How often the idle watch looks at the sandboxes.
const WATCH_EVERY: Duration = Duration::from_millis(250);

/// Serve until `stop` reads something (or closes): the caller's signal handling.
pub fn serve(config: &ServeConfig, stop: UnixStream) -> Result<(), ServeError> {
    let manager = Arc::new(Manager::open(
        &config.state_dir,
        config.mayfly.clone(),
        &config.policy,
    )?);
    manager.recover();
    let mut claim = mayfly_sys::claim::SocketClaim::new(&config.sock)?;
    let listener = claim.bind()?;
    // The socket file this manager made: at the end it removes that one only, never one a
    // newer manager bound at the same path meanwhile.
    let socket_id = std::fs::metadata(&config.sock)
        .ok()
        .map(|m| (m.dev(), m.ino()));
    listener
        .set_nonblocking(true)
        .map_err(|source| ServeError::Io {
            what: "listen on",
            path: config.sock.display().to_string(),
            source,
        })?;
    manager.event(
        "serving",
        "",
        json!({ "socket": config.sock, "state_dir": config.state_dir, "jail": config.policy.jail }),
    );
    {
        let manager = Arc::clone(&manager);
        std::thread::Builder::new()
            .name("idle-watch".into())
            .spawn(move || loop {
                std::thread::sleep(WATCH_EVERY);
                manager.watch_once();
            })
            .map_err(|source| ServeError::Io {
                what: "start",
                path: "the idle watch thread".into(),
                source,
            })?;
    }
    let active = Arc::new(AtomicUsize::new(0));
    use nix::poll::{poll, PollFd, PollFlags};
    loop {
        let mut fds = [
            PollFd::new(&listener, PollFlags::POLLIN),
            PollFd::new(&stop, PollFlags::POLLIN),
        ];
        let ready = poll(&mut fds, -1);
        if fds[1].revents().is_none_or(|r| !r.is_empty()) {
            break;
        }
        if ready.is_err() {
            continue;
        }
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(_) => {
                // Out of descriptors, most likely: let the moment pass instead of spinning.
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        if active.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
            active.fetch_sub(1, Ordering::SeqCst);
            reply(
                &stream,
                503,
                &json!({ "error": format!("the manager serves {MAX_CONNECTIONS} connections at once: try again") }),
            );
            continue;
        }
        let manager = Arc::clone(&manager);
        let active_now = Arc::clone(&active);
        let spawned = std::thread::Builder::new()
            .name("serve-conn".into())
            .spawn(move || {
                connection(&manager, stream);
                active_now.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            active.fetch_sub(1, Ordering::SeqCst);
        }
    }
    manager.event("stopped", "", json!({ "sandboxes": "left as they are" }));
    drop(listener);
    let ours = std::fs::symlink_metadata(&config.sock)
        .is_ok_and(|m| Some((m.dev(), m.ino())) == socket_id);
    if ours {
        let _ = std::fs::remove_file(&config.sock);
    }
    claim.release();
    Ok(())
}

/// Serve one connection: read its request, and answer it.
fn connection(manager: &Manager, stream: UnixStream) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_write_timeout(Some(REQUEST_TOTAL));
    manager.metrics.requests.fetch_add(1, Ordering::Relaxed);
    let request = match http::read_request(&stream, REQUEST_IDLE, REQUEST_TOTAL, streamed) {
        Ok(request) => request,
        Err(Refusal::Silent) => return,
        Err(Refusal::Reply { status, message }) => {
            manager
                .metrics
                .requests_refused
                .fetch_add(1, Ordering::Relaxed);
            error_reply(&stream, status, message);
            return;
        }
    };
    if let Err(refused) = route(manager, &request, &stream) {
        manager
            .metrics
            .requests_refused
            .fetch_add(1, Ordering::Relaxed);
        refusal_reply(&stream, &refused);
    }
}
