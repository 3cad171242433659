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

/// A bad `MAYFLY_*` setting in the environment of a VMM command.
#[derive(Debug, thiserror::Error)]
pub enum EnvError {
    #[error(transparent)]
    Seccomp(#[from] mayfly_jail::seccomp::SeccompError),
    #[error("MAYFLY_CONSOLE_LIMIT={0:?} is not a size: give bytes, or a number with K, M or G (e.g. 64M)")]
    ConsoleLimit(std::ffi::OsString),
}

/// A size in bytes: a number, or one with a binary suffix K, M or G ("64M"). None if it is
/// not one, or does not fit in 64 bits.
pub(crate) fn parse_size(text: &str) -> Option<u64> {
    let (digits, shift) = match text.strip_suffix(['K', 'k']) {
        Some(d) => (d, 10),
        None => match text.strip_suffix(['M', 'm']) {
            Some(d) => (d, 20),
            None => match text.strip_suffix(['G', 'g']) {
                Some(d) => (d, 30),
                None => (text, 0),
            },
        },
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse::<u64>().ok()?.checked_mul(1u64 << shift)
}

/// Say what went wrong, on one line, and end with status 1.
pub(crate) fn fail(err: impl std::fmt::Display) -> std::process::ExitCode {
    eprintln!("mayfly: {err}");
    std::process::ExitCode::FAILURE
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("64M"), Some(64 << 20));
        assert_eq!(parse_size("2g"), Some(2 << 30));
        assert_eq!(parse_size("1k"), Some(1024));
        for bad in ["", "M", "-1", "1.5M", "1T", " 1", "99999999999999999999G"] {
            assert_eq!(parse_size(bad), None, "{bad}");
        }
    }
}
