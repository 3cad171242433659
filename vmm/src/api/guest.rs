//! The control socket's routes into the guest, through its agent (see [`crate::agent`]):
//! exec and files. They are served on the connection's own thread, never the controller's:
//! a command may run for an hour and a file may be gigabytes, and neither may hold up
//! pause, snapshot or fork. The controller is asked only whether the VM runs (a paused VM's
//! agent cannot answer: 409 at once instead of a wait).
//!
//! | request                              | body                      | answer                          |
//! |--------------------------------------|---------------------------|---------------------------------|
//! | `POST /vm/exec`                      | exec JSON (below)         | exit record + output, or NDJSON |
//! | `PUT /vm/files?path=P[&mode=0644][&mkdirs=1][&atomic=0]` | the file's bytes | `{"bytes": N}`        |
//! | `GET /vm/files?path=P`               | none                      | the file's bytes (chunked)      |
//! | `DELETE /vm/files?path=P[&recursive=1]` | none                   | 204                             |
//! | `GET /vm/files/stat?path=P[&follow=0]` | none                    | type, size, mode, mtime, owner  |
//! | `GET /vm/files/list?path=P`          | none                      | `{"entries": [...]}`            |
//! | `PUT /vm/files/dir?path=P[&mode=0755][&parents=1]` | none        | 204                             |
//! | `GET /vm/agent`                      | none                      | the agent's ping + last refresh |
//!
//! Exec's body is the agent's exec request (`argv` or `shell`, `env`, `clear_env`, `cwd`,
//! `user`, `timeout_ms`) plus `stdin` (text) or `stdin_base64`, and `stream`. Without
//! `stream` the answer is `{"exit": {...}, "stdout": "...", "stderr": "..."}` (a stream that
//! is not UTF-8 comes as `stdout_base64`; past [`MAX_COLLECTED`] bytes the rest is counted in
//! `stdout_dropped`, not kept). With `"stream": true` the answer is chunked NDJSON, one
//! object per line: `{"started": {"pid": N}}`, `{"stdout": "text"}` or `{"stdout_base64":
//! "..."}` (and the same for stderr), and last `{"exit": {...}}` or `{"error": "..."}`.
//! A client that hangs up kills the command.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use mayfly_agent_protocol::{
    base64, ErrorCode, ExecRequest, ExitRecord, WriteFileOptions, MAX_PAYLOAD,
};
use serde_json::{json, Map, Value};

use super::http::{query_param, Request};
use super::{Reply, Services};
use crate::agent::{exec_json, Agent, AgentError, BoundedOutput};

/// How much of each output stream a non-streaming exec keeps; the rest is counted.
pub const MAX_COLLECTED: usize = 16 << 20;
/// Entries a listing answers with at most.
pub const MAX_LIST_ENTRIES: usize = 100_000;
/// How long an exec waits for a refresh that is still running after a restore or fork.
const REFRESH_WAIT: Duration = Duration::from_secs(30);
/// How long a request waits for a clone its fork still holds: the fork's own bound on its
/// clones being ready, after which it kills them.
const HELD_WAIT: Duration = crate::fork::READY_TIMEOUT;

/// The routes served here, for the route listing and method checks.
pub const ROUTES: &[(&str, &str)] = &[
    ("POST", "/vm/exec"),
    ("PUT", "/vm/files"),
    ("GET", "/vm/files"),
    ("DELETE", "/vm/files"),
    ("GET", "/vm/files/stat"),
    ("GET", "/vm/files/list"),
    ("PUT", "/vm/files/dir"),
    ("GET", "/vm/agent"),
];

/// Whether `path` is one of ours.
pub fn serves(path: &str) -> bool {
    ROUTES.iter().any(|(_, p)| *p == path)
}

/// The methods `path` accepts, for a 405.
pub fn methods(path: &str) -> String {
    ROUTES
        .iter()
        .filter(|(_, p)| *p == path)
        .map(|(m, _)| *m)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Whether the body of `method path` is streamed to the guest rather than read first.
pub fn streams_body(method: &str, path: &str) -> bool {
    method == "PUT" && path == "/vm/files"
}

/// What a route handler may do besides the agent: ask the controller.
pub struct Context<'a> {
    pub services: &'a Services,
    /// The VM's state as `GET /vm` says it (running, paused, or starting: a clone its fork
    /// still holds), asked of the controller; an error reply when it cannot say.
    pub state: &'a dyn Fn() -> Result<String, Reply>,
    /// How long a client may stall while it sends or receives.
    pub idle: Duration,
}

