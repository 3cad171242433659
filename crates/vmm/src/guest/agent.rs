//! The guest agent (`mayfly-agent`, see agent/guest and agent/PROTOCOL.md) from the host: one
//! vsock connection per operation, through the VM's vsock socket (`CONNECT <port>\n`, answered
//! `OK <host port>\n`). This is the library API that platforms embedding mayfly use, and what
//! `mayfly exec`, `mayfly cp` and the control socket's exec and file routes are built on.
//!
//! After every restore and in every clone, the VMM refreshes the guest through the agent
//! ([`crate::guest::refresh::spawn_refresh`]): wall clock from the host, fresh entropy, hostname, identity, and the
//! guest's own hook scripts. Requests that go through the control socket wait for it.
//!
//! The guest is not trusted, and neither is its agent: every call is bounded (a deadline, an
//! idle limit, an exec's `timeout_ms` plus a grace, the client's hang-up: see
//! [`crate::guest::watch`]), and nothing it sends is kept past a limit (a listing past
//! [`ListLimits`], an exec's collected output past its limit, one frame at a time otherwise).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use mayfly_agent_protocol as protocol;
use mayfly_agent_protocol::{
    AgentClient, DirEntry, ExecOutput, ExecRequest, ExitRecord, Identity as AgentIdentity,
    ListLimits, Listing, PingReply, RefreshEvent, RefreshReply, RefreshRequest, Signaller,
    StatReply, WriteFileOptions, DEFAULT_VSOCK_PORT,
};

pub use crate::guest::watch::{
    AgentStream, Stop, AGENT_IDLE_TIMEOUT, DEFAULT_CALL_TIMEOUT, EXEC_GRACE, EXEC_START_TIMEOUT,
    MAX_CALL_TIMEOUT, REFRESH_TIMEOUT,
};
use crate::guest::watch::{Bounds, Watch};
use crate::identity::Identity;

/// How long an operation waits for the agent to come up (a guest that is still booting)
/// before it says so.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(30);
/// How long the refresh after a boot waits for the agent: a whole boot, in a slow emulator too.
pub const BOOT_WAIT: Duration = Duration::from_secs(300);
/// How long the `OK <port>` answer may take once the guest is up.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Waiting for the guest's answer to `CONNECT`: longer than the vsock device waits for it (it
/// closes the connection then), so that the device's close is what ends the wait.
const CONNECT_READ_TIMEOUT: Duration = mayfly_devices::virtio::vsock::HANDSHAKE_TIMEOUT
    .saturating_add(mayfly_devices::virtio::vsock::RESET_HOLD_LIMIT)
    .saturating_add(Duration::from_secs(5));
/// A close this long after `CONNECT` is the device giving up on a silent guest, not a refusal
/// (a guest that refuses answers at once).
const DEVICE_GAVE_UP: Duration =
    mayfly_devices::virtio::vsock::HANDSHAKE_TIMEOUT.saturating_sub(Duration::from_millis(500));

