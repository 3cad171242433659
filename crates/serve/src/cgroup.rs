//! A memory limit for each VMM the manager starts: a memory cgroup of its own, its limit the
//! VMM's guest memory and a fixed allowance for the VMM itself, so that nothing a guest makes
//! its VMM allocate goes past what the memory budget counts for it. Jailed or not, the VMM
//! (and a jailed VMM's waiter) is put in it before it runs (`process::launch` writes to
//! `cgroup.procs` between fork and exec).
//!
//! cgroup v2 where its hierarchy has the memory controller (`memory.max`, no swap), else the
//! cgroup v1 memory hierarchy (`memory.limit_in_bytes`, and `memory.memsw.limit_in_bytes`
//! where swap is accounted), as hybrid hosts still have it. The groups are
//! `<v2>/mayfly-serve/<manager>-<group>`, or under the manager's own v1 memory group
//! (`.../mayfly-serve/<manager>-<group>`), `<manager>` a hash of the state directory,
//! `<group>` `s-<name>` for a sandbox and `t-template-<key>` for a template's build (see
//! [`crate::sandbox::Sandbox::group`]).

use std::fs::File;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::ServeError;
use crate::util::io_error;

/// Which memory hierarchy this host gives the manager.
#[derive(Clone, Debug)]
enum Kind {
    /// cgroup v2 mounted there, with the memory controller.
    V2(PathBuf),
    /// cgroup v1's memory hierarchy: the manager's own group in it.
    V1(PathBuf),
}

/// Where a manager makes its VMMs' memory cgroups.
#[derive(Clone, Debug)]
pub struct MemoryGroups {
    kind: Option<Kind>,
    /// Why the VMMs have no memory limit, when they have none.
    unavailable: Option<String>,
    /// Tells this manager's groups from another's on the host.
    tag: String,
}

/// A VMM's memory cgroup, made with its limit; `cgroup.procs` held open for the start.
pub struct Group {
    pub dir: PathBuf,
    /// Written with "0" by the VMM's process between fork and exec.
    pub procs: File,
    /// Whether it is a cgroup v2 group (a jailed VMM then moves to its jail's own group,
    /// which must get the limit too).
    pub v2: bool,
}

/// Mount points of `fstype` from /proc/self/mountinfo: (mount root, mount point, super
/// options).
fn mounts(fstype: &str) -> Vec<(String, PathBuf, String)> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    mountinfo
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let mut right = right.split_whitespace();
            if right.next() != Some(fstype) {
                return None;
            }
            let options = right.nth(1).unwrap_or_default().to_owned();
            let mut left = left.split_whitespace();
            let root = mayfly_sys::mountinfo::unescape(left.nth(3)?);
            let point = mayfly_sys::mountinfo::unescape(left.next()?);
            Some((root, PathBuf::from(point), options))
        })
        .collect()
}

impl MemoryGroups {
    /// Find the memory controller for a manager on `state_dir`; none when the host has none
    /// (the VMMs then have no memory limit, and the manager says so at its start).
    pub fn find(state_dir: &Path) -> MemoryGroups {
        let hash = Sha256::digest(state_dir.as_os_str().as_encoded_bytes());
        let tag = hash[..4].iter().map(|b| format!("{b:02x}")).collect();
        let v2 = mounts("cgroup2").into_iter().find(|(_, point, _)| {
            std::fs::read_to_string(point.join("cgroup.controllers"))
                .is_ok_and(|c| c.split_whitespace().any(|c| c == "memory"))
        });
        if let Some((_, point, _)) = v2 {
            return MemoryGroups::probed(Some(Kind::V2(point)), tag);
        }
        // v1: the manager's own memory group, as /proc/self/cgroup names it, under the
        // mount (whose root may be a group itself, in a container).
        let v1 = mounts("cgroup")
            .into_iter()
            .find(|(_, _, options)| options.split(',').any(|o| o == "memory"))
            .map(|(root, point, _)| {
                let own = std::fs::read_to_string("/proc/self/cgroup")
                    .unwrap_or_default()
                    .lines()
                    .find_map(|l| {
                        let mut parts = l.splitn(3, ':');
                        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
                        controllers
                            .split(',')
                            .any(|c| c == "memory")
                            .then(|| path.to_owned())
                    })
                    .unwrap_or_else(|| "/".into());
                let relative = own
                    .strip_prefix(root.trim_end_matches('/'))
                    .unwrap_or(&own)
                    .trim_start_matches('/')
                    .to_owned();
                point.join(relative)
            });
        MemoryGroups::probed(v1.map(Kind::V1), tag)
    }

