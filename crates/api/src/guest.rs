//! The control socket's routes into the guest, through its agent: exec and files. This is
//! their wire side (which routes, their query parameters and bodies, checked before anything
//! reaches the guest); the VMM serves them through [`GuestRoutes`] (crates/vmm/src/guest/).
//! They are served on the connection's own thread, never the controller's:
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

use std::os::unix::net::UnixStream;
use std::time::Duration;

use mayfly_agent_protocol::{base64, ExecRequest, ExitRecord, WriteFileOptions};
use serde_json::{Map, Value};

use crate::http::{query_param, Request};
use crate::reply::Reply;

/// How much of each output stream a non-streaming exec keeps; the rest is counted.
pub const MAX_COLLECTED: usize = 16 << 20;
/// Entries a listing answers with at most.
pub const MAX_LIST_ENTRIES: usize = 100_000;

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

/// What serves the guest routes: the VMM, through the guest's agent. Called on the
/// connection's own thread with a request [`parse`] accepted; it may answer with a reply, or
/// write a (streamed) answer itself.
pub trait GuestRoutes: Send + Sync {
    fn serve(&self, call: Call, request: &Request, stream: &UnixStream, cx: &Context) -> Outcome;
}

/// What a route handler may do besides the agent: ask the controller.
pub struct Context<'a> {
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

// ---------------------------------------------------------------------------------------
// exec

/// An exec request as the control socket takes it.
#[derive(Debug)]
pub struct HttpExec {
    /// What the agent runs.
    pub request: ExecRequest,
    /// Bytes for the command's stdin, if any.
    pub stdin: Option<Vec<u8>>,
    /// Whether the answer streams (chunked NDJSON) or comes whole at the end.
    pub stream: bool,
}

/// Check an exec body as `POST /vm/exec` does, acting on nothing: the entry point of the exec
/// body's fuzz target (`fuzz/`). True if the body is a valid exec request.
#[doc(hidden)]
pub fn check_exec_body(body: &[u8]) -> bool {
    parse_exec(body).is_ok()
}

fn parse_exec(body: &[u8]) -> Result<HttpExec, String> {
    const EXAMPLE: &str = r#"{"argv": ["uname", "-a"]} or {"shell": "ls /", "timeout_ms": 5000}"#;
    let mut value: Value = serde_json::from_slice(body).map_err(|e| {
        format!("the body of POST /vm/exec is not valid JSON ({e}): send e.g. {EXAMPLE}")
    })?;
    crate::body::whole_numbers_as_integers(&mut value);
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

/// Splits a byte stream into JSON-safe pieces: text where it is UTF-8 (a character cut
/// between two chunks waits for the rest), base64 where it is not. Nothing is lost.
#[derive(Default)]
pub struct Utf8Pieces {
    pending: Vec<u8>,
}

impl Utf8Pieces {
    /// The next piece for `data`: (is_text, text or base64).
    pub fn push(&mut self, data: &[u8]) -> Option<(bool, String)> {
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
    pub fn finish(&mut self) -> Option<(bool, String)> {
        let bytes = std::mem::take(&mut self.pending);
        (!bytes.is_empty()).then(|| (false, base64::encode(&bytes)))
    }
}

/// Output kept in memory up to a bound; what does not fit is counted, not kept (an exec
/// answered in one piece must not let a guest fill the host's memory).
#[derive(Debug)]
pub struct BoundedOutput {
    bytes: Vec<u8>,
    limit: usize,
    dropped: u64,
}

impl BoundedOutput {
    pub fn new(limit: usize) -> Self {
        Self {
            bytes: Vec::new(),
            limit,
            dropped: 0,
        }
    }

    pub fn push(&mut self, data: &[u8]) {
        let room = self.limit.saturating_sub(self.bytes.len());
        let keep = data.len().min(room);
        self.bytes.extend_from_slice(&data[..keep]);
        self.dropped += (data.len() - keep) as u64;
    }

    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Bytes that did not fit.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Into `body` as `name` (text), or `name_base64` when it is not UTF-8, and
    /// `name_dropped` when some did not fit.
    pub fn into_json(self, name: &str, body: &mut serde_json::Map<String, serde_json::Value>) {
        use serde_json::Value;
        match String::from_utf8(self.bytes) {
            Ok(text) => body.insert(name.into(), Value::String(text)),
            Err(e) => body.insert(
                format!("{name}_base64"),
                Value::String(base64::encode(e.as_bytes())),
            ),
        };
        if self.dropped > 0 {
            body.insert(format!("{name}_dropped"), serde_json::json!(self.dropped));
        }
    }
}

/// An exec's answer as one JSON object: `{"exit": ..., "stdout": ..., "stderr": ...}`.
pub fn exec_json(
    exit: &ExitRecord,
    stdout: BoundedOutput,
    stderr: BoundedOutput,
) -> serde_json::Value {
    let mut body = serde_json::Map::new();
    body.insert(
        "exit".into(),
        serde_json::to_value(exit).unwrap_or_default(),
    );
    stdout.into_json("stdout", &mut body);
    stderr.into_json("stderr", &mut body);
    serde_json::Value::Object(body)
}

/// For the route listing in 404s.
pub fn route_list() -> impl Iterator<Item = String> {
    ROUTES.iter().map(|(m, p)| format!("{m} {p}"))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

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
