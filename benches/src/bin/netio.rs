//! Guest network I/O benchmark: TCP throughput guest→host and host→guest, and ICMP round
//! trips, through mayfly's virtio-net against QEMU's on the same kind of network, in the same
//! run. Needs a KVM that runs Linux guests (the test rig here: its times are not real-world
//! times, so the report's point is the ratio to QEMU).
//!
//! The two VMMs get identical networks: a `mayfly_network` VM network each (a namespace of its
//! own with the tap, nftables policy `open`, SNAT, a veth to an uplink namespace this benchmark
//! creates), the same kernel, initramfs and guest address. mayfly opens its own with `--net
//! open`; QEMU (microvm, `virtio-net-device`, vhost off: a userspace device like mayfly's) is
//! handed the tap of one made here (`-netdev tap,fd=3`), with that network's MAC. The servers
//! live in an "internet" namespace behind the uplink (a veth between the two, forwarding on in
//! the uplink, routes both ways; a VM never reaches the uplink's own addresses, which are the
//! host's), on a public documentation address: a sink (the guest sends), a source (the guest
//! receives) and the address pinged; each transfer is timed by the server, from the connection
//! to the last byte (sink) or to the guest's close after the last byte (source). The guest is
//! driven over its serial console, the same way for both.
//!
//! Targets (issue "Network"): throughput >= QEMU's in the same run (ratio >= 1.0).
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
use std::io::{Read, Write};
use std::net::{Ipv4Addr, Shutdown, TcpListener};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Command;
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use clap::Parser;
use mayfly_benches::{emit_report, qemu_microvm, Machine, Stats};
use mayfly_network::{Network, NetworkConfig, Policy, Uplink, VmNetwork};
use mayfly_tests::guest::{Guest, TestDir};
use mayfly_vmm::config::DEFAULT_CMDLINE;
use serde::Serialize;

/// The servers' address (a public documentation one), in the internet namespace.
const SERVER: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
/// The link between the uplink and the internet (a /30).
const LINK_UPLINK: Ipv4Addr = Ipv4Addr::new(100, 100, 0, 1);
const LINK_INTERNET: Ipv4Addr = Ipv4Addr::new(100, 100, 0, 2);
const SINK_PORT: u16 = 5001;
const SOURCE_PORT: u16 = 5002;

