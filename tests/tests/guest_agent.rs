//! Exec and files through the guest agent over virtio-vsock, in a booted, a restored and a
//! forked VM. Run through tests/run, which picks a KVM that can run Linux (the host's or the
//! rig's).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use mayfly_agent_protocol::{ExecRequest, WriteFileOptions};
use mayfly_tests::agent::{exec_request, sh, wait_agent};
use mayfly_tests::guest::{mayfly_ok, mayfly_output, Guest, TestDir, BOOT_TIMEOUT, CLIENT_TIMEOUT};

const EXIT_TIMEOUT: Duration = Duration::from_secs(60);

/// Boot the default guest named `name` with a control socket in `dir`; returns once its agent
/// answers.
fn boot(dir: &TestDir, name: &str) -> (Guest, PathBuf) {
    let sock = dir.join(&format!("{name}.sock"));
    let guest = Guest::start(&[
        "run",
        "--name",
        name,
        "--api-sock",
        &sock.to_string_lossy(),
        "--console",
        &dir.arg(&format!("{name}.log")),
    ]);
    wait_agent(&sock, BOOT_TIMEOUT);
    (guest, sock)
}

fn sha256_local(data: &[u8]) -> String {
    let dir = TestDir::new("sha");
    let path = dir.join("data");
    std::fs::write(&path, data).unwrap();
    let out = std::process::Command::new("sha256sum")
        .arg(&path)
        .output()
        .expect("sha256sum (coreutils) is installed");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned()
}

#[test]
fn exec_and_files_in_a_booted_vm() {
    let dir = TestDir::new("agent-boot");
    let (mut guest, sock) = boot(&dir, "agent-vm");

    // Exit codes, signals, stdout and stderr apart.
    let out = exec_request(
        &sock,
        ExecRequest::shell("echo out; echo err >&2; exit 3"),
        None,
    );
    assert_eq!(out.exit.exit_code, Some(3), "{:?}", out.exit);
    assert_eq!(out.stdout, b"out\n");
    assert_eq!(out.stderr, b"err\n");
    assert_eq!(
        exec_request(&sock, ExecRequest::argv(["true"]), None)
            .exit
            .exit_code,
        Some(0)
    );
    assert_eq!(
        exec_request(&sock, ExecRequest::argv(["false"]), None)
            .exit
            .exit_code,
        Some(1)
    );
    let killed = exec_request(&sock, ExecRequest::shell("kill -9 $$"), None);
    assert_eq!((killed.exit.exit_code, killed.exit.signal), (None, Some(9)));
    let missing = exec_request(&sock, ExecRequest::argv(["no-such-program"]), None);
    assert_eq!(missing.exit.exit_code, Some(127));
    assert!(missing
        .exit
        .error
        .as_deref()
        .unwrap_or("")
        .contains("no-such-program"));

    // Stdin delivered; a timeout kills.
    let cat = exec_request(
        &sock,
        ExecRequest::argv(["cat"]),
        Some(b"to the guest".to_vec()),
    );
    assert_eq!(cat.stdout, b"to the guest");
    let slow = exec_request(
        &sock,
        ExecRequest::argv(["sleep", "60"]).with_timeout_ms(500),
        None,
    );
    assert!(slow.exit.timed_out, "{:?}", slow.exit);
    assert!(slow.exit.wall_ms < 30_000.0, "{:?}", slow.exit);

    // 64 MiB of output, intact: the guest's checksum of what it wrote against ours of what
    // arrived.
    let big = exec_request(
        &sock,
        ExecRequest::shell("head -c 67108864 /dev/urandom | tee /tmp/big | wc -c >/dev/null"),
        None,
    );
    assert!(big.exit.success(), "{:?}", big.exit);
    let streamed = exec_request(&sock, ExecRequest::argv(["cat", "/tmp/big"]), None);
    assert_eq!(streamed.stdout.len(), 64 << 20);
    let theirs = sh(&sock, "sha256sum /tmp/big | cut -d' ' -f1");
    assert_eq!(sha256_local(&streamed.stdout), theirs);
    sh(&sock, "rm /tmp/big");

    // Twenty at once, side by side.
    let start = Instant::now();
    let threads: Vec<_> = (0..20)
        .map(|i| {
            let sock = sock.clone();
            std::thread::spawn(move || sh(&sock, &format!("sleep 1; echo {i}")))
        })
        .collect();
    for (i, t) in threads.into_iter().enumerate() {
        assert_eq!(t.join().unwrap(), i.to_string());
    }
    assert!(
        start.elapsed() < Duration::from_secs(15),
        "twenty 1 s sleeps ran one after another: {:?}",
        start.elapsed()
    );

    // Files both ways, with their mode.
    let agent = wait_agent(&sock, BOOT_TIMEOUT);
    let data: Vec<u8> = (0..(4u32 << 20) + 3)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
        .collect();
    let written = agent
        .write_file(
            "/tmp/in/data.bin",
            &WriteFileOptions::default().mode(0o640).mkdirs(true),
            &data[..],
        )
        .unwrap();
    assert_eq!(written, data.len() as u64);
    assert_eq!(
        sh(
            &sock,
            "stat -c %a /tmp/in/data.bin; sha256sum /tmp/in/data.bin | cut -d' ' -f1"
        ),
        format!("640\n{}", sha256_local(&data))
    );
    let mut back = Vec::new();
    agent.read_file("/tmp/in/data.bin", &mut back).unwrap();
    assert_eq!(back, data);

    // The CLI, and the VM's name as its hostname.
    let local = dir.join("local.txt");
    std::fs::write(&local, "copied in\n").unwrap();
    let sock_arg = sock.to_string_lossy().into_owned();
    mayfly_ok(&[
        "cp",
        "--sock",
        &sock_arg,
        &local.to_string_lossy(),
        "vm:/tmp/local.txt",
    ]);
    assert_eq!(
        mayfly_ok(&["exec", "--sock", &sock_arg, "--", "cat", "/tmp/local.txt"]),
        "copied in\n"
    );
    let out = mayfly_output(
        &["exec", "--sock", &sock_arg, "--", "sh", "-c", "exit 7"],
        CLIENT_TIMEOUT,
    );
    assert_eq!(out.status.code(), Some(7));
    assert_eq!(sh(&sock, "hostname"), "agent-vm");

    mayfly_ok(&["shutdown", "--sock", &sock_arg]);
    assert_eq!(guest.wait_exit(EXIT_TIMEOUT).code(), Some(0));
}

