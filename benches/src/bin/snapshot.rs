//! Snapshot and restore benchmark.
//!
//! For each guest size: boot the default guest with a control socket and some data in its
//! tmpfs, then
//! - snapshot it repeatedly: pause (request to answer), state, memory and total times;
//! - restore it in every memory mode (cow, lazy without and with prefetch, eager), split into
//!   phases from `mayfly restore --trace` (process start, state loaded, memory mapped, VM
//!   created, vCPUs restored and started, first KVM_RUN) and, seen from outside, the first
//!   guest output and "time to useful": a command typed at launch answered on the console;
//! - restore the snapshot three times at once (cow) and measure each VMM's PSS.
//!
//! Baseline in the same run: a cold boot of the same guest to the same command's answer.
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

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use mayfly_api as api;
use mayfly_benches::{
    emit_report, monotonic_ns, ms_between as ms, smaps_memory, trace_events, Machine, MemoryUse,
    Stats,
};
use mayfly_tests::guest::{Guest, TestDir};
use serde::Serialize;

#[derive(Parser)]
#[command(about = "Benchmark mayfly's snapshot and restore")]
struct Args {
    /// Measured runs of each operation.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Guest sizes in MiB.
    #[arg(long, value_delimiter = ',', default_value = "128,1024")]
    mem_mib: Vec<u64>,
    /// MiB of data the guest writes to its tmpfs before the snapshot.
    #[arg(long, default_value_t = 16)]
    data_mib: u64,
    /// Write the JSON report here instead of stdout.
    #[arg(long)]
    out: Option<PathBuf>,
}

const TIMEOUT: Duration = Duration::from_secs(120);
const USEFUL_COMMAND: &str = "echo use''ful-$((40+2))\n";
const USEFUL_ANSWER: &str = "useful-42";

fn request(
    sock: &Path,
    method: &str,
    path: &str,
    body: Option<serde_json::Value>,
) -> (f64, serde_json::Value) {
    let start = monotonic_ns();
    let (status, answer) = api::request(sock, method, path, body.as_ref())
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    assert!(
        (200..300).contains(&status),
        "{method} {path}: HTTP {status} {answer}"
    );
    (ms(start, monotonic_ns()), answer)
}

#[derive(Default, Serialize)]
struct SnapshotTimes {
    pause_ms: Vec<f64>,
    state_ms: Vec<f64>,
    memory_ms: Vec<f64>,
    total_ms: Vec<f64>,
    resume_ms: Vec<f64>,
    memory_bytes_written: u64,
}

/// Boot a guest with data in its tmpfs; returns it, its socket and a snapshot of it.
fn prepare(
    dir: &TestDir,
    mem_mib: u64,
    data_mib: u64,
    runs: usize,
) -> (Guest, PathBuf, SnapshotTimes) {
    let sock = dir.join("boot.sock");
    let mut guest = Guest::start(&[
        "run",
        "--mem-mib",
        &mem_mib.to_string(),
        "--api-sock",
        &sock.to_string_lossy(),
    ]);
    guest.expect_ready();
    guest.run(&format!(
        "dd if=/dev/urandom of=/tmp/data bs=1M count={data_mib} 2>/dev/null; sync"
    ));
    let mut times = SnapshotTimes::default();
    let snap = dir.join("snap");
    for _ in 0..runs {
        let (pause, _) = request(&sock, "PUT", "/vm/pause", None);
        let (_, report) = request(
            &sock,
            "PUT",
            "/vm/snapshot",
            Some(serde_json::json!({ "path": snap })),
        );
        let (resume, _) = request(&sock, "PUT", "/vm/resume", None);
        times.pause_ms.push(pause);
        times
            .state_ms
            .push(report["state_ms"].as_f64().unwrap_or(0.0));
        times
            .memory_ms
            .push(report["memory_ms"].as_f64().unwrap_or(0.0));
        times
            .total_ms
            .push(report["total_ms"].as_f64().unwrap_or(0.0));
        times.resume_ms.push(resume);
        times.memory_bytes_written = report["memory_bytes_written"].as_u64().unwrap_or(0);
        // Let the guest run a little between snapshots, as it would.
        guest.run("true");
    }
    (guest, snap, times)
}

struct Restore {
    events: BTreeMap<String, u64>,
}

/// One restore: launch, type the command at once, wait for its answer.
fn restore_once(snap: &Path, mode: &str, extra: &[&str]) -> (Restore, Guest) {
    let launch = monotonic_ns();
    let snap = snap.to_string_lossy();
    let mut args = vec!["restore", &snap, "--memory", mode, "--trace"];
    args.extend_from_slice(extra);
    let mut guest = Guest::start(&args);
    guest.send(USEFUL_COMMAND);
    assert!(
        guest.wait_any_output(TIMEOUT),
        "no output from the restored guest: {}",
        guest.stderr()
    );
    let first_output = monotonic_ns();
    guest.expect(USEFUL_ANSWER, TIMEOUT);
    let useful = monotonic_ns();
    let mut events = trace_events(&guest.stderr());
    events.insert("launch".into(), launch);
    events.insert("first_output".into(), first_output);
    events.insert("useful".into(), useful);
    (Restore { events }, guest)
}

