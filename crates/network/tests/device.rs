//! The virtio-net device over a real VM network's tap, as the VMM wires them: a scripted guest
//! driver (mock queues) asks for its gateway's MAC with ARP and gets the answer from the VM's
//! namespace; an ARP from an address not its own gets nothing.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use event_manager::{EventManager, SubscriberOps};
use mayfly_devices::virtio::net::{Net, NET_FEATURES, VNET_HDR_LEN};
use mayfly_devices::virtio::{GuestMemory, Interrupt, VirtioDevice};
use mayfly_network::*;
use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::Queue;
use vm_memory::{Address, Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

const QLEN: u16 = 16;
const WRITE: u16 = 2; // VRING_DESC_F_WRITE
const RX_BUFS: u64 = 0x10_0000;
const TX_BUFS: u64 = 0x20_0000;

/// A queue: descriptor table through the mock, avail and used rings of our own.
struct Ring<'a> {
    mem: &'a GuestMemory,
    mock: MockSplitQueue<'a, GuestMemory>,
    avail: GuestAddress,
    used: GuestAddress,
}

impl<'a> Ring<'a> {
    fn new(mem: &'a GuestMemory, start: u64) -> Self {
        let start = GuestAddress(start);
        let r = Self {
            mem,
            mock: MockSplitQueue::create(mem, start, QLEN),
            avail: start.unchecked_add(0x800),
            used: start.unchecked_add(0x1000),
        };
        mem.write_slice(&[0u8; 0x1000], r.avail).unwrap();
        r
    }

    fn queue(&self) -> Queue {
        use virtio_queue::QueueT;
        let mut q: Queue = self.mock.create_queue().unwrap();
        q.set_avail_ring_address(Some(self.avail.0 as u32), Some(0));
        q.set_used_ring_address(Some(self.used.0 as u32), Some(0));
        q
    }

    fn post(&self, slot: u16, desc: SplitDescriptor) {
        self.mock
            .desc_table()
            .store(slot, RawDescriptor::from(desc))
            .unwrap();
        self.mem
            .write_obj(slot, self.avail.unchecked_add(4 + 2 * u64::from(slot)))
            .unwrap();
        self.mem
            .write_obj(slot + 1, self.avail.unchecked_add(2))
            .unwrap();
    }

    fn used_idx(&self) -> u16 {
        self.mem.read_obj(self.used.unchecked_add(2)).unwrap()
    }

    fn used_len(&self, i: u16) -> u32 {
        self.mem
            .read_obj(self.used.unchecked_add(8 + 8 * u64::from(i)))
            .unwrap()
    }
}

fn arp_request(mac: [u8; 6], from: [u8; 4], to: [u8; 4]) -> Vec<u8> {
    let mut f = vec![0u8; VNET_HDR_LEN];
    f.extend_from_slice(&[0xff; 6]);
    f.extend_from_slice(&mac);
    f.extend_from_slice(&[0x08, 0x06]);
    f.extend_from_slice(&[0, 1, 0x08, 0, 6, 4, 0, 1]);
    f.extend_from_slice(&mac);
    f.extend_from_slice(&from);
    f.extend_from_slice(&[0; 6]);
    f.extend_from_slice(&to);
    f
}

