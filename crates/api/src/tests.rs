//! The server and client together, with a fake VM controller on a thread of its own.

use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::*;
use mayfly_sys::claim::ClaimError;

/// Guest routes for a server without a guest: every call is refused as a VM without a vsock
/// socket refuses it.
struct NoGuest;

impl guest::GuestRoutes for NoGuest {
    fn serve(
        &self,
        _: guest::Call,
        _: &http::Request,
        _: &UnixStream,
        _: &guest::Context,
    ) -> guest::Outcome {
        Reply::error(409, "the VM has no vsock socket").into()
    }
}

fn no_guest() -> std::sync::Arc<dyn guest::GuestRoutes> {
    std::sync::Arc::new(NoGuest)
}

/// The controller's event enum, as the VM's would be.
#[derive(Debug)]
enum Event {
    Api(ApiCall),
}

/// How the fake controller treats calls.
#[derive(Clone, Copy)]
enum Mode {
    /// Answer each action as a VM would.
    Answer,
    /// Drop the reply sender without answering (the VM is going away).
    Drop,
    /// Keep every call and never answer.
    Hold,
    /// Answer with a status that is not an HTTP status.
    Invalid,
}

fn answer(action: &Action) -> Reply {
    match action {
        Action::Describe => Reply::ok(json!({"state": "running"})),
        Action::Pause | Action::Resume | Action::Shutdown => Reply::no_content(),
        Action::Snapshot { path, .. } => Reply::ok(json!({ "path": path })),
        Action::Fork(ForkRequest { count: 0, .. }) => Reply::error(400, "count must be at least 1"),
        Action::Fork(ForkRequest { count, .. }) => Reply::ok(json!({ "clones": count })),
        Action::ForkCapture(ForkRequest { count, .. }) => Reply::ok(json!({ "count": count })),
        Action::ForkCaptureRelease => Reply::no_content(),
        Action::Net => Reply::ok(json!({"policy": "open"})),
        Action::NetPolicy(policy) => Reply::ok(json!({ "policy": policy.to_string() })),
        Action::NetExpose { port, .. } => Reply::ok(json!({ "guest_port": port })),
        Action::NetUnexpose { port, .. } => Reply::ok(json!({ "guest_port": port })),
    }
}

/// A server on a fresh socket, a fake controller, and the actions it received.
struct Fixture {
    server: ApiServer,
    actions: Receiver<Action>,
    dir: PathBuf,
}

impl Fixture {
    fn socket(&self) -> &Path {
        self.server.path()
    }

    fn request(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        request_with_timeout(
            self.socket(),
            method,
            path,
            body.as_ref(),
            Duration::from_secs(20),
        )
        .unwrap()
    }

    /// The error message of a request that must fail with `status`.
    fn error(&self, method: &str, path: &str, body: Option<Value>, status: u16) -> String {
        let (got, body) = self.request(method, path, body);
        assert_eq!(got, status, "{method} {path}: {body}");
        body["error"].as_str().expect("an error message").to_owned()
    }

    fn raw(&self, bytes: &[u8]) -> RawResponse {
        raw(self.socket(), bytes)
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A fresh, empty directory for one test.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mayfly-api-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn start(name: &str, mode: Mode, timeouts: Timeouts) -> Fixture {
    let dir = temp_dir(name);
    let (server, actions) = controller(&dir.join("api.sock"), mode, timeouts);
    Fixture {
        server,
        actions,
        dir,
    }
}

/// A server on `socket` and a fake controller that treats calls as `mode` says.
fn controller(socket: &Path, mode: Mode, timeouts: Timeouts) -> (ApiServer, Receiver<Action>) {
    let (events, calls) = mpsc::channel();
    let server = ApiServer::start_with(socket, events, Event::Api, timeouts, no_guest()).unwrap();
    let (seen, actions) = mpsc::channel();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for Event::Api(call) in calls {
            let _ = seen.send(call.action.clone());
            match mode {
                Mode::Answer => {
                    let reply = answer(&call.action);
                    call.respond(reply);
                }
                Mode::Drop => drop(call),
                Mode::Hold => held.push(call),
                Mode::Invalid => call.respond(Reply::error(42, "what")),
            }
        }
    });
    (server, actions)
}

fn serve(name: &str) -> Fixture {
    start(name, Mode::Answer, Timeouts::default())
}

#[derive(Debug)]
struct RawResponse {
    status: u16,
    head: String,
    body: String,
}

impl RawResponse {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap()
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().skip(1).find_map(|line| {
            let (n, v) = line.split_once(':')?;
            n.eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }
}

/// Send `bytes` as they are and read everything the server answers until it closes.
fn raw(socket: &Path, bytes: &[u8]) -> RawResponse {
    let mut stream = UnixStream::connect(socket).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let _ = stream.write_all(bytes);
    read_raw(&mut stream)
}

fn read_raw(stream: &mut UnixStream) -> RawResponse {
    let mut out = Vec::new();
    let mut chunk = [0; 4096];
    loop {
        match stream.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&chunk[..n]),
            // The server closed with our unread bytes: the answer came first.
            Err(e) if e.kind() == ErrorKind::ConnectionReset => break,
            Err(e) => panic!("reading the response: {e}"),
        }
    }
    let text = String::from_utf8(out).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").expect("a complete head");
    let status = head[9..12].parse().unwrap();
    RawResponse {
        status,
        head: head.to_owned(),
        body: body.to_owned(),
    }
}

