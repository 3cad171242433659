//! The block device against a scripted guest driver on virtio-queue's mock queues, over a real
//! layered disk in a temporary directory.

use std::path::PathBuf;

use virtio_queue::desc::split::Descriptor as SplitDescriptor;
use vm_memory::{Bytes, GuestAddress};

use super::*;
use crate::disk::tests::{make_base, TempDir};
use crate::disk::Chain;

const WRITE: u16 = virtio_bindings::virtio_ring::VRING_DESC_F_WRITE as u16;
const NEXT: u16 = virtio_bindings::virtio_ring::VRING_DESC_F_NEXT as u16;
const INDIRECT: u16 = virtio_bindings::virtio_ring::VRING_DESC_F_INDIRECT as u16;
const BASE_ID: &str = "sha256:block-tests";
const QLEN: u16 = 256;
const DISK_BLOCKS: usize = 256;
const BS: usize = 4096;
/// Where the rig puts request buffers in guest memory.
const BUFS: u64 = 0x10_0000;
const MEM_SIZE: usize = 0x200_0000;

fn mem() -> GuestMemory {
    GuestMemory::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap()
}

/// A split virtqueue in guest memory, as a driver lays it out. (virtio-queue's
/// `MockSplitQueue` places its used ring over the end of its avail ring, so a device that
/// honours `used_event` reads garbage there; these rings do not overlap.)
struct Ring<'a> {
    mem: &'a GuestMemory,
}

const DESC_TABLE: u64 = 0;
const AVAIL_RING: u64 = 0x2000;
const USED_RING: u64 = 0x3000;

impl Ring<'_> {
    fn queue(&self) -> Queue {
        let mut q = Queue::new(QLEN).unwrap();
        q.set_size(QLEN);
        q.set_desc_table_address(Some(DESC_TABLE as u32), Some(0));
        q.set_avail_ring_address(Some(AVAIL_RING as u32), Some(0));
        q.set_used_ring_address(Some(USED_RING as u32), Some(0));
        q.set_ready(true);
        assert!(q.is_valid(self.mem));
        q
    }

    fn store(&self, index: u16, desc: SplitDescriptor) {
        let addr = DESC_TABLE + 16 * u64::from(index);
        self.mem.write_obj(desc, GuestAddress(addr)).unwrap();
    }

    fn set_avail(&self, slot: u16, head: u16) {
        let addr = AVAIL_RING + 4 + 2 * u64::from(slot % QLEN);
        self.mem.write_obj(head, GuestAddress(addr)).unwrap();
    }

    fn set_avail_idx(&self, idx: u16) {
        self.mem
            .write_obj(idx, GuestAddress(AVAIL_RING + 2))
            .unwrap();
    }

    fn used_idx(&self) -> u16 {
        self.mem.read_obj(GuestAddress(USED_RING + 2)).unwrap()
    }

    /// Used element `i`: (id, len).
    fn used(&self, i: u16) -> (u32, u32) {
        let addr = USED_RING + 4 + 8 * u64::from(i % QLEN);
        let id: u32 = self.mem.read_obj(GuestAddress(addr)).unwrap();
        let len: u32 = self.mem.read_obj(GuestAddress(addr + 4)).unwrap();
        (id, len)
    }
}

/// One descriptor: guest address, length, device-writable.
#[derive(Clone, Copy)]
struct D(u64, u32, bool);

/// A scripted driver: chains of descriptors, offered one by one.
struct Rig<'a> {
    mem: &'a GuestMemory,
    ring: Ring<'a>,
    block: Block,
    irq: EventFd,
    next_desc: u16,
    offered: u16,
    next_buf: u64,
    dir: TempDir,
    base: PathBuf,
}

impl<'a> Rig<'a> {
    fn new(mem: &'a GuestMemory, read_only: bool) -> Self {
        let dir = TempDir::new("blk");
        let base = make_base(&dir, DISK_BLOCKS * BS);
        let disk = if read_only {
            Disk::open(
                &Chain {
                    base: base.clone(),
                    base_identity: BASE_ID.into(),
                    layers: vec![],
                },
                true,
            )
            .unwrap()
        } else {
            Disk::create(&base, BASE_ID, &dir.join("top"), None).unwrap()
        };
        let block = Block::new(disk, "mayfly-disk-0").unwrap();
        Self::with_block(mem, block, dir, base, None)
    }

    fn with_block(
        mem: &'a GuestMemory,
        mut block: Block,
        dir: TempDir,
        base: PathBuf,
        features: Option<u64>,
    ) -> Self {
        let ring = Ring { mem };
        block.ack_features(features.unwrap_or(block.features()));
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let interrupt = Arc::new(Interrupt::new(irq.try_clone().unwrap()));
        block
            .activate(mem.clone(), vec![ring.queue()], interrupt)
            .unwrap();
        Self {
            mem,
            ring,
            block,
            irq,
            next_desc: 0,
            offered: 0,
            next_buf: BUFS,
            dir,
            base,
        }
    }

    /// Guest memory for a buffer of `len` bytes.
    fn alloc(&mut self, len: u64) -> u64 {
        let addr = self.next_buf;
        self.next_buf = (self.next_buf + len + 15) & !15;
        assert!(self.next_buf < MEM_SIZE as u64);
        addr
    }

