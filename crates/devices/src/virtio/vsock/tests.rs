//! The vsock device against a scripted guest driver on virtio-queue's mock queues, with its
//! event loop run by the test itself (one step at a time, deterministic).

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use event_manager::{EventManager, SubscriberOps};
use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::Queue;
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use super::consts::{EVENT_TRANSPORT_RESET, TX};
use super::packet::*;
use super::*;

const WRITE: u16 = virtio_bindings::virtio_ring::VRING_DESC_F_WRITE as u16;
const NEXT: u16 = virtio_bindings::virtio_ring::VRING_DESC_F_NEXT as u16;
const GUEST_CID: u64 = 7;
const QLEN: u16 = 64;
/// The mock rings are made this long and the queues then set to [`QLEN`]: virtio-queue's mock
/// places the used ring `len` bytes after the available ring's start instead of `2 * len + 6`,
/// so at the queue's own length the available ring's upper half and the used ring's head
/// overlap (posting a 32nd buffer overwrote the used index). Four times longer, the first
/// [`QLEN`] entries of each ring are clear of the other.
const MOCK_LEN: u16 = 4 * QLEN;
/// Where each queue's buffers live in guest memory.
const RX_BUFS: u64 = 0x10_0000;
const TX_BUFS: u64 = 0x60_0000;
const EVT_BUFS: u64 = 0xa0_0000;
const RX_BUF_LEN: u32 = HDR_LEN as u32 + 4096;

/// A minimal guest driver: posts RX buffers, sends TX packets, reads what the device wrote.
struct Guest<'a> {
    mem: &'a GuestMemory,
    rx: MockSplitQueue<'a, GuestMemory>,
    tx: MockSplitQueue<'a, GuestMemory>,
    evt: MockSplitQueue<'a, GuestMemory>,
    rx_posted: u16,
    rx_seen: u16,
    tx_sent: u16,
    evt_posted: u16,
    evt_seen: u16,
}

impl<'a> Guest<'a> {
    fn new(mem: &'a GuestMemory) -> Self {
        Self {
            mem,
            rx: MockSplitQueue::create(mem, GuestAddress(0x1000), MOCK_LEN),
            tx: MockSplitQueue::create(mem, GuestAddress(0x4000), MOCK_LEN),
            evt: MockSplitQueue::create(mem, GuestAddress(0x7000), MOCK_LEN),
            rx_posted: 0,
            rx_seen: 0,
            tx_sent: 0,
            evt_posted: 0,
            evt_seen: 0,
        }
    }

    fn queues(&self) -> Vec<Queue> {
        [&self.rx, &self.tx, &self.evt]
            .map(|mock| {
                let mut queue: Queue = mock.create_queue().unwrap();
                queue.try_set_size(QLEN).unwrap();
                queue
            })
            .into()
    }

    fn post(q: &MockSplitQueue<'a, GuestMemory>, posted: &mut u16, base: u64, len: u32) {
        let slot = *posted % QLEN;
        let desc = SplitDescriptor::new(base + u64::from(slot) * 0x2000, len, WRITE, 0);
        q.desc_table()
            .store(slot, RawDescriptor::from(desc))
            .unwrap();
        q.avail()
            .ring()
            .ref_at(usize::from(slot))
            .unwrap()
            .store(slot);
        *posted = posted.wrapping_add(1);
        q.avail().idx().store(*posted);
    }

    fn post_rx(&mut self, count: u16) {
        for _ in 0..count {
            Self::post(&self.rx, &mut self.rx_posted, RX_BUFS, RX_BUF_LEN);
        }
    }

    fn post_evt(&mut self) {
        Self::post(&self.evt, &mut self.evt_posted, EVT_BUFS, 8);
    }

