//! Tests of lazy restore: guest memory registered for real with a userfaultfd (as root, or
//! with access to /dev/userfaultfd), read by threads and by the kernel, discarded, prefetched,
//! populated, and a memory file truncated under it; and the block-size benchmark.

use super::*;
use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use super::layout::PAGE;
use super::shared::lock;
use super::start::{start_with, ReadMode};
use crate::memory::ram::HostRegion;

const MIB: usize = 1 << 20;

/// Private anonymous memory, unmapped on drop.
struct Anon {
    addr: usize,
    len: usize,
}

impl Anon {
    fn new(len: usize) -> Self {
        // SAFETY: a new private anonymous mapping; the result is checked.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        assert_ne!(addr, libc::MAP_FAILED);
        Self {
            addr: addr as usize,
            len,
        }
    }

    fn region(&self, file_offset: u64) -> HostRegion {
        HostRegion {
            host_addr: self.addr as *mut u8,
            len: self.len,
            file_offset,
        }
    }

    fn byte(&self, offset: usize) -> u8 {
        assert!(offset < self.len);
        // SAFETY: inside the mapping.
        unsafe { std::ptr::read_volatile((self.addr + offset) as *const u8) }
    }

    fn page(&self, offset: usize) -> &[u8] {
        assert!(offset + PAGE <= self.len);
        // SAFETY: inside the mapping, which lives as long as `self`.
        unsafe { std::slice::from_raw_parts((self.addr + offset) as *const u8, PAGE) }
    }
}

impl Drop for Anon {
    fn drop(&mut self) {
        // SAFETY: our own mapping.
        unsafe {
            libc::munmap(self.addr as *mut libc::c_void, self.len);
        }
    }
}

/// A file in the temp directory, removed on drop.
struct TempFile(std::path::PathBuf);

impl TempFile {
    fn new(tag: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let path =
            std::env::temp_dir().join(format!("mayfly-lazy-{tag}-{}-{n}", std::process::id()));
        Self(path)
    }

    fn create(&self) -> File {
        File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&self.0)
            .unwrap()
    }

    fn open(&self) -> File {
        File::open(&self.0).unwrap()
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn pattern(offset: usize) -> u8 {
    ((offset / PAGE) as u8).wrapping_mul(31) ^ (offset % 251) as u8 | 1
}

/// A 12 MiB memory file: pattern, a 2 MiB hole at 3 MiB, 64 KiB of written zeros at 6 MiB,
/// and its last 1 MiB missing (past the end). Returns the file and the expected 12 MiB.
fn sample_file(tag: &str) -> (TempFile, Vec<u8>) {
    let size = 12 * MIB;
    let mut expected: Vec<u8> = (0..size).map(pattern).collect();
    expected[3 * MIB..5 * MIB].fill(0);
    expected[6 * MIB..6 * MIB + (64 << 10)].fill(0);
    expected[11 * MIB..].fill(0);
    let temp = TempFile::new(tag);
    let file = temp.create();
    file.write_all_at(&expected[..3 * MIB], 0).unwrap();
    file.write_all_at(&expected[5 * MIB..11 * MIB], 5 * MIB as u64)
        .unwrap();
    file.sync_all().unwrap();
    (temp, expected)
}

/// Guest RAM for the sample: an 8 MiB and a 4 MiB region (file offsets 0 and 8 MiB).
fn sample_ram() -> (Anon, Anon) {
    (Anon::new(8 * MIB), Anon::new(4 * MIB))
}

type Failures = Arc<Mutex<Vec<String>>>;

fn recorder() -> (Failures, Box<dyn FnOnce(String) + Send>) {
    let failures = Failures::default();
    let f = failures.clone();
    (failures, Box::new(move |m| lock(&f).push(m)))
}

fn start_sample(
    file: File,
    ram: &(Anon, Anon),
    options: LazyOptions,
    on_failure: Box<dyn FnOnce(String) + Send>,
) -> LazyMemory {
    let regions = [ram.0.region(0), ram.1.region(8 * MIB as u64)];
    // SAFETY: fresh private anonymous mappings that outlive the LazyMemory in every test.
    unsafe { start(file, &regions, options, on_failure) }.unwrap()
}

fn options(block_size: usize) -> LazyOptions {
    LazyOptions {
        block_size,
        prefetch: Vec::new(),
    }
}

/// Byte `offset` of the sample's guest RAM, as the file sees it.
fn ram_byte(ram: &(Anon, Anon), offset: usize) -> u8 {
    if offset < 8 * MIB {
        ram.0.byte(offset)
    } else {
        ram.1.byte(offset - 8 * MIB)
    }
}

fn ram_page(ram: &(Anon, Anon), offset: usize) -> &[u8] {
    if offset < 8 * MIB {
        ram.0.page(offset)
    } else {
        ram.1.page(offset - 8 * MIB)
    }
}

/// xorshift64: enough randomness for shuffles without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, (self.next() % (i as u64 + 1)) as usize);
        }
    }
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn lazy_two_threads_random_order_read_the_file() {
    for block_size in [4 << 10, 64 << 10, 2 * MIB] {
        let (temp, expected) = sample_file("content");
        let ram = sample_ram();
        let (failures, on_failure) = recorder();
        let lazy = start_sample(temp.open(), &ram, options(block_size), on_failure);
        let pages = expected.len() / PAGE;
        std::thread::scope(|s| {
            for seed in [1u64, 2] {
                let (ram, expected) = (&ram, &expected);
                s.spawn(move || {
                    let mut order: Vec<usize> = (0..pages).collect();
                    Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15)).shuffle(&mut order);
                    for page in order {
                        let offset = page * PAGE;
                        assert!(
                            ram_page(ram, offset) == &expected[offset..offset + PAGE],
                            "page at {offset:#x} differs (block size {block_size})"
                        );
                    }
                });
            }
        });
        let stats = lazy.stats();
        let blocks = (12 * MIB).div_ceil(block_size) as u64;
        assert_eq!(stats.blocks_copied + stats.zero_blocks, blocks, "{stats:?}");
        // Blocks in the hole, in the zeros written at 6 MiB or in the missing tail.
        let zero = expected
            .chunks(block_size)
            .filter(|block| block.iter().all(|&b| b == 0))
            .count() as u64;
        assert_eq!(stats.zero_blocks, zero, "{stats:?}");
        assert!(stats.faults >= blocks, "{stats:?}");
        assert_eq!(lazy.working_set().len() as u64, blocks);
        drop(lazy);
        assert!(lock(&failures).is_empty());
    }
}

