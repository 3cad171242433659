//! A disk layer file, as `mayfly run --disk` and a restore open it: the header (magic,
//! version, geometry, IDs, base identity, checksum), the block map, and reads through the
//! chain. A layer file may come from anywhere (a snapshot someone handed over, a file the
//! guest's owner can write): a bad one is refused with an error, never a panic, a hang or an
//! allocation its header asked for.
//!
//! Input: rounds of (offset, length, bytes) patched into a valid layer file (made once per
//! process, with some blocks written); the first byte's low bit says whether the header's
//! checksum is then recomputed, so the fuzzer also gets past it. The patched file is opened
//! as the top of a read-only chain and read at offsets the input's last bytes pick.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use mayfly_devices::disk::{Chain, Disk, LayerInfo, BLOCK_BYTES};

const BASE_ID: &str = "sha256:fuzz-layer";
const DISK_BYTES: usize = 1 << 20;
/// Where the header's checksum sits (the format's last 8 bytes of its 4 KiB header).
const HEADER: usize = 4096;

struct Files {
    dir: PathBuf,
    /// The valid layer's bytes.
    layer: Vec<u8>,
}

fn files() -> &'static Files {
    static FILES: OnceLock<Files> = OnceLock::new();
    FILES.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("mayfly-fuzz-layer-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the fuzz scratch directory");
        let base: Vec<u8> = (0..DISK_BYTES)
            .map(|i| (i / 512).to_le_bytes()[0])
            .collect();
        std::fs::write(dir.join("base.raw"), base).expect("write the base");
        let top = dir.join("valid");
        let mut disk = Disk::create(&dir.join("base.raw"), BASE_ID, &top, None).expect("a disk");
        for block in [0u64, 3, 17, 100] {
            disk.write(block * BLOCK_BYTES as u64, &[0xa5; 4096])
                .expect("a write");
        }
        disk.flush().expect("a flush");
        drop(disk);
        let layer = std::fs::read(&top).expect("read the layer back");
        Files { dir, layer }
    })
}

/// The format's header checksum (FNV-1a over the header before it).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &b| {
        (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fuzz_target!(|data: &[u8]| {
    let files = files();
    let Some((&mode, mut rest)) = data.split_first() else {
        return;
    };
    let mut layer = files.layer.clone();
    // Patches: up to 32 of (u16 offset, u8 length, bytes), into the header and the map.
    for _ in 0..32 {
        if rest.len() < 3 {
            break;
        }
        let at = usize::from(u16::from_le_bytes([rest[0], rest[1]])) % layer.len();
        let len = usize::from(rest[2]).min(rest.len() - 3);
        let end = (at + len).min(layer.len());
        layer[at..end].copy_from_slice(&rest[3..3 + (end - at)]);
        rest = &rest[3 + len..];
    }
    if mode & 1 == 1 && layer.len() >= HEADER {
        let sum = fnv1a(&layer[..HEADER - 8]);
        layer[HEADER - 8..HEADER].copy_from_slice(&sum.to_le_bytes());
    }
    if mode & 2 == 2 {
        // A truncated file.
        let keep = usize::from(rest.first().copied().unwrap_or(0)) * 64;
        layer.truncate(keep.min(layer.len()));
    }
    let path = files.dir.join("fuzzed");
    std::fs::write(&path, &layer).expect("write the fuzzed layer");
    let _ = LayerInfo::read(&path);
    let chain = Chain {
        base: files.dir.join("base.raw"),
        base_identity: BASE_ID.into(),
        layers: vec![path],
    };
    if let Ok(mut disk) = Disk::open(&chain, true) {
        let _ = disk.identity();
        let _ = disk.layers();
        let size = disk.size();
        let mut buf = vec![0u8; 2 * BLOCK_BYTES];
        for pick in rest.chunks(2).take(8) {
            let at = u64::from(pick[0]) * 4096 + u64::from(*pick.get(1).unwrap_or(&0)) * 7;
            if at < size {
                let n = buf
                    .len()
                    .min(usize::try_from(size - at).unwrap_or(usize::MAX));
                let _ = disk.read(at, &mut buf[..n]);
            }
        }
    }
});