/// How a request ended: a reply still to write, or already written (streamed).
pub enum Outcome {
    Reply(Reply),
    Written,
}

impl From<Reply> for Outcome {
    fn from(reply: Reply) -> Self {
        Outcome::Reply(reply)
    }
}

/// A guest route's request, parsed and checked: everything decided before the agent is asked.
#[derive(Debug)]
pub enum Call {
    Exec(Box<HttpExec>),
    WriteFile {
        path: String,
        options: WriteFileOptions,
    },
    ReadFile {
        path: String,
    },
    Remove {
        path: String,
        recursive: bool,
    },
    Stat {
        path: String,
        follow: bool,
    },
    List {
        path: String,
    },
    Mkdir {
        path: String,
        mode: u32,
        parents: bool,
    },
    Agent,
}

/// Parse a request for a guest route: its method, query parameters and (for exec) body. What
/// a client sends is checked here, before anything reaches the guest's agent.
pub fn parse(request: &Request) -> Result<Call, Reply> {
    let method = request.method.as_str();
    if !ROUTES
        .iter()
        .any(|(m, p)| *m == method && *p == request.path)
    {
        return Err(Reply::error(
            405,
            format!(
                "{} {} is not supported: use {}",
                method,
                request.path,
                methods(&request.path)
            ),
        ));
    }
    Ok(match (method, request.path.as_str()) {
        ("POST", "/vm/exec") => Call::Exec(Box::new(
            parse_exec(&request.body).map_err(|message| Reply::error(400, message))?,
        )),
        ("PUT", "/vm/files") => Call::WriteFile {
            path: path_of(request)?,
            options: WriteFileOptions::default()
                .mode(mode(request, 0o644)?)
                .atomic(flag(request, "atomic", true)?)
                .mkdirs(flag(request, "mkdirs", false)?),
        },
        ("GET", "/vm/files") => Call::ReadFile {
            path: path_of(request)?,
        },
        ("DELETE", "/vm/files") => Call::Remove {
            path: path_of(request)?,
            recursive: flag(request, "recursive", false)?,
        },
        ("GET", "/vm/files/stat") => Call::Stat {
            path: path_of(request)?,
            follow: flag(request, "follow", true)?,
        },
        ("GET", "/vm/files/list") => Call::List {
            path: path_of(request)?,
        },
        ("PUT", "/vm/files/dir") => Call::Mkdir {
            path: path_of(request)?,
            mode: mode(request, 0o755)?,
            parents: flag(request, "parents", false)?,
        },
        ("GET", "/vm/agent") => Call::Agent,
        _ => return Err(Reply::error(404, format!("there is no {}", request.path))),
    })
}

/// Serve one request for a guest route on `stream`.
pub fn serve(request: &Request, stream: &UnixStream, cx: &Context) -> Outcome {
    let call = match parse(request) {
        Ok(call) => call,
        Err(reply) => return reply.into(),
    };
    let agent = match agent_for(cx) {
        Ok(agent) => agent,
        Err(reply) => return reply.into(),
    };
    let result = match call {
        Call::Exec(exec) => return run_exec(*exec, stream, &agent, cx),
        Call::WriteFile { path, options } => {
            write_file(request, &path, &options, stream, &agent, cx)
        }
        Call::ReadFile { path } => return read_file(&path, stream, &agent),
        Call::Remove { path, recursive } => agent
            .remove(&path, recursive)
            .map(|()| Reply::no_content())
            .map_err(agent_reply),
        Call::Stat { path, follow } => agent
            .stat(&path, follow)
            .map(|stat| Reply::ok(serde_json::to_value(stat).unwrap_or_default()))
            .map_err(agent_reply),
        Call::List { path } => agent.list(&path).map_err(agent_reply).map(|mut entries| {
            let total = entries.len();
            entries.truncate(MAX_LIST_ENTRIES);
            Reply::ok(json!({
                "entries": entries,
                "count": total,
                "truncated": total > MAX_LIST_ENTRIES,
            }))
        }),
        Call::Mkdir {
            path,
            mode,
            parents,
        } => agent
            .mkdir(&path, mode, parents)
            .map(|()| Reply::no_content())
            .map_err(agent_reply),
        Call::Agent => agent_status(&agent, cx),
    };
    match result {
        Ok(reply) | Err(reply) => reply.into(),
    }
}

