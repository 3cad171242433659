//! The jail (vmm/src/jail.rs), on this machine's KVM with the probe guest: a jailed VMM runs
//! as an unprivileged uid with no capabilities, in namespaces of its own, in a root that holds
//! only what it shares, in a cgroup of its own; its VM boots, snapshots into a shared
//! directory, restores jailed in every memory mode; what it cannot do is refused in words; and
//! whatever ends it, its jail, cgroup and sockets go with it.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use mayfly_tests::guest::{mayfly_output, request, Guest, TestDir};
use mayfly_tests::netns::{links_in, uplink};
use mayfly_tests::probe;

const NOBODY: u32 = 65534;

/// A field of /proc/PID/status.
fn status_field(pid: u32, field: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
        .trim()
        .to_string()
}

fn namespace(pid: &str, kind: &str) -> PathBuf {
    std::fs::read_link(format!("/proc/{pid}/ns/{kind}")).unwrap()
}

/// The jailed VMM's pid on the host and its jail, from its control socket.
/// The jail waiter's socket beside a VM's control socket.
fn net_socket(sock: &Path) -> PathBuf {
    PathBuf::from(format!("{}.net", sock.display()))
}

fn jail_of(sock: &Path) -> (u32, serde_json::Value) {
    let (status, vm) = request(sock, "GET", "/vm", None);
    assert_eq!(status, 200, "{vm}");
    let pid = vm["pid"].as_u64().expect("a pid") as u32;
    (pid, vm["jail"].clone())
}

/// A directory the jail's uid may write (the test runs as root).
fn shared_dir(dir: &TestDir, name: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::create_dir(&path).unwrap();
    std::os::unix::fs::chown(&path, Some(NOBODY), Some(NOBODY)).unwrap();
    path
}

fn boot_jailed(dir: &TestDir, sock: &Path, share: &Path, name: &str) -> Guest {
    probe::boot_with(
        64,
        sock,
        name,
        &[
            "--jail",
            "--jail-dir",
            &dir.arg("jails"),
            "--jail-share",
            &share.to_string_lossy(),
        ],
    )
}

