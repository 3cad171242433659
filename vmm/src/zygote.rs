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
//! 3. For each request (a clone's name, index and files, its console log attached) it forks.
//!    The child makes itself a process of its own (its own process group, stderr to its log),
//!    makes its KVM VM (a VM belongs to the process that created it, so no VM ever crosses a
//!    fork) and reports on the socket that it runs. The zygote sends the forking VMM the
//!    child's pid with a pidfd: clones are killed by pidfd, never by a pid that may have been
//!    recycled.
//! 4. When the forking VMM closes its end, the zygote exits; its clones live on.
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

use crate::console::Console;
use crate::device_manager::RestoreTargets;
use crate::restore::{self, Instance, MemoryMode, Prepared, SnapshotSource};

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
    /// From the fork request until this clone reported that it runs.
    #[serde(default)]
    pub ready_ms: f64,
}

/// A message on the fork's socket (a SOCK_SEQPACKET pair: one message is one datagram, and
/// the forking VMM sees the end of the stream once the zygote and every clone have closed
/// theirs).
#[derive(Debug, Serialize, Deserialize)]
enum Message {
    /// Forking VMM → zygote: start this clone (its console log attached).
    Start { parent: String, clone: CloneInfo },
    /// Zygote → forking VMM: the snapshot cannot be restored here; no clone will start.
    Unusable { reason: String },
    /// Zygote → forking VMM: the clone's process (its pidfd attached).
    Forked { index: u32, pid: u32 },
    /// Zygote → forking VMM: no process for this clone.
    NotForked { index: u32, reason: String },
    /// Clone → forking VMM: its vCPUs run.
    Ready { index: u32 },
    /// Clone → forking VMM: it could not start (it exits).
    Failed { index: u32, reason: String },
    /// Zygote → forking VMM: a clone's process ended.
    Exited { index: u32, status: String },
}

/// Longest message: a clone's failure, cut to fit (the rest is in its console log).
const MAX_MESSAGE: usize = 16 << 10;
const MAX_REASON: usize = 4 << 10;

#[derive(Debug, thiserror::Error)]
pub enum ZygoteError {
    #[error("cannot {what}: {source}")]
    Io {
        what: &'static str,
        source: std::io::Error,
    },
    #[error("the fork's snapshot cannot be restored on this host: {0}")]
    Unusable(String),
    #[error("clone {name} did not start: {reason} (its console log: {log})")]
    CloneFailed {
        name: String,
        reason: String,
        log: PathBuf,
    },
}

fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> ZygoteError {
    move |source| ZygoteError::Io { what, source }
}

fn encode(message: &Message) -> Vec<u8> {
    // A Message always serialises (plain data, string keys).
    serde_json::to_vec(message).unwrap_or_default()
}

/// A connected SOCK_SEQPACKET pair, close-on-exec. std has no seqpacket type; a datagram
/// socket's send and recv are send(2) and recv(2), which is all either end uses.
fn seqpacket_pair() -> std::io::Result<(UnixDatagram, UnixDatagram)> {
    let mut fds = [0; 2];
    // SAFETY: socketpair fills the two-element array; the result is checked.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: socketpair returned two new descriptors that nothing else owns.
    unsafe {
        Ok((
            UnixDatagram::from(OwnedFd::from_raw_fd(fds[0])),
            UnixDatagram::from(OwnedFd::from_raw_fd(fds[1])),
        ))
    }
}

/// Send `signal` to the process behind `pidfd` (nothing happens if it has ended, even if its
/// pid is in use again).
fn pidfd_kill(pidfd: &OwnedFd) {
    // SAFETY: pidfd_send_signal on a pidfd this process owns; no siginfo.
    unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
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
    /// Closed first when the fork is done: the end of the stream tells the zygote to exit.
    socket: Option<UnixDatagram>,
}

impl Drop for Zygote {
    fn drop(&mut self) {
        drop(self.socket.take());
        let _ = self.process.wait();
    }
}

/// A clone the zygote is asked for, as the forking VMM follows it.
struct Pending {
    info: CloneInfo,
    log: Option<File>,
    pidfd: Option<OwnedFd>,
    /// The zygote said whether it made this clone's process.
    answered: bool,
    outcome: Option<Result<(), String>>,
}

