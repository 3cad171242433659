//! `mayfly serve`: the sandbox manager (`mayfly_serve`) started with its stop signals.

use std::process::ExitCode;

use crate::args::{OverBudgetPolicy, ServeArgs};
use crate::error::fail;

/// `mayfly serve`: the sandbox manager, until SIGTERM, SIGINT or SIGHUP (which leave the
/// sandboxes as they are).
pub(crate) fn serve_sandboxes(args: ServeArgs) -> ExitCode {
    use nix::sys::signal::{SigSet, SigmaskHow, Signal};
    let mut signals = SigSet::empty();
    for sig in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP] {
        signals.add(sig);
    }
    // Blocked before any thread starts, so every thread inherits it and the signal thread
    // takes them (a VMM the manager starts gets an empty mask again: std resets it).
    if let Err(e) = nix::sys::signal::pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&signals), None) {
        return fail(format!("cannot block the stop signals: {e}"));
    }
    let (stop_tx, stop_rx) = match std::os::unix::net::UnixStream::pair() {
        Ok(pair) => pair,
        Err(e) => return fail(format!("cannot make a socket pair: {e}")),
    };
    let waiter = std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            let _ = signals.wait();
            drop(stop_tx);
        });
    if let Err(e) = waiter {
        return fail(format!("cannot start the signal thread: {e}"));
    }
    let state_dir = match mayfly_serve::absolute_state_dir(&args.state_dir) {
        Ok(dir) => dir,
        Err(e) => return fail(e),
    };
    let mayfly = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => {
            return fail(format!(
                "cannot find the mayfly binary (/proc/self/exe): {e}"
            ))
        }
    };
    let config = mayfly_serve::ServeConfig {
        state_dir,
        sock: args.sock,
        mayfly,
        policy: mayfly_serve::Policy {
            jail: !args.no_jail,
            jail_uid_base: args.jail_uid_base,
            mem_budget_mib: args.mem_budget_mib,
            make_room: matches!(args.when_over_budget, OverBudgetPolicy::SuspendIdle),
            disk_budget_mib: args.disk_budget_mib,
            expire_after_s: args.expire_after,
            template_ttl_s: args.template_ttl.0,
            crash_at: args.crash_at,
            images_dirs: args
                .images_dir
                .iter()
                .map(|d| std::path::absolute(d).unwrap_or_else(|_| d.clone()))
                .collect(),
            vmm_allowance_mib: args.vmm_allowance_mib,
            console_limit: args.console_limit,
            net_args: args.net.vmm_args(),
            net_names: args.net.names(),
            net_pool: mayfly_serve::NetPoolConfig {
                size: usize::try_from(args.net_pool).unwrap_or(0),
                network: args.net.settings().network_config(),
            },
        },
    };
    match mayfly_serve::serve(&config, stop_rx) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(e),
    }
}