/// A syscall that reads guest memory faults inside the kernel: that needs a userfaultfd
/// that is not user-mode only, as KVM does.
#[test]
fn lazy_kernel_mode_faults_are_served() {
    let (temp, expected) = sample_file("kernel");
    let ram = sample_ram();
    let (failures, on_failure) = recorder();
    let lazy = start_sample(temp.open(), &ram, LazyOptions::default(), on_failure);
    let out = TempFile::new("kernel-out");
    let mut file = out.create();
    // SAFETY: the whole mapping, alive for the call.
    let all = unsafe { std::slice::from_raw_parts(ram.0.addr as *const u8, ram.0.len) };
    file.write_all(all).unwrap();
    let written = std::fs::read(&out.0).unwrap();
    assert!(written == expected[..8 * MIB]);
    assert!(lazy.stats().faults > 0);
    drop(lazy);
    assert!(lock(&failures).is_empty());
}

#[test]
fn lazy_working_set_is_in_first_use_order() {
    let (temp, _) = sample_file("order");
    let ram = sample_ram();
    let (failures, on_failure) = recorder();
    let bs = 64 << 10;
    let lazy = start_sample(temp.open(), &ram, options(bs), on_failure);
    for block in [7usize, 2, 130, 9, 2, 7, 0] {
        ram_byte(&ram, block * bs + 5000);
    }
    let want: Vec<u64> = [7u64, 2, 130, 9, 0].iter().map(|b| b * bs as u64).collect();
    assert_eq!(lazy.working_set(), want);
    assert_eq!(lazy.stats().faults, 5);
    drop(lazy);
    assert!(lock(&failures).is_empty());
}

