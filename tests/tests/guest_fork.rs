//! Fork of a running VM into live clones. Run through tests/run, which picks a KVM that can
//! run Linux (the host's or the rig's).

use std::path::{Path, PathBuf};
use std::time::Duration;

use mayfly_tests::agent::{sh, wait_agent};
use mayfly_tests::guest::{mayfly_output, Guest, TestDir, BOOT_TIMEOUT};

const EXIT_TIMEOUT: Duration = Duration::from_secs(60);
const CLIENT_TIMEOUT: Duration = Duration::from_secs(180);

/// Fork through the CLI; returns the answer's clones as (name, pid, control socket).
fn fork(sock: &str, count: u32, extra: &[&str]) -> Vec<(String, u32, PathBuf)> {
    let count = count.to_string();
    let mut args = vec!["fork", "--sock", sock, "--count", &count];
    args.extend_from_slice(extra);
    let out = mayfly_output(&args, CLIENT_TIMEOUT);
    assert!(
        out.status.success(),
        "fork failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    answer["clones"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap().to_string(),
                c["pid"].as_u64().unwrap() as u32,
                PathBuf::from(c["api_sock"].as_str().unwrap()),
            )
        })
        .collect()
}

fn shutdown(sock: &str) {
    let out = mayfly_output(&["shutdown", "--sock", sock], CLIENT_TIMEOUT);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid as i32, 0) == 0 }
}

fn kill(pid: u32) {
    // SAFETY: kill(2) on a clone this test started.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
}

fn count(sock: &Path) -> u64 {
    let text = sh(sock, "cat /tmp/count");
    text.parse()
        .unwrap_or_else(|_| panic!("the counter file holds {text:?}"))
}

#[test]
fn clones_carry_on_from_the_fork_apart_from_each_other_and_the_parent() {
    let dir = TestDir::new("fork");
    let sock = dir.arg("web.sock");
    let psock = Path::new(&sock);
    let mut parent = Guest::start(&["run", "--name", "web", "--api-sock", &sock]);
    wait_agent(psock, BOOT_TIMEOUT);
    sh(
        psock,
        // Written aside and renamed: a reader never sees the file truncated and not yet written.
        "(i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new; mv -f /tmp/count.new /tmp/count; sleep 0.2; done) </dev/null >/dev/null 2>&1 &",
    );
    sh(psock, "echo from-before-the-fork > /tmp/shared");
    let before = count(psock);

    let clones = fork(&sock, 4, &[]);
    assert_eq!(clones.len(), 4);
    let names: Vec<&str> = clones.iter().map(|c| c.0.as_str()).collect();
    assert_eq!(names, ["web-0", "web-1", "web-2", "web-3"]);

    // The parent writes after the fork; no clone may see it.
    sh(psock, "echo parent-after-fork > /tmp/parent-only");
    let mut randoms = Vec::new();
    for (i, (name, _, csock)) in clones.iter().enumerate() {
        // Each continues from the fork point.
        let now = count(csock);
        assert!(
            now >= before && now < before + 300,
            "{name}: counter {now}, {before} before the fork"
        );
        assert_eq!(sh(csock, "cat /tmp/shared"), "from-before-the-fork");
        assert_eq!(
            sh(csock, "cat /tmp/parent-only 2>/dev/null || echo absent"),
            "absent",
            "{name} sees the parent's write after the fork"
        );
        // Each knows who it is.
        assert_eq!(sh(csock, "mayfly-identity name"), *name);
        assert_eq!(sh(csock, "mayfly-identity index"), i.to_string());
        assert_eq!(sh(csock, "mayfly-identity parent"), "web");
        sh(csock, &format!("echo written-by-{name} > /tmp/mine"));
        randoms.push(sh(
            csock,
            "head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'",
        ));
    }
    // Each clone's file is its own.
    for (name, _, csock) in &clones {
        assert_eq!(sh(csock, "cat /tmp/mine"), format!("written-by-{name}"));
    }
    assert_eq!(
        sh(psock, "cat /tmp/mine 2>/dev/null || echo absent"),
        "absent"
    );
    assert_eq!(sh(psock, "mayfly-identity name"), "web");
    // Fresh entropy in every clone.
    let mut unique = randoms.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(
        unique.len(),
        randoms.len(),
        "clones repeat random bytes: {randoms:?}"
    );
    for r in &randoms {
        assert_eq!(r.len(), 32, "{r}");
    }
    // Clocks are right everywhere.
    let host = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    for (name, _, csock) in &clones {
        let t: i64 = sh(csock, "date +%s").parse().unwrap();
        assert!((t - host).abs() <= 5, "{name}: guest {t}, host {host}");
    }

    // The parent dies; the clones do not.
    parent.signal(libc::SIGKILL);
    parent.wait_exit(EXIT_TIMEOUT);
    for (name, pid, csock) in &clones {
        assert!(alive(*pid), "{name} died with its parent");
        assert_eq!(sh(csock, "echo still-here"), "still-here");
    }
    for (_, pid, _) in &clones {
        kill(*pid);
    }
}

