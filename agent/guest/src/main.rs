//! mayfly-agent: the guest side of mayfly's agent protocol (see PROTOCOL.md).
//!
//! It listens on virtio-vsock (or a Unix socket, for tests on the host), serves each
//! connection on its own thread, and runs one operation per connection: exec, file
//! transfer and metadata, and the refresh a VM needs after a restore or a fork.
// Lossy `as` casts are refused here (tests aside): every conversion that can lose bits says
// why it cannot.
#![cfg_attr(
    not(test),
    warn(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_possible_wrap
    )
)]

/// Logs one line to stderr (the console) as `mayfly-agent: ...`, in a single write: stderr
/// is unbuffered, and a line written in pieces interleaves with other output on the console.
macro_rules! log {
    ($($arg:tt)*) => {
        $crate::log_line(format_args!($($arg)*))
    };
}

mod conn;
mod exec;
mod files;
mod init;
mod op;
mod process;
mod refresh;
mod session;
mod sys;
mod users;

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use mayfly_agent_protocol::DEFAULT_VSOCK_PORT;

use conn::{ListenAddr, Listener};
use op::Config;

const USAGE: &str = "\
usage: mayfly-agent [--listen vsock:PORT | --listen unix:PATH] [--init] [options]

  --listen ADDR          where to listen (default vsock:52)
  --init                 run as PID 1: mount /proc, /sys, /dev, /run, /tmp; reap orphans;
                         keep a shell on /dev/ttyS0; power off on SIGTERM or SIGINT
  --max-connections N    connections served at once; more get ERROR busy (default 256)
  --no-system-changes    refresh does not set the clock, entropy or hostname (for tests
                         on a host, where those would change the host)
  --run-dir DIR          where identity.json is written (default /run/mayfly)
  --hooks-dir DIR        where on-restore.d and on-fork.d are (default /etc/mayfly)
  --hook-timeout-ms N    how long each refresh hook may run (default 30000)
  --connect vsock:CID:PORT
                         instead of serving: connect to PORT of CID (2 is the host) and
                         copy stdin to it and it to stdout, as `socat - VSOCK-CONNECT` does
  --version              print the version";

#[derive(Debug, Clone)]
struct Options {
    listen: ListenAddr,
    init: bool,
    max_connections: usize,
    system_changes: bool,
    run_dir: PathBuf,
    hooks_dir: PathBuf,
    hook_timeout: Duration,
    connect: Option<(u32, u32)>,
}

fn log_line(args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let line = format!("mayfly-agent: {args}\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
}

fn agent_name() -> String {
    format!("mayfly-agent {}", env!("CARGO_PKG_VERSION"))
}

impl Default for Options {
    fn default() -> Self {
        Options {
            listen: ListenAddr::Vsock(DEFAULT_VSOCK_PORT),
            init: false,
            max_connections: 256,
            system_changes: true,
            run_dir: PathBuf::from("/run/mayfly"),
            hooks_dir: PathBuf::from("/etc/mayfly"),
            hook_timeout: Duration::from_secs(30),
            connect: None,
        }
    }
}

fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Option<Options>, String> {
    let mut o = Options::default();
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--listen" => o.listen = ListenAddr::parse(&value("--listen")?)?,
            "--init" => o.init = true,
            "--no-system-changes" => o.system_changes = false,
            "--run-dir" => o.run_dir = PathBuf::from(value("--run-dir")?),
            "--hooks-dir" => o.hooks_dir = PathBuf::from(value("--hooks-dir")?),
            "--max-connections" => {
                let v = value("--max-connections")?;
                o.max_connections = match v.parse() {
                    Ok(n) if n > 0 => n,
                    _ => return Err(format!("--max-connections {v:?}: give a positive number")),
                };
            }
            "--hook-timeout-ms" => {
                let v = value("--hook-timeout-ms")?;
                o.hook_timeout = match v.parse() {
                    Ok(ms) if ms > 0 => Duration::from_millis(ms),
                    _ => return Err(format!("--hook-timeout-ms {v:?}: give a positive number")),
                };
            }
            "--connect" => {
                let v = value("--connect")?;
                o.connect = Some(parse_connect(&v).ok_or(format!(
                    "--connect {v:?}: give vsock:CID:PORT, e.g. vsock:2:1234 for the host"
                ))?);
            }
            "--version" => {
                println!("{}", agent_name());
                return Ok(None);
            }
            "--help" | "-h" => {
                println!("{USAGE}");
                return Ok(None);
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(Some(o))
}

fn parse_connect(text: &str) -> Option<(u32, u32)> {
    let rest = text.strip_prefix("vsock:")?;
    let (cid, port) = rest.split_once(':')?;
    Some((cid.parse().ok()?, port.parse().ok()?))
}

/// `--connect`: stdin to the connection, the connection to stdout, until both ends are done.
fn bridge(cid: u32, port: u32) -> i32 {
    use std::io::{Read, Write};
    let fd = match conn::connect_vsock(cid, port) {
        Ok(fd) => fd,
        Err(e) => {
            log!("cannot connect to vsock {cid}:{port}: {e}");
            return 1;
        }
    };
    let sock = std::fs::File::from(fd);
    let Ok(mut upstream) = sock.try_clone() else {
        return 1;
    };
    let sender = thread::spawn(move || {
        let _ = std::io::copy(&mut std::io::stdin().lock(), &mut upstream);
        // End of our input: tell the peer, keep reading its answer.
        use std::os::fd::AsRawFd;
        // SAFETY: shutdown on a socket this thread holds open; no memory effects.
        unsafe { libc::shutdown(upstream.as_raw_fd(), libc::SHUT_WR) };
    });
    let mut sock = sock;
    let mut out = std::io::stdout().lock();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match sock.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if out.write_all(&buf[..n]).and_then(|()| out.flush()).is_err() {
                    break;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                log!("vsock {cid}:{port}: {e}");
                return 1;
            }
        }
    }
    // The stdin thread may be blocked reading; the peer is done, so are we.
    drop(sender);
    0
}

