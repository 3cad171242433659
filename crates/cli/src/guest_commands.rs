//! `mayfly exec` and `mayfly cp`: the guest agent from the command line, through the same
//! library API ([`mayfly_vmm::guest::agent`]) that platforms embedding mayfly use.

use std::fs::File;
use std::io::{IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use mayfly_agent_protocol::{ExecRequest, ExitRecord, FileType, WriteFileOptions};
use mayfly_api::guest::{exec_json, BoundedOutput};
use mayfly_vmm::guest::agent::{Agent, AgentError};

/// What `mayfly exec` and `mayfly cp` exit with when mayfly itself failed (not the command):
/// as ssh does, a status no ordinary command uses.
const MAYFLY_FAILED: u8 = 255;
/// A command the agent killed for its timeout, as timeout(1) reports it.
const TIMED_OUT: u8 = 124;
/// How much output `--json` keeps per stream.
const JSON_OUTPUT_LIMIT: usize = 16 << 20;

#[derive(Args)]
pub struct ExecArgs {
    /// The VM's control socket (its --api-sock).
    #[arg(long, value_name = "PATH")]
    sock: PathBuf,
    /// Kill the command (SIGTERM, then SIGKILL 2 s later) after this long, e.g. 30s, 500ms, 2m.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    timeout: Option<Duration>,
    /// Set an environment variable for the command (repeatable).
    #[arg(long, value_name = "KEY=VALUE", value_parser = parse_env)]
    env: Vec<(String, String)>,
    /// Start from an empty environment (then --env only).
    #[arg(long)]
    clear_env: bool,
    /// Working directory in the guest.
    #[arg(long, value_name = "DIR")]
    cwd: Option<String>,
    /// Run as this user (name or uid) in the guest.
    #[arg(long, value_name = "USER")]
    user: Option<String>,
    /// Run CMD as one shell command line (`/bin/sh -c`) instead of a program and arguments.
    #[arg(long)]
    shell: bool,
    /// Do not send this process's stdin to the command (it is sent unless it is a terminal).
    #[arg(long)]
    no_stdin: bool,
    /// Print one JSON object (the exit record, stdout and stderr) instead of streaming.
    #[arg(long)]
    json: bool,
    /// How long to wait for the guest agent to come up (a VM still booting).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "30s")]
    wait: Duration,
    /// The command and its arguments.
    #[arg(required = true, trailing_var_arg = true, value_name = "CMD")]
    command: Vec<String>,
}

#[derive(Args)]
pub struct CpArgs {
    /// The VM's control socket (its --api-sock).
    #[arg(long, value_name = "PATH")]
    sock: PathBuf,
    /// Permission bits of a file written in the guest (default: the local file's, or 0644).
    #[arg(long, value_name = "OCTAL", value_parser = parse_mode)]
    mode: Option<u32>,
    /// Create missing parent directories in the guest.
    #[arg(long)]
    mkdirs: bool,
    /// Source: a local path, `vm:/guest/path`, or `-` for stdin.
    #[arg(value_name = "SRC")]
    src: String,
    /// Destination: a local path, `vm:/guest/path`, or `-` for stdout.
    #[arg(value_name = "DST")]
    dst: String,
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    // A bare number is seconds, as timeout(1) takes it.
    if let Ok(secs) = text.parse::<f64>() {
        return Duration::try_from_secs_f64(secs).map_err(|e| format!("{text}: {e}"));
    }
    humantime::parse_duration(text).map_err(|e| format!("{text}: {e} (e.g. 30s, 500ms, 2m)"))
}

fn parse_env(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_owned(), value.to_owned())),
        _ => Err(format!("{text:?} is not KEY=VALUE")),
    }
}

fn parse_mode(text: &str) -> Result<u32, String> {
    u32::from_str_radix(text.trim_start_matches("0o"), 8)
        .ok()
        .filter(|m| *m <= 0o7777)
        .ok_or_else(|| format!("{text:?} is not octal permission bits such as 0644"))
}

fn failed(err: impl std::fmt::Display) -> ExitCode {
    eprintln!("mayfly: {err}");
    ExitCode::from(MAYFLY_FAILED)
}

/// The status `mayfly exec` exits with for the command's exit record.
fn exit_status(exit: &ExitRecord) -> u8 {
    if exit.timed_out {
        return TIMED_OUT;
    }
    match (exit.exit_code, exit.signal) {
        (Some(code), _) => u8::try_from(code & 0xff).unwrap_or(MAYFLY_FAILED),
        (None, Some(signal)) => u8::try_from(128 + (signal & 0x7f)).unwrap_or(MAYFLY_FAILED),
        (None, None) => MAYFLY_FAILED,
    }
}

