//! The fork's clone factory: one single-threaded process per fork that holds the prepared
//! snapshot and fork(2)s a clone out of itself per request, so that a clone costs what making
//! its KVM VM costs, not a `mayfly` process start.
//!
//! 1. The forking VMM starts `mayfly zygote` (one exec per fork, whatever the clone count),
//!    passing it the fork's state, its memory base and one end of a socket pair.
//! 2. The zygote prepares the restore once ([`restore::prepare`]): reads and checks the
//!    state, opens KVM and checks the state against it, maps the memory base copy-on-write.
//!    It never starts a thread: only a single-threaded process can fork(2) and let the child
//!    go on allocating, opening and starting threads as any process does.
//! 3. For each request (a clone's name, index and files, its console log attached) it forks;
//!    the forking VMM keeps a few clones starting at once (four per host CPU), not all.
//!    The child makes itself a process of its own (its own process group, stderr to its log),
//!    makes its KVM VM (a VM belongs to the process that created it, so no VM ever crosses a
//!    fork), paused, and reports on the socket that it is ready. The zygote sends the forking
//!    VMM the child's pid with a pidfd: clones are killed by pidfd, never by a pid that may
//!    have been recycled.
//! 4. When every clone is ready, the forking VMM kills the zygote (it has answered every
//!    request; the clones no longer die with it), writes the fork's answer, then queues
//!    [`Message::Go`] and closes its end: every clone runs ([`ForkEnd`]) and lives on. A
//!    clone that sees the end close without the word (the forking VMM died, or its answer
//!    reached nobody) stops.
//!
//! Why, measured on this machine's KVM with the probe guest (benches/results/probe-host.json):
//! starting every clone as `mayfly restore` of inherited descriptors cost 3.3 ms per clone (100
//! clones in 327 ms; the exec, the dynamic linking of a 37 MB binary and the state parse each
//! time), against the ~0.5 ms the KVM work itself takes. A pool of VMM processes started in
//! advance would still parse the state and map the memory per clone, and sits idle between
//! forks; fork(2) of a process that has done both already shares them, copy-on-write. The
//! forking VMM itself cannot be the one to fork(2): it is multi-threaded (its vCPUs, devices
//! and control socket), and a child of a multi-threaded process may not allocate.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use mayfly_sys::seqpacket::{self, Received};
use mayfly_sys::{pidfd, poll};

use crate::devices::console::Console;
use crate::devices::manager::RestoreTargets;
use crate::persist::restore::{self, Instance, MemoryMode, Prepared, SnapshotSource};

/// One clone: what the fork asks the zygote for, and what the fork's answer lists.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CloneInfo {
    pub name: String,
    pub index: u32,
    /// Its process (0 until the zygote has forked it).
    pub pid: u32,
    /// Its control socket.
    pub api_sock: PathBuf,
    /// Its serial console's output.
    pub console_log: PathBuf,
    /// A FIFO: what is written to it is typed into the clone's serial console.
    pub console_input: PathBuf,
    /// Its vsock socket (the guest agent is reached through it).
    pub vsock: PathBuf,
    /// Its vsock CID, its own.
    pub vsock_cid: u64,
    /// Where its writable disks keep their own layers (on the parent's frozen chain).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub disk_dir: Option<PathBuf>,
    /// Where its NIC's network is made (its parent's settings; it gets a namespace and a MAC
    /// of its own), if the parent has a NIC.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub net: Option<crate::devices::net::NetSettings>,
    /// From the fork request until this clone reported that it is ready to run.
    #[serde(default)]
    pub ready_ms: f64,
}

/// A message on the fork's socket (a SOCK_SEQPACKET pair: one message is one datagram, and
/// the forking VMM sees the end of the stream once the zygote and every clone have closed
/// theirs).
#[derive(Debug, Serialize, Deserialize)]
enum Message {
    /// Forking VMM → zygote: start this clone (its console log attached).
    Start {
        parent: String,
        clone: Box<CloneInfo>,
    },
    /// Zygote → forking VMM: the snapshot cannot be restored here; no clone will start.
    Unusable { reason: String },
    /// Zygote → forking VMM: the clone's process (its pidfd attached).
    Forked { index: u32, pid: u32 },
    /// Zygote → forking VMM: no process for this clone.
    NotForked { index: u32, reason: String },
    /// Clone → forking VMM: it is restored and ready to run (its own pidfd attached, so that the forking VMM
    /// can stop it even if the zygote's word on it never comes).
    Ready { index: u32, pid: u32 },
    /// Forking VMM → zygote: the fork failed; kill every clone process you made, reap them,
    /// and exit.
    Abort,
    /// Clone → forking VMM: it could not start (it exits).
    Failed { index: u32, reason: String },
    /// Zygote → forking VMM: a clone's process ended.
    Exited { index: u32, status: String },
    /// Forking VMM → its clones, as it lets them go: the fork succeeded. A clone that sees the
    /// forking VMM's end close without this queued (the VMM died mid-fork, or its answer
    /// reached nobody) stops.
    Go,
}

