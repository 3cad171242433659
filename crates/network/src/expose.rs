//! Exposing a guest port on the host: a listener on the host side (a loopback TCP port or a
//! Unix socket) whose connections a forwarding thread inside the VM's namespace passes on to
//! `guest_ip:port`.
//!
//! A forwarder in the VMM process rather than a DNAT rule: it needs no host-side rules or
//! `route_localnet` (nothing on the host to clean up if the VMM is killed: the listener and the
//! threads die with it), works for Unix sockets too, and reaches the guest from inside its
//! namespace, where the guest's fixed address is the same for every clone.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Where the host end of an exposed port listens.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExposeOn {
    /// A TCP address on the host (use a loopback one; port 0 picks a free port).
    Tcp(SocketAddr),
    /// A Unix socket at this path (which must not exist yet).
    Unix(PathBuf),
}

/// Where the host end of an exposed port is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum HostEndpoint {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    fn try_clone(&self) -> io::Result<Stream> {
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
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Copy one way until EOF or an error, then pass the end on.
fn pump(mut from: Stream, mut to: Stream) {
    let _ = io::copy(&mut from, &mut to);
    to.shutdown(Shutdown::Write);
    from.shutdown(Shutdown::Read);
}

pub(crate) struct Forwarder {
    pub(crate) guest_port: u16,
    pub(crate) endpoint: HostEndpoint,
    stop: Arc<AtomicBool>,
    listener_fd: RawFd,
    /// Keeps the listener open until the accept thread is gone.
    _listener: Arc<Listener>,
    conns: Arc<Conns>,
    thread: Option<JoinHandle<()>>,
}

/// Open connections (a clone of each end), to cut them when the forwarder stops; a
/// connection leaves once both directions are done.
#[derive(Default)]
struct Conns {
    next: std::sync::atomic::AtomicU64,
    open: Mutex<std::collections::HashMap<u64, (Stream, Stream)>>,
}

