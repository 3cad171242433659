//! The net device against a scripted guest driver on virtio-queue's mock queues, with a
//! seqpacket socket (or a real tap in a namespace of the test's own) as its host side, and its
//! event loop run by the test itself.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use event_manager::{EventManager, SubscriberOps};
use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::Queue;
use vm_memory::{Address, Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use super::*;

const WRITE: u16 = virtio_bindings::virtio_ring::VRING_DESC_F_WRITE as u16;
const NEXT: u16 = virtio_bindings::virtio_ring::VRING_DESC_F_NEXT as u16;
const QLEN: u16 = 64;
const RX_BUFS: u64 = 0x10_0000;
const RX_STRIDE: u64 = 0x1_0000;
const TX_BUFS: u64 = 0x60_0000;
const TX_STRIDE: u64 = 0x1_2000;
const MAC: MacAddr = [0x02, 0x6d, 0x66, 0x00, 0x00, 0x02];

fn mem() -> GuestMemory {
    GuestMemory::from_ranges(&[(GuestAddress(0), 0x100_0000)]).unwrap()
}

fn seqpacket_pair() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: socketpair writes two descriptors into `fds`.
    let r = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    assert_eq!(r, 0);
    // SAFETY: both are new descriptors nobody else owns.
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

/// A frame: Ethernet header (to `MAC`, from a host MAC), then `payload_len` bytes of pattern.
fn frame(payload_len: usize, seed: u8) -> Vec<u8> {
    let mut f = Vec::with_capacity(14 + payload_len);
    f.extend_from_slice(&MAC);
    f.extend_from_slice(&[0x02, 0, 0, 0, 0, 1]);
    f.extend_from_slice(&[0x08, 0x00]);
    f.extend((0..payload_len).map(|i| (i as u8).wrapping_mul(7).wrapping_add(seed)));
    f
}

/// A split queue as a driver lays it out: the descriptor table through virtio-queue's mock, the
/// avail and used rings at addresses of their own (the mock places its used ring over the end
/// of its avail ring once a queue has more than a few entries in use).
struct Ring<'a> {
    mem: &'a GuestMemory,
    mock: MockSplitQueue<'a, GuestMemory>,
    avail: GuestAddress,
    used: GuestAddress,
}

impl<'a> Ring<'a> {
    fn create(mem: &'a GuestMemory, start: GuestAddress, len: u16) -> Self {
        let ring = Self {
            mem,
            mock: MockSplitQueue::create(mem, start, len),
            avail: start.unchecked_add(0x800),
            used: start.unchecked_add(0x1000),
        };
        mem.write_slice(&[0u8; 0x1000], ring.avail).unwrap();
        ring
    }

    fn desc_table(&self) -> &virtio_queue::mock::DescriptorTable<'a, GuestMemory> {
        self.mock.desc_table()
    }

    fn set_avail(&self, slot: u16, head: u16) {
        self.mem
            .write_obj(
                head,
                self.avail.unchecked_add(4 + 2 * u64::from(slot % QLEN)),
            )
            .unwrap();
    }

    fn set_avail_idx(&self, idx: u16) {
        self.mem
            .write_obj(idx, self.avail.unchecked_add(2))
            .unwrap();
    }

    fn used_idx(&self) -> u16 {
        self.mem.read_obj(self.used.unchecked_add(2)).unwrap()
    }

    fn used(&self, index: u16) -> (u16, u32) {
        let at = self.used.unchecked_add(4 + 8 * u64::from(index % QLEN));
        let id: u32 = self.mem.read_obj(at).unwrap();
        let len: u32 = self.mem.read_obj(at.unchecked_add(4)).unwrap();
        (id as u16, len)
    }

    fn create_queue(&self) -> Queue {
        let mut q: Queue = self.mock.create_queue().unwrap();
        q.set_avail_ring_address(Some(self.avail.0 as u32), Some(0));
        q.set_used_ring_address(Some(self.used.0 as u32), Some(0));
        q
    }
}

/// A minimal guest driver.
struct Guest<'a> {
    mem: &'a GuestMemory,
    rx: Ring<'a>,
    tx: Ring<'a>,
    ctrl: Ring<'a>,
    rx_posted: u16,
    rx_seen: u16,
    tx_sent: u16,
    /// The next free descriptor slot of the TX table.
    tx_desc: u16,
}

impl<'a> Guest<'a> {
    fn new(mem: &'a GuestMemory) -> Self {
        Self {
            mem,
            rx: Ring::create(mem, GuestAddress(0x1000), QLEN),
            tx: Ring::create(mem, GuestAddress(0x4000), QLEN),
            ctrl: Ring::create(mem, GuestAddress(0x7000), QLEN),
            rx_posted: 0,
            rx_seen: 0,
            tx_sent: 0,
            tx_desc: 0,
        }
    }

    fn queues(&self) -> Vec<Queue> {
        vec![
            self.rx.create_queue(),
            self.tx.create_queue(),
            self.ctrl.create_queue(),
        ]
    }

