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

/// A refusal: its status and its message.
pub type Refused = (u16, String);

/// The VM routes only the admin token reaches through the manager.
const ADMIN_VM_ROUTES: [&str; 3] = ["/vm/snapshot", "/vm/net/policy", "/vm/net/expose"];

/// How long the manager waits for a client to take the answer it streams.
const CLIENT_WRITE_TIMEOUT: Duration = Duration::from_secs(60);

fn refused(e: ServeError) -> Refused {
    (e.status(), e.to_string())
}

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
        return Err((401, NO_TOKEN.into()));
    };
    if manager.is_admin(token) {
        return Ok(true);
    }
    if admin_only {
        return Err((
            403,
            "this request needs the admin token (<state-dir>/admin.token)".into(),
        ));
    }
    match sandbox {
        Some(sandbox) if sandbox.token_is(token) => Ok(false),
        _ => Err((
            403,
            "the token is not this sandbox's (or was revoked): use the sandbox's own token or \
             the admin token"
                .into(),
        )),
    }
}

pub fn route(manager: &Manager, request: &Request, stream: &UnixStream) -> Result<(), Refused> {
    let method = request.method.as_str();
    let path = request.path.as_str();
    if path == "/metrics" {
        if method != "GET" {
            return Err((405, "GET /metrics".into()));
        }
        let text = manager.metrics.render(&manager.gauges());
        reply_document(stream, "text/plain; version=0.0.4", &text);
        return Ok(());
    }
    if path == "/openapi.json" {
        if method != "GET" {
            return Err((405, "GET /openapi.json".into()));
        }
        reply_document(stream, "application/json", OPENAPI);
        return Ok(());
    }
    if path == "/credentials/verify" {
        check_token(manager, request, None, true)?;
        if method != "POST" {
            return Err((405, "POST /credentials/verify".into()));
        }
        #[derive(serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Verify {
            credential: String,
        }
        let body: Verify = serde_json::from_slice(&request.body).map_err(|e| {
            (
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
            _ => Err((405, "GET or POST /sandboxes".into())),
        };
    }
    let Some(rest) = path.strip_prefix("/sandboxes/") else {
        return Err((
            404,
            format!(
                "no such route: {path} (the manager serves /sandboxes, /metrics and \
                 /openapi.json, which lists every route)"
            ),
        ));
    };
    let (name, tail) = rest.split_once('/').unwrap_or((rest, ""));
    let Some(sandbox) = manager.get(name) else {
        // The token is checked first only where it can be: an unknown name says so to the
        // admin, and gets the same 403 as a known one otherwise (names are not given away).
        let token = bearer(request).ok_or((401, NO_TOKEN.to_string()))?;
        if !manager.is_admin(token) {
            return Err((
                403,
                "the token is not this sandbox's (or was revoked)".into(),
            ));
        }
        return Err((
            404,
            format!("no sandbox named {name:?}: GET /sandboxes lists them"),
        ));
    };
    let admin_only = tail == "token" || tail == "fork";
    let admin = check_token(manager, request, Some(&sandbox), admin_only)?;
    match (method, tail) {
        ("GET", "") => reply(stream, 200, &manager.describe(&sandbox)),
        ("DELETE", "") => {
            manager.delete(&sandbox).map_err(refused)?;
            reply(stream, 200, &json!({ "deleted": name }));
        }
        ("PUT", "pause") => {
            manager.suspend(&sandbox).map_err(refused)?;
            reply(stream, 200, &manager.describe(&sandbox));
        }
        ("PUT", "resume") => {
            manager.ensure_running(&sandbox, true).map_err(refused)?;
            reply(stream, 200, &manager.describe(&sandbox));
        }
        ("PUT", "token") => {
            let token = manager.set_token(&sandbox, false).map_err(refused)?;
            reply(stream, 200, &json!({ "name": name, "token": token }));
        }
        ("DELETE", "token") => {
            manager.set_token(&sandbox, true).map_err(refused)?;
            reply(stream, 200, &json!({ "name": name, "token": null }));
        }
        ("POST", "fork") => {
            let body: ForkRequest = serde_json::from_slice(&request.body).map_err(|e| {
                (
                    400,
                    format!(
                        "{e}: send {{\"count\": N}} or {{\"names\": [...]}}, and \
                         \"idle_timeout_s\" if wanted"
                    ),
                )
            })?;
            let forked = fork(manager, &sandbox, &body).map_err(refused)?;
            reply(stream, 201, &forked);
        }
        (_, "" | "pause" | "resume" | "token" | "fork") => {
            return Err((
                405,
                format!("{method} is not served on {path}: see the routes in the README"),
            ))
        }
        _ => {
            let Some((_, vm)) = vm_path(path) else {
                return Err((
                    404,
                    format!("no such route: {path} (a sandbox's VM is under /sandboxes/{name}/vm)"),
                ));
            };
            // What a sandbox's own token may not do to its VM: write a snapshot where it
            // chooses (over another sandbox's, say) or change the network the admin set.
            if !admin && ADMIN_VM_ROUTES.contains(&vm.as_str()) {
                return Err((
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
    let body: Value = serde_json::from_slice(&request.body).map_err(|e| {
        (
            400,
            format!("the body is not JSON ({e}): send {{\"name\": \"my-sandbox\", ...}}"),
        )
    })?;
    let Value::Object(mut fields) = body else {
        return Err((
            400,
            "send a JSON object: {\"name\": \"my-sandbox\", ...}".into(),
        ));
    };
    let name = match fields.remove("name") {
        Some(Value::String(name)) => name,
        _ => {
            return Err((
                400,
                "\"name\" is required: a DNS label such as \"my-sandbox\"".into(),
            ))
        }
    };
    let spec: Spec = serde_json::from_value(Value::Object(fields)).map_err(|e| {
        (
            400,
            format!(
                "{e}: a sandbox takes name, snapshot, template, kernel, initrd, cmdline, mem_mib, \
                 vcpus, rootfs, net, idle_timeout_s"
            ),
        )
    })?;
    let (mut described, token) = manager.create(&name, spec).map_err(refused)?;
    if let Some(object) = described.as_object_mut() {
        object.insert("token".into(), Value::String(token));
    }
    reply(stream, 201, &described);
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
        return Err((
            409,
            "a sandbox is forked by the manager, which names its clones: POST \
             /sandboxes/NAME/fork {\"count\": N}"
                .into(),
        ));
    }
    if vm == "/vm/shutdown" && request.method == "PUT" {
        return Err((
            409,
            "a sandbox's VMM is ended by the manager: DELETE /sandboxes/NAME, or PUT \
             /sandboxes/NAME/pause to suspend it"
                .into(),
        ));
    }
    let (_activity, sock) = manager.enter(sandbox).map_err(refused)?;
    let vmm = UnixStream::connect(&sock).map_err(|e| {
        (
            502,
            format!(
                "cannot reach the VMM of {} at {}: {e}",
                sandbox.name,
                sock.display()
            ),
        )
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
        return Err((
            502,
            format!("cannot send the request to {}'s VMM: {e}", sandbox.name),
        ));
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
            error_reply(
                client,
                502,
                format!(
                    "the VMM of {} closed the connection without an answer",
                    sandbox.name
                ),
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
