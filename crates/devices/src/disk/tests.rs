//! The layered disk on real files in a temporary directory.

use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

use super::*;

const BS: usize = BLOCK_SIZE as usize;
const ID: &str = "sha256:base-of-the-tests";

/// A directory removed when dropped.
pub(crate) struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let path = std::env::temp_dir().join(format!(
            "mayfly-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        Self(path)
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A base image of `len` bytes: byte i is (i / 512 + i) as u8, so every sector differs.
pub(crate) fn make_base(dir: &TempDir, len: usize) -> PathBuf {
    let path = dir.join("base.raw");
    let data: Vec<u8> = (0..len).map(pattern).collect();
    std::fs::write(&path, data).unwrap();
    path
}

fn pattern(i: usize) -> u8 {
    (i / 512 + i) as u8
}

fn hash_file(path: &Path) -> u64 {
    let data = std::fs::read(path).unwrap();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in data {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

fn chain(base: &Path, layers: &[&PathBuf]) -> Chain {
    Chain {
        base: base.to_path_buf(),
        base_identity: ID.into(),
        layers: layers.iter().map(|p| p.to_path_buf()).collect(),
    }
}

fn read_vec(disk: &mut Disk, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0xee; len];
    disk.read(offset, &mut buf).unwrap();
    buf
}

#[test]
fn reads_come_from_the_base_and_writes_of_whole_and_partial_blocks_read_back() {
    let dir = TempDir::new("disk-rw");
    let base = make_base(&dir, 64 * BS);
    let mut disk = Disk::create(&base, ID, &dir.join("top"), None).unwrap();
    assert_eq!(disk.size(), 64 * BLOCK_SIZE);
    let expect: Vec<u8> = (0..3 * BS).map(pattern).collect();
    assert_eq!(read_vec(&mut disk, 0, 3 * BS), expect);

    // A whole block, a partial block in the middle of one, and a write across blocks.
    disk.write(BLOCK_SIZE, &[1u8; BS]).unwrap();
    disk.write(3 * BLOCK_SIZE + 100, &[2u8; 50]).unwrap();
    disk.write(5 * BLOCK_SIZE - 10, &[3u8; BS + 20]).unwrap();

    let mut model: Vec<u8> = (0..64 * BS).map(pattern).collect();
    model[BS..2 * BS].fill(1);
    model[3 * BS + 100..3 * BS + 150].fill(2);
    model[5 * BS - 10..6 * BS + 10].fill(3);
    assert_eq!(read_vec(&mut disk, 0, 64 * BS), model);
    // Unaligned reads across sources.
    assert_eq!(
        read_vec(&mut disk, 3 * BLOCK_SIZE + 90, 70),
        &model[3 * BS + 90..3 * BS + 160]
    );
    // A second partial write into a block the top now holds is written in place.
    disk.write(3 * BLOCK_SIZE + 120, &[4u8; 10]).unwrap();
    model[3 * BS + 120..3 * BS + 130].fill(4);
    assert_eq!(
        read_vec(&mut disk, 3 * BLOCK_SIZE, BS),
        &model[3 * BS..4 * BS]
    );
}

#[test]
fn a_disk_bigger_than_its_base_reads_zeros_past_it_and_odd_base_sizes_work() {
    let dir = TempDir::new("disk-grow");
    let base = make_base(&dir, 3 * BS + 700);
    let mut disk = Disk::create(&base, ID, &dir.join("top"), Some(16 * BLOCK_SIZE)).unwrap();
    let got = read_vec(&mut disk, 3 * BLOCK_SIZE, 2 * BS);
    assert_eq!(
        &got[..700],
        &(3 * BS..3 * BS + 700).map(pattern).collect::<Vec<_>>()[..]
    );
    assert!(got[700..].iter().all(|&b| b == 0));
    // A partial write in the block the base ends in merges with what the base has.
    disk.write(3 * BLOCK_SIZE + 10, &[9; 4]).unwrap();
    let got = read_vec(&mut disk, 3 * BLOCK_SIZE, 800);
    assert_eq!(got[0], pattern(3 * BS));
    assert_eq!(&got[10..14], &[9; 4]);
    assert_eq!(got[699], pattern(3 * BS + 699));
    assert_eq!(got[700], 0);

    // A read-only disk of the base alone is its size rounded up to sectors.
    let mut plain = Disk::open(&chain(&base, &[]), true).unwrap();
    assert_eq!(plain.size(), (3 * BS + 1024) as u64);
    assert_eq!(
        read_vec(&mut plain, 0, 16),
        (0..16).map(pattern).collect::<Vec<_>>()
    );
    assert!(matches!(plain.write(0, &[1]), Err(DiskError::ReadOnly)));
}

#[test]
fn ranges_beyond_the_disk_are_refused() {
    let dir = TempDir::new("disk-range");
    let base = make_base(&dir, 4 * BS);
    let mut disk = Disk::create(&base, ID, &dir.join("top"), None).unwrap();
    let mut buf = [0u8; 16];
    assert!(matches!(
        disk.read(4 * BLOCK_SIZE - 8, &mut buf),
        Err(DiskError::OutOfRange { .. })
    ));
    assert!(matches!(
        disk.write(u64::MAX - 4, &buf),
        Err(DiskError::OutOfRange { .. })
    ));
    assert!(matches!(
        disk.write_zeroes(BLOCK_SIZE, u64::MAX),
        Err(DiskError::OutOfRange { .. })
    ));
    // Exactly up to the end is fine.
    disk.read(4 * BLOCK_SIZE - 16, &mut buf).unwrap();
    disk.write(4 * BLOCK_SIZE - 16, &buf).unwrap();
}

#[test]
fn data_is_visible_through_the_chain_and_freeze_sends_writes_to_the_new_layer() {
    let dir = TempDir::new("disk-freeze");
    let base = make_base(&dir, 32 * BS);
    let base_hash = hash_file(&base);
    let l1 = dir.join("l1");
    let mut disk = Disk::create(&base, ID, &l1, None).unwrap();
    disk.write(0, &[1; BS]).unwrap();
    disk.write(2 * BLOCK_SIZE, &[1; BS]).unwrap();

    let l2 = dir.join("l2");
    let frozen = disk.freeze(&l2).unwrap();
    assert_eq!(frozen.path, l1);
    assert!(frozen.frozen);
    assert!(LayerInfo::read(&l1).unwrap().frozen, "the header says so");
    let frozen_hash = hash_file(&l1);
    assert_eq!(disk.layers().len(), 2);
    assert_eq!(disk.layers()[1].parent, Some(frozen.id));

    // New writes land in l2; what l1 had is still visible under them.
    disk.write(2 * BLOCK_SIZE, &[2; BS]).unwrap();
    disk.write(4 * BLOCK_SIZE + 1, &[2; 3]).unwrap();
    disk.flush().unwrap();
    assert_eq!(read_vec(&mut disk, 0, BS), vec![1; BS]);
    assert_eq!(read_vec(&mut disk, 2 * BLOCK_SIZE, BS), vec![2; BS]);
    assert_eq!(
        read_vec(&mut disk, BLOCK_SIZE, 4),
        (BS..BS + 4).map(pattern).collect::<Vec<_>>()
    );
    assert_eq!(
        hash_file(&l1),
        frozen_hash,
        "the frozen layer is never written"
    );

    // The frozen chain alone still reads as it was at the freeze.
    let mut old = Disk::open(&chain(&base, &[&l1]), true).unwrap();
    assert_eq!(read_vec(&mut old, 2 * BLOCK_SIZE, BS), vec![1; BS]);
    drop(old);
    drop(disk);

    // And the whole chain, reopened from its files.
    let mut again = Disk::open(&chain(&base, &[&l1, &l2]), false).unwrap();
    assert_eq!(read_vec(&mut again, 2 * BLOCK_SIZE, BS), vec![2; BS]);
    assert_eq!(read_vec(&mut again, 4 * BLOCK_SIZE + 1, 3), vec![2; 3]);
    assert_eq!(read_vec(&mut again, 0, BS), vec![1; BS]);
    assert_eq!(hash_file(&base), base_hash, "the base is never written");
}

#[test]
fn forks_get_independent_tops_on_one_frozen_chain() {
    let dir = TempDir::new("disk-fork");
    let base = make_base(&dir, 16 * BS);
    let base_hash = hash_file(&base);
    let l1 = dir.join("l1");
    let mut parent = Disk::create(&base, ID, &l1, None).unwrap();
    parent.write(0, &[7; BS]).unwrap();
    let frozen = parent.freeze(&dir.join("parent-top")).unwrap();
    let frozen_hash = hash_file(&l1);

    let mut clones: Vec<Disk> = (0..3)
        .map(|i| {
            let top = dir.join(&format!("clone{i}"));
            let info = create_layer(&top, &frozen).unwrap();
            assert_eq!(info.parent, Some(frozen.id));
            Disk::open(&chain(&base, &[&l1, &top]), false).unwrap()
        })
        .collect();
    // Each clone reads as the parent did at the freeze (same identity as the parent now).
    for clone in &mut clones {
        assert_eq!(read_vec(clone, 0, BS), vec![7; BS]);
        assert!(clone.identity().same_content(&parent.identity()));
    }
    for (i, clone) in clones.iter_mut().enumerate() {
        clone.write(BLOCK_SIZE, &[i as u8 + 10; BS]).unwrap();
        clone.write(0, &[i as u8 + 20; 8]).unwrap();
        clone.flush().unwrap();
    }
    parent.write(BLOCK_SIZE, &[99; BS]).unwrap();
    for (i, clone) in clones.iter_mut().enumerate() {
        assert_eq!(read_vec(clone, BLOCK_SIZE, BS), vec![i as u8 + 10; BS]);
        let head = read_vec(clone, 0, 16);
        assert_eq!(&head[..8], &[i as u8 + 20; 8]);
        assert_eq!(&head[8..], &[7; 8]);
        assert!(!clone.identity().same_content(&parent.identity()));
    }
    assert_eq!(read_vec(&mut parent, BLOCK_SIZE, 4), vec![99; 4]);
    assert_eq!(read_vec(&mut parent, 0, 4), vec![7; 4]);
    assert_eq!(hash_file(&l1), frozen_hash);
    assert_eq!(hash_file(&base), base_hash);
}

#[test]
fn a_clone_needs_a_frozen_parent() {
    let dir = TempDir::new("disk-fork-unfrozen");
    let base = make_base(&dir, 4 * BS);
    let info = create_base_layer(&dir.join("l1"), &base, ID, None).unwrap();
    assert!(matches!(
        create_layer(&dir.join("c"), &info),
        Err(DiskError::NotFrozen { .. })
    ));
    // And a layer is never created over an existing file.
    let mut disk = Disk::open(&chain(&base, &[&dir.join("l1")]), false).unwrap();
    assert!(matches!(disk.freeze(&base), Err(DiskError::Create { .. })));
    // That failed freeze changed nothing: the top is still writable.
    disk.write(0, &[1; 4]).unwrap();
}

#[test]
fn a_base_opened_read_only_is_never_modified() {
    let dir = TempDir::new("disk-base");
    let base = make_base(&dir, 16 * BS);
    let before = hash_file(&base);
    let mtime = std::fs::metadata(&base).unwrap().modified().unwrap();
    let l1 = dir.join("l1");
    let mut disk = Disk::create(&base, ID, &l1, None).unwrap();
    for i in 0..16u64 {
        disk.write(i * BLOCK_SIZE + 7, &[0xaa; 100]).unwrap();
    }
    disk.write_zeroes(0, 16 * BLOCK_SIZE).unwrap();
    disk.flush().unwrap();
    disk.freeze(&dir.join("l2")).unwrap();
    disk.write(0, &[1; 3 * BS]).unwrap();
    disk.freeze(&dir.join("l3")).unwrap();
    disk.compact_frozen(&dir.join("c")).unwrap();
    drop(disk);
    assert_eq!(hash_file(&base), before);
    assert_eq!(std::fs::metadata(&base).unwrap().modified().unwrap(), mtime);
}

#[test]
fn zeroed_ranges_read_as_zeros_over_lower_data_and_free_their_space() {
    let dir = TempDir::new("disk-zero");
    let base = make_base(&dir, 32 * BS);
    let l1 = dir.join("l1");
    let mut disk = Disk::create(&base, ID, &l1, None).unwrap();
    disk.write(0, &[5; 8 * BS]).unwrap();
    disk.flush().unwrap();
    // Partial at both ends, whole blocks in between: over base data and layer data.
    disk.write_zeroes(100, 10 * BLOCK_SIZE).unwrap();
    let got = read_vec(&mut disk, 0, 12 * BS);
    assert_eq!(&got[..100], &[5; 100]);
    assert!(got[100..100 + 10 * BS].iter().all(|&b| b == 0));
    assert_eq!(got[100 + 10 * BS], pattern(100 + 10 * BS));
    // A tiny zeroing inside one block.
    disk.write_zeroes(20 * BLOCK_SIZE + 3, 5).unwrap();
    let got = read_vec(&mut disk, 20 * BLOCK_SIZE, 10);
    assert_eq!(got[2], pattern(20 * BS + 2));
    assert_eq!(&got[3..8], &[0; 5]);
    disk.flush().unwrap();
    // The blocks that held data were freed (the file holds 1 partial block of the 8).
    let used = std::fs::metadata(&l1).unwrap();
    let allocated = std::os::unix::fs::MetadataExt::blocks(&used) * 512;
    assert!(
        allocated < 6 * BLOCK_SIZE,
        "{allocated} bytes still allocated"
    );
    // Across a block boundary, with no whole block inside.
    disk.write(24 * BLOCK_SIZE, &[6; 2 * BS]).unwrap();
    disk.write_zeroes(24 * BLOCK_SIZE + 100, BLOCK_SIZE + 3000)
        .unwrap();
    let got = read_vec(&mut disk, 24 * BLOCK_SIZE, 2 * BS);
    assert_eq!(&got[..100], &[6; 100]);
    assert!(got[100..BS + 3100].iter().all(|&b| b == 0));
    assert!(got[BS + 3100..].iter().all(|&b| b == 6));
    drop(disk);
    let mut again = Disk::open(&chain(&base, &[&l1]), false).unwrap();
    assert!(read_vec(&mut again, BLOCK_SIZE, BS).iter().all(|&b| b == 0));
}

#[test]
fn written_and_flushed_data_survives_a_reopen_and_the_map_is_written_only_at_flush() {
    let dir = TempDir::new("disk-crash");
    let base = make_base(&dir, 16 * BS);
    let l1 = dir.join("l1");
    let mut disk = Disk::create(&base, ID, &l1, None).unwrap();
    disk.write(3 * BLOCK_SIZE, &[0x5a; BS]).unwrap();
    disk.write_zeroes(5 * BLOCK_SIZE, BLOCK_SIZE).unwrap();
    // Before the flush, the file's map does not claim the block (the data may not be
    // durable yet): a crash now reads the block from below, as it was.
    let file = std::fs::File::open(&l1).unwrap();
    let mut map = [0u8; 2];
    file.read_exact_at(&mut map, 4096).unwrap();
    assert_eq!(map, [0, 0]);
    disk.flush().unwrap();
    file.read_exact_at(&mut map, 4096).unwrap();
    assert_eq!(map[0] >> 6, 1, "block 3: data");
    assert_eq!((map[1] >> 2) & 3, 2, "block 5: zeros");
    // Dropped without any goodbye (as a killed VMM would be), then opened again.
    drop(disk);
    let mut again = Disk::open(&chain(&base, &[&l1]), false).unwrap();
    assert_eq!(read_vec(&mut again, 3 * BLOCK_SIZE, BS), vec![0x5a; BS]);
    assert_eq!(read_vec(&mut again, 5 * BLOCK_SIZE, BS), vec![0; BS]);
    // A second flush with nothing new is a no-op that still succeeds.
    again.flush().unwrap();
    again.flush().unwrap();
}

fn expect_err(result: Result<Disk, DiskError>) -> DiskError {
    match result {
        Ok(_) => panic!("opened"),
        Err(e) => e,
    }
}

#[test]
fn malformed_and_mismatched_chains_are_clear_errors() {
    let dir = TempDir::new("disk-bad");
    let base = make_base(&dir, 16 * BS);
    let l1 = dir.join("l1");
    let mut disk = Disk::create(&base, ID, &l1, None).unwrap();
    disk.write(0, &[1; BS]).unwrap();
    let l2 = dir.join("l2");
    disk.freeze(&l2).unwrap();
    drop(disk);

    // Truncated: a copy cut short.
    let cut = dir.join("cut");
    std::fs::copy(&l1, &cut).unwrap();
    let len = std::fs::metadata(&cut).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&cut)
        .unwrap()
        .set_len(len - 1)
        .unwrap();
    let e = expect_err(Disk::open(&chain(&base, &[&cut]), true));
    assert!(matches!(e, DiskError::Truncated { .. }), "{e}");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&cut)
        .unwrap()
        .set_len(100)
        .unwrap();
    let e = expect_err(Disk::open(&chain(&base, &[&cut]), true));
    assert!(
        matches!(e, DiskError::Truncated { expected: 4096, .. }),
        "{e}"
    );

    // Foreign: the raw base given as a layer, an empty file.
    let e = expect_err(Disk::open(&chain(&base, &[&base]), true));
    assert!(matches!(e, DiskError::NotALayer { .. }), "{e}");
    let empty = dir.join("empty");
    std::fs::write(&empty, b"").unwrap();
    let e = expect_err(Disk::open(&chain(&base, &[&empty]), true));
    assert!(matches!(e, DiskError::NotALayer { .. }), "{e}");

    // An edited header fails its checksum.
    let edited = dir.join("edited");
    std::fs::copy(&l1, &edited).unwrap();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&edited)
        .unwrap();
    f.write_all_at(&[0xff], 25).unwrap();
    let e = expect_err(Disk::open(&chain(&base, &[&edited]), true));
    assert!(matches!(e, DiskError::Corrupt { .. }), "{e}");
    // An invalid map entry.
    let badmap = dir.join("badmap");
    std::fs::copy(&l1, &badmap).unwrap();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&badmap)
        .unwrap();
    f.write_all_at(&[0b11], 4096 + 1).unwrap();
    let e = expect_err(Disk::open(&chain(&base, &[&badmap]), true));
    assert!(matches!(e, DiskError::Corrupt { .. }), "{e}");

    // Wrong parent: l2 given without l1, or in the wrong order.
    let e = expect_err(Disk::open(&chain(&base, &[&l2]), true));
    assert!(matches!(e, DiskError::WrongParent { .. }), "{e}");
    let e = expect_err(Disk::open(&chain(&base, &[&l2, &l1]), true));
    assert!(matches!(e, DiskError::WrongParent { .. }), "{e}");

    // Wrong base identity.
    let mut other = chain(&base, &[&l1, &l2]);
    other.base_identity = "sha256:another-base".into();
    let e = expect_err(Disk::open(&other, true));
    assert!(matches!(e, DiskError::WrongBase { .. }), "{e}");

    // A directory instead of a file, as base or as layer; a path that does not exist.
    let e = expect_err(Disk::open(&chain(&dir.0, &[&l1]), true));
    assert!(matches!(e, DiskError::NotAFile { .. }), "{e}");
    let e = expect_err(Disk::open(&chain(&base, &[&dir.0]), true));
    assert!(matches!(e, DiskError::NotAFile { .. }), "{e}");
    let e = expect_err(Disk::open(&chain(&base, &[&dir.0]), false));
    assert!(matches!(e, DiskError::NotAFile { .. }), "{e}");
    let e = expect_err(Disk::open(&chain(&base, &[&dir.join("missing")]), true));
    assert!(matches!(e, DiskError::Open { .. }), "{e}");

    // A disk smaller than its base.
    let big = dir.join("big.raw");
    std::fs::write(&big, vec![1u8; 64 * BS]).unwrap();
    let e = create_base_layer(&dir.join("small"), &big, ID, Some(16 * BLOCK_SIZE)).unwrap_err();
    assert!(matches!(e, DiskError::DiskTooSmall { .. }), "{e}");
    let e = expect_err(Disk::open(&chain(&big, &[&l1, &l2]), true));
    assert!(matches!(e, DiskError::DiskTooSmall { .. }), "{e}");
    // Sizes no disk has.
    for size in [0, 1000, MAX_DISK_SIZE + 512] {
        let e = create_base_layer(&dir.join("odd"), &base, ID, Some(size)).unwrap_err();
        assert!(matches!(e, DiskError::BadDiskSize { .. }), "{size}: {e}");
    }
    let e = create_base_layer(&dir.join("noid"), &base, "", None).unwrap_err();
    assert!(matches!(e, DiskError::BadBaseIdentity(_)), "{e}");

    // A frozen layer as the writable top; an unfrozen one under the top.
    let e = expect_err(Disk::open(&chain(&base, &[&l1]), false));
    assert!(matches!(e, DiskError::TopFrozen { .. }), "{e}");
    let l3 = dir.join("l3");
    create_layer(
        &l3,
        &LayerInfo::read(&l2)
            .map(|mut i| {
                i.frozen = true; // a caller lying about its parent: open still checks
                i
            })
            .unwrap(),
    )
    .unwrap();
    let e = expect_err(Disk::open(&chain(&base, &[&l1, &l2, &l3]), true));
    assert!(matches!(e, DiskError::NotFrozen { .. }), "{e}");
    // A writable disk needs a layer.
    let e = expect_err(Disk::open(&chain(&base, &[]), false));
    assert!(matches!(e, DiskError::NoLayers), "{e}");
    // Nothing here panicked, and every error says what it is about.
    assert!(e.to_string().contains("layer"));
}

