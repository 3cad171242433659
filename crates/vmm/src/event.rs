//! What the VM's controller hears about (events) and how a VM ends (exits). A leaf module:
//! the vCPU threads, devices and the control socket send events; the controller acts on them.

use mayfly_devices::PowerRequest;

use mayfly_api::ApiCall;

/// Something the VM's controller must act on: the VM ending, or a request.
#[derive(Debug)]
pub enum VmEvent {
    Power(PowerRequest),
    VcpuFailed {
        index: u8,
        reason: String,
        registers: String,
    },
    Signal(i32),
    /// Guest memory cannot be served any more (a lazy restore's memory file failed, or the
    /// memory file of a copy-on-write VM is about to change).
    MemoryFailed(String),
    /// A request from the control socket.
    Api(ApiCall),
    /// A clone's fork has every clone ready: a clone held paused until then goes (see
    /// [`crate::persist::zygote::ForkEnd`]).
    ForkEnded,
}

/// How a VM ended, and the process exit status that says so.
#[derive(Debug, PartialEq, Eq)]
pub enum VmExit {
    /// The guest powered off: status 0.
    PowerOff,
    /// Shut down through the control socket: status 0.
    Shutdown,
    /// The guest rebooted (mayfly does not restart it): status 133, as systemd-nspawn does.
    Reset,
    /// A signal asked the VMM to stop: 128 + the signal.
    Signal(i32),
    /// A vCPU hit something fatal: status 1.
    Crashed {
        index: u8,
        reason: String,
        registers: String,
    },
    /// The VMM could not keep the VM running (e.g. its memory file failed): status 1.
    Failed(String),
}

impl VmExit {
    pub const RESET_STATUS: u8 = 133;

    pub fn status(&self) -> u8 {
        match self {
            VmExit::PowerOff | VmExit::Shutdown => 0,
            VmExit::Reset => Self::RESET_STATUS,
            VmExit::Signal(sig) => 128u8.saturating_add(u8::try_from(*sig).unwrap_or(127)),
            VmExit::Crashed { .. } | VmExit::Failed(_) => 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_statuses() {
        assert_eq!(VmExit::PowerOff.status(), 0);
        assert_eq!(VmExit::Reset.status(), 133);
        assert_eq!(VmExit::Signal(libc::SIGTERM).status(), 143);
        assert_eq!(VmExit::Shutdown.status(), 0);
        assert_eq!(VmExit::Failed("x".into()).status(), 1);
    }
}
