//! Which requests the control socket serves and what each becomes: the route table, and each
//! route's body checked and turned into an [`Action`] (or a message that says what to send).

use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use serde_json::{Map, Value};

use crate::action::{Action, ForkRequest};
use crate::body::{
    Count, ExposeBody, ForkBody, ForkParent, NetPolicyBody, NoBody, Port, SnapshotBody,
    UnexposeBody,
};
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
        path: "/vm/fork/capture",
        parse: |endpoint, body| match parse_fork(endpoint, body)? {
            Action::Fork(request) => Ok(Action::ForkCapture(request)),
            other => Ok(other),
        },
    },
    Route {
        method: "PUT",
        path: "/vm/fork/release",
        parse: |endpoint, body| no_body(endpoint, body).map(|()| Action::ForkCaptureRelease),
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
    Route {
        method: "PUT",
        path: "/vm/net/unexpose",
        parse: parse_net_unexpose,
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

/// A body of type `T`: a JSON object (an empty body is an empty one) with only `fields`, each of
/// the type `T` gives it. The message says which field is wrong and what it must be.
fn typed<T: serde::de::DeserializeOwned>(
    endpoint: &str,
    body: &[u8],
    fields: &[&str],
    example: &str,
) -> Result<T, String> {
    let mut object = Value::Object(json_object(endpoint, body, fields, example)?);
    crate::body::whole_numbers_as_integers(&mut object);
    serde_path_to_error::deserialize(object).map_err(|e| {
        let field = e.path().to_string();
        let inner = e.into_inner().to_string();
        format!("the field \"{field}\" of {endpoint} {}", must_be(&inner))
    })
}

/// serde's "invalid type: X, expected Y" as "must be Y, not X".
fn must_be(serde_message: &str) -> String {
    for prefix in ["invalid type: ", "invalid value: "] {
        if let Some((got, expected)) = serde_message
            .strip_prefix(prefix)
            .and_then(|rest| rest.split_once(", expected "))
        {
            return format!("must be {expected}, not {}", clip(got));
        }
    }
    if let Some(rest) = serde_message.strip_prefix("unknown variant ") {
        if let Some((got, expected)) = rest.split_once(", expected ") {
            return format!("must be {expected}, not {}", clip(got));
        }
    }
    format!("is not valid: {}", clip(serde_message))
}

fn no_body(endpoint: &str, body: &[u8]) -> Result<(), String> {
    typed::<NoBody>(endpoint, body, NoBody::FIELDS, NoBody::EXAMPLE).map(drop)
}

fn parse_snapshot(endpoint: &str, body: &[u8]) -> Result<Action, String> {
    const EXAMPLE: &str = SnapshotBody::EXAMPLE;
    let body: SnapshotBody = typed(endpoint, body, SnapshotBody::FIELDS, EXAMPLE)?;
    match body.path {
        None => Err(format!(
            "{endpoint} needs the field \"path\", the directory to write the snapshot to: \
             send e.g. {EXAMPLE}"
        )),
        Some(path) if path.is_empty() => Err(format!(
            "the field \"path\" of {endpoint} is empty: give the directory to write the \
             snapshot to, e.g. {EXAMPLE}"
        )),
        Some(path) if path.contains('\0') => Err(format!(
            "the field \"path\" of {endpoint} contains a NUL character"
        )),
        Some(path) => Ok(Action::Snapshot {
            path: PathBuf::from(path),
            diff: body.diff.unwrap_or(false),
        }),
    }
}

fn parse_net_policy(endpoint: &str, body: &[u8]) -> Result<Action, String> {
    const EXAMPLE: &str = NetPolicyBody::EXAMPLE;
    let body: NetPolicyBody = typed(endpoint, body, NetPolicyBody::FIELDS, EXAMPLE)?;
    let Some(text) = body.policy else {
        return Err(format!(
            "{endpoint} needs the field \"policy\" (none, open or allow=CIDR[:PORT],...): send \
             e.g. {EXAMPLE}"
        ));
    };
    text.parse::<mayfly_network::Policy>()
        .map(Action::NetPolicy)
        .map_err(|e| format!("the field \"policy\" of {endpoint}: {e}"))
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
    const EXAMPLE: &str = ExposeBody::EXAMPLE;
    let body: ExposeBody = typed(endpoint, body, ExposeBody::FIELDS, EXAMPLE)?;
    let Some(Port(port)) = body.port else {
        return Err(format!(
            "{endpoint} needs the field \"port\", the guest's port: send e.g. {EXAMPLE}"
        ));
    };
    let on = match body.on {
        None => mayfly_network::ExposeOn::Tcp(std::net::SocketAddr::from((
            std::net::Ipv4Addr::LOCALHOST,
            0,
        ))),
        Some(text) => {
            parse_expose_on(&text).map_err(|e| format!("the field \"on\" of {endpoint}: {e}"))?
        }
    };
    Ok(Action::NetExpose { port, on })
}

fn parse_net_unexpose(endpoint: &str, body: &[u8]) -> Result<Action, String> {
    const EXAMPLE: &str = UnexposeBody::EXAMPLE;
    let body: UnexposeBody = typed(endpoint, body, UnexposeBody::FIELDS, EXAMPLE)?;
    let Some(Port(port)) = body.port else {
        return Err(format!(
            "{endpoint} needs the field \"port\", the guest's port: send e.g. {EXAMPLE}"
        ));
    };
    let on = match body.on {
        None => None,
        Some(text) => Some(
            parse_expose_on(&text).map_err(|e| format!("the field \"on\" of {endpoint}: {e}"))?,
        ),
    };
    Ok(Action::NetUnexpose { port, on })
}

fn parse_fork(endpoint: &str, body: &[u8]) -> Result<Action, String> {
    const EXAMPLE: &str = ForkBody::EXAMPLE;
    let body: ForkBody = typed(endpoint, body, ForkBody::FIELDS, EXAMPLE)?;
    let Some(Count(count)) = body.count else {
        return Err(format!(
            "{endpoint} needs the field \"count\", the number of clones: send e.g. {EXAMPLE}"
        ));
    };
    Ok(Action::Fork(ForkRequest {
        count,
        name_prefix: body.name_prefix,
        parent_paused: body.parent == Some(ForkParent::Paused),
        overcommit: body.overcommit.unwrap_or(false),
    }))
}
