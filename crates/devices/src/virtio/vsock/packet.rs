//! The virtio-vsock packet header (virtio 1.2, section 5.10.6), read from and written to
//! descriptor chains. Everything the guest writes into a header is untrusted: [`parse_tx`]
//! checks the lengths against the chain before a byte of payload is used.

use std::io::{Read, Write};

use virtio_queue::DescriptorChain;
use vm_memory::ByteValued;

use crate::virtio::GuestMemory;

/// Bytes of a packet header.
pub const HDR_LEN: usize = 44;
/// The largest payload mayfly accepts or sends in one packet (Linux sends at most 64 KiB).
pub const MAX_PAYLOAD: usize = 64 << 10;

pub const TYPE_STREAM: u16 = 1;

pub const OP_REQUEST: u16 = 1;
pub const OP_RESPONSE: u16 = 2;
pub const OP_RST: u16 = 3;
pub const OP_SHUTDOWN: u16 = 4;
pub const OP_RW: u16 = 5;
pub const OP_CREDIT_UPDATE: u16 = 6;
pub const OP_CREDIT_REQUEST: u16 = 7;

/// SHUTDOWN flags: the sender will receive no more / send no more.
pub const SHUTDOWN_RCV: u32 = 1;
pub const SHUTDOWN_SEND: u32 = 2;

/// The host's CID, as every guest knows it.
pub const HOST_CID: u64 = 2;

/// A packet header (little-endian on the wire; x86 is little-endian).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C, packed)]
pub struct Header {
    pub src_cid: u64,
    pub dst_cid: u64,
    pub src_port: u32,
    pub dst_port: u32,
    pub len: u32,
    pub type_: u16,
    pub op: u16,
    pub flags: u32,
    pub buf_alloc: u32,
    pub fwd_cnt: u32,
}

// SAFETY: Header is repr(C, packed) plain data (integers only): any byte pattern is a valid
// value and it has no padding.
unsafe impl ByteValued for Header {}

const _: () = assert!(std::mem::size_of::<Header>() == HDR_LEN);

/// Why a TX chain was not a usable packet.
#[derive(Debug, PartialEq, Eq)]
pub enum TxError {
    /// The chain cannot be read (addresses outside guest memory, a loop, too long).
    BadChain,
    /// Fewer readable bytes than a header.
    ShortHeader,
    /// The header claims more payload than the chain holds, or more than mayfly accepts.
    BadLength { claimed: u32, available: usize },
}

/// A packet the guest sent: its header and payload (at most [`MAX_PAYLOAD`] bytes).
#[derive(Debug)]
pub struct TxPacket {
    pub hdr: Header,
    pub payload: Vec<u8>,
}

/// Read the packet a TX descriptor chain holds.
pub fn parse_tx(
    mem: &GuestMemory,
    chain: DescriptorChain<&GuestMemory>,
) -> Result<TxPacket, TxError> {
    let mut reader = chain.reader(mem).map_err(|_| TxError::BadChain)?;
    if reader.available_bytes() < HDR_LEN {
        return Err(TxError::ShortHeader);
    }
    let hdr: Header = reader.read_obj().map_err(|_| TxError::BadChain)?;
    let claimed = hdr.len;
    let available = reader.available_bytes();
    if claimed as usize > MAX_PAYLOAD || claimed as usize > available {
        return Err(TxError::BadLength { claimed, available });
    }
    let mut payload = vec![0u8; claimed as usize];
    reader
        .read_exact(&mut payload)
        .map_err(|_| TxError::BadChain)?;
    Ok(TxPacket { hdr, payload })
}

/// Write a packet into an RX descriptor chain; returns the bytes written, or None if the chain
/// is unusable or too small for the header (and `payload` is cut to what fits: the caller
/// sizes it from [`rx_room`]).
pub fn write_rx(
    mem: &GuestMemory,
    chain: DescriptorChain<&GuestMemory>,
    hdr: &Header,
    payload: &[u8],
) -> Option<usize> {
    let mut writer = chain.writer(mem).ok()?;
    if writer.available_bytes() < HDR_LEN + payload.len() {
        return None;
    }
    writer.write_obj(*hdr).ok()?;
    writer.write_all(payload).ok()?;
    Some(HDR_LEN + payload.len())
}

