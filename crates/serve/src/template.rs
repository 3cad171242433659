//! Templates: a machine (kernel, initramfs, root filesystem, memory, vCPUs) and the setup
//! commands run in it through the guest agent, booted once and snapshotted; every sandbox
//! made from it is a restore of that snapshot, not a boot.
//!
//! A template is cached under the hash of its inputs, `<state-dir>/templates/<key>/`: its
//! options, the identity (device, inode, size, modification time) of each file it names, and
//! that of the mayfly binary (whose snapshot format it is). A changed input is another key,
//! so another template. `template.json` is written last: a directory without it is a build
//! that never finished (a crash), removed and built again. Two creates from one new template
//! at once build it once.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::sandbox::{lock, write_atomically, Manager, Spec};
use crate::ServeError;

/// How long a template's guest may take until its agent answers (a cold boot in the test rig
/// takes seconds).
const AGENT_TIMEOUT: Duration = Duration::from_secs(180);
/// How long one setup command may run.
const SETUP_TIMEOUT: Duration = Duration::from_secs(600);
/// Setup commands per template.
const MAX_SETUP: usize = 64;
/// How much of a failed setup command's output its error quotes.
const QUOTED_OUTPUT: usize = 2000;

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
}

impl Template {
    /// The boot this template starts from.
    fn boot_spec(&self) -> Spec {
        Spec {
            kernel: self.kernel.clone(),
            initrd: self.initrd.clone(),
            cmdline: self.cmdline.clone(),
            mem_mib: self.mem_mib,
            vcpus: self.vcpus,
            rootfs: self.rootfs.clone(),
            probe: self.probe,
            ..Spec::default()
        }
    }

