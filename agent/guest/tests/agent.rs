//! The agent binary on the host, over a Unix socket, driven by `AgentClient`.
//!
//! Each test starts its own agent with `--no-system-changes` (refresh must not set this
//! machine's clock or hostname) and its own run and hooks directories. `MAYFLY_AGENT_BIN`
//! replaces the binary under test (e.g. with the static release build).

use std::fs;
use std::io::{Cursor, Read, Write};
use std::os::unix::fs::{symlink, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use mayfly_agent_protocol::*;

struct Agent {
    child: Child,
    dir: PathBuf,
    sock: PathBuf,
}

impl Agent {
    fn start() -> Agent {
        Agent::start_with(&[])
    }

    fn start_with(extra: &[&str]) -> Agent {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "mayfly-agent-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("hooks")).unwrap();
        let sock = dir.join("agent.sock");
        let log = fs::File::create(dir.join("agent.log")).unwrap();
        // MAYFLY_AGENT_BIN runs the suite against another build, e.g. the static one.
        let bin = std::env::var_os("MAYFLY_AGENT_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_mayfly-agent")));
        let child = Command::new(&bin)
            .arg("--listen")
            .arg(format!("unix:{}", sock.display()))
            .arg("--no-system-changes")
            .arg("--run-dir")
            .arg(dir.join("run"))
            .arg("--hooks-dir")
            .arg(dir.join("hooks"))
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
        let agent = Agent { child, dir, sock };
        let deadline = Instant::now() + Duration::from_secs(10);
        while UnixStream::connect(&agent.sock).is_err() {
            assert!(
                Instant::now() < deadline,
                "the agent did not listen within 10 s; its log:\n{}",
                agent.log()
            );
            thread::sleep(Duration::from_millis(10));
        }
        agent
    }

    fn log(&self) -> String {
        fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default()
    }

    fn connect(&self) -> UnixStream {
        let s = UnixStream::connect(&self.sock).unwrap();
        // No test should hang forever on a broken agent.
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        s
    }

    fn client(&self) -> AgentClient<UnixStream> {
        AgentClient::new(self.connect())
    }

    fn path(&self, name: &str) -> String {
        self.dir.join(name).to_string_lossy().into_owned()
    }

    fn exec(&self, req: &ExecRequest) -> ExecOutput {
        self.client().exec_output(req, None).unwrap()
    }

    /// Peak resident memory of the agent process, in KiB.
    fn vm_hwm_kib(&self) -> u64 {
        let status = fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmHWM in /proc/<pid>/status")
    }

    fn assert_alive(&mut self) {
        assert!(
            self.child.try_wait().unwrap().is_none(),
            "the agent died; its log:\n{}",
            self.log()
        );
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

fn shell(cmd: &str) -> ExecRequest {
    ExecRequest::shell(cmd)
}

fn text(b: &[u8]) -> &str {
    std::str::from_utf8(b).unwrap()
}

/// Deterministic pseudo-random bytes (xorshift), so data checks do not rely on patterns.
fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

fn crc(data: &[u8]) -> u32 {
    crc32fast::hash(data)
}

/// Whether a process is gone (or only a zombie waiting for its new parent to reap it).
fn process_gone(pid: u32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
    }
}

fn wait_gone(pid: u32, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if process_gone(pid) {
            return true;
        }
        thread::sleep(Duration::from_millis(20));
    }
    process_gone(pid)
}

fn wait_for_file(path: &str, within: Duration) -> String {
    let deadline = Instant::now() + within;
    loop {
        if let Ok(s) = fs::read_to_string(path) {
            if s.ends_with('\n') {
                return s;
            }
        }
        assert!(Instant::now() < deadline, "{path} did not appear");
        thread::sleep(Duration::from_millis(10));
    }
}

fn pids_in(s: &str) -> Vec<u32> {
    s.split_whitespace().map(|p| p.parse().unwrap()).collect()
}

// ---------------------------------------------------------------------------------------
// Session basics

#[test]
fn hello_and_ping() {
    let agent = Agent::start();
    let mut client = agent.client();
    let hello = client.hello().unwrap().clone();
    assert_eq!(hello.protocol, PROTOCOL_VERSION);
    assert!(hello.agent.starts_with("mayfly-agent "), "{}", hello.agent);
    for op in OPS {
        assert!(
            hello.ops.iter().any(|o| o == op),
            "{op} missing from {:?}",
            hello.ops
        );
    }
    let ping = client.ping().unwrap();
    assert_eq!(ping.protocol, 1);
    assert_eq!(ping.agent, hello.agent);
    assert!(ping.uptime_ms > 0);
}

