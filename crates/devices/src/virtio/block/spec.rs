//! The numbers of virtio-blk (virtio 1.2, section 5.2) and mayfly's limits on a request.

/// `VIRTIO_ID_BLOCK`.
pub const VIRTIO_ID_BLOCK: u32 = 2;
pub const QUEUE_SIZE: u16 = 256;
/// Bytes of a sector, the unit of request offsets and the capacity.
pub const SECTOR_SIZE: u64 = 512;
/// The guest's logical block size: a sector, so file systems with 1 KiB blocks mount too.
pub const BLK_SIZE: u32 = 512;
/// The physical block size the guest is told to align to: the layers' block (4 KiB).
pub const PHYSICAL_BLOCK_SIZE: u32 = 4096;
/// Bytes of the device ID string GET_ID returns (`VIRTIO_BLK_ID_BYTES`).
pub const SERIAL_LEN: usize = 20;
/// Data segments per request the driver may use, and the largest segment.
pub const SEG_MAX: u32 = 128;
pub const SIZE_MAX: u32 = 1 << 20;
/// The most data one request may move (what SEG_MAX segments of SIZE_MAX hold); more is an
/// error.
pub const MAX_REQUEST_BYTES: u64 = SEG_MAX as u64 * SIZE_MAX as u64;
/// DISCARD / WRITE_ZEROES limits (config space): sectors per range and ranges per request.
pub const MAX_DISCARD_SECTORS: u32 = 1 << 22;
pub const MAX_WRITE_ZEROES_SECTORS: u32 = 1 << 22;
pub const MAX_DISCARD_SEG: u32 = 16;
/// Discard ranges are aligned to blocks (in sectors).
pub(crate) const DISCARD_SECTOR_ALIGNMENT: u32 = PHYSICAL_BLOCK_SIZE / 512;
const _: () = assert!(SECTOR_SIZE == 512);
/// Descriptors of one request taken into account; a longer chain is an error (the largest
/// legal request has SEG_MAX data descriptors, plus header and status).
pub(crate) const MAX_DESCS: usize = QUEUE_SIZE as usize + 2;
pub(crate) const HEADER_LEN: u64 = 16;
/// [`HEADER_LEN`] and [`SEGMENT_LEN`] as lengths in memory.
pub(crate) const HEADER_BYTES: usize = 16;
pub(crate) const SEGMENT_BYTES: usize = 16;
const _: () = assert!(HEADER_BYTES as u64 == HEADER_LEN && SEGMENT_BYTES as u64 == SEGMENT_LEN);
/// Bytes of one discard / write-zeroes range.
pub(crate) const SEGMENT_LEN: u64 = 16;

// Feature bits (virtio 1.2, 5.2.3) and request types / statuses (5.2.6).
pub(crate) const VIRTIO_BLK_F_SIZE_MAX: u32 = 1;
pub(crate) const VIRTIO_BLK_F_SEG_MAX: u32 = 2;
pub(crate) const VIRTIO_BLK_F_RO: u32 = 5;
pub(crate) const VIRTIO_BLK_F_BLK_SIZE: u32 = 6;
pub(crate) const VIRTIO_BLK_F_FLUSH: u32 = 9;
pub(crate) const VIRTIO_BLK_F_TOPOLOGY: u32 = 10;
pub(crate) const VIRTIO_BLK_F_DISCARD: u32 = 13;
pub(crate) const VIRTIO_BLK_F_WRITE_ZEROES: u32 = 14;
pub(crate) const VIRTIO_RING_F_INDIRECT_DESC: u32 = 28;
pub(crate) const VIRTIO_RING_F_EVENT_IDX: u32 = 29;

pub(crate) const VIRTIO_BLK_T_IN: u32 = 0;
pub(crate) const VIRTIO_BLK_T_OUT: u32 = 1;
pub(crate) const VIRTIO_BLK_T_FLUSH: u32 = 4;
pub(crate) const VIRTIO_BLK_T_GET_ID: u32 = 8;
pub(crate) const VIRTIO_BLK_T_DISCARD: u32 = 11;
pub(crate) const VIRTIO_BLK_T_WRITE_ZEROES: u32 = 13;
pub(crate) const VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP: u32 = 1;

pub(crate) const VIRTIO_BLK_S_OK: u8 = 0;
pub(crate) const VIRTIO_BLK_S_IOERR: u8 = 1;
pub(crate) const VIRTIO_BLK_S_UNSUPP: u8 = 2;

/// Bytes of the configuration space mayfly fills (through `write_zeroes_may_unmap` and its
/// padding; the secure-erase and zoned fields are for features it does not offer).
pub(crate) const CONFIG_LEN: usize = 60;
