//! The bounds of one call into the guest. The guest is not trusted: its agent may stop
//! answering at any point, answer forever, or never start what it was asked to. So every call
//! the VMM makes to it has a watch, and every read and write on the call's connection
//! ([`AgentStream`]) waits through it, in one `poll` that also watches:
//!
//! - the call's **deadline** (a stat, a listing, a removal: [`DEFAULT_CALL_TIMEOUT`]; a client
//!   may ask for less, or for more up to [`MAX_CALL_TIMEOUT`]);
//! - an **idle** limit: the agent may stay silent at most [`AGENT_IDLE_TIMEOUT`] while it owes
//!   bytes (what bounds a file transfer of any size);
//! - an exec's two phases: the agent must start the command within [`EXEC_START_TIMEOUT`],
//!   and end it within the request's `timeout_ms` plus [`EXEC_GRACE`];
//! - the **client** of the control socket: when it hangs up, the call ends;
//!
//! and whichever comes first ends the call: the wait fails, the protocol client returns, and
//! the connection to the agent closes (an agent kills an exec whose connection closes). What
//! ended it is kept ([`Stop`]), so that the error the client sees says so and what to do.

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use mayfly_agent_protocol::{Duplex, ExecStatus};
use nix::poll::{poll, PollFd, PollFlags};

/// The longest the agent may stay silent while it owes the VMM bytes (the next part of an
/// answer, room for the next part of an upload). Every step of a stat, a listing or a file
/// transfer is a few system calls in the guest, and the agent sends as it goes: 30 s of
/// silence is a stalled or hostile guest, not a slow one. An exec's running command may be
/// silent for as long as it likes; see [`EXEC_START_TIMEOUT`] and [`EXEC_GRACE`] instead.
pub const AGENT_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// The deadline of a call that answers once (stat, list, remove, mkdir, ping, identity),
/// from its start (waiting for the agent included) to its answer. A minute covers a recursive
/// removal or a listing of a large tree in a busy guest; a guest that takes longer is
/// answered 504, so that a stalled guest holds a call (and its place among the control
/// socket's guest calls) for a bounded time. A client may ask for less, or for up to
/// [`MAX_CALL_TIMEOUT`].
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// The longest deadline a client may ask for (`timeout_ms` on the file routes): ten minutes,
/// for a removal of a huge tree. Longer work belongs in an exec with its own `timeout_ms`.
pub const MAX_CALL_TIMEOUT: Duration = Duration::from_secs(600);

/// How long the agent may take to start a command (its STARTED, or the EXIT of one that
/// cannot start): a fork and an exec in the guest, plus looking up its user. 30 s is a guest
/// that is stalled, not busy.
pub const EXEC_START_TIMEOUT: Duration = Duration::from_secs(30);

/// How long after an exec's `timeout_ms` the VMM still waits for its EXIT: the agent sends
/// SIGTERM at the timeout and SIGKILL 2 s later, then forwards what is left in the pipes for
/// up to 1 s; 10 s covers that with room for a loaded guest. Past it the guest ignored the
/// timeout, and the VMM ends the call itself.
pub const EXEC_GRACE: Duration = Duration::from_secs(10);

/// The deadline of the refresh after a boot, restore or fork, once the agent answered HELLO:
/// the refresh runs the guest's own hook scripts (each up to 30 s by default), so it gets
/// five minutes; a guest that takes longer has its refresh reported failed.
pub const REFRESH_TIMEOUT: Duration = Duration::from_secs(300);

