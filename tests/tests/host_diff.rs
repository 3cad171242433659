//! Diff snapshots, on this machine's own KVM with the probe guest: a diff holds the pages
//! written since the restore and no others, restores (copy-on-write and eager) bring back
//! every page the guest wrote before, chains compact, and what cannot work says so.

use std::path::Path;
use std::time::Duration;

use mayfly_snapshot::VmState;
use mayfly_tests::guest::{mayfly_output, request, Guest, TestDir};
use mayfly_tests::probe;
use serde_json::{json, Value};

const TIMEOUT: Duration = Duration::from_secs(60);

/// Pause the VM on `sock` and snapshot it into `dir`; the VMM's report, or (status, body).
fn snapshot(sock: &Path, dir: &Path, diff: bool) -> Result<Value, (u16, Value)> {
    let _ = request(sock, "PUT", "/vm/pause", None);
    let (status, body) = request(
        sock,
        "PUT",
        "/vm/snapshot",
        Some(json!({ "path": dir, "diff": diff })),
    );
    if status == 200 {
        Ok(body)
    } else {
        Err((status, body))
    }
}

/// Restore `dir` with `--memory mode` and wait until the probe has checked its pages.
fn restore(dir: &Path, sock: &Path, mode: &str) -> Guest {
    let guest = Guest::start(&[
        "restore",
        &dir.to_string_lossy(),
        "--memory",
        mode,
        "--console",
        "/dev/null",
        "--api-sock",
        &sock.to_string_lossy(),
    ]);
    probe::wait_report(&guest, "verified");
    let reports = probe::reports(&guest.stderr());
    assert!(
        !reports.iter().any(|r| r.0 == "mismatch"),
        "pages came back wrong from {}: {}",
        dir.display(),
        guest.stderr()
    );
    guest
}

fn stop(mut guest: Guest) {
    guest.signal(libc::SIGTERM);
    guest.wait_exit(TIMEOUT);
}

fn field(report: &Value, name: &str) -> u64 {
    report[name]
        .as_u64()
        .unwrap_or_else(|| panic!("no {name} in {report}"))
}

#[test]
fn a_diff_holds_only_the_pages_written_since_the_restore_and_restores_whole() {
    let dir = TestDir::new("diff");
    // 64 MiB, every page from 4 MiB up written by the probe before the first snapshot.
    let sock = dir.join("boot.sock");
    let booted = probe::boot(64, &sock, "d");
    let full = dir.join("full");
    let report = snapshot(&sock, &full, false).unwrap();
    let full_bytes = field(&report, "memory_bytes_written");
    assert!(full_bytes > 50 << 20, "{report}");
    // A booted VM's memory is no snapshot's: there is nothing to diff against.
    let (status, body) = snapshot(&sock, &dir.join("no"), true).unwrap_err();
    assert_eq!(status, 409, "{body}");
    assert!(body.to_string().contains("take a full snapshot"), "{body}");
    stop(booted);

    // Restored, the probe reads all its pages and writes one: a diff of it is a few pages
    // over the full snapshot, which it links.
    let s1 = dir.join("s1.sock");
    let vm = restore(&full, &s1, "cow");
    let d1 = dir.join("d1");
    let report = snapshot(&s1, &d1, true).unwrap();
    let d1_bytes = field(&report, "memory_bytes_written");
    assert!(d1_bytes > 0 && d1_bytes < 1 << 20, "{report}");
    assert_eq!(field(&report, "memory_layers"), 1, "{report}");
    stop(vm);
    let links = std::fs::read_dir(d1.join("memory-layers")).unwrap().count();
    assert_eq!(links, 1);

    // The chain restores copy-on-write and eagerly, every page as the probe wrote it; each
    // diff of a diff stacks one more layer until the chain compacts.
    let mut from = d1.clone();
    let mut compacted = false;
    for round in 2..=6 {
        let sock = dir.join(&format!("s{round}.sock"));
        let mode = if round % 2 == 0 { "eager" } else { "cow" };
        let mut vm = restore(&from, &sock, mode);
        if mode == "eager" {
            // An eager restore's memory is its own: a diff of it cannot be made.
            assert_eq!(snapshot(&sock, &dir.join("no"), true).unwrap_err().0, 409);
            stop(vm);
            vm = restore(&from, &sock, "cow");
        }
        let next = dir.join(&format!("d{round}"));
        let report = snapshot(&sock, &next, true).unwrap();
        compacted |= report["compacted"] == json!(true);
        assert!(field(&report, "memory_layers") <= 5, "{report}");
        assert!(field(&report, "memory_bytes_written") < 1 << 20, "{report}");
        stop(vm);
        from = next;
    }
    assert!(compacted, "six diffs deep, the chain never compacted");
    // A diff of the compacted chain still restores whole.
    stop(restore(&from, &dir.join("last.sock"), "cow"));

    // Lazy restore reads one memory file: a diff is refused, saying what to do.
    let err = restore_refused(&d1, &["--memory", "lazy"]);
    assert!(err.contains("--memory cow or eager"), "{err}");

    // A diff without its memory-layers/ (its state and memory copied alone) says which layer
    // is missing.
    let mut damaged = d1.clone();
    damaged.set_file_name("d1-damaged");
    std::fs::create_dir(&damaged).unwrap();
    for name in ["state", "memory"] {
        std::fs::copy(d1.join(name), damaged.join(name)).unwrap();
    }
    let err = restore_refused(&damaged, &[]);
    assert!(err.contains("memory layer"), "{err}");

    crafted_chains_are_refused(&dir, &d1);
}

