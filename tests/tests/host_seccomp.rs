//! The seccomp filters (vmm/src/seccomp.rs) are live: the guest-facing threads of a running VMM
//! (probe guest, this machine's KVM) run under a filter and the others do not; a call a filter
//! does not allow ends the process with SIGSYS and a line naming the thread and the call; what
//! the filter allows still works, arguments included (a vCPU thread may issue KVM ioctls, not
//! others).

use std::process::Command;

use mayfly_tests::guest::TestDir;
use mayfly_tests::probe;
use mayfly_vmm::seccomp::{install, ThreadKind};

/// The threads of process `pid`: (name, seccomp mode from /proc: 0 none, 2 filter).
fn threads(pid: u32) -> Vec<(String, u32)> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let task = task.unwrap().path();
        let name = std::fs::read_to_string(task.join("comm")).unwrap_or_default();
        let status = std::fs::read_to_string(task.join("status")).unwrap_or_default();
        let mode = status
            .lines()
            .find_map(|l| l.strip_prefix("Seccomp:"))
            .and_then(|v| v.trim().parse().ok())
            .expect("the kernel reports each thread's seccomp mode");
        out.push((name.trim().to_string(), mode));
    }
    out
}

#[test]
fn the_guest_facing_threads_of_a_running_vmm_are_filtered() {
    let dir = TestDir::new("seccomp-threads");
    let guest = probe::boot(64, &dir.join("vm.sock"), "filtered");
    let threads = threads(guest.pid());
    let mode_of = |name: &str| {
        threads
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("no thread {name} in {threads:?}"))
            .1
    };
    for name in ["vcpu0", "virtio-rng", "virtio-vsock"] {
        assert_eq!(
            mode_of(name),
            2,
            "{name} runs without a filter: {threads:?}"
        );
    }
    // The controller (the main thread) acts for the host's user: no filter.
    assert_eq!(mode_of("mayfly"), 0, "{threads:?}");
}

/// Run `case` (below) in a child process of this test binary; its exit status and stderr.
fn child(case: &str) -> (std::process::ExitStatus, String) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "seccomp_child", "--ignored", "--nocapture"])
        .env("MAYFLY_SECCOMP_CASE", case)
        .env("MAYFLY_SECCOMP", "on")
        .output()
        .unwrap();
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The child's side: a thread under `kind`'s filter makes one call, then the child exits 0.
#[test]
#[ignore = "run by the seccomp tests in a child process"]
fn seccomp_child() {
    let Ok(case) = std::env::var("MAYFLY_SECCOMP_CASE") else {
        return;
    };
    let thread = std::thread::spawn(move || {
        let kind = if case.starts_with("vcpu") {
            ThreadKind::Vcpu
        } else {
            ThreadKind::Device
        };
        install(kind).expect("install the filter");
        // SAFETY: plain system calls on a bad descriptor or making a socket; no memory effects.
        let rc = unsafe {
            match case.as_str() {
                // socket(2): no filter of a vCPU allows it.
                "vcpu-socket" => libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0),
                // An ioctl that is not KVM's (TCGETS): the vCPU filter checks the request.
                "vcpu-tty-ioctl" => libc::ioctl(-1, libc::TCGETS),
                // A KVM ioctl (KVM_GET_API_VERSION) on a bad descriptor: allowed, so EBADF.
                "vcpu-kvm-ioctl" => libc::ioctl(-1, 0xAE00),
                // A device thread makes no ioctl at all.
                "device-ioctl" => libc::ioctl(-1, 0xAE00),
                // Opening a file: refused with EACCES, not SIGSYS (glibc's malloc may try).
                "device-open" => libc::open(
                    c"/proc/sys/vm/overcommit_memory".as_ptr(),
                    libc::O_RDONLY | libc::O_CLOEXEC,
                ),
                other => panic!("unknown case {other}"),
            }
        };
        (rc, std::io::Error::last_os_error().raw_os_error())
    });
    let (rc, errno) = thread.join().unwrap();
    eprintln!("the call returned {rc} (errno {errno:?})");
}

fn assert_killed_by_sigsys(case: &str, expected: &str) {
    use std::os::unix::process::ExitStatusExt;
    let (status, stderr) = child(case);
    assert_eq!(
        status.signal(),
        Some(libc::SIGSYS),
        "{case}: {status:?}, {stderr}"
    );
    assert!(stderr.contains(expected), "{case}: {stderr}");
    assert!(
        !stderr.contains("the call returned"),
        "{case} went on: {stderr}"
    );
}

#[test]
fn a_forbidden_call_from_a_filtered_thread_ends_the_process_with_sigsys() {
    assert_killed_by_sigsys(
        "vcpu-socket",
        "mayfly: seccomp: a vcpu thread made system call 41, which its filter forbids",
    );
    assert_killed_by_sigsys("vcpu-tty-ioctl", "a vcpu thread made system call 16");
    assert_killed_by_sigsys("device-ioctl", "a device thread made system call 16");
}

/// A filtered thread cannot open a file, but the VMM lives on: glibc's malloc opens
/// /proc/sys/vm/overcommit_memory the first time a thread arena shrinks, on whichever thread
/// frees memory then, and copes with the refusal.
#[test]
fn a_filtered_thread_that_opens_a_file_is_refused_and_the_vmm_goes_on() {
    let (status, stderr) = child("device-open");
    assert!(status.success(), "{status:?}: {stderr}");
    assert!(
        stderr.contains(&format!(
            "the call returned -1 (errno Some({}))",
            libc::EACCES
        )),
        "{stderr}"
    );
}

#[test]
fn what_a_filter_allows_still_works() {
    let (status, stderr) = child("vcpu-kvm-ioctl");
    assert!(status.success(), "{status:?}: {stderr}");
    assert!(
        stderr.contains(&format!(
            "the call returned -1 (errno Some({}))",
            libc::EBADF
        )),
        "{stderr}"
    );
}
