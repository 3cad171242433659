//! The host side of exec and files, end to end, without a Linux guest: the real mayfly-agent
//! runs on this host (on a Unix socket, making no system changes), behind a stand-in for the
//! VM's vsock socket that answers `CONNECT <port>` as the vsock device does, and the real
//! control-socket server (mayfly-api) serves the guest routes through the VMM's (mayfly-vmm). `mayfly exec` and `mayfly cp`
//! are the real CLI. The guest tests (guest_agent.rs) run the same through a real VM.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use mayfly_api::{self as api, Action, ApiCall, ApiServer, Reply};
use mayfly_tests::guest::{mayfly_bin, TestDir};
use mayfly_vmm::guest::routes::Routes;

const TIMEOUT: Duration = Duration::from_secs(60);

/// A fake VM: the agent, the vsock stand-in, the control socket.
struct FakeVm {
    dir: TestDir,
    sock: PathBuf,
    agent: Child,
    paused: Arc<AtomicBool>,
    _server: ApiServer,
}

impl Drop for FakeVm {
    fn drop(&mut self) {
        let _ = self.agent.kill();
        let _ = self.agent.wait();
    }
}

fn agent_bin() -> PathBuf {
    let bin = mayfly_bin().with_file_name("mayfly-agent");
    assert!(
        bin.exists(),
        "no mayfly-agent at {}: build the workspace first (cargo build --release --workspace)",
        bin.display()
    );
    bin
}

/// Answers `CONNECT <port>\n` with `OK <n>\n` and joins the connection to the agent's socket.
fn vsock_stand_in(listener: UnixListener, agent: PathBuf) {
    for client in listener.incoming() {
        let Ok(client) = client else { continue };
        let agent = agent.clone();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(client.try_clone().unwrap());
            let mut line = String::new();
            if reader.read_line(&mut line).is_err() || line != "CONNECT 52\n" {
                return;
            }
            let Ok(upstream) = UnixStream::connect(&agent) else {
                return;
            };
            let mut client_w = client;
            if client_w.write_all(b"OK 1024\n").is_err() {
                return;
            }
            // Whatever the reader buffered past the line belongs to the agent.
            let buffered = reader.buffer().to_vec();
            let mut up_w = upstream.try_clone().unwrap();
            let mut up_r = upstream;
            let mut client_r = reader.into_inner();
            let down = std::thread::spawn(move || {
                let _ = std::io::copy(&mut up_r, &mut client_w);
                let _ = client_w.shutdown(std::net::Shutdown::Both);
            });
            let _ = up_w.write_all(&buffered);
            let _ = std::io::copy(&mut client_r, &mut up_w);
            let _ = up_w.shutdown(std::net::Shutdown::Write);
            let _ = down.join();
        });
    }
}

impl FakeVm {
    fn start(name: &str) -> FakeVm {
        let dir = TestDir::new(name);
        let agent_sock = dir.join("agent.sock");
        let agent = Command::new(agent_bin())
            .args(["--listen", &format!("unix:{}", agent_sock.display())])
            .args(["--no-system-changes", "--run-dir", &dir.arg("run")])
            .args(["--hooks-dir", &dir.arg("hooks")])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("mayfly-agent starts");
        let deadline = Instant::now() + TIMEOUT;
        while !agent_sock.exists() {
            assert!(Instant::now() < deadline, "the agent did not listen");
            std::thread::sleep(Duration::from_millis(10));
        }
        let vsock = dir.join("vm.vsock");
        let listener = UnixListener::bind(&vsock).unwrap();
        std::thread::spawn(move || vsock_stand_in(listener, agent_sock));

        let sock = dir.join("vm.sock");
        let paused = Arc::new(AtomicBool::new(false));
        let (events, calls) = mpsc::channel::<ApiCall>();
        let server = ApiServer::start(
            &sock,
            events,
            |call| call,
            Arc::new(Routes {
                vsock: Some(vsock.clone()),
                ..Routes::default()
            }),
        )
        .unwrap();
        let state = paused.clone();
        std::thread::spawn(move || {
            for call in calls {
                let reply = match call.action {
                    Action::Describe => Reply::ok(serde_json::json!({
                        "state": if state.load(Ordering::SeqCst) { "paused" } else { "running" },
                        "vsock": {"path": vsock, "guest_cid": 3},
                        "agent_refresh": "done",
                    })),
                    _ => Reply::error(501, "not in this test"),
                };
                call.respond(reply);
            }
        });
        FakeVm {
            dir,
            sock,
            agent,
            paused,
            _server: server,
        }
    }

    fn mayfly(&self, args: &[&str], stdin: &[u8]) -> std::process::Output {
        let mut child = Command::new(mayfly_bin())
            .args(args.iter().take(1))
            .args(["--sock", &self.sock.to_string_lossy()])
            .args(args.iter().skip(1))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut input = child.stdin.take().unwrap();
        let data = stdin.to_vec();
        let feeder = std::thread::spawn(move || {
            let _ = input.write_all(&data);
        });
        let out = wait_output(child, TIMEOUT);
        feeder.join().unwrap();
        out
    }

