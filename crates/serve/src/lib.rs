//! `mayfly serve`: one control socket for many sandboxes, each still a VMM process of its own.
//!
//! A sandbox is a VM known by name (a DNS label) that the manager starts, puts to sleep when
//! it has been idle for its `idle_timeout_s` (a snapshot into its directory, then its VMM
//! exits and its RAM is freed), and wakes again, transparently, on the next request for it.
//! Requests for a sandbox's VM (exec, files, the VM's own pause, snapshot, network) are
//! passed to its VMM's own control socket as they are, streamed both ways.
//!
//! | request                                 | token   | what                                  |
//! |-----------------------------------------|---------|---------------------------------------|
//! | `GET /sandboxes`                        | admin   | list                                  |
//! | `POST /sandboxes` `{"name", ...spec}`   | admin   | create (a boot, or a restore of `snapshot`); answers its token once |
//! | `GET /sandboxes/NAME`                   | either  | describe                              |
//! | `DELETE /sandboxes/NAME`                | either  | end its VMM, remove everything of it  |
//! | `PUT /sandboxes/NAME/pause`             | either  | suspend to disk now                   |
//! | `PUT /sandboxes/NAME/resume`            | either  | wake now                              |
//! | `POST /sandboxes/NAME/fork`             | admin   | N new sandboxes from one snapshot of it (see [`fork`]) |
//! | `PUT /sandboxes/NAME/token`             | admin   | a new token (the old one stops working) |
//! | `DELETE /sandboxes/NAME/token`          | admin   | revoke its token                      |
//! | any `/sandboxes/NAME/vm...`             | either  | passed to its VMM as `/vm...` (woken first) |
//! | `GET /metrics`                          | none    | Prometheus text                       |
//! | `GET /openapi.json`                     | none    | the API's OpenAPI document ([`OPENAPI`]) |
//!
//! "either": the sandbox's own token or the admin token, as `Authorization: Bearer TOKEN`.
//! The admin token is in `<state-dir>/admin.token` (mode 0600, made at the first start); the
//! socket itself is mode 0600. Everything the manager knows is in the state directory
//! (see [`sandbox`]): `kill -9` of the manager loses nothing, and a new one adopts the VMMs
//! that still run. Stopping the manager (SIGTERM, SIGINT) leaves the sandboxes as they are.

mod credential;
mod fork;
mod metrics;
mod sandbox;
mod template;

use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use mayfly_api::http::{self, Refusal, Request};
use sandbox::{Manager, Spec};

/// The API described: an OpenAPI 3.1 document, served at `GET /openapi.json`. The unit tests
/// check that its operations are [`ROUTES`] and the VMM's routes under
/// `/sandboxes/{name}/vm`; `tests/tests/host_serve.rs` sends each to a running manager.
pub const OPENAPI: &str = include_str!("openapi.json");

/// The manager's own routes, as (method, path with `{name}` for a sandbox's name); every
/// VMM route is served under `/sandboxes/{name}` too (see [`pass_to_vmm`]).
pub const ROUTES: &[(&str, &str)] = &[
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
    ("GET", "/sandboxes"),
    ("POST", "/sandboxes"),
    ("GET", "/sandboxes/{name}"),
    ("DELETE", "/sandboxes/{name}"),
    ("PUT", "/sandboxes/{name}/pause"),
    ("PUT", "/sandboxes/{name}/resume"),
    ("PUT", "/sandboxes/{name}/token"),
    ("DELETE", "/sandboxes/{name}/token"),
    ("POST", "/sandboxes/{name}/fork"),
    ("POST", "/credentials/verify"),
];

