//! The virtio-mmio transport, version 2 (virtio 1.x, section 4.2): the registers through which
//! a guest driver discovers a device, negotiates features, sets up its queues and drives the
//! status state machine. At DRIVER_OK the transport checks every queue the driver made ready
//! against guest memory and hands them to its device; a driver that set up something
//! unusable gets DEVICE_NEEDS_RESET, never a device running on bad addresses.

use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK,
    VIRTIO_CONFIG_S_FAILED, VIRTIO_CONFIG_S_FEATURES_OK, VIRTIO_CONFIG_S_NEEDS_RESET,
};
use virtio_bindings::virtio_mmio::*;
use virtio_queue::{Queue, QueueT};

use super::{new_queues, GuestMemory, Interrupt, QueueSnapshot, VirtioDevice};
use crate::bus::{lock, BusDevice};
use crate::persist::Persist;

/// How many refused driver setups a VMM logs (see `set_status`).
const MAX_SETUP_REFUSALS_LOGGED: u32 = 8;

/// "virt", little-endian.
const MAGIC: u32 = 0x7472_6976;
const VERSION: u32 = 2;
/// No vendor in particular.
const VENDOR_ID: u32 = 0;

/// What the transport itself holds, as a snapshot keeps it. (The device saves its own state;
/// once it is activated, the queues are the device's.)
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MmioTransportState {
    pub status: u32,
    pub device_features_select: u32,
    pub driver_features_select: u32,
    pub driver_features: u64,
    pub queue_select: u32,
    pub interrupt_status: u32,
    pub config_generation: u32,
    /// The queues as the driver programmed them.
    pub queues: Vec<QueueSnapshot>,
    pub activated: bool,
}

pub struct MmioTransport {
    device: Arc<Mutex<dyn VirtioDevice>>,
    mem: GuestMemory,
    interrupt: Arc<Interrupt>,
    status: u32,
    device_features_select: u32,
    driver_features_select: u32,
    driver_features: u64,
    queue_select: u32,
    config_generation: u32,
    /// The queues while the driver configures them; handed to the device at DRIVER_OK.
    queues: Vec<Queue>,
    /// Queues the driver gave a size no queue can have (`virtio-queue` ignores such a size, so
    /// the queue would otherwise run at its maximum size, not the one the driver allocated).
    bad_size: Vec<bool>,
    activated: bool,
}

impl MmioTransport {
    pub fn new(
        device: Arc<Mutex<dyn VirtioDevice>>,
        mem: GuestMemory,
        interrupt: Arc<Interrupt>,
    ) -> Self {
        let queues = new_queues(lock(&device).queue_max_sizes());
        Self {
            device,
            mem,
            interrupt,
            status: 0,
            device_features_select: 0,
            driver_features_select: 0,
            driver_features: 0,
            queue_select: 0,
            config_generation: 0,
            bad_size: vec![false; queues.len()],
            queues,
            activated: false,
        }
    }

    pub fn interrupt(&self) -> &Arc<Interrupt> {
        &self.interrupt
    }

    pub fn device(&self) -> &Arc<Mutex<dyn VirtioDevice>> {
        &self.device
    }

    pub fn is_activated(&self) -> bool {
        self.activated
    }

    /// Raise the interrupt a snapshot saw pending (see [`Interrupt::raise_pending`]).
    pub fn raise_pending_interrupt(&self) -> std::io::Result<()> {
        self.interrupt.raise_pending()
    }

    fn selected_queue(&mut self) -> Option<&mut Queue> {
        // Before activation only: after it, the device owns the queues.
        if self.activated {
            return None;
        }
        self.queues.get_mut(self.queue_select as usize)
    }

    fn queue_value(&self, f: impl Fn(&Queue) -> u32) -> u32 {
        self.queues
            .get(self.queue_select as usize)
            .map(f)
            .unwrap_or(0)
    }

    fn update_queue(&mut self, f: impl FnOnce(&mut Queue)) {
        // The driver may only change a queue while the device is not running (and the queue is
        // not ready yet): a change later is ignored, as the spec lets a device do.
        if self.status & VIRTIO_CONFIG_S_DRIVER_OK != 0 {
            return;
        }
        if let Some(queue) = self.selected_queue() {
            f(queue);
        }
    }

