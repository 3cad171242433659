//! The contract every virtio device keeps, as one test each device runs on itself (as crosvm's
//! `Suspendable` devices share theirs): what the device manager relies on without knowing the
//! device's kind.
//!
//! 1. **Snapshot and restore**: a device saved, its state put through the snapshot's encoding
//!    (bincode, as the state file) and restored, saves the same state again; its state is
//!    tagged with its own kind; an activated device hands its queues to the transport (which
//!    saves them) and a reset one has none.
//! 2. **Sleep and wake**: on its thread, kicked without pause by another thread, the device
//!    stops at every pause within the pause timeout, handles nothing while paused (a queue
//!    notification stays unread), lets go of its lock (the controller never waits on a
//!    device), and serves again once resumed.
//! 3. **A reset and a second activation** work: a driver that resets and starts over gets a
//!    device that serves again.

use std::fmt::Debug;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::Serialize;
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::Queue;
use vm_memory::GuestAddress;
use vmm_sys_util::eventfd::EventFd;

use crate::bus::lock;
use crate::persist::Persist;
use crate::state::VirtioKindState;
use crate::virtio::device::Device;
use crate::virtio::thread::DeviceThread;
use crate::virtio::{GuestMemory, Interrupt, VirtioDevice};

/// Guest memory for the contract's queues.
fn memory() -> GuestMemory {
    GuestMemory::from_ranges(&[(GuestAddress(0), 0x100_0000)]).unwrap()
}

/// Activate `device` with one empty queue (16 entries) per queue it has, each in its own
/// part of `mem`.
fn activate<D: VirtioDevice>(device: &mut D, mem: &GuestMemory) {
    let queues: Vec<Queue> = (0..device.queue_max_sizes().len())
        .map(|i| {
            let start = GuestAddress(0x10_0000 * (i as u64 + 1));
            MockSplitQueue::create(mem, start, 16)
                .create_queue()
                .unwrap()
        })
        .collect();
    let interrupt = Arc::new(Interrupt::new(EventFd::new(libc::EFD_NONBLOCK).unwrap()));
    device
        .activate(mem.clone(), queues, interrupt)
        .unwrap_or_else(|e| panic!("{}: activation failed: {e}", device.name()));
}

/// Wait up to 5 s for `what`.
fn wait_for(what: impl Fn() -> bool, failure: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !what() {
        assert!(Instant::now() < deadline, "{failure}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Check the contract on the devices `make` makes, restored with what `args` gives.
pub fn check<D>(make: impl Fn() -> D, args: impl Fn() -> D::ConstructorArgs)
where
    D: Device + Persist + 'static,
    D::State: Serialize + DeserializeOwned + PartialEq + Debug,
    D::Error: Debug,
{
    snapshot_and_restore(&make, &args);
    sleep_and_wake(make());
    reset_and_again(make());
}

fn snapshot_and_restore<D>(make: &impl Fn() -> D, args: &impl Fn() -> D::ConstructorArgs)
where
    D: Device + Persist,
    D::State: Serialize + DeserializeOwned + PartialEq + Debug,
    D::Error: Debug,
{
    let mem = memory();
    let mut device = make();
    let name = device.name();
    device.ack_features(device.features());
    assert!(
        device.queues().is_none(),
        "{name}: queues before activation"
    );
    activate(&mut device, &mem);
    assert_eq!(
        device.queues().map(<[Queue]>::len),
        Some(device.queue_max_sizes().len()),
        "{name}: an activated device hands the transport every queue it serves"
    );
    let saved = device.save();
    let config = bincode::config::standard();
    let bytes = bincode::serde::encode_to_vec(&saved, config).unwrap();
    let (decoded, _): (D::State, usize) =
        bincode::serde::decode_from_slice(&bytes, config).unwrap();
    assert_eq!(
        decoded, saved,
        "{name}: its state survives the snapshot's encoding"
    );
    let restored = D::restore(args(), &decoded)
        .unwrap_or_else(|e| panic!("{name}: restore of its own state failed: {e:?}"));
    assert_eq!(
        restored.save(),
        saved,
        "{name}: restored, it saves what it was"
    );
    assert_eq!(restored.name(), name);
    let tagged = format!("{:?}", device.save_kind());
    let kind = match device.save_kind() {
        VirtioKindState::Rng(_) => "virtio-rng",
        VirtioKindState::Vsock(_) => "virtio-vsock",
        VirtioKindState::Net(_) => "virtio-net",
        VirtioKindState::Block(_) => "virtio-blk",
    };
    assert_eq!(
        kind, name,
        "{name}: its state is tagged as its own kind: {tagged}"
    );
}

fn sleep_and_wake<D: Device + 'static>(mut device: D) {
    let mem = memory();
    let name = device.name();
    device.ack_features(device.features());
    activate(&mut device, &mem);
    let notify = device.queue_events()[0].try_clone().unwrap();
    let device = Arc::new(Mutex::new(device));
    let thread =
        DeviceThread::spawn(&format!("contract-{name}"), device.clone(), 256 << 10).unwrap();
    // Another thread kicks the device's first queue without pause.
    let stop = Arc::new(AtomicBool::new(false));
    let kicker = {
        let stop = stop.clone();
        let notify = notify.try_clone().unwrap();
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                let _ = notify.write(1);
                std::thread::sleep(Duration::from_micros(200));
            }
        })
    };
    for round in 0..20 {
        let start = Instant::now();
        assert!(thread.pause(), "{name}: pause {round} timed out");
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "{name}: pause {round} took {:?}",
            start.elapsed()
        );
        assert!(
            device.try_lock().is_ok(),
            "{name}: paused, its thread still holds the device"
        );
        thread.resume();
    }
    stop.store(true, Ordering::SeqCst);
    kicker.join().unwrap();

    // Paused: a notification stays unread. Resumed: it is taken.
    assert!(thread.pause(), "{name}: pause timed out");
    while notify.read().is_ok() {}
    notify.write(1).unwrap();
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(
        notify.read().ok(),
        Some(1),
        "{name}: paused, it handled a queue notification"
    );
    notify.write(1).unwrap();
    thread.resume();
    wait_for(
        || {
            // Peek: an unread notification is written back.
            match notify.read() {
                Ok(n) => {
                    notify.write(n).unwrap();
                    false
                }
                Err(_) => true,
            }
        },
        &format!("{name}: resumed, it never took its queue notification"),
    );
    drop(thread);
    drop(lock(&device));
}

fn reset_and_again<D: Device>(mut device: D) {
    let mem = memory();
    let name = device.name();
    device.ack_features(device.features());
    activate(&mut device, &mem);
    device.reset();
    assert!(device.queues().is_none(), "{name}: queues after a reset");
    device.ack_features(device.features());
    activate(&mut device, &mem);
    assert!(device.queues().is_some(), "{name}: a second activation");
}