/// Longest message either side sends or takes (the socket's default send buffer holds a
/// few). A reason is cut to `MAX_REASON` bytes first, so even escaped six to a byte in JSON it
/// fits; a request whose paths do not fit is refused before it is sent.
const MAX_MESSAGE: usize = 64 << 10;
const MAX_REASON: usize = 2 << 10;

#[derive(Debug, thiserror::Error)]
pub enum ZygoteError {
    #[error("cannot {what}: {source}")]
    Io {
        what: &'static str,
        source: std::io::Error,
    },
    #[error("the fork's snapshot cannot be restored on this host: {0}")]
    Unusable(String),
    #[error("clone {name} did not start: {reason} (its console log: {log}); the fork's other clones were stopped ({killed} processes killed)")]
    CloneFailed {
        name: String,
        reason: String,
        log: PathBuf,
        /// Processes of this fork killed for it (the failed clone's own included, if made).
        killed: usize,
    },
    #[error(
        "the fork's zygote broke its protocol: {0} (this is a bug in mayfly; please report it)"
    )]
    Protocol(&'static str),
}

fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> ZygoteError {
    move |source| ZygoteError::Io { what, source }
}

/// A message as sent, or `None` if it cannot be (a path that is not UTF-8, or more than
/// `MAX_MESSAGE` bytes of it).
fn encode(message: &Message) -> Option<Vec<u8>> {
    serde_json::to_vec(message)
        .ok()
        .filter(|bytes| bytes.len() <= MAX_MESSAGE)
}

