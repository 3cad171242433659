//! HTTP routing: which request is what (see the table in the crate's docs), whom its token
//! speaks for, and its answer, errors as `{"error": "..."}` with the status of their kind
//! ([`ServeError::status`]). Requests for a sandbox's VM are passed to its VMM's own control
//! socket as they are, streamed both ways.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde_json::{json, Value};

use mayfly_api::http::{self, Request};

use crate::credential::GUEST_PATH;
use crate::error::ServeError;
use crate::fork::{fork, ForkRequest};
use crate::manager::Manager;
use crate::openapi::OPENAPI;
use crate::records::Spec;
use crate::sandbox::Sandbox;

/// How long a client may take to send its request (between reads).
pub const REQUEST_IDLE: Duration = Duration::from_secs(10);

pub fn reply(stream: &UnixStream, status: u16, body: &Value) {
    let _ = (&mut &*stream).write_all(&http::encode_response(status, Some(body), &[]));
}

/// A 200 with `body` as it is (the metrics text, the OpenAPI document).
fn reply_document(stream: &UnixStream, content_type: &str, body: &str) {
    let head = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let _ = (&mut &*stream).write_all(head.as_bytes());
    let _ = (&mut &*stream).write_all(body.as_bytes());
}

pub fn error_reply(stream: &UnixStream, status: u16, message: impl Into<String>) {
    reply(stream, status, &json!({ "error": message.into() }));
}

/// Whether a request's body is streamed to the VMM rather than read here: a file upload.
pub fn streamed(method: &str, path: &str) -> bool {
    vm_path(path).is_some_and(|(_, rest)| mayfly_api::guest::streams_body(method, &rest))
}

/// `/sandboxes/NAME/vm...` → (NAME, `/vm...`).
fn vm_path(path: &str) -> Option<(&str, String)> {
    let rest = path.strip_prefix("/sandboxes/")?;
    let (name, tail) = rest.split_once('/')?;
    (tail == "vm" || tail.starts_with("vm/")).then(|| (name, format!("/{tail}")))
}

fn bearer(request: &Request) -> Option<&str> {
    request
        .authorization
        .as_deref()
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
}

/// A refusal: its status, its message (the body `{"error": message}`), and for a 405 the
/// methods the path serves (its `Allow` header, RFC 9110).
#[derive(Debug)]
pub struct Refused {
    pub status: u16,
    pub message: String,
    pub allow: Option<String>,
}

impl Refused {
    pub fn new(status: u16, message: impl Into<String>) -> Refused {
        Refused {
            status,
            message: message.into(),
            allow: None,
        }
    }

    /// 405: the path serves only the methods in `allow`.
    fn method(allow: &str, message: impl Into<String>) -> Refused {
        Refused {
            allow: Some(allow.to_owned()),
            ..Refused::new(405, message)
        }
    }

    /// What the VMM's own checks answered (see [`check_as_the_vmm_would`]).
    fn from_reply(reply: &mayfly_api::Reply, allow: Option<String>) -> Refused {
        let message = reply
            .body
            .as_ref()
            .and_then(|b| b["error"].as_str())
            .unwrap_or_default();
        Refused {
            allow,
            ..Refused::new(reply.status, message)
        }
    }
}

impl From<ServeError> for Refused {
    fn from(e: ServeError) -> Refused {
        Refused::new(e.status(), e.to_string())
    }
}

/// Answer a refusal: its status, `{"error": message}`, and `Allow` for a 405.
pub fn refusal_reply(stream: &UnixStream, refused: &Refused) {
    let headers: Vec<(&str, &str)> = refused
        .allow
        .as_deref()
        .map(|methods| ("Allow", methods))
        .into_iter()
        .collect();
    let body = json!({ "error": refused.message });
    let _ = (&mut &*stream).write_all(&http::encode_response(
        refused.status,
        Some(&body),
        &headers,
    ));
}

/// The VM routes only the admin token reaches through the manager.
const ADMIN_VM_ROUTES: [&str; 3] = ["/vm/snapshot", "/vm/net/policy", "/vm/net/expose"];

/// How long the manager waits for a client to take the answer it streams.
const CLIENT_WRITE_TIMEOUT: Duration = Duration::from_secs(60);