    /// Post one RX buffer of `len` bytes (descriptor = slot).
    fn post_rx(&mut self, len: u32) {
        let slot = self.rx_posted % QLEN;
        self.post_rx_desc(SplitDescriptor::new(
            RX_BUFS + u64::from(slot) * RX_STRIDE,
            len,
            WRITE,
            0,
        ));
    }

    fn post_rx_desc(&mut self, desc: SplitDescriptor) {
        let slot = self.rx_posted % QLEN;
        self.rx
            .desc_table()
            .store(slot, RawDescriptor::from(desc))
            .unwrap();
        self.rx.set_avail(self.rx_posted, slot);
        self.rx_posted = self.rx_posted.wrapping_add(1);
        self.rx.set_avail_idx(self.rx_posted);
    }

    /// Frames the device delivered since the last call: (num_buffers, frame with header).
    fn received(&mut self) -> Vec<(u16, Vec<u8>)> {
        let mut out = Vec::new();
        while self.rx_seen != self.rx.used_idx() {
            let first = self.used_rx(self.rx_seen);
            let mut hdr = [0u8; VNET_HDR_LEN];
            self.mem
                .read_slice(
                    &mut hdr,
                    GuestAddress(RX_BUFS + u64::from(first.0) * RX_STRIDE),
                )
                .unwrap();
            let buffers = u16::from_le_bytes([hdr[10], hdr[11]]).max(1);
            let mut data = Vec::new();
            for i in 0..buffers {
                let (id, len) = self.used_rx(self.rx_seen.wrapping_add(i));
                let mut part = vec![0u8; len as usize];
                self.mem
                    .read_slice(&mut part, GuestAddress(RX_BUFS + u64::from(id) * RX_STRIDE))
                    .unwrap();
                data.extend_from_slice(&part);
            }
            self.rx_seen = self.rx_seen.wrapping_add(buffers);
            out.push((buffers, data));
        }
        out
    }

    fn used_rx(&self, index: u16) -> (u16, u32) {
        self.rx.used(index)
    }

    /// Put a chain of raw descriptors (NEXT flags and indices filled in) on the TX queue.
    fn send_raw(&mut self, descs: &[SplitDescriptor]) {
        let head = self.tx_desc;
        for (i, d) in descs.iter().enumerate() {
            let index = (head + i as u16) % QLEN;
            let mut d = *d;
            if i + 1 < descs.len() {
                d = SplitDescriptor::new(d.addr().0, d.len(), d.flags() | NEXT, (index + 1) % QLEN);
            }
            self.tx
                .desc_table()
                .store(index, RawDescriptor::from(d))
                .unwrap();
        }
        self.tx_desc = (head + descs.len() as u16) % QLEN;
        self.push_tx_head(head);
    }

    fn push_tx_head(&mut self, head: u16) {
        self.tx.set_avail(self.tx_sent, head);
        self.tx_sent = self.tx_sent.wrapping_add(1);
        self.tx.set_avail_idx(self.tx_sent);
    }

    /// Send `hdr` + `frame`, the frame split over `pieces` descriptors.
    fn send(&mut self, hdr: [u8; VNET_HDR_LEN], frame: &[u8], pieces: usize) {
        let addr = TX_BUFS + u64::from(self.tx_sent % QLEN) * TX_STRIDE;
        self.mem.write_slice(&hdr, GuestAddress(addr)).unwrap();
        self.mem
            .write_slice(frame, GuestAddress(addr + VNET_HDR_LEN as u64))
            .unwrap();
        let total = VNET_HDR_LEN + frame.len();
        let step = total.div_ceil(pieces);
        let descs: Vec<_> = (0..total)
            .step_by(step)
            .map(|off| SplitDescriptor::new(addr + off as u64, step.min(total - off) as u32, 0, 0))
            .collect();
        self.send_raw(&descs);
    }

    fn tx_used(&self) -> u16 {
        self.tx.used_idx()
    }
}

/// The device in an event loop the test turns.
struct Dev {
    dev: Arc<Mutex<Net>>,
    em: EventManager<Arc<Mutex<Net>>>,
    interrupt: Arc<Interrupt>,
}

impl Dev {
    fn start(net: Net, features: u64, mem: &GuestMemory, guest: &Guest<'_>) -> Self {
        let dev = Arc::new(Mutex::new(net));
        let interrupt = Arc::new(Interrupt::new(EventFd::new(libc::EFD_NONBLOCK).unwrap()));
        {
            let mut d = dev.lock().unwrap();
            d.ack_features(features);
            d.activate(mem.clone(), guest.queues(), interrupt.clone())
                .unwrap();
        }
        let mut em = EventManager::new().unwrap();
        em.add_subscriber(dev.clone());
        Self { dev, em, interrupt }
    }

    /// Run the event loop until it has nothing to do.
    fn turn(&mut self) {
        for _ in 0..20 {
            if self.em.run_with_timeout(10).unwrap() == 0 {
                break;
            }
        }
    }

    fn kick(&self, queue: usize) {
        self.dev.lock().unwrap().queue_events[queue]
            .write(1)
            .unwrap();
    }

