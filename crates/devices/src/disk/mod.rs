//! The layered copy-on-write disk behind virtio-blk.
//!
//! A VM's disk is a read-only **base** image (a raw file, the template root filesystem, shared
//! by every VM and never written) under a stack of copy-on-write **layers**, bottom to top.
//! Only the top layer is ever written. A read of a block takes it from the highest layer that
//! has it, else from the base (bytes past the base's end read as zeros).
//!
//! - **Freeze** ([`Disk::freeze`], what a snapshot does): the top layer is flushed and marked
//!   frozen, and a new empty layer stacked on it becomes the top. Metadata only: the time does
//!   not depend on how much data the layer holds.
//! - **Fork** ([`create_layer`]): each clone gets a new empty layer on the same frozen chain.
//! - **Compaction** ([`compact`], [`Disk::compact_frozen`]): a run of frozen layers merged
//!   into one, for chains that grew long ([`COMPACT_THRESHOLD`]).
//!
//! # Layer file format (version 1)
//!
//! All integers little-endian. A layer file is laid out in 4 KiB blocks:
//!
//! ```text
//! offset 0     header (4096 bytes)
//!   0   8  magic "MAYFLYCW"          8   4  version = 1
//!   12  4  header length = 4096      16  4  block size = 4096
//!   20  4  flags (bit 0: frozen)     24  8  disk size in bytes (a multiple of 512, <= 1 TiB)
//!   32  8  creation time (ns since the Unix epoch)
//!   40 16  layer ID (random)         56 16  parent layer ID (zero: directly on the base)
//!   72  8  map offset = 4096         80  8  map length (whole blocks)
//!   88  8  data offset = 4096 + map length
//!   96  2  base identity length (1..=256)   98 ..  base identity (UTF-8, the base's hash)
//!   4088 8 FNV-1a 64 checksum of bytes 0..4088
//! offset 4096  block map: 2 bits per disk block, block N in byte N/4, bits 2*(N%4)..:
//!              0 = absent (look below), 1 = data here, 2 = zeros (nothing stored)
//! data offset  data area: block N at data offset + N * 4096 (sparse: unwritten blocks are
//!              holes); the file is exactly data offset + blocks * 4096 bytes long
//! ```
//!
//! Crash safety: a block's data is written in place, and the map that says it is present is
//! written only by [`Disk::flush`], after an fdatasync of the data, then synced itself (and
//! the directory, once, for a new file). A crash loses at most what was written since the
//! last flush; a map never points at data that did not reach the disk. A layer made by
//! compaction gets its header last, so a half-made one is not a layer at all.
//!
//! Everything in a layer file is untrusted: a short, foreign, edited or mismatched file is a
//! typed [`DiskError`], never a panic, and no length from a file is used before it has been
//! checked against the file's size. Open layers are locked with `flock`: the writable top
//! exclusively, the others shared, so two VMMs never write one layer and nobody stacks a layer
//! on a layer that is still being written.

mod error;
mod io;
mod layer;

use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use error::DiskError;
pub use io::IoVecs;
use io::{gather, preadv_full, punch_hole, pwritev_full, zero, Cursor};
use layer::{check_base_identity, check_disk_size, in_memory, open_regular, BlockState, Layer};
pub use layer::{LayerId, LayerInfo, BLOCK_BYTES, BLOCK_SIZE, MAX_BASE_IDENTITY, MAX_DISK_SIZE};

/// A chain longer than this is better compacted ([`Disk::needs_compaction`]).
pub const COMPACT_THRESHOLD: usize = 8;
/// The most layers a disk may have open at once.
pub const MAX_LAYERS: usize = 128;

static ZEROS: [u8; BLOCK_BYTES] = [0; BLOCK_BYTES];

/// The files of a disk: the base image and the layers on it, bottom to top.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Chain {
    pub base: PathBuf,
    /// The base image's identity (its content hash); every layer records it.
    pub base_identity: String,
    pub layers: Vec<PathBuf>,
}

