//! The sandbox manager (`mayfly serve`), on this machine's KVM with the probe guest: what a
//! sandbox costs through the manager against the same work without it, measured in the same
//! run and interleaved (so a busy machine weighs on both alike).
//!
//! - **create, boot**: `POST /sandboxes` that boots the probe, to the 201;
//! - **create from a template** (cached: a restore of its snapshot) against a **plain
//!   restore** of the same snapshot (`mayfly restore` until its socket answers `GET /vm`),
//!   unjailed and jailed (the manager jails its sandboxes);
//! - **suspend**: `PUT /sandboxes/NAME/pause`, snapshot written and VMM gone;
//! - **wake on request**: a `GET /sandboxes/NAME/vm` to a suspended sandbox, to its answer;
//! - **manager overhead per call**: `GET /sandboxes/NAME/vm` through the manager against
//!   `GET /vm` on the VMM's own socket;
//! - **fork**: `POST /sandboxes/NAME/fork` of a running sandbox into 1 clone (each round) and
//!   into 10 (once), to the 201 (every clone running), with the snapshot's part of it;
//! - **parked**: disk per suspended sandbox (allocated blocks of its own files: the template
//!   it shares with every sandbox made from it counted apart), against the pages it dirtied
//!   (what its last suspend wrote: a diff over the template), and VMM processes left (0);
//! - **many parked**: `--parked N` sandboxes (default 1,000) created from the template and
//!   put to sleep one after another, then all of them asleep at once: disk in all, VMM
//!   processes left, and one of them woken at the end.
//!
//! - **composed** (issue "the pieces compose"): a create from a template with a NIC through
//!   the default (jailed) manager, against a create from a template without one through a
//!   manager started with `--no-jail`, interleaved; manager forks into 1 and 10 (each round)
//!   and 100 (`--fork-100-runs` rounds of their own, last) against `mayfly fork` (`PUT
//!   /vm/fork`) of a plain unjailed VMM into the same counts, in the same run, with the
//!   source's part of each manager fork. Networks go out to a namespace the benchmark makes
//!   (`--net-uplink`). `--composed-only` runs this phase alone.
//!
//! Targets (issue "sandbox manager"): create from a template ≤ 1.5× a plain restore;
//! wake-on-exec ≤ 1.5× restore → first answer; overhead per call ≤ 1 ms; disk per parked
//! sandbox ≤ its dirtied pages + 1 MiB.
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

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Parser;
use mayfly_benches::{emit_report, settle, Machine, Stats};
use mayfly_tests::guest::{memory_kib, Guest, TestDir};
use mayfly_tests::probe;
use mayfly_tests::serve::{call, Manager};
use serde::Serialize;
use serde_json::json;