    fn counters(&self) -> Counters {
        self.dev.lock().unwrap().counters()
    }

    fn until(&mut self, what: &str, mut done: impl FnMut(&mut Self) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !done(self) {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            self.turn();
        }
    }

    /// Nothing popped and not completed: the device's next_avail equals what it used.
    fn assert_nothing_in_flight(&self) {
        let d = self.dev.lock().unwrap();
        for (i, q) in d.queues().unwrap().iter().enumerate() {
            assert_eq!(
                q.next_avail(),
                q.next_used(),
                "queue {i} has descriptors popped but not used"
            );
        }
    }
}

fn recv(peer: &OwnedFd) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; VNET_HDR_LEN + MAX_FRAME_LEN + 16];
    // SAFETY: recv writes at most buf.len() bytes into buf.
    let n = unsafe {
        libc::recv(
            peer.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        return None;
    }
    buf.truncate(n as usize);
    Some(buf)
}

fn send(peer: &OwnedFd, data: &[u8]) {
    // SAFETY: send reads data.len() bytes from data.
    let n = unsafe { libc::send(peer.as_raw_fd(), data.as_ptr().cast(), data.len(), 0) };
    assert_eq!(
        n,
        data.len() as isize,
        "{}",
        std::io::Error::last_os_error()
    );
}

fn with_hdr(frame: &[u8]) -> Vec<u8> {
    let mut v = vec![0u8; VNET_HDR_LEN];
    v.extend_from_slice(frame);
    v
}

fn socket_dev<'a>(mem: &'a GuestMemory, features: u64) -> (Dev, Guest<'a>, OwnedFd) {
    let (ours, peer) = seqpacket_pair();
    let guest = Guest::new(mem);
    let dev = Dev::start(Net::with_socket(ours, MAC).unwrap(), features, mem, &guest);
    (dev, guest, peer)
}

#[test]
fn frames_go_from_the_guest_to_the_backend() {
    let mem = mem();
    let (mut dev, mut guest, peer) = socket_dev(&mem, NET_FEATURES);
    let f1 = frame(100, 1);
    let f2 = frame(5000, 2);
    guest.send([0; VNET_HDR_LEN], &f1, 1);
    guest.send([0; VNET_HDR_LEN], &f2, 4);
    dev.kick(TX);
    dev.turn();
    assert_eq!(guest.tx_used(), 2);
    assert_eq!(recv(&peer).unwrap(), with_hdr(&f1));
    assert_eq!(recv(&peer).unwrap(), with_hdr(&f2));
    let c = dev.counters();
    assert_eq!((c.tx_frames, c.tx_malformed), (2, 0));
    assert_eq!(c.tx_bytes, (f1.len() + f2.len()) as u64);
    dev.assert_nothing_in_flight();
}

#[test]
fn frames_go_from_the_backend_to_the_guest_in_mergeable_buffers() {
    let mem = mem();
    let (mut dev, mut guest, peer) = socket_dev(&mem, NET_FEATURES);
    for _ in 0..8 {
        guest.post_rx(1536);
    }
    dev.kick(RX);
    let small = frame(60, 3);
    let big = frame(3500, 4);
    send(&peer, &with_hdr(&small));
    send(&peer, &with_hdr(&big));
    let mut got = Vec::new();
    dev.until("two frames", |_| {
        got.extend(guest.received());
        got.len() == 2
    });
    assert_eq!(got[0].0, 1);
    assert_eq!(&got[0].1[VNET_HDR_LEN..], &small[..]);
    // 12 + 3514 bytes over 1536-byte buffers: three of them.
    assert_eq!(got[1].0, 3);
    assert_eq!(&got[1].1[VNET_HDR_LEN..], &big[..]);
    assert_eq!(dev.counters().rx_frames, 2);
    dev.assert_nothing_in_flight();
}

#[test]
fn without_mergeable_buffers_a_frame_must_fit_one_buffer() {
    let mem = mem();
    let (mut dev, mut guest, peer) = socket_dev(&mem, NET_FEATURES & !bit(VIRTIO_NET_F_MRG_RXBUF));
    guest.post_rx(1536);
    guest.post_rx(1536);
    dev.kick(RX);
    send(&peer, &with_hdr(&frame(3000, 5)));
    let ok = frame(1000, 6);
    send(&peer, &with_hdr(&ok));
    let mut got = Vec::new();
    dev.until("the small frame", |_| {
        got.extend(guest.received());
        !got.is_empty()
    });
    assert_eq!(got.len(), 1);
    assert_eq!(&got[0].1[VNET_HDR_LEN..], &ok[..]);
    let c = dev.counters();
    assert_eq!((c.rx_frames, c.rx_dropped), (1, 1));
    // The big frame took no buffer: one of the two is still the guest's.
    assert_eq!(guest.rx.used_idx(), 1);
    dev.assert_nothing_in_flight();
}

