//! virtio devices over the MMIO transport (virtio 1.x, "modern" virtio-mmio version 2).
//!
//! - [`mmio::MmioTransport`]: the registers a guest driver programs (features, queues,
//!   status), on the MMIO bus; it hands the configured queues to its device at DRIVER_OK.
//! - [`VirtioDevice`]: what a device is to its transport: type, queues, features, config
//!   space, and activation. Each device serves its queues on a thread of its own
//!   ([`thread::DeviceThread`]), woken by the queues' ioeventfds, and interrupts the guest
//!   through an irqfd ([`Interrupt`]).
//! - Devices: [`rng`] (entropy from the host) and [`vsock`] (sockets between guest and host).
//!
//! The guest is the adversary: every ring index, descriptor and length it writes is checked
//! (by the `virtio-queue` crate's queue and descriptor-chain code, and by each device's own
//! parsing), and a device that cannot make sense of what the driver did marks itself as
//! needing a reset instead of guessing.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use event_manager::MutEventSubscriber;
use serde::{Deserialize, Serialize};
use virtio_queue::{Queue, QueueT};
use vmm_sys_util::eventfd::EventFd;

pub mod block;
#[cfg(test)]
pub(crate) mod contract;
pub mod device;
pub mod mmio;
pub mod net;
pub mod rng;
pub mod thread;
pub mod vsock;

/// Guest memory as devices see it.
pub type GuestMemory = vm_memory::GuestMemoryMmap<()>;

/// `VIRTIO_F_VERSION_1`: the device is a virtio 1.x device (required by the modern transport).
pub const VIRTIO_F_VERSION_1: u64 = 1 << virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
/// Bytes of MMIO space one transport takes (registers, then the device's config space).
pub const MMIO_WINDOW: u64 = 0x1000;

/// The interrupt of one virtio-mmio device: the InterruptStatus bits the guest reads, and the
/// irqfd that raises the device's interrupt line.
pub struct Interrupt {
    status: AtomicU32,
    irqfd: EventFd,
}

impl Interrupt {
    pub fn new(irqfd: EventFd) -> Self {
        Self {
            status: AtomicU32::new(0),
            irqfd,
        }
    }

    /// "A used ring changed": the guest looks at the device's queues.
    pub fn signal_used_queue(&self) -> std::io::Result<()> {
        self.signal(virtio_bindings::virtio_mmio::VIRTIO_MMIO_INT_VRING)
    }

    /// "The configuration changed" (or the device needs a reset).
    pub fn signal_config_change(&self) -> std::io::Result<()> {
        self.signal(virtio_bindings::virtio_mmio::VIRTIO_MMIO_INT_CONFIG)
    }

    fn signal(&self, bit: u32) -> std::io::Result<()> {
        self.status.fetch_or(bit, Ordering::SeqCst);
        self.irqfd.write(1)
    }

    pub fn status(&self) -> u32 {
        self.status.load(Ordering::SeqCst)
    }

    /// The guest acknowledged `bits` (InterruptACK).
    pub fn ack(&self, bits: u32) {
        self.status.fetch_and(!bits, Ordering::SeqCst);
    }

    /// Restore the status a snapshot saw. The line is not raised here: see
    /// [`Interrupt::raise_pending`].
    pub fn restore(&self, status: u32) {
        self.status.store(status, Ordering::SeqCst);
    }

    /// Raise the line again if anything is pending: an interrupt in flight when the snapshot
    /// was taken would otherwise be lost. Call it once the vCPUs' interrupt controllers are
    /// restored: an interrupt raised before lands in a LAPIC state that the restore then
    /// overwrites.
    pub fn raise_pending(&self) -> std::io::Result<()> {
        if self.status() != 0 {
            self.irqfd.write(1)?;
        }
        Ok(())
    }
}

/// Why a device could not start serving its queues.
#[derive(Debug, thiserror::Error)]
pub enum ActivateError {
    #[error("queue {0} is not usable: the driver gave it addresses outside guest memory or an invalid size")]
    BadQueue(usize),
    #[error("the driver set up {found} queues; the device has {expected}")]
    QueueCount { found: usize, expected: usize },
    #[error("the device cannot start: {0}")]
    Backend(String),
}

