//! The test rig: run a command on a real `/dev/kvm` inside an emulated machine.
//!
//! The host's own `/dev/kvm` (when it comes from `kvm_pvm`) cannot run a Linux guest to user space.
//! The rig boots an "L1" Linux under QEMU's software emulator (TCG) with an AMD SVM CPU; L1's kernel
//! has `kvm_amd` built in and so a real `/dev/kvm`. L1 mounts the host's root read-only over 9p,
//! mounts fresh `/proc`, `/sys`, `/dev`, `/tmp`, `/run` inside it, mounts each writable directory
//! (`RigOptions::rw`) at its own path, `chroot`s there and runs the command in the caller's working
//! directory. The command's output comes back on L1's first serial port, its exit status through a
//! control directory shared read-write.
//!
//! ```no_run
//! use mayfly_tests::rig::{self, KvmLocation, RigOptions};
//!
//! if rig::kvm_location() == KvmLocation::Rig {
//!     let out = rig::run(&RigOptions::default(), &["sh", "-c", "ls -l /dev/kvm"])?;
//!     assert_eq!(out.status, 0, "{}", out.output_lossy());
//! }
//! # Ok::<(), rig::RigError>(())
//! ```
//!
//! Files of a run, in its control directory (kept when the run fails, or with
//! `RigOptions::keep_control_dir`): `rig.conf` and `run.sh` (written by the rig), `console.log`
//! (everything the command printed), `l1-kernel.log` (L1's kernel console and its init's log),
//! `qemu.log` (QEMU's own messages), `exit-status` (written by L1).

use std::ffi::{OsStr, OsString};
use std::fmt;
use std::fs;
use std::io::{self, BufRead, BufReader, IsTerminal, Read, Write};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::str::FromStr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Environment variable that forces [`kvm_location`]: `host` or `rig`.
pub const FORCE_ENV: &str = "MAYFLY_TEST_KVM";
/// Set to `1` inside the rig, for commands that want to know.
pub const IN_RIG_ENV: &str = "MAYFLY_IN_RIG";
/// QEMU's `-cpu` model used unless told otherwise. EPYC gives L1's KVM XSAVE and `KVM_CAP_XCRS`
/// (which `qemu64,+svm,+npt` lacks), so guests and snapshots see what real AMD hardware offers.
pub const DEFAULT_CPU_MODEL: &str = "EPYC";
/// Exit code of the `mayfly-rig` CLI when the command timed out.
pub const EXIT_TIMEOUT: i32 = 124;
/// Exit code of the `mayfly-rig` CLI when the user stopped QEMU (interactive runs).
pub const EXIT_STOPPED: i32 = 130;
/// Exit code of the `mayfly-rig` CLI when the rig itself failed (no exit status from the command).
pub const EXIT_RIG_FAILED: i32 = 125;

const FLAVOUR: &str = "rig-l1";
/// Builds the rig's patched QEMU; with `--check` it only prints the cached build's path.
const QEMU_BUILD_SCRIPT: &str = "tests/rig/qemu/build.sh";

/// Where a real `/dev/kvm` (one that runs a Linux guest to user space) is found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvmLocation {
    /// This machine's own `/dev/kvm` works: run tests directly.
    Host,
    /// Run tests inside the rig ([`run`]).
    Rig,
}

impl KvmLocation {
    /// `"host"` or `"rig"`.
    pub fn as_str(self) -> &'static str {
        match self {
            KvmLocation::Host => "host",
            KvmLocation::Rig => "rig",
        }
    }
}

impl fmt::Display for KvmLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for KvmLocation {
    type Err = RigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "host" => Ok(KvmLocation::Host),
            "rig" => Ok(KvmLocation::Rig),
            other => Err(RigError::BadOption {
                what: FORCE_ENV,
                reason: format!("{other:?} is neither \"host\" nor \"rig\""),
            }),
        }
    }
}

/// Where tests find a real `/dev/kvm`.
///
/// `MAYFLY_TEST_KVM=host|rig` forces the answer (an invalid value is reported on stderr and
/// ignored). Otherwise `Host` when `kvm_intel` or `kvm_amd` is loaded, `kvm_pvm` is not, and
/// `/dev/kvm` opens read-write; `Rig` in every other case.
pub fn kvm_location() -> KvmLocation {
    if let Some(value) = std::env::var_os(FORCE_ENV) {
        match value.to_string_lossy().parse() {
            Ok(location) => return location,
            Err(e) => eprintln!("mayfly-rig: ignoring {e}"),
        }
    }
    detect_kvm_location(Path::new("/sys/module"), Path::new("/dev/kvm"))
}

