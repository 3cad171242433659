//! The monitor's own latency on any KVM, measured with the probe guest (guest-kernel/probe):
//! a freestanding guest that runs in user mode, where even a nested KVM that emulates guest
//! kernel code runs it natively, and reports to mayfly's probe device.
//!
//! For each guest size and each share of memory touched after a restore (0, 1, 10, 100%):
//! boot the probe, snapshot it (timing the snapshot), then restore it repeatedly in each memory
//! mode (cow, lazy without and with prefetch of a recorded working set, eager) and time, from
//! launch: the first `KVM_RUN` (the guest's first instruction follows at once), the first probe
//! report (the guest noticed it was restored), and "verified" (every page it had to touch was
//! read back and checked). Then fork a probe into N clones (running = the fork's answer; all
//! reported = every clone's first report) and record each VMM's RSS without guest RAM.
//!
//! Writes JSON (`--out`) and an SVG plot of the distributions (`--plot`). `--quick` is the
//! regression guard the test suite runs: small sizes, few repetitions, and checks instead of
//! numbers (every page verified, no mismatch, clones diverged); it exits non-zero on failure.
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

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use mayfly_api as api;
use mayfly_benches::{
    emit_report, monotonic_ns, ms_between as ms, smaps, sum, trace_events, Machine, Stats,
};
use mayfly_tests::guest::{Guest, TestDir};
use serde::Serialize;

const PROBE_ELF: &str = mayfly_tests::probe::ELF;
const TIMEOUT: Duration = Duration::from_secs(300);

#[derive(Parser)]
#[command(about = "Benchmark mayfly's restore and fork latency with the probe guest")]
struct Args {
    /// Guest sizes in MiB.
    #[arg(long, value_delimiter = ',', default_value = "128,1024")]
    mem_mib: Vec<u64>,
    /// Percent of guest memory the probe reads back after a restore.
    #[arg(long, value_delimiter = ',', default_value = "0,1,10,100")]
    touch: Vec<u64>,
    /// Repetitions of each restore.
    #[arg(long, default_value_t = 10)]
    runs: usize,
    /// Clone counts to fork.
    #[arg(long, value_delimiter = ',', default_value = "1,10,100")]
    clones: Vec<u32>,
    /// The regression guard: 128 MiB, 10% touched, 2 runs, 3 clones, checks only.
    #[arg(long)]
    quick: bool,
    /// Only the forks (no snapshot and restore runs).
    #[arg(long)]
    fork_only: bool,
    /// Where the forks' sockets, logs and FIFOs go. A tmpfs, as /run is on most hosts: on
    /// ext4 creating a clone's six files costs more than the clone (measured here: 100 clones
    /// in 175 ms in /tmp on ext4, 127 ms on tmpfs).
    #[arg(long, default_value = "/dev/shm")]
    fork_dir: PathBuf,
    /// Fork with "overcommit": the host's memory is checked only for the clones' VMMs (for
    /// counts like 10,000 idle probe clones, which the full estimate refuses).
    #[arg(long)]
    overcommit: bool,
    /// Skip the KVM floor (each clone count forked as bare KVM VMs, for comparison).
    #[arg(long)]
    no_floor: bool,
    /// Internal: fork COUNT bare KVM VMs from the snapshot in this directory and print their
    /// times (the KVM floor; run in a process of its own, which must stay single-threaded).
    #[arg(long, hide = true, requires = "floor_count")]
    floor_child: Option<PathBuf>,
    #[arg(long, hide = true)]
    floor_count: Option<u32>,
    /// Internal: print the time and exit (the launch floor: a static binary's start).
    #[arg(long, hide = true)]
    launch_child: bool,
    /// Write the JSON report here instead of stdout.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write an SVG plot of the latency distributions here.
    #[arg(long)]
    plot: Option<PathBuf>,
}

/// Problems the regression guard looks for.
#[derive(Default)]
struct Checks(Vec<String>);

impl Checks {
    fn fail(&mut self, what: String) {
        eprintln!("probe bench: CHECK FAILED: {what}");
        self.0.push(what);
    }
}

/// The probe's report lines: `mayfly-probe: <kind> <value> <ns>`, in order.
fn probe_reports(stderr: &str) -> Vec<(String, u64, u64)> {
    stderr
        .lines()
        .filter_map(|line| {
            let mut w = line.split_whitespace();
            match (w.next(), w.next(), w.next(), w.next()) {
                (Some("mayfly-probe:"), Some(kind), Some(value), Some(ns)) => {
                    Some((kind.to_string(), value.parse().ok()?, ns.parse().ok()?))
                }
                _ => None,
            }
        })
        .collect()
}

