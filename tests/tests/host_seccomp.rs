//! The seccomp filters (vmm/src/seccomp.rs) are live: every thread of a running VMM (probe
//! guest, this machine's KVM) but the controller runs under a filter: vCPUs, devices, the
//! control socket, the console's input and the lazy-memory handler; a call a filter does not
//! allow ends the process with SIGSYS and a line naming the thread and the call; what the
//! filter allows still works, arguments included (a vCPU thread may issue KVM ioctls, not
//! others; the control socket's threads may start threads, not processes).

use std::process::Command;

use mayfly_jail::seccomp::{install, ThreadKind};
use mayfly_tests::guest::{mayfly_ok, Guest, TestDir};
use mayfly_tests::probe::{self, TIMEOUT};

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
fn every_thread_of_a_running_vmm_but_the_controller_is_filtered() {
    let dir = TestDir::new("seccomp-threads");
    let sock = dir.join("vm.sock");
    let guest = probe::boot(64, &sock, "filtered");
    let booted = threads(guest.pid());
    for name in ["vcpu0", "virtio-rng", "virtio-vsock", "api"] {
        assert_eq!(mode_of(&booted, name), 2, "{name} runs without a filter");
    }
    // The controller (the main thread) acts for the host's user: no filter.
    assert_eq!(mode_of(&booted, "mayfly"), 0, "{booted:?}");

    // A lazy restore with console input: its page-fault handler and the console's input
    // thread are filtered too, and so is a connection thread the control socket starts.
    let snap = dir.join("snap");
    mayfly_ok(&[
        "snapshot",
        "--sock",
        &sock.to_string_lossy(),
        &snap.to_string_lossy(),
    ]);
    drop(guest);
    // A FIFO, as a fork gives each clone: its reader lives as long as the VM.
    let input = dir.join("console.in");
    let fifo = std::ffi::CString::new(input.to_string_lossy().as_bytes()).unwrap();
    // SAFETY: mkfifo of a NUL-terminated path in the test's own directory.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    let rsock = dir.join("restored.sock");
    let restored = Guest::start(&[
        "restore",
        &snap.to_string_lossy(),
        "--memory",
        "lazy",
        "--console",
        "/dev/null",
        "--console-input",
        &input.to_string_lossy(),
        "--api-sock",
        &rsock.to_string_lossy(),
    ]);
    assert!(
        restored.wait_stderr("mayfly-probe: verified", TIMEOUT),
        "the restored probe did not verify its pages: {}",
        restored.stderr()
    );
    // A connection the server holds open while the threads are read: its thread is there.
    let mut held = std::os::unix::net::UnixStream::connect(&rsock).unwrap();
    std::io::Write::write_all(&mut held, b"GET /vm HTTP/1.1\r\n").unwrap();
    let deadline = std::time::Instant::now() + TIMEOUT;
    let running = loop {
        let running = threads(restored.pid());
        if running.iter().any(|(n, _)| n == "api-conn") || std::time::Instant::now() > deadline {
            break running;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    for name in ["vcpu0", "api", "api-conn", "console-in", "mayfly-lazy-mem"] {
        assert_eq!(mode_of(&running, name), 2, "{name} runs without a filter");
    }
    assert_eq!(mode_of(&running, "mayfly"), 0, "{running:?}");
    // Still served: the request finished on the filtered connection thread gets its answer.
    std::io::Write::write_all(&mut held, b"Host: x\r\n\r\n").unwrap();
    let mut answer = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(&held), &mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

#[test]
fn a_vmm_standing_by_reads_its_requests_on_a_filtered_thread() {
    let dir = TestDir::new("seccomp-standby");
    let sock = dir.join("s.sock");
    let vmm = probe::standby(&sock, &[]);
    // Answered first: the thread installs its filter before it reads anything, so once a
    // request has its answer the filter is on. (Looked at as soon as the thread had its name,
    // it was caught once in CI between the two, filter not yet installed.)
    let deadline = std::time::Instant::now() + TIMEOUT;
    let (status, body) = loop {
        match mayfly_api::request_with_timeout(&sock, "GET", "/vm", None, TIMEOUT) {
            Ok(answer) => break answer,
            // Its socket not bound and listening yet.
            Err(_) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            Err(e) => panic!("GET /vm of a VMM standing by: {e}"),
        }
    };
    assert_eq!(
        (status, &body["state"]),
        (200, &serde_json::json!("standby")),
        "{body}"
    );
    let standing = threads(vmm.pid());
    // What clients send is read by the thread waiting on the socket, under the control
    // socket's filter; the controller only gets the snapshot's path from it.
    assert_eq!(mode_of(&standing, "api"), 2, "{standing:?}");
    assert_eq!(mode_of(&standing, "mayfly"), 0, "{standing:?}");
}

/// The seccomp mode of the thread called `name` among `threads`.
fn mode_of(threads: &[(String, u32)], name: &str) -> u32 {
    threads
        .iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("no thread {name} in {threads:?}"))
        .1
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
        let kind = match case.split('-').next() {
            Some("vcpu") => ThreadKind::Vcpu,
            Some("api") => ThreadKind::Api,
            Some("lazy") => ThreadKind::LazyMemory,
            Some("console") => ThreadKind::Console,
            _ => ThreadKind::Device,
        };
        // A "fork-" case installs its filter in the child it forks.
        if !case.starts_with("fork-") {
            install(kind).expect("install the filter");
        }
        // SAFETY: plain system calls on a bad descriptor, making a socket, or forking a child
        // that exits at once; no memory effects in this process.
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
                // The control socket's threads start threads (clone3 refused with ENOSYS,
                // glibc falls back to clone with CLONE_THREAD): the new thread runs.
                "api-thread" => std::thread::spawn(|| 7).join().map_or(-1, |v| v),
                // Unix sockets only: not the host's network.
                "api-inet-socket" => libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0),
                // ... and never a process: fork(2) is clone without CLONE_THREAD.
                "api-fork" => {
                    let pid = libc::fork();
                    if pid == 0 {
                        libc::_exit(0);
                    }
                    pid
                }
                // Nor run a program.
                "api-exec" => libc::execv(c"/bin/true".as_ptr(), [std::ptr::null()].as_ptr()),
                // The lazy-memory handler: userfaultfd's ioctls (UFFDIO_API on a bad
                // descriptor: EBADF), no socket.
                "lazy-uffd-ioctl" => libc::ioctl(-1, 0xc018_aa3f_u64),
                "lazy-socket" => libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0),
                // The console's input reads and queues; no ioctl.
                "console-ioctl" => libc::ioctl(-1, libc::TCGETS),
                // Signals to this process's own threads (signal 0: nothing delivered)...
                "device-tgkill-own" => libc::syscall(
                    libc::SYS_tgkill,
                    libc::getpid(),
                    libc::syscall(libc::SYS_gettid),
                    0,
                ) as i32,
                // ... never to another process (an unjailed VMM is root).
                "device-tgkill-other" => libc::syscall(libc::SYS_tgkill, 1, 1, 0) as i32,
                // A process forked after the filters were compiled (a fork's clone) binds
                // them to itself: its own threads may be signalled, its parent may not.
                "fork-tgkill" => {
                    mayfly_jail::seccomp::prepare().expect("compile the filters");
                    let parent = libc::getpid();
                    let pid = libc::fork();
                    if pid == 0 {
                        if install(ThreadKind::Device).is_err() {
                            libc::_exit(2);
                        }
                        let own = libc::syscall(
                            libc::SYS_tgkill,
                            libc::getpid(),
                            libc::syscall(libc::SYS_gettid),
                            0,
                        );
                        if own != 0 {
                            libc::_exit(3);
                        }
                        // Ends the child with SIGSYS.
                        libc::syscall(libc::SYS_tgkill, parent, parent, 0);
                        libc::_exit(4);
                    }
                    let mut status = 0;
                    libc::waitpid(pid, &mut status, 0);
                    if libc::WIFSIGNALED(status) {
                        100 + libc::WTERMSIG(status)
                    } else {
                        libc::WEXITSTATUS(status)
                    }
                }
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
    assert_killed_by_sigsys(
        "api-fork",
        &format!(
            "a control socket thread made system call {}",
            libc::SYS_clone
        ),
    );
    assert_killed_by_sigsys(
        "api-inet-socket",
        "a control socket thread made system call 41",
    );
    assert_killed_by_sigsys(
        "api-exec",
        &format!(
            "a control socket thread made system call {}",
            libc::SYS_execve
        ),
    );
    assert_killed_by_sigsys("lazy-socket", "a lazy memory thread made system call 41");
    assert_killed_by_sigsys(
        "console-ioctl",
        "a console input thread made system call 16",
    );
    assert_killed_by_sigsys(
        "device-tgkill-other",
        &format!("a device thread made system call {}", libc::SYS_tgkill),
    );
}

/// tgkill reaches this process's own threads only: the filters bind the process that
/// installs them, a fork's clone included.
#[test]
fn signals_reach_only_the_processes_own_threads() {
    let (status, stderr) = child("device-tgkill-own");
    assert!(status.success(), "{status:?}: {stderr}");
    assert!(stderr.contains("the call returned 0 "), "{stderr}");
    let (status, stderr) = child("fork-tgkill");
    assert!(status.success(), "{status:?}: {stderr}");
    assert!(
        stderr.contains(&format!("the call returned {} ", 100 + libc::SIGSYS)),
        "the forked child's own tgkill failed, or its parent's went through: {stderr}"
    );
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
    for case in ["vcpu-kvm-ioctl", "lazy-uffd-ioctl"] {
        let (status, stderr) = child(case);
        assert!(status.success(), "{case}: {status:?}: {stderr}");
        assert!(
            stderr.contains(&format!(
                "the call returned -1 (errno Some({}))",
                libc::EBADF
            )),
            "{case}: {stderr}"
        );
    }
    let (status, stderr) = child("api-thread");
    assert!(status.success(), "{status:?}: {stderr}");
    assert!(stderr.contains("the call returned 7 "), "{stderr}");
}