impl Zygote {
    /// Step 1: start `mayfly zygote` on the fork's state and memory base.
    pub fn spawn(state: &File, memory: &File) -> Result<Self, ZygoteError> {
        let (socket, theirs) = seqpacket_pair().map_err(io("create the fork's socket"))?;
        // The three descriptors are duplicated without close-on-exec just for this spawn (a
        // fork is the only thing in the VMM that starts processes, one at a time), so the
        // standard library can start the zygote with posix_spawn.
        let inherit = [
            Inherited::dup(state)?,
            Inherited::dup(memory)?,
            Inherited::dup(&theirs)?,
        ];
        let exe = std::env::current_exe().map_err(io("find the mayfly binary"))?;
        let process = Command::new(exe)
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
        socket
            .set_nonblocking(true)
            .map_err(io("set up the fork's socket"))?;
        Ok(Self {
            process,
            socket: Some(socket),
        })
    }

    /// Steps 3 and 4, the forking VMM's side: ask for every clone (each with its console log)
    /// and follow them until each runs or fails, or `timeout` passes. On any failure every
    /// clone of this fork is killed and the first failure returned. The zygote ends either way.
    /// `since` is when the fork was asked for (each clone's `ready_ms` counts from it).
    pub fn start_clones(
        self,
        parent: &str,
        clones: Vec<(CloneInfo, File)>,
        since: Instant,
        timeout: Duration,
    ) -> Result<Vec<CloneInfo>, ZygoteError> {
        let socket = self.socket.as_ref().expect("open until dropped");
        follow(socket, parent, clones, since, timeout)
    }
}

fn follow(
    socket: &UnixDatagram,
    parent: &str,
    clones: Vec<(CloneInfo, File)>,
    since: Instant,
    timeout: Duration,
) -> Result<Vec<CloneInfo>, ZygoteError> {
    let deadline = Instant::now() + timeout;
    let order: Vec<u32> = clones.iter().map(|(info, _)| info.index).collect();
    let mut pending: HashMap<u32, Pending> = clones
        .into_iter()
        .map(|(info, log)| {
            (
                info.index,
                Pending {
                    info,
                    log: Some(log),
                    pidfd: None,
                    answered: false,
                    outcome: None,
                },
            )
        })
        .collect();
    let mut unsent = order.iter().copied().peekable();
    let mut open = order.len();
    // Clones the zygote has not yet answered for (Forked or NotForked): a clone may report
    // Ready before the zygote's Forked (with its pid) arrives, and the answer needs the pid.
    let mut unforked = order.len();
    let mut unusable = None;
    let mut buf = vec![0u8; MAX_MESSAGE];
    while (open > 0 || unforked > 0) && unusable.is_none() {
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            break;
        }
        let mut events = libc::POLLIN;
        if unsent.peek().is_some() {
            events |= libc::POLLOUT;
        }
        let mut poll = libc::pollfd {
            fd: socket.as_raw_fd(),
            events,
            revents: 0,
        };
        let wait_ms = i32::try_from(remaining.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: poll on one pollfd we own; the result is checked.
        let n = unsafe { libc::poll(&mut poll, 1, wait_ms) };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(io("wait for the fork's clones")(err));
        }
        if poll.revents & libc::POLLOUT != 0 {
            if let Some(&index) = unsent.peek() {
                let entry = pending.get_mut(&index).expect("every index has an entry");
                let message = encode(&Message::Start {
                    parent: parent.to_string(),
                    clone: entry.info.clone(),
                });
                let log = entry.log.as_ref().expect("not sent yet").as_raw_fd();
                match socket.send_with_fd(&message[..], log) {
                    Ok(_) => {
                        entry.log = None;
                        unsent.next();
                    }
                    Err(e) if e.errno() == libc::EAGAIN => {}
                    Err(e) => {
                        return Err(io("send a clone request to the fork's zygote")(
                            std::io::Error::from_raw_os_error(e.errno()),
                        ))
                    }
                }
            }
        }
        if poll.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) == 0 {
            continue;
        }
        let (len, fd) = match socket.recv_with_fd(&mut buf) {
            Ok(got) => got,
            Err(e) if e.errno() == libc::EAGAIN || e.errno() == libc::EINTR => continue,
            Err(e) => {
                return Err(io("read the fork's socket")(
                    std::io::Error::from_raw_os_error(e.errno()),
                ))
            }
        };
        if len == 0 && fd.is_none() {
            // Every sender is gone: the clones still open never will report.
            break;
        }
        // Only this fork's own processes write here; a message that does not parse is
        // ignored (its clone then fails for want of a report).
        let Ok(message) = serde_json::from_slice::<Message>(&buf[..len]) else {
            continue;
        };
        match message {
            Message::Unusable { reason } => unusable = Some(reason),
            Message::Forked { index, pid } => {
                if let Some(entry) = pending.get_mut(&index) {
                    if !entry.answered {
                        entry.answered = true;
                        unforked -= 1;
                    }
                    entry.info.pid = pid;
                    entry.pidfd = fd.map(OwnedFd::from);
                }
            }
            Message::NotForked { index, reason } => {
                if let Some(entry) = pending.get_mut(&index) {
                    if !entry.answered {
                        entry.answered = true;
                        unforked -= 1;
                    }
                }
                settle(&mut pending, &mut open, since, index, Err(reason))
            }
            Message::Failed { index, reason } => {
                settle(&mut pending, &mut open, since, index, Err(reason))
            }
            Message::Ready { index } => settle(&mut pending, &mut open, since, index, Ok(())),
            Message::Exited { index, status } => settle(
                &mut pending,
                &mut open,
                since,
                index,
                Err(format!("its process ended ({status}) before it reported")),
            ),
            Message::Start { .. } => {}
        }
    }
    let timed_out = Instant::now() >= deadline;
    let mut failure = unusable.map(ZygoteError::Unusable);
    for index in &order {
        let entry = &pending[index];
        let reason = match &entry.outcome {
            Some(Ok(())) => continue,
            Some(Err(reason)) => reason.clone(),
            None if timed_out => format!("it did not report within {} s", timeout.as_secs()),
            None => "it ended without reporting".to_string(),
        };
        if failure.is_none() {
            failure = Some(ZygoteError::CloneFailed {
                name: entry.info.name.clone(),
                reason,
                log: entry.info.console_log.clone(),
            });
        }
    }
    match failure {
        None => Ok(order
            .iter()
            .map(|index| pending[index].info.clone())
            .collect()),
        Some(err) => {
            for entry in pending.values() {
                if let Some(pidfd) = &entry.pidfd {
                    pidfd_kill(pidfd);
                }
            }
            Err(err)
        }
    }
}