// ---------------------------------------------------------------------------------------
// exec

#[test]
fn exit_codes_and_signals() {
    let agent = Agent::start();
    let out = agent.exec(&ExecRequest::argv(["true"]));
    assert_eq!((out.exit.exit_code, out.exit.signal), (Some(0), None));
    assert!(out.exit.error.is_none());
    assert!(!out.exit.timed_out);
    let out = agent.exec(&ExecRequest::argv(["false"]));
    assert_eq!(out.exit.exit_code, Some(1));
    let out = agent.exec(&shell("exit 42"));
    assert_eq!(out.exit.exit_code, Some(42));
    let out = agent.exec(&shell("kill -TERM $$; sleep 5"));
    assert_eq!((out.exit.exit_code, out.exit.signal), (None, Some(15)));
    assert!(out.exit.wall_ms > 0.0 && out.exit.wall_ms < 5000.0);
}

#[test]
fn resource_usage_is_reported() {
    let agent = Agent::start();
    // Busy for a while in user space, and touching ~20 MiB.
    let out = agent.exec(&shell(
        "i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done; head -c 20000000 /dev/zero | tail -c 1 >/dev/null",
    ));
    assert!(out.exit.success(), "{:?}", out);
    assert!(out.exit.user_cpu_ms > 1.0, "{:?}", out.exit);
    assert!(out.exit.max_rss_kib > 1000, "{:?}", out.exit);
    assert!(
        out.exit.wall_ms >= out.exit.user_cpu_ms * 0.5,
        "{:?}",
        out.exit
    );
}

#[test]
fn stdout_and_stderr_are_kept_apart() {
    let agent = Agent::start();
    let out = agent.exec(&shell("echo out1; echo err1 >&2; echo out2; echo err2 >&2"));
    assert_eq!(text(&out.stdout), "out1\nout2\n");
    assert_eq!(text(&out.stderr), "err1\nerr2\n");
    let out = agent.exec(&shell(
        "head -c 1000000 /dev/zero | tr '\\0' a & head -c 700000 /dev/zero | tr '\\0' b >&2; wait",
    ));
    assert!(out.exit.success());
    assert_eq!(out.stdout.len(), 1_000_000);
    assert_eq!(out.stderr.len(), 700_000);
    assert!(out.stdout.iter().all(|&b| b == b'a'));
    assert!(out.stderr.iter().all(|&b| b == b'b'));
}

#[test]
fn sixty_four_mib_of_output_with_bounded_agent_memory() {
    let agent = Agent::start();
    let blob = noise(1 << 20, 64);
    fs::write(agent.path("blob"), &blob).unwrap();
    let mut expected = crc32fast::Hasher::new();
    for _ in 0..64 {
        expected.update(&blob);
    }
    let expected = expected.finalize();

    let mut got = crc32fast::Hasher::new();
    let mut total = 0usize;
    let mut chunks = 0usize;
    let mut largest = 0usize;
    let mut stderr = Vec::new();
    let cmd = format!("for i in $(seq 64); do cat {}; done", agent.path("blob"));
    let exit = agent
        .client()
        .exec(
            &shell(&cmd),
            None::<Cursor<Vec<u8>>>,
            |b| {
                // A slow reader at first: the program outpaces us, so without
                // backpressure the agent would have to buffer.
                if chunks < 200 {
                    thread::sleep(Duration::from_millis(2));
                }
                chunks += 1;
                largest = largest.max(b.len());
                total += b.len();
                got.update(b);
            },
            |b| stderr.extend_from_slice(b),
        )
        .unwrap();
    assert!(exit.success(), "{exit:?} {}", text(&stderr));
    assert_eq!(total, 64 << 20);
    assert_eq!(got.finalize(), expected, "output corrupted");
    assert!(largest <= CHUNK_SIZE, "a chunk of {largest} bytes");
    let hwm = agent.vm_hwm_kib();
    println!("agent VmHWM after 64 MiB of output: {hwm} KiB ({chunks} chunks)");
    assert!(hwm < 32 * 1024, "the agent's peak RSS is {hwm} KiB");
}