    /// Packets the device put on the RX queue since the last call.
    fn received(&mut self) -> Vec<(Header, Vec<u8>)> {
        let mut out = Vec::new();
        while self.rx_seen != self.rx.used().idx().load() {
            let slot = self.rx_seen % QLEN;
            let used = self
                .rx
                .used()
                .ring()
                .ref_at(usize::from(slot))
                .unwrap()
                .load();
            let addr = RX_BUFS + u64::from(used.id()) * 0x2000;
            let hdr: Header = self.mem.read_obj(GuestAddress(addr)).unwrap();
            let len = hdr.len as usize;
            let mut payload = vec![0u8; len];
            self.mem
                .read_slice(&mut payload, GuestAddress(addr + HDR_LEN as u64))
                .unwrap();
            out.push((hdr, payload));
            self.rx_seen = self.rx_seen.wrapping_add(1);
        }
        out
    }

    /// Events (ids) the device used.
    fn events(&mut self) -> Vec<u32> {
        let mut out = Vec::new();
        while self.evt_seen != self.evt.used().idx().load() {
            let slot = self.evt_seen % QLEN;
            let used = self
                .evt
                .used()
                .ring()
                .ref_at(usize::from(slot))
                .unwrap()
                .load();
            let id: u32 = self
                .mem
                .read_obj(GuestAddress(EVT_BUFS + u64::from(used.id()) * 0x2000))
                .unwrap();
            out.push(id);
            self.evt_seen = self.evt_seen.wrapping_add(1);
        }
        out
    }

    /// Put raw descriptors (already pointing at written memory) on the TX queue.
    fn send_raw(&mut self, descs: &[SplitDescriptor]) {
        let head = (self.tx_sent * 4) % QLEN;
        for (i, d) in descs.iter().enumerate() {
            let mut d = *d;
            if i + 1 < descs.len() {
                d = SplitDescriptor::new(
                    d.addr().0,
                    d.len(),
                    d.flags() | NEXT,
                    head + i as u16 + 1,
                );
            }
            self.tx
                .desc_table()
                .store(head + i as u16, RawDescriptor::from(d))
                .unwrap();
        }
        let slot = self.tx_sent % QLEN;
        self.tx
            .avail()
            .ring()
            .ref_at(usize::from(slot))
            .unwrap()
            .store(head);
        self.tx_sent = self.tx_sent.wrapping_add(1);
        self.tx.avail().idx().store(self.tx_sent);
    }

    fn send(&mut self, hdr: Header, payload: &[u8]) {
        let addr = TX_BUFS + u64::from(self.tx_sent % QLEN) * 0x1_0000;
        let mut hdr = hdr;
        hdr.len = payload.len() as u32;
        self.mem.write_obj(hdr, GuestAddress(addr)).unwrap();
        self.mem
            .write_slice(payload, GuestAddress(addr + HDR_LEN as u64))
            .unwrap();
        self.send_raw(&[SplitDescriptor::new(
            addr,
            (HDR_LEN + payload.len()) as u32,
            0,
            0,
        )]);
    }

    fn tx_used(&self) -> u16 {
        self.tx.used().idx().load()
    }
}

fn guest_hdr(src_port: u32, dst_port: u32, op: u16) -> Header {
    Header {
        src_cid: GUEST_CID,
        dst_cid: HOST_CID,
        src_port,
        dst_port,
        len: 0,
        type_: TYPE_STREAM,
        op,
        flags: 0,
        buf_alloc: 1 << 20,
        fwd_cnt: 0,
    }
}

struct Rig {
    mem: GuestMemory,
    dir: std::path::PathBuf,
    path: std::path::PathBuf,
}

