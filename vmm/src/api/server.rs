//! The server side: bind the socket (taking it over from a dead VMM atomically, under a lock
//! file beside it), accept connections on a thread of its own and serve each on a thread of
//! its own (at most [`MAX_CONNECTIONS`] at once), turn each valid request into an [`ApiCall`]
//! for the VM's controller and write back its reply. Slow clients only hold their own thread:
//! a well-formed request is answered while a hundred others are still being sent.

use std::io::Write;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{Map, Value};

use super::guest;
use super::http::{self, Refusal, Request};
use super::socket::{self, MAX_SOCKET_PATH};
use super::{Action, ApiCall, ApiError, Reply, Services, MAX_FORK_COUNT};
use crate::fork::ForkRequest;

/// How long the server waits for the parts of a request and for the VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// How long a client may pause while it sends its request.
    pub idle: Duration,
    /// How long a client may take to send its whole request.
    pub request: Duration,
    /// How long the VM's controller may take to answer (then 504).
    pub reply: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            idle: Duration::from_secs(5),
            request: Duration::from_secs(10),
            reply: Duration::from_secs(120),
        }
    }
}

/// How long binding waits to learn whether an existing socket is alive.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// Connections served at once; past this a new one gets 503 at once.
pub const MAX_CONNECTIONS: usize = 64;
/// How often a server waiting for the VM checks whether it is being stopped.
const STOP_CHECK: Duration = Duration::from_millis(50);

/// State the server threads share with their [`ApiServer`].
struct Shared {
    stopping: AtomicBool,
    /// The connections being served (by an id), so that stopping can cut them short, and a
    /// new client at capacity can take the place of the slowest sender.
    current: Mutex<std::collections::HashMap<u64, Connection>>,
    /// Connection threads running; the last one out notifies `idle`.
    active: Mutex<usize>,
    idle: std::sync::Condvar,
    services: Services,
}

/// A connection as the server keeps track of it.
struct Connection {
    stream: UnixStream,
    accepted: Instant,
    /// Still sending its request: it holds a slot without having asked for anything yet.
    reading: bool,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A running server. Dropping it (or calling shutdown) stops accepting and removes the socket file.
pub struct ApiServer {
    path: PathBuf,
    /// Device and inode of the socket file this server created: it never removes another's.
    file_id: Option<(u64, u64)>,
    /// The claim on the path (its lock file), held for as long as the server lives.
    claim: Option<SocketClaim>,
    shared: Arc<Shared>,
    /// Closing this wakes the server thread, which then exits.
    wake: Option<UnixStream>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for ApiServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiServer")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl ApiServer {
    /// Bind `path` and serve on a background thread, sending each valid request to `calls`
    /// (wrapped by `wrap` so the caller can put it into its own event enum), then waiting for the reply.
    pub fn start<E: Send + 'static>(
        path: &Path,
        events: Sender<E>,
        wrap: fn(ApiCall) -> E,
        services: Services,
    ) -> Result<ApiServer, ApiError> {
        Self::start_with(path, events, wrap, Timeouts::default(), services)
    }

