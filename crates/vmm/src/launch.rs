//! Running a VM as a process, from its start to its exit status: the stop signals taken from
//! the first moment ([`with_stop_signals`]), the VM started and driven by its controller
//! ([`serve`]), a fork's clone told to its fork and held until the fork ends, and the line
//! that says how the VM ended. The `mayfly` command's `run`, `restore` and `zygote` are made
//! of these; so is a program that embeds mayfly and wants the same process behaviour.

use std::process::ExitCode;

use mayfly_jail::seccomp::ThreadKind;
use mayfly_sys::terminal::RawTerminal;

use crate::controller::Controller;
use crate::devices::console::Console;
use crate::event::{VmEvent, VmExit};
use crate::persist::restore::{self, Instance};
use crate::persist::zygote::Reporter;
use crate::signals::StopSignals;

fn fail(err: impl std::fmt::Display) -> ExitCode {
    eprintln!("mayfly: {err}");
    ExitCode::FAILURE
}

/// Run `body` with the stop signals taken by a thread of their own from the first moment: a
/// VMM told to stop while it is still starting its VM exits then and there.
pub fn with_stop_signals(
    ready: Option<Reporter>,
    body: impl FnOnce(Started) -> ExitCode,
) -> ExitCode {
    if let Err(err) = crate::memory::ram::install_sigbus_handler() {
        return fail_and_report(ready, format!("cannot set up signal handling: {err}"));
    }
    match StopSignals::start() {
        Ok(signals) => body(Started { signals, ready }),
        Err(err) => fail_and_report(ready, format!("cannot set up signal handling: {err}")),
    }
}

/// What `run` and `restore` start with: the signal thread, and whom to tell that the VM runs.
pub struct Started {
    pub signals: StopSignals,
    /// For a clone: the fork that waits for it to run.
    pub ready: Option<Reporter>,
}

/// Say why the VM could not start (to its fork too, for a clone).
pub fn fail_and_report(ready: Option<Reporter>, err: impl std::fmt::Display) -> ExitCode {
    if let Some(ready) = ready {
        ready.failed(&err.to_string());
    }
    fail(err)
}

/// When a console on stdio puts the terminal in raw mode.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Raw {
    /// Before the VM starts: the guest's first output and input find it raw.
    BeforeStart,
    /// Once it runs: for a VMM standing by, which may wait for its snapshot for hours (a raw
    /// terminal would swallow Ctrl-C meanwhile and queue keystrokes for a guest not yet there).
    OnceRunning,
}

/// Start a VM with `start` and run it until it ends; the process exit status says how.
pub fn serve<E: std::fmt::Display>(
    console: &Console,
    started: Started,
    raw: Raw,
    start: impl FnOnce() -> Result<Controller, E>,
) -> ExitCode {
    let Started { signals, ready } = started;
    let stdio = *console == Console::Stdio;
    let mut raw_terminal = (stdio && raw == Raw::BeforeStart)
        .then(RawTerminal::stdin)
        .flatten();
    let controller = match start() {
        Ok(controller) => controller,
        Err(err) => {
            drop(raw_terminal);
            return fail_and_report(ready, err);
        }
    };
    if stdio && raw == Raw::OnceRunning {
        raw_terminal = RawTerminal::stdin();
    }
    mayfly_sys::trace::event("vcpus_started");
    if let Some(ready) = ready {
        let Some(fork_end) = ready.ready() else {
            // The fork that made this clone cannot hear of it (it has failed or gone), so
            // nobody would know this VM runs.
            eprintln!("mayfly: the fork that started this clone is gone; the clone stops");
            std::process::exit(1);
        };
        // Held until the fork has every clone ready; then it goes.
        let events = controller.event_sender.clone();
        let builder = std::thread::Builder::new()
            .name("fork-end".into())
            .stack_size(mayfly_sys::HELPER_THREAD_STACK);
        let waiting = mayfly_jail::seccomp::spawn(builder, ThreadKind::ForkEnd, move || {
            if fork_end.wait() {
                let _ = events.send(VmEvent::ForkEnded);
            } else {
                // Nobody was told of this clone: it stops (cleanly, its sockets removed).
                eprintln!(
                    "mayfly: this clone's fork did not end well (the VMM that forked it \
                     ended before its fork did, or the fork's answer reached nobody); the \
                     clone stops"
                );
                let _ = events.send(VmEvent::Signal(libc::SIGTERM));
            }
        });
        if let Err(err) = waiting {
            eprintln!("mayfly: cannot wait for the fork's end ({err}); the clone runs now");
            let _ = controller.event_sender.send(VmEvent::ForkEnded);
        }
    }
    signals.forward_to(controller.event_sender.clone());
    let exit = controller.run();
    drop(raw_terminal);
    match &exit {
        VmExit::PowerOff | VmExit::Shutdown => {}
        VmExit::Reset => eprintln!(
            "mayfly: the guest rebooted; mayfly does not restart it (exit status {})",
            VmExit::RESET_STATUS
        ),
        VmExit::Signal(sig) => eprintln!("mayfly: stopped by signal {sig}"),
        VmExit::Crashed {
            index,
            reason,
            registers,
        } => eprintln!("mayfly: vCPU {index} stopped the VM: {reason}\n{registers}"),
        VmExit::Failed(reason) => eprintln!("mayfly: the VM stopped: {reason}"),
    }
    let status = exit.status();
    // A vCPU left stuck in the kernel must not keep the process alive.
    std::process::exit(i32::from(status))
}