/// The VM's agent, once the VM runs and its refresh after a restore or fork is over.
fn agent_for(cx: &Context) -> Result<Agent, Reply> {
    let Some(vsock) = &cx.services.vsock else {
        return Err(agent_reply(AgentError::NoVsock));
    };
    // A clone its fork still holds runs once the fork has every clone ready: wait for that
    // (the fork gives up on its clones within its own bound, and kills them then).
    let held_since = std::time::Instant::now();
    loop {
        match (cx.state)()?.as_str() {
            "paused" => {
                return Err(Reply::error(
                    409,
                    "the VM is paused, so its agent cannot answer: PUT /vm/resume first",
                ))
            }
            "starting" if held_since.elapsed() < HELD_WAIT => {
                std::thread::sleep(Duration::from_millis(20));
            }
            _ => break,
        }
    }
    cx.services.refresh.wait(REFRESH_WAIT);
    Ok(Agent::new(vsock))
}

/// The reply for an agent error: what went wrong and what to do.
pub fn agent_reply(e: AgentError) -> Reply {
    use mayfly_agent_protocol::Error as P;
    let status = match &e {
        AgentError::NoVsock => 409,
        AgentError::Connect { .. } | AgentError::NotUp { .. } => 503,
        AgentError::HandshakeTimeout { .. } => 504,
        AgentError::Handshake(_) => 502,
        AgentError::Protocol(P::Agent { code, .. }) => match code {
            ErrorCode::NotFound => 404,
            ErrorCode::Permission => 403,
            ErrorCode::Invalid => 400,
            ErrorCode::Unsupported => 501,
            ErrorCode::Busy => 503,
            ErrorCode::Timeout => 504,
            _ => 500,
        },
        AgentError::Protocol(P::InvalidRequest(_)) => 400,
        AgentError::Protocol(P::Input(_)) => 400,
        AgentError::Protocol(_) => 502,
        AgentError::Paused(_) => 409,
        AgentError::Api(_) => 502,
        AgentError::ApiStatus { status, .. } => *status,
    };
    Reply::error(status, e.to_string())
}

fn path_of(request: &Request) -> Result<String, Reply> {
    match query_param(&request.query, "path") {
        Some(path) if !path.is_empty() => Ok(path),
        _ => Err(Reply::error(
            400,
            format!(
                "{} {} needs the query parameter path, percent-encoded: e.g. {}?path=%2Ftmp%2Fout.txt",
                request.method, request.path, request.path
            ),
        )),
    }
}

/// A boolean query parameter: 1/true/yes or 0/false/no.
fn flag(request: &Request, key: &str, default: bool) -> Result<bool, Reply> {
    match query_param(&request.query, key).as_deref() {
        None => Ok(default),
        Some("1" | "true" | "yes") => Ok(true),
        Some("0" | "false" | "no") => Ok(false),
        Some(other) => Err(Reply::error(
            400,
            format!("the query parameter {key} must be 1 or 0, not {other:?}"),
        )),
    }
}

/// The `mode` query parameter, octal (0644 or 644).
fn mode(request: &Request, default: u32) -> Result<u32, Reply> {
    match query_param(&request.query, "mode") {
        None => Ok(default),
        Some(text) => u32::from_str_radix(text.trim_start_matches("0o"), 8)
            .ok()
            .filter(|m| *m <= 0o7777)
            .ok_or_else(|| {
                Reply::error(
                    400,
                    format!("the query parameter mode must be octal permission bits such as 0644, not {text:?}"),
                )
            }),
    }
}

fn agent_status(agent: &Agent, cx: &Context) -> Result<Reply, Reply> {
    let ping = agent
        .clone()
        .with_wait(Duration::from_secs(2))
        .ping()
        .map_err(agent_reply)?;
    let refresh = match cx.services.refresh.state() {
        crate::agent::RefreshState::Idle => json!(null),
        crate::agent::RefreshState::Running => json!({"state": "running"}),
        crate::agent::RefreshState::Done(reply) => json!({"state": "done", "reply": reply}),
        crate::agent::RefreshState::Failed(why) => json!({"state": "failed", "error": why}),
    };
    Ok(Reply::ok(json!({"agent": ping, "refresh": refresh})))
}