const NO_TOKEN: &str = "this request needs a token: send Authorization: Bearer TOKEN (the \
    sandbox's, from its create, or the admin token in <state-dir>/admin.token)";

/// Whom the request's token speaks for: the admin (true), or the sandbox it names (false).
fn check_token(
    manager: &Manager,
    request: &Request,
    sandbox: Option<&Sandbox>,
    admin_only: bool,
) -> Result<bool, Refused> {
    let Some(token) = bearer(request) else {
        return Err(Refused::new(401, NO_TOKEN));
    };
    if manager.is_admin(token) {
        return Ok(true);
    }
    if admin_only {
        return Err(Refused::new(
            403,
            "this request needs the admin token (<state-dir>/admin.token)",
        ));
    }
    match sandbox {
        Some(sandbox) if sandbox.token_is(token) => Ok(false),
        _ => Err(Refused::new(
            403,
            "the token is not this sandbox's (or was revoked): use the sandbox's own token or \
             the admin token",
        )),
    }
}

/// The methods a sandbox's own route (`/sandboxes/NAME` and what follows it, but `vm`)
/// serves, for a 405's `Allow`; None for a route that is not one of them.
fn sandbox_route_methods(tail: &str) -> Option<&'static str> {
    match tail {
        "" => Some("GET, DELETE"),
        "pause" | "resume" => Some("PUT"),
        "token" => Some("PUT, DELETE"),
        "fork" => Some("POST"),
        _ => None,
    }
}

