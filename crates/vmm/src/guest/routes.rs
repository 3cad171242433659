//! The control socket's routes into the guest (exec and files; their wire side is
//! `mayfly_api::guest`), served through the guest's agent on the connection's own thread,
//! never the controller's: a command may run for an hour and a file may be gigabytes, and
//! neither may hold up pause, snapshot or fork. The controller is asked only whether the VM
//! runs (a paused VM's agent cannot answer: 409 at once instead of a wait).

use std::io::{self, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use mayfly_agent_protocol::{ErrorCode, ExitRecord, WriteFileOptions, MAX_PAYLOAD};
use mayfly_api::guest::{
    exec_json, BoundedOutput, Call, Context, GuestRoutes, HttpExec, Outcome, Utf8Pieces,
    MAX_COLLECTED, MAX_LIST_ENTRIES,
};
use mayfly_api::http::{Chunked, Request, StreamedBody};
use mayfly_api::Reply;
use serde_json::json;

use crate::guest::agent::{Agent, AgentError};
use crate::guest::refresh::{RefreshState, RefreshStatus};

/// How long an exec waits for a refresh that is still running after a restore or fork.
const REFRESH_WAIT: Duration = Duration::from_secs(30);
/// How long a request waits for a clone its fork still holds: the fork's own bound on its
/// clones being ready, after which it kills them.
const HELD_WAIT: Duration = mayfly_api::FORK_READY_TIMEOUT;

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
        let agent = match self.agent_for(cx) {
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
            Call::Agent => self.agent_status(&agent),
        };
        match result {
            Ok(reply) | Err(reply) => reply.into(),
        }
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
        AgentError::Paused(_) => 409,
        AgentError::Api(_) => 502,
        AgentError::ApiStatus { status, .. } => *status,
    };
    Reply::error(status, e.to_string())
}

// ---------------------------------------------------------------------------------------
// exec

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
    let label = mayfly_jail::seccomp::Label::current();
    std::thread::scope(|scope| {
        let watcher = std::thread::Builder::new()
            .name("api-exec-watch".into())
            .stack_size(mayfly_sys::HELPER_THREAD_STACK)
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