#[test]
fn a_jailed_vmm_runs_unprivileged_alone_in_its_root_and_its_vm_snapshots_and_restores() {
    let dir = TestDir::new("jail-life");
    let snaps = shared_dir(&dir, "snaps");
    let sock = dir.join("vm.sock");
    let mut guest = boot_jailed(&dir, &sock, &snaps, "jailed");
    let (pid, jail) = jail_of(&sock);
    assert_ne!(
        pid,
        guest.pid(),
        "the VMM runs in a child of the mayfly started"
    );

    // Unprivileged, with nothing of root left.
    assert_eq!(
        status_field(pid, "Uid"),
        format!("{NOBODY}\t{NOBODY}\t{NOBODY}\t{NOBODY}")
    );
    assert_eq!(
        status_field(pid, "Gid"),
        format!("{NOBODY}\t{NOBODY}\t{NOBODY}\t{NOBODY}")
    );
    assert_eq!(status_field(pid, "Groups"), "");
    assert_eq!(status_field(pid, "CapEff"), "0000000000000000");
    assert_eq!(status_field(pid, "CapPrm"), "0000000000000000");
    assert_eq!(status_field(pid, "NoNewPrivs"), "1");
    // PID 1 of a PID namespace of its own, and in mount, network, IPC and UTS ones.
    assert_eq!(status_field(pid, "NSpid"), format!("{pid}\t1"));
    for kind in ["mnt", "pid", "net", "ipc", "uts"] {
        assert_ne!(
            namespace(&pid.to_string(), kind),
            namespace("self", kind),
            "the VMM shares the {kind} namespace with the host"
        );
    }
    // Its root holds its /proc, the shared directory and the directory of its vsock socket
    // (the test directory, read-only): nothing of the host's root.
    let root = PathBuf::from(format!("/proc/{pid}/root"));
    let mut top: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    top.sort();
    let first = dir.0.components().nth(1).unwrap();
    let first = first.as_os_str().to_string_lossy().into_owned();
    let mut expected = vec![first, "proc".to_string()];
    expected.sort();
    assert_eq!(top, expected, "the jail's root");
    assert!(!root.join("etc").exists() && !root.join("dev").exists());
    // Its /proc shows its own PID namespace: itself only.
    let pids: Vec<String> = std::fs::read_dir(root.join("proc"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .map(|p| p.to_string())
        .collect();
    assert_eq!(pids, vec!["1".to_string()], "the jail's /proc");
    // Its cgroup is its own.
    if let Some(cgroup) = jail["cgroup"].as_str() {
        let procs = std::fs::read_to_string(Path::new(cgroup).join("cgroup.procs")).unwrap();
        assert_eq!(procs.trim(), pid.to_string(), "{cgroup}");
    }
    assert_eq!(jail["uid"], NOBODY);

    // It writes snapshots where it shares, and nowhere else.
    let (status, body) = request(&sock, "PUT", "/vm/pause", None);
    assert_eq!(status, 204, "{body}");
    let outside = dir.join("outside");
    let (status, body) = request(
        &sock,
        "PUT",
        "/vm/snapshot",
        Some(serde_json::json!({ "path": outside })),
    );
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("--jail-share"),
        "{body}"
    );
    assert!(!outside.exists());
    let snap = snaps.join("s1");
    let (status, body) = request(
        &sock,
        "PUT",
        "/vm/snapshot",
        Some(serde_json::json!({ "path": snap })),
    );
    assert_eq!(status, 200, "{body}");
    // A fork on its own socket is refused, in words that say how to fork it.
    let (status, body) = request(
        &sock,
        "PUT",
        "/vm/fork",
        Some(serde_json::json!({ "count": 1 })),
    );
    assert_eq!(status, 409, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("mayfly fork"),
        "{body}"
    );
    let (status, body) = request(&sock, "PUT", "/vm/shutdown", None);
    assert_eq!(status, 204, "{body}");
    assert!(guest.wait_exit(Duration::from_secs(30)).success());

    // The snapshot restores jailed, in every memory mode, and the guest carries on.
    for mode in ["cow", "lazy", "eager"] {
        let rsock = dir.join(&format!("r-{mode}.sock"));
        let mut restored = Guest::start(&[
            "restore",
            &snap.to_string_lossy(),
            "--memory",
            mode,
            "--console",
            "/dev/null",
            "--api-sock",
            &rsock.to_string_lossy(),
            "--jail",
            "--jail-dir",
            &dir.arg("jails"),
        ]);
        probe::wait_report(&restored, "verified");
        let (rpid, _) = jail_of(&rsock);
        assert_eq!(status_field(rpid, "Uid").split('\t').next(), Some("65534"));
        let (status, body) = request(&rsock, "PUT", "/vm/shutdown", None);
        assert_eq!(status, 204, "{body}");
        assert!(
            restored.wait_exit(Duration::from_secs(30)).success(),
            "{mode}"
        );
        assert!(
            !rsock.exists(),
            "the waiter clears the socket after a {mode} restore"
        );
    }
    // Every jail is gone with its VMM.
    let left: Vec<_> = std::fs::read_dir(dir.join("jails")).unwrap().collect();
    assert!(left.is_empty(), "jails left behind: {left:?}");
}

fn wait_gone(path: &Path, what: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while path.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what} {} left behind",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_jailed_vm_forks_from_outside_into_clones_each_in_a_jail_of_its_own() {
    let dir = TestDir::new("jail-fork");
    let snaps = shared_dir(&dir, "snaps");
    let sock = dir.join("p.sock");
    let mut parent = boot_jailed(&dir, &sock, &snaps, "p");
    let (parent_pid, parent_jail) = jail_of(&sock);

    let out = mayfly_output(
        &["fork", "--sock", &sock.to_string_lossy(), "--count", "3"],
        Duration::from_secs(120),
    );
    assert!(
        out.status.success(),
        "mayfly fork of a jailed VM: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let clones = report["clones"].as_array().unwrap();
    assert_eq!(clones.len(), 3, "{report}");
    // The parent ran on: paused only while its state was captured.
    let (status, vm) = request(&sock, "GET", "/vm", None);
    assert_eq!(
        (status, vm["state"].as_str()),
        (200, Some("running")),
        "{vm}"
    );

    let mut seen = Vec::new();
    let mut generations = Vec::new();
    for clone in clones {
        let name = clone["name"].as_str().unwrap();
        let clone_sock = PathBuf::from(clone["api_sock"].as_str().unwrap());
        let (pid, jail) = jail_of(&clone_sock);
        // The answer names its VMM, and the process to signal: its jail's waiter, the
        // VMM's parent.
        assert_eq!(clone["vmm_pid"].as_u64(), Some(u64::from(pid)), "{clone}");
        assert_eq!(
            status_field(pid, "PPid"),
            clone["pid"].as_u64().unwrap().to_string(),
            "{clone}"
        );
        let (_, vm) = request(&clone_sock, "GET", "/vm", None);
        assert_eq!(vm["name"], name, "{vm}");
        assert_eq!(vm["origin"], "fork of p", "{vm}");
        // Unprivileged as its parent is, PID 1 of a namespace of its own.
        assert_eq!(
            status_field(pid, "Uid"),
            format!("{NOBODY}\t{NOBODY}\t{NOBODY}\t{NOBODY}")
        );
        assert_eq!(status_field(pid, "CapEff"), "0000000000000000");
        assert_eq!(status_field(pid, "NoNewPrivs"), "1");
        assert_eq!(status_field(pid, "NSpid"), format!("{pid}\t1"));
        // Its namespaces are its own: not the host's, not its parent's, not a sibling's.
        for kind in ["mnt", "pid", "net", "ipc", "uts"] {
            let own = namespace(&pid.to_string(), kind);
            assert_ne!(
                own,
                namespace("self", kind),
                "{name} shares the host's {kind}"
            );
            assert_ne!(
                own,
                namespace(&parent_pid.to_string(), kind),
                "{name} shares its parent's {kind}"
            );
            seen.push((kind, own));
        }
        // A root of its own, and a cgroup holding it alone.
        assert_ne!(jail["dir"], parent_jail["dir"]);
        let root = PathBuf::from(format!("/proc/{pid}/root"));
        assert!(!root.join("etc").exists() && !root.join("dev").exists());
        if let Some(cgroup) = jail["cgroup"].as_str() {
            let read = |file: &str| std::fs::read_to_string(Path::new(cgroup).join(file));
            assert_eq!(
                read("cgroup.procs").unwrap().trim(),
                pid.to_string(),
                "{cgroup}"
            );
            // Its parent's limits, as the parent's cgroup has them (where the cgroup v2
            // hierarchy offers the controller).
            let parent_cgroup = Path::new(parent_jail["cgroup"].as_str().unwrap());
            for file in ["memory.max", "pids.max", "cpu.max"] {
                if let Ok(max) = read(file) {
                    let parents = std::fs::read_to_string(parent_cgroup.join(file)).unwrap();
                    assert_eq!(max, parents, "{cgroup}/{file}");
                }
            }
        }
        // Its guest runs, restored from the parent with a generation of its own.
        generations.push(probe::resumed_generation(Path::new(
            clone["console_log"].as_str().unwrap(),
        )));
    }
    let kinds = seen.len();
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), kinds, "two clones share a namespace");
    generations.sort();
    generations.dedup();
    assert_eq!(
        generations.len(),
        3,
        "every clone has its own generation ID"
    );

    // A clone shut down takes its jail, cgroup and sockets along, and no one else.
    let first = &clones[0];
    let first_sock = PathBuf::from(first["api_sock"].as_str().unwrap());
    let (_, first_jail) = jail_of(&first_sock);
    let (status, body) = request(&first_sock, "PUT", "/vm/shutdown", None);
    assert_eq!(status, 204, "{body}");
    wait_gone(
        Path::new(first_jail["dir"].as_str().unwrap()),
        "a clone's jail",
    );
    if let Some(cgroup) = first_jail["cgroup"].as_str() {
        wait_gone(Path::new(cgroup), "a clone's cgroup");
    }
    wait_gone(&first_sock, "a clone's socket");
    for clone in &clones[1..] {
        let clone_sock = PathBuf::from(clone["api_sock"].as_str().unwrap());
        assert_eq!(request(&clone_sock, "GET", "/vm", None).0, 200);
        let (status, body) = request(&clone_sock, "PUT", "/vm/shutdown", None);
        assert_eq!(status, 204, "{body}");
        wait_gone(&clone_sock, "a clone's socket");
    }
    let (status, body) = request(&sock, "PUT", "/vm/shutdown", None);
    assert_eq!(status, 204, "{body}");
    assert!(parent.wait_exit(Duration::from_secs(30)).success());
    let jails = dir.join("jails");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let left: Vec<_> = std::fs::read_dir(&jails).unwrap().collect();
        if left.is_empty() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "jails left behind: {left:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn whatever_ends_a_jailed_vmm_ends_its_mayfly_the_same_way_and_takes_its_jail_along() {
    let dir = TestDir::new("jail-end");
    let snaps = shared_dir(&dir, "snaps");

    // SIGTERM to the mayfly started: the VM stops cleanly, 128 + 15.
    let sock = dir.join("a.sock");
    let mut guest = boot_jailed(&dir, &sock, &snaps, "term");
    let (_, jail) = jail_of(&sock);
    guest.signal(libc::SIGTERM);
    let status = guest.wait_exit(Duration::from_secs(30));
    assert_eq!(
        status.code(),
        Some(128 + libc::SIGTERM),
        "{}",
        guest.stderr()
    );
    assert!(!sock.exists() && !Path::new(&format!("{}.lock", sock.display())).exists());
    assert!(!Path::new(jail["dir"].as_str().unwrap()).exists());
    if let Some(cgroup) = jail["cgroup"].as_str() {
        assert!(!Path::new(cgroup).exists(), "{cgroup} left behind");
    }

    // kill -9 of the VMM itself: the mayfly started ends by the same signal, and cleans up.
    let sock = dir.join("b.sock");
    let mut guest = boot_jailed(&dir, &sock, &snaps, "killed");
    let (pid, jail) = jail_of(&sock);
    // SAFETY: kill(2) on the jailed VMM this test started.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    let status = guest.wait_exit(Duration::from_secs(30));
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    assert!(!sock.exists());
    assert!(!Path::new(jail["dir"].as_str().unwrap()).exists());

    // kill -9 of the mayfly started: the VMM dies with it (nothing runs on unwatched), and
    // the next jail made there clears what it left.
    let sock = dir.join("c.sock");
    let guest = boot_jailed(&dir, &sock, &snaps, "orphan");
    let (pid, jail) = jail_of(&sock);
    guest.signal(libc::SIGKILL);
    drop(guest);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while Path::new(&format!("/proc/{pid}")).exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "the VMM outlived its mayfly"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let stale = PathBuf::from(jail["dir"].as_str().unwrap());
    assert!(stale.exists(), "a killed waiter cannot clean up");
    let sock = dir.join("d.sock");
    let mut guest = boot_jailed(&dir, &sock, &snaps, "next");
    assert!(
        !stale.exists(),
        "the next jail clears a dead one's directory"
    );
    if let Some(cgroup) = jail["cgroup"].as_str() {
        assert!(!Path::new(cgroup).exists(), "the next jail clears {cgroup}");
    }
    request(&sock, "PUT", "/vm/shutdown", None);
    assert!(guest.wait_exit(Duration::from_secs(30)).success());
}