    /// [`ApiServer::start`] with other timeouts.
    pub fn start_with<E: Send + 'static>(
        path: &Path,
        events: Sender<E>,
        wrap: fn(ApiCall) -> E,
        timeouts: Timeouts,
        services: Services,
    ) -> Result<ApiServer, ApiError> {
        Self::start_claimed(SocketClaim::new(path)?, events, wrap, timeouts, services)
    }

    /// Serve on a path claimed earlier (so that nothing else can take it meanwhile).
    pub fn start_claimed<E: Send + 'static>(
        claim: SocketClaim,
        events: Sender<E>,
        wrap: fn(ApiCall) -> E,
        timeouts: Timeouts,
        services: Services,
    ) -> Result<ApiServer, ApiError> {
        let path = claim.path().to_path_buf();
        let path = path.as_path();
        // Sockets refuse a zero timeout; a millisecond is the shortest that means anything.
        let floor = Duration::from_millis(1);
        let timeouts = Timeouts {
            idle: timeouts.idle.max(floor),
            request: timeouts.request.max(floor),
            reply: timeouts.reply.max(floor),
        };
        let mut claim = claim;
        let listener = claim.bind()?;
        let shared = Arc::new(Shared {
            stopping: AtomicBool::new(false),
            current: Mutex::new(std::collections::HashMap::new()),
            active: Mutex::new(0),
            idle: std::sync::Condvar::new(),
            services,
        });
        // From here on, dropping `server` removes the socket file, also on the errors below.
        let mut server = ApiServer {
            path: path.to_owned(),
            file_id: std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino())),
            claim: Some(claim),
            shared: Arc::clone(&shared),
            wake: None,
            thread: None,
        };
        let (wake, woken) = UnixStream::pair().map_err(ApiError::Thread)?;
        listener.set_nonblocking(true).map_err(ApiError::Thread)?;
        // The accept thread and every connection thread it starts run under the control
        // socket's seccomp filter: they parse what clients send and relay the guest agent's
        // frames, and act on the VM only through the controller.
        let builder = std::thread::Builder::new()
            .name("api".into())
            .stack_size(crate::HELPER_THREAD_STACK);
        let thread = crate::seccomp::spawn(builder, crate::seccomp::ThreadKind::Api, move || {
            serve(listener, woken, &shared, &events, wrap, timeouts)
        })
        .map_err(ApiError::Thread)?;
        server.wake = Some(wake);
        server.thread = Some(thread);
        Ok(server)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Stop serving (a request waiting for the VM gets 503) and remove the socket file.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        {
            let current = lock(&self.shared.current);
            self.shared.stopping.store(true, Ordering::SeqCst);
            // Wakes reads from slow clients; the answers (503) can still be written.
            for conn in current.values() {
                let _ = conn.stream.shutdown(std::net::Shutdown::Read);
            }
        }
        drop(self.wake.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        // Connection threads answer 503 within STOP_CHECK once they see `stopping`.
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut active = lock(&self.shared.active);
        while *active > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            active = self
                .shared
                .idle
                .wait_timeout(active, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        drop(active);
        if let Some(id) = self.file_id.take() {
            let ours = std::fs::symlink_metadata(&self.path)
                .is_ok_and(|m| m.file_type().is_socket() && (m.dev(), m.ino()) == id);
            if ours {
                let _ = std::fs::remove_file(&self.path);
            }
        }
        if let Some(claim) = self.claim.take() {
            claim.release();
        }
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A socket path this process owns: validated, locked (the lock file `<path>.lock`) and cleared
/// of a stale socket a dead process left, but not bound yet. Of two VMMs started at once on one
/// path, one gets the claim, the other the "in use" error. Dropping the claim (or
/// [`SocketClaim::release`]) removes the lock file.
pub struct SocketClaim {
    path: PathBuf,
    lock: Option<socket::PathLock>,
    /// Bound ahead by [`SocketClaim::listen`].
    listener: Option<UnixListener>,
}

impl std::fmt::Debug for SocketClaim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SocketClaim")
            .field("path", &self.path)
            .finish()
    }
}