/// The VM's answers that must differ between restores and clones: its name and fresh bytes
/// from its RNG (never the same in two VMs that came from one memory image).
fn identity_and_random(sock: &Path) -> (String, String) {
    let text = sh(
        sock,
        "hostname; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'",
    );
    let (name, random) = text.split_once('\n').expect("two lines");
    (name.to_owned(), random.to_owned())
}

#[test]
fn exec_answers_after_restore_in_every_memory_mode_and_in_every_clone() {
    let dir = TestDir::new("agent-restore");
    let (mut parent, sock) = boot(&dir, "base");
    let agent = wait_agent(&sock, BOOT_TIMEOUT);
    // A hook every clone runs: it records that the clone was told it is one, and its name.
    agent
        .write_file(
            "/etc/mayfly/on-fork.d/10-mark",
            &WriteFileOptions::default().mode(0o755).mkdirs(true),
            &b"#!/bin/sh\nhostname > /tmp/forked-as\n"[..],
        )
        .unwrap();
    let sock_arg = sock.to_string_lossy().into_owned();
    let snap = dir.arg("snap");
    mayfly_ok(&["snapshot", "--sock", &sock_arg, &snap]);

    let mut randoms = vec![identity_and_random(&sock).1];
    for mode in ["cow", "lazy", "eager"] {
        let name = format!("restored-{mode}");
        let rsock = dir.join(&format!("{name}.sock"));
        let mut vm = Guest::start(&[
            "restore",
            &snap,
            "--memory",
            mode,
            "--name",
            &name,
            "--api-sock",
            &rsock.to_string_lossy(),
            "--console",
            &dir.arg(&format!("{name}.log")),
        ]);
        let (hostname, random) = identity_and_random(&rsock);
        assert_eq!(hostname, name, "{mode}: the refresh set the name");
        randoms.push(random);
        assert_eq!(
            sh(&rsock, "test -e /tmp/forked-as && echo yes || echo no"),
            "no"
        );
        vm.signal(libc::SIGTERM);
        vm.wait_exit(EXIT_TIMEOUT);
    }

    let answer: serde_json::Value =
        serde_json::from_str(&mayfly_ok(&["fork", "--sock", &sock_arg, "--count", "3"])).unwrap();
    let clones = answer["clones"].as_array().unwrap();
    assert_eq!(clones.len(), 3);
    for clone in clones {
        let name = clone["name"].as_str().unwrap();
        let csock = PathBuf::from(clone["api_sock"].as_str().unwrap());
        let (hostname, random) = identity_and_random(&csock);
        assert_eq!(hostname, name);
        randoms.push(random);
        assert_eq!(
            sh(&csock, "cat /tmp/forked-as"),
            name,
            "the on-fork hook ran"
        );
        let identity: serde_json::Value =
            serde_json::from_str(&sh(&csock, "cat /run/mayfly/identity.json")).unwrap();
        assert_eq!(identity["parent"], "base", "{identity}");
        assert_eq!(identity["name"], name, "{identity}");
        mayfly_ok(&["shutdown", "--sock", &csock.to_string_lossy()]);
    }
    let mut unique = randoms.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(
        unique.len(),
        randoms.len(),
        "two VMs drew the same random bytes: {randoms:?}"
    );

    mayfly_ok(&["shutdown", "--sock", &sock_arg]);
    assert_eq!(parent.wait_exit(EXIT_TIMEOUT).code(), Some(0));
}

