//! What the VMM must not trust: guest memory, snapshot files, slow clients, another VMM racing
//! for the same socket. These run on this machine's own KVM with the probe guest (no Linux
//! guest needed), and each would fail on a VMM that trusted its input.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use mayfly_snapshot::{MemoryRange, VmState};
use mayfly_tests::guest::{mayfly_bin, mayfly_output, request, Guest, TestDir};
use mayfly_tests::probe;

const TIMEOUT: Duration = Duration::from_secs(60);

/// Boot a probe VM named `name` and snapshot it into `dir/snap`; the VM is stopped after.
fn probe_snapshot(dir: &TestDir, name: &str) -> PathBuf {
    let sock = dir.join(&format!("{name}.sock"));
    let mut vm = probe::boot(64, &sock, name);
    let snap = dir.join(&format!("{name}-snap"));
    probe::snapshot(&sock, &snap);
    vm.signal(libc::SIGTERM);
    vm.wait_exit(TIMEOUT);
    snap
}

/// `mayfly restore ARGS` that must fail: its exit status and stderr. Fails the test if it is
/// still running after `TIMEOUT` (a restore must never hang on bad input).
fn restore_refused(args: &[&str]) -> String {
    let mut all = vec!["restore"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--console", "/dev/null"]);
    let out = mayfly_output(&all, TIMEOUT);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

fn assert_contains(text: &str, expected: &str) {
    assert!(text.contains(expected), "expected {expected:?} in {text:?}");
}

/// A copy of `snap` (memory hard-linked) with another state file.
fn with_state(dir: &TestDir, snap: &Path, name: &str, state: &[u8]) -> String {
    let path = dir.join(name);
    std::fs::create_dir_all(&path).unwrap();
    std::fs::hard_link(snap.join("memory"), path.join("memory")).unwrap();
    std::fs::write(path.join("state"), state).unwrap();
    path.to_string_lossy().into_owned()
}

/// The snapshot's state, decoded, changed by `edit` and encoded again: a state file with a
/// valid checksum that asks for something else.
fn edited_state(snap: &Path, edit: impl FnOnce(&mut VmState)) -> Vec<u8> {
    let bytes = std::fs::read(snap.join("state")).unwrap();
    let (header, mut state): (mayfly_snapshot::Header, VmState) =
        mayfly_snapshot::file::decode(&bytes, "state").unwrap();
    edit(&mut state);
    mayfly_snapshot::file::encode(&header, &state).unwrap()
}

fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if entry.file_type().unwrap().is_dir() {
            out.extend(files_under(&path));
        } else {
            out.push(path);
        }
    }
    out.sort();
    out
}