impl SocketClaim {
    pub fn new(path: &Path) -> Result<Self, ApiError> {
        use std::io::ErrorKind;
        use std::os::unix::ffi::OsStrExt;

        let shown = path.display().to_string();
        let bytes = path.as_os_str().as_bytes();
        if bytes.is_empty() || bytes.contains(&0) {
            return Err(ApiError::InvalidPath(shown));
        }
        if bytes.len() > MAX_SOCKET_PATH {
            return Err(ApiError::PathTooLong {
                path: shown,
                len: bytes.len(),
            });
        }
        let dir = match path.parent() {
            Some(dir) if !dir.as_os_str().is_empty() => dir,
            _ => Path::new("."),
        };
        let dir_error = |problem| ApiError::Directory {
            path: shown.clone(),
            dir: dir.display().to_string(),
            problem,
        };
        let bind_error = |source| ApiError::Bind {
            path: shown.clone(),
            source,
        };
        match std::fs::metadata(dir) {
            Ok(meta) if meta.is_dir() => {}
            Ok(_) => return Err(dir_error("is not a directory")),
            Err(e) if e.kind() == ErrorKind::NotFound => return Err(dir_error("does not exist")),
            Err(e) => return Err(bind_error(e)),
        }
        let lock = socket::PathLock::acquire(path).map_err(|e| match e.raw_os_error() {
            Some(libc::EWOULDBLOCK) => ApiError::InUse {
                path: shown.clone(),
            },
            _ => bind_error(e),
        })?;
        match std::fs::symlink_metadata(path) {
            Ok(meta) if meta.file_type().is_socket() => {
                match socket::connect(path, PROBE_TIMEOUT) {
                    // Alive (a full backlog is alive too): a program that does not use the lock.
                    Ok(_) => return Err(ApiError::InUse { path: shown }),
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        return Err(ApiError::InUse { path: shown })
                    }
                    // Left behind by a process that is gone.
                    Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
                        match std::fs::remove_file(path) {
                            Ok(()) => {}
                            Err(e) if e.kind() == ErrorKind::NotFound => {}
                            Err(e) => return Err(bind_error(e)),
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::NotFound => {}
                    Err(e) => return Err(bind_error(e)),
                }
            }
            Ok(_) => return Err(ApiError::NotASocket { path: shown }),
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(bind_error(e)),
        }
        Ok(Self {
            path: path.to_path_buf(),
            lock: Some(lock),
            listener: None,
        })
    }

    /// Listen on the claimed path now (as [`SocketClaim::bind`]); the server started on this
    /// claim later serves the same socket, connections still queued on it included.
    pub fn listen(&mut self) -> Result<&UnixListener, ApiError> {
        if self.listener.is_none() {
            self.listener = Some(self.bind()?);
        }
        Ok(self.listener.as_ref().expect("bound just now"))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Listen on the claimed path (mode 0600 from the first instant), or take the listener
    /// [`SocketClaim::listen`] bound.
    pub(crate) fn bind(&mut self) -> Result<UnixListener, ApiError> {
        if let Some(listener) = self.listener.take() {
            return Ok(listener);
        }
        let shown = self.path.display().to_string();
        let listener = socket::bind_private(&self.path).map_err(|e| match e.raw_os_error() {
            Some(libc::EADDRINUSE) => ApiError::InUse {
                path: shown.clone(),
            },
            _ => ApiError::Bind {
                path: shown.clone(),
                source: e,
            },
        })?;
        // Already 0600 on Linux; this covers a kernel where the socket's mode does not carry
        // over.
        if let Err(e) = std::fs::set_permissions(&self.path, std::fs::Permissions::from_mode(0o600))
        {
            let _ = std::fs::remove_file(&self.path);
            return Err(ApiError::Bind {
                path: shown,
                source: e,
            });
        }
        Ok(listener)
    }

    /// Give up the path: removes the lock file.
    pub fn release(mut self) {
        if let Some(lock) = self.lock.take() {
            lock.release();
        }
    }
}

impl Drop for SocketClaim {
    fn drop(&mut self) {
        // Bound ahead and never served: the socket file goes with it (under the lock, which
        // no other process holds, so the file is this one's).
        if self.listener.take().is_some() {
            let _ = std::fs::remove_file(&self.path);
        }
        if let Some(lock) = self.lock.take() {
            lock.release();
        }
    }
}

/// Serve `stream` on a thread of its own, or answer 503 at once when [`MAX_CONNECTIONS`] are
/// being served already (or no thread can be started).
fn spawn_connection<E: Send + 'static>(
    stream: UnixStream,
    shared: &Arc<Shared>,
    events: &Sender<E>,
    wrap: fn(ApiCall) -> E,
    timeouts: Timeouts,
) {
    let busy = |stream: UnixStream| {
        let reply = Reply::error(
            503,
            format!("the VM is serving {MAX_CONNECTIONS} connections already: try again"),
        );
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_write_timeout(Some(timeouts.idle));
        let _ = (&stream).write_all(&http::encode_response(
            reply.status,
            reply.body.as_ref(),
            &[],
        ));
    };
    {
        let mut active = lock(&shared.active);
        if *active >= MAX_CONNECTIONS {
            drop(active);
            // Full: the client that has been sending its request longest gives up its place
            // (its connection is cut; a well-behaved client sends a request in one go).
            // Slow senders thus never keep a well-formed request from being answered; only
            // MAX_CONNECTIONS requests actually being served (long execs, say) do.
            if !evict_slowest_sender(shared) {
                busy(stream);
                return;
            }
            active = lock(&shared.active);
        }
        *active += 1;
    }
    let Some(registered) = register(&stream, shared) else {
        *lock(&shared.active) -= 1;
        return;
    };
    let thread_shared = Arc::clone(shared);
    let events = events.clone();
    // Under the accept thread's seccomp filter, which it inherits.
    let label = crate::seccomp::Label::current();
    let spawned = std::thread::Builder::new()
        .name("api-conn".into())
        .stack_size(crate::HELPER_THREAD_STACK)
        .spawn(move || {
            label.apply();
            serve_connection(stream, registered, &thread_shared, &events, wrap, timeouts);
            let mut active = lock(&thread_shared.active);
            *active -= 1;
            if *active == 0 {
                thread_shared.idle.notify_all();
            }
        });
    if spawned.is_err() {
        lock(&shared.current).remove(&registered.0);
        *lock(&shared.active) -= 1;
    }
}