#[test]
fn hostile_tx_chains_are_dropped_counted_and_given_back() {
    let mem = mem();
    let (mut dev, mut guest, peer) = socket_dev(&mem, NET_FEATURES & !bit(VIRTIO_NET_F_HOST_TSO4));
    let base = TX_BUFS;
    // Beyond guest memory.
    guest.send_raw(&[SplitDescriptor::new(0xffff_ffff_0000, 100, 0, 0)]);
    // A length that runs off the end of guest memory.
    guest.send_raw(&[SplitDescriptor::new(0xff_ff00, 0x1000, 0, 0)]);
    // Write-only descriptors on TX.
    guest.send_raw(&[SplitDescriptor::new(base, 100, WRITE, 0)]);
    // Shorter than the header.
    guest.send_raw(&[SplitDescriptor::new(base, 8, 0, 0)]);
    // A header and no Ethernet frame.
    guest.send_raw(&[SplitDescriptor::new(base, 12, 0, 0)]);
    // Longer than the largest frame (two descriptors of 40 KiB).
    guest.send_raw(&[
        SplitDescriptor::new(base, 40 << 10, 0, 0),
        SplitDescriptor::new(base, 40 << 10, 0, 0),
    ]);
    // A loop: 60 -> 61 -> 60.
    guest
        .tx
        .desc_table()
        .store(
            60,
            RawDescriptor::from(SplitDescriptor::new(base, 20, NEXT, 61)),
        )
        .unwrap();
    guest
        .tx
        .desc_table()
        .store(
            61,
            RawDescriptor::from(SplitDescriptor::new(base, 20, NEXT, 60)),
        )
        .unwrap();
    guest.push_tx_head(60);
    // `next` beyond the table.
    guest
        .tx
        .desc_table()
        .store(
            62,
            RawDescriptor::from(SplitDescriptor::new(base, 100, NEXT, 999)),
        )
        .unwrap();
    guest.push_tx_head(62);
    // A head index beyond the table.
    guest.push_tx_head(5000);
    // GSO the guest did not negotiate (HOST_TSO4 is off here).
    let mut gso = [0u8; VNET_HDR_LEN];
    gso[0] = VIRTIO_NET_HDR_F_NEEDS_CSUM as u8;
    gso[1] = VIRTIO_NET_HDR_GSO_TCPV4 as u8;
    gso[4] = 0xa8;
    gso[5] = 0x05;
    guest.send(gso, &frame(3000, 7), 1);
    // A checksum offset outside the frame.
    let mut csum = [0u8; VNET_HDR_LEN];
    csum[0] = VIRTIO_NET_HDR_F_NEEDS_CSUM as u8;
    csum[6] = 0xff;
    csum[7] = 0xff;
    guest.send(csum, &frame(100, 8), 1);
    // And a good frame last: the queue still works.
    let good = frame(64, 9);
    guest.send([0; VNET_HDR_LEN], &good, 2);
    dev.kick(TX);
    dev.turn();
    let sent = guest.tx_sent;
    // Every chain was given back, but for the head beyond the table, which has no used entry
    // to give back (it was consumed).
    assert_eq!(guest.tx_used(), sent - 1);
    let c = dev.counters();
    assert_eq!(c.tx_malformed, u64::from(sent) - 1);
    assert_eq!(c.tx_frames, 1);
    assert_eq!(
        recv(&peer).unwrap(),
        with_hdr(&good),
        "only the good frame got out"
    );
    assert!(recv(&peer).is_none());
    let d = dev.dev.lock().unwrap();
    assert_eq!(
        d.queues().unwrap()[TX].next_avail(),
        sent,
        "nothing left on the ring"
    );
}

#[test]
fn hostile_rx_chains_are_given_back_empty_and_good_ones_still_work() {
    let mem = mem();
    let (mut dev, mut guest, peer) = socket_dev(&mem, NET_FEATURES);
    // Read-only, beyond guest memory, looping.
    guest.post_rx_desc(SplitDescriptor::new(RX_BUFS, 4096, 0, 0));
    guest.post_rx_desc(SplitDescriptor::new(0xffff_ffff_0000, 4096, WRITE, 0));
    let slot = guest.rx_posted % QLEN;
    guest.post_rx_desc(SplitDescriptor::new(RX_BUFS, 16, WRITE | NEXT, slot));
    dev.kick(RX);
    for i in 0..4 {
        send(&peer, &with_hdr(&frame(200, i)));
    }
    dev.turn();
    assert_eq!(guest.rx.used_idx(), 3);
    for i in 0..3 {
        assert_eq!(guest.used_rx(i).1, 0, "chain {i} got data");
    }
    guest.rx_seen = 3;
    let c = dev.counters();
    assert_eq!(c.rx_malformed, 3);
    // A good buffer: the fourth frame arrives.
    guest.post_rx(4096);
    dev.kick(RX);
    dev.turn();
    let got = guest.received();
    assert_eq!(got.len(), 1);
    assert_eq!(&got[0].1[VNET_HDR_LEN..], &frame(200, 3)[..]);
    dev.assert_nothing_in_flight();
}