#[test]
fn stdin_is_delivered() {
    let agent = Agent::start();
    let input = noise(3 << 20, 7);
    let out = agent
        .client()
        .exec_output(&ExecRequest::argv(["cat"]), Some(input.clone()))
        .unwrap();
    assert!(out.exit.success());
    assert_eq!(out.stdout.len(), input.len());
    assert_eq!(crc(&out.stdout), crc(&input));

    let out = agent
        .client()
        .exec_output(&ExecRequest::argv(["wc", "-c"]), Some(b"12345".to_vec()))
        .unwrap();
    assert_eq!(text(&out.stdout).trim(), "5");

    // A program that stops reading early must not hang the exec.
    let out = agent
        .client()
        .exec_output(
            &ExecRequest::argv(["head", "-c", "10"]),
            Some(input.clone()),
        )
        .unwrap();
    assert!(out.exit.success(), "{:?}", out.exit);
    assert_eq!(out.stdout, input[..10]);

    // Without stdin the program reads /dev/null.
    let out = agent.exec(&ExecRequest::argv(["wc", "-c"]));
    assert_eq!(text(&out.stdout).trim(), "0");
}

#[test]
fn timeout_kills_the_process_group() {
    let agent = Agent::start();
    let pidfile = agent.path("bg.pid");
    let cmd = format!("sleep 30 & echo $! > {pidfile}; sleep 30");
    let t = Instant::now();
    let out = agent.exec(&shell(&cmd).with_timeout_ms(1000));
    assert!(out.exit.timed_out, "{:?}", out.exit);
    assert_eq!(out.exit.signal, Some(libc::SIGTERM), "{:?}", out.exit);
    assert!(
        out.exit.wall_ms >= 950.0 && out.exit.wall_ms < 5000.0,
        "{:?}",
        out.exit
    );
    assert!(t.elapsed() < Duration::from_secs(5));
    let bg = pids_in(&fs::read_to_string(&pidfile).unwrap())[0];
    assert!(
        wait_gone(bg, Duration::from_secs(3)),
        "background child {bg} survived"
    );
}

#[test]
fn timeout_escalates_to_sigkill() {
    let agent = Agent::start();
    // Ignoring SIGTERM (inherited by its children too) leaves only SIGKILL.
    let out = agent.exec(&shell("trap '' TERM; while :; do sleep 0.1; done").with_timeout_ms(300));
    assert!(out.exit.timed_out);
    assert_eq!(out.exit.signal, Some(libc::SIGKILL), "{:?}", out.exit);
    assert!(
        out.exit.wall_ms >= 2200.0 && out.exit.wall_ms < 6000.0,
        "{:?}",
        out.exit
    );
}

