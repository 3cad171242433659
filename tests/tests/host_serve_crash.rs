//! `mayfly serve` killed inside each of its crash windows (the hidden `--crash-at POINT`
//! makes it abort right after that step, as `kill -9` there would), then started again on the
//! same state directory, on this machine's KVM with the probe guest. After each: no VMM of
//! the interrupted operation runs on (checked in /proc), no process runs as a uid that is
//! free again, no directory is left that is neither listed nor reusable, no clone of an
//! unfinished fork is listed, and the name can be created again.
//!
//! Windows: a VMM started but not yet in its record (a create's, a wake's); a fork after
//! some of its clones; a create's directory before its record; a delete half-way. And a
//! record lost while the manager was away: its directory is moved aside, its VMM ended.

use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use mayfly_tests::guest::TestDir;
use mayfly_tests::probe;
use mayfly_tests::serve::Manager;
use serde_json::{json, Value};

fn probe_spec(name: &str) -> Value {
    json!({ "name": name, "kernel": probe::ELF, "mem_mib": 64, "cmdline": "touch=1", "probe": true })
}

/// Send a request that makes the manager abort at its `--crash-at` point: no answer comes,
/// and the manager ends of SIGABRT (so the crash happened there, and nowhere else).
fn crash_on(m: &mut Manager, method: &str, path: &str, body: Option<Value>) {
    let mut stream = UnixStream::connect(&m.sock).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Length: {}\r\n\r\n{body}",
        m.admin,
        body.len()
    )
    .unwrap();
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    assert!(
        answer.is_empty(),
        "{method} {path} was answered: {}",
        String::from_utf8_lossy(&answer)
    );
    let status = m.process.wait_exit(Duration::from_secs(60));
    assert_eq!(
        status.signal(),
        Some(libc::SIGABRT),
        "the manager did not abort at its crash point ({status}): {}",
        m.process.stderr()
    );
}

/// A manager on `dir` whose sandboxes' uids start at `uid_base`: each test has its own range
/// (they run at once, and a test asserts that no process runs as a uid it freed), with `crash_at`
/// when given.
fn manager(dir: &TestDir, uid_base: u32, crash_at: Option<&str>) -> Manager {
    manager_with(dir, uid_base, crash_at, &[])
}

/// [`manager`] with more arguments (`extra`).
fn manager_with(dir: &TestDir, uid_base: u32, crash_at: Option<&str>, extra: &[&str]) -> Manager {
    let base = uid_base.to_string();
    let mut args = vec!["--jail-uid-base", &base];
    if let Some(point) = crash_at {
        args.extend(["--crash-at", point]);
    }
    args.extend_from_slice(extra);
    Manager::start_with(dir, &args)
}

/// Let go of a manager that has ended, leaving its sandboxes' VMMs as they are (dropping it
/// would kill the VMMs its records name: the next manager's work).
fn leave(m: Manager) {
    std::mem::forget(m);
}

/// `kill -9` of a manager that runs normally.
fn kill_9(m: &mut Manager) {
    m.process.signal(libc::SIGKILL);
    m.process.wait_exit(Duration::from_secs(10));
}

fn sandbox_dir(m: &Manager, name: &str) -> PathBuf {
    m.state.join("sandboxes").join(name)
}

fn socket_of(m: &Manager, name: &str) -> PathBuf {
    sandbox_dir(m, name).join("sock").join("vm.sock")
}

/// A process's status line `key` (its first field), unless it is a zombie.
fn status_field(pid: &str, key: &str) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    if status
        .lines()
        .any(|l| l.starts_with("State:") && l.contains("Z"))
    {
        return None;
    }
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next().map(str::to_owned))
}

fn pids() -> Vec<String> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.parse::<u32>().is_ok())
        .collect()
}

/// The live processes started for the control socket `sock` (`--api-sock SOCK`).
fn vmms_on(sock: &Path) -> Vec<u32> {
    pids()
        .into_iter()
        .filter(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
            args.windows(2)
                .any(|w| w[0] == b"--api-sock" && w[1] == sock.as_os_str().as_bytes())
                && status_field(pid, "State:").is_some()
        })
        .map(|pid| pid.parse().unwrap())
        .collect()
}

