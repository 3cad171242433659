//! `mayfly serve`'s limits on what its sandboxes take of the host (on this machine's KVM,
//! with the probe guest): each VMM in a memory cgroup of its guest memory and an allowance,
//! counted so in the memory budget; only files in the images directories (`--images-dir`),
//! reached without links, read for a create; console and VMM logs capped; running
//! sandboxes' disk layers counted in the disk budget at every start; each template build
//! its own uid from the sandboxes' pool.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use mayfly_tests::guest::TestDir;
use mayfly_tests::probe;
use mayfly_tests::serve::Manager;
use serde_json::{json, Value};

/// The life-cycle events of `kind`, for any sandbox.
fn events_of(m: &Manager, kind: &str) -> Vec<Value> {
    std::fs::read_to_string(m.state.join("events.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|e| e["event"] == kind)
        .collect()
}

/// Wait until `done` holds, or fail saying `what`.
fn wait_until(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn probe_spec(name: &str, cmdline: &str) -> Value {
    json!({ "name": name, "kernel": probe::ELF, "mem_mib": 64, "cmdline": cmdline, "probe": true })
}

/// The memory cgroup process `pid` is in, and the file holding its limit: cgroup v2 where
/// its hierarchy has the memory controller, else cgroup v1's memory hierarchy.
fn memory_limit_file(pid: u64) -> PathBuf {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let mounts: Vec<(String, String, String, String)> = mountinfo
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let left: Vec<&str> = left.split_whitespace().collect();
            let right: Vec<&str> = right.split_whitespace().collect();
            Some((
                right[0].to_owned(),
                left[3].to_owned(),
                left[4].to_owned(),
                right.get(2).copied().unwrap_or_default().to_owned(),
            ))
        })
        .collect();
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let under = |point: &str, root: &str, path: &str| {
        let relative = path
            .strip_prefix(root.trim_end_matches('/'))
            .unwrap_or(path);
        Path::new(point).join(relative.trim_start_matches('/'))
    };
    if let Some((_, root, point, _)) = mounts.iter().find(|(fs, _, point, _)| {
        fs == "cgroup2"
            && std::fs::read_to_string(Path::new(point).join("cgroup.controllers"))
                .is_ok_and(|c| c.split_whitespace().any(|c| c == "memory"))
    }) {
        let path = cgroups.lines().find_map(|l| l.strip_prefix("0::")).unwrap();
        return under(point, root, path).join("memory.max");
    }
    let (_, root, point, _) = mounts
        .iter()
        .find(|(fs, _, _, options)| fs == "cgroup" && options.split(',').any(|o| o == "memory"))
        .expect("this host has a memory cgroup controller (v2 or v1)");
    let path = cgroups
        .lines()
        .find_map(|l| {
            let mut parts = l.splitn(3, ':');
            let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            controllers
                .split(',')
                .any(|c| c == "memory")
                .then_some(path)
        })
        .unwrap();
    under(point, root, path).join("memory.limit_in_bytes")
}

/// Class 2: each VMM (jailed or not) runs in a memory cgroup limited to its guest memory and
/// the VMM's allowance (256 MiB unless told), the memory budget counts both, and the group
/// goes with its sandbox.
#[test]
fn every_vmm_has_a_memory_limit_of_its_guest_and_its_allowance_counted_in_the_budget() {
    let dir = TestDir::new("serve-memory-limit");
    // Probes of 64 MiB with the default allowance: 320 MiB each, two fit in 700, three do
    // not (their guest memory alone would).
    let m = Manager::start_with(&dir, &["--mem-budget-mib", "700"]);
    let limit_of = |m: &Manager, name: &str| {
        let pid = m.describe(name)["pid"].as_u64().expect("a pid");
        let file = memory_limit_file(pid);
        let limit =
            std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        (file, limit.trim().parse::<u64>().unwrap())
    };
    m.create_probe("a", None);
    let (file, limit) = limit_of(&m, "a");
    assert_eq!(limit, (64 + 256) << 20, "{}", file.display());
    m.create_probe("b", None);
    let (status, body) = m.admin("POST", "/sandboxes", Some(probe_spec("c", "touch=1")));
    assert_eq!(status, 429, "{body}");
    let error = body["error"].as_str().unwrap();
    assert!(
        error.contains("needs 320 MiB") && error.contains("hold 640 MiB of the 700 MiB"),
        "{error}"
    );
    // Its group goes with it.
    assert_eq!(m.admin("DELETE", "/sandboxes/a", None).0, 200);
    let group = file.parent().unwrap().to_path_buf();
    wait_until(
        &format!("{} stays after its sandbox went", group.display()),
        Duration::from_secs(10),
        || !group.exists(),
    );
    assert_eq!(m.admin("DELETE", "/sandboxes/b", None).0, 200);
    drop(m);

    // An unjailed VMM is limited alike, by the allowance it is told.
    let dir = TestDir::new("serve-memory-limit-nojail");
    let m = Manager::start_with(&dir, &["--no-jail", "--vmm-allowance-mib", "100"]);
    m.create_probe("free", None);
    let (file, limit) = limit_of(&m, "free");
    assert_eq!(limit, (64 + 100) << 20, "{}", file.display());
    assert_eq!(m.admin("DELETE", "/sandboxes/free", None).0, 200);
}

/// Class 3: a create's files are read only from the images directories (`--images-dir`),
/// by their own path, with no symbolic link: anything else is refused (400, naming the
/// option) before any VMM starts; a snapshot holds only directories and regular files.
#[test]
fn a_create_reads_only_plain_files_in_the_images_directories() {
    let dir = TestDir::new("serve-images");
    let m = Manager::start(&dir);
    // Inside the test's directory (an images directory): links out, and a snapshot with one.
    std::os::unix::fs::symlink("/etc/passwd", dir.join("kernel-link")).unwrap();
    std::os::unix::fs::symlink("/etc", dir.join("etc")).unwrap();
    std::fs::write(dir.join("real"), b"not a kernel").unwrap();
    std::os::unix::fs::symlink("real", dir.join("near-link")).unwrap();
    let snapshot = dir.join("snap");
    std::fs::create_dir_all(snapshot.join("memory-layers")).unwrap();
    std::fs::write(snapshot.join("state"), b"x").unwrap();
    std::os::unix::fs::symlink("/proc/self", snapshot.join("memory-layers/proc")).unwrap();
    let refusals: [(Value, String); 10] = [
        (
            json!({"name": "a", "kernel": "/etc/shadow"}),
            "--images-dir".into(),
        ),
        (
            json!({"name": "a", "snapshot": "/proc/self"}),
            "--images-dir".into(),
        ),
        (
            json!({"name": "a", "rootfs": "/etc/shadow"}),
            "--images-dir".into(),
        ),
        (
            json!({"name": "a", "template": {"kernel": "/etc/shadow", "probe": true}}),
            "--images-dir".into(),
        ),
        (
            json!({"name": "a", "kernel": format!("{}/../../etc/passwd", dir.0.display())}),
            "--images-dir".into(),
        ),
        (
            json!({"name": "a", "kernel": dir.join("kernel-link")}),
            "symbolic link".into(),
        ),
        (
            json!({"name": "a", "kernel": dir.join("near-link")}),
            "symbolic link".into(),
        ),
        (
            json!({"name": "a", "initrd": dir.join("etc/passwd")}),
            "symbolic link".into(),
        ),
        (
            json!({"name": "a", "snapshot": snapshot}),
            "not a regular file".into(),
        ),
        (
            json!({"name": "a", "kernel": snapshot}),
            "not a regular file".into(),
        ),
    ];
    for (spec, says) in refusals {
        let (status, body) = m.admin("POST", "/sandboxes", Some(spec.clone()));
        assert_eq!(status, 400, "{spec}: {body}");
        let error = body["error"].as_str().unwrap_or_default();
        assert!(error.contains(&says), "{spec}: {error}");
    }
    // Nothing was started or made for any of them.
    assert_eq!(events_of(&m, "create_failed").len(), 0);
    assert_eq!(m.admin("GET", "/sandboxes", None).1["sandboxes"], json!([]));
    assert!(!m.state.join("sandboxes/a").exists());
    // A kernel in an images directory is read.
    m.create_probe("fine", None);
    assert_eq!(m.admin("DELETE", "/sandboxes/fine", None).0, 200);
}

/// Class 8: a sandbox's console file stops at `--console-limit`.
#[test]
fn a_sandboxs_console_file_stops_at_the_console_limit() {
    let dir = TestDir::new("serve-logs");
    let m = Manager::start_with(&dir, &["--console-limit", "4K"]);
    let (status, body) = m.admin(
        "POST",
        "/sandboxes",
        Some(probe_spec("loud", "touch=1 console=20000")),
    );
    assert_eq!(status, 201, "{body}");
    m.wait_probe("loud", "waiting", 1);
    // The guest wrote its 20,000 bytes before it waits.
    let console = std::fs::read_to_string(m.state.join("sandboxes/loud/console.log")).unwrap();
    assert_eq!(console.matches('x').count(), 4096, "{}", console.len());
    assert!(console.contains("MAYFLY_CONSOLE_LIMIT"), "{console}");
    assert_eq!(m.admin("DELETE", "/sandboxes/loud", None).0, 200);
}

/// Class 8: a sandbox's VMM log past its cap (4 MiB) keeps only its tail, and so does a
/// template's (its build's VMM writes there for as long as its setup runs).
#[test]
fn a_vmm_log_past_its_cap_keeps_only_its_tail() {
    let dir = TestDir::new("serve-vmm-log");
    let m = Manager::start(&dir);
    m.create_probe("loud", None);
    let template =
        json!({ "kernel": probe::ELF, "mem_mib": 64, "cmdline": "touch=1", "probe": true });
    m.create(json!({ "name": "made", "template": template }));
    let template_dir = std::fs::read_dir(m.state.join("templates"))
        .unwrap()
        .next()
        .expect("the template")
        .unwrap()
        .path();
    let logs = [
        m.state.join("sandboxes/loud/vmm.log"),
        template_dir.join("vmm.log"),
    ];
    for log in &logs {
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new().append(true).open(log).unwrap();
        file.write_all(&vec![b'y'; 16 << 20]).unwrap();
    }
    wait_until(
        "the VMM logs were not trimmed to their cap",
        Duration::from_secs(10),
        || events_of(&m, "vmm_log_trimmed").len() >= 2,
    );
    for log in &logs {
        let text = std::fs::read(log).unwrap();
        assert!(text.len() <= 4 << 20, "{}: {}", log.display(), text.len());
        assert!(
            text.starts_with(b"[mayfly serve: this log reached"),
            "{}",
            String::from_utf8_lossy(&text[..text.len().min(100)])
        );
        assert!(text.ends_with(b"yyyy"));
    }
    assert_eq!(m.admin("DELETE", "/sandboxes/loud", None).0, 200);
}

/// Class 8: a running sandbox's disk layers count in the disk budget: a start past it is
/// refused (429), and the idle watch notices it.
#[test]
fn a_running_sandboxs_disk_layers_count_in_the_disk_budget() {
    let dir = TestDir::new("serve-disk-layers");
    let m = Manager::start_with(&dir, &["--disk-budget-mib", "64"]);
    m.create_probe("writer", None);
    // Its disk layers grow past the budget (as its guest's writes would).
    let layers = m.state.join("sandboxes/writer/vm/disks");
    std::fs::create_dir_all(&layers).unwrap();
    std::fs::write(layers.join("grown"), vec![1u8; 70 << 20]).unwrap();
    let (status, body) = m.admin("POST", "/sandboxes", Some(probe_spec("next", "touch=1")));
    assert_eq!(status, 429, "{body}");
    let error = body["error"].as_str().unwrap();
    assert!(
        error.contains("disk budget") && error.contains("--disk-budget-mib"),
        "{error}"
    );
    assert!(!m.state.join("sandboxes/next").exists());
    wait_until(
        "the idle watch did not notice the disk over its budget",
        Duration::from_secs(15),
        || !events_of(&m, "disk_over_budget").is_empty(),
    );
    // Back under it, a start goes through.
    std::fs::remove_file(layers.join("grown")).unwrap();
    m.create_probe("next", None);
    for name in ["writer", "next"] {
        assert_eq!(
            m.admin("DELETE", &format!("/sandboxes/{name}"), None).0,
            200
        );
    }
}

/// Class 9: each template build runs as a uid of its own from the sandboxes' pool (two at
/// once, two uids), never a shared one, and gives it back when it is over; nothing of the
/// template stays that uid's.
#[test]
fn each_template_build_runs_as_a_uid_of_its_own_from_the_pool() {
    use std::os::unix::fs::MetadataExt;
    let dir = TestDir::new("serve-build-uids");
    let m = Manager::start(&dir);
    let template = |name: &str, touch: u32| {
        json!({
            "name": name,
            "template": {
                "kernel": probe::ELF, "probe": true, "mem_mib": 64,
                "cmdline": format!("touch={touch}"),
            },
        })
    };
    let m = &m;
    std::thread::scope(|scope| {
        let builds: Vec<_> = [("t1", 1), ("t2", 2)]
            .into_iter()
            .map(|(name, touch)| {
                scope.spawn(move || m.admin("POST", "/sandboxes", Some(template(name, touch))))
            })
            .collect();
        for build in builds {
            let (status, body) = build.join().unwrap();
            assert_eq!(status, 201, "{body}");
        }
    });
    // Nothing of a template is its builder's once built.
    for entry in std::fs::read_dir(m.state.join("templates")).unwrap() {
        let vm = entry.unwrap().path().join("vm");
        assert_eq!(std::fs::metadata(&vm).unwrap().uid(), 0, "{}", vm.display());
    }
    let built = events_of(m, "template_built");
    assert_eq!(built.len(), 2, "{built:?}");
    let uid = |e: &Value| e["uid"].as_u64().unwrap_or_else(|| panic!("no uid: {e}"));
    for build in &built {
        // From the pool (--jail-uid-base 1000000 by default), not one shared below it.
        assert!(uid(build) >= 1_000_000, "{build}");
    }
    // Built at the same time (each from its end less its length): two uids.
    let span = |e: &Value| {
        let end = e["ts_ms"].as_f64().unwrap();
        (end - e["ms"].as_f64().unwrap(), end)
    };
    let (a, b) = (span(&built[0]), span(&built[1]));
    if a.0 < b.1 && b.0 < a.1 {
        assert_ne!(uid(&built[0]), uid(&built[1]), "{built:?}");
    }
    // A third build while t1 and t2 hold their uids runs as the lowest free one, which
    // its sandbox then gets: the build gave it back.
    let sandbox_uids: Vec<u64> = ["t1", "t2"]
        .iter()
        .map(|n| m.describe(n)["uid"].as_u64().unwrap())
        .collect();
    let (status, body) = m.admin("POST", "/sandboxes", Some(template("t3", 3)));
    assert_eq!(status, 201, "{body}");
    let third = events_of(m, "template_built")[2].clone();
    assert!(
        !sandbox_uids.contains(&uid(&third)),
        "{third} {sandbox_uids:?}"
    );
    assert_eq!(m.describe("t3")["uid"].as_u64(), Some(uid(&third)));
    for name in ["t1", "t2", "t3"] {
        assert_eq!(
            m.admin("DELETE", &format!("/sandboxes/{name}"), None).0,
            200
        );
    }
}

/// Class 8: a snapshot in an images directory is refused (400) when its state names a disk
/// base outside the images directories: the VMM would open it as root and hand it to the
/// guest (its recorded identity is the state's own, so it matches). Nothing is started.
#[test]
fn a_snapshot_whose_state_names_a_disk_base_outside_the_images_directories_is_refused() {
    let dir = TestDir::new("serve-snapshot-base");
    // A real snapshot of a VM with a disk, its base in the test's (images) directory.
    let base = dir.join("base.img");
    std::fs::write(&base, vec![7u8; 8 << 20]).unwrap();
    let sock = dir.join("d.sock");
    let mut vm = probe::boot_with(64, &sock, "d", &["--disk", base.to_str().unwrap()]);
    assert_eq!(
        mayfly_tests::guest::request(&sock, "PUT", "/vm/pause", None).0,
        204
    );
    let snap = dir.join("snap");
    let (status, body) =
        mayfly_tests::guest::request(&sock, "PUT", "/vm/snapshot", Some(json!({ "path": snap })));
    assert_eq!(status, 200, "{body}");
    vm.signal(libc::SIGTERM);
    vm.wait_exit(Duration::from_secs(60));
    // The base moves out of the images directories (a rename keeps the identity the state
    // recorded), and the state says it is there: as if it named a host file of its choosing.
    let outside = dir.0.parent().unwrap().join(format!(
        "{}-outside.img",
        dir.0.file_name().unwrap().to_string_lossy()
    ));
    std::fs::rename(&base, &outside).unwrap();
    let bytes = std::fs::read(snap.join("state")).unwrap();
    let (header, mut state): (mayfly_snapshot::Header, mayfly_snapshot::VmState) =
        mayfly_snapshot::file::decode(&bytes, "state").unwrap();
    let mut disks = 0;
    for device in &mut state.devices.virtio {
        if let mayfly_devices::state::VirtioKindState::Block(block) = &mut device.device {
            block.chain.base = outside.clone();
            disks += 1;
        }
    }
    assert_eq!(disks, 1);
    std::fs::write(
        snap.join("state"),
        mayfly_snapshot::file::encode(&header, &state).unwrap(),
    )
    .unwrap();

    let m = Manager::start(&dir);
    let (status, body) = m.admin(
        "POST",
        "/sandboxes",
        Some(json!({ "name": "a", "snapshot": snap })),
    );
    let _ = std::fs::remove_file(&outside);
    assert_eq!(status, 400, "{body}");
    let error = body["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("--images-dir") && error.contains("base"),
        "{error}"
    );
    assert_eq!(events_of(&m, "create_failed").len(), 0);
    assert!(!m.state.join("sandboxes/a").exists());
}

/// Class 8: a FIFO named as a create's kernel is refused (400) at once: the manager's check
/// does not wait in `open` for a writer that never comes.
#[test]
fn a_fifo_named_as_a_kernel_is_refused_at_once() {
    let dir = TestDir::new("serve-fifo");
    let m = Manager::start(&dir);
    let fifo = dir.join("kernel-fifo");
    let name = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo with a NUL-terminated path; the result is checked.
    assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
    let (sock, admin) = (m.sock.clone(), m.admin.clone());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let answer = mayfly_tests::serve::call(
            &sock,
            Some(&admin),
            "POST",
            "/sandboxes",
            Some(json!({ "name": "a", "kernel": fifo, "probe": true })),
        );
        let _ = tx.send(answer);
    });
    let (status, body) = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the create naming a FIFO got no answer: the manager waits in open");
    assert_eq!(status, 400, "{body}");
    let error = body["error"].as_str().unwrap_or_default();
    assert!(error.contains("not a regular file"), "{error}");
    assert!(!m.state.join("sandboxes/a").exists());
}