    /// Check the queues and start the device. On failure the device needs a reset.
    fn activate(&mut self) -> Result<(), super::ActivateError> {
        for (index, queue) in self.queues.iter().enumerate() {
            if queue.ready() && (self.bad_size[index] || !queue.is_valid(&self.mem)) {
                return Err(super::ActivateError::BadQueue(index));
            }
        }
        let queues = std::mem::replace(
            &mut self.queues,
            new_queues(lock(&self.device).queue_max_sizes()),
        );
        lock(&self.device).activate(self.mem.clone(), queues, self.interrupt.clone())?;
        self.activated = true;
        Ok(())
    }

    fn reset(&mut self) {
        if self.activated {
            lock(&self.device).reset();
        }
        self.activated = false;
        self.status = 0;
        self.driver_features = 0;
        self.device_features_select = 0;
        self.driver_features_select = 0;
        self.queue_select = 0;
        self.queues = new_queues(lock(&self.device).queue_max_sizes());
        self.bad_size = vec![false; self.queues.len()];
        self.interrupt.ack(u32::MAX);
    }

    fn set_status(&mut self, status: u32) {
        if status == 0 {
            self.reset();
            return;
        }
        // Bits only ever get set, in order; a driver that clears one (other than by writing 0)
        // or skips a step is refused: the status stays as it was.
        let added = status & !self.status;
        if status & self.status != self.status {
            return;
        }
        if added & VIRTIO_CONFIG_S_FAILED != 0 {
            self.status = status;
            return;
        }
        if added & VIRTIO_CONFIG_S_DRIVER != 0 && self.status & VIRTIO_CONFIG_S_ACKNOWLEDGE == 0 {
            return;
        }
        if added & VIRTIO_CONFIG_S_FEATURES_OK != 0 {
            if self.status & VIRTIO_CONFIG_S_DRIVER == 0 {
                return;
            }
            let offered = lock(&self.device).features();
            // A modern device requires VERSION_1; features it never offered are refused. The
            // driver reads FEATURES_OK back and gives up if it is not set.
            if self.driver_features & !offered != 0
                || self.driver_features & super::VIRTIO_F_VERSION_1 == 0
            {
                self.status = status & !VIRTIO_CONFIG_S_FEATURES_OK;
                return;
            }
            lock(&self.device).ack_features(self.driver_features);
        }
        if added & VIRTIO_CONFIG_S_DRIVER_OK != 0 {
            if self.status & VIRTIO_CONFIG_S_FEATURES_OK == 0 {
                return;
            }
            self.status = status;
            if let Err(err) = self.activate() {
                // The driver is at fault, the VM goes on. Logged for the first few only: a
                // driver that resets and tries again without end must not fill the VMM's
                // log (it is on the host's disk, and not the guest's to fill).
                static LOGGED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
                let n = LOGGED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if n < MAX_SETUP_REFUSALS_LOGGED {
                    eprintln!("mayfly: a virtio device refused its driver's setup: {err}");
                } else if n == MAX_SETUP_REFUSALS_LOGGED {
                    eprintln!(
                        "mayfly: a virtio device refused its driver's setup again; further refusals are not logged"
                    );
                }
                self.status |= VIRTIO_CONFIG_S_NEEDS_RESET;
                let _ = self.interrupt.signal_config_change();
            }
            return;
        }
        self.status = status;
    }
}

impl Persist for MmioTransport {
    type State = MmioTransportState;
    /// The device it drives (restored from its own state first), guest memory, its interrupt.
    type ConstructorArgs = (Arc<Mutex<dyn VirtioDevice>>, GuestMemory, Arc<Interrupt>);
    type Error = String;

    /// The transport's state; with an activated device the queues come from the device.
    fn save(&self) -> MmioTransportState {
        let device = lock(&self.device);
        let queues = match (self.activated, device.queues()) {
            (true, Some(queues)) => queues.iter().map(QueueSnapshot::of).collect(),
            _ => self.queues.iter().map(QueueSnapshot::of).collect(),
        };
        MmioTransportState {
            status: self.status,
            device_features_select: self.device_features_select,
            driver_features_select: self.driver_features_select,
            driver_features: self.driver_features,
            queue_select: self.queue_select,
            interrupt_status: self.interrupt.status(),
            config_generation: self.config_generation,
            queues,
            activated: self.activated,
        }
    }