/// Cut the connection that has been sending its request the longest; false if every
/// connection has sent its request already.
fn evict_slowest_sender(shared: &Shared) -> bool {
    let mut current = lock(&shared.current);
    let slowest = current
        .iter()
        .filter(|(_, c)| c.reading)
        .min_by_key(|(_, c)| c.accepted)
        .map(|(id, _)| *id);
    match slowest.and_then(|id| current.remove(&id)) {
        Some(connection) => {
            let _ = connection.stream.shutdown(std::net::Shutdown::Both);
            true
        }
        None => false,
    }
}

/// The accept thread: accept connections until the [`ApiServer`] stops it.
fn serve<E: Send + 'static>(
    listener: UnixListener,
    woken: UnixStream,
    shared: &Arc<Shared>,
    events: &Sender<E>,
    wrap: fn(ApiCall) -> E,
    timeouts: Timeouts,
) {
    use nix::poll::{poll, PollFd, PollFlags};
    // Bits nix does not know (None) count as fired: never a spin on them.
    let fired = |fd: &PollFd| fd.revents().is_none_or(|r| !r.is_empty());
    loop {
        let mut fds = [
            PollFd::new(&listener, PollFlags::POLLIN),
            PollFd::new(&woken, PollFlags::POLLIN),
        ];
        let ready = poll(&mut fds, -1);
        if shared.stopping.load(Ordering::SeqCst) || fired(&fds[1]) {
            return;
        }
        if let Err(errno) = ready {
            if errno != nix::errno::Errno::EINTR {
                std::thread::sleep(Duration::from_millis(100));
            }
            continue;
        }
        if !fired(&fds[0]) {
            continue;
        }
        match listener.accept() {
            Ok((stream, _)) => spawn_connection(stream, shared, events, wrap, timeouts),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::Interrupted
                        | std::io::ErrorKind::ConnectionAborted
                ) => {}
            // Out of file descriptors, most likely: let the moment pass instead of spinning.
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// Track a new connection as sending its request (so a newcomer at capacity can take its
/// place), before its thread starts: registered from its thread instead, a burst of clients
/// could fill every slot with connections not yet tracked, and a good request got 503 (the
/// flaky `two_hundred_half_requests_do_not_keep_a_good_one_waiting`, about 1 run in 10 on a
/// loaded machine). None once the server is stopping. `.1`: whether it could be tracked.
fn register(stream: &UnixStream, shared: &Shared) -> Option<(u64, bool)> {
    static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let mut current = lock(&shared.current);
    if shared.stopping.load(Ordering::SeqCst) {
        return None;
    }
    let tracked = stream.try_clone().is_ok_and(|clone| {
        current.insert(
            id,
            Connection {
                stream: clone,
                accepted: Instant::now(),
                reading: true,
            },
        );
        true
    });
    Some((id, tracked))
}

/// Read one request from `stream`, answer it, and close the connection.
fn serve_connection<E>(
    stream: UnixStream,
    (id, tracked): (u64, bool),
    shared: &Shared,
    events: &Sender<E>,
    wrap: fn(ApiCall) -> E,
    timeouts: Timeouts,
) {
    if stream.set_nonblocking(false).is_err()
        || stream.set_write_timeout(Some(timeouts.idle)).is_err()
    {
        lock(&shared.current).remove(&id);
        return;
    }
    let read = http::read_request(
        &stream,
        timeouts.idle,
        timeouts.request,
        guest::streams_body,
    );
    match lock(&shared.current).get_mut(&id) {
        Some(connection) => connection.reading = false,
        // Evicted while it was still sending: nothing to answer on a cut connection.
        None if tracked => return,
        None => {}
    }
    let answer = match read {
        Err(Refusal::Silent) => None,
        // Stopping cut the read short.
        Err(Refusal::Reply { .. }) if shared.stopping.load(Ordering::SeqCst) => {
            Some((shutting_down(), None))
        }
        Err(Refusal::Reply { status, message }) => Some((Reply::error(status, message), None)),
        Ok(request) if guest::serves(&request.path) => {
            let state = || {
                let reply = ask(Action::Describe, shared, events, wrap, timeouts.reply);
                match reply.body.as_ref().and_then(|b| b.get("state")) {
                    Some(serde_json::Value::String(state)) if reply.status == 200 => {
                        Ok(state.clone())
                    }
                    _ => Err(reply),
                }
            };
            let cx = guest::Context {
                services: &shared.services,
                state: &state,
                idle: timeouts.idle,
            };
            match guest::serve(&request, &stream, &cx) {
                guest::Outcome::Reply(reply) => Some((reply, None)),
                guest::Outcome::Written => None,
            }
        }
        Ok(request) => Some(match route(&request) {
            Ok(action) => (ask(action, shared, events, wrap, timeouts.reply), None),
            Err(Rejection { reply, allow }) => (reply, allow),
        }),
    };
    if let Some((reply, allow)) = answer {
        let headers: Vec<(&str, &str)> = allow
            .map(|methods| ("Allow", methods))
            .into_iter()
            .collect();
        let bytes = http::encode_response(reply.status, reply.body.as_ref(), &headers);
        if (&stream).write_all(&bytes).is_ok() {
            reply.until_written.delivered();
        }
        let _ = stream.shutdown(std::net::Shutdown::Write);
        // What the reply kept goes now (a fork's clones run, or stop if nobody got the answer).
        drop(reply);
    }
    lock(&shared.current).remove(&id);
}

fn shutting_down() -> Reply {
    Reply::error(503, "the VM is shutting down")
}

/// Hand `action` to the VM's controller and wait for its reply.
fn ask<E>(
    action: Action,
    shared: &Shared,
    events: &Sender<E>,
    wrap: fn(ApiCall) -> E,
    timeout: Duration,
) -> Reply {
    let (reply, replies) = mpsc::channel();
    if events.send(wrap(ApiCall { action, reply })).is_err() {
        return shutting_down();
    }
    let deadline = http::deadline(timeout);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Reply::error(
                504,
                format!(
                    "the VM did not answer within {} s: it may be busy or stuck; try again",
                    timeout.as_secs_f64()
                ),
            );
        }
        match replies.recv_timeout(left.min(STOP_CHECK)) {
            Ok(reply) if (200..=599).contains(&reply.status) => return reply,
            Ok(reply) => {
                return Reply::error(
                    500,
                    format!(
                        "the VM answered with the invalid HTTP status {}",
                        reply.status
                    ),
                )
            }
            Err(RecvTimeoutError::Disconnected) => return shutting_down(),
            Err(RecvTimeoutError::Timeout) => {
                if shared.stopping.load(Ordering::SeqCst) {
                    return shutting_down();
                }
            }
        }
    }
}