    /// Write `descs` as one chain into the descriptor table; returns its head.
    fn chain(&mut self, descs: &[D]) -> u16 {
        let head = self.next_desc;
        for (i, d) in descs.iter().enumerate() {
            let index = self.next_desc;
            let last = i + 1 == descs.len();
            let flags = if d.2 { WRITE } else { 0 } | if last { 0 } else { NEXT };
            let next = if last { 0 } else { index + 1 };
            self.store(index, SplitDescriptor::new(d.0, d.1, flags, next));
            self.next_desc += 1;
        }
        head
    }

    fn store(&self, index: u16, desc: SplitDescriptor) {
        self.ring.store(index, desc);
    }

    fn offer(&mut self, head: u16) {
        self.ring.set_avail(self.offered, head);
        self.offered = self.offered.wrapping_add(1);
        self.ring.set_avail_idx(self.offered);
    }

    fn run(&mut self) {
        self.block.process_queue();
    }

    /// The used element `i`: (head, len).
    fn used(&self, i: u16) -> (u32, u32) {
        self.ring.used(i)
    }

    fn used_idx(&self) -> u16 {
        self.ring.used_idx()
    }

    /// A request header in guest memory.
    fn header(&mut self, kind: u32, sector: u64) -> u64 {
        let addr = self.alloc(16);
        let mut h = [0u8; 16];
        h[..4].copy_from_slice(&kind.to_le_bytes());
        h[8..].copy_from_slice(&sector.to_le_bytes());
        self.mem.write_slice(&h, GuestAddress(addr)).unwrap();
        addr
    }

    /// A status byte, preset to 0xff so a write to it shows.
    fn status(&mut self) -> u64 {
        let addr = self.alloc(1);
        self.mem.write_obj(0xffu8, GuestAddress(addr)).unwrap();
        addr
    }

    fn status_of(&self, addr: u64) -> u8 {
        self.mem.read_obj(GuestAddress(addr)).unwrap()
    }

    /// Offer a well-formed request, run the device, return (status, used len).
    fn request(&mut self, kind: u32, sector: u64, data: &[D]) -> (u8, u32) {
        let h = self.header(kind, sector);
        let s = self.status();
        let mut descs = vec![D(h, 16, false)];
        descs.extend_from_slice(data);
        descs.push(D(s, 1, true));
        let head = self.chain(&descs);
        let before = self.used_idx();
        self.offer(head);
        self.run();
        assert_eq!(self.used_idx(), before.wrapping_add(1), "answered");
        let (id, len) = self.used(before);
        assert_eq!(id, u32::from(head));
        (self.status_of(s), len)
    }

    fn write_data(&mut self, bytes: &[u8]) -> u64 {
        let addr = self.alloc(bytes.len() as u64);
        self.mem.write_slice(bytes, GuestAddress(addr)).unwrap();
        addr
    }

    fn read_guest(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.mem.read_slice(&mut v, GuestAddress(addr)).unwrap();
        v
    }

    fn disk_read(&mut self, offset: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.block.disk_mut().read(offset, &mut v).unwrap();
        v
    }
}

fn base_byte(i: usize) -> u8 {
    (i / 512 + i) as u8
}

fn file_hash(path: &std::path::Path) -> Vec<u8> {
    std::fs::read(path).unwrap()
}

#[test]
fn features_and_config_space_describe_the_disk() {
    let mem = mem();
    let rig = Rig::new(&mem, false);
    let f = rig.block.features();
    for bit in [
        VIRTIO_BLK_F_FLUSH,
        VIRTIO_BLK_F_BLK_SIZE,
        VIRTIO_BLK_F_TOPOLOGY,
        VIRTIO_BLK_F_SEG_MAX,
        VIRTIO_BLK_F_SIZE_MAX,
        VIRTIO_BLK_F_DISCARD,
        VIRTIO_BLK_F_WRITE_ZEROES,
        VIRTIO_RING_F_EVENT_IDX,
    ] {
        assert_ne!(f & (1 << bit), 0, "feature {bit}");
    }
    assert_ne!(f & VIRTIO_F_VERSION_1, 0);
    assert_eq!(f & (1 << VIRTIO_BLK_F_RO), 0);
    assert_eq!(rig.block.device_type(), VIRTIO_ID_BLOCK);
    assert_eq!(rig.block.queue_max_sizes(), &[256]);

    let mut cap = [0u8; 8];
    rig.block.read_config(0, &mut cap);
    assert_eq!(u64::from_le_bytes(cap), (DISK_BLOCKS * BS / 512) as u64);
    let mut word = [0u8; 4];
    rig.block.read_config(20, &mut word);
    assert_eq!(u32::from_le_bytes(word), 512, "logical block: a sector");
    let mut topology = [0u8; 8];
    rig.block.read_config(24, &mut topology);
    assert_eq!(topology, [3, 0, 8, 0, 8, 0, 0, 0], "4 KiB physical blocks");
    rig.block.read_config(12, &mut word);
    assert_eq!(u32::from_le_bytes(word), SEG_MAX);
    rig.block.read_config(44, &mut word);
    assert_eq!(u32::from_le_bytes(word), 8, "discard alignment in sectors");
    // Past the end, or at absurd offsets: zeros, no panic.
    let mut tail = [0xffu8; 8];
    rig.block.read_config(56, &mut tail);
    assert_eq!(tail, [1, 0, 0, 0, 0, 0, 0, 0]);
    rig.block.read_config(u64::MAX, &mut tail);
    assert_eq!(tail, [0; 8]);

    let ro = Rig::new(&mem, true);
    let f = ro.block.features();
    assert_ne!(f & (1 << VIRTIO_BLK_F_RO), 0);
    assert_eq!(f & (1 << VIRTIO_BLK_F_DISCARD), 0);
    assert_eq!(f & (1 << VIRTIO_BLK_F_WRITE_ZEROES), 0);
}

