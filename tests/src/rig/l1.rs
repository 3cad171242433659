//! What L1 is given for a run: the command's environment, the writable directories it shares
//! and the ones it carries over under its fresh /tmp and /run, the `rig.conf` its init reads and
//! the `run.sh` that runs the command.

use std::ffi::{OsStr, OsString};
use std::fs;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use super::error::RigError;
use super::location::{FORCE_ENV, IN_RIG_ENV};
use super::options::RigOptions;

fn valid_env_name(name: &[u8]) -> bool {
    !name.is_empty()
        && !name[0].is_ascii_digit()
        && name.iter().all(|&b| b.is_ascii_alphanumeric() || b == b'_')
}

/// Parses `NAME=VALUE` (for `--env`).
pub fn parse_env_setting(setting: &OsStr) -> Result<(OsString, OsString), RigError> {
    let bytes = setting.as_bytes();
    let bad = || RigError::BadEnv {
        setting: setting.to_string_lossy().into_owned(),
    };
    let eq = bytes.iter().position(|&b| b == b'=').ok_or_else(bad)?;
    let (name, value) = (&bytes[..eq], &bytes[eq + 1..]);
    if !valid_env_name(name) {
        return Err(bad());
    }
    Ok((
        OsString::from_vec(name.to_vec()),
        OsString::from_vec(value.to_vec()),
    ))
}

fn passed_through(name: &str) -> bool {
    matches!(name, "PATH" | "HOME" | "TERM" | "USER" | "LANG")
        || ["RUST_", "CARGO_", "MAYFLY_"]
            .iter()
            .any(|prefix| name.starts_with(prefix))
}

/// The environment of the command: selected variables of this process, then `opts.env`, then the
/// rig's own markers (`MAYFLY_TEST_KVM=host`, so that tests inside do not start another rig).
pub(super) fn command_env(opts: &RigOptions) -> Result<Vec<(OsString, OsString)>, RigError> {
    let mut env: Vec<(OsString, OsString)> = std::env::vars_os()
        .filter(|(name, _)| {
            name.to_str()
                .is_some_and(|n| passed_through(n) && valid_env_name(n.as_bytes()))
        })
        .collect();
    for (name, value) in &opts.env {
        if !valid_env_name(name.as_bytes()) {
            let mut setting = name.clone();
            setting.push("=");
            setting.push(value);
            return Err(RigError::BadEnv {
                setting: setting.to_string_lossy().into_owned(),
            });
        }
        env.push((name.clone(), value.clone()));
    }
    env.push((FORCE_ENV.into(), "host".into()));
    env.push((IN_RIG_ENV.into(), "1".into()));
    Ok(env)
}

/// Canonical, distinct writable directories, parents before the directories inside them.
pub(super) fn rw_dirs(dirs: &[PathBuf]) -> Result<Vec<PathBuf>, RigError> {
    let mut out: Vec<PathBuf> = Vec::new();
    for dir in dirs {
        let bad = |reason: &str| RigError::BadRwDir {
            path: dir.clone(),
            reason: reason.to_string(),
        };
        let real = fs::canonicalize(dir).map_err(|e| RigError::BadRwDir {
            path: dir.clone(),
            reason: format!("{e} (it must be an existing directory)"),
        })?;
        if !real.is_dir() {
            return Err(bad("not a directory"));
        }
        if real == Path::new("/") {
            return Err(bad("the root cannot be shared writable"));
        }
        for special in ["/proc", "/sys", "/dev"] {
            if real.starts_with(special) {
                return Err(bad("L1 mounts its own /proc, /sys and /dev"));
            }
        }
        if real.as_os_str().as_bytes().contains(&b'\n') {
            return Err(bad("the path contains a newline"));
        }
        if !out.contains(&real) {
            out.push(real);
        }
    }
    out.sort_by_key(|p| p.components().count());
    Ok(out)
}

