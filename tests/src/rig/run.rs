//! Running a command in the rig: checking the options, writing the control directory, starting
//! QEMU (batch, or interactive on this terminal), waiting for it within the timeout, and reading
//! back the command's exit status and output, or saying from L1's logs why there is none.

use std::ffi::OsStr;
use std::fs;
use std::io::{self, IsTerminal};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::artifacts::{
    check_artifacts, describe_status, ensure_artifacts, find_qemu, source_root,
};
use super::control::ControlDir;
use super::error::{io_err, RigError};
use super::l1::{command_env, kept_dirs, rig_conf, run_script, rw_dirs};
use super::options::{RigArtifacts, RigOptions, RigOutput};
use super::qemu::qemu_args;

/// Runs `command` (program and arguments) inside L1 and returns its exit status and output.
///
/// Fails (rather than returning a status) when the rig could not run the command to its end:
/// bad options, missing QEMU or artifacts, a timeout, or an L1 that never reported the status.
/// The control directory is kept on failure; errors name its logs.
pub fn run<S: AsRef<OsStr>>(opts: &RigOptions, command: &[S]) -> Result<RigOutput, RigError> {
    let command: Vec<&OsStr> = command.iter().map(AsRef::as_ref).collect();
    if command.is_empty() || command[0].is_empty() {
        return Err(RigError::EmptyCommand);
    }
    validate_numbers(opts)?;
    let env = command_env(opts)?;
    let rw = rw_dirs(&opts.rw)?;
    let cwd = match &opts.cwd {
        Some(dir) => dir.clone(),
        None => std::env::current_dir().map_err(io_err("cannot read the current directory"))?,
    };
    if cwd.as_os_str().as_bytes().contains(&b'\n') {
        return Err(RigError::BadOption {
            what: "working directory",
            reason: format!("{} contains a newline", cwd.display()),
        });
    }
    let qemu = find_qemu(opts)?;
    let mut artifacts = match (&opts.kernel, &opts.initrd) {
        (Some(kernel), Some(initrd)) => RigArtifacts {
            kernel: kernel.clone(),
            initrd: initrd.clone(),
        },
        _ => ensure_artifacts()?,
    };
    if let Some(kernel) = &opts.kernel {
        artifacts.kernel = kernel.clone();
    }
    if let Some(initrd) = &opts.initrd {
        artifacts.initrd = initrd.clone();
    }
    check_artifacts(&artifacts)?;

    let ctl = ControlDir::create()?;
    for dir in &rw {
        if dir.starts_with(&ctl.path) || ctl.path.starts_with(dir) {
            return Err(RigError::BadRwDir {
                path: dir.clone(),
                reason: format!(
                    "overlaps the rig's control directory {}",
                    ctl.path.display()
                ),
            });
        }
    }
    let terminal_size = if opts.interactive {
        terminal_size()
    } else {
        None
    };
    let keep = kept_dirs(&[cwd.clone(), source_root()]);
    ctl.write(
        "rig.conf",
        &rig_conf(&ctl.path, &rw, &keep, opts.interactive, terminal_size),
    )?;
    ctl.write("run.sh", &run_script(&cwd, &env, &command))?;

    let args = qemu_args(opts, &artifacts, &ctl.path, &rw);
    let qemu_log = ctl.path.join("qemu.log");
    let qemu_log_file = fs::File::create(&qemu_log)
        .map_err(io_err(format!("cannot create {}", qemu_log.display())))?;
    let mut cmd = Command::new(&qemu);
    cmd.args(&args).stderr(qemu_log_file);
    if opts.interactive {
        cmd.stdin(Stdio::inherit()).stdout(Stdio::inherit());
    } else {
        cmd.stdin(Stdio::null());
        cmd.stdout(if opts.stream {
            Stdio::inherit()
        } else {
            Stdio::null()
        });
    }
    // QEMU sets the terminal raw and restores it when it exits normally; keep a copy in case it
    // is killed.
    let saved_terminal = if opts.interactive {
        saved_terminal_settings()
    } else {
        None
    };
    let start = Instant::now();
    let mut child = cmd.spawn().map_err(|source| RigError::QemuSpawn {
        qemu: qemu.clone(),
        source,
    })?;
    let qemu_status = wait_with_timeout(&mut child, opts.timeout, opts.interactive)?;
    let elapsed = start.elapsed();
    if let Some(settings) = saved_terminal {
        let _ = Command::new("stty")
            .arg(settings)
            .stdin(Stdio::inherit())
            .stderr(Stdio::null())
            .status();
    }

    report_emulator_faults(&qemu_log);
    let console_log = ctl.path.join("console.log");
    let kernel_log = ctl.path.join("l1-kernel.log");
    let Some(qemu_status) = qemu_status else {
        ctl.keep();
        return Err(RigError::Timeout {
            secs: opts.timeout.map(|t| t.as_secs_f64()).unwrap_or_default(),
            console_log,
            kernel_log,
        });
    };
    let status = match read_exit_status(&ctl.path.join("exit-status")) {
        Ok(status) => status,
        Err(_) if opts.interactive && user_stopped(&kernel_log) => {
            ctl.keep();
            return Err(RigError::Stopped { kernel_log });
        }
        Err(reason) => {
            ctl.keep();
            return Err(RigError::NoExitStatus {
                reason,
                qemu_status: describe_status(qemu_status),
                tail: log_tail(&kernel_log, &qemu_log),
                kernel_log,
                qemu_log,
            });
        }
    };
    let output = fs::read(&console_log).unwrap_or_default();
    let control_dir = if opts.keep_control_dir {
        ctl.keep();
        Some(ctl.path.clone())
    } else {
        None
    };
    Ok(RigOutput {
        status,
        output,
        elapsed,
        control_dir,
    })
}

