//! The guest agent (`mayfly-agent`, see agent/guest and agent/PROTOCOL.md) from the host: one
//! vsock connection per operation, through the VM's vsock socket (`CONNECT <port>\n`, answered
//! `OK <host port>\n`). This is the library API that platforms embedding mayfly use, and what
//! `mayfly exec`, `mayfly cp` and the control socket's exec and file routes are built on.
//!
//! After every restore and in every clone, the VMM refreshes the guest through the agent
//! ([`crate::guest::refresh::spawn_refresh`]): wall clock from the host, fresh entropy, hostname, identity, and the
//! guest's own hook scripts. Requests that go through the control socket wait for it.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use std::time::{Duration, Instant};

pub use mayfly_agent_protocol as protocol;
use mayfly_agent_protocol::{
    AgentClient, DirEntry, ExecOutput, ExecRequest, ExitRecord, Identity as AgentIdentity,
    PingReply, RefreshEvent, RefreshReply, RefreshRequest, StatReply, WriteFileOptions,
    DEFAULT_VSOCK_PORT,
};

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
    #[error("the VM is paused, so its agent cannot answer: resume it first (mayfly resume --sock {})", .0.display())]
    Paused(PathBuf),
    #[error(transparent)]
    Api(#[from] mayfly_api::ApiError),
    #[error("the VM's control socket answered HTTP {status}: {message}")]
    ApiStatus { status: u16, message: String },
}

/// The agent of one VM.
#[derive(Clone, Debug)]
pub struct Agent {
    vsock: PathBuf,
    port: u32,
    wait: Duration,
}

impl Agent {
    /// The agent behind the vsock socket `vsock`, on its default port.
    pub fn new(vsock: &Path) -> Self {
        Self {
            vsock: vsock.to_path_buf(),
            port: DEFAULT_VSOCK_PORT,
            wait: DEFAULT_WAIT,
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

    /// One connection to the agent, its HELLO checked. A guest that does not listen yet closes
    /// the connection without an answer: this retries until the wait is over.
    pub fn connect(&self) -> Result<AgentClient<UnixStream>, AgentError> {
        let start = Instant::now();
        let mut delay = Duration::from_millis(2);
        loop {
            match self.try_connect()? {
                Some(stream) => {
                    // The agent greets at once. A connection that closes or stays silent was
                    // cut on the guest's side (say, by a restore's transport reset): try
                    // again, backing off as for a refusal.
                    stream
                        .set_read_timeout(Some(HANDSHAKE_TIMEOUT))
                        .map_err(|source| AgentError::Connect {
                            path: self.vsock.clone(),
                            source,
                        })?;
                    let mut client = AgentClient::new(stream);
                    match client.hello() {
                        Ok(_) => {}
                        Err(mayfly_agent_protocol::Error::Protocol(_))
                        | Err(mayfly_agent_protocol::Error::Io(_))
                            if start.elapsed() < self.wait =>
                        {
                            mayfly_sys::trace::event("agent_hello_lost");
                            std::thread::sleep(delay);
                            delay = (delay * 2).min(Duration::from_millis(100));
                            continue;
                        }
                        Err(e) => return Err(e.into()),
                    }
                    client.get_ref().set_read_timeout(None).map_err(|source| {
                        AgentError::Connect {
                            path: self.vsock.clone(),
                            source,
                        }
                    })?;
                    return Ok(client);
                }
                None if start.elapsed() >= self.wait => {
                    return Err(AgentError::NotUp {
                        port: self.port,
                        waited: self.wait,
                    })
                }
                None => {
                    mayfly_sys::trace::event("agent_connect_refused");
                    std::thread::sleep(delay);
                    delay = (delay * 2).min(Duration::from_millis(100));
                }
            }
        }
    }

    /// Connect and handshake once: None when the guest refused (nobody listens on the port).
    /// The vsock device is the one timeout here: it closes a connection that its guest has not
    /// answered within its handshake limit (after a transport reset's hold, if one is on), and
    /// a close that late means the guest never answered, not that it refused.
    fn try_connect(&self) -> Result<Option<UnixStream>, AgentError> {
        let connect_err = |source| AgentError::Connect {
            path: self.vsock.clone(),
            source,
        };
        let mut stream = UnixStream::connect(&self.vsock).map_err(connect_err)?;
        match stream.write_all(format!("CONNECT {}\n", self.port).as_bytes()) {
            Ok(()) => {}
            // The VMM closed the connection before we wrote (the guest refused it at once).
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
                ) =>
            {
                return Ok(None)
            }
            Err(e) => return Err(connect_err(e)),
        }
        let sent = Instant::now();
        stream
            .set_read_timeout(Some(CONNECT_READ_TIMEOUT))
            .map_err(connect_err)?;
        let unanswered = || AgentError::HandshakeTimeout {
            waited: sent.elapsed(),
        };
        let mut line = Vec::new();
        let mut byte = [0u8; 1];
        loop {
            match stream.read(&mut byte) {
                // Closed by the device at its handshake limit: the guest never answered.
                Ok(0) if closed_unanswered(sent.elapsed()) => return Err(unanswered()),
                Ok(0) => return Ok(None),
                Ok(_) if byte[0] == b'\n' => break,
                Ok(_) if line.len() < 32 => line.push(byte[0]),
                Ok(_) => {
                    return Err(AgentError::Handshake(
                        String::from_utf8_lossy(&line).into_owned(),
                    ))
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                // Refused or reset while the guest drops connections: not up yet.
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Ok(None),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return Err(unanswered())
                }
                Err(e) => return Err(connect_err(e)),
            }
        }
        let line = String::from_utf8_lossy(&line).into_owned();
        if !line.starts_with("OK ") {
            return Err(AgentError::Handshake(line));
        }
        Ok(Some(stream))
    }

    /// Run a command, streaming its output; returns how it ended.
    pub fn exec<R: Read + Send + 'static>(
        &self,
        request: &ExecRequest,
        stdin: Option<R>,
        on_stdout: impl FnMut(&[u8]),
        on_stderr: impl FnMut(&[u8]),
    ) -> Result<ExitRecord, AgentError> {
        Ok(self.connect()?.exec(request, stdin, on_stdout, on_stderr)?)
    }

