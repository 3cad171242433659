//! Network namespaces, slot locks and the `ip`/`nft` commands run inside namespaces.
//!
//! A namespace is entered only by a thread of its own (`setns` changes the calling thread
//! alone), which ends when its work is done, so no thread of the caller ever changes its
//! namespace. Sockets keep the namespace they were created in, so a netlink socket opened on
//! such a thread serves that namespace from any thread afterwards.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::error::NetworkError;

/// Enter the network namespace `ns` (this thread only).
pub(crate) fn setns(ns: RawFd) -> io::Result<()> {
    // SAFETY: setns on a descriptor; it changes only the calling thread's namespace.
    if unsafe { libc::setns(ns, libc::CLONE_NEWNET) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Run `f` on a thread inside the namespace `ns`; the caller's threads stay where they are.
pub fn run_in<T: Send>(ns: &File, f: impl FnOnce() -> T + Send) -> io::Result<T> {
    let fd = ns.as_raw_fd();
    std::thread::scope(|scope| {
        scope
            .spawn(move || {
                setns(fd)?;
                Ok(f())
            })
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("a thread inside a namespace panicked")))
    })
}

/// The calling thread's network namespace.
pub(crate) fn current() -> io::Result<File> {
    File::open("/proc/thread-self/ns/net")
}

/// A new, empty network namespace, held only by the returned descriptor (it goes away when
/// the last descriptor or process holding it does).
pub(crate) fn create() -> io::Result<File> {
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                // SAFETY: unshare of the network namespace affects this (scoped) thread only.
                if unsafe { libc::unshare(libc::CLONE_NEWNET) } < 0 {
                    return Err(io::Error::last_os_error());
                }
                current()
            })
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("the namespace thread panicked")))
    })
}

/// The inode of a namespace descriptor (what `lsns` and `/proc/*/ns/net` show).
pub fn inode(ns: &File) -> io::Result<u64> {
    Ok(ns.metadata()?.ino())
}

fn cpath(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a path with a NUL byte"))
}

/// Bind-mount the namespace at `path` (so it outlives its descriptors: for the pool).
pub(crate) fn bind(ns: &File, path: &Path) -> io::Result<()> {
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o400)
        .open(path)?;
    let source = cpath(Path::new(&format!("/proc/self/fd/{}", ns.as_raw_fd())))?;
    let target = cpath(path)?;
    // SAFETY: NUL-terminated paths; a bind mount with no data.
    let r = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        )
    };
    if r < 0 {
        let err = io::Error::last_os_error();
        let _ = std::fs::remove_file(path);
        return Err(err);
    }
    Ok(())
}

/// Undo [`bind`]: the namespace lives on only through open descriptors.
pub(crate) fn unbind(path: &Path) -> io::Result<()> {
    let target = cpath(path)?;
    // SAFETY: a NUL-terminated path.
    let r = unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
    let err = (r < 0).then(io::Error::last_os_error);
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => match err {
            Some(err) if err.raw_os_error() != Some(libc::EINVAL) => Err(err),
            _ => Ok(()),
        },
        Err(e) => Err(e),
    }
}

/// An exclusive lock on a slot's lock file, held until dropped (or the process dies: flock
/// locks go with the last descriptor of the open file, so kill -9 releases them).
pub(crate) struct SlotLock {
    file: File,
}

impl SlotLock {
    /// Take the lock at `path` if nobody holds it.
    pub(crate) fn try_take(path: &Path) -> io::Result<Option<Self>> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)?;
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } < 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
                return Ok(None);
            }
            return Err(err);
        }
        Ok(Some(Self { file }))
    }

    /// Say who holds the slot (for people looking at /run/mayfly/net).
    pub(crate) fn note(&mut self, text: &str) {
        let _ = self.file.set_len(0);
        let _ = (&self.file).write_all(text.as_bytes());
    }
}