/// A request refused before it reaches the VM.
struct Rejection {
    reply: Reply,
    /// The methods the path accepts, for a 405's `Allow` header.
    allow: Option<&'static str>,
}

/// One endpoint: its method, its path and how its body becomes an [`Action`] (or a message
/// saying what is wrong with it).
struct Route {
    method: &'static str,
    path: &'static str,
    parse: fn(&str, &[u8]) -> Result<Action, String>,
}

const ROUTES: &[Route] = &[
    Route {
        method: "GET",
        path: "/vm",
        parse: |endpoint, body| no_body(endpoint, body).map(|()| Action::Describe),
    },
    Route {
        method: "PUT",
        path: "/vm/pause",
        parse: |endpoint, body| no_body(endpoint, body).map(|()| Action::Pause),
    },
    Route {
        method: "PUT",
        path: "/vm/resume",
        parse: |endpoint, body| no_body(endpoint, body).map(|()| Action::Resume),
    },
    Route {
        method: "PUT",
        path: "/vm/snapshot",
        parse: parse_snapshot,
    },
    Route {
        method: "PUT",
        path: "/vm/fork",
        parse: parse_fork,
    },
    Route {
        method: "PUT",
        path: "/vm/shutdown",
        parse: |endpoint, body| no_body(endpoint, body).map(|()| Action::Shutdown),
    },
    Route {
        method: "GET",
        path: "/vm/net",
        parse: |endpoint, body| no_body(endpoint, body).map(|()| Action::Net),
    },
    Route {
        method: "PUT",
        path: "/vm/net/policy",
        parse: parse_net_policy,
    },
    Route {
        method: "PUT",
        path: "/vm/net/expose",
        parse: parse_net_expose,
    },
];