/// The longest start of `text` of at most `max` bytes that ends at a character boundary.
fn prefix(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// `reason` cut to at most `MAX_REASON` bytes.
fn cut(reason: &str) -> String {
    prefix(reason, MAX_REASON).to_string()
}

/// Send a message that always encodes (no paths in it; its reason cut); errors are the
/// receiver's to notice (it then fails the clone for want of a word).
fn send(socket: &UnixDatagram, message: &Message) {
    if let Some(bytes) = encode(message) {
        let _ = socket.send(&bytes);
    }
}

/// A descriptor duplicated for a child to inherit (not close-on-exec); closed when dropped.
struct Inherited(OwnedFd);

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
const EXIT_GRACE: Duration = Duration::from_secs(2);

impl Drop for Zygote {
    fn drop(&mut self) {
        // The end of the stream tells the zygote to exit.
        drop(self.socket.take());
        self.finish();
    }
}

/// A fork's clones, every one ready and held: dropped, it lets them go (queues [`Message::Go`]
/// and closes the forking VMM's end of the fork's socket; each clone sees the hang-up and the
/// word: see [`ForkEnd`]) if the fork's answer reached its client ([`Release::delivered`]), and
/// otherwise closes without the word, so that the clones stop: nobody knows of them. Kept
/// until the fork's answer is written, so that the answer does not wait for the CPU behind
/// thousands of clones resuming at once; a request into a held clone's guest waits for it.
#[derive(Debug)]
pub struct Release {
    socket: UnixDatagram,
    delivered: std::sync::atomic::AtomicBool,
}

impl Release {
    fn new(socket: UnixDatagram) -> Self {
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
struct Pending {
    info: CloneInfo,
    pidfd: Option<OwnedFd>,
    /// The zygote said whether it made this clone's process (Forked or NotForked), or can no
    /// longer say.
    answered: bool,
    outcome: Option<Result<(), String>>,
}

impl Zygote {
    /// Step 1: start `mayfly zygote` on the fork's state and memory base.
    pub fn spawn(state: &File, memory: &File) -> Result<Self, ZygoteError> {
        let (socket, theirs) = seqpacket::pair().map_err(io("create the fork's socket"))?;
        // The three descriptors are duplicated without close-on-exec just for this spawn (a
        // fork is the only thing in the VMM that starts processes, one at a time), so the
        // standard library can start the zygote with posix_spawn.
        let inherit = [
            Inherited::dup(state)?,
            Inherited::dup(memory)?,
            Inherited::dup(&theirs)?,
        ];
        let exe = std::env::current_exe().map_err(io("find the mayfly binary"))?;
        let mut process = Command::new(exe)
            .arg("zygote")
            .args(["--state-fd", &inherit[0].arg()])
            .args(["--memory-fd", &inherit[1].arg()])
            .args(["--socket-fd", &inherit[2].arg()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            // Its own process group (and so its clones'): a Ctrl-C or hang-up meant for the
            // parent's terminal does not reach them.
            .process_group(0)
            .spawn()
            .map_err(io("start the fork's zygote"))?;
        drop(inherit);
        drop(theirs);
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
                let queued = kill_queued(&socket);
                if let ZygoteError::CloneFailed { killed, .. } = &mut err {
                    *killed += queued.len();
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
const DRAIN_GRACE: Duration = Duration::from_millis(50);

/// Kill every process whose pidfd is still queued on the fork's socket, or arrives within
/// `DRAIN_GRACE`; returns their pidfds.
fn kill_queued(socket: &UnixDatagram) -> Vec<OwnedFd> {
    let mut buf = vec![0u8; MAX_MESSAGE];
    let mut killed = Vec::new();
    let deadline = Instant::now() + DRAIN_GRACE;
    loop {
        let fds = match seqpacket::receive(socket, &mut buf) {
            Ok(Received::Message(_, fd)) => fd.into_iter().collect(),
            Ok(Received::Truncated(fds)) => fds,
            Ok(Received::End) => return killed,
            Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => {
                let remaining = deadline.saturating_duration_since(Instant::now());
                match poll::poll(&[(socket.as_raw_fd(), libc::POLLIN)], remaining) {
                    Ok(revents) if revents[0] != 0 && !remaining.is_zero() => continue,
                    _ => return killed,
                }
            }
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return killed,
        };
        fds.iter().for_each(pidfd::kill);
        killed.extend(fds);
    }
}

/// The forking VMM's record of a fork in progress.
struct Follow {
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
                // on it never comes.
                if fd.is_some() && self.take_pidfd(index, pid, fd) {
                    self.answer(index);
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
struct Fork<'a> {
    socket: &'a UnixDatagram,
    zygote: &'a OwnedFd,
    parent: &'a str,
    open_log: &'a dyn Fn(&CloneInfo) -> std::io::Result<File>,
}

/// A fork that failed: its first failure, and the pidfds of the clones it killed.
type ForkFailed = (ZygoteError, Vec<OwnedFd>);

/// The forking VMM's side of steps 3 and 4: returns every clone with its pidfd once all run,
/// or the first failure once every clone it knows of is killed (with their pidfds).
fn follow(
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
fn run_follow(
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
fn in_flight_limit() -> usize {
    if let Some(n) = crate::settings::get().fork_in_flight.filter(|&n| n > 0) {
        return n;
    }
    std::thread::available_parallelism().map_or(8, |n| n.get().saturating_mul(4))
}

/// Read and handle one message, if there is one. Returns false at the end of the stream.
fn read_one(
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
fn no_message(socket: &UnixDatagram) -> bool {
    poll::poll(&[(socket.as_raw_fd(), libc::POLLIN)], Duration::ZERO)
        .is_ok_and(|revents| revents[0] == 0)
}

/// Send one clone's request, its console log attached. A clone whose request cannot be made
/// fails (and so ends the fork) without reaching the zygote. Returns false if the socket had
/// no room after all (the request goes again on the next POLLOUT).
fn send_start(state: &mut Follow, fork: &Fork, index: u32) -> Result<bool, ZygoteError> {
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

/// How a clone tells the forking VMM whether it runs.
pub struct Reporter {
    socket: UnixDatagram,
    index: u32,
}

impl Reporter {
    /// The clone is ready to run: from now on it outlives the zygote (so its parent-death
    /// signal is cleared before the word goes out, on the thread that set it). Its own pidfd
    /// goes with the word. Returns what tells it when its fork ends, or None if the word
    /// could not be sent: nobody knows of this clone then, and it must stop.
    pub fn ready(self) -> Option<ForkEnd> {
        // SAFETY: prctl with plain integer arguments; getpid has no preconditions.
        let pid = unsafe {
            libc::prctl(libc::PR_SET_PDEATHSIG, 0, 0, 0, 0);
            libc::getpid()
        };
        let message = encode(&Message::Ready {
            index: self.index,
            pid: pid.unsigned_abs(),
        })?;
        let sent = match pidfd::open(pid) {
            Ok(pidfd) => self
                .socket
                .send_with_fd(&message[..], pidfd.as_raw_fd())
                .is_ok(),
            Err(_) => self.socket.send(&message).is_ok(),
        };
        sent.then_some(ForkEnd(self.socket))
    }

    /// The clone could not start (it is about to exit).
    pub fn failed(self, reason: &str) {
        send(
            &self.socket,
            &Message::Failed {
                index: self.index,
                reason: cut(reason),
            },
        );
    }
}

/// A clone's end of its fork's socket, kept once it is ready: the forking VMM closes its own
/// end once every clone of the fork is ready and its answer is written, with [`Message::Go`]
/// queued (and kills them all if one fails), and the clone is held paused until then.
///
/// Why: clones that run while the rest of their fork is still being made compete with it for
/// the host's CPUs. Measured in the test rig (one emulated CPU for L1 and every VM in it), a
/// Linux clone's guest spends ~200 ms of L1 CPU right after its restore, and its agent's
/// refresh another ~150 ms (vCPU and vsock threads; 100 clones, `/proc/PID/task/*/stat`):
/// each clone made the next ones slower (KVM_CREATE_VM to the VM made: 90 ms for the first
/// clones, 950 ms for the last), and a fork of 100 took 14.0 s, or 5.7 s without the
/// refresh. Held, the clones are made on an idle machine and all go at once, which is also
/// what a fork into many rollouts wants: none starts ahead of the others.
pub struct ForkEnd(UnixDatagram);

impl ForkEnd {
    /// Block until the forking VMM has closed its end of the socket (poll for the hang-up
    /// only: the zygote, which shares this end, reads the messages on it), then close this
    /// clone's end. Returns whether the fork succeeded: the VMM queued [`Message::Go`] before
    /// closing (it is looked at, not taken: every clone of the fork reads the same queue).
    /// Without it the forking VMM ended mid-fork or its answer reached nobody: nobody was told
    /// of this clone, and it must not run.
    pub fn wait(self) -> bool {
        loop {
            match poll::poll(&[(self.0.as_raw_fd(), 0)], Duration::MAX) {
                Ok(revents) if revents[0] != 0 => break,
                Ok(_) => {}
                // Not knowing is no answer: look again (poll fails only for want of memory).
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
        let mut buf = [0u8; 64];
        // A reset is said once, before the queue (an end closed with messages unread on it);
        // an interruption is no answer either: look again, a few times.
        use nix::errno::Errno;
        use nix::sys::socket::{recv, MsgFlags};
        let flags = MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT;
        for _ in 0..8 {
            match recv(self.0.as_raw_fd(), &mut buf, flags) {
                Ok(len) => {
                    return matches!(
                        serde_json::from_slice::<Message>(&buf[..len.min(buf.len())]),
                        Ok(Message::Go)
                    )
                }
                Err(Errno::ECONNRESET | Errno::EINTR) => {}
                Err(_) => return false,
            }
        }
        false
    }
}

/// What a clone's process runs once the zygote has forked it: finish the restore as
/// `instance` and report through `report`. Never returns (the clone's process ends with its
/// VM).
pub type CloneMain = fn(Prepared, Instance, Reporter) -> !;

/// Take a descriptor passed at exec, close-on-exec from now on.
fn take_fd(fd: RawFd, what: &'static str) -> Result<OwnedFd, String> {
    // SAFETY: fcntl on a plain integer; F_GETFD only reads the descriptor's flags.
    if fd <= 2 || unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return Err(format!("descriptor {fd} passed as the {what} is not open"));
    }
    // SAFETY: the fork passed this descriptor to this process alone; nothing else owns it.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sets FD_CLOEXEC on the descriptor this value now owns.
    unsafe { libc::fcntl(owned.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
    Ok(owned)
}

/// Threads of this process.
fn thread_count() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count())
}

/// Name this process (or thread) as `ps -o comm` and `top` show it: at most 15 bytes.
fn set_comm(name: &str) {
    let name = prefix(name, 15).as_bytes();
    let mut comm = [0u8; 16];
    comm[..name.len()].copy_from_slice(name);
    // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes.
    unsafe { libc::prctl(libc::PR_SET_NAME, comm.as_ptr()) };
}

/// The index of a request that does not parse as one, if it has one at all: the zygote still
/// answers for that clone, so the fork does not wait for it until its timeout.
fn index_of_bad_request(bytes: &[u8]) -> Option<u32> {
    let value: serde_json::Value = serde_json::from_slice(bytes).ok()?;
    let index = value.get("Start")?.get("clone")?.get("index")?.as_u64()?;
    u32::try_from(index).ok()
}

/// The zygote process (`mayfly zygote`), steps 2 to 4. Returns the process's exit status.
pub fn serve(state_fd: RawFd, memory_fd: RawFd, socket_fd: RawFd, clone_main: CloneMain) -> u8 {
    set_comm("mayfly-zygote");
    let socket = match take_fd(socket_fd, "fork's socket") {
        Ok(fd) => UnixDatagram::from(fd),
        Err(reason) => {
            eprintln!("mayfly zygote: {reason}");
            return 1;
        }
    };
    let unusable = |reason: String| {
        send(
            &socket,
            &Message::Unusable {
                reason: cut(&reason),
            },
        );
        1
    };
    let source = match SnapshotSource::inherited(state_fd, memory_fd) {
        Ok(source) => source,
        Err(err) => return unusable(err.to_string()),
    };
    mayfly_sys::trace::event("zygote_started");
    let prepared = match restore::prepare(source, MemoryMode::Cow, None, restore::Probe::Inline) {
        Ok(prepared) => prepared,
        Err(err) => return unusable(err.to_string()),
    };
    mayfly_sys::trace::event("zygote_prepared");
    // Every clone installs the same seccomp filters: compiled here once, inherited compiled.
    if let Err(err) = mayfly_jail::seccomp::prepare() {
        return unusable(err.to_string());
    }
    // Checked once everything before the first fork has run: nothing here starts a thread.
    if thread_count() != 1 {
        return unusable(format!(
            "the zygote runs {} threads; it forks only while it runs one",
            thread_count()
        ));
    }
    // SAFETY: getpid has no preconditions.
    let zygote_pid = unsafe { libc::getpid() };
    let mut children: HashMap<libc::pid_t, u32> = HashMap::new();
    let mut buf = vec![0u8; MAX_MESSAGE];
    let mut reaped = Instant::now();
    loop {
        // At most every REAP_EVERY: waitpid(-1) walks every child this process has, so
        // reaping after each request would cost a fork of thousands of clones a walk of all
        // of them per clone (measured: 3,000 clones, ~1.2 ms a clone for the first thousand
        // and ~1.6 ms for the third before this; see REAP_EVERY).
        if reaped.elapsed() >= REAP_EVERY {
            reap(&socket, &mut children);
            reaped = Instant::now();
        }
        // Woken at least every REAP_EVERY to reap clones that ended.
        match poll::poll(&[(socket.as_raw_fd(), libc::POLLIN)], REAP_EVERY) {
            Ok(revents) if revents[0] != 0 => {}
            Ok(_) => continue,
            Err(_) => return 1,
        }
        let (len, log) = match seqpacket::receive(&socket, &mut buf) {
            Ok(Received::Message(len, log)) => (len, log),
            // Never sent by the forking VMM: dropped (its descriptors closed).
            Ok(Received::Truncated(_)) => continue,
            // The forking VMM is done (or gone).
            Ok(Received::End) => return 0,
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN)) => continue,
            Err(_) => return 1,
        };
        let (parent, clone) = match serde_json::from_slice(&buf[..len]) {
            Ok(Message::Start { parent, clone }) => (parent, *clone),
            Ok(Message::Abort) => {
                abort(&mut children);
                return 1;
            }
            _ => {
                if let Some(index) = index_of_bad_request(&buf[..len]) {
                    let reason = "its request to the zygote did not parse".to_string();
                    send(&socket, &Message::NotForked { index, reason });
                }
                continue;
            }
        };
        let index = clone.index;
        let Some(log) = log.map(File::from) else {
            let reason = "its request came without its console log".to_string();
            send(&socket, &Message::NotForked { index, reason });
            continue;
        };
        // SAFETY: this process runs one thread (checked above, and it starts none), so the
        // child may do anything a process does.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            become_clone(zygote_pid, prepared, parent, clone, log, socket, clone_main);
        }
        if pid < 0 {
            let reason = format!("fork(2) failed: {}", std::io::Error::last_os_error());
            send(&socket, &Message::NotForked { index, reason });
            continue;
        }
        drop(log);
        children.insert(pid, index);
        // The child is not reaped before this process waits for it, so its pid cannot be
        // anyone else's yet; for the same reason it may be killed by pid here.
        let forked = pidfd::open(pid).and_then(|pidfd| {
            let message = encode(&Message::Forked {
                index,
                pid: pid.unsigned_abs(),
            })
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EMSGSIZE))?;
            socket
                .send_with_fd(&message[..], pidfd.as_raw_fd())
                .map(drop)
                .map_err(|e| std::io::Error::from_raw_os_error(e.errno()))
        });
        if let Err(err) = forked {
            // A clone the forking VMM cannot kill by pidfd must not run.
            // SAFETY: kill of our own child, not yet reaped.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            let reason = format!("its process could not be handed over ({err}); it was killed");
            send(&socket, &Message::NotForked { index, reason });
        }
    }
}

/// How often the zygote looks for clones that ended before they reported (their `Exited`
/// message waits at most this long; the clone's own pidfd tells the forking VMM at once once
/// the zygote has ended).
const REAP_EVERY: Duration = Duration::from_millis(100);

/// The fork failed: kill every clone process this zygote made and reap them (by pid: they are
/// its children, not yet reaped, so the pids are theirs).
fn abort(children: &mut HashMap<libc::pid_t, u32>) {
    for &pid in children.keys() {
        // SAFETY: kill of our own child, not yet reaped.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    for (pid, _) in children.drain() {
        let mut status = 0;
        // SAFETY: waitpid on our own child; `status` receives its status.
        unsafe { libc::waitpid(pid, &mut status, 0) };
    }
}

/// Tell the forking VMM of clones whose process ended, and reap them.
fn reap(socket: &UnixDatagram, children: &mut HashMap<libc::pid_t, u32>) {
    loop {
        let mut status = 0;
        // SAFETY: waitpid on any child of ours without blocking; `status` receives its status.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if pid <= 0 {
            return;
        }
        if let Some(index) = children.remove(&pid) {
            let status = if libc::WIFSIGNALED(status) {
                format!("killed by signal {}", libc::WTERMSIG(status))
            } else {
                format!("exit status {}", libc::WEXITSTATUS(status))
            };
            send(socket, &Message::Exited { index, status });
        }
    }
}

/// In the child, step 3: become the clone's own process and start its VM.
fn become_clone(
    zygote_pid: libc::pid_t,
    prepared: Prepared,
    parent: String,
    clone: CloneInfo,
    log: File,
    socket: UnixDatagram,
    clone_main: CloneMain,
) -> ! {
    let report = Reporter {
        socket,
        index: clone.index,
    };
    // Until it reports that it is ready, the clone dies with the zygote: a fork that fails kills
    // its zygote, and with it every clone whose pidfd the forking VMM may not have yet.
    // SAFETY: prctl with plain integer arguments; getppid has no preconditions.
    let orphaned = unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0
            || libc::getppid() != zygote_pid
    };
    if orphaned {
        report.failed("its zygote ended while it was being made");
        std::process::exit(1);
    }
    set_comm(&clone.name);
    // Its own process group: it outlives the fork and is signalled apart from the others.
    // Its stderr is its console log, appended to (the console writes there too).
    // SAFETY: plain system calls on this process and descriptors it owns; results checked.
    let setup = unsafe {
        let flags = libc::fcntl(log.as_raw_fd(), libc::F_GETFL);
        if libc::setpgid(0, 0) != 0 {
            Err("make its own process group")
        } else if flags < 0
            || libc::fcntl(log.as_raw_fd(), libc::F_SETFL, flags | libc::O_APPEND) < 0
            || libc::dup2(log.as_raw_fd(), 2) < 0
        {
            Err("send its stderr to its console log")
        } else {
            Ok(())
        }
    };
    if let Err(what) = setup {
        let err = std::io::Error::last_os_error();
        report.failed(&format!("cannot {what}: {err}"));
        std::process::exit(1);
    }
    drop(log);
    mayfly_sys::trace::event("clone_forked");
    let instance = Instance {
        origin: format!("fork of {parent}"),
        console: Console::Log(clone.console_log.clone()),
        console_input: Some(clone.console_input.clone()),
        api_sock: Some(clone.api_sock.clone()),
        // Held until the fork has every clone ready (see [`ForkEnd`]).
        paused: true,
        name: Some(clone.name.clone()),
        clone_of: Some((parent, clone.index)),
        devices: RestoreTargets {
            vsock_path: Some(clone.vsock.clone()),
            vsock_cid: Some(clone.vsock_cid),
            snapshot_dir: None,
            disk_dir: clone.disk_dir.clone(),
            layers_within: None,
            net: crate::devices::net::NetTargets {
                settings: clone.net.clone().unwrap_or_default(),
                policy: None,
                new_mac: true,
            },
        },
    };
    clone_main(prepared, instance, report)
}

#[cfg(test)]
mod tests {
    //! The forking VMM's side of the protocol against a fake zygote on a socket pair: every
    //! way the other side can go wrong ends the fork with an error and kills what it started.

    use super::*;
    use std::os::unix::process::ExitStatusExt;

    fn info(index: u32) -> CloneInfo {
        CloneInfo {
            name: format!("c-{index}"),
            index,
            pid: 0,
            api_sock: format!("/nonexistent/c-{index}.sock").into(),
            console_log: format!("/nonexistent/c-{index}.log").into(),
            console_input: format!("/nonexistent/c-{index}.in").into(),
            vsock: format!("/nonexistent/c-{index}.vsock").into(),
            vsock_cid: 1000 + u64::from(index),
            net: None,
            disk_dir: None,
            ready_ms: 0.0,
        }
    }

    fn clones(count: u32) -> Vec<CloneInfo> {
        (0..count).map(info).collect()
    }

    /// Follow a fork of `clones` on `ours` (each console log /dev/null) for up to a minute.
    fn run(
        ours: &UnixDatagram,
        zygote: &OwnedFd,
        clones: Vec<CloneInfo>,
    ) -> Result<Vec<(CloneInfo, OwnedFd)>, ZygoteError> {
        let fork = Fork {
            socket: ours,
            zygote,
            parent: "p",
            open_log: &|_| File::open("/dev/null"),
        };
        follow(&fork, clones, Instant::now(), Duration::from_secs(60)).map_err(|(err, _)| err)
    }

    /// A process standing in for a clone (or the zygote), and its pidfd.
    fn process() -> (Child, OwnedFd) {
        let child = Command::new("sleep")
            .arg("600")
            .spawn()
            .expect("start sleep");
        let pidfd = pidfd::open(child.id().try_into().unwrap()).expect("pidfd_open");
        (child, pidfd)
    }

    /// Whether `child` had been killed by SIGKILL (it is killed and reaped either way).
    fn was_killed(mut child: Child) -> bool {
        // The signal is on its way when the fork returns; give it time to land.
        for _ in 0..500 {
            if let Some(status) = child.try_wait().expect("try_wait") {
                return status.signal() == Some(libc::SIGKILL);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
        let _ = child.wait();
        false
    }

    fn stop(mut child: Child) {
        let _ = child.kill();
        let _ = child.wait();
    }

    fn still_running(child: &mut Child) -> bool {
        child.try_wait().expect("try_wait").is_none()
    }

    fn message(message: &Message) -> Vec<u8> {
        encode(message).expect("encodes")
    }

    /// The zygote's end: read the requests, answer with `script` (a message and the pidfd to
    /// pass with it), then hold the socket open for `hold` before closing it.
    fn fake_zygote(
        theirs: UnixDatagram,
        requests: usize,
        script: Vec<(Message, Option<RawFd>)>,
        hold: Duration,
    ) -> std::thread::JoinHandle<Vec<Message>> {
        std::thread::spawn(move || {
            let mut buf = vec![0u8; MAX_MESSAGE];
            let mut got = Vec::new();
            for _ in 0..requests {
                match seqpacket::receive(&theirs, &mut buf).expect("receive a request") {
                    Received::Message(len, fd) => {
                        assert!(fd.is_some(), "a request comes with its console log");
                        let fd = fd.unwrap();
                        // SAFETY: F_GETFD on a descriptor this test owns.
                        let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFD) };
                        assert!(flags & libc::FD_CLOEXEC != 0, "received close-on-exec");
                        got.push(serde_json::from_slice(&buf[..len]).expect("a request parses"));
                    }
                    // The fork ended before it sent them all.
                    Received::End => break,
                    Received::Truncated(_) => panic!("expected a request"),
                }
            }
            for (msg, fd) in script {
                let bytes = message(&msg);
                match fd {
                    Some(fd) => theirs.send_with_fd(&bytes[..], fd).map(drop).expect("send"),
                    None => theirs.send(&bytes).map(drop).expect("send"),
                }
            }
            std::thread::sleep(hold);
            got
        })
    }

    #[test]
    fn a_clone_that_reports_before_its_pid_arrives_is_listed_with_its_pid() {
        let (zygote, zygote_fd) = process();
        let (clone, clone_fd) = process();
        let (ours, theirs) = seqpacket::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let script = vec![
            (Message::Ready { index: 0, pid: 0 }, None),
            (
                Message::Forked {
                    index: 0,
                    pid: clone.id(),
                },
                Some(clone_fd.as_raw_fd()),
            ),
        ];
        let fake = fake_zygote(theirs, 1, script, Duration::from_secs(1));
        let started = run(&ours, &zygote_fd, clones(1)).expect("the fork succeeds");
        let requests = fake.join().unwrap();
        assert!(
            matches!(&requests[0], Message::Start { parent, clone } if parent == "p" && clone.index == 0)
        );
        assert_eq!(started.len(), 1);
        assert_eq!(started[0].0.pid, clone.id());
        // SAFETY: F_GETFD on a descriptor this test owns.
        let flags = unsafe { libc::fcntl(started[0].1.as_raw_fd(), libc::F_GETFD) };
        assert!(flags & libc::FD_CLOEXEC != 0, "pidfds arrive close-on-exec");
        assert!(
            !was_killed(clone),
            "a clone of a fork that succeeded is left running"
        );
        stop(zygote);
    }

    #[test]
    fn a_clone_reported_ready_that_the_zygote_never_handed_over_fails_the_fork() {
        // Before: this was a success with pid 0 (and `kill 0` is the caller's own group).
        let (zygote, zygote_fd) = process();
        let (ours, theirs) = seqpacket::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let fake = fake_zygote(
            theirs,
            1,
            vec![(Message::Ready { index: 0, pid: 0 }, None)],
            Duration::ZERO,
        );
        let err = run(&ours, &zygote_fd, clones(1)).expect_err("no pid, no success");
        fake.join().unwrap();
        assert!(
            matches!(&err, ZygoteError::CloneFailed { name, reason, .. } if name == "c-0" && reason.contains("never said which process")),
            "{err}"
        );
        stop(zygote);
    }

    #[test]
    fn a_clone_known_only_by_its_own_report_is_killed_when_the_fork_fails() {
        // The zygote forked it but never said so (it stalled or died); the clone ran and
        // reported with its own pidfd, then another clone failed.
        let (zygote, zygote_fd) = process();
        let (a, a_fd) = process();
        let (ours, theirs) = seqpacket::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let script = vec![
            (
                Message::Ready {
                    index: 0,
                    pid: a.id(),
                },
                Some(a_fd.as_raw_fd()),
            ),
            (
                Message::NotForked {
                    index: 1,
                    reason: "fork(2) failed".into(),
                },
                None,
            ),
        ];
        let fake = fake_zygote(theirs, 2, script, Duration::from_secs(1));
        let err = run(&ours, &zygote_fd, clones(2)).expect_err("a clone failed");
        fake.join().unwrap();
        assert!(
            matches!(&err, ZygoteError::CloneFailed { name, .. } if name == "c-1"),
            "{err}"
        );
        assert!(was_killed(a), "the clone that reported by itself is killed");
        stop(zygote);
    }

    #[test]
    fn one_clone_failing_kills_every_clone_the_fork_was_handed() {
        let (zygote, zygote_fd) = process();
        let (a, a_fd) = process();
        let (b, b_fd) = process();
        let (ours, theirs) = seqpacket::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let script = vec![
            (
                Message::Forked {
                    index: 0,
                    pid: a.id(),
                },
                Some(a_fd.as_raw_fd()),
            ),
            (Message::Ready { index: 0, pid: 0 }, None),
            (
                Message::Forked {
                    index: 1,
                    pid: b.id(),
                },
                Some(b_fd.as_raw_fd()),
            ),
            (
                Message::Failed {
                    index: 1,
                    reason: "no KVM for you".into(),
                },
                None,
            ),
        ];
        let fake = fake_zygote(theirs, 2, script, Duration::from_secs(1));
        let err = run(&ours, &zygote_fd, clones(2)).expect_err("a clone failed");
        fake.join().unwrap();
        assert!(
            matches!(&err, ZygoteError::CloneFailed { name, reason, killed: 2, .. } if name == "c-1" && reason == "no KVM for you"),
            "{err}"
        );
        assert!(was_killed(a), "the clone that ran is killed");
        assert!(was_killed(b), "the clone that failed is killed");
        stop(zygote);
    }

    #[test]
    fn a_message_the_buffer_cannot_hold_ends_the_fork_and_kills_its_clones() {
        // Before: a read error returned at once and left the clones handed over so far running.
        let (zygote, zygote_fd) = process();
        let (a, a_fd) = process();
        let (b, b_fd) = process();
        let (ours, theirs) = seqpacket::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let (a_pid, a_raw, b_raw) = (a.id(), a_fd.as_raw_fd(), b_fd.as_raw_fd());
        let fake = std::thread::spawn(move || {
            let mut buf = vec![0u8; MAX_MESSAGE];
            seqpacket::receive(&theirs, &mut buf).expect("a request");
            let forked = message(&Message::Forked {
                index: 0,
                pid: a_pid,
            });
            theirs.send_with_fd(&forked[..], a_raw).expect("send");
            let huge = vec![b' '; MAX_MESSAGE + 1];
            theirs.send_with_fd(&huge[..], b_raw).expect("send");
            std::thread::sleep(Duration::from_secs(1));
        });
        let err = run(&ours, &zygote_fd, clones(1)).expect_err("the zygote broke the protocol");
        fake.join().unwrap();
        assert!(matches!(err, ZygoteError::Protocol(_)), "{err}");
        assert!(was_killed(a), "the clone handed over is killed");
        assert!(
            was_killed(b),
            "the process whose pidfd came with the bad message is killed"
        );
        stop(zygote);
    }

    #[test]
    fn the_zygote_ending_fails_the_clones_it_never_answered_for_at_once() {
        // Before: the fork waited for its whole timeout (120 s) when the zygote died.
        let (mut zygote, zygote_fd) = process();
        let (ours, theirs) = seqpacket::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        // The socket stays open (a clone may still hold it) while the zygote dies.
        let fake = fake_zygote(theirs, 2, vec![], Duration::from_secs(2));
        zygote.kill().unwrap();
        let err = run(&ours, &zygote_fd, clones(2)).expect_err("no zygote, no clones");
        assert!(
            matches!(&err, ZygoteError::CloneFailed { reason, .. } if reason.contains("zygote ended before it made its process")),
            "{err}"
        );
        assert!(!still_running(&mut zygote));
        drop(ours);
        fake.join().unwrap();
    }

    #[test]
    fn a_clone_whose_paths_cannot_be_sent_fails_without_reaching_the_zygote() {
        use std::os::unix::ffi::OsStrExt;
        let (zygote, zygote_fd) = process();
        let (ours, theirs) = seqpacket::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let mut clone = info(0);
        clone.console_log = std::ffi::OsStr::from_bytes(b"/tmp/\xff.log").into();
        let err = run(&ours, &zygote_fd, vec![clone]).expect_err("a path that is not UTF-8");
        assert!(
            matches!(&err, ZygoteError::CloneFailed { reason, .. } if reason.contains("not UTF-8")),
            "{err}"
        );
        theirs.set_nonblocking(true).unwrap();
        let mut buf = vec![0u8; MAX_MESSAGE];
        assert!(
            seqpacket::receive(&theirs, &mut buf).is_err(),
            "nothing was sent (not even an empty message, which reads as the end)"
        );
        stop(zygote);
    }

    /// The forking VMM's end closed with a message still unread on it: the clones' end says
    /// ECONNRESET once before its queue, and a clone still finds the word after it.
    #[test]
    fn a_clone_finds_the_go_even_when_its_forks_end_closed_with_messages_unread() {
        let (vmm, clones) = seqpacket::pair().unwrap();
        // A zygote's late word, never read by the forking VMM.
        clones
            .send(&message(&Message::Exited {
                index: 0,
                status: "x".into(),
            }))
            .unwrap();
        vmm.send(&message(&Message::Go)).unwrap();
        drop(vmm);
        let look = clones.try_clone().unwrap();
        assert!(ForkEnd(clones).wait(), "the clone found its fork's word");
        // Looked at, not taken: the next clone finds it too.
        assert!(ForkEnd(look).wait(), "the next clone found it too");
    }

    /// A release lets the clones run only if the fork's answer reached its client.
    #[test]
    fn clones_run_only_if_their_forks_answer_was_delivered() {
        for delivered in [true, false] {
            let (vmm, clones) = seqpacket::pair().unwrap();
            vmm.set_nonblocking(true).unwrap();
            clones
                .send(&message(&Message::Exited {
                    index: 0,
                    status: "x".into(),
                }))
                .unwrap();
            let release = Release::new(vmm);
            if delivered {
                release.delivered();
            }
            drop(release);
            assert_eq!(ForkEnd(clones).wait(), delivered);
        }
        // The forking VMM gone without a word (it died mid-fork): no clone runs.
        let (vmm, clones) = seqpacket::pair().unwrap();
        drop(vmm);
        assert!(!ForkEnd(clones).wait());
    }

    #[test]
    fn a_clone_failure_of_any_length_and_content_reaches_the_fork() {
        // Before: 4 KiB of control characters grew past the 16 KiB message limit in JSON.
        let (ours, theirs) = seqpacket::pair().unwrap();
        Reporter {
            socket: theirs,
            index: 7,
        }
        .failed(&"\u{1}é".repeat(20_000));
        let mut buf = vec![0u8; MAX_MESSAGE];
        let Received::Message(len, None) = seqpacket::receive(&ours, &mut buf).expect("a message")
        else {
            panic!("expected one whole message");
        };
        match serde_json::from_slice(&buf[..len]).expect("it parses") {
            Message::Failed { index: 7, reason } => {
                assert!(
                    !reason.is_empty() && reason.len() <= MAX_REASON,
                    "{}",
                    reason.len()
                );
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}
