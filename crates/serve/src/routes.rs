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

/// The request's bearer token, exactly as sent after `Bearer ` (nothing trimmed: a token is
/// accepted in one spelling only).
pub fn bearer(request: &Request) -> Option<&str> {
    request
        .authorization
        .as_deref()
        .and_then(|v| v.strip_prefix("Bearer "))
}

/// A request's body as the JSON object `T` reads (an empty body as `{}` when `empty_ok`):
/// anything but an object (`null`, an array, a number) is a 400, as is what `T` refuses.
fn object_body<T: serde::de::DeserializeOwned>(
    request: &Request,
    empty_ok: bool,
    example: &str,
) -> Result<T, Refused> {
    let bad = |e: String| Refused::new(400, format!("{e}: send a JSON object such as {example}"));
    let mut body: Value = if empty_ok && request.body.iter().all(u8::is_ascii_whitespace) {
        json!({})
    } else {
        serde_json::from_slice(&request.body)
            .map_err(|e| bad(format!("the body is not JSON ({e})")))?
    };
    if !body.is_object() {
        return Err(bad("the body is not a JSON object".into()));
    }
    mayfly_api::body::whole_numbers_as_integers(&mut body);
    serde_json::from_value(body).map_err(|e| bad(e.to_string()))
}

/// The body of `PUT /sandboxes/NAME/token` (may be empty).
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenBody {
    #[serde(default)]
    ttl_s: Option<u64>,
}

/// The body of `POST /sandboxes/NAME/credential` (may be empty).
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct CredentialBody {
    #[serde(default)]
    audience: Option<String>,
    #[serde(default)]
    ttl_s: Option<u64>,
}

/// The longest audience a credential may name.
const MAX_AUDIENCE: usize = 256;

/// A lifetime in seconds: 1 s to ten years.
fn check_ttl(ttl_s: Option<u64>, what: &str) -> Result<(), Refused> {
    match ttl_s {
        Some(ttl) if ttl == 0 || ttl > 10 * 365 * 86_400 => Err(Refused::new(
            400,
            format!("\"{what}\" must be 1 to 315360000 seconds (leave it out for no expiry)"),
        )),
        _ => Ok(()),
    }
}

/// A refusal: its status, its message (the body `{"error": message}`), and for a 405 the
/// methods the path serves (its `Allow` header, RFC 9110).
#[derive(Debug)]
pub struct Refused {
    pub status: u16,
    pub message: String,
    pub allow: Option<String>,
    /// Seconds to wait before trying again (a 429's or 503's `Retry-After`).
    pub retry_after: Option<u32>,
}

impl Refused {
    pub fn new(status: u16, message: impl Into<String>) -> Refused {
        Refused {
            status,
            message: message.into(),
            allow: None,
            retry_after: None,
        }
    }

