//! Disk layer benchmark, on this machine (no guest: the layer code itself, as a snapshot and
//! a fork run it in the VMM).
//!
//! For each amount of scratch data (default 10 MiB and 1 GiB): a disk on a sparse base gets
//! that much written into its top layer and flushed (as a guest's `sync` would), then
//! - **snapshot**: freeze the top (flush + mark frozen + stack a new empty top) and hard-link
//!   the frozen chain into a snapshot directory, with the directory fsynced: what
//!   `vmm/src/snapshot.rs` adds for a disk;
//! - **fork**: for each of N clones, a new layer on the frozen chain and the clone's disk opened
//!   on it (every layer's header and map read and checked): what each clone's restore does.
//!
//! Also reported: the write and flush of the scratch data itself (what the guest pays, not the
//! snapshot). Targets (issue "Disks"): disk snapshot <= 5 ms and disk fork <= 1 ms per clone,
//! at either size.
// Lossy `as` casts are refused here (tests aside): every conversion that can lose bits says
// why it cannot.
#![cfg_attr(
    not(test),
    warn(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_possible_wrap
    )
)]

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Parser;
use mayfly_benches::{emit_report, Machine, Stats};
use mayfly_devices::disk::{create_layer, Chain, Disk};
use serde::Serialize;

#[derive(Parser)]
#[command(about = "Benchmark mayfly's disk layers: snapshot (freeze + link) and fork")]
struct Args {
    /// MiB of scratch data in the layer before the snapshot.
    #[arg(long, value_delimiter = ',', default_value = "10,1024")]
    data_mib: Vec<u64>,
    /// Measured snapshots per size (each on a freshly written disk).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Clones per fork.
    #[arg(long, default_value_t = 100)]
    clones: usize,
    /// Where the files go (a real file system, not tmpfs, to measure fsync honestly).
    #[arg(long, default_value = "target/disk-bench")]
    dir: PathBuf,
    /// Write the JSON report here instead of stdout.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Serialize)]
struct SizeReport {
    data_mib: u64,
    /// Writing the data into the top layer (page cache), MiB/s.
    write_mib_s: Stats,
    /// The guest's flush of it (fdatasync of data, then map), ms.
    flush_ms: Stats,
    /// Freeze of the flushed top, ms.
    freeze_ms: Stats,
    /// Hard links of the chain into the snapshot directory + its fsync, ms.
    link_ms: Stats,
    /// Freeze + link: the disk's part of a snapshot, ms. Target <= 5.
    snapshot_ms: Stats,
    /// Per clone: its layer created and its disk opened on the chain, ms. Target <= 1.
    fork_per_clone_ms: Stats,
}

#[derive(Serialize)]
struct Report {
    bench: &'static str,
    machine: Machine,
    clones: usize,
    sizes: Vec<SizeReport>,
}

fn ms_since(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1e3
}

fn sync_dir(dir: &Path) {
    std::fs::File::open(dir).unwrap().sync_all().unwrap();
}

fn main() {
    let args = Args::parse();
    let _ = std::fs::remove_dir_all(&args.dir);
    std::fs::create_dir_all(&args.dir).unwrap();
    let dir = std::path::absolute(&args.dir).unwrap();
    // A sparse 2 GiB base: reads of unwritten blocks come from it, writes never go to it.
    let base = dir.join("base.img");
    std::fs::File::create(&base)
        .unwrap()
        .set_len(2 << 30)
        .unwrap();
    let identity = "sha256:disk-bench";
    let chunk: Vec<u8> = (0..1 << 20)
        .map(|i: u32| (i % 253).to_le_bytes()[0] | 1)
        .collect();
    let mut sizes = Vec::new();
    for &mib in &args.data_mib {
        let (mut write, mut flush, mut freeze, mut link, mut snapshot, mut fork) =
            (vec![], vec![], vec![], vec![], vec![], vec![]);
        for run in 0..args.runs {
            let run_dir = dir.join(format!("{mib}-{run}"));
            std::fs::create_dir_all(&run_dir).unwrap();
            let mut disk =
                Disk::create(&base, identity, &run_dir.join("top-0.layer"), None).unwrap();
            let start = Instant::now();
            for i in 0..mib {
                disk.write(i << 20, &chunk).unwrap();
            }
            write.push(mib as f64 / start.elapsed().as_secs_f64());
            let start = Instant::now();
            disk.flush().unwrap();
            flush.push(ms_since(start));

            // The snapshot's part.
            let snap = run_dir.join("snap/disks");
            std::fs::create_dir_all(&snap).unwrap();
            let start = Instant::now();
            disk.freeze(&run_dir.join("top-1.layer")).unwrap();
            let frozen_ms = ms_since(start);
            let chain = disk.saved_chain();
            let linked = Instant::now();
            for layer in &chain.layers {
                std::fs::hard_link(layer, snap.join(layer.file_name().unwrap())).unwrap();
            }
            sync_dir(&snap);
            let link_ms = ms_since(linked);
            freeze.push(frozen_ms);
            link.push(link_ms);
            snapshot.push(frozen_ms + link_ms);

            // The fork's part, per clone (only on the first run: the chain is the same).
            if run == 0 {
                let frozen = mayfly_devices::disk::LayerInfo::read(&chain.layers[0]).unwrap();
                let mut clones = Vec::with_capacity(args.clones);
                for c in 0..args.clones {
                    let start = Instant::now();
                    let top = run_dir.join(format!("clone-{c}.layer"));
                    create_layer(&top, &frozen).unwrap();
                    let mut layers = chain.layers.clone();
                    layers.push(top);
                    let clone = Disk::open(
                        &Chain {
                            base: base.clone(),
                            base_identity: identity.into(),
                            layers,
                        },
                        false,
                    )
                    .unwrap();
                    fork.push(ms_since(start));
                    clones.push(clone);
                }
                // The clones read what the parent wrote (a sanity check, not timed).
                let mut buf = vec![0u8; 4096];
                clones[0].read(0, &mut buf).unwrap();
                assert_eq!(&buf[..], &chunk[..4096]);
            }
            drop(disk);
            let _ = std::fs::remove_dir_all(&run_dir);
        }
        let stats = |v: &[f64]| Stats::of(v).expect("at least one run");
        let report = SizeReport {
            data_mib: mib,
            write_mib_s: stats(&write),
            flush_ms: stats(&flush),
            freeze_ms: stats(&freeze),
            link_ms: stats(&link),
            snapshot_ms: stats(&snapshot),
            fork_per_clone_ms: stats(&fork),
        };
        eprintln!(
            "disk bench: {mib} MiB: snapshot {:.2} ms (freeze {:.2} + link {:.2}), fork {:.3} ms per clone; flush {:.0} ms",
            report.snapshot_ms.median,
            report.freeze_ms.median,
            report.link_ms.median,
            report.fork_per_clone_ms.median,
            report.flush_ms.median
        );
        sizes.push(report);
    }
    let _ = std::fs::remove_dir_all(&dir);
    emit_report(
        "disk",
        &Report {
            bench: "disk",
            machine: Machine::describe(),
            clones: args.clones,
            sizes,
        },
        args.out.as_deref(),
    );
}
