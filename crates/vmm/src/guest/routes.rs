//! The control socket's routes into the guest (exec and files; their wire side is
//! `mayfly_api::guest`), served through the guest's agent on the connection's own thread,
//! never the controller's: a command may run for an hour and a file may be gigabytes, and
//! neither may hold up pause, snapshot or fork. The controller is asked only whether the VM
//! runs (a paused VM's agent cannot answer: 409 at once instead of a wait).
//!
//! The guest is not trusted. Every call here is bounded and watches its client
//! ([`crate::guest::watch`]): a deadline (the file routes take `timeout_ms` in their query, up
//! to [`MAX_CALL_TIMEOUT`]), an idle limit, an exec's own `timeout_ms` plus a grace, and the
//! client's hang-up, each of which ends the call and closes its connection to the agent.
//! What the guest sends is kept only up to a bound: a listing up to [`MAX_LIST_ENTRIES`] or
//! [`MAX_LIST_BYTES`] (then cut, `"truncated": true`), a collected exec's output up to
//! [`MAX_COLLECTED`] per stream, a download's first 1 MiB (then streamed). Answers that can
//! be large are serialized straight onto the socket, never copied whole first. How many
//! guest calls run at once is the control socket's to bound (`mayfly_api::MAX_GUEST_CALLS`).

use std::io::{self, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use mayfly_agent_protocol::{
    DirEntry, ErrorCode, ExitRecord, ListLimits, WriteFileOptions, MAX_PAYLOAD,
};
use mayfly_api::guest::{
    exec_json, BoundedOutput, Call, Context, GuestRoutes, HttpExec, Outcome, Utf8Pieces,
    MAX_COLLECTED, MAX_LIST_ENTRIES,
};
use mayfly_api::http::{query_param, Chunked, Request, StreamedBody};
use mayfly_api::Reply;
use serde::Serialize;
use serde_json::json;

use crate::guest::agent::{Agent, AgentError, Stop, MAX_CALL_TIMEOUT};
use crate::guest::refresh::{RefreshState, RefreshStatus};

/// How long an exec waits for a refresh that is still running after a restore or fork.
const REFRESH_WAIT: Duration = Duration::from_secs(30);
/// How long a request waits for a clone its fork still holds: the fork's own bound on its
/// clones being ready, after which it kills them.
const HELD_WAIT: Duration = mayfly_api::FORK_READY_TIMEOUT;
/// The memory a listing's kept entries may take (names and entries, as
/// [`mayfly_agent_protocol::entry_bytes`] counts them): 8 MiB holds 100,000 entries of names
/// up to about 30 bytes, and with the answer serialized straight onto the socket bounds what
/// one listing costs the VMM to about twice that, whatever the guest sends. Past it (or past
/// [`MAX_LIST_ENTRIES`]) the listing is cut and says `"truncated": true`.
pub const MAX_LIST_BYTES: usize = 8 << 20;

/// The guest routes of one VM: its vsock socket (host side), if it has one, and its refresh
/// after a restore or fork, which guest routes wait for.
#[derive(Clone, Debug, Default)]
pub struct Routes {
    pub vsock: Option<PathBuf>,
    pub refresh: Arc<RefreshStatus>,
}

impl GuestRoutes for Routes {
    /// Serve one request for a guest route on `stream`.
    fn serve(&self, call: Call, request: &Request, stream: &UnixStream, cx: &Context) -> Outcome {
        let outcome = self.serve_call(call, request, stream, cx);
        if let Outcome::Written = outcome {
            // The answer is complete: say so now, whatever else still holds the connection.
            let _ = stream.shutdown(std::net::Shutdown::Write);
        }
        outcome
    }
}

impl Routes {
    fn serve_call(
        &self,
        call: Call,
        request: &Request,
        stream: &UnixStream,
        cx: &Context,
    ) -> Outcome {
        // Exec has its own timeout_ms (in its body); the other calls may ask for a deadline.
        let timeout = match &call {
            Call::Exec(_) | Call::Agent => None,
            _ => match call_timeout(request) {
                Ok(timeout) => timeout,
                Err(reply) => return reply.into(),
            },
        };
        let agent = match self.agent_for(cx) {
            Ok(agent) => agent,
            Err(reply) => return reply.into(),
        };
        let agent = match timeout {
            Some(timeout) => agent.with_timeout(timeout),
            None => agent,
        };
        // The client's hang-up ends the call (and an exec's command).
        let agent = match agent.clone().watching(stream) {
            Ok(watching) => watching,
            Err(_) => agent,
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
            Call::List { path } => return list(&path, stream, &agent),
            Call::Mkdir {
                path,
                mode,
                parents,
            } => agent
                .mkdir(&path, mode, parents)
                .map(|()| Reply::no_content())
                .map_err(agent_reply),
            Call::Agent => self.agent_status(&agent),
        };
        match result {
            Ok(reply) | Err(reply) => reply.into(),
        }
    }
}

/// The `timeout_ms` query parameter of a file route: the call's deadline.
fn call_timeout(request: &Request) -> Result<Option<Duration>, Reply> {
    let Some(text) = query_param(&request.query, "timeout_ms") else {
        return Ok(None);
    };
    let max = MAX_CALL_TIMEOUT.as_millis();
    match text.parse::<u64>() {
        Ok(ms) if ms >= 1 && u128::from(ms) <= max => Ok(Some(Duration::from_millis(ms))),
        _ => Err(Reply::error(
            400,
            format!(
                "the query parameter timeout_ms must be a whole number of milliseconds from 1 to {max}, not {text:?}"
            ),
        )),
    }
}

impl Routes {
    /// The VM's agent, once the VM runs and its refresh after a restore or fork is over.
    fn agent_for(&self, cx: &Context) -> Result<Agent, Reply> {
        let Some(vsock) = &self.vsock else {
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
        self.refresh.wait(REFRESH_WAIT);
        Ok(Agent::new(vsock))
    }

    fn agent_status(&self, agent: &Agent) -> Result<Reply, Reply> {
        let ping = agent
            .clone()
            .with_wait(Duration::from_secs(2))
            .ping()
            .map_err(agent_reply)?;
        let refresh = match self.refresh.state() {
            RefreshState::Idle => json!(null),
            RefreshState::Running => json!({"state": "running"}),
            RefreshState::Done(reply) => json!({"state": "done", "reply": reply}),
            RefreshState::Failed(why) => json!({"state": "failed", "error": why}),
        };
        Ok(Reply::ok(json!({"agent": ping, "refresh": refresh})))
    }
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
        // Nobody reads this one: the client is gone.
        AgentError::Stopped(Stop::HungUp) => 400,
        AgentError::Stopped(_) => 504,
        AgentError::Paused(_) => 409,
        AgentError::Api(_) => 502,
        AgentError::ApiStatus { status, .. } => *status,
    };
    Reply::error(status, e.to_string())
}

/// Answer 200 with `body` as JSON, serialized straight onto the socket: an answer that may
/// be tens of MiB (a listing, an exec's output) is never copied whole into memory first.
fn write_json(stream: &UnixStream, body: &impl Serialize) -> Outcome {
    /// Counts what would be written: the Content-Length, before anything is sent.
    struct Count(u64);
    impl Write for Count {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0 += buf.len() as u64;
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    if let Err(e) = serde_json::to_writer(&mut count, body) {
        return Reply::error(500, format!("cannot encode the answer: {e}")).into();
    }
    let head = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        count.0 + 1
    );
    let mut out = io::BufWriter::with_capacity(64 << 10, stream);
    let _ = out
        .write_all(head.as_bytes())
        .and_then(|()| serde_json::to_writer(&mut out, body).map_err(io::Error::from))
        .and_then(|()| out.write_all(b"\n"))
        .and_then(|()| out.flush());
    Outcome::Written
}

// ---------------------------------------------------------------------------------------
// exec

fn run_exec(exec: HttpExec, stream: &UnixStream, agent: &Agent, cx: &Context) -> Outcome {
    // Connect first, so that an agent that is not up is an ordinary error reply.
    let call = match agent.exec_call(&exec.request) {
        Ok(call) => call,
        Err(e) => return agent_reply(e).into(),
    };
    let signaller = call.signaller().clone();
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
        let result = call.run(
            exec.stdin.map(io::Cursor::new),
            |b| out.borrow_mut().output(Output::Stdout, b),
            |b| out.borrow_mut().output(Output::Stderr, b),
        );
        out.into_inner().end(result);
        return Outcome::Written;
    }
    drop(signaller);
    let mut stdout = BoundedOutput::new(MAX_COLLECTED);
    let mut stderr = BoundedOutput::new(MAX_COLLECTED);
    let result = call.run(
        exec.stdin.map(io::Cursor::new),
        |b| stdout.push(b),
        |b| stderr.push(b),
    );
    match result {
        Ok(exit) => write_json(stream, &exec_json(&exit, stdout, stderr)),
        Err(e) => agent_reply(e).into(),
    }
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

// ---------------------------------------------------------------------------------------
// files

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
    let body = StreamedBody {
        prefix: io::Cursor::new(request.body.clone()),
        stream,
        left: len,
    };
    let bytes = agent.write_file(path, options, body).map_err(agent_reply)?;
    Ok(Reply::ok(json!({ "bytes": bytes })))
}