fn main() {
    // SAFETY: getpid has no memory effects.
    let pid1 = unsafe { libc::getpid() } == 1;
    let opts = match parse_args(std::env::args().skip(1)) {
        Ok(Some(opts)) => opts,
        Ok(None) => return,
        // PID 1 must not exit (the kernel would panic): run as --init with defaults.
        Err(msg) if pid1 => {
            log!("{msg}; running as --init with the defaults");
            Options {
                init: true,
                ..Options::default()
            }
        }
        Err(msg) => {
            eprintln!("mayfly-agent: {msg}\n{USAGE}");
            std::process::exit(2);
        }
    };
    if let (Some((cid, port)), false) = (opts.connect, pid1) {
        std::process::exit(bridge(cid, port));
    }
    if opts.init {
        init::run(&|| serve_forever(&opts));
    }
    serve_forever(&opts);
}

/// Binds, retrying every second while it fails: a guest whose kernel has no vsock
/// device yet (or ever) waits quietly, saying why once rather than on every attempt.
fn bind_with_retry(addr: &ListenAddr) -> Listener {
    let mut said: Option<String> = None;
    loop {
        match Listener::bind(addr) {
            Ok(listener) => return listener,
            Err(e) => {
                let msg = e.to_string();
                if said.as_deref() != Some(msg.as_str()) {
                    log!("cannot listen on {addr}: {msg}; retrying every second");
                    said = Some(msg);
                }
                thread::sleep(Duration::from_secs(1));
            }
        }
    }
}

/// Frees a connection slot when the connection's thread ends, however it ends.
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn serve_forever(opts: &Options) {
    let cfg = Arc::new(Config {
        agent: agent_name(),
        system_changes: opts.system_changes,
        run_dir: opts.run_dir.clone(),
        hooks_dir: opts.hooks_dir.clone(),
        hook_timeout: opts.hook_timeout,
    });
    let listener = bind_with_retry(&opts.listen);
    log!("listening on {}", opts.listen);
    let active = Arc::new(AtomicUsize::new(0));
    let mut accept_error: Option<String> = None;
    loop {
        let conn = match listener.accept() {
            Ok(conn) => {
                accept_error = None;
                conn
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                // E.g. out of file descriptors: say so once and back off instead of spinning.
                let msg = e.to_string();
                if accept_error.as_deref() != Some(msg.as_str()) {
                    log!("accept failed: {msg}");
                    accept_error = Some(msg);
                }
                thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        if active.load(Ordering::SeqCst) >= opts.max_connections {
            session::refuse_busy(conn, opts.max_connections);
            continue;
        }
        active.fetch_add(1, Ordering::SeqCst);
        let slot = Slot(active.clone());
        let cfg = cfg.clone();
        let spawned = thread::Builder::new()
            .name("mayfly-conn".into())
            .spawn(move || {
                let _slot = slot;
                session::serve(conn, &cfg);
            });
        // On failure the closure is dropped with the connection and the slot: the host
        // sees the connection close and may retry.
        if let Err(e) = spawned {
            log!("cannot start a connection thread: {e}");
        }
    }
}