const PHASES: [(&str, &str, &str); 9] = [
    ("process_start", "launch", "main"),
    ("state_load", "main", "state_loaded"),
    ("memory_map", "state_loaded", "memory_mapped"),
    ("kvm_setup", "memory_mapped", "vcpus_restored"),
    ("vcpu_start", "vcpus_restored", "first_kvm_run"),
    ("launch_to_running", "launch", "first_kvm_run"),
    (
        "first_kvm_run_to_first_output",
        "first_kvm_run",
        "first_output",
    ),
    ("launch_to_first_output", "launch", "first_output"),
    ("launch_to_useful", "launch", "useful"),
];

#[derive(Serialize)]
struct ModeReport {
    mode: String,
    phases_ms: BTreeMap<String, Stats>,
}

fn phases(runs: &[Restore]) -> BTreeMap<String, Stats> {
    let mut out = BTreeMap::new();
    for (name, from, to) in PHASES {
        let samples: Vec<f64> = runs
            .iter()
            .filter_map(|r| Some(ms(*r.events.get(from)?, *r.events.get(to)?)))
            .collect();
        if let Some(stats) = Stats::of(&samples) {
            out.insert(name.to_string(), stats);
        }
    }
    out
}

#[derive(Serialize)]
struct SizeReport {
    mem_mib: u64,
    data_mib: u64,
    snapshot: SnapshotStats,
    restore: Vec<ModeReport>,
    /// Cold boot of the same guest to the same command's answer, in the same run.
    baseline_boot_to_useful_ms: Stats,
    /// Median launch-to-useful of each mode divided by the cold boot's.
    restore_to_boot_ratio: BTreeMap<String, f64>,
    three_cow_restores: ConcurrentReport,
}

#[derive(Serialize)]
struct SnapshotStats {
    pause_ms: Stats,
    state_ms: Stats,
    memory_ms: Stats,
    total_ms: Stats,
    resume_ms: Stats,
    memory_bytes_written: u64,
}

#[derive(Serialize)]
struct ConcurrentReport {
    /// Each VMM process's PSS and RSS (guest RAM included), KiB.
    per_vm: Vec<MemoryUse>,
    /// The part of each that is guest RAM (the memory file's mapping).
    guest_ram: Vec<MemoryUse>,
    pss_per_vm_kib_median: f64,
}

fn stats(samples: &[f64]) -> Stats {
    Stats::of(samples).expect("at least one sample")
}

fn boot_to_useful(mem_mib: u64) -> f64 {
    let launch = monotonic_ns();
    let mut guest = Guest::start(&["run", "--mem-mib", &mem_mib.to_string()]);
    // Typed once the shell is up: a booting guest's UART drops what arrives early.
    guest.expect_ready();
    guest.send(USEFUL_COMMAND);
    guest.expect(USEFUL_ANSWER, TIMEOUT);
    let elapsed = ms(launch, monotonic_ns());
    guest.signal(libc::SIGKILL);
    guest.wait_exit(TIMEOUT);
    elapsed
}

