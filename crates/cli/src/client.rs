//! The commands that talk to a running VM's control socket: pause, resume, status, shutdown,
//! fork, net, and snapshot (which pauses first if it must).

use std::path::Path;
use std::process::ExitCode;

use mayfly_api::body::{
    Count, ExposeBody, ForkBody, ForkParent, NetPolicyBody, Port, UnexposeBody,
};

use crate::args::{ForkArgs, NetArgs, SnapshotArgs};
use crate::error::fail;

/// A request body as JSON (the body types cannot fail to serialize).
pub(crate) fn body(body: &impl serde::Serialize) -> serde_json::Value {
    serde_json::to_value(body).unwrap_or_default()
}

/// One request to a VM's control socket; prints the answer.
pub(crate) fn client(
    sock: &Path,
    method: &str,
    path: &str,
    body: Option<serde_json::Value>,
) -> ExitCode {
    match mayfly_api::request(sock, method, path, body.as_ref()) {
        Ok((status, answer)) if (200..300).contains(&status) => {
            if !answer.is_null() {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&answer).unwrap_or_default()
                );
            }
            ExitCode::SUCCESS
        }
        Ok((status, answer)) => {
            let message = answer
                .get("error")
                .and_then(|e| e.as_str())
                .map(str::to_string)
                .unwrap_or_else(|| answer.to_string());
            fail(format!("{message} (HTTP {status})"))
        }
        Err(err) => fail(err),
    }
}

/// Pause if needed, snapshot, and resume if it was running (unless asked not to).
pub(crate) fn snapshot(args: SnapshotArgs) -> ExitCode {
    let sock = &args.sock.sock;
    let state = match mayfly_api::request(sock, "GET", "/vm", None) {
        Ok((200, vm)) => vm
            .get("state")
            .and_then(|s| s.as_str())
            .unwrap_or("")
            .to_string(),
        Ok((status, answer)) => return fail(format!("the VM answered HTTP {status}: {answer}")),
        Err(err) => return fail(err),
    };
    // A clone still held by its fork ("starting") runs in a moment: paused here, it stays
    // paused past its fork's end, and runs again after the snapshot (unless --keep-paused).
    let was_running = state == "running" || state == "starting";
    if was_running {
        let code = client(sock, "PUT", "/vm/pause", None);
        if code != ExitCode::SUCCESS {
            return code;
        }
    }
    let dir = std::path::absolute(&args.dir).unwrap_or(args.dir.clone());
    let code = client(
        sock,
        "PUT",
        "/vm/snapshot",
        Some(body(&mayfly_api::body::SnapshotBody {
            path: Some(dir.to_string_lossy().into_owned()),
            diff: Some(args.diff),
        })),
    );
    if was_running && !args.keep_paused {
        let resumed = client(sock, "PUT", "/vm/resume", None);
        if code == ExitCode::SUCCESS {
            return resumed;
        }
    }
    code
}

/// `mayfly fork`: `PUT /vm/fork`; a jailed VM is forked from here instead (each clone needs a
/// jail of its own, which only root outside the VM's can make: see
/// `mayfly_vmm::persist::fork::fork_from_outside`).
pub(crate) fn fork(args: ForkArgs) -> ExitCode {
    let sock = &args.sock.sock;
    let jailed = match mayfly_api::request(sock, "GET", "/vm", None) {
        Ok((200, vm)) => !vm["jail"].is_null(),
        Ok((status, answer)) => return fail(format!("the VM answered HTTP {status}: {answer}")),
        Err(err) => return fail(err),
    };
    if jailed || args.place.is_some() {
        return fork_from_outside(&args);
    }
    let request = ForkBody {
        count: Some(Count(args.count)),
        name_prefix: args.name_prefix,
        parent: Some(if args.keep_paused {
            ForkParent::Paused
        } else {
            ForkParent::Running
        }),
        overcommit: Some(args.overcommit),
    };
    client(&args.sock.sock, "PUT", "/vm/fork", Some(body(&request)))
}