pub fn route(manager: &Manager, request: &Request, stream: &UnixStream) -> Result<(), Refused> {
    let method = request.method.as_str();
    let path = request.path.as_str();
    if path == "/metrics" {
        if method != "GET" {
            return Err(Refused::method("GET", "GET /metrics"));
        }
        let text = manager.metrics.render(&manager.gauges());
        reply_document(stream, "text/plain; version=0.0.4", &text);
        return Ok(());
    }
    if path == "/openapi.json" {
        if method != "GET" {
            return Err(Refused::method("GET", "GET /openapi.json"));
        }
        reply_document(stream, "application/json", OPENAPI);
        return Ok(());
    }
    if path == "/credentials/verify" {
        check_token(manager, request, None, true)?;
        if method != "POST" {
            return Err(Refused::method("POST", "POST /credentials/verify"));
        }
        #[derive(serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Verify {
            credential: String,
        }
        let body: Verify = serde_json::from_slice(&request.body).map_err(|e| {
            Refused::new(
                400,
                format!(
                    "bad body ({e}): send {{\"credential\": \"mfc_...\"}} (the guest's {})",
                    GUEST_PATH
                ),
            )
        })?;
        reply(stream, 200, &manager.verify_credential(&body.credential));
        return Ok(());
    }
    if path == "/sandboxes" {
        check_token(manager, request, None, true)?;
        return match method {
            "GET" => {
                reply(stream, 200, &json!({ "sandboxes": manager.list() }));
                Ok(())
            }
            "POST" => create(manager, request, stream),
            _ => Err(Refused::method("GET, POST", "GET or POST /sandboxes")),
        };
    }
    let Some(rest) = path.strip_prefix("/sandboxes/") else {
        return Err(Refused::new(
            404,
            format!(
                "no such route: {path} (the manager serves /sandboxes, /metrics and \
                 /openapi.json, which lists every route)"
            ),
        ));
    };
    let (name, tail) = rest.split_once('/').unwrap_or((rest, ""));
    let token = bearer(request).ok_or_else(|| Refused::new(401, NO_TOKEN))?;
    // A method the route does not serve is a 405 whatever the sandbox (the routes are the
    // same for every name, so this gives nothing away).
    if let Some(allow) = sandbox_route_methods(tail) {
        if !allow.split(", ").any(|m| m == method) {
            return Err(Refused::method(
                allow,
                format!("{method} is not served on {path}: see the routes in the README"),
            ));
        }
    } else if let Some((_, vm)) = vm_path(path) {
        if !vmm_serves_method(method, &vm) {
            // The VMM's own 405, with its Allow.
            return Err(check_as_the_vmm_would(request, &vm)
                .err()
                .unwrap_or_else(|| Refused::new(405, format!("{method} {vm} is not served"))));
        }
    }
    let Some(sandbox) = manager.get(name) else {
        // The token is checked first only where it can be: an unknown name says so to the
        // admin, and gets the same 403 as a known one otherwise (names are not given away).
        if !manager.is_admin(token) {
            return Err(Refused::new(
                403,
                "the token is not this sandbox's (or was revoked)",
            ));
        }
        return Err(Refused::new(
            404,
            format!("no sandbox named {name:?}: GET /sandboxes lists them"),
        ));
    };
    let admin_only = tail == "token" || tail == "fork";
    let admin = check_token(manager, request, Some(&sandbox), admin_only)?;
    match (method, tail) {
        ("GET", "") => reply(stream, 200, &manager.describe(&sandbox)),
        ("DELETE", "") => {
            manager.delete(&sandbox)?;
            reply(stream, 200, &json!({ "deleted": name }));
        }
        ("PUT", "pause") => {
            manager.suspend(&sandbox)?;
            reply(stream, 200, &manager.describe(&sandbox));
        }
        ("PUT", "resume") => {
            manager.ensure_running(&sandbox, true)?;
            reply(stream, 200, &manager.describe(&sandbox));
        }
        ("PUT", "token") => {
            let token = manager.set_token(&sandbox, false)?;
            reply(stream, 200, &json!({ "name": name, "token": token }));
        }
        ("DELETE", "token") => {
            manager.set_token(&sandbox, true)?;
            reply(stream, 200, &json!({ "name": name, "token": null }));
        }
        ("POST", "fork") => {
            let mut body: Value = serde_json::from_slice(&request.body).map_err(|e| {
                Refused::new(
                    400,
                    format!(
                        "{e}: send {{\"count\": N}} or {{\"names\": [...]}}, and \
                         \"idle_timeout_s\" if wanted"
                    ),
                )
            })?;
            mayfly_api::body::whole_numbers_as_integers(&mut body);
            let body: ForkRequest = serde_json::from_value(body).map_err(|e| {
                Refused::new(
                    400,
                    format!(
                        "{e}: send {{\"count\": N}} or {{\"names\": [...]}}, and \
                         \"idle_timeout_s\" if wanted"
                    ),
                )
            })?;
            let forked = fork(manager, &sandbox, &body)?;
            reply(stream, 201, &forked);
        }
        _ => {
            let Some((_, vm)) = vm_path(path) else {
                return Err(Refused::new(
                    404,
                    format!("no such route: {path} (a sandbox's VM is under /sandboxes/{name}/vm)"),
                ));
            };
            // What a sandbox's own token may not do to its VM: write a snapshot where it
            // chooses (over another sandbox's, say) or change the network the admin set.
            if !admin && ADMIN_VM_ROUTES.contains(&vm.as_str()) {
                return Err(Refused::new(
                    403,
                    format!("{vm} needs the admin token: a sandbox's own token cannot change where its snapshots go or what its network allows"),
                ));
            }
            return pass_to_vmm(manager, &sandbox, request, &vm, stream);
        }
    }
    Ok(())
}

fn create(manager: &Manager, request: &Request, stream: &UnixStream) -> Result<(), Refused> {
    let mut body: Value = serde_json::from_slice(&request.body).map_err(|e| {
        Refused::new(
            400,
            format!("the body is not JSON ({e}): send {{\"name\": \"my-sandbox\", ...}}"),
        )
    })?;
    mayfly_api::body::whole_numbers_as_integers(&mut body);
    let Value::Object(mut fields) = body else {
        return Err(Refused::new(
            400,
            "send a JSON object: {\"name\": \"my-sandbox\", ...}",
        ));
    };
    let name = match fields.remove("name") {
        Some(Value::String(name)) => name,
        _ => {
            return Err(Refused::new(
                400,
                "\"name\" is required: a DNS label such as \"my-sandbox\"",
            ))
        }
    };
    let spec: Spec = serde_json::from_value(Value::Object(fields)).map_err(|e| {
        Refused::new(
            400,
            format!(
                "{e}: a sandbox takes name, snapshot, template, kernel, initrd, cmdline, mem_mib, \
                 vcpus, rootfs, net, idle_timeout_s"
            ),
        )
    })?;
    // What the admin names is read by root before any jail: only files in the images
    // directories, reached without links, and checked before anything else looks at them.
    manager.confine(&spec)?;
    let (mut described, token) = manager.create(&name, spec)?;
    if let Some(object) = described.as_object_mut() {
        object.insert("token".into(), Value::String(token));
    }
    reply(stream, 201, &described);
    Ok(())
}