/// The live processes whose real uid is `uid`.
fn running_as(uid: u64) -> Vec<String> {
    pids()
        .into_iter()
        .filter(|pid| status_field(pid, "Uid:").is_some_and(|u| u == uid.to_string()))
        .collect()
}

fn record(m: &Manager, name: &str) -> Option<Value> {
    std::fs::read(sandbox_dir(m, name).join("sandbox.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
}

fn listed(m: &Manager) -> Vec<String> {
    let (status, body) = m.admin("GET", "/sandboxes", None);
    assert_eq!(status, 200, "{body}");
    body["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap().to_string())
        .collect()
}

/// The directories under `sandboxes/`, sorted.
fn directories(m: &Manager) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(m.state.join("sandboxes"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// What every recovery must leave: the journal empty, and each directory a listed sandbox.
fn assert_consistent(m: &Manager) {
    let journal: Vec<_> = std::fs::read_dir(m.state.join("journal"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(journal.is_empty(), "left in the journal: {journal:?}");
    let mut names = listed(m);
    names.sort();
    assert_eq!(directories(m), names, "a directory no sandbox lists");
}

#[test]
fn a_kill_between_a_creates_vmm_start_and_its_record_leaves_no_vmm_and_frees_name_and_uid() {
    let dir = TestDir::new("serve-crash-spawn");
    let mut m = manager(&dir, 1_730_000, Some("after-spawn"));
    crash_on(&mut m, "POST", "/sandboxes", Some(probe_spec("spawned")));
    let sock = socket_of(&m, "spawned");
    // The window was hit: its VMM runs, its record (uid taken, no pid) does not name it.
    assert!(!vmms_on(&sock).is_empty(), "no VMM was started");
    let before = record(&m, "spawned").expect("its record");
    assert!(before["pid"].is_null(), "{before}");
    let uid = before["uid"].as_u64().expect("a jailed sandbox's uid");
    leave(m);

    let m = manager(&dir, 1_730_000, None);
    assert_eq!(
        vmms_on(&sock),
        Vec::<u32>::new(),
        "its VMM was left running"
    );
    assert_eq!(
        running_as(uid),
        Vec::<String>::new(),
        "uid {uid} still runs"
    );
    assert!(!listed(&m).contains(&"spawned".to_string()));
    assert_consistent(&m);
    assert_eq!(m.events("create_undone", "spawned"), 1);
    // The name and its uid are free again, for one sandbox only.
    m.create_probe("spawned", None);
    let again = m.describe("spawned");
    assert_eq!(again["uid"].as_u64(), Some(uid), "{again}");
    assert_eq!(m.admin("DELETE", "/sandboxes/spawned", None).0, 200);
    assert_consistent(&m);
}

#[test]
fn a_kill_between_a_wakes_vmm_start_and_its_record_leaves_no_second_vmm() {
    let dir = TestDir::new("serve-crash-wake");
    let mut m = manager(&dir, 1_731_000, None);
    m.create_probe("sleepy", None);
    let (status, body) = m.admin("PUT", "/sandboxes/sleepy/pause", None);
    assert_eq!(status, 200, "{body}");
    kill_9(&mut m);
    leave(m);

    let mut m = manager(&dir, 1_731_000, Some("after-spawn"));
    crash_on(&mut m, "PUT", "/sandboxes/sleepy/resume", None);
    let sock = socket_of(&m, "sleepy");
    assert!(!vmms_on(&sock).is_empty(), "no VMM was started");
    assert_eq!(record(&m, "sleepy").unwrap()["state"], "suspended");
    leave(m);

    let m = manager(&dir, 1_731_000, None);
    assert_eq!(vmms_on(&sock), Vec::<u32>::new(), "the wake's VMM was left");
    assert_eq!(m.describe("sleepy")["state"], "suspended");
    assert_consistent(&m);
    // It wakes as any sleeping sandbox, and its VMM is the one its record names.
    let (status, body) = m.admin("GET", "/sandboxes/sleepy/vm", None);
    assert_eq!(status, 200, "{body}");
    let pid = m.describe("sleepy")["pid"].as_u64().unwrap();
    let on_socket = vmms_on(&sock);
    assert!(
        on_socket.contains(&u32::try_from(pid).unwrap()),
        "{on_socket:?}"
    );
    for other in on_socket {
        let parent = std::fs::read_to_string(format!("/proc/{other}/stat")).unwrap();
        let ppid: u64 = parent[parent.rfind(')').unwrap() + 1..]
            .split_whitespace()
            .nth(1)
            .unwrap()
            .parse()
            .unwrap();
        assert!(
            u64::from(other) == pid || ppid == pid,
            "VMM {other} is not the sandbox's ({pid})"
        );
    }
    assert_eq!(m.admin("DELETE", "/sandboxes/sleepy", None).0, 200);
    assert_consistent(&m);
}

#[test]
fn a_kill_mid_fork_undoes_every_clone_and_leaves_the_source_as_it_was() {
    let dir = TestDir::new("serve-crash-fork");
    let mut m = manager(&dir, 1_732_000, None);
    m.create_probe("src", None);
    m.wait_probe("src", "waiting", 1);
    kill_9(&mut m);
    leave(m);

    let mut m = manager(&dir, 1_732_000, Some("after-clone:5"));
    let (clones, made) = crash_mid_fork(&mut m, "src");
    let uids: Vec<u64> = made.iter().filter_map(|r| r["uid"].as_u64()).collect();
    leave(m);

    let m = manager(&dir, 1_732_000, None);
    assert_fork_undone(&m, "src", &clones, &uids);
    assert_consistent(&m);
    assert_eq!(m.events("fork_undone", "src"), 1);
    // The source was running: it runs (it slept for the fork's snapshot and woke).
    let (status, body) = m.admin("GET", "/sandboxes/src/vm", None);
    assert_eq!(status, 200, "{body}");
    assert_eq!(m.describe("src")["state"], "running");
    // The clones' names are free again.
    let (status, body) = m.admin("POST", "/sandboxes/src/fork", Some(json!({"count": 2})));
    assert_eq!(status, 201, "{body}");
    let names: Vec<&str> = body["clones"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["src-1", "src-2"], "{body}");
    for name in ["src-1", "src-2", "src"] {
        assert_eq!(
            m.admin("DELETE", &format!("/sandboxes/{name}"), None).0,
            200
        );
    }
    assert_consistent(&m);
}

/// Fork `source` into six through `m`, started with `--crash-at after-clone:5`: the clones are
/// made four at a time, so it is killed once the fifth is made (the first four made, the sixth
/// perhaps part-way). The clones' names, and the records of those made: five at least, each
/// with a running VMM (the window was hit).
fn crash_mid_fork(m: &mut Manager, source: &str) -> (Vec<String>, Vec<Value>) {
    crash_on(
        m,
        "POST",
        &format!("/sandboxes/{source}/fork"),
        Some(json!({"count": 6})),
    );
    let clones: Vec<String> = (1..=6).map(|i| format!("{source}-{i}")).collect();
    let made: Vec<Value> = clones.iter().filter_map(|c| record(m, c)).collect();
    assert!(
        made.iter().filter(|r| r["state"] == "running").count() >= 5,
        "{made:?}"
    );
    (clones, made)
}

/// After the restart that follows [`crash_mid_fork`]: only `source` is listed, and no clone
/// has a VMM or a directory, nor its uid a process.
fn assert_fork_undone(m: &Manager, source: &str, clones: &[String], uids: &[u64]) {
    assert_eq!(
        listed(m),
        [source],
        "a clone of the unfinished fork is listed"
    );
    for clone in clones {
        assert_eq!(vmms_on(&socket_of(m, clone)), Vec::<u32>::new(), "{clone}");
        assert!(!sandbox_dir(m, clone).exists(), "{clone}'s directory");
    }
    for uid in uids {
        assert_eq!(
            running_as(*uid),
            Vec::<String>::new(),
            "uid {uid} still runs"
        );
    }
}

/// The memory cgroup of process `pid`, if it is one of a manager's (under `mayfly-serve`).
fn memory_cgroup(pid: u64) -> Option<PathBuf> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    text.lines().find_map(|line| {
        let mut fields = line.splitn(3, ':');
        let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
        let dir = match controllers {
            // cgroup v1's memory hierarchy, or v2's one.
            c if c.split(',').any(|c| c == "memory") => {
                Path::new("/sys/fs/cgroup/memory").join(path.trim_start_matches('/'))
            }
            "" => Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/')),
            _ => return None,
        };
        path.contains("mayfly-serve").then_some(dir)
    })
}

/// The memory cgroup a manager makes for sandbox `name`, from the one of `sibling`'s VMM
/// (`pid`): beside it, named the same way (the manager's tag, then `-s-NAME`).
fn group_beside(pid: u64, sibling: &str, name: &str) -> Option<PathBuf> {
    let theirs = memory_cgroup(pid)?;
    let file = theirs.file_name()?.to_str()?;
    let tag = file.strip_suffix(&format!("-s-{sibling}"))?;
    Some(theirs.with_file_name(format!("{tag}-s-{name}")))
}

/// The same window for a jailed sandbox with a network: the restart leaves no clone's
/// process, uid, network (its veth on the uplink: the namespace, tap and nftables table live
/// and die with it) or cgroup, and the source keeps its own network and policy.
#[test]
fn a_kill_mid_fork_of_a_networked_sandbox_leaves_no_clone_network_cgroup_or_uid() {
    let dir = TestDir::new("serve-crash-fork-net");
    let net = mayfly_tests::netns::TestNet::new(&dir);
    let net_args = net.args();
    let mut m = manager_with(&dir, 1_733_000, None, &net_args);
    let mut spec = probe_spec("netsrc");
    spec["net"] = json!("allow=192.0.2.1:443");
    let (status, body) = m.admin("POST", "/sandboxes", Some(spec));
    assert_eq!(status, 201, "{body}");
    kill_9(&mut m);
    leave(m);

    let mut m = manager_with(&dir, 1_733_000, Some("after-clone:5"), &net_args);
    let (clones, made) = crash_mid_fork(&mut m, "netsrc");
    let uids: Vec<u64> = made.iter().filter_map(|r| r["uid"].as_u64()).collect();
    // Their VMMs' memory cgroups (the manager's: under mayfly-serve), made before their
    // processes were recorded. (The clones themselves, held until the fork answers, stop as
    // soon as the manager is gone: the fork's helper dies with it.)
    let source_pid = record(&m, "netsrc").unwrap()["pid"].as_u64().unwrap();
    let groups: Vec<PathBuf> = made
        .iter()
        .filter_map(|r| r["name"].as_str())
        .filter_map(|name| group_beside(source_pid, "netsrc", name))
        .collect();
    assert!(
        groups.len() >= 5 && groups.iter().all(|g| g.is_dir()),
        "the clones' cgroups: {groups:?}"
    );
    leave(m);

    let m = manager_with(&dir, 1_733_000, None, &net_args);
    assert_fork_undone(&m, "netsrc", &clones, &uids);
    // A veth goes when the last process holding its namespace does: give the kernel a moment.
    let deadline = Instant::now() + Duration::from_secs(10);
    let src_link = {
        let (status, vm_net) = m.admin("GET", "/sandboxes/netsrc/vm/net", None);
        assert_eq!(status, 200, "{vm_net}");
        assert_eq!(vm_net["policy"], "allow=192.0.2.1/32:443", "{vm_net}");
        vm_net["host_link"]["name"].as_str().unwrap().to_string()
    };
    loop {
        let links = mayfly_tests::netns::links_in(&net.ns);
        let others: Vec<&String> = links
            .iter()
            .filter(|l| l.starts_with("mf") && **l != src_link)
            .collect();
        if others.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the clones' networks are left: {others:?} (the source's is {src_link})"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let left: Vec<&PathBuf> = groups.iter().filter(|g| g.exists()).collect();
    assert!(left.is_empty(), "the clones' cgroups are left: {left:?}");
    assert_consistent(&m);
    assert_eq!(m.events("fork_undone", "netsrc"), 1);
    assert_eq!(m.admin("DELETE", "/sandboxes/netsrc", None).0, 200);
}

#[test]
fn a_kill_between_a_creates_mkdir_and_its_record_leaves_the_name_free() {
    let dir = TestDir::new("serve-crash-mkdir");
    let mut m = manager(&dir, 1_733_000, Some("after-mkdir"));
    crash_on(&mut m, "POST", "/sandboxes", Some(probe_spec("half")));
    // The window was hit: a directory with no record.
    assert!(sandbox_dir(&m, "half").is_dir());
    assert!(record(&m, "half").is_none());
    leave(m);

    let m = manager(&dir, 1_733_000, None);
    assert!(
        !sandbox_dir(&m, "half").exists(),
        "the half-made directory is left"
    );
    assert_consistent(&m);
    m.create_probe("half", None);
    assert_eq!(m.admin("DELETE", "/sandboxes/half", None).0, 200);
    assert_consistent(&m);
}

#[test]
fn a_kill_midway_through_a_delete_is_finished_by_the_next_start() {
    let dir = TestDir::new("serve-crash-delete");
    let mut m = manager(&dir, 1_734_000, None);
    m.create_probe("gone", None);
    m.create_probe("kept", None);
    let uid = m.describe("gone")["uid"].as_u64().unwrap();
    kill_9(&mut m);
    leave(m);

    let mut m = manager(&dir, 1_734_000, Some("mid-delete"));
    crash_on(&mut m, "DELETE", "/sandboxes/gone", None);
    // The window was hit: its directory is there, its record is not.
    assert!(sandbox_dir(&m, "gone").is_dir());
    assert!(record(&m, "gone").is_none());
    leave(m);

    let m = manager(&dir, 1_734_000, None);
    assert!(
        !sandbox_dir(&m, "gone").exists(),
        "the half-deleted directory is left"
    );
    assert_eq!(vmms_on(&socket_of(&m, "gone")), Vec::<u32>::new());
    assert_eq!(
        running_as(uid),
        Vec::<String>::new(),
        "uid {uid} still runs"
    );
    assert_eq!(listed(&m), ["kept"]);
    assert_consistent(&m);
    m.create_probe("gone", None);
    for name in ["gone", "kept"] {
        assert_eq!(
            m.admin("DELETE", &format!("/sandboxes/{name}"), None).0,
            200
        );
    }
    assert_consistent(&m);
}

#[test]
fn a_directory_whose_record_cannot_be_read_is_moved_aside_and_its_vmm_ended() {
    let dir = TestDir::new("serve-crash-unreadable");
    let mut m = manager(&dir, 1_735_000, None);
    m.create_probe("garbled", None);
    let uid = m.describe("garbled")["uid"].as_u64().unwrap();
    let sock = socket_of(&m, "garbled");
    kill_9(&mut m);
    // Its record is lost while the manager is away; its VMM still runs.
    std::fs::write(
        sandbox_dir(&m, "garbled").join("sandbox.json"),
        b"{ not json",
    )
    .unwrap();
    assert!(!vmms_on(&sock).is_empty());
    leave(m);

    let m = manager(&dir, 1_735_000, None);
    assert_eq!(
        vmms_on(&sock),
        Vec::<u32>::new(),
        "its VMM was left running"
    );
    assert_eq!(
        running_as(uid),
        Vec::<String>::new(),
        "uid {uid} still runs"
    );
    assert!(!sandbox_dir(&m, "garbled").exists());
    // Kept whole for a person to look at.
    let aside: Vec<PathBuf> = std::fs::read_dir(m.state.join("quarantine"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert_eq!(aside.len(), 1, "{aside:?}");
    assert!(aside[0].join("sandbox.json").is_file());
    assert_eq!(m.events("quarantined", "garbled"), 1);
    assert_consistent(&m);
    m.create_probe("garbled", None);
    assert_eq!(m.admin("DELETE", "/sandboxes/garbled", None).0, 200);
    assert_consistent(&m);
}

#[test]
fn a_delete_left_in_the_journal_leaves_a_later_sandbox_of_its_name_alone() {
    let dir = TestDir::new("serve-crash-reborn");
    let mut m = manager(&dir, 1_736_000, None);
    m.create_probe("reborn", None);
    let uid = m.describe("reborn")["uid"].as_u64().unwrap();
    let sock = socket_of(&m, "reborn");
    kill_9(&mut m);
    // What a delete of an earlier "reborn" kept (its directory could not be removed; a try
    // again finished it, and the name was created again): one entry as a manager before
    // `created_ms` wrote it, one as now, both older than this sandbox.
    let journal = m.state.join("journal");
    std::fs::create_dir_all(&journal).unwrap();
    std::fs::write(
        journal.join("0000000000000001-00000000-delete.json"),
        br#"{"op":"delete","name":"reborn"}"#,
    )
    .unwrap();
    std::fs::write(
        journal.join("0000000000000002-00000001-delete.json"),
        br#"{"op":"delete","name":"reborn","created_ms":1}"#,
    )
    .unwrap();
    let before = vmms_on(&sock);
    assert!(!before.is_empty());
    leave(m);

    let m = manager(&dir, 1_736_000, None);
    assert_eq!(vmms_on(&sock), before, "the later sandbox's VMM was ended");
    assert_eq!(listed(&m), ["reborn"]);
    assert_eq!(m.describe("reborn")["uid"].as_u64(), Some(uid));
    assert_eq!(m.events("delete_finished", "reborn"), 0);
    assert_eq!(m.events("delete_gone", "reborn"), 2);
    assert_consistent(&m);
    assert_eq!(m.admin("DELETE", "/sandboxes/reborn", None).0, 200);
    assert_consistent(&m);
}

#[test]
fn a_record_that_cannot_be_read_for_now_leaves_its_sandbox_as_it_is() {
    let dir = TestDir::new("serve-crash-eio");
    let mut m = manager(&dir, 1_737_000, None);
    m.create_probe("held", None);
    let sock = socket_of(&m, "held");
    kill_9(&mut m);
    // Its record cannot be read while the manager is away (an I/O error, not a garbled file:
    // here a directory in its place).
    let path = sandbox_dir(&m, "held").join("sandbox.json");
    let saved = std::fs::read(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    std::fs::create_dir(&path).unwrap();
    let before = vmms_on(&sock);
    assert!(!before.is_empty());
    leave(m);

    let mut m = manager(&dir, 1_737_000, None);
    assert_eq!(vmms_on(&sock), before, "its VMM was ended");
    assert!(sandbox_dir(&m, "held").is_dir(), "its directory was moved");
    assert!(!m.state.join("quarantine").exists());
    assert_eq!(m.events("record_unreadable", "held"), 1);
    // Its name stays taken.
    let (status, body) = m.admin("POST", "/sandboxes", Some(probe_spec("held")));
    assert_eq!(status, 409, "{body}");
    kill_9(&mut m);
    // Readable again: the next start adopts it.
    std::fs::remove_dir(&path).unwrap();
    std::fs::write(&path, saved).unwrap();
    leave(m);

    let m = manager(&dir, 1_737_000, None);
    assert_eq!(vmms_on(&sock), before);
    assert_eq!(listed(&m), ["held"]);
    assert_consistent(&m);
    assert_eq!(m.admin("DELETE", "/sandboxes/held", None).0, 200);
    assert_consistent(&m);
}

#[test]
fn a_process_that_only_names_a_sandboxs_socket_is_not_ended() {
    let dir = TestDir::new("serve-crash-decoy");
    let mut m = manager(&dir, 1_738_000, None);
    m.create_probe("real", None);
    let sock = socket_of(&m, "real");
    kill_9(&mut m);
    // Another program whose command line says `--api-sock` with the sandbox's socket.
    let mut decoy = std::process::Command::new("sh")
        .args(["-c", "sleep 600; :", "sh", "--api-sock"])
        .arg(&sock)
        .spawn()
        .unwrap();
    let decoy_pid = decoy.id();
    // `spawn` returns once the child has left the test's memory, which the kernel does before
    // it lays out the new program's arguments: for a moment /proc/PID/cmdline is empty (CI
    // once saw it so). Wait, bounded, for the decoy to show its command line.
    let shown = Instant::now() + Duration::from_secs(10);
    while !vmms_on(&sock).contains(&decoy_pid) {
        assert!(
            Instant::now() < shown,
            "the decoy never showed its command line"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    leave(m);

    let m = manager(&dir, 1_738_000, None);
    let alive = decoy.try_wait().unwrap().is_none();
    let _ = decoy.kill();
    let _ = decoy.wait();
    assert!(alive, "a process not running mayfly was ended");
    assert_eq!(listed(&m), ["real"]);
    assert_eq!(m.admin("DELETE", "/sandboxes/real", None).0, 200);
    assert_consistent(&m);
}
