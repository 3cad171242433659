//! What the rig's machine is made of: the mayfly source tree, the L1 kernel and initramfs (built
//! by its scripts when not given, once at a time across processes) and the patched QEMU that
//! runs them.

use std::ffi::OsString;
use std::fs;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::Mutex;

use super::error::{io_err, RigError, FLAVOUR, QEMU_BUILD_SCRIPT};
use super::options::{RigArtifacts, RigOptions};

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

pub(super) fn check_artifacts(artifacts: &RigArtifacts) -> Result<(), RigError> {
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

pub(super) fn describe_status(status: ExitStatus) -> String {
    match status.code() {
        Some(code) => format!("exited with {code}"),
        None => format!("was killed ({status})"),
    }
}

pub(super) fn find_qemu(opts: &RigOptions) -> Result<PathBuf, RigError> {
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
