//! Network setup benchmark, on this machine (no guest): what giving a VM its network costs the
//! VMM, as `mayfly run --net`, a restore and every clone do it (a namespace of its own with a
//! tap, a veth to the uplink, the nftables ruleset and policy), and what the pre-built pool
//! would make of it.
//!
//! Measured, each over `--vms` networks (default 100) going out to an uplink namespace of the
//! benchmark's own (no traffic is sent anywhere):
//! - **cold, one after another**: `Network::new` + `create` per VM, as each VMM does today;
//! - **cold, in parallel**: the same on every core at once, as a fork's clones do (each clone
//!   process makes its own);
//! - **pool**: `prewarm` of the whole set (counted: it is work someone does ahead), then a
//!   claim per VM;
//! - **set_policy** (a runtime change) and **destroy**.
//!
//! Target (issue "Network"): a clone's network ready <= 2 ms on the host, pre-created
//! namespaces allowed if counted honestly.
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

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Parser;
use mayfly_benches::{emit_report, Machine, Stats};
use mayfly_network::{Network, NetworkConfig, Policy, Uplink};
use serde::Serialize;

#[derive(Parser)]
#[command(about = "Benchmark making VM networks: namespace, tap, veth, nftables policy")]
struct Args {
    /// Networks per measurement.
    #[arg(long, default_value_t = 100)]
    vms: usize,
    /// Slot locks and pooled namespaces go here (removed afterwards).
    #[arg(long, default_value = "/run/mayfly/net-bench")]
    state_dir: PathBuf,
    /// Write the JSON report here instead of stdout.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Serialize)]
struct Report {
    bench: &'static str,
    machine: Machine,
    vms: usize,
    policy: String,
    /// Each VM's network made from nothing, one after another, ms.
    cold_each_ms: Stats,
    cold_total_ms: f64,
    /// The same with one maker per core at once (a fork's clones), ms per network.
    cold_parallel_each_ms: Stats,
    cold_parallel_total_ms: f64,
    parallel_makers: usize,
    /// Building `vms` slots into the pool ahead of time, ms in all.
    pool_prewarm_total_ms: f64,
    /// Claiming a pooled slot and applying the VM's policy, ms.
    pool_claim_each_ms: Stats,
    /// The same for the pool `mayfly serve --net-pool` keeps (namespace and attached tap held
    /// open by the keeper, taken with pidfd_getfd): building it, ms in all; a claim, ms.
    held_pool_prewarm_total_ms: f64,
    held_pool_claim_each_ms: Stats,
    /// A runtime policy change, ms.
    set_policy_ms: Stats,
    /// Tearing all of them down, ms in all.
    destroy_total_ms: f64,
}

fn ms_since(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1e3
}

fn uplink_namespace() -> File {
    std::thread::spawn(|| {
        // SAFETY: unshare affects only this short-lived thread.
        let rc = unsafe { libc::unshare(libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "unshare(CLONE_NEWNET): run as root");
        File::open("/proc/thread-self/ns/net").expect("the new namespace")
    })
    .join()
    .expect("the namespace thread")
}

fn network(state_dir: &Path, uplink: &File) -> Network {
    Network::new(NetworkConfig {
        state_dir: state_dir.to_path_buf(),
        uplink: Uplink::Path(PathBuf::from(format!(
            "/proc/{}/fd/{}",
            std::process::id(),
            uplink.as_raw_fd()
        ))),
        ..NetworkConfig::default()
    })
    .unwrap_or_else(|e| {
        eprintln!("net bench: {e}");
        std::process::exit(1)
    })
}

fn main() {
    let args = Args::parse();
    let _ = std::fs::remove_dir_all(&args.state_dir);
    let uplink = uplink_namespace();
    let policy: Policy = "allow=198.51.100.0/24:443,203.0.113.0/24"
        .parse()
        .expect("a valid policy");

    // Cold, one after another: Network::new (tools checked, sweep) + create, as a VMM does.
    let mut cold = Vec::with_capacity(args.vms);
    let mut vms = Vec::with_capacity(args.vms);
    let all = Instant::now();
    for _ in 0..args.vms {
        let start = Instant::now();
        let net = network(&args.state_dir, &uplink);
        vms.push(net.create(&policy, None).expect("a network"));
        cold.push(ms_since(start));
    }
    let cold_total_ms = ms_since(all);
    let mut set_policy = Vec::with_capacity(args.vms);
    for vm in &mut vms {
        let start = Instant::now();
        vm.set_policy(Policy::Open).expect("a policy change");
        set_policy.push(ms_since(start));
    }
    let start = Instant::now();
    drop(vms);
    let destroy_total_ms = ms_since(start);

    // Cold, in parallel: one maker per core.
    let makers = std::thread::available_parallelism().map_or(2, |n| n.get());
    let all = Instant::now();
    let parallel: Vec<(f64, mayfly_network::VmNetwork)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..makers)
            .map(|m| {
                let (state_dir, uplink, policy) = (&args.state_dir, &uplink, &policy);
                let count = args.vms / makers + usize::from(m < args.vms % makers);
                s.spawn(move || {
                    (0..count)
                        .map(|_| {
                            let start = Instant::now();
                            let vm = network(state_dir, uplink)
                                .create(policy, None)
                                .expect("a network");
                            (ms_since(start), vm)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("a maker"))
            .collect()
    });
    let cold_parallel_total_ms = ms_since(all);
    let cold_parallel: Vec<f64> = parallel.iter().map(|(ms, _)| *ms).collect();
    drop(parallel);

    // The pool: built ahead, then claimed.
    let net = network(&args.state_dir, &uplink);
    let start = Instant::now();
    net.prewarm(args.vms).expect("prewarm");
    let pool_prewarm_total_ms = ms_since(start);
    let mut claim = Vec::with_capacity(args.vms);
    let mut vms = Vec::with_capacity(args.vms);
    for _ in 0..args.vms {
        let start = Instant::now();
        vms.push(net.create(&policy, None).expect("a pooled network"));
        claim.push(ms_since(start));
    }
    drop(vms);
    let _ = net.drain_pool();

    // The pool as `mayfly serve --net-pool` keeps it: held open by its keeper (this
    // process), taken with pidfd_getfd, its tap attached already.
    let start = Instant::now();
    let held: Vec<_> = (0..args.vms)
        .map(|_| net.prewarm_held().expect("a held pool slot"))
        .collect();
    let held_prewarm_total_ms = ms_since(start);
    let mut held_claim = Vec::with_capacity(args.vms);
    let mut vms = Vec::with_capacity(args.vms);
    for _ in 0..args.vms {
        let start = Instant::now();
        vms.push(net.create(&policy, None).expect("a held pooled network"));
        held_claim.push(ms_since(start));
    }
    drop(vms);
    drop(held);
    let _ = std::fs::remove_dir_all(&args.state_dir);

    let stats = |v: &[f64]| Stats::of(v).expect("samples");
    let report = Report {
        bench: "net",
        machine: Machine::describe(),
        vms: args.vms,
        policy: policy.to_string(),
        cold_each_ms: stats(&cold),
        cold_total_ms,
        cold_parallel_each_ms: stats(&cold_parallel),
        cold_parallel_total_ms,
        parallel_makers: makers,
        pool_prewarm_total_ms,
        pool_claim_each_ms: stats(&claim),
        held_pool_prewarm_total_ms: held_prewarm_total_ms,
        held_pool_claim_each_ms: stats(&held_claim),
        set_policy_ms: stats(&set_policy),
        destroy_total_ms,
    };
    emit_report("net", &report, args.out.as_deref());
}