fn read_file(path: &str, stream: &UnixStream, agent: &Agent) -> Outcome {
    let mut first = Vec::new();
    let mut head_sent: Option<Chunked> = None;
    // Buffer the first chunk: an error before any data (a missing file, an agent that is not
    // up) is still a proper reply, not a cut body.
    let result = agent.read_file(
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
        (Err(e), None) => agent_reply(e).into(),
    }
}

/// `GET /vm/files/list`: as much of the listing as [`MAX_LIST_ENTRIES`] and
/// [`MAX_LIST_BYTES`] keep, sorted by name; `count` is every entry the agent sent (all of the
/// directory unless `truncated`).
fn list(path: &str, stream: &UnixStream, agent: &Agent) -> Outcome {
    #[derive(Serialize)]
    struct Answer<'a> {
        count: u64,
        entries: &'a [DirEntry],
        truncated: bool,
    }
    let limits = ListLimits {
        max_entries: MAX_LIST_ENTRIES,
        max_bytes: MAX_LIST_BYTES,
    };
    match agent.list_limited(path, limits) {
        Ok(listing) => write_json(
            stream,
            &Answer {
                count: listing.received,
                entries: &listing.entries,
                truncated: listing.truncated,
            },
        ),
        Err(e) => agent_reply(e).into(),
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
