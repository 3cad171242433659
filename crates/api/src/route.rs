//! Which requests the control socket serves and what each becomes: the route table, and each
//! route's body checked and turned into an [`Action`] (or a message that says what to send).

use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use serde_json::{Map, Value};

use crate::action::{Action, ForkRequest, MAX_FORK_COUNT};
use crate::guest;
use crate::http::{self, Request};
use crate::reply::Reply;

/// A request refused before it reaches the VM.
pub struct Rejection {
    pub reply: Reply,
    /// The methods the path accepts, for a 405's `Allow` header.
    pub allow: Option<&'static str>,
}

/// One endpoint: its method, its path and how its body becomes an [`Action`] (or a message
/// saying what is wrong with it).
struct Route {
    method: &'static str,
    path: &'static str,
    parse: fn(&str, &[u8]) -> Result<Action, String>,
}

const ROUTES: &[Route] = &[
    Route {
        method: "GET",
        path: "/vm",
        parse: |endpoint, body| no_body(endpoint, body).map(|()| Action::Describe),
    },
    Route {
        method: "PUT",
        path: "/vm/pause",
        parse: |endpoint, body| no_body(endpoint, body).map(|()| Action::Pause),
    },
    Route {
        method: "PUT",
        path: "/vm/resume",
        parse: |endpoint, body| no_body(endpoint, body).map(|()| Action::Resume),
    },
    Route {
        method: "PUT",
        path: "/vm/snapshot",
        parse: parse_snapshot,
    },
    Route {
        method: "PUT",
        path: "/vm/fork",
        parse: parse_fork,
    },
    Route {
        method: "PUT",
        path: "/vm/shutdown",
        parse: |endpoint, body| no_body(endpoint, body).map(|()| Action::Shutdown),
    },
    Route {
        method: "GET",
        path: "/vm/net",
        parse: |endpoint, body| no_body(endpoint, body).map(|()| Action::Net),
    },
    Route {
        method: "PUT",
        path: "/vm/net/policy",
        parse: parse_net_policy,
    },
    Route {
        method: "PUT",
        path: "/vm/net/expose",
        parse: parse_net_expose,
    },
];

/// Every route the control socket serves, as (method, path): the VM's own and the guest's.
pub fn routes() -> impl Iterator<Item = (&'static str, &'static str)> {
    ROUTES
        .iter()
        .map(|r| (r.method, r.path))
        .chain(guest::ROUTES.iter().copied())
}

fn route_list() -> String {
    ROUTES
        .iter()
        .map(|r| format!("{} {}", r.method, r.path))
        .chain(guest::route_list())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Text from a client, cut short for an error message.
fn clip(text: &str) -> String {
    const MAX: usize = 100;
    match text.char_indices().nth(MAX) {
        Some((end, _)) => format!("{}...", &text[..end]),
        None => text.to_owned(),
    }
}

/// A JSON value from a client, cut short for an error message.
fn clip_json(value: &Value) -> String {
    clip(&value.to_string())
}

/// Read one request from `stream` and route it, as a connection's handler does before it
/// acts on it (nothing is acted on): the entry point of the control-socket fuzz target
/// (`fuzz/`). True if the request names an action.
#[doc(hidden)]
pub fn read_and_route(stream: &UnixStream, idle: Duration, total: Duration) -> bool {
    match http::read_request(stream, idle, total, guest::streams_body) {
        Ok(request) if guest::serves(&request.path) => guest::parse(&request).is_ok(),
        Ok(request) => route(&request).is_ok(),
        Err(_) => false,
    }
}

pub fn route(request: &Request) -> Result<Action, Rejection> {
    let rejection = |status, message| Rejection {
        reply: Reply::error(status, message),
        allow: None,
    };
    let Some(route) = ROUTES.iter().find(|r| r.path == request.path) else {
        return Err(rejection(
            404,
            format!(
                "there is no {}: mayfly serves {}",
                clip(&request.path),
                route_list()
            ),
        ));
    };
    if request.method != route.method {
        return Err(Rejection {
            reply: Reply::error(
                405,
                format!(
                    "{} {} is not supported: use {} {}",
                    clip(&request.method),
                    route.path,
                    route.method,
                    route.path
                ),
            ),
            allow: Some(route.method),
        });
    }
    let endpoint = format!("{} {}", route.method, route.path);
    (route.parse)(&endpoint, &request.body).map_err(|message| rejection(400, message))
}

/// The body as a JSON object with only the given fields; an empty body is an empty object.
fn json_object(
    endpoint: &str,
    body: &[u8],
    fields: &[&str],
    example: &str,
) -> Result<Map<String, Value>, String> {
    if body.trim_ascii().is_empty() {
        return Ok(Map::new());
    }
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        format!("the body of {endpoint} is not valid JSON ({e}): send e.g. {example}")
    })?;
    let Value::Object(object) = value else {
        return Err(format!(
            "the body of {endpoint} must be a JSON object, e.g. {example}"
        ));
    };
    if let Some(unknown) = object.keys().find(|key| !fields.contains(&key.as_str())) {
        let accepted = if fields.is_empty() {
            "it takes no body (or {})".to_owned()
        } else {
            format!("it accepts {}", fields.join(", "))
        };
        return Err(format!(
            "unknown field {:?} in the body of {endpoint}: {accepted}",
            clip(unknown)
        ));
    }
    Ok(object)
}

