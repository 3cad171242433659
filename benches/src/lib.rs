//! Shared pieces of mayfly's benchmarks: statistics, process memory, and the JSON report's
//! description of where it ran.
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

use serde::Serialize;

/// Min, median, 99th percentile (nearest rank) and max of a set of samples (milliseconds unless
/// the field says otherwise).
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Stats {
    pub min: f64,
    pub median: f64,
    pub p99: f64,
    pub max: f64,
    pub samples: usize,
}

impl Stats {
    /// None for an empty set.
    pub fn of(samples: &[f64]) -> Option<Self> {
        if samples.is_empty() {
            return None;
        }
        let mut sorted = samples.to_vec();
        sorted.sort_by(|a, b| a.total_cmp(b));
        let n = sorted.len();
        let median = if n % 2 == 1 {
            sorted[n / 2]
        } else {
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
        };
        // Nearest rank: the smallest sample with at least 99% of them at or below it.
        let rank = (n * 99).div_ceil(100).max(1);
        Some(Stats {
            min: sorted[0],
            median,
            p99: sorted[rank - 1],
            max: sorted[n - 1],
            samples: n,
        })
    }
}

/// CLOCK_MONOTONIC in nanoseconds, the clock `mayfly --boot-trace` and the probe device stamp
/// their lines with.
pub use mayfly_sys::trace::monotonic_ns;

/// Write a benchmark's JSON report to `out`, or stdout without one; exits on failure.
pub fn emit_report(bench: &str, report: &impl Serialize, out: Option<&std::path::Path>) {
    let json = serde_json::to_string_pretty(report).expect("reports serialise");
    match out {
        Some(path) => {
            if let Err(e) = std::fs::write(path, &json) {
                eprintln!("{bench} bench: cannot write {}: {e}", path.display());
                std::process::exit(1);
            }
        }
        None => println!("{json}"),
    }
}

/// Wait until the host's CPUs are idle (at least `IDLE` of their time, two 100 ms windows in a
/// row, from /proc/stat) or `max` has passed; returns how long it waited, ms. Before a timed
/// step whose baseline must not pay for the step before it: ending 100 jailed sandboxes goes
/// on in the kernel (their network namespaces are torn down by a work queue) after the
/// manager has answered, and a `mayfly fork` timed right then shares the CPUs with it.
pub fn settle(max: std::time::Duration) -> f64 {
    const IDLE: f64 = 0.9;
    let read = || -> Option<(u64, u64)> {
        let text = std::fs::read_to_string("/proc/stat").ok()?;
        let cpu: Vec<u64> = text
            .lines()
            .next()?
            .split_whitespace()
            .skip(1)
            .filter_map(|n| n.parse().ok())
            .collect();
        // idle + iowait, of all (user to steal: guest time is counted in user already).
        Some((cpu.get(3)? + cpu.get(4)?, cpu.iter().take(8).sum()))
    };
    let start = std::time::Instant::now();
    let mut quiet = 0;
    while start.elapsed() < max && quiet < 2 {
        let Some((idle0, all0)) = read() else { break };
        std::thread::sleep(std::time::Duration::from_millis(100));
        let Some((idle1, all1)) = read() else { break };
        // iowait may go backwards (it is counted per CPU, approximately).
        let share = idle1.saturating_sub(idle0) as f64 / all1.saturating_sub(all0).max(1) as f64;
        quiet = if share >= IDLE { quiet + 1 } else { 0 };
    }
    start.elapsed().as_secs_f64() * 1e3
}

/// Milliseconds between two CLOCK_MONOTONIC stamps.
pub fn ms_between(from: u64, to: u64) -> f64 {
    to.saturating_sub(from) as f64 / 1e6
}