// ---------------------------------------------------------------------------------------
// exec

/// An exec request as the control socket takes it.
#[derive(Debug)]
pub struct HttpExec {
    request: ExecRequest,
    stdin: Option<Vec<u8>>,
    stream: bool,
}

/// Check an exec body as `POST /vm/exec` does, acting on nothing: the entry point of the exec
/// body's fuzz target (`fuzz/`). True if the body is a valid exec request.
#[doc(hidden)]
pub fn check_exec_body(body: &[u8]) -> bool {
    parse_exec(body).is_ok()
}

fn parse_exec(body: &[u8]) -> Result<HttpExec, String> {
    const EXAMPLE: &str = r#"{"argv": ["uname", "-a"]} or {"shell": "ls /", "timeout_ms": 5000}"#;
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        format!("the body of POST /vm/exec is not valid JSON ({e}): send e.g. {EXAMPLE}")
    })?;
    let Value::Object(mut object) = value else {
        return Err(format!(
            "the body of POST /vm/exec must be a JSON object, e.g. {EXAMPLE}"
        ));
    };
    let stream = match object.remove("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => b,
        Some(other) => return Err(format!("\"stream\" must be true or false, not {other}")),
    };
    let stdin = match (object.remove("stdin"), object.remove("stdin_base64")) {
        (Some(_), Some(_)) => return Err("give \"stdin\" or \"stdin_base64\", not both".into()),
        (Some(Value::String(text)), None) => Some(text.into_bytes()),
        (None, Some(Value::String(b64))) => {
            Some(base64::decode(&b64).map_err(|e| format!("\"stdin_base64\" is not base64: {e}"))?)
        }
        (None, None) | (Some(Value::Null), None) | (None, Some(Value::Null)) => None,
        _ => return Err("\"stdin\" and \"stdin_base64\" must be strings".into()),
    };
    let request: ExecRequest = serde_json::from_value(Value::Object(Map::from_iter(object)))
        .map_err(|e| format!("bad exec request: {e}; send e.g. {EXAMPLE}"))?;
    request.validate()?;
    Ok(HttpExec {
        request,
        stdin,
        stream,
    })
}

fn run_exec(exec: HttpExec, stream: &UnixStream, agent: &Agent, cx: &Context) -> Outcome {
    // Connect first, so that an agent that is not up is an ordinary error reply.
    let mut client = match agent.connect() {
        Ok(client) => client,
        Err(e) => return agent_reply(e).into(),
    };
    let signaller = match client.signaller() {
        Ok(s) => s,
        Err(e) => return agent_reply(e.into()).into(),
    };
    let agent_stream = client.get_ref().try_clone().ok();
    if exec.stream {
        let _ = stream.set_write_timeout(Some(cx.idle));
        let Ok(body) = Chunked::start(stream, "application/x-ndjson") else {
            return Outcome::Written;
        };
        let out = std::cell::RefCell::new(Ndjson {
            body,
            started: false,
            signaller,
            stdout: Utf8Pieces::default(),
            stderr: Utf8Pieces::default(),
        });
        let result = watch_hangup(stream, agent_stream, || {
            client.exec(
                &exec.request,
                exec.stdin.map(io::Cursor::new),
                |b| out.borrow_mut().output(Output::Stdout, b),
                |b| out.borrow_mut().output(Output::Stderr, b),
            )
        });
        out.into_inner().end(result.map_err(AgentError::from));
        return Outcome::Written;
    }
    let mut stdout = BoundedOutput::new(MAX_COLLECTED);
    let mut stderr = BoundedOutput::new(MAX_COLLECTED);
    let result = watch_hangup(stream, agent_stream, || {
        client.exec(
            &exec.request,
            exec.stdin.map(io::Cursor::new),
            |b| stdout.push(b),
            |b| stderr.push(b),
        )
    });
    drop(signaller);
    match result {
        Ok(exit) => Reply::ok(exec_json(&exit, stdout, stderr)).into(),
        Err(e) => agent_reply(e.into()).into(),
    }
}