fn boot_probe(mem_mib: u64, touch: u64, sock: &Path) -> Guest {
    let guest = Guest::start(&[
        "run",
        "--probe",
        "--kernel",
        PROBE_ELF,
        "--mem-mib",
        &mem_mib.to_string(),
        "--cmdline",
        &format!("touch={touch}"),
        "--console",
        "/dev/null",
        "--api-sock",
        &sock.to_string_lossy(),
    ]);
    assert!(
        guest.wait_stderr("mayfly-probe: waiting", TIMEOUT),
        "the probe did not boot: {}",
        guest.stderr()
    );
    guest
}

fn request(
    sock: &Path,
    method: &str,
    path: &str,
    body: Option<serde_json::Value>,
) -> serde_json::Value {
    let (status, answer) = api::request_with_timeout(sock, method, path, body.as_ref(), TIMEOUT)
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    assert!(
        (200..300).contains(&status),
        "{method} {path}: HTTP {status} {answer}"
    );
    answer
}

/// Snapshot through the socket: pause, snapshot, and the report.
fn snapshot(sock: &Path, dir: &Path) -> serde_json::Value {
    request(sock, "PUT", "/vm/pause", None);
    request(
        sock,
        "PUT",
        "/vm/snapshot",
        Some(serde_json::json!({ "path": dir })),
    )
}

struct Restored {
    /// From the launch until mayfly's restore began (the process's start: exec, loading and
    /// relocating the binary, parsing its command line).
    main_ms: f64,
    first_kvm_run_ms: f64,
    first_report_ms: f64,
    verified_ms: f64,
    mismatches: u64,
    checksum: u64,
    vmm_rss_kib: u64,
}

/// The VMM of the mayfly process `pid`: its child when it is jailed (it then waits outside
/// its jail for the VMM), itself otherwise.
fn vmm_pid(pid: u32) -> u32 {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .ok()
        .and_then(|c| c.split_whitespace().next()?.parse().ok())
        .unwrap_or(pid)
}

/// Restore `snap` with `--memory mode` and `extra` options; with `--standby` among them, start
/// the VMM standing by on `sock` and time from the restore request instead of the launch.
fn restore_once(snap: &Path, mode: &str, extra: &[&str], sock: Option<&Path>) -> (Restored, Guest) {
    let standby = extra.contains(&"--standby");
    let mut launch = monotonic_ns();
    let snap_arg = snap.to_string_lossy();
    let sock_arg = sock.map(|s| s.to_string_lossy().into_owned());
    let mut args = vec!["restore"];
    if !standby {
        args.push(&snap_arg);
    }
    args.extend_from_slice(&["--memory", mode, "--console", "/dev/null", "--trace"]);
    args.extend_from_slice(extra);
    if let Some(sock) = &sock_arg {
        args.extend_from_slice(&["--api-sock", sock]);
    }
    let guest = Guest::start(&args);
    if standby {
        assert!(
            guest.wait_stderr("mayfly-trace: standing_by", TIMEOUT),
            "the VMM never stood by: {}",
            guest.stderr()
        );
        let sock = sock.expect("a VMM standing by has a socket");
        launch = monotonic_ns();
        let (status, body) = api::request_with_timeout(
            sock,
            "PUT",
            "/vm/restore",
            Some(&serde_json::json!({ "snapshot": snap })),
            TIMEOUT,
        )
        .expect("the VMM standing by answers");
        assert_eq!(status, 200, "{body}");
    }
    assert!(
        guest.wait_stderr("mayfly-probe: verified", TIMEOUT),
        "the restored probe never verified its pages: {}",
        guest.stderr()
    );
    let stderr = guest.stderr();
    let events = trace_events(&stderr);
    let reports = probe_reports(&stderr);
    let at = |kind: &str| reports.iter().find(|r| r.0 == kind);
    // Guest RAM is the one mapping as large as the guest (file-backed, memfd or anonymous).
    let mappings = smaps(vmm_pid(guest.pid())).unwrap_or_default();
    let largest = mappings.iter().map(|m| m.size_kib).max().unwrap_or(0);
    let total = sum(mappings.iter());
    let ram = sum(mappings.iter().filter(|m| m.size_kib == largest));
    let restored = Restored {
        // Standing by, the process started long before the request.
        main_ms: events
            .get("main")
            .filter(|_| !standby)
            .map(|&t| ms(launch, t))
            .unwrap_or(f64::NAN),
        first_kvm_run_ms: events
            .get("first_kvm_run")
            .map(|&t| ms(launch, t))
            .unwrap_or(f64::NAN),
        first_report_ms: at("resumed").map(|r| ms(launch, r.2)).unwrap_or(f64::NAN),
        verified_ms: at("verified").map(|r| ms(launch, r.2)).unwrap_or(f64::NAN),
        mismatches: at("mismatch").map(|r| r.1).unwrap_or(0),
        checksum: at("verified").map(|r| r.1).unwrap_or(0),
        vmm_rss_kib: total.rss_kib.saturating_sub(ram.rss_kib),
    };
    (restored, guest)
}

