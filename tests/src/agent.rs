//! Drive a VM through its guest agent from a test: run commands, copy files, wait for the
//! agent. This is how the guest tests check what a guest did (the console is for the tests of
//! the console itself).
//!
//! Timeouts here only stop a hung test; they are not performance assertions.

use std::path::Path;
use std::time::{Duration, Instant};

use mayfly_agent_protocol::{ExecOutput, ExecRequest};
use mayfly_vmm::guest::agent::Agent;

use crate::guest::{BOOT_TIMEOUT, COMMAND_TIMEOUT};

/// The agent of the VM whose control socket is `sock`, waiting up to `timeout` for it to come
/// up (a VM that is still booting); panics with the reason when it does not.
pub fn wait_agent(sock: &Path, timeout: Duration) -> Agent {
    let deadline = Instant::now() + timeout;
    loop {
        let attempt = Agent::for_vm(sock).and_then(|agent| {
            let left = deadline.saturating_duration_since(Instant::now());
            let agent = agent.with_wait(left);
            agent.ping().map(|_| agent)
        });
        match attempt {
            Ok(agent) => return agent.with_wait(COMMAND_TIMEOUT),
            Err(e) if Instant::now() >= deadline => {
                dump(sock);
                panic!(
                    "the agent of {} did not answer within {timeout:?}: {e}",
                    sock.display()
                )
            }
            // The control socket may not be there yet.
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// Ask the VMM behind `sock` for a state dump (on its stderr), for a failure report.
fn dump(sock: &Path) {
    if let Ok((200, vm)) = mayfly_api::request(sock, "GET", "/vm", None) {
        if let Some(pid) = vm["pid"].as_u64() {
            // SAFETY: kill(2) asking the VMM for a state dump; no memory effects.
            unsafe { libc::kill(libc::pid_t::try_from(pid).expect("a pid"), libc::SIGUSR1) };
            std::thread::sleep(Duration::from_secs(2));
        }
    }
}

/// Run `request` in the VM; panics (with a state dump of the VMM) if the agent cannot be
/// reached or the command does not end within [`COMMAND_TIMEOUT`].
pub fn exec_request(sock: &Path, request: ExecRequest, stdin: Option<Vec<u8>>) -> ExecOutput {
    // A VM just started (a restore, a clone) may not serve its socket yet.
    let agent = wait_agent(sock, BOOT_TIMEOUT);
    let request = match request.timeout_ms {
        Some(_) => request,
        None => {
            request.with_timeout_ms(u64::try_from(COMMAND_TIMEOUT.as_millis()).expect("minutes"))
        }
    };
    // The guest kills the command at its timeout; the host gives up on it a grace later
    // (mayfly_vmm::guest::watch::EXEC_GRACE), which catches a VM that stopped.
    agent.exec_output(&request, stdin).unwrap_or_else(|e| {
        dump(sock);
        panic!("exec {request:?} in {}: {e}", sock.display())
    })
}

/// Run a shell command line in the VM and return its stdout, trimmed; panics unless it exits
/// with status 0 (with its stderr in the message).
pub fn sh(sock: &Path, command: &str) -> String {
    let out = exec_request(sock, ExecRequest::shell(command), None);
    assert!(
        out.exit.success(),
        "{command:?} in {} ended {:?}; stderr: {}",
        sock.display(),
        out.exit,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}