    fn http(
        &self,
        method: &str,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> (u16, serde_json::Value) {
        api::request_with_timeout(&self.sock, method, path, body.as_ref(), TIMEOUT)
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
    }

    /// A raw request; returns the whole response (head and body) as bytes.
    fn raw(&self, request: &[u8]) -> Vec<u8> {
        let mut stream = UnixStream::connect(&self.sock).unwrap();
        stream.set_read_timeout(Some(TIMEOUT)).unwrap();
        stream.write_all(request).unwrap();
        let mut out = Vec::new();
        stream.read_to_end(&mut out).unwrap();
        out
    }
}

/// Wait for `child`, reading its output meanwhile (a full pipe would stall it).
fn wait_output(mut child: Child, timeout: Duration) -> std::process::Output {
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = r.read_to_end(&mut buf);
            buf
        })
    };
    let stdout = drain(Box::new(child.stdout.take().unwrap()));
    let stderr = drain(Box::new(child.stderr.take().unwrap()));
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            panic!("the command did not finish within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    std::process::Output {
        status,
        stdout: stdout.join().unwrap(),
        stderr: stderr.join().unwrap(),
    }
}

/// The head and the de-chunked body of a chunked response.
fn dechunk(response: &[u8]) -> (String, Vec<u8>, bool) {
    let split = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a response head");
    let head = String::from_utf8_lossy(&response[..split]).into_owned();
    let mut rest = &response[split + 4..];
    let mut body = Vec::new();
    loop {
        let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") else {
            return (head, body, false);
        };
        let size = usize::from_str_radix(std::str::from_utf8(&rest[..eol]).unwrap(), 16).unwrap();
        rest = &rest[eol + 2..];
        if size == 0 {
            return (head, body, true);
        }
        body.extend_from_slice(&rest[..size]);
        rest = &rest[size + 2..];
    }
}

fn sha256(data: &[u8]) -> String {
    let mut child = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("sha256sum (coreutils) is installed");
    let mut input = child.stdin.take().unwrap();
    let data = data.to_vec();
    let feeder = std::thread::spawn(move || input.write_all(&data).unwrap());
    let out = child.wait_with_output().unwrap();
    feeder.join().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned()
}

#[test]
fn mayfly_exec_reports_what_the_command_did() {
    let vm = FakeVm::start("agent-exec");
    let out = vm.mayfly(
        &["exec", "--", "sh", "-c", "echo out; echo err >&2; exit 3"],
        b"",
    );
    assert_eq!(out.status.code(), Some(3));
    assert_eq!(out.stdout, b"out\n");
    assert_eq!(out.stderr, b"err\n");

    assert_eq!(
        vm.mayfly(&["exec", "--", "true"], b"").status.code(),
        Some(0)
    );
    assert_eq!(
        vm.mayfly(&["exec", "--", "false"], b"").status.code(),
        Some(1)
    );
    let killed = vm.mayfly(&["exec", "--", "sh", "-c", "kill -9 $$"], b"");
    assert_eq!(killed.status.code(), Some(128 + 9));

    let missing = vm.mayfly(&["exec", "--", "no-such-program-here"], b"");
    assert_eq!(missing.status.code(), Some(127));
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(stderr.contains("no-such-program-here"), "{stderr}");

    let echoed = vm.mayfly(&["exec", "--", "cat"], b"stdin reaches the command");
    assert_eq!(echoed.stdout, b"stdin reaches the command");

    let timed = vm.mayfly(&["exec", "--timeout", "300ms", "--", "sleep", "30"], b"");
    assert_eq!(timed.status.code(), Some(124));

    let env = vm.mayfly(
        &[
            "exec",
            "--env",
            "GREETING=hi there",
            "--cwd",
            "/tmp",
            "--shell",
            "--",
            "echo $GREETING; pwd",
        ],
        b"",
    );
    assert_eq!(String::from_utf8_lossy(&env.stdout), "hi there\n/tmp\n");

    let json = vm.mayfly(
        &["exec", "--json", "--", "sh", "-c", "printf x; exit 5"],
        b"",
    );
    assert_eq!(json.status.code(), Some(5));
    let record: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(record["exit"]["exit_code"], 5);
    assert_eq!(record["stdout"], "x");
    assert!(record["exit"]["wall_ms"].as_f64().unwrap() >= 0.0);
}

#[test]
fn sixty_four_mib_of_output_arrive_intact() {
    let vm = FakeVm::start("agent-bulk");
    let out = vm.mayfly(
        &[
            "exec",
            "--",
            "sh",
            "-c",
            "yes 'mayfly sixty-four mebibytes of output, checked end to end' | head -c 67108864",
        ],
        b"",
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.stdout.len(), 64 << 20);
    let local = Command::new("sh")
        .args([
            "-c",
            "yes 'mayfly sixty-four mebibytes of output, checked end to end' | head -c 67108864",
        ])
        .output()
        .unwrap();
    assert_eq!(sha256(&out.stdout), sha256(&local.stdout));
}

