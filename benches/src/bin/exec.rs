//! Exec benchmark: how fast a program gets a verdict from a command in the guest.
//!
//! - exec round trip of `true` through the guest agent (new connection each time, as
//!   `mayfly exec` does, and on a connection opened beforehand), against a console round trip
//!   (a command typed on the serial console, its answer read back) in the same run;
//! - stdout throughput of one command writing `--stream-mib` of output, and the VMM's memory
//!   while it streams: its RSS without guest RAM (what the VMM itself holds) and with it;
//! - restore → first exec answered, per memory mode, against restore → first console output
//!   and restore → a console command answered, from the same snapshot;
//! - fork N → every clone's exec answered, for each N.
//!
//! Figures are reported as measured; the targets are printed beside them, met or not.
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
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use mayfly_agent_protocol::ExecRequest;
use mayfly_api as api;
use mayfly_benches::{
    emit_report, monotonic_ns, ms_between as ms, smaps_memory, Machine, MemoryUse, Stats,
};
use mayfly_tests::agent::wait_agent;
use mayfly_tests::guest::{Guest, TestDir};
use mayfly_vmm::guest::agent::Agent;
use serde::Serialize;

#[derive(Parser)]
#[command(about = "Benchmark exec through mayfly's guest agent")]
struct Args {
    /// Round trips measured for exec and for the console.
    #[arg(long, default_value_t = 200)]
    runs: usize,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 256)]
    mem_mib: u64,
    /// MiB of stdout streamed for the throughput measure.
    #[arg(long, default_value_t = 1024)]
    stream_mib: u64,
    /// Restores measured per memory mode.
    #[arg(long, default_value_t = 5)]
    restores: usize,
    /// Clone counts.
    #[arg(long, value_delimiter = ',', default_value = "1,10,100")]
    clones: Vec<u32>,
    /// Write the JSON report here instead of stdout.
    #[arg(long)]
    out: Option<PathBuf>,
}

const TIMEOUT: Duration = Duration::from_secs(600);

fn is_guest_ram(name: &str) -> bool {
    name.contains("mayfly-guest-ram")
}

fn boot(dir: &TestDir, name: &str, mem_mib: u64) -> (Guest, PathBuf) {
    let sock = dir.join(&format!("{name}.sock"));
    let mut guest = Guest::start(&[
        "run",
        "--name",
        name,
        "--mem-mib",
        &mem_mib.to_string(),
        "--api-sock",
        &sock.to_string_lossy(),
    ]);
    guest.expect_ready();
    wait_agent(&sock, TIMEOUT);
    (guest, sock)
}