#[test]
fn lazy_prefetch_loads_without_faults() {
    let (temp, expected) = sample_file("prefetch");
    let ram = sample_ram();
    let (failures, on_failure) = recorder();
    let bs = 64 << 10;
    let prefetch = vec![
        5 * bs as u64 + 100,
        bs as u64,
        (8 * MIB + 3 * bs) as u64,
        5 * bs as u64,     // again: loaded once
        (64 * MIB) as u64, // outside every region: ignored
    ];
    let lazy = start_sample(
        temp.open(),
        &ram,
        LazyOptions {
            block_size: bs,
            prefetch,
        },
        on_failure,
    );
    wait_until("prefetch", || lazy.stats().prefetched_blocks == 3);
    for offset in [5 * bs, bs + 4096, 8 * MIB + 3 * bs + bs - 1] {
        assert_eq!(ram_byte(&ram, offset), expected[offset]);
    }
    assert_eq!(lazy.stats().faults, 0);
    ram_byte(&ram, 3 * bs);
    let stats = lazy.stats();
    assert_eq!(stats.faults, 1);
    assert_eq!(stats.blocks_copied, 4);
    assert_eq!(stats.bytes_read, 4 * bs as u64);
    let want: Vec<u64> = [5 * bs, bs, 8 * MIB + 3 * bs, 3 * bs]
        .iter()
        .map(|&o| o as u64)
        .collect();
    assert_eq!(lazy.working_set(), want);
    drop(lazy);
    assert!(lock(&failures).is_empty());
}

#[test]
fn lazy_populate_all_loads_everything() {
    let (temp, expected) = sample_file("populate");
    let ram = sample_ram();
    let (failures, on_failure) = recorder();
    let bs = 64 << 10;
    let lazy = start_sample(temp.open(), &ram, options(bs), on_failure);
    ram_byte(&ram, 0);
    lazy.populate_all().unwrap();
    let stats = lazy.stats();
    assert_eq!(
        stats.blocks_copied + stats.zero_blocks,
        (12 * MIB / bs) as u64
    );
    assert_eq!(stats.faults, 1);
    for offset in (0..12 * MIB).step_by(PAGE) {
        assert!(ram_page(&ram, offset) == &expected[offset..offset + PAGE]);
    }
    assert_eq!(lazy.stats().faults, 1, "no faults after populate_all");
    assert_eq!(
        lazy.working_set(),
        vec![0],
        "populate_all is not the working set"
    );
    lazy.populate_all().unwrap();
    drop(lazy);
    assert!(lock(&failures).is_empty());
}

/// MADV_DONTNEED on lazy memory: the handler reads the REMOVE event (the madvise waits for
/// that), and the discarded pages read as zero afterwards, as without userfaultfd.
#[test]
fn lazy_discarded_pages_read_zero() {
    let (temp, expected) = sample_file("discard");
    let ram = sample_ram();
    let (failures, on_failure) = recorder();
    let bs = 64 << 10;
    let lazy = start_sample(temp.open(), &ram, options(bs), on_failure);
    assert_eq!(ram.0.byte(PAGE), expected[PAGE]);
    // One loaded page, and a block not loaded yet.
    for (offset, len) in [(PAGE, PAGE), (4 * bs, bs)] {
        // SAFETY: pages of our own mapping.
        let rc = unsafe {
            libc::madvise(
                (ram.0.addr + offset) as *mut libc::c_void,
                len,
                libc::MADV_DONTNEED,
            )
        };
        assert_eq!(rc, 0);
    }
    assert!(ram.0.page(PAGE).iter().all(|&b| b == 0));
    assert!(ram.0.page(0) == &expected[..PAGE]);
    assert!(ram.0.page(2 * PAGE) == &expected[2 * PAGE..3 * PAGE]);
    assert!(ram.0.page(4 * bs).iter().all(|&b| b == 0));
    // The whole block was discarded: nothing to read for it.
    assert_eq!(lazy.stats().bytes_read, bs as u64 + bs as u64);
    lazy.populate_all().unwrap();
    assert!(ram.0.page(PAGE).iter().all(|&b| b == 0));
    assert!(ram.0.page(5 * bs) == &expected[5 * bs..5 * bs + PAGE]);
    drop(lazy);
    assert!(lock(&failures).is_empty());
}