#[derive(Parser)]
#[command(about = "Benchmark guest TCP throughput and round trips: mayfly's virtio-net vs QEMU's")]
struct Args {
    /// MiB per transfer.
    #[arg(long, default_value_t = 64)]
    mib: u64,
    /// Transfers per direction and VMM.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Pings per VMM.
    #[arg(long, default_value_t = 20)]
    pings: u32,
    /// Guest memory, MiB.
    #[arg(long, default_value_t = 256)]
    mem_mib: u64,
    /// Which VMMs to run: both (the report's ratios need both), mayfly or qemu.
    #[arg(long, default_value = "both", value_parser = ["both", "mayfly", "qemu"])]
    vmm: String,
    /// Write the JSON report here instead of stdout.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Serialize, Default)]
struct VmmReport {
    name: String,
    /// Guest to host, MiB/s, as the sink saw it.
    guest_to_host_mib_s: Option<Stats>,
    /// Host to guest, MiB/s.
    host_to_guest_mib_s: Option<Stats>,
    /// ICMP echo round trip, guest to the server and back, ms (busybox ping's average).
    ping_avg_ms: Option<f64>,
}

#[derive(Serialize)]
struct Report {
    bench: &'static str,
    machine: Machine,
    mib_per_transfer: u64,
    runs: usize,
    mayfly: VmmReport,
    qemu: Option<VmmReport>,
    /// mayfly's median over QEMU's: >= 1.0 meets the target.
    ratio_guest_to_host: Option<f64>,
    ratio_host_to_guest: Option<f64>,
    /// QEMU's round trip over mayfly's (> 1: mayfly is faster).
    ratio_ping: Option<f64>,
}

/// The namespaces of the benchmark's own: the uplink the VM networks go out to (the host) and
/// the internet behind it, with the server address on its loopback.
struct Namespaces {
    uplink: File,
    internet: File,
}

fn new_namespace() -> File {
    std::thread::spawn(|| {
        // SAFETY: unshare affects only this short-lived thread.
        let rc = unsafe { libc::unshare(libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "unshare(CLONE_NEWNET): run as root");
        File::open("/proc/thread-self/ns/net").expect("the new namespace")
    })
    .join()
    .expect("the namespace thread")
}

fn ns_path(ns: &File) -> String {
    format!("/proc/{}/fd/{}", std::process::id(), ns.as_raw_fd())
}

/// `ip ARGS` (split at spaces) inside `ns`, `what` the namespace's name for errors.
fn ip_in(ns: &File, what: &str, args: &str) {
    let fd = ns.as_raw_fd();
    let mut cmd = Command::new("ip");
    cmd.args(args.split(' '));
    // SAFETY: setns only, between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let status = cmd.status().expect("ip (iproute2) is installed");
    assert!(status.success(), "ip {args} in the {what} namespace");
}

impl Namespaces {
    /// The uplink and the internet, joined by a veth: the uplink forwards to the internet
    /// (its default route), the internet routes the VMs' outside addresses (the slot pool) back.
    fn new() -> Self {
        let namespaces = Self {
            uplink: new_namespace(),
            internet: new_namespace(),
        };
        let (uplink, internet) = (&namespaces.uplink, &namespaces.internet);
        let pool = NetworkConfig::default().pool;
        ip_in(internet, "internet", "link set lo up");
        ip_in(
            internet,
            "internet",
            &format!("addr add {SERVER}/32 dev lo"),
        );
        ip_in(uplink, "uplink", "link set lo up");
        ip_in(
            uplink,
            "uplink",
            &format!(
                "link add up0 type veth peer name inet0 netns {}",
                ns_path(internet)
            ),
        );
        for args in [
            format!("addr add {LINK_UPLINK}/30 dev up0"),
            "link set up0 up".to_string(),
            format!("route add default via {LINK_INTERNET}"),
        ] {
            ip_in(uplink, "uplink", &args);
        }
        for args in [
            format!("addr add {LINK_INTERNET}/30 dev inet0"),
            "link set inet0 up".to_string(),
            format!("route add {pool} via {LINK_UPLINK}"),
        ] {
            ip_in(internet, "internet", &args);
        }
        mayfly_network::run_in(uplink, || {
            std::fs::write("/proc/sys/net/ipv4/ip_forward", "1")
        })
        .expect("enter the uplink namespace")
        .expect("turn forwarding on in the uplink namespace");
        namespaces
    }

    fn uplink_path(&self) -> String {
        ns_path(&self.uplink)
    }

    /// A listener on the server's address, in the internet namespace.
    fn listen(&self, port: u16) -> TcpListener {
        // The listener keeps the namespace it was made in.
        mayfly_network::run_in(&self.internet, || TcpListener::bind((SERVER, port)))
            .expect("enter the internet namespace")
            .expect("bind a server")
    }
}

/// The sink: each connection's MiB/s, from its accept to its `bytes`th byte.
fn sink(listener: TcpListener, bytes: u64) -> Receiver<f64> {
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let start = Instant::now();
            let mut got = 0u64;
            let mut buf = vec![0u8; 1 << 16];
            while got < bytes {
                match conn.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => got += n as u64,
                }
            }
            if got >= bytes {
                let _ = tx.send(mib(bytes) / start.elapsed().as_secs_f64());
            }
        }
    });
    rx
}

/// The source: sends `bytes` to each connection; MiB/s from the accept to the guest's close
/// after the last byte.
fn source(listener: TcpListener, bytes: u64) -> Receiver<f64> {
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        let buf = vec![0x5au8; 1 << 16];
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let start = Instant::now();
            let mut sent = 0u64;
            while sent < bytes {
                let n = usize::try_from((bytes - sent).min(1 << 16)).expect("at most 64 KiB");
                if conn.write_all(&buf[..n]).is_err() {
                    break;
                }
                sent += n as u64;
            }
            let _ = conn.shutdown(Shutdown::Write);
            let mut rest = [0u8; 64];
            while matches!(conn.read(&mut rest), Ok(n) if n > 0) {}
            if sent == bytes {
                let _ = tx.send(mib(bytes) / start.elapsed().as_secs_f64());
            }
        }
    });
    rx
}

