//! The state file: `MAGIC | version u32 | header length u32 | header | body length u64 | body |
//! CRC-32 u32`, integers little-endian, header and body in bincode. The checksum covers every
//! byte before it, so a flipped bit anywhere is caught before anything is decoded.

use std::io::Write;
use std::path::Path;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

pub use crate::error::SnapshotError;
use crate::state::HostFingerprint;

pub const MAGIC: [u8; 8] = *b"MAYFLYSN";
/// Bumped whenever the encoding of the header or the state changes (the golden-file test in
/// `state.rs` fails when it changes without a bump).
pub const FORMAT_VERSION: u32 = 5;
/// Decoding never allocates beyond this, whatever a damaged length field says: no more than
/// the largest state file holds.
#[allow(clippy::cast_possible_truncation)] // 64 MiB: a u64 constant that fits any usize here.
const DECODE_LIMIT: usize = crate::open::MAX_STATE_BYTES as usize;

/// What a snapshot was taken on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    pub arch: String,
    pub fingerprint: HostFingerprint,
    /// Wall-clock time of the snapshot, milliseconds since the Unix epoch.
    pub created_unix_ms: u64,
    /// The mayfly version that wrote it.
    pub writer: String,
}

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<DECODE_LIMIT>()
}

/// Encode a state file in memory.
pub fn encode<B: Serialize>(header: &Header, body: &B) -> Result<Vec<u8>, SnapshotError> {
    let enc = |e: bincode::error::EncodeError| SnapshotError::Encode(e.to_string());
    let header = bincode::serde::encode_to_vec(header, config()).map_err(enc)?;
    let body = bincode::serde::encode_to_vec(body, config()).map_err(enc)?;
    let mut out = Vec::with_capacity(8 + 4 + 4 + header.len() + 8 + body.len() + 4);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    let header_len = u32::try_from(header.len())
        .map_err(|_| SnapshotError::Encode(format!("a {} byte header", header.len())))?;
    out.extend_from_slice(&header_len.to_le_bytes());
    out.extend_from_slice(&header);
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(&body);
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    Ok(out)
}