/// `mayfly fork` of a jailed VM, or with `--place`: its clones are made by this process
/// (each in a jail of its own for a jailed VM), and run once their list is printed (with
/// `--hold`, once `go` is read).
fn fork_from_outside(args: &ForkArgs) -> ExitCode {
    if !nix::unistd::Uid::effective().is_root() {
        return fail(
            "the VM is jailed (or its clones placed): each of its clones is made a jail of its \
             own, which needs root; run mayfly fork as root",
        );
    }
    let placed = match &args.place {
        Some(path) => {
            let read = std::fs::read(path)
                .map_err(|e| e.to_string())
                .and_then(|bytes| {
                    serde_json::from_slice::<mayfly_vmm::persist::fork::Placed>(&bytes)
                        .map_err(|e| e.to_string())
                });
            match read {
                Ok(placed) => Some(placed),
                Err(e) => return fail(format!("--place {}: {e}", path.display())),
            }
        }
        None => None,
    };
    // Where the clones' networks are made is this command's to say (its --net-* options, as
    // the parent's were given), not the parent VMM's.
    let net = Some(args.net_place.settings());
    let request = mayfly_api::ForkRequest {
        count: args.count,
        name_prefix: args.name_prefix.clone(),
        parent_paused: args.keep_paused,
        overcommit: args.overcommit,
    };
    let sock = std::path::absolute(&args.sock.sock).unwrap_or(args.sock.sock.clone());
    let say = |line: &serde_json::Value| {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        writeln!(out, "{line}").and_then(|()| out.flush())
    };
    // With --hold, the one who holds the clones hears first that the parent is free, then
    // the clones (or why not), one line of JSON each.
    let mut on_captured = || {
        if args.hold {
            let _ = say(&serde_json::json!({ "captured": true }));
        }
    };
    let forked = mayfly_vmm::persist::fork::fork_from_outside(
        &sock,
        &request,
        placed,
        net,
        &mut on_captured,
    );
    match forked {
        Err(err) if args.hold => {
            let _ =
                say(&serde_json::json!({ "error": err.to_string(), "status": err.http_status() }));
            fail(err)
        }
        Ok(report) => {
            let printed = serde_json::to_string(&report)
                .map_err(std::io::Error::other)
                .and_then(|text| {
                    use std::io::Write;
                    let mut out = std::io::stdout().lock();
                    writeln!(out, "{text}")?;
                    out.flush()
                });
            if let Err(err) = printed {
                return fail(format!("cannot print the fork's clones ({err}); they stop"));
            }
            if args.hold {
                let mut line = String::new();
                let read = std::io::stdin().read_line(&mut line);
                if !(read.is_ok() && line.trim() == "go") {
                    return fail(
                        "the fork's clones were not let go (no \"go\" on stdin); they stop",
                    );
                }
            }
            // The clones run once their list is out (see zygote::Release).
            report.release.delivered();
            ExitCode::SUCCESS
        }
        Err(err) => fail(err),
    }
}

/// `mayfly net`: the VM's network, a new egress policy, or a guest port exposed.
pub(crate) fn net(args: NetArgs) -> ExitCode {
    let sock = &args.sock.sock;
    // A jailed VM's network is kept by its jail's waiter, which serves its changes beside
    // the VM's socket (see mayfly_vmm::outside).
    let kept = mayfly_vmm::outside::network_socket(sock);
    let changes = if kept.exists() { &kept } else { sock };
    if let Some(port) = args.unexpose {
        let request = UnexposeBody {
            port: Some(Port(port)),
            on: None,
        };
        return client(changes, "PUT", "/vm/net/unexpose", Some(body(&request)));
    }
    match (args.policy, args.expose) {
        (Some(policy), _) => {
            let request = NetPolicyBody {
                policy: Some(policy),
            };
            client(changes, "PUT", "/vm/net/policy", Some(body(&request)))
        }
        (None, Some(port)) => {
            let request = ExposeBody {
                port: Some(Port(port)),
                on: Some(args.on),
            };
            client(changes, "PUT", "/vm/net/expose", Some(body(&request)))
        }
        (None, None) => client(sock, "GET", "/vm/net", None),
    }
}
