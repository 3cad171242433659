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

pub mod packet;

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use event_manager::{EventOps, Events, MutEventSubscriber};
use serde::{Deserialize, Serialize};
use virtio_queue::{Queue, QueueOwnedT};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::timerfd::TimerFd;

use packet::*;

use super::{drain, ActivateError, GuestMemory, Interrupt, VirtioDevice, VIRTIO_F_VERSION_1};
use crate::persist::Persist;

/// `VIRTIO_ID_VSOCK`.
pub const VIRTIO_ID_VSOCK: u32 = 19;
const RX: usize = 0;
const TX: usize = 1;
const EVT: usize = 2;
const QUEUE_SIZE: u16 = 256;
/// Receive room mayfly advertises per connection: what the guest may send before mayfly has
/// passed it on to the host socket.
pub const BUF_ALLOC: u32 = 256 << 10;
/// Connections at once; past this a new one is refused (RST).
pub const MAX_CONNECTIONS: usize = 1024;
/// Host clients that connected but have not sent their `CONNECT` line yet.
const MAX_PENDING: usize = 256;
/// The longest `CONNECT <port>\n` line.
const MAX_CONNECT_LINE: usize = 64;
/// How long a host client may take to send its `CONNECT` line, and the guest to answer it (the
/// device then closes the connection).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// After a transport reset: how long new connections wait for the guest to handle it.
pub const RESET_HOLD_LIMIT: Duration = Duration::from_secs(5);
/// First host-side port of host-initiated connections.
const FIRST_LOCAL_PORT: u32 = 1 << 30;
/// virtio_vsock_event id.
const EVENT_TRANSPORT_RESET: u32 = 0;

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

/// Per connection: (host port, guest port).
type Key = (u32, u32);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Host-initiated: REQUEST sent (or waiting to be), no answer yet.
    Connecting,
    Established,
}

struct Conn {
    stream: UnixStream,
    state: State,
    local_port: u32,
    since: Instant,
    /// Credit the guest gave: its buffer and how much of what we sent it has consumed.
    peer_buf_alloc: u32,
    peer_fwd_cnt: u32,
    /// Bytes sent to the guest (wrapping).
    tx_cnt: u32,
    /// Bytes of the guest's data written to the host socket (wrapping).
    fwd_cnt: u32,
    /// `fwd_cnt` as the guest last heard it.
    fwd_cnt_told: u32,
    /// Guest data the host socket did not take yet (at most BUF_ALLOC).
    pending: VecDeque<u8>,
    /// The host socket has data (or EOF) to read.
    readable: bool,
    /// The host socket reached EOF: the guest was told SHUTDOWN.
    host_eof: bool,
    /// The guest will send no more (SHUTDOWN SEND): the host socket's write side is shut once
    /// `pending` is written.
    guest_done_sending: bool,
    /// The epoll interest registered for `stream`.
    interest: EventSet,
}

impl Conn {
    fn peer_credit(&self) -> u32 {
        let in_flight = self.tx_cnt.wrapping_sub(self.peer_fwd_cnt);
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    fn want(&self, rx_open: bool) -> EventSet {
        let mut set = EventSet::empty();
        if self.state == State::Established
            && rx_open
            && !self.host_eof
            && !self.readable
            && self.peer_credit() > 0
        {
            set |= EventSet::IN;
        }
        if !self.pending.is_empty() {
            set |= EventSet::OUT;
        }
        set
    }
}

/// The device's timer, non-blocking: epoll may report it expired and a handler earlier in
/// the same batch disarm it (clearing the expiry), and a blocking read of a disarmed timerfd
/// never returns — with the device's lock held, which stalls its VM's control socket too.
fn nonblocking_timer() -> std::io::Result<TimerFd> {
    let timer = TimerFd::new().map_err(std::io::Error::from)?;
    let fd = timer.as_raw_fd();
    // SAFETY: fcntl on a descriptor this function owns; no memory is passed.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(timer)
}

/// A host client that has not sent its `CONNECT` line yet.
struct Pending {
    stream: UnixStream,
    line: Vec<u8>,
    since: Instant,
}

struct Active {
    mem: GuestMemory,
    queues: Vec<Queue>,
    interrupt: Arc<Interrupt>,
}

/// What a file descriptor in the event loop is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    Queue(usize),
    Listener,
    Timer,
    Pending,
    Conn(Key),
}

