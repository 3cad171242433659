//! Drive a `mayfly` process from a test: start it, wait for what the guest prints, type
//! commands into its serial console and read their output, and collect how it ended.
//!
//! Timeouts here only stop a hung test; they are not performance assertions.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// The readiness line the default guest prints once it is up.
pub const READY: &str = "mayfly-guest: ready";

/// Generous bound for a boot inside the emulated test rig.
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(120);
/// Bound for one shell command to answer.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);

/// The `mayfly` binary built beside this program (`target/<profile>/mayfly`, for a test in
/// `target/<profile>/deps/` or a benchmark in `target/<profile>/`), or `MAYFLY_BIN`.
pub fn mayfly_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("MAYFLY_BIN") {
        return PathBuf::from(path);
    }
    let exe = std::env::current_exe().expect("the program knows its own path");
    let candidates: Vec<PathBuf> = exe
        .ancestors()
        .skip(1)
        .take(2)
        .map(|dir| dir.join("mayfly"))
        .collect();
    candidates
        .iter()
        .find(|bin| bin.exists())
        .cloned()
        .unwrap_or_else(|| {
            panic!(
                "no mayfly binary at {candidates:?}: build it first (cargo build --release -p mayfly-vmm) or set MAYFLY_BIN"
            )
        })
}