fn no_body(endpoint: &str, body: &[u8]) -> Result<(), String> {
    json_object(endpoint, body, &[], "{}").map(drop)
}

/// What kind of JSON value a client sent, for an error message.
fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn parse_snapshot(endpoint: &str, body: &[u8]) -> Result<Action, String> {
    const EXAMPLE: &str = r#"{"path": "/some/dir"}"#;
    let object = json_object(endpoint, body, &["path", "diff"], EXAMPLE)?;
    let diff = match object.get("diff") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(diff)) => *diff,
        Some(other) => {
            return Err(format!(
                "the field \"diff\" of {endpoint} must be true or false, not {}",
                kind(other)
            ))
        }
    };
    match object.get("path") {
        None | Some(Value::Null) => Err(format!(
            "{endpoint} needs the field \"path\", the directory to write the snapshot to: \
             send e.g. {EXAMPLE}"
        )),
        Some(Value::String(path)) if path.is_empty() => Err(format!(
            "the field \"path\" of {endpoint} is empty: give the directory to write the \
             snapshot to, e.g. {EXAMPLE}"
        )),
        Some(Value::String(path)) if path.contains('\0') => Err(format!(
            "the field \"path\" of {endpoint} contains a NUL character"
        )),
        Some(Value::String(path)) => Ok(Action::Snapshot {
            path: PathBuf::from(path),
            diff,
        }),
        Some(other) => Err(format!(
            "the field \"path\" of {endpoint} must be a string (a directory), not {}",
            kind(other)
        )),
    }
}

fn parse_net_policy(endpoint: &str, body: &[u8]) -> Result<Action, String> {
    const EXAMPLE: &str = r#"{"policy": "allow=192.0.2.0/24:443,198.51.100.7"}"#;
    let object = json_object(endpoint, body, &["policy"], EXAMPLE)?;
    match object.get("policy") {
        None | Some(Value::Null) => Err(format!(
            "{endpoint} needs the field \"policy\" (none, open or allow=CIDR[:PORT],...): send \
             e.g. {EXAMPLE}"
        )),
        Some(Value::String(text)) => text
            .parse::<mayfly_network::Policy>()
            .map(Action::NetPolicy)
            .map_err(|e| format!("the field \"policy\" of {endpoint}: {e}")),
        Some(other) => Err(format!(
            "the field \"policy\" of {endpoint} must be a string, not {}",
            kind(other)
        )),
    }
}

