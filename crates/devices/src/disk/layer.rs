//! One layer file: its header, its block map, and the positioned I/O on its data area.
//!
//! Everything read from a layer file is untrusted: the header is checked field by field (and
//! by its checksum) before any length in it is used, the map is sized from the checked disk
//! size and compared with the file's length before it is read, and every map entry is checked.

use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::disk::error::DiskError;

/// Bytes per block: the unit a layer stores and maps.
pub const BLOCK_SIZE: u64 = 4096;
/// [`BLOCK_SIZE`] as a length in memory.
pub const BLOCK_BYTES: usize = 4096;
/// Bytes of the header at the start of every layer file.
pub const HEADER_LEN: u64 = 4096;
/// [`HEADER_LEN`] as a length in memory.
const HEADER_BYTES: usize = 4096;
const _: () = assert!(BLOCK_BYTES as u64 == BLOCK_SIZE && HEADER_BYTES as u64 == HEADER_LEN);
/// The header's own record of the two, as the format stores them (u32).
const HEADER_LEN_FIELD: u32 = 4096;
const BLOCK_SIZE_FIELD: u32 = 4096;
const _: () =
    assert!(HEADER_LEN_FIELD as u64 == HEADER_LEN && BLOCK_SIZE_FIELD as u64 == BLOCK_SIZE);

/// A size in bytes of something this process holds in memory (a block map, part of a block):
/// bounded by MAX_DISK_SIZE's map or by a block, so it fits a usize (x86-64 only).
pub(crate) fn in_memory(bytes: u64) -> usize {
    usize::try_from(bytes).expect("a size bounded by the disk format fits in memory")
}
/// The first bytes of every layer file.
pub const MAGIC: [u8; 8] = *b"MAYFLYCW";
/// The format version this code writes and reads.
pub const VERSION: u32 = 1;
/// The largest disk a layer may describe (1 TiB): its map then takes 64 MiB of memory.
pub const MAX_DISK_SIZE: u64 = 1 << 40;
/// The longest base identity (a content hash string) a header holds.
pub const MAX_BASE_IDENTITY: usize = 256;

/// Header flag: the layer is frozen (read-only for good; other layers may be stacked on it).
const FLAG_FROZEN: u32 = 1;
const KNOWN_FLAGS: u32 = FLAG_FROZEN;

// Header field offsets.
const OFF_VERSION: usize = 8;
const OFF_HEADER_LEN: usize = 12;
const OFF_BLOCK_SIZE: usize = 16;
const OFF_FLAGS: usize = 20;
const OFF_DISK_SIZE: usize = 24;
const OFF_CREATED: usize = 32;
const OFF_ID: usize = 40;
const OFF_PARENT: usize = 56;
const OFF_MAP_OFFSET: usize = 72;
const OFF_MAP_LEN: usize = 80;
const OFF_DATA_OFFSET: usize = 88;
const OFF_BASE_LEN: usize = 96;
const OFF_BASE: usize = 98;
const OFF_CHECKSUM: usize = HEADER_BYTES - 8;

/// A layer's random 128-bit identity. A parent link names the layer below by it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LayerId(pub [u8; 16]);

impl LayerId {
    /// A new random ID (from the host's getrandom).
    pub fn random() -> std::io::Result<Self> {
        let mut bytes = [0u8; 16];
        let mut filled = 0;
        while filled < bytes.len() {
            // SAFETY: getrandom writes at most the given length into the rest of our buffer.
            let n = unsafe {
                libc::getrandom(bytes[filled..].as_mut_ptr().cast(), bytes.len() - filled, 0)
            };
            // Negative: the call failed.
            let Ok(n) = usize::try_from(n) else {
                let err = std::io::Error::last_os_error();
                if err.kind() == ErrorKind::Interrupted {
                    continue;
                }
                return Err(err);
            };
            filled += n;
        }
        Ok(Self(bytes))
    }

    fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }
}

impl std::fmt::Display for LayerId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl std::fmt::Debug for LayerId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LayerId({self})")
    }
}