#[derive(Parser)]
#[command(about = "Benchmark mayfly serve with the probe guest: create, suspend, wake, overhead")]
struct Args {
    /// Repetitions of each measurement.
    #[arg(long, default_value_t = 10)]
    runs: usize,
    /// The probe's memory, MiB.
    #[arg(long, default_value_t = 128)]
    mem_mib: u64,
    /// Requests for the per-call overhead.
    #[arg(long, default_value_t = 200)]
    calls: usize,
    /// Sandboxes parked at once in the last phase.
    #[arg(long, default_value_t = 1000)]
    parked: usize,
    /// Rounds that also fork into 100 (manager and `mayfly fork`): the slowest samples.
    #[arg(long, default_value_t = 3)]
    fork_100_runs: usize,
    /// The manager's pool of networks built ahead of need (`mayfly serve --net-pool`);
    /// its own default (8) when not given.
    #[arg(long)]
    net_pool: Option<u64>,
    /// Only the composed phase (jailed networked creates, forks into 1, 10 and 100); the rest
    /// of the report is left empty.
    #[arg(long)]
    composed_only: bool,
    /// Write the JSON report here instead of stdout.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Serialize)]
struct Report {
    bench: &'static str,
    machine: Machine,
    mem_mib: u64,
    runs: usize,
    create_boot_ms: Stats,
    create_from_template_ms: Stats,
    plain_restore_ms: Stats,
    /// The same restore jailed (`--jail`), as the manager's sandboxes are.
    plain_restore_jailed_ms: Stats,
    /// Median create from a template / median plain restore (target ≤ 1.5).
    create_over_restore: f64,
    /// Median create from a template / median jailed plain restore: the manager's own part.
    create_over_jailed_restore: f64,
    suspend_ms: Stats,
    wake_on_request_ms: Stats,
    /// Median wake on request / median plain restore (target ≤ 1.5).
    wake_over_restore: f64,
    /// Median wake on request / median jailed plain restore: the manager's own part.
    wake_over_jailed_restore: f64,
    via_manager_call_ms: Stats,
    direct_call_ms: Stats,
    /// Median through the manager − median direct (target ≤ 1 ms).
    overhead_per_call_ms: f64,
    /// Allocated bytes of one suspended sandbox's own files (its diff snapshot, logs, record;
    /// not the template's files it links).
    parked_disk_bytes: u64,
    /// What it dirtied since the template: the memory its suspends wrote.
    parked_dirty_bytes: u64,
    /// parked_disk_bytes − parked_dirty_bytes (target ≤ 1 MiB).
    parked_overhead_bytes: i64,
    /// The template's own files, shared by every sandbox made from it.
    template_disk_bytes: u64,
    /// Sandboxes asleep at once in the last phase, and what it took to get there.
    many_parked: usize,
    many_parked_create_and_suspend_s: f64,
    /// Allocated bytes of all their directories (shared files counted once).
    many_parked_disk_bytes: u64,
    /// Their VMM processes still running (0: RAM ≈ 0).
    many_parked_vmm_processes: usize,
    /// One of them woken by a request, to its answer.
    many_parked_wake_ms: f64,
    /// VMM processes of the parked sandboxes still running (RAM ≈ 0 means 0).
    parked_vmm_processes: usize,
    /// `POST .../fork {"count":1}` of a running sandbox → 201.
    fork_1_ms: Stats,
    /// The snapshot's part of those forks (pause, snapshot, resume, seal), as the answer says.
    fork_1_snapshot_ms: Stats,
    /// One fork of a running sandbox into 10 clones → 201.
    fork_10_ms: f64,
    /// Its snapshot's part.
    fork_10_snapshot_ms: f64,
    #[serde(flatten)]
    composed: ComposedFigures,
}

/// `--composed-only`: the composed phase's figures alone.
#[derive(Serialize)]
struct ComposedReport {
    bench: &'static str,
    machine: Machine,
    mem_mib: u64,
    runs: usize,
    fork_100_runs: usize,
    #[serde(flatten)]
    composed: ComposedFigures,
}

#[derive(Serialize)]
struct ComposedFigures {
    /// A create from a template with a NIC, jailed (the default manager) → 201.
    create_jailed_with_net_ms: Stats,
    /// A create from a template without a NIC through a manager started with --no-jail.
    create_unjailed_without_net_ms: Stats,
    /// Median jailed networked create / median unjailed create without a network (target ≤ 1.5).
    jailed_net_over_unjailed: f64,
    /// Manager fork of a running sandbox into N (→ 201), and `mayfly fork` of a plain VMM
    /// into N (`PUT /vm/fork` → its answer), N = 1 and 10 one sample each per round, N = 100
    /// in `--fork-100-runs` rounds of their own after those (none: its ratio is null).
    manager_fork_ms: Vec<(usize, Stats)>,
    /// The source's part of those (the answer's `snapshot_ms`: 0 for a running source, which
    /// is no longer put to sleep for a fork).
    manager_fork_source_snapshot_ms: Vec<(usize, Stats)>,
    /// How long the source was paused for the fork's capture (the answer's
    /// `source_paused_ms`; target ≤ 10 ms).
    manager_fork_source_paused_ms: Vec<(usize, Stats)>,
    /// Each clone of a manager fork into 100, right after it: its processes' (VMM and jail
    /// waiter) proportional set size, KiB (target ≤ 1 MiB beyond its dirtied pages; the
    /// probe dirties none after the fork), and its VMM's resident set, KiB, for scale.
    manager_clone_pss_kib: Stats,
    manager_clone_vmm_rss_kib: Stats,
    /// Each such clone's own memory (its processes' private pages, Private_Clean +
    /// Private_Dirty), KiB: what one more clone costs the host. Its PSS also counts its share
    /// of the template's memory file in the page cache, which a clone maps whole where the
    /// kernel maps the file's 2 MiB folios with one entry each (its RSS then is the guest's).
    manager_clone_private_kib: Stats,
    mayfly_fork_ms: Vec<(usize, Stats)>,
    /// Median manager fork / median `mayfly fork`, per N (target at 100: ≤ 1.5).
    manager_over_mayfly_fork: Vec<(usize, f64)>,
    /// The manager's network pool (`--net-pool`) and how long the benchmark waited for it to
    /// be full before each timed networked create and each fork (the manager's, and
    /// `mayfly fork`'s, which a refill would otherwise slow), ms (not in the figures).
    net_pool_size: usize,
    net_pool_wait_ms: Stats,
    /// How long the benchmark waited for the host's CPUs to be idle (see
    /// `mayfly_benches::settle`) before each timed fork, ms (not in the figures).
    settle_ms: Stats,
}

impl ComposedFigures {
    fn of(composed: &Composed) -> ComposedFigures {
        let median = |v: &[f64]| Stats::of(v).map_or(0.0, |s| s.median);
        let stats = |runs: &[(usize, Vec<f64>)]| {
            runs.iter()
                .map(|(n, v)| (*n, Stats::of(v).unwrap_or_default()))
                .collect()
        };
        ComposedFigures {
            jailed_net_over_unjailed: median(&composed.net_create) / median(&composed.bare_create),
            create_jailed_with_net_ms: Stats::of(&composed.net_create).unwrap_or_default(),
            create_unjailed_without_net_ms: Stats::of(&composed.bare_create).unwrap_or_default(),
            manager_over_mayfly_fork: composed
                .manager_fork
                .iter()
                .zip(&composed.mayfly_fork)
                .map(|((n, a), (_, b))| (*n, median(a) / median(b)))
                .collect(),
            manager_fork_ms: stats(&composed.manager_fork),
            manager_fork_source_snapshot_ms: stats(&composed.manager_snapshot),
            manager_fork_source_paused_ms: stats(&composed.manager_paused),
            manager_clone_pss_kib: Stats::of(&composed.clone_pss_kib).unwrap_or_default(),
            manager_clone_vmm_rss_kib: Stats::of(&composed.clone_rss_kib).unwrap_or_default(),
            manager_clone_private_kib: Stats::of(&composed.clone_private_kib).unwrap_or_default(),
            mayfly_fork_ms: stats(&composed.mayfly_fork),
            net_pool_size: composed.pool_size,
            net_pool_wait_ms: Stats::of(&composed.pool_wait_ms).unwrap_or_default(),
            settle_ms: Stats::of(&composed.settle_ms).unwrap_or_default(),
        }
    }

