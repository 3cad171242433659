//! A VMM running before it is asked to restore anything: `mayfly restore --standby`.
//!
//! A restore from launch spends most of its time before the snapshot matters. Measured on
//! this host's KVM (128 MiB probe, launch → first `KVM_RUN` ~4 ms): starting the process
//! ~1.4 ms (a small static program alone 0.76 ms), the signal thread and the socket claims
//! ~0.3 ms, KVM's capability and CPUID probe ~0.8 ms (beside the state read), KVM_CREATE_VM
//! ~0.4 ms. A VMM standing by has done all of that, and waits on its control socket for one
//! request:
//!
//! ```text
//! PUT /vm/restore {"snapshot": "/absolute/path/to/snapshot"}
//! ```
//!
//! It restores that snapshot with the options it was started with and answers once the VM
//! runs (200, the body of `GET /vm`); from then on the socket is the VM's control socket like
//! any other (requests sent meanwhile wait in its queue). Before that it answers `GET /vm`
//! with `{"state": "standby"}` and anything else with 409. A snapshot it cannot read, check,
//! map or make a VM for gets its error (400, or 500 for a fault of this host) and the VMM
//! stands by again, with KVM made ready anew; a failure once the VM's devices and vCPUs are
//! being made ends the process (status 1; nothing half-made is kept), as does KVM that
//! cannot be made ready again.
//!
//! The same idea as the fork's zygote (see [`crate::persist::zygote`]): the process exists before it
//! is needed, and a request only brings it what differs. It pays for embedders that keep one
//! VMM standing by per VM they are about to wake; a restore typed on the command line still
//! starts a process.
//!
//! Requests are served one at a time, each within [`IDLE_TIMEOUT`] between pieces and
//! [`REQUEST_TIMEOUT`] in all: N clients that connect first and send nothing hold a restore
//! back by N × [`IDLE_TIMEOUT`]. The socket is its user's alone (0600), and a process of that
//! user can stop the VMM anyway; the VM's own control socket, once it runs, serves
//! connections side by side.

use std::io::Write;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};

use crate::persist::restore::{
    self, Claims, Instance, MemoryMode, ReadyKvm, RestoreError, SnapshotSource,
};
use crate::runtime::Vmm;
use mayfly_api::http::{self, Refusal};
use mayfly_sys::trace;

/// How long a client standing by may pause while it sends its request.
pub const IDLE_TIMEOUT: Duration = Duration::from_millis(500);
/// How long a client may take to send its whole request to a VMM standing by.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// The largest body a restore request may have.
const MAX_BODY: usize = 16 << 10;

/// The files of this process's control socket while it stands by (the socket and the lock
/// files of its claims: all its own, as it holds the locks), for [`remove_socket`].
static STANDING_BY: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

