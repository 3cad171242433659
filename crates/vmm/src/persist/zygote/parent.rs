//! The forking VMM's side of a fork: it starts the zygote, asks it for each clone (a few at a
//! time), follows every clone by pidfd until all are ready, and holds them until the fork's
//! answer is written ([`Release`]).

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixDatagram;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use mayfly_sys::seqpacket::{self, Received};
use mayfly_sys::{pidfd, poll};

use crate::persist::zygote::message::*;

/// A descriptor duplicated for a child to inherit (not close-on-exec); closed when dropped.
pub(crate) struct Inherited(OwnedFd);

impl Inherited {
    fn dup(fd: &impl AsRawFd) -> Result<Self, ZygoteError> {
        // SAFETY: dup of a descriptor we own; the new one is owned by the returned value.
        let new = unsafe { libc::dup(fd.as_raw_fd()) };
        if new < 0 {
            return Err(io("duplicate a descriptor for the fork's zygote")(
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: dup returned a new descriptor that nothing else owns.
        Ok(Inherited(unsafe { OwnedFd::from_raw_fd(new) }))
    }

    fn arg(&self) -> String {
        self.0.as_raw_fd().to_string()
    }
}

/// The forking VMM's side: a zygote started for one fork.
pub struct Zygote {
    process: Child,
    /// The zygote's own pidfd: its end is seen at once, whatever it was doing.
    pidfd: OwnedFd,
    /// The forking VMM's end of the fork's socket: taken by [`Zygote::start_clones`] (into
    /// the [`Release`] of a fork that succeeded); a zygote dropped with it still here sees the
    /// end of the stream and exits.
    socket: Option<UnixDatagram>,
}

/// How long a zygote told to exit (its socket closed) may take before it is killed.
pub(crate) const EXIT_GRACE: Duration = Duration::from_secs(2);

impl Drop for Zygote {
    fn drop(&mut self) {
        // The end of the stream tells the zygote to exit.
        drop(self.socket.take());
        self.finish();
    }
}

/// A fork's clones, every one ready and held: dropped, it lets them go (queues `Message::Go`
/// and closes the forking VMM's end of the fork's socket; each clone sees the hang-up and the
/// word: see [`crate::persist::zygote::ForkEnd`]) if the fork's answer reached its client ([`Release::delivered`]), and
/// otherwise closes without the word, so that the clones stop: nobody knows of them. Kept
/// until the fork's answer is written, so that the answer does not wait for the CPU behind
/// thousands of clones resuming at once; a request into a held clone's guest waits for it.
#[derive(Debug)]
pub struct Release {
    socket: UnixDatagram,
    delivered: std::sync::atomic::AtomicBool,
}

impl Release {
    pub(crate) fn new(socket: UnixDatagram) -> Self {
        Self {
            socket,
            delivered: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The fork's answer reached its client: the clones may run.
    pub fn delivered(&self) {
        self.delivered
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for Release {
    fn drop(&mut self) {
        // Emptied first: closing an end with messages unread on it (a zygote's `Forked` for a
        // clone already known by its own `Ready`) makes the first read on the other end fail
        // once (ECONNRESET), and a clone would take that for a fork without its word.
        let mut buf = vec![0u8; MAX_MESSAGE];
        while let Ok(Received::Message(..) | Received::Truncated(_)) =
            seqpacket::receive(&self.socket, &mut buf)
        {}
        if !self.delivered.load(std::sync::atomic::Ordering::SeqCst) {
            eprintln!(
                "mayfly: the fork's answer did not reach its client; its clones stop (nobody \
                 knows of them)"
            );
            return;
        }
        // The queue the clones read is empty (the zygote took every request): the word goes
        // at once, or is said not to.
        let sent = encode(&Message::Go).ok_or_else(|| std::io::Error::other("no encoding"));
        let sent = sent.and_then(|bytes| {
            self.socket.set_nonblocking(false)?;
            self.socket
                .set_write_timeout(Some(Duration::from_secs(1)))?;
            self.socket.send(&bytes)
        });
        if let Err(err) = sent {
            eprintln!("mayfly: cannot tell the fork's clones to run ({err}); they stop");
        }
        mayfly_sys::trace::event("fork_released");
    }
}

/// A clone the zygote is asked for, as the forking VMM follows it.
pub(crate) struct Pending {
    info: CloneInfo,
    pidfd: Option<OwnedFd>,
    /// The zygote said whether it made this clone's process (Forked or NotForked), or can no
    /// longer say.
    answered: bool,
    outcome: Option<Result<(), String>>,
}

impl Zygote {
    /// Step 1: start `mayfly zygote` on the fork's state and memory (its files, bottom first:
    /// one base, or the layers the state names and the top).
    pub fn spawn(state: &File, memory: &[File]) -> Result<Self, ZygoteError> {
        let (socket, theirs) = seqpacket::pair().map_err(io("create the fork's socket"))?;
        // The descriptors are duplicated without close-on-exec just for this spawn (a fork is
        // the only thing in the VMM that starts processes, one at a time), so the standard
        // library can start the zygote with posix_spawn.
        let state = Inherited::dup(state)?;
        let socket_fd = Inherited::dup(&theirs)?;
        let memory = memory
            .iter()
            .map(Inherited::dup)
            .collect::<Result<Vec<_>, _>>()?;
        let memory_arg = memory
            .iter()
            .map(Inherited::arg)
            .collect::<Vec<_>>()
            .join(",");
        let exe = std::env::current_exe().map_err(io("find the mayfly binary"))?;
        let mut process = Command::new(exe)
            .arg("zygote")
            .args(["--state-fd", &state.arg()])
            .args(["--memory-fd", &memory_arg])
            .args(["--socket-fd", &socket_fd.arg()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            // Its own process group (and so its clones'): a Ctrl-C or hang-up meant for the
            // parent's terminal does not reach them.
            .process_group(0)
            .spawn()
            .map_err(io("start the fork's zygote"))?;
        drop((state, memory, socket_fd, theirs));
        // Not yet waited for, so the pid is still the zygote's.
        let pidfd = match libc::pid_t::try_from(process.id())
            .map_err(|_| std::io::Error::from_raw_os_error(libc::ESRCH))
            .and_then(pidfd::open)
        {
            Ok(pidfd) => pidfd,
            Err(err) => {
                let _ = process.kill();
                let _ = process.wait();
                return Err(io("follow the fork's zygote (pidfd_open)")(err));
            }
        };
        let zygote = Self {
            process,
            pidfd,
            socket: Some(socket),
        };
        zygote
            .socket
            .as_ref()
            .expect("just set")
            .set_nonblocking(true)
            .map_err(io("set up the fork's socket"))?;
        Ok(zygote)
    }

    /// Wait for the zygote, told to exit, to end; one that does not within `EXIT_GRACE`
    /// (stuck, or stopped) is killed, so that this never hangs the VMM. Once it has ended
    /// (and been reaped) this returns at once.
    fn finish(&mut self) {
        let exited = poll::poll(&[(self.pidfd.as_raw_fd(), libc::POLLIN)], EXIT_GRACE)
            .is_ok_and(|revents| revents[0] != 0);
        if !exited {
            let _ = self.process.kill();
        }
        let _ = self.process.wait();
    }

    /// Steps 3 and 4, the forking VMM's side: ask for every clone (each with its console log)
    /// and follow them until each is ready or one fails, or `timeout` passes. On any failure
    /// the zygote and every clone of this fork are killed and the first failure returned; on
    /// success the zygote has exited, and the clones, held, run when the returned [`Release`]
    /// is dropped. `since` is when the fork
    /// was asked for (each clone's `ready_ms` counts from it).
    pub fn start_clones(
        mut self,
        parent: &str,
        clones: Vec<CloneInfo>,
        open_log: &dyn Fn(&CloneInfo) -> std::io::Result<File>,
        since: Instant,
        timeout: Duration,
    ) -> Result<(Vec<CloneInfo>, Release), ZygoteError> {
        let socket = self.socket.take().expect("open until start_clones");
        let fork = Fork {
            socket: &socket,
            zygote: &self.pidfd,
            parent,
            open_log,
        };
        match follow(&fork, clones, since, timeout) {
            Ok(started) => {
                // The zygote goes first (its clones, all ready, no longer die with it), while
                // the clones are still held: once they run, a fork of thousands has them all
                // resuming at once, and a zygote or an answer waiting for the CPU behind them
                // waits long (1,000 probe clones: 0.42 s from the last one ready to the
                // answer). It is killed rather than told: it has answered every request, so
                // nothing is left on the socket for it, and nothing but the Go will be.
                let _ = self.process.kill();
                self.finish();
                mayfly_sys::trace::event("fork_zygote_ended");
                let (infos, pidfds): (Vec<CloneInfo>, Vec<OwnedFd>) = started.into_iter().unzip();
                reaper::adopt(pidfds);
                Ok((infos, Release::new(socket)))
            }
            Err((mut err, mut pidfds)) => {
                // The zygote kills and reaps every clone it made (it is their parent, and may
                // do so by pid); one that does not in time is killed, and its clones that have
                // not reported die with it (their parent-death signal).
                send(&socket, &Message::Abort);
                self.finish();
                // Whatever pidfd is still on its way (a clone's Ready, the zygote's Forked)
                // names a process that must not run either.
                let (queued, unusable) = kill_queued(&socket);
                if let ZygoteError::CloneFailed { killed, .. } = &mut err {
                    *killed += queued.len();
                }
                // A zygote that could not restore the fork's snapshot says why, and exits: a
                // request sent after that fails, and says less.
                if let (ZygoteError::Io { .. }, Some(reason)) = (&err, unusable) {
                    err = ZygoteError::Unusable(reason);
                }
                pidfds.extend(queued);
                // A VMM that inherits the zygote's orphans reaps them.
                reaper::adopt(pidfds);
                Err(err)
            }
        }
    }
}

/// How long a failed fork keeps reading its socket for pidfds still on their way.
pub(crate) const DRAIN_GRACE: Duration = Duration::from_millis(50);

/// Kill every process whose pidfd is still queued on the fork's socket, or arrives within
/// `DRAIN_GRACE`; returns their pidfds, and the zygote's reason if it said it cannot restore
/// the fork's snapshot.
pub(crate) fn kill_queued(socket: &UnixDatagram) -> (Vec<OwnedFd>, Option<String>) {
    let mut buf = vec![0u8; MAX_MESSAGE];
    let mut killed = Vec::new();
    let mut unusable = None;
    let mut reset_once = false;
    let deadline = Instant::now() + DRAIN_GRACE;
    loop {
        let fds = match seqpacket::receive(socket, &mut buf) {
            Ok(Received::Message(len, fd)) => {
                if let Ok(Message::Unusable { reason }) = serde_json::from_slice(&buf[..len]) {
                    unusable.get_or_insert(reason);
                }
                fd.into_iter().collect()
            }
            Ok(Received::Truncated(fds)) => fds,
            Ok(Received::End) => return (killed, unusable),
            Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => {
                let remaining = deadline.saturating_duration_since(Instant::now());
                match poll::poll(&[(socket.as_raw_fd(), libc::POLLIN)], remaining) {
                    Ok(revents) if revents[0] != 0 && !remaining.is_zero() => continue,
                    _ => return (killed, unusable),
                }
            }
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => continue,
            // Said once, before the queue, when the other end closed with messages unread.
            Err(err) if err.kind() == std::io::ErrorKind::ConnectionReset && !reset_once => {
                reset_once = true;
                continue;
            }
            Err(_) => return (killed, unusable),
        };
        fds.iter().for_each(pidfd::kill);
        killed.extend(fds);
    }
}

/// The forking VMM's record of a fork in progress.
pub(crate) struct Follow {
    pending: HashMap<u32, Pending>,
    /// Clones not yet settled (Ready, or failed).
    open: usize,
    /// Clones the zygote has not yet answered for (Forked or NotForked): a clone may report
    /// Ready before the zygote's Forked (with its pid) arrives, and the answer needs the pid.
    unanswered: usize,
    since: Instant,
    /// The first failure: it ends the fork.
    failure: Option<ZygoteError>,
}

impl Follow {
    /// Record that the zygote has answered (or can no longer answer) for a clone.
    fn answer(&mut self, index: u32) {
        if let Some(entry) = self.pending.get_mut(&index) {
            if !entry.answered {
                entry.answered = true;
                self.unanswered -= 1;
                if self.unanswered == 0 {
                    mayfly_sys::trace::event("fork_all_answered");
                }
            }
        }
    }

    /// Record how a clone ended up (the first word counts; a failure ends the fork).
    fn settle(&mut self, index: u32, outcome: Result<(), String>) {
        let Some(entry) = self.pending.get_mut(&index) else {
            return;
        };
        if entry.outcome.is_some() {
            return;
        }
        match &outcome {
            Ok(()) => entry.info.ready_ms = self.since.elapsed().as_secs_f64() * 1e3,
            Err(reason) => {
                if self.failure.is_none() {
                    self.failure = Some(ZygoteError::CloneFailed {
                        name: entry.info.name.clone(),
                        reason: reason.clone(),
                        log: entry.info.console_log.clone(),
                        killed: 0,
                    });
                }
            }
        }
        entry.outcome = Some(outcome);
        self.open -= 1;
        if self.open == 0 {
            mayfly_sys::trace::event("fork_all_settled");
        }
    }

    fn handle(&mut self, message: Message, fd: Option<OwnedFd>) {
        if let (Some(stray), false) = (
            &fd,
            matches!(message, Message::Forked { .. } | Message::Ready { .. }),
        ) {
            // Only a clone's process comes with a message: a descriptor with anything else
            // is a pidfd nobody follows.
            pidfd::kill(stray);
        }
        match message {
            Message::Unusable { reason } => {
                self.failure.get_or_insert(ZygoteError::Unusable(reason));
            }
            Message::Forked { index, pid } => {
                self.take_pidfd(index, pid, fd);
                self.answer(index);
                if self
                    .pending
                    .get(&index)
                    .is_some_and(|entry| entry.pidfd.is_none())
                {
                    self.settle(
                        index,
                        Err("the zygote did not pass its process's pidfd".into()),
                    );
                }
            }
            Message::NotForked { index, reason } => {
                self.answer(index);
                self.settle(index, Err(reason));
            }
            Message::Failed { index, reason } => self.settle(index, Err(reason)),
            Message::Ready { index, pid } => {
                // With its own pidfd, a clone that runs is known even if the zygote's word
                // on it never comes. A jailed clone sends none: the process followed is its
                // jail's waiter, which the zygote's word names.
                if fd.is_some() && self.take_pidfd(index, pid, fd) {
                    self.answer(index);
                } else if let Some(entry) = self.pending.get_mut(&index) {
                    if entry.info.jail.is_some() {
                        entry.info.vmm_pid = Some(pid);
                    }
                }
                self.settle(index, Ok(()));
            }
            Message::Exited { index, status } => self.settle(
                index,
                Err(format!("its process ended ({status}) before it reported")),
            ),
            Message::Start { .. } | Message::Abort | Message::Go => {}
        }
    }

    /// Keep `fd` as the pidfd of clone `index` (process `pid`) if it has none yet. A pidfd
    /// that cannot be this clone's (no such clone, or another process than the one already
    /// known) names a process nobody follows: it is killed, and the fork fails. Returns
    /// whether the clone now has a pidfd.
    fn take_pidfd(&mut self, index: u32, pid: u32, fd: Option<OwnedFd>) -> bool {
        let Some(entry) = self.pending.get_mut(&index) else {
            if let Some(fd) = fd {
                pidfd::kill(&fd);
                self.failure.get_or_insert(ZygoteError::Protocol(
                    "a process for a clone this fork did not ask for",
                ));
            }
            return false;
        };
        match (&entry.pidfd, fd) {
            (None, Some(fd)) => {
                entry.info.pid = pid;
                entry.pidfd = Some(fd);
            }
            (Some(_), Some(fd)) if entry.info.pid != pid => {
                pidfd::kill(&fd);
                self.failure
                    .get_or_insert(ZygoteError::Protocol("two processes for one clone"));
            }
            // The same process again, or no pidfd with the message.
            _ => {}
        }
        entry.pidfd.is_some()
    }

    /// The zygote has ended: it will answer for no more clones, and clones that have not
    /// reported must be watched through their own pidfds.
    fn zygote_ended(&mut self) {
        let unanswered: Vec<u32> = self
            .pending
            .iter()
            .filter(|(_, entry)| !entry.answered)
            .map(|(&index, _)| index)
            .collect();
        for index in unanswered {
            self.answer(index);
            self.settle(
                index,
                Err("the fork's zygote ended before it made its process".into()),
            );
        }
    }

    /// Kill every clone this fork has a pidfd for; returns their pidfds.
    fn kill_all(&mut self) -> Vec<OwnedFd> {
        let pidfds: Vec<OwnedFd> = self
            .pending
            .values_mut()
            .filter_map(|entry| entry.pidfd.take())
            .collect();
        pidfds.iter().for_each(pidfd::kill);
        pidfds
    }
}

/// What a fork talks to and with: its socket, its zygote's pidfd, the parent's name, and how
/// a clone's console log is opened (at the moment its request is sent, so that a fork of
/// thousands does not hold a descriptor per clone for its logs).
pub(crate) struct Fork<'a> {
    pub(crate) socket: &'a UnixDatagram,
    pub(crate) zygote: &'a OwnedFd,
    pub(crate) parent: &'a str,
    pub(crate) open_log: &'a dyn Fn(&CloneInfo) -> std::io::Result<File>,
}

/// A fork that failed: its first failure, and the pidfds of the clones it killed.
pub(crate) type ForkFailed = (ZygoteError, Vec<OwnedFd>);

/// The forking VMM's side of steps 3 and 4: returns every clone with its pidfd once all run,
/// or the first failure once every clone it knows of is killed (with their pidfds).
pub(crate) fn follow(
    fork: &Fork,
    clones: Vec<CloneInfo>,
    since: Instant,
    timeout: Duration,
) -> Result<Vec<(CloneInfo, OwnedFd)>, ForkFailed> {
    let order: Vec<u32> = clones.iter().map(|info| info.index).collect();
    let mut state = Follow {
        open: order.len(),
        unanswered: order.len(),
        pending: clones
            .into_iter()
            .map(|info| {
                (
                    info.index,
                    Pending {
                        info,
                        pidfd: None,
                        answered: false,
                        outcome: None,
                    },
                )
            })
            .collect(),
        since,
        failure: None,
    };
    let ended = run_follow(&mut state, fork, &order, timeout);
    if let Err(err) = ended {
        state.failure.get_or_insert(err);
    }
    if state.failure.is_none() {
        // Nothing failed, but the loop ended: by the timeout, or with the socket's end.
        if let Some(entry) = order
            .iter()
            .map(|index| &state.pending[index])
            .find(|entry| entry.outcome.is_none() || !entry.answered)
        {
            let reason = if entry.outcome.is_none() && Instant::now() >= since + timeout {
                format!("it did not report within {} s", timeout.as_secs())
            } else if entry.outcome.is_none() {
                "it ended without reporting".to_string()
            } else {
                "the zygote never said which process it is".to_string()
            };
            state.failure = Some(ZygoteError::CloneFailed {
                name: entry.info.name.clone(),
                reason,
                log: entry.info.console_log.clone(),
                killed: 0,
            });
        }
    }
    if let Some(mut err) = state.failure.take() {
        let pidfds = state.kill_all();
        if let ZygoteError::CloneFailed { killed, .. } = &mut err {
            *killed += pidfds.len();
        }
        return Err((err, pidfds));
    }
    let mut pending = state.pending;
    Ok(order
        .iter()
        .filter_map(|index| pending.remove(index))
        .filter_map(|entry| Some((entry.info, entry.pidfd?)))
        .collect())
}

/// The poll loop of [`follow`]: sends the requests as the socket takes them and reads the
/// answers, until every clone is settled and answered for, one fails, or `timeout` passes.
pub(crate) fn run_follow(
    state: &mut Follow,
    fork: &Fork,
    order: &[u32],
    timeout: Duration,
) -> Result<(), ZygoteError> {
    let (socket, zygote) = (fork.socket, fork.zygote);
    let deadline = state.since + timeout;
    let mut unsent = order.iter().copied().peekable();
    let mut sent = 0usize;
    let limit = in_flight_limit();
    let mut zygote_alive = true;
    let mut buf = vec![0u8; MAX_MESSAGE];
    while (state.open > 0 || state.unanswered > 0) && state.failure.is_none() {
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return Ok(());
        }
        let mut events = libc::POLLIN;
        // Clones sent for and not yet settled: they compete for the host's CPUs with each
        // other, and with the clones already running.
        let in_flight = sent.saturating_sub(order.len() - state.open);
        if unsent.peek().is_some() && in_flight < limit {
            events |= libc::POLLOUT;
        }
        let mut fds = vec![(socket.as_raw_fd(), events)];
        // Once the zygote has ended, nobody reports a clone's end for it: each clone still
        // starting is watched through its pidfd.
        let mut watched = Vec::new();
        if zygote_alive {
            fds.push((zygote.as_raw_fd(), libc::POLLIN));
        } else {
            for (&index, entry) in &state.pending {
                if let (None, Some(pidfd)) = (&entry.outcome, &entry.pidfd) {
                    fds.push((pidfd.as_raw_fd(), libc::POLLIN));
                    watched.push(index);
                }
            }
        }
        let revents = poll::poll(&fds, remaining).map_err(io("wait for the fork's clones"))?;
        if revents[0] & libc::POLLOUT != 0 {
            if let Some(&index) = unsent.peek() {
                if send_start(state, fork, index)? {
                    unsent.next();
                    sent += 1;
                }
            }
        }
        let readable = revents[0] & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0;
        if readable {
            if !read_one(state, socket, &mut buf)? {
                // Every sender is gone: the clones still open never will report.
                return Ok(());
            }
        } else if zygote_alive && revents[1] != 0 {
            // The zygote has ended, and so has every send it made; but what it sent may have
            // arrived after poll looked at the socket: its end counts once the socket is
            // empty (until then the next round reads on).
            if no_message(socket) {
                zygote_alive = false;
                state.zygote_ended();
            }
        } else if !zygote_alive {
            for (slot, index) in watched.into_iter().enumerate() {
                if revents[slot + 1] != 0 {
                    state.settle(index, Err("its process ended before it reported".into()));
                }
            }
        }
    }
    Ok(())
}

/// How many clones a fork has starting at once: four per host CPU (the settings'
/// `fork_in_flight`, from MAYFLY_FORK_IN_FLIGHT, sets another number, to measure). Measured on this project's 2-CPU host with the probe
/// (benches/results/probe-fork-host.json): 10,000 clones ran in 51 s with 8 starting at once
/// against 84 s with all of them at once, since clones that start all together compete with
/// each other and with those already running; 2 at once was slower (1,000 clones: 1.57 s
/// against 1.08 s with 4 or 8, 1.12 s unbounded).
pub(crate) fn in_flight_limit() -> usize {
    if let Some(n) = crate::settings::get().fork_in_flight.filter(|&n| n > 0) {
        return n;
    }
    std::thread::available_parallelism().map_or(8, |n| n.get().saturating_mul(4))
}

/// Read and handle one message, if there is one. Returns false at the end of the stream.
pub(crate) fn read_one(
    state: &mut Follow,
    socket: &UnixDatagram,
    buf: &mut [u8],
) -> Result<bool, ZygoteError> {
    match seqpacket::receive(socket, buf) {
        Ok(Received::Message(len, fd)) => {
            // Only this fork's own processes write here; a message that does not parse is
            // ignored (its clone then fails for want of a report).
            if let Ok(message) = serde_json::from_slice::<Message>(&buf[..len]) {
                state.handle(message, fd);
            } else if let Some(fd) = fd {
                pidfd::kill(&fd);
            }
            Ok(true)
        }
        Ok(Received::Truncated(fds)) => {
            fds.iter().for_each(pidfd::kill);
            Err(ZygoteError::Protocol(
                "a message too long, or with more than one descriptor",
            ))
        }
        Ok(Received::End) => Ok(false),
        Err(err)
            if matches!(
                err.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
            ) =>
        {
            Ok(true)
        }
        Err(err) => Err(io("read the fork's socket")(err)),
    }
}

/// Whether nothing is waiting on the socket now.
pub(crate) fn no_message(socket: &UnixDatagram) -> bool {
    poll::poll(&[(socket.as_raw_fd(), libc::POLLIN)], Duration::ZERO)
        .is_ok_and(|revents| revents[0] == 0)
}

/// Send one clone's request, its console log attached. A clone whose request cannot be made
/// fails (and so ends the fork) without reaching the zygote. Returns false if the socket had
/// no room after all (the request goes again on the next POLLOUT).
pub(crate) fn send_start(state: &mut Follow, fork: &Fork, index: u32) -> Result<bool, ZygoteError> {
    let entry = state
        .pending
        .get_mut(&index)
        .expect("every index has an entry");
    let message = encode(&Message::Start {
        parent: fork.parent.to_string(),
        clone: Box::new(entry.info.clone()),
    })
    .ok_or_else(|| {
        format!(
            "its file paths are not UTF-8 or longer than the zygote takes ({MAX_MESSAGE} bytes in all)"
        )
    });
    let log = message.and_then(|message| {
        (fork.open_log)(&entry.info)
            .map(|log| (message, log))
            .map_err(|err| format!("cannot open its console log: {err}"))
    });
    let (message, log) = match log {
        Ok(ready) => ready,
        Err(reason) => {
            state.answer(index);
            state.settle(index, Err(reason));
            return Ok(true);
        }
    };
    match fork.socket.send_with_fd(&message[..], log.as_raw_fd()) {
        Ok(_) => Ok(true),
        Err(e) if e.errno() == libc::EAGAIN => Ok(false),
        Err(e) => Err(io("send a clone request to the fork's zygote")(
            std::io::Error::from_raw_os_error(e.errno()),
        )),
    }
}

/// Clones whose zygote has ended are children of the nearest subreaper: when that is this
/// VMM (PID 1 of a container, or a process that made itself a subreaper), it must reap them
/// when they end, or they stay zombies. One thread does it for every fork, from their pidfds.
mod reaper {
    use std::os::fd::{AsRawFd, OwnedFd};
    use std::sync::mpsc::{channel, Receiver, Sender};
    use std::sync::{Mutex, OnceLock};
    use std::time::Duration;

    static ADOPT: OnceLock<Mutex<Sender<Vec<OwnedFd>>>> = OnceLock::new();

    /// Whether clones of this process's zygotes become its own children when the zygote ends.
    fn inherits_orphans() -> bool {
        let mut subreaper: libc::c_int = 0;
        // SAFETY: PR_GET_CHILD_SUBREAPER writes one int at the pointer given.
        let rc = unsafe { libc::prctl(libc::PR_GET_CHILD_SUBREAPER, &mut subreaper) };
        // SAFETY: getpid has no preconditions.
        let pid = unsafe { libc::getpid() };
        pid == 1 || (rc == 0 && subreaper != 0)
    }

    /// Reap these clones when they end, if they are to become this process's children.
    pub(super) fn adopt(pidfds: Vec<OwnedFd>) {
        if pidfds.is_empty() || !inherits_orphans() {
            return;
        }
        let sender = ADOPT.get_or_init(|| {
            let (sender, receiver) = channel();
            let _ = std::thread::Builder::new()
                .name("clone reaper".into())
                .spawn(move || reap(receiver));
            Mutex::new(sender)
        });
        if let Ok(sender) = sender.lock() {
            let _ = sender.send(pidfds);
        }
    }

    fn reap(receiver: Receiver<Vec<OwnedFd>>) {
        let mut watched: Vec<OwnedFd> = Vec::new();
        loop {
            while let Ok(more) = receiver.try_recv() {
                watched.extend(more);
            }
            if watched.is_empty() {
                match receiver.recv() {
                    Ok(more) => watched.extend(more),
                    Err(_) => return,
                }
                continue;
            }
            let fds: Vec<_> = watched
                .iter()
                .map(|fd| (fd.as_raw_fd(), libc::POLLIN))
                .collect();
            // New clones are picked up within a second.
            let Ok(revents) = mayfly_sys::poll::poll(&fds, Duration::from_secs(1)) else {
                std::thread::sleep(Duration::from_secs(1));
                continue;
            };
            let mut index = 0;
            watched.retain(|fd| {
                let ended = revents[index] != 0;
                index += 1;
                if ended {
                    // SAFETY: waitid on a pidfd we own, without blocking; a zeroed siginfo
                    // receives the status. ECHILD (the zygote reaped it) is fine too.
                    unsafe {
                        let mut info: libc::siginfo_t = std::mem::zeroed();
                        libc::waitid(
                            libc::P_PIDFD,
                            fd.as_raw_fd().unsigned_abs(),
                            &mut info,
                            libc::WEXITED | libc::WNOHANG,
                        );
                    }
                }
                !ended
            });
        }
    }
}