/// Whether a connection the VMM closed `after` the `CONNECT` line was given up on (the guest
/// never answered) rather than refused.
fn closed_unanswered(after: Duration) -> bool {
    after >= DEVICE_GAVE_UP
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("the VM has no vsock socket: start it with --api-sock (the socket is <api-sock>.vsock) or --vsock PATH")]
    NoVsock,
    #[error("cannot reach the VM's vsock socket {path}: {source} (is the VM running?)")]
    Connect {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the guest agent did not answer on vsock port {port} within {waited:?}: is mayfly-agent running in the guest (the default guest starts it; a custom one must)?")]
    NotUp { port: u32, waited: Duration },
    #[error("the VM's vsock socket answered {0:?} instead of OK")]
    Handshake(String),
    #[error("the VM took the vsock connection but its guest did not answer CONNECT ({waited:.1?} waited): the guest is very busy or stalled (mayfly status --sock, or kill -USR1 the VMM for a state dump)")]
    HandshakeTimeout { waited: Duration },
    #[error(transparent)]
    Protocol(#[from] mayfly_agent_protocol::Error),
    /// The VMM ended the call: a deadline passed, the agent went silent, or the client hung up.
    #[error(transparent)]
    Stopped(#[from] Stop),
    #[error("the VM is paused, so its agent cannot answer: resume it first (mayfly resume --sock {})", .0.display())]
    Paused(PathBuf),
    #[error(transparent)]
    Api(#[from] mayfly_api::ApiError),
    #[error("the VM's control socket answered HTTP {status}: {message}")]
    ApiStatus { status: u16, message: String },
}

/// What a call's failure was: the watch's reason when the watch ended it (the protocol client
/// only saw its reads fail), the protocol client's error otherwise.
fn failure(watch: &Watch, e: mayfly_agent_protocol::Error) -> AgentError {
    match watch.stopped() {
        Some(stop) => stop.into(),
        None => e.into(),
    }
}

/// The kinds of call, by how they are bounded (see [`crate::guest::watch`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// One answer at the end (stat, list, remove, mkdir, ping, identity): a deadline, and the
    /// idle limit.
    Answer,
    /// A file of any size: the idle limit (and a deadline only when one was asked for).
    Transfer,
    /// A command: its own phases (armed once connected), and a deadline only when asked.
    Exec,
    /// The refresh: a deadline from its HELLO on (waiting for a booting guest is its own).
    Refresh,
    /// A bare connection for the caller's own use: a deadline only when asked.
    Raw,
}

/// The agent of one VM.
#[derive(Clone, Debug)]
pub struct Agent {
    vsock: PathBuf,
    port: u32,
    wait: Duration,
    /// A deadline for every call, instead of each kind's own.
    timeout: Option<Duration>,
    /// A client whose hang-up ends every call (the control socket's connection).
    hangup: Option<Arc<UnixStream>>,
}

impl Agent {
    /// The agent behind the vsock socket `vsock`, on its default port.
    pub fn new(vsock: &Path) -> Self {
        Self {
            vsock: vsock.to_path_buf(),
            port: DEFAULT_VSOCK_PORT,
            wait: DEFAULT_WAIT,
            timeout: None,
            hangup: None,
        }
    }

    /// The agent of the VM whose control socket is `api_sock`: asks the VM for its vsock
    /// socket, refuses a paused VM, and waits (up to [`DEFAULT_WAIT`]) for the refresh that
    /// follows a restore or fork, so that a command never runs in a clone that has not been
    /// told it is one.
    pub fn for_vm(api_sock: &Path) -> Result<Self, AgentError> {
        let start = Instant::now();
        loop {
            let (status, vm) = mayfly_api::request(api_sock, "GET", "/vm", None)?;
            if status != 200 {
                let message = vm
                    .get("error")
                    .and_then(|e| e.as_str())
                    .map_or_else(|| vm.to_string(), str::to_string);
                return Err(AgentError::ApiStatus { status, message });
            }
            if vm.get("state").and_then(|s| s.as_str()) == Some("paused") {
                return Err(AgentError::Paused(api_sock.to_path_buf()));
            }
            let vsock = vm
                .pointer("/vsock/path")
                .and_then(|p| p.as_str())
                .ok_or(AgentError::NoVsock)?;
            let refreshing = vm.get("agent_refresh").and_then(|r| r.as_str()) == Some("running");
            if !refreshing || start.elapsed() >= DEFAULT_WAIT {
                return Ok(Self::new(Path::new(vsock)));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// How long operations wait for the agent to be up.
    pub fn with_wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    pub fn with_port(mut self, port: u32) -> Self {
        self.port = port;
        self
    }

    /// A deadline for every call, from its start (waiting for the agent included) to its
    /// end, instead of each kind's own: [`DEFAULT_CALL_TIMEOUT`] for the calls that answer
    /// once, none for file transfers (bounded by [`AGENT_IDLE_TIMEOUT`]) and commands
    /// (bounded by their `timeout_ms`), [`REFRESH_TIMEOUT`] for the refresh.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// End every call as soon as `client` hangs up (closes its end; a half-close does not
    /// count): the connection to the agent is closed then, and an exec's command killed.
    pub fn watching(mut self, client: &UnixStream) -> std::io::Result<Self> {
        self.hangup = Some(Arc::new(client.try_clone()?));
        Ok(self)
    }

    fn bounds(&self, kind: Kind) -> Bounds {
        match kind {
            Kind::Answer => Bounds {
                deadline: Some(self.timeout.unwrap_or(DEFAULT_CALL_TIMEOUT)),
                idle: Some(AGENT_IDLE_TIMEOUT),
            },
            Kind::Transfer => Bounds {
                deadline: self.timeout,
                idle: Some(AGENT_IDLE_TIMEOUT),
            },
            Kind::Exec | Kind::Refresh | Kind::Raw => Bounds {
                deadline: self.timeout,
                idle: None,
            },
        }
    }

    fn watch(&self, kind: Kind, what: String) -> Arc<Watch> {
        Watch::new(what, &self.bounds(kind), self.hangup.clone())
    }

    /// One call of `kind`: connected under its watch, then `op`.
    fn call<T>(
        &self,
        kind: Kind,
        what: String,
        op: impl FnOnce(AgentClient<AgentStream>) -> Result<T, mayfly_agent_protocol::Error>,
    ) -> Result<T, AgentError> {
        let watch = self.watch(kind, what);
        let client = self.connect_watched(&watch)?;
        op(client).map_err(|e| failure(&watch, e))
    }

    /// One connection to the agent, its HELLO checked, for the caller's own use: bounded only
    /// by [`Agent::with_timeout`] and [`Agent::watching`], if set. A guest that does not listen
    /// yet closes the connection without an answer: this retries until the wait is over.
    pub fn connect(&self) -> Result<AgentClient<AgentStream>, AgentError> {
        let watch = self.watch(Kind::Raw, "the call".into());
        self.connect_watched(&watch)
    }

    fn connect_watched(&self, watch: &Arc<Watch>) -> Result<AgentClient<AgentStream>, AgentError> {
        let start = Instant::now();
        let mut delay = Duration::from_millis(2);
        loop {
            match self.try_connect(watch)? {
                Some(stream) => {
                    // The agent greets at once. A connection that closes or stays silent was
                    // cut on the guest's side (say, by a restore's transport reset): try
                    // again, backing off as for a refusal.
                    watch.set_step(Some(HANDSHAKE_TIMEOUT));
                    let mut client = AgentClient::new(stream);
                    let hello = client.hello().map(drop);
                    watch.set_step(None);
                    match hello {
                        Ok(()) => return Ok(client),
                        Err(e) if watch.stopped().is_some() => return Err(failure(watch, e)),
                        Err(mayfly_agent_protocol::Error::Protocol(_))
                        | Err(mayfly_agent_protocol::Error::Io(_))
                            if start.elapsed() < self.wait =>
                        {
                            mayfly_sys::trace::event("agent_hello_lost");
                            self.pause(watch, delay)?;
                            delay = (delay * 2).min(Duration::from_millis(100));
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
                None if start.elapsed() >= self.wait => {
                    return Err(AgentError::NotUp {
                        port: self.port,
                        waited: self.wait,
                    })
                }
                None => {
                    mayfly_sys::trace::event("agent_connect_refused");
                    self.pause(watch, delay)?;
                    delay = (delay * 2).min(Duration::from_millis(100));
                }
            }
        }
    }

    /// Wait `delay` before the next try, unless the call ends meanwhile.
    fn pause(&self, watch: &Watch, delay: Duration) -> Result<(), AgentError> {
        watch.pause(delay).map_err(|source| match watch.stopped() {
            Some(stop) => stop.into(),
            None => AgentError::Connect {
                path: self.vsock.clone(),
                source,
            },
        })
    }

    /// Connect and handshake once: None when the guest refused (nobody listens on the port).
    /// The vsock device is the one timeout here: it closes a connection that its guest has not
    /// answered within its handshake limit (after a transport reset's hold, if one is on), and
    /// a close that late means the guest never answered, not that it refused.
    fn try_connect(&self, watch: &Arc<Watch>) -> Result<Option<AgentStream>, AgentError> {
        let connect_err = |source| AgentError::Connect {
            path: self.vsock.clone(),
            source,
        };
        let stream = UnixStream::connect(&self.vsock).map_err(connect_err)?;
        let mut stream = AgentStream::new(stream, Arc::clone(watch)).map_err(connect_err)?;
        watch.set_step(Some(CONNECT_READ_TIMEOUT));
        let answered = self.handshake(&mut stream, watch);
        watch.set_step(None);
        Ok(answered?.then_some(stream))
    }

    /// `CONNECT <port>` and its `OK <host port>` line: false when the guest refused.
    fn handshake(&self, stream: &mut AgentStream, watch: &Watch) -> Result<bool, AgentError> {
        use std::io::ErrorKind;
        let connect_err = |source| AgentError::Connect {
            path: self.vsock.clone(),
            source,
        };
        let sent = Instant::now();
        let unanswered = || AgentError::HandshakeTimeout {
            waited: sent.elapsed(),
        };
        match stream.write_all(format!("CONNECT {}\n", self.port).as_bytes()) {
            Ok(()) => {}
            Err(_) if watch.stopped().is_some() => return Err(self.stopped(watch)),
            // The VMM closed the connection before we wrote (the guest refused it at once).
            Err(e) if matches!(e.kind(), ErrorKind::BrokenPipe | ErrorKind::ConnectionReset) => {
                return Ok(false)
            }
            Err(e) if e.kind() == ErrorKind::TimedOut => return Err(unanswered()),
            Err(e) => return Err(connect_err(e)),
        }
        let mut line = Vec::new();
        let mut byte = [0u8; 1];
        loop {
            match stream.read(&mut byte) {
                // Closed by the device at its handshake limit: the guest never answered.
                Ok(0) if closed_unanswered(sent.elapsed()) => return Err(unanswered()),
                Ok(0) => return Ok(false),
                Ok(_) if byte[0] == b'\n' => break,
                Ok(_) if line.len() < 32 => line.push(byte[0]),
                Ok(_) => {
                    return Err(AgentError::Handshake(
                        String::from_utf8_lossy(&line).into_owned(),
                    ))
                }
                Err(_) if watch.stopped().is_some() => return Err(self.stopped(watch)),
                // Refused or reset while the guest drops connections: not up yet.
                Err(e) if e.kind() == ErrorKind::ConnectionReset => return Ok(false),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return Err(unanswered())
                }
                Err(e) => return Err(connect_err(e)),
            }
        }
        let line = String::from_utf8_lossy(&line).into_owned();
        if !line.starts_with("OK ") {
            return Err(AgentError::Handshake(line));
        }
        Ok(true)
    }

    /// The watch's reason for ending the call (called once it has one).
    fn stopped(&self, watch: &Watch) -> AgentError {
        watch.stopped().map_or_else(
            || AgentError::Connect {
                path: self.vsock.clone(),
                source: std::io::ErrorKind::Other.into(),
            },
            AgentError::from,
        )
    }

    /// Connect for a command, `request`: its start and (with `timeout_ms`) its end bounded
    /// (see [`crate::guest::watch`]). Signal it through [`ExecCall::signaller`], run it with
    /// [`ExecCall::run`].
    pub fn exec_call(&self, request: &ExecRequest) -> Result<ExecCall, AgentError> {
        let watch = self.watch(Kind::Exec, "the command".into());
        let mut client = self.connect_watched(&watch)?;
        let signaller = client.signaller().map_err(|e| failure(&watch, e))?;
        watch.arm_exec(signaller.status(), request.timeout_ms);
        Ok(ExecCall {
            client,
            signaller,
            watch,
            request: request.clone(),
        })
    }

    /// Run a command, streaming its output; returns how it ended.
    pub fn exec<R: Read + Send + 'static>(
        &self,
        request: &ExecRequest,
        stdin: Option<R>,
        on_stdout: impl FnMut(&[u8]),
        on_stderr: impl FnMut(&[u8]),
    ) -> Result<ExitRecord, AgentError> {
        self.exec_call(request)?.run(stdin, on_stdout, on_stderr)
    }

    /// Run a command and collect its output (up to
    /// [`mayfly_agent_protocol::DEFAULT_OUTPUT_LIMIT`] of each stream; the rest is counted).
    pub fn exec_output(
        &self,
        request: &ExecRequest,
        stdin: Option<Vec<u8>>,
    ) -> Result<ExecOutput, AgentError> {
        self.exec_call(request)?.output(stdin)
    }

    pub fn write_file(
        &self,
        path: &str,
        options: &WriteFileOptions,
        data: impl Read,
    ) -> Result<u64, AgentError> {
        self.call(Kind::Transfer, format!("the upload to {path}"), |c| {
            c.write_file(path, options, data)
        })
    }

    pub fn read_file(&self, path: &str, out: impl Write) -> Result<u64, AgentError> {
        self.call(Kind::Transfer, format!("the download of {path}"), |c| {
            c.read_file(path, out)
        })
    }

    pub fn stat(&self, path: &str, follow: bool) -> Result<StatReply, AgentError> {
        self.call(Kind::Answer, format!("the stat of {path}"), |c| {
            c.stat(path, follow)
        })
    }

    /// The entries of directory `path`, sorted by name; a directory past
    /// [`ListLimits::default`] is an error ([`Agent::list_limited`] keeps part of it).
    pub fn list(&self, path: &str) -> Result<Vec<DirEntry>, AgentError> {
        self.call(Kind::Answer, format!("the listing of {path}"), |c| {
            c.list(path)
        })
    }

    /// The entries of directory `path` as far as `limits` keep them (marked truncated past
    /// them), sorted by name.
    pub fn list_limited(&self, path: &str, limits: ListLimits) -> Result<Listing, AgentError> {
        self.call(Kind::Answer, format!("the listing of {path}"), |c| {
            c.list_limited(path, limits)
        })
    }

    pub fn remove(&self, path: &str, recursive: bool) -> Result<(), AgentError> {
        self.call(Kind::Answer, format!("the removal of {path}"), |c| {
            c.remove(path, recursive)
        })
    }

    pub fn mkdir(&self, path: &str, mode: u32, parents: bool) -> Result<(), AgentError> {
        self.call(Kind::Answer, format!("the mkdir of {path}"), |c| {
            c.mkdir(path, mode, parents)
        })
    }

    pub fn ping(&self) -> Result<PingReply, AgentError> {
        self.call(Kind::Answer, "a ping".into(), AgentClient::ping)
    }

    pub fn identity(&self) -> Result<AgentIdentity, AgentError> {
        self.call(Kind::Answer, "the identity".into(), AgentClient::identity)
    }

    /// Tell the guest it was restored or forked (or booted): clock, entropy, name, hooks, and
    /// the MAC its NIC must have (`mac`, for a VM with a NIC). Once the agent answered, the
    /// refresh has [`REFRESH_TIMEOUT`] (or [`Agent::with_timeout`]) to finish.
    pub fn refresh(
        &self,
        event: RefreshEvent,
        identity: &Identity,
        mac: Option<[u8; 6]>,
    ) -> Result<RefreshReply, AgentError> {
        // Connected first: the clock is read at the last moment, since waiting for the agent
        // may take seconds.
        let watch = self.watch(Kind::Refresh, "the refresh".into());
        let client = self.connect_watched(&watch)?;
        watch.set_deadline(self.timeout.unwrap_or(REFRESH_TIMEOUT));
        mayfly_sys::trace::event("agent_connected");
        let mut entropy = [0u8; 64];
        crate::identity::host_random(&mut entropy).map_err(|source| AgentError::Connect {
            path: self.vsock.clone(),
            source,
        })?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
            .unwrap_or(0);
        let request = RefreshRequest::new(
            event,
            now,
            &entropy,
            hostname_for(&identity.name),
            AgentIdentity {
                name: identity.name.clone(),
                index: identity.index.map(u64::from),
                parent: identity.parent.clone(),
                generation: identity.generation,
            },
        );
        let request = match mac {
            Some(mac) => request.with_mac(mac),
            None => request,
        };
        let reply = client.refresh(&request).map_err(|e| failure(&watch, e))?;
        mayfly_sys::trace::event("agent_refreshed");
        Ok(reply)
    }
}

/// A command connected and about to run (see [`Agent::exec_call`]).
pub struct ExecCall {
    client: AgentClient<AgentStream>,
    signaller: Signaller,
    watch: Arc<Watch>,
    request: ExecRequest,
}

impl ExecCall {
    /// Signals the command once it runs (from another thread).
    pub fn signaller(&self) -> &Signaller {
        &self.signaller
    }

    /// Run the command, its output to `on_stdout` and `on_stderr` as it comes; returns how it
    /// ended, or why the VMM ended the call ([`AgentError::Stopped`]).
    pub fn run<R: Read + Send + 'static>(
        self,
        stdin: Option<R>,
        on_stdout: impl FnMut(&[u8]),
        on_stderr: impl FnMut(&[u8]),
    ) -> Result<ExitRecord, AgentError> {
        let watch = self.watch;
        self.client
            .exec(&self.request, stdin, on_stdout, on_stderr)
            .map_err(|e| failure(&watch, e))
    }

    /// Run the command and collect its output (bounded as [`AgentClient::exec_output`]).
    pub fn output(self, stdin: Option<Vec<u8>>) -> Result<ExecOutput, AgentError> {
        let watch = self.watch;
        self.client
            .exec_output(&self.request, stdin)
            .map_err(|e| failure(&watch, e))
    }
}

/// A DNS label for a VM name (names may hold '.' and '_', labels may not).
pub fn hostname_for(name: &str) -> String {
    let mut label: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .take(63)
        .collect();
    while label.ends_with('-') {
        label.pop();
    }
    let label = label.trim_start_matches('-').to_string();
    if label.is_empty() {
        "mayfly".to_string()
    } else {
        label
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostnames_are_dns_labels() {
        assert_eq!(hostname_for("web-3"), "web-3");
        assert_eq!(hostname_for("kid_0.a"), "kid-0-a");
        assert_eq!(hostname_for("---"), "mayfly");
        assert_eq!(hostname_for(&"x".repeat(80)).len(), 63);
        assert!(mayfly_agent_protocol::is_dns_label(&hostname_for("a.b_c-")));
    }

    #[test]
    fn every_kind_of_call_is_bounded() {
        let agent = Agent::new(Path::new("/nonexistent/vm.vsock"));
        let answer = agent.bounds(Kind::Answer);
        assert_eq!(answer.deadline, Some(DEFAULT_CALL_TIMEOUT));
        assert_eq!(answer.idle, Some(AGENT_IDLE_TIMEOUT));
        // A file of any size: no deadline of its own, but the agent may not go silent.
        let transfer = agent.bounds(Kind::Transfer);
        assert_eq!(transfer.deadline, None);
        assert_eq!(transfer.idle, Some(AGENT_IDLE_TIMEOUT));
        // A command is bounded by its own phases (start, timeout_ms + grace), armed later.
        assert_eq!(agent.bounds(Kind::Exec).idle, None);
        // What a caller asks for applies to every kind.
        let agent = agent.with_timeout(Duration::from_millis(1500));
        for kind in [
            Kind::Answer,
            Kind::Transfer,
            Kind::Exec,
            Kind::Refresh,
            Kind::Raw,
        ] {
            assert_eq!(
                agent.bounds(kind).deadline,
                Some(Duration::from_millis(1500)),
                "{kind:?}"
            );
        }
        assert!(DEFAULT_CALL_TIMEOUT <= MAX_CALL_TIMEOUT);
        assert!(
            EXEC_GRACE > Duration::from_secs(3),
            "the agent's SIGKILL and drain fit"
        );
    }

    #[test]
    fn a_silent_agent_gets_the_deadline_error() {
        // A stand-in that answers CONNECT and HELLO, then nothing.
        let dir = std::env::temp_dir().join(format!("mayfly-agent-silent-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("vm.vsock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                std::thread::spawn(move || {
                    let mut line = [0u8; 11];
                    let _ = stream.read_exact(&mut line);
                    let hello = mayfly_agent_protocol::Message::Hello(protocol::Hello {
                        protocol: protocol::PROTOCOL_VERSION,
                        agent: "silent".into(),
                        ops: vec![],
                    });
                    let _ = stream.write_all(b"OK 1024\n");
                    let _ = protocol::write_message(&mut stream, &hello);
                    let mut sink = Vec::new();
                    let _ = stream.read_to_end(&mut sink);
                });
            }
        });
        let err = Agent::new(&path)
            .with_timeout(Duration::from_millis(300))
            .stat("/etc", true)
            .unwrap_err();
        assert!(
            matches!(err, AgentError::Stopped(Stop::Deadline { .. })),
            "{err}"
        );
        assert!(
            err.to_string()
                .contains("did not finish the stat of /etc within 0.3 s"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_vm_without_a_socket_is_an_error_that_says_so() {
        let agent = Agent::new(Path::new("/nonexistent/vm.vsock")).with_wait(Duration::ZERO);
        let err = agent.ping().unwrap_err();
        assert!(matches!(err, AgentError::Connect { .. }), "{err}");
    }

    #[test]
    fn a_late_close_is_a_guest_that_never_answered_and_an_early_one_a_refusal() {
        // The device closes an unanswered connection at its handshake limit; a refusal comes
        // at once. The client waits longer than the device, so the device's close decides.
        let limit = mayfly_devices::virtio::vsock::HANDSHAKE_TIMEOUT;
        assert!(closed_unanswered(limit));
        assert!(closed_unanswered(limit + Duration::from_secs(5)));
        assert!(!closed_unanswered(Duration::from_millis(3)));
        assert!(CONNECT_READ_TIMEOUT > limit + mayfly_devices::virtio::vsock::RESET_HOLD_LIMIT);
        let err = AgentError::HandshakeTimeout {
            waited: Duration::from_millis(10_020),
        };
        assert!(
            err.to_string()
                .contains("did not answer CONNECT (10.0s waited)"),
            "{err}"
        );
    }

    #[test]
    fn an_agent_that_is_not_up_is_waited_for_then_reported() {
        // A vsock socket whose "guest" refuses every connection: closes at once.
        let dir = std::env::temp_dir().join(format!("mayfly-agent-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("vm.vsock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                drop(stream);
            }
        });
        let start = Instant::now();
        let err = Agent::new(&path)
            .with_wait(Duration::from_millis(300))
            .ping()
            .unwrap_err();
        assert!(matches!(err, AgentError::NotUp { .. }), "{err}");
        assert!(start.elapsed() >= Duration::from_millis(300));
        assert!(err.to_string().contains("mayfly-agent"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
