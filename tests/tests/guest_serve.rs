//! `mayfly serve` with the default Linux guest (run through tests/run, on a KVM that runs
//! Linux): a command run through the manager leaves a file and a process; the sandbox sleeps
//! to disk (its VMM gone) and the next exec through the manager wakes it and finds both; a fork
//! of it makes two sandboxes that each find both and name themselves.

use std::time::{Duration, Instant};

use mayfly_tests::agent::wait_agent;
use mayfly_tests::guest::{TestDir, BOOT_TIMEOUT};
use mayfly_tests::index::PackageIndex;
use mayfly_tests::serve::{alive, call, Manager};
use serde_json::{json, Value};

/// Run `script` in the sandbox through the manager: its exit code and stdout.
fn shell(m: &Manager, token: &str, name: &str, script: &str) -> (i64, String) {
    let (status, body) = call(
        &m.sock,
        Some(token),
        "POST",
        &format!("/sandboxes/{name}/vm/exec"),
        Some(json!({ "shell": script })),
    );
    assert_eq!(status, 200, "exec {script:?}: {body}");
    let code = body["exit"]["exit_code"].as_i64().unwrap_or(-1);
    (
        code,
        body["stdout"].as_str().unwrap_or_default().to_string(),
    )
}

/// The credential in the sandbox's guest (/run/mayfly/sandbox.json), once it is there.
fn guest_credential(m: &Manager, token: &str, name: &str) -> String {
    let deadline = Instant::now() + BOOT_TIMEOUT;
    loop {
        let (code, out) = shell(m, token, name, "cat /run/mayfly/sandbox.json 2>/dev/null");
        if code == 0 {
            let file: Value = serde_json::from_str(&out).expect("sandbox.json is JSON");
            assert_eq!(file["sandbox"], name, "{file}");
            return file["credential"]
                .as_str()
                .expect("a credential")
                .to_string();
        }
        assert!(Instant::now() < deadline, "{name} never got its credential");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Fork `name` into `count` through the manager: each clone's name and token.
fn fork(m: &Manager, name: &str, count: usize) -> Vec<(String, String)> {
    let (status, forked) = m.admin(
        "POST",
        &format!("/sandboxes/{name}/fork"),
        Some(json!({ "count": count })),
    );
    assert_eq!(status, 201, "{forked}");
    let clones: Vec<(String, String)> = forked["clones"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap().to_string(),
                c["token"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(clones.len(), count, "{forked}");
    clones
}

fn verify(m: &Manager, credential: &str) -> Value {
    let (status, body) = m.admin(
        "POST",
        "/credentials/verify",
        Some(json!({ "credential": credential })),
    );
    assert_eq!(status, 200, "{body}");
    body
}

#[test]
fn a_sandbox_wakes_from_disk_with_its_files_and_processes() {
    let dir = TestDir::new("serve-guest");
    let m = Manager::start(&dir);
    let token = m.create(json!({ "name": "box", "acts_for": "user:alice" }));
    let vm = m.describe("box");
    let sock = std::path::PathBuf::from(vm["socket"].as_str().unwrap());
    wait_agent(&sock, BOOT_TIMEOUT);
    // Its credential: in the guest once its agent answers, and the manager vouches for it.
    let credential = guest_credential(&m, &token, "box");
    assert_eq!(
        verify(&m, &credential),
        json!({
            "valid": true,
            "sandbox": "box",
            "acts_for": "user:alice",
            "created_ms": vm["created_ms"],
            "audience": null,
            "expires_ms": null,
        })
    );
    let forged = credential.replacen("626f78", "626f79", 1);
    assert_eq!(verify(&m, &forged)["valid"], false);

    let (code, out) = shell(
        &m,
        &token,
        "box",
        "echo kept > /root/state; setsid sleep 100000 </dev/null >/dev/null 2>&1 & echo $!",
    );
    assert_eq!(code, 0, "{out}");
    let sleeper: u32 = out.trim().parse().expect("the sleeper's pid");

    // Asleep: on disk, its VMM gone.
    let pid = vm["pid"].as_u64().unwrap();
    let (status, body) = call(&m.sock, Some(&token), "PUT", "/sandboxes/box/pause", None);
    assert_eq!(
        (status, body["state"].as_str()),
        (200, Some("suspended")),
        "{body}"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while alive(pid) {
        assert!(
            Instant::now() < deadline,
            "the sleeping sandbox's VMM still runs"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // The next exec wakes it: the file and the process are as they were.
    let (code, out) = shell(
        &m,
        &token,
        "box",
        &format!("cat /root/state; kill -0 {sleeper} && echo alive"),
    );
    assert_eq!(code, 0, "{out}");
    assert_eq!(out, "kept\nalive\n");
    let awake = m.describe("box");
    assert_eq!(awake["state"], "running");
    assert_eq!(awake["wakes"], 1, "{awake}");
    assert_ne!(
        awake["pid"],
        Value::from(pid),
        "a new VMM serves the woken sandbox"
    );

    // A fork of the running sandbox: two sandboxes of their own, each with the file and the
    // process, each its own name in the guest; the source deleted, they carry on.
    let (status, body) = m.admin(
        "POST",
        "/sandboxes/box/fork",
        Some(json!({ "names": ["box-a", "box-b"] })),
    );
    assert_eq!(status, 201, "{body}");
    // The source was forked where it ran: not put to sleep for it, paused only for the
    // capture of its state and memory.
    let suspends = m.event_lines("suspended", "box");
    assert_eq!(suspends.len(), 1, "{suspends:?}");
    assert!(body["source_paused_ms"].as_f64().unwrap() > 0.0, "{body}");
    assert_eq!(m.describe("box")["wakes"], 1);
    let (status, _) = m.admin("DELETE", "/sandboxes/box", None);
    assert_eq!(status, 200);
    let gone = verify(&m, &credential);
    assert_eq!(gone["valid"], false, "{gone}");
    assert!(
        gone["error"].as_str().unwrap().contains("no longer exists"),
        "{gone}"
    );
    for clone in body["clones"].as_array().unwrap() {
        let name = clone["name"].as_str().unwrap();
        let token = clone["token"].as_str().unwrap();
        // Each clone has a credential of its own, before its create answered, acting for
        // whom its source did.
        let mine = verify(&m, &guest_credential(&m, token, name));
        assert_eq!(
            (&mine["valid"], &mine["sandbox"], &mine["acts_for"]),
            (&json!(true), &json!(name), &json!("user:alice")),
            "{mine}"
        );
        let (code, out) = shell(
            &m,
            token,
            name,
            &format!(
                "cat /root/state; kill -0 {sleeper} && echo alive; mayfly-identity name; \
                 echo {name} > /root/mine; cat /root/mine"
            ),
        );
        assert_eq!(code, 0, "{name}: {out}");
        assert_eq!(out, format!("kept\nalive\n{name}\n{name}\n"), "{name}");
    }
    // What one clone wrote, the other does not see; a clone sleeps (its whole memory: it ran
    // on the fork's memory base, no snapshot's) and wakes with it, its disk layers its own
    // links to the source's (deleted) and its own top.
    let a_token = body["clones"][0]["token"].as_str().unwrap();
    let (status, body) = call(
        &m.sock,
        Some(a_token),
        "PUT",
        "/sandboxes/box-a/pause",
        None,
    );
    assert_eq!(status, 200, "{body}");
    let slept = m.event_lines("suspended", "box-a");
    assert_eq!(slept.last().unwrap()["memory_layers"], 0, "{slept:?}");
    let (_, out) = shell(&m, a_token, "box-a", "cat /root/mine");
    assert_eq!(out, "box-a\n");
    for name in ["box-a", "box-b"] {
        let (status, _) = m.admin("DELETE", &format!("/sandboxes/{name}"), None);
        assert_eq!(status, 200);
    }
}

#[test]
fn a_template_runs_its_setup_once_and_a_failing_setup_says_which_command() {
    let dir = TestDir::new("serve-template-guest");
    let m = Manager::start(&dir);
    let template = json!({ "setup": ["echo built > /root/made", "mkdir -p /srv/app"] });
    let a = m.create(json!({ "name": "a", "template": template }));
    let b = m.create(json!({ "name": "b", "template": template }));
    for (name, token) in [("a", &a), ("b", &b)] {
        let (code, out) = shell(
            &m,
            token,
            name,
            "cat /root/made; test -d /srv/app && echo dir",
        );
        assert_eq!((code, out.as_str()), (0, "built\ndir\n"), "{name}");
    }
    let (status, body) = m.admin(
        "POST",
        "/sandboxes",
        Some(json!({ "name": "c", "template": { "setup": ["true", "echo nope >&2; exit 7"] } })),
    );
    assert_eq!(status, 400, "{body}");
    let error = body["error"].as_str().unwrap();
    assert!(
        error.contains("setup command 2")
            && error.contains("exited with 7")
            && error.contains("nope"),
        "{error}"
    );
    let (_, list) = m.admin("GET", "/sandboxes", None);
    assert_eq!(list["sandboxes"].as_array().unwrap().len(), 2, "{list}");
    let templates: Vec<_> = std::fs::read_dir(m.state.join("templates"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(templates.len(), 1, "a failed template left {templates:?}");
}

/// What a connection to `addr` is answered, once it is answered (the guest's server may not
/// listen yet: a connection it does not take is closed with nothing).
fn answer_at(addr: std::net::SocketAddr) -> String {
    use std::io::Read;
    let deadline = Instant::now() + BOOT_TIMEOUT;
    loop {
        let mut got = String::new();
        if let Ok(mut conn) = std::net::TcpStream::connect(addr) {
            conn.set_read_timeout(Some(Duration::from_secs(60)))
                .unwrap();
            let _ = conn.read_to_string(&mut got);
        }
        if !got.is_empty() {
            return got;
        }
        assert!(Instant::now() < deadline, "{addr} never answered");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn an_exposed_port_answers_before_and_after_sleep_and_a_connection_wakes_its_sandbox() {
    let dir = TestDir::new("serve-port-guest");
    let net = mayfly_tests::netns::TestNet::new(&dir);
    let m = Manager::start_with(&dir, &net.args());
    // Jailed (the default), with a NIC that reaches one documentation address only.
    let token = m.create(json!({ "name": "web", "net": "allow=192.0.2.1" }));
    let vm = m.describe("web");
    assert_eq!(vm["jailed"], true);
    let sock = std::path::PathBuf::from(vm["socket"].as_str().unwrap());
    wait_agent(&sock, BOOT_TIMEOUT);
    let (code, out) = shell(
        &m,
        &token,
        "web",
        "(while true; do echo served-by-guest | nc -l -p 8080; done) </dev/null >/dev/null 2>&1 & echo ok",
    );
    assert_eq!((code, out.as_str()), (0, "ok\n"));
    let (status, opened) = m.admin(
        "POST",
        "/sandboxes/web/ports",
        Some(json!({"guest_port": 8080})),
    );
    assert_eq!(status, 201, "{opened}");
    let addr: std::net::SocketAddr = opened["host"]
        .as_str()
        .unwrap()
        .strip_prefix("tcp:")
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(answer_at(addr), "served-by-guest\n");

    // Asleep, its VMM gone: a connection to its port wakes it, and its server answers.
    let pid = vm["pid"].as_u64().unwrap();
    let (status, body) = m.admin("PUT", "/sandboxes/web/pause", None);
    assert_eq!(
        (status, body["state"].as_str()),
        (200, Some("suspended")),
        "{body}"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while alive(pid) {
        assert!(
            Instant::now() < deadline,
            "the sleeping sandbox's VMM still runs"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(answer_at(addr), "served-by-guest\n");
    let awake = m.describe("web");
    assert_eq!(
        (awake["state"].as_str(), awake["wakes"].as_u64()),
        (Some("running"), Some(1)),
        "{awake}"
    );
    assert_eq!(m.admin("DELETE", "/sandboxes/web", None).0, 200);
}

#[test]
fn a_jailed_networked_sandbox_forks_into_three_each_with_its_own_network_uid_and_disk() {
    let dir = TestDir::new("serve-fork-net");
    let net = mayfly_tests::netns::TestNet::new(&dir);
    let m = Manager::start_with(&dir, &net.args());
    let token = m.create(json!({ "name": "src", "net": "allow=192.0.2.1" }));
    let sock = std::path::PathBuf::from(m.describe("src")["socket"].as_str().unwrap());
    wait_agent(&sock, BOOT_TIMEOUT);
    let (code, _) = shell(&m, &token, "src", "echo source > /root/mark");
    assert_eq!(code, 0);
    let clones = fork(&m, "src", 3);
    let mut macs = std::collections::BTreeSet::new();
    let mut outside = std::collections::BTreeSet::new();
    let mut uids = std::collections::BTreeSet::new();
    let net_of = |name: &str, token: &str| -> Value {
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
    let src_net = net_of("src", &token);
    macs.insert(src_net["guest"]["mac"].as_str().unwrap().to_string());
    outside.insert(src_net["outside_ip"].as_str().unwrap().to_string());
    uids.insert(m.describe("src")["uid"].as_u64().unwrap());
    for (i, (name, token)) in clones.iter().enumerate() {
        let net = net_of(name, token);
        assert_eq!(net["policy"], "allow=192.0.2.1/32", "{net}");
        let mac = net["guest"]["mac"].as_str().unwrap().to_string();
        // Its guest took on its own MAC (the agent's refresh after the fork).
        let deadline = Instant::now() + BOOT_TIMEOUT;
        loop {
            let (_, out) = shell(&m, token, name, "cat /sys/class/net/eth0/address");
            if out.trim() == mac {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{name}'s guest kept the MAC {out:?}, not {mac}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        macs.insert(mac);
        outside.insert(net["outside_ip"].as_str().unwrap().to_string());
        let described = m.describe(name);
        assert_eq!(described["jailed"], true);
        uids.insert(described["uid"].as_u64().unwrap());
        // Its disk: the source's file, and its own write, which no other sees.
        let (code, out) = shell(
            &m,
            token,
            name,
            &format!("cat /root/mark; echo clone-{i} > /root/own"),
        );
        assert_eq!(code, 0, "{out}");
        assert!(out.starts_with("source\n"), "{out}");
    }
    for (i, (name, token)) in clones.iter().enumerate() {
        let (_, out) = shell(&m, token, name, "cat /root/own");
        assert_eq!(out, format!("clone-{i}\n"), "{name} sees another's write");
    }
    assert_eq!(macs.len(), 4, "MACs: {macs:?}");
    assert_eq!(outside.len(), 4, "outside addresses: {outside:?}");
    assert_eq!(uids.len(), 4, "uids: {uids:?}");
    for name in clones.iter().map(|(n, _)| n.as_str()).chain(["src"]) {
        assert_eq!(
            m.admin("DELETE", &format!("/sandboxes/{name}"), None).0,
            200
        );
    }
}

/// The project the agent works on: a median with a bug, and a test that writes its verdict to
/// result.json and exits 1 on a failure.
const PROJECT: &str = r#"mkdir -p /root/app && cd /root/app && cat > app.py <<'PY'
import stats_kit

def median(xs):
    return xs[len(xs) // 2]

def summary(xs):
    return {"mean": stats_kit.mean(xs), "median": median(xs)}
PY
cat > test_app.py <<'PY'
import json, sys
from app import summary
cases = [([3, 1, 2], {"mean": 2.0, "median": 2}), ([4, 1, 3, 2], {"mean": 2.5, "median": 2.5})]
failed = [xs for xs, want in cases if summary(xs) != want]
json.dump({"passed": len(cases) - len(failed), "failed": len(failed)}, open("result.json", "w"))
print("FAIL" if failed else "PASS", failed)
sys.exit(1 if failed else 0)
PY"#;

/// Three fixes for the median: the first still does not sort, the second forgets even
/// lengths, the third is right.
const FIXES: [&str; 3] = [
    "return xs[(len(xs) - 1) // 2]",
    "return sorted(xs)[len(xs) // 2]",
    "s = sorted(xs); n = len(s); return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2",
];

/// The seed's trace, everything through the manager: a jailed sandbox from the Debian template
/// with an egress allowlist naming a package index by name (the name only the test's DNS
/// knows, which guests are told to use and the policy asks); `pip install` from it; a test
/// that fails, read as exit code, output and result file; a fork into 3, a different fix in
/// each; the one that passes is kept, the rest deleted.
#[test]
fn the_seeds_trace_pip_install_behind_an_allowlist_then_a_fork_into_three_fixes() {
    let dir = TestDir::new("serve-trace");
    let net = mayfly_tests::netns::TestNet::with_internet(
        &dir,
        &[PackageIndex::HTTP, PackageIndex::DNS],
        Some(PackageIndex::DNS),
    );
    let index = PackageIndex::start(&dir, &net);
    let m = Manager::start_with(&dir, &net.args());

    // A name nobody resolves is refused with the resolver's reason, and leaves no sandbox.
    let (status, body) = m.admin(
        "POST",
        "/sandboxes",
        Some(json!({ "name": "nowhere", "net": "allow=nothing.test:80" })),
    );
    assert_eq!(status, 400, "{body}");
    assert!(
        body.to_string().contains("no such name"),
        "the reason: {body}"
    );
    assert_eq!(m.admin("GET", "/sandboxes/nowhere", None).0, 404);

    // 1. The sandbox: the Debian template, pip pointed at the index once, in its setup (which
    //    reaches the index through the template's allowlist).
    let token = m.create(json!({
        "name": "agent",
        "net": format!("allow={}:80", PackageIndex::NAME),
        "template": {
            "rootfs": "debian",
            "net": format!("allow={}:80", PackageIndex::NAME),
            "setup": [
                concat!(
                    "printf '[global]\\nindex-url = http://pypi.test/simple/\\ntrusted-host = pypi.test\\n",
                    "break-system-packages = true\\nroot-user-action = ignore\\n' > /etc/pip.conf"
                ),
                // The setup reaches the index through the template's own allowlist.
                "python3 -c \"import urllib.request as u; u.urlopen('http://pypi.test/simple/', timeout=30).read()\"",
            ],
        },
    }));
    let sock = std::path::PathBuf::from(m.describe("agent")["socket"].as_str().unwrap());
    wait_agent(&sock, BOOT_TIMEOUT);
    assert_eq!(m.describe("agent")["jailed"], true);
    let (status, vm_net) = call(
        &m.sock,
        Some(&token),
        "GET",
        "/sandboxes/agent/vm/net",
        None,
    );
    assert_eq!(status, 200, "{vm_net}");
    assert_eq!(vm_net["policy"], format!("allow={}:80", PackageIndex::NAME));
    assert_eq!(
        vm_net["resolved"],
        json!([format!("{}/32:80", PackageIndex::HTTP)]),
        "the name is pinned to what the test's DNS says: {vm_net}"
    );
    let outside = vm_net["outside_ip"].as_str().unwrap().to_string();

    // 2. pip install, by name, through the allowlist.
    let (code, out) = shell(&m, &token, "agent", "pip install mayfly-demo-stats 2>&1");
    assert_eq!(code, 0, "pip install: {out}");
    assert!(
        out.contains("Successfully installed mayfly-demo-stats-1.0"),
        "{out}"
    );
    let requests = index.requests();
    assert!(
        requests
            .iter()
            .any(|(who, path)| *who == outside && path.starts_with("/packages/")),
        "the wheel was fetched from the sandbox's own address {outside}: {requests:?}"
    );
    // Nothing else is reachable: a server on the resolver's address (TCP 80, the decoy), which
    // the allowlist does not name.
    let (code, out) = shell(
        &m,
        &token,
        "agent",
        &format!(
            "python3 -c 'import socket; socket.create_connection((\"{}\", 80), timeout=5)' 2>&1",
            PackageIndex::DNS
        ),
    );
    assert_ne!(
        code, 0,
        "a destination off the allowlist was reached: {out}"
    );
    assert!(
        !index.requests().iter().any(|(_, what)| what == "-"),
        "the decoy saw a connection: {:?}",
        index.requests()
    );

    // 3. The project, and its test: it fails; the verdict is the exit code, the output and
    //    the result file.
    let (code, out) = shell(&m, &token, "agent", PROJECT);
    assert_eq!(code, 0, "{out}");
    let (code, out) = shell(&m, &token, "agent", "cd /root/app && python3 test_app.py");
    assert_eq!((code, out.starts_with("FAIL")), (1, true), "{out}");
    let (_, result) = shell(&m, &token, "agent", "cat /root/app/result.json");
    let result: Value = serde_json::from_str(&result).unwrap();
    assert_eq!(result, json!({"passed": 0, "failed": 2}));

    // 4. Fork into 3, a fix in each.
    let clones = fork(&m, "agent", 3);
    let mut verdicts = Vec::new();
    for ((name, token), fix) in clones.iter().zip(FIXES) {
        let apply = format!(
            "cd /root/app && python3 - <<'PY'\n\
             src = open('app.py').read()\n\
             src = src.replace('return xs[len(xs) // 2]', {fix:?})\n\
             open('app.py', 'w').write(src)\nPY"
        );
        let (code, out) = shell(&m, token, name, &apply);
        assert_eq!(code, 0, "{name}: {out}");
        let (code, out) = shell(&m, token, name, "cd /root/app && python3 test_app.py");
        let (_, result) = shell(&m, token, name, "cat /root/app/result.json");
        verdicts.push((name.clone(), code, out, result));
    }
    let passing: Vec<&String> = verdicts
        .iter()
        .filter(|(_, code, _, _)| *code == 0)
        .map(|(name, ..)| name)
        .collect();
    assert_eq!(passing, vec![&clones[2].0], "verdicts: {verdicts:?}");
    let (winner, _, out, result) = &verdicts[2];
    assert!(out.starts_with("PASS"), "{out}");
    assert_eq!(
        serde_json::from_str::<Value>(result).unwrap(),
        json!({"passed": 2, "failed": 0})
    );
    // The source is as it was: its fix was never applied.
    let (code, _) = shell(&m, &token, "agent", "cd /root/app && python3 test_app.py");
    assert_eq!(code, 1);

    // 5. Keep the one that passes; delete the rest.
    for name in clones.iter().map(|(n, _)| n.as_str()).chain(["agent"]) {
        if name != winner {
            assert_eq!(
                m.admin("DELETE", &format!("/sandboxes/{name}"), None).0,
                200
            );
        }
    }
    let (status, list) = m.admin("GET", "/sandboxes", None);
    assert_eq!(status, 200, "{list}");
    let names: Vec<&str> = list["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["name"].as_str())
        .collect();
    assert_eq!(names, vec![winner.as_str()], "{list}");
    let (code, out) = shell(
        &m,
        &clones[2].1,
        winner,
        "cd /root/app && python3 -c 'import stats_kit, app' && python3 test_app.py",
    );
    assert_eq!(code, 0, "{out}");
}