/// The detection behind [`kvm_location`], without the environment override, on the given sysfs
/// module directory and KVM device.
pub fn detect_kvm_location(sys_module: &Path, dev_kvm: &Path) -> KvmLocation {
    let real_kvm = sys_module.join("kvm_intel").exists() || sys_module.join("kvm_amd").exists();
    let pvm = sys_module.join("kvm_pvm").exists();
    let accessible = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dev_kvm)
        .is_ok();
    if real_kvm && !pvm && accessible {
        KvmLocation::Host
    } else {
        KvmLocation::Rig
    }
}

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

fn io_err(context: impl Into<String>) -> impl FnOnce(io::Error) -> RigError {
    let context = context.into();
    move |source| RigError::Io { context, source }
}

/// How to run a command in the rig. `RigOptions::default()` is 4 GiB, 2 vCPUs, EPYC, no timeout,
/// not interactive, output not streamed.
#[derive(Debug, Clone)]
pub struct RigOptions {
    /// Host directories the command may write; each appears inside L1 at the same path.
    pub rw: Vec<PathBuf>,
    /// L1's memory in MiB.
    pub mem_mib: u32,
    /// L1's vCPUs.
    pub cpus: u32,
    /// Stop QEMU and fail with [`RigError::Timeout`] after this long (boot included).
    pub timeout: Option<Duration>,
    /// QEMU `-cpu` model; it must offer SVM (`EPYC`, `max`, `qemu64,+svm,+npt`).
    pub cpu_model: String,
    /// Extra environment for the command, beside the variables taken from this process (`PATH`,
    /// `HOME`, `TERM`, `RUST_*`, `CARGO_*`, `MAYFLY_*`).
    pub env: Vec<(OsString, OsString)>,
    /// Working directory of the command; default: this process's.
    pub cwd: Option<PathBuf>,
    /// Pass the terminal through: the command gets L1's serial port as its terminal and this
    /// process's stdin/stdout (press Ctrl-A x to stop QEMU). Otherwise QEMU reads no input and the
    /// command's stdout/stderr is a pipe.
    pub interactive: bool,
    /// Copy the command's output to this process's stdout as it comes (always on when interactive).
    pub stream: bool,
    /// Keep the control directory (with the logs) after a successful run too.
    pub keep_control_dir: bool,
    /// L1 kernel (bzImage); default `$MAYFLY_RIG_KERNEL`, else built by `guest-kernel/build.sh rig-l1`.
    pub kernel: Option<PathBuf>,
    /// L1 initramfs; default `$MAYFLY_RIG_INITRD`, else built by `rootfs/build.sh rig-l1`.
    pub initrd: Option<PathBuf>,
    /// QEMU binary; default `$MAYFLY_RIG_QEMU`, else the patched build of `tests/rig/qemu/build.sh`
    /// ([`qemu_binary`]).
    pub qemu: Option<PathBuf>,
    /// L1 kernel `loglevel=` (its log goes to `l1-kernel.log`, never to the output).
    pub kernel_loglevel: u8,
}

impl Default for RigOptions {
    fn default() -> Self {
        RigOptions {
            rw: Vec::new(),
            mem_mib: 4096,
            cpus: 2,
            timeout: None,
            cpu_model: DEFAULT_CPU_MODEL.to_string(),
            env: Vec::new(),
            cwd: None,
            interactive: false,
            stream: false,
            keep_control_dir: false,
            kernel: None,
            initrd: None,
            qemu: None,
            kernel_loglevel: 7,
        }
    }
}

/// The result of a command run in the rig.
#[derive(Debug, Clone)]
pub struct RigOutput {
    /// The command's exit status (128 + N when killed by signal N).
    pub status: i32,
    /// Everything the command printed (stdout and stderr, interleaved as written).
    pub output: Vec<u8>,
    /// Wall time from starting QEMU to QEMU's exit.
    pub elapsed: Duration,
    /// The control directory, when it was kept (`RigOptions::keep_control_dir`).
    pub control_dir: Option<PathBuf>,
}

impl RigOutput {
    /// `status == 0`.
    pub fn success(&self) -> bool {
        self.status == 0
    }

    /// The output as text (invalid UTF-8 replaced).
    pub fn output_lossy(&self) -> String {
        String::from_utf8_lossy(&self.output).into_owned()
    }
}

/// The L1 kernel and initramfs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RigArtifacts {
    pub kernel: PathBuf,
    pub initrd: PathBuf,
}

/// The mayfly source tree: `$MAYFLY_ROOT`, else the one this crate was built from.
pub fn source_root() -> PathBuf {
    match std::env::var_os("MAYFLY_ROOT") {
        Some(root) => PathBuf::from(root),
        None => Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from(".")),
    }
}

fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("MAYFLY_CACHE") {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| OsString::from("/tmp"));
    Path::new(&home).join(".cache/mayfly")
}

static ARTIFACTS: Mutex<Option<RigArtifacts>> = Mutex::new(None);