/// Why the VMM ended a call into the guest before the agent did. Each says what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Stop {
    #[error(
        "the guest's agent did not finish {what} within {} s: the guest is stalled, \
         overloaded or misbehaving. Retry later; for work that is legitimately slow ask for \
         a longer deadline (the file routes take timeout_ms in their query, at most {} ms); \
         check the guest with GET /vm/agent (or kill -USR1 the VMM for a state dump)",
        limit.as_secs_f64(),
        MAX_CALL_TIMEOUT.as_millis()
    )]
    Deadline { what: String, limit: Duration },
    #[error(
        "the guest's agent sent nothing for {} s during {what}: the guest is stalled, \
         overloaded or misbehaving. Retry later; check the guest with GET /vm/agent (or \
         kill -USR1 the VMM for a state dump)",
        idle.as_secs_f64()
    )]
    Idle { what: String, idle: Duration },
    #[error(
        "the guest's agent did not start the command within {} s: the guest is stalled or \
         overloaded. Retry later; check the guest with GET /vm/agent (or kill -USR1 the VMM \
         for a state dump)",
        limit.as_secs_f64()
    )]
    ExecStart { limit: Duration },
    #[error(
        "the command's timeout_ms ({timeout_ms} ms) passed {} s ago and the guest's agent \
         still has not reported its end: the VMM gave up on it and closed the connection, \
         which tells the agent to kill the command. The guest ignores timeouts or is \
         stalled (or the VM was paused meanwhile: the VMM counts the host's time): check it \
         with GET /vm/agent, or restart the VM",
        grace.as_secs_f64()
    )]
    ExecOverran { timeout_ms: u64, grace: Duration },
    #[error("the client hung up, so the VMM ended its call into the guest")]
    HungUp,
}

impl Stop {
    fn io(&self) -> io::Error {
        let kind = match self {
            Stop::HungUp => io::ErrorKind::ConnectionAborted,
            _ => io::ErrorKind::TimedOut,
        };
        io::Error::new(kind, self.to_string())
    }
}

/// How one call is bounded, before it starts.
#[derive(Debug, Clone, Default)]
pub(crate) struct Bounds {
    /// The whole call: from its start (the connect included) to its last frame.
    pub deadline: Option<Duration>,
    /// Each wait for the agent while it owes bytes.
    pub idle: Option<Duration>,
}

/// An exec's phases, once armed: started by `start_by`, then ended within `run_for` (if the
/// request has a timeout). `started` holds nothing of the connection: the watch is owned by
/// the connection's handles, and a handle here would keep the connection (and the client's
/// hang-up watch) open for ever.
struct ExecPhases {
    started: ExecStatus,
    start_by: Instant,
    run_for: Option<(u64, Duration)>,
    run_by: OnceLock<Option<Instant>>,
}

/// What a wait may end on.
#[derive(Clone, Copy)]
enum Cause {
    Deadline,
    Idle,
    Step,
    ExecStart,
    ExecRun,
}