pub struct Vsock {
    guest_cid: u64,
    /// The host socket; None for a device with no host side (it refuses everything).
    path: Option<PathBuf>,
    listener: Option<UnixListener>,
    queue_events: Vec<EventFd>,
    timer: TimerFd,
    timer_armed: bool,
    active: Option<Active>,
    acked_features: u64,
    next_local_port: u32,
    conns: HashMap<Key, Conn>,
    pending: HashMap<RawFd, Pending>,
    sources: HashMap<RawFd, Source>,
    /// Control packets for the guest (REQUEST, RESPONSE, RST, SHUTDOWN, CREDIT_UPDATE).
    control: VecDeque<Header>,
    /// Connections with data for the guest, in turn.
    ready: VecDeque<Key>,
    /// A transport reset is to be sent.
    reset_pending: bool,
    /// Since the reset was sent, until the guest posts its event buffer again.
    reset_hold: Option<Instant>,
    /// The event queue's available index when the reset was sent: the guest has handled the
    /// reset once it moved on (Linux keeps several event buffers posted, so "some buffer is
    /// available" says nothing).
    hold_avail: u16,
    /// Connection requests from the guest that came during the hold, answered after it.
    held_requests: Vec<Header>,
    /// The guest had no RX buffers when data waited: host sockets are not read until it posts
    /// some.
    rx_starved: bool,
    /// fds to (re)register, processed where EventOps are at hand.
    ops_todo: Vec<(RawFd, Option<EventSet>)>,
    /// Streams already forgotten, closed once epoll stops watching them.
    graveyard: Vec<UnixStream>,
    /// Device and inode of the socket file this device created (it removes only that one).
    socket_id: Option<(u64, u64)>,
    counters: Counters,
}

