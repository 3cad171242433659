//! The server side: bind the socket (taking it over from a dead VMM atomically, under a lock
//! file beside it), accept connections on a thread of its own and serve each on a thread of
//! its own (at most [`MAX_CONNECTIONS`] at once), turn each valid request into an [`ApiCall`]
//! for the VM's controller and write back its reply. Slow clients only hold their own thread:
//! a well-formed request is answered while a hundred others are still being sent.

use std::io::Write;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mayfly_sys::claim::SocketClaim;

use crate::action::{Action, ApiCall};
use crate::error::ApiError;
use crate::guest::{self, GuestRoutes};
use crate::http::{self, Refusal};
use crate::reply::Reply;
use crate::route::{route, Rejection};

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

/// Connections served at once; past this a new one gets 503 at once.
pub const MAX_CONNECTIONS: usize = 64;
/// Calls into the guest (exec, files, `GET /vm/agent`) served at once; past this one gets 503
/// with `Retry-After` at once. Half of [`MAX_CONNECTIONS`]: each of these waits on the guest,
/// which may stall or be hostile, and up to its deadline it holds its connection; kept below
/// the connection cap, they can never take every connection, so pause, resume, snapshot,
/// fork, shutdown and `GET /vm` always find one (a newcomer also takes the place of the
/// slowest sender). Half still lets a client run dozens of commands side by side.
pub const MAX_GUEST_CALLS: usize = MAX_CONNECTIONS / 2;
const _: () = assert!(MAX_GUEST_CALLS < MAX_CONNECTIONS);
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
    /// Serves the routes into the guest (exec, files).
    guest: Arc<dyn GuestRoutes>,
    /// Guest calls being served (at most [`MAX_GUEST_CALLS`]).
    guest_calls: AtomicUsize,
}

/// A guest call's place in the guest lane, held while it is served and answered.
struct GuestLane<'a>(&'a Shared);

impl<'a> GuestLane<'a> {
    /// A place, or None when [`MAX_GUEST_CALLS`] are taken.
    fn enter(shared: &'a Shared) -> Option<Self> {
        shared
            .guest_calls
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < MAX_GUEST_CALLS).then_some(n + 1)
            })
            .ok()
            .map(|_| GuestLane(shared))
    }
}

impl Drop for GuestLane<'_> {
    fn drop(&mut self) {
        self.0.guest_calls.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The answer to a guest call when the guest lane is full: 503, retry in a second.
fn guest_lane_full(stream: &UnixStream) {
    let reply = Reply::error(
        503,
        format!(
            "the VM is serving {MAX_GUEST_CALLS} calls into its guest already (exec, files, \
             agent): that is the most it takes at once, so that pause, snapshot and the other \
             control actions always get through. Retry in a moment, or end calls you no longer \
             need (closing a call's connection ends it)"
        ),
    );
    let bytes = http::encode_response(reply.status, reply.body.as_ref(), &[("Retry-After", "1")]);
    let _ = (&*stream).write_all(&bytes);
    let _ = stream.shutdown(std::net::Shutdown::Write);
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
        guest: Arc<dyn GuestRoutes>,
    ) -> Result<ApiServer, ApiError> {
        Self::start_with(path, events, wrap, Timeouts::default(), guest)
    }

    /// [`ApiServer::start`] with other timeouts.
    pub fn start_with<E: Send + 'static>(
        path: &Path,
        events: Sender<E>,
        wrap: fn(ApiCall) -> E,
        timeouts: Timeouts,
        guest: Arc<dyn GuestRoutes>,
    ) -> Result<ApiServer, ApiError> {
        Self::start_claimed(SocketClaim::new(path)?, events, wrap, timeouts, guest)
    }

    /// Serve on a path claimed earlier (so that nothing else can take it meanwhile).
    pub fn start_claimed<E: Send + 'static>(
        claim: SocketClaim,
        events: Sender<E>,
        wrap: fn(ApiCall) -> E,
        timeouts: Timeouts,
        guest: Arc<dyn GuestRoutes>,
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
            guest,
            guest_calls: AtomicUsize::new(0),
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
            .stack_size(mayfly_sys::HELPER_THREAD_STACK);
        let thread = mayfly_jail::seccomp::spawn(
            builder,
            mayfly_jail::seccomp::ThreadKind::Api,
            move || serve(listener, woken, &shared, &events, wrap, timeouts),
        )
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
    let label = mayfly_jail::seccomp::Label::current();
    let spawned = std::thread::Builder::new()
        .name("api-conn".into())
        .stack_size(mayfly_sys::HELPER_THREAD_STACK)
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
    // A call into the guest takes a place in the guest lane for as long as it is served and
    // answered; with none free it is answered 503 at once.
    let _lane = match &read {
        Ok(request) if guest::serves(&request.path) => match GuestLane::enter(shared) {
            Some(lane) => Some(lane),
            None => {
                guest_lane_full(&stream);
                lock(&shared.current).remove(&id);
                return;
            }
        },
        _ => None,
    };
    let answer = match read {
        Err(Refusal::Silent) => None,
        // Stopping cut the read short.
        Err(Refusal::Reply { .. }) if shared.stopping.load(Ordering::SeqCst) => {
            Some((shutting_down(), None))
        }
        Err(Refusal::Reply { status, message }) => Some((Reply::error(status, message), None)),
        Ok(request) if guest::serves(&request.path) => match guest::parse(&request) {
            // A 405 names the methods the path serves (RFC 9110).
            Err(reply) => {
                let allow = (reply.status == 405).then(|| guest::methods(&request.path));
                Some((reply, allow))
            }
            Ok(call) => {
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
                    state: &state,
                    idle: timeouts.idle,
                };
                match shared.guest.serve(call, &request, &stream, &cx) {
                    guest::Outcome::Reply(reply) => Some((reply, None)),
                    guest::Outcome::Written => None,
                }
            }
        },
        Ok(request) => Some(match route(&request) {
            Ok(action) => (ask(action, shared, events, wrap, timeouts.reply), None),
            Err(Rejection { reply, allow }) => (reply, allow.map(str::to_owned)),
        }),
    };
    if let Some((reply, allow)) = answer {
        let headers: Vec<(&str, &str)> = allow
            .as_deref()
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