    pub fn check(&self) -> Result<(), String> {
        self.boot_spec().check()?;
        if self.setup.len() > MAX_SETUP {
            return Err(format!(
                "\"setup\" has {} commands; a template takes at most {MAX_SETUP} (join them \
                 with && or put them in a script)",
                self.setup.len()
            ));
        }
        if let Some(i) = self.setup.iter().position(|c| c.trim().is_empty()) {
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
    fn key(&self, mayfly: &Path) -> String {
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

/// The template cache and the builds under way.
pub struct Templates {
    dir: PathBuf,
    building: Mutex<HashMap<String, Arc<Mutex<()>>>>,
}

impl Templates {
    pub fn new(state_dir: &Path) -> Templates {
        Templates {
            dir: state_dir.join("templates"),
            building: Mutex::new(HashMap::new()),
        }
    }

    /// The snapshot sandboxes of `template` restore: cached, or built now (once, however many
    /// ask at once).
    pub fn snapshot_for(
        &self,
        manager: &Manager,
        template: &Template,
        jail_uid: Option<u32>,
    ) -> Result<PathBuf, ServeError> {
        let key = template.key(manager.mayfly());
        let dir = self.dir.join(&key);
        let gate = Arc::clone(lock(&self.building).entry(key.clone()).or_default());
        let _building = lock(&gate);
        let snapshot = dir.join("vm").join("snap");
        if dir.join("template.json").is_file() && snapshot.is_dir() {
            // Its last use, for collection (--template-ttl): template.json's mtime.
            let _ = std::fs::File::options()
                .write(true)
                .open(dir.join("template.json"))
                .and_then(|f| f.set_modified(std::time::SystemTime::now()));
            manager.event("template_used", "", json!({ "template": key }));
            return Ok(snapshot);
        }
        // A build that never finished (the manager died under it).
        let _ = std::fs::remove_dir_all(&dir);
        let start = Instant::now();
        let built = self.build(manager, template, &key, &dir, jail_uid);
        if let Err(e) = &built {
            let _ = std::fs::remove_dir_all(&dir);
            manager.event(
                "template_failed",
                "",
                json!({ "template": key, "error": e.to_string() }),
            );
        }
        built?;
        manager.event(
            "template_built",
            "",
            json!({
                "template": key,
                "ms": start.elapsed().as_secs_f64() * 1e3,
                "setup_commands": template.setup.len(),
            }),
        );
        Ok(snapshot)
    }

    /// Remove every template no create has used for `ttl` (its `template.json` untouched
    /// that long); the keys removed. A template a create is using or building right now is
    /// left (its gate is taken), and so is one `in_use` says a sandbox still names (one being
    /// made from it, not yet linked; one whose files could not be linked). Sandboxes made from
    /// a collected template keep working: each links the snapshot's files into its own
    /// directory at its create.
    pub fn collect_unused(&self, ttl: Duration, in_use: &dyn Fn(&Path) -> bool) -> Vec<String> {
        let unused = |dir: &Path| {
            std::fs::metadata(dir.join("template.json"))
                .and_then(|m| m.modified())
                .is_ok_and(|t| t.elapsed().unwrap_or_default() >= ttl)
        };
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut collected = Vec::new();
        for entry in entries.flatten() {
            let dir = entry.path();
            // A directory without template.json is a build under way (or a crashed one,
            // which the next start removes).
            if !unused(&dir) {
                continue;
            }
            let key = entry.file_name().to_string_lossy().into_owned();
            let gate = Arc::clone(lock(&self.building).entry(key.clone()).or_default());
            let Ok(_building) = gate.try_lock() else {
                continue;
            };
            if unused(&dir) && !in_use(&dir) && std::fs::remove_dir_all(&dir).is_ok() {
                collected.push(key);
            }
        }
        collected
    }

    fn build(
        &self,
        manager: &Manager,
        template: &Template,
        key: &str,
        dir: &Path,
        jail_uid: Option<u32>,
    ) -> Result<(), ServeError> {
        if let Some(parent) = dir.parent() {
            std::fs::create_dir_all(parent).map_err(|source| ServeError::Io {
                what: "make",
                path: parent.display().to_string(),
                source,
            })?;
        }
        crate::sandbox::make_dirs(dir, jail_uid)?;
        let builder = manager.detached_sandbox(&format!("template-{key}"), dir, jail_uid);
        let mut vmm = manager.start_vmm(
            &builder,
            &template.boot_spec(),
            jail_uid,
            false,
            &mut |pid, start, _| Manager::save_started(&builder, pid, start),
        )?;
        let sock = builder.socket();
        let result = (|| {
            // Snapshotted once its guest is ready, setup or not: a snapshot of a guest still
            // booting (or, the probe, still writing its pages) would make every sandbox
            // made from it finish that work, and its first sleep write all of it.
            if template.probe {
                wait_for_probe(&dir.join("vmm.log"))?;
            } else if !template.no_agent {
                wait_for_agent(&sock)?;
            }
            for (i, command) in template.setup.iter().enumerate() {
                run_setup(&sock, i + 1, command)?;
            }
            let request = |method: &str, path: &str, body: Option<serde_json::Value>| {
                match mayfly_api::request_with_timeout(
                    &sock,
                    method,
                    path,
                    body.as_ref(),
                    Duration::from_secs(120),
                ) {
                    Ok((status, _)) if status < 300 => Ok(()),
                    Ok((status, body)) => Err(ServeError::VmmFailed(format!(
                        "the template's VM answered {method} {path} with {status}: {body}"
                    ))),
                    Err(e) => Err(ServeError::VmmFailed(format!(
                        "the template's VM did not answer {method} {path}: {e}"
                    ))),
                }
            };
            request("PUT", "/vm/pause", None)?;
            request(
                "PUT",
                "/vm/snapshot",
                Some(json!({ "path": dir.join("vm").join("snap") })),
            )
        })();
        vmm.stop(&sock);
        result?;
        // The builder's VMM ran the setup commands' guest: what it wrote is checked and made
        // root's and read-only before any sandbox restores it.
        crate::fork::seal(&dir.join("vm").join("snap"))?;
        write_atomically(
            &dir.join("template.json"),
            &serde_json::to_vec_pretty(&json!({ "key": key, "template": template }))
                .unwrap_or_default(),
        )
    }
}

/// Wait until the template's guest agent runs commands.
fn wait_for_agent(sock: &Path) -> Result<(), ServeError> {
    let deadline = Instant::now() + AGENT_TIMEOUT;
    let mut last = String::new();
    while Instant::now() < deadline {
        match mayfly_api::request_with_timeout(
            sock,
            "POST",
            "/vm/exec",
            Some(&json!({ "argv": ["true"] })),
            Duration::from_secs(10),
        ) {
            Ok((200, body)) if body["exit"]["exit_code"] == 0 => return Ok(()),
            Ok((status, body)) => last = format!("{status} {body}"),
            Err(e) => last = e.to_string(),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Err(ServeError::VmmFailed(format!(
        "the template's guest agent did not answer within {} s (last: {last}); a template's \
         guest must run mayfly-agent, as the built-in one does",
        AGENT_TIMEOUT.as_secs()
    )))
}

/// Wait until the probe guest reports that it has written its pages and waits (its report
/// lines go to its VMM's log).
fn wait_for_probe(log: &Path) -> Result<(), ServeError> {
    let deadline = Instant::now() + AGENT_TIMEOUT;
    while Instant::now() < deadline {
        if std::fs::read_to_string(log).is_ok_and(|t| t.contains("mayfly-probe: waiting")) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Err(ServeError::VmmFailed(format!(
        "the template's probe guest did not report that it waits within {} s (see {})",
        AGENT_TIMEOUT.as_secs(),
        log.display()
    )))
}

/// The tail of a command's output, for an error.
fn tail(text: &str) -> &str {
    let mut start = text.len().saturating_sub(QUOTED_OUTPUT);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    text[start..].trim()
}

fn run_setup(sock: &Path, n: usize, command: &str) -> Result<(), ServeError> {
    let timeout_ms = u64::try_from(SETUP_TIMEOUT.as_millis()).unwrap_or(u64::MAX);
    let answer = mayfly_api::request_with_timeout(
        sock,
        "POST",
        "/vm/exec",
        Some(&json!({ "shell": command, "timeout_ms": timeout_ms })),
        SETUP_TIMEOUT + Duration::from_secs(30),
    );
    let failed = |how: String| {
        ServeError::BadRequest(format!(
            "the template's setup command {n} ({command:?}) {how}: the template is not made"
        ))
    };
    match answer {
        Ok((200, body)) if body["exit"]["exit_code"] == 0 => Ok(()),
        Ok((200, body)) => {
            let exit = &body["exit"];
            let how = match (exit["exit_code"].as_i64(), exit["signal"].as_i64()) {
                (Some(code), _) => format!("exited with {code}"),
                (None, Some(sig)) => format!("was killed by signal {sig}"),
                _ => format!("failed: {}", exit["error"]),
            };
            Err(failed(format!(
                "{how}; stdout: {:?}; stderr: {:?}",
                tail(body["stdout"].as_str().unwrap_or_default()),
                tail(body["stderr"].as_str().unwrap_or_default())
            )))
        }
        Ok((status, body)) => Err(failed(format!("could not run ({status}: {body})"))),
        Err(e) => Err(failed(format!("could not run ({e})"))),
    }
}
