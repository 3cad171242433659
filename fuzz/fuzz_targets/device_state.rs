//! A virtio device restored from a saved state, then driven by its guest: the transport's
//! saved registers and queues (`MmioTransportState`, as a snapshot's state file holds it, and
//! a state file may come from anywhere), the device's own saved state, then the guest's MMIO
//! register reads and writes and queue notifications. A state that does not fit the device or
//! guest memory is refused; whatever is accepted must then run without a panic or a hang.
//!
//! Input: a device selector; the device's and the transport's saved fields; guest memory
//! (16 KiB); then rounds of an MMIO access (read or write, register offset, value) or a
//! notification of every queue followed by one pass of the device's event loop.
#![no_main]

#[path = "input.rs"]
mod input;

use std::sync::{Arc, Mutex};

use event_manager::{EventManager, MutEventSubscriber, SubscriberOps};
use input::Input;
use libfuzzer_sys::fuzz_target;
use mayfly_devices::bus::BusDevice;
use mayfly_devices::persist::Persist;
use mayfly_devices::virtio::mmio::{MmioTransport, MmioTransportState};
use mayfly_devices::virtio::rng::{Rng, RngState};
use mayfly_devices::virtio::vsock::{Vsock, VsockArgs, VsockState};
use mayfly_devices::virtio::{GuestMemory, Interrupt, QueueSnapshot, VirtioDevice};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

const MEM: usize = 16 << 10;
const MAX_ROUNDS: usize = 64;

fn transport_state(input: &mut Input) -> MmioTransportState {
    let status = input.u32();
    let device_features_select = input.u32();
    let driver_features_select = input.u32();
    let driver_features = input.u64();
    let queue_select = input.u32();
    let interrupt_status = input.u32();
    let config_generation = input.u32();
    let count = usize::from(input.byte() % 5);
    let queues = (0..count)
        .map(|_| QueueSnapshot {
            max_size: input.u16(),
            size: input.u16(),
            ready: input.byte() & 1 == 1,
            // Mostly inside the small guest memory, sometimes anywhere.
            desc_table: if input.byte() & 1 == 1 {
                input.u64()
            } else {
                u64::from(input.u16())
            },
            avail_ring: u64::from(input.u16()),
            used_ring: u64::from(input.u16()),
            next_avail: input.u16(),
            next_used: input.u16(),
            event_idx: input.byte() & 1 == 1,
        })
        .collect();
    MmioTransportState {
        status,
        device_features_select,
        driver_features_select,
        driver_features,
        queue_select,
        interrupt_status,
        config_generation,
        queues,
        activated: input.byte() & 1 == 1,
    }
}

fn drive<D: VirtioDevice + MutEventSubscriber + 'static>(device: D, input: &mut Input) {
    let device = Arc::new(Mutex::new(device));
    let state = transport_state(input);
    let mem = GuestMemory::from_ranges(&[(GuestAddress(0), MEM)]).expect("guest memory");
    mem.write_slice(input.take(MEM), GuestAddress(0))
        .expect("the image fits");
    let interrupt = Arc::new(Interrupt::new(
        EventFd::new(EFD_NONBLOCK).expect("an eventfd"),
    ));
    let dyn_device: Arc<Mutex<dyn VirtioDevice>> = device.clone();
    let Ok(mut transport) = MmioTransport::restore((dyn_device, mem.clone(), interrupt), &state)
    else {
        return;
    };
    let mut events: EventManager<Arc<Mutex<D>>> = EventManager::new().expect("an event manager");
    events.add_subscriber(device.clone());
    for _ in 0..MAX_ROUNDS {
        if input.is_empty() {
            break;
        }
        let op = input.byte();
        let offset = u64::from(input.u16() % 0x200);
        match op % 4 {
            0 => {
                let mut data = [0u8; 4];
                transport.read(offset, &mut data);
            }
            1 | 2 => transport.write(offset, &input.u32().to_le_bytes()),
            _ => {
                for event in device.lock().unwrap().queue_events() {
                    let _ = event.write(1);
                }
                let _ = events.run_with_timeout(0);
            }
        }
    }
    let _ = transport.save();
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input(data);
    match input.byte() % 2 {
        0 => {
            let state = RngState {
                acked_features: input.u64(),
            };
            if let Ok(rng) = Rng::restore((), &state) {
                drive(rng, &mut input);
            }
        }
        _ => {
            let state = VsockState {
                guest_cid: input.u64(),
                acked_features: input.u64(),
                next_local_port: input.u32(),
            };
            if let Ok(vsock) = Vsock::restore(
                VsockArgs {
                    guest_cid: 3,
                    path: None,
                },
                &state,
            ) {
                drive(vsock, &mut input);
            }
        }
    }
});