/// Refuse here what the VMM would refuse (the route table, methods, bodies and query
/// parameters, checked by the VMM's own code): a request the VMM cannot take wakes no
/// sleeping sandbox, and a dead one's answer says what is wrong with the request first.
fn check_as_the_vmm_would(request: &Request, vm: &str) -> Result<(), Refused> {
    let as_sent = Request {
        method: request.method.clone(),
        path: vm.to_owned(),
        query: request.query.clone(),
        body: request.body.clone(),
        streamed_body_len: request.streamed_body_len,
        authorization: None,
    };
    if mayfly_api::guest::serves(vm) {
        return mayfly_api::guest::parse(&as_sent)
            .map(drop)
            .map_err(|reply| {
                let allow = (reply.status == 405).then(|| mayfly_api::guest::methods(vm));
                Refused::from_reply(&reply, allow)
            });
    }
    mayfly_api::route::route(&as_sent)
        .map(drop)
        .map_err(|rejection| {
            Refused::from_reply(&rejection.reply, rejection.allow.map(str::to_owned))
        })
}

/// Whether `method` is one the VMM serves on `vm` (true for a path it does not serve: that
/// is a 404, not a 405).
fn vmm_serves_method(method: &str, vm: &str) -> bool {
    let mut methods = mayfly_api::routes().filter(|(_, p)| *p == vm).peekable();
    methods.peek().is_none() || methods.any(|(m, _)| m == method)
}

/// A jailed sandbox's network routes: it has no NIC (a jailed VM cannot have one yet), so
/// nothing sent there can be done, whatever it says.
fn check_network(sandbox: &Sandbox, vm: &str) -> Result<(), Refused> {
    let network_route = (vm == "/vm/net" || vm.starts_with("/vm/net/"))
        && mayfly_api::routes().any(|(_, path)| path == vm);
    if sandbox.jailed() && network_route {
        return Err(Refused::new(
            409,
            format!(
                "sandbox {} has no NIC: this manager jails its sandboxes, and a jailed VM \
                 cannot have one yet (a manager started with --no-jail gives sandboxes networks)",
                sandbox.name
            ),
        ));
    }
    Ok(())
}

/// What a sandbox's VMM cannot do, as the manager knows without waking it: its guest's
/// routes with no agent in its guest (the probe's, or a create's `no_agent`), and a
/// snapshot where its jail cannot write.
fn check_what_it_can_do(sandbox: &Sandbox, request: &Request, vm: &str) -> Result<(), Refused> {
    let name = &sandbox.name;
    if mayfly_api::guest::serves(vm) && sandbox.spec().agentless() {
        return Err(Refused::new(
            409,
            format!(
                "sandbox {name} has no guest agent (it was made with \"probe\" or \"no_agent\"): \
                 {} {vm} needs mayfly-agent running in its guest",
                request.method
            ),
        ));
    }
    if vm == "/vm/snapshot" && sandbox.jailed() {
        let body: mayfly_api::body::SnapshotBody =
            serde_json::from_slice(&request.body).unwrap_or_default();
        let own = sandbox.vm_dir();
        let path = std::path::Path::new(body.path.as_deref().unwrap_or_default());
        let within = path.starts_with(&own)
            && !path
                .components()
                .any(|c| c == std::path::Component::ParentDir);
        if !within {
            return Err(Refused::new(
                403,
                format!(
                    "sandbox {name} is jailed: its VMM can write only under {}: snapshot into a \
                     directory there",
                    own.display()
                ),
            ));
        }
    }
    Ok(())
}

