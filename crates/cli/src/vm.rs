//! `mayfly run`, `mayfly restore` and the zygote's clones: the process's environment read once,
//! the jail entered, the VM started and run to its exit (`mayfly_vmm::launch`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use mayfly_sys::trace;
use mayfly_vmm::controller::Controller;
use mayfly_vmm::devices::config::RestoreTargets;
use mayfly_vmm::launch::{fail_and_report, serve, with_stop_signals, Raw, Started};
use mayfly_vmm::persist::restore::{self, Instance, MemoryMode, RestoreConfig, SnapshotSource};
use mayfly_vmm::{boot, identity};

use crate::args::{beside_socket, RestoreArgs, RunArgs, ZygoteArgs};
use crate::error::fail;
use crate::error::{EnvError, Error};

/// Enter the jail if asked (see vmm/src/jail.rs): returns in the jailed VMM, or with the
/// error that kept it from being made; the process that called it waits outside and exits
/// with the VMM's status.
///
/// The waiter keeps the VM's network, if it has a NIC (see `mayfly_vmm::outside`): it serves
/// the network's routes at `<api-sock>.net`, which it removes with the VM's other sockets.
fn enter_jail(
    jail: Option<mayfly_jail::jail::JailConfig>,
    name: &str,
    api_sock: Option<&Path>,
    vsock: Option<&Path>,
) -> Result<(), ExitCode> {
    let Some(config) = jail else {
        return Ok(());
    };
    let net_sock = api_sock.map(mayfly_vmm::outside::network_socket);
    let sockets = [api_sock, vsock]
        .into_iter()
        .flatten()
        .map(Path::to_path_buf)
        .chain(net_sock.clone())
        .collect();
    let keeper = mayfly_vmm::outside::keep_network(net_sock);
    mayfly_jail::jail::enter(config, name, sockets, Some(keeper)).map_err(fail)
}

/// Raise this process's descriptor limit to the hard limit: a fork follows each of its
/// clones through a pidfd until all run (a thousand clones, a thousand descriptors), and
/// Debian's default soft limit is 1024.
pub(crate) fn raise_descriptor_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid rlimit struct; failure leaves the limit as is.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max
        {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}

/// The environment a VMM process reads, here and nowhere below `main`:
/// - `MAYFLY_SECCOMP`: `on` (the default), `log` or `off` (see `mayfly_jail::seccomp`);
/// - `MAYFLY_KVM_DEVICE`: another KVM device node than /dev/kvm;
/// - `MAYFLY_CACHE`: where the build scripts keep images (default `~/.cache/mayfly`);
/// - `MAYFLY_CONSOLE_LIMIT`: the most a console file takes (bytes, or with K, M, G);
/// - `MAYFLY_FORK_COPY`, `MAYFLY_FORK_IN_FLIGHT`: the fork's measuring knobs (see
///   `mayfly_vmm::settings`);
/// - `MAYFLY_TRACE`: the process prints its phases on stderr (`mayfly-trace: PHASE NS`), as
///   `--trace` does: a restore, a boot, a fork's zygote and clones, and so every VMM of a
///   `mayfly serve` started with it (each sandbox's `vmm.log`).
///
/// A bad `MAYFLY_SECCOMP` is said now, before anything starts (a filtered thread that met it
/// later could only end the process).
pub(crate) fn take_environment() -> Result<(), EnvError> {
    let var = |name| std::env::var_os(name).filter(|v| !v.is_empty());
    let seccomp = std::env::var("MAYFLY_SECCOMP")
        .unwrap_or_default()
        .parse()?;
    let _ = mayfly_jail::seccomp::set_mode(seccomp);
    if var("MAYFLY_TRACE").is_some() {
        trace::enable();
    }
    let _ = mayfly_vmm::settings::set(mayfly_vmm::settings::Settings {
        kvm_device: var("MAYFLY_KVM_DEVICE")
            .map_or_else(|| PathBuf::from("/dev/kvm"), PathBuf::from),
        cache_dir: cache_dir(),
        fork_copy: std::env::var_os("MAYFLY_FORK_COPY").is_some(),
        fork_in_flight: std::env::var("MAYFLY_FORK_IN_FLIGHT")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n > 0),
        console_limit: match var("MAYFLY_CONSOLE_LIMIT") {
            None => None,
            Some(v) => Some(
                v.to_str()
                    .and_then(crate::error::parse_size)
                    .ok_or_else(|| EnvError::ConsoleLimit(v.to_owned()))?,
            ),
        },
    });
    Ok(())
}