#[test]
fn a_layer_has_one_writer() {
    let dir = TempDir::new("disk-lock");
    let base = make_base(&dir, 4 * BS);
    let l1 = dir.join("l1");
    let _writer = Disk::create(&base, ID, &l1, None).unwrap();
    let e = expect_err(Disk::open(&chain(&base, &[&l1]), false));
    assert!(matches!(e, DiskError::InUse { .. }), "{e}");
    let e = expect_err(Disk::open(&chain(&base, &[&l1]), true));
    assert!(matches!(e, DiskError::InUse { .. }), "readers too: {e}");
}

#[test]
fn compaction_merges_a_run_and_keeps_what_sits_on_it_valid() {
    let dir = TempDir::new("disk-compact");
    let base = make_base(&dir, 32 * BS);
    let paths: Vec<PathBuf> = (0..5).map(|i| dir.join(&format!("l{i}"))).collect();
    let mut disk = Disk::create(&base, ID, &paths[0], None).unwrap();
    let mut model: Vec<u8> = (0..32 * BS).map(pattern).collect();
    for (i, path) in paths[1..].iter().enumerate() {
        let v = i as u8 + 1;
        let at = i * BS + 10;
        disk.write(at as u64, &[v; BS]).unwrap();
        model[at..at + BS].fill(v);
        disk.write_zeroes((20 + i) as u64 * BLOCK_SIZE, BLOCK_SIZE)
            .unwrap();
        model[(20 + i) * BS..(21 + i) * BS].fill(0);
        disk.freeze(path).unwrap();
    }
    assert_eq!(disk.layers().len(), 5);
    let identity = disk.identity();

    // Offline: the four frozen layers into one file.
    let merged = dir.join("merged");
    let info = compact(&paths[..4], &merged).unwrap();
    assert_eq!(info.id, LayerInfo::read(&paths[3]).unwrap().id);
    assert!(info.frozen);
    assert!(info.parent.is_none());

    // Live: the same in the running disk; the top stays writable.
    let compacted = disk.compact_frozen(&dir.join("live")).unwrap();
    assert_eq!(compacted.replaced, paths[..4].to_vec());
    assert_eq!(disk.layers().len(), 2);
    assert_eq!(read_vec(&mut disk, 0, 32 * BS), model);
    assert!(disk.identity().same_content(&identity));
    disk.write(31 * BLOCK_SIZE, &[0xcc; BS]).unwrap();
    disk.flush().unwrap();
    drop(disk);

    // The old top (l4) opens on the merged file as it did on the run.
    let mut again = Disk::open(&chain(&base, &[&merged, &paths[4]]), false).unwrap();
    model[31 * BS..].fill(0xcc);
    assert_eq!(read_vec(&mut again, 0, 32 * BS), model);

    // Unfrozen or out-of-order runs are refused.
    assert!(matches!(
        compact(&[paths[1].clone(), paths[0].clone()], &dir.join("x")),
        Err(DiskError::WrongParent { .. })
    ));
    assert!(matches!(
        compact(&paths[..1], &dir.join("y")),
        Err(DiskError::NothingToCompact(_))
    ));
}