/// A virtio device, as its transport drives it. Implementations also subscribe to their own
/// event loop ([`MutEventSubscriber`]): the queue eventfds and whatever host file descriptors
/// serve them.
pub trait VirtioDevice: MutEventSubscriber + Send {
    /// Its name, for its thread and in messages: `virtio-rng`, `virtio-blk`, ...
    fn name(&self) -> &'static str;
    /// What it is doing, in a few words, for the VMM's state dump (its counters, its
    /// connections); none for a device with nothing to say.
    fn describe(&self) -> Option<String> {
        None
    }
    /// The virtio device ID (`VIRTIO_ID_*`).
    fn device_type(&self) -> u32;
    /// How many queues the device has, and the largest size of each.
    fn queue_max_sizes(&self) -> &[u16];
    /// The eventfds the guest's queue notifications arrive on, one per queue.
    fn queue_events(&self) -> &[EventFd];
    /// The features the device offers.
    fn features(&self) -> u64;
    /// The driver accepted `features` (a subset of [`VirtioDevice::features`]).
    fn ack_features(&mut self, features: u64);
    /// Read the device's configuration space at `offset`.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// The driver writes the configuration space (most devices ignore it).
    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}
    /// DRIVER_OK: serve these queues. The queues are valid (checked by the transport).
    fn activate(
        &mut self,
        mem: GuestMemory,
        queues: Vec<Queue>,
        interrupt: Arc<Interrupt>,
    ) -> Result<(), ActivateError>;
    /// The driver reset the device: stop serving, forget the queues.
    fn reset(&mut self);
    /// The queues the device serves (for a snapshot), if it is activated.
    fn queues(&self) -> Option<&[Queue]>;
}

/// A queue as a snapshot keeps it (virtio-queue's `QueueState`, which is not serializable).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueSnapshot {
    pub max_size: u16,
    pub size: u16,
    pub ready: bool,
    pub desc_table: u64,
    pub avail_ring: u64,
    pub used_ring: u64,
    pub next_avail: u16,
    pub next_used: u16,
    pub event_idx: bool,
}

impl QueueSnapshot {
    pub fn of(queue: &Queue) -> Self {
        let s = queue.state();
        Self {
            max_size: s.max_size,
            size: s.size,
            ready: s.ready,
            desc_table: s.desc_table,
            avail_ring: s.avail_ring,
            used_ring: s.used_ring,
            next_avail: s.next_avail,
            next_used: s.next_used,
            event_idx: s.event_idx_enabled,
        }
    }

    /// The queue again, checked like anything read from a file: a size that is not a power of
    /// two, misaligned rings or a size beyond `max_size` are errors. (Whether the rings lie in
    /// guest memory is checked against the memory when the device activates.)
    pub fn to_queue(&self, max_size: u16) -> Result<Queue, String> {
        if self.max_size != max_size {
            return Err(format!(
                "a queue of at most {} entries where the device has {max_size}",
                self.max_size
            ));
        }
        Queue::try_from(virtio_queue::QueueState {
            max_size: self.max_size,
            next_avail: self.next_avail,
            next_used: self.next_used,
            event_idx_enabled: self.event_idx,
            size: self.size,
            ready: self.ready,
            desc_table: self.desc_table,
            avail_ring: self.avail_ring,
            used_ring: self.used_ring,
        })
        .map_err(|e| format!("an invalid queue ({e:?})"))
    }
}

/// Queues of `max_sizes`, as the driver finds them after a reset.
pub fn new_queues(max_sizes: &[u16]) -> Vec<Queue> {
    max_sizes
        .iter()
        .map(|&max| Queue::new(max).expect("device queue sizes are powers of two"))
        .collect()
}

/// Take everything waiting on an eventfd (a queue notification), so it does not fire again.
pub fn drain(event: &EventFd) {
    let _ = event.read();
}

/// Add a used element and interrupt the guest if it asked to be told. Errors mean the driver
/// put the used ring somewhere it cannot be written: the device stops using the queue.
pub fn complete(
    queue: &mut Queue,
    mem: &GuestMemory,
    head: u16,
    len: u32,
) -> Result<bool, virtio_queue::Error> {
    queue.add_used(mem, head, len)?;
    queue.needs_notification(mem)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_snapshots_refuse_what_no_driver_could_set() {
        let queue = Queue::new(256).unwrap();
        let snap = QueueSnapshot::of(&queue);
        assert!(snap.to_queue(256).is_ok());
        assert!(snap.to_queue(128).is_err(), "another device's queue");
        let odd = QueueSnapshot { size: 100, ..snap };
        assert!(odd.to_queue(256).is_err(), "not a power of two");
        let big = QueueSnapshot { size: 512, ..snap };
        assert!(big.to_queue(256).is_err(), "beyond the maximum");
        let misaligned = QueueSnapshot {
            desc_table: 0x1001,
            ..snap
        };
        assert!(misaligned.to_queue(256).is_err());
    }

    #[test]
    fn interrupt_status_is_set_acked_and_restored() {
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let interrupt = Interrupt::new(irq.try_clone().unwrap());
        interrupt.signal_used_queue().unwrap();
        assert_eq!(interrupt.status(), 1);
        assert_eq!(irq.read().unwrap(), 1);
        interrupt.ack(1);
        assert_eq!(interrupt.status(), 0);
        interrupt.restore(2);
        assert_eq!(interrupt.status(), 2);
        assert!(
            irq.read().is_err(),
            "not raised before the vCPUs are restored"
        );
        interrupt.raise_pending().unwrap();
        assert_eq!(
            irq.read().unwrap(),
            1,
            "a pending interrupt is raised again"
        );
    }
}