/// What a layer file's header says about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerInfo {
    /// Where the file was found (or created).
    pub path: PathBuf,
    pub id: LayerId,
    /// The layer below; None: the layer sits directly on the base image.
    pub parent: Option<LayerId>,
    /// The base image's identity (a content hash string) the whole chain was built on.
    pub base_identity: String,
    /// The disk's size in bytes (the same in every layer of a chain).
    pub disk_size: u64,
    /// Frozen: never written again; layers may be stacked on it.
    pub frozen: bool,
    /// When the layer was created, in nanoseconds since the Unix epoch.
    pub created_unix_ns: u64,
}

impl LayerInfo {
    /// Read and check the header of the layer file at `path` (without locking it).
    pub fn read(path: &Path) -> Result<Self, DiskError> {
        let file = open_regular(path, false)?;
        let (info, _) = read_header(&file, path)?;
        Ok(info)
    }
}

/// Where the map and data area of a disk of `disk_size` bytes lie: (blocks, map bytes used,
/// map offset, map length rounded to whole blocks, data offset, the file's full length).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub blocks: u64,
    pub map_bytes: u64,
    pub map_offset: u64,
    pub map_len: u64,
    pub data_offset: u64,
    pub file_len: u64,
}

impl Geometry {
    /// The layout for `disk_size`, which must be checked against [`MAX_DISK_SIZE`] first (all
    /// arithmetic here is then far from overflowing; it is checked all the same).
    pub fn of(disk_size: u64) -> Option<Self> {
        let blocks = disk_size.div_ceil(BLOCK_SIZE);
        let map_bytes = blocks.div_ceil(4);
        let map_len = map_bytes.checked_next_multiple_of(BLOCK_SIZE)?;
        let map_offset = HEADER_LEN;
        let data_offset = map_offset.checked_add(map_len)?;
        let file_len = data_offset.checked_add(blocks.checked_mul(BLOCK_SIZE)?)?;
        Some(Self {
            blocks,
            map_bytes,
            map_offset,
            map_len,
            data_offset,
            file_len,
        })
    }
}

/// Check a disk size a caller or a header gives.
pub(crate) fn check_disk_size(size: u64) -> Result<Geometry, DiskError> {
    let reason = if size == 0 {
        "a disk needs at least one 512-byte sector"
    } else if !size.is_multiple_of(512) {
        "it is not a whole number of 512-byte sectors"
    } else if size > MAX_DISK_SIZE {
        "it is larger than the 1 TiB a layer can map"
    } else {
        return Geometry::of(size).ok_or(DiskError::BadDiskSize {
            size,
            reason: "its layout overflows",
        });
    };
    Err(DiskError::BadDiskSize { size, reason })
}

pub(crate) fn check_base_identity(identity: &str) -> Result<(), DiskError> {
    if identity.is_empty() {
        return Err(DiskError::BadBaseIdentity(
            "it is empty: give the base image's content hash",
        ));
    }
    if identity.len() > MAX_BASE_IDENTITY {
        return Err(DiskError::BadBaseIdentity(
            "it is longer than 256 bytes: give a content hash string",
        ));
    }
    Ok(())
}

/// FNV-1a, 64 bits: the header's checksum (it catches torn or edited headers, not attackers:
/// nothing in a header is trusted because of its checksum).
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

fn get_u32(buf: &[u8], at: usize) -> u32 {
    let mut bytes = [0u8; 4];
    bytes.copy_from_slice(&buf[at..at + 4]);
    u32::from_le_bytes(bytes)
}

fn get_u64(buf: &[u8], at: usize) -> u64 {
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&buf[at..at + 8]);
    u64::from_le_bytes(bytes)
}

fn get_id(buf: &[u8], at: usize) -> LayerId {
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&buf[at..at + 16]);
    LayerId(bytes)
}