impl Rig {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("mayfly-vsock-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("v.sock");
        Self {
            mem: GuestMemory::from_ranges(&[(GuestAddress(0), 0x100_0000)]).unwrap(),
            dir,
            path,
        }
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The device in an event loop the test turns.
struct Dev {
    dev: Arc<Mutex<Vsock>>,
    em: EventManager<Arc<Mutex<Vsock>>>,
    irq: EventFd,
}

impl Dev {
    fn start(vsock: Vsock, mem: &GuestMemory, guest: &Guest<'_>) -> Self {
        let dev = Arc::new(Mutex::new(vsock));
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let interrupt = Arc::new(Interrupt::new(irq.try_clone().unwrap()));
        dev.lock()
            .unwrap()
            .activate(mem.clone(), guest.queues(), interrupt)
            .unwrap();
        let mut em = EventManager::new().unwrap();
        em.add_subscriber(dev.clone());
        Self { dev, em, irq }
    }

    /// Run the event loop until it has nothing to do (a few rounds).
    fn turn(&mut self) {
        for _ in 0..10 {
            if self.em.run_with_timeout(20).unwrap() == 0 {
                break;
            }
        }
    }

    fn kick(&self, queue: usize) {
        self.dev.lock().unwrap().queue_events[queue]
            .write(1)
            .unwrap();
    }

    fn until(&mut self, what: &str, mut done: impl FnMut(&mut Self) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !done(self) {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            self.turn();
        }
    }
}

/// Host connects with CONNECT, guest accepts: returns the host stream and the connection's
/// (host port, guest port).
fn host_connect(
    dev: &mut Dev,
    guest: &mut Guest<'_>,
    path: &std::path::Path,
    port: u32,
) -> (UnixStream, u32) {
    let mut host = UnixStream::connect(path).unwrap();
    host.write_all(format!("CONNECT {port}\n").as_bytes())
        .unwrap();
    let mut request = None;
    dev.until("the REQUEST", |d| {
        d.turn();
        request = guest
            .received()
            .into_iter()
            .find(|(h, _)| h.op == OP_REQUEST);
        request.is_some()
    });
    let (req, _) = request.unwrap();
    let (local, dst) = (req.src_port, req.dst_port);
    assert_eq!(dst, port);
    guest.send(guest_hdr(port, local, OP_RESPONSE), &[]);
    dev.kick(TX);
    dev.turn();
    host.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut answer = [0u8; 32];
    let n = host.read(&mut answer).unwrap();
    assert_eq!(
        std::str::from_utf8(&answer[..n]).unwrap(),
        format!("OK {local}\n")
    );
    (host, local)
}

#[test]
fn host_to_guest_connection_carries_data_both_ways() {
    let rig = Rig::new("h2g");
    let mut guest = Guest::new(&rig.mem);
    guest.post_rx(32);
    let mut dev = Dev::start(
        Vsock::new(GUEST_CID, Some(&rig.path)).unwrap(),
        &rig.mem,
        &guest,
    );
    let (mut host, local) = host_connect(&mut dev, &mut guest, &rig.path, 52);

    host.write_all(b"ping from host").unwrap();
    let mut data = Vec::new();
    dev.until("the host's data", |d| {
        d.turn();
        for (h, p) in guest.received() {
            if h.op == OP_RW {
                data.extend(p);
            }
        }
        data == b"ping from host"
    });

    guest.send(guest_hdr(52, local, OP_RW), b"pong from guest");
    dev.kick(TX);
    dev.turn();
    let mut back = [0u8; 15];
    host.read_exact(&mut back).unwrap();
    assert_eq!(&back, b"pong from guest");

    // Host closes: the guest hears SHUTDOWN.
    drop(host);
    dev.until("the SHUTDOWN", |d| {
        d.turn();
        guest.received().iter().any(|(h, _)| h.op == OP_SHUTDOWN)
    });
    assert!(dev.irq.read().is_ok(), "the guest was interrupted");
}

#[test]
fn guest_to_host_connection_reaches_the_port_socket() {
    let rig = Rig::new("g2h");
    let listener = UnixListener::bind(format!("{}_1234", rig.path.display())).unwrap();
    let mut guest = Guest::new(&rig.mem);
    guest.post_rx(32);
    let mut dev = Dev::start(
        Vsock::new(GUEST_CID, Some(&rig.path)).unwrap(),
        &rig.mem,
        &guest,
    );
    guest.send(guest_hdr(40000, 1234, OP_REQUEST), &[]);
    dev.kick(TX);
    dev.until("the RESPONSE", |d| {
        d.turn();
        guest
            .received()
            .iter()
            .any(|(h, _)| h.op == OP_RESPONSE && { h.dst_port } == 40000)
    });
    let (mut accepted, _) = listener.accept().unwrap();
    guest.send(guest_hdr(40000, 1234, OP_RW), b"hello host");
    dev.kick(TX);
    dev.turn();
    let mut buf = [0u8; 10];
    accepted.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"hello host");

    // Nobody listens on port 99: refused.
    guest.send(guest_hdr(40001, 99, OP_REQUEST), &[]);
    dev.kick(TX);
    dev.until("the RST", |d| {
        d.turn();
        guest
            .received()
            .iter()
            .any(|(h, _)| h.op == OP_RST && { h.dst_port } == 40001)
    });
}

#[test]
fn malformed_connect_lines_close_only_that_client() {
    let rig = Rig::new("lines");
    let mut guest = Guest::new(&rig.mem);
    guest.post_rx(32);
    let mut dev = Dev::start(
        Vsock::new(GUEST_CID, Some(&rig.path)).unwrap(),
        &rig.mem,
        &guest,
    );
    for line in [
        &b"CONNECT\n"[..],
        b"CONNECT 99999999999\n",
        b"connect 52\n",
        b"CONNECT 52 extra\n",
        b"CONNECT 52\ntrailing",
        &[b'x'; 200][..],
    ] {
        let mut client = UnixStream::connect(&rig.path).unwrap();
        client.write_all(line).unwrap();
        client
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        dev.turn();
        let mut buf = [0u8; 16];
        assert_eq!(
            client.read(&mut buf).unwrap_or(0),
            0,
            "{line:?} was not refused"
        );
    }
    assert!(guest.received().is_empty(), "the guest never heard of them");
    // A good client still gets through.
    let (_host, _) = host_connect(&mut dev, &mut guest, &rig.path, 52);
}

#[test]
fn a_hostile_guest_gets_refusals_not_a_crash() {
    let rig = Rig::new("hostile");
    let mut guest = Guest::new(&rig.mem);
    guest.post_rx(64);
    let mut dev = Dev::start(
        Vsock::new(GUEST_CID, Some(&rig.path)).unwrap(),
        &rig.mem,
        &guest,
    );
    let (_host, local) = host_connect(&mut dev, &mut guest, &rig.path, 52);

    // Spoofed source CID: dropped silently.
    let mut spoof = guest_hdr(52, local, OP_RW);
    spoof.src_cid = 99;
    guest.send(spoof, b"x");
    // A packet to another CID, and a datagram type: refused.
    let mut other = guest_hdr(5, 6, OP_REQUEST);
    other.dst_cid = 42;
    guest.send(other, &[]);
    let mut dgram = guest_hdr(5, 7, OP_REQUEST);
    dgram.type_ = 2;
    guest.send(dgram, &[]);
    // Data for a connection that does not exist.
    guest.send(guest_hdr(8, 9, OP_RW), b"nobody");
    // A header that lies about its length.
    let addr = TX_BUFS + 0x40_0000;
    let mut liar = guest_hdr(52, local, OP_RW);
    liar.len = 60000;
    rig.mem.write_obj(liar, GuestAddress(addr)).unwrap();
    guest.send_raw(&[SplitDescriptor::new(addr, HDR_LEN as u32 + 10, 0, 0)]);
    // Descriptors outside guest memory, and too short for a header.
    guest.send_raw(&[SplitDescriptor::new(0xffff_0000_0000, 100, 0, 0)]);
    guest.send_raw(&[SplitDescriptor::new(addr, 10, 0, 0)]);
    dev.kick(TX);
    dev.until("every TX descriptor back", |d| {
        d.turn();
        guest.tx_used() == guest.tx_sent
    });
    let answers = guest.received();
    let rsts: Vec<(u32, u32)> = answers
        .iter()
        .filter(|(h, _)| h.op == OP_RST)
        .map(|(h, _)| (h.src_port, h.dst_port))
        .collect();
    assert!(rsts.contains(&(6, 5)), "{rsts:?}");
    assert!(rsts.contains(&(7, 5)), "{rsts:?}");
    assert!(rsts.contains(&(9, 8)), "{rsts:?}");
    let counters = dev.dev.lock().unwrap().counters();
    assert!(counters.bad_packets >= 5, "{counters:?}");
    assert_eq!(
        dev.dev.lock().unwrap().connections(),
        1,
        "the good connection lives"
    );

    // Sending beyond the credit mayfly gave: that connection is reset, not buffered.
    let chunk = vec![0u8; MAX_PAYLOAD];
    // The host never reads, so everything past what its socket takes stays with mayfly.
    for _ in 0..((BUF_ALLOC as usize * 4) / MAX_PAYLOAD + 8) {
        guest.send(guest_hdr(52, local, OP_RW), &chunk);
        dev.kick(TX);
        dev.turn();
        if dev.dev.lock().unwrap().connections() == 0 {
            break;
        }
    }
    assert_eq!(
        dev.dev.lock().unwrap().connections(),
        0,
        "the flood ended its connection"
    );
}

#[test]
fn a_restored_device_resets_the_guest_first_and_holds_new_connections_until_it_has() {
    let rig = Rig::new("reset");
    let mut guest = Guest::new(&rig.mem);
    guest.post_rx(32);
    let state = VsockState {
        guest_cid: GUEST_CID,
        acked_features: VIRTIO_F_VERSION_1,
        next_local_port: FIRST_LOCAL_PORT + 500,
    };
    let vsock = Vsock::restore(
        VsockArgs {
            guest_cid: GUEST_CID,
            path: Some(rig.path.clone()),
        },
        &state,
    )
    .unwrap();
    let mut dev = Dev::start(vsock, &rig.mem, &guest);
    dev.turn();
    assert!(guest.events().is_empty(), "no event buffer posted yet");
    // A host client connects right away: held, not sent before the reset.
    let mut host = UnixStream::connect(&rig.path).unwrap();
    host.write_all(b"CONNECT 52\n").unwrap();
    dev.turn();
    assert!(guest.received().is_empty());

    guest.post_evt();
    dev.kick(EVT);
    dev.until("the reset", |d| {
        d.turn();
        guest.events() == [EVENT_TRANSPORT_RESET]
    });
    dev.turn();
    assert!(
        guest.received().is_empty(),
        "nothing new before the guest handled the reset"
    );
    // The guest handled it (posts its event buffer again): the held connection goes out,
    // with a host port past every one used before the snapshot.
    guest.post_evt();
    dev.kick(EVT);
    let mut request = None;
    dev.until("the held REQUEST", |d| {
        d.turn();
        request = guest
            .received()
            .into_iter()
            .find(|(h, _)| h.op == OP_REQUEST);
        request.is_some()
    });
    let port = { request.unwrap().0.src_port };
    assert!(port >= FIRST_LOCAL_PORT + 500, "port {port} reused");
    assert_eq!(dev.dev.lock().unwrap().save().next_local_port, port + 1);
    drop(host);
}

/// Linux keeps several event buffers posted, handles the reset on a work queue of its own, and
/// may send packets before that work ran. Only a buffer posted after the reset shows that it
/// ran: a kick (perhaps left over) or buffers posted before say nothing.
#[test]
fn the_hold_ends_when_the_guest_posts_after_the_reset_not_at_any_kick() {
    let rig = Rig::new("reset-multi");
    let listener = UnixListener::bind(format!("{}_1234", rig.path.display())).unwrap();
    let mut guest = Guest::new(&rig.mem);
    guest.post_rx(32);
    for _ in 0..4 {
        guest.post_evt();
    }
    let state = VsockState {
        guest_cid: GUEST_CID,
        acked_features: VIRTIO_F_VERSION_1,
        next_local_port: FIRST_LOCAL_PORT,
    };
    let vsock = Vsock::restore(
        VsockArgs {
            guest_cid: GUEST_CID,
            path: Some(rig.path.clone()),
        },
        &state,
    )
    .unwrap();
    let mut dev = Dev::start(vsock, &rig.mem, &guest);
    dev.kick(EVT);
    dev.until("the reset", |d| {
        d.turn();
        guest.events() == [EVENT_TRANSPORT_RESET]
    });
    let mut host = UnixStream::connect(&rig.path).unwrap();
    host.write_all(b"CONNECT 52\n").unwrap();
    // The guest's own connection request, sent before its event work ran.
    guest.send(guest_hdr(40000, 1234, OP_REQUEST), &[]);
    dev.kick(TX);
    dev.kick(EVT);
    dev.turn();
    assert!(
        guest.received().is_empty(),
        "three buffers still posted and a kick do not mean the reset was handled"
    );
    guest.post_evt();
    dev.kick(EVT);
    let mut got = Vec::new();
    dev.until("the held REQUEST and RESPONSE", |d| {
        d.turn();
        got.extend(guest.received().into_iter().map(|(h, _)| h.op));
        got.contains(&OP_REQUEST) && got.contains(&OP_RESPONSE)
    });
    listener.accept().unwrap();
    drop(host);
}

/// A timer that expired and was disarmed in the same epoll round must not block the device
/// (which holds its lock meanwhile: the VM's control socket would hang on it too).
#[test]
fn a_disarmed_timer_does_not_block_the_device() {
    let rig = Rig::new("timer");
    let mut vsock = Vsock::new(GUEST_CID, Some(&rig.path)).unwrap();
    let fd = vsock.timer.as_raw_fd();
    // SAFETY: F_GETFL on a descriptor the device owns.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    assert_ne!(flags & libc::O_NONBLOCK, 0, "the timerfd blocks");
    // Disarmed, nothing expired: waiting returns at once (an error), it does not block.
    let start = Instant::now();
    assert!(vsock.timer.wait().is_err());
    assert!(start.elapsed() < Duration::from_secs(1));
}

#[test]
fn no_descriptor_is_in_flight_between_events() {
    let rig = Rig::new("inflight");
    let mut guest = Guest::new(&rig.mem);
    guest.post_rx(4);
    let mut dev = Dev::start(
        Vsock::new(GUEST_CID, Some(&rig.path)).unwrap(),
        &rig.mem,
        &guest,
    );
    let (host, local) = host_connect(&mut dev, &mut guest, &rig.path, 52);
    // The host socket takes some, then stops (nobody reads it): the rest waits in mayfly,
    // and every TX descriptor is back with the guest all the same.
    for _ in 0..8 {
        guest.send(guest_hdr(52, local, OP_RW), &vec![1u8; 30000]);
    }
    dev.kick(TX);
    dev.turn();
    assert_eq!(guest.tx_used(), guest.tx_sent, "TX descriptors all used");
    drop(host);
}

#[test]
fn a_tx_used_ring_over_its_avail_ring_does_not_spin() {
    // The rng device's fuzzer-found spin, on the TX queue: with the used ring over the avail
    // ring and the used index five ahead, every completed chain offers another. The chains
    // hold no packet, so a bound counting only good packets never stopped the pass. On a
    // thread, so that a pass that never ends fails the test instead of hanging it.
    let mem: &'static GuestMemory = Box::leak(Box::new(
        GuestMemory::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap(),
    ));
    let (done, pass) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let queue = |desc: u64, avail: u64, used: u64, next_used: u16| {
            Queue::try_from(virtio_queue::QueueState {
                max_size: QUEUE_SIZE,
                next_avail: 0,
                next_used,
                event_idx_enabled: false,
                size: 16,
                ready: true,
                desc_table: desc,
                avail_ring: avail,
                used_ring: used,
            })
            .unwrap()
        };
        let queues = vec![
            queue(0x1_0000, 0x1_1000, 0x1_2000, 0),
            queue(0x2_0000, 0x2_1000, 0x2_1000, 5),
            queue(0x3_0000, 0x3_1000, 0x3_2000, 0),
        ];
        let mut vsock = Vsock::new(GUEST_CID, None).unwrap();
        let interrupt = Arc::new(Interrupt::new(EventFd::new(libc::EFD_NONBLOCK).unwrap()));
        vsock.activate(mem.clone(), queues, interrupt).unwrap();
        // One chain offered on TX; each completion then offers the next.
        mem.write_obj(1u16, GuestAddress(0x2_1002)).unwrap();
        vsock.process_tx();
        let _ = done.send(vsock.counters().bad_packets);
    });
    let bad = pass
        .recv_timeout(Duration::from_secs(10))
        .expect("the TX pass over overlapping rings ended");
    assert!(
        bad <= u64::from(QUEUE_SIZE),
        "at most a queue's worth per pass: {bad}"
    );
}

