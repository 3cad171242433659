//! virtio-blk (virtio 1.2, section 5.2): the guest's disk, backed by a layered copy-on-write
//! [`Disk`]. One request queue, served on the device's own thread (its event loop), requests
//! carried out synchronously, straight between the disk files and guest memory.
//!
//! Supported: IN, OUT, FLUSH, GET_ID, DISCARD and WRITE_ZEROES; features VERSION_1, FLUSH,
//! BLK_SIZE (512-byte logical blocks, so any file system's block size works) with TOPOLOGY
//! (4 KiB physical blocks, the layers' block: the guest aligns its I/O to them and only odd
//! requests need the layer's read-modify-write), SEG_MAX/SIZE_MAX, RO for a read-only disk, DISCARD and WRITE_ZEROES for a writable
//! one, INDIRECT_DESC and EVENT_IDX.
//!
//! Batching: while the device drains the queue it asks the driver not to notify it (used-ring
//! flag or EVENT_IDX), and it interrupts the guest once per batch, when the driver asked for it.
//! A batch is at most [`QUEUE_SIZE`] requests; a guest that keeps the queue full gets the rest
//! on the loop's next turn (the device kicks itself), so other work is not starved.
//!
//! Snapshots: every chain popped is answered (a used entry) before the event that popped it
//! ends, so a paused device has nothing in flight. [`BlockState`] names the disk by its
//! [`DiskIdentity`]; the VMM reopens the disk's files and [`Block::restore`] checks they are
//! the ones the snapshot was taken on.

mod request;
mod spec;

use std::os::fd::AsRawFd;
use std::sync::Arc;

use event_manager::{EventOps, Events, MutEventSubscriber};
use serde::{Deserialize, Serialize};
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use super::{drain, ActivateError, GuestMemory, Interrupt, VirtioDevice, VIRTIO_F_VERSION_1};
use crate::disk::{Chain, Disk, DiskError, DiskIdentity, LayerInfo};
use crate::persist::Persist;
pub use request::BlockCounters;
use request::Engine;
pub use spec::*;

/// The block device's own state in a snapshot (its queue is the transport's to save).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockState {
    pub acked_features: u64,
    /// The serial number the guest read (it names the disk in /dev/disk/by-id).
    pub serial: String,
    pub read_only: bool,
    /// The disk's content when the state was saved (freeze first, so it stays that way).
    pub disk: DiskIdentity,
    /// The files it was read from ([`Disk::saved_chain`]): full paths as saved; a snapshot
    /// writer renames the layers to the copies (links) it keeps, relative to itself.
    pub chain: Chain,
}

/// Why a block device could not be made.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    #[error("the serial number {0:?} is longer than virtio-blk's 20 bytes: use a shorter one")]
    SerialTooLong(String),
    #[error("cannot create the block device's event descriptor: {0}")]
    EventFd(std::io::Error),
    // What the files opened are is not said: a snapshot names them, and the caller may not
    // be the one who may read them.
    #[error("the disk opened for the restored block device is not the one the snapshot saw (snapshot: {saved}): open the chain of layers the snapshot was taken on")]
    WrongDisk { saved: String },
    #[error("the snapshot's block device was {saved}, but its disk was opened {opened}: open it the same way")]
    ReadOnlyMismatch {
        saved: &'static str,
        opened: &'static str,
    },
    #[error(
        "the snapshot's block device accepted features {0:#x} that this device does not offer"
    )]
    Features(u64),
}

struct Active {
    mem: GuestMemory,
    queue: Queue,
    interrupt: Arc<Interrupt>,
}

pub struct Block {
    queue_events: Vec<EventFd>,
    active: Option<Active>,
    engine: Engine,
    features: u64,
    config: [u8; CONFIG_LEN],
}

fn describe(identity: &DiskIdentity) -> String {
    match identity.layers.last() {
        Some(top) => format!(
            "{} layers up to {top} on {:?}, {} bytes",
            identity.layers.len(),
            identity.base_identity,
            identity.disk_size
        ),
        None => format!(
            "the base {:?} alone, {} bytes",
            identity.base_identity, identity.disk_size
        ),
    }
}

