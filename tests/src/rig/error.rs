//! What can go wrong running the rig ([`RigError`], each message saying what to do about it),
//! and the exit codes the `mayfly-rig` CLI turns errors into.

use std::io;
use std::path::PathBuf;

/// Exit code of the `mayfly-rig` CLI when the command timed out.
pub const EXIT_TIMEOUT: i32 = 124;
/// Exit code of the `mayfly-rig` CLI when the user stopped QEMU (interactive runs).
pub const EXIT_STOPPED: i32 = 130;
/// Exit code of the `mayfly-rig` CLI when the rig itself failed (no exit status from the command).
pub const EXIT_RIG_FAILED: i32 = 125;

pub(super) const FLAVOUR: &str = "rig-l1";
/// Builds the rig's patched QEMU; with `--check` it only prints the cached build's path.
pub(super) const QEMU_BUILD_SCRIPT: &str = "tests/rig/qemu/build.sh";
/// Everything that can go wrong running the rig. Each message says what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum RigError {
    #[error("no command given: put the command to run inside L1 after `--`")]
    EmptyCommand,
    #[error("the rig's patched QEMU is not built ({reason}): run {script} (as root; it builds once, about 5 min on 2 cores) or scripts/setup.sh, or set MAYFLY_RIG_QEMU to another qemu-system-x86_64 (Debian's has an SVM bug that deadlocks L2 guests)")]
    QemuNotBuilt { script: PathBuf, reason: String },
    #[error(
        "cannot start {qemu}: {source} (run {QEMU_BUILD_SCRIPT} again, or check MAYFLY_RIG_QEMU)"
    )]
    QemuSpawn {
        qemu: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot find {path}: set MAYFLY_ROOT to the mayfly source tree (the directory holding guest-kernel/ and rootfs/)")]
    SourceTreeNotFound { path: PathBuf },
    #[error("building the {what} failed (`{script} {FLAVOUR}` {status}); its last output:\n{output}\nfix the problem it reports and run again")]
    BuildFailed {
        what: &'static str,
        script: PathBuf,
        status: String,
        output: String,
    },
    #[error(
        "the {what} build printed no output directory (`{script} {FLAVOUR}`): check the script"
    )]
    BuildNoOutput { what: &'static str, script: PathBuf },
    #[error(
        "the {what} {path} does not exist: build it (`{script} {FLAVOUR}`) or fix the path given"
    )]
    ArtifactMissing {
        what: &'static str,
        path: PathBuf,
        script: &'static str,
    },
    #[error("writable directory {path}: {reason}")]
    BadRwDir { path: PathBuf, reason: String },
    #[error("invalid environment setting {setting:?}: write NAME=VALUE, NAME made of letters, digits and _ (not starting with a digit)")]
    BadEnv { setting: String },
    #[error("invalid {what}: {reason}")]
    BadOption { what: &'static str, reason: String },
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
    #[error("the command did not finish within {secs} s, so QEMU was stopped; what it printed: {console_log}; L1 kernel log: {kernel_log}")]
    Timeout {
        secs: f64,
        console_log: PathBuf,
        kernel_log: PathBuf,
    },
    #[error(
        "QEMU was stopped (Ctrl-A x) before the command finished; L1 kernel log: {kernel_log}"
    )]
    Stopped { kernel_log: PathBuf },
    #[error("the command never reported an exit status ({reason}; QEMU {qemu_status}): L1 crashed, or could not start the command.\nL1 kernel log: {kernel_log} (QEMU's messages: {qemu_log}); its last lines:\n{tail}")]
    NoExitStatus {
        reason: String,
        qemu_status: String,
        kernel_log: PathBuf,
        qemu_log: PathBuf,
        tail: String,
    },
}

impl RigError {
    /// The exit code the `mayfly-rig` CLI uses for this error: [`EXIT_TIMEOUT`] for a timeout,
    /// [`EXIT_RIG_FAILED`] otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            RigError::Timeout { .. } => EXIT_TIMEOUT,
            RigError::Stopped { .. } => EXIT_STOPPED,
            _ => EXIT_RIG_FAILED,
        }
    }
}

pub(super) fn io_err(context: impl Into<String>) -> impl FnOnce(io::Error) -> RigError {
    let context = context.into();
    move |source| RigError::Io { context, source }
}
