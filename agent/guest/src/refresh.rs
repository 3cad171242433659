//! The refresh op (after a restore or in a fork: the guest's clock is stale, its entropy
//! is shared with its siblings, its name is its parent's) and the identity op.

use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use mayfly_agent_protocol::{
    HookReport, Identity, RefreshEvent, RefreshReply, RefreshRequest, REFRESH_ENTROPY_MAX,
};

use crate::conn::Conn;
use crate::op::{send_ok, Config, OpError, SessionResult};
use crate::process::{base_env, run_captured, spawn_failure};
use crate::sys::{self, cvt};
use crate::users;

/// How much of a hook's output the reply carries.
const HOOK_OUTPUT_CAP: usize = 4096;

/// `_IOW('R', 0x03, int[2])` from linux/random.h; not in the libc crate.
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;

/// Refreshes run one at a time, so hooks of two refreshes never interleave.
static REFRESH_LOCK: Mutex<()> = Mutex::new(());

pub fn refresh(conn: &mut Conn, req: &RefreshRequest, cfg: &Config) -> SessionResult {
    let entropy = req.entropy_bytes().map_err(OpError::invalid)?;
    let _serial = REFRESH_LOCK
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let mut reply = RefreshReply::default();
    if cfg.system_changes {
        match set_clock(req.time_unix_ns) {
            Ok(()) => reply.clock_set = true,
            Err(e) => reply
                .warnings
                .push(format!("clock_settime(CLOCK_REALTIME) failed: {e}")),
        }
        match add_entropy(&entropy) {
            Ok(()) => reply.entropy_bytes = entropy.len() as u64,
            Err(e) => {
                // Still worth mixing in, even if the kernel will not credit it.
                let mixed = fs::OpenOptions::new()
                    .write(true)
                    .open("/dev/urandom")
                    .and_then(|mut f| f.write_all(&entropy));
                match mixed {
                    Ok(()) => {
                        reply.entropy_bytes = entropy.len() as u64;
                        reply.warnings.push(format!(
                            "RNDADDENTROPY failed ({e}): entropy mixed in by writing \
                             /dev/urandom, but not credited"
                        ));
                    }
                    _ => reply.warnings.push(format!("RNDADDENTROPY failed: {e}")),
                }
            }
        }
        match sys::set_hostname(&req.hostname) {
            Ok(()) => reply.hostname_set = true,
            Err(e) => reply.warnings.push(format!("sethostname failed: {e}")),
        }
        // Validated with the request.
        if let Ok(Some(mac)) = req.mac_bytes() {
            match set_nic_mac(mac) {
                Ok(()) => reply.mac_set = true,
                Err(e) => reply
                    .warnings
                    .push(format!("setting the NIC's MAC failed: {e}")),
            }
        }
    }
    write_identity(&cfg.run_dir, &req.identity).map_err(|e| {
        OpError::io(
            format!("cannot write {}", identity_path(&cfg.run_dir).display()),
            &e,
        )
    })?;
    let dirs: &[&str] = match req.event {
        RefreshEvent::Boot => &[],
        RefreshEvent::Restore => &["on-restore.d"],
        RefreshEvent::Fork => &["on-restore.d", "on-fork.d"],
    };
    for dir in dirs {
        for hook in hooks_in(&cfg.hooks_dir.join(dir)) {
            reply.hooks.push(run_hook(&hook, req, cfg));
        }
    }
    send_ok(conn, &reply)
}

/// Give the VM's virtio NIC (every interface the virtio_net driver runs) `mac`: a clone
/// wakes with its parent's MAC, and the host lets out only frames from the clone's own.
/// virtio-net changes its address while up, so nothing the guest has open is disturbed.
fn set_nic_mac(mac: [u8; 6]) -> io::Result<()> {
    let mut found = false;
    for entry in fs::read_dir("/sys/class/net")? {
        let entry = entry?;
        let driver = fs::read_link(entry.path().join("device/driver")).unwrap_or_default();
        if driver.file_name().is_none_or(|d| d != "virtio_net") {
            continue;
        }
        let name = entry.file_name();
        let name = name
            .to_str()
            .ok_or_else(|| io::Error::other("interface name not UTF-8"))?;
        sys::set_link_mac(name, mac)?;
        found = true;
    }
    if found {
        Ok(())
    } else {
        Err(io::Error::other("the guest has no virtio_net interface"))
    }
}

fn set_clock(time_unix_ns: u64) -> io::Result<()> {
    let ts = libc::timespec {
        tv_sec: libc::time_t::try_from(time_unix_ns / 1_000_000_000).unwrap_or(libc::time_t::MAX),
        // Below 10^9.
        tv_nsec: libc::c_long::try_from(time_unix_ns % 1_000_000_000).expect("below 10^9"),
    };
    // SAFETY: `ts` is a valid timespec that outlives the call.
    cvt(unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) }).map(drop)
}