/// The agent of a VM just launched, asked for as soon as its control socket answers (every
/// millisecond, no back-off), so that the wait measured is the VM's, not the poll's.
fn agent_asap(sock: &Path) -> Agent {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        match Agent::for_vm(sock) {
            Ok(agent) => return agent.with_wait(TIMEOUT),
            Err(e) if Instant::now() >= deadline => panic!("{}: {e}", sock.display()),
            Err(_) => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}

fn exec_true(agent: &Agent) {
    let exit = agent
        .exec_output(&ExecRequest::argv(["true"]), None)
        .expect("exec true")
        .exit;
    assert!(exit.success(), "true ended {exit:?}");
}

#[derive(Serialize)]
struct RoundTrips {
    /// `true` through the agent, a new vsock connection each time (what `mayfly exec` does).
    exec_true_ms: Stats,
    /// `true` on a connection opened (and greeted) beforehand: the exec alone.
    exec_true_open_connection_ms: Stats,
    /// `echo` typed on the serial console, its answer read back from the console.
    console_round_trip_ms: Stats,
    /// exec p50 / console p50 (target ≤ 0.2).
    exec_p50_over_console_p50: f64,
}

fn round_trips(guest: &mut Guest, sock: &Path, runs: usize) -> RoundTrips {
    let agent = wait_agent(sock, TIMEOUT);
    // Warm both paths first (page cache, the agent's first fork).
    for _ in 0..10 {
        exec_true(&agent);
        guest.run("true");
    }
    let mut exec = Vec::with_capacity(runs);
    let mut open = Vec::with_capacity(runs);
    let mut console = Vec::with_capacity(runs);
    for _ in 0..runs {
        let start = monotonic_ns();
        exec_true(&agent);
        exec.push(ms(start, monotonic_ns()));

        let client = agent.connect().expect("connect to the agent");
        let start = monotonic_ns();
        let exit = client
            .exec_output(&ExecRequest::argv(["true"]), None)
            .expect("exec true")
            .exit;
        open.push(ms(start, monotonic_ns()));
        assert!(exit.success());

        let start = monotonic_ns();
        guest.run("true");
        console.push(ms(start, monotonic_ns()));
    }
    let exec = Stats::of(&exec).expect("runs");
    let console = Stats::of(&console).expect("runs");
    RoundTrips {
        exec_p50_over_console_p50: exec.median / console.median,
        exec_true_ms: exec,
        exec_true_open_connection_ms: Stats::of(&open).expect("runs"),
        console_round_trip_ms: console,
    }
}

#[derive(Serialize)]
struct Streaming {
    mib: u64,
    seconds: f64,
    mib_per_second: f64,
    /// The VMM without guest RAM: before, peak while streaming, growth (target ≤ 8 MiB).
    vmm_rss_before_kib: u64,
    vmm_rss_peak_kib: u64,
    vmm_rss_growth_kib: u64,
    /// With guest RAM (the guest's pipe and socket buffers are guest memory).
    total_rss_before_kib: u64,
    total_rss_peak_kib: u64,
    samples: usize,
}

fn streaming(pid: u32, sock: &Path, mib: u64) -> Streaming {
    let agent = wait_agent(sock, TIMEOUT);
    // A byte count, not "1024M": busybox's head takes no suffix.
    let command = |mib: u64| ExecRequest::shell(format!("head -c {} /dev/zero", mib << 20));
    // Warm up: the guest's buffers and the VMM's once-allocated ones are touched first.
    let warm = agent
        .exec(&command(16), None::<std::io::Empty>, |_| {}, |_| {})
        .expect("warm-up stream");
    assert!(warm.success(), "the warm-up stream ended {warm:?}");
    let own = || smaps_memory(pid, |name| !is_guest_ram(name)).expect("the VMM's smaps");
    let all = || smaps_memory(pid, |_| true).expect("the VMM's smaps");
    let before = own();
    let total_before = all();
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let done = done.clone();
        std::thread::spawn(move || {
            let mut peak = MemoryUse::default();
            let mut total_peak = MemoryUse::default();
            let mut samples = 0;
            while !done.load(Ordering::Relaxed) {
                let now = smaps_memory(pid, |name| !is_guest_ram(name)).expect("the VMM's smaps");
                let total = smaps_memory(pid, |_| true).expect("the VMM's smaps");
                peak.rss_kib = peak.rss_kib.max(now.rss_kib);
                total_peak.rss_kib = total_peak.rss_kib.max(total.rss_kib);
                samples += 1;
                std::thread::sleep(Duration::from_millis(100));
            }
            (peak, total_peak, samples)
        })
    };
    let mut bytes = 0u64;
    let start = Instant::now();
    let exit = agent
        .exec(
            &command(mib),
            None::<std::io::Empty>,
            |b| bytes += b.len() as u64,
            |_| {},
        )
        .expect("stream");
    let seconds = start.elapsed().as_secs_f64();
    done.store(true, Ordering::Relaxed);
    let (peak, total_peak, samples) = sampler.join().expect("sampler");
    assert!(exit.success(), "head ended {exit:?}");
    assert_eq!(bytes, mib << 20, "every byte of stdout arrived");
    assert!(
        samples >= 10,
        "only {samples} RSS samples while streaming: stream more"
    );
    let peak_rss = peak.rss_kib.max(before.rss_kib);
    Streaming {
        mib,
        seconds,
        mib_per_second: mib as f64 / seconds,
        vmm_rss_before_kib: before.rss_kib,
        vmm_rss_peak_kib: peak_rss,
        vmm_rss_growth_kib: peak_rss - before.rss_kib,
        total_rss_before_kib: total_before.rss_kib,
        total_rss_peak_kib: total_peak.rss_kib.max(total_before.rss_kib),
        samples,
    }
}

#[derive(Serialize)]
struct RestoreMode {
    mode: String,
    launch_to_first_output_ms: Stats,
    launch_to_console_answer_ms: Stats,
    launch_to_first_exec_ms: Stats,
    /// first exec p50 / first console output p50 (target ≤ 1.2).
    first_exec_over_first_output: f64,
}

