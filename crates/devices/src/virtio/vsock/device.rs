//! The vsock device's state: its host socket and event descriptors, the guest's queues once
//! activated, its connections and what it has queued for the guest; what each descriptor in
//! the event loop is; and the device's timer.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use virtio_queue::Queue;
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::timerfd::TimerFd;

use super::conn::{Conn, Key, Pending, State};
use super::packet::Header;
use crate::virtio::{GuestMemory, Interrupt};

/// The device's timer, non-blocking: epoll may report it expired and a handler earlier in
/// the same batch disarm it (clearing the expiry), and a blocking read of a disarmed timerfd
/// never returns — with the device's lock held, which stalls its VM's control socket too.
pub(super) fn nonblocking_timer() -> std::io::Result<TimerFd> {
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

pub(super) struct Active {
    pub(super) mem: GuestMemory,
    pub(super) queues: Vec<Queue>,
    pub(super) interrupt: Arc<Interrupt>,
}

/// What a file descriptor in the event loop is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Source {
    Queue(usize),
    Listener,
    Timer,
    Pending,
    Conn(Key),
}

pub struct Vsock {
    pub(super) guest_cid: u64,
    /// The host socket; None for a device with no host side (it refuses everything).
    pub(super) path: Option<PathBuf>,
    pub(super) listener: Option<UnixListener>,
    pub(super) queue_events: Vec<EventFd>,
    pub(super) timer: TimerFd,
    pub(super) timer_armed: bool,
    pub(super) active: Option<Active>,
    pub(super) acked_features: u64,
    pub(super) next_local_port: u32,
    pub(super) conns: HashMap<Key, Conn>,
    pub(super) pending: HashMap<RawFd, Pending>,
    pub(super) sources: HashMap<RawFd, Source>,
    /// Control packets for the guest (REQUEST, RESPONSE, RST, SHUTDOWN, CREDIT_UPDATE).
    pub(super) control: VecDeque<Header>,
    /// Connections with data for the guest, in turn.
    pub(super) ready: VecDeque<Key>,
    /// A transport reset is to be sent.
    pub(super) reset_pending: bool,
    /// Since the reset was sent, until the guest posts its event buffer again.
    pub(super) reset_hold: Option<Instant>,
    /// The event queue's available index when the reset was sent: the guest has handled the
    /// reset once it moved on (Linux keeps several event buffers posted, so "some buffer is
    /// available" says nothing).
    pub(super) hold_avail: u16,
    /// Connection requests from the guest that came during the hold, answered after it.
    pub(super) held_requests: Vec<Header>,
    /// The guest had no RX buffers when data waited: host sockets are not read until it posts
    /// some.
    pub(super) rx_starved: bool,
    /// fds to (re)register, processed where EventOps are at hand.
    pub(super) ops_todo: Vec<(RawFd, Option<EventSet>)>,
    /// Streams already forgotten, closed once epoll stops watching them.
    pub(super) graveyard: Vec<UnixStream>,
    /// Device and inode of the socket file this device created (it removes only that one).
    pub(super) socket_id: Option<(u64, u64)>,
    pub(super) counters: Counters,
}

/// What the device did, for tests and the state dump.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub resets_sent: u64,
    pub refused: u64,
    pub bad_packets: u64,
}

impl Vsock {
    pub(super) fn arm_timer(&mut self) {
        if !self.timer_armed {
            let tick = Duration::from_millis(500);
            if self.timer.reset(tick, Some(tick)).is_ok() {
                self.timer_armed = true;
            }
        }
    }

    pub(super) fn disarm_timer_if_idle(&mut self) {
        let waiting = !self.pending.is_empty()
            || self.reset_hold.is_some()
            || self.conns.values().any(|c| c.state == State::Connecting);
        if self.timer_armed && !waiting && self.timer.clear().is_ok() {
            self.timer_armed = false;
        }
    }
}