/// The `mayfly-trace: <event> <ns>` lines mayfly prints with `--boot-trace`/`--trace`.
pub fn trace_events(stderr: &str) -> std::collections::BTreeMap<String, u64> {
    let mut events = std::collections::BTreeMap::new();
    for line in stderr.lines() {
        let mut words = line.split_whitespace();
        if let (Some("mayfly-trace:"), Some(name), Some(ns)) =
            (words.next(), words.next(), words.next())
        {
            if let Ok(ns) = ns.parse() {
                events.entry(name.to_string()).or_insert(ns);
            }
        }
    }
    events
}

/// Resident and proportional memory of a process, whole and for the mappings whose name
/// contains a given string (such as guest RAM), in KiB.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq)]
pub struct MemoryUse {
    pub rss_kib: u64,
    pub pss_kib: u64,
}

/// One mapping of `/proc/<pid>/smaps`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Mapping {
    pub name: String,
    pub size_kib: u64,
    pub memory: MemoryUse,
    /// Pages of this mapping only this process has written (copy-on-write copies included).
    pub private_dirty_kib: u64,
}

/// Every mapping of a process, with its size, RSS and PSS.
pub fn smaps(pid: u32) -> std::io::Result<Vec<Mapping>> {
    Ok(parse_smaps(&std::fs::read_to_string(format!(
        "/proc/{pid}/smaps"
    ))?))
}

/// Sum Rss and Pss over the mappings of `/proc/<pid>/smaps` that `select` accepts (by name).
pub fn smaps_memory(pid: u32, select: impl Fn(&str) -> bool) -> std::io::Result<MemoryUse> {
    Ok(sum(smaps(pid)?.iter().filter(|m| select(&m.name))))
}

/// Add up mappings' memory.
pub fn sum<'a>(mappings: impl Iterator<Item = &'a Mapping>) -> MemoryUse {
    mappings.fold(MemoryUse::default(), |acc, m| MemoryUse {
        rss_kib: acc.rss_kib + m.memory.rss_kib,
        pss_kib: acc.pss_kib + m.memory.pss_kib,
    })
}

fn parse_smaps(smaps: &str) -> Vec<Mapping> {
    let mut mappings: Vec<Mapping> = Vec::new();
    for line in smaps.lines() {
        let mut fields = line.split_whitespace();
        let Some(first) = fields.next() else { continue };
        if first.contains('-') && !first.ends_with(':') {
            // A mapping's header: "start-end perms offset dev inode [name]".
            mappings.push(Mapping {
                name: line.split_whitespace().nth(5).unwrap_or("").to_string(),
                ..Mapping::default()
            });
            continue;
        }
        let Some(current) = mappings.last_mut() else {
            continue;
        };
        let value: u64 = fields.next().and_then(|v| v.parse().ok()).unwrap_or(0);
        match first {
            "Size:" => current.size_kib = value,
            "Rss:" => current.memory.rss_kib = value,
            "Pss:" => current.memory.pss_kib = value,
            "Private_Dirty:" => current.private_dirty_kib = value,
            _ => {}
        }
    }
    mappings
}

/// Where a benchmark ran, for its report.
#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    /// "rig": inside the emulated test machine (times are not real-world times);
    /// "host": on this machine's KVM directly.
    pub kvm: String,
    pub cpu_model: String,
    pub cpus: usize,
    pub kernel: String,
    /// /sys/kernel/mm/transparent_hugepage/shmem_enabled: whether memfd guest RAM gets huge
    /// pages (mayfly asks for them), which changes boot times a lot.
    pub shmem_thp: String,
    pub note: String,
}

impl Machine {
    pub fn describe() -> Self {
        let in_rig = std::env::var_os(mayfly_tests::rig::IN_RIG_ENV).is_some();
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split(':').nth(1))
            .unwrap_or("unknown")
            .trim()
            .to_string();
        let cpus = cpuinfo
            .lines()
            .filter(|l| l.starts_with("processor"))
            .count();
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_string();
        let note = if in_rig {
            "measured inside the test rig (QEMU TCG L1 with kvm_amd): compare ratios against the baseline of the same run, not absolute times".into()
        } else {
            "measured on this machine's KVM directly".into()
        };
        let shmem_thp =
            std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
                .ok()
                .and_then(|s| {
                    s.split_whitespace()
                        .find(|w| w.starts_with('['))
                        .map(|w| w.trim_matches(['[', ']']).to_string())
                })
                .unwrap_or_else(|| "unknown".into());
        Machine {
            kvm: if in_rig { "rig" } else { "host" }.into(),
            cpu_model,
            cpus,
            kernel,
            shmem_thp,
            note,
        }
    }
}