/// Run `f` (an exec) while watching the client: a client that hangs up (closes its socket)
/// ends the exec's agent connection, and the agent kills the command. A client that only
/// half-closes (shuts its write side after the request) is not hanging up.
fn watch_hangup<T>(client: &UnixStream, agent: Option<UnixStream>, f: impl FnOnce() -> T) -> T {
    let Some(agent) = agent else {
        return f();
    };
    let Ok((done, woken)) = UnixStream::pair() else {
        return f();
    };
    // Under this connection thread's seccomp filter, which it inherits.
    let label = crate::seccomp::Label::current();
    std::thread::scope(|scope| {
        let watcher = std::thread::Builder::new()
            .name("api-exec-watch".into())
            .stack_size(crate::HELPER_THREAD_STACK)
            .spawn_scoped(scope, || {
                label.apply();
                use nix::poll::{poll, PollFd, PollFlags};
                // Bits nix does not know (None) count as fired: never a spin on them.
                let fired = |fd: &PollFd| fd.revents().is_none_or(|r| !r.is_empty());
                loop {
                    let mut fds = [
                        // No events asked: POLLHUP (peer closed) and POLLERR come anyway, and
                        // bytes a client sends after its request do not wake us.
                        PollFd::new(client, PollFlags::empty()),
                        PollFd::new(&woken, PollFlags::POLLIN),
                    ];
                    match poll(&mut fds, -1) {
                        Err(nix::errno::Errno::EINTR) => continue,
                        Err(_) => return,
                        Ok(_) if fired(&fds[1]) => return,
                        Ok(_) => {}
                    }
                    if fired(&fds[0]) {
                        let _ = agent.shutdown(std::net::Shutdown::Both);
                        return;
                    }
                }
            });
        let result = f();
        drop(done);
        if let Ok(handle) = watcher {
            let _ = handle.join();
        }
        result
    })
}

#[derive(Clone, Copy)]
enum Output {
    Stdout,
    Stderr,
}

/// A streamed exec's answer: NDJSON lines in a chunked body.
struct Ndjson<'a> {
    body: Chunked<'a>,
    started: bool,
    signaller: mayfly_agent_protocol::Signaller,
    stdout: Utf8Pieces,
    stderr: Utf8Pieces,
}

impl Ndjson<'_> {
    fn announce(&mut self) {
        if !self.started {
            if let Some(pid) = self.signaller.pid() {
                self.started = true;
                let _ = self.body.line(&json!({"started": {"pid": pid}}));
            }
        }
    }

    fn piece(&mut self, which: Output, piece: Option<(bool, String)>) {
        let Some((text, data)) = piece else { return };
        let name = match which {
            Output::Stdout => "stdout",
            Output::Stderr => "stderr",
        };
        let key = if text {
            name.to_owned()
        } else {
            format!("{name}_base64")
        };
        if self.body.line(&json!({ key: data })).is_err() {
            // The client is gone: the command goes too.
            let _ = self.signaller.signal(libc::SIGKILL);
        }
    }

    fn output(&mut self, which: Output, data: &[u8]) {
        if self.body.failed {
            return;
        }
        self.announce();
        let piece = match which {
            Output::Stdout => self.stdout.push(data),
            Output::Stderr => self.stderr.push(data),
        };
        self.piece(which, piece);
    }

    fn end(mut self, result: Result<ExitRecord, AgentError>) {
        if self.body.failed {
            return;
        }
        self.announce();
        let rest = self.stdout.finish();
        self.piece(Output::Stdout, rest);
        let rest = self.stderr.finish();
        self.piece(Output::Stderr, rest);
        let last = match result {
            Ok(exit) => json!({ "exit": exit }),
            Err(e) => json!({ "error": e.to_string() }),
        };
        if !self.body.failed && self.body.line(&last).is_ok() {
            let _ = self.body.finish();
        }
    }
}

/// Splits a byte stream into JSON-safe pieces: text where it is UTF-8 (a character cut
/// between two chunks waits for the rest), base64 where it is not. Nothing is lost.
#[derive(Default)]
struct Utf8Pieces {
    pending: Vec<u8>,
}