#[test]
fn the_net_device_talks_to_its_gateway_through_a_vm_network() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(unsafe { libc::geteuid() }, 0, "this test needs root");
    check_tools().unwrap_or_else(|e| panic!("{e}"));
    let uplink = std::thread::spawn(|| {
        // SAFETY: unshare affects this short-lived thread only.
        assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0);
        std::fs::File::open("/proc/thread-self/ns/net").unwrap()
    })
    .join()
    .unwrap();
    let state_dir = std::env::temp_dir().join(format!("mayfly-net-{}-device", std::process::id()));
    let network = Network::new(NetworkConfig {
        state_dir: state_dir.clone(),
        uplink: Uplink::Path(
            format!("/proc/self/fd/{}", {
                use std::os::fd::AsRawFd;
                uplink.as_raw_fd()
            })
            .into(),
        ),
        ..NetworkConfig::default()
    })
    .unwrap();
    let mut vm = network.create(&Policy::Open, None).unwrap();
    let mac = vm.guest().mac;
    let net = Net::new(vm.take_tap().unwrap(), mac).expect("the VM network's tap suits the device");

    let mem = GuestMemory::from_ranges(&[(GuestAddress(0), 0x100_0000)]).unwrap();
    let rx = Ring::new(&mem, 0x1000);
    let tx = Ring::new(&mem, 0x4000);
    let ctrl = Ring::new(&mem, 0x7000);
    let dev = Arc::new(Mutex::new(net));
    let interrupt = Arc::new(Interrupt::new(EventFd::new(libc::EFD_NONBLOCK).unwrap()));
    {
        let mut d = dev.lock().unwrap();
        d.ack_features(NET_FEATURES);
        d.activate(
            mem.clone(),
            vec![rx.queue(), tx.queue(), ctrl.queue()],
            interrupt,
        )
        .unwrap();
    }
    let mut em = EventManager::new().unwrap();
    em.add_subscriber(dev.clone());
    for slot in 0..8 {
        rx.post(
            slot,
            SplitDescriptor::new(RX_BUFS + u64::from(slot) * 0x1_0000, 0x1_0000, WRITE, 0),
        );
    }
    let kick = |q: usize| dev.lock().unwrap().queue_events()[q].write(1).unwrap();
    kick(0);

    let send = |slot: u16, frame: &[u8]| {
        let at = TX_BUFS + u64::from(slot) * 0x1000;
        mem.write_slice(frame, GuestAddress(at)).unwrap();
        tx.post(slot, SplitDescriptor::new(at, frame.len() as u32, 0, 0));
        kick(1);
    };
    // The guest asks who its gateway is, from its own address: it gets the gateway's MAC.
    send(0, &arp_request(mac, GUEST_IP.octets(), GATEWAY_IP.octets()));
    let deadline = Instant::now() + Duration::from_secs(5);
    let reply = loop {
        em.run_with_timeout(20).unwrap();
        let got = rx.used_idx();
        let found = (0..got).find_map(|i| {
            let len = rx.used_len(i) as usize;
            let mut f = vec![0u8; len];
            mem.read_slice(&mut f, GuestAddress(RX_BUFS + u64::from(i) * 0x1_0000))
                .unwrap();
            let eth = &f[VNET_HDR_LEN..];
            (eth.len() >= 42 && eth[12..14] == [0x08, 0x06] && eth[20..22] == [0, 2])
                .then(|| eth.to_vec())
        });
        if let Some(r) = found {
            break r;
        }
        assert!(Instant::now() < deadline, "no ARP reply reached the guest");
    };
    assert_eq!(&reply[..6], &mac, "the reply is for the guest");
    assert_eq!(
        &reply[22..28],
        &GATEWAY_MAC,
        "the gateway's MAC is the fixed one"
    );
    assert_eq!(&reply[28..32], &GATEWAY_IP.octets());
    let counters = dev.lock().unwrap().counters();
    assert_eq!(counters.tx_frames, 1);
    assert!(counters.rx_frames >= 1);

    // From an address not its own: dropped at the tap, counted, no answer.
    let before = rx.used_idx();
    let spoofed_before = vm.counters().unwrap().spoofed;
    send(1, &arp_request(mac, [172, 16, 0, 3], GATEWAY_IP.octets()));
    let until = Instant::now() + Duration::from_millis(300);
    while Instant::now() < until {
        em.run_with_timeout(20).unwrap();
    }
    assert_eq!(tx.used_idx(), 2);
    assert_eq!(rx.used_idx(), before, "a spoofed ARP got an answer");
    assert!(vm.counters().unwrap().spoofed > spoofed_before);
    drop(em);
    drop(dev);
    vm.destroy().unwrap();
    let _ = std::fs::remove_dir_all(state_dir);
}