#[derive(Serialize)]
struct ModeResult {
    size_mib: u64,
    touch_percent: u64,
    mode: String,
    /// From the launch until mayfly's restore began (its `main` event, once the command line
    /// is parsed): what starting the process costs. For "cow standby" (a VMM standing by,
    /// started before) none, and the times that follow count from the restore request.
    restore_to_main_ms: Stats,
    restore_to_first_instruction_ms: Stats,
    restore_to_first_report_ms: Stats,
    restore_to_all_verified_ms: Stats,
    vmm_rss_kib: Stats,
}

#[derive(Serialize)]
struct SnapshotResult {
    size_mib: u64,
    touch_percent: u64,
    state_ms: f64,
    memory_ms: f64,
    total_ms: f64,
    memory_bytes_written: u64,
}

#[derive(Serialize)]
struct ForkResult {
    clones: u32,
    overcommit: bool,
    size_mib: u64,
    /// The fork's answer: every clone runs.
    request_to_running_ms: f64,
    /// Every clone's probe has reported that it runs on (read from the console logs).
    request_to_all_reported_ms: f64,
    /// request_to_running_ms / clones.
    per_clone_ms: f64,
    clones_per_s: f64,
    /// From the request until each clone reported running (the fork's `ready_ms`).
    clone_ready_ms: Stats,
    /// The fork's own count (its answer's `total_ms`): from the request until every clone was
    /// ready. The answer is written next, and the clones go once it is: on a host with fewer
    /// CPUs than clones, the client reading a large answer may then wait for the CPU behind
    /// them, so `request_to_running_ms` varies more than this.
    vmm_total_ms: f64,
    /// The fork's own phases (its answer).
    pause_ms: f64,
    state_ms: f64,
    freeze_ms: f64,
    zygote_ms: f64,
    /// Per idle clone (sampled: up to 50 clones): PSS of everything but guest RAM (its VMM:
    /// heap, stacks, its share of the binary), and of guest RAM the pages it wrote itself
    /// (private dirty) and its share of the pages it shares with its parent and siblings.
    vmm_pss_kib: Stats,
    guest_dirty_kib: Stats,
    guest_shared_pss_kib: Stats,
    /// Host memory in use (MemAvailable) before the fork minus after it, per clone.
    host_kib_per_clone: f64,
    /// CPU time per clone (mean over up to 50 clones), by thread, read from
    /// /proc/PID/task/*/schedstat at once after the fork's answer: what making a clone cost
    /// each of its threads ("main" is the controller, which makes the VM). The clones go once
    /// the answer is written, so vcpu0 may also hold the first moments of the guest's run;
    /// a thread that has ended by then (the wait for the fork's end, often) is not counted.
    cpu_ms_by_thread: std::collections::BTreeMap<String, f64>,
    clones_diverged: bool,
}

/// The KVM floor of a fork of `clones`: one single-threaded process that has prepared the
/// snapshot as a fork's zygote does (state read, memory mapped copy-on-write) fork(2)s one
/// child per clone, and each child makes the VM in KVM alone ([`mayfly_vmm::persist::restore::Prepared::kvm_only`]:
/// VM, memory slot, irqchip, PIT, VM state, vCPUs with their state) and stops before its first
/// KVM_RUN. Everything a mayfly clone does beyond that (devices, threads, seccomp, sockets,
/// console, identity, reporting) is what the fork costs over KVM here.
#[derive(Serialize)]
struct FloorResult {
    clones: u32,
    size_mib: u64,
    /// From the first fork(2) until the last child has its vCPUs restored.
    to_all_ready_ms: f64,
    per_clone_ms: f64,
    clones_per_s: f64,
    /// From the first fork(2) until each child was ready.
    clone_ready_ms: Stats,
}

#[derive(Serialize)]
struct Report {
    benchmark: &'static str,
    machine: Machine,
    probe: &'static str,
    runs: usize,
    snapshots: Vec<SnapshotResult>,
    restores: Vec<ModeResult>,
    forks: Vec<ForkResult>,
    kvm_floor: Vec<FloorResult>,
    /// From spawning a process until its `main` began, for a small static program (this
    /// benchmark, re-run with a flag that exits at once): what any restore that starts a
    /// process pays before it can do anything (medians over `runs`; `null` with --fork-only).
    launch_floor_ms: Option<Stats>,
}