#[test]
fn every_action_makes_the_round_trip() {
    let f = serve("round-trip");
    let cases = [
        ("GET", "/vm", None, Action::Describe, 200),
        ("PUT", "/vm/pause", None, Action::Pause, 204),
        ("PUT", "/vm/resume", Some(json!({})), Action::Resume, 204),
        ("PUT", "/vm/shutdown", None, Action::Shutdown, 204),
        (
            "PUT",
            "/vm/snapshot",
            Some(json!({"path": "/some/dir"})),
            Action::Snapshot {
                path: "/some/dir".into(),
                diff: false,
            },
            200,
        ),
        (
            "PUT",
            "/vm/snapshot",
            Some(json!({"path": "/some/dir", "diff": true})),
            Action::Snapshot {
                path: "/some/dir".into(),
                diff: true,
            },
            200,
        ),
        (
            "PUT",
            "/vm/fork",
            Some(json!({"count": 3})),
            Action::Fork(ForkRequest {
                count: 3,
                name_prefix: None,
                parent_paused: false,
                overcommit: false,
            }),
            200,
        ),
        (
            "PUT",
            "/vm/fork",
            Some(json!({"count": 10000, "name_prefix": "web", "parent": "paused"})),
            Action::Fork(ForkRequest {
                count: 10_000,
                name_prefix: Some("web".into()),
                parent_paused: true,
                overcommit: false,
            }),
            200,
        ),
        (
            "PUT",
            "/vm/fork",
            Some(json!({"count": 2, "name_prefix": null, "parent": "running"})),
            Action::Fork(ForkRequest {
                count: 2,
                name_prefix: None,
                parent_paused: false,
                overcommit: false,
            }),
            200,
        ),
        (
            "PUT",
            "/vm/fork",
            Some(json!({"count": 2, "overcommit": true})),
            Action::Fork(ForkRequest {
                count: 2,
                name_prefix: None,
                parent_paused: false,
                overcommit: true,
            }),
            200,
        ),
        (
            "PUT",
            "/vm/fork/capture",
            Some(json!({"count": 2, "name_prefix": "web", "parent": "paused"})),
            Action::ForkCapture(ForkRequest {
                count: 2,
                name_prefix: Some("web".into()),
                parent_paused: true,
                overcommit: false,
            }),
            200,
        ),
        (
            "PUT",
            "/vm/fork/release",
            None,
            Action::ForkCaptureRelease,
            204,
        ),
        ("GET", "/vm/net", None, Action::Net, 200),
        (
            "PUT",
            "/vm/net/policy",
            Some(json!({"policy": "allow=192.0.2.0/24:443,198.51.100.7"})),
            Action::NetPolicy("allow=192.0.2.0/24:443,198.51.100.7".parse().unwrap()),
            200,
        ),
        (
            "PUT",
            "/vm/net/policy",
            Some(json!({"policy": "none"})),
            Action::NetPolicy(mayfly_network::Policy::None),
            200,
        ),
        (
            "PUT",
            "/vm/net/expose",
            Some(json!({"port": 8080})),
            Action::NetExpose {
                port: 8080,
                on: mayfly_network::ExposeOn::Tcp("127.0.0.1:0".parse().unwrap()),
            },
            200,
        ),
        (
            "PUT",
            "/vm/net/expose",
            Some(json!({"port": 22, "on": "unix:/tmp/vm-ssh.sock"})),
            Action::NetExpose {
                port: 22,
                on: mayfly_network::ExposeOn::Unix("/tmp/vm-ssh.sock".into()),
            },
            200,
        ),
        (
            "PUT",
            "/vm/net/unexpose",
            Some(json!({"port": 22})),
            Action::NetUnexpose { port: 22, on: None },
            200,
        ),
        (
            "PUT",
            "/vm/net/unexpose",
            Some(json!({"port": 22, "on": "unix:/tmp/vm-ssh.sock"})),
            Action::NetUnexpose {
                port: 22,
                on: Some(mayfly_network::ExposeOn::Unix("/tmp/vm-ssh.sock".into())),
            },
            200,
        ),
    ];
    for (method, path, body, action, status) in cases {
        let (got, reply) = f.request(method, path, body);
        assert_eq!(f.actions.try_recv().unwrap(), action);
        assert_eq!(got, status, "{method} {path}");
        let expected = answer(&action).body.unwrap_or(Value::Null);
        assert_eq!(reply, expected);
    }
}

