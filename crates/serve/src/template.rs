//! What a template is: a machine (kernel, initramfs, root filesystem, memory, vCPUs) and the
//! setup commands run in it through the guest agent, as a create's `"template"` gives it;
//! its check and its key (the hash of its inputs, which names its cache directory). A
//! sandbox's [`crate::records::Spec`] holds one; [`crate::templates`] builds and caches them.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Setup commands per template.
const MAX_SETUP: usize = 64;

/// What `"template"` in a create holds.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Template {
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
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rootfs: Option<String>,
    /// The probe benchmark's guest (it has no agent: no setup commands).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub probe: bool,
    /// A guest without the agent: snapshotted as soon as it starts (no setup commands).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_agent: bool,
    /// Shell commands run in order as root through the agent; each must exit 0.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub setup: Vec<String>,
    /// The egress policy the setup commands run under (`mayfly run --net`): the template's
    /// machine then has a NIC, and so has every sandbox made from it, with the policy its own
    /// create names (none: it reaches nothing), never this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net: Option<String>,
}

/// The least guest memory a VMM boots with (`mayfly run --mem-mib`; mayfly_vmm::config's
/// MIN_MEM_MIB), and the most vCPUs (its MAX_VCPUS): a spec past them is refused here, not
/// by a VMM that then fails to start.
pub const MIN_MEM_MIB: u64 = 16;
pub const MAX_VCPUS: u32 = 254;

/// The machine's sizes a spec or template gives, checked as `mayfly run` checks them.
pub fn check_machine(mem_mib: Option<u64>, vcpus: Option<u32>) -> Result<(), String> {
    if mem_mib.is_some_and(|m| m < MIN_MEM_MIB) {
        return Err(format!(
            "\"mem_mib\" must be at least {MIN_MEM_MIB} (a guest needs that much)"
        ));
    }
    if vcpus.is_some_and(|v| v == 0 || v > MAX_VCPUS) {
        return Err(format!("\"vcpus\" must be 1 to {MAX_VCPUS}"));
    }
    Ok(())
}

/// Each file a spec names (what, path) must be given by an absolute path, and be there.
pub fn check_paths(paths: &[(&str, &Option<PathBuf>)]) -> Result<(), String> {
    for (what, path) in paths {
        if let Some(path) = path {
            if !path.is_absolute() {
                return Err(format!(
                    "\"{what}\": give an absolute path ({} is relative to nothing the \
                     manager knows)",
                    path.display()
                ));
            }
            if !path.exists() {
                return Err(format!("\"{what}\": {} does not exist", path.display()));
            }
        }
    }
    Ok(())
}

/// A root filesystem: `debian` (the image `rootfs/build.sh debian` builds), or the absolute
/// path of an image that is there.
pub fn check_rootfs(rootfs: Option<&str>) -> Result<(), String> {
    match rootfs {
        None | Some("debian") => Ok(()),
        Some(image) => check_paths(&[("rootfs", &Some(PathBuf::from(image)))]),
    }
}

/// Whether a setup command is blank: nothing but spaces, tabs and line breaks.
fn blank(command: &str) -> bool {
    command
        .chars()
        .all(|c| matches!(c, ' ' | '\t' | '\n' | '\r'))
}

impl Template {
    /// Whether its machine, and so every sandbox made from it, has a NIC.
    pub fn has_nic(&self) -> bool {
        self.net.as_deref().is_some_and(|net| net != "none")
    }

    pub fn check(&self) -> Result<(), String> {
        if let Some(net) = &self.net {
            net.parse::<mayfly_network::Policy>().map_err(|e| {
                format!(
                    "\"template\": \"net\": {net:?} is not a policy ({e}): give none, open, or \
                     allow=CIDR[:PORT]|NAME[:PORT],... (e.g. allow=pypi.org:443,files.pythonhosted.org:443)"
                )
            })?;
        }
        // What a check of its boot's spec checks: the files it names, its sizes.
        check_paths(&[("kernel", &self.kernel), ("initrd", &self.initrd)])?;
        check_rootfs(self.rootfs.as_deref())?;
        check_machine(self.mem_mib, self.vcpus)?;
        if self.setup.len() > MAX_SETUP {
            return Err(format!(
                "\"setup\" has {} commands; a template takes at most {MAX_SETUP} (join them \
                 with && or put them in a script)",
                self.setup.len()
            ));
        }
        if let Some(i) = self.setup.iter().position(|c| blank(c)) {
            return Err(format!("\"setup\" command {} is empty", i + 1));
        }
        if self.probe && !self.setup.is_empty() {
            return Err("the probe guest has no agent to run \"setup\" commands".into());
        }
        if self.no_agent && !self.setup.is_empty() {
            return Err(
                "a template without the agent (no_agent) cannot run \"setup\" commands".into(),
            );
        }
        Ok(())
    }

    /// The hash of everything that makes this template what it is.
    pub fn key(&self, mayfly: &Path) -> String {
        let mut hash = Sha256::new();
        hash.update(serde_json::to_vec(self).unwrap_or_default());
        let rootfs = self
            .rootfs
            .as_deref()
            .filter(|r| *r != "debian")
            .map(PathBuf::from);
        for path in [
            Some(mayfly.to_path_buf()),
            self.kernel.clone(),
            self.initrd.clone(),
            rootfs,
        ]
        .into_iter()
        .flatten()
        {
            hash.update(path.as_os_str().as_encoded_bytes());
            if let Ok(meta) = std::fs::metadata(&path) {
                for n in [
                    meta.dev(),
                    meta.ino(),
                    meta.size(),
                    meta.mtime().unsigned_abs(),
                    meta.mtime_nsec().unsigned_abs(),
                ] {
                    hash.update(n.to_le_bytes());
                }
            }
        }
        hash.finalize()[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}
