//! What the manager keeps of a sandbox: its [`Spec`] (what it is made from), its [`State`],
//! and the [`Record`] saved as `sandbox.json` in its directory at every change of state.
//!
//! The record is what a manager that starts again (after a crash, or `kill -9`) rebuilds its
//! view from: its format is the manager's on-disk contract, so its fields only ever grow.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::ServeError;
use crate::template::{check_machine, check_paths, check_rootfs, Template};
use crate::util::write_atomically;

/// The longest idle timeout: a year.
const MAX_IDLE_TIMEOUT_S: u64 = 365 * 86_400;
/// The longest `acts_for` label, in characters.
const MAX_ACTS_FOR: usize = 256;
/// The idle timeout a create or a fork gives, checked.
pub fn check_idle_timeout(idle_timeout_s: Option<u64>) -> Result<(), String> {
    if idle_timeout_s == Some(0) {
        return Err("\"idle_timeout_s\" must be at least 1 (leave it out for never)".into());
    }
    if idle_timeout_s.is_some_and(|t| t > MAX_IDLE_TIMEOUT_S) {
        return Err(format!(
            "\"idle_timeout_s\" must be at most {MAX_IDLE_TIMEOUT_S} (a year; leave it out \
             for never)"
        ));
    }
    Ok(())
}

/// The record's file name in a sandbox's directory.
pub const RECORD: &str = "sandbox.json";
/// The guest memory a sandbox boots with when its spec names none: what `mayfly run` boots
/// with when not told (its --mem-mib default; a test holds the two equal).
pub const DEFAULT_MEM_MIB: u64 = 256;

/// What a sandbox is made from: the options of `mayfly run`, or a snapshot to restore.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Spec {
    /// A snapshot directory to restore instead of booting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initrd: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmdline: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_mib: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vcpus: Option<u32>,
    /// `debian` or an image path (`mayfly run --rootfs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rootfs: Option<String>,
    /// `mayfly run --net`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net: Option<String>,
    /// Suspend to disk after this long without a request (none: never).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout_s: Option<u64>,
    /// The probe benchmark's guest (gives the VM the probe device).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub probe: bool,
    /// A template to make it from (see [`crate::templates`]): a restore of the template's
    /// snapshot, built once per set of inputs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<Template>,
    /// Whom it acts for (the platform's own label, e.g. a user id): in its credential (see
    /// [`crate::credential`]); a fork's clones keep their source's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acts_for: Option<String>,
    /// Its guest runs no mayfly-agent (a guest of the user's own): no credential is given
    /// (a restored one would otherwise hold its create `CREDENTIAL_RESTORE_WAIT`, in
    /// `manager.rs`, for one). The probe guest is taken as such; a fork's clones keep their
    /// source's.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_agent: bool,
}

impl Spec {
    /// Whether its guest has no agent to give a credential to.
    pub fn agentless(&self) -> bool {
        self.no_agent || self.probe || self.template.as_ref().is_some_and(|t| t.probe)
    }

    /// Check what can be checked before anything is made.
    pub fn check(&self) -> Result<(), String> {
        self.check_shape()?;
        if let Some(template) = &self.template {
            return template.check();
        }
        check_paths(&[
            ("snapshot", &self.snapshot),
            ("kernel", &self.kernel),
            ("initrd", &self.initrd),
        ])?;
        check_rootfs(self.rootfs.as_deref())
    }