impl Utf8Pieces {
    /// The next piece for `data`: (is_text, text or base64).
    fn push(&mut self, data: &[u8]) -> Option<(bool, String)> {
        self.pending.extend_from_slice(data);
        let bytes = std::mem::take(&mut self.pending);
        match std::str::from_utf8(&bytes) {
            Ok(text) => (!text.is_empty()).then(|| (true, text.to_owned())),
            Err(e) if e.error_len().is_none() && bytes.len() - e.valid_up_to() < 4 => {
                let (text, rest) = bytes.split_at(e.valid_up_to());
                self.pending = rest.to_vec();
                // Valid by construction: from_utf8 said so up to here.
                let text = String::from_utf8_lossy(text).into_owned();
                (!text.is_empty()).then_some((true, text))
            }
            Err(_) => Some((false, base64::encode(&bytes))),
        }
    }

    /// What is left at the end (a cut character): base64.
    fn finish(&mut self) -> Option<(bool, String)> {
        let bytes = std::mem::take(&mut self.pending);
        (!bytes.is_empty()).then(|| (false, base64::encode(&bytes)))
    }
}

/// A chunked HTTP response body.
struct Chunked<'a> {
    stream: &'a UnixStream,
    failed: bool,
}

impl<'a> Chunked<'a> {
    fn start(stream: &'a UnixStream, content_type: &str) -> io::Result<Self> {
        let head = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        );
        (&mut &*stream).write_all(head.as_bytes())?;
        Ok(Self {
            stream,
            failed: false,
        })
    }

    fn chunk(&mut self, data: &[u8]) -> io::Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let mut out = format!("{:x}\r\n", data.len()).into_bytes();
        out.extend_from_slice(data);
        out.extend_from_slice(b"\r\n");
        let result = (&mut &*self.stream).write_all(&out);
        if result.is_err() {
            self.failed = true;
        }
        result
    }

    fn line(&mut self, value: &Value) -> io::Result<()> {
        let mut bytes = serde_json::to_vec(value).unwrap_or_default();
        bytes.push(b'\n');
        self.chunk(&bytes)
    }

    /// The last chunk: without it the client knows the body is incomplete.
    fn finish(self) -> io::Result<()> {
        (&mut &*self.stream).write_all(b"0\r\n\r\n")
    }
}

impl Write for Chunked<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.chunk(buf).map(|()| buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// files

/// The rest of a streamed request body: what came with the head, then the socket, exactly
/// `len` bytes. A client that stops early or stalls is an error, never a short file.
struct Body<'a> {
    prefix: io::Cursor<Vec<u8>>,
    stream: &'a UnixStream,
    left: u64,
}

impl Read for Body<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 || buf.is_empty() {
            return Ok(0);
        }
        let want = buf
            .len()
            .min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let n = match self.prefix.read(&mut buf[..want])? {
            0 => (&mut &*self.stream).read(&mut buf[..want])?,
            n => n,
        };
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "the client sent {} bytes fewer than its Content-Length",
                    self.left
                ),
            ));
        }
        self.left -= n as u64;
        Ok(n)
    }
}

fn write_file(
    request: &Request,
    path: &str,
    options: &WriteFileOptions,
    stream: &UnixStream,
    agent: &Agent,
    cx: &Context,
) -> Result<Reply, Reply> {
    let len = request
        .streamed_body_len
        .unwrap_or(request.body.len() as u64);
    let _ = stream.set_read_timeout(Some(cx.idle));
    let body = Body {
        prefix: io::Cursor::new(request.body.clone()),
        stream,
        left: len,
    };
    let bytes = agent.write_file(path, options, body).map_err(agent_reply)?;
    Ok(Reply::ok(json!({ "bytes": bytes })))
}

