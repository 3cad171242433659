//! Network namespaces a test makes for itself: VMs' networks go out to one of these
//! (`--net-uplink`) instead of the host's, so a test touches nothing of the machine's own
//! network.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

/// A new, empty network namespace, and the path that names it while the test runs (what
/// `--net-uplink` is given).
pub fn uplink() -> (File, String) {
    let ns = std::thread::spawn(|| {
        // SAFETY: unshare affects only this short-lived thread.
        assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0);
        File::open("/proc/thread-self/ns/net").expect("the new namespace")
    })
    .join()
    .expect("the namespace thread");
    let path = format!("/proc/{}/fd/{}", std::process::id(), ns.as_raw_fd());
    (ns, path)
}

/// The names of the links in the namespace `ns` (`ip -o link`).
pub fn links_in(ns: &File) -> Vec<String> {
    let fd = ns.as_raw_fd();
    let mut cmd = Command::new("ip");
    cmd.args(["-o", "link"]).stdin(Stdio::null());
    // SAFETY: setns only, between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = cmd
        .output()
        .expect("ip (iproute2) runs: scripts/setup.sh installs it");
    assert!(
        out.status.success(),
        "ip -o link: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split(": ").nth(1))
        .filter_map(|name| name.split('@').next())
        .map(str::to_string)
        .collect()
}

/// Where a test's VMs make their networks: a namespace of its own for them to go out to, and
/// a directory under the test's for their slot locks.
pub struct TestNet {
    /// The uplink namespace (held open while the test runs).
    pub ns: File,
    /// `--net-uplink PATH --net-dir DIR`, for `mayfly run|restore|serve`.
    args: [String; 4],
}

impl TestNet {
    pub fn new(dir: &crate::guest::TestDir) -> TestNet {
        let (ns, path) = uplink();
        TestNet {
            ns,
            args: [
                "--net-uplink".into(),
                path,
                "--net-dir".into(),
                dir.arg("net"),
            ],
        }
    }

    pub fn args(&self) -> Vec<&str> {
        self.args.iter().map(String::as_str).collect()
    }
}
