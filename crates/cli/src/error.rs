//! Every error the `mayfly` command reports to its user, one line that says what to do.

/// Any error `mayfly` reports to its user.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Boot(#[from] mayfly_vmm::boot::BootError),
    #[error(transparent)]
    Restore(mayfly_vmm::persist::restore::RestoreError),
    #[error(transparent)]
    Config(#[from] mayfly_vmm::config::ConfigError),
    #[error(transparent)]
    Kernel(#[from] mayfly_vmm::kernel::KernelError),
    #[error(transparent)]
    CpuTemplate(#[from] mayfly_vmm::config::CpuTemplateError),
    #[error("this mayfly has no built-in guest {0}: build it with guest-kernel/build.sh and rootfs/build.sh and rebuild mayfly (cargo build --release), or pass --kernel and --initrd")]
    NoDefaultGuest(&'static str),
    #[error(transparent)]
    Identity(#[from] mayfly_vmm::identity::IdentityError),
    #[error(transparent)]
    Disk(mayfly_vmm::devices::disks::DiskSetupError),
    #[error(transparent)]
    Net(#[from] mayfly_vmm::devices::net::NetSetupError),
}

/// Say what went wrong, on one line, and end with status 1.
pub(crate) fn fail(err: impl std::fmt::Display) -> std::process::ExitCode {
    eprintln!("mayfly: {err}");
    std::process::ExitCode::FAILURE
}