    fn say(&self) {
        eprintln!(
            "serve bench: jailed create with a NIC {:.2} ms vs unjailed without {:.2} ms ({:.2}x); \
             manager fork / mayfly fork: {:?}",
            self.create_jailed_with_net_ms.median,
            self.create_unjailed_without_net_ms.median,
            self.jailed_net_over_unjailed,
            self.manager_over_mayfly_fork
        );
    }
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

fn ok(status: u16, body: &serde_json::Value, what: &str) {
    assert!(status < 300, "{what}: {status} {body}");
}

/// `mayfly restore` of `snap` until its socket answers, with the options the manager gives
/// it (a name, a console file); ms. The VMM is killed afterwards.
fn plain_restore(snap: &Path, sock: &Path, console: &Path, jail: bool) -> f64 {
    let start = Instant::now();
    let snap = snap.to_string_lossy();
    let sock_arg = sock.to_string_lossy();
    let console = console.to_string_lossy();
    let mut args = vec![
        "restore",
        &snap,
        "--name",
        "plain",
        "--api-sock",
        &sock_arg,
        "--console",
        &console,
    ];
    if jail {
        args.push("--jail");
    }
    let vmm = Guest::start(&args);
    loop {
        if let Ok((200, _)) =
            mayfly_api::request_with_timeout(sock, "GET", "/vm", None, Duration::from_secs(5))
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let took = ms(start);
    drop(vmm);
    took
}

fn main() {
    let args = Args::parse();
    let dir = TestDir::new("serve-bench");
    // Networks (the composed phase) go out to a namespace of the benchmark's own.
    let net = mayfly_tests::netns::TestNet::new(&dir);
    let pool = args.net_pool.map(|n| n.to_string());
    let mut manager_args = net.args();
    if let Some(n) = &pool {
        manager_args.extend(["--net-pool", n]);
    }
    let m = Manager::start_with(&dir, &manager_args);
    let spec = |name: &str| {
        json!({
            "name": name,
            "kernel": probe::ELF,
            "mem_mib": args.mem_mib,
            "cmdline": "touch=1",
            "probe": true,
        })
    };

    // A template of the probe (booted once and snapshotted by the manager); its snapshot is
    // what the plain restores restore.
    let template = json!({
        "kernel": probe::ELF,
        "mem_mib": args.mem_mib,
        "cmdline": "touch=1",
        "probe": true,
    });
    m.create(json!({ "name": "template", "template": template }));
    let (_, vm) = m.admin("GET", "/sandboxes/template/vm", None);
    let snap = PathBuf::from(
        vm["origin"]
            .as_str()
            .and_then(|o| o.strip_prefix("restore of "))
            .expect("a sandbox made from a template is a restore"),
    );

    if args.composed_only {
        let composed = ComposedFigures::of(&composed(&args, &m, &template));
        composed.say();
        let report = ComposedReport {
            bench: "serve-composed",
            machine: Machine::describe(),
            mem_mib: args.mem_mib,
            runs: args.runs,
            fork_100_runs: args.fork_100_runs,
            composed,
        };
        emit_report("serve-composed", &report, args.out.as_deref());
        return;
    }

    let (mut boot, mut from_snap, mut restore, mut suspend, mut wake) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut restore_jailed = Vec::new();
    let (mut fork_1, mut fork_1_snapshot) = (Vec::new(), Vec::new());
    for i in 0..args.runs {
        eprintln!("serve bench: round {}/{}", i + 1, args.runs);
        let start = Instant::now();
        let (status, body) = m.admin("POST", "/sandboxes", Some(spec(&format!("boot{i}"))));
        ok(status, &body, "create");
        boot.push(ms(start));

        restore.push(plain_restore(
            &snap,
            &dir.join("plain.sock"),
            &dir.join("plain.log"),
            false,
        ));
        restore_jailed.push(plain_restore(
            &snap,
            &dir.join("plain.sock"),
            &dir.join("plain.log"),
            true,
        ));
        let start = Instant::now();
        let (status, body) = m.admin(
            "POST",
            "/sandboxes",
            Some(json!({ "name": format!("snap{i}"), "template": template })),
        );
        ok(status, &body, "create from a template");
        from_snap.push(ms(start));

        let start = Instant::now();
        let (status, body) = m.admin("PUT", &format!("/sandboxes/snap{i}/pause"), None);
        ok(status, &body, "suspend");
        suspend.push(ms(start));
        let start = Instant::now();
        let (status, body) = m.admin("GET", &format!("/sandboxes/snap{i}/vm"), None);
        ok(status, &body, "wake");
        wake.push(ms(start));

        let start = Instant::now();
        let (status, body) = m.admin(
            "POST",
            &format!("/sandboxes/snap{i}/fork"),
            Some(json!({ "count": 1 })),
        );
        ok(status, &body, "fork into 1");
        fork_1.push(ms(start));
        fork_1_snapshot.push(body["snapshot_ms"].as_f64().unwrap_or(f64::NAN));
    }
    let start = Instant::now();
    let (status, fork_10) = m.admin(
        "POST",
        "/sandboxes/snap0/fork",
        Some(json!({ "count": 10 })),
    );
    ok(status, &fork_10, "fork into 10");
    let fork_10_ms = ms(start);

    let composed = composed(&args, &m, &template);

    // Per-call overhead: the same request through the manager and straight to the VMM.
    let vm_sock = PathBuf::from(m.describe("snap0")["socket"].as_str().unwrap());
    let (mut via, mut direct) = (Vec::new(), Vec::new());
    for _ in 0..args.calls {
        let start = Instant::now();
        let (status, body) = m.admin("GET", "/sandboxes/snap0/vm", None);
        ok(status, &body, "via the manager");
        via.push(ms(start));
        let start = Instant::now();
        let (status, body) = call(&vm_sock, None, "GET", "/vm", None);
        ok(status, &body, "direct");
        direct.push(ms(start));
    }

    // Parked: every sandbox suspended.
    let (_, list) = m.admin("GET", "/sandboxes", None);
    let names: Vec<String> = list["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap().to_string())
        .collect();
    for name in &names {
        let (status, body) = m.admin("PUT", &format!("/sandboxes/{name}/pause"), None);
        ok(status, &body, "park");
    }
    let template_files = inodes(&snap);
    let parked_disk = du_own(&m.state.join("sandboxes/snap0"), &template_files);
    // What it dirtied since the template: what each of its sleeps wrote, each a diff of the
    // pages written since the last (fewer than five sleeps: never compacted).
    let parked_dirty: u64 = m
        .event_lines("suspended", "snap0")
        .iter()
        .filter_map(|e| e["memory_bytes_written"].as_u64())
        .sum();
    let template_disk = du_own(&snap, &HashSet::new());
    let parked_vmm_processes = names
        .iter()
        .filter(|n| !m.describe(n)["pid"].is_null())
        .count();
    for name in &names {
        m.admin("DELETE", &format!("/sandboxes/{name}"), None);
    }

    // Many parked: each created from the template and put to sleep at once.
    let start = Instant::now();
    for i in 0..args.parked {
        if i % 100 == 0 {
            eprintln!("serve bench: parking {i}/{}", args.parked);
        }
        let name = format!("park{i}");
        let (status, body) = m.admin(
            "POST",
            "/sandboxes",
            Some(json!({ "name": name, "template": template })),
        );
        ok(status, &body, "create to park");
        let (status, body) = m.admin("PUT", &format!("/sandboxes/{name}/pause"), None);
        ok(status, &body, "park");
    }
    let many_parked_s = start.elapsed().as_secs_f64();
    let (_, list) = m.admin("GET", "/sandboxes", None);
    let parked: Vec<&serde_json::Value> = list["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["name"].as_str().is_some_and(|n| n.starts_with("park")))
        .collect();
    assert_eq!(parked.len(), args.parked, "{list}");
    let many_parked_vmm_processes = parked.iter().filter(|s| !s["pid"].is_null()).count();
    let many_parked_disk = du_own(&m.state.join("sandboxes"), &template_files);
    let start = Instant::now();
    let (status, body) = m.admin("GET", "/sandboxes/park0/vm", None);
    ok(status, &body, "wake a parked sandbox");
    let many_parked_wake_ms = ms(start);

    let median = |v: &[f64]| Stats::of(v).map_or(0.0, |s| s.median);
    let report = Report {
        bench: "serve",
        machine: Machine::describe(),
        mem_mib: args.mem_mib,
        runs: args.runs,
        create_over_restore: median(&from_snap) / median(&restore),
        create_over_jailed_restore: median(&from_snap) / median(&restore_jailed),
        plain_restore_jailed_ms: Stats::of(&restore_jailed).unwrap_or_default(),
        wake_over_restore: median(&wake) / median(&restore),
        wake_over_jailed_restore: median(&wake) / median(&restore_jailed),
        overhead_per_call_ms: median(&via) - median(&direct),
        create_boot_ms: Stats::of(&boot).unwrap_or_default(),
        create_from_template_ms: Stats::of(&from_snap).unwrap_or_default(),
        plain_restore_ms: Stats::of(&restore).unwrap_or_default(),
        suspend_ms: Stats::of(&suspend).unwrap_or_default(),
        wake_on_request_ms: Stats::of(&wake).unwrap_or_default(),
        via_manager_call_ms: Stats::of(&via).unwrap_or_default(),
        direct_call_ms: Stats::of(&direct).unwrap_or_default(),
        parked_disk_bytes: parked_disk,
        parked_dirty_bytes: parked_dirty,
        parked_overhead_bytes: i64::try_from(parked_disk).unwrap_or(i64::MAX)
            - i64::try_from(parked_dirty).unwrap_or(i64::MAX),
        template_disk_bytes: template_disk,
        many_parked: args.parked,
        many_parked_create_and_suspend_s: many_parked_s,
        many_parked_disk_bytes: many_parked_disk,
        many_parked_vmm_processes,
        many_parked_wake_ms,
        parked_vmm_processes,
        fork_1_ms: Stats::of(&fork_1).unwrap_or_default(),
        fork_1_snapshot_ms: Stats::of(&fork_1_snapshot).unwrap_or_default(),
        fork_10_ms,
        fork_10_snapshot_ms: fork_10["snapshot_ms"].as_f64().unwrap_or(f64::NAN),
        composed: ComposedFigures::of(&composed),
    };
    report.composed.say();
    eprintln!(
        "serve bench: create from a template {:.2} ms vs plain restore {:.2} ms ({:.2}x; jailed \
         {:.2} ms, {:.2}x), wake on request {:.2} ms ({:.2}x), suspend {:.1} ms, overhead per \
         call {:.3} ms, parked {} KiB (dirtied {} KiB), fork into 1 {:.1} ms, into 10 {:.1} ms; \
         {} parked: {} MiB, {} VMMs running, one woken in {:.1} ms",
        median(&from_snap),
        median(&restore),
        report.create_over_restore,
        median(&restore_jailed),
        report.create_over_jailed_restore,
        median(&wake),
        report.wake_over_restore,
        median(&suspend),
        report.overhead_per_call_ms,
        parked_disk >> 10,
        parked_dirty >> 10,
        median(&fork_1),
        fork_10_ms,
        args.parked,
        many_parked_disk >> 20,
        many_parked_vmm_processes,
        many_parked_wake_ms
    );
    emit_report("serve", &report, args.out.as_deref());
}

/// Walk everything under `path` (itself included) not in `seen` yet, adding it there and
/// handing `visit` its metadata.
fn walk(path: &Path, seen: &mut HashSet<(u64, u64)>, mut visit: impl FnMut(&std::fs::Metadata)) {
    use std::os::unix::fs::MetadataExt;
    let mut stack = vec![path.to_path_buf()];
    while let Some(path) = stack.pop() {
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if !seen.insert((meta.dev(), meta.ino())) {
            continue;
        }
        visit(&meta);
        if meta.is_dir() {
            if let Ok(entries) = std::fs::read_dir(&path) {
                stack.extend(entries.flatten().map(|e| e.path()));
            }
        }
    }
}

/// The (device, inode) of every file under `path`.
fn inodes(path: &Path) -> HashSet<(u64, u64)> {
    let mut seen = HashSet::new();
    walk(path, &mut seen, |_| {});
    seen
}

/// Allocated bytes under `path`, each file once, none of `shared`'s.
fn du_own(path: &Path, shared: &HashSet<(u64, u64)>) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    walk(path, &mut shared.clone(), |meta| {
        total += meta.blocks() * 512
    });
    total
}

/// What the composed phase measured.
struct Composed {
    net_create: Vec<f64>,
    bare_create: Vec<f64>,
    manager_fork: Vec<(usize, Vec<f64>)>,
    /// The source's part of each manager fork (`snapshot_ms`: pause, snapshot, resume, seal).
    manager_snapshot: Vec<(usize, Vec<f64>)>,
    /// The source's pause for each manager fork (`source_paused_ms`).
    manager_paused: Vec<(usize, Vec<f64>)>,
    /// Per clone of the forks into 100: PSS of its VMM and waiter, RSS of its VMM, KiB.
    clone_pss_kib: Vec<f64>,
    clone_rss_kib: Vec<f64>,
    clone_private_kib: Vec<f64>,
    mayfly_fork: Vec<(usize, Vec<f64>)>,
    /// The manager's `--net-pool` size, and the waits for it to be full before each timed
    /// networked create and fork (the pool is built ahead of need: a burst right after
    /// another finds it refilling).
    pool_size: usize,
    pool_wait_ms: Vec<f64>,
    settle_ms: Vec<f64>,
}

/// The longest the benchmark waits for the host to be idle before a timed fork.
const SETTLE: Duration = Duration::from_secs(10);

/// Wait (at most 60 s) until the manager's network pool holds `size` slots; how long, ms.
fn wait_for_pool(m: &Manager, size: usize) -> f64 {
    let net_dir = m
        .state
        .parent()
        .expect("the manager's test directory")
        .join("net");
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(60) {
        let held = std::fs::read_dir(&net_dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".ready"))
            .filter(|e| std::fs::read_to_string(e.path()).is_ok_and(|t| t.contains("held ")))
            .count();
        if held >= size {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    ms(start)
}

/// One manager fork of the running sandbox `net-warm` into `count` and one `mayfly fork` of the
/// plain VMM at `sock` into as many, their clones ended after each; the times go to slot `k`.
fn fork_pair(m: &Manager, sock: &Path, count: usize, out: &mut Composed, k: usize) {
    out.pool_wait_ms.push(wait_for_pool(m, out.pool_size));
    out.settle_ms.push(settle(SETTLE));
    let start = Instant::now();
    let (status, body) = m.admin(
        "POST",
        "/sandboxes/net-warm/fork",
        Some(json!({ "count": count })),
    );
    ok(status, &body, "manager fork");
    out.manager_fork[k].1.push(ms(start));
    out.manager_snapshot[k]
        .1
        .push(body["snapshot_ms"].as_f64().unwrap_or(f64::NAN));
    out.manager_paused[k]
        .1
        .push(body["source_paused_ms"].as_f64().unwrap_or(f64::NAN));
    if count >= 100 {
        for clone in body["clones"].as_array().into_iter().flatten() {
            let Some(waiter) = clone["pid"].as_u64() else {
                continue;
            };
            let vmm = std::fs::read_to_string(format!("/proc/{waiter}/task/{waiter}/children"))
                .ok()
                .and_then(|c| c.split_whitespace().next()?.parse::<u64>().ok());
            let (Some(waiter), Some(vmm)) = (memory_kib(waiter), vmm.and_then(memory_kib)) else {
                continue;
            };
            out.clone_pss_kib.push((waiter.pss + vmm.pss) as f64);
            out.clone_private_kib
                .push((waiter.private + vmm.private) as f64);
            out.clone_rss_kib.push(vmm.rss as f64);
        }
    }
    for clone in body["clones"].as_array().into_iter().flatten() {
        let name = clone["name"].as_str().unwrap_or_default();
        m.admin("DELETE", &format!("/sandboxes/{name}"), None);
    }
    // The pool refilled first: its building would otherwise run beside the baseline; and the
    // host idle again (the clones' ends go on after their deletes have answered).
    out.pool_wait_ms.push(wait_for_pool(m, out.pool_size));
    out.settle_ms.push(settle(SETTLE));
    let start = Instant::now();
    let (status, body) = mayfly_api::request_with_timeout(
        sock,
        "PUT",
        "/vm/fork",
        Some(&json!({ "count": count })),
        Duration::from_secs(120),
    )
    .expect("the plain VMM answers its fork");
    ok(status, &body, "mayfly fork");
    out.mayfly_fork[k].1.push(ms(start));
    for clone in body["clones"].as_array().into_iter().flatten() {
        if let Some(pid) = clone["pid"]
            .as_u64()
            .and_then(|p| libc::pid_t::try_from(p).ok())
        {
            // SAFETY: kill(2) of a clone this benchmark's fork made.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

/// The composed sandbox against its parts: see the module docs.
fn composed(args: &Args, m: &Manager, template: &serde_json::Value) -> Composed {
    const COUNTS: [usize; 3] = [1, 10, 100];
    let unjailed_dir = TestDir::new("serve-bench-unjailed");
    let u = Manager::start_with(&unjailed_dir, &["--no-jail"]);
    let mut net_template = template.clone();
    net_template["net"] = json!("allow=192.0.2.1");
    // Each template built once before the timed creates.
    m.create(json!({ "name": "net-warm", "template": net_template }));
    u.create(json!({ "name": "bare-warm", "template": template }));
    // A plain unjailed VMM for `mayfly fork`, and a running sandbox for the manager's.
    let sock = unjailed_dir.join("plain-fork.sock");
    let sock_arg = sock.to_string_lossy().into_owned();
    let mem = args.mem_mib.to_string();
    let log = unjailed_dir.arg("plain-fork.log");
    let _vmm = Guest::start(&[
        "run",
        "--probe",
        "--kernel",
        probe::ELF,
        "--mem-mib",
        &mem,
        "--cmdline",
        "touch=1",
        "--api-sock",
        &sock_arg,
        "--console",
        &log,
    ]);
    while !matches!(
        mayfly_api::request_with_timeout(&sock, "GET", "/vm", None, Duration::from_secs(5)),
        Ok((200, _))
    ) {
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut out = Composed {
        net_create: Vec::new(),
        bare_create: Vec::new(),
        manager_fork: COUNTS.iter().map(|n| (*n, Vec::new())).collect(),
        manager_snapshot: COUNTS.iter().map(|n| (*n, Vec::new())).collect(),
        manager_paused: COUNTS.iter().map(|n| (*n, Vec::new())).collect(),
        clone_pss_kib: Vec::new(),
        clone_rss_kib: Vec::new(),
        clone_private_kib: Vec::new(),
        mayfly_fork: COUNTS.iter().map(|n| (*n, Vec::new())).collect(),
        pool_size: args
            .net_pool
            .map_or(8, |n| usize::try_from(n).unwrap_or(usize::MAX)),
        pool_wait_ms: Vec::new(),
        settle_ms: Vec::new(),
    };
    for i in 0..args.runs {
        eprintln!("serve bench: composed round {}/{}", i + 1, args.runs);
        out.pool_wait_ms.push(wait_for_pool(m, out.pool_size));
        let start = Instant::now();
        let (status, body) = m.admin(
            "POST",
            "/sandboxes",
            Some(json!({ "name": format!("net{i}"), "template": net_template, "net": "allow=192.0.2.1" })),
        );
        ok(status, &body, "jailed create with a NIC");
        out.net_create.push(ms(start));
        let start = Instant::now();
        let (status, body) = u.admin(
            "POST",
            "/sandboxes",
            Some(json!({ "name": format!("bare{i}"), "template": template })),
        );
        ok(status, &body, "unjailed create without a NIC");
        out.bare_create.push(ms(start));
        for (k, count) in COUNTS.iter().enumerate() {
            if *count <= 10 {
                fork_pair(m, &sock, *count, &mut out, k);
            }
        }
    }
    // Forks into 100 last, in rounds of their own: ending 100 jailed VMMs (and their
    // networks) weighs on whatever is measured right after.
    for i in 0..args.fork_100_runs {
        eprintln!(
            "serve bench: fork into 100, round {}/{}",
            i + 1,
            args.fork_100_runs
        );
        for (k, count) in COUNTS.iter().enumerate() {
            if *count > 10 {
                fork_pair(m, &sock, *count, &mut out, k);
            }
        }
    }
    for i in 0..args.runs {
        m.admin("DELETE", &format!("/sandboxes/net{i}"), None);
        u.admin("DELETE", &format!("/sandboxes/bare{i}"), None);
    }
    m.admin("DELETE", "/sandboxes/net-warm", None);
    u.admin("DELETE", "/sandboxes/bare-warm", None);
    out
}
