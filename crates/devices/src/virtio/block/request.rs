//! One virtio-blk request (virtio 1.2, section 5.2.6): parsed from its descriptor chain,
//! checked, and carried out on the disk.
//!
//! A request is a header (16 device-readable bytes: type, reserved, sector), data, and a status
//! byte (the last device-writable byte of the chain). The framing across descriptors is not
//! assumed (the spec forbids relying on it): the header is the first 16 readable bytes, the
//! status the last writable byte, the data what lies between. Everything the guest wrote is
//! checked before it is used: directions, lengths (whole sectors, within the disk, at most
//! [`MAX_REQUEST_BYTES`]), and guest addresses (every data buffer must lie in guest memory).
//! Data moves between the disk files and guest memory directly (preadv/pwritev into the guest's
//! buffers): no copy, no buffer of our own, nothing allocated per request.

use virtio_queue::DescriptorChain;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use crate::disk::{Disk, IoVecs};
use crate::virtio::GuestMemory;

use crate::virtio::block::spec::*;

/// What the device did, for tests and diagnostics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockCounters {
    pub reads: u64,
    pub writes: u64,
    pub flushes: u64,
    pub zeroes: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Requests answered with an error status.
    pub errors: u64,
    /// Chains given back with nothing written (no usable status byte).
    pub unanswerable: u64,
    /// Interrupts raised (one per batch at most).
    pub interrupts: u64,
}

/// One descriptor, as read once from the guest's table.
#[derive(Clone, Copy, Debug)]
pub(super) struct Desc {
    addr: u64,
    len: u32,
    write: bool,
}

/// A piece of guest memory a request's data (or discard ranges) lies in.
#[derive(Clone, Copy, Debug)]
struct Seg {
    addr: u64,
    len: u32,
}

/// What serving requests needs, apart from the queue.
pub(super) struct Engine {
    pub disk: Disk,
    pub serial: [u8; SERIAL_LEN],
    pub acked_features: u64,
    pub counters: BlockCounters,
    descs: Vec<Desc>,
    segs: Vec<Seg>,
    iov: IoVecs,
}

/// Outcome of one request: its status, and the data bytes written into the chain.
type Outcome = (u8, u32);

const IOERR: Outcome = (VIRTIO_BLK_S_IOERR, 0);
const UNSUPP: Outcome = (VIRTIO_BLK_S_UNSUPP, 0);

fn le_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

fn le_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

/// Append the bytes of `descs` from `skip` on, leaving out the last `drop_back`, to `out`;
/// returns their total. (Descriptor lengths are u32 and a chain holds at most 2^32 bytes, so
/// the u64 sums cannot overflow.)
fn collect(descs: &[Desc], mut skip: u64, drop_back: u64, out: &mut Vec<Seg>) -> u64 {
    out.clear();
    let total: u64 = descs.iter().map(|d| u64::from(d.len)).sum();
    let mut keep = total.saturating_sub(skip).saturating_sub(drop_back);
    let sum = keep;
    for d in descs {
        if keep == 0 {
            break;
        }
        let len = u64::from(d.len);
        if skip >= len {
            skip -= len;
            continue;
        }
        let n = (len - skip).min(keep);
        out.push(Seg {
            // Guest addresses that wrap fail the guest memory lookup later.
            addr: d.addr.wrapping_add(skip),
            // At most the descriptor's own (u32) length.
            len: u32::try_from(n).expect("a piece of one descriptor"),
        });
        keep -= n;
        skip = 0;
    }
    sum
}

/// Read `buf.len()` bytes from the guest memory `segs` cover, in order.
fn read_segs(mem: &GuestMemory, segs: &[Seg], buf: &mut [u8]) -> bool {
    let mut at = 0;
    for s in segs {
        if at == buf.len() {
            break;
        }
        let n = (s.len as usize).min(buf.len() - at);
        if mem
            .read_slice(&mut buf[at..at + n], GuestAddress(s.addr))
            .is_err()
        {
            return false;
        }
        at += n;
    }
    at == buf.len()
}

impl Engine {
    pub fn new(disk: Disk, serial: [u8; SERIAL_LEN]) -> Self {
        Self {
            disk,
            serial,
            acked_features: 0,
            counters: BlockCounters::default(),
            descs: Vec::with_capacity(MAX_DESCS),
            segs: Vec::with_capacity(MAX_DESCS),
            iov: IoVecs::with_capacity(MAX_DESCS),
        }
    }

    fn acked(&self, bit: u32) -> bool {
        self.acked_features & (1 << bit) != 0
    }