    /// What the request says, before any file it names is looked at: fields that go
    /// together, the machine's size, the idle timeout (a template's own fields, which name
    /// files, are checked by [`Spec::check`]).
    pub fn check_shape(&self) -> Result<(), String> {
        if let Some(net) = &self.net {
            net.parse::<mayfly_network::Policy>().map_err(|e| {
                format!(
                    "\"net\": {net:?} is not a policy ({e}): give none, open, or \
                     allow=CIDR[:PORT],... (e.g. allow=10.0.0.0/8:443,pypi.org)"
                )
            })?;
        }
        if let Some(who) = &self.acts_for {
            if who.is_empty()
                || who.chars().count() > MAX_ACTS_FOR
                || who.chars().any(char::is_control)
            {
                return Err(format!(
                    "\"acts_for\" must be 1 to {MAX_ACTS_FOR} characters of printable text (a \
                     label of the platform's own, such as a user id)"
                ));
            }
        }
        if self.template.is_some() {
            if self.snapshot.is_some()
                || self.kernel.is_some()
                || self.initrd.is_some()
                || self.cmdline.is_some()
                || self.mem_mib.is_some()
                || self.vcpus.is_some()
                || self.rootfs.is_some()
                || self.probe
            {
                return Err("a sandbox made from a template takes its machine from the \
                     template: put kernel, initrd, cmdline, mem_mib, vcpus and rootfs in \
                     \"template\", and give only \"net\" and \"idle_timeout_s\" beside it"
                    .into());
            }
            let has_nic = self.template.as_ref().is_some_and(Template::has_nic);
            if self.net.as_deref().is_some_and(|n| n != "none") && !has_nic {
                return Err(
                    "a sandbox made from a template has a NIC only if its template \
                     has one: give the template a \"net\" (the policy its setup runs under), \
                     and this create its own"
                        .into(),
                );
            }
            return check_idle_timeout(self.idle_timeout_s);
        }
        if self.snapshot.is_some()
            && (self.kernel.is_some()
                || self.initrd.is_some()
                || self.cmdline.is_some()
                || self.mem_mib.is_some()
                || self.vcpus.is_some()
                || self.rootfs.is_some()
                || self.probe)
        {
            return Err(
                "a sandbox made from a snapshot takes its machine from the snapshot: \
                 give \"snapshot\" alone (with \"net\" and \"idle_timeout_s\" if wanted)"
                    .into(),
            );
        }
        check_machine(self.mem_mib, self.vcpus)?;
        check_idle_timeout(self.idle_timeout_s)
    }

    /// The options of `mayfly run` that boot this spec.
    pub fn run_args(&self) -> Vec<String> {
        let mut args = Vec::new();
        let mut add = |flag: &str, value: Option<String>| {
            if let Some(value) = value {
                args.push(flag.to_owned());
                args.push(value);
            }
        };
        let path = |p: &Option<PathBuf>| p.as_ref().map(|p| p.display().to_string());
        add("--kernel", path(&self.kernel));
        add("--initrd", path(&self.initrd));
        add("--cmdline", self.cmdline.clone());
        add("--mem-mib", self.mem_mib.map(|m| m.to_string()));
        add("--vcpus", self.vcpus.map(|v| v.to_string()));
        add("--rootfs", self.rootfs.clone());
        add("--net", self.net.clone());
        if self.probe {
            args.push("--probe".into());
        }
        args
    }
}

/// Where a sandbox is in its life (the transitions: see [`crate::lifecycle`]).
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum State {
    /// Its VMM is being started (a record left in this state is a create that never finished).
    Starting,
    Running,
    /// Being snapshotted to sleep.
    Suspending,
    /// On disk only: no process, no RAM.
    Suspended,
    /// Its VMM ended without being asked and it has no snapshot to wake from.
    Dead,
    Deleting,
}

impl State {
    pub const ALL: [State; 6] = [
        State::Starting,
        State::Running,
        State::Suspending,
        State::Suspended,
        State::Dead,
        State::Deleting,
    ];

    pub fn name(self) -> &'static str {
        match self {
            State::Starting => "starting",
            State::Running => "running",
            State::Suspending => "suspending",
            State::Suspended => "suspended",
            State::Dead => "dead",
            State::Deleting => "deleting",
        }
    }
}

/// The one credential of a sandbox that verifies: the id its claims must carry, for whom it
/// was made, until when, or that it was revoked. A record from before credentials had ids
/// has none, and its guest's credential (with no id) verifies as before.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CredentialState {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audience: Option<String>,
    /// When it stops verifying, ms since the epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_ms: Option<u64>,
    /// Revoked: no credential of the sandbox verifies until a new one is minted.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub revoked: bool,
}

