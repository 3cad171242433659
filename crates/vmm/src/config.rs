//! What `mayfly run` is asked to boot, checked before any VM exists.

pub use crate::arch::cpuid::{CpuTemplate, CpuTemplateError};
use crate::arch::mptable::MAX_VCPUS;
use crate::devices::console::Console;
use crate::kernel::Image;

/// Kernel command line when none is given: serial console, reset through the i8042 (the
/// VMM then exits), reboot one second after a panic, and no boot log (each console byte is a
/// VM exit; `--cmdline` without `quiet` shows it).
pub const DEFAULT_CMDLINE: &str = "console=ttyS0 reboot=k panic=1 quiet";
pub const DEFAULT_MEM_MIB: u64 = 256;
/// Below this mayfly cannot lay out a guest (boot structures, BIOS area, a kernel).
pub const MIN_MEM_MIB: u64 = 16;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("a VM needs at least one vCPU (--vcpus 0)")]
    NoVcpus,
    #[error("--vcpus {0} is more than mayfly supports ({MAX_VCPUS})")]
    TooManyVcpus(u32),
    #[error("--vcpus {asked} is more than KVM on this host allows ({max})")]
    TooManyVcpusForKvm { asked: u8, max: usize },
    #[error("--mem-mib {0} is too small: a guest needs at least {MIN_MEM_MIB} MiB")]
    MemTooSmall(u64),
    #[error("--mem-mib {asked} is more than this host's {host} MiB of RAM")]
    MemBeyondHost { asked: u64, host: u64 },
}

#[derive(Clone, Debug)]
pub struct RunConfig {
    pub kernel: Image,
    pub initrd: Option<Image>,
    pub cmdline: String,
    pub mem_mib: u64,
    pub vcpus: u8,
    pub console: Console,
    pub cpu_template: CpuTemplate,
    /// Print boot phase timestamps on stderr (see `trace`).
    pub boot_trace: bool,
    /// Give the VM the probe device (the probe benchmark's guest).
    pub probe: bool,
    /// Serve the control socket here.
    pub api_sock: Option<std::path::PathBuf>,
    /// The VM's name (its guest reads it from the identity page).
    pub name: String,
    /// The virtio devices it gets.
    pub devices: crate::devices::manager::DevicesConfig,
}

impl RunConfig {
    pub fn mem_bytes(&self) -> u64 {
        self.mem_mib << 20
    }
}

/// The vCPU count, checked against what the layout (MP table, APIC IDs) supports.
pub fn check_vcpus(vcpus: u32) -> Result<u8, ConfigError> {
    match vcpus {
        0 => Err(ConfigError::NoVcpus),
        n => match u8::try_from(n) {
            Ok(count) if count <= MAX_VCPUS => Ok(count),
            _ => Err(ConfigError::TooManyVcpus(n)),
        },
    }
}

/// The memory size, checked against mayfly's floor and the host's RAM (`host_mib`).
pub fn check_mem(mem_mib: u64, host_mib: u64) -> Result<u64, ConfigError> {
    if mem_mib < MIN_MEM_MIB {
        return Err(ConfigError::MemTooSmall(mem_mib));
    }
    if mem_mib > host_mib {
        return Err(ConfigError::MemBeyondHost {
            asked: mem_mib,
            host: host_mib,
        });
    }
    Ok(mem_mib)
}

/// The host's RAM in MiB, from /proc/meminfo (None if it cannot be read).
pub fn host_mem_mib() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vcpu_bounds() {
        assert_eq!(check_vcpus(0), Err(ConfigError::NoVcpus));
        assert_eq!(check_vcpus(1), Ok(1));
        assert_eq!(check_vcpus(254), Ok(254));
        assert_eq!(check_vcpus(255), Err(ConfigError::TooManyVcpus(255)));
    }

    #[test]
    fn memory_bounds() {
        assert_eq!(check_mem(8, 1024), Err(ConfigError::MemTooSmall(8)));
        assert_eq!(check_mem(16, 1024), Ok(16));
        assert_eq!(check_mem(1024, 1024), Ok(1024));
        assert_eq!(
            check_mem(1025, 1024),
            Err(ConfigError::MemBeyondHost {
                asked: 1025,
                host: 1024
            })
        );
    }

    #[test]
    fn host_memory_is_readable_here() {
        assert!(host_mem_mib().unwrap() > 0);
    }
}