/// Where a tool may live: root's PATH usually has the sbin directories, other environments
/// (CI, systemd units) may not.
fn find_tool(tool: &str) -> Option<PathBuf> {
    for dir in ["/usr/sbin", "/sbin", "/usr/bin", "/bin", "/usr/local/sbin"] {
        let p = Path::new(dir).join(tool);
        if p.exists() {
            return Some(p);
        }
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(tool))
            .find(|p| p.exists())
    })
}

/// The Debian package that has `tool`.
fn package_of(tool: &str) -> &'static str {
    match tool {
        "nft" => "nftables",
        "ip" => "iproute2",
        _ => "the package providing it",
    }
}

/// Check that the tools mayfly shells out to are installed.
pub fn check_tools() -> Result<(), NetworkError> {
    for tool in ["ip", "nft"] {
        if find_tool(tool).is_none() {
            return Err(NetworkError::ToolMissing {
                tool,
                package: package_of(tool),
            });
        }
    }
    Ok(())
}

/// Run `tool args...` (with `input` on its stdin) inside the namespace `ns` (or the caller's,
/// for `None`); its stdout on success.
pub(crate) fn run(
    tool: &'static str,
    args: &[&str],
    input: Option<&str>,
    ns: Option<&File>,
) -> Result<String, NetworkError> {
    let path = find_tool(tool).ok_or(NetworkError::ToolMissing {
        tool,
        package: package_of(tool),
    })?;
    let mut cmd = Command::new(path);
    cmd.args(args)
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(ns) = ns {
        let fd = ns.as_raw_fd();
        // SAFETY: the closure runs in the child between fork and exec and calls setns only,
        // a plain system call (async-signal-safe); `fd` is open in the child until exec.
        unsafe {
            cmd.pre_exec(move || setns(fd));
        }
    }
    let describe = || format!("{tool} {}", args.join(" "));
    let mut child = cmd.spawn().map_err(|source| NetworkError::Command {
        command: describe(),
        why: source.to_string(),
    })?;
    if let Some(input) = input {
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(input.as_bytes())
                .map_err(|source| NetworkError::Command {
                    command: describe(),
                    why: format!("cannot write its input: {source}"),
                })?;
        }
    }
    let out = child
        .wait_with_output()
        .map_err(|source| NetworkError::Command {
            command: describe(),
            why: source.to_string(),
        })?;
    if !out.status.success() {
        return Err(NetworkError::Command {
            command: describe(),
            why: format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The index of interface `name` in the namespace a socket `sock` was created in, if it
/// exists there.
pub(crate) fn link_index(sock: &File, name: &str) -> Option<u32> {
    let mut req = [0u8; 40];
    let bytes = name.as_bytes();
    if bytes.len() >= libc::IFNAMSIZ {
        return None;
    }
    req[..bytes.len()].copy_from_slice(bytes);
    // SAFETY: SIOCGIFINDEX reads and writes a 40-byte struct ifreq.
    let r = unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFINDEX, req.as_mut_ptr()) };
    (r == 0).then(|| u32::from_ne_bytes([req[16], req[17], req[18], req[19]]))
}

/// A datagram socket in the calling thread's namespace (for interface ioctls).
pub(crate) fn ioctl_socket() -> io::Result<File> {
    // SAFETY: a plain socket call.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor nobody else owns.
    Ok(unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}

/// Open the persistent tap `name` in the calling thread's namespace with IFF_TAP | IFF_NO_PI
/// | IFF_VNET_HDR.
pub(crate) fn open_tap(name: &str) -> io::Result<File> {
    let tun = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open("/dev/net/tun")?;
    let mut req = [0u8; 40];
    req[..name.len()].copy_from_slice(name.as_bytes());
    let flags = libc::c_short::try_from(libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR)
        .expect("the tap flags fit a short");
    req[16..18].copy_from_slice(&flags.to_ne_bytes());
    // SAFETY: TUNSETIFF reads and writes a 40-byte struct ifreq.
    let r = unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETIFF, req.as_mut_ptr()) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(tun)
}

/// Whether `file` is the tun device (/dev/net/tun, char 10:200) attached as a tap to the
/// interface `name` (TUNGETIFF): a descriptor taken from another process is checked to be
/// what it was said to be.
pub(crate) fn is_tap(file: &File, name: &str) -> bool {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let is_tun = file.metadata().is_ok_and(|m| {
        m.file_type().is_char_device()
            && libc::major(m.rdev()) == 10
            && libc::minor(m.rdev()) == 200
    });
    if !is_tun {
        return false;
    }
    let mut req = [0u8; 40];
    // SAFETY: TUNGETIFF on the tun device (checked above) fills a 40-byte struct ifreq, or
    // fails if the descriptor is attached to no interface.
    let r = unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNGETIFF, req.as_mut_ptr()) };
    if r < 0 {
        return false;
    }
    let flags = libc::c_int::from(i16::from_ne_bytes([req[16], req[17]]));
    let len = req[..16].iter().position(|b| *b == 0).unwrap_or(16);
    &req[..len] == name.as_bytes() && flags & libc::IFF_TAP != 0
}

