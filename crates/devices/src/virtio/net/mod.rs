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
mod spec;
mod tap;
#[cfg(test)]
mod tests;

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

    // ---- TX: guest to tap ----

    /// Check a TX header against what was negotiated, and clear what the tap must not see.
    fn check_tx_header(&self, hdr: &mut [u8; VNET_HDR_LEN], frame_len: usize) -> Result<(), Bad> {
        let flags = u32::from(hdr[0]);
        let gso = u32::from(hdr[1]);
        let needs_csum = flags & VIRTIO_NET_HDR_F_NEEDS_CSUM != 0;
        if needs_csum {
            if !self.has(VIRTIO_NET_F_CSUM) {
                return Err(Bad::Header);
            }
            let start = usize::from(u16::from_le_bytes([hdr[6], hdr[7]]));
            let offset = usize::from(u16::from_le_bytes([hdr[8], hdr[9]]));
            if start + offset + 2 > frame_len {
                return Err(Bad::Header);
            }
        }
        // Only NEEDS_CSUM means anything on transmit.
        hdr[0] &= HDR_F_NEEDS_CSUM;
        let allowed = match gso {
            VIRTIO_NET_HDR_GSO_NONE => true,
            VIRTIO_NET_HDR_GSO_TCPV4 => self.has(VIRTIO_NET_F_HOST_TSO4),
            VIRTIO_NET_HDR_GSO_TCPV6 => self.has(VIRTIO_NET_F_HOST_TSO6),
            // ECN, UFO, USO: never offered.
            _ => false,
        };
        if !allowed {
            return Err(Bad::Header);
        }
        if gso != VIRTIO_NET_HDR_GSO_NONE {
            let gso_size = u16::from_le_bytes([hdr[4], hdr[5]]);
            if gso_size == 0 || !needs_csum {
                return Err(Bad::Header);
            }
        }
        // num_buffers means nothing on transmit.
        hdr[10] = 0;
        hdr[11] = 0;
        Ok(())
    }

    /// Send the TX frames the guest queued, at most [`TX_BUDGET`] of them.
    fn process_tx(&mut self) {
        if self.tx_blocked {
            return;
        }
        let Some(mut active) = self.active.take() else {
            return;
        };
        let mut notify = false;
        let mut handled = 0;
        let mut iovs: Vec<libc::iovec> = Vec::with_capacity(64);
        let _ = active.queues[TX].disable_notification(&active.mem);
        let mut rechecked = false;
        loop {
            if handled >= TX_BUDGET {
                // More may wait: come back once RX has had its turn.
                let _ = self.queue_events[TX].write(1);
                break;
            }
            let Active { mem, queues, .. } = &mut active;
            let chain = match queues[TX].iter(&*mem) {
                Ok(mut iter) => iter.next(),
                // The avail index is beyond what the queue can hold: the driver is broken.
                Err(_) => break,
            };
            let Some(chain) = chain else {
                match queues[TX].enable_notification(&*mem) {
                    // More arrived meanwhile: once. Pending again with nothing popped means
                    // rings laid over each other, so that turning notifications on or off
                    // moves the avail index (the fuzzer found that spin in the block device):
                    // come back on the loop's next turn instead.
                    Ok(true) if !rechecked => {
                        rechecked = true;
                        let _ = queues[TX].disable_notification(&*mem);
                        continue;
                    }
                    Ok(true) => {
                        let _ = self.queue_events[TX].write(1);
                        break;
                    }
                    _ => break,
                }
            };
            rechecked = false;
            let head = chain.head_index();
            handled += 1;
            let mut hdr = [0u8; VNET_HDR_LEN];
            match gather_tx(mem, chain, &mut iovs, &mut hdr) {
                Ok(len) => match self.check_tx_header(&mut hdr, len - VNET_HDR_LEN) {
                    Ok(()) => {
                        iovs[0] = libc::iovec {
                            iov_base: hdr.as_mut_ptr().cast(),
                            iov_len: VNET_HDR_LEN,
                        };
                        // SAFETY: iovs[0] is our header copy; the others point into guest
                        // memory that `gather_tx` checked and that `active.mem` keeps mapped
                        // throughout the call.
                        match unsafe { self.backend.writev(&iovs) } {
                            Ok(_) => {
                                self.counters.tx_frames += 1;
                                self.counters.tx_bytes += (len - VNET_HDR_LEN) as u64;
                            }
                            Err(e)
                                if e.kind() == ErrorKind::WouldBlock
                                    || e.kind() == ErrorKind::Interrupted =>
                            {
                                // Not now: the chain goes back on the ring, untouched.
                                queues[TX].go_to_previous_position();
                                self.counters.tx_deferred += 1;
                                self.tx_blocked = e.kind() == ErrorKind::WouldBlock;
                                if !self.tx_blocked {
                                    continue;
                                }
                                break;
                            }
                            Err(_) => self.counters.tx_dropped += 1,
                        }
                    }
                    Err(_) => self.counters.tx_malformed += 1,
                },
                Err(_) => self.counters.tx_malformed += 1,
            }
            if head >= queues[TX].size() {
                // A head beyond the table has no used entry to give back: it is lost.
                continue;
            }
            match complete(&mut queues[TX], mem, head, 0) {
                Ok(needs) => notify |= needs,
                // The used ring is not writable: nothing more can be done with this queue.
                Err(_) => break,
            }
        }
        if notify {
            let _ = active.interrupt.signal_used_queue();
        }
        self.active = Some(active);
    }

    // ---- RX: tap to guest ----

    /// Deliver frames from the tap, at most [`RX_BUDGET`] of them.
    fn process_rx(&mut self) {
        let Some(mut active) = self.active.take() else {
            return;
        };
        let mut notify = false;
        for _ in 0..RX_BUDGET {
            if self.rx_pending == 0 {
                // Read the tap only with a buffer to put the frame in.
                if !has_avail(&mut active.queues[RX], &active.mem) {
                    self.rx_starved = true;
                    break;
                }
                match self.backend.read(&mut self.rx_buf) {
                    // A socket backend whose peer is gone.
                    Ok(0) => break,
                    Ok(n) if n < VNET_HDR_LEN + MIN_FRAME_LEN => {
                        self.counters.rx_dropped += 1;
                        continue;
                    }
                    Ok(n) => self.rx_pending = n,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    // WouldBlock: nothing more now. Anything else (the tap went away): the
                    // next readiness event says so again.
                    Err(_) => break,
                }
            }
            match self.deliver(&mut active) {
                Ok(needs) => {
                    notify |= needs;
                    self.counters.rx_frames += 1;
                    self.counters.rx_bytes += (self.rx_pending - VNET_HDR_LEN) as u64;
                    self.rx_pending = 0;
                }
                Err(Deliver::NoRoom) => {
                    self.rx_starved = true;
                    break;
                }
                Err(Deliver::Dropped(needs)) => {
                    notify |= needs;
                    self.counters.rx_dropped += 1;
                    self.rx_pending = 0;
                }
                Err(Deliver::Broken) => break,
            }
        }
        if notify {
            let _ = active.interrupt.signal_used_queue();
        }
        self.active = Some(active);
    }

    /// Copy the pending frame into the guest's RX buffers.
    fn deliver(&mut self, active: &mut Active) -> Result<bool, Deliver> {
        let Active { mem, queues, .. } = active;
        let queue = &mut queues[RX];
        let frame = &self.rx_buf[..self.rx_pending];
        let mergeable = self.acked_features & bit(VIRTIO_NET_F_MRG_RXBUF) != 0;
        let start = queue.next_avail();
        self.rx_used.clear();
        let mut written = 0usize;
        // Where bytes 10 and 11 of the header (num_buffers) went.
        let mut num_buffers_at = [None::<GuestAddress>; 2];
        let mut malformed = false;
        let mut rechecked = false;
        while written < frame.len() {
            if !mergeable && !self.rx_used.is_empty() {
                // One buffer per frame, and this one did not fit: drop the frame and leave the
                // buffer to the next one.
                queue.set_next_avail(start);
                return Err(Deliver::Dropped(false));
            }
            let chain = match queue.iter(&*mem) {
                Ok(mut iter) => iter.next(),
                Err(_) => {
                    queue.set_next_avail(start);
                    return Err(Deliver::Broken);
                }
            };
            let Some(chain) = chain else {
                // Not enough buffers yet. Ask to be told of more (the driver's notification
                // threshold is what was taken so far), unless more arrived meanwhile: once
                // (see the TX side: overlapping rings would make this spin).
                match queue.enable_notification(&*mem) {
                    Ok(true) if !rechecked => {
                        rechecked = true;
                        continue;
                    }
                    _ => {
                        // Put back what was taken; the frame waits for more buffers.
                        queue.set_next_avail(start);
                        return Err(Deliver::NoRoom);
                    }
                }
            };
            rechecked = false;
            let head = chain.head_index();
            if head >= queue.size() {
                // A head beyond the table: nothing to write into or give back.
                self.counters.rx_malformed += 1;
                continue;
            }
            let mut chain_written = 0u32;
            let mut last_next = true;
            let mut any = false;
            for desc in chain {
                any = true;
                last_next = desc.has_next();
                if !desc.is_write_only() {
                    malformed = true;
                    break;
                }
                let take = (desc.len() as usize).min(frame.len() - written);
                if take == 0 {
                    continue;
                }
                if mem
                    .write_slice(&frame[written..written + take], desc.addr())
                    .is_err()
                {
                    malformed = true;
                    break;
                }
                for (i, at) in num_buffers_at.iter_mut().enumerate() {
                    let index = 10 + i;
                    if at.is_none() && (written..written + take).contains(&index) {
                        *at = desc.addr().checked_add((index - written) as u64);
                    }
                }
                written += take;
                // At most the descriptor's own (u32) length.
                chain_written += u32::try_from(take).expect("a piece of one descriptor");
            }
            if !any || last_next {
                // The chain ended early (a loop, a `next` past the table): it is broken.
                malformed = true;
            }
            self.rx_used.push((head, chain_written));
            if malformed {
                break;
            }
        }
        if malformed {
            // Give back every chain taken for this frame, empty, and drop the frame: the
            // driver counts each as a length error.
            self.counters.rx_malformed += 1;
            let mut needs = false;
            for &(head, _) in &self.rx_used {
                match complete(queue, mem, head, 0) {
                    Ok(n) => needs |= n,
                    Err(_) => return Err(Deliver::Broken),
                }
            }
            return Err(Deliver::Dropped(needs));
        }
        // At most a queue's worth of buffers.
        let count = u16::try_from(self.rx_used.len())
            .unwrap_or(u16::MAX)
            .to_le_bytes();
        for (at, byte) in num_buffers_at.iter().zip(count) {
            if let Some(at) = at {
                let _ = mem.write_obj(byte, *at);
            }
        }
        let mut needs = false;
        for &(head, len) in &self.rx_used {
            match complete(queue, mem, head, len) {
                Ok(n) => needs |= n,
                Err(_) => return Err(Deliver::Broken),
            }
        }
        Ok(needs)
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

enum Deliver {
    /// The guest has not posted enough buffers for this frame.
    NoRoom,
    /// The frame was dropped; whether the guest should be interrupted.
    Dropped(bool),
    /// The queue cannot be used (its rings are not where they can be read or written).
    Broken,
}

/// Whether the guest posted a buffer not yet taken.
fn has_avail(queue: &mut Queue, mem: &GuestMemory) -> bool {
    let next = queue.next_avail();
    match queue.avail_idx(mem, Ordering::Acquire) {
        Ok(idx) if idx.0 != next => true,
        Ok(_) => matches!(queue.enable_notification(mem), Ok(true)),
        Err(_) => false,
    }
}

/// The iovecs of a TX chain (index 0 left for mayfly's copy of the header, which goes to
/// `hdr`), and the chain's length. Refuses what the module docs list.
fn gather_tx(
    mem: &GuestMemory,
    chain: virtio_queue::DescriptorChain<&GuestMemory>,
    iovs: &mut Vec<libc::iovec>,
    hdr: &mut [u8; VNET_HDR_LEN],
) -> Result<usize, Bad> {
    iovs.clear();
    iovs.push(libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    });
    let mut total = 0usize;
    let mut hdr_filled = 0usize;
    let mut last_next = true;
    let mut any = false;
    for desc in chain {
        any = true;
        last_next = desc.has_next();
        if desc.is_write_only() {
            return Err(Bad::Direction);
        }
        let len = desc.len() as usize;
        total += len;
        if total > VNET_HDR_LEN + MAX_FRAME_LEN {
            return Err(Bad::TooLong);
        }
        if len == 0 {
            continue;
        }
        let mut covered = 0usize;
        for slice in GuestMemoryBackend::get_slices(mem, desc.addr(), len) {
            let mut slice = slice.map_err(|_| Bad::Chain)?;
            covered += slice.len();
            if hdr_filled < VNET_HDR_LEN {
                let take = (VNET_HDR_LEN - hdr_filled).min(slice.len());
                slice.copy_to(&mut hdr[hdr_filled..hdr_filled + take]);
                hdr_filled += take;
                slice = slice.offset(take).map_err(|_| Bad::Chain)?;
            }
            if !slice.is_empty() {
                if iovs.len() >= libc::UIO_MAXIOV as usize {
                    return Err(Bad::Chain);
                }
                iovs.push(libc::iovec {
                    iov_base: slice.ptr_guard().as_ptr().cast_mut().cast(),
                    iov_len: slice.len(),
                });
            }
        }
        if covered != len {
            return Err(Bad::Chain);
        }
    }
    if !any || last_next {
        // Empty, or cut short by a loop, a `next` past the table or unreadable memory.
        return Err(Bad::Chain);
    }
    if total < VNET_HDR_LEN + MIN_FRAME_LEN {
        return Err(Bad::TooShort);
    }
    Ok(total)
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
