//! Boot benchmark: time from launching `mayfly run` to the guest's readiness line, split into
//! phases, and the VMM's own memory (its RSS and PSS minus guest RAM). A baseline in the same
//! run (QEMU's microvm machine booting the same kernel and initramfs) makes the numbers
//! comparable where absolute times mean little, as inside the emulated test rig.
//!
//! Phases come from `mayfly run --boot-trace`: CLOCK_MONOTONIC stamps the VMM prints at
//! `main`, `vm_created`, `vcpus_configured`, `first_kvm_run`, `first_instruction` (the guest's
//! first instruction, a port write of the boot trampoline right before the kernel's PVH entry)
//! and `start_kernel` (a hardware breakpoint, where KVM supports it).
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
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use mayfly_benches::ms_between as ms;
use mayfly_benches::{
    emit_report, monotonic_ns, qemu_microvm, smaps_memory, trace_events, Machine, MemoryUse, Stats,
};
use mayfly_tests::guest::{guest_artifact, mayfly_bin, Guest};
use mayfly_vmm::config::DEFAULT_CMDLINE;
use serde::Serialize;

#[derive(Parser)]
#[command(about = "Benchmark mayfly's boot: phases to the guest's readiness line, and VMM memory")]
struct Args {
    /// Measured boots (after one warm-up boot).
    #[arg(long, default_value_t = 10)]
    runs: usize,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 128)]
    mem_mib: u64,
    /// Also boot the same guest with QEMU's microvm machine, as a baseline.
    #[arg(long, default_value = "qemu")]
    baseline: Baseline,
    /// Write the JSON report here instead of stdout.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Clone, Copy, clap::ValueEnum, PartialEq)]
enum Baseline {
    Qemu,
    None,
}

/// (name, from event, to event). `start_kernel` comes from a hardware breakpoint, which KVM
/// does not deliver inside the emulated test rig: those phases are then left out.
const PHASES: [(&str, &str, &str); 9] = [
    ("launch_to_main", "launch", "main"),
    ("main_to_vm_created", "main", "vm_created"),
    (
        "vm_created_to_vcpus_configured",
        "vm_created",
        "vcpus_configured",
    ),
    (
        "vcpus_configured_to_first_kvm_run",
        "vcpus_configured",
        "first_kvm_run",
    ),
    (
        "first_kvm_run_to_first_instruction",
        "first_kvm_run",
        "first_instruction",
    ),
    ("launch_to_first_instruction", "launch", "first_instruction"),
    (
        "first_instruction_to_start_kernel",
        "first_instruction",
        "start_kernel",
    ),
    ("start_kernel_to_ready", "start_kernel", "ready"),
    ("first_instruction_to_ready", "first_instruction", "ready"),
];

struct Boot {
    events: BTreeMap<String, u64>,
    uptime_s: Option<f64>,
    vmm: MemoryUse,
    guest_ram: MemoryUse,
}

fn boot_mayfly(mem_mib: u64) -> Boot {
    let mut events = BTreeMap::new();
    events.insert("launch".to_string(), monotonic_ns());
    let mut guest = Guest::start(&["run", "--boot-trace", "--mem-mib", &mem_mib.to_string()]);
    let line = guest.expect_ready();
    events.insert("ready".to_string(), monotonic_ns());
    let is_guest_ram = |name: &str| name.contains("mayfly-guest-ram");
    let guest_ram = smaps_memory(guest.pid(), is_guest_ram).unwrap_or_default();
    let vmm = smaps_memory(guest.pid(), |name| !is_guest_ram(name)).unwrap_or_default();
    guest.signal(libc::SIGTERM);
    guest.wait_exit(Duration::from_secs(60));
    events.extend(trace_events(&guest.stderr()));
    Boot {
        events,
        uptime_s: uptime_of(&line),
        vmm,
        guest_ram,
    }
}

/// The guest's uptime from its readiness line ("... uptime=0.84s ...").
fn uptime_of(line: &str) -> Option<f64> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix("uptime="))
        .and_then(|v| v.trim_end_matches('s').parse().ok())
}

/// QEMU's microvm machine booting the same kernel and initramfs: launch to readiness line.
fn boot_qemu(mem_mib: u64) -> Option<(f64, Option<f64>)> {
    let kernel = guest_artifact("kernel/microvm.current/vmlinux");
    let initrd = guest_artifact("rootfs/guest.current/initramfs.cpio");
    let launch = monotonic_ns();
    let mut command = qemu_microvm("boot", mem_mib, false)?;
    command
        .arg("-kernel")
        .arg(&kernel)
        .arg("-initrd")
        .arg(&initrd)
        .arg("-append")
        .arg(format!("{DEFAULT_CMDLINE} acpi=off"));
    let mut guest = Guest::start_with(&mut command);
    let line = guest.expect_ready();
    let elapsed = ms(launch, monotonic_ns());
    guest.signal(libc::SIGKILL);
    guest.wait_exit(Duration::from_secs(30));
    Some((elapsed, uptime_of(&line)))
}

#[derive(Serialize)]
struct Report {
    benchmark: &'static str,
    machine: Machine,
    mayfly: String,
    guest: GuestDesc,
    runs: usize,
    /// Each phase's duration over the runs, in milliseconds.
    phases_ms: BTreeMap<String, Stats>,
    launch_to_ready_ms: Stats,
    guest_uptime_at_ready_s: Option<Stats>,
    /// The mayfly process minus its guest RAM mapping, at the readiness line.
    vmm_overhead_kib: MemoryStats,
    guest_ram_resident_kib: MemoryStats,
    baseline: Option<BaselineReport>,
}