#[test]
fn vectored_io_spans_many_buffers() {
    let dir = TempDir::new("disk-vec");
    let base = make_base(&dir, 16 * BS);
    let mut disk = Disk::create(&base, ID, &dir.join("top"), None).unwrap();
    let mut a = vec![1u8; 1000];
    let mut b = vec![2u8; 3 * BS];
    let mut c = vec![3u8; 96];
    let mut bufs = IoVecs::default();
    bufs.push(a.as_mut_ptr(), a.len());
    bufs.push(b.as_mut_ptr(), b.len());
    bufs.push(c.as_mut_ptr(), c.len());
    // SAFETY: the buffers are live vectors, unused elsewhere during the call.
    unsafe { disk.write_vectored(512, &bufs).unwrap() };
    let got = read_vec(&mut disk, 0, 5 * BS);
    assert_eq!(got[511], pattern(511));
    assert!(got[512..1512].iter().all(|&x| x == 1));
    assert!(got[1512..1512 + 3 * BS].iter().all(|&x| x == 2));
    assert!(got[1512 + 3 * BS..1608 + 3 * BS].iter().all(|&x| x == 3));
    a.fill(0);
    b.fill(0);
    c.fill(0);
    // SAFETY: as above.
    unsafe { disk.read_vectored(512, &bufs).unwrap() };
    assert!(a.iter().all(|&x| x == 1) && b.iter().all(|&x| x == 2) && c.iter().all(|&x| x == 3));
}