/// What is kept of a sandbox on disk.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    pub name: String,
    pub spec: Spec,
    pub state: State,
    /// SHA-256 of its token; none once revoked.
    pub token_sha256: Option<String>,
    /// When its token stops working (ms since the epoch); none: when it is revoked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_expires_ms: Option<u64>,
    /// Which credential of its guest's verifies now (see [`crate::credential`]).
    #[serde(default)]
    pub credential: CredentialState,
    /// Its VMM, while it runs: pid and the process's start time (field 22 of
    /// /proc/PID/stat), so that a pid used again by another process is never taken for it.
    pub pid: Option<u32>,
    pub pid_start: Option<u64>,
    pub created_ms: u64,
    pub last_used_ms: u64,
    pub suspended_ms: Option<u64>,
    pub wakes: u64,
    pub suspends: u64,
    /// Why it is dead, when it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub died: Option<String>,
    /// Whether its VMM runs jailed (`mayfly run|restore --jail`, sharing only this
    /// sandbox's directory): kept from its create, so its wakes are jailed alike.
    #[serde(default)]
    pub jailed: bool,
    /// The uid and gid its jailed VMM runs as: one of its own (no other sandbox's VMM, and
    /// nothing else on the host, runs as it), so nothing but its VMM can use its files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// Its running VMM's guest memory, bytes, for the memory budget: set at its start (a
    /// record from before budgets has none, and counts 0 until its next start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_bytes: Option<u64>,
    /// Its VM was paused by its user (`PUT .../vm/pause`) when it last went to sleep: the
    /// next wake pauses it again, as a wake (a restore) would otherwise set it running.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub vm_paused: bool,
    /// The fork that made it (its id in the journal, see `journal.rs`): a manager killed
    /// before that fork answered undoes every sandbox that names it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fork: Option<String>,
    /// Its guest ports the manager exposes on the host (see `ports.rs`): kept across sleep,
    /// wake and the manager's restarts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<PortRecord>,
    /// A jailed sandbox's NIC's egress policy, as its jail's waiter last said it (after its
    /// create and after each change the admin made): what a wake and a clone are restored
    /// with, never the policy in a snapshot its VMM wrote (a VMM its guest took over could
    /// have written `open` there). None: no NIC, or not jailed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net_policy: Option<String>,
}

/// A guest port exposed on the host: where it listens (`tcp:ADDR:PORT` or `unix:PATH`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PortRecord {
    pub guest_port: u16,
    pub host: String,
}

/// Save `record` as the record in the sandbox directory `dir`, atomically (a crash leaves
/// the old record or the new one).
pub fn write_record(dir: &Path, record: &Record) -> Result<(), ServeError> {
    write_atomically(
        &dir.join(RECORD),
        &serde_json::to_vec_pretty(record).unwrap_or_default(),
    )
}

/// The record in the sandbox directory `dir`, or why it cannot be read.
pub fn read_record(dir: &Path) -> Result<Record, String> {
    load_record(dir).map_err(|e| e.to_string())
}

/// Why a sandbox's record could not be had.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// The file could not be read (missing, or an I/O error): nothing is known of what it
    /// says; a read error may pass (try again, or look at the disk).
    #[error(
        "cannot read the record {path}: {source} (check the disk, then start the manager again)"
    )]
    Unreadable {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The file was read and is not a record this manager knows (garbled, or written by
    /// another version).
    #[error("the record {path} is not one this manager reads: {source} (look at it; a newer manager may read it)")]
    Garbled {
        path: PathBuf,
        source: serde_json::Error,
    },
}

/// The record in `dir`, or whether it could not be read or not understood.
pub fn load_record(dir: &Path) -> Result<Record, RecordError> {
    let path = dir.join(RECORD);
    let bytes = std::fs::read(&path).map_err(|source| RecordError::Unreadable {
        path: path.clone(),
        source,
    })?;
    serde_json::from_slice(&bytes).map_err(|source| RecordError::Garbled { path, source })
}

/// Whether `name` can name a sandbox: a DNS label (RFC 1123): 1 to 63 lower-case letters,
/// digits and hyphens, not starting or ending with a hyphen.
pub fn valid_name(name: &str) -> bool {
    (1..=63).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn names_are_dns_labels() {
        for good in ["a", "sbx-1", "0", &"x".repeat(63)] {
            assert!(valid_name(good), "{good}");
        }
        for bad in [
            "",
            "-a",
            "a-",
            "A",
            "a_b",
            "a.b",
            "a/b",
            "..",
            &"x".repeat(64),
            "é",
        ] {
            assert!(!valid_name(bad), "{bad}");
        }
    }

    #[test]
    fn specs_from_a_snapshot_take_nothing_else_and_paths_are_absolute() {
        let snap = Spec {
            snapshot: Some("/".into()),
            mem_mib: Some(64),
            ..Spec::default()
        };
        assert!(snap.check().unwrap_err().contains("alone"));
        let relative = Spec {
            kernel: Some("vmlinux".into()),
            ..Spec::default()
        };
        assert!(relative.check().unwrap_err().contains("absolute"));
        let missing = Spec {
            kernel: Some("/nonexistent/vmlinux".into()),
            ..Spec::default()
        };
        assert!(missing.check().unwrap_err().contains("does not exist"));
        let never = Spec {
            idle_timeout_s: Some(0),
            ..Spec::default()
        };
        assert!(never.check().unwrap_err().contains("at least 1"));
        assert!(Spec::default().check().is_ok());
        assert!(serde_json::from_value::<Spec>(json!({"kernal": "/x"})).is_err());
    }
}