/// Connections served at once; more get 503 at once.
const MAX_CONNECTIONS: usize = 256;
/// How long a client may take to send its request.
const REQUEST_IDLE: Duration = Duration::from_secs(10);
const REQUEST_TOTAL: Duration = Duration::from_secs(30);
/// How often the idle watch looks at the sandboxes.
const WATCH_EVERY: Duration = Duration::from_millis(250);

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    VmmFailed(String),
    #[error("{0}")]
    Busy(String),
    /// A budget of the manager's would be exceeded.
    #[error("{0}")]
    OverBudget(String),
    #[error("cannot {what} {path}: {source}")]
    Io {
        what: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Api(#[from] mayfly_api::ApiError),
    #[error(transparent)]
    Claim(#[from] mayfly_sys::claim::ClaimError),
}

impl ServeError {
    fn status(&self) -> u16 {
        match self {
            ServeError::BadRequest(_) => 400,
            ServeError::NotFound(_) => 404,
            ServeError::Conflict(_) => 409,
            ServeError::VmmFailed(_) => 502,
            ServeError::Busy(_) => 503,
            ServeError::OverBudget(_) => 429,
            ServeError::Io { .. } | ServeError::Api(_) | ServeError::Claim(_) => 500,
        }
    }
}

pub struct ServeConfig {
    pub state_dir: PathBuf,
    pub sock: PathBuf,
    /// The mayfly binary the sandboxes' VMMs run.
    pub mayfly: PathBuf,
    pub policy: Policy,
}

/// What the manager allows, and what it collects: `mayfly serve`'s options.
#[derive(Clone, Debug, Default)]
pub struct Policy {
    /// Jail new sandboxes' VMMs (see vmm/src/jail.rs): the default.
    pub jail: bool,
    /// Jailed sandboxes run as uids (and gids) from this one on, one each.
    pub jail_uid_base: u32,
    /// Guest memory (MiB) sandboxes with a running VMM may hold in all (see
    /// [`sandbox::Manager::reserve_memory`]); `None`: no budget.
    pub mem_budget_mib: Option<u64>,
    /// Past the memory budget, put the longest-idle running sandboxes to sleep to make room
    /// (instead of refusing).
    pub make_room: bool,
    /// What the sandboxes may keep on disk in all (MiB; their snapshots, disk layers and
    /// bases): a suspend that could take more is refused; `None`: no budget.
    pub disk_budget_mib: Option<u64>,
    /// A sandbox asleep this long (seconds, since it was suspended or last used, whichever
    /// is later) is deleted and its snapshot collected; `None`: kept until deleted.
    pub expire_after_s: Option<u64>,
    /// A template no create has used for this long (seconds) is collected; `None`: kept.
    pub template_ttl_s: Option<u64>,
}

/// Serve until `stop` reads something (or closes): the caller's signal handling.
pub fn serve(config: &ServeConfig, stop: UnixStream) -> Result<(), ServeError> {
    let manager = Arc::new(Manager::open(
        &config.state_dir,
        config.mayfly.clone(),
        &config.policy,
    )?);
    manager.recover();
    let mut claim = mayfly_sys::claim::SocketClaim::new(&config.sock)?;
    let listener = claim.bind()?;
    // The socket file this manager made: at the end it removes that one only, never one a
    // newer manager bound at the same path meanwhile.
    let socket_id = std::fs::metadata(&config.sock)
        .ok()
        .map(|m| (m.dev(), m.ino()));
    listener
        .set_nonblocking(true)
        .map_err(|source| ServeError::Io {
            what: "listen on",
            path: config.sock.display().to_string(),
            source,
        })?;
    manager.event(
        "serving",
        "",
        json!({ "socket": config.sock, "state_dir": config.state_dir, "jail": config.policy.jail }),
    );
    {
        let manager = Arc::clone(&manager);
        std::thread::Builder::new()
            .name("idle-watch".into())
            .spawn(move || loop {
                std::thread::sleep(WATCH_EVERY);
                manager.watch_once();
            })
            .map_err(|source| ServeError::Io {
                what: "start",
                path: "the idle watch thread".into(),
                source,
            })?;
    }
    let active = Arc::new(AtomicUsize::new(0));
    use nix::poll::{poll, PollFd, PollFlags};
    loop {
        let mut fds = [
            PollFd::new(&listener, PollFlags::POLLIN),
            PollFd::new(&stop, PollFlags::POLLIN),
        ];
        let ready = poll(&mut fds, -1);
        if fds[1].revents().is_none_or(|r| !r.is_empty()) {
            break;
        }
        if ready.is_err() {
            continue;
        }
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(_) => {
                // Out of descriptors, most likely: let the moment pass instead of spinning.
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        if active.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
            active.fetch_sub(1, Ordering::SeqCst);
            reply(
                &stream,
                503,
                &json!({ "error": format!("the manager serves {MAX_CONNECTIONS} connections at once: try again") }),
            );
            continue;
        }
        let manager = Arc::clone(&manager);
        let active_now = Arc::clone(&active);
        let spawned = std::thread::Builder::new()
            .name("serve-conn".into())
            .spawn(move || {
                connection(&manager, stream);
                active_now.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            active.fetch_sub(1, Ordering::SeqCst);
        }
    }
    manager.event("stopped", "", json!({ "sandboxes": "left as they are" }));
    drop(listener);
    let ours = std::fs::symlink_metadata(&config.sock)
        .is_ok_and(|m| Some((m.dev(), m.ino())) == socket_id);
    if ours {
        let _ = std::fs::remove_file(&config.sock);
    }
    claim.release();
    Ok(())
}

fn reply(stream: &UnixStream, status: u16, body: &Value) {
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

fn error_reply(stream: &UnixStream, status: u16, message: impl Into<String>) {
    reply(stream, status, &json!({ "error": message.into() }));
}

/// Whether a request's body is streamed to the VMM rather than read here: a file upload.
fn streamed(method: &str, path: &str) -> bool {
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

fn connection(manager: &Manager, stream: UnixStream) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_write_timeout(Some(REQUEST_TOTAL));
    manager.metrics.requests.fetch_add(1, Ordering::Relaxed);
    let request = match http::read_request(&stream, REQUEST_IDLE, REQUEST_TOTAL, streamed) {
        Ok(request) => request,
        Err(Refusal::Silent) => return,
        Err(Refusal::Reply { status, message }) => {
            manager
                .metrics
                .requests_refused
                .fetch_add(1, Ordering::Relaxed);
            error_reply(&stream, status, message);
            return;
        }
    };
    if let Err((status, message)) = route(manager, &request, &stream) {
        manager
            .metrics
            .requests_refused
            .fetch_add(1, Ordering::Relaxed);
        error_reply(&stream, status, message);
    }
}

type Refused = (u16, String);

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
    sandbox: Option<&sandbox::Sandbox>,
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

fn route(manager: &Manager, request: &Request, stream: &UnixStream) -> Result<(), Refused> {
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
                    credential::GUEST_PATH
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
        ("GET", "") => reply(stream, 200, &sandbox.describe(manager)),
        ("DELETE", "") => {
            manager.delete(&sandbox).map_err(refused)?;
            reply(stream, 200, &json!({ "deleted": name }));
        }
        ("PUT", "pause") => {
            manager.suspend(&sandbox).map_err(refused)?;
            reply(stream, 200, &sandbox.describe(manager));
        }
        ("PUT", "resume") => {
            manager.ensure_running(&sandbox, true).map_err(refused)?;
            reply(stream, 200, &sandbox.describe(manager));
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
            let body: fork::ForkRequest = serde_json::from_slice(&request.body).map_err(|e| {
                (
                    400,
                    format!(
                        "{e}: send {{\"count\": N}} or {{\"names\": [...]}}, and \
                         \"idle_timeout_s\" if wanted"
                    ),
                )
            })?;
            let forked = fork::fork(manager, &sandbox, &body).map_err(refused)?;
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
    sandbox: &sandbox::Sandbox,
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

/// The state directory must be absolute: the sandboxes' VMMs are given paths in it.
pub fn absolute_state_dir(dir: &Path) -> Result<PathBuf, ServeError> {
    std::path::absolute(dir).map_err(|source| ServeError::Io {
        what: "resolve",
        path: dir.display().to_string(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use serde_json::Value;

    use crate::{OPENAPI, ROUTES};

    fn documented() -> (Value, BTreeSet<(String, String)>) {
        let doc: Value = serde_json::from_str(OPENAPI).expect("openapi.json is JSON");
        let mut ops = BTreeSet::new();
        for (path, item) in doc["paths"].as_object().expect("paths") {
            for method in item.as_object().expect("a path item").keys() {
                if method != "parameters" {
                    ops.insert((method.to_uppercase(), path.clone()));
                }
            }
        }
        (doc, ops)
    }

    #[test]
    fn the_openapi_document_lists_exactly_the_routes_served() {
        let (_, documented) = documented();
        let served: BTreeSet<(String, String)> = ROUTES
            .iter()
            .map(|(m, p)| (m.to_string(), p.to_string()))
            .chain(
                mayfly_api::routes()
                    .map(|(m, p)| (m.to_string(), format!("/sandboxes/{{name}}{p}"))),
            )
            .collect();
        let undocumented: Vec<_> = served.difference(&documented).collect();
        let not_served: Vec<_> = documented.difference(&served).collect();
        assert!(
            undocumented.is_empty() && not_served.is_empty(),
            "served but not in openapi.json: {undocumented:?}; documented but not served: \
             {not_served:?}"
        );
    }

    #[test]
    fn every_documented_operation_has_an_id_answers_and_resolvable_schemas() {
        let (doc, _) = documented();
        let mut ids = BTreeSet::new();
        for (path, item) in doc["paths"].as_object().unwrap() {
            for (method, op) in item.as_object().unwrap() {
                if method == "parameters" {
                    continue;
                }
                let id = op["operationId"].as_str().unwrap_or_default();
                assert!(!id.is_empty(), "{method} {path} has no operationId");
                assert!(ids.insert(id.to_string()), "operationId {id} twice");
                let responses = op["responses"].as_object().unwrap();
                // A route kept only to refuse (a sandbox's `PUT /vm/fork` and `/vm/shutdown`)
                // says so; every other one documents its success.
                let refused = op["x-mayfly-refused"] == true;
                assert_eq!(
                    responses.keys().any(|c| c.starts_with('2')),
                    !refused,
                    "{method} {path}: a success documented, or x-mayfly-refused, not both"
                );
            }
        }
        // Every $ref names a schema that is there.
        fn refs(v: &Value, out: &mut Vec<String>) {
            match v {
                Value::Object(o) => {
                    if let Some(Value::String(r)) = o.get("$ref") {
                        out.push(r.clone());
                    }
                    o.values().for_each(|v| refs(v, out));
                }
                Value::Array(a) => a.iter().for_each(|v| refs(v, out)),
                _ => {}
            }
        }
        let mut all = Vec::new();
        refs(&doc, &mut all);
        for r in all {
            let name = r
                .strip_prefix("#/components/schemas/")
                .unwrap_or_else(|| panic!("{r}: only local schema refs"));
            assert!(
                doc["components"]["schemas"][name].is_object(),
                "{r} is not defined"
            );
        }
    }
}