    /// Serve the request in `chain`; returns the used length (bytes written into the chain),
    /// 0 when the chain has no usable status byte and so cannot even be answered.
    pub fn handle(&mut self, mem: &GuestMemory, chain: DescriptorChain<&GuestMemory>) -> u32 {
        self.descs.clear();
        let mut too_long = false;
        let mut last = None;
        for d in chain {
            if self.descs.len() < MAX_DESCS {
                self.descs.push(Desc {
                    addr: d.addr().0,
                    len: d.len(),
                    write: d.is_write_only(),
                });
            } else {
                too_long = true;
            }
            last = Some(d);
        }
        // The chain ended where it claims to go on (a loop, an index past the table, a table
        // outside guest memory): it is broken, and no byte of it is trusted as the status.
        let Some(last) = last.filter(|d| !d.has_next()) else {
            self.counters.unanswerable += 1;
            return 0;
        };
        let status_addr = match last.addr().0.checked_add(u64::from(last.len())) {
            Some(end) if last.is_write_only() && last.len() > 0 => GuestAddress(end - 1),
            _ => {
                self.counters.unanswerable += 1;
                return 0;
            }
        };
        // A status byte the device cannot write: nothing is done, since nothing can be told.
        if !GuestMemoryBackend::address_in_range(mem, status_addr) {
            self.counters.unanswerable += 1;
            return 0;
        }
        let (status, written) = if too_long { IOERR } else { self.execute(mem) };
        if status != VIRTIO_BLK_S_OK {
            self.counters.errors += 1;
        }
        if mem.write_obj(status, status_addr).is_err() {
            self.counters.unanswerable += 1;
            return 0;
        }
        written + 1
    }

    /// Point `self.iov` at the guest memory of `self.segs`; false if any is outside it.
    fn map_segs(&mut self, mem: &GuestMemory) -> bool {
        self.iov.clear();
        for s in &self.segs {
            for slice in GuestMemoryBackend::get_slices(mem, GuestAddress(s.addr), s.len as usize) {
                match slice {
                    Ok(slice) => self.iov.push(slice.ptr_guard_mut().as_ptr(), slice.len()),
                    Err(_) => return false,
                }
            }
        }
        true
    }

    /// Check a data transfer of `len` bytes at `sector`; the disk offset.
    fn check_transfer(&self, sector: u64, len: u64) -> Option<u64> {
        if !len.is_multiple_of(SECTOR_SIZE) || len > MAX_REQUEST_BYTES {
            return None;
        }
        let offset = sector.checked_mul(SECTOR_SIZE)?;
        (offset.checked_add(len)? <= self.disk.size()).then_some(offset)
    }

    fn execute(&mut self, mem: &GuestMemory) -> Outcome {
        // Device-readable descriptors first, then device-writable ones (2.7.4.2).
        let first_write = self
            .descs
            .iter()
            .position(|d| d.write)
            .unwrap_or(self.descs.len());
        if self.descs[first_write..].iter().any(|d| !d.write) {
            return IOERR;
        }
        let (readable, writable) = self.descs.split_at(first_write);
        let mut header = [0u8; HEADER_BYTES];
        let mut segs = std::mem::take(&mut self.segs);
        collect(readable, 0, 0, &mut segs);
        let header_ok = read_segs(mem, &segs, &mut header);
        // Data the guest gives (after the header) and room it gives (before the status).
        let readable_len = collect(readable, HEADER_LEN, 0, &mut segs);
        let writable_len = writable
            .iter()
            .map(|d| u64::from(d.len))
            .sum::<u64>()
            .saturating_sub(1);
        self.segs = segs;
        if !header_ok {
            return IOERR;
        }
        let kind = le_u32(&header[0..4]);
        let sector = le_u64(&header[8..16]);
        match kind {
            VIRTIO_BLK_T_IN => {
                self.counters.reads += 1;
                if readable_len != 0 {
                    return IOERR;
                }
                self.read(mem, sector, first_write)
            }
            VIRTIO_BLK_T_OUT => {
                self.counters.writes += 1;
                if writable_len != 0 || self.disk.is_read_only() {
                    return IOERR;
                }
                // self.segs holds the data after the header.
                self.write(mem, sector, readable_len)
            }
            VIRTIO_BLK_T_FLUSH => {
                self.counters.flushes += 1;
                match self.disk.flush() {
                    Ok(()) => (VIRTIO_BLK_S_OK, 0),
                    Err(_) => IOERR,
                }
            }
            VIRTIO_BLK_T_GET_ID => self.get_id(mem, first_write),
            VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => {
                let feature = if kind == VIRTIO_BLK_T_DISCARD {
                    VIRTIO_BLK_F_DISCARD
                } else {
                    VIRTIO_BLK_F_WRITE_ZEROES
                };
                if !self.acked(feature) {
                    return UNSUPP;
                }
                self.counters.zeroes += 1;
                if self.disk.is_read_only() {
                    return IOERR;
                }
                self.zeroes(mem, kind == VIRTIO_BLK_T_DISCARD, readable_len)
            }
            _ => UNSUPP,
        }
    }