/// The launch floor: spawn this benchmark `runs` times with `--launch-child`, which prints
/// the time first thing in `main` and exits.
fn launch_floor(runs: usize) -> Stats {
    let exe = std::env::current_exe().expect("this benchmark");
    let samples: Vec<f64> = (0..runs.max(1) * 3)
        .map(|_| {
            let launch = monotonic_ns();
            let out = std::process::Command::new(&exe)
                .arg("--launch-child")
                .output()
                .expect("run this benchmark again");
            let at: u64 = String::from_utf8_lossy(&out.stdout)
                .trim()
                .parse()
                .expect("the launch child prints the time");
            ms(launch, at)
        })
        .collect();
    stats(&samples)
}

fn stats(samples: &[f64]) -> Stats {
    Stats::of(samples).unwrap_or(Stats {
        min: f64::NAN,
        median: f64::NAN,
        p99: f64::NAN,
        max: f64::NAN,
        samples: 0,
    })
}

fn bench_restores(
    args: &Args,
    size: u64,
    touch: u64,
    checks: &mut Checks,
    snapshots: &mut Vec<SnapshotResult>,
) -> Vec<ModeResult> {
    let dir = TestDir::new(&format!("probe-{size}-{touch}"));
    let sock = dir.join("p.sock");
    let snap = dir.join("snap");
    let mut guest = boot_probe(size, touch, &sock);
    let report = snapshot(&sock, &snap);
    snapshots.push(SnapshotResult {
        size_mib: size,
        touch_percent: touch,
        state_ms: report["state_ms"].as_f64().unwrap_or(f64::NAN),
        memory_ms: report["memory_ms"].as_f64().unwrap_or(f64::NAN),
        total_ms: report["total_ms"].as_f64().unwrap_or(f64::NAN),
        memory_bytes_written: report["memory_bytes_written"].as_u64().unwrap_or(0),
    });
    guest.signal(libc::SIGKILL);
    guest.wait_exit(TIMEOUT);

    // A snapshot whose working set a lazy restore recorded while the probe verified its pages.
    let ws_snap = dir.join("snap-ws");
    let ws_sock = dir.join("ws.sock");
    {
        let (_, mut g) = restore_once(&snap, "lazy", &["--no-prefetch"], Some(&ws_sock));
        snapshot(&ws_sock, &ws_snap);
        g.signal(libc::SIGKILL);
        g.wait_exit(TIMEOUT);
    }

    // "cow+jail": the same restore as "cow" with the VMM jailed (vmm/src/jail.rs): what the
    // jail costs a restore.
    // "cow standby": the same restore asked of a VMM already standing by
    // (`mayfly restore --standby`, vmm/src/standby.rs), timed from the request.
    let standby_sock = dir.join("standby.sock");
    let modes: [(&str, &str, &Path, &[&str]); 6] = [
        ("cow", "cow", &snap, &[]),
        ("cow standby", "cow", &snap, &["--standby"]),
        ("cow+jail", "cow", &snap, &["--jail"]),
        ("lazy", "lazy", &snap, &["--no-prefetch"]),
        ("lazy+prefetch", "lazy", &ws_snap, &[]),
        ("eager", "eager", &snap, &[]),
    ];
    let mut results = Vec::new();
    let mut checksum = None;
    for (name, mode, path, extra) in modes {
        eprintln!("probe bench: {size} MiB, {touch}% touched, restore {name}");
        let runs: Vec<Restored> = (0..args.runs)
            .map(|_| {
                let sock = extra
                    .contains(&"--standby")
                    .then_some(standby_sock.as_path());
                let (r, mut g) = restore_once(path, mode, extra, sock);
                g.signal(libc::SIGKILL);
                g.wait_exit(TIMEOUT);
                r
            })
            .collect();
        for r in &runs {
            if r.mismatches > 0 {
                checks.fail(format!(
                    "{size} MiB {name}: {} pages did not verify",
                    r.mismatches
                ));
            }
            if r.verified_ms.is_nan() {
                checks.fail(format!("{size} MiB {name}: no verified report"));
            }
            match checksum {
                None => checksum = Some(r.checksum),
                Some(c) if c != r.checksum => checks.fail(format!(
                    "{size} MiB {name}: checksum {} differs from another mode's {c}",
                    r.checksum
                )),
                _ => {}
            }
        }
        let pick = |f: fn(&Restored) -> f64| stats(&runs.iter().map(f).collect::<Vec<_>>());
        results.push(ModeResult {
            size_mib: size,
            touch_percent: touch,
            mode: name.to_string(),
            restore_to_main_ms: pick(|r| r.main_ms),
            restore_to_first_instruction_ms: pick(|r| r.first_kvm_run_ms),
            restore_to_first_report_ms: pick(|r| r.first_report_ms),
            restore_to_all_verified_ms: pick(|r| r.verified_ms),
            vmm_rss_kib: pick(|r| r.vmm_rss_kib as f64),
        });
    }
    results
}