    /// A transport in a saved state, over a device restored from its own state. An activated
    /// device is activated again with the saved queues (checked against guest memory: a state
    /// whose rings point outside it is refused).
    fn restore(
        (device, mem, interrupt): (Arc<Mutex<dyn VirtioDevice>>, GuestMemory, Arc<Interrupt>),
        state: &MmioTransportState,
    ) -> Result<Self, String> {
        let max_sizes = lock(&device).queue_max_sizes().to_vec();
        if state.queues.len() != max_sizes.len() {
            return Err(format!(
                "{} queues saved for a device with {}",
                state.queues.len(),
                max_sizes.len()
            ));
        }
        let queues = state
            .queues
            .iter()
            .zip(&max_sizes)
            .map(|(q, &max)| q.to_queue(max))
            .collect::<Result<Vec<_>, _>>()?;
        let offered = lock(&device).features();
        if state.driver_features & !offered != 0 {
            return Err(format!(
                "driver features {:#x} the device does not offer",
                state.driver_features & !offered
            ));
        }
        let mut transport = Self {
            device,
            mem,
            interrupt,
            status: state.status,
            device_features_select: state.device_features_select,
            driver_features_select: state.driver_features_select,
            driver_features: state.driver_features,
            queue_select: state.queue_select,
            config_generation: state.config_generation,
            bad_size: vec![false; queues.len()],
            queues,
            activated: false,
        };
        lock(&transport.device).ack_features(state.driver_features);
        if state.activated {
            transport
                .activate()
                .map_err(|e| format!("the device does not start again: {e}"))?;
        }
        transport.interrupt.restore(state.interrupt_status);
        Ok(transport)
    }
}

fn read_u32(data: &[u8]) -> Option<u32> {
    let bytes: [u8; 4] = data.try_into().ok()?;
    Some(u32::from_le_bytes(bytes))
}

impl BusDevice for MmioTransport {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= u64::from(VIRTIO_MMIO_CONFIG) {
            lock(&self.device).read_config(offset - u64::from(VIRTIO_MMIO_CONFIG), data);
            return;
        }
        // Registers are 32 bits wide, read whole.
        if data.len() != 4 {
            data.fill(0);
            return;
        }
        // Below VIRTIO_MMIO_CONFIG (checked above), so it fits.
        let register = u32::try_from(offset).expect("a register offset");
        let value = match register {
            VIRTIO_MMIO_MAGIC_VALUE => MAGIC,
            VIRTIO_MMIO_VERSION => VERSION,
            VIRTIO_MMIO_DEVICE_ID => lock(&self.device).device_type(),
            VIRTIO_MMIO_VENDOR_ID => VENDOR_ID,
            VIRTIO_MMIO_DEVICE_FEATURES => {
                let features = lock(&self.device).features();
                match self.device_features_select {
                    0 => low_half(features),
                    1 => low_half(features >> 32),
                    _ => 0,
                }
            }
            VIRTIO_MMIO_QUEUE_NUM_MAX => self.queue_value(|q| u32::from(q.max_size())),
            VIRTIO_MMIO_QUEUE_READY => self.queue_value(|q| u32::from(q.ready())),
            VIRTIO_MMIO_INTERRUPT_STATUS => self.interrupt.status(),
            VIRTIO_MMIO_STATUS => self.status,
            VIRTIO_MMIO_CONFIG_GENERATION => self.config_generation,
            _ => 0,
        };
        data.copy_from_slice(&value.to_le_bytes());
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= u64::from(VIRTIO_MMIO_CONFIG) {
            lock(&self.device).write_config(offset - u64::from(VIRTIO_MMIO_CONFIG), data);
            return;
        }
        let Some(value) = read_u32(data) else {
            return;
        };
        let low =
            |q: &mut Queue, f: fn(&mut Queue, Option<u32>, Option<u32>)| f(q, Some(value), None);
        let high =
            |q: &mut Queue, f: fn(&mut Queue, Option<u32>, Option<u32>)| f(q, None, Some(value));
        // Below VIRTIO_MMIO_CONFIG (checked above), so it fits.
        let register = u32::try_from(offset).expect("a register offset");
        match register {
            VIRTIO_MMIO_DEVICE_FEATURES_SEL => self.device_features_select = value,
            VIRTIO_MMIO_DRIVER_FEATURES_SEL => self.driver_features_select = value,
            // Features are fixed once accepted.
            VIRTIO_MMIO_DRIVER_FEATURES if self.status & VIRTIO_CONFIG_S_FEATURES_OK == 0 => {
                match self.driver_features_select {
                    0 => {
                        self.driver_features =
                            (self.driver_features & !0xffff_ffff) | u64::from(value)
                    }
                    1 => {
                        self.driver_features =
                            (self.driver_features & 0xffff_ffff) | (u64::from(value) << 32)
                    }
                    _ => {}
                }
            }
            VIRTIO_MMIO_QUEUE_SEL => self.queue_select = value,
            VIRTIO_MMIO_QUEUE_NUM => {
                // A size that is zero, too big or not a power of two makes the queue fail the
                // check at DRIVER_OK.
                let index = self.queue_select as usize;
                let mut valid = false;
                self.update_queue(|q| {
                    valid = u16::try_from(value).is_ok_and(|size| q.try_set_size(size).is_ok());
                });
                if let Some(bad) = self.bad_size.get_mut(index) {
                    if self.status & VIRTIO_CONFIG_S_DRIVER_OK == 0 && !self.activated {
                        *bad = !valid;
                    }
                }
            }
            VIRTIO_MMIO_QUEUE_READY => self.update_queue(|q| q.set_ready(value == 1)),
            VIRTIO_MMIO_QUEUE_DESC_LOW => {
                self.update_queue(|q| low(q, Queue::set_desc_table_address))
            }
            VIRTIO_MMIO_QUEUE_DESC_HIGH => {
                self.update_queue(|q| high(q, Queue::set_desc_table_address))
            }
            VIRTIO_MMIO_QUEUE_AVAIL_LOW => {
                self.update_queue(|q| low(q, Queue::set_avail_ring_address))
            }
            VIRTIO_MMIO_QUEUE_AVAIL_HIGH => {
                self.update_queue(|q| high(q, Queue::set_avail_ring_address))
            }
            VIRTIO_MMIO_QUEUE_USED_LOW => {
                self.update_queue(|q| low(q, Queue::set_used_ring_address))
            }
            VIRTIO_MMIO_QUEUE_USED_HIGH => {
                self.update_queue(|q| high(q, Queue::set_used_ring_address))
            }
            VIRTIO_MMIO_QUEUE_NOTIFY => {
                // Normally an ioeventfd catches this write before it leaves KVM; without one
                // the transport passes it on.
                let device = lock(&self.device);
                if let Some(event) = device.queue_events().get(value as usize) {
                    let _ = event.write(1);
                }
            }
            VIRTIO_MMIO_INTERRUPT_ACK => self.interrupt.ack(value),
            VIRTIO_MMIO_STATUS => self.set_status(value),
            _ => {}
        }
    }
}