fn restore_modes(dir: &TestDir, snap: &Path, runs: usize) -> Vec<RestoreMode> {
    let mut report = Vec::new();
    for mode in ["cow", "lazy", "eager"] {
        eprintln!("exec bench: restore ({mode}) to first exec");
        let (mut output, mut answer, mut exec) = (Vec::new(), Vec::new(), Vec::new());
        // One warm-up of each kind (the snapshot's files in the page cache).
        for run in 0..=runs {
            // Console: the first byte the restored guest prints, and a command answered.
            let snap_arg = snap.to_string_lossy();
            let launch = monotonic_ns();
            // The same setup as the exec arm (a control socket, so the agent refresh runs too).
            let console_sock = dir.join(&format!("console-{mode}-{run}.sock"));
            let mut guest = Guest::start(&[
                "restore",
                &snap_arg,
                "--memory",
                mode,
                "--api-sock",
                &console_sock.to_string_lossy(),
            ]);
            guest.send("echo use''ful-$((40+2))\n");
            assert!(
                guest.wait_any_output(TIMEOUT),
                "no output: {}",
                guest.stderr()
            );
            let first = monotonic_ns();
            guest.expect("useful-42", TIMEOUT);
            let useful = monotonic_ns();
            guest.signal(libc::SIGKILL);
            guest.wait_exit(TIMEOUT);

            // Exec: its own restore, with a control socket, the exec sent at launch.
            let sock = dir.join(&format!("restored-{mode}-{run}.sock"));
            let launch_exec = monotonic_ns();
            let mut guest = Guest::start(&[
                "restore",
                &snap_arg,
                "--memory",
                mode,
                "--api-sock",
                &sock.to_string_lossy(),
            ]);
            let agent = agent_asap(&sock);
            exec_true(&agent);
            let exec_done = monotonic_ns();
            guest.signal(libc::SIGKILL);
            guest.wait_exit(TIMEOUT);
            if run > 0 {
                output.push(ms(launch, first));
                answer.push(ms(launch, useful));
                exec.push(ms(launch_exec, exec_done));
            }
        }
        let output = Stats::of(&output).expect("runs");
        let exec = Stats::of(&exec).expect("runs");
        report.push(RestoreMode {
            mode: mode.to_string(),
            first_exec_over_first_output: exec.median / output.median,
            launch_to_first_output_ms: output,
            launch_to_console_answer_ms: Stats::of(&answer).expect("runs"),
            launch_to_first_exec_ms: exec,
        });
    }
    report
}

#[derive(Serialize)]
struct ForkExec {
    clones: u32,
    /// Fork request sent to its answer (every clone's vCPUs run).
    request_to_running_ms: f64,
    /// Fork request sent to every clone's exec of `true` answered.
    request_to_every_exec_ms: f64,
    /// Each clone's exec answered, from the fork request.
    per_clone_exec_ms: Stats,
}

fn fork_exec(parent_sock: &Path, count: u32) -> ForkExec {
    let start = monotonic_ns();
    let (status, answer) = api::request_with_timeout(
        parent_sock,
        "PUT",
        "/vm/fork",
        Some(&serde_json::json!({ "count": count })),
        TIMEOUT,
    )
    .expect("the fork request");
    let running = monotonic_ns();
    assert!((200..300).contains(&status), "fork: HTTP {status} {answer}");
    let clones: Vec<(PathBuf, u32)> = answer["clones"]
        .as_array()
        .expect("a list of clones")
        .iter()
        .map(|c| {
            (
                PathBuf::from(c["api_sock"].as_str().expect("api_sock")),
                u32::try_from(c["pid"].as_u64().expect("pid")).expect("a pid"),
            )
        })
        .collect();
    let threads: Vec<_> = clones
        .iter()
        .map(|(sock, _)| {
            let sock = sock.clone();
            std::thread::spawn(move || {
                let agent = wait_agent(&sock, TIMEOUT);
                exec_true(&agent);
                monotonic_ns()
            })
        })
        .collect();
    let done: Vec<u64> = threads
        .into_iter()
        .map(|t| t.join().expect("a clone's exec"))
        .collect();
    let last = done.iter().copied().max().unwrap_or(running);
    for (_, pid) in &clones {
        // SAFETY: kill(2) on a clone this benchmark made.
        unsafe { libc::kill(libc::pid_t::try_from(*pid).expect("a pid"), libc::SIGKILL) };
    }
    // Gone before the next N starts (they are the parent VMM's children, not ours to reap: a
    // zombie counts as gone).
    let alive = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|stat| {
                stat.rsplit(')')
                    .next()
                    .map(|rest| rest.trim_start().to_owned())
            })
            .is_some_and(|rest| !rest.starts_with('Z'))
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while clones.iter().any(|(_, pid)| alive(*pid)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let per: Vec<f64> = done.iter().map(|&t| ms(start, t)).collect();
    ForkExec {
        clones: count,
        request_to_running_ms: ms(start, running),
        request_to_every_exec_ms: ms(start, last),
        per_clone_exec_ms: Stats::of(&per).expect("clones"),
    }
}

