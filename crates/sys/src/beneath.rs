//! Names resolved strictly beneath a directory (openat2 with `RESOLVE_BENEATH`): the kernel
//! refuses any step of the resolution that would leave the directory: `..` above it, an
//! absolute symbolic link, a symbolic link that points outside, a magic link of /proc. For
//! files a snapshot names, which may come from a VMM the reader does not trust.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Open `name` (relative) beneath the directory `dir`, read-only, and return the file and
/// the real path it resolved to. `name` may hold symbolic links only as long as every one
/// resolves inside `dir`.
pub fn open(dir: &Path, name: &Path) -> std::io::Result<(File, PathBuf)> {
    open_resolving(
        dir,
        name,
        libc::RESOLVE_BENEATH | libc::RESOLVE_NO_MAGICLINKS,
    )
}

/// Open `name` (relative) beneath `dir` as [`open`] does, but following no symbolic link at
/// all, not even one that stays inside: for paths someone names that must be exactly what
/// they say (an admin's kernel or snapshot in an images directory). Opened non-blocking, so
/// a FIFO or a device there does not hold the caller in `open`: check its type before
/// reading (a regular file reads the same either way).
pub fn open_no_links(dir: &Path, name: &Path) -> std::io::Result<(File, PathBuf)> {
    open_how(
        dir,
        name,
        libc::O_NONBLOCK,
        libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS,
    )
}

fn open_resolving(dir: &Path, name: &Path, resolve: u64) -> std::io::Result<(File, PathBuf)> {
    open_how(dir, name, 0, resolve)
}

fn open_how(
    dir: &Path,
    name: &Path,
    flags: libc::c_int,
    resolve: u64,
) -> std::io::Result<(File, PathBuf)> {
    let invalid =
        |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidInput, what.to_owned());
    if name.is_absolute() {
        return Err(invalid("a name beneath a directory must be relative"));
    }
    let dir = File::open(dir)?;
    let name =
        CString::new(name.as_os_str().as_bytes()).map_err(|_| invalid("a name with a NUL byte"))?;
    // struct open_how (linux/openat2.h): flags, mode, resolve, three u64s.
    let how: [u64; 3] = [
        u64::try_from(libc::O_RDONLY | libc::O_CLOEXEC | flags).unwrap_or(0),
        0,
        resolve,
    ];
    // SAFETY: openat2 with a directory we hold open, a NUL-terminated name and an open_how of
    // the size passed; the result is checked.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir.as_raw_fd(),
            name.as_ptr(),
            how.as_ptr(),
            std::mem::size_of_val(&how),
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let fd = RawFd::try_from(fd).map_err(|_| std::io::Error::from_raw_os_error(libc::EBADF))?;
    // SAFETY: openat2 returned a new descriptor that nothing else owns.
    let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    let real = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))?;
    Ok((file, real))
}

/// Resolve `path` (absolute) as a name beneath `dir`: it must start with `dir` as written,
/// and the rest must resolve inside it (see [`open`]). Returns the file and its real path.
pub fn open_absolute(dir: &Path, path: &Path) -> std::io::Result<(File, PathBuf)> {
    let rest = path.strip_prefix(dir).map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!("{} is not under {}", path.display(), dir.display()),
        )
    })?;
    open(dir, rest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_stay_beneath_their_directory_whatever_links_they_hold() {
        let root = std::env::temp_dir().join(format!("mayfly-beneath-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let inside = root.join("inside");
        std::fs::create_dir_all(inside.join("sub")).unwrap();
        std::fs::write(inside.join("sub/file"), b"ok").unwrap();
        std::fs::write(root.join("secret"), b"no").unwrap();
        std::os::unix::fs::symlink("sub/file", inside.join("near")).unwrap();
        std::os::unix::fs::symlink("../secret", inside.join("up")).unwrap();
        std::os::unix::fs::symlink(root.join("secret"), inside.join("abs")).unwrap();

        let (_, real) = open(&inside, Path::new("sub/file")).unwrap();
        assert_eq!(
            real,
            std::fs::canonicalize(inside.join("sub/file")).unwrap()
        );
        let (_, real) = open(&inside, Path::new("near")).unwrap();
        assert_eq!(
            real,
            std::fs::canonicalize(inside.join("sub/file")).unwrap()
        );
        for escape in ["up", "abs", "../secret", "sub/../../secret"] {
            assert!(open(&inside, Path::new(escape)).is_err(), "{escape}");
        }
        assert!(open(&inside, Path::new("/etc/passwd")).is_err());
        let (_, real) = open_absolute(&inside, &inside.join("sub/file")).unwrap();
        assert!(real.ends_with("sub/file"));
        assert!(open_absolute(&inside, &inside.join("up")).is_err());
        assert!(open_absolute(&inside, &root.join("secret")).is_err());
        std::fs::remove_dir_all(&root).unwrap();
    }
}
