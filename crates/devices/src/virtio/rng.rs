//! virtio-rng: the guest's hardware RNG, fed from the host's getrandom. The guest kernel mixes
//! it into its pool as soon as the driver binds, so its RNG is ready early (a guest with no
//! other entropy source, as in the test rig, otherwise waits seconds), and a restored or forked
//! guest that reads it gets bytes no other copy of it got.

use std::os::fd::AsRawFd;
use std::sync::Arc;

use event_manager::{EventOps, Events, MutEventSubscriber};
use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_ids::VIRTIO_ID_RNG;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use crate::persist::Persist;

use super::{
    complete, drain, ActivateError, GuestMemory, Interrupt, VirtioDevice, VIRTIO_F_VERSION_1,
};

const QUEUE_SIZE: u16 = 256;
/// Bytes given per request at most: a guest asking for more gets this much (it asks again).
const MAX_PER_REQUEST: usize = 64 << 10;

/// The rng device's own state (its queue is the transport's to save).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RngState {
    pub acked_features: u64,
}

pub struct Rng {
    queue_events: Vec<EventFd>,
    active: Option<Active>,
    acked_features: u64,
    /// Requests served (for tests and diagnostics).
    served: u64,
}

struct Active {
    mem: GuestMemory,
    queue: Queue,
    interrupt: Arc<Interrupt>,
}

/// Fill `buf` from the host's RNG (getrandom): the device's bytes, and for the VMM generation
/// IDs, snapshot IDs and the entropy a restored guest is given.
pub fn host_random(buf: &mut [u8]) -> std::io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        // SAFETY: getrandom writes at most the given length into the rest of our buffer.
        let n =
            unsafe { libc::getrandom(buf[filled..].as_mut_ptr().cast(), buf.len() - filled, 0) };
        // Negative: the call failed.
        let Ok(n) = usize::try_from(n) else {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        };
        filled += n;
    }
    Ok(())
}

impl Rng {
    pub fn new() -> std::io::Result<Self> {
        Ok(Self {
            queue_events: vec![EventFd::new(libc::EFD_NONBLOCK)?],
            active: None,
            acked_features: 0,
            served: 0,
        })
    }

    pub fn served(&self) -> u64 {
        self.served
    }

    /// Answer every request on the queue.
    fn process_queue(&mut self) {
        let Some(active) = &mut self.active else {
            return;
        };
        let mut buf = vec![0u8; MAX_PER_REQUEST];
        let mut notify = false;
        // At most a queue's worth per pass, then again on the loop's next turn: a driver that
        // lays its used ring over its avail index makes every answer "offer" another request,
        // which spun here forever (found by the fuzzer, fuzz/ device_state).
        let budget = usize::from(active.queue.size());
        let mut answered = 0;
        loop {
            if answered >= budget {
                let _ = self.queue_events[0].write(1);
                break;
            }
            let chain = match active.queue.iter(&active.mem) {
                Ok(mut iter) => iter.next(),
                // The driver's avail index is beyond what the queue can hold: stop here.
                Err(_) => None,
            };
            let Some(chain) = chain else { break };
            let head = chain.head_index();
            let written = match chain.writer(&active.mem) {
                Ok(mut writer) => {
                    let want = writer.available_bytes().min(MAX_PER_REQUEST);
                    match host_random(&mut buf[..want]) {
                        Ok(()) => std::io::Write::write(&mut writer, &buf[..want]).unwrap_or(0),
                        Err(_) => 0,
                    }
                }
                // Descriptors outside guest memory, or too long a chain: nothing written.
                Err(_) => 0,
            };
            // At most MAX_PER_REQUEST bytes.
            let written = u32::try_from(written).expect("at most MAX_PER_REQUEST");
            match complete(&mut active.queue, &active.mem, head, written) {
                Ok(needs) => notify |= needs,
                Err(_) => break,
            }
            answered += 1;
            self.served += 1;
        }
        if notify {
            let _ = active.interrupt.signal_used_queue();
        }
    }
}

impl Persist for Rng {
    type State = RngState;
    type ConstructorArgs = ();
    type Error = std::io::Error;

    fn save(&self) -> RngState {
        RngState {
            acked_features: self.acked_features,
        }
    }

    fn restore((): (), state: &RngState) -> std::io::Result<Self> {
        let mut rng = Self::new()?;
        rng.acked_features = state.acked_features;
        Ok(rng)
    }
}

impl VirtioDevice for Rng {
    fn name(&self) -> &'static str {
        "virtio-rng"
    }

    fn device_type(&self) -> u32 {
        VIRTIO_ID_RNG
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE]
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
    fn read_config(&self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
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
        let queue = queues.remove(0);
        self.active = Some(Active {
            mem,
            queue,
            interrupt,
        });
        // Requests the driver made before (or across a snapshot) are answered now.
        self.process_queue();
        Ok(())
    }
    fn reset(&mut self) {
        self.active = None;
    }
    fn queues(&self) -> Option<&[Queue]> {
        self.active.as_ref().map(|a| std::slice::from_ref(&a.queue))
    }
}

impl MutEventSubscriber for Rng {
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
mod tests {
    use super::*;
    use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::{Bytes, GuestAddress};

    const WRITE: u16 = virtio_bindings::virtio_ring::VRING_DESC_F_WRITE as u16;
    const NEXT: u16 = virtio_bindings::virtio_ring::VRING_DESC_F_NEXT as u16;