#[test]
fn twenty_concurrent_execs() {
    let agent = Agent::start();
    let t = Instant::now();
    thread::scope(|s| {
        let handles: Vec<_> = (0..20)
            .map(|i| {
                let agent = &agent;
                s.spawn(move || {
                    let cmd = format!("echo start-{i}; sleep 0.5; echo end-{i} >&2; exit {i}");
                    let out = agent.exec(&shell(&cmd));
                    assert_eq!(out.exit.exit_code, Some(i));
                    assert_eq!(text(&out.stdout), format!("start-{i}\n"));
                    assert_eq!(text(&out.stderr), format!("end-{i}\n"));
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    });
    // 20 x 0.5 s one after another would be 10 s.
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
}

#[test]
fn missing_or_unexecutable_programs() {
    let agent = Agent::start();
    let mut client = agent.client();
    let signaller = client.signaller().unwrap();
    let exit = client
        .exec(
            &ExecRequest::argv(["mayfly-no-such-command"]),
            None::<Cursor<Vec<u8>>>,
            |_| {},
            |_| {},
        )
        .unwrap();
    assert_eq!(exit.exit_code, Some(127), "{exit:?}");
    let error = exit.error.unwrap();
    assert!(
        error.contains("no such file: mayfly-no-such-command"),
        "{error}"
    );
    assert_eq!(
        signaller.pid(),
        None,
        "STARTED was sent for a program that never ran"
    );

    let out = agent.exec(&ExecRequest::argv(["/nonexistent/dir/prog"]));
    assert_eq!(out.exit.exit_code, Some(127));

    let script = agent.path("not-executable");
    fs::write(&script, "#!/bin/sh\necho hi\n").unwrap();
    fs::set_permissions(&script, fs::Permissions::from_mode(0o644)).unwrap();
    let out = agent.exec(&ExecRequest::argv([script.as_str()]));
    assert_eq!(out.exit.exit_code, Some(126), "{:?}", out.exit);
    assert!(out.exit.error.unwrap().contains("permission denied"));
}

#[test]
fn signals_reach_the_program() {
    let agent = Agent::start();
    let mut client = agent.client();
    let signaller = client.signaller().unwrap();
    let sender = signaller.clone();
    let t = thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !sender.is_running() {
            assert!(Instant::now() < deadline, "never started");
            thread::sleep(Duration::from_millis(5));
        }
        sender.signal(libc::SIGUSR1).unwrap();
    });
    let exit = client
        .exec(
            &ExecRequest::argv(["sleep", "30"]),
            None::<Cursor<Vec<u8>>>,
            |_| {},
            |_| {},
        )
        .unwrap();
    t.join().unwrap();
    assert_eq!(exit.signal, Some(libc::SIGUSR1), "{exit:?}");
    assert!(signaller.pid().unwrap() > 1);

    // A shell that traps the signal sees it too (it is sent to the whole group). The shell
    // says when its trap is in place; only then is the signal sent.
    let mut client = agent.client();
    let sender = client.signaller().unwrap();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
    let t = thread::spawn(move || {
        ready_rx
            .recv_timeout(Duration::from_secs(20))
            .expect("the shell never got ready");
        sender.signal(libc::SIGUSR1).unwrap();
    });
    let mut stdout = Vec::new();
    let exit = client
        .exec(
            &shell("trap 'echo got-usr1; exit 7' USR1; echo ready; sleep 30 & wait"),
            None::<Cursor<Vec<u8>>>,
            |b| {
                stdout.extend_from_slice(b);
                if stdout.starts_with(b"ready\n") {
                    let _ = ready_tx.send(());
                }
            },
            |_| {},
        )
        .unwrap();
    t.join().unwrap();
    assert_eq!(exit.exit_code, Some(7), "{exit:?}");
    assert_eq!(text(&stdout), "ready\ngot-usr1\n");
}

#[test]
fn dropped_connection_kills_the_program() {
    let agent = Agent::start();
    let pidfile = agent.path("pids");
    let mut s = agent.connect();
    assert!(matches!(
        read_message(&mut s).unwrap(),
        Some(Message::Hello(_))
    ));
    let cmd = format!("sleep 30 & echo $$ $! > {pidfile}; sleep 30");
    write_message(&mut s, &Message::Request(Request::Exec(shell(&cmd)))).unwrap();
    assert!(matches!(
        read_message(&mut s).unwrap(),
        Some(Message::Started(_))
    ));
    let pids = pids_in(&wait_for_file(&pidfile, Duration::from_secs(10)));
    drop(s);
    for pid in pids {
        assert!(
            wait_gone(pid, Duration::from_secs(3)),
            "{pid} survived the drop"
        );
    }
}

#[test]
fn exec_environment_user_and_cwd() {
    let agent = Agent::start();
    let out = agent.exec(&ExecRequest::argv(["env"]).with_env("FOO", "bar baz"));
    let env = text(&out.stdout);
    assert!(env.contains("FOO=bar baz\n"), "{env}");
    assert!(env.contains(&format!("PATH={DEFAULT_PATH}\n")), "{env}");
    assert!(env.contains("TERM=xterm\n"), "{env}");
    assert!(env.contains("HOME="), "{env}");

    let out = agent.exec(
        &ExecRequest::argv(["/usr/bin/env"])
            .with_clear_env(true)
            .with_env("ONLY", "me"),
    );
    assert_eq!(text(&out.stdout), "ONLY=me\n");

    let out = agent.exec(&ExecRequest::argv(["pwd"]).with_cwd(agent.path("hooks")));
    assert_eq!(text(&out.stdout).trim(), agent.path("hooks"));
    let out = agent.exec(&ExecRequest::argv(["pwd"]));
    assert_eq!(text(&out.stdout).trim(), "/");

    let e = agent
        .client()
        .exec_output(&ExecRequest::argv(["pwd"]).with_cwd("/no/such/dir"), None)
        .unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::NotFound), "{e}");
    let e = agent
        .client()
        .exec_output(
            &ExecRequest::argv(["id"]).with_user("no-such-user-xyz"),
            None,
        )
        .unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::NotFound), "{e}");
    assert!(e.to_string().contains("no such user"), "{e}");

    // SAFETY: getuid has no memory effects.
    if unsafe { libc::getuid() } == 0 {
        let out =
            agent.exec(&ExecRequest::shell("id -u; id -g; echo $HOME $USER").with_user("nobody"));
        assert!(out.exit.success(), "{:?} {}", out.exit, text(&out.stderr));
        let lines: Vec<&str> = text(&out.stdout).lines().collect();
        assert_eq!(lines[0], "65534");
        assert!(lines[2].ends_with(" nobody"), "{lines:?}");
        let out = agent.exec(&ExecRequest::argv(["id", "-u"]).with_user(4242u32));
        assert_eq!(text(&out.stdout).trim(), "4242");
    } else {
        // An unprivileged agent cannot switch users: the program is refused, with a reason.
        let out = agent.exec(&ExecRequest::argv(["id", "-u"]).with_user("nobody"));
        assert_eq!(out.exit.exit_code, Some(126), "{:?}", out.exit);
        assert!(out.exit.error.is_some());
    }
}

