//! `mayfly serve` from a test: a manager on a state directory of the test's, and requests to
//! it with a bearer token.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::guest::{Guest, TestDir};
use crate::probe;

/// One request to the manager, with `token` (if any) as its bearer: status and JSON body.
pub fn call(
    sock: &Path,
    token: Option<&str>,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut stream = UnixStream::connect(sock).unwrap_or_else(|e| panic!("connect {sock:?}: {e}"));
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = Vec::new();
    stream.read_to_end(&mut response).unwrap();
    let text = String::from_utf8_lossy(&response);
    let (head, rest) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no head in {text:?}"));
    let status: u16 = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let value = serde_json::from_str(rest.trim()).unwrap_or(Value::String(rest.to_string()));
    (status, value)
}

pub struct Manager {
    pub process: Guest,
    pub sock: PathBuf,
    pub state: PathBuf,
    pub admin: String,
}

impl Manager {
    pub fn start(dir: &TestDir) -> Manager {
        Manager::start_with(dir, &[])
    }

    /// A manager with more `mayfly serve` options. Its images directories (where the files
    /// a create names must be) are the test's directory and the probe guest's.
    pub fn start_with(dir: &TestDir, extra: &[&str]) -> Manager {
        let sock = dir.join("m.sock");
        let state = dir.join("state");
        let (state_arg, sock_arg) = (state.to_string_lossy(), sock.to_string_lossy());
        let probe_dir = Path::new(probe::ELF)
            .parent()
            .expect("the probe is in a directory")
            .to_string_lossy()
            .into_owned();
        let test_dir = dir.0.to_string_lossy().into_owned();
        let mut args = vec![
            "serve",
            "--state-dir",
            &state_arg,
            "--sock",
            &sock_arg,
            "--images-dir",
            &test_dir,
            "--images-dir",
            &probe_dir,
        ];
        args.extend_from_slice(extra);
        let process = Guest::start(&args);
        assert!(
            process.wait_stderr("\"event\":\"serving\"", Duration::from_secs(30)),
            "the manager did not start: {}",
            process.stderr()
        );
        let admin = std::fs::read_to_string(state.join("admin.token"))
            .unwrap()
            .trim()
            .to_string();
        Manager {
            process,
            sock,
            state,
            admin,
        }
    }

    pub fn admin(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        call(&self.sock, Some(&self.admin), method, path, body)
    }

    /// Create a sandbox from `spec` (with its name); returns its token.
    pub fn create(&self, spec: Value) -> String {
        let (status, body) = self.admin("POST", "/sandboxes", Some(spec));
        assert_eq!(status, 201, "{body}");
        assert_eq!(body["state"], "running", "{body}");
        body["token"].as_str().expect("a token").to_string()
    }

    /// Create a probe sandbox; returns its token.
    pub fn create_probe(&self, name: &str, idle_timeout_s: Option<u64>) -> String {
        let mut spec = json!({
            "name": name,
            "kernel": probe::ELF,
            "mem_mib": 64,
            "cmdline": "touch=1",
            "probe": true,
        });
        if let Some(idle) = idle_timeout_s {
            spec["idle_timeout_s"] = json!(idle);
        }
        let (status, body) = self.admin("POST", "/sandboxes", Some(spec));
        assert_eq!(status, 201, "{body}");
        assert_eq!(body["state"], "running", "{body}");
        body["token"].as_str().expect("a token").to_string()
    }

    /// `PUT /sandboxes/NAME/ACTION` (`pause` or `resume`) that must answer 200 with the
    /// sandbox in `state`.
    pub fn put_to(&self, name: &str, action: &str, state: &str) {
        let (status, body) = self.admin("PUT", &format!("/sandboxes/{name}/{action}"), None);
        assert_eq!(
            (status, body["state"].as_str()),
            (200, Some(state)),
            "{body}"
        );
    }

    pub fn describe(&self, name: &str) -> Value {
        let (status, body) = self.admin("GET", &format!("/sandboxes/{name}"), None);
        assert_eq!(status, 200, "{body}");
        body
    }

    pub fn wait_state(&self, name: &str, state: &str, timeout: Duration) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let body = self.describe(name);
            if body["state"] == state {
                return body;
            }
            assert!(
                Instant::now() < deadline,
                "{name} never became {state}: {body}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn vmm_log(&self, name: &str) -> String {
        std::fs::read_to_string(self.state.join("sandboxes").join(name).join("vmm.log"))
            .unwrap_or_default()
    }

    /// Wait until the probe in sandbox `name` has made `n` reports of `kind` (`waiting`: it
    /// has written its pages and may be snapshotted; `verified`: a restore found them all).
    /// Its VMM log is kept across wakes; a corrupt page fails at once.
    pub fn wait_probe(&self, name: &str, kind: &str, n: usize) {
        let deadline = Instant::now() + probe::TIMEOUT;
        let needle = format!("mayfly-probe: {kind} ");
        loop {
            let log = self.vmm_log(name);
            assert!(!log.contains("mayfly-probe: corrupt"), "{name}: {log}");
            if log.matches(&needle).count() >= n {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{name}: no {kind} report #{n}: {log}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn events(&self, event: &str, name: &str) -> usize {
        self.event_lines(event, name).len()
    }

    /// The life-cycle events `event` of sandbox `name`, in order.
    pub fn event_lines(&self, event: &str, name: &str) -> Vec<Value> {
        let text = std::fs::read_to_string(self.state.join("events.jsonl")).unwrap();
        text.lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|e| e["event"] == event && e["sandbox"] == name)
            .collect()
    }
}

impl Drop for Manager {
    /// The sandboxes' VMMs outlive their manager by design: a test that failed half-way ends
    /// the ones it left.
    fn drop(&mut self) {
        let Ok(entries) = std::fs::read_dir(self.state.join("sandboxes")) else {
            return;
        };
        for entry in entries.flatten() {
            let record: Value = std::fs::read(entry.path().join("sandbox.json"))
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
                .unwrap_or_default();
            if let Some(pid) = record["pid"]
                .as_u64()
                .and_then(|p| libc::pid_t::try_from(p).ok())
            {
                // SAFETY: kill(2) of a VMM this test's manager started (best effort).
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }
}

/// Serve the manager's socket `sock` on a loopback TCP port too (for clients that speak only
/// TCP, such as schemathesis): each connection is relayed both ways to a connection of its own
/// to `sock`, on threads that live as long as the test. Returns the address it listens on.
pub fn tcp_forwarder(sock: &Path) -> std::net::SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a loopback port");
    let addr = listener.local_addr().unwrap();
    let sock = sock.to_path_buf();
    std::thread::spawn(move || {
        for client in listener.incoming().flatten() {
            let sock = sock.clone();
            std::thread::spawn(move || {
                let Ok(manager) = UnixStream::connect(&sock) else {
                    return;
                };
                let (Ok(mut from_client), Ok(mut to_client)) =
                    (client.try_clone(), client.try_clone())
                else {
                    return;
                };
                let Ok(mut to_manager) = manager.try_clone() else {
                    return;
                };
                let upstream = std::thread::spawn(move || {
                    let _ = std::io::copy(&mut from_client, &mut to_manager);
                    let _ = to_manager.shutdown(std::net::Shutdown::Write);
                });
                let _ = std::io::copy(&mut &manager, &mut to_client);
                let _ = client.shutdown(std::net::Shutdown::Both);
                let _ = manager.shutdown(std::net::Shutdown::Both);
                let _ = upstream.join();
            });
        }
    });
    addr
}

pub fn alive(pid: u64) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .contains(") Z")
}