/// Payload bytes an RX chain has room for (0 if it cannot even hold a header).
pub fn rx_room(mem: &GuestMemory, chain: &DescriptorChain<&GuestMemory>) -> usize {
    chain
        .clone()
        .writer(mem)
        .map(|w| w.available_bytes().saturating_sub(HDR_LEN).min(MAX_PAYLOAD))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use virtio_queue::{Queue, QueueOwnedT};
    use vm_memory::{Bytes, GuestAddress};

    const NEXT: u16 = virtio_bindings::virtio_ring::VRING_DESC_F_NEXT as u16;
    const WRITE: u16 = virtio_bindings::virtio_ring::VRING_DESC_F_WRITE as u16;

    fn mem() -> GuestMemory {
        GuestMemory::from_ranges(&[(GuestAddress(0), 0x100_0000)]).unwrap()
    }

    fn one_chain(mem: &GuestMemory, descs: &[RawDescriptor]) -> Queue {
        let vq = MockSplitQueue::new(mem, 16);
        for (i, d) in descs.iter().enumerate() {
            vq.desc_table().store(i as u16, *d).unwrap();
        }
        vq.avail().ring().ref_at(0).unwrap().store(0);
        vq.avail().idx().store(1);
        vq.create_queue().unwrap()
    }

    fn desc(addr: u64, len: u32, flags: u16, next: u16) -> RawDescriptor {
        RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next))
    }

    fn parse(mem: &GuestMemory, queue: &mut Queue) -> Result<TxPacket, TxError> {
        let chain = queue.iter(mem).unwrap().next().unwrap();
        parse_tx(mem, chain)
    }

    #[test]
    fn a_packet_split_over_descriptors_parses() {
        let mem = mem();
        let hdr = Header {
            src_cid: 3,
            dst_cid: HOST_CID,
            len: 5,
            op: OP_RW,
            type_: TYPE_STREAM,
            ..Default::default()
        };
        mem.write_obj(hdr, GuestAddress(0x10_0000)).unwrap();
        mem.write_slice(b"hello", GuestAddress(0x20_0000)).unwrap();
        let mut q = one_chain(
            &mem,
            &[
                desc(0x10_0000, HDR_LEN as u32, NEXT, 1),
                desc(0x20_0000, 5, 0, 0),
            ],
        );
        let pkt = parse(&mem, &mut q).unwrap();
        assert_eq!(pkt.hdr, hdr);
        assert_eq!(pkt.payload, b"hello");
    }

    #[test]
    fn lying_lengths_and_bad_chains_are_refused() {
        let mem = mem();
        let hdr = Header {
            len: 1000,
            ..Default::default()
        };
        mem.write_obj(hdr, GuestAddress(0x10_0000)).unwrap();
        // Claims 1000 bytes, holds 10.
        let mut q = one_chain(&mem, &[desc(0x10_0000, HDR_LEN as u32 + 10, 0, 0)]);
        assert!(matches!(
            parse(&mem, &mut q),
            Err(TxError::BadLength { claimed: 1000, .. })
        ));
        // Claims more than any packet may carry.
        let huge = Header {
            len: u32::MAX,
            ..Default::default()
        };
        mem.write_obj(huge, GuestAddress(0x10_0000)).unwrap();
        let mut q = one_chain(&mem, &[desc(0x10_0000, 0x10_0000, 0, 0)]);
        assert!(matches!(
            parse(&mem, &mut q),
            Err(TxError::BadLength { .. })
        ));
        // Too short for a header.
        let mut q = one_chain(&mem, &[desc(0x10_0000, 10, 0, 0)]);
        assert_eq!(parse(&mem, &mut q).unwrap_err(), TxError::ShortHeader);
        // Outside guest memory.
        let mut q = one_chain(&mem, &[desc(0xffff_0000_0000, 100, 0, 0)]);
        assert!(parse(&mem, &mut q).is_err());
        // A loop of descriptors: walked at most queue-size times (16 x 8 bytes here), so a
        // header that claims more than that is refused and nothing runs away.
        // The header's length field (bytes 24..28) comes from the fourth descriptor read,
        // the second buffer's first bytes.
        mem.write_obj(100u32, GuestAddress(0x10_1000)).unwrap();
        let mut q = one_chain(
            &mem,
            &[desc(0x10_0000, 8, NEXT, 1), desc(0x10_1000, 8, NEXT, 0)],
        );
        assert!(matches!(
            parse(&mem, &mut q),
            Err(TxError::BadLength { available, .. }) if available <= 16 * 8
        ));
    }

    #[test]
    fn rx_packets_fit_or_are_not_written() {
        let mem = mem();
        let mut q = one_chain(&mem, &[desc(0x10_0000, HDR_LEN as u32 + 4, WRITE, 0)]);
        let chain = q.iter(&mem).unwrap().next().unwrap();
        assert_eq!(rx_room(&mem, &chain), 4);
        let hdr = Header {
            op: OP_RW,
            len: 4,
            ..Default::default()
        };
        assert_eq!(
            write_rx(&mem, chain.clone(), &hdr, b"abcd"),
            Some(HDR_LEN + 4)
        );
        assert_eq!(write_rx(&mem, chain, &hdr, b"abcde"), None);
        let mut back = [0u8; 4];
        mem.read_slice(&mut back, GuestAddress(0x10_0000 + HDR_LEN as u64))
            .unwrap();
        assert_eq!(&back, b"abcd");
    }
}
