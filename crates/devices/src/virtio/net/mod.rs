//! virtio-net over a tap: one RX and one TX queue (and a control queue for the announce
//! acknowledgement only), a MAC in config space, link status, mergeable RX buffers and
//! checksum/TSO offloads in both directions.
//!
//! - The tap is the caller's (the VMM opens `/dev/net/tun` inside the VM's network namespace,
//!   see `mayfly-network`) and must carry virtio-net headers (`IFF_VNET_HDR`): the 12-byte
//!   `virtio_net_hdr_v1` of a virtio 1.x device is what the tap reads and writes, so frames and
//!   their offload metadata (partial checksums, GSO) pass through without being touched.
//! - TX is zero-copy: a frame's descriptors become the iovecs of one `writev` to the tap. Only
//!   the header is copied first, checked (offloads the guest did not negotiate are refused) and
//!   sent from mayfly's copy, so the guest cannot change it after the check.
//! - RX reads one frame from the tap into a buffer and copies it into as many of the guest's
//!   buffers as it takes (`num_buffers`, with VIRTIO_NET_F_MRG_RXBUF), or into one buffer.
//!
//! The guest is the adversary. A chain that leaves guest memory, loops, points past the table,
//! has descriptors of the wrong direction or is too short for the header is dropped and
//! counted ([`Counters`]); a TX frame beyond 64 KiB plus headers ([`MAX_FRAME_LEN`]) is dropped.
//! Work per event is bounded ([`TX_BUDGET`], [`RX_BUDGET`]) so a flood in one direction cannot
//! starve the other, and the device thread never spins: it reads the tap only while the guest
//! has RX buffers, and stops reading TX while the tap cannot take a frame.
//!
//! Nothing is in flight between events: a TX chain is completed in the event that popped it; if
//! the tap cannot take it now (EAGAIN), it is put back on the ring (not popped) and retried once
//! the tap is writable. An RX chain is popped only to be filled and completed at once; a frame
//! that does not fit the buffers posted so far waits in mayfly's own buffer and the chains it
//! would need stay on the ring. So a paused device has no descriptor popped, and a snapshot
//! loses at most that one host-side frame (a network may drop a frame anyway).
//!
//! Restore: a restored (or forked) device asks its guest to announce itself
//! (VIRTIO_NET_F_GUEST_ANNOUNCE: VIRTIO_NET_S_ANNOUNCE in the status and a config-change
//! interrupt; Linux then sends gratuitous ARPs and IPv6 neighbour advertisements, and acks
//! through the control queue, which clears the bit). So whatever is on the other side of the
//! tap learns the guest's MAC and address at once, without the guest's link going down. (The
//! guest's own view of its gateway stays right across clones because mayfly-network gives
//! every VM's gateway the same MAC.) The control queue serves that acknowledgement only; any
//! other command gets VIRTIO_NET_ERR (no CTRL_RX, CTRL_VLAN, MQ... are offered, so a driver
//! has no reason to send one). A driver that did not negotiate GUEST_ANNOUNCE but STATUS gets
//! a link flap instead: the link reads down once (Linux drops carrier), and that read brings it
//! back up with a second config-change interrupt.

mod error;
mod rx;
mod spec;
mod tap;
#[cfg(test)]
mod tests;
mod tx;

use std::io::ErrorKind;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use event_manager::{EventOps, Events, MutEventSubscriber};
use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_net::*;
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use super::{complete, drain, ActivateError, GuestMemory, Interrupt, VirtioDevice};
use crate::persist::Persist;
pub use error::NetError;
pub use spec::{MacAddr, VNET_HDR_LEN};
use tap::Backend;