#[allow(clippy::cast_precision_loss)]
fn mib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1u32 << 20)
}

/// Run the transfers and pings in a booted guest.
fn measure(
    name: &str,
    guest: &mut Guest,
    sink: &Receiver<f64>,
    source: &Receiver<f64>,
    args: &Args,
) -> VmmReport {
    let count = args.mib * 16;
    let mut up = Vec::new();
    let mut down = Vec::new();
    // A transfer whose client could not even connect has nothing to wait for.
    let wait = |out: &str| {
        if out.contains("can't connect") {
            Duration::ZERO
        } else {
            Duration::from_secs(60)
        }
    };
    for _ in 0..args.runs {
        let out = guest.run(&format!(
            "dd if=/dev/zero bs=65536 count={count} 2>/dev/null | nc -w 30 {SERVER} {SINK_PORT}"
        ));
        match sink.recv_timeout(wait(&out)) {
            Ok(rate) => up.push(rate),
            Err(_) => eprintln!("netio bench: {name}: an upload did not complete: {out}"),
        }
        let out = guest.run(&format!("nc -w 30 {SERVER} {SOURCE_PORT} | wc -c"));
        match source.recv_timeout(wait(&out)) {
            Ok(rate) => down.push(rate),
            Err(_) => eprintln!("netio bench: {name}: a download did not complete: {out}"),
        }
    }
    if up.is_empty() || down.is_empty() {
        let config = guest.run("cat /proc/cmdline; ip addr; ip route; dmesg | grep -i -e virtio -e eth0 -e mayfly | tail -20");
        eprintln!("netio bench: {name}: the guest's network:\n{config}");
    }
    let ping = guest.run(&format!("ping -c {} -i 0.2 {SERVER}", args.pings));
    // busybox: "round-trip min/avg/max = 0.321/0.456/0.789 ms"
    let ping_avg_ms = ping
        .lines()
        .find_map(|l| l.split("= ").nth(1))
        .and_then(|v| v.split('/').nth(1))
        .and_then(|v| v.parse().ok());
    if ping_avg_ms.is_none() {
        eprintln!("netio bench: {name}: no round trip in: {ping}");
    }
    VmmReport {
        name: name.to_string(),
        guest_to_host_mib_s: Stats::of(&up),
        host_to_guest_mib_s: Stats::of(&down),
        ping_avg_ms,
    }
}