/// Record how a clone ended up (the first word counts).
fn settle(
    pending: &mut HashMap<u32, Pending>,
    open: &mut usize,
    since: Instant,
    index: u32,
    outcome: Result<(), String>,
) {
    if let Some(entry) = pending.get_mut(&index) {
        if entry.outcome.is_none() {
            if outcome.is_ok() {
                entry.info.ready_ms = since.elapsed().as_secs_f64() * 1e3;
            }
            entry.outcome = Some(outcome);
            *open -= 1;
        }
    }
}

/// How a clone tells the forking VMM whether it runs.
pub struct Reporter {
    socket: UnixDatagram,
    index: u32,
}

impl Reporter {
    /// The clone runs.
    pub fn ready(self) {
        let _ = self
            .socket
            .send(&encode(&Message::Ready { index: self.index }));
    }

    /// The clone could not start (it is about to exit).
    pub fn failed(self, reason: &str) {
        let mut reason = reason.to_string();
        if reason.len() > MAX_REASON {
            let mut cut = MAX_REASON;
            while !reason.is_char_boundary(cut) {
                cut -= 1;
            }
            reason.truncate(cut);
        }
        let _ = self.socket.send(&encode(&Message::Failed {
            index: self.index,
            reason,
        }));
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

/// The zygote process (`mayfly zygote`), steps 2 to 4. Returns the process's exit status.
pub fn serve(state_fd: RawFd, memory_fd: RawFd, socket_fd: RawFd, clone_main: CloneMain) -> u8 {
    let socket = match take_fd(socket_fd, "fork's socket") {
        Ok(fd) => UnixDatagram::from(fd),
        Err(reason) => {
            eprintln!("mayfly zygote: {reason}");
            return 1;
        }
    };
    let unusable = |reason: String| {
        let _ = socket.send(&encode(&Message::Unusable { reason }));
        1
    };
    let source = match SnapshotSource::inherited(state_fd, memory_fd) {
        Ok(source) => source,
        Err(err) => return unusable(err.to_string()),
    };
    if thread_count() != 1 {
        return unusable(format!(
            "the zygote runs {} threads; it forks only while it runs one",
            thread_count()
        ));
    }
    // MAYFLY_TRACE=1 in the forking VMM's environment: every clone prints its phases.
    if std::env::var_os("MAYFLY_TRACE").is_some() {
        crate::trace::enable();
    }
    let prepared = match restore::prepare(source, MemoryMode::Cow) {
        Ok(prepared) => prepared,
        Err(err) => return unusable(err.to_string()),
    };
    let mut children: HashMap<libc::pid_t, u32> = HashMap::new();
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        reap(&socket, &mut children);
        let mut poll = libc::pollfd {
            fd: socket.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // Woken at least every 100 ms to reap clones that ended.
        // SAFETY: poll on one pollfd we own; the result is checked.
        if unsafe { libc::poll(&mut poll, 1, 100) } <= 0 {
            continue;
        }
        let (len, log) = match socket.recv_with_fd(&mut buf) {
            Ok(got) => got,
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => continue,
            Err(_) => return 1,
        };
        if len == 0 && log.is_none() {
            // The forking VMM is done (or gone).
            return 0;
        }
        let Ok(Message::Start { parent, clone }) = serde_json::from_slice(&buf[..len]) else {
            continue;
        };
        let index = clone.index;
        let Some(log) = log else {
            let _ = socket.send(&encode(&Message::NotForked {
                index,
                reason: "its request came without its console log".into(),
            }));
            continue;
        };
        // SAFETY: this process runs one thread (checked above, and it starts none), so the
        // child may do anything a process does.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            become_clone(prepared, parent, clone, log, socket, clone_main);
        }
        if pid < 0 {
            let reason = format!("fork(2) failed: {}", std::io::Error::last_os_error());
            let _ = socket.send(&encode(&Message::NotForked { index, reason }));
            continue;
        }
        drop(log);
        children.insert(pid, index);
        // The child is not reaped before this process waits for it, so its pid cannot be
        // anyone else's yet.
        // SAFETY: pidfd_open of our own child; the result is checked.
        let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        let message = encode(&Message::Forked {
            index,
            pid: pid.unsigned_abs(),
        });
        if pidfd >= 0 {
            // SAFETY: pidfd_open returned a new descriptor that nothing else owns.
            let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as RawFd) };
            let _ = socket.send_with_fd(&message[..], pidfd.as_raw_fd());
        } else {
            let _ = socket.send(&message);
        }
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
            let _ = socket.send(&encode(&Message::Exited { index, status }));
        }
    }
}