/// `'...'` quoting for sh, byte-exact.
pub(super) fn sh_quote(s: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(s.len() + 2);
    out.push(b'\'');
    for &b in s {
        if b == b'\'' {
            out.extend_from_slice(b"'\\''");
        } else {
            out.push(b);
        }
    }
    out.push(b'\'');
    out
}

/// L1 mounts fresh tmpfs on /tmp and /run. Host directories under them that the command needs
/// (its working directory, the source tree: a CI clone often lives in /tmp) are carried over,
/// read-only like the rest of the host's root. /tmp or /run themselves are not: the command
/// needs them writable.
pub(super) fn kept_dirs(dirs: &[PathBuf]) -> Vec<PathBuf> {
    let fresh = [Path::new("/tmp"), Path::new("/run")];
    let mut kept: Vec<PathBuf> = dirs
        .iter()
        .filter_map(|d| d.canonicalize().ok())
        .filter(|d| fresh.iter().any(|f| d.starts_with(f) && d.as_path() != *f))
        .filter(|d| !d.as_os_str().as_bytes().contains(&b'\n'))
        .collect();
    kept.sort();
    kept.dedup();
    // A directory inside another kept one comes along with it.
    let outer: Vec<PathBuf> = kept
        .iter()
        .filter(|d| !kept.iter().any(|o| o != *d && d.starts_with(o)))
        .cloned()
        .collect();
    outer
}

pub(super) fn rig_conf(
    ctl: &Path,
    rw: &[PathBuf],
    keep: &[PathBuf],
    interactive: bool,
    terminal_size: Option<(u16, u16)>,
) -> Vec<u8> {
    let mut conf = b"# written by mayfly-rig, read by L1's /init\n".to_vec();
    let mut line = |name: &str, value: &[u8]| {
        conf.extend_from_slice(name.as_bytes());
        conf.push(b'=');
        conf.extend_from_slice(&sh_quote(value));
        conf.push(b'\n');
    };
    line("RIG_CTL", ctl.as_os_str().as_bytes());
    line("RIG_NSHARES", (rw.len() + 1).to_string().as_bytes());
    for (i, dir) in rw.iter().enumerate() {
        line(&format!("RIG_SHARE_{}", i + 1), dir.as_os_str().as_bytes());
    }
    line("RIG_NKEEP", keep.len().to_string().as_bytes());
    for (i, dir) in keep.iter().enumerate() {
        line(&format!("RIG_KEEP_{}", i + 1), dir.as_os_str().as_bytes());
    }
    line("RIG_INTERACTIVE", if interactive { b"1" } else { b"0" });
    let (rows, cols) = terminal_size
        .map(|(r, c)| (r.to_string(), c.to_string()))
        .unwrap_or_default();
    line("RIG_ROWS", rows.as_bytes());
    line("RIG_COLS", cols.as_bytes());
    conf
}

pub(super) fn run_script(cwd: &Path, env: &[(OsString, OsString)], command: &[&OsStr]) -> Vec<u8> {
    let mut script =
        b"# written by mayfly-rig: the command, run by L1's /init in the host's root\n".to_vec();
    for (name, value) in env {
        script.extend_from_slice(b"export ");
        script.extend_from_slice(name.as_bytes());
        script.push(b'=');
        script.extend_from_slice(&sh_quote(value.as_bytes()));
        script.push(b'\n');
    }
    let cwd_q = sh_quote(cwd.as_os_str().as_bytes());
    script.extend_from_slice(b"cd ");
    script.extend_from_slice(&cwd_q);
    script.extend_from_slice(b" || { echo \"mayfly-rig: cannot enter the working directory \"");
    script.extend_from_slice(&cwd_q);
    script.extend_from_slice(
        b"\" inside L1 (/tmp and /run are fresh there: share it with --rw)\" >&2; exit 125; }\n",
    );
    script.extend_from_slice(b"exec");
    for arg in command {
        script.push(b' ');
        script.extend_from_slice(&sh_quote(arg.as_bytes()));
    }
    script.push(b'\n');
    script
}
