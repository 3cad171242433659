//! Guest disk I/O benchmark: sequential read and write (MiB/s) and 4 KiB random read and write
//! (IOPS) on a scratch disk, through mayfly's virtio-blk (the disk writable through the VM's own
//! copy-on-write layer, as `--disk` gives it) against QEMU's virtio-blk on the same image, with
//! the same guest (the Debian template as the root file system, read-only base for both) in the
//! same run; and boot to the agent's first answer from the Debian disk, cold cache and warm.
//! Needs a KVM that runs Linux guests (the test rig here: its times are not real-world times,
//! so the report's point is the ratio to QEMU).
//!
//! The guest runs one small Python program (the template has python3) per measure, with
//! `O_DIRECT` so the guest's page cache is not what is measured; the host's page cache serves
//! both VMMs alike (mayfly reads its base and layer files with pread/preadv, QEMU its raw image
//! with `cache=writeback`). Writes go to mayfly's own top layer, to QEMU's raw file directly:
//! what each user gets. Each measure is fsynced at its end (the write's cost includes making it
//! durable: mayfly's flush is an fdatasync of its layer, QEMU's of its file).
//!
//! Targets (issue "Disks"): guest I/O >= QEMU's in the same run (ratio >= 1.0).
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
use std::time::{Duration, Instant};

use clap::Parser;
use mayfly_benches::{emit_report, qemu_microvm, Machine, Stats};
use mayfly_tests::agent::wait_agent;
use mayfly_tests::guest::{Guest, TestDir};
use serde::Serialize;

/// The guest program: `io.py DEVICE MODE MIB SECONDS` prints one number (MiB/s or IOPS).
const IO_PY: &str = r#"import mmap, os, random, sys, time
dev, mode, mib, secs = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
fd = os.open(dev, os.O_RDWR | os.O_DIRECT)
random.seed(7)
if mode.startswith("seq"):
    buf = mmap.mmap(-1, 1 << 20)
    buf.write(b"\x5a" * (1 << 20))
    t = time.time()
    for i in range(mib):
        (os.pwritev if mode == "seqw" else os.preadv)(fd, [buf], i << 20)
    os.fsync(fd)
    print(mib / (time.time() - t))
else:
    buf = mmap.mmap(-1, 4096)
    buf.write(b"\xa5" * 4096)
    blocks = (mib << 20) // 4096
    op = os.pwritev if mode == "randw" else os.preadv
    n, t = 0, time.time()
    while time.time() - t < secs:
        for _ in range(64):
            op(fd, [buf], random.randrange(blocks) * 4096)
        n += 64
    os.fsync(fd)
    print(n / (time.time() - t))
"#;

