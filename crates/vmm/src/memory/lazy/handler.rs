//! The handler thread's state and how it places guest memory: it reads the userfaultfd's
//! events (faults to serve, pages discarded), then fills a block's missing pages from the
//! memory file or with the zero page, counting and recording each block it loads. Its main
//! loop is in `serve`.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use userfaultfd::{Event, EventBuffer, Uffd};

use super::layout::{Bitmap, Block, Extents, Layout, MappedFile, PAGE};
use super::shared::{lock, Shared};

/// Events read per `read(2)` of the userfaultfd.
pub(super) const EVENT_BATCH: usize = 64;

/// How long the handler retries an ioctl that keeps answering EAGAIN (an address-space change
/// in flight) before it gives up. Each change completes within microseconds once its event is
/// read, so reaching this means something is badly wrong.
const EAGAIN_LIMIT: Duration = Duration::from_secs(5);

/// userfaultfd's errors print without their errno; this keeps it.
pub(super) fn describe(error: &userfaultfd::Error) -> String {
    use userfaultfd::Error as E;
    match error {
        E::SystemError(errno) => errno.to_string(),
        E::CopyFailed(errno) => format!("UFFDIO_COPY: {errno}"),
        E::ZeropageFailed(errno) => format!("UFFDIO_ZEROPAGE: {errno}"),
        E::OpenDevUserfaultfd(e) => format!("cannot open /dev/userfaultfd: {e}"),
        other => other.to_string(),
    }
}

/// The errno of a failed userfaultfd ioctl, if it has one.
fn errno_of(error: &userfaultfd::Error) -> Option<i32> {
    use userfaultfd::Error as E;
    match error {
        E::SystemError(errno) | E::CopyFailed(errno) | E::ZeropageFailed(errno) => {
            Some(*errno as i32)
        }
        _ => None,
    }
}

/// Why a block is being loaded.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Why {
    Fault,
    Prefetch,
    /// For `populate_all`: not part of the working set.
    Fill,
}

/// The outcome of placing memory with userfaultfd.
enum Placed {
    Done,
    /// An address-space change is in flight (EAGAIN): read events, then try again.
    Again,
}

/// The userfaultfd events the handler acts on.
pub(super) enum Message {
    Fault(usize),
    /// `[start, end)` was discarded.
    Remove(usize, usize),
}

/// The handler's failure: the message for `on_failure`.
pub(super) struct Fatal(pub(super) String);

/// The handler thread's state.
pub(super) struct Handler {
    pub(super) uffd: Uffd,
    pub(super) shared: Arc<Shared>,
    pub(super) file: File,
    pub(super) mapped: Option<MappedFile>,
    pub(super) extents: Extents,
    pub(super) layout: Layout,
    /// Blocks whose pages are all present.
    pub(super) populated: Bitmap,
    /// Blocks not in `populated`.
    pub(super) remaining: usize,
    /// Blocks already in the working set.
    pub(super) recorded: Bitmap,
    /// Pages discarded (UFFD_EVENT_REMOVE): they read as zero from then on. Allocated on the
    /// first discard.
    pub(super) discarded: Option<Bitmap>,
    /// Blocks still to prefetch, in order.
    pub(super) prefetch: VecDeque<usize>,
    /// The block `serve_block` is loading and why, until `account` has counted it.
    pub(super) accounting: Option<(usize, Why)>,
    /// Where `populate_all`'s sweep looks for the next missing block.
    pub(super) fill_cursor: usize,
    /// The last `populate_requests` value answered.
    pub(super) populate_done: u64,
    /// Addresses of faults read but not served yet, in order.
    pub(super) pending: VecDeque<usize>,
    pub(super) events: EventBuffer,
    /// Reused list of the events of one read.
    pub(super) scratch: Vec<Message>,
    /// Reused read buffer, one block long.
    pub(super) buf: Vec<u8>,
    pub(super) on_failure: Option<Box<dyn FnOnce(String) + Send>>,
}

impl Handler {
    /// Read every pending event: discards take effect at once (before any fault read with
    /// them is served: until a REMOVE event is read, every ioctl answers EAGAIN), faults join
    /// `pending`.
    pub(super) fn drain_events(&mut self) -> Result<(), Fatal> {
        loop {
            let mut events = std::mem::take(&mut self.scratch);
            events.clear();
            let read = self
                .uffd
                .read_events(&mut self.events)
                .map_err(|e| Fatal(format!("cannot read userfaultfd events: {}", describe(&e))));
            let read = read.and_then(|iter| {
                for event in iter {
                    let event = event
                        .map_err(|e| Fatal(format!("bad userfaultfd event: {}", describe(&e))))?;
                    events.push(match event {
                        Event::Pagefault { addr, .. } => Message::Fault(addr as usize),
                        Event::Remove { start, end } => {
                            Message::Remove(start as usize, end as usize)
                        }
                        // Not subscribed to; nothing to do.
                        _ => continue,
                    });
                }
                Ok(())
            });
            let count = events.len();
            for event in events.drain(..) {
                match event {
                    Message::Remove(start, end) => self.discard(start, end),
                    Message::Fault(addr) => self.pending.push_back(addr),
                }
            }
            self.scratch = events;
            read?;
            if count < EVENT_BATCH {
                return Ok(());
            }
        }
    }