/// Whether `ns`, a namespace file (its inode checked by the caller), is a network
/// namespace (NS_GET_NSTYPE).
pub(crate) fn is_net_namespace(ns: &File) -> bool {
    // SAFETY: NS_GET_NSTYPE takes no argument (0 is passed) and returns the namespace's
    // type; the caller has checked the file is the namespace it expects by its inode.
    let kind = unsafe { libc::ioctl(ns.as_raw_fd(), libc::NS_GET_NSTYPE, 0) };
    kind == libc::CLONE_NEWNET
}

/// The inode of the network namespace the tun device `tap` (checked by [`is_tap`]) is in
/// (TUNGETDEVNETNS).
pub(crate) fn tap_namespace_inode(tap: &File) -> io::Result<u64> {
    // SAFETY: on a tun descriptor (checked by the caller) TUNGETDEVNETNS takes no argument
    // (0 is passed) and returns a new descriptor of its device's network namespace, which
    // the File below owns.
    let fd = unsafe { libc::ioctl(tap.as_raw_fd(), libc::TUNGETDEVNETNS, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor the kernel just made for this process alone.
    let ns = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    inode(&ns)
}

/// Wait until interface `name` of the calling thread's namespace is running (carrier on and
/// seen by the kernel's link watcher, which until then leaves the device's queue dropping
/// everything sent to it): a tap is, shortly after a descriptor attaches. Returns whether it
/// became so within `timeout`.
pub(crate) fn wait_running(name: &str, timeout: std::time::Duration) -> io::Result<bool> {
    let sock = ioctl_socket()?;
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let mut req = [0u8; 40];
        req[..name.len()].copy_from_slice(name.as_bytes());
        // SAFETY: SIOCGIFFLAGS reads and writes a 40-byte struct ifreq.
        let r = unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, req.as_mut_ptr()) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        let flags = i32::from(i16::from_ne_bytes([req[16], req[17]]));
        if flags & libc::IFF_RUNNING != 0 {
            return Ok(true);
        }
        if std::time::Instant::now() >= deadline {
            return Ok(false);
        }
        std::thread::sleep(std::time::Duration::from_micros(50));
    }
}

/// Make the tap persistent (it stays without a descriptor attached, in its namespace).
pub(crate) fn persist_tap(tap: &File, persist: bool) -> io::Result<()> {
    // SAFETY: TUNSETPERSIST takes its argument by value.
    let r = unsafe {
        libc::ioctl(
            tap.as_raw_fd(),
            libc::TUNSETPERSIST,
            libc::c_ulong::from(persist),
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Write a sysctl of the calling thread's namespace (`/proc/sys/net/...` follows the
/// namespace of the thread that opens it).
pub(crate) fn sysctl(path: &str, value: &str) -> io::Result<()> {
    let mut f = OpenOptions::new().write(true).open(path)?;
    f.write_all(value.as_bytes())
}