    /// A refusal to be tried again in `seconds` (`Retry-After`).
    pub fn later(status: u16, seconds: u32, message: impl Into<String>) -> Refused {
        Refused {
            retry_after: Some(seconds),
            ..Refused::new(status, message)
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

/// Answer a refusal: its status, `{"error": message}`, `Allow` for a 405 and `Retry-After`
/// when it says when to try again.
pub fn refusal_reply(stream: &UnixStream, refused: &Refused) {
    let retry = refused.retry_after.map(|s| s.to_string());
    let headers: Vec<(&str, &str)> = refused
        .allow
        .as_deref()
        .map(|methods| ("Allow", methods))
        .into_iter()
        .chain(retry.as_deref().map(|s| ("Retry-After", s)))
        .collect();
    let body = json!({ "error": refused.message });
    let _ = (&mut &*stream).write_all(&http::encode_response(
        refused.status,
        Some(&body),
        &headers,
    ));
}

/// The VM routes only the admin token reaches through the manager.
const ADMIN_VM_ROUTES: [&str; 4] = [
    "/vm/snapshot",
    "/vm/net/policy",
    "/vm/net/expose",
    "/vm/net/unexpose",
];

/// How long the manager waits for a client to take the answer it streams.
const CLIENT_WRITE_TIMEOUT: Duration = Duration::from_secs(60);

/// The one 403 a sandbox's token gets for any sandbox not its own, known or not: a name is
/// not given away by a different answer.
const NOT_YOURS: &str = "the token is not this sandbox's (or was revoked or expired): use the \
    sandbox's own token or the admin token";

/// The 403 of an admin's route (the same for every name).
const ADMIN_ONLY: &str = "this request needs the admin token (<state-dir>/admin.token)";

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
        return Err(Refused::new(403, ADMIN_ONLY));
    }
    match sandbox {
        Some(sandbox) if sandbox.token_is(token) => Ok(false),
        _ => Err(Refused::new(403, NOT_YOURS)),
    }
}

/// The methods a sandbox's own route (`/sandboxes/NAME` and what follows it, but `vm`)
/// serves, for a 405's `Allow`; None for a route that is not one of them.
fn sandbox_route_methods(tail: &str) -> Option<&'static str> {
    match tail {
        "" => Some("GET, DELETE"),
        "pause" | "resume" => Some("PUT"),
        "token" => Some("PUT, DELETE"),
        "credential" => Some("POST, DELETE"),
        "fork" => Some("POST"),
        "ports" => Some("GET, POST"),
        _ if tail.starts_with("ports/") => Some("DELETE"),
        _ => None,
    }
}