fn bench_size(mem_mib: u64, args: &Args) -> SizeReport {
    let dir = TestDir::new(&format!("bench-snapshot-{mem_mib}"));
    eprintln!(
        "snapshot bench: {mem_mib} MiB guest, {} MiB of data",
        args.data_mib
    );
    let (mut booted, snap, times) = prepare(&dir, mem_mib, args.data_mib, args.runs);
    booted.signal(libc::SIGKILL);
    booted.wait_exit(TIMEOUT);

    // A snapshot whose working set was recorded by a lazy restore answering the command.
    let ws_sock = dir.join("ws.sock");
    let ws_snap = dir.join("snap-ws");
    {
        let (_, mut guest) = restore_once(
            &snap,
            "lazy",
            &["--no-prefetch", "--api-sock", &ws_sock.to_string_lossy()],
        );
        request(&ws_sock, "PUT", "/vm/pause", None);
        request(
            &ws_sock,
            "PUT",
            "/vm/snapshot",
            Some(serde_json::json!({ "path": ws_snap })),
        );
        guest.signal(libc::SIGKILL);
        guest.wait_exit(TIMEOUT);
    }

    let modes: [(&str, &str, &Path, &[&str]); 4] = [
        ("cow", "cow", &snap, &[]),
        ("lazy", "lazy", &snap, &["--no-prefetch"]),
        ("lazy+prefetch", "lazy", &ws_snap, &[]),
        ("eager", "eager", &snap, &[]),
    ];
    let mut restore = Vec::new();
    let mut ratios = BTreeMap::new();
    let boots: Vec<f64> = (0..args.runs).map(|_| boot_to_useful(mem_mib)).collect();
    let boot_stats = stats(&boots);
    for (name, mode, path, extra) in modes {
        eprintln!("snapshot bench: {mem_mib} MiB, restore {name}");
        // One warm-up, so every mode starts with the memory file in the page cache.
        let (_, mut warm) = restore_once(path, mode, extra);
        warm.signal(libc::SIGKILL);
        warm.wait_exit(TIMEOUT);
        let runs: Vec<Restore> = (0..args.runs)
            .map(|_| {
                let (r, mut guest) = restore_once(path, mode, extra);
                guest.signal(libc::SIGKILL);
                guest.wait_exit(TIMEOUT);
                r
            })
            .collect();
        let phases_ms = phases(&runs);
        if let Some(useful) = phases_ms.get("launch_to_useful") {
            ratios.insert(name.to_string(), useful.median / boot_stats.median);
        }
        restore.push(ModeReport {
            mode: name.to_string(),
            phases_ms,
        });
    }

    eprintln!("snapshot bench: {mem_mib} MiB, three cow restores at once");
    let mut three: Vec<Guest> = (0..3).map(|_| restore_once(&snap, "cow", &[]).1).collect();
    let is_guest_ram = |name: &str| name.ends_with("/memory") || name.contains("mayfly-guest-ram");
    let per_vm: Vec<MemoryUse> = three
        .iter()
        .map(|g| smaps_memory(g.pid(), |_| true).unwrap_or_default())
        .collect();
    let guest_ram: Vec<MemoryUse> = three
        .iter()
        .map(|g| smaps_memory(g.pid(), is_guest_ram).unwrap_or_default())
        .collect();
    for guest in &mut three {
        guest.signal(libc::SIGKILL);
        guest.wait_exit(TIMEOUT);
    }
    let pss: Vec<f64> = per_vm.iter().map(|m| m.pss_kib as f64).collect();

    SizeReport {
        mem_mib,
        data_mib: args.data_mib,
        snapshot: SnapshotStats {
            pause_ms: stats(&times.pause_ms),
            state_ms: stats(&times.state_ms),
            memory_ms: stats(&times.memory_ms),
            total_ms: stats(&times.total_ms),
            resume_ms: stats(&times.resume_ms),
            memory_bytes_written: times.memory_bytes_written,
        },
        restore,
        baseline_boot_to_useful_ms: boot_stats,
        restore_to_boot_ratio: ratios,
        three_cow_restores: ConcurrentReport {
            pss_per_vm_kib_median: stats(&pss).median,
            per_vm,
            guest_ram,
        },
    }
}

#[derive(Serialize)]
struct Report {
    benchmark: &'static str,
    machine: Machine,
    runs: usize,
    /// Where snapshots were written.
    snapshot_dir_fs: String,
    sizes: Vec<SizeReport>,
}

fn main() {
    let args = Args::parse();
    assert!(args.runs > 0, "--runs must be at least 1");
    let sizes: Vec<SizeReport> = args.mem_mib.iter().map(|&m| bench_size(m, &args)).collect();
    let report = Report {
        benchmark: "snapshot-restore",
        machine: Machine::describe(),
        runs: args.runs,
        snapshot_dir_fs: format!("{} (tmpfs in the rig)", std::env::temp_dir().display()),
        sizes,
    };
    emit_report("snapshot", &report, args.out.as_deref());

    eprintln!(
        "\nsnapshot bench summary ({}; medians over {} runs)",
        report.machine.kvm, args.runs
    );
    for size in &report.sizes {
        let s = &size.snapshot;
        eprintln!(
            "  {} MiB: pause {:.2} ms, snapshot {:.1} ms (state {:.1}, memory {:.1}; {} MiB written), resume {:.2} ms",
            size.mem_mib,
            s.pause_ms.median,
            s.total_ms.median,
            s.state_ms.median,
            s.memory_ms.median,
            s.memory_bytes_written >> 20,
            s.resume_ms.median
        );
        for mode in &size.restore {
            let get = |k: &str| mode.phases_ms.get(k).map(|s| s.median).unwrap_or(f64::NAN);
            eprintln!(
                "    restore {:<14} running {:>7.1} ms, first output {:>7.1} ms, useful {:>7.1} ms (x{:.2} of boot)",
                mode.mode,
                get("launch_to_running"),
                get("launch_to_first_output"),
                get("launch_to_useful"),
                size.restore_to_boot_ratio.get(&mode.mode).copied().unwrap_or(f64::NAN)
            );
        }
        eprintln!(
            "    cold boot to useful {:.1} ms; 3 cow restores: PSS {:.0} KiB per VM",
            size.baseline_boot_to_useful_ms.median, size.three_cow_restores.pss_per_vm_kib_median
        );
    }
}