/// Every route the control socket serves, as (method, path): the VM's own and the guest's.
pub fn routes() -> impl Iterator<Item = (&'static str, &'static str)> {
    ROUTES
        .iter()
        .map(|r| (r.method, r.path))
        .chain(guest::ROUTES.iter().copied())
}

fn route_list() -> String {
    ROUTES
        .iter()
        .map(|r| format!("{} {}", r.method, r.path))
        .chain(guest::route_list())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Text from a client, cut short for an error message.
fn clip(text: &str) -> String {
    const MAX: usize = 100;
    match text.char_indices().nth(MAX) {
        Some((end, _)) => format!("{}...", &text[..end]),
        None => text.to_owned(),
    }
}

/// A JSON value from a client, cut short for an error message.
fn clip_json(value: &Value) -> String {
    clip(&value.to_string())
}

/// Read one request from `stream` and route it, as a connection's handler does before it
/// acts on it (nothing is acted on): the entry point of the control-socket fuzz target
/// (`fuzz/`). True if the request names an action.
#[doc(hidden)]
pub fn read_and_route(stream: &UnixStream, idle: Duration, total: Duration) -> bool {
    match http::read_request(stream, idle, total, guest::streams_body) {
        Ok(request) if guest::serves(&request.path) => guest::parse(&request).is_ok(),
        Ok(request) => route(&request).is_ok(),
        Err(_) => false,
    }
}

fn route(request: &Request) -> Result<Action, Rejection> {
    let rejection = |status, message| Rejection {
        reply: Reply::error(status, message),
        allow: None,
    };
    let Some(route) = ROUTES.iter().find(|r| r.path == request.path) else {
        return Err(rejection(
            404,
            format!(
                "there is no {}: mayfly serves {}",
                clip(&request.path),
                route_list()
            ),
        ));
    };
    if request.method != route.method {
        return Err(Rejection {
            reply: Reply::error(
                405,
                format!(
                    "{} {} is not supported: use {} {}",
                    clip(&request.method),
                    route.path,
                    route.method,
                    route.path
                ),
            ),
            allow: Some(route.method),
        });
    }
    let endpoint = format!("{} {}", route.method, route.path);
    (route.parse)(&endpoint, &request.body).map_err(|message| rejection(400, message))
}

/// The body as a JSON object with only the given fields; an empty body is an empty object.
fn json_object(
    endpoint: &str,
    body: &[u8],
    fields: &[&str],
    example: &str,
) -> Result<Map<String, Value>, String> {
    if body.trim_ascii().is_empty() {
        return Ok(Map::new());
    }
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        format!("the body of {endpoint} is not valid JSON ({e}): send e.g. {example}")
    })?;
    let Value::Object(object) = value else {
        return Err(format!(
            "the body of {endpoint} must be a JSON object, e.g. {example}"
        ));
    };
    if let Some(unknown) = object.keys().find(|key| !fields.contains(&key.as_str())) {
        let accepted = if fields.is_empty() {
            "it takes no body (or {})".to_owned()
        } else {
            format!("it accepts {}", fields.join(", "))
        };
        return Err(format!(
            "unknown field {:?} in the body of {endpoint}: {accepted}",
            clip(unknown)
        ));
    }
    Ok(object)
}