/// The watch over one call: its limits, the client whose hang-up ends it, and what ended it.
/// Shared by every handle on the call's connection (exec's stdin and signals write on
/// clones), so that all of them end together.
pub(crate) struct Watch {
    /// The call, for messages: e.g. `list /etc`.
    what: String,
    /// When the call must be over, and the limit it was set from (for the message).
    deadline: Mutex<Option<(Instant, Duration)>>,
    idle: Mutex<Option<Duration>>,
    /// The control socket's client: its hang-up ends the call.
    hangup: Option<Arc<UnixStream>>,
    exec: OnceLock<ExecPhases>,
    /// A limit of the current step only (the vsock handshake, HELLO): passing it fails that
    /// wait with `TimedOut` and leaves the call going (the caller may retry the step).
    step: Mutex<Option<Instant>>,
    stopped: Mutex<Option<Stop>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Watch {
    pub(crate) fn new(
        what: String,
        bounds: &Bounds,
        hangup: Option<Arc<UnixStream>>,
    ) -> Arc<Watch> {
        let now = Instant::now();
        Arc::new(Watch {
            what,
            deadline: Mutex::new(
                bounds
                    .deadline
                    .and_then(|limit| now.checked_add(limit).map(|at| (at, limit))),
            ),
            idle: Mutex::new(bounds.idle),
            hangup,
            exec: OnceLock::new(),
            step: Mutex::new(None),
            stopped: Mutex::new(None),
        })
    }

    /// Bound an exec's phases: `started` says when the agent has started the command.
    pub(crate) fn arm_exec(&self, started: ExecStatus, timeout_ms: Option<u64>) {
        let run_for =
            timeout_ms.map(|ms| (ms, Duration::from_millis(ms).saturating_add(EXEC_GRACE)));
        let _ = self.exec.set(ExecPhases {
            started,
            start_by: Instant::now() + EXEC_START_TIMEOUT,
            run_for,
            run_by: OnceLock::new(),
        });
    }

    /// The call must be over `limit` from now (instead of any deadline it had).
    pub(crate) fn set_deadline(&self, limit: Duration) {
        *lock(&self.deadline) = Instant::now().checked_add(limit).map(|at| (at, limit));
    }

    /// Limit the current step to `limit` from now (None: no limit of its own).
    pub(crate) fn set_step(&self, limit: Option<Duration>) {
        *lock(&self.step) = limit.and_then(|l| Instant::now().checked_add(l));
    }

    /// What ended the call, if the watch did.
    pub(crate) fn stopped(&self) -> Option<Stop> {
        lock(&self.stopped).clone()
    }

    /// End the call for `stop` (the first reason stays).
    fn stop(&self, stop: Stop) -> io::Error {
        let mut stopped = lock(&self.stopped);
        stopped.get_or_insert(stop).io()
    }

    /// The nearest limit, at `now`, of a wait that started at `began`.
    fn nearest(&self, began: Instant, now: Instant) -> Option<(Instant, Cause)> {
        let mut limits: Vec<(Instant, Cause)> = Vec::with_capacity(4);
        if let Some((at, _)) = *lock(&self.deadline) {
            limits.push((at, Cause::Deadline));
        }
        if let Some(at) = lock(&self.idle).and_then(|idle| began.checked_add(idle)) {
            limits.push((at, Cause::Idle));
        }
        if let Some(at) = *lock(&self.step) {
            limits.push((at, Cause::Step));
        }
        if let Some(exec) = self.exec.get() {
            if exec.started.pid().is_none() {
                limits.push((exec.start_by, Cause::ExecStart));
            } else if let Some((_, run_for)) = exec.run_for {
                // From the first wait after STARTED: as near to the command's start as the
                // VMM can tell.
                if let Some(at) = *exec.run_by.get_or_init(|| now.checked_add(run_for)) {
                    limits.push((at, Cause::ExecRun));
                }
            }
        }
        limits.into_iter().min_by_key(|(at, _)| *at)
    }

    fn expired(&self, cause: Cause) -> io::Error {
        match cause {
            Cause::Step => io::Error::new(io::ErrorKind::TimedOut, "this step took too long"),
            Cause::Deadline => self.stop(Stop::Deadline {
                what: self.what.clone(),
                limit: lock(&self.deadline).map_or(Duration::ZERO, |(_, limit)| limit),
            }),
            Cause::Idle => self.stop(Stop::Idle {
                what: self.what.clone(),
                idle: lock(&self.idle).unwrap_or_default(),
            }),
            Cause::ExecStart => self.stop(Stop::ExecStart {
                limit: EXEC_START_TIMEOUT,
            }),
            Cause::ExecRun => {
                let timeout_ms = self
                    .exec
                    .get()
                    .and_then(|e| e.run_for)
                    .map_or(0, |(ms, _)| ms);
                self.stop(Stop::ExecOverran {
                    timeout_ms,
                    grace: EXEC_GRACE,
                })
            }
        }
    }

    /// Wait until `fd` is ready for `events`, or fail as soon as a limit passes or the client
    /// hangs up (and, once the call was ended, at once).
    pub(crate) fn wait(&self, fd: BorrowedFd<'_>, events: PollFlags) -> io::Result<()> {
        self.wait_until(Some((fd, events)), None)
    }

    /// Sleep `pause` (between two tries to reach the agent), ending early with an error when
    /// a limit of the call passes or the client hangs up.
    pub(crate) fn pause(&self, pause: Duration) -> io::Result<()> {
        let until = Instant::now() + pause;
        match self.wait_until(None, Some(until)) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(()),
            other => other,
        }
    }