/// `POST /sandboxes/NAME/ports`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PortBody {
    guest_port: u16,
    #[serde(default)]
    host: Option<String>,
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
            #[serde(default)]
            audience: Option<String>,
        }
        let example = format!(
            "{{\"credential\": \"mfc_...\"}} (the guest's {GUEST_PATH}), and \"audience\" to \
             check it was minted for that one"
        );
        let body: Verify = object_body(request, false, &example)?;
        reply(
            stream,
            200,
            &manager.verify_credential(&body.credential, body.audience.as_deref()),
        );
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
    // Exposing a port puts the guest on the host (its loopback, a socket): the admin's call.
    let admin_only = matches!(tail, "token" | "fork" | "credential")
        || (tail == "ports" && method == "POST")
        || tail.starts_with("ports/");
    let Some(sandbox) = manager.get(name) else {
        // The token is checked first only where it can be: an unknown name says so to the
        // admin, and gets the very 403 another tenant's sandbox gets otherwise (names are not
        // given away).
        if !manager.is_admin(token) {
            return Err(check_token(manager, request, None, admin_only)
                .err()
                .unwrap_or_else(|| Refused::new(403, NOT_YOURS)));
        }
        return Err(Refused::new(
            404,
            format!("no sandbox named {name:?}: GET /sandboxes lists them"),
        ));
    };
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
            let body: TokenBody = object_body(request, true, r#"{"ttl_s": 3600} or nothing"#)?;
            check_ttl(body.ttl_s, "ttl_s")?;
            let token = manager.set_token(&sandbox, false, body.ttl_s)?;
            reply(
                stream,
                200,
                &json!({ "name": name, "token": token, "ttl_s": body.ttl_s }),
            );
        }
        ("DELETE", "token") => {
            manager.set_token(&sandbox, true, None)?;
            reply(stream, 200, &json!({ "name": name, "token": null }));
        }
        ("POST", "credential") => {
            let body: CredentialBody = object_body(
                request,
                true,
                r#"{"audience": "my-service", "ttl_s": 3600} (both optional)"#,
            )?;
            check_ttl(body.ttl_s, "ttl_s")?;
            if body
                .audience
                .as_deref()
                .is_some_and(|a| a.is_empty() || a.len() > MAX_AUDIENCE)
            {
                return Err(Refused::new(
                    400,
                    format!(
                        "\"audience\" must be 1 to {MAX_AUDIENCE} bytes (leave it out for none)"
                    ),
                ));
            }
            let (credential, delivered) =
                manager.rotate_credential(&sandbox, body.audience, body.ttl_s)?;
            let claims = manager.verify_credential(&credential, None);
            reply(
                stream,
                200,
                &json!({
                    "name": name,
                    "credential": credential,
                    "audience": claims["audience"],
                    "expires_ms": claims["expires_ms"],
                    "delivered": delivered,
                }),
            );
        }
        ("DELETE", "credential") => {
            manager.revoke_credential(&sandbox)?;
            reply(stream, 200, &json!({ "name": name, "credential": null }));
        }
        ("GET", "ports") => reply(stream, 200, &manager.list_ports(&sandbox)),
        ("POST", "ports") => {
            let body: PortBody = object_body(
                request,
                false,
                r#"{"guest_port": 8080} (and "host": "tcp:127.0.0.1:PORT" or "unix:/path" if wanted)"#,
            )?;
            let opened = manager.open_port(&sandbox, body.guest_port, body.host.as_deref())?;
            reply(stream, 201, &opened);
        }
        ("DELETE", port) if port.starts_with("ports/") => {
            let guest_port = port["ports/".len()..]
                .parse::<u16>()
                .ok()
                .filter(|p| *p > 0)
                .ok_or_else(|| {
                    Refused::new(
                        400,
                        format!("{path}: the guest port after /ports/ must be 1 to 65535"),
                    )
                })?;
            manager.close_port(&sandbox, guest_port)?;
            reply(
                stream,
                200,
                &json!({ "name": name, "guest_port": guest_port, "closed": true }),
            );
        }
        ("POST", "fork") => {
            let body: ForkRequest = object_body(
                request,
                false,
                r#"{"count": N} or {"names": [...]}, and "idle_timeout_s" if wanted"#,
            )?;
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
    let token_ttl_s = match fields.remove("token_ttl_s") {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) if n.as_u64().is_some() => n.as_u64(),
        Some(_) => {
            return Err(Refused::new(
                400,
                "\"token_ttl_s\" is the token's lifetime in seconds (leave it out for none)",
            ))
        }
    };
    check_ttl(token_ttl_s, "token_ttl_s")?;
    let spec: Spec = serde_json::from_value(Value::Object(fields)).map_err(|e| {
        Refused::new(
            400,
            format!(
                "{e}: a sandbox takes name, snapshot, template, kernel, initrd, cmdline, mem_mib, \
                 vcpus, rootfs, net, idle_timeout_s, token_ttl_s"
            ),
        )
    })?;
    // The request's own shape first (what it says, not what its files hold); then what the
    // admin names, which root reads before any jail: only files in the images directories,
    // reached without links, and checked before anything else looks at them.
    spec.check_shape().map_err(ServeError::BadRequest)?;
    manager.confine(&spec)?;
    let (mut described, token) = manager.create(&name, spec, token_ttl_s)?;
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
    // Every fork route: a capture (the first half of a fork made outside the VMM) is the
    // manager's own to ask for, and only while it forks.
    if vm == "/vm/fork" || vm.starts_with("/vm/fork/") {
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
    check_as_the_vmm_would(request, vm)?;
    check_what_it_can_do(sandbox, request, vm)?;
    let (_activity, sock) = manager.enter(sandbox)?;
    // A jailed sandbox's network is kept outside its jail, and its policy changed there
    // alone (the VMM, which its guest may have taken over, cannot); its state is asked of the
    // waiter too (such a VMM could lie about it). A jailed VM without a NIC has no such
    // socket: its VMM says it has no NIC.
    let kept = mayfly_api::network_socket(&sock);
    let network_route = matches!(
        vm,
        "/vm/net" | "/vm/net/policy" | "/vm/net/expose" | "/vm/net/unexpose"
    );
    let sock = if sandbox.jailed() && network_route {
        if kept.exists() {
            kept
        } else if crate::util::lock(&sandbox.view).net_policy.is_some() {
            return Err(Refused::new(
                502,
                format!(
                    "sandbox {} has a NIC, but its jail's waiter, which keeps its network, does \
                     not serve it (its socket {} is gone): its network cannot be looked at or \
                     changed now; PUT /sandboxes/{}/pause and a request after it start it anew",
                    sandbox.name,
                    kept.display(),
                    sandbox.name
                ),
            ));
        } else {
            sock
        }
    } else {
        sock
    };
    // A VMM that cannot be reached may have just ended: then the sandbox is dead, and the
    // answer says so (as any request for a dead sandbox is told), not 502.
    let unreachable = |what: String| -> Refused {
        match manager.check_vmm_alive(sandbox) {
            Err(dead) => dead.into(),
            Ok(()) => Refused::new(502, what),
        }
    };
    let vmm = mayfly_sys::socket::connect(&sock, VMM_CONNECT_TIMEOUT).map_err(|e| {
        unreachable(format!(
            "cannot reach the VMM of {} at {} within {} s: {e}",
            sandbox.name,
            sock.display(),
            VMM_CONNECT_TIMEOUT.as_secs()
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
    let _ = vmm.set_write_timeout(Some(VMM_SEND_TIMEOUT));
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
    let bounds = Bounds::of(request, vm);
    let to_vmm = &vmm;
    std::thread::scope(|scope| {
        if let Some(left) = upload {
            scope.spawn(move || {
                let mut from = client.take(left);
                let _ = std::io::copy(&mut from, &mut &*to_vmm);
            });
        }
        // A client that stops reading is cut after a while: it holds a connection and keeps
        // the sandbox from going idle.
        let _ = client.set_write_timeout(Some(CLIENT_WRITE_TIMEOUT));
        let relayed = relay(&vmm, client, &bounds);
        if vm == "/vm/net/policy" && relayed.first.starts_with(b"HTTP/1.1 2") {
            manager.note_policy(sandbox);
        }
        // The first bytes say the status: an exec answered with an error counts as failed.
        if exec && !relayed.first.starts_with(b"HTTP/1.1 2") {
            manager.metrics.execs_failed.fetch_add(1, Ordering::Relaxed);
        }
        // Whatever happened, the VMM's connection ends here: a call whose client left, or
        // that passed its deadline, ends in the VMM too (it sees the hang-up).
        let _ = vmm.shutdown(std::net::Shutdown::Both);
        match relayed.end {
            End::Done | End::ClientGone | End::ClientStalled => {}
            End::Closed if relayed.first.is_empty() => refusal_reply(
                client,
                &unreachable(format!(
                    "the VMM of {} closed the connection without an answer",
                    sandbox.name
                )),
            ),
            End::Closed => {}
            End::Timeout(limit) if relayed.first.is_empty() => refusal_reply(
                client,
                &Refused::new(
                    504,
                    format!(
                        "the VMM of {name} did not answer {method} {vm} within {secs} s: it is \
                         stalled or busy (a snapshot, a wake); the call was ended. Retry later, \
                         and look at GET /sandboxes/{name}",
                        name = sandbox.name,
                        method = request.method,
                        secs = limit.as_secs()
                    ),
                ),
            ),
            // Part of the answer is out: the client sees it cut short.
            End::Timeout(_) => {}
        }
    });
    Ok(())
}

/// How long the manager waits for a sandbox's VMM to take a connection.
const VMM_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long it waits for the VMM to take the request it sends.
const VMM_SEND_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a VMM may take to answer a read of its state (`GET /vm...` outside the guest).
const VMM_READ_TIMEOUT: Duration = Duration::from_secs(15);
/// How long it may take to answer an action (pause, snapshot, restore, network).
const VMM_ACTION_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a VMM may stay silent in the middle of an answer: the VMM's own limit on its
/// guest's silence (30 s) with room to spare.
const VMM_IDLE_TIMEOUT: Duration = Duration::from_secs(45);
/// What the manager adds to a guest call's own deadline (the VMM's, which answers first).
const VMM_MARGIN: Duration = Duration::from_secs(15);
/// The VMM's deadlines for calls into the guest (crates/vmm/src/guest/watch.rs): what the
/// manager's own deadlines are set above.
const GUEST_CALL_TIMEOUT: Duration = Duration::from_secs(60);
const GUEST_MAX_CALL_TIMEOUT: Duration = Duration::from_secs(600);
const EXEC_START_TIMEOUT: Duration = Duration::from_secs(30);
const EXEC_GRACE: Duration = Duration::from_secs(10);
/// The longest a call into the guest other than an exec may take in all: a file's transfer,
/// which the VMM bounds only by the guest's silence, so that a guest sending a byte now and
/// then cannot hold a connection for ever.
const GUEST_TRANSFER_LIMIT: Duration = Duration::from_secs(3600);

/// The deadlines of one call passed to a VMM: for its first bytes (from the call's start),
/// between bytes after them, and for the whole call; None: not bounded (an exec without a
/// `timeout_ms` may run and stay silent as long as it likes; its client's hang-up, and the
/// caps on connections, bound it).
#[derive(Debug, PartialEq)]
struct Bounds {
    head: Option<Duration>,
    idle: Option<Duration>,
    whole: Option<Duration>,
}

impl Bounds {
    fn of(request: &Request, vm: &str) -> Bounds {
        if vm == "/vm/exec" {
            // The VMM ends an exec at its timeout_ms plus its grace, once started.
            let body = serde_json::from_slice::<Value>(&request.body).unwrap_or_default();
            let whole = body["timeout_ms"].as_u64().map(|ms| {
                Duration::from_millis(ms)
                    .saturating_add(EXEC_START_TIMEOUT + EXEC_GRACE + VMM_MARGIN)
            });
            // A streamed exec's answer starts once the agent is reached (its first bytes
            // come before the command's); a collected one's only at the end.
            let head = if body["stream"] == Value::Bool(true) {
                let start = EXEC_START_TIMEOUT + VMM_MARGIN;
                Some(whole.map_or(start, |w| w.min(start)))
            } else {
                whole
            };
            return Bounds {
                head,
                idle: None,
                whole,
            };
        }
        if mayfly_api::guest::serves(vm) {
            let call = request
                .query
                .split('&')
                .find_map(|kv| kv.strip_prefix("timeout_ms="))
                .and_then(|ms| ms.parse::<u64>().ok())
                .map_or(GUEST_CALL_TIMEOUT, Duration::from_millis)
                .min(GUEST_MAX_CALL_TIMEOUT);
            return Bounds {
                head: Some(call + VMM_MARGIN),
                idle: Some(VMM_IDLE_TIMEOUT),
                whole: Some(GUEST_TRANSFER_LIMIT),
            };
        }
        let head = if request.method == "GET" {
            VMM_READ_TIMEOUT
        } else {
            VMM_ACTION_TIMEOUT
        };
        Bounds {
            head: Some(head),
            idle: Some(VMM_IDLE_TIMEOUT),
            whole: Some(VMM_ACTION_TIMEOUT + VMM_MARGIN),
        }
    }
}

/// How a relay ended.
#[derive(Debug, PartialEq)]
enum End {
    /// The VMM answered and closed.
    Done,
    /// The VMM closed (or failed) before it said anything.
    Closed,
    /// The client hung up.
    ClientGone,
    /// The client did not take the answer in time.
    ClientStalled,
    /// A deadline passed (the limit that did).
    Timeout(Duration),
}

struct Relayed {
    /// The answer's first bytes (up to 16), empty if none came.
    first: Vec<u8>,
    end: End,
}

/// Copy the VMM's answer to the client as it comes, within `bounds`, watching the client:
/// when it hangs up, the relay ends at once.
fn relay(vmm: &UnixStream, client: &UnixStream, bounds: &Bounds) -> Relayed {
    use nix::poll::{poll, PollFd, PollFlags};
    let start = std::time::Instant::now();
    let mut first = Vec::new();
    let mut last = start;
    let mut buf = vec![0u8; 64 << 10];
    loop {
        // The nearest deadline, and the limit it stands for.
        let whole = bounds.whole.map(|d| (start + d, d));
        let step = if first.is_empty() {
            bounds.head.map(|d| (start + d, d))
        } else {
            bounds.idle.map(|d| (last + d, d))
        };
        let next = match (whole, step) {
            (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
            (a, b) => a.or(b),
        };
        let wait_ms = next.map_or(-1, |(at, _)| {
            let left = at.saturating_duration_since(std::time::Instant::now());
            i32::try_from(left.as_millis().max(1)).unwrap_or(i32::MAX)
        });
        // The client's end is watched for its hang-up only (POLLHUP is always reported): a
        // client that only shut its sending side still gets its answer.
        let mut fds = [
            PollFd::new(vmm, PollFlags::POLLIN),
            PollFd::new(client, PollFlags::empty()),
        ];
        match poll(&mut fds, wait_ms) {
            Ok(0) => {
                if let Some((at, limit)) = next {
                    if std::time::Instant::now() >= at {
                        return Relayed {
                            first,
                            end: End::Timeout(limit),
                        };
                    }
                }
                continue;
            }
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => {
                return Relayed {
                    first,
                    end: End::Closed,
                }
            }
        }
        let gone = PollFlags::POLLHUP | PollFlags::POLLERR;
        if fds[1].revents().is_some_and(|r| r.intersects(gone)) {
            return Relayed {
                first,
                end: End::ClientGone,
            };
        }
        if fds[0].revents().is_none_or(|r| r.is_empty()) {
            continue;
        }
        let n = match (&mut &*vmm).read(&mut buf) {
            Ok(0) | Err(_) => {
                let end = if first.is_empty() {
                    End::Closed
                } else {
                    End::Done
                };
                return Relayed { first, end };
            }
            Ok(n) => n,
        };
        if first.is_empty() {
            first = buf[..n.min(16)].to_vec();
        }
        last = std::time::Instant::now();
        if (&mut &*client).write_all(&buf[..n]).is_err() {
            return Relayed {
                first,
                end: End::ClientStalled,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(method: &str, query: &str, body: &str) -> Request {
        Request {
            method: method.into(),
            path: String::new(),
            query: query.into(),
            body: body.as_bytes().to_vec(),
            streamed_body_len: None,
            authorization: None,
        }
    }

    #[test]
    fn every_call_passed_to_a_vmm_has_deadlines_but_an_exec_without_its_own() {
        let secs = Duration::from_secs;
        let read = Bounds::of(&request("GET", "", ""), "/vm");
        assert_eq!(read.head, Some(secs(15)));
        assert_eq!(read.idle, Some(secs(45)));
        assert!(read.whole.is_some());
        assert_eq!(
            Bounds::of(&request("PUT", "", ""), "/vm/pause").head,
            Some(secs(120))
        );
        // An exec: its timeout_ms, its start and the agent's grace, and a margin.
        let exec = Bounds::of(
            &request("POST", "", r#"{"argv": ["x"], "timeout_ms": 5000}"#),
            "/vm/exec",
        );
        assert_eq!(
            (exec.head, exec.idle, exec.whole),
            (Some(secs(60)), None, Some(secs(60)))
        );
        let streamed = Bounds::of(
            &request(
                "POST",
                "",
                r#"{"argv": ["x"], "timeout_ms": 500000, "stream": true}"#,
            ),
            "/vm/exec",
        );
        assert_eq!(streamed.head, Some(secs(45)));
        assert_eq!(streamed.whole, Some(secs(555)));
        let endless = Bounds::of(&request("POST", "", r#"{"argv": ["x"]}"#), "/vm/exec");
        assert_eq!((endless.head, endless.whole), (None, None));
        // A guest call: its own deadline (or the VMM's default) and a margin.
        let stat = Bounds::of(
            &request("GET", "path=/x&timeout_ms=2000", ""),
            "/vm/files/stat",
        );
        assert_eq!(stat.head, Some(secs(17)));
        let list = Bounds::of(&request("GET", "path=/x", ""), "/vm/files/list");
        assert_eq!(list.head, Some(secs(75)));
    }
}