/// microvm's own firmware, from Debian's qemu-system-data. qboot loads a `-kernel` itself;
/// QEMU 10's default microvm firmware, SeaBIOS, needs the option ROMs these baselines turn off
/// to boot one ("No bootable device").
pub const QBOOT: &str = "/usr/share/qemu/qboot.rom";

/// QEMU's microvm machine as a benchmark's baseline: qboot, KVM, one vCPU, `mem_mib` of RAM, no
/// default devices, the serial console on stdio; the caller adds devices, kernel and command
/// line. `acpi_off`: no ACPI tables, so QEMU lists its virtio-mmio devices on the kernel
/// command line (`virtio_mmio.device=`). None, said on stderr, when qboot is missing.
pub fn qemu_microvm(bench: &str, mem_mib: u64, acpi_off: bool) -> Option<std::process::Command> {
    if !std::path::Path::new(QBOOT).exists() {
        eprintln!(
            "{bench} bench: {QBOOT} is missing, so no QEMU baseline: install qemu-system-data \
             (scripts/setup.sh does)"
        );
        return None;
    }
    let machine = if acpi_off {
        "microvm,x-option-roms=off,rtc=off,isa-serial=on,acpi=off"
    } else {
        "microvm,x-option-roms=off,rtc=off,isa-serial=on"
    };
    let mut command = std::process::Command::new("qemu-system-x86_64");
    command
        .args(["-M", machine])
        .args(["-bios", QBOOT])
        .args(["-enable-kvm", "-cpu", "host", "-smp", "1"])
        .args(["-m", &mem_mib.to_string()])
        .args(["-nodefaults", "-no-user-config", "-nographic", "-no-reboot"])
        .args(["-serial", "stdio"]);
    Some(command)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_median_of_even_and_odd_sets() {
        assert_eq!(Stats::of(&[]), None);
        let s = Stats::of(&[3.0, 1.0, 2.0]).unwrap();
        assert_eq!((s.min, s.median, s.max, s.samples), (1.0, 2.0, 3.0, 3));
        assert_eq!(Stats::of(&[4.0, 1.0, 2.0, 3.0]).unwrap().median, 2.5);
    }

    #[test]
    fn p99_is_the_nearest_rank() {
        let samples: Vec<f64> = (1..=200).map(f64::from).collect();
        assert_eq!(Stats::of(&samples).unwrap().p99, 198.0);
        assert_eq!(Stats::of(&[5.0]).unwrap().p99, 5.0);
        let hundred: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(Stats::of(&hundred).unwrap().p99, 99.0);
    }

    #[test]
    fn smaps_sums_selected_mappings() {
        let smaps = "\
55d0-55e0 r-xp 00000000 fd:00 123 /usr/bin/mayfly
Rss:                 100 kB
Pss:                  50 kB
7f00-7f10 rw-s 00000000 00:01 9 /memfd:mayfly-guest-ram (deleted)
Rss:                2048 kB
Pss:                2048 kB
7f20-7f30 rw-p 00000000 00:00 0
Rss:                  12 kB
Pss:                  12 kB
";
        let mappings = parse_smaps(smaps);
        let guest = sum(mappings
            .iter()
            .filter(|m| m.name.contains("mayfly-guest-ram")));
        assert_eq!(
            guest,
            MemoryUse {
                rss_kib: 2048,
                pss_kib: 2048
            }
        );
        assert_eq!(
            sum(mappings.iter()),
            MemoryUse {
                rss_kib: 2160,
                pss_kib: 2110
            }
        );
        assert_eq!(mappings[2].name, "");
    }
}