/// Decode a state file read from `path` (named in errors).
pub fn decode<B: DeserializeOwned>(bytes: &[u8], path: &str) -> Result<(Header, B), SnapshotError> {
    let truncated = || SnapshotError::Truncated {
        path: path.to_string(),
    };
    if bytes.len() < MAGIC.len() || bytes[..MAGIC.len()] != MAGIC {
        return Err(if MAGIC.starts_with(bytes) && !bytes.is_empty() {
            truncated()
        } else {
            SnapshotError::NotASnapshot {
                path: path.to_string(),
            }
        });
    }
    let u32_at = |at: usize| -> Result<u32, SnapshotError> {
        let end = at.checked_add(4).ok_or_else(truncated)?;
        let b = bytes.get(at..end).ok_or_else(truncated)?;
        Ok(u32::from_le_bytes(b.try_into().expect("4 bytes")))
    };
    let version = u32_at(8)?;
    if version != FORMAT_VERSION {
        return Err(SnapshotError::Version {
            path: path.to_string(),
            found: version,
            supported: FORMAT_VERSION,
        });
    }
    let header_len = u32_at(12)? as usize;
    let header_start = 16usize;
    let body_len_at = header_start.checked_add(header_len).ok_or_else(truncated)?;
    let body_len = bytes
        .get(body_len_at..body_len_at + 8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
        .ok_or_else(truncated)?;
    let body_start = body_len_at + 8;
    let body_end = usize::try_from(body_len)
        .ok()
        .and_then(|l| body_start.checked_add(l))
        .ok_or_else(truncated)?;
    let stored = u32_at(body_end)?;
    if bytes.len() > body_end + 4 {
        return Err(SnapshotError::Decode {
            path: path.to_string(),
            what: "the file's length",
            reason: format!("{} bytes follow the checksum", bytes.len() - body_end - 4),
        });
    }
    let computed = crc32fast::hash(&bytes[..body_end]);
    if stored != computed {
        return Err(SnapshotError::Checksum {
            path: path.to_string(),
            stored,
            computed,
        });
    }
    let decode_err = |what| {
        move |e: bincode::error::DecodeError| SnapshotError::Decode {
            path: path.to_string(),
            what,
            reason: e.to_string(),
        }
    };
    let (header, _) =
        bincode::serde::decode_from_slice(&bytes[header_start..body_len_at], config())
            .map_err(decode_err("the header"))?;
    let (body, _) = bincode::serde::decode_from_slice(&bytes[body_start..body_end], config())
        .map_err(decode_err("the VM state"))?;
    Ok((header, body))
}

/// Write a state file and fsync it. The caller makes the snapshot directory crash-safe (a
/// temporary directory renamed into place).
pub fn write_state_file<B: Serialize>(
    path: &Path,
    header: &Header,
    body: &B,
) -> Result<(), SnapshotError> {
    let bytes = encode(header, body)?;
    let err = |source| SnapshotError::Write {
        path: path.display().to_string(),
        source,
    };
    let mut file = std::fs::File::create(path).map_err(err)?;
    file.write_all(&bytes).map_err(err)?;
    file.sync_all().map_err(err)
}

/// Read and decode a state file at `path`, which must be a regular file of at most
/// [`crate::open::MAX_STATE_BYTES`].
pub fn read_state_file<B: DeserializeOwned>(path: &Path) -> Result<(Header, B), SnapshotError> {
    let file = crate::open::open_regular(path)?;
    read_state(&file, path)
}

/// Read and decode an open state file (named `shown` in errors).
pub fn read_state<B: DeserializeOwned>(
    file: &std::fs::File,
    shown: &Path,
) -> Result<(Header, B), SnapshotError> {
    let bytes = crate::open::read_capped(file, shown)?;
    decode(&bytes, &shown.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Body {
        numbers: Vec<u64>,
        name: String,
    }

    fn header() -> Header {
        Header {
            arch: "x86_64".into(),
            fingerprint: HostFingerprint::default(),
            created_unix_ms: 1,
            writer: "test".into(),
        }
    }

    fn sample() -> (Vec<u8>, Body) {
        let body = Body {
            numbers: (0..100).collect(),
            name: "vm".into(),
        };
        (encode(&header(), &body).unwrap(), body)
    }

    #[test]
    fn round_trip() {
        let (bytes, body) = sample();
        let (h, b): (Header, Body) = decode(&bytes, "s").unwrap();
        assert_eq!(h, header());
        assert_eq!(b, body);
    }

    #[test]
    fn every_flipped_byte_is_caught() {
        let (bytes, _) = sample();
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x40;
            assert!(
                decode::<Body>(&bad, "s").is_err(),
                "flip at byte {i} went unnoticed"
            );
        }
    }

    #[test]
    fn every_truncation_is_caught() {
        let (bytes, _) = sample();
        for len in 0..bytes.len() {
            let err = decode::<Body>(&bytes[..len], "s").unwrap_err();
            assert!(
                matches!(
                    err,
                    SnapshotError::Truncated { .. }
                        | SnapshotError::NotASnapshot { .. }
                        | SnapshotError::Checksum { .. }
                ),
                "length {len}: {err}"
            );
        }
    }

    #[test]
    fn errors_name_the_problem() {
        let (mut bytes, _) = sample();
        bytes[8] = 99;
        let err = decode::<Body>(&bytes, "s").unwrap_err();
        assert!(
            matches!(err, SnapshotError::Version { found: 99, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("version 99"));

        let err = decode::<Body>(b"hello, this is not a snapshot", "s").unwrap_err();
        assert!(matches!(err, SnapshotError::NotASnapshot { .. }));

        let (mut bytes, _) = sample();
        let last = bytes.len() - 10;
        bytes[last] ^= 1;
        let err = decode::<Body>(&bytes, "s").unwrap_err();
        assert!(err.to_string().contains("corrupted"), "{err}");
    }

    #[test]
    fn trailing_garbage_is_rejected() {
        let (mut bytes, _) = sample();
        bytes.push(0);
        assert!(decode::<Body>(&bytes, "s").is_err());
    }
}