#[test]
fn writes_and_reads_through_the_queue_across_segments() {
    let mem = mem();
    let mut rig = Rig::new(&mem, false);
    // OUT: 8 KiB + 4 KiB in two descriptors at sector 16 (block 2).
    let a: Vec<u8> = (0..2 * BS).map(|i| (i % 251) as u8).collect();
    let b = vec![0x42u8; BS];
    let (pa, pb) = (rig.write_data(&a), rig.write_data(&b));
    let (status, len) = rig.request(
        VIRTIO_BLK_T_OUT,
        16,
        &[D(pa, a.len() as u32, false), D(pb, b.len() as u32, false)],
    );
    assert_eq!((status, len), (VIRTIO_BLK_S_OK, 1));
    let mut expect = a.clone();
    expect.extend_from_slice(&b);
    assert_eq!(rig.disk_read(16 * 512, 3 * BS), expect);

    // IN: the same range (and a sector of the base before it) into three buffers.
    let bufs = [
        rig.alloc(512 + 1000),
        rig.alloc(BS as u64),
        rig.alloc(3 * BS as u64),
    ];
    let lens = [512 + 1000, BS as u32, 2 * BS as u32 - 1000];
    let (status, len) = rig.request(
        VIRTIO_BLK_T_IN,
        15,
        &[
            D(bufs[0], lens[0], true),
            D(bufs[1], lens[1], true),
            D(bufs[2], lens[2], true),
        ],
    );
    assert_eq!(status, VIRTIO_BLK_S_OK);
    assert_eq!(len, 3 * BS as u32 + 512 + 1, "data and status");
    let mut got = Vec::new();
    for (addr, len) in bufs.iter().zip(lens) {
        got.extend(rig.read_guest(*addr, len as usize));
    }
    let before: Vec<u8> = (15 * 512..16 * 512).map(base_byte).collect();
    assert_eq!(&got[..512], &before[..]);
    assert_eq!(&got[512..], &expect[..]);
    let c = rig.block.counters();
    assert_eq!((c.reads, c.writes, c.errors), (1, 1, 0));
    assert_eq!(c.bytes_written, 3 * BS as u64);
}

#[test]
fn a_header_and_data_in_one_descriptor_work_too() {
    let mem = mem();
    let mut rig = Rig::new(&mem, false);
    // Framing is not assumed: header + 512 bytes in one readable descriptor.
    let addr = rig.alloc(16 + 512);
    let mut bytes = vec![0u8; 16 + 512];
    bytes[..4].copy_from_slice(&VIRTIO_BLK_T_OUT.to_le_bytes());
    bytes[8..16].copy_from_slice(&3u64.to_le_bytes());
    bytes[16..].fill(0x77);
    mem.write_slice(&bytes, GuestAddress(addr)).unwrap();
    let s = rig.status();
    let head = rig.chain(&[D(addr, 16 + 512, false), D(s, 1, true)]);
    rig.offer(head);
    rig.run();
    assert_eq!(rig.status_of(s), VIRTIO_BLK_S_OK);
    assert_eq!(rig.disk_read(3 * 512, 512), vec![0x77; 512]);
}

#[test]
fn indirect_descriptor_tables_are_followed() {
    let mem = mem();
    let mut rig = Rig::new(&mem, false);
    let h = rig.header(VIRTIO_BLK_T_IN, 0);
    let buf = rig.alloc(BS as u64);
    let s = rig.status();
    let table = rig.alloc(3 * 16);
    let entries = [
        SplitDescriptor::new(h, 16, NEXT, 1),
        SplitDescriptor::new(buf, BS as u32, WRITE | NEXT, 2),
        SplitDescriptor::new(s, 1, WRITE, 0),
    ];
    for (i, e) in entries.iter().enumerate() {
        mem.write_obj(*e, GuestAddress(table + 16 * i as u64))
            .unwrap();
    }
    let head = rig.next_desc;
    rig.store(head, SplitDescriptor::new(table, 48, INDIRECT, 0));
    rig.next_desc += 1;
    rig.offer(head);
    rig.run();
    assert_eq!(rig.status_of(s), VIRTIO_BLK_S_OK);
    assert_eq!(rig.used(0), (u32::from(head), BS as u32 + 1));
    let expect: Vec<u8> = (0..BS).map(base_byte).collect();
    assert_eq!(rig.read_guest(buf, BS), expect);
}