fn read_file(path: &str, stream: &UnixStream, agent: &Agent) -> Outcome {
    // Start the read before answering, so that a missing file is a 404, not a cut body.
    let mut client = match agent.connect() {
        Ok(client) => client,
        Err(e) => return agent_reply(e).into(),
    };
    let _ = client.hello();
    let mut first = Vec::new();
    let mut head_sent: Option<Chunked> = None;
    // Buffer the first chunk: an error before any data is still a proper reply.
    let result = client.read_file(
        path,
        Forward {
            first: &mut first,
            body: &mut head_sent,
            stream,
        },
    );
    match (result, head_sent) {
        (Ok(_), Some(body)) => {
            let _ = body.finish();
            Outcome::Written
        }
        (Ok(_), None) => match Chunked::start(stream, "application/octet-stream") {
            Ok(mut body) => {
                if body.chunk(&first).is_ok() {
                    let _ = body.finish();
                }
                Outcome::Written
            }
            Err(_) => Outcome::Written,
        },
        // Data already went out: end without the last chunk, so the client sees a cut body.
        (Err(_), Some(_)) => Outcome::Written,
        (Err(e), None) => agent_reply(e.into()).into(),
    }
}

/// read_file's output: held until [`MAX_PAYLOAD`] bytes, then streamed as chunks.
struct Forward<'a, 'b> {
    first: &'a mut Vec<u8>,
    body: &'a mut Option<Chunked<'b>>,
    stream: &'b UnixStream,
}

impl Write for Forward<'_, '_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if let Some(body) = self.body.as_mut() {
            return body.write(buf);
        }
        self.first.extend_from_slice(buf);
        if self.first.len() >= MAX_PAYLOAD {
            let mut body = Chunked::start(self.stream, "application/octet-stream")?;
            body.chunk(self.first)?;
            self.first.clear();
            *self.body = Some(body);
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// For the route listing in 404s.
pub fn route_list() -> impl Iterator<Item = String> {
    ROUTES.iter().map(|(m, p)| format!("{m} {p}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_pieces_keep_every_byte() {
        let mut p = Utf8Pieces::default();
        // "é" is c3 a9: cut between two chunks.
        assert_eq!(p.push(b"caf\xc3"), Some((true, "caf".into())));
        assert_eq!(p.push(b"\xa9!"), Some((true, "\u{e9}!".into())));
        assert_eq!(
            p.push(b"\xff\xfe"),
            Some((false, base64::encode(b"\xff\xfe")))
        );
        assert_eq!(p.push(b"x\xe2"), Some((true, "x".into())));
        assert_eq!(p.finish(), Some((false, base64::encode(b"\xe2"))));
        assert_eq!(p.finish(), None);
    }

    #[test]
    fn exec_bodies_are_checked() {
        let e = parse_exec(br#"{"argv": ["true"], "stream": true, "stdin": "hi"}"#).unwrap();
        assert!(e.stream);
        assert_eq!(e.stdin.as_deref(), Some(&b"hi"[..]));
        assert_eq!(e.request.argv.as_deref(), Some(&["true".to_string()][..]));
        let e = parse_exec(br#"{"shell": "echo", "stdin_base64": "aGk="}"#).unwrap();
        assert_eq!(e.stdin.as_deref(), Some(&b"hi"[..]));
        for bad in [
            &br#"{"argv": []}"#[..],
            br#"{"argv": ["x"], "shell": "y"}"#,
            br#"{}"#,
            br#"{"argv": ["x"], "bogus": 1}"#,
            br#"{"argv": ["x"], "stream": "yes"}"#,
            br#"{"argv": ["x"], "stdin": "a", "stdin_base64": "YQ=="}"#,
            br#"{"argv": ["x"], "stdin_base64": "!!"}"#,
            br#"{"argv": ["x"], "timeout_ms": 0}"#,
            br#"[1]"#,
            br#"not json"#,
        ] {
            assert!(parse_exec(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        let err = parse_exec(br#"{"argv": ["x"], "bogus": 1}"#).unwrap_err();
        assert!(err.contains("bogus"), "{err}");
    }

    #[test]
    fn collected_output_is_bounded() {
        let mut c = BoundedOutput::new(4);
        c.push(b"ab");
        c.push(b"cdef");
        assert_eq!(c.bytes(), b"abcd");
        assert_eq!(c.dropped(), 2);
        let mut body = Map::new();
        c.into_json("stdout", &mut body);
        assert_eq!(body["stdout"], json!("abcd"));
        assert_eq!(body["stdout_dropped"], json!(2));
        let mut c = BoundedOutput::new(4);
        c.push(b"\xff");
        let mut body = Map::new();
        c.into_json("stderr", &mut body);
        assert_eq!(body["stderr_base64"], json!(base64::encode(b"\xff")));
    }
}