#[derive(Serialize)]
struct GuestDesc {
    kernel: String,
    initramfs: String,
    mem_mib: u64,
    vcpus: u32,
    cmdline: &'static str,
}

#[derive(Serialize)]
struct MemoryStats {
    rss: Stats,
    pss: Stats,
}

#[derive(Serialize)]
struct BaselineReport {
    name: &'static str,
    launch_to_ready_ms: Stats,
    guest_uptime_at_ready_s: Option<Stats>,
    /// mayfly's median launch-to-ready divided by the baseline's.
    mayfly_to_baseline_ratio: f64,
}

fn memory_stats(samples: &[MemoryUse]) -> MemoryStats {
    let rss: Vec<f64> = samples.iter().map(|m| m.rss_kib as f64).collect();
    let pss: Vec<f64> = samples.iter().map(|m| m.pss_kib as f64).collect();
    MemoryStats {
        rss: Stats::of(&rss).expect("at least one run"),
        pss: Stats::of(&pss).expect("at least one run"),
    }
}

fn main() {
    let args = Args::parse();
    assert!(args.runs > 0, "--runs must be at least 1");
    eprintln!(
        "boot bench: 1 warm-up + {} boots of the default guest ({} MiB)",
        args.runs, args.mem_mib
    );
    boot_mayfly(args.mem_mib);
    let boots: Vec<Boot> = (0..args.runs).map(|_| boot_mayfly(args.mem_mib)).collect();

    let mut phases_ms = BTreeMap::new();
    for (name, from, to) in PHASES {
        let samples: Vec<f64> = boots
            .iter()
            .filter_map(|b| Some(ms(*b.events.get(from)?, *b.events.get(to)?)))
            .collect();
        if let Some(stats) = Stats::of(&samples) {
            phases_ms.insert(name.to_string(), stats);
        }
    }
    let total: Vec<f64> = boots
        .iter()
        .map(|b| ms(b.events["launch"], b.events["ready"]))
        .collect();
    let uptimes: Vec<f64> = boots.iter().filter_map(|b| b.uptime_s).collect();
    let launch_to_ready_ms = Stats::of(&total).expect("at least one run");

    let baseline = (args.baseline == Baseline::Qemu).then(|| {
        eprintln!(
            "boot bench: baseline, QEMU microvm: 1 warm-up + {} boots",
            args.runs
        );
        boot_qemu(args.mem_mib);
        let runs: Vec<(f64, Option<f64>)> = (0..args.runs)
            .filter_map(|_| boot_qemu(args.mem_mib))
            .collect();
        let times: Vec<f64> = runs.iter().map(|r| r.0).collect();
        let uptimes: Vec<f64> = runs.iter().filter_map(|r| r.1).collect();
        let stats = Stats::of(&times).expect("at least one run");
        BaselineReport {
            name: "qemu-system-x86_64 -M microvm -bios qboot.rom (same kernel, initramfs, memory; acpi=off)",
            mayfly_to_baseline_ratio: launch_to_ready_ms.median / stats.median,
            launch_to_ready_ms: stats,
            guest_uptime_at_ready_s: Stats::of(&uptimes),
        }
    });

    let report = Report {
        benchmark: "boot",
        machine: Machine::describe(),
        mayfly: mayfly_bin().display().to_string(),
        guest: GuestDesc {
            kernel: "built-in (guest-kernel/microvm.config, vmlinux via PVH)".into(),
            initramfs: "built-in (rootfs/guest)".into(),
            mem_mib: args.mem_mib,
            vcpus: 1,
            cmdline: DEFAULT_CMDLINE,
        },
        runs: args.runs,
        phases_ms,
        launch_to_ready_ms,
        guest_uptime_at_ready_s: Stats::of(&uptimes),
        vmm_overhead_kib: memory_stats(&boots.iter().map(|b| b.vmm).collect::<Vec<_>>()),
        guest_ram_resident_kib: memory_stats(
            &boots.iter().map(|b| b.guest_ram).collect::<Vec<_>>(),
        ),
        baseline,
    };
    emit_report("boot", &report, args.out.as_deref());

    eprintln!(
        "\nboot bench summary ({}; medians over {} runs)",
        report.machine.kvm, args.runs
    );
    for (name, stats) in &report.phases_ms {
        eprintln!("  {name:<36} {:>9.2} ms", stats.median);
    }
    eprintln!(
        "  {:<36} {:>9.2} ms",
        "launch_to_ready (total)", report.launch_to_ready_ms.median
    );
    if let Some(up) = &report.guest_uptime_at_ready_s {
        eprintln!("  {:<36} {:>9.3} s", "guest uptime at readiness", up.median);
    }
    eprintln!(
        "  {:<36} {:>9} KiB RSS, {} KiB PSS",
        "VMM overhead (minus guest RAM)",
        report.vmm_overhead_kib.rss.median,
        report.vmm_overhead_kib.pss.median
    );
    if let Some(b) = &report.baseline {
        eprintln!(
            "  baseline {}: {:.2} ms launch to ready; mayfly/baseline = {:.2}",
            b.name, b.launch_to_ready_ms.median, b.mayfly_to_baseline_ratio
        );
    }
    if report.machine.kvm == "rig" {
        eprintln!("  (inside the test rig: compare the ratio, not the absolute times)");
    }
}
