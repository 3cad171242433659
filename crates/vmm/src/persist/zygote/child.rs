//! The zygote process and the clones it forks: [`serve`] prepares the restore once and forks a
//! clone per request; a clone reports ready ([`Reporter`]) and waits for its fork's end
//! ([`ForkEnd`]) before it runs.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::time::{Duration, Instant};

use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use mayfly_sys::seqpacket::{self, Received};
use mayfly_sys::{pidfd, poll};

use crate::devices::console::Console;
use crate::devices::manager::RestoreTargets;
use crate::persist::restore::{self, Instance, MemoryMode, Prepared, SnapshotSource};
use crate::persist::zygote::message::*;

/// How a clone tells the forking VMM whether it runs.
pub struct Reporter {
    pub(crate) socket: UnixDatagram,
    pub(crate) index: u32,
}

impl Reporter {
    /// The clone is ready to run: from now on it outlives the zygote (so its parent-death
    /// signal is cleared before the word goes out, on the thread that set it). Its own pidfd
    /// goes with the word. Returns what tells it when its fork ends, or None if the word
    /// could not be sent: nobody knows of this clone then, and it must stop.
    pub fn ready(self) -> Option<ForkEnd> {
        // A jailed clone keeps its own: it dies with its jail's waiter, which no longer dies
        // with the zygote (see `become_clone`).
        let jailed = mayfly_jail::jail::current().is_some();
        // SAFETY: prctl with plain integer arguments; getpid has no preconditions.
        let pid = unsafe {
            if !jailed {
                libc::prctl(libc::PR_SET_PDEATHSIG, 0, 0, 0, 0);
            }
            libc::getpid()
        };
        let message = encode(&Message::Ready {
            index: self.index,
            // As the forking side numbers it (a jailed clone is 1 in its own namespace).
            pid: mayfly_jail::jail::host_pid(),
        })?;
        // A jailed clone's pidfd stays here: the fork follows its jail's waiter (the
        // zygote's child, named by the zygote), with which it dies.
        let own = if jailed {
            Err(std::io::ErrorKind::Unsupported.into())
        } else {
            pidfd::open(pid)
        };
        let sent = match own {
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
/// end once every clone of the fork is ready and its answer is written, with `Message::Go`
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
pub struct ForkEnd(pub(crate) UnixDatagram);

impl ForkEnd {
    /// Block until the forking VMM has closed its end of the socket (poll for the hang-up
    /// only: the zygote, which shares this end, reads the messages on it), then close this
    /// clone's end. Returns whether the fork succeeded: the VMM queued `Message::Go` before
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
pub(crate) fn take_fd(fd: RawFd, what: &'static str) -> Result<OwnedFd, String> {
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
pub(crate) fn thread_count() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count())
}

/// Name this process (or thread) as `ps -o comm` and `top` show it: at most 15 bytes.
pub(crate) fn set_comm(name: &str) {
    let name = prefix(name, 15).as_bytes();
    let mut comm = [0u8; 16];
    comm[..name.len()].copy_from_slice(name);
    // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes.
    unsafe { libc::prctl(libc::PR_SET_NAME, comm.as_ptr()) };
}

/// The index of a request that does not parse as one, if it has one at all: the zygote still
/// answers for that clone, so the fork does not wait for it until its timeout.
pub(crate) fn index_of_bad_request(bytes: &[u8]) -> Option<u32> {
    let value: serde_json::Value = serde_json::from_slice(bytes).ok()?;
    let index = value.get("Start")?.get("clone")?.get("index")?.as_u64()?;
    u32::try_from(index).ok()
}

/// The zygote process (`mayfly zygote`), steps 2 to 4. Returns the process's exit status.
pub fn serve(state_fd: RawFd, memory_fds: &[RawFd], socket_fd: RawFd, clone_main: CloneMain) -> u8 {
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
    let source = match SnapshotSource::inherited(state_fd, memory_fds) {
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
pub(crate) const REAP_EVERY: Duration = Duration::from_millis(100);

/// The fork failed: kill every clone process this zygote made and reap them (by pid: they are
/// its children, not yet reaped, so the pids are theirs).
pub(crate) fn abort(children: &mut HashMap<libc::pid_t, u32>) {
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
pub(crate) fn reap(socket: &UnixDatagram, children: &mut HashMap<libc::pid_t, u32>) {
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
pub(crate) fn become_clone(
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
    if let Some(jail) = clone.jail.clone() {
        // Its own jail, made while this process has one thread: this process stays outside
        // as the jail's waiter (root: it keeps the clone's network and cleans up after it),
        // and goes on inside as the clone's VMM. The waiter must outlive the zygote, which
        // ends once every clone of the fork is ready, so it no longer dies with it; a fork
        // that fails kills it by the pidfd the zygote sent, and the VMM inside dies with it.
        // SAFETY: prctl with plain integer arguments.
        unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, 0, 0, 0, 0) };
        let network = crate::outside::network_socket(&clone.api_sock);
        let sockets = vec![clone.api_sock.clone(), clone.vsock.clone(), network.clone()];
        let work = crate::outside::keep_network(Some(network));
        if let Err(err) = mayfly_jail::jail::enter(jail, &clone.name, sockets, Some(work)) {
            report.failed(&format!("cannot make its jail: {err}"));
            std::process::exit(1);
        }
        mayfly_sys::trace::event("clone_jailed");
    }
    let policy = match clone
        .policy
        .as_deref()
        .map(crate::devices::net::parse_policy)
        .transpose()
    {
        Ok(policy) => policy,
        Err(err) => {
            report.failed(&format!("its policy: {err}"));
            std::process::exit(1);
        }
    };
    let instance = Instance {
        origin: format!("fork of {parent}"),
        console: Console::Log(clone.console_log.clone()),
        console_input: clone.console_input.clone(),
        api_sock: Some(clone.api_sock.clone()),
        // Held until the fork has every clone ready (see [`crate::persist::zygote::ForkEnd`]).
        paused: true,
        name: Some(clone.name.clone()),
        clone_of: Some((parent, clone.index)),
        devices: RestoreTargets {
            vsock_path: Some(clone.vsock.clone()),
            vsock_cid: Some(clone.vsock_cid),
            snapshot_dir: None,
            disk_dir: clone.disk_dir.clone(),
            // A manager's clone opens its own links to its source's layers, and no others.
            layers_within: clone.layers_moved.as_ref().map(|(_, to)| to.clone()),
            layers_moved: clone.layers_moved.clone(),
            net: crate::devices::net::NetTargets {
                settings: clone.net.clone().unwrap_or_default(),
                policy,
                new_mac: true,
            },
        },
    };
    clone_main(prepared, instance, report)
}