pub(crate) fn now_unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// The header block of `info`.
fn encode_header(info: &LayerInfo, geo: &Geometry) -> Vec<u8> {
    let mut buf = vec![0u8; HEADER_BYTES];
    buf[..8].copy_from_slice(&MAGIC);
    buf[OFF_VERSION..OFF_VERSION + 4].copy_from_slice(&VERSION.to_le_bytes());
    buf[OFF_HEADER_LEN..OFF_HEADER_LEN + 4].copy_from_slice(&HEADER_LEN_FIELD.to_le_bytes());
    buf[OFF_BLOCK_SIZE..OFF_BLOCK_SIZE + 4].copy_from_slice(&BLOCK_SIZE_FIELD.to_le_bytes());
    let flags = if info.frozen { FLAG_FROZEN } else { 0 };
    buf[OFF_FLAGS..OFF_FLAGS + 4].copy_from_slice(&flags.to_le_bytes());
    buf[OFF_DISK_SIZE..OFF_DISK_SIZE + 8].copy_from_slice(&info.disk_size.to_le_bytes());
    buf[OFF_CREATED..OFF_CREATED + 8].copy_from_slice(&info.created_unix_ns.to_le_bytes());
    buf[OFF_ID..OFF_ID + 16].copy_from_slice(&info.id.0);
    if let Some(parent) = info.parent {
        buf[OFF_PARENT..OFF_PARENT + 16].copy_from_slice(&parent.0);
    }
    buf[OFF_MAP_OFFSET..OFF_MAP_OFFSET + 8].copy_from_slice(&geo.map_offset.to_le_bytes());
    buf[OFF_MAP_LEN..OFF_MAP_LEN + 8].copy_from_slice(&geo.map_len.to_le_bytes());
    buf[OFF_DATA_OFFSET..OFF_DATA_OFFSET + 8].copy_from_slice(&geo.data_offset.to_le_bytes());
    let base = info.base_identity.as_bytes();
    buf[OFF_BASE_LEN..OFF_BASE_LEN + 2].copy_from_slice(
        &u16::try_from(base.len())
            .expect("a base identity within MAX_BASE_IDENTITY")
            .to_le_bytes(),
    );
    buf[OFF_BASE..OFF_BASE + base.len()].copy_from_slice(base);
    let sum = fnv1a(&buf[..OFF_CHECKSUM]);
    buf[OFF_CHECKSUM..].copy_from_slice(&sum.to_le_bytes());
    buf
}

/// Open `path` as a regular file (a directory, device or socket is refused).
pub(crate) fn open_regular(path: &Path, writable: bool) -> Result<File, DiskError> {
    // O_NONBLOCK: a FIFO (or a device) named as a disk must not block the open; it is refused
    // below. On a regular file the flag changes nothing.
    let file = OpenOptions::new()
        .read(true)
        .write(writable)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|source| {
            // Opening a directory for writing fails with EISDIR: the clearer error is ours.
            if source.raw_os_error() == Some(libc::EISDIR) {
                DiskError::NotAFile {
                    path: path.to_path_buf(),
                }
            } else {
                DiskError::Open {
                    path: path.to_path_buf(),
                    source,
                }
            }
        })?;
    // fstat on the opened file, so the check and the use are of the same file.
    let meta = file.metadata().map_err(|source| DiskError::Open {
        path: path.to_path_buf(),
        source,
    })?;
    if !meta.is_file() {
        return Err(DiskError::NotAFile {
            path: path.to_path_buf(),
        });
    }
    Ok(file)
}

/// Take an advisory lock (shared for readers, exclusive for the one writer) without waiting.
pub(crate) fn lock(file: &File, path: &Path, exclusive: bool) -> Result<(), DiskError> {
    let op = if exclusive {
        libc::LOCK_EX
    } else {
        libc::LOCK_SH
    } | libc::LOCK_NB;
    loop {
        // SAFETY: flock on a descriptor we own; no memory is involved.
        let rc = unsafe { libc::flock(file.as_raw_fd(), op) };
        if rc == 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EWOULDBLOCK) => {
                return Err(DiskError::InUse {
                    path: path.to_path_buf(),
                })
            }
            _ => {
                return Err(DiskError::Io {
                    path: path.to_path_buf(),
                    op: "lock",
                    source: err,
                })
            }
        }
    }
}

/// Read `buf.len()` bytes at `offset`; Ok(false) when the file ends first.
fn read_exact_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<bool> {
    match file.read_exact_at(buf, offset) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(e),
    }
}