#[test]
fn twenty_execs_at_once() {
    let vm = Arc::new(FakeVm::start("agent-many"));
    let threads: Vec<_> = (0..20)
        .map(|i| {
            let vm = vm.clone();
            std::thread::spawn(move || {
                let (status, body) = vm.http(
                    "POST",
                    "/vm/exec",
                    Some(serde_json::json!({"shell": format!("sleep 0.2; echo {i}")})),
                );
                assert_eq!(status, 200, "{body}");
                assert_eq!(body["stdout"], format!("{i}\n"));
            })
        })
        .collect();
    let start = Instant::now();
    for t in threads {
        t.join().unwrap();
    }
    // Twenty 200 ms sleeps run side by side, not one after another (4 s).
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn exec_over_the_control_socket() {
    let vm = FakeVm::start("agent-http");
    let (status, body) = vm.http(
        "POST",
        "/vm/exec",
        Some(serde_json::json!({"argv": ["sh", "-c", "cat; echo e >&2; exit 2"], "stdin": "in"})),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["exit"]["exit_code"], 2);
    assert_eq!(body["stdout"], "in");
    assert_eq!(body["stderr"], "e\n");

    let (status, body) = vm.http("POST", "/vm/exec", Some(serde_json::json!({"argv": []})));
    assert_eq!(status, 400, "{body}");
    let (status, body) = vm.http(
        "POST",
        "/vm/exec",
        Some(serde_json::json!({"argv": ["x"], "nope": 1})),
    );
    assert_eq!(status, 400, "{body}");
    assert!(body["error"].as_str().unwrap().contains("nope"), "{body}");
    let (status, _) = vm.http("GET", "/vm/exec", None);
    assert_eq!(status, 405);

    // Not UTF-8: base64, nothing lost.
    let (_, body) = vm.http(
        "POST",
        "/vm/exec",
        Some(serde_json::json!({"shell": "printf '\\377\\376'"})),
    );
    assert_eq!(body["stdout_base64"], "//4=");

    // Streamed: NDJSON lines in a chunked body, ending with the exit record.
    let request = br#"{"shell": "echo one; echo two >&2; exit 7", "stream": true}"#;
    let response = vm.raw(
        &[
            format!(
                "POST /vm/exec HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n",
                request.len()
            )
            .as_bytes(),
            request,
        ]
        .concat(),
    );
    let (head, body, complete) = dechunk(&response);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("application/x-ndjson"), "{head}");
    assert!(complete, "the last chunk arrived");
    let lines: Vec<serde_json::Value> = body
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).unwrap())
        .collect();
    assert!(
        lines[0]["started"]["pid"].as_u64().unwrap() > 0,
        "{lines:?}"
    );
    assert!(lines.iter().any(|l| l["stdout"] == "one\n"), "{lines:?}");
    assert!(lines.iter().any(|l| l["stderr"] == "two\n"), "{lines:?}");
    assert_eq!(lines.last().unwrap()["exit"]["exit_code"], 7, "{lines:?}");

    // A paused VM's agent cannot answer: said at once.
    vm.paused.store(true, Ordering::SeqCst);
    let (status, body) = vm.http(
        "POST",
        "/vm/exec",
        Some(serde_json::json!({"argv": ["true"]})),
    );
    assert_eq!(status, 409, "{body}");
    let out = vm.mayfly(&["exec", "--", "true"], b"");
    assert_eq!(out.status.code(), Some(255));
    assert!(String::from_utf8_lossy(&out.stderr).contains("paused"));
    vm.paused.store(false, Ordering::SeqCst);
}

