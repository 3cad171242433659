//! Ports that outlive sleep: a guest port exposed on the host by the manager, not by the VMM.
//!
//! `POST /sandboxes/NAME/ports {"guest_port": 8080}` makes a host listener (loopback TCP, a
//! free port unless one is asked for, or a Unix socket) that the manager keeps: its record
//! says so, so the listener is there across the sandbox's sleeps and wakes and the manager's
//! restarts. Each connection to it:
//!
//! 1. is activity of the sandbox ([`Manager::enter_connection`]): a sleeping sandbox is
//!    woken, and one with a connection open does not go idle; but it is not an API request,
//!    so connections never crowd out the sandbox's own API (its cap of requests at once);
//! 2. reaches the guest through its VMM's side of the network: a Unix socket in the
//!    sandbox's `sock/` directory (`port-N.sock`) that the VMM (unjailed) or its jail's
//!    waiter (jailed) forwards into the VM's namespace (`PUT /vm/net/expose`), asked for
//!    again after every wake (a new VMM, a new namespace);
//! 3. is relayed both ways until either side closes.
//!
//! Bounds: at most [`MAX_PORTS`] ports per sandbox, [`MAX_CONNECTIONS`] connections at once
//! per port and [`MAX_SANDBOX_CONNECTIONS`] across a sandbox's ports (more are closed at
//! once: each holds two relay threads); a guest that never answers costs a connection its
//! [`GUEST_CONNECT`] wait, not the listener. A listener whose sandbox is gone (deleted,
//! expired) ends within a second.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use serde_json::{json, Value};

use crate::error::ServeError;
use crate::listeners::Listening;
use crate::manager::Manager;
use crate::records::PortRecord;
use crate::sandbox::Sandbox;
use crate::util::lock;

/// Ports exposed per sandbox.
pub const MAX_PORTS: usize = 16;
/// Connections at once per exposed port.
pub const MAX_CONNECTIONS: usize = 64;
/// Connections at once across all of one sandbox's ports.
pub const MAX_SANDBOX_CONNECTIONS: usize = 128;
/// How long a connection waits for the VMM's side to take it.
const GUEST_CONNECT: Duration = Duration::from_secs(10);
/// How long a closed port waits for the VMM's side to stop forwarding it.
const UNEXPOSE_WAIT: Duration = Duration::from_secs(2);
/// How often a listener looks whether its sandbox is still there.
const LOOK_EVERY: Duration = Duration::from_secs(1);

enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

impl Listener {
    fn fd(&self) -> BorrowedFd<'_> {
        match self {
            Listener::Tcp(l) => l.as_fd(),
            Listener::Unix(l) => l.as_fd(),
        }
    }

    fn accept(&self) -> std::io::Result<Stream> {
        match self {
            Listener::Tcp(l) => l.accept().map(|(s, _)| Stream::Tcp(s)),
            Listener::Unix(l) => l.accept().map(|(s, _)| Stream::Unix(s)),
        }
    }
}

enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    fn try_clone(&self) -> std::io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
        })
    }

    fn shutdown(&self, how: Shutdown) {
        let _ = match self {
            Stream::Tcp(s) => s.shutdown(how),
            Stream::Unix(s) => s.shutdown(how),
        };
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Where a new listener goes: `tcp:ADDR:PORT` on a loopback address (port 0: a free one), or
/// `unix:PATH` (absolute, not there yet, in a directory that is).
fn parse_host(host: &str) -> Result<HostAddr, ServeError> {
    let bad = |why: &str| {
        ServeError::BadRequest(format!(
            "\"host\": {host:?} {why}: give tcp:127.0.0.1:PORT (0, or leave \"host\" out, for a \
             free port) or unix:/absolute/path"
        ))
    };
    if let Some(addr) = host.strip_prefix("tcp:") {
        let addr: SocketAddr = addr
            .parse()
            .map_err(|_| bad("is not an address and port"))?;
        if !addr.ip().is_loopback() {
            return Err(bad(
                "is not a loopback address (a port the manager exposes is for this host only)",
            ));
        }
        return Ok(HostAddr::Tcp(addr));
    }
    if let Some(path) = host.strip_prefix("unix:") {
        let path = PathBuf::from(path);
        if !path.is_absolute() || path.components().any(|c| c.as_os_str() == "..") {
            return Err(bad("is not an absolute path"));
        }
        if path.as_os_str().len() > mayfly_sys::socket::MAX_SOCKET_PATH {
            return Err(bad("is longer than a Unix socket path may be"));
        }
        return Ok(HostAddr::Unix(path));
    }
    Err(bad("says neither tcp: nor unix:"))
}

enum HostAddr {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

fn bind(addr: &HostAddr) -> Result<(Listener, String, Option<PathBuf>), ServeError> {
    let taken = |e: std::io::Error| {
        ServeError::Conflict(format!(
            "cannot listen on {}: {e} (the address is taken, or not this host's): pick \
             another, or leave \"host\" out for a free loopback port",
            match addr {
                HostAddr::Tcp(a) => format!("tcp:{a}"),
                HostAddr::Unix(p) => format!("unix:{}", p.display()),
            }
        ))
    };
    match addr {
        HostAddr::Tcp(a) => {
            let l = TcpListener::bind(a).map_err(taken)?;
            let at = l.local_addr().map_err(taken)?;
            Ok((Listener::Tcp(l), format!("tcp:{at}"), None))
        }
        HostAddr::Unix(p) => {
            clear_stale_socket(p);
            let l = UnixListener::bind(p).map_err(taken)?;
            Ok((
                Listener::Unix(l),
                format!("unix:{}", p.display()),
                Some(p.clone()),
            ))
        }
    }
}

/// Remove a socket file at `path` that nobody listens on (a manager that ended left it):
/// never a file of another kind, nor a socket something answers on.
fn clear_stale_socket(path: &Path) {
    use std::os::unix::fs::FileTypeExt;
    let is_socket = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket());
    if is_socket
        && UnixStream::connect(path)
            .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionRefused)
    {
        let _ = std::fs::remove_file(path);
    }
}

/// Whether a sandbox of `spec` has no NIC for certain (a boot or template without a network,
/// or a policy of none given to a boot).
fn has_no_nic(sandbox: &Sandbox) -> bool {
    let spec = sandbox.spec();
    let named = spec.net.as_deref();
    match &spec.template {
        Some(template) => !template.has_nic(),
        None if spec.snapshot.is_some() => false,
        None => named.is_none_or(|n| n == "none"),
    }
}

impl Manager {
    /// Expose `guest_port` of `sandbox` on the host at `host` (default: a free loopback TCP
    /// port); what `POST /sandboxes/NAME/ports` answers.
    pub(crate) fn open_port(
        &self,
        sandbox: &Sandbox,
        guest_port: u16,
        host: Option<&str>,
    ) -> Result<Value, ServeError> {
        if guest_port == 0 {
            return Err(ServeError::BadRequest(
                "\"guest_port\" must be 1 to 65535".into(),
            ));
        }
        let addr = parse_host(host.unwrap_or("tcp:127.0.0.1:0"))?;
        if has_no_nic(sandbox) {
            return Err(ServeError::Conflict(format!(
                "sandbox {} has no NIC, so no port of its guest can be reached: make it with \
                 \"net\" (or from a template with one)",
                sandbox.name
            )));
        }
        // Under the sandbox's lock: its record changes, and a delete waits.
        let mut inner = lock(&sandbox.inner);
        if inner
            .record
            .ports
            .iter()
            .any(|p| p.guest_port == guest_port)
        {
            return Err(ServeError::Conflict(format!(
                "guest port {guest_port} of {} is exposed already: GET \
                 /sandboxes/{}/ports says where, DELETE .../ports/{guest_port} ends it",
                sandbox.name, sandbox.name
            )));
        }
        if inner.record.ports.len() >= MAX_PORTS {
            return Err(ServeError::Conflict(format!(
                "sandbox {} exposes {MAX_PORTS} ports, the most one may: end one first",
                sandbox.name
            )));
        }
        let host = self.listen(sandbox, guest_port, &addr)?;
        inner.record.ports.push(PortRecord {
            guest_port,
            host: host.clone(),
        });
        if let Err(e) = sandbox.save(&inner) {
            inner.record.ports.retain(|p| p.guest_port != guest_port);
            self.ports.remove(&sandbox.name, guest_port);
            // The view as it was (a save sets it before it writes).
            let _ = sandbox.save(&inner);
            return Err(e);
        }
        drop(inner);
        self.event(
            "port_opened",
            &sandbox.name,
            json!({ "guest_port": guest_port, "host": host }),
        );
        Ok(json!({ "guest_port": guest_port, "host": host }))
    }

