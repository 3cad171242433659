//! Templates built and cached: every sandbox made from a [`Template`] is a restore of its
//! snapshot, not a boot; the template's machine is booted once, its setup commands run
//! through the guest agent, and snapshotted.
//!
//! A template is cached under the hash of its inputs, `<state-dir>/templates/<key>/`: its
//! options, the identity (device, inode, size, modification time) of each file it names, and
//! that of the mayfly binary (whose snapshot format it is). A changed input is another key,
//! so another template. `template.json` is written last: a directory without it is a build
//! that never finished (a crash), removed and built again. Two creates from one new template
//! at once build it once. A build's VMM is started as a sandbox's is (see [`Launcher`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::error::ServeError;
use crate::events::EventLog;
use crate::files::{self, make_dirs, seal};
use crate::records::Spec;
use crate::sandbox::{Launcher, Sandbox};
use crate::template::Template;
use crate::util::{io_error, lock, write_atomically};

/// How long a template's guest may take until its agent answers (a cold boot in the test rig
/// takes seconds).
const AGENT_TIMEOUT: Duration = Duration::from_secs(180);
/// How long one setup command may run.
const SETUP_TIMEOUT: Duration = Duration::from_secs(600);
/// How much of a failed setup command's output its error quotes.
const QUOTED_OUTPUT: usize = 2000;

/// The boot a template starts from.
fn boot_spec(template: &Template) -> Spec {
    Spec {
        kernel: template.kernel.clone(),
        initrd: template.initrd.clone(),
        cmdline: template.cmdline.clone(),
        mem_mib: template.mem_mib,
        vcpus: template.vcpus,
        rootfs: template.rootfs.clone(),
        probe: template.probe,
        net: template.net.clone(),
        ..Spec::default()
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
    /// ask at once) by a VMM `launcher` starts, jailed as `jail_uid`, if `before_build` (what
    /// only a build needs: its network's names) allows.
    pub fn snapshot_for(
        &self,
        launcher: &Launcher<'_, '_>,
        events: &EventLog,
        template: &Template,
        jail_uid: Option<u32>,
        before_build: &dyn Fn() -> Result<(), ServeError>,
    ) -> Result<PathBuf, ServeError> {
        let key = template.key(launcher.mayfly);
        let dir = self.dir.join(&key);
        let gate = Arc::clone(lock(&self.building).entry(key.clone()).or_default());
        let _building = lock(&gate);
        let snapshot = files::snapshot_dir(&dir);
        if dir.join("template.json").is_file() && snapshot.is_dir() {
            // Its last use, for collection (--template-ttl): template.json's mtime.
            let _ = std::fs::File::options()
                .write(true)
                .open(dir.join("template.json"))
                .and_then(|f| f.set_modified(std::time::SystemTime::now()));
            events.write("template_used", "", json!({ "template": key }));
            return Ok(snapshot);
        }
        // A build that never finished (the manager died under it).
        let _ = std::fs::remove_dir_all(&dir);
        before_build()?;
        let start = Instant::now();
        let built = build(launcher, template, &key, &dir, jail_uid);
        if let Err(e) = &built {
            let _ = std::fs::remove_dir_all(&dir);
            events.write(
                "template_failed",
                "",
                json!({ "template": key, "error": e.to_string() }),
            );
        }
        built?;
        events.write(
            "template_built",
            "",
            json!({
                "template": key,
                "ms": start.elapsed().as_secs_f64() * 1e3,
                "setup_commands": template.setup.len(),
                "uid": jail_uid,
            }),
        );
        Ok(snapshot)
    }

    /// Each template's VMM log (a build's, under way or done) and its key: the idle watch
    /// keeps them under their cap as it does sandboxes' logs (a build's guest may write to
    /// its VMM for as long as its setup runs).
    pub fn vmm_logs(&self) -> Vec<(String, PathBuf)> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        entries
            .flatten()
            .map(|entry| {
                let key = entry.file_name().to_string_lossy().into_owned();
                (key, files::vmm_log(&entry.path()))
            })
            .collect()
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
}

/// Build `template` into `dir` (made here): boot it, wait for its guest, run its setup
/// commands, snapshot it, seal the snapshot, and write `template.json` last.
fn build(
    launcher: &Launcher<'_, '_>,
    template: &Template,
    key: &str,
    dir: &Path,
    jail_uid: Option<u32>,
) -> Result<(), ServeError> {
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent).map_err(io_error("make", parent))?;
    }
    make_dirs(dir, jail_uid)?;
    let builder = Sandbox::detached(&format!("template-{key}"), dir, jail_uid);
    let mut vmm = builder.start_vmm(
        launcher,
        &boot_spec(template),
        jail_uid,
        false,
        &mut |pid, start, _| builder.save_started(pid, start),
    )?;
    let sock = builder.socket();
    let result = (|| {
        // Snapshotted once its guest is ready, setup or not: a snapshot of a guest still
        // booting (or, the probe, still writing its pages) would make every sandbox
        // made from it finish that work, and its first sleep write all of it.
        if template.probe {
            wait_for_probe(&files::vmm_log(dir))?;
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
            Some(json!({ "path": files::snapshot_dir(dir) })),
        )
    })();
    vmm.stop(&sock);
    result?;
    // The builder's VMM ran the setup commands' guest: what it wrote is checked and made
    // root's and read-only before any sandbox restores it.
    seal(&files::snapshot_dir(dir))?;
    // Its uid goes back to the pool (a sandbox may get it next): nothing of the template
    // stays its.
    let vm = files::vm_dir(dir);
    std::os::unix::fs::lchown(&vm, Some(0), Some(0)).map_err(io_error("make root's", &vm))?;
    write_atomically(
        &dir.join("template.json"),
        &serde_json::to_vec_pretty(&json!({ "key": key, "template": template }))
            .unwrap_or_default(),
    )
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