#[test]
fn keeps_the_device_contract() {
    crate::virtio::contract::check(
        || Vsock::new(GUEST_CID, None).unwrap(),
        || VsockArgs {
            guest_cid: GUEST_CID,
            path: None,
        },
    );
}

/// A guest that floods one connection (its host end never reads) and never acknowledges
/// what it receives on another (its credit never comes back) stalls those two connections
/// only: the device's TX queue keeps moving, what it reads from the host is bounded by the
/// credit the guest gave, and a third connection still carries data both ways.
#[test]
fn a_flooding_guest_that_never_acknowledges_stalls_only_its_own_connections() {
    let rig = Rig::new("flood");
    let mut guest = Guest::new(&rig.mem);
    guest.post_rx(32);
    let mut dev = Dev::start(
        Vsock::new(GUEST_CID, Some(&rig.path)).unwrap(),
        &rig.mem,
        &guest,
    );

    // 1. Connection A: the guest sends all the credit mayfly gave it, in 4 KiB packets;
    //    the host end never reads. Every packet is taken off the TX ring.
    let (_host_a, local_a) = host_connect(&mut dev, &mut guest, &rig.path, 52);
    let chunk = vec![0x5au8; 4096];
    for _ in 0..(BUF_ALLOC as usize / chunk.len()) {
        guest.send(guest_hdr(52, local_a, OP_RW), &chunk);
        dev.kick(TX);
        dev.turn();
        let got = guest.received().len() as u16;
        guest.post_rx(got);
    }
    dev.until("every TX descriptor of the flood back", |d| {
        d.turn();
        guest.tx_used() == guest.tx_sent
    });

    // 2. Connection B: the host writes as fast as it can; the guest posts RX buffers but
    //    never says it consumed anything (fwd_cnt stays 0, no CREDIT_UPDATE).
    let (mut host_b, local_b) = host_connect(&mut dev, &mut guest, &rig.path, 53);
    host_b.set_nonblocking(true).unwrap();
    let guest_credit = guest_hdr(0, 0, 0).buf_alloc as usize;
    let mut written = 0usize;
    let mut delivered_b = 0usize;
    let mut blocked_rounds = 0;
    let block = vec![0xa5u8; 64 << 10];
    while blocked_rounds < 20 {
        match host_b.write(&block) {
            Ok(n) => {
                written += n;
                blocked_rounds = 0;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => blocked_rounds += 1,
            Err(e) => panic!("connection B's host end failed: {e}"),
        }
        assert!(
            written <= 16 * guest_credit,
            "the device read {written} bytes for a guest that gave {guest_credit} of credit"
        );
        dev.turn();
        let received = guest.received();
        for (h, p) in &received {
            if h.op == OP_RW && { h.src_port } == local_b {
                delivered_b += p.len();
            }
        }
        guest.post_rx(received.len() as u16);
    }
    assert!(
        delivered_b <= guest_credit,
        "{delivered_b} bytes sent to a guest that gave {guest_credit} of credit"
    );
    assert!(delivered_b > 0, "connection B carried nothing at all");

    // 3. Connection C: still both ways, while A and B stay stalled.
    let (mut host_c, local_c) = host_connect(&mut dev, &mut guest, &rig.path, 54);
    host_c.write_all(b"still here").unwrap();
    let mut data = Vec::new();
    dev.until("connection C's data", |d| {
        d.turn();
        let received = guest.received();
        for (h, p) in &received {
            if h.op == OP_RW && { h.src_port } == local_c {
                data.extend_from_slice(p);
            }
        }
        guest.post_rx(received.len() as u16);
        data == b"still here"
    });
    guest.send(guest_hdr(54, local_c, OP_RW), b"and back");
    dev.kick(TX);
    dev.turn();
    let mut back = [0u8; 8];
    host_c.read_exact(&mut back).unwrap();
    assert_eq!(&back, b"and back");
    assert_eq!(
        dev.dev.lock().unwrap().connections(),
        3,
        "the stalled connections are kept, not reset: they did nothing wrong"
    );
}