    /// The ports `sandbox` has exposed: what `GET /sandboxes/NAME/ports` answers.
    pub(crate) fn list_ports(&self, sandbox: &Sandbox) -> Value {
        let ports: Vec<Value> = lock(&sandbox.view)
            .ports
            .iter()
            .map(|p| {
                let connections = self.ports.connections(&sandbox.name, p.guest_port);
                json!({
                    "guest_port": p.guest_port,
                    "host": p.host,
                    "listening": connections.is_some(),
                    "connections": connections.unwrap_or(0),
                })
            })
            .collect();
        json!({ "name": sandbox.name, "ports": ports })
    }

    /// Stop exposing `guest_port` of `sandbox`.
    pub(crate) fn close_port(&self, sandbox: &Sandbox, guest_port: u16) -> Result<(), ServeError> {
        let mut inner = lock(&sandbox.inner);
        let Some(at) = inner
            .record
            .ports
            .iter()
            .position(|p| p.guest_port == guest_port)
        else {
            return Err(ServeError::NotFound(format!(
                "guest port {guest_port} of {} is not exposed: GET /sandboxes/{}/ports lists \
                 those that are",
                sandbox.name, sandbox.name
            )));
        };
        let port = inner.record.ports.remove(at);
        if let Err(e) = sandbox.save(&inner) {
            // Still exposed, as its listener still runs: the record and view say so again.
            inner.record.ports.insert(at, port);
            let _ = sandbox.save(&inner);
            return Err(e);
        }
        let running = inner.vmm.is_some();
        drop(inner);
        // The VMM's side stops forwarding too (its socket removed): a running VMM that
        // forwarded this port would otherwise keep doing so until it ended. A sleeping one has
        // nothing to stop. Done holding the port's gate, marked closed: a connection accepted
        // before the listener stopped (waking its sandbox, say) does not expose it again.
        let vmm_side = match self.ports.remove(&sandbox.name, guest_port) {
            Some(gate) => {
                let mut closed = lock(&gate);
                *closed = true;
                if running {
                    unexpose(sandbox, guest_port)
                } else {
                    "asleep: nothing forwards it".to_string()
                }
            }
            None => "no listener".to_string(),
        };
        self.event(
            "port_closed",
            &sandbox.name,
            json!({ "guest_port": guest_port, "vmm_side": vmm_side }),
        );
        Ok(())
    }

    /// At a start: listen again on every port the sandboxes' records expose. One whose
    /// address cannot be had again (taken meanwhile) is said in an event and listed with
    /// `"listening": false`.
    pub(crate) fn reopen_ports(&self) {
        for sandbox in self.all() {
            let ports = lock(&sandbox.view).ports.clone();
            for port in ports {
                let reopened = parse_host(&port.host)
                    .and_then(|addr| self.listen(&sandbox, port.guest_port, &addr));
                if let Err(e) = reopened {
                    self.event(
                        "port_not_reopened",
                        &sandbox.name,
                        json!({ "guest_port": port.guest_port, "host": port.host, "error": e.to_string() }),
                    );
                }
            }
        }
    }

    /// Bind `addr` and start its listener's thread; where it listens.
    fn listen(
        &self,
        sandbox: &Sandbox,
        guest_port: u16,
        addr: &HostAddr,
    ) -> Result<String, ServeError> {
        let name = &sandbox.name;
        // The listener serves this sandbox, not another made later under its name.
        let created_ms = lock(&sandbox.view).created_ms;
        let me = self.me.get().cloned().ok_or_else(|| {
            ServeError::Conflict("this manager does not serve ports (it is not serving)".into())
        })?;
        let (listener, host, unix_path) = bind(addr)?;
        let (stop, stopped) = UnixStream::pair().map_err(|source| ServeError::Io {
            what: "make",
            path: "a socket pair for a port's listener".into(),
            source,
        })?;
        let exposing: Arc<Mutex<bool>> = Arc::default();
        let target = Target {
            name: name.clone(),
            created_ms,
            guest_port,
            exposing: Arc::clone(&exposing),
        };
        let open = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&open);
        let started = std::thread::Builder::new()
            .name("port".into())
            .stack_size(mayfly_sys::HELPER_THREAD_STACK)
            .spawn(move || listen_loop(&me, &target, &listener, &stopped, &counted));
        if let Err(source) = started {
            if let Some(path) = &unix_path {
                let _ = std::fs::remove_file(path);
            }
            return Err(ServeError::Io {
                what: "start",
                path: "a port's listener thread".into(),
                source,
            });
        }
        let listening = Listening {
            unix_path,
            stop,
            open,
            exposing,
        };
        if !self.ports.insert(name, guest_port, listening) {
            return Err(ServeError::Conflict(format!(
                "guest port {guest_port} of {name} is exposed already"
            )));
        }
        Ok(host)
    }
}

