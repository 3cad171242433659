//! `mayfly-fake-vm --sock PATH --vsock PATH`: a VMM process without a VM, for tests of the
//! control socket's guest routes against a guest agent the test plays itself. It serves the
//! real control socket (mayfly-api) with the VMM's real guest routes (mayfly-vmm), which reach
//! the agent through `--vsock` (where the test listens, as a VM's vsock device would answer);
//! a stand-in for the VM's controller answers `GET /vm`, pause, resume, snapshot and shutdown
//! at once. In a process of its own, like a VMM, so that a test can watch its memory.
//!
//! Prints `ready` once it serves; exits on `PUT /vm/shutdown` or when its stdin closes.
// Lossy `as` casts are refused here (tests aside): every conversion that can lose bits says
// why it cannot.
#![cfg_attr(
    not(test),
    warn(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_possible_wrap
    )
)]

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{mpsc, Arc};

use mayfly_api::{Action, ApiCall, ApiServer, Reply};
use mayfly_vmm::guest::routes::Routes;

fn main() -> ExitCode {
    let mut sock = None;
    let mut vsock = None;
    let mut args = std::env::args_os().skip(1);
    while let Some(arg) = args.next() {
        match arg.to_str() {
            Some("--sock") => sock = args.next().map(PathBuf::from),
            Some("--vsock") => vsock = args.next().map(PathBuf::from),
            _ => {
                eprintln!("usage: mayfly-fake-vm --sock PATH --vsock PATH");
                return ExitCode::from(2);
            }
        }
    }
    let (Some(sock), Some(vsock)) = (sock, vsock) else {
        eprintln!("usage: mayfly-fake-vm --sock PATH --vsock PATH");
        return ExitCode::from(2);
    };
    let (events, calls) = mpsc::channel::<ApiCall>();
    let server = match ApiServer::start(
        &sock,
        events,
        |call| call,
        Arc::new(Routes {
            vsock: Some(vsock.clone()),
            ..Routes::default()
        }),
    ) {
        Ok(server) => server,
        Err(e) => {
            eprintln!("mayfly-fake-vm: cannot serve {}: {e}", sock.display());
            return ExitCode::FAILURE;
        }
    };
    // The test ends us by closing our stdin (or by killing us).
    std::thread::spawn(|| {
        let mut sink = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut sink);
        std::process::exit(0);
    });
    println!("ready");
    let _ = std::io::stdout().flush();
    let mut paused = false;
    for call in calls {
        let reply = match call.action.clone() {
            Action::Describe => Reply::ok(serde_json::json!({
                "state": if paused { "paused" } else { "running" },
                "pid": std::process::id(),
                "vsock": {"path": vsock, "guest_cid": 3},
                "agent_refresh": "done",
            })),
            Action::Pause if paused => Reply::error(409, "the VM is paused already"),
            Action::Pause => {
                paused = true;
                Reply::no_content()
            }
            Action::Resume if !paused => Reply::error(409, "the VM is not paused"),
            Action::Resume => {
                paused = false;
                Reply::no_content()
            }
            Action::Snapshot { path, .. } if paused => {
                Reply::ok(serde_json::json!({ "path": path, "state_bytes": 0 }))
            }
            Action::Snapshot { .. } => Reply::error(409, "the VM must be paused: PUT /vm/pause"),
            Action::Shutdown => {
                call.respond(Reply::no_content());
                server.shutdown();
                return ExitCode::SUCCESS;
            }
            _ => Reply::error(501, "mayfly-fake-vm does not do that"),
        };
        call.respond(reply);
    }
    ExitCode::SUCCESS
}