#[test]
fn a_clone_can_be_forked_and_snapshotted() {
    let dir = TestDir::new("fork2");
    let sock = dir.arg("root.sock");
    let mut parent = Guest::start(&["run", "--name", "root", "--api-sock", &sock]);
    wait_agent(Path::new(&sock), BOOT_TIMEOUT);
    let clones = fork(&sock, 1, &["--name-prefix", "kid-"]);
    let (kid, kid_pid, kid_sock) = clones.into_iter().next().unwrap();
    assert_eq!(kid, "kid-0");
    sh(&kid_sock, "echo kid-data > /tmp/kid");

    // Fork of a fork.
    assert_eq!(kid_sock, dir.join("kid-0.sock"));
    let kid_sock = kid_sock.to_string_lossy().into_owned();
    let grandchildren = fork(&kid_sock, 2, &[]);
    let mut pids = vec![kid_pid];
    for (name, pid, csock) in grandchildren {
        pids.push(pid);
        assert!(name.starts_with("kid-0-"), "{name}");
        assert_eq!(sh(&csock, "cat /tmp/kid"), "kid-data");
        assert_eq!(sh(&csock, "mayfly-identity parent"), "kid-0");
    }

    // A snapshot of the clone restores.
    let snap = dir.arg("kid-snap");
    let out = mayfly_output(&["snapshot", "--sock", &kid_sock, &snap], CLIENT_TIMEOUT);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rsock = dir.join("restored.sock");
    let mut restored = Guest::start(&["restore", &snap, "--api-sock", &rsock.to_string_lossy()]);
    assert_eq!(sh(&rsock, "cat /tmp/kid"), "kid-data");
    assert_eq!(sh(&rsock, "mayfly-identity name"), "kid-0");
    shutdown(&rsock.to_string_lossy());
    assert_eq!(restored.wait_exit(EXIT_TIMEOUT).code(), Some(0));

    for pid in pids {
        kill(pid);
    }
    shutdown(&sock);
    assert_eq!(parent.wait_exit(EXIT_TIMEOUT).code(), Some(0));
}

#[test]
fn bad_fork_requests_are_refused_and_the_parent_keeps_running() {
    let dir = TestDir::new("fork-bad");
    let sock = dir.arg("p.sock");
    let mut parent = Guest::start(&["run", "--api-sock", &sock]);
    wait_agent(Path::new(&sock), BOOT_TIMEOUT);

    let refused = |args: &[&str], expected: &str| {
        let mut all = vec!["fork", "--sock", &sock];
        all.extend_from_slice(args);
        let out = mayfly_output(&all, CLIENT_TIMEOUT);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(
            stderr.contains(expected),
            "{args:?}: expected {expected:?} in {stderr:?}"
        );
    };
    refused(&["--count", "0"], "at least 1");
    refused(&["--count", "100000"], "the most clones mayfly allows");
    // More clones than host memory holds (at least 2 MiB each, whatever the guest's size): a
    // count from what the host has available, which a host with over 20 GB available cannot
    // be refused within the 10,000-clone limit, so it says so rather than fork them all.
    let available_mib = std::fs::read_to_string("/proc/meminfo")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .unwrap()
        / 1024;
    let too_many = available_mib / 2 + 1;
    assert!(
        too_many <= 10_000,
        "this test needs a host (or rig machine) with under 20 GB of memory available, not {available_mib} MiB"
    );
    refused(&["--count", &too_many.to_string()], "needs about");
    refused(
        &["--count", "1", "--name-prefix", "../evil"],
        "is not usable",
    );
    assert_eq!(sh(Path::new(&sock), "echo unharmed"), "unharmed");

    // A VM that is shutting down forks nothing.
    let out = mayfly_output(&["shutdown", "--sock", &sock], CLIENT_TIMEOUT);
    assert!(out.status.success());
    let out = mayfly_output(&["fork", "--sock", &sock, "--count", "1"], CLIENT_TIMEOUT);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("shutting down") || stderr.contains("no mayfly listens"),
        "{stderr}"
    );
    assert_eq!(parent.wait_exit(EXIT_TIMEOUT).code(), Some(0));
}