/// Where an exposed port listens on the host, as `tcp:ADDR:PORT` or `unix:PATH`.
pub fn parse_expose_on(text: &str) -> Result<mayfly_network::ExposeOn, String> {
    if let Some(addr) = text.strip_prefix("tcp:") {
        return addr
            .parse()
            .map(mayfly_network::ExposeOn::Tcp)
            .map_err(|_| format!("{:?} is not ADDR:PORT, e.g. tcp:127.0.0.1:8080", clip(text)));
    }
    match text.strip_prefix("unix:") {
        Some(path) if !path.is_empty() && !path.contains('\0') => {
            Ok(mayfly_network::ExposeOn::Unix(PathBuf::from(path)))
        }
        _ => Err(format!(
            "{:?} is not where to listen: give tcp:ADDR:PORT (port 0: a free one) or unix:PATH",
            clip(text)
        )),
    }
}

fn parse_net_expose(endpoint: &str, body: &[u8]) -> Result<Action, String> {
    const EXAMPLE: &str = r#"{"port": 8080, "on": "tcp:127.0.0.1:0"}"#;
    let object = json_object(endpoint, body, &["port", "on"], EXAMPLE)?;
    let port = match object.get("port") {
        None | Some(Value::Null) => {
            return Err(format!(
                "{endpoint} needs the field \"port\", the guest's port: send e.g. {EXAMPLE}"
            ))
        }
        Some(value) => value
            .as_u64()
            .and_then(|n| u16::try_from(n).ok())
            .filter(|&n| n != 0)
            .ok_or_else(|| {
                format!(
                    "the field \"port\" of {endpoint} must be a port from 1 to 65535, not {}",
                    clip_json(value)
                )
            })?,
    };
    let on = match object.get("on") {
        None | Some(Value::Null) => mayfly_network::ExposeOn::Tcp(std::net::SocketAddr::from((
            std::net::Ipv4Addr::LOCALHOST,
            0,
        ))),
        Some(Value::String(text)) => {
            parse_expose_on(text).map_err(|e| format!("the field \"on\" of {endpoint}: {e}"))?
        }
        Some(other) => {
            return Err(format!(
                "the field \"on\" of {endpoint} must be a string, not {}",
                kind(other)
            ))
        }
    };
    Ok(Action::NetExpose { port, on })
}

fn parse_fork(endpoint: &str, body: &[u8]) -> Result<Action, String> {
    const EXAMPLE: &str = r#"{"count": 2, "name_prefix": "web", "parent": "paused"}"#;
    let object = json_object(
        endpoint,
        body,
        &["count", "name_prefix", "parent", "overcommit"],
        EXAMPLE,
    )?;
    let count = match object.get("count") {
        None | Some(Value::Null) => {
            return Err(format!(
                "{endpoint} needs the field \"count\", the number of clones: send e.g. {EXAMPLE}"
            ))
        }
        Some(value) => value
            .as_u64()
            .filter(|&n| n <= u64::from(MAX_FORK_COUNT))
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| {
                format!(
                    "the field \"count\" of {endpoint} must be an integer from 0 to \
                     {MAX_FORK_COUNT} (the most clones mayfly allows in one fork), not {}",
                    clip_json(value)
                )
            })?,
    };
    let name_prefix = match object.get("name_prefix") {
        None | Some(Value::Null) => None,
        Some(Value::String(prefix)) => Some(prefix.clone()),
        Some(other) => {
            return Err(format!(
                "the field \"name_prefix\" of {endpoint} must be a string, not {}",
                kind(other)
            ))
        }
    };
    let parent_paused = match object.get("parent") {
        None | Some(Value::Null) => false,
        Some(Value::String(parent)) if parent == "running" => false,
        Some(Value::String(parent)) if parent == "paused" => true,
        Some(other) => {
            return Err(format!(
                "the field \"parent\" of {endpoint} must be \"running\" or \"paused\" (what the \
                 parent VM does after the fork), not {}",
                clip_json(other)
            ))
        }
    };
    let overcommit = match object.get("overcommit") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(overcommit)) => *overcommit,
        Some(other) => {
            return Err(format!(
                "the field \"overcommit\" of {endpoint} must be true or false (true: count only \
                 what starting the clones costs the host, not the guest memory they will write), \
                 not {}",
                clip_json(other)
            ))
        }
    };
    Ok(Action::Fork(ForkRequest {
        count,
        name_prefix,
        parent_paused,
        overcommit,
    }))
}