// ---------------------------------------------------------------------------------------
// Files

#[test]
fn write_and_read_round_trip() {
    let agent = Agent::start();
    let data = noise(3 << 20 | 12345, 3);
    let path = agent.path("deep/er/file.bin");
    let n = agent
        .client()
        .write_file(
            &path,
            &WriteFileOptions::default().mode(0o600).mkdirs(true),
            Cursor::new(data.clone()),
        )
        .unwrap();
    assert_eq!(n, data.len() as u64);
    let st = agent.client().stat(&path, true).unwrap();
    assert_eq!((st.file_type, st.size, st.mode), (FileType::File, n, 0o600));
    let mut back = Vec::new();
    let got = agent.client().read_file(&path, &mut back).unwrap();
    assert_eq!(got, n);
    assert_eq!(crc(&back), crc(&data));
    // The atomic write left no temporary file behind.
    let names: Vec<String> = agent
        .client()
        .list(&agent.path("deep/er"))
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(names, ["file.bin"]);

    // Non-atomic, over the existing file, with a mode the umask would mask.
    let n = agent
        .client()
        .write_file(
            &path,
            &WriteFileOptions::default().mode(0o666).atomic(false),
            &b"short"[..],
        )
        .unwrap();
    assert_eq!(n, 5);
    assert_eq!(fs::read(&path).unwrap(), b"short");
    assert_eq!(agent.client().stat(&path, true).unwrap().mode, 0o666);

    // Empty file.
    let empty = agent.path("empty");
    assert_eq!(
        agent
            .client()
            .write_file(&empty, &WriteFileOptions::default(), &b""[..])
            .unwrap(),
        0
    );
    assert_eq!(fs::metadata(&empty).unwrap().len(), 0);
    assert_eq!(agent.client().read_file(&empty, Vec::new()).unwrap(), 0);

    // Errors.
    let e = agent
        .client()
        .write_file(
            &agent.path("missing/dir/f"),
            &WriteFileOptions::default(),
            &b"x"[..],
        )
        .unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::NotFound), "{e}");
    let e = agent
        .client()
        .read_file(&agent.path("nope"), Vec::new())
        .unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::NotFound), "{e}");
    let e = agent
        .client()
        .read_file(&agent.path("deep"), Vec::new())
        .unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::Invalid), "{e}");
    let e = agent
        .client()
        .write_file("relative/path", &WriteFileOptions::default(), &b"x"[..])
        .unwrap_err();
    assert!(matches!(e, Error::InvalidRequest(_)), "{e}");
}

#[test]
fn large_write_is_streamed_intact() {
    let agent = Agent::start();
    let data = noise(40 << 20, 11);
    let path = agent.path("big");
    agent
        .client()
        .write_file(
            &path,
            &WriteFileOptions::default(),
            Cursor::new(data.clone()),
        )
        .unwrap();
    assert_eq!(crc(&fs::read(&path).unwrap()), crc(&data));
    let hwm = agent.vm_hwm_kib();
    assert!(
        hwm < 32 * 1024,
        "the agent's peak RSS is {hwm} KiB after a 40 MiB write"
    );
}

