//! Snapshot and restore of a running guest, in every memory mode, and the control socket.
//! Run through tests/run, which picks a KVM that can run Linux (the host's or the rig's).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use std::path::Path;

use mayfly_snapshot::{HostFingerprint, VmState};
use mayfly_tests::agent::{sh, wait_agent};
use mayfly_tests::guest::{mayfly_output, Guest, TestDir, BOOT_TIMEOUT};

const EXIT_TIMEOUT: Duration = Duration::from_secs(60);
const CLIENT_TIMEOUT: Duration = Duration::from_secs(120);

/// A booted guest with a control socket, a counter writing to a tmpfs file every 0.2 s, and a
/// data file whose checksum is known.
struct Busy {
    guest: Guest,
    sock: String,
    data_md5: String,
}

fn boot_busy(dir: &TestDir) -> Busy {
    let sock = dir.arg("api.sock");
    let guest = Guest::start(&["run", "--api-sock", &sock]);
    let api = Path::new(&sock);
    wait_agent(api, BOOT_TIMEOUT);
    sh(
        api,
        // Written aside and renamed: a reader never sees the file truncated and not yet written.
        "(i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new; mv -f /tmp/count.new /tmp/count; sleep 0.2; done) </dev/null >/dev/null 2>&1 &",
    );
    sh(api, "seq 1 200000 > /tmp/data");
    let data_md5 = sh(api, "md5sum /tmp/data | cut -d' ' -f1");
    assert_eq!(data_md5.len(), 32, "{data_md5}");
    Busy {
        guest,
        sock,
        data_md5,
    }
}

fn count(sock: &str) -> u64 {
    let text = sh(Path::new(sock), "cat /tmp/count");
    text.parse()
        .unwrap_or_else(|_| panic!("the counter file holds {text:?}"))
}