/// `$MAYFLY_CACHE`, else `~/.cache/mayfly` (where the build scripts put images).
fn cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("MAYFLY_CACHE") {
        return Some(PathBuf::from(dir));
    }
    std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache/mayfly"))
}

pub(crate) fn run(args: RunArgs) -> ExitCode {
    if args.boot_trace {
        trace::enable();
        trace::event("main");
    }
    let jail = args.jail.config();
    let config = match args.into_config() {
        Ok(config) => config,
        Err(err) => return fail(err),
    };
    let vsock = config
        .devices
        .vsock
        .as_ref()
        .and_then(|v| v.path.as_deref());
    if let Err(code) = enter_jail(jail, &config.name, config.api_sock.as_deref(), vsock) {
        return code;
    }
    with_stop_signals(None, |started| {
        let console = config.console.clone();
        serve(&console, started, Raw::BeforeStart, || {
            boot::boot(&config)
                .map(Controller::new)
                .map_err(Error::Boot)
        })
    })
}

pub(crate) fn restore(args: RestoreArgs) -> ExitCode {
    if args.trace {
        trace::enable();
        trace::event("main");
    }
    let vsock = beside_socket(args.vsock.clone(), args.api_sock.as_deref(), ".vsock");
    let name = args.name.clone().unwrap_or_else(|| "restore".into());
    if let Err(code) = enter_jail(
        args.jail.config(),
        &name,
        args.api_sock.as_deref(),
        vsock.as_deref(),
    ) {
        return code;
    }
    with_stop_signals(None, |started| restore_started(args, started))
}

fn restore_started(args: RestoreArgs, started: Started) -> ExitCode {
    let Started { signals, ready } = started;
    let (memory, instance, dir) = match restore_instance(args) {
        Ok(made) => made,
        Err(err) => return fail_and_report(ready, err),
    };
    let console = instance.console.clone();
    match dir {
        Some(dir) => serve(
            &console,
            Started { signals, ready },
            Raw::BeforeStart,
            || {
                let config = RestoreConfig {
                    source: SnapshotSource::Dir(dir),
                    memory,
                    instance,
                };
                restore::restore(config)
                    .map(Controller::new)
                    .map_err(Error::Restore)
            },
        ),
        None => serve(
            &console,
            Started { signals, ready },
            Raw::OnceRunning,
            || {
                mayfly_vmm::persist::standby::stand_by(instance, memory)
                    .map(Controller::new)
                    .map_err(Error::Restore)
            },
        ),
    }
}

/// What `mayfly restore` makes of its arguments: the memory mode, the instance, and the
/// snapshot directory (none with --standby: a request names it later).
fn restore_instance(args: RestoreArgs) -> Result<(MemoryMode, Instance, Option<PathBuf>), String> {
    let memory = match (args.memory, args.no_prefetch) {
        (MemoryMode::Lazy { .. }, true) => MemoryMode::Lazy { prefetch: false },
        (mode, _) => mode,
    };
    if let Some(name) = &args.name {
        identity::check_name(name).map_err(|e| e.to_string())?;
    }
    let net_policy = args
        .net
        .as_deref()
        .map(mayfly_vmm::devices::net::parse_policy)
        .transpose()
        .map_err(|e| e.to_string())?;
    let instance = Instance {
        origin: match &args.dir {
            Some(dir) => format!("restore of {}", dir.display()),
            None => "standby".into(),
        },
        console: args.console,
        console_input: args.console_input,
        api_sock: args.api_sock.clone(),
        paused: args.paused,
        name: args.name,
        clone_of: None,
        devices: RestoreTargets {
            vsock_path: beside_socket(args.vsock, args.api_sock.as_deref(), ".vsock"),
            vsock_cid: None,
            snapshot_dir: args.dir.clone(),
            disk_dir: beside_socket(args.disk_dir, args.api_sock.as_deref(), ".disks"),
            layers_within: args.disk_layers_within,
            layers_moved: None,
            net: mayfly_vmm::devices::net::NetTargets {
                settings: args.net_place.settings(),
                policy: net_policy,
                new_mac: args.new_mac,
            },
        },
    };
    Ok((memory, instance, args.dir))
}

/// `mayfly zygote`: started by a fork, it makes the fork's clones (see
/// `mayfly_vmm::persist::zygote`).
pub(crate) fn zygote(args: ZygoteArgs) -> ExitCode {
    mayfly_vmm::launch::zygote(args.state_fd, &args.memory_fd, args.socket_fd)
}