/// Read and check a layer header; returns it and the layout it implies.
fn read_header(file: &File, path: &Path) -> Result<(LayerInfo, Geometry), DiskError> {
    let io = |op, source| DiskError::Io {
        path: path.to_path_buf(),
        op,
        source,
    };
    let len = file.metadata().map_err(|e| io("stat", e))?.len();
    let mut magic = [0u8; 8];
    if !read_exact_at(file, &mut magic, 0).map_err(|e| io("read the header of", e))?
        || magic != MAGIC
    {
        return Err(DiskError::NotALayer {
            path: path.to_path_buf(),
        });
    }
    let mut buf = vec![0u8; HEADER_BYTES];
    if !read_exact_at(file, &mut buf, 0).map_err(|e| io("read the header of", e))? {
        return Err(DiskError::Truncated {
            path: path.to_path_buf(),
            expected: HEADER_LEN,
            found: len,
        });
    }
    let corrupt = |reason: String| DiskError::Corrupt {
        path: path.to_path_buf(),
        reason,
    };
    let version = get_u32(&buf, OFF_VERSION);
    if version != VERSION {
        return Err(DiskError::UnsupportedVersion {
            path: path.to_path_buf(),
            version,
        });
    }
    if fnv1a(&buf[..OFF_CHECKSUM]) != get_u64(&buf, OFF_CHECKSUM) {
        return Err(corrupt("its header checksum does not match".into()));
    }
    if u64::from(get_u32(&buf, OFF_HEADER_LEN)) != HEADER_LEN
        || u64::from(get_u32(&buf, OFF_BLOCK_SIZE)) != BLOCK_SIZE
    {
        return Err(corrupt("its header or block size is not 4096 bytes".into()));
    }
    let flags = get_u32(&buf, OFF_FLAGS);
    if flags & !KNOWN_FLAGS != 0 {
        return Err(corrupt(format!("unknown header flags {flags:#x}")));
    }
    let disk_size = get_u64(&buf, OFF_DISK_SIZE);
    let geo = check_disk_size(disk_size)
        .map_err(|e| corrupt(format!("its disk size is unusable: {e}")))?;
    if get_u64(&buf, OFF_MAP_OFFSET) != geo.map_offset
        || get_u64(&buf, OFF_MAP_LEN) != geo.map_len
        || get_u64(&buf, OFF_DATA_OFFSET) != geo.data_offset
    {
        return Err(corrupt(
            "its map or data offsets do not match its disk size".into(),
        ));
    }
    let id = get_id(&buf, OFF_ID);
    if id.is_zero() {
        return Err(corrupt("its layer ID is zero".into()));
    }
    let parent = get_id(&buf, OFF_PARENT);
    let parent = (!parent.is_zero()).then_some(parent);
    let base_len = usize::from(u16::from_le_bytes([
        buf[OFF_BASE_LEN],
        buf[OFF_BASE_LEN + 1],
    ]));
    if base_len == 0 || base_len > MAX_BASE_IDENTITY {
        return Err(corrupt(format!("a base identity of {base_len} bytes")));
    }
    let base_identity = std::str::from_utf8(&buf[OFF_BASE..OFF_BASE + base_len])
        .map_err(|_| corrupt("its base identity is not UTF-8".into()))?
        .to_string();
    if len < geo.file_len {
        return Err(DiskError::Truncated {
            path: path.to_path_buf(),
            expected: geo.file_len,
            found: len,
        });
    }
    let info = LayerInfo {
        path: path.to_path_buf(),
        id,
        parent,
        base_identity,
        disk_size,
        frozen: flags & FLAG_FROZEN != 0,
        created_unix_ns: get_u64(&buf, OFF_CREATED),
    };
    Ok((info, geo))
}

/// What a layer says about one block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum BlockState {
    /// Not in this layer: look below.
    Absent = 0,
    /// Its data is in this layer's data area.
    Data = 1,
    /// Reads as zeros (whatever the layers below hold); no data stored.
    Zero = 2,
}

/// A layer's block map: 2 bits per block, 4 blocks per byte (block N in bits 2*(N%4)..),
/// and which of its 4 KiB pages changed since they were last written to the file.
pub(crate) struct BlockMap {
    bits: Vec<u8>,
    blocks: u64,
    dirty: Vec<u64>,
    /// Blocks not Absent (an empty layer has none).
    used: u64,
}