    fn wait_until(
        &self,
        fd: Option<(BorrowedFd<'_>, PollFlags)>,
        until: Option<Instant>,
    ) -> io::Result<()> {
        // Bits nix does not know (None) count as fired: never a spin on them.
        let fired = |fd: &PollFd| fd.revents().is_none_or(|r| !r.is_empty());
        let began = Instant::now();
        loop {
            if let Some(stop) = self.stopped() {
                return Err(stop.io());
            }
            let now = Instant::now();
            let nearest = self.nearest(began, now);
            if let Some((at, cause)) = nearest {
                if at <= now {
                    return Err(self.expired(cause));
                }
            }
            if until.is_some_and(|until| until <= now) {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            let wake = match (nearest.map(|(at, _)| at), until) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let timeout = wake.map_or(-1, |at| {
                // Rounded up, so that a wake-up never comes before the limit it is for.
                let ms = at.saturating_duration_since(now).as_micros().div_ceil(1000);
                i32::try_from(ms).unwrap_or(i32::MAX)
            });
            let mut fds = Vec::with_capacity(2);
            if let Some((fd, events)) = &fd {
                fds.push(PollFd::new(fd, *events));
            }
            let hangup = self.hangup.as_deref();
            if let Some(client) = hangup {
                // No events asked: POLLHUP (the client closed) and POLLERR come anyway, while
                // bytes it sends after its request, or a half-close, do not wake us.
                fds.push(PollFd::new(client, PollFlags::empty()));
            }
            match poll(&mut fds, timeout) {
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(e.into()),
                Ok(_) => {}
            }
            if hangup.is_some() && fds.last().is_some_and(fired) {
                return Err(self.stop(Stop::HungUp));
            }
            if fd.is_some() && fired(&fds[0]) {
                return Ok(());
            }
        }
    }
}

/// The connection of one call to the agent: non-blocking underneath, every read and write
/// waiting through the watch of its call. Clones (exec's stdin, its signals) share the watch.
pub struct AgentStream {
    stream: UnixStream,
    watch: Arc<Watch>,
}

impl std::fmt::Debug for AgentStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentStream")
            .field("what", &self.watch.what)
            .finish_non_exhaustive()
    }
}

impl AgentStream {
    /// `stream` under `watch`; it is made non-blocking (for every handle on it).
    pub(crate) fn new(stream: UnixStream, watch: Arc<Watch>) -> io::Result<Self> {
        stream.set_nonblocking(true)?;
        Ok(AgentStream { stream, watch })
    }

    /// Why the VMM ended this call, if it did.
    pub fn stopped(&self) -> Option<Stop> {
        self.watch.stopped()
    }

    /// As `UnixStream::set_read_timeout`, for callers of [`crate::guest::agent::Agent::connect`]:
    /// each wait for the agent (for bytes, or for room to send) at most `timeout`; one that
    /// lasts longer ends the call ([`Stop::Idle`]). None: no such limit.
    pub fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        if timeout == Some(Duration::ZERO) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a zero timeout: give None for no limit",
            ));
        }
        *lock(&self.watch.idle) = timeout;
        Ok(())
    }
}

impl Read for AgentStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            self.watch.wait(self.stream.as_fd(), PollFlags::POLLIN)?;
            match (&self.stream).read(buf) {
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                    ) => {}
                other => return other,
            }
        }
    }
}