#[test]
fn bad_network_requests_say_what_to_send() {
    let f = serve("net-bad");
    let cases = [
        ("/vm/net/policy", json!({}), "needs the field \"policy\""),
        ("/vm/net/policy", json!({"policy": 3}), "must be a string"),
        (
            "/vm/net/policy",
            json!({"policy": "closed"}),
            "use none, open or allow=",
        ),
        (
            "/vm/net/policy",
            json!({"policy": "allow=10.0.0.0/33"}),
            "allow",
        ),
        (
            "/vm/net/policy",
            json!({"policy": "allow=10.0.0.1:70000"}),
            "out of range",
        ),
        (
            "/vm/net/policy",
            json!({"policy": "allow="}),
            "no destination",
        ),
        (
            "/vm/net/policy",
            json!({"policy": "open", "x": 1}),
            "unknown field",
        ),
        ("/vm/net/expose", json!({}), "needs the field \"port\""),
        ("/vm/net/unexpose", json!({}), "needs the field \"port\""),
        ("/vm/net/unexpose", json!({"port": 0}), "from 1 to 65535"),
        (
            "/vm/net/unexpose",
            json!({"port": 22, "at": "unix:/x"}),
            "unknown field",
        ),
        (
            "/vm/net/unexpose",
            json!({"port": 22, "on": "udp:1"}),
            "\"on\"",
        ),
        ("/vm/net/expose", json!({"port": 0}), "from 1 to 65535"),
        ("/vm/net/expose", json!({"port": 65536}), "from 1 to 65535"),
        ("/vm/net/expose", json!({"port": "80"}), "from 1 to 65535"),
        (
            "/vm/net/expose",
            json!({"port": 80, "on": "127.0.0.1:80"}),
            "tcp:ADDR:PORT",
        ),
        (
            "/vm/net/expose",
            json!({"port": 80, "on": "tcp:localhost"}),
            "ADDR:PORT",
        ),
        (
            "/vm/net/expose",
            json!({"port": 80, "on": "unix:"}),
            "unix:PATH",
        ),
        (
            "/vm/net/expose",
            json!({"port": 80, "on": 5}),
            "must be a string",
        ),
    ];
    for (path, body, expect) in cases {
        let message = f.error("PUT", path, Some(body.clone()), 400);
        assert!(message.contains(expect), "{path} {body}: {message}");
    }
    assert!(
        f.actions.try_recv().is_err(),
        "a bad request reached the VM"
    );
}

#[test]
fn fork_count_zero_is_the_vms_business() {
    let f = serve("fork-zero");
    let message = f.error("PUT", "/vm/fork", Some(json!({"count": 0})), 400);
    assert_eq!(message, "count must be at least 1");
    assert!(matches!(
        f.actions.try_recv().unwrap(),
        Action::Fork(ForkRequest { count: 0, .. })
    ));
}

#[test]
fn paths_are_normalised() {
    let f = serve("paths");
    assert_eq!(f.request("GET", "/vm/", None).0, 200);
    assert_eq!(f.request("GET", "/vm?verbose=1", None).0, 200);
    assert_eq!(f.request("PUT", "/vm/pause/?x#y", None).0, 204);
    let r = f.raw(b"GET http://localhost/vm HTTP/1.0\r\n\r\n");
    assert_eq!(r.status, 200);
    assert_eq!(r.json(), json!({"state": "running"}));
}

#[test]
fn unknown_paths_get_404() {
    let f = serve("404");
    for path in ["/", "/vms", "/vm/paws", "/vm/pause/now", "//vm"] {
        let message = f.error("GET", path, None, 404);
        assert!(message.contains("PUT /vm/pause"), "{message}");
    }
    assert!(f.actions.try_recv().is_err());
}