impl BlockMap {
    fn new(geo: &Geometry) -> Self {
        let pages = in_memory(geo.map_bytes.div_ceil(BLOCK_SIZE));
        Self {
            bits: vec![0; in_memory(geo.map_bytes)],
            blocks: geo.blocks,
            dirty: vec![0; pages.div_ceil(64)],
            used: 0,
        }
    }

    #[inline]
    pub fn get(&self, block: u64) -> BlockState {
        let byte = self.bits[(block / 4) as usize];
        match (byte >> ((block % 4) * 2)) & 3 {
            1 => BlockState::Data,
            2 => BlockState::Zero,
            // 3 never passes the check at open, and set() never stores it.
            _ => BlockState::Absent,
        }
    }

    #[inline]
    pub fn set(&mut self, block: u64, state: BlockState) {
        let old = self.get(block);
        if old == state {
            return;
        }
        let index = (block / 4) as usize;
        let shift = (block % 4) * 2;
        self.bits[index] = (self.bits[index] & !(3 << shift)) | ((state as u8) << shift);
        let page = index / BLOCK_BYTES;
        self.dirty[page / 64] |= 1 << (page % 64);
        match (old, state) {
            (BlockState::Absent, _) => self.used += 1,
            (_, BlockState::Absent) => self.used -= 1,
            _ => {}
        }
    }

    pub fn used(&self) -> u64 {
        self.used
    }

    fn is_dirty(&self) -> bool {
        self.dirty.iter().any(|&w| w != 0)
    }

    /// Check what was read from a file and count the blocks in use. Eight map bytes (32
    /// blocks) at a time: a clone opens its whole chain's maps, so this is on the fork path.
    fn check(&mut self) -> Result<(), String> {
        const LOW: u64 = 0x5555_5555_5555_5555;
        let mut used = 0u64;
        let mut chunks = self.bits.chunks_exact(8);
        let mut first_block = 0u64;
        for chunk in &mut chunks {
            let word = u64::from_le_bytes(chunk.try_into().expect("chunks of 8"));
            if word != 0 {
                // A 2-bit entry of 3 has both bits set.
                let invalid = word & (word >> 1) & LOW;
                if invalid != 0 {
                    let block = first_block + u64::from(invalid.trailing_zeros() / 2);
                    return Err(format!("block {block} has an invalid map entry"));
                }
                used += u64::from(((word | (word >> 1)) & LOW).count_ones());
            }
            first_block += 32;
        }
        for (i, &byte) in chunks.remainder().iter().enumerate() {
            for slot in 0..4u64 {
                let value = (byte >> (slot * 2)) & 3;
                if value == 3 {
                    let block = first_block + i as u64 * 4 + slot;
                    return Err(format!("block {block} has an invalid map entry"));
                }
                used += u64::from(value != 0);
            }
        }
        // The map's last byte may hold entries past the disk's end: they must be empty.
        let slots = self.bits.len() as u64 * 4;
        if (self.blocks..slots).any(|block| self.get(block) != BlockState::Absent) {
            return Err(format!(
                "map entries past the disk's {} blocks",
                self.blocks
            ));
        }
        self.used = used;
        Ok(())
    }
}

/// An open layer file.
pub(crate) struct Layer {
    pub file: File,
    pub info: LayerInfo,
    pub geo: Geometry,
    pub map: BlockMap,
    /// Only the top layer of a writable disk.
    pub writable: bool,
    /// Data or metadata was written since the last fdatasync.
    unsynced: bool,
    /// The directory entry is known durable (the file was opened, not just created).
    dir_synced: bool,
}

impl Layer {
    /// Open and check an existing layer; `writable` opens it for writing and locks it
    /// exclusively (readers take a shared lock).
    pub fn open(path: &Path, writable: bool) -> Result<Self, DiskError> {
        let file = open_regular(path, writable)?;
        lock(&file, path, writable)?;
        let (info, geo) = read_header(&file, path)?;
        let mut map = BlockMap::new(&geo);
        if !read_exact_at(&file, &mut map.bits, geo.map_offset).map_err(|source| DiskError::Io {
            path: path.to_path_buf(),
            op: "read the block map of",
            source,
        })? {
            return Err(DiskError::Truncated {
                path: path.to_path_buf(),
                expected: geo.file_len,
                found: file.metadata().map(|m| m.len()).unwrap_or(0),
            });
        }
        map.check().map_err(|reason| DiskError::Corrupt {
            path: path.to_path_buf(),
            reason,
        })?;
        Ok(Self {
            file,
            info,
            geo,
            map,
            writable,
            unsynced: false,
            dir_synced: true,
        })
    }