/// Pass a request for a sandbox's VM to its VMM (waking it first) and stream the answer back
/// as it comes. Routes the manager must see are refused: a fork (its clones would be
/// sandboxes nobody knows) and a shutdown (delete or pause the sandbox instead).
fn pass_to_vmm(
    manager: &Manager,
    sandbox: &Sandbox,
    request: &Request,
    vm: &str,
    client: &UnixStream,
) -> Result<(), Refused> {
    if vm == "/vm/fork" && request.method == "PUT" {
        return Err(Refused::new(
            409,
            "a sandbox is forked by the manager, which names its clones: POST \
             /sandboxes/NAME/fork {\"count\": N}",
        ));
    }
    if vm == "/vm/shutdown" && request.method == "PUT" {
        return Err(Refused::new(
            409,
            "a sandbox's VMM is ended by the manager: DELETE /sandboxes/NAME, or PUT \
             /sandboxes/NAME/pause to suspend it",
        ));
    }
    check_network(sandbox, vm)?;
    check_as_the_vmm_would(request, vm)?;
    check_what_it_can_do(sandbox, request, vm)?;
    let (_activity, sock) = manager.enter(sandbox)?;
    // A VMM that cannot be reached may have just ended: then the sandbox is dead, and the
    // answer says so (as any request for a dead sandbox is told), not 502.
    let unreachable = |what: String| -> Refused {
        match manager.check_vmm_alive(sandbox) {
            Err(dead) => dead.into(),
            Ok(()) => Refused::new(502, what),
        }
    };
    let vmm = UnixStream::connect(&sock).map_err(|e| {
        unreachable(format!(
            "cannot reach the VMM of {} at {}: {e}",
            sandbox.name,
            sock.display()
        ))
    })?;
    let body_len = request
        .streamed_body_len
        .unwrap_or(request.body.len() as u64);
    let target = if request.query.is_empty() {
        vm.to_owned()
    } else {
        format!("{vm}?{}", request.query)
    };
    let head = format!(
        "{} {target} HTTP/1.1\r\nHost: mayfly\r\nContent-Length: {body_len}\r\nConnection: close\r\n\r\n",
        request.method
    );
    let sent = (&mut &vmm)
        .write_all(head.as_bytes())
        .and_then(|()| (&mut &vmm).write_all(&request.body));
    if let Err(e) = sent {
        return Err(unreachable(format!(
            "cannot send the request to {}'s VMM: {e}",
            sandbox.name
        )));
    }
    let exec = vm == "/vm/exec";
    if exec {
        manager.metrics.execs.fetch_add(1, Ordering::Relaxed);
    }
    // The rest of a streamed body goes on from the client while the answer comes back.
    let upload = request
        .streamed_body_len
        .map(|len| len.saturating_sub(request.body.len() as u64))
        .filter(|left| *left > 0);
    let _ = client.set_read_timeout(Some(REQUEST_IDLE));
    let to_vmm = &vmm;
    std::thread::scope(|scope| {
        if let Some(left) = upload {
            scope.spawn(move || {
                let mut from = client.take(left);
                let _ = std::io::copy(&mut from, &mut &*to_vmm);
            });
        }
        // The first bytes say the status: an exec answered with an error counts as failed.
        let mut first = [0u8; 16];
        let n = (&mut &vmm).read(&mut first).unwrap_or(0);
        if exec && (n < 12 || !first[..n].starts_with(b"HTTP/1.1 2")) {
            manager.metrics.execs_failed.fetch_add(1, Ordering::Relaxed);
        }
        if n == 0 {
            refusal_reply(
                client,
                &unreachable(format!(
                    "the VMM of {} closed the connection without an answer",
                    sandbox.name
                )),
            );
            return;
        }
        // A client that stops reading is cut after a while: it holds a connection and keeps
        // the sandbox from going idle.
        let _ = client.set_write_timeout(Some(CLIENT_WRITE_TIMEOUT));
        if (&mut &*client).write_all(&first[..n]).is_ok() {
            let _ = std::io::copy(&mut &vmm, &mut &*client);
        }
        // Whatever the client still sends is not waited for.
        let _ = vmm.shutdown(std::net::Shutdown::Both);
    });
    Ok(())
}
