//! How to run a command in the rig ([`RigOptions`]), what a run gives back ([`RigOutput`]), and
//! the L1 kernel and initramfs it boots ([`RigArtifacts`]).

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

/// QEMU's `-cpu` model used unless told otherwise. EPYC gives L1's KVM XSAVE and `KVM_CAP_XCRS`
/// (which `qemu64,+svm,+npt` lacks), so guests and snapshots see what real AMD hardware offers.
pub const DEFAULT_CPU_MODEL: &str = "EPYC";

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
    /// Stop QEMU and fail with [`RigError::Timeout`](super::RigError::Timeout) after this long (boot included).
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
    /// ([`qemu_binary`](super::qemu_binary)).
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