#[test]
fn flush_makes_writes_durable_and_get_id_returns_the_serial() {
    let mem = mem();
    let mut rig = Rig::new(&mem, false);
    let data = rig.write_data(&[0x99; BS]);
    assert_eq!(
        rig.request(VIRTIO_BLK_T_OUT, 8, &[D(data, BS as u32, false)])
            .0,
        VIRTIO_BLK_S_OK
    );
    assert_eq!(
        rig.request(VIRTIO_BLK_T_FLUSH, 0, &[]),
        (VIRTIO_BLK_S_OK, 1)
    );
    // The map on the file says block 1 holds data (the flush wrote it).
    let map = std::fs::read(rig.dir.join("top")).unwrap();
    assert_eq!(map[4096] & 0b1100, 0b0100);

    let id = rig.alloc(20);
    mem.write_slice(&[0xffu8; 20], GuestAddress(id)).unwrap();
    let (status, len) = rig.request(VIRTIO_BLK_T_GET_ID, 0, &[D(id, 20, true)]);
    assert_eq!((status, len), (VIRTIO_BLK_S_OK, 21));
    let mut expect = b"mayfly-disk-0".to_vec();
    expect.resize(20, 0);
    assert_eq!(rig.read_guest(id, 20), expect);
    // A short buffer gets what fits.
    let short = rig.alloc(4);
    assert_eq!(
        rig.request(VIRTIO_BLK_T_GET_ID, 0, &[D(short, 4, true)]),
        (VIRTIO_BLK_S_OK, 5)
    );
    assert_eq!(rig.read_guest(short, 4), b"mayf");

    // The block device goes away; the disk reopened from its files has the data.
    let Rig {
        block, dir, base, ..
    } = rig;
    drop(block);
    let mut disk = Disk::open(
        &Chain {
            base,
            base_identity: BASE_ID.into(),
            layers: vec![dir.join("top")],
        },
        false,
    )
    .unwrap();
    let mut got = vec![0u8; BS];
    disk.read(8 * 512, &mut got).unwrap();
    assert_eq!(got, vec![0x99; BS]);
}

fn range(sector: u64, sectors: u32, flags: u32) -> [u8; 16] {
    let mut r = [0u8; 16];
    r[..8].copy_from_slice(&sector.to_le_bytes());
    r[8..12].copy_from_slice(&sectors.to_le_bytes());
    r[12..].copy_from_slice(&flags.to_le_bytes());
    r
}

#[test]
fn discard_and_write_zeroes_zero_ranges_within_their_limits() {
    let mem = mem();
    let mut rig = Rig::new(&mem, false);
    let data = rig.write_data(&vec![0x11; 4 * BS]);
    rig.request(VIRTIO_BLK_T_OUT, 0, &[D(data, 4 * BS as u32, false)]);

    // Two ranges in one request: sectors 1..3 and block 2 (sectors 16..24).
    let mut ranges = range(1, 2, 0).to_vec();
    ranges.extend(range(16, 8, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP));
    let r = rig.write_data(&ranges);
    assert_eq!(
        rig.request(VIRTIO_BLK_T_WRITE_ZEROES, 0, &[D(r, 32, false)])
            .0,
        VIRTIO_BLK_S_OK
    );
    let got = rig.disk_read(0, 4 * BS);
    assert_eq!(&got[..512], &[0x11; 512]);
    assert!(got[512..1536].iter().all(|&b| b == 0));
    assert_eq!(&got[1536..2 * BS], &vec![0x11; 2 * BS - 1536][..]);
    assert!(got[2 * BS..3 * BS].iter().all(|&b| b == 0));
    assert_eq!(&got[3 * BS..], &[0x11; BS]);

    let r = rig.write_data(&range(24, 8, 0));
    assert_eq!(
        rig.request(VIRTIO_BLK_T_DISCARD, 0, &[D(r, 16, false)]).0,
        VIRTIO_BLK_S_OK
    );
    assert!(rig.disk_read(3 * BS as u64, BS).iter().all(|&b| b == 0));

    // Refused: unmap on a discard, unknown flags, past the end, too many sectors or ranges,
    // a length that is not whole ranges, no range at all.
    let cap = (DISK_BLOCKS * BS / 512) as u64;
    let cases: Vec<(u32, Vec<u8>, u8)> = vec![
        (
            VIRTIO_BLK_T_DISCARD,
            range(0, 8, 1).to_vec(),
            VIRTIO_BLK_S_UNSUPP,
        ),
        (
            VIRTIO_BLK_T_WRITE_ZEROES,
            range(0, 8, 4).to_vec(),
            VIRTIO_BLK_S_UNSUPP,
        ),
        (
            VIRTIO_BLK_T_WRITE_ZEROES,
            range(cap - 1, 2, 0).to_vec(),
            VIRTIO_BLK_S_IOERR,
        ),
        (
            VIRTIO_BLK_T_DISCARD,
            range(u64::MAX, 1, 0).to_vec(),
            VIRTIO_BLK_S_IOERR,
        ),
        (
            VIRTIO_BLK_T_WRITE_ZEROES,
            range(0, MAX_WRITE_ZEROES_SECTORS + 1, 0).to_vec(),
            VIRTIO_BLK_S_IOERR,
        ),
        (
            VIRTIO_BLK_T_DISCARD,
            range(0, 8, 0).repeat(17),
            VIRTIO_BLK_S_IOERR,
        ),
        (
            VIRTIO_BLK_T_DISCARD,
            range(0, 8, 0)[..12].to_vec(),
            VIRTIO_BLK_S_IOERR,
        ),
    ];
    let data = rig.write_data(&vec![0x22; BS]);
    rig.request(VIRTIO_BLK_T_OUT, 0, &[D(data, BS as u32, false)]);
    for (kind, bytes, want) in cases {
        let r = rig.write_data(&bytes);
        let (status, _) = rig.request(kind, 0, &[D(r, bytes.len() as u32, false)]);
        assert_eq!(status, want, "{kind} {bytes:?}");
    }
    assert_eq!(
        rig.request(VIRTIO_BLK_T_DISCARD, 0, &[]).0,
        VIRTIO_BLK_S_IOERR
    );
    // A refused range changed nothing, even with a valid one before it in the request.
    let mut two = range(0, 8, 0).to_vec();
    two.extend(range(cap, 8, 0));
    let r = rig.write_data(&two);
    assert_eq!(
        rig.request(VIRTIO_BLK_T_WRITE_ZEROES, 0, &[D(r, 32, false)])
            .0,
        VIRTIO_BLK_S_IOERR
    );
    assert_eq!(rig.disk_read(0, BS), vec![0x22; BS]);
}