    fn mem() -> GuestMemory {
        GuestMemory::from_ranges(&[(GuestAddress(0), 0x100_0000)]).unwrap()
    }

    /// An activated rng over a mock queue holding `descs` as one chain each (or a custom
    /// layout with NEXT flags).
    fn rng_with<'a>(
        mem: &'a GuestMemory,
        descs: &[RawDescriptor],
    ) -> (Rng, MockSplitQueue<'a, GuestMemory>) {
        let vq = MockSplitQueue::new(mem, 16);
        for (i, d) in descs.iter().enumerate() {
            vq.desc_table().store(i as u16, *d).unwrap();
        }
        let mut rng = Rng::new().unwrap();
        let queue: Queue = vq.create_queue().unwrap();
        let interrupt = Arc::new(Interrupt::new(EventFd::new(libc::EFD_NONBLOCK).unwrap()));
        // Activation processes nothing yet: the avail ring is empty.
        rng.activate(mem.clone(), vec![queue], interrupt).unwrap();
        (rng, vq)
    }

    fn offer(vq: &MockSplitQueue<'_, GuestMemory>, heads: &[u16]) {
        for (i, &h) in heads.iter().enumerate() {
            vq.avail().ring().ref_at(i).unwrap().store(h);
        }
        vq.avail().idx().store(heads.len() as u16);
    }

    fn desc(addr: u64, len: u32, flags: u16, next: u16) -> RawDescriptor {
        RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next))
    }

    #[test]
    fn keeps_the_device_contract() {
        crate::virtio::contract::check(|| Rng::new().unwrap(), || ());
    }

    #[test]
    fn requests_get_random_bytes() {
        let mem = mem();
        let (mut rng, vq) = rng_with(&mem, &[desc(0x10_0000, 64, WRITE, 0)]);
        offer(&vq, &[0]);
        rng.process_queue();
        assert_eq!(vq.used().idx().load(), 1);
        let used = vq.used().ring().ref_at(0).unwrap().load();
        assert_eq!(used.len(), 64);
        let mut bytes = [0u8; 64];
        mem.read_slice(&mut bytes, GuestAddress(0x10_0000)).unwrap();
        assert_ne!(bytes, [0u8; 64]);
    }

    #[test]
    fn hostile_chains_are_answered_with_nothing_and_never_crash() {
        let mem = mem();
        let (mut rng, vq) = rng_with(
            &mem,
            &[
                // 0: beyond guest memory.
                desc(0xffff_ffff_0000, 4096, WRITE, 0),
                // 1 -> 2 -> 1: a loop.
                desc(0x10_0000, 16, WRITE | NEXT, 2),
                desc(0x10_1000, 16, WRITE | NEXT, 1),
                // 3: read-only: nothing to write into.
                desc(0x10_2000, 16, 0, 0),
                // 4: next points beyond the table.
                desc(0x10_3000, 16, WRITE | NEXT, 999),
                // 5: a length that wraps the address space.
                desc(u64::MAX - 8, 4096, WRITE, 0),
            ],
        );
        offer(&vq, &[0, 1, 3, 4, 5]);
        rng.process_queue();
        assert_eq!(vq.used().idx().load(), 5, "every request answered");
        for i in [0usize, 2, 4] {
            let used = vq.used().ring().ref_at(i).unwrap().load();
            assert_eq!(used.len(), 0, "request {i} got bytes");
        }
    }

    #[test]
    fn an_avail_index_beyond_the_queue_stops_processing() {
        let mem = mem();
        let (mut rng, vq) = rng_with(&mem, &[desc(0x10_0000, 16, WRITE, 0)]);
        // 1000 entries "available" in a queue of 16.
        vq.avail().idx().store(1000);
        rng.process_queue();
        assert_eq!(vq.used().idx().load(), 0);
        assert_eq!(rng.served(), 0);
    }

    #[test]
    fn a_used_ring_over_the_avail_ring_does_not_spin() {
        // Found by the fuzzer (fuzz/, device_state): with the used ring laid over the avail
        // ring and the used index restored five ahead of the avail one, every answer moved
        // the avail index five past what had been taken, so the pass never ran out of
        // requests. On a thread, so a pass that never ends fails the test, not hangs it.
        let mem: &'static GuestMemory = Box::leak(Box::new(mem()));
        let (done, pass) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let queue = Queue::try_from(virtio_queue::QueueState {
                max_size: 256,
                next_avail: 0,
                next_used: 5,
                event_idx_enabled: false,
                size: 16,
                ready: true,
                desc_table: 0x1000,
                avail_ring: 0x2000,
                used_ring: 0x2000,
            })
            .unwrap();
            let mut rng = Rng::new().unwrap();
            let interrupt = Arc::new(Interrupt::new(EventFd::new(libc::EFD_NONBLOCK).unwrap()));
            rng.activate(mem.clone(), vec![queue], interrupt).unwrap();
            // One request offered; each answer then offers the next.
            mem.write_obj(1u16, GuestAddress(0x2002)).unwrap();
            rng.process_queue();
            let _ = done.send(rng.served());
        });
        let served = pass
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the pass over overlapping rings ended");
        assert!(
            served <= 2 * 16,
            "at most a queue's worth per pass: {served}"
        );
    }
}