#[test]
fn a_name_the_guest_writes_into_its_identity_page_decides_nothing_on_the_host() {
    let dir = TestDir::new("identity");
    let snap = probe_snapshot(&dir, "victim");
    // The guest owns its memory: here it "writes" a name that climbs out of the VM's
    // directory into its identity page (0xee000), as a hostile guest would.
    let memory = std::fs::OpenOptions::new()
        .write(true)
        .open(snap.join("memory"))
        .unwrap();
    let mut page = vec![0u8; 4096];
    let evil = b"name=../outside/target\nindex=7\nparent=../../etc\ngeneration=9\n";
    page[..evil.len()].copy_from_slice(evil);
    memory.write_all_at(&page, 0xee000).unwrap();
    drop(memory);

    let vms = dir.join("vms");
    let outside = dir.join("outside");
    std::fs::create_dir_all(&vms).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("target-0.log"), b"precious").unwrap();
    std::fs::write(outside.join("target-0.in"), b"precious").unwrap();
    let before = files_under(&outside);

    let sock = vms.join("r.sock");
    let mut restored = Guest::start(&[
        "restore",
        &snap.to_string_lossy(),
        "--console",
        "/dev/null",
        "--api-sock",
        &sock.to_string_lossy(),
    ]);
    probe::wait_report(&restored, "resumed");
    let (status, vm) = request(&sock, "GET", "/vm", None);
    assert_eq!(status, 200);
    assert_eq!(
        vm["name"], "victim",
        "the name comes from the state file: {vm}"
    );
    assert_eq!(vm["generation"], 1, "{vm}");
    let (status, fork) = request(
        &sock,
        "PUT",
        "/vm/fork",
        Some(serde_json::json!({"count": 2})),
    );
    assert_eq!(status, 200, "{fork}");
    let names: Vec<&str> = fork["clones"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["victim-0", "victim-1"]);
    for clone in fork["clones"].as_array().unwrap() {
        for key in ["api_sock", "console_log", "console_input"] {
            let path = PathBuf::from(clone[key].as_str().unwrap());
            assert_eq!(path.parent(), Some(vms.as_path()), "{key}: {path:?}");
        }
        // SAFETY: kill(2) of a clone this test started.
        unsafe { libc::kill(clone["pid"].as_i64().unwrap() as i32, libc::SIGKILL) };
    }
    assert_eq!(
        files_under(&outside),
        before,
        "nothing appeared outside vms/"
    );
    assert_eq!(
        std::fs::read(outside.join("target-0.log")).unwrap(),
        b"precious"
    );
    assert_eq!(
        std::fs::read(outside.join("target-0.in")).unwrap(),
        b"precious"
    );
    restored.signal(libc::SIGTERM);
    restored.wait_exit(TIMEOUT);
}