/// `VIRTIO_ID_NET`.
pub const VIRTIO_ID_NET: u32 = 1;
const RX: usize = 0;
const TX: usize = 1;
const CTRL: usize = 2;
const QUEUE_SIZE: u16 = 256;
// virtio-bindings' u32 constants at the widths of the fields they go in (checked below).
const S_LINK_UP: u16 = 1;
const S_ANNOUNCE: u16 = 2;
const HDR_F_NEEDS_CSUM: u8 = 1;
const CTRL_ANNOUNCE: u8 = 3;
const CTRL_ANNOUNCE_ACK: u8 = 0;
const CTRL_OK: u8 = 0;
const CTRL_ERR: u8 = 1;
const _: () = assert!(
    S_LINK_UP as u32 == VIRTIO_NET_S_LINK_UP
        && S_ANNOUNCE as u32 == VIRTIO_NET_S_ANNOUNCE
        && HDR_F_NEEDS_CSUM as u32 == VIRTIO_NET_HDR_F_NEEDS_CSUM
        && CTRL_ANNOUNCE as u32 == VIRTIO_NET_CTRL_ANNOUNCE
        && CTRL_ANNOUNCE_ACK as u32 == VIRTIO_NET_CTRL_ANNOUNCE_ACK
        && CTRL_OK as u32 == VIRTIO_NET_OK
        && CTRL_ERR as u32 == VIRTIO_NET_ERR
);
const CTRL_QUEUE_SIZE: u16 = 64;
/// Control commands handled per event at most.
const CTRL_BUDGET: usize = 64;
/// The largest frame either way: the largest IP packet (64 KiB, as TSO makes them) behind an
/// Ethernet header with a VLAN tag.
pub const MAX_FRAME_LEN: usize = 65535 + 18;
/// An Ethernet header: a frame shorter than this is not one.
const MIN_FRAME_LEN: usize = 14;
/// TX frames handled per event at most; the rest wait for the next turn.
pub const TX_BUDGET: usize = 256;
/// RX frames delivered per event at most.
pub const RX_BUDGET: usize = 256;

const fn bit(feature: u32) -> u64 {
    1 << feature
}

/// What the device offers. No multiqueue; the control queue is for GUEST_ANNOUNCE only.
pub const NET_FEATURES: u64 = super::VIRTIO_F_VERSION_1
    | bit(VIRTIO_RING_F_EVENT_IDX)
    | bit(VIRTIO_NET_F_MAC)
    | bit(VIRTIO_NET_F_STATUS)
    | bit(VIRTIO_NET_F_MRG_RXBUF)
    | bit(VIRTIO_NET_F_CSUM)
    | bit(VIRTIO_NET_F_GUEST_CSUM)
    | bit(VIRTIO_NET_F_GUEST_TSO4)
    | bit(VIRTIO_NET_F_GUEST_TSO6)
    | bit(VIRTIO_NET_F_HOST_TSO4)
    | bit(VIRTIO_NET_F_HOST_TSO6)
    | bit(VIRTIO_NET_F_CTRL_VQ)
    | bit(VIRTIO_NET_F_GUEST_ANNOUNCE);

/// The device's own state in a snapshot (its queues are the transport's).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetState {
    pub mac: MacAddr,
    pub acked_features: u64,
    /// The link status the guest should end up seeing (VIRTIO_NET_S_LINK_UP or 0).
    pub status: u16,
    /// The egress policy the host enforces for this NIC, in `--net` syntax (`open`,
    /// `allow=...`): not the device's own business, but part of what the NIC is, so a restore
    /// and every clone keep it. The VMM fills it in ([`Net::save`] leaves it empty).
    pub policy: String,
}

/// What the device did, for tests and diagnostics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub tx_frames: u64,
    pub tx_bytes: u64,
    /// TX chains the device could not make sense of (out of guest memory, loops, write-only
    /// descriptors, shorter than the header, longer than the largest frame, a bad header).
    pub tx_malformed: u64,
    /// TX frames the tap refused (other than "not now").
    pub tx_dropped: u64,
    /// Times the tap could not take a frame yet (the chain went back on the ring).
    pub tx_deferred: u64,
    pub rx_frames: u64,
    pub rx_bytes: u64,
    /// RX frames dropped: too big for the guest's buffers, shorter than a header.
    pub rx_dropped: u64,
    /// RX chains the device could not write into (returned to the guest empty).
    pub rx_malformed: u64,
    /// Announce requests (or, without GUEST_ANNOUNCE, link flaps) sent after a restore.
    pub announces: u64,
    /// Announce acknowledgements from the guest.
    pub announce_acks: u64,
    /// Control commands refused (unknown, or malformed chains).
    pub ctrl_refused: u64,
}

