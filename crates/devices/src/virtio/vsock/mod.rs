//! virtio-vsock with a Unix-socket host side, as Firecracker users know it:
//!
//! - host to guest: connect to the VM's vsock socket and send `CONNECT <port>\n`; the answer
//!   is `OK <host port>\n` once the guest accepted, then the stream is the connection (a guest
//!   that refuses or does not listen closes it without an answer);
//! - guest to host: a guest connecting to CID 2 port P reaches the Unix socket `<path>_P`.
//!
//! Flow control is virtio-vsock's credit: the guest never sends more than the room mayfly
//! advertises per connection ([`BUF_ALLOC`]), and mayfly never sends more than the guest
//! advertises. So memory per connection is bounded, a slow host reader stops the guest
//! sender, and a guest that ignores its credit loses the connection.
//!
//! Snapshots: descriptors are never held across events (a TX packet is read and completed at
//! once; an RX or event descriptor is taken only to be filled), so a paused device has none in
//! flight. A restored or forked device has no connections: it sends the guest a transport
//! reset as soon as it runs, and holds back new connections until the guest has handled it,
//! so the reset cannot kill a connection made after it. The guest has handled it when it has
//! made an event buffer available again (Linux refills the event queue right after it reset
//! its sockets): the device looks at the event queue's available index, not at a kick, which
//! may be left over from before. The guest's own connection requests that arrive meanwhile
//! wait too (Linux may send them before its event work ran).
//! Host ports keep counting up across snapshots, so a restored guest never sees a port again.

mod conn;
mod connections;
mod consts;
mod device;
mod host;
pub mod packet;
mod queues;

use std::collections::{HashMap, VecDeque};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use event_manager::{EventOps, Events, MutEventSubscriber};
use serde::{Deserialize, Serialize};
use virtio_queue::Queue;
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

pub use consts::{
    BUF_ALLOC, HANDSHAKE_TIMEOUT, MAX_CONNECTIONS, RESET_HOLD_LIMIT, VIRTIO_ID_VSOCK,
};
pub use device::{Counters, Vsock};

use super::{drain, ActivateError, GuestMemory, Interrupt, VirtioDevice, VIRTIO_F_VERSION_1};
use crate::persist::Persist;
use conn::Key;
use consts::{EVT, FIRST_LOCAL_PORT, QUEUE_SIZE, RX};
use device::{nonblocking_timer, Active, Source};

/// The device's own state in a snapshot (queues are the transport's).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VsockState {
    pub guest_cid: u64,
    pub acked_features: u64,
    /// The next host port a host-initiated connection gets.
    pub next_local_port: u32,
}

/// Why a vsock device could not be created.
#[derive(Debug, thiserror::Error)]
pub enum VsockError {
    #[error("{0} is not a usable guest CID: use 3 to 4294967294")]
    BadCid(u64),
    #[error("cannot listen on the vsock socket {path}: {source}")]
    Listen {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot create the vsock device's event descriptors: {0}")]
    EventFd(std::io::Error),
}

impl Vsock {
    /// A device for guest CID `guest_cid` whose host side listens at `path` (created here;
    /// an existing file at `path` is the caller's to remove first).
    pub fn new(guest_cid: u64, path: Option<&Path>) -> Result<Self, VsockError> {
        Self::build(guest_cid, path, FIRST_LOCAL_PORT)
    }

    fn build(
        guest_cid: u64,
        path: Option<&Path>,
        next_local_port: u32,
    ) -> Result<Self, VsockError> {
        if !(3..=u64::from(u32::MAX - 1)).contains(&guest_cid) {
            return Err(VsockError::BadCid(guest_cid));
        }
        let listener = match path {
            Some(path) => {
                let listener = UnixListener::bind(path).map_err(|source| VsockError::Listen {
                    path: path.to_path_buf(),
                    source,
                })?;
                listener
                    .set_nonblocking(true)
                    .map_err(VsockError::EventFd)?;
                Some(listener)
            }
            None => None,
        };
        let queue_events = (0..3)
            .map(|_| EventFd::new(libc::EFD_NONBLOCK))
            .collect::<Result<Vec<_>, _>>()
            .map_err(VsockError::EventFd)?;
        let timer = nonblocking_timer().map_err(VsockError::EventFd)?;
        Ok(Self {
            guest_cid,
            path: path.map(Path::to_path_buf),
            listener,
            queue_events,
            timer,
            timer_armed: false,
            active: None,
            acked_features: 0,
            next_local_port,
            conns: HashMap::new(),
            pending: HashMap::new(),
            sources: HashMap::new(),
            control: VecDeque::new(),
            ready: VecDeque::new(),
            reset_pending: false,
            reset_hold: None,
            held_requests: Vec::new(),
            hold_avail: 0,
            rx_starved: false,
            ops_todo: Vec::new(),
            graveyard: Vec::new(),
            socket_id: path.and_then(|p| std::fs::metadata(p).ok()).map(|m| {
                use std::os::unix::fs::MetadataExt;
                (m.dev(), m.ino())
            }),
            counters: Counters::default(),
        })
    }

    pub fn guest_cid(&self) -> u64 {
        self.guest_cid
    }

    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    pub fn counters(&self) -> Counters {
        self.counters
    }

