//! `mayfly restore --standby`, on this machine's own KVM with the probe guest: a VMM started
//! without a snapshot answers on its control socket, refuses what it cannot restore and stands
//! by again, restores the snapshot a request names, and then serves that VM like any other.

use std::path::Path;
use std::time::{Duration, Instant};

use mayfly_tests::guest::{request, Guest, TestDir};
use mayfly_tests::probe;

const TIMEOUT: Duration = Duration::from_secs(60);

/// A snapshot of a booted probe in `dir/snap`.
fn probe_snapshot(dir: &TestDir) -> std::path::PathBuf {
    let sock = dir.join("p.sock");
    let mut guest = probe::boot(128, &sock, "standby-source");
    let snap = dir.join("snap");
    probe::snapshot(&sock, &snap);
    guest.signal(libc::SIGKILL);
    guest.wait_exit(TIMEOUT);
    snap
}

/// Wait until the VMM on `sock` answers `GET /vm`; its body.
fn wait_answer(guest: &Guest, sock: &Path) -> serde_json::Value {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        if let Ok((200, body)) =
            mayfly_api::request_with_timeout(sock, "GET", "/vm", None, Duration::from_secs(5))
        {
            return body;
        }
        assert!(
            Instant::now() < deadline,
            "the VMM standing by never answered: {}",
            guest.stderr()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn restore(sock: &Path, snapshot: &Path) -> (u16, serde_json::Value) {
    request(
        sock,
        "PUT",
        "/vm/restore",
        Some(serde_json::json!({ "snapshot": snapshot })),
    )
}

#[test]
fn a_vmm_standing_by_refuses_what_it_cannot_restore_then_restores_and_serves_its_snapshot() {
    let dir = TestDir::new("standby");
    let snap = probe_snapshot(&dir);
    let sock = dir.join("s.sock");
    let mut vmm = probe::standby(&sock, &["--name", "woken"]);
    assert_eq!(
        wait_answer(&vmm, &sock),
        serde_json::json!({"state": "standby"})
    );

    // What it cannot restore is refused, the VMM still standing by.
    let missing = dir.join("no-such-snapshot");
    let (status, body) = restore(&sock, &missing);
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains(&*missing.to_string_lossy()),
        "{body}"
    );
    let junk = dir.join("junk");
    std::fs::create_dir(&junk).unwrap();
    std::fs::write(junk.join("state"), b"not a state file").unwrap();
    std::fs::write(junk.join("memory"), b"").unwrap();
    let (status, body) = restore(&sock, &junk);
    assert_eq!(status, 400, "{body}");
    let (status, body) = request(&sock, "PUT", "/vm/pause", None);
    assert_eq!(status, 409, "{body}");
    let (status, body) = request(
        &sock,
        "PUT",
        "/vm/restore",
        Some(serde_json::json!({ "snapshot": "relative/snap" })),
    );
    assert_eq!(status, 400, "{body}");
    assert_eq!(wait_answer(&vmm, &sock)["state"], "standby");

    // The snapshot: answered once its VM runs, as `GET /vm` describes it.
    let (status, body) = restore(&sock, &snap);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["state"], "running", "{body}");
    assert_eq!(body["name"], "woken", "{body}");
    assert_eq!(
        body["origin"],
        format!("restore of {}", snap.display()),
        "{body}"
    );
    // The guest runs on, in a new generation, and reads back what it wrote before the
    // snapshot.
    probe::wait_report(&vmm, "resumed");
    probe::wait_report(&vmm, "verified");
    let reports = probe::reports(&vmm.stderr());
    assert!(
        !reports.iter().any(|r| r.0 == "mismatch"),
        "{}",
        vmm.stderr()
    );

    // The socket is the VM's own now: its routes, not the standby's.
    let (status, body) = request(&sock, "GET", "/vm", None);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["state"], "running", "{body}");
    let (status, body) = restore(&sock, &snap);
    assert_ne!(status, 200, "{body}");
    let (status, body) = request(&sock, "PUT", "/vm/pause", None);
    assert_eq!(status, 204, "{body}");
    let (status, body) = request(&sock, "PUT", "/vm/shutdown", None);
    assert_eq!(status, 204, "{body}");
    let exit = vmm.wait_exit(TIMEOUT);
    assert_eq!(exit.code(), Some(0), "{}", vmm.stderr());
    assert!(!sock.exists(), "the VM's socket is removed when it ends");
}

#[test]
fn a_vmm_stopped_while_standing_by_exits_and_removes_its_socket() {
    let dir = TestDir::new("standby-stop");
    let sock = dir.join("s.sock");
    let mut vmm = probe::standby(&sock, &[]);
    assert_eq!(wait_answer(&vmm, &sock)["state"], "standby");
    vmm.signal(libc::SIGTERM);
    let exit = vmm.wait_exit(TIMEOUT);
    assert_eq!(exit.code(), Some(128 + libc::SIGTERM), "{}", vmm.stderr());
    assert!(
        !sock.exists(),
        "a VMM stopped while standing by removes its socket"
    );
}