fn standing_by() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    STANDING_BY
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Marks the process as standing by, until dropped (an error: the claims, dropped with it,
/// remove their files themselves) or kept (the VM runs).
struct StandingBy;

impl StandingBy {
    fn on(instance: &Instance) -> Self {
        let lock = |path: &std::path::Path| {
            let mut lock = path.as_os_str().to_owned();
            lock.push(".lock");
            PathBuf::from(lock)
        };
        let mut files = Vec::new();
        if let Some(sock) = &instance.api_sock {
            files.push(sock.clone());
            files.push(lock(sock));
        }
        if let Some(vsock) = &instance.devices.vsock_path {
            files.push(lock(vsock));
        }
        *standing_by() = files;
        StandingBy
    }

    /// The VM runs: a stop signal before its controller takes signals still removes the
    /// files (the process ends at once); after, the controller stops the VM cleanly.
    fn keep(self) {
        std::mem::forget(self);
    }
}

impl Drop for StandingBy {
    fn drop(&mut self) {
        standing_by().clear();
    }
}

/// Remove the control socket and lock files of a VMM standing by (or whose VM has not yet
/// handed signals to its controller): for a stop signal, which ends the process without
/// unwinding. Nothing otherwise.
pub fn remove_socket() {
    for path in standing_by().drain(..) {
        let _ = std::fs::remove_file(path);
    }
}

/// What a VMM standing by is asked to restore.
#[derive(Debug)]
pub struct RestoreRequest {
    /// The snapshot directory (absolute).
    pub snapshot: PathBuf,
    /// The connection to answer once the VM runs (see [`RestoreRequest::answer`]).
    stream: UnixStream,
}

impl RestoreRequest {
    /// Answer the restore: `status` with `body` (the VM's description, or `{"error": ...}`).
    pub fn answer(self, status: u16, body: &Value) {
        write_reply(&self.stream, status, body);
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RestoreBody {
    snapshot: PathBuf,
}

/// Stand by on `instance`'s control socket until a snapshot can be restored as `instance` in
/// `memory` mode; return its VM, running (or paused, as `instance` asks), the restore request
/// answered. Errors: the control socket or KVM cannot be had, or a restore failed once its VM
/// had begun to be made.
pub fn stand_by(mut instance: Instance, memory: MemoryMode) -> Result<Vmm, RestoreError> {
    let mut claims = Claims::take(&instance)?;
    // Set once the paths are this process's (claimed), so that a stop signal removes them.
    let standing = StandingBy::on(&instance);
    let listener = claims
        .listen_early()?
        .ok_or_else(|| {
            RestoreError::Refused("a VMM standing by needs a control socket (--api-sock)".into())
        })?
        .try_clone()
        .map_err(RestoreError::Standby)?;
    let mut ready = ReadyKvm::open()?;
    trace::event("standing_by");
    loop {
        let request = wait_filtered(&listener)?;
        let started = std::time::Instant::now();
        trace::event("restore_requested");
        let snapshot = request.snapshot.clone();
        let prepared = restore::prepare_ready(
            SnapshotSource::Dir(snapshot.clone()),
            memory,
            instance.devices.layers_within.as_deref(),
            ready,
        );
        let prepared = match prepared {
            Ok(prepared) => prepared,
            Err(err) => {
                // Nothing of it is kept: KVM is made ready again for the next request.
                // This host's faults (KVM, memory, threads) are 500; the rest is the
                // snapshot's or the request's.
                let status = match err {
                    RestoreError::Vm(_)
                    | RestoreError::Memory(_)
                    | RestoreError::Thread(_)
                    | RestoreError::Lazy(_) => 500,
                    _ => 400,
                };
                request.answer(
                    status,
                    &json!({ "error": format!("cannot restore {}: {err}", snapshot.display()) }),
                );
                ready = ReadyKvm::open()?;
                continue;
            }
        };
        instance.origin = format!("restore of {}", snapshot.display());
        instance.devices.snapshot_dir = Some(snapshot);
        return match restore::start(prepared, instance, claims, started) {
            Ok(vmm) => {
                standing.keep();
                request.answer(200, &vmm.describe());
                Ok(vmm)
            }
            Err(err) => {
                request.answer(500, &json!({ "error": err.to_string() }));
                Err(err)
            }
        };
    }
}

/// [`next_restore`] on a thread under the control socket's seccomp filter: what clients send
/// is read and parsed there, never on the controller (which is not filtered: see
/// [`mayfly_jail::seccomp`]). The thread is started while nothing is asked of the VMM; handing the
/// request over costs the restore one wakeup.
fn wait_filtered(listener: &UnixListener) -> Result<RestoreRequest, RestoreError> {
    let listener = listener.try_clone().map_err(RestoreError::Standby)?;
    let (sender, receiver) = std::sync::mpsc::channel();
    let builder = std::thread::Builder::new()
        .name("api".into())
        .stack_size(mayfly_sys::HELPER_THREAD_STACK);
    mayfly_jail::seccomp::spawn(builder, mayfly_jail::seccomp::ThreadKind::Api, move || {
        let _ = sender.send(next_restore(&listener));
    })
    .map_err(RestoreError::Standby)?;
    match receiver.recv() {
        Ok(request) => request.map_err(RestoreError::Standby),
        Err(_) => Err(RestoreError::Standby(std::io::Error::other(
            "the thread serving the control socket ended without a request",
        ))),
    }
}

/// Serve `listener` until a valid restore request arrives; answer everything else. Fails
/// only if the listener does (nothing to stand by for then).
pub fn next_restore(listener: &UnixListener) -> std::io::Result<RestoreRequest> {
    loop {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            // Out of descriptors or memory for a moment, or a client gone before it was
            // accepted: the next accept may do.
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(
                        libc::EMFILE
                            | libc::ENFILE
                            | libc::ENOMEM
                            | libc::ENOBUFS
                            | libc::ECONNABORTED
                    )
                ) =>
            {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(e) => return Err(e),
        };
        if let Some(snapshot) = route(&stream) {
            return Ok(RestoreRequest { snapshot, stream });
        }
    }
}

/// Read one request from `stream` and answer it, unless it is a valid restore request: then
/// its snapshot directory, left for the caller to answer. (Public for the `api_request` fuzz
/// target, which feeds it what it feeds the VM's own control socket.)
pub fn route(stream: &UnixStream) -> Option<PathBuf> {
    let request = match http::read_request(stream, IDLE_TIMEOUT, REQUEST_TIMEOUT, |_, _| false) {
        Ok(request) => request,
        Err(Refusal::Silent) => return None,
        Err(Refusal::Reply { status, message }) => {
            write_reply(stream, status, &json!({ "error": message }));
            return None;
        }
    };
    let refuse = |status: u16, message: String| {
        write_reply(stream, status, &json!({ "error": message }));
        None
    };
    match (request.method.as_str(), request.path.as_str()) {
        ("GET", "/vm") => {
            write_reply(stream, 200, &json!({ "state": "standby" }));
            None
        }
        ("PUT", "/vm/restore") => match parse_body(&request.body) {
            Ok(snapshot) => Some(snapshot),
            Err(message) => refuse(400, message),
        },
        (_, "/vm/restore") => refuse(405, format!("{} /vm/restore: use PUT", request.method)),
        (method, path) => refuse(
            409,
            format!(
                "{method} {path}: this VMM stands by for a snapshot; restore one first with \
                 PUT /vm/restore {{\"snapshot\": \"/path/to/snapshot\"}}"
            ),
        ),
    }
}

/// The snapshot directory a restore request's body names.
fn parse_body(body: &[u8]) -> Result<PathBuf, String> {
    if body.len() > MAX_BODY {
        return Err(format!(
            "the body is {} bytes; a restore request's is at most {MAX_BODY}",
            body.len()
        ));
    }
    let parsed: RestoreBody = serde_json::from_slice(body)
        .map_err(|e| format!("the body must be {{\"snapshot\": \"/path/to/snapshot\"}} ({e})"))?;
    if !parsed.snapshot.is_absolute() {
        return Err(format!(
            "\"snapshot\": {} is not an absolute path (the VMM's working directory is not \
             the client's): give the snapshot directory's full path",
            parsed.snapshot.display()
        ));
    }
    Ok(parsed.snapshot)
}

fn write_reply(stream: &UnixStream, status: u16, body: &Value) {
    let _ = stream.set_write_timeout(Some(REQUEST_TIMEOUT));
    let _ = (&*stream).write_all(&http::encode_response(status, Some(body), &[]));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(listener: &UnixListener, path: &std::path::Path, raw: &str) -> (u16, Value) {
        let mut client = UnixStream::connect(path).unwrap();
        client.write_all(raw.as_bytes()).unwrap();
        let (stream, _) = listener.accept().unwrap();
        assert_eq!(route(&stream), None, "{raw} is not a restore");
        drop(stream);
        let response = http::read_response(&client, http::deadline(Duration::from_secs(5)))
            .expect("an answer");
        (
            response.status,
            serde_json::from_slice(&response.body).unwrap(),
        )
    }

    fn put(body: &str) -> String {
        format!(
            "PUT /vm/restore HTTP/1.1\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
    }

    #[test]
    fn a_vmm_standing_by_answers_what_is_not_a_restore_and_takes_what_is() {
        let dir = std::env::temp_dir().join(format!("mayfly-standby-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.sock");
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        assert_eq!(
            ask(&listener, &path, "GET /vm HTTP/1.1\r\n\r\n"),
            (200, json!({"state": "standby"}))
        );
        let (status, body) = ask(&listener, &path, "PUT /vm/pause HTTP/1.1\r\n\r\n");
        assert_eq!(status, 409, "{body}");
        assert!(body["error"].as_str().unwrap().contains("PUT /vm/restore"));
        assert_eq!(
            ask(&listener, &path, "GET /vm/restore HTTP/1.1\r\n\r\n").0,
            405
        );
        for bad in [
            "",
            "{}",
            "[1]",
            r#"{"snapshot": 7}"#,
            r#"{"snapshot": "relative/dir"}"#,
            r#"{"snapshot": "/a", "memory": "lazy"}"#,
        ] {
            let (status, body) = ask(&listener, &path, &put(bad));
            assert_eq!(status, 400, "{bad}: {body}");
        }
        let huge = format!(r#"{{"snapshot": "/{}"}}"#, "a".repeat(MAX_BODY));
        assert_eq!(ask(&listener, &path, &put(&huge)).0, 400);
        assert_eq!(ask(&listener, &path, "BREW /vm HTTP/9\r\n\r\n").0, 400);

        // A client that sends nothing is dropped at its deadline; the next one is served.
        let _silent = UnixStream::connect(&path).unwrap();
        let mut client = UnixStream::connect(&path).unwrap();
        client
            .write_all(put(r#"{"snapshot": "/snapshots/a"}"#).as_bytes())
            .unwrap();
        let request = next_restore(&listener).unwrap();
        assert_eq!(request.snapshot, PathBuf::from("/snapshots/a"));
        request.answer(200, &json!({"state": "running"}));
        let response =
            http::read_response(&client, http::deadline(Duration::from_secs(5))).unwrap();
        assert_eq!(response.status, 200);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
