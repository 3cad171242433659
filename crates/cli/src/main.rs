//! The `mayfly` command line.
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

use std::process::ExitCode;

use args::{parse, Command};
use error::fail;

mod args;
mod client;
mod error;
mod guest_commands;
mod serve;
mod vm;

fn main() -> ExitCode {
    let cli = parse();
    // The manager holds a pidfd per sandbox, its connections and its pool of networks (two
    // descriptors each), past Debian's default soft limit of 1024 with a few hundred.
    if matches!(cli.command, Command::Serve(_)) {
        vm::raise_descriptor_limit();
    }
    if matches!(
        cli.command,
        Command::Run(_) | Command::Restore(_) | Command::Zygote(_)
    ) {
        if !matches!(cli.command, Command::Zygote(_)) {
            vm::raise_descriptor_limit();
        }
        if let Err(err) = vm::take_environment() {
            return fail(err);
        }
    }
    match cli.command {
        Command::Run(args) => vm::run(args),
        Command::Restore(args) => vm::restore(args),
        Command::Pause(args) => client::client(&args.sock, "PUT", "/vm/pause", None),
        Command::Resume(args) => client::client(&args.sock, "PUT", "/vm/resume", None),
        Command::Status(args) => client::client(&args.sock, "GET", "/vm", None),
        Command::Shutdown(args) => client::client(&args.sock, "PUT", "/vm/shutdown", None),
        Command::Snapshot(args) => client::snapshot(args),
        Command::Fork(args) => client::fork(args),
        Command::Exec(args) => guest_commands::exec(args),
        Command::Cp(args) => guest_commands::cp(args),
        Command::Serve(args) => serve::serve_sandboxes(args),
        Command::Net(args) => client::net(args),
        Command::Zygote(args) => vm::zygote(args),
    }
}