impl Conns {
    fn open(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<u64, (Stream, Stream)>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Forwarder {
    /// Listen on `on` (in the caller's namespace), forward to `guest` from inside `ns`.
    pub(crate) fn start(
        ns: std::fs::File,
        guest: SocketAddrV4,
        on: &ExposeOn,
    ) -> io::Result<Forwarder> {
        let (listener, endpoint) = match on {
            ExposeOn::Tcp(addr) => {
                let l = TcpListener::bind(addr)?;
                let at = l.local_addr()?;
                (Listener::Tcp(l), HostEndpoint::Tcp(at))
            }
            ExposeOn::Unix(path) => {
                let l = UnixListener::bind(path)?;
                (Listener::Unix(l), HostEndpoint::Unix(path.clone()))
            }
        };
        let listener = Arc::new(listener);
        let listener_fd = match &*listener {
            Listener::Tcp(l) => l.as_raw_fd(),
            Listener::Unix(l) => l.as_raw_fd(),
        };
        let stop = Arc::new(AtomicBool::new(false));
        let conns: Arc<Conns> = Arc::default();
        let thread = {
            let (listener, stop, conns) = (listener.clone(), stop.clone(), conns.clone());
            std::thread::Builder::new()
                .name(format!("mayfly-expose-{}", guest.port()))
                .spawn(move || {
                    // Connections to the guest are made from inside its namespace.
                    if crate::netns::setns(ns.as_raw_fd()).is_err() {
                        return;
                    }
                    drop(ns);
                    accept_loop(&listener, guest, &stop, &conns);
                })?
        };
        Ok(Forwarder {
            guest_port: guest.port(),
            endpoint,
            stop,
            listener_fd,
            _listener: listener,
            conns,
            thread: Some(thread),
        })
    }

    pub(crate) fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // SAFETY: shutdown on the listener's descriptor (kept open by `_listener`) wakes the
        // thread blocked in accept.
        unsafe { libc::shutdown(self.listener_fd, libc::SHUT_RDWR) };
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        for (_, (a, b)) in self.conns.open().drain() {
            a.shutdown(Shutdown::Both);
            b.shutdown(Shutdown::Both);
        }
        if let HostEndpoint::Unix(path) = &self.endpoint {
            let _ = std::fs::remove_file(path);
        }
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Connections one forwarder serves at once (waiting for the guest or relaying); more are
/// closed as they come. Each holds two threads.
const MAX_CONNECTIONS: usize = 256;
/// How long a connection waits for the guest to accept it.
const GUEST_CONNECT: Duration = Duration::from_secs(5);

/// One connection counted from its accept until both directions are done.
struct Live(Arc<AtomicUsize>);

impl Drop for Live {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn accept_loop(
    listener: &Listener,
    guest: SocketAddrV4,
    stop: &Arc<AtomicBool>,
    conns: &Arc<Conns>,
) {
    let live = Arc::new(AtomicUsize::new(0));
    while !stop.load(Ordering::SeqCst) {
        let client = match listener {
            Listener::Tcp(l) => l.accept().map(|(s, _)| Stream::Tcp(s)),
            Listener::Unix(l) => l.accept().map(|(s, _)| Stream::Unix(s)),
        };
        let client = match client {
            Ok(c) => c,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            // Shut down (stop), or out of descriptors: wait a little rather than spin.
            Err(_) => {
                if stop.load(Ordering::SeqCst) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        if live.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
            live.fetch_sub(1, Ordering::SeqCst);
            continue;
        }
        let counted = Live(live.clone());
        // The guest may take its time to accept, or never: each connection waits in a thread
        // of its own (in this one's namespace, as threads it starts are), so neither the
        // listener nor a stop waits for it (it did: one guest that never answered held every
        // later connection, and its forwarder's stop, for 5 s each).
        let (stop, conns) = (stop.clone(), conns.clone());
        let _ = std::thread::Builder::new()
            .name(format!("mayfly-expose-{}", guest.port()))
            .stack_size(mayfly_sys::HELPER_THREAD_STACK)
            .spawn(move || {
                let _counted = counted;
                connect_and_relay(client, guest, &stop, &conns);
            });
    }
}

/// Connect `client` to the guest and relay both ways until either side is done.
fn connect_and_relay(client: Stream, guest: SocketAddrV4, stop: &AtomicBool, conns: &Conns) {
    let upstream = match TcpStream::connect_timeout(&SocketAddr::V4(guest), GUEST_CONNECT) {
        Ok(s) => Stream::Tcp(s),
        // The guest does not listen (yet): the client sees its connection close.
        Err(_) => return,
    };
    let pair = (|| -> io::Result<_> {
        Ok((
            client.try_clone()?,
            upstream.try_clone()?,
            client.try_clone()?,
            upstream.try_clone()?,
        ))
    })();
    let Ok((c2, u2, c3, u3)) = pair else {
        return;
    };
    let id = conns.next.fetch_add(1, Ordering::SeqCst);
    conns.open().insert(id, (c3, u3));
    // Stopped while this connection was made: cut it (the stop may have drained the open
    // connections before this one was in).
    if stop.load(Ordering::SeqCst) {
        if let Some((a, b)) = conns.open().remove(&id) {
            a.shutdown(Shutdown::Both);
            b.shutdown(Shutdown::Both);
        }
        return;
    }
    let out = std::thread::Builder::new()
        .name(format!("mayfly-expose-{}", guest.port()))
        .stack_size(mayfly_sys::HELPER_THREAD_STACK)
        .spawn(move || pump(u2, c2));
    match out {
        Ok(out) => {
            pump(client, upstream);
            let _ = out.join();
        }
        // Half a relay is none: both ends see the connection close.
        Err(_) => {
            client.shutdown(Shutdown::Both);
            upstream.shutdown(Shutdown::Both);
        }
    }
    conns.open().remove(&id);
}