/// Crafted copies of the diff `d1` (a state file with a valid checksum, written by a VMM the
/// restorer does not trust) are refused before any guest runs.
fn crafted_chains_are_refused(dir: &TestDir, d1: &Path) {
    let bytes = std::fs::read(d1.join("state")).unwrap();
    let (header, state): (mayfly_snapshot::Header, VmState) =
        mayfly_snapshot::file::decode(&bytes, "state").unwrap();
    let layer_name = d1
        .join("memory-layers")
        .read_dir()
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .file_name();

    // A layer in memory-layers/ that is a symbolic link to a file outside the snapshot (the
    // very file it was linked from, so nothing else is wrong with it).
    let linked = dir.join("d-linked");
    std::fs::create_dir_all(linked.join("memory-layers")).unwrap();
    for name in ["state", "memory"] {
        std::fs::copy(d1.join(name), linked.join(name)).unwrap();
    }
    std::os::unix::fs::symlink(
        dir.join("full").join("memory"),
        linked.join("memory-layers").join(&layer_name),
    )
    .unwrap();
    let err = restore_refused(&linked, &[]);
    assert!(
        err.contains("cannot be opened inside the snapshot"),
        "{err}"
    );

    // A chain whose full bottom layer is the snapshot's own sparse memory file: its holes
    // would be mapped as the guest's RAM.
    let own = dir.join("d-own");
    std::fs::create_dir_all(own.join("memory-layers")).unwrap();
    std::fs::copy(d1.join("memory"), own.join("memory")).unwrap();
    let own_name = mayfly_snapshot::layer_file_name(&state.snapshot_id);
    std::fs::hard_link(
        own.join("memory"),
        own.join("memory-layers").join(&own_name),
    )
    .unwrap();
    let mut edited = state.clone();
    edited.memory_layers[0].path = Path::new("memory-layers").join(&own_name);
    edited.memory_layers[0].snapshot_id = state.snapshot_id;
    std::fs::write(
        own.join("state"),
        mayfly_snapshot::file::encode(&header, &edited).unwrap(),
    )
    .unwrap();
    let err = restore_refused(&own, &[]);
    assert!(err.contains("this snapshot itself"), "{err}");
}

/// `mayfly restore DIR ARGS` must fail: what it printed on stderr.
fn restore_refused(dir: &Path, args: &[&str]) -> String {
    let dir = dir.to_string_lossy();
    let mut all = vec!["restore", &dir, "--console", "/dev/null"];
    all.extend_from_slice(args);
    let out = mayfly_output(&all, TIMEOUT);
    assert!(!out.status.success(), "{dir} restored");
    String::from_utf8_lossy(&out.stderr).into_owned()
}