fn mem_available_kib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn bench_fork(
    count: u32,
    size: u64,
    fork_dir: &Path,
    overcommit: bool,
    checks: &mut Checks,
) -> ForkResult {
    eprintln!("probe bench: fork into {count} clones");
    let dir = if fork_dir.is_dir() {
        TestDir::new_in(fork_dir, &format!("probe-fork-{count}"))
    } else {
        TestDir::new(&format!("probe-fork-{count}"))
    };
    let sock = dir.join("p.sock");
    // touch 0: the probe writes and reads back no pages after the fork, so what is timed is
    // mayfly's work (and KVM's), not the probe's.
    let mut parent = boot_probe(size, 0, &sock);
    let available_before = mem_available_kib();
    let start = monotonic_ns();
    let answer = request(
        &sock,
        "PUT",
        "/vm/fork",
        Some(serde_json::json!({ "count": count, "overcommit": overcommit })),
    );
    let running = monotonic_ns();
    let Some(listed) = answer["clones"].as_array() else {
        panic!("the fork failed: {answer}");
    };
    let clones: Vec<(u32, PathBuf, f64)> = listed
        .iter()
        .map(|c| {
            (
                u32::try_from(c["pid"].as_u64().unwrap()).expect("a pid"),
                PathBuf::from(c["console_log"].as_str().unwrap()),
                c["ready_ms"].as_f64().unwrap_or(f64::NAN),
            )
        })
        .collect();
    let cpu_ms_by_thread = thread_cpu(sampled(&clones).map(|c| c.0));
    // A clone's stderr (its probe reports) goes to its console log.
    let deadline = std::time::Instant::now() + TIMEOUT;
    let mut first_reports = Vec::new();
    for (_, log, _) in &clones {
        loop {
            let text =
                String::from_utf8_lossy(&std::fs::read(log).unwrap_or_default()).into_owned();
            if let Some(r) = probe_reports(&text).into_iter().find(|r| r.0 == "resumed") {
                first_reports.push(r);
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "a clone never reported: {}",
                log.display()
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    let last = first_reports.iter().map(|r| r.2).max().unwrap_or(running);
    let mut generations: Vec<u64> = first_reports.iter().map(|r| r.1).collect();
    generations.sort();
    generations.dedup();
    let diverged = generations.len() == clones.len();
    if !diverged {
        checks.fail(format!(
            "{count} clones: only {} distinct generation IDs",
            generations.len()
        ));
    }
    // Memory of idle clones: they have verified their pages and wait.
    std::thread::sleep(Duration::from_millis(200));
    let host_kib_per_clone =
        available_before.saturating_sub(mem_available_kib()) as f64 / f64::from(count);
    let (mut vmm_pss, mut guest_dirty, mut guest_shared) = (Vec::new(), Vec::new(), Vec::new());
    for (pid, _, _) in sampled(&clones) {
        let Ok(mappings) = smaps(*pid) else { continue };
        // Guest RAM is the one mapping as large as the guest.
        let largest = mappings.iter().map(|m| m.size_kib).max().unwrap_or(0);
        let (ram, rest): (Vec<_>, Vec<_>) = mappings.iter().partition(|m| m.size_kib == largest);
        let ram_pss: u64 = ram.iter().map(|m| m.memory.pss_kib).sum();
        let ram_dirty: u64 = ram.iter().map(|m| m.private_dirty_kib).sum();
        vmm_pss.push(rest.iter().map(|m| m.memory.pss_kib).sum::<u64>() as f64);
        guest_dirty.push(ram_dirty as f64);
        guest_shared.push(ram_pss.saturating_sub(ram_dirty) as f64);
    }
    for (pid, _, _) in &clones {
        // SAFETY: kill(2) on a clone this benchmark made.
        unsafe { libc::kill(libc::pid_t::try_from(*pid).expect("a pid"), libc::SIGKILL) };
    }
    parent.signal(libc::SIGKILL);
    parent.wait_exit(TIMEOUT);
    // No samples (every clone's smaps unreadable) shows as NaN (null), never as 0 KiB.
    let ready: Vec<f64> = clones.iter().map(|c| c.2).collect();
    let phase = |name: &str| answer[name].as_f64().unwrap_or(f64::NAN);
    ForkResult {
        clones: count,
        size_mib: size,
        overcommit,
        request_to_running_ms: ms(start, running),
        request_to_all_reported_ms: ms(start, last),
        per_clone_ms: ms(start, running) / f64::from(count),
        clones_per_s: f64::from(count) / (ms(start, running) / 1e3),
        clone_ready_ms: stats(&ready),
        vmm_total_ms: phase("total_ms"),
        pause_ms: phase("pause_ms"),
        state_ms: phase("state_ms"),
        freeze_ms: phase("freeze_ms"),
        zygote_ms: phase("zygote_ms"),
        vmm_pss_kib: stats(&vmm_pss),
        guest_dirty_kib: stats(&guest_dirty),
        guest_shared_pss_kib: stats(&guest_shared),
        host_kib_per_clone,
        cpu_ms_by_thread,
        clones_diverged: diverged,
    }
}

/// Up to [`SAMPLED`] of `items`, spread evenly: the clones whose memory and CPU are read.
fn sampled<T>(items: &[T]) -> impl Iterator<Item = &T> {
    items.iter().step_by(items.len().div_ceil(SAMPLED).max(1))
}

const SAMPLED: usize = 50;

/// Mean CPU time per clone by thread name, over the clones `pids` (see
/// [`ForkResult::cpu_ms_by_thread`]).
fn thread_cpu(pids: impl Iterator<Item = u32>) -> std::collections::BTreeMap<String, f64> {
    let mut sums: std::collections::BTreeMap<String, f64> = Default::default();
    let mut read = 0u32;
    for pid in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        read += 1;
        for task in tasks.flatten() {
            let path = task.path();
            let Ok(comm) = std::fs::read_to_string(path.join("comm")) else {
                continue;
            };
            let ns: f64 = std::fs::read_to_string(path.join("schedstat"))
                .ok()
                .and_then(|s| s.split_whitespace().next()?.parse().ok())
                .unwrap_or(0.0);
            // The clone's main thread carries the clone's name.
            let name = if task.file_name().to_string_lossy() == pid.to_string() {
                "main".to_string()
            } else {
                comm.trim().to_string()
            };
            *sums.entry(name).or_default() += ns / 1e6;
        }
    }
    for value in sums.values_mut() {
        *value /= f64::from(read.max(1));
    }
    sums
}

/// The KVM floor's forking process (`--floor-child`): prepare the snapshot once, fork `count`
/// children that each make the VM in KVM and note when they are done in a shared page, hold
/// them until every one is done (as a fork holds its clones), and print the times (ms from the
/// first fork(2), one per child) as JSON. Exits non-zero if any child failed.
fn floor_child(dir: &Path, count: u32) -> ! {
    use mayfly_vmm::persist::restore::{self, MemoryMode, SnapshotSource};
    let prepared = restore::prepare(
        SnapshotSource::Dir(dir.to_path_buf()),
        MemoryMode::Cow,
        None,
        restore::Probe::Inline,
    )
    .unwrap_or_else(|e| {
        eprintln!("kvm floor: {e}");
        std::process::exit(2)
    });
    let slots = usize::try_from(count).expect("a count");
    let len = slots * std::mem::size_of::<u64>();
    // SAFETY: a new shared anonymous mapping of `len` bytes; checked below.
    let shared = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len.max(1),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert!(shared != libc::MAP_FAILED, "map the floor's shared page");
    // SAFETY: the mapping is `slots` u64s long, zeroed, shared with the children and never
    // unmapped; each slot is written by one child and read here with atomic accesses.
    let done: &[std::sync::atomic::AtomicU64] =
        unsafe { std::slice::from_raw_parts(shared.cast(), slots) };
    let mut release = [0i32; 2];
    // SAFETY: pipe(2) fills the two descriptors.
    assert_eq!(unsafe { libc::pipe(release.as_mut_ptr()) }, 0, "a pipe");
    let start = monotonic_ns();
    let mut pids = Vec::with_capacity(slots);
    for slot in done {
        // SAFETY: this process runs one thread (the benchmark starts none before this).
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let outcome = prepared.kvm_only();
            let now = monotonic_ns();
            slot.store(
                if outcome.is_ok() {
                    now.max(1)
                } else {
                    u64::MAX
                },
                std::sync::atomic::Ordering::SeqCst,
            );
            // Held until every child is done: the release pipe's end of file.
            // SAFETY: close and read on this process's own descriptors, into a local buffer.
            unsafe {
                libc::close(release[1]);
                let mut byte = 0u8;
                libc::read(release[0], std::ptr::addr_of_mut!(byte).cast(), 1);
                libc::_exit(0);
            }
        }
        assert!(pid > 0, "fork(2): {}", std::io::Error::last_os_error());
        pids.push(pid);
    }
    let deadline = std::time::Instant::now() + TIMEOUT;
    while done
        .iter()
        .any(|d| d.load(std::sync::atomic::Ordering::SeqCst) == 0)
    {
        assert!(
            std::time::Instant::now() < deadline,
            "kvm floor: a child never finished"
        );
        std::thread::sleep(Duration::from_micros(50));
    }
    let times: Vec<u64> = done
        .iter()
        .map(|d| d.load(std::sync::atomic::Ordering::SeqCst))
        .collect();
    // SAFETY: closing our own descriptors (the children see end of file and exit), then
    // reaping our own children.
    unsafe {
        libc::close(release[1]);
        libc::close(release[0]);
        for pid in pids {
            let mut status = 0;
            libc::waitpid(pid, &mut status, 0);
        }
    }
    if times.contains(&u64::MAX) {
        eprintln!("kvm floor: a child could not make its VM");
        std::process::exit(1);
    }
    let ms: Vec<f64> = times.iter().map(|&t| ms(start, t)).collect();
    println!("{}", serde_json::to_string(&ms).expect("JSON"));
    std::process::exit(0)
}

/// Run the KVM floor for `count` clones of the snapshot in `dir` (a process of its own).
fn bench_floor(count: u32, size: u64, dir: &Path) -> FloorResult {
    eprintln!("probe bench: KVM floor of {count} clones");
    let out = std::process::Command::new(std::env::current_exe().expect("this benchmark"))
        .arg("--floor-child")
        .arg(dir)
        .arg("--floor-count")
        .arg(count.to_string())
        .stderr(std::process::Stdio::inherit())
        .output()
        .expect("run the KVM floor");
    assert!(out.status.success(), "the KVM floor failed: {}", out.status);
    let ready: Vec<f64> = serde_json::from_slice(&out.stdout).expect("the floor's times");
    let all = ready.iter().copied().fold(0.0, f64::max);
    FloorResult {
        clones: count,
        size_mib: size,
        to_all_ready_ms: all,
        per_clone_ms: all / f64::from(count),
        clones_per_s: f64::from(count) / (all / 1e3),
        clone_ready_ms: stats(&ready),
    }
}

/// An SVG of each restore measure: one row per (size, touched, mode), a line from min to max
/// and a mark at the median, on a log scale.
fn plot(report: &Report) -> String {
    let rows: Vec<(String, [&Stats; 3])> = report
        .restores
        .iter()
        .map(|m| {
            (
                format!("{} MiB {:>3}% {}", m.size_mib, m.touch_percent, m.mode),
                [
                    &m.restore_to_first_instruction_ms,
                    &m.restore_to_first_report_ms,
                    &m.restore_to_all_verified_ms,
                ],
            )
        })
        .collect();
    let (left, width, row_h, top) = (230.0, 620.0, 14.0, 40.0);
    let (lo, hi) = (0.1f64.log10(), 10000f64.log10());
    let x = |v: f64| left + (v.max(0.1).log10() - lo) / (hi - lo) * width;
    let height = top + rows.len() as f64 * row_h + 40.0;
    let mut svg = String::new();
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{height}" font-family="monospace" font-size="10">"#,
        left + width + 20.0
    );
    let _ = write!(
        svg,
        r#"<text x="10" y="15" font-size="12">mayfly restore latency with the probe guest ({}; min-max, dot = median; log scale, ms)</text>"#,
        report.machine.kvm
    );
    let colours = ["#1f77b4", "#ff7f0e", "#2ca02c"];
    let names = ["first instruction", "first report", "all verified"];
    for (i, name) in names.iter().enumerate() {
        let _ = write!(
            svg,
            r#"<text x="{}" y="30" fill="{}">{name}</text>"#,
            left + i as f64 * 150.0,
            colours[i]
        );
    }
    for tick in [0.1, 1.0, 10.0, 100.0, 1000.0, 10000.0] {
        let tx = x(tick);
        let _ = write!(
            svg,
            r##"<line x1="{tx}" y1="{top}" x2="{tx}" y2="{}" stroke="#ddd"/><text x="{}" y="{}">{tick}</text>"##,
            height - 30.0,
            tx - 8.0,
            height - 18.0
        );
    }
    for (r, (label, measures)) in rows.iter().enumerate() {
        let y = top + r as f64 * row_h + 8.0;
        let _ = write!(svg, r#"<text x="5" y="{}">{label}</text>"#, y + 3.0);
        for (i, s) in measures.iter().enumerate() {
            if s.samples == 0 {
                continue;
            }
            let dy = y - 3.0 + i as f64 * 3.0;
            let _ = write!(
                svg,
                r#"<line x1="{}" y1="{dy}" x2="{}" y2="{dy}" stroke="{}" stroke-width="2"/><circle cx="{}" cy="{dy}" r="2.2" fill="{}"/>"#,
                x(s.min),
                x(s.max),
                colours[i],
                x(s.median),
                colours[i]
            );
        }
    }
    svg.push_str("</svg>\n");
    svg
}

fn main() {
    // Before anything else, argument parsing included: the launch floor's end.
    if std::env::args().nth(1).as_deref() == Some("--launch-child") {
        println!("{}", monotonic_ns());
        std::process::exit(0);
    }
    let mut args = Args::parse();
    if let (Some(dir), Some(count)) = (&args.floor_child, args.floor_count) {
        floor_child(dir, count);
    }
    if args.quick {
        args.mem_mib = vec![128];
        args.touch = vec![10];
        args.runs = 2;
        args.clones = vec![3];
    }
    let mut checks = Checks::default();
    let mut snapshots = Vec::new();
    let mut restores = Vec::new();
    for &size in args.mem_mib.iter().filter(|_| !args.fork_only) {
        for &touch in &args.touch {
            restores.extend(bench_restores(
                &args,
                size,
                touch,
                &mut checks,
                &mut snapshots,
            ));
        }
    }
    let forks: Vec<ForkResult> = args
        .clones
        .iter()
        .map(|&n| bench_fork(n, 128, &args.fork_dir, args.overcommit, &mut checks))
        .collect();
    // The same counts as bare KVM VMs forked from one prepared snapshot of the same probe.
    let kvm_floor = if args.no_floor || args.clones.is_empty() {
        Vec::new()
    } else {
        let dir = TestDir::new("probe-floor");
        let sock = dir.join("p.sock");
        let mut guest = boot_probe(128, 0, &sock);
        let snap = dir.join("snap");
        snapshot(&sock, &snap);
        guest.signal(libc::SIGKILL);
        guest.wait_exit(TIMEOUT);
        args.clones
            .iter()
            .map(|&n| bench_floor(n, 128, &snap))
            .collect()
    };
    let report = Report {
        benchmark: "probe",
        machine: Machine::describe(),
        probe: "guest-kernel/probe (user-mode loop, reports through mayfly's probe device)",
        runs: args.runs,
        snapshots,
        restores,
        forks,
        kvm_floor,
        launch_floor_ms: (!args.fork_only).then(|| launch_floor(args.runs)),
    };
    emit_report("probe", &report, args.out.as_deref());
    if let Some(path) = &args.plot {
        std::fs::write(path, plot(&report)).expect("write the plot");
    }

    eprintln!(
        "\nprobe bench summary ({}; medians of {} runs; ms)",
        report.machine.kvm, args.runs
    );
    for s in &report.snapshots {
        eprintln!(
            "  snapshot {:>4} MiB ({:>3}%): {:.1} ms (state {:.2}, memory {:.1}; {} MiB written)",
            s.size_mib,
            s.touch_percent,
            s.total_ms,
            s.state_ms,
            s.memory_ms,
            s.memory_bytes_written >> 20
        );
    }
    if let Some(floor) = &report.launch_floor_ms {
        eprintln!(
            "  launch floor (a small static program, spawn → main): median {:.2} ms, min {:.2}",
            floor.median, floor.min
        );
    }
    for m in &report.restores {
        eprintln!(
            "  restore {:>4} MiB {:>3}% {:<14} main {:>5.2}  first instruction {:>8.2}  first report {:>8.2}  all verified {:>9.2}  VMM RSS {:>6.0} KiB",
            m.size_mib,
            m.touch_percent,
            m.mode,
            m.restore_to_main_ms.median,
            m.restore_to_first_instruction_ms.median,
            m.restore_to_first_report_ms.median,
            m.restore_to_all_verified_ms.median,
            m.vmm_rss_kib.median
        );
    }
    for f in &report.forks {
        eprintln!(
            "  fork into {:>4}: running {:>8.1} ms (VMM: all ready {:.1} ms; {:.2} ms per clone, {:.0}/s), clone ready p50 {:.1} p99 {:.1} ms, all reported {:>8.1} ms, VMM PSS {:.0} KiB, dirty {:.0} KiB, host {:.0} KiB per clone, diverged: {}",
            f.clones, f.request_to_running_ms, f.vmm_total_ms, f.per_clone_ms, f.clones_per_s,
            f.clone_ready_ms.median, f.clone_ready_ms.p99, f.request_to_all_reported_ms,
            f.vmm_pss_kib.median, f.guest_dirty_kib.median, f.host_kib_per_clone, f.clones_diverged
        );
        let threads: Vec<String> = f
            .cpu_ms_by_thread
            .iter()
            .map(|(name, ms)| format!("{name} {ms:.3}"))
            .collect();
        eprintln!(
            "    CPU per clone {:.2} ms: {}",
            f.cpu_ms_by_thread.values().sum::<f64>(),
            threads.join(", ")
        );
    }
    for (floor, fork) in report.kvm_floor.iter().zip(&report.forks) {
        eprintln!(
            "  KVM floor {:>4}: all ready {:>8.1} ms ({:.2} ms per clone, {:.0}/s), clone ready p50 {:.1} p99 {:.1} ms; mayfly's fork {:.1}x",
            floor.clones, floor.to_all_ready_ms, floor.per_clone_ms, floor.clones_per_s,
            floor.clone_ready_ms.median, floor.clone_ready_ms.p99,
            fork.request_to_running_ms / floor.to_all_ready_ms
        );
    }
    if !checks.0.is_empty() {
        eprintln!("probe bench: {} check(s) failed", checks.0.len());
        std::process::exit(1);
    }
}