/// QEMU's microvm on the tap of `network`, with its MAC and the same guest.
fn start_qemu(network: &mut VmNetwork, mem_mib: u64, dir: &TestDir) -> Option<Guest> {
    let tap: OwnedFd = network.take_tap().expect("the network's tap");
    let mac = mayfly_vmm::devices::net::mac_text(network.guest().mac);
    let cmdline = format!(
        "{DEFAULT_CMDLINE} acpi=off {}",
        mayfly_vmm::devices::net::guest_cmdline_arg(network.guest())
    );
    // Exactly the guest mayfly boots: the kernel and initramfs built into this mayfly.
    let (Some(kernel), Some(initramfs)) = (
        mayfly_vmm::default_guest::DEFAULT_KERNEL,
        mayfly_vmm::default_guest::DEFAULT_INITRAMFS,
    ) else {
        eprintln!("netio bench: this mayfly has no built-in guest, so no QEMU baseline");
        return None;
    };
    let (kernel_path, initramfs_path) = (dir.join("vmlinux"), dir.join("initramfs.cpio"));
    std::fs::write(&kernel_path, kernel).expect("write the guest kernel");
    std::fs::write(&initramfs_path, initramfs).expect("write the guest initramfs");
    // acpi=off: the devices are then on the kernel command line (virtio_mmio.device=),
    // which QEMU writes itself; the guest is told acpi=off too.
    let mut command = qemu_microvm("netio", mem_mib, true)?;
    command
        .args(["-netdev", "tap,id=n0,fd=3,vhost=off"])
        .args(["-device", &format!("virtio-net-device,netdev=n0,mac={mac}")])
        .arg("-kernel")
        .arg(&kernel_path)
        .arg("-initrd")
        .arg(&initramfs_path)
        .arg("-append")
        .arg(cmdline);
    let raw = tap.as_raw_fd();
    // SAFETY: dup2 between fork and exec puts the tap at the descriptor QEMU is told (3),
    // without close-on-exec.
    unsafe {
        command.pre_exec(move || {
            if libc::dup2(raw, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let guest = Guest::start_with(&mut command);
    drop(tap);
    Some(guest)
}

fn main() {
    let args = Args::parse();
    let bytes = args.mib << 20;
    let namespaces = Namespaces::new();
    let sink = sink(namespaces.listen(SINK_PORT), bytes);
    let source = source(namespaces.listen(SOURCE_PORT), bytes);
    let dir = TestDir::new("netio-bench");
    let mayfly = if args.vmm != "qemu" {
        Some(run_mayfly(&args, &namespaces, &dir, &sink, &source))
    } else {
        None
    };
    let qemu = if args.vmm != "mayfly" {
        run_qemu(&args, &namespaces, &dir, &sink, &source)
    } else {
        None
    };
    let mayfly = mayfly.unwrap_or_default();
    let ratio = |m: &Option<Stats>, q: Option<&Option<Stats>>| match (m, q) {
        (Some(m), Some(Some(q))) if q.median > 0.0 => Some(m.median / q.median),
        _ => None,
    };
    let report = Report {
        bench: "netio",
        machine: Machine::describe(),
        mib_per_transfer: args.mib,
        runs: args.runs,
        ratio_guest_to_host: ratio(
            &mayfly.guest_to_host_mib_s,
            qemu.as_ref().map(|q| &q.guest_to_host_mib_s),
        ),
        ratio_host_to_guest: ratio(
            &mayfly.host_to_guest_mib_s,
            qemu.as_ref().map(|q| &q.host_to_guest_mib_s),
        ),
        ratio_ping: match (
            mayfly.ping_avg_ms,
            qemu.as_ref().and_then(|q| q.ping_avg_ms),
        ) {
            (Some(m), Some(q)) if m > 0.0 => Some(q / m),
            _ => None,
        },
        mayfly,
        qemu,
    };
    emit_report("netio", &report, args.out.as_deref());
}

fn run_mayfly(
    args: &Args,
    namespaces: &Namespaces,
    dir: &TestDir,
    sink: &Receiver<f64>,
    source: &Receiver<f64>,
) -> VmmReport {
    eprintln!(
        "netio bench: mayfly, {} x {} MiB each way",
        args.runs, args.mib
    );
    let mut guest = Guest::start(&[
        "run",
        "--mem-mib",
        &args.mem_mib.to_string(),
        "--net",
        "open",
        "--net-dir",
        &dir.arg("net"),
        "--net-uplink",
        &namespaces.uplink_path(),
    ]);
    guest.expect_ready();
    let report = measure("mayfly", &mut guest, sink, source, args);
    guest.signal(libc::SIGTERM);
    guest.wait_exit(Duration::from_secs(60));
    report
}

fn run_qemu(
    args: &Args,
    namespaces: &Namespaces,
    dir: &TestDir,
    sink: &Receiver<f64>,
    source: &Receiver<f64>,
) -> Option<VmmReport> {
    eprintln!("netio bench: QEMU baseline");
    let network = Network::new(NetworkConfig {
        state_dir: dir.join("qemu-net"),
        uplink: Uplink::Path(PathBuf::from(namespaces.uplink_path())),
        ..NetworkConfig::default()
    })
    .and_then(|n| n.create(&Policy::Open, None));
    match network {
        Ok(mut network) => start_qemu(&mut network, args.mem_mib, dir).map(|mut guest| {
            guest.expect_ready();
            let report = measure("qemu", &mut guest, sink, source, args);
            guest.signal(libc::SIGKILL);
            guest.wait_exit(Duration::from_secs(30));
            drop(network);
            report
        }),
        Err(e) => {
            eprintln!("netio bench: no network for QEMU: {e}");
            None
        }
    }
}