/// Link states (the guest-visible status follows from it).
const LINK_UP: u8 = 0;
/// Restored: the guest is to be told the link is down.
const LINK_DOWN_PENDING: u8 = 1;
/// Told; the guest's next status read brings it up again.
const LINK_DOWN_SIGNALLED: u8 = 2;
/// Down on the VMM's request.
const LINK_DOWN: u8 = 3;

/// Announce states.
const ANNOUNCE_NONE: u8 = 0;
/// Restored: the guest is to be asked to announce itself.
const ANNOUNCE_PENDING: u8 = 1;
/// Asked (the status shows VIRTIO_NET_S_ANNOUNCE) until the guest acks.
const ANNOUNCE_SIGNALLED: u8 = 2;

struct Active {
    mem: GuestMemory,
    queues: Vec<Queue>,
    interrupt: Arc<Interrupt>,
}

pub struct Net {
    mac: MacAddr,
    backend: Backend,
    queue_events: Vec<EventFd>,
    active: Option<Active>,
    acked_features: u64,
    link: AtomicU8,
    announce: AtomicU8,
    /// The frame read from the tap that did not fit the guest's buffers yet (header first).
    rx_buf: Vec<u8>,
    rx_pending: usize,
    /// The guest had no (or not enough) RX buffers: the tap is not read until it posts more.
    rx_starved: bool,
    /// The tap could not take a frame: TX waits until it is writable.
    tx_blocked: bool,
    /// The epoll interest registered for the tap.
    interest: EventSet,
    /// The backend hung up or failed: it is no longer watched.
    backend_gone: bool,
    /// RX chains of the frame being delivered: (head, bytes written).
    rx_used: Vec<(u16, u32)>,
    counters: Counters,
}

fn check_mac(mac: MacAddr) -> Result<MacAddr, NetError> {
    if mac[0] & 1 != 0 || mac == [0; 6] {
        return Err(NetError::BadMac(mac));
    }
    Ok(mac)
}

/// Why a chain was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Bad {
    /// Outside guest memory, a loop, a `next` past the table, an empty chain.
    Chain,
    /// A descriptor the device may not use this way (write-only on TX, read-only on RX).
    Direction,
    TooShort,
    TooLong,
    /// A header asking for an offload the guest did not negotiate.
    Header,
}

impl Net {
    /// A device over `tap` (opened with IFF_TAP | IFF_NO_PI | IFF_VNET_HDR) whose guest sees
    /// MAC `mac`.
    pub fn new(tap: OwnedFd, mac: MacAddr) -> Result<Self, NetError> {
        let mac = check_mac(mac)?;
        Self::build(Backend::tap(tap)?, mac)
    }

    /// A device over a `SOCK_SEQPACKET` or `SOCK_DGRAM` socket: each message is one frame
    /// behind a 12-byte `virtio_net_hdr_v1`, as a tap with IFF_VNET_HDR would carry it (the
    /// peer sees offloaded frames as the guest sent them: it must handle partial checksums and
    /// GSO frames, or the guest must not be offered them).
    pub fn with_socket(socket: OwnedFd, mac: MacAddr) -> Result<Self, NetError> {
        let mac = check_mac(mac)?;
        Self::build(Backend::socket(socket)?, mac)
    }

    fn build(backend: Backend, mac: MacAddr) -> Result<Self, NetError> {
        let queue_events = (0..3)
            .map(|_| EventFd::new(libc::EFD_NONBLOCK))
            .collect::<Result<Vec<_>, _>>()
            .map_err(NetError::EventFd)?;
        Ok(Self {
            mac,
            backend,
            queue_events,
            active: None,
            acked_features: 0,
            link: AtomicU8::new(LINK_UP),
            announce: AtomicU8::new(ANNOUNCE_NONE),
            rx_buf: vec![0u8; VNET_HDR_LEN + MAX_FRAME_LEN],
            rx_pending: 0,
            rx_starved: false,
            tx_blocked: false,
            interest: EventSet::empty(),
            backend_gone: false,
            rx_used: Vec::with_capacity(usize::from(QUEUE_SIZE)),
            counters: Counters::default(),
        })
    }