#[test]
fn stat_list_remove_mkdir() {
    let agent = Agent::start();
    let base = agent.path("tree");
    agent
        .client()
        .mkdir(&format!("{base}/a/b/c"), 0o750, true)
        .unwrap();
    let st = agent.client().stat(&format!("{base}/a/b/c"), true).unwrap();
    assert_eq!((st.file_type, st.mode), (FileType::Dir, 0o750));
    // mkdir -p of an existing directory is fine; plain mkdir is not.
    agent
        .client()
        .mkdir(&format!("{base}/a/b/c"), 0o700, true)
        .unwrap();
    let e = agent
        .client()
        .mkdir(&format!("{base}/a/b/c"), 0o700, false)
        .unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::Invalid), "{e}");
    let e = agent
        .client()
        .mkdir(&format!("{base}/x/y"), 0o700, false)
        .unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::NotFound), "{e}");

    fs::write(format!("{base}/a/file"), b"12345").unwrap();
    symlink("file", format!("{base}/a/link")).unwrap();
    let st = agent
        .client()
        .stat(&format!("{base}/a/link"), false)
        .unwrap();
    assert_eq!(st.file_type, FileType::Symlink);
    let st = agent
        .client()
        .stat(&format!("{base}/a/link"), true)
        .unwrap();
    assert_eq!((st.file_type, st.size), (FileType::File, 5));
    // SAFETY: getuid has no memory effects.
    assert_eq!(st.uid, unsafe { libc::getuid() });
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    assert!(
        (now_ms - st.mtime_ms).abs() < 60_000,
        "mtime {} vs now {now_ms}",
        st.mtime_ms
    );

    let entries = agent.client().list(&format!("{base}/a")).unwrap();
    let summary: Vec<(&str, FileType)> = entries
        .iter()
        .map(|e| (e.name.as_str(), e.file_type))
        .collect();
    assert_eq!(
        summary,
        [
            ("b", FileType::Dir),
            ("file", FileType::File),
            ("link", FileType::Symlink)
        ]
    );
    assert_eq!(entries[1].size, 5);

    // Enough entries to need several ENTRIES frames.
    let many = format!("{base}/many");
    fs::create_dir(&many).unwrap();
    for i in 0..3000 {
        fs::write(
            format!("{many}/entry-with-a-rather-long-name-to-fill-frames-{i:05}"),
            b"",
        )
        .unwrap();
    }
    let entries = agent.client().list(&many).unwrap();
    assert_eq!(entries.len(), 3000);
    assert!(entries.windows(2).all(|w| w[0].name < w[1].name));
    assert!(entries[2999].name.ends_with("02999"));

    let e = agent.client().list(&format!("{base}/nope")).unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::NotFound), "{e}");

    let e = agent
        .client()
        .remove(&format!("{base}/a"), false)
        .unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::Invalid), "{e}");
    assert!(e.to_string().contains("recursive"), "{e}");
    agent
        .client()
        .remove(&format!("{base}/a/link"), false)
        .unwrap();
    assert!(
        fs::metadata(format!("{base}/a/file")).is_ok(),
        "removing a link removed its target"
    );
    agent.client().remove(&format!("{base}/a"), true).unwrap();
    let e = agent
        .client()
        .stat(&format!("{base}/a"), false)
        .unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::NotFound), "{e}");
    let e = agent
        .client()
        .remove(&format!("{base}/a"), true)
        .unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::NotFound), "{e}");
    let e = agent.client().remove("/", true).unwrap_err();
    assert!(matches!(e, Error::InvalidRequest(_)), "{e}");
}

// ---------------------------------------------------------------------------------------
// refresh and identity

fn write_hook(dir: &Path, name: &str, body: &str, mode: u32) {
    fs::create_dir_all(dir).unwrap();
    let path = dir.join(name);
    fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
    fs::set_permissions(&path, fs::Permissions::from_mode(mode)).unwrap();
}

fn identity() -> Identity {
    Identity {
        name: "web-2".into(),
        index: Some(2),
        parent: Some("web".into()),
        generation: 3,
    }
}