#[test]
fn snapshot_files_that_are_not_regular_files_are_refused_at_once() {
    let dir = TestDir::new("kinds");
    let snap = probe_snapshot(&dir, "kinds");
    let state = std::fs::read(snap.join("state")).unwrap();

    // The state file a symlink to a device that never ends.
    let zero = with_state(&dir, &snap, "zero", b"");
    std::fs::remove_file(Path::new(&zero).join("state")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", Path::new(&zero).join("state")).unwrap();
    assert_contains(&restore_refused(&[&zero]), "a character device");

    // A FIFO as the state file, then as the memory file: no writer ever comes.
    for (name, file) in [("fifo-state", "state"), ("fifo-memory", "memory")] {
        let path = PathBuf::from(with_state(&dir, &snap, name, &state));
        std::fs::remove_file(path.join(file)).unwrap();
        let c = std::ffi::CString::new(path.join(file).to_string_lossy().as_bytes()).unwrap();
        // SAFETY: a valid path; the result is checked.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let started = Instant::now();
        assert_contains(&restore_refused(&[&path.to_string_lossy()]), "a FIFO");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{name} took {:?}",
            started.elapsed()
        );
    }

    // A sparse state file of several GiB: refused by its size, not read.
    let huge = PathBuf::from(with_state(&dir, &snap, "huge", b""));
    std::fs::File::create(huge.join("state"))
        .unwrap()
        .set_len(6 << 30)
        .unwrap();
    let started = Instant::now();
    assert_contains(
        &restore_refused(&[&huge.to_string_lossy()]),
        "more than a mayfly state file can be",
    );
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_state_file_asking_for_more_than_run_allows_is_refused_in_every_memory_mode() {
    let dir = TestDir::new("asks");
    let snap = probe_snapshot(&dir, "asks");
    let gib = 1u64 << 30;
    let huge = edited_state(&snap, |s| {
        s.mem_bytes = 64 * gib;
        s.memory = vec![
            MemoryRange {
                guest_addr: 0,
                size: 3 * gib,
                file_offset: 0,
            },
            MemoryRange {
                guest_addr: 4 * gib,
                size: 61 * gib,
                file_offset: 3 * gib,
            },
        ];
    });
    let huge = with_state(&dir, &snap, "huge-ram", &huge);
    for mode in ["cow", "lazy", "eager"] {
        assert_contains(
            &restore_refused(&[&huge, "--memory", mode]),
            "more than this host's",
        );
    }
    let layout = edited_state(&snap, |s| {
        s.memory[0].file_offset = u64::MAX - 4096;
    });
    assert_contains(
        &restore_refused(&[&with_state(&dir, &snap, "layout", &layout)]),
        "memory layout",
    );
    let vcpus = edited_state(&snap, |s| s.vcpu_count = 0);
    assert_contains(
        &restore_refused(&[&with_state(&dir, &snap, "vcpus", &vcpus)]),
        "at least one vCPU",
    );
    let name = edited_state(&snap, |s| s.identity.name = "../../x".into());
    assert_contains(
        &restore_refused(&[&with_state(&dir, &snap, "name", &name)]),
        "is not usable",
    );
}

#[test]
fn state_and_memory_of_different_snapshots_are_not_paired() {
    let dir = TestDir::new("pair");
    let a = probe_snapshot(&dir, "a");
    let b = probe_snapshot(&dir, "b");
    let mixed = dir.join("mixed");
    std::fs::create_dir_all(&mixed).unwrap();
    std::fs::hard_link(a.join("state"), mixed.join("state")).unwrap();
    std::fs::hard_link(b.join("memory"), mixed.join("memory")).unwrap();
    assert_contains(
        &restore_refused(&[&mixed.to_string_lossy()]),
        "were not written together",
    );
}

#[test]
fn leftovers_of_a_killed_snapshot_are_cleaned_up_by_the_next_one() {
    let dir = TestDir::new("leftovers");
    let sock = dir.join("vm.sock");
    let mut vm = probe::boot(64, &sock, "left");
    // What a VMM killed in the middle of a snapshot leaves: a hidden temporary directory.
    let dead = dir.join(".snap.tmp-999999-1");
    std::fs::create_dir_all(&dead).unwrap();
    std::fs::write(dead.join("memory"), vec![1u8; 1 << 20]).unwrap();
    // One that a live writer holds (its lock): it must stay.
    let live = dir.join(".other.tmp-1-2");
    std::fs::create_dir_all(&live).unwrap();
    let held = std::fs::File::open(&live).unwrap();
    assert_eq!(
        // SAFETY: flock on a descriptor this test owns.
        unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&held), libc::LOCK_EX) },
        0
    );
    // And one that is not a snapshot's at all.
    let foreign = dir.join(".mine.tmp-5-5");
    std::fs::create_dir_all(&foreign).unwrap();
    std::fs::write(foreign.join("notes"), b"mine").unwrap();

    probe::snapshot(&sock, &dir.join("snap"));
    assert!(!dead.exists(), "the dead VMM's leftovers are gone");
    assert!(live.exists(), "a snapshot in progress is left alone");
    assert!(
        foreign.join("notes").exists(),
        "a directory that is not a snapshot's is left alone"
    );
    drop(held);
    vm.signal(libc::SIGTERM);
    vm.wait_exit(TIMEOUT);
}

#[test]
fn snapshot_requests_that_cannot_work_are_the_clients_mistake() {
    let dir = TestDir::new("snap4xx");
    let sock = dir.join("vm.sock");
    let mut vm = probe::boot(64, &sock, "fourxx");
    assert_eq!(request(&sock, "PUT", "/vm/pause", None).0, 204);
    std::fs::create_dir_all(dir.join("taken")).unwrap();
    std::fs::write(dir.join("taken").join("notes.txt"), b"x").unwrap();
    for (path, status, expected) in [
        (dir.join("taken"), 409, "is not a mayfly snapshot"),
        (dir.join("no-such-dir").join("snap"), 400, "does not exist"),
        (
            dir.join("taken").join("notes.txt").join("snap"),
            400,
            "is not a directory",
        ),
    ] {
        let (got, body) = request(
            &sock,
            "PUT",
            "/vm/snapshot",
            Some(serde_json::json!({ "path": path })),
        );
        assert_eq!(got, status, "{path:?}: {body}");
        assert_contains(body["error"].as_str().unwrap(), expected);
    }
    vm.signal(libc::SIGTERM);
    vm.wait_exit(TIMEOUT);
}