    fn restored(mut self, state: &NetState) -> Result<Self, NetError> {
        self.acked_features = state.acked_features & NET_FEATURES;
        let announce = self.has(VIRTIO_NET_F_GUEST_ANNOUNCE) && self.has(VIRTIO_NET_F_CTRL_VQ);
        let link = if u32::from(state.status) & VIRTIO_NET_S_LINK_UP == 0 {
            LINK_DOWN
        } else if !announce && self.has(VIRTIO_NET_F_STATUS) {
            LINK_DOWN_PENDING
        } else {
            LINK_UP
        };
        self.link.store(link, Ordering::SeqCst);
        if announce {
            self.announce.store(ANNOUNCE_PENDING, Ordering::SeqCst);
        }
        Ok(self)
    }

    pub fn mac(&self) -> MacAddr {
        self.mac
    }

    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// Take the link down or bring it up (the guest is told through a config-change interrupt
    /// if it negotiated VIRTIO_NET_F_STATUS). While down, frames still flow: the guest's
    /// driver stops sending on its own.
    pub fn set_link_up(&mut self, up: bool) {
        let new = if up { LINK_UP } else { LINK_DOWN };
        if self.link.swap(new, Ordering::SeqCst) != new {
            self.signal_config();
        }
    }

    fn signal_config(&self) {
        if let Some(active) = &self.active {
            let _ = active.interrupt.signal_config_change();
        }
    }

    fn has(&self, feature: u32) -> bool {
        self.acked_features & bit(feature) != 0
    }

    /// The config space: `struct virtio_net_config { u8 mac[6]; le16 status; le16
    /// max_virtqueue_pairs; ... }`.
    fn config(&self, reads_status: bool) -> [u8; 10] {
        let mut status = S_LINK_UP;
        match self.link.load(Ordering::SeqCst) {
            LINK_UP => {}
            LINK_DOWN => status = 0,
            // Not running: no driver to flap the link for.
            _ if self.active.is_none() => {}
            state => {
                status = 0;
                // The guest sees the link down now: bring it back up and tell it.
                if reads_status
                    && self
                        .link
                        .compare_exchange(state, LINK_UP, Ordering::SeqCst, Ordering::SeqCst)
                        .is_ok()
                {
                    self.signal_config();
                }
            }
        }
        if self.announce.load(Ordering::SeqCst) != ANNOUNCE_NONE {
            status |= S_ANNOUNCE;
        }
        let mut config = [0u8; 10];
        config[..6].copy_from_slice(&self.mac);
        config[6..8].copy_from_slice(&status.to_le_bytes());
        config[8..10].copy_from_slice(&1u16.to_le_bytes());
        config
    }

    /// What the tap may hand over (TUN_F_*): the offloads the guest accepts on receive.
    fn tap_offloads(&self) -> u32 {
        let mut flags = 0;
        if self.has(VIRTIO_NET_F_GUEST_CSUM) {
            flags |= libc::TUN_F_CSUM;
            if self.has(VIRTIO_NET_F_GUEST_TSO4) {
                flags |= libc::TUN_F_TSO4;
            }
            if self.has(VIRTIO_NET_F_GUEST_TSO6) {
                flags |= libc::TUN_F_TSO6;
            }
        }
        flags
    }

    /// Bring the tap's epoll interest in line with what the device can do now.
    fn sync_interest(&mut self, ops: &mut EventOps) {
        let mut want = EventSet::empty();
        if self.active.is_some() && !self.backend_gone {
            if !self.rx_starved && self.rx_pending == 0 {
                want |= EventSet::IN;
            }
            if self.tx_blocked {
                want |= EventSet::OUT;
            }
        }
        if want != self.interest
            && ops
                .modify(Events::new_raw(self.backend.as_raw_fd(), want))
                .is_ok()
        {
            self.interest = want;
        }
    }