#[test]
fn refresh_runs_hooks_and_sets_identity() {
    let agent = Agent::start_with(&["--hook-timeout-ms", "500"]);
    let hooks = agent.dir.join("hooks");
    let restore = hooks.join("on-restore.d");
    let fork = hooks.join("on-fork.d");
    write_hook(
        &restore,
        "10-env",
        "echo \"$MAYFLY_EVENT $MAYFLY_NAME $MAYFLY_INDEX $MAYFLY_PARENT $MAYFLY_GENERATION\"; echo to-stderr >&2",
        0o755,
    );
    write_hook(&restore, "20-fail", "echo failing; exit 3", 0o755);
    write_hook(&restore, "30-slow", "sleep 10", 0o755);
    write_hook(
        &restore,
        "40-loud",
        "head -c 100000 /dev/zero | tr '\\0' x",
        0o755,
    );
    write_hook(&restore, "50-not-executable", "exit 0", 0o644);
    write_hook(&restore, ".hidden", "exit 0", 0o755);
    write_hook(&fork, "10-fork", "echo fork-hook", 0o755);

    // Before any refresh: defaults named after the hostname.
    let id = agent.client().identity().unwrap();
    assert_eq!(
        (id.index, id.parent.as_deref(), id.generation),
        (None, None, 0)
    );
    assert!(!id.name.is_empty());

    let req = RefreshRequest::new(
        RefreshEvent::Fork,
        1_700_000_000_000_000_000,
        &[5u8; 64],
        "web-2",
        identity(),
    );
    let reply = agent.client().refresh(&req).unwrap();
    // --no-system-changes: nothing of the host was touched.
    assert!(!reply.clock_set && !reply.hostname_set);
    assert_eq!(reply.entropy_bytes, 0);
    let names: Vec<&str> = reply.hooks.iter().map(|h| h.name.as_str()).collect();
    assert_eq!(
        names,
        ["10-env", "20-fail", "30-slow", "40-loud", "10-fork"]
    );
    let h = &reply.hooks;
    assert_eq!(h[0].exit_code, Some(0));
    assert_eq!(h[0].output, "fork web-2 2 web 3\nto-stderr\n");
    assert_eq!(
        (h[1].exit_code, h[1].output.as_str()),
        (Some(3), "failing\n")
    );
    assert!(h[2].timed_out, "{:?}", h[2]);
    assert_eq!(h[2].signal, Some(libc::SIGTERM));
    assert_eq!(h[3].exit_code, Some(0));
    assert_eq!(h[3].output.len(), 4096, "output is capped at 4 KiB");
    assert_eq!(h[4].output, "fork-hook\n");

    assert_eq!(agent.client().identity().unwrap(), identity());
    let on_disk: Identity =
        serde_json::from_slice(&fs::read(agent.dir.join("run/identity.json")).unwrap()).unwrap();
    assert_eq!(on_disk, identity());

    // restore: only on-restore.d; boot: no hooks.
    let mut req = req;
    req.event = RefreshEvent::Restore;
    let reply = agent.client().refresh(&req).unwrap();
    assert_eq!(reply.hooks.len(), 4);
    assert!(reply.hooks[0].output.starts_with("restore "));
    req.event = RefreshEvent::Boot;
    assert!(agent.client().refresh(&req).unwrap().hooks.is_empty());
}

/// Sends one raw REQUEST payload and returns the answer.
fn raw_request(agent: &Agent, payload: &[u8]) -> Message {
    let mut s = agent.connect();
    assert!(matches!(
        read_message(&mut s).unwrap(),
        Some(Message::Hello(_))
    ));
    write_frame(&mut s, FrameType::Request, payload).unwrap();
    read_message(&mut s).unwrap().expect("an answer")
}

fn expect_error(msg: Message, code: ErrorCode) -> String {
    match msg {
        Message::Error(e) => {
            assert_eq!(e.code, code, "{}", e.error);
            e.error
        }
        other => panic!("expected ERROR {code}, got {other:?}"),
    }
}

#[test]
fn refresh_validates_what_the_host_sends() {
    let agent = Agent::start();
    let good = RefreshRequest::new(RefreshEvent::Fork, 1, &[1u8; 32], "ok", identity());
    let mut bad_host = serde_json::to_value(Request::Refresh(good.clone())).unwrap();
    bad_host["hostname"] = "not_a_label".into();
    let e = expect_error(
        raw_request(&agent, bad_host.to_string().as_bytes()),
        ErrorCode::Invalid,
    );
    assert!(e.contains("hostname"), "{e}");
    let mut short = serde_json::to_value(Request::Refresh(good)).unwrap();
    short["entropy"] = base64::encode(&[0u8; 8]).into();
    let e = expect_error(
        raw_request(&agent, short.to_string().as_bytes()),
        ErrorCode::Invalid,
    );
    assert!(e.contains("entropy"), "{e}");
}

// ---------------------------------------------------------------------------------------
// Robustness

/// Sends raw bytes after HELLO, expects ERROR `code`, then the connection's end.
fn expect_refusal(agent: &Agent, bytes: &[u8], code: ErrorCode) {
    let mut s = agent.connect();
    assert!(matches!(
        read_message(&mut s).unwrap(),
        Some(Message::Hello(_))
    ));
    s.write_all(bytes).unwrap();
    // Half-close, so a truncated frame is seen as truncated rather than awaited.
    s.shutdown(std::net::Shutdown::Write).unwrap();
    expect_error(read_message(&mut s).unwrap().expect("an ERROR frame"), code);
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty(), "more after the ERROR: {rest:?}");
}