#[test]
fn a_full_backend_leaves_tx_chains_on_the_ring_not_popped() {
    let mem = mem();
    let (mut dev, mut guest, peer) = socket_dev(&mem, NET_FEATURES);
    // Fill the socket until the device cannot write any more.
    let big = frame(60_000, 1);
    let mut sent = 0;
    while sent < 40 {
        guest.send([0; VNET_HDR_LEN], &big, 1);
        sent += 1;
    }
    dev.kick(TX);
    dev.turn();
    let c = dev.counters();
    assert!(c.tx_deferred >= 1, "the socket never filled up: {c:?}");
    assert!(guest.tx_used() < sent, "some chains must wait");
    dev.assert_nothing_in_flight();
    {
        let d = dev.dev.lock().unwrap();
        assert_eq!(
            d.queues().unwrap()[TX].next_avail(),
            guest.tx_used(),
            "the deferred chain was put back"
        );
    }
    // Drain the peer: the rest goes out, in order.
    let mut got = 0;
    dev.until("every frame", |d| {
        while let Some(f) = recv(&peer) {
            assert_eq!(f, with_hdr(&big));
            got += 1;
        }
        d.turn();
        got == sent
    });
    assert_eq!(guest.tx_used(), sent);
    dev.assert_nothing_in_flight();
}

#[test]
fn a_guest_without_rx_buffers_makes_the_device_wait_not_spin() {
    let mem = mem();
    let (mut dev, mut guest, peer) = socket_dev(&mem, NET_FEATURES);
    for i in 0..3 {
        send(&peer, &with_hdr(&frame(100, i)));
    }
    dev.turn();
    // No buffers: the socket is not even being watched for reading.
    assert_eq!(dev.em.run_with_timeout(50).unwrap(), 0, "the loop spins");
    assert_eq!(dev.counters().rx_frames, 0);
    for _ in 0..4 {
        guest.post_rx(2048);
    }
    dev.kick(RX);
    let mut got = Vec::new();
    dev.until("three frames", |_| {
        got.extend(guest.received());
        got.len() == 3
    });
    for (i, (_, f)) in got.iter().enumerate() {
        assert_eq!(&f[VNET_HDR_LEN..], &frame(100, i as u8)[..]);
    }
    dev.assert_nothing_in_flight();
}

#[test]
fn a_frame_larger_than_the_buffers_posted_waits_with_nothing_popped() {
    let mem = mem();
    let (mut dev, mut guest, peer) = socket_dev(&mem, NET_FEATURES);
    guest.post_rx(1024);
    dev.kick(RX);
    let big = frame(3000, 1);
    send(&peer, &with_hdr(&big));
    dev.turn();
    assert!(guest.received().is_empty());
    dev.assert_nothing_in_flight();
    assert_eq!(
        dev.dev.lock().unwrap().queues().unwrap()[RX].next_avail(),
        0,
        "the buffer taken for the frame was put back"
    );
    guest.post_rx(1024);
    guest.post_rx(1024);
    dev.kick(RX);
    let mut got = Vec::new();
    dev.until("the frame", |_| {
        got.extend(guest.received());
        !got.is_empty()
    });
    assert_eq!(got[0].0, 3);
    assert_eq!(&got[0].1[VNET_HDR_LEN..], &big[..]);
}

#[test]
fn floods_in_both_directions_both_progress() {
    let mem = mem();
    let (mut dev, mut guest, peer) = socket_dev(&mem, NET_FEATURES);
    for _ in 0..QLEN {
        guest.post_rx(2048);
    }
    for i in 0..48 {
        send(&peer, &with_hdr(&frame(1000, i)));
    }
    for i in 0..QLEN {
        guest.send([0; VNET_HDR_LEN], &frame(1000, i as u8), 1);
    }
    dev.kick(TX);
    dev.kick(RX);
    dev.turn();
    assert_eq!(guest.tx_used(), QLEN);
    assert_eq!(guest.received().len(), 48, "{:?}", dev.counters());
    let mut out = 0;
    while recv(&peer).is_some() {
        out += 1;
    }
    assert_eq!(out, QLEN);
    dev.assert_nothing_in_flight();
}

#[test]
fn the_backend_going_away_does_not_spin_the_loop() {
    let mem = mem();
    let (mut dev, mut guest, peer) = socket_dev(&mem, NET_FEATURES);
    guest.post_rx(2048);
    dev.kick(RX);
    dev.turn();
    drop(peer);
    dev.turn();
    assert_eq!(dev.em.run_with_timeout(50).unwrap(), 0, "the loop spins");
    // TX still completes (the frames are dropped).
    guest.send([0; VNET_HDR_LEN], &frame(100, 1), 1);
    dev.kick(TX);
    dev.turn();
    assert_eq!(guest.tx_used(), 1);
    assert_eq!(dev.counters().tx_dropped, 1);
}

#[test]
fn config_space_holds_the_mac_and_link_status() {
    let (ours, _peer) = seqpacket_pair();
    let net = Net::with_socket(ours, MAC).unwrap();
    let mut mac = [0u8; 6];
    net.read_config(0, &mut mac);
    assert_eq!(mac, MAC);
    let mut status = [0u8; 2];
    net.read_config(6, &mut status);
    assert_eq!(u16::from_le_bytes(status), VIRTIO_NET_S_LINK_UP as u16);
    let mut far = [0xaau8; 4];
    net.read_config(u64::MAX - 1, &mut far);
    assert_eq!(far, [0; 4]);
    assert_eq!(net.features() & NET_FEATURES, NET_FEATURES);
    assert_eq!(net.features() & bit(VIRTIO_NET_F_MQ), 0);
}