impl Write for AgentStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        loop {
            self.watch.wait(self.stream.as_fd(), PollFlags::POLLOUT)?;
            match (&self.stream).write(buf) {
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                    ) => {}
                other => return other,
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Duplex for AgentStream {
    fn try_clone_stream(&self) -> io::Result<Self> {
        Ok(AgentStream {
            stream: self.stream.try_clone()?,
            watch: Arc::clone(&self.watch),
        })
    }

    fn shutdown_stream(&self) -> io::Result<()> {
        self.stream.shutdown(std::net::Shutdown::Both)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watch(bounds: Bounds, hangup: Option<Arc<UnixStream>>) -> Arc<Watch> {
        Watch::new("a test call".into(), &bounds, hangup)
    }

    #[test]
    fn a_silent_agent_meets_the_deadline() {
        let (ours, _theirs) = UnixStream::pair().unwrap();
        let bounds = Bounds {
            deadline: Some(Duration::from_millis(100)),
            idle: Some(Duration::from_secs(30)),
        };
        let mut stream = AgentStream::new(ours, watch(bounds, None)).unwrap();
        let err = stream.read(&mut [0u8; 8]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        let stop = stream.stopped().unwrap();
        assert!(matches!(stop, Stop::Deadline { .. }), "{stop}");
        assert!(
            stop.to_string().contains("a test call within 0.1 s"),
            "{stop}"
        );
        // Ended for good: every later wait fails at once.
        let err = stream.write(b"x").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    }

    #[test]
    fn silence_past_the_idle_limit_ends_the_call() {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let bounds = Bounds {
            deadline: None,
            idle: Some(Duration::from_millis(100)),
        };
        let mut stream = AgentStream::new(ours, watch(bounds, None)).unwrap();
        theirs.write_all(b"ab").unwrap();
        let mut buf = [0u8; 8];
        assert_eq!(stream.read(&mut buf).unwrap(), 2);
        let err = stream.read(&mut buf).unwrap_err();
        assert!(matches!(stream.stopped(), Some(Stop::Idle { .. })), "{err}");
    }

    #[test]
    fn a_step_limit_fails_the_step_and_not_the_call() {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let w = watch(Bounds::default(), None);
        let mut stream = AgentStream::new(ours, w.clone()).unwrap();
        w.set_step(Some(Duration::from_millis(50)));
        let err = stream.read(&mut [0u8; 1]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert_eq!(stream.stopped(), None);
        w.set_step(None);
        theirs.write_all(b"z").unwrap();
        assert_eq!(stream.read(&mut [0u8; 1]).unwrap(), 1);
    }

    #[test]
    fn the_clients_hang_up_ends_the_call_and_a_half_close_does_not() {
        let (ours, _theirs) = UnixStream::pair().unwrap();
        let (client_end, server_end) = UnixStream::pair().unwrap();
        let w = watch(Bounds::default(), Some(Arc::new(server_end)));
        let mut stream = AgentStream::new(ours, w.clone()).unwrap();
        // A half-close (the client is done sending) is not a hang-up.
        client_end.shutdown(std::net::Shutdown::Write).unwrap();
        w.set_step(Some(Duration::from_millis(100)));
        let err = stream.read(&mut [0u8; 1]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert_eq!(stream.stopped(), None);
        w.set_step(None);
        let closer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            drop(client_end);
        });
        let err = stream.read(&mut [0u8; 1]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::ConnectionAborted);
        assert_eq!(stream.stopped(), Some(Stop::HungUp));
        closer.join().unwrap();
    }

    #[test]
    fn a_pause_ends_early_only_for_the_call() {
        let w = watch(Bounds::default(), None);
        w.pause(Duration::from_millis(10)).unwrap();
        let w = watch(
            Bounds {
                deadline: Some(Duration::from_millis(20)),
                idle: None,
            },
            None,
        );
        let err = w.pause(Duration::from_secs(30)).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(matches!(w.stopped(), Some(Stop::Deadline { .. })));
    }
}