impl Block {
    /// A block device over `disk`; `serial` (at most 20 bytes) is what GET_ID returns.
    pub fn new(disk: Disk, serial: &str) -> Result<Self, BlockError> {
        if serial.len() > SERIAL_LEN {
            return Err(BlockError::SerialTooLong(serial.to_string()));
        }
        let mut id = [0u8; SERIAL_LEN];
        id[..serial.len()].copy_from_slice(serial.as_bytes());
        let read_only = disk.is_read_only();
        let mut features = VIRTIO_F_VERSION_1
            | 1 << VIRTIO_BLK_F_SIZE_MAX
            | 1 << VIRTIO_BLK_F_SEG_MAX
            | 1 << VIRTIO_BLK_F_BLK_SIZE
            | 1 << VIRTIO_BLK_F_TOPOLOGY
            | 1 << VIRTIO_BLK_F_FLUSH
            | 1 << VIRTIO_RING_F_INDIRECT_DESC
            | 1 << VIRTIO_RING_F_EVENT_IDX;
        if read_only {
            features |= 1 << VIRTIO_BLK_F_RO;
        } else {
            features |= 1 << VIRTIO_BLK_F_DISCARD | 1 << VIRTIO_BLK_F_WRITE_ZEROES;
        }
        let config = config_space(disk.size());
        Ok(Self {
            queue_events: vec![EventFd::new(libc::EFD_NONBLOCK).map_err(BlockError::EventFd)?],
            active: None,
            engine: Engine::new(disk, id),
            features,
            config,
        })
    }

    pub fn disk(&self) -> &Disk {
        &self.engine.disk
    }

    pub fn disk_mut(&mut self) -> &mut Disk {
        &mut self.engine.disk
    }

    /// Freeze the disk's top layer and go on on a new one at `new_top` (see
    /// [`Disk::freeze`]). Call it with the device paused, before [`Block::save`].
    pub fn freeze(&mut self, new_top: &std::path::Path) -> Result<LayerInfo, DiskError> {
        self.engine.disk.freeze(new_top)
    }

    pub fn counters(&self) -> BlockCounters {
        self.engine.counters
    }

    /// Serve the requests on the queue: at most one batch, one interrupt.
    fn process_queue(&mut self) {
        let Some(active) = &mut self.active else {
            return;
        };
        let mem = &active.mem;
        let mut served = 0usize;
        let mut more = false;
        'batch: loop {
            // The driver need not notify while we are draining anyway.
            let _ = active.queue.disable_notification(mem);
            let mut popped = false;
            loop {
                if served >= usize::from(QUEUE_SIZE) {
                    more = true;
                    break 'batch;
                }
                let chain = match active.queue.iter(mem) {
                    Ok(mut iter) => iter.next(),
                    // Not ready, or an avail index beyond what the queue can hold: stop until
                    // the next notification. (Not `None`: notifications back on would find
                    // the same index "pending" and come round again, forever; the fuzzer's
                    // first find.)
                    // Notifications go back on first: the driver must not be told to stay
                    // quiet while nothing is being served.
                    Err(_) => {
                        let _ = active.queue.enable_notification(mem);
                        break 'batch;
                    }
                };
                let Some(chain) = chain else { break };
                let head = chain.head_index();
                popped = true;
                let len = self.engine.handle(mem, chain);
                served += 1;
                // Only the used ring being unwritable fails this: the queue is unusable.
                if active.queue.add_used(mem, head, len).is_err() {
                    break 'batch;
                }
            }
            // Notifications back on; anything that came meanwhile is served in this batch.
            match active.queue.enable_notification(mem) {
                Ok(true) if popped => continue,
                // More is pending, yet nothing could be popped: the driver added it just now,
                // or it laid its rings over each other so that turning notifications on or
                // off moves its avail index (the fuzzer's second find: that spun here
                // forever). Come back on the loop's next turn, where a pause or reset can
                // get in between.
                Ok(true) => {
                    more = true;
                    break;
                }
                _ => break,
            }
        }
        if more {
            // Leave notifications on, and come back for the rest on the loop's next turn.
            let _ = active.queue.enable_notification(mem);
            let _ = self.queue_events[0].write(1);
        }
        if served > 0 && active.queue.needs_notification(mem).unwrap_or(true) {
            self.engine.counters.interrupts += 1;
            let _ = active.interrupt.signal_used_queue();
        }
    }
}