    /// Run a command and collect its output.
    pub fn exec_output(
        &self,
        request: &ExecRequest,
        stdin: Option<Vec<u8>>,
    ) -> Result<ExecOutput, AgentError> {
        Ok(self.connect()?.exec_output(request, stdin)?)
    }

    pub fn write_file(
        &self,
        path: &str,
        options: &WriteFileOptions,
        data: impl Read,
    ) -> Result<u64, AgentError> {
        Ok(self.connect()?.write_file(path, options, data)?)
    }

    pub fn read_file(&self, path: &str, out: impl Write) -> Result<u64, AgentError> {
        Ok(self.connect()?.read_file(path, out)?)
    }

    pub fn stat(&self, path: &str, follow: bool) -> Result<StatReply, AgentError> {
        Ok(self.connect()?.stat(path, follow)?)
    }

    pub fn list(&self, path: &str) -> Result<Vec<DirEntry>, AgentError> {
        Ok(self.connect()?.list(path)?)
    }

    pub fn remove(&self, path: &str, recursive: bool) -> Result<(), AgentError> {
        Ok(self.connect()?.remove(path, recursive)?)
    }

    pub fn mkdir(&self, path: &str, mode: u32, parents: bool) -> Result<(), AgentError> {
        Ok(self.connect()?.mkdir(path, mode, parents)?)
    }

    pub fn ping(&self) -> Result<PingReply, AgentError> {
        Ok(self.connect()?.ping()?)
    }

    pub fn identity(&self) -> Result<AgentIdentity, AgentError> {
        Ok(self.connect()?.identity()?)
    }

    /// Tell the guest it was restored or forked (or booted): clock, entropy, name, hooks, and
    /// the MAC its NIC must have (`mac`, for a VM with a NIC).
    pub fn refresh(
        &self,
        event: RefreshEvent,
        identity: &Identity,
        mac: Option<[u8; 6]>,
    ) -> Result<RefreshReply, AgentError> {
        // Connected first: the clock is read at the last moment, since waiting for the agent
        // may take seconds.
        let client = self.connect()?;
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
        let reply = client.refresh(&request)?;
        mayfly_sys::trace::event("agent_refreshed");
        Ok(reply)
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