#[test]
fn discard_and_write_zeroes_need_their_features() {
    let mem = mem();
    let dir = TempDir::new("blk-nofeat");
    let base = make_base(&dir, DISK_BLOCKS * BS);
    let disk = Disk::create(&base, BASE_ID, &dir.join("top"), None).unwrap();
    let block = Block::new(disk, "x").unwrap();
    let minimal = VIRTIO_F_VERSION_1 | 1 << VIRTIO_BLK_F_FLUSH;
    let mut rig = Rig::with_block(&mem, block, dir, base, Some(minimal));
    let r = rig.write_data(&range(0, 8, 0));
    assert_eq!(
        rig.request(VIRTIO_BLK_T_DISCARD, 0, &[D(r, 16, false)]).0,
        VIRTIO_BLK_S_UNSUPP
    );
    assert_eq!(
        rig.request(VIRTIO_BLK_T_WRITE_ZEROES, 0, &[D(r, 16, false)])
            .0,
        VIRTIO_BLK_S_UNSUPP
    );
}

#[test]
fn hostile_requests_get_errors_and_change_nothing_outside_the_top_layer() {
    let mem = mem();
    let mut rig = Rig::new(&mem, false);
    let base_before = file_hash(&rig.base);
    let cap = (DISK_BLOCKS * BS / 512) as u64;
    let buf = rig.alloc(2 * BS as u64);
    let data = D(buf, BS as u32, false);
    let room = D(buf, BS as u32, true);

    // Beyond the disk's end: starting past it, running over it, overflowing the offset.
    for sector in [cap, cap - 1, u64::MAX / 512 + 1, u64::MAX] {
        assert_eq!(
            rig.request(VIRTIO_BLK_T_OUT, sector, &[data]).0,
            VIRTIO_BLK_S_IOERR
        );
        assert_eq!(
            rig.request(VIRTIO_BLK_T_IN, sector, &[room]).0,
            VIRTIO_BLK_S_IOERR
        );
    }
    // Lengths that are not whole sectors.
    assert_eq!(
        rig.request(VIRTIO_BLK_T_OUT, 0, &[D(buf, 100, false)]).0,
        VIRTIO_BLK_S_IOERR
    );
    assert_eq!(
        rig.request(VIRTIO_BLK_T_IN, 0, &[D(buf, 513, true)]).0,
        VIRTIO_BLK_S_IOERR
    );
    // Data in the wrong direction: an IN with readable data, an OUT with writable room.
    assert_eq!(
        rig.request(VIRTIO_BLK_T_IN, 0, &[data, room]).0,
        VIRTIO_BLK_S_IOERR
    );
    assert_eq!(
        rig.request(VIRTIO_BLK_T_OUT, 0, &[data, room]).0,
        VIRTIO_BLK_S_IOERR
    );
    // Data outside guest memory, or wrapping the address space.
    assert_eq!(
        rig.request(
            VIRTIO_BLK_T_OUT,
            0,
            &[D(MEM_SIZE as u64 - 512, BS as u32, false)]
        )
        .0,
        VIRTIO_BLK_S_IOERR
    );
    assert_eq!(
        rig.request(VIRTIO_BLK_T_IN, 0, &[D(u64::MAX - 511, 1024, true)])
            .0,
        VIRTIO_BLK_S_IOERR
    );
    // A huge request (more than MAX_REQUEST_BYTES), refused before anything is looked at.
    let huge = D(buf, !511, true);
    assert_eq!(
        rig.request(VIRTIO_BLK_T_IN, 0, &[huge]).0,
        VIRTIO_BLK_S_IOERR
    );
    // Unknown request types.
    for kind in [2, 7, 14, 0xffff_ffff] {
        assert_eq!(
            rig.request(kind, 0, &[]).0,
            VIRTIO_BLK_S_UNSUPP,
            "type {kind}"
        );
    }

    // A header that is too short, or writable (so the device has no header to read).
    let h = rig.header(VIRTIO_BLK_T_OUT, 0);
    let s = rig.status();
    let head = rig.chain(&[D(h, 8, false), D(s, 1, true)]);
    rig.offer(head);
    rig.run();
    assert_eq!(rig.status_of(s), VIRTIO_BLK_S_IOERR);
    let s = rig.status();
    let head = rig.chain(&[D(h, 16, true), D(buf, 512, true), D(s, 1, true)]);
    rig.offer(head);
    rig.run();
    assert_eq!(rig.status_of(s), VIRTIO_BLK_S_IOERR);
    // A readable descriptor after a writable one.
    let s = rig.status();
    let head = rig.chain(&[D(h, 16, false), room, data, D(s, 1, true)]);
    rig.offer(head);
    rig.run();
    assert_eq!(rig.status_of(s), VIRTIO_BLK_S_IOERR);

    // The disk is as it was: nothing of the above was written.
    let expect: Vec<u8> = (0..4 * BS).map(base_byte).collect();
    assert_eq!(rig.disk_read(0, 4 * BS), expect);
    let mut tail = vec![0u8; BS];
    rig.block
        .disk_mut()
        .read((cap * 512) - BS as u64, &mut tail)
        .unwrap();
    assert_eq!(
        tail,
        ((DISK_BLOCKS - 1) * BS..DISK_BLOCKS * BS)
            .map(base_byte)
            .collect::<Vec<_>>()
    );
    assert_eq!(
        rig.block.disk().identity().layers.len(),
        0,
        "the top is still empty"
    );
    assert_eq!(file_hash(&rig.base), base_before);
    assert!(rig.block.counters().errors >= 20);
}