/// A discarded page inside a block mapped as the zero page: the block is filled again
/// around the pages still present.
#[test]
fn lazy_discard_inside_a_zero_block() {
    let (temp, _) = sample_file("discard-zero");
    let ram = sample_ram();
    let (failures, on_failure) = recorder();
    let bs = 64 << 10;
    let lazy = start_sample(temp.open(), &ram, options(bs), on_failure);
    let hole = 3 * MIB;
    assert_eq!(ram.0.byte(hole), 0);
    // Write to a page so it is a real page, then discard the one after it.
    // SAFETY: inside our mapping.
    unsafe { std::ptr::write_volatile((ram.0.addr + hole + PAGE) as *mut u8, 7) };
    // SAFETY: a page of our own mapping.
    let rc = unsafe {
        libc::madvise(
            (ram.0.addr + hole + 2 * PAGE) as *mut libc::c_void,
            PAGE,
            libc::MADV_DONTNEED,
        )
    };
    assert_eq!(rc, 0);
    assert_eq!(ram.0.byte(hole + 2 * PAGE), 0);
    assert_eq!(ram.0.byte(hole + PAGE), 7);
    assert_eq!(ram.0.byte(hole + 5 * PAGE), 0);
    let stats = lazy.stats();
    assert_eq!((stats.zero_blocks, stats.bytes_read), (2, 0), "{stats:?}");
    drop(lazy);
    assert!(lock(&failures).is_empty());
}

/// One thread discards pages while another reads them: every read ends with the file's
/// bytes or zeros, and nothing hangs.
#[test]
fn lazy_discards_racing_with_faults() {
    let (temp, expected) = sample_file("discard-race");
    let ram = sample_ram();
    let (failures, on_failure) = recorder();
    let lazy = start_sample(temp.open(), &ram, options(64 << 10), on_failure);
    let (addr, len) = (ram.0.addr, ram.0.len);
    let (tx, done) = mpsc::channel();
    let discarder = std::thread::spawn(move || {
        let mut rng = Rng(7);
        for _ in 0..2000 {
            let page = rng.next() as usize % (len / PAGE);
            // SAFETY: a page of the test's mapping, which outlives this thread.
            let rc = unsafe {
                libc::madvise(
                    (addr + page * PAGE) as *mut libc::c_void,
                    PAGE,
                    libc::MADV_DONTNEED,
                )
            };
            assert_eq!(rc, 0);
        }
        let _ = tx.send(());
    });
    let mut rng = Rng(11);
    while done.try_recv().is_err() {
        let offset = (rng.next() as usize % (len / PAGE)) * PAGE;
        for (i, &b) in ram.0.page(offset).iter().enumerate() {
            assert!(b == 0 || b == expected[offset + i], "{offset:#x}+{i}");
        }
    }
    discarder.join().unwrap();
    lazy.populate_all().unwrap();
    drop(lazy);
    assert!(lock(&failures).is_empty());
}

#[test]
fn lazy_truncated_file_fails_and_releases_the_faulting_thread() {
    let (temp, expected) = sample_file("truncate");
    let ram = sample_ram();
    let (tx, failed) = mpsc::channel();
    let lazy = start_sample(
        temp.open(),
        &ram,
        options(64 << 10),
        Box::new(move |message| tx.send(message).unwrap()),
    );
    assert_eq!(ram.0.byte(0), expected[0]);
    File::options()
        .write(true)
        .open(&temp.0)
        .unwrap()
        .set_len(0)
        .unwrap();
    let (tx, touched) = mpsc::channel();
    let addr = ram.0.addr + 2 * MIB;
    std::thread::spawn(move || {
        // SAFETY: inside the mapping, which outlives this thread in the test (the test
        // waits for the thread's answer before it ends, or fails and leaks nothing worse).
        let byte = unsafe { std::ptr::read_volatile(addr as *const u8) };
        let _ = tx.send(byte);
    });
    let message = failed.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(message.contains("truncated"), "{message}");
    let byte = touched.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(byte, 0, "released threads see zero pages");
    assert!(matches!(lazy.populate_all(), Err(LazyError::Failed(_))));
    // The regions are unregistered: untouched memory is plain anonymous memory now.
    assert_eq!(ram.1.byte(0), 0);
    drop(lazy);
}

#[test]
fn lazy_drop_stops_the_thread_and_unregisters() {
    let (temp, expected) = sample_file("drop");
    let ram = sample_ram();
    let (failures, on_failure) = recorder();
    let lazy = start_sample(temp.open(), &ram, LazyOptions::default(), on_failure);
    assert_eq!(ram.0.byte(PAGE), expected[PAGE]);
    let shared = Arc::downgrade(&lazy.shared);
    let (tx, dropped) = mpsc::channel();
    std::thread::spawn(move || {
        drop(lazy);
        let _ = tx.send(());
    });
    dropped.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(shared.upgrade().is_none(), "the handler thread is gone");
    assert_eq!(ram.0.byte(2 * MIB), 0, "unregistered: no handler, no hang");
    assert!(lock(&failures).is_empty());
}