/// The low 32 bits of a 64-bit register pair's value (the feature words).
fn low_half(value: u64) -> u32 {
    u32::try_from(value & u64::from(u32::MAX)).expect("32 bits")
}

#[cfg(test)]
mod tests {
    use super::*;
    use event_manager::{EventOps, Events, MutEventSubscriber};
    use vm_memory::GuestAddress;
    use vmm_sys_util::eventfd::EventFd;

    /// A device that records what its transport did to it.
    struct Dummy {
        events: Vec<EventFd>,
        queues: Option<Vec<Queue>>,
        acked: u64,
        resets: u32,
    }

    impl MutEventSubscriber for Dummy {
        fn process(&mut self, _: Events, _: &mut EventOps) {}
        fn init(&mut self, _: &mut EventOps) {}
    }

    impl VirtioDevice for Dummy {
        fn name(&self) -> &'static str {
            "dummy"
        }

        fn device_type(&self) -> u32 {
            42
        }
        fn queue_max_sizes(&self) -> &[u16] {
            &[16, 16]
        }
        fn queue_events(&self) -> &[EventFd] {
            &self.events
        }
        fn features(&self) -> u64 {
            super::super::VIRTIO_F_VERSION_1 | 1
        }
        fn ack_features(&mut self, features: u64) {
            self.acked = features;
        }
        fn read_config(&self, offset: u64, data: &mut [u8]) {
            data.fill(offset as u8);
        }
        fn activate(
            &mut self,
            _mem: GuestMemory,
            queues: Vec<Queue>,
            _interrupt: Arc<Interrupt>,
        ) -> Result<(), super::super::ActivateError> {
            self.queues = Some(queues);
            Ok(())
        }
        fn reset(&mut self) {
            self.queues = None;
            self.resets += 1;
        }
        fn queues(&self) -> Option<&[Queue]> {
            self.queues.as_deref()
        }
    }

    fn setup() -> (MmioTransport, Arc<Mutex<Dummy>>, EventFd) {
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let dummy = Arc::new(Mutex::new(Dummy {
            events: vec![
                EventFd::new(libc::EFD_NONBLOCK).unwrap(),
                EventFd::new(libc::EFD_NONBLOCK).unwrap(),
            ],
            queues: None,
            acked: 0,
            resets: 0,
        }));
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let interrupt = Arc::new(Interrupt::new(irq.try_clone().unwrap()));
        let transport = MmioTransport::new(dummy.clone(), mem, interrupt);
        (transport, dummy, irq)
    }

    fn rd(t: &mut MmioTransport, offset: u32) -> u32 {
        let mut data = [0u8; 4];
        t.read(u64::from(offset), &mut data);
        u32::from_le_bytes(data)
    }

    fn wr(t: &mut MmioTransport, offset: u32, value: u32) {
        t.write(u64::from(offset), &value.to_le_bytes());
    }

    /// Program queue `index` at `base`, as a driver does.
    fn queue(t: &mut MmioTransport, index: u32, base: u64, size: u32) {
        wr(t, VIRTIO_MMIO_QUEUE_SEL, index);
        wr(t, VIRTIO_MMIO_QUEUE_NUM, size);
        wr(t, VIRTIO_MMIO_QUEUE_DESC_LOW, base as u32);
        wr(t, VIRTIO_MMIO_QUEUE_DESC_HIGH, (base >> 32) as u32);
        wr(t, VIRTIO_MMIO_QUEUE_AVAIL_LOW, (base + 0x1000) as u32);
        wr(t, VIRTIO_MMIO_QUEUE_AVAIL_HIGH, 0);
        wr(t, VIRTIO_MMIO_QUEUE_USED_LOW, (base + 0x2000) as u32);
        wr(t, VIRTIO_MMIO_QUEUE_USED_HIGH, 0);
        wr(t, VIRTIO_MMIO_QUEUE_READY, 1);
    }

    fn negotiate(t: &mut MmioTransport) {
        wr(t, VIRTIO_MMIO_STATUS, VIRTIO_CONFIG_S_ACKNOWLEDGE);
        wr(
            t,
            VIRTIO_MMIO_STATUS,
            VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER,
        );
        wr(t, VIRTIO_MMIO_DRIVER_FEATURES_SEL, 1);
        wr(t, VIRTIO_MMIO_DRIVER_FEATURES, 1); // VERSION_1
        wr(t, VIRTIO_MMIO_DRIVER_FEATURES_SEL, 0);
        wr(t, VIRTIO_MMIO_DRIVER_FEATURES, 1);
        wr(
            t,
            VIRTIO_MMIO_STATUS,
            VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER | VIRTIO_CONFIG_S_FEATURES_OK,
        );
    }

    const ALL_OK: u32 = VIRTIO_CONFIG_S_ACKNOWLEDGE
        | VIRTIO_CONFIG_S_DRIVER
        | VIRTIO_CONFIG_S_FEATURES_OK
        | VIRTIO_CONFIG_S_DRIVER_OK;

    #[test]
    fn a_driver_discovers_negotiates_and_starts_the_device() {
        let (mut t, dummy, _irq) = setup();
        assert_eq!(rd(&mut t, VIRTIO_MMIO_MAGIC_VALUE), MAGIC);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_VERSION), 2);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_DEVICE_ID), 42);
        wr(&mut t, VIRTIO_MMIO_DEVICE_FEATURES_SEL, 1);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_DEVICE_FEATURES), 1);
        wr(&mut t, VIRTIO_MMIO_QUEUE_SEL, 1);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_QUEUE_NUM_MAX), 16);
        negotiate(&mut t);
        assert_ne!(
            rd(&mut t, VIRTIO_MMIO_STATUS) & VIRTIO_CONFIG_S_FEATURES_OK,
            0
        );
        queue(&mut t, 0, 0x1_0000, 16);
        queue(&mut t, 1, 0x2_0000, 8);
        wr(&mut t, VIRTIO_MMIO_STATUS, ALL_OK);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_STATUS), ALL_OK);
        assert!(t.is_activated());
        let d = dummy.lock().unwrap();
        assert_eq!(d.acked, super::super::VIRTIO_F_VERSION_1 | 1);
        assert_eq!(d.queues.as_ref().unwrap()[1].size(), 8);
    }

    #[test]
    fn features_the_device_never_offered_are_refused() {
        let (mut t, _dummy, _irq) = setup();
        wr(&mut t, VIRTIO_MMIO_STATUS, VIRTIO_CONFIG_S_ACKNOWLEDGE);
        wr(
            &mut t,
            VIRTIO_MMIO_STATUS,
            VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER,
        );
        wr(&mut t, VIRTIO_MMIO_DRIVER_FEATURES_SEL, 0);
        wr(&mut t, VIRTIO_MMIO_DRIVER_FEATURES, 0xff);
        wr(
            &mut t,
            VIRTIO_MMIO_STATUS,
            VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER | VIRTIO_CONFIG_S_FEATURES_OK,
        );
        assert_eq!(
            rd(&mut t, VIRTIO_MMIO_STATUS) & VIRTIO_CONFIG_S_FEATURES_OK,
            0
        );
        // And DRIVER_OK without FEATURES_OK does nothing.
        wr(
            &mut t,
            VIRTIO_MMIO_STATUS,
            ALL_OK & !VIRTIO_CONFIG_S_FEATURES_OK,
        );
        assert!(!t.is_activated());
    }

    #[test]
    fn queues_outside_guest_memory_or_of_bad_sizes_need_a_reset_not_a_running_device() {
        for (base, size) in [(0xffff_0000_0000u64, 16u32), (0x1_0000, 12), (0x1_0000, 0)] {
            let (mut t, dummy, irq) = setup();
            negotiate(&mut t);
            queue(&mut t, 0, base, size);
            wr(&mut t, VIRTIO_MMIO_STATUS, ALL_OK);
            assert!(!t.is_activated(), "base {base:#x} size {size}");
            assert_ne!(
                rd(&mut t, VIRTIO_MMIO_STATUS) & VIRTIO_CONFIG_S_NEEDS_RESET,
                0
            );
            assert!(dummy.lock().unwrap().queues.is_none());
            assert!(irq.read().is_ok(), "the driver is told");
            // A reset makes it usable again.
            wr(&mut t, VIRTIO_MMIO_STATUS, 0);
            assert_eq!(rd(&mut t, VIRTIO_MMIO_STATUS), 0);
        }
    }

    #[test]
    fn out_of_range_selects_and_odd_accesses_are_harmless() {
        let (mut t, _dummy, _irq) = setup();
        wr(&mut t, VIRTIO_MMIO_QUEUE_SEL, 999);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_QUEUE_NUM_MAX), 0);
        wr(&mut t, VIRTIO_MMIO_QUEUE_NUM, 16);
        wr(&mut t, VIRTIO_MMIO_QUEUE_NOTIFY, 999);
        let mut byte = [0u8; 1];
        t.read(u64::from(VIRTIO_MMIO_MAGIC_VALUE), &mut byte);
        t.write(u64::from(VIRTIO_MMIO_STATUS), &[1, 2, 3]);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_STATUS), 0);
        // Config space reads go to the device.
        let mut cfg = [0u8; 2];
        t.read(u64::from(VIRTIO_MMIO_CONFIG) + 3, &mut cfg);
        assert_eq!(cfg, [3, 3]);
    }

    #[test]
    fn a_saved_transport_comes_back_activated_with_its_queues() {
        let (mut t, dummy, _irq) = setup();
        negotiate(&mut t);
        queue(&mut t, 0, 0x1_0000, 16);
        wr(&mut t, VIRTIO_MMIO_STATUS, ALL_OK);
        let state = t.save();
        assert!(state.activated);
        dummy.lock().unwrap().queues = None;

        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let interrupt = Arc::new(Interrupt::new(EventFd::new(libc::EFD_NONBLOCK).unwrap()));
        let restored = MmioTransport::restore((dummy.clone(), mem, interrupt), &state).unwrap();
        assert!(restored.is_activated());
        assert_eq!(restored.save(), state);

        // A state that points a queue outside guest memory does not start the device.
        let mut bad = state.clone();
        bad.queues[0].desc_table = 0xffff_0000_0000;
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let interrupt = Arc::new(Interrupt::new(EventFd::new(libc::EFD_NONBLOCK).unwrap()));
        assert!(MmioTransport::restore((dummy, mem, interrupt), &bad).is_err());
    }
}