#[test]
fn chains_without_a_usable_status_byte_are_returned_with_nothing_written() {
    let mem = mem();
    let mut rig = Rig::new(&mem, false);
    let h = rig.header(VIRTIO_BLK_T_OUT, 0);
    let buf = rig.write_data(&[0x55; BS]);
    let marker = |rig: &Rig<'_>, addr: u64| rig.status_of(addr);
    let mut cases = Vec::new();

    // The status descriptor is readable, not writable: nothing is done or written.
    let s = rig.status();
    cases.push((
        rig.chain(&[D(h, 16, false), D(buf, BS as u32, false), D(s, 1, false)]),
        s,
    ));
    // No status at all: the chain is just a header.
    cases.push((rig.chain(&[D(h, 16, false)]), h + 15));
    // A zero-length "status".
    let s = rig.status();
    cases.push((rig.chain(&[D(h, 16, false), D(s, 0, true)]), s));
    // A status outside guest memory.
    cases.push((
        rig.chain(&[D(h, 16, false), D(MEM_SIZE as u64 + 10, 1, true)]),
        s,
    ));
    // A loop: 1 -> 2 -> 1.
    let s = rig.status();
    let head = rig.next_desc;
    rig.store(head, SplitDescriptor::new(h, 16, NEXT, head + 1));
    rig.store(head + 1, SplitDescriptor::new(s, 1, WRITE | NEXT, head));
    rig.next_desc += 2;
    cases.push((head, s));
    // A next index beyond the table.
    let s = rig.status();
    let head = rig.next_desc;
    rig.store(head, SplitDescriptor::new(h, 16, NEXT, head + 1));
    rig.store(head + 1, SplitDescriptor::new(s, 1, WRITE | NEXT, 999));
    rig.next_desc += 2;
    cases.push((head, s));

    let before: Vec<u8> = cases.iter().map(|&(_, s)| marker(&rig, s)).collect();
    for &(head, _) in &cases {
        rig.offer(head);
    }
    rig.run();
    assert_eq!(rig.used_idx(), cases.len() as u16, "every chain given back");
    for (i, &(head, s)) in cases.iter().enumerate() {
        assert_eq!(rig.used(i as u16), (u32::from(head), 0), "case {i}");
        assert_eq!(marker(&rig, s), before[i], "case {i}: nothing written");
    }
    assert_eq!(rig.block.counters().unanswerable, cases.len() as u64);
    assert_eq!(rig.block.counters().writes, 0, "no request was carried out");
    let expect: Vec<u8> = (0..BS).map(base_byte).collect();
    assert_eq!(rig.disk_read(0, BS), expect);
}

#[test]
fn a_read_only_disk_refuses_writes_and_zeroing_but_reads_and_flushes() {
    let mem = mem();
    let mut rig = Rig::new(&mem, true);
    let before = file_hash(&rig.base);
    let data = rig.write_data(&[1; BS]);
    assert_eq!(
        rig.request(VIRTIO_BLK_T_OUT, 0, &[D(data, BS as u32, false)])
            .0,
        VIRTIO_BLK_S_IOERR
    );
    let r = rig.write_data(&range(0, 8, 0));
    // Not offered on a read-only disk, so not negotiated either.
    assert_eq!(
        rig.request(VIRTIO_BLK_T_WRITE_ZEROES, 0, &[D(r, 16, false)])
            .0,
        VIRTIO_BLK_S_UNSUPP
    );
    assert_eq!(rig.request(VIRTIO_BLK_T_FLUSH, 0, &[]).0, VIRTIO_BLK_S_OK);
    let buf = rig.alloc(BS as u64);
    assert_eq!(
        rig.request(VIRTIO_BLK_T_IN, 0, &[D(buf, BS as u32, true)])
            .0,
        VIRTIO_BLK_S_OK
    );
    assert_eq!(
        rig.read_guest(buf, 8),
        (0..8).map(base_byte).collect::<Vec<_>>()
    );
    assert_eq!(file_hash(&rig.base), before);
}

#[test]
fn a_flood_is_served_in_bounded_batches_with_one_interrupt_each() {
    let mem = mem();
    let mut rig = Rig::new(&mem, false);
    // As many 1-sector reads as the table holds (3 descriptors each).
    let mut statuses = Vec::new();
    for i in 0..QLEN / 3 {
        let h = rig.header(VIRTIO_BLK_T_IN, u64::from(i));
        let buf = rig.alloc(512);
        let s = rig.status();
        let head = rig.chain(&[D(h, 16, false), D(buf, 512, true), D(s, 1, true)]);
        rig.offer(head);
        statuses.push(s);
    }
    rig.run();
    assert_eq!(rig.used_idx(), QLEN / 3);
    assert!(statuses
        .iter()
        .all(|&s| rig.status_of(s) == VIRTIO_BLK_S_OK));
    assert_eq!(rig.irq.read().unwrap(), 1, "one interrupt for the batch");
    assert_eq!(rig.block.counters().interrupts, 1);

    // More than a batch at once: one chain offered QLEN times (a driver gone wild). The
    // device serves one batch, then kicks itself for the rest instead of looping on.
    let h = rig.header(VIRTIO_BLK_T_FLUSH, 0);
    let s = rig.status();
    rig.next_desc = 0;
    let head = rig.chain(&[D(h, 16, false), D(s, 1, true)]);
    let start = rig.used_idx();
    for _ in 0..QLEN {
        rig.offer(head);
    }
    let _ = rig.block.queue_events[0].read();
    rig.run();
    assert_eq!(rig.used_idx().wrapping_sub(start), QLEN);
    assert_eq!(
        rig.block.queue_events[0].read().unwrap(),
        1,
        "came back for more"
    );
    rig.run();
    assert_eq!(rig.used_idx().wrapping_sub(start), QLEN);
}