fn mayfly_ok(args: &[&str]) -> String {
    let out = mayfly_output(args, CLIENT_TIMEOUT);
    assert!(
        out.status.success(),
        "mayfly {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn now_s() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// Restore `snap` with its control socket at `sock` (and these extra arguments).
fn restore(snap: &str, sock: &str, extra: &[&str]) -> Guest {
    let mut args = vec!["restore", snap, "--api-sock", sock];
    args.extend_from_slice(extra);
    Guest::start(&args)
}

/// Check a restored guest: the counter carries on from `before`, the data file is intact, the
/// agent and the serial console answer and the wall clock is the host's.
fn check_carries_on(guest: &mut Guest, sock: &str, before: u64, data_md5: &str) {
    let api = Path::new(sock);
    let first = count(sock);
    assert!(
        first >= before && first < before + 150,
        "the counter restarted or jumped: {before} before the snapshot, {first} after"
    );
    sh(api, "sleep 1");
    let second = count(sock);
    assert!(second > first, "the counter stopped: {first} then {second}");
    assert_eq!(sh(api, "md5sum /tmp/data | cut -d' ' -f1"), data_md5);
    // The console's shell carried on too.
    assert_eq!(
        guest.run("echo hello from the restored guest"),
        "hello from the restored guest"
    );
    let guest_time: i64 = sh(api, "date +%s").parse().unwrap();
    assert!(
        (guest_time - now_s()).abs() <= 3,
        "the guest's clock is off: guest {guest_time}, host {}",
        now_s()
    );
}

#[test]
fn restores_in_every_memory_mode_carry_on_where_the_guest_stopped() {
    let dir = TestDir::new("modes");
    let mut busy = boot_busy(&dir);
    let before = count(&busy.sock);
    let snap = dir.arg("snap");
    mayfly_ok(&["snapshot", "--sock", &busy.sock, &snap]);
    // The VMM dies hard: nothing but the snapshot is left.
    busy.guest.signal(libc::SIGKILL);
    busy.guest.wait_exit(EXIT_TIMEOUT);
    // Time passes on disk: the restored clock must catch up.
    std::thread::sleep(Duration::from_secs(3));

    for mode in ["cow", "eager", "lazy"] {
        let sock = dir.arg(&format!("{mode}.sock"));
        let mut guest = restore(&snap, &sock, &["--memory", mode]);
        check_carries_on(&mut guest, &sock, before, &busy.data_md5);
        guest.send("poweroff -f\n");
        let status = guest.wait_exit(EXIT_TIMEOUT);
        assert_eq!(status.code(), Some(0), "{mode}: {}", guest.stderr());
    }
}

#[test]
fn three_copy_on_write_restores_of_one_snapshot_run_at_once() {
    let dir = TestDir::new("three");
    let mut busy = boot_busy(&dir);
    let before = count(&busy.sock);
    let snap = dir.arg("snap");
    mayfly_ok(&["snapshot", "--sock", &busy.sock, &snap]);
    busy.guest.signal(libc::SIGTERM);
    busy.guest.wait_exit(EXIT_TIMEOUT);

    let socks: Vec<String> = (0..3).map(|i| dir.arg(&format!("r{i}.sock"))).collect();
    let mut guests: Vec<Guest> = socks
        .iter()
        .map(|sock| restore(&snap, sock, &["--memory", "cow"]))
        .collect();
    for (i, sock) in socks.iter().enumerate() {
        sh(Path::new(sock), &format!("echo {i} > /tmp/who"));
    }
    for (i, guest) in guests.iter_mut().enumerate() {
        check_carries_on(guest, &socks[i], before, &busy.data_md5);
        // Each restore writes only its own copy.
        assert_eq!(sh(Path::new(&socks[i]), "cat /tmp/who"), i.to_string());
    }
    let memory = std::fs::metadata(dir.join("snap").join("memory")).unwrap();
    let modified = memory.modified().unwrap();
    for mut guest in guests {
        guest.send("poweroff -f\n");
        assert_eq!(guest.wait_exit(EXIT_TIMEOUT).code(), Some(0));
    }
    assert_eq!(
        std::fs::metadata(dir.join("snap").join("memory"))
            .unwrap()
            .modified()
            .unwrap(),
        modified,
        "copy-on-write restores never write the memory file"
    );
}

#[test]
fn a_restored_vm_can_be_snapshotted_and_restored_again() {
    let dir = TestDir::new("again");
    let mut busy = boot_busy(&dir);
    let snap1 = dir.arg("snap1");
    mayfly_ok(&["snapshot", "--sock", &busy.sock, &snap1]);
    busy.guest.signal(libc::SIGTERM);
    busy.guest.wait_exit(EXIT_TIMEOUT);

    for mode in ["cow", "lazy"] {
        let sock = dir.arg(&format!("{mode}.sock"));
        let mut restored = restore(&snap1, &sock, &["--memory", mode]);
        sh(
            Path::new(&sock),
            &format!("echo second generation > /tmp/gen-{mode}"),
        );
        let before = count(&sock);
        let snap2 = dir.arg(&format!("snap2-{mode}"));
        mayfly_ok(&["snapshot", "--sock", &sock, &snap2]);
        restored.signal(libc::SIGKILL);
        restored.wait_exit(EXIT_TIMEOUT);

        let third_sock = dir.arg(&format!("third-{mode}.sock"));
        let mut third = restore(&snap2, &third_sock, &["--memory", "cow"]);
        check_carries_on(&mut third, &third_sock, before, &busy.data_md5);
        assert_eq!(
            sh(Path::new(&third_sock), &format!("cat /tmp/gen-{mode}")),
            "second generation"
        );
        third.send("poweroff -f\n");
        assert_eq!(third.wait_exit(EXIT_TIMEOUT).code(), Some(0));
    }
}

/// A copy of a snapshot with its state file replaced (the memory file is shared by a hard link).
fn variant(dir: &TestDir, snap: &str, name: &str, state: &[u8]) -> String {
    let path = dir.join(name);
    std::fs::create_dir_all(&path).unwrap();
    std::fs::hard_link(format!("{snap}/memory"), path.join("memory")).unwrap();
    std::fs::write(path.join("state"), state).unwrap();
    path.to_string_lossy().into_owned()
}

fn assert_refused(snapshot: &str, expected: &str) {
    let out = mayfly_output(
        &["restore", snapshot, "--console", "/dev/null"],
        CLIENT_TIMEOUT,
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{snapshot}: {stderr}");
    assert!(
        stderr.contains(expected),
        "{snapshot}: expected {expected:?} in {stderr:?}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn bad_snapshots_are_refused_with_clear_errors() {
    let dir = TestDir::new("bad");
    let mut busy = boot_busy(&dir);
    let snap = dir.arg("snap");
    mayfly_ok(&["snapshot", "--sock", &busy.sock, &snap]);
    busy.guest.signal(libc::SIGTERM);
    busy.guest.wait_exit(EXIT_TIMEOUT);
    let state = std::fs::read(format!("{snap}/state")).unwrap();

    let mut flipped = state.clone();
    let middle = flipped.len() / 2;
    flipped[middle] ^= 0x10;
    assert_refused(&variant(&dir, &snap, "flipped", &flipped), "is corrupted");

    assert_refused(
        &variant(&dir, &snap, "short-state", &state[..state.len() - 100]),
        "is truncated",
    );

    let mut version = state.clone();
    version[8..12].copy_from_slice(&77u32.to_le_bytes());
    assert_refused(
        &variant(&dir, &snap, "version", &version),
        "format version 77",
    );

    assert_refused(
        &variant(&dir, &snap, "garbage", b"this is not a snapshot at all"),
        "not a mayfly snapshot",
    );

    // The same state, as if written on another CPU model.
    let (mut header, body): (mayfly_snapshot::Header, VmState) =
        mayfly_snapshot::file::decode(&state, "state").unwrap();
    header.fingerprint = HostFingerprint {
        cpu_model: header.fingerprint.cpu_model ^ 0x40,
        ..header.fingerprint
    };
    let other_cpu = mayfly_snapshot::file::encode(&header, &body).unwrap();
    assert_refused(
        &variant(&dir, &snap, "other-cpu", &other_cpu),
        "taken on a different host CPU",
    );

    // A truncated memory file (a copy: the original stays intact for the variants above).
    let short = dir.join("short-memory");
    std::fs::create_dir_all(&short).unwrap();
    std::fs::write(short.join("state"), &state).unwrap();
    std::fs::File::create(short.join("memory"))
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    assert_refused(
        &short.to_string_lossy(),
        "is truncated or belongs to another snapshot",
    );

    let no_memory = dir.join("no-memory");
    std::fs::create_dir_all(&no_memory).unwrap();
    std::fs::write(no_memory.join("state"), &state).unwrap();
    assert_refused(&no_memory.to_string_lossy(), "memory file");

    assert_refused(&dir.arg("does-not-exist"), "no such directory");
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    assert_refused(&empty.to_string_lossy(), "state file is missing");
}

#[test]
fn a_lazy_restore_whose_memory_file_goes_away_stops_with_an_error() {
    let dir = TestDir::new("lazy-gone");
    let sock = dir.arg("api.sock");
    let mut guest = Guest::start(&["run", "--api-sock", &sock]);
    wait_agent(Path::new(&sock), BOOT_TIMEOUT);
    // 48 MiB of data in guest RAM that the restored guest has not touched yet.
    sh(
        Path::new(&sock),
        "dd if=/dev/urandom of=/tmp/big bs=1M count=48 2>/dev/null; sync",
    );
    let snap = dir.arg("snap");
    mayfly_ok(&["snapshot", "--sock", &sock, &snap]);
    guest.signal(libc::SIGTERM);
    guest.wait_exit(EXIT_TIMEOUT);

    // A private copy of the memory file that can be emptied under the restored VM.
    let copy = dir.join("copy");
    std::fs::create_dir_all(&copy).unwrap();
    std::fs::copy(format!("{snap}/state"), copy.join("state")).unwrap();
    // A sparse copy: 256 MiB of mostly holes stays small (and quick to make in the rig).
    let cp = std::process::Command::new("cp")
        .arg("--sparse=always")
        .arg(format!("{snap}/memory"))
        .arg(copy.join("memory"))
        .status()
        .unwrap();
    assert!(cp.success());
    let mut restored = Guest::start(&[
        "restore",
        &copy.to_string_lossy(),
        "--memory",
        "lazy",
        "--no-prefetch",
    ]);
    assert_eq!(restored.run("echo alive"), "alive");
    std::fs::File::options()
        .write(true)
        .open(copy.join("memory"))
        .unwrap()
        .set_len(0)
        .unwrap();
    // Reading the data needs pages that were never loaded. (The VMM may stop even before this,
    // as soon as the guest needs any page it has not loaded yet.)
    restored.try_send("md5sum /tmp/big\n");
    let status = restored.wait_exit(EXIT_TIMEOUT);
    assert_eq!(status.code(), Some(1), "stderr: {}", restored.stderr());
    assert!(
        restored.stderr().contains("guest memory cannot be loaded"),
        "{}",
        restored.stderr()
    );
}

/// Send raw bytes to the control socket and return the status code and body.
fn raw_request(sock: &str, request: &[u8]) -> (u16, String) {
    let mut stream = UnixStream::connect(sock).expect("connect to the control socket");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    stream.write_all(request).unwrap();
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    let text = String::from_utf8_lossy(&response).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    (status, body)
}

#[test]
fn the_control_socket_answers_bad_requests_with_errors_and_the_vm_keeps_running() {
    let dir = TestDir::new("api");
    let sock = dir.arg("api.sock");
    let mut guest = Guest::start(&["run", "--api-sock", &sock]);
    guest.expect_ready();

    let (status, body) = raw_request(&sock, b"GET /vm HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_eq!(status, 200, "{body}");
    let vm: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(vm["state"], "running");
    assert_eq!(vm["vcpus"], 1);

    for (request, expected) in [
        (&b"BREW /coffee HTCPCP/1.0\r\n\r\n"[..], 400),
        (b"GET /nowhere HTTP/1.1\r\n\r\n", 404),
        (b"DELETE /vm HTTP/1.1\r\n\r\n", 405),
        (b"PUT /vm/resume HTTP/1.1\r\n\r\n", 409),
        (
            b"PUT /vm/snapshot HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}",
            400,
        ),
        (
            b"PUT /vm/snapshot HTTP/1.1\r\nContent-Length: 8\r\n\r\n{\"path\":",
            400,
        ),
    ] {
        let (status, body) = raw_request(&sock, request);
        assert_eq!(
            status,
            expected,
            "{} -> {body}",
            String::from_utf8_lossy(request)
        );
        let error: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert!(error["error"].is_string(), "{body}");
    }
    let huge = format!(
        "PUT /vm/snapshot HTTP/1.1\r\nContent-Length: {}\r\n\r\n",
        10 << 20
    );
    assert_eq!(raw_request(&sock, huge.as_bytes()).0, 413);

    // A snapshot of a running VM is refused; pause, snapshot, resume works.
    let snap = dir.arg("snap");
    let body = format!("{{\"path\":\"{snap}\"}}");
    let request = format!(
        "PUT /vm/snapshot HTTP/1.1\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    assert_eq!(raw_request(&sock, request.as_bytes()).0, 409);
    mayfly_ok(&["pause", "--sock", &sock]);
    let again = mayfly_output(&["pause", "--sock", &sock], CLIENT_TIMEOUT);
    assert_eq!(again.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&again.stderr).contains("already paused"));
    let status = mayfly_ok(&["status", "--sock", &sock]);
    assert!(status.contains("\"paused\""), "{status}");
    let (code, body) = raw_request(&sock, request.as_bytes());
    assert_eq!(code, 200, "{body}");
    let report: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(
        report["memory_bytes_written"].as_u64().unwrap() > 0,
        "{body}"
    );
    mayfly_ok(&["resume", "--sock", &sock]);

    // Through it all the guest kept running.
    assert_eq!(guest.run("echo still here"), "still here");
    mayfly_ok(&["shutdown", "--sock", &sock]);
    assert_eq!(guest.wait_exit(EXIT_TIMEOUT).code(), Some(0));
    assert!(!dir.join("api.sock").exists(), "the socket file is removed");
}
