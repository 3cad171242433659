//! What `mayfly serve` is told at its start: where its state and socket are, which binary
//! its sandboxes' VMMs run, and its [`Policy`] (jail, budgets, expiry).
//!
//! Read once by the manager when it opens its state directory; nothing here changes while it
//! serves.

use std::path::{Path, PathBuf};

use crate::error::ServeError;

pub struct ServeConfig {
    pub state_dir: PathBuf,
    pub sock: PathBuf,
    /// The mayfly binary the sandboxes' VMMs run.
    pub mayfly: PathBuf,
    pub policy: Policy,
}

/// What the manager allows, and what it collects: `mayfly serve`'s options.
#[derive(Clone, Debug, Default)]
pub struct Policy {
    /// Jail new sandboxes' VMMs (see vmm/src/jail.rs): the default.
    pub jail: bool,
    /// Jailed sandboxes run as uids (and gids) from this one on, one each.
    pub jail_uid_base: u32,
    /// Guest memory (MiB) sandboxes with a running VMM may hold in all (see
    /// `budget::MemoryBudget::reserve`); `None`: no budget.
    pub mem_budget_mib: Option<u64>,
    /// Past the memory budget, put the longest-idle running sandboxes to sleep to make room
    /// (instead of refusing).
    pub make_room: bool,
    /// What the sandboxes may keep on disk in all (MiB; their snapshots, disk layers and
    /// bases): a suspend that could take more is refused; `None`: no budget.
    pub disk_budget_mib: Option<u64>,
    /// A sandbox asleep this long (seconds, since it was suspended or last used, whichever
    /// is later) is deleted and its snapshot collected; `None`: kept until deleted.
    pub expire_after_s: Option<u64>,
    /// A template no create has used for this long (seconds) is collected; `None`: kept.
    pub template_ttl_s: Option<u64>,
    /// The directories the files a create names must be in (`--images-dir`); none given:
    /// `<state-dir>/images`.
    pub images_dirs: Vec<PathBuf>,
    /// What each VMM may hold beside its guest's memory (MiB): its memory cgroup's limit is
    /// guest memory and this, and the memory budget counts both.
    pub vmm_allowance_mib: u64,
    /// The most a sandbox's console file takes (bytes; `MAYFLY_CONSOLE_LIMIT` of its VMM).
    pub console_limit: u64,
    /// Where sandboxes' networks are made (`--net-uplink`, `--net-dir`, `--net-dns`,
    /// `--net-reach`, `--net-never`), as arguments given to every VMM it starts.
    pub net_args: Vec<String>,
    /// Where names in a create's policies are resolved (`--net-dns`, `--net-uplink`): a name
    /// that does not resolve is refused (400) before any VMM starts for it.
    pub net_names: mayfly_network::Names,
    /// The networks kept built ahead of need (`--net-pool`), see `netpool.rs`.
    pub net_pool: NetPoolConfig,
    /// Abort the manager right after this step (tests only: `mayfly serve --crash-at`,
    /// hidden), to kill it inside one of the windows the journal covers (see `journal.rs`).
    pub crash_at: Option<CrashPoint>,
}

/// How many networks the manager keeps built ahead of need, made as its VMMs make theirs.
#[derive(Clone, Debug, Default)]
pub struct NetPoolConfig {
    /// 0: none.
    pub size: usize,
    /// The configuration every VMM's network is made with (`--net-dir`, `--net-uplink`...).
    pub network: mayfly_network::NetworkConfig,
}

/// A step of the manager's after which `--crash-at` makes it abort, as `kill -9` would.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrashPoint {
    /// `after-spawn`: a VMM was started, its pid is not saved yet.
    AfterSpawn,
    /// `after-mkdir`: a create made its sandbox's directory, its record is not written yet.
    AfterMkdir,
    /// `after-clone:K`: a fork made its K-th clone (counted from 1), it has not answered.
    AfterClone(usize),
    /// `mid-delete`: a delete ended its VMM and removed its record, not the rest of its
    /// directory.
    MidDelete,
}

impl std::str::FromStr for CrashPoint {
    type Err = String;

    fn from_str(text: &str) -> Result<CrashPoint, String> {
        match text {
            "after-spawn" => Ok(CrashPoint::AfterSpawn),
            "after-mkdir" => Ok(CrashPoint::AfterMkdir),
            "mid-delete" => Ok(CrashPoint::MidDelete),
            _ => match text.strip_prefix("after-clone:").map(str::parse::<usize>) {
                Some(Ok(k)) if k > 0 => Ok(CrashPoint::AfterClone(k)),
                _ => Err(format!(
                    "{text:?} is no crash point: give after-spawn, after-mkdir, after-clone:K \
                     (K from 1) or mid-delete"
                )),
            },
        }
    }
}

/// What a VMM may hold beside its guest's memory when not told (`--vmm-allowance-mib`): its
/// own code, threads, device queues and buffers, with room to spare.
pub const DEFAULT_VMM_ALLOWANCE_MIB: u64 = 256;
/// A console file's size when not told (`--console-limit`).
pub const DEFAULT_CONSOLE_LIMIT: u64 = 64 << 20;
/// The most a sandbox's VMM log (`vmm.log`, its stdout and stderr) keeps: past it, the idle
/// watch keeps its last half.
pub const VMM_LOG_LIMIT: u64 = 4 << 20;

/// The state directory must be absolute: the sandboxes' VMMs are given paths in it.
pub fn absolute_state_dir(dir: &Path) -> Result<PathBuf, ServeError> {
    std::path::absolute(dir).map_err(|source| ServeError::Io {
        what: "resolve",
        path: dir.display().to_string(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::CrashPoint;

    #[test]
    fn crash_points_are_read_from_their_names() {
        assert_eq!("after-spawn".parse(), Ok(CrashPoint::AfterSpawn));
        assert_eq!("after-mkdir".parse(), Ok(CrashPoint::AfterMkdir));
        assert_eq!("mid-delete".parse(), Ok(CrashPoint::MidDelete));
        assert_eq!("after-clone:3".parse(), Ok(CrashPoint::AfterClone(3)));
        for bad in [
            "after-clone:0",
            "after-clone:",
            "after-clone:x",
            "somewhere",
            "",
        ] {
            assert!(bad.parse::<CrashPoint>().is_err(), "{bad}");
        }
    }
}