/// Makes sure the L1 kernel and initramfs exist and returns them: `$MAYFLY_RIG_KERNEL` /
/// `$MAYFLY_RIG_INITRD` when set, else the outputs of `guest-kernel/build.sh rig-l1` and
/// `rootfs/build.sh rig-l1` (instant when cached; a cold kernel build takes minutes). Builds are
/// serialised across threads and processes; the result is remembered for this process.
pub fn ensure_artifacts() -> Result<RigArtifacts, RigError> {
    let mut cached = ARTIFACTS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(artifacts) = cached.as_ref() {
        return Ok(artifacts.clone());
    }
    let kernel_env = std::env::var_os("MAYFLY_RIG_KERNEL").map(PathBuf::from);
    let initrd_env = std::env::var_os("MAYFLY_RIG_INITRD").map(PathBuf::from);

    let lock = if kernel_env.is_none() || initrd_env.is_none() {
        Some(build_lock()?)
    } else {
        None
    };
    let root = source_root();
    let kernel = match kernel_env {
        Some(path) => path,
        None => build("L1 kernel", &root.join("guest-kernel/build.sh"))?.join("bzImage"),
    };
    let initrd = match initrd_env {
        Some(path) => path,
        None => build("L1 initramfs", &root.join("rootfs/build.sh"))?.join("initramfs.cpio"),
    };
    drop(lock);

    let artifacts = RigArtifacts { kernel, initrd };
    check_artifacts(&artifacts)?;
    *cached = Some(artifacts.clone());
    Ok(artifacts)
}

fn check_artifacts(artifacts: &RigArtifacts) -> Result<(), RigError> {
    if !artifacts.kernel.is_file() {
        return Err(RigError::ArtifactMissing {
            what: "L1 kernel",
            path: artifacts.kernel.clone(),
            script: "guest-kernel/build.sh",
        });
    }
    if !artifacts.initrd.is_file() {
        return Err(RigError::ArtifactMissing {
            what: "L1 initramfs",
            path: artifacts.initrd.clone(),
            script: "rootfs/build.sh",
        });
    }
    Ok(())
}

/// An exclusive lock on `<cache>/rig-build.lock`, so that parallel test processes do not run the
/// build scripts at the same time. Released when dropped.
fn build_lock() -> Result<fs::File, RigError> {
    let dir = cache_dir();
    fs::create_dir_all(&dir).map_err(io_err(format!("cannot create {}", dir.display())))?;
    let path = dir.join("rig-build.lock");
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io_err(format!("cannot open {}", path.display())))?;
    file.lock()
        .map_err(io_err(format!("cannot lock {}", path.display())))?;
    Ok(file)
}

/// Runs `bash <script> rig-l1`; returns the directory it prints last. Its progress lines go to
/// stderr (except the "is cached" ones).
fn build(what: &'static str, script: &Path) -> Result<PathBuf, RigError> {
    if !script.is_file() {
        return Err(RigError::SourceTreeNotFound {
            path: script.to_path_buf(),
        });
    }
    let mut child = Command::new("bash")
        .arg(script)
        .arg(FLAVOUR)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(io_err(format!("cannot run bash {}", script.display())))?;
    let stderr = child.stderr.take();
    let forwarder = std::thread::spawn(move || {
        let mut tail: Vec<String> = Vec::new();
        if let Some(stderr) = stderr {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if !line.ends_with("is cached") {
                    eprintln!("{line}");
                }
                tail.push(line);
                if tail.len() > 40 {
                    tail.remove(0);
                }
            }
        }
        tail
    });
    let mut stdout = Vec::new();
    if let Some(mut out) = child.stdout.take() {
        out.read_to_end(&mut stdout).map_err(io_err(format!(
            "cannot read the output of {}",
            script.display()
        )))?;
    }
    let status = child
        .wait()
        .map_err(io_err(format!("cannot wait for {}", script.display())))?;
    let tail = forwarder.join().unwrap_or_default();
    let stdout = String::from_utf8_lossy(&stdout);
    if !status.success() {
        let mut output = tail.join("\n");
        if !stdout.trim().is_empty() {
            output.push('\n');
            output.push_str(stdout.trim_end());
        }
        return Err(RigError::BuildFailed {
            what,
            script: script.to_path_buf(),
            status: describe_status(status),
            output,
        });
    }
    match stdout.lines().rev().find(|l| !l.trim().is_empty()) {
        Some(dir) => Ok(PathBuf::from(dir.trim())),
        None => Err(RigError::BuildNoOutput {
            what,
            script: script.to_path_buf(),
        }),
    }
}

fn describe_status(status: ExitStatus) -> String {
    match status.code() {
        Some(code) => format!("exited with {code}"),
        None => format!("was killed ({status})"),
    }
}

fn find_qemu(opts: &RigOptions) -> Result<PathBuf, RigError> {
    match &opts.qemu {
        Some(path) => Ok(path.clone()),
        None => qemu_binary(),
    }
}

static PATCHED_QEMU: Mutex<Option<PathBuf>> = Mutex::new(None);

