//! What a jailed VMM's waiter does outside the jail: it keeps the VM's network.
//!
//! `mayfly run|restore --jail` forks; the parent stays outside as the waiter (root, see
//! `mayfly_jail::jail`). A VM with a NIC needs its network namespace, tap and nftables egress
//! policy made and changed as root, which the jailed VMM no longer is once its guest runs. So
//! the waiter holds them ([`keep_network`]): the VMM asks it for the network before its jail
//! is locked down and gets the tap back (`mayfly_network::keeper`), and the policy is changed
//! through the waiter alone, at a control socket of its own beside the VM's: `<api-sock>.net`,
//! mode 0600, so only root reaches it, made once the VM has its network. It answers the VM's
//! own routes for its network: `GET /vm/net`, `PUT /vm/net/policy` and `PUT /vm/net/expose`.
//! The VMM never changes the policy nor exposes a port: a guest that took over its VMM still
//! cannot open its own egress.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};

use mayfly_api::guest::{Call, Context, GuestRoutes, Outcome};
use mayfly_api::http::Request;
use mayfly_api::{Action, ApiCall, ApiServer, Reply};
use mayfly_jail::jail::OutsideWork;
use mayfly_network::keeper::Keeper;

pub use mayfly_api::network_socket;

/// The waiter's work for a jailed VM that may have a NIC: keep its network, and once it has
/// one, serve its network routes at `sock` (none: its policy cannot be changed while it
/// runs). A VM without a NIC costs a thread that waits, and no socket.
pub fn keep_network(sock: Option<PathBuf>) -> OutsideWork {
    Box::new(move |vmm_pid, vmm| {
        let keeper = Arc::new(Keeper::new(vmm_pid));
        // The server once made, and whether the VMM has ended (then a server made late is
        // shut down at once).
        let server: Arc<Mutex<(Option<ApiServer>, bool)>> = Arc::default();
        let (kept, serving) = (Arc::clone(&keeper), Arc::clone(&server));
        let answering = std::thread::Builder::new()
            .name("net-keeper".into())
            .stack_size(mayfly_sys::HELPER_THREAD_STACK)
            .spawn(move || {
                let mut made = || {
                    let Some(path) = &sock else { return };
                    match serve(path, Arc::clone(&kept)) {
                        Ok(started) => {
                            let mut held = lock(&serving);
                            if held.1 {
                                started.shutdown();
                            } else {
                                held.0 = Some(started);
                            }
                        }
                        Err(e) => eprintln!(
                            "mayfly: the jailed VM's network policy cannot be changed while \
                             it runs: cannot serve {}: {e}",
                            path.display()
                        ),
                    }
                };
                kept.serve(&vmm, &mut made);
            });
        if let Err(e) = answering {
            // The VMM's request for a network then fails (nobody answers): it says so.
            eprintln!("mayfly: cannot start the jailed VM's network keeper: {e}");
        }
        Box::new(move || {
            let started = {
                let mut held = lock(&server);
                held.1 = true;
                held.0.take()
            };
            if let Some(server) = started {
                server.shutdown();
            }
            keeper.end();
        })
    })
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// No guest routes here: this socket is for the VM's network alone.
struct NetworkOnly;

impl GuestRoutes for NetworkOnly {
    fn serve(
        &self,
        _call: Call,
        _request: &Request,
        _stream: &std::os::unix::net::UnixStream,
        _cx: &Context,
    ) -> Outcome {
        Reply::error(404, ONLY_NETWORK).into()
    }
}

const ONLY_NETWORK: &str = "this socket is the jail waiter's, for the VM's network only: GET \
    /vm/net, PUT /vm/net/policy and PUT /vm/net/expose; everything else goes to the VM's \
    control socket (this path without .net)";

fn serve(path: &Path, keeper: Arc<Keeper>) -> Result<ApiServer, mayfly_api::ApiError> {
    let (calls, answered) = channel::<ApiCall>();
    // Root's alone: made with no permission for anyone else (the waiter's other threads make
    // no files meanwhile), and set so again in case the umask was not kept.
    // SAFETY: umask has no memory effects.
    let old = unsafe { libc::umask(0o177) };
    let server = ApiServer::start(path, calls, |call| call, Arc::new(NetworkOnly));
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    let server = server?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(mayfly_api::ApiError::Thread)?;
    std::thread::Builder::new()
        .name("net-policy".into())
        .stack_size(mayfly_sys::HELPER_THREAD_STACK)
        .spawn(move || answer(&answered, &keeper))
        .map_err(mayfly_api::ApiError::Thread)?;
    Ok(server)
}

fn answer(calls: &Receiver<ApiCall>, keeper: &Keeper) {
    const NO_NIC: &str =
        "the VM has no NIC (it was started with --net none, or its snapshot had none)";
    for call in calls {
        let reply = match &call.action {
            Action::Net => match keeper.describe() {
                Some(described) => Reply::ok(described),
                None => Reply::error(409, NO_NIC),
            },
            Action::NetPolicy(policy) => match keeper.set_policy(policy.clone()) {
                Some(Ok(described)) => Reply::ok(described),
                // Names are resolved now; a policy that cannot be applied leaves the old one.
                Some(Err(e)) => Reply::error(policy_status(&e), e.to_string()),
                None => Reply::error(409, NO_NIC),
            },
            Action::NetExpose { port, on } => match keeper.expose(*port, on.clone()) {
                Some(Ok(endpoint)) => Reply::ok(serde_json::json!({
                    "guest_port": port,
                    "host": match endpoint {
                        mayfly_network::HostEndpoint::Tcp(addr) => format!("tcp:{addr}"),
                        mayfly_network::HostEndpoint::Unix(path) => format!("unix:{}", path.display()),
                    },
                })),
                Some(Err(e)) => Reply::error(expose_status(&e), e.to_string()),
                None => Reply::error(409, NO_NIC),
            },
            Action::NetUnexpose { port, on } => match keeper.unexpose(*port, on.as_ref()) {
                Some(was) => unexposed(*port, was),
                None => Reply::error(409, NO_NIC),
            },
            _ => Reply::error(404, ONLY_NETWORK),
        };
        call.respond(reply);
    }
}

/// The answer to `PUT /vm/net/unexpose`: 200 if `port` was exposed (now no longer), 409 if
/// it was not.
pub(crate) fn unexposed(port: u16, was: bool) -> Reply {
    if was {
        Reply::ok(serde_json::json!({ "guest_port": port, "exposed": false }))
    } else {
        Reply::error(
            409,
            format!("guest port {port} is not exposed: PUT /vm/net/expose exposes it"),
        )
    }
}

/// A policy that cannot be applied: the request's fault (400: it names nothing resolvable,
/// or only what no VM reaches), the resolver's (503: try again), or the host's (500).
pub(crate) fn policy_status(e: &mayfly_network::NetworkError) -> u16 {
    match e.fault() {
        mayfly_network::Fault::Request => 400,
        mayfly_network::Fault::Resolver => 503,
        mayfly_network::Fault::Host => 500,
    }
}

/// A port that cannot be exposed: taken or exposed already (409), or the host's fault (500).
fn expose_status(e: &mayfly_network::NetworkError) -> u16 {
    match e {
        mayfly_network::NetworkError::Expose { source, .. }
            if matches!(
                source.kind(),
                std::io::ErrorKind::AddrInUse | std::io::ErrorKind::AlreadyExists
            ) =>
        {
            409
        }
        _ => 500,
    }
}