/// Run a mayfly command to its end (a client command such as `pause`, or a restore that must
/// fail), with a bound on how long it may take.
pub fn mayfly_output(args: &[&str], timeout: Duration) -> std::process::Output {
    let mut child = Command::new(mayfly_bin())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mayfly starts");
    let deadline = Instant::now() + timeout;
    while child.try_wait().expect("wait for mayfly").is_none() {
        if Instant::now() >= deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "mayfly {args:?} did not finish within {timeout:?}\n--- stdout ---\n{}\n--- stderr ---\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("collect mayfly's output")
}

/// How long a client command (`mayfly snapshot`, `fork`, `net`, ...) may take in [`mayfly_ok`].
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(180);

/// Run a mayfly client command that must succeed (within [`CLIENT_TIMEOUT`]); its stdout.
pub fn mayfly_ok(args: &[&str]) -> String {
    let out = mayfly_output(args, CLIENT_TIMEOUT);
    assert!(
        out.status.success(),
        "mayfly {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// One request to a VM's control socket that must get an answer (within 60 s): its status and
/// JSON body.
pub fn request(
    sock: &Path,
    method: &str,
    path: &str,
    body: Option<serde_json::Value>,
) -> (u16, serde_json::Value) {
    mayfly_api::request_with_timeout(sock, method, path, body.as_ref(), Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

/// A directory for one test, removed when dropped.
pub struct TestDir(pub PathBuf);

impl TestDir {
    pub fn new(name: &str) -> Self {
        Self::new_in(&std::env::temp_dir(), name)
    }

    /// A test directory under `base` rather than the temp directory.
    pub fn new_in(base: &Path, name: &str) -> Self {
        let path = base.join(format!("mayfly-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("create the test directory");
        TestDir(path)
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// A path as a &str, for command lines.
    pub fn arg(&self, name: &str) -> String {
        self.join(name).to_string_lossy().into_owned()
    }
}

impl Drop for TestDir {
    /// Removed unless `MAYFLY_TEST_KEEP` is set (to look at a failed test's snapshots).
    fn drop(&mut self) {
        if std::env::var_os("MAYFLY_TEST_KEEP").is_none() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// The console of a VM that runs detached (a fork's clone): input through a FIFO, output in a
/// log file.
pub struct FileConsole {
    pub input: PathBuf,
    pub log: PathBuf,
    /// The VMM, asked for a state dump (into the log) when a command gets no answer.
    pub pid: Option<u32>,
    commands: u32,
}

impl FileConsole {
    pub fn new(input: impl Into<PathBuf>, log: impl Into<PathBuf>) -> Self {
        Self {
            input: input.into(),
            log: log.into(),
            pid: None,
            commands: 0,
        }
    }

    /// Type into the console.
    pub fn send(&self, text: &str) {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        // Non-blocking: a FIFO nobody reads (the VM is gone) must fail, not hang.
        let mut fifo = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&self.input)
            .unwrap_or_else(|e| {
                panic!(
                    "cannot type into {} ({e}): is the VM gone? Its log:\n{}",
                    self.input.display(),
                    String::from_utf8_lossy(&std::fs::read(&self.log).unwrap_or_default())
                )
            });
        fifo.write_all(text.as_bytes())
            .expect("write to the console FIFO");
    }

    /// Run a shell command and return its output, as [`Guest::run`] does.
    pub fn run(&mut self, command: &str) -> String {
        self.commands += 1;
        let n = self.commands;
        let start = std::fs::metadata(&self.log)
            .map(|m| usize::try_from(m.len()).unwrap_or(usize::MAX))
            .unwrap_or(0);
        self.send(&format!(
            "echo '@@beg''in-{n}@@'; {command} 2>&1; echo '@@en''d-{n}@@'\n"
        ));
        let (begin, end) = (format!("@@begin-{n}@@"), format!("@@end-{n}@@"));
        let deadline = Instant::now() + COMMAND_TIMEOUT;
        loop {
            let text = std::fs::read(&self.log).unwrap_or_default();
            let text = String::from_utf8_lossy(&text[start.min(text.len())..]).into_owned();
            if let Some(b) = text.find(&begin) {
                if let Some(e) = text[b..].find(&end) {
                    return without_agent_log(&text[b + begin.len()..b + e]);
                }
            }
            if Instant::now() >= deadline {
                if let Some(pid) = self.pid {
                    // SAFETY: kill(2) asking the VMM for a state dump on its stderr (the log).
                    unsafe {
                        libc::kill(libc::pid_t::try_from(pid).expect("a pid"), libc::SIGUSR1)
                    };
                    std::thread::sleep(Duration::from_secs(2));
                }
                let all = String::from_utf8_lossy(&std::fs::read(&self.log).unwrap_or_default())
                    .into_owned();
                panic!(
                    "{command:?} got no answer within {COMMAND_TIMEOUT:?}; {} holds:\n{all}",
                    self.log.display()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The project's artifact cache (`MAYFLY_CACHE`, default ~/.cache/mayfly).
pub fn cache_dir() -> PathBuf {
    std::env::var_os("MAYFLY_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into()))
                .join(".cache/mayfly")
        })
}

/// A file of the current default guest build, e.g. `kernel/microvm.current/bzImage`.
pub fn guest_artifact(relative: &str) -> PathBuf {
    let path = cache_dir().join(relative);
    assert!(
        path.exists(),
        "{} is missing: run guest-kernel/build.sh and rootfs/build.sh",
        path.display()
    );
    path
}

#[derive(Default)]
struct Captured {
    bytes: Vec<u8>,
    closed: bool,
}

/// Collects a pipe's bytes on a thread; tests wait on it for text to appear.
#[derive(Clone, Default)]
struct Capture(Arc<(Mutex<Captured>, Condvar)>);

impl Capture {
    fn spawn(self, mut pipe: impl Read + Send + 'static) {
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            loop {
                let n = pipe.read(&mut buf).unwrap_or(0);
                let (lock, cond) = &*self.0;
                let mut captured = lock.lock().unwrap();
                if n == 0 {
                    captured.closed = true;
                    cond.notify_all();
                    return;
                }
                captured.bytes.extend_from_slice(&buf[..n]);
                cond.notify_all();
            }
        });
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0 .0.lock().unwrap().bytes).into_owned()
    }

    /// Wait until at least `count` bytes have arrived; false on timeout or end of the pipe.
    fn wait_bytes(&self, count: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let (lock, cond) = &*self.0;
        let mut captured = lock.lock().unwrap();
        while captured.bytes.len() < count {
            let now = Instant::now();
            if captured.closed || now >= deadline {
                return false;
            }
            captured = cond.wait_timeout(captured, deadline - now).unwrap().0;
        }
        true
    }

    /// Wait until the pipe is closed (the process and its children let go of it).
    fn wait_closed(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let (lock, cond) = &*self.0;
        let mut captured = lock.lock().unwrap();
        while !captured.closed {
            let now = Instant::now();
            if now >= deadline {
                return;
            }
            captured = cond.wait_timeout(captured, deadline - now).unwrap().0;
        }
    }

    /// Wait until `pattern` appears at or after byte `from`; returns the end of the match.
    fn wait_for(&self, pattern: &str, from: usize, timeout: Duration) -> Option<usize> {
        let deadline = Instant::now() + timeout;
        let (lock, cond) = &*self.0;
        let mut captured = lock.lock().unwrap();
        loop {
            let start = from.min(captured.bytes.len());
            if let Some(at) = find(&captured.bytes[start..], pattern.as_bytes()) {
                return Some(start + at + pattern.len());
            }
            let now = Instant::now();
            if captured.closed || now >= deadline {
                return None;
            }
            captured = cond.wait_timeout(captured, deadline - now).unwrap().0;
        }
    }
}

/// A command's console output, trimmed, without the lines the guest agent logs to the console
/// on its own schedule ("mayfly-agent: listening on vsock port 52" can land between a command's
/// markers: a boot test once read it as the command's output).
fn without_agent_log(text: &str) -> String {
    text.replace('\r', "")
        .lines()
        .filter(|line| !line.starts_with("mayfly-agent: "))
        .collect::<Vec<_>>()
        .join("\n")
        .trim()
        .to_string()
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// A running `mayfly run` (or any mayfly command) with its console on pipes.
pub struct Guest {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: Capture,
    stderr: Capture,
    /// Console output before this offset has been consumed by earlier waits.
    cursor: usize,
    commands: u32,
}

impl Guest {
    /// Start `mayfly <args>`.
    pub fn start(args: &[&str]) -> Self {
        Self::start_with(Command::new(mayfly_bin()).args(args))
    }

    pub fn start_with(command: &mut Command) -> Self {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("mayfly starts");
        let stdout = Capture::default();
        stdout.clone().spawn(child.stdout.take().unwrap());
        let stderr = Capture::default();
        stderr.clone().spawn(child.stderr.take().unwrap());
        Guest {
            stdin: child.stdin.take(),
            child,
            stdout,
            stderr,
            cursor: 0,
            commands: 0,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything the console printed so far.
    pub fn console(&self) -> String {
        self.stdout.text()
    }

    pub fn stderr(&self) -> String {
        self.stderr.text()
    }

    /// Wait for `pattern` on the console after what earlier waits consumed; panics with the
    /// console and stderr if it does not come.
    pub fn expect(&mut self, pattern: &str, timeout: Duration) -> String {
        match self.stdout.wait_for(pattern, self.cursor, timeout) {
            Some(end) => {
                let text = self.stdout.text();
                let seen = text.get(self.cursor..end).unwrap_or_default().to_string();
                self.cursor = end;
                seen
            }
            None => {
                // Ask mayfly for a dump of its devices and vCPUs, for the report.
                // SAFETY: kill(2) on our own child's pid.
                unsafe {
                    libc::kill(
                        libc::pid_t::try_from(self.child.id()).expect("a pid"),
                        libc::SIGUSR1,
                    )
                };
                std::thread::sleep(Duration::from_secs(2));
                panic!(
                    "{pattern:?} did not appear on the console within {timeout:?}\n--- console ---\n{}\n--- stderr ---\n{}",
                    self.console(),
                    self.stderr()
                )
            }
        }
    }

    /// Wait until mayfly's stderr holds `pattern` (probe reports, trace lines); false on
    /// timeout or if mayfly exits first.
    pub fn wait_stderr(&self, pattern: &str, timeout: Duration) -> bool {
        self.stderr.wait_for(pattern, 0, timeout).is_some()
    }

    /// Wait until the console has printed anything at all; false on timeout.
    pub fn wait_any_output(&self, timeout: Duration) -> bool {
        self.stdout.wait_bytes(1, timeout)
    }

    /// Wait for the default guest's readiness line and return that line.
    pub fn expect_ready(&mut self) -> String {
        self.expect(READY, BOOT_TIMEOUT);
        self.expect("\n", COMMAND_TIMEOUT);
        let text = self.console();
        let start = text[..self.cursor].rfind(READY).unwrap_or(0);
        text[start..self.cursor].trim().to_string()
    }

    /// Type raw text into the console.
    pub fn send(&mut self, text: &str) {
        if !self.try_send(text) {
            let status = self.child.try_wait().ok().flatten();
            panic!(
                "cannot type into the console: mayfly is gone ({status:?})\n--- console ---\n{}\n--- stderr ---\n{}",
                self.console(),
                self.stderr()
            );
        }
    }

    /// Type raw text into the console unless the VMM has gone already (false then).
    pub fn try_send(&mut self, text: &str) -> bool {
        let Some(stdin) = self.stdin.as_mut() else {
            return false;
        };
        stdin.write_all(text.as_bytes()).is_ok() && stdin.flush().is_ok()
    }

    /// Run a shell command in the guest and return its output (stdout and stderr, trimmed).
    /// The markers are split in the typed text so the terminal's echo of the command line
    /// cannot be mistaken for them.
    pub fn run(&mut self, command: &str) -> String {
        self.commands += 1;
        let n = self.commands;
        self.send(&format!(
            "echo '@@beg''in-{n}@@'; {command} 2>&1; echo '@@en''d-{n}@@'\n"
        ));
        self.expect(&format!("@@begin-{n}@@"), COMMAND_TIMEOUT);
        let output = self.expect(&format!("@@end-{n}@@"), COMMAND_TIMEOUT);
        without_agent_log(output.trim_end_matches(&format!("@@end-{n}@@")))
    }

    /// Wait for the process to end.
    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait for mayfly") {
                // Let the capture threads drain the pipes.
                self.stdout.wait_closed(Duration::from_secs(5));
                self.stderr.wait_closed(Duration::from_secs(5));
                return status;
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                panic!(
                    "mayfly did not exit within {timeout:?}\n--- console ---\n{}\n--- stderr ---\n{}",
                    self.console(),
                    self.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Send a signal to the mayfly process.
    pub fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on our own child's pid; the result is checked.
        let rc = unsafe {
            libc::kill(
                libc::pid_t::try_from(self.child.id()).expect("a pid"),
                signal,
            )
        };
        assert_eq!(rc, 0, "signal {signal} to mayfly");
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A process's memory, KiB (its smaps_rollup).
#[derive(Debug, Clone, Copy)]
pub struct MemoryKib {
    /// Resident.
    pub rss: u64,
    /// Proportional: each resident page divided among the processes that map it.
    pub pss: u64,
    /// Its own: resident pages no other process maps (Private_Clean + Private_Dirty).
    pub private: u64,
}

/// The memory of process `pid` (its smaps_rollup); `None` if it is gone or the file does not
/// parse.
pub fn memory_kib(pid: u64) -> Option<MemoryKib> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    let field = |name: &str| -> Option<u64> {
        text.lines()
            .find_map(|l| l.strip_prefix(name))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    Some(MemoryKib {
        rss: field("Rss:")?,
        pss: field("Pss:")?,
        private: field("Private_Clean:")? + field("Private_Dirty:")?,
    })
}

#[cfg(test)]
mod tests {
    use super::without_agent_log;

    #[test]
    fn the_agents_console_log_is_not_command_output() {
        assert_eq!(
            without_agent_log("\r\nmayfly-agent: listening on vsock port 52\r\n0-1\r\n"),
            "0-1"
        );
        assert_eq!(without_agent_log("a\nb\n"), "a\nb");
        // Only whole lines the agent starts are dropped.
        assert_eq!(without_agent_log("x mayfly-agent: y"), "x mayfly-agent: y");
    }
}