#[test]
fn every_popped_chain_gets_a_used_entry() {
    let mem = mem();
    let mut rig = Rig::new(&mem, false);
    let mut heads = Vec::new();
    let buf = rig.alloc(BS as u64);
    for i in 0..40u32 {
        let h = rig.header(i % 16, u64::from(i));
        let s = rig.status();
        let descs: Vec<D> = match i % 4 {
            0 => vec![D(h, 16, false), D(buf, 512, true), D(s, 1, true)],
            1 => vec![D(h, 16, false), D(buf, 512, false), D(s, 1, true)],
            2 => vec![D(h, 16, false), D(s, 1, false)],
            _ => vec![D(h, 3, false), D(buf, 7, true), D(s, 1, true)],
        };
        let head = rig.chain(&descs);
        rig.offer(head);
        heads.push(head);
    }
    rig.run();
    assert_eq!(rig.used_idx(), heads.len() as u16);
    let mut seen: Vec<u32> = (0..heads.len() as u16).map(|i| rig.used(i).0).collect();
    seen.sort_unstable();
    let mut want: Vec<u32> = heads.iter().map(|&h| u32::from(h)).collect();
    want.sort_unstable();
    assert_eq!(seen, want);
    // Nothing is left popped: the queue's next index is where the driver's is.
    let q = &rig.block.queues().unwrap()[0];
    assert_eq!(q.next_avail(), rig.offered);
    assert_eq!(q.next_used(), rig.offered);
}

#[test]
fn save_restore_checks_the_disk_and_carries_features_and_serial() {
    let mem = mem();
    let mut rig = Rig::new(&mem, false);
    let data = rig.write_data(&[0x31; BS]);
    rig.request(VIRTIO_BLK_T_OUT, 0, &[D(data, BS as u32, false)]);
    // A snapshot: freeze, then save.
    let frozen = rig.block.freeze(&rig.dir.join("parent-2")).unwrap();
    let state = rig.block.save();
    assert_eq!(state.serial, "mayfly-disk-0");
    assert!(!state.read_only);
    assert_eq!(state.disk.layers, vec![frozen.id]);
    assert_eq!(state.acked_features, rig.block.features());
    let json = serde_json::to_string(&state).unwrap();
    assert_eq!(serde_json::from_str::<BlockState>(&json).unwrap(), state);

    // A clone: a new layer on the frozen one.
    let clone_top = rig.dir.join("clone");
    crate::disk::create_layer(&clone_top, &frozen).unwrap();
    let chain = Chain {
        base: rig.base.clone(),
        base_identity: BASE_ID.into(),
        layers: vec![frozen.path.clone(), clone_top.clone()],
    };
    let restored = Block::restore(Disk::open(&chain, false).unwrap(), &state).unwrap();
    assert_eq!(restored.save(), state);
    drop(restored);

    // The wrong disk: the base alone (what the guest wrote is missing).
    let bare = Chain {
        base: rig.base.clone(),
        base_identity: BASE_ID.into(),
        layers: vec![],
    };
    let e = Block::restore(Disk::open(&bare, true).unwrap(), &state)
        .err()
        .unwrap();
    assert!(matches!(e, BlockError::WrongDisk { .. }), "{e}");
    // Opened read-only where the snapshot's was writable.
    let ro = Chain {
        layers: vec![frozen.path.clone()],
        ..bare.clone()
    };
    let e = Block::restore(Disk::open(&ro, true).unwrap(), &state)
        .err()
        .unwrap();
    assert!(matches!(e, BlockError::ReadOnlyMismatch { .. }), "{e}");
    // Features the device does not offer.
    let mut odd = state.clone();
    odd.acked_features |= 1 << 40;
    let e = Block::restore(Disk::open(&chain, false).unwrap(), &odd)
        .err()
        .unwrap();
    assert!(matches!(e, BlockError::Features(_)), "{e}");
    assert!(matches!(
        Block::new(Disk::open(&chain, false).unwrap(), "a-serial-number-of-21"),
        Err(BlockError::SerialTooLong(_))
    ));
}

#[test]
fn the_event_loop_serves_notifications() {
    use event_manager::{EventManager, SubscriberOps};
    let mem = mem();
    let mut rig = Rig::new(&mem, false);
    let h = rig.header(VIRTIO_BLK_T_GET_ID, 0);
    let id = rig.alloc(20);
    let s = rig.status();
    let head = rig.chain(&[D(h, 16, false), D(id, 20, true), D(s, 1, true)]);
    let Rig {
        ring, block, irq, ..
    } = rig;
    let kick = block.queue_events[0].try_clone().unwrap();
    let block = Arc::new(std::sync::Mutex::new(block));
    let mut manager: EventManager<Arc<std::sync::Mutex<dyn MutEventSubscriber + Send>>> =
        EventManager::new().unwrap();
    manager.add_subscriber(block.clone());

    ring.set_avail(0, head);
    ring.set_avail_idx(1);
    kick.write(1).unwrap();
    manager.run_with_timeout(1000).unwrap();
    assert_eq!(ring.used_idx(), 1);
    assert_eq!(irq.read().unwrap(), 1);
    let mut got = [0u8; 13];
    mem.read_slice(&mut got, GuestAddress(id)).unwrap();
    assert_eq!(&got, b"mayfly-disk-0");
    assert_eq!(
        mem.read_obj::<u8>(GuestAddress(s)).unwrap(),
        VIRTIO_BLK_S_OK
    );
}