#[test]
fn malformed_frames_close_only_that_connection() {
    let mut agent = Agent::start();
    let frame = |t: u8, p: &[u8]| {
        let mut v = ((p.len() + 1) as u32).to_be_bytes().to_vec();
        v.push(t);
        v.extend_from_slice(p);
        v
    };
    expect_refusal(&agent, &[0, 0, 0, 0], ErrorCode::Protocol);
    expect_refusal(&agent, &[0xff, 0xff, 0xff, 0xff, 2], ErrorCode::Protocol);
    expect_refusal(
        &agent,
        &((MAX_FRAME + 1) as u32).to_be_bytes(),
        ErrorCode::Protocol,
    );
    expect_refusal(&agent, &frame(0x42, b"{}"), ErrorCode::Protocol);
    expect_refusal(&agent, &[0, 0, 0, 100, 2, b'{'], ErrorCode::Protocol);
    expect_refusal(&agent, &frame(0x03, b"stdin first"), ErrorCode::Protocol);
    expect_refusal(&agent, &frame(0x02, b"{not json"), ErrorCode::Invalid);
    expect_refusal(
        &agent,
        &frame(0x02, br#"{"op":"exec","argvv":["ls"]}"#),
        ErrorCode::Invalid,
    );
    expect_refusal(
        &agent,
        &frame(0x02, br#"{"op":"exec","argv":"ls"}"#),
        ErrorCode::Invalid,
    );
    expect_refusal(
        &agent,
        &frame(0x02, br#"{"op":"launch_missiles"}"#),
        ErrorCode::Unsupported,
    );
    expect_refusal(
        &agent,
        &frame(0x02, br#"{"op":"stat","path":"/","x":1}"#),
        ErrorCode::Invalid,
    );
    // A frame that is not STDIN or SIGNAL while a program runs: refused, program killed.
    let mut s = agent.connect();
    read_message(&mut s).unwrap();
    write_message(
        &mut s,
        &Message::Request(Request::Exec(ExecRequest::argv(["sleep", "30"]))),
    )
    .unwrap();
    let pid = match read_message(&mut s).unwrap() {
        Some(Message::Started(st)) => st.pid,
        other => panic!("{other:?}"),
    };
    write_frame(&mut s, FrameType::Data, b"wrong").unwrap();
    expect_error(read_message(&mut s).unwrap().unwrap(), ErrorCode::Protocol);
    assert!(
        wait_gone(pid, Duration::from_secs(3)),
        "the program outlived the protocol error"
    );
    // A garbage length in the middle of an exec too.
    let mut s = agent.connect();
    read_message(&mut s).unwrap();
    write_message(
        &mut s,
        &Message::Request(Request::Exec(ExecRequest::argv(["sleep", "30"]))),
    )
    .unwrap();
    assert!(matches!(
        read_message(&mut s).unwrap(),
        Some(Message::Started(_))
    ));
    s.write_all(&[0, 0, 0, 0]).unwrap();
    expect_error(read_message(&mut s).unwrap().unwrap(), ErrorCode::Protocol);

    // The agent is still there, serving.
    agent.assert_alive();
    assert_eq!(agent.client().ping().unwrap().protocol, 1);
    let out = agent.exec(&ExecRequest::argv(["echo", "still here"]));
    assert_eq!(text(&out.stdout), "still here\n");
}

#[test]
fn connections_over_the_cap_get_busy() {
    let agent = Agent::start_with(&["--max-connections", "2"]);
    // Take both slots. The start-up probe's connection may still hold one for a moment,
    // so a busy answer here is retried.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut held: Vec<UnixStream> = Vec::new();
    while held.len() < 2 {
        let mut s = agent.connect();
        match read_message(&mut s).unwrap() {
            Some(Message::Hello(_)) => held.push(s),
            Some(Message::Error(e)) if e.code == ErrorCode::Busy && Instant::now() < deadline => {
                thread::sleep(Duration::from_millis(20))
            }
            other => panic!("expected HELLO, got {other:?}"),
        }
    }
    let e = agent.client().ping().unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::Busy), "{e}");
    held.pop();
    // The freed slot is usable once the agent notices the close.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match agent.client().ping() {
            Ok(_) => break,
            Err(e) if e.agent_code() == Some(ErrorCode::Busy) && Instant::now() < deadline => {
                thread::sleep(Duration::from_millis(20))
            }
            Err(e) => panic!("{e}"),
        }
    }
}