    pub fn connections(&self) -> usize {
        self.conns.len()
    }
}

/// What restoring a vsock device needs besides its state: the guest CID it gets (a clone's
/// own, or the saved one) and its host socket on this host.
#[derive(Clone, Debug)]
pub struct VsockArgs {
    pub guest_cid: u64,
    pub path: Option<PathBuf>,
}

impl Persist for Vsock {
    type State = VsockState;
    type ConstructorArgs = VsockArgs;
    type Error = VsockError;

    fn save(&self) -> VsockState {
        VsockState {
            guest_cid: self.guest_cid,
            acked_features: self.acked_features,
            next_local_port: self.next_local_port,
        }
    }

    /// A device from a snapshot, listening at `args.path`, with guest CID `args.guest_cid`.
    /// It has no connections and resets the guest's when it runs.
    fn restore(args: VsockArgs, state: &VsockState) -> Result<Self, VsockError> {
        let mut vsock = Self::build(args.guest_cid, args.path.as_deref(), state.next_local_port)?;
        vsock.acked_features = state.acked_features;
        vsock.reset_pending = true;
        Ok(vsock)
    }
}

impl VirtioDevice for Vsock {
    fn name(&self) -> &'static str {
        "virtio-vsock"
    }

    fn describe(&self) -> Option<String> {
        Some(format!(
            "{} connections, {:?}",
            self.connections(),
            self.counters()
        ))
    }

    fn device_type(&self) -> u32 {
        VIRTIO_ID_VSOCK
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE, QUEUE_SIZE, QUEUE_SIZE]
    }
    fn queue_events(&self) -> &[EventFd] {
        &self.queue_events
    }
    fn features(&self) -> u64 {
        VIRTIO_F_VERSION_1
    }
    fn ack_features(&mut self, features: u64) {
        self.acked_features = features;
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // struct virtio_vsock_config { le64 guest_cid; }
        let config = self.guest_cid.to_le_bytes();
        data.fill(0);
        if let Some(bytes) = usize::try_from(offset).ok().and_then(|o| config.get(o..)) {
            let n = bytes.len().min(data.len());
            data[..n].copy_from_slice(&bytes[..n]);
        }
    }
    fn activate(
        &mut self,
        mem: GuestMemory,
        queues: Vec<Queue>,
        interrupt: Arc<Interrupt>,
    ) -> Result<(), ActivateError> {
        if queues.len() != 3 {
            return Err(ActivateError::QueueCount {
                found: queues.len(),
                expected: 3,
            });
        }
        self.active = Some(Active {
            mem,
            queues,
            interrupt,
        });
        // The event loop picks up from here (a restored device sends its reset first).
        for event in &self.queue_events {
            let _ = event.write(1);
        }
        Ok(())
    }
    fn reset(&mut self) {
        self.active = None;
        let keys: Vec<Key> = self.conns.keys().copied().collect();
        for key in keys {
            self.close(key, false);
        }
        self.control.clear();
        self.ready.clear();
        self.reset_hold = None;
        self.held_requests.clear();
    }
    fn queues(&self) -> Option<&[Queue]> {
        self.active.as_ref().map(|a| a.queues.as_slice())
    }
}

impl MutEventSubscriber for Vsock {
    fn process(&mut self, events: Events, ops: &mut EventOps) {
        let fd = events.fd();
        let set = events.event_set();
        match self.sources.get(&fd).copied() {
            Some(Source::Queue(index)) => {
                drain(&self.queue_events[index]);
                match index {
                    RX => self.rx_starved = false,
                    // Maybe the guest posted an event buffer again: rx_open() looks.
                    EVT => {}
                    _ => {}
                }
            }
            Some(Source::Listener) => self.accept(),
            Some(Source::Timer) => {
                let _ = self.timer.wait();
                self.expire();
            }
            Some(Source::Pending) => self.read_connect_line(fd),
            Some(Source::Conn(key)) => {
                if set.intersects(EventSet::IN | EventSet::HANG_UP | EventSet::ERROR) {
                    if let Some(conn) = self.conns.get_mut(&key) {
                        conn.readable = true;
                    }
                }
                if set.contains(EventSet::OUT) {
                    self.flush_to_host(key);
                }
            }
            None => {
                // Not (or no longer) ours: stop watching it.
                let _ = ops.remove(Events::new_raw(fd, EventSet::empty()));
            }
        }
        self.run(ops);
    }

    fn init(&mut self, ops: &mut EventOps) {
        for (index, event) in self.queue_events.iter().enumerate() {
            self.sources.insert(event.as_raw_fd(), Source::Queue(index));
            let _ = ops.add(Events::new(event, EventSet::IN));
        }
        if let Some(listener) = &self.listener {
            self.sources.insert(listener.as_raw_fd(), Source::Listener);
            let _ = ops.add(Events::new(listener, EventSet::IN));
        }
        self.sources.insert(self.timer.as_raw_fd(), Source::Timer);
        let _ = ops.add(Events::new(&self.timer, EventSet::IN));
    }
}

impl Drop for Vsock {
    fn drop(&mut self) {
        use std::os::unix::fs::MetadataExt;
        let Some(path) = &self.path else {
            return;
        };
        let ours = std::fs::symlink_metadata(path)
            .is_ok_and(|m| Some((m.dev(), m.ino())) == self.socket_id);
        if ours {
            let _ = std::fs::remove_file(path);
        }
    }
}

#[cfg(test)]
mod tests;