/// xorshift64*: reproducible pseudo-random numbers for the model test.
struct Rand(u64);

impl Rand {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[test]
fn random_operations_match_a_model_across_freezes_reopens_and_compaction() {
    let dir = TempDir::new("disk-model");
    // A base that ends inside a block, under a disk that ends inside a block too.
    let base_len = 40 * BS + 1000;
    let base = make_base(&dir, base_len);
    let size = 48 * BLOCK_SIZE + 1536;
    let mut model: Vec<u8> = (0..size as usize)
        .map(|i| if i < base_len { pattern(i) } else { 0 })
        .collect();
    let mut layers = vec![dir.join("l0")];
    let mut disk = Disk::create(&base, ID, &layers[0], Some(size)).unwrap();
    let mut rng = Rand(0x9e37_79b9_7f4a_7c15);
    for step in 0..3000u32 {
        let offset = rng.below(size);
        let len = rng.below((size - offset).min(3 * BLOCK_SIZE) + 1);
        match rng.below(100) {
            0..=39 => {
                let byte = (step % 250) as u8 + 1;
                disk.write(offset, &vec![byte; len as usize]).unwrap();
                model[offset as usize..(offset + len) as usize].fill(byte);
            }
            40..=49 => {
                disk.write_zeroes(offset, len).unwrap();
                model[offset as usize..(offset + len) as usize].fill(0);
            }
            50..=51 => {
                let path = dir.join(&format!("l{step}"));
                disk.freeze(&path).unwrap();
                layers.push(path);
            }
            52 => {
                disk.flush().unwrap();
                drop(disk);
                let chain = Chain {
                    base: base.clone(),
                    base_identity: ID.into(),
                    layers: layers.clone(),
                };
                disk = Disk::open(&chain, false).unwrap();
            }
            53 if disk.layers().len() > 3 => {
                let out = dir.join(&format!("c{step}"));
                let done = disk.compact_frozen(&out).unwrap();
                let top = layers.pop().unwrap();
                layers = vec![out, top];
                assert!(done.replaced.len() >= 3);
            }
            _ => {
                let mut got = vec![0u8; len as usize];
                disk.read(offset, &mut got).unwrap();
                assert_eq!(
                    got,
                    &model[offset as usize..(offset + len) as usize],
                    "step {step}"
                );
            }
        }
    }
    let mut all = vec![0u8; size as usize];
    disk.read(0, &mut all).unwrap();
    assert_eq!(all, model);
}

/// Mark every block of the top as written without writing it (sparse data, fast to make).
fn fill_sparse(disk: &mut Disk, bytes: u64) {
    let top = disk.layers.len() - 1;
    let layer = &mut disk.layers[top];
    for block in 0..bytes / BLOCK_SIZE {
        layer.map.set(block, BlockState::Data);
    }
    layer.mark_written();
    disk.flush().unwrap();
}

#[test]
#[ignore = "micro-benchmark: cargo test -p mayfly-devices --release -- --ignored --nocapture disk_bench"]
fn disk_bench_freeze_and_fork() {
    let dir = TempDir::new("disk-bench");
    let base = dir.join("base.raw");
    let gib = 1u64 << 30;
    std::fs::File::create(&base).unwrap().set_len(gib).unwrap();
    let mut results = Vec::new();
    for (label, bytes) in [("10MiB", 10u64 << 20), ("1GiB", gib)] {
        let mut disk =
            Disk::create(&base, ID, &dir.join(&format!("{label}-l0")), Some(2 * gib)).unwrap();
        fill_sparse(&mut disk, bytes);
        // Some fresh writes too, so the freeze has data and a map to sync.
        for i in 0..16u64 {
            disk.write(i * 64 * BLOCK_SIZE, &[1; BS]).unwrap();
        }
        let mut times = Vec::new();
        for round in 0..5 {
            let start = Instant::now();
            disk.freeze(&dir.join(&format!("{label}-l{}", round + 1)))
                .unwrap();
            times.push(start.elapsed().as_secs_f64() * 1e3);
            disk.write(round * BLOCK_SIZE, &[2; BS]).unwrap();
        }
        times.sort_by(|a, b| a.partial_cmp(b).unwrap());
        results.push(format!(
            "{{\"what\":\"freeze\",\"data\":\"{label}\",\"median_ms\":{:.3},\"max_ms\":{:.3}}}",
            times[times.len() / 2],
            times[times.len() - 1]
        ));
        if bytes == gib {
            let frozen = disk.layers()[0].clone();
            let start = Instant::now();
            for i in 0..100 {
                create_layer(&dir.join(&format!("clone{i}")), &frozen).unwrap();
            }
            let total = start.elapsed().as_secs_f64() * 1e3;
            results.push(format!(
                "{{\"what\":\"fork\",\"clones\":100,\"total_ms\":{total:.3},\"per_clone_ms\":{:.3}}}",
                total / 100.0
            ));
            let start = Instant::now();
            let mut opened = Vec::new();
            for i in 0..100 {
                let mut layers = vec![frozen.path.clone()];
                layers.push(dir.join(&format!("clone{i}")));
                opened.push(
                    Disk::open(
                        &Chain {
                            base: base.clone(),
                            base_identity: ID.into(),
                            layers,
                        },
                        false,
                    )
                    .unwrap(),
                );
            }
            let total = start.elapsed().as_secs_f64() * 1e3;
            results.push(format!(
                "{{\"what\":\"open-clone-disk\",\"clones\":100,\"per_clone_ms\":{:.3}}}",
                total / 100.0
            ));
        }
    }
    println!("[{}]", results.join(","));
}