/// The configuration space (virtio 1.2, 5.2.4) of a disk of `size` bytes.
fn config_space(size: u64) -> [u8; CONFIG_LEN] {
    let mut c = [0u8; CONFIG_LEN];
    let mut put = |at: usize, bytes: &[u8]| c[at..at + bytes.len()].copy_from_slice(bytes);
    put(0, &(size / SECTOR_SIZE).to_le_bytes()); // capacity
    put(8, &SIZE_MAX.to_le_bytes());
    put(12, &SEG_MAX.to_le_bytes());
    // 16: geometry (unused), 32: writeback (not offered).
    put(20, &BLK_SIZE.to_le_bytes());
    // Topology: physical blocks of 2^3 logical ones, no offset, minimum and optimal I/O of
    // one physical block (in logical blocks).
    let per_physical = PHYSICAL_BLOCK_SIZE / BLK_SIZE;
    // Both small: 3, and 8.
    let exponent = u8::try_from(per_physical.trailing_zeros()).expect("a shift below 32");
    put(24, &[exponent, 0]);
    put(26, &u16::try_from(per_physical).expect("8").to_le_bytes());
    put(28, &per_physical.to_le_bytes());
    put(34, &1u16.to_le_bytes()); // num_queues
    put(36, &MAX_DISCARD_SECTORS.to_le_bytes());
    put(40, &MAX_DISCARD_SEG.to_le_bytes());
    put(44, &DISCARD_SECTOR_ALIGNMENT.to_le_bytes());
    put(48, &MAX_WRITE_ZEROES_SECTORS.to_le_bytes());
    put(52, &MAX_DISCARD_SEG.to_le_bytes()); // max_write_zeroes_seg
    put(56, &[1]); // write_zeroes_may_unmap
    c
}

impl Persist for Block {
    type State = BlockState;
    type ConstructorArgs = Disk;
    type Error = BlockError;

    fn save(&self) -> BlockState {
        let serial = &self.engine.serial;
        let len = serial.iter().position(|&b| b == 0).unwrap_or(SERIAL_LEN);
        BlockState {
            acked_features: self.engine.acked_features,
            serial: String::from_utf8_lossy(&serial[..len]).into_owned(),
            read_only: self.engine.disk.is_read_only(),
            disk: self.engine.disk.identity(),
            chain: self.engine.disk.saved_chain(),
        }
    }

    /// The device again, over `disk` (reopened by the VMM from the files the snapshot
    /// recorded): it must read as the disk the state was saved with, opened the same way.
    fn restore(disk: Disk, state: &BlockState) -> Result<Self, BlockError> {
        let found = disk.identity();
        if !state.disk.same_content(&found) {
            return Err(BlockError::WrongDisk {
                saved: describe(&state.disk),
            });
        }
        let mode = |ro: bool| if ro { "read-only" } else { "writable" };
        if state.read_only != disk.is_read_only() {
            return Err(BlockError::ReadOnlyMismatch {
                saved: mode(state.read_only),
                opened: mode(disk.is_read_only()),
            });
        }
        let mut block = Self::new(disk, &state.serial)?;
        if state.acked_features & !block.features != 0 {
            return Err(BlockError::Features(state.acked_features & !block.features));
        }
        block.engine.acked_features = state.acked_features;
        Ok(block)
    }
}

impl VirtioDevice for Block {
    fn name(&self) -> &'static str {
        "virtio-blk"
    }

    fn describe(&self) -> Option<String> {
        Some(format!("{:?}", self.counters()))
    }

    fn device_type(&self) -> u32 {
        VIRTIO_ID_BLOCK
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE]
    }
    fn queue_events(&self) -> &[EventFd] {
        &self.queue_events
    }
    fn features(&self) -> u64 {
        self.features
    }
    fn ack_features(&mut self, features: u64) {
        self.engine.acked_features = features & self.features;
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        let Ok(start) = usize::try_from(offset) else {
            return;
        };
        if start >= CONFIG_LEN {
            return;
        }
        let n = data.len().min(CONFIG_LEN - start);
        data[..n].copy_from_slice(&self.config[start..start + n]);
    }
    fn activate(
        &mut self,
        mem: GuestMemory,
        mut queues: Vec<Queue>,
        interrupt: Arc<Interrupt>,
    ) -> Result<(), ActivateError> {
        if queues.len() != 1 {
            return Err(ActivateError::QueueCount {
                found: queues.len(),
                expected: 1,
            });
        }
        let mut queue = queues.remove(0);
        queue.set_event_idx(self.engine.acked_features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0);
        self.active = Some(Active {
            mem,
            queue,
            interrupt,
        });
        // Requests the driver made before (or across a snapshot) are served now.
        self.process_queue();
        Ok(())
    }
    fn reset(&mut self) {
        self.active = None;
        // What the guest wrote stays (a reset is not a power cut).
        let _ = self.engine.disk.flush();
    }
    fn queues(&self) -> Option<&[Queue]> {
        self.active.as_ref().map(|a| std::slice::from_ref(&a.queue))
    }
}

impl MutEventSubscriber for Block {
    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        if events.fd() == self.queue_events[0].as_raw_fd() {
            drain(&self.queue_events[0]);
            self.process_queue();
        }
    }

    fn init(&mut self, ops: &mut EventOps) {
        // Registration only fails for a duplicate fd, which a new eventfd cannot be.
        let _ = ops.add(Events::new(&self.queue_events[0], EventSet::IN));
    }
}

#[cfg(test)]
mod tests;