fn no_body(endpoint: &str, body: &[u8]) -> Result<(), String> {
    json_object(endpoint, body, &[], "{}").map(drop)
}

/// What kind of JSON value a client sent, for an error message.
fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn parse_snapshot(endpoint: &str, body: &[u8]) -> Result<Action, String> {
    const EXAMPLE: &str = r#"{"path": "/some/dir"}"#;
    let object = json_object(endpoint, body, &["path", "diff"], EXAMPLE)?;
    let diff = match object.get("diff") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(diff)) => *diff,
        Some(other) => {
            return Err(format!(
                "the field \"diff\" of {endpoint} must be true or false, not {}",
                kind(other)
            ))
        }
    };
    match object.get("path") {
        None | Some(Value::Null) => Err(format!(
            "{endpoint} needs the field \"path\", the directory to write the snapshot to: \
             send e.g. {EXAMPLE}"
        )),
        Some(Value::String(path)) if path.is_empty() => Err(format!(
            "the field \"path\" of {endpoint} is empty: give the directory to write the \
             snapshot to, e.g. {EXAMPLE}"
        )),
        Some(Value::String(path)) if path.contains('\0') => Err(format!(
            "the field \"path\" of {endpoint} contains a NUL character"
        )),
        Some(Value::String(path)) => Ok(Action::Snapshot {
            path: PathBuf::from(path),
            diff,
        }),
        Some(other) => Err(format!(
            "the field \"path\" of {endpoint} must be a string (a directory), not {}",
            kind(other)
        )),
    }
}

fn parse_net_policy(endpoint: &str, body: &[u8]) -> Result<Action, String> {
    const EXAMPLE: &str = r#"{"policy": "allow=192.0.2.0/24:443,198.51.100.7"}"#;
    let object = json_object(endpoint, body, &["policy"], EXAMPLE)?;
    match object.get("policy") {
        None | Some(Value::Null) => Err(format!(
            "{endpoint} needs the field \"policy\" (none, open or allow=CIDR[:PORT],...): send \
             e.g. {EXAMPLE}"
        )),
        Some(Value::String(text)) => text
            .parse::<mayfly_network::Policy>()
            .map(Action::NetPolicy)
            .map_err(|e| format!("the field \"policy\" of {endpoint}: {e}")),
        Some(other) => Err(format!(
            "the field \"policy\" of {endpoint} must be a string, not {}",
            kind(other)
        )),
    }
}