/// A clone, in the process the fork's zygote made for it: finish the restore and run the VM.
pub fn start_clone(prepared: restore::Prepared, instance: Instance, report: Reporter) -> ! {
    let started = std::time::Instant::now();
    let console = instance.console.clone();
    with_stop_signals(Some(report), |signals| {
        serve(&console, signals, Raw::BeforeStart, || {
            let claims = restore::Claims::take(&instance)?;
            let vmm = restore::start(prepared, instance, claims, started)?;
            let mut controller = Controller::new(vmm);
            // Restored paused: it runs once its fork has every clone ready (see ForkEnd).
            controller.hold_for_fork();
            Ok::<_, restore::RestoreError>(controller)
        })
    });
    std::process::exit(1)
}

/// `mayfly zygote --state-fd S --memory-fd M[,M...] --socket-fd K`, started by a fork of this process
/// (see [`crate::persist::zygote`]): it makes the fork's clones, each running
/// [`start_clone`], and returns the zygote's exit status. A program that embeds mayfly and
/// forks VMs answers that command line the same way (the zygote is started as
/// `/proc/self/exe zygote ...`).
pub fn zygote(state_fd: i32, memory_fds: &[i32], socket_fd: i32) -> ExitCode {
    if let Err(err) = crate::memory::ram::install_sigbus_handler() {
        return fail(format!("cannot set up signal handling: {err}"));
    }
    ExitCode::from(crate::persist::zygote::serve(
        state_fd,
        memory_fds,
        socket_fd,
        start_clone,
    ))
}

/// For a program that embeds mayfly and forks VMs: call first thing in `main`. When this
/// process was started as a fork's zygote (`<this program> zygote --state-fd S --memory-fd M[,M...]
/// --socket-fd K`, as the fork starts it), it runs the zygote and returns its exit status;
/// otherwise it returns `None` and the program goes on.
pub fn zygote_if_asked() -> Option<ExitCode> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) != Some("zygote") {
        return None;
    }
    let fd = |name: &str| {
        args.windows(2)
            .find(|pair| pair[0] == name)
            .and_then(|pair| pair[1].parse::<i32>().ok())
    };
    let fds = |name: &str| {
        args.windows(2)
            .find(|pair| pair[0] == name)
            .and_then(|pair| {
                pair[1]
                    .split(',')
                    .map(|fd| fd.parse::<i32>().ok())
                    .collect::<Option<Vec<_>>>()
            })
    };
    Some(
        match (fd("--state-fd"), fds("--memory-fd"), fd("--socket-fd")) {
            (Some(state), Some(memory), Some(socket)) => zygote(state, &memory, socket),
            _ => fail(
                "zygote: expected --state-fd N --memory-fd N[,N...] --socket-fd N (a fork \
                 starts it)",
            ),
        },
    )
}