#[derive(Parser)]
#[command(
    about = "Benchmark guest disk I/O: mayfly's virtio-blk vs QEMU's; boot from the Debian disk"
)]
struct Args {
    /// The scratch disk's size, MiB (sequential passes cover all of it).
    #[arg(long, default_value_t = 256)]
    disk_mib: u64,
    /// Seconds per random-I/O measure.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Rounds of the four measures per VMM.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Warm boots from the Debian disk measured (after one cold one).
    #[arg(long, default_value_t = 3)]
    boots: usize,
    /// Guest memory, MiB.
    #[arg(long, default_value_t = 512)]
    mem_mib: u64,
    /// Which VMMs to run: both (the ratios need both), mayfly or qemu.
    #[arg(long, default_value = "both", value_parser = ["both", "mayfly", "qemu"])]
    vmm: String,
    /// Write the JSON report here instead of stdout.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Serialize, Default)]
struct VmmReport {
    name: String,
    seq_read_mib_s: Option<Stats>,
    seq_write_mib_s: Option<Stats>,
    rand_read_iops: Option<Stats>,
    rand_write_iops: Option<Stats>,
}

#[derive(Serialize)]
struct BootReport {
    /// `mayfly run --rootfs debian` to the agent's first answer, host page cache dropped, ms.
    cold_ms: Option<f64>,
    /// The same with the image in the host's page cache, ms.
    warm_ms: Option<Stats>,
}

#[derive(Serialize)]
struct Report {
    bench: &'static str,
    machine: Machine,
    image: String,
    disk_mib: u64,
    runs: usize,
    mayfly: Option<VmmReport>,
    qemu: Option<VmmReport>,
    /// mayfly's median over QEMU's, per measure: >= 1.0 meets the target.
    ratios: std::collections::BTreeMap<String, f64>,
    boot_from_debian_disk: Option<BootReport>,
}

fn drop_host_caches() {
    let _ = std::fs::write("/proc/sys/vm/drop_caches", "3");
}

/// A zeroed scratch image (written, not sparse, so reads of it cost what reads of data do).
fn scratch_image(path: &Path, mib: u64) {
    let chunk = vec![0u8; 1 << 20];
    let mut file = std::fs::File::create(path).expect("create the scratch image");
    for _ in 0..mib {
        std::io::Write::write_all(&mut file, &chunk).expect("write the scratch image");
    }
    file.sync_all().expect("sync the scratch image");
}

/// Put the program into the guest and run the measures `args.runs` times on `device`.
fn measure(name: &str, guest: &mut Guest, device: &str, args: &Args) -> VmmReport {
    let encoded = base64(IO_PY.as_bytes());
    guest.run(&format!("echo {encoded} | base64 -d > /tmp/io.py"));
    let mut results: [Vec<f64>; 4] = Default::default();
    let modes = ["seqw", "seqr", "randw", "randr"];
    for _ in 0..args.runs {
        for (mode, samples) in modes.iter().zip(results.iter_mut()) {
            let out = guest.run(&format!(
                "python3 /tmp/io.py {device} {mode} {} {}",
                args.disk_mib, args.seconds
            ));
            match out
                .trim()
                .lines()
                .last()
                .and_then(|l| l.trim().parse::<f64>().ok())
            {
                Some(v) => samples.push(v),
                None => eprintln!("blkio bench: {name} {mode}: {out}"),
            }
        }
    }
    let [sw, sr, rw, rr] = results;
    VmmReport {
        name: name.into(),
        seq_write_mib_s: Stats::of(&sw),
        seq_read_mib_s: Stats::of(&sr),
        rand_write_iops: Stats::of(&rw),
        rand_read_iops: Stats::of(&rr),
    }
}

/// Standard base64, for typing the program into the guest's console.
fn base64(bytes: &[u8]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(
                    ABC[usize::try_from(n >> (18 - 6 * i) & 63).expect("6 bits")],
                ));
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn run_mayfly(args: &Args, image: &Path, dir: &TestDir) -> VmmReport {
    let scratch = dir.join("scratch-mayfly.img");
    scratch_image(&scratch, args.disk_mib);
    eprintln!("blkio bench: mayfly");
    let mut guest = Guest::start(&[
        "run",
        "--mem-mib",
        &args.mem_mib.to_string(),
        "--rootfs",
        &image.to_string_lossy(),
        "--disk",
        &scratch.to_string_lossy(),
        "--disk-dir",
        &dir.arg("mayfly-disks"),
    ]);
    guest.expect_ready();
    let report = measure("mayfly", &mut guest, "/dev/vdb", args);
    guest.signal(libc::SIGTERM);
    guest.wait_exit(Duration::from_secs(60));
    report
}

fn run_qemu(args: &Args, image: &Path, dir: &TestDir) -> Option<VmmReport> {
    let (Some(kernel), Some(_)) = (
        mayfly_vmm::default_guest::DEFAULT_KERNEL,
        mayfly_vmm::default_guest::DEFAULT_INITRAMFS,
    ) else {
        eprintln!("blkio bench: this mayfly has no built-in guest kernel, so no QEMU baseline");
        return None;
    };
    let kernel_path = dir.join("vmlinux");
    std::fs::write(&kernel_path, kernel).expect("write the guest kernel");
    let scratch = dir.join("scratch-qemu.img");
    scratch_image(&scratch, args.disk_mib);
    eprintln!("blkio bench: QEMU baseline");
    let mut command = qemu_microvm("blkio", args.mem_mib, true)?;
    command
        // The template read-only under a throwaway overlay (snapshot=on), as mayfly's base
        // under its layer; the scratch disk raw, written in place.
        .arg("-drive")
        .arg(format!(
            "file={},if=none,id=root,format=raw,readonly=on",
            image.display()
        ))
        .args(["-device", "virtio-blk-device,drive=root"])
        .arg("-drive")
        .arg(format!(
            "file={},if=none,id=scratch,format=raw,cache=writeback,aio=threads",
            scratch.display()
        ))
        .args(["-device", "virtio-blk-device,drive=scratch"])
        .arg("-kernel")
        .arg(&kernel_path)
        .arg("-append")
        .arg(format!(
            "{} acpi=off root=/dev/vda ro rootfstype=ext4 rootwait init=/sbin/init",
            mayfly_vmm::config::DEFAULT_CMDLINE
        ));
    let mut guest = Guest::start_with(&mut command);
    guest.expect_ready();
    // The scratch disk is whichever vd* is not the root (probe order follows the devices).
    let device = guest.run(&format!(
        "for d in /sys/block/vd*; do [ $(cat $d/size) -eq {} ] && echo /dev/${{d##*/}}; done",
        args.disk_mib * 2048
    ));
    let device = device
        .trim()
        .lines()
        .last()
        .unwrap_or("/dev/vdb")
        .to_string();
    let report = measure("qemu", &mut guest, &device, args);
    guest.signal(libc::SIGKILL);
    guest.wait_exit(Duration::from_secs(30));
    Some(report)
}

/// Launch → the agent's first answer, booting the Debian disk.
fn boot_once(image: &Path, dir: &TestDir, n: usize) -> Option<f64> {
    let sock = dir.join(&format!("boot-{n}.sock"));
    let start = Instant::now();
    let mut guest = Guest::start(&[
        "run",
        "--rootfs",
        &image.to_string_lossy(),
        "--api-sock",
        &sock.to_string_lossy(),
        "--console",
        &dir.arg(&format!("boot-{n}.log")),
    ]);
    wait_agent(&sock, Duration::from_secs(300));
    let ms = start.elapsed().as_secs_f64() * 1e3;
    guest.signal(libc::SIGKILL);
    guest.wait_exit(Duration::from_secs(60));
    Some(ms)
}

fn main() {
    let args = Args::parse();
    let image = mayfly_tests::guest::cache_dir().join("rootfs/debian.current/root.ext4");
    let image = if image.is_file() {
        Ok(image)
    } else {
        Err(format!(
            "the Debian image is not built (looked for {}): run rootfs/build.sh debian",
            image.display()
        ))
    };
    let image = image.unwrap_or_else(|e| {
        eprintln!("blkio bench: {e}");
        std::process::exit(1)
    });
    let dir = TestDir::new("blkio-bench");
    let mayfly = (args.vmm != "qemu").then(|| run_mayfly(&args, &image, &dir));
    let qemu = if args.vmm != "mayfly" {
        run_qemu(&args, &image, &dir)
    } else {
        None
    };
    let mut ratios = std::collections::BTreeMap::new();
    if let (Some(m), Some(q)) = (&mayfly, &qemu) {
        for (key, a, b) in [
            ("seq_read", &m.seq_read_mib_s, &q.seq_read_mib_s),
            ("seq_write", &m.seq_write_mib_s, &q.seq_write_mib_s),
            ("rand_read", &m.rand_read_iops, &q.rand_read_iops),
            ("rand_write", &m.rand_write_iops, &q.rand_write_iops),
        ] {
            if let (Some(a), Some(b)) = (a, b) {
                if b.median > 0.0 {
                    ratios.insert(key.to_string(), a.median / b.median);
                }
            }
        }
    }
    let boot = (args.vmm != "qemu" && args.boots > 0).then(|| {
        eprintln!(
            "blkio bench: boot from the Debian disk, cold then {} warm",
            args.boots
        );
        drop_host_caches();
        let cold_ms = boot_once(&image, &dir, 0);
        let warm: Vec<f64> = (1..=args.boots)
            .filter_map(|n| boot_once(&image, &dir, n))
            .collect();
        BootReport {
            cold_ms,
            warm_ms: Stats::of(&warm),
        }
    });
    let report = Report {
        bench: "blkio",
        machine: Machine::describe(),
        image: image.display().to_string(),
        disk_mib: args.disk_mib,
        runs: args.runs,
        mayfly,
        qemu,
        ratios,
        boot_from_debian_disk: boot,
    };
    emit_report("blkio", &report, args.out.as_deref());
}