/// `struct rand_pool_info` with room for the largest refresh.
#[repr(C)]
struct RandPoolInfo {
    entropy_count: libc::c_int,
    buf_size: libc::c_int,
    buf: [u8; REFRESH_ENTROPY_MAX],
}

/// Mixes `bytes` into the kernel's pool and credits them, so a fork's RNG diverges from its
/// siblings' at once.
fn add_entropy(bytes: &[u8]) -> io::Result<()> {
    // At most REFRESH_ENTROPY_MAX (512) bytes, credited at 8 bits each.
    let len = bytes.len().min(REFRESH_ENTROPY_MAX);
    let c_len = libc::c_int::try_from(len).expect("at most REFRESH_ENTROPY_MAX");
    let mut info = RandPoolInfo {
        entropy_count: c_len * 8,
        buf_size: c_len,
        buf: [0; REFRESH_ENTROPY_MAX],
    };
    info.buf[..len].copy_from_slice(&bytes[..len]);
    let urandom = fs::OpenOptions::new().write(true).open("/dev/urandom")?;
    // SAFETY: RNDADDENTROPY reads a rand_pool_info whose buf holds buf_size bytes; `info` is
    // laid out like the kernel's struct (two ints, then the bytes) and buf_size <= buf.len().
    cvt(unsafe {
        libc::ioctl(
            std::os::fd::AsRawFd::as_raw_fd(&urandom),
            RNDADDENTROPY as _,
            &info as *const RandPoolInfo,
        )
    })
    .map(drop)
}

fn identity_path(run_dir: &Path) -> PathBuf {
    run_dir.join("identity.json")
}

/// Writes identity.json atomically: readers see the old identity or the new one.
fn write_identity(run_dir: &Path, identity: &Identity) -> io::Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(run_dir)?;
    let mut json = serde_json::to_vec_pretty(identity)?;
    json.push(b'\n');
    let temp = run_dir.join(format!(".identity.json.{}.tmp", std::process::id()));
    let write = || -> io::Result<()> {
        let mut f = fs::File::create(&temp)?;
        f.write_all(&json)?;
        f.sync_all()?;
        fs::rename(&temp, identity_path(run_dir))
    };
    write().inspect_err(|_| {
        let _ = fs::remove_file(&temp);
    })
}

/// The identity the last refresh wrote, or defaults named after the hostname.
pub fn current_identity(cfg: &Config) -> Identity {
    fs::read(identity_path(&cfg.run_dir))
        .ok()
        .and_then(|bytes| serde_json::from_slice(&bytes).ok())
        .unwrap_or_else(|| Identity {
            name: sys::hostname(),
            index: None,
            parent: None,
            generation: 0,
        })
}

/// The hooks of one directory: executable files not starting with '.', in byte order of
/// their names. A missing directory has none.
fn hooks_in(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut hooks: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .filter(|e| !e.file_name().as_encoded_bytes().starts_with(b"."))
        .map(|e| e.path())
        .filter(|p| fs::metadata(p).is_ok_and(|m| m.is_file() && m.mode() & 0o111 != 0))
        .collect();
    hooks.sort_by(|a, b| a.file_name().cmp(&b.file_name()));
    hooks
}

fn run_hook(path: &Path, req: &RefreshRequest, cfg: &Config) -> HookReport {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let id = &req.identity;
    let mut cmd = Command::new(path);
    cmd.env_clear()
        .envs(base_env(&users::current(Path::new("/etc"))))
        .env("MAYFLY_EVENT", req.event.as_str())
        .env("MAYFLY_NAME", &id.name)
        .env(
            "MAYFLY_INDEX",
            id.index.map(|i| i.to_string()).unwrap_or_default(),
        )
        .env("MAYFLY_PARENT", id.parent.clone().unwrap_or_default())
        .env("MAYFLY_GENERATION", id.generation.to_string())
        .current_dir("/");
    match run_captured(cmd, cfg.hook_timeout, HOOK_OUTPUT_CAP) {
        Ok(run) => {
            let exit = crate::process::exit_record(run.result, Default::default(), run.timed_out);
            HookReport {
                name,
                exit_code: exit.exit_code,
                signal: exit.signal,
                timed_out: run.timed_out,
                output: String::from_utf8_lossy(&run.output).into_owned(),
            }
        }
        Err(e) => {
            let (code, reason) = spawn_failure(&path.display().to_string(), &e);
            HookReport {
                name,
                exit_code: Some(code),
                signal: None,
                timed_out: false,
                output: reason,
            }
        }
    }
}