    /// The groups under `kind`, if the manager can make them there: its own group made and
    /// (cgroup v2) the memory controller handed down to it, once, here. A host that lists
    /// the controller but does not let the manager use it (a read-only /sys/fs/cgroup, as in
    /// a container; EBUSY in a cgroup namespace whose root holds processes) runs its VMMs
    /// without a memory limit, and says why, instead of refusing every launch.
    fn probed(kind: Option<Kind>, tag: String) -> MemoryGroups {
        let Some(kind) = kind else {
            return MemoryGroups {
                kind: None,
                unavailable: Some(
                    "this host gives the manager no memory cgroup controller (cgroup v2 with \
                     memory, or cgroup v1's memory hierarchy)"
                        .into(),
                ),
                tag,
            };
        };
        match prepare(&kind) {
            Ok(()) => MemoryGroups {
                kind: Some(kind),
                unavailable: None,
                tag,
            },
            Err(e) => MemoryGroups {
                kind: None,
                unavailable: Some(format!(
                    "the host has a memory cgroup controller, but the manager cannot use it: \
                     {e} (give it a writable cgroup hierarchy, with memory delegated, for \
                     limits)"
                )),
                tag,
            },
        }
    }

    /// Why the VMMs run without a memory limit of their own, if they do.
    pub fn unavailable(&self) -> Option<&str> {
        self.unavailable.as_deref()
    }

    /// What the groups are under.
    fn parent(&self) -> Option<PathBuf> {
        match self.kind.as_ref()? {
            Kind::V2(mount) | Kind::V1(mount) => Some(mount.join("mayfly-serve")),
        }
    }

    /// The group named `group` (a sandbox's `s-<name>`, a template build's `t-<name>`), made
    /// or not.
    pub fn path(&self, group: &str) -> Option<PathBuf> {
        Some(self.parent()?.join(format!("{}-{group}", self.tag)))
    }

    /// Remove this manager's groups that hold no process any more (left by VMMs that ended
    /// while no manager watched them); one that still holds a VMM (adopted) stays, the kernel
    /// refusing to remove it.
    pub fn sweep(&self) {
        let Some(parent) = self.parent() else {
            return;
        };
        let Ok(entries) = std::fs::read_dir(&parent) else {
            return;
        };
        let prefix = format!("{}-", self.tag);
        for entry in entries.flatten() {
            if entry.file_name().to_string_lossy().starts_with(&prefix) {
                let _ = std::fs::remove_dir(entry.path());
            }
        }
    }

    /// Make (or remake) the memory group named `group` (see [`MemoryGroups::path`]), limited
    /// to `bytes`; `None` when the manager has no memory controller to use.
    pub fn make(&self, group: &str, bytes: u64) -> Result<Option<Group>, ServeError> {
        let (Some(kind), Some(dir)) = (&self.kind, self.path(group)) else {
            return Ok(None);
        };
        // Done at the start already; again in case the group was removed meanwhile.
        prepare(kind)?;
        // A group left by an earlier VMM of that group (a manager killed meanwhile) is made
        // again; one that still holds a process keeps it and gets the new limit.
        let _ = std::fs::remove_dir(&dir);
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io_error("make the memory cgroup", &dir)(e)),
        }
        let write = |file: &str, value: &str| {
            let path = dir.join(file);
            std::fs::write(&path, value).map_err(io_error("write", &path))
        };
        let limited = match kind {
            Kind::V2(_) => write("memory.max", &bytes.to_string()).and_then(|()| {
                // No swap: a guest over its limit is stopped, not slowed to a crawl.
                if dir.join("memory.swap.max").exists() {
                    write("memory.swap.max", "0")?;
                }
                Ok(())
            }),
            Kind::V1(_) => {
                let memsw = dir.join("memory.memsw.limit_in_bytes").exists();
                // memsw must stay at least the memory limit: the order that keeps it so.
                let value = bytes.to_string();
                write("memory.limit_in_bytes", &value)
                    .and_then(|()| {
                        if memsw {
                            write("memory.memsw.limit_in_bytes", &value)?;
                        }
                        Ok(())
                    })
                    .or_else(|_| {
                        if memsw {
                            write("memory.memsw.limit_in_bytes", &value)?;
                        }
                        write("memory.limit_in_bytes", &value)
                    })
            }
        };
        if let Err(e) = limited {
            let _ = std::fs::remove_dir(&dir);
            return Err(e);
        }
        let procs_path = dir.join("cgroup.procs");
        let procs = File::options()
            .write(true)
            .open(&procs_path)
            .map_err(io_error("open", &procs_path))?;
        Ok(Some(Group {
            dir,
            procs,
            v2: matches!(kind, Kind::V2(_)),
        }))
    }
}