#[derive(Serialize)]
struct Report {
    benchmark: &'static str,
    machine: Machine,
    guest_mem_mib: u64,
    round_trips: RoundTrips,
    streaming: Streaming,
    restore: Vec<RestoreMode>,
    fork: Vec<ForkExec>,
}

fn main() {
    let args = Args::parse();
    let dir = TestDir::new("bench-exec");
    let (mut guest, sock) = boot(&dir, "bench", args.mem_mib);

    eprintln!("exec bench: {} exec and console round trips", args.runs);
    let round_trips = round_trips(&mut guest, &sock, args.runs);
    eprintln!("exec bench: {} MiB of stdout", args.stream_mib);
    let streaming = streaming(guest.pid(), &sock, args.stream_mib);

    let snap = dir.join("snap");
    let (status, answer) = api::request(&sock, "PUT", "/vm/pause", None).expect("pause");
    assert!(
        (200..300).contains(&status),
        "pause: HTTP {status} {answer}"
    );
    let (status, answer) = api::request(
        &sock,
        "PUT",
        "/vm/snapshot",
        Some(&serde_json::json!({ "path": snap })),
    )
    .expect("snapshot");
    assert!(
        (200..300).contains(&status),
        "snapshot: HTTP {status} {answer}"
    );
    let (status, answer) = api::request(&sock, "PUT", "/vm/resume", None).expect("resume");
    assert!(
        (200..300).contains(&status),
        "resume: HTTP {status} {answer}"
    );
    let restore = restore_modes(&dir, &snap, args.restores);

    let mut fork = Vec::new();
    for &count in &args.clones {
        eprintln!("exec bench: fork {count} → every clone's exec");
        fork.push(fork_exec(&sock, count));
    }
    guest.signal(libc::SIGKILL);
    guest.wait_exit(TIMEOUT);

    let report = Report {
        benchmark: "exec",
        machine: Machine::describe(),
        guest_mem_mib: args.mem_mib,
        round_trips,
        streaming,
        restore,
        fork,
    };
    emit_report("exec", &report, args.out.as_deref());
    let met = |ok: bool| if ok { "met" } else { "NOT met" };
    let rt = &report.round_trips;
    eprintln!("\nexec bench summary ({})", report.machine.kvm);
    eprintln!(
        "  exec `true` p50 {:.2} ms p99 {:.2} ms (open connection p50 {:.2} ms); console round trip p50 {:.2} ms p99 {:.2} ms; ratio {:.2} (target ≤ 0.2: {})",
        rt.exec_true_ms.median,
        rt.exec_true_ms.p99,
        rt.exec_true_open_connection_ms.median,
        rt.console_round_trip_ms.median,
        rt.console_round_trip_ms.p99,
        rt.exec_p50_over_console_p50,
        met(rt.exec_p50_over_console_p50 <= 0.2)
    );
    let s = &report.streaming;
    eprintln!(
        "  stdout {} MiB in {:.2} s = {:.1} MiB/s; VMM RSS (without guest RAM) {} → {} KiB, growth {} KiB (target ≤ 8192: {})",
        s.mib,
        s.seconds,
        s.mib_per_second,
        s.vmm_rss_before_kib,
        s.vmm_rss_peak_kib,
        s.vmm_rss_growth_kib,
        met(s.vmm_rss_growth_kib <= 8192)
    );
    for r in &report.restore {
        eprintln!(
            "  restore {:<5} first output p50 {:.1} ms, console answer {:.1} ms, first exec {:.1} ms: ratio {:.2} (target ≤ 1.2: {})",
            r.mode,
            r.launch_to_first_output_ms.median,
            r.launch_to_console_answer_ms.median,
            r.launch_to_first_exec_ms.median,
            r.first_exec_over_first_output,
            met(r.first_exec_over_first_output <= 1.2)
        );
    }
    for f in &report.fork {
        eprintln!(
            "  fork {:>3}: running {:.1} ms, every clone's exec answered {:.1} ms (per clone p50 {:.1} ms)",
            f.clones, f.request_to_running_ms, f.request_to_every_exec_ms, f.per_clone_exec_ms.median
        );
    }
}