/// In the child, step 3: become the clone's own process and start its VM.
fn become_clone(
    prepared: Prepared,
    parent: String,
    clone: CloneInfo,
    log: File,
    socket: UnixDatagram,
    clone_main: CloneMain,
) -> ! {
    // SAFETY: plain system calls on this process and descriptors it owns.
    unsafe {
        // Its own process group: it outlives the fork and is signalled apart from the others.
        libc::setpgid(0, 0);
        // Its stderr is its console log, appended to (the console writes there too).
        let flags = libc::fcntl(log.as_raw_fd(), libc::F_GETFL);
        libc::fcntl(log.as_raw_fd(), libc::F_SETFL, flags | libc::O_APPEND);
        libc::dup2(log.as_raw_fd(), 2);
    }
    drop(log);
    crate::trace::event("clone_forked");
    let instance = Instance {
        origin: format!("fork of {parent}"),
        console: Console::Log(clone.console_log.clone()),
        console_input: Some(clone.console_input.clone()),
        api_sock: Some(clone.api_sock.clone()),
        paused: false,
        name: Some(clone.name.clone()),
        clone_of: Some((parent, clone.index)),
        devices: RestoreTargets {
            vsock_path: Some(clone.vsock.clone()),
            vsock_cid: Some(clone.vsock_cid),
            snapshot_dir: None,
            disk_dir: clone.disk_dir.clone(),
        },
    };
    let report = Reporter {
        socket,
        index: clone.index,
    };
    clone_main(prepared, instance, report)
}