    /// Create a new, empty layer file (never over an existing one). With `header_last`, the
    /// header is left zero (the file is not a layer yet) until [`Layer::finish`].
    pub fn create(
        path: &Path,
        parent: Option<LayerId>,
        base_identity: &str,
        disk_size: u64,
        id: Option<LayerId>,
        header_last: bool,
    ) -> Result<Self, DiskError> {
        check_base_identity(base_identity)?;
        let geo = check_disk_size(disk_size)?;
        let id = match id {
            Some(id) => id,
            None => LayerId::random().map_err(|source| DiskError::Io {
                path: path.to_path_buf(),
                op: "make an ID for",
                source,
            })?,
        };
        let info = LayerInfo {
            path: path.to_path_buf(),
            id,
            parent,
            base_identity: base_identity.to_string(),
            disk_size,
            frozen: false,
            created_unix_ns: now_unix_ns(),
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(|source| DiskError::Create {
                path: path.to_path_buf(),
                source,
            })?;
        let layer = (|| {
            lock(&file, path, true)?;
            let io = |op, source| DiskError::Io {
                path: path.to_path_buf(),
                op,
                source,
            };
            // Sparse: the map reads as zeros (all Absent) and the data area is one hole.
            file.set_len(geo.file_len).map_err(|e| io("size", e))?;
            if !header_last {
                file.write_all_at(&encode_header(&info, &geo), 0)
                    .map_err(|e| io("write the header of", e))?;
            }
            Ok(Self {
                map: BlockMap::new(&geo),
                file,
                info,
                geo,
                writable: true,
                unsynced: true,
                dir_synced: false,
            })
        })();
        if layer.is_err() {
            let _ = std::fs::remove_file(path);
        }
        layer
    }

    pub fn path(&self) -> &Path {
        &self.info.path
    }

    pub fn io_error(&self, op: &'static str, source: std::io::Error) -> DiskError {
        DiskError::Io {
            path: self.info.path.clone(),
            op,
            source,
        }
    }

    /// Where block `block`'s data lies in the file.
    #[inline]
    pub fn data_pos(&self, disk_offset: u64) -> u64 {
        self.geo.data_offset + disk_offset
    }

    pub fn mark_written(&mut self) {
        self.unsynced = true;
    }

    fn sync(&self) -> Result<(), DiskError> {
        self.file
            .sync_data()
            .map_err(|e| self.io_error("fdatasync", e))
    }

    /// Write the changed pages of the map to the file.
    fn write_map(&mut self) -> Result<(), DiskError> {
        let pages = in_memory(self.geo.map_bytes.div_ceil(BLOCK_SIZE));
        let mut page = 0;
        while page < pages {
            if self.map.dirty[page / 64] & (1 << (page % 64)) == 0 {
                page += 1;
                continue;
            }
            // Coalesce a run of dirty pages into one write.
            let first = page;
            while page < pages && self.map.dirty[page / 64] & (1 << (page % 64)) != 0 {
                self.map.dirty[page / 64] &= !(1 << (page % 64));
                page += 1;
            }
            let start = first * BLOCK_BYTES;
            let end = (page * BLOCK_BYTES).min(self.map.bits.len());
            self.file
                .write_all_at(
                    &self.map.bits[start..end],
                    self.geo.map_offset + start as u64,
                )
                .map_err(|e| self.io_error("write the block map of", e))?;
            self.unsynced = true;
        }
        Ok(())
    }

    fn sync_dir(&mut self) -> Result<(), DiskError> {
        if self.dir_synced {
            return Ok(());
        }
        let dir = match self.info.path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        File::open(&dir)
            .and_then(|d| d.sync_all())
            .map_err(|source| DiskError::Io {
                path: dir,
                op: "fsync the directory",
                source,
            })?;
        self.dir_synced = true;
        Ok(())
    }

    /// Make everything written so far durable: data first, then the map that points at it.
    /// With `freeze`, the header is rewritten with the frozen flag in the same step.
    pub fn flush(&mut self, freeze: bool) -> Result<(), DiskError> {
        let map_dirty = self.map.is_dirty();
        if !self.unsynced && !map_dirty && !freeze && self.dir_synced {
            return Ok(());
        }
        // 1. The data blocks (and any earlier header write) reach the disk...
        if self.unsynced && map_dirty {
            self.sync()?;
        }
        // 2. ...before the map says they are present.
        self.write_map()?;
        if freeze {
            let mut info = self.info.clone();
            info.frozen = true;
            self.file
                .write_all_at(&encode_header(&info, &self.geo), 0)
                .map_err(|e| self.io_error("write the header of", e))?;
            self.info.frozen = true;
            self.unsynced = true;
        }
        if self.unsynced {
            self.sync()?;
            self.unsynced = false;
        }
        self.sync_dir()
    }

    /// The header of a layer created with `header_last`, written once everything else is
    /// durable: only then does the file become a layer.
    pub fn finish(&mut self, frozen: bool) -> Result<(), DiskError> {
        self.write_map()?;
        self.sync()?;
        self.info.frozen = frozen;
        self.file
            .write_all_at(&encode_header(&self.info, &self.geo), 0)
            .map_err(|e| self.io_error("write the header of", e))?;
        self.sync()?;
        self.unsynced = false;
        self.sync_dir()
    }

    /// From now on only read (after a freeze): the exclusive lock becomes a shared one.
    pub fn make_read_only(&mut self) {
        self.writable = false;
        // Downgrading cannot conflict (we hold the exclusive lock); a failure only leaves the
        // lock exclusive, which is stricter.
        let _ = lock(&self.file, &self.info.path, false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_of_small_and_large_disks() {
        let g = Geometry::of(4096).unwrap();
        assert_eq!((g.blocks, g.map_bytes, g.map_len), (1, 1, 4096));
        assert_eq!(g.data_offset, 8192);
        assert_eq!(g.file_len, 8192 + 4096);
        let g = Geometry::of(1 << 30).unwrap();
        assert_eq!(g.blocks, 262_144);
        assert_eq!(g.map_bytes, 65_536);
        assert_eq!(g.data_offset, 4096 + 65_536);
        // A disk of 512 bytes still takes a whole block.
        assert_eq!(Geometry::of(512).unwrap().blocks, 1);
    }

    #[test]
    fn map_entries_round_trip_and_count() {
        let mut map = BlockMap::new(&Geometry::of(1 << 20).unwrap());
        assert_eq!(map.get(5), BlockState::Absent);
        map.set(5, BlockState::Data);
        map.set(6, BlockState::Zero);
        map.set(5, BlockState::Data);
        assert_eq!(map.get(5), BlockState::Data);
        assert_eq!(map.get(6), BlockState::Zero);
        assert_eq!(map.get(4), BlockState::Absent);
        assert_eq!(map.used(), 2);
        map.set(6, BlockState::Absent);
        assert_eq!(map.used(), 1);
        assert!(map.is_dirty());
        map.bits[0] = 0b11;
        assert!(map.check().is_err(), "3 is no state");
    }

    #[test]
    fn header_round_trips() {
        let info = LayerInfo {
            path: PathBuf::from("x"),
            id: LayerId([7; 16]),
            parent: Some(LayerId([9; 16])),
            base_identity: "sha256:abc".into(),
            disk_size: 1 << 20,
            frozen: true,
            created_unix_ns: 42,
        };
        let geo = Geometry::of(info.disk_size).unwrap();
        let buf = encode_header(&info, &geo);
        assert_eq!(&buf[..8], &MAGIC);
        assert_eq!(fnv1a(&buf[..OFF_CHECKSUM]), get_u64(&buf, OFF_CHECKSUM));
        assert_eq!(get_id(&buf, OFF_PARENT), LayerId([9; 16]));
    }
}