#[test]
fn vsock_connections_across_pause_snapshot_and_restore() {
    let dir = TestDir::new("agent-vsock");
    let (mut parent, sock) = boot(&dir, "conn");
    let sock_arg = sock.to_string_lossy().into_owned();

    // Pause and resume without a snapshot: an open connection carries on.
    let s = sock.clone();
    let across_pause = std::thread::spawn(move || sh(&s, "sleep 3; echo survived the pause"));
    std::thread::sleep(Duration::from_secs(1));
    mayfly_ok(&["pause", "--sock", &sock_arg]);
    std::thread::sleep(Duration::from_secs(1));
    mayfly_ok(&["resume", "--sock", &sock_arg]);
    assert_eq!(across_pause.join().unwrap(), "survived the pause");

    // A connection open across a snapshot: in the restored VM it ends (the guest's side is
    // reset, which ends the command), and a new one works.
    let s = sock.clone();
    let open = std::thread::spawn(move || {
        mayfly_vmm::guest::agent::Agent::for_vm(&s)
            .and_then(|agent| agent.exec_output(&ExecRequest::argv(["sleep", "600.5"]), None))
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    while sh(&sock, "ps | grep -c '[s]leep 600.5' || true") != "1" {
        assert!(Instant::now() < deadline, "the long command did not start");
        std::thread::sleep(Duration::from_millis(200));
    }
    let snap = dir.arg("snap");
    mayfly_ok(&["snapshot", "--sock", &sock_arg, &snap]);
    let rsock = dir.join("restored.sock");
    let mut restored = Guest::start(&[
        "restore",
        &snap,
        "--api-sock",
        &rsock.to_string_lossy(),
        "--console",
        &dir.arg("restored.log"),
    ]);
    let deadline = Instant::now() + Duration::from_secs(60);
    while sh(&rsock, "ps | grep -c '[s]leep 600.5' || true") != "0" {
        assert!(
            Instant::now() < deadline,
            "the command of a connection cut by the restore still runs"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(sh(&rsock, "echo a new connection"), "a new connection");

    // A guest-initiated connection reaches a host listener at <vsock>_<port>.
    let vsock: serde_json::Value =
        serde_json::from_str(&mayfly_ok(&["status", "--sock", &rsock.to_string_lossy()])).unwrap();
    let vsock_path = vsock["vsock"]["path"].as_str().unwrap().to_owned();
    let listener = UnixListener::bind(format!("{vsock_path}_5000")).unwrap();
    let server = std::thread::spawn(move || {
        let (conn, _) = listener.accept().unwrap();
        let mut reader = BufReader::new(conn.try_clone().unwrap());
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        (&conn)
            .write_all(format!("host got {line}").as_bytes())
            .unwrap();
        line
    });
    assert_eq!(
        sh(&rsock, "echo hello | mayfly-agent --connect vsock:2:5000"),
        "host got hello"
    );
    assert_eq!(server.join().unwrap(), "hello\n");

    restored.signal(libc::SIGTERM);
    restored.wait_exit(EXIT_TIMEOUT);
    // The original still has its connection; shutting it down ends it (no hang).
    mayfly_ok(&["shutdown", "--sock", &sock_arg]);
    assert_eq!(parent.wait_exit(EXIT_TIMEOUT).code(), Some(0));
    let ended = open.join().unwrap();
    assert!(
        ended.is_err(),
        "the cut connection's exec reports an error: {ended:?}"
    );
}
