//! Boot the default guest on a KVM that runs Linux (the host's, or the test rig's) and check
//! what it prints and how the VMM ends. Run through tests/run, which picks where.

use std::time::Duration;

use mayfly_tests::guest::{guest_artifact, Guest, BOOT_TIMEOUT};
use mayfly_vmm::config::DEFAULT_CMDLINE;

const EXIT_TIMEOUT: Duration = Duration::from_secs(60);

#[test]
fn default_guest_answers_commands_and_powers_off() {
    let mut guest = Guest::start(&["run"]);
    let ready = guest.expect_ready();
    assert!(ready.contains("cpus=1"), "{ready}");

    let uname = guest.run("uname -a");
    assert!(
        uname.starts_with("Linux mayfly 6.1."),
        "uname said {uname:?}"
    );
    assert!(uname.contains("x86_64"), "{uname}");
    // Input goes through the UART FIFO in pieces: a long line must arrive whole.
    let long = "x".repeat(300);
    assert_eq!(guest.run(&format!("echo {long} | wc -c")), "301");
    // The guest's wall clock comes from the host (kvmclock): within a minute of ours.
    let guest_time: i64 = guest.run("date +%s").parse().unwrap();
    let host_time = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    assert!(
        (guest_time - host_time).abs() < 60,
        "guest {guest_time} host {host_time}"
    );

    guest.send("poweroff\n");
    let status = guest.wait_exit(EXIT_TIMEOUT);
    assert_eq!(status.code(), Some(0), "stderr: {}", guest.stderr());
}

#[test]
fn two_vcpus_are_two_cpus_in_the_guest() {
    let mut guest = Guest::start(&["run", "--vcpus", "2"]);
    let ready = guest.expect_ready();
    assert!(ready.contains("cpus=2"), "{ready}");
    assert_eq!(guest.run("grep -c ^processor /proc/cpuinfo"), "2");
    assert_eq!(guest.run("cat /sys/devices/system/cpu/online"), "0-1");
    guest.send("poweroff -f\n");
    assert_eq!(guest.wait_exit(EXIT_TIMEOUT).code(), Some(0));
}

#[test]
fn mp_table_alone_brings_up_both_cpus() {
    // acpi=off: the guest finds its CPUs and IOAPIC through the MP table only.
    let cmdline = format!("{DEFAULT_CMDLINE} acpi=off");
    let mut guest = Guest::start(&["run", "--vcpus", "2", "--cmdline", &cmdline]);
    let ready = guest.expect_ready();
    assert!(ready.contains("cpus=2"), "{ready}");
    assert_eq!(guest.run("cat /sys/devices/system/cpu/online"), "0-1");
    // Without ACPI there is no power-off: reboot through the i8042 instead.
    guest.send("reboot -f\n");
    assert_eq!(guest.wait_exit(EXIT_TIMEOUT).code(), Some(133));
}

#[test]
fn guest_reboot_ends_the_vmm_with_status_133() {
    let mut guest = Guest::start(&["run"]);
    guest.expect_ready();
    guest.send("reboot\n");
    let status = guest.wait_exit(EXIT_TIMEOUT);
    assert_eq!(status.code(), Some(133), "stderr: {}", guest.stderr());
    assert!(
        guest.stderr().contains("the guest rebooted"),
        "{}",
        guest.stderr()
    );
}

#[test]
fn sigterm_stops_the_vmm_with_status_143() {
    let mut guest = Guest::start(&["run"]);
    guest.expect_ready();
    guest.signal(libc::SIGTERM);
    assert_eq!(guest.wait_exit(EXIT_TIMEOUT).code(), Some(143));
}

#[test]
fn bzimage_boots_with_an_explicit_initrd_and_cmdline() {
    let bzimage = guest_artifact("kernel/microvm.current/bzImage");
    let initrd = guest_artifact("rootfs/guest.current/initramfs.cpio");
    let cmdline = format!("{DEFAULT_CMDLINE} mayfly.marker=42");
    let mut guest = Guest::start(&[
        "run",
        "--kernel",
        bzimage.to_str().unwrap(),
        "--initrd",
        initrd.to_str().unwrap(),
        "--cmdline",
        &cmdline,
        "--mem-mib",
        "192",
    ]);
    guest.expect_ready();
    assert!(guest.run("cat /proc/cmdline").contains("mayfly.marker=42"));
    // 192 MiB minus what the kernel keeps for itself.
    let total_kib: u64 = guest
        .run("awk '/MemTotal/ {print $2}' /proc/meminfo")
        .parse()
        .unwrap();
    assert!(
        (150_000..=196_608).contains(&total_kib),
        "MemTotal {total_kib} kB"
    );
    guest.send("poweroff -f\n");
    assert_eq!(guest.wait_exit(EXIT_TIMEOUT).code(), Some(0));
}

#[test]
fn memory_above_the_4gib_gap_is_usable() {
    // 3.25 GiB: 3 GiB below the MMIO gap, the rest above 4 GiB.
    let mut guest = Guest::start(&["run", "--mem-mib", "3328"]);
    guest.expect_ready();
    let total_kib: u64 = guest
        .run("awk '/MemTotal/ {print $2}' /proc/meminfo")
        .parse()
        .unwrap();
    assert!(total_kib > 3 * 1024 * 1024, "MemTotal {total_kib} kB");
    // Fill 400 MiB of tmpfs, which must come from above 4 GiB once the low RAM is short.
    assert_eq!(
        guest.run("dd if=/dev/zero of=/tmp/fill bs=1M count=400 2>/dev/null; ls -l /tmp/fill | awk '{print $5}'"),
        (400u64 << 20).to_string()
    );
    guest.send("poweroff -f\n");
    assert_eq!(guest.wait_exit(EXIT_TIMEOUT).code(), Some(0));
}

#[test]
fn console_can_go_to_a_file() {
    let dir = std::env::temp_dir().join(format!("mayfly-console-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("console.log");
    let mut guest = Guest::start(&["run", "--console", log.to_str().unwrap()]);
    let deadline = std::time::Instant::now() + BOOT_TIMEOUT;
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains("mayfly-guest: ready") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no readiness line in {text:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        guest.console().is_empty(),
        "nothing on stdout when the console is a file"
    );
    guest.signal(libc::SIGTERM);
    assert_eq!(guest.wait_exit(EXIT_TIMEOUT).code(), Some(143));
    let _ = std::fs::remove_dir_all(&dir);
}