#[test]
fn jail_options_that_cannot_work_are_refused_before_any_vm_exists() {
    let dir = TestDir::new("jail-refused");
    let jails = dir.arg("jails");
    let root_owned = dir.join("root-owned");
    std::fs::create_dir(&root_owned).unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "run",
            "--probe",
            "--kernel",
            probe::ELF,
            "--mem-mib",
            "64",
            "--console",
            "/dev/null",
            "--jail",
            "--jail-dir",
            &jails,
        ];
        args.extend_from_slice(extra);
        let out = mayfly_output(&args, Duration::from_secs(30));
        assert_eq!(out.status.code(), Some(1), "{extra:?} was not refused");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    assert!(run(&["--jail-uid", "0"]).contains("must not be 0"));
    let err = run(&["--jail-share", &root_owned.to_string_lossy()]);
    assert!(
        err.contains("uid 65534 cannot write it") && err.contains("chown"),
        "{err}"
    );
    assert!(run(&["--jail-share", "relative/dir"]).contains("absolute path"));
    assert!(run(&["--jail-cpus", "0"]).contains("above 0"));
    assert!(run(&["--jail-pids", "0"]).contains("above 0"));
    // A memory limit needs cgroup v2's memory controller: where the host keeps it in cgroup
    // v1 (this project's build machines), that is said; where it has it, the limit is set.
    let controllers = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .find_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            (right.starts_with("cgroup2 "))
                .then(|| left.split_whitespace().nth(4).map(String::from))?
        })
        .map(|mount| {
            std::fs::read_to_string(Path::new(&mount).join("cgroup.controllers")).unwrap()
        });
    match controllers {
        Some(c) if !c.split_whitespace().any(|c| c == "memory") => {
            let err = run(&["--jail-memory-mib", "256"]);
            assert!(
                err.contains("has no memory controller") && err.contains(c.trim()),
                "{err}"
            );
        }
        Some(_) => {
            let sock = dir.join("mem.sock");
            let snaps = shared_dir(&dir, "snaps");
            let mut guest = Guest::start(&[
                "run",
                "--probe",
                "--kernel",
                probe::ELF,
                "--mem-mib",
                "64",
                "--console",
                "/dev/null",
                "--api-sock",
                &sock.to_string_lossy(),
                "--jail",
                "--jail-dir",
                &jails,
                "--jail-share",
                &snaps.to_string_lossy(),
                "--jail-memory-mib",
                "256",
            ]);
            assert!(guest.wait_stderr("mayfly-probe: waiting", probe::TIMEOUT));
            let (_, jail) = jail_of(&sock);
            let cgroup = PathBuf::from(jail["cgroup"].as_str().unwrap());
            let max = std::fs::read_to_string(cgroup.join("memory.max")).unwrap();
            assert_eq!(max.trim(), (256u64 << 20).to_string());
            request(&sock, "PUT", "/vm/shutdown", None);
            assert!(guest.wait_exit(Duration::from_secs(30)).success());
        }
        None => {
            let err = run(&["--jail-memory-mib", "256"]);
            assert!(err.contains("none is mounted"), "{err}");
        }
    }
    // Nothing was left behind by the refusals.
    let left: Vec<_> = std::fs::read_dir(&jails).into_iter().flatten().collect();
    assert!(left.is_empty(), "{left:?}");
    // The jail's options need --jail (usage error, status 2).
    let out = mayfly_output(
        &["run", "--jail-uid", "1000", "--console", "/dev/null"],
        Duration::from_secs(30),
    );
    assert_eq!(out.status.code(), Some(2));
}