#[test]
fn bad_macs_and_non_taps_are_refused_with_reasons() {
    let (ours, _peer) = seqpacket_pair();
    assert!(matches!(
        Net::with_socket(ours, [0x01, 0, 0, 0, 0, 1]),
        Err(NetError::BadMac(_))
    ));
    let (ours, _peer) = seqpacket_pair();
    let err = Net::new(ours, MAC).err().unwrap();
    assert!(matches!(err, NetError::NotATap(_)), "{err}");
    assert!(err.to_string().contains("TUNSETIFF"));
    // A stream socket has no frame boundaries.
    let stream = std::os::unix::net::UnixStream::pair().unwrap().0;
    assert!(matches!(
        Net::with_socket(OwnedFd::from(stream), MAC),
        Err(NetError::NotADatagramSocket)
    ));
}

/// Put a control command on the control queue: header (class, cmd), then a 1-byte ack buffer.
fn send_ctrl(mem: &GuestMemory, guest: &Guest<'_>, slot: u16, class: u8, cmd: u8, ack: bool) {
    let base = 0xb0_0000 + u64::from(slot) * 0x100;
    mem.write_slice(&[class, cmd], GuestAddress(base)).unwrap();
    mem.write_slice(&[0xee], GuestAddress(base + 0x80)).unwrap();
    let hdr_flags = if ack { NEXT } else { 0 };
    guest
        .ctrl
        .desc_table()
        .store(
            slot * 2,
            RawDescriptor::from(SplitDescriptor::new(base, 2, hdr_flags, slot * 2 + 1)),
        )
        .unwrap();
    if ack {
        guest
            .ctrl
            .desc_table()
            .store(
                slot * 2 + 1,
                RawDescriptor::from(SplitDescriptor::new(base + 0x80, 1, WRITE, 0)),
            )
            .unwrap();
    }
    guest.ctrl.set_avail(slot, slot * 2);
    guest.ctrl.set_avail_idx(slot + 1);
}

#[test]
fn a_restored_device_asks_its_guest_to_announce_itself() {
    let mem = mem();
    let (ours, _peer) = seqpacket_pair();
    let mut net = Net::with_socket(ours, MAC).unwrap();
    net.ack_features(NET_FEATURES);
    let state = net.save();
    let (ours, _peer) = seqpacket_pair();
    let restored = Net::restore(
        NetArgs {
            backend: NetBackend::Socket(ours),
            mac: None,
        },
        &state,
    )
    .unwrap();
    let guest = Guest::new(&mem);
    let mut dev = Dev::start(restored, state.acked_features, &mem, &guest);
    dev.turn();
    let config_bit = virtio_bindings::virtio_mmio::VIRTIO_MMIO_INT_CONFIG;
    assert_ne!(dev.interrupt.status() & config_bit, 0, "the guest is told");
    let status = |dev: &Dev| {
        let mut s = [0u8; 2];
        dev.dev.lock().unwrap().read_config(6, &mut s);
        u32::from(u16::from_le_bytes(s))
    };
    let announce = VIRTIO_NET_S_ANNOUNCE;
    assert_eq!(
        status(&dev),
        VIRTIO_NET_S_LINK_UP | announce,
        "the link stays up"
    );
    // A command the device does not know: refused; one without an ack buffer: nothing written.
    send_ctrl(&mem, &guest, 0, 9, 9, true);
    send_ctrl(&mem, &guest, 1, VIRTIO_NET_CTRL_ANNOUNCE as u8, 0, false);
    dev.kick(CTRL);
    dev.turn();
    assert_eq!(guest.ctrl.used_idx(), 2);
    let mut ack = [0u8; 1];
    mem.read_slice(&mut ack, GuestAddress(0xb0_0080)).unwrap();
    assert_eq!(ack[0], VIRTIO_NET_ERR as u8);
    assert_eq!(guest.ctrl.used(1).1, 0);
    assert_eq!(status(&dev) & announce, announce, "still to be acked");
    // The real acknowledgement clears the bit.
    send_ctrl(&mem, &guest, 2, VIRTIO_NET_CTRL_ANNOUNCE as u8, 0, true);
    dev.kick(CTRL);
    dev.turn();
    assert_eq!(guest.ctrl.used_idx(), 3);
    assert_eq!(guest.ctrl.used(2).1, 1);
    mem.read_slice(&mut ack, GuestAddress(0xb0_0280)).unwrap();
    assert_eq!(ack[0], VIRTIO_NET_OK as u8);
    assert_eq!(status(&dev), VIRTIO_NET_S_LINK_UP);
    let c = dev.counters();
    assert_eq!((c.announces, c.announce_acks, c.ctrl_refused), (1, 1, 2));
}