    /// IN: the data goes into the writable buffers before the status byte.
    fn read(&mut self, mem: &GuestMemory, sector: u64, first_write: usize) -> Outcome {
        let mut segs = std::mem::take(&mut self.segs);
        let len = collect(&self.descs[first_write..], 0, 1, &mut segs);
        self.segs = segs;
        let Some(offset) = self.check_transfer(sector, len) else {
            return IOERR;
        };
        if !self.map_segs(mem) {
            return IOERR;
        }
        // SAFETY: every iovec points into a region of `mem` (get_slices checked each range
        // against the guest's memory), which stays mapped while `mem` lives: for the whole
        // call. Nothing else in this process holds a Rust reference into guest memory; the
        // guest itself may touch it concurrently, which only changes bytes it owns.
        match unsafe { self.disk.read_vectored(offset, &self.iov) } {
            Ok(()) => {
                self.counters.bytes_read += len;
                (VIRTIO_BLK_S_OK, u32::try_from(len).unwrap_or(u32::MAX))
            }
            Err(_) => IOERR,
        }
    }

    /// OUT: the data is in `self.segs` (the readable bytes after the header).
    fn write(&mut self, mem: &GuestMemory, sector: u64, len: u64) -> Outcome {
        let Some(offset) = self.check_transfer(sector, len) else {
            return IOERR;
        };
        if !self.map_segs(mem) {
            return IOERR;
        }
        // SAFETY: as in `read`: every iovec points into guest memory that stays mapped for the
        // call; a write only reads it.
        if unsafe { self.disk.write_vectored(offset, &self.iov) }.is_err() {
            return IOERR;
        }
        // A driver that did not accept FLUSH expects every write to be durable when done.
        if !self.acked(VIRTIO_BLK_F_FLUSH) && self.disk.flush().is_err() {
            return IOERR;
        }
        self.counters.bytes_written += len;
        (VIRTIO_BLK_S_OK, 0)
    }

    /// GET_ID: the serial number, zero-padded to 20 bytes (or as much as fits).
    fn get_id(&mut self, mem: &GuestMemory, first_write: usize) -> Outcome {
        let mut segs = std::mem::take(&mut self.segs);
        let room = collect(&self.descs[first_write..], 0, 1, &mut segs);
        let mut at = 0usize;
        let want = usize::try_from(room).unwrap_or(usize::MAX).min(SERIAL_LEN);
        let mut ok = want > 0;
        for s in &segs {
            if at == want {
                break;
            }
            let n = (s.len as usize).min(want - at);
            if mem
                .write_slice(&self.serial[at..at + n], GuestAddress(s.addr))
                .is_err()
            {
                ok = false;
                break;
            }
            at += n;
        }
        self.segs = segs;
        if ok {
            (
                VIRTIO_BLK_S_OK,
                u32::try_from(at).expect("at most SERIAL_LEN"),
            )
        } else {
            IOERR
        }
    }

    /// DISCARD / WRITE_ZEROES: the readable data is a list of 16-byte ranges.
    fn zeroes(&mut self, mem: &GuestMemory, discard: bool, len: u64) -> Outcome {
        let count = len / SEGMENT_LEN;
        if !len.is_multiple_of(SEGMENT_LEN) || count == 0 || count > u64::from(MAX_DISCARD_SEG) {
            return IOERR;
        }
        let mut ranges = [0u8; SEGMENT_BYTES * MAX_DISCARD_SEG as usize];
        // At most MAX_DISCARD_SEG segments (checked above).
        let ranges = &mut ranges[..usize::try_from(len).expect("a bounded range list")];
        if !read_segs(mem, &self.segs, ranges) {
            return IOERR;
        }
        // Check every range before changing anything.
        for r in ranges.chunks_exact(SEGMENT_BYTES) {
            let (sector, sectors, flags) =
                (le_u64(&r[0..8]), le_u32(&r[8..12]), le_u32(&r[12..16]));
            if flags & !VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0 || (discard && flags != 0) {
                return UNSUPP;
            }
            let max = if discard {
                MAX_DISCARD_SECTORS
            } else {
                MAX_WRITE_ZEROES_SECTORS
            };
            let in_disk = sector
                .checked_add(u64::from(sectors))
                .and_then(|end| end.checked_mul(SECTOR_SIZE))
                .is_some_and(|end| end <= self.disk.size());
            if sectors > max || !in_disk {
                return IOERR;
            }
        }
        for r in ranges.chunks_exact(SEGMENT_BYTES) {
            let (sector, sectors) = (le_u64(&r[0..8]), le_u32(&r[8..12]));
            // Discarded ranges read as zeros too: one behaviour, and no stale data.
            if self
                .disk
                .write_zeroes(sector * SECTOR_SIZE, u64::from(sectors) * SECTOR_SIZE)
                .is_err()
            {
                return IOERR;
            }
        }
        (VIRTIO_BLK_S_OK, 0)
    }
}
