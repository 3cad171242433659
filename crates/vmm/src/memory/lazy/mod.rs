//! Lazy restore of guest RAM with userfaultfd.
//!
//! A lazily restored VM runs before its memory is loaded. Guest RAM is private anonymous memory
//! registered with a userfaultfd (MISSING mode): the first touch of a page, by a vCPU inside KVM
//! or by the VMM itself, waits while a handler thread copies the aligned block around it from
//! the snapshot's memory file. Meanwhile the handler loads the blocks listed in
//! [`LazyOptions::prefetch`] (the working set a previous run recorded with
//! [`LazyMemory::working_set`]), and [`LazyMemory::populate_all`] finishes the load.
//!
//! What the guest sees:
//! - holes of the sparse memory file, the bytes past its end and blocks of zeros are mapped as
//!   the shared zero page (`UFFDIO_ZEROPAGE`): no copy and no memory until written;
//! - pages the VMM discards later (`MADV_DONTNEED`, e.g. a balloon) read as zero afterwards, as
//!   they would without userfaultfd: their bytes in the file are stale from then on.
//!
//! Block size, measured here (2 vCPUs of a nested KVM host, one thread touching one byte per
//! page of 128 MiB, `cargo test --release -p mayfly-vmm lazy::tests::bench -- --ignored
//! --nocapture`; 2-3 runs, µs per page touched, memory file in the page cache / not):
//!
//! | block  | sequential    | random, all   | random, 10%   | random, 1%        | populate_all |
//! |--------|---------------|---------------|---------------|-------------------|--------------|
//! | 4 KiB  | 7.6-8.3* / 8  | 7.7-8 / 53-60 | 8 / 80-92     | 8 / 56-106        | 2.7 / 8-11   |
//! | 64 KiB | 1.5 / 1.8-2.0 | 1.5 / 7.7-9.5 | 12 / 66-90    | 22-23 / 128-159   | 1.1 / 1.4    |
//! | 2 MiB  | 1.1 / 1.6-1.8 | 1.1 / 4.5-5.7 | 10-14 / 47-58 | 103-109 / 420-536 | 1.0 / 1.6-4  |
//!
//! (*) 45 µs in some runs: a 4 KiB fault costs mostly the wake-up, which is dear across CPUs.
//! 64 KiB is the default: 5x faster than 4 KiB when the guest touches much of its memory (and
//! each fault of a KVM guest costs ~70 µs more than these host-thread faults), within 1.4x of
//! 2 MiB, while a sparse guest pays 4x less than with 2 MiB, loads and keeps far less memory
//! it never uses, and a fault waits for one 64 KiB copy (~25 µs cached) where a 2 MiB block
//! stalls the vCPU ~0.5 ms (~2.5 ms with the file not cached).
//!
//! Reading the file: `pread` into a reused buffer, then `UFFDIO_COPY` from it. Copying straight
//! from a read-only mapping of the file saves a copy and was 5-15% faster with the file cached
//! and the guest touching everything, but 3-6x slower for sparse access to a file not cached
//! (each fault reads around the page through the mapping) and sometimes slower cached (the
//! kernel retries UFFDIO_COPY when the source page is not mapped yet); a mapping would also turn
//! a file truncated under us into SIGBUS for the zero checks here. So only the benchmark maps.

mod handler;
mod layout;
mod options;
mod serve;
mod shared;
mod start;

pub use options::{LazyError, LazyOptions};
pub use start::{start, LazyMemory};

#[cfg(test)]
mod tests;