/// What the process `pid` holds open: the targets of /proc/PID/fd/*.
fn open_files(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .map(|t| t.to_string_lossy().into_owned())
        .collect()
}

#[test]
fn a_jailed_vm_has_a_nic_whose_network_its_waiter_keeps_and_only_root_changes() {
    let dir = TestDir::new("jail-net");
    let snaps = shared_dir(&dir, "snaps");
    let (uplink_ns, uplink_path) = uplink();
    let net_dir = dir.arg("net");
    let sock = dir.join("vm.sock");
    let net_args = |policy: &'static str| -> Vec<String> {
        [
            "--net",
            policy,
            "--net-uplink",
            &uplink_path,
            "--net-dir",
            &net_dir,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let mut args: Vec<String> = vec![
        "--jail".into(),
        "--jail-dir".into(),
        dir.arg("jails"),
        "--jail-share".into(),
        snaps.to_string_lossy().into_owned(),
    ];
    args.extend(net_args("allow=192.0.2.0/24:443"));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut guest = probe::boot_with(64, &sock, "jailed-net", &args);
    let (pid, _) = jail_of(&sock);
    assert_eq!(status_field(pid, "Uid").split('\t').next(), Some("65534"));

    // The VM has its NIC and network, as unjailed: a namespace, a veth out to the uplink.
    let (status, net) = request(&sock, "GET", "/vm/net", None);
    assert_eq!(status, 200, "{net}");
    assert_eq!(net["policy"], "allow=192.0.2.0/24:443", "{net}");
    assert!(net["counters"].is_object(), "{net}");
    let host_link = net["host_link"]["name"].as_str().unwrap().to_string();
    assert!(links_in(&uplink_ns).contains(&host_link), "{net}");
    // The VMM holds the tap and nothing else of the network: no namespace of it.
    let held = open_files(pid);
    assert!(held.iter().any(|f| f == "/dev/net/tun"), "{held:?}");
    assert!(!held.iter().any(|f| f.starts_with("net:")), "{held:?}");

    // Its own control socket does not change the policy (its guest may own it)...
    let (status, body) = request(
        &sock,
        "PUT",
        "/vm/net/policy",
        Some(serde_json::json!({ "policy": "open" })),
    );
    assert_eq!(status, 409, "{body}");
    assert!(body["error"].as_str().unwrap().contains(".net"), "{body}");
    // ...its waiter's does, which only root reaches.
    let kept = dir.join("vm.sock.net");
    let meta = std::fs::metadata(&kept).expect("the waiter's socket");
    assert_eq!((meta.uid(), meta.permissions().mode() & 0o777), (0, 0o600));
    let as_nobody = Command::new(mayfly_tests::guest::mayfly_bin())
        .args(["net", "--sock", &sock.to_string_lossy(), "--policy", "open"])
        .uid(NOBODY)
        .gid(NOBODY)
        .output()
        .unwrap();
    assert!(!as_nobody.status.success());
    let err = String::from_utf8_lossy(&as_nobody.stderr);
    assert!(err.contains("ermission denied"), "{err}");
    let out = mayfly_tests::guest::mayfly_ok(&[
        "net",
        "--sock",
        &sock.to_string_lossy(),
        "--policy",
        "allow=198.51.100.0/24",
    ]);
    assert!(out.contains("allow=198.51.100.0/24"), "{out}");
    let (status, net) = request(&sock, "GET", "/vm/net", None);
    assert_eq!(
        (status, net["policy"].as_str()),
        (200, Some("allow=198.51.100.0/24"))
    );
    // A fork (from outside, as root) gives each clone a jail, a network, a MAC and an
    // outside address of its own, kept by its own waiter, with its parent's policy.
    // Its networks go where the parent's went: this command says where (--net-*), as the
    // parent's did, not the parent's VMM.
    let out = mayfly_tests::guest::mayfly_ok(&[
        "fork",
        "--sock",
        &sock.to_string_lossy(),
        "--count",
        "2",
        "--net-uplink",
        &uplink_path,
        "--net-dir",
        &net_dir,
    ]);
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    let mut addresses = vec![net["outside_ip"].as_str().unwrap().to_string()];
    let mut macs = vec![net["guest"]["mac"].as_str().unwrap().to_string()];
    let mut links = vec![host_link.clone()];
    for clone in report["clones"].as_array().unwrap() {
        let clone_sock = PathBuf::from(clone["api_sock"].as_str().unwrap());
        let (clone_pid, _) = jail_of(&clone_sock);
        assert_ne!(
            namespace(&clone_pid.to_string(), "net"),
            namespace(&pid.to_string(), "net")
        );
        let (status, clone_net) = request(&clone_sock, "GET", "/vm/net", None);
        assert_eq!(status, 200, "{clone_net}");
        assert_eq!(clone_net["policy"], "allow=198.51.100.0/24", "{clone_net}");
        addresses.push(clone_net["outside_ip"].as_str().unwrap().to_string());
        macs.push(clone_net["guest"]["mac"].as_str().unwrap().to_string());
        let link = clone_net["host_link"]["name"].as_str().unwrap().to_string();
        assert!(links_in(&uplink_ns).contains(&link), "{clone_net}");
        links.push(link);
        // Its policy is its own waiter's to change, at its own .net socket.
        let clone_kept = net_socket(&clone_sock);
        let (status, body) = request(
            &clone_kept,
            "PUT",
            "/vm/net/policy",
            Some(serde_json::json!({ "policy": "none" })),
        );
        assert_eq!(
            (status, body["policy"].as_str()),
            (200, Some("none")),
            "{body}"
        );
        let (status, body) = request(&clone_sock, "PUT", "/vm/shutdown", None);
        assert_eq!(status, 204, "{body}");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while clone_kept.exists() || links_in(&uplink_ns).contains(links.last().unwrap()) {
            assert!(
                std::time::Instant::now() < deadline,
                "a clone's network outlived it"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    for list in [&mut addresses, &mut macs, &mut links] {
        let all = list.len();
        list.sort();
        list.dedup();
        assert_eq!(list.len(), all, "parent and clones share one: {list:?}");
    }
    // The parent's policy is as it was.
    let (status, net) = request(&sock, "GET", "/vm/net", None);
    assert_eq!(
        (status, net["policy"].as_str()),
        (200, Some("allow=198.51.100.0/24"))
    );

    // What the waiter's socket is not for, it says.
    let (status, body) = request(&kept, "PUT", "/vm/pause", None);
    assert_eq!(status, 404, "{body}");
    let (status, body) = request(
        &kept,
        "PUT",
        "/vm/net/policy",
        Some(serde_json::json!({ "policy": "allow=nonsense" })),
    );
    assert_eq!(status, 400, "{body}");

    // A snapshot keeps the policy the waiter set; its restore, jailed, gets a network of its own.
    let snap = snaps.join("s1");
    let (status, body) = request(&sock, "PUT", "/vm/pause", None);
    assert_eq!(status, 204, "{body}");
    let (status, body) = request(
        &sock,
        "PUT",
        "/vm/snapshot",
        Some(serde_json::json!({ "path": snap })),
    );
    assert_eq!(status, 200, "{body}");
    let (status, body) = request(&sock, "PUT", "/vm/shutdown", None);
    assert_eq!(status, 204, "{body}");
    assert!(guest.wait_exit(Duration::from_secs(30)).success());
    assert!(!kept.exists(), "the waiter removes its socket");
    assert!(
        !links_in(&uplink_ns).contains(&host_link),
        "the network went with the VM"
    );

    let rsock = dir.join("r.sock");
    let rargs: Vec<String> = vec![
        "restore".into(),
        snap.to_string_lossy().into_owned(),
        "--console".into(),
        "/dev/null".into(),
        "--api-sock".into(),
        rsock.to_string_lossy().into_owned(),
        "--jail".into(),
        "--jail-dir".into(),
        dir.arg("jails"),
        "--net-uplink".into(),
        uplink_path.clone(),
        "--net-dir".into(),
        net_dir.clone(),
    ];
    let rargs_ref: Vec<&str> = rargs.iter().map(String::as_str).collect();
    let restored = Guest::start(&rargs_ref);
    probe::wait_report(&restored, "verified");
    let (status, rnet) = request(&rsock, "GET", "/vm/net", None);
    assert_eq!(status, 200, "{rnet}");
    assert_eq!(rnet["policy"], "allow=198.51.100.0/24", "{rnet}");
    assert_eq!(
        rnet["guest"]["mac"], net["guest"]["mac"],
        "a restore keeps its MAC"
    );
    let rlink = rnet["host_link"]["name"].as_str().unwrap().to_string();
    assert!(links_in(&uplink_ns).contains(&rlink), "{rnet}");

    // Killed with -9, the waiter takes the VMM and the network along.
    let (rpid, _) = jail_of(&rsock);
    // SAFETY: kill(2) on a pid this test started (the waiter is `restored`).
    unsafe { libc::kill(restored.pid() as i32, libc::SIGKILL) };
    let gone = std::time::Instant::now() + Duration::from_secs(20);
    while std::path::Path::new(&format!("/proc/{rpid}")).exists()
        || links_in(&uplink_ns).contains(&rlink)
    {
        assert!(
            std::time::Instant::now() < gone,
            "the VMM or its network outlived its waiter"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(restored);
}