    /// Answer the driver's control commands: the announce acknowledgement, nothing else.
    fn process_ctrl(&mut self) {
        let Some(active) = &mut self.active else {
            return;
        };
        let Active {
            mem,
            queues,
            interrupt,
        } = active;
        let queue = &mut queues[CTRL];
        let mut notify = false;
        for _ in 0..CTRL_BUDGET {
            let chain = match queue.iter(&*mem) {
                Ok(mut iter) => iter.next(),
                // Not set up (no CTRL_VQ), or a broken avail index.
                Err(_) => None,
            };
            let Some(chain) = chain else { break };
            let head = chain.head_index();
            let command = chain
                .clone()
                .reader(&*mem)
                .ok()
                .and_then(|mut r| r.read_obj::<[u8; 2]>().ok());
            let is_ack = command == Some([CTRL_ANNOUNCE, CTRL_ANNOUNCE_ACK]);
            let status = if is_ack { CTRL_OK } else { CTRL_ERR };
            // The ack byte is the first writable byte (after the readable command).
            let written = chain
                .writer(&*mem)
                .ok()
                .and_then(|mut w| w.write_obj(status).ok())
                .map_or(0, |()| 1);
            if is_ack && written == 1 {
                self.announce.store(ANNOUNCE_NONE, Ordering::SeqCst);
                self.counters.announce_acks += 1;
            } else {
                self.counters.ctrl_refused += 1;
            }
            if head >= queue.size() {
                continue;
            }
            match complete(queue, mem, head, written) {
                Ok(needs) => notify |= needs,
                Err(_) => break,
            }
        }
        // The driver waits (spinning) for each answer: it must be told to kick again.
        if let Ok(true) = queue.enable_notification(&*mem) {
            let _ = self.queue_events[CTRL].write(1);
        }
        if notify {
            let _ = interrupt.signal_used_queue();
        }
    }

    /// Everything there is to do, then the interest for the next wait.
    fn run(&mut self, ops: &mut EventOps) {
        if self.active.is_some()
            && self
                .announce
                .compare_exchange(
                    ANNOUNCE_PENDING,
                    ANNOUNCE_SIGNALLED,
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                )
                .is_ok()
        {
            self.counters.announces += 1;
            self.signal_config();
        }
        self.process_ctrl();
        if self.active.is_some()
            && self
                .link
                .compare_exchange(
                    LINK_DOWN_PENDING,
                    LINK_DOWN_SIGNALLED,
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                )
                .is_ok()
        {
            self.counters.announces += 1;
            self.signal_config();
        }
        self.process_tx();
        if self.rx_pending != 0 || !self.rx_starved {
            self.process_rx();
        }
        self.sync_interest(ops);
    }
}

/// What a NIC's frames go through on the host.
pub enum NetBackend {
    /// A tap (opened with IFF_TAP | IFF_NO_PI | IFF_VNET_HDR): a VM's own, or a clone's.
    Tap(OwnedFd),
    /// A `SOCK_SEQPACKET` or `SOCK_DGRAM` socket (see [`Net::with_socket`]).
    Socket(OwnedFd),
}

/// What restoring a NIC needs besides its state: its backend, and the MAC its config space
/// says (a clone's own; none keeps the saved one).
pub struct NetArgs {
    pub backend: NetBackend,
    pub mac: Option<MacAddr>,
}

impl Persist for Net {
    type State = NetState;
    type ConstructorArgs = NetArgs;
    type Error = NetError;

    fn save(&self) -> NetState {
        let status = match self.link.load(Ordering::SeqCst) {
            LINK_DOWN => 0,
            _ => S_LINK_UP,
        };
        NetState {
            mac: self.mac,
            acked_features: self.acked_features,
            status,
            policy: String::new(),
        }
    }

    /// A device from a snapshot over a new backend (a clone's own tap). The saved MAC is kept
    /// unless `args.mac` names another: for a clone with a MAC of its own, the config space
    /// says it (what a later snapshot saves), while the guest keeps the MAC it learnt until
    /// told otherwise (mayfly's agent sets the new one at the clone's refresh). Once running,
    /// the device flaps the guest's link (see the module docs) so it re-learns its neighbours.
    fn restore(args: NetArgs, state: &NetState) -> Result<Self, NetError> {
        let mac = args.mac.unwrap_or(state.mac);
        let net = match args.backend {
            NetBackend::Tap(tap) => Self::new(tap, mac)?,
            NetBackend::Socket(socket) => Self::with_socket(socket, mac)?,
        };
        net.restored(state)
    }
}