/// What a disk's content is, by the IDs of its layers, as a snapshot records it. The ID of a
/// layer stands for the content of the chain up to it (IDs are random and parent links are
/// checked at open), so two disks with the same base and the same topmost ID read the same.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskIdentity {
    pub base_identity: String,
    pub disk_size: u64,
    /// Layer IDs bottom to top, leaving out a writable top that holds nothing yet (so a disk
    /// right after a freeze, and a clone on the frozen chain, have the same identity).
    pub layers: Vec<LayerId>,
}

impl DiskIdentity {
    /// Whether `other` reads as this disk (same base, size and topmost layer: layers merged
    /// by compaction keep the ID of the top of their run, so they still match).
    pub fn same_content(&self, other: &DiskIdentity) -> bool {
        self.base_identity == other.base_identity
            && self.disk_size == other.disk_size
            && self.layers.last() == other.layers.last()
    }
}

/// Create an empty layer on the frozen layer `parent` (what a fork gives each clone): a header
/// and a sparse file, nothing copied. The file must not exist yet.
pub fn create_layer(path: &Path, parent: &LayerInfo) -> Result<LayerInfo, DiskError> {
    if !parent.frozen {
        return Err(DiskError::NotFrozen {
            path: parent.path.clone(),
        });
    }
    let layer = Layer::create(
        path,
        Some(parent.id),
        &parent.base_identity,
        parent.disk_size,
        None,
        false,
    )?;
    Ok(layer.info.clone())
}

/// Create the first layer on a base image: a disk of `disk_size` bytes (at least the base's
/// size; None: the base's size rounded up to whole sectors).
pub fn create_base_layer(
    path: &Path,
    base: &Path,
    base_identity: &str,
    disk_size: Option<u64>,
) -> Result<LayerInfo, DiskError> {
    let base_size = base_len(base)?;
    let disk_size = disk_size.unwrap_or(base_size.next_multiple_of(512));
    check_disk_size(disk_size)?;
    if disk_size < base_size {
        return Err(DiskError::DiskTooSmall {
            disk_size,
            base_size,
        });
    }
    let layer = Layer::create(path, None, base_identity, disk_size, None, false)?;
    Ok(layer.info.clone())
}

fn base_len(base: &Path) -> Result<u64, DiskError> {
    let file = open_regular(base, false)?;
    file.metadata()
        .map(|m| m.len())
        .map_err(|source| DiskError::Io {
            path: base.to_path_buf(),
            op: "stat",
            source,
        })
}

/// Where a block's bytes come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    Layer(usize),
    Zero,
    Base,
}

/// The topmost layer of `layers` that says something about `block`.
fn source_in(layers: &[Layer], block: u64) -> Source {
    for (i, layer) in layers.iter().enumerate().rev() {
        match layer.map.get(block) {
            BlockState::Data => return Source::Layer(i),
            BlockState::Zero => return Source::Zero,
            BlockState::Absent => {}
        }
    }
    Source::Base
}

/// What compaction produced.
#[derive(Debug)]
pub struct Compacted {
    /// The new layer (frozen, with the ID of the top of the run it replaces).
    pub layer: LayerInfo,
    /// The files it replaces in this disk (other disks may still use them).
    pub replaced: Vec<PathBuf>,
}

/// A disk: a base image and its layers, open.
pub struct Disk {
    base: File,
    base_path: PathBuf,
    base_size: u64,
    base_identity: String,
    disk_size: u64,
    /// Bottom to top.
    layers: Vec<Layer>,
    read_only: bool,
    /// One block, for read-modify-write of partial blocks.
    scratch: Vec<u8>,
    /// The part of a request one piece of I/O covers.
    sub: IoVecs,
    /// Another, for the read inside a read-modify-write.
    spare: IoVecs,
}