#[test]
fn wrong_methods_get_405_with_allow() {
    let f = serve("405");
    let r = f.raw(b"POST /vm/pause HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_eq!(r.status, 405);
    assert_eq!(r.header("allow"), Some("PUT"));
    assert!(r.json()["error"]
        .as_str()
        .unwrap()
        .contains("PUT /vm/pause"));
    let r = f.raw(b"PUT /vm HTTP/1.1\r\n\r\n");
    assert_eq!((r.status, r.header("Allow")), (405, Some("GET")));
    assert_eq!(
        f.error("DELETE", "/vm/fork", None, 405),
        "DELETE /vm/fork is not supported: use PUT /vm/fork"
    );
    // A capture needs its count, as a fork does; letting go of one takes no body.
    assert!(f
        .error("PUT", "/vm/fork/capture", Some(json!({})), 400)
        .contains("\"count\""));
    f.error("PUT", "/vm/fork/release", Some(json!({"count": 1})), 400);
    let r = f.raw(b"GET /vm/fork/capture HTTP/1.1\r\n\r\n");
    assert_eq!((r.status, r.header("Allow")), (405, Some("PUT")));
    // The guest's routes too, listing every method the path serves.
    let r = f.raw(b"PATCH /vm/files?path=%2Fx HTTP/1.1\r\n\r\n");
    assert_eq!(
        (r.status, r.header("Allow")),
        (405, Some("PUT, GET, DELETE"))
    );
    let r = f.raw(b"GET /vm/exec HTTP/1.1\r\n\r\n");
    assert_eq!((r.status, r.header("Allow")), (405, Some("POST")));
    assert!(r.json()["error"].as_str().unwrap().contains("use POST"));
    // Anything else has none.
    let r = f.raw(b"POST /vm/exec HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}");
    assert_eq!((r.status, r.header("Allow")), (400, None));
    assert!(f.actions.try_recv().is_err());
}

#[test]
fn whole_numbers_with_a_fraction_are_integers() {
    let f = serve("whole");
    assert_eq!(
        f.request("PUT", "/vm/fork", Some(json!({"count": 3.0}))),
        (200, json!({"clones": 3}))
    );
    f.actions.recv().unwrap();
    assert!(f
        .error("PUT", "/vm/fork", Some(json!({"count": 2.5})), 400)
        .contains("count"));
    let mut v = json!({"a": 1e3, "b": [2.0, -4.0, 0.5], "c": {"d": 1e300, "e": "7.0"}});
    body::whole_numbers_as_integers(&mut v);
    assert_eq!(
        v,
        json!({"a": 1000, "b": [2, -4, 0.5], "c": {"d": 1e300, "e": "7.0"}})
    );
    assert!(v["a"].is_u64() && v["b"][1].is_i64());
    // An exec's integers as well (its body is checked before the guest is asked).
    assert_eq!(
        f.error(
            "POST",
            "/vm/exec",
            Some(json!({"argv": ["true"], "timeout_ms": 1000.0})),
            409
        ),
        "the VM has no vsock socket"
    );
}

#[test]
fn malformed_http_gets_400() {
    let f = serve("400-http");
    for request in [
        &b"HELLO\r\n\r\n"[..],
        b"GET /vm HTTP/1.1 extra\r\n\r\n",
        b"GET /vm\r\n\r\n",
        b"GET vm HTTP/1.1\r\n\r\n",
        b"GET /vm HTTP/1.1\r\nbroken header\r\n\r\n",
        b"GET /vm HTTP/1.1\r\nContent-Length: many\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",
    ] {
        let r = f.raw(request);
        assert_eq!(r.status, 400, "{:?}", String::from_utf8_lossy(request));
        assert_eq!(r.header("content-type"), Some("application/json"));
        assert_eq!(r.header("connection"), Some("close"));
        assert!(r.json()["error"].is_string());
    }
    assert_eq!(f.raw(b"GET /vm HTTP/2.0\r\n\r\n").status, 505);
    assert_eq!(f.request("GET", "/vm", None).0, 200);
}

#[test]
fn bad_bodies_get_400_naming_the_problem() {
    let f = serve("400-body");
    let fork = |body: &str| {
        let request = format!(
            "PUT /vm/fork HTTP/1.1\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        let r = f.raw(request.as_bytes());
        assert_eq!(r.status, 400, "{body}");
        r.json()["error"].as_str().unwrap().to_owned()
    };
    assert!(fork("{count: 2}").contains("not valid JSON"));
    assert!(fork("{\"count\": 2").contains("not valid JSON"));
    assert!(fork("[2]").contains("JSON object"));
    assert!(fork("").contains("\"count\""));
    assert!(fork(r#"{"count": 2, "colour": "red"}"#).contains("\"colour\""));
    // One limit for the API and the fork path: the fork path's is MAX_FORK_COUNT itself.
    // (1e3 is the integer 1000, as JSON Schema counts: taken, see
    // whole_numbers_with_a_fraction_are_integers; 1e300 is past any integer.)
    for count in ["-1", "1.5", "\"3\"", "10001", "4294967296", "1e300", "true"] {
        let message = fork(&format!(r#"{{"count": {count}}}"#));
        assert!(
            message.contains("\"count\"") && message.contains("10000"),
            "{message}"
        );
    }
    assert!(fork(r#"{"name_prefix": "x"}"#).contains("needs the field \"count\""));
    assert!(fork(r#"{"count": 1, "name_prefix": 5}"#).contains("\"name_prefix\""));
    assert!(fork(r#"{"count": 1, "parent": "sleeping"}"#).contains("\"parent\""));
    assert!(fork(r#"{"count": 1, "overcommit": "yes"}"#).contains("\"overcommit\""));

    let snapshot = |body: Option<Value>| f.error("PUT", "/vm/snapshot", body, 400);
    assert!(snapshot(None).contains("\"path\""));
    assert!(snapshot(Some(json!({}))).contains("\"path\""));
    assert!(snapshot(Some(json!({"path": ""}))).contains("empty"));
    assert!(snapshot(Some(json!({"path": 42}))).contains("must be a string"));
    assert!(snapshot(Some(json!({"path": "/d", "compress": true}))).contains("\"compress\""));

    let message = f.error("PUT", "/vm/pause", Some(json!({"now": true})), 400);
    assert!(
        message.contains("\"now\"") && message.contains("no body"),
        "{message}"
    );
    assert_eq!(
        f.error("GET", "/vm", Some(json!([])), 400),
        "the body of GET /vm must be a JSON object, e.g. {}"
    );
    assert!(
        f.actions.try_recv().is_err(),
        "no bad request reaches the VM"
    );
}

#[test]
fn deeply_nested_json_is_refused_not_fatal() {
    let f = serve("nested");
    for depth in [100, 127, 200, 30_000] {
        let body = format!("{{\"count\": {}{}}}", "[".repeat(depth), "]".repeat(depth));
        let request = format!(
            "PUT /vm/fork HTTP/1.1\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        assert_eq!(f.raw(request.as_bytes()).status, 400, "depth {depth}");
    }
    assert_eq!(f.request("GET", "/vm", None).0, 200);
}

#[test]
fn oversized_body_gets_413_without_being_read() {
    let f = serve("413");
    let started = Instant::now();
    // Announce 100 000 bytes but send none: the answer must not wait for them.
    let r = f.raw(b"PUT /vm/snapshot HTTP/1.1\r\nContent-Length: 100000\r\n\r\n");
    assert_eq!(r.status, 413);
    assert!(r.json()["error"].as_str().unwrap().contains("65536"));
    assert!(started.elapsed() < Duration::from_secs(2));
    // The client sends it all; it still reads the answer.
    let big = json!({ "path": "x".repeat(200_000) });
    assert!(f
        .error("PUT", "/vm/snapshot", Some(big), 413)
        .contains("at most"));
    // 64 KiB exactly is fine.
    let body = format!(r#"{{"path": "{}"}}"#, "y".repeat(65536 - 12));
    assert_eq!(body.len(), 65536);
    let request = format!("PUT /vm/snapshot HTTP/1.1\r\nContent-Length: 65536\r\n\r\n{body}");
    assert_eq!(f.raw(request.as_bytes()).status, 200);
}

#[test]
fn chunked_bodies_are_refused() {
    let f = serve("chunked");
    let r = f.raw(
        b"PUT /vm/fork HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nc\r\n{\"count\": 1}\r\n0\r\n\r\n",
    );
    assert_eq!(r.status, 411);
    assert!(r.json()["error"]
        .as_str()
        .unwrap()
        .contains("Content-Length"));
    assert!(f.actions.try_recv().is_err());
}

#[test]
fn oversized_headers_are_refused() {
    let f = serve("431");
    let mut request = b"GET /vm HTTP/1.1\r\nX-Junk: ".to_vec();
    request.resize(20_000, b'j');
    request.extend_from_slice(b"\r\n\r\n");
    assert_eq!(f.raw(&request).status, 431);
}

#[test]
fn expect_100_continue_is_honoured() {
    let f = serve("continue");
    let mut stream = UnixStream::connect(f.socket()).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream
        .write_all(b"PUT /vm/fork HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 12\r\n\r\n")
        .unwrap();
    let mut interim = [0; 25];
    stream.read_exact(&mut interim).unwrap();
    assert_eq!(&interim, b"HTTP/1.1 100 Continue\r\n\r\n");
    stream.write_all(b"{\"count\": 5}").unwrap();
    let r = read_raw(&mut stream);
    assert_eq!((r.status, r.json()), (200, json!({"clones": 5})));
}

fn short_timeouts() -> Timeouts {
    Timeouts {
        idle: Duration::from_millis(300),
        request: Duration::from_millis(1000),
        reply: Duration::from_secs(20),
    }
}

#[test]
fn idle_client_does_not_block_others() {
    let f = start("idle", Mode::Answer, short_timeouts());
    let mut idle = UnixStream::connect(f.socket()).unwrap();
    let mut half = UnixStream::connect(f.socket()).unwrap();
    half.write_all(b"PUT /vm/fork HTTP/1.1\r\nContent-Le")
        .unwrap();
    let started = Instant::now();
    assert_eq!(f.request("GET", "/vm", None).0, 200);
    assert!(started.elapsed() < Duration::from_secs(3));
    let r = read_raw(&mut idle);
    assert_eq!(r.status, 408);
    assert_eq!(read_raw(&mut half).status, 408);
}

#[test]
fn slow_client_hits_the_request_deadline() {
    let f = start("slow", Mode::Answer, short_timeouts());
    let socket = f.socket().to_owned();
    let dribbler = std::thread::spawn(move || {
        let mut stream = UnixStream::connect(socket).unwrap();
        // One byte every 100 ms never trips the idle timeout, only the deadline.
        for &b in b"GET /vm HTTP/1.1\r\nX-Slow: "
            .iter()
            .chain([b'z'; 100].iter())
        {
            if stream.write_all(&[b]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    std::thread::sleep(Duration::from_millis(50));
    let started = Instant::now();
    assert_eq!(f.request("GET", "/vm", None).0, 200);
    assert!(started.elapsed() < Duration::from_secs(3));
    dribbler.join().unwrap();
}

#[test]
fn garbage_never_stops_the_server() {
    let f = serve("garbage");
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for round in 0..200 {
        let len = round * 7 % 300;
        let bytes: Vec<u8> = (0..len)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed as u8
            })
            .collect();
        let mut stream = UnixStream::connect(f.socket()).unwrap();
        let mut request = b"PUT /vm/fork HTTP/1.1\r\n".to_vec();
        if round % 2 == 0 {
            request.clear();
        }
        request.extend_from_slice(&bytes);
        let _ = stream.write_all(&request);
        let _ = stream.shutdown(std::net::Shutdown::Write);
        let mut sink = Vec::new();
        let _ = stream.read_to_end(&mut sink);
    }
    assert_eq!(f.request("GET", "/vm", None).0, 200);
}

#[test]
fn dropped_reply_gets_503() {
    let f = start("503", Mode::Drop, Timeouts::default());
    let message = f.error("PUT", "/vm/pause", None, 503);
    assert_eq!(message, "the VM is shutting down");
}

#[test]
fn gone_controller_gets_503() {
    let dir = temp_dir("503-gone");
    let (events, calls) = mpsc::channel();
    let server = ApiServer::start(&dir.join("api.sock"), events, Event::Api, no_guest()).unwrap();
    drop(calls);
    let (status, body) = request(server.path(), "GET", "/vm", None).unwrap();
    assert_eq!(
        (status, body),
        (503, json!({"error": "the VM is shutting down"}))
    );
    drop(server);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn slow_controller_gets_504() {
    let timeouts = Timeouts {
        reply: Duration::from_millis(300),
        ..Timeouts::default()
    };
    let f = start("504", Mode::Hold, timeouts);
    let message = f.error("PUT", "/vm/snapshot", Some(json!({"path": "/s"})), 504);
    assert!(message.contains("did not answer"), "{message}");
    // The server is still there for the next one.
    assert_eq!(f.request("PUT", "/vm/resume", None).0, 504);
}

#[test]
fn invalid_controller_status_gets_500() {
    let f = start("500", Mode::Invalid, Timeouts::default());
    assert!(f.error("GET", "/vm", None, 500).contains("42"));
}

#[test]
fn stopping_answers_a_waiting_client_and_returns_promptly() {
    let dir = temp_dir("stop");
    let (server, actions) = controller(&dir.join("api.sock"), Mode::Hold, Timeouts::default());
    let socket = server.path().to_owned();
    let client = {
        let socket = socket.clone();
        std::thread::spawn(move || request(&socket, "PUT", "/vm/pause", None))
    };
    actions.recv_timeout(Duration::from_secs(10)).unwrap();
    let started = Instant::now();
    server.shutdown();
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(!socket.exists(), "the socket file is removed");
    let (status, body) = client.join().unwrap().unwrap();
    assert_eq!(
        (status, body),
        (503, json!({"error": "the VM is shutting down"}))
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn socket_is_private_and_removed_on_drop() {
    let dir = temp_dir("mode");
    let socket = dir.join("api.sock");
    let (server, _actions) = controller(&socket, Mode::Answer, Timeouts::default());
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    drop(server);
    assert!(!socket.exists());
    assert!(matches!(
        request(&socket, "GET", "/vm", None),
        Err(ApiError::NotListening { .. })
    ));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn stale_socket_is_replaced() {
    let dir = temp_dir("stale");
    let socket = dir.join("api.sock");
    drop(UnixListener::bind(&socket).unwrap());
    assert!(socket.exists());
    let err = request(&socket, "GET", "/vm", None).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "no mayfly listens on {0}: is the VM running with --api-sock {0}?",
            socket.display()
        )
    );
    let (server, _actions) = controller(&socket, Mode::Answer, Timeouts::default());
    assert_eq!(request(&socket, "GET", "/vm", None).unwrap().0, 200);
    drop(server);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn live_socket_is_refused() {
    let f = serve("live");
    let (events, _calls) = mpsc::channel();
    let err = ApiServer::start(f.socket(), events.clone(), Event::Api, no_guest()).unwrap_err();
    assert!(
        matches!(err, ApiError::Claim(ClaimError::InUse { .. })),
        "{err}"
    );
    assert!(err.to_string().contains("in use"), "{err}");
    // The probe did not disturb the live server, and its socket is still there.
    assert_eq!(f.request("GET", "/vm", None).0, 200);

    // Another program's socket is just as live.
    let other = f.dir.join("other.sock");
    let _listener = UnixListener::bind(&other).unwrap();
    let err = ApiServer::start(&other, events, Event::Api, no_guest()).unwrap_err();
    assert!(
        matches!(err, ApiError::Claim(ClaimError::InUse { .. })),
        "{err}"
    );
}

#[test]
fn unusable_paths_are_explained() {
    let dir = temp_dir("paths-bad");
    let (events, _calls) = mpsc::channel();
    let start =
        |path: &Path| ApiServer::start(path, events.clone(), Event::Api, no_guest()).unwrap_err();

    let long = dir.join("x".repeat(120));
    let err = start(&long);
    assert!(
        matches!(err, ApiError::Claim(ClaimError::PathTooLong { .. })),
        "{err}"
    );
    assert!(err.to_string().contains("at most 107"), "{err}");
    let longest = PathBuf::from(format!(
        "{}/{}",
        dir.display(),
        "y".repeat(107 - dir.as_os_str().len() - 1)
    ));
    assert_eq!(longest.as_os_str().len(), 107);
    drop(ApiServer::start(&longest, events.clone(), Event::Api, no_guest()).unwrap());

    let err = start(&dir.join("no-such-dir/api.sock"));
    assert!(
        err.to_string().contains("no-such-dir does not exist"),
        "{err}"
    );

    let file = dir.join("file");
    std::fs::write(&file, "keep me").unwrap();
    let err = start(&file.join("api.sock"));
    assert!(err.to_string().contains("is not a directory"), "{err}");
    let err = start(&file);
    assert!(
        matches!(err, ApiError::Claim(ClaimError::NotASocket { .. })),
        "{err}"
    );
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me");

    assert!(matches!(
        start(Path::new("")),
        ApiError::Claim(ClaimError::InvalidPath(_))
    ));
    assert!(matches!(
        request(&long, "GET", "/vm", None),
        Err(ApiError::PathTooLong { .. })
    ));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn client_refuses_to_send_nonsense() {
    let socket = Path::new("/nonexistent/api.sock");
    assert!(matches!(
        request(socket, "GET /x", "/vm", None),
        Err(ApiError::InvalidRequest(_))
    ));
    assert!(matches!(
        request(socket, "GET", "/vm HTTP/1.1\r\nX: y", None),
        Err(ApiError::InvalidRequest(_))
    ));
    assert!(matches!(
        request(socket, "GET", "/vm", None),
        Err(ApiError::NotListening { .. })
    ));
}

#[test]
fn curl_can_drive_it() {
    // curl is part of the test set-up (scripts/setup.sh installs it): missing, the test fails
    // rather than passing without having driven anything.
    let curl = Path::new("/usr/bin/curl");
    assert!(
        curl.exists(),
        "/usr/bin/curl is missing: install it (apt-get install curl, or run scripts/setup.sh)"
    );
    let f = serve("curl");
    let curl = |args: &[&str]| {
        let out = std::process::Command::new(curl)
            .args(["-s", "--max-time", "20", "--unix-socket"])
            .arg(f.socket())
            .args(["-w", "\n%{http_code}"])
            .args(args)
            .output()
            .unwrap();
        let text = String::from_utf8(out.stdout).unwrap();
        let (body, code) = text.rsplit_once('\n').unwrap();
        (code.parse::<u16>().unwrap(), body.trim().to_owned())
    };
    assert_eq!(
        curl(&["-X", "PUT", "http://localhost/vm/pause"]),
        (204, String::new())
    );
    assert_eq!(f.actions.try_recv().unwrap(), Action::Pause);
    assert_eq!(
        curl(&["http://localhost/vm"]),
        (200, r#"{"state":"running"}"#.to_owned())
    );
    assert_eq!(
        curl(&[
            "-X",
            "PUT",
            "-d",
            r#"{"count": 2, "parent": "paused"}"#,
            "http://localhost/vm/fork"
        ]),
        (200, r#"{"clones":2}"#.to_owned())
    );
    let (code, body) = curl(&["-X", "POST", "http://localhost/vm/fork"]);
    assert_eq!(code, 405);
    assert!(body.contains("use PUT /vm/fork"), "{body}");
    // A large upload: curl may ask `Expect: 100-continue`; either way the answer is 413.
    let big = f.dir.join("big.json");
    std::fs::write(&big, format!(r#"{{"path": "{}"}}"#, "z".repeat(2 << 20))).unwrap();
    let data = format!("@{}", big.display());
    let (code, body) = curl(&[
        "-X",
        "PUT",
        "--data-binary",
        &data,
        "http://localhost/vm/snapshot",
    ]);
    assert_eq!(code, 413, "{body}");
    assert_eq!(curl(&["http://localhost/vm/"]).0, 200);
}

#[test]
fn extreme_timeouts_do_not_panic() {
    let forever = Timeouts {
        idle: Duration::MAX,
        request: Duration::MAX,
        reply: Duration::MAX,
    };
    let f = start("forever", Mode::Answer, forever);
    let reply = request_with_timeout(f.socket(), "GET", "/vm", None, Duration::MAX).unwrap();
    assert_eq!(reply.0, 200);
    let instant = Timeouts {
        idle: Duration::ZERO,
        request: Duration::ZERO,
        reply: Duration::ZERO,
    };
    let f = start("instant", Mode::Answer, instant);
    match request_with_timeout(f.socket(), "GET", "/vm", None, Duration::ZERO) {
        Ok((status, _)) => assert!([200, 408, 504].contains(&status), "{status}"),
        Err(ApiError::Timeout { .. }) => {}
        Err(err) => panic!("{err}"),
    }
}

#[test]
fn two_hundred_half_requests_do_not_keep_a_good_one_waiting() {
    // Default timeouts: the slow clients stay connected for the whole test (5 s idle).
    let f = start("many-slow", Mode::Answer, Timeouts::default());
    let mut slow = Vec::new();
    for _ in 0..200 {
        let mut stream = UnixStream::connect(f.socket()).unwrap();
        // Past MAX_CONNECTIONS the server answers 503 and closes at once, which may come
        // before this write: a closed pipe is that refusal, any other error is not.
        match stream.write_all(b"GET /vm HTTP/1.1\r\nContent-Le") {
            Ok(()) => {}
            Err(e) if matches!(e.kind(), ErrorKind::BrokenPipe | ErrorKind::ConnectionReset) => {}
            Err(e) => panic!("writing a half request: {e}"),
        }
        slow.push(stream);
    }
    // Answered while all 200 are still connected, their idle timeout (5 s) not reached:
    // the answer came from a server that serves connections side by side, not in turn.
    let started = Instant::now();
    let (status, body) =
        request_with_timeout(f.socket(), "GET", "/vm", None, Duration::from_secs(4)).unwrap();
    assert!(
        started.elapsed() < Timeouts::default().idle,
        "answered only after the slow clients timed out"
    );
    // Past MAX_CONNECTIONS the slowest sender gives up its place: the good request is
    // served, not turned away.
    assert_eq!(status, 200, "{body}");
    drop(slow);
    // Once the slow ones are gone, requests are served as usual.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, _) = f.request("GET", "/vm", None);
        if status == 200 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still busy after the slow clients left"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_busy_server_says_so_at_once() {
    // Every slot holds a whole request the VM has not answered yet (as long execs would):
    // nobody can be asked to make room.
    let f = start("busy", Mode::Hold, Timeouts::default());
    let mut slow = Vec::new();
    for _ in 0..server::MAX_CONNECTIONS {
        let mut stream = UnixStream::connect(f.socket()).unwrap();
        stream.write_all(b"GET /vm HTTP/1.1\r\n\r\n").unwrap();
        slow.push(stream);
    }
    // Let the server take them all.
    std::thread::sleep(Duration::from_millis(300));
    // The answer comes before any request is read: the client may not even get to send one.
    let mut extra = UnixStream::connect(f.socket()).unwrap();
    let _ = extra.write_all(b"GET /vm HTTP/1.1\r\n\r\n");
    let r = read_raw(&mut extra);
    assert_eq!(r.status, 503);
    assert!(r.json()["error"].as_str().unwrap().contains("connections"));
}

#[test]
fn two_servers_racing_for_a_stale_socket_end_with_one_winner() {
    let dir = temp_dir("race");
    for round in 0..20 {
        let socket = dir.join(format!("api-{round}.sock"));
        drop(UnixListener::bind(&socket).unwrap());
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(2));
        let racers: Vec<_> = (0..2)
            .map(|_| {
                let socket = socket.clone();
                let barrier = barrier.clone();
                std::thread::spawn(move || {
                    let (events, calls) = mpsc::channel::<Event>();
                    barrier.wait();
                    let result = ApiServer::start(&socket, events, Event::Api, no_guest());
                    (result, calls)
                })
            })
            .collect();
        let results: Vec<_> = racers.into_iter().map(|r| r.join().unwrap()).collect();
        let winners = results.iter().filter(|(r, _)| r.is_ok()).count();
        assert_eq!(
            winners, 1,
            "round {round}: {winners} servers own the socket"
        );
        for (result, _) in &results {
            if let Err(err) = result {
                assert!(
                    matches!(err, ApiError::Claim(ClaimError::InUse { .. })),
                    "round {round}: {err}"
                );
            }
        }
        let lock = dir.join(format!("api-{round}.sock.lock"));
        assert!(lock.exists(), "the winner holds the lock file");
        drop(results);
        assert!(!lock.exists(), "the lock file goes with its server");
        assert!(!socket.exists(), "so does the socket");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// What a reply keeps (a fork's held clones) is let go only once the answer has been written:
/// when it is dropped, the client's socket already holds the answer.
#[test]
fn what_a_reply_keeps_goes_only_after_the_answer_is_written() {
    struct Kept {
        client: UnixStream,
        seen: mpsc::Sender<isize>,
    }
    impl Delivery for Kept {}
    impl Drop for Kept {
        fn drop(&mut self) {
            use nix::sys::socket::{recv, MsgFlags};
            let mut byte = [0u8; 1];
            let waiting = recv(
                std::os::fd::AsRawFd::as_raw_fd(&self.client),
                &mut byte,
                MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT,
            );
            let _ = self.seen.send(waiting.map_or(-1, |n| n as isize));
        }
    }
    let dir = temp_dir("keeping");
    let (events, calls) = mpsc::channel();
    let server = ApiServer::start(&dir.join("api.sock"), events, Event::Api, no_guest()).unwrap();
    let mut client = UnixStream::connect(server.path()).unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let (seen, dropped) = mpsc::channel();
    let kept = Kept {
        client: client.try_clone().unwrap(),
        seen,
    };
    std::thread::spawn(move || {
        if let Ok(Event::Api(call)) = calls.recv() {
            call.respond(Reply::ok(json!({ "clones": 1 })).keeping(kept));
        }
    });
    let body = br#"{"count": 1}"#;
    let request = format!(
        "PUT /vm/fork HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    client.write_all(request.as_bytes()).unwrap();
    client.write_all(body).unwrap();
    let waiting = dropped
        .recv_timeout(Duration::from_secs(20))
        .expect("the kept value was dropped");
    assert!(
        waiting > 0,
        "dropped before the answer was written (peek: {waiting})"
    );
    let response = read_raw(&mut client);
    assert_eq!(response.status, 200, "{response:?}");
    assert_eq!(response.json()["clones"], 1);
    let _ = std::fs::remove_dir_all(&dir);
}