#[test]
#[ignore = "micro-benchmark: cargo test -p mayfly-devices --release -- --ignored --nocapture block_bench"]
fn block_bench_requests_through_the_queue() {
    let mem = mem();
    let mut rig = Rig::new(&mem, false);
    let batch = 64u16;
    let mut results = Vec::new();
    for (label, kind, len) in [
        ("write-4k", VIRTIO_BLK_T_OUT, BS as u32),
        ("read-4k", VIRTIO_BLK_T_IN, BS as u32),
        ("write-128k", VIRTIO_BLK_T_OUT, 32 * BS as u32),
        ("read-128k", VIRTIO_BLK_T_IN, 32 * BS as u32),
    ] {
        let rounds = 100u32;
        let mut rng = 0x1234_5678u64;
        let blocks = (DISK_BLOCKS - 32) as u64;
        rig.next_buf = BUFS;
        let bufs: Vec<(u64, u64, u64)> = (0..batch)
            .map(|_| (rig.alloc(16), rig.alloc(u64::from(len)), rig.alloc(1)))
            .collect();
        let start = std::time::Instant::now();
        for _ in 0..rounds {
            rig.next_desc = 0;
            for &(h, data, s) in &bufs {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let sector = (rng % blocks) * 8;
                let mut hdr = [0u8; 16];
                hdr[..4].copy_from_slice(&kind.to_le_bytes());
                hdr[8..].copy_from_slice(&sector.to_le_bytes());
                mem.write_slice(&hdr, GuestAddress(h)).unwrap();
                let head = rig.chain(&[
                    D(h, 16, false),
                    D(data, len, kind == VIRTIO_BLK_T_IN),
                    D(s, 1, true),
                ]);
                rig.offer(head);
            }
            rig.run();
        }
        let per = start.elapsed().as_secs_f64() * 1e6 / f64::from(rounds * u32::from(batch));
        assert_eq!(rig.block.counters().errors, 0);
        results.push(format!(
            "{{\"what\":\"{label}\",\"us_per_request\":{per:.2}}}"
        ));
    }
    println!("[{}]", results.join(","));
}

#[test]
fn an_avail_index_beyond_the_queue_ends_the_pass() {
    // Found by the fuzzer (fuzz/, virtio_devices): with an avail index more than a queue ahead,
    // popping failed, and turning notifications back on found the same index "pending", so the
    // device came round again, forever, on its own thread. On a thread here, so that a pass
    // that never ends fails the test instead of hanging it.
    let mem: &'static GuestMemory = Box::leak(Box::new(mem()));
    let (done, pass) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut rig = Rig::new(mem, false);
        rig.ring.set_avail_idx(QLEN + 5);
        rig.run();
        let _ = done.send(rig.used_idx());
    });
    let used = pass
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("the pass over an avail index beyond the queue ended");
    assert_eq!(used, 0, "nothing is served from a broken avail ring");
}

#[test]
fn rings_laid_over_each_other_end_the_pass() {
    // Found by the fuzzer (fuzz/, virtio_devices): with the used ring's flags on top of the
    // avail index, turning notifications off set that index to 1 and turning them on set it
    // to 0, so each re-check found "more" and popped nothing, forever. On a thread, so that a
    // pass that never ends fails the test instead of hanging it.
    let mem: &'static GuestMemory = Box::leak(Box::new(mem()));
    let (done, pass) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut rig = Rig::new(mem, false);
        rig.block.reset();
        // Without EVENT_IDX: notifications are switched through the used ring's flags.
        let features = rig.block.features() & !(1 << VIRTIO_RING_F_EVENT_IDX);
        rig.block.ack_features(features);
        let queue = Queue::try_from(virtio_queue::QueueState {
            max_size: QLEN,
            next_avail: 0,
            next_used: 0,
            event_idx_enabled: false,
            size: 16,
            ready: true,
            desc_table: 0x1000,
            avail_ring: 0x2002,
            used_ring: 0x2004,
        })
        .unwrap();
        let interrupt = Arc::new(Interrupt::new(EventFd::new(libc::EFD_NONBLOCK).unwrap()));
        rig.block
            .activate(mem.clone(), vec![queue], interrupt)
            .unwrap();
        rig.run();
        let _ = done.send(());
    });
    pass.recv_timeout(std::time::Duration::from_secs(10))
        .expect("the pass over overlapping rings ended");
}

#[test]
fn keeps_the_device_contract() {
    // A read-only disk: the device restored over the same files reads as the one saved.
    let dir = TempDir::new("blk-contract");
    let base = make_base(&dir, DISK_BLOCKS * BS);
    let open = || {
        Disk::open(
            &Chain {
                base: base.clone(),
                base_identity: BASE_ID.into(),
                layers: vec![],
            },
            true,
        )
        .unwrap()
    };
    crate::virtio::contract::check(|| Block::new(open(), "mayfly-disk-0").unwrap(), open);
}