#[test]
fn without_guest_announce_a_restored_device_flaps_its_link() {
    let mem = mem();
    let (ours, _peer) = seqpacket_pair();
    let mut net = Net::with_socket(ours, MAC).unwrap();
    net.ack_features(NET_FEATURES & !bit(VIRTIO_NET_F_GUEST_ANNOUNCE) & !bit(VIRTIO_NET_F_CTRL_VQ));
    let state = net.save();
    assert_eq!(state.mac, MAC);
    assert_eq!(state.status, VIRTIO_NET_S_LINK_UP as u16);
    let json = serde_json::to_string(&state).unwrap();
    let state: NetState = serde_json::from_str(&json).unwrap();

    let (ours, peer) = seqpacket_pair();
    let restored = Net::restore(
        NetArgs {
            backend: NetBackend::Socket(ours),
            mac: None,
        },
        &state,
    )
    .unwrap();
    assert_eq!(restored.mac(), MAC);
    assert_eq!(restored.save(), state);
    let mut guest = Guest::new(&mem);
    guest.post_rx(2048);
    let mut dev = Dev::start(restored, state.acked_features, &mem, &guest);
    dev.turn();
    let config_bit = virtio_bindings::virtio_mmio::VIRTIO_MMIO_INT_CONFIG;
    assert_ne!(dev.interrupt.status() & config_bit, 0, "the guest is told");
    dev.interrupt.ack(config_bit);
    let status = |dev: &Dev| {
        let mut s = [0u8; 2];
        dev.dev.lock().unwrap().read_config(6, &mut s);
        u16::from_le_bytes(s)
    };
    assert_eq!(status(&dev), 0, "the guest sees the link down once");
    assert_ne!(
        dev.interrupt.status() & config_bit,
        0,
        "and is told it is up"
    );
    assert_eq!(status(&dev), VIRTIO_NET_S_LINK_UP as u16);
    assert_eq!(dev.counters().announces, 1);
    // And frames flow.
    send(&peer, &with_hdr(&frame(80, 1)));
    let mut got = Vec::new();
    dev.until("a frame", |_| {
        got.extend(guest.received());
        !got.is_empty()
    });
}

/// A real tap in a network namespace of the test's own: the ioctls (vnet header size,
/// offloads) work, and frames cross it both ways (an AF_PACKET socket on the tap plays the
/// host's network stack).
#[test]
fn frames_cross_a_real_tap() {
    assert_eq!(
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() },
        0,
        "this test needs root (a tap in a network namespace of its own)"
    );
    std::thread::spawn(|| {
        // SAFETY: unshare affects only this thread, which does nothing else afterwards.
        let r = unsafe { libc::unshare(libc::CLONE_NEWNET) };
        assert_eq!(
            r,
            0,
            "unshare(CLONE_NEWNET): {}",
            std::io::Error::last_os_error()
        );
        let (tap, index) = open_test_tap();
        let packet = packet_socket(index);
        let mem = mem();
        let mut guest = Guest::new(&mem);
        for _ in 0..16 {
            guest.post_rx(4096);
        }
        let mut dev = Dev::start(Net::new(tap, MAC).unwrap(), NET_FEATURES, &mem, &guest);
        dev.turn();
        // Guest to host.
        let out = frame(500, 1);
        guest.send([0; VNET_HDR_LEN], &out, 3);
        dev.kick(TX);
        dev.turn();
        assert_eq!(dev.counters().tx_frames, 1);
        let mut buf = vec![0u8; 4096];
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            // SAFETY: recv writes at most buf.len() bytes.
            let n = unsafe {
                libc::recv(
                    packet.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if n > 0 && buf[..n as usize] == out[..] {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the frame never came out of the tap"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        // Host to guest.
        let mut back = frame(700, 2);
        back[..6].copy_from_slice(&MAC);
        // SAFETY: send reads back.len() bytes.
        let n = unsafe { libc::send(packet.as_raw_fd(), back.as_ptr().cast(), back.len(), 0) };
        assert_eq!(
            n,
            back.len() as isize,
            "{}",
            std::io::Error::last_os_error()
        );
        let mut got = Vec::new();
        dev.until("the frame from the tap", |_| {
            got.extend(guest.received());
            got.iter().any(|(_, f)| f[VNET_HDR_LEN..] == back[..])
        });
        dev.assert_nothing_in_flight();
    })
    .join()
    .unwrap();
}

fn ifreq(name: &str) -> [u8; 40] {
    let mut req = [0u8; 40];
    req[..name.len()].copy_from_slice(name.as_bytes());
    req
}

/// `mtap0` in the current namespace, up, with IFF_VNET_HDR; and its index.
fn open_test_tap() -> (OwnedFd, i32) {
    // SAFETY: open with a NUL-terminated path.
    let fd = unsafe { libc::open(c"/dev/net/tun".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    assert!(fd >= 0, "/dev/net/tun: {}", std::io::Error::last_os_error());
    // SAFETY: a new descriptor we own.
    let tap = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut req = ifreq("mtap0");
    let flags = (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as i16;
    req[16..18].copy_from_slice(&flags.to_ne_bytes());
    // SAFETY: TUNSETIFF reads and writes a 40-byte ifreq.
    let r = unsafe { libc::ioctl(tap.as_raw_fd(), libc::TUNSETIFF, req.as_mut_ptr()) };
    assert_eq!(r, 0, "TUNSETIFF: {}", std::io::Error::last_os_error());
    // SAFETY: a plain socket call.
    let sock = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    assert!(sock >= 0);
    // SAFETY: a new descriptor we own.
    let sock = unsafe { OwnedFd::from_raw_fd(sock) };
    let mut req = ifreq("mtap0");
    let up = (libc::IFF_UP) as i16;
    req[16..18].copy_from_slice(&up.to_ne_bytes());
    // SAFETY: SIOCSIFFLAGS reads a 40-byte ifreq.
    let r = unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, req.as_mut_ptr()) };
    assert_eq!(r, 0, "SIOCSIFFLAGS: {}", std::io::Error::last_os_error());
    let mut req = ifreq("mtap0");
    // SAFETY: SIOCGIFINDEX reads and writes a 40-byte ifreq.
    let r = unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFINDEX, req.as_mut_ptr()) };
    assert_eq!(r, 0);
    let index = i32::from_ne_bytes([req[16], req[17], req[18], req[19]]);
    (tap, index)
}

fn packet_socket(index: i32) -> OwnedFd {
    // SAFETY: a plain socket call.
    let fd = unsafe {
        libc::socket(
            libc::AF_PACKET,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            (libc::ETH_P_ALL as u16).to_be() as i32,
        )
    };
    assert!(fd >= 0, "AF_PACKET: {}", std::io::Error::last_os_error());
    // SAFETY: a new descriptor we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: an all-zero sockaddr_ll is valid; the fields that matter are set below.
    let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    addr.sll_family = libc::AF_PACKET as u16;
    addr.sll_protocol = (libc::ETH_P_ALL as u16).to_be();
    addr.sll_ifindex = index;
    // SAFETY: bind reads a sockaddr_ll of the given size.
    let r = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_ll).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as u32,
        )
    };
    assert_eq!(r, 0, "bind: {}", std::io::Error::last_os_error());
    fd
}