/// The rig's patched QEMU prints a line when it catches its own SVM emulation breaking a guest
/// (tests/rig/qemu/patches/0003: a #VMEXIT outside guest mode, which hands an L2 vCPU the L1
/// host's registers); say so, so that a failed run's report names the emulator as the cause.
fn report_emulator_faults(qemu_log: &Path) {
    let text = fs::read_to_string(qemu_log).unwrap_or_default();
    let faults = count_bad_vmexits(&text);
    if faults > 0 {
        // The patch prints the first 20 only.
        let faults = if faults >= 20 {
            format!("at least {faults}")
        } else {
            faults.to_string()
        };
        eprintln!(
            "mayfly-rig: the rig's QEMU delivered {faults} #VMEXIT(s) outside guest mode (an \
             emulator bug, tests/rig/qemu/patches/0003): each gave an L2 vCPU the L1 host's \
             registers; see {}",
            qemu_log.display()
        );
    }
}

pub(super) fn count_bad_vmexits(qemu_log: &str) -> usize {
    qemu_log
        .lines()
        .filter(|l| l.starts_with("rig-qemu: cpu ") && l.contains("outside guest mode"))
        .count()
}

fn validate_numbers(opts: &RigOptions) -> Result<(), RigError> {
    if !(1..=64).contains(&opts.cpus) {
        return Err(RigError::BadOption {
            what: "vCPU count",
            reason: format!("{} is not between 1 and 64", opts.cpus),
        });
    }
    if !(256..=1024 * 1024).contains(&opts.mem_mib) {
        return Err(RigError::BadOption {
            what: "memory size",
            reason: format!("{} MiB is not between 256 MiB and 1 TiB", opts.mem_mib),
        });
    }
    if opts.timeout == Some(Duration::ZERO) {
        return Err(RigError::BadOption {
            what: "timeout",
            reason: "it must be more than 0 s".to_string(),
        });
    }
    let model = &opts.cpu_model;
    if model.is_empty()
        || !model
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"+-_,.=".contains(&b))
    {
        return Err(RigError::BadOption {
            what: "CPU model",
            reason: format!(
                "{model:?} is not a QEMU -cpu model (e.g. EPYC, max, qemu64,+svm,+npt)"
            ),
        });
    }
    Ok(())
}
/// Waits for QEMU; `None` if it had to be stopped at the timeout.
fn wait_with_timeout(
    child: &mut Child,
    timeout: Option<Duration>,
    interactive: bool,
) -> Result<Option<ExitStatus>, RigError> {
    let deadline = timeout.map(|t| Instant::now() + t);
    loop {
        if let Some(status) = child.try_wait().map_err(io_err("cannot wait for QEMU"))? {
            return Ok(Some(status));
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            stop(child, interactive);
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Stops QEMU: SIGTERM first when it owns the terminal (so it restores it), then SIGKILL.
fn stop(child: &mut Child, interactive: bool) {
    if interactive {
        if let Ok(pid) = libc::pid_t::try_from(child.id()) {
            // SAFETY: kill(2) takes plain integers and touches no memory of this process; `pid` is
            // our own child, which has not been reaped yet (try_wait returned None), so the pid
            // cannot have been reused by another process.
            unsafe {
                libc::kill(pid, libc::SIGTERM);
            }
            let until = Instant::now() + Duration::from_secs(2);
            while Instant::now() < until {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
    let _ = child.kill();
    let _ = child.wait();
}

fn read_exit_status(path: &Path) -> Result<i32, String> {
    let text = match fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(format!("no {}", path.display()))
        }
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    text.trim()
        .parse::<i32>()
        .map_err(|_| format!("{} holds {:?}, not a number", path.display(), text.trim()))
}

/// Whether L1 was running the command and stopped without a trace of its own: the user quit QEMU.
fn user_stopped(kernel_log: &Path) -> bool {
    let log = fs::read(kernel_log).unwrap_or_default();
    let log = String::from_utf8_lossy(&log);
    log.contains("mayfly-rig-l1: running")
        && !log.contains("mayfly-rig-l1: command exited")
        && !log.contains("Kernel panic")
        && !log.contains("reboot:")
}

fn log_tail(kernel_log: &Path, qemu_log: &Path) -> String {
    let mut tail = String::new();
    for (label, path, lines) in [("L1", kernel_log, 25), ("QEMU", qemu_log, 10)] {
        let text = fs::read(path).unwrap_or_default();
        let text = String::from_utf8_lossy(&text);
        let all: Vec<&str> = text.lines().collect();
        for line in &all[all.len().saturating_sub(lines)..] {
            tail.push_str(&format!("  {label}| {line}\n"));
        }
    }
    if tail.is_empty() {
        tail.push_str("  (both logs are empty)\n");
    }
    tail
}

/// The settings of the terminal on stdin, from `stty -g`.
fn saved_terminal_settings() -> Option<String> {
    if !io::stdin().is_terminal() {
        return None;
    }
    let out = Command::new("stty")
        .arg("-g")
        .stdin(Stdio::inherit())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    let settings = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (out.status.success() && !settings.is_empty()).then_some(settings)
}

/// The terminal size of stdin, as (rows, columns), from `stty size`.
fn terminal_size() -> Option<(u16, u16)> {
    if !io::stdin().is_terminal() {
        return None;
    }
    let out = Command::new("stty")
        .arg("size")
        .stdin(Stdio::inherit())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut it = text.split_whitespace().map(|n| n.parse::<u16>().ok());
    match (it.next()??, it.next()??) {
        (0, _) | (_, 0) => None,
        size => Some(size),
    }
}