impl Disk {
    /// Open `chain`: the base read-only, every layer checked against the one below (parent
    /// IDs, base identity, disk size, frozen), the top writable unless `read_only`.
    pub fn open(chain: &Chain, read_only: bool) -> Result<Self, DiskError> {
        check_base_identity(&chain.base_identity)?;
        if chain.layers.len() > MAX_LAYERS {
            return Err(DiskError::TooManyLayers {
                count: chain.layers.len(),
                max: MAX_LAYERS,
            });
        }
        if chain.layers.is_empty() && !read_only {
            return Err(DiskError::NoLayers);
        }
        let base = open_regular(&chain.base, false)?;
        layer::lock(&base, &chain.base, false)?;
        let base_size = base
            .metadata()
            .map_err(|source| DiskError::Io {
                path: chain.base.clone(),
                op: "stat",
                source,
            })?
            .len();
        let mut layers: Vec<Layer> = Vec::with_capacity(chain.layers.len() + 1);
        for (i, path) in chain.layers.iter().enumerate() {
            let top = i + 1 == chain.layers.len();
            let layer = Layer::open(path, top && !read_only)?;
            let info = &layer.info;
            if info.base_identity != chain.base_identity {
                return Err(DiskError::WrongBase {
                    path: path.clone(),
                    expected: chain.base_identity.clone(),
                    found: info.base_identity.clone(),
                });
            }
            let below = layers.last().map(|l| l.info.id);
            if info.parent != below {
                let name = |id: Option<LayerId>| match id {
                    None => "the base image".to_string(),
                    Some(id) => format!("layer {id}"),
                };
                return Err(DiskError::WrongParent {
                    path: path.clone(),
                    expected: name(below),
                    found: name(info.parent),
                });
            }
            if let Some(first) = layers.first() {
                if info.disk_size != first.info.disk_size {
                    return Err(DiskError::SizeMismatch {
                        path: path.clone(),
                        expected: first.info.disk_size,
                        found: info.disk_size,
                    });
                }
            }
            if !top && !info.frozen {
                return Err(DiskError::NotFrozen { path: path.clone() });
            }
            if top && !read_only && info.frozen {
                return Err(DiskError::TopFrozen { path: path.clone() });
            }
            layers.push(layer);
        }
        let disk_size = match layers.first() {
            Some(l) => l.info.disk_size,
            None => {
                let size = base_size.next_multiple_of(512);
                check_disk_size(size)?;
                size
            }
        };
        if disk_size < base_size {
            return Err(DiskError::DiskTooSmall {
                disk_size,
                base_size,
            });
        }
        Ok(Self {
            base,
            base_path: chain.base.clone(),
            base_size,
            base_identity: chain.base_identity.clone(),
            disk_size,
            layers,
            read_only,
            scratch: vec![0; BLOCK_BYTES],
            sub: IoVecs::with_capacity(64),
            spare: IoVecs::with_capacity(64),
        })
    }

    /// A new disk on `base`: a new layer at `top` (which must not exist) opened writable.
    pub fn create(
        base: &Path,
        base_identity: &str,
        top: &Path,
        disk_size: Option<u64>,
    ) -> Result<Self, DiskError> {
        create_base_layer(top, base, base_identity, disk_size)?;
        Self::open(
            &Chain {
                base: base.to_path_buf(),
                base_identity: base_identity.to_string(),
                layers: vec![top.to_path_buf()],
            },
            false,
        )
    }

    /// The disk's size in bytes.
    pub fn size(&self) -> u64 {
        self.disk_size
    }

    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// The files the disk is made of now.
    pub fn chain(&self) -> Chain {
        Chain {
            base: self.base_path.clone(),
            base_identity: self.base_identity.clone(),
            layers: self.layers.iter().map(|l| l.path().to_path_buf()).collect(),
        }
    }

    /// The files a snapshot or fork records: the chain without a writable top that holds
    /// nothing yet (after [`Disk::freeze`], the frozen chain a restore stacks its own top on).
    /// A top with data stays in: a restore then refuses it as not frozen, rather than lose it.
    pub fn saved_chain(&self) -> Chain {
        let mut chain = self.chain();
        if self
            .layers
            .last()
            .is_some_and(|top| top.writable && top.map.used() == 0)
        {
            chain.layers.pop();
        }
        chain
    }

    /// The layers' headers, bottom to top.
    pub fn layers(&self) -> Vec<LayerInfo> {
        self.layers.iter().map(|l| l.info.clone()).collect()
    }

    /// What the disk's content is (see [`DiskIdentity`]).
    pub fn identity(&self) -> DiskIdentity {
        let mut layers: Vec<LayerId> = self.layers.iter().map(|l| l.info.id).collect();
        if let Some(top) = self.layers.last() {
            if top.writable && top.map.used() == 0 {
                layers.pop();
            }
        }
        DiskIdentity {
            base_identity: self.base_identity.clone(),
            disk_size: self.disk_size,
            layers,
        }
    }

