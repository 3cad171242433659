//! Fork benchmark: one call to N running clones.
//!
//! For each N: boot a small guest with a control socket, then fork it into N clones and measure
//! the request's latency until every clone runs guest code (the fork's answer), and until every
//! clone has answered a command typed into its console; clones per second; and, once they sit
//! idle, each clone's PSS and RSS, split into guest RAM and the VMM itself. The sum of RSS is
//! what the clones would cost without sharing; the sum of PSS is what they cost.
//!
//! `--compare-copy` also runs each N with the parent's memory copied into the base instead of
//! handed over (MAYFLY_FORK_COPY), the alternative the fork module's docs weigh.
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
use std::time::Duration;

use clap::Parser;
use mayfly_api as api;
use mayfly_benches::{
    emit_report, monotonic_ns, ms_between as ms, smaps_memory, Machine, MemoryUse, Stats,
};
use mayfly_tests::guest::{FileConsole, Guest, TestDir};
use serde::Serialize;

#[derive(Parser)]
#[command(about = "Benchmark mayfly's fork: latency to N running clones, and their memory")]
struct Args {
    /// Clone counts.
    #[arg(long, value_delimiter = ',', default_value = "1,10,100")]
    clones: Vec<u32>,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 128)]
    mem_mib: u64,
    /// Also measure forks whose base is a copy of the parent's memory.
    #[arg(long)]
    compare_copy: bool,
    /// Write the JSON report here instead of stdout.
    #[arg(long)]
    out: Option<PathBuf>,
}

const TIMEOUT: Duration = Duration::from_secs(600);

#[derive(Serialize)]
struct CloneMemory {
    name: String,
    total: MemoryUse,
    guest_ram: MemoryUse,
}

#[derive(Serialize)]
struct ForkRun {
    clones: u32,
    mechanism: &'static str,
    /// Request sent to answer received: every clone's vCPUs run.
    request_to_running_ms: f64,
    /// Request sent to every clone answering a command on its console.
    request_to_all_answered_ms: f64,
    clones_per_second: f64,
    /// The fork's own account (pause, state, freeze, spawn, total).
    parent_report: serde_json::Value,
    /// Each idle clone, 2 s after the last answer.
    per_clone: Vec<CloneMemory>,
    pss_per_clone_kib: Stats,
    rss_per_clone_kib: Stats,
    /// Sum of the clones' RSS: their memory if nothing were shared.
    sum_rss_kib: u64,
    /// Sum of the clones' PSS: what they cost with sharing.
    sum_pss_kib: u64,
    /// The parent after the fork (its clean pages are shared with the clones too).
    parent: MemoryUse,
    saved_kib: u64,
    saved_percent: f64,
}

fn is_guest_ram(name: &str) -> bool {
    name.contains("mayfly-guest-ram")
}