/// What the device did, for tests and the state dump.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub resets_sent: u64,
    pub refused: u64,
    pub bad_packets: u64,
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

    fn header(&self, local_port: u32, peer_port: u32, op: u16) -> Header {
        header(self.guest_cid, local_port, peer_port, op)
    }

    /// Queue a control packet about a connection (with its credit figures).
    fn send_control(&mut self, key: Key, op: u16, flags: u32) {
        let mut hdr = self.header(key.0, key.1, op);
        hdr.flags = flags;
        if let Some(conn) = self.conns.get_mut(&key) {
            hdr.fwd_cnt = conn.fwd_cnt;
            conn.fwd_cnt_told = conn.fwd_cnt;
        }
        self.control.push_back(hdr);
    }

    /// Refuse or end a connection the device has no (more) state for.
    fn send_rst(&mut self, local_port: u32, peer_port: u32) {
        self.control
            .push_back(self.header(local_port, peer_port, OP_RST));
    }

    /// Forget a connection: its host socket closes, the guest gets RST if `tell_guest`.
    fn close(&mut self, key: Key, tell_guest: bool) {
        if let Some(conn) = self.conns.remove(&key) {
            let fd = conn.stream.as_raw_fd();
            self.sources.remove(&fd);
            self.ops_todo.push((fd, None));
            // The fd is removed from epoll before it is closed (when `conn` drops after the
            // removal is applied): keep the stream alive until then.
            self.graveyard.push(conn.stream);
            if tell_guest {
                self.send_rst(key.0, key.1);
            }
        }
        self.ready.retain(|k| *k != key);
    }

    fn allocate_local_port(&mut self) -> u32 {
        loop {
            let port = self.next_local_port;
            self.next_local_port = self.next_local_port.wrapping_add(1).max(FIRST_LOCAL_PORT);
            if !self.conns.keys().any(|k| k.0 == port) {
                return port;
            }
        }
    }

    // ---- the host side ----

    fn accept(&mut self) {
        loop {
            let Some(listener) = &self.listener else {
                return;
            };
            match listener.accept() {
                Ok((stream, _)) => {
                    if self.pending.len() >= MAX_PENDING
                        || self.conns.len() >= MAX_CONNECTIONS
                        || stream.set_nonblocking(true).is_err()
                    {
                        self.counters.refused += 1;
                        continue;
                    }
                    let fd = stream.as_raw_fd();
                    self.sources.insert(fd, Source::Pending);
                    self.ops_todo.push((fd, Some(EventSet::IN)));
                    self.pending.insert(
                        fd,
                        Pending {
                            stream,
                            line: Vec::new(),
                            since: Instant::now(),
                        },
                    );
                    self.arm_timer();
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                // Out of descriptors or the like: try again on the next event.
                Err(_) => return,
            }
        }
    }

    /// Read a pending client's `CONNECT` line; once complete, start the connection.
    fn read_connect_line(&mut self, fd: RawFd) {
        let Some(pending) = self.pending.get_mut(&fd) else {
            return;
        };
        let mut buf = [0u8; MAX_CONNECT_LINE];
        let room = MAX_CONNECT_LINE - pending.line.len();
        let result = pending.stream.read(&mut buf[..room.max(1)]);
        let done = match result {
            Ok(0) => Err(()),
            Ok(n) => {
                pending.line.extend_from_slice(&buf[..n]);
                match pending.line.iter().position(|&b| b == b'\n') {
                    // Anything after the line would be data before the connection exists.
                    Some(end) if end + 1 == pending.line.len() => Ok(Some(end)),
                    Some(_) => Err(()),
                    None if pending.line.len() >= MAX_CONNECT_LINE => Err(()),
                    None => Ok(None),
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                Ok(None)
            }
            Err(_) => Err(()),
        };
        match done {
            Ok(None) => {}
            Err(()) => self.drop_pending(fd),
            Ok(Some(end)) => {
                let port = parse_connect_line(&pending.line[..end]);
                let Some(pending) = self.remove_pending(fd) else {
                    return;
                };
                match port {
                    Some(port) if self.conns.len() < MAX_CONNECTIONS => {
                        self.start_host_connection(pending.stream, port)
                    }
                    _ => {
                        self.counters.refused += 1;
                        self.graveyard.push(pending.stream);
                    }
                }
            }
        }
    }

    fn remove_pending(&mut self, fd: RawFd) -> Option<Pending> {
        let pending = self.pending.remove(&fd)?;
        self.sources.remove(&fd);
        self.ops_todo.push((fd, None));
        Some(pending)
    }

    fn drop_pending(&mut self, fd: RawFd) {
        if let Some(pending) = self.remove_pending(fd) {
            self.graveyard.push(pending.stream);
        }
    }

    fn start_host_connection(&mut self, stream: UnixStream, peer_port: u32) {
        let local_port = self.allocate_local_port();
        let key = (local_port, peer_port);
        let fd = stream.as_raw_fd();
        self.sources.insert(fd, Source::Conn(key));
        self.ops_todo.push((fd, Some(EventSet::empty())));
        self.conns.insert(
            key,
            Conn {
                stream,
                state: State::Connecting,
                local_port,
                since: Instant::now(),
                peer_buf_alloc: 0,
                peer_fwd_cnt: 0,
                tx_cnt: 0,
                fwd_cnt: 0,
                fwd_cnt_told: 0,
                pending: VecDeque::new(),
                readable: false,
                host_eof: false,
                guest_done_sending: false,
                interest: EventSet::empty(),
            },
        );
        self.send_control(key, OP_REQUEST, 0);
        self.arm_timer();
    }

    /// The guest connects to host port `local_port`: reach `<path>_<port>`.
    fn guest_connects(&mut self, hdr: &Header) {
        let (dst_port, src_port) = (hdr.dst_port, hdr.src_port);
        let (buf_alloc, fwd_cnt) = (hdr.buf_alloc, hdr.fwd_cnt);
        let key = (dst_port, src_port);
        if self.conns.contains_key(&key) || self.conns.len() >= MAX_CONNECTIONS {
            self.counters.refused += 1;
            self.send_rst(key.0, key.1);
            return;
        }
        let Some(path) = &self.path else {
            self.counters.refused += 1;
            self.send_rst(key.0, key.1);
            return;
        };
        let mut target = path.as_os_str().to_owned();
        target.push(format!("_{dst_port}"));
        let stream = match UnixStream::connect(&target) {
            Ok(stream) if stream.set_nonblocking(true).is_ok() => stream,
            _ => {
                self.counters.refused += 1;
                self.send_rst(key.0, key.1);
                return;
            }
        };
        let fd = stream.as_raw_fd();
        self.sources.insert(fd, Source::Conn(key));
        self.ops_todo.push((fd, Some(EventSet::empty())));
        self.conns.insert(
            key,
            Conn {
                stream,
                state: State::Established,
                local_port: key.0,
                since: Instant::now(),
                peer_buf_alloc: buf_alloc,
                peer_fwd_cnt: fwd_cnt,
                tx_cnt: 0,
                fwd_cnt: 0,
                fwd_cnt_told: 0,
                pending: VecDeque::new(),
                readable: false,
                host_eof: false,
                guest_done_sending: false,
                interest: EventSet::empty(),
            },
        );
        self.send_control(key, OP_RESPONSE, 0);
    }

    /// Write what the guest sent to the host socket; keep what does not fit (bounded by the
    /// credit the guest was given).
    fn flush_to_host(&mut self, key: Key) {
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        while !conn.pending.is_empty() {
            let (front, _) = conn.pending.as_slices();
            match conn.stream.write(front) {
                Ok(0) => break,
                Ok(n) => {
                    conn.pending.drain(..n);
                    conn.fwd_cnt = conn.fwd_cnt.wrapping_add(credit_bytes(n));
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(_) => {
                    // The host side is gone.
                    self.close(key, true);
                    return;
                }
            }
        }
        if conn.pending.is_empty() && conn.guest_done_sending {
            let _ = conn.stream.shutdown(std::net::Shutdown::Write);
        }
        // Tell the guest about freed room before it runs out.
        if conn.fwd_cnt.wrapping_sub(conn.fwd_cnt_told) >= BUF_ALLOC / 4 {
            self.send_control(key, OP_CREDIT_UPDATE, 0);
        }
    }

    // ---- the guest side ----

    fn handle_tx(&mut self, pkt: TxPacket) {
        let hdr = pkt.hdr;
        // Copies of the packed header's fields (references into it would be unaligned).
        let (src_cid, dst_cid, src_port, dst_port) =
            (hdr.src_cid, hdr.dst_cid, hdr.src_port, hdr.dst_port);
        let (type_, op, flags) = (hdr.type_, hdr.op, hdr.flags);
        let (buf_alloc, fwd_cnt) = (hdr.buf_alloc, hdr.fwd_cnt);
        // A guest that claims another CID is spoofing: dropped without a word.
        if src_cid != self.guest_cid {
            self.counters.bad_packets += 1;
            return;
        }
        let key = (dst_port, src_port);
        if dst_cid != HOST_CID || type_ != TYPE_STREAM {
            self.counters.bad_packets += 1;
            if op != OP_RST {
                self.send_rst(key.0, key.1);
            }
            return;
        }
        if op == OP_REQUEST {
            if !self.rx_open() {
                // Answered once the guest has handled the reset: connected now, the reset
                // would kill it on the guest's side without a word to the host.
                if self.held_requests.len() < MAX_CONNECTIONS {
                    self.held_requests.push(hdr);
                } else {
                    self.counters.refused += 1;
                    self.send_rst(key.0, key.1);
                }
                return;
            }
            self.guest_connects(&hdr);
            return;
        }
        let Some(conn) = self.conns.get_mut(&key) else {
            if op != OP_RST {
                self.send_rst(key.0, key.1);
            }
            return;
        };
        conn.peer_buf_alloc = buf_alloc;
        conn.peer_fwd_cnt = fwd_cnt;
        match op {
            OP_RESPONSE if conn.state == State::Connecting => {
                conn.state = State::Established;
                let answer = format!("OK {}\n", conn.local_port);
                // A few bytes into a fresh socket's empty buffer: they fit.
                if conn.stream.write_all(answer.as_bytes()).is_err() {
                    self.close(key, true);
                }
            }
            OP_RESPONSE => {
                self.counters.bad_packets += 1;
                self.close(key, true);
            }
            OP_RW if conn.state == State::Established => {
                if conn.pending.len() + pkt.payload.len() > BUF_ALLOC as usize {
                    // More than the credit it was given: the guest is misbehaving.
                    self.counters.bad_packets += 1;
                    self.close(key, true);
                    return;
                }
                conn.pending.extend(pkt.payload.iter());
                self.flush_to_host(key);
            }
            OP_CREDIT_UPDATE => {
                // More room at the guest: its data may flow again.
            }
            OP_CREDIT_REQUEST => self.send_control(key, OP_CREDIT_UPDATE, 0),
            OP_SHUTDOWN => {
                if flags & SHUTDOWN_SEND != 0 {
                    conn.guest_done_sending = true;
                }
                let both = SHUTDOWN_SEND | SHUTDOWN_RCV;
                if flags & both == both {
                    // Nothing more either way: what is pending still goes out, then close.
                    self.flush_to_host(key);
                    self.close(key, true);
                } else {
                    self.flush_to_host(key);
                }
            }
            OP_RST => self.close(key, false),
            _ => {
                self.counters.bad_packets += 1;
                self.close(key, true);
            }
        }
    }

    /// Read and answer every packet the guest queued.
    fn process_tx(&mut self) {
        let Some(active) = &mut self.active else {
            return;
        };
        let mem = active.mem.clone();
        let mut packets = Vec::new();
        let mut notify = false;
        // Chains taken this pass, good or bad: at most a queue's worth, then the next turn.
        // (Counting only good packets let a driver with its used ring over its avail ring
        // feed bad chains forever, as the rng device's fuzzer-found spin did.)
        let mut taken = 0usize;
        let mut more = false;
        loop {
            if taken >= usize::from(QUEUE_SIZE) {
                more = true;
                break;
            }
            let chain = match active.queues[TX].iter(&mem) {
                Ok(mut iter) => iter.next(),
                Err(_) => None,
            };
            let Some(chain) = chain else { break };
            taken += 1;
            let head = chain.head_index();
            match parse_tx(&mem, chain) {
                Ok(pkt) => packets.push(pkt),
                Err(_) => self.counters.bad_packets += 1,
            }
            // Every TX descriptor is given back at once: none is ever in flight.
            match super::complete(&mut active.queues[TX], &mem, head, 0) {
                Ok(needs) => notify |= needs,
                Err(_) => break,
            }
        }
        if notify {
            let _ = active.interrupt.signal_used_queue();
        }
        // The bound above also keeps a guest that keeps the queue full from starving RX.
        for pkt in packets {
            self.handle_tx(pkt);
        }
        if more {
            // Come back for the rest once RX has had its turn.
            let _ = self.queue_events[TX].write(1);
        }
    }

    /// Send the transport reset if one is due and the guest gave an event buffer.
    fn process_event_queue(&mut self) {
        if !self.reset_pending {
            return;
        }
        let Some(active) = &mut self.active else {
            return;
        };
        let mem = active.mem.clone();
        let chain = match active.queues[EVT].iter(&mem) {
            Ok(mut iter) => iter.next(),
            Err(_) => None,
        };
        let Some(chain) = chain else {
            return;
        };
        let head = chain.head_index();
        let written = chain
            .writer(&mem)
            .ok()
            .and_then(|mut w| w.write_obj(EVENT_TRANSPORT_RESET.to_le()).ok().map(|()| 4))
            .unwrap_or(0);
        if let Ok(true) = super::complete(&mut active.queues[EVT], &mem, head, written) {
            let _ = active.interrupt.signal_used_queue();
        }
        self.reset_pending = false;
        self.hold_avail = self.event_avail().unwrap_or(0);
        self.reset_hold = Some(Instant::now());
        self.counters.resets_sent += 1;
        self.arm_timer();
    }

    /// Whether new packets may go to the guest (not while it handles a reset).
    fn rx_open(&mut self) -> bool {
        match self.reset_hold {
            Some(since) if since.elapsed() < RESET_HOLD_LIMIT && !self.reset_handled() => false,
            // Handled, or a guest that does not refill its event queue: go on.
            Some(_) => {
                self.end_hold();
                true
            }
            None => !self.reset_pending,
        }
    }

    /// The event queue's available index (what the guest has posted so far).
    fn event_avail(&self) -> Option<u16> {
        use virtio_queue::QueueT;
        let active = self.active.as_ref()?;
        active.queues[EVT]
            .avail_idx(&active.mem, std::sync::atomic::Ordering::Acquire)
            .ok()
            .map(|idx| idx.0)
    }

    /// Whether the guest posted an event buffer since the reset was sent.
    fn reset_handled(&self) -> bool {
        self.event_avail()
            .is_some_and(|avail| avail != self.hold_avail)
    }

    fn end_hold(&mut self) {
        self.reset_hold = None;
        for hdr in std::mem::take(&mut self.held_requests) {
            self.guest_connects(&hdr);
        }
    }

    /// Fill the guest's RX buffers: control packets first, then data from host sockets in
    /// turn, each within the guest's credit.
    fn process_rx(&mut self) {
        if self.active.is_none() || !self.rx_open() {
            return;
        }
        // Host sockets that became readable join the round.
        let keys: Vec<Key> = self
            .conns
            .iter()
            .filter(|(_, c)| c.readable && c.state == State::Established)
            .map(|(k, _)| *k)
            .collect();
        for key in keys {
            if !self.ready.contains(&key) {
                self.ready.push_back(key);
            }
        }
        let mut notify = false;
        let mut buf = vec![0u8; MAX_PAYLOAD];
        let guest_cid = self.guest_cid;
        self.rx_starved = false;
        loop {
            if self.control.is_empty() && self.ready.is_empty() {
                break;
            }
            let Some(active) = &mut self.active else {
                break;
            };
            let mem = active.mem.clone();
            let mut iter = match active.queues[RX].iter(&mem) {
                Ok(iter) => iter,
                Err(_) => break,
            };
            let Some(chain) = iter.next() else {
                self.rx_starved = true;
                break;
            };
            let room = rx_room(&mem, &chain);
            let head = chain.head_index();
            let written = if let Some(hdr) = self.control.front().copied() {
                match write_rx(&mem, chain, &hdr, &[]) {
                    Some(n) => {
                        self.control.pop_front();
                        Some(n)
                    }
                    // A buffer too small for a header: the driver's bug; give it back empty.
                    None => Some(0),
                }
            } else {
                let key = self.ready.pop_front().expect("checked non-empty");
                match self.conns.get_mut(&key) {
                    Some(conn) if conn.state == State::Established => {
                        let want = room.min(conn.peer_credit() as usize);
                        if want == 0 {
                            // No credit (or no room): wait for the guest's credit update.
                            iter.go_to_previous_position();
                            continue;
                        }
                        match conn.stream.read(&mut buf[..want]) {
                            Ok(0) => {
                                // EOF: the guest hears SHUTDOWN (it will send no more to us
                                // either way once it closes).
                                conn.readable = false;
                                conn.host_eof = true;
                                iter.go_to_previous_position();
                                self.send_control(key, OP_SHUTDOWN, SHUTDOWN_SEND | SHUTDOWN_RCV);
                                continue;
                            }
                            Ok(n) => {
                                let mut hdr = header(guest_cid, key.0, key.1, OP_RW);
                                hdr.len = credit_bytes(n);
                                hdr.fwd_cnt = conn.fwd_cnt;
                                conn.fwd_cnt_told = conn.fwd_cnt;
                                conn.tx_cnt = conn.tx_cnt.wrapping_add(credit_bytes(n));
                                // More may be there: stay in the round.
                                self.ready.push_back(key);
                                Some(write_rx(&mem, chain, &hdr, &buf[..n]).unwrap_or(0))
                            }
                            Err(e)
                                if e.kind() == ErrorKind::WouldBlock
                                    || e.kind() == ErrorKind::Interrupted =>
                            {
                                conn.readable = false;
                                iter.go_to_previous_position();
                                continue;
                            }
                            Err(_) => {
                                iter.go_to_previous_position();
                                self.close(key, true);
                                continue;
                            }
                        }
                    }
                    _ => {
                        iter.go_to_previous_position();
                        continue;
                    }
                }
            };
            let Some(active) = &mut self.active else {
                break;
            };
            match super::complete(
                &mut active.queues[RX],
                &mem,
                head,
                credit_bytes(written.unwrap_or(0)),
            ) {
                Ok(needs) => notify |= needs,
                Err(_) => break,
            }
        }
        if notify {
            if let Some(active) = &self.active {
                let _ = active.interrupt.signal_used_queue();
            }
        }
    }

    /// Drop what waited too long: silent host clients, unanswered requests.
    fn expire(&mut self) {
        let late: Vec<RawFd> = self
            .pending
            .iter()
            .filter(|(_, p)| p.since.elapsed() > HANDSHAKE_TIMEOUT)
            .map(|(fd, _)| *fd)
            .collect();
        for fd in late {
            self.drop_pending(fd);
        }
        let late: Vec<Key> = self
            .conns
            .iter()
            .filter(|(_, c)| c.state == State::Connecting && c.since.elapsed() > HANDSHAKE_TIMEOUT)
            .map(|(k, _)| *k)
            .collect();
        for key in late {
            self.close(key, true);
        }
    }

    fn arm_timer(&mut self) {
        if !self.timer_armed {
            let tick = Duration::from_millis(500);
            if self.timer.reset(tick, Some(tick)).is_ok() {
                self.timer_armed = true;
            }
        }
    }

    fn disarm_timer_if_idle(&mut self) {
        let waiting = !self.pending.is_empty()
            || self.reset_hold.is_some()
            || self.conns.values().any(|c| c.state == State::Connecting);
        if self.timer_armed && !waiting && self.timer.clear().is_ok() {
            self.timer_armed = false;
        }
    }

    /// Work everything through, then bring the event loop's interest up to date.
    fn run(&mut self, ops: &mut EventOps) {
        self.process_event_queue();
        self.process_tx();
        self.process_rx();
        self.disarm_timer_if_idle();
        self.sync_interest(ops);
    }

    fn sync_interest(&mut self, ops: &mut EventOps) {
        let rx_open = !self.rx_starved && self.reset_hold.is_none() && !self.reset_pending;
        for (fd, want) in self.ops_todo.drain(..) {
            match want {
                Some(set) => {
                    let _ = ops.add(Events::new_raw(fd, set));
                }
                None => {
                    let _ = ops.remove(Events::new_raw(fd, EventSet::empty()));
                }
            }
        }
        // Closed streams can go now that epoll no longer watches them.
        self.graveyard.clear();
        for conn in self.conns.values_mut() {
            let want = conn.want(rx_open);
            if want != conn.interest
                && ops
                    .modify(Events::new_raw(conn.stream.as_raw_fd(), want))
                    .is_ok()
            {
                conn.interest = want;
            }
        }
    }
}

/// A packet header from the host to the guest.
fn header(guest_cid: u64, local_port: u32, peer_port: u32, op: u16) -> Header {
    Header {
        src_cid: HOST_CID,
        dst_cid: guest_cid,
        src_port: local_port,
        dst_port: peer_port,
        len: 0,
        type_: TYPE_STREAM,
        op,
        flags: 0,
        buf_alloc: BUF_ALLOC,
        fwd_cnt: 0,
    }
}

/// `CONNECT <port>` (without the newline) to the port.
/// A count of bytes moved in one packet or one write (at most [`BUF_ALLOC`] or a packet's
/// payload) as the u32 virtio-vsock counts in; its counters wrap by design.
fn credit_bytes(n: usize) -> u32 {
    u32::try_from(n).expect("at most one buffer's worth")
}

fn parse_connect_line(line: &[u8]) -> Option<u32> {
    let text = std::str::from_utf8(line).ok()?;
    let port = text.strip_prefix("CONNECT ")?;
    if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    port.parse().ok()
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