/// The QEMU the rig runs unless [`RigOptions::qemu`] says otherwise: `$MAYFLY_RIG_QEMU` when set,
/// else the patched build of `tests/rig/qemu/build.sh` (Debian's QEMU with a fix for its SVM
/// emulation), found by `build.sh --check`: it hashes the same inputs as the build, so an out of
/// date build counts as missing. Never the system's QEMU: fails with [`RigError::QemuNotBuilt`]
/// when the build is missing. The result is remembered for this process.
pub fn qemu_binary() -> Result<PathBuf, RigError> {
    if let Some(path) = std::env::var_os("MAYFLY_RIG_QEMU") {
        return Ok(PathBuf::from(path));
    }
    let mut cached = PATCHED_QEMU.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(path) = cached.as_ref() {
        return Ok(path.clone());
    }
    let script = source_root().join(QEMU_BUILD_SCRIPT);
    if !script.is_file() {
        return Err(RigError::SourceTreeNotFound { path: script });
    }
    let out = Command::new("bash")
        .arg(&script)
        .arg("--check")
        .stdin(Stdio::null())
        .output()
        .map_err(io_err(format!("cannot run bash {}", script.display())))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let path = stdout
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .map(|l| PathBuf::from(l.trim()));
    match path {
        Some(path) if out.status.success() && path.is_file() => {
            *cached = Some(path.clone());
            Ok(path)
        }
        _ => {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let reason = match stderr.trim() {
                "" => format!("`build.sh --check` {}", describe_status(out.status)),
                said => said.to_string(),
            };
            Err(RigError::QemuNotBuilt { script, reason })
        }
    }
}

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