    /// Whether the chain has grown past [`COMPACT_THRESHOLD`] layers.
    pub fn needs_compaction(&self) -> bool {
        self.layers.len() > COMPACT_THRESHOLD
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<u64, DiskError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.disk_size => Ok(end),
            _ => Err(DiskError::OutOfRange {
                offset,
                len,
                size: self.disk_size,
            }),
        }
    }

    fn writable_top(&self) -> Result<usize, DiskError> {
        match self.layers.last() {
            Some(top) if !self.read_only && top.writable => Ok(self.layers.len() - 1),
            _ => Err(DiskError::ReadOnly),
        }
    }

    /// Read `buf.len()` bytes at `offset`.
    pub fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), DiskError> {
        let iov = [libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        }];
        // SAFETY: the one buffer is `buf`, writable for its length, borrowed for the call.
        unsafe { self.read_iov(offset, &iov) }
    }

    /// Write `data` at `offset` (into the top layer).
    pub fn write(&mut self, offset: u64, data: &[u8]) -> Result<(), DiskError> {
        let iov = [libc::iovec {
            iov_base: data.as_ptr().cast_mut().cast(),
            iov_len: data.len(),
        }];
        // SAFETY: the one buffer is `data`, readable for its length, borrowed for the call;
        // a write only reads its buffers.
        unsafe { self.write_iov(offset, &iov) }
    }

    /// Read into the buffers of `bufs` (in order, together their total length) at `offset`.
    ///
    /// # Safety
    /// Every buffer must be valid for writes of its length for the whole call (guest memory
    /// that stays mapped, for instance), and no Rust reference may be in use to it meanwhile.
    pub unsafe fn read_vectored(&mut self, offset: u64, bufs: &IoVecs) -> Result<(), DiskError> {
        // SAFETY: passed on from the caller.
        unsafe { self.read_iov(offset, bufs.as_slice()) }
    }

    /// Write the buffers of `bufs` (in order) at `offset`.
    ///
    /// # Safety
    /// Every buffer must be valid for reads of its length for the whole call.
    pub unsafe fn write_vectored(&mut self, offset: u64, bufs: &IoVecs) -> Result<(), DiskError> {
        // SAFETY: passed on from the caller.
        unsafe { self.write_iov(offset, bufs.as_slice()) }
    }

    /// # Safety
    /// See [`Disk::read_vectored`].
    unsafe fn read_iov(&mut self, offset: u64, iov: &[libc::iovec]) -> Result<(), DiskError> {
        let len = io::total(iov).unwrap_or(u64::MAX);
        let end = self.check_range(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let mut cursor = Cursor::new(iov);
        let last = (end - 1) / BLOCK_SIZE;
        let mut block = offset / BLOCK_SIZE;
        while block <= last {
            let source = source_in(&self.layers, block);
            let mut run_end = block + 1;
            while run_end <= last && source_in(&self.layers, run_end) == source {
                run_end += 1;
            }
            let from = offset.max(block * BLOCK_SIZE);
            let to = end.min(run_end * BLOCK_SIZE);
            self.sub.clear();
            cursor.take(to - from, &mut self.sub);
            match source {
                // SAFETY: the pieces of the caller's buffers, writable (caller).
                Source::Zero => unsafe { zero(self.sub.as_slice()) },
                Source::Layer(i) => {
                    let layer = &self.layers[i];
                    // SAFETY: as above.
                    let done = unsafe {
                        preadv_full(&layer.file, layer.data_pos(from), self.sub.as_mut_slice())
                    }
                    .map_err(|e| layer.io_error("read", e))?;
                    if done < self.sub.len() {
                        // The file was sized to hold every block: someone cut it meanwhile.
                        return Err(layer.io_error(
                            "read",
                            std::io::Error::new(
                                std::io::ErrorKind::UnexpectedEof,
                                "the layer file shrank while open",
                            ),
                        ));
                    }
                }
                Source::Base => {
                    // Past the base's end (or if it shrank) the rest is zeros.
                    let done = if from < self.base_size {
                        // SAFETY: as above.
                        unsafe { preadv_full(&self.base, from, self.sub.as_mut_slice()) }.map_err(
                            |source| DiskError::Io {
                                path: self.base_path.clone(),
                                op: "read",
                                source,
                            },
                        )?
                    } else {
                        0
                    };
                    // SAFETY: what is left of the caller's buffers, writable.
                    unsafe { zero(&self.sub.as_slice()[done..]) };
                }
            }
            block = run_end;
        }
        Ok(())
    }

    /// # Safety
    /// See [`Disk::write_vectored`].
    unsafe fn write_iov(&mut self, offset: u64, iov: &[libc::iovec]) -> Result<(), DiskError> {
        let top = self.writable_top()?;
        let len = io::total(iov).unwrap_or(u64::MAX);
        let end = self.check_range(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let mut cursor = Cursor::new(iov);
        let first = offset / BLOCK_SIZE;
        let mut pos = offset;
        // A partial first block.
        if !offset.is_multiple_of(BLOCK_SIZE) || end < (first + 1) * BLOCK_SIZE {
            let to = end.min((first + 1) * BLOCK_SIZE);
            // SAFETY: the caller's buffers are readable.
            unsafe { self.write_partial(top, first, pos, to, &mut cursor)? };
            pos = to;
        }
        if pos < end {
            // Whole blocks straight into the top layer's data area (in one vectored write:
            // block N is at a fixed place, so consecutive blocks are consecutive in the file).
            let whole_end = end - end % BLOCK_SIZE;
            if whole_end > pos {
                self.sub.clear();
                cursor.take(whole_end - pos, &mut self.sub);
                let layer = &mut self.layers[top];
                // SAFETY: pieces of the caller's buffers, readable.
                unsafe { pwritev_full(&layer.file, layer.data_pos(pos), self.sub.as_mut_slice()) }
                    .map_err(|e| layer.io_error("write", e))?;
                layer.mark_written();
                for block in pos / BLOCK_SIZE..whole_end / BLOCK_SIZE {
                    layer.map.set(block, BlockState::Data);
                }
                pos = whole_end;
            }
            if pos < end {
                // SAFETY: as above.
                unsafe { self.write_partial(top, pos / BLOCK_SIZE, pos, end, &mut cursor)? };
            }
        }
        Ok(())
    }

    /// Write `[from, to)` (inside `block`) from the next bytes of `cursor`. A block the top
    /// already holds is written in place; any other is read through the chain first, merged
    /// and written whole.
    ///
    /// # Safety
    /// The cursor's buffers must be readable for their lengths.
    unsafe fn write_partial(
        &mut self,
        top: usize,
        block: u64,
        from: u64,
        to: u64,
        cursor: &mut Cursor<'_>,
    ) -> Result<(), DiskError> {
        self.sub.clear();
        cursor.take(to - from, &mut self.sub);
        if self.layers[top].map.get(block) == BlockState::Data {
            let layer = &mut self.layers[top];
            // SAFETY: pieces of the caller's buffers, readable.
            unsafe { pwritev_full(&layer.file, layer.data_pos(from), self.sub.as_mut_slice()) }
                .map_err(|e| layer.io_error("write", e))?;
            layer.mark_written();
            return Ok(());
        }
        let start = block * BLOCK_SIZE;
        let valid = (self.disk_size - start).min(BLOCK_SIZE) as usize;
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch[valid..].fill(0);
        // The request's pieces stay aside while the read below uses the spare list.
        let sub = std::mem::replace(&mut self.sub, std::mem::take(&mut self.spare));
        let result = self.read(start, &mut scratch[..valid]).and_then(|()| {
            let at = in_memory(from - start);
            // SAFETY: the caller's buffers are readable; the scratch block is ours alone.
            unsafe { gather(sub.as_slice(), &mut scratch[at..at + in_memory(to - from)]) };
            let layer = &mut self.layers[top];
            std::os::unix::fs::FileExt::write_all_at(&layer.file, &scratch, layer.data_pos(start))
                .map_err(|e| layer.io_error("write", e))?;
            layer.mark_written();
            layer.map.set(block, BlockState::Data);
            Ok(())
        });
        self.scratch = scratch;
        self.spare = std::mem::replace(&mut self.sub, sub);
        result
    }

    /// Make `[offset, offset + len)` read as zeros. Whole blocks are only marked (and their
    /// space in the top layer freed); partial ones are written. Used for both DISCARD and
    /// WRITE_ZEROES: a discarded range reads as zeros.
    pub fn write_zeroes(&mut self, offset: u64, len: u64) -> Result<(), DiskError> {
        let top = self.writable_top()?;
        let end = self.check_range(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let whole_start = offset.next_multiple_of(BLOCK_SIZE);
        // The disk's last block counts as whole when the range reaches the disk's end.
        let whole_end = if end == self.disk_size {
            end.next_multiple_of(BLOCK_SIZE)
        } else {
            end - end % BLOCK_SIZE
        };
        if whole_start >= whole_end {
            // No whole block: the range lies in one block, or in the ends of two.
            let mid = whole_start.min(end);
            self.write(offset, &ZEROS[..in_memory(mid - offset)])?;
            if mid < end {
                self.write(mid, &ZEROS[..in_memory(end - mid)])?;
            }
            return Ok(());
        }
        if offset < whole_start {
            self.write(offset, &ZEROS[..in_memory(whole_start - offset)])?;
        }
        if whole_end < end {
            self.write(whole_end, &ZEROS[..in_memory(end - whole_end)])?;
        }
        let only_layer = top == 0;
        let layer = &mut self.layers[top];
        let mut had_data = false;
        for block in whole_start / BLOCK_SIZE..whole_end / BLOCK_SIZE {
            had_data |= layer.map.get(block) == BlockState::Data;
            // Past the base's end, with nothing below, absent already reads as zeros.
            let state = if only_layer && block * BLOCK_SIZE >= self.base_size {
                BlockState::Absent
            } else {
                BlockState::Zero
            };
            layer.map.set(block, state);
        }
        if had_data {
            punch_hole(
                &layer.file,
                layer.data_pos(whole_start),
                whole_end - whole_start,
            )
            .map_err(|e| layer.io_error("free blocks of", e))?;
            layer.mark_written();
        }
        Ok(())
    }

    /// Make every write so far durable (fdatasync the top layer's data, then its map). A
    /// read-only disk has nothing to flush.
    pub fn flush(&mut self) -> Result<(), DiskError> {
        match self.writable_top() {
            Ok(top) => self.layers[top].flush(false),
            Err(_) => Ok(()),
        }
    }

    /// Freeze the top layer (flushed, marked frozen, never written again) and stack a new empty
    /// layer at `new_top` on it, which becomes the top. Returns the frozen layer: a snapshot
    /// records it, and forks stack their clones' layers on it ([`create_layer`]). Metadata
    /// only: no data is copied.
    pub fn freeze(&mut self, new_top: &Path) -> Result<LayerInfo, DiskError> {
        let top = self.writable_top()?;
        let parent = self.layers[top].info.id;
        // The new layer first: if it cannot be made, nothing changed.
        let layer = Layer::create(
            new_top,
            Some(parent),
            &self.base_identity,
            self.disk_size,
            None,
            false,
        )?;
        if let Err(e) = self.layers[top].flush(true) {
            drop(layer);
            let _ = std::fs::remove_file(new_top);
            return Err(e);
        }
        self.layers[top].make_read_only();
        let frozen = self.layers[top].info.clone();
        self.layers.push(layer);
        Ok(frozen)
    }

    /// Merge every frozen layer under the top (all layers of a read-only disk) into one new
    /// layer at `out`, and use it in their place. Copies the data of those layers once.
    pub fn compact_frozen(&mut self, out: &Path) -> Result<Compacted, DiskError> {
        let end = match self.layers.last() {
            Some(top) if top.writable => self.layers.len() - 1,
            _ => self.layers.len(),
        };
        if end < 2 {
            return Err(DiskError::NothingToCompact(
                "fewer than two frozen layers under the top",
            ));
        }
        let mut merged = merge(&self.layers[..end], out)?;
        merged.make_read_only();
        let replaced = self
            .layers
            .splice(0..end, std::iter::once(merged))
            .map(|l| l.info.path)
            .collect();
        Ok(Compacted {
            layer: self.layers[0].info.clone(),
            replaced,
        })
    }
}

impl Drop for Disk {
    /// What was written reaches the files' maps (best effort: a VMM that exits without a
    /// guest flush keeps the guest's writes, as a disk kept powered would).
    fn drop(&mut self) {
        let _ = self.flush();
    }
}

/// Merge a run of frozen layers (bottom to top, each on the one before) into one new frozen
/// layer at `out`: it sits on what the run's bottom sat on and has the ID of the run's top, so
/// the layers stacked on the run, and snapshots that name it, stay valid. The old files are
/// left alone (other disks may use them).
pub fn compact(layers: &[PathBuf], out: &Path) -> Result<LayerInfo, DiskError> {
    if layers.len() < 2 {
        return Err(DiskError::NothingToCompact(
            "give at least two layers, bottom to top",
        ));
    }
    if layers.len() > MAX_LAYERS {
        return Err(DiskError::TooManyLayers {
            count: layers.len(),
            max: MAX_LAYERS,
        });
    }
    let mut open: Vec<Layer> = Vec::with_capacity(layers.len());
    for path in layers {
        let layer = Layer::open(path, false)?;
        if !layer.info.frozen {
            return Err(DiskError::NotFrozen { path: path.clone() });
        }
        if let Some(below) = open.last() {
            if layer.info.parent != Some(below.info.id) {
                return Err(DiskError::WrongParent {
                    path: path.clone(),
                    expected: format!("layer {}", below.info.id),
                    found: layer
                        .info
                        .parent
                        .map_or("the base image".to_string(), |p| format!("layer {p}")),
                });
            }
            if layer.info.base_identity != below.info.base_identity {
                return Err(DiskError::WrongBase {
                    path: path.clone(),
                    expected: below.info.base_identity.clone(),
                    found: layer.info.base_identity.clone(),
                });
            }
            if layer.info.disk_size != below.info.disk_size {
                return Err(DiskError::SizeMismatch {
                    path: path.clone(),
                    expected: below.info.disk_size,
                    found: layer.info.disk_size,
                });
            }
        }
        open.push(layer);
    }
    Ok(merge(&open, out)?.info)
}

/// Write the merge of `run` (checked, bottom to top) into a new layer at `out`.
fn merge(run: &[Layer], out: &Path) -> Result<Layer, DiskError> {
    let bottom = &run[0].info;
    let top = &run[run.len() - 1].info;
    let mut merged = Layer::create(
        out,
        bottom.parent,
        &bottom.base_identity,
        bottom.disk_size,
        Some(top.id),
        true,
    )?;
    let result = (|| {
        let blocks = merged.geo.blocks;
        let mut buf = vec![0u8; 1 << 20];
        let mut block = 0;
        while block < blocks {
            let source = source_in(run, block);
            let mut run_end = block + 1;
            while run_end < blocks && source_in(run, run_end) == source {
                run_end += 1;
            }
            match source {
                Source::Base => {}
                Source::Zero => {
                    for b in block..run_end {
                        merged.map.set(b, BlockState::Zero);
                    }
                }
                Source::Layer(i) => {
                    copy_blocks(&run[i], &merged, block..run_end, &mut buf)?;
                    for b in block..run_end {
                        merged.map.set(b, BlockState::Data);
                    }
                    merged.mark_written();
                }
            }
            block = run_end;
        }
        merged.finish(true)
    })();
    match result {
        Ok(()) => Ok(merged),
        Err(e) => {
            drop(merged);
            let _ = std::fs::remove_file(out);
            Err(e)
        }
    }
}

/// Copy the data of `blocks` from one layer to the same place in another.
fn copy_blocks(
    from: &Layer,
    to: &Layer,
    blocks: Range<u64>,
    buf: &mut [u8],
) -> Result<(), DiskError> {
    use std::os::unix::fs::FileExt;
    let mut pos = blocks.start * BLOCK_SIZE;
    let end = blocks.end * BLOCK_SIZE;
    while pos < end {
        let n = usize::try_from(end - pos)
            .unwrap_or(usize::MAX)
            .min(buf.len());
        from.file
            .read_exact_at(&mut buf[..n], from.data_pos(pos))
            .map_err(|e| from.io_error("read", e))?;
        to.file
            .write_all_at(&buf[..n], to.data_pos(pos))
            .map_err(|e| to.io_error("write", e))?;
        pos += n as u64;
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests;
