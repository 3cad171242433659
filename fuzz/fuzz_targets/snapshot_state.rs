//! A snapshot's state file, as `mayfly restore` reads it: the framing (magic, version,
//! lengths, checksum), the header and VM state decoders, and the checks a restore makes
//! before it creates anything. The file is untrusted: a snapshot directory may come from
//! anywhere, and it must be refused with an error, never a panic or an allocation it asked for.
//!
//! Input: the raw bytes are decoded as a file; then the same bytes, split in two by their
//! first two bytes, are framed as a well-formed file (right magic, version, lengths and
//! checksum) holding that header and body, so the fuzzer reaches the decoders behind the
//! checksum it could never guess.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mayfly_snapshot::file::{decode, MAGIC};
use mayfly_snapshot::{VmState, FORMAT_VERSION};

/// Host memory the checks compare the snapshot's RAM with (MiB).
const HOST_MIB: u64 = 24 << 10;

fn framed(header: &[u8], body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(header.len() + body.len() + 32);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(
        &u32::try_from(header.len())
            .unwrap_or(u32::MAX)
            .to_le_bytes(),
    );
    out.extend_from_slice(header);
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(body);
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

fn check(bytes: &[u8]) {
    if let Ok((_header, state)) = decode::<VmState>(bytes, "fuzz/state") {
        let _ = mayfly_vmm::persist::restore::check_state(&state, HOST_MIB);
    }
}

fuzz_target!(|data: &[u8]| {
    check(data);
    if data.len() >= 2 {
        let rest = &data[2..];
        let split = (usize::from(data[0]) << 8 | usize::from(data[1])).min(rest.len());
        let (header, body) = rest.split_at(split);
        check(&framed(header, body));
    }
});