/// Where an exposed port listens on the host, as `tcp:ADDR:PORT` or `unix:PATH`.
pub fn parse_expose_on(text: &str) -> Result<mayfly_network::ExposeOn, String> {
    if let Some(addr) = text.strip_prefix("tcp:") {
        return addr
            .parse()
            .map(mayfly_network::ExposeOn::Tcp)
            .map_err(|_| format!("{:?} is not ADDR:PORT, e.g. tcp:127.0.0.1:8080", clip(text)));
    }
    match text.strip_prefix("unix:") {
        Some(path) if !path.is_empty() && !path.contains('\0') => {
            Ok(mayfly_network::ExposeOn::Unix(PathBuf::from(path)))
        }
        _ => Err(format!(
            "{:?} is not where to listen: give tcp:ADDR:PORT (port 0: a free one) or unix:PATH",
            clip(text)
        )),
    }
}

fn parse_net_expose(endpoint: &str, body: &[u8]) -> Result<Action, String> {
    const EXAMPLE: &str = r#"{"port": 8080, "on": "tcp:127.0.0.1:0"}"#;
    let object = json_object(endpoint, body, &["port", "on"], EXAMPLE)?;
    let port = match object.get("port") {
        None | Some(Value::Null) => {
            return Err(format!(
                "{endpoint} needs the field \"port\", the guest's port: send e.g. {EXAMPLE}"
            ))
        }
        Some(value) => value
            .as_u64()
            .and_then(|n| u16::try_from(n).ok())
            .filter(|&n| n != 0)
            .ok_or_else(|| {
                format!(
                    "the field \"port\" of {endpoint} must be a port from 1 to 65535, not {}",
                    clip_json(value)
                )
            })?,
    };
    let on = match object.get("on") {
        None | Some(Value::Null) => mayfly_network::ExposeOn::Tcp(std::net::SocketAddr::from((
            std::net::Ipv4Addr::LOCALHOST,
            0,
        ))),
        Some(Value::String(text)) => {
            parse_expose_on(text).map_err(|e| format!("the field \"on\" of {endpoint}: {e}"))?
        }
        Some(other) => {
            return Err(format!(
                "the field \"on\" of {endpoint} must be a string, not {}",
                kind(other)
            ))
        }
    };
    Ok(Action::NetExpose { port, on })
}

fn parse_fork(endpoint: &str, body: &[u8]) -> Result<Action, String> {
    const EXAMPLE: &str = r#"{"count": 2, "name_prefix": "web", "parent": "paused"}"#;
    let object = json_object(
        endpoint,
        body,
        &["count", "name_prefix", "parent", "overcommit"],
        EXAMPLE,
    )?;
    let count = match object.get("count") {
        None | Some(Value::Null) => {
            return Err(format!(
                "{endpoint} needs the field \"count\", the number of clones: send e.g. {EXAMPLE}"
            ))
        }
        Some(value) => value
            .as_u64()
            .filter(|&n| n <= u64::from(MAX_FORK_COUNT))
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| {
                format!(
                    "the field \"count\" of {endpoint} must be an integer from 0 to \
                     {MAX_FORK_COUNT} (the most clones mayfly allows in one fork), not {}",
                    clip_json(value)
                )
            })?,
    };
    let name_prefix = match object.get("name_prefix") {
        None | Some(Value::Null) => None,
        Some(Value::String(prefix)) => Some(prefix.clone()),
        Some(other) => {
            return Err(format!(
                "the field \"name_prefix\" of {endpoint} must be a string, not {}",
                kind(other)
            ))
        }
    };
    let parent_paused = match object.get("parent") {
        None | Some(Value::Null) => false,
        Some(Value::String(parent)) if parent == "running" => false,
        Some(Value::String(parent)) if parent == "paused" => true,
        Some(other) => {
            return Err(format!(
                "the field \"parent\" of {endpoint} must be \"running\" or \"paused\" (what the \
                 parent VM does after the fork), not {}",
                clip_json(other)
            ))
        }
    };
    let overcommit = match object.get("overcommit") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(overcommit)) => *overcommit,
        Some(other) => {
            return Err(format!(
                "the field \"overcommit\" of {endpoint} must be true or false (true: count only \
                 what starting the clones costs the host, not the guest memory they will write), \
                 not {}",
                clip_json(other)
            ))
        }
    };
    Ok(Action::Fork(ForkRequest {
        count,
        name_prefix,
        parent_paused,
        overcommit,
    }))
}