    /// The VMM discarded `[start, end)` (MADV_DONTNEED): those pages are missing again and read
    /// as zero from now on.
    fn discard(&mut self, start: usize, end: usize) {
        let discarded = self
            .discarded
            .get_or_insert_with(|| Bitmap::new(self.layout.pages));
        for page in self.layout.pages_in(start, end) {
            discarded.set(page);
        }
        let mut addr = start & !(PAGE - 1);
        while addr < end {
            let Some(region) = self.layout.region_of_addr(addr) else {
                // Not ours: skip to the next region, if any.
                match self.layout.regions.iter().find(|r| r.host > addr) {
                    Some(r) => addr = r.host,
                    None => break,
                }
                continue;
            };
            let block = region.first_block + (addr - region.host) / self.layout.block_size;
            if self.populated.get(block) {
                self.populated.clear(block);
                self.remaining += 1;
            }
            let block_end = region.host
                + ((addr - region.host) / self.layout.block_size + 1) * self.layout.block_size;
            addr = block_end.min(region.host + region.len);
        }
    }

    /// Record and count the block `serve_block` is loading, once, just before the copy that
    /// wakes the faulting thread: whoever it tells then sees the block in the working set and
    /// the stats.
    fn account(&mut self, zero: bool) {
        let Some((index, why)) = self.accounting.take() else {
            return;
        };
        let stats = &self.shared.stats;
        if zero {
            stats.zero_blocks.fetch_add(1, Ordering::Relaxed);
        } else {
            stats.blocks_copied.fetch_add(1, Ordering::Relaxed);
        }
        if why == Why::Prefetch {
            stats.prefetched_blocks.fetch_add(1, Ordering::Relaxed);
        }
        if why != Why::Fill && !self.recorded.get(index) {
            self.recorded.set(index);
            let offset = self.layout.block(index).file_offset;
            let mut working = lock(&self.shared.working);
            match why {
                Why::Prefetch => working.prefetched.push(offset),
                _ => working.faulted.push(offset),
            }
        }
    }

    /// Fill the missing pages of `block`, retrying while an address-space change is in flight.
    pub(super) fn place_with_retry(&mut self, block: Block) -> Result<(), Fatal> {
        let since = Instant::now();
        let mut tries = 0u32;
        loop {
            match self.place(block)? {
                Placed::Done => return Ok(()),
                Placed::Again => {
                    // Read the event that holds things up (a REMOVE); it may discard pages of
                    // this very block, so start the block over with its new contents.
                    self.drain_events()?;
                    if since.elapsed() > EAGAIN_LIMIT {
                        return Err(Fatal(format!(
                            "userfaultfd kept answering EAGAIN for {EAGAIN_LIMIT:?} at {:#x}",
                            block.host
                        )));
                    }
                    tries += 1;
                    if tries < 16 {
                        std::thread::yield_now();
                    } else {
                        std::thread::sleep(Duration::from_micros(50));
                    }
                }
            }
        }
    }

    /// Fill the missing pages of `block` once.
    fn place(&mut self, block: Block) -> Result<Placed, Fatal> {
        let src = self.source(block)?;
        self.account(src.is_none());
        self.copy(block, src)
    }

    /// Where to copy `block` from: `None` for the zero page (holes, zeros, discarded pages),
    /// else the file's bytes (discarded pages as zeros), in `buf` or the file mapping.
    fn source(&mut self, block: Block) -> Result<Option<*const u8>, Fatal> {
        let discarded = self.discarded.as_ref().map_or(0, |d| {
            self.layout
                .pages_in(block.host, block.host + block.len)
                .filter(|&p| d.get(p))
                .count()
        });
        if discarded == block.len / PAGE || !self.extents.has_data(block.file_offset, block.len) {
            return Ok(None);
        }
        let discarded = discarded > 0;
        if let Some(mapped) = &self.mapped {
            let end = block.file_offset + block.len as u64;
            if !discarded && end <= mapped.len as u64 {
                // Inside the mapping (checked above).
                let src = mapped.addr
                    + usize::try_from(block.file_offset).expect("an offset in the mapping");
                self.shared
                    .stats
                    .bytes_read
                    .fetch_add(block.len as u64, Ordering::Relaxed);
                return Ok(Some(src as *const u8));
            }
        }
        self.read(block.file_offset, block.len)?;
        if discarded {
            if let Some(d) = &self.discarded {
                for (i, page) in self
                    .layout
                    .pages_in(block.host, block.host + block.len)
                    .enumerate()
                {
                    if d.get(page) {
                        self.buf[i * PAGE..(i + 1) * PAGE].fill(0);
                    }
                }
            }
        }
        if is_zero(&self.buf[..block.len]) {
            Ok(None)
        } else {
            Ok(Some(self.buf.as_ptr()))
        }
    }

