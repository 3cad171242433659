//! `mayfly serve` (vmm/src/serve/), on this machine's KVM with the probe guest: sandboxes by
//! name, each a VMM process of its own; idle ones sleep to disk (their VMM gone) and wake on
//! the next request with their memory intact; tokens scope every request; `kill -9` of the
//! manager loses nothing; bad requests are refused in words and leave nothing behind.

use std::time::{Duration, Instant};

use mayfly_tests::guest::TestDir;
use mayfly_tests::probe;
use mayfly_tests::serve::{alive, call, Manager};
use serde_json::{json, Value};

#[test]
fn an_idle_sandbox_sleeps_to_disk_and_wakes_on_the_next_request_with_its_memory() {
    // The sandbox sleeps after 1 s idle, and on a loaded host the test's own steps can be
    // further apart than that (this test failed so under load). So nothing here assumes it is
    // still awake between two steps: what needs its VMM asks through the manager (which wakes
    // it), and counts are taken from the manager's own events, not from a timetable.
    let dir = TestDir::new("serve-sleep");
    let m = Manager::start(&dir);

    // Jailed by default, sharing only its own directory, as an unprivileged uid: read off a
    // sandbox that never sleeps, so its VMM cannot go while it is looked at.
    let awake = m.create_probe("awake", None);
    let (status, body) = call(&m.sock, Some(&awake), "GET", "/sandboxes/awake/vm", None);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["name"], "awake");
    assert_eq!(m.describe("awake")["jailed"], true);
    let own_dir = m.state.join("sandboxes/awake/vm");
    assert_eq!(body["jail"]["shared"], json!([own_dir]), "{body}");
    let vmm_pid = body["pid"].as_u64().unwrap();
    let status_file = std::fs::read_to_string(format!("/proc/{vmm_pid}/status")).unwrap();
    assert!(
        status_file.contains("Uid:\t1000000\t1000000\t1000000\t1000000"),
        "{status_file}"
    );

    let (status, created) = m.admin(
        "POST",
        "/sandboxes",
        Some(json!({
            "name": "sleepy",
            "kernel": probe::ELF,
            "mem_mib": 64,
            "cmdline": "touch=1",
            "probe": true,
            "idle_timeout_s": 1,
        })),
    );
    assert_eq!(status, 201, "{created}");
    let token = created["token"].as_str().unwrap().to_string();
    let first_pid = created["pid"]
        .as_u64()
        .expect("a created sandbox has a pid");

    // Idle past its timeout: snapshotted, its VMM gone. Nothing asked for it since its
    // create, so this is its first sleep.
    let asleep = m.wait_state("sleepy", "suspended", Duration::from_secs(30));
    assert_eq!(asleep["pid"], Value::Null);
    assert_eq!(asleep["suspends"], 1);
    let deadline = Instant::now() + Duration::from_secs(10);
    while alive(first_pid) {
        assert!(
            Instant::now() < deadline,
            "the suspended sandbox's VMM still runs"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(m.state.join("sandboxes/sleepy/vm/snap").is_dir());

    // Two requests at once while it sleeps: one wake, both answered.
    let answers: Vec<(u16, Value)> = std::thread::scope(|s| {
        let a = s.spawn(|| call(&m.sock, Some(&token), "GET", "/sandboxes/sleepy/vm", None));
        let b = s.spawn(|| call(&m.sock, Some(&token), "GET", "/sandboxes/sleepy/vm", None));
        vec![a.join().unwrap(), b.join().unwrap()]
    });
    for (status, body) in &answers {
        assert_eq!(*status, 200, "{body}");
        assert!(
            body["origin"].as_str().unwrap().starts_with("restore of"),
            "{body}"
        );
    }
    // (It may be asleep again by now: its wakes are what count.)
    let woken = m.describe("sleepy");
    assert_eq!(woken["wakes"], 1, "two requests woke it twice: {woken}");
    assert_eq!(m.events("woke", "sleepy"), 1);
    // The probe finds every page it wrote before the sleep; each look asks the VM through the
    // manager, which wakes it if it fell asleep again meanwhile.
    let deadline = Instant::now() + probe::TIMEOUT;
    while !m.vmm_log("sleepy").contains("mayfly-probe: verified") {
        assert!(
            !m.vmm_log("sleepy").contains("mayfly-probe: corrupt"),
            "{}",
            m.vmm_log("sleepy")
        );
        assert!(
            Instant::now() < deadline,
            "no verified report: {}",
            m.vmm_log("sleepy")
        );
        let (status, body) = call(&m.sock, Some(&token), "GET", "/sandboxes/sleepy/vm", None);
        assert_eq!(status, 200, "{body}");
        std::thread::sleep(Duration::from_millis(20));
    }

    // pause and resume do the same on demand; delete removes everything.
    let (status, body) = call(
        &m.sock,
        Some(&token),
        "PUT",
        "/sandboxes/sleepy/pause",
        None,
    );
    assert_eq!(
        (status, body["state"].as_str()),
        (200, Some("suspended")),
        "{body}"
    );
    // The first sleep of a booted VM writes all it holds; the second (the idle one or the
    // pause, whichever came first), of a VM woken from that snapshot, only the pages written
    // since: a diff over the first.
    let suspends = m.event_lines("suspended", "sleepy");
    assert!(suspends.len() >= 2, "{suspends:?}");
    assert_eq!(suspends[0]["memory_layers"], 0, "{suspends:?}");
    assert_eq!(suspends[1]["memory_layers"], 1, "{suspends:?}");
    let diff_bytes = suspends[1]["memory_bytes_written"].as_u64().unwrap();
    let full_bytes = suspends[0]["memory_bytes_written"].as_u64().unwrap();
    assert!(
        diff_bytes < 1 << 20 && full_bytes > 8 * diff_bytes,
        "{suspends:?}"
    );
    let (status, body) = call(
        &m.sock,
        Some(&token),
        "PUT",
        "/sandboxes/sleepy/resume",
        None,
    );
    assert_eq!(
        (status, body["state"].as_str()),
        (200, Some("running")),
        "{body}"
    );
    let pid = body["pid"].as_u64().unwrap();
    let (status, body) = call(&m.sock, Some(&token), "DELETE", "/sandboxes/sleepy", None);
    assert_eq!(status, 200, "{body}");
    assert!(!m.state.join("sandboxes/sleepy").exists());
    let deadline = Instant::now() + Duration::from_secs(10);
    while alive(pid) {
        assert!(
            Instant::now() < deadline,
            "a deleted sandbox's VMM still runs"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (status, _) = m.admin("GET", "/sandboxes/sleepy", None);
    assert_eq!(status, 404);

    // The metrics saw all of it: every wake and sleep the events name (at least the two
    // requests' wake and the resume, the idle sleep and the pause), and the two creates.
    let wakes = m.events("woke", "sleepy");
    let sleeps = m.events("suspended", "sleepy");
    assert!(wakes >= 2 && sleeps >= 2, "{wakes} wakes, {sleeps} sleeps");
    let (status, metrics) = call(&m.sock, None, "GET", "/metrics", None);
    assert_eq!(status, 200);
    let metrics = metrics.as_str().unwrap().to_string();
    assert!(
        metrics.contains(&format!("mayfly_wake_seconds_count {wakes}\n")),
        "{metrics}"
    );
    assert!(
        metrics.contains(&format!("mayfly_suspend_seconds_count {sleeps}\n")),
        "{metrics}"
    );
    assert!(
        metrics.contains("mayfly_create_seconds_count 2\n"),
        "{metrics}"
    );
}

#[test]
fn a_token_opens_its_own_sandbox_only_and_stops_when_revoked() {
    let dir = TestDir::new("serve-tokens");
    let m = Manager::start(&dir);
    let a = m.create_probe("a", None);
    let b = m.create_probe("b", None);
    let get = |token: Option<&str>, path: &str| call(&m.sock, token, "GET", path, None).0;
    assert_eq!(get(Some(&a), "/sandboxes/a"), 200);
    assert_eq!(get(Some(&a), "/sandboxes/a/vm"), 200);
    assert_eq!(get(Some(&a), "/sandboxes/b"), 403);
    assert_eq!(get(Some(&a), "/sandboxes/b/vm"), 403);
    assert_eq!(get(Some(&b), "/sandboxes/a/vm"), 403);
    // Manager-wide requests need the admin token; names are not given away.
    assert_eq!(get(Some(&a), "/sandboxes"), 403);
    assert_eq!(get(None, "/sandboxes/a"), 401);
    assert_eq!(get(Some("mfs_guess"), "/sandboxes/a"), 403);
    assert_eq!(get(Some(&a), "/sandboxes/nobody"), 403);
    assert_eq!(get(Some(&m.admin), "/sandboxes/nobody"), 404);
    assert_eq!(get(Some(&m.admin), "/sandboxes/b/vm"), 200);
    // Revoked: a's token stops working, the admin's does not; a new one works.
    assert_eq!(
        call(&m.sock, Some(&a), "DELETE", "/sandboxes/a/token", None).0,
        403
    );
    let (status, _) = m.admin("DELETE", "/sandboxes/a/token", None);
    assert_eq!(status, 200);
    assert_eq!(get(Some(&a), "/sandboxes/a/vm"), 403);
    let (status, body) = m.admin("PUT", "/sandboxes/a/token", None);
    assert_eq!(status, 200, "{body}");
    let fresh = body["token"].as_str().unwrap().to_string();
    assert_eq!(get(Some(&fresh), "/sandboxes/a/vm"), 200);
    assert_eq!(get(Some(&a), "/sandboxes/a/vm"), 403);
    // The routes the manager must see are not passed through.
    let (status, body) = call(
        &m.sock,
        Some(&fresh),
        "PUT",
        "/sandboxes/a/vm/fork",
        Some(json!({"count": 1})),
    );
    assert_eq!(status, 409, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("POST /sandboxes/NAME/fork"),
        "{body}"
    );
    let (status, body) = call(
        &m.sock,
        Some(&fresh),
        "PUT",
        "/sandboxes/a/vm/shutdown",
        None,
    );
    assert_eq!(status, 409, "{body}");
}

#[test]
fn kill_9_of_the_manager_loses_nothing() {
    let dir = TestDir::new("serve-crash");
    let mut m = Manager::start(&dir);
    let awake_token = m.create_probe("awake", None);
    m.create_probe("asleep", None);
    m.create_probe("doomed", None);
    let (status, _) = m.admin("PUT", "/sandboxes/asleep/pause", None);
    assert_eq!(status, 200);
    let awake_pid = m.describe("awake")["pid"].as_u64().unwrap();
    // The VMM itself (a jailed VMM is the child of the process the manager started).
    let awake_vmm = m.admin("GET", "/sandboxes/awake/vm", None).1["pid"].as_u64();
    let doomed_pid = m.describe("doomed")["pid"].as_u64().unwrap();
    m.process.signal(libc::SIGKILL);
    m.process.wait_exit(Duration::from_secs(10));
    // The sandboxes' VMMs outlive their manager; one dies while it is away.
    assert!(alive(awake_pid));
    // SAFETY: kill(2) of a VMM this test made.
    unsafe { libc::kill(libc::pid_t::try_from(doomed_pid).unwrap(), libc::SIGKILL) };
    let deadline = Instant::now() + Duration::from_secs(10);
    while alive(doomed_pid) {
        assert!(Instant::now() < deadline, "the killed VMM lives on");
        std::thread::sleep(Duration::from_millis(10));
    }

    let m = Manager::start(&dir);
    let awake = m.describe("awake");
    assert_eq!(awake["state"], "running", "{awake}");
    assert_eq!(
        awake["pid"].as_u64(),
        Some(awake_pid),
        "not adopted: {awake}"
    );
    let (status, body) = call(
        &m.sock,
        Some(&awake_token),
        "GET",
        "/sandboxes/awake/vm",
        None,
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["pid"].as_u64(), awake_vmm, "another VMM answers");
    assert_eq!(m.describe("asleep")["state"], "suspended");
    let doomed = m.describe("doomed");
    assert_eq!(doomed["state"], "dead", "{doomed}");
    let (status, body) = m.admin("GET", "/sandboxes/doomed/vm", None);
    assert_eq!(status, 409, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("delete it"),
        "{body}"
    );
    // The sleeping one wakes under the new manager.
    let (status, body) = m.admin("GET", "/sandboxes/asleep/vm", None);
    assert_eq!(status, 200, "{body}");
    assert_eq!(m.describe("asleep")["state"], "running");
    for name in ["awake", "asleep", "doomed"] {
        assert_eq!(
            m.admin("DELETE", &format!("/sandboxes/{name}"), None).0,
            200
        );
    }
}

#[test]
fn bad_creates_are_refused_in_words_and_leave_nothing_behind() {
    let dir = TestDir::new("serve-bad");
    let m = Manager::start(&dir);
    let refused = |body: Value, status: u16, says: &str| {
        let (got, answer) = m.admin("POST", "/sandboxes", Some(body.clone()));
        assert_eq!(got, status, "{body} → {answer}");
        let message = answer["error"].as_str().unwrap_or_default();
        assert!(message.contains(says), "{body} → {message}");
    };
    refused(json!({}), 400, "\"name\" is required");
    refused(json!({"name": "Bad_Name"}), 400, "DNS label");
    refused(json!({"name": "-x"}), 400, "DNS label");
    refused(json!({"name": "x".repeat(64)}), 400, "DNS label");
    refused(json!({"name": "a", "kernal": "/x"}), 400, "unknown field");
    refused(
        json!({"name": "a", "kernel": "vmlinux"}),
        400,
        "absolute path",
    );
    refused(
        json!({"name": "a", "kernel": "/nonexistent"}),
        400,
        "--images-dir",
    );
    refused(
        json!({"name": "a", "kernel": dir.join("nonexistent")}),
        400,
        "does not exist",
    );
    refused(json!({"name": "a", "idle_timeout_s": 0}), 400, "at least 1");
    refused(
        json!({"name": "a", "net": "sometimes"}),
        400,
        "is not a policy",
    );
    refused(
        json!({"name": "a", "net": "allow=10.0.0.0/99"}),
        400,
        "is not a policy",
    );
    std::fs::create_dir(dir.join("snap")).unwrap();
    refused(
        json!({"name": "a", "snapshot": dir.join("snap"), "mem_mib": 64}),
        400,
        "alone",
    );
    // A VMM that cannot start: its own words come back, and nothing of it stays.
    let not_a_kernel = dir.join("passwd");
    std::fs::copy("/etc/passwd", &not_a_kernel).unwrap();
    refused(
        json!({"name": "notakernel", "kernel": not_a_kernel}),
        502,
        "neither an x86-64 ELF vmlinux nor a bzImage",
    );
    let (status, body) = call(&m.sock, Some(&m.admin), "POST", "/sandboxes", None);
    assert_eq!(status, 400, "{body}");
    assert!(!m.state.join("sandboxes/notakernel").exists());
    let (_, list) = m.admin("GET", "/sandboxes", None);
    assert_eq!(list["sandboxes"], json!([]));
    // A name taken is refused, and the sandbox that has it is untouched.
    m.create_probe("taken", None);
    refused(json!({"name": "taken"}), 409, "exists");
    assert_eq!(m.describe("taken")["state"], "running");
    let (status, _) = m.admin("PATCH", "/sandboxes/taken", None);
    assert_eq!(status, 405);
    let (status, _) = m.admin("GET", "/elsewhere", None);
    assert_eq!(status, 404);
    assert_eq!(m.admin("DELETE", "/sandboxes/taken", None).0, 200);
}

#[test]
fn two_hundred_parallel_requests_to_fifty_sandboxes_are_all_answered() {
    let dir = TestDir::new("serve-load");
    let m = Manager::start(&dir);
    let names: Vec<String> = (0..50).map(|i| format!("s{i}")).collect();
    let tokens: Vec<String> = names.iter().map(|n| m.create_probe(n, None)).collect();
    // A tenth of them asleep: those requests wake them.
    for name in names.iter().step_by(10) {
        assert_eq!(
            m.admin("PUT", &format!("/sandboxes/{name}/pause"), None).0,
            200
        );
    }
    let answers: Vec<(usize, u16, Value)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..200)
            .map(|i| {
                let (name, token, sock) = (&names[i % 50], &tokens[i % 50], &m.sock);
                s.spawn(move || {
                    let (status, body) = call(
                        sock,
                        Some(token),
                        "GET",
                        &format!("/sandboxes/{name}/vm"),
                        None,
                    );
                    (i, status, body)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, status, body) in &answers {
        assert_eq!(*status, 200, "request {i}: {body}");
        assert_eq!(
            body["name"],
            names[i % 50],
            "request {i} reached the wrong VM"
        );
    }
    for name in names.iter().step_by(10) {
        assert_eq!(m.describe(name)["wakes"], 1, "{name}");
    }
    // Each jailed VMM runs as a uid of its own.
    let uids: std::collections::BTreeSet<u64> = names
        .iter()
        .map(|n| {
            m.describe(n)["uid"]
                .as_u64()
                .expect("a jailed sandbox's uid")
        })
        .collect();
    assert_eq!(uids.len(), names.len(), "{uids:?}");
    for name in &names {
        assert_eq!(
            m.admin("DELETE", &format!("/sandboxes/{name}"), None).0,
            200
        );
    }
    let (_, list) = m.admin("GET", "/sandboxes", None);
    assert_eq!(list["sandboxes"], json!([]));
}

#[test]
fn sandboxes_from_one_template_share_one_build_and_a_changed_input_builds_another() {
    let dir = TestDir::new("serve-template");
    let m = Manager::start(&dir);
    let template = |mem_mib: u64| json!({ "kernel": probe::ELF, "mem_mib": mem_mib, "cmdline": "touch=1", "probe": true });
    let built = |m: &Manager| {
        let text = std::fs::read_to_string(m.state.join("events.jsonl")).unwrap();
        text.lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|e| e["event"] == "template_built")
            .map(|e| e["template"].as_str().unwrap().to_string())
            .collect::<Vec<_>>()
    };
    // Two creates at once from a new template: one build, two restores of it.
    std::thread::scope(|s| {
        for name in ["t1", "t2"] {
            let m = &m;
            s.spawn(move || m.create(json!({ "name": name, "template": template(64) })));
        }
    });
    assert_eq!(built(&m).len(), 1, "{:?}", built(&m));
    let key = &built(&m)[0];
    for name in ["t1", "t2"] {
        let (status, vm) = m.admin("GET", &format!("/sandboxes/{name}/vm"), None);
        assert_eq!(status, 200, "{vm}");
        // Restored from the one build, linked into the sandbox's own `vm/base` (so the template
        // can go while the sandbox lives): the same inode, not a copy.
        assert!(
            vm["origin"]
                .as_str()
                .unwrap()
                .ends_with(&format!("sandboxes/{name}/vm/base")),
            "{vm}"
        );
        let inode = |p: std::path::PathBuf| {
            use std::os::unix::fs::MetadataExt;
            std::fs::metadata(&p)
                .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
                .ino()
        };
        assert_eq!(
            inode(m.state.join(format!("sandboxes/{name}/vm/base/state"))),
            inode(m.state.join(format!("templates/{key}/vm/snap/state"))),
        );
        assert_eq!(vm["name"], name);
    }
    // The same again: the cache; another input: another template.
    m.create(json!({ "name": "t3", "template": template(64) }));
    assert_eq!(built(&m).len(), 1);
    m.create(json!({ "name": "t4", "template": template(96) }));
    let keys = built(&m);
    assert_eq!(keys.len(), 2, "{keys:?}");
    assert_ne!(keys[0], keys[1]);
    assert_eq!(m.admin("GET", "/sandboxes/t4/vm", None).1["mem_mib"], 96);
    // A template is the whole machine: nothing beside it but the idle timeout.
    let (status, body) = m.admin(
        "POST",
        "/sandboxes",
        Some(json!({ "name": "t5", "template": template(64), "mem_mib": 64 })),
    );
    assert_eq!(status, 400, "{body}");
    let (status, body) = m.admin(
        "POST",
        "/sandboxes",
        Some(json!({ "name": "t5", "template": { "kernal": "/x" } })),
    );
    assert_eq!(status, 400, "{body}");
    for name in ["t1", "t2", "t3", "t4"] {
        assert_eq!(
            m.admin("DELETE", &format!("/sandboxes/{name}"), None).0,
            200
        );
    }
}

#[test]
fn a_vmm_that_dies_after_a_wake_is_reported_not_rolled_back_behind_the_users_back() {
    let dir = TestDir::new("serve-death");
    let m = Manager::start(&dir);
    let token = m.create_probe("fragile", None);
    assert_eq!(m.admin("PUT", "/sandboxes/fragile/pause", None).0, 200);
    assert_eq!(m.admin("PUT", "/sandboxes/fragile/resume", None).0, 200);
    // Its VMM dies after the wake: what ran since the snapshot is gone.
    let pid = m.describe("fragile")["pid"].as_u64().unwrap();
    // SAFETY: kill(2) of a VMM this test's manager started.
    unsafe { libc::kill(libc::pid_t::try_from(pid).unwrap(), libc::SIGKILL) };
    // The manager notices (its watch looks every 250 ms; a request would too).
    m.wait_state("fragile", "dead", Duration::from_secs(10));
    let (status, body) = call(&m.sock, Some(&token), "GET", "/sandboxes/fragile/vm", None);
    assert_eq!(
        status, 409,
        "a request woke the old snapshot silently: {body}"
    );
    let error = body["error"].as_str().unwrap();
    assert!(
        error.contains("is dead") && error.contains("resume goes back"),
        "{error}"
    );
    assert_eq!(m.describe("fragile")["state"], "dead");
    // Going back to the snapshot is the user's call.
    let (status, body) = call(
        &m.sock,
        Some(&token),
        "PUT",
        "/sandboxes/fragile/resume",
        None,
    );
    assert_eq!(
        (status, body["state"].as_str()),
        (200, Some("running")),
        "{body}"
    );
    assert_eq!(m.events("back_to_snapshot", "fragile"), 1);
    // A sandbox's own token may not write snapshots where it likes.
    let (status, body) = call(
        &m.sock,
        Some(&token),
        "PUT",
        "/sandboxes/fragile/vm/snapshot",
        Some(json!({ "path": "/tmp/elsewhere" })),
    );
    assert_eq!(status, 403, "{body}");
}

#[test]
fn a_link_planted_in_a_sleeping_sandboxs_snapshot_is_never_followed() {
    let dir = TestDir::new("serve-link");
    let m = Manager::start(&dir);
    m.create_probe("victim", None);
    m.create_probe("attacker", None);
    for name in ["victim", "attacker"] {
        assert_eq!(
            m.admin("PUT", &format!("/sandboxes/{name}/pause"), None).0,
            200
        );
    }
    // What a compromised jailed VMM could leave in its own vm/ directory: its snapshot
    // swapped for a link to another sandbox's.
    let own = m.state.join("sandboxes/attacker/vm/snap");
    std::fs::remove_dir_all(&own).unwrap();
    std::os::unix::fs::symlink(m.state.join("sandboxes/victim/vm/snap"), &own).unwrap();
    let (status, body) = m.admin("PUT", "/sandboxes/attacker/resume", None);
    assert_eq!(status, 502, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("not a plain file or directory"),
        "{body}"
    );
    assert_eq!(m.describe("attacker")["state"], "suspended");
    // The record, logs and sockets are root's, outside what the jail shares.
    use std::os::unix::fs::MetadataExt;
    let sandbox_dir = std::fs::metadata(m.state.join("sandboxes/victim")).unwrap();
    assert_eq!((sandbox_dir.uid(), sandbox_dir.mode() & 0o777), (0, 0o700));
    assert_eq!(m.admin("PUT", "/sandboxes/victim/resume", None).0, 200);
}

#[test]
fn a_fork_makes_sandboxes_of_their_own_from_one_snapshot_running_or_asleep() {
    let dir = TestDir::new("serve-fork");
    let m = Manager::start(&dir);
    // A disk, so that the clones' layers stack on the fork's and must survive their sleeps.
    let image = dir.join("base.img");
    std::fs::write(&image, vec![7u8; 4 << 20]).unwrap();
    let (status, body) = m.admin(
        "POST",
        "/sandboxes",
        Some(json!({
            "name": "src", "kernel": probe::ELF, "mem_mib": 64, "cmdline": "touch=1",
            "probe": true, "rootfs": image,
        })),
    );
    assert_eq!(status, 201, "{body}");
    let src_token = body["token"].as_str().unwrap().to_string();

    // Refused in words, nothing made.
    for (request, want) in [
        (json!({}), 400),
        (json!({"count": 0}), 400),
        (json!({"count": 129}), 400),
        (json!({"names": ["x", "x"]}), 400),
        (json!({"names": ["Not_A_Label"]}), 400),
        (json!({"names": ["src"]}), 409),
        (json!({"count": 2, "names": ["x"]}), 400),
        (json!({"count": 1, "colour": "red"}), 400),
    ] {
        let (status, body) = m.admin("POST", "/sandboxes/src/fork", Some(request.clone()));
        assert_eq!(status, want, "{request}: {body}");
        assert!(body["error"].is_string(), "{body}");
    }
    let (status, _) = call(
        &m.sock,
        Some(&src_token),
        "POST",
        "/sandboxes/src/fork",
        Some(json!({"count": 1})),
    );
    assert_eq!(status, 403, "a sandbox's own token makes no sandboxes");
    // Nor does it (nor the admin) reach the VMM's own fork routes through the manager: a
    // capture is the manager's to ask for, only while it forks.
    for (token, path) in [
        (Some(src_token.as_str()), "/sandboxes/src/vm/fork/capture"),
        (Some(src_token.as_str()), "/sandboxes/src/vm/fork/release"),
        (Some(m.admin.as_str()), "/sandboxes/src/vm/fork/capture"),
        (Some(src_token.as_str()), "/sandboxes/src/vm/fork"),
    ] {
        let (status, body) = call(&m.sock, token, "PUT", path, Some(json!({"count": 1})));
        assert_eq!(status, 409, "{path}: {body}");
    }
    assert_eq!(
        m.admin("GET", "/sandboxes", None).1["sandboxes"]
            .as_array()
            .unwrap()
            .len(),
        1
    );

    m.wait_probe("src", "waiting", 1);
    // From the running source (once its probe has written its pages): two clones, named after it, each its own VMM, uid and token.
    let (status, body) = m.admin("POST", "/sandboxes/src/fork", Some(json!({"count": 2})));
    assert_eq!(status, 201, "{body}");
    let clones = body["clones"].as_array().unwrap();
    let names: Vec<&str> = clones.iter().map(|c| c["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["src-1", "src-2"], "{body}");
    let mut uids: Vec<u64> = clones.iter().map(|c| c["uid"].as_u64().unwrap()).collect();
    uids.push(m.describe("src")["uid"].as_u64().unwrap());
    uids.sort_unstable();
    uids.dedup();
    assert_eq!(uids.len(), 3, "every sandbox has a uid of its own: {body}");
    for clone in clones {
        assert_eq!(clone["state"], "running", "{clone}");
        assert!(
            clone["token"].as_str().unwrap().starts_with("mfs_"),
            "{clone}"
        );
    }
    let tokens: Vec<String> = clones
        .iter()
        .map(|c| c["token"].as_str().unwrap().to_string())
        .collect();
    // Each clone's probe finds every page the source wrote; the source carries on.
    m.wait_probe("src-1", "verified", 1);
    m.wait_probe("src-2", "verified", 1);
    let (status, vm) = call(
        &m.sock,
        Some(&tokens[0]),
        "GET",
        "/sandboxes/src-1/vm",
        None,
    );
    assert_eq!(status, 200, "{vm}");
    assert_eq!(vm["name"], "src-1");
    assert_eq!(vm["state"], "running", "{vm}");
    assert_eq!(
        m.admin("GET", "/sandboxes/src/vm", None).1["state"],
        "running"
    );
    // A clone's token is its own only.
    assert_eq!(
        call(&m.sock, Some(&tokens[0]), "GET", "/sandboxes/src", None).0,
        403
    );
    assert_eq!(
        call(&m.sock, Some(&tokens[0]), "GET", "/sandboxes/src-2", None).0,
        403
    );
    // The fork base is gone: the clones hold links to what they need.
    let forks = m.state.join("forks");
    assert_eq!(std::fs::read_dir(&forks).unwrap().count(), 0);

    // The source goes; a clone still sleeps and wakes with its pages and its disk.
    let (status, body) = m.admin("DELETE", "/sandboxes/src", None);
    assert_eq!(status, 200, "{body}");
    m.put_to("src-1", "pause", "suspended");
    m.put_to("src-1", "resume", "running");
    m.wait_probe("src-1", "verified", 2);

    // From a sleeping sandbox: it is not woken.
    let (status, body) = m.admin("PUT", "/sandboxes/src-2/pause", None);
    assert_eq!(status, 200, "{body}");
    let (status, body) = m.admin(
        "POST",
        "/sandboxes/src-2/fork",
        Some(json!({"names": ["kid"], "idle_timeout_s": 1})),
    );
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["clones"][0]["name"], "kid", "{body}");
    assert_eq!(m.describe("src-2")["state"], "suspended");
    assert_eq!(m.describe("src-2")["wakes"], 0);
    // The source's own files stay its own (the seal copied what it shares with the base, and
    // left the base's files root's), so after the fork it wakes, sleeps and wakes again, its
    // disk layers and all.
    fn owners(path: &std::path::Path, out: &mut Vec<(std::path::PathBuf, u32)>) {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::symlink_metadata(path).unwrap();
        out.push((path.to_path_buf(), meta.uid()));
        if meta.is_dir() {
            for entry in std::fs::read_dir(path).unwrap() {
                owners(&entry.unwrap().path(), out);
            }
        }
    }
    let uid = m.describe("src-2")["uid"].as_u64().unwrap();
    let mut files = Vec::new();
    owners(&m.state.join("sandboxes/src-2/vm/snap"), &mut files);
    for (path, owner) in &files {
        assert_eq!(
            u64::from(*owner),
            uid,
            "{} was taken from the source",
            path.display()
        );
    }
    let mut files = Vec::new();
    owners(&m.state.join("sandboxes/kid/vm/base"), &mut files);
    for (path, owner) in &files {
        assert_eq!(
            *owner,
            0,
            "{} of the clone's base is not root's",
            path.display()
        );
    }
    for _ in 0..2 {
        m.put_to("src-2", "resume", "running");
        m.put_to("src-2", "pause", "suspended");
    }
    m.put_to("src-2", "resume", "running");
    m.wait_probe("kid", "verified", 1);
    // The clone takes the idle timeout it was given, and wakes again.
    m.wait_state("kid", "suspended", Duration::from_secs(30));
    let (status, _) = m.admin("GET", "/sandboxes/kid/vm", None);
    assert_eq!(status, 200);
    m.wait_probe("kid", "verified", 2);
    assert_eq!(m.events("forked", "src"), 1);
    assert_eq!(m.events("forked", "src-2"), 1);
}

/// A running sandbox made from a template forks without a copy of the template's memory: its
/// VMM hands over the template's memory file as it is (root's, nobody else may write it: the
/// manager checks) and a sealed memfd of only the pages it changed, and each jailed clone
/// finds every page. A clone forks the same way, sleeps and wakes with its pages, and outlives
/// its source.
#[test]
fn a_fork_of_a_sandbox_made_from_a_template_copies_only_the_pages_it_changed() {
    let dir = TestDir::new("serve-fork-template");
    let m = Manager::start(&dir);
    let template =
        json!({ "kernel": probe::ELF, "mem_mib": 64, "cmdline": "touch=1", "probe": true });
    m.create(json!({ "name": "src", "template": template }));
    m.wait_probe("src", "verified", 1);
    // The probe wrote every page of its 64 MiB when the template was built: a copy of its
    // memory would be all of that.
    let fork = |source: &str, request: Value| -> Value {
        let (status, body) = m.admin("POST", &format!("/sandboxes/{source}/fork"), Some(request));
        assert_eq!(status, 201, "{body}");
        let copied = body["copied_bytes"].as_u64().expect("copied_bytes");
        assert!(copied < 4 << 20, "the fork copied {copied} bytes: {body}");
        body
    };
    let body = fork("src", json!({ "count": 2 }));
    let uids: std::collections::HashSet<u64> = body["clones"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["uid"].as_u64().unwrap())
        .collect();
    assert_eq!(uids.len(), 2, "{body}");
    m.wait_probe("src-1", "verified", 1);
    m.wait_probe("src-2", "verified", 1);
    // A clone's own fork: the same template file at the bottom, its own pages above.
    fork("src-1", json!({ "names": ["grand"] }));
    m.wait_probe("grand", "verified", 1);
    // The source goes; a clone sleeps (a full snapshot: it cannot name a fork's memory in a
    // diff) and wakes with every page.
    let (status, body) = m.admin("DELETE", "/sandboxes/src", None);
    assert_eq!(status, 200, "{body}");
    m.put_to("src-1", "pause", "suspended");
    m.put_to("src-1", "resume", "running");
    m.wait_probe("src-1", "verified", 2);
    m.wait_probe("grand", "verified", 1);
    assert_eq!(m.describe("src-2")["state"], "running");
}

/// Every operation of the OpenAPI document the manager serves (`GET /openapi.json`), sent to a
/// running manager with a probe sandbox: the answer's status is one the document gives for it
/// (so no route it lists is missing, and no answer is undocumented), every other method on a
/// documented path is a 405, and a path it does not list is a 404.
#[test]
fn every_route_in_the_openapi_document_answers_as_documented() {
    let dir = TestDir::new("serve-openapi");
    let m = Manager::start(&dir);
    let (status, doc) = call(&m.sock, None, "GET", "/openapi.json", None);
    assert_eq!(status, 200, "{doc}");
    assert_eq!(doc["openapi"], "3.1.0");
    m.create_probe("api", None);
    let mut ops: Vec<(String, String, Value)> = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            if method != "parameters" {
                ops.push((method.to_uppercase(), path.clone(), op.clone()));
            }
        }
    }
    // Deletes last (the sandbox's token, then the sandbox), so every other route meets a
    // sandbox that is there.
    let rank = |(method, path, _): &(String, String, Value)| match (method.as_str(), path.as_str())
    {
        ("DELETE", "/sandboxes/{name}") => 2,
        ("DELETE", "/sandboxes/{name}/token") => 1,
        _ => 0,
    };
    ops.sort_by_key(rank);
    assert!(ops.len() >= 28, "{} operations", ops.len());
    let methods = ["GET", "PUT", "POST", "DELETE"];
    let check = |(method, path, op): &(String, String, Value)| {
        let mut concrete = path.replace("{name}", "api");
        if concrete.contains("/vm/files") {
            concrete.push_str("?path=/tmp/openapi-check");
        }
        let (status, body) = m.admin(method, &concrete, None);
        let documented: Vec<&String> = op["responses"].as_object().unwrap().keys().collect();
        assert!(
            documented.iter().any(|c| **c == status.to_string()),
            "{method} {concrete} answered {status} ({body}); openapi.json documents {documented:?}"
        );
        assert!(
            !body.to_string().contains("no such route"),
            "{method} {concrete}: {body}"
        );
    };
    // The guest agent's routes wait for an agent the probe does not have (10 s each): at
    // once, side by side; the rest in order.
    let (agent, others): (Vec<_>, Vec<_>) = ops.iter().partition(|(_, path, _)| {
        ["/vm/exec", "/vm/files", "/vm/agent"]
            .iter()
            .any(|p| path.contains(p))
    });
    std::thread::scope(|s| {
        for op in &agent {
            s.spawn(|| check(op));
        }
    });
    others.iter().for_each(|op| check(op));
    // Methods a documented path does not serve.
    m.create_probe("api", None);
    for (path, item) in doc["paths"].as_object().unwrap() {
        let concrete = path.replace("{name}", "api");
        for method in methods {
            if item.get(method.to_lowercase()).is_none() {
                let (status, body) = m.admin(method, &concrete, None);
                assert_eq!(status, 405, "{method} {concrete}: {body}");
            }
        }
    }
    let (status, body) = m.admin("GET", "/sandboxes/api/nothing-here", None);
    assert_eq!(status, 404, "{body}");
    let (status, body) = m.admin("GET", "/elsewhere", None);
    assert_eq!(status, 404, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("/openapi.json"),
        "{body}"
    );
}

/// `--mem-budget-mib`: creates, wakes and fork clones past the guest memory of the sandboxes
/// whose VMMs run are refused (429, saying what is held and what to do), leave nothing
/// behind, and go through once a sandbox sleeps; a manager started again counts the VMMs it
/// adopts.
#[test]
fn the_memory_budget_refuses_what_would_exceed_it_and_says_why() {
    let dir = TestDir::new("serve-budget");
    // Probes of 64 MiB, each VMM allowed 16 MiB more (and counted so): two fit in 200 MiB,
    // three do not.
    let budget = ["--mem-budget-mib", "200", "--vmm-allowance-mib", "16"];
    let mut m = Manager::start_with(&dir, &budget);
    m.create_probe("a", None);
    m.create_probe("b", None);
    let spec = |name: &str| json!({ "name": name, "kernel": probe::ELF, "mem_mib": 64, "cmdline": "touch=1", "probe": true });
    let refused = |(status, body): (u16, Value), what: &str| {
        assert_eq!(status, 429, "{what}: {body}");
        let error = body["error"].as_str().unwrap();
        assert!(
            error.contains("memory budget")
                && error.contains("needs 80 MiB")
                && error.contains("hold 160 MiB of the 200 MiB")
                && error.contains("PUT /sandboxes/NAME/pause"),
            "{what}: {error}"
        );
    };
    refused(
        m.admin("POST", "/sandboxes", Some(spec("c"))),
        "a third create",
    );
    assert_eq!(m.admin("GET", "/sandboxes/c", None).0, 404);
    assert!(!m.state.join("sandboxes/c").exists());
    refused(
        m.admin("POST", "/sandboxes/b/fork", Some(json!({ "count": 1 }))),
        "a fork",
    );
    assert_eq!(m.admin("GET", "/sandboxes/b-1", None).0, 404);
    assert!(!m.state.join("sandboxes/b-1").exists());
    // A sleeping sandbox holds none: then the third fits, and the first cannot wake.
    let (status, body) = m.admin("PUT", "/sandboxes/a/pause", None);
    assert_eq!(status, 200, "{body}");
    m.create_probe("c", None);
    refused(m.admin("PUT", "/sandboxes/a/resume", None), "a wake");
    refused(m.admin("GET", "/sandboxes/a/vm", None), "a wake on request");
    assert_eq!(m.describe("a")["state"], "suspended");
    // A new manager on the same state counts the VMMs it adopted.
    m.process.signal(libc::SIGKILL);
    m.process.wait_exit(Duration::from_secs(10));
    let m = Manager::start_with(&dir, &budget);
    refused(
        m.admin("PUT", "/sandboxes/a/resume", None),
        "a wake after a restart",
    );
    let (status, _) = m.admin("DELETE", "/sandboxes/c", None);
    assert_eq!(status, 200);
    let (status, body) = m.admin("PUT", "/sandboxes/a/resume", None);
    assert_eq!((status, &body["state"]), (200, &json!("running")), "{body}");
    let (_, metrics) = call(&m.sock, None, "GET", "/metrics", None);
    assert!(
        metrics
            .as_str()
            .unwrap()
            .contains("mayfly_over_budget_total 1"),
        "{metrics}"
    );
    for name in ["a", "b"] {
        assert_eq!(
            m.admin("DELETE", &format!("/sandboxes/{name}"), None).0,
            200
        );
    }
}

/// How many life-cycle events of `kind` the manager logged (for any sandbox).
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
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `--expire-after`: a sandbox asleep that long is deleted, snapshot and all, while one that
/// runs is kept; `--template-ttl`: a template no create has used that long is collected, the
/// sandbox made from it still sleeps and wakes, and the next create builds it again.
#[test]
fn sleeping_sandboxes_expire_and_unused_templates_are_collected() {
    let dir = TestDir::new("serve-expire");
    let m = Manager::start_with(&dir, &["--expire-after", "2s", "--template-ttl", "2s"]);
    m.create_probe("sleeper", None);
    m.create_probe("awake", None);
    let (status, body) = m.admin("PUT", "/sandboxes/sleeper/pause", None);
    assert_eq!(status, 200, "{body}");
    wait_until(
        "the sleeping sandbox never expired",
        Duration::from_secs(30),
        || m.admin("GET", "/sandboxes/sleeper", None).0 == 404,
    );
    assert!(!m.state.join("sandboxes/sleeper").exists());
    let expired = events_of(&m, "expired");
    assert_eq!(expired.len(), 1, "{expired:?}");
    assert_eq!(expired[0]["sandbox"], "sleeper");
    assert!(
        expired[0]["asleep_ms"].as_u64().unwrap() >= 2000,
        "{expired:?}"
    );
    assert_eq!(m.describe("awake")["state"], "running");

    let template =
        json!({ "kernel": probe::ELF, "mem_mib": 64, "cmdline": "touch=1", "probe": true });
    m.create(json!({ "name": "made", "template": template }));
    let templates = m.state.join("templates");
    let count = || {
        std::fs::read_dir(&templates)
            .map(|d| d.count())
            .unwrap_or(0)
    };
    assert_eq!(count(), 1);
    wait_until(
        "the unused template was never collected",
        Duration::from_secs(30),
        || count() == 0,
    );
    assert_eq!(events_of(&m, "template_collected").len(), 1);
    // Its sandbox does not need it: it sleeps and wakes with its memory (the probe checks
    // every page it wrote after each restore: the template's, then the wake).
    m.wait_probe("made", "verified", 1);
    let (status, body) = m.admin("PUT", "/sandboxes/made/pause", None);
    assert_eq!(status, 200, "{body}");
    let (status, body) = m.admin("PUT", "/sandboxes/made/resume", None);
    assert_eq!((status, &body["state"]), (200, &json!("running")), "{body}");
    m.wait_probe("made", "verified", 2);
    m.create(json!({ "name": "again", "template": template }));
    assert_eq!(events_of(&m, "template_built").len(), 2);
    let (_, metrics) = call(&m.sock, None, "GET", "/metrics", None);
    assert!(
        metrics.as_str().unwrap().contains("mayfly_expired_total 1"),
        "{metrics}"
    );
    for name in ["awake", "made", "again"] {
        assert_eq!(
            m.admin("DELETE", &format!("/sandboxes/{name}"), None).0,
            200
        );
    }
}

/// `--disk-budget-mib`: a suspend whose snapshot could take the sandboxes past it is refused
/// (429, saying what is kept and what to do) and the sandbox stays awake; once a sleeping
/// sandbox is deleted, the suspend goes through.
#[test]
fn the_disk_budget_refuses_a_suspend_that_could_exceed_it() {
    let dir = TestDir::new("serve-disk-budget");
    // Probes of 64 MiB that write every page: one snapshot fits in 100 MiB, two do not.
    let m = Manager::start_with(&dir, &["--disk-budget-mib", "100"]);
    m.create_probe("a", None);
    m.create_probe("b", None);
    m.wait_probe("a", "waiting", 1);
    m.wait_probe("b", "waiting", 1);
    let (status, body) = m.admin("PUT", "/sandboxes/a/pause", None);
    assert_eq!(status, 200, "{body}");
    let (status, body) = m.admin("PUT", "/sandboxes/b/pause", None);
    assert_eq!(status, 429, "{body}");
    let error = body["error"].as_str().unwrap();
    assert!(
        error.contains("disk budget")
            && error.contains("of the 100 MiB budget")
            && error.contains("delete a sleeping sandbox"),
        "{error}"
    );
    assert_eq!(m.describe("b")["state"], "running");
    assert_eq!(events_of(&m, "suspend_refused").len(), 1);
    assert_eq!(m.admin("DELETE", "/sandboxes/a", None).0, 200);
    let (status, body) = m.admin("PUT", "/sandboxes/b/pause", None);
    assert_eq!(
        (status, &body["state"]),
        (200, &json!("suspended")),
        "{body}"
    );
    assert_eq!(m.admin("DELETE", "/sandboxes/b", None).0, 200);
}

/// `--when-over-budget suspend-idle`: a create or wake past the memory budget puts the
/// longest-idle running sandbox to sleep on disk first, instead of being refused.
#[test]
fn past_the_memory_budget_the_longest_idle_sandbox_sleeps_to_make_room() {
    let dir = TestDir::new("serve-make-room");
    // Probes of 64 MiB, each VMM allowed 16 MiB more: two fit in 170 MiB (a restored one
    // counts its memory file, a little more than its 64 MiB), three do not.
    let m = Manager::start_with(
        &dir,
        &[
            "--mem-budget-mib",
            "170",
            "--vmm-allowance-mib",
            "16",
            "--when-over-budget",
            "suspend-idle",
        ],
    );
    m.create_probe("a", None);
    m.create_probe("b", None);
    m.wait_probe("a", "waiting", 1);
    m.wait_probe("b", "waiting", 1);
    // b used last: a is the longest idle.
    assert_eq!(m.admin("GET", "/sandboxes/b/vm", None).0, 200);
    m.create_probe("c", None);
    let states =
        |m: &Manager| ["a", "b", "c"].map(|n| m.describe(n)["state"].as_str().unwrap().to_string());
    assert_eq!(states(&m), ["suspended", "running", "running"]);
    // A request for a wakes it, and b (now idle longest) sleeps for it.
    assert_eq!(m.admin("GET", "/sandboxes/a/vm", None).0, 200);
    assert_eq!(states(&m), ["running", "suspended", "running"]);
    m.wait_probe("a", "verified", 1);
    let made_room: Vec<(String, String)> = events_of(&m, "making_room")
        .iter()
        .map(|e| {
            (
                e["sandbox"].as_str().unwrap().into(),
                e["for"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert_eq!(
        made_room,
        [("a".to_string(), "c".to_string()), ("b".into(), "a".into())]
    );
    let (_, metrics) = call(&m.sock, None, "GET", "/metrics", None);
    let metrics = metrics.as_str().unwrap().to_string();
    assert!(metrics.contains("mayfly_made_room_total 2"), "{metrics}");
    assert!(metrics.contains("mayfly_over_budget_total 0"), "{metrics}");
    for name in ["a", "b", "c"] {
        assert_eq!(
            m.admin("DELETE", &format!("/sandboxes/{name}"), None).0,
            200
        );
    }
}

/// A VM its user paused (`PUT .../vm/pause`) is paused again when its sandbox wakes from
/// disk, and after a fork of it (whose snapshot puts it to sleep and wakes it); the fork's
/// clones run.
#[test]
fn a_vm_its_user_paused_stays_paused_across_sleep_and_fork() {
    let dir = TestDir::new("serve-user-paused");
    let m = Manager::start(&dir);
    m.create_probe("p", None);
    m.wait_probe("p", "waiting", 1);
    let vm_state = |name: &str| {
        let (status, body) = m.admin("GET", &format!("/sandboxes/{name}/vm"), None);
        assert_eq!(status, 200, "{body}");
        body["state"].as_str().unwrap().to_string()
    };
    assert_eq!(m.admin("PUT", "/sandboxes/p/vm/pause", None).0, 204);
    assert_eq!(vm_state("p"), "paused");
    let (status, body) = m.admin("PUT", "/sandboxes/p/pause", None);
    assert_eq!(status, 200, "{body}");
    let (status, body) = m.admin("PUT", "/sandboxes/p/resume", None);
    assert_eq!((status, &body["state"]), (200, &json!("running")), "{body}");
    assert_eq!(
        vm_state("p"),
        "paused",
        "the wake set the user's paused VM running"
    );
    let (status, body) = m.admin("POST", "/sandboxes/p/fork", Some(json!({ "count": 1 })));
    assert_eq!(status, 201, "{body}");
    assert_eq!(
        vm_state("p"),
        "paused",
        "the fork set the user's paused VM running"
    );
    assert_eq!(vm_state("p-1"), "running");
    m.wait_probe("p-1", "verified", 1);
    assert_eq!(m.admin("PUT", "/sandboxes/p/vm/resume", None).0, 204);
    assert_eq!(vm_state("p"), "running");
    for name in ["p", "p-1"] {
        assert_eq!(
            m.admin("DELETE", &format!("/sandboxes/{name}"), None).0,
            200
        );
    }
}

#[test]
fn a_jailed_sandbox_has_a_network_whose_policy_the_admin_changes_and_sleep_keeps() {
    let dir = TestDir::new("serve-net");
    let net = mayfly_tests::netns::TestNet::new(&dir);
    let uplink_ns = &net.ns;
    let mut args = net.args();
    args.extend(["--net-pool", "2"]);
    let mut m = Manager::start_with(&dir, &args);
    let token = m.create(json!({
        "name": "netted",
        "kernel": probe::ELF,
        "mem_mib": 64,
        "cmdline": "touch=1",
        "probe": true,
        "net": "allow=192.0.2.0/24:443",
    }));
    assert_eq!(m.describe("netted")["jailed"], true);
    let (status, net) = call(
        &m.sock,
        Some(&token),
        "GET",
        "/sandboxes/netted/vm/net",
        None,
    );
    assert_eq!(status, 200, "{net}");
    assert_eq!(net["policy"], "allow=192.0.2.0/24:443", "{net}");
    let link = net["host_link"]["name"].as_str().unwrap().to_string();
    assert!(mayfly_tests::netns::links_in(uplink_ns).contains(&link));
    let (status, vm) = call(&m.sock, Some(&token), "GET", "/sandboxes/netted/vm", None);
    assert_eq!(status, 200, "{vm}");
    assert_ne!(vm["jail"]["uid"], 0, "{vm}");

    // Its own token cannot change what its network allows; the admin can, through the jail's
    // waiter (the VMM itself cannot).
    let open = json!({"policy": "open"});
    let (status, body) = call(
        &m.sock,
        Some(&token),
        "PUT",
        "/sandboxes/netted/vm/net/policy",
        Some(open),
    );
    assert_eq!(status, 403, "{body}");
    let (status, body) = m.admin(
        "PUT",
        "/sandboxes/netted/vm/net/policy",
        Some(json!({"policy": "allow=198.51.100.0/24"})),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["policy"], "allow=198.51.100.0/24", "{body}");
    // The record keeps it as the waiter says it: what a wake is restored with.
    let record: Value = serde_json::from_slice(
        &std::fs::read(m.state.join("sandboxes/netted/sandbox.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(record["net_policy"], "allow=198.51.100.0/24", "{record}");

    // From the first sandbox with a network on, the manager keeps two networks built ahead
    // (--net-pool 2), held by its own descriptors: nothing mounted for them.
    let net_dir = dir.join("net");
    let pooled = held_pool_slots(&net_dir, m.process.pid(), 2);
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(&net_dir.display().to_string()), "{mounts}");

    // Asleep and awake again, it has the policy the admin set, in a network of its own.
    let (status, body) = m.admin("PUT", "/sandboxes/netted/pause", None);
    assert_eq!(
        (status, body["state"].as_str()),
        (200, Some("suspended")),
        "{body}"
    );
    gone(uplink_ns, &link);
    let (status, woke) = call(
        &m.sock,
        Some(&token),
        "GET",
        "/sandboxes/netted/vm/net",
        None,
    );
    assert_eq!(status, 200, "{woke}");
    assert_eq!(woke["policy"], "allow=198.51.100.0/24", "{woke}");
    assert_eq!(woke["guest"]["mac"], net["guest"]["mac"], "{woke}");
    let link = woke["host_link"]["name"].as_str().unwrap().to_string();
    assert!(mayfly_tests::netns::links_in(uplink_ns).contains(&link));
    // Its waiter took one of the pool's networks (the link is named for its slot).
    assert!(
        pooled.iter().any(|slot| link == format!("mfv{slot}")),
        "{link} is not one of the pooled slots {pooled:?}"
    );

    // Deleted, it leaves no network behind.
    let (status, body) = m.admin("DELETE", "/sandboxes/netted", None);
    assert_eq!(status, 200, "{body}");
    gone(uplink_ns, &link);
    // The pool was topped up again; a manager that stops lets its networks go.
    let pooled = held_pool_slots(&net_dir, m.process.pid(), 2);
    m.process.signal(libc::SIGTERM);
    m.process.wait_exit(Duration::from_secs(20));
    for slot in pooled {
        gone(uplink_ns, &format!("mfv{slot}"));
    }
    let ready: Vec<_> = std::fs::read_dir(&net_dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".ready"))
        .collect();
    assert!(ready.is_empty(), "{ready:?}");
}

/// Wait, bounded, until `count` network slots in `net_dir` are ready in the pool held by the
/// manager `pid`; their indices.
fn held_pool_slots(net_dir: &std::path::Path, pid: u32, count: usize) -> Vec<u32> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let held: Vec<u32> = std::fs::read_dir(net_dir)
            .unwrap()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                let index = name
                    .strip_prefix("slot-")?
                    .strip_suffix(".ready")?
                    .parse()
                    .ok()?;
                let mark = std::fs::read_to_string(e.path()).ok()?;
                mark.contains(&format!("held {pid} ")).then_some(index)
            })
            .collect();
        if held.len() == count {
            return held;
        }
        assert!(
            Instant::now() < deadline,
            "the manager's network pool holds {held:?}, not {count} slots"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Wait, bounded, for the link `link` to leave the namespace `ns`: a VMM's network goes with
/// it, the kernel removing a namespace (and its veth) a moment after its last holder.
fn gone(ns: &std::fs::File, link: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while mayfly_tests::netns::links_in(ns).iter().any(|l| l == link) {
        assert!(
            Instant::now() < deadline,
            "the network of {link} outlived its VMM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_templates_network_is_for_its_setup_and_each_sandbox_gets_the_policy_its_create_names() {
    let dir = TestDir::new("serve-template-net");
    let net = mayfly_tests::netns::TestNet::new(&dir);
    let uplink_ns = &net.ns;
    let m = Manager::start_with(&dir, &net.args());
    let template = json!({
        "kernel": probe::ELF,
        "mem_mib": 64,
        "cmdline": "touch=1",
        "probe": true,
        "net": "allow=192.0.2.0/24:443",
    });
    let policy_of = |name: &str, token: &str| -> Value {
        let (status, net) = call(
            &m.sock,
            Some(token),
            "GET",
            &format!("/sandboxes/{name}/vm/net"),
            None,
        );
        assert_eq!(status, 200, "{net}");
        net
    };
    // Made without a policy of its own, a sandbox's NIC reaches nothing: the template's
    // policy was its setup's alone.
    let plain = m.create(json!({"name": "plain", "template": template}));
    let net = policy_of("plain", &plain);
    assert_eq!(net["policy"], "none", "{net}");
    assert!(mayfly_tests::netns::links_in(uplink_ns)
        .contains(&net["host_link"]["name"].as_str().unwrap().to_string()));
    // With its own, it has that one; the template was built once for both.
    let own = m.create(json!({"name": "own", "template": template, "net": "allow=198.51.100.7"}));
    let net = policy_of("own", &own);
    assert!(
        net["policy"]
            .as_str()
            .unwrap()
            .starts_with("allow=198.51.100.7"),
        "{net}"
    );
    assert_eq!(m.events("template_built", ""), 1);
    // A template with no NIC makes sandboxes with none: a create's policy for one is refused.
    let mut bare = template.clone();
    bare.as_object_mut().unwrap().remove("net");
    let (status, body) = m.admin(
        "POST",
        "/sandboxes",
        Some(json!({"name": "bare", "template": bare, "net": "open"})),
    );
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("only if its template has one"),
        "{body}"
    );
    let (status, body) = m.admin(
        "POST",
        "/sandboxes",
        Some(json!({"name": "bad", "template": {"kernel": probe::ELF, "probe": true, "net": "sometimes"}})),
    );
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("is not a policy"),
        "{body}"
    );
    for name in ["plain", "own"] {
        assert_eq!(
            m.admin("DELETE", &format!("/sandboxes/{name}"), None).0,
            200
        );
    }
}

#[test]
fn an_exposed_port_is_the_managers_kept_across_sleep_and_restarts_and_a_connection_wakes_it() {
    use std::io::Read;
    let dir = TestDir::new("serve-ports");
    let net = mayfly_tests::netns::TestNet::new(&dir);
    let args = net.args();
    let mut m = Manager::start_with(&dir, &args);
    let token = m.create(json!({
        "name": "porty",
        "kernel": probe::ELF,
        "mem_mib": 64,
        "cmdline": "touch=1",
        "probe": true,
        "net": "allow=192.0.2.0/24",
    }));
    m.create_probe("nonic", None);

    // What cannot be, refused in words; its own token cannot expose it.
    for (body, status, says) in [
        (json!({"guest_port": 0}), 400, "1 to 65535"),
        (json!({"guest_port": 70000}), 400, "guest_port"),
        (
            json!({"guest_port": 8080, "host": "tcp:0.0.0.0:0"}),
            400,
            "loopback",
        ),
        (
            json!({"guest_port": 8080, "host": "unix:relative"}),
            400,
            "absolute",
        ),
        (
            json!({"guest_port": 8080, "host": "udp:127.0.0.1:1"}),
            400,
            "tcp:",
        ),
        (json!({"port": 8080}), 400, "unknown field"),
    ] {
        let (got, answer) = post(&m, "porty", body.clone());
        assert_eq!(got, status, "{body} → {answer}");
        assert!(
            answer["error"].as_str().unwrap().contains(says),
            "{body} → {answer}"
        );
    }
    let (status, body) = post(&m, "nonic", json!({"guest_port": 8080}));
    assert_eq!(status, 409, "{body}");
    assert!(body["error"].as_str().unwrap().contains("no NIC"), "{body}");
    let (status, body) = call(
        &m.sock,
        Some(&token),
        "POST",
        "/sandboxes/porty/ports",
        Some(json!({"guest_port": 8080})),
    );
    assert_eq!(status, 403, "{body}");

    // Exposed on a free loopback port; the same port twice, or a taken address, is refused.
    let (status, opened) = post(&m, "porty", json!({"guest_port": 8080}));
    assert_eq!(status, 201, "{opened}");
    let host = opened["host"].as_str().unwrap().to_string();
    let addr: std::net::SocketAddr = host.strip_prefix("tcp:").unwrap().parse().unwrap();
    assert!(addr.ip().is_loopback() && addr.port() != 0, "{opened}");
    assert_eq!(post(&m, "porty", json!({"guest_port": 8080})).0, 409);
    let (status, body) = post(&m, "porty", json!({"guest_port": 8081, "host": host}));
    assert_eq!(status, 409, "{body}");
    let (status, listed) = call(&m.sock, Some(&token), "GET", "/sandboxes/porty/ports", None);
    assert_eq!(status, 200, "{listed}");
    assert_eq!(
        listed["ports"],
        json!([{"guest_port": 8080, "host": host, "listening": true, "connections": 0}])
    );
    let unix_path = dir.join("porty-9000.sock");
    let unix_host = format!("unix:{}", unix_path.display());
    let (status, body) = post(&m, "porty", json!({"guest_port": 9000, "host": unix_host}));
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["host"], unix_host.as_str());

    // Asleep, its port still listens; a connection wakes it (the probe guest serves no TCP,
    // so the connection is then closed from the guest's side).
    let (status, body) = m.admin("PUT", "/sandboxes/porty/pause", None);
    assert_eq!(
        (status, body["state"].as_str()),
        (200, Some("suspended")),
        "{body}"
    );
    let woke_before = m.events("woke", "porty");
    let mut conn = std::net::TcpStream::connect(addr).expect("the port listens while asleep");
    conn.set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut buf = [0u8; 16];
    let read = conn.read(&mut buf);
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    m.wait_state("porty", "running", Duration::from_secs(30));
    assert_eq!(m.events("woke", "porty"), woke_before + 1);

    // The most connections a port holds at once (64) never crowd out the sandbox's own API
    // (its cap of 64 requests at once counts requests only). The probe serves no TCP: each
    // connection stays open for the seconds the VMM's side tries the guest.
    let held: Vec<std::net::TcpStream> = (0..64)
        .map(|_| std::net::TcpStream::connect(addr).expect("the port takes 64 connections"))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, listed) = m.admin("GET", "/sandboxes/porty/ports", None);
        if listed["ports"][0]["connections"] == 64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "64 connections never open: {listed}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(200));
    let (status, body) = call(&m.sock, Some(&token), "GET", "/sandboxes/porty/vm", None);
    assert_eq!(status, 200, "the API while its port is full: {body}");
    drop(held);

    // A manager killed and started again listens there again.
    m.process.signal(libc::SIGKILL);
    m.process.wait_exit(Duration::from_secs(10));
    std::mem::forget(m);
    let m = Manager::start_with(&dir, &args);
    let (status, listed) = m.admin("GET", "/sandboxes/porty/ports", None);
    assert_eq!(status, 200, "{listed}");
    assert_eq!(listed["ports"][0]["listening"], true, "{listed}");
    assert_eq!(listed["ports"][1]["listening"], true, "{listed}");
    drop(std::net::TcpStream::connect(addr).expect("the port listens after a restart"));
    // The Unix socket the killed manager left is cleared and listened on again.
    drop(
        std::os::unix::net::UnixStream::connect(&unix_path).expect("the unix port after a restart"),
    );
    assert_eq!(
        m.admin("DELETE", "/sandboxes/porty/ports/9000", None).0,
        200
    );
    assert!(
        !unix_path.exists(),
        "a closed unix port's socket is removed"
    );

    // Closed, it no longer listens, and the VMM's side (its jail's waiter) no longer forwards
    // it (its listening socket, listed by the kernel even once unlinked, is gone); closed
    // again, it is not there.
    let forwarded = m.state.join("sandboxes/porty/sock/port-8080.sock");
    let bound = |path: &std::path::Path| {
        // Num RefCount Protocol Flags Type St Inode Path: a listener's flags hold
        // __SO_ACCEPTCON (0x10000); its accepted connections show its path too.
        std::fs::read_to_string("/proc/net/unix")
            .unwrap()
            .lines()
            .filter(|l| l.ends_with(&format!(" {}", path.display())))
            .any(|l| {
                l.split_whitespace()
                    .nth(3)
                    .and_then(|f| u32::from_str_radix(f, 16).ok())
                    .is_some_and(|flags| flags & 0x10000 != 0)
            })
    };
    assert!(bound(&forwarded), "the VMM's side forwards port 8080");
    // The admin's own exposure of that guest port (through the VMM's route) is not the
    // manager's port, and stays.
    let admin_end = dir.join("admin-8080.sock");
    let (status, body) = m.admin(
        "PUT",
        "/sandboxes/porty/vm/net/expose",
        Some(json!({"port": 8080, "on": format!("unix:{}", admin_end.display())})),
    );
    assert_eq!(status, 200, "{body}");
    assert!(bound(&admin_end), "{body}");
    let (status, body) = m.admin("DELETE", "/sandboxes/porty/ports/8080", None);
    assert_eq!(status, 200, "{body}");
    assert!(
        bound(&admin_end),
        "closing the manager's port closed the admin's own exposure too"
    );
    assert!(
        !bound(&forwarded),
        "the VMM's side still forwards a closed port: {:?}",
        m.event_lines("port_closed", "porty")
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(addr).is_ok() {
        assert!(Instant::now() < deadline, "the closed port still listens");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        m.admin("DELETE", "/sandboxes/porty/ports/8080", None).0,
        404
    );
    assert_eq!(
        m.admin("DELETE", "/sandboxes/porty/ports/zero", None).0,
        400
    );

    // A deleted sandbox's ports go with it.
    let (status, opened) = post(&m, "porty", json!({"guest_port": 9090}));
    assert_eq!(status, 201, "{opened}");
    let addr: std::net::SocketAddr = opened["host"]
        .as_str()
        .unwrap()
        .strip_prefix("tcp:")
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(m.admin("DELETE", "/sandboxes/porty", None).0, 200);
    // Made again under its name at once: the old sandbox's port is not the new one's.
    m.create(json!({
        "name": "porty",
        "kernel": probe::ELF,
        "mem_mib": 64,
        "cmdline": "touch=1",
        "probe": true,
        "net": "allow=192.0.2.0/24",
    }));
    let deadline = Instant::now() + Duration::from_secs(5);
    while std::net::TcpStream::connect(addr).is_ok() {
        assert!(
            Instant::now() < deadline,
            "a deleted sandbox's port still listens"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let (_, listed) = m.admin("GET", "/sandboxes/porty/ports", None);
    assert_eq!(listed["ports"], json!([]), "{listed}");
}

fn post(m: &Manager, name: &str, body: Value) -> (u16, Value) {
    m.admin("POST", &format!("/sandboxes/{name}/ports"), Some(body))
}

/// A name in a sandbox's policy means what the resolver its guest is told to use
/// (`--net-dns`) says, asked from the uplink: a name only the test's DNS knows is pinned to its
/// address, and one it does not know is refused (400, with the resolver's reason) before any
/// VMM starts, at a create, for a template, and at a policy change.
#[test]
fn names_in_policies_are_asked_of_the_guests_resolver_and_unknown_ones_are_refused() {
    use mayfly_tests::index::PackageIndex;
    let dir = TestDir::new("serve-names");
    let net = mayfly_tests::netns::TestNet::with_internet(
        &dir,
        &[PackageIndex::HTTP, PackageIndex::DNS],
        Some(PackageIndex::DNS),
    );
    let _index = PackageIndex::start(&dir, &net);
    let m = Manager::start_with(&dir, &net.args());
    let probe = |name: &str, policy: &str| {
        json!({
            "name": name,
            "kernel": probe::ELF,
            "mem_mib": 64,
            "cmdline": "touch=1",
            "probe": true,
            "net": policy,
        })
    };
    for (spec, field) in [
        (
            probe("nowhere", "allow=192.0.2.1:80,nothing.test:80"),
            "\"net\"",
        ),
        (
            json!({"name": "nowhere", "template": {"net": "allow=nothing.test:80", "setup": ["true"]}}),
            "\"template.net\"",
        ),
    ] {
        let (status, body) = m.admin("POST", "/sandboxes", Some(spec));
        assert_eq!(status, 400, "{body}");
        let text = body["error"].as_str().unwrap_or_default();
        assert!(text.starts_with(field), "{text}");
        assert!(
            text.contains("\"nothing.test\"") && text.contains("no such name"),
            "{text}"
        );
        assert_eq!(m.admin("GET", "/sandboxes/nowhere", None).0, 404);
    }
    assert!(!m.state.join("sandboxes").join("nowhere").exists());

    let token = m.create(probe("named", "allow=pypi.test:80"));
    assert_eq!(m.describe("named")["jailed"], true);
    let policy = || {
        let (status, net) = call(
            &m.sock,
            Some(&token),
            "GET",
            "/sandboxes/named/vm/net",
            None,
        );
        assert_eq!(status, 200, "{net}");
        (net["policy"].clone(), net["resolved"].clone())
    };
    let pinned = (
        json!("allow=pypi.test:80"),
        json!([format!("{}/32:80", PackageIndex::HTTP)]),
    );
    assert_eq!(policy(), pinned);
    let (status, body) = m.admin(
        "PUT",
        "/sandboxes/named/vm/net/policy",
        Some(json!({"policy": "allow=nothing.test"})),
    );
    assert_eq!(status, 400, "{body}");
    assert!(body.to_string().contains("no such name"), "{body}");
    assert_eq!(policy(), pinned, "the old policy stays");
    assert_eq!(m.admin("DELETE", "/sandboxes/named", None).0, 200);

    // A resolver that does not answer is not the request's fault: 503, try again.
    let dir = TestDir::new("serve-names-deaf");
    let deaf = mayfly_tests::netns::TestNet::with_internet(
        &dir,
        &[PackageIndex::HTTP],
        Some(PackageIndex::HTTP),
    );
    let m = Manager::start_with(&dir, &deaf.args());
    let (status, body) = m.admin(
        "POST",
        "/sandboxes",
        Some(probe("deaf", "allow=pypi.test:80")),
    );
    assert_eq!(status, 503, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap_or_default()
            .contains("try again"),
        "{body}"
    );
    assert_eq!(m.admin("GET", "/sandboxes/deaf", None).0, 404);
}

/// Resident and proportional memory of process `pid`, bytes (smaps_rollup).
fn rss_and_pss(pid: u64) -> (u64, u64) {
    let memory = mayfly_tests::guest::memory_kib(pid)
        .unwrap_or_else(|| panic!("no Rss and Pss in the smaps_rollup of {pid}"));
    (memory.rss * 1024, memory.pss * 1024)
}

/// The process a jailed sandbox's VMM is: the one child of its jail's waiter.
fn vmm_of(waiter: u64) -> u64 {
    let children =
        std::fs::read_to_string(format!("/proc/{waiter}/task/{waiter}/children")).unwrap();
    let kids: Vec<u64> = children
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect();
    assert_eq!(kids.len(), 1, "the waiter {waiter} has {kids:?}");
    kids[0]
}

/// A fork into 100 of a running sandbox is the zygote's fork: the source runs on (it is not
/// put to sleep), and each clone is a sandbox of its own (its process, its jail's uid, its
/// token), whose guest memory is the source's shared copy-on-write.
#[test]
fn a_fork_into_a_hundred_shares_the_running_sources_memory_each_clone_jailed_apart() {
    let dir = TestDir::new("serve-fork-100");
    let m = Manager::start(&dir);
    let (status, body) = m.admin(
        "POST",
        "/sandboxes",
        Some(json!({
            "name": "src", "kernel": probe::ELF, "mem_mib": 64, "cmdline": "touch=1",
            "probe": true,
        })),
    );
    assert_eq!(status, 201, "{body}");
    m.wait_probe("src", "waiting", 1);
    let (status, body) = m.admin("POST", "/sandboxes/src/fork", Some(json!({"count": 100})));
    assert_eq!(status, 201, "{body}");
    let clones = body["clones"].as_array().unwrap().clone();
    assert_eq!(clones.len(), 100);
    // The source ran on.
    let src = m.describe("src");
    assert_eq!(
        (src["state"].as_str(), src["suspends"].as_u64()),
        (Some("running"), Some(0)),
        "{src}"
    );
    let mut uids = vec![src["uid"].as_u64().unwrap()];
    let mut tokens = Vec::new();
    let mut waiters = Vec::new();
    let (mut rss, mut pss) = (0u64, 0u64);
    for clone in &clones {
        let name = clone["name"].as_str().unwrap();
        assert_eq!(clone["state"], "running", "{clone}");
        let uid = clone["uid"].as_u64().unwrap();
        uids.push(uid);
        tokens.push(clone["token"].as_str().unwrap().to_string());
        let waiter = m.describe(name)["pid"].as_u64().unwrap();
        assert!(alive(waiter), "{name}");
        waiters.push(waiter);
        let vmm = vmm_of(waiter);
        let status = std::fs::read_to_string(format!("/proc/{vmm}/status")).unwrap();
        let uid_line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
        assert_eq!(
            uid_line.split_whitespace().nth(1),
            Some(uid.to_string().as_str()),
            "{name}'s VMM runs as its own uid"
        );
        let (r, p) = rss_and_pss(vmm);
        rss += r;
        pss += p;
    }
    for list in [&mut uids, &mut waiters] {
        list.sort_unstable();
        list.dedup();
    }
    tokens.sort();
    tokens.dedup();
    assert_eq!((uids.len(), waiters.len(), tokens.len()), (101, 100, 100));
    // Their pages are shared: each clone's proportional share is a small part of what it
    // maps (the guest's pages written before the fork are mapped by all 101 VMMs).
    assert!(
        pss * 3 < rss,
        "the clones' VMMs: PSS {} MiB of RSS {} MiB",
        pss >> 20,
        rss >> 20
    );
    // Each clone finds every page the source wrote, and answers with its own token.
    for name in ["src-1", "src-50", "src-100"] {
        m.wait_probe(name, "verified", 1);
    }
    let first = clones[0]["name"].as_str().unwrap();
    let token = clones[0]["token"].as_str().unwrap();
    let (status, vm) = call(
        &m.sock,
        Some(token),
        "GET",
        &format!("/sandboxes/{first}/vm"),
        None,
    );
    assert_eq!((status, &vm["name"]), (200, &json!(first)), "{vm}");
    let (status, _) = call(&m.sock, Some(token), "GET", "/sandboxes/src/vm", None);
    assert_eq!(status, 403, "a clone's token opens its own sandbox only");
    for clone in &clones {
        let name = clone["name"].as_str().unwrap();
        let (status, body) = m.admin("DELETE", &format!("/sandboxes/{name}"), None);
        assert_eq!(status, 200, "{body}");
    }
    for waiter in waiters {
        assert!(!alive(waiter), "a deleted clone's process runs on");
    }
}