#[test]
fn a_stop_signal_ends_a_restore_that_is_still_starting() {
    let dir = TestDir::new("early-stop");
    let snap = probe_snapshot(&dir, "early");
    // A console that is a FIFO nobody reads: opening it blocks the restore before the VM runs.
    let fifo = dir.join("console.fifo");
    let c = std::ffi::CString::new(fifo.to_string_lossy().as_bytes()).unwrap();
    // SAFETY: a valid path; the result is checked.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let mut child = Command::new(mayfly_bin())
        .args([
            "restore",
            &snap.to_string_lossy(),
            "--console",
            &fifo.to_string_lossy(),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        child.try_wait().unwrap().is_none(),
        "the restore is blocked on its console"
    );
    // SAFETY: kill(2) of our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + TIMEOUT;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("SIGTERM did not stop a restore that was still starting");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(128 + libc::SIGTERM));
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert_contains(&stderr, "before the VM started");
}

#[test]
fn truncating_the_memory_file_under_a_copy_on_write_vm_stops_it_and_says_why() {
    let dir = TestDir::new("cow-cut");
    let snap = probe_snapshot(&dir, "cut");
    let mut restored = Guest::start(&[
        "restore",
        &snap.to_string_lossy(),
        "--memory",
        "cow",
        "--console",
        "/dev/null",
    ]);
    probe::wait_report(&restored, "verified");
    // The kernel holds this truncate until the VMM lets go of the file (it stops the VM).
    let memory = snap.join("memory");
    let cutter = std::thread::spawn(move || {
        std::fs::OpenOptions::new()
            .write(true)
            .open(&memory)
            .and_then(|f| f.set_len(0))
    });
    let status = restored.wait_exit(TIMEOUT);
    cutter.join().unwrap().unwrap();
    assert_eq!(status.code(), Some(1), "stderr: {}", restored.stderr());
    assert_contains(&restored.stderr(), "memory file");
    assert!(
        !restored.stderr().contains("rebooted"),
        "{}",
        restored.stderr()
    );
}

#[test]
fn two_restores_on_one_stale_socket_leave_exactly_one_vm_running() {
    let dir = TestDir::new("two");
    let snap = probe_snapshot(&dir, "two");
    for round in 0..10 {
        let sock = dir.join(&format!("race-{round}.sock"));
        drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
        let start = || {
            Command::new(mayfly_bin())
                .args([
                    "restore",
                    &snap.to_string_lossy(),
                    "--console",
                    "/dev/null",
                    "--api-sock",
                    &sock.to_string_lossy(),
                ])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        };
        // Killed however the round ends, so that a failed assertion leaks no VMM.
        let mut pair = Reap([start(), start()]);
        let pair = &mut pair.0;
        // Let both get through start-up; the loser exits by itself.
        let deadline = Instant::now() + TIMEOUT;
        let mut exited = Vec::new();
        while exited.is_empty() && Instant::now() < deadline {
            for (i, child) in pair.iter_mut().enumerate() {
                if let Some(status) = child.try_wait().unwrap() {
                    exited.push((i, status));
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(
            exited.len(),
            1,
            "round {round}: exactly one of the two exits"
        );
        let (loser, status) = exited[0];
        assert_eq!(status.code(), Some(1), "round {round}");
        let mut stderr = String::new();
        std::io::Read::read_to_string(&mut pair[loser].stderr.take().unwrap(), &mut stderr)
            .unwrap();
        assert_contains(&stderr, "is in use");
        let winner = &mut pair[1 - loser];
        std::thread::sleep(Duration::from_millis(200));
        assert!(
            winner.try_wait().unwrap().is_none(),
            "round {round}: the winner runs"
        );
        assert_eq!(request(&sock, "GET", "/vm", None).0, 200);
        winner.kill().unwrap();
        winner.wait().unwrap();
    }
}

/// Children killed and reaped when dropped.
struct Reap<const N: usize>([std::process::Child; N]);

impl<const N: usize> Drop for Reap<N> {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[test]
fn only_a_vm_asked_to_have_the_probe_device_has_it() {
    let dir = TestDir::new("no-probe");
    let mut vm = Guest::start(&[
        "run",
        "--kernel",
        probe::ELF,
        "--mem-mib",
        "64",
        "--console",
        "/dev/null",
        "--api-sock",
        &dir.arg("vm.sock"),
    ]);
    // The probe reports within milliseconds when the device is there.
    assert!(
        !vm.wait_stderr("mayfly-probe:", Duration::from_secs(2)),
        "{}",
        vm.stderr()
    );
    vm.signal(libc::SIGTERM);
    vm.wait_exit(TIMEOUT);
}

/// A guest that writes to its console without end fills no disk: a console file takes
/// `MAYFLY_CONSOLE_LIMIT` bytes, then one line saying the rest was dropped, and the VM runs on.
#[test]
fn a_guest_flooding_its_console_fills_only_its_limit() {
    let dir = TestDir::new("console-cap");
    let console = dir.join("console.log");
    let sock = dir.join("vm.sock");
    let mut guest = Guest::start_with(
        Command::new(mayfly_bin())
            .args([
                "run",
                "--probe",
                "--kernel",
                probe::ELF,
                "--mem-mib",
                "32",
                "--cmdline",
                "touch=1 console=20000",
                "--console",
            ])
            .arg(&console)
            .arg("--api-sock")
            .arg(&sock)
            .env("MAYFLY_CONSOLE_LIMIT", "4K"),
    );
    assert!(
        guest.wait_stderr("mayfly-probe: waiting", probe::TIMEOUT),
        "the probe did not boot: {}",
        guest.stderr()
    );
    // The guest wrote all 20,000 bytes before it got here.
    let log = std::fs::read_to_string(&console).unwrap();
    assert_eq!(log.matches('x').count(), 4096, "{}", log.len());
    assert!(
        log.ends_with(
            "[mayfly: the console reached its limit of 4096 bytes (MAYFLY_CONSOLE_LIMIT); \
             the rest of the guest's output is dropped]\n"
        ),
        "{}",
        &log[4096..]
    );
    assert_eq!(request(&sock, "GET", "/vm", None).0, 200);
    guest.signal(libc::SIGTERM);
    guest.wait_exit(probe::TIMEOUT);

    // A limit that is not a size is refused at the start, saying what to give.
    let out = Command::new(mayfly_bin())
        .args([
            "run",
            "--probe",
            "--kernel",
            probe::ELF,
            "--console",
            "/dev/null",
        ])
        .env("MAYFLY_CONSOLE_LIMIT", "lots")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("MAYFLY_CONSOLE_LIMIT=\"lots\" is not a size"),
        "{stderr}"
    );
}

/// The lost console wake-up, bounded (docs/rig.md, known problems): a vCPU inside one KVM_RUN
/// for over 2 s while the UART has an interrupt pending is kicked out, and says so. The probe's
/// `stall=1` makes that shape on purpose: the UART's transmit interrupt pending, interrupts
/// off, a loop that never exits to the VMM.
#[test]
fn a_vcpu_stuck_behind_a_pending_console_interrupt_is_kicked() {
    let dir = TestDir::new("console-stall");
    let sock = dir.join("vm.sock");
    let mut guest = Guest::start(&[
        "run",
        "--probe",
        "--kernel",
        probe::ELF,
        "--mem-mib",
        "32",
        "--cmdline",
        "stall=1",
        "--console",
        "/dev/null",
        "--api-sock",
        &sock.to_string_lossy(),
    ]);
    assert!(
        guest.wait_stderr(
            "sat in KVM_RUN over 2 s with the console's interrupt pending",
            probe::TIMEOUT
        ),
        "no kick: {}",
        guest.stderr()
    );
    // The VMM answers and stops as ever.
    assert_eq!(request(&sock, "GET", "/vm", None).0, 200);
    guest.signal(libc::SIGTERM);
    let status = guest.wait_exit(probe::TIMEOUT);
    assert!(status.code().is_some(), "{status:?}");
}
