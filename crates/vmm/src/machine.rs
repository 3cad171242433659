//! The machine: a KVM VM with its memory and devices, and who it is. Pause and resume cover
//! all of it (vCPUs first, then the devices' threads), so that a snapshot or fork reads a
//! machine that nothing changes. The controller drives a machine; the snapshot, fork and
//! restore paths work on one.

use crate::devices::manager::{DeviceError, DeviceManager};
use crate::identity::Identity;
use crate::memory::lazy::LazyMemory;
use crate::memory::ram::{BackingProtection, GuestRam};
use crate::vm::{Vm, VmError};

/// How long a vCPU may sit in one `KVM_RUN` with the console's interrupt pending before it is
/// kicked (see [`Machine::nudge_stalled_console`]): far longer than any console write takes
/// (microseconds), far shorter than the 60 s the stall lasted.
pub const CONSOLE_STALL: std::time::Duration = std::time::Duration::from_secs(2);

/// Facts about the VM for `GET /vm`, snapshots and forks.
#[derive(Clone, Debug)]
pub struct VmInfo {
    pub identity: Identity,
    /// The index the next clone forked from this VM gets.
    pub next_clone: u32,
    pub vcpu_count: u8,
    pub cmdline: String,
    /// "boot", or the snapshot it was restored from.
    pub origin: String,
    pub started: std::time::Instant,
    /// Whether the VM has the probe device.
    pub probe: bool,
    /// How the file behind guest RAM is kept from changing under the VM.
    pub memory_protection: BackingProtection,
}

#[derive(Debug, thiserror::Error)]
pub enum PauseError {
    #[error(transparent)]
    Vm(#[from] VmError),
    #[error(transparent)]
    Devices(#[from] DeviceError),
}

/// A VM and everything it runs on. Fields drop in order: the vCPU threads stop first, then the
/// lazy memory handler and the device threads; guest memory is unmapped only after everything
/// that uses it is gone.
pub struct Machine {
    pub vm: Vm,
    /// The userfaultfd handler of a lazily restored VM.
    pub lazy: Option<LazyMemory>,
    pub devices: DeviceManager,
    pub ram: GuestRam,
    pub info: VmInfo,
}

/// A machine dropped without [`Machine::stop`] (an error after its vCPUs started) still ends
/// the probe's waits first: its vCPU threads are joined as its fields drop, and a vCPU parked
/// in a probe wait would hold that up for the wait's whole limit.
impl Drop for Machine {
    fn drop(&mut self) {
        self.devices.probe_waker.hold();
    }
}

impl Machine {
    pub fn paused(&self) -> bool {
        self.vm.paused
    }

    /// Stop the vCPUs, then the device threads.
    pub fn pause(&mut self) -> Result<(), PauseError> {
        // The probe guest may be parked in a wait the vCPU must come out of first, and must
        // not go into the next one before its pause request arrives.
        self.devices.probe_waker.hold();
        let paused = self.vm.pause();
        self.devices.probe_waker.release();
        paused?;
        if let Err(err) = self.devices.pause() {
            self.devices.resume();
            self.vm.resume();
            return Err(err.into());
        }
        Ok(())
    }

    /// Start the device threads, then the vCPUs.
    pub fn resume(&mut self) {
        self.devices.resume();
        self.vm.resume();
    }

    /// The lost console wake-up, bounded. Now and then, in the test rig, a vCPU stays inside
    /// one `KVM_RUN` for about 60 s at the 8250 driver's `in` or `out`, interrupts off and the
    /// UART's interrupt pending, and goes on as soon as anything kicks it out (docs/rig.md,
    /// known problems; where the wake-up is lost is not known). Kicking every vCPU out of
    /// every long `KVM_RUN` made things worse, so only that case is kicked: a vCPU inside one
    /// `KVM_RUN` for longer than [`CONSOLE_STALL`] while the UART has an interrupt pending.
    /// The kick costs the vCPU one exit and nothing else (it enters again at once), so a
    /// false match (a guest that ignores its UART) is harmless. Returns the vCPUs kicked.
    pub fn nudge_stalled_console(&self) -> Vec<u8> {
        if self.vm.paused || !mayfly_devices::bus::lock(&self.devices.serial).interrupt_pending() {
            return Vec::new();
        }
        let stall = u64::try_from(CONSOLE_STALL.as_nanos()).unwrap_or(u64::MAX);
        let mut nudged = Vec::new();
        for vcpu in &self.vm.vcpus {
            if vcpu
                .activity()
                .in_kvm_run_for_ns()
                .is_some_and(|ns| ns > stall)
            {
                vcpu.nudge();
                nudged.push(vcpu.index);
            }
        }
        nudged
    }

    /// Stop everything for good (the VM is ending).
    pub fn stop(&mut self) {
        self.devices.probe_waker.hold();
        self.vm.stop_vcpus();
    }
}