/// The marker process is gone within the bound.
fn wait_gone(marker: &str, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        let found = std::fs::read_dir("/proc").unwrap().flatten().any(|e| {
            std::fs::read(e.path().join("cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(marker))
                .unwrap_or(false)
        });
        if !found {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

#[test]
fn a_client_that_hangs_up_kills_its_command() {
    let vm = FakeVm::start("agent-hangup");
    for stream in [false, true] {
        let marker = format!("{}.{}", 4000 + std::process::id() % 1000, u8::from(stream));
        let body = serde_json::json!({"argv": ["sleep", marker], "stream": stream}).to_string();
        let mut conn = UnixStream::connect(&vm.sock).unwrap();
        conn.write_all(
            format!(
                "POST /vm/exec HTTP/1.1\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .unwrap();
        // Running: the command shows up.
        let deadline = Instant::now() + TIMEOUT;
        while wait_gone(&format!("sleep\0{marker}"), Duration::ZERO) {
            assert!(Instant::now() < deadline, "the command did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        drop(conn);
        assert!(
            wait_gone(&format!("sleep\0{marker}"), Duration::from_secs(10)),
            "stream={stream}: the command outlived its client"
        );
    }
}

#[test]
fn files_round_trip() {
    let vm = FakeVm::start("agent-files");
    let local = vm.dir.join("data.bin");
    let data: Vec<u8> = (0..(3 << 20) + 17)
        .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(&local, &data).unwrap();
    let guest_path = vm.dir.join("guest/sub/data.bin");
    let dst = format!("vm:{}", guest_path.display());
    let out = vm.mayfly(
        &[
            "cp",
            "--mode",
            "0640",
            "--mkdirs",
            &local.to_string_lossy(),
            &dst,
        ],
        b"",
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(std::fs::read(&guest_path).unwrap(), data);
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&guest_path).unwrap().permissions().mode() & 0o7777,
        0o640
    );

    let back = vm.dir.join("back.bin");
    let out = vm.mayfly(&["cp", &dst, &back.to_string_lossy()], b"");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(sha256(&std::fs::read(&back).unwrap()), sha256(&data));

    let out = vm.mayfly(&["cp", "vm:/no/such/file", &back.to_string_lossy()], b"");
    assert_eq!(out.status.code(), Some(255));
    assert_eq!(
        std::fs::read(&back).unwrap().len(),
        data.len(),
        "a failed copy keeps the old file"
    );

    // Through the control socket: PUT streams its body, GET answers chunked.
    let q = |p: &Path| {
        p.to_string_lossy()
            .bytes()
            .map(|b| match b {
                b'/' => "%2F".to_string(),
                b => (b as char).to_string(),
            })
            .collect::<String>()
    };
    let up = vm.dir.join("up.bin");
    let response = vm.raw(
        &[
            format!(
                "PUT /vm/files?path={}&mode=0600 HTTP/1.1\r\nContent-Length: {}\r\n\r\n",
                q(&up),
                data.len()
            )
            .as_bytes(),
            &data,
        ]
        .concat(),
    );
    let text = String::from_utf8_lossy(&response);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(
        text.contains(&format!("\"bytes\":{}", data.len())),
        "{text}"
    );
    assert_eq!(std::fs::read(&up).unwrap(), data);
    assert_eq!(
        std::fs::metadata(&up).unwrap().permissions().mode() & 0o7777,
        0o600
    );

    let response = vm.raw(format!("GET /vm/files?path={} HTTP/1.1\r\n\r\n", q(&up)).as_bytes());
    let (head, body, complete) = dechunk(&response);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(complete);
    assert_eq!(body, data);

    let (status, stat) = vm.http("GET", &format!("/vm/files/stat?path={}", q(&up)), None);
    assert_eq!(status, 200, "{stat}");
    assert_eq!(stat["size"], data.len());
    assert_eq!(stat["mode"], 0o600);
    assert_eq!(stat["type"], "file");

    let made = vm.dir.join("made/deep");
    let (status, body) = vm.http(
        "PUT",
        &format!("/vm/files/dir?path={}&parents=1", q(&made)),
        None,
    );
    assert_eq!(status, 204, "{body}");
    assert!(made.is_dir());
    let (status, list) = vm.http(
        "GET",
        &format!("/vm/files/list?path={}", q(&vm.dir.join("made"))),
        None,
    );
    assert_eq!(status, 200, "{list}");
    assert_eq!(list["entries"][0]["name"], "deep");
    assert_eq!(list["entries"][0]["type"], "dir");

    let (status, _) = vm.http("DELETE", &format!("/vm/files?path={}", q(&up)), None);
    assert_eq!(status, 204);
    assert!(!up.exists());
    let (status, body) = vm.http("GET", &format!("/vm/files/stat?path={}", q(&up)), None);
    assert_eq!(status, 404, "{body}");
    let (status, body) = vm.http("GET", "/vm/files", None);
    assert_eq!(status, 400, "{body}");
    assert!(body["error"].as_str().unwrap().contains("path"), "{body}");

    // An upload cut short leaves nothing behind: not a short file.
    let cut = vm.dir.join("cut.bin");
    let mut conn = UnixStream::connect(&vm.sock).unwrap();
    conn.write_all(
        format!(
            "PUT /vm/files?path={} HTTP/1.1\r\nContent-Length: 1000000\r\n\r\n",
            q(&cut)
        )
        .as_bytes(),
    )
    .unwrap();
    conn.write_all(&data[..1000]).unwrap();
    conn.shutdown(std::net::Shutdown::Write).unwrap();
    let mut answer = String::new();
    conn.set_read_timeout(Some(TIMEOUT)).unwrap();
    let _ = conn.read_to_string(&mut answer);
    assert!(!answer.starts_with("HTTP/1.1 200"), "{answer}");
    std::thread::sleep(Duration::from_millis(200));
    assert!(!cut.exists(), "a cut upload must not become a file");
}

#[test]
fn a_vm_without_an_agent_says_so() {
    let dir = TestDir::new("agent-none");
    // A vsock socket where nobody answers CONNECT (a guest without the agent closes at once).
    let vsock = dir.join("vm.vsock");
    let listener = UnixListener::bind(&vsock).unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            drop(conn);
        }
    });
    let sock = dir.join("vm.sock");
    let (events, calls) = mpsc::channel::<ApiCall>();
    let _server = ApiServer::start(
        &sock,
        events,
        |c| c,
        Arc::new(Routes {
            vsock: Some(vsock.clone()),
            ..Routes::default()
        }),
    )
    .unwrap();
    std::thread::spawn(move || {
        for call in calls {
            call.respond(Reply::ok(
                serde_json::json!({"state": "running", "vsock": {"path": vsock}}),
            ));
        }
    });
    let out = Command::new(mayfly_bin())
        .args([
            "exec",
            "--sock",
            &sock.to_string_lossy(),
            "--wait",
            "500ms",
            "--",
            "true",
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(255));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("mayfly-agent"), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "one clear line: {stderr}");
}

// ---------------------------------------------------------------------------------------
// A hostile guest: the VMM's side of the agent's connection, against an agent that stalls,
// floods or ignores its timeouts. The VMM is `mayfly-fake-vm` (the real control socket and
// guest routes, in a process of their own, so that its memory can be watched); the agent is
// played here, listening where the VM's vsock device would.

/// What the hostile agent does once it has a request.
#[derive(Clone, Copy, Debug)]
enum Hostile {
    /// Greets (HELLO), then never answers: it reads and discards what the host sends.
    Silent,
    /// Answers a list with ENTRIES frames without end (up to [`FLOOD_BYTES`]), a stat with a
    /// frame-sized OK, a read with a frame longer than the protocol allows.
    Flood,
    /// Starts an exec (STARTED), then ignores it, its timeout included.
    IgnoresTimeouts,
}

/// How much a flooding agent sends at most: far more than the VMM may keep.
const FLOOD_BYTES: u64 = 384 << 20;

/// What the stand-in agent saw.
#[derive(Default)]
struct Seen {
    /// Each connection's id and op, once its REQUEST came.
    requests: Vec<(u64, String)>,
    /// Connections the host closed (after their request, or before).
    closed: Vec<u64>,
    /// What a flood sent before the host stopped reading it.
    flooded: u64,
}

#[derive(Default)]
struct StandIn {
    seen: std::sync::Mutex<Seen>,
    changed: std::sync::Condvar,
}

impl StandIn {
    fn update(&self, f: impl FnOnce(&mut Seen)) {
        f(&mut self.seen.lock().unwrap());
        self.changed.notify_all();
    }

    /// Wait (up to `bound`) until `f` finds something in what was seen.
    fn wait_for<T>(&self, bound: Duration, mut f: impl FnMut(&Seen) -> Option<T>) -> Option<T> {
        let deadline = Instant::now() + bound;
        let mut seen = self.seen.lock().unwrap();
        loop {
            if let Some(found) = f(&seen) {
                return Some(found);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            seen = self.changed.wait_timeout(seen, left).unwrap().0;
        }
    }

    fn requests(&self) -> usize {
        self.seen.lock().unwrap().requests.len()
    }
}

/// One connection from the VMM, as a hostile agent serves it.
fn hostile_agent(mut conn: UnixStream, id: u64, how: Hostile, standin: &StandIn) {
    use mayfly_agent_protocol::{
        encode_frame, read_message, write_message, DirEntry, FileType, FrameType, Hello, ListReply,
        Message, ReadFileReply, Started, OPS, PROTOCOL_VERSION,
    };
    // The vsock device's handshake, then the agent's HELLO.
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.last() != Some(&b'\n') {
        match conn.read(&mut byte) {
            Ok(1) => line.push(byte[0]),
            _ => return,
        }
    }
    let hello = Message::Hello(Hello {
        protocol: PROTOCOL_VERSION,
        agent: "mayfly-agent hostile".into(),
        ops: OPS.iter().map(|op| op.to_string()).collect(),
    });
    let request = conn
        .write_all(b"OK 1024\n")
        .ok()
        .and_then(|()| write_message(&mut conn, &hello).ok())
        .and_then(|()| read_message(&mut conn).ok().flatten());
    let Some(Message::Request(request)) = request else {
        standin.update(|s| s.closed.push(id));
        return;
    };
    let op = request.op();
    standin.update(|s| s.requests.push((id, op.to_string())));
    match (how, op) {
        (Hostile::Flood, "list") => {
            let batch: Vec<DirEntry> = (0..3500)
                .map(|i| DirEntry {
                    name: format!("{i:0>200}"),
                    file_type: FileType::File,
                    size: 0,
                    mode: 0o644,
                    mtime_ms: 0,
                })
                .collect();
            let frame = Message::Entries(batch).encode().unwrap();
            let (mut sent, mut entries) = (0u64, 0u64);
            while sent < FLOOD_BYTES && conn.write_all(&frame).is_ok() {
                sent += frame.len() as u64;
                entries += 3500;
            }
            standin.update(|s| s.flooded = sent);
            let _ = write_message(
                &mut conn,
                &Message::ok(&ListReply { count: entries }).unwrap(),
            );
        }
        (Hostile::Flood, "stat") => {
            // A whole frame of JSON that is no stat: `[0,0,0,...]`.
            let mut json = vec![b'['];
            while json.len() < mayfly_agent_protocol::MAX_PAYLOAD - 2 {
                json.extend_from_slice(b"0,");
            }
            json.pop();
            json.push(b']');
            let _ = conn.write_all(&encode_frame(FrameType::Ok, &json).unwrap());
        }
        (Hostile::Flood, "read_file") => {
            let ok = Message::ok(&ReadFileReply {
                size: 1 << 40,
                mode: 0o644,
            })
            .unwrap();
            let _ = write_message(&mut conn, &ok);
            // A DATA frame announced at 4 GiB.
            let _ = conn.write_all(&[0xff, 0xff, 0xff, 0xff, 0x0a]);
        }
        (Hostile::IgnoresTimeouts, "exec") => {
            let _ = write_message(&mut conn, &Message::Started(Started { pid: 7 }));
        }
        _ => {}
    }
    // Then silence: whatever the host sends is read and dropped, until it closes.
    let mut buf = vec![0u8; 64 << 10];
    while matches!(conn.read(&mut buf), Ok(n) if n > 0) {}
    standin.update(|s| s.closed.push(id));
}

/// A VMM (`mayfly-fake-vm`) whose guest's agent is hostile.
struct HostileVm {
    dir: TestDir,
    sock: PathBuf,
    vmm: Child,
    standin: Arc<StandIn>,
}

impl Drop for HostileVm {
    fn drop(&mut self) {
        let _ = self.vmm.kill();
        let _ = self.vmm.wait();
    }
}

impl HostileVm {
    fn start(name: &str, how: Hostile) -> HostileVm {
        let dir = TestDir::new(name);
        let vsock = dir.join("vm.vsock");
        let listener = UnixListener::bind(&vsock).unwrap();
        let standin = Arc::new(StandIn::default());
        let agent = standin.clone();
        std::thread::spawn(move || {
            for (id, conn) in (0u64..).zip(listener.incoming()) {
                let Ok(conn) = conn else { continue };
                let agent = agent.clone();
                std::thread::spawn(move || hostile_agent(conn, id, how, &agent));
            }
        });
        let sock = dir.join("vm.sock");
        let mut vmm = Command::new(env!("CARGO_BIN_EXE_mayfly-fake-vm"))
            .args([
                "--sock",
                &dir.arg("vm.sock"),
                "--vsock",
                &dir.arg("vm.vsock"),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("mayfly-fake-vm starts");
        let mut ready = String::new();
        BufReader::new(vmm.stdout.take().unwrap())
            .read_line(&mut ready)
            .unwrap();
        assert_eq!(ready, "ready\n", "mayfly-fake-vm did not start");
        HostileVm {
            dir,
            sock,
            vmm,
            standin,
        }
    }

    fn http(
        &self,
        method: &str,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> (u16, serde_json::Value) {
        api::request_with_timeout(&self.sock, method, path, body.as_ref(), TIMEOUT)
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
    }

    /// A request sent whole, its connection left open for the answer.
    fn send(&self, request: &[u8]) -> UnixStream {
        let mut conn = UnixStream::connect(&self.sock).unwrap();
        conn.write_all(request).unwrap();
        conn
    }

    /// The VMM's `field` of /proc/PID/status, in KiB (VmRSS, VmHWM).
    fn status_kib(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.vmm.id())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or_else(|| panic!("no {field} in {status}"))
    }

    /// Wait until the agent saw a new request of `op` (after the first `after` requests).
    fn request_of(&self, op: &str, after: usize) -> u64 {
        self.standin
            .wait_for(TIMEOUT, |s| {
                s.requests[after.min(s.requests.len())..]
                    .iter()
                    .find(|(_, o)| o == op)
                    .map(|(id, _)| *id)
            })
            .unwrap_or_else(|| panic!("the agent never got the {op}"))
    }

    /// Whether the VMM closed connection `id` to the agent within `bound`.
    fn closed_within(&self, id: u64, bound: Duration) -> bool {
        self.standin
            .wait_for(bound, |s| s.closed.contains(&id).then_some(()))
            .is_some()
    }
}

/// The whole answer on `conn`: status, head, body (de-chunked if chunked).
fn answer(mut conn: UnixStream) -> (u16, String, Vec<u8>) {
    conn.set_read_timeout(Some(TIMEOUT)).unwrap();
    let mut raw = Vec::new();
    conn.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw);
    let status = text
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP status in {text:?}"));
    if text.contains("Transfer-Encoding: chunked") {
        let (head, body, _) = dechunk(&raw);
        return (status, head, body);
    }
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    (
        status,
        String::from_utf8_lossy(&raw[..split]).into_owned(),
        raw[split + 4..].to_vec(),
    )
}

#[test]
fn an_agent_that_never_answers_gets_the_deadline_error() {
    let vm = HostileVm::start("agent-deadline", Hostile::Silent);
    for (path, what) in [
        ("/vm/files/stat?path=%2Fx&timeout_ms=1500", "the stat of /x"),
        (
            "/vm/files/list?path=%2Fx&timeout_ms=1500",
            "the listing of /x",
        ),
        ("/vm/files?path=%2Fx&timeout_ms=1500", "the download of /x"),
    ] {
        let (status, body) = vm.http("GET", path, None);
        assert_eq!(status, 504, "GET {path}: {body}");
        let message = body["error"].as_str().unwrap();
        assert!(
            message.contains(&format!("did not finish {what} within 1.5 s")),
            "{message}"
        );
        // It says what to do.
        assert!(message.contains("timeout_ms"), "{message}");
        assert!(message.contains("GET /vm/agent"), "{message}");
    }
    // And each time the VMM closed its connection to the agent.
    assert!(
        vm.standin
            .wait_for(TIMEOUT, |s| (s.closed.len() >= 3).then_some(()))
            .is_some(),
        "the VMM kept connections it had given up on"
    );
    // A deadline the VMM does not allow is refused before the guest is asked.
    for bad in ["0", "600001", "soon"] {
        let (status, body) = vm.http(
            "GET",
            &format!("/vm/files/stat?path=%2Fx&timeout_ms={bad}"),
            None,
        );
        assert_eq!(status, 400, "{body}");
        assert!(body["error"].as_str().unwrap().contains("600000"), "{body}");
    }
    assert_eq!(vm.standin.requests(), 3);
}

#[test]
fn control_actions_get_through_while_guest_calls_stall() {
    let vm = HostileVm::start("agent-lane", Hostile::Silent);
    // As many stalled guest calls as the control socket takes connections (64): before the
    // guest lane, they took every connection, and pause or snapshot got 503.
    let mut calls: Vec<Option<UnixStream>> = (0..api::MAX_CONNECTIONS)
        .map(|_| Some(vm.send(b"GET /vm/files/stat?path=%2Fstalled HTTP/1.1\r\n\r\n")))
        .collect();
    for call in calls.iter().flatten() {
        call.set_nonblocking(true).unwrap();
    }
    // Each is either with the agent (where it stalls) or answered: wait until all are one or
    // the other.
    let mut answers: Vec<Vec<u8>> = Vec::new();
    let deadline = Instant::now() + TIMEOUT;
    while answers.len() + vm.standin.requests() < api::MAX_CONNECTIONS {
        assert!(
            Instant::now() < deadline,
            "of {} guest calls, {} reached the agent and {} were answered",
            api::MAX_CONNECTIONS,
            vm.standin.requests(),
            answers.len()
        );
        for slot in calls.iter_mut() {
            let Some(conn) = slot else { continue };
            let mut buf = [0u8; 4096];
            match conn.read(&mut buf) {
                Ok(0) => *slot = None,
                Ok(n) => {
                    // Small enough to come whole; the close follows.
                    answers.push(buf[..n].to_vec());
                    *slot = None;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => panic!("{e}"),
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    // Meanwhile the control actions are served.
    let (status, body) = vm.http("GET", "/vm", None);
    assert_eq!(status, 200, "{body}");
    let (status, body) = vm.http("PUT", "/vm/pause", None);
    assert_eq!(status, 204, "{body}");
    let snap = vm.dir.join("snap");
    let (status, body) = vm.http(
        "PUT",
        "/vm/snapshot",
        Some(serde_json::json!({ "path": snap })),
    );
    assert_eq!(status, 200, "{body}");
    let (status, body) = vm.http("PUT", "/vm/resume", None);
    assert_eq!(status, 204, "{body}");
    // The guest lane took MAX_GUEST_CALLS of them to the agent; every other was answered at
    // once: 503, retry in a second.
    assert_eq!(vm.standin.requests(), api::MAX_GUEST_CALLS);
    assert_eq!(answers.len(), api::MAX_CONNECTIONS - api::MAX_GUEST_CALLS);
    for answer in &answers {
        let text = String::from_utf8_lossy(answer);
        assert!(text.starts_with("HTTP/1.1 503"), "{text}");
        assert!(text.contains("Retry-After: 1\r\n"), "{text}");
        assert!(text.contains("control actions"), "{text}");
    }
    // The stalled calls still hold their places; their clients leaving ends them all.
    let stalled = calls.iter().flatten().count();
    assert_eq!(stalled, api::MAX_GUEST_CALLS);
    drop(calls);
    assert!(
        vm.standin
            .wait_for(TIMEOUT, |s| (s.closed.len() == api::MAX_GUEST_CALLS)
                .then_some(()))
            .is_some(),
        "the stalled calls outlived their clients"
    );
    // And the lane is free again.
    let conn = vm.send(b"GET /vm/files/stat?path=%2Fagain HTTP/1.1\r\n\r\n");
    vm.request_of("stat", api::MAX_GUEST_CALLS);
    drop(conn);
}

#[test]
fn a_client_that_hangs_up_ends_its_call_into_the_guest() {
    let vm = HostileVm::start("agent-hostile-hangup", Hostile::Silent);
    let exec = br#"{"argv": ["sleep", "600"]}"#;
    let streamed = br#"{"argv": ["sleep", "600"], "stream": true}"#;
    let post = |body: &[u8]| {
        [
            format!(
                "POST /vm/exec HTTP/1.1\r\nContent-Length: {}\r\n\r\n",
                body.len()
            )
            .as_bytes(),
            body,
        ]
        .concat()
    };
    let calls: Vec<(&str, Vec<u8>)> = vec![
        (
            "stat",
            b"GET /vm/files/stat?path=%2Fx HTTP/1.1\r\n\r\n".to_vec(),
        ),
        (
            "list",
            b"GET /vm/files/list?path=%2Fx HTTP/1.1\r\n\r\n".to_vec(),
        ),
        (
            "read_file",
            b"GET /vm/files?path=%2Fx HTTP/1.1\r\n\r\n".to_vec(),
        ),
        (
            "write_file",
            b"PUT /vm/files?path=%2Fx HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello".to_vec(),
        ),
        (
            "remove",
            b"DELETE /vm/files?path=%2Fx HTTP/1.1\r\n\r\n".to_vec(),
        ),
        (
            "mkdir",
            b"PUT /vm/files/dir?path=%2Fx HTTP/1.1\r\n\r\n".to_vec(),
        ),
        ("exec", post(exec)),
        ("exec", post(streamed)),
    ];
    for (op, request) in calls {
        let before = vm.standin.requests();
        let conn = vm.send(&request);
        let id = vm.request_of(op, before);
        drop(conn);
        // Far within the call's own limits (a minute; 30 s for an exec to start): only the
        // hang-up can have ended it.
        assert!(
            vm.closed_within(id, Duration::from_secs(5)),
            "{op}: the VMM kept its call into the guest after the client hung up"
        );
    }
}

#[test]
fn a_flood_from_the_guest_is_cut_and_the_vmm_stays_small() {
    let vm = HostileVm::start("agent-flood", Hostile::Flood);
    let (status, _) = vm.http("GET", "/vm", None);
    assert_eq!(status, 200);
    let before = vm.status_kib("VmRSS");

    // A listing without end: cut at the VMM's bound, said so.
    let (status, body) = vm.http("GET", "/vm/files/list?path=%2Fflood", None);
    assert_eq!(status, 200, "{}", body["error"]);
    assert_eq!(body["truncated"], true);
    let entries = body["entries"].as_array().unwrap();
    assert!(
        !entries.is_empty() && entries.len() <= 100_000,
        "{}",
        entries.len()
    );
    assert!(body["count"].as_u64().unwrap() >= entries.len() as u64);
    let names: Vec<&str> = entries
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert!(names.windows(2).all(|w| w[0] <= w[1]), "sorted by name");
    let flooded = vm
        .standin
        .wait_for(TIMEOUT, |s| (s.flooded > 0).then_some(s.flooded))
        .unwrap();
    assert!(
        flooded < FLOOD_BYTES,
        "the VMM read all {flooded} bytes of the flood"
    );

    // A frame-sized OK that is no stat: refused, never held as a JSON tree.
    let (status, body) = vm.http("GET", "/vm/files/stat?path=%2Fhuge", None);
    assert_eq!(status, 502, "{body}");
    // A frame announced past the protocol's limit: refused before anything is read.
    let (status, body) = vm.http("GET", "/vm/files?path=%2Fhuge", None);
    assert_eq!(status, 502, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("exceeds the maximum"),
        "{body}"
    );

    let peak = vm.status_kib("VmHWM");
    let grown = peak.saturating_sub(before);
    eprintln!("the VMM: {before} KiB before the flood, {peak} KiB at its peak");
    assert!(
        grown < 48 << 10,
        "the VMM grew by {} MiB while its guest flooded it ({before} KiB before, {peak} KiB peak)",
        grown >> 10
    );
}

#[test]
fn an_exec_whose_guest_ignores_its_timeout_is_ended_by_the_host() {
    let vm = HostileVm::start("agent-overrun", Hostile::IgnoresTimeouts);
    let body = br#"{"argv": ["sleep", "600"], "timeout_ms": 300, "stream": true}"#;
    let streamed = vm.send(
        &[
            format!(
                "POST /vm/exec HTTP/1.1\r\nContent-Length: {}\r\n\r\n",
                body.len()
            )
            .as_bytes(),
            body,
        ]
        .concat(),
    );
    let streamed = std::thread::spawn(move || answer(streamed));
    let (status, body) = vm.http(
        "POST",
        "/vm/exec",
        Some(serde_json::json!({"argv": ["sleep", "600"], "timeout_ms": 300})),
    );
    assert_eq!(status, 504, "{body}");
    let message = body["error"].as_str().unwrap();
    assert!(
        message.contains("timeout_ms (300 ms) passed 10 s ago"),
        "{message}"
    );
    let (status, head, body) = streamed.join().unwrap();
    assert_eq!(status, 200, "{head}");
    let last: serde_json::Value = serde_json::from_slice(
        body.split(|b| *b == b'\n')
            .rfind(|l| !l.is_empty())
            .expect("NDJSON lines"),
    )
    .unwrap();
    assert!(
        last["error"]
            .as_str()
            .is_some_and(|e| e.contains("timeout_ms (300 ms)")),
        "{last}"
    );
    // Both connections to the agent closed: the agent is told to kill what it ignored.
    assert!(
        vm.standin
            .wait_for(TIMEOUT, |s| (s.closed.len() == 2).then_some(()))
            .is_some(),
        "the VMM kept the overrun execs' connections"
    );
}
