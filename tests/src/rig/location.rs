//! Where tests find a real `/dev/kvm`: this machine's own, or the rig's; and the environment
//! variables that force the answer and mark a command run inside the rig.

use std::fmt;
use std::fs;
use std::path::Path;
use std::str::FromStr;

use super::error::RigError;

/// Environment variable that forces [`kvm_location`]: `host` or `rig`.
pub const FORCE_ENV: &str = "MAYFLY_TEST_KVM";
/// Set to `1` inside the rig, for commands that want to know.
pub const IN_RIG_ENV: &str = "MAYFLY_IN_RIG";

/// Where a real `/dev/kvm` (one that runs a Linux guest to user space) is found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvmLocation {
    /// This machine's own `/dev/kvm` works: run tests directly.
    Host,
    /// Run tests inside the rig ([`run`](fn@super::run)).
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