/// The manager's own group under `kind` made, and (cgroup v2) the memory controller handed
/// down: root → mayfly-serve/ → the VMMs' groups.
fn prepare(kind: &Kind) -> Result<(), ServeError> {
    let (Kind::V2(mount) | Kind::V1(mount)) = kind;
    let parent = mount.join("mayfly-serve");
    match std::fs::create_dir(&parent) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io_error("make the memory cgroup", &parent)(e)),
    }
    if let Kind::V2(mount) = kind {
        for group in [mount, &parent] {
            let file = group.join("cgroup.subtree_control");
            std::fs::write(&file, "+memory").map_err(io_error("enable memory in", &file))?;
        }
    }
    Ok(())
}

/// End every process still in a sandbox's memory group (what is left of a VMM whose record
/// no longer names it: a fork's clone caught mid-fork, its jail's waiter still cleaning up),
/// then remove the group. Each is asked to stop (SIGTERM: a jail's waiter then cleans up
/// after its VMM), and killed if it has not within 2 s, through a pidfd taken while it is
/// still listed in the group, so no process that took a listed pid after its owner ended is
/// touched.
pub fn end_and_remove(dir: &Path) {
    let listed = || -> Vec<libc::pid_t> {
        std::fs::read_to_string(dir.join("cgroup.procs"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()
    };
    let start = std::time::Instant::now();
    loop {
        let pids = listed();
        let waited = start.elapsed();
        if pids.is_empty() || waited > std::time::Duration::from_secs(10) {
            break;
        }
        let signal = if waited < std::time::Duration::from_secs(2) {
            libc::SIGTERM
        } else {
            libc::SIGKILL
        };
        for pid in pids {
            if let Ok(pidfd) = mayfly_sys::pidfd::open(pid) {
                if listed().contains(&pid) {
                    mayfly_sys::pidfd::signal(&pidfd, signal);
                }
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    remove(dir);
}

/// Remove a VMM's memory group once its processes are gone (best effort: the kernel empties
/// a group a moment after its last process exits).
pub fn remove(dir: &Path) {
    for _ in 0..50 {
        match std::fs::remove_dir(dir) {
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            _ => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_controller_the_manager_cannot_use_means_no_limits_and_says_why() {
        // A hierarchy where the manager's group cannot be made (as under a read-only
        // /sys/fs/cgroup): launches go on without a limit.
        let missing = std::env::temp_dir().join(format!("mayfly-no-cgroup-{}", std::process::id()));
        let groups = MemoryGroups::probed(Some(Kind::V2(missing.join("absent"))), "t".into());
        assert!(groups.kind.is_none());
        let why = groups.unavailable().expect("a reason");
        assert!(why.contains("cannot use it"), "{why}");
        assert!(why.contains("mayfly-serve"), "{why}");
        assert!(groups.make("s-a", 1 << 30).expect("no failure").is_none());
        // None at all.
        let none = MemoryGroups::probed(None, "t".into());
        assert!(none.kind.is_none());
        assert!(none
            .unavailable()
            .expect("a reason")
            .contains("no memory cgroup"));
        // One it can use (a directory standing in for the hierarchy): limits.
        let dir = std::env::temp_dir().join(format!("mayfly-cgroup-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a directory");
        let usable = MemoryGroups::probed(Some(Kind::V1(dir.clone())), "t".into());
        assert!(usable.kind.is_some());
        assert!(usable.unavailable().is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