fn fork_once(count: u32, mem_mib: u64, copy: bool) -> ForkRun {
    let dir = TestDir::new(&format!("bench-fork-{count}-{copy}"));
    let sock = dir.join("p.sock");
    let mut command = std::process::Command::new(mayfly_tests::guest::mayfly_bin());
    command.args([
        "run",
        "--name",
        "p",
        "--mem-mib",
        &mem_mib.to_string(),
        "--api-sock",
        &sock.to_string_lossy(),
    ]);
    if copy {
        command.env("MAYFLY_FORK_COPY", "1");
    }
    let mut parent = Guest::start_with(&mut command);
    parent.expect_ready();
    // A guest with some state worth sharing.
    parent.run("dd if=/dev/urandom of=/tmp/data bs=1M count=8 2>/dev/null");

    let start = monotonic_ns();
    let (status, answer) = api::request_with_timeout(
        &sock,
        "PUT",
        "/vm/fork",
        Some(&serde_json::json!({ "count": count })),
        TIMEOUT,
    )
    .expect("the fork request");
    let running = monotonic_ns();
    assert_eq!(status, 200, "fork: {answer}");
    let clones: Vec<(String, u32, FileConsole)> = answer["clones"]
        .as_array()
        .expect("a list of clones")
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap().to_string(),
                u32::try_from(c["pid"].as_u64().unwrap()).expect("a pid"),
                FileConsole::new(
                    c["console_input"].as_str().unwrap(),
                    c["console_log"].as_str().unwrap(),
                ),
            )
        })
        .collect();
    for (_, _, console) in &clones {
        console.send("echo answ''ered-$((6*7))\n");
    }
    for (name, _, console) in &clones {
        wait_for(&console.log, "answered-42", name);
    }
    let answered = monotonic_ns();

    std::thread::sleep(Duration::from_secs(2));
    let per_clone: Vec<CloneMemory> = clones
        .iter()
        .map(|(name, pid, _)| CloneMemory {
            name: name.clone(),
            total: smaps_memory(*pid, |_| true).unwrap_or_default(),
            guest_ram: smaps_memory(*pid, is_guest_ram).unwrap_or_default(),
        })
        .collect();
    let parent_memory = smaps_memory(parent.pid(), |_| true).unwrap_or_default();
    for (_, pid, _) in &clones {
        // SAFETY: kill(2) on a clone this benchmark made.
        unsafe { libc::kill(libc::pid_t::try_from(*pid).expect("a pid"), libc::SIGKILL) };
    }
    parent.signal(libc::SIGKILL);
    parent.wait_exit(TIMEOUT);

    let sum_rss: u64 = per_clone.iter().map(|c| c.total.rss_kib).sum();
    let sum_pss: u64 = per_clone.iter().map(|c| c.total.pss_kib).sum();
    let pss: Vec<f64> = per_clone.iter().map(|c| c.total.pss_kib as f64).collect();
    let rss: Vec<f64> = per_clone.iter().map(|c| c.total.rss_kib as f64).collect();
    let total_ms = ms(start, answered);
    ForkRun {
        clones: count,
        mechanism: if copy { "copy" } else { "handover" },
        request_to_running_ms: ms(start, running),
        request_to_all_answered_ms: total_ms,
        clones_per_second: f64::from(count) / (ms(start, running) / 1e3),
        parent_report: answer,
        pss_per_clone_kib: Stats::of(&pss).expect("clones"),
        rss_per_clone_kib: Stats::of(&rss).expect("clones"),
        per_clone,
        sum_rss_kib: sum_rss,
        sum_pss_kib: sum_pss,
        parent: parent_memory,
        saved_kib: sum_rss.saturating_sub(sum_pss),
        saved_percent: if sum_rss > 0 {
            100.0 * (sum_rss.saturating_sub(sum_pss)) as f64 / sum_rss as f64
        } else {
            0.0
        },
    }
}

fn wait_for(log: &Path, pattern: &str, name: &str) {
    let deadline = std::time::Instant::now() + TIMEOUT;
    loop {
        let text = std::fs::read(log).unwrap_or_default();
        if String::from_utf8_lossy(&text).contains(pattern) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{name} never answered"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[derive(Serialize)]
struct Report {
    benchmark: &'static str,
    machine: Machine,
    guest_mem_mib: u64,
    runs: Vec<ForkRun>,
}

fn main() {
    let args = Args::parse();
    let mut runs = Vec::new();
    for &count in &args.clones {
        eprintln!("fork bench: {count} clones");
        runs.push(fork_once(count, args.mem_mib, false));
        if args.compare_copy {
            eprintln!("fork bench: {count} clones, base copied");
            runs.push(fork_once(count, args.mem_mib, true));
        }
    }
    let report = Report {
        benchmark: "fork",
        machine: Machine::describe(),
        guest_mem_mib: args.mem_mib,
        runs,
    };
    emit_report("fork", &report, args.out.as_deref());
    eprintln!(
        "\nfork bench summary ({}, {} MiB guest)",
        report.machine.kvm, args.mem_mib
    );
    for run in &report.runs {
        eprintln!(
            "  {:>3} clones ({:<8}): running {:>8.1} ms, all answered {:>8.1} ms, {:>6.1} clones/s; idle clone PSS {:>6.0} KiB (RSS {:>6.0}); total PSS {} KiB vs RSS {} KiB: sharing saves {:.0}%",
            run.clones,
            run.mechanism,
            run.request_to_running_ms,
            run.request_to_all_answered_ms,
            run.clones_per_second,
            run.pss_per_clone_kib.median,
            run.rss_per_clone_kib.median,
            run.sum_pss_kib,
            run.sum_rss_kib,
            run.saved_percent
        );
    }
}