/// The device's own cost per byte, without a guest or a network stack: 64 KiB TSO-sized
/// frames through a seqpacket socket both ways. Prints JSON (`cargo test --release -p
/// mayfly-devices bench_net -- --ignored --nocapture`).
#[test]
#[ignore]
fn bench_net_device_throughput() {
    let mem = mem();
    let (mut dev, mut guest, peer) = socket_dev(&mem, NET_FEATURES);
    let size = 60_000;
    let rounds = 2000;
    // SAFETY: setsockopt with an int.
    unsafe {
        let big: libc::c_int = 8 << 20;
        let fd = peer.as_raw_fd();
        for opt in [libc::SO_RCVBUF, libc::SO_SNDBUF] {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                opt,
                (&big as *const libc::c_int).cast(),
                4,
            );
        }
    }
    let f = frame(size, 1);
    // TX: the guest keeps the ring full, the peer drains.
    let start = Instant::now();
    let mut sent = 0u64;
    let mut received = 0u64;
    while received < rounds {
        while guest.tx_sent.wrapping_sub(guest.tx_used()) < QLEN && (guest.tx_sent as u64) < rounds
        {
            guest.send([0; VNET_HDR_LEN], &f, 1);
            sent += 1;
        }
        dev.kick(TX);
        dev.em.run_with_timeout(0).unwrap();
        while recv(&peer).is_some() {
            received += 1;
        }
    }
    let tx = start.elapsed();
    // RX: the peer sends, the guest reposts buffers as they are used.
    let mut rx_frames = 0u64;
    for _ in 0..QLEN {
        guest.post_rx(0x1_0000);
    }
    dev.kick(RX);
    let payload = with_hdr(&f);
    let start = Instant::now();
    let mut queued = 0u64;
    while rx_frames < rounds {
        while queued < rounds && queued - rx_frames < 32 {
            send(&peer, &payload);
            queued += 1;
        }
        dev.em.run_with_timeout(0).unwrap();
        let got = guest.received().len() as u64;
        for _ in 0..got {
            guest.post_rx(0x1_0000);
        }
        if got > 0 {
            dev.kick(RX);
        }
        rx_frames += got;
    }
    let rx = start.elapsed();
    let gbit = |d: Duration| (rounds * size as u64 * 8) as f64 / d.as_secs_f64() / 1e9;
    println!(
        "{{\"frame_bytes\": {size}, \"frames\": {rounds}, \"tx_gbit_s\": {:.2}, \"rx_gbit_s\": {:.2}, \"sent\": {sent}}}",
        gbit(tx),
        gbit(rx)
    );
}

#[test]
fn keeps_the_device_contract() {
    crate::virtio::contract::check(
        || Net::with_socket(seqpacket_pair().0, MAC).unwrap(),
        || NetArgs {
            backend: NetBackend::Socket(seqpacket_pair().0),
            mac: None,
        },
    );
}
