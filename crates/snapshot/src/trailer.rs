//! The memory file's trailer: one page after guest RAM that names the snapshot the memory
//! belongs to. The state file records the same random snapshot ID, so a restore can tell that
//! its two files were written together (and not, say, one snapshot's state beside another's
//! memory after a copy or a race).

use std::fs::File;
use std::os::unix::fs::FileExt;

use crate::error::SnapshotError;

/// Bytes the trailer takes at the end of the memory file (one page, so RAM stays page-aligned
/// before it and a mapping of RAM never covers it).
pub const TRAILER_BYTES: u64 = 4096;
const MAGIC: [u8; 8] = *b"MAYFLYMT";
const VERSION: u32 = 1;
/// magic, version, reserved, snapshot ID, RAM bytes, CRC-32 of what precedes it.
const USED: usize = 8 + 4 + 4 + 16 + 8 + 4;

fn encode(mem_bytes: u64, id: &[u8; 16]) -> [u8; USED] {
    let mut out = [0u8; USED];
    out[..8].copy_from_slice(&MAGIC);
    out[8..12].copy_from_slice(&VERSION.to_le_bytes());
    out[16..32].copy_from_slice(id);
    out[32..40].copy_from_slice(&mem_bytes.to_le_bytes());
    let crc = crc32fast::hash(&out[..40]);
    out[40..44].copy_from_slice(&crc.to_le_bytes());
    out
}

/// Write the trailer after `mem_bytes` of RAM; the file becomes `mem_bytes + TRAILER_BYTES`
/// long. Guest RAM before it is left as it is.
pub fn write_trailer(file: &File, mem_bytes: u64, id: &[u8; 16]) -> std::io::Result<()> {
    file.set_len(mem_bytes + TRAILER_BYTES)?;
    file.write_all_at(&encode(mem_bytes, id), mem_bytes)
}

/// The memory file's expected length for `mem_bytes` of RAM.
pub fn memory_file_len(mem_bytes: u64) -> Option<u64> {
    mem_bytes.checked_add(TRAILER_BYTES)
}

/// Check that `file` is the memory of the snapshot `id` with `mem_bytes` of RAM.
pub fn check_trailer(
    file: &File,
    mem_bytes: u64,
    id: &[u8; 16],
    shown: &str,
) -> Result<(), SnapshotError> {
    let mismatch = |reason: String| SnapshotError::MemoryMismatch {
        path: shown.to_string(),
        reason,
    };
    let expected = memory_file_len(mem_bytes)
        .ok_or_else(|| mismatch(format!("{mem_bytes} bytes of RAM overflow")))?;
    let len = file
        .metadata()
        .map_err(|source| SnapshotError::Read {
            path: shown.to_string(),
            source,
        })?
        .len();
    if len != expected {
        return Err(mismatch(format!(
            "it is {len} bytes, but this snapshot's memory is {expected} ({mem_bytes} of RAM and a {TRAILER_BYTES}-byte trailer): it is truncated or belongs to another snapshot"
        )));
    }
    let mut found = [0u8; USED];
    file.read_exact_at(&mut found, mem_bytes)
        .map_err(|source| SnapshotError::Read {
            path: shown.to_string(),
            source,
        })?;
    if found[..8] != MAGIC {
        return Err(mismatch(
            "it has no mayfly memory trailer: it is not a mayfly memory file".into(),
        ));
    }
    if found != encode(mem_bytes, id) {
        return Err(mismatch(
            "its trailer names another snapshot: the state and memory files were not written together".into(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trailer_ties_memory_to_its_snapshot() {
        let path = std::env::temp_dir().join(format!("mayfly-trailer-{}", std::process::id()));
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        let id = [7u8; 16];
        write_trailer(&file, 1 << 20, &id).unwrap();
        assert_eq!(file.metadata().unwrap().len(), (1 << 20) + TRAILER_BYTES);
        check_trailer(&file, 1 << 20, &id, "m").unwrap();
        let err = check_trailer(&file, 1 << 20, &[8u8; 16], "m").unwrap_err();
        assert!(err.to_string().contains("another snapshot"), "{err}");
        let err = check_trailer(&file, 2 << 20, &id, "m").unwrap_err();
        assert!(err.to_string().contains("truncated"), "{err}");
        file.set_len(1 << 20).unwrap();
        assert!(check_trailer(&file, 1 << 20, &id, "m").is_err());
        std::fs::remove_file(&path).unwrap();
    }
}