    /// Read `len` bytes of the file at `offset` into `buf`. Past the file's original end reads
    /// zeros; a file that ends earlier than it did at start was changed under us: fatal.
    fn read(&mut self, offset: u64, len: usize) -> Result<(), Fatal> {
        // At most `len`.
        let want = usize::try_from(self.extents.len.saturating_sub(offset).min(len as u64))
            .expect("at most len");
        let mut got = 0;
        while got < want {
            match self
                .file
                .read_at(&mut self.buf[got..want], offset + got as u64)
            {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(Fatal(format!(
                        "cannot read the memory file at offset {:#x}: {e}",
                        offset + got as u64
                    )))
                }
            }
        }
        self.shared
            .stats
            .bytes_read
            .fetch_add(got as u64, Ordering::Relaxed);
        if got < want {
            return Err(Fatal(format!(
                "the memory file ends at {:#x}, inside the {want} bytes at {offset:#x} it had when \
                 the restore started: it was truncated or replaced under a running VM",
                offset + got as u64
            )));
        }
        self.buf[want..len].fill(0);
        Ok(())
    }

    /// Place `block.len` bytes at `block.host` from `src`, or the zero page if `None`. Pages
    /// already present are left alone (EEXIST: a race, or pages of a partly discarded block)
    /// and their waiters woken.
    fn copy(&self, block: Block, src: Option<*const u8>) -> Result<Placed, Fatal> {
        use userfaultfd::Error as E;
        let mut done = 0;
        let mut existed = false;
        // UFFDIO_ZEROPAGE reports a partial fill (it met a present page) only as EAGAIN, like
        // a change in flight: after one, try a single page to tell which it was.
        let mut single = false;
        while done < block.len {
            let dst = (block.host + done) as *mut libc::c_void;
            let left = if single { PAGE } else { block.len - done };
            let result = match src {
                // SAFETY: `dst..dst+left` lies in a region registered with this userfaultfd,
                // which the caller of `start` keeps mapped; UFFDIO_COPY only fills missing
                // pages. `src..src+left` is readable: our buffer or file mapping, at least
                // `block.len` long from `src`.
                Some(src) => unsafe { self.uffd.copy(src.add(done).cast(), dst, left, true) },
                // SAFETY: as above; UFFDIO_ZEROPAGE only fills missing pages.
                None => unsafe { self.uffd.zeropage(dst, left, true) },
            };
            match result {
                Ok(n) if n > 0 && n <= left => done += n,
                // Progress, then a stop (EEXIST on a later page, or a change in flight).
                Err(E::PartiallyCopied(n)) if n > 0 && n <= left => done += n,
                Err(e) if errno_of(&e) == Some(libc::EEXIST) => {
                    existed = true;
                    done += PAGE;
                }
                Err(E::ZeropageFailed(errno)) if errno as i32 == libc::EAGAIN && !single => {
                    single = true;
                    continue;
                }
                Ok(_) | Err(E::PartiallyCopied(_)) => return Ok(Placed::Again),
                Err(e) if errno_of(&e) == Some(libc::EAGAIN) => return Ok(Placed::Again),
                Err(e) => {
                    return Err(Fatal(format!(
                        "cannot fill guest memory at {:#x}: {}",
                        dst as usize,
                        describe(&e)
                    )))
                }
            }
            single = false;
        }
        if existed {
            self.wake(block.host, block.len)?;
        }
        Ok(Placed::Done)
    }

    pub(super) fn wake(&self, addr: usize, len: usize) -> Result<(), Fatal> {
        self.uffd.wake(addr as *mut libc::c_void, len).map_err(|e| {
            Fatal(format!(
                "cannot wake a thread at {addr:#x}: {}",
                describe(&e)
            ))
        })
    }
}

/// Whether `bytes` are all zero. Checks a page at a time, so data is usually recognised by its
/// first page.
fn is_zero(bytes: &[u8]) -> bool {
    bytes
        .chunks(PAGE)
        .all(|page| page.iter().fold(0u8, |acc, &b| acc | b) == 0)
}