/// What a listener's connections go to.
#[derive(Clone)]
struct Target {
    name: String,
    /// Its sandbox's `created_ms`: a sandbox made later under the same name is another.
    created_ms: u64,
    guest_port: u16,
    /// One exposure at a time for this port: after a wake, two connections would otherwise
    /// both ask the VMM's side to expose it, or remove each other's socket. True once the
    /// port is closed: a connection accepted before then does not expose it again.
    exposing: Arc<Mutex<bool>>,
}

impl Target {
    /// Its sandbox, if it is still there (the same one).
    fn sandbox(&self, manager: &Manager) -> Option<Arc<Sandbox>> {
        manager
            .get(&self.name)
            .filter(|s| lock(&s.view).created_ms == self.created_ms)
    }
}

/// A listener's thread: accept until stopped (the other end of `stopped` closes) or the
/// sandbox is gone, each connection on a thread of its own.
fn listen_loop(
    manager: &Weak<Manager>,
    target: &Target,
    listener: &Listener,
    stopped: &UnixStream,
    open: &Arc<AtomicUsize>,
) {
    use nix::poll::{poll, PollFd, PollFlags};
    let timeout = i32::try_from(LOOK_EVERY.as_millis()).unwrap_or(1000);
    let listening = listener.fd();
    loop {
        let mut fds = [
            PollFd::new(&listening, PollFlags::POLLIN),
            PollFd::new(stopped, PollFlags::POLLIN),
        ];
        let ready = poll(&mut fds, timeout);
        if fds[1].revents().is_some_and(|r| !r.is_empty()) {
            return;
        }
        let Some(manager) = manager.upgrade() else {
            return;
        };
        let Some(sandbox) = target.sandbox(&manager) else {
            // Deleted or expired (its delete stops it too): its listener goes with it.
            return;
        };
        if !matches!(ready, Ok(n) if n > 0) {
            continue;
        }
        let Ok(client) = listener.accept() else {
            // Out of descriptors, most likely: let the moment pass rather than spin.
            std::thread::sleep(Duration::from_millis(50));
            continue;
        };
        if open.load(Ordering::SeqCst) >= MAX_CONNECTIONS
            || sandbox.connections.load(Ordering::SeqCst) >= MAX_SANDBOX_CONNECTIONS
        {
            client.shutdown(Shutdown::Both);
            continue;
        }
        let counted = Counted::take(open, sandbox);
        let target = target.clone();
        let relaying = std::thread::Builder::new()
            .name("port-conn".into())
            .stack_size(mayfly_sys::HELPER_THREAD_STACK)
            .spawn(move || {
                let _counted = counted;
                relay(&manager, &target, client);
            });
        // Not started: the closure, and the client and the counts with it, is dropped (it
        // sees its connection close; the counts are given back).
        drop(relaying);
    }
}

/// One connection counted, on its port and on its sandbox, until dropped.
struct Counted {
    port: Arc<AtomicUsize>,
    sandbox: Arc<Sandbox>,
}