#[test]
fn lazy_rejects_bad_input() {
    let ram = sample_ram();
    let temp = TempFile::new("bad");
    temp.create();
    let start = |regions: &[HostRegion], block_size| {
        // SAFETY: only invalid input, which `start` rejects before registering anything.
        unsafe { super::start(temp.open(), regions, options(block_size), Box::new(|_| {})) }
    };
    let good = ram.0.region(0);
    for bs in [0, 1000, 2048, 3 * PAGE, 2 << 30] {
        assert!(matches!(start(&[good], bs), Err(LazyError::BlockSize(_))));
    }
    let unaligned = HostRegion {
        host_addr: (ram.0.addr + 1) as *mut u8,
        ..good
    };
    let overlapping = HostRegion {
        host_addr: (ram.0.addr + PAGE) as *mut u8,
        len: PAGE,
        ..good
    };
    for regions in [&[][..], &[unaligned], &[good, overlapping]] {
        assert!(matches!(start(regions, PAGE), Err(LazyError::Region(_))));
    }
}

#[test]
fn lazy_memory_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<LazyMemory>();
}

/// Block sizes and read modes, touching 128 MiB from one thread, with the memory file in
/// the page cache or not. Run by hand:
/// `cargo test --release -p mayfly-vmm lazy::tests::bench -- --ignored --nocapture`
#[test]
#[ignore]
fn bench_block_sizes() {
    const SIZE: usize = 128 * MIB;
    let temp = TempFile::new("bench");
    {
        let mut rng = Rng(0x1234_5678);
        let data: Vec<u8> = (0..SIZE / 8)
            .flat_map(|_| (rng.next() | 0x0101_0101_0101_0101).to_ne_bytes())
            .collect();
        let mut file = temp.create();
        file.write_all(&data).unwrap();
        file.sync_all().unwrap();
    }
    let pages = SIZE / PAGE;
    let sequential: Vec<usize> = (0..pages).collect();
    let mut random = sequential.clone();
    Rng(42).shuffle(&mut random);
    let patterns: [(&str, &[usize]); 5] = [
        ("sequential", &sequential),
        ("random", &random),
        ("random 10%", &random[..pages / 10]),
        ("random 1%", &random[..pages / 100]),
        ("populate", &[]),
    ];
    println!("cache mode   block  pattern     total ms  us/page  faults  MiB read");
    for cold in [false, true] {
        for mode in [ReadMode::Pread, ReadMode::Mmap] {
            for bs in [4 << 10, 64 << 10, 2 * MIB] {
                for (name, order) in patterns {
                    let file = temp.open();
                    if cold {
                        // SAFETY: advice on our own descriptor.
                        let rc = unsafe {
                            libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED)
                        };
                        assert_eq!(rc, 0);
                    }
                    let ram = Anon::new(SIZE);
                    // SAFETY: a fresh private anonymous mapping that outlives the
                    // LazyMemory.
                    let lazy = unsafe {
                        start_with(
                            file,
                            &[ram.region(0)],
                            options(bs),
                            Box::new(|m| panic!("{m}")),
                            mode,
                        )
                    }
                    .unwrap();
                    let t = Instant::now();
                    let mut sum = 0u64;
                    for &page in order.iter() {
                        sum += ram.byte(page * PAGE) as u64;
                    }
                    if order.is_empty() {
                        lazy.populate_all().unwrap();
                    }
                    let elapsed = t.elapsed();
                    assert!(sum > 0 || order.is_empty());
                    let stats = lazy.stats();
                    let touched = if order.is_empty() { pages } else { order.len() };
                    println!(
                        "{:<5} {:<6} {:>5}K  {:<10} {:>9.1} {:>8.2} {:>7} {:>9}",
                        if cold { "cold" } else { "warm" },
                        format!("{mode:?}"),
                        bs >> 10,
                        name,
                        elapsed.as_secs_f64() * 1e3,
                        elapsed.as_secs_f64() * 1e6 / touched as f64,
                        stats.faults,
                        stats.bytes_read >> 20
                    );
                }
            }
        }
    }
}
