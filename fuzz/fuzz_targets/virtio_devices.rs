//! A guest's virtio driver at its worst, against each virtio device (rng, vsock, block, net): the
//! queue layout, every ring index, descriptor, flag, length and payload is fuzzer-chosen, and
//! guest memory changes between the device's passes, as a guest's other vCPU would change it.
//! Whatever the guest writes, the device answers, refuses or marks itself broken; it never
//! panics, loops forever or touches memory outside the guest's.
//!
//! Input: a device selector, the features the driver accepts, per queue its size, ring
//! addresses and event-index flag; then guest memory (64 KiB); then rounds of (offset, length,
//! bytes) written into guest memory, each followed by a notification of every queue and one
//! pass of the device's event loop. The net device's backend is a datagram socket whose other
//! end holds up to three fuzzer-chosen frames for the guest before the first pass.
#![no_main]

#[path = "input.rs"]
mod input;

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use event_manager::{EventManager, MutEventSubscriber, SubscriberOps};
use input::Input;
use libfuzzer_sys::fuzz_target;
use mayfly_devices::disk::Disk;
use mayfly_devices::virtio::block::Block;
use mayfly_devices::virtio::net::Net;
use mayfly_devices::virtio::rng::Rng;
use mayfly_devices::virtio::vsock::Vsock;
use mayfly_devices::virtio::{GuestMemory, Interrupt, QueueSnapshot, VirtioDevice};
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// Guest memory: small, so random ring addresses land inside it often.
const MEM: usize = 64 << 10;
/// Rounds of memory changes and device passes per input.
const MAX_ROUNDS: usize = 64;
/// The block device's disk.
const DISK_BYTES: usize = 256 << 10;
const BASE_ID: &str = "sha256:fuzz";

/// A directory of this process's own for the block device's files.
fn scratch() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("mayfly-fuzz-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the fuzz scratch directory");
        let base: Vec<u8> = (0..DISK_BYTES).map(|i| (i / 512) as u8).collect();
        std::fs::write(dir.join("base.raw"), base).expect("write the fuzz disk's base");
        dir
    })
}

fn block() -> Block {
    let dir = scratch();
    let top = dir.join("top");
    let _ = std::fs::remove_file(&top);
    let disk = Disk::create(&dir.join("base.raw"), BASE_ID, &top, None).expect("a fuzz disk");
    Block::new(disk, "fuzz").expect("a block device")
}

/// A net device over a socket, and the socket's other end with frames waiting for the guest
/// (kept open while the device runs: a backend that goes away is another path).
fn net(input: &mut Input) -> (Net, UnixDatagram) {
    let (device_end, peer) = UnixDatagram::pair().expect("a socket pair");
    peer.set_nonblocking(true).expect("a non-blocking socket");
    for _ in 0..input.byte() % 4 {
        let len = usize::from(input.u16()) % 4096;
        let _ = peer.send(input.take(len));
    }
    let device =
        Net::with_socket(OwnedFd::from(device_end), [0x02, 0, 0, 0, 0, 1]).expect("a net device");
    (device, peer)
}

fn drive<D: VirtioDevice + MutEventSubscriber + 'static>(device: D, input: &mut Input) {
    let device = Arc::new(Mutex::new(device));
    let mem = GuestMemory::from_ranges(&[(GuestAddress(0), MEM)]).expect("guest memory");
    let mut queues = Vec::new();
    {
        let mut dev = device.lock().unwrap();
        let features = input.u64() & dev.features();
        dev.ack_features(features);
        for &max in dev.queue_max_sizes() {
            let mut queue = Queue::new(max).expect("a device's queue size");
            // Sizes that are not powers of two, or too big, are refused by the queue itself.
            queue.set_size(input.u16() % (max.saturating_mul(2).max(2)));
            let address = |input: &mut Input| Some(u32::from(input.u16()));
            queue.set_desc_table_address(address(input), Some(0));
            queue.set_avail_ring_address(address(input), Some(0));
            queue.set_used_ring_address(address(input), Some(0));
            queue.set_event_idx(input.byte() & 1 != 0);
            queue.set_ready(true);
            queues.push(queue);
        }
    }
    let image = input.take(MEM);
    mem.write_slice(image, GuestAddress(0))
        .expect("the image fits");
    // The transport activates a device only with queues that are valid in guest memory.
    if !queues.iter().all(|q| q.is_valid(&mem)) {
        return;
    }
    let interrupt = Arc::new(Interrupt::new(
        EventFd::new(EFD_NONBLOCK).expect("an eventfd"),
    ));
    if device
        .lock()
        .unwrap()
        .activate(mem.clone(), queues, interrupt)
        .is_err()
    {
        return;
    }
    let mut events: EventManager<Arc<Mutex<D>>> = EventManager::new().expect("an event manager");
    events.add_subscriber(device.clone());
    for _ in 0..MAX_ROUNDS {
        for event in device.lock().unwrap().queue_events() {
            let _ = event.write(1);
        }
        let _ = events.run_with_timeout(0);
        if input.is_empty() {
            break;
        }
        let at = u64::from(input.u16());
        let len = usize::from(input.byte());
        let bytes = input.take(len);
        let end = (at as usize + bytes.len()).min(MEM);
        let _ = mem.write_slice(&bytes[..end - at as usize], GuestAddress(at));
    }
    let mut dev = device.lock().unwrap();
    if let Some(queues) = dev.queues() {
        for queue in queues {
            let _ = QueueSnapshot::of(queue);
        }
    }
    dev.reset();
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input(data);
    // Selector 2 stays the block device (the regression inputs start with 254).
    match input.byte() % 4 {
        0 => drive(Rng::new().expect("an rng device"), &mut input),
        1 => drive(Vsock::new(3, None).expect("a vsock device"), &mut input),
        2 => drive(block(), &mut input),
        _ => {
            let (device, _peer) = net(&mut input);
            drive(device, &mut input)
        }
    }
});
