//! Disks on the host side, with the probe guest on this machine's own KVM (the guest does not
//! drive the disk; the guest tests in guest_disk.rs do): where a VM's layers go, what a
//! snapshot, a restore and a fork do with them, that the base is never written, and that bad
//! disks are refused before any VM runs.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use mayfly_devices::disk::LayerInfo;
use mayfly_tests::guest::{mayfly_output, request, Guest, TestDir};
use mayfly_tests::probe;

const TIMEOUT: Duration = Duration::from_secs(60);

/// A base image of `mib` MiB with content that is not all zeros.
fn base_image(dir: &TestDir, mib: usize) -> PathBuf {
    let path = dir.join("base.img");
    let data: Vec<u8> = (0..mib << 20).map(|i| (i % 251) as u8).collect();
    std::fs::write(&path, data).unwrap();
    path
}

fn boot_with_disk(dir: &TestDir, name: &str, disk: &str) -> (Guest, PathBuf) {
    let sock = dir.join(&format!("{name}.sock"));
    let guest = probe::boot_with(64, &sock, name, &["--disk", disk]);
    (guest, sock)
}

/// The layer files in `dir`, sorted.
fn layers_in(dir: &Path) -> Vec<PathBuf> {
    let mut layers: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "layer"))
        .collect();
    layers.sort();
    layers
}

fn sha(path: &Path) -> Vec<u8> {
    // The content itself (small test images): equal bytes, equal image.
    std::fs::read(path).unwrap()
}

fn stop(mut guest: Guest) {
    guest.signal(libc::SIGTERM);
    guest.wait_exit(TIMEOUT);
}

#[test]
fn layers_follow_snapshot_restore_and_fork_and_the_base_is_never_written() {
    let dir = TestDir::new("disk-layers");
    let base = base_image(&dir, 8);
    let before = sha(&base);
    let (vm, sock) = boot_with_disk(&dir, "d", &base.to_string_lossy());
    // Booted: one layer on the base, in <api-sock>.disks, with a manifest.
    let disks = dir.join("d.sock.disks");
    let first = layers_in(&disks);
    assert_eq!(first.len(), 1, "{first:?}");
    assert!(disks.join("vda.chain.json").is_file());
    let info = LayerInfo::read(&first[0]).unwrap();
    assert_eq!(info.parent, None);
    assert!(!info.frozen);

    // A snapshot freezes that layer and links it into the snapshot; the VM goes on on a new
    // top stacked on it.
    assert_eq!(request(&sock, "PUT", "/vm/pause", None).0, 204);
    let snap = dir.join("snap");
    let (status, body) = request(
        &sock,
        "PUT",
        "/vm/snapshot",
        Some(serde_json::json!({ "path": snap })),
    );
    assert_eq!(status, 200, "{body}");
    let frozen = LayerInfo::read(&first[0]).unwrap();
    assert!(frozen.frozen);
    let linked = layers_in(&snap.join("disks"));
    assert_eq!(linked.len(), 1, "{linked:?}");
    let (a, b) = (
        std::fs::metadata(&first[0]).unwrap(),
        std::fs::metadata(&linked[0]).unwrap(),
    );
    assert_eq!((a.dev(), a.ino()), (b.dev(), b.ino()), "a link, not a copy");
    let now = layers_in(&disks);
    assert_eq!(now.len(), 2, "{now:?}");
    let top = now.iter().find(|p| **p != first[0]).unwrap();
    assert_eq!(LayerInfo::read(top).unwrap().parent, Some(frozen.id));

    // A restore stacks a top of its own on the snapshot's frozen chain, in its own directory.
    let rsock = dir.join("r.sock");
    let restored = Guest::start(&[
        "restore",
        &snap.to_string_lossy(),
        "--console",
        "/dev/null",
        "--api-sock",
        &rsock.to_string_lossy(),
    ]);
    probe::wait_report(&restored, "resumed");
    let rtop = layers_in(&dir.join("r.sock.disks"));
    assert_eq!(rtop.len(), 1, "{rtop:?}");
    assert_eq!(LayerInfo::read(&rtop[0]).unwrap().parent, Some(frozen.id));

    // A fork of the restored VM: every clone gets its own top on the restored VM's frozen
    // chain, which the restored VM itself goes on from too.
    let (status, fork) = request(
        &rsock,
        "PUT",
        "/vm/fork",
        Some(serde_json::json!({"count": 2})),
    );
    assert_eq!(status, 200, "{fork}");
    let rfrozen = LayerInfo::read(&rtop[0]).unwrap();
    assert!(rfrozen.frozen, "the fork froze the restored VM's top");
    for clone in fork["clones"].as_array().unwrap() {
        let clone_dir = PathBuf::from(clone["disk_dir"].as_str().unwrap());
        let layers = layers_in(&clone_dir);
        assert_eq!(layers.len(), 1, "{layers:?}");
        assert_eq!(
            LayerInfo::read(&layers[0]).unwrap().parent,
            Some(rfrozen.id)
        );
        let pid = clone["pid"].as_u64().unwrap() as i32;
        // SAFETY: kill(2) of a clone this test started.
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }
    stop(restored);
    stop(vm);
    assert_eq!(sha(&base), before, "the base image was written");
}

