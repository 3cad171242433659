//! What a VMM process is told once, at its start, rather than per VM: which KVM device to open,
//! where the build scripts cache images, how much console output a file takes, and two knobs
//! kept to measure the fork. The `mayfly` command reads them from its environment
//! (`MAYFLY_KVM_DEVICE`, `MAYFLY_CACHE`, `MAYFLY_CONSOLE_LIMIT`, `MAYFLY_FORK_COPY`,
//! `MAYFLY_FORK_IN_FLIGHT`) in `main` and hands them over with [`set`]; a fork's zygote
//! inherits the environment, so its clones have their parent's settings;
//! nothing below reads the environment. An embedder sets them the same way, or keeps the
//! defaults.

use std::path::PathBuf;
use std::sync::OnceLock;

/// The process's settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// The KVM device node (default `/dev/kvm`).
    pub kvm_device: PathBuf,
    /// Where the build scripts keep images (`rootfs/debian.current/...`) and where the
    /// identities of disk bases are cached (`base-ids/`); none: nothing is cached.
    pub cache_dir: Option<PathBuf>,
    /// A fork copies the parent's memory into a new base instead of handing its memfd over
    /// (kept to measure the alternative; see `persist::fork`).
    pub fork_copy: bool,
    /// How many clones a fork has starting at once (default: four per host CPU).
    pub fork_in_flight: Option<usize>,
    /// The most bytes of guest console output a console file (`--console PATH`, a clone's
    /// console log) takes; what the guest writes past it is dropped, after one line saying
    /// so. None: no limit. The console on stdout is never cut.
    pub console_limit: Option<u64>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            kvm_device: PathBuf::from("/dev/kvm"),
            cache_dir: None,
            fork_copy: false,
            fork_in_flight: None,
            console_limit: None,
        }
    }
}

static SETTINGS: OnceLock<Settings> = OnceLock::new();

/// Give this process its settings, once, before any VM is made. Returns them back if the
/// process already has settings (from an earlier call, or because a VM already read the
/// defaults).
pub fn set(settings: Settings) -> Result<(), Settings> {
    SETTINGS.set(settings)
}

/// This process's settings: as [`set`], or the defaults.
pub fn get() -> &'static Settings {
    SETTINGS.get_or_init(Settings::default)
}