impl VirtioDevice for Net {
    fn name(&self) -> &'static str {
        "virtio-net"
    }

    fn describe(&self) -> Option<String> {
        Some(format!(
            "{} {:?}",
            self.mac
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(":"),
            self.counters
        ))
    }

    fn device_type(&self) -> u32 {
        VIRTIO_ID_NET
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE, QUEUE_SIZE, CTRL_QUEUE_SIZE]
    }
    fn queue_events(&self) -> &[EventFd] {
        &self.queue_events
    }
    fn features(&self) -> u64 {
        NET_FEATURES
    }
    fn ack_features(&mut self, features: u64) {
        self.acked_features = features & NET_FEATURES;
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let end = offset.saturating_add(data.len() as u64);
        // Bytes 6 and 7 are the status.
        let reads_status = offset < 8 && end > 6;
        let config = self.config(reads_status);
        data.fill(0);
        if let Some(bytes) = usize::try_from(offset).ok().and_then(|o| config.get(o..)) {
            let n = bytes.len().min(data.len());
            data[..n].copy_from_slice(&bytes[..n]);
        }
    }
    fn activate(
        &mut self,
        mem: GuestMemory,
        mut queues: Vec<Queue>,
        interrupt: Arc<Interrupt>,
    ) -> Result<(), ActivateError> {
        if queues.len() != 3 {
            return Err(ActivateError::QueueCount {
                found: queues.len(),
                expected: 3,
            });
        }
        let event_idx = self.has(VIRTIO_RING_F_EVENT_IDX);
        for queue in &mut queues {
            queue.set_event_idx(event_idx);
        }
        self.backend
            .set_offload(self.tap_offloads())
            .map_err(|e| ActivateError::Backend(format!("the tap refuses the offloads: {e}")))?;
        self.active = Some(Active {
            mem,
            queues,
            interrupt,
        });
        self.rx_starved = false;
        self.tx_blocked = false;
        // The event loop picks up from here (a restored device flaps its link first).
        for event in &self.queue_events {
            let _ = event.write(1);
        }
        Ok(())
    }
    fn reset(&mut self) {
        self.active = None;
        self.rx_pending = 0;
        self.rx_starved = false;
        self.tx_blocked = false;
        if self.link.load(Ordering::SeqCst) != LINK_DOWN {
            self.link.store(LINK_UP, Ordering::SeqCst);
        }
        self.announce.store(ANNOUNCE_NONE, Ordering::SeqCst);
        // The tap's interest is dropped on its next event (or the next queue kick).
        let _ = self.queue_events[RX].write(1);
    }
    fn queues(&self) -> Option<&[Queue]> {
        self.active.as_ref().map(|a| a.queues.as_slice())
    }
}

impl MutEventSubscriber for Net {
    fn process(&mut self, events: Events, ops: &mut EventOps) {
        let fd = events.fd();
        if fd == self.queue_events[RX].as_raw_fd() {
            drain(&self.queue_events[RX]);
            self.rx_starved = false;
        } else if fd == self.queue_events[TX].as_raw_fd() {
            drain(&self.queue_events[TX]);
        } else if fd == self.queue_events[CTRL].as_raw_fd() {
            drain(&self.queue_events[CTRL]);
        } else if fd == self.backend.as_raw_fd() {
            let set = events.event_set();
            if set.intersects(EventSet::HANG_UP | EventSet::ERROR) {
                // The tap was detached or the socket's peer closed: stop watching it (epoll
                // would report it forever). TX frames are dropped from now on.
                let _ = ops.remove(Events::new_raw(fd, EventSet::empty()));
                self.backend_gone = true;
                self.tx_blocked = false;
                self.interest = EventSet::empty();
            } else if set.contains(EventSet::OUT) {
                self.tx_blocked = false;
            }
        } else {
            let _ = ops.remove(Events::new_raw(fd, EventSet::empty()));
            return;
        }
        self.run(ops);
    }

    fn init(&mut self, ops: &mut EventOps) {
        // Registration only fails for a duplicate fd, which these cannot be.
        for event in &self.queue_events {
            let _ = ops.add(Events::new(event, EventSet::IN));
        }
        let _ = ops.add(Events::new_raw(self.backend.as_raw_fd(), EventSet::empty()));
        self.interest = EventSet::empty();
    }
}