fn agent_for(sock: &Path, wait: Duration) -> Result<Agent, AgentError> {
    Ok(Agent::for_vm(sock)?.with_wait(wait))
}

pub fn exec(args: ExecArgs) -> ExitCode {
    let mut request = if args.shell {
        ExecRequest::shell(args.command.join(" "))
    } else {
        ExecRequest::argv(args.command)
    };
    for (key, value) in args.env {
        request = request.with_env(key, value);
    }
    request = request.with_clear_env(args.clear_env);
    if let Some(cwd) = args.cwd {
        request = request.with_cwd(cwd);
    }
    if let Some(user) = args.user {
        request = match user.parse::<u32>() {
            Ok(uid) => request.with_user(uid),
            Err(_) => request.with_user(user.as_str()),
        };
    }
    if let Some(timeout) = args.timeout {
        let ms = u64::try_from(timeout.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        request = request.with_timeout_ms(ms);
    }
    if let Err(problem) = request.validate() {
        return failed(format!("bad command: {problem}"));
    }
    let agent = match agent_for(&args.sock, args.wait) {
        Ok(agent) => agent,
        Err(e) => return failed(e),
    };
    let stdin = std::io::stdin();
    let send_stdin = !args.no_stdin && !stdin.is_terminal();
    let input: Option<Box<dyn Read + Send>> = send_stdin.then(|| Box::new(stdin) as _);

    if args.json {
        let mut stdout = BoundedOutput::new(JSON_OUTPUT_LIMIT);
        let mut stderr = BoundedOutput::new(JSON_OUTPUT_LIMIT);
        let result = agent.exec(&request, input, |b| stdout.push(b), |b| stderr.push(b));
        return match result {
            Ok(exit) => {
                let status = exit_status(&exit);
                let json = exec_json(&exit, stdout, stderr);
                println!(
                    "{}",
                    serde_json::to_string_pretty(&json).unwrap_or_default()
                );
                ExitCode::from(status)
            }
            Err(e) => failed(e),
        };
    }
    let mut out = std::io::stdout().lock();
    let mut err = std::io::stderr();
    let mut out_failed = false;
    let result = agent.exec(
        &request,
        input,
        |b| {
            // Our stdout closed (`| head`): the rest is dropped, the command runs on.
            if !out_failed && (out.write_all(b).is_err() || out.flush().is_err()) {
                out_failed = true;
            }
        },
        |b| {
            let _ = err.write_all(b);
        },
    );
    match result {
        Ok(exit) => {
            if let Some(reason) = &exit.error {
                eprintln!("mayfly: {reason}");
            } else if exit.timed_out {
                eprintln!(
                    "mayfly: the command timed out after {:.0} ms and was killed",
                    exit.wall_ms
                );
            }
            ExitCode::from(exit_status(&exit))
        }
        Err(e) => failed(e),
    }
}

/// One side of `mayfly cp`.
enum Place {
    Guest(String),
    Local(PathBuf),
    Std,
}

fn place(text: &str) -> Place {
    match text.strip_prefix("vm:") {
        Some(path) => Place::Guest(path.to_owned()),
        None if text == "-" => Place::Std,
        None => Place::Local(PathBuf::from(text)),
    }
}

pub fn cp(args: CpArgs) -> ExitCode {
    let agent = match agent_for(&args.sock, mayfly_vmm::guest::agent::DEFAULT_WAIT) {
        Ok(agent) => agent,
        Err(e) => return failed(e),
    };
    match (place(&args.src), place(&args.dst)) {
        (Place::Guest(_), Place::Guest(_)) => {
            failed("both sides are in the VM: copy inside it with `mayfly exec -- cp SRC DST`")
        }
        (Place::Local(_) | Place::Std, Place::Local(_) | Place::Std) => {
            failed("neither side is in the VM: name the guest's side vm:/path (e.g. vm:/tmp/file)")
        }
        (src, Place::Guest(dst)) => to_guest(&agent, src, &dst, &args),
        (Place::Guest(src), dst) => from_guest(&agent, &src, dst),
    }
}

fn to_guest(agent: &Agent, src: Place, dst: &str, args: &CpArgs) -> ExitCode {
    let (input, local_mode): (Box<dyn Read>, Option<u32>) = match src {
        Place::Local(path) => {
            let file = match File::open(&path) {
                Ok(file) => file,
                Err(e) => return failed(format!("cannot open {}: {e}", path.display())),
            };
            match file.metadata() {
                Ok(meta) if meta.is_dir() => {
                    return failed(format!(
                        "{} is a directory: mayfly cp copies files (for a tree, pipe tar through mayfly exec)",
                        path.display()
                    ))
                }
                Ok(meta) => {
                    use std::os::unix::fs::PermissionsExt;
                    (Box::new(file), Some(meta.permissions().mode() & 0o7777))
                }
                Err(e) => return failed(format!("cannot read {}: {e}", path.display())),
            }
        }
        _ => (Box::new(std::io::stdin()), None),
    };
    let options = WriteFileOptions::default()
        .mode(args.mode.or(local_mode).unwrap_or(0o644))
        .mkdirs(args.mkdirs);
    match agent.write_file(dst, &options, input) {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => failed(e),
    }
}

fn from_guest(agent: &Agent, src: &str, dst: Place) -> ExitCode {
    let stat = match agent.stat(src, true) {
        Ok(stat) => stat,
        Err(e) => return failed(e),
    };
    if stat.file_type == FileType::Dir {
        return failed(format!(
            "vm:{src} is a directory: mayfly cp copies files (for a tree, pipe tar through mayfly exec)"
        ));
    }
    match dst {
        Place::Local(path) => {
            // Into a temporary file beside it, renamed over it once complete: a copy that
            // fails half-way leaves the old file (or none), never half of the new one.
            let path = if path.is_dir() {
                let name = Path::new(src).file_name().unwrap_or_default();
                path.join(name)
            } else {
                path
            };
            let dir = match path.parent() {
                Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
                _ => PathBuf::from("."),
            };
            let mut temp = dir.join(format!(
                ".{}.mayfly-cp-{}",
                path.file_name().unwrap_or_default().to_string_lossy(),
                std::process::id()
            ));
            let file = match File::create(&temp) {
                Ok(file) => file,
                Err(e) => return failed(format!("cannot create {}: {e}", temp.display())),
            };
            let mut writer = std::io::BufWriter::with_capacity(1 << 20, file);
            let result = agent.read_file(src, &mut writer);
            let finished = result.map_err(|e| e.to_string()).and_then(|_| {
                let file = writer.into_inner().map_err(|e| e.to_string())?;
                use std::os::unix::fs::PermissionsExt;
                file.set_permissions(std::fs::Permissions::from_mode(stat.mode & 0o777))
                    .map_err(|e| e.to_string())?;
                file.sync_all().map_err(|e| e.to_string())?;
                std::fs::rename(&temp, &path)
                    .map_err(|e| format!("cannot move the copy to {}: {e}", path.display()))?;
                temp = PathBuf::new();
                Ok(())
            });
            if !temp.as_os_str().is_empty() {
                let _ = std::fs::remove_file(&temp);
            }
            match finished {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => failed(e),
            }
        }
        _ => {
            let stdout = std::io::stdout().lock();
            match agent.read_file(src, std::io::BufWriter::new(stdout)) {
                Ok(_) => ExitCode::SUCCESS,
                Err(e) => failed(e),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_follow_the_shell() {
        let rec = |code, signal, timed_out| ExitRecord {
            exit_code: code,
            signal,
            timed_out,
            ..ExitRecord::default()
        };
        assert_eq!(exit_status(&rec(Some(0), None, false)), 0);
        assert_eq!(exit_status(&rec(Some(3), None, false)), 3);
        assert_eq!(exit_status(&rec(Some(127), None, false)), 127);
        assert_eq!(exit_status(&rec(None, Some(9), false)), 137);
        assert_eq!(exit_status(&rec(None, Some(15), true)), TIMED_OUT);
    }

    #[test]
    fn arguments_parse() {
        assert_eq!(parse_duration("1.5").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("-1").is_err());
        assert_eq!(parse_env("A=b=c").unwrap(), ("A".into(), "b=c".into()));
        assert!(parse_env("=x").is_err());
        assert!(parse_env("novalue").is_err());
        assert_eq!(parse_mode("0755").unwrap(), 0o755);
        assert!(parse_mode("999").is_err());
        assert!(matches!(place("vm:/etc/x"), Place::Guest(p) if p == "/etc/x"));
        assert!(matches!(place("-"), Place::Std));
        assert!(matches!(place("./vm:x"), Place::Local(_)));
    }
}