fn count_bad_vmexits(qemu_log: &str) -> usize {
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

fn valid_env_name(name: &[u8]) -> bool {
    !name.is_empty()
        && !name[0].is_ascii_digit()
        && name.iter().all(|&b| b.is_ascii_alphanumeric() || b == b'_')
}

/// Parses `NAME=VALUE` (for `--env`).
pub fn parse_env_setting(setting: &OsStr) -> Result<(OsString, OsString), RigError> {
    let bytes = setting.as_bytes();
    let bad = || RigError::BadEnv {
        setting: setting.to_string_lossy().into_owned(),
    };
    let eq = bytes.iter().position(|&b| b == b'=').ok_or_else(bad)?;
    let (name, value) = (&bytes[..eq], &bytes[eq + 1..]);
    if !valid_env_name(name) {
        return Err(bad());
    }
    Ok((
        OsString::from_vec(name.to_vec()),
        OsString::from_vec(value.to_vec()),
    ))
}

fn passed_through(name: &str) -> bool {
    matches!(name, "PATH" | "HOME" | "TERM" | "USER" | "LANG")
        || ["RUST_", "CARGO_", "MAYFLY_"]
            .iter()
            .any(|prefix| name.starts_with(prefix))
}

/// The environment of the command: selected variables of this process, then `opts.env`, then the
/// rig's own markers (`MAYFLY_TEST_KVM=host`, so that tests inside do not start another rig).
fn command_env(opts: &RigOptions) -> Result<Vec<(OsString, OsString)>, RigError> {
    let mut env: Vec<(OsString, OsString)> = std::env::vars_os()
        .filter(|(name, _)| {
            name.to_str()
                .is_some_and(|n| passed_through(n) && valid_env_name(n.as_bytes()))
        })
        .collect();
    for (name, value) in &opts.env {
        if !valid_env_name(name.as_bytes()) {
            let mut setting = name.clone();
            setting.push("=");
            setting.push(value);
            return Err(RigError::BadEnv {
                setting: setting.to_string_lossy().into_owned(),
            });
        }
        env.push((name.clone(), value.clone()));
    }
    env.push((FORCE_ENV.into(), "host".into()));
    env.push((IN_RIG_ENV.into(), "1".into()));
    Ok(env)
}

/// Canonical, distinct writable directories, parents before the directories inside them.
fn rw_dirs(dirs: &[PathBuf]) -> Result<Vec<PathBuf>, RigError> {
    let mut out: Vec<PathBuf> = Vec::new();
    for dir in dirs {
        let bad = |reason: &str| RigError::BadRwDir {
            path: dir.clone(),
            reason: reason.to_string(),
        };
        let real = fs::canonicalize(dir).map_err(|e| RigError::BadRwDir {
            path: dir.clone(),
            reason: format!("{e} (it must be an existing directory)"),
        })?;
        if !real.is_dir() {
            return Err(bad("not a directory"));
        }
        if real == Path::new("/") {
            return Err(bad("the root cannot be shared writable"));
        }
        for special in ["/proc", "/sys", "/dev"] {
            if real.starts_with(special) {
                return Err(bad("L1 mounts its own /proc, /sys and /dev"));
            }
        }
        if real.as_os_str().as_bytes().contains(&b'\n') {
            return Err(bad("the path contains a newline"));
        }
        if !out.contains(&real) {
            out.push(real);
        }
    }
    out.sort_by_key(|p| p.components().count());
    Ok(out)
}

/// `'...'` quoting for sh, byte-exact.
fn sh_quote(s: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(s.len() + 2);
    out.push(b'\'');
    for &b in s {
        if b == b'\'' {
            out.extend_from_slice(b"'\\''");
        } else {
            out.push(b);
        }
    }
    out.push(b'\'');
    out
}

/// L1 mounts fresh tmpfs on /tmp and /run. Host directories under them that the command needs
/// (its working directory, the source tree: a CI clone often lives in /tmp) are carried over,
/// read-only like the rest of the host's root. /tmp or /run themselves are not: the command
/// needs them writable.
fn kept_dirs(dirs: &[PathBuf]) -> Vec<PathBuf> {
    let fresh = [Path::new("/tmp"), Path::new("/run")];
    let mut kept: Vec<PathBuf> = dirs
        .iter()
        .filter_map(|d| d.canonicalize().ok())
        .filter(|d| fresh.iter().any(|f| d.starts_with(f) && d.as_path() != *f))
        .filter(|d| !d.as_os_str().as_bytes().contains(&b'\n'))
        .collect();
    kept.sort();
    kept.dedup();
    // A directory inside another kept one comes along with it.
    let outer: Vec<PathBuf> = kept
        .iter()
        .filter(|d| !kept.iter().any(|o| o != *d && d.starts_with(o)))
        .cloned()
        .collect();
    outer
}

fn rig_conf(
    ctl: &Path,
    rw: &[PathBuf],
    keep: &[PathBuf],
    interactive: bool,
    terminal_size: Option<(u16, u16)>,
) -> Vec<u8> {
    let mut conf = b"# written by mayfly-rig, read by L1's /init\n".to_vec();
    let mut line = |name: &str, value: &[u8]| {
        conf.extend_from_slice(name.as_bytes());
        conf.push(b'=');
        conf.extend_from_slice(&sh_quote(value));
        conf.push(b'\n');
    };
    line("RIG_CTL", ctl.as_os_str().as_bytes());
    line("RIG_NSHARES", (rw.len() + 1).to_string().as_bytes());
    for (i, dir) in rw.iter().enumerate() {
        line(&format!("RIG_SHARE_{}", i + 1), dir.as_os_str().as_bytes());
    }
    line("RIG_NKEEP", keep.len().to_string().as_bytes());
    for (i, dir) in keep.iter().enumerate() {
        line(&format!("RIG_KEEP_{}", i + 1), dir.as_os_str().as_bytes());
    }
    line("RIG_INTERACTIVE", if interactive { b"1" } else { b"0" });
    let (rows, cols) = terminal_size
        .map(|(r, c)| (r.to_string(), c.to_string()))
        .unwrap_or_default();
    line("RIG_ROWS", rows.as_bytes());
    line("RIG_COLS", cols.as_bytes());
    conf
}

fn run_script(cwd: &Path, env: &[(OsString, OsString)], command: &[&OsStr]) -> Vec<u8> {
    let mut script =
        b"# written by mayfly-rig: the command, run by L1's /init in the host's root\n".to_vec();
    for (name, value) in env {
        script.extend_from_slice(b"export ");
        script.extend_from_slice(name.as_bytes());
        script.push(b'=');
        script.extend_from_slice(&sh_quote(value.as_bytes()));
        script.push(b'\n');
    }
    let cwd_q = sh_quote(cwd.as_os_str().as_bytes());
    script.extend_from_slice(b"cd ");
    script.extend_from_slice(&cwd_q);
    script.extend_from_slice(b" || { echo \"mayfly-rig: cannot enter the working directory \"");
    script.extend_from_slice(&cwd_q);
    script.extend_from_slice(
        b"\" inside L1 (/tmp and /run are fresh there: share it with --rw)\" >&2; exit 125; }\n",
    );
    script.extend_from_slice(b"exec");
    for arg in command {
        script.push(b' ');
        script.extend_from_slice(&sh_quote(arg.as_bytes()));
    }
    script.push(b'\n');
    script
}

/// A QEMU option value: commas are doubled.
fn qemu_escape(path: &Path) -> OsString {
    let mut out = Vec::new();
    for &b in path.as_os_str().as_bytes() {
        out.push(b);
        if b == b',' {
            out.push(b',');
        }
    }
    OsString::from_vec(out)
}

fn opt(prefix: &str, path: &Path, suffix: &str) -> OsString {
    let mut s = OsString::from(prefix);
    s.push(qemu_escape(path));
    s.push(suffix);
    s
}

fn qemu_args(
    opts: &RigOptions,
    artifacts: &RigArtifacts,
    ctl: &Path,
    rw: &[PathBuf],
) -> Vec<OsString> {
    let mut args: Vec<OsString> = Vec::new();
    let mut push = |items: &[&str]| args.extend(items.iter().map(OsString::from));
    // One host thread runs every emulated CPU. Multi-threaded TCG (thread=multi) breaks L2
    // guests: now and then a #VMEXIT comes while the CPU is in host mode with nested paging
    // on, and the guest's VMCB gets the L1 host's registers (the guest then runs at L1's RIP
    // with L1's CR3 and stalls or triple-faults). tests/tests/guest_stress.rs showed it in 3
    // runs of 3 with thread=multi and in none of 3 with thread=single; patches/0003 reports
    // each occurrence. MAYFLY_RIG_TCG_THREAD=multi brings it back, to study it.
    let thread = match std::env::var("MAYFLY_RIG_TCG_THREAD").as_deref() {
        Ok("multi") => "tcg,thread=multi",
        _ => "tcg,thread=single",
    };
    push(&["-accel", thread, "-M", "pc"]);
    push(&["-cpu", &opts.cpu_model]);
    push(&[
        "-smp",
        &opts.cpus.to_string(),
        "-m",
        &opts.mem_mib.to_string(),
    ]);
    push(&[
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-no-reboot",
    ]);
    // The state of every CPU at every reset, the one that ends L1 (a triple fault) included:
    // the evidence when L1 dies without a word on its console. A few KiB per reset.
    args.push("-d".into());
    args.push("cpu_reset".into());
    args.push("-D".into());
    args.push(ctl.join("qemu-cpu-reset.log").into());
    // kvm.tdp_mmu=0: L1's KVM with the TDP MMU, whose vCPUs update page tables concurrently
    // with atomic operations, corrupts its SPTEs under QEMU's software emulation when several
    // guests run at once ("Invalid SPTE change", then a BUG); the older MMU serialises updates.
    let append = format!(
        "console=ttyS1 loglevel={} panic=-1 mitigations=off random.trust_cpu=on kvm.tdp_mmu=0",
        opts.kernel_loglevel.min(8)
    );
    args.push("-kernel".into());
    args.push(artifacts.kernel.clone().into());
    args.push("-initrd".into());
    args.push(artifacts.initrd.clone().into());
    args.push("-append".into());
    args.push(append.into());
    // ttyS0: the command's console; QEMU also logs it to console.log.
    let mux = if opts.interactive { ",mux=on" } else { "" };
    args.push("-chardev".into());
    args.push(opt(
        &format!("stdio,id=con0,signal=off{mux},logfile="),
        &ctl.join("console.log"),
        "",
    ));
    args.push("-serial".into());
    args.push("chardev:con0".into());
    if opts.interactive {
        // Ctrl-A c switches to QEMU's monitor, Ctrl-A x quits.
        args.push("-mon".into());
        args.push("chardev=con0,mode=readline".into());
    }
    // ttyS1: L1's kernel console.
    args.push("-chardev".into());
    args.push(opt("file,id=klog,path=", &ctl.join("l1-kernel.log"), ""));
    args.push("-serial".into());
    args.push("chardev:klog".into());
    args.push("-virtfs".into());
    args.push(
        "local,path=/,mount_tag=hostroot,security_model=passthrough,readonly=on,multidevs=remap"
            .into(),
    );
    for (i, dir) in std::iter::once(ctl)
        .chain(rw.iter().map(PathBuf::as_path))
        .enumerate()
    {
        args.push("-virtfs".into());
        args.push(opt(
            "local,path=",
            dir,
            &format!(",mount_tag=rw{i},security_model=passthrough,multidevs=remap"),
        ));
    }
    args
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

/// The per-run control directory (shared read-write with L1 as `rw0`); removed when dropped
/// unless kept.
struct ControlDir {
    path: PathBuf,
    keep: std::cell::Cell<bool>,
}

impl ControlDir {
    fn create() -> Result<ControlDir, RigError> {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let base = std::env::temp_dir();
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or_default();
        for _ in 0..100 {
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let path = base.join(format!("mayfly-rig-{}-{n}-{nanos:08x}", std::process::id()));
            match fs::DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => {
                    let path = fs::canonicalize(&path).unwrap_or(path);
                    if path.as_os_str().as_bytes().contains(&b'\n') {
                        let _ = fs::remove_dir(&path);
                        break;
                    }
                    return Ok(ControlDir {
                        path,
                        keep: std::cell::Cell::new(false),
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => {
                    return Err(RigError::Io {
                        context: format!("cannot create a control directory in {}", base.display()),
                        source: e,
                    })
                }
            }
        }
        Err(RigError::BadOption {
            what: "temporary directory",
            reason: format!(
                "cannot create a control directory in {} (set TMPDIR to a plain directory)",
                base.display()
            ),
        })
    }

    fn write(&self, name: &str, contents: &[u8]) -> Result<(), RigError> {
        let path = self.path.join(name);
        let mut file =
            fs::File::create(&path).map_err(io_err(format!("cannot create {}", path.display())))?;
        file.write_all(contents)
            .map_err(io_err(format!("cannot write {}", path.display())))
    }

    fn keep(&self) {
        self.keep.set(true);
    }
}

impl Drop for ControlDir {
    fn drop(&mut self) {
        if !self.keep.get() {
            let _ = fs::remove_dir_all(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct TempDir(PathBuf);

    impl TempDir {
        fn new(tag: &str) -> TempDir {
            let path = std::env::temp_dir().join(format!(
                "mayfly-rig-test-{tag}-{}-{:?}",
                std::process::id(),
                std::thread::current().id()
            ));
            let _ = fs::remove_dir_all(&path);
            fs::create_dir_all(&path).expect("create temp dir");
            TempDir(path)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn detection_needs_real_kvm_without_pvm_and_a_device() {
        let t = TempDir::new("detect");
        let module = t.0.join("module");
        let dev = t.0.join("kvm");
        fs::create_dir_all(&module).unwrap();
        assert_eq!(detect_kvm_location(&module, &dev), KvmLocation::Rig);
        fs::write(&dev, b"").unwrap();
        assert_eq!(detect_kvm_location(&module, &dev), KvmLocation::Rig);
        fs::create_dir_all(module.join("kvm_amd")).unwrap();
        assert_eq!(detect_kvm_location(&module, &dev), KvmLocation::Host);
        fs::create_dir_all(module.join("kvm_pvm")).unwrap();
        assert_eq!(detect_kvm_location(&module, &dev), KvmLocation::Rig);
        fs::remove_dir(module.join("kvm_pvm")).unwrap();
        fs::remove_file(&dev).unwrap();
        assert_eq!(detect_kvm_location(&module, &dev), KvmLocation::Rig);
    }

    #[test]
    fn location_parses() {
        assert_eq!("host".parse::<KvmLocation>().unwrap(), KvmLocation::Host);
        assert_eq!(" rig\n".parse::<KvmLocation>().unwrap(), KvmLocation::Rig);
        assert!("kvm".parse::<KvmLocation>().is_err());
        assert_eq!(KvmLocation::Rig.to_string(), "rig");
    }

    #[test]
    fn quoting_round_trips_through_sh() {
        let nasty = [
            "plain",
            "with space",
            "it's",
            "'",
            "",
            "$HOME `x` \"q\" \\ *",
            "a\nb",
        ];
        let mut script = b"for a in".to_vec();
        for s in nasty {
            script.push(b' ');
            script.extend_from_slice(&sh_quote(s.as_bytes()));
        }
        script.extend_from_slice(b"; do printf '%s\\0' \"$a\"; done");
        let out = Command::new("sh")
            .arg("-c")
            .arg(OsStr::from_bytes(&script))
            .output()
            .unwrap();
        let got: Vec<&[u8]> = out.stdout.split(|&b| b == 0).collect();
        let want: Vec<&[u8]> = nasty
            .iter()
            .map(|s| s.as_bytes())
            .chain([&b""[..]])
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn env_settings() {
        let (k, v) = parse_env_setting(OsStr::new("A_1=x=y")).unwrap();
        assert_eq!(
            (k.as_os_str(), v.as_os_str()),
            (OsStr::new("A_1"), OsStr::new("x=y"))
        );
        assert!(parse_env_setting(OsStr::new("novalue")).is_err());
        assert!(parse_env_setting(OsStr::new("1A=x")).is_err());
        assert!(parse_env_setting(OsStr::new("A-B=x")).is_err());
        assert!(parse_env_setting(OsStr::new("=x")).is_err());
    }

    #[test]
    fn run_script_forces_host_inside_and_quotes() {
        let opts = RigOptions {
            env: vec![("MAYFLY_TEST_KVM".into(), "rig".into())],
            ..RigOptions::default()
        };
        let env = command_env(&opts).unwrap();
        let script = run_script(
            Path::new("/work/it's"),
            &env,
            &[OsStr::new("echo"), OsStr::new("a b")],
        );
        let text = String::from_utf8(script).unwrap();
        let last_force = text
            .lines()
            .rfind(|l| l.starts_with("export MAYFLY_TEST_KVM="))
            .unwrap();
        assert_eq!(last_force, "export MAYFLY_TEST_KVM='host'");
        assert!(text.contains("cd '/work/it'\\''s' ||"));
        assert!(text.ends_with("exec 'echo' 'a b'\n"));
    }

    #[test]
    fn rw_dirs_are_checked_and_ordered() {
        let t = TempDir::new("rw");
        let inner = t.0.join("a/b");
        fs::create_dir_all(&inner).unwrap();
        let dirs = rw_dirs(&[inner.clone(), t.0.clone(), t.0.join("a/../a/b")]).unwrap();
        let real = fs::canonicalize(&t.0).unwrap();
        assert_eq!(dirs, vec![real.clone(), real.join("a/b")]);
        assert!(rw_dirs(&[t.0.join("missing")]).is_err());
        assert!(rw_dirs(&[PathBuf::from("/")]).is_err());
        assert!(rw_dirs(&[PathBuf::from("/proc")]).is_err());
        fs::write(t.0.join("file"), b"").unwrap();
        assert!(rw_dirs(&[t.0.join("file")]).is_err());
    }

    #[test]
    fn bad_options_are_errors() {
        let base = RigOptions {
            kernel: Some("/nonexistent".into()),
            initrd: Some("/nonexistent".into()),
            ..RigOptions::default()
        };
        let empty: [&str; 0] = [];
        assert!(matches!(run(&base, &empty), Err(RigError::EmptyCommand)));
        let cases = [
            RigOptions {
                cpus: 0,
                ..base.clone()
            },
            RigOptions {
                mem_mib: 1,
                ..base.clone()
            },
            RigOptions {
                cpu_model: "EPYC -monitor stdio".into(),
                ..base.clone()
            },
            RigOptions {
                timeout: Some(Duration::ZERO),
                ..base.clone()
            },
        ];
        for opts in cases {
            assert!(matches!(
                run(&opts, &["true"]),
                Err(RigError::BadOption { .. })
            ));
        }
        let missing = run(
            &RigOptions {
                qemu: Some("/bin/true".into()),
                ..base
            },
            &["true"],
        );
        assert!(matches!(missing, Err(RigError::ArtifactMissing { .. })));
    }

    #[test]
    fn qemu_option_commas_are_doubled() {
        assert_eq!(qemu_escape(Path::new("/a,b")), OsString::from("/a,,b"));
    }

    #[test]
    fn bad_vmexits_are_counted_from_the_qemu_log() {
        let log = "qemu-system-x86_64: warning: something else\n\
            rig-qemu: cpu 1: a #VMEXIT (exit code 0x400) outside guest mode (rip ffffffff8155f70c, vmcb 0x101b04000, npt 1): the guest's VMCB gets the host's registers\n\
            rig-qemu: cpu 0: a #VMEXIT (exit code 0x7b) outside guest mode (rip 1, vmcb 0x2000, npt 0): the guest's VMCB gets the host's registers\n";
        assert_eq!(count_bad_vmexits(log), 2);
        assert_eq!(count_bad_vmexits(""), 0);
    }

    #[test]
    fn keeps_only_dirs_under_tmp_and_run_that_l1_would_hide() {
        let t = TempDir::new("keep");
        let inner = t.0.join("inner");
        fs::create_dir_all(&inner).unwrap();
        let kept = kept_dirs(&[inner.clone(), t.0.clone(), PathBuf::from("/usr")]);
        // The temp dir is under /tmp (unless TMPDIR says otherwise); its inner dir comes along.
        if t.0.canonicalize().unwrap().starts_with("/tmp") {
            assert_eq!(kept, vec![t.0.canonicalize().unwrap()]);
        }
        assert!(kept_dirs(&[PathBuf::from("/tmp"), PathBuf::from("/usr")]).is_empty());
    }

    /// Boots L1 for real (about 2 s): `cargo test -p mayfly-tests -- --ignored`.
    #[test]
    #[ignore = "boots the rig's L1 under QEMU (needs qemu-system-x86 and the L1 kernel)"]
    fn rig_end_to_end() {
        let t = TempDir::new("e2e");
        let opts = RigOptions {
            rw: vec![t.0.clone()],
            env: vec![("MAYFLY_E2E".into(), "it's here".into())],
            timeout: Some(Duration::from_secs(120)),
            ..RigOptions::default()
        };
        let out_file = t.0.join("out");
        let script = format!(
            "cat /sys/module/kvm_amd/parameters/nested; echo \"$MAYFLY_E2E\"; \
             echo done > {}; exit 3",
            String::from_utf8_lossy(&sh_quote(out_file.as_os_str().as_bytes()))
        );
        let out = run(&opts, &["sh", "-c", &script]).expect("the rig runs");
        assert_eq!(out.status, 3, "{}", out.output_lossy());
        assert_eq!(out.output_lossy(), "1\nit's here\n");
        assert_eq!(fs::read_to_string(&out_file).unwrap(), "done\n");

        let short = RigOptions {
            timeout: Some(Duration::from_secs(3)),
            ..RigOptions::default()
        };
        match run(&short, &["sleep", "60"]) {
            Err(RigError::Timeout { console_log, .. }) => {
                // The control directory is kept for debugging; this one is not needed.
                if let Some(dir) = console_log.parent() {
                    let _ = fs::remove_dir_all(dir);
                }
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
    }
}