impl Counted {
    fn take(port: &Arc<AtomicUsize>, sandbox: Arc<Sandbox>) -> Counted {
        port.fetch_add(1, Ordering::SeqCst);
        sandbox.connections.fetch_add(1, Ordering::SeqCst);
        Counted {
            port: Arc::clone(port),
            sandbox,
        }
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.port.fetch_sub(1, Ordering::SeqCst);
        self.sandbox.connections.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One connection: wake the sandbox, reach its guest's port, relay both ways.
fn relay(manager: &Manager, target: &Target, client: Stream) {
    let Some(sandbox) = target.sandbox(manager) else {
        return;
    };
    let unreachable = |error: String| {
        manager.event(
            "port_unreachable",
            &target.name,
            json!({ "guest_port": target.guest_port, "error": error }),
        );
    };
    // The VMM's socket it answers is the sandbox's own (see network_side).
    let (_activity, _) = match manager.enter_connection(&sandbox) {
        Ok(entered) => entered,
        Err(e) => return unreachable(e.to_string()),
    };
    let upstream = match guest_stream(&sandbox, target) {
        Ok(s) => s,
        Err(e) => return unreachable(e),
    };
    let upstream = Stream::Unix(upstream);
    let (Ok(client_in), Ok(upstream_out)) = (client.try_clone(), upstream.try_clone()) else {
        return;
    };
    std::thread::scope(|scope| {
        scope.spawn(|| pump(client_in, upstream_out));
        pump(upstream, client);
    });
}

/// Copy `from` into `to` until `from` ends, then end `to`'s writing and `from`'s reading.
fn pump(mut from: Stream, mut to: Stream) {
    let _ = std::io::copy(&mut from, &mut to);
    to.shutdown(Shutdown::Write);
    from.shutdown(Shutdown::Read);
}

/// A connection to `guest_port` of the sandbox's guest, through the Unix socket its VMM's
/// side forwards: exposed now if it is not yet (after a wake: a new VMM).
fn guest_stream(sandbox: &Sandbox, target: &Target) -> Result<UnixStream, String> {
    let guest_port = target.guest_port;
    let path = port_socket(sandbox, guest_port);
    if let Ok(s) = UnixStream::connect(&path) {
        return Ok(s);
    }
    let closed = lock(&target.exposing);
    if *closed {
        return Err(format!("guest port {guest_port} was closed"));
    }
    if let Ok(s) = UnixStream::connect(&path) {
        return Ok(s);
    }
    // A socket an earlier VMM bound (it died, or slept) and nobody serves now.
    let _ = std::fs::remove_file(&path);
    let target = network_side(sandbox);
    let body = json!({ "port": guest_port, "on": format!("unix:{}", path.display()) });
    match mayfly_api::request_with_timeout(
        &target,
        "PUT",
        "/vm/net/expose",
        Some(&body),
        GUEST_CONNECT,
    ) {
        Ok((200, _)) => {}
        Ok((status, body)) => {
            return Err(format!(
                "the VMM's side answered {status} to exposing the port: {body}"
            ))
        }
        Err(e) => return Err(format!("the VMM's side did not answer: {e}")),
    }
    UnixStream::connect(&path).map_err(|e| format!("cannot connect to {}: {e}", path.display()))
}

/// Ask the VMM's side (its jail's waiter, for a jailed sandbox) to stop forwarding
/// `guest_port`, best effort: a VMM that does not answer in time keeps a forwarder nobody
/// reaches (its socket is removed here) until it ends. What it answered, in words.
fn unexpose(sandbox: &Sandbox, guest_port: u16) -> String {
    let target = network_side(sandbox);
    // Only the manager's own endpoint: one the admin exposed at another (`.../vm/net/expose`)
    // stays.
    let path = port_socket(sandbox, guest_port);
    let body = json!({ "port": guest_port, "on": format!("unix:{}", path.display()) });
    let answer = mayfly_api::request_with_timeout(
        &target,
        "PUT",
        "/vm/net/unexpose",
        Some(&body),
        UNEXPOSE_WAIT,
    );
    let _ = std::fs::remove_file(&path);
    match answer {
        Ok((200, _)) => "stopped".into(),
        // Never exposed by this VMM (no connection asked since its start), or no NIC.
        Ok((status, body)) => {
            let said: String = body["error"]
                .as_str()
                .unwrap_or_default()
                .chars()
                .take(200)
                .collect();
            format!("answered {status}: {said}")
        }
        Err(e) => format!("did not answer: {e}"),
    }
}

/// Where `sandbox`'s ports are exposed and unexposed: a jailed sandbox's network is kept by
/// its jail's waiter (its `.net` socket), an unjailed one's by its VMM.
fn network_side(sandbox: &Sandbox) -> PathBuf {
    let sock = sandbox.socket();
    if sandbox.jailed() {
        mayfly_api::network_socket(&sock)
    } else {
        sock
    }
}

/// The Unix socket the VMM's side forwards `guest_port` from: in the sandbox's `sock/`.
fn port_socket(sandbox: &Sandbox, guest_port: u16) -> PathBuf {
    sandbox
        .socket()
        .with_file_name(format!("port-{guest_port}.sock"))
}