#[test]
fn a_vmm_started_again_on_its_disk_directory_carries_on_on_the_same_layer() {
    let dir = TestDir::new("disk-again");
    let base = base_image(&dir, 1);
    let (vm, _) = boot_with_disk(&dir, "a", &base.to_string_lossy());
    let disks = dir.join("a.sock.disks");
    let manifest = std::fs::read(disks.join("vda.chain.json")).unwrap();
    let layers = layers_in(&disks);
    vm.signal(libc::SIGKILL);
    let mut vm = vm;
    vm.wait_exit(TIMEOUT);
    let (vm, _) = boot_with_disk(&dir, "a", &base.to_string_lossy());
    assert_eq!(
        layers_in(&disks),
        layers,
        "no new layer: the same one reopened"
    );
    assert_eq!(
        std::fs::read(disks.join("vda.chain.json")).unwrap(),
        manifest
    );
    stop(vm);
}

/// `mayfly ARGS` that must fail before any VM runs: its stderr.
fn refused(args: &[&str]) -> String {
    let out = mayfly_output(args, TIMEOUT);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

fn assert_contains(text: &str, expected: &str) {
    assert!(text.contains(expected), "expected {expected:?} in {text:?}");
}

#[test]
fn bad_disks_are_refused_before_the_vm_runs() {
    let dir = TestDir::new("disk-bad");
    let base = base_image(&dir, 1);
    let run = |disk: &str, extra: &[&str]| {
        let sock = dir.join("bad.sock");
        let mut args = vec![
            "run",
            "--probe",
            "--kernel",
            probe::ELF,
            "--console",
            "/dev/null",
            "--disk",
            disk,
        ];
        args.extend_from_slice(extra);
        if !extra.contains(&"--no-sock") {
            args.extend_from_slice(&["--api-sock", sock.to_str().unwrap()]);
        } else {
            args.retain(|a| *a != "--no-sock");
        }
        refused(&args)
    };
    assert_contains(&run(&dir.arg("missing.img"), &[]), "missing.img");
    assert_contains(&run(&dir.0.to_string_lossy(), &[]), "not a regular file");
    let fifo = dir.join("fifo.img");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path; checked.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    assert_contains(&run(fifo.to_str().unwrap(), &[]), "not a regular file");
    assert_contains(
        &run(&format!("{},bogus", base.display()), &[]),
        "expected PATH or PATH,ro",
    );
    // Writable, with nowhere to put its layer.
    assert_contains(&run(base.to_str().unwrap(), &["--no-sock"]), "--disk-dir");
    // A disk directory that is a file.
    let file = dir.join("file");
    std::fs::write(&file, b"x").unwrap();
    assert_contains(
        &run(
            base.to_str().unwrap(),
            &["--no-sock", "--disk-dir", file.to_str().unwrap()],
        ),
        "not a directory",
    );
    // An empty image is too small to be a disk.
    let empty = dir.join("empty.img");
    std::fs::write(&empty, b"").unwrap();
    let stderr = run(empty.to_str().unwrap(), &[]);
    assert!(stderr.contains("vda"), "{stderr}");
}

#[test]
fn a_snapshot_refuses_to_restore_over_a_changed_base_or_damaged_layers() {
    let dir = TestDir::new("disk-changed");
    let base = base_image(&dir, 1);
    let (vm, sock) = boot_with_disk(&dir, "c", &base.to_string_lossy());
    assert_eq!(request(&sock, "PUT", "/vm/pause", None).0, 204);
    let snap = dir.join("snap");
    let (status, body) = request(
        &sock,
        "PUT",
        "/vm/snapshot",
        Some(serde_json::json!({ "path": snap })),
    );
    assert_eq!(status, 200, "{body}");
    stop(vm);
    let restore = |snap: &Path| {
        refused(&[
            "restore",
            &snap.to_string_lossy(),
            "--console",
            "/dev/null",
            "--api-sock",
            &dir.arg("r.sock"),
        ])
    };
    // A truncated layer.
    let copy = dir.join("snap-truncated");
    copy_snapshot(&snap, &copy);
    let layer = layers_in(&copy.join("disks")).remove(0);
    let len = std::fs::metadata(&layer).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&layer)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let stderr = restore(&copy);
    assert!(stderr.contains("vda"), "{stderr}");
    // A missing layer.
    let copy = dir.join("snap-missing");
    copy_snapshot(&snap, &copy);
    std::fs::remove_file(layers_in(&copy.join("disks")).remove(0)).unwrap();
    assert_contains(&restore(&copy), "vda");
    // A layer of another chain (another VM's, on the same base) in place of the right one.
    let (other, osock) = boot_with_disk(&dir, "o", &base.to_string_lossy());
    assert_eq!(request(&osock, "PUT", "/vm/pause", None).0, 204);
    let other_snap = dir.join("other-snap");
    let (status, body) = request(
        &osock,
        "PUT",
        "/vm/snapshot",
        Some(serde_json::json!({ "path": other_snap })),
    );
    assert_eq!(status, 200, "{body}");
    stop(other);
    let copy = dir.join("snap-foreign");
    copy_snapshot(&snap, &copy);
    let ours = layers_in(&copy.join("disks")).remove(0);
    std::fs::copy(layers_in(&other_snap.join("disks")).remove(0), &ours).unwrap();
    let stderr = restore(&copy);
    assert_contains(&stderr, "is not the one the snapshot saw");
    // What the file in its place is stays unsaid (the snapshot's writer may not read it).
    let foreign = LayerInfo::read(&ours).unwrap().id.to_string();
    assert!(!stderr.contains(&foreign), "{stderr}");
    // A layer in disks/ that is a symbolic link to a file outside the snapshot (a copy of the
    // right layer, so nothing else is wrong with it): refused, whatever the file holds.
    let copy = dir.join("snap-linked");
    copy_snapshot(&snap, &copy);
    let layer = layers_in(&copy.join("disks")).remove(0);
    let outside = dir.join("outside.layer");
    std::fs::rename(&layer, &outside).unwrap();
    std::os::unix::fs::symlink(&outside, &layer).unwrap();
    assert_contains(
        &restore(&copy),
        "cannot be opened inside its disks/ directory",
    );
    // The base changed since the snapshot.
    let mut data = std::fs::read(&base).unwrap();
    data[4096] ^= 0xff;
    std::fs::write(&base, data).unwrap();
    let stderr = restore(&snap);
    assert_contains(&stderr, "is not the one the disk was made on");
    // The digest of the file now at the base's path stays unsaid: an oracle over host files.
    let now = mayfly_vmm::devices::disks::base_identity(&base).unwrap();
    assert!(!stderr.contains(&now), "{stderr}");
}

/// A copy of a snapshot directory (its layers copied, not linked, so they can be damaged).
fn copy_snapshot(from: &Path, to: &Path) {
    std::fs::create_dir_all(to.join("disks")).unwrap();
    for name in ["state", "memory"] {
        std::fs::copy(from.join(name), to.join(name)).unwrap();
    }
    for layer in layers_in(&from.join("disks")) {
        std::fs::copy(&layer, to.join("disks").join(layer.file_name().unwrap())).unwrap();
    }
}
